//! Selective unsharding across a training step: a parameter gathered at the end of the forward
//! and again at the start of the backward can stay gathered in between, saving one all-gather,
//! when the memory budget has room for it in both graphs. Candidates are chosen by
//! communication saved per byte-millisecond held, so the last layers of the forward (the
//! first of the backward, where a gather has no compute to hide behind) go first.

use crate::cost::Collective;
use crate::ops::{self, CommOp};
use crate::schedule::ScheduleOptions;
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
        if let Some(t) = live[c.forward].as_mut() {
            t.add(fpos, f_end, c.bytes);
        }
        if let Some(t) = live[c.backward].as_mut() {
            t.add(0, b_len, c.bytes);
        }
        p.graphs[c.forward].set_target(c.release, ops::KEEP);
        let g = &mut p.graphs[c.backward];
        g.set_target(c.gather, ops::REUSE);
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
    report.kept.sort();
    report
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

/// Range add, range max over positions (a lazy segment tree), so each candidate is checked
/// and committed in logarithmic time.
struct MaxAdd {
    size: usize,
    max: Vec<u64>,
    add: Vec<u64>,
}

impl MaxAdd {
    fn from_live(values: &[u64]) -> MaxAdd {
        let size = values.len().next_power_of_two().max(1);
        let mut max = vec![0u64; 2 * size];
        max[size..size + values.len()].copy_from_slice(values);
        for i in (1..size).rev() {
            max[i] = max[2 * i].max(max[2 * i + 1]);
        }
        MaxAdd {
            size,
            max,
            add: vec![0; 2 * size],
        }
    }

    /// Adds `v` to positions `lo..hi`.
    fn add(&mut self, lo: usize, hi: usize, v: u64) {
        self.update(1, 0, self.size, lo, hi, v);
    }

    fn update(&mut self, node: usize, l: usize, r: usize, lo: usize, hi: usize, v: u64) {
        if hi <= l || r <= lo {
            return;
        }
        if lo <= l && r <= hi {
            self.max[node] = self.max[node].saturating_add(v);
            self.add[node] = self.add[node].saturating_add(v);
            return;
        }
        let mid = (l + r) / 2;
        self.update(2 * node, l, mid, lo, hi, v);
        self.update(2 * node + 1, mid, r, lo, hi, v);
        self.max[node] = self.max[2 * node]
            .max(self.max[2 * node + 1])
            .saturating_add(self.add[node]);
    }

    /// Largest value over positions `lo..hi`.
    fn max(&self, lo: usize, hi: usize) -> u64 {
        self.query(1, 0, self.size, lo, hi)
    }

    fn query(&self, node: usize, l: usize, r: usize, lo: usize, hi: usize) -> u64 {
        if hi <= l || r <= lo {
            return 0;
        }
        if lo <= l && r <= hi {
            return self.max[node];
        }
        let mid = (l + r) / 2;
        self.query(2 * node, l, mid, lo, hi)
            .max(self.query(2 * node + 1, mid, r, lo, hi))
            .saturating_add(self.add[node])
    }
}

#[cfg(test)]
mod tests {
    use super::MaxAdd;

    #[test]
    fn range_add_range_max_matches_a_plain_array() {
        let base: Vec<u64> = (0..37).map(|i| (i * 7919 % 101) as u64).collect();
        let mut plain = base.clone();
        let mut tree = MaxAdd::from_live(&base);
        for (lo, hi, v) in [
            (0, 10, 5),
            (3, 37, 2),
            (20, 21, 100),
            (36, 37, 1),
            (5, 5, 9),
        ] {
            tree.add(lo, hi, v);
            plain[lo..hi].iter_mut().for_each(|x| *x += v);
            for (a, b) in [(0, 37), (0, 1), (19, 22), (30, 37), (4, 6)] {
                assert_eq!(
                    tree.max(a, b),
                    plain[a..b].iter().copied().max().unwrap_or(0)
                );
            }
        }
    }
}
