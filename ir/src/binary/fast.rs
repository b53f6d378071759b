//! The fast path: [`super::BinProgram`]'s bytes read by [`Wire`] straight into the IR. Every
//! graph's header (name, kind, target and tensor tables) is read first, then every chunk of
//! nodes of every graph on every core (references checked and converted on the way), each
//! chunk added to its graph as soon as the chunks before it are in ([`Assembly`]); each
//! graph's parameters and gradient map are a job of the same pool.
//!
//! Any problem, a bad reference or a repeated name included, is `None`: the careful path then
//! decodes again and names it. That includes every problem the structural verifier finds in a
//! node: its checks of each node run as the node is read (of a tensor, once, in its graph's
//! table), and a reference can only name an earlier node, so the program needs only the
//! verifier's checks over whole graphs after. The fast path reads exactly what bincode's
//! derived code reads, field by field in declaration order, and claims what it claims (see
//! [`Wire`]).

use super::arg::{self, Source};
use super::assemble::Assembly;
use super::wire::Wire;
use super::{BinNode, Tables, shared};
use crate::{
    Arg, Diagnostics, Form, Grad, Graph, GraphKind, Kwargs, Meta, Node, NodeId, Op, Param, Program,
    Str, TensorMeta, Val, verify,
};
use rayon::prelude::*;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

// The fast path claims `Arg<u32>`s where it builds `Arg<NodeId>`s: the same size, so the
// same limit.
const _: () = assert!(std::mem::size_of::<Arg<u32>>() == std::mem::size_of::<Arg<NodeId>>());

/// The program in `payload`, or `None` for anything the careful path should look at.
pub(super) fn program(payload: &[u8]) -> Option<Program> {
    let mut w = Wire::new(payload);
    let bundle = w.bool()?;
    let sections = list::<Vec<u8>, _>(&mut w, Wire::section)?;
    let persistent = list::<String, _>(&mut w, |w| w.str().map(str::to_owned))?;
    if w.remaining() != 0 {
        return None;
    }
    // Each graph's header first: the tables its chunks of nodes refer to.
    let parts = sections
        .into_iter()
        .map(Parts::read)
        .collect::<Option<Vec<_>>>()?;
    // Then every chunk of every graph, each knowing the position of its first node, taken in
    // program order by every core and added to its graph as soon as it is next in order; each
    // graph's parameters and gradient map last, while the last chunks are being added.
    let mut jobs = Vec::new();
    let mut assemblies = Vec::with_capacity(parts.len());
    for (gi, part) in parts.iter().enumerate() {
        let (mut first, mut room) = (0usize, 0usize);
        for (ci, &chunk) in part.chunks.iter().enumerate() {
            jobs.push(Job::Chunk {
                gi,
                ci,
                first,
                chunk,
            });
            let len = Wire::new(chunk).len()?;
            first = first.checked_add(len)?;
            // Every node takes a byte at least: a length no input backs reserves nothing.
            room += len.min(chunk.len());
        }
        let mut graph = Graph::new(part.name.clone(), part.kind);
        graph.forward.clone_from(&part.forward);
        assemblies.push(Assembly::new(graph, part.chunks.len(), room));
    }
    jobs.extend((0..parts.len()).map(Job::Tail));
    let next = AtomicUsize::new(0);
    let refused = AtomicBool::new(false);
    rayon::scope(|s| {
        for _ in 0..rayon::current_num_threads() {
            s.spawn(|_| {
                while let Some(job) = jobs.get(next.fetch_add(1, Relaxed)) {
                    if refused.load(Relaxed) || !job.run(&parts, &assemblies) {
                        refused.store(true, Relaxed);
                        return;
                    }
                }
            });
        }
    });
    if refused.into_inner() {
        return None;
    }
    let graphs = parts
        .into_par_iter()
        .zip(assemblies)
        .map(|(part, assembly)| part.finish(assembly.finish()?))
        .collect::<Option<Vec<Graph>>>()?;
    let form = if bundle { Form::Bundle } else { Form::Graph };
    Some(Program {
        graphs,
        form,
        persistent_list: persistent.into_iter().collect(),
    })
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
    list_pushed::<B, T>(w, first, |w, i, out| {
        out.push(item(w, i)?);
        Some(())
    })
}

/// [`list_from`] with `push` appending each item to the list itself, so that a large item is
/// built where it is kept instead of being passed back through an `Option` and moved.
fn list_pushed<'a, B, T>(
    w: &mut Wire<'a>,
    first: usize,
    mut push: impl FnMut(&mut Wire<'a>, usize, &mut Vec<T>) -> Option<()>,
) -> Option<Vec<T>> {
    let len = w.len()?;
    w.claim_items::<B>(len)?;
    // Every item takes a byte at least: a length no input backs reserves nothing.
    let mut out = Vec::with_capacity(len.min(w.remaining()));
    for i in 0..len {
        w.unclaim_item::<B>();
        push(w, first.checked_add(i)?, &mut out)?;
    }
    Some(out)
}

/// A share of the reading that any core may take.
enum Job<'a> {
    /// Chunk `ci` of graph `gi`, whose first node is at program position `first`.
    Chunk {
        gi: usize,
        ci: usize,
        first: usize,
        chunk: &'a [u8],
    },
    /// The parameters and gradient map of graph `gi`.
    Tail(usize),
}

impl Job<'_> {
    /// Does the job; whether all was well.
    fn run(&self, parts: &[Parts], assemblies: &[Assembly]) -> bool {
        match *self {
            Job::Chunk {
                gi,
                ci,
                first,
                chunk,
            } => match (parts.get(gi), assemblies.get(gi)) {
                (Some(part), Some(assembly)) => match part.decode(first, chunk) {
                    Some(nodes) => {
                        assembly.offer(ci, nodes);
                        true
                    }
                    None => false,
                },
                _ => false,
            },
            Job::Tail(gi) => parts.get(gi).is_some_and(Parts::read_tail),
        }
    }
}

/// One graph section before its nodes are read: [`super::BinGraph`] with its chunks of nodes
/// as bytes.
struct Parts<'a> {
    name: Option<String>,
    kind: GraphKind,
    forward: Option<String>,
    targets: Vec<Str>,
    tensors: Vec<std::sync::Arc<TensorMeta>>,
    chunks: Vec<&'a [u8]>,
    /// The rest of the section, `params` then `grads`, with the claims made before them.
    tail: Wire<'a>,
    /// Read from `tail` by [`Job::Tail`].
    params_and_grads: OnceLock<(Vec<Param<u32>>, Vec<Grad>)>,
}

impl<'a> Parts<'a> {
    fn read(section: &'a [u8]) -> Option<Parts<'a>> {
        let mut w = Wire::new(section);
        Some(Parts {
            name: option(&mut w, |w| w.str().map(str::to_owned))?,
            kind: w.decode()?,
            forward: option(&mut w, |w| w.str().map(str::to_owned))?,
            targets: w.decode()?,
            // Every node's tensors come from this table: checked here once, they need no
            // check per node. An unsound entry leaves the document to the careful path, which
            // refuses it only if a node uses it.
            tensors: shared(
                w.decode::<Vec<TensorMeta>>()?
                    .into_iter()
                    .map(|t| verify::tensor_is_sound(&t).then_some(t))
                    .collect::<Option<_>>()?,
            ),
            chunks: list::<Vec<u8>, _>(&mut w, Wire::section)?,
            tail: w,
            params_and_grads: OnceLock::new(),
        })
    }

    /// Reads the parameters and gradient map, which end the section; whether they read.
    fn read_tail(&self) -> bool {
        let mut w = self.tail.clone();
        let read = (|| Some((w.decode()?, w.decode()?)))();
        match read {
            Some(tail) if w.remaining() == 0 => self.params_and_grads.set(tail).is_ok(),
            _ => false,
        }
    }

    fn tables(&self) -> Tables<'_> {
        Tables {
            targets: &self.targets,
            tensors: &self.tensors,
        }
    }

    /// The nodes of one chunk, the first at program position `first`. The verifier's checks
    /// of each node on its own run here too, once the chunk is read and while its nodes are in
    /// cache, on every core, so that the program needs only the checks over whole graphs after.
    fn decode(&self, first: usize, chunk: &[u8]) -> Option<Vec<Node>> {
        let mut w = Wire::new(chunk);
        let tables = self.tables();
        let mut problems = Diagnostics::default();
        let nodes =
            list_pushed::<BinNode, _>(&mut w, first, |w, pos, out| node(w, pos, &tables, out))?;
        for n in &nodes {
            verify::node_fields_tabled("", n, &mut problems);
        }
        (w.remaining() == 0 && problems.0.is_empty()).then_some(nodes)
    }

    /// The graph `g`, its nodes all added, with its parameters and gradients.
    fn finish(self, mut g: Graph) -> Option<Graph> {
        let (params, grads) = self.params_and_grads.into_inner()?;
        let len = g.len();
        g.params.reserve_exact(params.len());
        for p in params {
            if p.node as usize >= len {
                return None;
            }
            g.params.push(p.with_node(NodeId::new(p.node as usize)));
        }
        g.grads = grads;
        Some(g)
    }
}

/// Node `pos` of its graph, with references to earlier nodes only and its target and tensors
/// taken from the graph's tables, appended to `out`.
fn node(w: &mut Wire, pos: usize, tables: &Tables, out: &mut Vec<Node>) -> Option<()> {
    let mut node_ref = |w: &mut Wire| match w.u32() {
        Some(r) if (r as usize) < pos => Ok(NodeId::new(r as usize)),
        _ => Err(()),
    };
    let name = Str::from(w.str()?);
    let op = *Op::ALL.get(w.u32()? as usize)?;
    let target = tables.targets.get(w.u32()? as usize)?.clone();
    let args = list::<Arg<u32>, _>(w, |w| arg::read(w, &mut node_ref).ok())?;
    // A repeated key keeps its last value, as bincode's map does.
    let kwargs = Kwargs::from_pairs(list::<(Str, Arg<u32>), _>(w, |w| {
        let key = Str::from(w.str()?);
        Some((key, arg::read(w, &mut node_ref).ok()?))
    })?);
    let val = option(w, |w| val(w, tables))?;
    let aliases = option(w, |w| list::<u32, _>(w, Wire::u32))?;
    let mutates = option(w, |w| list::<u32, _>(w, Wire::u32))?;
    let device_time_ms = option(w, Wire::f64)?;
    out.push(Node {
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
    });
    Some(())
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
