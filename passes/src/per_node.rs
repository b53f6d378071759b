//! Short lists per node (inputs, users, alias sources, class members) kept in one flat array,
//! so an analysis of a 100,000-node graph makes a handful of allocations, not one per node.

use zerosched_ir::{Graph, NodeId, SideTable};

#[derive(Clone, Debug, Default)]
pub struct PerNode {
    range: SideTable<(u32, u32)>,
    items: Vec<NodeId>,
}

impl PerNode {
    /// `fill(id, out)` appends node `id`'s list to `out`, for every node in program order.
    pub fn build(g: &Graph, mut fill: impl FnMut(NodeId, &mut Vec<NodeId>)) -> PerNode {
        let mut p = PerNode {
            range: SideTable::new(g, (0, 0)),
            items: Vec::with_capacity(2 * g.len()),
        };
        for &id in g.order() {
            let lo = p.items.len();
            fill(id, &mut p.items);
            p.range[id] = (lo as u32, p.items.len() as u32);
        }
        p
    }

    /// Groups nodes by `key`, each group in program order: `group(k)` lists the nodes whose
    /// key is `k`.
    pub fn group_by(g: &Graph, key: impl Fn(NodeId) -> Option<NodeId>) -> PerNode {
        PerNode::from_pairs(g, || {
            g.order().iter().filter_map(|&id| key(id).map(|k| (k, id)))
        })
    }

    /// The lists of `(owner, item)` pairs, each item under its owner in the order `pairs`
    /// yields them; `pairs` is called twice (to count, then to fill) and must yield the same.
    fn from_pairs<I: Iterator<Item = (NodeId, NodeId)>>(
        g: &Graph,
        pairs: impl Fn() -> I,
    ) -> PerNode {
        let mut count: SideTable<u32> = SideTable::new(g, 0);
        for (owner, _) in pairs() {
            count[owner] += 1;
        }
        let mut p = PerNode::sized(g, &count);
        for (owner, item) in pairs() {
            p.push(owner, item);
        }
        p
    }

    /// Empty lists with room for `count[id]` items under each node.
    fn sized(g: &Graph, count: &SideTable<u32>) -> PerNode {
        let mut p = PerNode {
            range: SideTable::new(g, (0, 0)),
            items: Vec::new(),
        };
        let mut at = 0u32;
        for &id in g.order() {
            p.range[id] = (at, at);
            at += count[id];
        }
        p.items = vec![NodeId::new(0); at as usize];
        p
    }

    /// Appends `item` to `owner`'s list, within the room [`PerNode::sized`] made.
    fn push(&mut self, owner: NodeId, item: NodeId) {
        let end = &mut self.range[owner].1;
        self.items[*end as usize] = item;
        *end += 1;
    }

    /// Sorts each node's list by node index.
    fn sort(&mut self, g: &Graph) {
        for &id in g.order() {
            let (lo, hi) = self.range[id];
            self.items[lo as usize..hi as usize].sort_unstable();
        }
    }

    pub fn get(&self, id: NodeId) -> &[NodeId] {
        match self.range.get(id) {
            Some(&(lo, hi)) => &self.items[lo as usize..hi as usize],
            None => &[],
        }
    }
}

// Neighbour lists come from passes over the edge list rather than each node's own edges,
// which would bring every node into the cache for the two edge indexes it holds. The graph
// keeps one edge per producer-consumer pair, so neighbours are already distinct.

/// Distinct consumers of each node, by node index.
pub fn users(g: &Graph) -> PerNode {
    let mut p = PerNode::from_pairs(g, || g.edges());
    p.sort(g);
    p
}

/// Distinct producers of each node and distinct consumers of each node, by node index: both
/// from the same two passes over the edge list.
pub fn inputs_and_users(g: &Graph) -> (PerNode, PerNode) {
    let mut fan_in: SideTable<u32> = SideTable::new(g, 0);
    let mut fan_out: SideTable<u32> = SideTable::new(g, 0);
    for (source, target) in g.edges() {
        fan_in[target] += 1;
        fan_out[source] += 1;
    }
    let (mut inputs, mut users) = (PerNode::sized(g, &fan_in), PerNode::sized(g, &fan_out));
    for (source, target) in g.edges() {
        inputs.push(target, source);
        users.push(source, target);
    }
    inputs.sort(g);
    users.sort(g);
    (inputs, users)
}
