//! Executors: run a graph or program, scheduled or not, over a simulated world of ranks.
//!
//! The core here is shared by every backend. It walks each graph in program order over a
//! world of N ranks in lock step (rank 0, 1, ... for each node: deterministic, and a
//! collective sees every rank's buffer at once), and owns everything that is not arithmetic:
//!
//! - **Liveness.** Each value lives in the storage of its alias class (`passes::alias`); a
//!   class is allocated when its allocating node runs and freed right after its last real use
//!   (`passes::liveness::LastUses` on the graph's own order), exactly as the simulator counts
//!   it. Graph inputs are allocated at the start (one that nothing reads is freed at its place
//!   in the order); parameters, attributes, gathered buffers and
//!   whatever the output returns stay to the end of the graph.
//! - **ZeRO-3 ops with real data.** A sharded parameter's placeholder holds the rank's shard
//!   (flattened, padded to a multiple of N, one N-th). `allgather` concatenates every rank's
//!   shard into the padded full buffer (cast first when it carries a `dtype`); `wait` views it as
//!   the parameter; `release` frees it; `keep` leaves it resident for a later graph's `reuse`;
//!   `reduce_grad` sums every rank's gradient (rank order, left to right) and leaves each rank
//!   its shard (sharded) or the full sum (persistent); `end_backward` hands the reductions on.
//! - **Byte counting.** Every allocation goes through [`alloc::Counter`]: measured peak per
//!   rank, and peak gathered-parameter bytes (which equal the simulator's and the checker's
//!   for the same schedule: same walk, same padded sizes).
//! - **Safety.** Before anything runs, every node's target is checked against the backend (an
//!   op it lacks is an error naming op and node). While running, a real use of storage that a
//!   release (or liveness) already freed is an error naming the reading node: a broken
//!   schedule fails loudly instead of reading stale data.
//!
//! A [`Backend`] supplies what differs between CPU and a device: tensors, kernels and the
//! collectives over the world's buffers. The CPU reference backend (crate
//! `zerosched-exec-cpu`) computes; [`dry::Dry`] only carries byte sizes (`--dry-run`:
//! allocation, liveness and collectives, no arithmetic). Inputs and downloads travel as
//! [`host::Tensor`]s.

#![forbid(unsafe_code)]

pub mod alloc;
pub mod dry;
pub mod host;
pub mod inputs;
pub mod world;

use crate::alloc::Counter;
use std::collections::BTreeMap;
use zerosched_ir::comm::{self, CommOp};
use zerosched_ir::{Arg, Dtype, Graph, Node, NodeId, Op, Program, TensorMeta, Val};
use zerosched_passes::alias::Aliases;
use zerosched_passes::liveness::LastUses;

/// A node's value on one rank.
#[derive(Clone, Debug, Default)]
pub enum Value<T> {
    /// No value (releases, the output node, non-tensor results).
    #[default]
    None,
    Tensor(T),
    /// A multi-output op's results (`None` for non-tensor entries).
    List(Vec<Option<T>>),
    /// Its storage was freed before this node made its (view) value: any real use is an error.
    Dead,
}

/// What a kernel sees: its node and the values computed so far on its rank.
pub struct Env<'a, T> {
    pub g: &'a Graph,
    pub id: NodeId,
    values: &'a [Value<T>],
}

impl<'a, T> Env<'a, T> {
    pub fn node(&self) -> &'a Node {
        self.g.node(self.id)
    }

    pub fn value(&self, id: NodeId) -> Result<&'a Value<T>, String> {
        self.values
            .get(id.index())
            .ok_or_else(|| format!("no value for node #{}", id.index()))
    }

    /// The tensor a bare node reference names.
    pub fn tensor(&self, a: &Arg<NodeId>) -> Result<&'a T, String> {
        let id = a
            .as_node()
            .ok_or_else(|| format!("expected a tensor argument, found {a:?}"))?;
        match self.value(*id)? {
            Value::Tensor(t) => Ok(t),
            Value::Dead => Err(format!("`{}` was freed", self.g.node(*id).name)),
            _ => Err(format!("`{}` is not a tensor", self.g.node(*id).name)),
        }
    }

    /// Positional argument `i`.
    pub fn arg(&self, i: usize) -> Result<&'a Arg<NodeId>, String> {
        self.node()
            .args
            .get(i)
            .ok_or_else(|| format!("missing argument {i}"))
    }

    /// Positional argument `i`, else keyword `name`.
    pub fn arg_or_kw(&self, i: usize, name: &str) -> Option<&'a Arg<NodeId>> {
        let n = self.node();
        n.args.get(i).or_else(|| n.kwargs.get(name))
    }

    /// The node's recorded output tensor metadata.
    pub fn out_meta(&self) -> Option<&'a TensorMeta> {
        match &self.node().meta.val {
            Some(Val::Tensor(t)) => Some(t),
            _ => None,
        }
    }

    /// The recorded metadata of output `k` of a multi-output node.
    pub fn out_meta_k(&self, k: usize) -> Option<&'a TensorMeta> {
        match &self.node().meta.val {
            Some(Val::Tuple(ts)) => ts.get(k).and_then(Option::as_deref),
            Some(Val::Tensor(t)) if k == 0 => Some(t),
            _ => None,
        }
    }
}

/// What differs between executors: tensors, kernels, collectives.
pub trait Backend {
    type Tensor: Clone;
    fn name(&self) -> &'static str;
    /// Whether [`Backend::compute`] implements this node's target.
    fn supports(&self, node: &Node) -> bool;
    /// Runs one compute node (anything but the inserted ops, placeholders and the output).
    fn compute(&mut self, env: &Env<'_, Self::Tensor>) -> Result<Value<Self::Tensor>, String>;
    /// Bytes a tensor's buffer holds.
    fn nbytes(&self, t: &Self::Tensor) -> u64;
    /// A graph input of the given metadata; `make` produces its data on the host when the
    /// backend needs data (a dry run never calls it).
    fn input(
        &mut self,
        meta: &TensorMeta,
        make: &mut dyn FnMut() -> Result<host::Tensor, String>,
    ) -> Result<Self::Tensor, String>;
    /// The tensor's data on the host, if the backend has data.
    fn download(&self, t: &Self::Tensor) -> Option<host::Tensor>;
    /// Rank `rank`'s shard of a full tensor: flattened, padded to a multiple of `world`.
    fn shard(&mut self, full: &Self::Tensor, world: u32, rank: u32)
    -> Result<Self::Tensor, String>;
    /// All-gather: every rank's shard (rank order) concatenated into the padded flat buffer,
    /// cast to `dtype` first when given.
    fn all_gather(
        &mut self,
        shards: &[&Self::Tensor],
        dtype: Option<Dtype>,
    ) -> Result<Self::Tensor, String>;
    /// The first `product(shape)` elements of a flat buffer, as `shape`.
    fn unflatten(&mut self, flat: &Self::Tensor, shape: &[usize]) -> Result<Self::Tensor, String>;
    /// Sums every rank's gradient (rank order); sharded: each rank gets its shard of the sum,
    /// else each gets the whole sum.
    fn reduce(
        &mut self,
        grads: &[&Self::Tensor],
        sharded: bool,
        world: u32,
    ) -> Result<Vec<Self::Tensor>, String>;
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(
        "the {backend} executor does not implement {}",
        .missing.iter().map(|(node, op)| format!("`{op}` (node `{node}`)")).collect::<Vec<_>>().join(", ")
    )]
    Unsupported {
        backend: &'static str,
        /// (node, target) for each node it cannot run, in program order.
        missing: Vec<(String, String)>,
    },
    #[error(transparent)]
    UseAfterFree(Box<UseAfterFree>),
    #[error(transparent)]
    Input(#[from] inputs::InputError),
    #[error("graph `{graph}`, node `{node}` (`{target}`): {message}")]
    Node {
        graph: String,
        node: String,
        target: String,
        message: String,
    },
    #[error("graph `{graph}`: {message}")]
    Graph { graph: String, message: String },
}

/// A read of storage that a release (or liveness) had already freed.
#[derive(Debug, thiserror::Error)]
#[error(
    "graph `{graph}`: node `{node}` reads `{value}`, whose storage `{storage}` was {how} by `{by}` before it: the schedule frees memory that is still in use"
)]
pub struct UseAfterFree {
    pub graph: String,
    pub node: String,
    pub value: String,
    pub storage: String,
    /// "released" (by a release) or "freed" (by liveness).
    pub how: &'static str,
    pub by: String,
}

#[derive(Clone, Debug)]
pub struct ExecOptions {
    pub world_size: u32,
}

impl Default for ExecOptions {
    fn default() -> ExecOptions {
        ExecOptions { world_size: 1 }
    }
}

/// One graph's run over the world.
#[derive(Clone, Debug)]
pub struct GraphRun<T> {
    pub graph: String,
    /// Per rank, the returned values in output order.
    pub outputs: Vec<Vec<Option<T>>>,
    /// Per rank, the allocator's figures for this graph.
    pub memory: Vec<Counter>,
    pub nodes: usize,
}

/// A whole program's run.
#[derive(Clone, Debug)]
pub struct ProgramRun<T> {
    pub graphs: Vec<GraphRun<T>>,
}

impl<T> ProgramRun<T> {
    /// Per rank, the largest peak over the graphs.
    pub fn peak_per_rank(&self) -> Vec<u64> {
        let ranks = self.graphs.first().map_or(0, |g| g.memory.len());
        (0..ranks)
            .map(|r| {
                self.graphs
                    .iter()
                    .map(|g| g.memory[r].peak)
                    .max()
                    .unwrap_or(0)
            })
            .collect()
    }

    /// The largest gathered-parameter peak over graphs and ranks.
    pub fn peak_gathered(&self) -> u64 {
        self.graphs
            .iter()
            .flat_map(|g| g.memory.iter().map(|c| c.peak_gathered))
            .max()
            .unwrap_or(0)
    }
}

/// Where a graph's inputs come from: asked once per placeholder and rank.
pub trait Feed<B: Backend> {
    /// The value of placeholder `id` on `rank` (the full tensor for a parameter: the core
    /// shards it where the graph is sharded).
    fn input(
        &mut self,
        backend: &mut B,
        g: &Graph,
        id: NodeId,
        rank: u32,
    ) -> Result<B::Tensor, String>;
}

const NONE: u32 = u32::MAX;

/// The class state of a rank's storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Unallocated,
    Live,
    /// Freed after its last use by this node.
    Freed(NodeId),
    /// Freed by this release.
    Released(NodeId),
    /// Kept resident for a later graph by this keep.
    Kept(NodeId),
}

/// Everything about a graph the walk needs, computed once.
pub struct Plan<'g> {
    g: &'g Graph,
    comm: Vec<Option<CommOp>>,
    /// Alias class (allocating node index) of each node, `NONE` without storage.
    class: Vec<u32>,
    /// Per node, its distinct inputs with "is a real use" (CSR: `in_start[i]..in_start[i+1]`).
    in_start: Vec<u32>,
    inputs: Vec<(u32, bool)>,
    /// Per node, the classes freed right after it (CSR).
    free_start: Vec<u32>,
    frees: Vec<u32>,
    /// Per class, its members (CSR over `aliases.members`).
    mem_start: Vec<u32>,
    members: Vec<u32>,
    /// Per node: a placeholder that holds a shard (a sharded parameter of an inserted graph).
    sharded_input: Vec<bool>,
    /// Per node: the parameter a placeholder carries.
    param: Vec<Option<usize>>,
    /// Gather and reuse nodes, which need the parameter's shape.
    reuses: Vec<NodeId>,
    /// Whether the graph holds inserted ops (its parameters are then sharded).
    pub inserted: bool,
}

fn first_arg(n: &Node) -> Option<NodeId> {
    n.args.first().and_then(Arg::as_node).copied()
}

impl<'g> Plan<'g> {
    /// Builds the plan; `persistent` names parameters kept whole anywhere in the program.
    pub fn new(g: &'g Graph, persistent: &std::collections::BTreeSet<String>) -> Plan<'g> {
        let bound = g.node_bound();
        let aliases = Aliases::analyse(g);
        let last = LastUses::compute(g, &aliases, g.order());
        let mut comm = vec![None; bound];
        let mut class = vec![NONE; bound];
        let mut param = vec![None; bound];
        for (i, p) in g.params.iter().enumerate() {
            param[p.node.index()] = Some(i);
        }
        let mut reuses = Vec::new();
        for (id, n) in g.nodes() {
            comm[id.index()] = CommOp::of(n);
            if let Some(c) = aliases.class(id) {
                class[id.index()] = c.index() as u32;
            }
            if comm[id.index()] == Some(CommOp::Reuse) {
                reuses.push(id);
            }
        }
        let inserted = comm.iter().any(Option::is_some);
        let mut sharded_input = vec![false; bound];
        for p in &g.params {
            // A placeholder only the output reads holds its shard even where insertion had
            // nothing to add (its other parameters persistent): the format lets the output
            // return the shard, and the simulator counts the shard.
            let only_returned = g
                .users(p.node)
                .into_iter()
                .all(|u| g.node(u).op == Op::Output);
            sharded_input[p.node.index()] =
                (inserted || only_returned) && !p.persistent && !persistent.contains(&p.name);
        }
        let returned = zerosched_passes::simulate::returned_classes(g, &aliases);
        // Frees: the simulator's rule, class by class.
        let mut free_lists: Vec<Vec<u32>> = vec![Vec::new(); bound];
        for (id, n) in g.nodes() {
            if aliases.class(id) != Some(id) {
                continue;
            }
            let held = returned[id]
                || n.op == Op::GetAttr
                || param[id.index()].is_some()
                || matches!(comm[id.index()], Some(CommOp::AllGather | CommOp::Reuse));
            if held {
                continue;
            }
            let at = last.of(id).unwrap_or(id);
            free_lists[at.index()].push(id.index() as u32);
        }
        let (free_start, frees) = csr(&free_lists);
        let mut input_lists: Vec<Vec<(u32, bool)>> = vec![Vec::new(); bound];
        for &id in g.order() {
            input_lists[id.index()] = g
                .inputs(id)
                .into_iter()
                .map(|v| (v.index() as u32, aliases.is_real_use(g, id, v)))
                .collect();
        }
        let (in_start, inputs) = csr(&input_lists);
        let mut member_lists: Vec<Vec<u32>> = vec![Vec::new(); bound];
        for &id in g.order() {
            if aliases.class(id) == Some(id) {
                member_lists[id.index()] = aliases
                    .members(id)
                    .iter()
                    .map(|m| m.index() as u32)
                    .collect();
            }
        }
        let (mem_start, members) = csr(&member_lists);
        Plan {
            g,
            comm,
            class,
            in_start,
            inputs,
            free_start,
            frees,
            mem_start,
            members,
            sharded_input,
            param,
            reuses,
            inserted,
        }
    }

    fn inputs_of(&self, i: usize) -> &[(u32, bool)] {
        &self.inputs[self.in_start[i] as usize..self.in_start[i + 1] as usize]
    }

    fn frees_after(&self, i: usize) -> &[u32] {
        &self.frees[self.free_start[i] as usize..self.free_start[i + 1] as usize]
    }

    fn members_of(&self, c: usize) -> &[u32] {
        &self.members[self.mem_start[c] as usize..self.mem_start[c + 1] as usize]
    }

    /// Whether placeholder `id` holds a shard in this graph.
    pub fn is_sharded_input(&self, id: NodeId) -> bool {
        self.sharded_input[id.index()]
    }

    fn param_shape(&self, shard: NodeId) -> Option<(Vec<usize>, Dtype, String)> {
        let p = &self.g.params[self.param[shard.index()]?];
        Some((
            p.shape.iter().map(|d| d.hint() as usize).collect(),
            p.dtype,
            p.name.clone(),
        ))
    }
}

fn csr<T: Copy>(lists: &[Vec<T>]) -> (Vec<u32>, Vec<T>) {
    let mut start = Vec::with_capacity(lists.len() + 1);
    let mut flat = Vec::new();
    start.push(0);
    for l in lists {
        flat.extend_from_slice(l);
        start.push(flat.len() as u32);
    }
    (start, flat)
}

/// Frees, on every rank, the classes whose last use is `id`.
fn free_after<T>(plan: &Plan<'_>, ranks: &mut [Rank<T>], id: NodeId) {
    for &c in plan.frees_after(id.index()) {
        let c = c as usize;
        for rk in ranks.iter_mut() {
            if rk.state[c] == State::Live {
                rk.state[c] = State::Freed(id);
                rk.counter.free(rk.bytes[c], false);
                for &m in plan.members_of(c) {
                    rk.values[m as usize] = Value::Dead;
                }
            }
        }
    }
}

/// One rank's tables while a graph runs.
struct Rank<T> {
    values: Vec<Value<T>>,
    state: Vec<State>,
    bytes: Vec<u64>,
    counter: Counter,
}

/// Buffers kept across graphs, per rank, by parameter name: (full value, bytes).
pub type Kept<T> = Vec<BTreeMap<String, (T, u64)>>;

/// The executor: a backend, a world size, and the buffers kept between graphs.
pub struct Executor<B: Backend> {
    pub backend: B,
    pub opts: ExecOptions,
    kept: Kept<B::Tensor>,
}

impl<B: Backend> Executor<B> {
    pub fn new(backend: B, opts: ExecOptions) -> Executor<B> {
        let kept = (0..opts.world_size.max(1))
            .map(|_| BTreeMap::new())
            .collect();
        Executor {
            backend,
            opts,
            kept,
        }
    }

    pub fn world(&self) -> u32 {
        self.opts.world_size.max(1)
    }

    /// Every node the backend cannot run, before anything runs.
    pub fn check_supported(&self, p: &Program) -> Result<(), ExecError> {
        let missing: Vec<(String, String)> = p
            .graphs
            .iter()
            .flat_map(|g| g.nodes())
            .filter(|(_, n)| {
                n.op == Op::CallFunction && CommOp::of(n).is_none() && !self.backend.supports(n)
            })
            .map(|(_, n)| (n.name.to_string(), n.target.to_string()))
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(ExecError::Unsupported {
                backend: self.backend.name(),
                missing,
            })
        }
    }

    /// Runs one graph over the world.
    pub fn run_graph(
        &mut self,
        plan: &Plan<'_>,
        feed: &mut dyn Feed<B>,
    ) -> Result<GraphRun<B::Tensor>, ExecError> {
        let g = plan.g;
        let world = self.world();
        let bound = g.node_bound();
        let graph = g.label().to_owned();
        let node_err = |id: NodeId, message: String| {
            let n = g.node(id);
            ExecError::Node {
                graph: graph.clone(),
                node: n.name.to_string(),
                target: n.target.to_string(),
                message,
            }
        };
        let mut ranks: Vec<Rank<B::Tensor>> = (0..world)
            .map(|_| Rank {
                values: vec![Value::None; bound],
                state: vec![State::Unallocated; bound],
                bytes: vec![0; bound],
                counter: Counter::default(),
            })
            .collect();
        // Inputs are there before the first kernel.
        for (id, n) in g.nodes() {
            if !matches!(n.op, Op::Placeholder | Op::GetAttr) {
                continue;
            }
            for r in 0..world {
                let full = feed
                    .input(&mut self.backend, g, id, r)
                    .map_err(|m| node_err(id, m))?;
                let v = if plan.is_sharded_input(id) {
                    self.backend
                        .shard(&full, world, r)
                        .map_err(|m| node_err(id, m))?
                } else {
                    full
                };
                let bytes = self.backend.nbytes(&v);
                let rk = &mut ranks[r as usize];
                rk.values[id.index()] = Value::Tensor(v);
                if plan.class[id.index()] == id.index() as u32 {
                    rk.bytes[id.index()] = bytes;
                    rk.state[id.index()] = State::Live;
                    rk.counter.alloc(bytes, false);
                }
            }
        }
        // A buffer an earlier graph kept is resident from the start; standing alone, the graph
        // gathers it here.
        for &id in &plan.reuses {
            let shard = first_arg(g.node(id)).ok_or_else(|| node_err(id, "no shard".into()))?;
            let (shape, _, name) = plan
                .param_shape(shard)
                .ok_or_else(|| node_err(id, "not a parameter's reuse".into()))?;
            let mut fresh = None;
            for r in 0..world as usize {
                let (v, bytes) = match self.kept[r].remove(&name) {
                    Some(k) => k,
                    None => {
                        if fresh.is_none() {
                            fresh = Some(
                                self.gather(&ranks, shard, &shape, comm::gather_dtype(g.node(id)))
                                    .map_err(|m| node_err(id, m))?,
                            );
                        }
                        let (flat, full) = fresh.clone().unwrap_or_else(|| unreachable!());
                        (full, self.backend.nbytes(&flat))
                    }
                };
                let rk = &mut ranks[r];
                rk.values[id.index()] = Value::Tensor(v);
                rk.bytes[id.index()] = bytes;
                rk.state[id.index()] = State::Live;
                rk.counter.alloc(bytes, true);
            }
        }
        let mut outputs = vec![Vec::new(); world as usize];
        for &id in g.order() {
            let i = id.index();
            let n = g.node(id);
            if matches!(n.op, Op::Placeholder | Op::GetAttr) {
                // An input that nothing reads is freed at its place in the order.
                free_after(plan, &mut ranks, id);
                continue;
            }
            // Every read is of live storage; a view of freed storage is itself dead.
            let mut dead = false;
            for &(v, real) in plan.inputs_of(i) {
                let c = plan.class[v as usize];
                if c == NONE {
                    continue;
                }
                let st = ranks[0].state[c as usize];
                let freed = match st {
                    State::Freed(by) => Some(("freed", by)),
                    State::Released(by) => Some(("released", by)),
                    _ => None,
                };
                let is_dead = matches!(ranks[0].values[v as usize], Value::Dead);
                if let Some((how, by)) = freed.filter(|_| real) {
                    return Err(ExecError::UseAfterFree(Box::new(UseAfterFree {
                        graph: graph.clone(),
                        node: n.name.to_string(),
                        value: g.node(NodeId::new(v as usize)).name.to_string(),
                        storage: g.node(NodeId::new(c as usize)).name.to_string(),
                        how,
                        by: g.node(by).name.to_string(),
                    })));
                }
                // A release's `after` references only order it.
                let orders_only = matches!(plan.comm[i], Some(CommOp::Release | CommOp::Keep));
                if (freed.is_some() || is_dead) && !orders_only {
                    if real {
                        return Err(node_err(
                            id,
                            format!(
                                "reads `{}`, a view of freed storage",
                                g.node(NodeId::new(v as usize)).name
                            ),
                        ));
                    }
                    dead = true;
                }
            }
            match plan.comm[i] {
                Some(CommOp::AllGather) => {
                    let shard = first_arg(n).ok_or_else(|| node_err(id, "no shard".into()))?;
                    let (shape, _, _) = plan
                        .param_shape(shard)
                        .ok_or_else(|| node_err(id, "gathers no parameter".into()))?;
                    let (flat, full) = self
                        .gather(&ranks, shard, &shape, comm::gather_dtype(n))
                        .map_err(|m| node_err(id, m))?;
                    let bytes = self.backend.nbytes(&flat);
                    for rk in &mut ranks {
                        rk.values[i] = Value::Tensor(full.clone());
                        rk.bytes[i] = bytes;
                        rk.state[i] = State::Live;
                        rk.counter.alloc(bytes, true);
                    }
                }
                Some(CommOp::Wait) => {
                    let src = first_arg(n).ok_or_else(|| node_err(id, "no gather".into()))?;
                    for rk in &mut ranks {
                        rk.values[i] = rk.values[src.index()].clone();
                    }
                }
                Some(CommOp::Reuse) => {}
                Some(CommOp::Release) | Some(CommOp::Keep) => {
                    let v = first_arg(n).ok_or_else(|| node_err(id, "no value".into()))?;
                    let c = plan.class[v.index()];
                    if c == NONE
                        || !matches!(
                            plan.comm[c as usize],
                            Some(CommOp::AllGather | CommOp::Reuse)
                        )
                    {
                        return Err(node_err(id, "releases no gathered storage".into()));
                    }
                    let c = c as usize;
                    match ranks[0].state[c] {
                        State::Live => {}
                        State::Released(by) | State::Kept(by) => {
                            return Err(node_err(
                                id,
                                format!("`{}` already released it", g.node(by).name),
                            ));
                        }
                        other => return Err(node_err(id, format!("storage is {other:?}"))),
                    }
                    if plan.comm[i] == Some(CommOp::Keep) {
                        let name = comm::param_name(n).unwrap_or_default().to_owned();
                        for (r, rk) in ranks.iter_mut().enumerate() {
                            rk.state[c] = State::Kept(id);
                            if let Value::Tensor(t) = &rk.values[c] {
                                self.kept[r].insert(name.clone(), (t.clone(), rk.bytes[c]));
                            }
                        }
                    } else {
                        for rk in &mut ranks {
                            rk.state[c] = State::Released(id);
                            rk.counter.free(rk.bytes[c], true);
                            for &m in plan.members_of(c) {
                                rk.values[m as usize] = Value::Dead;
                            }
                        }
                    }
                }
                Some(CommOp::ReduceGrad) => {
                    let grad = first_arg(n).ok_or_else(|| node_err(id, "no gradient".into()))?;
                    let sharded = !matches!(n.kwargs.get("sharded"), Some(Arg::Bool(false)));
                    let grads: Vec<&B::Tensor> = ranks
                        .iter()
                        .map(|rk| match &rk.values[grad.index()] {
                            Value::Tensor(t) => Ok(t),
                            _ => Err(node_err(id, "the gradient is not a tensor".into())),
                        })
                        .collect::<Result<_, _>>()?;
                    let out = self
                        .backend
                        .reduce(&grads, sharded, world)
                        .map_err(|m| node_err(id, m))?;
                    for (rk, t) in ranks.iter_mut().zip(out) {
                        let bytes = self.backend.nbytes(&t);
                        rk.values[i] = Value::Tensor(t);
                        if plan.class[i] == i as u32 {
                            rk.bytes[i] = bytes;
                            rk.state[i] = State::Live;
                            rk.counter.alloc(bytes, false);
                        }
                    }
                }
                Some(CommOp::EndBackward) => {
                    for rk in &mut ranks {
                        let mut items = Vec::new();
                        if let Some(list) = n.args.first().and_then(Arg::as_list) {
                            for a in list {
                                items.push(match a.as_node().map(|r| &rk.values[r.index()]) {
                                    Some(Value::Tensor(t)) => Some(t.clone()),
                                    _ => None,
                                });
                            }
                        }
                        rk.values[i] = Value::List(items);
                    }
                }
                None if n.op == Op::Output => {
                    let values = g.output_values();
                    for (r, rk) in ranks.iter().enumerate() {
                        outputs[r] = values
                            .iter()
                            .map(|a| match a.as_node().map(|v| &rk.values[v.index()]) {
                                Some(Value::Tensor(t)) => Some(t.clone()),
                                _ => None,
                            })
                            .collect();
                    }
                }
                None => {
                    for rk in &mut ranks {
                        let v = if dead {
                            Value::Dead
                        } else {
                            let env = Env {
                                g,
                                id,
                                values: &rk.values,
                            };
                            self.backend.compute(&env).map_err(|m| node_err(id, m))?
                        };
                        if plan.class[i] == i as u32 {
                            let bytes = match &v {
                                Value::Tensor(t) => self.backend.nbytes(t),
                                Value::List(ts) => {
                                    ts.iter().flatten().map(|t| self.backend.nbytes(t)).sum()
                                }
                                _ => 0,
                            };
                            rk.bytes[i] = bytes;
                            rk.state[i] = State::Live;
                            rk.counter.alloc(bytes, false);
                        }
                        rk.values[i] = v;
                    }
                }
            }
            free_after(plan, &mut ranks, id);
        }
        Ok(GraphRun {
            graph,
            outputs,
            memory: ranks.into_iter().map(|r| r.counter).collect(),
            nodes: g.len(),
        })
    }

    /// All-gathers parameter `shard` over the world: (padded flat buffer, full value).
    fn gather(
        &mut self,
        ranks: &[Rank<B::Tensor>],
        shard: NodeId,
        shape: &[usize],
        dtype: Option<Dtype>,
    ) -> Result<(B::Tensor, B::Tensor), String> {
        let shards: Vec<&B::Tensor> = ranks
            .iter()
            .map(|rk| match &rk.values[shard.index()] {
                Value::Tensor(t) => Ok(t),
                _ => Err("the shard is not a tensor".to_owned()),
            })
            .collect::<Result<_, _>>()?;
        let flat = self.backend.all_gather(&shards, dtype)?;
        let full = self.backend.unflatten(&flat, shape)?;
        Ok((flat, full))
    }
}
