//! The `deepcompile` scheduler (DeepCompile's `fast_free_schedule`): on hand-built graphs and on
//! the fixture graphs after insertion, its order is a topological permutation in which every
//! wait follows its gather and every release follows every real use of its storage, and the
//! same input gives the same bytes. Two small cases are traced by hand from the Python.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use zerosched_ir::testing::GraphBuilder as Builder;
use zerosched_ir::{Arg, Graph, GraphKind, Node, NodeId};
use zerosched_passes::alias::Aliases;
use zerosched_passes::insert::insert;
use zerosched_passes::ops::{self, CommOp};
use zerosched_passes::schedule::{self, DeepCompile, ScheduleOptions, ScheduleReport, Scheduler};

/// A parameter `model.NAME` on the placeholder `NAME`, as DeepSpeed qualifies them.
fn param(b: &mut Builder, name: &str, shape: &[u64]) -> NodeId {
    b.param_as(name, &format!("model.{name}"), shape)
}

/// `h @ w.T` for a parameter `w`.
fn linear(b: &mut Builder, name: &str, h: NodeId, w: NodeId, shape: &[u64]) -> NodeId {
    let t = b.op(&format!("{name}_t"), "aten.t.default", &[w], &[]);
    b.op(name, "aten.mm.default", &[h, t], shape)
}

/// `layers` linear layers with a ReLU after each; placeholders first, as AOTAutograd has them.
fn mlp(layers: usize) -> Graph {
    let mut b = Builder::new("built", GraphKind::Forward);
    let mut h = b.input("x", &[4, 16]);
    let ws: Vec<NodeId> = (0..layers)
        .map(|i| param(&mut b, &format!("w{i}"), &[16, 16]))
        .collect();
    for (i, &w) in ws.iter().enumerate() {
        let mm = linear(&mut b, &format!("mm{i}"), h, w, &[4, 16]);
        h = b.op(&format!("relu{i}"), "aten.relu.default", &[mm], &[4, 16]);
    }
    b.output(&[h])
}

/// A router and parallel expert branches, combined by a sum: the branches are independent, so
/// the scheduler may interleave them.
fn moe(experts: usize) -> Graph {
    let mut b = Builder::new("built", GraphKind::Forward);
    let x = b.input("x", &[4, 16]);
    let router = param(&mut b, "router", &[experts as u64, 16]);
    let logits = linear(&mut b, "logits", x, router, &[4, experts as u64]);
    let gates = b.op("gates", "aten.softmax.int", &[logits], &[4, experts as u64]);
    let mut acc = None;
    for e in 0..experts {
        let up = param(&mut b, &format!("up{e}"), &[32, 16]);
        let down = param(&mut b, &format!("down{e}"), &[16, 32]);
        let gate = b.call(
            &format!("gate{e}"),
            "aten.select.int",
            vec![Arg::Node(gates), Arg::Int(1), Arg::Int(e as i64)],
            &[4],
        );
        let h = linear(&mut b, &format!("up{e}_mm"), x, up, &[4, 32]);
        let h = b.op(&format!("act{e}"), "aten.silu.default", &[h], &[4, 32]);
        let h = linear(&mut b, &format!("down{e}_mm"), h, down, &[4, 16]);
        let h = b.op(
            &format!("scaled{e}"),
            "aten.mul.Tensor",
            &[h, gate],
            &[4, 16],
        );
        acc = Some(match acc {
            None => h,
            Some(a) => b.op(&format!("sum{e}"), "aten.add.Tensor", &[a, h], &[4, 16]),
        });
    }
    let out = acc.unwrap_or(x);
    b.output(&[out])
}

/// A fused weight used only through `split` and its `getitem`s, each half by its own matmul
/// with compute in between.
fn split_weight() -> Graph {
    let mut b = Builder::new("built", GraphKind::Forward);
    let x = b.input("x", &[4, 16]);
    let w = param(&mut b, "qkv", &[32, 16]);
    let parts = b.call(
        "split",
        "aten.split.Tensor",
        vec![Arg::Node(w), Arg::Int(16)],
        &[],
    );
    let q = b.call(
        "q",
        ops::GETITEM,
        vec![Arg::Node(parts), Arg::Int(0)],
        &[16, 16],
    );
    let k = b.call(
        "k",
        ops::GETITEM,
        vec![Arg::Node(parts), Arg::Int(1)],
        &[16, 16],
    );
    let other = param(&mut b, "other", &[16, 16]);
    let h = linear(&mut b, "hq", x, q, &[4, 16]);
    let h = b.op("act", "aten.gelu.default", &[h], &[4, 16]);
    let h = linear(&mut b, "ho", h, other, &[4, 16]);
    let h = linear(&mut b, "hk", h, k, &[4, 16]);
    b.output(&[h])
}

/// A parameter (an attention mask) passed only as a keyword argument.
fn kwarg_param() -> Graph {
    let mut b = Builder::new("built", GraphKind::Forward);
    let x = b.input("x", &[4, 16]);
    let wq = param(&mut b, "wq", &[16, 16]);
    let mask = param(&mut b, "mask", &[4, 4]);
    let q = linear(&mut b, "q", x, wq, &[4, 16]);
    let act = b.op("act", "aten.relu.default", &[x], &[4, 16]);
    let mut attn = Node::call(
        "attn",
        "aten.scaled_dot_product_attention.default",
        vec![Arg::Node(q), Arg::Node(act), Arg::Node(act)],
    );
    attn.kwargs.insert("attn_mask", Arg::Node(mask));
    let attn = b.push(attn, &[4, 16]);
    b.output(&[attn])
}

/// The backward of an MLP: each layer's input gradient reads its weight, and each weight
/// gradient is returned (and so reduced).
fn mlp_backward(layers: usize) -> Graph {
    let mut b = Builder::new("built", GraphKind::Backward);
    let acts: Vec<NodeId> = (0..layers)
        .map(|i| b.input(&format!("act{i}"), &[4, 16]))
        .collect();
    let ws: Vec<NodeId> = (0..layers)
        .map(|i| param(&mut b, &format!("w{i}"), &[16, 16]))
        .collect();
    let mut grad = b.input("tangent", &[4, 16]);
    let mut grads = vec![None; layers];
    for i in (0..layers).rev() {
        let gt = b.op(&format!("gt{i}"), "aten.t.default", &[grad], &[16, 4]);
        grads[i] = Some(b.op(
            &format!("gw{i}"),
            "aten.mm.default",
            &[gt, acts[i]],
            &[16, 16],
        ));
        grad = b.op(
            &format!("gx{i}"),
            "aten.mm.default",
            &[grad, ws[i]],
            &[4, 16],
        );
    }
    let mut outs: Vec<NodeId> = grads.into_iter().flatten().collect();
    outs.push(grad);
    let mut g = b.output(&outs);
    g.grads = (0..layers)
        .map(|i| zerosched_ir::Grad {
            param: format!("model.w{i}"),
            output_index: i as u32,
            persistent: false,
        })
        .collect();
    g
}

/// A transformer-like forward: `layers` blocks of norm, four attention projections and a gated
/// MLP, with elementwise filler standing in for the rest of a real block.
fn transformer(layers: usize, filler: usize) -> Graph {
    let mut b = Builder::new("built", GraphKind::Forward);
    let s = [4, 16];
    let mut h = b.input("x", &s);
    for l in 0..layers {
        let p = |n: &str| format!("l{l}_{n}");
        let norm_w = param(&mut b, &p("norm"), &[16]);
        let normed = b.op(&p("normed"), "aten.mul.Tensor", &[h, norm_w], &s);
        let mut heads = Vec::new();
        for proj in ["q", "k", "v"] {
            let w = param(&mut b, &p(proj), &[16, 16]);
            let mut v = linear(&mut b, &p(&format!("{proj}_mm")), normed, w, &s);
            for f in 0..filler {
                v = b.op(&p(&format!("{proj}_f{f}")), "aten.mul.Scalar", &[v], &s);
            }
            heads.push(v);
        }
        let scores = b.op(&p("sdpa"), "aten.mul.Tensor", &heads, &s);
        let wo = param(&mut b, &p("o"), &[16, 16]);
        let attn = linear(&mut b, &p("o_mm"), scores, wo, &s);
        h = b.op(&p("res1"), "aten.add.Tensor", &[h, attn], &s);
        let gate_w = param(&mut b, &p("gate"), &[16, 16]);
        let up_w = param(&mut b, &p("up"), &[16, 16]);
        let down_w = param(&mut b, &p("down"), &[16, 16]);
        let gate = linear(&mut b, &p("gate_mm"), h, gate_w, &s);
        let mut gate = b.op(&p("gate_act"), "aten.silu.default", &[gate], &s);
        for f in 0..filler {
            gate = b.op(&p(&format!("gate_f{f}")), "aten.mul.Scalar", &[gate], &s);
        }
        let up = linear(&mut b, &p("up_mm"), h, up_w, &s);
        let mlp = b.op(&p("mlp"), "aten.mul.Tensor", &[gate, up], &s);
        let down = linear(&mut b, &p("down_mm"), mlp, down_w, &s);
        h = b.op(&p("res2"), "aten.add.Tensor", &[h, down], &s);
    }
    b.output(&[h])
}

fn persistent_of(graphs: &[Graph]) -> BTreeSet<String> {
    graphs
        .iter()
        .flat_map(|g| &g.params)
        .filter(|p| p.persistent)
        .map(|p| p.name.clone())
        .collect()
}

fn inserted(mut g: Graph, persistent: &BTreeSet<String>) -> Graph {
    insert(&mut g, persistent).expect("insertion succeeds");
    g
}

fn run(g: &Graph) -> (Graph, ScheduleReport) {
    let mut out = g.clone();
    let report = DeepCompile
        .schedule(&mut out, &ScheduleOptions::default())
        .expect("deepcompile schedules the graph");
    (out, report)
}

fn names(g: &Graph) -> Vec<&str> {
    g.nodes().map(|(_, n)| n.name.as_str()).collect()
}

/// Everything the scheduled graph `s` must satisfy, `before` being its input.
fn check(before: &Graph, s: &Graph, report: &ScheduleReport) {
    let label = before.label();
    let mut a: Vec<NodeId> = before.order().to_vec();
    let mut b: Vec<NodeId> = s.order().to_vec();
    a.sort_unstable();
    b.sort_unstable();
    assert_eq!(a, b, "{label}: not a permutation");
    if let Err(d) = zerosched_ir::verify::graph(s) {
        panic!("{label}: the schedule fails the verifier:\n{d}");
    }
    let pos = s.positions();
    let aliases = Aliases::analyse(s);
    let (mut gathers, mut releases) = (0, 0);
    for (id, n) in s.nodes() {
        match CommOp::of(n) {
            Some(CommOp::AllGather | CommOp::Reuse) => gathers += 1,
            Some(CommOp::Wait) => {
                let gather = n.args[0]
                    .as_node()
                    .copied()
                    .expect("a wait reads its gather");
                assert_eq!(
                    pos[gather] + 1,
                    pos[id],
                    "{label}: `{}` does not directly follow its gather",
                    n.name
                );
            }
            Some(op @ (CommOp::Release | CommOp::Keep)) => {
                releases += usize::from(op == CommOp::Release);
                let value = n.args[0]
                    .as_node()
                    .copied()
                    .expect("a release names a value");
                let class = aliases
                    .class(value)
                    .expect("the released value has storage");
                for u in aliases.real_uses(s, class) {
                    assert!(
                        pos[u] < pos[id],
                        "{label}: `{}` comes before the use `{}`",
                        n.name,
                        s.node(u).name
                    );
                }
            }
            _ => {}
        }
    }
    assert_eq!(report.gathers, gathers, "{label}: gathers reported");
    assert_eq!(report.releases, releases, "{label}: releases reported");
    let again = run(before).0;
    assert_eq!(
        zerosched_ir::json::export_graph(s),
        zerosched_ir::json::export_graph(&again),
        "{label}: two runs differ"
    );
}

fn check_built(g: Graph) -> (Graph, ScheduleReport) {
    let g = inserted(g, &BTreeSet::new());
    let (s, report) = run(&g);
    check(&g, &s, &report);
    (s, report)
}

#[test]
fn is_registered_by_name() {
    assert!(schedule::NAMES.contains(&"deepcompile"));
    let s = schedule::by_name("deepcompile").expect("by_name knows it");
    assert_eq!(s.name(), "deepcompile");
}

#[test]
fn mlp_layers() {
    let (_, report) = check_built(mlp(6));
    assert_eq!(report.gathers, 6);
    // Each layer's weight is released before the next is gathered: one 16x16 f32 at a time.
    assert_eq!(report.peak_gathered, 16 * 16 * 4);
}

#[test]
fn moe_fan_out() {
    let (_, report) = check_built(moe(4));
    assert_eq!(report.gathers, 9);
}

#[test]
fn param_used_only_through_split_and_getitem() {
    let (s, _) = check_built(split_weight());
    let pos = s.positions();
    let at = |name: &str| pos[s.node_by_name(name).expect("node exists")];
    // Both halves are read before the fused weight is released.
    assert!(at("release_wait_qkv") > at("hk"));
    assert!(at("release_wait_qkv") > at("hq"));
}

#[test]
fn param_passed_as_a_keyword() {
    let (s, _) = check_built(kwarg_param());
    let pos = s.positions();
    let at = |name: &str| pos[s.node_by_name(name).expect("node exists")];
    assert!(at("wait_mask") < at("attn"));
    assert!(at("release_wait_mask") > at("attn"));
}

#[test]
fn backward_reductions() {
    let (s, report) = check_built(mlp_backward(4));
    assert_eq!(report.reductions, 4);
    let pos = s.positions();
    for (id, n) in s.nodes() {
        if CommOp::of(n) == Some(CommOp::ReduceGrad) {
            let grad = n.args[0]
                .as_node()
                .copied()
                .expect("a reduction reads its gradient");
            assert!(pos[grad] < pos[id]);
        }
    }
}

#[test]
fn transformer_blocks() {
    let (_, report) = check_built(transformer(4, 2));
    assert_eq!(report.gathers, 4 * 8);
}

/// Traced by hand through `fast_free_schedule`. Last uses: `allgather_w0` → `mm0`,
/// `allgather_w1` → `mm1`. The first tier holds only `allgather_w0` (one gather on the path to
/// its last use); its path to its release needs no other gather, so it is scheduled through
/// `release_wait_w0`. Then `allgather_w1` and what reaches its release: `relu0` is pulled in
/// by `mm1`'s walk, after the gather (and its wait, which rides with it here; DeepCompile's walk
/// would put `relu0` between them).
#[test]
fn traced_two_layers() {
    let g = inserted(mlp(2), &BTreeSet::new());
    assert_eq!(
        names(&g),
        [
            "x",
            "w0",
            "w1",
            "allgather_w0",
            "wait_w0",
            "mm0_t",
            "mm0",
            "release_wait_w0",
            "relu0",
            "allgather_w1",
            "wait_w1",
            "mm1_t",
            "mm1",
            "release_wait_w1",
            "relu1",
            "output"
        ]
    );
    let (s, report) = run(&g);
    check(&g, &s, &report);
    assert_eq!(
        names(&s),
        [
            "x",
            "w0",
            "w1",
            "allgather_w0",
            "wait_w0",
            "mm0_t",
            "mm0",
            "release_wait_w0",
            "allgather_w1",
            "wait_w1",
            "relu0",
            "mm1_t",
            "mm1",
            "release_wait_w1",
            "relu1",
            "output"
        ]
    );
}

/// Traced by hand: one node reads two gathered parameters, so neither gather has a free path
/// (each needs the other before its last use) and the fallback key picks the one whose path
/// needs fewer other gathered bytes: `a` (it needs `b`, 32 bytes padded; `b` needs `a`, 64).
/// Only `a`'s gather and wait are scheduled. Next `b` is free and is scheduled through its
/// release; the output value `relu` follows as soon as both gathers are chosen, and `a`'s
/// release, on no chosen path, is left to the tail in the original order.
#[test]
fn traced_fallback_choice() {
    let mut b = Builder::new("built", GraphKind::Forward);
    let wa = param(&mut b, "a", &[4, 4]);
    let wb = param(&mut b, "b", &[4]);
    let mul = b.op("mul", "aten.mul.Tensor", &[wa, wb], &[4, 4]);
    let relu = b.op("relu", "aten.relu.default", &[mul], &[4, 4]);
    let g = inserted(b.output(&[relu]), &BTreeSet::new());
    assert_eq!(
        names(&g),
        [
            "a",
            "b",
            "allgather_a",
            "wait_a",
            "allgather_b",
            "wait_b",
            "mul",
            "release_wait_a",
            "release_wait_b",
            "relu",
            "output"
        ]
    );
    let (s, report) = run(&g);
    check(&g, &s, &report);
    assert_eq!(
        names(&s),
        [
            "a",
            "b",
            "allgather_a",
            "wait_a",
            "allgather_b",
            "wait_b",
            "mul",
            "release_wait_b",
            "relu",
            "release_wait_a",
            "output"
        ]
    );
    assert_eq!(report.peak_gathered, 64 + 32);
}

/// In the standard pipeline (insert, schedule, keep) by name; the graphs the keep pass leaves,
/// with keeps in place of releases and reuses in place of gathers, schedule again.
#[test]
fn in_the_pipeline_and_after_keep() {
    use zerosched_passes::pipeline::{self, PipelineOptions};
    let mut p = common::train_step(4, 64, 1.0);
    let opts = PipelineOptions {
        scheduler: "deepcompile".to_owned(),
        verify: true,
        ..PipelineOptions::default()
    };
    let cx = pipeline::run(&pipeline::standard(), &mut p, &opts).expect("pipeline");
    assert!(!cx.keep.kept.is_empty(), "with no budget something is kept");
    for g in &p.graphs {
        let (s, report) = run(g);
        check(g, &s, &report);
    }
    let reuses = |g: &Graph| g.nodes().filter(|(_, n)| n.target == ops::REUSE).count();
    let backward = &p.graphs[1];
    let (_, report) = run(backward);
    // Reused buffers count as gathered, resident from the start.
    assert_eq!(report.gathers, 4);
    assert_eq!(reuses(backward), cx.keep.kept.len());
    assert!(report.peak_gathered >= cx.keep.kept.len() as u64 * 64 * 64 * 4);
}

/// Fixture files: the edge cases, plus any exported model graphs present.
fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "json" || x == "zsg") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn fixture_graphs() {
    let files = fixtures();
    assert!(files.iter().any(|p| p.to_string_lossy().contains("edge")));
    for path in files {
        let bytes = std::fs::read(&path).expect("fixture is readable");
        let program =
            zerosched_ir::import(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let persistent = persistent_of(&program.graphs);
        for g in program.graphs {
            let g = inserted(g, &persistent);
            let (s, report) = run(&g);
            check(&g, &s, &report);
        }
    }
}
