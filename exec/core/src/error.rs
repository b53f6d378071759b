//! The executor's errors. Everything that fails at a node says which: [`ExecError::Node`]
//! carries graph, node and target around the typed cause ([`NodeError`]), so a backend or a
//! communicator reports only what went wrong, never where.

use crate::inputs::InputError;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(
        "the {backend} executor does not implement {}",
        .missing.iter().map(|(node, op)| format!("`{op}` (node `{node}`)")).collect::<Vec<_>>().join(", ")
    )]
    Unsupported {
        backend: &'static str,
        /// (node, target) for each node it cannot run, in program order.
        missing: Vec<(String, String)>,
    },
    #[error(transparent)]
    UseAfterFree(Box<UseAfterFree>),
    #[error(transparent)]
    Input(#[from] InputError),
    #[error("graph `{graph}`, node `{node}` (`{target}`): {source}")]
    Node {
        graph: String,
        node: String,
        target: String,
        source: NodeError,
    },
    /// A rank's backend could not be set up.
    #[error("rank {rank}: {source}")]
    Rank { rank: u32, source: BackendError },
    #[error(
        "the run needs {need} bytes at its peak ({counted}), more than the {available} bytes available ({from})"
    )]
    DoesNotFit {
        need: u64,
        /// What `need` counts.
        counted: String,
        available: u64,
        /// Where `available` comes from (`MemAvailable in /proc/meminfo`, `--memory-limit`).
        from: String,
    },
}

impl ExecError {
    /// Whether this is a rank stopping because another one failed (not the failure itself).
    pub fn is_abort(&self) -> bool {
        matches!(
            self,
            ExecError::Node {
                source: NodeError::Comm(CommError::Aborted),
                ..
            }
        )
    }
}

/// What failed at a node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The node lacks what its op needs (an inserted op without its operand, a value of the
    /// wrong kind): the graph, not the executor, is wrong.
    #[error("{0}")]
    Malformed(String),
    /// The data of a graph input could not be made.
    #[error("{0}")]
    Input(String),
}

/// What a backend reports: the core adds graph, node and target.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A kernel refused its arguments (shapes, dtypes, indices out of range, ...).
    #[error("{0}")]
    Kernel(String),
    #[error("cannot allocate {bytes} bytes")]
    OutOfMemory { bytes: u64 },
    /// The device or its libraries failed.
    #[error("{0}")]
    Device(String),
}

/// What a collective reports.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// Another rank failed and aborted the world; its own error is the one reported.
    #[error("aborted: another rank failed")]
    Aborted,
    /// Combining the ranks' buffers failed in the backend.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The communication library failed.
    #[error("{0}")]
    Failed(String),
}

/// A read of storage that a release (or liveness) had already freed.
#[derive(Debug, thiserror::Error)]
#[error(
    "graph `{graph}`: node `{node}` reads `{value}`, whose storage `{storage}` was {how} by `{by}` before it: the schedule frees memory that is still in use"
)]
pub struct UseAfterFree {
    pub graph: String,
    pub node: String,
    pub value: String,
    pub storage: String,
    /// "released" (by a release) or "freed" (by liveness).
    pub how: &'static str,
    pub by: String,
}
