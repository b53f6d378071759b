//! Advanced indexing and scatter: `index.Tensor`, `index_put` (with `accumulate`),
//! `embedding_dense_backward`, `scatter` (a source tensor or a value) and `scatter_add`.
//! The index tensors are broadcast and packed into one `[k, J]` i64 buffer; the indexed
//! tensor is addressed through its strides, its dimensions reordered `[pre, indexed, post]`
//! (torch puts the indexed result first when the indexed dimensions are not adjacent).

use super::{CudaTensor, Env, Value};
use crate::backend::{
    Cuda, broadcast_shape, checked_flag, elem, flag, int, norm_dim, one, out_dtype, tensor,
};
use crate::kernels::index::IndexMode;
use crate::kernels::{Lay, View, contiguous_strides};
use zerosched_ir::{Arg, Dtype};

/// Where the index tensors of an advanced index apply: the reordered dimensions of the
/// indexed tensor and the result's `[P, J, Q]` factors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexPlan {
    /// The indexed tensor's dimensions as `[pre..., indexed..., post...]`.
    pub order: Vec<usize>,
    /// Number of `pre` dimensions.
    pub np: usize,
    /// Number of indexed dimensions.
    pub k: usize,
    /// The broadcast shape of the index tensors.
    pub bshape: Vec<usize>,
    /// The result's shape: `pre` sizes, `bshape`, `post` sizes.
    pub out_shape: Vec<usize>,
}

impl IndexPlan {
    /// `indexed[d]` is whether dimension `d` of a tensor of `shape` has an index tensor (a
    /// list shorter than the rank leaves the rest unindexed).
    pub fn new(shape: &[usize], indexed: &[bool], bshape: Vec<usize>) -> Result<IndexPlan, String> {
        if indexed.len() > shape.len() {
            return Err(format!(
                "{} indices for a {}-d tensor",
                indexed.len(),
                shape.len()
            ));
        }
        let on: Vec<usize> = (0..indexed.len()).filter(|&d| indexed[d]).collect();
        let (first, last) = match (on.first(), on.last()) {
            (Some(&f), Some(&l)) => (f, l),
            _ => return Err("an index without index tensors".into()),
        };
        let adjacent = last - first + 1 == on.len();
        let rest: Vec<usize> = (0..shape.len()).filter(|d| !on.contains(d)).collect();
        let (pre, post): (Vec<usize>, Vec<usize>) = if adjacent {
            rest.iter().partition(|&&d| d < first)
        } else {
            (vec![], rest)
        };
        let mut order = pre.clone();
        order.extend(&on);
        order.extend(&post);
        let mut out_shape: Vec<usize> = pre.iter().map(|&d| shape[d]).collect();
        out_shape.extend(&bshape);
        out_shape.extend(post.iter().map(|&d| shape[d]));
        Ok(IndexPlan {
            order,
            np: pre.len(),
            k: on.len(),
            bshape,
            out_shape,
        })
    }

    /// `[P, J, Q]`.
    fn factors(&self) -> [usize; 3] {
        let nb = self.bshape.len();
        let p: usize = self.out_shape[..self.np].iter().product();
        let j: usize = self.bshape.iter().product();
        let q: usize = self.out_shape[self.np + nb..].iter().product();
        [p, j, q]
    }

    /// The layout of `t` in the plan's dimension order.
    fn lay(&self, t: &CudaTensor) -> Result<Lay, String> {
        let v = View {
            ptr: t.block.ptr,
            elem: t.elem()?,
            shape: self.order.iter().map(|&d| t.shape[d]).collect(),
            strides: self.order.iter().map(|&d| t.strides[d]).collect(),
            offset: t.offset,
        };
        Lay::of(&v, &[&v])
    }
}

/// The index tensors of `list` (`None` entries skip a dimension) broadcast and packed as
/// `[k, J]` i64, with which dimensions they index.
fn pack_indices(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    list: &Arg<zerosched_ir::NodeId>,
) -> Result<(CudaTensor, Vec<bool>, Vec<usize>), String> {
    let Arg::List(items) = list else {
        return Err("indices that are not a list".into());
    };
    let mut idx = vec![];
    let mut indexed = vec![];
    for a in items {
        match a {
            Arg::None => indexed.push(false),
            a => {
                let t = env.tensor(a)?;
                if t.dtype == Dtype::Bool {
                    return Err("boolean-mask indexing is not supported on the GPU".into());
                }
                indexed.push(true);
                idx.push(t);
            }
        }
    }
    let bshape = broadcast_shape(idx.iter().map(|t| t.shape.as_slice()))?;
    let j: usize = bshape.iter().product();
    let packed = c.empty(Dtype::Int64, &[idx.len(), j])?;
    for (m, t) in idx.iter().enumerate() {
        let row = packed.restride(bshape.clone(), contiguous_strides(&bshape), (m * j) as i64);
        if let Err(e) = c.ew_into("copy", &[t], &row, 0.0) {
            c.release(&packed);
            return Err(e);
        }
    }
    Ok((packed, indexed, bshape))
}

/// Runs the index kernel and checks its flag, releasing the packed indices.
#[allow(clippy::too_many_arguments)]
fn run(
    c: &mut Cuda,
    mode: IndexMode,
    plan: &IndexPlan,
    t: &CudaTensor,
    v: &CudaTensor,
    packed: &CudaTensor,
    skip: i64,
    what: &str,
) -> Result<(), String> {
    let [p, j, q] = plan.factors();
    let res = flag(c).and_then(|bad| {
        let r = plan.lay(t).and_then(|lay| {
            c.k.index(
                mode,
                t.elem()?,
                [t.block.ptr, v.block.ptr, packed.block.ptr],
                [p, j, q, plan.np, plan.k],
                &lay,
                plan.order.len(),
                skip,
                bad.block.ptr,
            )
            .map_err(|e| e.to_string())
        });
        match r {
            Ok(()) => checked_flag(c, &bad, what),
            Err(e) => {
                c.release(&bad);
                Err(e)
            }
        }
    });
    c.release(packed);
    res
}

/// `index(x, indices)`.
pub fn index(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let (packed, indexed, bshape) = pack_indices(c, env, env.arg(1)?)?;
    let plan = match IndexPlan::new(&x.shape, &indexed, bshape) {
        Ok(p) => p,
        Err(e) => {
            c.release(&packed);
            return Err(e);
        }
    };
    let out = match c.empty(x.dtype, &plan.out_shape) {
        Ok(o) => o,
        Err(e) => {
            c.release(&packed);
            return Err(e);
        }
    };
    if let Err(e) = run(
        c,
        IndexMode::Gather,
        &plan,
        x,
        &out,
        &packed,
        i64::MIN,
        "index",
    ) {
        c.release(&out);
        return Err(e);
    }
    one(out)
}

/// `values` broadcast to `shape` as a new contiguous tensor of `dt`.
fn broadcast_copy(
    c: &mut Cuda,
    values: &CudaTensor,
    shape: &[usize],
    dt: Dtype,
) -> Result<CudaTensor, String> {
    let out = c.empty(dt, shape)?;
    if let Err(e) = c.ew_into("copy", &[values], &out, 0.0) {
        c.release(&out);
        return Err(e);
    }
    Ok(out)
}

/// `index_put(x, indices, values, accumulate=False)`.
pub fn index_put(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let (x, values) = (tensor(env, 0)?, tensor(env, 2)?);
    let accumulate = matches!(env.arg_or_kw(3, "accumulate"), Some(Arg::Bool(true)));
    let dt = out_dtype(env, x.dtype);
    let (packed, indexed, bshape) = pack_indices(c, env, env.arg(1)?)?;
    let res = IndexPlan::new(&x.shape, &indexed, bshape).and_then(|plan| {
        let v = broadcast_copy(c, values, &plan.out_shape, dt)?;
        let out = match c.ew("copy", &[x], dt, 0.0) {
            Ok(o) => o,
            Err(e) => {
                c.release(&v);
                return Err(e);
            }
        };
        let mode = if accumulate {
            IndexMode::Accumulate
        } else {
            IndexMode::Put
        };
        let r = run(c, mode, &plan, &out, &v, &packed, i64::MIN, "index_put");
        c.release(&v);
        match r {
            Ok(()) => Ok(out),
            Err(e) => {
                c.release(&out);
                Err(e)
            }
        }
    });
    if res.is_err() {
        c.release(&packed);
    }
    one(res?)
}

/// `embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)`:
/// the rows of `grad` summed into `[num_weights, D]` at their indices, the padding index
/// skipped.
pub fn embedding_dense_backward(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
) -> Result<Value<CudaTensor>, String> {
    let (g, idx) = (tensor(env, 0)?, tensor(env, 1)?);
    let rows = usize::try_from(int(env.arg(2)?)?).map_err(|_| "negative num_weights")?;
    let padding = int(env.arg(3)?)?;
    if matches!(
        env.arg_or_kw(4, "scale_grad_by_freq"),
        Some(Arg::Bool(true))
    ) {
        return Err("embedding backward with scale_grad_by_freq is not supported".into());
    }
    let d = *g.shape.last().ok_or("embedding gradient of a 0-d tensor")?;
    let j = idx.numel();
    let dt = out_dtype(env, g.dtype);
    let out = c.full(dt, &[rows, d], 0.0)?;
    let res = (|| {
        let packed = broadcast_copy(c, idx, &idx.shape.clone(), Dtype::Int64)?;
        let v = match broadcast_copy(c, g, &g.shape.clone(), dt) {
            Ok(v) => v,
            Err(e) => {
                c.release(&packed);
                return Err(e);
            }
        };
        let plan = IndexPlan {
            order: vec![0, 1],
            np: 0,
            k: 1,
            bshape: vec![j],
            out_shape: vec![j, d],
        };
        let skip = if padding < 0 { i64::MIN } else { padding };
        let r = run(
            c,
            IndexMode::Accumulate,
            &plan,
            &out,
            &v,
            &packed,
            skip,
            "embedding_dense_backward",
        );
        c.release(&v);
        r
    })();
    if let Err(e) = res {
        c.release(&out);
        return Err(e);
    }
    one(out)
}

/// `scatter(x, dim, index, src | value)` and `scatter_add(x, dim, index, src)`.
pub fn scatter(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    add: bool,
) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let d = norm_dim(int(env.arg(1)?)?, x.shape.len())?;
    let idx = tensor(env, 2)?;
    if env.node().kwargs.get("reduce").is_some() {
        return Err("scatter with a reduce keyword is not supported".into());
    }
    let src_arg = env.arg(3)?;
    let src = match src_arg {
        Arg::Node(_) => Some(env.tensor(src_arg)?),
        _ => None,
    };
    let value = match src {
        Some(_) => 0.0,
        None => {
            crate::backend::number(src_arg).ok_or_else(|| format!("scatter value {src_arg:?}"))?
        }
    };
    let rank = x.shape.len();
    if idx.shape.len() != rank || src.is_some_and(|s| s.shape.len() != rank) {
        return Err(format!(
            "scatter into {:?} with index {:?}",
            x.shape, idx.shape
        ));
    }
    for k in 0..rank {
        let src_short = src.is_some_and(|s| s.shape[k] < idx.shape[k]);
        if (k != d && idx.shape[k] > x.shape[k]) || src_short {
            return Err(format!(
                "scatter index {:?} exceeds the tensor {:?} or source",
                idx.shape, x.shape
            ));
        }
    }
    let dt = out_dtype(env, x.dtype);
    let out = c.ew("copy", &[x], dt, 0.0)?;
    // The source read at the index's coordinates (cast to the output's dtype).
    let src_c = match src {
        Some(s) if s.dtype != dt => Some(c.ew("copy", &[s], dt, 0.0)?),
        _ => None,
    };
    let res = (|| {
        let srcv = src_c.as_ref().or(src);
        let mut lay = Lay::default();
        for k in 0..rank {
            lay.shape[k] = idx.shape[k] as i64;
            lay.ost[k] = out.strides[k];
            lay.st[1][k] = idx.strides[k];
            if let Some(s) = srcv {
                lay.st[2][k] = s.strides[k];
            }
        }
        lay.ooff = out.offset;
        lay.off[1] = idx.offset;
        lay.off[2] = srcv.map_or(0, |s| s.offset);
        let bad = flag(c)?;
        let r =
            c.k.scatter(
                add,
                [elem(dt)?, idx.elem()?],
                [
                    out.block.ptr,
                    idx.block.ptr,
                    srcv.map_or(0, |s| s.block.ptr),
                ],
                idx.numel(),
                rank,
                d,
                x.shape[d],
                &lay,
                value,
                bad.block.ptr,
            )
            .map_err(|e| e.to_string());
        match r {
            Ok(()) => checked_flag(c, &bad, "scatter"),
            Err(e) => {
                c.release(&bad);
                Err(e)
            }
        }
    })();
    if let Some(s) = &src_c {
        c.release(s);
    }
    if let Err(e) = res {
        c.release(&out);
        return Err(e);
    }
    one(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_indices_stay_in_place_and_separated_ones_go_first() {
        // x[:, i, j] of [2, 3, 4, 5] with i, j of [6]: the result is [2, 6, 5].
        let p = IndexPlan::new(&[2, 3, 4, 5], &[false, true, true], vec![6]).unwrap();
        assert_eq!(p.order, vec![0, 1, 2, 3]);
        assert_eq!((p.np, p.k), (1, 2));
        assert_eq!(p.out_shape, vec![2, 6, 5]);
        assert_eq!(p.factors(), [2, 6, 5]);
        // x[i, :, j] of [2, 3, 4] with i, j of [2, 7]: separated, so [2, 7, 3].
        let p = IndexPlan::new(&[2, 3, 4], &[true, false, true], vec![2, 7]).unwrap();
        assert_eq!(p.order, vec![0, 2, 1]);
        assert_eq!((p.np, p.k), (0, 2));
        assert_eq!(p.out_shape, vec![2, 7, 3]);
        assert_eq!(p.factors(), [1, 14, 3]);
        // gemma's cumsum[b, pos] with two broadcast index tensors.
        let p = IndexPlan::new(&[2, 16], &[true, true], vec![2, 1, 16, 1]).unwrap();
        assert_eq!(p.out_shape, vec![2, 1, 16, 1]);
        assert!(IndexPlan::new(&[2], &[false], vec![]).is_err());
        assert!(IndexPlan::new(&[2], &[true, true], vec![1]).is_err());
    }
}
