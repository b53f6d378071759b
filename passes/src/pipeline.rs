//! The pass manager (rustc's MIR pass manager is the model): each pass is named, says which
//! facts it needs and which it gives, may be switched off, and is followed by the structural
//! verifier when verification is on (debug builds and every test). `--dump-after PASS` keeps
//! the program as that pass left it.

use crate::insert::{InsertReport, insert};
use crate::keep::{KeepReport, keep_across};
use crate::schedule::{Least, ScheduleError, ScheduleOptions, ScheduleReport, Scheduler, by_name};
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
        "graph `{graph}`: the `{scheduler}` schedule holds {peak} bytes of gathered parameters, over the budget of {budget}; the smallest budget that works is {needed} bytes"
    )]
    OverBudget {
        graph: String,
        scheduler: &'static str,
        peak: u64,
        budget: u64,
        /// The program's: every graph's peak fits it.
        needed: u64,
    },
    #[error(
        "graph `{graph}`: the `{scheduler}` schedule holds {peak} bytes at its peak, over the memory budget of {memory}; the smallest memory budget that works is {needed} bytes"
    )]
    OverMemory {
        graph: String,
        scheduler: &'static str,
        peak: u64,
        memory: u64,
        needed: u64,
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
        let so = &opts.schedule;
        // Where a budget can fail, the graphs as they were: the smallest budget named is the
        // whole program's, computed on them.
        let limited = so.budget != u64::MAX || so.memory != u64::MAX;
        let before = limited.then(|| p.graphs.clone());
        let results = each_graph_results(p, |g| {
            let report = scheduler.schedule(g, so)?;
            tracing::info!(
                scheduler = scheduler.name(),
                gathers = report.gathers,
                buckets = report.buckets,
                peak_gathered = report.peak_gathered,
                peak_memory = report.peak_memory,
                budget = so.budget,
                memory = so.memory,
                "scheduled"
            );
            // A scheduler that does not plan for memory (deepcompile) may overrun the
            // budget; that is an error whether or not the checker runs.
            if report.peak_gathered > so.budget {
                return Err(PassError::OverBudget {
                    graph: g.label().to_owned(),
                    scheduler: scheduler.name(),
                    peak: report.peak_gathered,
                    budget: so.budget,
                    needed: report.peak_gathered,
                });
            }
            if so.memory != u64::MAX && report.peak_memory > so.memory {
                return Err(PassError::OverMemory {
                    graph: g.label().to_owned(),
                    scheduler: scheduler.name(),
                    peak: report.peak_memory,
                    memory: so.memory,
                    needed: report.peak_memory,
                });
            }
            Ok(report)
        });
        // The first graph's failure, except that one over the gathered budget goes before
        // one over memory: a memory named back would still fail on the budget.
        let failed = |want: Option<Over>| {
            results.iter().position(|r| {
                r.as_ref()
                    .err()
                    .is_some_and(|e| want.is_none() || over(e) == want)
            })
        };
        let pick = failed(Some(Over::Budget)).or_else(|| failed(None));
        let mut results = results;
        if let Some(i) = pick {
            if let Err(mut e) = results.swap_remove(i) {
                if let Some(graphs) = &before {
                    program_least(&mut e, graphs, scheduler.as_ref(), so)?;
                }
                return Err(e);
            }
        }
        for (i, (g, report)) in p.graphs.iter().zip(results).enumerate() {
            graph_report(cx, i, g.label()).schedule = report?;
        }
        Ok(())
    }
}

/// Which budget an error is over, if it is over one.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Over {
    Budget,
    Memory,
}

fn over(e: &PassError) -> Option<Over> {
    match e {
        PassError::Schedule(ScheduleError::OverBudget { .. }) | PassError::OverBudget { .. } => {
            Some(Over::Budget)
        }
        PassError::Schedule(ScheduleError::OverMemory { .. }) | PassError::OverMemory { .. } => {
            Some(Over::Memory)
        }
        _ => None,
    }
}

/// The whole program's least budget of the kind `e` is over, into `e`: at it every graph
/// schedules, not only the one that failed first.
fn program_least(
    e: &mut PassError,
    graphs: &[Graph],
    scheduler: &dyn Scheduler,
    opts: &ScheduleOptions,
) -> Result<(), PassError> {
    let Some(kind) = over(e) else {
        return Ok(());
    };
    let least: Vec<Least> = graphs
        .par_iter()
        .map(|g| scheduler.least(g, opts))
        .collect::<Result<_, _>>()?;
    let most = least
        .iter()
        .map(|l| match kind {
            Over::Budget => l.gathered,
            Over::Memory => l.memory,
        })
        .max()
        .unwrap_or(0);
    match e {
        PassError::Schedule(
            ScheduleError::OverBudget { needed, .. } | ScheduleError::OverMemory { needed, .. },
        )
        | PassError::OverBudget { needed, .. }
        | PassError::OverMemory { needed, .. } => *needed = (*needed).max(most),
        _ => {}
    }
    Ok(())
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
    each_graph_results(p, f).into_iter().collect()
}

/// Every graph's result, in order, failed or not.
fn each_graph_results<R: Send>(
    p: &mut Program,
    f: impl Fn(&mut Graph) -> Result<R, PassError> + Send + Sync,
) -> Vec<Result<R, PassError>> {
    // Each task runs under the pass's span, and its own naming the graph, so that what a pass
    // reports (RUST_LOG) says which graph it is about.
    let pass = tracing::Span::current();
    p.graphs
        .par_iter_mut()
        .map(|g| {
            let span = tracing::info_span!(parent: &pass, "graph", graph = g.label());
            let _entered = span.enter();
            f(g)
        })
        .collect()
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
                    memory: opts.schedule.memory,
                    world_size: opts.schedule.world_size,
                    cost: opts.schedule.cost.clone(),
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
