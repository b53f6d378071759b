//! Reductions along dimensions: sum, mean, cumsum, cumprod, argmax, argmin, (log-)softmax,
//! topk, sort, histc. Sums run
//! in the output dtype's compute type, one dimension at a time from the last listed, in
//! ndarray's fixed order: the same data gives the same bits on every run.

use super::{Env, Value, flag, int, ints, norm_dim, number, one, out_dtype};
use ndarray::{ArrayD, ArrayView1, Axis, IxDyn, Zip};
use zerosched_exec::host::{Data, Elem, Kind, Tensor, kind};
use zerosched_ir::{Arg, Dtype};

pub(crate) fn dims_of(
    a: Option<&Arg<zerosched_ir::NodeId>>,
    rank: usize,
) -> Result<Vec<usize>, String> {
    let list = match a {
        None | Some(Arg::None) => Vec::new(),
        Some(a) => ints(a)?,
    };
    if rank == 0 {
        // A 0-d tensor has no dimension to reduce (torch accepts dim 0 and -1 for it).
        for &d in &list {
            norm_dim(d, rank)?;
        }
        return Ok(Vec::new());
    }
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

/// `cumsum` / `cumprod(x, dim, dtype=None)` along `dim`, in the output dtype's compute type.
fn cumulative(env: &Env<'_, Tensor>, product: bool) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let d = norm_dim(int(env.arg(1)?)?, t.shape().len())?;
    let dt = out_dtype(env, t.dtype);
    // A 0-d tensor is one row of one element (an axis to iterate over, where ndarray has none).
    let shape = t.shape().to_vec();
    let t = &if shape.is_empty() {
        t.reshape(&[1])?
    } else {
        t.clone()
    };
    macro_rules! go {
        ($T:ty, $add:expr, $mul:expr) => {{
            let mut a = <$T>::get(t).into_owned();
            if product {
                a.accumulate_axis_inplace(Axis(d), |&prev, cur| *cur = $mul(*cur, prev));
            } else {
                a.accumulate_axis_inplace(Axis(d), |&prev, cur| *cur = $add(*cur, prev));
            }
            <$T>::wrap(a, dt)?
        }};
    }
    let out = match kind(dt)? {
        Kind::F32 => go!(f32, |a, b| a + b, |a, b| a * b),
        Kind::F64 => go!(f64, |a, b| a + b, |a, b| a * b),
        _ => go!(i64, i64::wrapping_add, i64::wrapping_mul),
    };
    one(out.reshape(&shape)?)
}

pub fn cumsum(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    cumulative(env, false)
}

pub fn cumprod(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    cumulative(env, true)
}

/// The first position of a lane's maximum (`max`) or minimum, a NaN counting as the extreme.
pub(crate) fn lane_arg<T: PartialOrd + Copy>(
    lane: ArrayView1<'_, T>,
    max: bool,
) -> Result<i64, String> {
    #[allow(clippy::eq_op)] // `x != x` is the generic NaN test
    let nan = |x: T| x != x;
    let mut best: Option<(usize, T)> = None;
    for (i, &v) in lane.iter().enumerate() {
        let better = match best {
            None => true,
            Some((_, b)) if nan(b) => false,
            Some((_, b)) => nan(v) || if max { v > b } else { v < b },
        };
        if better {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i as i64)
        .ok_or_else(|| "argmax / argmin of an empty dimension".to_owned())
}

/// `argmax` / `argmin(x, dim=None, keepdim=False)`: the first position of the extreme along
/// `dim` (of the flattened tensor without one), a NaN counting as the extreme, as torch.
fn arg_extreme(env: &Env<'_, Tensor>, max: bool) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let rank = t.shape().len();
    let dim = match env.arg_or_kw(1, "dim") {
        None | Some(Arg::None) => None,
        Some(a) => Some(norm_dim(int(a)?, rank)?),
    };
    let keep = flag(env.arg_or_kw(2, "keepdim"), false);
    fn go<T: Elem>(
        x: &zerosched_exec::host::Arr<T>,
        dim: Option<usize>,
        keep: bool,
        max: bool,
    ) -> Result<ArrayD<i64>, String> {
        match dim {
            None => {
                let flat: Vec<T> = x.iter().copied().collect();
                let i = lane_arg(ArrayView1::from(&flat[..]), max)?;
                let shape = if keep { vec![1; x.ndim()] } else { Vec::new() };
                Ok(ArrayD::from_elem(IxDyn(&shape), i))
            }
            Some(_) if x.ndim() == 0 => {
                let v = [*x.first().ok_or("argmax of an empty tensor")?];
                Ok(ArrayD::from_elem(
                    IxDyn(&[]),
                    lane_arg(ArrayView1::from(&v[..]), max)?,
                ))
            }
            Some(d) => {
                let mut out = Vec::new();
                for lane in x.lanes(Axis(d)) {
                    out.push(lane_arg(lane, max)?);
                }
                let mut shape = x.shape().to_vec();
                shape.remove(d);
                // `lanes` walks the other axes in row-major order.
                let mut a =
                    ArrayD::from_shape_vec(IxDyn(&shape), out).map_err(|e| e.to_string())?;
                if keep {
                    a = a.insert_axis(Axis(d));
                }
                Ok(a)
            }
        }
    }
    let idx = match &t.data {
        Data::F32(a) => go(a, dim, keep, max)?,
        Data::F64(a) => go(a, dim, keep, max)?,
        Data::I64(a) => go(a, dim, keep, max)?,
        Data::Bool(a) => go(a, dim, keep, max)?,
    };
    one(i64::wrap(idx, out_dtype(env, Dtype::Int64))?)
}

pub fn argmax(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    arg_extreme(env, true)
}

pub fn argmin(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    arg_extreme(env, false)
}

fn softmax_impl(env: &Env<'_, Tensor>, log: bool) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let d = norm_dim(int(env.arg(1)?)?, t.shape().len())?;
    let dt = out_dtype(env, t.dtype);
    let shape = t.shape().to_vec();
    let t = &if shape.is_empty() {
        t.reshape(&[1])?
    } else {
        t.clone()
    };
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
    let out = match kind(dt)? {
        Kind::F64 => go!(f64),
        Kind::F32 => go!(f32),
        k => return Err(format!("softmax of a {k:?} tensor")),
    };
    one(out.reshape(&shape)?)
}

pub fn softmax(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    softmax_impl(env, false)
}

pub fn log_softmax(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    softmax_impl(env, true)
}

/// A lane's positions in sorted order, NaN largest (as torch sorts), ties by position (a
/// stable sort).
fn sorted_order<T: PartialOrd + Copy>(lane: ArrayView1<'_, T>, descending: bool) -> Vec<usize> {
    #[allow(clippy::eq_op)] // `x != x` is the generic NaN test
    let nan = |x: T| x != x;
    let mut order: Vec<usize> = (0..lane.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (lane[a], lane[b]);
        let c = match x.partial_cmp(&y) {
            Some(c) => c,
            None => nan(x).cmp(&nan(y)),
        };
        if descending { c.reverse() } else { c }
    });
    order
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
    let vd = env.out_meta_k(0).map_or(t.dtype, |m| m.dtype);
    select_sorted(t, d, k, largest, vd)
}

/// `sort(x, dim=-1, descending=False)` and `sort.stable(x, *, stable, dim, descending)`:
/// values and int64 indices, NaN largest. Ties keep their input order in both overloads:
/// torch's unstable CPU sort may order equal keys otherwise, which permutes only positions
/// whose keys are equal.
pub fn sort(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let rank = t.shape().len();
    let stable_overload = env.node().target == "aten.sort.stable";
    let (dim_at, desc_at) = if stable_overload {
        (usize::MAX, usize::MAX)
    } else {
        (1, 2)
    };
    let d = norm_dim(
        env.arg_or_kw(dim_at, "dim")
            .and_then(|a| a.as_int())
            .unwrap_or(-1),
        rank,
    )?;
    let descending = flag(env.arg_or_kw(desc_at, "descending"), false);
    let n = t.shape().get(d).copied().unwrap_or(1);
    let vd = env.out_meta_k(0).map_or(t.dtype, |m| m.dtype);
    select_sorted(t, d, n, descending, vd)
}

/// The first `k` of each lane along `d` in sorted order: (values as `vd`, int64 indices).
fn select_sorted(
    t: &Tensor,
    d: usize,
    k: usize,
    descending: bool,
    vd: Dtype,
) -> Result<Value<Tensor>, String> {
    fn go<T: Elem>(
        x: &zerosched_exec::host::Arr<T>,
        d: usize,
        k: usize,
        descending: bool,
        vd: Dtype,
    ) -> Result<(Tensor, ArrayD<i64>), String> {
        let mut shape = x.shape().to_vec();
        if let Some(s) = shape.get_mut(d) {
            *s = k;
        }
        let mut vals = ArrayD::<T>::from_elem(IxDyn(&shape), T::elem_zero());
        let mut idx = ArrayD::<i64>::zeros(IxDyn(&shape));
        Zip::from(vals.lanes_mut(Axis(d)))
            .and(idx.lanes_mut(Axis(d)))
            .and(x.lanes(Axis(d)))
            .for_each(|mut v, mut ix, src| {
                for (j, &o) in sorted_order(src, descending).iter().take(k).enumerate() {
                    v[j] = src[o];
                    ix[j] = o as i64;
                }
            });
        Ok((T::wrap(vals, vd)?, idx))
    }
    if t.shape().is_empty() {
        // A 0-d tensor sorts as itself.
        return Ok(Value::List(vec![
            Some(t.cast(vd)?),
            Some(Tensor::scalar(0.0, Dtype::Int64)?),
        ]));
    }
    let (vals, idx) = match &t.data {
        Data::F32(a) => go(a, d, k, descending, vd)?,
        Data::F64(a) => go(a, d, k, descending, vd)?,
        Data::I64(a) => go(a, d, k, descending, vd)?,
        Data::Bool(a) => go(a, d, k, descending, vd)?,
    };
    Ok(Value::List(vec![
        Some(vals),
        Some(i64::wrap(idx, Dtype::Int64)?),
    ]))
}

/// `histc(x, bins=100, min=0, max=0)`: counts of `bins` equal-width bins over `[min, max]`
/// (the data's range when `min == max`, an error if that is not finite; widened by one each
/// way when it is a single value), in the input's dtype. As torch's CPU kernel: the bin is
/// `trunc((x - min) * bins / (max - min))` in the input's compute type, `x == max` falls in
/// the last bin, values outside the range and NaN are not counted.
pub fn histc(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let bins = env.arg_or_kw(1, "bins").map_or(Ok(100), int)?;
    let bins = usize::try_from(bins)
        .ok()
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("histc: bins must be > 0, got {bins}"))?;
    let lim = |i: usize, name: &str| env.arg_or_kw(i, name).and_then(number).unwrap_or(0.0);
    let (lo, hi) = (lim(2, "min"), lim(3, "max"));
    if lo > hi {
        return Err(format!("histc: max ({hi}) must be at least min ({lo})"));
    }
    let dt = out_dtype(env, t.dtype);
    macro_rules! go {
        ($T:ty) => {{
            let x = <$T>::get(t);
            let (mut lo, mut hi) = (lo as $T, hi as $T);
            if lo == hi && !x.is_empty() {
                lo = x.iter().copied().fold(<$T>::INFINITY, <$T>::min);
                hi = x.iter().copied().fold(<$T>::NEG_INFINITY, <$T>::max);
                if x.iter().any(|v| v.is_nan()) || !lo.is_finite() || !hi.is_finite() {
                    return Err(format!("histc: range of [{lo}, {hi}] is not finite"));
                }
            }
            if lo == hi {
                lo -= 1.0;
                hi += 1.0;
            }
            let mut counts = vec![0.0 as $T; bins];
            for &v in x.iter() {
                if !(v >= lo && v <= hi) {
                    continue;
                }
                let b = (((v - lo) * bins as $T / (hi - lo)) as usize).min(bins - 1);
                counts[b] += 1.0;
            }
            <$T>::wrap(
                ArrayD::from_shape_vec(IxDyn(&[bins]), counts).map_err(|e| e.to_string())?,
                dt,
            )?
        }};
    }
    one(match t.kind() {
        Kind::F64 => go!(f64),
        Kind::F32 => go!(f32),
        k => {
            return Err(format!(
                "histc of a {k:?} tensor (torch's CPU kernel takes floats)"
            ));
        }
    })
}
