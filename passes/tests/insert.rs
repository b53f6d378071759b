//! ZeRO-3 insertion on the graphs behind DeepCompile's failure modes, and the basics.

mod common;

use common::{Builder, node, pos};
use std::collections::BTreeSet;
use zerosched_ir::{Arg, GraphKind};
use zerosched_passes::insert::insert;
use zerosched_passes::ops;

fn run(g: &mut zerosched_ir::Graph) -> zerosched_passes::insert::InsertReport {
    let r = insert(g, &BTreeSet::new()).expect("insertion succeeds");
    zerosched_ir::verify::graph(g).expect("insertion keeps the graph valid");
    r
}

fn count(g: &zerosched_ir::Graph, target: &str) -> usize {
    g.nodes().filter(|(_, n)| n.target == target).count()
}

#[test]
fn a_parameter_only_the_output_uses_is_passed_through_as_its_shard() {
    // docs/design.md §4, mode 1: gathering it left a wait with no last use (KeyError).
    let bytes = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/edge/param_only_used_by_output.json"
    ))
    .expect("fixture");
    let mut p = zerosched_ir::import(&bytes).expect("valid");
    let g = &mut p.graphs[0];
    let r = run(g);
    assert_eq!(r.output_only, vec!["tied.weight".to_owned()]);
    assert_eq!(r.gathered, 1);
    assert_eq!(count(g, ops::ALLGATHER), 1);
    assert_eq!(count(g, ops::RELEASE), 1);
    // The output still returns the shard placeholder.
    let out = g.output_values();
    assert_eq!(
        out[1],
        Arg::Node(g.node_by_name("primals_2").expect("placeholder"))
    );
    // The gathered weight is released after its only real use, the matmul.
    assert!(pos(g, "release_wait_primals_1") > pos(g, "mm"));
    assert!(pos(g, "wait_primals_1") < pos(g, "t"));
}

#[test]
fn a_parameter_used_only_through_split_and_getitem_is_released_after_the_last_piece() {
    // docs/design.md §4, mode 2: a release after the first getitem freed the storage under the others.
    let mut b = Builder::new("split_getitem", GraphKind::Forward);
    let x = b.input("x", &[4, 8]);
    let w = b.param("fused.weight", &[8, 16]);
    let t = b.call("t", "aten.t.default", vec![node(w)], &[16, 8]);
    let parts = b.call(
        "split",
        "aten.split.Tensor",
        vec![node(t), Arg::Int(8)],
        &[8, 8],
    );
    let a = b.call(
        "a",
        "operator.getitem",
        vec![node(parts), Arg::Int(0)],
        &[8, 8],
    );
    let mm1 = b.mm("mm1", x, a, &[4, 8], 1.0);
    let relu = b.call("relu", "aten.relu.default", vec![node(mm1)], &[4, 8]);
    let c = b.call(
        "c",
        "operator.getitem",
        vec![node(parts), Arg::Int(1)],
        &[8, 8],
    );
    let mm2 = b.mm("mm2", relu, c, &[4, 8], 1.0);
    let mut g = b.output(&[mm2]);
    run(&mut g);
    let release = g
        .nodes()
        .find(|(_, n)| n.target == ops::RELEASE)
        .map(|(id, _)| id)
        .expect("a release");
    let after = ops::release_after(g.node(release));
    let mm1 = g.node_by_name("mm1").expect("mm1");
    let mm2 = g.node_by_name("mm2").expect("mm2");
    assert_eq!(
        after,
        vec![mm1, mm2],
        "the release depends on every real use, through every view"
    );
    assert!(pos(&g, &g.node(release).name.clone()) > pos(&g, "mm2"));
}

#[test]
fn a_parameter_passed_only_as_a_keyword_is_gathered_before_its_consumer() {
    // docs/design.md §4, mode 4: dependency walks that followed args and forgot kwargs.
    let mut b = Builder::new("kwarg", GraphKind::Forward);
    let q = b.input("q", &[2, 4, 8, 16]);
    let mask = b.param("attn.mask", &[8, 8]);
    let attn = b.call_kw(
        "attn",
        "aten.scaled_dot_product_attention.default",
        vec![node(q), node(q), node(q)],
        &[("attn_mask", node(mask))],
        &[2, 4, 8, 16],
    );
    let mut g = b.output(&[attn]);
    let r = run(&mut g);
    assert_eq!(r.gathered, 1);
    let attn = g.node_by_name("attn").expect("attn");
    let wait = g.node_by_name("wait_attn_mask").expect("wait");
    assert_eq!(g.node(attn).kwargs.get("attn_mask"), Some(&Arg::Node(wait)));
    assert!(pos(&g, "wait_attn_mask") < pos(&g, "attn"));
    assert!(pos(&g, "release_wait_attn_mask") > pos(&g, "attn"));
}

#[test]
fn a_downcast_that_is_the_only_use_is_gathered_in_the_smaller_dtype() {
    let mut b = Builder::new("cast", GraphKind::Forward);
    let x = b.input("x", &[4, 8]);
    let w = b.param("w", &[8, 8]);
    let cast = b.call(
        "cast",
        "prims.convert_element_type.default",
        vec![node(w), Arg::Dtype(zerosched_ir::Dtype::BFloat16)],
        &[8, 8],
    );
    let mm = b.mm("mm", x, cast, &[4, 8], 1.0);
    let mut g = b.output(&[mm]);
    let r = run(&mut g);
    assert_eq!(r.fused_casts, 1);
    assert!(g.node_by_name("cast").is_none(), "the cast is gone");
    let gather = g
        .nodes()
        .find(|(_, n)| n.target == ops::ALLGATHER)
        .map(|(_, n)| n)
        .expect("gather");
    assert_eq!(
        ops::gather_dtype(gather),
        Some(zerosched_ir::Dtype::BFloat16)
    );
}

#[test]
fn persistent_and_unused_parameters_are_left_alone() {
    let mut b = Builder::new("persist", GraphKind::Forward);
    let x = b.input("x", &[4, 8]);
    let w = b.param("w", &[8, 8]);
    let _unused = b.param("unused", &[8, 8]);
    let mm = b.mm("mm", x, w, &[4, 8], 1.0);
    let mut g = b.output(&[mm]);
    let persistent: BTreeSet<String> = ["w".to_owned()].into();
    let r = insert(&mut g, &persistent).expect("insertion");
    assert_eq!(r.gathered, 0);
    assert_eq!(r.unused, vec!["unused".to_owned()]);
    assert_eq!(count(&g, ops::ALLGATHER), 0);
}

#[test]
fn backward_gradients_are_reduced_and_joined_by_end_backward() {
    let mut b = Builder::new("bwd", GraphKind::Backward);
    let w = b.param("w", &[8, 8]);
    let x = b.input("x", &[4, 8]);
    let dy = b.input("tangents_1", &[4, 8]);
    let t = b.call("t", "aten.t.default", vec![node(x)], &[8, 4]);
    let dw = b.mm("dw", t, dy, &[8, 8], 1.0);
    let wt = b.call("wt", "aten.t.default", vec![node(w)], &[8, 8]);
    let dx = b.mm("dx", dy, wt, &[4, 8], 1.0);
    let mut g = b.output(&[dw, dx]);
    g.grads.push(zerosched_ir::Grad {
        param: "w".into(),
        output_index: 0,
        persistent: false,
    });
    let r = run(&mut g);
    assert_eq!((r.gathered, r.reduced), (1, 1));
    let reduce = g.node_by_name("reduce_dw").expect("reduce");
    assert!(
        pos(&g, "reduce_dw") == pos(&g, "dw") + 1,
        "reduced as soon as produced"
    );
    let slot = g.output_values()[0].as_node().copied().expect("slot");
    assert_eq!(g.node(slot).target, ops::GETITEM);
    let end = g.inputs(slot)[0];
    assert_eq!(g.node(end).target, ops::END_BACKWARD);
    assert!(g.inputs(end).contains(&reduce));
}

/// A persistent RMSNorm-like weight whose gradient does not read the weight: the backward graph
/// does not carry it, so only its gradient entry can say it is persistent.
#[test]
fn backward_graph_without_the_persistent_parameter_all_reduces_from_its_grad_entry() {
    let build = |persistent: bool| {
        let mut b = Builder::new("bwd_norm", GraphKind::Backward);
        let normed = b.input("normed", &[4, 8]);
        let dy = b.input("tangents_1", &[4, 8]);
        let prod = b.call(
            "prod",
            "aten.mul.Tensor",
            vec![node(normed), node(dy)],
            &[4, 8],
        );
        let dw = b.call("dw", "aten.sum.dim_IntList", vec![node(prod)], &[8]);
        let mut g = b.output(&[dw]);
        g.grads.push(zerosched_ir::Grad {
            param: "norm.weight".into(),
            output_index: 0,
            persistent,
        });
        g
    };
    let sharded_kwarg = |g: &zerosched_ir::Graph| {
        let (_, n) = g
            .nodes()
            .find(|(_, n)| n.target == ops::REDUCE_GRAD)
            .expect("a reduce_grad");
        n.kwargs.get("sharded").cloned()
    };
    let mut said = build(true);
    run(&mut said);
    assert_eq!(sharded_kwarg(&said), Some(Arg::Bool(false)));
    let mut unsaid = build(false);
    run(&mut unsaid);
    assert_eq!(sharded_kwarg(&unsaid), Some(Arg::Bool(true)));
}

#[test]
fn a_hundred_thousand_node_chain_is_handled_without_recursion() {
    let mut b = Builder::new("chain", GraphKind::Forward);
    let w = b.param("w", &[4, 4]);
    let mut x = b.input("x", &[4, 4]);
    x = b.mm("mm_first", x, w, &[4, 4], 0.01);
    for i in 0..100_000 {
        x = b.call(
            &format!("relu_{i}"),
            "aten.relu.default",
            vec![node(x)],
            &[4, 4],
        );
    }
    x = b.mm("mm_last", x, w, &[4, 4], 0.01);
    let mut g = b.output(&[x]);
    run(&mut g);
    assert!(pos(&g, "release_wait_w") > pos(&g, "mm_last"));
}

/// A backward graph scheduled on its own carries neither the norm weight nor a flag on its
/// gradient entry; only the document's program-level `persistent` list says the weight is
/// kept whole. With it the gradient is all-reduced (and priced so by the simulator, at its
/// full size), and the graph's gradient entry says so; without it, reduce-scattered.
#[test]
fn a_standalone_backward_graph_takes_persistence_from_the_program_list() {
    use zerosched_passes::cost::Collective;
    use zerosched_passes::pipeline::{self, PipelineOptions};
    use zerosched_passes::schedule::ScheduleOptions;
    use zerosched_passes::simulate::{SimOptions, simulate_program};
    let doc = |list: &str| {
        format!(
            r#"{{"format":"fx-graph","version":1,"name":"bwd","kind":"backward","nodes":[
{{"name":"t","op":"placeholder","target":"t","args":[],"kwargs":{{}},"meta":{{"val":{{"shape":[1024],"dtype":"float32"}}}}}},
{{"name":"mul","op":"call_function","target":"aten.mul.Tensor","args":[{{"node":"t"}},{{"node":"t"}}],"kwargs":{{}},"meta":{{"val":{{"shape":[1024],"dtype":"float32"}}}}}},
{{"name":"output","op":"output","target":"output","args":[[{{"node":"mul"}}]],"kwargs":{{}}}}
],"params":[],"grads":[{{"param":"norm.weight","output_index":0}}]{list}}}"#
        )
    };
    for (list, all_reduced) in [(r#","persistent":["norm.weight"]"#, true), ("", false)] {
        let mut p = zerosched_ir::import(doc(list).as_bytes()).expect("valid");
        let opts = PipelineOptions {
            schedule: ScheduleOptions {
                world_size: 4,
                ..ScheduleOptions::default()
            },
            verify: true,
            ..PipelineOptions::default()
        };
        pipeline::run(&pipeline::standard(), &mut p, &opts).expect("schedules");
        let g = &p.graphs[0];
        let (_, reduce) = g
            .nodes()
            .find(|(_, n)| n.target == ops::REDUCE_GRAD)
            .expect("a reduction");
        assert_eq!(zerosched_ir::comm::reduce_sharded(reduce), !all_reduced);
        assert_eq!(g.grads[0].persistent, all_reduced);
        let sim = simulate_program(
            &p,
            &SimOptions {
                world_size: 4,
                ..SimOptions::default()
            },
        );
        let spans = &sim.graphs[0].timeline.comm;
        assert_eq!(spans.len(), 1);
        let want = if all_reduced {
            Collective::AllReduce
        } else {
            Collective::ReduceScatter
        };
        assert_eq!((spans[0].kind, spans[0].bytes), (want, 4096));
    }
}
