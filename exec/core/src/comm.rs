//! Collectives between ranks. Each rank's interpreter holds one [`Communicator`]: it starts a
//! collective where the graph issues it and waits for it where the graph waits (an
//! all-gather's `wait` node, a reduction's first reader), so a backend with streams overlaps
//! the two. [`ThreadComm`] joins ranks that are threads of one process.

use crate::{Backend, CommError, Local};
use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use zerosched_ir::Dtype;

/// One rank's end of the world's collectives. Every rank starts the same collectives in the
/// same order (they run the same plans); a handle is waited on by the rank that started it.
pub trait Communicator<B: Backend> {
    /// A collective in flight.
    type Pending;
    fn rank(&self) -> u32;
    fn world(&self) -> u32;
    /// Starts gathering every rank's shard (rank order) into the padded flat buffer, each cast
    /// to `dtype` first when given.
    fn start_all_gather(
        &mut self,
        backend: &mut B,
        shard: &B::Tensor,
        dtype: Option<Dtype>,
    ) -> Result<Self::Pending, CommError>;
    /// Starts summing every rank's gradient; the result is this rank's shard of the sum
    /// (padded as [`Backend::shard`] pads).
    fn start_reduce_scatter(
        &mut self,
        backend: &mut B,
        grad: &B::Tensor,
    ) -> Result<Self::Pending, CommError>;
    /// Starts summing every rank's gradient; the result is the whole sum.
    fn start_all_reduce(
        &mut self,
        backend: &mut B,
        grad: &B::Tensor,
    ) -> Result<Self::Pending, CommError>;
    /// The collectives started from here to [`Communicator::end_group`] are one bucket (the
    /// adjacent all-gathers, or reductions, of a `bucket` id), which a library may issue as one
    /// grouped call.
    /// By default each is issued alone.
    fn start_group(&mut self) -> Result<(), CommError> {
        Ok(())
    }
    fn end_group(&mut self) -> Result<(), CommError> {
        Ok(())
    }
    /// The collective's result, once this rank's later work may use it.
    fn wait(&mut self, backend: &mut B, pending: Self::Pending) -> Result<B::Tensor, CommError>;
    /// This rank failed: every rank waiting on a collective, now or later, gets
    /// [`CommError::Aborted`] instead of waiting for it forever.
    fn abort(&mut self);
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    AllGather(Option<Dtype>),
    ReduceScatter,
    AllReduce,
}

/// A [`ThreadComm`] collective in flight: its place in the world's sequence.
#[derive(Debug)]
pub struct Ticket {
    seq: u64,
    kind: Kind,
}

/// One collective's contributions, until every rank has taken them.
struct Slot<T> {
    parts: Vec<Option<T>>,
    arrived: u32,
    taken: u32,
}

struct Board<T> {
    slots: BTreeMap<u64, Slot<T>>,
    aborted: bool,
    /// Ranks blocked in [`ThreadComm::collect`]: a post wakes them only if there are any (a
    /// wake-up is a system call, and most posts find nobody waiting).
    waiting: u32,
}

struct Shared<T> {
    board: Mutex<Board<T>>,
    changed: Condvar,
}

/// Ranks that are threads of one process: each rank posts its buffer (a cheap handle) and
/// every rank combines all of them itself, in rank order, so the results are the same bits as
/// one thread summing the ranks left to right.
pub struct ThreadComm<T> {
    rank: u32,
    world: u32,
    next: u64,
    shared: Arc<Shared<T>>,
}

impl<T> ThreadComm<T> {
    /// The communicators of a world of `world` ranks, rank order.
    pub fn world(world: u32) -> Vec<ThreadComm<T>> {
        let world = world.max(1);
        let shared = Arc::new(Shared {
            board: Mutex::new(Board {
                slots: BTreeMap::new(),
                aborted: false,
                waiting: 0,
            }),
            changed: Condvar::new(),
        });
        (0..world)
            .map(|rank| ThreadComm {
                rank,
                world,
                next: 0,
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    /// A rank that panicked holding the lock leaves the board as it was: still consistent.
    fn board(&self) -> MutexGuard<'_, Board<T>> {
        self.shared
            .board
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn post(&mut self, part: T, kind: Kind) -> Result<Ticket, CommError> {
        let seq = self.next;
        self.next += 1;
        let world = self.world as usize;
        let mut board = self.board();
        if board.aborted {
            return Err(CommError::Aborted);
        }
        let slot = board.slots.entry(seq).or_insert_with(|| Slot {
            parts: (0..world).map(|_| None).collect(),
            arrived: 0,
            taken: 0,
        });
        slot.parts[self.rank as usize] = Some(part);
        slot.arrived += 1;
        let wake = board.waiting > 0;
        drop(board);
        if wake {
            self.shared.changed.notify_all();
        }
        Ok(Ticket { seq, kind })
    }

    /// Every rank's part of collective `seq`, once all have posted.
    fn collect(&self, seq: u64) -> Result<Vec<T>, CommError>
    where
        T: Clone,
    {
        let mut board = self.board();
        loop {
            if board.aborted {
                return Err(CommError::Aborted);
            }
            if board
                .slots
                .get(&seq)
                .is_some_and(|s| s.arrived == self.world)
            {
                break;
            }
            board.waiting += 1;
            board = self
                .shared
                .changed
                .wait(board)
                .unwrap_or_else(PoisonError::into_inner);
            board.waiting -= 1;
        }
        let slot = board
            .slots
            .get_mut(&seq)
            .ok_or_else(|| CommError::Failed(format!("collective {seq} vanished")))?;
        let parts = slot.parts.iter().flatten().cloned().collect();
        slot.taken += 1;
        if slot.taken == self.world {
            board.slots.remove(&seq);
        }
        Ok(parts)
    }
}

impl<B> Communicator<B> for ThreadComm<B::Tensor>
where
    B: Local,
    B::Tensor: Send,
{
    type Pending = Ticket;

    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.world
    }

    fn start_all_gather(
        &mut self,
        _: &mut B,
        shard: &B::Tensor,
        dtype: Option<Dtype>,
    ) -> Result<Ticket, CommError> {
        self.post(shard.clone(), Kind::AllGather(dtype))
    }

    fn start_reduce_scatter(&mut self, _: &mut B, grad: &B::Tensor) -> Result<Ticket, CommError> {
        self.post(grad.clone(), Kind::ReduceScatter)
    }

    fn start_all_reduce(&mut self, _: &mut B, grad: &B::Tensor) -> Result<Ticket, CommError> {
        self.post(grad.clone(), Kind::AllReduce)
    }

    fn wait(&mut self, backend: &mut B, t: Ticket) -> Result<B::Tensor, CommError> {
        let parts = self.collect(t.seq)?;
        let parts: Vec<&B::Tensor> = parts.iter().collect();
        Ok(match t.kind {
            Kind::AllGather(dtype) => backend.concat(&parts, dtype)?,
            Kind::ReduceScatter => {
                let sum = backend.sum(&parts)?;
                let shard = backend.shard(&sum, self.world, self.rank)?;
                backend.free(sum);
                shard
            }
            Kind::AllReduce => backend.sum(&parts)?,
        })
    }

    fn abort(&mut self) {
        self.board().aborted = true;
        self.shared.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::{Communicator, ThreadComm};
    use crate::CommError;
    use crate::dry::{Dry, DryTensor};
    use zerosched_ir::Dtype;

    fn t(numel: u64) -> DryTensor {
        DryTensor {
            numel,
            dtype: Dtype::Float32,
        }
    }

    /// Collectives complete whatever order the ranks start and wait in: rank 1 starts two
    /// before rank 0 starts any.
    #[test]
    fn collectives_complete_in_any_interleaving() {
        let mut comms = ThreadComm::<DryTensor>::world(2);
        let mut c1 = comms.pop().expect("rank 1");
        let mut c0 = comms.pop().expect("rank 0");
        let got = std::thread::scope(|s| {
            let h1 = s.spawn(move || {
                let mut b = Dry;
                let g = c1.start_all_gather(&mut b, &t(3), Some(Dtype::BFloat16))?;
                let r = c1.start_reduce_scatter(&mut b, &t(10))?;
                Ok::<_, CommError>((c1.wait(&mut b, r)?, c1.wait(&mut b, g)?))
            });
            let mut b = Dry;
            let g = c0.start_all_gather(&mut b, &t(3), Some(Dtype::BFloat16))?;
            let r = c0.start_reduce_scatter(&mut b, &t(10))?;
            let mine = (c0.wait(&mut b, g)?, c0.wait(&mut b, r)?);
            Ok::<_, CommError>((mine, h1.join().expect("rank 1")?))
        })
        .expect("no failure");
        let ((g0, r0), (r1, g1)) = got;
        assert_eq!(g0, g1);
        assert_eq!((g0.numel, g0.dtype), (6, Dtype::BFloat16));
        assert_eq!((r0.numel, r1.numel), (5, 5));
    }

    /// A rank that fails aborts the world: a rank waiting for its part stops waiting.
    #[test]
    fn an_abort_wakes_the_ranks_that_wait() {
        let mut comms = ThreadComm::<DryTensor>::world(2);
        let mut c1 = comms.pop().expect("rank 1");
        let mut c0 = comms.pop().expect("rank 0");
        let waited = std::thread::scope(|s| {
            let h0 = s.spawn(move || {
                let mut b = Dry;
                let p = c0.start_all_reduce(&mut b, &t(4))?;
                c0.wait(&mut b, p)
            });
            std::thread::sleep(std::time::Duration::from_millis(20));
            <ThreadComm<DryTensor> as Communicator<Dry>>::abort(&mut c1);
            h0.join().expect("rank 0")
        });
        assert!(matches!(waited, Err(CommError::Aborted)), "{waited:?}");
    }
}
