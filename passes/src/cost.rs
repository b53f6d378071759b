//! The cost model: compute time per node and collective time per message.
//!
//! Compute time is `meta.device_time_ms` when the exporter measured it, otherwise a roofline
//! estimate (matrix flops over a peak rate, bytes over memory bandwidth, plus a launch
//! overhead). Collectives are `alpha + wire_bytes / beta`, or a piecewise-linear table measured
//! on the target machine.

use crate::ops::CommOp;
use serde::{Deserialize, Serialize};
use zerosched_ir::{Arg, Dtype, Graph, Node, NodeId, Op, SideTable, TensorMeta, Val, aten};

/// Which collective a message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    AllGather,
    ReduceScatter,
    AllReduce,
}

/// Measured collective times: `(bytes, milliseconds)` points per collective, by message size
/// (the full gathered or reduced size), interpolated linearly and extrapolated from the last
/// two points.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CollectiveTable {
    pub all_gather: Vec<(u64, f64)>,
    pub reduce_scatter: Vec<(u64, f64)>,
    #[serde(default)]
    pub all_reduce: Vec<(u64, f64)>,
}

impl CollectiveTable {
    /// The points that price `kind`, and the factor on them: an all-reduce without points of
    /// its own is priced as two reduce-scatters.
    fn points(&self, kind: Collective) -> (&[(u64, f64)], f64) {
        match kind {
            Collective::AllGather => (&self.all_gather, 1.0),
            Collective::ReduceScatter => (&self.reduce_scatter, 1.0),
            Collective::AllReduce if self.all_reduce.is_empty() => (&self.reduce_scatter, 2.0),
            Collective::AllReduce => (&self.all_reduce, 1.0),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CollectiveModel {
    /// Ring collectives: `alpha_ms + bytes * (n-1)/n / beta` (all-reduce moves twice that).
    AlphaBeta {
        alpha_ms: f64,
        beta_bytes_per_s: f64,
    },
    Table(CollectiveTable),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Dense 16-bit matrix throughput, FLOP/s.
    pub peak_flops: f64,
    /// 32-bit matrix throughput, FLOP/s.
    pub peak_flops_fp32: f64,
    /// Device memory bandwidth, bytes/s.
    pub mem_bandwidth: f64,
    /// Fixed cost of every kernel that does work, ms.
    pub launch_ms: f64,
    /// Host time to issue one node (the executor's walk and the launch), ms: the device
    /// starts no node before the host has issued every node up to it, so a step of many
    /// short kernels is bound by the host. 0, the host never behind, unless calibrated.
    #[serde(default)]
    pub host_ms_per_node: f64,
    pub collective: CollectiveModel,
}

impl Default for CostModel {
    /// An H200 in an 8-GPU NVLink node: about 790 TFLOP/s measured bf16 matrix rate, 4.8 TB/s
    /// HBM, and all-gather bus bandwidth of about 360 GB/s with 20 µs latency.
    fn default() -> CostModel {
        CostModel {
            peak_flops: 790e12,
            peak_flops_fp32: 60e12,
            mem_bandwidth: 4.0e12,
            launch_ms: 0.004,
            host_ms_per_node: 0.0,
            collective: CollectiveModel::AlphaBeta {
                alpha_ms: 0.02,
                beta_bytes_per_s: 360e9,
            },
        }
    }
}

impl CostModel {
    /// Time of every node of `g` on the compute stream, ms, in one pass over the program
    /// order (which puts producers first), each value's byte size computed once. Inserted ops,
    /// views, placeholders and the output cost nothing there.
    pub fn compute_costs(&self, g: &Graph) -> SideTable<f64> {
        let mut bytes = SideTable::new(g, 0u64);
        let mut ms = SideTable::new(g, 0.0);
        for (id, n) in g.nodes() {
            let out = n.meta.val.as_ref().and_then(Val::nbytes).unwrap_or(0);
            bytes[id] = out;
            ms[id] = self.node_ms(g, id, n, out, &bytes);
        }
        ms
    }

    /// One node's time, `bytes` holding the output size of every earlier node.
    fn node_ms(&self, g: &Graph, id: NodeId, n: &Node, out: u64, bytes: &SideTable<u64>) -> f64 {
        if n.op != Op::CallFunction {
            return 0.0;
        }
        let aten = aten::op_name(&n.target);
        let free = match aten {
            Some(op) => aten::is_view_op(op),
            None => CommOp::of(n).is_some() || n.target == crate::ops::GETITEM,
        };
        if free {
            return 0.0;
        }
        if let Some(t) = n.meta.device_time_ms {
            return if t.is_finite() && t > 0.0 { t } else { 0.0 };
        }
        let inputs: u64 = g
            .producers(id)
            .map(|i| bytes[i])
            .fold(0, u64::saturating_add);
        let moved = out.saturating_add(inputs) as f64;
        let (flops, dtype) = aten.map_or((0.0, None), |op| matmul_flops(g, op, n));
        let rate = match dtype {
            Some(Dtype::Float32 | Dtype::Float64) => self.peak_flops_fp32,
            _ => self.peak_flops,
        };
        let t = (flops / rate).max(moved / self.mem_bandwidth) * 1e3;
        t + self.launch_ms
    }

    /// Time of one collective of `bytes` (the full message) over `world` ranks, ms.
    pub fn collective_ms(&self, kind: Collective, bytes: u64, world: u32) -> f64 {
        match &self.collective {
            CollectiveModel::AlphaBeta {
                alpha_ms,
                beta_bytes_per_s,
            } => {
                let n = f64::from(world.max(1));
                let factor = if kind == Collective::AllReduce {
                    2.0
                } else {
                    1.0
                };
                alpha_ms + factor * bytes as f64 * (n - 1.0) / n / beta_bytes_per_s * 1e3
            }
            CollectiveModel::Table(t) => {
                let (points, scale) = t.points(kind);
                scale * interpolate(points, bytes)
            }
        }
    }

    /// The least time any collective of `kind` carrying at least `bytes` takes: what a lower
    /// bound may charge for an op that a schedule may coalesce into a larger bucket. That is
    /// `collective_ms` where it is nondecreasing in bytes (alpha-beta with a positive
    /// bandwidth; a table whose byte points rise strictly and whose times do not fall, which
    /// interpolation and extrapolation keep nondecreasing), else 0; never negative or NaN.
    pub fn collective_floor_ms(&self, kind: Collective, bytes: u64, world: u32) -> f64 {
        let monotone = match &self.collective {
            CollectiveModel::AlphaBeta {
                beta_bytes_per_s, ..
            } => *beta_bytes_per_s > 0.0,
            CollectiveModel::Table(t) => t
                .points(kind)
                .0
                .windows(2)
                .all(|w| matches!(w, [(b0, y0), (b1, y1)] if b0 < b1 && y0 <= y1)),
        };
        let ms = self.collective_ms(kind, bytes, world);
        if monotone && ms > 0.0 { ms } else { 0.0 }
    }

    /// Loads a cost model from JSON (the format `serde` gives this type).
    pub fn from_json(text: &str) -> Result<CostModel, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// Piecewise-linear interpolation over points sorted by size; extrapolates at both ends.
fn interpolate(points: &[(u64, f64)], bytes: u64) -> f64 {
    let x = bytes as f64;
    let seg = match points {
        [] => return 0.0,
        [(_, y)] => return *y,
        _ => {
            let i = points
                .partition_point(|&(b, _)| b < bytes)
                .clamp(1, points.len() - 1);
            (points[i - 1], points[i])
        }
    };
    let ((x0, y0), (x1, y1)) = seg;
    let (x0, x1) = (x0 as f64, x1 as f64);
    if x1 <= x0 {
        return y1;
    }
    (y0 + (y1 - y0) * (x - x0) / (x1 - x0)).max(0.0)
}

fn tensor<'g>(g: &'g Graph, a: Option<&Arg<NodeId>>) -> Option<&'g TensorMeta> {
    match &g.node(*a?.as_node()?).meta.val {
        Some(Val::Tensor(t)) => Some(t),
        _ => None,
    }
}

fn dims(t: &TensorMeta) -> Vec<f64> {
    t.shape.iter().map(|d| d.hint() as f64).collect()
}

/// Matrix flops of the node, aten op `op` (0 for anything that is not a matrix product), and
/// its dtype.
fn matmul_flops(g: &Graph, op: &str, n: &Node) -> (f64, Option<Dtype>) {
    let (a, b) = match op {
        "mm" | "bmm" | "matmul" | "_grouped_mm" => (n.args.first(), n.args.get(1)),
        "addmm" | "baddbmm" | "addbmm" => (n.args.get(1), n.args.get(2)),
        "_scaled_dot_product_flash_attention"
        | "_scaled_dot_product_efficient_attention"
        | "_scaled_dot_product_cudnn_attention"
        | "scaled_dot_product_attention" => return attention_flops(g, n.args.as_slice(), 1.0),
        "_scaled_dot_product_flash_attention_backward"
        | "_scaled_dot_product_efficient_attention_backward"
        | "_scaled_dot_product_cudnn_attention_backward" => {
            return attention_flops(g, &n.args[1.min(n.args.len())..], 2.5);
        }
        _ => return (0.0, None),
    };
    match (tensor(g, a), tensor(g, b)) {
        (Some(a), Some(b)) => {
            let (da, db) = (dims(a), dims(b));
            let (Some(&k), Some(&nn)) = (da.last(), db.last()) else {
                return (0.0, None);
            };
            let m_batch: f64 = da[..da.len().saturating_sub(1)].iter().product();
            (2.0 * m_batch * k * nn, Some(a.dtype))
        }
        _ => (0.0, None),
    }
}

/// `4 * B * H * S * L * D` for q `[B,H,S,D]`, k `[B,H,L,D]`, times `factor`.
fn attention_flops(g: &Graph, args: &[Arg<NodeId>], factor: f64) -> (f64, Option<Dtype>) {
    match (tensor(g, args.first()), tensor(g, args.get(1))) {
        (Some(q), Some(k)) if q.shape.len() == 4 && k.shape.len() == 4 => {
            let (q, kd) = (dims(q), dims(k));
            (factor * 4.0 * q[0] * q[1] * q[2] * kd[2] * q[3], None)
        }
        _ => (0.0, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x [64,128] bf16`, `w [256,128] bf16` placeholders; `t = t(w)`, `y = mm(x, t)`,
    /// `z = relu(y)`, `k = cos(z)` with a measured time, `o = zerosched.wait(z)`.
    fn small() -> (Graph, Vec<NodeId>) {
        use std::sync::Arc;
        use zerosched_ir::{Dim, GraphKind};
        let mut g = Graph::new(None, GraphKind::Forward);
        let mut add = |name: &str, target: &str, args: &[NodeId], shape: [u64; 2]| {
            let op = if args.is_empty() {
                Op::Placeholder
            } else {
                Op::CallFunction
            };
            let args = args.iter().map(|&a| Arg::Node(a)).collect();
            let mut node = Node {
                op,
                ..Node::call(name, target, args)
            };
            let dims = shape.iter().map(|&d| Dim::Const(d)).collect();
            node.meta.val = Some(Val::Tensor(Arc::new(TensorMeta::new(
                dims,
                Dtype::BFloat16,
            ))));
            g.push(node).unwrap()
        };
        let x = add("x", "x", &[], [64, 128]);
        let w = add("w", "w", &[], [256, 128]);
        let t = add("t", "aten.t.default", &[w], [128, 256]);
        let y = add("y", "aten.mm.default", &[x, t], [64, 256]);
        let z = add("z", "aten.relu.default", &[y], [64, 256]);
        let k = add("k", "aten.cos.default", &[z], [64, 256]);
        let o = add("o", "zerosched.wait.default", &[z], [64, 256]);
        g.meta_mut(k).device_time_ms = Some(2.5);
        (g, vec![x, w, t, y, z, k, o])
    }

    #[test]
    fn compute_costs_price_matmuls_by_flops_and_the_rest_by_bytes_moved() {
        let m = CostModel {
            peak_flops: 1e12,
            mem_bandwidth: 1e9,
            launch_ms: 0.5,
            ..CostModel::default()
        };
        let (g, ids) = small();
        let c = m.compute_costs(&g);
        let [x, w, t, y, z, k, o] = ids[..] else {
            unreachable!()
        };
        // Placeholders, views and inserted ops cost nothing.
        for free in [x, w, t, o] {
            assert_eq!(c[free], 0.0, "{}", g.node(free).name);
        }
        // mm: 2 * 64 * 128 * 256 flops at 1e12/s against (64*128 + 128*256 + 64*256) * 2
        // bytes at 1e9/s: the bytes bound, since this machine is slow at moving them.
        let flops_ms = 2.0 * 64.0 * 128.0 * 256.0 / 1e12 * 1e3;
        let bytes_ms = ((64 * 128 + 128 * 256 + 64 * 256) * 2) as f64 / 1e9 * 1e3;
        assert!(bytes_ms > flops_ms);
        assert!((c[y] - (bytes_ms + 0.5)).abs() < 1e-12, "{}", c[y]);
        // relu reads y and writes z.
        let relu_ms = (2 * 64 * 256 * 2) as f64 / 1e9 * 1e3 + 0.5;
        assert!((c[z] - relu_ms).abs() < 1e-12, "{}", c[z]);
        // A measured time stands as it is.
        assert_eq!(c[k], 2.5);
        // With memory fast enough, the matmul's flops bound instead.
        let fast = CostModel {
            mem_bandwidth: 1e18,
            ..m
        };
        let c = fast.compute_costs(&g);
        assert!((c[y] - (flops_ms + 0.5)).abs() < 1e-12, "{}", c[y]);
    }

    #[test]
    fn alpha_beta_is_ring_and_table_interpolates() {
        let m = CostModel::default();
        let one = m.collective_ms(Collective::AllGather, 1 << 30, 8);
        let CollectiveModel::AlphaBeta {
            alpha_ms,
            beta_bytes_per_s,
        } = m.collective
        else {
            unreachable!()
        };
        let want = alpha_ms + (1u64 << 30) as f64 * 7.0 / 8.0 / beta_bytes_per_s * 1e3;
        assert!((one - want).abs() < 1e-9);
        assert!(m.collective_ms(Collective::AllReduce, 1 << 30, 8) > one * 1.9);
        let t = CollectiveTable {
            all_gather: vec![(0, 0.01), (1000, 1.01)],
            reduce_scatter: vec![(0, 0.0)],
            all_reduce: vec![],
        };
        let m = CostModel {
            collective: CollectiveModel::Table(t),
            ..CostModel::default()
        };
        assert!((m.collective_ms(Collective::AllGather, 500, 8) - 0.51).abs() < 1e-12);
        assert!((m.collective_ms(Collective::AllGather, 2000, 8) - 2.01).abs() < 1e-12);
    }
}
