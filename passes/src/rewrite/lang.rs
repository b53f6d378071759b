//! The term language of the rewrite stage and its e-class analysis (tensor shape and dtype).
//!
//! Leaves are plain values (indices, dtypes, shapes), never egg `Symbol`s: symbols are interned
//! in a process-wide table whose order depends on which thread interned first, and the term
//! order decides extraction ties, so symbols would let one run differ from the next.

use egg::{Analysis, DidMerge, EGraph, Id, define_language};
use std::fmt;
use std::str::FromStr;
use zerosched_ir::Dtype;

/// A leaf of a term.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Atom {
    /// A parameter, by index into [`Context::params`].
    Param(u32),
    /// A gather segment, by index into [`Context::segs`].
    Seg(u32),
    Dtype(Dtype),
    /// A `view` size argument as written (may hold one `-1`).
    Shape(Vec<i64>),
    /// A dimension argument (`transpose`).
    Int(i64),
}

impl fmt::Display for Atom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Atom::Param(p) => write!(f, "param#{p}"),
            Atom::Seg(s) => write!(f, "seg#{s}"),
            Atom::Dtype(d) => write!(f, "dtype:{d}"),
            Atom::Shape(s) => {
                let dims: Vec<String> = s.iter().map(i64::to_string).collect();
                write!(f, "shape:{}", dims.join("x"))
            }
            Atom::Int(i) => write!(f, "{i}"),
        }
    }
}

impl FromStr for Atom {
    type Err = ();
    fn from_str(s: &str) -> Result<Atom, ()> {
        let num = |t: &str| t.parse::<u32>().map_err(|_| ());
        if let Some(p) = s.strip_prefix("param#") {
            return Ok(Atom::Param(num(p)?));
        }
        if let Some(p) = s.strip_prefix("seg#") {
            return Ok(Atom::Seg(num(p)?));
        }
        if let Some(d) = s.strip_prefix("dtype:") {
            return Dtype::from_name(d).map(Atom::Dtype).ok_or(());
        }
        if let Some(dims) = s.strip_prefix("shape:") {
            if dims.is_empty() {
                return Ok(Atom::Shape(Vec::new()));
            }
            let dims: Result<Vec<i64>, _> = dims.split('x').map(str::parse).collect();
            return dims.map(Atom::Shape).map_err(|_| ());
        }
        s.parse().map(Atom::Int).map_err(|_| ())
    }
}

// Communication-relevant terms: how a value that a compute node reads is made from a
// parameter's gathered storage.
define_language! {
    pub enum Comm {
        // `(gather param dtype seg)`: the all-gather of segment `seg`, in `dtype`.
        "gather" = Gather([Id; 3]),
        "wait" = Wait(Id),
        // `(keep value seg)`: `value` (gathered for an earlier segment) held into segment
        // `seg` instead of gathered again. Materializes as `value` itself.
        "keep" = Keep([Id; 2]),
        // `aten.view.default(x, shape)`.
        "view" = View([Id; 2]),
        // `aten.t.default(x)`.
        "t" = T(Id),
        // `aten.transpose.int(x, i, j)`.
        "transpose" = Transpose([Id; 3]),
        // An elementwise dtype conversion (`prims.convert_element_type`, `aten._to_copy`).
        "cast" = Cast([Id; 2]),
        Atom(Atom),
    }
}

/// Shape and dtype of a tensor-valued e-class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ty {
    pub shape: Vec<u64>,
    pub dtype: Dtype,
}

/// One parameter that the stage works on.
#[derive(Clone, Debug)]
pub struct ParamInfo {
    pub name: String,
    pub shape: Vec<u64>,
    /// The parameter's own dtype (a gather in it needs no `dtype` keyword).
    pub dtype: Dtype,
}

/// One gather segment: a gather, its wait and its release.
#[derive(Clone, Debug)]
pub struct SegInfo {
    pub param: u32,
    /// The same parameter's segment just before this one, if any.
    pub prev: Option<u32>,
    /// The dtype of a cast that is this segment's only real use.
    pub only_cast: Option<Dtype>,
    /// The most bytes that holding a buffer across the gap from `prev` may add without
    /// exceeding the budget.
    pub headroom: u64,
}

/// What rules and costs need to know beyond the terms; the analysis carries it so that
/// conditions and appliers can read it from the e-graph.
#[derive(Clone, Debug, Default)]
pub struct Context {
    pub params: Vec<ParamInfo>,
    pub segs: Vec<SegInfo>,
    pub world_size: u32,
}

impl Context {
    /// Bytes of a gathered buffer of this type: padded to a multiple of the world size, as
    /// docs/format.md defines it.
    pub fn padded_bytes(&self, ty: &Ty) -> u64 {
        let numel = ty.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        numel
            .and_then(|n| zerosched_ir::comm::gathered_bytes(n, ty.dtype, self.world_size))
            .unwrap_or(u64::MAX)
    }
}

pub type CommGraph = EGraph<Comm, Context>;

/// The leaf in an e-class, if it holds one.
pub fn atom(eg: &CommGraph, id: Id) -> Option<&Atom> {
    eg[id].nodes.iter().find_map(|n| match n {
        Comm::Atom(a) => Some(a),
        _ => None,
    })
}

pub fn dtype_atom(eg: &CommGraph, id: Id) -> Option<Dtype> {
    match atom(eg, id) {
        Some(Atom::Dtype(d)) => Some(*d),
        _ => None,
    }
}

pub fn int_atom(eg: &CommGraph, id: Id) -> Option<i64> {
    match atom(eg, id) {
        Some(Atom::Int(i)) => Some(*i),
        _ => None,
    }
}

pub fn seg_atom(eg: &CommGraph, id: Id) -> Option<u32> {
    match atom(eg, id) {
        Some(Atom::Seg(s)) => Some(*s),
        _ => None,
    }
}

/// A `view` size resolved against the viewed tensor's element count (`-1` inferred).
pub fn resolve_view(sizes: &[i64], numel: u64) -> Option<Vec<u64>> {
    let known = sizes
        .iter()
        .filter(|&&d| d != -1)
        .try_fold(1u64, |a, &d| a.checked_mul(u64::try_from(d).ok()?))?;
    let inferred = sizes.iter().filter(|&&d| d == -1).count();
    let out: Option<Vec<u64>> = sizes
        .iter()
        .map(|&d| match d {
            -1 if known > 0 && numel % known == 0 => Some(numel / known),
            -1 => None,
            d => u64::try_from(d).ok(),
        })
        .collect();
    let out = out?;
    let total = out.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
    (inferred <= 1 && total == numel).then_some(out)
}

/// A dimension argument normalized to `0..rank`.
pub fn norm_dim(d: i64, rank: usize) -> Option<usize> {
    let rank = i64::try_from(rank).ok()?;
    let d = if d < 0 { d + rank } else { d };
    usize::try_from(d).ok().filter(|&d| (d as i64) < rank)
}

impl Analysis<Comm> for Context {
    type Data = Option<Ty>;

    fn make(eg: &mut CommGraph, enode: &Comm, _id: Id) -> Option<Ty> {
        let ty = |id: Id| eg[id].data.clone();
        match enode {
            Comm::Gather([p, d, _]) => {
                let Some(Atom::Param(p)) = atom(eg, *p) else {
                    return None;
                };
                Some(Ty {
                    shape: eg.analysis.params.get(*p as usize)?.shape.clone(),
                    dtype: dtype_atom(eg, *d)?,
                })
            }
            Comm::Wait(x) | Comm::Keep([x, _]) => ty(*x),
            Comm::View([x, s]) => {
                let x = ty(*x)?;
                let Some(Atom::Shape(sizes)) = atom(eg, *s) else {
                    return None;
                };
                let numel = x.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
                Some(Ty {
                    shape: resolve_view(sizes, numel)?,
                    dtype: x.dtype,
                })
            }
            Comm::T(x) => {
                let mut x = ty(*x)?;
                x.shape.reverse();
                (x.shape.len() <= 2).then_some(x)
            }
            Comm::Transpose([x, i, j]) => {
                let mut x = ty(*x)?;
                let rank = x.shape.len();
                let i = norm_dim(int_atom(eg, *i)?, rank)?;
                let j = norm_dim(int_atom(eg, *j)?, rank)?;
                x.shape.swap(i, j);
                Some(x)
            }
            Comm::Cast([x, d]) => Some(Ty {
                shape: ty(*x)?.shape,
                dtype: dtype_atom(eg, *d)?,
            }),
            Comm::Atom(_) => None,
        }
    }

    // Sound rules only join terms of one type; the first known type is kept.
    fn merge(&mut self, a: &mut Option<Ty>, b: Option<Ty>) -> DidMerge {
        match (a.is_none(), b) {
            (true, Some(b)) => {
                *a = Some(b);
                DidMerge(true, false)
            }
            (true, None) => DidMerge(false, false),
            (false, b) => DidMerge(false, b.as_ref() != a.as_ref()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atoms_round_trip_and_views_resolve() {
        for a in [
            Atom::Param(3),
            Atom::Seg(0),
            Atom::Dtype(Dtype::BFloat16),
            Atom::Shape(vec![-1, 8]),
            Atom::Shape(vec![]),
            Atom::Int(-2),
        ] {
            assert_eq!(a.to_string().parse::<Atom>(), Ok(a));
        }
        assert_eq!(resolve_view(&[-1, 8], 32), Some(vec![4, 8]));
        assert_eq!(resolve_view(&[3, 8], 32), None);
        assert_eq!(resolve_view(&[-1, -1], 32), None);
        assert_eq!(norm_dim(-1, 2), Some(1));
        assert_eq!(norm_dim(2, 2), None);
    }
}
