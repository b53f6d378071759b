//! Creation ops: `full`, `zeros`, `ones`, `empty` and their `_like` and `new_` forms,
//! `scalar_tensor` and `arange`, each one generated fill kernel (`empty` is zero-filled, so a
//! run is deterministic and agrees with the CPU backend).

use super::{CudaTensor, Env, Value};
use crate::backend::{Cuda, ints, number, one, tensor};
use zerosched_ir::{Arg, Dtype};

/// The output's dtype: its metadata, else the `dtype` keyword, else `fallback`.
fn dtype(env: &Env<'_, CudaTensor>, fallback: Dtype) -> Dtype {
    if let Some(m) = env.out_meta() {
        return m.dtype;
    }
    match env.node().kwargs.get("dtype") {
        Some(Arg::Dtype(d)) => *d,
        _ => fallback,
    }
}

/// A list of sizes (non-negative integers).
pub fn sizes(a: &Arg<zerosched_ir::NodeId>) -> Result<Vec<usize>, String> {
    ints(a)?
        .into_iter()
        .map(|d| usize::try_from(d).map_err(|_| format!("negative size {d}")))
        .collect()
}

fn value(a: &Arg<zerosched_ir::NodeId>) -> Result<f64, String> {
    number(a).ok_or_else(|| format!("expected a number, found {a:?}"))
}

/// `full(size, value)`, `zeros(size)`, `ones(size)`, `empty(size)`: `fill` is the value of
/// the sizeless forms, `None` for `full`'s argument 1.
pub fn sized(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    fill: Option<f64>,
) -> Result<Value<CudaTensor>, String> {
    let shape = sizes(env.arg(0)?)?;
    let x = match fill {
        Some(x) => x,
        None => value(env.arg(1)?)?,
    };
    one(c.full(dtype(env, Dtype::Float32), &shape, x)?)
}

/// `full_like(x, value)`, `zeros_like(x)`, `ones_like(x)`: `x`'s shape (and dtype by default).
pub fn like(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    fill: Option<f64>,
) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let v = match fill {
        Some(v) => v,
        None => value(env.arg(1)?)?,
    };
    one(c.full(dtype(env, x.dtype), &x.shape.clone(), v)?)
}

/// `new_zeros(x, size)`, `new_ones(x, size)`, `new_full(x, size, value)`: `x`'s dtype.
pub fn new(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    fill: Option<f64>,
) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let shape = sizes(env.arg(1)?)?;
    let v = match fill {
        Some(v) => v,
        None => value(env.arg(2)?)?,
    };
    one(c.full(dtype(env, x.dtype), &shape, v)?)
}

pub fn scalar_tensor(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let v = value(env.arg(0)?)?;
    one(c.full(dtype(env, Dtype::Float32), &[], v)?)
}

/// The number of elements of `arange(start, end, step)`.
pub fn arange_len(start: f64, end: f64, step: f64) -> Result<usize, String> {
    if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
        return Err(format!("arange({start}, {end}, {step})"));
    }
    Ok(((end - start) / step).ceil().max(0.0) as usize)
}

/// `arange(end)`, `arange(start, end)`, `arange(start, end, step)` (`start_step` also takes
/// `step` by keyword).
pub fn arange(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let n = env.node();
    let nums: Vec<f64> = n
        .args
        .iter()
        .map(|a| number(a).ok_or_else(|| format!("arange bound {a:?}")))
        .collect::<Result<_, _>>()?;
    let kw = |k: &str| n.kwargs.get(k).and_then(number);
    let (start, end, step) = match nums.as_slice() {
        [end] => (0.0, *end, kw("step").unwrap_or(1.0)),
        [start, end] => (*start, *end, kw("step").unwrap_or(1.0)),
        [start, end, step] => (*start, *end, *step),
        _ => return Err(format!("arange of {} arguments", nums.len())),
    };
    let len = arange_len(start, end, step)?;
    let integral = [start, end, step].iter().all(|v| v.fract() == 0.0);
    let dt = dtype(
        env,
        if integral {
            Dtype::Int64
        } else {
            Dtype::Float32
        },
    );
    let out = c.empty(dt, &[len])?;
    let views = out.view()?;
    let res =
        c.k.elementwise("arange", &[], &views, start, step)
            .map_err(|e| e.to_string());
    if let Err(e) = res {
        c.release(&out);
        return Err(e);
    }
    one(out)
}

/// `empty_permuted(size, physical_layout)` and `empty.memory_format(size)`: zeros (the
/// contents are unspecified; zeros keep runs deterministic).
pub fn empty(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let shape = sizes(env.arg(0)?)?;
    one(c.full(dtype(env, Dtype::Float32), &shape, 0.0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arange_lengths_round_up_and_refuse_a_zero_step() {
        assert_eq!(arange_len(0.0, 16.0, 1.0).unwrap(), 16);
        assert_eq!(arange_len(0.0, 1.0, 0.3).unwrap(), 4);
        assert_eq!(arange_len(5.0, 0.0, 1.0).unwrap(), 0);
        assert_eq!(arange_len(5.0, 0.0, -2.0).unwrap(), 3);
        assert!(arange_len(0.0, 1.0, 0.0).is_err());
    }
}
