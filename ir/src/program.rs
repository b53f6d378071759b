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
    /// The document's own list of the program's persistent parameters (its top-level
    /// `persistent`), beside what each graph flags: a graph written alone, or one that
    /// carries neither the parameter nor its gradient, still has the program's word.
    pub persistent_list: BTreeSet<String>,
}

impl Program {
    pub fn single(graph: Graph) -> Program {
        Program {
            graphs: vec![graph],
            form: Form::Graph,
            persistent_list: BTreeSet::new(),
        }
    }

    pub fn bundle(graphs: Vec<Graph>) -> Program {
        Program {
            graphs,
            form: Form::Bundle,
            persistent_list: BTreeSet::new(),
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

    /// Parameters kept unsharded: in the program's list, or persistent in any graph, as a
    /// parameter or on a gradient.
    pub fn persistent(&self) -> BTreeSet<String> {
        let mut all = self.persistent_list.clone();
        all.extend(
            self.graphs
                .iter()
                .flat_map(Graph::persistent_names)
                .map(str::to_owned),
        );
        all
    }

    pub fn node_count(&self) -> usize {
        self.graphs.iter().map(Graph::len).sum()
    }
}
