//! Generators of valid programs that look like ZeRO-3 training steps, for property tests here
//! and in the passes crate (cargo feature `testing`).
//!
//! ```ignore
//! use proptest::prelude::*;
//! use zerosched_ir::testing::{self, Config};
//!
//! proptest! {
//!     #[test]
//!     fn my_pass_keeps_graphs_valid(p in testing::program(&Config::default())) {
//!         zerosched_ir::verify::program(&p).unwrap();
//!     }
//! }
//! ```
//!
//! Every strategy produces documents that [`crate::verify::program`] accepts. They are built
//! from a recipe of *blocks*, each a pattern that the ZeRO-3 passes must get right:
//!
//! - a parameter used directly, or only through an alias chain (`aten.t.default`,
//!   `aten.view.default`, `aten.split.Tensor` + `operator.getitem` with every chunk used), with
//!   `meta.aliases` recorded or absent, feeding a matmul;
//! - a parameter reached only through a keyword argument;
//! - MoE fan-out: one router value feeding K parallel expert branches that rejoin;
//! - multi-output ops (`meta.val` a list with `null` slots) whose `getitem`s are partly unused;
//! - in-place ops (`meta.mutates`), nodes with no users, `get_attr` constants;
//! - a parameter whose only consumer is the graph output;
//! - literal arguments of every ARG kind (non-finite floats, slices, dtypes, devices, layouts,
//!   memory formats, symbolic ints, reprs, nested lists).
//!
//! Placeholders come first in program order, as in FX, so node indices differ from program
//! positions. Backward graphs carry a `grads` map; bundles hold forward graphs (graph breaks,
//! sometimes sharing a tied parameter) followed by one backward graph.
//!
//! [`chain`] and [`llama_like`] build large deterministic programs for stress tests and
//! benchmarks; [`GraphBuilder`] builds hand-written graphs node by node.

use crate::{
    Arg, Dim, Dtype, Grad, Graph, GraphKind, Kwargs, Meta, Node, NodeId, Op, Param, Program, Str,
    SymInt, TensorMeta, Val,
};
use proptest::collection::vec;

mod builder;
pub use builder::{GraphBuilder, node};
use proptest::prelude::*;

/// Size limits and switches for the generators.
#[derive(Clone, Debug)]
pub struct Config {
    /// Blocks per graph: 1 to this many.
    pub max_blocks: usize,
    /// Experts per MoE block: 2 to this many (MoE blocks are off below 2).
    pub max_experts: usize,
    /// Forward graphs in a bundle (graph breaks): 1 to this many.
    pub max_forward_graphs: usize,
    /// Literal arguments of every ARG kind (non-finite floats, odd strings), plus values that
    /// JSON cannot spell and the exporter drops (a NaN `device_time_ms`, a NaN float
    /// `meta.val`). Off ([`Config::plain`]), a program survives a JSON round trip unchanged.
    pub exotic: bool,
    /// Symbolic batch sizes (`{"sym": "s0", "hint": ..}`).
    pub symbolic: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            max_blocks: 6,
            max_experts: 4,
            max_forward_graphs: 2,
            exotic: true,
            symbolic: true,
        }
    }
}

impl Config {
    /// Small graphs: quick cases for expensive properties.
    pub fn small() -> Config {
        Config {
            max_blocks: 3,
            max_experts: 3,
            max_forward_graphs: 2,
            ..Config::default()
        }
    }

    /// Only the ZeRO-3 structure: plain names, no literal-argument noise.
    pub fn plain(self) -> Config {
        Config {
            exotic: false,
            ..self
        }
    }
}

/// One forward graph (`Form::Graph` when wrapped by [`Program::single`]).
pub fn graph(cfg: &Config) -> BoxedStrategy<Graph> {
    (shape_strategy(cfg), graph_recipe(cfg), any::<u8>())
        .prop_map(|(shape, recipe, kind)| {
            let kind = match kind % 8 {
                0 => GraphKind::Inference,
                1 => GraphKind::Joint,
                _ => GraphKind::Forward,
            };
            let mut params = Vec::new();
            build_forward(&shape, &recipe, kind, 0, &mut params)
        })
        .boxed()
}

/// A backward graph with a `grads` map, for a forward graph's parameters.
pub fn backward_graph(cfg: &Config) -> BoxedStrategy<Graph> {
    (shape_strategy(cfg), graph_recipe(cfg), any::<u64>())
        .prop_map(|(shape, recipe, seed)| {
            let mut params = Vec::new();
            let _ = build_forward(&shape, &recipe, GraphKind::Forward, 0, &mut params);
            build_backward(&shape, &params, seed, false)
        })
        .boxed()
}

/// A training step: forward graphs (graph breaks, sometimes with a tied parameter shared
/// between them) then one backward graph with gradients, as an `fx-program` bundle.
pub fn training_step(cfg: &Config) -> BoxedStrategy<Program> {
    let forwards = vec(graph_recipe(cfg), 1..=cfg.max_forward_graphs.max(1));
    (shape_strategy(cfg), forwards, any::<u64>(), any::<bool>())
        .prop_map(|(shape, recipes, seed, tie)| {
            let mut params: Vec<Param> = Vec::new();
            let mut graphs = Vec::new();
            for (gi, r) in recipes.iter().enumerate() {
                let mut r = r.clone();
                if tie && gi > 0 {
                    let square = vec![Dim::Const(shape.hidden); 2];
                    r.tied = params
                        .iter()
                        .find(|p| p.shape == square)
                        .map(|p| p.name.clone());
                }
                let mut mine = Vec::new();
                let mut g = build_forward(&shape, &r, GraphKind::Forward, gi, &mut mine);
                g.name = Some(format!("fwd_{gi}"));
                for p in mine {
                    if !params.iter().any(|q| q.name == p.name) {
                        params.push(p);
                    }
                }
                graphs.push(g);
            }
            let mut bwd = build_backward(&shape, &params, seed, false);
            bwd.name = Some("bwd_0".into());
            graphs.push(bwd);
            Program::bundle(graphs)
        })
        .boxed()
}

/// Any program: a single forward graph, a single backward graph, or a training-step bundle.
pub fn program(cfg: &Config) -> BoxedStrategy<Program> {
    let shapes = prop_oneof![
        2 => graph(cfg).prop_map(Program::single),
        1 => backward_graph(cfg).prop_map(Program::single),
        3 => training_step(cfg),
    ];
    (
        shapes,
        vec(any::<prop::sample::Index>(), 0..3),
        any::<bool>(),
    )
        .prop_map(|(mut p, picks, stray)| {
            // The program-level list: a few of its parameters (by name, whether a graph
            // carries the parameter or only its gradient), and sometimes one no graph has.
            let names: Vec<&String> = p
                .graphs
                .iter()
                .flat_map(|g| {
                    let params = g.params.iter().map(|q| &q.name);
                    params.chain(g.grads.iter().map(|q| &q.param))
                })
                .collect();
            let listed: Vec<String> = if names.is_empty() {
                Vec::new()
            } else {
                picks.iter().map(|i| i.get(&names).to_string()).collect()
            };
            p.persistent_list.extend(listed);
            if stray {
                p.persistent_list.insert("not.in.any.graph".to_owned());
            }
            p
        })
        .boxed()
}

/// A literal ARG of any kind, without node references, nested up to `depth` lists deep.
pub fn literal_arg(depth: u32) -> BoxedStrategy<Arg<NodeId>> {
    let leaf = prop_oneof![
        Just(Arg::None),
        any::<bool>().prop_map(Arg::Bool),
        any::<i64>().prop_map(Arg::Int),
        float().prop_map(Arg::Float),
        text().prop_map(Arg::Str),
        dtype().prop_map(Arg::Dtype),
        prop_oneof![
            Just("cpu".to_owned()),
            (0u8..8).prop_map(|i| format!("cuda:{i}"))
        ]
        .prop_map(Arg::Device),
        prop_oneof![Just("strided"), Just("sparse_coo")].prop_map(|s| Arg::Layout(s.into())),
        prop_oneof![Just("contiguous_format"), Just("channels_last")]
            .prop_map(|s| Arg::MemoryFormat(s.into())),
        (text(), any::<i64>()).prop_map(|(expr, hint)| Arg::Sym(SymInt {
            expr: expr.into(),
            hint,
        })),
        text().prop_map(Arg::Repr),
    ];
    leaf.prop_recursive(depth, 24, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Arg::List),
            (inner.clone(), inner.clone(), inner)
                .prop_map(|(a, b, c)| Arg::Slice(Box::new([a, b, c]))),
        ]
    })
    .boxed()
}

/// A straight chain of `n` unary ops on one parameter: deep, never wide.
pub fn chain(n: usize) -> Program {
    let mut g = Graph::new(Some("chain".into()), GraphKind::Forward);
    let shape = vec![Dim::Const(8), Dim::Const(8)];
    let t = || {
        Some(Val::Tensor(
            TensorMeta::new(shape.clone(), Dtype::Float32).into(),
        ))
    };
    let p = g
        .push(Node {
            meta: Box::new(Meta {
                val: t(),
                ..Meta::default()
            }),
            ..placeholder("primals_1")
        })
        .expect("fresh name");
    g.params.push(Param {
        name: "w".into(),
        node: p,
        shape: shape.clone(),
        dtype: Dtype::Float32,
        persistent: false,
    });
    let mut x = p;
    for i in 0..n {
        let mut node = Node::call(format!("relu_{i}"), "aten.relu.default", vec![Arg::Node(x)]);
        node.meta.val = t();
        x = g.push(node).expect("fresh name");
    }
    push_output(&mut g, vec![Arg::Node(x)]);
    Program::single(g)
}

/// A deterministic Llama-shaped training step: `layers` decoder layers (attention q/k/v/o and
/// a gated MLP, each weight used through `aten.t.default`) in a forward graph, and a backward
/// graph producing every weight's gradient. About 40 nodes per layer per graph.
pub fn llama_like(layers: usize) -> Program {
    let shape = Shape {
        batch: Dim::Sym(SymInt {
            expr: "s0".into(),
            hint: 4096,
        }),
        hidden: 8192,
        dtype: Dtype::BFloat16,
    };
    let linear = |record: bool| {
        Block::Linear(LinearSpec {
            via: Via::T,
            record_aliases: record,
            persistent: false,
            time: Some(0.081),
        })
    };
    let mut blocks = Vec::new();
    for l in 0..layers {
        blocks.push(Block::Literals(vec![
            Arg::Float(1e-5),
            Arg::Dtype(Dtype::Float32),
        ]));
        for _ in 0..4 {
            blocks.push(linear(l % 2 == 0));
        }
        blocks.push(Block::MultiOut {
            none_slot: false,
            use_second: true,
        });
        for _ in 0..3 {
            blocks.push(linear(true));
        }
        blocks.push(Block::InPlace);
    }
    let recipe = GraphRecipe {
        blocks,
        tied: None,
        return_input: false,
    };
    let mut params = Vec::new();
    let mut fwd = build_forward(&shape, &recipe, GraphKind::Forward, 0, &mut params);
    fwd.name = Some("llama_fwd_0".into());
    let mut bwd = build_backward(&shape, &params, 0, true);
    bwd.name = Some("llama_bwd_0".into());
    Program::bundle(vec![fwd, bwd])
}

// ---------------------------------------------------------------------------------------------
// Recipes

#[derive(Clone, Debug)]
struct Shape {
    batch: Dim,
    hidden: u64,
    dtype: Dtype,
}

#[derive(Clone, Debug)]
struct GraphRecipe {
    blocks: Vec<Block>,
    /// A parameter of an earlier graph, declared and used here too (tied weights).
    tied: Option<String>,
    /// Also return the non-parameter input.
    return_input: bool,
}

#[derive(Clone, Copy, Debug)]
enum Via {
    Direct,
    T,
    ViewT,
    Split(u8),
}

#[derive(Clone, Debug)]
struct LinearSpec {
    via: Via,
    record_aliases: bool,
    persistent: bool,
    time: Option<f64>,
}

#[derive(Clone, Debug)]
enum Block {
    Linear(LinearSpec),
    /// The weight is passed only as `kwargs.weight`.
    KwargLinear {
        persistent: bool,
    },
    /// A mask placeholder passed only as `kwargs.attn_mask`.
    KwargMask,
    Moe {
        experts: u8,
        record_aliases: bool,
    },
    MultiOut {
        none_slot: bool,
        use_second: bool,
    },
    InPlace,
    /// A parameter returned by the output, optionally also used.
    ReturnParam {
        also_used: bool,
    },
    /// A node nobody uses.
    Dead,
    GetAttr,
    Literals(Vec<Arg<NodeId>>),
    /// Literal keyword arguments under arbitrary keys.
    Kwargs(Kwargs),
}

fn shape_strategy(cfg: &Config) -> BoxedStrategy<Shape> {
    let batch = if cfg.symbolic {
        prop_oneof![
            (1u64..512).prop_map(Dim::Const),
            (0i64..4096).prop_map(|hint| Dim::Sym(SymInt {
                expr: "s0".into(),
                hint
            })),
        ]
        .boxed()
    } else {
        (1u64..512).prop_map(Dim::Const).boxed()
    };
    let hidden = prop_oneof![Just(16u64), Just(64), Just(4096), Just(8192)];
    let dt = prop_oneof![
        Just(Dtype::BFloat16),
        Just(Dtype::Float32),
        Just(Dtype::Float16)
    ];
    (batch, hidden, dt)
        .prop_map(|(batch, hidden, dtype)| Shape {
            batch,
            hidden,
            dtype,
        })
        .boxed()
}

fn graph_recipe(cfg: &Config) -> BoxedStrategy<GraphRecipe> {
    (vec(block(cfg), 1..=cfg.max_blocks.max(1)), any::<bool>())
        .prop_map(|(blocks, return_input)| GraphRecipe {
            blocks,
            tied: None,
            return_input,
        })
        .boxed()
}

fn block(cfg: &Config) -> BoxedStrategy<Block> {
    let via = prop_oneof![
        Just(Via::Direct),
        Just(Via::T),
        Just(Via::ViewT),
        (2u8..=4).prop_map(Via::Split),
    ];
    // A NaN time has no JSON spelling; the exporter drops it (exotic only: it is lossy).
    let nan_time = if cfg.exotic { 1 } else { 0 };
    let time = prop_oneof![
        2 => Just(None),
        4 => (0.0f64..10.0).prop_map(Some),
        nan_time => Just(Some(f64::NAN)),
    ];
    let linear = (via, any::<bool>(), any::<u8>(), time).prop_map(|(via, record, p, time)| {
        Block::Linear(LinearSpec {
            via,
            record_aliases: record,
            persistent: p % 4 == 0,
            time,
        })
    });
    let experts = cfg.max_experts.clamp(2, 64) as u8;
    let mut choices: Vec<(u32, BoxedStrategy<Block>)> = vec![
        (6, linear.boxed()),
        (
            1,
            any::<bool>()
                .prop_map(|persistent| Block::KwargLinear { persistent })
                .boxed(),
        ),
        (1, Just(Block::KwargMask).boxed()),
        (
            1,
            (any::<bool>(), any::<bool>())
                .prop_map(|(none_slot, use_second)| Block::MultiOut {
                    none_slot,
                    use_second,
                })
                .boxed(),
        ),
        (1, Just(Block::InPlace).boxed()),
        (
            1,
            any::<bool>()
                .prop_map(|also_used| Block::ReturnParam { also_used })
                .boxed(),
        ),
        (1, Just(Block::Dead).boxed()),
        (1, Just(Block::GetAttr).boxed()),
    ];
    if cfg.max_experts >= 2 {
        choices.push((
            2,
            (2u8..=experts, any::<bool>())
                .prop_map(|(experts, record_aliases)| Block::Moe {
                    experts,
                    record_aliases,
                })
                .boxed(),
        ));
    }
    if cfg.exotic {
        choices.push((
            2,
            vec(literal_arg(3), 0..5).prop_map(Block::Literals).boxed(),
        ));
        choices.push((
            1,
            // Pairs in any order, keys possibly repeated: `Kwargs` sorts and keeps the last.
            vec((text().prop_map(Str::from), literal_arg(2)), 0..4)
                .prop_map(|pairs| Block::Kwargs(pairs.into_iter().collect()))
                .boxed(),
        ));
    }
    proptest::strategy::Union::new_weighted(choices).boxed()
}

fn float() -> impl Strategy<Value = f64> {
    prop_oneof![
        // One NaN bit pattern: JSON spells every NaN `{"float": "nan"}`.
        4 => any::<f64>().prop_map(|x| if x.is_nan() { f64::NAN } else { x }),
        1 => Just(f64::INFINITY),
        1 => Just(f64::NEG_INFINITY),
        1 => Just(f64::NAN),
        1 => Just(-0.0),
    ]
}

/// Strings that exercise escaping: ASCII, quotes, control characters, any printable Unicode.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z_][a-z0-9_.]{0,12}",
        "[\"\\\\\u{0}-\u{1f}\u{7f}]{0,4}",
        "\\PC{0,8}",
    ]
}

fn dtype() -> impl Strategy<Value = Dtype> {
    proptest::sample::select(Dtype::ALL)
}

// ---------------------------------------------------------------------------------------------
// Building graphs from recipes

struct Builder<'s> {
    g: Graph,
    shape: &'s Shape,
    placeholders: Vec<NodeId>,
    outputs: Vec<Arg<NodeId>>,
    /// Parameters declared in this graph, in declaration order.
    params: Vec<Param>,
    /// Distinguishes parameter names across the graphs of one program.
    prefix: String,
    layer: usize,
    /// Next suffix per base name, so that naming stays linear in large graphs.
    suffixes: std::collections::HashMap<String, u64>,
}

impl<'s> Builder<'s> {
    fn new(shape: &'s Shape, kind: GraphKind, prefix: String) -> Builder<'s> {
        Builder {
            g: Graph::new(None, kind),
            shape,
            placeholders: Vec::new(),
            outputs: Vec::new(),
            params: Vec::new(),
            prefix,
            layer: 0,
            suffixes: Default::default(),
        }
    }

    fn act(&self) -> TensorMeta {
        let h = Dim::Const(self.shape.hidden);
        let mut t = TensorMeta::new(vec![self.shape.batch.clone(), h], self.shape.dtype);
        t.stride = Some(vec![Dim::Const(self.shape.hidden), Dim::Const(1)]);
        t
    }

    fn tensor(&self, shape: Vec<u64>) -> TensorMeta {
        TensorMeta::new(
            shape.into_iter().map(Dim::Const).collect(),
            self.shape.dtype,
        )
    }

    fn push(&mut self, mut node: Node) -> NodeId {
        // FX's scheme: `mm`, `mm_1`, `mm_2`, ... skipping names already taken.
        let next = self.suffixes.entry(node.name.to_string()).or_insert(0);
        loop {
            let name = match *next {
                0 => node.name.clone(),
                i => format!("{}_{i}", node.name).into(),
            };
            *next += 1;
            if self.g.node_by_name(&name).is_none() {
                node.name = name;
                break;
            }
        }
        let placeholder = node.op == Op::Placeholder;
        let id = self.g.push(node).expect("builder nodes are valid");
        if placeholder {
            self.placeholders.push(id);
        }
        id
    }

    fn call(
        &mut self,
        name: &str,
        target: &str,
        args: Vec<Arg<NodeId>>,
        val: TensorMeta,
    ) -> NodeId {
        let mut n = Node::call(name, target, args);
        n.meta.val = Some(Val::Tensor(val.into()));
        self.push(n)
    }

    /// A view-like call: `meta.aliases` is `[0]` when recorded, absent otherwise.
    fn view(
        &mut self,
        name: &str,
        target: &str,
        args: Vec<Arg<NodeId>>,
        val: Val,
        record: bool,
    ) -> NodeId {
        let mut n = Node::call(name, target, args);
        n.meta.val = Some(val);
        n.meta.aliases = record.then(|| vec![0]);
        self.push(n)
    }

    fn input(&mut self, name: &str, val: TensorMeta) -> NodeId {
        let mut n = placeholder(name);
        n.meta.val = Some(Val::Tensor(val.into()));
        self.push(n)
    }

    /// Declares a parameter (or re-declares one by name, for tied weights).
    fn param(&mut self, name: Option<String>, shape: Vec<u64>, persistent: bool) -> NodeId {
        let name = name.unwrap_or_else(|| {
            self.layer += 1;
            format!("{}layers.{}.weight", self.prefix, self.layer)
        });
        let ph = format!("primals_{}", self.placeholders.len() + 1);
        let shape: Vec<Dim> = shape.into_iter().map(Dim::Const).collect();
        let mut val = TensorMeta::new(shape.clone(), self.shape.dtype);
        val.requires_grad = Some(true);
        let mut n = placeholder(&ph);
        n.meta.val = Some(Val::Tensor(val.into()));
        let id = self.push(n);
        self.params.push(Param {
            name,
            node: id,
            shape,
            dtype: self.shape.dtype,
            persistent,
        });
        id
    }

    fn finish(mut self, extra_outputs: Vec<Arg<NodeId>>) -> (Graph, Vec<Param>) {
        self.outputs.extend(extra_outputs);
        push_output(&mut self.g, vec![Arg::List(self.outputs)]);
        // FX puts every placeholder first; keep the rest in creation order.
        let rest: Vec<NodeId> = self
            .g
            .order()
            .iter()
            .copied()
            .filter(|id| !self.placeholders.contains(id))
            .collect();
        let mut order = self.placeholders.clone();
        order.extend(rest);
        self.g.set_order(order).expect("a permutation");
        self.g.params = self.params.clone();
        (self.g, self.params)
    }
}

fn placeholder(name: &str) -> Node {
    Node {
        op: Op::Placeholder,
        target: name.into(),
        ..Node::call(name, "", vec![])
    }
}

fn push_output(g: &mut Graph, args: Vec<Arg<NodeId>>) {
    let name = g.fresh_name("output");
    let node = Node {
        op: Op::Output,
        target: "output".into(),
        ..Node::call(name, "", args)
    };
    g.push(node).expect("output is valid");
}

fn build_forward(
    shape: &Shape,
    recipe: &GraphRecipe,
    kind: GraphKind,
    graph_index: usize,
    params: &mut Vec<Param>,
) -> Graph {
    let prefix = format!("model.g{graph_index}.");
    let mut b = Builder::new(shape, kind, prefix);
    let input = b.input("arg0_1", b.act());
    let h = shape.hidden;
    let mut x = input;
    if let Some(tied) = &recipe.tied {
        let w = b.param(Some(tied.clone()), vec![h, h], false);
        let act = b.act();
        x = b.call(
            "mm",
            "aten.mm.default",
            vec![Arg::Node(x), Arg::Node(w)],
            act,
        );
    }
    for blk in &recipe.blocks {
        x = build_block(&mut b, blk, x);
    }
    b.outputs.insert(0, Arg::Node(x));
    let extra = if recipe.return_input {
        vec![Arg::Node(input), Arg::None]
    } else {
        vec![]
    };
    let (g, mine) = b.finish(extra);
    params.extend(mine);
    g
}

fn build_block(b: &mut Builder, blk: &Block, x: NodeId) -> NodeId {
    let h = b.shape.hidden;
    let act = b.act();
    match blk {
        Block::Linear(spec) => {
            let w = b.param(None, vec![h, h], spec.persistent);
            let rec = spec.record_aliases;
            let t_val = |b: &Builder| {
                let mut t = b.tensor(vec![h, h]);
                t.stride = Some(vec![Dim::Const(1), Dim::Const(h)]);
                Val::Tensor(t.into())
            };
            let out = match spec.via {
                Via::Direct => b.call(
                    "mm",
                    "aten.mm.default",
                    vec![Arg::Node(x), Arg::Node(w)],
                    act,
                ),
                Via::T => {
                    let v = t_val(b);
                    let t = b.view("t", "aten.t.default", vec![Arg::Node(w)], v, rec);
                    b.call(
                        "mm",
                        "aten.mm.default",
                        vec![Arg::Node(x), Arg::Node(t)],
                        act,
                    )
                }
                Via::ViewT => {
                    let sizes = Arg::List(vec![Arg::Int(h as i64), Arg::Int(h as i64)]);
                    let v = Val::Tensor(b.tensor(vec![h, h]).into());
                    let view = b.view(
                        "view",
                        "aten.view.default",
                        vec![Arg::Node(w), sizes],
                        v,
                        rec,
                    );
                    let v = t_val(b);
                    let t = b.view("t", "aten.t.default", vec![Arg::Node(view)], v, !rec);
                    b.call(
                        "mm",
                        "aten.mm.default",
                        vec![Arg::Node(x), Arg::Node(t)],
                        act,
                    )
                }
                Via::Split(k) => {
                    let k = u64::from(k);
                    let chunk = h / k;
                    let sizes: Vec<u64> = (0..k)
                        .map(|i| {
                            if i + 1 == k {
                                h - chunk * (k - 1)
                            } else {
                                chunk
                            }
                        })
                        .collect();
                    let val = Val::Tuple(
                        sizes
                            .iter()
                            .map(|&s| Some(b.tensor(vec![s, h]).into()))
                            .collect(),
                    );
                    let split = b.view(
                        "split",
                        "aten.split.Tensor",
                        vec![Arg::Node(w), Arg::Int(chunk as i64)],
                        val,
                        rec,
                    );
                    let mut parts = Vec::new();
                    for (i, &s) in sizes.iter().enumerate() {
                        let v = Val::Tensor(b.tensor(vec![s, h]).into());
                        let gi = b.view(
                            "getitem",
                            "operator.getitem",
                            vec![Arg::Node(split), Arg::Int(i as i64)],
                            v,
                            rec,
                        );
                        let v = Val::Tensor(b.tensor(vec![h, s]).into());
                        let t = b.view("t", "aten.t.default", vec![Arg::Node(gi)], v, rec);
                        let mut part = act.clone();
                        part.shape[1] = Dim::Const(s);
                        part.stride = None;
                        let mm = b.call(
                            "mm",
                            "aten.mm.default",
                            vec![Arg::Node(x), Arg::Node(t)],
                            part,
                        );
                        parts.push(Arg::Node(mm));
                    }
                    b.call(
                        "cat",
                        "aten.cat.default",
                        vec![Arg::List(parts), Arg::Int(1)],
                        act,
                    )
                }
            };
            if let Some(t) = spec.time {
                b.g.meta_mut(out).device_time_ms = Some(t);
            }
            if rec {
                b.g.meta_mut(out).aliases = Some(vec![]);
                b.g.meta_mut(out).mutates = Some(vec![]);
            }
            out
        }
        Block::KwargLinear { persistent } => {
            let w = b.param(None, vec![h, h], *persistent);
            let mut n = Node::call("linear", "aten.linear.default", vec![Arg::Node(x)]);
            n.kwargs.insert("weight", Arg::Node(w));
            n.kwargs.insert("bias", Arg::None);
            n.meta.val = Some(Val::Tensor(act.into()));
            b.push(n)
        }
        Block::KwargMask => {
            let mask = b.input("attn_mask", b.tensor(vec![1, h]));
            let mut n = Node::call(
                "sdpa",
                "aten.scaled_dot_product_attention.default",
                vec![Arg::Node(x), Arg::Node(x), Arg::Node(x)],
            );
            n.kwargs.insert("attn_mask", Arg::Node(mask));
            n.kwargs.insert("is_causal", Arg::Bool(false));
            n.kwargs.insert("scale", Arg::Float(0.125));
            n.meta.val = Some(Val::Tensor(act.into()));
            b.push(n)
        }
        Block::Moe {
            experts,
            record_aliases,
        } => {
            let e = u64::from(*experts);
            let rw = b.param(None, vec![e, h], false);
            let mut rt = b.tensor(vec![h, e]);
            rt.stride = Some(vec![Dim::Const(1), Dim::Const(h)]);
            let rt = b.view(
                "t",
                "aten.t.default",
                vec![Arg::Node(rw)],
                Val::Tensor(rt.into()),
                *record_aliases,
            );
            let mut logits = act.clone();
            logits.shape[1] = Dim::Const(e);
            logits.stride = None;
            let router = b.call(
                "mm",
                "aten.mm.default",
                vec![Arg::Node(x), Arg::Node(rt)],
                logits.clone(),
            );
            let mut branches = Vec::new();
            for i in 0..e {
                let w = b.param(None, vec![h, h], false);
                let mut tv = b.tensor(vec![h, h]);
                tv.stride = Some(vec![Dim::Const(1), Dim::Const(h)]);
                let t = b.view(
                    "t",
                    "aten.t.default",
                    vec![Arg::Node(w)],
                    Val::Tensor(tv.into()),
                    *record_aliases,
                );
                let hmm = b.call(
                    "mm",
                    "aten.mm.default",
                    vec![Arg::Node(x), Arg::Node(t)],
                    act.clone(),
                );
                let mut gate = logits.clone();
                gate.shape[1] = Dim::Const(1);
                let gate = b.view(
                    "slice",
                    "aten.slice.Tensor",
                    vec![
                        Arg::Node(router),
                        Arg::Int(1),
                        Arg::Int(i as i64),
                        Arg::Int(i as i64 + 1),
                    ],
                    Val::Tensor(gate.into()),
                    *record_aliases,
                );
                let y = b.call(
                    "mul",
                    "aten.mul.Tensor",
                    vec![Arg::Node(hmm), Arg::Node(gate)],
                    act.clone(),
                );
                branches.push(Arg::Node(y));
            }
            let mut stacked = act.clone();
            stacked.shape.insert(0, Dim::Const(e));
            stacked.stride = None;
            let st = b.call(
                "stack",
                "aten.stack.default",
                vec![Arg::List(branches)],
                stacked,
            );
            b.call(
                "sum",
                "aten.sum.dim_IntList",
                vec![Arg::Node(st), Arg::List(vec![Arg::Int(0)])],
                act,
            )
        }
        Block::MultiOut {
            none_slot,
            use_second,
        } => {
            let mut stat = act.clone();
            stat.shape[1] = Dim::Const(1);
            stat.stride = None;
            let mut items = vec![Some(stat.clone().into()), Some(stat.clone().into())];
            if *none_slot {
                items.push(None);
            }
            let mut n = Node::call(
                "var_mean",
                "aten.var_mean.correction",
                vec![Arg::Node(x), Arg::List(vec![Arg::Int(1)])],
            );
            n.kwargs.insert("correction", Arg::Int(0));
            n.kwargs.insert("keepdim", Arg::Bool(true));
            n.meta.val = Some(Val::Tuple(items));
            n.meta.aliases = Some(vec![]);
            let vm = b.push(n);
            let g0 = b.view(
                "getitem",
                "operator.getitem",
                vec![Arg::Node(vm), Arg::Int(0)],
                Val::Tensor(stat.clone().into()),
                false,
            );
            let g1 = b.view(
                "getitem",
                "operator.getitem",
                vec![Arg::Node(vm), Arg::Int(1)],
                Val::Tensor(stat.into()),
                false,
            );
            let centered = b.call(
                "sub",
                "aten.sub.Tensor",
                vec![Arg::Node(x), Arg::Node(g1)],
                act.clone(),
            );
            if *use_second {
                b.call(
                    "mul",
                    "aten.mul.Tensor",
                    vec![Arg::Node(centered), Arg::Node(g0)],
                    act,
                )
            } else {
                centered
            }
        }
        Block::InPlace => {
            let c = b.call(
                "clone",
                "aten.clone.default",
                vec![Arg::Node(x)],
                act.clone(),
            );
            let mut n = Node::call("add_", "aten.add_.Tensor", vec![Arg::Node(c), Arg::Node(x)]);
            n.meta.val = Some(Val::Tensor(act.into()));
            n.meta.aliases = Some(vec![0]);
            n.meta.mutates = Some(vec![0]);
            b.push(n)
        }
        Block::ReturnParam { also_used } => {
            let w = b.param(None, vec![h, h], false);
            b.outputs.push(Arg::Node(w));
            if *also_used {
                b.call(
                    "mm",
                    "aten.mm.default",
                    vec![Arg::Node(x), Arg::Node(w)],
                    act,
                )
            } else {
                x
            }
        }
        Block::Dead => {
            let _ = b.call("clone", "aten.clone.default", vec![Arg::Node(x)], act);
            x
        }
        Block::GetAttr => {
            let mut n = Node {
                op: Op::GetAttr,
                target: "_tensor_constant0".into(),
                ..Node::call("_tensor_constant0", "", vec![])
            };
            n.meta.val = Some(Val::Tensor(b.tensor(vec![h]).into()));
            let c = b.push(n);
            b.call(
                "add",
                "aten.add.Tensor",
                vec![Arg::Node(x), Arg::Node(c)],
                act,
            )
        }
        Block::Literals(args) => {
            let mut all = vec![Arg::Node(x)];
            all.extend(args.iter().cloned());
            let mut n = Node::call("opaque", "custom.opaque_op.default", all);
            n.meta.val = Some(Val::Tensor(act.into()));
            b.push(n)
        }
        Block::Kwargs(kwargs) => {
            let mut n = Node::call("opaque", "custom.kwarg_op.default", vec![Arg::Node(x)]);
            n.kwargs = kwargs.clone();
            n.meta.val = Some(Val::Tensor(act.into()));
            let y = b.push(n);
            // A scalar-valued node next to it: `meta.val` as a SYM, an int or a float.
            let mut s = Node::call(
                "sym_size",
                "aten.sym_size.int",
                vec![Arg::Node(y), Arg::Int(0)],
            );
            s.meta.val = Some(match &b.shape.batch {
                Dim::Sym(sym) => Val::Sym(sym.clone()),
                Dim::Const(c) => Val::Int(*c as i64),
            });
            let _ = b.push(s);
            let mut f = Node::call(
                "item",
                "aten._local_scalar_dense.default",
                vec![Arg::Node(y)],
            );
            f.meta.val = Some(Val::Float(f64::NAN));
            let _ = b.push(f);
            y
        }
    }
}

/// A backward graph for `params` (all declared with the same `shape`): every parameter is read
/// again (ZeRO-3 re-gathers it) and most get a gradient, at shuffled output positions.
fn build_backward(shape: &Shape, params: &[Param], seed: u64, all_grads: bool) -> Graph {
    let mut b = Builder::new(shape, GraphKind::Backward, String::new());
    let mut rng = seed;
    let mut next = move || {
        // splitmix64: deterministic, good enough to shuffle.
        rng = rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let ids: Vec<NodeId> = params
        .iter()
        .map(|p| {
            let shape = p.shape.iter().map(Dim::hint).collect();
            b.param(Some(p.name.clone()), shape, p.persistent)
        })
        .collect();
    let saved = b.input("mm_saved", b.act());
    let tangent = b.input("tangents_1", b.act());
    let act = b.act();
    let mut dx = tangent;
    let mut slots: Vec<Option<(usize, NodeId)>> = Vec::new();
    for (i, (p, &w)) in params.iter().zip(&ids).enumerate() {
        let dims: Vec<u64> = p.shape.iter().map(Dim::hint).collect();
        // The input gradient reads the (re-gathered) weight.
        if dims.len() == 2 && dims[0] == shape.hidden && dims[1] == shape.hidden {
            dx = b.call(
                "mm",
                "aten.mm.default",
                vec![Arg::Node(dx), Arg::Node(w)],
                act.clone(),
            );
        }
        let mut tv = act.clone();
        tv.shape.swap(0, 1);
        tv.stride = Some(vec![Dim::Const(1), Dim::Const(shape.hidden)]);
        let tt = b.view(
            "t",
            "aten.t.default",
            vec![Arg::Node(dx)],
            Val::Tensor(tv.into()),
            next() % 2 == 0,
        );
        let gval = b.tensor(dims);
        let g = b.call(
            "mm",
            "aten.mm.default",
            vec![Arg::Node(tt), Arg::Node(saved)],
            gval,
        );
        if all_grads || next() % 5 != 0 {
            slots.push(Some((i, g)));
        }
    }
    slots.push(None);
    // Fisher-Yates with the seeded generator.
    for i in (1..slots.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        slots.swap(i, j);
    }
    let mut grads = Vec::new();
    let mut outs = Vec::new();
    for (pos, s) in slots.iter().enumerate() {
        match s {
            Some((pi, g)) => {
                grads.push(Grad {
                    param: params[*pi].name.clone(),
                    output_index: pos as u32,
                    persistent: params[*pi].persistent,
                });
                outs.push(Arg::Node(*g));
            }
            None => outs.push(Arg::None),
        }
    }
    outs.push(Arg::Node(dx));
    b.outputs = outs;
    let (mut g, _) = b.finish(vec![]);
    g.grads = grads;
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::test_runner::{Config as RunnerConfig, TestRunner};

    #[test]
    fn generated_programs_verify() {
        let mut runner = TestRunner::new(RunnerConfig::with_cases(256));
        runner
            .run(&program(&Config::default()), |p| {
                crate::verify::program(&p).map_err(|d| TestCaseError::fail(d.to_string()))?;
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn fixed_programs_verify() {
        crate::verify::program(&chain(1000)).unwrap();
        let l = llama_like(2);
        crate::verify::program(&l).unwrap();
        assert_eq!(l.graphs[1].grads.len(), l.graphs[0].params.len());
    }
}
