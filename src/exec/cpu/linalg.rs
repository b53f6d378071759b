//! Matrix products through ndarray's `general_mat_mul` (matrixmultiply's sgemm/dgemm, which
//! read any strides, so transposed views are multiplied without a copy). Single-threaded and
//! deterministic: the same operands give the same bits.

use super::elementwise::{Bin, binary};
use super::tensor::{Arr, Elem, Kind, Tensor, kind};
use super::{Env, Value, number, one, out_dtype};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, Array3, Axis, Ix2, Ix3, LinalgScalar};

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

fn product(env: &Env<'_, Tensor>, a: &Tensor, b: &Tensor, batched: bool) -> Result<Tensor, String> {
    let dt = out_dtype(env, a.dtype);
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
    one(product(env, a, b, false)?)
}

pub fn bmm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (a, b) = (env.tensor(env.arg(0)?)?, env.tensor(env.arg(1)?)?);
    one(product(env, a, b, true)?)
}

/// `addmm(bias, a, b, *, beta=1, alpha=1)`: `beta * bias + alpha * (a @ b)`, the product
/// rounded once before the addition.
pub fn addmm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let bias = env.tensor(env.arg(0)?)?;
    let (a, b) = (env.tensor(env.arg(1)?)?, env.tensor(env.arg(2)?)?);
    let dt = out_dtype(env, a.dtype);
    let kw = |k: &str| env.node().kwargs.get(k).and_then(number).unwrap_or(1.0);
    let (beta, alpha) = (kw("beta"), kw("alpha"));
    let mut p = product(env, a, b, false)?;
    if alpha != 1.0 {
        p = binary(&p, &Tensor::scalar(alpha, dt)?, dt, Bin::Mul, None)?;
    }
    let bias = if beta != 1.0 {
        binary(bias, &Tensor::scalar(beta, dt)?, dt, Bin::Mul, None)?
    } else {
        bias.clone()
    };
    one(binary(&p, &bias, dt, Bin::Add, None)?)
}
