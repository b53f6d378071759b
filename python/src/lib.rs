//! `zerosched._core`: the Rust core in-process. Documents go in and out as bytes, options as a
//! dict read into the same request types the command line fills, and errors come back as
//! `zerosched.ZeroschedError` with the message the command line prints. The interpreter lock
//! is released while Rust works.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use serde::de::DeserializeOwned;
use zerosched_api::request::{self, CheckRequest, Error, ScheduleRequest};
use zerosched_passes::cost::{Collective, CostModel};
use zerosched_passes::simulate::{SimOptions, simulate_program};

mod run;

create_exception!(
    zerosched,
    ZeroschedError,
    PyException,
    "A document, option or schedule zerosched refuses; the message names the place."
);
create_exception!(
    zerosched,
    OverBudgetError,
    ZeroschedError,
    "No schedule fits the budget; `needed` is the smallest that works for the whole program, in \
     bytes, of the budget `kind` names (`budget`: gathered bytes, `memory`: every live byte)."
);

/// Reads an options dict (or None, for the defaults) into a request.
fn options<T: DeserializeOwned + Default>(options: Option<&Bound<'_, PyAny>>) -> PyResult<T> {
    let Some(options) = options.filter(|o| !o.is_none()) else {
        return Ok(T::default());
    };
    if !options.is_instance_of::<PyDict>() {
        return Err(PyTypeError::new_err(format!(
            "options must be a dict, not {}",
            options.get_type().name()?
        )));
    }
    // Through a JSON value: its types are strict (pythonize alone reads "8" as 8 and any
    // object as a bool), so a value of the wrong type is refused as from the command line.
    let value: serde_json::Value = pythonize::depythonize(options)
        .map_err(|e| ZeroschedError::new_err(format!("options: {e}")))?;
    request::parse(value).map_err(|e| ZeroschedError::new_err(format!("options: {e}")))
}

fn raise(py: Python<'_>, e: Error) -> PyErr {
    let message = e.to_string();
    let Some(needed) = e.needed_budget() else {
        return ZeroschedError::new_err(message);
    };
    let err = OverBudgetError::new_err(message);
    let value = err.value(py);
    let set = value
        .setattr("needed", needed)
        .and_then(|()| value.setattr("kind", e.needed_kind().unwrap_or("budget")));
    match set {
        Ok(()) => err,
        Err(setattr) => setattr,
    }
}

/// Schedules a graph or program; returns it as fx-graph v1 JSON, and the report as JSON.
#[pyfunction]
#[pyo3(signature = (data, options = None))]
fn schedule<'py>(
    py: Python<'py>,
    data: &[u8],
    options: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyBytes>, String)> {
    let request: ScheduleRequest = self::options(options)?;
    let result = py.detach(|| {
        let mut program = request::import(data)?;
        let scheduled = request.run(INPUT, &mut program)?;
        let report = String::from_utf8_lossy(&scheduled.report.to_json()).into_owned();
        Ok((zerosched_ir::json::export(&program), report))
    });
    let (json, report) = result.map_err(|e| raise(py, e))?;
    Ok((PyBytes::new(py, &json), report))
}

/// Verifies a graph or program and, if it is scheduled, checks the schedule; returns the
/// summary as JSON.
#[pyfunction]
#[pyo3(signature = (data, options = None))]
fn check(py: Python<'_>, data: &[u8], options: Option<&Bound<'_, PyAny>>) -> PyResult<String> {
    let request: CheckRequest = self::options(options)?;
    py.detach(|| {
        let program = request::import(data)?;
        Ok(request.run(INPUT, &program)?.to_json())
    })
    .map_err(|e| raise(py, e))
}

/// What `simulate`, `compute_costs` and `collective_ms` price with: the world size and cost
/// model of a schedule request, so that figures from outside (another scheduler's plan) use
/// the costs zerosched plans with.
#[derive(serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct CostRequest {
    world_size: u32,
    cost: Option<CostModel>,
}

impl Default for CostRequest {
    fn default() -> CostRequest {
        CostRequest {
            world_size: ScheduleRequest::default().world_size,
            cost: None,
        }
    }
}

impl CostRequest {
    fn read(options: Option<&Bound<'_, PyAny>>) -> PyResult<SimOptions> {
        let r: CostRequest = self::options(options)?;
        if r.world_size == 0 {
            return Err(ZeroschedError::new_err(
                "options: world_size: the world size must be at least 1",
            ));
        }
        Ok(SimOptions {
            world_size: r.world_size,
            cost: r.cost.unwrap_or_default(),
        })
    }
}

/// Simulates a graph or program as it stands (scheduled or not); returns JSON
/// `{"world_size": N, "simulation": ...}`, the simulation as the report of
/// `zerosched simulate --report` holds it.
#[pyfunction]
#[pyo3(signature = (data, options = None))]
fn simulate(py: Python<'_>, data: &[u8], options: Option<&Bound<'_, PyAny>>) -> PyResult<String> {
    let sim = CostRequest::read(options)?;
    py.detach(|| {
        let program = request::import(data)?;
        let simulation = simulate_program(&program, &sim);
        Ok(serde_json::json!({"world_size": sim.world_size, "simulation": simulation}).to_string())
    })
    .map_err(|e| raise(py, e))
}

/// Each node's time on the compute stream, ms, as the simulator and the schedulers price it:
/// JSON, one object per graph in program order, `{"graph": name, "ms": {node: ms}}`.
#[pyfunction]
#[pyo3(signature = (data, options = None))]
fn compute_costs(
    py: Python<'_>,
    data: &[u8],
    options: Option<&Bound<'_, PyAny>>,
) -> PyResult<String> {
    let sim = CostRequest::read(options)?;
    py.detach(|| {
        let program = request::import(data)?;
        let graphs: Vec<serde_json::Value> = program
            .graphs
            .iter()
            .map(|g| {
                let ms = sim.cost.compute_costs(g);
                let by_name: serde_json::Map<String, serde_json::Value> = g
                    .nodes()
                    .map(|(id, n)| (n.name.to_string(), ms[id].into()))
                    .collect();
                serde_json::json!({"graph": g.label(), "ms": by_name})
            })
            .collect();
        Ok(serde_json::Value::from(graphs).to_string())
    })
    .map_err(|e| raise(py, e))
}

/// Time of one collective, ms: `kind` is `all_gather`, `reduce_scatter` or `all_reduce`,
/// `nbytes` the full (gathered or reduced) message.
#[pyfunction]
#[pyo3(signature = (kind, nbytes, options = None))]
fn collective_ms(kind: &str, nbytes: u64, options: Option<&Bound<'_, PyAny>>) -> PyResult<f64> {
    let sim = CostRequest::read(options)?;
    let kind = match kind {
        "all_gather" => Collective::AllGather,
        "reduce_scatter" => Collective::ReduceScatter,
        "all_reduce" => Collective::AllReduce,
        other => {
            return Err(ZeroschedError::new_err(format!(
                "unknown collective `{other}` (collectives: all_gather, reduce_scatter, all_reduce)"
            )));
        }
    };
    Ok(sim.cost.collective_ms(kind, nbytes, sim.world_size))
}

/// What reports call a document that came as bytes rather than from a file.
const INPUT: &str = "<bytes>";

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("ZeroschedError", py.get_type::<ZeroschedError>())?;
    m.add("OverBudgetError", py.get_type::<OverBudgetError>())?;
    m.add_function(wrap_pyfunction!(schedule, m)?)?;
    m.add_function(wrap_pyfunction!(check, m)?)?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(compute_costs, m)?)?;
    m.add_function(wrap_pyfunction!(collective_ms, m)?)?;
    m.add_function(wrap_pyfunction!(run::run, m)?)?;
    Ok(())
}
