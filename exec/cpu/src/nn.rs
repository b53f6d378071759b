//! Fused neural-network ops: layer norm and scaled dot-product attention, forward with
//! logsumexp and backward from it, for every fused form a graph holds: the CPU flash pair and
//! the GPU flash, memory-efficient and cuDNN pairs (whose graphs were exported on a GPU),
//! all computed by the math formulation: `S = scale * Q K^T + mask`,
//! `P = exp(S - logsumexp)`, `O = P V`; backward `dV = P^T dO`, `dP = dO V^T`,
//! `dS = P * (dP - rowsum(dO * O))`, `dQ = scale dS K`, `dK = scale dS^T Q`. Grouped KV
//! heads (H a multiple of the KV heads) share K and V and accumulate their gradients. Dropout
//! inside attention (the GPU forms) follows the random ops' rule: the forward draws by its
//! node's name and returns that key as its RNG state, from which the backward draws the same
//! mask (the CPU flash form returns no state, so its dropout is refused). A GPU form's other
//! bookkeeping outputs (sequence offsets, debug mask) are zeros of their recorded shapes, and its logsumexp fills the recorded shape
//! (padded past the sequence, as the memory-efficient kernel's is, with zeros).

use super::{Env, Value, flag, number, out_dtype};
use crate::random::Stream;
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
    /// Additive mask broadcast to [B, H, L, S], and its own shape.
    mask: Option<(ndarray::Array4<T>, Vec<usize>)>,
    /// Dropout probability on the attention weights, when not 0.
    dropout: Option<f64>,
}

/// Which fused form a target is, and where its arguments are.
#[derive(Clone, Copy)]
struct Form {
    /// Forward: dropout, is_causal and the additive mask (`None`: keyword `attn_mask`).
    dropout: usize,
    causal: usize,
    mask: Option<usize>,
    /// Backward: out, logsumexp, dropout, is_causal, mask; the gradient mask of the
    /// memory-efficient form (which can return the bias's gradient).
    b_out: usize,
    b_lse: usize,
    b_dropout: usize,
    b_causal: usize,
    b_mask: Option<usize>,
    b_grad_mask: Option<usize>,
    /// Where the forward returns its RNG state and the backward takes it: the dropout
    /// stream's key (random.rs), so both draw one mask. None: dropout is refused.
    seed_out: Option<usize>,
    b_seed: Option<usize>,
}

fn form(target: &str) -> Result<Form, String> {
    let base = target
        .trim_end_matches(".default")
        .trim_start_matches("aten.")
        .trim_end_matches("_backward");
    Ok(match base {
        "_scaled_dot_product_flash_attention_for_cpu" => Form {
            dropout: 3,
            causal: 4,
            mask: None,
            b_out: 4,
            b_lse: 5,
            b_dropout: 6,
            b_causal: 7,
            b_mask: None,
            b_grad_mask: None,
            seed_out: None,
            b_seed: None,
        },
        "_scaled_dot_product_flash_attention" => Form {
            dropout: 3,
            causal: 4,
            mask: None,
            b_out: 4,
            b_lse: 5,
            b_dropout: 10,
            b_causal: 11,
            b_mask: None,
            b_grad_mask: None,
            seed_out: Some(6),
            b_seed: Some(12),
        },
        "_scaled_dot_product_efficient_attention" => Form {
            dropout: 5,
            causal: 6,
            mask: Some(3),
            b_out: 5,
            b_lse: 6,
            b_dropout: 9,
            b_causal: 11,
            b_mask: Some(4),
            b_grad_mask: Some(10),
            seed_out: Some(2),
            b_seed: Some(7),
        },
        "_scaled_dot_product_cudnn_attention" => Form {
            dropout: 5,
            causal: 6,
            mask: Some(3),
            b_out: 4,
            b_lse: 5,
            b_dropout: 13,
            b_causal: 14,
            b_mask: Some(8),
            b_grad_mask: None,
            seed_out: Some(6),
            b_seed: Some(6),
        },
        _ => return Err(format!("`{target}` is not an attention op")),
    })
}

fn attn_opts<T: F>(
    env: &Env<'_, Tensor>,
    q: &Tensor,
    (dropout, causal, mask): (usize, usize, Option<usize>),
    l: usize,
    sz: usize,
) -> Result<Attn<T>, String> {
    let n = env.node();
    let p = n
        .args
        .get(dropout)
        .or(n.kwargs.get("dropout_p"))
        .and_then(number)
        .unwrap_or(0.0);
    if !(0.0..1.0).contains(&p) {
        return Err(format!("attention dropout p = {p} outside [0, 1)"));
    }
    let causal = flag(n.args.get(causal).or(n.kwargs.get("is_causal")), false);
    let e = *q.shape().last().unwrap_or(&1);
    let scale = n
        .kwargs
        .get("scale")
        .and_then(number)
        .unwrap_or(1.0 / (e as f64).sqrt());
    let (b, h) = (q.shape()[0], q.shape()[1]);
    let mask_arg = match mask {
        Some(i) => n.args.get(i),
        None => n.kwargs.get("attn_mask"),
    };
    let mask = match mask_arg {
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
            Some((full, m.shape().to_vec()))
        }
        _ => None,
    };
    Ok(Attn {
        scale: T::from_f64(scale),
        causal,
        mask,
        dropout: (p > 0.0).then_some(p),
    })
}

/// The dropout stream of the node (forward: its own name's; backward: the key in the RNG state
/// its forward returned), or None without dropout; an error where the form carries no state.
fn stream(
    env: &Env<'_, Tensor>,
    p: Option<f64>,
    seed: Option<Option<usize>>,
) -> Result<Option<Stream>, String> {
    if p.is_none() {
        return Ok(None);
    }
    match seed {
        None => Ok(Some(Stream::of(env))),
        Some(None) => Err("dropout in attention is not supported for this form (no RNG state reaches its backward)".into()),
        Some(Some(i)) => {
            let t = env.tensor(env.arg(i)?)?;
            let key = i64::get(t).iter().next().copied().ok_or("attention backward: empty RNG state")?;
            Ok(Some(Stream(key as u64)))
        }
    }
}

/// `p` (b, h) of [B, H, L, S] weights with dropout applied: each kept weight scaled by
/// 1 / (1 - p), draw ((b H + h) L + i) S + j of the stream deciding element (i, j).
fn apply_dropout<T: F>(
    p: &mut Array2<T>,
    st: &Stream,
    prob: f64,
    b: usize,
    h: usize,
    heads: usize,
) {
    let (l, sz) = p.dim();
    let keep = T::from_f64(1.0 / (1.0 - prob));
    for ((i, j), x) in p.indexed_iter_mut() {
        let at = (((b * heads + h) * l + i) * sz + j) as u64;
        *x = if st.uniform(at) >= prob {
            *x * keep
        } else {
            T::zero()
        };
    }
}

/// Zeros of output `k`'s recorded shape and dtype (a GPU form's bookkeeping output), or None
/// for a non-tensor output.
fn filler(env: &Env<'_, Tensor>, k: usize) -> Result<Option<Tensor>, String> {
    match env.out_meta_k(k) {
        Some(m) => {
            let shape = m.hint_dims();
            Ok(Some(crate::create::filled(&shape, 0.0, m.dtype)?))
        }
        None => Ok(None),
    }
}

/// The offset of (b, h, i) in a logsumexp of `shape` = [B, H, per, trailing...].
fn lse_at(shape: &[usize], b: usize, h: usize, i: usize) -> Option<usize> {
    let (bs, hs, per) = (*shape.first()?, *shape.get(1)?, *shape.get(2)?);
    let trail: usize = shape.get(3..).map_or(1, |r| r.iter().product());
    (b < bs && h < hs && i < per).then(|| ((b * hs + h) * per + i) * trail)
}

/// `full` summed over the axes where `shape` (right-aligned) is 1: a broadcast bias's gradient.
fn sum_to<T: F>(full: Array4<T>, shape: &[usize]) -> Result<ndarray::ArrayD<T>, String> {
    let pad = 4usize
        .checked_sub(shape.len())
        .ok_or_else(|| format!("bias of shape {shape:?}"))?;
    let mut a = full.into_dyn();
    for ax in 0..4 {
        let want = if ax < pad { 1 } else { shape[ax - pad] };
        if want == 1 && a.shape()[ax] != 1 {
            a = a.sum_axis(Axis(ax)).insert_axis(Axis(ax));
        }
    }
    a.into_shape_with_order(IxDyn(shape))
        .map_err(|e| e.to_string())
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
    if let Some((m, _)) = &o.mask {
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
    let f = form(&env.node().target)?;
    let o = attn_opts::<T>(env, qt, (f.dropout, f.causal, f.mask), l, sz)?;
    let st = stream(env, o.dropout, f.seed_out.is_none().then_some(None))?;
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
            if let (Some(st), Some(prob)) = (&st, o.dropout) {
                apply_dropout(&mut p, st, prob, b, hh, h);
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
    let lse = match env.out_meta_k(1) {
        Some(m) => {
            let shape = m.hint_dims();
            let mut v = vec![T::zero(); shape.iter().product()];
            for ((b, hh, i), &x) in lse.indexed_iter() {
                if let Some(at) = lse_at(&shape, b, hh, i) {
                    v[at] = x;
                }
            }
            let a = ndarray::ArrayD::from_shape_vec(IxDyn(&shape), v).map_err(|e| e.to_string())?;
            T::wrap(a, m.dtype)?
        }
        None => T::wrap(lse.into_dyn(), zerosched_ir::Dtype::Float32)?,
    };
    let mut outs = vec![Some(T::wrap(out.into_dyn(), d0)?), Some(lse)];
    for k in 2..env.n_outputs(2) {
        let mut t = filler(env, k)?;
        if f.seed_out == Some(k) {
            // The stream's key, for the backward to draw the same mask.
            if let (Some(t), Some(m)) = (t.as_mut(), env.out_meta_k(k)) {
                let shape = m.hint_dims();
                let mut v = vec![0i64; shape.iter().product()];
                if let Some(first) = v.first_mut() {
                    *first = Stream::of(env).0 as i64;
                }
                let a =
                    ndarray::ArrayD::from_shape_vec(IxDyn(&shape), v).map_err(|e| e.to_string())?;
                *t = i64::wrap(a, m.dtype)?;
            }
        }
        outs.push(t);
    }
    Ok(Value::List(outs))
}

fn bwd<T: F>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let f = form(&env.node().target)?;
    let t = |i| env.tensor(env.arg(i)?);
    let (dot, qt, kt, vt, ot, lt) = (t(0)?, t(1)?, t(2)?, t(3)?, t(f.b_out)?, t(f.b_lse)?);
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
    let o = attn_opts::<T>(env, qt, (f.b_dropout, f.b_causal, f.b_mask), l, sz)?;
    let st = stream(env, o.dropout, Some(f.b_seed))?;
    let want_bias = f.b_grad_mask.is_some_and(|i| {
        matches!(env.node().args.get(i), Some(Arg::List(m)) if matches!(m.get(3), Some(Arg::Bool(true))))
    }) && o.mask.is_some();
    let mut dbias = want_bias.then(|| Array4::<T>::zeros((bs, h, l, sz)));
    let lse_flat: Vec<T> = la.iter().copied().collect();
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
                let ls = *lse_at(la.shape(), b, hh, i)
                    .and_then(|at| lse_flat.get(at))
                    .ok_or("logsumexp has the wrong shape")?;
                if ls == T::neg_infinity() {
                    row.fill(T::zero());
                } else {
                    row.mapv_inplace(|x| (x - ls).exp());
                }
            }
            // With dropout Z: O = (P Z / (1 - p)) V, so dV = (P Z / (1 - p))^T dO and the
            // weights' gradient dO V^T passes through Z / (1 - p) before the softmax's.
            let mut dropped = p.clone();
            let mut dp = Array2::<T>::zeros((l, sz));
            general_mat_mul(T::one(), &dom, &vm.t(), T::zero(), &mut dp);
            if let (Some(st), Some(prob)) = (&st, o.dropout) {
                apply_dropout(&mut dropped, st, prob, b, hh, h);
                let mut ones = Array2::<T>::ones((l, sz));
                apply_dropout(&mut ones, st, prob, b, hh, h);
                dp.zip_mut_with(&ones, |a, &z| *a = *a * z);
            }
            let mut dvb = dv.slice_mut(s![b, kv, .., ..]);
            general_mat_mul(T::one(), &dropped.t(), &dom, T::one(), &mut dvb);
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
            if let Some(db) = dbias.as_mut() {
                db.slice_mut(s![b, hh, .., ..]).assign(&dp);
            }
            let mut dqb = dq.slice_mut(s![b, hh, .., ..]);
            general_mat_mul(o.scale, &dp, &km, T::zero(), &mut dqb);
            let mut dkb = dk.slice_mut(s![b, kv, .., ..]);
            general_mat_mul(o.scale, &dp.t(), &qm, T::one(), &mut dkb);
        }
    }
    let d = |k: usize, f: zerosched_ir::Dtype| env.out_meta_k(k).map_or(f, |m| m.dtype);
    let mut outs = vec![
        Some(T::wrap(dq.into_dyn(), d(0, qt.dtype))?),
        Some(T::wrap(dk.into_dyn(), d(1, kt.dtype))?),
        Some(T::wrap(dv.into_dyn(), d(2, vt.dtype))?),
    ];
    if f.b_grad_mask.is_some() {
        outs.push(match (dbias, &o.mask) {
            (Some(db), Some((_, shape))) => Some(T::wrap(sum_to(db, shape)?, d(3, qt.dtype))?),
            _ => None,
        });
    }
    Ok(Value::List(outs))
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
    let opt = |i: usize, name: &str| -> Result<Option<zerosched_exec::host::Arr<T>>, String> {
        match env.arg_or_kw(i, name) {
            Some(a @ Arg::Node(_)) => Ok(Some(T::get(env.tensor(a)?))),
            _ => Ok(None),
        }
    };
    let (w, bias) = (opt(2, "weight")?, opt(3, "bias")?);
    let eps = T::from_f64(env.arg_or_kw(4, "eps").and_then(number).unwrap_or(1e-5));
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

/// `native_layer_norm(input, normalized_shape, weight, bias, eps)`: (out, mean, rstd).
pub fn layer_norm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    match env.tensor(env.arg(0)?)?.kind() {
        Kind::F64 => ln::<f64>(env),
        _ => ln::<f32>(env),
    }
}

/// `layer_norm(input, normalized_shape, weight, bias, eps, cudnn_enable)` (the composite op a
/// graph records where autograd does not decompose it): the normalised output alone.
pub fn layer_norm_output(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    match layer_norm(env)? {
        Value::List(outs) => outs
            .into_iter()
            .next()
            .flatten()
            .map(Value::Tensor)
            .ok_or_else(|| "layer norm made no output".to_string()),
        other => Ok(other),
    }
}
