//! Regression tests for the known failure modes of DeepSpeed DeepCompile's ZeRO-3 passes
//! (docs/design.md §4, modes 1 to 6), run through
//! zerosched's insertion, every scheduler and the keep pass, each output proven by the
//! independent schedule checker. Each test names the failure mode it guards against.

mod common;

use common::{
    Builder, WORLD, check_options, fixture, fixture_files, node, options, pos,
    random_topological_order,
};
use proptest::prelude::*;
use std::collections::BTreeSet;
use zerosched_ir::{
    Arg, Dim, Dtype, Graph, GraphKind, Meta, Node, NodeId, Op, Param, Program, TensorMeta, Val,
};
use zerosched_passes::checker::{CheckReport, check_graph, check_program};
use zerosched_passes::insert::insert;
use zerosched_passes::ops::{self, CommOp};
use zerosched_passes::pipeline::{self, Context, PipelineOptions};
use zerosched_passes::schedule::{NAMES, ScheduleOptions, by_name};

/// The standard pipeline (insert, schedule, keep) with the verifier and the checker after
/// every pass, then the checker once more for its reports.
fn run(p: &Program, scheduler: &str, budget: u64) -> (Program, Context, Vec<CheckReport>) {
    let mut out = p.clone();
    let cx = pipeline::run(&pipeline::standard(), &mut out, &options(scheduler, budget))
        .unwrap_or_else(|e| panic!("pipeline under {scheduler} at budget {budget}: {e}"));
    let reports = check_program(&out, &check_options(budget))
        .unwrap_or_else(|v| panic!("checker rejects {scheduler} at budget {budget}:\n{v}"));
    (out, cx, reports)
}

/// The budgets to run `scheduler` at: unlimited, and `tight` for the schedulers that honour
/// a budget (`deepcompile`, like DeepCompile, ignores it; properties.rs pins that down).
fn budgets(scheduler: &str, tight: u64) -> Vec<u64> {
    if scheduler == "deepcompile" {
        vec![u64::MAX]
    } else {
        vec![u64::MAX, tight]
    }
}

/// The inserted ops of kind `op` for parameter `param`, in program order.
fn comm(g: &Graph, op: CommOp, param: &str) -> Vec<NodeId> {
    g.nodes()
        .filter(|(_, n)| CommOp::of(n) == Some(op) && ops::param_name(n) == Some(param))
        .map(|(id, _)| id)
        .collect()
}

fn the(g: &Graph, op: CommOp, param: &str) -> NodeId {
    match comm(g, op, param)[..] {
        [one] => one,
        ref v => panic!("{}: {} {op:?} of {param}, expected one", g.label(), v.len()),
    }
}

fn at(g: &Graph, id: NodeId) -> usize {
    pos(g, &g.node(id).name)
}

fn named(g: &Graph, name: &str) -> NodeId {
    g.node_by_name(name)
        .unwrap_or_else(|| panic!("{}: no node `{name}`", g.label()))
}

/// The release of `param` comes after every node named in `uses` and names each of them in
/// its `after` list.
fn released_after(g: &Graph, param: &str, uses: &[&str]) {
    let r = the(g, CommOp::Release, param);
    let after = ops::release_after(g.node(r));
    for &u in uses {
        let id = named(g, u);
        assert!(
            at(g, r) > pos(g, u),
            "{}: release of {param} at {} before its use `{u}` at {}",
            g.label(),
            at(g, r),
            pos(g, u)
        );
        assert!(
            after.contains(&id),
            "{}: `{u}` not in the release's after",
            g.label()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Mode 1: `KeyError: wait_allgather_ds_param__arg0_1_0` (a parameter only the output uses).

/// Output slots holding a parameter's placeholder: `(slot, placeholder name)`.
fn returned_shards(g: &Graph) -> Vec<(usize, String)> {
    g.output_values()
        .iter()
        .enumerate()
        .filter_map(|(i, a)| {
            let id = *a.as_node()?;
            g.param_of(id).map(|_| (i, g.node(id).name.to_string()))
        })
        .collect()
}

/// Declares a new sharded parameter in `g` whose only consumer is the output (a tied weight
/// the forward saves for the backward), returned in a new last output slot.
fn add_output_only_param(g: &mut Graph, name: &str, placeholder: &str) {
    let shape = vec![Dim::Const(64), Dim::Const(64)];
    let n = Node {
        op: Op::Placeholder,
        meta: Box::new(Meta {
            val: Some(Val::Tensor(
                (TensorMeta::new(shape.clone(), Dtype::BFloat16)).into(),
            )),
            ..Meta::default()
        }),
        ..Node::call(placeholder, placeholder, vec![])
    };
    let id = g.add(n).expect("fresh name");
    let mut order = vec![id];
    order.extend(g.order().iter().copied());
    g.set_order(order).expect("a permutation");
    g.params.push(Param {
        name: name.to_owned(),
        node: id,
        shape,
        dtype: Dtype::BFloat16,
        persistent: false,
    });
    let out = g.output().expect("an output");
    let mut values = g.output_values().to_vec();
    values.push(Arg::Node(id));
    let kwargs = g.node(out).kwargs.clone();
    g.set_args(out, vec![Arg::List(values)], kwargs)
        .expect("valid refs");
    zerosched_ir::verify::graph(g).expect("still valid");
}

/// What mode 1 needs of every scheduled graph: no gather, wait or reuse of an output-only
/// parameter; every returned shard still returned as the shard, never a wait; and no wait
/// that nothing reads (the wait DeepCompile's last-use map had no entry for).
fn no_dangling_waits(before: &Program, after: &Program, output_only: &[&str]) {
    for (gb, ga) in before.graphs.iter().zip(&after.graphs) {
        for &p in output_only {
            for op in [
                CommOp::AllGather,
                CommOp::Wait,
                CommOp::Reuse,
                CommOp::Release,
            ] {
                assert!(comm(ga, op, p).is_empty(), "{}: {op:?} of {p}", ga.label());
            }
        }
        let values = ga.output_values();
        for (slot, name) in returned_shards(gb) {
            assert_eq!(
                values[slot],
                Arg::Node(named(ga, &name)),
                "{}: output slot {slot} passes the shard `{name}` through",
                ga.label()
            );
        }
        for (id, n) in ga.nodes() {
            if CommOp::of(n) == Some(CommOp::Wait) {
                let readers = ga.users(id).into_iter().filter(|&u| {
                    !matches!(CommOp::of(ga.node(u)), Some(CommOp::Release | CommOp::Keep))
                });
                assert!(
                    readers.count() > 0,
                    "{}: `{}` has no use",
                    ga.label(),
                    n.name
                );
            }
        }
    }
}

/// Mode 1 (`KeyError: wait_allgather_ds_param__arg0_1_0`) on the exported Qwen2-MoE step with
/// every parameter sharded (persistence threshold 0), plus a tied weight that only the
/// forward's output returns: that weight is never gathered, every returned shard passes
/// through in its slot, no wait is left unread, and every scheduler's output is proven.
#[test]
fn mode1_keyerror_wait_allgather_qwen2_moe_output_only_param_is_not_gathered() {
    let mut p = fixture("qwen2_moe.program.json");
    assert!(
        p.graphs
            .iter()
            .flat_map(|g| &g.params)
            .all(|q| !q.persistent),
        "persistence off: every parameter sharded"
    );
    add_output_only_param(&mut p.graphs[0], "lm_head.tied_weight", "primals_tied");
    let tied = ["lm_head.tied_weight"];
    for scheduler in NAMES {
        let (out, cx, reports) = run(&p, scheduler, u64::MAX);
        assert_eq!(cx.graphs[0].insert.output_only, tied.map(String::from));
        for (g, r) in p.graphs.iter().zip(&cx.graphs) {
            assert!(r.insert.unused.is_empty(), "{}", g.label());
            assert_eq!(
                r.insert.gathered + r.insert.output_only.len(),
                g.params.len(),
                "{}: every sharded parameter with a real use is gathered",
                g.label()
            );
        }
        assert!(reports.iter().all(|c| c.escaped.is_empty()));
        no_dangling_waits(&p, &out, &tied);
        // The unmodified fixture too: its forward returns many shards it also uses.
        let plain = fixture("qwen2_moe.program.json");
        let (out, _, _) = run(&plain, scheduler, u64::MAX);
        assert!(returned_shards(&plain.graphs[0]).len() > 10);
        no_dangling_waits(&plain, &out, &[]);
    }
}

/// A forward graph that uses one parameter, returns it too (saved for the backward), and
/// returns a second parameter it never uses.
fn forward_returning_params() -> Graph {
    let mut b = Builder::new("returns_params", GraphKind::Forward);
    let x = b.input("x", &[16, 64]);
    let w = b.param("layer.weight", &[64, 64]);
    let tied = b.param("tied.weight", &[64, 64]);
    let mm = b.mm("mm", x, w, &[16, 64], 1.0);
    let relu = b.call("relu", "aten.relu.default", vec![node(mm)], &[16, 64]);
    b.output(&[relu, w, tied])
}

/// Mode 1 (`KeyError: wait_allgather_ds_param__arg0_1_0`) on a hand-built forward graph that
/// returns a parameter nothing else reads: no gather for it, its shard in its output slot
/// (and the used, returned parameter's shard in its slot, not the wait), proven under every
/// scheduler.
#[test]
fn mode1_keyerror_wait_allgather_forward_returning_a_parameter() {
    let p = Program::single(forward_returning_params());
    for scheduler in NAMES {
        let (out, cx, reports) = run(&p, scheduler, u64::MAX);
        let r = &cx.graphs[0].insert;
        assert_eq!(r.output_only, vec!["tied.weight".to_owned()]);
        assert_eq!(r.gathered, 1);
        assert_eq!(reports[0].gathers, 1);
        assert_eq!(reports[0].releases, 1);
        no_dangling_waits(&p, &out, &["tied.weight"]);
        let g = &out.graphs[0];
        assert_eq!(g.output_values()[1], node(named(g, "layer_weight")));
        assert_eq!(g.output_values()[2], node(named(g, "tied_weight")));
        released_after(g, "layer.weight", &["mm"]);
    }
}

/// Mode 1 (`KeyError: wait_allgather_ds_param__arg0_1_0`), the inference side: an inference
/// graph returning a view of a parameter (one also used, one used only through the returned
/// view). The gathered value must reach the output through its wait and never be released
/// (the caller owns it); insertion and the checker both list it as escaped.
#[test]
fn mode1_keyerror_wait_allgather_inference_view_of_a_parameter_escapes() {
    let mut b = Builder::new("infer", GraphKind::Inference);
    let x = b.input("x", &[16, 64]);
    let w = b.param("head.weight", &[64, 64]);
    let e = b.param("emb.weight", &[64, 64]);
    let t = b.call("t", "aten.t.default", vec![node(w)], &[64, 64]);
    let mm = b.mm("mm", x, t, &[16, 64], 1.0);
    let flat = b.call(
        "flat",
        "aten.view.default",
        vec![node(e), Arg::List(vec![Arg::Int(4096)])],
        &[4096],
    );
    let p = Program::single(b.output(&[mm, t, flat]));
    let both = vec!["emb.weight".to_owned(), "head.weight".to_owned()];
    for scheduler in NAMES {
        let (out, cx, reports) = run(&p, scheduler, u64::MAX);
        let g = &out.graphs[0];
        let mut escaped = cx.graphs[0].insert.escaped.clone();
        escaped.sort();
        assert_eq!(escaped, both, "{scheduler}: insertion says both escape");
        let mut found = reports[0].escaped.clone();
        found.sort();
        assert_eq!(
            found, both,
            "{scheduler}: the checker lists both as escaped"
        );
        for (param, view) in [("head.weight", "t"), ("emb.weight", "flat")] {
            assert!(
                comm(g, CommOp::Release, param).is_empty(),
                "{param} released"
            );
            let wait = the(g, CommOp::Wait, param);
            let v = named(g, view);
            assert_eq!(
                g.inputs(v),
                vec![wait],
                "{scheduler}: `{view}` views the wait"
            );
            assert!(g.output_values().contains(&node(v)), "the view is returned");
            assert!(at(g, the(g, CommOp::AllGather, param)) < at(g, wait));
            assert!(at(g, wait) < at(g, v));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Mode 2: parameters used only through alias ops.

/// Three parameters used only through views: `t` → `view` → `split` → getitems; `unbind` →
/// getitems; `t` → `chunk` → getitems. Every getitem sits right after its list view (as FX
/// places them); the pieces are used far apart. `recorded` records `meta.aliases` on the
/// views, else the passes fall back to their table of aten views.
fn alias_only(recorded: bool) -> (Graph, Vec<(&'static str, Vec<String>)>) {
    let mut b = Builder::new("alias_only", GraphKind::Forward);
    let x = b.input("x", &[16, 16]);
    let wq = b.param("attn.qkv.weight", &[48, 16]);
    let wu = b.param("experts.stacked", &[3, 16, 16]);
    let wc = b.param("mlp.gate_up.weight", &[32, 16]);
    let tq = b.call("tq", "aten.t.default", vec![node(wq)], &[16, 48]);
    let vq = b.call(
        "vq",
        "aten.view.default",
        vec![node(tq), Arg::List(vec![Arg::Int(16), Arg::Int(48)])],
        &[16, 48],
    );
    let q = b.list_view(
        "split",
        "aten.split.Tensor",
        vec![node(vq), Arg::Int(16), Arg::Int(1)],
        3,
        &[16, 16],
    );
    let u = b.list_view("unbind", "aten.unbind.int", vec![node(wu)], 3, &[16, 16]);
    let tc = b.call("tc", "aten.t.default", vec![node(wc)], &[16, 32]);
    let c = b.list_view(
        "chunk",
        "aten.chunk.default",
        vec![node(tc), Arg::Int(2), Arg::Int(1)],
        2,
        &[16, 16],
    );
    if recorded {
        for id in [tq, vq].into_iter().chain(q.iter().copied()) {
            b.g.meta_mut(id).aliases = Some(vec![0]);
        }
        for id in u.iter().chain(&c).copied().chain([tc]) {
            b.g.meta_mut(id).aliases = Some(vec![0]);
        }
        for name in ["split", "unbind", "chunk"] {
            let id = b.g.node_by_name(name).expect("list view");
            b.g.meta_mut(id).aliases = Some(vec![0]);
        }
    }
    let pieces = [q[0], u[0], c[0], q[1], u[1], c[1], q[2], u[2]];
    let owner = ["q", "u", "c", "q", "u", "c", "q", "u"];
    let mut h = x;
    let mut uses: Vec<(&str, Vec<String>)> = vec![
        ("attn.qkv.weight", vec![]),
        ("experts.stacked", vec![]),
        ("mlp.gate_up.weight", vec![]),
    ];
    for (i, (&piece, &o)) in pieces.iter().zip(&owner).enumerate() {
        let mm = format!("mm_{i}");
        h = b.mm(&mm, h, piece, &[16, 16], 1.0);
        h = b.call(
            &format!("relu_{i}"),
            "aten.relu.default",
            vec![node(h)],
            &[16, 16],
        );
        let k = ["q", "u", "c"].iter().position(|&x| x == o).expect("owner");
        uses[k].1.push(mm);
    }
    (b.output(&[h]), uses)
}

/// Mode 2 (alias-only parameters released too early or never): a parameter reached only
/// through `t`, `view`, `split`/`unbind`/`chunk` and `getitem` gets exactly one release, after
/// the real use of its last getitem (not after the first getitem), depending on every real
/// use, under every scheduler, with and without recorded `meta.aliases`; checker-proven.
#[test]
fn mode2_alias_only_parameter_released_after_the_last_getitem_use() {
    for recorded in [false, true] {
        let (g, uses) = alias_only(recorded);
        let p = Program::single(g);
        for scheduler in NAMES {
            let (out, _, reports) = run(&p, scheduler, u64::MAX);
            let g = &out.graphs[0];
            assert_eq!((reports[0].gathers, reports[0].releases), (3, 3));
            for (param, mms) in &uses {
                let mms: Vec<&str> = mms.iter().map(String::as_str).collect();
                released_after(g, param, &mms);
                let after: BTreeSet<NodeId> =
                    ops::release_after(g.node(the(g, CommOp::Release, param)))
                        .into_iter()
                        .collect();
                let want: BTreeSet<NodeId> = mms.iter().map(|m| named(g, m)).collect();
                assert_eq!(
                    after, want,
                    "{scheduler}: {param}'s release waits for its real uses"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Mode 3: releases computed on one order, then the scheduler reorders parallel branches.

/// `(param, uses)` of the hand-built MoE: the router weight is used by the router, expert
/// `e`'s weight by `expert_e`.
fn moe_uses(experts: usize) -> Vec<(String, String)> {
    let mut v = vec![("moe.router.weight".to_owned(), "router".to_owned())];
    v.extend((0..experts).map(|e| (format!("moe.experts.{e}.weight"), format!("expert_{e}"))));
    v
}

/// The compute order of the expert matmuls.
fn expert_order(g: &Graph) -> Vec<String> {
    g.nodes()
        .filter(|(_, n)| n.name.starts_with("expert_"))
        .map(|(_, n)| n.name.to_string())
        .collect()
}

/// Mode 3 (last uses computed before reordering): router → K parallel expert branches →
/// combine. Whatever order each scheduler gives the branches, every expert weight's release
/// follows its own branch's use; at least one scheduler does reorder the branches, so the test
/// sees the reordering it guards against.
#[test]
fn mode3_moe_expert_branches_released_after_use_whatever_the_order() {
    let mut reordered = false;
    for (experts, skewed) in [(2, false), (4, false), (4, true), (12, false), (12, true)] {
        let mut g = common::moe(experts, 64, 1.0);
        if skewed {
            // Later experts are cheaper: a scheduler that weighs the cost to each release
            // (DeepCompile's free cost) runs them first.
            for e in 0..experts {
                let id = named(&g, &format!("expert_{e}"));
                g.meta_mut(id).device_time_ms = Some((experts - e) as f64);
            }
        }
        let original = expert_order(&g);
        for scheduler in NAMES {
            for budget in budgets(scheduler, 2 * 64 * 64 * 4) {
                let (out, _, _) = run(&Program::single(g.clone()), scheduler, budget);
                let s = &out.graphs[0];
                for (param, u) in moe_uses(experts) {
                    released_after(s, &param, &[&u]);
                }
                reordered |= expert_order(s) != original;
            }
        }
    }
    assert!(reordered, "no scheduler reordered the expert branches");
}

/// Mode 3 on the exported Qwen2-MoE steps (router, experts, shared expert): every scheduler's
/// output at every budget from the tightest up is proven by the checker, which replays the
/// final order and demands each use between its wait and its release.
#[test]
fn mode3_moe_qwen2_fixtures_releases_follow_every_branch_use() {
    for f in ["qwen2_moe.program.json", "qwen2_moe_batched.program.json"] {
        let p = fixture(f);
        let tight = tightest_budget(&p);
        for scheduler in NAMES {
            for budget in budgets(scheduler, tight) {
                let (out, _, _) = run(&p, scheduler, budget);
                for g in &out.graphs {
                    every_release_after_its_list(g);
                }
            }
        }
    }
}

/// A release follows everything its `after` list names (the checker proves more; this is the
/// direct statement of mode 3).
fn every_release_after_its_list(g: &Graph) {
    let at = g.positions();
    for (id, n) in g.nodes() {
        if CommOp::of(n) == Some(CommOp::Release) {
            for u in ops::release_after(n) {
                assert!(
                    at[u] < at[id],
                    "{}: `{}` before `{}`",
                    g.label(),
                    n.name,
                    g.node(u).name
                );
            }
        }
    }
}

/// The smallest budget every graph of `p` fits under `jit` (no order of the same compute
/// needs less).
fn tightest_budget(p: &Program) -> u64 {
    let (_, cx, _) = run(p, "jit", u64::MAX);
    cx.graphs
        .iter()
        .map(|g| g.schedule.peak_gathered)
        .max()
        .unwrap_or(0)
}

/// Reorders `g` by a random topological order.
fn shuffled(mut g: Graph, seed: u64) -> Graph {
    let order = random_topological_order(&g, seed);
    g.set_order(order).expect("a permutation");
    zerosched_ir::verify::graph(&g).expect("a topological order is valid");
    g
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Mode 3 (last uses computed before reordering), randomized: the MoE graph in a random
    /// valid topological order before insertion, and again between insertion and scheduling;
    /// every scheduler's output still releases each expert weight after its branch's use and
    /// passes the checker.
    #[test]
    fn mode3_moe_shuffled_topological_orders_still_release_after_every_use(
        experts in 2usize..=6,
        before in any::<u64>(),
        between in any::<u64>(),
        budget_layers in 1u64..=8,
    ) {
        let g = shuffled(common::moe(experts, 64, 1.0), before);
        let budget = budget_layers * 64 * 64 * 4;
        for scheduler in NAMES {
            let mut g = g.clone();
            insert(&mut g, &BTreeSet::new()).expect("insertion");
            let mut g = shuffled(g, between);
            let opts = ScheduleOptions { budget, world_size: WORLD, ..ScheduleOptions::default() };
            let s = by_name(scheduler).expect("known");
            match s.schedule(&mut g, &opts) {
                Ok(_) => {}
                Err(zerosched_passes::schedule::ScheduleError::OverBudget { needed, .. }) => {
                    prop_assert!(needed > budget);
                    continue;
                }
                Err(e) => panic!("{scheduler}: {e}"),
            }
            zerosched_ir::verify::graph(&g).expect("valid");
            let b = if *scheduler == "deepcompile" { u64::MAX } else { budget };
            check_graph(&g, &check_options(b))
                .unwrap_or_else(|v| panic!("{scheduler}:\n{v}"));
            for (param, u) in moe_uses(experts) {
                released_after(&g, &param, &[&u]);
            }
        }
    }

    /// Mode 3 on the exported Qwen2-MoE forward in random topological orders (before
    /// insertion and before scheduling): every scheduler's output is proven.
    #[test]
    fn mode3_moe_qwen2_shuffled_topological_orders_are_proven(
        before in any::<u64>(),
        between in any::<u64>(),
    ) {
        let p = fixture("qwen2_moe_fwd_0.json");
        let g = shuffled(p.graphs[0].clone(), before);
        for scheduler in NAMES {
            let mut g = g.clone();
            insert(&mut g, &BTreeSet::new()).expect("insertion");
            let mut g = shuffled(g, between);
            let opts = ScheduleOptions { world_size: WORLD, ..ScheduleOptions::default() };
            by_name(scheduler).expect("known").schedule(&mut g, &opts)
                .unwrap_or_else(|e| panic!("{scheduler}: {e}"));
            zerosched_ir::verify::graph(&g).expect("valid");
            check_graph(&g, &check_options(u64::MAX))
                .unwrap_or_else(|v| panic!("{scheduler}:\n{v}"));
            every_release_after_its_list(&g);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Mode 4: keyword-argument dependencies, deep graphs.

/// `x → mm(proj) → relu → attention(attn_mask=mask) → mm(out)`, and with `twice` a second
/// attention with the same keyword mask after it. With two uses, the mask's last use needs the
/// second weight's gather, so DeepCompile's walk takes the second weight first, through its
/// last use: a walk that forgets keywords then schedules the first attention before the mask's
/// gather (DeepSpeed 0.19.8's crash).
fn kwarg_mask(twice: bool) -> Program {
    let mut b = Builder::new("kwarg_mask", GraphKind::Forward);
    let x = b.input("x", &[16, 64]);
    let w1 = b.param("proj.weight", &[64, 64]);
    let mask = b.param("attn.mask", &[16, 16]);
    let w2 = b.param("out.weight", &[64, 64]);
    let h = b.mm("mm1", x, w1, &[16, 64], 1.0);
    let r = b.call("relu", "aten.relu.default", vec![node(h)], &[16, 64]);
    let sdpa = "aten.scaled_dot_product_attention.default";
    let attn = b.call_kw(
        "attn",
        sdpa,
        vec![node(r), node(r), node(r)],
        &[("attn_mask", node(mask))],
        &[16, 64],
    );
    let mut o = b.mm("mm2", attn, w2, &[16, 64], 1.0);
    if twice {
        o = b.call_kw(
            "attn_2",
            sdpa,
            vec![node(o), node(o), node(o)],
            &[("attn_mask", node(mask))],
            &[16, 64],
        );
    }
    Program::single(b.output(&[o]))
}

/// Mode 4 (`KeyError: wait_allgather_ds_param__...` from walks that forget kwargs): a
/// parameter passed only as `attn_mask=` (to one attention, or to two far apart) is gathered
/// and waited before every consumer, each of which reads the wait through the keyword, and
/// released after the last, under every scheduler and budget; checker-proven.
#[test]
fn mode4_kwarg_only_attn_mask_parameter_gathered_before_its_consumer() {
    for twice in [false, true] {
        let p = kwarg_mask(twice);
        let consumers: &[&str] = if twice {
            &["attn", "attn_2"]
        } else {
            &["attn"]
        };
        for scheduler in NAMES {
            for budget in budgets(scheduler, 2 * 64 * 64 * 4 + 16 * 16 * 4) {
                let (out, _, _) = run(&p, scheduler, budget);
                let g = &out.graphs[0];
                let gather = the(g, CommOp::AllGather, "attn.mask");
                let wait = the(g, CommOp::Wait, "attn.mask");
                assert!(at(g, gather) < at(g, wait));
                for &c in consumers {
                    let attn = named(g, c);
                    assert_eq!(g.node(attn).kwargs.get("attn_mask"), Some(&node(wait)));
                    assert!(
                        at(g, wait) < at(g, attn),
                        "{scheduler}: the mask's wait before `{c}`"
                    );
                }
                released_after(g, "attn.mask", consumers);
            }
        }
    }
}

/// A chain of `n` relus between two uses of one weight, a second weight in the middle.
fn long_chain(n: usize) -> Graph {
    let mut b = Builder::new("chain", GraphKind::Forward);
    let w = b.param("w", &[4, 4]);
    let mid = b.param("mid", &[4, 4]);
    let mut x = b.input("x", &[4, 4]);
    x = b.mm("mm_first", x, w, &[4, 4], 0.01);
    for i in 0..n {
        x = b.call(
            &format!("relu_{i}"),
            "aten.relu.default",
            vec![node(x)],
            &[4, 4],
        );
        if i == n / 2 {
            x = b.mm("mm_mid", x, mid, &[4, 4], 0.01);
        }
    }
    x = b.mm("mm_last", x, w, &[4, 4], 0.01);
    b.output(&[x])
}

/// Mode 4 (recursive dependency walks overflow on deep graphs): a 100,000-node chain through
/// insertion, `jit`, `prefetch` and `deepcompile`, the verifier and the checker, on a test
/// thread's default stack; the weight used at both ends is released after the last use.
#[test]
fn mode4_deep_graph_hundred_thousand_node_chain_without_stack_overflow() {
    let p = Program::single(long_chain(100_000));
    for scheduler in NAMES {
        let (out, _, reports) = run(&p, scheduler, u64::MAX);
        let g = &out.graphs[0];
        assert!(g.len() > 100_000);
        assert_eq!(reports[0].gathers, 2);
        released_after(g, "w", &["mm_first", "mm_last"]);
        released_after(g, "mid", &["mm_mid"]);
    }
}

// ---------------------------------------------------------------------------------------------
// Mode 5: scaling. Speed belongs in benches; here, that the output grows linearly.

/// Mode 5 (quadratic scheduling): a proxy without timing. `prefetch` on the common builder's
/// training step at L, 2L and 4L layers and a fixed budget: gathers, releases and reductions
/// scale exactly with L, the node count is affine in L (no per-pair ops), the peak stays
/// within the same budget, and each output is proven.
#[test]
fn mode5_scaling_prefetch_output_is_linear_in_layers() {
    let dim = 32;
    let w = dim * dim * 4;
    let budget = 3 * w;
    let mut sizes = Vec::new();
    for layers in [8, 16, 32] {
        let p = common::train_step(layers, dim, 0.5);
        let (out, cx, reports) = run(&p, "prefetch", budget);
        let gathers: usize = reports.iter().map(|r| r.gathers + r.reuses).sum();
        let releases: usize = reports.iter().map(|r| r.releases + r.keeps).sum();
        let reductions: usize = reports.iter().map(|r| r.reductions).sum();
        assert_eq!(
            (gathers, releases, reductions),
            (2 * layers, 2 * layers, layers)
        );
        assert!(cx.graphs.iter().all(|g| g.schedule.peak_gathered <= budget));
        sizes.push(out.node_count());
    }
    assert_eq!(
        sizes[2] - sizes[1],
        2 * (sizes[1] - sizes[0]),
        "nodes: {sizes:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Mode 6: ranks must agree.

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `v` as JSON with the keys of every object in a seeded random order (arrays keep theirs).
fn write_permuted(v: &serde_json::Value, seed: &mut u64, out: &mut String) {
    match v {
        serde_json::Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            for i in (1..keys.len()).rev() {
                let j = (splitmix(seed) % (i as u64 + 1)) as usize;
                keys.swap(i, j);
            }
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(k).expect("a string"));
                out.push(':');
                write_permuted(&m[k], seed, out);
            }
            out.push('}');
        }
        serde_json::Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_permuted(x, seed, out);
            }
            out.push(']');
        }
        leaf => out.push_str(&serde_json::to_string(leaf).expect("a leaf")),
    }
}

/// `p` through the pipeline without the verifier (it decides nothing), as JSON.
fn scheduled_json(mut p: Program, scheduler: &str, budget: u64) -> Vec<u8> {
    let opts = PipelineOptions {
        verify: false,
        ..options(scheduler, budget)
    };
    pipeline::run(&pipeline::standard(), &mut p, &opts).expect("the pipeline runs");
    zerosched_ir::json::export(&p)
}

/// Mode 6 (ranks reaching different schedules hang): for every fixture, every scheduler and
/// both an unlimited and the tightest budget, the scheduled program's JSON is byte-identical
/// across two runs, across inputs whose objects list their keys in another order, and across
/// the JSON and the binary form; and, at the last budget, from four threads importing and
/// scheduling at once.
#[test]
fn mode6_ranks_agree_byte_identical_schedules() {
    for file in fixture_files() {
        let bytes = std::fs::read(&file).expect("reads");
        let value: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        let mut seed = 0x5EED;
        let mut permuted = String::new();
        write_permuted(&value, &mut seed, &mut permuted);
        assert_ne!(
            permuted,
            serde_json::to_string(&value).expect("JSON"),
            "{}: some keys moved",
            file.display()
        );
        let program = zerosched_ir::import(&bytes).expect("imports");
        let from_permuted = zerosched_ir::import(permuted.as_bytes()).expect("imports");
        let binary = zerosched_ir::binary::export(&program);
        assert!(zerosched_ir::binary::has_magic(&binary));
        let from_binary = zerosched_ir::import(&binary).expect("imports");
        let tight = tightest_budget(&program);
        for scheduler in NAMES {
            let budgets = budgets(scheduler, tight);
            for &budget in &budgets {
                let what = format!("{} under {scheduler} at {budget}", file.display());
                let once = |p: &Program| scheduled_json(p.clone(), scheduler, budget);
                let base = zerosched_ir::json::export(&run(&program, scheduler, budget).0);
                assert!(base == once(&program), "{what}: rerun");
                assert!(base == once(&from_permuted), "{what}: key order");
                assert!(base == once(&from_binary), "{what}: binary");
                if budget != *budgets.last().expect("a budget") {
                    continue;
                }
                std::thread::scope(|s| {
                    let runs: Vec<_> = (0..4)
                        .map(|_| {
                            s.spawn(|| {
                                let p = zerosched_ir::import(&bytes).expect("imports");
                                scheduled_json(p, scheduler, budget)
                            })
                        })
                        .collect();
                    for r in runs {
                        assert!(r.join().expect("no panic") == base, "{what}: threads");
                    }
                });
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Every exported fixture.

/// Every fixture under tests/fixtures (llama, qwen2_moe, qwen2_moe_batched, gpt2: per-graph
/// files and bundles, and the edge cases) through the whole pipeline under every scheduler,
/// at an unlimited and at the tightest budget, verified and checker-proven after every pass;
/// the checker's counts agree with what insertion and scheduling report.
#[test]
fn every_fixture_through_every_scheduler_is_proven() {
    let files = fixture_files();
    for want in ["llama", "qwen2_moe_batched", "gpt2", "edge"] {
        assert!(
            files.iter().any(|f| f.to_string_lossy().contains(want)),
            "{want}"
        );
    }
    for file in files {
        let p = zerosched_ir::import(&std::fs::read(&file).expect("reads")).expect("imports");
        let tight = tightest_budget(&p);
        for scheduler in NAMES {
            for budget in budgets(scheduler, tight) {
                let (out, cx, reports) = run(&p, scheduler, budget);
                for ((g, r), c) in out.graphs.iter().zip(&cx.graphs).zip(&reports) {
                    let at = format!("{} {} under {scheduler}", file.display(), g.label());
                    assert_eq!(c.gathers + c.reuses, r.insert.gathered, "{at}: gathers");
                    assert_eq!(c.releases + c.keeps, r.schedule.releases, "{at}: releases");
                    assert_eq!(c.reductions, r.insert.reduced, "{at}: reductions");
                    assert!(c.peak_gathered <= budget, "{at}: peak");
                    every_release_after_its_list(g);
                }
            }
        }
    }
}
