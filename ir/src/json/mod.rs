//! fx-graph v1 JSON: import ([`import`]) and deterministic export ([`export`]).
//!
//! Import first tries the fast path ([`fast`]): one pass from the text straight into the IR,
//! which gives up on anything irregular. Then, and for every document with a problem, the
//! careful path parses into plain serde structs, lowers them to the IR while collecting
//! every naming and reference problem, and runs the structural verifier. Export writes one
//! node per line with fixed field order, so equal graphs give equal bytes.

mod arg_serde;
mod fast;
mod lower;
mod raw;
mod values;
mod write;

pub use write::{export, export_graph};

use crate::{ImportError, Program};

/// Imports an `fx-graph` or `fx-program` document.
pub fn import(bytes: &[u8]) -> Result<Program, ImportError> {
    // The fast path builds exactly what the careful path would, or nothing; the verifier's
    // verdict on that program is the careful path's too.
    if let Some(program) = fast::import(bytes) {
        crate::verify::program(&program)?;
        return Ok(program);
    }
    import_careful(bytes)
}

/// [`import`] without its fast path: same result, same errors, slower. For differential
/// tests and fuzzing of the fast path.
pub fn import_careful(bytes: &[u8]) -> Result<Program, ImportError> {
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// The fast path must take what the exporter writes, or import silently slows down.
    #[test]
    fn fast_path_takes_exports_and_fixtures() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let mut seen = 0;
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let bytes = std::fs::read(&path).unwrap();
            let program = super::fast::import(&bytes)
                .unwrap_or_else(|| panic!("the fast path gives up on {}", path.display()));
            let careful = super::import_careful(&bytes).unwrap();
            assert_eq!(super::export(&program), super::export(&careful));
            let again = super::export(&program);
            assert!(super::fast::import(&again).is_some());
            seen += 1;
        }
        assert!(seen > 0);
        #[cfg(feature = "testing")]
        {
            let synthetic = super::export(&crate::testing::llama_like(2));
            assert!(super::fast::import(&synthetic).is_some());
        }
    }
}
