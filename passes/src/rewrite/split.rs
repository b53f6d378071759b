//! Gap splitting: gives one parameter several gather segments, so that the rewrite stage can
//! choose per gap whether to hold the buffer across it or gather again.
//!
//! Insertion gathers each parameter once per graph and releases it after its last real use. A
//! parameter used at the start and at the end of a long graph (GPT-2's tied embedding) then
//! holds its buffer throughout. `split_long_gaps` cuts its real uses, taken in program order,
//! wherever `min_gap_nodes` or more nodes stand between two consecutive ones: the segment before
//! the gap gets a release after its last use, the one after it a gather and wait of its own
//! before its first use, with the views between the wait and the uses copied for it.

use crate::alias::Aliases;
use crate::ops::{self, CommOp};
use std::collections::BTreeMap;
use zerosched_ir::{Arg, Graph, NodeId, Problem};

/// What splitting did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SplitReport {
    /// Gathers added (one per gap cut).
    pub segments_added: usize,
}

/// Splits every gathered parameter's uses at gaps of at least `min_gap_nodes` nodes.
pub fn split_long_gaps(g: &mut Graph, min_gap_nodes: usize) -> Result<SplitReport, Problem> {
    let mut report = SplitReport::default();
    let gathers: Vec<NodeId> = g
        .nodes()
        .filter(|(_, n)| CommOp::of(n) == Some(CommOp::AllGather) && ops::bucket(n).is_none())
        .map(|(id, _)| id)
        .collect();
    let mut before: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    let mut after: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    let mut dead = Vec::new();
    let aliases = Aliases::analyse(g);
    let pos = g.positions();
    for gather in gathers {
        let [wait] = g.users(gather)[..] else {
            continue;
        };
        let members = aliases.members(gather).to_vec();
        let output = g.output();
        let users: Vec<NodeId> = members.iter().flat_map(|&m| g.users(m)).collect();
        let releases: Vec<NodeId> = users
            .iter()
            .copied()
            .filter(|&u| CommOp::of(g.node(u)) == Some(CommOp::Release))
            .collect();
        let writes = users.iter().any(|&u| {
            g.node(u)
                .meta
                .mutates
                .as_ref()
                .is_some_and(|w| !w.is_empty())
        });
        let [release] = releases[..] else {
            continue;
        };
        if writes || users.iter().any(|&u| Some(u) == output) {
            continue;
        }
        let mut uses = aliases.real_uses(g, gather);
        uses.sort_by_key(|&u| pos[u]);
        let mut segs: Vec<Vec<NodeId>> = Vec::new();
        for (i, &u) in uses.iter().enumerate() {
            let gap = i
                .checked_sub(1)
                .map(|j| pos[u] - pos[uses[j]] - 1)
                .unwrap_or(0);
            match segs.last_mut() {
                Some(seg) if gap < min_gap_nodes => seg.push(u),
                _ => segs.push(vec![u]),
            }
        }
        if segs.len() < 2 {
            continue;
        }
        let name = ops::param_name(g.node(gather))
            .unwrap_or_default()
            .to_owned();
        let dtype = ops::gather_dtype(g.node(gather));
        let shard = *g.node(gather).args[0].as_node().ok_or(Problem::Missing)?;
        let member_set: std::collections::BTreeSet<NodeId> = members.iter().copied().collect();
        let last = segs.len() - 1;
        for (k, seg) in segs.iter().enumerate() {
            let first_use = seg[0];
            let last_use = *seg.last().ok_or(Problem::Missing)?;
            // The first segment keeps the original gather and wait.
            let (seg_wait, mut copies) = if k == 0 {
                (wait, BTreeMap::new())
            } else {
                let ng = g.add(ops::allgather(g, shard, &name, dtype))?;
                g.meta_mut(ng).val = g.node(gather).meta.val.clone();
                let nw = g.add(ops::wait(g, ng, &name))?;
                g.meta_mut(nw).val = g.node(wait).meta.val.clone();
                g.meta_mut(nw).aliases = Some(vec![0]);
                before.entry(first_use).or_default().extend([ng, nw]);
                report.segments_added += 1;
                (nw, BTreeMap::from([(wait, nw)]))
            };
            if k > 0 {
                for &u in seg {
                    let mut map = BTreeMap::new();
                    for input in g.inputs(u) {
                        if member_set.contains(&input) {
                            let c = copy_chain(
                                g,
                                input,
                                &member_set,
                                &mut copies,
                                &mut before,
                                first_use,
                            )?;
                            map.insert(input, c);
                        }
                    }
                    if !map.is_empty() {
                        g.map_refs(u, |r| map.get(&r).copied().unwrap_or(r))?;
                    }
                }
            }
            if k == last {
                let kwargs = ops::release_kwargs(&name, seg);
                g.set_args(release, vec![Arg::Node(seg_wait)], kwargs)?;
            } else {
                let r = g.add(ops::release(g, seg_wait, &name, seg))?;
                after.entry(last_use).or_default().push(r);
            }
        }
        // Views that only later segments used are copied there; the originals go.
        for &m in members.iter().rev() {
            if m != wait && m != gather && !g.has_users(m) {
                dead.push(m);
            }
        }
    }
    let mut order = Vec::with_capacity(g.len());
    for &id in g.order() {
        order.extend(before.get(&id).into_iter().flatten());
        order.push(id);
        order.extend(after.get(&id).into_iter().flatten());
    }
    g.set_order(order)?;
    for id in dead {
        g.remove(id)?;
    }
    Ok(report)
}

/// The copy, for one segment, of the view chain from the wait to `value`; copies are placed
/// before `anchor`, inputs first. Iterative: alias chains may be long.
fn copy_chain(
    g: &mut Graph,
    value: NodeId,
    members: &std::collections::BTreeSet<NodeId>,
    copies: &mut BTreeMap<NodeId, NodeId>,
    before: &mut BTreeMap<NodeId, Vec<NodeId>>,
    anchor: NodeId,
) -> Result<NodeId, Problem> {
    let mut stack = vec![value];
    while let Some(&v) = stack.last() {
        if copies.contains_key(&v) {
            stack.pop();
            continue;
        }
        let missing: Vec<NodeId> = g
            .inputs(v)
            .into_iter()
            .filter(|i| members.contains(i) && !copies.contains_key(i))
            .collect();
        if !missing.is_empty() {
            stack.extend(missing);
            continue;
        }
        let mut node = g.node(v).clone();
        node.name = g.fresh_name(&node.name).into();
        let node = node.map_refs(&mut |r| copies.get(r).copied().unwrap_or(*r));
        let c = g.add(node)?;
        before.entry(anchor).or_default().push(c);
        copies.insert(v, c);
        stack.pop();
    }
    copies.get(&value).copied().ok_or(Problem::Missing)
}
