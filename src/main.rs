//! The `zerosched` command line.

mod cli;

#[global_allocator]
static GLOBAL: zerosched::alloc::Mimalloc = zerosched::alloc::Mimalloc;

fn main() -> std::process::ExitCode {
    cli::main()
}
