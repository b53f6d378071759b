//! `nll_loss_forward` / `nll_loss_backward` over `[N, C]` or `[C]` log-probabilities, with
//! class weights, `ignore_index` and the reductions none (0), mean (1) and sum (2), as torch's
//! CPU kernel: mean divides by the total weight of the targets that are not ignored.

use super::{Env, Value, int, one, out_dtype};
use crate::real::{Real, by_real};
use ndarray::{ArrayD, IxDyn};
use zerosched_exec::host::{Elem, Tensor};
use zerosched_ir::Arg;

struct Nll<T> {
    /// Rows of the input (1 for a `[C]` input) and classes.
    n: usize,
    c: usize,
    x: Vec<T>,
    target: Vec<i64>,
    weight: Option<Vec<T>>,
    reduction: i64,
    ignore: i64,
}

impl<T: Real> Nll<T> {
    fn read(env: &Env<'_, Tensor>, x_at: usize) -> Result<Nll<T>, String> {
        let xt = env.tensor(env.arg(x_at)?)?;
        let (n, c) = match xt.shape() {
            [c] => (1, *c),
            [n, c] => (*n, *c),
            s => {
                return Err(format!(
                    "nll_loss: input of shape {s:?} (only [N, C] and [C])"
                ));
            }
        };
        let target: Vec<i64> = i64::get(env.tensor(env.arg(x_at + 1)?)?)
            .iter()
            .copied()
            .collect();
        if target.len() != n {
            return Err(format!("nll_loss: {} targets for {n} rows", target.len()));
        }
        let weight = match env.arg(x_at + 2)? {
            a @ Arg::Node(_) => Some(T::get(env.tensor(a)?).iter().copied().collect::<Vec<T>>()),
            _ => None,
        };
        if weight.as_ref().is_some_and(|w| w.len() != c) {
            return Err(format!("nll_loss: weight is not of the {c} classes"));
        }
        let ignore = int(env.arg(x_at + 4)?)?;
        for &t in &target {
            if t != ignore && !(0..c as i64).contains(&t) {
                return Err(format!("nll_loss: target {t} out of range for {c} classes"));
            }
        }
        Ok(Nll {
            n,
            c,
            x: T::get(xt).iter().copied().collect(),
            target,
            weight,
            reduction: int(env.arg(x_at + 3)?)?,
            ignore,
        })
    }

    /// The weight of row `i`'s target (0 when ignored) and the target.
    fn w(&self, i: usize) -> (T, usize) {
        let t = self.target[i];
        if t == self.ignore {
            return (T::zero(), 0);
        }
        let t = t as usize;
        (self.weight.as_ref().map_or(T::one(), |w| w[t]), t)
    }

    fn total_weight(&self) -> T {
        (0..self.n).map(|i| self.w(i).0).sum()
    }
}

fn fwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let l = Nll::<T>::read(env, 0)?;
    let losses: Vec<T> = (0..l.n)
        .map(|i| {
            let (w, t) = l.w(i);
            if w == T::zero() {
                T::zero()
            } else {
                -w * l.x[i * l.c + t]
            }
        })
        .collect();
    let total = l.total_weight();
    let out = match l.reduction {
        0 => {
            let shape: &[usize] = if env.tensor(env.arg(0)?)?.shape().len() == 1 {
                &[]
            } else {
                &[l.n]
            };
            ArrayD::from_shape_vec(IxDyn(shape), losses).map_err(|e| e.to_string())?
        }
        1 => ArrayD::from_elem(IxDyn(&[]), losses.into_iter().sum::<T>() / total),
        2 => ArrayD::from_elem(IxDyn(&[]), losses.into_iter().sum::<T>()),
        r => return Err(format!("nll_loss: reduction {r}")),
    };
    let xdt = env.tensor(env.arg(0)?)?.dtype;
    let d = |k: usize| env.out_meta_k(k).map_or(xdt, |m| m.dtype);
    let tw = if l.reduction == 0 { T::zero() } else { total };
    Ok(Value::List(vec![
        Some(T::wrap(out, d(0))?),
        Some(T::wrap(ArrayD::from_elem(IxDyn(&[]), tw), d(1))?),
    ]))
}

fn bwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let l = Nll::<T>::read(env, 1)?;
    let g: Vec<T> = T::get(env.tensor(env.arg(0)?)?).iter().copied().collect();
    let total: Vec<T> = T::get(env.tensor(env.arg(6)?)?).iter().copied().collect();
    let xt = env.tensor(env.arg(1)?)?;
    let mut dx = vec![T::zero(); l.n * l.c];
    for i in 0..l.n {
        let (w, t) = l.w(i);
        if w == T::zero() {
            continue;
        }
        let gi = match l.reduction {
            0 => *g
                .get(i)
                .ok_or("nll_loss_backward: fewer gradients than rows")?,
            1 => {
                *g.first().ok_or("nll_loss_backward: no gradient")?
                    / *total.first().ok_or("nll_loss_backward: no total weight")?
            }
            _ => *g.first().ok_or("nll_loss_backward: no gradient")?,
        };
        dx[i * l.c + t] = -w * gi;
    }
    let a = ArrayD::from_shape_vec(IxDyn(xt.shape()), dx).map_err(|e| e.to_string())?;
    one(T::wrap(a, out_dtype(env, xt.dtype))?)
}

/// `nll_loss_forward(self, target, weight, reduction, ignore_index)` → (output, total_weight).
pub fn nll_loss_forward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(0)?)?.dtype, "nll_loss_forward", T => fwd::<T>(env))
}

/// `nll_loss_backward(grad, self, target, weight, reduction, ignore_index, total_weight)`.
pub fn nll_loss_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(1)?)?.dtype, "nll_loss_backward", T => bwd::<T>(env))
}

#[cfg(test)]
mod tests {
    use crate::testkit::{f32s, run1};

    /// A target outside the classes (and not `ignore_index`) is an error naming it; an
    /// ignored one is not.
    #[test]
    fn target_out_of_range_is_refused() {
        let x = f32s(&[2, 2], &[-1.0, -2.0, -3.0, -4.0]);
        let int = |v: &[f32]| f32s(&[2], v).cast(zerosched_ir::Dtype::Int64).expect("int");
        let meta = r#"[{"dtype":"float32","shape":[]},{"dtype":"float32","shape":[]}]"#;
        let args = r#"[{"node":"x0"},{"node":"x1"},null,1,-100]"#;
        run1(
            "aten.nll_loss_forward.default",
            &[x.clone(), int(&[-100.0, 1.0])],
            args,
            meta,
        )
        .expect("an ignored target is fine");
        let err = run1(
            "aten.nll_loss_forward.default",
            &[x, int(&[0.0, 7.0])],
            args,
            meta,
        )
        .expect_err("range");
        assert!(err.contains("target 7 out of range for 2 classes"), "{err}");
    }
}
