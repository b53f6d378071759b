//! Regression tests for bugs that the property tests and the fuzzers found in the importers
//! and exporters. Each names the bug it pins.

use zerosched_ir::testing;
use zerosched_ir::{Arg, Dim, Program, SymInt, Val, binary, json};

fn fixed_point(doc: &[u8]) {
    let p = json::import(doc).expect("the document imports");
    let first = json::export(&p);
    let q = json::import(&first).expect("its export imports");
    assert_eq!(
        String::from_utf8_lossy(&first),
        String::from_utf8_lossy(&json::export(&q)),
        "JSON export is a fixed point"
    );
}

/// Found by `cargo fuzz run import_json`: an integer literal too large for i64 is read as
/// the float 6.6666666666666646e80; serde_json's default (fast, inexact) float parser read
/// the exporter's shortest spelling back one ULP off, so export was not a fixed point.
/// Fixed by enabling serde_json's `float_roundtrip`.
#[test]
fn big_integer_literal_float_round_trips() {
    fixed_point(include_bytes!(
        "regressions/float_roundtrip_big_integer_literal.json"
    ));
}

/// Found by the round-trip property test: `device_time_ms` 1.8628408660317017 came back as
/// ...015 (the same parser bug as above, on a plain time).
#[test]
fn device_time_round_trips_exactly() {
    let mut p = testing::chain(2);
    let g = &mut p.graphs[0];
    let id = g.order()[1];
    g.meta_mut(id).device_time_ms = Some(1.8628408660317017);
    let q = json::import(&json::export(&p)).unwrap();
    assert_eq!(
        q.graphs[0].node(q.graphs[0].order()[1]).meta.device_time_ms,
        Some(1.8628408660317017)
    );
}

/// Found by the round-trip property test: a node whose only metadata was a value JSON cannot
/// spell (a NaN float `meta.val`, or a NaN `device_time_ms`) was exported as
/// `"meta":{"val":null}` / `"meta":{}`, which re-imports as no metadata and then exports
/// without `meta`: export was not a fixed point.
#[test]
fn unspellable_meta_is_dropped_entirely() {
    let mut p = testing::chain(2);
    let g = &mut p.graphs[0];
    let (a, b) = (g.order()[1], g.order()[2]);
    g.meta_mut(a).val = Some(Val::Float(f64::NAN));
    *g.meta_mut(b) = Default::default();
    g.meta_mut(b).device_time_ms = Some(f64::INFINITY);
    let doc = json::export(&p);
    let text = String::from_utf8_lossy(&doc);
    assert!(
        !text.contains("\"val\":null") && !text.contains("\"meta\":{}"),
        "{text}"
    );
    fixed_point(&doc);
}

/// The binary document of `p`, with the bytes that encode the ARG `Arg::Str(marker)` replaced.
fn splice_arg(p: &Program, marker: &str, replacement: &[u8]) -> Vec<u8> {
    let bin = binary::export_with_arg_bytes(p, marker, replacement);
    assert_ne!(bin, binary::export(p), "the marker is in the document");
    bin
}

fn chain_with_arg(arg: Arg<zerosched_ir::NodeId>) -> Program {
    let mut p = testing::chain(1);
    let g = &mut p.graphs[0];
    let id = g.order()[1];
    let mut args = g.node(id).args.clone();
    args.push(arg);
    g.set_args(id, args, Default::default()).unwrap();
    p
}

/// Nested lists: `[[[...None...]]]`, `depth` lists deep, in bincode (List is variant 6).
fn nested_lists(depth: usize) -> Vec<u8> {
    let mut bytes = [6u8, 1].repeat(depth);
    bytes.push(0);
    bytes
}

/// Found by reading `binary.rs`: the binary decoder recursed once per nested ARG list with no
/// bound, so a few hundred kilobytes of `[[[[...` overflowed the stack (an abort, not an
/// error). It now stops at the ARG depth limit with an error.
#[test]
fn deeply_nested_binary_arg_is_an_error() {
    let p = chain_with_arg(Arg::Str("MARKER".into()));
    let bad = splice_arg(&p, "MARKER", &nested_lists(1_000_000));
    let err = binary::import(&bad).expect_err("a million nested lists are refused");
    assert!(err.to_string().contains("nested"), "{err}");
}

/// The ARG depth limit is the same for both encodings, and anything one accepts the other
/// accepts and round-trips: a binary document with ARGs nested deeper than JSON can carry
/// used to import, then export to JSON that its own importer refused (recursion limit).
#[test]
fn arg_depth_limit_agrees_between_encodings() {
    let limit = zerosched_ir::arg::MAX_DEPTH;
    let p = chain_with_arg(Arg::Str("MARKER".into()));
    // `limit` lists around `None`: JSON depth `limit`, accepted by both, both ways.
    let ok = binary::import(&splice_arg(&p, "MARKER", &nested_lists(limit))).expect("at the limit");
    let doc = json::export(&ok);
    let back = json::import(&doc).expect("its JSON export imports");
    assert_eq!(binary::export(&back), binary::export(&ok));
    // One more level: both refuse.
    assert!(binary::import(&splice_arg(&p, "MARKER", &nested_lists(limit + 1))).is_err());
    let deep =
        String::from_utf8_lossy(&doc).replacen(&"[".repeat(limit), &"[".repeat(limit + 1), 1);
    let deep = deep.replacen(&"]".repeat(limit), &"]".repeat(limit + 1), 1);
    let err = json::import(deep.as_bytes()).expect_err("one level deeper is refused");
    assert!(err.to_string().contains("nested"), "{err}");
}

/// Found by the corrupted-binary property test: the binary importer accepted a symbolic
/// shape entry with a negative hint (the JSON importer refuses it), and its JSON export then
/// failed to import. The verifier now checks every shape, stride and offset.
#[test]
fn negative_symbolic_hint_is_refused_by_both_importers() {
    let mut p = testing::chain(1);
    let g = &mut p.graphs[0];
    let id = g.order()[1];
    if let Some(Val::Tensor(t)) = &mut g.meta_mut(id).val {
        std::sync::Arc::make_mut(t).shape[0] = Dim::Sym(SymInt {
            expr: "s0".into(),
            hint: -56,
        });
    }
    let err = binary::import(&binary::export(&p)).expect_err("negative hint refused");
    assert!(err.to_string().contains("meta.val.shape[0]"), "{err}");
    assert!(json::import(&json::export(&p)).is_err());
}
