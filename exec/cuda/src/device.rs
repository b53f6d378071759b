//! One rank's device: its context, a compute stream and a communication stream, and the
//! events that join them.
//!
//! cudarc's own event tracking (an event per buffer per use) is switched off: buffers are the
//! pool's raw addresses, and the ordering between the two streams is what the executor states
//! explicitly (a gather's wait makes the compute stream wait on the communication stream; a
//! free fences every stream that used the buffer, see [`crate::pool`]).

use crate::error::{CudaError, Result};
use crate::libs::{self, Lib};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result};
use std::sync::Arc;

/// The two streams of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamKind {
    Compute,
    Comm,
}

/// A rank's device (cheap to clone: every clone shares context and streams).
#[derive(Clone)]
pub struct Device {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    comm: Arc<CudaStream>,
}

impl Device {
    /// Number of visible devices (the driver library checked first).
    pub fn count() -> Result<usize> {
        libs::check(Lib::Cuda)?;
        let n = CudaContext::device_count().map_err(CudaError::driver("cuDeviceGetCount"))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Opens device `ordinal` (its primary context) with its two streams.
    pub fn open(ordinal: usize) -> Result<Device> {
        libs::check(Lib::Cuda)?;
        let ctx =
            CudaContext::new(ordinal).map_err(CudaError::driver("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: no buffer of cudarc's own type crosses streams in this crate: the pool's
        // blocks are raw addresses ordered by the pool's events and the executor's joins.
        unsafe { ctx.disable_event_tracking() };
        let compute = ctx
            .new_stream()
            .map_err(CudaError::driver("cuStreamCreate"))?;
        let comm = ctx
            .new_stream()
            .map_err(CudaError::driver("cuStreamCreate"))?;
        Ok(Device {
            ordinal,
            ctx,
            compute,
            comm,
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn name(&self) -> Result<String> {
        self.ctx
            .name()
            .map_err(CudaError::driver("cuDeviceGetName"))
    }

    /// (major, minor) compute capability.
    pub fn capability(&self) -> Result<(i32, i32)> {
        self.ctx
            .compute_capability()
            .map_err(CudaError::driver("cuDeviceGetAttribute"))
    }

    /// (free, total) device memory, bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(CudaError::driver("cuMemGetInfo"))
    }

    pub fn stream(&self, k: StreamKind) -> &Arc<CudaStream> {
        match k {
            StreamKind::Compute => &self.compute,
            StreamKind::Comm => &self.comm,
        }
    }

    /// Makes the context current on the calling thread (raw driver calls need it).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))
    }

    /// An event (no timing) recorded on `k` now.
    pub fn record(&self, k: StreamKind) -> Result<CudaEvent> {
        self.stream(k)
            .record_event(None)
            .map_err(CudaError::driver("cuEventRecord"))
    }

    /// A timing event recorded on `k` now.
    pub fn timing_event(&self, k: StreamKind) -> Result<CudaEvent> {
        self.stream(k)
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(CudaError::driver("cuEventRecord"))
    }

    /// Milliseconds the GPU spent on stream `k` between two events around `work` (which may
    /// queue work on other streams that `k` waits for), waited for on the host.
    pub fn time_ms<T>(&self, k: StreamKind, work: impl FnOnce() -> Result<T>) -> Result<(f64, T)> {
        let start = self.timing_event(k)?;
        let out = work()?;
        let end = self.timing_event(k)?;
        end.synchronize()
            .map_err(CudaError::driver("cuEventSynchronize"))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(CudaError::driver("cuEventElapsedTime"))?;
        Ok((f64::from(ms), out))
    }

    /// Makes `waiter` wait for the work queued on `on` so far (no host blocking).
    pub fn join(&self, waiter: StreamKind, on: StreamKind) -> Result<()> {
        let e = self.record(on)?;
        self.stream(waiter)
            .wait(&e)
            .map_err(CudaError::driver("cuStreamWaitEvent"))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.ctx
            .synchronize()
            .map_err(CudaError::driver("cuCtxSynchronize"))
    }

    /// Copies `src` to device address `dst` on `k`, returning when the copy is done.
    pub fn upload(&self, k: StreamKind, dst: u64, src: &[u8]) -> Result<()> {
        self.bind()?;
        let s = self.stream(k);
        // SAFETY: `dst` is a pool block of at least `src.len()` bytes, and the stream is
        // synchronised before `src` can go away.
        unsafe { result::memcpy_htod_async(dst, src, s.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
        s.synchronize()
            .map_err(CudaError::driver("cuStreamSynchronize"))
    }

    /// Copies `dst.len()` bytes from device address `src` after the work queued on `k`.
    pub fn download(&self, k: StreamKind, src: u64, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        let s = self.stream(k);
        // SAFETY: `src` is a pool block of at least `dst.len()` bytes; the stream is
        // synchronised before `dst` is read.
        unsafe { result::memcpy_dtoh_async(dst, src, s.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyDtoHAsync"))?;
        s.synchronize()
            .map_err(CudaError::driver("cuStreamSynchronize"))
    }

    /// Zeroes `bytes` bytes at `dst` on `k`.
    pub fn zero(&self, k: StreamKind, dst: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: `dst` is a pool block of at least `bytes` bytes.
        unsafe { result::memset_d8_async(dst, 0, bytes, self.stream(k).cu_stream()) }
            .map_err(CudaError::driver("cuMemsetD8Async"))
    }
}
