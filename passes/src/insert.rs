//! ZeRO-3 insertion: all-gather, wait and release around every real use of each sharded
//! parameter, and a reduce-scatter on every gradient a backward graph returns.
//!
//! The inserted ops start out just-in-time (gather and wait right before the first use, release
//! right after the last); the schedulers move them. Each release names every real use of the
//! gathered storage in its `after` keyword, so that no later reordering can place it too early.

use crate::alias::Aliases;
use crate::ops;
use std::collections::{BTreeMap, BTreeSet};
use zerosched_ir::{Arg, Dtype, Graph, GraphKind, NodeId, Param, Problem, SideTable, Val};

/// What insertion did to one graph.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InsertReport {
    /// Parameters gathered.
    pub gathered: usize,
    /// Of those, gathered in a smaller dtype because a downcast was their only use.
    pub fused_casts: usize,
    /// Parameters whose only consumer is the graph output: their shard is passed through and
    /// nothing is gathered.
    pub output_only: Vec<String>,
    /// Parameters with no consumer at all.
    pub unused: Vec<String>,
    /// Gathered parameters whose full value the graph returns (inference graphs): no release;
    /// the caller owns the buffer.
    pub escaped: Vec<String>,
    /// Gradients given a reduce-scatter.
    pub reduced: usize,
}

/// Inserts the ZeRO-3 ops into `g`. `persistent` names the parameters kept unsharded anywhere
/// in the program (a backward graph need not declare them itself).
pub fn insert(g: &mut Graph, persistent: &BTreeSet<String>) -> Result<InsertReport, Problem> {
    let mut report = InsertReport::default();
    let mut plan = Placement {
        positions: g.positions(),
        ..Placement::default()
    };
    // One analysis serves every parameter: each placeholder is its own storage class, so
    // rewiring one parameter's consumers leaves every other class as it was.
    let aliases = Aliases::analyse(g);
    // Kept unsharded: whatever the program says, and whatever this graph says itself.
    let persistent: BTreeSet<String> = persistent
        .iter()
        .cloned()
        .chain(g.persistent_names().map(str::to_owned))
        .collect();
    let params: Vec<Param> = g
        .params
        .iter()
        .filter(|p| !persistent.contains(&p.name))
        .cloned()
        .collect();
    for p in &params {
        gather_param(g, &aliases, p, &mut plan, &mut report)?;
    }
    if g.kind == GraphKind::Backward {
        reduce_grads(g, &persistent, &mut plan, &mut report)?;
    }
    plan.apply(g)?;
    Ok(report)
}

fn gather_param(
    g: &mut Graph,
    aliases: &Aliases,
    param: &Param,
    plan: &mut Placement,
    report: &mut InsertReport,
) -> Result<(), Problem> {
    let (name, placeholder) = (param.name.as_str(), param.node);
    let output = g.output();
    let cast = fusable_downcast(g, param, output);
    // The storage whose uses the gathered value takes over: the parameter's, or the cast's.
    let replaced = cast.map_or(placeholder, |(c, _)| c);
    let uses = aliases.real_uses(g, replaced);
    let compute_uses: Vec<NodeId> = uses
        .iter()
        .copied()
        .filter(|&u| Some(u) != output)
        .collect();
    let escapes = output.is_some_and(|o| {
        aliases
            .members(replaced)
            .iter()
            .any(|&m| m != placeholder && g.feeds(m, o))
    });
    if compute_uses.is_empty() && !escapes {
        if uses.is_empty() {
            report.unused.push(name.to_owned())
        } else {
            report.output_only.push(name.to_owned())
        }
        return Ok(());
    }

    let consumers: Vec<NodeId> = g
        .users(replaced)
        .into_iter()
        .filter(|&u| cast.is_some() || Some(u) != output)
        .collect();
    let dtype = cast.map(|(_, d)| d);
    let full = full_meta(g, param, dtype);
    let gather = g.add(ops::allgather(g, placeholder, name, dtype))?;
    g.meta_mut(gather).val = Some(full.clone());
    let wait = g.add(ops::wait(g, gather, name))?;
    g.meta_mut(wait).val = Some(full);
    g.meta_mut(wait).aliases = Some(vec![0]);
    for &user in &consumers {
        g.map_refs(user, |r| if r == replaced { wait } else { r })?;
    }
    if let Some((cast_node, _)) = cast {
        plan.removed.push(cast_node);
        report.fused_casts += 1;
    }
    report.gathered += 1;

    // Gather and wait go before the first consumer of any kind (a view of the parameter may
    // stand well before its first real use), the release after the last real use.
    let (Some(first), Some(last)) = (plan.first(&consumers), plan.last(&uses)) else {
        return Ok(());
    };
    plan.before.entry(first).or_default().extend([gather, wait]);
    if escapes {
        report.escaped.push(name.to_owned());
        return Ok(());
    }
    let release = g.add(ops::release(g, wait, name, &compute_uses))?;
    plan.after.entry(last).or_default().push(release);
    Ok(())
}

/// A convert of the parameter to a smaller float dtype that is the parameter's only consumer.
fn fusable_downcast(g: &Graph, param: &Param, output: Option<NodeId>) -> Option<(NodeId, Dtype)> {
    let placeholder = param.node;
    let [user] = g.users(placeholder)[..] else {
        return None;
    };
    let n = g.node(user);
    let target = match n.target.as_str() {
        "prims.convert_element_type.default" => n.args.get(1),
        "aten._to_copy.default" => n.kwargs.get("dtype"),
        _ => None,
    };
    let Some(Arg::Dtype(to)) = target else {
        return None;
    };
    let from = match &g.node(placeholder).meta.val {
        Some(Val::Tensor(t)) => t.dtype,
        _ => param.dtype,
    };
    let returned = output.is_some_and(|o| g.feeds(user, o));
    (to.is_floating() && from.is_floating() && to.size() < from.size() && !returned)
        .then_some((user, *to))
}

/// The gathered tensor's metadata: the parameter's full shape, in `dtype` if cast.
fn full_meta(g: &Graph, p: &Param, dtype: Option<Dtype>) -> Val {
    let mut t = zerosched_ir::TensorMeta::new(p.shape.clone(), dtype.unwrap_or(p.dtype));
    if let Some(Val::Tensor(v)) = &g.node(p.node).meta.val {
        t.device.clone_from(&v.device);
    }
    Val::Tensor(t.into())
}

fn reduce_grads(
    g: &mut Graph,
    persistent: &BTreeSet<String>,
    plan: &mut Placement,
    report: &mut InsertReport,
) -> Result<(), Problem> {
    let Some(output) = g.output() else {
        return Ok(());
    };
    let mut slots: Vec<(usize, NodeId, String)> = Vec::new();
    for gr in &g.grads {
        let slot = gr.output_index as usize;
        if let Some(&v) = g.output_values().get(slot).and_then(Arg::as_node) {
            slots.push((slot, v, gr.param.clone()));
        }
    }
    if slots.is_empty() {
        return Ok(());
    }
    slots.sort_by_key(|s| s.0);
    let mut reduces = Vec::with_capacity(slots.len());
    for (_, grad, param) in &slots {
        let sharded = !persistent.contains(param);
        let r = g.add(ops::reduce_grad(g, *grad, param, sharded))?;
        g.meta_mut(r).val = g.node(*grad).meta.val.clone();
        plan.after.entry(*grad).or_default().push(r);
        reduces.push(r);
    }
    let end = g.add(ops::end_backward(g, &reduces))?;
    g.meta_mut(end).val = Some(Val::Tuple(
        reduces
            .iter()
            .map(|&r| match &g.node(r).meta.val {
                Some(Val::Tensor(t)) => Some(t.clone()),
                _ => None,
            })
            .collect(),
    ));
    g.meta_mut(end).aliases = Some(vec![0]);
    plan.before.entry(output).or_default().push(end);
    let mut values: Vec<Arg<NodeId>> = g.output_values().to_vec();
    for (k, (slot, _, _)) in slots.iter().enumerate() {
        let item = g.add(ops::getitem(g, end, k))?;
        g.meta_mut(item).val = g.node(reduces[k]).meta.val.clone();
        plan.before.entry(output).or_default().push(item);
        if let Some(v) = values.get_mut(*slot) {
            *v = Arg::Node(item);
        }
    }
    let kwargs = g.node(output).kwargs.clone();
    g.set_args(output, vec![Arg::List(values)], kwargs)?;
    report.reduced += slots.len();
    Ok(())
}

/// Where new nodes go in the program order, applied in one rebuild at the end.
#[derive(Default)]
struct Placement {
    before: BTreeMap<NodeId, Vec<NodeId>>,
    after: BTreeMap<NodeId, Vec<NodeId>>,
    removed: Vec<NodeId>,
    /// Positions in the order as it was before insertion: the anchors are all original nodes.
    positions: SideTable<usize>,
}

impl Placement {
    fn pos(&self, id: NodeId) -> usize {
        self.positions.get(id).copied().unwrap_or(usize::MAX)
    }

    fn first(&self, ids: &[NodeId]) -> Option<NodeId> {
        ids.iter().copied().min_by_key(|&u| self.pos(u))
    }

    fn last(&self, ids: &[NodeId]) -> Option<NodeId> {
        ids.iter().copied().max_by_key(|&u| self.pos(u))
    }

    fn apply(self, g: &mut Graph) -> Result<(), Problem> {
        let mut order = Vec::with_capacity(g.len());
        for &id in g.order() {
            order.extend(self.before.get(&id).into_iter().flatten());
            order.push(id);
            order.extend(self.after.get(&id).into_iter().flatten());
        }
        g.set_order(order)?;
        g.remove_all(&self.removed)
    }
}
