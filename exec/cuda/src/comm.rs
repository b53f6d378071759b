//! The CUDA backend's communicator: NCCL collectives on the rank's communication stream.
//! Starting one makes the communication stream wait for the compute stream's work so far (the
//! operand's producer); waiting makes the compute stream wait for the communication stream,
//! so a gather overlaps the compute issued between its start and its wait. A bucket is one
//! NCCL group. Every backend over a [`Cuda`] device ([`OnCuda`]: numeric, replay, profile)
//! shares it.

use crate::backend::{Cuda, CudaTensor};
use crate::device::StreamKind;
use crate::kernels::source::Elem;
use crate::nccl::Comm;
use zerosched_exec::comm::Communicator;
use zerosched_exec::{Backend, BackendError, CommError};
use zerosched_ir::Dtype;

/// A backend whose tensors are [`Cuda`] device buffers.
pub trait OnCuda: Backend<Tensor = CudaTensor> {
    fn cuda(&mut self) -> &mut Cuda;
}

impl OnCuda for Cuda {
    fn cuda(&mut self) -> &mut Cuda {
        self
    }
}

/// One rank's NCCL communicator.
pub struct NcclComm {
    comm: Comm,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time; the executor moves
// each rank's communicator to its thread and uses it only there.
unsafe impl Send for NcclComm {}

impl NcclComm {
    pub fn new(comm: Comm) -> NcclComm {
        NcclComm { comm }
    }
}

/// A collective in flight: its result, and an operand copy to release once it is done.
pub struct Pending {
    out: CudaTensor,
    temp: Option<CudaTensor>,
}

fn failed(e: impl std::fmt::Display) -> CommError {
    CommError::Failed(e.to_string())
}

fn elem(d: Dtype) -> Result<Elem, CommError> {
    Elem::of(d).ok_or_else(|| {
        CommError::Backend(BackendError::Kernel(format!(
            "dtype {d} cannot be communicated"
        )))
    })
}

/// `t` flattened and contiguous in `dtype`, zero-padded to `len` elements: `t` itself when it
/// already is, else a copy (returned second, to release after the collective).
fn operand(
    b: &mut Cuda,
    t: &CudaTensor,
    dtype: Dtype,
    len: usize,
) -> Result<(CudaTensor, Option<CudaTensor>), CommError> {
    let n = t.numel();
    if t.dtype == dtype
        && n == len
        && t.offset == 0
        && t.strides == crate::kernels::contiguous_strides(&t.shape)
    {
        return Ok((t.clone(), None));
    }
    let copy = b
        .copy_padded(t, dtype, len)
        .map_err(|e| CommError::Backend(BackendError::Kernel(e)))?;
    Ok((copy.clone(), Some(copy)))
}

impl NcclComm {
    fn start(
        &mut self,
        b: &mut Cuda,
        src: (CudaTensor, Option<CudaTensor>),
        out_len: usize,
        run: impl FnOnce(&Comm, u64, u64, Elem) -> crate::Result<()>,
    ) -> Result<Pending, CommError> {
        let (src, temp) = src;
        let out = b
            .empty_on(src.dtype, &[out_len], StreamKind::Comm)
            .map_err(|e| CommError::Backend(BackendError::Kernel(e)))?;
        b.dev
            .join(StreamKind::Comm, StreamKind::Compute)
            .map_err(failed)?;
        run(&self.comm, src.block.ptr, out.block.ptr, elem(src.dtype)?).map_err(failed)?;
        Ok(Pending { out, temp })
    }
}

impl<B: OnCuda> Communicator<B> for NcclComm {
    type Pending = Pending;

    fn rank(&self) -> u32 {
        self.comm.rank
    }

    fn world(&self) -> u32 {
        self.comm.world
    }

    fn start_all_gather(
        &mut self,
        b: &mut B,
        shard: &CudaTensor,
        dtype: Option<Dtype>,
    ) -> Result<Pending, CommError> {
        let b = b.cuda();
        let dt = dtype.unwrap_or(shard.dtype);
        let n = shard.numel();
        let src = operand(b, shard, dt, n)?;
        let world = self.comm.world as usize;
        self.start(b, src, n * world, |c, s, o, e| c.all_gather(s, o, n, e))
    }

    fn start_reduce_scatter(&mut self, b: &mut B, grad: &CudaTensor) -> Result<Pending, CommError> {
        let b = b.cuda();
        let world = self.comm.world as usize;
        let per = grad.numel().div_ceil(world);
        let src = operand(b, grad, grad.dtype, per * world)?;
        self.start(b, src, per, |c, s, o, e| c.reduce_scatter(s, o, per, e))
    }

    fn start_all_reduce(&mut self, b: &mut B, grad: &CudaTensor) -> Result<Pending, CommError> {
        let b = b.cuda();
        let n = grad.numel();
        let src = operand(b, grad, grad.dtype, n)?;
        self.start(b, src, n, |c, s, o, e| c.all_reduce(s, o, n, e))
    }

    fn start_group(&mut self) -> Result<(), CommError> {
        self.comm.group_start().map_err(failed)
    }

    fn end_group(&mut self) -> Result<(), CommError> {
        self.comm.group_end().map_err(failed)
    }

    fn wait(&mut self, b: &mut B, p: Pending) -> Result<CudaTensor, CommError> {
        let b = b.cuda();
        b.dev
            .join(StreamKind::Compute, StreamKind::Comm)
            .map_err(failed)?;
        if let Some(t) = &p.temp {
            b.release(t);
        }
        Ok(p.out)
    }

    fn abort(&mut self) {
        self.comm.abort();
    }
}
