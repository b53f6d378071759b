//! What the command line needs from the CUDA backend (cargo feature `cuda`): every library
//! checked up front, so that a machine without them gets exit 1 and a message naming the
//! missing one, and this process's rank and device from the launch environment.

use super::Failure;

/// The reason the CUDA backend cannot run in this process, if any.
#[cfg(feature = "cuda")]
pub fn unavailable() -> Option<Failure> {
    use zerosched_exec_cuda::device::Device;
    use zerosched_exec_cuda::libs::{self, Lib};
    if let Err(e) = libs::check_all(&Lib::ALL) {
        return Some(format!("the CUDA executor cannot start: {e}").into());
    }
    match Device::count() {
        Ok(0) => Some("the CUDA executor cannot start: the driver sees no GPU".into()),
        Ok(_) => None,
        Err(e) => Some(format!("the CUDA executor cannot start: {e}").into()),
    }
}

#[cfg(not(feature = "cuda"))]
pub fn unavailable() -> Option<Failure> {
    Some(
        "this zerosched was built without the CUDA backend: build it with `cargo build --release --features cuda`"
            .into(),
    )
}

/// How a CUDA run executes the compute nodes.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub enum Mode {
    /// The kernels, on data; `steps` steps on the same inputs, the first a warm-up when
    /// there are several; the outputs kept on the host, or only their checksums.
    Numeric { steps: u32, keep_outputs: bool },
    /// Calibrated spins of the cost model's durations, on uninitialised buffers; `steps`
    /// steps, the first a warm-up when there are several.
    Replay {
        cost: zerosched_passes::cost::CostModel,
        steps: u32,
    },
}

/// What a CUDA run measured on this process's rank, besides the core's figures.
pub struct CudaRun {
    pub run: zerosched_exec::ProgramRun,
    pub rank: u32,
    pub device: String,
    /// Event-timed milliseconds of each step on the compute stream: replay, the whole step;
    /// numeric, the sum of each graph's span from its first kernel to its last (the inputs'
    /// uploads and the outputs' downloads left out).
    pub step_ms: Vec<f64>,
    /// Wall-clock milliseconds the host took to issue each step (replay): a step the host
    /// issues slower than the GPU runs it is bound by the host, not by the schedule.
    pub host_ms: Vec<f64>,
    /// Replay: the compute stream's spin time per step, ms (the cost model's total).
    pub compute_ms: Option<f64>,
    /// The pool over the last step: peak requested bytes, peak rounded bytes in use.
    pub pool_peak_requested: u64,
    pub pool_peak_in_use: u64,
}

impl CudaRun {
    /// The step time reported: the median of the steps after the warm-up (the only step when
    /// there is one).
    pub fn measured_ms(&self) -> f64 {
        median_after_warmup(&self.step_ms)
    }

    /// The host's issue time reported, as [`CudaRun::measured_ms`]; `None` where not timed.
    pub fn host_issue_ms(&self) -> Option<f64> {
        (!self.host_ms.is_empty()).then(|| median_after_warmup(&self.host_ms))
    }
}

/// The median of the steps after the first (the only step when there is one).
fn median_after_warmup(steps: &[f64]) -> f64 {
    let mut v: Vec<f64> = steps
        .iter()
        .skip(usize::from(steps.len() > 1))
        .copied()
        .collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// This process's rank and GPU: from the launch environment (torchrun, Slurm, or
/// [`super::spawn`]), else rank 0 of a world of one on GPU 0.
#[cfg(feature = "cuda")]
fn launch(world: u32) -> Result<zerosched_exec_cuda::rendezvous::Launch, Failure> {
    use zerosched_exec_cuda::rendezvous::Launch;
    match Launch::from_env()? {
        Some(l) if l.world != world => Err(format!(
            "WORLD_SIZE={} in the environment, --world-size {world} on the command line",
            l.world
        )
        .into()),
        Some(l) => Ok(l),
        None if world == 1 => Ok(Launch {
            rank: 0,
            world: 1,
            local_rank: 0,
            master: None,
        }),
        None => Err(format!(
            "--world-size {world} with the CUDA executor runs one process per GPU: launch it with torchrun (or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)"
        )
        .into()),
    }
}

/// Whether this process was launched as one rank of a world (the torchrun variables set).
pub fn launched() -> bool {
    std::env::var_os("RANK").is_some() || std::env::var_os("WORLD_SIZE").is_some()
}

/// Refuses a program with ops the numeric CUDA backend lacks, naming every such node (before
/// anything is read or the device touched; replay runs every op).
#[cfg(feature = "cuda")]
pub fn check_ops(program: &zerosched_ir::Program) -> Result<(), Failure> {
    zerosched_exec::plans::<zerosched_exec_cuda::profile::Numeric>(program)?;
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn check_ops(_program: &zerosched_ir::Program) -> Result<(), Failure> {
    Err(unavailable().unwrap_or_else(|| "no CUDA backend".into()))
}

/// Runs the program on this process's GPU, one rank of the world, after checking that the
/// rank's dry-run peak fits the GPU's free memory.
#[cfg(feature = "cuda")]
pub fn run_program(
    program: &zerosched_ir::Program,
    inputs: &zerosched_exec::inputs::Inputs,
    world: u32,
    mode: &Mode,
) -> Result<CudaRun, Failure> {
    use zerosched_exec::memory::{Limit, ensure_fits};
    use zerosched_exec::world::{HostInputs, run_rank};
    use zerosched_exec::{ProgramRun, plans};
    use zerosched_exec_cuda::backend::Cuda;
    use zerosched_exec_cuda::comm::NcclComm;
    use zerosched_exec_cuda::device::Device;
    use zerosched_exec_cuda::nccl::Comm;
    use zerosched_exec_cuda::profile::{Numeric, Spans};
    let l = launch(world)?;
    inputs.check(program)?;
    let dev = Device::open(l.local_rank as usize)?;
    let device = format!("GPU {} ({})", dev.ordinal(), dev.name()?);
    let (free, _) = dev.memory()?;
    let limit = Limit::Device {
        free: free as u64,
        from: format!("free memory of {device}, cuMemGetInfo"),
    };
    ensure_fits(program, inputs, world, &limit)?;
    let mut comm = NcclComm::new(Comm::from_launch(&dev, &l)?);
    let mut cuda = Cuda::new(&dev)?;
    let host = HostInputs::new(inputs);
    let (run, compute_ms, step_ms, host_ms) = match mode {
        Mode::Numeric {
            steps,
            keep_outputs,
        } => {
            let mut spans = Spans::default();
            let (mut last, mut step_ms) = (None, Vec::new());
            for _ in 0..(*steps).max(1) {
                let run = {
                    let plans = plans::<Numeric>(program)?;
                    cuda.pool.reset_peaks();
                    let b = Numeric::new(&mut cuda, &mut spans);
                    let (c, h, ps) = (&mut comm, &host, &plans);
                    let keep = *keep_outputs;
                    let (_, _, r) = timed_step(&dev, move || run_rank(ps, h, b, c, keep))?;
                    ProgramRun::of_rank(&plans, r)
                };
                spans.close()?;
                step_ms.push(spans.take_total_ms());
                last = Some(run);
            }
            // Numeric steps are timed per graph, so no host issue time is kept.
            (last.ok_or("no step ran")?, None, step_ms, Vec::new())
        }
        Mode::Replay { cost, steps } => {
            let r = replay_steps(&dev, &mut cuda, &mut comm, &host, program, cost, *steps)?;
            (r.run, Some(r.compute_ms), r.step_ms, r.host_ms)
        }
    };
    let pool = cuda.pool_stats();
    Ok(CudaRun {
        run,
        rank: l.rank,
        device,
        step_ms,
        host_ms,
        compute_ms,
        pool_peak_requested: pool.peak_requested,
        pool_peak_in_use: pool.peak_in_use,
    })
}

#[cfg(not(feature = "cuda"))]
pub fn run_program(
    _program: &zerosched_ir::Program,
    _inputs: &zerosched_exec::inputs::Inputs,
    _world: u32,
    _mode: &Mode,
) -> Result<CudaRun, Failure> {
    Err(unavailable().unwrap_or_else(|| "no CUDA backend".into()))
}

/// `steps` replayed steps of a program (the first a warm-up when there are several).
#[cfg(feature = "cuda")]
struct Replayed {
    /// Each step's event-timed milliseconds.
    step_ms: Vec<f64>,
    /// Each step's milliseconds of the host's issue.
    host_ms: Vec<f64>,
    /// The last step's run.
    run: zerosched_exec::ProgramRun,
    /// The cost model's compute of one step, which the spins replay.
    compute_ms: f64,
}

#[cfg(feature = "cuda")]
fn replay_steps(
    dev: &zerosched_exec_cuda::device::Device,
    cuda: &mut zerosched_exec_cuda::backend::Cuda,
    comm: &mut zerosched_exec_cuda::comm::NcclComm,
    host: &zerosched_exec::world::HostInputs<'_>,
    program: &zerosched_ir::Program,
    cost: &zerosched_passes::cost::CostModel,
    steps: u32,
) -> Result<Replayed, Failure> {
    use zerosched_exec::world::run_rank;
    use zerosched_exec::{ProgramRun, plans};
    use zerosched_exec_cuda::replay::{self, Replay, Table};
    let table = Table::new(program, cost);
    let spin = replay::calibrate(cuda)?;
    let (mut step_ms, mut host_ms, mut last) = (Vec::new(), Vec::new(), None);
    for _ in 0..steps.max(1) {
        // Plans per step: each borrows this step's backend type.
        let plans = plans::<Replay>(program)?;
        cuda.pool.reset_peaks();
        let b = Replay::new(cuda, spin, &table);
        let (c, ps) = (&mut *comm, &plans);
        let (ms, host, r) = timed_step(dev, move || run_rank(ps, host, b, c, false))?;
        step_ms.push(ms);
        host_ms.push(host);
        last = Some(ProgramRun::of_rank(&plans, r));
    }
    Ok(Replayed {
        step_ms,
        host_ms,
        run: last.ok_or("no step ran")?,
        compute_ms: table.compute_us() / 1e3,
    })
}

/// One step between two events on the compute stream, joined to the communication stream
/// first so that the step ends with its last collective; the device idle before it. Also
/// the host's wall-clock milliseconds to issue it.
#[cfg(feature = "cuda")]
fn timed_step(
    dev: &zerosched_exec_cuda::device::Device,
    run: impl FnOnce() -> Result<zerosched_exec::world::RankRun, zerosched_exec::ExecError>,
) -> Result<(f64, f64, zerosched_exec::world::RankRun), Failure> {
    use zerosched_exec_cuda::device::StreamKind;
    dev.synchronize()?;
    let mut host_ms = 0.0;
    let (ms, r) = dev.time_ms(StreamKind::Compute, || {
        let started = std::time::Instant::now();
        let r = run();
        host_ms = started.elapsed().as_secs_f64() * 1e3;
        dev.join(StreamKind::Compute, StreamKind::Comm)?;
        Ok(r)
    })?;
    Ok((ms, host_ms, r?))
}

/// `zerosched profile`: runs the program in numeric mode on this process's GPU (world size 1),
/// each compute node `runs` times, and writes the medians into the nodes' `device_time_ms`;
/// returns how many nodes it timed and the device.
#[cfg(feature = "cuda")]
pub fn profile(
    program: &mut zerosched_ir::Program,
    inputs: &zerosched_exec::inputs::Inputs,
    runs: usize,
) -> Result<(usize, String), Failure> {
    use zerosched_exec::memory::{Limit, ensure_fits};
    use zerosched_exec::plans;
    use zerosched_exec::world::{HostInputs, run_rank};
    use zerosched_exec_cuda::backend::Cuda;
    use zerosched_exec_cuda::comm::NcclComm;
    use zerosched_exec_cuda::device::Device;
    use zerosched_exec_cuda::nccl::Comm;
    use zerosched_exec_cuda::profile::{Numeric, Times};
    if let Some(e) = unavailable() {
        return Err(e);
    }
    let l = launch(1)?;
    let mut times = Times::new(program);
    let device = {
        let p: &zerosched_ir::Program = program;
        let plans = plans::<Numeric>(p)?;
        inputs.check(p)?;
        let dev = Device::open(l.local_rank as usize)?;
        let device = format!("GPU {} ({})", dev.ordinal(), dev.name()?);
        let (free, _) = dev.memory()?;
        let limit = Limit::Device {
            free: free as u64,
            from: format!("free memory of {device}, cuMemGetInfo"),
        };
        ensure_fits(p, inputs, 1, &limit)?;
        let mut comm = NcclComm::new(Comm::from_launch(&dev, &l)?);
        let mut cuda = Cuda::new(&dev)?;
        let host = HostInputs::new(inputs);
        let backend = Numeric::profiling(&mut cuda, runs, &mut times);
        run_rank(&plans, &host, backend, &mut comm, false)?;
        device
    };
    Ok((times.write(program), device))
}

#[cfg(not(feature = "cuda"))]
pub fn profile(
    _program: &mut zerosched_ir::Program,
    _inputs: &zerosched_exec::inputs::Inputs,
    _runs: usize,
) -> Result<(usize, String), Failure> {
    Err(unavailable().unwrap_or_else(|| "no CUDA backend".into()))
}

/// `zerosched calibrate`: one process per GPU as `torchrun` (or `--world-size`'s spawning)
/// launches it (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), or world
/// size 1 without them; a given `--world-size` must match the launch's; rank 0 writes the
/// table.
#[cfg(feature = "cuda")]
pub fn calibrate(out: &std::path::Path, max_bytes: u64, world: Option<u32>) -> Result<(), Failure> {
    use zerosched_exec_cuda::calibrate;
    use zerosched_exec_cuda::device::Device;
    use zerosched_exec_cuda::nccl::Comm;
    use zerosched_exec_cuda::pool::Pool;
    use zerosched_exec_cuda::rendezvous::Launch;
    if let Some(e) = unavailable() {
        return Err(e);
    }
    let launch = match (Launch::from_env()?, world) {
        (Some(l), None) => l,
        (_, w) => launch(w.unwrap_or(1))?,
    };
    let dev = Device::open(launch.local_rank as usize)?;
    let mut pool = Pool::new(&dev);
    let comm = Comm::from_launch(&dev, &launch)?;
    let sizes = calibrate::sizes(max_bytes);
    let table = calibrate::measure(&dev, &mut pool, &comm, &sizes)?;
    drop(pool);
    let last = table.all_gather.last().copied().unwrap_or((0, 0.0));
    let mut model = calibrate::cost_model(table);
    model.host_ms_per_node = host_ms_per_node(&dev, comm, &model, launch.world)?;
    if launch.rank == 0 {
        calibrate::write(out, &model).map_err(|e| format!("{}: {e}", out.display()))?;
        println!(
            "{}: {} sizes at world size {} on {} (all-gather of {} B: {:.3} ms); the host issues a node in {:.2} µs",
            out.display(),
            sizes.len(),
            launch.world,
            dev.name()?,
            last.0,
            last.1,
            model.host_ms_per_node * 1e3
        );
    }
    Ok(())
}

/// The host's time to issue one node: the embedded program (a real step of many short
/// kernels, which the host issues slower than the GPU runs them), scheduled for this world
/// size and replayed; the median host issue time of 5 steps after a warm-up, over the nodes
/// the simulator charges it for.
#[cfg(feature = "cuda")]
fn host_ms_per_node(
    dev: &zerosched_exec_cuda::device::Device,
    comm: zerosched_exec_cuda::nccl::Comm,
    cost: &zerosched_passes::cost::CostModel,
    world: u32,
) -> Result<f64, Failure> {
    use zerosched_exec::inputs::Inputs;
    use zerosched_exec::world::HostInputs;
    use zerosched_exec_cuda::backend::Cuda;
    use zerosched_exec_cuda::comm::NcclComm;
    use zerosched_ir::Op;
    use zerosched_passes::pipeline::{self, PipelineOptions};
    let mut program = crate::default_program::load()?;
    let opts = PipelineOptions {
        schedule: zerosched_passes::schedule::ScheduleOptions {
            world_size: world,
            ..Default::default()
        },
        ..Default::default()
    };
    pipeline::run(&pipeline::standard(), &mut program, &opts)?;
    let nodes = program
        .graphs
        .iter()
        .flat_map(|g| g.nodes())
        .filter(|(_, n)| !matches!(n.op, Op::Placeholder | Op::GetAttr | Op::Output))
        .count();
    let mut cuda = Cuda::new(dev)?;
    let mut comm = NcclComm::new(comm);
    let inputs = Inputs::new(0);
    let host = HostInputs::new(&inputs);
    let r = replay_steps(dev, &mut cuda, &mut comm, &host, &program, cost, 6)?;
    Ok(median_after_warmup(&r.host_ms) / nodes.max(1) as f64)
}

#[cfg(not(feature = "cuda"))]
pub fn calibrate(
    _out: &std::path::Path,
    _max_bytes: u64,
    _world: Option<u32>,
) -> Result<(), Failure> {
    Err(unavailable().unwrap_or_else(|| "no CUDA backend".into()))
}
