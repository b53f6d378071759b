use super::Failure;
use std::path::PathBuf;
use zerosched_api::report::Report;
use zerosched_passes::simulate::SimOptions;

#[derive(clap::Args)]
pub struct Args {
    /// Graph or program, scheduled or not; the embedded default program if omitted.
    input: Option<PathBuf>,
    /// Ranks the parameters are sharded over.
    #[arg(long, default_value_t = 8)]
    world_size: u32,
    /// Cost model as JSON.
    #[arg(long)]
    cost: Option<PathBuf>,
    /// Write the report as JSON.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace of the simulated timeline.
    #[arg(long)]
    trace: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    if args.world_size == 0 {
        return Err("--world-size must be at least 1".into());
    }
    let (label, program) = super::check::input(args.input.as_deref())?;
    let sim = SimOptions {
        world_size: args.world_size,
        cost: super::schedule::cost_model(args.cost.as_deref())?,
    };
    let report = Report::new(&label, &program, None, None, (u64::MAX, u64::MAX), &sim);
    print!("{}", report.table());
    super::schedule::write_outputs(
        &program,
        &report,
        args.report.as_deref(),
        args.trace.as_deref(),
    )
}
