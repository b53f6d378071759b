//! The stream-ordered memory pool of one rank.
//!
//! Blocks come from `cuMemAlloc` and are never returned to the driver while the pool lives
//! (except to retry an allocation that ran out of memory). A freed block is *idle*: it
//! remembers an event recorded, at the free, on every stream that used it. Handing it out
//! again to stream `s` makes `s` wait on the events of the other streams (`s`'s own work is
//! ordered before its new work already), so that the new owner never overwrites data a
//! pending kernel or collective still reads, and the host never blocks.
//!
//! **Rounding.** Every request is rounded up to a multiple of [`ROUND`] bytes (512 B, the
//! alignment cuBLAS and NCCL like, as in PyTorch's caching allocator), and an idle block is
//! reused only for a request of exactly its rounded size. The pool reports two peaks: the
//! requested bytes (comparable with the simulator's peak, which counts exact tensor sizes)
//! and the rounded bytes in use, which exceed it by less than 512 B per live buffer.
//!
//! [`Book`] is the bookkeeping alone, generic over the fence type so that its logic is tested
//! without a GPU; [`Pool`] drives it with driver allocations and events.

use crate::device::{Device, StreamKind};
use crate::error::{CudaError, Result};
use cudarc::driver::{CudaEvent, result};
use std::collections::{BTreeMap, HashMap};

/// Allocation granularity, bytes.
pub const ROUND: u64 = 512;

/// `bytes` rounded up to the pool's granularity (a zero-byte request takes one unit, so that
/// every buffer has a distinct address).
pub fn rounded(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(ROUND) * ROUND
}

/// A device buffer of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub ptr: u64,
    /// Rounded size, bytes.
    pub size: u64,
}

/// The pool's figures, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Requested bytes of live buffers, and their peak.
    pub requested: u64,
    pub peak_requested: u64,
    /// Rounded bytes of live buffers, and their peak.
    pub in_use: u64,
    pub peak_in_use: u64,
    /// Bytes held from the driver (live and idle), and their peak.
    pub reserved: u64,
    pub peak_reserved: u64,
}

struct Idle<E> {
    block: Block,
    /// One fence per stream that used the block, recorded at its free.
    fences: Vec<(StreamKind, E)>,
}

/// The pool's bookkeeping: live and idle blocks, and the figures.
pub struct Book<E> {
    idle: BTreeMap<u64, Vec<Idle<E>>>,
    /// Live blocks by address: (rounded size, requested bytes).
    live: HashMap<u64, (u64, u64)>,
    stats: PoolStats,
}

impl<E> Default for Book<E> {
    fn default() -> Book<E> {
        Book {
            idle: BTreeMap::new(),
            live: HashMap::new(),
            stats: PoolStats::default(),
        }
    }
}

impl<E> Book<E> {
    /// An idle block for `bytes` on `stream`, with the fences `stream` must wait on before
    /// using it; `None` when no idle block has the size.
    pub fn take(&mut self, bytes: u64, stream: StreamKind) -> Option<(Block, Vec<E>)> {
        let size = rounded(bytes);
        let list = self.idle.get_mut(&size)?;
        let idle = list.pop()?;
        if list.is_empty() {
            self.idle.remove(&size);
        }
        self.mark_live(idle.block, bytes);
        let waits = idle
            .fences
            .into_iter()
            .filter(|(s, _)| *s != stream)
            .map(|(_, e)| e)
            .collect();
        Some((idle.block, waits))
    }

    /// Records a block fresh from the driver as live.
    pub fn add_fresh(&mut self, block: Block, bytes: u64) {
        self.stats.reserved += block.size;
        self.stats.peak_reserved = self.stats.peak_reserved.max(self.stats.reserved);
        self.mark_live(block, bytes);
    }

    fn mark_live(&mut self, block: Block, bytes: u64) {
        self.live.insert(block.ptr, (block.size, bytes));
        let s = &mut self.stats;
        s.in_use += block.size;
        s.requested += bytes;
        s.peak_in_use = s.peak_in_use.max(s.in_use);
        s.peak_requested = s.peak_requested.max(s.requested);
    }

    /// Returns a live block with the fences of the streams that used it; an address the pool
    /// did not hand out (or already took back) is an error.
    pub fn give_back(&mut self, ptr: u64, fences: Vec<(StreamKind, E)>) -> Result<Block> {
        let (size, bytes) = self.live.remove(&ptr).ok_or_else(|| {
            CudaError::Invalid(format!(
                "pool: free of {ptr:#x}, which is not a live buffer"
            ))
        })?;
        self.stats.in_use -= size;
        self.stats.requested -= bytes;
        let block = Block { ptr, size };
        self.idle
            .entry(size)
            .or_default()
            .push(Idle { block, fences });
        Ok(block)
    }

    /// Every idle block, removed from the pool (to be freed once the device is idle).
    pub fn drain_idle(&mut self) -> Vec<Block> {
        let blocks: Vec<Block> = std::mem::take(&mut self.idle)
            .into_values()
            .flatten()
            .map(|i| i.block)
            .collect();
        self.stats.reserved -= blocks.iter().map(|b| b.size).sum::<u64>();
        blocks
    }

    /// Addresses of the live blocks.
    pub fn live(&self) -> impl Iterator<Item = u64> + '_ {
        self.live.keys().copied()
    }

    pub fn stats(&self) -> PoolStats {
        self.stats
    }

    /// Starts a new measurement window: peaks restart from the current figures.
    pub fn reset_peaks(&mut self) {
        let s = &mut self.stats;
        s.peak_requested = s.requested;
        s.peak_in_use = s.in_use;
        s.peak_reserved = s.reserved;
    }
}

/// One rank's pool on its device.
pub struct Pool {
    dev: Device,
    book: Book<CudaEvent>,
}

impl Pool {
    pub fn new(dev: &Device) -> Pool {
        Pool {
            dev: dev.clone(),
            book: Book::default(),
        }
    }

    /// A buffer of `bytes` that `stream` may use from now on (in stream order).
    pub fn alloc(&mut self, bytes: u64, stream: StreamKind) -> Result<Block> {
        if let Some((block, waits)) = self.book.take(bytes, stream) {
            for e in &waits {
                self.dev
                    .stream(stream)
                    .wait(e)
                    .map_err(CudaError::driver("cuStreamWaitEvent"))?;
            }
            return Ok(block);
        }
        let size = rounded(bytes);
        let ptr = match self.malloc(size) {
            Ok(p) => p,
            Err(_) => {
                // Out of memory with idle blocks of other sizes: give those back and retry.
                self.dev.synchronize()?;
                for b in self.book.drain_idle() {
                    self.dev.bind()?;
                    // SAFETY: the device is idle and the block is no longer in the pool.
                    unsafe { result::free_sync(b.ptr) }.map_err(CudaError::driver("cuMemFree"))?;
                }
                self.malloc(size).map_err(|_| CudaError::OutOfMemory {
                    device: self.dev.ordinal(),
                    requested: size,
                    in_use: self.book.stats().in_use,
                })?
            }
        };
        let block = Block { ptr, size };
        self.book.add_fresh(block, bytes);
        Ok(block)
    }

    fn malloc(&self, size: u64) -> Result<u64> {
        self.dev.bind()?;
        let size =
            usize::try_from(size).map_err(|_| CudaError::Invalid("allocation size".into()))?;
        // SAFETY: a plain device allocation; the pool owns the pointer until it frees it.
        unsafe { result::malloc_sync(size) }.map_err(CudaError::driver("cuMemAlloc"))
    }

    /// Returns `block` once the work queued so far on each of `used_by` is past it.
    pub fn free(&mut self, block: Block, used_by: &[StreamKind]) -> Result<()> {
        let mut fences = Vec::with_capacity(used_by.len());
        for &s in used_by {
            fences.push((s, self.dev.record(s)?));
        }
        self.book.give_back(block.ptr, fences)?;
        Ok(())
    }

    pub fn stats(&self) -> PoolStats {
        self.book.stats()
    }

    pub fn reset_peaks(&mut self) {
        self.book.reset_peaks();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Teardown: wait for the device, then free everything (errors have nowhere to go).
        if self.dev.synchronize().is_err() {
            return;
        }
        let live: Vec<u64> = self.book.live().collect();
        let idle = self.book.drain_idle().into_iter().map(|b| b.ptr);
        for ptr in live.into_iter().chain(idle) {
            // SAFETY: the device is idle and nothing uses the pool's blocks after its drop.
            let _ = unsafe { result::free_sync(ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use StreamKind::{Comm, Compute};

    fn block(ptr: u64, bytes: u64) -> Block {
        Block {
            ptr,
            size: rounded(bytes),
        }
    }

    #[test]
    fn sizes_round_up_to_512_bytes() {
        assert_eq!(rounded(0), 512);
        assert_eq!(rounded(1), 512);
        assert_eq!(rounded(512), 512);
        assert_eq!(rounded(513), 1024);
    }

    #[test]
    fn a_freed_block_is_reused_for_its_size_after_the_other_streams_fences() {
        let mut b: Book<&str> = Book::default();
        assert!(
            b.take(1000, Compute).is_none(),
            "an empty pool has nothing idle"
        );
        b.add_fresh(block(0x1000, 1000), 1000);
        b.give_back(
            0x1000,
            vec![(Compute, "compute-done"), (Comm, "gather-done")],
        )
        .unwrap();
        assert!(
            b.take(2000, Compute).is_none(),
            "another size class is not reused"
        );
        let (got, waits) = b.take(600, Compute).unwrap();
        assert_eq!(got, block(0x1000, 1024));
        // Compute's own fence is implied by stream order; the communication stream's is not.
        assert_eq!(waits, vec!["gather-done"]);
        assert!(b.take(1000, Compute).is_none(), "the block is live again");
    }

    #[test]
    fn peaks_count_requested_and_rounded_bytes() {
        let mut b: Book<()> = Book::default();
        b.add_fresh(block(0x1000, 100), 100);
        b.add_fresh(block(0x2000, 1000), 1000);
        b.give_back(0x1000, vec![]).unwrap();
        let (_, _) = b.take(200, Comm).unwrap();
        let s = b.stats();
        assert_eq!((s.requested, s.peak_requested), (1200, 1200));
        assert_eq!((s.in_use, s.peak_in_use), (1536, 1536));
        assert_eq!((s.reserved, s.peak_reserved), (1536, 1536));
        b.give_back(0x2000, vec![]).unwrap();
        b.reset_peaks();
        assert_eq!(
            b.stats().peak_requested,
            200,
            "a new window starts from what is live"
        );
        assert_eq!(b.drain_idle(), vec![block(0x2000, 1000)]);
        assert_eq!(b.stats().reserved, 512);
    }

    #[test]
    fn a_double_free_is_an_error() {
        let mut b: Book<()> = Book::default();
        b.add_fresh(block(0x1000, 8), 8);
        b.give_back(0x1000, vec![]).unwrap();
        let e = b.give_back(0x1000, vec![]).unwrap_err();
        assert!(e.to_string().contains("not a live buffer"), "{e}");
    }
}
