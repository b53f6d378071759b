//! A graph's name index: node name to handle, without a second copy of each name.
//!
//! The table holds only handles; a name is compared against the node it belongs to, so adding
//! a node allocates nothing here. Lookups only: iteration order never reaches any output, so a
//! randomly seeded hash is safe for determinism and keeps hostile names from colliding.

use crate::{Node, NodeId};
use hashbrown::{DefaultHashBuilder, HashTable};
use petgraph::stable_graph::StableDiGraph;
use std::hash::BuildHasher;

type Dag = StableDiGraph<Node, (), u32>;

#[derive(Clone, Debug, Default)]
pub(crate) struct Names {
    table: HashTable<NodeId>,
    hasher: DefaultHashBuilder,
}

impl Names {
    pub(crate) fn hash(&self, name: &str) -> u64 {
        self.hasher.hash_one(name)
    }

    /// The node named `name`, given its [`Names::hash`].
    pub(crate) fn find(&self, hash: u64, name: &str, dag: &Dag) -> Option<NodeId> {
        self.table
            .find(hash, |&id| dag[id.ix()].name == name)
            .copied()
    }

    pub(crate) fn get(&self, name: &str, dag: &Dag) -> Option<NodeId> {
        self.find(self.hash(name), name, dag)
    }

    /// Indexes node `id`, already in `dag`, whose name hashes to `hash` and is not taken.
    pub(crate) fn insert(&mut self, hash: u64, id: NodeId, dag: &Dag) {
        let hasher = &self.hasher;
        self.table.insert_unique(hash, id, |&other| {
            hasher.hash_one(dag[other.ix()].name.as_str())
        });
    }

    /// Forgets node `id`, named `name` (the node itself may already be gone from the graph).
    pub(crate) fn remove(&mut self, name: &str, id: NodeId) {
        if let Ok(entry) = self.table.find_entry(self.hash(name), |&other| other == id) {
            entry.remove();
        }
    }

    pub(crate) fn reserve(&mut self, additional: usize, dag: &Dag) {
        let hasher = &self.hasher;
        self.table.reserve(additional, |&id| {
            hasher.hash_one(dag[id.ix()].name.as_str())
        });
    }
}
