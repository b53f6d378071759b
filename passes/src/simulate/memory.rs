//! Memory over time: a running count of live bytes (gathered parameters, and everything) with
//! its peaks, sampled after every change.
//!
//! Changes arrive from the compute side in time order. Frees that wait for a collective to
//! finish (a gradient is kept until its reduction has read it) arrive early but take effect
//! later; since the communication stream is FIFO their times arrive sorted too, so one queue
//! merged on the fly keeps the whole timeline linear.

use serde::Serialize;
use std::collections::VecDeque;

/// Live bytes just after a change at `t_ms` (graph-relative).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Sample {
    pub t_ms: f64,
    /// Gathered parameter buffers.
    pub gathered: u64,
    /// Everything: activations, inputs, gradients and gathered buffers.
    pub total: u64,
}

#[derive(Debug, Default)]
pub(super) struct Memory {
    gathered: u64,
    total: u64,
    pub peak_gathered: u64,
    pub peak_total: u64,
    /// First time the total reached its peak.
    pub peak_total_at: f64,
    pub samples: Vec<Sample>,
    /// Activation frees due when a collective ends, by time.
    later: VecDeque<(f64, u64)>,
}

impl Memory {
    /// Allocates at `t`, which is no earlier than any change made so far.
    pub fn alloc(&mut self, t: f64, bytes: u64, gathered: bool) {
        self.advance(t);
        if gathered {
            self.gathered = self.gathered.saturating_add(bytes);
        }
        self.total = self.total.saturating_add(bytes);
        self.record(t, bytes);
    }

    pub fn free(&mut self, t: f64, bytes: u64, gathered: bool) {
        self.advance(t);
        self.release(t, bytes, gathered);
    }

    /// Frees activation bytes when the collective that reads them ends at `t`.
    pub fn free_at(&mut self, t: f64, bytes: u64) {
        if bytes > 0 {
            self.later.push_back((t, bytes));
        }
    }

    /// Applies the queued frees due by `t`.
    pub fn advance(&mut self, t: f64) {
        while let Some(&(due, bytes)) = self.later.front() {
            if due > t {
                break;
            }
            self.later.pop_front();
            self.release(due, bytes, false);
        }
    }

    /// Live bytes now, everything counted.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Applies every queued free: the graph has ended.
    pub fn finish(&mut self) {
        self.advance(f64::INFINITY);
    }

    fn release(&mut self, t: f64, bytes: u64, gathered: bool) {
        if gathered {
            self.gathered = self.gathered.saturating_sub(bytes);
        }
        self.total = self.total.saturating_sub(bytes);
        self.record(t, bytes);
    }

    fn record(&mut self, t: f64, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.peak_gathered = self.peak_gathered.max(self.gathered);
        if self.total > self.peak_total {
            self.peak_total = self.total;
            self.peak_total_at = t;
        }
        self.samples.push(Sample {
            t_ms: t,
            gathered: self.gathered,
            total: self.total,
        });
    }
}
