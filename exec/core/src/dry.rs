//! The dry-run backend: no data, only sizes. Every kernel "returns" a buffer of the size its
//! node's metadata records, so a run measures allocation, liveness and collectives alone: the
//! interpreter's own overhead (`zerosched run --dry-run`, `benches/exec.rs`).

use super::{Backend, Env, Value};
use zerosched_ir::{Dtype, Node, TensorMeta, Val};

/// A buffer's size without its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DryTensor {
    pub numel: u64,
    pub dtype: Dtype,
}

impl DryTensor {
    fn of(t: &TensorMeta) -> DryTensor {
        DryTensor {
            numel: t.numel().unwrap_or(0),
            dtype: t.dtype,
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Dry;

impl Backend for Dry {
    type Tensor = DryTensor;

    fn name(&self) -> &'static str {
        "dry-run"
    }

    fn supports(&self, _: &Node) -> bool {
        true
    }

    fn compute(&mut self, env: &Env<'_, DryTensor>) -> Result<Value<DryTensor>, String> {
        Ok(match &env.node().meta.val {
            Some(Val::Tensor(t)) => Value::Tensor(DryTensor::of(t)),
            Some(Val::Tuple(ts)) => {
                Value::List(ts.iter().map(|t| t.as_deref().map(DryTensor::of)).collect())
            }
            _ => Value::None,
        })
    }

    fn nbytes(&self, t: &DryTensor) -> u64 {
        t.numel.saturating_mul(t.dtype.size())
    }

    fn input(
        &mut self,
        meta: &TensorMeta,
        _: &mut dyn FnMut() -> Result<crate::host::Tensor, String>,
    ) -> Result<DryTensor, String> {
        Ok(DryTensor::of(meta))
    }

    fn download(&self, _: &DryTensor) -> Option<crate::host::Tensor> {
        None
    }

    fn shard(&mut self, full: &DryTensor, world: u32, _: u32) -> Result<DryTensor, String> {
        Ok(DryTensor {
            numel: full.numel.div_ceil(u64::from(world.max(1))),
            dtype: full.dtype,
        })
    }

    fn all_gather(
        &mut self,
        shards: &[&DryTensor],
        dtype: Option<Dtype>,
    ) -> Result<DryTensor, String> {
        let first = shards.first().ok_or("no ranks")?;
        Ok(DryTensor {
            numel: shards.iter().map(|s| s.numel).sum(),
            dtype: dtype.unwrap_or(first.dtype),
        })
    }

    fn unflatten(&mut self, flat: &DryTensor, shape: &[usize]) -> Result<DryTensor, String> {
        Ok(DryTensor {
            numel: shape.iter().map(|&d| d as u64).product(),
            dtype: flat.dtype,
        })
    }

    fn reduce(
        &mut self,
        grads: &[&DryTensor],
        sharded: bool,
        world: u32,
    ) -> Result<Vec<DryTensor>, String> {
        Ok(grads
            .iter()
            .map(|g| DryTensor {
                numel: if sharded {
                    g.numel.div_ceil(u64::from(world.max(1)))
                } else {
                    g.numel
                },
                dtype: g.dtype,
            })
            .collect())
    }
}
