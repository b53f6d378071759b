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
    "No schedule fits the budget; `needed` is the smallest budget that works, in bytes."
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
    match err.value(py).setattr("needed", needed) {
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
    m.add_function(wrap_pyfunction!(run::run, m)?)?;
    Ok(())
}
