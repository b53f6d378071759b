//! Layer norm: `native_layer_norm` (output, mean, rstd), `layer_norm` (the output alone) and
//! `native_layer_norm_backward`, on the row kernels of [`crate::kernels::rows`].

use super::{CudaTensor, Env, Temps, Value, dense};
use crate::backend::{Cuda, ints, number};
use zerosched_ir::{Arg, Dtype};

fn optional<'a>(
    env: &Env<'a, CudaTensor>,
    i: usize,
    kw: &str,
) -> Result<Option<&'a CudaTensor>, String> {
    match env.arg_or_kw(i, kw) {
        Some(a @ Arg::Node(_)) => env.tensor(a).map(Some),
        _ => Ok(None),
    }
}

fn out_dt(env: &Env<'_, CudaTensor>, k: usize, fallback: Dtype) -> Dtype {
    env.out_meta_k(k).map_or(fallback, |m| m.dtype)
}

/// `(x, normalized_shape, weight, bias, eps)`: `full` returns mean and rstd as well.
pub fn layer_norm(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    full: bool,
) -> Result<Value<CudaTensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let norm = ints(env.arg(1)?)?;
    let n: usize = norm.iter().map(|&d| d.max(0) as usize).product();
    if norm.len() > x.shape.len() || n == 0 {
        return Err(format!("layer norm of {:?} over {norm:?}", x.shape));
    }
    let (w, b) = (optional(env, 2, "weight")?, optional(env, 3, "bias")?);
    let eps = env.arg_or_kw(4, "eps").and_then(number).unwrap_or(1e-5);
    let rows = x.numel() / n;
    let dt = if full {
        out_dt(env, 0, x.dtype)
    } else {
        env.out_meta().map_or(x.dtype, |m| m.dtype)
    };
    let mut temps = Temps(vec![]);
    let res = (|| {
        let xc = dense(c, x, dt, &mut temps)?;
        let wc = w.map(|w| dense(c, w, dt, &mut temps)).transpose()?;
        let bc = b.map(|b| dense(c, b, dt, &mut temps)).transpose()?;
        let keep = x.shape.len() - norm.len();
        let mut stat_shape = x.shape[..keep].to_vec();
        stat_shape.extend(std::iter::repeat_n(1, norm.len()));
        let y = c.empty(dt, &x.shape.clone())?;
        let mean = c.empty(Dtype::Float32, &stat_shape)?;
        let rstd = c.empty(Dtype::Float32, &stat_shape)?;
        let ptr = |t: Option<CudaTensor>| t.map_or(0, |t| t.block.ptr);
        let r =
            c.k.layer_norm(
                [
                    y.block.ptr,
                    mean.block.ptr,
                    rstd.block.ptr,
                    xc.block.ptr,
                    ptr(wc),
                    ptr(bc),
                ],
                xc.elem()?,
                rows,
                n,
                eps as f32,
            )
            .map_err(|e| e.to_string());
        if let Err(e) = r {
            for t in [&y, &mean, &rstd] {
                c.release(t);
            }
            return Err(e);
        }
        if !full {
            c.release(&mean);
            c.release(&rstd);
            return Ok(Value::Tensor(y));
        }
        let mut outs = vec![Some(y)];
        for (k, s) in [(1, mean), (2, rstd)] {
            let want = out_dt(env, k, Dtype::Float32);
            if want == Dtype::Float32 {
                outs.push(Some(s));
            } else {
                let cast = c.ew("copy", &[&s], want, 0.0);
                c.release(&s);
                outs.push(Some(cast?));
            }
        }
        Ok(Value::List(outs))
    })();
    temps.release(c);
    res
}

/// `native_layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight, bias, mask)`.
pub fn layer_norm_backward(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
) -> Result<Value<CudaTensor>, String> {
    let (dy, x) = (env.tensor(env.arg(0)?)?, env.tensor(env.arg(1)?)?);
    let norm = ints(env.arg(2)?)?;
    let n: usize = norm.iter().map(|&d| d.max(0) as usize).product();
    let (mean, rstd) = (env.tensor(env.arg(3)?)?, env.tensor(env.arg(4)?)?);
    let w = optional(env, 5, "weight")?;
    let has_b = matches!(env.arg_or_kw(6, "bias"), Some(Arg::Node(_)));
    let mask: Vec<bool> = match env.arg_or_kw(7, "output_mask") {
        Some(Arg::List(l)) => l.iter().map(|a| matches!(a, Arg::Bool(true))).collect(),
        _ => vec![true; 3],
    };
    let want = |k: usize| mask.get(k).copied().unwrap_or(true);
    if n == 0 || x.numel() % n != 0 || dy.shape != x.shape {
        return Err(format!(
            "layer norm backward of {:?} (gradient {:?}) over {norm:?}",
            x.shape, dy.shape
        ));
    }
    let rows = x.numel() / n;
    if mean.numel() != rows || rstd.numel() != rows {
        return Err(format!(
            "layer norm backward: statistics of {:?} for {rows} rows",
            mean.shape
        ));
    }
    let dt = out_dt(env, 0, x.dtype);
    let mut temps = Temps(vec![]);
    let mut made: Vec<CudaTensor> = vec![];
    let res = (|| {
        let xc = dense(c, x, dt, &mut temps)?;
        let dyc = dense(c, dy, dt, &mut temps)?;
        let mc = dense(c, mean, Dtype::Float32, &mut temps)?;
        let rc = dense(c, rstd, Dtype::Float32, &mut temps)?;
        let wc = w.map(|w| dense(c, w, dt, &mut temps)).transpose()?;
        let norm_shape: Vec<usize> = norm.iter().map(|&d| d.max(0) as usize).collect();
        let mut alloc =
            |c: &mut Cuda, on: bool, shape: &[usize]| -> Result<Option<CudaTensor>, String> {
                if !on {
                    return Ok(None);
                }
                let t = c.empty(dt, shape)?;
                made.push(t.clone());
                Ok(Some(t))
            };
        let dx = alloc(c, want(0), &x.shape.clone())?;
        let dw = alloc(c, want(1) && w.is_some(), &norm_shape)?;
        let db = alloc(c, want(2) && has_b, &norm_shape)?;
        let ptr = |t: &Option<CudaTensor>| t.as_ref().map_or(0, |t| t.block.ptr);
        c.k.layer_norm_backward(
            [
                ptr(&dx),
                ptr(&dw),
                ptr(&db),
                dyc.block.ptr,
                xc.block.ptr,
                mc.block.ptr,
                rc.block.ptr,
                ptr(&wc),
            ],
            xc.elem()?,
            rows,
            n,
        )
        .map_err(|e| e.to_string())?;
        Ok(Value::List(vec![dx, dw, db]))
    })();
    temps.release(c);
    if res.is_err() {
        for t in &made {
            c.release(t);
        }
    }
    res
}
