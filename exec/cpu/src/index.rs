//! Indexing: embedding, advanced indexing with index tensors after leading full slices (`index`,
//! `index_put`),
//! `gather`, `scatter`, `scatter_add` and `index_select`. Indices are checked (an index out of range is an error naming it,
//! never a panic); negative indices count from the end as in torch.

use super::elementwise::bcast_shape;
use super::{Env, Value, flag, int, norm_dim, number, one, out_dtype};
use ndarray::{ArrayD, Dimension, IxDyn};
use zerosched_exec::host::{Arr, Data, Elem, Tensor};
use zerosched_ir::{Arg, NodeId};

/// Accumulation for `index_put(accumulate=True)` and the scatter reductions.
trait Acc: Elem {
    fn acc(self, other: Self) -> Self;
    fn prod(self, other: Self) -> Self;
}
impl Acc for f32 {
    fn acc(self, o: f32) -> f32 {
        self + o
    }
    fn prod(self, o: f32) -> f32 {
        self * o
    }
}
impl Acc for f64 {
    fn acc(self, o: f64) -> f64 {
        self + o
    }
    fn prod(self, o: f64) -> f64 {
        self * o
    }
}
impl Acc for i64 {
    fn acc(self, o: i64) -> i64 {
        self.wrapping_add(o)
    }
    fn prod(self, o: i64) -> i64 {
        self.wrapping_mul(o)
    }
}
impl Acc for bool {
    fn acc(self, o: bool) -> bool {
        self | o
    }
    fn prod(self, o: bool) -> bool {
        self & o
    }
}

/// How a scatter combines a source value with the element it lands on.
#[derive(Clone, Copy)]
enum Combine {
    Set,
    Add,
    Multiply,
}

impl Combine {
    fn apply<T: Acc>(self, old: T, v: T) -> T {
        match self {
            Combine::Set => v,
            Combine::Add => old.acc(v),
            Combine::Multiply => old.prod(v),
        }
    }
}

fn fix(i: i64, n: usize) -> Result<usize, String> {
    let x = if i < 0 { i + n as i64 } else { i };
    if (0..n as i64).contains(&x) {
        Ok(x as usize)
    } else {
        Err(format!(
            "index {i} is out of range for a dimension of size {n}"
        ))
    }
}

/// Flat offsets (into a row-major `shape`) selected by leading index tensors, and the
/// broadcast index shape.
fn offsets(shape: &[usize], idx: &[Arr<i64>]) -> Result<(Vec<usize>, Vec<usize>), String> {
    if idx.len() > shape.len() {
        return Err("too many indices".into());
    }
    let mut b: Vec<usize> = Vec::new();
    for i in idx {
        b = bcast_shape(&b, i.shape())?;
    }
    let n: usize = b.iter().product();
    let strides: Vec<usize> = (0..idx.len())
        .map(|j| shape[j + 1..].iter().product())
        .collect();
    let mut off = vec![0usize; n];
    for (j, i) in idx.iter().enumerate() {
        let v = i.broadcast(IxDyn(&b)).ok_or("index broadcast failed")?;
        for (o, &x) in off.iter_mut().zip(v.iter()) {
            *o += fix(x, shape[j])? * strides[j];
        }
    }
    Ok((off, b))
}

fn index_t<T: Elem>(a: &Arr<T>, idx: &[Arr<i64>]) -> Result<ArrayD<T>, String> {
    let shape = a.shape();
    let (off, b) = offsets(shape, idx)?;
    let inner: usize = shape[idx.len()..].iter().product();
    let flat: Vec<T> = a.iter().copied().collect();
    let mut out = Vec::with_capacity(off.len() * inner);
    for o in off {
        out.extend_from_slice(&flat[o..o + inner]);
    }
    let mut oshape = b;
    oshape.extend_from_slice(&shape[idx.len()..]);
    ArrayD::from_shape_vec(IxDyn(&oshape), out).map_err(|e| e.to_string())
}

fn put_t<T: Acc>(a: &Arr<T>, idx: &[Arr<i64>], v: &Arr<T>, acc: bool) -> Result<ArrayD<T>, String> {
    let shape = a.shape().to_vec();
    let (off, mut b) = offsets(&shape, idx)?;
    let inner: usize = shape[idx.len()..].iter().product();
    b.extend_from_slice(&shape[idx.len()..]);
    let vals: Vec<T> = v
        .broadcast(IxDyn(&b))
        .ok_or_else(|| {
            format!(
                "index_put: values {:?} do not broadcast to {b:?}",
                v.shape()
            )
        })?
        .iter()
        .copied()
        .collect();
    let mut flat: Vec<T> = a.iter().copied().collect();
    for (k, o) in off.into_iter().enumerate() {
        for e in 0..inner {
            let x = vals[k * inner + e];
            flat[o + e] = if acc { flat[o + e].acc(x) } else { x };
        }
    }
    ArrayD::from_shape_vec(IxDyn(&shape), flat).map_err(|e| e.to_string())
}

/// Index tensors after `lead` leading `None`s (full slices, as `x[:, :, i, j]` writes;
/// `None`s after the last tensor are full slices too).
struct Indices {
    lead: usize,
    idx: Vec<Arr<i64>>,
}

fn index_list(env: &Env<'_, Tensor>, a: &Arg<NodeId>) -> Result<Indices, String> {
    let items = a.as_list().ok_or("indices are not a list")?;
    let lead = items.iter().take_while(|i| matches!(i, Arg::None)).count();
    let last = items
        .iter()
        .rposition(|i| !matches!(i, Arg::None))
        .map_or(lead, |p| p + 1);
    let idx = items[lead..last]
        .iter()
        .map(|i| match i {
            Arg::None => Err(
                "a `None` index between index tensors (only leading and trailing ones are supported)"
                    .to_owned(),
            ),
            _ => {
                let t = env.tensor(i)?;
                if t.dtype == zerosched_ir::Dtype::Bool {
                    return Err("boolean mask indices are not supported".to_owned());
                }
                Ok(i64::get(t))
            }
        })
        .collect::<Result<_, _>>()?;
    Ok(Indices { lead, idx })
}

/// `a` as `[L, rest...]`, `L` the product of its first `lead` dimensions, and those dimensions.
fn split_lead<T: Clone>(a: &Arr<T>, lead: usize) -> Result<(ArrayD<T>, Vec<usize>), String> {
    let shape = a.shape();
    if lead > shape.len() {
        return Err("too many indices".into());
    }
    let mut flat = vec![shape[..lead].iter().product::<usize>()];
    flat.extend_from_slice(&shape[lead..]);
    let r = a
        .to_owned()
        .into_shape_with_order(IxDyn(&flat))
        .map_err(|e| e.to_string())?;
    Ok((r, shape[..lead].to_vec()))
}

/// `x[(:,) * lead, idx...]`: the leading-index gather on each slice of the leading dimensions.
fn index_lead<T: Elem>(a: &Arr<T>, ix: &Indices) -> Result<ArrayD<T>, String> {
    if ix.lead == 0 {
        return index_t(a, &ix.idx);
    }
    let (flat, lead_shape) = split_lead(a, ix.lead)?;
    let parts: Vec<ArrayD<T>> = flat
        .outer_iter()
        .map(|sub| index_t(&sub.to_owned().into_shared(), &ix.idx))
        .collect::<Result<_, _>>()?;
    let views: Vec<_> = parts.iter().map(|p| p.view()).collect();
    let stacked = ndarray::stack(ndarray::Axis(0), &views)
        .map_err(|_| "index over an empty leading dimension".to_owned())?;
    let mut shape = lead_shape;
    shape.extend_from_slice(&stacked.shape()[1..]);
    stacked
        .into_shape_with_order(IxDyn(&shape))
        .map_err(|e| e.to_string())
}

/// `index_put` after `lead` full slices: each leading slice put with its slice of the values.
fn put_lead<T: Acc>(a: &Arr<T>, ix: &Indices, v: &Arr<T>, acc: bool) -> Result<ArrayD<T>, String> {
    if ix.lead == 0 {
        return put_t(a, &ix.idx, v, acc);
    }
    let (flat, _) = split_lead(a, ix.lead)?;
    // The values broadcast to the selection's shape: leading dims, index shape, the rest.
    let mut b: Vec<usize> = Vec::new();
    for i in &ix.idx {
        b = bcast_shape(&b, i.shape())?;
    }
    let mut full = a.shape()[..ix.lead].to_vec();
    full.extend_from_slice(&b);
    full.extend_from_slice(a.shape().get(ix.lead + ix.idx.len()..).unwrap_or(&[]));
    let vb = v
        .broadcast(IxDyn(&full))
        .ok_or_else(|| {
            format!(
                "index_put: values {:?} do not broadcast to {full:?}",
                v.shape()
            )
        })?
        .to_owned()
        .into_shared();
    let (vflat, _) = split_lead(&vb, ix.lead)?;
    let parts: Vec<ArrayD<T>> = flat
        .outer_iter()
        .zip(vflat.outer_iter())
        .map(|(sub, vs)| {
            put_t(
                &sub.to_owned().into_shared(),
                &ix.idx,
                &vs.to_owned().into_shared(),
                acc,
            )
        })
        .collect::<Result<_, _>>()?;
    let views: Vec<_> = parts.iter().map(|p| p.view()).collect();
    if views.is_empty() {
        return Ok(a.to_owned());
    }
    ndarray::stack(ndarray::Axis(0), &views)
        .map_err(|e| e.to_string())?
        .into_shape_with_order(IxDyn(a.shape()))
        .map_err(|e| e.to_string())
}

macro_rules! on_kind {
    ($t:expr, $T:ident, $a:ident => $e:expr) => {
        match &$t.data {
            Data::F32($a) => {
                type $T = f32;
                Tensor {
                    dtype: $t.dtype,
                    data: Data::F32($e.into_shared()),
                }
            }
            Data::F64($a) => {
                type $T = f64;
                Tensor {
                    dtype: $t.dtype,
                    data: Data::F64($e.into_shared()),
                }
            }
            Data::I64($a) => {
                type $T = i64;
                Tensor {
                    dtype: $t.dtype,
                    data: Data::I64($e.into_shared()),
                }
            }
            Data::Bool($a) => {
                type $T = bool;
                Tensor {
                    dtype: $t.dtype,
                    data: Data::Bool($e.into_shared()),
                }
            }
        }
    };
}

pub fn embedding(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let w = env.tensor(env.arg(0)?)?;
    let idx = vec![i64::get(env.tensor(env.arg(1)?)?)];
    one(on_kind!(w, T, a => index_t::<T>(a, &idx)?))
}

pub fn index(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let idx = index_list(env, env.arg(1)?)?;
    one(on_kind!(x, T, a => index_lead::<T>(a, &idx)?))
}

pub fn index_put(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let idx = index_list(env, env.arg(1)?)?;
    let v = env.tensor(env.arg(2)?)?;
    let acc = flag(env.arg_or_kw(3, "accumulate"), false);
    let out = on_kind!(x, T, a => put_lead::<T>(a, &idx, &T::get(v), acc)?);
    one(out.cast(out_dtype(env, x.dtype))?)
}

pub fn gather(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let d = norm_dim(int(env.arg(1)?)?, x.shape().len())?;
    let idx = i64::get(env.tensor(env.arg(2)?)?);
    fn go<T: Elem>(a: &Arr<T>, d: usize, idx: &Arr<i64>) -> Result<ArrayD<T>, String> {
        let n = a.shape()[d];
        let mut out = Vec::with_capacity(idx.len());
        for (p, &i) in idx.indexed_iter() {
            let mut q: Vec<usize> = p.slice().to_vec();
            q[d] = fix(i, n)?;
            out.push(
                *a.get(q.as_slice())
                    .ok_or("gather: index outside the input")?,
            );
        }
        ArrayD::from_shape_vec(IxDyn(idx.shape()), out).map_err(|e| e.to_string())
    }
    one(on_kind!(x, T, a => go::<T>(a, d, &idx)?))
}

/// `scatter.value(self, dim, index, value)`, `scatter.src(self, dim, index, src)`, their
/// `reduce=` forms (`'add'`, `'multiply'`) and `scatter_add(self, dim, index, src)`
/// (combining in index order).
fn scatter_into(env: &Env<'_, Tensor>, how: Combine) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let d = norm_dim(int(env.arg(1)?)?, x.shape().len())?;
    let idx = i64::get(env.tensor(env.arg(2)?)?);
    let src = env.arg(3)?;
    let src_t = match src.as_node() {
        Some(_) => env.tensor(src)?.clone(),
        None => Tensor::scalar(
            number(src).ok_or("scatter: value is not a number")?,
            x.dtype,
        )?,
    };
    fn go<T: Acc>(
        a: &Arr<T>,
        d: usize,
        idx: &Arr<i64>,
        src: &Arr<T>,
        how: Combine,
    ) -> Result<ArrayD<T>, String> {
        let mut out = a.to_owned();
        if a.ndim() == 0 {
            // A 0-d tensor is one element along its only (implicit) dimension.
            for &i in idx.iter() {
                fix(i, 1)?;
                let v = *src.first().ok_or("scatter: empty src")?;
                let o = out.first_mut().ok_or("scatter: empty input")?;
                *o = how.apply(*o, v);
            }
            return Ok(out);
        }
        let n = a.shape()[d];
        let scalar = src.ndim() == 0;
        for (p, &i) in idx.indexed_iter() {
            let v = if scalar {
                *src.first().ok_or("empty value")?
            } else {
                *src.get(p.slice()).ok_or("scatter: index outside src")?
            };
            let mut q: Vec<usize> = p.slice().to_vec();
            q[d] = fix(i, n)?;
            let o = out
                .get_mut(q.as_slice())
                .ok_or("scatter: index outside the input")?;
            *o = how.apply(*o, v);
        }
        Ok(out)
    }
    one(on_kind!(x, T, a => go::<T>(a, d, &idx, &T::get(&src_t), how)?))
}

pub fn scatter(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let how = match env.arg_or_kw(4, "reduce") {
        None | Some(Arg::None) => Combine::Set,
        Some(Arg::Str(s)) if s == "add" => Combine::Add,
        Some(Arg::Str(s)) if s == "multiply" => Combine::Multiply,
        Some(a) => {
            return Err(format!(
                "scatter: reduce={a:?} is neither 'add' nor 'multiply'"
            ));
        }
    };
    scatter_into(env, how)
}

pub fn scatter_add(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    scatter_into(env, Combine::Add)
}

/// `index_select(self, dim, index)`: the entries of `index` (0-d or 1-d) along `dim`.
pub fn index_select(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let it = env.tensor(env.arg(2)?)?;
    if it.shape().len() > 1 {
        return Err(format!(
            "index_select: index of shape {:?} (0-d or 1-d only)",
            it.shape()
        ));
    }
    let rank = x.shape().len();
    let d = norm_dim(int(env.arg(1)?)?, rank)?;
    let base = if rank == 0 {
        x.reshape(&[1])?
    } else {
        x.clone()
    };
    let n = base.shape()[d];
    let idx: Vec<usize> = i64::get(it)
        .iter()
        .map(|&i| fix(i, n))
        .collect::<Result<_, _>>()?;
    let out =
        zerosched_exec::host::map_data!(&base, a => a.select(ndarray::Axis(d), &idx).into_shared());
    // A 0-d input gives a 0-d result, whatever the index's rank.
    let shape = if rank == 0 {
        Vec::new()
    } else {
        out.shape().to_vec()
    };
    one(out.reshape(&shape)?)
}

/// `scatter_reduce.two(self, dim, index, src, reduce, include_self=True)` with `reduce` one
/// of sum, prod, mean, amax, amin: each element of `self` that an index names combined with
/// every source value scattered to it (and with itself when `include_self`), in f64 (i64 for
/// integers, whose mean rounds down as torch's); a NaN wins amax / amin.
pub fn scatter_reduce(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let rank = x.shape().len();
    let d = norm_dim(int(env.arg(1)?)?, rank)?;
    let idx = i64::get(env.tensor(env.arg(2)?)?);
    let src = env.tensor(env.arg(3)?)?;
    let how = match env.arg(4)? {
        Arg::Str(s) if ["sum", "prod", "mean", "amax", "amin"].contains(&s.as_str()) => s.clone(),
        a => return Err(format!("scatter_reduce: reduce={a:?}")),
    };
    let include = flag(env.arg_or_kw(5, "include_self"), true);
    let shape = x.shape().to_vec();
    let n = shape.get(d).copied().unwrap_or(1);
    let integer = !x.dtype.is_floating();
    let base: Vec<f64> = x.to_f64_vec();
    let sv = f64::get(src);
    // Values landing on each element of `self`, in index order.
    let mut landed: Vec<Vec<f64>> = vec![Vec::new(); base.len()];
    let strides: Vec<usize> = (0..rank).map(|k| shape[k + 1..].iter().product()).collect();
    for (p, &i) in idx.indexed_iter() {
        let v = *sv
            .get(p.slice())
            .ok_or("scatter_reduce: index outside src")?;
        let mut off = 0;
        for (k, &c) in p.slice().iter().enumerate() {
            let c = if k == d { fix(i, n)? } else { c };
            if c >= *shape.get(k).unwrap_or(&1) {
                return Err("scatter_reduce: index outside the input".into());
            }
            off += c * strides.get(k).copied().unwrap_or(1);
        }
        landed[off].push(v);
    }
    let out: Vec<f64> = base
        .iter()
        .zip(&landed)
        .map(|(&s, vs)| {
            if vs.is_empty() {
                return s;
            }
            let all: Vec<f64> = if include {
                std::iter::once(s).chain(vs.iter().copied()).collect()
            } else {
                vs.clone()
            };
            let pick = |max: bool| {
                all.iter().copied().fold(all[0], |b, v| {
                    if b.is_nan() || v.is_nan() {
                        f64::NAN
                    } else if (v > b) == max && v != b {
                        v
                    } else {
                        b
                    }
                })
            };
            match how.as_str() {
                "sum" => all.iter().sum(),
                "prod" => all.iter().product(),
                "mean" => {
                    let m = all.iter().sum::<f64>() / all.len() as f64;
                    if integer { m.floor() } else { m }
                }
                "amax" => pick(true),
                _ => pick(false),
            }
        })
        .collect();
    let a = ArrayD::from_shape_vec(IxDyn(&shape), out).map_err(|e| e.to_string())?;
    one(f64::wrap(a, out_dtype(env, x.dtype))?)
}

/// `index_add(self, dim, index, source, alpha=1)`: `alpha * source`'s slices along `dim`
/// added to `self`'s slices that `index` names, in index order.
pub fn index_add(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let rank = x.shape().len();
    let d = norm_dim(int(env.arg(1)?)?, rank)?;
    let idx = i64::get(env.tensor(env.arg(2)?)?);
    let src = env.tensor(env.arg(3)?)?;
    let alpha = env
        .node()
        .kwargs
        .get("alpha")
        .and_then(number)
        .unwrap_or(1.0);
    let dt = out_dtype(env, x.dtype);
    let base = if rank == 0 {
        x.reshape(&[1])?
    } else {
        x.clone()
    };
    let srcb = if src.shape().is_empty() {
        src.reshape(&[1])?
    } else {
        src.clone()
    };
    let n = base.shape()[d];
    if idx.len() != srcb.shape().get(d).copied().unwrap_or(0) {
        return Err(format!(
            "index_add: {} indices for a source of {:?} along {d}",
            idx.len(),
            src.shape()
        ));
    }
    fn go<T: Acc>(
        a: &Arr<T>,
        s: &Arr<T>,
        d: usize,
        idx: &[usize],
        alpha: T,
        scale: bool,
    ) -> Result<ArrayD<T>, String> {
        let mut out = a.to_owned();
        for (k, &i) in idx.iter().enumerate() {
            let from = s.index_axis(ndarray::Axis(d), k);
            let mut to = out.index_axis_mut(ndarray::Axis(d), i);
            if to.shape() != from.shape() {
                return Err(format!(
                    "index_add: slices {:?} and {:?}",
                    to.shape(),
                    from.shape()
                ));
            }
            ndarray::Zip::from(&mut to).and(&from).for_each(|o, &v| {
                *o = o.acc(if scale { v.prod(alpha) } else { v });
            });
        }
        Ok(out)
    }
    let idx: Vec<usize> = idx.iter().map(|&i| fix(i, n)).collect::<Result<_, _>>()?;
    let srcc = srcb.cast(base.dtype)?;
    let scale = alpha != 1.0;
    let out = match (&base.data, &srcc.data) {
        (Data::F32(a), Data::F32(s)) => f32::wrap(go(a, s, d, &idx, alpha as f32, scale)?, dt)?,
        (Data::F64(a), Data::F64(s)) => f64::wrap(go(a, s, d, &idx, alpha, scale)?, dt)?,
        (Data::I64(a), Data::I64(s)) => i64::wrap(go(a, s, d, &idx, alpha as i64, scale)?, dt)?,
        (Data::Bool(a), Data::Bool(s)) => bool::wrap(go(a, s, d, &idx, alpha != 0.0, scale)?, dt)?,
        _ => return Err("index_add of mixed kinds".into()),
    };
    one(out.reshape(x.shape())?)
}
