//! Fitting `jit` and `prefetch` to the budgets. The gathered budget is the walk's own; a
//! device-memory budget counts everything the simulator counts, which depends on timing, so it
//! is met in three steps: the `jit` schedule (the least memory any order that keeps the compute
//! order holds) is simulated for the live bytes at each position; the prefetch walk then issues
//! a gather ahead of need only where those bytes, plus what it has already issued ahead, leave
//! room for it until its need; the result is simulated, and where timing made it overshoot
//! (a gradient freed later because its reduction queued behind a prefetch) the walk runs again
//! with the limit lowered by the overshoot, twice as much each time. After a few tries the
//! `jit` schedule itself is the answer: so every memory at or above its peak succeeds, and that
//! peak is the smallest memory budget named when none fits.

use super::walk::{self, Outcome, Plan, Policy, Room};
use super::{Least, ScheduleError, ScheduleOptions, ScheduleReport};
use crate::max_add::MaxAdd;
use crate::simulate::{SimOptions, simulate_graph};
use zerosched_ir::{Graph, NodeId};

const JIT: Policy = Policy {
    prefetch: false,
    bucketing: false,
};
const PREFETCH: Policy = Policy {
    prefetch: true,
    bucketing: true,
};

/// Prefetch walks under a memory budget before falling back to `jit`.
const TRIES: usize = 4;

/// Peak live bytes of `g` as it stands, simulated with the scheduling cost model.
pub(super) fn simulated(g: &Graph, opts: &ScheduleOptions) -> crate::simulate::GraphSim {
    let sim = SimOptions {
        world_size: opts.world_size,
        cost: opts.cost.clone(),
    };
    simulate_graph(g, &sim)
}

pub(super) fn simulated_peak(g: &Graph, opts: &ScheduleOptions) -> u64 {
    simulated(g, opts).summary.peak_total_bytes
}

fn over_budget(g: &Graph, opts: &ScheduleOptions, needed: u64) -> ScheduleError {
    ScheduleError::OverBudget {
        graph: g.label().to_owned(),
        budget: opts.budget,
        needed,
    }
}

fn over_memory(g: &Graph, opts: &ScheduleOptions, needed: u64) -> ScheduleError {
    ScheduleError::OverMemory {
        graph: g.label().to_owned(),
        memory: opts.memory,
        needed,
    }
}

fn limited(opts: &ScheduleOptions) -> bool {
    opts.memory != u64::MAX
}

/// The `jit` schedule of `g` as a new graph, with its report (simulated peak included).
fn jit_schedule(
    g: &Graph,
    plan: &Plan,
    opts: &ScheduleOptions,
) -> Result<(Graph, ScheduleReport, Vec<u64>), ScheduleError> {
    let outcome = walk::walk(g, plan, opts, JIT, None);
    let mut scheduled = g.clone();
    let mut report = walk::apply(&mut scheduled, plan, outcome)?;
    let sim = simulated(&scheduled, opts);
    report.peak_memory = sim.summary.peak_total_bytes;
    Ok((scheduled, report, sim.timeline.live))
}

pub(super) fn least(g: &Graph, opts: &ScheduleOptions) -> Result<Least, ScheduleError> {
    let plan = Plan::build(g, opts);
    let (_, report, _) = jit_schedule(g, &plan, opts)?;
    Ok(Least {
        gathered: report.peak_gathered,
        memory: report.peak_memory,
    })
}

pub(super) fn jit(g: &mut Graph, opts: &ScheduleOptions) -> Result<ScheduleReport, ScheduleError> {
    let plan = Plan::build(g, opts);
    if !limited(opts) {
        let outcome = walk::walk(g, &plan, opts, JIT, None);
        if outcome.peak > opts.budget {
            return Err(over_budget(g, opts, outcome.peak));
        }
        return walk::apply(g, &plan, outcome);
    }
    let (scheduled, report, _) = jit_schedule(g, &plan, opts)?;
    check_jit(g, opts, &report)?;
    *g = scheduled;
    Ok(report)
}

/// Refuses a `jit` schedule over either budget, naming its own peak as the least.
fn check_jit(g: &Graph, opts: &ScheduleOptions, r: &ScheduleReport) -> Result<(), ScheduleError> {
    if r.peak_gathered > opts.budget {
        return Err(over_budget(g, opts, r.peak_gathered));
    }
    if limited(opts) && r.peak_memory > opts.memory {
        return Err(over_memory(g, opts, r.peak_memory));
    }
    Ok(())
}

fn fits_budget(outcome: &Outcome, opts: &ScheduleOptions) -> bool {
    outcome.needed == 0 && outcome.peak <= opts.budget
}

pub(super) fn prefetch(
    g: &mut Graph,
    opts: &ScheduleOptions,
) -> Result<ScheduleReport, ScheduleError> {
    let plan = Plan::build(g, opts);
    if !limited(opts) {
        let outcome = walk::walk(g, &plan, opts, PREFETCH, None);
        if fits_budget(&outcome, opts) {
            return walk::apply(g, &plan, outcome);
        }
        // Prefetching early left a later gather no room; `jit` needs the least.
        let outcome = walk::walk(g, &plan, opts, JIT, None);
        if outcome.peak > opts.budget {
            return Err(over_budget(g, opts, outcome.peak));
        }
        return walk::apply(g, &plan, outcome);
    }
    let (jit_graph, jit_report, live) = jit_schedule(g, &plan, opts)?;
    check_jit(g, opts, &jit_report)?;
    let live = by_spine(&jit_graph, plan.spine(), &live);
    let mut limit = opts.memory;
    for attempt in 0..TRIES {
        let room = Room {
            live: MaxAdd::from_live(&live),
            limit,
        };
        let outcome = walk::walk(g, &plan, opts, PREFETCH, Some(room));
        if !fits_budget(&outcome, opts) {
            break;
        }
        let mut scheduled = g.clone();
        let mut report = walk::apply(&mut scheduled, &plan, outcome)?;
        report.peak_memory = simulated_peak(&scheduled, opts);
        if report.peak_memory <= opts.memory {
            *g = scheduled;
            return Ok(report);
        }
        // The walk's decisions are discrete: a limit lower by the overshoot alone often makes
        // the same ones again, so what each try takes off doubles.
        let over = report.peak_memory - opts.memory;
        limit = limit.saturating_sub(over.saturating_mul(1 << attempt));
    }
    *g = jit_graph;
    Ok(jit_report)
}

/// Live bytes per spine position of a schedule that keeps the spine's order: the most held at
/// any position from just after the previous spine node through this one (where the walk
/// issues this node's gathers); what follows the last spine node counts with it.
fn by_spine(scheduled: &Graph, spine: &[NodeId], live: &[u64]) -> Vec<u64> {
    let positions = scheduled.positions();
    let mut out = Vec::with_capacity(spine.len());
    let mut from = 0;
    for &s in spine {
        let to = positions
            .get(s)
            .copied()
            .filter(|&p| p != usize::MAX)
            .map_or(from, |p| (p + 1).max(from));
        let held = live.get(from..to).unwrap_or_default();
        out.push(held.iter().copied().max().unwrap_or(0));
        from = to;
    }
    let rest = live.get(from..).unwrap_or_default().iter().copied().max();
    if let (Some(last), Some(rest)) = (out.last_mut(), rest) {
        *last = (*last).max(rest);
    }
    out
}
