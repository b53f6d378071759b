//! The two-stream event simulation of a scheduled graph: step time, exposed communication and
//! memory over time (docs/design.md §3).
//!
//! The host walks the program order. Every node that is not an inserted comm op runs on the
//! compute stream for `CostModel::compute_costs`; the walk reaches a node when the compute stream
//! has finished everything before it, and that is when comm ops are issued. The communication
//! stream runs gathers and reductions FIFO in program order, each starting at
//! `max(issue, stream free)`; adjacent gathers sharing a `bucket` id are one collective of their
//! summed bytes, and so are adjacent reductions sharing one. A wait stalls the compute stream until its gather ends, `end_backward` until
//! all its reductions end; a release frees at its position.
//!
//! Memory: each storage class (`alias::Aliases`) is allocated when its allocating node starts
//! and freed when its last real use (`liveness::LastUses`) ends; a use on the communication
//! stream ends with its collective. Graph inputs are live from the start; parameters and
//! attributes (owned by the module) and values the output returns stay to the end. A sharded
//! parameter's placeholder holds its shard; a gather holds its padded full buffer from issue
//! to release.
//!
//! Everything is one pass over the order, in f64 arithmetic done in a fixed order, so the same
//! graph gives the same numbers on every machine.

mod memory;
pub mod trace;

pub use memory::Sample;

use crate::alias::Aliases;
use crate::cost::{Collective, CostModel};
use crate::liveness::LastUses;
use crate::ops::{self, CommOp};
use memory::Memory;
use serde::Serialize;
use zerosched_ir::{Arg, Graph, NodeId, Op, Param, Program, SideTable, Val, comm};

#[derive(Clone, Debug)]
pub struct SimOptions {
    pub world_size: u32,
    pub cost: CostModel,
}

impl Default for SimOptions {
    fn default() -> SimOptions {
        SimOptions {
            world_size: 8,
            cost: CostModel::default(),
        }
    }
}

/// The figures of one graph, or of a whole program (times summed, peaks maximal).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// End of the later stream.
    pub step_ms: f64,
    /// Sum of compute-stream kernel times.
    pub compute_ms: f64,
    /// Sum of collective times.
    pub comm_ms: f64,
    /// `step_ms - compute_ms - host_wait_ms`: communication the compute did not hide.
    pub exposed_comm_ms: f64,
    /// Time the compute stream spent stalled at waits and `end_backward`.
    pub stall_ms: f64,
    /// Time the compute stream waited for the host to issue its next node.
    pub host_wait_ms: f64,
    /// A lower bound on the step of any valid schedule of the graph: the largest of its
    /// compute, its communication, the host's issue time, and the head and tail terms of
    /// [`dependency_bound`] (the first gathers before the compute that needs them, the last
    /// reductions after the compute they reduce); for a program, the sum over its graphs (they
    /// do not overlap).
    pub lower_bound_ms: f64,
    /// `step_ms / lower_bound_ms` (1 when the bound is 0).
    pub ratio: f64,
    pub peak_gathered_bytes: u64,
    pub peak_total_bytes: u64,
    /// When the total first reached its peak: graph-relative for a graph, program time for a
    /// program.
    pub peak_total_at_ms: f64,
    pub gathers: usize,
    /// Collectives coalescing two or more gathers.
    pub buckets: usize,
    pub reductions: usize,
    /// Collectives coalescing two or more reductions.
    pub reduce_buckets: usize,
}

/// A span of the compute stream: a kernel, or a stall at a wait or `end_backward`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    pub node: NodeId,
    pub start_ms: f64,
    pub end_ms: f64,
}

/// One collective on the communication stream.
#[derive(Clone, Debug, PartialEq)]
pub struct CommSpan {
    pub kind: Collective,
    /// The gathers of a bucket, or the one gather or reduction.
    pub nodes: Vec<NodeId>,
    pub bytes: u64,
    pub start_ms: f64,
    pub end_ms: f64,
}

/// Everything that happened in one graph, graph-relative; `offset_ms` places it in a program.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    pub offset_ms: f64,
    /// Compute spans of non-zero length, in order.
    pub compute: Vec<Span>,
    pub comm: Vec<CommSpan>,
    pub memory: Vec<Sample>,
    /// Total live bytes at each position of the program order, once the node there has
    /// allocated (the most that position holds): what a memory budget is checked against.
    pub live: Vec<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GraphSim {
    pub graph: String,
    pub kind: &'static str,
    #[serde(flatten)]
    pub summary: Summary,
    #[serde(skip)]
    pub timeline: Timeline,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProgramSim {
    pub total: Summary,
    pub graphs: Vec<GraphSim>,
}

/// Simulates the graphs of a step in order, each starting when the previous one has drained
/// both streams.
pub fn simulate_program(p: &Program, opts: &SimOptions) -> ProgramSim {
    let mut total = Summary::default();
    let mut graphs = Vec::with_capacity(p.graphs.len());
    for g in &p.graphs {
        let mut sim = simulate_graph(g, opts);
        sim.timeline.offset_ms = total.step_ms;
        let s = &sim.summary;
        if s.peak_total_bytes > total.peak_total_bytes {
            total.peak_total_bytes = s.peak_total_bytes;
            total.peak_total_at_ms = total.step_ms + s.peak_total_at_ms;
        }
        total.step_ms += s.step_ms;
        total.compute_ms += s.compute_ms;
        total.comm_ms += s.comm_ms;
        total.exposed_comm_ms += s.exposed_comm_ms;
        total.stall_ms += s.stall_ms;
        total.host_wait_ms += s.host_wait_ms;
        total.lower_bound_ms += s.lower_bound_ms;
        total.peak_gathered_bytes = total.peak_gathered_bytes.max(s.peak_gathered_bytes);
        total.gathers += s.gathers;
        total.buckets += s.buckets;
        total.reductions += s.reductions;
        total.reduce_buckets += s.reduce_buckets;
        graphs.push(sim);
    }
    total.ratio = ratio(total.step_ms, total.lower_bound_ms);
    ProgramSim { total, graphs }
}

fn ratio(step: f64, bound: f64) -> f64 {
    if bound > 0.0 { step / bound } else { 1.0 }
}

pub fn simulate_graph(g: &Graph, opts: &SimOptions) -> GraphSim {
    let _span = tracing::info_span!("simulate", graph = g.label()).entered();
    let mut sim = Sim::new(g, opts);
    sim.run();
    let dependency = dependency_bound(&sim);
    let Sim {
        t_compute,
        t_comm,
        compute_total,
        comm_total,
        stall,
        t_host,
        host_wait,
        mut mem,
        timeline,
        gathers,
        buckets,
        reductions,
        reduce_buckets,
        ..
    } = sim;
    mem.finish();
    let step = t_compute.max(t_comm);
    let bound = compute_total.max(comm_total).max(t_host).max(dependency);
    GraphSim {
        graph: g.label().to_owned(),
        kind: g.kind.name(),
        summary: Summary {
            step_ms: step,
            compute_ms: compute_total,
            comm_ms: comm_total,
            exposed_comm_ms: (step - compute_total - host_wait).max(0.0),
            stall_ms: stall,
            host_wait_ms: host_wait,
            lower_bound_ms: bound,
            ratio: ratio(step, bound),
            peak_gathered_bytes: mem.peak_gathered,
            peak_total_bytes: mem.peak_total,
            peak_total_at_ms: mem.peak_total_at,
            gathers,
            buckets,
            reductions,
            reduce_buckets,
        },
        timeline: Timeline {
            memory: std::mem::take(&mut mem.samples),
            ..timeline
        },
    }
}

/// When a storage class is freed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Free {
    /// Held to the end of the graph.
    Never,
    /// When this node ends (its last real use, or itself when nothing reads it).
    After(NodeId),
}

struct Sim<'a> {
    g: &'a Graph,
    opts: &'a SimOptions,
    aliases: Aliases,
    /// Each node's inserted-op kind, looked up once (it compares target strings).
    comm: SideTable<Option<CommOp>>,
    /// Each node's time on the compute stream, ms.
    cost: SideTable<f64>,
    /// Bytes each allocating node allocates (gathers: the full buffer).
    bytes: SideTable<u64>,
    /// Classes freed when each node ends, as an intrusive list: `frees[u]` heads it and
    /// `next_free[c]` links on, so that building it allocates nothing per node.
    frees: SideTable<Option<NodeId>>,
    next_free: SideTable<Option<NodeId>>,
    /// End of each gather's or reduction's collective.
    comm_end: SideTable<f64>,
    released: SideTable<bool>,
    t_compute: f64,
    t_comm: f64,
    /// The host's clock: when it has issued the nodes walked so far.
    t_host: f64,
    compute_total: f64,
    comm_total: f64,
    stall: f64,
    host_wait: f64,
    mem: Memory,
    timeline: Timeline,
    gathers: usize,
    buckets: usize,
    reductions: usize,
    reduce_buckets: usize,
}

impl<'a> Sim<'a> {
    fn new(g: &'a Graph, opts: &'a SimOptions) -> Sim<'a> {
        let aliases = Aliases::analyse(g);
        let last = LastUses::compute(g, &aliases, g.order());
        let returned = returned_classes(g, &aliases);
        let mut comm = SideTable::new(g, None);
        // `Graph::param_of` scans the parameter list; tables keep this linear.
        let mut params = SideTable::new(g, None);
        let mut gathered = SideTable::new(g, false);
        for p in &g.params {
            params[p.node] = Some(p);
        }
        for (id, n) in g.nodes() {
            comm[id] = CommOp::of(n);
            if comm[id] == Some(CommOp::AllGather) {
                if let Some(shard) = first_arg(n) {
                    gathered[shard] = true;
                }
            }
        }
        let mut sim = Sim {
            g,
            opts,
            comm,
            cost: opts.cost.compute_costs(g),
            bytes: SideTable::new(g, 0),
            frees: SideTable::new(g, None),
            next_free: SideTable::new(g, None),
            comm_end: SideTable::new(g, 0.0),
            released: SideTable::new(g, false),
            t_compute: 0.0,
            t_comm: 0.0,
            t_host: 0.0,
            compute_total: 0.0,
            comm_total: 0.0,
            stall: 0.0,
            host_wait: 0.0,
            mem: Memory::default(),
            timeline: Timeline::default(),
            gathers: 0,
            buckets: 0,
            reductions: 0,
            reduce_buckets: 0,
            aliases,
        };
        for (id, n) in g.nodes() {
            if sim.aliases.class(id) != Some(id) {
                continue;
            }
            let kind = sim.comm[id];
            sim.bytes[id] = match params[id] {
                Some(p) => param_bytes(g, p, gathered[id], opts.world_size),
                None => storage_bytes(g, kind, id, &params, opts.world_size),
            };
            let held = returned[id]
                || matches!(n.op, Op::GetAttr)
                || params[id].is_some()
                || matches!(kind, Some(CommOp::AllGather | CommOp::Reuse));
            let free = match last.of(id) {
                _ if held => Free::Never,
                Some(u) => Free::After(u),
                None => Free::After(id),
            };
            if let Free::After(u) = free {
                sim.next_free[id] = sim.frees[u];
                sim.frees[u] = Some(id);
            }
        }
        sim
    }

    fn run(&mut self) {
        let g = self.g;
        // Inputs are there before the first kernel starts.
        for (id, n) in g.nodes() {
            if matches!(n.op, Op::Placeholder | Op::GetAttr) && self.owns_storage(id) {
                self.mem.alloc(0.0, self.bytes[id], false);
            }
            // A buffer an earlier graph kept is resident from the start.
            if self.comm[id] == Some(CommOp::Reuse) {
                self.mem.alloc(0.0, self.bytes[id], true);
            }
        }
        let order = g.order();
        // Where the bucket being issued ends; the bucket's collective is issued at its first
        // member and covers the rest.
        let mut bucket_end = 0;
        for (i, &id) in order.iter().enumerate() {
            let n = g.node(id);
            if !matches!(n.op, Op::Placeholder | Op::GetAttr | Op::Output) {
                self.t_host += self.opts.cost.host_ms_per_node;
            }
            let t = self.t_compute;
            match self.comm[id] {
                Some(CommOp::AllGather) => {
                    self.gathers += 1;
                    if i >= bucket_end {
                        bucket_end = i + self.issue_bucket(&order[i..]);
                    }
                    self.mem.alloc(t, self.bytes[id], true);
                }
                Some(CommOp::ReduceGrad) => {
                    self.reductions += 1;
                    if i >= bucket_end {
                        bucket_end = i + self.issue_bucket(&order[i..]);
                    }
                    if self.owns_storage(id) {
                        self.mem.alloc(t, self.bytes[id], false);
                    }
                }
                Some(CommOp::Wait) => {
                    let ready = first_arg(n)
                        .and_then(|v| self.gather_of(v))
                        .map_or(t, |gather| self.comm_end[gather]);
                    self.stall_until(id, ready);
                }
                Some(CommOp::EndBackward) => {
                    let ready = g
                        .inputs(id)
                        .into_iter()
                        .map(|r| self.comm_end[r])
                        .fold(t, f64::max);
                    self.stall_until(id, ready);
                }
                // Already resident and complete; a keep leaves the buffer for a later graph.
                Some(CommOp::Reuse | CommOp::Keep) => {}
                Some(CommOp::Release) => {
                    if let Some(gather) = first_arg(n).and_then(|v| self.gather_of(v)) {
                        // A second release is the checker's to report; it frees nothing here.
                        if !std::mem::replace(&mut self.released[gather], true) {
                            self.mem.free(t, self.bytes[gather], true);
                        }
                    }
                }
                None => self.compute(id),
            }
            // Frees already due lower the count; a free still waiting on its collective
            // does not, so the figure never understates what the position holds.
            self.mem.advance(self.t_compute);
            self.timeline.live.push(self.mem.total());
            self.free_after(id);
        }
    }

    /// Whether `id` allocates storage counted as an activation (gathers count as gathered).
    fn owns_storage(&self, id: NodeId) -> bool {
        self.aliases.class(id) == Some(id)
            && !matches!(self.comm[id], Some(CommOp::AllGather | CommOp::Reuse))
    }

    /// The gather whose buffer `value` lives in.
    fn gather_of(&self, value: NodeId) -> Option<NodeId> {
        self.aliases
            .class(value)
            .filter(|&c| matches!(self.comm[c], Some(CommOp::AllGather | CommOp::Reuse)))
    }

    fn compute(&mut self, id: NodeId) {
        let dur = self.cost[id];
        if dur > 0.0 && self.t_host > self.t_compute {
            // A kernel the host has not issued yet: the stream idles until it has.
            self.host_wait += self.t_host - self.t_compute;
            self.t_compute = self.t_host;
        }
        let start = self.t_compute;
        if self.owns_storage(id) && !matches!(self.g.node(id).op, Op::Placeholder | Op::GetAttr) {
            self.mem.alloc(start, self.bytes[id], false);
        }
        self.t_compute = start + dur;
        self.compute_total += dur;
        self.push_span(id, start);
    }

    fn stall_until(&mut self, id: NodeId, ready: f64) {
        let start = self.t_compute;
        if ready > start {
            tracing::debug!(
                at = %self.g.node(id).name,
                start_ms = start,
                stall_ms = ready - start,
                "compute stalled: the communication it waits for is not done"
            );
            self.stall += ready - start;
            self.t_compute = ready;
            self.push_span(id, start);
        }
    }

    fn push_span(&mut self, node: NodeId, start_ms: f64) {
        if self.t_compute > start_ms {
            self.timeline.compute.push(Span {
                node,
                start_ms,
                end_ms: self.t_compute,
            });
        }
    }

    /// Issues the collective of the bucket that starts `run[0]` (a gather or a reduction): the
    /// adjacent ops of its kind sharing its `bucket` id (just itself without one), priced as one
    /// collective of their summed bytes. Returns how many ops it covers.
    fn issue_bucket(&mut self, run: &[NodeId]) -> usize {
        let g = self.g;
        let Some(&head) = run.first() else {
            return 0;
        };
        let op = self.comm[head];
        let len = match ops::bucket(g.node(head)) {
            None => 1,
            Some(b) => run
                .iter()
                .take_while(|&&id| self.comm[id] == op && ops::bucket(g.node(id)) == Some(b))
                .count(),
        };
        let nodes = run[..len].to_vec();
        let reduce = op == Some(CommOp::ReduceGrad);
        let bytes = nodes.iter().fold(0u64, |acc, &id| {
            acc.saturating_add(if reduce {
                grad_bytes(g, id)
            } else {
                self.bytes[id]
            })
        });
        let kind = if reduce {
            self.reduce_buckets += usize::from(len > 1);
            reduction_kind(g, head)
        } else {
            self.buckets += usize::from(len > 1);
            Collective::AllGather
        };
        self.issue(kind, nodes, bytes);
        len
    }

    fn issue(&mut self, kind: Collective, nodes: Vec<NodeId>, bytes: u64) {
        let dur = self
            .opts
            .cost
            .collective_ms(kind, bytes, self.opts.world_size);
        let start_ms = self.t_compute.max(self.t_comm).max(self.t_host);
        let end_ms = start_ms + dur;
        for &m in &nodes {
            self.comm_end[m] = end_ms;
        }
        self.t_comm = end_ms;
        self.comm_total += dur;
        self.timeline.comm.push(CommSpan {
            kind,
            nodes,
            bytes,
            start_ms,
            end_ms,
        });
    }

    /// Frees the classes whose last use is `id`, when `id` ends: on the communication stream
    /// for a collective, else now.
    fn free_after(&mut self, id: NodeId) {
        let on_comm = matches!(self.comm[id], Some(CommOp::AllGather | CommOp::ReduceGrad));
        let mut next = self.frees[id];
        while let Some(c) = next {
            if on_comm {
                self.mem.free_at(self.comm_end[id], self.bytes[c]);
            } else {
                self.mem.free(self.t_compute, self.bytes[c], false);
            }
            next = self.next_free[c];
        }
    }
}

fn reduction_kind(g: &Graph, id: NodeId) -> Collective {
    if comm::reduce_sharded(g.node(id)) {
        Collective::ReduceScatter
    } else {
        Collective::AllReduce
    }
}

/// The gradient bytes a reduction carries.
fn grad_bytes(g: &Graph, id: NodeId) -> u64 {
    first_arg(g.node(id))
        .and_then(|v| val_bytes(g, v))
        .or_else(|| val_bytes(g, id))
        .unwrap_or(0)
}

/// The head and tail terms of the lower bound: the larger of these over the graph, valid for
/// every order of the graph's nodes that respects its data edges and every bucketing.
///
/// Each is a floor on when one serial compute stream, or the communication after it, can end:
///
/// - A compute node that depends (through data edges) on the wait of a gather `w` runs after
///   that wait in any order, and the wait stalls the compute stream until the gather's
///   collective, issued no earlier than 0, ends. That collective carries at least `w`'s bytes
///   (a bucket carries its members' sum), so it takes at least `floor(w)`, the standalone
///   time (`CostModel::collective_floor_ms`: the model's time where that grows with bytes,
///   else 0). So the node cannot start before `rel`, the largest `floor` of the gathers it
///   depends on. For any `θ`, the nodes with `rel >= θ` all run, one after another, in
///   `[θ, end of compute]`: **head** = `max over θ of θ + their compute`. At `θ = t_min`,
///   the smallest `rel`, that is `t_min + all compute depending on a gather`; with
///   `compute_ms` beside it in the bound, this covers `max(compute not depending on a
///   gather, t_min) + compute depending on one`.
/// - A reduction `r` (or the bucket carrying it, whose collective is issued at its first
///   member, which only reductions separate from `r`) is issued after every compute node it
///   depends on, `A_r`, has ended; they ran one after another, and those of them depending on
///   a gather started no earlier than the smallest `rel` among them, `t_r`. Its collective
///   then takes at least `floor(r)`, and the step ends no earlier than the communication
///   stream: **tail(r)** = `max(compute of A_r, t_r + compute of A_r depending on a
///   gather) + floor(r)`.
///
/// Nodes not depending on a gather, and graphs with no gathers or no reductions, add nothing.
/// Cost: one pass for `rel`, a sort of the nodes depending on gathers, and for each 64
/// reductions one pass over the order and its edges with one `u64` per node (which of them
/// each node is an ancestor of), plus one addition per (compute ancestor, reduction) pair.
fn dependency_bound(sim: &Sim) -> f64 {
    let g = sim.g;
    let order = g.order();
    let floor = |kind, bytes| {
        sim.opts
            .cost
            .collective_floor_ms(kind, bytes, sim.opts.world_size)
    };
    let is_compute = |id: NodeId| sim.comm[id].is_none() && sim.cost[id] > 0.0;
    // `rel[id]`: the earliest `id` can start because of the gathers it depends on; None when it
    // depends on none. Program order is a topological order (the verifier's), so one pass.
    let mut rel: SideTable<Option<f64>> = SideTable::new(g, None);
    for &id in order {
        let mut r: Option<f64> = None;
        g.for_each_input(id, |p| {
            if let Some(t) = rel[p] {
                r = Some(r.map_or(t, |r: f64| r.max(t)));
            }
        });
        if sim.comm[id] == Some(CommOp::Wait) {
            let gather = first_arg(g.node(id))
                .and_then(|v| sim.aliases.class(v))
                .filter(|&c| sim.comm[c] == Some(CommOp::AllGather));
            if let Some(gather) = gather {
                let t = floor(Collective::AllGather, sim.bytes[gather]);
                r = Some(r.map_or(t, |r| r.max(t)));
            }
        }
        rel[id] = r;
    }

    // Head: by `rel` descending, each prefix is the nodes with `rel` at least its last one's.
    let mut dependent: Vec<(f64, NodeId)> = order
        .iter()
        .filter(|&&id| is_compute(id))
        .filter_map(|&id| rel[id].map(|r| (r, id)))
        .collect();
    dependent.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut bound = 0.0f64;
    let mut after = 0.0;
    for &(r, id) in &dependent {
        after += sim.cost[id];
        bound = bound.max(r + after);
    }

    // Tail, 64 reductions at a time.
    let reductions: Vec<NodeId> = order
        .iter()
        .copied()
        .filter(|&id| sim.comm[id] == Some(CommOp::ReduceGrad))
        .collect();
    let mut reaches: SideTable<u64> = SideTable::new(g, 0);
    for block in reductions.chunks(64) {
        for &id in order {
            reaches[id] = 0;
        }
        for (k, &r) in block.iter().enumerate() {
            reaches[r] |= 1u64 << k;
        }
        for &id in order.iter().rev() {
            let bits = reaches[id];
            if bits != 0 {
                g.for_each_input(id, |p| reaches[p] |= bits);
            }
        }
        let mut all = [0.0f64; 64];
        let mut dep = [0.0f64; 64];
        let mut start = [f64::INFINITY; 64];
        for &id in order {
            if !is_compute(id) {
                continue;
            }
            let mut bits = reaches[id];
            while bits != 0 {
                let k = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if let (Some(a), Some(d), Some(s)) =
                    (all.get_mut(k), dep.get_mut(k), start.get_mut(k))
                {
                    *a += sim.cost[id];
                    if let Some(r) = rel[id] {
                        *d += sim.cost[id];
                        *s = s.min(r);
                    }
                }
            }
        }
        for (k, &r) in block.iter().enumerate() {
            let (a, d, s) = (all[k % 64], dep[k % 64], start[k % 64]);
            let done = if s.is_finite() { a.max(s + d) } else { a };
            bound = bound.max(done + floor(reduction_kind(g, r), grad_bytes(g, r)));
        }
    }
    bound
}

fn first_arg(n: &zerosched_ir::Node) -> Option<NodeId> {
    n.args.first().and_then(Arg::as_node).copied()
}

fn val_bytes(g: &Graph, id: NodeId) -> Option<u64> {
    g.node(id).meta.val.as_ref().and_then(Val::nbytes)
}

/// Bytes a parameter's placeholder holds: its shard when it is sharded (not persistent, or
/// gathered here), else the full tensor.
fn param_bytes(g: &Graph, p: &Param, gathered: bool, world: u32) -> u64 {
    if !p.persistent || gathered {
        return p
            .numel()
            .and_then(|e| comm::shard_bytes(e, p.dtype, world))
            .unwrap_or(0);
    }
    val_bytes(g, p.node).or_else(|| p.nbytes()).unwrap_or(0)
}

/// Bytes any other allocating node allocates: a gather's padded full buffer, a
/// reduce-scatter's shard of the gradient, otherwise the value's size.
fn storage_bytes(
    g: &Graph,
    kind: Option<CommOp>,
    id: NodeId,
    params: &SideTable<Option<&Param>>,
    world: u32,
) -> u64 {
    let n = g.node(id);
    match kind {
        // Looked up through `params` rather than `ops::gathered_bytes`, which scans the list.
        Some(CommOp::AllGather | CommOp::Reuse) => first_arg(n)
            .and_then(|shard| params[shard])
            .and_then(|p| {
                comm::gathered_bytes(p.numel()?, ops::gather_dtype(n).unwrap_or(p.dtype), world)
            })
            .or_else(|| val_bytes(g, id))
            .unwrap_or(0),
        Some(CommOp::ReduceGrad) if comm::reduce_sharded(n) => {
            // One rank's shard, padded per element as the executor holds it.
            match &n.meta.val {
                Some(Val::Tensor(t)) => t
                    .numel()
                    .and_then(|e| comm::shard_bytes(e, t.dtype, world))
                    .unwrap_or(0),
                _ => 0,
            }
        }
        _ => val_bytes(g, id).unwrap_or(0),
    }
}

/// Classes whose storage the output returns, directly or through views (`end_backward` and
/// its `getitem`s view every reduction, though alias analysis files them under the first).
/// The executor holds the same classes to the end of the graph.
pub fn returned_classes(g: &Graph, aliases: &Aliases) -> SideTable<bool> {
    let mut returned = SideTable::new(g, false);
    let mut seen = SideTable::new(g, false);
    let Some(out) = g.output() else {
        return returned;
    };
    let mut stack = g.inputs(out);
    while let Some(v) = stack.pop() {
        if std::mem::replace(&mut seen[v], true) {
            continue;
        }
        if let Some(c) = aliases.class(v) {
            returned[c] = true;
        }
        stack.extend(
            g.inputs(v)
                .into_iter()
                .filter(|&u| !aliases.is_real_use(g, v, u)),
        );
    }
    returned
}
