//! The host tensor: what inputs and downloads are, and what the CPU backend's kernels compute
//! on. An n-d ndarray (shared, copy-on-write storage) of one of four element kinds, tagged
//! with the logical dtype.
//!
//! Floating dtypes: `float64` is computed in f64; `float32`, `bfloat16` and `float16` in f32.
//! A bf16/f16 tensor holds f32 values that are exactly representable in its dtype: every
//! kernel's result is rounded to the dtype (round to nearest, ties to even, as `half` and
//! torch's CPU kernels round) when it is stored, so bf16 arithmetic is "f32 inside a kernel,
//! rounded once per op". Integer dtypes are held as i64, `bool` as bool.
//!
//! The graphs are functional (AOT graphs have no in-place ops), so a view op may return a copy
//! or a shared view alike; the executor core tracks storage by alias class, not by buffer.

use ndarray::{ArcArray, ArrayD, IxDyn};
use rayon::prelude::*;
use zerosched_ir::Dtype;

pub type Arr<T> = ArcArray<T, IxDyn>;

#[derive(Clone, Debug)]
pub enum Data {
    F32(Arr<f32>),
    F64(Arr<f64>),
    I64(Arr<i64>),
    Bool(Arr<bool>),
}

#[derive(Clone, Debug)]
pub struct Tensor {
    pub dtype: Dtype,
    pub data: Data,
}

/// How a dtype is held and computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    F32,
    F64,
    I64,
    Bool,
}

pub fn kind(d: Dtype) -> Result<Kind, String> {
    Ok(match d {
        Dtype::Float64 => Kind::F64,
        Dtype::Float32 | Dtype::BFloat16 | Dtype::Float16 => Kind::F32,
        Dtype::Int64
        | Dtype::Int32
        | Dtype::Int16
        | Dtype::Int8
        | Dtype::UInt8
        | Dtype::UInt16
        | Dtype::UInt32
        | Dtype::UInt64 => Kind::I64,
        Dtype::Bool => Kind::Bool,
        other => return Err(format!("dtype {other} is not supported by the CPU backend")),
    })
}

/// Rounds an f32 to what `d` can hold (identity for f32).
#[inline]
pub fn round_to(d: Dtype, x: f32) -> f32 {
    match d {
        Dtype::BFloat16 => half::bf16::from_f32(x).to_f32(),
        Dtype::Float16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Elements per block of a [`Tensor::checksum`].
pub const CHECKSUM_BLOCK: usize = 1 << 16;

/// The elements in row-major order: borrowed when the array is laid out so, else copied.
pub fn row_major<T: Clone>(a: &Arr<T>) -> std::borrow::Cow<'_, [T]> {
    match a.as_slice() {
        Some(s) => std::borrow::Cow::Borrowed(s),
        None => std::borrow::Cow::Owned(a.iter().cloned().collect()),
    }
}

/// Element types the kernels are written over.
pub trait Elem: Copy + Clone + Send + Sync + PartialOrd + std::fmt::Debug + 'static {
    /// The tensor's elements converted to this type (no copy if already held so).
    fn get(t: &Tensor) -> Arr<Self>;
    /// Wraps computed elements as a tensor of `dtype`, rounding/converting as it must.
    fn wrap(a: ArrayD<Self>, dtype: Dtype) -> Result<Tensor, String>;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn elem_zero() -> Self;
}

fn conv<A: Copy, B: Clone>(a: &Arr<A>, f: impl Fn(A) -> B) -> Arr<B> {
    a.mapv(f).into_shared()
}

impl Elem for f32 {
    fn get(t: &Tensor) -> Arr<f32> {
        match &t.data {
            Data::F32(a) => a.clone(),
            Data::F64(a) => conv(a, |x| x as f32),
            Data::I64(a) => conv(a, |x| x as f32),
            Data::Bool(a) => conv(a, |x| f32::from(u8::from(x))),
        }
    }
    fn wrap(a: ArrayD<f32>, dtype: Dtype) -> Result<Tensor, String> {
        Ok(match kind(dtype)? {
            Kind::F32 => Tensor {
                dtype,
                data: Data::F32(if dtype == Dtype::Float32 {
                    a.into_shared()
                } else {
                    a.mapv(|x| round_to(dtype, x)).into_shared()
                }),
            },
            Kind::F64 => Tensor {
                dtype,
                data: Data::F64(a.mapv(f64::from).into_shared()),
            },
            Kind::I64 => Tensor {
                dtype,
                data: Data::I64(a.mapv(|x| x as i64).into_shared()),
            },
            Kind::Bool => Tensor {
                dtype,
                data: Data::Bool(a.mapv(|x| x != 0.0).into_shared()),
            },
        })
    }
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn elem_zero() -> f32 {
        0.0
    }
}

impl Elem for f64 {
    fn get(t: &Tensor) -> Arr<f64> {
        match &t.data {
            Data::F32(a) => conv(a, f64::from),
            Data::F64(a) => a.clone(),
            Data::I64(a) => conv(a, |x| x as f64),
            Data::Bool(a) => conv(a, |x| f64::from(u8::from(x))),
        }
    }
    fn wrap(a: ArrayD<f64>, dtype: Dtype) -> Result<Tensor, String> {
        Tensor::from_f64_kind(a, dtype)
    }
    fn from_f64(x: f64) -> f64 {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn elem_zero() -> f64 {
        0.0
    }
}

impl Elem for i64 {
    fn get(t: &Tensor) -> Arr<i64> {
        match &t.data {
            Data::F32(a) => conv(a, |x| x as i64),
            Data::F64(a) => conv(a, |x| x as i64),
            Data::I64(a) => a.clone(),
            Data::Bool(a) => conv(a, i64::from),
        }
    }
    fn wrap(a: ArrayD<i64>, dtype: Dtype) -> Result<Tensor, String> {
        Ok(match kind(dtype)? {
            Kind::I64 => Tensor {
                dtype,
                data: Data::I64(a.into_shared()),
            },
            Kind::Bool => Tensor {
                dtype,
                data: Data::Bool(a.mapv(|x| x != 0).into_shared()),
            },
            Kind::F32 => Tensor {
                dtype,
                data: Data::F32(a.mapv(|x| round_to(dtype, x as f32)).into_shared()),
            },
            Kind::F64 => Tensor {
                dtype,
                data: Data::F64(a.mapv(|x| x as f64).into_shared()),
            },
        })
    }
    fn from_f64(x: f64) -> i64 {
        x as i64
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn elem_zero() -> i64 {
        0
    }
}

impl Elem for bool {
    fn get(t: &Tensor) -> Arr<bool> {
        match &t.data {
            Data::F32(a) => conv(a, |x| x != 0.0),
            Data::F64(a) => conv(a, |x| x != 0.0),
            Data::I64(a) => conv(a, |x| x != 0),
            Data::Bool(a) => a.clone(),
        }
    }
    fn wrap(a: ArrayD<bool>, dtype: Dtype) -> Result<Tensor, String> {
        i64::wrap(a.mapv(i64::from), dtype)
    }
    fn from_f64(x: f64) -> bool {
        x != 0.0
    }
    fn to_f64(self) -> f64 {
        f64::from(u8::from(self))
    }
    fn elem_zero() -> bool {
        false
    }
}

impl Tensor {
    fn from_f64_kind(a: ArrayD<f64>, dtype: Dtype) -> Result<Tensor, String> {
        Ok(match kind(dtype)? {
            Kind::F64 => Tensor {
                dtype,
                data: Data::F64(a.into_shared()),
            },
            Kind::F32 => Tensor {
                dtype,
                data: Data::F32(a.mapv(|x| round_to(dtype, x as f32)).into_shared()),
            },
            Kind::I64 => Tensor {
                dtype,
                data: Data::I64(a.mapv(|x| x as i64).into_shared()),
            },
            Kind::Bool => Tensor {
                dtype,
                data: Data::Bool(a.mapv(|x| x != 0.0).into_shared()),
            },
        })
    }

    pub fn shape(&self) -> &[usize] {
        match &self.data {
            Data::F32(a) => a.shape(),
            Data::F64(a) => a.shape(),
            Data::I64(a) => a.shape(),
            Data::Bool(a) => a.shape(),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape().iter().product()
    }

    /// Bytes the tensor's dtype takes for its elements.
    pub fn nbytes(&self) -> u64 {
        self.numel() as u64 * self.dtype.size()
    }

    pub fn kind(&self) -> Kind {
        match self.data {
            Data::F32(_) => Kind::F32,
            Data::F64(_) => Kind::F64,
            Data::I64(_) => Kind::I64,
            Data::Bool(_) => Kind::Bool,
        }
    }

    /// Converts to another dtype (a copy; the same tensor when the dtype is equal).
    pub fn cast(&self, dtype: Dtype) -> Result<Tensor, String> {
        if dtype == self.dtype {
            return Ok(self.clone());
        }
        match self.kind() {
            Kind::F32 => f32::wrap(f32::get(self).into_owned(), dtype),
            Kind::F64 => f64::wrap(f64::get(self).into_owned(), dtype),
            Kind::I64 => i64::wrap(i64::get(self).into_owned(), dtype),
            Kind::Bool => bool::wrap(bool::get(self).into_owned(), dtype),
        }
    }

    /// A scalar (0-d) tensor.
    pub fn scalar(x: f64, dtype: Dtype) -> Result<Tensor, String> {
        Tensor::from_f64_kind(ArrayD::from_elem(IxDyn(&[]), x), dtype)
    }

    /// Every element as f64, in row-major order (for checksums and comparisons).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        f64::get(self).iter().copied().collect()
    }

    /// The elements' bit patterns in row-major order, as the dtype stores them (f32 values of
    /// bf16/f16 tensors are exact, so their f32 bits identify them).
    pub fn bits(&self) -> Vec<u64> {
        match &self.data {
            Data::F32(a) => a.iter().map(|x| u64::from(x.to_bits())).collect(),
            Data::F64(a) => a.iter().map(|x| x.to_bits()).collect(),
            Data::I64(a) => a.iter().map(|&x| x as u64).collect(),
            Data::Bool(a) => a.iter().map(|&x| u64::from(x)).collect(),
        }
    }

    /// Same dtype, shape and bits.
    pub fn bitwise_eq(&self, other: &Tensor) -> bool {
        self.dtype == other.dtype && self.shape() == other.shape() && self.bits() == other.bits()
    }

    /// Largest absolute elementwise difference (NaN-aware: NaN where exactly one is NaN).
    pub fn max_abs_diff(&self, other: &Tensor) -> f64 {
        if self.shape() != other.shape() {
            return f64::INFINITY;
        }
        self.to_f64_vec()
            .iter()
            .zip(other.to_f64_vec())
            .map(|(&a, b)| {
                if a.to_bits() == b.to_bits() || a == b {
                    0.0
                } else {
                    (a - b).abs()
                }
            })
            .fold(0.0, |m: f64, d| if d.is_nan() || d > m { d } else { m })
    }

    /// A checksum that is stable across machines: the sum of elements in f64, and the sum of
    /// absolute values, each over blocks of [`CHECKSUM_BLOCK`] elements in row-major order and
    /// then over the blocks in order, so that the figure does not depend on the host's cores.
    pub fn checksum(&self) -> (f64, f64) {
        fn sums<T: Copy + Sync>(v: &[T], f: impl Fn(T) -> f64 + Sync) -> (f64, f64) {
            let blocks: Vec<(f64, f64)> = v
                .par_chunks(CHECKSUM_BLOCK)
                .map(|c| {
                    c.iter().fold((0.0, 0.0), |(s, a), &x| {
                        let x = f(x);
                        (s + x, a + x.abs())
                    })
                })
                .collect();
            blocks
                .iter()
                .fold((0.0, 0.0), |(s, a), &(bs, ba)| (s + bs, a + ba))
        }
        match &self.data {
            Data::F32(a) => sums(&row_major(a), f64::from),
            Data::F64(a) => sums(&row_major(a), |x| x),
            Data::I64(a) => sums(&row_major(a), |x| x as f64),
            Data::Bool(a) => sums(&row_major(a), |x| f64::from(u8::from(x))),
        }
    }

    /// The same elements reshaped (row-major), copying only when the layout needs it.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor, String> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(format!(
                "cannot view {:?} ({} elements) as {shape:?}",
                self.shape(),
                self.numel()
            ));
        }
        fn go<T: Clone>(a: &Arr<T>, shape: &[usize]) -> Arr<T> {
            if a.is_standard_layout() {
                if let Ok(v) = a.clone().into_shape_with_order(IxDyn(shape)) {
                    return v;
                }
            }
            let flat: Vec<T> = a.iter().cloned().collect();
            ArrayD::from_shape_vec(IxDyn(shape), flat)
                .map(ArrayD::into_shared)
                .unwrap_or_else(|_| a.clone())
        }
        Ok(Tensor {
            dtype: self.dtype,
            data: match &self.data {
                Data::F32(a) => Data::F32(go(a, shape)),
                Data::F64(a) => Data::F64(go(a, shape)),
                Data::I64(a) => Data::I64(go(a, shape)),
                Data::Bool(a) => Data::Bool(go(a, shape)),
            },
        })
    }
}

/// Applies a generic expression to the tensor's array, whatever its kind:
/// `map_data!(t, a => expr)` where `a: &Arr<T>` and `expr: Arr<T>`.
#[macro_export]
macro_rules! map_data {
    ($t:expr, $a:ident => $e:expr) => {{
        let t: &$crate::host::Tensor = $t;
        use $crate::host::Data;
        $crate::host::Tensor {
            dtype: t.dtype,
            data: match &t.data {
                Data::F32($a) => Data::F32($e),
                Data::F64($a) => Data::F64($e),
                Data::I64($a) => Data::I64($e),
                Data::Bool($a) => Data::Bool($e),
            },
        }
    }};
}
pub use crate::map_data;
