//! The compact binary form: an 8-byte magic, a format version, then the program in bincode.
//! Each graph is a section of its own, and its nodes are chunks of their own within it, each
//! with its length in front, so that a reader decodes the chunks of every graph at once.
//!
//! Node references are program positions, so reading needs no name lookups; every position is
//! still checked before a graph is built, and decoding is bounded in memory, so a corrupt or
//! hostile file gives an error, never a panic or a huge allocation.

use crate::{
    Arg, Diagnostics, Form, Grad, Graph, GraphKind, ImportError, Kwargs, Location, Meta, Node,
    NodeId, Op, Param, Problem, Program, Str, SymInt, TensorMeta, Val,
};
use bincode::{Decode, Encode};
use rayon::prelude::*;
use std::sync::Arc;

/// `ZSGRAPH` and a byte that no text encoding of JSON starts with.
pub const MAGIC: &[u8; 8] = b"ZSGRAPH\x89";
/// Bumped on any change to the encoded structures.
pub const VERSION: u16 = 6;
/// Upper bound on what a decode may claim, far above any real training step.
const LIMIT: usize = 1 << 30;
/// Nodes per chunk: enough that a chunk's overhead is nothing, few enough that a large graph
/// splits into several and the cores share its decoding evenly.
const CHUNK_NODES: usize = 2048;

mod arg;
mod assemble;
mod fast;
mod wire;

pub fn has_magic(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}

#[derive(Encode, Decode)]
struct BinProgram {
    bundle: bool,
    /// Each graph's [`BinGraph`], encoded on its own: decoding one claims against the decode
    /// limit afresh.
    graphs: Vec<Vec<u8>>,
    /// The program's list of persistent parameters ([`Program::persistent_list`]), sorted.
    persistent: Vec<String>,
}

/// A graph with its repeated parts stored once: each distinct target and each distinct tensor
/// metadata sits in a table, in order of first use, and nodes refer to them by index. A
/// training step repeats a few dozen targets and a few hundred tensor shapes over thousands of
/// nodes, so reading one copies them instead of decoding each again.
#[derive(Encode, Decode)]
struct BinGraph {
    name: Option<String>,
    kind: GraphKind,
    forward: Option<String>,
    targets: Vec<Str>,
    tensors: Vec<TensorMeta>,
    /// The nodes in program order, [`CHUNK_NODES`] to a chunk (the last may hold fewer), each
    /// chunk a `Vec<BinNode>` encoded on its own.
    nodes: Vec<Vec<u8>>,
    params: Vec<Param<u32>>,
    grads: Vec<Grad>,
}

#[derive(Encode, Decode)]
struct BinNode {
    name: Str,
    op: Op,
    /// Index into the graph's `targets`.
    target: u32,
    args: Vec<Arg<u32>>,
    kwargs: Kwargs<u32>,
    val: Option<BinVal>,
    aliases: Option<Vec<u32>>,
    mutates: Option<Vec<u32>>,
    device_time_ms: Option<f64>,
}

/// [`Val`] with its tensors as indexes into the graph's `tensors`.
#[derive(Encode, Decode)]
enum BinVal {
    Tensor(u32),
    Tuple(Vec<Option<u32>>),
    Sym(SymInt),
    Int(i64),
    Float(f64),
    Bool(bool),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<LIMIT>()
}

pub fn export(program: &Program) -> Vec<u8> {
    export_with(program, |chunk| chunk)
}

/// The binary form of `p` with the bytes of the ARG `Arg::Str(marker)` replaced by
/// `replacement`, every length around them kept right: for tests that hand the reader ARGs
/// no program can hold.
#[cfg(feature = "testing")]
pub fn export_with_arg_bytes(p: &Program, marker: &str, replacement: &[u8]) -> Vec<u8> {
    // bincode standard: variant index 4 (Str), varint length, bytes.
    let mut needle = vec![4u8, marker.len() as u8];
    needle.extend_from_slice(marker.as_bytes());
    export_with(p, |chunk| {
        match chunk
            .windows(needle.len())
            .position(|w| w == needle.as_slice())
        {
            Some(at) => [&chunk[..at], replacement, &chunk[at + needle.len()..]].concat(),
            None => chunk,
        }
    })
}

/// [`export`], each encoded chunk of nodes passed through `chunk`.
fn export_with(program: &Program, chunk: impl Fn(Vec<u8>) -> Vec<u8> + Sync) -> Vec<u8> {
    let graphs = program
        .graphs
        .par_iter()
        .map(|g| encode(&encode_graph(g, &chunk)))
        .collect();
    let doc = BinProgram {
        bundle: program.form == Form::Bundle,
        graphs,
        persistent: program.persistent_list.iter().cloned().collect(),
    };
    // About a byte in eight of the JSON text; sized once for the common case.
    let nodes: usize = program.graphs.iter().map(Graph::len).sum();
    let mut out = Vec::with_capacity(nodes.saturating_mul(48).max(1 << 12));
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    let _ = bincode::encode_into_std_write(&doc, &mut out, config());
    out
}

/// A section or chunk. Encoding plain owned data into a Vec has no failure path but the size
/// limit, which a program held in memory cannot reach.
fn encode<T: Encode + ?Sized>(value: &T) -> Vec<u8> {
    bincode::encode_to_vec(value, config()).unwrap_or_default()
}

/// Distinct values in order of first use; the index of each. Insertion order alone decides
/// the indexes, so the encoding is deterministic.
struct Table<'g, T: ?Sized> {
    // Lookups only, so the hasher's seed never reaches the output; foldhash is several times
    // faster than SipHash on shapes.
    index: hashbrown::HashMap<&'g T, u32>,
    items: Vec<&'g T>,
}

impl<'g, T: ?Sized + Eq + std::hash::Hash> Table<'g, T> {
    fn new() -> Self {
        Table {
            index: hashbrown::HashMap::new(),
            items: Vec::new(),
        }
    }

    fn of(&mut self, item: &'g T) -> u32 {
        *self.index.entry(item).or_insert_with(|| {
            self.items.push(item);
            (self.items.len() - 1) as u32
        })
    }
}

fn encode_graph(g: &Graph, chunk: impl Fn(Vec<u8>) -> Vec<u8> + Sync) -> BinGraph {
    let pos = g.positions();
    let at = |id: &NodeId| pos[*id] as u32;
    // The tables first, in one pass in program order: an entry's index is the order of its
    // first use, so the encoding is deterministic. Nodes share their tensor metadata: each
    // shared copy is looked up by address, and only a copy not seen before by its value.
    let mut targets = Table::<str>::new();
    let mut tensors = Table::<TensorMeta>::new();
    let mut shared: hashbrown::HashMap<usize, u32> = hashbrown::HashMap::new();
    let target_index: Vec<u32> = g
        .nodes()
        .map(|(_, n)| {
            for t in n.meta.val.iter().flat_map(Val::tensors) {
                shared
                    .entry(std::ptr::from_ref(t) as usize)
                    .or_insert_with(|| tensors.of(t));
            }
            targets.of(&n.target)
        })
        .collect();
    // Then the nodes, a chunk per job on every core, the tables only read. The pass above
    // entered every node's tensors.
    let tensor = |t: &Arc<TensorMeta>| shared[&(Arc::as_ptr(t) as usize)];
    let node = |n: &Node, target: u32| BinNode {
        name: n.name.clone(),
        op: n.op,
        target,
        args: n.args.iter().map(|a| a.map_refs(&mut |r| at(r))).collect(),
        kwargs: n
            .kwargs
            .iter()
            .map(|(k, a)| (k.clone(), a.map_refs(&mut |r| at(r))))
            .collect(),
        val: n.meta.val.as_ref().map(|v| match v {
            Val::Tensor(t) => BinVal::Tensor(tensor(t)),
            Val::Tuple(ts) => BinVal::Tuple(ts.iter().map(|t| t.as_ref().map(tensor)).collect()),
            Val::Sym(s) => BinVal::Sym(s.clone()),
            Val::Int(i) => BinVal::Int(*i),
            Val::Float(x) => BinVal::Float(*x),
            Val::Bool(b) => BinVal::Bool(*b),
        }),
        aliases: n.meta.aliases.clone(),
        mutates: n.meta.mutates.clone(),
        device_time_ms: n.meta.device_time_ms,
    };
    let nodes = g
        .order()
        .par_chunks(CHUNK_NODES)
        .zip(target_index.par_chunks(CHUNK_NODES))
        .map(|(ids, targets)| {
            let chunk_nodes: Vec<BinNode> = ids
                .iter()
                .zip(targets)
                .map(|(&id, &target)| node(g.node(id), target))
                .collect();
            chunk(encode(&chunk_nodes))
        })
        .collect();
    BinGraph {
        name: g.name.clone(),
        kind: g.kind,
        forward: g.forward.clone(),
        targets: targets.items.into_iter().map(Str::from).collect(),
        tensors: tensors.items.into_iter().cloned().collect(),
        nodes,
        params: g.params.iter().map(|p| p.with_node(at(&p.node))).collect(),
        grads: g.grads.clone(),
    }
}

pub fn import(bytes: &[u8]) -> Result<Program, ImportError> {
    let payload = payload(bytes)?;
    // The fast path reads straight into the IR, verifying each node as it goes, and gives up
    // on any problem; the careful path then decodes again and reports it as it always has.
    if let Some(program) = fast::program(payload)
        && crate::verify::program_read_in_order(&program)
    {
        debug_assert!(
            crate::verify::program(&program).is_ok(),
            "the fast path accepted a program the verifier refuses"
        );
        return Ok(program);
    }
    careful(payload)
}

/// [`import`] without its fast path: same result, same errors, slower. For differential
/// tests and fuzzing of the fast path.
pub fn import_careful(bytes: &[u8]) -> Result<Program, ImportError> {
    careful(payload(bytes)?)
}

/// The bincode payload after a checked header.
fn payload(bytes: &[u8]) -> Result<&[u8], ImportError> {
    let body = bytes
        .strip_prefix(MAGIC.as_slice())
        .ok_or(ImportError::BadMagic)?;
    let (version, payload) = match body {
        [a, b, rest @ ..] => (u16::from_le_bytes([*a, *b]), rest),
        _ => {
            return Err(ImportError::Corrupt {
                message: "truncated header".into(),
            });
        }
    };
    if version != VERSION {
        return Err(ImportError::UnsupportedBinaryVersion {
            found: version,
            supported: VERSION,
        });
    }
    Ok(payload)
}

fn careful(payload: &[u8]) -> Result<Program, ImportError> {
    let (doc, used): (BinProgram, usize) =
        bincode::decode_from_slice(payload, config()).map_err(|e| ImportError::Corrupt {
            message: e.to_string(),
        })?;
    if used != payload.len() {
        return Err(ImportError::Corrupt {
            message: format!("{} trailing bytes after the program", payload.len() - used),
        });
    }
    let mut diags = Diagnostics::default();
    let mut graphs = Vec::with_capacity(doc.graphs.len());
    for (i, section) in doc.graphs.iter().enumerate() {
        let bg: BinGraph = whole(section, || format!("graph {i}"))?;
        let mut nodes = Vec::new();
        for (c, chunk) in bg.nodes.iter().enumerate() {
            nodes.extend(whole::<Vec<BinNode>>(chunk, || {
                format!("graph {i}, node chunk {c}")
            })?);
        }
        match decode_graph(bg, nodes, i) {
            Ok(g) => graphs.push(g),
            Err(d) => diags.0.extend(d.0),
        }
    }
    diags.into_result()?;
    let form = if doc.bundle {
        Form::Bundle
    } else {
        Form::Graph
    };
    let program = Program {
        graphs,
        form,
        persistent_list: doc.persistent.into_iter().collect(),
    };
    crate::verify::program(&program)?;
    Ok(program)
}

/// A section or chunk, which must be exactly one `T`; `what` names it in an error.
fn whole<T: Decode<()>>(bytes: &[u8], what: impl Fn() -> String) -> Result<T, ImportError> {
    let corrupt = |message: String| ImportError::Corrupt {
        message: format!("{}: {message}", what()),
    };
    let (value, used) =
        bincode::decode_from_slice(bytes, config()).map_err(|e| corrupt(e.to_string()))?;
    if used != bytes.len() {
        return Err(corrupt(format!("{} trailing bytes", bytes.len() - used)));
    }
    Ok(value)
}

fn decode_graph(bg: BinGraph, nodes: Vec<BinNode>, i: usize) -> Result<Graph, Diagnostics> {
    let label = bg.name.clone().unwrap_or_else(|| format!("graphs[{i}]"));
    let mut d = Diagnostics::default();
    let mut g = Graph::new(bg.name, bg.kind);
    g.forward = bg.forward;
    let tensors = shared(bg.tensors);
    let tables = Tables {
        targets: &bg.targets,
        tensors: &tensors,
    };
    for (pos, n) in nodes.iter().enumerate() {
        let at = |field: &str| Location::field(&label, &n.name, field);
        let mut check = |&r: &u32| {
            if (r as usize) < pos {
                Ok(NodeId::new(r as usize))
            } else {
                Err(r)
            }
        };
        let refs = n
            .args
            .iter()
            .map(|a| a.try_map_refs(&mut check))
            .collect::<Result<Vec<_>, _>>()
            .and_then(|args| {
                let kwargs = n
                    .kwargs
                    .iter()
                    .map(|(k, a)| Ok((k.clone(), a.try_map_refs(&mut check)?)))
                    .collect::<Result<Kwargs, u32>>()?;
                Ok((args, kwargs))
            });
        let (args, kwargs) = match refs {
            Ok(refs) => refs,
            Err(r) => {
                let target = nodes
                    .get(r as usize)
                    .map_or_else(|| format!("#{r}"), |t| t.name.to_string());
                d.push(
                    Location::node(&label, &n.name),
                    Problem::LaterRef { target },
                );
                return Err(d);
            }
        };
        let target = tables.target(n.target);
        let val = n.val.as_ref().map(|v| tables.val(v)).transpose();
        let (target, val) = match (target, val) {
            (Ok(t), Ok(v)) => (t, v),
            (t, v) => {
                if let Err(p) = t {
                    d.push(at("target"), p);
                }
                if let Err(p) = v {
                    d.push(at("meta.val"), p);
                }
                return Err(d);
            }
        };
        let node = Node {
            name: n.name.clone(),
            op: n.op,
            target,
            args,
            kwargs,
            meta: Box::new(Meta {
                val,
                aliases: n.aliases.clone(),
                mutates: n.mutates.clone(),
                device_time_ms: n.device_time_ms,
            }),
        };
        if let Err(p) = g.push(node) {
            d.push(Location::node(&label, &n.name), p);
            return Err(d);
        }
    }
    for (pi, p) in bg.params.into_iter().enumerate() {
        if (p.node as usize) < nodes.len() {
            g.params.push(p.with_node(NodeId::new(p.node as usize)));
        } else {
            d.push(
                Location::graph_field(&label, format!("params[{pi}].node")),
                Problem::UnknownRef {
                    target: format!("#{}", p.node),
                },
            );
        }
    }
    g.grads = bg.grads;
    d.into_result()?;
    Ok(g)
}

/// A graph's tables, looked up with a typed error for an index out of range.
struct Tables<'t> {
    targets: &'t [Str],
    tensors: &'t [Arc<TensorMeta>],
}

/// A graph's tensor table, one shared copy of each entry for all the nodes that use it.
fn shared(tensors: Vec<TensorMeta>) -> Vec<Arc<TensorMeta>> {
    tensors.into_iter().map(Arc::new).collect()
}

impl Tables<'_> {
    fn target(&self, i: u32) -> Result<Str, Problem> {
        lookup(self.targets, "targets", i)
    }

    fn tensor(&self, i: u32) -> Result<Arc<TensorMeta>, Problem> {
        lookup(self.tensors, "tensors", i)
    }

    fn val(&self, v: &BinVal) -> Result<Val, Problem> {
        Ok(match v {
            BinVal::Tensor(t) => Val::Tensor(self.tensor(*t)?),
            BinVal::Tuple(ts) => Val::Tuple(
                ts.iter()
                    .map(|t| t.map(|t| self.tensor(t)).transpose())
                    .collect::<Result<_, _>>()?,
            ),
            BinVal::Sym(s) => Val::Sym(s.clone()),
            BinVal::Int(i) => Val::Int(*i),
            BinVal::Float(x) => Val::Float(*x),
            BinVal::Bool(b) => Val::Bool(*b),
        })
    }
}

fn lookup<T: Clone>(table: &[T], name: &'static str, i: u32) -> Result<T, Problem> {
    table
        .get(i as usize)
        .cloned()
        .ok_or(Problem::BadTableIndex {
            table: name,
            index: i,
            len: table.len(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A two-node graph in the wire form, its output's target and value indexes given.
    fn document(target: u32, val: Option<BinVal>) -> Vec<u8> {
        let node = |name: &str, op, target, args, val| BinNode {
            name: Str::from(name),
            op,
            target,
            args,
            kwargs: Kwargs::new(),
            val,
            aliases: None,
            mutates: None,
            device_time_ms: None,
        };
        let graph = BinGraph {
            name: Some("g".into()),
            kind: GraphKind::Forward,
            forward: None,
            targets: vec![Str::from("x"), Str::from("output")],
            tensors: vec![TensorMeta::new(vec![], crate::Dtype::Float32)],
            nodes: vec![encode(&vec![
                node("x", Op::Placeholder, 0, vec![], Some(BinVal::Tensor(0))),
                node("out", Op::Output, target, vec![Arg::Node(0)], val),
            ])],
            params: vec![],
            grads: vec![],
        };
        let doc = BinProgram {
            bundle: false,
            graphs: vec![encode(&graph)],
            persistent: vec![],
        };
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend(bincode::encode_to_vec(&doc, config()).unwrap());
        out
    }

    #[test]
    fn table_indexes_are_checked_and_named() {
        let ok = import(&document(1, None)).unwrap();
        assert_eq!(ok.graphs[0].nodes().nth(1).unwrap().1.target, "output");
        let err = import(&document(2, None)).unwrap_err().to_string();
        assert!(
            err.contains("node `out`, field `target`") && err.contains("targets table"),
            "{err}"
        );
        let err = import(&document(1, Some(BinVal::Tuple(vec![None, Some(1)]))))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("node `out`, field `meta.val`") && err.contains("tensors table"),
            "{err}"
        );
    }

    #[test]
    fn repeated_targets_and_tensors_are_stored_once_and_nodes_chunked() {
        let p = crate::testing::llama_like(96);
        let bin = export(&p);
        let doc: BinProgram = whole(payload(&bin).unwrap(), String::new).unwrap();
        let mut chunked = false;
        for (g, section) in p.graphs.iter().zip(&doc.graphs) {
            let bg: BinGraph = whole(section, String::new).unwrap();
            let distinct: std::collections::HashSet<&str> =
                g.nodes().map(|(_, n)| n.target.as_str()).collect();
            assert_eq!(bg.targets.len(), distinct.len());
            assert!(
                bg.tensors.len() < g.len() / 2,
                "{} tensors",
                bg.tensors.len()
            );
            let sizes: Vec<usize> = bg
                .nodes
                .iter()
                .map(|c| whole::<Vec<BinNode>>(c, String::new).unwrap().len())
                .collect();
            assert_eq!(sizes.iter().sum::<usize>(), g.len());
            let (last, full) = sizes.split_last().unwrap();
            assert!(full.iter().all(|&n| n == CHUNK_NODES) && *last <= CHUNK_NODES);
            chunked |= sizes.len() > 1;
        }
        assert!(
            chunked,
            "some graph spans several chunks: {:?}",
            p.graphs.iter().map(Graph::len).collect::<Vec<_>>()
        );
        assert_eq!(export(&import(&bin).unwrap()), bin);
    }
}
