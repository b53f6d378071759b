//! Reductions along dimensions: sum, mean, cumsum, (log-)softmax, topk. Sums run in the output
//! dtype's compute type, one dimension at a time from the last listed, in ndarray's fixed
//! order: the same data gives the same bits on every run.

use super::tensor::{Elem, Kind, Tensor, kind};
use super::{Env, Value, flag, int, ints, norm_dim, one, out_dtype};
use ndarray::{ArrayD, Axis, IxDyn, Zip};
use zerosched_ir::{Arg, Dtype};

fn dims_of(a: Option<&Arg<zerosched_ir::NodeId>>, rank: usize) -> Result<Vec<usize>, String> {
    let list = match a {
        None | Some(Arg::None) => Vec::new(),
        Some(a) => ints(a)?,
    };
    let mut dims: Vec<usize> = if list.is_empty() {
        (0..rank).collect()
    } else {
        list.into_iter()
            .map(|d| norm_dim(d, rank))
            .collect::<Result<_, _>>()?
    };
    dims.sort_unstable();
    dims.dedup();
    Ok(dims)
}

fn sum_dims<T>(mut a: ArrayD<T>, dims: &[usize], keep: bool) -> ArrayD<T>
where
    T: Clone + num_traits::Zero + std::ops::Add<Output = T>,
{
    for &d in dims.iter().rev() {
        a = a.sum_axis(Axis(d));
        if keep {
            a = a.insert_axis(Axis(d));
        }
    }
    a
}

fn reduce(env: &Env<'_, Tensor>, mean: bool) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let rank = t.shape().len();
    let dims = dims_of(env.node().args.get(1), rank)?;
    let keep = flag(env.arg_or_kw(2, "keepdim"), false);
    let dt = out_dtype(env, t.dtype);
    let count: usize = dims.iter().map(|&d| t.shape()[d]).product();
    one(match kind(dt)? {
        Kind::F32 => {
            let s = sum_dims(f32::get(t).into_owned(), &dims, keep);
            f32::wrap(
                if mean {
                    s.mapv(|x| x / count as f32)
                } else {
                    s
                },
                dt,
            )?
        }
        Kind::F64 => {
            let s = sum_dims(f64::get(t).into_owned(), &dims, keep);
            f64::wrap(
                if mean {
                    s.mapv(|x| x / count as f64)
                } else {
                    s
                },
                dt,
            )?
        }
        _ => i64::wrap(sum_dims(i64::get(t).into_owned(), &dims, keep), dt)?,
    })
}

pub fn sum(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    reduce(env, false)
}

pub fn mean(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    reduce(env, true)
}

pub fn cumsum(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let d = norm_dim(int(env.arg(1)?)?, t.shape().len())?;
    let dt = out_dtype(env, t.dtype);
    macro_rules! go {
        ($T:ty) => {{
            let mut a = <$T>::get(t).into_owned();
            a.accumulate_axis_inplace(Axis(d), |&prev, cur| *cur += prev);
            <$T>::wrap(a, dt)?
        }};
    }
    one(match kind(dt)? {
        Kind::F32 => go!(f32),
        Kind::F64 => go!(f64),
        _ => go!(i64),
    })
}

fn softmax_impl(env: &Env<'_, Tensor>, log: bool) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let d = norm_dim(int(env.arg(1)?)?, t.shape().len())?;
    let dt = out_dtype(env, t.dtype);
    macro_rules! go {
        ($T:ty) => {{
            let mut a = <$T>::get(t).into_owned();
            for mut lane in a.lanes_mut(Axis(d)) {
                let m = lane.iter().copied().fold(<$T>::NEG_INFINITY, <$T>::max);
                let m = if m.is_finite() { m } else { 0.0 };
                let s: $T = lane.iter().map(|&x| (x - m).exp()).sum();
                if log {
                    let l = s.ln();
                    lane.mapv_inplace(|x| x - m - l);
                } else {
                    lane.mapv_inplace(|x| (x - m).exp() / s);
                }
            }
            <$T>::wrap(a, dt)?
        }};
    }
    one(match kind(dt)? {
        Kind::F64 => go!(f64),
        Kind::F32 => go!(f32),
        k => return Err(format!("softmax of a {k:?} tensor")),
    })
}

pub fn softmax(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    softmax_impl(env, false)
}

pub fn log_softmax(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    softmax_impl(env, true)
}

/// `topk(x, k, dim=-1, largest=True, sorted=True)`: values and int64 indices; ties keep the
/// lower index first (a stable sort), NaN counts as largest.
pub fn topk(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let k = int(env.arg(1)?)?.max(0) as usize;
    let rank = t.shape().len();
    let d = norm_dim(
        env.arg_or_kw(2, "dim")
            .and_then(|a| a.as_int())
            .unwrap_or(-1),
        rank,
    )?;
    let largest = flag(env.arg_or_kw(3, "largest"), true);
    if k > t.shape()[d] {
        return Err(format!("topk: k = {k} > {}", t.shape()[d]));
    }
    let mut shape = t.shape().to_vec();
    shape[d] = k;
    let x = f64::get(t);
    let mut vals = ArrayD::<f64>::zeros(IxDyn(&shape));
    let mut idx = ArrayD::<i64>::zeros(IxDyn(&shape));
    Zip::from(vals.lanes_mut(Axis(d)))
        .and(idx.lanes_mut(Axis(d)))
        .and(x.lanes(Axis(d)))
        .for_each(|mut v, mut ix, src| {
            let mut order: Vec<usize> = (0..src.len()).collect();
            let key = |i: usize| src[i];
            order.sort_by(|&a, &b| {
                let (x, y) = (key(a), key(b));
                let c = if x.is_nan() || y.is_nan() {
                    y.is_nan().cmp(&x.is_nan()).reverse()
                } else {
                    x.partial_cmp(&y).unwrap_or(std::cmp::Ordering::Equal)
                };
                if largest { c.reverse() } else { c }
            });
            for (j, &o) in order.iter().take(k).enumerate() {
                v[j] = src[o];
                ix[j] = o as i64;
            }
        });
    let vd = env.out_meta_k(0).map_or(t.dtype, |m| m.dtype);
    Ok(Value::List(vec![
        Some(f64::wrap(vals, vd)?),
        Some(i64::wrap(idx, Dtype::Int64)?),
    ]))
}
