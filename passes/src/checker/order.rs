//! Guarantee 1: the program order is a topological order of every reference, `after` included.

use super::{Ctx, Violation};

pub(super) fn check(cx: &mut Ctx) {
    let g = cx.g;
    let mut late = Vec::new();
    for (here, (id, n)) in g.nodes().enumerate() {
        // Field names are spelled out only for a violation: most nodes have none.
        let fields = n
            .args
            .iter()
            .enumerate()
            .map(|(i, a)| (Field::Arg(i), a))
            .chain(n.kwargs.iter().map(|(k, a)| (Field::Kwarg(k), a)));
        for (field, a) in fields {
            late.clear();
            a.for_each_ref(&mut |&r| {
                if cx.pos(r) >= here {
                    late.push(r);
                }
            });
            for &r in &late {
                let target = cx.name(r);
                cx.at_field(id, field.name(), Violation::NotTopological { target });
            }
        }
    }
}

/// Where in a node a reference stands.
enum Field<'a> {
    Arg(usize),
    Kwarg(&'a str),
}

impl Field<'_> {
    fn name(&self) -> String {
        match self {
            Field::Arg(i) => format!("args[{i}]"),
            Field::Kwarg(k) => format!("kwargs.{k}"),
        }
    }
}
