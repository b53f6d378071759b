//! The graph builder of hand-written test graphs (the passes' tests, this crate's): every value
//! a float32 tensor of the shape given, nodes named as written, parameters declared on their
//! placeholders, compute nodes optionally with a measured time.

use crate::{
    Arg, Dim, Dtype, Graph, GraphKind, Meta, Node, NodeId, Op, Param, Str, TensorMeta, Val,
};

pub struct GraphBuilder {
    pub g: Graph,
}

/// A reference to `id` as an argument.
pub fn node(id: NodeId) -> Arg<NodeId> {
    Arg::Node(id)
}

fn f32_tensor(shape: &[u64]) -> TensorMeta {
    TensorMeta::new(
        shape.iter().map(|&d| Dim::Const(d)).collect(),
        Dtype::Float32,
    )
}

impl GraphBuilder {
    pub fn new(name: &str, kind: GraphKind) -> GraphBuilder {
        GraphBuilder {
            g: Graph::new(Some(name.to_owned()), kind),
        }
    }

    /// Pushes `n` with a float32 value of `shape`.
    pub fn push(&mut self, mut n: Node, shape: &[u64]) -> NodeId {
        n.meta.val = Some(Val::Tensor(f32_tensor(shape).into()));
        self.g.push(n).expect("test graphs name each node once")
    }

    /// A placeholder that is not a parameter.
    pub fn input(&mut self, name: &str, shape: &[u64]) -> NodeId {
        let n = Node {
            op: Op::Placeholder,
            ..Node::call(name, name, vec![])
        };
        self.push(n, shape)
    }

    /// A parameter `name` on a placeholder of the same name, dots as underscores.
    pub fn param(&mut self, name: &str, shape: &[u64]) -> NodeId {
        self.param_as(&name.replace('.', "_"), name, shape)
    }

    /// A parameter `name` on the placeholder `placeholder`.
    pub fn param_as(&mut self, placeholder: &str, name: &str, shape: &[u64]) -> NodeId {
        let id = self.input(placeholder, shape);
        self.g.params.push(Param {
            name: name.to_owned(),
            node: id,
            shape: shape.iter().map(|&d| Dim::Const(d)).collect(),
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
        self.push(Node::call(name, target, args), shape)
    }

    /// A call whose arguments are the nodes `inputs`.
    pub fn op(&mut self, name: &str, target: &str, inputs: &[NodeId], shape: &[u64]) -> NodeId {
        self.call(
            name,
            target,
            inputs.iter().map(|&i| node(i)).collect(),
            shape,
        )
    }

    /// A compute node of `ms` milliseconds (its measured `device_time_ms`).
    pub fn kernel(
        &mut self,
        name: &str,
        target: &str,
        inputs: &[NodeId],
        shape: &[u64],
        ms: f64,
    ) -> NodeId {
        let id = self.op(name, target, inputs, shape);
        self.g.meta_mut(id).device_time_ms = Some(ms);
        id
    }

    pub fn mm(&mut self, name: &str, a: NodeId, b: NodeId, shape: &[u64], ms: f64) -> NodeId {
        self.kernel(name, "aten.mm.default", &[a, b], shape, ms)
    }

    pub fn call_kw(
        &mut self,
        name: &str,
        target: &str,
        args: Vec<Arg<NodeId>>,
        kw: &[(&str, Arg<NodeId>)],
        shape: &[u64],
    ) -> NodeId {
        let mut n = Node::call(name, target, args);
        for (k, v) in kw {
            n.kwargs.insert(Str::from(*k), v.clone());
        }
        self.push(n, shape)
    }

    /// A list-returning view (`split`, `unbind`, `chunk`) whose `meta.val` is a tuple of
    /// `parts` tensors of shape `part`, and a `getitem` of each part right after it (as FX
    /// places them).
    pub fn list_view(
        &mut self,
        name: &str,
        target: &str,
        args: Vec<Arg<NodeId>>,
        parts: usize,
        part: &[u64],
    ) -> Vec<NodeId> {
        let n = Node {
            meta: Box::new(Meta {
                val: Some(Val::Tuple(vec![Some(f32_tensor(part).into()); parts])),
                ..Meta::default()
            }),
            ..Node::call(name, target, args)
        };
        let list = self.g.push(n).expect("test graphs name each node once");
        (0..parts)
            .map(|i| {
                self.call(
                    &format!("{name}_{i}"),
                    "operator.getitem",
                    vec![node(list), Arg::Int(i as i64)],
                    part,
                )
            })
            .collect()
    }

    /// Adds the output node (returning `values` as a list) and checks the graph.
    pub fn output(mut self, values: &[NodeId]) -> Graph {
        let list = Arg::List(values.iter().map(|&v| node(v)).collect());
        let n = Node {
            op: Op::Output,
            ..Node::call("output", "output", vec![list])
        };
        self.g.push(n).expect("test graphs name each node once");
        crate::verify::graph(&self.g).expect("the builder makes valid graphs");
        self.g
    }
}
