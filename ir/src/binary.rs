//! The compact binary form: an 8-byte magic, a format version, then the program in bincode.
//!
//! Node references are program positions, so reading needs no name lookups; every position is
//! still checked before a graph is built, and decoding is bounded in memory, so a corrupt or
//! hostile file gives an error, never a panic or a huge allocation.

use crate::{
    Diagnostics, Form, Grad, Graph, GraphKind, ImportError, Location, Node, NodeId, Param, Problem,
    Program,
};
use bincode::{Decode, Encode};

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
