//! Replay mode: every compute node of a graph runs a calibrated spin kernel for its cost-model
//! duration (its `device_time_ms` when profiled, else the roofline estimate) while
//! allocations and collectives are real, on buffers of the graph's shapes whose contents are
//! never initialised. So any schedule of any graph runs on GPUs with no kernels for its ops
//! and no weights, and the measured step, exposed communication and pool peak stand beside
//! the simulator's.
//!
//! The spin kernel is one thread spinning on the GPU's global nanosecond timer. The timer
//! itself is exact; what calibration measures is the fixed cost around it (launch and timer
//! granularity) and the ratio of event-timed duration to requested duration, fitted as a line
//! from two lengths at start-up, so that a requested duration is what the compute stream
//! actually spends. Replay fits it on back-to-back spins, as it runs them; a node shorter
//! than the fixed cost is owed to the next spin, so the compute stream's total stays the sum
//! of the nodes' durations.

use crate::backend::{Cuda, CudaTensor};
use crate::comm::OnCuda;
use crate::device::{Device, StreamKind};
use crate::error::{CudaError, Result};
use crate::kernels::{Kernels, contiguous_strides};
use zerosched_exec::{Backend, BackendError, Env, NodeError, Value, host};
use zerosched_ir::{Dtype, Graph, NodeId, Program, TensorMeta, Val};
use zerosched_passes::alias::Aliases;
use zerosched_passes::cost::CostModel;

/// The fitted line `measured_ns = slope * requested_ns + intercept_ns`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spin {
    pub slope: f64,
    pub intercept_ns: f64,
}

impl Spin {
    /// Fits the line from medians of 7 runs at 20 µs and 200 µs (after a warm-up), each one
    /// spin timed alone.
    pub fn calibrate(dev: &Device, k: &mut Kernels) -> Result<Spin> {
        Spin::calibrate_batch(dev, k, 1)
    }

    /// The same fit over `batch` spins queued back to back per timed run (per-spin figures):
    /// the fixed cost between consecutive kernels, which is what a replayed graph pays.
    pub fn calibrate_batch(dev: &Device, k: &mut Kernels, batch: usize) -> Result<Spin> {
        for _ in 0..3 {
            measure_batch_ns(dev, k, 10_000, batch)?;
        }
        let median = |dev: &Device, k: &mut Kernels, ns: i64| -> Result<f64> {
            let mut v = (0..7)
                .map(|_| measure_batch_ns(dev, k, ns, batch))
                .collect::<Result<Vec<f64>>>()?;
            v.sort_by(f64::total_cmp);
            Ok(v[v.len() / 2])
        };
        let (r1, r2) = (20_000.0, 200_000.0);
        let m1 = median(dev, k, r1 as i64)?;
        let m2 = median(dev, k, r2 as i64)?;
        let slope = (m2 - m1) / (r2 - r1);
        if !(0.5..2.0).contains(&slope) {
            return Err(CudaError::Invalid(format!(
                "spin calibration: {m1:.0} ns for 20 µs and {m2:.0} ns for 200 µs are not a line of slope near 1"
            )));
        }
        Ok(Spin {
            slope,
            intercept_ns: m1 - slope * r1,
        })
    }

    /// Nanoseconds to ask the kernel for so that it takes `us` microseconds.
    pub fn request_ns(&self, us: f64) -> i64 {
        ((us * 1e3 - self.intercept_ns) / self.slope)
            .max(0.0)
            .round() as i64
    }

    /// Queues a spin of `us` microseconds on `stream`.
    pub fn run(&self, k: &mut Kernels, us: f64, stream: StreamKind) -> Result<()> {
        k.spin(self.request_ns(us), stream)
    }
}

/// Event-timed nanoseconds of one spin of `ns` on the compute stream.
pub fn measure_ns(dev: &Device, k: &mut Kernels, ns: i64) -> Result<f64> {
    measure_batch_ns(dev, k, ns, 1)
}

/// Event-timed nanoseconds per spin of `batch` spins of `ns` queued back to back.
fn measure_batch_ns(dev: &Device, k: &mut Kernels, ns: i64, batch: usize) -> Result<f64> {
    let batch = batch.max(1);
    let (ms, ()) = dev.time_ms(StreamKind::Compute, || {
        (0..batch).try_for_each(|_| k.spin(ns, StreamKind::Compute))
    })?;
    Ok(ms * 1e6 / batch as f64)
}

/// What replay does at one node.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NodeStep {
    /// Compute-stream microseconds (0 for views, placeholders and inserted ops).
    pub us: f64,
    /// The argument whose storage the node's value lives in (views, in-place ops): its value
    /// is a view of that argument's buffer instead of a new one.
    pub view_of: Option<NodeId>,
}

/// Replay's per-node steps for every graph of a program, computed before anything runs.
#[derive(Clone, Debug, Default)]
pub struct Table {
    /// Per graph: its address (the plans borrow the program's graphs, so a graph is known by
    /// it while running) and its steps by node index.
    graphs: Vec<(usize, Vec<NodeStep>)>,
    compute_us: f64,
}

fn address(g: &Graph) -> usize {
    std::ptr::from_ref(g) as usize
}

impl Table {
    /// Durations from `cost` (which takes a node's `device_time_ms` when it has one).
    pub fn new(p: &Program, cost: &CostModel) -> Table {
        let mut compute_us = 0.0;
        let graphs = p
            .graphs
            .iter()
            .map(|g| {
                let ms = cost.compute_costs(g);
                let aliases = Aliases::analyse(g);
                let mut steps = vec![NodeStep::default(); g.node_bound()];
                for (id, _) in g.nodes() {
                    let class = aliases.class(id).filter(|&c| c != id);
                    let view_of = class.and_then(|c| {
                        g.inputs(id)
                            .into_iter()
                            .find(|&v| aliases.class(v) == Some(c))
                    });
                    steps[id.index()] = NodeStep {
                        us: ms[id] * 1e3,
                        view_of,
                    };
                    compute_us += ms[id] * 1e3;
                }
                (address(g), steps)
            })
            .collect();
        Table { graphs, compute_us }
    }

    /// The step of node `id` of `g`.
    pub fn step(&self, g: &Graph, id: NodeId) -> Option<NodeStep> {
        let a = address(g);
        let (_, steps) = self.graphs.iter().find(|(ga, _)| *ga == a)?;
        steps.get(id.index()).copied()
    }

    /// The compute stream's total over the program, µs: a step's compute time.
    pub fn compute_us(&self) -> f64 {
        self.compute_us
    }
}

/// One rank's replay backend, over the rank's [`Cuda`] device (kept by the caller across
/// steps, so that its pool stays warm).
pub struct Replay<'a> {
    cuda: &'a mut Cuda,
    spin: Spin,
    table: &'a Table,
    /// Compute microseconds not yet spun (each below the spin's fixed cost).
    owed_us: f64,
}

/// The spin fitted for replay on `cuda`'s compute stream: 16 spins back to back per run.
pub fn calibrate(cuda: &mut Cuda) -> Result<Spin> {
    Spin::calibrate_batch(&cuda.dev, &mut cuda.k, 16)
}

impl<'a> Replay<'a> {
    pub fn new(cuda: &'a mut Cuda, spin: Spin, table: &'a Table) -> Replay<'a> {
        Replay {
            cuda,
            spin,
            table,
            owed_us: 0.0,
        }
    }

    /// Queues `us` more of compute, spinning once the debt covers the fixed cost.
    fn owe(&mut self, us: f64) -> std::result::Result<(), BackendError> {
        self.owed_us += us;
        if self.owed_us >= (self.spin.intercept_ns / 1e3).max(1.0) {
            self.spin
                .run(&mut self.cuda.k, self.owed_us, StreamKind::Compute)
                .map_err(|e| BackendError::Device(e.to_string()))?;
            self.owed_us = 0.0;
        }
        Ok(())
    }

    /// A new uninitialised buffer of `meta`.
    fn alloc(&mut self, meta: &TensorMeta) -> std::result::Result<CudaTensor, BackendError> {
        let shape = meta.hint_dims();
        let bytes = meta.numel().unwrap_or(0).saturating_mul(meta.dtype.size());
        let block = self
            .cuda
            .pool
            .alloc(bytes, StreamKind::Compute)
            .map_err(|e| BackendError::Device(e.to_string()))?;
        Ok(CudaTensor {
            block,
            dtype: meta.dtype,
            strides: contiguous_strides(&shape),
            shape,
            offset: 0,
        })
    }
}

/// A view of `t`'s buffer as `meta`: contiguous where it fits the buffer, else (a broadcast
/// view larger than its storage) every stride 0, so that nothing reads past the buffer.
fn view_as(t: &CudaTensor, meta: &TensorMeta) -> CudaTensor {
    let shape = meta.hint_dims();
    let bytes = meta.numel().unwrap_or(0).saturating_mul(meta.dtype.size());
    let strides = if bytes <= t.block.size {
        contiguous_strides(&shape)
    } else {
        vec![0; shape.len()]
    };
    CudaTensor {
        block: t.block,
        dtype: meta.dtype,
        shape,
        strides,
        offset: 0,
    }
}

/// The node's value made by `one` per tensor of its metadata.
fn per_meta<E>(
    val: Option<&Val>,
    mut one: impl FnMut(&TensorMeta) -> std::result::Result<CudaTensor, E>,
) -> std::result::Result<Value<CudaTensor>, E> {
    Ok(match val {
        Some(Val::Tensor(t)) => Value::Tensor(one(t)?),
        Some(Val::Tuple(ts)) => Value::List(
            ts.iter()
                .map(|t| t.as_deref().map(&mut one).transpose())
                .collect::<std::result::Result<_, _>>()?,
        ),
        _ => Value::None,
    })
}

fn kernel_err(e: impl std::fmt::Display) -> BackendError {
    BackendError::Kernel(e.to_string())
}

impl Backend for Replay<'_> {
    type Tensor = CudaTensor;
    /// Every target replays: its duration and size come from the node.
    type Kernel = ();
    const NAME: &'static str = "cuda replay";

    fn resolve(_: &str) -> Option<()> {
        Some(())
    }

    fn compute(
        &mut self,
        _: &(),
        env: &Env<'_, CudaTensor>,
    ) -> std::result::Result<Value<CudaTensor>, BackendError> {
        let n = env.node();
        let step = self.table.step(env.g, env.id).ok_or_else(|| {
            kernel_err("replay: the node is not in the program its durations were computed for")
        })?;
        self.owe(step.us)?;
        if n.target == zerosched_ir::comm::GETITEM {
            let src = n
                .args
                .first()
                .and_then(|a| a.as_node())
                .ok_or_else(|| kernel_err("getitem of a literal"))?;
            let k = n.args.get(1).and_then(|a| a.as_int()).unwrap_or(0);
            return Ok(match env.value(*src).map_err(kernel_err)? {
                Value::List(items) => usize::try_from(k)
                    .ok()
                    .and_then(|k| items.get(k).cloned().flatten())
                    .map_or(Value::None, Value::Tensor),
                other => other.clone(),
            });
        }
        let val = n.meta.val.as_ref();
        match step.view_of {
            Some(src) => match env.value(src).map_err(kernel_err)? {
                Value::Tensor(t) => per_meta(val, |m| Ok(view_as(t, m))),
                Value::List(_) | Value::None | Value::Dead => Ok(Value::None),
            },
            None => per_meta(val, |m| self.alloc(m)),
        }
    }

    fn numel(&self, t: &CudaTensor) -> u64 {
        t.numel() as u64
    }

    fn dtype(&self, t: &CudaTensor) -> Dtype {
        t.dtype
    }

    /// A buffer of the input's size; its data is never made.
    fn input(
        &mut self,
        meta: &TensorMeta,
        _: &mut dyn FnMut() -> std::result::Result<host::Tensor, String>,
    ) -> std::result::Result<CudaTensor, NodeError> {
        Ok(self.alloc(meta)?)
    }

    /// The shard's buffer alone: the full parameter is never on the device.
    fn sharded_input(
        &mut self,
        meta: &TensorMeta,
        _: &mut dyn FnMut() -> std::result::Result<host::Tensor, String>,
        world: u32,
        _: u32,
    ) -> std::result::Result<CudaTensor, NodeError> {
        let per = meta.numel().unwrap_or(0).div_ceil(u64::from(world.max(1)));
        let flat = TensorMeta::new(vec![zerosched_ir::Dim::Const(per)], meta.dtype);
        Ok(self.alloc(&flat)?)
    }

    fn download(
        &mut self,
        _: &CudaTensor,
    ) -> std::result::Result<Option<host::Tensor>, BackendError> {
        Ok(None)
    }

    fn shard(
        &mut self,
        full: &CudaTensor,
        world: u32,
        _: u32,
    ) -> std::result::Result<CudaTensor, BackendError> {
        let per = (full.numel() as u64).div_ceil(u64::from(world.max(1)));
        let flat = TensorMeta::new(vec![zerosched_ir::Dim::Const(per)], full.dtype);
        self.alloc(&flat)
    }

    fn unflatten(
        &mut self,
        flat: &CudaTensor,
        shape: &[usize],
    ) -> std::result::Result<CudaTensor, BackendError> {
        Ok(CudaTensor {
            block: flat.block,
            dtype: flat.dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        })
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

impl OnCuda for Replay<'_> {
    fn cuda(&mut self) -> &mut Cuda {
        self.cuda
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerosched_ir::testing::{GraphBuilder, node};
    use zerosched_ir::{Arg, GraphKind};

    #[test]
    fn replay_spins_what_the_simulator_counts_as_compute() {
        use zerosched_passes::pipeline::{self, PipelineOptions};
        use zerosched_passes::schedule::ScheduleOptions;
        use zerosched_passes::simulate::{SimOptions, simulate_program};
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/llama.program.json"
        );
        let mut p = zerosched_ir::import(&std::fs::read(path).unwrap()).unwrap();
        let opts = PipelineOptions {
            schedule: ScheduleOptions {
                world_size: 2,
                ..ScheduleOptions::default()
            },
            ..PipelineOptions::default()
        };
        pipeline::run(&pipeline::standard(), &mut p, &opts).unwrap();
        let cost = CostModel::default();
        let table = Table::new(&p, &cost);
        let sim = simulate_program(
            &p,
            &SimOptions {
                world_size: 2,
                cost,
            },
        );
        let (replayed, simulated) = (table.compute_us() / 1e3, sim.total.compute_ms);
        assert!(simulated > 0.0);
        assert!(
            (replayed - simulated).abs() <= 1e-9 * simulated,
            "replay spins {replayed} ms, the simulator counts {simulated} ms"
        );
    }

    #[test]
    fn the_table_takes_measured_times_and_finds_view_sources() {
        let mut b = GraphBuilder::new("replayed", GraphKind::Forward);
        let x = b.input("x", &[64, 128]);
        let w = b.param("w", &[256, 128]);
        let t = b.op("t", "aten.t.default", &[w], &[128, 256]);
        let y = b.mm("y", x, t, &[64, 256], 1.5);
        let z = b.op("z", "aten.relu.default", &[y], &[64, 256]);
        let r = b.op("r", "aten.relu_.default", &[z], &[64, 256]);
        b.g.meta_mut(r).mutates = Some(vec![0]);
        let parts = b.list_view(
            "s",
            "aten.split.Tensor",
            vec![node(r), Arg::Int(32)],
            2,
            &[32, 256],
        );
        let p = Program::single(b.output(&parts));
        let cost = CostModel::default();
        let table = Table::new(&p, &cost);
        let g = &p.graphs[0];
        let step = |id| table.step(g, id).unwrap();
        assert_eq!(step(y).us, 1500.0, "the measured time");
        let z_ms = cost.compute_costs(g)[z];
        assert!(z_ms > 0.0);
        assert_eq!(step(z).us, z_ms * 1e3, "the roofline estimate");
        assert_eq!(step(t).us, 0.0, "views spin for nothing");
        assert_eq!(step(t).view_of, Some(w));
        assert_eq!(step(y).view_of, None, "a new buffer");
        assert_eq!(
            step(r).view_of,
            Some(z),
            "an in-place op writes its argument"
        );
        let split = g
            .nodes()
            .find(|(_, n)| n.name.as_str() == "s")
            .map(|(id, _)| id)
            .unwrap();
        assert_eq!(step(split).view_of, Some(r));
        let total: f64 = g.nodes().map(|(id, _)| step(id).us).sum();
        assert_eq!(table.compute_us(), total);
        let other = Program::single(g.clone());
        assert!(
            table.step(&other.graphs[0], y).is_none(),
            "a graph of another program is not looked up by its node numbers"
        );
    }

    #[test]
    fn requests_subtract_the_fixed_cost_and_divide_by_the_slope() {
        let s = Spin {
            slope: 1.02,
            intercept_ns: 3000.0,
        };
        assert_eq!(
            s.request_ns(100.0),
            ((100_000.0 - 3000.0) / 1.02f64).round() as i64
        );
        assert_eq!(
            s.request_ns(1.0),
            0,
            "shorter than the fixed cost: no spin at all"
        );
    }
}
