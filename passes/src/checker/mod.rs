//! The schedule checker: proves a scheduled graph keeps the guarantees of docs/format.md
//! ("Inserted ops"), independently of every pass that made it (regalloc2's `checker.rs` is the
//! model). It shares nothing with the passes but the IR crate, so a bug in their alias analysis
//! or liveness cannot vouch for itself here.
//!
//! Every check is one linear walk over the nodes and their references, without recursion on
//! graph depth; every violation is collected with its place. The one exception is the
//! device-memory budget: what is live at a moment depends on the timing of both streams, so it
//! is checked by the simulator (`crate::simulate`), the one definition of that figure the
//! schedulers and the report share.

mod across;
mod buckets;
mod gathers;
mod grads;
mod memory;
mod order;
mod storage;
mod violation;

pub use violation::{Located, Violation, Violations};

use rayon::prelude::*;
use std::collections::BTreeSet;
use zerosched_ir::{Graph, Location, NodeId, Program, SideTable};

/// What the checked schedule must respect.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// Most bytes of gathered parameters alive at once, replayed in program order.
    pub budget: u64,
    /// Most bytes alive at once, everything counted, simulated; `u64::MAX` for no limit.
    pub memory: u64,
    pub world_size: u32,
    /// The cost model the memory simulation times the streams with.
    pub cost: crate::cost::CostModel,
}

impl Default for CheckOptions {
    fn default() -> CheckOptions {
        CheckOptions {
            budget: u64::MAX,
            memory: u64::MAX,
            world_size: 8,
            cost: crate::cost::CostModel::default(),
        }
    }
}

/// What a graph that passed does.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CheckReport {
    pub graph: String,
    pub gathers: usize,
    /// Reuses of buffers an earlier graph kept.
    pub reuses: usize,
    pub releases: usize,
    pub keeps: usize,
    /// Distinct `bucket` ids among the gathers.
    pub buckets: usize,
    pub reductions: usize,
    /// Distinct `bucket` ids among the reductions.
    pub reduce_buckets: usize,
    /// Peak gathered bytes in the program-order replay.
    pub peak_gathered: u64,
    /// Parameters whose gathered value the output returns (never released), by gather.
    pub escaped: Vec<String>,
}

/// Checks one graph. Persistence is as the graph itself declares it; whether its keeps and
/// reuses pair up across graphs is for [`check_program`].
pub fn check_graph(g: &Graph, opts: &CheckOptions) -> Result<CheckReport, Violations> {
    let persistent = g.persistent_names().map(str::to_owned).collect();
    let mut out = Vec::new();
    let report = check_into(g, opts, &persistent, &mut out);
    if out.is_empty() {
        Ok(report)
    } else {
        Err(Violations(out))
    }
}

/// Checks every graph of a program; a parameter persistent in any graph is persistent in all.
pub fn check_program(p: &Program, opts: &CheckOptions) -> Result<Vec<CheckReport>, Violations> {
    let persistent = p.persistent();
    // One task per graph; violations in graph order whichever finishes first.
    let checked: Vec<(CheckReport, Vec<Located>)> = p
        .graphs
        .par_iter()
        .map(|g| {
            let mut found = Vec::new();
            let report = check_into(g, opts, &persistent, &mut found);
            (report, found)
        })
        .collect();
    let mut out = Vec::new();
    let mut reports = Vec::with_capacity(checked.len());
    for (report, found) in checked {
        reports.push(report);
        out.extend(found);
    }
    across::check(p, &mut out);
    if out.is_empty() {
        Ok(reports)
    } else {
        Err(Violations(out))
    }
}

fn check_into(
    g: &Graph,
    opts: &CheckOptions,
    persistent: &BTreeSet<String>,
    out: &mut Vec<Located>,
) -> CheckReport {
    let mut cx = Ctx::new(g, persistent, out);
    order::check(&mut cx);
    let gathers = gathers::check(&mut cx);
    let reductions = grads::check(&mut cx);
    let peak_gathered = memory::check(&mut cx, &gathers, opts);
    memory::check_device(&mut cx, opts);
    CheckReport {
        graph: g.label().to_owned(),
        gathers: gathers.list.iter().filter(|x| !x.reuse).count(),
        reuses: gathers.list.iter().filter(|x| x.reuse).count(),
        releases: gathers.releases,
        keeps: gathers.keeps,
        buckets: gathers.buckets,
        reductions: reductions.count,
        reduce_buckets: reductions.buckets,
        peak_gathered,
        escaped: gathers
            .list
            .iter()
            .filter(|x| x.escaped)
            .map(|x| x.param.clone())
            .collect(),
    }
}

/// What every rule needs: the graph, positions, and where violations go.
struct Ctx<'a> {
    g: &'a Graph,
    pos: SideTable<usize>,
    /// Index into `g.params` of the parameter each placeholder carries.
    param_at: SideTable<Option<usize>>,
    persistent: &'a BTreeSet<String>,
    out: &'a mut Vec<Located>,
}

impl<'a> Ctx<'a> {
    fn new(g: &'a Graph, persistent: &'a BTreeSet<String>, out: &'a mut Vec<Located>) -> Ctx<'a> {
        let mut param_at = SideTable::new(g, None);
        for (i, p) in g.params.iter().enumerate() {
            if g.get(p.node).is_some() {
                param_at[p.node] = Some(i);
            }
        }
        Ctx {
            g,
            pos: g.positions(),
            param_at,
            persistent,
            out,
        }
    }

    fn name(&self, id: NodeId) -> String {
        self.g.node(id).name.to_string()
    }

    fn pos(&self, id: NodeId) -> usize {
        self.pos.get(id).copied().unwrap_or(usize::MAX)
    }

    fn at(&mut self, id: NodeId, violation: Violation) {
        let location = Location::node(self.g.label(), &self.g.node(id).name);
        self.out.push(Located {
            location,
            violation,
        });
    }

    fn at_graph(&mut self, violation: Violation) {
        let location = Location::graph(self.g.label());
        self.out.push(Located {
            location,
            violation,
        });
    }

    fn at_field(&mut self, id: NodeId, field: impl Into<String>, violation: Violation) {
        let location = Location::field(self.g.label(), &self.g.node(id).name, field);
        self.out.push(Located {
            location,
            violation,
        });
    }

    fn sharded(&self, param: &zerosched_ir::Param) -> bool {
        !param.persistent && !self.persistent.contains(&param.name)
    }
}
