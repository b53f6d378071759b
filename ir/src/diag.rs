//! Errors with places: every problem names its graph, node and field where it has them.

use std::fmt;

/// Where a problem is: graph, node, and a field path such as `args[1][0]` or `meta.val.shape[2]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Location {
    pub graph: Option<String>,
    pub node: Option<String>,
    pub field: Option<String>,
}

impl Location {
    pub fn graph(graph: &str) -> Location {
        Location {
            graph: Some(graph.to_owned()),
            ..Location::default()
        }
    }

    pub fn node(graph: &str, node: &str) -> Location {
        Location {
            node: Some(node.to_owned()),
            ..Location::graph(graph)
        }
    }

    pub fn field(graph: &str, node: &str, field: impl Into<String>) -> Location {
        Location {
            field: Some(field.into()),
            ..Location::node(graph, node)
        }
    }

    /// A top-level field of a graph that belongs to no node (`params[3].node`).
    pub fn graph_field(graph: &str, field: impl Into<String>) -> Location {
        Location {
            field: Some(field.into()),
            ..Location::graph(graph)
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(g) = &self.graph {
            parts.push(format!("graph `{g}`"));
        }
        if let Some(n) = &self.node {
            parts.push(format!("node `{n}`"));
        }
        if let Some(x) = &self.field {
            parts.push(format!("field `{x}`"));
        }
        if parts.is_empty() {
            parts.push("document".to_owned());
        }
        f.write_str(&parts.join(", "))
    }
}

/// What is wrong, independent of where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("duplicate node name (first defined at nodes[{first}])")]
    DuplicateName { first: usize },
    #[error("a node named `{name}` already exists")]
    NameTaken { name: String },
    #[error("reference to unknown node `{target}`")]
    UnknownRef { target: String },
    #[error("reference to `{target}`, which comes later in program order")]
    LaterRef { target: String },
    #[error("reference to the output node `{target}`, which has no value")]
    RefToOutput { target: String },
    #[error("node is on a dependency cycle")]
    Cycle,
    #[error("graph has no `output` node")]
    NoOutput,
    #[error("graph has {count} `output` nodes; exactly one is allowed")]
    ManyOutputs { count: usize },
    #[error("unknown op `{op}` (expected placeholder, get_attr, call_function or output)")]
    UnknownOp { op: String },
    #[error("op `{op}` does not occur in AOT/export graphs and is not supported")]
    UnsupportedOp { op: String },
    #[error("shape entry {value} is not a non-negative integer")]
    BadShape { value: String },
    #[error("unknown dtype `{value}`")]
    UnknownDtype { value: String },
    #[error("unknown graph kind `{value}` (expected forward, backward, inference or joint)")]
    UnknownKind { value: String },
    #[error("{message}")]
    BadValue { message: String },
    #[error("missing required field")]
    Missing,
    #[error("tensor byte size overflows 64 bits")]
    SizeOverflow,
    #[error("parameter node `{node}` is not a placeholder")]
    ParamNotPlaceholder { node: String },
    #[error("placeholder carries more than one parameter (also `{other}`)")]
    ParamTwice { other: String },
    #[error("parameter `{name}` is declared more than once")]
    DuplicateParam { name: String },
    #[error("parameter `{name}` has shape/dtype {found} here but {expected} in graph `{graph}`")]
    ParamMismatch {
        name: String,
        found: String,
        expected: String,
        graph: String,
    },
    #[error("parameter shape/dtype {declared} disagrees with the placeholder's meta.val {val}")]
    ParamValMismatch { declared: String, val: String },
    #[error("gradient output_index {index} is out of range (the output has {len} values)")]
    GradOutOfRange { index: i64, len: usize },
    #[error("index {index} in meta is out of range (the node has {len} args)")]
    MetaIndexOutOfRange { index: i64, len: usize },
    #[error("index {index} into the graph's {table} table is out of range (it has {len})")]
    BadTableIndex {
        table: &'static str,
        index: u32,
        len: usize,
    },
    #[error("argument index {index} names no live node")]
    DanglingRef { index: usize },
    #[error("order is not a permutation of the graph's nodes")]
    BadOrder,
    #[error("node still has users")]
    StillUsed,
    #[error("a {kind} graph names a forward; only a backward graph does")]
    ForwardOnNonBackward { kind: String },
    #[error("`{name}` is no earlier forward graph of the program")]
    UnknownForward { name: String },
    #[error("forward graph `{name}` is already the forward of `{other}`")]
    ForwardTwice { name: String, other: String },
}

/// A problem at a place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    pub location: Location,
    pub problem: Problem,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.location, self.problem)
    }
}

/// Every problem found in one document, in the order they were found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl Diagnostics {
    pub fn push(&mut self, location: Location, problem: Problem) {
        self.0.push(Diagnostic { location, problem });
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn into_result(self) -> Result<(), Diagnostics> {
        if self.0.is_empty() { Ok(()) } else { Err(self) }
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 50;
        for (i, d) in self.0.iter().take(SHOWN).enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{d}")?;
        }
        if self.0.len() > SHOWN {
            write!(f, "\n... and {} more", self.0.len() - SHOWN)?;
        }
        Ok(())
    }
}

impl std::error::Error for Diagnostics {}

/// Why a document could not be imported.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("malformed JSON at line {line}, column {column}: {message}")]
    Syntax {
        line: usize,
        column: usize,
        message: String,
    },
    #[error("not an fx-graph document: `format` is {found}")]
    NotFxGraph { found: String },
    #[error("unsupported fx-graph version {found}; this build reads version 1")]
    UnsupportedVersion { found: String },
    #[error("not a zerosched binary graph (bad magic bytes)")]
    BadMagic,
    #[error("unsupported binary format version {found}; this build reads version {supported}")]
    UnsupportedBinaryVersion { found: u16, supported: u16 },
    #[error("corrupt binary graph: {message}")]
    Corrupt { message: String },
    #[error("{count} problem(s):\n{diagnostics}", count = diagnostics.0.len())]
    Invalid { diagnostics: Diagnostics },
}

impl From<Diagnostics> for ImportError {
    fn from(diagnostics: Diagnostics) -> ImportError {
        ImportError::Invalid { diagnostics }
    }
}
