//! Properties of every scheduler over generated ZeRO-3-like programs (`zerosched_ir::testing`,
//! plain configs): the checker proves every output at every feasible budget, infeasible
//! budgets are refused with a `needed` that works, and outputs are byte-identical across runs.
//!
//! The smallest feasible budget of a graph is the `jit` peak: no scheduler that keeps the
//! compute order can hold fewer gathered bytes at once. `jit` and `prefetch` honour budgets;
//! `deepcompile`, like DeepSpeed's `fast_free_schedule`, ignores them, so its property is that
//! its order does not depend on the budget and that an over-budget order is caught by the
//! checker, never passed on silently by the verifying pipeline.

mod common;

use common::{WORLD, check_options, options};
use proptest::collection::vec;
use proptest::prelude::*;
use std::collections::BTreeSet;
use zerosched_ir::testing::{self, Config};
use zerosched_ir::{Graph, Program};
use zerosched_passes::checker::{CheckReport, Violation, check_graph, check_program};
use zerosched_passes::pipeline::{self, PassError, PipelineOptions};
use zerosched_passes::schedule::{NAMES, ScheduleError, ScheduleOptions, ScheduleReport, by_name};

const CASES: u32 = 64;

fn cfg() -> Config {
    Config::default().plain()
}

/// Persistence is a property of the parameter: every graph's declaration says so, so that the
/// checker, which reads one graph at a time here, agrees with the insertion over the program.
fn normalized(mut p: Program) -> Program {
    let persistent: BTreeSet<String> = p
        .graphs
        .iter()
        .flat_map(|g| &g.params)
        .filter(|q| q.persistent)
        .map(|q| q.name.clone())
        .collect();
    for g in &mut p.graphs {
        for q in &mut g.params {
            q.persistent |= persistent.contains(&q.name);
        }
    }
    p
}

/// The program after insertion alone.
fn inserted(p: &Program) -> Program {
    let mut q = p.clone();
    let opts = PipelineOptions {
        disabled: ["schedule", "keep"].map(String::from).into(),
        ..options("jit", u64::MAX)
    };
    pipeline::run(&pipeline::standard(), &mut q, &opts).expect("insertion");
    q
}

fn schedule(
    g: &Graph,
    scheduler: &str,
    budget: u64,
) -> Result<(Graph, ScheduleReport), ScheduleError> {
    let mut g = g.clone();
    let opts = ScheduleOptions {
        budget,
        world_size: WORLD,
        ..ScheduleOptions::default()
    };
    let r = by_name(scheduler).expect("known").schedule(&mut g, &opts)?;
    zerosched_ir::verify::graph(&g).expect("a valid graph");
    Ok((g, r))
}

fn proven(g: &Graph, budget: u64) -> Result<CheckReport, TestCaseError> {
    check_graph(g, &check_options(budget)).map_err(|v| {
        TestCaseError::fail(format!("checker rejects `{}` at {budget}:\n{v}", g.label()))
    })
}

/// Budgets around and above the smallest feasible one, `least`.
fn budgets(least: u64, fractions: &[u64]) -> Vec<u64> {
    let mut b = vec![
        0,
        least.saturating_sub(1),
        least,
        least + 1,
        2 * least + 1,
        u64::MAX,
    ];
    b.extend(fractions.iter().map(|&f| least.saturating_mul(f) / 100));
    b.sort_unstable();
    b.dedup();
    b
}

/// The `jit` peak of every graph: the smallest budget at which each one can be scheduled.
fn least_budgets(p: &Program) -> Vec<u64> {
    p.graphs
        .iter()
        .map(|g| {
            schedule(g, "jit", u64::MAX)
                .expect("jit, unlimited")
                .1
                .peak_gathered
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, ..ProptestConfig::default() })]

    /// `jit` and `prefetch` succeed exactly at the budgets from the smallest feasible one (the
    /// `jit` peak) up, never exceed them, and the checker proves each output at its budget;
    /// below it they refuse with `OverBudget` naming the budget asked for and a `needed` at
    /// which scheduling succeeds and is proven.
    #[test]
    fn budgeted_schedulers_are_proven_at_every_feasible_budget_and_refuse_the_rest(
        p in testing::program(&cfg()),
        fractions in vec(0u64..=400, 3),
    ) {
        let p = inserted(&normalized(p));
        for (g, least) in p.graphs.iter().zip(least_budgets(&p)) {
            for scheduler in ["jit", "prefetch"] {
                for b in budgets(least, &fractions) {
                    match schedule(g, scheduler, b) {
                        Ok((s, r)) => {
                            prop_assert!(b >= least, "{scheduler} fits {b} below the jit peak {least}");
                            prop_assert!(r.peak_gathered <= b);
                            let c = proven(&s, b)?;
                            prop_assert_eq!(c.peak_gathered, r.peak_gathered);
                        }
                        Err(ScheduleError::OverBudget { budget, needed, .. }) => {
                            prop_assert_eq!(budget, b);
                            prop_assert!(b < least, "{scheduler} refuses {b} >= jit peak {least}");
                            prop_assert!(needed > b);
                            prop_assert_eq!(needed, least, "{}: the smallest that works", scheduler);
                            let (s, _) = schedule(g, scheduler, needed)
                                .map_err(|e| TestCaseError::fail(format!("at needed: {e}")))?;
                            proven(&s, needed)?;
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("{scheduler}: {e}"))),
                    }
                }
            }
        }
    }

    /// `deepcompile` is budget-oblivious, as DeepCompile: the same order at every budget,
    /// proven at its own peak, and wherever that peak exceeds the budget the checker says so
    /// (`OverBudget`) rather than accepting it.
    #[test]
    fn deepcompile_is_budget_oblivious_and_proven_at_its_own_peak(
        p in testing::program(&cfg()),
        fractions in vec(0u64..=400, 3),
    ) {
        let p = inserted(&normalized(p));
        for (g, least) in p.graphs.iter().zip(least_budgets(&p)) {
            let (free, r) = schedule(g, "deepcompile", u64::MAX)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(r.peak_gathered >= least);
            proven(&free, r.peak_gathered)?;
            let want = zerosched_ir::json::export_graph(&free);
            for b in budgets(least, &fractions) {
                let (s, _) = schedule(g, "deepcompile", b)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert!(zerosched_ir::json::export_graph(&s) == want, "order at {}", b);
                match check_graph(&s, &check_options(b)) {
                    Ok(_) => prop_assert!(r.peak_gathered <= b),
                    Err(v) => {
                        prop_assert!(r.peak_gathered > b);
                        prop_assert!(v.0.iter().all(|l| matches!(l.violation, Violation::OverBudget { .. })), "{}", v);
                    }
                }
            }
        }
    }

    /// The whole pipeline (insert, schedule, keep, verifier and checker after every pass) at
    /// budgets from the program's smallest feasible one up: `jit` and `prefetch` succeed and
    /// are proven, keeping buffers across graphs only within the budget; one byte below, the
    /// pipeline refuses with the `needed` budget, at which it succeeds.
    #[test]
    fn pipeline_is_proven_from_the_smallest_feasible_budget_up(
        p in testing::program(&cfg()),
        fractions in vec(100u64..=400, 2),
    ) {
        let p = normalized(p);
        let least = least_budgets(&inserted(&p)).into_iter().max().unwrap_or(0);
        for scheduler in ["jit", "prefetch"] {
            for b in budgets(least, &fractions).into_iter().filter(|&b| b >= least) {
                let mut q = p.clone();
                pipeline::run(&pipeline::standard(), &mut q, &options(scheduler, b))
                    .map_err(|e| TestCaseError::fail(format!("{scheduler} at {b}: {e}")))?;
                check_program(&q, &check_options(b))
                    .map_err(|v| TestCaseError::fail(format!("{scheduler} at {b}:\n{v}")))?;
            }
            if least > 0 {
                let mut q = p.clone();
                match pipeline::run(&pipeline::standard(), &mut q, &options(scheduler, least - 1)) {
                    Err(PassError::Schedule(ScheduleError::OverBudget { needed, .. })) => {
                        prop_assert_eq!(needed, least);
                        let mut q = p.clone();
                        pipeline::run(&pipeline::standard(), &mut q, &options(scheduler, needed))
                            .map_err(|e| TestCaseError::fail(format!("at needed: {e}")))?;
                    }
                    other => {
                        return Err(TestCaseError::fail(format!(
                            "{scheduler} at {}: expected OverBudget, got {:?}",
                            least - 1,
                            other.map(|_| ())
                        )))
                    }
                }
            }
        }
        let mut q = p.clone();
        pipeline::run(&pipeline::standard(), &mut q, &options("deepcompile", u64::MAX))
            .map_err(|e| TestCaseError::fail(format!("deepcompile: {e}")))?;
    }

    /// Same input, same bytes (failure mode 6 over generated programs): every scheduler's
    /// pipeline output, as JSON, is identical across two runs and from the binary form, at an
    /// unlimited and at the smallest feasible budget.
    #[test]
    fn schedules_are_byte_identical_across_runs(p in testing::program(&cfg())) {
        let p = normalized(p);
        let least = least_budgets(&inserted(&p)).into_iter().max().unwrap_or(0);
        let from_binary = zerosched_ir::import(&zerosched_ir::binary::export(&p))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for scheduler in NAMES {
            let budgets = if *scheduler == "deepcompile" { vec![u64::MAX] } else { vec![u64::MAX, least] };
            for b in budgets {
                let out = |p: &Program| {
                    let mut q = p.clone();
                    pipeline::run(&pipeline::standard(), &mut q, &options(scheduler, b))
                        .unwrap_or_else(|e| panic!("{scheduler} at {b}: {e}"));
                    zerosched_ir::json::export(&q)
                };
                let first = out(&p);
                prop_assert!(first == out(&p), "{} at {}: two runs differ", scheduler, b);
                prop_assert!(first == out(&from_binary), "{} at {}: binary input differs", scheduler, b);
            }
        }
    }
}
