//! The whole pipeline (import, insert, schedule, check, export) on the exported 70B-class and
//! MoE programs, and scheduling alone with each scheduler side by side.
//!
//! `cargo bench --bench pipeline`. Budgets are two decoder layers' worth of parameters.

// The allocator the command line uses, so that the figures are the command line's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::path::Path;
use zerosched_passes::checker::{CheckOptions, check_program};
use zerosched_passes::pipeline::{self, PipelineOptions};
use zerosched_passes::schedule::ScheduleOptions;

const PROGRAMS: &[&str] = &["llama70b_l8", "llama70b_l80", "mixtral8x7b_l24"];

fn load(name: &str) -> Option<Vec<u8>> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("benches/data/{name}.program.json.gz"));
    zerosched_api::io::read_bytes(&path).ok()
}

fn options(bytes: &[u8], scheduler: &str) -> PipelineOptions {
    let p = zerosched_ir::import(bytes).expect("benchmark data imports");
    let budget = 2 * zerosched_api::budget::layer_bytes(&p, 0, 8);
    PipelineOptions {
        schedule: ScheduleOptions {
            budget,
            ..ScheduleOptions::default()
        },
        scheduler: scheduler.to_owned(),
        verify: false,
        ..PipelineOptions::default()
    }
}

fn whole_pipeline(c: &mut Criterion) {
    let mut group = c.benchmark_group("pipeline");
    group.sample_size(20);
    for &name in PROGRAMS {
        let Some(bytes) = load(name) else { continue };
        let opts = options(&bytes, "prefetch");
        let check = CheckOptions {
            budget: opts.schedule.budget,
            world_size: opts.schedule.world_size,
            ..Default::default()
        };
        group.bench_function(name, |b| {
            b.iter(|| {
                let mut p = zerosched_ir::import(black_box(&bytes)).expect("imports");
                pipeline::run(&pipeline::standard(), &mut p, &opts).expect("schedules");
                check_program(&p, &check).expect("the checker accepts the schedule");
                black_box(zerosched_ir::json::export(&p))
            })
        });
    }
    group.finish();
}

fn schedulers(c: &mut Criterion) {
    let mut group = c.benchmark_group("schedule");
    group.sample_size(10);
    for &name in PROGRAMS {
        let Some(bytes) = load(name) else { continue };
        for scheduler in zerosched_passes::schedule::NAMES {
            let opts = options(&bytes, scheduler);
            let mut inserted = zerosched_ir::import(&bytes).expect("imports");
            let mut insert_only = opts.clone();
            insert_only.disabled = ["schedule", "keep"].map(String::from).into();
            pipeline::run(&pipeline::standard(), &mut inserted, &insert_only).expect("inserts");
            let s = zerosched_passes::schedule::by_name(scheduler).expect("known");
            group.bench_function(format!("{name}/{scheduler}"), |b| {
                // Fresh copies of the inserted graphs each time, made and dropped untimed.
                b.iter_batched(
                    || inserted.graphs.clone(),
                    |mut graphs| {
                        for g in &mut graphs {
                            black_box(s.schedule(g, &opts.schedule).expect("schedules"));
                        }
                        graphs
                    },
                    BatchSize::LargeInput,
                )
            });
        }
    }
    group.finish();
}

criterion_group!(benches, whole_pipeline, schedulers);
criterion_main!(benches);
