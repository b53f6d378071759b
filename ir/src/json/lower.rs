//! Lowering: resolve names to nodes, parse ops and values, and report every problem found.

use super::raw::{RawGraph, RawProgram, check_version};
use super::values;
use crate::{
    Arg, Diagnostics, Grad, Graph, GraphKind, ImportError, Location, Meta, Node, NodeId, Op, Param,
    Problem, Program,
};
use std::collections::HashMap;

pub(super) fn single(doc: RawGraph) -> Result<Program, ImportError> {
    let label = doc.name.clone().unwrap_or_else(|| "<unnamed>".to_owned());
    let persistent_list = doc.persistent.iter().cloned().collect();
    Ok(Program {
        persistent_list,
        ..Program::single(graph(doc, &label)?)
    })
}

pub(super) fn program(doc: RawProgram) -> Result<Program, ImportError> {
    let Some(raw_graphs) = doc.graphs else {
        let mut d = Diagnostics::default();
        d.push(
            Location {
                field: Some("graphs".into()),
                ..Location::default()
            },
            Problem::Missing,
        );
        return Err(d.into());
    };
    let mut diags = Diagnostics::default();
    let mut graphs = Vec::with_capacity(raw_graphs.len());
    for (i, g) in raw_graphs.into_iter().enumerate() {
        if let Some(f) = &g.format {
            if f.as_str() != Some("fx-graph") {
                return Err(ImportError::NotFxGraph {
                    found: format!("{f} in graphs[{i}]"),
                });
            }
        }
        if g.version.is_some() {
            check_version(g.version.as_ref())?;
        }
        let label = g.name.clone().unwrap_or_else(|| format!("graphs[{i}]"));
        match graph(g, &label) {
            Ok(g) => graphs.push(g),
            Err(d) => diags.0.extend(d.0),
        }
    }
    diags.into_result()?;
    Ok(Program {
        persistent_list: doc.persistent.into_iter().collect(),
        ..Program::bundle(graphs)
    })
}

fn graph(doc: RawGraph, label: &str) -> Result<Graph, Diagnostics> {
    let mut d = Diagnostics::default();
    let kind = match doc.kind.as_deref() {
        None => GraphKind::Forward,
        Some(k) => GraphKind::from_name(k).unwrap_or_else(|| {
            d.push(
                Location::graph_field(label, "kind"),
                Problem::UnknownKind {
                    value: k.to_owned(),
                },
            );
            GraphKind::Forward
        }),
    };
    let Some(raw_nodes) = doc.nodes else {
        d.push(Location::graph_field(label, "nodes"), Problem::Missing);
        return Err(d);
    };

    let mut index: HashMap<&str, usize> = HashMap::with_capacity(raw_nodes.len());
    for (i, n) in raw_nodes.iter().enumerate() {
        if let Some(&first) = index.get(n.name.as_str()) {
            d.push(
                Location::field(label, &n.name, "name"),
                Problem::DuplicateName { first },
            );
        } else {
            index.insert(&n.name, i);
        }
    }
    let is_output: Vec<bool> = raw_nodes.iter().map(|n| n.op == "output").collect();

    let mut nodes: Vec<Node<usize>> = Vec::with_capacity(raw_nodes.len());
    let mut later_refs: Vec<(usize, usize)> = Vec::new();
    for (i, n) in raw_nodes.iter().enumerate() {
        let at = |field: &str| Location::field(label, &n.name, field);
        let op = Op::from_name(&n.op).unwrap_or_else(|| {
            let problem = if n.op == "call_method" || n.op == "call_module" {
                Problem::UnsupportedOp { op: n.op.clone() }
            } else {
                Problem::UnknownOp { op: n.op.clone() }
            };
            d.push(at("op"), problem);
            Op::CallFunction
        });
        let target = match (&n.target, op) {
            (Some(t), _) => t.clone(),
            (None, Op::Output) => "output".to_owned(),
            (None, Op::Placeholder) => n.name.clone(),
            (None, _) => {
                d.push(at("target"), Problem::Missing);
                String::new()
            }
        };
        let mut resolver = Resolver {
            index: &index,
            is_output: &is_output,
            at: i,
            later_refs: &mut later_refs,
        };
        let mut path = String::new();
        let mut args = Vec::with_capacity(n.args.len());
        for (ai, a) in n.args.iter().enumerate() {
            path.clear();
            path.push_str(&format!("args[{ai}]"));
            args.push(resolver.arg(a, &mut path, &mut |f, p| d.push(at(f), p)));
        }
        let kwargs: crate::Kwargs<usize> = n
            .kwargs
            .iter()
            .map(|(k, a)| {
                path.clear();
                path.push_str(&format!("kwargs.{k}"));
                let a = resolver.arg(a, &mut path, &mut |f, p| d.push(at(f), p));
                (k, a)
            })
            .collect();
        let val = match n.meta.val.as_ref().map(values::val).transpose() {
            Ok(v) => v.flatten(),
            Err((f, p)) => {
                let sep = if f.is_empty() || f.starts_with('[') {
                    ""
                } else {
                    "."
                };
                d.push(at(&format!("meta.val{sep}{f}")), p);
                None
            }
        };
        let mut indexes = |field: &str, raw: &Option<Vec<i64>>| {
            raw.as_ref().map(|v| {
                v.iter()
                    .filter_map(|&x| {
                        let ok = u32::try_from(x).ok();
                        if ok.is_none() {
                            d.push(
                                at(field),
                                Problem::MetaIndexOutOfRange {
                                    index: x,
                                    len: n.args.len(),
                                },
                            );
                        }
                        ok
                    })
                    .collect()
            })
        };
        let meta = Meta {
            val,
            aliases: indexes("meta.aliases", &n.meta.aliases),
            mutates: indexes("meta.mutates", &n.meta.mutates),
            device_time_ms: n.meta.device_time_ms,
        };
        nodes.push(Node {
            name: n.name.as_str().into(),
            op,
            target: target.into(),
            args,
            kwargs,
            meta: Box::new(meta),
        });
    }
    if !later_refs.is_empty() {
        report_cycles(&nodes, &later_refs, label, &mut d);
    }

    let mut params = Vec::with_capacity(doc.params.len());
    for (pi, p) in doc.params.iter().enumerate() {
        let node = index.get(p.node.as_str()).copied();
        if node.is_none() {
            d.push(
                Location::graph_field(label, format!("params[{pi}].node")),
                Problem::UnknownRef {
                    target: p.node.clone(),
                },
            );
        }
        let shape = values::shape(&p.shape).map_err(|(f, prob)| {
            d.push(
                Location::graph_field(label, format!("params[{pi}].shape{f}")),
                prob,
            );
        });
        let dtype = values::dtype(&p.dtype).map_err(|prob| {
            d.push(
                Location::graph_field(label, format!("params[{pi}].dtype")),
                prob,
            );
        });
        if let (Some(node), Ok(shape), Ok(dtype)) = (node, shape, dtype) {
            params.push(Param {
                name: p.name.clone(),
                node,
                shape,
                dtype,
                persistent: p.persistent,
            });
        }
    }
    let mut grads = Vec::with_capacity(doc.grads.len());
    for (gi, g) in doc.grads.iter().enumerate() {
        match u32::try_from(g.output_index) {
            Ok(output_index) => grads.push(Grad {
                param: g.param.clone(),
                output_index,
                persistent: g.persistent,
            }),
            Err(_) => d.push(
                Location::graph_field(label, format!("grads[{gi}].output_index")),
                Problem::GradOutOfRange {
                    index: g.output_index,
                    len: 0,
                },
            ),
        }
    }
    if !d.is_empty() {
        return Err(d);
    }

    // No errors: every reference points at an earlier node, and node i gets index i.
    let mut g = Graph::new(doc.name, kind);
    g.forward = doc.forward;
    for n in &nodes {
        let node = n.map_refs(&mut |&p| NodeId::new(p));
        let name = node.name.clone();
        if let Err(p) = g.push(node) {
            d.push(Location::node(label, &name), p);
        }
    }
    g.params = params
        .iter()
        .map(|p| p.with_node(NodeId::new(p.node)))
        .collect();
    g.grads = grads;
    d.into_result()?;
    Ok(g)
}

/// Resolves names in one node's arguments, reporting each bad reference at its path.
struct Resolver<'a> {
    index: &'a HashMap<&'a str, usize>,
    is_output: &'a [bool],
    at: usize,
    later_refs: &'a mut Vec<(usize, usize)>,
}

impl Resolver<'_> {
    fn arg(
        &mut self,
        a: &Arg<String>,
        path: &mut String,
        report: &mut impl FnMut(&str, Problem),
    ) -> Arg<usize> {
        match a {
            Arg::Node(name) => Arg::Node(self.name(name, path, report)),
            Arg::List(items) => Arg::List(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, item)| self.nested(item, path, &format!("[{i}]"), report))
                    .collect(),
            ),
            Arg::Slice(parts) => {
                let [a, b, c] = &**parts;
                Arg::Slice(Box::new([
                    self.nested(a, path, ".slice[0]", report),
                    self.nested(b, path, ".slice[1]", report),
                    self.nested(c, path, ".slice[2]", report),
                ]))
            }
            // No references below this point.
            other => other.map_refs(&mut |_| usize::MAX),
        }
    }

    fn nested(
        &mut self,
        a: &Arg<String>,
        path: &mut String,
        seg: &str,
        report: &mut impl FnMut(&str, Problem),
    ) -> Arg<usize> {
        let len = path.len();
        path.push_str(seg);
        let out = self.arg(a, path, report);
        path.truncate(len);
        out
    }

    fn name(&mut self, name: &str, path: &str, report: &mut impl FnMut(&str, Problem)) -> usize {
        let Some(&pos) = self.index.get(name) else {
            report(
                path,
                Problem::UnknownRef {
                    target: name.to_owned(),
                },
            );
            return usize::MAX;
        };
        if self.is_output.get(pos).copied().unwrap_or(false) {
            report(
                path,
                Problem::RefToOutput {
                    target: name.to_owned(),
                },
            );
        } else if pos >= self.at {
            report(
                path,
                Problem::LaterRef {
                    target: name.to_owned(),
                },
            );
            self.later_refs.push((pos, self.at));
        }
        pos
    }
}

/// Names every node on a dependency cycle (only possible when some reference points forward).
fn report_cycles(
    nodes: &[Node<usize>],
    later: &[(usize, usize)],
    label: &str,
    d: &mut Diagnostics,
) {
    let mut dg = petgraph::graph::DiGraph::<(), (), u32>::with_capacity(nodes.len(), nodes.len());
    for _ in nodes {
        dg.add_node(());
    }
    for (i, n) in nodes.iter().enumerate() {
        for &p in n.refs() {
            if p < nodes.len() {
                dg.add_edge(
                    petgraph::graph::NodeIndex::new(p),
                    petgraph::graph::NodeIndex::new(i),
                    (),
                );
            }
        }
    }
    debug_assert!(!later.is_empty());
    let mut on_cycle: Vec<usize> = petgraph::algo::tarjan_scc(&dg)
        .into_iter()
        .filter(|scc| scc.len() > 1 || scc.first().is_some_and(|&n| dg.contains_edge(n, n)))
        .flatten()
        .map(|n| n.index())
        .collect();
    on_cycle.sort_unstable();
    for i in on_cycle {
        d.push(Location::node(label, &nodes[i].name), Problem::Cycle);
    }
}
