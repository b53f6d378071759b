//! Writes the extracted terms back into the graph.
//!
//! Each chosen e-class becomes one node: the original node when the graph already has that
//! e-node (so unchanged parts stay as they were, and identical views merge), else a new one.
//! Consumers are rewired, every gather that remains gets one release after the last real use of
//! its storage, and what no longer has a use is removed. The new order keeps every old node's
//! relative place: new gathers and waits stand where their segment's did, new views and casts
//! just before their first consumer, releases where the last segment they cover released.

use super::build::Built;
use super::extract::Plan;
use super::lang::{Atom, Comm, atom};
use crate::alias::Aliases;
use crate::ops::{self, CommOp};
use egg::{Id, Language};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use zerosched_ir::{Arg, Dim, Graph, Node, NodeId, Problem, TensorMeta, Val};

/// What the write-back changed.
#[derive(Debug, Default)]
pub(super) struct Effects {
    pub casts_fused: usize,
    pub regathers_removed: usize,
    pub alias_nodes_before: usize,
    pub alias_nodes_after: usize,
}

/// Why a write-back failed: a graph edit refused, or a plan that does not match the graph
/// (a bug in the stage, reported rather than panicking).
#[derive(Debug)]
pub(super) enum Failure {
    Graph(Problem),
    Inconsistent,
}

const INCONSISTENT: Failure = Failure::Inconsistent;

impl From<Problem> for Failure {
    fn from(p: Problem) -> Failure {
        Failure::Graph(p)
    }
}

/// Sort keys for the new order: an old node at position `p` has `(2p + 1, 0)`; a node placed
/// just before it `(2p, n)`, just after it `(2p + 1, n)` with `n > 0`.
type Key = (usize, u32);

struct Writer<'a> {
    built: &'a Built,
    plan: &'a Plan,
    pos: zerosched_ir::SideTable<usize>,
    /// Original nodes by (e-class, canonical e-node); the lowest id wins.
    originals: BTreeMap<(Id, Comm), NodeId>,
    memo: BTreeMap<Id, NodeId>,
    keys: BTreeMap<NodeId, Key>,
    /// New views and casts, in creation order (children first).
    fresh_terms: Vec<NodeId>,
    seg_of_gather: BTreeMap<NodeId, u32>,
    wait_of: BTreeMap<NodeId, NodeId>,
    seq: u32,
}

fn is_alias(e: &Comm) -> bool {
    matches!(e, Comm::View(_) | Comm::T(_) | Comm::Transpose(_))
}

impl Writer<'_> {
    fn key_before(&mut self, anchor: NodeId) -> Key {
        self.seq += 1;
        (2 * self.pos[anchor], self.seq)
    }

    fn meta(&self, g: &Graph, class: Id, like: NodeId) -> Option<Val> {
        let ty = self.built.egraph[class].data.as_ref()?;
        let mut t = TensorMeta::new(ty.shape.iter().map(|&d| Dim::Const(d)).collect(), ty.dtype);
        if let Some(Val::Tensor(v)) = &g.node(like).meta.val {
            t.device.clone_from(&v.device);
        }
        Some(Val::Tensor(t.into()))
    }

    /// The node for e-class `class`, whose chosen e-node's one tensor child is already `child`.
    fn node_for(
        &mut self,
        g: &mut Graph,
        class: Id,
        child: Option<NodeId>,
    ) -> Result<NodeId, Failure> {
        let eg = &self.built.egraph;
        let enode = self.plan.choice[&class].clone();
        if let Comm::Keep(_) = enode {
            return child.ok_or(INCONSISTENT);
        }
        if let Some(&old) = self.originals.get(&(class, enode.clone())) {
            // The same e-node may have been another original node's argument: point at the one
            // chosen for the child.
            if let (Some(child), Some(Arg::Node(arg))) = (child, g.node(old).args.first()) {
                if *arg != child {
                    let n = g.node(old);
                    let mut args = n.args.clone();
                    args[0] = Arg::Node(child);
                    let kwargs = n.kwargs.clone();
                    g.set_args(old, args, kwargs)?;
                }
            }
            if let Comm::Gather([_, _, s]) = &enode {
                if let Some(Atom::Seg(s)) = atom(eg, *s) {
                    self.seg_of_gather.insert(old, *s);
                }
            }
            if let (Comm::Wait(_), Some(c)) = (&enode, child) {
                self.wait_of.insert(c, old);
            }
            return Ok(old);
        }
        let id = match &enode {
            Comm::Gather([p, d, s]) => {
                let (Some(Atom::Param(p)), Some(Atom::Dtype(d)), Some(Atom::Seg(s))) =
                    (atom(eg, *p), atom(eg, *d), atom(eg, *s))
                else {
                    return Err(INCONSISTENT);
                };
                let info = &eg.analysis.params[*p as usize];
                let seg = &self.built.segs[*s as usize];
                let dtype = (*d != info.dtype).then_some(*d);
                let node = ops::allgather(g, seg.shard, &info.name, dtype);
                let val = self.meta(g, class, seg.shard);
                let id = g.add(node)?;
                g.meta_mut(id).val = val;
                let key = self.key_before(seg.gather);
                self.keys.insert(id, key);
                self.seg_of_gather.insert(id, *s);
                id
            }
            Comm::Wait(_) => {
                let gather = child.ok_or(INCONSISTENT)?;
                let s = self
                    .seg_of_gather
                    .get(&gather)
                    .copied()
                    .ok_or(INCONSISTENT)?;
                let seg = &self.built.segs[s as usize];
                let name = ops::param_name(g.node(gather))
                    .unwrap_or_default()
                    .to_owned();
                let node = ops::wait(g, gather, &name);
                let val = self.meta(g, class, gather);
                let id = g.add(node)?;
                g.meta_mut(id).val = val;
                g.meta_mut(id).aliases = Some(vec![0]);
                let key = self.key_before(seg.wait);
                self.keys.insert(id, key);
                self.wait_of.insert(gather, id);
                id
            }
            term => {
                let x = Arg::Node(child.ok_or(INCONSISTENT)?);
                let leaf = |id: &Id| atom(eg, *id).cloned();
                let (base, target, args) = match term {
                    Comm::View([_, sh]) => {
                        let Some(Atom::Shape(sizes)) = leaf(sh) else {
                            return Err(INCONSISTENT);
                        };
                        let sizes = sizes.into_iter().map(Arg::Int).collect();
                        ("view", "aten.view.default", vec![x, Arg::List(sizes)])
                    }
                    Comm::T(_) => ("t", "aten.t.default", vec![x]),
                    Comm::Transpose([_, i, j]) => {
                        let (Some(Atom::Int(i)), Some(Atom::Int(j))) = (leaf(i), leaf(j)) else {
                            return Err(INCONSISTENT);
                        };
                        (
                            "transpose",
                            "aten.transpose.int",
                            vec![x, Arg::Int(i), Arg::Int(j)],
                        )
                    }
                    Comm::Cast([_, d]) => {
                        let Some(Atom::Dtype(d)) = leaf(d) else {
                            return Err(INCONSISTENT);
                        };
                        (
                            "convert_element_type",
                            "prims.convert_element_type.default",
                            vec![x, Arg::Dtype(d)],
                        )
                    }
                    _ => return Err(INCONSISTENT),
                };
                let like = child.ok_or(INCONSISTENT)?;
                let val = self.meta(g, class, like);
                let id = g.add(Node::call(g.fresh_name(base), target, args))?;
                g.meta_mut(id).val = val;
                self.fresh_terms.push(id);
                id
            }
        };
        Ok(id)
    }
}

/// A topological order that follows the keys wherever the edges allow (Kahn's algorithm,
/// smallest key first): an order that was already topological comes back unchanged.
fn ordered(
    g: &Graph,
    keys: &BTreeMap<NodeId, Key>,
    pos: &zerosched_ir::SideTable<usize>,
) -> Vec<NodeId> {
    let key = |id: NodeId| {
        keys.get(&id)
            .copied()
            .unwrap_or_else(|| (2 * pos.get(id).copied().unwrap_or(0) + 1, 0))
    };
    // The nodes sorted by key is what Kahn's algorithm yields whenever that sequence is
    // itself topological (each next node is then ready and the smallest of all that remain),
    // which is the common case: check it in one pass before falling back to the heap.
    let mut by_key: Vec<(Key, NodeId)> = g.node_ids().map(|id| (key(id), id)).collect();
    by_key.sort_unstable();
    let sorted: Vec<NodeId> = by_key.into_iter().map(|(_, id)| id).collect();
    if super::inert::is_topological(g, &sorted) {
        return sorted;
    }
    let mut pending = zerosched_ir::SideTable::new(g, 0usize);
    let mut heap = BinaryHeap::new();
    let mut ids: Vec<NodeId> = g.node_ids().collect();
    ids.sort_unstable();
    for &id in &ids {
        pending[id] = g.inputs(id).len();
        if pending[id] == 0 {
            heap.push(Reverse((key(id), id)));
        }
    }
    let mut order = Vec::with_capacity(ids.len());
    while let Some(Reverse((_, id))) = heap.pop() {
        order.push(id);
        for u in g.users(id) {
            pending[u] -= 1;
            if pending[u] == 0 {
                heap.push(Reverse((key(u), u)));
            }
        }
    }
    order
}

pub(super) fn write_back(g: &mut Graph, built: &Built, plan: &Plan) -> Result<Effects, Failure> {
    let eg = &built.egraph;
    let mut w = Writer {
        built,
        plan,
        pos: g.positions(),
        originals: BTreeMap::new(),
        memo: BTreeMap::new(),
        keys: BTreeMap::new(),
        fresh_terms: Vec::new(),
        seg_of_gather: BTreeMap::new(),
        wait_of: BTreeMap::new(),
        seq: 0,
    };
    let mut effects = Effects::default();
    for (id, e) in &built.originals {
        let canon = e.clone().map_children(|c| eg.find(c));
        if is_alias(&canon) {
            effects.alias_nodes_before += 1;
        }
        if let Some(class) = eg.lookup(canon.clone()) {
            w.originals.entry((class, canon)).or_insert(*id);
        }
    }

    // Materialize each root's chain bottom-up: every term has one tensor child.
    let mut rewire: BTreeMap<NodeId, BTreeMap<NodeId, NodeId>> = BTreeMap::new();
    for root in &built.roots {
        let mut chain = vec![eg.find(root.class)];
        while let Some(&top) = chain.last() {
            if w.memo.contains_key(&top) {
                break;
            }
            match chain_child(&plan.choice[&top]) {
                Some(x) => chain.push(eg.find(x)),
                None => break,
            }
        }
        while let Some(class) = chain.pop() {
            if w.memo.contains_key(&class) {
                continue;
            }
            let child = chain_child(&plan.choice[&class]).map(|x| w.memo[&eg.find(x)]);
            let id = w.node_for(g, class, child)?;
            w.memo.insert(class, id);
        }
        let now = w.memo[&eg.find(root.class)];
        if now != root.value {
            rewire
                .entry(root.consumer)
                .or_default()
                .insert(root.value, now);
        }
    }
    for (consumer, map) in &rewire {
        g.map_refs(*consumer, |r| map.get(&r).copied().unwrap_or(r))?;
    }

    // One release per remaining gather, reusing the release of the last segment it covers.
    let mut claimed: BTreeSet<NodeId> = BTreeSet::new();
    let mut releases: Vec<(NodeId, NodeId)> = Vec::new();
    for (class, gu) in &plan.gathers {
        let gather = w.memo[class];
        let wait = *w.wait_of.get(&gather).ok_or(INCONSISTENT)?;
        let last = gu.covered.iter().next_back().copied().unwrap_or(gu.seg);
        let old = built.segs[last as usize].release;
        let name = ops::param_name(g.node(gather))
            .unwrap_or_default()
            .to_owned();
        let release = if claimed.insert(old) {
            old
        } else {
            let id = g.add(ops::release(g, wait, &name, &[]))?;
            w.seq += 1;
            w.keys.insert(id, (2 * w.pos[old] + 1, w.seq));
            id
        };
        g.set_args(
            release,
            vec![Arg::Node(wait)],
            ops::release_kwargs(&name, &[]),
        )?;
        releases.push((release, wait));
        if gu.dtype != built.segs[gu.seg as usize].dtype {
            effects.casts_fused += 1;
        }
    }
    let own: BTreeSet<u32> = plan.gathers.values().map(|gu| gu.seg).collect();
    effects.regathers_removed = plan.kept.keys().filter(|s| !own.contains(s)).count();

    let kept: BTreeSet<NodeId> = w
        .memo
        .values()
        .copied()
        .chain(claimed.iter().copied())
        .collect();
    let mut dead: Vec<NodeId> = built
        .originals
        .iter()
        .map(|(id, _)| *id)
        .chain(built.segs.iter().map(|s| s.release))
        .filter(|id| !kept.contains(id))
        .collect();
    dead.sort_unstable();
    dead.dedup();
    g.remove_all(&dead)?;
    effects.alias_nodes_after = w
        .memo
        .iter()
        .filter(|(class, _)| is_alias(&plan.choice[class]))
        .map(|(_, id)| *id)
        .collect::<BTreeSet<_>>()
        .len();

    // New views and casts go just before their first consumer; parents were made after their
    // children, so in reverse every consumer's key is known.
    for &id in w.fresh_terms.iter().rev() {
        let key = g
            .users(id)
            .into_iter()
            .map(|u| {
                w.keys
                    .get(&u)
                    .copied()
                    .unwrap_or((2 * w.pos.get(u).copied().unwrap_or(0) + 1, 0))
            })
            .min();
        if let Some(k) = key {
            w.keys.insert(id, k);
        }
    }
    let order = ordered(g, &w.keys, &w.pos);
    g.set_order(order)?;
    let aliases = Aliases::analyse(g);
    let output = g.output();
    for (release, wait) in releases {
        let Some(class) = aliases.class(wait) else {
            continue;
        };
        let after: Vec<NodeId> = aliases
            .real_uses(g, class)
            .into_iter()
            .filter(|&u| Some(u) != output && CommOp::of(g.node(u)) != Some(CommOp::Release))
            .collect();
        let name = ops::param_name(g.node(release))
            .unwrap_or_default()
            .to_owned();
        g.set_args(
            release,
            vec![Arg::Node(wait)],
            ops::release_kwargs(&name, &after),
        )?;
    }
    let order = ordered(g, &w.keys, &w.pos);
    g.set_order(order)?;
    Ok(effects)
}

fn chain_child(e: &Comm) -> Option<Id> {
    match e {
        Comm::Gather(_) | Comm::Atom(_) => None,
        Comm::Wait(x) | Comm::T(x) => Some(*x),
        Comm::Keep([x, _]) | Comm::View([x, _]) | Comm::Cast([x, _]) => Some(*x),
        Comm::Transpose([x, _, _]) => Some(*x),
    }
}
