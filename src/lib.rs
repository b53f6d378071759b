//! zerosched: the command-line tool's library half. Reading and writing documents, summaries
//! and reports live here so that tests and benchmarks use exactly what the tool uses.

// `deny`, not `forbid`: ndarray's `s!` macro expands to an `allow(unsafe_code)` of its own.
#![deny(unsafe_code)]

pub mod budget;
pub mod default_program;
pub mod exec;
pub mod io;
pub mod report;
pub mod request;
pub mod summary;
