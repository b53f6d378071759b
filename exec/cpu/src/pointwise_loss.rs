//! Losses that are elementwise before their reduction (none 0, mean 1, sum 2): `mse_loss`,
//! `smooth_l1_loss` and their backward, `binary_cross_entropy_with_logits` (whose backward
//! autograd writes as elementwise ops). Operands broadcast; the formulas are torch's CPU ones
//! (BCE through `logsigmoid(x) = min(x, 0) - log1p(exp(-|x|))`, as torch's decomposition).

use super::{Env, Value, int, number, one, out_dtype};
use crate::elementwise::bcast_shape;
use crate::real::{Real, by_real};
use ndarray::{ArrayD, IxDyn};
use zerosched_exec::host::Tensor;
use zerosched_ir::Arg;

/// Operands broadcast to one shape, as flat vectors (`None` for an absent optional one).
struct Flat<T> {
    shape: Vec<usize>,
    vals: Vec<Option<Vec<T>>>,
}

fn flat<T: Real>(ts: &[Option<&Tensor>]) -> Result<Flat<T>, String> {
    let mut shape = Vec::new();
    for t in ts.iter().flatten() {
        shape = bcast_shape(&shape, t.shape())?;
    }
    let vs = ts
        .iter()
        .map(|t| {
            t.map(|t| {
                let a = T::get(t);
                a.broadcast(IxDyn(&shape))
                    .map(|v| v.iter().copied().collect::<Vec<T>>())
                    .ok_or_else(|| format!("shape {:?} does not broadcast to {shape:?}", t.shape()))
            })
            .transpose()
        })
        .collect::<Result<_, _>>()?;
    Ok(Flat { shape, vals: vs })
}

fn reduction(env: &Env<'_, Tensor>, i: usize) -> Result<i64, String> {
    match env.arg_or_kw(i, "reduction") {
        None => Ok(1),
        Some(a) => int(a),
    }
}

/// The reduced loss of elementwise losses `v` of `shape`.
fn reduce<T: Real>(v: Vec<T>, shape: &[usize], r: i64) -> Result<ArrayD<T>, String> {
    let n = v.len();
    match r {
        0 => ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| e.to_string()),
        1 => Ok(ArrayD::from_elem(
            IxDyn(&[]),
            v.into_iter().sum::<T>() / T::c(n as f64),
        )),
        2 => Ok(ArrayD::from_elem(IxDyn(&[]), v.into_iter().sum::<T>())),
        r => Err(format!("loss: reduction {r} is not 0, 1 or 2")),
    }
}

fn tensor_at<'a>(env: &Env<'a, Tensor>, i: usize) -> Result<Option<&'a Tensor>, String> {
    match env.node().args.get(i) {
        Some(a @ Arg::Node(_)) => Ok(Some(env.tensor(a)?)),
        _ => Ok(None),
    }
}

/// The input and target (arguments `first`, `first + 1`) broadcast together.
struct Pair<T> {
    shape: Vec<usize>,
    x: Vec<T>,
    t: Vec<T>,
}

fn two<T: Real>(env: &Env<'_, Tensor>, first: usize) -> Result<Pair<T>, String> {
    let (x, t) = (
        env.tensor(env.arg(first)?)?,
        env.tensor(env.arg(first + 1)?)?,
    );
    let mut f = flat::<T>(&[Some(x), Some(t)])?;
    let t = f.vals.pop().flatten().unwrap_or_default();
    let x = f.vals.pop().flatten().unwrap_or_default();
    Ok(Pair {
        shape: f.shape,
        x,
        t,
    })
}

/// The backward's gradient at each element of `shape` (the loss's gradient is 0-d when reduced)
/// and the mean's divisor.
fn grad_at<T: Real>(env: &Env<'_, Tensor>, shape: &[usize], r: i64) -> Result<(Vec<T>, T), String> {
    let g = T::get(env.tensor(env.arg(0)?)?);
    let n: usize = shape.iter().product();
    let full = if r == 0 {
        g.broadcast(IxDyn(shape))
            .ok_or("loss backward: gradient does not broadcast")?
            .iter()
            .copied()
            .collect()
    } else {
        vec![*g.first().ok_or("loss backward: no gradient")?; n]
    };
    let norm = if r == 1 {
        T::one() / T::c(n as f64)
    } else {
        T::one()
    };
    Ok((full, norm))
}

fn mse_fwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let Pair { shape, x, t } = two::<T>(env, 0)?;
    let l: Vec<T> = x.iter().zip(&t).map(|(&a, &b)| (a - b) * (a - b)).collect();
    let dt = out_dtype(env, env.tensor(env.arg(0)?)?.dtype);
    one(T::wrap(reduce(l, &shape, reduction(env, 2)?)?, dt)?)
}

/// `mse_loss(x, target, reduction=1)`.
pub fn mse_loss(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(0)?)?.dtype, "mse_loss", T => mse_fwd::<T>(env))
}

fn mse_bwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let Pair { shape, x, t } = two::<T>(env, 1)?;
    let r = reduction(env, 3)?;
    let (g, norm) = grad_at::<T>(env, &shape, r)?;
    let d: Vec<T> = (0..x.len())
        .map(|i| T::c(2.0) * norm * (x[i] - t[i]) * g[i])
        .collect();
    let dt = out_dtype(env, env.tensor(env.arg(1)?)?.dtype);
    one(T::wrap(reduce(d, &shape, 0)?, dt)?)
}

/// `mse_loss_backward(grad, x, target, reduction)`.
pub fn mse_loss_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(1)?)?.dtype, "mse_loss_backward", T => mse_bwd::<T>(env))
}

fn beta(env: &Env<'_, Tensor>, i: usize) -> Result<f64, String> {
    match env.arg_or_kw(i, "beta") {
        None => Ok(1.0),
        Some(a) => number(a).ok_or_else(|| format!("smooth_l1_loss: beta {a:?}")),
    }
}

fn sl1_fwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let Pair { shape, x, t } = two::<T>(env, 0)?;
    let b = T::c(beta(env, 3)?);
    let l: Vec<T> = x
        .iter()
        .zip(&t)
        .map(|(&a, &c)| {
            let z = (a - c).abs();
            if z < b {
                T::c(0.5) * z * z / b
            } else {
                z - T::c(0.5) * b
            }
        })
        .collect();
    let dt = out_dtype(env, env.tensor(env.arg(0)?)?.dtype);
    one(T::wrap(reduce(l, &shape, reduction(env, 2)?)?, dt)?)
}

/// `smooth_l1_loss(x, target, reduction=1, beta=1)`: 0.5 z^2 / beta below beta, else
/// z - 0.5 beta, z = |x - target| (beta 0 is the L1 loss).
pub fn smooth_l1_loss(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(0)?)?.dtype, "smooth_l1_loss", T => sl1_fwd::<T>(env))
}

fn sl1_bwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let Pair { shape, x, t } = two::<T>(env, 1)?;
    let r = reduction(env, 3)?;
    let b = T::c(beta(env, 4)?);
    let (g, norm) = grad_at::<T>(env, &shape, r)?;
    let d: Vec<T> = (0..x.len())
        .map(|i| {
            let z = x[i] - t[i];
            if z <= -b {
                -norm * g[i]
            } else if z >= b {
                norm * g[i]
            } else {
                norm * z * g[i] / b
            }
        })
        .collect();
    let dt = out_dtype(env, env.tensor(env.arg(1)?)?.dtype);
    one(T::wrap(reduce(d, &shape, 0)?, dt)?)
}

/// `smooth_l1_loss_backward(grad, x, target, reduction, beta)`.
pub fn smooth_l1_loss_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(1)?)?.dtype, "smooth_l1_loss_backward", T => sl1_bwd::<T>(env))
}

fn bce_fwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let t = env.tensor(env.arg(1)?)?;
    let (w, pw) = (tensor_at(env, 2)?, tensor_at(env, 3)?);
    let Flat { shape, vals } = flat::<T>(&[Some(x), Some(t), w, pw])?;
    let get = |k: usize| vals.get(k).cloned().flatten();
    let (xs, ts) = (get(0).unwrap_or_default(), get(1).unwrap_or_default());
    let (ws, pws) = (get(2), get(3));
    let l: Vec<T> = (0..xs.len())
        .map(|i| {
            let (a, y) = (xs[i], ts[i]);
            let logsig = a.min(T::zero()) - (-a.abs()).exp().ln_1p();
            let lw = pws
                .as_ref()
                .map_or(T::one(), |p| (p[i] - T::one()) * y + T::one());
            let loss = (T::one() - y) * a - lw * logsig;
            ws.as_ref().map_or(loss, |w| loss * w[i])
        })
        .collect();
    let dt = out_dtype(env, x.dtype);
    one(T::wrap(reduce(l, &shape, reduction(env, 4)?)?, dt)?)
}

/// `binary_cross_entropy_with_logits(x, target, weight=None, pos_weight=None, reduction=1)`.
pub fn binary_cross_entropy_with_logits(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(0)?)?.dtype, "binary_cross_entropy_with_logits", T => bce_fwd::<T>(env))
}
