//! Graphs assembled from their chunks of nodes while later chunks are still being decoded.
//!
//! Adding nodes to a graph is sequential (each name goes into the name index, each reference
//! becomes an edge), and a training step's backward graph holds most of the nodes. Instead of
//! decoding every chunk first and then building each graph on one core while the others wait,
//! each decoded chunk is offered to its graph's [`Assembly`]: whichever thread finds the graph
//! free adds every chunk that is next in order, and the other threads go on decoding. A chunk
//! offered while the graph is busy waits for the thread that holds it, or for [`Assembly::finish`],
//! which adds whatever is left once every chunk has been decoded; so none is ever stranded.

use crate::{Graph, Node};
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// One graph under construction.
pub(super) struct Assembly {
    /// Decoded chunks not yet added, by chunk index.
    waiting: Mutex<BTreeMap<usize, Vec<Node>>>,
    building: Mutex<Building>,
    chunks: usize,
}

struct Building {
    graph: Graph,
    /// The index of the chunk to add next.
    next: usize,
    /// A node was refused: the careful path must read the document.
    refused: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks has already failed the whole import.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Assembly {
    /// An empty `graph` that `chunks` chunks will fill, with room for `nodes` nodes.
    pub(super) fn new(mut graph: Graph, chunks: usize, nodes: usize) -> Assembly {
        // Training-step graphs read about two producers per node.
        graph.reserve(nodes, 2 * nodes);
        Assembly {
            waiting: Mutex::new(BTreeMap::new()),
            building: Mutex::new(Building {
                graph,
                next: 0,
                refused: false,
            }),
            chunks,
        }
    }

    /// Chunk `index`, decoded: added now if it is next and the graph is free, else later.
    pub(super) fn offer(&self, index: usize, nodes: Vec<Node>) {
        lock(&self.waiting).insert(index, nodes);
        if let Ok(mut b) = self.building.try_lock() {
            b.add_ready(&self.waiting);
        }
    }

    /// The graph with every chunk added, or `None` if a node was refused or a chunk is
    /// missing.
    pub(super) fn finish(self) -> Option<Graph> {
        let mut b = self
            .building
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        b.add_ready(&self.waiting);
        (!b.refused && b.next == self.chunks).then_some(b.graph)
    }
}

impl Building {
    /// Adds chunks while the next one in order has been decoded.
    fn add_ready(&mut self, waiting: &Mutex<BTreeMap<usize, Vec<Node>>>) {
        while !self.refused {
            let Some(nodes) = lock(waiting).remove(&self.next) else {
                return;
            };
            self.next += 1;
            for node in nodes {
                if !self.add(node) {
                    self.refused = true;
                    return;
                }
            }
        }
    }

    /// Adds one node whose references all name earlier nodes; whether it was taken.
    fn add(&mut self, node: Node) -> bool {
        let g = &mut self.graph;
        // That no reference names an output is the verifier's one check of a node that needs
        // the others. All nodes but the last usually come before any output.
        if !g.outputs().is_empty() {
            let mut to_output = false;
            node.for_each_ref(|r| to_output |= g.outputs().contains(r));
            if to_output {
                return false;
            }
        }
        g.push(node).is_ok()
    }
}
