use super::Failure;
use std::collections::BTreeSet;
use std::path::PathBuf;
use zerosched::io::{Encoding, encode, write_atomic};
use zerosched::report::Report;
use zerosched_passes::cost::CostModel;
use zerosched_passes::pipeline::{self, PipelineOptions};
use zerosched_passes::schedule::ScheduleOptions;
use zerosched_passes::simulate::SimOptions;
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
    /// Write the program as it is after this pass to `<output stem>.after-<pass>.json`.
    #[arg(long)]
    dump_after: Vec<String>,
    /// Write the report as JSON.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace of the simulated timeline.
    #[arg(long)]
    trace: Option<PathBuf>,
}

pub fn parse_bytes(s: &str) -> Result<u64, String> {
    s.parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("not a byte size: {e}"))
}

fn options(args: &Args) -> Result<PipelineOptions, Failure> {
    let known = pipeline::pass_names();
    for name in args.disable.iter().chain(&args.dump_after) {
        if !known.contains(&name.as_str()) {
            return Err(format!("unknown pass `{name}` (passes: {})", known.join(", ")).into());
        }
    }
    if !zerosched_passes::schedule::NAMES.contains(&args.scheduler.as_str()) {
        let names = zerosched_passes::schedule::NAMES.join(", ");
        return Err(format!(
            "unknown scheduler `{}` (schedulers: {names})",
            args.scheduler
        )
        .into());
    }
    if args.world_size == 0 {
        return Err("--world-size must be at least 1".into());
    }
    let cost = match &args.cost {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            CostModel::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => CostModel::default(),
    };
    Ok(PipelineOptions {
        schedule: ScheduleOptions {
            budget: args.budget.unwrap_or(u64::MAX),
            world_size: args.world_size,
            cost,
        },
        scheduler: args.scheduler.clone(),
        disabled: args.disable.iter().cloned().collect::<BTreeSet<_>>(),
        dump_after: args.dump_after.iter().cloned().collect(),
        verify: true,
    })
}

/// The cost model from a JSON file, or the default.
pub fn cost_model(path: Option<&std::path::Path>) -> Result<CostModel, Failure> {
    let Some(path) = path else {
        return Ok(CostModel::default());
    };
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(CostModel::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))?)
}

pub fn run(args: Args) -> Result<(), Failure> {
    let opts = options(&args)?;
    let (label, mut program) = super::check::input(args.input.as_deref())?;
    let cx = pipeline::run(&pipeline::standard(), &mut program, &opts)?;
    let sim = SimOptions {
        world_size: opts.schedule.world_size,
        cost: opts.schedule.cost.clone(),
    };
    let report = Report::new(
        &label,
        &program,
        Some(&cx),
        Some(&opts.scheduler),
        opts.schedule.budget,
        &sim,
    );
    print!("{}", report.table());
    if let Some(path) = &args.output {
        write_atomic(path, &encode(&program, Encoding::from_path(path)))?;
        for (pass, dumped) in &cx.dumps {
            let dump = path.with_extension(format!("after-{pass}.json"));
            write_atomic(&dump, &zerosched_ir::json::export(dumped))?;
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
