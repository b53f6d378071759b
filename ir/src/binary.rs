//! The compact binary form: an 8-byte magic, a format version, then the program in bincode.
//!
//! Node references are program positions, so reading needs no name lookups; every position is
//! still checked before a graph is built, and decoding is bounded in memory, so a corrupt or
//! hostile file gives an error, never a panic or a huge allocation.

use crate::{
    Arg, Diagnostics, Dtype, Form, Grad, Graph, GraphKind, ImportError, Location, Meta, Node,
    NodeId, Op, Param, Problem, Program, SymInt, TensorMeta, Val,
};
use bincode::de::{BorrowDecoder, Decoder};
use bincode::error::DecodeError;
use bincode::{BorrowDecode, Decode, Encode};
use std::collections::BTreeMap;

/// `ZSGRAPH` and a byte that no text encoding of JSON starts with.
pub const MAGIC: &[u8; 8] = b"ZSGRAPH\x89";
/// Bumped on any change to the encoded structures.
pub const VERSION: u16 = 1;
/// Upper bound on what a decode may claim, far above any real training step.
const LIMIT: usize = 1 << 30;

pub fn has_magic(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}

#[derive(Encode, Decode)]
struct BinProgram {
    bundle: bool,
    graphs: Vec<BinGraph>,
}

#[derive(Encode, Decode)]
struct BinGraph {
    name: Option<String>,
    kind: GraphKind,
    nodes: Vec<Node<u32>>,
    params: Vec<Param<u32>>,
    grads: Vec<Grad>,
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<LIMIT>()
}

pub fn export(program: &Program) -> Vec<u8> {
    let graphs = program.graphs.iter().map(encode_graph).collect();
    let doc = BinProgram {
        bundle: program.form == Form::Bundle,
        graphs,
    };
    let mut out = Vec::with_capacity(1 << 16);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    // Encoding plain owned data into a Vec has no failure path but the size limit, which a
    // program held in memory cannot reach.
    let _ = bincode::encode_into_std_write(&doc, &mut out, config());
    out
}

fn encode_graph(g: &Graph) -> BinGraph {
    let pos = g.positions();
    let at = |id: &NodeId| pos[*id] as u32;
    BinGraph {
        name: g.name.clone(),
        kind: g.kind,
        nodes: g.nodes().map(|(_, n)| n.map_refs(&mut |r| at(r))).collect(),
        params: g.params.iter().map(|p| p.with_node(at(&p.node))).collect(),
        grads: g.grads.clone(),
    }
}

pub fn import(bytes: &[u8]) -> Result<Program, ImportError> {
    let payload = payload(bytes)?;
    // The fast path decodes straight into the IR and gives up on any problem; the careful
    // path then decodes again and reports it as it always has.
    if let Ok((FastProgram(program), used)) =
        bincode::borrow_decode_from_slice_with_context(payload, config(), payload.len())
    {
        if used == payload.len() {
            crate::verify::program(&program)?;
            return Ok(program);
        }
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
    for (i, g) in doc.graphs.into_iter().enumerate() {
        match decode_graph(g, i) {
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
    let program = Program { graphs, form };
    crate::verify::program(&program)?;
    Ok(program)
}

fn decode_graph(bg: BinGraph, i: usize) -> Result<Graph, Diagnostics> {
    let label = bg.name.clone().unwrap_or_else(|| format!("graphs[{i}]"));
    let mut d = Diagnostics::default();
    let mut g = Graph::new(bg.name, bg.kind);
    for (pos, n) in bg.nodes.iter().enumerate() {
        let node = n.try_map_refs(&mut |&r| {
            if (r as usize) < pos {
                Ok(NodeId::new(r as usize))
            } else {
                Err(r)
            }
        });
        match node {
            Ok(node) => {
                if let Err(p) = g.push(node) {
                    d.push(Location::node(&label, &n.name), p);
                }
            }
            Err(r) => {
                let target = bg
                    .nodes
                    .get(r as usize)
                    .map_or_else(|| format!("#{r}"), |t| t.name.clone());
                d.push(
                    Location::node(&label, &n.name),
                    Problem::LaterRef { target },
                );
            }
        }
        if !d.is_empty() {
            return Err(d);
        }
    }
    for (pi, p) in bg.params.into_iter().enumerate() {
        if (p.node as usize) < bg.nodes.len() {
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

/// The fast path's program: [`BinProgram`] as `#[derive(Decode)]` reads it (the same bytes,
/// the same claims against the decode limit, so it fails wherever that fails), each node
/// going into its graph as it is read, references checked and converted on the way. Any
/// problem, a bad reference or a repeated name included, is a decode error: the careful path
/// then names it. The context is the payload's length, which bounds what is reserved.
struct FastProgram(Program);

/// The fewest bytes a node takes: five lengths or tags and four `Option` tags.
const MIN_NODE_BYTES: usize = 9;

// The fast path claims `Arg<u32>`s where it builds `Arg<NodeId>`s: the same size, so the
// same limit.
const _: () = assert!(std::mem::size_of::<Arg<u32>>() == std::mem::size_of::<Arg<NodeId>>());

fn give_up() -> DecodeError {
    DecodeError::Other("the fast path gives up")
}

fn decode_len<D: Decoder>(d: &mut D) -> Result<usize, DecodeError> {
    let len = u64::decode(d)?;
    usize::try_from(len).map_err(|_| DecodeError::OutsideUsizeRange(len))
}

impl<'de> BorrowDecode<'de, usize> for FastProgram {
    fn borrow_decode<D: BorrowDecoder<'de, Context = usize>>(
        d: &mut D,
    ) -> Result<Self, DecodeError> {
        let bundle = bool::decode(d)?;
        let len = decode_len(d)?;
        d.claim_container_read::<BinGraph>(len)?;
        let mut graphs = Vec::with_capacity(len.min(*d.context()));
        for _ in 0..len {
            d.unclaim_bytes_read(std::mem::size_of::<BinGraph>());
            graphs.push(decode_graph_fast(d)?);
        }
        let form = if bundle { Form::Bundle } else { Form::Graph };
        Ok(FastProgram(Program { graphs, form }))
    }
}

/// A `String` as bincode writes it, copied out of the input: one exact allocation, where
/// `String::decode` zeroes a buffer first. Same claim against the limit.
fn string<'de, D: BorrowDecoder<'de>>(d: &mut D) -> Result<String, DecodeError> {
    Ok(<&str>::borrow_decode(d)?.to_owned())
}

/// An `Option` tag as bincode writes it.
fn is_some<D: Decoder>(d: &mut D) -> Result<bool, DecodeError> {
    Ok(Option::<()>::decode(d)?.is_some())
}

fn decode_graph_fast<'de, D: BorrowDecoder<'de, Context = usize>>(
    d: &mut D,
) -> Result<Graph, DecodeError> {
    let name = if is_some(d)? { Some(string(d)?) } else { None };
    let kind = GraphKind::decode(d)?;
    let mut g = Graph::new(name, kind);
    let len = decode_len(d)?;
    d.claim_container_read::<Node<u32>>(len)?;
    g.reserve(len.min(*d.context() / MIN_NODE_BYTES), 0);
    for pos in 0..len {
        d.unclaim_bytes_read(std::mem::size_of::<Node<u32>>());
        let node = decode_node(d, pos)?;
        g.push(node).map_err(|_| give_up())?;
    }
    let params = Vec::<Param<u32>>::decode(d)?;
    g.params.reserve_exact(params.len());
    for p in params {
        if p.node as usize >= len {
            return Err(give_up());
        }
        let node = NodeId::new(p.node as usize);
        g.params.push(Param {
            name: p.name,
            node,
            shape: p.shape,
            dtype: p.dtype,
            persistent: p.persistent,
        });
    }
    g.grads = Vec::<Grad>::decode(d)?;
    Ok(g)
}

/// Node `pos` of its graph, as `Node<u32>` decodes, with references to earlier nodes only.
fn decode_node<'de, D: BorrowDecoder<'de>>(d: &mut D, pos: usize) -> Result<Node, DecodeError> {
    let mut node_ref = |d: &mut D| {
        let r = u32::decode(d)? as usize;
        if r < pos {
            Ok(NodeId::new(r))
        } else {
            Err(give_up())
        }
    };
    let name = string(d)?;
    let op = Op::decode(d)?;
    let target = string(d)?;
    let len = decode_len(d)?;
    d.claim_container_read::<Arg<u32>>(len)?;
    let mut args = Vec::with_capacity(len);
    for _ in 0..len {
        d.unclaim_bytes_read(std::mem::size_of::<Arg<u32>>());
        args.push(crate::arg::decode_arg(d, &mut node_ref)?);
    }
    let len = decode_len(d)?;
    d.claim_container_read::<(String, Arg<u32>)>(len)?;
    let mut kwargs = BTreeMap::new();
    for _ in 0..len {
        d.unclaim_bytes_read(std::mem::size_of::<(String, Arg<u32>)>());
        let key = string(d)?;
        let value = crate::arg::decode_arg(d, &mut node_ref)?;
        kwargs.insert(key, value);
    }
    let meta = decode_meta(d)?;
    Ok(Node {
        name,
        op,
        target,
        args,
        kwargs,
        meta,
    })
}

/// [`Meta`] as it decodes, its tensors by [`decode_tensor`].
fn decode_meta<'de, D: BorrowDecoder<'de>>(d: &mut D) -> Result<Meta, DecodeError> {
    let val = if is_some(d)? {
        Some(match u32::decode(d)? {
            0 => Val::Tensor(decode_tensor(d)?),
            1 => {
                let len = decode_len(d)?;
                d.claim_container_read::<Option<TensorMeta>>(len)?;
                let mut items = Vec::with_capacity(len);
                for _ in 0..len {
                    d.unclaim_bytes_read(std::mem::size_of::<Option<TensorMeta>>());
                    items.push(if is_some(d)? {
                        Some(decode_tensor(d)?)
                    } else {
                        None
                    });
                }
                Val::Tuple(items)
            }
            2 => Val::Sym(SymInt::decode(d)?),
            3 => Val::Int(i64::decode(d)?),
            4 => Val::Float(f64::decode(d)?),
            5 => Val::Bool(bool::decode(d)?),
            _ => return Err(give_up()),
        })
    } else {
        None
    };
    Ok(Meta {
        val,
        aliases: Decode::decode(d)?,
        mutates: Decode::decode(d)?,
        device_time_ms: Decode::decode(d)?,
    })
}

/// [`TensorMeta`] as it decodes, its device string copied out of the input.
fn decode_tensor<'de, D: BorrowDecoder<'de>>(d: &mut D) -> Result<TensorMeta, DecodeError> {
    Ok(TensorMeta {
        shape: Decode::decode(d)?,
        dtype: Dtype::decode(d)?,
        stride: Decode::decode(d)?,
        storage_offset: Decode::decode(d)?,
        device: if is_some(d)? { Some(string(d)?) } else { None },
        requires_grad: Decode::decode(d)?,
    })
}
