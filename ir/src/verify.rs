//! The structural verifier: collects every problem with its place instead of stopping at the
//! first (Cranelift's verifier is the model). Importers run it; the pass manager runs it
//! between passes.

use crate::{
    Diagnostics, Form, Graph, GraphKind, Location, Node, NodeId, Op, Param, Problem, Program, Val,
};
use hashbrown::HashMap;
use rayon::prelude::*;

/// Verifies every graph of a program and that graphs agree on shared parameters.
pub fn program(p: &Program) -> Result<(), Diagnostics> {
    check_program(p, Nodes::Check)
}

/// [`program`] for a reader that has already held every node to [`node_fields`] and built
/// each graph in program order from references to earlier nodes that are not outputs: the
/// checks over whole graphs and across them, without a second walk over the nodes. Whether
/// it finds problems is all it says; the careful path then names them.
pub(crate) fn program_read_in_order(p: &Program) -> bool {
    check_program(p, Nodes::Checked).is_ok()
}

/// Whether [`check_graph`] walks the nodes, or a reader already has.
#[derive(Clone, Copy, PartialEq)]
enum Nodes {
    Check,
    Checked,
}

fn check_program(p: &Program, nodes: Nodes) -> Result<(), Diagnostics> {
    // One task per graph; problems in graph order whichever finishes first.
    let found: Vec<Diagnostics> = p
        .graphs
        .par_iter()
        .map(|g| {
            let mut d = Diagnostics::default();
            check_graph(g, nodes, &mut d);
            d
        })
        .collect();
    let mut d = Diagnostics(found.into_iter().flat_map(|d| d.0).collect());
    check_params_agree(p, &mut d);
    check_forwards(p, &mut d);
    d.into_result()
}

/// A backward graph's `forward` names an earlier forward graph of its bundle, each forward
/// paired once (AOTAutograd compiles one backward per forward). A graph written alone may
/// name a forward it does not hold.
fn check_forwards(p: &Program, d: &mut Diagnostics) {
    let mut paired: HashMap<&str, &str> = HashMap::new();
    for (gi, g) in p.graphs.iter().enumerate() {
        let Some(f) = g.forward.as_deref() else {
            continue;
        };
        let at = || Location::graph_field(g.label(), "forward");
        if g.kind != GraphKind::Backward {
            d.push(
                at(),
                Problem::ForwardOnNonBackward {
                    kind: g.kind.name().to_owned(),
                },
            );
            continue;
        }
        if p.form != Form::Bundle {
            continue;
        }
        let found = p.graphs[..gi]
            .iter()
            .any(|e| e.kind == GraphKind::Forward && e.name.as_deref() == Some(f));
        if !found {
            d.push(at(), Problem::UnknownForward { name: f.to_owned() });
        } else if let Some(other) = paired.insert(f, g.label()) {
            d.push(
                at(),
                Problem::ForwardTwice {
                    name: f.to_owned(),
                    other: other.to_owned(),
                },
            );
        }
    }
}

/// Each parameter against the first one of the same name, in program order: a program's
/// graphs must agree on its shape and dtype. Reported by name, then place.
fn check_params_agree(p: &Program, d: &mut Diagnostics) {
    // Lookups only, so the hasher's seed never reaches a message.
    let mut first: HashMap<&str, (&Graph, &Param)> = HashMap::new();
    let mut mismatches = Vec::new();
    for (gi, g) in p.graphs.iter().enumerate() {
        for (pi, other) in g.params.iter().enumerate() {
            let (g0, f) = *first.entry(other.name.as_str()).or_insert((g, other));
            if other.shape != f.shape || other.dtype != f.dtype {
                mismatches.push((other.name.as_str(), gi, pi, g, other, g0, f));
            }
        }
    }
    mismatches.sort_unstable_by_key(|&(name, gi, pi, ..)| (name, gi, pi));
    for (name, _, pi, g, other, g0, f) in mismatches {
        d.push(
            Location::graph_field(g.label(), format!("params[{pi}]")),
            Problem::ParamMismatch {
                name: name.to_owned(),
                found: describe(&other.shape, other.dtype),
                expected: describe(&f.shape, f.dtype),
                graph: g0.label().to_owned(),
            },
        );
    }
}

/// Verifies one graph.
pub fn graph(g: &Graph) -> Result<(), Diagnostics> {
    let mut d = Diagnostics::default();
    check_graph(g, Nodes::Check, &mut d);
    d.into_result()
}

/// Nodes a task of the per-node checks takes: a large graph's nodes are checked in ranges at
/// once, and each range's problems join the others' in program order.
const NODES_PER_TASK: usize = 4096;

fn check_graph(g: &Graph, nodes: Nodes, d: &mut Diagnostics) {
    let label = g.label();
    let mut forward_refs = false;
    match nodes {
        Nodes::Check => forward_refs = check_all_nodes(g, d),
        // Every node's fields are sound and its references earlier: only a second output
        // is left to find.
        Nodes::Checked => {
            if g.outputs().len() > 1 {
                d.push(
                    Location::graph(label),
                    Problem::ManyOutputs {
                        count: g.outputs().len(),
                    },
                );
            }
        }
    }
    if g.outputs().is_empty() {
        d.push(Location::graph(label), Problem::NoOutput);
    }
    if forward_refs {
        for scc in petgraph::algo::tarjan_scc(g.dag()) {
            let cyclic = scc.len() > 1 || scc.first().is_some_and(|&n| g.dag().contains_edge(n, n));
            if cyclic {
                let pos = g.positions();
                let mut members: Vec<crate::NodeId> = scc.into_iter().map(Into::into).collect();
                members.sort_unstable_by_key(|&n| pos[n]);
                for m in members {
                    d.push(Location::node(label, &g.node(m).name), Problem::Cycle);
                }
            }
        }
    }
    check_params(g, d);
    let returned = g.output_values().len();
    for (i, gr) in g.grads.iter().enumerate() {
        if gr.output_index as usize >= returned {
            d.push(
                Location::graph_field(label, format!("grads[{i}].output_index")),
                Problem::GradOutOfRange {
                    index: i64::from(gr.output_index),
                    len: returned,
                },
            );
        }
    }
}

/// The per-node checks of every node, a large graph's in ranges at once; whether any node
/// refers to a node at or after its own position.
fn check_all_nodes(g: &Graph, d: &mut Diagnostics) -> bool {
    let pos = g.positions();
    // A reference is checked against these instead of reading the node it names.
    let mut outputs = g.outputs().to_vec();
    outputs.sort_unstable_by_key(|&o| pos[o]);
    let checked: Vec<(Diagnostics, bool)> = g
        .order()
        .par_chunks(NODES_PER_TASK)
        .enumerate()
        .map(|(task, ids)| {
            let mut found = Diagnostics::default();
            let first = task * NODES_PER_TASK;
            let forward = check_nodes(g, ids, first, &pos, &outputs, &mut found);
            (found, forward)
        })
        .collect();
    let mut forward_refs = false;
    for (found, forward) in checked {
        d.0.extend(found.0);
        forward_refs |= forward;
    }
    forward_refs
}

/// The per-node checks of `ids`, the nodes at program positions from `first` on; whether any
/// refers to a node at or after its own position.
fn check_nodes(
    g: &Graph,
    ids: &[NodeId],
    first: usize,
    pos: &crate::SideTable<usize>,
    outputs: &[NodeId],
    d: &mut Diagnostics,
) -> bool {
    let label = g.label();
    let mut forward_refs = false;
    let mut refs: Vec<NodeId> = Vec::new();
    let mut sound = SoundTensors::default();
    for (k, &id) in ids.iter().enumerate() {
        let here = first + k;
        let n = g.node(id);
        if n.op == Op::Output {
            // The second output and every one after it.
            let count = outputs.iter().position(|&o| o == id).map_or(0, |i| i + 1);
            if count > 1 {
                d.push(
                    Location::node(label, &n.name),
                    Problem::ManyOutputs { count },
                );
            }
        }
        node_fields(label, n, &mut sound, d);
        for (fi, a) in n.args.iter().chain(n.kwargs.values()).enumerate() {
            refs.clear();
            a.for_each_ref(&mut |r| refs.push(*r));
            for &r in &refs {
                let later = pos[r] >= here;
                if outputs.contains(&r) {
                    d.push(
                        Location::field(label, &n.name, field_of(n, fi)),
                        Problem::RefToOutput {
                            target: g.node(r).name.to_string(),
                        },
                    );
                }
                if later {
                    forward_refs = true;
                    d.push(
                        Location::field(label, &n.name, field_of(n, fi)),
                        Problem::LaterRef {
                            target: g.node(r).name.to_string(),
                        },
                    );
                }
            }
        }
        debug_assert_eq!(pos[id], here);
    }
    forward_refs
}

/// Tensors already found sound: nodes share them, so each is checked once.
pub(crate) type SoundTensors = hashbrown::HashSet<*const crate::TensorMeta>;

/// The checks of one node that need nothing but the node: how deeply its arguments nest, its
/// value's sizes, and the argument indexes its metadata names. `sound` holds the shared
/// tensors already checked, here or by an earlier call.
pub(crate) fn node_fields(label: &str, n: &Node, sound: &mut SoundTensors, d: &mut Diagnostics) {
    arg_depths(label, n, d);
    if let Some(v) = &n.meta.val {
        let shared = match v {
            Val::Tensor(t) => Some(std::sync::Arc::as_ptr(t)),
            _ => None,
        };
        if shared.is_none_or(|t| !sound.contains(&t)) {
            let before = d.0.len();
            val_sizes(label, n, v, d);
            if let Some(t) = shared.filter(|_| d.0.len() == before) {
                sound.insert(t);
            }
        }
    }
    meta_indexes(label, n, d);
}

/// [`node_fields`] for a reader that takes every tensor from a table it has already held to
/// [`tensor_is_sound`]: of the value, only a tuple's total size is left to check.
pub(crate) fn node_fields_tabled(label: &str, n: &Node, d: &mut Diagnostics) {
    arg_depths(label, n, d);
    if let Some(v @ Val::Tuple(_)) = &n.meta.val {
        val_sizes(label, n, v, d);
    }
    meta_indexes(label, n, d);
}

/// Whether a tensor's sizes are all sound: no negative hint, a byte size within `u64`.
pub(crate) fn tensor_is_sound(t: &crate::TensorMeta) -> bool {
    let mut sound = t.nbytes().is_some();
    tensor_dims(&String::new, t, &mut |_, _| sound = false);
    sound
}

fn arg_depths(label: &str, n: &Node, d: &mut Diagnostics) {
    for (fi, a) in n.args.iter().chain(n.kwargs.values()).enumerate() {
        // A lone reference or scalar, the usual argument, is as shallow as can be.
        if matches!(a, crate::Arg::List(_) | crate::Arg::Slice(_)) {
            let depth = a.depth();
            if depth > crate::arg::MAX_DEPTH {
                d.push(
                    Location::field(label, &n.name, field_of(n, fi)),
                    Problem::BadValue {
                        message: format!(
                            "ARG nested {depth} levels deep; at most {} are allowed",
                            crate::arg::MAX_DEPTH
                        ),
                    },
                );
            }
        }
    }
}

fn val_sizes(label: &str, n: &Node, v: &Val, d: &mut Diagnostics) {
    check_dims(v, &mut |f, p| {
        d.push(Location::field(label, &n.name, format!("meta.val{f}")), p)
    });
    if v.nbytes().is_none() {
        d.push(
            Location::field(label, &n.name, "meta.val"),
            Problem::SizeOverflow,
        );
    }
}

fn meta_indexes(label: &str, n: &Node, d: &mut Diagnostics) {
    for (field, idx) in [
        ("meta.aliases", &n.meta.aliases),
        ("meta.mutates", &n.meta.mutates),
    ] {
        for &i in idx.iter().flatten() {
            if i as usize >= n.args.len() {
                d.push(
                    Location::field(label, &n.name, field),
                    Problem::MetaIndexOutOfRange {
                        index: i64::from(i),
                        len: n.args.len(),
                    },
                );
            }
        }
    }
}

/// The name of argument `i` of `n`, counting `args` then `kwargs` in key order. Built only
/// for a diagnostic: the checks run for every argument.
fn field_of(n: &Node, i: usize) -> String {
    match i.checked_sub(n.args.len()) {
        None => format!("args[{i}]"),
        Some(k) => format!(
            "kwargs.{}",
            n.kwargs.keys().nth(k).map_or("", |k| k.as_str())
        ),
    }
}

fn check_params(g: &Graph, d: &mut Diagnostics) {
    let label = g.label();
    let mut by_name: HashMap<&str, usize> = HashMap::new();
    let mut by_node: HashMap<NodeId, &str> = HashMap::new();
    for (i, p) in g.params.iter().enumerate() {
        let at = || Location::graph_field(label, format!("params[{i}]"));
        if by_name.insert(&p.name, i).is_some() {
            d.push(
                at(),
                Problem::DuplicateParam {
                    name: p.name.clone(),
                },
            );
        }
        if p.nbytes().is_none() {
            d.push(at(), Problem::SizeOverflow);
        }
        for (j, dim) in p.shape.iter().enumerate() {
            if let Some(problem) = negative_hint(dim) {
                d.push(
                    Location::graph_field(label, format!("params[{i}].shape[{j}]")),
                    problem,
                );
            }
        }
        let Some(node) = g.get(p.node) else {
            d.push(
                at(),
                Problem::DanglingRef {
                    index: p.node.index(),
                },
            );
            continue;
        };
        if node.op != Op::Placeholder {
            d.push(
                at(),
                Problem::ParamNotPlaceholder {
                    node: node.name.to_string(),
                },
            );
        }
        if let Some(other) = by_node.insert(p.node, &p.name) {
            d.push(
                at(),
                Problem::ParamTwice {
                    other: other.to_owned(),
                },
            );
        }
        if let Some(Val::Tensor(t)) = &node.meta.val {
            let same = t.dtype == p.dtype
                && t.shape.len() == p.shape.len()
                && t.shape
                    .iter()
                    .zip(&p.shape)
                    .all(|(a, b)| a.hint() == b.hint());
            if !same {
                d.push(
                    at(),
                    Problem::ParamValMismatch {
                        declared: describe(&p.shape, p.dtype),
                        val: describe(&t.shape, t.dtype),
                    },
                );
            }
        }
    }
}

/// A size with a negative hint: the JSON importer refuses them while reading; this catches
/// them from the binary form and from passes.
fn negative_hint(dim: &crate::Dim) -> Option<Problem> {
    match dim {
        crate::Dim::Sym(s) if s.hint < 0 => Some(Problem::BadShape {
            value: format!("{{\"sym\":{:?},\"hint\":{}}}", s.expr, s.hint),
        }),
        _ => None,
    }
}

/// Every shape, stride and offset entry of a value, reported at its path under `meta.val`.
/// Paths are built only for a diagnostic: this runs for every node.
fn check_dims(v: &Val, report: &mut impl FnMut(String, Problem)) {
    match v {
        Val::Tensor(t) => tensor_dims(&String::new, t, report),
        Val::Tuple(items) => {
            for (i, t) in items.iter().enumerate() {
                if let Some(t) = t {
                    tensor_dims(&|| format!("[{i}]"), t, report);
                }
            }
        }
        _ => {}
    }
}

/// [`check_dims`] of one tensor, whose path under `meta.val` is `at()`.
fn tensor_dims(
    at: &dyn Fn() -> String,
    t: &crate::TensorMeta,
    report: &mut dyn FnMut(String, Problem),
) {
    for (j, dim) in t.shape.iter().enumerate() {
        if let Some(p) = negative_hint(dim) {
            report(format!("{}.shape[{j}]", at()), p);
        }
    }
    for (j, dim) in t.stride.iter().flatten().enumerate() {
        if let Some(p) = negative_hint(dim) {
            report(format!("{}.stride[{j}]", at()), p);
        }
    }
    if let Some(p) = t.storage_offset.as_ref().and_then(negative_hint) {
        report(format!("{}.storage_offset", at()), p);
    }
}

fn describe(shape: &[crate::Dim], dtype: crate::Dtype) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.hint().to_string()).collect();
    format!("[{}] {dtype}", dims.join(", "))
}
