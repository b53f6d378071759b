//! zerosched's graph IR.
//!
//! A [`Program`] is the graphs of one training step in execution order; a [`Graph`] keeps its
//! nodes in a petgraph `StableGraph` (passes insert and delete) plus an explicit program order.
//! Node references are typed [`NodeId`]s; facts that analyses compute live in [`SideTable`]s
//! keyed by node, never in the node itself.
//!
//! Every document enters through [`json::import`] or [`binary::import`], which validate every
//! handle and run the structural [`verify`]er, so code downstream may assume a well-formed graph.

#![forbid(unsafe_code)]

pub mod arg;
pub mod aten;
pub mod binary;
pub mod comm;
pub mod diag;
pub mod dtype;
pub mod graph;
pub mod json;
pub mod kwargs;
pub mod listing;
mod names;
pub mod node;
pub mod program;
pub mod side_table;
pub mod string;
pub mod tensor;
#[cfg(feature = "testing")]
pub mod testing;
pub mod verify;

pub use arg::Arg;
pub use diag::{Diagnostic, Diagnostics, ImportError, Location, Problem};
pub use dtype::Dtype;
pub use graph::{Grad, Graph, GraphKind, NodeId, Param};
pub use kwargs::Kwargs;
pub use node::{Meta, Node, Op};
pub use program::{Form, Program};
pub use side_table::SideTable;
pub use string::Str;
pub use tensor::{Dim, SymInt, TensorMeta, Val};

/// Reads a document in either encoding, telling them apart by the binary form's magic bytes.
pub fn import(bytes: &[u8]) -> Result<Program, ImportError> {
    if binary::has_magic(bytes) {
        binary::import(bytes)
    } else {
        json::import(bytes)
    }
}
