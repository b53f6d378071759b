//! The clamp family: `clamp` (number or tensor bounds, either optional), `clamp_min`,
//! `clamp_max` and `hardtanh`, in the output dtype's compute type with the bounds converted to
//! it first, as torch's kernels. Bounds broadcast with the input; a NaN input or bound gives
//! NaN; a lower bound above the upper gives the upper.

use super::{Env, Value, number, one, out_dtype};
use crate::elementwise::{operand, zip2};
use crate::real::{Real, by_real};
use zerosched_exec::host::{Arr, Elem, Kind, Tensor, kind};
use zerosched_ir::{Arg, Dtype};

/// An optional bound: None / absent, a number or a tensor.
fn bound(env: &Env<'_, Tensor>, i: usize, name: &str) -> Result<Option<Tensor>, String> {
    match env.arg_or_kw(i, name) {
        None | Some(Arg::None) => Ok(None),
        Some(a) => operand(env, a).map(Some),
    }
}

fn lower<T: Real>(x: T, l: T) -> T {
    if x.is_nan() || l.is_nan() {
        T::nan()
    } else if x < l {
        l
    } else {
        x
    }
}

fn upper<T: Real>(x: T, h: T) -> T {
    if x.is_nan() || h.is_nan() {
        T::nan()
    } else if x > h {
        h
    } else {
        x
    }
}

fn apply(
    x: &Tensor,
    lo: Option<&Tensor>,
    hi: Option<&Tensor>,
    dt: Dtype,
) -> Result<Tensor, String> {
    match kind(dt)? {
        Kind::I64 | Kind::Bool => {
            let mut r: Arr<i64> = i64::get(x);
            if let Some(l) = lo {
                r = zip2(&r, &i64::get(l), i64::max)?.into_shared();
            }
            if let Some(h) = hi {
                r = zip2(&r, &i64::get(h), i64::min)?.into_shared();
            }
            i64::wrap(r.into_owned(), dt)
        }
        _ => by_real!(dt, "clamp", T => {
            let mut r: Arr<T> = T::get(x);
            if let Some(l) = lo {
                r = zip2(&r, &T::get(l), lower)?.into_shared();
            }
            if let Some(h) = hi {
                r = zip2(&r, &T::get(h), upper)?.into_shared();
            }
            T::wrap(r.into_owned(), dt)
        }),
    }
}

fn clamp_with(
    env: &Env<'_, Tensor>,
    lo: Option<Tensor>,
    hi: Option<Tensor>,
) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    if lo.is_none() && hi.is_none() {
        return Err("clamp: neither min nor max is given".into());
    }
    let dt = out_dtype(env, x.dtype);
    one(apply(x, lo.as_ref(), hi.as_ref(), dt)?)
}

/// `clamp(x, min=None, max=None)` with numbers or tensors.
pub fn clamp(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    clamp_with(env, bound(env, 1, "min")?, bound(env, 2, "max")?)
}

pub fn clamp_min(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    clamp_with(env, bound(env, 1, "min")?, None)
}

pub fn clamp_max(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    clamp_with(env, None, bound(env, 1, "max")?)
}

/// `hardtanh(x, min_val=-1, max_val=1)`.
pub fn hardtanh(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let num = |i: usize, name: &str, d: f64| -> Result<Tensor, String> {
        let v = match env.arg_or_kw(i, name) {
            None | Some(Arg::None) => d,
            Some(a) => number(a).ok_or_else(|| format!("hardtanh: `{name}` is not a number"))?,
        };
        Tensor::scalar(v, Dtype::Float64)
    };
    clamp_with(
        env,
        Some(num(1, "min_val", -1.0)?),
        Some(num(2, "max_val", 1.0)?),
    )
}
