//! The ops whose values PyTorch draws from its generator: `native_dropout` (and its backward,
//! which is not random), `rand` / `randn` / `randint` and their `_like` forms, `bernoulli`,
//! `randperm` (positions ordered by their draws).
//!
//! No executor can reproduce PyTorch's generator stream, so these follow this executor's own
//! rule (docs/exec.md): element `i` of a random node's output is a function of the node's name
//! and `i` alone, through SplitMix64 of (FNV-1a of the name) + `i`. The run's seed, the rank
//! and the position of the node in the order play no part, so every rank draws the same
//! values, and a scheduled graph (whose compute nodes keep their names) draws exactly what the
//! original draws.

use super::{Env, Value, ints, number, one, out_dtype, out_shape};
use crate::create::kw_dtype;
use ndarray::{ArrayD, IxDyn};
use zerosched_exec::host::{Elem, Tensor};
use zerosched_ir::{Arg, Dtype};

/// The stream of a node: uniform draws in [0, 1) by element index. Its key travels in the RNG
/// state a fused attention forward returns, so that its backward draws the same dropout mask.
pub(crate) struct Stream(pub(crate) u64);

impl Stream {
    pub(crate) fn of(env: &Env<'_, Tensor>) -> Stream {
        // FNV-1a 64 of the node's name.
        let h = env
            .node()
            .name
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
            });
        Stream(h)
    }

    /// SplitMix64 of the key advanced `i` steps: draw `i` of the stream.
    fn bits(&self, i: u64) -> u64 {
        let mut z = self
            .0
            .wrapping_add(i.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub(crate) fn uniform(&self, i: u64) -> f64 {
        (self.bits(i) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box-Muller on draws 2i and 2i + 1).
    fn normal(&self, i: u64) -> f64 {
        let u1 = 1.0 - self.uniform(2 * i); // in (0, 1]: ln is finite
        let u2 = self.uniform(2 * i + 1);
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

fn make(shape: &[usize], dt: Dtype, f: impl Fn(u64) -> f64) -> Result<Tensor, String> {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n as u64).map(f).collect();
    f64::wrap(
        ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| e.to_string())?,
        dt,
    )
}

fn size(a: &Arg<zerosched_ir::NodeId>) -> Result<Vec<usize>, String> {
    ints(a)?
        .into_iter()
        .map(|d| usize::try_from(d).map_err(|_| format!("negative size {d}")))
        .collect()
}

/// The output's shape: the recorded metadata's, else the `_like` input's or the size list.
fn shape_of(env: &Env<'_, Tensor>, like: bool, size_at: usize) -> Result<Vec<usize>, String> {
    if let Some(s) = out_shape(env) {
        return Ok(s);
    }
    if like {
        Ok(env.tensor(env.arg(0)?)?.shape().to_vec())
    } else {
        size(env.arg(size_at)?)
    }
}

fn dtype_of(env: &Env<'_, Tensor>, like: bool, fallback: Dtype) -> Result<Dtype, String> {
    let base = if like {
        env.tensor(env.arg(0)?)?.dtype
    } else {
        fallback
    };
    Ok(kw_dtype(env, base))
}

/// `rand(size)` / `rand_like(x)`: uniform in [0, 1).
pub fn rand(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let like = env.node().target.starts_with("aten.rand_like");
    let s = Stream::of(env);
    let dt = dtype_of(env, like, Dtype::Float32)?;
    one(make(&shape_of(env, like, 0)?, dt, |i| s.uniform(i))?)
}

/// `randn(size)` / `randn_like(x)`: standard normal.
pub fn randn(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let like = env.node().target.starts_with("aten.randn_like");
    let s = Stream::of(env);
    let dt = dtype_of(env, like, Dtype::Float32)?;
    one(make(&shape_of(env, like, 0)?, dt, |i| s.normal(i))?)
}

/// `randint(high, size)`, `randint.low(low, high, size)`, `randint_like(x, high)`,
/// `randint_like.low_dtype(x, low, high)`: uniform integers in [low, high).
pub fn randint(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.node().target.as_str();
    let like = t.starts_with("aten.randint_like");
    let low_form = t.ends_with(".low") || t.ends_with(".low_dtype");
    let at = usize::from(like);
    let num = |i: usize| -> Result<i64, String> {
        let a = env.arg(i)?;
        number(a)
            .map(|x| x as i64)
            .ok_or_else(|| format!("randint: argument {i} is not an integer"))
    };
    let (low, high) = if low_form {
        (num(at)?, num(at + 1)?)
    } else {
        (0, num(at)?)
    };
    if high <= low {
        return Err(format!("randint: empty range [{low}, {high})"));
    }
    let span = (high - low) as u64;
    let s = Stream::of(env);
    let size_at = if low_form { 2 } else { 1 };
    let dt = dtype_of(env, like, Dtype::Int64)?;
    let shape = shape_of(env, like, size_at)?;
    let n: usize = shape.iter().product();
    let v: Vec<i64> = (0..n as u64)
        .map(|i| low + (s.bits(i) % span) as i64)
        .collect();
    one(i64::wrap(
        ArrayD::from_shape_vec(IxDyn(&shape), v).map_err(|e| e.to_string())?,
        dt,
    )?)
}

/// `bernoulli(p_tensor)` and `bernoulli.p(x, p)`: 1 where draw `i` is below the probability.
pub fn bernoulli(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let s = Stream::of(env);
    let dt = out_dtype(env, x.dtype);
    let p: Vec<f64> = match env.node().args.get(1) {
        Some(a @ Arg::Node(_)) => {
            let p = env.tensor(a)?;
            if p.numel() != 1 && p.shape() != x.shape() {
                return Err(format!(
                    "bernoulli: probabilities {:?} for a tensor {:?}",
                    p.shape(),
                    x.shape()
                ));
            }
            let v = p.to_f64_vec();
            if v.len() == 1 {
                vec![v[0]; x.numel()]
            } else {
                v
            }
        }
        Some(a) => vec![number(a).ok_or("bernoulli: p is not a number")?; x.numel()],
        None => x.to_f64_vec(),
    };
    one(make(x.shape(), dt, |i| {
        f64::from(u8::from(s.uniform(i) < p[i as usize]))
    })?)
}

/// `native_dropout(x, p, train)` → (x * mask / (1 - p), mask), mask true where draw `i` is
/// at least `p` (kept with probability 1 - p); outside training (`train` false) the input and
/// an all-true mask.
pub fn native_dropout(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    let p = number(env.arg(1)?).ok_or("native_dropout: p is not a number")?;
    if !(0.0..=1.0).contains(&p) {
        return Err(format!("native_dropout: p = {p} outside [0, 1]"));
    }
    let train = !matches!(env.arg_or_kw(2, "train"), Some(Arg::Bool(false)));
    let s = Stream::of(env);
    let n = x.numel();
    let keep: Vec<bool> = (0..n as u64)
        .map(|i| !train || (p < 1.0 && s.uniform(i) >= p))
        .collect();
    let dt = env.out_meta_k(0).map_or(x.dtype, |m| m.dtype);
    let md = env.out_meta_k(1).map_or(Dtype::Bool, |m| m.dtype);
    let scale = if !train {
        1.0
    } else if p < 1.0 {
        1.0 / (1.0 - p)
    } else {
        0.0
    };
    let mask = bool::wrap(
        ArrayD::from_shape_vec(IxDyn(x.shape()), keep.clone()).map_err(|e| e.to_string())?,
        md,
    )?;
    let out = crate::real::by_real!(dt, "native_dropout", T => {
        let sc = <T as Elem>::from_f64(scale);
        let v: Vec<T> = T::get(x)
            .iter()
            .zip(&keep)
            .map(|(&a, &k)| if k { a * sc } else { <T as Elem>::elem_zero() })
            .collect();
        T::wrap(
            ArrayD::from_shape_vec(IxDyn(x.shape()), v).map_err(|e| e.to_string())?,
            dt,
        )
    })?;
    Ok(Value::List(vec![Some(out), Some(mask)]))
}

/// `native_dropout_backward(grad, mask, scale)` = grad * mask * scale.
pub fn native_dropout_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let g = env.tensor(env.arg(0)?)?;
    let m = env.tensor(env.arg(1)?)?;
    let scale = number(env.arg(2)?).ok_or("native_dropout_backward: scale is not a number")?;
    let dt = out_dtype(env, g.dtype);
    crate::real::by_real!(dt, "native_dropout_backward", T => {
        let sc = <T as Elem>::from_f64(scale);
        let r = crate::elementwise::zip2(&T::get(g), &bool::get(m), |a: T, k: bool| {
            if k { a * sc } else { <T as Elem>::elem_zero() }
        })?;
        one(T::wrap(r, dt)?)
    })
}

/// `randperm(n)`: 0..n ordered by each position's draw (ties by position).
pub fn randperm(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let n = number(env.arg(0)?).ok_or("randperm: n is not an integer")?;
    let n = usize::try_from(n as i64).map_err(|_| format!("randperm: n = {n}"))?;
    let s = Stream::of(env);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| s.bits(i as u64));
    let v: Vec<i64> = order.into_iter().map(|i| i as i64).collect();
    one(i64::wrap(
        ArrayD::from_shape_vec(IxDyn(&[n]), v).map_err(|e| e.to_string())?,
        kw_dtype(env, Dtype::Int64),
    )?)
}

#[cfg(test)]
mod tests {
    use super::Stream;

    /// The rule's draws are uniform enough that dropout keeps about 1 - p, and a stream is a
    /// function of its key alone.
    #[test]
    fn draws_are_spread_and_keyed() {
        let s = Stream(42);
        let n = 20_000;
        let mean: f64 = (0..n).map(|i| s.uniform(i)).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        let kept = (0..n).filter(|&i| s.uniform(i) >= 0.1).count();
        assert!((kept as f64 / n as f64 - 0.9).abs() < 0.01, "{kept}");
        let z: f64 = (0..n).map(|i| s.normal(i).powi(2)).sum::<f64>() / n as f64;
        assert!((z - 1.0).abs() < 0.05, "variance {z}");
        assert_eq!(Stream(42).bits(7), s.bits(7));
        assert_ne!(Stream(43).bits(7), s.bits(7));
    }
}
