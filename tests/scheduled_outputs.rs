//! The scheduled programs the pipeline writes, pinned: for every exported fixture and the
//! smaller benchmark programs, every scheduler and three budgets, a digest of the fx-graph v1
//! JSON the pipeline produces (or its error). Passes may get faster; what they write must not
//! change unnoticed. `ZEROSCHED_BLESS=1` rewrites the expected file after an intended change.

mod common;

use zerosched_passes::pipeline::{self, PipelineOptions};
use zerosched_passes::schedule::{NAMES, ScheduleOptions};

/// FNV-1a, 64-bit: a digest that is the same on every platform and toolchain.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn outcome(bytes: &[u8], scheduler: &str, budget: u64) -> String {
    let mut p = zerosched_ir::import(bytes).expect("fixture imports");
    let opts = PipelineOptions {
        schedule: ScheduleOptions {
            budget,
            ..ScheduleOptions::default()
        },
        scheduler: scheduler.to_owned(),
        verify: true,
        ..PipelineOptions::default()
    };
    match pipeline::run(&pipeline::standard(), &mut p, &opts) {
        Ok(_) => format!("{:016x}", fnv1a(&zerosched_ir::json::export(&p))),
        Err(e) => format!("error: {}", e.to_string().lines().next().unwrap_or("")),
    }
}

#[test]
fn pipeline_outputs_match_the_pinned_digests() {
    let mut inputs = common::files("tests/fixtures", &[".json"]);
    for name in ["llama70b_l8", "mixtral8x7b_l2"] {
        inputs.push(common::root().join(format!("benches/data/{name}.program.json.gz")));
    }
    let mut actual = String::new();
    for path in &inputs {
        let bytes = zerosched_api::io::read_bytes(path).expect("fixture reads");
        let program = zerosched_ir::import(&bytes).expect("fixture imports");
        let layer = zerosched_api::budget::layer_bytes(&program, 0, 8);
        // Unlimited, two layers' worth, and one layer's worth (infeasible for some).
        let mut budgets = vec![u64::MAX];
        if layer > 0 {
            budgets.extend([2 * layer, layer]);
        }
        for budget in budgets {
            for scheduler in NAMES {
                actual.push_str(&format!(
                    "{} {scheduler} {budget} {}\n",
                    common::relative(path),
                    outcome(&bytes, scheduler, budget)
                ));
            }
        }
    }
    let expected = common::root().join("tests/scheduled_outputs.expected");
    if let Some(diff) = common::check_expected(&expected, &actual) {
        panic!("{diff}");
    }
}
