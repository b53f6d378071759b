//! The rewrite stage (docs/design.md §3, pass 2): equational rewrites over the communication ops,
//! after insertion and before scheduling.
//!
//! It builds an e-graph over the terms that connect each gathered parameter to its real uses
//! (gathers, waits, and the view and cast chains between; see [`build`]), saturates it with the
//! named rules of [`rules`], extracts one form per e-class by a cost in communicated bytes and
//! memory held across gaps ([`extract`]), and writes that form back ([`write`]). Rules:
//!
//! - `fuse-cast-into-gather`: a downcast that is the gathered storage's only real use becomes a
//!   gather in the smaller dtype (through any views between).
//! - `keep-instead-of-regather`: a segment's gather becomes the previous segment's buffer held
//!   across the gap, when the budget allows it ([`split::split_long_gaps`] makes segments).
//! - `canonical-alias-chain`: `view(view(x))`, `t(t(x))`, `transpose(transpose(x))` and
//!   same-shape views collapse.
//!
//! Determinism: the term leaves are plain values (no interned symbols), egg's tables hash with
//! a fixed hasher, the runner stops on iteration and node limits only (never on time), and every
//! map the stage itself iterates is ordered.

mod build;
mod extract;
mod inert;
mod lang;
mod rules;
pub mod split;
mod write;

use crate::ops::{self, CommOp};
use std::collections::{BTreeMap, BTreeSet};
use zerosched_ir::{Graph, Problem};

pub use rules::{CANONICAL, FUSE_CAST, KEEP};

/// What the stage may do.
#[derive(Clone, Debug)]
pub struct RewriteOptions {
    /// Most bytes of gathered parameters alive at once, counted in program order: a buffer is
    /// held across a gap only while this holds.
    pub budget: u64,
    pub world_size: u32,
    /// Cost of one communicated byte.
    pub comm_weight: f64,
    /// Cost of one byte held across a gap instead of gathered again. Below `comm_weight`,
    /// keeping wins whenever it fits; above it, never.
    pub keep_weight: f64,
    /// Rules or rule families (`canonical-alias-chain`) not to run.
    pub disabled: BTreeSet<String>,
    /// Saturation limits. The runner stops on these only, never on time, so that the result
    /// does not depend on the machine's speed.
    pub iter_limit: usize,
    pub node_limit: usize,
}

impl Default for RewriteOptions {
    fn default() -> RewriteOptions {
        RewriteOptions {
            budget: u64::MAX,
            world_size: 8,
            comm_weight: 1.0,
            keep_weight: 0.25,
            disabled: BTreeSet::new(),
            iter_limit: 32,
            node_limit: 200_000,
        }
    }
}

/// What the stage did to one graph.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RewriteReport {
    /// Rule name → times it added an equality during saturation (whether or not extraction
    /// then chose the result).
    pub fired: BTreeMap<String, usize>,
    /// Gathers now made in a smaller dtype in place of a cast.
    pub casts_fused: usize,
    /// Gathers removed because an earlier segment's buffer is held instead.
    pub regathers_removed: usize,
    /// View, `t` and `transpose` nodes on gathered chains, before and after.
    pub alias_nodes_before: usize,
    pub alias_nodes_after: usize,
    /// Gathered bytes over all gathers of the graph (padded full sizes), before and after.
    pub comm_bytes_before: u64,
    pub comm_bytes_after: u64,
    /// Bytes held across gaps instead of gathered again, summed over the gaps.
    pub kept_bytes: u64,
    /// Whether saturation reached a fixed point (rather than a limit).
    pub saturated: bool,
}

impl RewriteReport {
    pub fn comm_bytes_saved(&self) -> u64 {
        self.comm_bytes_before.saturating_sub(self.comm_bytes_after)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    #[error("unknown rewrite rule `{name}` (known: {known})")]
    UnknownRule { name: String, known: String },
    #[error("cost weights must be finite and non-negative (comm {comm}, keep {keep})")]
    BadWeights { comm: f64, keep: f64 },
    #[error("graph `{graph}`: {problem}")]
    Graph { graph: String, problem: Problem },
    #[error("graph `{graph}`: the rewrite plan does not match the graph (a bug in the stage)")]
    Inconsistent { graph: String },
}

fn comm_bytes(g: &Graph, world: u32) -> u64 {
    let params = ops::ParamIndex::new(g);
    g.nodes()
        .filter(|(_, n)| CommOp::of(n) == Some(CommOp::AllGather))
        .map(|(id, _)| params.gathered_bytes(g, id, world).unwrap_or(0))
        .fold(0, u64::saturating_add)
}

/// Runs the stage on `g`, a graph after insertion (and, optionally, gap splitting).
pub fn rewrite(g: &mut Graph, opts: &RewriteOptions) -> Result<RewriteReport, RewriteError> {
    let known = rules::known_names();
    if let Some(bad) = opts.disabled.iter().find(|d| !known.contains(d)) {
        return Err(RewriteError::UnknownRule {
            name: bad.clone(),
            known: known.join(", "),
        });
    }
    let finite = |w: f64| w.is_finite() && w >= 0.0;
    if !finite(opts.comm_weight) || !finite(opts.keep_weight) {
        return Err(RewriteError::BadWeights {
            comm: opts.comm_weight,
            keep: opts.keep_weight,
        });
    }
    let scope = build::scope(g);
    if inert::unchanged(g, &scope, opts) {
        return Ok(untouched(g, opts));
    }
    saturate(g, scope, opts)
}

/// What the stage reports on a graph it leaves as it is.
fn untouched(g: &Graph, opts: &RewriteOptions) -> RewriteReport {
    let bytes = comm_bytes(g, opts.world_size);
    RewriteReport {
        comm_bytes_before: bytes,
        comm_bytes_after: bytes,
        saturated: true,
        ..RewriteReport::default()
    }
}

/// The stage proper: build the e-graph over `scope`, saturate, extract, write back.
fn saturate(
    g: &mut Graph,
    scope: build::Scope,
    opts: &RewriteOptions,
) -> Result<RewriteReport, RewriteError> {
    let mut report = untouched(g, opts);
    let mut built = build::build(g, scope, opts.budget, opts.world_size);
    if built.roots.is_empty() {
        return Ok(report);
    }
    let rules: Vec<_> = rules::all()
        .into_iter()
        .filter(|r| !rules::is_disabled(r.name.as_str(), &opts.disabled))
        .collect();
    let runner = egg::Runner::default()
        .with_egraph(built.egraph)
        .with_iter_limit(opts.iter_limit)
        .with_node_limit(opts.node_limit)
        .with_time_limit(std::time::Duration::MAX)
        .with_scheduler(egg::SimpleScheduler)
        .run(&rules);
    report.saturated = matches!(runner.stop_reason, Some(egg::StopReason::Saturated));
    for it in &runner.iterations {
        for (name, n) in &it.applied {
            *report.fired.entry(name.to_string()).or_default() += n;
        }
    }
    built.egraph = runner.egraph;
    let plan = extract::decide(&built, opts.budget, opts.comm_weight, opts.keep_weight);
    let graph = g.label().to_owned();
    let effects = write::write_back(g, &built, &plan).map_err(|f| match f {
        write::Failure::Graph(problem) => RewriteError::Graph {
            graph: graph.clone(),
            problem,
        },
        write::Failure::Inconsistent => RewriteError::Inconsistent {
            graph: graph.clone(),
        },
    })?;
    report.casts_fused = effects.casts_fused;
    report.regathers_removed = effects.regathers_removed;
    report.alias_nodes_before = effects.alias_nodes_before;
    report.alias_nodes_after = effects.alias_nodes_after;
    report.kept_bytes = plan.kept.values().fold(0, |a, &b| a.saturating_add(b));
    report.comm_bytes_after = comm_bytes(g, opts.world_size);
    Ok(report)
}
