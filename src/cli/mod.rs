//! Command-line parsing and dispatch. Exit codes: 0 success, 1 invalid input (the message on
//! stderr names the place), 2 usage error (clap's own).

mod check;
mod convert;
mod run;
mod schedule;
mod simulate;

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
  zerosched simulate scheduled.json --report report.json";

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
    /// Execute a graph or program on N ranks, one thread each (CPU reference backend).
    Run(run::Args),
    /// Simulate a graph or program as it stands (two streams: compute, communication).
    Simulate(simulate::Args),
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
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
