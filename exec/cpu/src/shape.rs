//! Views and layout ops: view, (un)squeeze, permute, expand, slice, cat, split, padding,
//! slice_scatter. Every result is a tensor of its own logical shape (a view may share the
//! input's storage or copy it: the graph is functional).

use super::{Env, Value, int, ints, norm_dim, number, one, out_dtype};
use ndarray::{Axis, Dimension, IxDyn, Slice};
use zerosched_exec::host::{Tensor, map_data};
use zerosched_ir::Arg;

fn x<'a>(env: &Env<'a, Tensor>) -> Result<&'a Tensor, String> {
    env.tensor(env.arg(0)?)
}

/// A size list with at most one -1, resolved against `numel`.
fn resolve(sizes: &[i64], numel: usize) -> Result<Vec<usize>, String> {
    let known: i64 = sizes.iter().filter(|&&s| s >= 0).product();
    sizes
        .iter()
        .map(|&s| match s {
            -1 if known > 0 => Ok(numel / known as usize),
            -1 => Ok(0),
            s if s >= 0 => Ok(s as usize),
            s => Err(format!("invalid size {s}")),
        })
        .collect()
}

pub fn view(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let shape = resolve(&ints(env.arg(1)?)?, t.numel())?;
    one(t.reshape(&shape)?)
}

pub fn unsqueeze(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let d = norm_dim(int(env.arg(1)?)?, t.shape().len() + 1)?;
    one(map_data!(t, a => a.clone().insert_axis(Axis(d))))
}

pub fn squeeze(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let rank = t.shape().len();
    let mut dims: Vec<usize> = match env.node().args.get(1) {
        Some(a) => ints(a)?
            .into_iter()
            .map(|d| norm_dim(d, rank))
            .collect::<Result<_, _>>()?,
        None => (0..rank).collect(),
    };
    dims.retain(|&d| t.shape()[d] == 1);
    dims.sort_unstable();
    dims.dedup();
    let mut out = t.clone();
    for &d in dims.iter().rev() {
        out = map_data!(&out, a => a.clone().index_axis_move(Axis(d), 0));
    }
    one(out)
}

pub fn permute(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let rank = t.shape().len();
    let perm: Vec<usize> = ints(env.arg(1)?)?
        .into_iter()
        .map(|d| norm_dim(d, rank))
        .collect::<Result<_, _>>()?;
    if perm.len() != rank {
        return Err(format!("permute of rank {rank} by {perm:?}"));
    }
    one(map_data!(t, a => a.clone().permuted_axes(IxDyn(&perm))))
}

pub fn t(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    one(map_data!(t, a => a.clone().reversed_axes()))
}

pub fn transpose(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let rank = t.shape().len();
    let (d0, d1) = (
        norm_dim(int(env.arg(1)?)?, rank)?,
        norm_dim(int(env.arg(2)?)?, rank)?,
    );
    one(map_data!(t, a => { let mut v = a.clone(); v.swap_axes(d0, d1); v }))
}

pub fn expand(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let sizes = ints(env.arg(1)?)?;
    let old = t.shape();
    let lead = sizes
        .len()
        .checked_sub(old.len())
        .ok_or("expand to fewer dimensions")?;
    let shape: Vec<usize> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| if s < 0 { old[i - lead] } else { s as usize })
        .collect();
    let s = IxDyn(&shape);
    Ok(Value::Tensor(map_data!(t, a => a
        .broadcast(s.clone())
        .ok_or_else(|| format!("cannot expand {old:?} to {shape:?}"))?
        .to_owned()
        .into_shared())))
}

/// Python slice bounds on a dimension of size `n` (end clamped, negatives from the end).
pub(crate) fn bounds(start: Option<i64>, end: Option<i64>, n: usize) -> (usize, usize) {
    let n = n as i64;
    let fix = |v: i64| if v < 0 { (v + n).max(0) } else { v.min(n) };
    let s = fix(start.unwrap_or(0));
    let e = fix(end.unwrap_or(n)).max(s);
    (s as usize, e as usize)
}

pub(crate) fn opt_int(env: &Env<'_, Tensor>, i: usize, name: &str) -> Option<i64> {
    env.arg_or_kw(i, name).and_then(|a| a.as_int())
}

pub fn slice(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let d = norm_dim(opt_int(env, 1, "dim").unwrap_or(0), t.shape().len())?;
    let (s, e) = bounds(
        opt_int(env, 2, "start"),
        opt_int(env, 3, "end"),
        t.shape()[d],
    );
    let step = opt_int(env, 4, "step").unwrap_or(1).max(1) as isize;
    let sl = Slice::new(s as isize, Some(e as isize), step);
    one(map_data!(t, a => a.slice_axis(Axis(d), sl).to_owned().into_shared()))
}

pub fn cat(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let items = env.arg(0)?.as_list().ok_or("cat of a non-list")?;
    let ts: Vec<&Tensor> = items
        .iter()
        .map(|a| env.tensor(a))
        .collect::<Result<_, _>>()?;
    let first = ts.first().ok_or("cat of nothing")?;
    let dt = out_dtype(env, first.dtype);
    // Legacy behaviour: 1-d empty tensors are skipped.
    let ts: Vec<Tensor> = ts
        .iter()
        .filter(|t| t.shape() != [0])
        .map(|t| t.cast(dt))
        .collect::<Result<_, _>>()?;
    let rank = ts.first().map_or(1, |t| t.shape().len());
    let d = norm_dim(
        env.node().args.get(1).map(int).transpose()?.unwrap_or(0),
        rank,
    )?;
    one(concat(&ts, d, dt)?)
}

/// Tensors of one kind joined along `d`.
fn concat(ts: &[Tensor], d: usize, dt: zerosched_ir::Dtype) -> Result<Tensor, String> {
    use zerosched_exec::host::Data;
    macro_rules! go {
        ($v:ident) => {{
            let views: Vec<_> = ts
                .iter()
                .map(|t| match &t.data {
                    Data::$v(a) => Ok(a.view()),
                    _ => Err("cat of mixed kinds"),
                })
                .collect::<Result<_, _>>()?;
            Data::$v(
                ndarray::concatenate(Axis(d), &views)
                    .map_err(|e| e.to_string())?
                    .into_shared(),
            )
        }};
    }
    let data = match ts.first().map(|t| &t.data) {
        Some(Data::F32(_)) => go!(F32),
        Some(Data::F64(_)) => go!(F64),
        Some(Data::I64(_)) => go!(I64),
        Some(Data::Bool(_)) => go!(Bool),
        None => return Err("cat of nothing".into()),
    };
    Ok(Tensor { dtype: dt, data })
}

/// `stack(tensors, dim=0)`: the tensors joined along a new dimension `dim`.
pub fn stack(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let items = env.arg(0)?.as_list().ok_or("stack of a non-list")?;
    let ts: Vec<&Tensor> = items
        .iter()
        .map(|a| env.tensor(a))
        .collect::<Result<_, _>>()?;
    let first = ts.first().ok_or("stack of nothing")?;
    let shape = first.shape().to_vec();
    let d = norm_dim(
        env.arg_or_kw(1, "dim").map(int).transpose()?.unwrap_or(0),
        shape.len() + 1,
    )?;
    let dt = out_dtype(env, first.dtype);
    let mut up = shape.clone();
    up.insert(d, 1);
    let ts: Vec<Tensor> = ts
        .iter()
        .map(|t| {
            if t.shape() != shape.as_slice() {
                return Err(format!("stack of shapes {shape:?} and {:?}", t.shape()));
            }
            t.cast(dt)?.reshape(&up)
        })
        .collect::<Result<_, _>>()?;
    one(concat(&ts, d, dt)?)
}

/// `unbind(x, dim=0)`: the slices along `dim`, that dimension removed.
pub fn unbind(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let rank = t.shape().len();
    let d = norm_dim(
        env.arg_or_kw(1, "dim").map(int).transpose()?.unwrap_or(0),
        rank,
    )?;
    let mut rest = t.shape().to_vec();
    let n = rest.remove(d);
    let parts = (0..n)
        .map(|i| {
            Ok(Some(
                map_data!(t, a => a.index_axis(Axis(d), i).to_owned().into_shared())
                    .reshape(&rest)?,
            ))
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Value::List(parts))
}

/// `roll(x, shifts, dims=[])`: elements moved `shifts[i]` places along `dims[i]`, wrapping
/// (the flattened tensor when no dimension is given).
pub fn roll(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let shifts = ints(env.arg(1)?)?;
    let dims = match env.arg_or_kw(2, "dims") {
        None | Some(Arg::None) => Vec::new(),
        Some(a) => ints(a)?,
    };
    let shape = t.shape().to_vec();
    let (base, dims) = if dims.is_empty() {
        (t.reshape(&[t.numel()])?, vec![0])
    } else {
        (t.clone(), dims)
    };
    if shifts.len() != dims.len() {
        return Err(format!(
            "roll: {} shifts for {} dimensions",
            shifts.len(),
            dims.len()
        ));
    }
    let rank = base.shape().len();
    let mut out = base;
    for (&s, &d) in shifts.iter().zip(&dims) {
        let d = norm_dim(d, rank)?;
        let n = out.shape().get(d).copied().unwrap_or(1);
        if n == 0 {
            continue;
        }
        let idx: Vec<usize> = (0..n as i64)
            .map(|i| (i - s).rem_euclid(n as i64) as usize)
            .collect();
        out = map_data!(&out, a => a.select(Axis(d), &idx).into_shared());
    }
    one(out.reshape(&shape)?)
}

fn split_at(t: &Tensor, sizes: &[usize], d: usize) -> Result<Value<Tensor>, String> {
    let mut out = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for &s in sizes {
        let sl = Slice::new(at as isize, Some((at + s) as isize), 1);
        out.push(Some(
            map_data!(t, a => a.slice_axis(Axis(d), sl).to_owned().into_shared()),
        ));
        at += s;
    }
    if at != t.shape()[d] {
        return Err(format!(
            "split sizes {sizes:?} do not cover {}",
            t.shape()[d]
        ));
    }
    Ok(Value::List(out))
}

pub fn split_with_sizes(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let sizes: Vec<usize> = ints(env.arg(1)?)?
        .into_iter()
        .map(|s| s.max(0) as usize)
        .collect();
    let d = norm_dim(opt_int(env, 2, "dim").unwrap_or(0), t.shape().len())?;
    split_at(t, &sizes, d)
}

pub fn split(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let d = norm_dim(opt_int(env, 2, "dim").unwrap_or(0), t.shape().len())?;
    let each = int(env.arg(1)?)?.max(1) as usize;
    let n = t.shape()[d];
    let sizes: Vec<usize> = (0..n.div_ceil(each))
        .map(|i| each.min(n - i * each))
        .collect();
    split_at(t, &sizes, d)
}

/// `constant_pad_nd(x, pad, value)`: `pad` pairs (before, after) from the last dimension.
pub fn constant_pad_nd(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let pad = ints(env.arg(1)?)?;
    let value = env.node().args.get(2).and_then(number).unwrap_or(0.0);
    let rank = t.shape().len();
    if pad.len() % 2 != 0 || pad.len() / 2 > rank || pad.iter().any(|&p| p < 0) {
        return Err(format!("unsupported padding {pad:?}"));
    }
    let mut shape = t.shape().to_vec();
    let mut before = vec![0usize; rank];
    for (k, pair) in pad.chunks(2).enumerate() {
        let d = rank - 1 - k;
        before[d] = pair[0] as usize;
        shape[d] += (pair[0] + pair[1]) as usize;
    }
    let fill = Tensor::scalar(value, t.dtype)?;
    use zerosched_exec::host::Data;
    macro_rules! go {
        ($v:ident) => {{
            let (Data::$v(src), Data::$v(f)) = (&t.data, &fill.data) else {
                unreachable!()
            };
            let mut out =
                ndarray::ArrayD::from_elem(IxDyn(&shape), f.first().copied().unwrap_or_default());
            let mut view = out.view_mut();
            for d in 0..rank {
                let n = t.shape()[d];
                view.slice_axis_inplace(Axis(d), Slice::from(before[d]..before[d] + n));
            }
            view.assign(src);
            Data::$v(out.into_shared())
        }};
    }
    let data = match &t.data {
        Data::F32(_) => go!(F32),
        Data::F64(_) => go!(F64),
        Data::I64(_) => go!(I64),
        Data::Bool(_) => go!(Bool),
    };
    one(Tensor {
        dtype: t.dtype,
        data,
    })
}

/// `flip(x, dims)`: the order along each listed dimension reversed.
pub fn flip(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let rank = t.shape().len();
    let dims: Vec<usize> = ints(env.arg(1)?)?
        .into_iter()
        .map(|d| norm_dim(d, rank))
        .collect::<Result<_, _>>()?;
    if rank == 0 {
        return one(t.clone());
    }
    one(map_data!(t, a => {
        let mut v = a.view();
        for &d in &dims {
            v.invert_axis(Axis(d));
        }
        v.to_owned().into_shared()
    }))
}

/// `repeat(x, repeats)`: the tensor tiled `repeats[i]` times along dimension i (leading
/// repeats add dimensions).
pub fn repeat(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let reps: Vec<usize> = ints(env.arg(1)?)?
        .into_iter()
        .map(|r| usize::try_from(r).map_err(|_| format!("repeat: negative count {r}")))
        .collect::<Result<_, _>>()?;
    let rank = t.shape().len();
    if reps.len() < rank {
        return Err(format!(
            "repeat: {} counts for a tensor of rank {rank}",
            reps.len()
        ));
    }
    let mut shape = vec![1; reps.len() - rank];
    shape.extend_from_slice(t.shape());
    let out_shape: Vec<usize> = shape.iter().zip(&reps).map(|(s, r)| s * r).collect();
    let base = t.reshape(&shape)?;
    one(map_data!(&base, a => {
        let n: usize = out_shape.iter().product();
        let mut v = Vec::with_capacity(n);
        for idx in ndarray::indices(IxDyn(&out_shape)) {
            let src: Vec<usize> = idx.slice().iter().zip(&shape).map(|(i, s)| i % s).collect();
            v.push(a[IxDyn(&src)]);
        }
        ndarray::ArrayD::from_shape_vec(IxDyn(&out_shape), v)
            .map_err(|e| e.to_string())?
            .into_shared()
    }))
}

/// `diagonal(x, offset=0, dim1=0, dim2=1)`: the diagonal of the (dim1, dim2) planes as the
/// last dimension, the other dimensions in order.
pub fn diagonal(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = x(env)?;
    let rank = t.shape().len();
    let get = |i: usize, name: &str, d: i64| env.arg_or_kw(i, name).map_or(Ok(d), int);
    let offset = get(1, "offset", 0)?;
    let d1 = norm_dim(get(2, "dim1", 0)?, rank)?;
    let d2 = norm_dim(get(3, "dim2", 1)?, rank)?;
    if d1 == d2 || rank < 2 {
        return Err(format!(
            "diagonal: dimensions {d1} and {d2} of a rank-{rank} tensor"
        ));
    }
    let (r, c) = (t.shape()[d1] as i64, t.shape()[d2] as i64);
    let len = if offset >= 0 {
        (c - offset).min(r)
    } else {
        (r + offset).min(c)
    }
    .max(0) as usize;
    let rest: Vec<usize> = (0..rank).filter(|&k| k != d1 && k != d2).collect();
    let mut out_shape: Vec<usize> = rest.iter().map(|&k| t.shape()[k]).collect();
    out_shape.push(len);
    one(map_data!(t, a => {
        let mut v = Vec::with_capacity(out_shape.iter().product());
        for idx in ndarray::indices(IxDyn(&out_shape)) {
            let s = idx.slice();
            let k = s[s.len() - 1] as i64;
            let mut src = vec![0usize; rank];
            for (j, &dim) in rest.iter().enumerate() {
                src[dim] = s[j];
            }
            src[d1] = (k + (-offset).max(0)) as usize;
            src[d2] = (k + offset.max(0)) as usize;
            v.push(a[IxDyn(&src)]);
        }
        ndarray::ArrayD::from_shape_vec(IxDyn(&out_shape), v)
            .map_err(|e| e.to_string())?
            .into_shared()
    }))
}
