//! The CUDA backend's device layer: one rank's GPU with a compute and a communication stream
//! ([`device`]), a stream-ordered memory pool ([`pool`]), NVRTC-generated kernels
//! ([`kernels`]), cuBLAS matrix products ([`matmul`]), the executor's backend over them
//! ([`backend`], its op families in `ops/`, who owns a block in `owners`), NCCL collectives
//! ([`nccl`]) with a TCP rendezvous ([`rendezvous`]), replay mode over a calibrated spin kernel ([`replay`]),
//! profile mode's per-node timing ([`profile`]) and the collective table measurement
//! ([`calibrate`]).
//!
//! Every library is loaded at run time (cudarc's `dynamic-loading`): the crate builds where
//! no CUDA toolkit is installed, and on a machine without one every entry point returns
//! [`CudaError::MissingLibrary`] (checked by [`libs`] before cudarc could panic).

pub mod backend;
pub mod calibrate;
pub mod comm;
pub mod device;
pub mod error;
pub mod kernels;
pub mod libs;
pub mod matmul;
pub mod nccl;
mod ops;
mod owners;
pub mod pool;
pub mod profile;
pub mod rendezvous;
pub mod replay;
mod storage;

pub use error::{CudaError, Result};
