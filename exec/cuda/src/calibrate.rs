//! `zerosched calibrate`: NCCL all-gather, reduce-scatter and all-reduce times at the run's
//! world size for messages of 1 KiB to 1 GiB (powers of two, bf16), written as the cost
//! model's collective table (`passes::cost::CollectiveTable`): the JSON `--cost` reads, the
//! compute figures left at their defaults.

use crate::device::{Device, StreamKind};
use crate::error::Result;
use crate::kernels::source::Elem;
use crate::nccl::Comm;
use crate::pool::Pool;
use std::path::Path;
use zerosched_passes::cost::{Collective, CollectiveModel, CollectiveTable, CostModel};

/// Message sizes (the full gathered or reduced bytes): 1 KiB, 2 KiB, ... `max`.
pub fn sizes(max: u64) -> Vec<u64> {
    std::iter::successors(Some(1024u64), |s| Some(s * 2))
        .take_while(|s| *s <= max)
        .collect()
}

/// Warm-up launches and timed launches per point.
const WARMUP: usize = 2;
const REPS: usize = 5;

/// Measures every collective at every size in `sizes`.
pub fn measure(
    dev: &Device,
    pool: &mut Pool,
    comm: &Comm,
    sizes: &[u64],
) -> Result<CollectiveTable> {
    let world = u64::from(comm.world);
    let max = sizes.iter().copied().max().unwrap_or(0);
    let full = pool.alloc(max, StreamKind::Comm)?;
    let part = pool.alloc(max.div_ceil(world), StreamKind::Comm)?;
    let mut table = CollectiveTable {
        all_gather: vec![],
        reduce_scatter: vec![],
        all_reduce: vec![],
    };
    for &bytes in sizes {
        // bf16 elements per rank, at least one.
        let count = (bytes / 2 / world).max(1) as usize;
        for kind in [
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AllReduce,
        ] {
            let run = || match kind {
                Collective::AllGather => comm.all_gather(part.ptr, full.ptr, count, Elem::BF16),
                Collective::ReduceScatter => {
                    comm.reduce_scatter(full.ptr, part.ptr, count, Elem::BF16)
                }
                Collective::AllReduce => {
                    comm.all_reduce(full.ptr, full.ptr, count * world as usize, Elem::BF16)
                }
            };
            for _ in 0..WARMUP {
                run()?;
            }
            let (total, ()) = dev.time_ms(StreamKind::Comm, || {
                for _ in 0..REPS {
                    run()?;
                }
                Ok(())
            })?;
            let ms = total / REPS as f64;
            let points = match kind {
                Collective::AllGather => &mut table.all_gather,
                Collective::ReduceScatter => &mut table.reduce_scatter,
                Collective::AllReduce => &mut table.all_reduce,
            };
            points.push((bytes, ms));
        }
    }
    pool.free(full, &[StreamKind::Comm])?;
    pool.free(part, &[StreamKind::Comm])?;
    Ok(table)
}

/// The cost model with `table` as its collective model.
pub fn cost_model(table: CollectiveTable) -> CostModel {
    CostModel {
        collective: CollectiveModel::Table(table),
        ..CostModel::default()
    }
}

/// Writes `model` as JSON to `path`, whole or not at all (a temporary file renamed over it).
pub fn write(path: &Path, model: &CostModel) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(model).map_err(std::io::Error::other)?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text + "\n")?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_run_from_1_kib_to_1_gib_in_powers_of_two() {
        let s = sizes(1 << 30);
        assert_eq!((s.len(), s[0], s[20]), (21, 1024, 1 << 30));
    }

    #[test]
    fn the_written_table_is_what_the_cost_model_reads() {
        let t = CollectiveTable {
            all_gather: vec![(1024, 0.01), (2048, 0.02)],
            reduce_scatter: vec![(1024, 0.015), (2048, 0.025)],
            all_reduce: vec![(1024, 0.03), (2048, 0.05)],
        };
        let dir = std::env::temp_dir().join(format!("zerosched-calibrate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("table.json");
        write(&path, &cost_model(t.clone())).unwrap();
        let back = CostModel::from_json(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back.collective, CollectiveModel::Table(t));
        assert!((back.collective_ms(Collective::AllGather, 1536, 1) - 0.015).abs() < 1e-12);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
