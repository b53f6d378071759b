//! Per-node facts computed by analyses, kept beside the graph rather than in its nodes
//! (Cranelift's `SecondaryMap`).

use crate::{Graph, NodeId};
use std::ops::{Index, IndexMut};

#[derive(Clone, Debug, PartialEq, Default)]
pub struct SideTable<T> {
    data: Vec<T>,
}

impl<T: Clone> SideTable<T> {
    /// A table sized for every node of `graph`, each entry `default`.
    pub fn new(graph: &Graph, default: T) -> SideTable<T> {
        SideTable {
            data: vec![default; graph.node_bound()],
        }
    }

    /// Grows the table to cover nodes added since it was made.
    pub fn resize(&mut self, graph: &Graph, default: T) {
        if self.data.len() < graph.node_bound() {
            self.data.resize(graph.node_bound(), default);
        }
    }
}

impl<T> SideTable<T> {
    pub fn get(&self, id: NodeId) -> Option<&T> {
        self.data.get(id.index())
    }
}

impl<T> Index<NodeId> for SideTable<T> {
    type Output = T;
    fn index(&self, id: NodeId) -> &T {
        &self.data[id.index()]
    }
}

impl<T> IndexMut<NodeId> for SideTable<T> {
    fn index_mut(&mut self, id: NodeId) -> &mut T {
        &mut self.data[id.index()]
    }
}
