//! Normalisation over channels: batch norm (statistics per channel over the batch and the
//! spatial positions of `[N, C, *]`) and group norm (per sample and group of channels), forward
//! and backward, in the input's compute type. Variance is biased in the normalisation; the
//! running variance a training step returns (`_native_batch_norm_legit_functional`) is
//! updated with the unbiased one, as torch does. Outside training the statistics a CPU kernel
//! saves are empty: their recorded shapes are filled with zeros.

use super::{Env, Value, flag, int, number};
use crate::real::{Real, by_real};
use ndarray::{ArrayD, IxDyn};
use zerosched_exec::host::Tensor;
use zerosched_ir::{Arg, Dtype};

fn opt<T: Real>(env: &Env<'_, Tensor>, i: usize) -> Result<Option<Vec<T>>, String> {
    match env.node().args.get(i) {
        Some(a @ Arg::Node(_)) => Ok(Some(T::get(env.tensor(a)?).iter().copied().collect())),
        _ => Ok(None),
    }
}

fn need<T>(v: Option<Vec<T>>, what: &str) -> Result<Vec<T>, String> {
    v.ok_or_else(|| format!("batch norm: no {what}"))
}

fn arr<T: Real>(v: Vec<T>, shape: &[usize], dt: Dtype) -> Result<Tensor, String> {
    T::wrap(
        ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| e.to_string())?,
        dt,
    )
}

/// `[N, C, *]` as (N, C, positions per channel and sample).
fn layout(shape: &[usize], what: &str) -> Result<(usize, usize, usize), String> {
    match shape {
        [n, c, rest @ ..] => Ok((*n, *c, rest.iter().product())),
        _ => Err(format!(
            "{what}: input of shape {shape:?} has no channel dimension"
        )),
    }
}

fn check_len<T>(v: &Option<Vec<T>>, c: usize, what: &str) -> Result<(), String> {
    match v {
        Some(v) if v.len() != c => Err(format!(
            "batch norm: {what} of {} for {c} channels",
            v.len()
        )),
        _ => Ok(()),
    }
}

/// Output `k` of the node: `v` in its recorded dtype, or zeros of its recorded shape when that
/// is not `v`'s (an empty statistic).
fn stat<T: Real>(
    env: &Env<'_, Tensor>,
    k: usize,
    v: Vec<T>,
    shape: &[usize],
    dt: Dtype,
) -> Result<Tensor, String> {
    match env.out_meta_k(k) {
        Some(m) => {
            let rec = m.hint_dims();
            if rec.iter().product::<usize>() == v.len() {
                arr(v, &rec, m.dtype)
            } else {
                arr(vec![T::zero(); rec.iter().product()], &rec, m.dtype)
            }
        }
        None => arr(v, shape, dt),
    }
}

/// Which batch-norm form a target is: where the running statistics and the training flag are.
struct Form {
    running: Option<(usize, usize)>,
    training: Option<usize>,
    momentum: usize,
    eps: usize,
    functional: bool,
}

fn form(target: &str) -> Form {
    match target {
        "aten._native_batch_norm_legit.no_stats" => Form {
            running: None,
            training: Some(3),
            momentum: 4,
            eps: 5,
            functional: false,
        },
        "aten._native_batch_norm_legit_no_training.default" => Form {
            running: Some((3, 4)),
            training: None,
            momentum: 5,
            eps: 6,
            functional: false,
        },
        t => Form {
            running: Some((3, 4)),
            training: Some(5),
            momentum: 6,
            eps: 7,
            functional: t == "aten._native_batch_norm_legit_functional.default",
        },
    }
}

fn bn_fwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let f = form(&env.node().target);
    let xt = env.tensor(env.arg(0)?)?;
    let (n, c, s) = layout(xt.shape(), "batch norm")?;
    let x: Vec<T> = T::get(xt).iter().copied().collect();
    let (w, b) = (opt::<T>(env, 1)?, opt::<T>(env, 2)?);
    let (rm, rv) = match f.running {
        Some((m, v)) => (opt::<T>(env, m)?, opt::<T>(env, v)?),
        None => (None, None),
    };
    for (v, what) in [
        (&w, "weight"),
        (&b, "bias"),
        (&rm, "running mean"),
        (&rv, "running var"),
    ] {
        check_len(v, c, what)?;
    }
    let training = f
        .training
        .is_some_and(|i| flag(env.node().args.get(i), false));
    let arg = |i: usize, what: &str| {
        env.node()
            .args
            .get(i)
            .and_then(number)
            .ok_or_else(|| format!("batch norm: {what} is not a number"))
    };
    let momentum = T::c(arg(f.momentum, "momentum")?);
    let eps = T::c(arg(f.eps, "eps")?);
    let count = n * s;
    let at = |ni: usize, ci: usize, k: usize| (ni * c + ci) * s + k;
    let (mut mean, mut var) = (vec![T::zero(); c], vec![T::zero(); c]);
    if training {
        if count == 0 {
            return Err("batch norm: training on an empty batch".into());
        }
        let cnt = T::c(count as f64);
        for ci in 0..c {
            let mut sum = T::zero();
            for ni in 0..n {
                for k in 0..s {
                    sum += x[at(ni, ci, k)];
                }
            }
            let m = sum / cnt;
            let mut sq = T::zero();
            for ni in 0..n {
                for k in 0..s {
                    let d = x[at(ni, ci, k)] - m;
                    sq += d * d;
                }
            }
            mean[ci] = m;
            var[ci] = sq / cnt;
        }
    } else {
        mean = need(rm.clone(), "running mean")?;
        var = need(rv.clone(), "running var")?;
    }
    let invstd: Vec<T> = var.iter().map(|&v| T::one() / (v + eps).sqrt()).collect();
    let mut y = vec![T::zero(); x.len()];
    for ni in 0..n {
        for ci in 0..c {
            let scale = invstd[ci] * w.as_ref().map_or(T::one(), |w| w[ci]);
            let shift = b.as_ref().map_or(T::zero(), |b| b[ci]);
            for k in 0..s {
                let i = at(ni, ci, k);
                y[i] = (x[i] - mean[ci]) * scale + shift;
            }
        }
    }
    let d0 = env.out_meta_k(0).map_or(xt.dtype, |m| m.dtype);
    let mut out = vec![Some(arr(y, xt.shape(), d0)?)];
    let (sm, si) = if training {
        (mean.clone(), invstd)
    } else {
        (Vec::new(), Vec::new())
    };
    out.push(Some(stat(env, 1, sm, &[c], xt.dtype)?));
    out.push(Some(stat(env, 2, si, &[c], xt.dtype)?));
    if f.functional {
        let (rm, rv) = (need(rm, "running mean")?, need(rv, "running var")?);
        let (new_m, new_v) = if training {
            let unbiased = if count > 1 {
                T::c(count as f64 / (count - 1) as f64)
            } else {
                T::infinity()
            };
            let keep = T::one() - momentum;
            (
                (0..c).map(|i| keep * rm[i] + momentum * mean[i]).collect(),
                (0..c)
                    .map(|i| keep * rv[i] + momentum * var[i] * unbiased)
                    .collect(),
            )
        } else {
            (rm, rv)
        };
        out.push(Some(stat(env, 3, new_m, &[c], xt.dtype)?));
        out.push(Some(stat(env, 4, new_v, &[c], xt.dtype)?));
    }
    Ok(Value::List(out))
}

/// `native_batch_norm`, `_native_batch_norm_legit` (with and without running statistics),
/// `_native_batch_norm_legit_no_training`, `_native_batch_norm_legit_functional`.
pub fn batch_norm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(0)?)?.dtype, "batch norm", T => bn_fwd::<T>(env))
}

fn mask(env: &Env<'_, Tensor>, i: usize, n: usize) -> Vec<bool> {
    match env.node().args.get(i) {
        Some(Arg::List(l)) => l.iter().map(|a| matches!(a, Arg::Bool(true))).collect(),
        _ => vec![true; n],
    }
}

fn bn_bwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (gt, xt) = (env.tensor(env.arg(0)?)?, env.tensor(env.arg(1)?)?);
    let (n, c, s) = layout(xt.shape(), "native_batch_norm_backward")?;
    let g: Vec<T> = T::get(gt).iter().copied().collect();
    let x: Vec<T> = T::get(xt).iter().copied().collect();
    if g.len() != x.len() {
        return Err(format!(
            "native_batch_norm_backward: gradient {:?} for input {:?}",
            gt.shape(),
            xt.shape()
        ));
    }
    let w = opt::<T>(env, 2)?;
    let train = flag(env.node().args.get(7), false);
    let eps = T::c(env.node().args.get(8).and_then(number).unwrap_or(1e-5));
    let (mean, invstd) = if train {
        (
            need(opt::<T>(env, 5)?, "saved mean")?,
            need(opt::<T>(env, 6)?, "saved invstd")?,
        )
    } else {
        let rv = need(opt::<T>(env, 4)?, "running var")?;
        (
            need(opt::<T>(env, 3)?, "running mean")?,
            rv.iter().map(|&v| T::one() / (v + eps).sqrt()).collect(),
        )
    };
    for (v, what) in [
        (&Some(mean.clone()), "mean"),
        (&Some(invstd.clone()), "invstd"),
        (&w, "weight"),
    ] {
        check_len(v, c, what)?;
    }
    let at = |ni: usize, ci: usize, k: usize| (ni * c + ci) * s + k;
    let cnt = T::c((n * s) as f64);
    let mut dx = vec![T::zero(); x.len()];
    let (mut dw, mut db) = (vec![T::zero(); c], vec![T::zero(); c]);
    for ci in 0..c {
        let (mut sum_g, mut dot) = (T::zero(), T::zero());
        for ni in 0..n {
            for k in 0..s {
                let i = at(ni, ci, k);
                sum_g += g[i];
                dot += g[i] * (x[i] - mean[ci]);
            }
        }
        let wc = w.as_ref().map_or(T::one(), |w| w[ci]);
        let inv = invstd[ci];
        for ni in 0..n {
            for k in 0..s {
                let i = at(ni, ci, k);
                dx[i] = if train {
                    let proj = (x[i] - mean[ci]) * dot * inv * inv / cnt;
                    (g[i] - proj - sum_g / cnt) * inv * wc
                } else {
                    g[i] * inv * wc
                };
            }
        }
        dw[ci] = dot * inv;
        db[ci] = sum_g;
    }
    let m = mask(env, 9, 3);
    let dt = |k: usize| env.out_meta_k(k).map_or(xt.dtype, |m| m.dtype);
    let pick = |k: usize, v: Vec<T>, sh: &[usize]| -> Result<Option<Tensor>, String> {
        if m.get(k).copied().unwrap_or(true) {
            Ok(Some(arr(v, sh, dt(k))?))
        } else {
            Ok(None)
        }
    };
    Ok(Value::List(vec![
        pick(0, dx, xt.shape())?,
        pick(1, dw, &[c])?,
        pick(2, db, &[c])?,
    ]))
}

/// `native_batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean,
/// save_invstd, train, eps, output_mask)`.
pub fn batch_norm_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(1)?)?.dtype, "native_batch_norm_backward", T => bn_bwd::<T>(env))
}

/// Group-norm sizes from the arguments from `first` (N, C, HxW, group), checked against `x`.
fn groups(
    env: &Env<'_, Tensor>,
    x: &Tensor,
    first: usize,
) -> Result<(usize, usize, usize, usize), String> {
    let get = |i: usize| -> Result<usize, String> {
        let v = int(env.arg(first + i)?)?;
        usize::try_from(v).map_err(|_| format!("group norm: negative size {v}"))
    };
    let (n, c, hw, g) = (get(0)?, get(1)?, get(2)?, get(3)?);
    if g == 0 || c % g != 0 || n * c * hw != x.numel() {
        return Err(format!(
            "group norm: N {n}, C {c}, HxW {hw}, {g} groups for an input {:?}",
            x.shape()
        ));
    }
    Ok((n, c, hw, g))
}

fn gn_fwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let xt = env.tensor(env.arg(0)?)?;
    let (n, c, hw, g) = groups(env, xt, 3)?;
    let (w, b) = (opt::<T>(env, 1)?, opt::<T>(env, 2)?);
    check_len(&w, c, "weight")?;
    check_len(&b, c, "bias")?;
    let eps = T::c(env.node().args.get(7).and_then(number).unwrap_or(1e-5));
    let x: Vec<T> = T::get(xt).iter().copied().collect();
    let per = c / g * hw;
    let (mut mean, mut rstd) = (Vec::with_capacity(n * g), Vec::with_capacity(n * g));
    let mut y = vec![T::zero(); x.len()];
    for grp in 0..n * g {
        let row = &x[grp * per..(grp + 1) * per];
        let cnt = T::c(per as f64);
        let m = row.iter().copied().sum::<T>() / cnt;
        let v = row.iter().map(|&a| (a - m) * (a - m)).sum::<T>() / cnt;
        let r = T::one() / (v + eps).sqrt();
        for (k, &a) in row.iter().enumerate() {
            let ch = (grp % g) * (c / g) + k / hw.max(1);
            let wc = w.as_ref().map_or(T::one(), |w| w[ch]);
            let bc = b.as_ref().map_or(T::zero(), |b| b[ch]);
            y[grp * per + k] = (a - m) * r * wc + bc;
        }
        mean.push(m);
        rstd.push(r);
    }
    let d = |k: usize| env.out_meta_k(k).map_or(xt.dtype, |m| m.dtype);
    Ok(Value::List(vec![
        Some(arr(y, xt.shape(), d(0))?),
        Some(arr(mean, &[n, g], d(1))?),
        Some(arr(rstd, &[n, g], d(2))?),
    ]))
}

/// `native_group_norm(x, weight, bias, N, C, HxW, group, eps)` → (y, mean [N, G], rstd [N, G]).
pub fn group_norm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(0)?)?.dtype, "native_group_norm", T => gn_fwd::<T>(env))
}

fn gn_bwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (gt, xt) = (env.tensor(env.arg(0)?)?, env.tensor(env.arg(1)?)?);
    let (n, c, hw, g) = groups(env, xt, 5)?;
    let dy: Vec<T> = T::get(gt).iter().copied().collect();
    let x: Vec<T> = T::get(xt).iter().copied().collect();
    let mean = need(opt::<T>(env, 2)?, "mean")?;
    let rstd = need(opt::<T>(env, 3)?, "rstd")?;
    let w = opt::<T>(env, 4)?;
    check_len(&w, c, "weight")?;
    if dy.len() != x.len() || mean.len() != n * g || rstd.len() != n * g {
        return Err(format!(
            "native_group_norm_backward: gradient {:?}, input {:?}, statistics of {} for {n} x {g}",
            gt.shape(),
            xt.shape(),
            mean.len()
        ));
    }
    let per = c / g * hw;
    let cnt = T::c(per as f64);
    let ch_of = |grp: usize, k: usize| (grp % g) * (c / g) + k / hw.max(1);
    let mut dx = vec![T::zero(); x.len()];
    let (mut dw, mut db) = (vec![T::zero(); c], vec![T::zero(); c]);
    for grp in 0..n * g {
        let (m, r) = (mean[grp], rstd[grp]);
        let (mut s1, mut s2) = (T::zero(), T::zero());
        for k in 0..per {
            let i = grp * per + k;
            let ch = ch_of(grp, k);
            let xh = (x[i] - m) * r;
            let dxh = dy[i] * w.as_ref().map_or(T::one(), |w| w[ch]);
            s1 += dxh;
            s2 += dxh * xh;
            dw[ch] += dy[i] * xh;
            db[ch] += dy[i];
        }
        for k in 0..per {
            let i = grp * per + k;
            let xh = (x[i] - m) * r;
            let dxh = dy[i] * w.as_ref().map_or(T::one(), |w| w[ch_of(grp, k)]);
            dx[i] = r / cnt * (cnt * dxh - s1 - xh * s2);
        }
    }
    let msk = mask(env, 9, 3);
    let dt = |k: usize| env.out_meta_k(k).map_or(xt.dtype, |m| m.dtype);
    let pick = |k: usize, v: Vec<T>, sh: &[usize]| -> Result<Option<Tensor>, String> {
        if msk.get(k).copied().unwrap_or(true) {
            Ok(Some(arr(v, sh, dt(k))?))
        } else {
            Ok(None)
        }
    };
    Ok(Value::List(vec![
        pick(0, dx, xt.shape())?,
        pick(1, dw, &[c])?,
        pick(2, db, &[c])?,
    ]))
}

/// `native_group_norm_backward(grad, x, mean, rstd, weight, N, C, HxW, group, output_mask)`.
pub fn group_norm_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(1)?)?.dtype, "native_group_norm_backward", T => gn_bwd::<T>(env))
}
