//! `meta.val`, shapes and dtypes: checked conversion from JSON values, naming the failing field.

use crate::{Dim, Dtype, Problem, SymInt, TensorMeta, Val};
use serde_json::{Map, Value};

/// A problem at a field path relative to where conversion started.
pub(super) type FieldError = (String, Problem);

pub(super) fn val(v: &Value) -> Result<Option<Val>, FieldError> {
    Ok(Some(match v {
        Value::Null => return Ok(None),
        Value::Bool(b) => Val::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Val::Int(i),
            None => Val::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::Array(items) => Val::Tuple(
            items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::Null => Ok(None),
                    Value::Object(o) => tensor(o)
                        .map(|t| Some(t.into()))
                        .map_err(|(f, p)| (format!("[{i}].{f}"), p)),
                    other => Err((
                        format!("[{i}]"),
                        bad(format!("expected a TENSOR or null, found {other}")),
                    )),
                })
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(o) if o.contains_key("sym") => {
            Val::Sym(sym(v).map_err(|p| (String::new(), p))?)
        }
        Value::Object(o) => Val::Tensor(tensor(o)?.into()),
        Value::String(s) => {
            return Err((
                String::new(),
                bad(format!(
                    "expected a TENSOR, list, SYM or null, found \"{s}\""
                )),
            ));
        }
    }))
}

pub(super) fn tensor(o: &Map<String, Value>) -> Result<TensorMeta, FieldError> {
    let dims = match o.get("shape") {
        Some(Value::Array(dims)) => shape(dims).map_err(|(f, p)| (format!("shape{f}"), p))?,
        Some(_) => return Err(("shape".into(), bad("expected an array".into()))),
        None => return Err(("shape".into(), Problem::Missing)),
    };
    let dtype = match o.get("dtype") {
        Some(Value::String(s)) => dtype(s).map_err(|p| ("dtype".to_owned(), p))?,
        Some(other) => {
            return Err((
                "dtype".into(),
                Problem::UnknownDtype {
                    value: other.to_string(),
                },
            ));
        }
        None => return Err(("dtype".into(), Problem::Missing)),
    };
    let stride = match o.get("stride") {
        None | Some(Value::Null) => None,
        Some(Value::Array(dims)) => Some(shape(dims).map_err(|(f, p)| (format!("stride{f}"), p))?),
        Some(_) => return Err(("stride".into(), bad("expected an array".into()))),
    };
    let storage_offset = match o.get("storage_offset") {
        None | Some(Value::Null) => None,
        Some(v) => Some(dim(v).map_err(|p| ("storage_offset".to_owned(), p))?),
    };
    let device = match o.get("device") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.into()),
        Some(_) => return Err(("device".into(), bad("expected a string".into()))),
    };
    let requires_grad = match o.get("requires_grad") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => return Err(("requires_grad".into(), bad("expected a boolean".into()))),
    };
    Ok(TensorMeta {
        shape: dims,
        dtype,
        stride,
        storage_offset,
        device,
        requires_grad,
    })
}

/// A shape or stride; the error's field is `[i]`.
pub(super) fn shape(dims: &[Value]) -> Result<Vec<Dim>, FieldError> {
    dims.iter()
        .enumerate()
        .map(|(i, d)| dim(d).map_err(|p| (format!("[{i}]"), p)))
        .collect()
}

fn dim(v: &Value) -> Result<Dim, Problem> {
    match v {
        Value::Number(n) => n.as_u64().map(Dim::Const).ok_or(Problem::BadShape {
            value: n.to_string(),
        }),
        Value::Object(o) if o.contains_key("sym") => {
            let s = sym(v)?;
            if s.hint < 0 {
                return Err(Problem::BadShape {
                    value: v.to_string(),
                });
            }
            Ok(Dim::Sym(s))
        }
        other => Err(Problem::BadShape {
            value: other.to_string(),
        }),
    }
}

fn sym(v: &Value) -> Result<SymInt, Problem> {
    let expr = v.get("sym").and_then(Value::as_str);
    let hint = v.get("hint").and_then(Value::as_i64);
    match (expr, hint) {
        (Some(expr), Some(hint)) => Ok(SymInt {
            expr: expr.into(),
            hint,
        }),
        _ => Err(bad(format!(
            "a SYM needs a string `sym` and an integer `hint`, found {v}"
        ))),
    }
}

pub(super) fn dtype(s: &str) -> Result<Dtype, Problem> {
    Dtype::from_name(s).ok_or_else(|| Problem::UnknownDtype {
        value: s.to_owned(),
    })
}

fn bad(message: String) -> Problem {
    Problem::BadValue { message }
}
