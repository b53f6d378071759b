//! Short lists per node (inputs, users, alias sources, class members) kept in one flat array,
//! so an analysis of a 100,000-node graph makes a handful of allocations, not one per node.

use petgraph::Direction;
use petgraph::visit::{EdgeRef, IntoEdgeReferences};
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
        for (owner, item) in pairs() {
            let end = &mut p.range[owner].1;
            p.items[*end as usize] = item;
            *end += 1;
        }
        p
    }

    pub fn get(&self, id: NodeId) -> &[NodeId] {
        match self.range.get(id) {
            Some(&(lo, hi)) => &self.items[lo as usize..hi as usize],
            None => &[],
        }
    }
}

/// Distinct producers of each node, by node index.
pub fn inputs(g: &Graph) -> PerNode {
    neighbors(g, Direction::Incoming)
}

/// Distinct consumers of each node, by node index.
pub fn users(g: &Graph) -> PerNode {
    neighbors(g, Direction::Outgoing)
}

fn neighbors(g: &Graph, dir: Direction) -> PerNode {
    // From one pass over the edge list rather than each node's own edges, which would bring
    // every node into the cache for the two edge indexes it holds. The graph keeps one edge
    // per producer-consumer pair, so neighbours are already distinct.
    let mut p = PerNode::from_pairs(g, || {
        g.dag().edge_references().map(|e| match dir {
            Direction::Incoming => (e.target(), e.source()),
            Direction::Outgoing => (e.source(), e.target()),
        })
    });
    for &id in g.order() {
        let (lo, hi) = p.range[id];
        p.items[lo as usize..hi as usize].sort_unstable();
    }
    p
}
