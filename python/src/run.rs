//! `_core.run`: a graph or program on the CPU executor, in-process. Inputs come as one
//! safetensors document (by placeholder or parameter name; anything not given is drawn from
//! the seed as `zerosched run` draws it), outputs go back as raw little-endian buffers that
//! the Python side wraps as tensors.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde::Deserialize;
use zerosched_exec::host::{Data, Tensor};
use zerosched_exec::inputs::Inputs;
use zerosched_exec::world::run_program;
use zerosched_exec_cpu::Cpu;
use zerosched_ir::Dtype;

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunOptions {
    /// Ranks (the program's schedule decides what each gathers); 1 when absent.
    world_size: Option<u32>,
    /// The seed of the inputs not given.
    seed: u64,
}

/// One output: its dtype's name, its shape, and its elements as the buffer holds them
/// (`float32`/`float64`/`bfloat16`/`float16` in their own width, integers as int64, bool as
/// one byte), or None for an output that is not a tensor.
type Out = Option<(String, Vec<usize>, Vec<u8>)>;

/// [`Out`] with the elements as Python bytes.
type PyOut<'py> = Option<(String, Vec<usize>, Bound<'py, PyBytes>)>;

fn buffer(t: &Tensor) -> (String, Vec<usize>, Vec<u8>) {
    let bytes = match (&t.data, t.dtype) {
        (Data::F32(a), Dtype::BFloat16) => a
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
        (Data::F32(a), Dtype::Float16) => a
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        (Data::F32(a), _) => a.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (Data::F64(a), _) => a.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (Data::I64(a), _) => a.iter().flat_map(|x| x.to_le_bytes()).collect(),
        (Data::Bool(a), _) => a.iter().map(|&x| u8::from(x)).collect(),
    };
    (t.dtype.to_string(), t.shape().to_vec(), bytes)
}

fn execute(data: &[u8], inputs: &[u8], o: &RunOptions) -> Result<Vec<Vec<Vec<Out>>>, String> {
    let program = zerosched_api::request::import(data).map_err(|e| e.to_string())?;
    let mut given = Inputs::new(o.seed);
    if !inputs.is_empty() {
        given
            .load_safetensors(inputs, "<inputs>")
            .map_err(|e| e.to_string())?;
    }
    let world = o.world_size.unwrap_or(1);
    let run = run_program(&program, &given, world, |_| Ok(Cpu)).map_err(|e| e.to_string())?;
    Ok(run
        .graphs
        .iter()
        .map(|g| {
            g.outputs
                .iter()
                .map(|rank| rank.iter().map(|t| t.as_ref().map(buffer)).collect())
                .collect()
        })
        .collect())
}

/// Runs a document; returns, per graph, per rank, each output as (dtype, shape, bytes).
#[pyfunction]
#[pyo3(signature = (data, inputs, options = None))]
pub fn run<'py>(
    py: Python<'py>,
    data: &[u8],
    inputs: &[u8],
    options: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<Vec<Vec<PyOut<'py>>>>> {
    let o: RunOptions = crate::options(options)?;
    let out = py
        .detach(|| execute(data, inputs, &o))
        .map_err(crate::ZeroschedError::new_err)?;
    Ok(out
        .into_iter()
        .map(|g| {
            g.into_iter()
                .map(|r| {
                    r.into_iter()
                        .map(|t| t.map(|(d, s, b)| (d, s, PyBytes::new(py, &b))))
                        .collect()
                })
                .collect()
        })
        .collect())
}
