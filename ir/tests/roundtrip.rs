//! Round trips of the two encodings over generated ZeRO-3-like programs
//! (`zerosched_ir::testing`): export is a fixed point, the encodings agree, JSON key order and
//! whitespace do not matter, a damaged binary document never panics, and a very deep graph
//! neither overflows the stack nor takes long.

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::Value;
use zerosched_ir::testing::{self, Config};
use zerosched_ir::{Program, binary, json, verify};

fn cases() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        ..ProptestConfig::default()
    }
}

fn import_json(bytes: &[u8]) -> Result<Program, TestCaseError> {
    json::import(bytes).map_err(|e| {
        TestCaseError::fail(format!(
            "{e}\n--- document\n{}",
            String::from_utf8_lossy(bytes)
        ))
    })
}

fn import_bin(bytes: &[u8]) -> Result<Program, TestCaseError> {
    binary::import(bytes).map_err(|e| TestCaseError::fail(e.to_string()))
}

/// `Ok` if equal, else the first differing line of each.
fn same(a: &[u8], b: &[u8]) -> Result<(), TestCaseError> {
    if a == b {
        return Ok(());
    }
    let (a, b) = (String::from_utf8_lossy(a), String::from_utf8_lossy(b));
    let (i, (la, lb)) = a
        .lines()
        .zip(b.lines())
        .enumerate()
        .find(|(_, (x, y))| x != y)
        .unwrap_or((0, ("<length differs>", "")));
    Err(TestCaseError::fail(format!(
        "line {i} differs:\n  {la}\n  {lb}"
    )))
}

/// Re-serializes a JSON value with every object's keys in a seeded random order and random
/// whitespace between tokens.
fn shuffled(v: &Value, rng: &mut u64, out: &mut String) {
    fn next(rng: &mut u64) -> u64 {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng
    }
    let ws = |r: u64, out: &mut String| match r % 5 {
        0 => out.push(' '),
        1 => out.push_str("\n  "),
        2 => out.push('\t'),
        _ => {}
    };
    match v {
        Value::Object(m) => {
            let mut entries: Vec<(&String, &Value)> = m.iter().collect();
            for i in (1..entries.len()).rev() {
                let j = (next(rng) % (i as u64 + 1)) as usize;
                entries.swap(i, j);
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(next(rng), out);
                out.push_str(&serde_json::to_string(k).unwrap());
                ws(next(rng), out);
                out.push(':');
                shuffled(v, rng, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(next(rng), out);
                shuffled(v, rng, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

proptest! {
    #![proptest_config(cases())]

    /// Every generated program verifies: the generators only make valid documents.
    #[test]
    fn generated_programs_verify(p in testing::program(&Config::default())) {
        verify::program(&p).map_err(|d| TestCaseError::fail(d.to_string()))?;
    }

    /// export → import → export gives the same bytes, and the two imports are equal graphs
    /// (compared through their binary form, which holds every field).
    #[test]
    fn json_export_is_a_fixed_point(p in testing::program(&Config::default())) {
        let first = json::export(&p);
        let q = import_json(&first)?;
        let second = json::export(&q);
        same(&first, &second)?;
        let r = import_json(&second)?;
        prop_assert_eq!(binary::export(&q), binary::export(&r));
    }

    /// Without values JSON cannot spell, the program itself survives the JSON round trip.
    #[test]
    fn json_import_gives_the_exported_program(p in testing::program(&Config::default().plain())) {
        let q = import_json(&json::export(&p))?;
        same(&json::export(&p), &json::export(&q))?;
        prop_assert!(binary::export(&p) == binary::export(&q), "the program changed");
    }

    /// JSON → binary → JSON reproduces the document byte for byte, and binary export is a
    /// fixed point too.
    #[test]
    fn json_binary_json_is_the_identity(p in testing::program(&Config::default())) {
        let doc = json::export(&p);
        let q = import_json(&doc)?;
        let bin = binary::export(&q);
        let r = import_bin(&bin)?;
        same(&doc, &json::export(&r))?;
        prop_assert!(bin == binary::export(&r), "binary export is not a fixed point");
    }

    /// The exporter's output does not depend on the key order or whitespace of its input.
    #[test]
    fn export_ignores_input_key_order(p in testing::program(&Config::default()), seed in any::<u64>()) {
        let doc = json::export(&p);
        let value: Value = serde_json::from_slice(&doc).unwrap();
        let mut permuted = String::new();
        let mut rng = seed | 1;
        shuffled(&value, &mut rng, &mut permuted);
        let q = import_json(permuted.as_bytes())?;
        same(&doc, &json::export(&q))?;
    }

    /// Every proper prefix of a binary document is rejected with an error.
    #[test]
    fn truncated_binary_is_an_error(p in testing::program(&Config::small())) {
        let bin = binary::export(&p);
        for len in 0..bin.len() {
            prop_assert!(binary::import(&bin[..len]).is_err(), "a {len}-byte prefix of {} imported", bin.len());
        }
    }

    /// Changing a byte of a binary document (about 128 sampled positions per case) never panics; when the damage still
    /// decodes (a changed name, say) the result is a valid program that re-exports cleanly.
    #[test]
    fn corrupted_binary_never_panics(
        p in testing::program(&Config::small()),
        flip in 1u8..=255,
        offset in any::<usize>(),
    ) {
        let bin = binary::export(&p);
        let mut bad = bin.clone();
        // About 128 positions per case, at a random phase: over 256 cases every byte offset
        // of a typical document is hit, and the test stays quick.
        let step = (bin.len() / 128).max(1);
        for i in (offset % step..bad.len()).step_by(step) {
            bad[i] ^= flip;
            if let Ok(q) = binary::import(&bad) {
                verify::program(&q).map_err(|d| TestCaseError::fail(d.to_string()))?;
                let again = binary::export(&q);
                prop_assert!(binary::import(&again).is_ok());
                let doc = json::export(&q);
                if let Err(e) = json::import(&doc) {
                    return Err(TestCaseError::fail(format!(
                        "byte {i}: JSON export of an accepted binary document does not import: {e}\n{}",
                        String::from_utf8_lossy(&doc)
                    )));
                }
            }
            bad[i] = bin[i];
        }
    }
}

/// A 100,000-node chain imports, verifies and exports in the default test thread's stack.
#[test]
fn deep_chain() {
    let n = 100_000;
    let p = testing::chain(n);
    let doc = json::export(&p);
    let q = json::import(&doc).expect("the chain imports");
    verify::program(&q).expect("the chain verifies");
    assert_eq!(q.node_count(), n + 2);
    assert_eq!(json::export(&q), doc);
    let bin = binary::export(&q);
    let r = binary::import(&bin).expect("the binary chain imports");
    verify::program(&r).expect("the binary chain verifies");
    assert_eq!(json::export(&r), doc);
    assert_eq!(binary::export(&r), bin);
}

/// The fixtures survive both round trips.
#[test]
fn fixtures_round_trip() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let mut stack = vec![root];
    let mut seen = 0;
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let bytes = std::fs::read(&path).unwrap();
            let p = json::import(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let doc = json::export(&p);
            let q = json::import(&doc).unwrap();
            assert_eq!(json::export(&q), doc, "{}", path.display());
            let r = binary::import(&binary::export(&q)).unwrap();
            assert_eq!(json::export(&r), doc, "{}", path.display());
            seen += 1;
        }
    }
    assert!(seen >= 1);
}

/// The program-level `persistent` list: read at the top of a bundle and of a single graph's
/// document, by both JSON paths; written back where it was read, and through the binary
/// form; a graph inside a bundle may carry one too, which the program's list does not take;
/// a document without one (every v1 document before it) reads as an empty list.
#[test]
fn the_program_level_persistent_list_round_trips() {
    let graph = r#"{"format":"fx-graph","version":1,"name":"g","kind":"backward","nodes":[
{"name":"x","op":"placeholder","target":"x","args":[],"kwargs":{},"meta":{"val":{"shape":[4],"dtype":"float32"}}},
{"name":"output","op":"output","target":"output","args":[[{"node":"x"}]],"kwargs":{}}
],"params":[],"grads":[{"param":"norm.weight","output_index":0}]"#;
    let single = format!("{graph},\"persistent\":[\"norm.weight\",\"b\",\"b\"]}}");
    let bundle = format!(
        "{{\"format\":\"fx-program\",\"version\":1,\"persistent\":[\"norm.weight\"],\"graphs\":[{graph},\"persistent\":[\"inner\"]}}]}}"
    );
    let plain = format!("{{\"format\":\"fx-program\",\"version\":1,\"graphs\":[{graph}}}]}}");
    let names = |p: &Program| p.persistent_list.iter().cloned().collect::<Vec<_>>();
    for (doc, want) in [
        (&single, vec!["b", "norm.weight"]),
        (&bundle, vec!["norm.weight"]),
        (&plain, vec![]),
    ] {
        let fast = json::import(doc.as_bytes()).expect("imports");
        let careful = json::import_careful(doc.as_bytes()).expect("imports carefully");
        assert_eq!(names(&fast), want, "{doc}");
        assert_eq!(names(&careful), want, "{doc}");
        // The gradient's own entry says nothing; the program's list makes it persistent.
        assert_eq!(fast.persistent().contains("norm.weight"), !want.is_empty());
        let out = json::export(&fast);
        assert_eq!(names(&json::import(&out).expect("reimports")), want);
        let bin = binary::import(&binary::export(&fast)).expect("binary");
        assert_eq!(names(&bin), want);
        assert_eq!(json::export(&bin), out);
    }
    // A list that is not a list of names is refused where it stands.
    let bad = format!("{graph},\"persistent\":[1]}}");
    let e = json::import(bad.as_bytes()).unwrap_err().to_string();
    assert!(e.contains("line 4"), "{e}");
}
