//! Range add, range max over positions (a lazy segment tree): the memory a schedule holds at
//! each position, with what a choice adds over a stretch, each check and commit logarithmic.
//! Selective unsharding and the memory-budgeted prefetch both place buffers this way.

pub(crate) struct MaxAdd {
    size: usize,
    max: Vec<u64>,
    add: Vec<u64>,
}

impl MaxAdd {
    pub(crate) fn from_live(values: &[u64]) -> MaxAdd {
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
    pub(crate) fn add(&mut self, lo: usize, hi: usize, v: u64) {
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
    pub(crate) fn max(&self, lo: usize, hi: usize) -> u64 {
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
