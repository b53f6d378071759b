//! Whether a run fits before it starts. The dry run ([`crate::dry::Dry`]) walks the program
//! with sizes only and measures each rank's peak; the ranks of one process share its memory,
//! so the run needs the sum of their peaks plus the full parameters the host holds for them.
//! That is compared with what the host has available (`MemAvailable` in `/proc/meminfo`) or a
//! limit given by the user, and a run that needs more is refused naming both figures, instead
//! of dying in an allocation halfway. A rank with a device of its own (CUDA, one process per
//! rank) needs its own peak there, compared with the device's free memory.

use crate::comm::ThreadComm;
use crate::dry::Dry;
use crate::inputs::Inputs;
use crate::{ExecError, plans, world};
use std::collections::BTreeMap;
use zerosched_ir::Program;

/// The memory a run may use.
#[derive(Clone, Debug)]
pub enum Limit {
    /// What the host has available now (no check where that cannot be read).
    Host,
    /// A given number of bytes.
    Bytes(u64),
    /// The free memory of one rank's device (`from` says where the figure comes from): each
    /// rank is then its own process on its own device, so the run needs one rank's peak.
    Device { free: u64, from: String },
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn host_available() -> Option<u64> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Bytes of every parameter of the program, whole (each counted once).
fn full_param_bytes(p: &Program) -> u64 {
    let mut seen = BTreeMap::new();
    for g in &p.graphs {
        for pa in &g.params {
            let numel = pa
                .shape
                .iter()
                .map(|d| d.hint())
                .fold(1u64, u64::saturating_mul);
            seen.entry(pa.name.as_str())
                .or_insert(numel.saturating_mul(pa.dtype.size()));
        }
    }
    seen.values().fold(0, |a, &b| a.saturating_add(b))
}

/// Each rank's peak over the program, by a dry run of `p` on `world` ranks.
fn dry_peaks(p: &Program, inputs: &Inputs, world: u32) -> Result<Vec<u64>, ExecError> {
    let plans = plans::<Dry>(p)?;
    let run = world::run_threads(&plans, inputs, ThreadComm::world(world), |_| Ok(Dry))?;
    Ok(run.peak_per_rank())
}

/// The bytes a run of `p` on `world` in-process ranks needs at its peak, by a dry run.
pub fn need(p: &Program, inputs: &Inputs, world: u32) -> Result<u64, ExecError> {
    let ranks = dry_peaks(p, inputs, world)?
        .into_iter()
        .fold(0u64, u64::saturating_add);
    Ok(ranks.saturating_add(full_param_bytes(p)))
}

/// The bytes one rank's device needs at its peak in a run of `p` on `world` ranks, one per
/// process and device: the largest rank's dry-run peak.
pub fn device_need(p: &Program, inputs: &Inputs, world: u32) -> Result<u64, ExecError> {
    Ok(dry_peaks(p, inputs, world)?.into_iter().max().unwrap_or(0))
}

/// Refuses a run of `p` on `world` ranks that needs more than `limit`; returns what it
/// needs.
pub fn ensure_fits(
    p: &Program,
    inputs: &Inputs,
    world: u32,
    limit: &Limit,
) -> Result<u64, ExecError> {
    let host =
        || format!("the dry-run peaks of its {world} rank(s) and the full parameters on the host");
    let (need, available, counted, from) = match limit {
        Limit::Bytes(b) => (
            need(p, inputs, world)?,
            *b,
            host(),
            "--memory-limit".to_owned(),
        ),
        Limit::Host => match host_available() {
            Some(b) => (
                need(p, inputs, world)?,
                b,
                host(),
                "MemAvailable in /proc/meminfo".to_owned(),
            ),
            None => return need(p, inputs, world),
        },
        Limit::Device { free, from } => (
            device_need(p, inputs, world)?,
            *free,
            format!("the dry-run peak of one rank of {world}, on its own device"),
            from.clone(),
        ),
    };
    if need > available {
        return Err(ExecError::DoesNotFit {
            need,
            counted,
            available,
            from,
        });
    }
    Ok(need)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_mem_available() {
        let text = "MemTotal:       32594264 kB\nMemFree:  1 kB\nMemAvailable:   24157568 kB\n";
        assert_eq!(super::parse_mem_available(text), Some(24157568 * 1024));
        assert_eq!(super::parse_mem_available("MemTotal: 3 kB\n"), None);
    }
}
