//! Matrix products through cuBLAS (`cublasGemmStridedBatchedEx`): f32, bf16 and f16 inputs,
//! f32 accumulation (`CUBLAS_COMPUTE_32F`), output in the input dtype, row-major like the
//! executor's tensors, on the rank's compute stream. f32 products whose operands came from
//! 16-bit values may run on TF32 tensor cores ([`Math::Tf32`]).

use crate::device::{Device, StreamKind};
use crate::error::{CudaError, Result};
use crate::kernels::source::Elem;
use crate::libs::{self, Lib};
use cudarc::cublas::result;
use cudarc::cublas::sys::{self, cublasComputeType_t, cublasOperation_t, cudaDataType};
use std::ffi::c_void;

/// A row-major batched product `C[b] = op(A[b]) · op(B[b])`, `C` of `[m, n]`.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    /// `A` is stored `[k, m]` (read transposed); else `[m, k]`.
    pub trans_a: bool,
    /// `B` is stored `[n, k]`; else `[k, n]`.
    pub trans_b: bool,
    /// Elements between consecutive batch entries (0 broadcasts one matrix to every entry).
    pub stride_a: usize,
    pub stride_b: usize,
    pub elem: Elem,
}

/// How an f32 product multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Math {
    /// f32 products (`CUBLAS_COMPUTE_32F`).
    Exact,
    /// Operands rounded to TF32 (10 mantissa bits) on tensor cores, accumulated in f32
    /// (`CUBLAS_COMPUTE_32F_FAST_TF32`): exact for operands that hold bf16 or f16 values,
    /// within 2^-11 of each other operand, several times faster.
    Tf32,
}

/// A cuBLAS handle bound to a rank's compute stream.
pub struct Blas {
    dev: Device,
    handle: sys::cublasHandle_t,
}

impl Blas {
    pub fn new(dev: &Device) -> Result<Blas> {
        libs::check_all(&[Lib::Cublas, Lib::CublasLt])?;
        dev.bind()?;
        let handle = result::create_handle().map_err(CudaError::cublas("cublasCreate"))?;
        let stream = dev.stream(StreamKind::Compute).cu_stream() as sys::cudaStream_t;
        // SAFETY: a fresh handle and a stream that lives as long as the device (`dev` is kept).
        unsafe { result::set_stream(handle, stream) }
            .map_err(CudaError::cublas("cublasSetStream"))?;
        Ok(Blas {
            dev: dev.clone(),
            handle,
        })
    }

    /// Queues `c = a · b` as described by `g`; `a`, `b`, `c` are device addresses.
    pub fn gemm(&self, g: &Gemm, a: u64, b: u64, c: u64) -> Result<()> {
        self.gemm_scaled(g, 1.0, Math::Exact, a, b, c)
    }

    /// Queues `c = alpha · a · b`, multiplied as `math` says (for f32 operands).
    pub fn gemm_scaled(
        &self,
        g: &Gemm,
        alpha: f32,
        math: Math,
        a: u64,
        b: u64,
        c: u64,
    ) -> Result<()> {
        let ty = match g.elem {
            Elem::F32 => cudaDataType::CUDA_R_32F,
            Elem::BF16 => cudaDataType::CUDA_R_16BF,
            Elem::F16 => cudaDataType::CUDA_R_16F,
            e => {
                return Err(CudaError::Invalid(format!(
                    "matrix product of {} tensors",
                    e.tag()
                )));
            }
        };
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| {
                CudaError::Invalid(format!(
                    "matrix dimension {v} exceeds cuBLAS's 32-bit range"
                ))
            })
        };
        let (m, n, k, batch) = (int(g.m)?, int(g.n)?, int(g.k)?, int(g.batch)?);
        // Column-major cuBLAS computes Cᵀ = op(B)ᵀ · op(A)ᵀ: the operands swap.
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let ldb_ = if g.trans_b { k } else { n };
        let lda_ = if g.trans_a { m } else { k };
        let beta = 0.0f32;
        let compute = match (math, g.elem) {
            (Math::Tf32, Elem::F32) => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        self.dev.bind()?;
        // SAFETY: the addresses are live pool blocks of the sizes `g` describes; alpha and beta
        // are host f32 as CUBLAS_COMPUTE_32F requires.
        unsafe {
            result::gemm_strided_batched_ex(
                self.handle,
                op(g.trans_b),
                op(g.trans_a),
                n,
                m,
                k,
                (&alpha as *const f32).cast::<c_void>(),
                b as *const c_void,
                ty,
                ldb_,
                g.stride_b as i64,
                a as *const c_void,
                ty,
                lda_,
                g.stride_a as i64,
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                ty,
                n,
                (g.m * g.n) as i64,
                batch,
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(CudaError::cublas("cublasGemmStridedBatchedEx"))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle is this value's and is not used after.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}
