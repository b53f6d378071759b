//! Ops that write a region of a tensor: `slice_scatter`, `select_scatter`, their backward
//! forms `slice_backward` and `select_backward` (into zeros), `constant_pad_nd`, `copy`,
//! `fill` and `masked_fill`. Each is a copy of the base (or a fill) and one elementwise copy
//! into a strided view of the result.

use super::create::sizes;
use super::{CudaTensor, Env, Value};
use crate::backend::{Cuda, int, ints, norm_dim, number, one, out_dtype, tensor};
use zerosched_ir::{Arg, NodeId};

/// The view `x[.., start:end:step, ..]` on dimension `d` (bounds clamped as Python's).
pub fn slice_view(
    x: &CudaTensor,
    d: usize,
    start: Option<i64>,
    end: Option<i64>,
    step: i64,
) -> Result<CudaTensor, String> {
    if step < 1 {
        return Err(format!("slice step {step}"));
    }
    let n = *x.shape.get(d).ok_or("slice of a missing dimension")? as i64;
    let bound = |v: Option<i64>, default: i64| {
        let v = v.unwrap_or(default);
        (if v < 0 { v + n } else { v }).clamp(0, n)
    };
    let start = bound(start, 0);
    let end = bound(end, n).max(start);
    let (mut shape, mut strides) = (x.shape.clone(), x.strides.clone());
    shape[d] = ((end - start) as usize).div_ceil(step as usize);
    let offset = x.offset + start * strides[d];
    strides[d] *= step;
    Ok(x.restride(shape, strides, offset))
}

/// The view `x.select(d, i)`.
pub fn select_view(x: &CudaTensor, d: usize, i: i64) -> Result<CudaTensor, String> {
    let n = *x.shape.get(d).ok_or("select of a missing dimension")? as i64;
    let i = if i < 0 { i + n } else { i };
    if !(0..n).contains(&i) {
        return Err(format!("select index {i} of a dimension of {n}"));
    }
    let (mut shape, mut strides) = (x.shape.clone(), x.strides.clone());
    let offset = x.offset + i * strides[d];
    shape.remove(d);
    strides.remove(d);
    Ok(x.restride(shape, strides, offset))
}

/// An optional integer argument (`None` when absent or `None`).
pub fn opt_int(a: Option<&Arg<NodeId>>) -> Result<Option<i64>, String> {
    match a {
        None | Some(Arg::None) => Ok(None),
        Some(a) => int(a).map(Some),
    }
}

/// `base` copied, then `src` written into `region(copy)`.
fn write_region(
    c: &mut Cuda,
    base: Option<&CudaTensor>,
    zeros: Option<(&[usize], zerosched_ir::Dtype)>,
    src: &CudaTensor,
    region: impl FnOnce(&CudaTensor) -> Result<CudaTensor, String>,
) -> Result<CudaTensor, String> {
    let out = match (base, zeros) {
        (Some(b), _) => c.ew("copy", &[b], b.dtype, 0.0)?,
        (None, Some((shape, dt))) => c.full(dt, shape, 0.0)?,
        (None, None) => return Err("a region write without a base".into()),
    };
    let res = region(&out).and_then(|view| {
        if view.shape != src.shape {
            return Err(format!(
                "writing {:?} into a region of {:?}",
                src.shape, view.shape
            ));
        }
        c.ew_into("copy", &[src], &view, 0.0)
    });
    if let Err(e) = res {
        c.release(&out);
        return Err(e);
    }
    Ok(out)
}

/// `slice_scatter(base, src, dim=0, start=None, end=None, step=1)`.
pub fn slice_scatter(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let (base, src) = (tensor(env, 0)?, tensor(env, 1)?);
    let d = norm_dim(
        opt_int(env.arg_or_kw(2, "dim"))?.unwrap_or(0),
        base.shape.len(),
    )?;
    let start = opt_int(env.arg_or_kw(3, "start"))?;
    let end = opt_int(env.arg_or_kw(4, "end"))?;
    let step = opt_int(env.arg_or_kw(5, "step"))?.unwrap_or(1);
    one(write_region(c, Some(base), None, src, |o| {
        slice_view(o, d, start, end, step)
    })?)
}

/// `select_scatter(base, src, dim, index)`.
pub fn select_scatter(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
) -> Result<Value<CudaTensor>, String> {
    let (base, src) = (tensor(env, 0)?, tensor(env, 1)?);
    let d = norm_dim(int(env.arg(2)?)?, base.shape.len())?;
    let i = int(env.arg(3)?)?;
    one(write_region(c, Some(base), None, src, |o| {
        select_view(o, d, i)
    })?)
}

/// `slice_backward(grad, input_sizes, dim, start, end, step)`: zeros with `grad` in the slice.
pub fn slice_backward(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
) -> Result<Value<CudaTensor>, String> {
    let g = tensor(env, 0)?;
    let shape = sizes(env.arg(1)?)?;
    let d = norm_dim(int(env.arg(2)?)?, shape.len())?;
    let (start, end) = (opt_int(env.arg(3).ok())?, opt_int(env.arg(4).ok())?);
    let step = opt_int(env.arg(5).ok())?.unwrap_or(1);
    let dt = out_dtype(env, g.dtype);
    one(write_region(c, None, Some((&shape, dt)), g, |o| {
        slice_view(o, d, start, end, step)
    })?)
}

/// `select_backward(grad, input_sizes, dim, index)`.
pub fn select_backward(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
) -> Result<Value<CudaTensor>, String> {
    let g = tensor(env, 0)?;
    let shape = sizes(env.arg(1)?)?;
    let d = norm_dim(int(env.arg(2)?)?, shape.len())?;
    let i = int(env.arg(3)?)?;
    let dt = out_dtype(env, g.dtype);
    one(write_region(c, None, Some((&shape, dt)), g, |o| {
        select_view(o, d, i)
    })?)
}

/// Of one dimension of a padding: the input's start and length kept, and where they land.
pub type Kept = (usize, usize, usize);

/// The output shape of `constant_pad_nd` and, per dimension, the input range kept and where
/// it lands: pads are `(before, after)` pairs from the last dimension backwards; negative pads
/// crop.
pub fn pad_plan(shape: &[usize], pad: &[i64]) -> Result<(Vec<usize>, Vec<Kept>), String> {
    if pad.len() % 2 != 0 || pad.len() / 2 > shape.len() {
        return Err(format!("padding {pad:?} of a {}-d tensor", shape.len()));
    }
    let mut out = shape.to_vec();
    // (input start, length, output start) per dimension.
    let mut keep: Vec<Kept> = shape.iter().map(|&n| (0, n, 0)).collect();
    for (k, p) in pad.chunks(2).enumerate() {
        let d = shape.len() - 1 - k;
        let n = shape[d] as i64;
        let (lo, hi) = (p[0], p[1]);
        let len = n + lo + hi;
        if len < 0 {
            return Err(format!("padding {pad:?} leaves dimension {d} negative"));
        }
        out[d] = len as usize;
        let in_start = (-lo).max(0);
        let in_end = (n + hi.min(0)).max(in_start);
        keep[d] = (
            in_start as usize,
            (in_end - in_start) as usize,
            lo.max(0) as usize,
        );
    }
    Ok((out, keep))
}

/// `constant_pad_nd(x, pad, value=0)`.
pub fn constant_pad_nd(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let pad = ints(env.arg(1)?)?;
    let v = env.arg_or_kw(2, "value").and_then(number).unwrap_or(0.0);
    let (shape, keep) = pad_plan(&x.shape, &pad)?;
    let dt = out_dtype(env, x.dtype);
    let out = c.full(dt, &shape, v)?;
    let (mut src, mut dst) = (x.clone(), out.clone());
    for (d, &(from, len, to)) in keep.iter().enumerate() {
        src = slice_view(&src, d, Some(from as i64), Some((from + len) as i64), 1)?;
        dst = slice_view(&dst, d, Some(to as i64), Some((to + len) as i64), 1)?;
    }
    if let Err(e) = c.ew_into("copy", &[&src], &dst, 0.0) {
        c.release(&out);
        return Err(e);
    }
    one(out)
}

/// `copy(self, src)`: `src` broadcast to `self`'s shape, in `self`'s dtype.
pub fn copy(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let (x, src) = (tensor(env, 0)?, tensor(env, 1)?);
    let out = c.empty(out_dtype(env, x.dtype), &x.shape.clone())?;
    if let Err(e) = c.ew_into("copy", &[src], &out, 0.0) {
        c.release(&out);
        return Err(e);
    }
    one(out)
}

/// `fill(self, value)`: a number, or a 0-d tensor broadcast.
pub fn fill(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let dt = out_dtype(env, x.dtype);
    let v = env.arg(1)?;
    if v.as_node().is_none() {
        let n = number(v).ok_or_else(|| format!("fill value {v:?}"))?;
        return one(c.full(dt, &x.shape.clone(), n)?);
    }
    let t = env.tensor(v)?;
    let out = c.empty(dt, &x.shape.clone())?;
    if let Err(e) = c.ew_into("copy", &[t], &out, 0.0) {
        c.release(&out);
        return Err(e);
    }
    one(out)
}

/// `masked_fill(self, mask, value)`: a number (`.Scalar`) or a 0-d tensor (`.Tensor`).
pub fn masked_fill(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let (x, mask) = (tensor(env, 0)?, tensor(env, 1)?);
    let dt = out_dtype(env, x.dtype);
    let v = env.arg(2)?;
    if v.as_node().is_none() {
        let n = number(v).ok_or_else(|| format!("masked_fill value {v:?}"))?;
        return one(c.ew("masked_fill", &[x, mask], dt, n)?);
    }
    let t = env.tensor(v)?;
    one(c.ew("where", &[mask, t, x], dt, 0.0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_grow_from_the_last_dimension_and_negative_pads_crop() {
        let (shape, keep) = pad_plan(&[2, 16], &[0, 1]).unwrap();
        assert_eq!(shape, vec![2, 17], "gpt2's label shift");
        assert_eq!(keep, vec![(0, 2, 0), (0, 16, 0)]);
        let (shape, keep) = pad_plan(&[3, 4, 5], &[1, -2, -1, 2]).unwrap();
        assert_eq!(shape, vec![3, 5, 4]);
        assert_eq!(keep[2], (0, 3, 1), "last dim: 1 before, 2 cropped after");
        assert_eq!(keep[1], (1, 3, 0), "middle dim: 1 cropped before, 2 after");
        assert!(pad_plan(&[2], &[1]).is_err());
        assert!(pad_plan(&[2], &[-2, -1]).is_err());
    }
}
