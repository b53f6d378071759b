//! Graphs and options shared by the passes' tests, built with the IR's test graph builder.
#![allow(dead_code)]

pub use zerosched_ir::testing::{GraphBuilder as Builder, node};
use zerosched_ir::{Arg, Graph, GraphKind, NodeId};

/// `layers` linear layers `x = mm(x, w_l)`, each weight `dim x dim`, each matmul `ms` long.
pub fn mlp(layers: usize, dim: u64, ms: f64) -> Graph {
    let mut b = Builder::new("mlp", GraphKind::Forward);
    let mut x = b.input("x", &[16, dim]);
    for l in 0..layers {
        let w = b.param(&format!("layers.{l}.weight"), &[dim, dim]);
        x = b.mm(&format!("mm_{l}"), x, w, &[16, dim], ms);
    }
    b.output(&[x])
}

/// Index of a node by name in the program order.
pub fn pos(g: &Graph, name: &str) -> usize {
    g.nodes()
        .position(|(_, n)| n.name == name)
        .unwrap_or_else(|| panic!("no node {name}"))
}

pub fn names(g: &Graph) -> Vec<String> {
    g.nodes().map(|(_, n)| n.name.to_string()).collect()
}

/// Forward and backward of `layers` linear layers: the forward saves each layer's input, the
/// backward computes `dW = x^T dy` and `dx = dy W^T` from the last layer to the first.
pub fn train_step(layers: usize, dim: u64, ms: f64) -> zerosched_ir::Program {
    let mut f = Builder::new("fwd", GraphKind::Forward);
    let mut x = f.input("x", &[16, dim]);
    let mut saved = vec![x];
    let mut weights = Vec::new();
    for l in 0..layers {
        let w = f.param(&format!("layers.{l}.weight"), &[dim, dim]);
        weights.push(w);
        x = f.mm(&format!("mm_{l}"), x, w, &[16, dim], ms);
        saved.push(x);
    }
    let fwd = f.output(&saved);

    let mut b = Builder::new("bwd", GraphKind::Backward);
    let ws: Vec<NodeId> = (0..layers)
        .map(|l| b.param(&format!("layers.{l}.weight"), &[dim, dim]))
        .collect();
    let xs: Vec<NodeId> = (0..layers)
        .map(|l| b.input(&format!("saved_{l}"), &[16, dim]))
        .collect();
    let mut dy = b.input("tangents_1", &[16, dim]);
    let mut grads = vec![None; layers];
    for l in (0..layers).rev() {
        let xt = b.call(
            &format!("xt_{l}"),
            "aten.t.default",
            vec![node(xs[l])],
            &[dim, 16],
        );
        grads[l] = Some(b.mm(&format!("dw_{l}"), xt, dy, &[dim, dim], ms));
        let wt = b.call(
            &format!("wt_{l}"),
            "aten.t.default",
            vec![node(ws[l])],
            &[dim, dim],
        );
        dy = b.mm(&format!("dx_{l}"), dy, wt, &[16, dim], ms);
    }
    let outs: Vec<NodeId> = grads.into_iter().flatten().collect();
    let mut bwd = b.output(&outs);
    bwd.grads = (0..layers)
        .map(|l| zerosched_ir::Grad {
            param: format!("layers.{l}.weight"),
            output_index: l as u32,
            persistent: false,
        })
        .collect();
    zerosched_ir::Program::bundle(vec![fwd, bwd])
}

/// A router, `experts` parallel expert branches (each `t` of its weight, a matmul, a gate
/// product and an activation) and a combine that sums them: the shape of an MoE layer.
pub fn moe(experts: usize, dim: u64, ms: f64) -> Graph {
    let mut b = Builder::new("moe", GraphKind::Forward);
    let x = b.input("x", &[16, dim]);
    let wr = b.param("moe.router.weight", &[dim, dim]);
    let ws: Vec<NodeId> = (0..experts)
        .map(|e| b.param(&format!("moe.experts.{e}.weight"), &[dim, dim]))
        .collect();
    let router = b.mm("router", x, wr, &[16, dim], ms);
    let gate = b.call(
        "gate",
        "aten.softmax.int",
        vec![node(router), Arg::Int(-1)],
        &[16, dim],
    );
    let mut branches = Vec::new();
    for (e, &w) in ws.iter().enumerate() {
        let t = b.call(
            &format!("t_{e}"),
            "aten.t.default",
            vec![node(w)],
            &[dim, dim],
        );
        let h = b.mm(&format!("expert_{e}"), x, t, &[16, dim], ms);
        let gated = b.call(
            &format!("gated_{e}"),
            "aten.mul.Tensor",
            vec![node(h), node(gate)],
            &[16, dim],
        );
        let act = b.call(
            &format!("act_{e}"),
            "aten.silu.default",
            vec![node(gated)],
            &[16, dim],
        );
        branches.push(node(act));
    }
    let st = b.call(
        "stack",
        "aten.stack.default",
        vec![Arg::List(branches)],
        &[experts as u64, 16, dim],
    );
    let combine = b.call(
        "combine",
        "aten.sum.dim_IntList",
        vec![node(st), Arg::List(vec![Arg::Int(0)])],
        &[16, dim],
    );
    b.output(&[combine])
}

/// A random topological order of `g` (Kahn's algorithm, a seeded choice among the ready
/// nodes), with the output node last.
pub fn random_topological_order(g: &Graph, seed: u64) -> Vec<NodeId> {
    let mut rng = seed;
    let mut next = move || {
        rng = rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let output = g.output();
    let mut missing = vec![0usize; g.node_bound()];
    let mut ready = Vec::new();
    for &id in g.order() {
        missing[id.index()] = g.inputs(id).len();
        if missing[id.index()] == 0 && Some(id) != output {
            ready.push(id);
        }
    }
    let mut order = Vec::with_capacity(g.len());
    while !ready.is_empty() {
        let i = (next() % ready.len() as u64) as usize;
        let id = ready.swap_remove(i);
        order.push(id);
        for u in g.users(id) {
            missing[u.index()] -= 1;
            if missing[u.index()] == 0 && Some(u) != output {
                ready.push(u);
            }
        }
    }
    order.extend(output);
    assert_eq!(order.len(), g.len(), "the graph is acyclic");
    order
}

/// Every fixture file under tests/fixtures (exported graphs, bundles, edge cases), sorted.
pub fn fixture_files() -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "json") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// A fixture by file name under tests/fixtures.
pub fn fixture(name: &str) -> zerosched_ir::Program {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    zerosched_ir::import(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The world size the shared option builders use.
pub const WORLD: u32 = 8;

/// Pipeline options for `scheduler` at `budget`, with the verifier and the checker after every
/// pass.
pub fn options(scheduler: &str, budget: u64) -> zerosched_passes::pipeline::PipelineOptions {
    zerosched_passes::pipeline::PipelineOptions {
        scheduler: scheduler.to_owned(),
        schedule: zerosched_passes::schedule::ScheduleOptions {
            budget,
            world_size: WORLD,
            ..zerosched_passes::schedule::ScheduleOptions::default()
        },
        verify: true,
        ..zerosched_passes::pipeline::PipelineOptions::default()
    }
}

pub fn check_options(budget: u64) -> zerosched_passes::checker::CheckOptions {
    zerosched_passes::checker::CheckOptions {
        budget,
        world_size: WORLD,
    }
}
