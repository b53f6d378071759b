//! Kernel tests through the executor: a one-node graph document, its inputs given by name.

use zerosched_exec::host::Tensor;
use zerosched_exec::inputs::{Given, Inputs};
use zerosched_exec::world::run_program;

/// Runs `target(args)` (args as fx-graph v1 JSON, placeholders `x0`, `x1`, ... for the inputs)
/// and returns its outputs, or the executor's error message.
pub(crate) fn run1(
    target: &str,
    inputs: &[Tensor],
    args: &str,
    out: &str,
) -> Result<Vec<Option<Tensor>>, String> {
    let mut nodes = Vec::new();
    let mut given = Inputs::new(0);
    for (i, t) in inputs.iter().enumerate() {
        nodes.push(format!(
            r#"{{"name":"x{i}","op":"placeholder","target":"x{i}","args":[],"kwargs":{{}},"meta":{{"val":{{"dtype":"{}","shape":{:?}}}}}}}"#,
            t.dtype,
            t.shape()
        ));
        let file = "test".to_owned();
        given.given.insert(
            format!("x{i}"),
            Given {
                tensor: t.clone(),
                file,
            },
        );
    }
    nodes.push(format!(
        r#"{{"name":"y","op":"call_function","target":"{target}","args":{args},"kwargs":{{}},"meta":{{"val":{out}}}}}"#
    ));
    nodes.push(r#"{"name":"output","op":"output","target":"output","args":[[{"node":"y"}]],"kwargs":{},"meta":{}}"#.to_owned());
    let doc = format!(
        r#"{{"format":"fx-graph","version":1,"kind":"inference","name":"t","params":[],"nodes":[{}]}}"#,
        nodes.join(",")
    );
    let p = zerosched_ir::import(doc.as_bytes()).map_err(|e| e.to_string())?;
    let run = run_program(&p, &given, 1, |_| Ok(crate::Cpu)).map_err(|e| e.to_string())?;
    Ok(run.graphs[0].outputs[0].clone())
}

/// An f32 tensor of `shape` from row-major values.
pub(crate) fn f32s(shape: &[usize], v: &[f32]) -> Tensor {
    let a = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(shape), v.to_vec()).expect("shape");
    <f32 as zerosched_exec::host::Elem>::wrap(a, zerosched_ir::Dtype::Float32).expect("f32")
}
