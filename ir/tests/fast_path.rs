//! The importers' fast paths against their careful paths (`json::import_careful`,
//! `binary::import_careful`): on generated documents and on damaged copies of them, `import`
//! must give exactly what the careful path gives — the same program, or the same error text.

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::Value;
use zerosched_ir::testing::{self, Config};
use zerosched_ir::{Arg, Graph, NodeId, Program, binary, json};

fn cases() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        ..ProptestConfig::default()
    }
}

/// Both importers on `bytes`, compared by export (JSON and binary) or by error text.
fn agree(bytes: &[u8]) -> Result<(), TestCaseError> {
    let describe = |r: &Result<zerosched_ir::Program, zerosched_ir::ImportError>| match r {
        Ok(p) => Ok((json::export(p), binary::export(p))),
        Err(e) => Err(e.to_string()),
    };
    let fast = describe(&json::import(bytes));
    let careful = describe(&json::import_careful(bytes));
    prop_assert!(
        fast == careful,
        "fast and careful paths differ\n--- fast\n{:?}\n--- careful\n{:?}\n--- document\n{}",
        fast.as_ref()
            .map(|(j, _)| String::from_utf8_lossy(j).into_owned()),
        careful
            .as_ref()
            .map(|(j, _)| String::from_utf8_lossy(j).into_owned()),
        String::from_utf8_lossy(bytes)
    );
    Ok(())
}

/// Replacement values: each of the JSON types, and numbers at the edges the importers treat
/// differently.
fn replacement(pick: u64) -> Value {
    let s = |t: &str| Value::String(t.to_owned());
    match pick % 22 {
        0 => Value::Null,
        1 => Value::Bool(true),
        2 => Value::from(-1),
        3 => Value::from(1.5),
        4 => Value::from(u64::MAX),
        5 => Value::from(i64::MAX as u64 + 1),
        6 => Value::from(1u64 << 32),
        7 => s("x"),
        8 => s("fx-program"),
        9 => s("bfloat16"),
        10 => s("output"),
        11 => Value::Array(vec![]),
        12 => Value::Array(vec![Value::Null, Value::from(3)]),
        13 => serde_json::json!({}),
        14 => serde_json::json!({"sym": "s0", "hint": 4}),
        15 => serde_json::json!({"sym": "s0", "hint": -4}),
        16 => serde_json::json!({"sym": "s0"}),
        17 => serde_json::json!({"node": "x"}),
        18 => serde_json::json!({"shape": [2, 3], "dtype": "float32"}),
        19 => serde_json::json!({"shape": [2, -3], "dtype": "float32"}),
        20 => Value::from(0),
        _ => Value::from(2.0),
    }
}

fn count(v: &Value) -> u64 {
    1 + match v {
        Value::Array(a) => a.iter().map(count).sum(),
        Value::Object(o) => o.values().map(count).sum(),
        _ => 0,
    }
}

/// Applies `op` to the `at`-th value in pre-order.
fn mutate(v: &mut Value, at: &mut u64, op: u64, seed: u64) -> bool {
    if *at == 0 {
        match op % 4 {
            // Replace the value.
            0 | 1 => *v = replacement(seed),
            // Drop a key or an item.
            2 => match v {
                Value::Object(o) if !o.is_empty() => {
                    let k = o.keys().nth((seed as usize) % o.len()).cloned();
                    if let Some(k) = k {
                        o.remove(&k);
                    }
                }
                Value::Array(a) if !a.is_empty() => {
                    a.remove((seed as usize) % a.len());
                }
                _ => *v = replacement(seed),
            },
            // Add a key (an unknown one, or a known one with a new value) or an item.
            _ => match v {
                Value::Object(o) => {
                    let keys = [
                        "zzz", "name", "kind", "op", "target", "args", "meta", "val", "hint",
                        "sym", "shape", "stride", "device", "params", "grads", "version",
                    ];
                    o.insert(
                        keys[(seed as usize) % keys.len()].to_owned(),
                        replacement(seed / 7),
                    );
                }
                Value::Array(a) => a.push(replacement(seed)),
                _ => *v = replacement(seed),
            },
        }
        return true;
    }
    *at -= 1;
    match v {
        Value::Array(a) => a.iter_mut().any(|x| mutate(x, at, op, seed)),
        Value::Object(o) => o.values_mut().any(|x| mutate(x, at, op, seed)),
        _ => false,
    }
}

/// Both binary importers on `bytes`, compared by binary export or by error text.
fn agree_bin(bytes: &[u8]) -> Result<(), TestCaseError> {
    let fast = binary::import(bytes)
        .map(|p| binary::export(&p))
        .map_err(|e| e.to_string());
    let careful = binary::import_careful(bytes)
        .map(|p| binary::export(&p))
        .map_err(|e| e.to_string());
    prop_assert_eq!(fast, careful);
    Ok(())
}

proptest! {
    #![proptest_config(cases())]

    /// A changed byte (about 64 sampled positions per case), a cut, or a graph whose nodes
    /// point forward or repeat a name.
    #[test]
    fn binary_fast_path_agrees_on_damaged_documents(
        p in testing::program(&Config::small()),
        flip in 1u8..=255,
        offset in any::<usize>(),
    ) {
        let bin = binary::export(&p);
        agree_bin(&bin)?;
        let step = (bin.len() / 64).max(1);
        let mut bad = bin.clone();
        for i in (offset % step..bad.len()).step_by(step) {
            bad[i] ^= flip;
            agree_bin(&bad)?;
            bad[i] = bin[i];
            agree_bin(&bin[..i])?;
        }
    }

    #[test]
    fn fast_path_agrees_on_exports(p in testing::program(&Config::default())) {
        agree(&json::export(&p))?;
    }

    #[test]
    fn fast_path_agrees_on_damaged_documents(
        p in testing::program(&Config::small()),
        picks in proptest::collection::vec((any::<u64>(), any::<u64>(), any::<u64>()), 1..4),
    ) {
        let mut v: Value = serde_json::from_slice(&json::export(&p)).unwrap();
        for (at, op, seed) in picks {
            let mut at = at % count(&v);
            mutate(&mut v, &mut at, op, seed);
        }
        agree(serde_json::to_string(&v).unwrap().as_bytes())?;
    }

    /// Text-level damage: a repeated key, a cut, a stray byte.
    #[test]
    fn fast_path_agrees_on_damaged_text(
        p in testing::program(&Config::small()),
        at in any::<u64>(),
        how in 0u8..4,
    ) {
        let text = String::from_utf8(json::export(&p)).unwrap();
        let i = (at as usize) % text.len();
        let i = (0..=i).rev().find(|&j| text.is_char_boundary(j)).unwrap_or(0);
        let damaged = match how {
            0 => {
                // Repeat the first key at or after `i` (with a null value) right after its
                // object's opening brace.
                match text[..i].rfind('{') {
                    Some(b) => {
                        let rest = &text[b + 1..];
                        match rest.find("\":") {
                            Some(e) if rest.starts_with('"') => {
                                let key = &rest[..e + 2];
                                format!("{}{}null,{}", &text[..=b], key, rest)
                            }
                            _ => text.clone(),
                        }
                    }
                    None => text.clone(),
                }
            }
            1 => text[..i].to_owned(),
            2 => format!("{}\\{}", &text[..i], &text[i..]),
            _ => format!("{}\"a\\u0041\"{}", &text[..i], &text[i..]),
        };
        agree(damaged.as_bytes())?;
    }
}

#[test]
fn fast_path_agrees_on_error_fixtures() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/import_errors");
    let mut seen = 0;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let path = e.path();
        if path.extension().is_some_and(|x| x == "json") {
            agree(&std::fs::read(&path).unwrap()).unwrap();
            seen += 1;
        }
    }
    assert!(seen > 0);
}

/// Distinct tensor metadata addresses over the tensors of every node, and distinct values.
fn tensor_sharing(p: &zerosched_ir::Program) -> (usize, usize, usize) {
    use std::collections::HashSet;
    use zerosched_ir::Val;
    let (mut tensors, mut addrs, mut values) = (0, HashSet::new(), HashSet::new());
    for g in &p.graphs {
        for (_, n) in g.nodes() {
            let shared = match &n.meta.val {
                Some(Val::Tensor(t)) => vec![t],
                Some(Val::Tuple(ts)) => ts.iter().flatten().collect(),
                _ => vec![],
            };
            for t in shared {
                tensors += 1;
                addrs.insert(std::sync::Arc::as_ptr(t));
                values.insert(&**t);
            }
        }
    }
    (tensors, addrs.len(), values.len())
}

/// Both importers hand out one copy of each tensor metadata instead of one per node: the JSON
/// importer per distinct `meta` text of a graph, the binary importer per distinct value of a
/// graph. Memory per node and the cost of cloning a graph depend on it.
#[test]
fn importers_share_tensor_metadata_between_nodes() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/llama.program.json"
    );
    let bytes = std::fs::read(path).unwrap();
    let from_json = json::import(&bytes).unwrap();
    let (tensors, addrs, values) = tensor_sharing(&from_json);
    assert!(
        addrs * 3 < tensors,
        "{addrs} copies for {tensors} tensors ({values} distinct)"
    );
    let from_binary = binary::import(&binary::export(&from_json)).unwrap();
    let graphs = from_binary.graphs.len();
    let (tensors_b, addrs_b, values_b) = tensor_sharing(&from_binary);
    assert_eq!((tensors_b, values_b), (tensors, values));
    // One copy per distinct value in each graph: at most one per graph for each value.
    assert!(
        addrs_b >= values && addrs_b <= values * graphs,
        "{addrs_b} copies, {values} values"
    );
}

/// A program that breaks one rule of the structural verifier, in one node of a small graph
/// (`x` → `y` → output): `damage` edits the graph, given `y`'s and the output's handles.
fn with_problem(damage: impl FnOnce(&mut Graph, NodeId, NodeId)) -> Program {
    use zerosched_ir::{Dim, Dtype, GraphKind, Meta, Node, Op, TensorMeta, Val};
    let tensor = |dims: Vec<u64>| {
        let shape = dims.into_iter().map(Dim::Const).collect();
        Some(Val::Tensor(std::sync::Arc::new(TensorMeta::new(
            shape,
            Dtype::Float32,
        ))))
    };
    let mut g = Graph::new(Some("forward".into()), GraphKind::Forward);
    let x = g
        .push(Node {
            op: Op::Placeholder,
            meta: Box::new(Meta {
                val: tensor(vec![4]),
                ..Meta::default()
            }),
            ..Node::call("x", "x", vec![])
        })
        .unwrap();
    let y = g
        .push(Node {
            meta: Box::new(Meta {
                val: tensor(vec![4]),
                aliases: Some(vec![]),
                ..Meta::default()
            }),
            ..Node::call("y", "aten.relu.default", vec![Arg::Node(x)])
        })
        .unwrap();
    let out = g
        .push(Node {
            op: Op::Output,
            ..Node::call("output", "output", vec![Arg::List(vec![Arg::Node(y)])])
        })
        .unwrap();
    damage(&mut g, y, out);
    Program::single(g)
}

/// The binary fast path checks each node as it reads it and leaves the checks over whole
/// graphs to the verifier after: for a problem of either kind, the binary importer must
/// refuse the document with the verifier's own words, the fast path's verdict and the careful
/// path's alike.
#[test]
fn binary_fast_path_refuses_what_the_verifier_refuses() {
    use zerosched_ir::{Dim, Dtype, Node, Op, SymInt, TensorMeta, Val};
    // 64 lists are as deep as the binary reader goes; the `nan` inside, an object in JSON,
    // is one level more than JSON allows.
    let deep = (0..64).fold(Arg::Float(f64::NAN), |inner, _| Arg::List(vec![inner]));
    let cases: Vec<(&str, Program)> = vec![
        (
            "alias index out of range",
            with_problem(|g, y, _| g.meta_mut(y).aliases = Some(vec![3])),
        ),
        (
            "negative symbolic size",
            with_problem(|g, y, _| {
                let shape = vec![Dim::Sym(SymInt {
                    expr: "s0".into(),
                    hint: -2,
                })];
                g.meta_mut(y).val = Some(Val::Tensor(std::sync::Arc::new(TensorMeta::new(
                    shape,
                    Dtype::Float32,
                ))));
            }),
        ),
        (
            "byte size overflows",
            with_problem(|g, y, _| {
                let shape = vec![Dim::Const(u64::MAX / 2), Dim::Const(8)];
                g.meta_mut(y).val = Some(Val::Tensor(std::sync::Arc::new(TensorMeta::new(
                    shape,
                    Dtype::Float32,
                ))));
            }),
        ),
        (
            "tuple whose tensors' sizes overflow together",
            with_problem(|g, y, _| {
                // 2^61 float32 elements: 2^63 bytes each, fine alone, too many for u64 as two.
                let half =
                    std::sync::Arc::new(TensorMeta::new(vec![Dim::Const(1 << 61)], Dtype::Float32));
                g.meta_mut(y).val = Some(Val::Tuple(vec![Some(half.clone()), Some(half)]));
            }),
        ),
        (
            "ARG nested deeper than JSON allows",
            with_problem(|g, y, _| {
                let mut args = g.node(y).args.clone();
                args.push(deep);
                g.set_args(y, args, Default::default()).unwrap();
            }),
        ),
        (
            "reference to the output node",
            with_problem(|g, _, out| {
                g.push(Node::call("z", "aten.relu.default", vec![Arg::Node(out)]))
                    .unwrap();
            }),
        ),
        (
            "two output nodes",
            with_problem(|g, y, _| {
                g.push(Node {
                    op: Op::Output,
                    ..Node::call("output_1", "output", vec![Arg::List(vec![Arg::Node(y)])])
                })
                .unwrap();
            }),
        ),
        (
            "no output node",
            with_problem(|g, _, out| g.remove(out).map(drop).unwrap()),
        ),
    ];
    for (what, p) in cases {
        let expected = zerosched_ir::verify::program(&p)
            .expect_err(what)
            .to_string();
        let bin = binary::export(&p);
        let fast = binary::import(&bin).expect_err(what).to_string();
        let careful = binary::import_careful(&bin).expect_err(what).to_string();
        assert_eq!(fast, careful, "{what}");
        assert!(
            fast.contains(&expected),
            "{what}: {fast} against {expected}"
        );
    }
}
