//! Alias analysis: which values share storage.
//!
//! Each node's value lives in the storage of a *class*, named by the node that allocated it.
//! Views (from `meta.aliases` when the exporter recorded it, else a built-in table of aten view
//! ops), `getitem`s of list-returning views, waits on gathers and in-place ops join the class
//! of what they alias. A use of a value is *real* when it reads or writes the data rather than
//! just making another view of it; liveness and releases are computed over real uses.

use crate::ops;
use crate::per_node::{self, PerNode};
use zerosched_ir::{Graph, Node, NodeId, Op, SideTable};

#[derive(Clone, Debug)]
pub struct Aliases {
    /// The allocating node of each node's storage; `None` for nodes that hold no storage
    /// (the output node, releases).
    class: SideTable<Option<NodeId>>,
    /// The arguments each node's output is a view of (not a use of them).
    views_of: PerNode,
    /// The arguments each node writes in place (a use, and the output aliases them).
    writes: PerNode,
    /// Members of each class, by allocating node, in program order.
    members: PerNode,
    /// Consumers of each node, by index.
    users: PerNode,
    /// Releases and keeps: they read nothing.
    bookkeeping: SideTable<bool>,
}

impl Aliases {
    /// Analyses `g` in its program order (every argument precedes its user).
    pub fn analyse(g: &Graph) -> Aliases {
        let views_of = PerNode::build(g, |id, out| view_sources(g, g.node(id), out));
        let writes = PerNode::build(g, |id, out| write_targets(g.node(id), out));
        let mut bookkeeping = SideTable::new(g, false);
        // Union-find over storage: a value that may alias several others (recorded
        // multi-index `aliases`, end_backward's list) joins all of their classes.
        let mut parent: SideTable<Option<NodeId>> = SideTable::new(g, None);
        for (id, n) in g.nodes() {
            let op = ops::CommOp::of(n);
            bookkeeping[id] = matches!(op, Some(ops::CommOp::Release | ops::CommOp::Keep));
            // end_backward only hands its reductions on: each of its items lives in the
            // storage of the reduction it names.
            if n.op == Op::Output || bookkeeping[id] || op == Some(ops::CommOp::EndBackward) {
                continue;
            }
            parent[id] = Some(id);
            for &s in views_of.get(id).iter().chain(writes.get(id)) {
                if parent[s].is_some() {
                    union(g, &mut parent, id, s);
                }
            }
        }
        let mut class = SideTable::new(g, None);
        for &id in g.order() {
            if parent[id].is_some() {
                class[id] = Some(find(&mut parent, id));
            }
        }
        let members = PerNode::group_by(g, |id| class[id]);
        Aliases {
            class,
            views_of,
            writes,
            members,
            users: per_node::users(g),
            bookkeeping,
        }
    }

    /// The class (allocating node) of a node's storage.
    pub fn class(&self, id: NodeId) -> Option<NodeId> {
        self.class.get(id).copied().flatten()
    }

    /// Every node whose value shares storage with `id`, in program order.
    pub fn members(&self, id: NodeId) -> &[NodeId] {
        self.class(id).map_or(&[], |c| self.members.get(c))
    }

    /// Whether `user` reading `value` is a real use (not merely a view of it, not a release).
    pub fn is_real_use(&self, _g: &Graph, user: NodeId, value: NodeId) -> bool {
        if self.bookkeeping.get(user).copied().unwrap_or(false) {
            return false;
        }
        !self.views_of.get(user).contains(&value) || self.writes.get(user).contains(&value)
    }

    /// The distinct real uses of the storage `id` lives in, sorted by node index.
    pub fn real_uses(&self, g: &Graph, id: NodeId) -> Vec<NodeId> {
        let mut uses: Vec<NodeId> = self
            .members(id)
            .iter()
            .flat_map(|&m| {
                self.users
                    .get(m)
                    .iter()
                    .copied()
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

/// Appends the arguments a node's output is a view of: `meta.aliases` when recorded, else
/// the table.
pub fn view_sources(g: &Graph, n: &Node, out: &mut Vec<NodeId>) {
    if n.op != Op::CallFunction || n.target == ops::END_BACKWARD {
        return;
    }
    if n.target == ops::GETITEM {
        if let Some(reduced) = end_backward_item(g, n) {
            out.push(reduced);
            return;
        }
    }
    if let Some(idx) = &n.meta.aliases {
        return indexed_refs(n, idx, out);
    }
    let viewing = match n.target.as_str() {
        // An element of a tuple lives in the tuple's storage: for a list-returning view
        // (split, unbind) that is the viewed tensor's; for a multi-output op, the op's own.
        ops::WAIT | ops::GETITEM => true,
        t => zerosched_ir::aten::is_view(t),
    };
    if let Some(&first) = n.args.first().and_then(|a| a.as_node()).filter(|_| viewing) {
        out.push(first);
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

/// Appends the arguments a node writes in place (`meta.mutates`).
pub fn write_targets(n: &Node, out: &mut Vec<NodeId>) {
    indexed_refs(n, n.meta.mutates.as_deref().unwrap_or(&[]), out)
}

/// Appends the distinct node references inside the arguments at the given positions.
fn indexed_refs(n: &Node, idx: &[u32], out: &mut Vec<NodeId>) {
    let lo = out.len();
    for &i in idx {
        if let Some(a) = n.args.get(i as usize) {
            a.for_each_ref(&mut |r| out.push(*r));
        }
    }
    out[lo..].sort_unstable();
    let mut keep = lo;
    for j in lo..out.len() {
        if j == lo || out[j] != out[keep - 1] {
            out[keep] = out[j];
            keep += 1;
        }
    }
    out.truncate(keep);
}
