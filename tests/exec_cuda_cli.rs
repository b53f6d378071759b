//! The CUDA executor on a machine without CUDA (CI's): `zerosched run --executor cuda` and
//! `zerosched calibrate` exit 1 with a message naming what is missing, never a panic.

use std::process::Command;

fn zerosched(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zerosched"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// An NVIDIA driver is installed (a GPU machine): these expectations do not apply.
fn has_driver() -> bool {
    std::path::Path::new("/proc/driver/nvidia").exists()
}

fn expect_missing(args: &[&str]) {
    let (code, err) = zerosched(args);
    assert_eq!(code, Some(1), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    if cfg!(feature = "cuda") {
        assert!(
            err.starts_with("error: the CUDA executor cannot start: libcuda (CUDA driver) is not loadable: tried libcuda.so,")
                && err.contains("system library path"),
            "{args:?}: {err}"
        );
    } else {
        assert!(
            err.contains("built without the CUDA backend"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn run_with_the_cuda_executor_names_the_missing_driver() {
    if has_driver() {
        return;
    }
    expect_missing(&["run", "--executor", "cuda"]);
    expect_missing(&[
        "run",
        "tests/fixtures/llama.program.json",
        "--executor",
        "cuda",
        "--world-size",
        "2",
    ]);
}

#[test]
fn calibrate_names_the_missing_driver() {
    if has_driver() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("table.json");
    expect_missing(&["calibrate", "-o", out.to_str().expect("utf-8")]);
    // Checked before any rank is spawned.
    expect_missing(&[
        "calibrate",
        "-o",
        out.to_str().expect("utf-8"),
        "--world-size",
        "2",
    ]);
    assert!(!out.exists(), "nothing written");
}

#[test]
fn replay_and_profile_name_the_missing_driver() {
    if has_driver() {
        return;
    }
    expect_missing(&[
        "run",
        "tests/fixtures/llama.program.json",
        "--executor",
        "cuda",
        "--replay",
        "--scheduler",
        "prefetch",
    ]);
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("profiled.json");
    expect_missing(&[
        "profile",
        "tests/fixtures/llama.program.json",
        "-o",
        out.to_str().expect("utf-8"),
    ]);
    assert!(!out.exists(), "nothing written");
}

#[test]
fn replay_needs_the_cuda_executor() {
    let (code, err) = zerosched(&["run", "--replay"]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(
        err,
        "error: --replay runs on the GPU: it needs --executor cuda\n"
    );
    let (code, err) = zerosched(&["run", "--executor", "cuda", "--replay", "--dry-run"]);
    assert_eq!(code, Some(2), "a usage error: {err}");
}
