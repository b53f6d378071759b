//! The list walk behind `jit` and `prefetch`.
//!
//! The compute nodes (the *spine*) keep their order. Waits and pure views of gathered storage
//! are *deferred*: each is placed right before the first node that needs it. Releases and
//! reductions are *eager*: each is placed as soon as everything it depends on is placed (a
//! reduction waits for the next step so that gathers go first on the communication stream).
//! A view of a gradient that only reductions read (a transpose back to the parameter's
//! layout) is eager too: it costs nothing, and held to its program position it would hold
//! the reduction behind compute that does not feed it. Gathers are issued in the order they
//! are first needed. Under `prefetch` a gather is issued ahead of need while it fits the
//! budget and the communication stream would otherwise fall idle during the next compute
//! node; gathers issued at one point are coalesced into a bucket while that does not delay the
//! bucket's first member past its need. Under `prefetch` a ready reduction is also held back
//! while the communication stream is busy past the next compute node anyway: the next
//! gathers, which compute waits for, then go first, and the reductions held go out together
//! as one bucket (one latency) once the stream would otherwise fall idle, as long as the
//! memory budget has room for the gradients held.
//!
//! A small two-stream clock (compute, communication) drives these choices; the simulator,
//! not this clock, reports step times. Every node is visited a constant number of times.

use super::{ScheduleError, ScheduleOptions, ScheduleReport};
use crate::cost::Collective;
use crate::max_add::MaxAdd;
use crate::ops::{self, CommOp};
use crate::per_node::{self, PerNode};
use zerosched_ir::{Arg, Dtype, Graph, NodeId, Op, Problem, SideTable};

#[derive(Clone, Copy, Debug)]
pub(super) struct Policy {
    pub prefetch: bool,
    pub bucketing: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Spine,
    Deferred,
    Eager,
    Gather,
}

/// What one walk chose: the order, its buckets, and its gathered peaks.
pub(super) struct Outcome {
    order: Vec<NodeId>,
    buckets: Vec<Vec<NodeId>>,
    reduce_buckets: Vec<Vec<NodeId>>,
    pub peak: u64,
    /// The most gathered bytes a forced (just-in-time) gather needed over the budget; 0 when
    /// it fits.
    pub needed: u64,
}

/// Memory left for prefetching at each spine position: what another schedule holds there
/// (`live`, indexed by spine position), and the most it may reach (`limit`). A gather issued
/// ahead of need adds its bytes from its issue to its need.
pub(super) struct Room {
    pub live: MaxAdd,
    pub limit: u64,
}

/// Walks `g` under `policy` (and `room`, for a memory budget) without changing it.
pub(super) fn walk(
    g: &Graph,
    plan: &Plan,
    opts: &ScheduleOptions,
    policy: Policy,
    room: Option<Room>,
) -> Outcome {
    let mut w = Walk::new(g, plan, opts, policy, room);
    w.run();
    Outcome {
        order: std::mem::take(&mut w.order),
        buckets: std::mem::take(&mut w.buckets),
        reduce_buckets: std::mem::take(&mut w.reduce_buckets),
        peak: w.peak,
        needed: w.needed,
    }
}

/// Sets `g`'s order and bucket ids to what a walk chose.
pub(super) fn apply(
    g: &mut Graph,
    plan: &Plan,
    outcome: Outcome,
) -> Result<ScheduleReport, ScheduleError> {
    let label = g.label().to_owned();
    let bad = |problem| ScheduleError::Graph {
        graph: label.clone(),
        problem,
    };
    let Outcome {
        order,
        buckets,
        reduce_buckets,
        peak,
        ..
    } = outcome;
    let multi = |b: &Vec<NodeId>| b.len() > 1;
    let report = ScheduleReport {
        gathers: plan.gathers,
        buckets: buckets.iter().filter(|b| multi(b)).count(),
        releases: plan.releases,
        reductions: plan.reductions,
        reduce_buckets: reduce_buckets.iter().filter(|b| multi(b)).count(),
        peak_gathered: peak,
        peak_memory: 0,
    };
    if order.len() != g.len() {
        return Err(bad(Problem::BadOrder));
    }
    g.set_order(order).map_err(bad)?;
    // Gathers and reductions number their buckets apart (docs/format.md).
    for kind in [buckets, reduce_buckets] {
        for (id, members) in kind.into_iter().filter(multi).enumerate() {
            for m in members {
                let n = g.node(m);
                let (args, mut kwargs) = (n.args.clone(), n.kwargs.clone());
                zerosched_ir::comm::set_bucket(&mut kwargs, id as i64);
                g.set_args(m, args, kwargs).map_err(bad)?;
            }
        }
    }
    Ok(report)
}

/// Everything the walk needs, computed once from the graph after insertion.
pub(super) struct Plan {
    inputs: PerNode,
    users: PerNode,
    role: SideTable<Role>,
    /// Each node's communication op, read once: the walk then never reads a node itself.
    comm: SideTable<Option<CommOp>>,
    spine: Vec<NodeId>,
    /// Compute cost of each spine node, ms (0 for the others).
    cost: SideTable<f64>,
    /// `prefix[i]`: total cost of `spine[..i]`.
    prefix: Vec<f64>,
    /// Gathers in the order they are first needed.
    fifo: Vec<NodeId>,
    /// The spine index that first needs each gather.
    need_at: SideTable<usize>,
    /// The gather each node's storage belongs to, for releases and waits.
    gather_of: SideTable<Option<NodeId>>,
    /// A gather's full buffer, a reduction's gradient.
    bytes: SideTable<u64>,
    /// What a gather's bucket-mates must share ([`zerosched_ir::comm::bucket_dtypes`]).
    dtypes: SideTable<(Option<Dtype>, Option<Dtype>)>,
    /// What a reduction's bucket-mates must share ([`zerosched_ir::comm::reduce_bucket_kind`]).
    reduce_kind: SideTable<(bool, Option<Dtype>)>,
    /// Reuses of buffers an earlier graph kept: resident from the start, no communication.
    resident: SideTable<bool>,
    /// Distinct inputs of each eager node.
    deps: SideTable<usize>,
    gathers: usize,
    releases: usize,
    reductions: usize,
}

impl Plan {
    /// The compute nodes in the order they keep.
    pub fn spine(&self) -> &[NodeId] {
        &self.spine
    }

    pub fn build(g: &Graph, opts: &ScheduleOptions) -> Plan {
        let (inputs, users) = per_node::inputs_and_users(g);
        let mut p = Plan {
            inputs,
            users,
            role: SideTable::new(g, Role::Spine),
            comm: SideTable::new(g, None),
            spine: Vec::new(),
            cost: opts.cost.compute_costs(g),
            prefix: Vec::new(),
            fifo: Vec::new(),
            need_at: SideTable::new(g, usize::MAX),
            gather_of: SideTable::new(g, None),
            bytes: SideTable::new(g, 0),
            dtypes: SideTable::new(g, (None, None)),
            reduce_kind: SideTable::new(g, (true, None)),
            resident: SideTable::new(g, false),
            deps: SideTable::new(g, 0),
            gathers: 0,
            releases: 0,
            reductions: 0,
        };
        // Graph inputs are available from the start: placeholders lead the spine, so every
        // shard can be gathered as early as the budget allows. They cost nothing, and every
        // other table's default is what it holds for them.
        let mut rest = Vec::new();
        let mut scratch = Vec::new();
        let params = ops::ParamIndex::new(g);
        let for_reduction = views_for_reduction(g, &p.inputs, &p.users, &mut scratch);
        for (id, n) in g.nodes() {
            if n.op == Op::Placeholder {
                p.spine.push(id);
                continue;
            }
            let comm = CommOp::of(n);
            p.comm[id] = comm;
            let (gathered, reads) = gathered_storage(g, &p, id, comm, &mut scratch);
            p.gather_of[id] = gathered;
            p.role[id] = match comm {
                Some(op @ (CommOp::AllGather | CommOp::Reuse)) => {
                    p.gathers += 1;
                    p.resident[id] = op == CommOp::Reuse;
                    p.bytes[id] = params
                        .gathered_bytes(g, id, opts.world_size)
                        .or_else(|| n.meta.val.as_ref().and_then(|v| v.nbytes()))
                        .unwrap_or(0);
                    p.dtypes[id] = zerosched_ir::comm::bucket_dtypes(n);
                    Role::Gather
                }
                Some(CommOp::Wait) => Role::Deferred,
                Some(op @ (CommOp::Release | CommOp::Keep)) => {
                    p.releases += usize::from(op == CommOp::Release);
                    p.gather_of[id] = n
                        .args
                        .first()
                        .and_then(Arg::as_node)
                        .and_then(|&v| p.gather_of[v]);
                    Role::Eager
                }
                Some(CommOp::ReduceGrad) => {
                    p.reductions += 1;
                    p.bytes[id] = n.meta.val.as_ref().and_then(|v| v.nbytes()).unwrap_or(0);
                    p.reduce_kind[id] = zerosched_ir::comm::reduce_bucket_kind(n);
                    Role::Eager
                }
                _ => {
                    let pure_view = gathered.is_some() && !reads && g.has_users(id);
                    if pure_view {
                        Role::Deferred
                    } else if for_reduction[id] {
                        Role::Eager
                    } else {
                        Role::Spine
                    }
                }
            };
            if p.role[id] == Role::Eager {
                p.deps[id] = p.inputs.get(id).len();
            }
            if p.role[id] == Role::Spine {
                rest.push(id);
            } else {
                p.cost[id] = 0.0;
            }
        }
        p.spine.extend(rest);
        let sums = p.spine.iter().scan(0.0, |total, &id| {
            *total += p.cost[id];
            Some(*total)
        });
        p.prefix = std::iter::once(0.0).chain(sums).collect();
        // First need of each gather: the first spine node that reaches its wait through
        // deferred nodes. Each deferred node is visited once.
        let mut seen = SideTable::new(g, false);
        let mut stack = Vec::new();
        for (i, &s) in p.spine.iter().enumerate() {
            stack.extend_from_slice(p.inputs.get(s));
            while let Some(v) = stack.pop() {
                if p.role[v] != Role::Deferred || seen[v] {
                    continue;
                }
                seen[v] = true;
                if let Some(gather) = p.gather_of[v] {
                    if p.comm[v] == Some(CommOp::Wait) && p.need_at[gather] == usize::MAX {
                        p.need_at[gather] = i;
                        p.fifo.push(gather);
                    }
                }
                stack.extend_from_slice(p.inputs.get(v));
            }
        }
        // Gathers no compute node needs still get issued (last, in program order).
        for &id in g.order() {
            if p.role[id] == Role::Gather && p.need_at[id] == usize::MAX {
                p.fifo.push(id);
            }
        }
        p
    }
}

/// The views that only reductions read, through other such views (found from the last node
/// back, so that a chain of them is found in one pass).
fn views_for_reduction(
    g: &Graph,
    inputs: &PerNode,
    users: &PerNode,
    scratch: &mut Vec<NodeId>,
) -> SideTable<bool> {
    let mut out = SideTable::new(g, false);
    for &id in g.order().iter().rev() {
        let n = g.node(id);
        let readers = users.get(id);
        if n.op != Op::CallFunction || CommOp::of(n).is_some() || readers.is_empty() {
            continue;
        }
        let only_reductions = readers
            .iter()
            .all(|&u| out[u] || CommOp::of(g.node(u)) == Some(CommOp::ReduceGrad));
        if !only_reductions {
            continue;
        }
        let ins = inputs.get(id);
        out[id] = !ins.is_empty() && !reads_inputs(g, id, ins, scratch);
    }
    out
}

/// The gather whose buffer `id`'s value lives in, found from its inputs (program order puts
/// them first), and whether `id` reads any input rather than only viewing it. Only the few
/// nodes downstream of a gather need the alias tables consulted.
fn gathered_storage(
    g: &Graph,
    p: &Plan,
    id: NodeId,
    comm: Option<CommOp>,
    scratch: &mut Vec<NodeId>,
) -> (Option<NodeId>, bool) {
    let inputs = p.inputs.get(id);
    match comm {
        Some(CommOp::AllGather | CommOp::Reuse) => return (Some(id), true),
        Some(CommOp::Release | CommOp::Keep | CommOp::EndBackward) => return (None, true),
        _ => {}
    }
    if !inputs.iter().any(|&i| p.gather_of[i].is_some()) {
        return (None, true);
    }
    let reads = reads_inputs(g, id, inputs, scratch);
    let gather = scratch.iter().find_map(|&s| p.gather_of[s]);
    (gather, reads)
}

/// Whether node `id` reads any of its `inputs` (or writes one) rather than only viewing them.
/// Leaves in `scratch` what its value views, then what it writes in place.
fn reads_inputs(g: &Graph, id: NodeId, inputs: &[NodeId], scratch: &mut Vec<NodeId>) -> bool {
    let n = g.node(id);
    scratch.clear();
    crate::alias::view_sources(g, n, scratch);
    let viewed = scratch.len();
    crate::alias::write_targets(n, scratch);
    inputs.iter().any(|i| !scratch[..viewed].contains(i)) || viewed < scratch.len()
}

/// How many later gathers a bucket looks ahead for a stall that absorbs a member's wait.
const LOOKAHEAD: usize = 32;

struct Bucket {
    start: f64,
    end: f64,
    bytes: u64,
    /// When the first member is expected to be needed.
    first_need: f64,
}

struct Walk<'a> {
    g: &'a Graph,
    plan: &'a Plan,
    opts: &'a ScheduleOptions,
    policy: Policy,
    emitted: SideTable<bool>,
    pending: SideTable<usize>,
    end_of: SideTable<f64>,
    order: Vec<NodeId>,
    buckets: Vec<Vec<NodeId>>,
    open: Option<Bucket>,
    /// Reductions ready to issue, in the order they became ready.
    reduce_queue: Vec<NodeId>,
    /// The members of each reduction collective issued (one alone unless bucketed).
    reduce_buckets: Vec<Vec<NodeId>>,
    /// Scratch for [`Walk::place`].
    stack: Vec<(NodeId, bool)>,
    /// Scratch for [`Walk::emit`].
    emitted_now: Vec<NodeId>,
    t_compute: f64,
    t_comm: f64,
    live: u64,
    peak: u64,
    /// The most gathered bytes a forced (just-in-time) gather needed.
    needed: u64,
    /// Index into `plan.fifo` of the next gather to issue.
    next: usize,
    /// The entries of `plan.fifo` needed at the spine node being issued for: from the first
    /// whose need is not earlier to the first whose need is later. Both only move forward.
    needed_here: (usize, usize),
    /// The gather last reported held back by the budget, so that it is reported once.
    held: Option<NodeId>,
    room: Option<Room>,
}

impl<'a> Walk<'a> {
    fn new(
        g: &'a Graph,
        plan: &'a Plan,
        opts: &'a ScheduleOptions,
        policy: Policy,
        room: Option<Room>,
    ) -> Walk<'a> {
        let resident: u64 = g
            .order()
            .iter()
            .filter(|&&id| plan.resident[id])
            .map(|&id| plan.bytes[id])
            .sum();
        Walk {
            g,
            plan,
            opts,
            policy,
            emitted: SideTable::new(g, false),
            pending: plan.deps.clone(),
            end_of: SideTable::new(g, 0.0),
            order: Vec::with_capacity(g.len()),
            buckets: Vec::new(),
            open: None,
            reduce_queue: Vec::new(),
            reduce_buckets: Vec::new(),
            stack: Vec::new(),
            emitted_now: Vec::new(),
            t_compute: 0.0,
            t_comm: 0.0,
            live: resident,
            peak: resident,
            needed: 0,
            next: 0,
            needed_here: (0, 0),
            held: None,
            room,
        }
    }

    fn run(&mut self) {
        let plan = self.plan;
        for (i, &s) in plan.spine.iter().enumerate() {
            self.issue_gathers(i, plan.cost[s]);
            self.open = None;
            if !self.hold_reductions(i, plan.cost[s]) {
                self.flush_reductions();
            }
            self.place(s);
        }
        // Whatever no compute node needed, in program order.
        for &id in self.g.order() {
            if !self.emitted[id] && plan.role[id] != Role::Eager {
                self.place(id);
            }
        }
        self.flush_reductions();
    }

    /// Issues the gathers due before spine node `i` (cost `cost`).
    fn issue_gathers(&mut self, i: usize, cost: f64) {
        let fifo = &self.plan.fifo;
        let need = &self.plan.need_at;
        let (mut lo, mut hi) = self.needed_here;
        while fifo.get(lo).is_some_and(|&g| need[g] < i) {
            lo += 1;
        }
        hi = hi.max(lo);
        while fifo.get(hi).is_some_and(|&g| need[g] <= i) {
            hi += 1;
        }
        self.needed_here = (lo, hi);
        while let Some(&gather) = self.plan.fifo.get(self.next) {
            if self.emitted[gather] {
                self.next += 1;
                continue;
            }
            let forced = self.plan.need_at[gather] <= i;
            let ready = self
                .plan
                .inputs
                .get(gather)
                .iter()
                .all(|&s| self.emitted[s]);
            // Held ahead of need over spine positions `i..need` (to the end if never needed).
            let ahead = (i, self.plan.need_at[gather].min(self.plan.spine.len()));
            if !forced {
                let bytes = self.plan.bytes[gather];
                let fits = self.live.saturating_add(bytes) <= self.opts.budget
                    && self.room.as_ref().is_none_or(|r| {
                        r.live.max(ahead.0, ahead.1).saturating_add(bytes) <= r.limit
                    });
                // If the stream stays busy past the end of this node (its own waits included),
                // issuing after it loses nothing and holds the memory for less time, unless
                // it is latency-bound and can ride in the bucket just issued, which saves its
                // own collective. (A large gather that would merely end on time is left for
                // later: pulled in early it takes memory room a later gather needs.)
                let stream_frees = self.t_comm < self.node_start() + cost;
                let rides =
                    !stream_frees && self.joined_end(gather, i).is_some_and(|(_, cheap)| cheap);
                if !(self.policy.prefetch && fits && (stream_frees || rides) && ready) {
                    if let (Some(b), true) = (&self.open, self.policy.prefetch) {
                        tracing::debug!(
                            members = self.buckets.last().map_or(0, Vec::len),
                            bytes = b.bytes,
                            next = %self.g.node(gather).name,
                            fits,
                            "bucket closed: the next gather does not fit, or would delay the bucket more than it saves"
                        );
                    }
                    if self.policy.prefetch && !fits && self.held != Some(gather) {
                        self.held = Some(gather);
                        tracing::debug!(
                            gather = %self.g.node(gather).name,
                            before = self.spine_name(i),
                            live = self.live,
                            bytes = self.plan.bytes[gather],
                            budget = self.opts.budget,
                            "gather held back: prefetching it here would pass the budget"
                        );
                    }
                    break;
                }
            }
            if !forced && !self.plan.resident[gather] {
                if let Some(r) = self.room.as_mut() {
                    r.live.add(ahead.0, ahead.1, self.plan.bytes[gather]);
                }
            }
            self.issue(gather, i);
            self.next += 1;
        }
    }

    /// When the spine node being issued for can start: after the compute before it and after
    /// the gathers it waits for that are issued by now (gathers needed later may follow them
    /// in the first-need order, issued ahead in their bucket).
    fn node_start(&self) -> f64 {
        let (lo, hi) = self.needed_here;
        self.plan.fifo[lo..hi.min(self.next).max(lo)]
            .iter()
            .fold(self.t_compute, |t, &g| t.max(self.end_of[g]))
    }

    /// The name of spine node `i`, for the log; past the last, the end of the graph.
    fn spine_name(&self, i: usize) -> &str {
        self.plan
            .spine
            .get(i)
            .map_or("(end)", |&id| self.g.node(id).name.as_str())
    }

    /// When the open bucket would end with `gather` in it, if the gather should join it (it
    /// never joins a bucket of other dtypes), and whether it is latency-bound (the second
    /// reason below). Joining saves the gather its own collective (its latency, mostly) and costs
    /// the members already in the bucket the time its bytes add. It joins when the bucket
    /// still ends by the time its first member is needed (nothing waits longer), or when
    /// what it adds to the bucket is less than what it saves (a latency-bound gather: the
    /// stream's total shrinks by about a collective's latency, and a member waits at most
    /// that much longer), or when the compute will stall anyway on a later gather for longer
    /// than the members wait: that stall absorbs the wait, and it ends sooner by the latency
    /// saved.
    fn joined_end(&self, gather: NodeId, at: usize) -> Option<(f64, bool)> {
        let b = self.open.as_ref().filter(|_| self.policy.bucketing)?;
        // The open bucket's members are the last ones pushed.
        let first = *self.buckets.last()?.first()?;
        if self.plan.dtypes[first] != self.plan.dtypes[gather] {
            return None;
        }
        let bytes = self.plan.bytes[gather];
        let end = b.start + self.collective(b.bytes.saturating_add(bytes));
        let separately = b.end + self.collective(bytes);
        let on_time = end <= b.end.max(b.first_need);
        let cheap = end - b.end < separately - end;
        let saves = end < separately;
        let absorbed = || self.stall_ahead(gather, at, separately, end - b.end);
        (saves && (on_time || cheap || absorbed())).then_some((end, cheap))
    }

    /// Whether the compute, issued for spine node `at`, will stall for `wait` or longer on one
    /// of the next [`LOOKAHEAD`] gathers after `gather` (which ends at `end` on its own), with
    /// each issued as soon as the stream is free, each waited for at its first need.
    fn stall_ahead(&self, gather: NodeId, at: usize, end: f64, wait: f64) -> bool {
        let plan = self.plan;
        let spine_at = |g: NodeId| plan.prefix.get(plan.need_at[g]).copied();
        let (Some(from), Some(mut prev)) = (plan.prefix.get(at).copied(), spine_at(gather)) else {
            return false;
        };
        // When the compute reaches the previous gather's need, and when that gather ends.
        let mut reached = self.t_compute + prev - from;
        let mut arrives = end;
        let later = plan.fifo.iter().skip(self.next + 1);
        for &next in later.filter(|&&n| !self.emitted[n]).take(LOOKAHEAD) {
            let Some(need) = spine_at(next) else {
                return false;
            };
            reached = reached.max(arrives) + (need - prev);
            arrives += self.collective(plan.bytes[next]);
            if arrives - reached >= wait {
                return true;
            }
            prev = need;
        }
        false
    }

    fn collective(&self, bytes: u64) -> f64 {
        self.opts
            .cost
            .collective_ms(Collective::AllGather, bytes, self.opts.world_size)
    }

    fn issue(&mut self, gather: NodeId, at: usize) {
        // A shard that is not a graph input is placed first (a dependency, out of turn).
        let plan = self.plan;
        for &s in plan.inputs.get(gather) {
            if !self.emitted[s] {
                self.place(s);
            }
        }
        if self.plan.resident[gather] {
            // Already complete and already counted: placing it is all there is to do.
            self.emit(gather);
            return;
        }
        let bytes = self.plan.bytes[gather];
        let need = self.plan.need_at[gather];
        let expected = match self.plan.prefix.get(need) {
            Some(&p) => self.t_compute + p - self.plan.prefix.get(at).copied().unwrap_or(p),
            None => f64::INFINITY,
        };
        let alone = self.collective(bytes);
        let joined = self.joined_end(gather, at).map(|(end, _)| end);
        if let (Some(b), Some(end)) = (&mut self.open, joined) {
            b.end = end;
            b.bytes += bytes;
        }
        let joined_open = joined.is_some();
        match joined {
            Some(end) => {
                if let Some(members) = self.buckets.last_mut() {
                    members.push(gather);
                    for &m in members.iter() {
                        self.end_of[m] = end;
                    }
                }
                self.t_comm = end;
            }
            None => {
                if let (Some(b), true) = (&self.open, self.policy.bucketing) {
                    tracing::debug!(
                        members = self.buckets.last().map_or(0, Vec::len),
                        bytes = b.bytes,
                        next = %self.g.node(gather).name,
                        "bucket closed: adding the next gather would end it later than its first need, or save nothing"
                    );
                }
                let start = self.t_compute.max(self.t_comm);
                let end = start + alone;
                self.open = Some(Bucket {
                    start,
                    end,
                    bytes,
                    first_need: expected,
                });
                self.buckets.push(vec![gather]);
                self.end_of[gather] = end;
                self.t_comm = end;
            }
        }
        if self.live.saturating_add(bytes) > self.opts.budget {
            self.needed = self.needed.max(self.live.saturating_add(bytes));
        }
        self.live = self.live.saturating_add(bytes);
        self.peak = self.peak.max(self.live);
        tracing::debug!(
            gather = %self.g.node(gather).name,
            before = self.spine_name(at),
            needed_by = self.spine_name(need),
            joined_open = joined_open,
            live = self.live,
            "gather issued"
        );
        self.emit(gather);
    }

    /// Whether the queued reductions wait past spine node `i` (cost `cost`) rather than go out
    /// before it: under `prefetch`, while the communication stream is busy past that node's end
    /// anyway (issued now, they would hold up the next gathers and start no sooner than the
    /// next flush's, give or take those gathers), while together they are latency-bound (their
    /// bytes take less time than the latency a bucket saves each member; larger gradients
    /// would only be held for nothing), and while the memory budget has room for the gradients
    /// held over it. Held, their bytes count against the room there.
    fn hold_reductions(&mut self, i: usize, cost: f64) -> bool {
        if !self.policy.bucketing || self.reduce_queue.is_empty() {
            return false;
        }
        if self.t_comm < self.node_start() + cost {
            return false;
        }
        let held = self
            .reduce_queue
            .iter()
            .fold(0u64, |acc, &r| acc.saturating_add(self.plan.bytes[r]));
        let ms = |bytes| {
            self.opts
                .cost
                .collective_ms(Collective::ReduceScatter, bytes, self.opts.world_size)
        };
        let latency = ms(0);
        if ms(held) - latency > latency {
            return false;
        }
        let end = (i + 1).min(self.plan.spine.len());
        if let Some(r) = self.room.as_mut() {
            if r.live.max(i, end).saturating_add(held) > r.limit {
                return false;
            }
            r.live.add(i, end, held);
        }
        true
    }

    /// Issues the queued reductions. Under `prefetch` they go out as few collectives as one
    /// kind and dtype per collective allows: the queue grouped by kind (first come first),
    /// each group one bucket. Without bucketing each is a collective of its own.
    fn flush_reductions(&mut self) {
        let mut queue = std::mem::take(&mut self.reduce_queue);
        if self.policy.bucketing {
            // Reductions are independent of each other: any order among them is valid.
            let kind = &self.plan.reduce_kind;
            let mut kinds: Vec<(bool, Option<Dtype>)> = Vec::new();
            for &r in &queue {
                if !kinds.contains(&kind[r]) {
                    kinds.push(kind[r]);
                }
            }
            queue.sort_by_key(|&r| kinds.iter().position(|&k| k == kind[r]));
        }
        let mut members: Vec<NodeId> = Vec::new();
        for &r in &queue {
            // A bucket is adjacent reductions of one kind in the order; anything an emit
            // placed after the last member (nothing, for reductions that only `end_backward`
            // reads) ends it.
            let joins = self.policy.bucketing
                && members.last().is_some_and(|&m| {
                    self.plan.reduce_kind[m] == self.plan.reduce_kind[r]
                        && self.order.last() == Some(&m)
                });
            if !joins {
                self.issue_reductions(std::mem::take(&mut members));
            }
            self.emit(r);
            members.push(r);
        }
        self.issue_reductions(members);
        queue.clear();
        self.reduce_queue = queue;
    }

    /// Times `members` (already placed, adjacent, of one kind) as one collective of their
    /// summed bytes, after what the stream holds.
    fn issue_reductions(&mut self, members: Vec<NodeId>) {
        let Some(&first) = members.first() else {
            return;
        };
        let kind = if self.plan.reduce_kind[first].0 {
            Collective::ReduceScatter
        } else {
            Collective::AllReduce
        };
        let bytes = members
            .iter()
            .fold(0u64, |acc, &r| acc.saturating_add(self.plan.bytes[r]));
        let start = self.t_compute.max(self.t_comm);
        self.t_comm = start
            + self
                .opts
                .cost
                .collective_ms(kind, bytes, self.opts.world_size);
        for &r in &members {
            self.end_of[r] = self.t_comm;
        }
        if members.len() > 1 {
            tracing::debug!(
                members = members.len(),
                bytes,
                first = %self.g.node(first).name,
                "reductions coalesced into one bucket"
            );
        }
        self.reduce_buckets.push(members);
    }

    /// Places `node` after everything it needs that is not yet placed (deferred nodes, and a
    /// gather not yet issued), depth first, without recursion.
    fn place(&mut self, node: NodeId) {
        let plan = self.plan;
        // Most compute nodes find everything they read already placed.
        if !self.emitted[node] && plan.inputs.get(node).iter().all(|&i| self.emitted[i]) {
            self.emit_compute(node);
            return;
        }
        // One buffer for every call: this runs once per compute node.
        let mut stack = std::mem::take(&mut self.stack);
        stack.push((node, false));
        while let Some((v, expanded)) = stack.pop() {
            if self.emitted[v] {
                continue;
            }
            if expanded {
                self.emit_compute(v);
                continue;
            }
            stack.push((v, true));
            for &i in plan.inputs.get(v) {
                if self.emitted[i] {
                    continue;
                }
                match self.plan.role[i] {
                    Role::Gather => self.issue(i, self.order.len()),
                    Role::Eager => {
                        // A reduction a compute node consumes (end_backward): issue it now.
                        self.reduce_queue.retain(|&r| r != i);
                        self.reduce_queue.push(i);
                        self.flush_reductions();
                    }
                    _ => stack.push((i, false)),
                }
            }
        }
        self.stack = stack;
    }

    fn emit_compute(&mut self, v: NodeId) {
        match self.plan.comm[v] {
            Some(CommOp::Wait) => {
                if let Some(gather) = self.plan.gather_of[v] {
                    self.t_compute = self.t_compute.max(self.end_of[gather]);
                }
            }
            Some(CommOp::EndBackward) => {
                for &r in self.plan.inputs.get(v) {
                    self.t_compute = self.t_compute.max(self.end_of[r]);
                }
            }
            _ => self.t_compute += self.plan.cost[v],
        }
        self.emit(v);
    }

    /// Appends `v` to the order and places the eager nodes it completes (a view for a
    /// reduction completes its own users in turn).
    fn emit(&mut self, v: NodeId) {
        self.emitted[v] = true;
        self.order.push(v);
        let plan = self.plan;
        // One buffer for every call: this runs once per node.
        let mut done = std::mem::take(&mut self.emitted_now);
        done.push(v);
        while let Some(v) = done.pop() {
            for &u in plan.users.get(v) {
                if plan.role[u] != Role::Eager || self.emitted[u] {
                    continue;
                }
                self.pending[u] = self.pending[u].saturating_sub(1);
                if self.pending[u] > 0 {
                    continue;
                }
                match plan.comm[u] {
                    Some(CommOp::ReduceGrad) => {
                        self.reduce_queue.push(u);
                        continue;
                    }
                    Some(CommOp::Release) => {
                        if let Some(gather) = plan.gather_of[u] {
                            self.live = self.live.saturating_sub(plan.bytes[gather]);
                        }
                    }
                    // A kept buffer stays resident past the graph's end.
                    Some(_) => {}
                    None => done.push(u),
                }
                self.emitted[u] = true;
                self.order.push(u);
            }
        }
        self.emitted_now = done;
    }
}
