//! Graph inputs: seeded random tensors of the metadata's shapes and dtypes, integer inputs in
//! the ranges their consumers accept, or real tensors from `.npy` files.
//!
//! Every tensor is drawn from its own SplitMix64 stream (tiny, fast even in debug builds, and
//! the same on every machine), seeded by `--seed`, the input's name and the rank's data stream, so the same input gets the same data whichever graph (original or
//! scheduled) asks for it. Parameters are seeded by their fully qualified name and are the
//! same on every rank (each rank then keeps its shard); other inputs (token ids, activations)
//! differ per rank, as a data-parallel batch does.
//!
//! Ranges: floats uniform in [-1, 1) (parameters in [-0.1, 0.1)); `bool` fair coins; integers
//! in [0, bound) where `bound` is the smallest size any consumer indexes with the value
//! (`embedding`'s table rows, `index`/`index_put`'s indexed dimension, `gather`/`scatter`'s
//! `dim`), followed through views; 2 when no consumer bounds it.

use super::cpu::Tensor;
use ndarray::{ArrayD, IxDyn};
use std::collections::BTreeMap;
use std::path::Path;
use zerosched_ir::{Arg, Dim, Dtype, Graph, NodeId, Param, TensorMeta, Val};

#[derive(Clone, Debug, Default)]
pub struct Inputs {
    pub seed: u64,
    /// The data stream of each rank (default: rank r draws stream r). A one-rank reference run
    /// of rank r's data sets `[r]`.
    pub data_streams: Option<Vec<u32>>,
    /// Tensors given by name (placeholder name or parameter name), from `--inputs`.
    pub given: BTreeMap<String, Tensor>,
}

/// FNV-1a: a stable hash of a name (no random state).
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn shape_of(t: &TensorMeta) -> Vec<usize> {
    t.shape.iter().map(|d| d.hint() as usize).collect()
}

impl Inputs {
    pub fn new(seed: u64) -> Inputs {
        Inputs {
            seed,
            ..Inputs::default()
        }
    }

    fn stream(&self, rank: u32) -> u64 {
        u64::from(match &self.data_streams {
            Some(s) => s.get(rank as usize).copied().unwrap_or(rank),
            None => rank,
        })
    }

    fn rng(&self, name: &str, stream: u64) -> SplitMix {
        let mut r = SplitMix(self.seed ^ fnv(name));
        r.0 ^= r
            .next()
            .wrapping_add(stream.wrapping_mul(0xd134_2543_de82_ef95));
        r.next();
        r
    }

    /// A parameter's full value.
    pub fn param(&self, p: &Param) -> Result<Tensor, String> {
        if let Some(t) = self.given.get(&p.name) {
            return t.cast(p.dtype);
        }
        let shape: Vec<usize> = p.shape.iter().map(Dim::hint).map(|d| d as usize).collect();
        let mut rng = self.rng(&p.name, u64::MAX);
        random(&mut rng, &shape, p.dtype, 0.1, 2)
    }

    /// A non-parameter placeholder's value on `rank`.
    pub fn data(&self, g: &Graph, id: NodeId, rank: u32) -> Result<Tensor, String> {
        let n = g.node(id);
        let Some(Val::Tensor(meta)) = &n.meta.val else {
            return Err(format!("placeholder `{}` has no tensor metadata", n.name));
        };
        if let Some(t) = self.given.get(&n.name) {
            if t.shape() != shape_of(meta).as_slice() {
                return Err(format!(
                    "input `{}`: the file has shape {:?}, the graph {:?}",
                    n.name,
                    t.shape(),
                    shape_of(meta)
                ));
            }
            return t.cast(meta.dtype);
        }
        let bound = if meta.dtype.is_floating() || meta.dtype == Dtype::Bool {
            2
        } else {
            int_bound(g, id).unwrap_or(2)
        };
        let mut rng = self.rng(&n.name, self.stream(rank));
        random(&mut rng, &shape_of(meta), meta.dtype, 1.0, bound)
    }

    /// Reads `.npy` files: a file `NAME.npy` gives the input (placeholder or parameter) `NAME`;
    /// a directory gives every `.npy` in it. f32, f64 and i64 arrays.
    pub fn load(&mut self, path: &Path) -> Result<(), String> {
        let files: Vec<std::path::PathBuf> = if path.is_dir() {
            let mut v: Vec<_> = std::fs::read_dir(path)
                .map_err(|e| format!("{}: {e}", path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "npy"))
                .collect();
            v.sort();
            v
        } else {
            vec![path.to_owned()]
        };
        for f in files {
            let name = f
                .file_stem()
                .and_then(|s| s.to_str())
                .ok_or_else(|| format!("{}: no name", f.display()))?
                .to_owned();
            let t = read_npy(&f)?;
            self.given.insert(name, t);
        }
        Ok(())
    }
}

fn read_npy(f: &Path) -> Result<Tensor, String> {
    use super::cpu::tensor::Data;
    use ndarray_npy::ReadNpyExt;
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", f.display());
    let bytes = std::fs::read(f).map_err(|e| err(&e))?;
    if let Ok(a) = ArrayD::<f32>::read_npy(bytes.as_slice()) {
        return Ok(Tensor {
            dtype: Dtype::Float32,
            data: Data::F32(a.into_shared()),
        });
    }
    if let Ok(a) = ArrayD::<f64>::read_npy(bytes.as_slice()) {
        return Ok(Tensor {
            dtype: Dtype::Float64,
            data: Data::F64(a.into_shared()),
        });
    }
    match ArrayD::<i64>::read_npy(bytes.as_slice()) {
        Ok(a) => Ok(Tensor {
            dtype: Dtype::Int64,
            data: Data::I64(a.into_shared()),
        }),
        Err(e) => Err(err(&format!("not an f32, f64 or i64 array: {e}"))),
    }
}

fn random(
    rng: &mut SplitMix,
    shape: &[usize],
    dtype: Dtype,
    scale: f64,
    bound: i64,
) -> Result<Tensor, String> {
    let n: usize = shape.iter().product();
    if dtype.is_floating() {
        let v: Vec<f64> = (0..n).map(|_| (rng.unit() * 2.0 - 1.0) * scale).collect();
        let a = ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| e.to_string())?;
        <f64 as super::cpu::tensor::Elem>::wrap(a, dtype)
    } else {
        let hi = bound.max(1);
        let v: Vec<i64> = (0..n).map(|_| (rng.next() % hi as u64) as i64).collect();
        let a = ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| e.to_string())?;
        <i64 as super::cpu::tensor::Elem>::wrap(a, dtype)
    }
}

fn dim_size(g: &Graph, a: Option<&Arg<NodeId>>, dim: i64) -> Option<i64> {
    let id = *a?.as_node()?;
    let Some(Val::Tensor(t)) = &g.node(id).meta.val else {
        return None;
    };
    let rank = t.shape.len() as i64;
    let d = if dim < 0 { dim + rank } else { dim };
    t.shape
        .get(usize::try_from(d).ok()?)
        .map(|s| s.hint() as i64)
}

/// The smallest size any consumer indexes with `id`'s values, followed through views.
pub fn int_bound(g: &Graph, id: NodeId) -> Option<i64> {
    let mut best: Option<i64> = None;
    let mut stack = vec![id];
    let mut seen = std::collections::BTreeSet::new();
    while let Some(v) = stack.pop() {
        if !seen.insert(v) {
            continue;
        }
        for u in g.users(v) {
            let n = g.node(u);
            let is = |a: Option<&Arg<NodeId>>| a.and_then(Arg::as_node) == Some(&v);
            let position_in = |a: Option<&Arg<NodeId>>| {
                a.and_then(Arg::as_list)
                    .and_then(|l| l.iter().position(|x| x.as_node() == Some(&v)))
            };
            let bound = match n.target.as_str() {
                "aten.embedding.default" if is(n.args.get(1)) => dim_size(g, n.args.first(), 0),
                "aten.index.Tensor" | "aten.index_put.default" => {
                    position_in(n.args.get(1)).and_then(|k| dim_size(g, n.args.first(), k as i64))
                }
                "aten.gather.default" | "aten.scatter.value" | "aten.scatter.src"
                    if is(n.args.get(2)) =>
                {
                    n.args
                        .get(1)
                        .and_then(Arg::as_int)
                        .and_then(|d| dim_size(g, n.args.first(), d))
                }
                t if zerosched_ir::aten::is_view(t) || t == "aten.clone.default" => {
                    stack.push(u);
                    None
                }
                _ => None,
            };
            if let Some(b) = bound {
                best = Some(best.map_or(b, |x: i64| x.min(b)));
            }
        }
    }
    best
}

/// SplitMix64 (Steele, Lea and Flood 2014): a 64-bit state, one multiply-xorshift per draw.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), 53 bits.
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}
