//! Tensor factories: full, full_like, scalar_tensor, arange, empty (zero-filled, so runs are
//! reproducible). Shapes and dtypes come from the node's recorded metadata where the op's own
//! arguments leave them implicit.

use super::{Env, Value, ints, number, one, out_dtype, out_shape};
use ndarray::{ArrayD, IxDyn};
use zerosched_exec::host::Tensor;
use zerosched_ir::{Arg, Dtype};

pub(crate) fn filled(shape: &[usize], value: f64, dtype: Dtype) -> Result<Tensor, String> {
    <f64 as zerosched_exec::host::Elem>::wrap(ArrayD::from_elem(IxDyn(shape), value), dtype)
}

pub(crate) fn kw_dtype(env: &Env<'_, Tensor>, fallback: Dtype) -> Dtype {
    match env.node().kwargs.get("dtype") {
        Some(Arg::Dtype(d)) => out_dtype(env, *d),
        _ => out_dtype(env, fallback),
    }
}

pub fn full(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let shape: Vec<usize> = ints(env.arg(0)?)?
        .into_iter()
        .map(|d| d.max(0) as usize)
        .collect();
    let v = number(env.arg(1)?).ok_or("full: value is not a number")?;
    one(filled(&shape, v, kw_dtype(env, Dtype::Float32))?)
}

pub fn full_like(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let v = number(env.arg(1)?).ok_or("full_like: value is not a number")?;
    one(filled(x.shape(), v, kw_dtype(env, x.dtype))?)
}

pub fn scalar_tensor(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let v = number(env.arg(0)?).ok_or("scalar_tensor: value is not a number")?;
    one(filled(&[], v, kw_dtype(env, Dtype::Float32))?)
}

pub fn empty(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let shape = match out_shape(env) {
        Some(s) => s,
        None => ints(env.arg(0)?)?
            .into_iter()
            .map(|d| d.max(0) as usize)
            .collect(),
    };
    one(filled(&shape, 0.0, kw_dtype(env, Dtype::Float32))?)
}

/// `arange(end)`, `arange(start, end)`, `arange(start, end, step)`.
pub fn arange(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let nums: Vec<f64> = env.node().args.iter().map_while(number).collect();
    let (start, end, step) = match nums.as_slice() {
        [e] => (0.0, *e, 1.0),
        [s, e] => (*s, *e, 1.0),
        [s, e, st, ..] => (*s, *e, *st),
        [] => return Err("arange without bounds".into()),
    };
    if step == 0.0 {
        return Err("arange with step 0".into());
    }
    let n = ((end - start) / step).ceil().max(0.0) as usize;
    let v: Vec<f64> = (0..n).map(|i| start + i as f64 * step).collect();
    let a = ArrayD::from_shape_vec(IxDyn(&[n]), v).map_err(|e| e.to_string())?;
    one(<f64 as zerosched_exec::host::Elem>::wrap(
        a,
        kw_dtype(env, Dtype::Int64),
    )?)
}
