//! Logical ops on truth values (any nonzero element is true): `logical_not`, `any` over
//! dimensions or the whole tensor.

use super::{Env, Value, flag, int, norm_dim, one, out_dtype};
use ndarray::Axis;
use zerosched_exec::host::{Elem, Tensor};
use zerosched_ir::{Arg, Dtype};

pub fn logical_not(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    one(bool::wrap(
        bool::get(t).mapv(|x| !x),
        out_dtype(env, Dtype::Bool),
    )?)
}

/// `any.dim(x, dim, keepdim)`, `any.dims(x, dims, keepdim)`, `any.default(x)`.
pub fn any(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let t = env.tensor(env.arg(0)?)?;
    let rank = t.shape().len();
    let mut dims: Vec<usize> = match env.node().args.get(1) {
        None | Some(Arg::None) => (0..rank).collect(),
        Some(Arg::List(l)) if l.is_empty() => (0..rank).collect(),
        Some(Arg::List(l)) => l
            .iter()
            .map(|a| norm_dim(int(a)?, rank))
            .collect::<Result<_, _>>()?,
        Some(a) => vec![norm_dim(int(a)?, rank)?],
    };
    if rank == 0 {
        // A 0-d tensor has no dimension to reduce (torch accepts dim 0 and -1 for it).
        dims.clear();
    }
    dims.sort_unstable();
    dims.dedup();
    let keep = flag(env.arg_or_kw(2, "keepdim"), false);
    let mut a = bool::get(t).into_owned();
    for &d in dims.iter().rev() {
        a = a.map_axis(Axis(d), |lane| lane.iter().any(|&x| x));
        if keep {
            a = a.insert_axis(Axis(d));
        }
    }
    one(bool::wrap(a, out_dtype(env, Dtype::Bool))?)
}
