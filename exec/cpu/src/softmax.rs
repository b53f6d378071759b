//! What AOTAutograd leaves of softmax without a decomposition table: `_safe_softmax` (a row
//! of only `-inf` gives zeros, not NaN: attention with every key masked) and the backward ops
//! `_softmax_backward_data` (`y * (g - sum(g * y))`) and `_log_softmax_backward_data`
//! (`g - exp(y) * sum(g)`), the sums along the softmax dimension.

use super::{Env, Value, int, norm_dim, one, out_dtype};
use crate::real::by_real;
use ndarray::{Axis, Zip};
use num_traits::{Float, Zero};
use zerosched_exec::host::{Elem, Tensor};

/// `_safe_softmax(x, dim, dtype=None)`: `_softmax`, then zeros where a row is all `-inf`.
pub fn safe_softmax(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let d = norm_dim(int(env.arg(1)?)?, x.shape().len())?;
    if x.shape().is_empty() {
        return Err("_safe_softmax of a 0-d tensor".into());
    }
    let Value::Tensor(y) = crate::reduce::softmax(env)? else {
        return Err("_safe_softmax: softmax gave no tensor".into());
    };
    by_real!(y.dtype, "_safe_softmax", T => {
        let xs = T::get(x);
        let mut out = T::get(&y).into_owned();
        Zip::from(xs.lanes(Axis(d)))
            .and(out.lanes_mut(Axis(d)))
            .for_each(|xl, mut ol| {
                if xl.iter().all(|&v| v == T::neg_infinity()) {
                    ol.fill(T::zero());
                }
            });
        one(T::wrap(out, y.dtype)?)
    })
}

fn backward(env: &Env<'_, Tensor>, log: bool) -> Result<Value<Tensor>, String> {
    let g = env.tensor(env.arg(0)?)?;
    let y = env.tensor(env.arg(1)?)?;
    if g.shape() != y.shape() {
        return Err(format!(
            "softmax backward: gradient {:?}, output {:?}",
            g.shape(),
            y.shape()
        ));
    }
    let d = norm_dim(int(env.arg(2)?)?, g.shape().len())?;
    let dt = out_dtype(env, g.dtype);
    // A 0-d tensor is one row of one element.
    let shape = g.shape().to_vec();
    let (g, y) = if shape.is_empty() {
        (g.reshape(&[1])?, y.reshape(&[1])?)
    } else {
        (g.clone(), y.clone())
    };
    by_real!(dt, "softmax backward", T => {
        let (gs, ys) = (T::get(&g), T::get(&y));
        let mut out = gs.to_owned();
        Zip::from(gs.lanes(Axis(d)))
            .and(ys.lanes(Axis(d)))
            .and(out.lanes_mut(Axis(d)))
            .for_each(|gl, yl, mut ol| {
                if log {
                    let s: T = gl.iter().copied().sum();
                    Zip::from(&mut ol).and(&gl).and(&yl).for_each(|o, &g, &y| *o = g - y.exp() * s);
                } else {
                    let s: T = gl.iter().zip(yl.iter()).map(|(&g, &y)| g * y).sum();
                    Zip::from(&mut ol).and(&gl).and(&yl).for_each(|o, &g, &y| *o = y * (g - s));
                }
            });
        one(T::wrap(out, dt)?.reshape(&shape)?)
    })
}

/// `_softmax_backward_data(grad, output, dim, input_dtype)`.
pub fn softmax_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    backward(env, false)
}

/// `_log_softmax_backward_data(grad, output, dim, input_dtype)`.
pub fn log_softmax_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    backward(env, true)
}

#[cfg(test)]
mod tests {
    use crate::testkit::{f32s, run1};

    const META: &str = r#"{"dtype":"float32","shape":[2,3]}"#;

    /// A row of only `-inf` (every key masked): zeros, where `_softmax` gives NaN.
    #[test]
    fn safe_softmax_of_a_masked_row_is_zero() {
        let inf = f32::NEG_INFINITY;
        let x = f32s(&[2, 3], &[inf, inf, inf, 0.0, 0.0, inf]);
        let args = r#"[{"node":"x0"},-1]"#;
        let safe = run1(
            "aten._safe_softmax.default",
            std::slice::from_ref(&x),
            args,
            META,
        )
        .expect("run");
        let v = safe[0].as_ref().expect("tensor").to_f64_vec();
        assert_eq!(v, [0.0, 0.0, 0.0, 0.5, 0.5, 0.0]);
        let plain = run1(
            "aten._softmax.default",
            &[x],
            r#"[{"node":"x0"},-1,false]"#,
            META,
        )
        .expect("run");
        assert!(plain[0].as_ref().expect("tensor").to_f64_vec()[0].is_nan());
    }

    /// `_softmax_backward_data` of a 0-d tensor (a one-element row) is zero, not a panic.
    #[test]
    fn softmax_backward_of_a_scalar() {
        let g = f32s(&[], &[2.0]);
        let y = f32s(&[], &[1.0]);
        let out = run1(
            "aten._softmax_backward_data.default",
            &[g, y],
            r#"[{"node":"x0"},{"node":"x1"},0,{"dtype":"float32"}]"#,
            r#"{"dtype":"float32","shape":[]}"#,
        )
        .expect("run");
        assert_eq!(out[0].as_ref().expect("tensor").to_f64_vec(), [0.0]);
    }
}
