//! zerosched's ZeRO-3 passes over the IR of `zerosched-ir`.
//!
//! Pipeline: alias analysis → insertion of gathers, waits, releases and gradient reductions →
//! scheduling under a memory budget → rewrites → the independent schedule checker and the
//! two-stream simulator. See docs/passes.md for the design.

pub mod alias;
pub mod checker;
pub mod cost;
pub mod insert;
pub mod keep;
pub mod liveness;
pub mod ops;
pub mod per_node;
pub mod pipeline;
pub mod rewrite;
pub mod schedule;
pub mod simulate;
