//! Budgets in units users think in: "two layers' worth of parameters".

use zerosched_ir::Program;

/// Gathered bytes of one decoder layer's parameters: those whose name contains
/// `layers.{layer}.` (the transformers naming), padded as gathers pad them.
pub fn layer_bytes(p: &Program, layer: usize, world_size: u32) -> u64 {
    let needle = format!("layers.{layer}.");

    p.params_by_name()
        .into_iter()
        .filter(|(name, _)| name.contains(&needle))
        .filter_map(|(_, places)| places.first().copied())
        .filter_map(|(g, i)| {
            let param = &p.graphs[g].params[i];
            zerosched_ir::comm::gathered_bytes(param.numel()?, param.dtype, world_size)
        })
        .fold(0, u64::saturating_add)
}
