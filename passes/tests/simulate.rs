//! The two-stream simulator on graphs small enough to time by hand, and on the schedulers'
//! output.
//!
//! Cost model throughout: a gather of `N` f32 elements over 2 ranks moves `4N/2` bytes at
//! 2,000 bytes/ms after a 1 ms latency, so a 1,000-element parameter gathers in 2 ms and two of
//! them bucketed in 3 ms.

use proptest::prelude::*;
use std::collections::BTreeSet;
use zerosched_ir::testing::GraphBuilder as Builder;
use zerosched_ir::{Arg, Grad, Graph, GraphKind, NodeId, Program};
use zerosched_passes::cost::{CollectiveModel, CollectiveTable, CostModel};
use zerosched_passes::insert::insert;
use zerosched_passes::ops::CommOp;
use zerosched_passes::schedule::{self, ScheduleOptions};
use zerosched_passes::simulate::{self, GraphSim, SimOptions, trace};

const EPS: f64 = 1e-9;

fn opts() -> SimOptions {
    SimOptions {
        world_size: 2,
        cost: CostModel {
            collective: CollectiveModel::AlphaBeta {
                alpha_ms: 1.0,
                beta_bytes_per_s: 2e6,
            },
            ..CostModel::default()
        },
    }
}

fn inserted(mut g: Graph) -> Graph {
    insert(&mut g, &BTreeSet::new()).unwrap();
    zerosched_ir::verify::graph(&g).unwrap();
    g
}

fn sim(g: &Graph) -> GraphSim {
    simulate::simulate_graph(g, &opts())
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < EPS
}

fn find(g: &Graph, op: CommOp) -> Vec<NodeId> {
    g.order()
        .iter()
        .copied()
        .filter(|&id| CommOp::of(g.node(id)) == Some(op))
        .collect()
}

/// Moves `node` to just before `before` in the program order.
fn move_before(g: &mut Graph, node: NodeId, before: NodeId) {
    let mut order: Vec<NodeId> = g.order().iter().copied().filter(|&n| n != node).collect();
    let at = order.iter().position(|&n| n == before).unwrap();
    order.insert(at, node);
    g.set_order(order).unwrap();
    zerosched_ir::verify::graph(g).unwrap();
}

/// Puts `ids` in bucket `bucket`.
fn bucket(g: &mut Graph, ids: &[NodeId], bucket: i64) {
    for &id in ids {
        let n = g.node(id);
        let (args, mut kwargs) = (n.args.clone(), n.kwargs.clone());
        zerosched_ir::comm::set_bucket(&mut kwargs, bucket);
        g.set_args(id, args, kwargs).unwrap();
    }
}

/// `y = mm(x, w)` with an optional 3 ms kernel before it.
fn one_gather(lead: bool) -> Graph {
    let mut b = Builder::new("forward_0", GraphKind::Forward);
    let x = b.input("x", &[100]);
    let w = b.param("w", &[1000]);
    let a = if lead {
        b.kernel("relu", "aten.relu.default", &[x], &[100], 3.0)
    } else {
        x
    };
    let y = b.kernel("mm", "aten.mm.default", &[a, w], &[50], 3.0);
    inserted(b.output(&[y]))
}

#[test]
fn just_in_time_gather_is_fully_exposed() {
    let g = one_gather(false);
    let s = sim(&g).summary;
    // gather 0–2, wait stalls 2 ms, mm 2–5.
    assert!(close(s.comm_ms, 2.0), "{s:?}");
    assert!(close(s.compute_ms, 3.0), "{s:?}");
    assert!(close(s.step_ms, 5.0), "{s:?}");
    assert!(close(s.exposed_comm_ms, 2.0), "{s:?}");
    assert!(close(s.stall_ms, 2.0), "{s:?}");
    // mm needs the gather: no order starts it before 2 ms, so 5 ms is the best there is.
    assert!(close(s.lower_bound_ms, 5.0), "{s:?}");
    assert!(close(s.ratio, 1.0), "{s:?}");
    assert_eq!((s.gathers, s.buckets, s.reductions), (1, 0, 0));
}

#[test]
fn prefetching_one_node_earlier_hides_the_gather() {
    let mut g = one_gather(true);
    let jit = sim(&g).summary;
    // relu 0–3, gather 3–5, stall 2, mm 5–8.
    assert!(close(jit.step_ms, 8.0), "{jit:?}");
    assert!(close(jit.exposed_comm_ms, 2.0), "{jit:?}");
    let gather = find(&g, CommOp::AllGather)[0];
    let relu = g.node_by_name("relu").unwrap();
    move_before(&mut g, gather, relu);
    // gather 0–2 under relu 0–3; mm 3–6 without a stall.
    let pre = sim(&g).summary;
    assert!(close(pre.step_ms, 6.0), "{pre:?}");
    assert!(close(pre.exposed_comm_ms, 0.0), "{pre:?}");
    assert!(close(pre.stall_ms, 0.0), "{pre:?}");
    assert!(close(pre.ratio, 1.0), "{pre:?}");
}

#[test]
fn a_partly_hidden_gather_stalls_for_the_rest() {
    let mut b = Builder::new("forward_0", GraphKind::Forward);
    let x = b.input("x", &[100]);
    let w = b.param("w", &[1000]);
    let a = b.kernel("relu", "aten.relu.default", &[x], &[100], 0.5);
    let y = b.kernel("mm", "aten.mm.default", &[a, w], &[50], 3.0);
    let mut g = inserted(b.output(&[y]));
    let gather = find(&g, CommOp::AllGather)[0];
    move_before(&mut g, gather, a);
    let s = sim(&g).summary;
    // gather 0–2, relu 0–0.5, wait stalls 1.5 ms, mm 2–5.
    assert!(close(s.stall_ms, 1.5), "{s:?}");
    assert!(close(s.step_ms, 5.0), "{s:?}");
    assert!(close(s.exposed_comm_ms, 1.5), "{s:?}");
}

/// `y = mm(mm(x, w1), w2)`, with both gathers moved to the front and optionally bucketed.
fn two_gathers(bucketed: bool) -> Graph {
    let mut b = Builder::new("forward_0", GraphKind::Forward);
    let x = b.input("x", &[100]);
    let w1 = b.param("w1", &[1000]);
    let w2 = b.param("w2", &[1000]);
    let h = b.kernel("mm1", "aten.mm.default", &[x, w1], &[100], 3.0);
    let y = b.kernel("mm2", "aten.mm.default", &[h, w2], &[100], 3.0);
    let mut g = inserted(b.output(&[y]));
    let gathers = find(&g, CommOp::AllGather);
    let first_wait = find(&g, CommOp::Wait)[0];
    move_before(&mut g, gathers[1], first_wait);
    if bucketed {
        bucket(&mut g, &gathers, 7);
    }
    g
}

#[test]
fn a_bucket_of_two_pays_one_latency() {
    let apart = sim(&two_gathers(false));
    let together = sim(&two_gathers(true));
    // Apart: 2 + 2 ms back to back; mm1 waits for the first (0–2), mm2 starts at 5.
    assert!(close(apart.summary.comm_ms, 4.0), "{:?}", apart.summary);
    assert!(close(apart.summary.step_ms, 8.0), "{:?}", apart.summary);
    // One stream: the second gather queues behind the first.
    let spans: Vec<(f64, f64)> = apart
        .timeline
        .comm
        .iter()
        .map(|c| (c.start_ms, c.end_ms))
        .collect();
    assert_eq!(spans, vec![(0.0, 2.0), (2.0, 4.0)]);
    assert_eq!(apart.summary.buckets, 0);
    // Together: one 1 + 2 ms collective; both wait for it, mm1 3–6, mm2 6–9.
    assert!(
        close(together.summary.comm_ms, 3.0),
        "{:?}",
        together.summary
    );
    assert!(
        close(together.summary.step_ms, 9.0),
        "{:?}",
        together.summary
    );
    assert_eq!(together.timeline.comm.len(), 1);
    assert_eq!(together.timeline.comm[0].bytes, 8000);
    assert_eq!(together.summary.buckets, 1);
    assert_eq!(together.summary.gathers, 2);
    // Both buffers are live at once either way.
    assert_eq!(together.summary.peak_gathered_bytes, 8000);
    assert_eq!(apart.summary.peak_gathered_bytes, 8000);
}

/// A backward graph producing two 1,000-element gradients, 3 ms each.
fn backward() -> Graph {
    let mut b = Builder::new("backward_0", GraphKind::Backward);
    let t = b.input("tangent", &[1000]);
    let g1 = b.kernel("grad1", "aten.mul.Tensor", &[t], &[1000], 3.0);
    let g2 = b.kernel("grad2", "aten.mul.Tensor", &[t], &[1000], 3.0);
    b.g.grads = vec![
        Grad {
            param: "w1".to_owned(),
            output_index: 0,
            persistent: false,
        },
        Grad {
            param: "w2".to_owned(),
            output_index: 1,
            persistent: false,
        },
    ];
    inserted(b.output(&[g1, g2]))
}

#[test]
fn reductions_overlap_compute_and_leave_a_tail() {
    let g = backward();
    let s = sim(&g);
    // grad1 0–3, its reduce-scatter 3–5 under grad2 3–6, the second 6–8; end_backward waits.
    assert!(close(s.summary.comm_ms, 4.0), "{:?}", s.summary);
    assert!(close(s.summary.step_ms, 8.0), "{:?}", s.summary);
    assert!(close(s.summary.exposed_comm_ms, 2.0), "{:?}", s.summary);
    assert!(close(s.summary.stall_ms, 2.0), "{:?}", s.summary);
    assert_eq!(s.summary.reductions, 2);
    let starts: Vec<f64> = s.timeline.comm.iter().map(|c| c.start_ms).collect();
    assert_eq!(starts, vec![3.0, 6.0]);
}

#[test]
fn a_reduction_with_nothing_waiting_still_ends_the_step() {
    let mut g = backward();
    // Without end_backward the tail is the communication stream's, not a stall.
    let end = find(&g, CommOp::EndBackward)[0];
    let reduces = find(&g, CommOp::ReduceGrad);
    let n = g.node(end);
    let kwargs = n.kwargs.clone();
    g.set_args(end, vec![Arg::List(vec![])], kwargs).unwrap();
    let out = g.output().unwrap();
    let values = Arg::List(reduces.iter().map(|&r| Arg::Node(r)).collect());
    g.set_args(out, vec![values], Default::default()).unwrap();
    let s = sim(&g).summary;
    assert!(close(s.step_ms, 8.0), "{s:?}");
    assert!(close(s.stall_ms, 0.0), "{s:?}");
    assert!(close(s.exposed_comm_ms, 2.0), "{s:?}");
}

/// `backward()` with both reductions after the second gradient, adjacent; in one bucket when
/// `bucketed`.
fn adjacent_reductions(bucketed: bool) -> Graph {
    let mut g = backward();
    let reduces = find(&g, CommOp::ReduceGrad);
    let end = find(&g, CommOp::EndBackward)[0];
    move_before(&mut g, reduces[0], reduces[1]);
    move_before(&mut g, reduces[1], end);
    if bucketed {
        bucket(&mut g, &reduces, 3);
    }
    g
}

#[test]
fn a_bucket_of_two_reductions_pays_one_latency() {
    let apart = sim(&adjacent_reductions(false));
    let together = sim(&adjacent_reductions(true));
    // Apart: 2 + 2 ms back to back from 6 ms.
    let spans = |s: &GraphSim| -> Vec<(f64, f64)> {
        s.timeline
            .comm
            .iter()
            .map(|c| (c.start_ms, c.end_ms))
            .collect()
    };
    assert_eq!(spans(&apart), vec![(6.0, 8.0), (8.0, 10.0)]);
    assert_eq!(apart.summary.reduce_buckets, 0);
    // Together: one reduce-scatter of 8,000 B, 1 + 2 ms.
    assert_eq!(spans(&together), vec![(6.0, 9.0)]);
    assert_eq!(together.timeline.comm[0].bytes, 8000);
    assert_eq!(together.timeline.comm[0].nodes.len(), 2);
    assert!(
        close(together.summary.step_ms, 9.0),
        "{:?}",
        together.summary
    );
    assert!(
        close(together.summary.comm_ms, 3.0),
        "{:?}",
        together.summary
    );
    assert_eq!(
        (together.summary.reduce_buckets, together.summary.buckets),
        (1, 0)
    );
    assert_eq!(together.summary.reductions, 2);
    // Each gradient lives until its collective ends: apart, the first (4,000 B) goes at 8 ms
    // and the second at 10; together, both at 9. The two reduced shards (2,000 B each) stay.
    let reached = |s: &GraphSim, total: u64| {
        s.timeline
            .memory
            .iter()
            .find(|m| m.t_ms > 6.0 && m.total == total)
            .map(|m| m.t_ms)
    };
    assert_eq!(reached(&apart, 4000 + 4000), Some(8.0));
    assert_eq!(reached(&apart, 4000), Some(10.0));
    assert_eq!(reached(&together, 4000 + 4000), Some(9.0));
    assert_eq!(reached(&together, 4000), Some(9.0));
}

#[test]
fn an_unsharded_gradient_is_all_reduced() {
    let mut g = backward();
    let r = find(&g, CommOp::ReduceGrad)[1];
    let n = g.node(r);
    let (args, mut kwargs) = (n.args.clone(), n.kwargs.clone());
    kwargs.insert("sharded", Arg::Bool(false));
    g.set_args(r, args, kwargs).unwrap();
    let s = sim(&g);
    // An all-reduce moves twice the bytes: 1 + 2 × 1 ms.
    let last = s.timeline.comm.last().unwrap();
    assert!(close(last.end_ms - last.start_ms, 3.0), "{last:?}");
    assert!(close(s.summary.step_ms, 9.0), "{:?}", s.summary);
}

#[test]
fn memory_peaks_follow_the_sizes() {
    // x: 400 B; w's shard 2,000 B, gathered 4,000 B; y, z: 200 B each.
    let mut b = Builder::new("forward_0", GraphKind::Forward);
    let x = b.input("x", &[100]);
    let w = b.param("w", &[1000]);
    let y = b.kernel("mm", "aten.mm.default", &[x, w], &[50], 3.0);
    let z = b.kernel("relu", "aten.relu.default", &[y], &[50], 1.0);
    let g = inserted(b.output(&[z]));
    let s = sim(&g);
    assert_eq!(s.summary.peak_gathered_bytes, 4000);
    // At mm's start (after the 2 ms stall): x, the shard, the gathered buffer and y.
    assert_eq!(s.summary.peak_total_bytes, 400 + 2000 + 4000 + 200);
    assert!(close(s.summary.peak_total_at_ms, 2.0), "{:?}", s.summary);
    let totals: Vec<u64> = s.timeline.memory.iter().map(|m| m.total).collect();
    // x, shard, gather, y; x freed after mm, then the release; z, then y freed after relu.
    assert_eq!(totals, vec![400, 2400, 6400, 6600, 6200, 2200, 2400, 2200]);
    let last = s.timeline.memory.last().unwrap();
    assert_eq!((last.gathered, last.total), (0, 2200));
    assert!(close(last.t_ms, 6.0), "{last:?}");
}

#[test]
fn a_gradient_lives_until_its_reduction_ends() {
    let s = sim(&backward());
    // tangent 4,000 B from the start; grad1 4,000 B from 0; its 2,000 B reduced shard from 3;
    // grad2 from 3; grad1 is freed when its reduce-scatter ends at 5, before grad2's at 8.
    let at = |t: f64| {
        s.timeline
            .memory
            .iter()
            .rfind(|m| m.t_ms <= t)
            .map(|m| m.total)
    };
    assert_eq!(at(0.0), Some(8000));
    assert_eq!(at(4.0), Some(8000 + 2000 + 4000));
    assert_eq!(at(5.0), Some(4000 + 2000 + 4000));
    // Both reduced shards are returned: still live at the end.
    assert_eq!(s.timeline.memory.last().map(|m| m.total), Some(2000 + 2000));
    assert_eq!(s.summary.peak_total_bytes, 14000);
}

#[test]
fn program_simulation_runs_graphs_back_to_back() {
    let fwd = one_gather(false);
    let bwd = backward();
    let (a, b) = (sim(&fwd).summary, sim(&bwd).summary);
    let p = Program::bundle(vec![fwd, bwd]);
    let ps = simulate::simulate_program(&p, &opts());
    assert!(close(ps.total.step_ms, a.step_ms + b.step_ms));
    assert!(close(ps.total.compute_ms, a.compute_ms + b.compute_ms));
    assert!(close(ps.total.comm_ms, a.comm_ms + b.comm_ms));
    // The forward's bound is its gather then mm (5 ms); the backward's its 6 ms of compute.
    assert!(close(ps.total.lower_bound_ms, 5.0 + 6.0));
    assert!(close(ps.total.ratio, 13.0 / 11.0), "{:?}", ps.total);
    assert_eq!(
        ps.total.peak_total_bytes,
        a.peak_total_bytes.max(b.peak_total_bytes)
    );
    // The backward's peak (14,000 B, first reached 3 ms in) comes after the forward.
    assert!(
        close(ps.total.peak_total_at_ms, a.step_ms + 3.0),
        "{:?}",
        ps.total
    );
    assert_eq!(ps.total.gathers, 1);
    assert_eq!(ps.total.reductions, 2);
    assert!(close(ps.graphs[1].timeline.offset_ms, a.step_ms));
    let json = serde_json::to_value(&ps).unwrap();
    assert_eq!(json["graphs"][1]["kind"], "backward");
    assert_eq!(json["total"]["gathers"], 1);
    assert!(json["graphs"][0]["step_ms"].is_number());
}

#[test]
fn the_trace_is_json_with_one_event_per_span_and_sample() {
    let p = Program::bundle(vec![two_gathers(true), backward()]);
    let run = || {
        let ps = simulate::simulate_program(&p, &opts());
        (trace::chrome_trace(&p.graphs, &ps.graphs), ps)
    };
    let (bytes, ps) = run();
    let (again, _) = run();
    assert_eq!(bytes, again, "the trace is byte-identical across runs");
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let count = |ph: &str, tid: Option<u64>| {
        events
            .iter()
            .filter(|e| e["ph"] == ph && tid.is_none_or(|t| e["tid"] == t))
            .count()
    };
    // Forward: mm1, mm2 and the stall of the first wait; backward: grad1, grad2 and the
    // stall at end_backward.
    assert_eq!(count("X", Some(0)), 6);
    // One bucket, two reductions.
    assert_eq!(count("X", Some(1)), 3);
    let samples: usize = ps.graphs.iter().map(|g| g.timeline.memory.len()).sum();
    assert_eq!(count("C", None), 2 * samples);
    assert_eq!(count("M", None), 3);
    assert_eq!(events.len(), 3 + 6 + 3 + 2 * samples);
    let bucket = events.iter().find(|e| e["cat"] == "all_gather").unwrap();
    assert_eq!(bucket["name"], "bucket 7");
    assert_eq!(bucket["dur"], 3000.0);
    assert_eq!(bucket["args"]["params"], serde_json::json!(["w1", "w2"]));
    // The backward's first reduce-scatter starts 3 ms into it, after the 9 ms forward.
    let reduce = events
        .iter()
        .find(|e| e["cat"] == "reduce_scatter")
        .unwrap();
    assert_eq!(reduce["ts"], 12000.0);
}

/// `l` layers of `x = mm(x, w_i)`, `ms` milliseconds each, every weight 1,000 f32s (a 2 ms
/// gather).
fn layers(l: usize, ms: f64) -> Graph {
    let mut b = Builder::new("forward_0", GraphKind::Forward);
    let mut x = b.input("x", &[100]);
    let ws: Vec<NodeId> = (0..l).map(|i| b.param(&format!("w{i}"), &[1000])).collect();
    for (i, &w) in ws.iter().enumerate() {
        x = b.kernel(&format!("mm{i}"), "aten.mm.default", &[x, w], &[100], ms);
    }
    inserted(b.output(&[x]))
}

fn scheduled(name: &str, g: &Graph) -> GraphSim {
    let mut g = g.clone();
    let o = opts();
    let sched = ScheduleOptions {
        budget: u64::MAX,
        memory: u64::MAX,
        world_size: o.world_size,
        cost: o.cost.clone(),
    };
    schedule::by_name(name)
        .unwrap()
        .schedule(&mut g, &sched)
        .unwrap();
    zerosched_ir::verify::graph(&g).unwrap();
    simulate::simulate_graph(&g, &o)
}

#[test]
fn prefetch_is_no_slower_than_just_in_time() {
    for ms in [1.0, 2.0, 3.0, 5.0] {
        let g = layers(8, ms);
        let jit = scheduled("jit", &g).summary;
        let pre = scheduled("prefetch", &g).summary;
        assert_eq!((jit.gathers, pre.gathers), (8, 8));
        // Just in time, every gather is exposed: 8 × (2 + ms).
        assert!(close(jit.step_ms, 8.0 * (2.0 + ms)), "{jit:?}");
        assert!(close(jit.exposed_comm_ms, jit.comm_ms), "{jit:?}");
        assert!(
            pre.step_ms <= jit.step_ms + EPS,
            "{ms} ms: {pre:?} vs {jit:?}"
        );
        assert!(pre.step_ms >= pre.lower_bound_ms - EPS, "{pre:?}");
    }
}

#[test]
fn prefetch_hides_all_but_the_first_gather_when_compute_bound() {
    let pre = scheduled("prefetch", &layers(8, 3.0)).summary;
    assert!(close(pre.step_ms, 2.0 + 8.0 * 3.0), "{pre:?}");
    assert!(close(pre.stall_ms, 2.0), "{pre:?}");
}

#[test]
fn prefetch_overlaps_gathers_when_communication_bound() {
    let g = layers(8, 2.0);
    let jit = scheduled("jit", &g).summary;
    let pre = scheduled("prefetch", &g).summary;
    // Gathers back to back (0–16 ms), each layer right after its gather: 18 ms is possible.
    assert!(pre.step_ms < jit.step_ms, "{pre:?} vs {jit:?}");
    assert!(close(pre.step_ms, 18.0), "{pre:?}");
}
#[test]
fn an_output_only_parameter_holds_only_its_shard() {
    // A parameter the forward only returns: insertion gathers nothing; its shard is held.
    let mut b = Builder::new("forward_0", GraphKind::Forward);
    let x = b.input("x", &[100]);
    let w = b.param("w", &[1000]);
    let y = b.kernel("relu", "aten.relu.default", &[x], &[100], 1.0);
    let g = inserted(b.output(&[y, w]));
    assert!(find(&g, CommOp::AllGather).is_empty());
    let s = sim(&g).summary;
    assert!(close(s.comm_ms, 0.0));
    assert!(close(s.step_ms, 1.0));
    assert_eq!(s.peak_total_bytes, 400 + 2000 + 400);
}

/// Five 0.1 ms kernels that the host issues one per millisecond: each waits for its launch,
/// the wait is the host's and not exposed communication, and the bound is the host's 5 ms.
#[test]
fn a_host_slower_than_the_kernels_bounds_the_step() {
    let mut b = Builder::new("forward_0", GraphKind::Forward);
    let mut v = b.input("x", &[100]);
    for i in 0..5 {
        v = b.kernel(&format!("relu_{i}"), "aten.relu.default", &[v], &[100], 0.1);
    }
    let g = inserted(b.output(&[v]));
    let fast = sim(&g).summary;
    assert!(
        close(fast.step_ms, 0.5) && close(fast.host_wait_ms, 0.0),
        "{fast:?}"
    );
    let mut o = opts();
    o.cost.host_ms_per_node = 1.0;
    let s = simulate::simulate_graph(&g, &o).summary;
    assert!(close(s.step_ms, 5.1), "{s:?}");
    assert!(close(s.host_wait_ms, 4.6), "{s:?}");
    assert!(close(s.exposed_comm_ms, 0.0), "{s:?}");
    assert!(close(s.lower_bound_ms, 5.0), "{s:?}");
}

/// A backward graph whose one gradient needs a gathered weight: `mm(tangent, w)`, 3 ms, then
/// the gradient's reduce-scatter. Gather 0–2, mm 2–5, reduction 5–7, in every order.
fn a_gather_first_and_a_reduction_last() -> Graph {
    let mut b = Builder::new("backward_0", GraphKind::Backward);
    let t = b.input("tangent", &[1000]);
    let w = b.param("w", &[1000]);
    let dw = b.kernel("mm", "aten.mm.default", &[t, w], &[1000], 3.0);
    b.g.grads = vec![Grad {
        param: "w1".to_owned(),
        output_index: 0,
        persistent: false,
    }];
    inserted(b.output(&[dw]))
}

#[test]
fn a_gather_first_and_a_reduction_last_bound_the_step_exactly() {
    let g = a_gather_first_and_a_reduction_last();
    assert_eq!(find(&g, CommOp::AllGather).len(), 1);
    assert_eq!(find(&g, CommOp::ReduceGrad).len(), 1);
    let s = sim(&g).summary;
    assert!(close(s.step_ms, 7.0), "{s:?}");
    // The old bound, max(compute 3, communication 4), was 4 ms; the gather before mm and the
    // reduction after it are 7 ms in any schedule.
    assert!(close(s.compute_ms.max(s.comm_ms), 4.0), "{s:?}");
    assert!(close(s.lower_bound_ms, 7.0), "{s:?}");
    assert!(close(s.ratio, 1.0), "{s:?}");
}

#[test]
fn a_cost_table_that_falls_with_bytes_charges_no_head_or_tail() {
    // A bucket could then be faster than its members alone: only the old terms are sound.
    let g = a_gather_first_and_a_reduction_last();
    let mut o = opts();
    o.cost.collective = CollectiveModel::Table(CollectiveTable {
        all_gather: vec![(0, 2.0), (1 << 20, 1.0)],
        reduce_scatter: vec![(0, 2.0), (1 << 20, 1.0)],
        all_reduce: vec![],
    });
    let s = simulate::simulate_graph(&g, &o).summary;
    assert!(
        close(s.lower_bound_ms, s.compute_ms.max(s.comm_ms)),
        "{s:?}"
    );
    assert!(s.step_ms >= s.lower_bound_ms - EPS, "{s:?}");
}

#[test]
fn graphs_without_gathers_or_reductions_keep_the_old_bound() {
    let mut b = Builder::new("forward_0", GraphKind::Forward);
    let x = b.input("x", &[100]);
    let y = b.kernel("relu", "aten.relu.default", &[x], &[100], 3.0);
    let s = sim(&inserted(b.output(&[y]))).summary;
    assert!(close(s.lower_bound_ms, 3.0), "{s:?}");
    let empty = Builder::new("forward_0", GraphKind::Forward).output(&[]);
    assert!(close(sim(&empty).summary.lower_bound_ms, 0.0));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The bound is one for every schedule: each scheduler's output, and the insertion's own
    /// order, simulate to no less, on generated programs, under the tests' cost model and the
    /// default one.
    #[test]
    fn every_schedulers_step_is_at_least_the_lower_bound(
        p in zerosched_ir::testing::program(&zerosched_ir::testing::Config::default().plain()),
    ) {
        for o in [opts(), SimOptions::default()] {
            for g in &p.graphs {
                let g = inserted(g.clone());
                let mut outs = vec![g.clone()];
                for name in schedule::NAMES {
                    let mut h = g.clone();
                    let sched = ScheduleOptions {
                        budget: u64::MAX,
                        memory: u64::MAX,
                        world_size: o.world_size,
                        cost: o.cost.clone(),
                    };
                    schedule::by_name(name).unwrap().schedule(&mut h, &sched).unwrap();
                    outs.push(h);
                }
                for h in &outs {
                    let s = simulate::simulate_graph(h, &o).summary;
                    prop_assert!(
                        s.step_ms >= s.lower_bound_ms * (1.0 - 1e-12) - EPS,
                        "{}: step {} below the bound {}", h.label(), s.step_ms, s.lower_bound_ms
                    );
                }
            }
        }
    }
}
