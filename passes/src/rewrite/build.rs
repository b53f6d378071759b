//! Finds the communication-relevant part of a graph and builds the e-graph over it.
//!
//! For each sharded parameter: its gather segments (gather, wait, release) and the *term
//! nodes* reachable from each wait through the ops the language knows (`view`, `t`,
//! `transpose`, casts). Every other consumer of a term node is a *root*: it reads one term,
//! and after extraction it reads whatever the term's e-class extracts to. A parameter the stage
//! cannot account for exactly (a bucketed gather, a gather without exactly one wait and one
//! release, a value the output returns, an in-place write into the storage) is left alone.

use super::lang::{Atom, Comm, CommGraph, Context, ParamInfo, SegInfo};
use crate::alias::Aliases;
use crate::ops::{self, CommOp};
use egg::Id;
use std::collections::BTreeMap;
use zerosched_ir::{Arg, Dtype, Graph, Node, NodeId, SideTable, Val};

/// One gather segment in the graph.
#[derive(Clone, Debug)]
pub(super) struct Segment {
    pub shard: NodeId,
    pub gather: NodeId,
    pub wait: NodeId,
    pub release: NodeId,
    pub dtype: Dtype,
    pub gather_pos: usize,
    pub release_pos: usize,
}

/// A consumer reading a term: after the stage it reads the term's extracted form.
#[derive(Clone, Debug)]
pub(super) struct Root {
    pub consumer: NodeId,
    pub value: NodeId,
    pub class: Id,
    pub seg: u32,
}

pub(super) struct Built {
    pub egraph: CommGraph,
    pub segs: Vec<Segment>,
    /// Each node the e-graph covers with the e-node it was added as.
    pub originals: Vec<(NodeId, Comm)>,
    pub roots: Vec<Root>,
    /// Gathered bytes live after each position, for gathers the stage leaves alone.
    pub others_live: Vec<u64>,
    /// Gathered bytes live after each position, for every gather, before the stage.
    pub baseline_live: Vec<u64>,
}

/// The ops a term can be made of, parsed from a node.
pub(super) enum Shape {
    View(Vec<i64>),
    T,
    Transpose(i64, i64),
    Cast(Dtype),
}

/// How `n` makes a term from its one node argument, if it is an op the language knows.
pub(super) fn parse(n: &Node) -> Option<(NodeId, Shape)> {
    if n.meta.mutates.as_ref().is_some_and(|m| !m.is_empty()) {
        return None;
    }
    let x = *n.args.first()?.as_node()?;
    let ints = |a: &Arg<NodeId>| match a {
        Arg::Int(i) => Some(*i),
        _ => None,
    };
    let plain = n.kwargs.is_empty();
    let shape = match (n.target.as_str(), &n.args[1..]) {
        ("aten.view.default", [Arg::List(sizes)]) if plain => {
            Shape::View(sizes.iter().map(ints).collect::<Option<_>>()?)
        }
        ("aten.t.default", []) if plain => Shape::T,
        ("aten.transpose.int", [i, j]) if plain => Shape::Transpose(ints(i)?, ints(j)?),
        ("prims.convert_element_type.default", [Arg::Dtype(d)]) if plain => Shape::Cast(*d),
        ("aten._to_copy.default", []) => match (n.kwargs.len(), n.kwargs.get("dtype")) {
            (1, Some(Arg::Dtype(d))) => Shape::Cast(*d),
            _ => return None,
        },
        _ => return None,
    };
    let viewish = !matches!(shape, Shape::Cast(_));
    let aliases_ok = match &n.meta.aliases {
        None => true,
        Some(a) => a.as_slice() == if viewish { &[0][..] } else { &[][..] },
    };
    aliases_ok.then_some((x, shape))
}

/// The gathers of one parameter, if the stage can account for all of them.
fn segments(
    g: &Graph,
    params: &ops::ParamIndex,
    aliases: &Aliases,
    gathers: &[NodeId],
    pos: &SideTable<usize>,
    output: Option<NodeId>,
) -> Option<Vec<Segment>> {
    let mut out = Vec::new();
    for &gather in gathers {
        let n = g.node(gather);
        let shard = *n.args.first()?.as_node()?;
        let param = g.params.get(params.position(shard)?)?;
        if ops::bucket(n).is_some() {
            return None;
        }
        let [wait] = g.users(gather)[..] else {
            return None;
        };
        if CommOp::of(g.node(wait)) != Some(CommOp::Wait) {
            return None;
        }
        let members = aliases.members(gather);
        let mut releases = Vec::new();
        for &m in members {
            for u in g.users(m) {
                let un = g.node(u);
                if Some(u) == output || un.meta.mutates.as_ref().is_some_and(|w| !w.is_empty()) {
                    return None;
                }
                if CommOp::of(un) == Some(CommOp::Release) && un.args.first()?.as_node() == Some(&m)
                {
                    releases.push(u);
                }
            }
        }
        let [release] = releases[..] else {
            return None;
        };
        out.push(Segment {
            shard,
            gather,
            wait,
            release,
            dtype: ops::gather_dtype(n).unwrap_or(param.dtype),
            gather_pos: pos[gather],
            release_pos: pos[release],
        });
    }
    Some(out)
}

/// Gathered bytes live after each position, counting the gathers `keep` selects.
fn live_profile(
    g: &Graph,
    aliases: &Aliases,
    pos: &SideTable<usize>,
    world: u32,
    keep: impl Fn(NodeId) -> bool,
) -> Vec<u64> {
    let mut delta = vec![0i128; g.len() + 1];
    let params = ops::ParamIndex::new(g);
    for (id, n) in g.nodes() {
        if CommOp::of(n) != Some(CommOp::AllGather) || !keep(id) {
            continue;
        }
        let bytes = i128::from(params.gathered_bytes(g, id, world).unwrap_or(0));
        let end = aliases
            .members(id)
            .iter()
            .flat_map(|&m| g.users(m))
            .filter(|&u| CommOp::of(g.node(u)) == Some(CommOp::Release))
            .map(|u| pos[u])
            .min()
            .unwrap_or(g.len());
        delta[pos[id]] += bytes;
        delta[end] -= bytes;
    }
    let mut live = 0i128;
    delta[..g.len()]
        .iter()
        .map(|d| {
            live += d;
            u64::try_from(live.max(0)).unwrap_or(u64::MAX)
        })
        .collect()
}

/// The parameters the stage can account for, each with its gather segments, and the analyses
/// of the graph that the rest of the stage reads.
pub(super) struct Scope {
    pub aliases: Aliases,
    pub pos: SideTable<usize>,
    pub output: Option<NodeId>,
    /// By parameter name: the name, the index of its declaration in the graph's parameters,
    /// and its segments in program order.
    pub params: Vec<(String, usize, Vec<Segment>)>,
}

pub(super) fn scope(g: &Graph) -> Scope {
    let aliases = Aliases::analyse(g);
    let pos = g.positions();
    let output = g.output();
    let mut by_param: BTreeMap<&str, Vec<NodeId>> = BTreeMap::new();
    for (id, n) in g.nodes() {
        if CommOp::of(n) == Some(CommOp::AllGather) {
            if let Some(p) = ops::param_name(n) {
                by_param.entry(p).or_default().push(id);
            }
        }
    }
    let index = ops::ParamIndex::new(g);
    let params = by_param
        .into_iter()
        .filter_map(|(name, gathers)| {
            let found = segments(g, &index, &aliases, &gathers, &pos, output)?;
            let shard = found.first()?.shard;
            let param = index.position(shard)?;
            Some((name.to_owned(), param, found))
        })
        .collect();
    Scope {
        aliases,
        pos,
        output,
        params,
    }
}

/// Where a segment may hold the previous one's buffer instead: only across a real gap.
pub(super) fn previous(found: &[Segment], k: usize) -> Option<usize> {
    k.checked_sub(1)
        .filter(|&j| found[j].release_pos < found[k].gather_pos)
}

pub(super) fn build(g: &Graph, scope: Scope, budget: u64, world: u32) -> Built {
    let Scope {
        aliases,
        pos,
        output,
        params,
    } = scope;
    let baseline_live = live_profile(g, &aliases, &pos, world, |_| true);
    let mut ctx = Context {
        world_size: world,
        ..Context::default()
    };
    let mut segs = Vec::new();
    let mut in_scope = SideTable::new(g, false);
    for (name, param, found) in params {
        let param = &g.params[param];
        let p = ctx.params.len() as u32;
        ctx.params.push(ParamInfo {
            name,
            shape: param.shape.iter().map(|d| d.hint()).collect(),
            dtype: param.dtype,
        });
        let base = segs.len();
        for (k, s) in found.iter().enumerate() {
            let prev = previous(&found, k);
            let headroom = prev.map_or(0, |j| {
                let gap = &baseline_live[found[j].release_pos..s.gather_pos];
                budget.saturating_sub(gap.iter().copied().max().unwrap_or(0))
            });
            let prev = prev.map(|j| (base + j) as u32);
            let only_cast = match aliases.real_uses(g, s.gather)[..] {
                [u] => match parse(g.node(u)) {
                    Some((_, Shape::Cast(d))) => Some(d),
                    _ => None,
                },
                _ => None,
            };
            ctx.segs.push(SegInfo {
                param: p,
                prev,
                only_cast,
                headroom,
            });
            in_scope[s.gather] = true;
        }
        segs.extend(found);
    }
    let others_live = live_profile(g, &aliases, &pos, world, |id| !in_scope[id]);

    let mut eg = CommGraph::new(ctx);
    let mut class_of: SideTable<Option<Id>> = SideTable::new(g, None);
    let mut seg_of: SideTable<u32> = SideTable::new(g, 0);
    let mut originals = Vec::new();
    for (k, s) in segs.iter().enumerate() {
        let param = eg.analysis.segs[k].param;
        let p = eg.add(Comm::Atom(Atom::Param(param)));
        let d = eg.add(Comm::Atom(Atom::Dtype(s.dtype)));
        let sid = eg.add(Comm::Atom(Atom::Seg(k as u32)));
        let gather = Comm::Gather([p, d, sid]);
        let gc = eg.add(gather.clone());
        let wait = Comm::Wait(gc);
        let wc = eg.add(wait.clone());
        originals.push((s.gather, gather));
        originals.push((s.wait, wait));
        class_of[s.gather] = Some(gc);
        class_of[s.wait] = Some(wc);
        seg_of[s.wait] = k as u32;
    }
    // Term nodes in program order: every term's argument is an earlier term.
    let mut roots = Vec::new();
    for (id, n) in g.nodes() {
        if class_of[id].is_some() {
            continue;
        }
        // The output must never come to hold gathered storage, so what it reads stays as is.
        let returned = output.is_some_and(|o| g.feeds(id, o));
        let Some((x, shape)) = parse(n).filter(|_| !returned) else {
            continue;
        };
        let Some(xc) = class_of[x] else {
            continue;
        };
        let enode = match shape {
            Shape::View(sizes) => Comm::View([xc, eg.add(Comm::Atom(Atom::Shape(sizes)))]),
            Shape::T => Comm::T(xc),
            Shape::Transpose(i, j) => Comm::Transpose([
                xc,
                eg.add(Comm::Atom(Atom::Int(i))),
                eg.add(Comm::Atom(Atom::Int(j))),
            ]),
            Shape::Cast(d) => Comm::Cast([xc, eg.add(Comm::Atom(Atom::Dtype(d)))]),
        };
        let c = eg.add(enode.clone());
        // A node whose recorded shape disagrees with the term's is not understood: it stays
        // a consumer.
        let agrees = match (&eg[c].data, &n.meta.val) {
            (Some(ty), Some(Val::Tensor(t))) => {
                t.dtype == ty.dtype
                    && t.shape.len() == ty.shape.len()
                    && t.shape.iter().zip(&ty.shape).all(|(a, &b)| a.hint() == b)
            }
            (Some(_), None) => true,
            _ => false,
        };
        if agrees {
            class_of[id] = Some(c);
            seg_of[id] = seg_of[x];
            originals.push((id, enode));
        }
    }
    for &id in g.order() {
        let Some(class) = class_of[id] else {
            continue;
        };
        if CommOp::of(g.node(id)) == Some(CommOp::AllGather) {
            continue;
        }
        for consumer in g.users(id) {
            let cn = g.node(consumer);
            if class_of[consumer].is_none() && CommOp::of(cn) != Some(CommOp::Release) {
                roots.push(Root {
                    consumer,
                    value: id,
                    class,
                    seg: seg_of[id],
                });
            }
        }
    }
    eg.rebuild();
    Built {
        egraph: eg,
        segs,
        originals,
        roots,
        others_live,
        baseline_live,
    }
}
