//! The whole pipeline against its own checker and the executor, as regalloc2 fuzzes its
//! allocator against its checker. The input either is a document (JSON or binary, mutated
//! from the seeds) or seeds the generator of ZeRO-3-like programs (`zerosched_ir::testing`). Each program is
//! imported, inserted and scheduled by every scheduler at a gathered budget and a device-memory
//! budget taken from the input (fractions of what the unlimited schedule reaches), with the
//! verifier and checker after every pass. Then:
//!
//! - an accepted schedule checks at its budgets and dry-runs (exec/core `dry.rs`) within them:
//!   the executor's measured gathered peak within the budget, its total peak within the memory;
//! - a refused one names a smallest figure, and the pipeline succeeds at it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config as RunnerConfig, RngAlgorithm, TestRng, TestRunner};
use zerosched_exec::dry::Dry;
use zerosched_exec::inputs::Inputs;
use zerosched_exec::world::run_program;
use zerosched_ir::Program;
use zerosched_ir::testing::{self, Config};
use zerosched_passes::checker::{CheckOptions, check_program};
use zerosched_passes::pipeline::{self, PassError, PipelineOptions};
use zerosched_passes::schedule::{NAMES, ScheduleError, ScheduleOptions};

const WORLD: [u32; 4] = [1, 2, 4, 8];

fn program(data: &[u8]) -> Option<Program> {
    if let Ok(p) = zerosched_ir::import(data) {
        return Some(p);
    }
    // The input seeds the generator. (The pass-through generator, which would let
    // mutations steer each choice, yields zeros once the input is exhausted, on which
    // proptest's rejection sampling never ends.)
    let mut seed = [0u8; 32];
    for (lane, chunk) in seed.chunks_mut(8).enumerate() {
        let h = data.iter().fold(0x9E37_79B9_7F4A_7C15u64 ^ lane as u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3)
        });
        chunk.copy_from_slice(&h.to_le_bytes());
    }
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed);
    let mut runner = TestRunner::new_with_rng(RunnerConfig::default(), rng);
    let tree = testing::program(&Config::default().plain())
        .new_tree(&mut runner)
        .ok()?;
    Some(tree.current())
}

fn options(scheduler: &str, world: u32, budget: u64, memory: u64) -> PipelineOptions {
    PipelineOptions {
        schedule: ScheduleOptions {
            budget,
            memory,
            world_size: world,
            ..ScheduleOptions::default()
        },
        scheduler: scheduler.to_owned(),
        verify: true,
        ..PipelineOptions::default()
    }
}

fn named(e: &PassError) -> Option<(bool, u64)> {
    match e {
        PassError::Schedule(ScheduleError::OverBudget { needed, .. })
        | PassError::OverBudget { needed, .. } => Some((false, *needed)),
        PassError::Schedule(ScheduleError::OverMemory { needed, .. })
        | PassError::OverMemory { needed, .. } => Some((true, *needed)),
        _ => None,
    }
}

/// `num/4` of `top`, or no limit for 4 and above (0 to 7 from one byte).
fn fraction(top: u64, byte: u8) -> u64 {
    match byte % 8 {
        k @ 0..4 => top.saturating_mul(u64::from(k) + 1) / 5,
        _ => u64::MAX,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some(p) = program(data) else { return };
    if zerosched_ir::verify::program(&p).is_err() {
        return;
    }
    let tail = data.last().copied().unwrap_or(0);
    let world = WORLD[usize::from(tail) % WORLD.len()];
    for &scheduler in NAMES {
        let mut free = p.clone();
        let opts = options(scheduler, world, u64::MAX, u64::MAX);
        // Programs the pipeline refuses outright (no budget involved) are the importer's and
        // the passes' own tests' business.
        if pipeline::run(&pipeline::standard(), &mut free, &opts).is_err() {
            return;
        }
        let sim = zerosched_passes::simulate::simulate_program(
            &free,
            &zerosched_passes::simulate::SimOptions {
                world_size: world,
                ..Default::default()
            },
        );
        let budget = fraction(sim.total.peak_gathered_bytes, tail >> 3);
        let memory = fraction(sim.total.peak_total_bytes, tail.rotate_left(2));
        let mut q = p.clone();
        match pipeline::run(&pipeline::standard(), &mut q, &options(scheduler, world, budget, memory)) {
            Ok(_) => accepted(&q, scheduler, world, budget, memory),
            Err(e) => {
                let Some((is_memory, needed)) = named(&e) else {
                    panic!("{scheduler} at budget {budget}, memory {memory}: {e}");
                };
                let (b, m) = if is_memory { (budget, needed) } else { (needed, memory) };
                let mut again = p.clone();
                // The other budget may still refuse; the named one must not be what fails.
                if let Err(e2) = pipeline::run(&pipeline::standard(), &mut again, &options(scheduler, world, b, m)) {
                    let (k2, _) = named(&e2).unwrap_or_else(|| panic!("{scheduler} at the named {needed}: {e2}"));
                    assert_ne!(k2, is_memory, "{scheduler}: the named {needed} fails again: {e2}");
                } else {
                    accepted(&again, scheduler, world, b, m);
                }
            }
        }
    }
});

fn accepted(q: &Program, scheduler: &str, world: u32, budget: u64, memory: u64) {
    let check = CheckOptions {
        budget,
        memory,
        world_size: world,
        ..CheckOptions::default()
    };
    if let Err(v) = check_program(q, &check) {
        panic!("{scheduler}: accepted schedule fails the checker:\n{v}");
    }
    // The dry backend runs every target, so every accepted schedule runs.
    let run = match run_program(q, &Inputs::new(0), world, |_| Ok(Dry)) {
        Ok(run) => run,
        Err(e) => panic!("{scheduler}: accepted schedule fails its dry run: {e}"),
    };
    assert!(run.peak_gathered() <= budget, "{scheduler}: dry run gathers {} > budget {budget}", run.peak_gathered());
    for (r, peak) in run.peak_per_rank().into_iter().enumerate() {
        assert!(peak <= memory, "{scheduler}: rank {r} dry run holds {peak} > memory {memory}");
    }
}
