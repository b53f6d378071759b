//! `zerosched run`: executes a graph or program over N ranks (threads of this process, or with
//! `--executor cuda` one process per GPU) and prints what it computed and the memory it
//! measured (beside the simulator's prediction when scheduled); `--replay` measures the step
//! on the GPU with spins of the cost model's durations instead of the kernels. A run that
//! needs more memory than the host (or the GPU) has is refused before it starts.

use super::Failure;
use super::cuda::{CudaRun, Mode};
use std::path::PathBuf;
use zerosched_api::summary::bytes;
use zerosched_exec::ProgramRun;
use zerosched_exec::dry::Dry;
use zerosched_exec::inputs::Inputs;
use zerosched_exec::memory::{Limit, ensure_fits};
use zerosched_exec::world::run_program;
use zerosched_exec_cpu::Cpu;
use zerosched_ir::Program;
use zerosched_passes::simulate::{ProgramSim, SimOptions, simulate_program};

#[derive(clap::Args)]
pub struct Args {
    /// Graph or program, scheduled or not; the embedded default program if omitted.
    input: Option<PathBuf>,
    /// Executor backend: `cpu` (reference), or `cuda` (a build with the `cuda` feature, on a
    /// machine with the CUDA libraries and a GPU).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
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
    /// Replay mode (`--executor cuda`): every compute node spins on the GPU for its cost-model
    /// duration (its `device_time_ms` when profiled); allocations and collectives are real,
    /// on uninitialised buffers. Prints the measured step, exposed communication and pool
    /// peak beside the simulator's.
    #[arg(long, conflicts_with_all = ["dry_run", "outputs"])]
    replay: bool,
    /// Steps on the GPU (`--executor cuda`, on the same inputs); the first is a warm-up when
    /// there are several, the median of the rest is reported. Default: 3 for `--replay`,
    /// else 1.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    steps: Option<u32>,
    /// Cost model JSON (as `schedule --cost`): replay's durations and the simulator's
    /// prediction; the default model if omitted.
    #[arg(long)]
    cost: Option<PathBuf>,
    /// Write the run's figures (measured and simulated step, exposed communication, peaks)
    /// as JSON (rank 0's, with `--executor cuda`).
    #[arg(long)]
    report: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    if args.world_size == 0 {
        return Err("--world-size must be at least 1".into());
    }
    // Before reading anything: a machine without the CUDA libraries is told at once.
    if args.executor == "cuda"
        && let Some(e) = super::cuda::unavailable()
    {
        return Err(e);
    }
    if args.replay && args.executor != "cuda" {
        return Err("--replay runs on the GPU: it needs --executor cuda".into());
    }
    let cost = super::schedule::cost_model(args.cost.as_deref())?;
    // Without a launcher, the CUDA executor starts one process per local GPU itself.
    if args.executor == "cuda" && !args.dry_run && args.world_size > 1 && !super::cuda::launched() {
        return super::spawn::local_ranks(args.world_size);
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
    // Ops the numeric CUDA backend lacks are refused before an inputs file (perhaps large)
    // is read.
    if args.executor == "cuda" && !args.replay && !args.dry_run {
        super::cuda::check_ops(&program)?;
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
    let sim_opts = SimOptions {
        world_size: world,
        cost: cost.clone(),
    };
    let (run, cuda) = if args.dry_run {
        (run_program(&program, &inputs, world, |_| Ok(Dry))?, None)
    } else if args.executor == "cuda" {
        let mode = if args.replay {
            Mode::Replay {
                cost,
                steps: args.steps.unwrap_or(3),
            }
        } else {
            Mode::Numeric {
                steps: args.steps.unwrap_or(1),
                keep_outputs: args.outputs.is_some(),
            }
        };
        let c = super::cuda::run_program(&program, &inputs, world, &mode)?;
        (c.run.clone(), Some(c))
    } else {
        let limit = args.memory_limit.map_or(Limit::Host, Limit::Bytes);
        ensure_fits(&program, &inputs, world, &limit)?;
        (run_program(&program, &inputs, world, |_| Ok(Cpu))?, None)
    };
    let sim = report(&program, &run, &args, &sim_opts, started)?;
    let rank0 = cuda.as_ref().is_none_or(|c| c.rank == 0);
    if let Some(c) = &cuda {
        report_cuda(c, sim.as_ref(), args.replay);
    }
    if let Some(path) = args.report.as_ref().filter(|_| rank0) {
        let json = figures(&label, &args, &run, cuda.as_ref(), sim.as_ref());
        zerosched_api::io::write_atomic(path, serde_json::to_string_pretty(&json)?.as_bytes())?;
    }
    if let Some(path) = args.outputs.as_ref().filter(|_| !args.dry_run && rank0) {
        write_outputs(path, &run)?;
    }
    Ok(())
}

/// The GPU's figures: the event-timed step, and in replay the exposed communication (the
/// step less the compute stream's spins) and the pool's peak, each beside the simulator's.
fn report_cuda(c: &CudaRun, sim: Option<&ProgramSim>, replay: bool) {
    let step = c.measured_ms();
    let steps = c.step_ms.len();
    let how = if steps > 1 {
        format!("median of {} after a warm-up", steps - 1)
    } else {
        "one step".to_owned()
    };
    let sim_total = sim.map(|s| &s.total);
    let mut line = format!(
        "rank {} on {}: step {step:.3} ms ({how}, events on the compute stream{})",
        c.rank,
        c.device,
        if replay {
            ""
        } else {
            ", each graph from its first kernel to its last"
        }
    );
    if let Some(t) = sim_total.filter(|_| replay) {
        line += &format!(
            "; simulator {:.3} ms, measured/simulated {:.3}",
            t.step_ms,
            step / t.step_ms.max(f64::MIN_POSITIVE)
        );
    }
    println!("{line}");
    if let Some(host) = c.host_issue_ms() {
        print!(
            "  host issued the step in {host:.3} ms{}",
            if host >= 0.9 * step {
                " (host-bound: the GPU waited for launches)"
            } else {
                ""
            }
        );
        if let Some(t) = sim_total.filter(|t| t.host_wait_ms > 0.0) {
            print!(
                "; the simulator's compute waits {:.3} ms for the host",
                t.host_wait_ms
            );
        }
        println!();
    }
    if let Some(compute) = c.compute_ms {
        let exposed = (step - compute).max(0.0);
        print!("  exposed communication {exposed:.3} ms (step less {compute:.3} ms of compute)");
        if let Some(t) = sim_total {
            print!("; simulator {:.3} ms", t.exposed_comm_ms);
        }
        println!();
    }
    print!(
        "  pool peak {} requested, {} in use",
        bytes(c.pool_peak_requested),
        bytes(c.pool_peak_in_use)
    );
    if let Some(t) = sim_total {
        print!("; simulator peak {}", bytes(t.peak_total_bytes));
    }
    println!();
    for g in &c.run.graphs {
        let Some(h) = g.memory.first().and_then(|m| m.held.as_ref()) else {
            continue;
        };
        // Carried values count in the pool only; what matters is growth within the graph.
        if h.max - h.start < 1 << 20 {
            continue;
        }
        let grown: Vec<String> = h
            .growth
            .iter()
            .map(|(n, t, b)| format!("{n} ({t}) +{}", bytes(*b as u64)))
            .collect();
        println!(
            "  {}: pool above the executor's count by {} at most (after {}; {} at the start); grown most at {}",
            g.graph,
            bytes(h.max.max(0) as u64),
            h.at,
            bytes(h.start.max(0) as u64),
            grown.join(", ")
        );
    }
}

/// The run's figures as JSON (`--report`).
fn figures(
    label: &str,
    args: &Args,
    run: &ProgramRun,
    cuda: Option<&CudaRun>,
    sim: Option<&ProgramSim>,
) -> serde_json::Value {
    let mode = if args.dry_run {
        "dry-run"
    } else if args.replay {
        "replay"
    } else {
        "numeric"
    };
    serde_json::json!({
        "input": label,
        "executor": args.executor,
        "mode": mode,
        "scheduler": args.scheduler,
        "world_size": args.world_size,
        "peak_per_rank": run.peak_per_rank(),
        "peak_gathered": run.peak_gathered(),
        // Rank 0's outputs per graph: [sum, absolute sum] (null without data).
        "checksums": run.graphs.iter().map(|g| {
            g.checksums.first().map(|sums| sums.iter().map(|s| s.map(|(sum, abs)| [sum, abs]))
                .collect::<Vec<_>>())
        }).collect::<Vec<_>>(),
        "cuda": cuda.map(|c| serde_json::json!({
            "rank": c.rank,
            "device": c.device,
            "step_ms": c.step_ms,
            "measured_step_ms": c.measured_ms(),
            "host_issue_ms": c.host_issue_ms(),
            "compute_ms": c.compute_ms,
            "exposed_comm_ms": c.compute_ms.map(|m| (c.measured_ms() - m).max(0.0)),
            "pool_peak_requested": c.pool_peak_requested,
            "pool_peak_in_use": c.pool_peak_in_use,
        })),
        "simulator": sim.map(|s| serde_json::json!({
            "step_ms": s.total.step_ms,
            "compute_ms": s.total.compute_ms,
            "exposed_comm_ms": s.total.exposed_comm_ms,
            "host_wait_ms": s.total.host_wait_ms,
            "peak_total_bytes": s.total.peak_total_bytes,
            "peak_gathered_bytes": s.total.peak_gathered_bytes,
        })),
    })
}

/// Prints the outputs and memory per graph; returns the simulator's prediction (of a
/// scheduled program, or of any replayed one).
fn report(
    program: &Program,
    run: &ProgramRun,
    args: &Args,
    sim_opts: &SimOptions,
    started: std::time::Instant,
) -> Result<Option<ProgramSim>, Failure> {
    let elapsed = started.elapsed();
    let scheduled = program.graphs.iter().any(|g| {
        g.nodes()
            .any(|(_, n)| zerosched_ir::comm::CommOp::of(n).is_some())
    });
    let sim = (scheduled || args.replay).then(|| simulate_program(program, sim_opts));
    for (gi, g) in run.graphs.iter().enumerate() {
        println!("graph {}: {} nodes", g.graph, g.nodes);
        let returns = program.graphs[gi].output_values();
        let sums = g.checksums.first();
        if let Some(outs) = g.outputs.first() {
            for (slot, o) in outs.iter().enumerate() {
                let sum = sums.and_then(|s| s.get(slot).copied().flatten());
                match (o, sum) {
                    (Some(t), _) => {
                        let (sum, abs) = t.checksum();
                        println!(
                            "  output {slot}: {:?} {} sum {sum:.9e} abs-sum {abs:.9e}",
                            t.shape(),
                            t.dtype
                        );
                    }
                    // Not kept on the host (a GPU run without `--outputs`).
                    (None, Some((sum, abs))) => {
                        println!("  output {slot}: sum {sum:.9e} abs-sum {abs:.9e}")
                    }
                    (None, None)
                        if (args.dry_run || args.replay)
                            && returns.get(slot).is_some_and(|a| a.as_node().is_some()) =>
                    {
                        println!("  output {slot}: (no data)")
                    }
                    (None, None) => println!("  output {slot}: None"),
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
    Ok(sim)
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
