//! Who owns a pool block: the bookkeeping behind the backend's `free` and `share`, apart
//! from the device so that it is tested without a GPU.
//!
//! A block has one owner when it is allocated. A view op that had to copy (a reshape of a
//! strided tensor) makes a *derived* block that its viewed block owns: the executor frees a
//! storage class once, through the viewed block, and the copy goes with it. `share` adds an
//! owner (an output carried to a later graph, freed there as an input while its own graph
//! frees the class); a block goes back to the pool when its last owner lets go, a derived
//! block when its base and every share of it have.

use crate::pool::Block;
use std::collections::HashMap;

#[derive(Default)]
pub struct Owners {
    /// Copies made by view ops, by the block they view.
    derived: HashMap<u64, Vec<Block>>,
    /// Owners beyond the first, by block.
    shares: HashMap<u64, u32>,
}

impl Owners {
    /// `copy` is freed with `base`.
    pub fn derive(&mut self, base: Block, copy: Block) {
        self.derived.entry(base.ptr).or_default().push(copy);
    }

    /// One more owner of `block`.
    pub fn share(&mut self, block: Block) {
        *self.shares.entry(block.ptr).or_default() += 1;
    }

    /// One owner of `block` lets go: the blocks that go back to the pool now.
    pub fn free(&mut self, block: Block) -> Vec<Block> {
        let mut back = vec![];
        let mut pending = vec![block];
        while let Some(b) = pending.pop() {
            if let Some(n) = self.shares.get_mut(&b.ptr) {
                *n -= 1;
                if *n == 0 {
                    self.shares.remove(&b.ptr);
                }
                continue;
            }
            back.push(b);
            pending.extend(self.derived.remove(&b.ptr).unwrap_or_default());
        }
        back
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(ptr: u64) -> Block {
        Block { ptr, size: 512 }
    }

    #[test]
    fn a_block_goes_back_at_its_only_free() {
        let mut o = Owners::default();
        assert_eq!(o.free(block(1)), vec![block(1)]);
    }

    #[test]
    fn a_copy_goes_back_with_the_block_it_views() {
        let mut o = Owners::default();
        o.derive(block(1), block(2));
        o.derive(block(2), block(3));
        let mut back = o.free(block(1));
        back.sort_by_key(|b| b.ptr);
        assert_eq!(back, vec![block(1), block(2), block(3)]);
    }

    #[test]
    fn a_shared_block_goes_back_at_its_last_owners_free() {
        let mut o = Owners::default();
        o.share(block(1));
        o.share(block(1));
        assert!(o.free(block(1)).is_empty());
        assert!(o.free(block(1)).is_empty());
        assert_eq!(o.free(block(1)), vec![block(1)]);
    }

    /// A forward returns an attention output and a reshaped copy of it; the backward frees
    /// the attention output first and still reads the copy.
    #[test]
    fn a_carried_copy_outlives_the_block_it_views() {
        let mut o = Owners::default();
        o.derive(block(1), block(2));
        // Both outputs are carried; the forward frees its class (block 1 with its copy).
        o.share(block(1));
        o.share(block(2));
        assert!(o.free(block(1)).is_empty());
        // The backward frees its two inputs, the attention output first.
        assert_eq!(o.free(block(1)), vec![block(1)]);
        assert_eq!(o.free(block(2)), vec![block(2)]);
    }
}
