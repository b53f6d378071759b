//! What the `deepcompile` scheduler (DeepCompile's `fast_free_schedule`, quadratic on purpose)
//! costs on the forward graph of a Llama-shaped step (`zerosched_ir::testing::llama_like`) of
//! 8, 32 and 80 layers, after insertion: nodes, gathers, and the wall time of one schedule.
//!
//! `cargo run --release -p zerosched-passes --example deepcompile_timing`

use std::collections::BTreeSet;
use std::time::Instant;
use zerosched_passes::insert::insert;
use zerosched_passes::schedule::{DeepCompile, ScheduleOptions, Scheduler};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for layers in [8, 32, 80] {
        let mut program = zerosched_ir::testing::llama_like(layers);
        let mut g = program.graphs.swap_remove(0);
        insert(&mut g, &BTreeSet::new())?;
        let start = Instant::now();
        let report = DeepCompile.schedule(&mut g, &ScheduleOptions::default())?;
        println!(
            "{layers} layers: {} nodes, {} gathers: {:?}",
            g.len(),
            report.gathers,
            start.elapsed()
        );
    }
    Ok(())
}
