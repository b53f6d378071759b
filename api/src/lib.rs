//! zerosched-api: what the command line and the Python extension share. Requests (validated
//! options of `schedule` and `check`), reports, summaries and document I/O live here so that
//! both front ends, the tests and the benchmarks use exactly the same code.

#![forbid(unsafe_code)]

pub mod budget;
pub mod io;
pub mod report;
pub mod request;
pub mod summary;
