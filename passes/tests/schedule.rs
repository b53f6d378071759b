//! The `jit` and `prefetch` schedulers: order validity, budget, prefetch distance, buckets.

mod common;

use common::{mlp, pos};
use std::collections::BTreeSet;
use zerosched_ir::Graph;
use zerosched_passes::insert::insert;
use zerosched_passes::ops;
use zerosched_passes::schedule::{ScheduleError, ScheduleOptions, by_name};

fn inserted(mut g: Graph) -> Graph {
    insert(&mut g, &BTreeSet::new()).expect("insertion");
    g
}

fn scheduled(
    g: &Graph,
    name: &str,
    opts: &ScheduleOptions,
) -> Result<(Graph, zerosched_passes::schedule::ScheduleReport), ScheduleError> {
    let mut g = g.clone();
    let s = by_name(name).expect("known scheduler");
    let r = s.schedule(&mut g, opts)?;
    zerosched_ir::verify::graph(&g).expect("a topological order");
    Ok((g, r))
}

/// 64x64 f32 weights: 16 KiB each.
const W: u64 = 64 * 64 * 4;

#[test]
fn jit_gathers_right_before_use_and_releases_right_after() {
    let g = inserted(mlp(4, 64, 1.0));
    let (s, r) = scheduled(&g, "jit", &ScheduleOptions::default()).expect("feasible");
    for l in 0..4 {
        let wait = pos(&s, &format!("wait_layers_{l}_weight"));
        let mm = pos(&s, &format!("mm_{l}"));
        let gather = pos(&s, &format!("allgather_layers_{l}_weight"));
        assert_eq!(
            (gather + 1, wait + 1),
            (wait, mm),
            "layer {l}: gather, wait, matmul"
        );
        assert_eq!(pos(&s, &format!("release_wait_layers_{l}_weight")), mm + 1);
    }
    assert_eq!(r.peak_gathered, W);
}

#[test]
fn prefetch_issues_the_next_gather_during_the_previous_layer() {
    let g = inserted(mlp(4, 64, 1.0));
    let opts = ScheduleOptions {
        budget: 2 * W,
        ..ScheduleOptions::default()
    };
    let (s, r) = scheduled(&g, "prefetch", &opts).expect("feasible");
    for l in 1..4 {
        let gather = pos(&s, &format!("allgather_layers_{l}_weight"));
        assert!(
            gather < pos(&s, &format!("mm_{}", l - 1)),
            "layer {l}'s gather overlaps layer {}",
            l - 1
        );
    }
    assert!(r.peak_gathered <= 2 * W);
}

#[test]
fn prefetch_never_exceeds_the_budget_and_says_what_would_fit() {
    let g = inserted(mlp(6, 64, 1.0));
    for budget in [W, W + 1, 2 * W, 3 * W, 10 * W] {
        let opts = ScheduleOptions {
            budget,
            ..ScheduleOptions::default()
        };
        let (_, r) = scheduled(&g, "prefetch", &opts).expect("feasible");
        assert!(
            r.peak_gathered <= budget,
            "budget {budget}: peak {}",
            r.peak_gathered
        );
    }
    let opts = ScheduleOptions {
        budget: W - 1,
        ..ScheduleOptions::default()
    };
    match scheduled(&g, "prefetch", &opts) {
        Err(ScheduleError::OverBudget { needed, .. }) => assert_eq!(needed, W),
        other => panic!("expected OverBudget, got {:?}", other.map(|x| x.1)),
    }
}

#[test]
fn small_gathers_issued_together_become_one_bucket() {
    // Tiny weights and long matmuls: the collectives are latency-bound, so fusing pays.
    let g = inserted(mlp(6, 8, 5.0));
    let (s, r) = scheduled(&g, "prefetch", &ScheduleOptions::default()).expect("feasible");
    assert!(r.buckets >= 1, "some gathers were coalesced");
    let buckets: BTreeSet<i64> = s.nodes().filter_map(|(_, n)| ops::bucket(n)).collect();
    for b in buckets {
        let at: Vec<usize> = s
            .nodes()
            .enumerate()
            .filter(|(_, (_, n))| ops::bucket(n) == Some(b))
            .map(|(i, _)| i)
            .collect();
        assert!(
            at.windows(2).all(|w| w[1] == w[0] + 1),
            "bucket {b} members are adjacent: {at:?}"
        );
    }
}

/// Tiny weights and next to no compute: each gather's 20 µs of latency is the step, and the
/// stream is busy past every node, so no gather would be issued ahead for the stream's sake.
/// A gather whose bytes add less to the bucket than its own collective would cost rides in
/// the bucket just issued instead: the twelve gathers take a few latencies, not twelve.
#[test]
fn latency_bound_gathers_ride_in_one_bucket_when_the_stream_is_busy() {
    use zerosched_passes::checker::{CheckOptions, check_graph};
    use zerosched_passes::simulate::{SimOptions, simulate_graph};
    let g = inserted(mlp(12, 8, 0.001));
    let step = |name: &str| {
        let (s, r) = scheduled(&g, name, &ScheduleOptions::default()).expect("feasible");
        check_graph(&s, &CheckOptions::default()).expect("the checker accepts it");
        (
            simulate_graph(&s, &SimOptions::default()).summary.step_ms,
            r.buckets,
        )
    };
    let (jit, _) = step("jit");
    let (prefetch, buckets) = step("prefetch");
    assert!(buckets >= 1);
    // Twelve collectives of 0.02 ms each one by one; far fewer latencies coalesced.
    assert!(jit > 12.0 * 0.02, "jit {jit}");
    assert!(prefetch < 3.0 * 0.02, "prefetch {prefetch} ms");
}

/// The same latency-bound layers, the first half's gathers cast to bf16 (as under autocast,
/// where norms stay f32): gathers coalesce within each dtype, never across.
#[test]
fn buckets_never_mix_dtypes() {
    use zerosched_ir::comm::{self, kw};
    use zerosched_ir::{Arg, Dtype};
    use zerosched_passes::checker::{CheckOptions, check_graph};
    let mut g = inserted(mlp(12, 8, 0.001));
    for l in 0..6 {
        let id = g
            .node_by_name(&format!("allgather_layers_{l}_weight"))
            .expect("a gather per layer");
        let n = g.node(id);
        let (args, mut kwargs) = (n.args.clone(), n.kwargs.clone());
        kwargs.insert(kw::DTYPE, Arg::Dtype(Dtype::BFloat16));
        g.set_args(id, args, kwargs).expect("valid keywords");
    }
    let (s, r) = scheduled(&g, "prefetch", &ScheduleOptions::default()).expect("feasible");
    check_graph(&s, &CheckOptions::default()).expect("the checker accepts it");
    assert!(r.buckets >= 2, "each half coalesces: {} buckets", r.buckets);
    let mut dtypes = std::collections::BTreeMap::new();
    for (_, n) in s.nodes() {
        if let Some(b) = ops::bucket(n) {
            dtypes
                .entry(b)
                .or_insert_with(BTreeSet::new)
                .insert(format!("{:?}", comm::gather_dtype(n)));
        }
    }
    for (b, d) in dtypes {
        assert_eq!(d.len(), 1, "bucket {b} mixes {d:?}");
    }
}

#[test]
fn schedules_are_deterministic() {
    let g = inserted(mlp(8, 32, 0.5));
    for name in ["jit", "prefetch"] {
        let opts = ScheduleOptions {
            budget: 3 * 32 * 32 * 4,
            ..ScheduleOptions::default()
        };
        let a = scheduled(&g, name, &opts).expect("feasible").0;
        let b = scheduled(&g, name, &opts).expect("feasible").0;
        assert_eq!(
            zerosched_ir::json::export_graph(&a),
            zerosched_ir::json::export_graph(&b)
        );
    }
}

/// A weight gradient transposed back to its parameter's layout by a view that program order
/// puts after a long matmul that does not read it (as AOTAutograd emits a grouped expert
/// gradient's `permute`): its reduction is issued once the gradient exists, overlapping that
/// matmul, not after it.
#[test]
fn a_reduction_behind_a_late_view_is_issued_when_its_gradient_exists() {
    use common::{Builder, node};
    use zerosched_ir::GraphKind;
    let mut b = Builder::new("bwd_late_view", GraphKind::Backward);
    let w = b.param("layer.weight", &[64, 64]);
    let x = b.input("saved_x", &[64, 16]);
    let dy = b.input("tangents_1", &[16, 64]);
    let dw = b.mm("dw", x, dy, &[64, 64], 1.0);
    let dx = b.mm("dx", dy, w, &[16, 64], 5.0);
    let t1 = b.call("dw_t", "aten.t.default", vec![node(dw)], &[64, 64]);
    let t2 = b.call("dw_t_t", "aten.t.default", vec![node(t1)], &[64, 64]);
    let mut g = b.output(&[t2, dx]);
    g.grads = vec![zerosched_ir::Grad {
        param: "layer.weight".into(),
        output_index: 0,
        persistent: false,
    }];
    let g = inserted(g);
    for name in ["jit", "prefetch"] {
        let (s, _) = scheduled(&g, name, &ScheduleOptions::default()).expect("feasible");
        let reduce = s
            .nodes()
            .position(|(_, n)| ops::CommOp::of(n) == Some(ops::CommOp::ReduceGrad))
            .expect("a reduction");
        assert!(
            pos(&s, "dw") < reduce && reduce < pos(&s, "dx"),
            "{name}: the reduction issued between the gradient and the next matmul: {:?}",
            common::names(&s)
        );
    }
}

/// Four weights whose bytes cost more than a collective's latency, then one the compute will
/// wait on for over a millisecond whatever comes before it (the shape of a mixture-of-experts
/// layer's attention weights before its experts): delaying the first small weight by the
/// others' bytes costs nothing, since that wait is absorbed, and one bucket saves three
/// latencies from the step.
#[test]
fn gathers_join_a_late_bucket_when_a_later_stall_absorbs_the_wait() {
    use common::Builder;
    use zerosched_ir::GraphKind;
    use zerosched_passes::cost::Collective;
    use zerosched_passes::simulate::{SimOptions, simulate_graph};
    let (d, wide) = (2048, 65536);
    let mut b = Builder::new("small_weights_then_a_large_one", GraphKind::Forward);
    let mut x = b.input("x", &[16, d]);
    for l in 0..4 {
        let w = b.param(&format!("small.{l}.weight"), &[d, d]);
        x = b.mm(&format!("mm_{l}"), x, w, &[16, d], 0.001);
    }
    let w = b.param("large.weight", &[d, wide]);
    let y = b.mm("mm_large", x, w, &[16, wide], 0.001);
    let out = b.kernel("tail", "aten.relu.default", &[y], &[16, wide], 1.0);
    let g = inserted(b.output(&[out]));
    let opts = ScheduleOptions::default();
    let (s, _) = scheduled(&g, "prefetch", &opts).expect("feasible");
    let bucket = |name: &str| {
        s.nodes()
            .find(|(_, n)| n.name == name)
            .and_then(|(_, n)| ops::bucket(n))
    };
    let first = bucket("allgather_small_0_weight");
    assert!(first.is_some(), "the first small gather opens a bucket");
    for l in 1..4 {
        assert_eq!(
            bucket(&format!("allgather_small_{l}_weight")),
            first,
            "small.{l}"
        );
    }
    let ms = |bytes: u64| {
        opts.cost
            .collective_ms(Collective::AllGather, bytes, opts.world_size)
    };
    let one_bucket = ms(4 * 4 * d * d) + ms(4 * d * wide) + 0.001 + 1.0;
    let step = simulate_graph(&s, &SimOptions::default()).summary.step_ms;
    assert!(
        step <= one_bucket + 1e-9,
        "step {step} ms, one bucket then the large gather {one_bucket} ms"
    );
}

/// The backward of eight tiny layers with next to no compute: every gather and reduction is a
/// latency (20 µs) against 8 µs of compute a layer, so the communication stream is busy past
/// every node. Issued as they become ready, each reduction would take its own latency and the
/// next layer's gather, which the compute waits for, would queue behind it (the stream is
/// FIFO). Held while the stream is busy anyway, the gathers go first and the reductions go out
/// together, in buckets of one collective each.
#[test]
fn reductions_behind_a_busy_stream_go_out_in_buckets_after_the_gathers() {
    use zerosched_passes::checker::{CheckOptions, check_graph};
    use zerosched_passes::simulate::{SimOptions, simulate_graph};
    let p = common::train_step(8, 16, 0.004);
    let g = inserted(p.graphs[1].clone());
    // Two layers' weights gathered at once: the gathers are issued close to their need.
    let opts = ScheduleOptions {
        budget: 2 * 16 * 16 * 4,
        ..ScheduleOptions::default()
    };
    let (s, r) = scheduled(&g, "prefetch", &opts).expect("feasible");
    let report = check_graph(&s, &CheckOptions::default()).expect("the checker accepts it");
    assert!(r.reduce_buckets >= 1, "{r:?}");
    assert_eq!(report.reduce_buckets, r.reduce_buckets);
    // A reduction held past its gradient's next layer lets that layer's gather go first.
    let passed = (1..8).any(|l| {
        let reduce = pos(&s, &format!("reduce_dw_{l}"));
        let gather = pos(&s, &format!("allgather_layers_{}_weight", l - 1));
        pos(&s, &format!("dw_{l}")) < gather && gather < reduce
    });
    assert!(passed, "{:?}", common::names(&s));
    // The buckets save a latency per member beyond the first: the same order with every
    // reduction a collective of its own is slower.
    let sim = SimOptions::default();
    let step = |g: &Graph| simulate_graph(g, &sim).summary.step_ms;
    let mut apart = s.clone();
    for (id, n) in s.nodes() {
        if ops::CommOp::of(n) == Some(ops::CommOp::ReduceGrad) {
            let kwargs = ops::reduce_kwargs(ops::param_name(n).expect("a param"), true);
            apart.set_args(id, n.args.clone(), kwargs).expect("valid");
        }
    }
    assert!(step(&s) < step(&apart), "{} vs {}", step(&s), step(&apart));
    // And faster than just-in-time gathers with reductions issued as they come.
    let (jit, _) = scheduled(&g, "jit", &opts).expect("feasible");
    assert!(step(&s) < step(&jit));
}
