//! Logical ops on truth values (any nonzero element is true): `logical_not`, `logical_and` /
//! `_or` / `_xor` (broadcasting), `any` over dimensions or the whole tensor, and
//! `_assert_async`, the check a graph keeps of a data-dependent condition.

use super::{Env, Value, flag, int, norm_dim, one, out_dtype};
use crate::elementwise::zip2;
use ndarray::Axis;
use zerosched_exec::host::{Elem, Tensor};
use zerosched_ir::{Arg, Dtype};

pub fn logical_not(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    one(bool::wrap(
        bool::get(t).mapv(|x| !x),
        out_dtype(env, Dtype::Bool),
    )?)
}

/// `any.dim(x, dim, keepdim)`, `any.dims(x, dims, keepdim)`, `any.default(x)`.
pub fn any(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let rank = t.shape().len();
    let mut dims: Vec<usize> = match env.node().args.get(1) {
        None | Some(Arg::None) => (0..rank).collect(),
        Some(Arg::List(l)) if l.is_empty() => (0..rank).collect(),
        Some(Arg::List(l)) => l
            .iter()
            .map(|a| norm_dim(int(a)?, rank))
            .collect::<Result<_, _>>()?,
        Some(a) => vec![norm_dim(int(a)?, rank)?],
    };
    if rank == 0 {
        // A 0-d tensor has no dimension to reduce (torch accepts dim 0 and -1 for it).
        dims.clear();
    }
    dims.sort_unstable();
    dims.dedup();
    let keep = flag(env.arg_or_kw(2, "keepdim"), false);
    let mut a = bool::get(t).into_owned();
    for &d in dims.iter().rev() {
        a = a.map_axis(Axis(d), |lane| lane.iter().any(|&x| x));
        if keep {
            a = a.insert_axis(Axis(d));
        }
    }
    one(bool::wrap(a, out_dtype(env, Dtype::Bool))?)
}

fn logical2(env: &Env<'_, Tensor>, f: fn(bool, bool) -> bool) -> Result<Value<Tensor>, String> {
    let a = env.tensor(env.arg(0)?)?;
    let b = env.tensor(env.arg(1)?)?;
    let r = zip2(&bool::get(a), &bool::get(b), f)?;
    one(bool::wrap(r, out_dtype(env, Dtype::Bool))?)
}

pub fn logical_and(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    logical2(env, |x, y| x && y)
}
pub fn logical_or(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    logical2(env, |x, y| x || y)
}
pub fn logical_xor(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    logical2(env, |x, y| x != y)
}

/// `_assert_async(x)` / `_assert_async.msg(x, msg)`: an error (the message, else the node's
/// name) unless the one element of `x` is true; no value.
pub fn assert_async(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    if t.numel() != 1 {
        return Err(format!(
            "_assert_async of a tensor of {} elements (one only)",
            t.numel()
        ));
    }
    if bool::get(t).iter().all(|&x| x) {
        return Ok(Value::None);
    }
    let msg = match env.node().args.get(1) {
        Some(Arg::Str(m)) => m.clone(),
        _ => format!("`{}` is false", env.node().name),
    };
    Err(format!("assertion failed: {msg}"))
}
