//! The floating element types the composite-op kernels are written over once, and the
//! dispatch from a dtype to one of them.

use zerosched_exec::host::Elem;

pub(crate) trait Real:
    num_traits::Float + Elem + std::iter::Sum + std::ops::AddAssign + Default
{
    fn erf(self) -> Self;
    fn c(x: f64) -> Self {
        <Self as Elem>::from_f64(x)
    }
}

impl Real for f32 {
    fn erf(self) -> f32 {
        libm::erff(self)
    }
}

impl Real for f64 {
    fn erf(self) -> f64 {
        libm::erf(self)
    }
}

/// `by_real!(dtype, T => expr)`: `expr` with `T` the dtype's compute type (f32 or f64); an
/// error naming `what` for other dtypes.
macro_rules! by_real {
    ($dt:expr, $what:expr, $T:ident => $e:expr) => {
        match zerosched_exec::host::kind($dt)? {
            zerosched_exec::host::Kind::F64 => {
                type $T = f64;
                $e
            }
            zerosched_exec::host::Kind::F32 => {
                type $T = f32;
                $e
            }
            k => Err(format!("`{}` of a {k:?} tensor", $what)),
        }
    };
}
pub(crate) use by_real;
