//! The schedule checker against what insertion and every scheduler produce (it must accept), and
//! against deliberately broken schedules (it must reject, naming the node).

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use zerosched_ir::comm::{self, CommOp};
use zerosched_ir::{Arg, Dim, Dtype, Graph, GraphKind, Meta, Node, NodeId, Op, Param, Program};
use zerosched_ir::{Kwargs, Str, TensorMeta, Val};
use zerosched_passes::checker::{
    CheckOptions, CheckReport, Violation, Violations, check_graph, check_program,
};
use zerosched_passes::insert::{InsertReport, insert};
use zerosched_passes::schedule::{NAMES, ScheduleOptions, ScheduleReport, by_name};

const WORLD: u32 = 8;

// ---------------------------------------------------------------------------------------------
// A small graph builder over the IR API.

struct B {
    g: Graph,
}

fn tensor(shape: &[u64], dtype: Dtype) -> Val {
    Val::Tensor((TensorMeta::new(shape.iter().map(|&d| Dim::Const(d)).collect(), dtype)).into())
}

fn n(id: NodeId) -> Arg<NodeId> {
    Arg::Node(id)
}

impl B {
    fn new(name: &str, kind: GraphKind) -> B {
        B {
            g: Graph::new(Some(name.to_owned()), kind),
        }
    }

    fn push(&mut self, node: Node) -> NodeId {
        self.g.push(node).expect("the builder makes valid nodes")
    }

    fn input(&mut self, name: &str, shape: &[u64]) -> NodeId {
        self.input_of(name, shape, Dtype::Float32)
    }

    fn input_of(&mut self, name: &str, shape: &[u64], dtype: Dtype) -> NodeId {
        let node = Node {
            op: Op::Placeholder,
            meta: Box::new(Meta {
                val: Some(tensor(shape, dtype)),
                ..Meta::default()
            }),
            ..Node::call(name, name, vec![])
        };
        self.push(node)
    }

    fn param(&mut self, name: &str, fqn: &str, shape: &[u64]) -> NodeId {
        let id = self.input(name, shape);
        self.g.params.push(Param {
            name: fqn.to_owned(),
            node: id,
            shape: shape.iter().map(|&d| Dim::Const(d)).collect(),
            dtype: Dtype::Float32,
            persistent: false,
        });
        id
    }

    fn op(&mut self, name: &str, target: &str, args: Vec<Arg<NodeId>>, shape: &[u64]) -> NodeId {
        self.op_kw(name, target, args, vec![], shape)
    }

    fn op_kw(
        &mut self,
        name: &str,
        target: &str,
        args: Vec<Arg<NodeId>>,
        kwargs: Vec<(&str, Arg<NodeId>)>,
        shape: &[u64],
    ) -> NodeId {
        let node = Node {
            kwargs: kwargs.into_iter().map(|(k, v)| (Str::from(k), v)).collect(),
            meta: Box::new(Meta {
                val: Some(tensor(shape, Dtype::Float32)),
                ..Meta::default()
            }),
            ..Node::call(name, target, args)
        };
        self.push(node)
    }

    /// `aten.t` of a square 2-D value.
    fn t(&mut self, name: &str, x: NodeId, shape: &[u64]) -> NodeId {
        self.op(name, "aten.t.default", vec![n(x)], shape)
    }

    /// A list-returning view and a getitem of each of its `parts` outputs.
    fn split(&mut self, name: &str, x: NodeId, parts: u64, part: &[u64]) -> Vec<NodeId> {
        let node = Node {
            meta: Box::new(Meta {
                val: Some(Val::Tuple(
                    (0..parts)
                        .map(|_| match tensor(part, Dtype::Float32) {
                            Val::Tensor(t) => Some(t),
                            _ => None,
                        })
                        .collect(),
                )),
                ..Meta::default()
            }),
            ..Node::call(
                name,
                "aten.split.Tensor",
                vec![n(x), Arg::Int(part[0] as i64)],
            )
        };
        let s = self.push(node);
        (0..parts)
            .map(|i| {
                self.op(
                    &format!("{name}_{i}"),
                    comm::GETITEM,
                    vec![n(s), Arg::Int(i as i64)],
                    part,
                )
            })
            .collect()
    }

    fn output(mut self, values: Vec<Arg<NodeId>>) -> Graph {
        let node = Node {
            op: Op::Output,
            ..Node::call("output", "output", vec![Arg::List(values)])
        };
        self.push(node);
        self.g
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-built graphs, one per failure mode of docs/design.md §4 that shapes the guarantees.

/// Two linear layers; the forward returns both shards for the backward (saved parameters).
fn mlp() -> Graph {
    let mut b = B::new("mlp_fwd", GraphKind::Forward);
    let x = b.input("x", &[4, 16]);
    let w1 = b.param("w1", "l1.weight", &[16, 16]);
    let b1 = b.param("b1", "l1.bias", &[16]);
    let w2 = b.param("w2", "l2.weight", &[16, 16]);
    let t1 = b.t("t1", w1, &[16, 16]);
    let mm1 = b.op("mm1", "aten.mm.default", vec![n(x), n(t1)], &[4, 16]);
    let add = b.op("add", "aten.add.Tensor", vec![n(mm1), n(b1)], &[4, 16]);
    let relu = b.op("relu", "aten.relu.default", vec![n(add)], &[4, 16]);
    let t2 = b.t("t2", w2, &[16, 16]);
    let mm2 = b.op("mm2", "aten.mm.default", vec![n(relu), n(t2)], &[4, 16]);
    b.output(vec![n(mm2), n(w1), n(w2), n(relu)])
}

/// A parameter used only through `split` and its getitems, at far-apart places (mode 2).
fn split_views() -> Graph {
    let mut b = B::new("split_fwd", GraphKind::Forward);
    let x = b.input("x", &[4, 16]);
    let w = b.param("qkv", "attn.qkv.weight", &[48, 16]);
    let parts = b.split("split", w, 3, &[16, 16]);
    let tq = b.t("tq", parts[0], &[16, 16]);
    let q = b.op("q", "aten.mm.default", vec![n(x), n(tq)], &[4, 16]);
    let r = b.op("r", "aten.relu.default", vec![n(q)], &[4, 16]);
    let tk = b.t("tk", parts[1], &[16, 16]);
    let k = b.op("k", "aten.mm.default", vec![n(r), n(tk)], &[4, 16]);
    let s = b.op("s", "aten.sigmoid.default", vec![n(k)], &[4, 16]);
    let tv = b.t("tv", parts[2], &[16, 16]);
    let v = b.op("v", "aten.mm.default", vec![n(s), n(tv)], &[4, 16]);
    b.output(vec![n(v)])
}

/// A router and parallel expert branches joined by a combine (mode 3).
fn moe() -> Graph {
    let mut b = B::new("moe_fwd", GraphKind::Forward);
    let x = b.input("x", &[4, 16]);
    let wr = b.param("wr", "moe.router.weight", &[16, 16]);
    let experts: Vec<NodeId> = (0..4)
        .map(|i| {
            b.param(
                &format!("we{i}"),
                &format!("moe.experts.{i}.weight"),
                &[16, 16],
            )
        })
        .collect();
    let tr = b.t("tr", wr, &[16, 16]);
    let router = b.op("router", "aten.mm.default", vec![n(x), n(tr)], &[4, 16]);
    let gate = b.op(
        "gate",
        "aten.softmax.int",
        vec![n(router), Arg::Int(-1)],
        &[4, 16],
    );
    let mut acc = None;
    for (i, &w) in experts.iter().enumerate() {
        let t = b.t(&format!("te{i}"), w, &[16, 16]);
        let h = b.op(
            &format!("h{i}"),
            "aten.mm.default",
            vec![n(x), n(t)],
            &[4, 16],
        );
        let g = b.op(
            &format!("g{i}"),
            "aten.mul.Tensor",
            vec![n(h), n(gate)],
            &[4, 16],
        );
        acc = Some(match acc {
            None => g,
            Some(a) => b.op(
                &format!("sum{i}"),
                "aten.add.Tensor",
                vec![n(a), n(g)],
                &[4, 16],
            ),
        });
    }
    let out = acc.expect("at least one expert");
    b.output(vec![n(out)])
}

/// [`moe`] with measured compute times long enough that prefetch issues the experts' gathers
/// together and buckets them.
fn timed_moe() -> Graph {
    let mut g = moe();
    g.name = Some("timed_moe_fwd".into());
    let compute: Vec<NodeId> = g
        .nodes()
        .filter(|(_, x)| ["aten.mm.default", "aten.mul.Tensor"].contains(&x.target.as_str()))
        .map(|(id, _)| id)
        .collect();
    for id in compute {
        g.meta_mut(id).device_time_ms = Some(1.0);
    }
    g
}

/// A parameter passed as a keyword argument (mode 4), and a fused downcast.
fn kwarg_and_cast() -> Graph {
    let mut b = B::new("attn_fwd", GraphKind::Forward);
    let q = b.input("q", &[4, 4]);
    let k = b.input("k", &[4, 4]);
    let v = b.input("v", &[4, 4]);
    let mask = b.param("mask", "attn.bias_mask", &[4, 4]);
    let w = b.param("wo", "attn.o.weight", &[4, 4]);
    let attn = b.op_kw(
        "attn",
        "aten.scaled_dot_product_attention.default",
        vec![n(q), n(k), n(v)],
        vec![("attn_mask", n(mask))],
        &[4, 4],
    );
    let cast = b.op(
        "cast",
        "prims.convert_element_type.default",
        vec![n(w), Arg::Dtype(Dtype::BFloat16)],
        &[4, 4],
    );
    let a16 = b.op(
        "a16",
        "prims.convert_element_type.default",
        vec![n(attn), Arg::Dtype(Dtype::BFloat16)],
        &[4, 4],
    );
    let o = b.op("o", "aten.mm.default", vec![n(a16), n(cast)], &[4, 4]);
    b.output(vec![n(o)])
}

/// A parameter whose size does not divide by the world size, used only through a downcast.
fn odd_cast() -> Graph {
    let mut b = B::new("odd_cast_fwd", GraphKind::Forward);
    let x = b.input_of("x", &[4, 5], Dtype::BFloat16);
    let w = b.param("w", "proj.weight", &[3, 5]);
    let cast = b.op(
        "cast",
        "prims.convert_element_type.default",
        vec![n(w), Arg::Dtype(Dtype::BFloat16)],
        &[3, 5],
    );
    let t = b.t("t", cast, &[5, 3]);
    let mm = b.op("mm", "aten.mm.default", vec![n(x), n(t)], &[4, 3]);
    b.output(vec![n(mm)])
}

/// An inference graph that hands a view of a gathered parameter to its caller (escape), and a
/// parameter the output returns without using it.
fn inference_escape() -> Graph {
    let mut b = B::new("infer", GraphKind::Inference);
    let x = b.input("x", &[4, 16]);
    let w = b.param("w", "head.weight", &[16, 16]);
    let tied = b.param("tied", "tied.weight", &[16, 16]);
    let t = b.t("t", w, &[16, 16]);
    let mm = b.op("mm", "aten.mm.default", vec![n(x), n(t)], &[4, 16]);
    b.output(vec![n(mm), n(t), n(tied)])
}

/// A backward graph: one sharded and one persistent parameter with gradients.
fn backward() -> Graph {
    let mut b = B::new("mlp_bwd", GraphKind::Backward);
    let x = b.input("x", &[4, 16]);
    let w1 = b.param("w1", "l1.weight", &[16, 16]);
    let w2 = b.param("w2", "l2.weight", &[16, 16]);
    b.g.params[1].persistent = true;
    let go = b.input("tangents_1", &[4, 16]);
    let tgo = b.t("t_go", go, &[16, 4]);
    let gw2 = b.op("gw2", "aten.mm.default", vec![n(tgo), n(x)], &[16, 16]);
    let gx = b.op("gx", "aten.mm.default", vec![n(go), n(w2)], &[4, 16]);
    let tgx = b.t("t_gx", gx, &[16, 4]);
    let gw1 = b.op("gw1", "aten.mm.default", vec![n(tgx), n(x)], &[16, 16]);
    let gxx = b.op("gxx", "aten.mm.default", vec![n(gx), n(w1)], &[4, 16]);
    let mut g = b.output(vec![n(gxx), n(gw1), n(gw2)]);
    g.grads = vec![
        zerosched_ir::Grad {
            param: "l1.weight".into(),
            output_index: 1,
            persistent: false,
        },
        zerosched_ir::Grad {
            param: "l2.weight".into(),
            output_index: 2,
            persistent: false,
        },
    ];
    g
}

/// `layers` linear layers in a chain, each with its own parameter: deep and long. FX puts every
/// placeholder first; `interleaved` declares each parameter just before its layer instead,
/// which the format allows too.
fn deep(layers: usize, interleaved: bool) -> Graph {
    let mut b = B::new("deep_fwd", GraphKind::Forward);
    let mut h = b.input("x", &[4, 16]);
    let param =
        |b: &mut B, i: usize| b.param(&format!("w{i}"), &format!("layers.{i}.weight"), &[16, 16]);
    let mut ws: Vec<NodeId> = if interleaved {
        Vec::new()
    } else {
        (0..layers).map(|i| param(&mut b, i)).collect()
    };
    for i in 0..layers {
        if interleaved {
            ws.push(param(&mut b, i));
        }
        let t = b.t(&format!("t{i}"), ws[i], &[16, 16]);
        let mm = b.op(
            &format!("mm{i}"),
            "aten.mm.default",
            vec![n(h), n(t)],
            &[4, 16],
        );
        h = b.op(
            &format!("act{i}"),
            "aten.gelu.default",
            vec![n(mm)],
            &[4, 16],
        );
    }
    b.output(vec![n(h)])
}

fn hand_built() -> Vec<Graph> {
    vec![
        mlp(),
        split_views(),
        moe(),
        timed_moe(),
        kwarg_and_cast(),
        odd_cast(),
        inference_escape(),
        backward(),
        deep(50, false),
        deep(50, true),
    ]
}

// ---------------------------------------------------------------------------------------------
// Producing schedules with the passes (the checker itself never calls them).

fn opts(budget: u64) -> CheckOptions {
    CheckOptions {
        budget,
        world_size: WORLD,
        ..Default::default()
    }
}

fn persistent(graphs: &[Graph]) -> BTreeSet<String> {
    graphs
        .iter()
        .flat_map(|g| &g.params)
        .filter(|p| p.persistent)
        .map(|p| p.name.clone())
        .collect()
}

fn schedule(
    g: &mut Graph,
    persistent: &BTreeSet<String>,
    scheduler: &str,
    budget: u64,
) -> (InsertReport, ScheduleReport) {
    let ins = insert(g, persistent).unwrap_or_else(|e| panic!("insert {}: {e}", g.label()));
    let s = by_name(scheduler).expect("a known scheduler");
    let sopts = ScheduleOptions {
        budget,
        world_size: WORLD,
        ..ScheduleOptions::default()
    };
    let rep = s
        .schedule(g, &sopts)
        .unwrap_or_else(|e| panic!("{scheduler} on {}: {e}", g.label()));
    (ins, rep)
}

fn scheduled(g: Graph, scheduler: &str) -> Graph {
    let mut g = g;
    let p = persistent(std::slice::from_ref(&g));
    schedule(&mut g, &p, scheduler, u64::MAX);
    g
}

/// The checker's report agrees with what insertion and the scheduler say they did.
fn agrees(c: &CheckReport, ins: &InsertReport, s: &ScheduleReport) {
    let at = &c.graph;
    assert_eq!(c.gathers, s.gathers, "{at}: gathers");
    assert_eq!(c.gathers, ins.gathered, "{at}: gathers vs insertion");
    assert_eq!(c.releases, s.releases, "{at}: releases");
    assert_eq!(c.reductions, s.reductions, "{at}: reductions");
    assert_eq!(c.reductions, ins.reduced, "{at}: reductions vs insertion");
    assert_eq!(c.buckets, s.buckets, "{at}: buckets");
    assert_eq!(
        c.reduce_buckets, s.reduce_buckets,
        "{at}: reduction buckets"
    );
    assert_eq!(
        c.peak_gathered, s.peak_gathered,
        "{at}: peak gathered bytes"
    );
    let mut escaped = ins.escaped.clone();
    escaped.sort();
    let mut found = c.escaped.clone();
    found.sort();
    assert_eq!(found, escaped, "{at}: escaped");
}

fn accept(g: &Graph, budget: u64) -> CheckReport {
    check_graph(g, &opts(budget))
        .unwrap_or_else(|v| panic!("checker rejects `{}`:\n{v}", g.label()))
}

fn reject(g: &Graph, budget: u64) -> Violations {
    match check_graph(g, &opts(budget)) {
        Ok(r) => panic!("checker accepts a broken `{}`: {r:?}", g.label()),
        Err(v) => v,
    }
}

// ---------------------------------------------------------------------------------------------
// Accepting what the passes produce.

#[test]
fn accepts_every_scheduler_on_hand_built_graphs() {
    for name in NAMES {
        for g in hand_built() {
            let mut g = g;
            let p = persistent(std::slice::from_ref(&g));
            let (ins, s) = schedule(&mut g, &p, name, u64::MAX);
            let c = accept(&g, u64::MAX);
            agrees(&c, &ins, &s);
        }
    }
}

#[test]
fn hand_built_graphs_exercise_what_they_are_for() {
    let g = scheduled(inference_escape(), "jit");
    assert_eq!(accept(&g, u64::MAX).escaped, vec!["head.weight".to_owned()]);
    let c = accept(&scheduled(backward(), "prefetch"), u64::MAX);
    assert_eq!((c.gathers, c.releases, c.reductions), (1, 1, 2));
    assert!(accept(&scheduled(timed_moe(), "prefetch"), u64::MAX).buckets > 0);
    let c = accept(&scheduled(split_views(), "prefetch"), u64::MAX);
    assert_eq!((c.gathers, c.releases), (1, 1));
    // 15 elements padded to 16 for 8 ranks, gathered in bf16 by the fused downcast.
    let c = accept(&scheduled(odd_cast(), "jit"), u64::MAX);
    assert_eq!(c.peak_gathered, 16 * 2);
}

/// A schedule at the smallest budget any order fits is accepted at exactly that budget.
#[test]
fn accepts_prefetch_at_the_tightest_budget() {
    for g in hand_built() {
        let p = persistent(std::slice::from_ref(&g));
        let mut jit = g.clone();
        let (_, j) = schedule(&mut jit, &p, "jit", u64::MAX);
        let mut pre = g;
        let (ins, s) = schedule(&mut pre, &p, "prefetch", j.peak_gathered);
        let c = accept(&pre, j.peak_gathered);
        agrees(&c, &ins, &s);
    }
}

/// A hundred thousand nodes deep: no recursion, and linear enough for a debug build.
#[test]
fn accepts_a_deep_graph() {
    let g = scheduled(deep(25_000, false), "prefetch");
    assert!(g.len() > 100_000);
    let c = accept(&g, u64::MAX);
    assert_eq!((c.gathers, c.releases), (25_000, 25_000));
}

fn fixtures() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
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
fn accepts_every_scheduler_on_fixtures() {
    let files = fixtures();
    assert!(
        files.iter().any(|f| f.to_string_lossy().contains("edge")),
        "the edge fixtures are found"
    );
    for file in files {
        let bytes = std::fs::read(&file).expect("fixture reads");
        let program =
            zerosched_ir::import(&bytes).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let p = persistent(&program.graphs);
        for name in NAMES {
            let mut graphs = program.graphs.clone();
            let done: Vec<_> = graphs
                .iter_mut()
                .map(|g| schedule(g, &p, name, u64::MAX))
                .collect();
            let reports = check_program(&Program::bundle(graphs), &opts(u64::MAX))
                .unwrap_or_else(|v| panic!("{} under {name}:\n{v}", file.display()));
            for (c, (ins, s)) in reports.iter().zip(&done) {
                agrees(c, ins, s);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rejecting broken schedules.

/// The first node with this target and `param` keyword.
fn find(g: &Graph, target: &str, param: &str) -> NodeId {
    g.nodes()
        .find(|(_, x)| x.target == target && comm::param_name(x) == Some(param))
        .map(|(id, _)| id)
        .unwrap_or_else(|| panic!("no {target} of {param} in {}", g.label()))
}

fn named(g: &Graph, name: &str) -> NodeId {
    g.node_by_name(name)
        .unwrap_or_else(|| panic!("no node `{name}`"))
}

fn name(g: &Graph, id: NodeId) -> String {
    g.node(id).name.to_string()
}

/// Moves `node` to just before `before` in the program order.
fn move_before(g: &mut Graph, node: NodeId, before: NodeId) {
    let mut order: Vec<NodeId> = g.order().iter().copied().filter(|&x| x != node).collect();
    let at = order
        .iter()
        .position(|&x| x == before)
        .expect("anchor in order");
    order.insert(at, node);
    g.set_order(order).expect("a permutation");
}

fn move_after(g: &mut Graph, node: NodeId, after: NodeId) {
    let mut order: Vec<NodeId> = g.order().iter().copied().filter(|&x| x != node).collect();
    let at = order
        .iter()
        .position(|&x| x == after)
        .expect("anchor in order");
    order.insert(at + 1, node);
    g.set_order(order).expect("a permutation");
}

fn set_kwarg(g: &mut Graph, id: NodeId, key: &str, value: Arg<NodeId>) {
    let x = g.node(id);
    let (args, mut kwargs) = (x.args.clone(), x.kwargs.clone());
    kwargs.insert(key, value);
    g.set_args(id, args, kwargs).expect("valid references");
}

fn set_arg0(g: &mut Graph, id: NodeId, value: NodeId) {
    let x = g.node(id);
    let (mut args, kwargs) = (x.args.clone(), x.kwargs.clone());
    args[0] = n(value);
    g.set_args(id, args, kwargs).expect("valid references");
}

fn not_topological(v: &Violations) -> bool {
    v.0.iter()
        .any(|l| matches!(l.violation, Violation::NotTopological { .. }))
}

#[test]
fn rejects_a_release_moved_before_a_use() {
    let mut g = scheduled(mlp(), "jit");
    let release = find(&g, comm::RELEASE, "l1.weight");
    let mm1 = named(&g, "mm1");
    move_before(&mut g, release, mm1);
    let v = reject(&g, u64::MAX);
    let rel = name(&g, release);
    assert!(
        v.at_node(
            "mm1",
            |x| matches!(x, Violation::UseAfterRelease { release, .. } if *release == rel)
        ),
        "{v}"
    );
    // Its `after` edge to the use now points forward.
    assert!(
        v.0.iter()
            .any(|l| l.location.node.as_deref() == Some(rel.as_str())
                && l.location.field.as_deref() == Some("kwargs.after")
                && matches!(&l.violation, Violation::NotTopological { target } if target == "mm1")),
        "{v}"
    );
}

#[test]
fn rejects_an_early_release_whose_after_was_emptied() {
    let mut g = scheduled(mlp(), "prefetch");
    let release = find(&g, comm::RELEASE, "l1.weight");
    set_kwarg(&mut g, release, "after", Arg::List(vec![]));
    let mm1 = named(&g, "mm1");
    move_before(&mut g, release, mm1);
    let v = reject(&g, u64::MAX);
    assert!(!not_topological(&v), "{v}");
    assert!(
        v.at_node("mm1", |x| matches!(x, Violation::UseAfterRelease { .. })),
        "{v}"
    );
    let rel = name(&g, release);
    assert!(
        v.at_node(
            &rel,
            |x| matches!(x, Violation::ReleaseMissesUse { user, .. } if user == "mm1")
        ),
        "{v}"
    );
}

#[test]
fn rejects_an_after_list_missing_a_use_even_when_the_order_is_right() {
    let mut g = scheduled(split_views(), "jit");
    let release = find(&g, comm::RELEASE, "attn.qkv.weight");
    let q = named(&g, "q");
    set_kwarg(&mut g, release, "after", Arg::List(vec![n(q)]));
    let v = reject(&g, u64::MAX);
    let rel = name(&g, release);
    for user in ["k", "v"] {
        assert!(
            v.at_node(
                &rel,
                |x| matches!(x, Violation::ReleaseMissesUse { user: u, .. } if u == user)
            ),
            "{v}"
        );
    }
    assert_eq!(v.0.len(), 2, "{v}");
}

#[test]
fn rejects_a_double_release() {
    let mut g = scheduled(mlp(), "jit");
    let release = find(&g, comm::RELEASE, "l1.weight");
    let mut again = g.node(release).clone();
    again.name = "release_again".into();
    let again = g.add(again).expect("valid node");
    move_after(&mut g, again, release);
    let v = reject(&g, u64::MAX);
    let first = name(&g, release);
    assert!(
        v.at_node(
            "release_again",
            |x| matches!(x, Violation::DoubleRelease { first: f, .. } if *f == first)
        ),
        "{v}"
    );
    assert_eq!(v.0.len(), 1, "{v}");
}

#[test]
fn rejects_a_missing_release() {
    let mut g = scheduled(moe(), "prefetch");
    let release = find(&g, comm::RELEASE, "moe.experts.2.weight");
    g.remove(release).expect("nothing uses a release");
    let v = reject(&g, u64::MAX);
    let gather = name(&g, find(&g, comm::ALLGATHER, "moe.experts.2.weight"));
    assert!(
        v.at_node(&gather, |x| matches!(x, Violation::MissingRelease { .. })),
        "{v}"
    );
    assert_eq!(v.0.len(), 1, "{v}");
}

#[test]
fn rejects_a_release_of_what_was_not_gathered() {
    let mut g = scheduled(mlp(), "jit");
    let release = find(&g, comm::RELEASE, "l1.weight");
    let relu = named(&g, "relu");
    set_arg0(&mut g, release, relu);
    let v = reject(&g, u64::MAX);
    let rel = name(&g, release);
    assert!(
        v.at_node(&rel, |x| matches!(x, Violation::ReleaseNotGathered)),
        "{v}"
    );
}

#[test]
fn rejects_a_use_before_the_wait() {
    // The view reads the gather itself and the wait comes only after the matmul: the compute
    // stream reads a buffer whose all-gather may still be in flight.
    let mut g = scheduled(mlp(), "jit");
    let gather = find(&g, comm::ALLGATHER, "l1.weight");
    let wait = find(&g, comm::WAIT, "l1.weight");
    let mm1 = named(&g, "mm1");
    let t1 = named(&g, "t1");
    set_arg0(&mut g, t1, gather);
    move_after(&mut g, wait, mm1);
    let v = reject(&g, u64::MAX);
    assert!(!not_topological(&v), "{v}");
    assert!(
        v.at_node("mm1", |x| matches!(x, Violation::UseBeforeWait { .. })),
        "{v}"
    );
}

#[test]
fn rejects_a_wait_before_its_gather() {
    let mut g = scheduled(mlp(), "jit");
    let gather = find(&g, comm::ALLGATHER, "l2.weight");
    let wait = find(&g, comm::WAIT, "l2.weight");
    move_before(&mut g, wait, gather);
    let v = reject(&g, u64::MAX);
    let w = name(&g, wait);
    assert!(
        v.at_node(&w, |x| matches!(x, Violation::WaitBeforeGather { .. })),
        "{v}"
    );
}

#[test]
fn rejects_a_second_wait() {
    let mut g = scheduled(mlp(), "jit");
    let wait = find(&g, comm::WAIT, "l2.weight");
    let mut again = g.node(wait).clone();
    again.name = "wait_again".into();
    let again = g.add(again).expect("valid node");
    move_after(&mut g, again, wait);
    let v = reject(&g, u64::MAX);
    assert!(
        v.at_node("wait_again", |x| matches!(x, Violation::ExtraWait { .. })),
        "{v}"
    );
}

#[test]
fn rejects_compute_reading_a_shard() {
    let mut g = scheduled(mlp(), "jit");
    let (t1, w1) = (named(&g, "t1"), named(&g, "w1"));
    set_arg0(&mut g, t1, w1);
    let v = reject(&g, u64::MAX);
    assert!(
        v.at_node(
            "t1",
            |x| matches!(x, Violation::ShardRead { param, .. } if param == "l1.weight")
        ),
        "{v}"
    );

    // Through a keyword argument too (docs/design.md §4, mode 4).
    let mut g = scheduled(kwarg_and_cast(), "prefetch");
    let attn = named(&g, "attn");
    let mask = named(&g, "mask");
    set_kwarg(&mut g, attn, "attn_mask", n(mask));
    let v = reject(&g, u64::MAX);
    assert!(
        v.at_node("attn", |x| matches!(x, Violation::ShardRead { .. })),
        "{v}"
    );
}

#[test]
fn rejects_a_gather_of_the_wrong_parameter() {
    let mut g = scheduled(mlp(), "jit");
    let gather = find(&g, comm::ALLGATHER, "l1.weight");
    set_kwarg(&mut g, gather, "param", Arg::Str("l2.weight".into()));
    let v = reject(&g, u64::MAX);
    let at = name(&g, gather);
    assert!(
        v.at_node(&at, |x| matches!(x, Violation::ParamMismatch { .. })),
        "{v}"
    );

    let mut g = scheduled(mlp(), "jit");
    let gather = find(&g, comm::ALLGATHER, "l1.weight");
    let x = named(&g, "x");
    set_arg0(&mut g, gather, x);
    let v = reject(&g, u64::MAX);
    let at = name(&g, gather);
    assert!(
        v.at_node(&at, |x| matches!(x, Violation::GatherNotOfParam)),
        "{v}"
    );
}

/// The MoE's first two experts' gathers in bucket 7, the second issued right after the first:
/// a valid, bucketed schedule.
fn two_experts_in_one_bucket() -> (Graph, NodeId, NodeId) {
    let mut g = scheduled(moe(), "jit");
    let a = find(&g, comm::ALLGATHER, "moe.experts.0.weight");
    let b = find(&g, comm::ALLGATHER, "moe.experts.1.weight");
    set_kwarg(&mut g, a, "bucket", Arg::Int(7));
    set_kwarg(&mut g, b, "bucket", Arg::Int(7));
    move_after(&mut g, b, a);
    assert_eq!(accept(&g, u64::MAX).buckets, 1);
    (g, a, b)
}

#[test]
fn checks_bucket_adjacency() {
    let (mut g, _, b) = two_experts_in_one_bucket();
    // With the first one's wait between them, it is not.
    let wait = find(&g, comm::WAIT, "moe.experts.0.weight");
    move_after(&mut g, b, wait);
    let v = reject(&g, u64::MAX);
    let (bn, wn) = (name(&g, b), name(&g, wait));
    assert!(
        v.at_node(&bn, |x| matches!(x, Violation::BucketNotAdjacent { bucket: 7, between, .. } if *between == wn)),
        "{v}"
    );
    assert_eq!(v.0.len(), 1, "{v}");
}

#[test]
fn checks_bucket_dtypes() {
    let (mut g, a, b) = two_experts_in_one_bucket();
    // One coalesced collective moves one dtype: a member cast to bf16 cannot join f32 ones.
    set_kwarg(&mut g, b, "dtype", Arg::Dtype(Dtype::BFloat16));
    let v = reject(&g, u64::MAX);
    let (an, bn) = (name(&g, a), name(&g, b));
    assert!(
        v.at_node(
            &bn,
            |x| matches!(x, Violation::BucketMixedDtype { bucket: 7, first, .. } if *first == an)
        ),
        "{v}"
    );
    assert_eq!(v.0.len(), 1, "{v}");
}

/// The backward graph with both gradients reduce-scattered (`l2.weight` not persistent) and
/// both reductions in bucket 4, `l2.weight`'s moved to just before `l1.weight`'s (after `gw1`,
/// the later producer): a valid, bucketed schedule. Gathers number their buckets apart, so
/// bucket 4 of the reductions has no gathers however they are numbered.
fn two_reductions_in_one_bucket(persistent_l2: bool) -> (Graph, NodeId, NodeId) {
    let mut g = backward();
    g.params[1].persistent = persistent_l2;
    let mut g = scheduled(g, "jit");
    let first = find(&g, comm::REDUCE_GRAD, "l2.weight");
    let second = find(&g, comm::REDUCE_GRAD, "l1.weight");
    move_before(&mut g, first, second);
    set_kwarg(&mut g, first, "bucket", Arg::Int(4));
    set_kwarg(&mut g, second, "bucket", Arg::Int(4));
    (g, first, second)
}

#[test]
fn accepts_adjacent_reductions_of_one_kind_in_one_bucket() {
    let (g, _, _) = two_reductions_in_one_bucket(false);
    let r = accept(&g, u64::MAX);
    assert_eq!((r.reduce_buckets, r.reductions), (1, 2));
}

#[test]
fn checks_reduction_bucket_adjacency() {
    let (mut g, first, second) = two_reductions_in_one_bucket(false);
    // Back before `gw1`: the producer of the second member stands between them.
    let gw1 = named(&g, "gw1");
    move_before(&mut g, first, gw1);
    let v = reject(&g, u64::MAX);
    let sn = name(&g, second);
    assert!(
        v.at_node(&sn, |x| matches!(x, Violation::BucketNotAdjacent { bucket: 4, between, .. } if between == "gw1")),
        "{v}"
    );
    assert_eq!(v.0.len(), 1, "{v}");
}

#[test]
fn rejects_a_reduction_bucket_mixing_reduce_scatter_and_all_reduce() {
    // `l2.weight` persistent: its gradient is all-reduced, `l1.weight`'s reduce-scattered.
    let (g, first, second) = two_reductions_in_one_bucket(true);
    let v = reject(&g, u64::MAX);
    let (f, sn) = (name(&g, first), name(&g, second));
    assert!(
        v.at_node(&sn, |x| matches!(x, Violation::BucketMixedReduction { bucket: 4, first, expected, found }
            if *first == f && expected == "an all-reduce of float32" && found == "a reduce-scatter of float32")),
        "{v}"
    );
    assert_eq!(v.0.len(), 1, "{v}");
}

#[test]
fn rejects_a_reduction_bucket_mixing_dtypes() {
    let (mut g, _, second) = two_reductions_in_one_bucket(false);
    g.meta_mut(second).val = Some(tensor(&[16, 16], Dtype::BFloat16));
    let v = reject(&g, u64::MAX);
    let sn = name(&g, second);
    assert!(
        v.at_node(
            &sn,
            |x| matches!(x, Violation::BucketMixedReduction { bucket: 4, found, .. }
            if found == "a reduce-scatter of bfloat16")
        ),
        "{v}"
    );
    assert_eq!(v.0.len(), 1, "{v}");
}

#[test]
fn rejects_one_byte_over_budget() {
    let g = scheduled(moe(), "prefetch");
    let peak = accept(&g, u64::MAX).peak_gathered;
    assert!(peak > 0);
    assert_eq!(accept(&g, peak).peak_gathered, peak);
    let v = reject(&g, peak - 1);
    assert_eq!(v.0.len(), 1, "{v}");
    let at = v.0[0].location.node.clone().expect("names a node");
    assert_eq!(CommOp::of(g.node(named(&g, &at))), Some(CommOp::AllGather));
    assert!(matches!(
        v.0[0].violation,
        Violation::OverBudget { live, budget } if live == peak && budget == peak - 1
    ));
}

#[test]
fn rejects_a_missing_reduction() {
    let mut g = scheduled(backward(), "prefetch");
    let output = g.output().expect("an output");
    let mut values = g.output_values().to_vec();
    values[1] = n(named(&g, "gw1"));
    g.set_args(output, vec![Arg::List(values)], Kwargs::new())
        .expect("valid references");
    let v = reject(&g, u64::MAX);
    assert!(
        v.0.iter().any(|l| l.location.node.as_deref() == Some("output")
            && l.location.field.as_deref() == Some("args[0][1]")
            && matches!(&l.violation, Violation::GradNotReduced { param, slot: 1 } if param == "l1.weight")),
        "{v}"
    );
}

#[test]
fn rejects_a_duplicate_reduction() {
    let mut g = scheduled(backward(), "jit");
    let reduce = find(&g, comm::REDUCE_GRAD, "l1.weight");
    let end = named(&g, "end_backward");
    let mut again = g.node(reduce).clone();
    again.name = "reduce_again".into();
    let again = g.add(again).expect("valid node");
    move_after(&mut g, again, reduce);
    let mut list = g.node(end).args[0].as_list().expect("a list").to_vec();
    list.push(n(again));
    g.set_args(end, vec![Arg::List(list)], Kwargs::new())
        .expect("valid references");
    let v = reject(&g, u64::MAX);
    assert!(
        v.at_node("reduce_again", |x| matches!(
            x,
            Violation::DuplicateReduction { .. }
        )),
        "{v}"
    );
    assert_eq!(v.0.len(), 1, "{v}");
}

#[test]
fn rejects_end_backward_before_a_reduction() {
    let mut g = scheduled(backward(), "prefetch");
    let reduce = find(&g, comm::REDUCE_GRAD, "l2.weight");
    let end = named(&g, "end_backward");
    move_before(&mut g, end, reduce);
    let v = reject(&g, u64::MAX);
    let r = name(&g, reduce);
    assert!(
        v.at_node(
            "end_backward",
            |x| matches!(x, Violation::EndBackwardBeforeReduce { reduce } if *reduce == r)
        ),
        "{v}"
    );
}

#[test]
fn rejects_a_reduction_before_its_producer() {
    let mut g = scheduled(backward(), "jit");
    let reduce = find(&g, comm::REDUCE_GRAD, "l2.weight");
    let gw2 = named(&g, "gw2");
    move_before(&mut g, reduce, gw2);
    let v = reject(&g, u64::MAX);
    let r = name(&g, reduce);
    assert!(
        v.at_node(&r, |x| matches!(x, Violation::ReduceBeforeProducer { .. })),
        "{v}"
    );
}

#[test]
fn check_program_collects_violations_of_every_graph() {
    let mut a = scheduled(mlp(), "jit");
    let mut b = scheduled(backward(), "jit");
    let ra = find(&a, comm::RELEASE, "l2.weight");
    a.remove(ra).expect("nothing uses a release");
    let rb = find(&b, comm::RELEASE, "l1.weight");
    b.remove(rb).expect("nothing uses a release");
    let v = match check_program(&Program::bundle(vec![a, b]), &opts(u64::MAX)) {
        Ok(r) => panic!("accepted: {r:?}"),
        Err(v) => v,
    };
    let graphs: BTreeSet<_> =
        v.0.iter()
            .filter_map(|l| l.location.graph.clone())
            .collect();
    assert_eq!(
        graphs,
        BTreeSet::from(["mlp_bwd".to_owned(), "mlp_fwd".to_owned()])
    );
    assert!(
        v.to_string()
            .contains("graph `mlp_fwd`, node `allgather_w2`"),
        "{v}"
    );
}

/// `z = pick(x, w)` with `aliases: [0, 1]`: `z` may live in the input's storage or the
/// parameter's, so reading `z` is a use of the gathered parameter, while `x` stays apart.
fn two_way_alias(input_first: bool) -> Graph {
    let mut b = B::new("two_way_alias", GraphKind::Forward);
    let declare = |b: &mut B, input: bool| {
        if input {
            b.input("x", &[16, 16])
        } else {
            b.param("w", "p.w", &[16, 16])
        }
    };
    let first = declare(&mut b, input_first);
    let second = declare(&mut b, !input_first);
    let (x, w) = if input_first {
        (first, second)
    } else {
        (second, first)
    };
    let z = b.op("z", "custom.pick.default", vec![n(x), n(w)], &[16, 16]);
    b.g.meta_mut(z).aliases = Some(vec![0, 1]);
    let r = b.op("r", "aten.relu.default", vec![n(x)], &[16, 16]);
    let u = b.op("u", "aten.mm.default", vec![n(r), n(z)], &[16, 16]);
    b.output(vec![n(u)])
}

#[test]
fn a_value_aliasing_two_others_keeps_them_apart() {
    for s in NAMES {
        let g = scheduled(two_way_alias(false), s);
        let c = accept(&g, u64::MAX);
        assert_eq!((c.gathers, c.releases), (1, 1));
        // The release must wait for `u`. The passes merge `z`'s two possible storages into one
        // class, so they may also wait for `r`, which reads only the input: conservative, and
        // the checker (which keeps them apart) accepts it.
        let release = find(&g, comm::RELEASE, "p.w");
        let after: Vec<String> = comm::release_after(g.node(release))
            .into_iter()
            .map(|a| name(&g, a))
            .collect();
        assert!(after.contains(&"u".to_owned()), "{after:?}");
    }
}

/// With the input declared first, `z` must still count as a use of the parameter: a class
/// chosen by the first alias source alone left the parameter looking unused and `z` reading
/// the shard.
#[test]

fn accepts_a_value_aliasing_an_input_declared_before_the_parameter() {
    for s in NAMES {
        accept(&scheduled(two_way_alias(true), s), u64::MAX);
    }
}

// ---------------------------------------------------------------------------------------------
// Keep and reuse across a training step (the `keep` pass of the standard pipeline).

const W: u64 = 64 * 64 * 4;

fn kept_step(budget: u64) -> Program {
    let mut p = common::train_step(6, 64, 1.0);
    let opts = zerosched_passes::pipeline::PipelineOptions {
        schedule: ScheduleOptions {
            budget,
            world_size: WORLD,
            ..ScheduleOptions::default()
        },
        verify: true,
        ..Default::default()
    };
    let std = zerosched_passes::pipeline::standard();
    let cx = zerosched_passes::pipeline::run(&std, &mut p, &opts).expect("pipeline");
    assert!(!cx.keep.kept.is_empty(), "the pass keeps something");
    p
}

#[test]
fn accepts_kept_and_reused_buffers_within_the_budget() {
    let p = kept_step(4 * W);
    let reports = check_program(&p, &opts(4 * W)).unwrap_or_else(|v| panic!("{v}"));
    let (f, b) = (&reports[0], &reports[1]);
    assert!(f.keeps > 0);
    assert_eq!(f.keeps, b.reuses);
    assert_eq!(f.gathers, 6);
    assert_eq!(b.gathers + b.reuses, 6);
    assert_eq!(b.releases, 6);
    // Kept buffers count to the forward's end and from the backward's start.
    let peak = f.peak_gathered.max(b.peak_gathered);
    let v = match check_program(&p, &opts(peak - 1)) {
        Ok(r) => panic!("accepted over budget: {r:?}"),
        Err(v) => v,
    };
    assert!(
        v.0.iter()
            .all(|l| matches!(l.violation, Violation::OverBudget { .. })),
        "{v}"
    );
}

#[test]
fn rejects_a_reuse_without_a_keep_and_a_keep_never_reused() {
    let mut p = kept_step(W);
    let keep = find(&p.graphs[0], comm::KEEP, "layers.5.weight");
    p.graphs[0].set_target(keep, comm::RELEASE);
    let v = check_program(&p, &opts(u64::MAX)).expect_err("a reuse of nothing kept");
    let reuse = name(
        &p.graphs[1],
        find(&p.graphs[1], comm::REUSE, "layers.5.weight"),
    );
    assert!(
        v.at_node(&reuse, |x| matches!(x, Violation::ReuseWithoutKeep { .. })),
        "{v}"
    );
    // A single graph has nothing to pair with: only the program check sees it.
    check_graph(&p.graphs[1], &opts(u64::MAX)).unwrap_or_else(|v| panic!("{v}"));

    let mut p = kept_step(W);
    let reuse = find(&p.graphs[1], comm::REUSE, "layers.5.weight");
    p.graphs[1].set_target(reuse, comm::ALLGATHER);
    let v = check_program(&p, &opts(u64::MAX)).expect_err("a keep never reused");
    let keep = name(
        &p.graphs[0],
        find(&p.graphs[0], comm::KEEP, "layers.5.weight"),
    );
    let gather = name(&p.graphs[1], reuse);
    assert!(
        v.at_node(&keep, |x| matches!(x, Violation::KeptNeverReused { .. })),
        "{v}"
    );
    assert!(
        v.at_node(&gather, |x| matches!(
            x,
            Violation::GatheredWhileKept { .. }
        )),
        "{v}"
    );
}

#[test]
fn rejects_a_reuse_in_a_bucket() {
    let mut p = kept_step(4 * W);
    let reuse = find(&p.graphs[1], comm::REUSE, "layers.5.weight");
    let g = &mut p.graphs[1];
    let (args, mut kwargs) = (g.node(reuse).args.clone(), g.node(reuse).kwargs.clone());
    kwargs.insert("bucket", zerosched_ir::Arg::Int(3));
    g.set_args(reuse, args, kwargs).expect("keywords only");
    let v = check_program(&p, &opts(u64::MAX)).expect_err("a reuse with a bucket");
    let at = name(&p.graphs[1], reuse);
    assert!(
        v.at_node(&at, |x| matches!(x, Violation::BucketOnReuse { bucket: 3 })),
        "{v}"
    );
}
