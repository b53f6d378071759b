//! What `zerosched check` prints: per graph, its size and the bytes it holds.

use std::fmt::Write;
use zerosched_ir::{Graph, NodeId, Op, Program};

/// Size figures of one graph.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GraphSummary {
    pub name: String,
    pub kind: &'static str,
    pub nodes: usize,
    pub params: usize,
    /// Full (unsharded) bytes of the graph's parameters.
    pub param_bytes: u64,
    /// Bytes of the values the graph returns, parameters and gradients excluded: for a
    /// forward graph, its results and the activations it saves for the backward.
    pub activation_bytes: u64,
}

impl GraphSummary {
    pub fn of(g: &Graph) -> GraphSummary {
        let grad_slots: Vec<u32> = g.grads.iter().map(|gr| gr.output_index).collect();
        let mut activation_bytes = 0u64;
        for (i, v) in g.output_values().iter().enumerate() {
            let Some(&id) = v.as_node() else { continue };
            if grad_slots.contains(&(i as u32)) || is_param(g, id) {
                continue;
            }
            let bytes = g
                .node(id)
                .meta
                .val
                .as_ref()
                .and_then(|v| v.nbytes())
                .unwrap_or(0);
            activation_bytes = activation_bytes.saturating_add(bytes);
        }
        GraphSummary {
            name: g.label().to_owned(),
            kind: g.kind.name(),
            nodes: g.len(),
            params: g.params.len(),
            param_bytes: g
                .params
                .iter()
                .filter_map(|p| p.nbytes())
                .fold(0, u64::saturating_add),
            activation_bytes,
        }
    }
}

fn is_param(g: &Graph, id: NodeId) -> bool {
    g.node(id).op == Op::Placeholder && g.param_of(id).is_some()
}

/// The table `zerosched check` prints, with a total row for programs of several graphs.
pub fn table(p: &Program) -> String {
    let rows: Vec<GraphSummary> = p.graphs.iter().map(GraphSummary::of).collect();
    let distinct_params = p.params_by_name();
    let distinct_bytes: u64 = distinct_params
        .values()
        .filter_map(|places| places.first())
        .filter_map(|&(g, i)| p.graphs[g].params[i].nbytes())
        .fold(0, u64::saturating_add);
    let total_label = format!("total ({} graphs)", rows.len());
    let width = rows
        .iter()
        .map(|r| r.name.len())
        .chain([5, total_label.len()])
        .max()
        .unwrap_or(5);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<width$}  {:<9} {:>8} {:>7} {:>12} {:>12}",
        "graph", "kind", "nodes", "params", "param bytes", "activations"
    );
    for r in &rows {
        let _ = writeln!(
            s,
            "{:<width$}  {:<9} {:>8} {:>7} {:>12} {:>12}",
            r.name,
            r.kind,
            r.nodes,
            r.params,
            bytes(r.param_bytes),
            bytes(r.activation_bytes)
        );
    }
    if rows.len() > 1 {
        let nodes: usize = rows.iter().map(|r| r.nodes).sum();
        let act = rows
            .iter()
            .map(|r| r.activation_bytes)
            .fold(0, u64::saturating_add);
        let _ = writeln!(
            s,
            "{:<width$}  {:<9} {:>8} {:>7} {:>12} {:>12}",
            total_label,
            "",
            nodes,
            distinct_params.len(),
            bytes(distinct_bytes),
            bytes(act)
        );
    }
    s
}

/// Bytes in binary units: `1.5 GiB`.
pub fn bytes(n: u64) -> String {
    bytesize::ByteSize(n).display().iec().to_string()
}
