//! Fitting `prefetch` to a device-memory budget on an exported program, where the simulated
//! peak overshoots by the same bytes whatever small amount is taken off the walk's limit.

use zerosched_passes::pipeline::{self, PipelineOptions};
use zerosched_passes::schedule::ScheduleOptions;
use zerosched_passes::simulate::{SimOptions, simulate_program};

/// ViT's backward at 90% of the memory PyTorch's overlap scheduler peaks at: the first walk
/// overshoots by a few hundred bytes, and a limit lower by that alone (or twice it) makes the
/// same decisions again. Taking off twice as much each try finds a prefetch schedule before the
/// tries run out, instead of falling back to `jit` (0.29 ms against 1.42 ms).
#[test]
fn a_repeated_overshoot_does_not_end_in_the_jit_schedule() {
    let path = format!(
        "{}/tests/fixtures/families/vit_none.program.json.gz",
        env!("CARGO_MANIFEST_DIR")
    );
    let p = zerosched_api::io::read_program(std::path::Path::new(&path)).expect("read");
    let memory = 133_225;
    let backward_ms = |scheduler: &str| {
        let mut q = p.clone();
        let opts = PipelineOptions {
            scheduler: scheduler.to_owned(),
            schedule: ScheduleOptions {
                memory,
                ..ScheduleOptions::default()
            },
            disabled: ["keep".to_owned()].into(),
            verify: true,
            ..PipelineOptions::default()
        };
        pipeline::run(&pipeline::standard(), &mut q, &opts).expect("fits");
        let sim = simulate_program(&q, &SimOptions::default());
        assert!(sim.total.peak_total_bytes <= memory);
        sim.graphs.last().expect("a backward").summary.step_ms
    };
    let (prefetch, jit) = (backward_ms("prefetch"), backward_ms("jit"));
    assert!(prefetch < 0.5 * jit, "prefetch {prefetch} ms, jit {jit} ms");
}
