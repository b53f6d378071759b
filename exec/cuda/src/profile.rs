//! Numeric mode over a device the caller keeps ([`Numeric`]), and profile mode
//! (`zerosched profile`): the graph runs in numeric mode, and every compute node's
//! kernels run several times, each run event-timed alone on the compute stream; the median
//! becomes the node's `device_time_ms`, which the cost model takes before its roofline
//! estimate. Views, `getitem` and in-place ops run once (repeating an in-place op would change
//! what later nodes read); views and `getitem` are not recorded, since the cost model prices
//! them at zero whatever they carry.

use crate::backend::{self, Cuda, CudaTensor, Kernel};
use crate::comm::OnCuda;
use crate::device::{Device, StreamKind};
use cudarc::driver::CudaEvent;
use zerosched_exec::{Backend, BackendError, Env, NodeError, Value, host};
use zerosched_ir::{Dtype, Graph, NodeId, Program, TensorMeta, aten, comm};
use zerosched_passes::alias::Aliases;

/// One graph's entry: its address while the plans borrow it, whether each node may run more
/// than once, and its medians, by node index.
type GraphTimes = (usize, Vec<bool>, Vec<Option<f64>>);

/// Measured milliseconds per node, per graph of one program.
#[derive(Clone, Debug, Default)]
pub struct Times {
    graphs: Vec<GraphTimes>,
}

fn address(g: &Graph) -> usize {
    std::ptr::from_ref(g) as usize
}

/// Whether the cost model prices the node by what it records (not a view, not a getitem).
fn priced(target: &str) -> bool {
    target != comm::GETITEM && !aten::op_name(target).is_some_and(aten::is_view_op)
}

impl Times {
    pub fn new(p: &Program) -> Times {
        let graphs = p
            .graphs
            .iter()
            .map(|g| {
                let aliases = Aliases::analyse(g);
                let mut repeat = vec![false; g.node_bound()];
                for (id, n) in g.nodes() {
                    repeat[id.index()] = aliases.class(id) == Some(id) && priced(&n.target);
                }
                (address(g), repeat, vec![None; g.node_bound()])
            })
            .collect();
        Times { graphs }
    }

    fn graph(&mut self, g: &Graph) -> Option<&mut GraphTimes> {
        let a = address(g);
        self.graphs.iter_mut().find(|(ga, _, _)| *ga == a)
    }

    /// Records `ms` for node `id` of `g` (a graph of the program these times were made for).
    pub fn set(&mut self, g: &Graph, id: NodeId, ms: f64) {
        if let Some((_, _, t)) = self.graph(g)
            && let Some(slot) = t.get_mut(id.index())
        {
            *slot = Some(ms);
        }
    }

    /// Writes every recorded time into its node's `device_time_ms` (graphs in program order,
    /// as [`Times::new`] saw them); returns how many nodes it set.
    pub fn write(&self, p: &mut Program) -> usize {
        let mut set = 0;
        for (g, (_, _, times)) in p.graphs.iter_mut().zip(&self.graphs) {
            let ids: Vec<NodeId> = g.nodes().map(|(id, _)| id).collect();
            for id in ids {
                let priced = priced(&g.node(id).target);
                if let Some(ms) = times.get(id.index()).copied().flatten().filter(|_| priced) {
                    g.meta_mut(id).device_time_ms = Some(ms);
                    set += 1;
                }
            }
        }
        set
    }
}

/// The median of `v` (the mean of the middle two for an even count).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The numeric CUDA backend over a device the caller keeps (across steps, so that its pool
/// and compiled kernels stay warm), timing each compute node `runs` times into [`Times`]
/// when profiling.
pub struct Numeric<'a> {
    cuda: &'a mut Cuda,
    profile: Option<(usize, &'a mut Times)>,
    spans: Option<&'a mut Spans>,
}

impl<'a> Numeric<'a> {
    /// Numeric mode, each graph's compute span measured into `spans`.
    pub fn new(cuda: &'a mut Cuda, spans: &'a mut Spans) -> Numeric<'a> {
        Numeric {
            cuda,
            profile: None,
            spans: Some(spans),
        }
    }

    pub fn profiling(cuda: &'a mut Cuda, runs: usize, times: &'a mut Times) -> Numeric<'a> {
        Numeric {
            cuda,
            profile: Some((runs.max(1), times)),
            spans: None,
        }
    }
}

/// The compute stream's span of each graph run: from before its first kernel to after its
/// last, so that the inputs' uploads before it and the outputs' downloads after it are not
/// counted (the host's time between kernels is).
#[derive(Default)]
pub struct Spans {
    /// The graph being run (its address), the event before its first kernel and the event
    /// after its latest one.
    open: Option<(usize, CudaEvent, Option<CudaEvent>)>,
    ms: Vec<f64>,
}

impl Spans {
    /// Events around a kernel of `g`: a new span starts at a new graph.
    fn before(&mut self, dev: &Device, g: &Graph) -> crate::Result<()> {
        let a = address(g);
        if self.open.as_ref().is_none_or(|(og, _, _)| *og != a) {
            self.close()?;
            self.open = Some((a, dev.timing_event(StreamKind::Compute)?, None));
        }
        Ok(())
    }

    /// After each kernel: one event per span, recorded again (cheaper than a new one).
    fn after(&mut self, dev: &Device) -> crate::Result<()> {
        match &mut self.open {
            Some((_, _, Some(last))) => last
                .record(dev.stream(StreamKind::Compute))
                .map_err(crate::CudaError::driver("cuEventRecord")),
            Some((_, _, last)) => {
                *last = Some(dev.timing_event(StreamKind::Compute)?);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Ends the open span (waiting for its last kernel).
    pub fn close(&mut self) -> crate::Result<()> {
        if let Some((_, start, Some(end))) = self.open.take() {
            end.synchronize()
                .map_err(crate::CudaError::driver("cuEventSynchronize"))?;
            let ms = start
                .elapsed_ms(&end)
                .map_err(crate::CudaError::driver("cuEventElapsedTime"))?;
            self.ms.push(f64::from(ms));
        }
        Ok(())
    }

    /// The closed spans' total, ms; and starts over.
    pub fn take_total_ms(&mut self) -> f64 {
        std::mem::take(&mut self.ms).iter().sum()
    }
}

/// Returns what a repeat made, except buffers it shares with the node's inputs or with the
/// result kept.
fn drop_repeat(cuda: &mut Cuda, v: Value<CudaTensor>, keep: &[u64]) {
    let ts = match v {
        Value::Tensor(t) => vec![t],
        Value::List(ts) => ts.into_iter().flatten().collect(),
        Value::None | Value::Dead => vec![],
    };
    for t in ts {
        if !keep.contains(&t.block.ptr) {
            cuda.release(&t);
        }
    }
}

/// Runs kernel `k` of node `env` `runs` times (once where it may not repeat), each timed
/// alone, and records the median; returns the first run's value.
fn timed(
    cuda: &mut Cuda,
    runs: usize,
    times: &mut Times,
    k: &Kernel,
    env: &Env<'_, CudaTensor>,
) -> Result<Value<CudaTensor>, BackendError> {
    let repeat = times
        .graph(env.g)
        .and_then(|(_, r, _)| r.get(env.id.index()).copied())
        .unwrap_or(false);
    let runs = if repeat { runs } else { 1 };
    let dev = cuda.dev.clone();
    let mut ms = Vec::with_capacity(runs);
    let mut kept: Option<Value<CudaTensor>> = None;
    let mut keep: Vec<u64> = env
        .g
        .inputs(env.id)
        .into_iter()
        .filter_map(|i| env.value(i).ok())
        .flat_map(blocks)
        .collect();
    for _ in 0..runs {
        let (t, v) = dev
            .time_ms(StreamKind::Compute, || Ok(k(cuda, env)))
            .map_err(device_err)?;
        let v = v.map_err(BackendError::Kernel)?;
        ms.push(t);
        match kept {
            None => {
                keep.extend(blocks(&v));
                kept = Some(v);
            }
            Some(_) => drop_repeat(cuda, v, &keep),
        }
    }
    times.set(env.g, env.id, median(&mut ms));
    Ok(kept.unwrap_or_default())
}

fn blocks(v: &Value<CudaTensor>) -> Vec<u64> {
    match v {
        Value::Tensor(t) => vec![t.block.ptr],
        Value::List(ts) => ts.iter().flatten().map(|t| t.block.ptr).collect(),
        Value::None | Value::Dead => vec![],
    }
}

fn device_err(e: impl std::fmt::Display) -> BackendError {
    BackendError::Device(e.to_string())
}

impl Backend for Numeric<'_> {
    type Tensor = CudaTensor;
    type Kernel = Kernel;
    const NAME: &'static str = "cuda";

    fn resolve(target: &str) -> Option<Kernel> {
        backend::resolve(target)
    }

    fn compute(
        &mut self,
        k: &Kernel,
        env: &Env<'_, CudaTensor>,
    ) -> Result<Value<CudaTensor>, BackendError> {
        if let Some((runs, times)) = &mut self.profile {
            return timed(self.cuda, *runs, times, k, env);
        }
        let Some(spans) = &mut self.spans else {
            return k(self.cuda, env).map_err(BackendError::Kernel);
        };
        let dev = self.cuda.dev.clone();
        spans.before(&dev, env.g).map_err(device_err)?;
        let v = k(self.cuda, env).map_err(BackendError::Kernel)?;
        spans.after(&dev).map_err(device_err)?;
        Ok(v)
    }

    fn numel(&self, t: &CudaTensor) -> u64 {
        self.cuda.numel(t)
    }

    fn dtype(&self, t: &CudaTensor) -> Dtype {
        t.dtype
    }

    fn input(
        &mut self,
        meta: &TensorMeta,
        make: &mut dyn FnMut() -> Result<host::Tensor, String>,
    ) -> Result<CudaTensor, NodeError> {
        self.cuda.input(meta, make)
    }

    fn download(&mut self, t: &CudaTensor) -> Result<Option<host::Tensor>, BackendError> {
        self.cuda.download(t)
    }

    fn shard(
        &mut self,
        full: &CudaTensor,
        world: u32,
        rank: u32,
    ) -> Result<CudaTensor, BackendError> {
        self.cuda.shard(full, world, rank)
    }

    fn unflatten(
        &mut self,
        flat: &CudaTensor,
        shape: &[usize],
    ) -> Result<CudaTensor, BackendError> {
        self.cuda.unflatten(flat, shape)
    }

    fn free(&mut self, t: CudaTensor) {
        self.cuda.free(t);
    }

    fn share(&mut self, t: &CudaTensor) -> CudaTensor {
        self.cuda.share(t)
    }

    fn held_bytes(&self) -> Option<u64> {
        self.cuda.held_bytes()
    }
}

impl OnCuda for Numeric<'_> {
    fn cuda(&mut self) -> &mut Cuda {
        self.cuda
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerosched_ir::GraphKind;
    use zerosched_ir::testing::GraphBuilder;
    use zerosched_passes::cost::CostModel;

    /// `x [64,128]`, `w [256,128]`; `t = t(w)` (a view), `y = mm(x, t)`, `z = relu(y)`,
    /// `s = split(z)` with its getitems.
    fn program() -> Program {
        let mut b = GraphBuilder::new("profiled", GraphKind::Forward);
        let x = b.input("x", &[64, 128]);
        let w = b.param("w", &[256, 128]);
        let t = b.op("t", "aten.t.default", &[w], &[128, 256]);
        let y = b.op("y", "aten.mm.default", &[x, t], &[64, 256]);
        let z = b.op("z", "aten.relu.default", &[y], &[64, 256]);
        let parts = b.list_view(
            "s",
            "aten.split.Tensor",
            vec![zerosched_ir::testing::node(z), zerosched_ir::Arg::Int(32)],
            2,
            &[32, 256],
        );
        Program::single(b.output(&parts))
    }

    fn id(g: &Graph, name: &str) -> NodeId {
        g.nodes()
            .find(|(_, n)| n.name.as_str() == name)
            .map(|(id, _)| id)
            .unwrap()
    }

    #[test]
    fn only_real_kernels_repeat() {
        let p = program();
        let t = Times::new(&p);
        let g = &p.graphs[0];
        let (_, repeat, _) = &t.graphs[0];
        for (name, want) in [
            ("y", true),
            ("z", true),
            ("t", false),
            ("s", false),
            ("s_0", false),
        ] {
            assert_eq!(repeat[id(g, name).index()], want, "{name}");
        }
    }

    #[test]
    fn measured_times_survive_export_and_the_cost_model_takes_them() {
        let mut p = program();
        let mut t = Times::new(&p);
        let g = &p.graphs[0];
        let (y, z, view, item) = (id(g, "y"), id(g, "z"), id(g, "t"), id(g, "s_0"));
        t.set(g, y, 1.25);
        t.set(g, z, 0.0625);
        // A view and a getitem measure launch noise: not recorded.
        t.set(g, view, 0.5);
        t.set(g, item, 0.5);
        assert_eq!(t.write(&mut p), 2);
        let back = zerosched_ir::json::import(&zerosched_ir::json::export(&p)).unwrap();
        let g = &back.graphs[0];
        let (y, z, view) = (id(g, "y"), id(g, "z"), id(g, "t"));
        assert_eq!(g.node(y).meta.device_time_ms, Some(1.25));
        assert_eq!(g.node(z).meta.device_time_ms, Some(0.0625));
        assert_eq!(g.node(view).meta.device_time_ms, None);
        let costs = CostModel::default().compute_costs(g);
        assert_eq!(
            costs[y], 1.25,
            "the measured time, not the roofline estimate"
        );
        assert_eq!(costs[z], 0.0625);
        assert_eq!(costs[view], 0.0);
        let unprofiled = CostModel::default().compute_costs(&program().graphs[0]);
        assert_ne!(unprofiled[id(&program().graphs[0], "y")], 1.25);
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
