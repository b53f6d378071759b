//! What `zerosched schedule` prints and writes: per graph, what the passes did and how the
//! schedule performs.

use serde::Serialize;
use std::fmt::Write;
use zerosched_ir::Program;
use zerosched_passes::pipeline::{Context, PipelineOptions};

#[derive(Clone, Debug, Serialize)]
pub struct GraphRow {
    pub graph: String,
    pub kind: &'static str,
    pub nodes: usize,
    pub gathers: usize,
    pub buckets: usize,
    pub releases: usize,
    pub reductions: usize,
    pub peak_gathered_bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub input: String,
    pub scheduler: String,
    pub world_size: u32,
    /// `None` when no budget was given.
    pub budget_bytes: Option<u64>,
    pub graphs: Vec<GraphRow>,
    pub kept: Vec<String>,
}

impl Report {
    pub fn new(input: &str, p: &Program, cx: &Context, opts: &PipelineOptions) -> Report {
        let graphs = p
            .graphs
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let r = cx.graphs.get(i).cloned().unwrap_or_default();
                GraphRow {
                    graph: g.label().to_owned(),
                    kind: g.kind.name(),
                    nodes: g.len(),
                    gathers: r.schedule.gathers,
                    buckets: r.schedule.buckets,
                    releases: r.schedule.releases,
                    reductions: r.schedule.reductions,
                    peak_gathered_bytes: r.schedule.peak_gathered,
                }
            })
            .collect();
        let budget = opts.schedule.budget;
        Report {
            input: input.to_owned(),
            scheduler: opts.scheduler.clone(),
            world_size: opts.schedule.world_size,
            budget_bytes: (budget != u64::MAX).then_some(budget),
            graphs,
            kept: cx.keep.kept.clone(),
        }
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let budget = self
            .budget_bytes
            .map_or("none".to_owned(), crate::summary::bytes);
        let _ = writeln!(
            s,
            "{}: scheduler {}, world size {}, budget {budget}",
            self.input, self.scheduler, self.world_size
        );
        let width = self
            .graphs
            .iter()
            .map(|r| r.graph.len())
            .chain([5])
            .max()
            .unwrap_or(5);
        let _ = writeln!(
            s,
            "{:<width$}  {:<9} {:>7} {:>7} {:>7} {:>8} {:>7} {:>12}",
            "graph", "kind", "nodes", "gathers", "buckets", "releases", "reduces", "peak gathered"
        );
        for r in &self.graphs {
            let _ = writeln!(
                s,
                "{:<width$}  {:<9} {:>7} {:>7} {:>7} {:>8} {:>7} {:>12}",
                r.graph,
                r.kind,
                r.nodes,
                r.gathers,
                r.buckets,
                r.releases,
                r.reductions,
                crate::summary::bytes(r.peak_gathered_bytes)
            );
        }
        if !self.kept.is_empty() {
            let _ = writeln!(
                s,
                "kept gathered from forward to backward: {} parameters",
                self.kept.len()
            );
        }
        s
    }

    pub fn to_json(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec_pretty(self).unwrap_or_default();
        out.push(b'\n');
        out
    }
}
