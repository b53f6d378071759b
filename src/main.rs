//! The `zerosched` command line.

mod cli;

// mimalloc: an import builds tens of thousands of small nodes; freeing them with the system
// allocator took a fifth of the instructions `check` spent on the 80-layer program, and
// mimalloc takes a third of that.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    cli::main()
}
