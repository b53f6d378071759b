//! The byte-counting allocator: every buffer the executor keeps alive is counted here when its
//! storage class is allocated and uncounted when liveness (or a release) frees it, so the peak
//! is measured over the real program-order walk, not estimated.

/// One rank's live bytes and peaks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub live: u64,
    pub live_gathered: u64,
    pub peak: u64,
    pub peak_gathered: u64,
    /// Allocations made (classes), for reports.
    pub allocs: u64,
    /// The backend's own count beside this one, where it keeps one ([`crate::Backend::held_bytes`]).
    pub held: Option<Held>,
}

/// Bytes a backend holds (a device pool) against the executor's count of live bytes, node by
/// node: where they part is memory that the count, and the simulator that it equals, miss.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Held less counted at the graph's first node (values carried from earlier graphs).
    pub start: i64,
    /// The largest excess over the graph, and the node after which it was reached.
    pub max: i64,
    pub at: String,
    /// The nodes that grew the excess most, largest first: (node, target, bytes).
    pub growth: Vec<(String, String, i64)>,
    last: i64,
}

impl Held {
    const GROWTH: usize = 8;

    /// The backend holds `held` bytes after `node` while `live` are counted.
    pub fn observe(&mut self, node: &str, target: &str, held: u64, live: u64) {
        let excess =
            i64::try_from(held).unwrap_or(i64::MAX) - i64::try_from(live).unwrap_or(i64::MAX);
        if self.at.is_empty() {
            (self.start, self.max, self.last) = (excess, excess, excess);
            self.at = node.to_owned();
            return;
        }
        let grew = excess - self.last;
        self.last = excess;
        if excess > self.max {
            self.max = excess;
            self.at = node.to_owned();
        }
        if grew > 0 {
            let pos = self.growth.partition_point(|(_, _, b)| *b >= grew);
            if pos < Held::GROWTH {
                self.growth
                    .insert(pos, (node.to_owned(), target.to_owned(), grew));
                self.growth.truncate(Held::GROWTH);
            }
        }
    }
}

impl Counter {
    #[inline]
    pub fn alloc(&mut self, bytes: u64, gathered: bool) {
        self.allocs += 1;
        self.live = self.live.saturating_add(bytes);
        self.peak = self.peak.max(self.live);
        if gathered {
            self.live_gathered = self.live_gathered.saturating_add(bytes);
            self.peak_gathered = self.peak_gathered.max(self.live_gathered);
        }
    }

    #[inline]
    pub fn free(&mut self, bytes: u64, gathered: bool) {
        self.live = self.live.saturating_sub(bytes);
        if gathered {
            self.live_gathered = self.live_gathered.saturating_sub(bytes);
        }
    }

    /// Starts a new graph: nothing live, peaks kept only in the per-graph result.
    pub fn reset(&mut self) {
        *self = Counter::default();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn held_bytes_above_the_count_are_traced_to_the_nodes_that_grew_them() {
        let mut h = super::Held::default();
        h.observe("a", "x", 150, 100);
        h.observe("b", "y", 400, 300);
        h.observe("c", "z", 900, 500);
        h.observe("d", "w", 700, 500);
        h.observe("e", "v", 800, 500);
        assert_eq!((h.start, h.max, h.at.as_str()), (50, 400, "c"));
        let grown: Vec<_> = h.growth.iter().map(|(n, _, b)| (n.as_str(), *b)).collect();
        assert_eq!(grown, [("c", 300), ("e", 100), ("b", 50)]);
    }

    #[test]
    fn peaks_follow_live_bytes() {
        let mut c = super::Counter::default();
        c.alloc(10, false);
        c.alloc(5, true);
        c.free(10, false);
        c.alloc(3, true);
        assert_eq!(
            (c.live, c.peak, c.live_gathered, c.peak_gathered),
            (8, 15, 8, 8)
        );
        c.free(8, true);
        assert_eq!((c.live, c.live_gathered), (0, 0));
    }
}
