//! Matrix products through ndarray's `general_mat_mul` (matrixmultiply's sgemm/dgemm, which
//! read any strides, so transposed views are multiplied without a copy). Single-threaded and
//! deterministic: the same operands give the same bits.

use super::elementwise::{Bin, binary};
use super::{Env, Value, number, one, out_dtype};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, Array3, ArrayView2, Axis, Ix2, Ix3, LinalgScalar, s};
use zerosched_exec::host::{Arr, Elem, Kind, Tensor, kind};
use zerosched_ir::{Arg, Dtype};

fn mat<T: Clone>(a: &Arr<T>) -> Result<ndarray::ArrayView2<'_, T>, String> {
    a.view()
        .into_dimensionality::<Ix2>()
        .map_err(|_| format!("expected a matrix, got {:?}", a.shape()))
}

fn mm_t<T: LinalgScalar + Elem>(a: &Tensor, b: &Tensor) -> Result<ndarray::ArrayD<T>, String> {
    let (x, y) = (T::get(a), T::get(b));
    let (x, y) = (mat(&x)?, mat(&y)?);
    if x.ncols() != y.nrows() {
        return Err(format!("mm of {:?} and {:?}", x.shape(), y.shape()));
    }
    let mut c = Array2::<T>::zeros((x.nrows(), y.ncols()));
    general_mat_mul(T::one(), &x, &y, T::zero(), &mut c);
    Ok(c.into_dyn())
}

fn bmm_t<T: LinalgScalar + Elem>(a: &Tensor, b: &Tensor) -> Result<ndarray::ArrayD<T>, String> {
    let (x, y) = (T::get(a), T::get(b));
    let x = x
        .view()
        .into_dimensionality::<Ix3>()
        .map_err(|_| "bmm of a non-3-d tensor")?;
    let y = y
        .view()
        .into_dimensionality::<Ix3>()
        .map_err(|_| "bmm of a non-3-d tensor")?;
    let (bs, n, k) = x.dim();
    let (bs2, k2, m) = y.dim();
    if bs != bs2 || k != k2 {
        return Err(format!("bmm of {:?} and {:?}", x.shape(), y.shape()));
    }
    let mut c = Array3::<T>::zeros((bs, n, m));
    for ((xi, yi), mut ci) in x
        .axis_iter(Axis(0))
        .zip(y.axis_iter(Axis(0)))
        .zip(c.axis_iter_mut(Axis(0)))
    {
        general_mat_mul(T::one(), &xi, &yi, T::zero(), &mut ci);
    }
    Ok(c.into_dyn())
}

/// `a @ b` (batched or not) as `dt`.
fn product(dt: Dtype, a: &Tensor, b: &Tensor, batched: bool) -> Result<Tensor, String> {
    match kind(dt)? {
        Kind::F32 => f32::wrap(
            if batched {
                bmm_t::<f32>(a, b)?
            } else {
                mm_t::<f32>(a, b)?
            },
            dt,
        ),
        Kind::F64 => f64::wrap(
            if batched {
                bmm_t::<f64>(a, b)?
            } else {
                mm_t::<f64>(a, b)?
            },
            dt,
        ),
        Kind::I64 => i64::wrap(
            if batched {
                bmm_t::<i64>(a, b)?
            } else {
                mm_t::<i64>(a, b)?
            },
            dt,
        ),
        Kind::Bool => Err("matrix product of bool tensors".into()),
    }
}

pub fn mm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (a, b) = (env.tensor(env.arg(0)?)?, env.tensor(env.arg(1)?)?);
    one(product(out_dtype(env, a.dtype), a, b, false)?)
}

pub fn bmm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (a, b) = (env.tensor(env.arg(0)?)?, env.tensor(env.arg(1)?)?);
    one(product(out_dtype(env, a.dtype), a, b, true)?)
}

/// `addmm(bias, a, b, *, beta=1, alpha=1)`: `beta * bias + alpha * (a @ b)`, the product
/// rounded once before the addition.
/// `beta * bias + alpha * (a @ b)`, batched or not.
fn add_product(env: &Env<'_, Tensor>, batched: bool) -> Result<Value<Tensor>, String> {
    let bias = env.tensor(env.arg(0)?)?;
    let (a, b) = (env.tensor(env.arg(1)?)?, env.tensor(env.arg(2)?)?);
    let dt = out_dtype(env, a.dtype);
    // bf16 / f16 in f32 throughout, rounded once at the end (as torch's kernel).
    let cdt = if kind(dt)? == Kind::F32 {
        Dtype::Float32
    } else {
        dt
    };
    let kw = |k: &str| env.node().kwargs.get(k).and_then(number).unwrap_or(1.0);
    let (beta, alpha) = (kw("beta"), kw("alpha"));
    let mut p = product(cdt, a, b, batched)?;
    if alpha != 1.0 {
        p = binary(&p, &Tensor::scalar(alpha, cdt)?, cdt, Bin::Mul, None)?;
    }
    let bias = if beta != 1.0 {
        binary(bias, &Tensor::scalar(beta, cdt)?, cdt, Bin::Mul, None)?
    } else {
        bias.clone()
    };
    one(binary(&p, &bias, cdt, Bin::Add, None)?.cast(dt)?)
}

pub fn addmm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    add_product(env, false)
}

/// `baddbmm(bias, a, b, beta=1, alpha=1)`: `addmm` of batches.
pub fn baddbmm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    add_product(env, true)
}

/// Group `g`'s range `[start, end)` from cumulative group ends, checked against `len`.
fn group_ranges(offs: &[i64], len: usize) -> Result<Vec<(usize, usize)>, String> {
    let mut start = 0usize;
    offs.iter()
        .map(|&end| {
            let e = usize::try_from(end)
                .ok()
                .filter(|&e| e >= start && e <= len)
                .ok_or_else(|| {
                    format!("group offsets {offs:?} must be non-decreasing and at most {len}")
                })?;
            let r = (start, e);
            start = e;
            Ok(r)
        })
        .collect()
}

fn view3<T: Clone>(a: &Arr<T>) -> Result<ndarray::ArrayView3<'_, T>, String> {
    a.view()
        .into_dimensionality::<Ix3>()
        .map_err(|_| format!("expected a 3-d tensor, got {:?}", a.shape()))
}

fn grouped_t<T: LinalgScalar + Elem>(
    a: &Tensor,
    b: &Tensor,
    offs: Option<&[i64]>,
) -> Result<ndarray::ArrayD<T>, String> {
    let (x, y) = (T::get(a), T::get(b));
    let need = || -> Result<Vec<i64>, String> {
        offs.map(<[i64]>::to_vec)
            .ok_or_else(|| "group offsets are needed when an operand is 2-d".to_owned())
    };
    // One range per matrix of the 3-d operand.
    let groups = |len: usize, g: usize| -> Result<Vec<(usize, usize)>, String> {
        let ranges = group_ranges(&need()?, len)?;
        if ranges.len() == g {
            Ok(ranges)
        } else {
            Err(format!("{} group offsets for {g} matrices", ranges.len()))
        }
    };
    let mismatch = || {
        format!(
            "contraction dimensions of {:?} and {:?} differ",
            a.shape(),
            b.shape()
        )
    };
    let mm = |x: ArrayView2<'_, T>, y: ArrayView2<'_, T>, mut c: ndarray::ArrayViewMut2<'_, T>| {
        general_mat_mul(T::one(), &x, &y, T::zero(), &mut c);
    };
    match (x.ndim(), y.ndim()) {
        // Rows of `a` in groups, group g times `b[g]`.
        (2, 3) => {
            let (x, y) = (mat(&x)?, view3(&y)?);
            let (g, k, n) = y.dim();
            if x.ncols() != k {
                return Err(mismatch());
            }
            let ranges = groups(x.nrows(), g)?;
            let mut c = Array2::<T>::zeros((x.nrows(), n));
            for (i, &(lo, hi)) in ranges.iter().enumerate() {
                mm(
                    x.slice(s![lo..hi, ..]),
                    y.index_axis(Axis(0), i),
                    c.slice_mut(s![lo..hi, ..]),
                );
            }
            Ok(c.into_dyn())
        }
        // Columns of `b` in groups, `a[g]` times group g.
        (3, 2) => {
            let (x, y) = (view3(&x)?, mat(&y)?);
            let (g, m, k) = x.dim();
            if y.nrows() != k {
                return Err(mismatch());
            }
            let ranges = groups(y.ncols(), g)?;
            let mut c = Array2::<T>::zeros((m, y.ncols()));
            for (i, &(lo, hi)) in ranges.iter().enumerate() {
                mm(
                    x.index_axis(Axis(0), i),
                    y.slice(s![.., lo..hi]),
                    c.slice_mut(s![.., lo..hi]),
                );
            }
            Ok(c.into_dyn())
        }
        // The contraction dimension in groups: one product per group.
        (2, 2) => {
            let (x, y) = (mat(&x)?, mat(&y)?);
            if x.ncols() != y.nrows() {
                return Err(mismatch());
            }
            let ranges = group_ranges(&need()?, x.ncols())?;
            let mut c = Array3::<T>::zeros((ranges.len(), x.nrows(), y.ncols()));
            for (i, &(lo, hi)) in ranges.iter().enumerate() {
                mm(
                    x.slice(s![.., lo..hi]),
                    y.slice(s![lo..hi, ..]),
                    c.index_axis_mut(Axis(0), i),
                );
            }
            Ok(c.into_dyn())
        }
        (3, 3) if offs.is_none() => bmm_t::<T>(a, b),
        (3, 3) => Err("group offsets given for two 3-d operands".into()),
        (p, q) => Err(format!(
            "grouped matrix product of {p}-d and {q}-d operands"
        )),
    }
}

/// `_grouped_mm(a, b, offs=None, bias=None, out_dtype=None)`: one matrix product per group,
/// `offs` holding each group's cumulative end along the dimension that a 2-d operand is
/// grouped in (2-d × 3-d: rows of `a`; 3-d × 2-d: columns of `b`; 2-d × 2-d: the contraction
/// dimension, one [M, N] result per group); 3-d × 3-d is a batched product. Each product
/// accumulates in the compute type and is rounded once. Rows or columns past the last offset,
/// which torch leaves unwritten (uninitialized memory), are zero here.
pub fn grouped_mm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (a, b) = (env.tensor(env.arg(0)?)?, env.tensor(env.arg(1)?)?);
    let offs = match env.arg_or_kw(2, "offs") {
        Some(o @ Arg::Node(_)) => {
            Some(i64::get(env.tensor(o)?).iter().copied().collect::<Vec<_>>())
        }
        _ => None,
    };
    if matches!(env.arg_or_kw(3, "bias"), Some(Arg::Node(_))) {
        return Err("a bias in a grouped matrix product is not supported (nor by torch)".into());
    }
    let dt = out_dtype(env, a.dtype);
    let offs = offs.as_deref();
    one(match kind(dt)? {
        Kind::F32 => f32::wrap(grouped_t::<f32>(a, b, offs)?, dt)?,
        Kind::F64 => f64::wrap(grouped_t::<f64>(a, b, offs)?, dt)?,
        k => return Err(format!("grouped matrix product of {k:?} tensors")),
    })
}
