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

/// This process's rank and GPU: from the launch environment (torchrun, Slurm), else rank 0 of
/// a world of one on GPU 0.
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

/// Runs the program on this process's GPU, one rank of the world.
#[cfg(feature = "cuda")]
pub fn run_program(
    program: &zerosched_ir::Program,
    inputs: &zerosched_exec::inputs::Inputs,
    world: u32,
) -> Result<zerosched_exec::ProgramRun, Failure> {
    use zerosched_exec::BackendError;
    use zerosched_exec_cuda::backend::Cuda;
    use zerosched_exec_cuda::comm::NcclComm;
    use zerosched_exec_cuda::device::Device;
    use zerosched_exec_cuda::nccl::Comm;
    let l = launch(world)?;
    let plans = zerosched_exec::plans::<Cuda>(program)?;
    inputs.check(program)?;
    let dev = Device::open(l.local_rank as usize)?;
    let comm = NcclComm::new(Comm::from_launch(&dev, &l)?);
    let run = zerosched_exec::world::run_threads(&plans, inputs, vec![comm], |_| {
        Cuda::new(&dev).map_err(|e| BackendError::Device(e.to_string()))
    })?;
    Ok(run)
}

#[cfg(not(feature = "cuda"))]
pub fn run_program(
    _program: &zerosched_ir::Program,
    _inputs: &zerosched_exec::inputs::Inputs,
    _world: u32,
) -> Result<zerosched_exec::ProgramRun, Failure> {
    Err(unavailable().unwrap_or_else(|| "no CUDA backend".into()))
}

/// `zerosched calibrate`: one process per GPU as `torchrun` launches it (`RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), or world size 1 without them;
/// rank 0 writes the table.
#[cfg(feature = "cuda")]
pub fn calibrate(out: &std::path::Path, max_bytes: u64) -> Result<(), Failure> {
    use zerosched_exec_cuda::calibrate;
    use zerosched_exec_cuda::device::Device;
    use zerosched_exec_cuda::nccl::Comm;
    use zerosched_exec_cuda::pool::Pool;
    use zerosched_exec_cuda::rendezvous::Launch;
    if let Some(e) = unavailable() {
        return Err(e);
    }
    let launch = match Launch::from_env()? {
        Some(l) => l,
        None => launch(1)?,
    };
    let dev = Device::open(launch.local_rank as usize)?;
    let mut pool = Pool::new(&dev);
    let comm = Comm::from_launch(&dev, &launch)?;
    let sizes = calibrate::sizes(max_bytes);
    let table = calibrate::measure(&dev, &mut pool, &comm, &sizes)?;
    if launch.rank == 0 {
        let last = table.all_gather.last().copied().unwrap_or((0, 0.0));
        calibrate::write(out, &calibrate::cost_model(table))
            .map_err(|e| format!("{}: {e}", out.display()))?;
        println!(
            "{}: {} sizes at world size {} on {} (all-gather of {} B: {:.3} ms)",
            out.display(),
            sizes.len(),
            launch.world,
            dev.name()?,
            last.0,
            last.1
        );
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn calibrate(_out: &std::path::Path, _max_bytes: u64) -> Result<(), Failure> {
    Err(unavailable().unwrap_or_else(|| "no CUDA backend".into()))
}
