//! `tril` / `triu`: over the last two dimensions, with the `diagonal` offset.

use super::{Env, Value, int, one};
use ndarray::{ArrayD, IxDyn};
use zerosched_exec::host::{Elem, Kind, Tensor};

fn triangle(env: &Env<'_, Tensor>, lower: bool) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let k = env.node().args.get(1).map(int).transpose()?.unwrap_or(0);
    let shape = t.shape().to_vec();
    if shape.len() < 2 {
        return Err(format!(
            "tril/triu of a tensor of shape {shape:?} (needs 2 dimensions)"
        ));
    }
    let keep = |p: &IxDyn| {
        let (i, j) = (p[shape.len() - 2] as i64, p[shape.len() - 1] as i64);
        if lower { j - i <= k } else { j - i >= k }
    };
    fn go<T: Elem>(t: &Tensor, keep: impl Fn(&IxDyn) -> bool) -> Result<Tensor, String> {
        let a = T::get(t);
        let out = ArrayD::from_shape_fn(
            a.raw_dim(),
            |p| if keep(&p) { a[&p] } else { T::elem_zero() },
        );
        T::wrap(out, t.dtype)
    }
    one(match t.kind() {
        Kind::F32 => go::<f32>(t, keep)?,
        Kind::F64 => go::<f64>(t, keep)?,
        Kind::I64 => go::<i64>(t, keep)?,
        Kind::Bool => go::<bool>(t, keep)?,
    })
}

pub fn tril(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    triangle(env, true)
}
pub fn triu(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    triangle(env, false)
}
