//! Everything about a graph that the walk needs, computed once and shared by every rank: alias
//! classes, real uses, the liveness frees, and each compute node's kernel.

use crate::{Backend, ExecError};
use std::collections::BTreeSet;
use zerosched_ir::comm::CommOp;
use zerosched_ir::{Arg, Dtype, Graph, Node, NodeId, Op, Program};
use zerosched_passes::alias::Aliases;
use zerosched_passes::liveness::LastUses;

pub(crate) const NONE: u32 = u32::MAX;

pub struct Plan<'g, B: Backend> {
    pub(crate) g: &'g Graph,
    pub(crate) comm: Vec<Option<CommOp>>,
    /// Alias class (allocating node index) of each node, `NONE` without storage.
    pub(crate) class: Vec<u32>,
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
    pub(crate) param: Vec<Option<usize>>,
    /// Per compute node, its kernel.
    kernels: Vec<Option<B::Kernel>>,
    /// Per all-gather or reduction: it opens (`.0`) or closes (`.1`) a bucket of several
    /// adjacent ops of its kind sharing a `bucket` id, the simulator's rule for one collective.
    pub(crate) group: Vec<(bool, bool)>,
    /// Reuse nodes, whose buffers are resident before the first node runs.
    pub(crate) reuses: Vec<NodeId>,
    /// Whether the graph holds inserted ops (its parameters are then sharded).
    pub inserted: bool,
}

pub(crate) fn first_arg(n: &Node) -> Option<NodeId> {
    n.args.first().and_then(Arg::as_node).copied()
}

/// Whether a node runs a kernel (not a placeholder, the output or an inserted op).
fn is_compute(n: &Node) -> bool {
    n.op == Op::CallFunction && CommOp::of(n).is_none()
}

/// The plans of every graph of `p`; every node its backend cannot run is named at once, in
/// program order.
pub fn plans<B: Backend>(p: &Program) -> Result<Vec<Plan<'_, B>>, ExecError> {
    let persistent = p.persistent();
    let mut missing = Vec::new();
    let plans = p
        .graphs
        .iter()
        .map(|g| Plan::build(g, &persistent, &mut missing))
        .collect();
    if missing.is_empty() {
        Ok(plans)
    } else {
        Err(ExecError::Unsupported {
            backend: B::NAME,
            missing,
        })
    }
}

impl<'g, B: Backend> Plan<'g, B> {
    /// The plan of one graph; `persistent` names parameters kept whole anywhere in the program.
    pub fn new(g: &'g Graph, persistent: &BTreeSet<String>) -> Result<Plan<'g, B>, ExecError> {
        let mut missing = Vec::new();
        let plan = Plan::build(g, persistent, &mut missing);
        if missing.is_empty() {
            Ok(plan)
        } else {
            Err(ExecError::Unsupported {
                backend: B::NAME,
                missing,
            })
        }
    }

    fn build(
        g: &'g Graph,
        persistent: &BTreeSet<String>,
        missing: &mut Vec<(String, String)>,
    ) -> Plan<'g, B> {
        let bound = g.node_bound();
        let aliases = Aliases::analyse(g);
        let last = LastUses::compute(g, &aliases, g.order());
        let mut comm = vec![None; bound];
        let mut class = vec![NONE; bound];
        let mut param = vec![None; bound];
        let mut kernels: Vec<Option<B::Kernel>> = (0..bound).map(|_| None).collect();
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
            if is_compute(n) {
                kernels[id.index()] = B::resolve(&n.target);
                if kernels[id.index()].is_none() {
                    missing.push((n.name.to_string(), n.target.to_string()));
                }
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
        let returned_classes = zerosched_passes::simulate::returned_classes(g, &aliases);
        // Frees: the simulator's rule, class by class.
        let mut free_lists: Vec<Vec<u32>> = vec![Vec::new(); bound];
        for (id, n) in g.nodes() {
            if aliases.class(id) != Some(id) {
                continue;
            }
            let held = returned_classes[id]
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
        let group = buckets(g, &comm);
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
            kernels,
            group,
            reuses,
            inserted,
        }
    }

    pub fn graph(&self) -> &'g Graph {
        self.g
    }

    pub(crate) fn inputs_of(&self, i: usize) -> &[(u32, bool)] {
        &self.inputs[self.in_start[i] as usize..self.in_start[i + 1] as usize]
    }

    pub(crate) fn frees_after(&self, i: usize) -> &[u32] {
        &self.frees[self.free_start[i] as usize..self.free_start[i + 1] as usize]
    }

    pub(crate) fn members_of(&self, c: usize) -> &[u32] {
        &self.members[self.mem_start[c] as usize..self.mem_start[c + 1] as usize]
    }

    pub(crate) fn kernel(&self, i: usize) -> Option<&B::Kernel> {
        self.kernels.get(i).and_then(Option::as_ref)
    }

    /// Whether placeholder `id` holds a shard in this graph.
    pub fn is_sharded_input(&self, id: NodeId) -> bool {
        self.sharded_input[id.index()]
    }

    /// (shape, dtype, name) of the parameter placeholder `shard` carries.
    pub(crate) fn param_shape(&self, shard: NodeId) -> Option<(Vec<usize>, Dtype, &'g str)> {
        let p = &self.g.params[self.param[shard.index()]?];
        Some((
            p.shape.iter().map(|d| d.hint() as usize).collect(),
            p.dtype,
            p.name.as_str(),
        ))
    }
}

/// Which all-gathers and reductions open and close a bucket: runs of adjacent ops of one kind
/// (in the graph's order) with the same `bucket` id, of two or more.
fn buckets(g: &Graph, comm: &[Option<CommOp>]) -> Vec<(bool, bool)> {
    let mut group = vec![(false, false); g.node_bound()];
    let bucket_of = |id: NodeId| {
        let op = comm[id.index()];
        matches!(op, Some(CommOp::AllGather | CommOp::ReduceGrad))
            .then(|| zerosched_ir::comm::bucket(g.node(id)).map(|b| (op, b)))
            .flatten()
    };
    let order = g.order();
    let mut i = 0;
    while i < order.len() {
        let Some(b) = bucket_of(order[i]) else {
            i += 1;
            continue;
        };
        let len = order[i..]
            .iter()
            .take_while(|&&id| bucket_of(id) == Some(b))
            .count();
        if len > 1 {
            group[order[i].index()].0 = true;
            group[order[i + len - 1].index()].1 = true;
        }
        i += len;
    }
    group
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
