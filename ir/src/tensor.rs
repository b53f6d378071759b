//! Tensor metadata: shapes (concrete or symbolic with a hint), dtypes, exact byte sizes.

use crate::{Dtype, Str};
use bincode::{Decode, Encode};
use std::sync::Arc;

/// A symbolic integer as the exporter saw it: its expression and the concrete value it had.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Encode, Decode)]
pub struct SymInt {
    pub expr: Str,
    pub hint: i64,
}

/// One entry of a shape or stride.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Encode, Decode)]
pub enum Dim {
    Const(u64),
    /// A symbolic size; its hint is non-negative (the importer checks it).
    Sym(SymInt),
}

impl Dim {
    /// The concrete value, using the hint for a symbolic size.
    pub fn hint(&self) -> u64 {
        match self {
            Dim::Const(n) => *n,
            Dim::Sym(s) => s.hint.max(0).unsigned_abs(),
        }
    }
}

/// What `meta.val` says about a tensor value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Encode, Decode)]
pub struct TensorMeta {
    pub shape: Vec<Dim>,
    pub dtype: Dtype,
    pub stride: Option<Vec<Dim>>,
    pub storage_offset: Option<Dim>,
    pub device: Option<Str>,
    pub requires_grad: Option<bool>,
}

impl TensorMeta {
    pub fn new(shape: Vec<Dim>, dtype: Dtype) -> TensorMeta {
        TensorMeta {
            shape,
            dtype,
            stride: None,
            storage_offset: None,
            device: None,
            requires_grad: None,
        }
    }

    /// Elements, from the hints of symbolic sizes; `None` if the product overflows `u64`.
    pub fn numel(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(d.hint()))
    }

    /// The dimensions, symbolic sizes at their hints.
    pub fn hint_dims(&self) -> Vec<usize> {
        self.shape.iter().map(|d| d.hint() as usize).collect()
    }

    /// Exact byte size; `None` if it overflows `u64` (the verifier rejects such tensors).
    pub fn nbytes(&self) -> Option<u64> {
        self.numel()?.checked_mul(self.dtype.size())
    }
}

/// The value a node produces, as its `meta.val` records it.
///
/// Tensor metadata is shared: a training step has a few hundred distinct tensor shapes over
/// tens of thousands of nodes, so the importers hand out one copy of each and cloning a node
/// or a graph copies a pointer instead of two shape lists.
#[derive(Clone, Debug, PartialEq)]
pub enum Val {
    Tensor(Arc<TensorMeta>),
    /// A multi-output op: one entry per output, `None` where the output is not a tensor.
    Tuple(Vec<Option<Arc<TensorMeta>>>),
    Sym(SymInt),
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl Val {
    /// The tensors this value holds, in output order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorMeta> {
        let (one, many): (Option<&TensorMeta>, &[Option<Arc<TensorMeta>>]) = match self {
            Val::Tensor(t) => (Some(t), &[]),
            Val::Tuple(ts) => (None, ts.as_slice()),
            _ => (None, &[]),
        };
        one.into_iter().chain(many.iter().flatten().map(|t| &**t))
    }

    /// Total bytes of the tensors this value holds; `None` on overflow.
    pub fn nbytes(&self) -> Option<u64> {
        match self {
            // Most values are one tensor: no iterator over the general case.
            Val::Tensor(t) => t.nbytes(),
            _ => self
                .tensors()
                .try_fold(0u64, |acc, t| acc.checked_add(t.nbytes()?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_size_uses_hints_and_detects_overflow() {
        let t = TensorMeta::new(
            vec![
                Dim::Sym(SymInt {
                    expr: "s0".into(),
                    hint: 4096,
                }),
                Dim::Const(8192),
            ],
            Dtype::BFloat16,
        );
        assert_eq!(t.nbytes(), Some(4096 * 8192 * 2));
        let huge = TensorMeta::new(vec![Dim::Const(u64::MAX), Dim::Const(2)], Dtype::Float32);
        assert_eq!(huge.nbytes(), None);
        let scalar = TensorMeta::new(vec![], Dtype::Float32);
        assert_eq!(scalar.nbytes(), Some(4));
    }
}
