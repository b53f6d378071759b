//! The backend's errors: every failure of a library call names the call, so that an error that
//! surfaces at a later synchronisation still says where it came from.

use crate::libs::Lib;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(transparent)]
    MissingLibrary(#[from] Box<crate::libs::MissingLibrary>),
    #[error("CUDA driver: {call}: {message}")]
    Driver { call: &'static str, message: String },
    #[error("NVRTC could not compile kernel `{kernel}`: {log}")]
    Compile { kernel: String, log: String },
    #[error("cuBLAS: {call}: {message}")]
    Cublas { call: &'static str, message: String },
    #[error("NCCL: {call}: {message}")]
    Nccl { call: &'static str, message: String },
    #[error("rendezvous at {addr}: {message}")]
    Rendezvous { addr: String, message: String },
    #[error("launch environment: {0}")]
    Env(String),
    #[error(
        "device out of memory: {requested} bytes requested with {in_use} in use on device {device}"
    )]
    OutOfMemory {
        device: usize,
        requested: u64,
        in_use: u64,
    },
    #[error("{0}")]
    Invalid(String),
}

impl CudaError {
    /// Wraps a driver error of `call`.
    pub fn driver(call: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
        move |e| CudaError::Driver {
            call,
            message: e.to_string(),
        }
    }

    pub fn cublas(
        call: &'static str,
    ) -> impl FnOnce(cudarc::cublas::result::CublasError) -> CudaError {
        move |e| CudaError::Cublas {
            call,
            message: format!("{e:?}"),
        }
    }

    pub fn nccl(call: &'static str) -> impl FnOnce(cudarc::nccl::result::NcclError) -> CudaError {
        move |e| CudaError::Nccl {
            call,
            message: format!("{e:?}"),
        }
    }

    /// The library a [`CudaError::MissingLibrary`] names.
    pub fn missing_library(&self) -> Option<Lib> {
        match self {
            CudaError::MissingLibrary(m) => Some(m.lib),
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, CudaError>;
