//! Elementwise ops with broadcasting: arithmetic, comparisons, `where`, unary math, casts.
//!
//! Arithmetic is done in the output dtype's compute type (f32 for f32/bf16/f16, f64, i64),
//! Python scalars converted to it first, as torch's CPU kernels do; comparisons in f64 when
//! either side is floating (exact for every f32 and i64 below 2^53), else in i64.

use super::{Env, Value, number, one, out_dtype};
use ndarray::{ArrayD, IxDyn, Zip};
use zerosched_exec::host::{Arr, Elem, Kind, Tensor, kind};
use zerosched_ir::{Arg, Dtype, NodeId};

pub(crate) fn bcast_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>, String> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let x = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let y = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (x, y) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return Err(format!("shapes {a:?} and {b:?} do not broadcast")),
        };
    }
    Ok(out)
}

pub(crate) fn zip2<A: Copy, B: Copy, C>(
    x: &Arr<A>,
    y: &Arr<B>,
    f: impl Fn(A, B) -> C,
) -> Result<ArrayD<C>, String> {
    let shape = bcast_shape(x.shape(), y.shape())?;
    let xv = x.broadcast(IxDyn(&shape)).ok_or("broadcast failed")?;
    let yv = y.broadcast(IxDyn(&shape)).ok_or("broadcast failed")?;
    Ok(Zip::from(&xv).and(&yv).map_collect(|&a, &b| f(a, b)))
}

/// An argument as a tensor: a node's value, or a Python number as a 0-d tensor.
pub(crate) fn operand(env: &Env<'_, Tensor>, a: &Arg<NodeId>) -> Result<Tensor, String> {
    if a.as_node().is_some() {
        return env.tensor(a).cloned();
    }
    let x = number(a).ok_or_else(|| format!("expected a tensor or a number, found {a:?}"))?;
    let dtype = match a {
        Arg::Float(_) => Dtype::Float64,
        Arg::Bool(_) => Dtype::Bool,
        _ => Dtype::Int64,
    };
    Tensor::scalar(x, dtype)
}

/// The dtype of `a op b` when the node records none: the tensors' (floating wins).
fn promote(a: &Tensor, b: &Tensor) -> Dtype {
    let fl = |t: &Tensor| t.dtype.is_floating();
    match (fl(a), fl(b)) {
        (true, false) => a.dtype,
        (false, true) => b.dtype,
        _ if a.shape().is_empty() => b.dtype,
        _ => a.dtype,
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Bin {
    Add,
    Sub,
    Mul,
    Div,
}

macro_rules! arith_float {
    ($T:ty, $a:expr, $b:expr, $dt:expr, $op:expr, $alpha:expr) => {{
        let x = <$T>::get($a);
        let y = <$T>::get($b);
        let al = $alpha.map(|v| v as $T);
        let r = match ($op, al) {
            (Bin::Add, None) => zip2(&x, &y, |p, q| p + q)?,
            (Bin::Add, Some(al)) => zip2(&x, &y, |p, q| p + al * q)?,
            (Bin::Sub, None) => zip2(&x, &y, |p, q| p - q)?,
            (Bin::Sub, Some(al)) => zip2(&x, &y, |p, q| p - al * q)?,
            (Bin::Mul, _) => zip2(&x, &y, |p, q| p * q)?,
            (Bin::Div, _) => zip2(&x, &y, |p, q| p / q)?,
        };
        <$T>::wrap(r, $dt)
    }};
}

pub(crate) fn binary(
    a: &Tensor,
    b: &Tensor,
    dt: Dtype,
    op: Bin,
    alpha: Option<f64>,
) -> Result<Tensor, String> {
    match kind(dt)? {
        Kind::F32 => arith_float!(f32, a, b, dt, op, alpha),
        Kind::F64 => arith_float!(f64, a, b, dt, op, alpha),
        Kind::I64 | Kind::Bool => {
            let x = i64::get(a);
            let y = i64::get(b);
            let al = alpha.map_or(1, |v| v as i64);
            let r = match op {
                Bin::Add => zip2(&x, &y, |p, q| p.wrapping_add(al.wrapping_mul(q)))?,
                Bin::Sub => zip2(&x, &y, |p, q| p.wrapping_sub(al.wrapping_mul(q)))?,
                Bin::Mul => zip2(&x, &y, i64::wrapping_mul)?,
                Bin::Div => zip2(&x, &y, |p, q| p.checked_div(q).unwrap_or(0))?,
            };
            i64::wrap(r, dt)
        }
    }
}

pub(crate) fn add_tensors(a: &Tensor, b: &Tensor, dt: Dtype) -> Result<Tensor, String> {
    binary(a, b, dt, Bin::Add, None)
}

fn arith(env: &Env<'_, Tensor>, op: Bin) -> Result<Value<Tensor>, String> {
    let a = operand(env, env.arg(0)?)?;
    let b = operand(env, env.arg(1)?)?;
    let alpha = env
        .node()
        .kwargs
        .get("alpha")
        .and_then(number)
        .filter(|&x| x != 1.0);
    let dt = out_dtype(env, promote(&a, &b));
    one(binary(&a, &b, dt, op, alpha)?)
}

pub fn add(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    arith(env, Bin::Add)
}
pub fn sub(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    arith(env, Bin::Sub)
}
pub fn mul(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    arith(env, Bin::Mul)
}
pub fn div(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    arith(env, Bin::Div)
}

/// `div.Tensor_mode(a, b, rounding_mode=trunc|floor)`.
pub fn div_mode(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let a = operand(env, env.arg(0)?)?;
    let b = operand(env, env.arg(1)?)?;
    let mode = match env.arg_or_kw(2, "rounding_mode") {
        Some(Arg::Str(s)) => s.clone(),
        _ => return arith(env, Bin::Div),
    };
    let dt = out_dtype(env, promote(&a, &b));
    let floor = mode == "floor";
    match kind(dt)? {
        Kind::I64 | Kind::Bool => {
            let (x, y) = (i64::get(&a), i64::get(&b));
            let r = zip2(&x, &y, |p, q| {
                if q == 0 {
                    0
                } else if floor {
                    p.div_euclid(q) - i64::from(q < 0 && p.rem_euclid(q) != 0)
                } else {
                    p / q
                }
            })?;
            one(i64::wrap(r, dt)?)
        }
        Kind::F32 => {
            let (x, y) = (f32::get(&a), f32::get(&b));
            let r = zip2(&x, &y, |p, q| {
                if floor {
                    (p / q).floor()
                } else {
                    (p / q).trunc()
                }
            })?;
            one(f32::wrap(r, dt)?)
        }
        Kind::F64 => {
            let (x, y) = (f64::get(&a), f64::get(&b));
            let r = zip2(&x, &y, |p, q| {
                if floor {
                    (p / q).floor()
                } else {
                    (p / q).trunc()
                }
            })?;
            one(f64::wrap(r, dt)?)
        }
    }
}

fn compare(
    env: &Env<'_, Tensor>,
    f64op: fn(f64, f64) -> bool,
    i64op: fn(i64, i64) -> bool,
) -> Result<Value<Tensor>, String> {
    let a = operand(env, env.arg(0)?)?;
    let b = operand(env, env.arg(1)?)?;
    let floating = a.dtype.is_floating() || b.dtype.is_floating();
    let r = if floating {
        zip2(&f64::get(&a), &f64::get(&b), f64op)?
    } else {
        zip2(&i64::get(&a), &i64::get(&b), i64op)?
    };
    one(bool::wrap(r, out_dtype(env, Dtype::Bool))?)
}

pub fn eq(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    compare(env, |a, b| a == b, |a, b| a == b)
}
pub fn ne(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    compare(env, |a, b| a != b, |a, b| a != b)
}
pub fn le(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    compare(env, |a, b| a <= b, |a, b| a <= b)
}
pub fn lt(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    compare(env, |a, b| a < b, |a, b| a < b)
}
pub fn ge(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    compare(env, |a, b| a >= b, |a, b| a >= b)
}
pub fn gt(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    compare(env, |a, b| a > b, |a, b| a > b)
}

fn bitwise(
    env: &Env<'_, Tensor>,
    bop: fn(bool, bool) -> bool,
    iop: fn(i64, i64) -> i64,
) -> Result<Value<Tensor>, String> {
    let a = operand(env, env.arg(0)?)?;
    let b = operand(env, env.arg(1)?)?;
    let dt = out_dtype(env, promote(&a, &b));
    if dt == Dtype::Bool {
        one(bool::wrap(zip2(&bool::get(&a), &bool::get(&b), bop)?, dt)?)
    } else {
        one(i64::wrap(zip2(&i64::get(&a), &i64::get(&b), iop)?, dt)?)
    }
}

pub fn bitwise_and(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    bitwise(env, |a, b| a & b, |a, b| a & b)
}
pub fn bitwise_or(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    bitwise(env, |a, b| a | b, |a, b| a | b)
}

fn select3<T: Elem>(c: &Arr<bool>, a: &Arr<T>, b: &Arr<T>) -> Result<ArrayD<T>, String> {
    let shape = bcast_shape(&bcast_shape(c.shape(), a.shape())?, b.shape())?;
    let s = IxDyn(&shape);
    let (cv, av, bv) = (
        c.broadcast(s.clone()).ok_or("broadcast failed")?,
        a.broadcast(s.clone()).ok_or("broadcast failed")?,
        b.broadcast(s).ok_or("broadcast failed")?,
    );
    Ok(Zip::from(&cv)
        .and(&av)
        .and(&bv)
        .map_collect(|&c, &x, &y| if c { x } else { y }))
}

/// `where.self(cond, a, b)`.
pub fn where_(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let c = bool::get(env.tensor(env.arg(0)?)?);
    let a = operand(env, env.arg(1)?)?;
    let b = operand(env, env.arg(2)?)?;
    let dt = out_dtype(env, promote(&a, &b));
    one(match kind(dt)? {
        Kind::F32 => f32::wrap(select3(&c, &f32::get(&a), &f32::get(&b))?, dt)?,
        Kind::F64 => f64::wrap(select3(&c, &f64::get(&a), &f64::get(&b))?, dt)?,
        Kind::I64 => i64::wrap(select3(&c, &i64::get(&a), &i64::get(&b))?, dt)?,
        Kind::Bool => bool::wrap(select3(&c, &bool::get(&a), &bool::get(&b))?, dt)?,
    })
}

macro_rules! float_unary {
    ($(#[$m:meta])* $name:ident, |$x:ident| $e:expr) => {
        $(#[$m])*
        pub fn $name(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
            let t = env.tensor(env.arg(0)?)?;
            let dt = out_dtype(env, t.dtype);
            match kind(dt)? {
                Kind::F64 => one(f64::wrap(f64::get(t).mapv(|$x: f64| $e), dt)?),
                Kind::F32 => one(f32::wrap(f32::get(t).mapv(|$x: f32| $e), dt)?),
                k => Err(format!("`{}` of a {k:?} tensor", stringify!($name))),
            }
        }
    };
}

float_unary!(exp, |x| x.exp());
float_unary!(cos, |x| x.cos());
float_unary!(sin, |x| x.sin());
float_unary!(rsqrt, |x| 1.0 / x.sqrt());
float_unary!(sqrt, |x| x.sqrt());
float_unary!(sigmoid, |x| 1.0 / (1.0 + (-x).exp()));
float_unary!(tanh, |x| x.tanh());
float_unary!(reciprocal, |x| 1.0 / x);
float_unary!(log, |x| x.ln());

pub fn neg(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let dt = out_dtype(env, t.dtype);
    one(match kind(dt)? {
        Kind::F64 => f64::wrap(f64::get(t).mapv(|x| -x), dt)?,
        Kind::F32 => f32::wrap(f32::get(t).mapv(|x| -x), dt)?,
        _ => i64::wrap(i64::get(t).mapv(i64::wrapping_neg), dt)?,
    })
}

/// `pow.Tensor_Scalar(x, e)`: `x * x` for 2 (as torch does), `x` for 1, else `powf`.
pub fn pow_scalar(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let e = number(env.arg(1)?).ok_or("pow: the exponent is not a number")?;
    let dt = out_dtype(env, t.dtype);
    one(match kind(dt)? {
        Kind::F64 => f64::wrap(
            f64::get(t).mapv(|x| match e {
                2.0 => x * x,
                1.0 => x,
                0.5 => x.sqrt(),
                _ => x.powf(e),
            }),
            dt,
        )?,
        Kind::F32 => {
            let e32 = e as f32;
            f32::wrap(
                f32::get(t).mapv(|x| match e {
                    2.0 => x * x,
                    1.0 => x,
                    0.5 => x.sqrt(),
                    _ => x.powf(e32),
                }),
                dt,
            )?
        }
        _ => {
            let p = u32::try_from(e as i64).map_err(|_| "pow: negative integer exponent")?;
            i64::wrap(i64::get(t).mapv(|x| x.wrapping_pow(p)), dt)?
        }
    })
}

/// `_to_copy(x, *, dtype)` / `convert_element_type(x, dtype)`.
pub fn to_copy(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let asked = match env.arg_or_kw(1, "dtype") {
        Some(Arg::Dtype(d)) => *d,
        _ => t.dtype,
    };
    one(t.cast(out_dtype(env, asked))?)
}

/// `clone` and `alias`: the same values (the graph is functional).
pub fn clone(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    one(t.cast(out_dtype(env, t.dtype))?)
}

/// Integer power as torch's CPU kernel: a negative exponent gives 1 / x^|e| truncated
/// (0 unless x is 1 or -1).
fn int_pow(x: i64, e: i64) -> i64 {
    match u32::try_from(e) {
        Ok(p) => x.wrapping_pow(p),
        Err(_) if e > 0 => x.wrapping_pow(u32::MAX),
        Err(_) => match x {
            1 => 1,
            -1 if e % 2 == 0 => 1,
            -1 => -1,
            _ => 0,
        },
    }
}

/// `pow.Tensor_Tensor(a, b)` and `pow.Scalar(number, b)`, broadcasting, in the output dtype's
/// compute type.
pub fn pow_tensor(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let a = operand(env, env.arg(0)?)?;
    let b = operand(env, env.arg(1)?)?;
    let dt = out_dtype(env, promote(&a, &b));
    one(match kind(dt)? {
        Kind::F64 => f64::wrap(zip2(&f64::get(&a), &f64::get(&b), f64::powf)?, dt)?,
        Kind::F32 => f32::wrap(zip2(&f32::get(&a), &f32::get(&b), f32::powf)?, dt)?,
        _ => i64::wrap(zip2(&i64::get(&a), &i64::get(&b), int_pow)?, dt)?,
    })
}
