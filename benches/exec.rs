//! Interpreter overhead of the executor core: `--dry-run` (allocation, liveness and
//! collectives, no arithmetic) over the scheduled 80-layer Llama-70B program, per node.
//!
//! `cargo bench --bench exec`. Plans (alias classes, last uses, free lists) are built once
//! outside the timed loop, as a run of many steps would; the timed part is the walk of both
//! graphs over the world. Criterion's throughput is in nodes x ranks, so its "elem/s" gives
//! the per-node cost directly; the target is under 1 us per node.

// The allocator the command line uses, so that the figures are the command line's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use std::path::Path;
use zerosched_exec::comm::ThreadComm;
use zerosched_exec::dry::Dry;
use zerosched_exec::inputs::Inputs;
use zerosched_exec::plans;
use zerosched_exec::world::run_threads;
use zerosched_passes::pipeline::{self, PipelineOptions};
use zerosched_passes::schedule::ScheduleOptions;

fn scheduled(name: &str, world: u32) -> Option<zerosched_ir::Program> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("benches/data/{name}.program.json.gz"));
    let mut p = zerosched_api::io::read_program(&path).ok()?;
    let budget = 2 * zerosched_api::budget::layer_bytes(&p, 0, world);
    let opts = PipelineOptions {
        schedule: ScheduleOptions {
            budget,
            world_size: world,
            ..ScheduleOptions::default()
        },
        verify: false,
        ..PipelineOptions::default()
    };
    pipeline::run(&pipeline::standard(), &mut p, &opts).ok()?;
    Some(p)
}

fn dry_run(c: &mut Criterion) {
    let mut group = c.benchmark_group("exec_dry_run");
    group.sample_size(20);
    for world in [1u32, 8] {
        let Some(p) = scheduled("llama70b_l80", world) else {
            eprintln!("benches/data/llama70b_l80.program.json.gz missing: skipped");
            return;
        };
        let plans = plans::<Dry>(&p).expect("the dry run runs every op");
        let nodes: usize = p.graphs.iter().map(|g| g.len()).sum();
        let inputs = Inputs::new(0);
        group.throughput(Throughput::Elements(nodes as u64 * u64::from(world)));
        group.bench_function(format!("llama70b_l80_x{world}"), |b| {
            b.iter(|| {
                let comms = ThreadComm::world(world);
                black_box(
                    run_threads(black_box(&plans), &inputs, comms, |_| Ok(Dry)).expect("runs"),
                )
            })
        });
    }
    group.finish();
}

criterion_group!(benches, dry_run);
criterion_main!(benches);
