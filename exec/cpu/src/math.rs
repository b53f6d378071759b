//! Elementwise math beyond arithmetic: inverse and hyperbolic trigonometry, logarithm and
//! exponential variants, rounding (`round` to nearest even, as torch), `sign`, NaN and
//! infinity tests, `atan2`, `fmod` (the dividend's sign), `remainder` (the divisor's sign),
//! `bitwise_not` / `bitwise_xor`. Integers round to themselves; integer `fmod` / `remainder`
//! by zero is an error, as torch raises.

use super::{Env, Value, one, out_dtype};
use crate::elementwise::{operand, zip2};
use zerosched_exec::host::{Elem, Kind, Tensor, kind};
use zerosched_ir::Dtype;

macro_rules! unary {
    ($($name:ident => |$x:ident| $e:expr;)*) => {$(
        pub fn $name(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
            let t = env.tensor(env.arg(0)?)?;
            let dt = out_dtype(env, t.dtype);
            match kind(dt)? {
                Kind::F64 => one(f64::wrap(f64::get(t).mapv(|$x: f64| $e), dt)?),
                Kind::F32 => one(f32::wrap(f32::get(t).mapv(|$x: f32| $e), dt)?),
                k => Err(format!("`{}` of a {k:?} tensor", stringify!($name))),
            }
        }
    )*};
}

unary! {
    acos => |x| x.acos();
    acosh => |x| x.acosh();
    asin => |x| x.asin();
    asinh => |x| x.asinh();
    atan => |x| x.atan();
    atanh => |x| x.atanh();
    cosh => |x| x.cosh();
    sinh => |x| x.sinh();
    tan => |x| x.tan();
    expm1 => |x| x.exp_m1();
    log1p => |x| x.ln_1p();
    log10 => |x| x.log10();
    log2 => |x| x.log2();
}

/// Rounding ops: floats through `f`, integers and booleans unchanged.
fn rounding(
    env: &Env<'_, Tensor>,
    f32op: fn(f32) -> f32,
    f64op: fn(f64) -> f64,
) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let dt = out_dtype(env, t.dtype);
    one(match kind(dt)? {
        Kind::F64 => f64::wrap(f64::get(t).mapv(f64op), dt)?,
        Kind::F32 => f32::wrap(f32::get(t).mapv(f32op), dt)?,
        _ => t.cast(dt)?,
    })
}

pub fn ceil(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    rounding(env, f32::ceil, f64::ceil)
}
pub fn floor(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    rounding(env, f32::floor, f64::floor)
}
pub fn trunc(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    rounding(env, f32::trunc, f64::trunc)
}
/// `round`: halves to even, as torch (`nearbyint`).
pub fn round(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    rounding(env, f32::round_ties_even, f64::round_ties_even)
}

/// `sign(x) = (0 < x) - (x < 0)`: 0 for NaN and for zeros of either sign.
pub fn sign(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let dt = out_dtype(env, t.dtype);
    fn s<T: PartialOrd + Default>(x: T) -> i8 {
        let z = T::default();
        i8::from(z < x) - i8::from(x < z)
    }
    one(match kind(dt)? {
        Kind::F64 => f64::wrap(f64::get(t).mapv(|x| f64::from(s(x))), dt)?,
        Kind::F32 => f32::wrap(f32::get(t).mapv(|x| f32::from(s(x))), dt)?,
        Kind::I64 => i64::wrap(i64::get(t).mapv(|x| i64::from(s(x))), dt)?,
        Kind::Bool => t.cast(dt)?,
    })
}

fn test(env: &Env<'_, Tensor>, f: fn(f64) -> bool) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let r = if t.dtype.is_floating() {
        f64::get(t).mapv(f)
    } else {
        bool::get(t).mapv(|_| false)
    };
    one(bool::wrap(r, out_dtype(env, Dtype::Bool))?)
}

pub fn isnan(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    test(env, f64::is_nan)
}
pub fn isinf(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    test(env, f64::is_infinite)
}

pub fn bitwise_not(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let dt = out_dtype(env, t.dtype);
    one(match kind(dt)? {
        Kind::Bool => bool::wrap(bool::get(t).mapv(|x| !x), dt)?,
        Kind::I64 => i64::wrap(i64::get(t).mapv(|x| !x), dt)?,
        k => return Err(format!("`bitwise_not` of a {k:?} tensor")),
    })
}

/// Two operands (tensors or numbers) and the output dtype.
fn operands(env: &Env<'_, Tensor>) -> Result<(Tensor, Tensor, Dtype), String> {
    let a = operand(env, env.arg(0)?)?;
    let b = operand(env, env.arg(1)?)?;
    let fallback = if a.dtype.is_floating() || !b.dtype.is_floating() {
        a.dtype
    } else {
        b.dtype
    };
    let dt = out_dtype(env, fallback);
    Ok((a, b, dt))
}

pub fn bitwise_xor(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (a, b, dt) = operands(env)?;
    one(match kind(dt)? {
        Kind::Bool => bool::wrap(zip2(&bool::get(&a), &bool::get(&b), |x, y| x ^ y)?, dt)?,
        Kind::I64 => i64::wrap(zip2(&i64::get(&a), &i64::get(&b), |x, y| x ^ y)?, dt)?,
        k => return Err(format!("`bitwise_xor` of a {k:?} tensor")),
    })
}

pub fn atan2(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (a, b, dt) = operands(env)?;
    one(match kind(dt)? {
        Kind::F64 => f64::wrap(zip2(&f64::get(&a), &f64::get(&b), f64::atan2)?, dt)?,
        Kind::F32 => f32::wrap(zip2(&f32::get(&a), &f32::get(&b), f32::atan2)?, dt)?,
        k => return Err(format!("`atan2` of a {k:?} tensor")),
    })
}

/// `fmod` (`python` false: the dividend's sign) and `remainder` (the divisor's sign).
fn modulo(env: &Env<'_, Tensor>, python: bool) -> Result<Value<Tensor>, String> {
    let (a, b, dt) = operands(env)?;
    macro_rules! float {
        ($T:ty) => {{
            let r = zip2(&<$T>::get(&a), &<$T>::get(&b), |x: $T, y: $T| {
                let m = x % y;
                if python && m != 0.0 && (m < 0.0) != (y < 0.0) {
                    m + y
                } else {
                    m
                }
            })?;
            <$T>::wrap(r, dt)?
        }};
    }
    one(match kind(dt)? {
        Kind::F64 => float!(f64),
        Kind::F32 => float!(f32),
        _ => {
            let (x, y) = (i64::get(&a), i64::get(&b));
            if y.iter().any(|&v| v == 0) {
                return Err("integer division by zero in fmod / remainder".into());
            }
            let r = zip2(&x, &y, |p, q| {
                let m = p.wrapping_rem(q);
                if python && m != 0 && (m < 0) != (q < 0) {
                    m + q
                } else {
                    m
                }
            })?;
            i64::wrap(r, dt)?
        }
    })
}

pub fn fmod(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    modulo(env, false)
}
pub fn remainder(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    modulo(env, true)
}
