//! Guarantee 1: the program order is a topological order of every reference, `after` included.

use super::{Ctx, Violation};

pub(super) fn check(cx: &mut Ctx) {
    let g = cx.g;
    for (here, (id, n)) in g.nodes().enumerate() {
        let fields = n
            .args
            .iter()
            .enumerate()
            .map(|(i, a)| (format!("args[{i}]"), a))
            .chain(n.kwargs.iter().map(|(k, a)| (format!("kwargs.{k}"), a)));
        for (field, a) in fields {
            let mut late = Vec::new();
            a.for_each_ref(&mut |&r| {
                if cx.pos(r) >= here {
                    late.push(r);
                }
            });
            for r in late {
                let target = cx.name(r);
                cx.at_field(id, field.clone(), Violation::NotTopological { target });
            }
        }
    }
}
