//! `zerosched profile IN -o OUT`: runs the program once in numeric mode on this process's GPU
//! (world size 1), every compute node's kernels several times, and writes the program with
//! each node's median device time as its `device_time_ms`, which the cost model (and so
//! every scheduler and the simulator) takes before its estimate. The output is written whole
//! or not at all.

use super::Failure;
use std::path::PathBuf;
use zerosched_api::io::{Encoding, encode, write_atomic};
use zerosched_exec::inputs::Inputs;

#[derive(clap::Args)]
pub struct Args {
    /// Graph or program, scheduled or not; the embedded default program if omitted.
    input: Option<PathBuf>,
    /// Output: the same program with measured `device_time_ms` (format by extension).
    #[arg(short, long)]
    output: PathBuf,
    /// Timed runs of each compute node; the median is recorded.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Inputs by name, as `zerosched run --inputs` reads them; the rest are random.
    #[arg(long)]
    inputs: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    // Before reading anything: a machine without the CUDA libraries is told at once.
    if let Some(e) = super::cuda::unavailable() {
        return Err(e);
    }
    let (label, mut program) = super::check::input(args.input.as_deref())?;
    let mut inputs = Inputs::new(args.seed);
    if let Some(p) = &args.inputs {
        inputs.load(p)?;
    }
    let (timed, device) = super::cuda::profile(&mut program, &inputs, args.runs as usize)?;
    write_atomic(
        &args.output,
        &encode(&program, Encoding::from_path(&args.output)),
    )?;
    println!(
        "{label}: {timed} nodes timed on {device} (median of {} runs each) -> {}",
        args.runs,
        args.output.display()
    );
    Ok(())
}
