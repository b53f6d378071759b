//! One FX graph: nodes in a petgraph `StableGraph`, an explicit program order, parameters and
//! the gradient map.

use crate::names::Names;
use crate::{Dim, Dtype, Node, Op, Problem};
use bincode::{Decode, Encode};
use petgraph::Direction;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::{EdgeRef, IntoEdgeReferences, NodeIndexable};

/// A node handle: an index into its graph's node arena, stable while other nodes are added
/// and removed. Only a [`Graph`] hands them out, so a `NodeId` from a graph is valid in it
/// until that node is removed. The IR's own type, so that the storage behind it can change
/// without touching the passes.
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(u32);

impl NodeId {
    /// The handle of the node at arena index `index` (readers and side tables number nodes so).
    pub fn new(index: usize) -> NodeId {
        NodeId(index as u32)
    }

    /// The arena index, for side tables indexed by node.
    pub fn index(self) -> usize {
        self.0 as usize
    }

    pub(crate) fn ix(self) -> NodeIndex<u32> {
        NodeIndex::new(self.0 as usize)
    }
}

impl From<NodeIndex<u32>> for NodeId {
    fn from(ix: NodeIndex<u32>) -> NodeId {
        NodeId(ix.index() as u32)
    }
}

impl std::fmt::Debug for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "n{}", self.0)
    }
}

/// What part of a training step a graph is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Encode, Decode)]
pub enum GraphKind {
    #[default]
    Forward,
    Backward,
    Inference,
    Joint,
}

impl GraphKind {
    pub fn name(self) -> &'static str {
        match self {
            GraphKind::Forward => "forward",
            GraphKind::Backward => "backward",
            GraphKind::Inference => "inference",
            GraphKind::Joint => "joint",
        }
    }

    pub fn from_name(name: &str) -> Option<GraphKind> {
        Some(match name {
            "forward" => GraphKind::Forward,
            "backward" => GraphKind::Backward,
            "inference" => GraphKind::Inference,
            "joint" => GraphKind::Joint,
            _ => return None,
        })
    }
}

/// A trainable parameter among the placeholders: what ZeRO-3 shards.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct Param<R = NodeId> {
    /// Fully qualified name, stable across the graphs of a program.
    pub name: String,
    /// The placeholder that carries it in this graph.
    pub node: R,
    pub shape: Vec<Dim>,
    pub dtype: Dtype,
    /// Kept unsharded (ZeRO-3's persistence threshold).
    pub persistent: bool,
}

impl<R> Param<R> {
    /// The same parameter carried by another spelling of its placeholder reference.
    pub fn with_node<S>(&self, node: S) -> Param<S> {
        Param {
            name: self.name.clone(),
            node,
            shape: self.shape.clone(),
            dtype: self.dtype,
            persistent: self.persistent,
        }
    }

    /// Elements, from the hints of symbolic sizes; `None` on overflow.
    pub fn numel(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(d.hint()))
    }

    /// Full (unsharded) byte size; `None` on overflow.
    pub fn nbytes(&self) -> Option<u64> {
        self.numel()?.checked_mul(self.dtype.size())
    }
}

/// In a backward graph: output position `output_index` is the gradient of `param`.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct Grad {
    pub param: String,
    pub output_index: u32,
    /// The parameter is kept unsharded, so its gradient is all-reduced rather than
    /// reduce-scattered. Said here because a backward graph need not carry the parameter
    /// itself (an RMSNorm weight's gradient does not read the weight).
    pub persistent: bool,
}

/// A graph. Data edges run from producer to consumer, one per distinct pair, and always
/// mirror the references in the nodes' arguments: only this type edits either.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub name: Option<String>,
    pub kind: GraphKind,
    /// A backward graph's forward (AOTAutograd's pair), by name: the graph whose outputs its
    /// saved-value placeholders read. Needed where a step has several forward graphs (graph
    /// breaks), whose inputs and saved values all have the same names (`primals_1`, ...).
    pub forward: Option<String>,
    dag: StableDiGraph<Node, (), u32>,
    order: Vec<NodeId>,
    names: Names,
    /// The `output` nodes, in the order they were added: one in a well-formed graph.
    outputs: Vec<NodeId>,
    pub params: Vec<Param>,
    pub grads: Vec<Grad>,
}

impl Graph {
    pub fn new(name: Option<String>, kind: GraphKind) -> Graph {
        Graph {
            name,
            kind,
            ..Graph::default()
        }
    }

    /// The label used in messages: the graph's name, or `<unnamed>`.
    pub fn label(&self) -> &str {
        self.name.as_deref().unwrap_or("<unnamed>")
    }

    /// Adds a node without placing it in the program order (see [`Graph::set_order`]).
    pub fn add(&mut self, node: Node) -> Result<NodeId, Problem> {
        // One hash of the name for both the check and the insertion.
        let hash = self.names.hash(&node.name);
        if self.names.find(hash, &node.name, &self.dag).is_some() {
            return Err(Problem::NameTaken {
                name: node.name.into(),
            });
        }
        // One walk over the arguments both checks each producer and collects the distinct
        // ones, in the order the arguments first name them, for the edges.
        let mut producers = Distinct::default();
        let mut bad = None;
        node.for_each_ref(|&r| {
            if producers.fresh(r) && bad.is_none() && !self.dag.contains_node(r.ix()) {
                bad = Some(r.index());
            }
        });
        if let Some(index) = bad {
            return Err(Problem::DanglingRef { index });
        }
        let is_output = node.op == Op::Output;
        let id = NodeId::from(self.dag.add_node(node));
        self.names.insert(hash, id, &self.dag);
        if is_output {
            self.outputs.push(id);
        }
        for &p in producers.as_slice() {
            self.dag.add_edge(p.ix(), id.ix(), ());
        }
        Ok(id)
    }

    /// Adds a node at the end of the program order.
    pub fn push(&mut self, node: Node) -> Result<NodeId, Problem> {
        let id = self.add(node)?;
        self.order.push(id);
        Ok(id)
    }

    /// Replaces the program order. It must hold every live node exactly once.
    pub fn set_order(&mut self, order: Vec<NodeId>) -> Result<(), Problem> {
        let mut seen = vec![false; self.dag.node_bound()];
        // Without removed nodes every index below the bound is a node: no need to read each.
        let dense = self.dag.node_count() == self.dag.node_bound();
        for &id in &order {
            match seen.get_mut(id.index()) {
                Some(s) if !*s && (dense || self.dag.contains_node(id.ix())) => *s = true,
                _ => return Err(Problem::BadOrder),
            }
        }
        if order.len() != self.dag.node_count() {
            return Err(Problem::BadOrder);
        }
        self.order = order;
        Ok(())
    }

    /// Replaces a node's arguments, keeping the data edges in step.
    pub fn set_args(
        &mut self,
        id: NodeId,
        args: Vec<crate::Arg<NodeId>>,
        kwargs: crate::Kwargs,
    ) -> Result<(), Problem> {
        let mut probe = Node {
            args,
            kwargs,
            ..Node::call("", "", vec![])
        };
        if let Some(bad) = probe
            .refs()
            .find(|r| !self.dag.contains_node(r.ix()) || **r == id)
        {
            return Err(Problem::DanglingRef { index: bad.index() });
        }
        let producers = distinct(probe.refs().copied());
        let node = &mut self.dag[id.ix()];
        std::mem::swap(&mut node.args, &mut probe.args);
        std::mem::swap(&mut node.kwargs, &mut probe.kwargs);
        let old: Vec<_> = self
            .dag
            .edges_directed(id.ix(), Direction::Incoming)
            .map(|e| e.id())
            .collect();
        for e in old {
            self.dag.remove_edge(e);
        }
        for p in producers {
            self.dag.add_edge(p.ix(), id.ix(), ());
        }
        Ok(())
    }

    /// Rewrites every reference in a node's arguments with `f`, keeping the data edges in
    /// step (the one way passes redirect a consumer to another producer).
    pub fn map_refs(
        &mut self,
        id: NodeId,
        mut f: impl FnMut(NodeId) -> NodeId,
    ) -> Result<(), Problem> {
        let n = &self.dag[id.ix()];
        let mut swap = |r: &NodeId| f(*r);
        let args = n.args.iter().map(|a| a.map_refs(&mut swap)).collect();
        let kwargs = n
            .kwargs
            .iter()
            .map(|(k, a)| (k.clone(), a.map_refs(&mut swap)))
            .collect();
        self.set_args(id, args, kwargs)
    }

    /// Removes a node that nothing uses any more.
    pub fn remove(&mut self, id: NodeId) -> Result<Node, Problem> {
        if self
            .dag
            .neighbors_directed(id.ix(), Direction::Outgoing)
            .next()
            .is_some()
        {
            return Err(Problem::StillUsed);
        }
        let node = self
            .dag
            .remove_node(id.ix())
            .ok_or(Problem::DanglingRef { index: id.index() })?;
        self.names.remove(&node.name, id);
        self.order.retain(|&n| n != id);
        self.outputs.retain(|&n| n != id);
        Ok(node)
    }

    /// Removes several nodes that nothing outside the set uses, in one pass over the order.
    pub fn remove_all(&mut self, ids: &[NodeId]) -> Result<(), Problem> {
        for &id in ids {
            let used_outside = self
                .dag
                .neighbors_directed(id.ix(), Direction::Outgoing)
                .any(|u| !ids.contains(&u.into()));
            if used_outside {
                return Err(Problem::StillUsed);
            }
        }
        for &id in ids {
            if let Some(node) = self.dag.remove_node(id.ix()) {
                self.names.remove(&node.name, id);
            }
        }
        self.order.retain(|&n| self.dag.contains_node(n.ix()));
        self.outputs.retain(|&n| self.dag.contains_node(n.ix()));
        Ok(())
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.dag[id.ix()]
    }

    pub fn get(&self, id: NodeId) -> Option<&Node> {
        self.dag.node_weight(id.ix())
    }

    /// Changes what a node calls; its arguments and edges stay.
    pub fn set_target(&mut self, id: NodeId, target: impl Into<crate::Str>) {
        self.dag[id.ix()].target = target.into();
    }

    /// Metadata may change freely: it carries no edges.
    pub fn meta_mut(&mut self, id: NodeId) -> &mut crate::Meta {
        &mut self.dag[id.ix()].meta
    }

    pub fn node_by_name(&self, name: &str) -> Option<NodeId> {
        self.names.get(name, &self.dag)
    }

    /// `base` if no node has that name, else the first free `base_N`.
    pub fn fresh_name(&self, base: &str) -> String {
        if self.node_by_name(base).is_none() {
            return base.to_owned();
        }
        (1u64..)
            .map(|i| format!("{base}_{i}"))
            .find(|n| self.node_by_name(n).is_none())
            .unwrap_or_default()
    }

    /// The program order.
    pub fn order(&self) -> &[NodeId] {
        &self.order
    }

    /// Nodes in program order with their data.
    pub fn nodes(&self) -> impl Iterator<Item = (NodeId, &Node)> {
        self.order.iter().map(|&id| (id, &self.dag[id.ix()]))
    }

    pub fn len(&self) -> usize {
        self.dag.node_count()
    }

    pub fn is_empty(&self) -> bool {
        self.dag.node_count() == 0
    }

    /// One past the largest node index: the size side tables need.
    pub fn node_bound(&self) -> usize {
        self.dag.node_bound()
    }

    /// Distinct producers a node reads, in the order its arguments first name them.
    pub fn inputs(&self, id: NodeId) -> Vec<NodeId> {
        let mut out = Vec::new();
        self.for_each_input(id, |p| out.push(p));
        out
    }

    /// Calls `f` on each distinct producer a node reads, in the order its arguments first
    /// name them: [`Graph::inputs`] without collecting them.
    pub fn for_each_input(&self, id: NodeId, f: impl FnMut(NodeId)) {
        let node = &self.dag[id.ix()];
        Distinct::default().each(|g| node.for_each_ref(|r| g(*r)), f);
    }

    /// Room for `nodes` more nodes and `edges` more data edges, so that a reader that knows
    /// how many are coming grows the storage once.
    pub fn reserve(&mut self, nodes: usize, edges: usize) {
        self.dag.reserve_nodes(nodes);
        self.dag.reserve_edges(edges);
        self.order.reserve(nodes);
        self.names.reserve(nodes, &self.dag);
    }

    /// Distinct consumers of a node, by ascending index (deterministic, not program order).
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let mut users: Vec<NodeId> = self
            .dag
            .neighbors_directed(id.ix(), Direction::Outgoing)
            .map(NodeId::from)
            .collect();
        users.sort_unstable();
        users
    }

    pub fn has_users(&self, id: NodeId) -> bool {
        self.dag
            .neighbors_directed(id.ix(), Direction::Outgoing)
            .next()
            .is_some()
    }

    /// Distinct consumers of a node in storage order: [`Graph::users`] without sorting, for
    /// walks whose result does not depend on the order.
    pub fn consumers(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.dag
            .neighbors_directed(id.ix(), Direction::Outgoing)
            .map(NodeId::from)
    }

    /// Distinct producers of a node in storage order: [`Graph::inputs`] without collecting
    /// them in argument order.
    pub fn producers(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.dag
            .neighbors_directed(id.ix(), Direction::Incoming)
            .map(NodeId::from)
    }

    /// Whether `consumer` reads `producer`.
    pub fn feeds(&self, producer: NodeId, consumer: NodeId) -> bool {
        self.dag.contains_edge(producer.ix(), consumer.ix())
    }

    /// Every live node by ascending index (not program order).
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.dag.node_indices().map(NodeId::from)
    }

    /// Every data edge as (producer, consumer), one per pair, in storage order.
    pub fn edges(&self) -> impl Iterator<Item = (NodeId, NodeId)> + '_ {
        self.dag
            .edge_references()
            .map(|e| (e.source().into(), e.target().into()))
    }

    /// The dataflow graph, for petgraph's algorithms inside the IR.
    pub(crate) fn dag(&self) -> &StableDiGraph<Node, (), u32> {
        &self.dag
    }

    /// The `output` node: the last in program order, should there be several.
    pub fn output(&self) -> Option<NodeId> {
        match self.outputs.as_slice() {
            [] => None,
            [one] => Some(*one),
            _ => self
                .order
                .iter()
                .rev()
                .copied()
                .find(|id| self.outputs.contains(id)),
        }
    }

    /// Every `output` node, in no particular order: one in a well-formed graph, found without
    /// reading the others.
    pub fn outputs(&self) -> &[NodeId] {
        &self.outputs
    }

    /// The returned values: the output node's one argument, flattened one level.
    pub fn output_values(&self) -> &[crate::Arg<NodeId>] {
        self.output()
            .and_then(|o| self.dag[o.ix()].args.first())
            .and_then(|a| a.as_list())
            .unwrap_or(&[])
    }

    /// Names of the parameters this graph says are kept unsharded: persistent among its
    /// parameters or on its gradient entries. With repeats.
    pub fn persistent_names(&self) -> impl Iterator<Item = &str> {
        let params = self.params.iter().filter(|p| p.persistent).map(|p| &p.name);
        let grads = self.grads.iter().filter(|g| g.persistent).map(|g| &g.param);
        params.chain(grads).map(String::as_str)
    }

    /// Position of each node in the program order.
    pub fn positions(&self) -> crate::SideTable<usize> {
        let mut pos = crate::SideTable::new(self, usize::MAX);
        for (i, &id) in self.order.iter().enumerate() {
            pos[id] = i;
        }
        pos
    }

    /// The parameter a placeholder carries, if any.
    pub fn param_of(&self, id: NodeId) -> Option<&Param> {
        self.params.iter().find(|p| p.node == id)
    }
}

/// Stable de-duplication of references: a linear scan of a stack buffer for the usual
/// handful, a set for the output node and other nodes with hundreds of arguments. Keeps the
/// distinct references in order of first occurrence.
#[derive(Default)]
struct Distinct {
    few: [NodeId; Distinct::FEW],
    len: usize,
    many: Option<(hashbrown::HashSet<NodeId>, Vec<NodeId>)>,
}

impl Distinct {
    const FEW: usize = 16;

    /// Records `r`; whether it is new.
    fn fresh(&mut self, r: NodeId) -> bool {
        if let Some((set, order)) = &mut self.many {
            let new = set.insert(r);
            if new {
                order.push(r);
            }
            return new;
        }
        if self.few[..self.len].contains(&r) {
            return false;
        }
        if self.len < Distinct::FEW {
            self.few[self.len] = r;
            self.len += 1;
        } else {
            let mut order = self.few.to_vec();
            order.push(r);
            self.many = Some((order.iter().copied().collect(), order));
        }
        true
    }

    /// The distinct references so far, in order of first occurrence.
    fn as_slice(&self) -> &[NodeId] {
        match &self.many {
            Some((_, order)) => order,
            None => &self.few[..self.len],
        }
    }

    /// Feeds the references that `refs` produces through the filter, calling `f` on each
    /// first occurrence, in order.
    fn each(mut self, refs: impl FnOnce(&mut dyn FnMut(NodeId)), mut f: impl FnMut(NodeId)) {
        refs(&mut |r| {
            if self.fresh(r) {
                f(r)
            }
        });
    }
}

/// [`Distinct`] into a `Vec`.
fn distinct(refs: impl Iterator<Item = NodeId>) -> Vec<NodeId> {
    let mut out = Vec::new();
    Distinct::default().each(|f| refs.for_each(f), |r| out.push(r));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Arg;

    fn output(name: &str, of: NodeId) -> Node {
        Node {
            op: Op::Output,
            ..Node::call(name, "output", vec![Arg::List(vec![Arg::Node(of)])])
        }
    }

    #[test]
    fn outputs_follow_adds_and_removals() {
        let mut g = Graph::new(None, GraphKind::Forward);
        let x = g
            .push(Node::call("x", "aten.relu.default", vec![]))
            .unwrap();
        assert_eq!(g.outputs(), &[] as &[NodeId]);
        let first = g.push(output("out", x)).unwrap();
        let second = g.push(output("out_1", x)).unwrap();
        assert_eq!(g.outputs(), &[first, second]);
        assert_eq!(g.output(), Some(second), "the last in program order");
        g.set_order(vec![x, second, first]).unwrap();
        assert_eq!(g.output(), Some(first));
        g.remove(first).unwrap();
        assert_eq!(g.outputs(), &[second]);
        assert_eq!(g.output(), Some(second));
        g.remove_all(&[second]).unwrap();
        assert_eq!(g.output(), None);
    }

    #[test]
    fn an_order_must_name_live_nodes_once_with_or_without_removed_ones() {
        let mut g = Graph::new(None, GraphKind::Forward);
        let ids: Vec<NodeId> = (0..3)
            .map(|i| {
                g.push(Node::call(format!("n{i}"), "aten.relu.default", vec![]))
                    .unwrap()
            })
            .collect();
        let (a, b, c) = (ids[0], ids[1], ids[2]);
        assert_eq!(g.set_order(vec![a, a, c]), Err(Problem::BadOrder));
        assert_eq!(g.set_order(vec![c, b]), Err(Problem::BadOrder));
        assert_eq!(
            g.set_order(vec![c, NodeId::new(3), a]),
            Err(Problem::BadOrder)
        );
        g.set_order(vec![c, b, a]).unwrap();
        assert_eq!(g.order(), &[c, b, a]);
        // With a hole at `b`'s index, naming it is refused even though it is below the bound.
        g.remove(b).unwrap();
        assert_eq!(g.set_order(vec![b, c]), Err(Problem::BadOrder));
        assert_eq!(g.set_order(vec![b, c, a]), Err(Problem::BadOrder));
        g.set_order(vec![a, c]).unwrap();
        assert_eq!(g.order(), &[a, c]);
    }
}
