use super::Failure;
use std::path::PathBuf;
use zerosched_api::request::CheckRequest;

#[derive(clap::Args)]
pub struct Args {
    /// Graph or program (`.json`, `.json.gz`, `.zsg`); the embedded default program if omitted.
    file: Option<PathBuf>,
    /// For a scheduled program: the gathered-memory budget the schedule must respect.
    #[arg(long, value_parser = super::schedule::parse_bytes)]
    budget: Option<u64>,
    /// For a scheduled program: the device-memory budget (every live byte, simulated).
    #[arg(long, value_parser = super::schedule::parse_bytes)]
    memory: Option<u64>,
    /// For a scheduled program: the cost model the memory simulation uses (as `schedule`'s).
    #[arg(long)]
    cost: Option<PathBuf>,
    /// For a scheduled program: ranks the parameters are sharded over (sizes gathered buffers).
    #[arg(long, default_value_t = 8)]
    world_size: u32,
}

pub fn run(args: Args) -> Result<(), Failure> {
    let (label, program) = input(args.file.as_deref())?;
    let request = CheckRequest {
        budget: args.budget,
        memory: args.memory,
        world_size: args.world_size,
        cost: Some(super::schedule::cost_model(args.cost.as_deref())?),
    };
    let summary = request.run(&label, &program)?;
    println!("{label}: ok");
    print!("{}", zerosched_api::summary::table(&program));
    for r in summary.schedules {
        println!(
            "schedule of {}: ok ({} gathers, {} reuses, {} releases, {} keeps, {} reductions, peak gathered {})",
            r.graph,
            r.gathers,
            r.reuses,
            r.releases,
            r.keeps,
            r.reductions,
            zerosched_api::summary::bytes(r.peak_gathered)
        );
    }
    Ok(())
}

/// The named file, or the program embedded in the binary.
pub fn input(file: Option<&std::path::Path>) -> Result<(String, zerosched_ir::Program), Failure> {
    match file {
        Some(path) => Ok((
            path.display().to_string(),
            zerosched_api::io::read_program(path)?,
        )),
        None => Ok((
            "<embedded default>".to_owned(),
            crate::default_program::load()?,
        )),
    }
}
