//! One rank's interpreter over one graph: the walk in program order, one function per kind of
//! node (inputs, gathers, waits, releases, reductions, compute), liveness frees after each.

use crate::alloc::Counter;
use crate::comm::Communicator;
use crate::plan::{NONE, Plan, first_arg};
use crate::world::HostInputs;
use crate::{Backend, Env, ExecError, NodeError, UseAfterFree, Value};
use std::collections::BTreeMap;
use zerosched_ir::comm::{self, CommOp};
use zerosched_ir::{Arg, Graph, NodeId, Op, TensorMeta, Val};

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

/// A rank across the graphs of a program: its backend, its communicator, and what one graph
/// hands the next.
pub(crate) struct Rank<'a, B: Backend, C: Communicator<B>> {
    pub backend: B,
    pub comm: &'a mut C,
    host: &'a HostInputs<'a>,
    /// Gathered buffers a `keep` left resident for a later graph's `reuse`, by parameter name:
    /// (full value, bytes).
    kept: BTreeMap<String, (B::Tensor, u64)>,
    /// Values returned by earlier graphs, by the graph that returned them and the name of the
    /// node returned (AOTAutograd's partitioner names the backward's saved inputs after the
    /// forward's values).
    carried: BTreeMap<(String, String), B::Tensor>,
    /// Where no backward graph names its forward: the graph that last returned each name,
    /// whose value a later placeholder of that name takes.
    last_by_name: BTreeMap<String, String>,
    /// Whether the program's backward graphs name their forward graphs: a placeholder then
    /// takes a carried value only in a backward graph, from its forward's outputs, and every
    /// other input comes from the inputs (the eager code between graph breaks makes them).
    paired: bool,
    /// Whether the graphs' outputs are kept on the host (else only their checksums).
    keep_outputs: bool,
}

/// One graph's tables on one rank.
struct Tables<T, P> {
    values: Vec<Value<T>>,
    state: Vec<State>,
    bytes: Vec<u64>,
    /// Collectives started and not yet awaited, by the node that started them.
    pending: Vec<Option<P>>,
    counter: Counter,
    outputs: Vec<Option<T>>,
}

impl<T, P> Tables<T, P> {
    /// Storage class `i` is allocated: `bytes` live from now, counted as gathered or not.
    fn allocate(&mut self, i: usize, bytes: u64, gathered: bool) {
        self.bytes[i] = bytes;
        self.state[i] = State::Live;
        self.counter.alloc(bytes, gathered);
    }
}

/// What one graph left on one rank.
pub(crate) struct RankGraph {
    pub outputs: Vec<Option<crate::host::Tensor>>,
    /// Each output's (sum, absolute sum), kept where the outputs themselves are not.
    pub checksums: Vec<Option<(f64, f64)>>,
    pub counter: Counter,
}

fn node_err(g: &Graph, id: NodeId, source: NodeError) -> ExecError {
    let n = g.node(id);
    ExecError::Node {
        graph: g.label().to_owned(),
        node: n.name.to_string(),
        target: n.target.to_string(),
        source,
    }
}

fn malformed(m: &str) -> NodeError {
    NodeError::Malformed(m.to_owned())
}

impl<'a, B: Backend, C: Communicator<B>> Rank<'a, B, C> {
    /// `paired`: whether the program's backward graphs name their forward graphs
    /// ([`Graph::forward`]); `keep_outputs`: whether the outputs are kept on the host.
    pub fn new(
        backend: B,
        comm: &'a mut C,
        host: &'a HostInputs<'a>,
        paired: bool,
        keep_outputs: bool,
    ) -> Rank<'a, B, C> {
        Rank {
            backend,
            comm,
            host,
            kept: BTreeMap::new(),
            carried: BTreeMap::new(),
            last_by_name: BTreeMap::new(),
            paired,
            keep_outputs,
        }
    }

    /// The value an earlier graph returned for placeholder `name` of `g`, if any.
    fn take_carried(&mut self, g: &Graph, name: &str) -> Option<B::Tensor> {
        let from = match &g.forward {
            Some(f) => f.clone(),
            None if self.paired => return None,
            None => self.last_by_name.get(name)?.clone(),
        };
        self.carried.remove(&(from, name.to_owned()))
    }

    /// Carries output `name` of `g` to later graphs.
    fn carry(&mut self, g: &Graph, name: &str, t: B::Tensor) {
        let key = (g.label().to_owned(), name.to_owned());
        // A value returned twice is carried once.
        if let Some(old) = self.carried.insert(key, t) {
            self.backend.free(old);
        }
        if !self.paired {
            // An earlier graph's value of the same name is out of every later graph's reach.
            let before = self
                .last_by_name
                .insert(name.to_owned(), g.label().to_owned());
            if let Some(old) = before
                .filter(|b| b != g.label())
                .and_then(|b| self.carried.remove(&(b, name.to_owned())))
            {
                self.backend.free(old);
            }
        }
    }

    /// The end of the program: what no later graph took is freed.
    pub fn finish(mut self) {
        for (_, t) in std::mem::take(&mut self.carried) {
            self.backend.free(t);
        }
        for (_, (t, _)) in std::mem::take(&mut self.kept) {
            self.backend.free(t);
        }
    }

    pub fn run_graph(&mut self, plan: &Plan<'_, B>) -> Result<RankGraph, ExecError> {
        let g = plan.g;
        let bound = g.node_bound();
        let mut w = Tables {
            values: vec![Value::None; bound],
            state: vec![State::Unallocated; bound],
            bytes: vec![0; bound],
            pending: (0..bound).map(|_| None).collect(),
            counter: Counter::default(),
            outputs: Vec::new(),
        };
        // Inputs are there before the first kernel.
        for (id, n) in g.nodes() {
            if matches!(n.op, Op::Placeholder | Op::GetAttr) {
                self.input(plan, &mut w, id)
                    .map_err(|e| node_err(g, id, e))?;
            }
        }
        // A buffer an earlier graph kept is resident from the start; standing alone, the graph
        // gathers it here.
        for &id in &plan.reuses {
            self.reuse(plan, &mut w, id)
                .map_err(|e| node_err(g, id, e))?;
        }
        for &id in g.order() {
            let i = id.index();
            let n = g.node(id);
            if matches!(n.op, Op::Placeholder | Op::GetAttr) {
                // An input that nothing reads is freed at its place in the order.
                self.free_after(plan, &mut w, id);
                continue;
            }
            let dead = check_reads(plan, &w, id)?;
            let step = self
                .settle_inputs(plan, &mut w, i)
                .and_then(|()| match plan.comm[i] {
                    Some(CommOp::AllGather) => self.gather(plan, &mut w, id),
                    Some(CommOp::Wait) => self.wait(plan, &mut w, id),
                    Some(CommOp::Reuse) => Ok(()),
                    Some(CommOp::Release | CommOp::Keep) => self.release(plan, &mut w, id),
                    Some(CommOp::ReduceGrad) => self.reduce(plan, &mut w, id),
                    Some(CommOp::EndBackward) => end_backward(plan, &mut w, id),
                    None if n.op == Op::Output => {
                        output(plan, &mut w);
                        Ok(())
                    }
                    None => self.compute(plan, &mut w, id, dead),
                });
            step.map_err(|e| node_err(g, id, e))?;
            self.free_after(plan, &mut w, id);
            if let Some(held) = self.backend.held_bytes() {
                let live = w.counter.live;
                w.counter
                    .held
                    .get_or_insert_default()
                    .observe(&n.name, &n.target, held, live);
            }
        }
        self.end_graph(plan, w)
    }

    /// A placeholder's value: a parameter from the host's store, a value an earlier graph
    /// returned, else the inputs' data for this rank; a sharded parameter keeps its shard.
    fn input(
        &mut self,
        plan: &Plan<'_, B>,
        w: &mut Tables<B::Tensor, C::Pending>,
        id: NodeId,
    ) -> Result<(), NodeError> {
        let g = plan.g;
        let n = g.node(id);
        let host = self.host;
        let rank = self.comm.rank();
        // A forward that returns a parameter's shard for the backward (AOTAutograd saves the
        // primals) hands it over: the same tensor, which would otherwise stay carried to the
        // program's end beside a second copy. Only a parameter's placeholder holds a shard.
        let carried = self.take_carried(g, &n.name);
        let v = if let Some(pi) = plan.param[id.index()] {
            let p = &g.params[pi];
            let meta = TensorMeta::new(p.shape.clone(), p.dtype);
            let sharded = plan.is_sharded_input(id);
            let world = if sharded { self.comm.world() } else { 1 };
            let want = meta.numel().unwrap_or(0).div_ceil(u64::from(world.max(1)));
            match carried {
                Some(v) if self.backend.numel(&v) == want && self.backend.dtype(&v) == p.dtype => v,
                other => {
                    if let Some(v) = other {
                        self.backend.free(v);
                    }
                    let make = &mut || host.param(g, p);
                    if sharded {
                        self.backend
                            .sharded_input(&meta, make, self.comm.world(), rank)?
                    } else {
                        self.backend.input(&meta, make)?
                    }
                }
            }
        } else if let Some(v) = carried {
            v
        } else {
            let Some(Val::Tensor(meta)) = &n.meta.val else {
                return Err(NodeError::Input(format!(
                    "placeholder `{}` has no tensor metadata",
                    n.name
                )));
            };
            self.backend
                .input(meta, &mut || host.inputs.data(g, id, rank))?
        };
        let bytes = self.backend.nbytes(&v);
        w.values[id.index()] = Value::Tensor(v);
        if plan.class[id.index()] == id.index() as u32 {
            w.allocate(id.index(), bytes, false);
        }
        Ok(())
    }

    /// A reuse's buffer: the one a keep left, or gathered now.
    fn reuse(
        &mut self,
        plan: &Plan<'_, B>,
        w: &mut Tables<B::Tensor, C::Pending>,
        id: NodeId,
    ) -> Result<(), NodeError> {
        let g = plan.g;
        let shard = first_arg(g.node(id)).ok_or_else(|| malformed("no shard"))?;
        let (shape, _, name) = plan
            .param_shape(shard)
            .ok_or_else(|| malformed("not a parameter's reuse"))?;
        let (v, bytes) = match self.kept.remove(name) {
            Some(k) => k,
            None => {
                let t = shard_of(w, shard)?;
                let p = self.comm.start_all_gather(
                    &mut self.backend,
                    t,
                    comm::gather_dtype(g.node(id)),
                )?;
                let flat = self.comm.wait(&mut self.backend, p)?;
                let full = self.backend.unflatten(&flat, &shape)?;
                (full, self.backend.nbytes(&flat))
            }
        };
        let i = id.index();
        w.values[i] = Value::Tensor(v);
        w.allocate(i, bytes, true);
        Ok(())
    }

    /// Waits for the collectives whose results node `i` reads.
    fn settle_inputs(
        &mut self,
        plan: &Plan<'_, B>,
        w: &mut Tables<B::Tensor, C::Pending>,
        i: usize,
    ) -> Result<(), NodeError> {
        for &(v, _) in plan.inputs_of(i) {
            self.settle(w, v as usize)?;
        }
        Ok(())
    }

    fn settle(&mut self, w: &mut Tables<B::Tensor, C::Pending>, v: usize) -> Result<(), NodeError> {
        if let Some(p) = w.pending[v].take() {
            w.values[v] = Value::Tensor(self.comm.wait(&mut self.backend, p)?);
        }
        Ok(())
    }

    /// An all-gather starts; its bytes are allocated now, its data is there at the wait.
    fn gather(
        &mut self,
        plan: &Plan<'_, B>,
        w: &mut Tables<B::Tensor, C::Pending>,
        id: NodeId,
    ) -> Result<(), NodeError> {
        let n = plan.g.node(id);
        let shard = first_arg(n).ok_or_else(|| malformed("no shard"))?;
        plan.param_shape(shard)
            .ok_or_else(|| malformed("gathers no parameter"))?;
        let t = shard_of(w, shard)?;
        let dtype = comm::gather_dtype(n);
        let elem = dtype.unwrap_or_else(|| self.backend.dtype(t)).size();
        let bytes = self
            .backend
            .numel(t)
            .saturating_mul(u64::from(self.comm.world()))
            .saturating_mul(elem);
        let i = id.index();
        let (opens, closes) = plan.group[i];
        if opens {
            self.comm.start_group()?;
        }
        let p = self.comm.start_all_gather(&mut self.backend, t, dtype)?;
        if closes {
            self.comm.end_group()?;
        }
        w.pending[i] = Some(p);
        w.allocate(i, bytes, true);
        Ok(())
    }

    /// The gathered buffer (awaited by [`Rank::settle_inputs`]) viewed as the parameter.
    fn wait(
        &mut self,
        plan: &Plan<'_, B>,
        w: &mut Tables<B::Tensor, C::Pending>,
        id: NodeId,
    ) -> Result<(), NodeError> {
        let g = plan.g;
        let src = first_arg(g.node(id)).ok_or_else(|| malformed("no gather"))?;
        let shard = first_arg(g.node(src)).ok_or_else(|| malformed("gathers no shard"))?;
        let (shape, _, _) = plan
            .param_shape(shard)
            .ok_or_else(|| malformed("gathers no parameter"))?;
        let Value::Tensor(flat) = &w.values[src.index()] else {
            return Err(malformed("waits for no gathered buffer"));
        };
        let full = self.backend.unflatten(flat, &shape)?;
        w.values[id.index()] = Value::Tensor(full);
        Ok(())
    }

    /// A release frees the gathered storage; a keep leaves it for a later graph's reuse.
    fn release(
        &mut self,
        plan: &Plan<'_, B>,
        w: &mut Tables<B::Tensor, C::Pending>,
        id: NodeId,
    ) -> Result<(), NodeError> {
        let g = plan.g;
        let n = g.node(id);
        let v = first_arg(n).ok_or_else(|| malformed("no value"))?;
        let c = plan.class[v.index()];
        if c == NONE
            || !matches!(
                plan.comm[c as usize],
                Some(CommOp::AllGather | CommOp::Reuse)
            )
        {
            return Err(malformed("releases no gathered storage"));
        }
        let c = c as usize;
        match w.state[c] {
            State::Live => {}
            State::Released(by) | State::Kept(by) => {
                return Err(NodeError::Malformed(format!(
                    "`{}` already released it",
                    g.node(by).name
                )));
            }
            other => return Err(NodeError::Malformed(format!("storage is {other:?}"))),
        }
        if plan.comm[id.index()] == Some(CommOp::Keep) {
            let name = comm::param_name(n).unwrap_or_default().to_owned();
            w.state[c] = State::Kept(id);
            if let Value::Tensor(t) = &w.values[v.index()] {
                self.kept.insert(name, (t.clone(), w.bytes[c]));
            }
        } else {
            w.state[c] = State::Released(id);
            w.counter.free(w.bytes[c], true);
            self.free_class(plan, w, c);
        }
        Ok(())
    }

    /// A gradient reduction starts: a reduce-scatter (sharded) or an all-reduce (persistent).
    fn reduce(
        &mut self,
        plan: &Plan<'_, B>,
        w: &mut Tables<B::Tensor, C::Pending>,
        id: NodeId,
    ) -> Result<(), NodeError> {
        let n = plan.g.node(id);
        let grad = first_arg(n).ok_or_else(|| malformed("no gradient"))?;
        let sharded = zerosched_ir::comm::reduce_sharded(n);
        let Value::Tensor(t) = &w.values[grad.index()] else {
            return Err(malformed("the gradient is not a tensor"));
        };
        let world = u64::from(self.comm.world());
        let numel = self.backend.numel(t);
        let numel = if sharded {
            numel.div_ceil(world)
        } else {
            numel
        };
        let bytes = numel.saturating_mul(self.backend.dtype(t).size());
        let i = id.index();
        let (opens, closes) = plan.group[i];
        if opens {
            self.comm.start_group()?;
        }
        let p = if sharded {
            self.comm.start_reduce_scatter(&mut self.backend, t)?
        } else {
            self.comm.start_all_reduce(&mut self.backend, t)?
        };
        if closes {
            self.comm.end_group()?;
        }
        w.pending[i] = Some(p);
        if plan.class[i] == i as u32 {
            w.allocate(i, bytes, false);
        }
        Ok(())
    }

    fn compute(
        &mut self,
        plan: &Plan<'_, B>,
        w: &mut Tables<B::Tensor, C::Pending>,
        id: NodeId,
        dead: bool,
    ) -> Result<(), NodeError> {
        let i = id.index();
        let v = if dead {
            Value::Dead
        } else {
            let k = plan
                .kernel(i)
                .ok_or_else(|| malformed("no kernel was resolved for it"))?;
            let env = Env {
                g: plan.g,
                id,
                values: &w.values,
            };
            self.backend.compute(k, &env)?
        };
        if plan.class[i] == i as u32 {
            let bytes = match &v {
                Value::Tensor(t) => self.backend.nbytes(t),
                Value::List(ts) => ts.iter().flatten().map(|t| self.backend.nbytes(t)).sum(),
                _ => 0,
            };
            w.allocate(i, bytes, false);
        }
        w.values[i] = v;
        Ok(())
    }

    /// Frees the classes whose last use is `id`.
    fn free_after(
        &mut self,
        plan: &Plan<'_, B>,
        w: &mut Tables<B::Tensor, C::Pending>,
        id: NodeId,
    ) {
        for &c in plan.frees_after(id.index()) {
            let c = c as usize;
            if w.state[c] == State::Live {
                w.state[c] = State::Freed(id);
                w.counter.free(w.bytes[c], false);
                self.free_class(plan, w, c);
            }
        }
    }

    /// Drops every view of class `c` and frees its buffer.
    fn free_class(&mut self, plan: &Plan<'_, B>, w: &mut Tables<B::Tensor, C::Pending>, c: usize) {
        let storage = std::mem::take(&mut w.values[c]);
        for &m in plan.members_of(c) {
            w.values[m as usize] = Value::Dead;
        }
        match storage {
            Value::Tensor(t) => self.backend.free(t),
            Value::List(ts) => ts.into_iter().flatten().for_each(|t| self.backend.free(t)),
            Value::None | Value::Dead => {}
        }
    }

    /// The graph's end: collectives still in flight are awaited, the outputs downloaded and
    /// handed to later graphs, and every buffer not kept is freed.
    fn end_graph(
        &mut self,
        plan: &Plan<'_, B>,
        mut w: Tables<B::Tensor, C::Pending>,
    ) -> Result<RankGraph, ExecError> {
        let g = plan.g;
        for i in 0..w.pending.len() {
            self.settle(&mut w, i)
                .map_err(|e| node_err(g, NodeId::new(i), e))?;
        }
        let out_node = g.output();
        let mut outputs = Vec::with_capacity(w.outputs.len());
        let mut checksums = Vec::with_capacity(w.outputs.len());
        let values = g.output_values();
        for (slot, o) in std::mem::take(&mut w.outputs).into_iter().enumerate() {
            let Some(t) = o else {
                outputs.push(None);
                checksums.push(None);
                continue;
            };
            let host = self.backend.download(&t).map_err(|e| {
                node_err(g, out_node.unwrap_or(NodeId::new(0)), NodeError::Backend(e))
            })?;
            checksums.push(host.as_ref().map(crate::host::Tensor::checksum));
            // Held one at a time otherwise: a large step's outputs exceed the host's memory.
            outputs.push(host.filter(|_| self.keep_outputs));
            if let Some(v) = values.get(slot).and_then(Arg::as_node) {
                let carried = self.backend.share(&t);
                self.carry(g, &g.node(*v).name, carried);
            }
        }
        // The carried outputs hold their own handles ([`Backend::share`]).
        for (c, &k) in plan.class.iter().enumerate() {
            if k == c as u32 && w.state[c] == State::Live {
                self.free_class(plan, &mut w, c);
            }
        }
        Ok(RankGraph {
            outputs,
            checksums,
            counter: w.counter,
        })
    }
}

/// The shard a parameter placeholder holds.
fn shard_of<T, P>(w: &Tables<T, P>, shard: NodeId) -> Result<&T, NodeError> {
    match &w.values[shard.index()] {
        Value::Tensor(t) => Ok(t),
        _ => Err(malformed("the shard is not a tensor")),
    }
}

/// Every read of node `id` is of live storage (else an error naming it); returns whether the
/// node's value is a view of freed storage, itself dead.
fn check_reads<B: Backend, T, P>(
    plan: &Plan<'_, B>,
    w: &Tables<T, P>,
    id: NodeId,
) -> Result<bool, ExecError> {
    let g = plan.g;
    let i = id.index();
    let n = g.node(id);
    let mut dead = false;
    for &(v, real) in plan.inputs_of(i) {
        let c = plan.class[v as usize];
        if c == NONE {
            continue;
        }
        let freed = match w.state[c as usize] {
            State::Freed(by) => Some(("freed", by)),
            State::Released(by) => Some(("released", by)),
            _ => None,
        };
        let is_dead = matches!(w.values[v as usize], Value::Dead);
        if let Some((how, by)) = freed.filter(|_| real) {
            return Err(ExecError::UseAfterFree(Box::new(UseAfterFree {
                graph: g.label().to_owned(),
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
                    g,
                    id,
                    NodeError::Malformed(format!(
                        "reads `{}`, a view of freed storage",
                        g.node(NodeId::new(v as usize)).name
                    )),
                ));
            }
            dead = true;
        }
    }
    Ok(dead)
}

/// `end_backward` lists the reductions' results (awaited by then).
fn end_backward<B: Backend, P>(
    plan: &Plan<'_, B>,
    w: &mut Tables<B::Tensor, P>,
    id: NodeId,
) -> Result<(), NodeError> {
    let n = plan.g.node(id);
    let mut items = Vec::new();
    if let Some(list) = n.args.first().and_then(Arg::as_list) {
        for a in list {
            items.push(match a.as_node().map(|r| &w.values[r.index()]) {
                Some(Value::Tensor(t)) => Some(t.clone()),
                _ => None,
            });
        }
    }
    w.values[id.index()] = Value::List(items);
    Ok(())
}

fn output<B: Backend, P>(plan: &Plan<'_, B>, w: &mut Tables<B::Tensor, P>) {
    w.outputs = plan
        .g
        .output_values()
        .iter()
        .map(|a| match a.as_node().map(|v| &w.values[v.index()]) {
            Some(Value::Tensor(t)) => Some(t.clone()),
            _ => None,
        })
        .collect();
}
