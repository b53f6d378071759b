//! Writing into a copy: the backward ops of `select` and `slice` (the gradient written into
//! zeros of the input's shape), `select_scatter`, `copy` (the source broadcast to the
//! destination's shape and dtype), `fill`, `masked_fill`, and `embedding_dense_backward`
//! (gradient rows summed into the rows their indices name); and `select` itself.

use super::{Env, Value, flag, int, ints, norm_dim, number, one, out_dtype};
use crate::create::filled;
use crate::elementwise::zip2;
use crate::real::{Real, by_real};
use crate::shape::{bounds, opt_int};
use ndarray::{ArrayD, Axis, IxDyn, Slice};
use zerosched_exec::host::{Data, Elem, Kind, Tensor, kind, map_data};
use zerosched_ir::Arg;

/// Where along a dimension: one index (the dimension removed) or a slice.
#[derive(Clone, Copy)]
enum At {
    Index(usize),
    Slice(Slice),
}

/// The size of dimension `d`: an error for a 0-d shape, which has none.
fn size_of(shape: &[usize], d: usize) -> Result<usize, String> {
    shape
        .get(d)
        .copied()
        .ok_or_else(|| format!("dimension {d} of a tensor of shape {shape:?}"))
}

fn index_at(i: i64, n: usize) -> Result<usize, String> {
    let j = if i < 0 { i + n as i64 } else { i };
    usize::try_from(j)
        .ok()
        .filter(|&j| j < n)
        .ok_or_else(|| format!("index {i} out of range for a dimension of size {n}"))
}

/// `base` with `src` written at `at` along `d`.
fn write(base: &Tensor, src: &Tensor, d: usize, at: At) -> Result<Tensor, String> {
    let src = src.cast(base.dtype)?;
    macro_rules! go {
        ($v:ident) => {{
            let (Data::$v(b), Data::$v(sv)) = (&base.data, &src.data) else {
                return Err("source and destination of different kinds".into());
            };
            let mut out = b.to_owned();
            let mut view = match at {
                At::Index(i) => out.index_axis_mut(Axis(d), i),
                At::Slice(sl) => out.slice_axis_mut(Axis(d), sl),
            };
            if view.shape() != sv.shape() {
                return Err(format!(
                    "the destination's view is {:?}, the source {:?}",
                    view.shape(),
                    sv.shape()
                ));
            }
            view.assign(sv);
            Data::$v(out.into_shared())
        }};
    }
    let data = match &base.data {
        Data::F32(_) => go!(F32),
        Data::F64(_) => go!(F64),
        Data::I64(_) => go!(I64),
        Data::Bool(_) => go!(Bool),
    };
    Ok(Tensor {
        dtype: base.dtype,
        data,
    })
}

fn sizes(a: &Arg<zerosched_ir::NodeId>) -> Result<Vec<usize>, String> {
    ints(a)?
        .into_iter()
        .map(|d| usize::try_from(d).map_err(|_| format!("negative size {d}")))
        .collect()
}

fn slice_at(env: &Env<'_, Tensor>, first: usize, n: usize) -> At {
    let (s, e) = bounds(
        opt_int(env, first, "start"),
        opt_int(env, first + 1, "end"),
        n,
    );
    let step = opt_int(env, first + 2, "step").unwrap_or(1).max(1) as isize;
    At::Slice(Slice::new(s as isize, Some(e as isize), step))
}

/// `select.int(x, dim, index)`.
pub fn select(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let d = norm_dim(int(env.arg(1)?)?, t.shape().len())?;
    let i = index_at(int(env.arg(2)?)?, size_of(t.shape(), d)?)?;
    one(map_data!(t, a => a.index_axis(Axis(d), i).to_owned().into_shared()))
}

/// `select_backward(grad, input_sizes, dim, index)`.
pub fn select_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let g = env.tensor(env.arg(0)?)?;
    let shape = sizes(env.arg(1)?)?;
    let d = norm_dim(int(env.arg(2)?)?, shape.len())?;
    let i = index_at(int(env.arg(3)?)?, size_of(&shape, d)?)?;
    let dt = out_dtype(env, g.dtype);
    one(write(&filled(&shape, 0.0, dt)?, g, d, At::Index(i))?)
}

/// `slice_backward(grad, input_sizes, dim, start, end, step)`.
pub fn slice_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let g = env.tensor(env.arg(0)?)?;
    let shape = sizes(env.arg(1)?)?;
    let d = norm_dim(int(env.arg(2)?)?, shape.len())?;
    let dt = out_dtype(env, g.dtype);
    one(write(
        &filled(&shape, 0.0, dt)?,
        g,
        d,
        slice_at(env, 3, size_of(&shape, d)?),
    )?)
}

/// `select_scatter(base, src, dim, index)`.
pub fn select_scatter(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let base = env.tensor(env.arg(0)?)?;
    let src = env.tensor(env.arg(1)?)?;
    let d = norm_dim(int(env.arg(2)?)?, base.shape().len())?;
    let i = index_at(int(env.arg(3)?)?, size_of(base.shape(), d)?)?;
    one(write(base, src, d, At::Index(i))?)
}

/// `slice_scatter(base, src, dim, start, end, step)`: `base` with `src` written over the slice.
pub fn slice_scatter(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let base = env.tensor(env.arg(0)?)?;
    let src = env.tensor(env.arg(1)?)?;
    let d = norm_dim(opt_int(env, 2, "dim").unwrap_or(0), base.shape().len())?;
    let (s, e) = bounds(
        opt_int(env, 3, "start"),
        opt_int(env, 4, "end"),
        size_of(base.shape(), d)?,
    );
    let step = opt_int(env, 5, "step").unwrap_or(1).max(1) as isize;
    one(write(
        base,
        src,
        d,
        At::Slice(Slice::new(s as isize, Some(e as isize), step)),
    )?)
}

/// `copy(dst, src, non_blocking)`: `src` broadcast to `dst`'s shape, in `dst`'s dtype.
pub fn copy(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let dst = env.tensor(env.arg(0)?)?;
    let src = env.tensor(env.arg(1)?)?.cast(out_dtype(env, dst.dtype))?;
    let shape = IxDyn(dst.shape());
    one(map_data!(&src, a => a
        .broadcast(shape.clone())
        .ok_or_else(|| format!("copy: {:?} does not broadcast to {:?}", a.shape(), dst.shape()))?
        .to_owned()
        .into_shared()))
}

/// A scalar argument: a Python number or a one-element tensor.
fn scalar(env: &Env<'_, Tensor>, a: &Arg<zerosched_ir::NodeId>) -> Result<f64, String> {
    if let Some(x) = number(a) {
        return Ok(x);
    }
    let t = env.tensor(a)?;
    match t.to_f64_vec().as_slice() {
        [x] => Ok(*x),
        _ => Err(format!(
            "expected one value, found a tensor of shape {:?}",
            t.shape()
        )),
    }
}

/// `fill.Scalar(x, v)` / `fill.Tensor(x, v)`: `x`'s shape full of `v`.
pub fn fill(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let v = scalar(env, env.arg(1)?)?;
    one(filled(x.shape(), v, out_dtype(env, x.dtype))?)
}

/// `masked_fill.Scalar(x, mask, v)` / `.Tensor`: `v` where `mask`, else `x`.
pub fn masked_fill(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let m = bool::get(env.tensor(env.arg(1)?)?);
    let v = scalar(env, env.arg(2)?)?;
    let dt = out_dtype(env, x.dtype);
    fn go<T: Elem>(
        x: &Tensor,
        m: &zerosched_exec::host::Arr<bool>,
        v: f64,
        dt: zerosched_ir::Dtype,
    ) -> Result<Tensor, String> {
        let v = T::from_f64(v);
        T::wrap(zip2(&T::get(x), m, |a, c| if c { v } else { a })?, dt)
    }
    one(match kind(dt)? {
        Kind::F32 => go::<f32>(x, &m, v, dt)?,
        Kind::F64 => go::<f64>(x, &m, v, dt)?,
        Kind::I64 => go::<i64>(x, &m, v, dt)?,
        Kind::Bool => go::<bool>(x, &m, v, dt)?,
    })
}

fn embedding_bwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let gt = env.tensor(env.arg(0)?)?;
    let idx: Vec<i64> = i64::get(env.tensor(env.arg(1)?)?).iter().copied().collect();
    let rows = usize::try_from(int(env.arg(2)?)?)
        .map_err(|_| "embedding_dense_backward: negative num_weights")?;
    let pad = int(env.arg(3)?)?;
    let by_freq = flag(env.node().args.get(4), false);
    let dim = gt.shape().last().copied().unwrap_or(1);
    let g: Vec<T> = T::get(gt).iter().copied().collect();
    if g.len() != idx.len() * dim {
        return Err(format!(
            "embedding_dense_backward: gradient {:?} for {} indices",
            gt.shape(),
            idx.len()
        ));
    }
    let mut count = vec![0usize; rows];
    for &i in &idx {
        let r = usize::try_from(i)
            .ok()
            .filter(|&r| r < rows)
            .ok_or_else(|| {
                format!("embedding_dense_backward: index {i} out of range for {rows} rows")
            })?;
        count[r] += 1;
    }
    let mut out = vec![T::zero(); rows * dim];
    for (k, &i) in idx.iter().enumerate() {
        if i == pad {
            continue;
        }
        let r = i as usize;
        let scale = if by_freq {
            T::one() / T::c(count[r] as f64)
        } else {
            T::one()
        };
        for j in 0..dim {
            out[r * dim + j] += g[k * dim + j] * scale;
        }
    }
    let a = ArrayD::from_shape_vec(IxDyn(&[rows, dim]), out).map_err(|e| e.to_string())?;
    one(T::wrap(a, out_dtype(env, gt.dtype))?)
}

/// `embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)`.
pub fn embedding_dense_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(0)?)?.dtype, "embedding_dense_backward", T => embedding_bwd::<T>(env))
}

#[cfg(test)]
mod tests {
    use crate::testkit::{f32s, run1};

    /// A negative index counts from the end; one out of range is an error naming it.
    #[test]
    fn select_index_from_the_end_and_out_of_range() {
        let x = f32s(&[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let meta = r#"{"dtype":"float32","shape":[2]}"#;
        let out = run1(
            "aten.select.int",
            std::slice::from_ref(&x),
            r#"[{"node":"x0"},1,-1]"#,
            meta,
        )
        .expect("run");
        assert_eq!(out[0].as_ref().expect("tensor").to_f64_vec(), [2.0, 5.0]);
        let err = run1("aten.select.int", &[x], r#"[{"node":"x0"},1,3]"#, meta)
            .expect_err("out of range");
        assert!(err.contains("index 3 out of range"), "{err}");
    }

    /// Rows of `padding_idx` get no gradient; an index past `num_weights` is an error.
    #[test]
    fn embedding_backward_padding_and_range() {
        let g = f32s(&[3, 1], &[1.0, 2.0, 4.0]);
        let idx = crate::testkit::f32s(&[3], &[1.0, 0.0, 1.0])
            .cast(zerosched_ir::Dtype::Int64)
            .expect("int");
        let meta = r#"{"dtype":"float32","shape":[3,1]}"#;
        let args = r#"[{"node":"x0"},{"node":"x1"},3,0,false]"#;
        let out = run1(
            "aten.embedding_dense_backward.default",
            &[g.clone(), idx.clone()],
            args,
            meta,
        )
        .expect("run");
        assert_eq!(
            out[0].as_ref().expect("tensor").to_f64_vec(),
            [0.0, 5.0, 0.0]
        );
        let args = r#"[{"node":"x0"},{"node":"x1"},1,-1,false]"#;
        let err = run1(
            "aten.embedding_dense_backward.default",
            &[g, idx],
            args,
            meta,
        )
        .expect_err("range");
        assert!(err.contains("index 1 out of range for 1 rows"), "{err}");
    }
}
