//! One run of the whole pipeline on a benchmark program, stage by stage: import, each pass,
//! the checker, export. Prints each stage's wall time and a digest of the output. Meant for
//! profilers, whose instruction counts are repeatable where wall times on a shared machine
//! are not:
//!
//! ```text
//! cargo build --release --example pipeline_stages
//! valgrind --tool=callgrind target/release/examples/pipeline_stages llama70b_l80
//! callgrind_annotate --inclusive=yes callgrind.out.* | grep -E 'Pass>::run|check_program|json::write::export|zerosched_ir::import'
//! ```
//!
//! Arguments: a program in `benches/data` (default `llama70b_l80`) and a number of runs
//! (default 1). The budget is two decoder layers' worth of parameters, as in the benchmarks.

// The allocator the command line uses, so that the figures are the command line's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::Path;
use std::time::Instant;
use zerosched_passes::checker::{CheckOptions, check_program};
use zerosched_passes::pipeline::{self, Context, PipelineOptions};
use zerosched_passes::schedule::ScheduleOptions;

/// FNV-1a, 64-bit.
fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map_or("llama70b_l80", String::as_str);
    let runs: usize = args.get(2).map_or(Ok(1), |s| s.parse())?;
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("benches/data/{name}.program.json.gz"));
    let bytes = zerosched_api::io::read_bytes(&path)?;
    for _ in 0..runs {
        let mut line = String::new();
        let mut lap = |stage: &str, t: Instant| {
            line.push_str(&format!(
                "{stage} {:.1} ms  ",
                t.elapsed().as_secs_f64() * 1e3
            ));
        };
        let t = Instant::now();
        let mut p = zerosched_ir::import(&bytes)?;
        lap("import", t);
        let budget = 2 * zerosched_api::budget::layer_bytes(&p, 0, 8);
        let opts = PipelineOptions {
            schedule: ScheduleOptions {
                budget,
                ..ScheduleOptions::default()
            },
            verify: false,
            ..PipelineOptions::default()
        };
        let mut cx = Context::default();
        for pass in pipeline::standard() {
            let t = Instant::now();
            pass.run(&mut p, &opts, &mut cx)?;
            lap(pass.name(), t);
        }
        let t = Instant::now();
        let check = CheckOptions {
            budget,
            world_size: opts.schedule.world_size,
            ..Default::default()
        };
        check_program(&p, &check)?;
        lap("check", t);
        let t = Instant::now();
        let out = zerosched_ir::json::export(&p);
        lap("export", t);
        println!("{line}digest {:016x}", digest(&out));
    }
    Ok(())
}
