//! Every op of every fixture program has a CUDA kernel, and every fixture program scheduled by
//! every scheduler plans on the CUDA backend: `zerosched run --executor cuda` refuses a graph
//! with an op it lacks before running, so this is what lets each fixture run on the GPU at all
//! (the values are checked there, by `scripts/gpu-exec-test`).

use std::io::Read;
use std::path::{Path, PathBuf};
use zerosched_exec::Backend;
use zerosched_exec_cuda::backend::Cuda;
use zerosched_ir::Op;

fn load(f: &Path) -> zerosched_ir::Program {
    let raw = std::fs::read(f).expect("read");
    let bytes = if f.extension().is_some_and(|e| e == "gz") {
        let mut out = vec![];
        flate2::read::MultiGzDecoder::new(raw.as_slice())
            .read_to_end(&mut out)
            .expect("gunzip");
        out
    } else {
        raw
    };
    zerosched_ir::import(&bytes).unwrap_or_else(|e| panic!("{}: {e}", f.display()))
}

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mut files = vec![];
    for dir in [root.clone(), root.join("families"), root.join("edge")] {
        for e in std::fs::read_dir(&dir).expect("fixture directory") {
            let p = e.expect("entry").path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.ends_with(".json") || name.ends_with(".json.gz") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

#[test]
fn every_op_of_every_fixture_program_resolves_on_the_cuda_backend() {
    let mut missing = vec![];
    let files = fixtures();
    assert!(files.len() >= 20, "fixtures found: {files:?}");
    for f in &files {
        let p = load(f);
        for g in &p.graphs {
            for (_, n) in g.nodes() {
                if n.op == Op::CallFunction && Cuda::resolve(&n.target).is_none() {
                    missing.push(format!("{} ({})", n.target, f.display()));
                }
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "ops without a CUDA kernel: {missing:#?}"
    );
}

#[test]
fn every_fixture_program_scheduled_by_every_scheduler_plans_on_the_cuda_backend() {
    use zerosched_passes::pipeline::{self, PipelineOptions};
    let mut failed = vec![];
    for f in fixtures() {
        for scheduler in ["jit", "deepcompile", "prefetch"] {
            let mut p = load(&f);
            let opts = PipelineOptions {
                scheduler: scheduler.to_owned(),
                schedule: zerosched_passes::schedule::ScheduleOptions {
                    world_size: 1,
                    ..Default::default()
                },
                verify: false,
                ..Default::default()
            };
            if let Err(e) = pipeline::run(&pipeline::standard(), &mut p, &opts) {
                failed.push(format!("{} {scheduler}: schedule: {e}", f.display()));
                continue;
            }
            if let Err(e) = zerosched_exec::plans::<Cuda>(&p) {
                failed.push(format!("{} {scheduler}: {e}", f.display()));
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}
