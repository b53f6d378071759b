//! `zerosched run` end to end: outputs with shape, dtype and checksum, measured peaks beside
//! the simulator's, identical checksums for the original and the scheduled program, and a
//! non-zero exit naming the node for an op the CPU backend lacks, and a run too large for the
//! host refused before it starts.

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

/// A graph with an op the CPU backend lacks (here `rsqrt` renamed to an op no backend has).
#[test]
fn run_refuses_ops_it_lacks_naming_the_node() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_fwd_0.json"),
    )
    .expect("fixture");
    let edited = text.replacen("aten.rsqrt.default", "aten.frobnicate.default", 1);
    assert_ne!(edited, text);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("unknown_op.json");
    std::fs::write(&path, edited).expect("write");
    let (ok, text) = zerosched(&["run", path.to_str().expect("utf-8")]);
    assert!(!ok);
    assert!(
        text.contains("aten.frobnicate.default") && text.contains("(node `rsqrt"),
        "{text}"
    );
}

/// `llama_fwd_0` with its token ids (`primals_1`, int64 `[2, 16]`) claiming `[2, n]`: valid,
/// and as large as the user says.
fn with_token_ids(dir: &std::path::Path, n: u64) -> String {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_fwd_0.json"),
    )
    .expect("fixture");
    let from = r#""shape":[2,16],"storage_offset":0,"stride":[16,1]}},"name":"primals_1""#;
    let to =
        format!(r#""shape":[2,{n}],"storage_offset":0,"stride":[{n},1]}}}},"name":"primals_1""#);
    assert!(text.contains(from));
    let path = dir.join(format!("token_ids_2x{n}.json"));
    std::fs::write(&path, text.replacen(from, &to, 1)).expect("write");
    path.to_str().expect("utf-8").to_owned()
}

fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Token ids claiming 2 x 16e9 elements (256 GB of int64): refused before anything runs, the
/// message naming what the run needs and what is available (the host's, or `--memory-limit`),
/// exit code 1, not an allocator abort.
#[test]
fn a_run_that_cannot_fit_is_refused_before_it_starts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = with_token_ids(dir.path(), 16_000_000_000);
    let refused = |args: &[&str], available: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_zerosched"))
            .args(args)
            .output()
            .expect("runs");
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{text}");
        // The token ids alone are 256e9 bytes; the rest of the graph adds about a megabyte.
        let need: u64 = text
            .split("needs ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{text}"));
        assert!((256_000_000_000..256_010_000_000).contains(&need), "{text}");
        assert!(text.contains(available), "{text}");
    };
    refused(
        &["run", &path, "--memory-limit", "1GiB"],
        "more than the 1073741824 bytes available (--memory-limit)",
    );
    if mem_available().is_some_and(|m| m < 256_000_000_000) {
        refused(
            &["run", &path],
            "bytes available (MemAvailable in /proc/meminfo)",
        );
    }
}

/// An allocation that fails anyway (here a limit that lets through token ids of 2^60 int64s,
/// more than any machine can address) is an error naming the node, not an abort.
#[test]
fn an_allocation_that_fails_names_the_node() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = with_token_ids(dir.path(), 1 << 59);
    let out = Command::new(env!("CARGO_BIN_EXE_zerosched"))
        .args(["run", &path, "--memory-limit", &u64::MAX.to_string()])
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("node `primals_1`")
            && text.contains("cannot allocate 9223372036854775808 bytes"),
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

/// Every fixture, unscheduled and scheduled, on 1, 2 and 4 ranks: each run succeeds and
/// reports one measured peak per rank (beside the simulator's when scheduled), and rank 0's
/// first output is the same bits in every run of a fixture (rank 0 draws the same inputs
/// whatever the world size, and scheduling changes no arithmetic).
#[test]
fn every_fixture_runs_scheduled_and_unscheduled_on_1_2_and_4_ranks() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut fixtures: Vec<String> = std::fs::read_dir(&dir)
        .expect("fixtures")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            format!(
                "tests/fixtures/{}",
                p.file_name().unwrap_or_default().to_string_lossy()
            )
        })
        .collect();
    fixtures.sort();
    assert!(fixtures.len() >= 12, "{fixtures:?}");
    for f in &fixtures {
        let mut first: Option<String> = None;
        for world in ["1", "2", "4"] {
            for scheduled in [false, true] {
                let mut args = vec!["run", f.as_str(), "--world-size", world];
                if scheduled {
                    args.extend(["--scheduler", "prefetch"]);
                }
                let (ok, text) = zerosched(&args);
                let what = format!("{f} x{world} scheduled={scheduled}");
                assert!(ok, "{what}: {text}");
                let ranks = text
                    .lines()
                    .filter(|l| l.contains("peak memory per rank"))
                    .map(|l| l.split(';').next().unwrap_or_default().matches(',').count() + 1);
                for n in ranks {
                    assert_eq!(n.to_string(), world, "{what}: {text}");
                }
                assert_eq!(
                    text.contains("(simulator: peak"),
                    scheduled,
                    "{what}: {text}"
                );
                let line = loss_line(&text);
                assert!(!line.is_empty(), "{what}: {text}");
                match &first {
                    None => first = Some(line),
                    Some(l) => assert_eq!(&line, l, "{what}"),
                }
            }
        }
    }
}
