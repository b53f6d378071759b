//! Scaled dot-product attention by its math definition (`_scaled_dot_product_flash_attention`
//! and its `_for_cpu` form with their backwards, the ops an export on a GPU and on the CPU
//! records): cuBLAS batched products and the generated
//! softmax and elementwise kernels, in f32 throughout as the CPU backend computes, rounded to
//! the outputs' dtypes once. With 16-bit inputs the products run on TF32 tensor cores: exact
//! where an operand holds the inputs' values, within 2^-11 where it holds probabilities or
//! their gradients, finer than the 16-bit outputs they end in. Grouped-query heads read their
//! key/value head; a boolean mask keeps where true, a float mask is added, `is_causal` masks above the diagonal, and a row
//! with nothing kept is 0 with a log-sum-exp of -inf.

use super::{CudaTensor, Env, Temps, Value, dense};
use crate::backend::{Cuda, number, product_scaled, reduce_dims, tensor};
use crate::kernels::contiguous_strides;
use crate::kernels::source::{Reduce, Softmax};
use crate::matmul::Math;
use zerosched_ir::{Arg, Dtype};

const F32: Dtype = Dtype::Float32;

/// The sizes of one attention: batch, query heads, key/value heads, query and key lengths,
/// and the query/key and value widths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub h: usize,
    pub hk: usize,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    pub ev: usize,
}

impl Dims {
    pub fn of(q: &[usize], k: &[usize], v: &[usize]) -> Result<Dims, String> {
        let (&[b, h, l, e], &[bk, hk, s, ek], &[bv, hv, sv, ev]) = (q, k, v) else {
            return Err(format!(
                "attention of {q:?}, {k:?}, {v:?} (4-d tensors expected)"
            ));
        };
        if hk == 0 || h % hk != 0 || hv != hk || bk != b || bv != b || sv != s || ek != e {
            return Err(format!(
                "attention of {q:?}, {k:?}, {v:?}: shapes do not agree"
            ));
        }
        Ok(Dims {
            b,
            h,
            hk,
            l,
            s,
            e,
            ev,
        })
    }
}

struct Opts {
    scale: f64,
    causal: bool,
    mask: Option<CudaTensor>,
    math: Math,
}

/// The options of an attention of `qkv` (query, key, value).
fn opts(
    env: &Env<'_, CudaTensor>,
    dropout_at: usize,
    e: usize,
    qkv: [&CudaTensor; 3],
) -> Result<Opts, String> {
    let n = env.node();
    if n.args.get(dropout_at).and_then(number).unwrap_or(0.0) != 0.0 {
        return Err("dropout in attention is not supported".into());
    }
    let causal = matches!(
        n.args.get(dropout_at + 1).or(n.kwargs.get("is_causal")),
        Some(Arg::Bool(true))
    );
    let scale = n
        .kwargs
        .get("scale")
        .and_then(number)
        .unwrap_or(1.0 / (e as f64).sqrt());
    let mask = match n.kwargs.get("attn_mask") {
        Some(a @ Arg::Node(_)) => Some(env.tensor(a)?.clone()),
        _ => None,
    };
    let sixteen = qkv
        .iter()
        .all(|t| matches!(t.dtype, Dtype::BFloat16 | Dtype::Float16));
    Ok(Opts {
        scale,
        causal,
        mask,
        math: if sixteen { Math::Tf32 } else { Math::Exact },
    })
}

/// `[b, hk, s, x]` as a contiguous f32 `[b*h, s, x]`, each key/value head repeated for its
/// `h / hk` query heads.
fn per_head(
    c: &mut Cuda,
    t: &CudaTensor,
    d: &Dims,
    temps: &mut Temps,
) -> Result<CudaTensor, String> {
    let g = d.h / d.hk;
    let (s, x) = (t.shape[2], t.shape[3]);
    let st = &t.strides;
    let wide = t.restride(
        vec![d.b, d.hk, g, s, x],
        vec![st[0], st[1], 0, st[2], st[3]],
        t.offset,
    );
    let out = c.empty(F32, &[d.b, d.hk, g, s, x])?;
    temps.0.push(out.clone());
    c.ew_into("copy", &[&wide], &out, 0.0)?;
    Ok(out.restride(
        vec![d.b * d.h, s, x],
        contiguous_strides(&[d.b * d.h, s, x]),
        0,
    ))
}

/// The masked, scaled scores `[b*h, l, s]` (f32) of `q3` `[b*h, l, e]` and `k3` `[b*h, s, e]`.
fn scores(
    c: &mut Cuda,
    q3: &CudaTensor,
    k3: &CudaTensor,
    d: &Dims,
    o: &Opts,
    temps: &mut Temps,
) -> Result<CudaTensor, String> {
    let bh = d.b * d.h;
    let kt = k3.restride(
        vec![bh, d.e, d.s],
        vec![(d.s * d.e) as i64, 1, d.e as i64],
        0,
    );
    let mut sc = product_scaled(c, q3, &kt, F32, o.scale as f32, o.math)?;
    temps.0.push(sc.clone());
    let four = |t: &CudaTensor| {
        t.restride(
            vec![d.b, d.h, d.l, d.s],
            contiguous_strides(&[d.b, d.h, d.l, d.s]),
            0,
        )
    };
    if let Some(m) = &o.mask {
        let next = if m.dtype == Dtype::Bool {
            c.ew("mask_scores", &[&four(&sc), m], F32, 0.0)?
        } else {
            c.ew("add", &[&four(&sc), m], F32, 1.0)?
        };
        temps.0.push(next.clone());
        sc = next;
    }
    if o.causal {
        // keep[i, j] = i >= j, from two index ramps.
        let rows = c.empty(Dtype::Int64, &[d.l, 1])?;
        temps.0.push(rows.clone());
        c.k.elementwise("arange", &[], &rows.view()?, 0.0, 1.0)
            .map_err(|e| e.to_string())?;
        let cols = c.empty(Dtype::Int64, &[1, d.s])?;
        temps.0.push(cols.clone());
        c.k.elementwise("arange", &[], &cols.view()?, 0.0, 1.0)
            .map_err(|e| e.to_string())?;
        let keep = c.ew("ge", &[&rows, &cols], Dtype::Bool, 0.0)?;
        temps.0.push(keep.clone());
        let next = c.ew("mask_scores", &[&four(&sc), &keep], F32, 0.0)?;
        temps.0.push(next.clone());
        sc = next;
    }
    Ok(sc.restride(vec![bh, d.l, d.s], contiguous_strides(&[bh, d.l, d.s]), 0))
}

fn cast(c: &mut Cuda, t: &CudaTensor, shape: &[usize], dt: Dtype) -> Result<CudaTensor, String> {
    let v = t.restride(shape.to_vec(), contiguous_strides(shape), 0);
    c.ew("copy", &[&v], dt, 0.0)
}

/// The GPU form (`_scaled_dot_product_flash_attention`, not `_for_cpu`): its backward takes
/// the sequence bookkeeping and RNG state the forward returns, which moves `dropout_p` and
/// `is_causal` from 6 and 7 to 10 and 11.
fn gpu_form(env: &Env<'_, CudaTensor>) -> bool {
    !env.node().target.contains("_for_cpu")
}

/// The outputs past `(out, logsumexp)` the node records (the GPU form's sequence bookkeeping,
/// RNG state and debug mask): zeros of their recorded shapes, `None` where none is recorded.
/// Without dropout nothing reads their values.
fn bookkeeping(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Vec<Option<CudaTensor>>, String> {
    let mut outs = vec![];
    for k in 2..env.n_outputs(2) {
        let Some(m) = env.out_meta_k(k) else {
            outs.push(None);
            continue;
        };
        let shape = m.hint_dims();
        match c.full(m.dtype, &shape, 0.0) {
            Ok(t) => outs.push(Some(t)),
            Err(e) => {
                outs.iter().flatten().for_each(|t| c.release(t));
                return Err(e);
            }
        }
    }
    Ok(outs)
}

/// `(query, key, value, dropout_p, is_causal, *, attn_mask, scale)`: `(out, logsumexp)`, and
/// the GPU form's bookkeeping outputs after them.
pub fn forward(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let (q, k, v) = (tensor(env, 0)?, tensor(env, 1)?, tensor(env, 2)?);
    let d = Dims::of(&q.shape, &k.shape, &v.shape)?;
    let o = opts(env, 3, d.e, [q, k, v])?;
    let d0 = env.out_meta_k(0).map_or(q.dtype, |m| m.dtype);
    let d1 = env.out_meta_k(1).map_or(F32, |m| m.dtype);
    let mut temps = Temps(vec![]);
    let res = (|| {
        let bh = d.b * d.h;
        let q3 = dense(c, q, F32, &mut temps)?.restride(
            vec![bh, d.l, d.e],
            contiguous_strides(&[bh, d.l, d.e]),
            0,
        );
        let k3 = per_head(c, k, &d, &mut temps)?;
        let v3 = per_head(c, v, &d, &mut temps)?;
        let sc = scores(c, &q3, &k3, &d, &o, &mut temps)?;
        let p = c.empty(F32, &[bh, d.l, d.s])?;
        temps.0.push(p.clone());
        let lse = c.empty(F32, &[d.b, d.h, d.l])?;
        temps.0.push(lse.clone());
        c.k.softmax(
            sc.block.ptr,
            p.block.ptr,
            crate::kernels::source::Elem::F32,
            bh * d.l,
            d.s,
            Softmax::Safe,
            lse.block.ptr,
        )
        .map_err(|e| e.to_string())?;
        let out = product_scaled(c, &p, &v3, F32, 1.0, o.math)?;
        temps.0.push(out.clone());
        let o4 = cast(c, &out, &[d.b, d.h, d.l, d.ev], d0)?;
        let l = match cast(c, &lse, &[d.b, d.h, d.l], d1) {
            Ok(l) => l,
            Err(e) => {
                c.release(&o4);
                return Err(e);
            }
        };
        match bookkeeping(c, env) {
            Ok(rest) => Ok(Value::List(
                [Some(o4), Some(l)].into_iter().chain(rest).collect(),
            )),
            Err(e) => {
                c.release(&o4);
                c.release(&l);
                Err(e)
            }
        }
    })();
    temps.release(c);
    res
}

/// `(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask,
/// scale)` (the GPU form: `cum_seq_q, cum_seq_k, max_q, max_k` before `dropout_p`, the RNG
/// state after `is_causal`): `(grad_query, grad_key, grad_value)`.
pub fn backward(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let t = |i| tensor(env, i);
    let (go, q, k, v, out, lse) = (t(0)?, t(1)?, t(2)?, t(3)?, t(4)?, t(5)?);
    let d = Dims::of(&q.shape, &k.shape, &v.shape)?;
    if lse.numel() != d.b * d.h * d.l
        || go.numel() != d.b * d.h * d.l * d.ev
        || out.shape != go.shape
    {
        return Err(format!(
            "attention backward: logsumexp {:?}, gradient {:?}, output {:?}",
            lse.shape, go.shape, out.shape
        ));
    }
    let o = opts(env, if gpu_form(env) { 10 } else { 6 }, d.e, [q, k, v])?;
    let dts: Vec<Dtype> = [(0, q.dtype), (1, k.dtype), (2, v.dtype)]
        .iter()
        .map(|&(i, f)| env.out_meta_k(i).map_or(f, |m| m.dtype))
        .collect();
    let mut temps = Temps(vec![]);
    let mut made: Vec<CudaTensor> = vec![];
    let res = (|| {
        let (bh, g) = (d.b * d.h, d.h / d.hk);
        let flat = |t: CudaTensor, x: usize, y: usize| {
            t.restride(vec![bh, x, y], contiguous_strides(&[bh, x, y]), 0)
        };
        let q3 = flat(dense(c, q, F32, &mut temps)?, d.l, d.e);
        let go3 = flat(dense(c, go, F32, &mut temps)?, d.l, d.ev);
        let o3 = flat(dense(c, out, F32, &mut temps)?, d.l, d.ev);
        let lse3 = dense(c, lse, F32, &mut temps)?.restride(
            vec![bh, d.l, 1],
            contiguous_strides(&[bh, d.l, 1]),
            0,
        );
        let k3 = per_head(c, k, &d, &mut temps)?;
        let v3 = per_head(c, v, &d, &mut temps)?;
        let sc = scores(c, &q3, &k3, &d, &o, &mut temps)?;
        let p = c.ew("exp_sub_lse", &[&sc, &lse3], F32, 0.0)?;
        temps.0.push(p.clone());
        let tr = |t: &CudaTensor| {
            let (x, y) = (t.shape[1], t.shape[2]);
            t.restride(vec![bh, y, x], vec![(x * y) as i64, 1, y as i64], 0)
        };
        let dv = product_scaled(c, &tr(&p), &go3, F32, 1.0, o.math)?;
        temps.0.push(dv.clone());
        let dp = product_scaled(c, &go3, &tr(&v3), F32, 1.0, o.math)?;
        temps.0.push(dp.clone());
        let prod = c.ew("mul", &[&go3, &o3], F32, 1.0)?;
        temps.0.push(prod.clone());
        let di = reduce_dims(c, &prod, &[2], true, Reduce::Sum, F32)?;
        temps.0.push(di.clone());
        let ds = c.ew("mul_sub", &[&p, &dp, &di], F32, 0.0)?;
        temps.0.push(ds.clone());
        let dq = product_scaled(c, &ds, &k3, F32, 1.0, o.math)?;
        temps.0.push(dq.clone());
        let dk = product_scaled(c, &tr(&ds), &q3, F32, 1.0, o.math)?;
        temps.0.push(dk.clone());
        // Per query head back to [b, h, ..], key/value heads summed over their query heads.
        let dq4 = cast_scaled(c, &dq, &[d.b, d.h, d.l, d.e], o.scale, dts[0])?;
        made.push(dq4.clone());
        let group = |c: &mut Cuda,
                     t: &CudaTensor,
                     x: usize,
                     scale: f64,
                     dt: Dtype,
                     temps: &mut Temps|
         -> Result<CudaTensor, String> {
            let five = t.restride(
                vec![d.b, d.hk, g, d.s, x],
                contiguous_strides(&[d.b, d.hk, g, d.s, x]),
                0,
            );
            let summed = reduce_dims(c, &five, &[2], false, Reduce::Sum, F32)?;
            temps.0.push(summed.clone());
            cast_scaled(c, &summed, &[d.b, d.hk, d.s, x], scale, dt)
        };
        let dk4 = group(c, &dk, d.e, o.scale, dts[1], &mut temps)?;
        made.push(dk4.clone());
        let dv4 = group(c, &dv, d.ev, 1.0, dts[2], &mut temps)?;
        made.push(dv4.clone());
        Ok(Value::List(vec![Some(dq4), Some(dk4), Some(dv4)]))
    })();
    temps.release(c);
    if res.is_err() {
        for t in &made {
            c.release(t);
        }
    }
    res
}

/// `scale * t` viewed as `shape`, in `dt`.
fn cast_scaled(
    c: &mut Cuda,
    t: &CudaTensor,
    shape: &[usize],
    scale: f64,
    dt: Dtype,
) -> Result<CudaTensor, String> {
    let v = t.restride(shape.to_vec(), contiguous_strides(shape), 0);
    c.ew("mul_scalar", &[&v], dt, scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouped_query_heads_divide_evenly_and_shapes_must_agree() {
        let d = Dims::of(&[2, 8, 16, 4], &[2, 2, 32, 4], &[2, 2, 32, 6]).unwrap();
        assert_eq!((d.h / d.hk, d.s, d.ev), (4, 32, 6));
        assert!(Dims::of(&[2, 8, 16, 4], &[2, 3, 32, 4], &[2, 3, 32, 4]).is_err());
        assert!(Dims::of(&[2, 8, 16, 4], &[2, 2, 32, 5], &[2, 2, 32, 4]).is_err());
        assert!(Dims::of(&[8, 16, 4], &[2, 32, 4], &[2, 32, 4]).is_err());
    }
}
