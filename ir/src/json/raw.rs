//! The document as serde reads it, before names are resolved and values checked.

use crate::{Arg, ImportError};
use serde::Deserialize;
use std::collections::BTreeMap;

/// Read first, on its own, so that a newer major version is refused before its body is parsed.
#[derive(Deserialize)]
pub(super) struct Header {
    format: Option<serde_json::Value>,
    version: Option<serde_json::Value>,
}

impl Header {
    /// `Ok(true)` for a bundle, `Ok(false)` for a single graph.
    pub(super) fn check(&self) -> Result<bool, ImportError> {
        let bundle = match self.format.as_ref().and_then(|f| f.as_str()) {
            Some("fx-graph") => false,
            Some("fx-program") => true,
            _ => {
                let found = self
                    .format
                    .as_ref()
                    .map_or("missing".to_owned(), |f| f.to_string());
                return Err(ImportError::NotFxGraph { found });
            }
        };
        check_version(self.version.as_ref())?;
        Ok(bundle)
    }
}

/// Version 1 and any 1.x minor revision are read; anything else is refused.
pub(super) fn check_version(version: Option<&serde_json::Value>) -> Result<(), ImportError> {
    let major = version.and_then(|v| v.as_f64()).map(f64::trunc);
    if major == Some(1.0) {
        Ok(())
    } else {
        let found = version.map_or("missing".to_owned(), |v| v.to_string());
        Err(ImportError::UnsupportedVersion { found })
    }
}

/// Header and either body in one pass. A document that parses as this also parses as
/// `Header` and as the `RawGraph` / `RawProgram` its format names, to the same values (those
/// ignore the fields they lack); a document this rejects takes the two-pass path.
#[derive(Deserialize)]
pub(super) struct RawDoc {
    format: Option<serde_json::Value>,
    version: Option<serde_json::Value>,
    name: Option<String>,
    kind: Option<String>,
    forward: Option<String>,
    nodes: Option<Vec<RawNode>>,
    #[serde(default)]
    params: Vec<RawParam>,
    #[serde(default)]
    grads: Vec<RawGrad>,
    graphs: Option<Vec<RawGraph>>,
    #[serde(default)]
    persistent: Vec<String>,
}

impl RawDoc {
    pub(super) fn split(self) -> (Header, RawGraph, RawProgram) {
        let header = Header {
            format: self.format,
            version: self.version,
        };
        let graph = RawGraph {
            format: None,
            version: None,
            name: self.name,
            kind: self.kind,
            forward: self.forward,
            nodes: self.nodes,
            params: self.params,
            grads: self.grads,
            persistent: self.persistent.clone(),
        };
        (
            header,
            graph,
            RawProgram {
                graphs: self.graphs,
                persistent: self.persistent,
            },
        )
    }
}

#[derive(Deserialize)]
pub(super) struct RawProgram {
    pub graphs: Option<Vec<RawGraph>>,
    #[serde(default)]
    pub persistent: Vec<String>,
}

#[derive(Deserialize)]
pub(super) struct RawGraph {
    pub format: Option<serde_json::Value>,
    pub version: Option<serde_json::Value>,
    pub name: Option<String>,
    pub kind: Option<String>,
    pub forward: Option<String>,
    pub nodes: Option<Vec<RawNode>>,
    #[serde(default)]
    pub params: Vec<RawParam>,
    #[serde(default)]
    pub grads: Vec<RawGrad>,
    /// A document's top-level list of the program's persistent parameters; read from a
    /// single graph's document, not from a graph inside a bundle.
    #[serde(default)]
    pub persistent: Vec<String>,
}

#[derive(Deserialize)]
pub(super) struct RawNode {
    pub name: String,
    pub op: String,
    pub target: Option<String>,
    #[serde(default)]
    pub args: Vec<Arg<String>>,
    #[serde(default)]
    pub kwargs: BTreeMap<String, Arg<String>>,
    #[serde(default)]
    pub meta: RawMeta,
}

#[derive(Deserialize, Default)]
pub(super) struct RawMeta {
    pub val: Option<serde_json::Value>,
    pub aliases: Option<Vec<i64>>,
    pub mutates: Option<Vec<i64>>,
    pub device_time_ms: Option<f64>,
}

#[derive(Deserialize)]
pub(super) struct RawParam {
    pub name: String,
    pub node: String,
    pub shape: Vec<serde_json::Value>,
    pub dtype: String,
    #[serde(default)]
    pub persistent: bool,
}

#[derive(Deserialize)]
pub(super) struct RawGrad {
    pub param: String,
    pub output_index: i64,
    #[serde(default)]
    pub persistent: bool,
}
