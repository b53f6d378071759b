//! Argument trees: the ARG table of the fx-graph v1 format as one enum.
//!
//! `Arg<R>` is generic over how a node reference is spelled: the IR uses [`crate::NodeId`],
//! the JSON form names (`String`) and the binary form program positions (`u32`). One type for
//! all three keeps the encodings from drifting apart.

use crate::{Dtype, SymInt};
use bincode::Encode;

/// The deepest ARG either encoding accepts, in JSON nesting levels ([`Arg::depth`]). Well
/// inside serde_json's recursion limit even in a bundle, so that whatever one encoding accepts
/// the other can carry; and it bounds every recursive walk over an ARG.
pub const MAX_DEPTH: usize = 64;

/// `Decode` is written out (in `binary::arg`) to bound nesting; the wire format is exactly
/// what `#[derive(Decode)]` reads: a `u32` variant index in declaration order, then the fields.
#[derive(Clone, Debug, Encode)]
pub enum Arg<R> {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Node(R),
    List(Vec<Arg<R>>),
    Dtype(Dtype),
    Device(String),
    Layout(String),
    MemoryFormat(String),
    Slice(Box<[Arg<R>; 3]>),
    Sym(SymInt),
    Repr(String),
}

// Floats compare by bit pattern so that a `nan` literal equals itself after a round trip.
impl<R: PartialEq> PartialEq for Arg<R> {
    fn eq(&self, other: &Self) -> bool {
        use Arg::*;
        match (self, other) {
            (None, None) => true,
            (Bool(a), Bool(b)) => a == b,
            (Int(a), Int(b)) => a == b,
            (Float(a), Float(b)) => a.to_bits() == b.to_bits(),
            (Str(a), Str(b)) | (Device(a), Device(b)) | (Layout(a), Layout(b)) => a == b,
            (MemoryFormat(a), MemoryFormat(b)) | (Repr(a), Repr(b)) => a == b,
            (Node(a), Node(b)) => a == b,
            (List(a), List(b)) => a == b,
            (Dtype(a), Dtype(b)) => a == b,
            (Slice(a), Slice(b)) => a == b,
            (Sym(a), Sym(b)) => a == b,
            _ => false,
        }
    }
}

impl<R> Arg<R> {
    /// How deeply the JSON spelling of this ARG nests objects and arrays: 0 for a plain
    /// literal, 1 for a one-key object (`{"node": ..}`, `{"dtype": ..}`, non-finite floats,
    /// SYMs), plus 1 per enclosing list and 2 per enclosing slice (an object holding an array).
    /// Iterative, so any depth can be measured.
    pub fn depth(&self) -> usize {
        match self {
            Arg::List(items) if items.iter().all(Arg::is_flat) => {
                return 1 + items.iter().map(Arg::depth).max().unwrap_or(0);
            }
            Arg::List(_) | Arg::Slice(_) => {}
            Arg::Float(x) if x.is_finite() => return 0,
            Arg::None | Arg::Bool(_) | Arg::Int(_) | Arg::Float(_) | Arg::Str(_) => {
                return usize::from(matches!(self, Arg::Float(_)));
            }
            _ => return 1,
        }
        let mut deepest = 0;
        let mut stack = vec![(self, 0usize)];
        while let Some((a, above)) = stack.pop() {
            let here = match a {
                Arg::None | Arg::Bool(_) | Arg::Int(_) | Arg::Str(_) => above,
                Arg::Float(x) if x.is_finite() => above,
                Arg::List(items) => {
                    stack.extend(items.iter().map(|i| (i, above + 1)));
                    above + 1
                }
                Arg::Slice(parts) => {
                    stack.extend(parts.iter().map(|i| (i, above + 2)));
                    above + 2
                }
                _ => above + 1,
            };
            deepest = deepest.max(here);
        }
        deepest
    }

    /// Not a list or slice.
    fn is_flat(&self) -> bool {
        !matches!(self, Arg::List(_) | Arg::Slice(_))
    }

    /// Calls `f` on every node reference, depth first, left to right.
    pub fn for_each_ref<'a>(&'a self, f: &mut impl FnMut(&'a R)) {
        match self {
            Arg::Node(r) => f(r),
            Arg::List(items) => items.iter().for_each(|a| a.for_each_ref(f)),
            Arg::Slice(parts) => parts.iter().for_each(|a| a.for_each_ref(f)),
            _ => {}
        }
    }

    /// Rewrites every node reference with `f`, keeping the tree's shape.
    pub fn try_map_refs<S, E>(&self, f: &mut impl FnMut(&R) -> Result<S, E>) -> Result<Arg<S>, E> {
        Ok(match self {
            Arg::None => Arg::None,
            Arg::Bool(b) => Arg::Bool(*b),
            Arg::Int(i) => Arg::Int(*i),
            Arg::Float(x) => Arg::Float(*x),
            Arg::Str(s) => Arg::Str(s.clone()),
            Arg::Node(r) => Arg::Node(f(r)?),
            Arg::List(items) => Arg::List(
                items
                    .iter()
                    .map(|a| a.try_map_refs(f))
                    .collect::<Result<_, _>>()?,
            ),
            Arg::Dtype(d) => Arg::Dtype(*d),
            Arg::Device(s) => Arg::Device(s.clone()),
            Arg::Layout(s) => Arg::Layout(s.clone()),
            Arg::MemoryFormat(s) => Arg::MemoryFormat(s.clone()),
            Arg::Slice(parts) => {
                let [a, b, c] = &**parts;
                Arg::Slice(Box::new([
                    a.try_map_refs(f)?,
                    b.try_map_refs(f)?,
                    c.try_map_refs(f)?,
                ]))
            }
            Arg::Sym(s) => Arg::Sym(s.clone()),
            Arg::Repr(s) => Arg::Repr(s.clone()),
        })
    }

    /// Infallible [`Arg::try_map_refs`].
    pub fn map_refs<S>(&self, f: &mut impl FnMut(&R) -> S) -> Arg<S> {
        let r: Result<Arg<S>, std::convert::Infallible> = self.try_map_refs(&mut |r| Ok(f(r)));
        match r {
            Ok(a) => a,
            Err(never) => match never {},
        }
    }

    /// The node this argument references directly, if it is a bare reference.
    pub fn as_node(&self) -> Option<&R> {
        match self {
            Arg::Node(r) => Some(r),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Arg::Int(i) => Some(*i),
            Arg::Sym(s) => Some(s.hint),
            _ => None,
        }
    }

    pub fn as_list(&self) -> Option<&[Arg<R>]> {
        match self {
            Arg::List(items) => Some(items),
            _ => None,
        }
    }
}
