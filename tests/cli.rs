//! The command line end to end: accepted inputs, conversions, exit codes, atomic output.

mod common;

use common::{files, relative, zerosched};

fn documents() -> Vec<std::path::PathBuf> {
    let mut all = files("tests/fixtures", &[".json", ".json.gz"]);
    all.extend(files("benches/data", &[".json.gz"]));
    all
}

#[test]
fn check_accepts_every_fixture() {
    let docs = documents();
    assert!(!docs.is_empty());
    for doc in docs {
        let out = zerosched(&["check", &relative(&doc)]);
        assert!(
            out.status.success(),
            "{}: {}",
            doc.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains(": ok"));
    }
}

#[test]
fn check_without_a_file_uses_the_embedded_default() {
    let out = zerosched(&["check"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("<embedded default>: ok"), "{stdout}");
}

#[test]
fn json_binary_json_is_the_identity_for_every_fixture() {
    let tmp = tempfile::tempdir().expect("temp dir");
    for doc in documents() {
        let bin = tmp.path().join("g.zsg");
        let back = tmp.path().join("g.json");
        let bin_s = bin.to_string_lossy().into_owned();
        let back_s = back.to_string_lossy().into_owned();
        let once = tmp.path().join("once.json");
        let once_s = once.to_string_lossy().into_owned();
        for (from, to) in [
            (relative(&doc), &once_s),
            (once_s.clone(), &bin_s),
            (bin_s.clone(), &back_s),
        ] {
            let out = zerosched(&["convert", &from, "-o", to]);
            assert!(
                out.status.success(),
                "{from}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let a = std::fs::read(&once).expect("first export");
        let b = std::fs::read(&back).expect("second export");
        assert!(
            a == b,
            "{}: JSON -> binary -> JSON changed the document",
            doc.display()
        );
        let bin_bytes = std::fs::read(&bin).expect("binary");
        assert!(bin_bytes.starts_with(zerosched_ir::binary::MAGIC));
    }
}

#[test]
fn convert_of_invalid_input_writes_nothing() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let target = tmp.path().join("out.zsg");
    let out = zerosched(&[
        "convert",
        "tests/import_errors/cycle_between_two_nodes.json",
        "-o",
        &target.to_string_lossy(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!target.exists(), "no output file for rejected input");
    assert_eq!(
        std::fs::read_dir(tmp.path()).expect("dir").count(),
        0,
        "no temporary file left behind"
    );
}

#[test]
fn convert_into_a_missing_directory_fails_cleanly() {
    let out = zerosched(&[
        "convert",
        "tests/fixtures/edge/param_only_used_by_output.json",
        "-o",
        "/nonexistent-dir/x.json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent-dir/x.json"));
}

#[test]
fn usage_errors_exit_with_two() {
    assert_eq!(zerosched(&["frobnicate"]).status.code(), Some(2));
    assert_eq!(zerosched(&["convert", "a.json"]).status.code(), Some(2));
    let help = zerosched(&["--help"]);
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("Examples:"));
}

#[test]
fn gzip_output_is_deterministic_and_readable() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let a = tmp.path().join("a.json.gz");
    let b = tmp.path().join("b.json.gz");
    for t in [&a, &b] {
        let out = zerosched(&[
            "convert",
            "tests/fixtures/edge/param_only_used_by_output.json",
            "-o",
            &t.to_string_lossy(),
        ]);
        assert!(out.status.success());
    }
    assert_eq!(std::fs::read(&a).expect("a"), std::fs::read(&b).expect("b"));
    assert!(zerosched(&["check", &a.to_string_lossy()]).status.success());
}

/// `--dump-after insert --dump-format listing` writes the program as insertion left it, as the
/// IR's listing: the gathers are there, in the order the listing of the imported dump has them.
#[test]
fn dump_after_writes_a_listing() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let out_path = tmp.path().join("out.json");
    let out = zerosched(&[
        "schedule",
        "tests/fixtures/gpt2_fwd_0.json",
        "-o",
        &out_path.to_string_lossy(),
        "--dump-after",
        "insert",
        "--dump-after",
        "schedule",
        "--dump-format",
        "listing",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listing = std::fs::read_to_string(tmp.path().join("out.after-insert.txt"))
        .expect("the listing after insert");
    assert!(listing.starts_with("# graph "), "{listing}");
    assert!(
        listing.contains("= zerosched.allgather.default(%"),
        "{listing}"
    );
    let scheduled = std::fs::read_to_string(tmp.path().join("out.after-schedule.txt"))
        .expect("the listing after schedule");
    assert_ne!(listing, scheduled, "scheduling moved the gathers");
    // The same dump as JSON lists the same.
    let json = tmp.path().join("j.json");
    let out = zerosched(&[
        "schedule",
        "tests/fixtures/gpt2_fwd_0.json",
        "-o",
        &json.to_string_lossy(),
        "--dump-after",
        "insert",
    ]);
    assert!(out.status.success());
    let dumped = zerosched_api::io::read_program(&tmp.path().join("j.after-insert.json"))
        .expect("the JSON dump imports");
    assert_eq!(zerosched_ir::listing::program(&dumped), listing);
}

/// `RUST_LOG=zerosched=debug zerosched schedule` explains the schedule on stderr: each gather
/// as it is issued and before which node, the ones the budget held back, closed buckets, kept
/// parameters and the simulator's stalls, under spans naming the pass and the graph. Without
/// `RUST_LOG` stderr stays empty.
#[test]
fn rust_log_explains_the_schedule() {
    let run = |log: Option<&str>, budget: &str| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_zerosched"));
        cmd.args([
            "schedule",
            "tests/fixtures/llama.program.json",
            "--budget",
            budget,
        ])
        .current_dir(common::root())
        .env_remove("RUST_LOG");
        if let Some(log) = log {
            cmd.env("RUST_LOG", log);
        }
        cmd.output().expect("the zerosched binary runs")
    };
    // One layer's worth: prefetching is held back and not every parameter can be kept.
    let quiet = run(None, "147968");
    assert!(quiet.status.success());
    assert!(
        quiet.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&quiet.stderr)
    );

    let out = run(Some("zerosched=debug"), "147968");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "pass{pass=\"schedule\"}:graph{graph=\"llama_fwd_0\"}",
        "gather issued",
        "gather held back: prefetching it here would pass the budget",
        "parameter kept from the forward to the backward",
        "parameter not kept: holding it would pass the budget",
        "simulate{graph=\"llama_bwd_0\"}",
        "scheduled",
    ] {
        assert!(log.contains(needle), "no `{needle}` in:\n{log}");
    }
    // The standard output (the report table) is the same with or without the log.
    assert_eq!(out.stdout, quiet.stdout);
    // Buckets form; the log says where one closed.
    assert!(log.contains("bucket closed"), "{log}");
    let unlimited = run(Some("zerosched_passes::schedule=debug"), "1TiB");
    let log = String::from_utf8_lossy(&unlimited.stderr);
    assert!(log.contains("gather issued"), "{log}");
    assert!(
        !log.contains("simulate{"),
        "the filter selects the scheduler only:\n{log}"
    );
}

/// `--memory`: too little names the whole program's smallest figure, which works when given
/// back and holds the schedule within it; `check --memory` refuses the same schedule one byte
/// under its simulated peak.
#[test]
fn memory_budget_names_its_smallest_and_check_verifies_it() {
    let input = "tests/fixtures/qwen2_moe.program.json";
    let out = zerosched(&["schedule", input, "--memory", "1KiB"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let needed: u64 = stderr
        .split("the smallest memory budget that works is ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no figure in: {stderr}"));
    let dir = tempfile::tempdir().expect("temp dir");
    let (scheduled, report) = (dir.path().join("s.json"), dir.path().join("r.json"));
    let (s, r) = (relative(&scheduled), relative(&report));
    let needed_arg = needed.to_string();
    let out = zerosched(&[
        "schedule",
        input,
        "--memory",
        &needed_arg,
        "-o",
        &s,
        "--report",
        &r,
    ]);
    assert!(
        out.status.success(),
        "at {needed}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&report).expect("report");
    let json: serde_json::Value = serde_json::from_str(&text).expect("report JSON");
    let peak = json["simulation"]["total"]["peak_total_bytes"]
        .as_u64()
        .expect("peak");
    assert!(peak <= needed, "{peak} > {needed}");
    assert_eq!(json["memory_bytes"].as_u64(), Some(needed));
    let at = |m: u64| zerosched(&["check", &s, "--memory", &m.to_string()]);
    assert!(at(peak).status.success());
    let under = at(peak - 1);
    assert_eq!(under.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&under.stderr).contains("over the memory budget"),
        "{}",
        String::from_utf8_lossy(&under.stderr)
    );
}
