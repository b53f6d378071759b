//! Schedulers: each takes a graph after insertion and chooses its program order, placing
//! gathers, waits, releases and reductions relative to the compute.
//!
//! - `jit`: gather right before first use, release right after last. The baseline.
//! - `deepcompile`: DeepSpeed DeepCompile's `fast_free_schedule`, re-implemented for
//!   side-by-side comparison.
//! - `prefetch` (the default): keeps the compute order and issues each gather as early as the
//!   memory budget allows and as late as keeps the communication stream busy, coalescing
//!   adjacent gathers into buckets when that saves time. One pass, near-linear.
//!
//! Under a device-memory budget (`ScheduleOptions::memory`) `prefetch` issues ahead of need
//! only into the memory the `jit` schedule leaves free at each position, and checks the result
//! by simulation (`fit`).

mod deepcompile;
mod fit;
mod walk;

pub use deepcompile::DeepCompile;

use crate::cost::CostModel;
use zerosched_ir::{Graph, Problem};

/// What a scheduler is asked to respect.
#[derive(Clone, Debug)]
pub struct ScheduleOptions {
    /// Most bytes of gathered parameters alive at once, counted in program order.
    pub budget: u64,
    /// Most bytes alive at once on a rank, everything counted as the simulator counts it
    /// (activations, inputs, gathered parameters, gradients until reduced); `u64::MAX` for no
    /// limit.
    pub memory: u64,
    pub world_size: u32,
    pub cost: CostModel,
}

impl Default for ScheduleOptions {
    fn default() -> ScheduleOptions {
        ScheduleOptions {
            budget: u64::MAX,
            memory: u64::MAX,
            world_size: 8,
            cost: CostModel::default(),
        }
    }
}

/// What a scheduler did to one graph.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScheduleReport {
    pub gathers: usize,
    /// Coalesced groups of two or more gathers.
    pub buckets: usize,
    pub releases: usize,
    pub reductions: usize,
    /// Coalesced groups of two or more reductions.
    pub reduce_buckets: usize,
    /// Peak gathered bytes in the new program order.
    pub peak_gathered: u64,
    /// Peak of all live bytes, simulated; computed only under a memory budget (else 0).
    pub peak_memory: u64,
}

/// The least a graph needs to be scheduled: gathered bytes for `budget`, live bytes for
/// `memory`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Least {
    pub gathered: u64,
    pub memory: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error(
        "graph `{graph}`: no schedule fits a budget of {budget} bytes of gathered parameters; \
         the smallest budget that works is {needed} bytes"
    )]
    OverBudget {
        graph: String,
        budget: u64,
        needed: u64,
    },
    #[error(
        "graph `{graph}`: no schedule fits a memory budget of {memory} bytes; the smallest \
         memory budget that works is {needed} bytes"
    )]
    OverMemory {
        graph: String,
        memory: u64,
        needed: u64,
    },
    #[error("graph `{graph}`: {problem}")]
    Graph { graph: String, problem: Problem },
}

pub trait Scheduler: Sync {
    fn name(&self) -> &'static str;
    /// Reorders `g` (a graph after insertion) in place.
    fn schedule(
        &self,
        g: &mut Graph,
        opts: &ScheduleOptions,
    ) -> Result<ScheduleReport, ScheduleError>;
    /// The smallest budgets at which this scheduler schedules `g`: the `jit` schedule's peaks
    /// (no order that keeps the compute order holds less), unless the scheduler ignores the
    /// budgets.
    fn least(&self, g: &Graph, opts: &ScheduleOptions) -> Result<Least, ScheduleError> {
        fit::least(g, opts)
    }
}

/// Gather right before first use, release right after last use.
pub struct Jit;

/// Budgeted prefetch with bucketing (the default).
pub struct Prefetch;

impl Scheduler for Jit {
    fn name(&self) -> &'static str {
        "jit"
    }
    fn schedule(
        &self,
        g: &mut Graph,
        opts: &ScheduleOptions,
    ) -> Result<ScheduleReport, ScheduleError> {
        fit::jit(g, opts)
    }
}

impl Scheduler for Prefetch {
    fn name(&self) -> &'static str {
        "prefetch"
    }
    fn schedule(
        &self,
        g: &mut Graph,
        opts: &ScheduleOptions,
    ) -> Result<ScheduleReport, ScheduleError> {
        fit::prefetch(g, opts)
    }
}

/// The scheduler names `--scheduler` accepts.
pub const NAMES: &[&str] = &["prefetch", "jit", "deepcompile"];

pub fn by_name(name: &str) -> Option<Box<dyn Scheduler>> {
    match name {
        "prefetch" => Some(Box::new(Prefetch)),
        "jit" => Some(Box::new(Jit)),
        "deepcompile" => Some(Box::new(DeepCompile)),
        _ => None,
    }
}
