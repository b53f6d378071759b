//! Reductions other than sums, over a list of dimensions (all when empty or absent): `amax`,
//! `amin` (a NaN in a lane gives NaN), `max.dim` / `min.dim` (values and the first index of the
//! extreme, a NaN counting as one), `prod`, `var` (with a correction or `unbiased`) and `std`,
//! `linalg_vector_norm`. Each lane
//! is the reduced dimensions' elements in row-major order, reduced in the output dtype's
//! compute type.

use super::{Env, Value, flag, int, norm_dim, number, one, out_dtype};
use crate::reduce::{dims_of, lane_arg};
use ndarray::{ArrayD, ArrayView1, IxDyn};
use zerosched_exec::host::{Arr, Data, Elem, Kind, Tensor, kind};
use zerosched_ir::{Arg, Dtype};

/// The lanes of `a` over `dims`, in row-major order of the kept dimensions, and the result's
/// shape (with ones for the reduced dimensions when `keep`).
fn lanes<T: Copy>(a: &Arr<T>, dims: &[usize], keep: bool) -> (Vec<Vec<T>>, Vec<usize>) {
    let rank = a.ndim();
    let kept: Vec<usize> = (0..rank).filter(|d| !dims.contains(d)).collect();
    let order: Vec<usize> = kept.iter().chain(dims).copied().collect();
    let n: usize = dims.iter().map(|&d| a.shape()[d]).product();
    let flat: Vec<T> = a
        .view()
        .permuted_axes(IxDyn(&order))
        .iter()
        .copied()
        .collect();
    let out: Vec<Vec<T>> = if n == 0 {
        let m: usize = kept.iter().map(|&d| a.shape()[d]).product();
        vec![Vec::new(); m]
    } else {
        flat.chunks(n).map(<[T]>::to_vec).collect()
    };
    let shape = (0..rank)
        .filter_map(|d| match (dims.contains(&d), keep) {
            (false, _) => Some(a.shape()[d]),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect();
    (out, shape)
}

fn arr<T>(v: Vec<T>, shape: &[usize]) -> Result<ArrayD<T>, String> {
    ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| e.to_string())
}

fn keepdim(env: &Env<'_, Tensor>, i: usize) -> bool {
    flag(env.arg_or_kw(i, "keepdim"), false)
}

fn extreme(env: &Env<'_, Tensor>, max: bool) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let dims = dims_of(env.node().args.get(1), t.shape().len())?;
    let keep = keepdim(env, 2);
    fn go<T: Elem>(a: &Arr<T>, dims: &[usize], keep: bool, max: bool) -> Result<ArrayD<T>, String> {
        let (ls, shape) = lanes(a, dims, keep);
        let v = ls
            .iter()
            .map(|l| {
                let i = lane_arg(ArrayView1::from(&l[..]), max)?;
                Ok(l[i as usize])
            })
            .collect::<Result<Vec<T>, String>>()
            .map_err(|e| e.replace("argmax / argmin", "amax / amin"))?;
        arr(v, &shape)
    }
    let out = zerosched_exec::host::map_data!(t, a => go(a, &dims, keep, max)?.into_shared());
    one(out.cast(out_dtype(env, t.dtype))?)
}

pub fn amax(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    extreme(env, true)
}
pub fn amin(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    extreme(env, false)
}

/// `max.dim` / `min.dim(x, dim, keepdim=False)` → (values, int64 indices).
fn extreme_dim(env: &Env<'_, Tensor>, max: bool) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let rank = t.shape().len();
    let d = norm_dim(int(env.arg(1)?)?, rank)?;
    let dims = if rank == 0 { Vec::new() } else { vec![d] };
    let keep = keepdim(env, 2);
    fn go<T: Elem>(
        a: &Arr<T>,
        dims: &[usize],
        keep: bool,
        max: bool,
    ) -> Result<(ArrayD<T>, ArrayD<i64>), String> {
        let (ls, shape) = lanes(a, dims, keep);
        let (mut vals, mut idx) = (Vec::with_capacity(ls.len()), Vec::with_capacity(ls.len()));
        for l in &ls {
            let i = lane_arg(ArrayView1::from(&l[..]), max)?;
            vals.push(l[i as usize]);
            idx.push(i);
        }
        Ok((arr(vals, &shape)?, arr(idx, &shape)?))
    }
    let (vals, idx) = match &t.data {
        Data::F32(a) => {
            let (v, i) = go(a, &dims, keep, max)?;
            (f32::wrap(v, t.dtype)?, i)
        }
        Data::F64(a) => {
            let (v, i) = go(a, &dims, keep, max)?;
            (f64::wrap(v, t.dtype)?, i)
        }
        Data::I64(a) => {
            let (v, i) = go(a, &dims, keep, max)?;
            (i64::wrap(v, t.dtype)?, i)
        }
        Data::Bool(a) => {
            let (v, i) = go(a, &dims, keep, max)?;
            (bool::wrap(v, t.dtype)?, i)
        }
    };
    let vd = env.out_meta_k(0).map_or(t.dtype, |m| m.dtype);
    Ok(Value::List(vec![
        Some(vals.cast(vd)?),
        Some(i64::wrap(idx, Dtype::Int64)?),
    ]))
}

pub fn max_dim(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    extreme_dim(env, true)
}
pub fn min_dim(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    extreme_dim(env, false)
}

/// `prod.default(x, dtype=None)` and `prod.dim_int(x, dim, keepdim=False, dtype=None)`.
pub fn prod(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let rank = t.shape().len();
    let (dims, keep) = if env.node().target == "aten.prod.dim_int" {
        let d = norm_dim(int(env.arg(1)?)?, rank)?;
        (
            if rank == 0 { Vec::new() } else { vec![d] },
            keepdim(env, 2),
        )
    } else {
        ((0..rank).collect(), false)
    };
    let dt = out_dtype(env, t.dtype);
    macro_rules! go {
        ($T:ty, $one:expr, $mul:expr) => {{
            let (ls, shape) = lanes(&<$T>::get(t), &dims, keep);
            let v: Vec<$T> = ls
                .iter()
                .map(|l| l.iter().fold($one, |p, &x| $mul(p, x)))
                .collect();
            <$T>::wrap(arr(v, &shape)?, dt)?
        }};
    }
    one(match kind(dt)? {
        Kind::F64 => go!(f64, 1.0, |p: f64, x| p * x),
        Kind::F32 => go!(f32, 1.0, |p: f32, x| p * x),
        _ => go!(i64, 1, i64::wrapping_mul),
    })
}

/// `var.correction(x, dim=None, *, correction=1, keepdim=False)` and
/// `var.dim(x, dim, unbiased=True, keepdim=False)`: sum of squared deviations from the mean
/// over N - correction; `std.correction` its square root.
pub fn var(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let root = env.node().target.starts_with("aten.std");
    let t = env.tensor(env.arg(0)?)?;
    let rank = t.shape().len();
    let dims = dims_of(env.node().args.get(1), rank)?;
    let (correction, keep) = if env.node().target == "aten.var.dim" {
        let unbiased = flag(env.arg_or_kw(2, "unbiased"), true);
        (f64::from(u8::from(unbiased)), keepdim(env, 3))
    } else {
        let c = match env.node().kwargs.get("correction") {
            None | Some(Arg::None) => 1.0,
            Some(a) => number(a).ok_or("var: correction is not a number")?,
        };
        (c, keepdim(env, 2))
    };
    let dt = out_dtype(env, t.dtype);
    macro_rules! go {
        ($T:ty) => {{
            let (ls, shape) = lanes(&<$T>::get(t), &dims, keep);
            let v: Vec<$T> = ls
                .iter()
                .map(|l| {
                    let n = l.len() as $T;
                    let mean = l.iter().copied().sum::<$T>() / n;
                    let ss: $T = l.iter().map(|&x| (x - mean) * (x - mean)).sum();
                    let v = ss / (n - correction as $T).max(0.0);
                    if root { v.sqrt() } else { v }
                })
                .collect();
            <$T>::wrap(arr(v, &shape)?, dt)?
        }};
    }
    one(match kind(dt)? {
        Kind::F64 => go!(f64),
        Kind::F32 => go!(f32),
        k => return Err(format!("`var` of a {k:?} tensor")),
    })
}

/// `linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None)`: the p-norm of each
/// lane (inf: the largest magnitude, -inf: the smallest, 0: the count of nonzeros).
pub fn vector_norm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let ord = match env.arg_or_kw(1, "ord") {
        None | Some(Arg::None) => 2.0,
        Some(a) => number(a).ok_or("linalg_vector_norm: ord is not a number")?,
    };
    let dims = dims_of(env.arg_or_kw(2, "dim"), t.shape().len())?;
    let keep = keepdim(env, 3);
    let dt = out_dtype(env, t.dtype);
    macro_rules! go {
        ($T:ty) => {{
            let (ls, shape) = lanes(&<$T>::get(t), &dims, keep);
            let p = ord as $T;
            let v: Vec<$T> = ls
                .iter()
                .map(|l| {
                    let abs = l.iter().map(|x| x.abs());
                    if ord == f64::INFINITY {
                        abs.fold(0.0, <$T>::max)
                    } else if ord == f64::NEG_INFINITY {
                        abs.fold(<$T>::INFINITY, <$T>::min)
                    } else if ord == 0.0 {
                        abs.filter(|&x| x != 0.0).count() as $T
                    } else if ord == 2.0 {
                        abs.map(|x| x * x).sum::<$T>().sqrt()
                    } else {
                        abs.map(|x| x.powf(p)).sum::<$T>().powf(1.0 / p)
                    }
                })
                .collect();
            <$T>::wrap(arr(v, &shape)?, dt)?
        }};
    }
    one(match kind(dt)? {
        Kind::F64 => go!(f64),
        Kind::F32 => go!(f32),
        k => return Err(format!("`linalg_vector_norm` of a {k:?} tensor")),
    })
}
