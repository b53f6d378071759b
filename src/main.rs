//! The `zerosched` command line.

#![forbid(unsafe_code)]

mod cli;
mod default_program;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    log_from_env();
    cli::main()
}

/// `RUST_LOG` (`zerosched=debug`, `zerosched_passes::keep=debug`, ...) prints, on stderr, why
/// the passes decided what they did. Without it no subscriber is installed, so the passes'
/// events cost a disabled-callsite check and the output is the same as ever.
fn log_from_env() {
    use tracing_subscriber::EnvFilter;
    if std::env::var_os(EnvFilter::DEFAULT_ENV).is_none() {
        return;
    }
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .without_time()
        .init();
}
