//! Guarantee 6: in a backward graph every gradient slot is reduced exactly once, after its
//! producer, and `end_backward` follows every reduction and precedes the output. And guarantee
//! 4 for reductions: a bucket of them is contiguous, of one collective and one dtype.

use super::{Ctx, Violation};
use std::collections::{BTreeMap, BTreeSet};
use zerosched_ir::comm::{self, CommOp};
use zerosched_ir::{Arg, Dtype, Graph, GraphKind, NodeId, SideTable};

/// What the gradient checks found: the number of reductions and of distinct bucket ids among them.
pub(super) struct Reductions {
    pub count: usize,
    pub buckets: usize,
}

pub(super) fn check(cx: &mut Ctx) -> Reductions {
    let g = cx.g;
    let reduces: Vec<NodeId> = g
        .nodes()
        .filter(|(_, n)| CommOp::of(n) == Some(CommOp::ReduceGrad))
        .map(|(id, _)| id)
        .collect();
    let counted = Reductions {
        count: reduces.len(),
        buckets: buckets(cx, &reduces),
    };
    if g.kind != GraphKind::Backward {
        return counted;
    }
    let slotted: BTreeSet<&str> = g.grads.iter().map(|gr| gr.param.as_str()).collect();
    let mut first: BTreeMap<&str, NodeId> = BTreeMap::new();
    for &r in &reduces {
        let n = g.node(r);
        let param = comm::param_name(n).unwrap_or_default();
        match first.get(param) {
            Some(&f) => {
                let violation = Violation::DuplicateReduction {
                    param: param.to_owned(),
                    first: cx.name(f),
                };
                cx.at(r, violation);
            }
            None => {
                first.insert(param, r);
            }
        }
        if !slotted.contains(param) {
            let param = param.to_owned();
            cx.at(r, Violation::StrayReduction { param });
        }
        let producer = n.args.first().and_then(Arg::as_node).copied();
        if let Some(p) = producer.filter(|&p| cx.pos(r) < cx.pos(p)) {
            let producer = cx.name(p);
            cx.at_field(r, "args[0]", Violation::ReduceBeforeProducer { producer });
        }
    }

    let output = g.output();
    let mut awaited = SideTable::new(g, false);
    for (id, n) in g.nodes() {
        if CommOp::of(n) != Some(CommOp::EndBackward) {
            continue;
        }
        let mut listed = Vec::new();
        if let Some(a) = n.args.first() {
            a.for_each_ref(&mut |&r| listed.push(r));
        }
        for r in listed {
            awaited[r] = true;
            if cx.pos(r) > cx.pos(id) {
                let reduce = cx.name(r);
                cx.at(id, Violation::EndBackwardBeforeReduce { reduce });
            }
        }
        if output.is_some_and(|o| cx.pos(id) > cx.pos(o)) {
            cx.at(id, Violation::EndBackwardAfterOutput);
        }
    }
    for &r in &reduces {
        if !awaited[r] {
            let param = comm::param_name(g.node(r)).unwrap_or_default().to_owned();
            cx.at(r, Violation::ReduceNotAwaited { param });
        }
    }

    if let Some(o) = output {
        let values = g.output_values();
        for gr in &g.grads {
            let slot = gr.output_index;
            let ok = match values.get(slot as usize) {
                Some(Arg::Node(v)) => reduced_in(g, *v, &gr.param),
                // A gradient that is not a tensor (`None`) has nothing to reduce.
                Some(_) => true,
                None => false,
            };
            if !ok {
                let violation = Violation::GradNotReduced {
                    param: gr.param.clone(),
                    slot,
                };
                cx.at_field(o, format!("args[0][{slot}]"), violation);
            }
        }
    }
    counted
}

/// Guarantee 4 for the reductions `reduces` (in program order); returns the number of distinct
/// bucket ids.
fn buckets(cx: &mut Ctx, reduces: &[NodeId]) -> usize {
    let mut members: BTreeMap<i64, Vec<NodeId>> = BTreeMap::new();
    for &r in reduces {
        if let Some(b) = comm::bucket(cx.g.node(r)) {
            members.entry(b).or_default().push(r);
        }
    }
    super::buckets::check(
        cx,
        &members,
        comm::reduce_bucket_kind,
        |bucket, first, expected, found| Violation::BucketMixedReduction {
            bucket,
            first,
            expected: describe(expected),
            found: describe(found),
        },
    )
}

/// `a reduce-scatter of bfloat16`, for a bucket's violation.
fn describe((sharded, dtype): (bool, Option<Dtype>)) -> String {
    let kind = if sharded {
        "a reduce-scatter"
    } else {
        "an all-reduce"
    };
    format!(
        "{kind} of {}",
        dtype.map_or("an unknown dtype", Dtype::name)
    )
}

/// Whether `v` is `getitem(end_backward([..]), k)` whose `k`-th entry reduces `param`.
fn reduced_in(g: &Graph, v: NodeId, param: &str) -> bool {
    let item = g.node(v);
    if !item.is_call(comm::GETITEM) {
        return false;
    }
    let end = item.args.first().and_then(Arg::as_node).map(|&e| g.node(e));
    let k = item.args.get(1).and_then(Arg::as_int);
    let (Some(end), Some(k)) = (end, k.and_then(|k| usize::try_from(k).ok())) else {
        return false;
    };
    if CommOp::of(end) != Some(CommOp::EndBackward) {
        return false;
    }
    let reduce = end
        .args
        .first()
        .and_then(Arg::as_list)
        .and_then(|l| l.get(k))
        .and_then(Arg::as_node)
        .map(|&r| g.node(r));
    reduce.is_some_and(|r| {
        CommOp::of(r) == Some(CommOp::ReduceGrad) && comm::param_name(r) == Some(param)
    })
}
