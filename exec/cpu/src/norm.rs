//! `native_layer_norm_backward(dy, x, normalized_shape, mean, rstd, weight, bias, mask)`:
//! per row of the normalized size N, with `xh = (x - mean) * rstd` and `g = dy * weight`,
//! `dx = rstd / N * (N g - sum(g) - xh sum(g xh))`, `dweight = sum over rows of dy xh`,
//! `dbias = sum over rows of dy`; an output whose mask entry is false is None.

use super::{Env, Value, ints};
use crate::real::{Real, by_real};
use ndarray::{ArrayD, IxDyn};
use zerosched_exec::host::Tensor;
use zerosched_ir::Arg;

fn flat<T: Real>(env: &Env<'_, Tensor>, i: usize) -> Result<Option<Vec<T>>, String> {
    match env.node().args.get(i) {
        Some(a @ Arg::Node(_)) => Ok(Some(T::get(env.tensor(a)?).iter().copied().collect())),
        _ => Ok(None),
    }
}

fn bwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let xt = env.tensor(env.arg(1)?)?;
    let norm_shape: Vec<usize> = ints(env.arg(2)?)?
        .iter()
        .map(|&d| d.max(0) as usize)
        .collect();
    let n: usize = norm_shape.iter().product();
    let need =
        |v: Option<Vec<T>>, what: &str| v.ok_or_else(|| format!("layer norm backward: no {what}"));
    let dy = need(flat::<T>(env, 0)?, "gradient")?;
    let x = need(flat::<T>(env, 1)?, "input")?;
    let mean = need(flat::<T>(env, 3)?, "mean")?;
    let rstd = need(flat::<T>(env, 4)?, "rstd")?;
    let w = flat::<T>(env, 5)?;
    let rows = x.len().checked_div(n).unwrap_or(0);
    if dy.len() != x.len()
        || mean.len() != rows
        || rstd.len() != rows
        || w.as_ref().is_some_and(|w| w.len() != n)
    {
        return Err(format!(
            "layer norm backward: sizes do not agree with input {:?} normalized over {norm_shape:?}",
            xt.shape()
        ));
    }
    let mask: Vec<bool> = match env.node().args.get(7) {
        Some(Arg::List(l)) => l.iter().map(|a| matches!(a, Arg::Bool(true))).collect(),
        _ => vec![true; 3],
    };
    let nt = T::c(n as f64);
    let mut dx = vec![T::zero(); x.len()];
    let mut dw = vec![T::zero(); n];
    let mut db = vec![T::zero(); n];
    for r in 0..rows {
        let (m, s) = (mean[r], rstd[r]);
        let row = r * n..(r + 1) * n;
        let (mut sg, mut sgx) = (T::zero(), T::zero());
        for (j, k) in row.clone().enumerate() {
            let xh = (x[k] - m) * s;
            let g = dy[k] * w.as_ref().map_or(T::one(), |w| w[j]);
            sg += g;
            sgx += g * xh;
            dw[j] += dy[k] * xh;
            db[j] += dy[k];
        }
        for (j, k) in row.enumerate() {
            let xh = (x[k] - m) * s;
            let g = dy[k] * w.as_ref().map_or(T::one(), |w| w[j]);
            dx[k] = s / nt * (nt * g - sg - xh * sgx);
        }
    }
    let mk = |v: Vec<T>, sh: &[usize], k: usize| -> Result<Option<Tensor>, String> {
        if !mask.get(k).copied().unwrap_or(true) {
            return Ok(None);
        }
        let dt = env.out_meta_k(k).map_or(xt.dtype, |m| m.dtype);
        let a = ArrayD::from_shape_vec(IxDyn(sh), v).map_err(|e| e.to_string())?;
        Ok(Some(T::wrap(a, dt)?))
    };
    let has_w = w.is_some();
    let has_b = matches!(env.node().args.get(6), Some(Arg::Node(_)));
    Ok(Value::List(vec![
        mk(dx, xt.shape(), 0)?,
        if has_w { mk(dw, &norm_shape, 1)? } else { None },
        if has_b { mk(db, &norm_shape, 2)? } else { None },
    ]))
}

pub fn layer_norm_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(1)?)?.dtype, "native_layer_norm_backward", T => bwd::<T>(env))
}
