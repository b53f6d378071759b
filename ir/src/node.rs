//! Nodes: op kind, target, arguments and metadata.

use crate::{Arg, Kwargs, Str, Val};
use bincode::{Decode, Encode};

/// The FX node kinds that occur in AOT/export graphs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Encode, Decode)]
pub enum Op {
    Placeholder,
    GetAttr,
    CallFunction,
    Output,
}

impl Op {
    /// Every op kind, in declaration order (the binary form's variant order).
    pub const ALL: [Op; 4] = [Op::Placeholder, Op::GetAttr, Op::CallFunction, Op::Output];

    pub fn name(self) -> &'static str {
        match self {
            Op::Placeholder => "placeholder",
            Op::GetAttr => "get_attr",
            Op::CallFunction => "call_function",
            Op::Output => "output",
        }
    }

    pub fn from_name(name: &str) -> Option<Op> {
        Some(match name {
            "placeholder" => Op::Placeholder,
            "get_attr" => Op::GetAttr,
            "call_function" => Op::CallFunction,
            "output" => Op::Output,
            _ => return None,
        })
    }
}

/// `meta`: what the exporter recorded about a node. Every field is optional in the format.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Meta {
    pub val: Option<Val>,
    /// Indexes into `args` whose storage the output may share; `None` = not recorded.
    pub aliases: Option<Vec<u32>>,
    /// Indexes into `args` written in place; `None` = not recorded.
    pub mutates: Option<Vec<u32>>,
    pub device_time_ms: Option<f64>,
}

/// One node, with references spelled as `R` (see [`crate::arg`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Node<R = crate::NodeId> {
    pub name: Str,
    pub op: Op,
    pub target: Str,
    pub args: Vec<Arg<R>>,
    /// Sorted by key, so that output never depends on the input's key order.
    pub kwargs: Kwargs<R>,
    /// Out of line: most passes scan nodes for their op, target and arguments only, and a
    /// node that holds its metadata inline is too large for a whole graph's nodes to stay
    /// in cache.
    pub meta: Box<Meta>,
}

impl<R> Node<R> {
    /// A `call_function` node with no keyword arguments and empty metadata.
    pub fn call(name: impl Into<Str>, target: impl Into<Str>, args: Vec<Arg<R>>) -> Node<R> {
        Node {
            name: name.into(),
            op: Op::CallFunction,
            target: target.into(),
            args,
            kwargs: Kwargs::new(),
            meta: Box::default(),
        }
    }

    /// Every node reference in `args` then `kwargs` (in key order), with repeats.
    pub fn refs(&self) -> impl Iterator<Item = &R> {
        let mut out = Vec::new();
        self.for_each_ref(|r| out.push(r));
        out.into_iter()
    }

    /// Calls `f` on every node reference in `args` then `kwargs` (in key order), with
    /// repeats: [`Node::refs`] without collecting them.
    pub fn for_each_ref<'a>(&'a self, mut f: impl FnMut(&'a R)) {
        let mut visit = |a: &'a Arg<R>| match a {
            // Most arguments are a reference or a scalar: no call for them.
            Arg::Node(r) => f(r),
            Arg::List(_) | Arg::Slice(_) => a.for_each_ref(&mut f),
            _ => {}
        };
        self.args.iter().for_each(&mut visit);
        self.kwargs.values().for_each(visit);
    }

    /// Rewrites every reference, keeping everything else.
    pub fn try_map_refs<S, E>(&self, f: &mut impl FnMut(&R) -> Result<S, E>) -> Result<Node<S>, E> {
        Ok(Node {
            name: self.name.clone(),
            op: self.op,
            target: self.target.clone(),
            args: self
                .args
                .iter()
                .map(|a| a.try_map_refs(f))
                .collect::<Result<_, _>>()?,
            kwargs: self
                .kwargs
                .iter()
                .map(|(k, a)| Ok((k.clone(), a.try_map_refs(f)?)))
                .collect::<Result<_, _>>()?,
            meta: self.meta.clone(),
        })
    }

    /// Infallible [`Node::try_map_refs`].
    pub fn map_refs<S>(&self, f: &mut impl FnMut(&R) -> S) -> Node<S> {
        let r: Result<Node<S>, std::convert::Infallible> = self.try_map_refs(&mut |r| Ok(f(r)));
        match r {
            Ok(n) => n,
            Err(never) => match never {},
        }
    }

    pub fn is_call(&self, target: &str) -> bool {
        self.op == Op::CallFunction && self.target == target
    }
}
