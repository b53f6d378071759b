use super::Failure;
use std::path::PathBuf;
use zerosched_api::io::{Encoding, encode, read_program, write_atomic};

#[derive(clap::Args)]
pub struct Args {
    /// Input graph or program, in any encoding.
    input: PathBuf,
    /// Output file; its extension picks the encoding unless `--to` is given.
    #[arg(short, long)]
    output: PathBuf,
    /// Output encoding.
    #[arg(long, value_enum)]
    to: Option<Encoding>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    let program = read_program(&args.input)?;
    let encoding = args.to.unwrap_or_else(|| Encoding::from_path(&args.output));
    write_atomic(&args.output, &encode(&program, encoding))?;
    Ok(())
}
