//! Programs: the graphs of one training step in execution order.

use crate::Graph;
use std::collections::{BTreeMap, BTreeSet};

/// How the document was written: a single `fx-graph` or an `fx-program` bundle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Form {
    #[default]
    Graph,
    Bundle,
}

#[derive(Clone, Debug, Default)]
pub struct Program {
    /// Forward graphs, then backward graphs, in the order they run.
    pub graphs: Vec<Graph>,
    pub form: Form,
}

impl Program {
    pub fn single(graph: Graph) -> Program {
        Program {
            graphs: vec![graph],
            form: Form::Graph,
        }
    }

    pub fn bundle(graphs: Vec<Graph>) -> Program {
        Program {
            graphs,
            form: Form::Bundle,
        }
    }

    /// Each parameter name with the (graph, param) positions that carry it, by name.
    pub fn params_by_name(&self) -> BTreeMap<&str, Vec<(usize, usize)>> {
        let mut out: BTreeMap<&str, Vec<(usize, usize)>> = BTreeMap::new();
        for (gi, g) in self.graphs.iter().enumerate() {
            for (pi, p) in g.params.iter().enumerate() {
                out.entry(p.name.as_str()).or_default().push((gi, pi));
            }
        }
        out
    }

    /// Parameters kept unsharded: persistent in any graph, as a parameter or on a gradient.
    pub fn persistent(&self) -> BTreeSet<String> {
        self.graphs
            .iter()
            .flat_map(Graph::persistent_names)
            .map(str::to_owned)
            .collect()
    }

    pub fn node_count(&self) -> usize {
        self.graphs.iter().map(Graph::len).sum()
    }
}
