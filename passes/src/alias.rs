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
        // Union-find over storage: a value that may alias several others (recorded
        // multi-index `aliases`, end_backward's list) joins all of their classes.
        let mut parent: SideTable<Option<NodeId>> = SideTable::new(g, None);
        for (id, n) in g.nodes() {
            a.views_of[id] = view_sources(g, n);
            a.writes[id] = indexed_refs(n, n.meta.mutates.as_deref().unwrap_or(&[]));
            // end_backward only hands its reductions on: each of its items lives in the
            // storage of the reduction it names.
            let no_storage = n.op == Op::Output
                || matches!(
                    ops::CommOp::of(n),
                    Some(ops::CommOp::Release | ops::CommOp::Keep | ops::CommOp::EndBackward)
                );
            if no_storage {
                continue;
            }
            parent[id] = Some(id);
            for &s in a.views_of[id].iter().chain(&a.writes[id]) {
                if parent[s].is_some() {
                    union(g, &mut parent, id, s);
                }
            }
        }
        for (id, _) in g.nodes() {
            if parent[id].is_some() {
                let c = find(&mut parent, id);
                a.class[id] = Some(c);
                a.members[c].push(id);
            }
        }
        a
    }

    /// The class (allocating node) of a node's storage.
    pub fn class(&self, id: NodeId) -> Option<NodeId> {
        self.class.get(id).copied().flatten()
    }

    /// Every node whose value shares storage with `id`, in program order.
    pub fn members(&self, id: NodeId) -> &[NodeId] {
        self.class(id)
            .and_then(|c| self.members.get(c))
            .map_or(&[], Vec::as_slice)
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

    /// The distinct real uses of the storage `id` lives in, sorted by node index.
    pub fn real_uses(&self, g: &Graph, id: NodeId) -> Vec<NodeId> {
        let mut uses: Vec<NodeId> = self
            .members(id)
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

fn find(parent: &mut SideTable<Option<NodeId>>, mut x: NodeId) -> NodeId {
    while let Some(p) = parent[x].filter(|&p| p != x) {
        // Path halving keeps later finds short.
        let grand = parent[p].unwrap_or(p);
        parent[x] = Some(grand);
        x = grand;
    }
    x
}

/// Which of two roots names the merged class: the buffer a gather or reuse allocates, else a
/// graph input (a parameter's placeholder), else the earlier node. Deterministic, and it keeps
/// "the class of gathered storage is its gather" true.
fn rank(g: &Graph, id: NodeId) -> (u8, NodeId) {
    let n = g.node(id);
    let tier = match ops::CommOp::of(n) {
        Some(ops::CommOp::AllGather | ops::CommOp::Reuse) => 0,
        _ if n.op == Op::Placeholder => 1,
        _ => 2,
    };
    (tier, id)
}

fn union(g: &Graph, parent: &mut SideTable<Option<NodeId>>, a: NodeId, b: NodeId) {
    let (ra, rb) = (find(parent, a), find(parent, b));
    if ra != rb {
        let (root, child) = if rank(g, ra) <= rank(g, rb) {
            (ra, rb)
        } else {
            (rb, ra)
        };
        parent[child] = Some(root);
    }
}

/// The arguments a node's output is a view of: `meta.aliases` when recorded, else the table.
fn view_sources(g: &Graph, n: &Node) -> Vec<NodeId> {
    if n.op != Op::CallFunction || n.target == ops::END_BACKWARD {
        return Vec::new();
    }
    if n.target == ops::GETITEM {
        if let Some(reduced) = end_backward_item(g, n) {
            return vec![reduced];
        }
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
        // An element of a tuple lives in the tuple's storage: for a list-returning view
        // (split, unbind) that is the viewed tensor's; for a multi-output op, the op's own.
        ops::GETITEM => first(),
        t if zerosched_ir::aten::is_view(t) => first(),
        _ => Vec::new(),
    }
}

/// `getitem(end_backward([r0, r1, ...]), k)`: the reduction `rk`.
fn end_backward_item(g: &Graph, n: &Node) -> Option<NodeId> {
    let source = g.node(*n.args.first()?.as_node()?);
    if source.target != ops::END_BACKWARD {
        return None;
    }
    let k = usize::try_from(n.args.get(1)?.as_int()?).ok()?;
    source.args.first()?.as_list()?.get(k)?.as_node().copied()
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
