//! A readable text listing of a graph or program: one line per node in program order,
//! `%name = target(args, key=value) : [shape] dtype`. Test snapshots pin listings, so that a
//! change shows as the lines that moved; `zerosched schedule --dump-after PASS
//! --dump-format listing` writes one. Shapes show their hints; the listing is for reading, the
//! fx-graph v1 document is the exchange format.

use crate::{Arg, Graph, NodeId, Program, Val};
use std::fmt::Write;

/// The nodes of `g`, one line each.
pub fn graph(g: &Graph) -> String {
    let mut out = String::new();
    for (_, n) in g.nodes() {
        let mut parts: Vec<String> = n.args.iter().map(|a| arg(a, g)).collect();
        parts.extend(n.kwargs.iter().map(|(k, v)| format!("{k}={}", arg(v, g))));
        let ty = match &n.meta.val {
            Some(Val::Tensor(t)) => {
                let dims: Vec<String> = t.shape.iter().map(|d| d.hint().to_string()).collect();
                format!(" : [{}] {}", dims.join(", "), t.dtype)
            }
            _ => String::new(),
        };
        let _ = writeln!(out, "%{} = {}({}){ty}", n.name, n.target, parts.join(", "));
    }
    out
}

/// Every graph of `p` in order: a header naming the graph, its parameters (and, for a backward
/// graph, where its gradients are), then its nodes.
pub fn program(p: &Program) -> String {
    let mut out = String::new();
    for g in &p.graphs {
        let name = g.name.as_deref().unwrap_or("(unnamed)");
        let _ = writeln!(out, "# graph {name} ({})", g.kind.name());
        for param in &g.params {
            let dims: Vec<String> = param.shape.iter().map(|d| d.hint().to_string()).collect();
            let persistent = if param.persistent { " persistent" } else { "" };
            let _ = writeln!(
                out,
                "# param {} = %{} : [{}] {}{persistent}",
                param.name,
                g.node(param.node).name,
                dims.join(", "),
                param.dtype
            );
        }
        for grad in &g.grads {
            let persistent = if grad.persistent { " persistent" } else { "" };
            let _ = writeln!(
                out,
                "# grad {} = output[{}]{persistent}",
                grad.param, grad.output_index
            );
        }
        out.push_str(&graph(g));
        out.push('\n');
    }
    out
}

fn arg(a: &Arg<NodeId>, g: &Graph) -> String {
    match a {
        Arg::None => "None".into(),
        Arg::Bool(b) => b.to_string(),
        Arg::Int(i) => i.to_string(),
        Arg::Float(f) => format!("{f:?}"),
        Arg::Str(s) => format!("{s:?}"),
        Arg::Node(r) => format!("%{}", g.node(*r).name),
        Arg::List(items) => {
            let items: Vec<String> = items.iter().map(|i| arg(i, g)).collect();
            format!("[{}]", items.join(", "))
        }
        Arg::Dtype(d) => d.to_string(),
        Arg::Device(s) => format!("device({s:?})"),
        Arg::Layout(s) | Arg::MemoryFormat(s) => s.clone(),
        Arg::Slice(parts) => {
            let [a, b, c] = &**parts;
            format!("slice({}, {}, {})", arg(a, g), arg(b, g), arg(c, g))
        }
        Arg::Sym(s) => format!("{}={}", s.expr, s.hint),
        Arg::Repr(s) => format!("repr({s:?})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dim, Dtype, GraphKind, Meta, Node, Op, Param, TensorMeta};

    #[test]
    fn lists_args_keywords_and_types() {
        let mut g = Graph::new(Some("g".into()), GraphKind::Forward);
        let t = TensorMeta::new(vec![Dim::Const(2), Dim::Const(3)], Dtype::Float32);
        let x = g
            .push(Node {
                op: Op::Placeholder,
                meta: Box::new(Meta {
                    val: Some(Val::Tensor(t.into())),
                    ..Meta::default()
                }),
                ..Node::call("x", "x", vec![])
            })
            .expect("fresh name");
        g.params.push(Param {
            name: "w".into(),
            node: x,
            shape: vec![Dim::Const(2), Dim::Const(3)],
            dtype: Dtype::Float32,
            persistent: true,
        });
        let mut n = Node::call(
            "s",
            "aten.sum.dim_IntList",
            vec![Arg::Node(x), Arg::List(vec![Arg::Int(0)]), Arg::Float(0.5)],
        );
        n.kwargs.insert("dtype", Arg::Dtype(Dtype::BFloat16));
        g.push(n).expect("fresh name");
        let text = program(&Program::single(g));
        assert_eq!(
            text,
            "# graph g (forward)\n# param w = %x : [2, 3] float32 persistent\n\
             %x = x() : [2, 3] float32\n%s = aten.sum.dim_IntList(%x, [0], 0.5, dtype=bfloat16)\n\n"
        );
    }
}
