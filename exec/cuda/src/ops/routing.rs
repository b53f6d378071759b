//! The routing ops of mixture-of-experts layers: `cumsum`, `sort`, `topk` and `histc`, on the
//! row kernels of [`crate::kernels::rows`].

use super::{CudaTensor, Env, Temps, Value, dense};
use crate::backend::{Cuda, elem, gather_dims_last, int, norm_dim, number, one, out_dtype, tensor};
use crate::kernels::source::Elem;
use zerosched_ir::{Arg, Dtype, NodeId};

/// A boolean argument, `default` when absent.
fn bool_arg(a: Option<&Arg<NodeId>>, default: bool) -> bool {
    match a {
        Some(Arg::Bool(b)) => *b,
        _ => default,
    }
}

/// `cumsum(x, dim)`, in the output's dtype.
pub fn cumsum(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let d = norm_dim(int(env.arg(1)?)?, x.shape.len())?;
    let dt = out_dtype(env, x.dtype);
    let mut temps = Temps(vec![]);
    let res = (|| {
        let xc = dense(c, x, x.dtype, &mut temps)?;
        let out = c.empty(dt, &x.shape.clone())?;
        let outer: usize = x.shape[..d.min(x.shape.len())].iter().product();
        let r = x.shape.get(d).copied().unwrap_or(1);
        let inner: usize = x.shape.get(d + 1..).map_or(1, |s| s.iter().product());
        match c.k.cumsum(
            out.block.ptr,
            xc.block.ptr,
            [xc.elem()?, elem(dt)?],
            [outer, r, inner],
        ) {
            Ok(()) => Ok(out),
            Err(e) => {
                c.release(&out);
                Err(e.to_string())
            }
        }
    })();
    temps.release(c);
    one(res?)
}

/// The `k` first of `x` along `d` in sorted order: values (in `vd`) and i64 indices.
fn sorted(
    c: &mut Cuda,
    x: &CudaTensor,
    d: usize,
    k: usize,
    descending: bool,
    vd: Dtype,
) -> Result<Value<CudaTensor>, String> {
    let rank = x.shape.len();
    if rank == 0 {
        let v = c.ew("copy", &[x], vd, 0.0)?;
        let i = c.full(Dtype::Int64, &[], 0.0)?;
        return Ok(Value::List(vec![Some(v), Some(i)]));
    }
    let (t, temp, kept, n) = gather_dims_last(c, x, &[d])?;
    let rows: usize = kept.iter().product();
    let mut moved = kept.clone();
    moved.push(k);
    let res = (|| {
        let vals = c.empty(x.dtype, &moved)?;
        let idx = match c.empty(Dtype::Int64, &moved) {
            Ok(i) => i,
            Err(e) => {
                c.release(&vals);
                return Err(e);
            }
        };
        let r =
            c.k.sort(
                vals.block.ptr,
                idx.block.ptr,
                t.block.ptr,
                t.elem()?,
                rows,
                n,
                k,
                descending,
            )
            .map_err(|e| e.to_string());
        if let Err(e) = r {
            c.release(&vals);
            c.release(&idx);
            return Err(e);
        }
        Ok((vals, idx))
    })();
    if temp {
        c.release(&t);
    }
    let (vals, idx) = res?;
    // Back to the input's dimension order, and the values to their dtype.
    let mut order: Vec<usize> = (0..rank - 1).collect();
    order.insert(d, rank - 1);
    let back = |t: &CudaTensor| {
        t.restride(
            order.iter().map(|&i| t.shape[i]).collect(),
            order.iter().map(|&i| t.strides[i]).collect(),
            0,
        )
    };
    let mut outs = vec![];
    for (t, dt) in [(vals, vd), (idx, Dtype::Int64)] {
        if d + 1 == rank && t.dtype == dt {
            outs.push(Some(t));
            continue;
        }
        let r = c.ew("copy", &[&back(&t)], dt, 0.0);
        c.release(&t);
        outs.push(Some(r?));
    }
    Ok(Value::List(outs))
}

/// `sort(x, dim=-1, descending=False)` and `sort.stable(x, *, stable, dim, descending)`:
/// stable in both (the CPU backend's order).
pub fn sort(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let stable_overload = env.node().target == "aten.sort.stable";
    let (dim_at, desc_at) = if stable_overload {
        (usize::MAX, usize::MAX)
    } else {
        (1, 2)
    };
    let d = norm_dim(
        env.arg_or_kw(dim_at, "dim")
            .and_then(|a| a.as_int())
            .unwrap_or(-1),
        x.shape.len(),
    )?;
    let descending = bool_arg(env.arg_or_kw(desc_at, "descending"), false);
    let n = x.shape.get(d).copied().unwrap_or(1);
    let vd = env.out_meta_k(0).map_or(x.dtype, |m| m.dtype);
    sorted(c, x, d, n, descending, vd)
}

/// `topk(x, k, dim=-1, largest=True)`.
pub fn topk(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let k = int(env.arg(1)?)?.max(0) as usize;
    let d = norm_dim(
        env.arg_or_kw(2, "dim")
            .and_then(|a| a.as_int())
            .unwrap_or(-1),
        x.shape.len(),
    )?;
    let largest = bool_arg(env.arg_or_kw(3, "largest"), true);
    let n = x.shape.get(d).copied().unwrap_or(1);
    if k > n {
        return Err(format!("topk: k = {k} > {n}"));
    }
    let vd = env.out_meta_k(0).map_or(x.dtype, |m| m.dtype);
    sorted(c, x, d, k, largest, vd)
}

/// `histc(x, bins=100, min=0, max=0)` (a zero range is the data's: one host read).
pub fn histc(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let bins = env.arg_or_kw(1, "bins").map_or(Ok(100), int)?;
    let bins = usize::try_from(bins)
        .ok()
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("histc: bins must be > 0, got {bins}"))?;
    let lim = |i: usize, name: &str| env.arg_or_kw(i, name).and_then(number).unwrap_or(0.0);
    let (mut lo, mut hi) = (lim(2, "min"), lim(3, "max"));
    if lo > hi {
        return Err(format!("histc: max ({hi}) must be at least min ({lo})"));
    }
    if !Elem::of(x.dtype).is_some_and(Elem::is_float) {
        return Err(format!(
            "histc of a {} tensor (torch's kernel takes floats)",
            x.dtype
        ));
    }
    let dt = out_dtype(env, x.dtype);
    let mut temps = Temps(vec![]);
    let res = (|| {
        let xc = dense(c, x, x.dtype, &mut temps)?;
        if lo == hi && xc.numel() > 0 {
            let (mn, mx) = data_range(c, &xc)?;
            (lo, hi) = (mn, mx);
        }
        if lo == hi {
            lo -= 1.0;
            hi += 1.0;
        }
        let counts = c.full(Dtype::Float32, &[bins], 0.0)?;
        temps.0.push(counts.clone());
        c.k.histc(
            counts.block.ptr,
            xc.block.ptr,
            xc.elem()?,
            xc.numel(),
            bins,
            [lo as f32, hi as f32],
        )
        .map_err(|e| e.to_string())?;
        c.ew("copy", &[&counts], dt, 0.0)
    })();
    temps.release(c);
    one(res?)
}

/// The finite minimum and maximum of `x` (a host read of two reductions).
fn data_range(c: &mut Cuda, x: &CudaTensor) -> Result<(f64, f64), String> {
    use crate::kernels::source::Reduce;
    let all: Vec<usize> = (0..x.shape.len()).collect();
    let mut out = [0.0; 2];
    for (k, op) in [Reduce::Min, Reduce::Max].into_iter().enumerate() {
        let r = crate::backend::reduce_dims(c, x, &all, false, op, Dtype::Float32)?;
        let mut b = [0u8; 4];
        let got = c
            .dev
            .download(crate::device::StreamKind::Compute, r.block.ptr, &mut b)
            .map_err(|e| e.to_string());
        c.release(&r);
        got?;
        out[k] = f64::from(f32::from_le_bytes(b));
    }
    if !out[0].is_finite() || !out[1].is_finite() {
        return Err(format!(
            "histc: range of [{}, {}] is not finite",
            out[0], out[1]
        ));
    }
    Ok((out[0], out[1]))
}
