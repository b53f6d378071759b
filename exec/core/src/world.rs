//! Running whole programs over the simulated world: graph inputs from [`Inputs`], values that
//! one graph returns handed to the later graphs' placeholders of the same name (AOTAutograd's
//! partitioner names the backward's saved inputs after the forward's values), parameters from
//! one store shared by every graph, and the buffers a forward keeps carried to the backward.

use super::inputs::Inputs;
use super::{Backend, ExecError, Executor, Feed, Plan, ProgramRun};
use std::collections::BTreeMap;
use zerosched_ir::{Graph, NodeId, Program, TensorMeta, Val};

/// The inputs of a program's graphs.
pub struct ProgramFeed<'a, B: Backend> {
    pub inputs: &'a Inputs,
    /// Values returned by earlier graphs, by the name of the node returned, per rank.
    carried: BTreeMap<String, Vec<B::Tensor>>,
    /// Full parameter values by name (identical on every rank).
    params: BTreeMap<String, B::Tensor>,
    /// Per graph being run: placeholder index → parameter.
    param_of: Vec<Option<usize>>,
}

impl<'a, B: Backend> ProgramFeed<'a, B> {
    pub fn new(inputs: &'a Inputs) -> ProgramFeed<'a, B> {
        ProgramFeed {
            inputs,
            carried: BTreeMap::new(),
            params: BTreeMap::new(),
            param_of: Vec::new(),
        }
    }

    fn start_graph(&mut self, g: &Graph) {
        self.param_of = vec![None; g.node_bound()];
        for (i, p) in g.params.iter().enumerate() {
            self.param_of[p.node.index()] = Some(i);
        }
    }
}

impl<B: Backend> Feed<B> for ProgramFeed<'_, B> {
    fn input(&mut self, b: &mut B, g: &Graph, id: NodeId, rank: u32) -> Result<B::Tensor, String> {
        if let Some(pi) = self.param_of.get(id.index()).copied().flatten() {
            let p = &g.params[pi];
            if let Some(t) = self.params.get(&p.name) {
                return Ok(t.clone());
            }
            let meta = TensorMeta::new(p.shape.clone(), p.dtype);
            let inputs = self.inputs;
            let t = b.input(&meta, &mut || inputs.param(g, p))?;
            self.params.insert(p.name.clone(), t.clone());
            return Ok(t);
        }
        let n = g.node(id);
        if let Some(v) = self.carried.get(n.name.as_str()) {
            return v
                .get(rank as usize)
                .cloned()
                .ok_or_else(|| format!("no value of `{}` for rank {rank}", n.name));
        }
        let Some(Val::Tensor(meta)) = &n.meta.val else {
            return Err(format!("placeholder `{}` has no tensor metadata", n.name));
        };
        let inputs = self.inputs;
        b.input(meta, &mut || inputs.data(g, id, rank))
    }
}

/// Runs every graph of `p` in order.
pub fn run_program<B: Backend>(
    exec: &mut Executor<B>,
    p: &Program,
    inputs: &Inputs,
) -> Result<ProgramRun<B::Tensor>, ExecError> {
    exec.check_supported(p)?;
    inputs.check(p)?;
    let persistent = p.persistent();
    let plans: Vec<Plan<'_>> = p.graphs.iter().map(|g| Plan::new(g, &persistent)).collect();
    run_plans(exec, &plans, inputs)
}

/// Runs prepared plans in order (what a benchmark times).
pub fn run_plans<B: Backend>(
    exec: &mut Executor<B>,
    plans: &[Plan<'_>],
    inputs: &Inputs,
) -> Result<ProgramRun<B::Tensor>, ExecError> {
    let mut feed = ProgramFeed::<B>::new(inputs);
    let mut graphs = Vec::with_capacity(plans.len());
    for plan in plans {
        let g = plan.g;
        feed.start_graph(g);
        let run = exec.run_graph(plan, &mut feed)?;
        for (slot, a) in g.output_values().iter().enumerate() {
            let Some(&v) = a.as_node() else { continue };
            let per_rank: Option<Vec<B::Tensor>> = run
                .outputs
                .iter()
                .map(|o| o.get(slot).cloned().flatten())
                .collect();
            if let Some(vals) = per_rank {
                feed.carried.insert(g.node(v).name.to_string(), vals);
            }
        }
        graphs.push(run);
    }
    Ok(ProgramRun { graphs })
}

/// Reassembles a sharded tensor from every rank's shard: all-gather, then the first
/// `product(shape)` elements as `shape`.
pub fn unshard<B: Backend>(
    b: &mut B,
    shards: &[&B::Tensor],
    shape: &[usize],
) -> Result<B::Tensor, String> {
    let flat = b.all_gather(shards, None)?;
    b.unflatten(&flat, shape)
}
