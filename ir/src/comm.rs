//! The communication ops that zerosched's passes insert, as they appear in fx-graph v1
//! documents (docs/format.md, "Inserted ops"): their targets, and readers for their keywords.
//! They belong to the format, so every consumer (passes, checker, executors) reads them here.

use crate::{Arg, Dtype, Kwargs, Node, NodeId};

/// The keywords of the inserted ops, spelled here only: builders below write them, readers below
/// read them.
pub mod kw {
    pub const PARAM: &str = "param";
    pub const DTYPE: &str = "dtype";
    pub const BUCKET: &str = "bucket";
    pub const AFTER: &str = "after";
    pub const SHARDED: &str = "sharded";
}

/// `zerosched.allgather.default(shard, *, param, [dtype], [bucket])`: issues the all-gather of
/// a sharded parameter on the communication stream and allocates its full buffer.
pub const ALLGATHER: &str = "zerosched.allgather.default";
/// `zerosched.wait.default(gather)`: the compute stream waits for the gather; the result is the
/// full parameter (it aliases the gather's buffer).
pub const WAIT: &str = "zerosched.wait.default";
/// `zerosched.release.default(value, *, param, after=[uses])`: frees the gathered buffer. `after`
/// names every real use of that storage, so no reordering can move the release before one.
pub const RELEASE: &str = "zerosched.release.default";
/// `zerosched.reduce_grad.default(grad, *, param, sharded, [bucket])`: reduce-scatters (or, for
/// a persistent parameter, all-reduces) a gradient on the communication stream.
pub const REDUCE_GRAD: &str = "zerosched.reduce_grad.default";
/// `zerosched.end_backward.default([reduce, ...])`: waits for every reduction; returns their
/// results in order.
pub const END_BACKWARD: &str = "zerosched.end_backward.default";
/// `zerosched.keep.default(value, *, param)`: in a forward graph, in place of a release: the
/// gathered buffer stays resident after the graph, for a later graph's `reuse`.
pub const KEEP: &str = "zerosched.keep.default";
/// `zerosched.reuse.default(shard, *, param)`: in place of a gather, the buffer an earlier
/// graph kept; it is already complete, so it costs no communication.
pub const REUSE: &str = "zerosched.reuse.default";
/// `operator.getitem(value, i)`.
pub const GETITEM: &str = "operator.getitem";

/// Bytes of the full buffer a gather of `numel` elements allocates: the flattened tensor padded
/// to a multiple of the world size (docs/format.md, guarantee 7); `None` on overflow.
pub fn gathered_bytes(numel: u64, dtype: Dtype, world_size: u32) -> Option<u64> {
    let world = u64::from(world_size.max(1));
    numel
        .div_ceil(world)
        .checked_mul(world)?
        .checked_mul(dtype.size())
}

/// Bytes of one rank's shard of a sharded tensor of `numel` elements.
pub fn shard_bytes(numel: u64, dtype: Dtype, world_size: u32) -> Option<u64> {
    numel
        .div_ceil(u64::from(world_size.max(1)))
        .checked_mul(dtype.size())
}

/// What kind of inserted op a node is, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommOp {
    AllGather,
    Wait,
    Release,
    ReduceGrad,
    EndBackward,
    Keep,
    Reuse,
}

impl CommOp {
    pub fn of(node: &Node) -> Option<CommOp> {
        // Most nodes are aten ops: one prefix test turns them away before any full compare.
        if node.op != crate::Op::CallFunction || !node.target.starts_with("zerosched.") {
            return None;
        }
        Some(match node.target.as_str() {
            ALLGATHER => CommOp::AllGather,
            WAIT => CommOp::Wait,
            RELEASE => CommOp::Release,
            REDUCE_GRAD => CommOp::ReduceGrad,
            END_BACKWARD => CommOp::EndBackward,
            KEEP => CommOp::Keep,
            REUSE => CommOp::Reuse,
            _ => return None,
        })
    }
}

/// An inserted op as one typed value: its kind and its keywords, read once. For consumers that
/// want everything an op says (a listing, an executor, a checker); one keyword alone has its
/// reader below.
#[derive(Clone, Debug, PartialEq)]
pub enum Inserted<'a> {
    AllGather {
        param: Option<&'a str>,
        /// Cast to this dtype before gathering.
        dtype: Option<Dtype>,
        /// Issued together with the gathers of the same bucket.
        bucket: Option<i64>,
    },
    Wait {
        param: Option<&'a str>,
    },
    Release {
        param: Option<&'a str>,
        /// Every real use of the storage; the release follows them all.
        after: Vec<NodeId>,
    },
    ReduceGrad {
        param: Option<&'a str>,
        /// Reduce-scattered; `false` for a persistent parameter's gradient (all-reduced).
        sharded: bool,
        /// Issued together with the reductions of the same bucket.
        bucket: Option<i64>,
    },
    EndBackward,
    Keep {
        param: Option<&'a str>,
    },
    Reuse {
        param: Option<&'a str>,
    },
}

impl<'a> Inserted<'a> {
    pub fn of(node: &'a Node) -> Option<Inserted<'a>> {
        let param = param_name(node);
        Some(match CommOp::of(node)? {
            CommOp::AllGather => Inserted::AllGather {
                param,
                dtype: gather_dtype(node),
                bucket: bucket(node),
            },
            CommOp::Wait => Inserted::Wait { param },
            CommOp::Release => Inserted::Release {
                param,
                after: release_after(node),
            },
            CommOp::ReduceGrad => Inserted::ReduceGrad {
                param,
                sharded: reduce_sharded(node),
                bucket: bucket(node),
            },
            CommOp::EndBackward => Inserted::EndBackward,
            CommOp::Keep => Inserted::Keep { param },
            CommOp::Reuse => Inserted::Reuse { param },
        })
    }

    pub fn op(&self) -> CommOp {
        match self {
            Inserted::AllGather { .. } => CommOp::AllGather,
            Inserted::Wait { .. } => CommOp::Wait,
            Inserted::Release { .. } => CommOp::Release,
            Inserted::ReduceGrad { .. } => CommOp::ReduceGrad,
            Inserted::EndBackward => CommOp::EndBackward,
            Inserted::Keep { .. } => CommOp::Keep,
            Inserted::Reuse { .. } => CommOp::Reuse,
        }
    }

    /// The parameter the op is about (`None` for `end_backward`, or a document without one).
    pub fn param(&self) -> Option<&'a str> {
        match self {
            Inserted::AllGather { param, .. }
            | Inserted::Wait { param }
            | Inserted::Release { param, .. }
            | Inserted::ReduceGrad { param, .. }
            | Inserted::Keep { param }
            | Inserted::Reuse { param } => *param,
            Inserted::EndBackward => None,
        }
    }
}

/// The `param` keyword of an inserted op: the parameter's fully qualified name.
pub fn param_name(node: &Node) -> Option<&str> {
    match node.kwargs.get(kw::PARAM) {
        Some(Arg::Str(s)) => Some(s),
        _ => None,
    }
}

/// The `bucket` keyword of an all-gather or a gradient reduction: adjacent ops of one kind with
/// the same bucket id are issued together as one coalesced collective. Gathers and reductions
/// number their buckets apart: a gather and a reduction never share one, whatever their ids.
pub fn bucket(node: &Node) -> Option<i64> {
    node.kwargs.get(kw::BUCKET).and_then(Arg::as_int)
}

/// The `dtype` keyword of an all-gather: the parameter is cast to it before gathering.
pub fn gather_dtype(node: &Node) -> Option<Dtype> {
    match node.kwargs.get(kw::DTYPE) {
        Some(Arg::Dtype(d)) => Some(*d),
        _ => None,
    }
}

/// What the members of one bucket must agree on: the dtype each is cast to before gathering
/// (its `dtype` keyword) and the dtype of the gathered value (its `meta.val`). A coalesced
/// collective moves one flat buffer of one dtype.
pub fn bucket_dtypes(node: &Node) -> (Option<Dtype>, Option<Dtype>) {
    let gathered = match &node.meta.val {
        Some(crate::Val::Tensor(v)) => Some(v.dtype),
        _ => None,
    };
    (gather_dtype(node), gathered)
}

/// What the members of one bucket of reductions must agree on: the collective (reduce-scatter
/// when `true`, all-reduce for persistent parameters) and the gradient's dtype (its
/// `meta.val`). One coalesced collective is one kind of collective over one flat buffer.
pub fn reduce_bucket_kind(node: &Node) -> (bool, Option<Dtype>) {
    let dtype = match &node.meta.val {
        Some(crate::Val::Tensor(v)) => Some(v.dtype),
        _ => None,
    };
    (reduce_sharded(node), dtype)
}

/// The nodes a release waits for (its `after` keyword).
pub fn release_after(node: &Node) -> Vec<NodeId> {
    let mut out = Vec::new();
    if let Some(a) = node.kwargs.get(kw::AFTER) {
        a.for_each_ref(&mut |r| out.push(*r));
    }
    out
}

/// The `sharded` keyword of a gradient reduction: a reduce-scatter unless it says `false` (a
/// persistent parameter's gradient, all-reduced).
pub fn reduce_sharded(node: &Node) -> bool {
    !matches!(node.kwargs.get(kw::SHARDED), Some(Arg::Bool(false)))
}

/// The keywords of an all-gather: its parameter and, where it is cast first, the dtype.
pub fn gather_kwargs(param: &str, dtype: Option<Dtype>) -> Kwargs {
    let mut kwargs = param_kwargs(param);
    if let Some(d) = dtype {
        kwargs.insert(kw::DTYPE, Arg::Dtype(d));
    }
    kwargs
}

/// The keywords of a wait, keep or reuse: the parameter alone.
pub fn param_kwargs(param: &str) -> Kwargs {
    let mut kwargs = Kwargs::new();
    kwargs.insert(kw::PARAM, Arg::Str(param.to_owned()));
    kwargs
}

/// A release's keywords: the parameter and the uses it must follow.
pub fn release_kwargs(param: &str, after: &[NodeId]) -> Kwargs {
    let mut kwargs = param_kwargs(param);
    let after = Arg::List(after.iter().map(|&u| Arg::Node(u)).collect());
    kwargs.insert(kw::AFTER, after);
    kwargs
}

/// A gradient reduction's keywords: the parameter, and whether it is sharded.
pub fn reduce_kwargs(param: &str, sharded: bool) -> Kwargs {
    let mut kwargs = param_kwargs(param);
    kwargs.insert(kw::SHARDED, Arg::Bool(sharded));
    kwargs
}

/// Puts an all-gather or a reduction into bucket `id` (the members of one bucket are issued as
/// one collective).
pub fn set_bucket(kwargs: &mut Kwargs, id: i64) {
    kwargs.insert(kw::BUCKET, Arg::Int(id));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a builder writes, the view reads back; absent keywords read as their defaults.
    #[test]
    fn the_view_reads_what_the_builders_write() {
        let mut gather = Node::call("g", ALLGATHER, vec![]);
        gather.kwargs = gather_kwargs("w", Some(Dtype::BFloat16));
        set_bucket(&mut gather.kwargs, 3);
        assert_eq!(
            Inserted::of(&gather),
            Some(Inserted::AllGather {
                param: Some("w"),
                dtype: Some(Dtype::BFloat16),
                bucket: Some(3),
            })
        );
        let mut reduce = Node::call("r", REDUCE_GRAD, vec![]);
        reduce.kwargs = reduce_kwargs("w", false);
        set_bucket(&mut reduce.kwargs, 1);
        let view = Inserted::of(&reduce).expect("an inserted op");
        assert_eq!((view.op(), view.param()), (CommOp::ReduceGrad, Some("w")));
        assert_eq!(
            view,
            Inserted::ReduceGrad {
                param: Some("w"),
                sharded: false,
                bucket: Some(1),
            }
        );
        let bare = Node::call("r", REDUCE_GRAD, vec![]);
        assert_eq!(
            Inserted::of(&bare),
            Some(Inserted::ReduceGrad {
                param: None,
                sharded: true,
                bucket: None,
            })
        );
        assert_eq!(
            Inserted::of(&Node::call("m", "aten.mm.default", vec![])),
            None
        );
    }
}
