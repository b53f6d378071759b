//! Activations and their backward ops as AOTAutograd leaves them without a decomposition
//! table: relu / threshold_backward, gelu (erf and tanh forms) / gelu_backward, silu /
//! silu_backward, erf, abs, minimum / maximum, hardswish, softplus, leaky_relu, elu, hardtanh
//! and their backward, sigmoid / tanh backward. Torch's CPU formulas, in the output dtype's
//! compute type.

use super::{Env, Value, number, one, out_dtype};
use crate::elementwise::{operand, zip2};
use crate::real::{Real, by_real};
use num_traits::{Float, One, Zero};
use zerosched_exec::host::{Elem, Kind, Tensor, kind};
use zerosched_ir::Arg;

fn unary<T: Real>(env: &Env<'_, Tensor>, f: impl Fn(T) -> T) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    one(T::wrap(T::get(t).mapv(f), out_dtype(env, t.dtype))?)
}

/// `f(grad, x)` elementwise, the output in the gradient's dtype.
fn with_grad<T: Real>(
    env: &Env<'_, Tensor>,
    f: impl Fn(T, T) -> T,
) -> Result<Value<Tensor>, String> {
    let g = env.tensor(env.arg(0)?)?;
    let x = env.tensor(env.arg(1)?)?;
    one(T::wrap(
        zip2(&T::get(g), &T::get(x), f)?,
        out_dtype(env, g.dtype),
    )?)
}

fn dtype0(env: &Env<'_, Tensor>) -> Result<zerosched_ir::Dtype, String> {
    Ok(out_dtype(env, env.tensor(env.arg(0)?)?.dtype))
}

/// Whether `approximate='tanh'` (the default is the erf form).
fn tanh_form(env: &Env<'_, Tensor>, i: usize) -> Result<bool, String> {
    match env.arg_or_kw(i, "approximate") {
        None | Some(Arg::None) => Ok(false),
        Some(Arg::Str(s)) if s == "none" => Ok(false),
        Some(Arg::Str(s)) if s == "tanh" => Ok(true),
        Some(a) => Err(format!(
            "gelu: approximate={a:?} is neither 'none' nor 'tanh'"
        )),
    }
}

/// relu(x) = max(x, 0), NaN kept (as clamp_min).
pub fn relu(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let dt = out_dtype(env, t.dtype);
    match kind(dt)? {
        Kind::I64 => one(i64::wrap(i64::get(t).mapv(|x| x.max(0)), dt)?),
        _ => by_real!(dt, "relu", T => unary::<T>(env, |x| if x <= 0.0 { 0.0 } else { x })),
    }
}

/// threshold_backward(grad, x, threshold) = grad where x > threshold, else 0.
pub fn threshold_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let th = number(env.arg(2)?).ok_or("threshold_backward: threshold is not a number")?;
    by_real!(dtype0(env)?, "threshold_backward", T => {
        let th = T::c(th);
        with_grad::<T>(env, |g, x| if x <= th { T::zero() } else { g })
    })
}

fn gelu_t<T: Real>(x: T, tanh: bool) -> T {
    let half = T::c(0.5);
    if tanh {
        let inner = T::c(std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2)
            * (x + T::c(0.044715) * x * x * x);
        half * x * (T::one() + inner.tanh())
    } else {
        x * half * (T::one() + (x * T::c(std::f64::consts::FRAC_1_SQRT_2)).erf())
    }
}

fn gelu_grad_t<T: Real>(g: T, x: T, tanh: bool) -> T {
    let half = T::c(0.5);
    if tanh {
        let beta = T::c(std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5);
        let kappa = T::c(0.044715);
        let x2 = x * x;
        let t = (beta * (x + kappa * x2 * x)).tanh();
        let left = half * x;
        let right = T::one() + t;
        let dleft = half * right;
        let dright = left * (T::one() - t * t) * beta * (T::one() + T::c(3.0) * kappa * x2);
        g * (dleft + dright)
    } else {
        let cdf = half * (T::one() + (x * T::c(std::f64::consts::FRAC_1_SQRT_2)).erf());
        let pdf = (-half * x * x).exp()
            * T::c(std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2 * 0.5);
        g * (cdf + x * pdf)
    }
}

pub fn gelu(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let tanh = tanh_form(env, 1)?;
    by_real!(dtype0(env)?, "gelu", T => unary::<T>(env, |x| gelu_t(x, tanh)))
}

/// gelu_backward(grad, x, approximate).
pub fn gelu_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let tanh = tanh_form(env, 2)?;
    by_real!(dtype0(env)?, "gelu_backward", T => with_grad::<T>(env, |g, x| gelu_grad_t(g, x, tanh)))
}

pub fn silu(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(dtype0(env)?, "silu", T => unary::<T>(env, |x| x / (T::one() + (-x).exp())))
}

/// silu_backward(grad, x) = grad * s * (1 + x * (1 - s)), s = sigmoid(x).
pub fn silu_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(dtype0(env)?, "silu_backward", T => with_grad::<T>(env, |g, x| {
        let s = T::one() / (T::one() + (-x).exp());
        g * s * (T::one() + x * (T::one() - s))
    }))
}

pub fn erf(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(dtype0(env)?, "erf", T => unary::<T>(env, Real::erf))
}

pub fn abs(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let dt = out_dtype(env, t.dtype);
    match kind(dt)? {
        Kind::I64 => one(i64::wrap(i64::get(t).mapv(i64::wrapping_abs), dt)?),
        Kind::Bool => one(t.cast(dt)?),
        _ => by_real!(dt, "abs", T => unary::<T>(env, num_traits::Float::abs)),
    }
}

fn extremum(env: &Env<'_, Tensor>, max: bool) -> Result<Value<Tensor>, String> {
    let a = operand(env, env.arg(0)?)?;
    let b = operand(env, env.arg(1)?)?;
    let dt = out_dtype(env, a.dtype);
    let pick = |x_lt_y: bool| x_lt_y != max;
    match kind(dt)? {
        Kind::I64 | Kind::Bool => {
            let r = zip2(&i64::get(&a), &i64::get(&b), |x, y| {
                if pick(x < y) { x } else { y }
            })?;
            one(i64::wrap(r, dt)?)
        }
        _ => by_real!(dt, "minimum", T => {
            let r = zip2(&T::get(&a), &T::get(&b), |x: T, y: T| {
                if x.is_nan() || y.is_nan() {
                    T::nan()
                } else if pick(x < y) {
                    x
                } else {
                    y
                }
            })?;
            one(T::wrap(r, dt)?)
        }),
    }
}

/// minimum(a, b): NaN if either is NaN (unlike fmin).
pub fn minimum(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    extremum(env, false)
}
pub fn maximum(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    extremum(env, true)
}

/// Scalar argument `i` (or keyword `name`), else `default`.
fn scalar(env: &Env<'_, Tensor>, i: usize, name: &str, default: f64) -> Result<f64, String> {
    match env.arg_or_kw(i, name) {
        None | Some(Arg::None) => Ok(default),
        Some(a) => number(a).ok_or_else(|| format!("`{name}` is not a number: {a:?}")),
    }
}

/// hardswish(x) = x * clamp(x + 3, 0, 6) / 6.
pub fn hardswish(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(dtype0(env)?, "hardswish", T => unary::<T>(env, |x| {
        x * (x + T::c(3.0)).max(T::zero()).min(T::c(6.0)) / T::c(6.0)
    }))
}

pub fn hardswish_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(dtype0(env)?, "hardswish_backward", T => with_grad::<T>(env, |g, x| {
        if x < T::c(-3.0) {
            T::zero()
        } else if x <= T::c(3.0) {
            g * (x / T::c(3.0) + T::c(0.5))
        } else {
            g
        }
    }))
}

/// softplus(x, beta, threshold) = log1p(exp(beta x)) / beta, x where beta x > threshold.
pub fn softplus(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (beta, th) = (
        scalar(env, 1, "beta", 1.0)?,
        scalar(env, 2, "threshold", 20.0)?,
    );
    by_real!(dtype0(env)?, "softplus", T => {
        let (b, t) = (T::c(beta), T::c(th));
        unary::<T>(env, |x| if x * b > t { x } else { (x * b).exp().ln_1p() / b })
    })
}

pub fn softplus_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (beta, th) = (
        scalar(env, 2, "beta", 1.0)?,
        scalar(env, 3, "threshold", 20.0)?,
    );
    by_real!(dtype0(env)?, "softplus_backward", T => {
        let (b, t) = (T::c(beta), T::c(th));
        with_grad::<T>(env, |g, x| {
            let z = (x * b).exp();
            if x * b > t { g } else { g * z / (z + T::one()) }
        })
    })
}

/// leaky_relu(x, slope) = x where x > 0, else slope x.
pub fn leaky_relu(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let slope = scalar(env, 1, "negative_slope", 0.01)?;
    by_real!(dtype0(env)?, "leaky_relu", T => {
        let s = T::c(slope);
        unary::<T>(env, |x| if x > T::zero() { x } else { x * s })
    })
}

/// leaky_relu_backward(grad, x, slope, self_is_result): the sign of x and of the result agree.
pub fn leaky_relu_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let slope = scalar(env, 2, "negative_slope", 0.01)?;
    by_real!(dtype0(env)?, "leaky_relu_backward", T => {
        let s = T::c(slope);
        with_grad::<T>(env, |g, x| if x > T::zero() { g } else { g * s })
    })
}

/// elu(x, alpha, scale, input_scale) = scale x where x > 0, else
/// alpha scale (exp(input_scale x) - 1).
pub fn elu(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let alpha = scalar(env, 1, "alpha", 1.0)?;
    let scale = scalar(env, 2, "scale", 1.0)?;
    let input_scale = scalar(env, 3, "input_scale", 1.0)?;
    by_real!(dtype0(env)?, "elu", T => {
        let (neg, pos, ins) = (T::c(alpha * scale), T::c(scale), T::c(input_scale));
        unary::<T>(env, |x| if x <= T::zero() { (x * ins).exp_m1() * neg } else { x * pos })
    })
}

/// elu_backward(grad, alpha, scale, input_scale, is_result, self_or_result).
pub fn elu_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let alpha = scalar(env, 1, "alpha", 1.0)?;
    let scale = scalar(env, 2, "scale", 1.0)?;
    let input_scale = scalar(env, 3, "input_scale", 1.0)?;
    let is_result = matches!(env.arg_or_kw(4, "is_result"), Some(Arg::Bool(true)));
    let g = env.tensor(env.arg(0)?)?;
    let y = env.tensor(env.arg(5)?)?;
    let dt = out_dtype(env, g.dtype);
    by_real!(dt, "elu_backward", T => {
        let (neg, pos, ins) = (T::c(alpha * scale), T::c(scale), T::c(input_scale));
        let r = zip2(&T::get(g), &T::get(y), |g, v| {
            if v > T::zero() {
                g * pos
            } else if is_result {
                g * ins * (v + neg)
            } else {
                g * ins * neg * (v * ins).exp()
            }
        })?;
        one(T::wrap(r, dt)?)
    })
}

/// sigmoid_backward(grad, y) = grad (1 - y) y, y the forward's result.
pub fn sigmoid_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(dtype0(env)?, "sigmoid_backward", T => with_grad::<T>(env, |g, y| g * (T::one() - y) * y))
}

/// tanh_backward(grad, y) = grad (1 - y^2), y the forward's result.
pub fn tanh_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(dtype0(env)?, "tanh_backward", T => with_grad::<T>(env, |g, y| g * (T::one() - y * y)))
}

/// hardtanh_backward(grad, x, min, max) = grad strictly inside (min, max), else 0.
pub fn hardtanh_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let lo = scalar(env, 2, "min_val", -1.0)?;
    let hi = scalar(env, 3, "max_val", 1.0)?;
    by_real!(dtype0(env)?, "hardtanh_backward", T => {
        let (lo, hi) = (T::c(lo), T::c(hi));
        with_grad::<T>(env, |g, x| if x <= lo || x >= hi { T::zero() } else { g })
    })
}
