//! `zerosched calibrate`: measures NCCL collectives on this machine's GPUs and writes the
//! cost model's collective table (`--cost` reads it).

use super::Failure;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Output JSON: the cost model with the measured collective table.
    #[arg(short, long)]
    output: PathBuf,
    /// Largest message, bytes (sizes run from 1 KiB in powers of two).
    #[arg(long, default_value_t = 1 << 30)]
    max_bytes: u64,
    /// Ranks, one process per GPU: without torchrun's variables, this process starts the
    /// local ones itself (as `run --executor cuda` does); with them, their `WORLD_SIZE`.
    #[arg(long)]
    world_size: Option<u32>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    if args.max_bytes < 1024 {
        return Err("--max-bytes must be at least 1024".into());
    }
    if args.world_size == Some(0) {
        return Err("--world-size must be at least 1".into());
    }
    if let Some(world) = args
        .world_size
        .filter(|&w| w > 1 && !super::cuda::launched())
    {
        if let Some(e) = super::cuda::unavailable() {
            return Err(e);
        }
        return super::spawn::local_ranks(world);
    }
    super::cuda::calibrate(&args.output, args.max_bytes, args.world_size)
}
