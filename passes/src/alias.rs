//! Alias analysis: which values share storage.
//!
//! Each node's value lives in the storage of a *class*, named by the node that allocated it.
//! Views (from `meta.aliases` when the exporter recorded it, else a built-in table of aten view
//! ops), `getitem`s of list-returning views, waits on gathers and in-place ops join the class
//! of what they alias. A use of a value is *real* when it reads or writes the data rather than
//! just making another view of it; liveness and releases are computed over real uses.

use crate::ops;
use zerosched_ir::{Graph, Node, NodeId, Op, SideTable};

#[derive(Clone, Debug)]
pub struct Aliases {
    /// The allocating node of each node's storage; `None` for nodes that hold no storage
    /// (the output node, releases).
    class: SideTable<Option<NodeId>>,
    /// The arguments each node's output is a view of (not a use of them).
    views_of: SideTable<Vec<NodeId>>,
    /// The arguments each node writes in place (a use, and the output aliases them).
    writes: SideTable<Vec<NodeId>>,
    /// Members of each class, by allocating node, in program order.
    members: SideTable<Vec<NodeId>>,
}

impl Aliases {
    /// Analyses `g` in its program order (every argument precedes its user).
    pub fn analyse(g: &Graph) -> Aliases {
        let mut a = Aliases {
            class: SideTable::new(g, None),
            views_of: SideTable::new(g, Vec::new()),
            writes: SideTable::new(g, Vec::new()),
            members: SideTable::new(g, Vec::new()),
        };
        for (id, n) in g.nodes() {
            a.views_of[id] = view_sources(n);
            a.writes[id] = indexed_refs(n, n.meta.mutates.as_deref().unwrap_or(&[]));
            let shared = a.views_of[id]
                .iter()
                .chain(&a.writes[id])
                .find_map(|&s| a.class[s]);
            let class = match n.op {
                Op::Output => None,
                _ if matches!(
                    ops::CommOp::of(n),
                    Some(ops::CommOp::Release | ops::CommOp::Keep)
                ) =>
                {
                    None
                }
                _ => Some(shared.unwrap_or(id)),
            };
            a.class[id] = class;
            if let Some(c) = class {
                a.members[c].push(id);
            }
        }
        a
    }

    /// The class (allocating node) of a node's storage.
    pub fn class(&self, id: NodeId) -> Option<NodeId> {
        self.class.get(id).copied().flatten()
    }

    /// Every node whose value lives in class `class`, in program order.
    pub fn members(&self, class: NodeId) -> &[NodeId] {
        self.members.get(class).map_or(&[], Vec::as_slice)
    }

    /// Whether `user` reading `value` is a real use (not merely a view of it, not a release).
    pub fn is_real_use(&self, g: &Graph, user: NodeId, value: NodeId) -> bool {
        if matches!(
            ops::CommOp::of(g.node(user)),
            Some(ops::CommOp::Release | ops::CommOp::Keep)
        ) {
            return false;
        }
        !self.views_of[user].contains(&value) || self.writes[user].contains(&value)
    }

    /// The distinct real uses of a class's storage, sorted by node index.
    pub fn real_uses(&self, g: &Graph, class: NodeId) -> Vec<NodeId> {
        let mut uses: Vec<NodeId> = self
            .members(class)
            .iter()
            .flat_map(|&m| {
                g.users(m)
                    .into_iter()
                    .filter(move |&u| self.is_real_use(g, u, m))
            })
            .collect();
        uses.sort_unstable();
        uses.dedup();
        uses
    }
}

/// The arguments a node's output is a view of: `meta.aliases` when recorded, else the table.
fn view_sources(n: &Node) -> Vec<NodeId> {
    if n.op != Op::CallFunction {
        return Vec::new();
    }
    if let Some(idx) = &n.meta.aliases {
        return indexed_refs(n, idx);
    }
    let first = || {
        n.args
            .first()
            .and_then(|a| a.as_node())
            .copied()
            .into_iter()
            .collect()
    };
    match n.target.as_str() {
        ops::WAIT => first(),
        ops::END_BACKWARD => indexed_refs(n, &[0]),
        // An element of a tuple lives in the tuple's storage: for a list-returning view
        // (split, unbind) that is the viewed tensor's; for a multi-output op, the op's own.
        ops::GETITEM => first(),
        t if zerosched_ir::aten::is_view(t) => first(),
        _ => Vec::new(),
    }
}

/// Node references inside the arguments at the given positions.
fn indexed_refs(n: &Node, idx: &[u32]) -> Vec<NodeId> {
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
