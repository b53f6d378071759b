//! Builders for the inserted ops (their targets, keywords and keyword readers and writers are
//! in `zerosched_ir::comm`), and the byte size of a gathered buffer.

pub use zerosched_ir::comm::*;
use zerosched_ir::{Arg, Dtype, Graph, Kwargs, Node, NodeId, Param, SideTable};

fn call(g: &Graph, base: &str, target: &str, args: Vec<Arg<NodeId>>, kwargs: Kwargs) -> Node {
    Node {
        kwargs,
        ..Node::call(g.fresh_name(base), target, args)
    }
}

pub fn allgather(g: &Graph, shard: NodeId, param: &str, dtype: Option<Dtype>) -> Node {
    let base = format!("allgather_{}", g.node(shard).name);
    call(
        g,
        &base,
        ALLGATHER,
        vec![Arg::Node(shard)],
        gather_kwargs(param, dtype),
    )
}

pub fn wait(g: &Graph, gather: NodeId, param: &str) -> Node {
    let gather_name = &g.node(gather).name;
    let base = format!(
        "wait_{}",
        gather_name
            .strip_prefix("allgather_")
            .unwrap_or(gather_name)
    );
    call(g, &base, WAIT, vec![Arg::Node(gather)], param_kwargs(param))
}

pub fn release(g: &Graph, value: NodeId, param: &str, after: &[NodeId]) -> Node {
    let base = format!("release_{}", g.node(value).name);
    Node {
        kwargs: release_kwargs(param, after),
        ..Node::call(g.fresh_name(&base), RELEASE, vec![Arg::Node(value)])
    }
}

pub fn reduce_grad(g: &Graph, grad: NodeId, param: &str, sharded: bool) -> Node {
    let base = format!("reduce_{}", g.node(grad).name);
    call(
        g,
        &base,
        REDUCE_GRAD,
        vec![Arg::Node(grad)],
        reduce_kwargs(param, sharded),
    )
}

pub fn end_backward(g: &Graph, reduces: &[NodeId]) -> Node {
    let list = Arg::List(reduces.iter().map(|&r| Arg::Node(r)).collect());
    call(g, "end_backward", END_BACKWARD, vec![list], Kwargs::new())
}

pub fn getitem(g: &Graph, value: NodeId, index: usize) -> Node {
    let base = format!("{}_{index}", g.node(value).name);
    call(
        g,
        &base,
        GETITEM,
        vec![Arg::Node(value), Arg::Int(index as i64)],
        Kwargs::new(),
    )
}

/// Bytes of the full buffer a gather allocates: the flattened parameter padded to a multiple of
/// the world size, in the gather's dtype. `None` if the node is not a gather of a known
/// parameter.
pub fn gathered_bytes(g: &Graph, gather: NodeId, world_size: u32) -> Option<u64> {
    let n = g.node(gather);
    let p = g.param_of(*n.args.first()?.as_node()?)?;
    bytes_of(p, n, world_size)
}

fn bytes_of(p: &Param, gather: &Node, world_size: u32) -> Option<u64> {
    let dtype = gather_dtype(gather).unwrap_or(p.dtype);
    zerosched_ir::comm::gathered_bytes(p.numel()?, dtype, world_size)
}

/// The parameter each placeholder carries, found in constant time: for passes that size
/// every gather of a graph ([`Graph::param_of`] scans the parameter list).
pub struct ParamIndex(SideTable<Option<usize>>);

impl ParamIndex {
    pub fn new(g: &Graph) -> ParamIndex {
        let mut at = SideTable::new(g, None);
        // The first declaration wins, as with `Graph::param_of`.
        for (i, p) in g.params.iter().enumerate().rev() {
            if p.node.index() < g.node_bound() {
                at[p.node] = Some(i);
            }
        }
        ParamIndex(at)
    }

    /// The index in `g.params` of the parameter `placeholder` carries.
    pub fn position(&self, placeholder: NodeId) -> Option<usize> {
        self.0.get(placeholder).copied().flatten()
    }

    /// [`gathered_bytes`], for a gather of `g`.
    pub fn gathered_bytes(&self, g: &Graph, gather: NodeId, world_size: u32) -> Option<u64> {
        let n = g.node(gather);
        let shard = *n.args.first()?.as_node()?;
        let p = g.params.get(self.position(shard)?)?;
        bytes_of(p, n, world_size)
    }
}
