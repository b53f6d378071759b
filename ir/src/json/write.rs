//! Deterministic JSON export: fixed field order, kwargs sorted by key, one node per line.
//!
//! The document is written directly as bytes: field names are constants, and a string is
//! copied as it is unless it holds a byte JSON must escape, in which case serde_json writes
//! it. Numbers are written as serde_json writes them, so the text is what serializing the
//! same values with serde_json would give.

use crate::{Arg, Dim, Form, Graph, Meta, Node, NodeId, Program, SideTable, TensorMeta, Val};
use rayon::prelude::*;
use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Arc;

/// Bytes per node of a typical export, to size the output once instead of growing it.
const BYTES_PER_NODE: usize = 320;

/// Writes a program as an `fx-program` bundle, or as a single `fx-graph` if it was read as one.
pub fn export(program: &Program) -> Vec<u8> {
    let nodes: usize = program.graphs.iter().map(Graph::len).sum();
    let mut out = Vec::with_capacity(nodes.saturating_mul(BYTES_PER_NODE));
    let listed = &program.persistent_list;
    if program.form == Form::Graph && program.graphs.len() == 1 {
        write_graph(&mut out, &program.graphs[0], listed);
    } else {
        out.extend_from_slice(b"{\"format\":\"fx-program\",\"version\":1,");
        if !listed.is_empty() {
            out.extend_from_slice(b"\"persistent\":");
            write_names(&mut out, listed);
            out.push(b',');
        }
        out.extend_from_slice(b"\"graphs\":[\n");
        if let Some((first, others)) = program.graphs.split_first() {
            // The graphs are written at once, one task each, and joined in order.
            let (_, others) = rayon::join(
                || write_graph(&mut out, first, &BTreeSet::new()),
                || {
                    others
                        .par_iter()
                        .map(|g| {
                            let mut text =
                                Vec::with_capacity(g.len().saturating_mul(BYTES_PER_NODE));
                            write_graph(&mut text, g, &BTreeSet::new());
                            text
                        })
                        .collect::<Vec<_>>()
                },
            );
            for text in others {
                out.extend_from_slice(b",\n");
                out.extend_from_slice(&text);
            }
        }
        out.extend_from_slice(b"\n]}");
    }
    out.push(b'\n');
    out
}

/// Writes one graph as an `fx-graph` document.
pub fn export_graph(graph: &Graph) -> Vec<u8> {
    let mut out = Vec::with_capacity(graph.len().saturating_mul(BYTES_PER_NODE));
    write_graph(&mut out, graph, &BTreeSet::new());
    out.push(b'\n');
    out
}

/// A JSON list of names, as serde_json writes one.
fn write_names(out: &mut Vec<u8>, names: &BTreeSet<String>) {
    // Writing plain strings into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, names);
}

/// One graph as an `fx-graph` document; `listed` is the program's list of persistent
/// parameters, written when the graph is the whole document.
fn write_graph(out: &mut Vec<u8>, g: &Graph, listed: &BTreeSet<String>) {
    let mut names = SideTable::new(g, "");
    for (id, n) in g.nodes() {
        names[id] = n.name.as_str();
    }
    let mut w = Writer {
        out,
        names: &names,
        tensors: hashbrown::HashMap::new(),
    };
    w.raw(b"{\"format\":\"fx-graph\",\"version\":1,");
    if let Some(name) = &g.name {
        w.raw(b"\"name\":");
        w.str(name);
        w.raw(b",");
    }
    w.raw(b"\"kind\":");
    w.str(g.kind.name());
    if let Some(f) = &g.forward {
        w.raw(b",\"forward\":");
        w.str(f);
    }
    w.raw(b",\"nodes\":[\n");
    for (i, (_, n)) in g.nodes().enumerate() {
        if i > 0 {
            w.raw(b",\n");
        }
        w.node(n);
    }
    w.raw(b"\n],\"params\":[");
    for (i, p) in g.params.iter().enumerate() {
        if i > 0 {
            w.raw(b",");
        }
        w.raw(b"{\"name\":");
        w.str(&p.name);
        w.raw(b",\"node\":");
        w.str(names[p.node]);
        w.raw(b",\"shape\":");
        w.dims(&p.shape);
        w.raw(b",\"dtype\":");
        w.str(p.dtype.name());
        if p.persistent {
            w.raw(b",\"persistent\":true");
        }
        w.raw(b"}");
    }
    w.raw(b"],\"grads\":[");
    for (i, gr) in g.grads.iter().enumerate() {
        if i > 0 {
            w.raw(b",");
        }
        w.raw(b"{\"param\":");
        w.str(&gr.param);
        w.raw(b",\"output_index\":");
        w.int(gr.output_index);
        if gr.persistent {
            w.raw(b",\"persistent\":true");
        }
        w.raw(b"}");
    }
    w.raw(b"]");
    if !listed.is_empty() {
        w.raw(b",\"persistent\":");
        write_names(w.out, listed);
    }
    w.raw(b"}");
}

/// The bytes a JSON string must escape: control characters, `"` and `\`.
const ESCAPED: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        t[b] = true;
        b += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

struct Writer<'a> {
    out: &'a mut Vec<u8>,
    names: &'a SideTable<&'a str>,
    /// Where each shared tensor metadata was first written: the nodes that share it copy
    /// those bytes instead of formatting it again. Keyed by address, for lookups only, so
    /// the output does not depend on it.
    tensors: hashbrown::HashMap<*const TensorMeta, Range<usize>>,
}

impl Writer<'_> {
    fn raw(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    fn str(&mut self, s: &str) {
        // Names, targets and dtypes almost never need escaping: copy those in one go.
        if !s.bytes().any(|b| ESCAPED[b as usize]) {
            self.out.push(b'"');
            self.out.extend_from_slice(s.as_bytes());
            self.out.push(b'"');
        } else {
            // Writing a string into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut *self.out, s);
        }
    }

    fn int(&mut self, n: impl itoa::Integer) {
        self.out
            .extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    }

    /// A finite float, as serde_json writes it (the shortest text that reads back exactly).
    fn float(&mut self, x: f64) {
        let _ = serde_json::to_writer(&mut *self.out, &x);
    }

    /// `[a,b,...]`, each item written by `each`.
    fn list<T>(&mut self, items: &[T], mut each: impl FnMut(&mut Self, &T)) {
        self.raw(b"[");
        for (i, x) in items.iter().enumerate() {
            if i > 0 {
                self.raw(b",");
            }
            each(self, x);
        }
        self.raw(b"]");
    }

    fn bool(&mut self, b: bool) {
        self.raw(if b { b"true" } else { b"false" });
    }

    /// `{"key":"value"}`, the spelling of the tagged argument kinds.
    fn tagged(&mut self, key: &[u8], value: &str) {
        self.raw(b"{\"");
        self.raw(key);
        self.raw(b"\":");
        self.str(value);
        self.raw(b"}");
    }

    fn node(&mut self, n: &Node) {
        self.raw(b"{\"name\":");
        self.str(&n.name);
        self.raw(b",\"op\":");
        self.str(n.op.name());
        self.raw(b",\"target\":");
        self.str(&n.target);
        self.raw(b",\"args\":");
        self.args(&n.args);
        self.raw(b",\"kwargs\":{");
        for (i, (k, a)) in n.kwargs.iter().enumerate() {
            if i > 0 {
                self.raw(b",");
            }
            self.str(k);
            self.raw(b":");
            self.arg(a);
        }
        self.raw(b"}");
        // Decided on what will be written, not on the fields: a meta whose only contents JSON
        // cannot spell must vanish here, as it does on re-import, or export is no fixed point.
        if !meta_is_empty(&n.meta) {
            self.raw(b",\"meta\":");
            self.meta(&n.meta);
        }
        self.raw(b"}");
    }

    fn args(&mut self, args: &[Arg<NodeId>]) {
        self.list(args, Self::arg);
    }

    fn arg(&mut self, arg: &Arg<NodeId>) {
        match arg {
            Arg::None => self.raw(b"null"),
            Arg::Bool(b) => self.bool(*b),
            Arg::Int(i) => self.int(*i),
            Arg::Float(x) if x.is_finite() => self.float(*x),
            Arg::Float(x) => self.tagged(
                b"float",
                if x.is_nan() {
                    "nan"
                } else if *x > 0.0 {
                    "inf"
                } else {
                    "-inf"
                },
            ),
            Arg::Str(v) => self.str(v),
            Arg::Node(id) => {
                let name = self.names[*id];
                self.tagged(b"node", name);
            }
            Arg::List(items) => self.args(items),
            Arg::Dtype(d) => self.tagged(b"dtype", d.name()),
            Arg::Device(v) => self.tagged(b"device", v),
            Arg::Layout(v) => self.tagged(b"layout", v),
            Arg::MemoryFormat(v) => self.tagged(b"memory_format", v),
            Arg::Slice(parts) => {
                self.raw(b"{\"slice\":");
                self.args(&parts[..]);
                self.raw(b"}");
            }
            Arg::Sym(sym) => self.sym(&sym.expr, sym.hint),
            Arg::Repr(v) => self.tagged(b"repr", v),
        }
    }

    fn sym(&mut self, expr: &str, hint: i64) {
        self.raw(b"{\"sym\":");
        self.str(expr);
        self.raw(b",\"hint\":");
        self.int(hint);
        self.raw(b"}");
    }

    fn meta(&mut self, meta: &Meta) {
        self.raw(b"{");
        let mut first = true;
        let mut key = |w: &mut Self, k: &[u8]| {
            if !std::mem::take(&mut first) {
                w.raw(b",");
            }
            w.raw(k);
        };
        if let Some(v) = meta_val(meta) {
            key(self, b"\"val\":");
            self.val(v);
        }
        if let Some(a) = &meta.aliases {
            key(self, b"\"aliases\":");
            self.indexes(a);
        }
        if let Some(a) = &meta.mutates {
            key(self, b"\"mutates\":");
            self.indexes(a);
        }
        if let Some(t) = meta_time(meta) {
            key(self, b"\"device_time_ms\":");
            self.float(t);
        }
        self.raw(b"}");
    }

    fn indexes(&mut self, xs: &[u32]) {
        self.list(xs, |w, &x| w.int(x));
    }

    fn val(&mut self, v: &Val) {
        match v {
            Val::Tensor(t) => self.tensor(t),
            Val::Tuple(items) => {
                self.list(items, |w, t| match t {
                    Some(t) => w.tensor(t),
                    None => w.raw(b"null"),
                });
            }
            Val::Sym(sym) => self.sym(&sym.expr, sym.hint),
            Val::Int(i) => self.int(*i),
            Val::Float(x) if x.is_finite() => self.float(*x),
            Val::Float(_) => self.raw(b"null"),
            Val::Bool(b) => self.bool(*b),
        }
    }

    fn tensor(&mut self, t: &Arc<TensorMeta>) {
        let key = Arc::as_ptr(t);
        if let Some(text) = self.tensors.get(&key) {
            self.out.extend_from_within(text.clone());
            return;
        }
        let start = self.out.len();
        self.tensor_fields(t);
        self.tensors.insert(key, start..self.out.len());
    }

    fn tensor_fields(&mut self, t: &TensorMeta) {
        self.raw(b"{\"shape\":");
        self.dims(&t.shape);
        self.raw(b",\"dtype\":");
        self.str(t.dtype.name());
        if let Some(st) = &t.stride {
            self.raw(b",\"stride\":");
            self.dims(st);
        }
        if let Some(o) = &t.storage_offset {
            self.raw(b",\"storage_offset\":");
            self.dim(o);
        }
        if let Some(d) = &t.device {
            self.raw(b",\"device\":");
            self.str(d);
        }
        if let Some(r) = t.requires_grad {
            self.raw(b",\"requires_grad\":");
            self.bool(r);
        }
        self.raw(b"}");
    }

    fn dims(&mut self, dims: &[Dim]) {
        self.list(dims, Self::dim);
    }

    fn dim(&mut self, d: &Dim) {
        match d {
            Dim::Const(n) => self.int(*n),
            Dim::Sym(sym) => self.sym(&sym.expr, sym.hint),
        }
    }
}

/// A non-finite float `val` has no JSON number; it is left out, as if absent.
fn meta_val(meta: &Meta) -> Option<&Val> {
    meta.val
        .as_ref()
        .filter(|v| !matches!(v, Val::Float(x) if !x.is_finite()))
}

/// Non-finite times are not JSON numbers; a missing time means the same to readers.
fn meta_time(meta: &Meta) -> Option<f64> {
    meta.device_time_ms.filter(|t| t.is_finite())
}

fn meta_is_empty(meta: &Meta) -> bool {
    meta_val(meta).is_none()
        && meta.aliases.is_none()
        && meta.mutates.is_none()
        && meta_time(meta).is_none()
}
