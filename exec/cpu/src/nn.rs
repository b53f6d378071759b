//! Fused neural-network ops: layer norm and the CPU flash-attention pair (forward with
//! logsumexp, backward from it), in the math formulation: `S = scale * Q K^T + mask`,
//! `P = exp(S - logsumexp)`, `O = P V`; backward `dV = P^T dO`, `dP = dO V^T`,
//! `dS = P * (dP - rowsum(dO * O))`, `dQ = scale dS K`, `dK = scale dS^T Q`. Grouped KV
//! heads (H a multiple of the KV heads) share K and V and accumulate their gradients.

use super::{Env, Value, flag, number, out_dtype};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, Array3, Array4, ArrayView2, ArrayView4, Axis, Ix4, IxDyn, LinalgScalar, s};
use num_traits::Float;
use zerosched_exec::host::{Elem, Kind, Tensor, kind};
use zerosched_ir::Arg;

trait F: Float + LinalgScalar + Elem + std::iter::Sum + std::ops::AddAssign {}
impl F for f32 {}
impl F for f64 {}

fn view4<T: Clone>(a: &zerosched_exec::host::Arr<T>) -> Result<ArrayView4<'_, T>, String> {
    a.view()
        .into_dimensionality::<Ix4>()
        .map_err(|_| format!("attention expects 4-d tensors, got {:?}", a.shape()))
}

struct Attn<T> {
    scale: T,
    causal: bool,
    /// Additive mask broadcast to [B, H, L, S].
    mask: Option<ndarray::Array4<T>>,
}

fn attn_opts<T: F>(
    env: &Env<'_, Tensor>,
    q: &Tensor,
    dropout_pos: usize,
    l: usize,
    sz: usize,
) -> Result<Attn<T>, String> {
    let n = env.node();
    if n.args.get(dropout_pos).and_then(number).unwrap_or(0.0) != 0.0 {
        return Err("dropout in attention is not supported".into());
    }
    let causal = flag(
        n.args.get(dropout_pos + 1).or(n.kwargs.get("is_causal")),
        false,
    );
    let e = *q.shape().last().unwrap_or(&1);
    let scale = n
        .kwargs
        .get("scale")
        .and_then(number)
        .unwrap_or(1.0 / (e as f64).sqrt());
    let (b, h) = (q.shape()[0], q.shape()[1]);
    let mask = match n.kwargs.get("attn_mask") {
        Some(a @ Arg::Node(_)) => {
            let m = env.tensor(a)?;
            let add: zerosched_exec::host::Arr<T> = if m.dtype == zerosched_ir::Dtype::Bool {
                bool::get(m)
                    .mapv(|keep| if keep { T::zero() } else { T::neg_infinity() })
                    .into_shared()
            } else {
                T::get(m)
            };
            let full = add
                .broadcast(IxDyn(&[b, h, l, sz]))
                .ok_or_else(|| {
                    format!(
                        "mask {:?} does not broadcast to {:?}",
                        m.shape(),
                        [b, h, l, sz]
                    )
                })?
                .to_owned()
                .into_dimensionality::<Ix4>()
                .map_err(|e| e.to_string())?;
            Some(full)
        }
        _ => None,
    };
    Ok(Attn {
        scale: T::from_f64(scale),
        causal,
        mask,
    })
}

/// Scores `scale * q k^T + mask` (causal: -inf above the diagonal) for one (batch, head).
fn scores<T: F>(
    o: &Attn<T>,
    q: ArrayView2<'_, T>,
    k: ArrayView2<'_, T>,
    b: usize,
    h: usize,
) -> Array2<T> {
    let (l, sz) = (q.nrows(), k.nrows());
    let mut sc = Array2::<T>::zeros((l, sz));
    general_mat_mul(o.scale, &q, &k.t(), T::zero(), &mut sc);
    if let Some(m) = &o.mask {
        sc += &m.slice(s![b, h, .., ..]);
    }
    if o.causal {
        for i in 0..l {
            for j in (i + 1)..sz {
                sc[[i, j]] = T::neg_infinity();
            }
        }
    }
    sc
}

fn fwd<T: F>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (qt, kt, vt) = (
        env.tensor(env.arg(0)?)?,
        env.tensor(env.arg(1)?)?,
        env.tensor(env.arg(2)?)?,
    );
    let (qa, ka, va) = (T::get(qt), T::get(kt), T::get(vt));
    let (q, k, v) = (view4(&qa)?, view4(&ka)?, view4(&va)?);
    let (bs, h, l, _) = q.dim();
    let (_, hk, sz, ev) = v.dim();
    if hk == 0 || h % hk != 0 || k.dim().1 != hk {
        return Err(format!("{h} query heads over {hk} key/value heads"));
    }
    let o = attn_opts::<T>(env, qt, 3, l, sz)?;
    let mut out = Array4::<T>::zeros((bs, h, l, ev));
    let mut lse = Array3::<T>::zeros((bs, h, l));
    for b in 0..bs {
        for hh in 0..h {
            let kv = hh / (h / hk);
            let mut p = scores(
                &o,
                q.slice(s![b, hh, .., ..]),
                k.slice(s![b, kv, .., ..]),
                b,
                hh,
            );
            for (i, mut row) in p.axis_iter_mut(Axis(0)).enumerate() {
                let m = row.iter().copied().fold(T::neg_infinity(), T::max);
                if m == T::neg_infinity() {
                    lse[[b, hh, i]] = m;
                    row.fill(T::zero());
                    continue;
                }
                let sum: T = row.iter().map(|&x| (x - m).exp()).sum();
                let ls = m + sum.ln();
                lse[[b, hh, i]] = ls;
                row.mapv_inplace(|x| (x - ls).exp());
            }
            let mut ob = out.slice_mut(s![b, hh, .., ..]);
            general_mat_mul(
                T::one(),
                &p,
                &v.slice(s![b, kv, .., ..]),
                T::zero(),
                &mut ob,
            );
        }
    }
    let d0 = env.out_meta_k(0).map_or(qt.dtype, |m| m.dtype);
    let d1 = env
        .out_meta_k(1)
        .map_or(zerosched_ir::Dtype::Float32, |m| m.dtype);
    Ok(Value::List(vec![
        Some(T::wrap(out.into_dyn(), d0)?),
        Some(T::wrap(lse.into_dyn(), d1)?),
    ]))
}

fn bwd<T: F>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = |i| env.tensor(env.arg(i)?);
    let (dot, qt, kt, vt, ot, lt) = (t(0)?, t(1)?, t(2)?, t(3)?, t(4)?, t(5)?);
    let (doa, qa, ka, va, oa) = (T::get(dot), T::get(qt), T::get(kt), T::get(vt), T::get(ot));
    let (dov, q, k, v, ov) = (
        view4(&doa)?,
        view4(&qa)?,
        view4(&ka)?,
        view4(&va)?,
        view4(&oa)?,
    );
    let la = T::get(lt);
    let (bs, h, l, e) = q.dim();
    let (_, hk, sz, ev) = v.dim();
    if hk == 0 || h % hk != 0 {
        return Err(format!("{h} query heads over {hk} key/value heads"));
    }
    let o = attn_opts::<T>(env, qt, 6, l, sz)?;
    let mut dq = Array4::<T>::zeros((bs, h, l, e));
    let mut dk = Array4::<T>::zeros((bs, hk, sz, e));
    let mut dv = Array4::<T>::zeros((bs, hk, sz, ev));
    for b in 0..bs {
        for hh in 0..h {
            let kv = hh / (h / hk);
            let (qm, km, vm) = (
                q.slice(s![b, hh, .., ..]),
                k.slice(s![b, kv, .., ..]),
                v.slice(s![b, kv, .., ..]),
            );
            let (dom, om) = (dov.slice(s![b, hh, .., ..]), ov.slice(s![b, hh, .., ..]));
            let mut p = scores(&o, qm, km, b, hh);
            for (i, mut row) in p.axis_iter_mut(Axis(0)).enumerate() {
                let ls = *la
                    .get([b, hh, i].as_slice())
                    .ok_or("logsumexp has the wrong shape")?;
                if ls == T::neg_infinity() {
                    row.fill(T::zero());
                } else {
                    row.mapv_inplace(|x| (x - ls).exp());
                }
            }
            let mut dvb = dv.slice_mut(s![b, kv, .., ..]);
            general_mat_mul(T::one(), &p.t(), &dom, T::one(), &mut dvb);
            let mut dp = Array2::<T>::zeros((l, sz));
            general_mat_mul(T::one(), &dom, &vm.t(), T::zero(), &mut dp);
            for i in 0..l {
                let di: T = dom
                    .row(i)
                    .iter()
                    .zip(om.row(i).iter())
                    .map(|(&a, &b)| a * b)
                    .sum();
                for j in 0..sz {
                    dp[[i, j]] = p[[i, j]] * (dp[[i, j]] - di);
                }
            }
            let mut dqb = dq.slice_mut(s![b, hh, .., ..]);
            general_mat_mul(o.scale, &dp, &km, T::zero(), &mut dqb);
            let mut dkb = dk.slice_mut(s![b, kv, .., ..]);
            general_mat_mul(o.scale, &dp.t(), &qm, T::one(), &mut dkb);
        }
    }
    let d = |k: usize, f: zerosched_ir::Dtype| env.out_meta_k(k).map_or(f, |m| m.dtype);
    Ok(Value::List(vec![
        Some(T::wrap(dq.into_dyn(), d(0, qt.dtype))?),
        Some(T::wrap(dk.into_dyn(), d(1, kt.dtype))?),
        Some(T::wrap(dv.into_dyn(), d(2, vt.dtype))?),
    ]))
}

fn compute_kind(env: &Env<'_, Tensor>) -> Result<Kind, String> {
    let q = env.tensor(env.arg(0)?)?;
    kind(out_dtype(env, q.dtype)).or_else(|_| Ok(q.kind()))
}

pub fn sdpa(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    match compute_kind(env)? {
        Kind::F64 => fwd::<f64>(env),
        _ => fwd::<f32>(env),
    }
}

pub fn sdpa_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    match env.tensor(env.arg(1)?)?.kind() {
        Kind::F64 => bwd::<f64>(env),
        _ => bwd::<f32>(env),
    }
}

fn ln<T: F>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let xt = env.tensor(env.arg(0)?)?;
    let norm: usize = super::ints(env.arg(1)?)?
        .iter()
        .map(|&d| d.max(0) as usize)
        .product();
    let opt = |i: usize| -> Result<Option<zerosched_exec::host::Arr<T>>, String> {
        match env.node().args.get(i) {
            Some(a @ Arg::Node(_)) => Ok(Some(T::get(env.tensor(a)?))),
            _ => Ok(None),
        }
    };
    let (w, bias) = (opt(2)?, opt(3)?);
    let eps = T::from_f64(env.node().args.get(4).and_then(number).unwrap_or(1e-5));
    let shape = xt.shape().to_vec();
    let rows = xt.numel() / norm.max(1);
    let x = T::get(xt);
    let flat: Vec<T> = x.iter().copied().collect();
    let wf: Option<Vec<T>> = w.map(|a| a.iter().copied().collect());
    let bf: Option<Vec<T>> = bias.map(|a| a.iter().copied().collect());
    let n = T::from_f64(norm as f64);
    let mut out = Vec::with_capacity(flat.len());
    let (mut means, mut rstds) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
    for r in 0..rows {
        let row = &flat[r * norm..(r + 1) * norm];
        let mean = row.iter().copied().sum::<T>() / n;
        let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() / n;
        let rstd = T::one() / (var + eps).sqrt();
        for (j, &v) in row.iter().enumerate() {
            let mut y = (v - mean) * rstd;
            if let Some(w) = &wf {
                y = y * w[j];
            }
            if let Some(b) = &bf {
                y += b[j];
            }
            out.push(y);
        }
        means.push(mean);
        rstds.push(rstd);
    }
    let keep = shape.len() - super::ints(env.arg(1)?)?.len();
    let mut stat_shape = shape[..keep].to_vec();
    stat_shape.extend(std::iter::repeat_n(1, shape.len() - keep));
    let mk = |v: Vec<T>, sh: &[usize]| {
        ndarray::ArrayD::from_shape_vec(IxDyn(sh), v).map_err(|e| e.to_string())
    };
    let d = |k: usize| env.out_meta_k(k).map_or(xt.dtype, |m| m.dtype);
    Ok(Value::List(vec![
        Some(T::wrap(mk(out, &shape)?, d(0))?),
        Some(T::wrap(mk(means, &stat_shape)?, d(1))?),
        Some(T::wrap(mk(rstds, &stat_shape)?, d(2))?),
    ]))
}

pub fn layer_norm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    match env.tensor(env.arg(0)?)?.kind() {
        Kind::F64 => ln::<f64>(env),
        _ => ln::<f32>(env),
    }
}
