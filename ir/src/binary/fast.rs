//! The fast path: [`super::BinProgram`]'s bytes read by [`Wire`] straight into the IR, one
//! task per graph section, each node going into its graph as it is read, references checked
//! and converted on the way.
//!
//! Any problem, a bad reference or a repeated name included, is `None`: the careful path then
//! decodes again and names it. The fast path reads exactly what bincode's derived code reads,
//! field by field in declaration order, and claims what it claims (see [`Wire`]).

use super::arg;
use super::wire::Wire;
use super::{BinNode, Tables, shared};
use crate::{
    Arg, Form, Grad, Graph, GraphKind, Meta, Node, NodeId, Op, Param, Program, Str, SymInt,
    TensorMeta, Val,
};
use rayon::prelude::*;
use std::collections::BTreeMap;

/// The fewest bytes a node takes: its name's length, op, target index, two lengths and four
/// `Option` tags. Bounds what a claimed node count may reserve.
const MIN_NODE_BYTES: usize = 9;

// The fast path claims `Arg<u32>`s where it builds `Arg<NodeId>`s: the same size, so the
// same limit.
const _: () = assert!(std::mem::size_of::<Arg<u32>>() == std::mem::size_of::<Arg<NodeId>>());

/// The program in `payload`, or `None` for anything the careful path should look at.
pub(super) fn program(payload: &[u8]) -> Option<Program> {
    let mut w = Wire::new(payload);
    let bundle = w.bool()?;
    let len = w.len()?;
    w.claim_items::<Vec<u8>>(len)?;
    let mut sections = Vec::with_capacity(len.min(w.remaining()));
    for _ in 0..len {
        w.unclaim_item::<Vec<u8>>();
        sections.push(w.section()?);
    }
    if w.remaining() != 0 {
        return None;
    }
    // One task per graph; each section is decoded as bincode decodes it, on its own.
    let graphs = sections
        .into_par_iter()
        .map(|section| {
            let mut w = Wire::new(section);
            graph(&mut w).filter(|_| w.remaining() == 0)
        })
        .collect::<Option<Vec<Graph>>>()?;
    let form = if bundle { Form::Bundle } else { Form::Graph };
    Some(Program { graphs, form })
}

/// One section: a [`BinGraph`].
fn graph(w: &mut Wire) -> Option<Graph> {
    let name = if w.is_some()? {
        Some(w.str()?.to_owned())
    } else {
        None
    };
    let kind: GraphKind = w.decode()?;
    let targets: Vec<Str> = w.decode()?;
    let tensors = shared(w.decode::<Vec<TensorMeta>>()?);
    let tables = Tables {
        targets: &targets,
        tensors: &tensors,
    };
    let mut g = Graph::new(name, kind);
    let len = w.len()?;
    w.claim_items::<BinNode>(len)?;
    // Training-step graphs read about two producers per node; a reference takes two bytes.
    let nodes = len.min(w.remaining() / MIN_NODE_BYTES);
    g.reserve(nodes, (2 * nodes).min(w.remaining() / 2));
    for pos in 0..len {
        w.unclaim_item::<BinNode>();
        g.push(node(w, pos, &tables)?).ok()?;
    }
    let params: Vec<Param<u32>> = w.decode()?;
    g.params.reserve_exact(params.len());
    for p in params {
        if p.node as usize >= len {
            return None;
        }
        g.params.push(p.with_node(NodeId::new(p.node as usize)));
    }
    g.grads = w.decode::<Vec<Grad>>()?;
    Some(g)
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
    let len = w.len()?;
    w.claim_items::<Arg<u32>>(len)?;
    let mut args = Vec::with_capacity(len.min(w.remaining()));
    for _ in 0..len {
        w.unclaim_item::<Arg<u32>>();
        args.push(arg::read(w, &mut node_ref).ok()?);
    }
    let len = w.len()?;
    w.claim_items::<(Str, Arg<u32>)>(len)?;
    let mut kwargs = BTreeMap::new();
    for _ in 0..len {
        w.unclaim_item::<(Str, Arg<u32>)>();
        let key = Str::from(w.str()?);
        kwargs.insert(key, arg::read(w, &mut node_ref).ok()?);
    }
    let val = if w.is_some()? {
        Some(val(w, tables)?)
    } else {
        None
    };
    let aliases = indexes(w)?;
    let mutates = indexes(w)?;
    let device_time_ms = if w.is_some()? { Some(w.f64()?) } else { None };
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
        1 => {
            let len = w.len()?;
            w.claim_items::<Option<u32>>(len)?;
            let mut items = Vec::with_capacity(len.min(w.remaining()));
            for _ in 0..len {
                w.unclaim_item::<Option<u32>>();
                items.push(if w.is_some()? { Some(tensor(w)?) } else { None });
            }
            Val::Tuple(items)
        }
        2 => Val::Sym(SymInt {
            expr: Str::from(w.str()?),
            hint: w.i64()?,
        }),
        3 => Val::Int(w.i64()?),
        4 => Val::Float(w.f64()?),
        5 => Val::Bool(w.bool()?),
        _ => return None,
    })
}

/// `meta.aliases` or `meta.mutates`: an `Option<Vec<u32>>`.
fn indexes(w: &mut Wire) -> Option<Option<Vec<u32>>> {
    if !w.is_some()? {
        return Some(None);
    }
    let len = w.len()?;
    w.claim_items::<u32>(len)?;
    let mut out = Vec::with_capacity(len.min(w.remaining()));
    for _ in 0..len {
        w.unclaim_item::<u32>();
        out.push(w.u32()?);
    }
    Some(Some(out))
}
