//! Last uses over storage classes, on any given order.
//!
//! One iterative pass over the order: no recursion, so graphs of any depth are fine. The
//! analysis follows every reference, in `args` and in `kwargs` alike.

use crate::alias::Aliases;
use zerosched_ir::{Graph, NodeId, SideTable};

/// For each storage class (by allocating node), its real use that comes last in `order`;
/// `None` for storage nothing reads.
#[derive(Clone, Debug)]
pub struct LastUses {
    last: SideTable<Option<NodeId>>,
}

impl LastUses {
    /// Computes last uses for `g` in the order `order` (a permutation of its nodes).
    pub fn compute(g: &Graph, aliases: &Aliases, order: &[NodeId]) -> LastUses {
        let mut last = SideTable::new(g, None);
        for &user in order {
            for value in g.producers(user) {
                if let Some(class) = aliases.class(value) {
                    if aliases.is_real_use(g, user, value) {
                        // Later in `order` overwrites earlier: the last write is the last use.
                        last[class] = Some(user);
                    }
                }
            }
        }
        LastUses { last }
    }

    /// The last real use of a class's storage.
    pub fn of(&self, class: NodeId) -> Option<NodeId> {
        self.last.get(class).copied().flatten()
    }
}
