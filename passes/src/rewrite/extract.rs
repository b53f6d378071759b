//! Extraction: a cost in communicated bytes and held memory picks one form per e-class; a
//! check of the whole choice against the budget forbids keeps that do not fit together.
//!
//! egg's extractor picks per e-class from local costs, so two things it cannot see are checked
//! afterwards on the chosen terms: keeps that overlap and together overflow the budget (each
//! fits alone: that much the cost function knows from the gap's headroom), and a keep whose
//! buffer the earlier segment does not itself use (it would be gathered only to be held). Each
//! round forbids such keeps and extracts again; every round forbids at least one, so it ends.

use super::build::Built;
use super::lang::{Comm, CommGraph, Ty, dtype_atom, seg_atom};
use egg::{CostFunction, Extractor, Id, Language};
use std::collections::{BTreeMap, BTreeSet};
use zerosched_ir::Dtype;

/// Lexicographic: a feasible form first, then the weighted bytes, then fewer alias and cast
/// nodes, then the form already in the graph (so that a graph with nothing to gain comes out
/// unchanged).
#[derive(Clone, Debug, PartialEq, PartialOrd)]
pub(super) struct Cost {
    infeasible: bool,
    score: f64,
    nodes: u32,
    fresh: u32,
}

pub(super) struct CommCost<'a> {
    pub eg: &'a CommGraph,
    pub comm_weight: f64,
    pub keep_weight: f64,
    pub forbidden: &'a BTreeSet<u32>,
    /// The e-nodes the graph already has, canonical.
    pub originals: &'a BTreeSet<Comm>,
}

impl CostFunction<Comm> for CommCost<'_> {
    type Cost = Cost;

    fn cost<C: FnMut(Id) -> Cost>(&mut self, enode: &Comm, mut costs: C) -> Cost {
        let ctx = &self.eg.analysis;
        let zero = Cost {
            infeasible: false,
            score: 0.0,
            nodes: 0,
            fresh: 0,
        };
        match enode {
            Comm::Atom(_) => zero,
            Comm::Gather([p, d, _]) => {
                let (Some(super::lang::Atom::Param(p)), Some(dtype)) =
                    (super::lang::atom(self.eg, *p), dtype_atom(self.eg, *d))
                else {
                    return Cost {
                        infeasible: true,
                        ..zero
                    };
                };
                let ty = Ty {
                    shape: ctx.params[*p as usize].shape.clone(),
                    dtype,
                };
                Cost {
                    score: self.comm_weight * ctx.padded_bytes(&ty) as f64,
                    ..zero
                }
            }
            // Marginal: the buffer is the earlier segment's, already paid for there (checked
            // after extraction). What the keep costs is the memory held over the gap.
            Comm::Keep([x, s]) => {
                let bytes = self.eg[*x]
                    .data
                    .as_ref()
                    .map_or(u64::MAX, |t| ctx.padded_bytes(t));
                let seg = seg_atom(self.eg, *s);
                let fits = seg.is_some_and(|s| {
                    !self.forbidden.contains(&s)
                        && ctx
                            .segs
                            .get(s as usize)
                            .is_some_and(|i| bytes <= i.headroom)
                });
                Cost {
                    infeasible: !fits,
                    score: self.keep_weight * bytes as f64,
                    ..zero
                }
            }
            _ => {
                let own = Cost {
                    nodes: u32::from(!matches!(enode, Comm::Wait(_))),
                    fresh: u32::from(!self.originals.contains(enode)),
                    ..zero
                };
                enode.fold(own, |acc, child| {
                    let c = costs(child);
                    Cost {
                        infeasible: acc.infeasible || c.infeasible,
                        score: acc.score + c.score,
                        nodes: acc.nodes.saturating_add(c.nodes),
                        fresh: acc.fresh.saturating_add(c.fresh),
                    }
                })
            }
        }
    }
}

/// A gather the chosen terms contain.
#[derive(Clone, Debug)]
pub(super) struct GatherUse {
    pub seg: u32,
    pub dtype: Dtype,
    /// Segments whose consumers read this buffer.
    pub covered: BTreeSet<u32>,
    /// Segments that reach it through a keep.
    pub via_keep: BTreeSet<u32>,
    pub bytes: u64,
}

/// The chosen form of every e-class the roots reach.
pub(super) struct Plan {
    pub choice: BTreeMap<Id, Comm>,
    pub gathers: BTreeMap<Id, GatherUse>,
    /// Segments whose buffer is held over from an earlier one, with the bytes held.
    pub kept: BTreeMap<u32, u64>,
}

fn walk(built: &Built, ex: &Extractor<'_, CommCost<'_>, Comm, super::lang::Context>) -> Plan {
    let eg = &built.egraph;
    let mut plan = Plan {
        choice: BTreeMap::new(),
        gathers: BTreeMap::new(),
        kept: BTreeMap::new(),
    };
    for root in &built.roots {
        let mut cur = eg.find(root.class);
        let mut via = Vec::new();
        loop {
            let node = ex.find_best_node(cur).clone();
            plan.choice.insert(cur, node.clone());
            let next = match node {
                Comm::Gather([_, d, s]) => {
                    let bytes = eg[cur]
                        .data
                        .as_ref()
                        .map_or(0, |t| eg.analysis.padded_bytes(t));
                    let entry = plan.gathers.entry(cur).or_insert_with(|| GatherUse {
                        seg: seg_atom(eg, s).unwrap_or(0),
                        dtype: dtype_atom(eg, d).unwrap_or(Dtype::Float32),
                        covered: BTreeSet::new(),
                        via_keep: BTreeSet::new(),
                        bytes,
                    });
                    entry.covered.insert(root.seg);
                    entry.via_keep.extend(via.iter().copied());
                    for &k in &via {
                        plan.kept.insert(k, bytes);
                    }
                    None
                }
                Comm::Keep([x, s]) => {
                    via.extend(seg_atom(eg, s));
                    Some(x)
                }
                Comm::Wait(x)
                | Comm::T(x)
                | Comm::View([x, _])
                | Comm::Transpose([x, _, _])
                | Comm::Cast([x, _]) => Some(x),
                Comm::Atom(_) => None,
            };
            match next {
                Some(x) => cur = eg.find(x),
                None => break,
            }
        }
    }
    plan
}

/// Keeps that make the chosen terms invalid or over budget; empty when the plan stands.
fn violations(built: &Built, plan: &Plan, budget: u64) -> BTreeSet<u32> {
    let mut bad: BTreeSet<u32> = BTreeSet::new();
    for gu in plan.gathers.values() {
        if !gu.covered.contains(&gu.seg) {
            bad.extend(gu.via_keep.iter().copied());
        }
    }
    if !bad.is_empty() {
        return bad;
    }
    let n = built.others_live.len();
    let mut delta = vec![0i128; n + 1];
    for gu in plan.gathers.values() {
        let from = built.segs[gu.seg as usize].gather_pos;
        let last = gu.covered.iter().next_back().copied().unwrap_or(gu.seg);
        let to = built.segs[last as usize].release_pos;
        delta[from] += i128::from(gu.bytes);
        delta[to.max(from)] -= i128::from(gu.bytes);
    }
    let mut live = 0i128;
    for (x, d) in delta.iter().take(n).enumerate() {
        live += d;
        let total = i128::from(built.others_live[x]) + live;
        if total <= i128::from(budget.max(built.baseline_live[x])) {
            continue;
        }
        // The biggest keep held at this point goes; ties to the earliest segment.
        let culprit = plan
            .kept
            .iter()
            .filter(|&(&s, _)| {
                let to = built.segs[s as usize].gather_pos;
                let from = built.egraph.analysis.segs[s as usize]
                    .prev
                    .map_or(to, |p| built.segs[p as usize].release_pos);
                (from..to).contains(&x)
            })
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(&s, _)| s);
        if let Some(s) = culprit {
            bad.insert(s);
            return bad;
        }
    }
    bad
}

/// Extracts until the chosen terms hold together and fit the budget.
pub(super) fn decide(built: &Built, budget: u64, comm_weight: f64, keep_weight: f64) -> Plan {
    let eg = &built.egraph;
    let originals: BTreeSet<Comm> = built
        .originals
        .iter()
        .map(|(_, e)| e.clone().map_children(|c| eg.find(c)))
        .collect();
    let mut forbidden = BTreeSet::new();
    loop {
        let cost = CommCost {
            eg,
            comm_weight,
            keep_weight,
            forbidden: &forbidden,
            originals: &originals,
        };
        let ex = Extractor::new(eg, cost);
        let plan = walk(built, &ex);
        let bad = violations(built, &plan, budget);
        drop(ex);
        // A forbidden keep is infeasible, so it is never chosen again; the guard only makes
        // termination evident.
        if bad.is_subset(&forbidden) {
            return plan;
        }
        forbidden.extend(bad);
    }
}
