//! The checker's own storage classes, kept apart from `crate::alias` so that a bug there cannot
//! hide itself here.
//!
//! Classes are a union-find over alias edges (views, `getitem`, waits, in-place writes), so
//! the result does not depend on the program order being valid, and a node that may alias two
//! classes joins them both: the conservative reading for a checker.

use zerosched_ir::comm::{self, CommOp};
use zerosched_ir::{Graph, Node, NodeId, Op};

pub(super) struct Storage {
    parent: Vec<u32>,
    size: Vec<u32>,
}

impl Storage {
    pub(super) fn analyse(g: &Graph) -> Storage {
        let n = g.node_bound();
        let mut s = Storage {
            parent: (0..n as u32).collect(),
            size: vec![1; n],
        };
        for (id, node) in g.nodes() {
            for src in alias_sources(node).into_iter().chain(written(node)) {
                s.union(id.index(), src.index());
            }
        }
        s
    }

    /// The representative of a node's storage class.
    pub(super) fn class(&mut self, id: NodeId) -> usize {
        let mut x = id.index();
        // Path halving: iterative, so chains of any length are fine.
        while self.parent[x] as usize != x {
            let grand = self.parent[self.parent[x] as usize];
            self.parent[x] = grand;
            x = grand as usize;
        }
        x
    }

    fn union(&mut self, a: usize, b: usize) {
        let (mut ra, mut rb) = (self.class(NodeId::new(a)), self.class(NodeId::new(b)));
        if ra == rb {
            return;
        }
        if self.size[ra] < self.size[rb] {
            std::mem::swap(&mut ra, &mut rb);
        }
        self.parent[rb] = ra as u32;
        self.size[ra] += self.size[rb];
    }
}

/// The arguments whose storage a node's output shares. Gathers, releases and reductions
/// allocate (or hold nothing) whatever their metadata says.
pub(super) fn alias_sources(n: &Node) -> Vec<NodeId> {
    if n.op != Op::CallFunction {
        return Vec::new();
    }
    let kind = CommOp::of(n);
    if matches!(
        kind,
        Some(CommOp::AllGather | CommOp::Release | CommOp::ReduceGrad)
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
            || matches!(CommOp::of(user), Some(CommOp::Wait | CommOp::Release)))
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
