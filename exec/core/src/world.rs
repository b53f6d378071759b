//! Running whole programs: every rank runs every graph in order through its own interpreter
//! ([`run_rank`]), graph inputs from [`Inputs`] (parameters drawn once on the host and shared
//! by every rank), values that one graph returns handed to the later graphs' placeholders of
//! the same name, and the buffers a forward keeps carried to the backward. In one process the
//! ranks are threads ([`run_threads`], [`run_program`]); a process per rank calls
//! [`run_rank`] itself.

use crate::alloc::Counter;
use crate::comm::{Communicator, ThreadComm};
use crate::inputs::Inputs;
use crate::rank::{Rank, RankGraph};
use crate::{Backend, BackendError, ExecError, Local, Plan, host, plans};
use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use zerosched_ir::{Graph, Param, Program};

/// One graph's run over the world.
#[derive(Clone, Debug)]
pub struct GraphRun {
    pub graph: String,
    /// Per rank, the returned values in output order (`None` for non-tensors, and for every
    /// value of a backend without data).
    pub outputs: Vec<Vec<Option<host::Tensor>>>,
    /// Per rank, each output's (sum, absolute sum), also where the outputs were not kept.
    pub checksums: Vec<Vec<Option<(f64, f64)>>>,
    /// Per rank, the allocator's figures for this graph.
    pub memory: Vec<Counter>,
    pub nodes: usize,
}

/// A whole program's run.
#[derive(Clone, Debug)]
pub struct ProgramRun {
    pub graphs: Vec<GraphRun>,
}

impl ProgramRun {
    /// Per rank, the largest peak over the graphs.
    pub fn peak_per_rank(&self) -> Vec<u64> {
        let ranks = self.graphs.first().map_or(0, |g| g.memory.len());
        (0..ranks)
            .map(|r| {
                self.graphs
                    .iter()
                    .map(|g| g.memory[r].peak)
                    .max()
                    .unwrap_or(0)
            })
            .collect()
    }

    /// The largest gathered-parameter peak over graphs and ranks.
    pub fn peak_gathered(&self) -> u64 {
        self.graphs
            .iter()
            .flat_map(|g| g.memory.iter().map(|c| c.peak_gathered))
            .max()
            .unwrap_or(0)
    }
}

impl ProgramRun {
    /// The run of a world of one: this process's rank (one process per device), as
    /// [`run_rank`] returned it.
    pub fn of_rank<B: Backend>(plans: &[Plan<'_, B>], run: RankRun) -> ProgramRun {
        let graphs = plans
            .iter()
            .zip(run.graphs)
            .map(|(plan, (outputs, checksums, counter))| GraphRun {
                graph: plan.graph().label().to_owned(),
                outputs: vec![outputs],
                checksums: vec![checksums],
                memory: vec![counter],
                nodes: plan.graph().len(),
            })
            .collect();
        ProgramRun { graphs }
    }
}

/// The inputs as every rank of a process sees them: parameters are drawn (or read) once, on
/// the host, and every rank's backend takes them from here.
pub struct HostInputs<'a> {
    pub inputs: &'a Inputs,
    params: Mutex<BTreeMap<String, host::Tensor>>,
}

impl<'a> HostInputs<'a> {
    pub fn new(inputs: &'a Inputs) -> HostInputs<'a> {
        HostInputs {
            inputs,
            params: Mutex::new(BTreeMap::new()),
        }
    }

    /// A parameter's full value.
    pub fn param(&self, g: &Graph, p: &Param) -> Result<host::Tensor, String> {
        let mut params = self.params.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = params.get(&p.name) {
            return Ok(t.clone());
        }
        let t = self.inputs.param(g, p)?;
        params.insert(p.name.clone(), t.clone());
        Ok(t)
    }
}

/// What one rank computed and measured, graph by graph.
pub struct RankRun {
    /// Per graph: the outputs in output order, their checksums, and the allocator's figures.
    pub graphs: Vec<Checked>,
}

/// One graph's outputs on one rank (`None` where not kept), their (sum, absolute sum), and
/// the allocator's figures.
pub type Checked = (Vec<Option<host::Tensor>>, Vec<Option<(f64, f64)>>, Counter);

/// Runs every graph of the plans in order on one rank. On failure the communicator is aborted,
/// so that the other ranks stop too. Without `keep_outputs`, only the outputs' checksums stay
/// on the host.
pub fn run_rank<B: Backend, C: Communicator<B>>(
    plans: &[Plan<'_, B>],
    host: &HostInputs<'_>,
    backend: B,
    comm: &mut C,
    keep_outputs: bool,
) -> Result<RankRun, ExecError> {
    let paired = plans.iter().any(|p| p.graph().forward.is_some());
    let mut rank = Rank::new(backend, comm, host, paired, keep_outputs);
    let mut graphs = Vec::with_capacity(plans.len());
    for plan in plans {
        match rank.run_graph(plan) {
            Ok(RankGraph {
                outputs,
                checksums,
                counter,
            }) => graphs.push((outputs, checksums, counter)),
            Err(e) => {
                rank.comm.abort();
                return Err(e);
            }
        }
    }
    rank.finish();
    Ok(RankRun { graphs })
}

/// Runs the plans on one thread per communicator (rank order): `backend(rank)` makes each
/// rank's backend on its own thread. The error reported is the first rank's own failure, not
/// another rank's abort.
pub fn run_threads<B, C, F>(
    plans: &[Plan<'_, B>],
    inputs: &Inputs,
    comms: Vec<C>,
    backend: F,
) -> Result<ProgramRun, ExecError>
where
    B: Backend,
    C: Communicator<B> + Send,
    F: Fn(u32) -> Result<B, BackendError> + Sync,
{
    let host = HostInputs::new(inputs);
    let world = comms.len();
    // A rank's whole run; a panic aborts the world too, then goes on unwinding once every
    // rank has stopped.
    let rank_run = |mut comm: C| {
        let rank = comm.rank();
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let b = backend(rank).map_err(|source| ExecError::Rank { rank, source })?;
            run_rank(plans, &host, b, &mut comm, true)
        }));
        if !matches!(run, Ok(Ok(_))) {
            comm.abort();
        }
        run
    };
    let finished: Vec<std::thread::Result<Result<RankRun, ExecError>>> = if world == 1 {
        // One rank runs on the calling thread: nothing to overlap, and its warm allocator.
        comms.into_iter().map(rank_run).collect()
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| s.spawn(|| rank_run(comm)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().and_then(|r| r))
                .collect()
        })
    };
    let results: Vec<Result<RankRun, ExecError>> = finished
        .into_iter()
        .map(|r| r.unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
        .collect();
    let mut runs = Vec::with_capacity(world);
    let mut first_err: Option<ExecError> = None;
    for r in results {
        match r {
            Ok(run) => runs.push(run),
            Err(e) => match &first_err {
                Some(f) if !f.is_abort() || e.is_abort() => {}
                _ => first_err = Some(e),
            },
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    let graphs = plans
        .iter()
        .enumerate()
        .map(|(gi, plan)| {
            let g = plan.graph();
            let (mut outputs, mut checksums, mut memory) = (vec![], vec![], vec![]);
            for r in &mut runs {
                let (o, c, m) = std::mem::take(&mut r.graphs[gi]);
                outputs.push(o);
                checksums.push(c);
                memory.push(m);
            }
            GraphRun {
                graph: g.label().to_owned(),
                outputs,
                checksums,
                memory,
                nodes: g.len(),
            }
        })
        .collect();
    Ok(ProgramRun { graphs })
}

/// Runs every graph of `p` in order on `world` ranks, threads of this process joined by a
/// [`ThreadComm`]. Every op the backend lacks, and every input file that does not fit, is
/// refused before anything runs.
pub fn run_program<B, F>(
    p: &Program,
    inputs: &Inputs,
    world: u32,
    backend: F,
) -> Result<ProgramRun, ExecError>
where
    B: Local,
    B::Tensor: Send,
    F: Fn(u32) -> Result<B, BackendError> + Sync,
{
    let plans = plans::<B>(p)?;
    inputs.check(p)?;
    run_threads(&plans, inputs, ThreadComm::world(world), backend)
}

/// Reassembles a sharded tensor from every rank's shard: all-gather, then the first
/// `product(shape)` elements as `shape`.
pub fn unshard<B: Local>(
    b: &mut B,
    shards: &[&B::Tensor],
    shape: &[usize],
) -> Result<B::Tensor, BackendError> {
    let flat = b.concat(shards, None)?;
    b.unflatten(&flat, shape)
}
