//! `zerosched run` end to end: outputs with shape, dtype and checksum, measured peaks beside
//! the simulator's, identical checksums for the original and the scheduled program, and a
//! non-zero exit naming the node for an op the CPU backend lacks.

use std::process::Command;

fn zerosched(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zerosched"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn loss_line(text: &str) -> String {
    text.lines()
        .find(|l| l.trim_start().starts_with("output 0:"))
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn run_prints_outputs_and_peaks() {
    let (ok, plain) = zerosched(&["run", "tests/fixtures/llama.program.json", "--seed", "3"]);
    assert!(ok, "{plain}");
    assert!(plain.contains("output 0: [] float32 sum"), "{plain}");
    assert!(plain.contains("peak memory per rank"), "{plain}");
    let (ok, sched) = zerosched(&[
        "run",
        "tests/fixtures/llama.program.json",
        "--seed",
        "3",
        "--world-size",
        "2",
        "--scheduler",
        "prefetch",
    ]);
    assert!(ok, "{sched}");
    assert!(sched.contains("(simulator: peak"), "{sched}");
    // Rank 0's loss is the same bits as the one-rank run of the same inputs.
    assert_eq!(loss_line(&plain), loss_line(&sched));
}

#[test]
fn run_refuses_ops_it_lacks_naming_the_node() {
    let (ok, text) = zerosched(&["run", "tests/fixtures/qwen2_moe_fwd_0.json"]);
    assert!(!ok);
    assert!(
        text.contains("aten._grouped_mm.default") && text.contains("(node `"),
        "{text}"
    );
}

#[test]
fn dry_run_needs_no_data() {
    let (ok, text) = zerosched(&[
        "run",
        "benches/data/mixtral8x7b_l2.program.json.gz",
        "--dry-run",
        "--world-size",
        "4",
        "--scheduler",
        "jit",
    ]);
    assert!(ok, "{text}");
    assert!(
        text.contains("(dry run)") && text.contains("simulator: peak"),
        "{text}"
    );
}
