//! The fast path: one pass from JSON text straight into the IR, for well-formed documents.
//!
//! Nodes go into their [`Graph`] as they are read, and each `{"node": name}` resolves on the
//! spot against the nodes read so far (a valid reference always names an earlier node), so no
//! intermediate document, name table or second copy of any node is built. A node's `meta` is
//! looked up by its text among those the graph has already read ([`Metas`]), and only a new
//! one is read, by typed visitors, not into a `serde_json::Value`.
//!
//! The fast path only ever accepts: anything it does not like — a problem the careful path
//! would report, but also merely unusual spellings such as a repeated key — makes it give up
//! ([`import`] returns `None`) and the careful path ([`super::raw`], [`super::lower`]) reads
//! the document again and reports exactly what it always has. So when it succeeds it must
//! build exactly the program the careful path would, and it may give up whenever it is unsure.

use super::arg_serde::{ArgSeed, ArgsSeed, ReadRef};
use crate::{
    Dim, Dtype, Grad, Graph, GraphKind, Kwargs, Meta, Node, NodeId, Op, Param, Program, Str,
    SymInt, TensorMeta, Val,
};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use std::collections::BTreeSet;
use std::fmt;

/// The document, or `None` if the careful path must decide.
pub(super) fn import(bytes: &[u8]) -> Option<Program> {
    // One UTF-8 check of the whole text is far cheaper than serde_json's check of every
    // string read from a byte slice; invalid text is the careful path's to report.
    let text = std::str::from_utf8(bytes).ok()?;
    let mut de = serde_json::Deserializer::from_str(text);
    let program = DocSeed.deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(program)
}

/// Giving up; the message is never shown.
fn give_up<E: de::Error>() -> E {
    E::custom("")
}

/// A map key, as its position in a list of known keys (`None` for any other key, which is
/// read past as the derived structs of the careful path do).
struct Key(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Option<usize>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key {
    type Value = Option<usize>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.0.iter().position(|k| *k == v))
    }
}

/// Keys seen in one object; a repeat gives up (serde's derive refuses some repeats and
/// `serde_json::Value` keeps the last of others: not worth telling apart here).
#[derive(Default)]
struct Seen(u32);

impl Seen {
    fn first<E: de::Error>(&mut self, k: usize) -> Result<(), E> {
        let bit = 1u32 << k;
        if self.0 & bit != 0 {
            return Err(give_up());
        }
        self.0 |= bit;
        Ok(())
    }
}

/// A string the visitor looks at without keeping (no allocation, escapes or not).
struct Peek<F>(F);

impl<'de, T, F: FnOnce(&str) -> Option<T>> DeserializeSeed<'de> for Peek<F> {
    type Value = T;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de, T, F: FnOnce(&str) -> Option<T>> Visitor<'de> for Peek<F> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        (self.0)(v).ok_or_else(give_up)
    }
}

/// `null` or a `T` read by the seed `S` (as `Option<T>` reads).
struct Nullable<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Nullable<S> {
    type Value = Option<S::Value>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de, S: DeserializeSeed<'de>> Visitor<'de> for Nullable<S> {
    type Value = Option<S::Value>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an option")
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        self.0.deserialize(d).map(Some)
    }
}

/// A value read as plain serde reads `T`.
struct Plain<T>(std::marker::PhantomData<T>);

fn plain<T>() -> Plain<T> {
    Plain(std::marker::PhantomData)
}

impl<'de, T: de::Deserialize<'de>> DeserializeSeed<'de> for Plain<T> {
    type Value = T;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        T::deserialize(d)
    }
}

// ---------------------------------------------------------------------------------------
// The document and its graphs.

struct DocSeed;

const DOC_KEYS: &[&str] = &[
    "format",
    "version",
    "name",
    "kind",
    "nodes",
    "params",
    "grads",
    "graphs",
    "persistent",
    "forward",
];

#[derive(Clone, Copy, PartialEq)]
enum Format {
    Graph,
    Program,
}

fn format(s: &str) -> Option<Format> {
    match s {
        "fx-graph" => Some(Format::Graph),
        "fx-program" => Some(Format::Program),
        _ => None,
    }
}

/// `check_version`'s test, on the number as `Value::as_f64` reads it.
fn version_ok(v: f64) -> bool {
    v.trunc() == 1.0
}

impl<'de> DeserializeSeed<'de> for DocSeed {
    type Value = Program;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Program, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for DocSeed {
    type Value = Program;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an fx-graph document")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Program, A::Error> {
        let mut seen = Seen::default();
        let mut fmt = None;
        let mut version = None;
        // The top level as a single graph; in a bundle its fields are read and dropped, as
        // the careful path's one-pass reading does.
        let mut top = GraphParts::default();
        let mut graphs = None;
        let mut persistent = BTreeSet::new();
        while let Some(key) = map.next_key_seed(Key(DOC_KEYS))? {
            let Some(k) = key else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            seen.first(k)?;
            match k {
                0 => fmt = Some(map.next_value_seed(Peek(format))?),
                1 => version = Some(map.next_value::<f64>()?),
                7 => graphs = Some(map.next_value_seed(GraphsSeed)?),
                8 => persistent = map.next_value::<Vec<String>>()?.into_iter().collect(),
                _ => top.field(k, &mut map)?,
            }
        }
        if !version.is_some_and(version_ok) {
            return Err(give_up());
        }
        let program = match fmt {
            Some(Format::Graph) => Program::single(top.finish()?),
            Some(Format::Program) => Program::bundle(graphs.ok_or_else(give_up)?),
            None => return Err(give_up()),
        };
        Ok(Program {
            persistent_list: persistent,
            ..program
        })
    }
}

struct GraphsSeed;

impl<'de> DeserializeSeed<'de> for GraphsSeed {
    type Value = Vec<Graph>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for GraphsSeed {
    type Value = Vec<Graph>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of graphs")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(g) = seq.next_element_seed(GraphSeed)? {
            out.push(g);
        }
        Ok(out)
    }
}

/// One graph of a bundle.
struct GraphSeed;

impl<'de> DeserializeSeed<'de> for GraphSeed {
    type Value = Graph;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Graph, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for GraphSeed {
    type Value = Graph;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an fx-graph")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Graph, A::Error> {
        let mut seen = Seen::default();
        let mut parts = GraphParts::default();
        while let Some(key) = map.next_key_seed(Key(DOC_KEYS))? {
            let Some(k) = key else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            seen.first(k)?;
            match k {
                // A graph's own header may be absent or null; if given it must agree.
                0 => {
                    let f = map.next_value_seed(Nullable(Peek(format)))?;
                    if f.is_some_and(|f| f != Format::Graph) {
                        return Err(give_up());
                    }
                }
                1 => {
                    if !map.next_value::<Option<f64>>()?.is_none_or(version_ok) {
                        return Err(give_up());
                    }
                }
                // The program's list is read at the top level only, but must be one here
                // too, as the careful path reads it.
                8 => {
                    map.next_value::<Vec<String>>()?;
                }
                // Not a field of a bundle's graph.
                7 => {
                    map.next_value::<IgnoredAny>()?;
                }
                _ => parts.field(k, &mut map)?,
            }
        }
        parts.finish()
    }
}

/// A graph's fields as they arrive, in any order.
#[derive(Default)]
struct GraphParts {
    name: Option<String>,
    kind: Option<GraphKind>,
    forward: Option<String>,
    graph: Option<Graph>,
    params: Vec<FastParam>,
    grads: Vec<Grad>,
}

struct FastParam {
    name: String,
    node: String,
    shape: Vec<Dim>,
    dtype: Dtype,
    persistent: bool,
}

impl GraphParts {
    /// Reads the value of key `k` of [`DOC_KEYS`] (one of name, kind, nodes, params, grads,
    /// forward).
    fn field<'de, A: MapAccess<'de>>(&mut self, k: usize, map: &mut A) -> Result<(), A::Error> {
        match k {
            2 => self.name = map.next_value()?,
            3 => self.kind = map.next_value_seed(Nullable(Peek(GraphKind::from_name)))?,
            4 => self.graph = Some(map.next_value_seed(NodesSeed)?),
            5 => self.params = map.next_value_seed(ListSeed(ParamSeed))?,
            6 => self.grads = map.next_value_seed(ListSeed(GradSeed))?,
            9 => self.forward = map.next_value()?,
            _ => return Err(give_up()),
        }
        Ok(())
    }

    fn finish<E: de::Error>(self) -> Result<Graph, E> {
        let mut g = self.graph.ok_or_else(give_up)?;
        g.name = self.name;
        g.kind = self.kind.unwrap_or_default();
        g.forward = self.forward;
        g.params.reserve_exact(self.params.len());
        for p in self.params {
            let node = g.node_by_name(&p.node).ok_or_else(give_up)?;
            g.params.push(Param {
                name: p.name,
                node,
                shape: p.shape,
                dtype: p.dtype,
                persistent: p.persistent,
            });
        }
        g.grads = self.grads;
        Ok(g)
    }
}

/// A JSON array, each item read by a copy of the seed.
struct ListSeed<S>(S);

impl<'de, S: DeserializeSeed<'de> + Copy> DeserializeSeed<'de> for ListSeed<S> {
    type Value = Vec<S::Value>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, S: DeserializeSeed<'de> + Copy> Visitor<'de> for ListSeed<S> {
    type Value = Vec<S::Value>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(x) = seq.next_element_seed(self.0)? {
            out.push(x);
        }
        // Exact, as the careful path's collected vectors are (a shrink is in place).
        out.shrink_to_fit();
        Ok(out)
    }
}

#[derive(Clone, Copy)]
struct ParamSeed;

const PARAM_KEYS: &[&str] = &["name", "node", "shape", "dtype", "persistent"];

impl<'de> DeserializeSeed<'de> for ParamSeed {
    type Value = FastParam;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<FastParam, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ParamSeed {
    type Value = FastParam;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a parameter")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<FastParam, A::Error> {
        let mut seen = Seen::default();
        let (mut name, mut node, mut shape, mut dtype) = (None, None, None, None);
        let mut persistent = false;
        while let Some(key) = map.next_key_seed(Key(PARAM_KEYS))? {
            let Some(k) = key else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            seen.first(k)?;
            match k {
                0 => name = Some(map.next_value()?),
                1 => node = Some(map.next_value()?),
                2 => shape = Some(map.next_value_seed(ListSeed(DimSeed))?),
                3 => dtype = Some(map.next_value_seed(Peek(Dtype::from_name))?),
                _ => persistent = map.next_value()?,
            }
        }
        match (name, node, shape, dtype) {
            (Some(name), Some(node), Some(shape), Some(dtype)) => Ok(FastParam {
                name,
                node,
                shape,
                dtype,
                persistent,
            }),
            _ => Err(give_up()),
        }
    }
}

#[derive(Clone, Copy)]
struct GradSeed;

const GRAD_KEYS: &[&str] = &["param", "output_index", "persistent"];

impl<'de> DeserializeSeed<'de> for GradSeed {
    type Value = Grad;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Grad, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for GradSeed {
    type Value = Grad;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a gradient")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Grad, A::Error> {
        let mut seen = Seen::default();
        let (mut param, mut output_index, mut persistent) = (None, None, false);
        while let Some(key) = map.next_key_seed(Key(GRAD_KEYS))? {
            let Some(k) = key else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            seen.first(k)?;
            match k {
                0 => param = Some(map.next_value()?),
                // An i64 in the careful path, refused there unless it fits a u32.
                1 => output_index = Some(map.next_value::<i64>()?),
                _ => persistent = map.next_value()?,
            }
        }
        match (param, output_index.and_then(|i| u32::try_from(i).ok())) {
            (Some(param), Some(output_index)) => Ok(Grad {
                param,
                output_index,
                persistent,
            }),
            _ => Err(give_up()),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Nodes.

/// The `nodes` array, read into a new graph.
struct NodesSeed;

impl<'de> DeserializeSeed<'de> for NodesSeed {
    type Value = Graph;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Graph, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for NodesSeed {
    type Value = Graph;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of nodes")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Graph, A::Error> {
        let mut g = Graph::new(None, GraphKind::Forward);
        let mut metas = Metas::default();
        while let Some(node) = seq.next_element_seed(NodeSeed {
            graph: &g,
            metas: &mut metas,
        })? {
            // A repeated name is refused here.
            g.push(node).map_err(|_| give_up())?;
        }
        Ok(g)
    }
}

/// One node, its references resolved against the nodes of the graph so far.
struct NodeSeed<'g, 'de> {
    graph: &'g Graph,
    metas: &'g mut Metas<'de>,
}

const NODE_KEYS: &[&str] = &["name", "op", "target", "args", "kwargs", "meta"];

impl<'de> DeserializeSeed<'de> for NodeSeed<'_, 'de> {
    type Value = Node;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for NodeSeed<'_, 'de> {
    type Value = Node;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a node")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut seen = Seen::default();
        let resolve = Resolve(self.graph);
        let (mut name, mut op, mut target): (Option<Str>, _, Option<Str>) = (None, None, None);
        let mut args = Vec::new();
        let mut kwargs = Kwargs::new();
        let mut meta = Meta::default();
        while let Some(key) = map.next_key_seed(Key(NODE_KEYS))? {
            let Some(k) = key else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            seen.first(k)?;
            match k {
                0 => name = Some(map.next_value()?),
                1 => op = Some(map.next_value_seed(Peek(Op::from_name))?),
                2 => target = map.next_value()?,
                3 => args = map.next_value_seed(ArgsSeed(resolve))?,
                4 => kwargs = map.next_value_seed(KwargsSeed(resolve))?,
                _ => meta = self.metas.read(map.next_value()?)?,
            }
        }
        let (Some(name), Some(op)) = (name, op) else {
            return Err(give_up());
        };
        let target = match (target, op) {
            (Some(t), _) => t,
            (None, Op::Output) => "output".into(),
            (None, Op::Placeholder) => name.clone(),
            (None, _) => return Err(give_up()),
        };
        Ok(Node {
            name,
            op,
            target,
            args,
            kwargs,
            meta: Box::new(meta),
        })
    }
}

/// Resolves `{"node": name}` to an earlier node that is not an output; anything else
/// (unknown, later, the node itself, an output) gives up.
#[derive(Clone, Copy)]
struct Resolve<'g>(&'g Graph);

impl<'de> ReadRef<'de> for Resolve<'_> {
    type Ref = NodeId;
    fn read<A: MapAccess<'de>>(self, map: &mut A) -> Result<NodeId, A::Error> {
        let g = self.0;
        map.next_value_seed(Peek(|name: &str| {
            g.node_by_name(name)
                .filter(|&id| g.node(id).op != Op::Output)
        }))
    }
}

struct KwargsSeed<'g>(Resolve<'g>);

impl<'de> DeserializeSeed<'de> for KwargsSeed<'_> {
    type Value = Kwargs;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for KwargsSeed<'_> {
    type Value = Kwargs;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut pairs = Vec::new();
        while let Some(k) = map.next_key::<Str>()? {
            pairs.push((k, map.next_value_seed(ArgSeed(self.0))?));
        }
        let read = pairs.len();
        let out = Kwargs::from_pairs(pairs);
        // The careful path keeps the last of repeated keys; not worth matching.
        if out.len() != read {
            return Err(give_up());
        }
        Ok(out)
    }
}

struct MetaSeed;

const META_KEYS: &[&str] = &["val", "aliases", "mutates", "device_time_ms"];

impl<'de> DeserializeSeed<'de> for MetaSeed {
    type Value = Meta;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Meta, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MetaSeed {
    type Value = Meta;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("node metadata")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Meta, A::Error> {
        let mut seen = Seen::default();
        let mut meta = Meta::default();
        while let Some(key) = map.next_key_seed(Key(META_KEYS))? {
            let Some(k) = key else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            seen.first(k)?;
            match k {
                0 => meta.val = map.next_value_seed(Nullable(ValSeed))?,
                // Each entry must fit a u32, or the careful path reports it.
                1 => meta.aliases = map.next_value()?,
                2 => meta.mutates = map.next_value()?,
                _ => meta.device_time_ms = map.next_value()?,
            }
        }
        Ok(meta)
    }
}

/// The `meta`s of a graph read so far, by their text.
///
/// A training step spells the same few hundred metadata objects over and over (every layer's
/// activations have the same shape), so each is parsed once and later nodes with the same
/// text share its tensor metadata. Skipping over the text is much cheaper than reading the
/// object, and cheaper still than building shape and stride lists from it again.
#[derive(Default)]
struct Metas<'de>(hashbrown::HashMap<&'de str, Meta>);

impl<'de> Metas<'de> {
    fn read<E: de::Error>(&mut self, raw: &'de RawValue) -> Result<Meta, E> {
        let text = raw.get();
        if let Some(m) = self.0.get(text) {
            return Ok(m.clone());
        }
        let mut de = serde_json::Deserializer::from_str(text);
        let m = MetaSeed.deserialize(&mut de).map_err(|_| give_up())?;
        self.0.insert(text, m.clone());
        Ok(m)
    }
}

// ---------------------------------------------------------------------------------------
// `meta.val`, typed: what `values::val` accepts from a `serde_json::Value`, and nothing else.

struct ValSeed;

impl<'de> DeserializeSeed<'de> for ValSeed {
    type Value = Val;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Val, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValSeed {
    type Value = Val;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Val, E> {
        Ok(Val::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Val, E> {
        Ok(Val::Int(v))
    }
    // `Number::as_i64`, else `as_f64`.
    fn visit_u64<E>(self, v: u64) -> Result<Val, E> {
        Ok(i64::try_from(v).map_or(Val::Float(v as f64), Val::Int))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Val, E> {
        Ok(Val::Float(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Val, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(item) = seq.next_element_seed(Nullable(ObjSeed))? {
            // A tuple's entries are tensors (a `sym` key in one is ignored).
            items.push(item.map(Obj::tensor).transpose()?.map(Into::into));
        }
        Ok(Val::Tuple(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Val, A::Error> {
        let o = ObjSeed.visit_map(map)?;
        if o.sym.is_some() {
            Ok(Val::Sym(o.sym_int()?))
        } else {
            Ok(Val::Tensor(o.tensor()?.into()))
        }
    }
}

/// The fields of a TENSOR or SYM object; which it is is decided once it is all read.
#[derive(Default)]
struct Obj {
    shape: Option<Vec<Dim>>,
    dtype: Option<Dtype>,
    stride: Option<Vec<Dim>>,
    storage_offset: Option<Dim>,
    device: Option<Str>,
    requires_grad: Option<bool>,
    sym: Option<Str>,
    hint: Option<i64>,
}

impl Obj {
    fn tensor<E: de::Error>(self) -> Result<TensorMeta, E> {
        match (self.shape, self.dtype) {
            (Some(shape), Some(dtype)) => Ok(TensorMeta {
                shape,
                dtype,
                stride: self.stride,
                storage_offset: self.storage_offset,
                device: self.device,
                requires_grad: self.requires_grad,
            }),
            _ => Err(give_up()),
        }
    }

    fn sym_int<E: de::Error>(self) -> Result<SymInt, E> {
        match (self.sym, self.hint) {
            (Some(expr), Some(hint)) => Ok(SymInt { expr, hint }),
            _ => Err(give_up()),
        }
    }
}

#[derive(Clone, Copy)]
struct ObjSeed;

const OBJ_KEYS: &[&str] = &[
    "shape",
    "dtype",
    "stride",
    "storage_offset",
    "device",
    "requires_grad",
    "sym",
    "hint",
];

impl<'de> DeserializeSeed<'de> for ObjSeed {
    type Value = Obj;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Obj, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ObjSeed {
    type Value = Obj;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a TENSOR or SYM")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Obj, A::Error> {
        let mut seen = Seen::default();
        let mut o = Obj::default();
        while let Some(key) = map.next_key_seed(Key(OBJ_KEYS))? {
            let Some(k) = key else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            seen.first(k)?;
            match k {
                // `shape` and `dtype` must not be null; the others may.
                0 => o.shape = Some(map.next_value_seed(ListSeed(DimSeed))?),
                1 => o.dtype = Some(map.next_value_seed(Peek(Dtype::from_name))?),
                2 => o.stride = map.next_value_seed(Nullable(ListSeed(DimSeed)))?,
                3 => o.storage_offset = map.next_value_seed(Nullable(DimSeed))?,
                4 => o.device = map.next_value_seed(Nullable(plain::<Str>()))?,
                5 => o.requires_grad = map.next_value_seed(Nullable(plain::<bool>()))?,
                6 => o.sym = Some(map.next_value::<Str>()?),
                _ => o.hint = Some(map.next_value::<i64>()?),
            }
        }
        Ok(o)
    }
}

/// A shape or stride entry: a non-negative integer, or a SYM with a non-negative hint.
#[derive(Clone, Copy)]
struct DimSeed;

impl<'de> DeserializeSeed<'de> for DimSeed {
    type Value = Dim;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Dim, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for DimSeed {
    type Value = Dim;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a dimension")
    }
    fn visit_u64<E>(self, v: u64) -> Result<Dim, E> {
        Ok(Dim::Const(v))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Dim, A::Error> {
        // A SYM's other keys are read past, tensor-looking or not, as `values::dim` does;
        // here they must at least read cleanly.
        let o = ObjSeed.visit_map(map)?;
        if o.sym.is_none() {
            return Err(give_up());
        }
        let s = o.sym_int()?;
        if s.hint < 0 {
            return Err(give_up());
        }
        Ok(Dim::Sym(s))
    }
}
