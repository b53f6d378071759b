//! Replay mode's compute node: a one-thread kernel that spins on the GPU's global nanosecond
//! timer for the node's duration. The timer itself is exact; what calibration measures is the
//! fixed cost around it (launch and timer granularity) and the ratio of event-timed duration
//! to requested duration, fitted as a line from two lengths at start-up, so that a requested
//! duration is what the compute stream actually spends.

use crate::device::{Device, StreamKind};
use crate::error::{CudaError, Result};
use crate::kernels::Kernels;

/// The fitted line `measured_ns = slope * requested_ns + intercept_ns`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spin {
    pub slope: f64,
    pub intercept_ns: f64,
}

impl Spin {
    /// Fits the line from medians of 7 runs at 20 µs and 200 µs (after a warm-up).
    pub fn calibrate(dev: &Device, k: &mut Kernels) -> Result<Spin> {
        for _ in 0..3 {
            measure_ns(dev, k, 10_000)?;
        }
        let median = |dev: &Device, k: &mut Kernels, ns: i64| -> Result<f64> {
            let mut v = (0..7)
                .map(|_| measure_ns(dev, k, ns))
                .collect::<Result<Vec<f64>>>()?;
            v.sort_by(f64::total_cmp);
            Ok(v[v.len() / 2])
        };
        let (r1, r2) = (20_000.0, 200_000.0);
        let m1 = median(dev, k, r1 as i64)?;
        let m2 = median(dev, k, r2 as i64)?;
        let slope = (m2 - m1) / (r2 - r1);
        if !(0.5..2.0).contains(&slope) {
            return Err(CudaError::Invalid(format!(
                "spin calibration: {m1:.0} ns for 20 µs and {m2:.0} ns for 200 µs are not a line of slope near 1"
            )));
        }
        Ok(Spin {
            slope,
            intercept_ns: m1 - slope * r1,
        })
    }

    /// Nanoseconds to ask the kernel for so that it takes `us` microseconds.
    pub fn request_ns(&self, us: f64) -> i64 {
        ((us * 1e3 - self.intercept_ns) / self.slope)
            .max(0.0)
            .round() as i64
    }

    /// Queues a spin of `us` microseconds on `stream`.
    pub fn run(&self, k: &mut Kernels, us: f64, stream: StreamKind) -> Result<()> {
        k.spin(self.request_ns(us), stream)
    }
}

/// Event-timed nanoseconds of one spin of `ns` on the compute stream.
pub fn measure_ns(dev: &Device, k: &mut Kernels, ns: i64) -> Result<f64> {
    let (ms, ()) = dev.time_ms(StreamKind::Compute, || k.spin(ns, StreamKind::Compute))?;
    Ok(ms * 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_subtract_the_fixed_cost_and_divide_by_the_slope() {
        let s = Spin {
            slope: 1.02,
            intercept_ns: 3000.0,
        };
        assert_eq!(
            s.request_ns(100.0),
            ((100_000.0 - 3000.0) / 1.02f64).round() as i64
        );
        assert_eq!(
            s.request_ns(1.0),
            0,
            "shorter than the fixed cost: no spin at all"
        );
    }
}
