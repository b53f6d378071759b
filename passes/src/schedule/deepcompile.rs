//! DeepSpeed DeepCompile's ZeRO-3 list scheduler (`fast_free_schedule` in
//! `deepspeed/compile/list_schedule.py`), re-implemented so that its order can be compared
//! with zerosched's own schedulers on the same graph.
//!
//! The algorithm: placeholders first; then, until every all-gather is chosen, take the tier of
//! gathers with the fewest gathers on the path to their last use, and for each compute what
//! must run before it (`until_ag`), what more must run to reach its last use and what more to
//! reach its releases (`until_free`). A gather whose path to its last use needs no other gather
//! is preferred, and then everything up to its release is scheduled; otherwise the gather
//! needing the fewest extra gathered bytes is scheduled alone. After each choice the gradient
//! reductions and output values whose gathers are all chosen are scheduled; whatever is left
//! follows in the original order. The memory budget plays no part, as in DeepCompile.
//!
//! The bookkeeping (a scheduled list turned into a set for every requirement walk, removal
//! from an unscheduled list) is kept as DeepCompile has it: this scheduler is the baseline whose
//! cost in time is measured, not only its order.
//!
//! Where it departs from the Python, on purpose:
//! - Requirement walks follow keyword arguments as well as positional ones (DeepCompile's
//!   `map_arg(node.args)` misses an `attn_mask=` parameter and schedules its consumer before
//!   the gather), and a release's `after` list is among them, so the order stays topological.
//! - A wait is scheduled directly after its gather (in DeepCompile's graphs the wait follows
//!   the gather; a requirement walk here emits the pair together).
//! - The walks are iterative, not recursive, so deep graphs cannot overflow the stack.
//! - A release does not count as a use of the value it frees when last uses are computed: in
//!   DeepCompile a release references only the use it follows, which here is its `after` list.
//! - Ties, impossible in DeepCompile's keys because node names are unique, also break on node
//!   index; inconsistencies that DeepCompile asserts on are errors.

use super::{ScheduleError, ScheduleOptions, ScheduleReport, Scheduler};
use crate::alias::Aliases;
use crate::ops::{self, CommOp};
use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use zerosched_ir::{Arg, Graph, Node, NodeId, Op, Problem, SideTable};

/// DeepCompile's `fast_free_schedule`.
pub struct DeepCompile;

impl Scheduler for DeepCompile {
    fn name(&self) -> &'static str {
        "deepcompile"
    }

    fn schedule(
        &self,
        g: &mut Graph,
        opts: &ScheduleOptions,
    ) -> Result<ScheduleReport, ScheduleError> {
        let label = g.label().to_owned();
        let bad = |problem| ScheduleError::Graph {
            graph: label.clone(),
            problem,
        };
        let ctx = Ctx::new(g, opts);
        let order = ctx.fast_free_schedule().map_err(bad)?;
        let report = ctx.report(&order);
        g.set_order(order).map_err(bad)?;
        Ok(report)
    }
}

/// Facts about the graph in its original (post-insertion) order, computed once.
struct Ctx<'a> {
    g: &'a Graph,
    /// Distinct producers of each node, positional arguments first, then keywords.
    deps: SideTable<Vec<NodeId>>,
    gather: SideTable<bool>,
    /// The wait on each gather.
    wait_of: SideTable<Option<NodeId>>,
    /// DeepCompile's `device_time`.
    device_time: SideTable<f64>,
    /// DeepCompile's `tensor_size`, which it reads only on gathers; here also on reuses.
    tensor_size: SideTable<u64>,
    /// DeepCompile's `node_to_last_use`.
    last_use: SideTable<Option<NodeId>>,
}

/// DeepCompile's `AllgatherTask`, less the fields its choice never reads.
struct Task {
    node: NodeId,
    free_cost: f64,
    allgather_acc_mem: u64,
    free_acc_mem: u64,
    n_scheduled_ags: usize,
    until_ag: Vec<NodeId>,
    until_free: Vec<NodeId>,
}

impl<'a> Ctx<'a> {
    fn new(g: &'a Graph, opts: &ScheduleOptions) -> Ctx<'a> {
        let mut ctx = Ctx {
            g,
            deps: SideTable::new(g, Vec::new()),
            gather: SideTable::new(g, false),
            wait_of: SideTable::new(g, None),
            device_time: opts.cost.compute_costs(g),
            tensor_size: SideTable::new(g, 0),
            last_use: SideTable::new(g, None),
        };
        for (id, n) in g.nodes() {
            ctx.deps[id] = g.inputs(id);
            match CommOp::of(n) {
                // A reuse of a buffer an earlier graph kept is no gather to schedule, but its
                // size counts toward the peak. A size DeepCompile's profiler did not record
                // counts as 0.
                Some(op @ (CommOp::AllGather | CommOp::Reuse)) => {
                    ctx.gather[id] = op == CommOp::AllGather;
                    ctx.tensor_size[id] = ops::gathered_bytes(g, id, opts.world_size).unwrap_or(0);
                }
                // Only a wait on nothing but its gather can ride with it and keep the order
                // topological.
                Some(CommOp::Wait) => {
                    if let [gather] = ctx.deps[id][..] {
                        ctx.wait_of[gather] = Some(id);
                    }
                }
                _ => {}
            }
        }
        ctx.last_use = last_uses(g);
        ctx
    }

    /// DeepCompile's `get_node_requirements`: the unscheduled nodes `target` needs, itself
    /// last, in depth-first post-order over arguments left to right. `done` is the scheduled
    /// list (in pieces), made into a set on every call as DeepCompile does.
    fn requirements(&self, target: NodeId, done: &[&[NodeId]]) -> Vec<NodeId> {
        let mut skip = SideTable::new(self.g, false);
        for &id in done.iter().copied().flatten() {
            skip[id] = true;
        }
        let mut out = Vec::new();
        // Frames of (node, next argument to visit); a node is marked when first pushed.
        let mut stack: Vec<(NodeId, usize)> = Vec::new();
        if !skip[target] {
            skip[target] = true;
            stack.push((target, 0));
        }
        while let Some(top) = stack.last_mut() {
            let (id, next) = *top;
            if let Some(&arg) = self.deps[id].get(next) {
                top.1 += 1;
                if !skip[arg] {
                    skip[arg] = true;
                    stack.push((arg, 0));
                }
                continue;
            }
            stack.pop();
            out.push(id);
            // The wait rides with its gather. If the wait is not marked yet it is not on the
            // stack; if it is on the stack, its gather is its only argument and it comes next.
            if let Some(wait) = self.wait_of[id].filter(|&w| !skip[w]) {
                skip[wait] = true;
                out.push(wait);
            }
        }
        out
    }

    fn gathers_in(&self, nodes: &[NodeId]) -> BTreeSet<NodeId> {
        nodes.iter().copied().filter(|&n| self.gather[n]).collect()
    }

    fn fast_free_schedule(&self) -> Result<Vec<NodeId>, Problem> {
        let g = self.g;
        let original = g.order();
        let (mut scheduled, mut unscheduled): (Vec<NodeId>, Vec<NodeId>) = original
            .iter()
            .copied()
            .partition(|&id| g.node(id).op == Op::Placeholder);
        let mut unscheduled_ags: Vec<NodeId> = unscheduled
            .iter()
            .copied()
            .filter(|&n| self.gather[n])
            .collect();
        // DeepCompile keys releases by the parameter's ds_id; the parameter's name here.
        let mut release_nodes: BTreeMap<&str, Vec<NodeId>> = BTreeMap::new();
        for &n in &unscheduled {
            let node = g.node(n);
            if CommOp::of(node) == Some(CommOp::Release) {
                if let Some(param) = ops::param_name(node) {
                    release_nodes.entry(param).or_default().push(n);
                }
            }
        }
        let release_of = |ag: NodeId| {
            ops::param_name(g.node(ag))
                .and_then(|p| release_nodes.get(p))
                .map_or(&[][..], Vec::as_slice)
        };
        // A gather nothing reads (not something insertion makes) is its own last use.
        let last_use_of = |ag: NodeId| self.last_use[ag].unwrap_or(ag);

        let mut ags_in_path = SideTable::new(g, BTreeSet::new());
        for &ag in &unscheduled_ags {
            ags_in_path[ag] = self.gathers_in(&self.requirements(last_use_of(ag), &[&scheduled]));
        }
        let reduce_nodes: Vec<NodeId> = unscheduled
            .iter()
            .copied()
            .filter(|&n| CommOp::of(g.node(n)) == Some(CommOp::ReduceGrad))
            .collect();
        let mut ags_to_reduce: Vec<BTreeSet<NodeId>> = reduce_nodes
            .iter()
            .map(|&r| self.gathers_in(&self.requirements(r, &[&scheduled])))
            .collect();
        let mut output_nodes: Vec<NodeId> = Vec::new();
        for v in g.output_values().iter().filter_map(Arg::as_node) {
            if CommOp::of(g.node(*v)) != Some(CommOp::ReduceGrad) && !output_nodes.contains(v) {
                output_nodes.push(*v);
            }
        }
        let mut ags_to_output: Vec<BTreeSet<NodeId>> = output_nodes
            .iter()
            .map(|&o| self.gathers_in(&self.requirements(o, &[&scheduled])))
            .collect();

        while !unscheduled_ags.is_empty() {
            let counts: BTreeSet<usize> = unscheduled_ags
                .iter()
                .map(|&ag| ags_in_path[ag].len())
                .collect();
            let mut runnable: Vec<Task> = Vec::new();
            for &count in &counts {
                for &ag in unscheduled_ags
                    .iter()
                    .filter(|&&ag| ags_in_path[ag].len() == count)
                {
                    runnable.push(self.task(ag, last_use_of(ag), release_of(ag), &scheduled));
                }
                if !runnable.is_empty() {
                    break;
                }
            }
            // Prefer a gather whose last use needs no other gather: then schedule through its
            // release, so its memory is held for the shortest time.
            let free_path = runnable
                .iter()
                .filter(|t| t.free_acc_mem == 0)
                .min_by(|a, b| self.free_path_key(a, b));
            let (next, nodes) = match free_path {
                Some(t) => (t.node, &t.until_free),
                None => {
                    let t = runnable
                        .iter()
                        .min_by(|a, b| self.fallback_key(a, b))
                        .ok_or(Problem::BadOrder)?;
                    (t.node, &t.until_ag)
                }
            };
            tracing::debug!(
                gather = %g.node(next).name,
                free_path = free_path.is_some(),
                nodes = nodes.len(),
                "gather chosen: through its release if its path needs no other gather, alone otherwise"
            );
            for &n in nodes {
                take(&mut scheduled, &mut unscheduled, n)?;
            }
            unscheduled_ags.retain(|&ag| ag != next);
            for &ag in &unscheduled_ags {
                ags_in_path[ag].remove(&next);
            }
            // Reductions, then output values, as soon as the gathers they need are chosen.
            for (sinks, paths) in [
                (&reduce_nodes, &mut ags_to_reduce),
                (&output_nodes, &mut ags_to_output),
            ] {
                let mut ready = Vec::new();
                for (&sink, path) in sinks.iter().zip(paths.iter_mut()) {
                    if path.remove(&next) && path.is_empty() {
                        ready.push(sink);
                    }
                }
                for sink in ready {
                    for n in self.requirements(sink, &[&scheduled]) {
                        take(&mut scheduled, &mut unscheduled, n)?;
                    }
                }
            }
        }

        let mut placed = SideTable::new(g, false);
        for &n in &scheduled {
            placed[n] = true;
        }
        for &n in original {
            if !placed[n] {
                take(&mut scheduled, &mut unscheduled, n)?;
            }
        }
        if unscheduled.is_empty() {
            Ok(scheduled)
        } else {
            Err(Problem::BadOrder)
        }
    }

    /// Evaluates one candidate gather against the current schedule.
    fn task(
        &self,
        ag: NodeId,
        last_use: NodeId,
        releases: &[NodeId],
        scheduled: &[NodeId],
    ) -> Task {
        let until_ag = self.requirements(ag, &[scheduled]);
        let diff = self.requirements(last_use, &[scheduled, &until_ag]);
        let free_cost = diff.iter().map(|&n| self.device_time[n]).sum();
        let gathered = |nodes: &[NodeId]| -> u64 {
            nodes
                .iter()
                .filter(|&&n| self.gather[n])
                .map(|&n| self.tensor_size[n])
                .fold(0, u64::saturating_add)
        };
        let allgather_acc_mem = gathered(&until_ag);
        let free_acc_mem = gathered(&diff);
        let mut until_free = until_ag.clone();
        until_free.extend(diff);
        for &release in releases {
            for dep in self.requirements(release, &[scheduled, &until_free]) {
                if !until_free.contains(&dep) {
                    until_free.push(dep);
                }
            }
        }
        let n_scheduled_ags = until_free.iter().filter(|&&n| self.gather[n]).count();
        Task {
            node: ag,
            free_cost,
            allgather_acc_mem,
            free_acc_mem,
            n_scheduled_ags,
            until_ag,
            until_free,
        }
    }

    fn by_name(&self, a: &Task, b: &Task) -> Ordering {
        let name = |t: &Task| self.g.node(t.node).name.as_str();
        name(a).cmp(name(b)).then(a.node.cmp(&b.node))
    }

    /// `(n_scheduled_ags, allgather_acc_mem, free_cost, name)`.
    fn free_path_key(&self, a: &Task, b: &Task) -> Ordering {
        a.n_scheduled_ags
            .cmp(&b.n_scheduled_ags)
            .then(a.allgather_acc_mem.cmp(&b.allgather_acc_mem))
            .then(a.free_cost.total_cmp(&b.free_cost))
            .then_with(|| self.by_name(a, b))
    }

    /// `(free_acc_mem, n_scheduled_ags, allgather_acc_mem, free_cost, name)`.
    fn fallback_key(&self, a: &Task, b: &Task) -> Ordering {
        a.free_acc_mem
            .cmp(&b.free_acc_mem)
            .then_with(|| self.free_path_key(a, b))
    }

    /// Gathers (and reuses), releases and reductions counted, and the peak of gathered bytes
    /// replayed in `order`: a gather allocates, a reused buffer is resident from the start, the
    /// release of either frees it (a keep does not).
    fn report(&self, order: &[NodeId]) -> ScheduleReport {
        let g = self.g;
        let aliases = Aliases::analyse(g);
        let mut r = ScheduleReport::default();
        let resident = order
            .iter()
            .filter(|&&id| CommOp::of(g.node(id)) == Some(CommOp::Reuse))
            .map(|&id| self.tensor_size[id])
            .fold(0, u64::saturating_add);
        let (mut live, mut peak) = (resident, resident);
        for &id in order {
            let n = g.node(id);
            match CommOp::of(n) {
                Some(CommOp::AllGather) => {
                    r.gathers += 1;
                    live = live.saturating_add(self.tensor_size[id]);
                    peak = peak.max(live);
                }
                Some(CommOp::Reuse) => r.gathers += 1,
                Some(CommOp::Release) => {
                    r.releases += 1;
                    // Only gathered and reused storage has a size here.
                    let freed = n
                        .args
                        .first()
                        .and_then(Arg::as_node)
                        .and_then(|&v| aliases.class(v));
                    if let Some(class) = freed {
                        live = live.saturating_sub(self.tensor_size[class]);
                    }
                }
                Some(CommOp::ReduceGrad) => r.reductions += 1,
                _ => {}
            }
        }
        r.peak_gathered = peak;
        r
    }
}

/// Moves `n` from the unscheduled list to the scheduled one; scheduling a node twice is an
/// error (DeepCompile's `list.remove` would raise).
fn take(
    scheduled: &mut Vec<NodeId>,
    unscheduled: &mut Vec<NodeId>,
    n: NodeId,
) -> Result<(), Problem> {
    let at = unscheduled
        .iter()
        .position(|&u| u == n)
        .ok_or(Problem::BadOrder)?;
    unscheduled.remove(at);
    scheduled.push(n);
    Ok(())
}

/// DeepCompile's `get_last_uses` (its `node_to_last_use`), on the original order: walking the
/// nodes backwards, a value's last use is its latest user, except that a user of a no-copy op
/// (one whose result may alias its input) stands in for that op's own last use, and a no-copy
/// user replaces a known last use when its own last use comes later.
fn last_uses(g: &Graph) -> SideTable<Option<NodeId>> {
    let pos = g.positions();
    let mut last: SideTable<Option<NodeId>> = SideTable::new(g, None);
    for &user in g.order().iter().rev() {
        let node = g.node(user);
        let no_copy = is_no_copy(node);
        // A release (or keep) reads the uses it follows, not the value it frees (see the
        // module notes).
        let refs: Vec<NodeId> = if matches!(CommOp::of(node), Some(CommOp::Release | CommOp::Keep))
        {
            ops::release_after(node)
        } else {
            node.refs().copied().collect()
        };
        for n in refs {
            let stand_in = if no_copy {
                last[user].unwrap_or(user)
            } else {
                user
            };
            let update = match last[n] {
                None => true,
                Some(known) => no_copy && pos[stand_in] > pos[known],
            };
            if update {
                last[n] = Some(stand_in);
            }
        }
    }
    last
}

/// DeepCompile's no-copy ops: its wait, and every aten op whose schema returns an alias of an
/// input. Without schemas, an aten op is taken to alias when it is a known view, the exporter
/// recorded an alias or a mutation for it, or it is an in-place variant (`name_`). `getitem` is
/// not an aten op and is not among them, as in DeepCompile.
fn is_no_copy(n: &Node) -> bool {
    if CommOp::of(n) == Some(CommOp::Wait) {
        return true;
    }
    let Some(rest) = n.target.strip_prefix("aten.") else {
        return false;
    };
    let in_place = rest.split('.').next().is_some_and(|op| op.ends_with('_'));
    let recorded = |idx: &Option<Vec<u32>>| idx.as_ref().is_some_and(|v| !v.is_empty());
    n.op == Op::CallFunction
        && (zerosched_ir::aten::is_view(&n.target)
            || in_place
            || recorded(&n.meta.aliases)
            || recorded(&n.meta.mutates))
}
