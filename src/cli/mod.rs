//! Command-line parsing and dispatch. Exit codes: 0 success, 1 invalid input (the message on
//! stderr names the place), 2 usage error (clap's own).

mod calibrate;
mod check;
mod convert;
mod cuda;
mod profile;
mod run;
mod schedule;
mod simulate;
mod spawn;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

const EXAMPLES: &str = "\
Examples:
  zerosched check                              check the embedded default program
  zerosched check tests/fixtures/llama.program.json
  zerosched convert llama.program.json -o llama.zsg      JSON to binary
  zerosched convert llama.zsg -o llama.json.gz           binary to gzip JSON
  zerosched schedule                           schedule the embedded default program
  zerosched schedule llama.program.json --budget 2GiB --world-size 8 -o scheduled.json
  zerosched schedule llama.program.json --scheduler deepcompile --trace trace.json
  zerosched simulate scheduled.json --report report.json
  zerosched calibrate -o table.json            measure NCCL collectives (CUDA build)
  zerosched profile llama.json -o profiled.json   measured node times (CUDA build)
  zerosched run scheduled.json --executor cuda --replay   the step on the GPU, spins for kernels";

#[derive(Parser)]
#[command(name = "zerosched", version, about = "ZeRO-3 communication scheduling for exported PyTorch training graphs", after_help = EXAMPLES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Verify a graph or program and print its summary.
    Check(check::Args),
    /// Convert between JSON (`.json`, `.json.gz`) and the binary form (`.zsg`).
    Convert(convert::Args),
    /// Insert the ZeRO-3 ops, schedule them, check, simulate, and print a summary.
    Schedule(schedule::Args),
    /// Execute a graph or program on N ranks: threads of this process (CPU reference
    /// backend), or one process per GPU (`--executor cuda`, numeric or `--replay`).
    Run(run::Args),
    /// Time each compute node's kernels on the GPU and record the medians in the graph's
    /// metadata (`device_time_ms`), which the cost model then takes (needs the `cuda` build).
    Profile(profile::Args),
    /// Simulate a graph or program as it stands (two streams: compute, communication).
    Simulate(simulate::Args),
    /// Measure NCCL all-gather/reduce-scatter/all-reduce times into a cost model (needs the
    /// `cuda` build and GPUs).
    Calibrate(calibrate::Args),
}

/// A failure the tool reports: always about the input, so exit code 1.
pub type Failure = Box<dyn std::error::Error>;

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(a) => check::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Schedule(a) => schedule::run(a),
        Command::Simulate(a) => simulate::run(a),
        Command::Run(a) => run::run(a),
        Command::Profile(a) => profile::run(a),
        Command::Calibrate(a) => calibrate::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
