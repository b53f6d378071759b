//! NCCL through cudarc's `nccl` module: one communicator per rank, made from a unique id that
//! rank 0 creates and [`crate::rendezvous`] hands to the others. Every collective is queued on
//! the rank's communication stream; a bucket is one NCCL group.

use crate::device::{Device, StreamKind};
use crate::error::{CudaError, Result};
use crate::kernels::source::Elem;
use crate::libs::{self, Lib};
use crate::rendezvous::{self, ID_BYTES, Launch, Server};
use cudarc::nccl::result;
use cudarc::nccl::sys::{self, ncclDataType_t, ncclRedOp_t};
use std::ffi::c_void;
use std::time::Duration;

/// How long ranks wait for each other at the rendezvous.
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// A rank's communicator.
pub struct Comm {
    dev: Device,
    comm: sys::ncclComm_t,
    pub rank: u32,
    pub world: u32,
    aborted: bool,
}

fn dtype(e: Elem) -> ncclDataType_t {
    match e {
        Elem::F32 => ncclDataType_t::ncclFloat32,
        Elem::BF16 => ncclDataType_t::ncclBfloat16,
        Elem::F16 => ncclDataType_t::ncclFloat16,
        Elem::I64 => ncclDataType_t::ncclInt64,
        Elem::I32 => ncclDataType_t::ncclInt32,
        Elem::Bool => ncclDataType_t::ncclUint8,
    }
}

impl Comm {
    /// A fresh NCCL unique id (rank 0's).
    pub fn unique_id() -> Result<[u8; ID_BYTES]> {
        libs::check(Lib::Nccl)?;
        let id = result::get_uniqueid().map_err(CudaError::nccl("ncclGetUniqueId"))?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins the communicator of `id` as `rank` of `world` (blocks until every rank joins).
    pub fn init(dev: &Device, id: &[u8; ID_BYTES], world: u32, rank: u32) -> Result<Comm> {
        libs::check(Lib::Nccl)?;
        dev.bind()?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is an out-parameter; the id is the run's.
        unsafe { result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
            .map_err(CudaError::nccl("ncclCommInitRank"))?;
        Ok(Comm {
            dev: dev.clone(),
            comm,
            rank,
            world,
            aborted: false,
        })
    }

    /// The communicator of a launch: rank 0 makes the id and serves it at the master address,
    /// the others fetch it there (a world of one needs no address).
    pub fn from_launch(dev: &Device, l: &Launch) -> Result<Comm> {
        let addr = l.master.clone();
        let need_addr = || {
            addr.clone()
                .ok_or_else(|| CudaError::Env("MASTER_PORT is not set".into()))
        };
        if l.rank == 0 {
            let id = Comm::unique_id()?;
            let server = match l.world {
                1 => None,
                n => Some(Server::start(&need_addr()?, id, n - 1, RENDEZVOUS_TIMEOUT)?),
            };
            let comm = Comm::init(dev, &id, l.world, 0)?;
            server.map(Server::finish).transpose()?;
            Ok(comm)
        } else {
            let id = rendezvous::fetch(&need_addr()?, RENDEZVOUS_TIMEOUT)?;
            Comm::init(dev, &id, l.world, l.rank)
        }
    }

    fn stream(&self) -> sys::cudaStream_t {
        self.dev.stream(StreamKind::Comm).cu_stream() as sys::cudaStream_t
    }

    /// All-gather of `count` elements per rank from `send` into `recv` (`world * count`).
    pub fn all_gather(&self, send: u64, recv: u64, count: usize, e: Elem) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: pool blocks of the stated sizes, on this rank's communication stream.
        unsafe {
            result::all_gather(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype(e),
                self.comm,
                self.stream(),
            )
        }
        .map_err(CudaError::nccl("ncclAllGather"))?;
        Ok(())
    }

    /// Sum-reduce-scatter of `send` (`world * count`) into this rank's `count` elements.
    pub fn reduce_scatter(&self, send: u64, recv: u64, count: usize, e: Elem) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: as in `all_gather`.
        unsafe {
            result::reduce_scatter(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype(e),
                ncclRedOp_t::ncclSum,
                self.comm,
                self.stream(),
            )
        }
        .map_err(CudaError::nccl("ncclReduceScatter"))?;
        Ok(())
    }

    /// Sum-all-reduce of `count` elements (in place when `send == recv`).
    pub fn all_reduce(&self, send: u64, recv: u64, count: usize, e: Elem) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: as in `all_gather`.
        unsafe {
            result::all_reduce(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype(e),
                ncclRedOp_t::ncclSum,
                self.comm,
                self.stream(),
            )
        }
        .map_err(CudaError::nccl("ncclAllReduce"))?;
        Ok(())
    }

    /// The collectives from here to [`Comm::group_end`] are one NCCL group (one launch for
    /// a bucket).
    pub fn group_start(&self) -> Result<()> {
        result::group_start().map_err(CudaError::nccl("ncclGroupStart"))?;
        Ok(())
    }

    pub fn group_end(&self) -> Result<()> {
        result::group_end().map_err(CudaError::nccl("ncclGroupEnd"))?;
        Ok(())
    }

    /// Another rank failed: abandons the collectives in flight (the communicator is unusable
    /// after).
    pub fn abort(&mut self) {
        if !self.aborted {
            // SAFETY: the communicator is this value's; it is not used for collectives after.
            let _ = unsafe { result::comm_abort(self.comm) };
            self.aborted = true;
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: the communicator is this value's; the device is synchronised first so that
        // no queued collective outlives it.
        if self.aborted {
            return;
        }
        let _ = self.dev.synchronize();
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}
