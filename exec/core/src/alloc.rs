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
