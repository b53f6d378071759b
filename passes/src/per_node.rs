//! Short lists per node (inputs, users, alias sources, class members) kept in one flat array,
//! so an analysis of a 100,000-node graph makes a handful of allocations, not one per node.

use petgraph::Direction;
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
        let mut count: SideTable<u32> = SideTable::new(g, 0);
        for &id in g.order() {
            if let Some(k) = key(id) {
                count[k] += 1;
            }
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
        for &id in g.order() {
            if let Some(k) = key(id) {
                let end = &mut p.range[k].1;
                p.items[*end as usize] = id;
                *end += 1;
            }
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
    // The graph keeps one edge per producer-consumer pair, so neighbours are already distinct.
    PerNode::build(g, |id, out| {
        let lo = out.len();
        out.extend(g.dag().neighbors_directed(id, dir));
        out[lo..].sort_unstable();
    })
}
