//! What `zerosched schedule` and `zerosched simulate` print and write: per graph, what the
//! passes did and how the schedule performs in the two-stream simulation.

use serde::Serialize;
use std::fmt::Write;
use zerosched_ir::Program;
use zerosched_passes::pipeline::Context;
use zerosched_passes::simulate::{ProgramSim, SimOptions, Summary, simulate_program};

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub input: String,
    /// `None` for `simulate`, which runs no scheduler.
    pub scheduler: Option<String>,
    pub world_size: u32,
    /// `None` when no budget was given.
    pub budget_bytes: Option<u64>,
    /// The device-memory budget; `None` when none was given.
    pub memory_bytes: Option<u64>,
    /// Per graph and in total: the simulation of the program as it stands.
    pub simulation: ProgramSim,
    /// Releases per graph (the simulation counts gathers, buckets and reductions).
    pub releases: Vec<usize>,
    /// Parameters kept gathered from the forward to the backward.
    pub kept: Vec<String>,
}

impl Report {
    pub fn new(
        input: &str,
        p: &Program,
        cx: Option<&Context>,
        scheduler: Option<&str>,
        budgets: (u64, u64),
        sim: &SimOptions,
    ) -> Report {
        let (budget, memory) = budgets;
        let releases = p
            .graphs
            .iter()
            .map(|g| {
                g.nodes()
                    .filter(|(_, n)| n.target == zerosched_ir::comm::RELEASE)
                    .count()
            })
            .collect();
        Report {
            input: input.to_owned(),
            scheduler: scheduler.map(str::to_owned),
            world_size: sim.world_size,
            budget_bytes: (budget != u64::MAX).then_some(budget),
            memory_bytes: (memory != u64::MAX).then_some(memory),
            simulation: simulate_program(p, sim),
            releases,
            kept: cx.map(|c| c.keep.kept.clone()).unwrap_or_default(),
        }
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let budget = self
            .budget_bytes
            .map_or("none".to_owned(), crate::summary::bytes);
        let scheduler = self.scheduler.as_deref().unwrap_or("as given");
        let memory = self
            .memory_bytes
            .map(|m| format!(", memory {}", crate::summary::bytes(m)))
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "{}: scheduler {scheduler}, world size {}, budget {budget}{memory}",
            self.input, self.world_size
        );
        let rows: Vec<(&str, &str, usize, &Summary)> = self
            .simulation
            .graphs
            .iter()
            .zip(&self.releases)
            .map(|(g, &r)| (g.graph.as_str(), g.kind, r, &g.summary))
            .collect();
        let total_label = format!("total ({} graphs)", rows.len());
        let width = rows
            .iter()
            .map(|r| r.0.len())
            .chain([5, total_label.len()])
            .max()
            .unwrap_or(5);
        let _ = writeln!(
            s,
            "{:<width$}  {:<8} {:>7} {:>7} {:>8} {:>7} {:>13} {:>10} {:>10} {:>6} {:>10}",
            "graph",
            "kind",
            "gathers",
            "buckets",
            "releases",
            "reduces",
            "peak gathered",
            "step ms",
            "bound ms",
            "ratio",
            "exposed ms"
        );
        let mut line = |name: &str, kind: &str, releases: usize, m: &Summary| {
            let _ = writeln!(
                s,
                "{:<width$}  {:<8} {:>7} {:>7} {:>8} {:>7} {:>13} {:>10.3} {:>10.3} {:>6.3} {:>10.3}",
                name,
                kind,
                m.gathers,
                m.buckets,
                releases,
                m.reductions,
                crate::summary::bytes(m.peak_gathered_bytes),
                m.step_ms,
                m.lower_bound_ms,
                m.ratio,
                m.exposed_comm_ms
            );
        };
        for (name, kind, releases, m) in &rows {
            line(name, kind, *releases, m);
        }
        if rows.len() > 1 {
            line(
                &total_label,
                "",
                self.releases.iter().sum(),
                &self.simulation.total,
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
