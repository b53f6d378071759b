//! zerosched's ZeRO-3 passes over the IR of `zerosched-ir`.
//!
//! Pipeline, in the order the pass manager runs it ([`pipeline`]): alias analysis → insertion
//! of gathers, waits, releases and gradient reductions → the egg rewrite stage → scheduling
//! under a memory budget → keep across forward and backward; the independent schedule checker
//! after each, and the two-stream simulator at the end. See docs/passes.md for the design.

#![forbid(unsafe_code)]

pub mod alias;
pub mod checker;
pub mod cost;
pub mod insert;
pub mod keep;
pub mod liveness;
mod max_add;
pub mod ops;
pub mod per_node;
pub mod pipeline;
pub mod rewrite;
pub mod schedule;
pub mod simulate;
