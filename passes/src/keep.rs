//! Selective unsharding across a training step: a parameter gathered at the end of the forward
//! and again at the start of the backward can stay gathered in between, saving one all-gather,
//! when the memory budget has room for it in both graphs. Candidates are chosen by
//! communication saved per byte-millisecond held, so the last layers of the forward (the
//! first of the backward, where a gather has no compute to hide behind) go first.
//!
//! Under a device-memory budget a kept buffer counts against it too: each candidate must fit
//! the live bytes the simulator counts at every position it is held, and, since keeping moves
//! the backward's timing, the two graphs are simulated again before it is committed.

use crate::cost::Collective;
use crate::max_add::MaxAdd;
use crate::ops::{self, CommOp};
use crate::schedule::ScheduleOptions;
use crate::simulate::{SimOptions, simulate_graph};
use std::collections::{BTreeMap, BTreeSet};
use zerosched_ir::{Graph, GraphKind, NodeId, Program};

/// What the pass kept.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeepReport {
    /// Parameters kept gathered from the forward to the backward, by name.
    pub kept: Vec<String>,
    /// Communication time saved, ms (the gathers the backward no longer issues).
    pub saved_ms: f64,
}

struct Candidate {
    param: String,
    forward: usize,
    release: NodeId,
    backward: usize,
    gather: NodeId,
    bytes: u64,
    saved_ms: f64,
    held_ms: f64,
}

/// Replaces releases by keeps and gathers by reuses where the budget allows. Runs on a
/// scheduled program and leaves every order as it is.
pub fn keep_across(p: &mut Program, opts: &ScheduleOptions) -> KeepReport {
    let mut candidates = find(p, opts);
    // Best benefit first; ties by name, then position, so every rank agrees.
    candidates.sort_by(|a, b| {
        let ka = a.saved_ms / ((a.bytes.max(1) as f64) * a.held_ms.max(1e-9));
        let kb = b.saved_ms / ((b.bytes.max(1) as f64) * b.held_ms.max(1e-9));
        kb.total_cmp(&ka).then_with(|| a.param.cmp(&b.param))
    });
    let mut live: Vec<Option<MaxAdd>> = p.graphs.iter().map(|_| None).collect();
    // Under a memory budget: the simulated live bytes per position, with what was kept.
    let limited = opts.memory != u64::MAX;
    let mut held: Vec<Option<MaxAdd>> = p.graphs.iter().map(|_| None).collect();
    let positions: Vec<_> = p.graphs.iter().map(Graph::positions).collect();
    let mut report = KeepReport::default();
    for c in candidates {
        let (f, b) = (&p.graphs[c.forward], &p.graphs[c.backward]);
        let (fpos, bpos) = (
            positions[c.forward][c.release],
            positions[c.backward][c.gather],
        );
        let (f_end, b_len) = (f.len(), bpos);
        let fits = |tree: &mut Option<MaxAdd>, g: &Graph, lo: usize, hi: usize| {
            let t = tree.get_or_insert_with(|| MaxAdd::from_live(&live_bytes(g, opts)));
            hi <= lo || t.max(lo, hi).saturating_add(c.bytes) <= opts.budget
        };
        let in_forward = fits(&mut live[c.forward], f, fpos, f_end);
        if !in_forward || !fits(&mut live[c.backward], b, 0, b_len) {
            tracing::debug!(
                param = %c.param,
                bytes = c.bytes,
                budget = opts.budget,
                over_in = if in_forward { "backward" } else { "forward" },
                "parameter not kept: holding it would pass the budget"
            );
            continue;
        }
        if limited {
            let room = |tree: &mut Option<MaxAdd>, g: &Graph, lo: usize, hi: usize| {
                let t = tree.get_or_insert_with(|| MaxAdd::from_live(&simulated(g, opts)));
                hi <= lo || t.max(lo, hi).saturating_add(c.bytes) <= opts.memory
            };
            if !room(&mut held[c.forward], f, fpos, f_end)
                || !room(&mut held[c.backward], b, 0, b_len)
            {
                continue;
            }
        }
        let (release_target, gather_target) = (
            p.graphs[c.forward].node(c.release).target.clone(),
            p.graphs[c.backward].node(c.gather).target.clone(),
        );
        p.graphs[c.forward].set_target(c.release, ops::KEEP);
        p.graphs[c.backward].set_target(c.gather, ops::REUSE);
        if limited && !within_memory(p, &[c.forward, c.backward], opts) {
            p.graphs[c.forward].set_target(c.release, release_target);
            p.graphs[c.backward].set_target(c.gather, gather_target);
            tracing::debug!(param = %c.param, bytes = c.bytes, "not kept: over the memory budget");
            continue;
        }
        for trees in [&mut live, &mut held] {
            if let Some(t) = trees[c.forward].as_mut() {
                t.add(fpos, f_end, c.bytes);
            }
            if let Some(t) = trees[c.backward].as_mut() {
                t.add(0, b_len, c.bytes);
            }
        }
        tracing::debug!(
            param = %c.param,
            bytes = c.bytes,
            saved_ms = c.saved_ms,
            held_ms = c.held_ms,
            "parameter kept from the forward to the backward"
        );
        report.saved_ms += c.saved_ms;
        report.kept.push(c.param);
    }
    for g in &mut p.graphs {
        rebucket(g);
    }
    report.kept.sort();
    report
}

/// Buckets again after gathers became reuses: a reuse is no collective and carries no `bucket`
/// (docs/format.md), so a bucket it stood in splits at it. Each run of adjacent gathers sharing
/// an id gets its own id, in program order; a run of one is a lone gather, without the keyword.
/// The simulator already issued such a bucket as the collectives either side of the reuse, so
/// timing does not change.
fn rebucket(g: &mut Graph) {
    let order = g.order().to_vec();
    if !order.iter().any(|&id| {
        CommOp::of(g.node(id)) == Some(CommOp::Reuse) && ops::bucket(g.node(id)).is_some()
    }) {
        return;
    }
    // Runs of adjacent gathers with the same id.
    let mut runs: Vec<Vec<NodeId>> = Vec::new();
    let mut last: Option<i64> = None;
    for &id in &order {
        let n = g.node(id);
        let bucket = ops::bucket(n).filter(|_| CommOp::of(n) == Some(CommOp::AllGather));
        match (bucket, runs.last_mut()) {
            (Some(b), Some(run)) if last == Some(b) => run.push(id),
            (Some(_), _) => runs.push(vec![id]),
            (None, _) => {}
        }
        last = bucket;
    }
    let mut fresh = 0i64;
    let set = |g: &mut Graph, id: NodeId, bucket: Option<i64>| {
        let n = g.node(id);
        let mut kwargs = zerosched_ir::Kwargs::default();
        for (k, v) in n
            .kwargs
            .iter()
            .filter(|(k, _)| k.as_str() != zerosched_ir::comm::kw::BUCKET)
        {
            kwargs.insert(k.clone(), v.clone());
        }
        if let Some(b) = bucket {
            kwargs.insert(zerosched_ir::comm::kw::BUCKET, zerosched_ir::Arg::Int(b));
        }
        let args = n.args.clone();
        // Only keywords change, so every reference stays valid.
        let _ = g.set_args(id, args, kwargs);
    };
    for &id in &order {
        if CommOp::of(g.node(id)) == Some(CommOp::Reuse) && ops::bucket(g.node(id)).is_some() {
            set(g, id, None);
        }
    }
    for run in runs {
        let id = (run.len() > 1).then_some(fresh);
        fresh += i64::from(run.len() > 1);
        for m in run {
            set(g, m, id);
        }
    }
}

/// Total live bytes at each position of `g`'s order, simulated.
fn simulated(g: &Graph, opts: &ScheduleOptions) -> Vec<u64> {
    simulate_graph(g, &sim_options(opts)).timeline.live
}

fn sim_options(opts: &ScheduleOptions) -> SimOptions {
    SimOptions {
        world_size: opts.world_size,
        cost: opts.cost.clone(),
    }
}

/// Whether the graphs `which` of `p` peak within the memory budget, simulated.
fn within_memory(p: &Program, which: &[usize], opts: &ScheduleOptions) -> bool {
    which.iter().all(|&i| {
        p.graphs.get(i).is_none_or(|g| {
            simulate_graph(g, &sim_options(opts))
                .summary
                .peak_total_bytes
                <= opts.memory
        })
    })
}

/// Pairs of (last forward release, first backward gather) of the same parameter.
fn find(p: &Program, opts: &ScheduleOptions) -> Vec<Candidate> {
    // Per graph, once: where each parameter is gathered and released, and compute prefixes.
    let touched: Vec<BTreeMap<&str, Touch>> = p.graphs.iter().map(touches).collect();
    let prefixes: Vec<Vec<f64>> = p.graphs.iter().map(|g| compute_prefix(g, opts)).collect();
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for (bi, b) in p
        .graphs
        .iter()
        .enumerate()
        .filter(|(_, g)| g.kind == GraphKind::Backward)
    {
        let params = ops::ParamIndex::new(b);
        for (&param, t) in &touched[bi] {
            let Some((pos_b, gather)) = t.first_gather else {
                continue;
            };
            if !seen.insert(param) {
                continue;
            }
            // The last graph before this one that touches the parameter must be a forward that
            // releases it; anything in between would need the buffer or free it.
            let Some(fi) = (0..bi).rev().find(|&i| touched[i].contains_key(param)) else {
                continue;
            };
            let (f, Some((pos_f, release))) = (&p.graphs[fi], touched[fi][param].release) else {
                continue;
            };
            if f.kind != GraphKind::Forward {
                continue;
            }
            let Some(bytes) = params.gathered_bytes(b, gather, opts.world_size) else {
                continue;
            };
            let after_f = &prefixes[fi];
            let held_ms =
                (after_f.last().copied().unwrap_or(0.0) - after_f[pos_f]) + prefixes[bi][pos_b];
            out.push(Candidate {
                param: param.to_owned(),
                forward: fi,
                release,
                backward: bi,
                gather,
                bytes,
                saved_ms: opts
                    .cost
                    .collective_ms(Collective::AllGather, bytes, opts.world_size),
                held_ms,
            });
        }
    }
    out
}

/// Where a graph first gathers and last releases one parameter: `(position, node)`.
#[derive(Default)]
struct Touch {
    first_gather: Option<(usize, NodeId)>,
    release: Option<(usize, NodeId)>,
}

fn touches(g: &Graph) -> BTreeMap<&str, Touch> {
    let mut out: BTreeMap<&str, Touch> = BTreeMap::new();
    for (i, (id, n)) in g.nodes().enumerate() {
        let (Some(op), Some(param)) = (CommOp::of(n), ops::param_name(n)) else {
            continue;
        };
        let t = out.entry(param).or_default();
        match op {
            CommOp::AllGather if t.first_gather.is_none() => t.first_gather = Some((i, id)),
            CommOp::Release => t.release = Some((i, id)),
            _ => {}
        }
    }
    out
}

/// `prefix[i]`: compute time of the nodes before position `i`.
fn compute_prefix(g: &Graph, opts: &ScheduleOptions) -> Vec<f64> {
    let costs = opts.cost.compute_costs(g);
    let mut out = Vec::with_capacity(g.len() + 1);
    let mut t = 0.0;
    for &id in g.order() {
        out.push(t);
        t += costs[id];
    }
    out.push(t);
    out
}

/// Gathered bytes alive after each position, replayed in program order.
fn live_bytes(g: &Graph, opts: &ScheduleOptions) -> Vec<u64> {
    let params = ops::ParamIndex::new(g);
    let mut live = 0u64;
    let mut gathered_at: zerosched_ir::SideTable<u64> = zerosched_ir::SideTable::new(g, 0);
    g.nodes()
        .map(|(id, n)| {
            match CommOp::of(n) {
                Some(CommOp::AllGather | CommOp::Reuse) => {
                    let b = params.gathered_bytes(g, id, opts.world_size).unwrap_or(0);
                    gathered_at[id] = b;
                    live = live.saturating_add(b);
                }
                Some(CommOp::Release) => {
                    let freed = release_source(g, id).map_or(0, |s| gathered_at[s]);
                    live = live.saturating_sub(freed);
                }
                _ => {}
            }
            live
        })
        .collect()
}

/// The gather whose buffer a release frees: through its wait (the form insertion writes).
fn release_source(g: &Graph, release: NodeId) -> Option<NodeId> {
    let value = *g.node(release).args.first()?.as_node()?;
    let wait = g.node(value);
    match CommOp::of(wait) {
        Some(CommOp::Wait) => wait.args.first()?.as_node().copied(),
        _ => None,
    }
}
