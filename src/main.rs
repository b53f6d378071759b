//! The `zerosched` command line.

#![forbid(unsafe_code)]

mod cli;
mod default_program;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    cli::main()
}
