//! Executors: run a graph or program, scheduled or not, over a world of ranks.
//!
//! The core here is shared by every backend. Each rank runs its own interpreter
//! ([`world::run_rank`]) over the same plans, driving its own [`Backend`] and exchanging
//! buffers with the other ranks only through its [`comm::Communicator`]: in-process ranks are
//! threads joined by [`comm::ThreadComm`] ([`world::run_threads`]); a rank per process (one per
//! GPU) calls [`world::run_rank`] with the communicator of its library. The core owns
//! everything that is not arithmetic:
//!
//! - **Liveness.** Each value lives in the storage of its alias class (`passes::alias`); a
//!   class is allocated when its allocating node runs and freed ([`Backend::free`]) right after
//!   its last real use (`passes::liveness::LastUses` on the graph's own order), exactly as the
//!   simulator counts it. Graph inputs are allocated at the start (one that nothing reads is
//!   freed at its place in the order); parameters, attributes, gathered buffers and whatever
//!   the output returns stay to the end of the graph.
//! - **ZeRO-3 ops with real data.** A sharded parameter's placeholder holds the rank's shard
//!   (flattened, padded to a multiple of N, one N-th). `allgather` starts an all-gather of every
//!   rank's shard into the padded full buffer (cast first when it carries a `dtype`); `wait`
//!   waits for it and views it as the parameter; `release` frees it; `keep` leaves it resident
//!   for a later graph's `reuse`; `reduce_grad` starts a reduce-scatter (sharded) or an
//!   all-reduce (persistent) of the gradient, awaited where its result is first read;
//!   `end_backward` hands the reductions on.
//! - **Byte counting.** Every allocation goes through [`alloc::Counter`]: measured peak per
//!   rank, and peak gathered-parameter bytes (which equal the simulator's and the checker's
//!   for the same schedule: same walk, same padded sizes). A collective's result is counted
//!   when it starts, as the simulator counts it.
//! - **Safety.** Plans resolve every node's kernel ([`Backend::resolve`]) before anything
//!   runs: an op the backend lacks is an error naming op and node. While running, a real use of
//!   storage that a release (or liveness) already freed is an error naming the reading node: a
//!   broken schedule fails loudly instead of reading stale data. A rank that fails aborts its
//!   communicator, so no other rank waits for it forever.
//!
//! The CPU reference backend (crate `zerosched-exec-cpu`) computes; [`dry::Dry`] only carries
//! byte sizes (`--dry-run`: allocation, liveness and collectives, no arithmetic), and its peak
//! is what a run is checked against before it starts ([`memory`]). Inputs and outputs travel as
//! [`host::Tensor`]s.

#![forbid(unsafe_code)]

pub mod alloc;
pub mod comm;
pub mod dry;
mod error;
pub mod host;
pub mod inputs;
pub mod memory;
mod plan;
mod rank;
pub mod world;

pub use error::{BackendError, CommError, ExecError, NodeError, UseAfterFree};
pub use plan::{Plan, plans};
pub use world::{GraphRun, ProgramRun};

use zerosched_ir::{Arg, Dtype, Graph, Node, NodeId, TensorMeta, Val};

/// A node's value on one rank.
#[derive(Clone, Debug, Default)]
pub enum Value<T> {
    /// No value (releases, the output node, non-tensor results, a collective in flight).
    #[default]
    None,
    Tensor(T),
    /// A multi-output op's results (`None` for non-tensor entries).
    List(Vec<Option<T>>),
    /// Its storage was freed before this node made its (view) value: any real use is an error.
    Dead,
}

/// What a kernel sees: its node and the values computed so far on its rank.
pub struct Env<'a, T> {
    pub g: &'a Graph,
    pub id: NodeId,
    values: &'a [Value<T>],
}

impl<'a, T> Env<'a, T> {
    pub fn node(&self) -> &'a Node {
        self.g.node(self.id)
    }

    pub fn value(&self, id: NodeId) -> Result<&'a Value<T>, String> {
        self.values
            .get(id.index())
            .ok_or_else(|| format!("no value for node #{}", id.index()))
    }

    /// The tensor a bare node reference names.
    pub fn tensor(&self, a: &Arg<NodeId>) -> Result<&'a T, String> {
        let id = a
            .as_node()
            .ok_or_else(|| format!("expected a tensor argument, found {a:?}"))?;
        match self.value(*id)? {
            Value::Tensor(t) => Ok(t),
            Value::Dead => Err(format!("`{}` was freed", self.g.node(*id).name)),
            _ => Err(format!("`{}` is not a tensor", self.g.node(*id).name)),
        }
    }

    /// Positional argument `i`.
    pub fn arg(&self, i: usize) -> Result<&'a Arg<NodeId>, String> {
        self.node()
            .args
            .get(i)
            .ok_or_else(|| format!("missing argument {i}"))
    }

    /// Positional argument `i`, else keyword `name`.
    pub fn arg_or_kw(&self, i: usize, name: &str) -> Option<&'a Arg<NodeId>> {
        let n = self.node();
        n.args.get(i).or_else(|| n.kwargs.get(name))
    }

    /// The node's recorded output tensor metadata.
    pub fn out_meta(&self) -> Option<&'a TensorMeta> {
        match &self.node().meta.val {
            Some(Val::Tensor(t)) => Some(t),
            _ => None,
        }
    }

    /// How many outputs a multi-output node records (`default` when it records none).
    pub fn n_outputs(&self, default: usize) -> usize {
        match &self.node().meta.val {
            Some(Val::Tuple(ts)) => ts.len(),
            _ => default,
        }
    }

    /// The recorded metadata of output `k` of a multi-output node.
    pub fn out_meta_k(&self, k: usize) -> Option<&'a TensorMeta> {
        match &self.node().meta.val {
            Some(Val::Tuple(ts)) => ts.get(k).and_then(Option::as_deref),
            Some(Val::Tensor(t)) if k == 0 => Some(t),
            _ => None,
        }
    }
}

/// One rank's device (or the host): its buffers and kernels. A backend is made per rank (one
/// device, its streams, its pool), so it need not be shareable between threads; only its
/// kernels, resolved once per node into the plan, are shared by every rank.
///
/// Work a backend issues may complete asynchronously: the core never assumes a result is
/// ready before it reads it through the backend, and frees through [`Backend::free`], which
/// may defer the release until every stream that used the buffer has passed it.
pub trait Backend: Sized {
    /// A handle to a buffer (or a view of one) on this rank.
    type Tensor: Clone;
    /// What [`Backend::resolve`] finds for a target, shared by every rank's interpreter.
    type Kernel: Send + Sync;
    /// For messages: `cpu`, `dry-run`, ...
    const NAME: &'static str;
    /// The kernel of an aten target, if the backend has one. Called once per node when the
    /// plan is made, never while running.
    fn resolve(target: &str) -> Option<Self::Kernel>;
    /// Runs one compute node (anything but the inserted ops, placeholders and the output).
    fn compute(
        &mut self,
        kernel: &Self::Kernel,
        env: &Env<'_, Self::Tensor>,
    ) -> Result<Value<Self::Tensor>, BackendError>;
    fn numel(&self, t: &Self::Tensor) -> u64;
    fn dtype(&self, t: &Self::Tensor) -> Dtype;
    /// Bytes a tensor's buffer holds.
    fn nbytes(&self, t: &Self::Tensor) -> u64 {
        self.numel(t).saturating_mul(self.dtype(t).size())
    }
    /// A graph input of the given metadata; `make` produces its data on the host when the
    /// backend needs data (a dry run never calls it).
    fn input(
        &mut self,
        meta: &TensorMeta,
        make: &mut dyn FnMut() -> Result<host::Tensor, String>,
    ) -> Result<Self::Tensor, NodeError>;
    /// Rank `rank`'s shard of a parameter of the given (full) metadata: by default the full
    /// input, sharded, then freed. A backend without data (replay) allocates the shard alone,
    /// so that the full parameter never counts in its memory.
    fn sharded_input(
        &mut self,
        meta: &TensorMeta,
        make: &mut dyn FnMut() -> Result<host::Tensor, String>,
        world: u32,
        rank: u32,
    ) -> Result<Self::Tensor, NodeError> {
        let full = self.input(meta, make)?;
        let shard = self.shard(&full, world, rank);
        self.free(full);
        Ok(shard?)
    }
    /// The tensor's data on the host (waiting for the work that makes it), if the backend
    /// has data.
    fn download(&mut self, t: &Self::Tensor) -> Result<Option<host::Tensor>, BackendError>;
    /// Rank `rank`'s shard of a full tensor: flattened, padded to a multiple of `world`.
    fn shard(
        &mut self,
        full: &Self::Tensor,
        world: u32,
        rank: u32,
    ) -> Result<Self::Tensor, BackendError>;
    /// The first `product(shape)` elements of a flat buffer, as `shape`.
    fn unflatten(
        &mut self,
        flat: &Self::Tensor,
        shape: &[usize],
    ) -> Result<Self::Tensor, BackendError>;
    /// The executor is done with this storage (liveness, a release, the end of a graph or
    /// program): called once per storage class with one handle to it (the allocating node's
    /// value; for a reused parameter, its full view), after every other handle was dropped,
    /// and once per handle [`Backend::share`] made. The storage goes back when the last of
    /// those is freed. The backend may defer the release until the work that reads the
    /// storage is done.
    fn free(&mut self, t: Self::Tensor);
    /// Another owning handle to `t`'s storage: a graph's output carried to a later graph,
    /// which frees it as its own input while the graph that made it frees its class. Several
    /// outputs may view one storage (a saved activation and a view of it), and each is freed
    /// on its own. A backend whose tensors count their references themselves clones.
    fn share(&mut self, t: &Self::Tensor) -> Self::Tensor {
        t.clone()
    }
    /// Bytes of live buffers by the backend's own count, where it keeps one (a device pool),
    /// set beside the executor's count after every node ([`alloc::Held`]).
    fn held_bytes(&self) -> Option<u64> {
        None
    }
}

/// The buffer arithmetic that in-process collectives ([`comm::ThreadComm`]) combine ranks'
/// buffers with, for backends whose ranks share one address space.
pub trait Local: Backend {
    /// Every rank's shard (rank order) concatenated into the padded flat buffer, each cast to
    /// `dtype` first when given.
    fn concat(
        &mut self,
        parts: &[&Self::Tensor],
        dtype: Option<Dtype>,
    ) -> Result<Self::Tensor, BackendError>;
    /// The elementwise sum of one tensor per rank, left to right in rank order (so that a
    /// reference can reproduce its bits).
    fn sum(&mut self, parts: &[&Self::Tensor]) -> Result<Self::Tensor, BackendError>;
}
