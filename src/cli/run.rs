//! `zerosched run`: executes a graph or program over N ranks (threads of this process) and
//! prints what it computed and the memory it measured (beside the simulator's prediction when
//! scheduled). A run that needs more memory than the host has is refused before it starts.

use super::Failure;
use std::path::PathBuf;
use zerosched_api::summary::bytes;
use zerosched_exec::ProgramRun;
use zerosched_exec::dry::Dry;
use zerosched_exec::inputs::Inputs;
use zerosched_exec::memory::{Limit, ensure_fits};
use zerosched_exec::world::run_program;
use zerosched_exec_cpu::Cpu;
use zerosched_ir::Program;
use zerosched_passes::simulate::{SimOptions, simulate_program};

#[derive(clap::Args)]
pub struct Args {
    /// Graph or program, scheduled or not; the embedded default program if omitted.
    input: Option<PathBuf>,
    /// Executor backend.
    #[arg(long, default_value = "cpu", value_parser = ["cpu"])]
    executor: String,
    /// Ranks, each a thread of this process with its own interpreter, exchanging buffers
    /// through in-process collectives; each holds one shard of every sharded parameter.
    #[arg(long, default_value_t = 1)]
    world_size: u32,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Inputs by placeholder or parameter name: a `.safetensors` file, a file `NAME.npy`, or a
    /// directory of `.npy` files; each must have its graph's shape and dtype. The rest are
    /// random.
    #[arg(long)]
    inputs: Option<PathBuf>,
    /// Write rank 0's outputs (shape, dtype, values) as JSON.
    #[arg(long)]
    outputs: Option<PathBuf>,
    /// Schedule the program first with this scheduler (`prefetch`, `jit`, `deepcompile`).
    #[arg(long)]
    scheduler: Option<String>,
    /// Allocation, liveness and collectives only: no arithmetic, no data.
    #[arg(long)]
    dry_run: bool,
    /// The memory the run may use (bytes, or with a unit: `64GiB`), instead of what the host
    /// has available (`MemAvailable` in /proc/meminfo). A run whose dry-run peak (summed over
    /// the ranks, plus the full parameters) exceeds it is refused before it starts.
    #[arg(long, value_name = "BYTES", value_parser = zerosched_api::request::parse_bytes)]
    memory_limit: Option<u64>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    if args.world_size == 0 {
        return Err("--world-size must be at least 1".into());
    }
    let (label, mut program) = super::check::input(args.input.as_deref())?;
    if let Some(s) = &args.scheduler {
        let opts = zerosched_passes::pipeline::PipelineOptions {
            scheduler: s.clone(),
            schedule: zerosched_passes::schedule::ScheduleOptions {
                world_size: args.world_size,
                ..Default::default()
            },
            ..Default::default()
        };
        zerosched_passes::pipeline::run(
            &zerosched_passes::pipeline::standard(),
            &mut program,
            &opts,
        )?;
    }
    let mut inputs = Inputs::new(args.seed);
    if let Some(p) = &args.inputs {
        inputs.load(p)?;
    }
    let world = args.world_size;
    println!(
        "{label}: {} on {world} rank{}{}",
        args.executor,
        if world == 1 { "" } else { "s" },
        if args.dry_run { " (dry run)" } else { "" }
    );
    let started = std::time::Instant::now();
    let run = if args.dry_run {
        run_program(&program, &inputs, world, |_| Ok(Dry))?
    } else {
        let limit = args.memory_limit.map_or(Limit::Host, Limit::Bytes);
        ensure_fits(&program, &inputs, world, &limit)?;
        run_program(&program, &inputs, world, |_| Ok(Cpu))?
    };
    report(&program, &run, &args, started)?;
    if let Some(path) = args.outputs.as_ref().filter(|_| !args.dry_run) {
        write_outputs(path, &run)?;
    }
    Ok(())
}

fn report(
    program: &Program,
    run: &ProgramRun,
    args: &Args,
    started: std::time::Instant,
) -> Result<(), Failure> {
    let elapsed = started.elapsed();
    let scheduled = program.graphs.iter().any(|g| {
        g.nodes()
            .any(|(_, n)| zerosched_ir::comm::CommOp::of(n).is_some())
    });
    let sim = scheduled.then(|| {
        simulate_program(
            program,
            &SimOptions {
                world_size: args.world_size,
                ..SimOptions::default()
            },
        )
    });
    for (gi, g) in run.graphs.iter().enumerate() {
        println!("graph {}: {} nodes", g.graph, g.nodes);
        let returns = program.graphs[gi].output_values();
        if let Some(outs) = g.outputs.first() {
            for (slot, o) in outs.iter().enumerate() {
                match o {
                    Some(t) => {
                        let (sum, abs) = t.checksum();
                        println!(
                            "  output {slot}: {:?} {} sum {sum:.9e} abs-sum {abs:.9e}",
                            t.shape(),
                            t.dtype
                        );
                    }
                    None if args.dry_run
                        && returns.get(slot).is_some_and(|a| a.as_node().is_some()) =>
                    {
                        println!("  output {slot}: (no data)")
                    }
                    None => println!("  output {slot}: None"),
                }
            }
        }
        let peaks: Vec<String> = g.memory.iter().map(|c| bytes(c.peak)).collect();
        let gathered = g.memory.iter().map(|c| c.peak_gathered).max().unwrap_or(0);
        print!(
            "  peak memory per rank: {}; peak gathered: {}",
            peaks.join(", "),
            bytes(gathered)
        );
        if let Some(s) = sim.as_ref().and_then(|s| s.graphs.get(gi)) {
            print!(
                " (simulator: peak {}, peak gathered {})",
                bytes(s.summary.peak_total_bytes),
                bytes(s.summary.peak_gathered_bytes)
            );
        }
        println!();
    }
    let nodes: usize = run.graphs.iter().map(|g| g.nodes).sum();
    println!(
        "ran {nodes} nodes x {} ranks in {:.3} s ({:.3} us per node and rank)",
        args.world_size,
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e6 / (nodes.max(1) as f64 * f64::from(args.world_size))
    );
    Ok(())
}

fn write_outputs(path: &std::path::Path, run: &ProgramRun) -> Result<(), Failure> {
    let graphs: Vec<serde_json::Value> = run
        .graphs
        .iter()
        .map(|g| {
            let outs: Vec<serde_json::Value> = g
                .outputs
                .first()
                .map(|o| {
                    o.iter()
                        .map(|t| match t {
                            Some(t) => serde_json::json!({
                                "shape": t.shape(),
                                "dtype": t.dtype.name(),
                                "values": t.to_f64_vec().iter().map(|x| if x.is_finite() { serde_json::json!(x) } else { serde_json::json!(x.to_string()) }).collect::<Vec<_>>(),
                            }),
                            None => serde_json::Value::Null,
                        })
                        .collect()
                })
                .unwrap_or_default();
            serde_json::json!({"graph": g.graph, "outputs": outs})
        })
        .collect();
    let text = serde_json::to_string(&serde_json::json!({ "graphs": graphs }))?;
    zerosched_api::io::write_atomic(path, text.as_bytes())?;
    Ok(())
}
