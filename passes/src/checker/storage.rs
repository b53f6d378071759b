//! The checker's own storage tracking, kept apart from `crate::alias` so that a bug there cannot
//! hide itself here.
//!
//! For every node, the set of gathered buffers its value may live in: a gather's own, and what
//! flows to it along alias edges (views, `getitem`, waits, in-place writes) from source to
//! aliasing value. A node that may alias two values may live in either one's buffers, while
//! those two stay apart. The sets are computed in a topological order of the data edges
//! (Kahn's algorithm, iterative), so they do not depend on the program order being valid.

use zerosched_ir::comm::{self, CommOp};
use zerosched_ir::{Graph, Node, NodeId, Op, SideTable};

pub(super) struct Storage {
    /// Indices of the gathers whose buffer each node's value may be, sorted.
    gathers: SideTable<Vec<usize>>,
}

impl Storage {
    /// `gather_index`: each all-gather's index; every other node `None`.
    pub(super) fn analyse(g: &Graph, gather_index: &SideTable<Option<usize>>) -> Storage {
        let mut gathers = SideTable::new(g, Vec::new());
        for id in topological(g) {
            let n = g.node(id);
            let mut set = match gather_index[id] {
                Some(i) => vec![i],
                // Sources are among the references: with none in a gathered buffer, neither
                // is this node (most nodes, and no allocation for them).
                None if !touches(n, &gathers) => continue,
                None => Vec::new(),
            };
            for src in alias_sources(n).into_iter().chain(written(n)) {
                set.extend_from_slice(&gathers[src]);
            }
            set.sort_unstable();
            set.dedup();
            gathers[id] = set;
        }
        Storage { gathers }
    }

    /// The gathers whose buffer a node's value may be.
    pub(super) fn gathers(&self, id: NodeId) -> &[usize] {
        self.gathers.get(id).map_or(&[], Vec::as_slice)
    }

    /// Whether any node `n` references may be in a gathered buffer.
    pub(super) fn reads_gathered(&self, n: &Node) -> bool {
        touches(n, &self.gathers)
    }
}

fn touches(n: &Node, gathers: &SideTable<Vec<usize>>) -> bool {
    let mut any = false;
    n.for_each_ref(|&r| any |= gathers.get(r).is_some_and(|s| !s.is_empty()));
    any
}

/// Every node, producers before consumers; nodes on a cycle (which the order check reports)
/// come last, in program order.
fn topological(g: &Graph) -> Vec<NodeId> {
    // Edges are followed as the graph stores them (one per producer and consumer); the order
    // among ready nodes does not change the sets.
    let users = |id| g.consumers(id);
    let mut indegree = SideTable::new(g, 0usize);
    for &id in g.order() {
        for u in users(id) {
            indegree[u] += 1;
        }
    }
    let mut out: Vec<NodeId> = g
        .order()
        .iter()
        .copied()
        .filter(|&id| indegree[id] == 0)
        .collect();
    let mut next = 0;
    while let Some(&id) = out.get(next) {
        next += 1;
        for u in users(id) {
            indegree[u] -= 1;
            if indegree[u] == 0 {
                out.push(u);
            }
        }
    }
    let cyclic = g.order().iter().copied().filter(|&id| indegree[id] > 0);
    let rest: Vec<NodeId> = cyclic.collect();
    out.extend(rest);
    out
}

/// The arguments whose storage a node's output shares. Gathers, reuses, releases, keeps and
/// reductions allocate (or hold nothing) whatever their metadata says.
pub(super) fn alias_sources(n: &Node) -> Vec<NodeId> {
    if n.op != Op::CallFunction {
        return Vec::new();
    }
    let kind = CommOp::of(n);
    if matches!(
        kind,
        Some(
            CommOp::AllGather | CommOp::Reuse | CommOp::Release | CommOp::Keep | CommOp::ReduceGrad
        )
    ) {
        return Vec::new();
    }
    let by_table =
        kind.is_some() || n.target == comm::GETITEM || zerosched_ir::aten::is_view(&n.target);
    let mut out = match &n.meta.aliases {
        Some(idx) => refs_at(n, idx),
        None if by_table => refs_at(n, &[0]),
        None => Vec::new(),
    };
    // A wait or a getitem lives in its argument's storage even if `aliases` says otherwise.
    if kind == Some(CommOp::Wait) || n.target == comm::GETITEM {
        out.extend(refs_at(n, &[0]));
        out.sort_unstable();
        out.dedup();
    }
    out
}

/// The arguments a node writes in place.
pub(super) fn written(n: &Node) -> Vec<NodeId> {
    match &n.meta.mutates {
        Some(idx) if n.op == Op::CallFunction => refs_at(n, idx),
        _ => Vec::new(),
    }
}

/// Whether `user` reading `value` reads or writes its data. `views` and `writes` are
/// `user`'s [`alias_sources`] and [`written`], sorted.
pub(super) fn is_real_use(user: &Node, value: NodeId, views: &[NodeId], writes: &[NodeId]) -> bool {
    if user.op == Op::CallFunction
        && (user.target == comm::GETITEM
            || matches!(
                CommOp::of(user),
                Some(CommOp::Wait | CommOp::Release | CommOp::Keep)
            ))
    {
        return false;
    }
    views.binary_search(&value).is_err() || writes.binary_search(&value).is_ok()
}

/// Node references inside the arguments at the given positions, sorted and distinct.
fn refs_at(n: &Node, idx: &[u32]) -> Vec<NodeId> {
    let mut out = Vec::new();
    for &i in idx {
        if let Some(a) = n.args.get(i as usize) {
            a.for_each_ref(&mut |r| out.push(*r));
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}
