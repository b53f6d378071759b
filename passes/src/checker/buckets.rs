//! Guarantee 4, for gathers and reductions alike: the members of a bucket stand next to each
//! other in program order and agree on what one coalesced collective needs. Gathers and
//! reductions number their buckets apart, so each kind is checked on its own.

use super::{Ctx, Violation};
use std::collections::BTreeMap;
use zerosched_ir::{Node, NodeId};

/// Checks the buckets `members` (by id, each list in program order): every member agrees with
/// the first on `key`, and `mismatch` says how one that does not is wrong (bucket, first
/// member's name, its key, the member's key). Returns the number of distinct ids.
pub(super) fn check<K: PartialEq>(
    cx: &mut Ctx,
    members: &BTreeMap<i64, Vec<NodeId>>,
    key: impl Fn(&Node) -> K,
    mismatch: impl Fn(i64, String, K, K) -> Violation,
) -> usize {
    for (&bucket, ids) in members {
        if let Some((&first, rest)) = ids.split_first() {
            for &m in rest {
                let (expected, found) = (key(cx.g.node(first)), key(cx.g.node(m)));
                if found != expected {
                    let violation = mismatch(bucket, cx.name(first), expected, found);
                    cx.at(m, violation);
                }
            }
        }
        for pair in ids.windows(2) {
            let (prev, next) = (pair[0], pair[1]);
            let after_prev = cx.pos(prev).saturating_add(1);
            if cx.pos(next) != after_prev {
                let between =
                    cx.g.order()
                        .get(after_prev)
                        .map_or(String::new(), |&b| cx.name(b));
                let previous = cx.name(prev);
                let violation = Violation::BucketNotAdjacent {
                    bucket,
                    previous,
                    between,
                };
                cx.at(next, violation);
            }
        }
    }
    members.len()
}
