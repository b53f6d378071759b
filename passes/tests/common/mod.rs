//! A small graph builder for the passes' tests.
#![allow(dead_code)]

use zerosched_ir::{
    Arg, Dim, Dtype, Graph, GraphKind, Meta, Node, NodeId, Op, Param, TensorMeta, Val,
};

pub struct Builder {
    pub g: Graph,
}

pub fn node(id: NodeId) -> Arg<NodeId> {
    Arg::Node(id)
}

fn tensor(shape: &[u64]) -> Option<Val> {
    Some(Val::Tensor(TensorMeta::new(
        shape.iter().map(|&d| Dim::Const(d)).collect(),
        Dtype::Float32,
    )))
}

impl Builder {
    pub fn new(name: &str, kind: GraphKind) -> Builder {
        Builder {
            g: Graph::new(Some(name.to_owned()), kind),
        }
    }

    fn placeholder(&mut self, name: &str, shape: &[u64]) -> NodeId {
        let n = Node {
            op: Op::Placeholder,
            meta: Meta {
                val: tensor(shape),
                ..Meta::default()
            },
            ..Node::call(name, name, vec![])
        };
        self.g.push(n).expect("fresh name")
    }

    pub fn input(&mut self, name: &str, shape: &[u64]) -> NodeId {
        self.placeholder(name, shape)
    }

    pub fn param(&mut self, name: &str, shape: &[u64]) -> NodeId {
        let id = self.placeholder(&name.replace('.', "_"), shape);
        let shape = shape.iter().map(|&d| Dim::Const(d)).collect();
        self.g.params.push(Param {
            name: name.to_owned(),
            node: id,
            shape,
            dtype: Dtype::Float32,
            persistent: false,
        });
        id
    }

    pub fn call(
        &mut self,
        name: &str,
        target: &str,
        args: Vec<Arg<NodeId>>,
        shape: &[u64],
    ) -> NodeId {
        let n = Node {
            meta: Meta {
                val: tensor(shape),
                ..Meta::default()
            },
            ..Node::call(name, target, args)
        };
        self.g.push(n).expect("fresh name")
    }

    pub fn call_kw(
        &mut self,
        name: &str,
        target: &str,
        args: Vec<Arg<NodeId>>,
        kw: &[(&str, Arg<NodeId>)],
        shape: &[u64],
    ) -> NodeId {
        let id = self.call(name, target, args, shape);
        let n = self.g.node(id);
        let mut kwargs = n.kwargs.clone();
        for (k, v) in kw {
            kwargs.insert((*k).to_owned(), v.clone());
        }
        let args = n.args.clone();
        self.g.set_args(id, args, kwargs).expect("valid refs");
        id
    }

    pub fn mm(&mut self, name: &str, a: NodeId, b: NodeId, shape: &[u64], ms: f64) -> NodeId {
        let id = self.call(name, "aten.mm.default", vec![node(a), node(b)], shape);
        self.g.meta_mut(id).device_time_ms = Some(ms);
        id
    }

    pub fn output(mut self, values: &[NodeId]) -> Graph {
        let list = Arg::List(values.iter().map(|&v| node(v)).collect());
        let n = Node {
            op: Op::Output,
            target: "output".into(),
            ..Node::call("output", "output", vec![list])
        };
        self.g.push(n).expect("fresh name");
        zerosched_ir::verify::graph(&self.g).expect("the builder makes valid graphs");
        self.g
    }
}

/// `layers` linear layers `x = mm(x, w_l)`, each weight `dim x dim`, each matmul `ms` long.
pub fn mlp(layers: usize, dim: u64, ms: f64) -> Graph {
    let mut b = Builder::new("mlp", GraphKind::Forward);
    let mut x = b.input("x", &[16, dim]);
    for l in 0..layers {
        let w = b.param(&format!("layers.{l}.weight"), &[dim, dim]);
        x = b.mm(&format!("mm_{l}"), x, w, &[16, dim], ms);
    }
    b.output(&[x])
}

/// Index of a node by name in the program order.
pub fn pos(g: &Graph, name: &str) -> usize {
    g.nodes()
        .position(|(_, n)| n.name == name)
        .unwrap_or_else(|| panic!("no node {name}"))
}

pub fn names(g: &Graph) -> Vec<String> {
    g.nodes().map(|(_, n)| n.name.clone()).collect()
}

/// Forward and backward of `layers` linear layers: the forward saves each layer's input, the
/// backward computes `dW = x^T dy` and `dx = dy W^T` from the last layer to the first.
pub fn train_step(layers: usize, dim: u64, ms: f64) -> zerosched_ir::Program {
    let mut f = Builder::new("fwd", GraphKind::Forward);
    let mut x = f.input("x", &[16, dim]);
    let mut saved = vec![x];
    let mut weights = Vec::new();
    for l in 0..layers {
        let w = f.param(&format!("layers.{l}.weight"), &[dim, dim]);
        weights.push(w);
        x = f.mm(&format!("mm_{l}"), x, w, &[16, dim], ms);
        saved.push(x);
    }
    let fwd = f.output(&saved);

    let mut b = Builder::new("bwd", GraphKind::Backward);
    let ws: Vec<NodeId> = (0..layers)
        .map(|l| b.param(&format!("layers.{l}.weight"), &[dim, dim]))
        .collect();
    let xs: Vec<NodeId> = (0..layers)
        .map(|l| b.input(&format!("saved_{l}"), &[16, dim]))
        .collect();
    let mut dy = b.input("tangents_1", &[16, dim]);
    let mut grads = vec![None; layers];
    for l in (0..layers).rev() {
        let xt = b.call(
            &format!("xt_{l}"),
            "aten.t.default",
            vec![node(xs[l])],
            &[dim, 16],
        );
        grads[l] = Some(b.mm(&format!("dw_{l}"), xt, dy, &[dim, dim], ms));
        let wt = b.call(
            &format!("wt_{l}"),
            "aten.t.default",
            vec![node(ws[l])],
            &[dim, dim],
        );
        dy = b.mm(&format!("dx_{l}"), dy, wt, &[16, dim], ms);
    }
    let outs: Vec<NodeId> = grads.into_iter().flatten().collect();
    let mut bwd = b.output(&outs);
    bwd.grads = (0..layers)
        .map(|l| zerosched_ir::Grad {
            param: format!("layers.{l}.weight"),
            output_index: l as u32,
        })
        .collect();
    zerosched_ir::Program::bundle(vec![fwd, bwd])
}
