//! Guarantee 7: replayed in program order, gathered bytes stay within the budget. A kept
//! buffer stays counted to the end of its graph; a reused one counts from the start of its
//! graph to its release. Under a device-memory budget, everything live, as simulated, stays
//! within it too.

use super::gathers::Gathers;
use super::{CheckOptions, Ctx, Violation};
use zerosched_ir::comm::{self, CommOp};
use zerosched_ir::{NodeId, Val};

/// Returns the peak gathered bytes; reports the first gather that takes them over budget.
pub(super) fn check(cx: &mut Ctx, gathers: &Gathers, opts: &CheckOptions) -> u64 {
    let g = cx.g;
    let bytes: Vec<u64> = gathers
        .list
        .iter()
        .map(|x| padded_bytes(cx, x.node, opts.world_size))
        .collect();
    let mut at = vec![usize::MAX; g.node_bound()];
    for (i, x) in gathers.list.iter().enumerate() {
        at[x.node.index()] = i;
    }
    // A reused buffer was kept by an earlier graph: resident from this graph's start.
    let mut live_set: Vec<bool> = gathers.list.iter().map(|x| x.reuse).collect();
    let mut live = (0..bytes.len())
        .filter(|&i| live_set[i])
        .fold(0u64, |acc, i| acc.saturating_add(bytes[i]));
    let mut peak = live;
    let first_reuse = gathers.list.iter().find(|x| x.reuse).map(|x| x.node);
    let mut over = first_reuse
        .filter(|_| live > opts.budget)
        .map(|id| (id, live));
    for (id, n) in g.nodes() {
        match CommOp::of(n) {
            Some(CommOp::AllGather) => {
                let i = at[id.index()];
                live_set[i] = true;
                live = live.saturating_add(bytes[i]);
                peak = peak.max(live);
                if live > opts.budget && over.is_none() {
                    over = Some((id, live));
                }
            }
            // Only a release of a live buffer frees it: a double release (reported elsewhere)
            // must not make the replay look cheaper than it is. A keep frees nothing.
            Some(CommOp::Release) => {
                if let Some(i) = gathers.frees[id].filter(|&i| live_set[i]) {
                    live_set[i] = false;
                    live = live.saturating_sub(bytes[i]);
                }
            }
            _ => {}
        }
    }
    if let Some((id, live)) = over {
        let budget = opts.budget;
        cx.at(id, Violation::OverBudget { live, budget });
    }
    peak
}

/// Reports a simulated peak of live bytes over the device-memory budget, at the graph.
pub(super) fn check_device(cx: &mut Ctx, opts: &CheckOptions) {
    if opts.memory == u64::MAX {
        return;
    }
    let sim = crate::simulate::SimOptions {
        world_size: opts.world_size,
        cost: opts.cost.clone(),
    };
    let peak = crate::simulate::simulate_graph(cx.g, &sim)
        .summary
        .peak_total_bytes;
    if peak > opts.memory {
        let memory = opts.memory;
        cx.at_graph(Violation::OverMemory { peak, memory });
    }
}

/// `ceil(numel / world) * world * element_size`, in the gather's `dtype` or the parameter's;
/// from the gather's own `meta.val` when its argument is no parameter. Saturates on overflow.
fn padded_bytes(cx: &Ctx, gather: NodeId, world_size: u32) -> u64 {
    let n = cx.g.node(gather);
    let param = n
        .args
        .first()
        .and_then(|a| a.as_node())
        .and_then(|&v| cx.param_at[v])
        .map(|i| &cx.g.params[i]);
    let (numel, dtype) = match (param, &n.meta.val) {
        (Some(p), _) => (p.numel(), p.dtype),
        (None, Some(Val::Tensor(t))) => (t.numel(), t.dtype),
        (None, _) => return 0,
    };
    let dtype = comm::gather_dtype(n).unwrap_or(dtype);
    numel
        .and_then(|e| comm::gathered_bytes(e, dtype, world_size))
        .unwrap_or(u64::MAX)
}
