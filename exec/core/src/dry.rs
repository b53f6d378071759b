//! The dry-run backend: no data, only sizes. Every kernel "returns" a buffer of the size its
//! node's metadata records, so a run measures allocation, liveness and collectives alone: the
//! interpreter's own overhead (`zerosched run --dry-run`, `benches/exec.rs`), and the peak a
//! real run is checked against before it starts ([`crate::memory`]).

use crate::{Backend, BackendError, Env, Local, NodeError, Value};
use zerosched_ir::{Dtype, TensorMeta, Val};

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
    /// Every target "runs": its size comes from the node's metadata.
    type Kernel = ();
    const NAME: &'static str = "dry-run";

    fn resolve(_: &str) -> Option<()> {
        Some(())
    }

    fn compute(
        &mut self,
        _: &(),
        env: &Env<'_, DryTensor>,
    ) -> Result<Value<DryTensor>, BackendError> {
        Ok(match &env.node().meta.val {
            Some(Val::Tensor(t)) => Value::Tensor(DryTensor::of(t)),
            Some(Val::Tuple(ts)) => {
                Value::List(ts.iter().map(|t| t.as_deref().map(DryTensor::of)).collect())
            }
            _ => Value::None,
        })
    }

    fn numel(&self, t: &DryTensor) -> u64 {
        t.numel
    }

    fn dtype(&self, t: &DryTensor) -> Dtype {
        t.dtype
    }

    fn input(
        &mut self,
        meta: &TensorMeta,
        _: &mut dyn FnMut() -> Result<crate::host::Tensor, String>,
    ) -> Result<DryTensor, NodeError> {
        Ok(DryTensor::of(meta))
    }

    fn download(&mut self, _: &DryTensor) -> Result<Option<crate::host::Tensor>, BackendError> {
        Ok(None)
    }

    fn shard(&mut self, full: &DryTensor, world: u32, _: u32) -> Result<DryTensor, BackendError> {
        Ok(DryTensor {
            numel: full.numel.div_ceil(u64::from(world.max(1))),
            dtype: full.dtype,
        })
    }

    fn unflatten(&mut self, flat: &DryTensor, shape: &[usize]) -> Result<DryTensor, BackendError> {
        Ok(DryTensor {
            numel: shape.iter().map(|&d| d as u64).product(),
            dtype: flat.dtype,
        })
    }

    fn free(&mut self, _: DryTensor) {}
}

impl Local for Dry {
    fn concat(
        &mut self,
        parts: &[&DryTensor],
        dtype: Option<Dtype>,
    ) -> Result<DryTensor, BackendError> {
        let first = parts
            .first()
            .ok_or_else(|| BackendError::Kernel("no ranks".into()))?;
        Ok(DryTensor {
            numel: parts.iter().map(|s| s.numel).sum(),
            dtype: dtype.unwrap_or(first.dtype),
        })
    }

    fn sum(&mut self, parts: &[&DryTensor]) -> Result<DryTensor, BackendError> {
        parts
            .first()
            .map(|&&t| t)
            .ok_or_else(|| BackendError::Kernel("no ranks".into()))
    }
}
