//! The fast path: [`super::BinProgram`]'s bytes read by [`Wire`] straight into the IR. Every
//! graph's header is read first, then every chunk of nodes of every graph at once (references
//! checked and converted on the way), then each graph is built from its chunks in order.
//!
//! Any problem, a bad reference or a repeated name included, is `None`: the careful path then
//! decodes again and names it. The fast path reads exactly what bincode's derived code reads,
//! field by field in declaration order, and claims what it claims (see [`Wire`]).

use super::arg::{self, Source};
use super::wire::Wire;
use super::{BinNode, Tables, shared};
use crate::{
    Arg, Form, Grad, Graph, GraphKind, Meta, Node, NodeId, Op, Param, Program, Str, TensorMeta, Val,
};
use rayon::prelude::*;
use std::collections::BTreeMap;

// The fast path claims `Arg<u32>`s where it builds `Arg<NodeId>`s: the same size, so the
// same limit.
const _: () = assert!(std::mem::size_of::<Arg<u32>>() == std::mem::size_of::<Arg<NodeId>>());

/// The program in `payload`, or `None` for anything the careful path should look at.
pub(super) fn program(payload: &[u8]) -> Option<Program> {
    let mut w = Wire::new(payload);
    let bundle = w.bool()?;
    let sections = list::<Vec<u8>, _>(&mut w, Wire::section)?;
    if w.remaining() != 0 {
        return None;
    }
    // Each graph's header first: the tables its chunks of nodes refer to.
    let parts = sections
        .into_iter()
        .map(Parts::read)
        .collect::<Option<Vec<_>>>()?;
    // Then every chunk of every graph at once, each knowing the position of its first node.
    let mut jobs = Vec::new();
    for (gi, part) in parts.iter().enumerate() {
        let mut first = 0usize;
        for &chunk in &part.chunks {
            jobs.push((gi, first, chunk));
            first = first.checked_add(Wire::new(chunk).len()?)?;
        }
    }
    let chunks = jobs
        .into_par_iter()
        .map(|(gi, first, chunk)| {
            let mut w = Wire::new(chunk);
            let tables = parts[gi].tables();
            let nodes = list_from::<BinNode, _>(&mut w, first, |w, pos| node(w, pos, &tables))?;
            (w.remaining() == 0).then_some((gi, nodes))
        })
        .collect::<Option<Vec<_>>>()?;
    // Then each graph from its chunks in order, one task per graph.
    let mut by_graph: Vec<Vec<Vec<Node>>> = parts.iter().map(|_| Vec::new()).collect();
    for (gi, nodes) in chunks {
        by_graph.get_mut(gi)?.push(nodes);
    }
    let graphs = parts
        .into_par_iter()
        .zip(by_graph)
        .map(|(part, chunks)| part.build(chunks))
        .collect::<Option<Vec<Graph>>>()?;
    let form = if bundle { Form::Bundle } else { Form::Graph };
    Some(Program { graphs, form })
}

/// A `Vec<B>` as bincode reads it, claims and all, each item read by `item` as a `T`.
fn list<'a, B, T>(
    w: &mut Wire<'a>,
    mut item: impl FnMut(&mut Wire<'a>) -> Option<T>,
) -> Option<Vec<T>> {
    list_from::<B, T>(w, 0, |w, _| item(w))
}

/// [`list`], `item` also given each item's index counted from `first`.
fn list_from<'a, B, T>(
    w: &mut Wire<'a>,
    first: usize,
    mut item: impl FnMut(&mut Wire<'a>, usize) -> Option<T>,
) -> Option<Vec<T>> {
    let len = w.len()?;
    w.claim_items::<B>(len)?;
    // Every item takes a byte at least: a length no input backs reserves nothing.
    let mut out = Vec::with_capacity(len.min(w.remaining()));
    for i in 0..len {
        w.unclaim_item::<B>();
        out.push(item(w, first.checked_add(i)?)?);
    }
    Some(out)
}

/// One graph section before its nodes are read: [`super::BinGraph`] with its chunks of nodes
/// as bytes.
struct Parts<'a> {
    name: Option<String>,
    kind: GraphKind,
    targets: Vec<Str>,
    tensors: Vec<std::sync::Arc<TensorMeta>>,
    chunks: Vec<&'a [u8]>,
    params: Vec<Param<u32>>,
    grads: Vec<Grad>,
}

impl<'a> Parts<'a> {
    fn read(section: &'a [u8]) -> Option<Parts<'a>> {
        let mut w = Wire::new(section);
        let parts = Parts {
            name: option(&mut w, |w| w.str().map(str::to_owned))?,
            kind: w.decode()?,
            targets: w.decode()?,
            tensors: shared(w.decode::<Vec<TensorMeta>>()?),
            chunks: list::<Vec<u8>, _>(&mut w, Wire::section)?,
            params: w.decode()?,
            grads: w.decode()?,
        };
        (w.remaining() == 0).then_some(parts)
    }

    fn tables(&self) -> Tables<'_> {
        Tables {
            targets: &self.targets,
            tensors: &self.tensors,
        }
    }

    /// The graph, its nodes `chunks` in order.
    fn build(self, chunks: Vec<Vec<Node>>) -> Option<Graph> {
        let mut g = Graph::new(self.name, self.kind);
        let len: usize = chunks.iter().map(Vec::len).sum();
        // Training-step graphs read about two producers per node.
        g.reserve(len, 2 * len);
        for node in chunks.into_iter().flatten() {
            g.push(node).ok()?;
        }
        g.params.reserve_exact(self.params.len());
        for p in self.params {
            if p.node as usize >= len {
                return None;
            }
            g.params.push(p.with_node(NodeId::new(p.node as usize)));
        }
        g.grads = self.grads;
        Some(g)
    }
}

/// Node `pos` of its graph, with references to earlier nodes only and its target and tensors
/// taken from the graph's tables.
fn node(w: &mut Wire, pos: usize, tables: &Tables) -> Option<Node> {
    let mut node_ref = |w: &mut Wire| match w.u32() {
        Some(r) if (r as usize) < pos => Ok(NodeId::new(r as usize)),
        _ => Err(()),
    };
    let name = Str::from(w.str()?);
    let op = *Op::ALL.get(w.u32()? as usize)?;
    let target = tables.targets.get(w.u32()? as usize)?.clone();
    let args = list::<Arg<u32>, _>(w, |w| arg::read(w, &mut node_ref).ok())?;
    // A repeated key keeps its last value, as bincode's map does.
    let mut kwargs = BTreeMap::new();
    list::<(Str, Arg<u32>), _>(w, |w| {
        let key = Str::from(w.str()?);
        kwargs.insert(key, arg::read(w, &mut node_ref).ok()?);
        Some(())
    })?;
    let val = option(w, |w| val(w, tables))?;
    let aliases = option(w, |w| list::<u32, _>(w, Wire::u32))?;
    let mutates = option(w, |w| list::<u32, _>(w, Wire::u32))?;
    let device_time_ms = option(w, Wire::f64)?;
    Some(Node {
        name,
        op,
        target,
        args,
        kwargs,
        meta: Box::new(Meta {
            val,
            aliases,
            mutates,
            device_time_ms,
        }),
    })
}

/// [`super::BinVal`], its tensors taken from the graph's table.
fn val(w: &mut Wire, tables: &Tables) -> Option<Val> {
    let tensor = |w: &mut Wire| tables.tensors.get(w.u32()? as usize).cloned();
    Some(match w.u32()? {
        0 => Val::Tensor(tensor(w)?),
        1 => Val::Tuple(list::<Option<u32>, _>(w, |w| option(w, tensor))?),
        2 => Val::Sym(Source::sym(w).ok()?),
        3 => Val::Int(w.i64()?),
        4 => Val::Float(w.f64()?),
        5 => Val::Bool(w.bool()?),
        _ => return None,
    })
}

/// An `Option<T>` as bincode reads it, the value read by `value`.
fn option<'a, T>(
    w: &mut Wire<'a>,
    value: impl FnOnce(&mut Wire<'a>) -> Option<T>,
) -> Option<Option<T>> {
    Some(if w.is_some()? { Some(value(w)?) } else { None })
}
