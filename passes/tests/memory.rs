//! The device-memory budget (`ScheduleOptions::memory`): every live byte on a rank, as the
//! simulator counts it. The schedulers fit it from the `jit` peak up, the named smallest works
//! when given back for the whole program (for the gathered budget too), `keep` keeps only what
//! fits, and the checker refuses a schedule over it.

mod common;

use common::{Builder, WORLD};
use proptest::prelude::*;
use zerosched_ir::testing::{self, Config};
use zerosched_ir::{GraphKind, Program};
use zerosched_passes::checker::{CheckOptions, Violation, check_program};
use zerosched_passes::pipeline::{self, Context, PassError, PipelineOptions};
use zerosched_passes::schedule::ScheduleError;
use zerosched_passes::simulate::{SimOptions, simulate_program};

fn options(scheduler: &str, budget: u64, memory: u64) -> PipelineOptions {
    let mut o = common::options(scheduler, budget);
    o.schedule.memory = memory;
    o
}

fn run(
    p: &Program,
    scheduler: &str,
    budget: u64,
    memory: u64,
) -> Result<(Program, Context), Box<PassError>> {
    let mut q = p.clone();
    let cx = pipeline::run(
        &pipeline::standard(),
        &mut q,
        &options(scheduler, budget, memory),
    )
    .map_err(Box::new)?;
    Ok((q, cx))
}

fn sim(p: &Program) -> zerosched_passes::simulate::ProgramSim {
    simulate_program(
        p,
        &SimOptions {
            world_size: WORLD,
            ..SimOptions::default()
        },
    )
}

/// The smallest budget the pipeline names for `budget`/`memory`, and which kind it is.
fn named(e: &PassError) -> Option<(bool, u64)> {
    match e {
        PassError::Schedule(ScheduleError::OverBudget { needed, .. })
        | PassError::OverBudget { needed, .. } => Some((false, *needed)),
        PassError::Schedule(ScheduleError::OverMemory { needed, .. })
        | PassError::OverMemory { needed, .. } => Some((true, *needed)),
        _ => None,
    }
}

/// A forward of `layers` square layers of width `dim`, its parameters named `{prefix}.{l}`:
/// graphs of different widths need different budgets.
fn layers(name: &str, prefix: &str, layers: usize, dim: u64) -> zerosched_ir::Graph {
    let mut b = Builder::new(name, GraphKind::Forward);
    let mut x = b.input("x", &[16, dim]);
    for l in 0..layers {
        let w = b.param(&format!("{prefix}.{l}.weight"), &[dim, dim]);
        x = b.mm(&format!("mm_{l}"), x, w, &[16, dim], 1.0);
    }
    b.output(&[x])
}

/// A narrow graph first, a wide one after: the first graph to fail at a small budget is the
/// narrow one, whose own minimum is too small for the wide one.
fn narrow_then_wide() -> Program {
    Program::bundle(vec![
        layers("narrow", "a", 3, 32),
        layers("wide", "b", 3, 128),
    ])
}

#[test]
fn the_named_smallest_budget_is_the_whole_programs_and_works_when_given_back() {
    let p = narrow_then_wide();
    for scheduler in ["jit", "prefetch", "deepcompile"] {
        for memory_kind in [false, true] {
            let (budget, memory) = if memory_kind {
                (u64::MAX, 1)
            } else {
                (1, u64::MAX)
            };
            let e = run(&p, scheduler, budget, memory).err();
            let Some((kind, needed)) = e.as_deref().and_then(named) else {
                panic!("{scheduler}: expected an over-budget error, got {e:?}");
            };
            assert_eq!(kind, memory_kind, "{scheduler}: {e:?}");
            // The first failing graph is the narrow one, but the figure is the wide one's.
            let message = e.map(|e| e.to_string()).unwrap_or_default();
            assert!(message.contains("`narrow`"), "{message}");
            let (budget, memory) = if memory_kind {
                (u64::MAX, needed)
            } else {
                (needed, u64::MAX)
            };
            let (q, _) = run(&p, scheduler, budget, memory)
                .unwrap_or_else(|e| panic!("{scheduler} at the named {needed}: {e}"));
            let s = sim(&q);
            let reached = if memory_kind {
                s.total.peak_total_bytes
            } else {
                s.total.peak_gathered_bytes
            };
            assert!(reached <= needed, "{scheduler}: {reached} > {needed}");
            let wide = &s.graphs[1].summary;
            let narrow = &s.graphs[0].summary;
            let (w, n) = if memory_kind {
                (wide.peak_total_bytes, narrow.peak_total_bytes)
            } else {
                (wide.peak_gathered_bytes, narrow.peak_gathered_bytes)
            };
            assert!(n < w, "{scheduler}: the wide graph needs more ({n} vs {w})");
            if scheduler != "deepcompile" {
                // And it is the smallest: one byte less fails.
                let (budget, memory) = if memory_kind {
                    (u64::MAX, needed - 1)
                } else {
                    (needed - 1, u64::MAX)
                };
                assert!(
                    run(&p, scheduler, budget, memory).is_err(),
                    "{scheduler} at {needed} - 1"
                );
            }
        }
    }
}

/// The train step the other tests use: six layers, 64 wide, forward then backward.
fn step() -> Program {
    common::train_step(6, 64, 1.0)
}

fn least_memory(p: &Program, scheduler: &str) -> u64 {
    match run(p, scheduler, u64::MAX, 0)
        .err()
        .as_deref()
        .and_then(named)
    {
        Some((true, needed)) => needed,
        other => panic!("{scheduler} at memory 0: {other:?}"),
    }
}

#[test]
fn prefetch_fills_the_memory_it_is_given_and_never_more() {
    let p = step();
    let least = least_memory(&p, "prefetch");
    assert_eq!(
        least,
        least_memory(&p, "jit"),
        "both start from the jit peak"
    );
    let (unlimited, _) = run(&p, "prefetch", u64::MAX, u64::MAX).expect("unlimited");
    let top = sim(&unlimited).total;
    assert!(
        top.peak_total_bytes > least,
        "prefetching holds more than jit"
    );
    let (jit, _) = run(&p, "jit", u64::MAX, least).expect("jit at its peak");
    let jit_ms = sim(&jit).total.step_ms;
    let mut steps = Vec::new();
    for memory in [
        least,
        (least + top.peak_total_bytes) / 2,
        top.peak_total_bytes,
    ] {
        let (q, _) = run(&p, "prefetch", u64::MAX, memory)
            .unwrap_or_else(|e| panic!("prefetch at {memory}: {e}"));
        let s = sim(&q).total;
        assert!(
            s.peak_total_bytes <= memory,
            "{} > {memory}",
            s.peak_total_bytes
        );
        assert!(s.step_ms <= jit_ms + 1e-9, "never slower than jit");
        steps.push(s.step_ms);
    }
    assert!(
        steps[2] < jit_ms,
        "with the memory the unlimited schedule takes, prefetch beats jit: {steps:?} vs {jit_ms}"
    );
}

#[test]
fn both_budgets_hold_at_once() {
    let p = step();
    let (unlimited, _) = run(&p, "prefetch", u64::MAX, u64::MAX).expect("unlimited");
    let top = sim(&unlimited).total;
    let budget = top.peak_gathered_bytes / 2;
    let memory = top.peak_total_bytes - 1;
    let (q, _) = run(&p, "prefetch", budget, memory).expect("both");
    let s = sim(&q).total;
    assert!(
        s.peak_gathered_bytes <= budget && s.peak_total_bytes <= memory,
        "{s:?}"
    );
}

#[test]
fn keep_counts_what_it_keeps_against_the_memory() {
    let p = step();
    let (_, cx) = run(&p, "prefetch", u64::MAX, u64::MAX).expect("unlimited");
    assert!(!cx.keep.kept.is_empty(), "with room, keep keeps");
    let least = least_memory(&p, "prefetch");
    let (q, cx) = run(&p, "prefetch", u64::MAX, least).expect("at the least");
    assert!(sim(&q).total.peak_total_bytes <= least);
    assert!(
        cx.keep.kept.len()
            < run(&p, "prefetch", u64::MAX, u64::MAX)
                .map(|(_, c)| c.keep.kept.len())
                .unwrap_or(0),
        "at the least memory keep keeps less: {:?}",
        cx.keep.kept
    );
}

#[test]
fn the_checker_refuses_a_schedule_over_the_memory() {
    let p = step();
    let (q, _) = run(&p, "prefetch", u64::MAX, u64::MAX).expect("unlimited");
    let s = sim(&q);
    let check = |memory| {
        check_program(
            &q,
            &CheckOptions {
                memory,
                world_size: WORLD,
                ..CheckOptions::default()
            },
        )
    };
    let peak = s.total.peak_total_bytes;
    check(peak).expect("within its own peak");
    let v = check(peak - 1).expect_err("one byte under its peak");
    let worst = s
        .graphs
        .iter()
        .find(|g| g.summary.peak_total_bytes == peak)
        .map(|g| g.graph.clone());
    assert!(
        v.0.iter().any(|l| matches!(l.violation, Violation::OverMemory { peak: p, memory } if p == peak && memory == peak - 1)
            && l.location.graph == worst),
        "{v}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Over generated programs, for each budget kind and every budget-aware scheduler: an
    /// impossible budget names a figure, the pipeline succeeds at it (verifier and checker
    /// after every pass, the memory included), and what it reaches is within it.
    #[test]
    fn the_named_smallest_budget_works_when_given_back(
        p in testing::program(&Config::default().plain()),
        memory_kind in any::<bool>(),
        scheduler in prop::sample::select(vec!["jit", "prefetch", "deepcompile"]),
    ) {
        let (budget, memory) = if memory_kind { (u64::MAX, 0) } else { (0, u64::MAX) };
        let needed = match run(&p, scheduler, budget, memory) {
            Ok(_) => return Ok(()), // nothing to gather or hold: no budget is too small
            Err(e) => match named(&e) {
                Some((kind, needed)) => {
                    prop_assert_eq!(kind, memory_kind, "{}", e);
                    needed
                }
                None => return Err(TestCaseError::fail(format!("{scheduler}: {e}"))),
            },
        };
        let (budget, memory) = if memory_kind { (u64::MAX, needed) } else { (needed, u64::MAX) };
        let (q, _) = run(&p, scheduler, budget, memory)
            .map_err(|e| TestCaseError::fail(format!("{scheduler} at the named {needed}: {e}")))?;
        let s = sim(&q).total;
        prop_assert!(s.peak_total_bytes <= memory && s.peak_gathered_bytes <= budget, "{:?}", s);
    }
}
