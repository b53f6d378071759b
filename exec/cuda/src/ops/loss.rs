//! Losses and softmax backward: `nll_loss_forward` / `nll_loss_backward` (row kernels),
//! `_softmax_backward_data` and `_log_softmax_backward_data` (an elementwise op over the
//! gradient and output with their row sum).

use super::{CudaTensor, Env, Temps, Value, dense};
use crate::backend::{Cuda, elem, int, norm_dim, one, out_dtype, reduce_dims, tensor};
use crate::kernels::source::Reduce;
use zerosched_ir::{Arg, Dtype};

/// `_softmax_backward_data(grad, out, dim, input_dtype)` (`log` false: `out * (g - Σ g·out)`)
/// or `_log_softmax_backward_data` (`g - exp(out) * Σ g`).
pub fn softmax_backward(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    log: bool,
) -> Result<Value<CudaTensor>, String> {
    let (g, y) = (tensor(env, 0)?, tensor(env, 1)?);
    if g.shape != y.shape {
        return Err(format!(
            "softmax backward: gradient {:?}, output {:?}",
            g.shape, y.shape
        ));
    }
    let d = norm_dim(int(env.arg(2)?)?, g.shape.len())?;
    let dt = out_dtype(env, g.dtype);
    // Row sums in f32, as the CPU backend accumulates.
    let sum = if log {
        reduce_dims(c, g, &[d], true, Reduce::Sum, Dtype::Float32)?
    } else {
        let prod = c.ew("mul", &[g, y], Dtype::Float32, 1.0)?;
        let s = reduce_dims(c, &prod, &[d], true, Reduce::Sum, Dtype::Float32);
        c.release(&prod);
        s?
    };
    let out = if log {
        c.ew("log_softmax_backward", &[g, y, &sum], dt, 0.0)
    } else {
        c.ew("mul_sub", &[y, g, &sum], dt, 0.0)
    };
    c.release(&sum);
    one(out?)
}

struct Nll {
    n: usize,
    classes: usize,
    reduction: i32,
    ignore: i64,
}

fn nll_args(env: &Env<'_, CudaTensor>, x: &CudaTensor, at: usize) -> Result<Nll, String> {
    let (n, classes) = match x.shape.as_slice() {
        [c] => (1, *c),
        [n, c] => (*n, *c),
        s => {
            return Err(format!(
                "nll_loss: input of shape {s:?} (only [N, C] and [C])"
            ));
        }
    };
    let reduction = int(env.arg(at + 3)?)?;
    if !(0..=2).contains(&reduction) {
        return Err(format!("nll_loss: reduction {reduction}"));
    }
    Ok(Nll {
        n,
        classes,
        reduction: reduction as i32,
        ignore: int(env.arg(at + 4)?)?,
    })
}

fn weight<'a>(env: &Env<'a, CudaTensor>, i: usize) -> Result<Option<&'a CudaTensor>, String> {
    match env.arg(i)? {
        a @ Arg::Node(_) => env.tensor(a).map(Some),
        _ => Ok(None),
    }
}

/// `nll_loss_forward(logp, target, weight, reduction, ignore_index)`: `(loss, total_weight)`.
pub fn nll_loss_forward(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
) -> Result<Value<CudaTensor>, String> {
    let (x, target) = (tensor(env, 0)?, tensor(env, 1)?);
    let l = nll_args(env, x, 0)?;
    if target.numel() != l.n {
        return Err(format!(
            "nll_loss: {} targets for {} rows",
            target.numel(),
            l.n
        ));
    }
    let w = weight(env, 2)?;
    let dt = out_dtype(env, x.dtype);
    let mut temps = Temps(vec![]);
    let res = (|| {
        let xc = dense(c, x, dt, &mut temps)?;
        let tc = dense(c, target, Dtype::Int64, &mut temps)?;
        let wc = w.map(|w| dense(c, w, dt, &mut temps)).transpose()?;
        let shape: Vec<usize> = if l.reduction == 0 && x.shape.len() == 2 {
            vec![l.n]
        } else {
            vec![]
        };
        let loss = c.empty(dt, &shape)?;
        let total = match c.empty(env.out_meta_k(1).map_or(dt, |m| m.dtype), &[]) {
            Ok(t) => t,
            Err(e) => {
                c.release(&loss);
                return Err(e);
            }
        };
        let totalc = if total.dtype == dt {
            total.clone()
        } else {
            c.empty(dt, &[])?
        };
        let r =
            c.k.nll_loss(
                false,
                [
                    loss.block.ptr,
                    totalc.block.ptr,
                    xc.block.ptr,
                    tc.block.ptr,
                    wc.map_or(0, |w| w.block.ptr),
                ],
                [elem(dt)?, crate::kernels::source::Elem::I64],
                l.n,
                l.classes,
                l.ignore,
                l.reduction,
            )
            .map_err(|e| e.to_string())
            .and_then(|()| {
                if totalc.block != total.block {
                    c.ew_into("copy", &[&totalc], &total, 0.0)
                } else {
                    Ok(())
                }
            });
        if totalc.block != total.block {
            c.release(&totalc);
        }
        if let Err(e) = r {
            c.release(&loss);
            c.release(&total);
            return Err(e);
        }
        Ok(Value::List(vec![Some(loss), Some(total)]))
    })();
    temps.release(c);
    res
}

/// `nll_loss_backward(grad, logp, target, weight, reduction, ignore_index, total_weight)`.
pub fn nll_loss_backward(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
) -> Result<Value<CudaTensor>, String> {
    let (g, x, target) = (tensor(env, 0)?, tensor(env, 1)?, tensor(env, 2)?);
    let l = nll_args(env, x, 1)?;
    if target.numel() != l.n {
        return Err(format!(
            "nll_loss_backward: {} targets for {} rows",
            target.numel(),
            l.n
        ));
    }
    let w = weight(env, 3)?;
    let total = tensor(env, 6)?;
    let dt = out_dtype(env, x.dtype);
    let mut temps = Temps(vec![]);
    let res = (|| {
        let gc = dense(c, g, dt, &mut temps)?;
        let tc = dense(c, target, Dtype::Int64, &mut temps)?;
        let wc = w.map(|w| dense(c, w, dt, &mut temps)).transpose()?;
        let totc = dense(c, total, dt, &mut temps)?;
        let dx = c.full(dt, &x.shape.clone(), 0.0)?;
        let r =
            c.k.nll_loss(
                true,
                [
                    dx.block.ptr,
                    gc.block.ptr,
                    tc.block.ptr,
                    wc.map_or(0, |w| w.block.ptr),
                    totc.block.ptr,
                ],
                [elem(dt)?, crate::kernels::source::Elem::I64],
                l.n,
                l.classes,
                l.ignore,
                l.reduction,
            )
            .map_err(|e| e.to_string());
        if let Err(e) = r {
            c.release(&dx);
            return Err(e);
        }
        Ok(Value::Tensor(dx))
    })();
    temps.release(c);
    res
}
