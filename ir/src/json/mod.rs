//! fx-graph v1 JSON: import ([`import`]) and deterministic export ([`export`]).
//!
//! Import parses into plain serde structs (no DOM), lowers them to the IR while collecting
//! every naming and reference problem, then runs the structural verifier. Export writes one
//! node per line with fixed field order, so equal graphs give equal bytes.

mod arg_serde;
mod lower;
mod raw;
mod values;
mod write;

pub use write::{export, export_graph};

use crate::{ImportError, Program};

/// Imports an `fx-graph` or `fx-program` document.
pub fn import(bytes: &[u8]) -> Result<Program, ImportError> {
    // One pass for the common case, a well-formed document: header and body together.
    if let Ok(doc) = serde_json::from_slice::<raw::RawDoc>(bytes) {
        let (header, graph, bundle) = doc.split();
        let program = if header.check()? {
            lower::program(bundle)?
        } else {
            lower::single(graph)?
        };
        crate::verify::program(&program)?;
        return Ok(program);
    }
    // Otherwise the careful path, for the right error: the header alone first (a newer
    // version is refused before its body is read), then the body as its kind.
    let header: raw::Header = serde_json::from_slice(bytes).map_err(syntax)?;
    let bundle = header.check()?;
    let program = if bundle {
        let doc: raw::RawProgram = serde_json::from_slice(bytes).map_err(syntax)?;
        lower::program(doc)?
    } else {
        let doc: raw::RawGraph = serde_json::from_slice(bytes).map_err(syntax)?;
        lower::single(doc)?
    };
    crate::verify::program(&program)?;
    Ok(program)
}

fn syntax(e: serde_json::Error) -> ImportError {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = full.strip_suffix(&suffix).unwrap_or(&full).to_owned();
    ImportError::Syntax {
        line: e.line(),
        column: e.column(),
        message,
    }
}
