use super::Failure;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Graph or program (`.json`, `.json.gz`, `.zsg`); the embedded default program if omitted.
    file: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    let (label, program) = input(args.file.as_deref())?;
    println!("{label}: ok");
    print!("{}", zerosched::summary::table(&program));
    Ok(())
}

/// The named file, or the program embedded in the binary.
pub fn input(file: Option<&std::path::Path>) -> Result<(String, zerosched_ir::Program), Failure> {
    match file {
        Some(path) => Ok((
            path.display().to_string(),
            zerosched::io::read_program(path)?,
        )),
        None => Ok((
            "<embedded default>".to_owned(),
            zerosched::default_program::load()?,
        )),
    }
}
