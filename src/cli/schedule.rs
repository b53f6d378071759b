use super::Failure;
use std::path::PathBuf;
use zerosched_api::io::{Encoding, encode, write_atomic};
use zerosched_api::report::Report;
use zerosched_api::request::{ScheduleRequest, Scheduled};
use zerosched_passes::cost::CostModel;
use zerosched_passes::simulate::trace::chrome_trace;

#[derive(clap::Args)]
pub struct Args {
    /// Graph or program; the embedded default program if omitted.
    input: Option<PathBuf>,
    /// Where to write the scheduled program (`.json`, `.json.gz` or `.zsg`).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Most bytes of gathered parameters alive at once (`40GiB`, `512MiB`, `1e9`).
    #[arg(long, value_parser = parse_bytes)]
    budget: Option<u64>,
    /// Ranks the parameters are sharded over.
    #[arg(long, default_value_t = 8)]
    world_size: u32,
    /// Scheduler: `prefetch` (budgeted prefetch with buckets), `jit`, or `deepcompile`.
    #[arg(long, default_value = "prefetch")]
    scheduler: String,
    /// Cost model as JSON (rates, launch overhead, alpha-beta or a measured table).
    #[arg(long)]
    cost: Option<PathBuf>,
    /// Switch a pass off (`insert`, `schedule`, `keep`).
    #[arg(long)]
    disable: Vec<String>,
    /// Write the program as it is after this pass to `<output stem>.after-<pass>.json` (or
    /// `.txt` for a listing).
    #[arg(long)]
    dump_after: Vec<String>,
    /// How `--dump-after` writes: an fx-graph v1 document, or a readable listing (one line per
    /// node).
    #[arg(long, value_enum, default_value_t = DumpFormat::Json)]
    dump_format: DumpFormat,
    /// Write the report as JSON.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace of the simulated timeline.
    #[arg(long)]
    trace: Option<PathBuf>,
}

pub use zerosched_api::request::parse_bytes;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum DumpFormat {
    Json,
    Listing,
}

fn request(args: &Args) -> Result<ScheduleRequest, Failure> {
    Ok(ScheduleRequest {
        budget: args.budget,
        world_size: args.world_size,
        scheduler: args.scheduler.clone(),
        cost: args.cost.as_deref().map(read_cost).transpose()?,
        disable: args.disable.clone(),
        dump_after: args.dump_after.clone(),
        verify: true,
    })
}

fn read_cost(path: &std::path::Path) -> Result<CostModel, Failure> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(CostModel::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))?)
}

/// The cost model from a JSON file, or the default.
pub fn cost_model(path: Option<&std::path::Path>) -> Result<CostModel, Failure> {
    Ok(path.map(read_cost).transpose()?.unwrap_or_default())
}

pub fn run(args: Args) -> Result<(), Failure> {
    let request = request(&args)?;
    // Options first: a bad flag is reported before the input is read.
    request.pipeline_options()?;
    let (label, mut program) = super::check::input(args.input.as_deref())?;
    let Scheduled { context, report } = request.run(&label, &mut program)?;
    print!("{}", report.table());
    if let Some(path) = &args.output {
        write_atomic(path, &encode(&program, Encoding::from_path(path)))?;
        for (pass, dumped) in &context.dumps {
            let (ext, bytes) = match args.dump_format {
                DumpFormat::Json => ("json", zerosched_ir::json::export(dumped)),
                DumpFormat::Listing => ("txt", zerosched_ir::listing::program(dumped).into_bytes()),
            };
            write_atomic(&path.with_extension(format!("after-{pass}.{ext}")), &bytes)?;
        }
    }
    write_outputs(
        &program,
        &report,
        args.report.as_deref(),
        args.trace.as_deref(),
    )
}

/// The JSON report and the Chrome trace, where asked for.
pub fn write_outputs(
    program: &zerosched_ir::Program,
    report: &Report,
    json: Option<&std::path::Path>,
    trace: Option<&std::path::Path>,
) -> Result<(), Failure> {
    if let Some(path) = json {
        write_atomic(path, &report.to_json())?;
    }
    if let Some(path) = trace {
        write_atomic(
            path,
            &chrome_trace(&program.graphs, &report.simulation.graphs),
        )?;
    }
    Ok(())
}
