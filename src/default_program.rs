//! The program the tool runs when given no file: a real exported training step shipped inside
//! the binary, so the main job works on a fresh machine with nothing else present.

use zerosched_ir::{ImportError, Program};

/// Llama-style dense decoder, 2 layers, exported by `python -m zerosched.export` (see
/// docs/export.md): forward and backward graphs of one training step.
const BYTES: &[u8] = include_bytes!("../tests/fixtures/llama.program.json");

pub fn load() -> Result<Program, ImportError> {
    zerosched_ir::import(BYTES)
}
