//! Deterministic JSON export: fixed field order, kwargs sorted by key, one node per line.

use crate::{Arg, Dim, Form, Graph, Meta, Node, NodeId, Program, SideTable, TensorMeta, Val};
use serde::Serialize;
use serde::ser::{SerializeMap, SerializeSeq, Serializer};
use std::io::Write;

/// Writes a program as an `fx-program` bundle, or as a single `fx-graph` if it was read as one.
pub fn export(program: &Program) -> Vec<u8> {
    let mut out = Vec::new();
    if program.form == Form::Graph && program.graphs.len() == 1 {
        write_graph(&mut out, &program.graphs[0]);
    } else {
        out.extend_from_slice(b"{\"format\":\"fx-program\",\"version\":1,\"graphs\":[\n");
        for (i, g) in program.graphs.iter().enumerate() {
            if i > 0 {
                out.extend_from_slice(b",\n");
            }
            write_graph(&mut out, g);
        }
        out.extend_from_slice(b"\n]}");
    }
    out.push(b'\n');
    out
}

/// Writes one graph as an `fx-graph` document.
pub fn export_graph(graph: &Graph) -> Vec<u8> {
    let mut out = Vec::new();
    write_graph(&mut out, graph);
    out.push(b'\n');
    out
}

fn write_graph(out: &mut Vec<u8>, g: &Graph) {
    let mut names = SideTable::new(g, "");
    for (id, n) in g.nodes() {
        names[id] = n.name.as_str();
    }
    out.extend_from_slice(b"{\"format\":\"fx-graph\",\"version\":1,");
    if let Some(name) = &g.name {
        json(out, "name", name);
    }
    json(out, "kind", g.kind.name());
    out.extend_from_slice(b"\"nodes\":[\n");
    for (i, (_, n)) in g.nodes().enumerate() {
        if i > 0 {
            out.extend_from_slice(b",\n");
        }
        to_json(
            out,
            &NodeOut {
                node: n,
                names: &names,
            },
        );
    }
    out.extend_from_slice(b"\n],\"params\":[");
    for (i, p) in g.params.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let shape = DimsOut(&p.shape);
        let param = ParamOut {
            name: &p.name,
            node: names[p.node],
            shape,
            dtype: p.dtype.name(),
            persistent: p.persistent,
        };
        to_json(out, &param);
    }
    out.extend_from_slice(b"],\"grads\":[");
    for (i, gr) in g.grads.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        to_json(
            out,
            &GradOut {
                param: &gr.param,
                output_index: gr.output_index,
            },
        );
    }
    out.extend_from_slice(b"]}");
}

fn json(out: &mut Vec<u8>, key: &str, value: &str) {
    to_json(out, key);
    out.push(b':');
    to_json(out, value);
    out.push(b',');
}

fn to_json<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    // Serializing these types into a Vec cannot fail: no maps with non-string keys, no I/O.
    let _ = serde_json::to_writer(&mut *out, value);
    let _ = out.flush();
}

#[derive(Serialize)]
struct ParamOut<'a> {
    name: &'a str,
    node: &'a str,
    shape: DimsOut<'a>,
    dtype: &'a str,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    persistent: bool,
}

#[derive(Serialize)]
struct GradOut<'a> {
    param: &'a str,
    output_index: u32,
}

struct NodeOut<'a> {
    node: &'a Node,
    names: &'a SideTable<&'a str>,
}

impl Serialize for NodeOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let n = self.node;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("name", &n.name)?;
        m.serialize_entry("op", n.op.name())?;
        m.serialize_entry("target", &n.target)?;
        m.serialize_entry(
            "args",
            &ArgsOut {
                args: &n.args,
                names: self.names,
            },
        )?;
        m.serialize_entry(
            "kwargs",
            &KwargsOut {
                node: n,
                names: self.names,
            },
        )?;
        // Decided on what will be written, not on the fields: a meta whose only contents JSON
        // cannot spell must vanish here, as it does on re-import, or export is no fixed point.
        if !MetaOut(&n.meta).is_empty() {
            m.serialize_entry("meta", &MetaOut(&n.meta))?;
        }
        m.end()
    }
}

struct ArgsOut<'a> {
    args: &'a [Arg<NodeId>],
    names: &'a SideTable<&'a str>,
}

impl Serialize for ArgsOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.args.len()))?;
        for a in self.args {
            seq.serialize_element(&ArgOut {
                arg: a,
                names: self.names,
            })?;
        }
        seq.end()
    }
}

struct KwargsOut<'a> {
    node: &'a Node,
    names: &'a SideTable<&'a str>,
}

impl Serialize for KwargsOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.node.kwargs.len()))?;
        for (k, a) in &self.node.kwargs {
            m.serialize_entry(
                k,
                &ArgOut {
                    arg: a,
                    names: self.names,
                },
            )?;
        }
        m.end()
    }
}

struct ArgOut<'a> {
    arg: &'a Arg<NodeId>,
    names: &'a SideTable<&'a str>,
}

fn one<S: Serializer, V: Serialize + ?Sized>(
    s: S,
    key: &str,
    value: &V,
) -> Result<S::Ok, S::Error> {
    let mut m = s.serialize_map(Some(1))?;
    m.serialize_entry(key, value)?;
    m.end()
}

impl Serialize for ArgOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.arg {
            Arg::None => s.serialize_unit(),
            Arg::Bool(b) => s.serialize_bool(*b),
            Arg::Int(i) => s.serialize_i64(*i),
            Arg::Float(x) if x.is_finite() => s.serialize_f64(*x),
            Arg::Float(x) => one(
                s,
                "float",
                if x.is_nan() {
                    "nan"
                } else if *x > 0.0 {
                    "inf"
                } else {
                    "-inf"
                },
            ),
            Arg::Str(v) => s.serialize_str(v),
            Arg::Node(id) => one(s, "node", self.names[*id]),
            Arg::List(items) => ArgsOut {
                args: items,
                names: self.names,
            }
            .serialize(s),
            Arg::Dtype(d) => one(s, "dtype", d.name()),
            Arg::Device(v) => one(s, "device", v),
            Arg::Layout(v) => one(s, "layout", v),
            Arg::MemoryFormat(v) => one(s, "memory_format", v),
            Arg::Slice(parts) => one(
                s,
                "slice",
                &ArgsOut {
                    args: &parts[..],
                    names: self.names,
                },
            ),
            Arg::Sym(sym) => SymOut(&sym.expr, sym.hint).serialize(s),
            Arg::Repr(v) => one(s, "repr", v),
        }
    }
}

struct SymOut<'a>(&'a str, i64);

impl Serialize for SymOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(2))?;
        m.serialize_entry("sym", self.0)?;
        m.serialize_entry("hint", &self.1)?;
        m.end()
    }
}

struct MetaOut<'a>(&'a Meta);

impl MetaOut<'_> {
    /// A non-finite float `val` or time has no JSON number; it is left out, as if absent.
    fn val(&self) -> Option<&Val> {
        self.0
            .val
            .as_ref()
            .filter(|v| !matches!(v, Val::Float(x) if !x.is_finite()))
    }

    fn time(&self) -> Option<f64> {
        self.0.device_time_ms.filter(|t| t.is_finite())
    }

    fn is_empty(&self) -> bool {
        self.val().is_none()
            && self.0.aliases.is_none()
            && self.0.mutates.is_none()
            && self.time().is_none()
    }
}

impl Serialize for MetaOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let meta = self.0;
        let mut m = s.serialize_map(None)?;
        if let Some(v) = self.val() {
            m.serialize_entry("val", &ValOut(v))?;
        }
        if let Some(a) = &meta.aliases {
            m.serialize_entry("aliases", a)?;
        }
        if let Some(a) = &meta.mutates {
            m.serialize_entry("mutates", a)?;
        }
        // Non-finite times are not JSON numbers; a missing time means the same to readers.
        if let Some(t) = self.time() {
            m.serialize_entry("device_time_ms", &t)?;
        }
        m.end()
    }
}

struct ValOut<'a>(&'a Val);

impl Serialize for ValOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Val::Tensor(t) => TensorOut(t).serialize(s),
            Val::Tuple(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for t in items {
                    seq.serialize_element(&t.as_ref().map(TensorOut))?;
                }
                seq.end()
            }
            Val::Sym(sym) => SymOut(&sym.expr, sym.hint).serialize(s),
            Val::Int(i) => s.serialize_i64(*i),
            Val::Float(x) if x.is_finite() => s.serialize_f64(*x),
            Val::Float(_) => s.serialize_unit(),
            Val::Bool(b) => s.serialize_bool(*b),
        }
    }
}

struct TensorOut<'a>(&'a TensorMeta);

impl Serialize for TensorOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let t = self.0;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("shape", &DimsOut(&t.shape))?;
        m.serialize_entry("dtype", t.dtype.name())?;
        if let Some(st) = &t.stride {
            m.serialize_entry("stride", &DimsOut(st))?;
        }
        if let Some(o) = &t.storage_offset {
            m.serialize_entry("storage_offset", &DimOut(o))?;
        }
        if let Some(d) = &t.device {
            m.serialize_entry("device", d)?;
        }
        if let Some(r) = t.requires_grad {
            m.serialize_entry("requires_grad", &r)?;
        }
        m.end()
    }
}

struct DimsOut<'a>(&'a [Dim]);

impl Serialize for DimsOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for d in self.0 {
            seq.serialize_element(&DimOut(d))?;
        }
        seq.end()
    }
}

struct DimOut<'a>(&'a Dim);

impl Serialize for DimOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Dim::Const(n) => s.serialize_u64(*n),
            Dim::Sym(sym) => SymOut(&sym.expr, sym.hint).serialize(s),
        }
    }
}
