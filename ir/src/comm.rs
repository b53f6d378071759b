//! The communication ops that zerosched's passes insert, as they appear in fx-graph v1
//! documents (docs/format.md, "Inserted ops"): their targets, and readers for their keywords.
//! They belong to the format, so every consumer (passes, checker, executors) reads them here.

use crate::{Arg, Dtype, Node, NodeId};

/// `zerosched.allgather.default(shard, *, param, [dtype], [bucket])`: issues the all-gather of
/// a sharded parameter on the communication stream and allocates its full buffer.
pub const ALLGATHER: &str = "zerosched.allgather.default";
/// `zerosched.wait.default(gather)`: the compute stream waits for the gather; the result is the
/// full parameter (it aliases the gather's buffer).
pub const WAIT: &str = "zerosched.wait.default";
/// `zerosched.release.default(value, *, param, after=[uses])`: frees the gathered buffer. `after`
/// names every real use of that storage, so no reordering can move the release before one.
pub const RELEASE: &str = "zerosched.release.default";
/// `zerosched.reduce_grad.default(grad, *, param, sharded)`: reduce-scatters (or, for a
/// persistent parameter, all-reduces) a gradient on the communication stream.
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

/// The `param` keyword of an inserted op: the parameter's fully qualified name.
pub fn param_name(node: &Node) -> Option<&str> {
    match node.kwargs.get("param") {
        Some(Arg::Str(s)) => Some(s),
        _ => None,
    }
}

/// The `bucket` keyword of an all-gather: gathers with the same bucket id are issued together as
/// one coalesced collective.
pub fn bucket(node: &Node) -> Option<i64> {
    node.kwargs.get("bucket").and_then(Arg::as_int)
}

/// The `dtype` keyword of an all-gather: the parameter is cast to it before gathering.
pub fn gather_dtype(node: &Node) -> Option<Dtype> {
    match node.kwargs.get("dtype") {
        Some(Arg::Dtype(d)) => Some(*d),
        _ => None,
    }
}

/// The nodes a release waits for (its `after` keyword).
pub fn release_after(node: &Node) -> Vec<NodeId> {
    let mut out = Vec::new();
    if let Some(a) = node.kwargs.get("after") {
        a.for_each_ref(&mut |r| out.push(*r));
    }
    out
}
