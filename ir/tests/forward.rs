//! A backward graph's `forward`: read and written by every path, and checked against the
//! bundle that holds it.

use zerosched_ir::{GraphKind, Program, binary, json, testing, verify};

/// Forward `f0`, forward `f1`, then their backward graphs, each naming its forward.
fn fragments() -> Program {
    let graph = |name: &str, kind: GraphKind, forward: Option<&str>| {
        let mut g = testing::chain(2).graphs.remove(0);
        g.name = Some(name.into());
        g.kind = kind;
        g.forward = forward.map(str::to_owned);
        g
    };
    Program::bundle(vec![
        graph("f0", GraphKind::Forward, None),
        graph("f1", GraphKind::Forward, None),
        graph("b1", GraphKind::Backward, Some("f1")),
        graph("b0", GraphKind::Backward, Some("f0")),
    ])
}

fn forwards(p: &Program) -> Vec<Option<&str>> {
    p.graphs.iter().map(|g| g.forward.as_deref()).collect()
}

#[test]
fn every_reader_keeps_each_backward_s_forward() {
    let p = fragments();
    let want = [None, None, Some("f1"), Some("f0")];
    let doc = json::export(&p);
    assert_eq!(forwards(&json::import(&doc).unwrap()), want);
    assert_eq!(forwards(&json::import_careful(&doc).unwrap()), want);
    let bin = binary::export(&p);
    assert_eq!(forwards(&binary::import(&bin).unwrap()), want);
    assert_eq!(forwards(&binary::import_careful(&bin).unwrap()), want);
}

fn problems(p: &Program) -> Vec<String> {
    match verify::program(p) {
        Ok(()) => vec![],
        Err(d) => d.0.iter().map(ToString::to_string).collect(),
    }
}

#[test]
fn a_forward_must_be_an_earlier_forward_graph_of_the_bundle_named_once() {
    assert_eq!(problems(&fragments()), Vec::<String>::new());
    // (graph, its name, the forward it is given, what the one error says besides its place)
    let cases = [
        (2, "b1", "b0", "`b0` is no earlier forward graph"),
        (3, "b0", "f1", "already the forward of `b1`"),
        (1, "f1", "f0", "a forward graph names a forward"),
    ];
    for (graph, name, forward, says) in cases {
        let mut p = fragments();
        p.graphs[graph].forward = Some(forward.into());
        let msgs = problems(&p);
        assert!(
            msgs.len() == 1 && msgs[0].contains(name) && msgs[0].contains(says),
            "{name}: {msgs:?}"
        );
    }
}

/// A backward graph written alone names a forward its document does not hold.
#[test]
fn a_graph_alone_may_name_a_forward_it_does_not_hold() {
    let mut p = fragments();
    let alone = Program::single(p.graphs.remove(2));
    assert_eq!(problems(&alone), Vec::<String>::new());
    let doc = json::export(&alone);
    assert_eq!(forwards(&json::import(&doc).unwrap()), [Some("f1")]);
}
