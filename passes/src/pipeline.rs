//! The pass manager (rustc's MIR pass manager is the model): each pass is named, says which
//! facts it needs and which it gives, may be switched off, and is followed by the structural
//! verifier when verification is on (debug builds and every test). `--dump-after PASS` keeps
//! the program as that pass left it.

use crate::insert::{InsertReport, insert};
use crate::keep::{KeepReport, keep_across};
use crate::schedule::{ScheduleError, ScheduleOptions, ScheduleReport, by_name};
use rayon::prelude::*;
use std::collections::BTreeSet;
use zerosched_ir::{Diagnostics, Graph, Problem, Program};

/// What holds of a program after a pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fact {
    /// The ZeRO-3 ops are in.
    Inserted,
    /// A scheduler chose the program order.
    Scheduled,
}

#[derive(Clone, Debug)]
pub struct PipelineOptions {
    pub schedule: ScheduleOptions,
    /// The scheduler `schedule` uses (see `schedule::NAMES`).
    pub scheduler: String,
    /// Passes switched off by name.
    pub disabled: BTreeSet<String>,
    /// Passes after which to keep a copy of the program.
    pub dump_after: BTreeSet<String>,
    /// Run the verifier after every pass.
    pub verify: bool,
}

impl Default for PipelineOptions {
    fn default() -> PipelineOptions {
        PipelineOptions {
            schedule: ScheduleOptions::default(),
            scheduler: "prefetch".to_owned(),
            disabled: BTreeSet::new(),
            dump_after: BTreeSet::new(),
            verify: cfg!(debug_assertions),
        }
    }
}

/// Per graph, what the passes did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GraphReport {
    pub name: String,
    pub insert: InsertReport,
    pub rewrite: crate::rewrite::RewriteReport,
    pub schedule: ScheduleReport,
}

/// What a pipeline run produced besides the program itself.
#[derive(Clone, Debug, Default)]
pub struct Context {
    pub graphs: Vec<GraphReport>,
    pub keep: KeepReport,
    /// `(pass, program)` for each pass named in `dump_after`.
    pub dumps: Vec<(String, Program)>,
}

#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("pass `{pass}` needs {fact:?}, which no earlier pass gave (was a pass switched off?)")]
    MissingFact { pass: &'static str, fact: Fact },
    #[error("unknown scheduler `{0}`")]
    UnknownScheduler(String),
    #[error("graph `{graph}`: {problem}")]
    Graph { graph: String, problem: Problem },
    #[error("graph `{graph}`: rewrite stage: {message}")]
    Rewrite { graph: String, message: String },
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error(
        "graph `{graph}`: the `{scheduler}` schedule holds {peak} bytes of gathered parameters, over the budget of {budget}"
    )]
    OverBudget {
        graph: String,
        scheduler: &'static str,
        peak: u64,
        budget: u64,
    },
    #[error("after pass `{pass}`, the program is invalid:\n{diagnostics}")]
    Invalid {
        pass: &'static str,
        diagnostics: Diagnostics,
    },
    #[error("after pass `{pass}`, the schedule checker rejects the program:\n{violations}")]
    Rejected {
        pass: &'static str,
        violations: crate::checker::Violations,
    },
}

pub trait Pass {
    fn name(&self) -> &'static str;
    fn needs(&self) -> &'static [Fact];
    fn gives(&self) -> &'static [Fact];
    fn is_enabled(&self, opts: &PipelineOptions) -> bool {
        !opts.disabled.contains(self.name())
    }
    fn run(
        &self,
        p: &mut Program,
        opts: &PipelineOptions,
        cx: &mut Context,
    ) -> Result<(), PassError>;
}

/// Inserts gathers, waits, releases and reductions into every graph.
pub struct Insert;

/// The egg stage: cast fusion, keep-instead-of-regather, canonical alias chains.
pub struct Rewrite;

/// Orders every graph with the chosen scheduler.
pub struct Schedule;

/// Keeps parameters gathered from the forward to the backward where the budget allows.
pub struct Keep;

impl Pass for Insert {
    fn name(&self) -> &'static str {
        "insert"
    }
    fn needs(&self) -> &'static [Fact] {
        &[]
    }
    fn gives(&self) -> &'static [Fact] {
        &[Fact::Inserted]
    }
    fn run(&self, p: &mut Program, _: &PipelineOptions, cx: &mut Context) -> Result<(), PassError> {
        // Persistence is a property of the parameter, whichever graph declares it.
        let persistent = p.persistent();
        let reports = each_graph(p, |g| {
            insert(g, &persistent).map_err(|problem| PassError::Graph {
                graph: g.label().to_owned(),
                problem,
            })
        })?;
        for (i, (g, report)) in p.graphs.iter().zip(reports).enumerate() {
            graph_report(cx, i, g.label()).insert = report;
        }
        Ok(())
    }
}

impl Pass for Rewrite {
    fn name(&self) -> &'static str {
        "rewrite"
    }
    fn needs(&self) -> &'static [Fact] {
        &[Fact::Inserted]
    }
    fn gives(&self) -> &'static [Fact] {
        &[]
    }
    fn run(
        &self,
        p: &mut Program,
        opts: &PipelineOptions,
        cx: &mut Context,
    ) -> Result<(), PassError> {
        let ro = crate::rewrite::RewriteOptions {
            budget: opts.schedule.budget,
            world_size: opts.schedule.world_size,
            ..crate::rewrite::RewriteOptions::default()
        };
        let reports = each_graph(p, |g| {
            crate::rewrite::rewrite(g, &ro).map_err(|e| PassError::Rewrite {
                graph: g.label().to_owned(),
                message: e.to_string(),
            })
        })?;
        for (i, (g, report)) in p.graphs.iter().zip(reports).enumerate() {
            graph_report(cx, i, g.label()).rewrite = report;
        }
        Ok(())
    }
}

impl Pass for Schedule {
    fn name(&self) -> &'static str {
        "schedule"
    }
    fn needs(&self) -> &'static [Fact] {
        &[Fact::Inserted]
    }
    fn gives(&self) -> &'static [Fact] {
        &[Fact::Scheduled]
    }
    fn run(
        &self,
        p: &mut Program,
        opts: &PipelineOptions,
        cx: &mut Context,
    ) -> Result<(), PassError> {
        let scheduler = by_name(&opts.scheduler)
            .ok_or_else(|| PassError::UnknownScheduler(opts.scheduler.clone()))?;
        let reports = each_graph(p, |g| {
            let report = scheduler.schedule(g, &opts.schedule)?;
            tracing::info!(
                scheduler = scheduler.name(),
                gathers = report.gathers,
                buckets = report.buckets,
                peak_gathered = report.peak_gathered,
                budget = opts.schedule.budget,
                "scheduled"
            );
            // A scheduler that does not plan for memory (deepcompile) may overrun the budget;
            // that is an error whether or not the checker runs.
            if report.peak_gathered > opts.schedule.budget {
                return Err(PassError::OverBudget {
                    graph: g.label().to_owned(),
                    scheduler: scheduler.name(),
                    peak: report.peak_gathered,
                    budget: opts.schedule.budget,
                });
            }
            Ok(report)
        })?;
        for (i, (g, report)) in p.graphs.iter().zip(reports).enumerate() {
            graph_report(cx, i, g.label()).schedule = report;
        }
        Ok(())
    }
}

impl Pass for Keep {
    fn name(&self) -> &'static str {
        "keep"
    }
    fn needs(&self) -> &'static [Fact] {
        &[Fact::Scheduled]
    }
    fn gives(&self) -> &'static [Fact] {
        &[]
    }
    fn run(
        &self,
        p: &mut Program,
        opts: &PipelineOptions,
        cx: &mut Context,
    ) -> Result<(), PassError> {
        cx.keep = keep_across(p, &opts.schedule);
        Ok(())
    }
}

/// Runs `f` on every graph of a program at once, one task per graph. Results come in graph
/// order, and of several failures the first graph's, so the outcome never depends on which
/// task finished first.
fn each_graph<R: Send>(
    p: &mut Program,
    f: impl Fn(&mut Graph) -> Result<R, PassError> + Send + Sync,
) -> Result<Vec<R>, PassError> {
    // Each task runs under the pass's span, and its own naming the graph, so that what a pass
    // reports (RUST_LOG) says which graph it is about.
    let pass = tracing::Span::current();
    let results: Vec<Result<R, PassError>> = p
        .graphs
        .par_iter_mut()
        .map(|g| {
            let span = tracing::info_span!(parent: &pass, "graph", graph = g.label());
            let _entered = span.enter();
            f(g)
        })
        .collect();
    results.into_iter().collect()
}

fn graph_report<'a>(cx: &'a mut Context, i: usize, name: &str) -> &'a mut GraphReport {
    if cx.graphs.len() <= i {
        cx.graphs.resize_with(i + 1, GraphReport::default);
    }
    let r = &mut cx.graphs[i];
    if r.name.is_empty() {
        r.name = name.to_owned();
    }
    r
}

/// The standard pipeline, in order.
pub fn standard() -> Vec<Box<dyn Pass>> {
    vec![
        Box::new(Insert),
        Box::new(Rewrite),
        Box::new(Schedule),
        Box::new(Keep),
    ]
}

/// Names of the standard passes, for `--disable` and `--dump-after`.
pub fn pass_names() -> Vec<&'static str> {
    standard().iter().map(|p| p.name()).collect()
}

/// Runs `passes` over `p` in order.
pub fn run(
    passes: &[Box<dyn Pass>],
    p: &mut Program,
    opts: &PipelineOptions,
) -> Result<Context, PassError> {
    let mut cx = Context::default();
    let mut facts: BTreeSet<Fact> = BTreeSet::new();
    for pass in passes {
        if !pass.is_enabled(opts) {
            continue;
        }
        if let Some(&fact) = pass.needs().iter().find(|f| !facts.contains(f)) {
            return Err(PassError::MissingFact {
                pass: pass.name(),
                fact,
            });
        }
        let span = tracing::info_span!("pass", pass = pass.name());
        span.in_scope(|| pass.run(p, opts, &mut cx))?;
        facts.extend(pass.gives());
        if opts.verify {
            zerosched_ir::verify::program(p).map_err(|diagnostics| PassError::Invalid {
                pass: pass.name(),
                diagnostics,
            })?;
            // Once scheduled, every pass's output must also satisfy the independent checker.
            if facts.contains(&Fact::Scheduled) {
                let check = crate::checker::CheckOptions {
                    budget: opts.schedule.budget,
                    world_size: opts.schedule.world_size,
                };
                crate::checker::check_program(p, &check).map_err(|violations| {
                    PassError::Rejected {
                        pass: pass.name(),
                        violations,
                    }
                })?;
            }
        }
        if opts.dump_after.contains(pass.name()) {
            cx.dumps.push((pass.name().to_owned(), p.clone()));
        }
    }
    Ok(cx)
}
