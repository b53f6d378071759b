//! Graph inputs: seeded random tensors of the metadata's shapes and dtypes, integer inputs in
//! the ranges their consumers accept, or real tensors from files (`--inputs`): a safetensors
//! file (every tensor in it, by name), a `NAME.npy` file, or a directory of `.npy` files. A
//! tensor from a file gives the placeholder or parameter of its name; before anything runs,
//! every one is checked against the program (a name nothing in it has, or a shape or dtype
//! other than the graph's, is an [`InputError`] naming input, graph and field); inputs no file
//! gives are random.
//!
//! Every tensor is drawn from its own SplitMix64 stream (tiny, fast even in debug builds, and
//! the same on every machine), seeded by `--seed`, the input's name and the rank's data
//! stream, so the same input gets the same data whichever graph (original or scheduled) asks
//! for it. Parameters are seeded by their fully qualified name and are the
//! same on every rank (each rank then keeps its shard); other inputs (token ids, activations)
//! differ per rank, as a data-parallel batch does.
//!
//! Ranges: floats uniform in [-1, 1) (parameters in [-0.1, 0.1)); `bool` fair coins; integers
//! in [0, bound) where `bound` is the smallest size any consumer indexes with the value
//! (`embedding`'s table rows, `index`/`index_put`'s indexed dimension, `gather`/`scatter`'s
//! `dim`), followed through views; 2 when no consumer bounds it. Group offsets of a grouped
//! matrix product are drawn sorted in [0, size of the dimension they split], as cumulative
//! group ends are.

use crate::host::Tensor;
use ndarray::{ArrayD, IxDyn};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;
use zerosched_ir::{Arg, Dim, Dtype, Graph, NodeId, Op, Param, Program, Val};

/// A tensor given in a file.
#[derive(Clone, Debug)]
pub struct Given {
    pub tensor: Tensor,
    /// The file it came from (for messages).
    pub file: String,
}

/// A file of inputs that cannot be read, or a tensor in it that does not fit the program.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{file}: {message}")]
    File { file: String, message: String },
    #[error(transparent)]
    Mismatch(Box<Mismatch>),
    #[error("input `{input}` ({file}) names no placeholder or parameter of the program")]
    Unknown { input: String, file: String },
}

/// A given tensor whose shape or dtype is not its graph's.
#[derive(Debug, thiserror::Error)]
#[error("input `{input}` ({file}): {field}: the file has {found}, graph `{graph}` has {expected}")]
pub struct Mismatch {
    pub input: String,
    pub file: String,
    pub graph: String,
    /// `shape` or `dtype`.
    pub field: &'static str,
    pub found: String,
    pub expected: String,
}

#[derive(Clone, Debug, Default)]
pub struct Inputs {
    pub seed: u64,
    /// The data stream of each rank (default: rank r draws stream r). A one-rank reference run
    /// of rank r's data sets `[r]`.
    pub data_streams: Option<Vec<u32>>,
    /// Tensors given by name (placeholder name or parameter name), from `--inputs`.
    pub given: BTreeMap<String, Given>,
}

/// FNV-1a: a stable hash of a name (no random state).
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
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
    pub fn param(&self, g: &Graph, p: &Param) -> Result<Tensor, String> {
        let shape: Vec<usize> = p.shape.iter().map(Dim::hint).map(|d| d as usize).collect();
        if let Some(t) = self.given.get(&p.name) {
            fits(&p.name, t, g.label(), &shape, p.dtype).map_err(|e| e.to_string())?;
            return Ok(t.tensor.clone());
        }
        let mut rng = self.rng(&p.name, u64::MAX);
        random(&mut rng, &shape, p.dtype, 0.1, 2)
    }

    /// A non-parameter placeholder's value on `rank`.
    pub fn data(&self, g: &Graph, id: NodeId, rank: u32) -> Result<Tensor, String> {
        let n = g.node(id);
        let Some(Val::Tensor(meta)) = &n.meta.val else {
            return Err(format!("placeholder `{}` has no tensor metadata", n.name));
        };
        if let Some(t) = self.given.get(n.name.as_str()) {
            fits(&n.name, t, g.label(), &meta.hint_dims(), meta.dtype)
                .map_err(|e| e.to_string())?;
            return Ok(t.tensor.clone());
        }
        let mut rng = self.rng(&n.name, self.stream(rank));
        let shape = meta.hint_dims();
        if meta.dtype.is_floating() || meta.dtype == Dtype::Bool {
            return random(&mut rng, &shape, meta.dtype, 1.0, 2);
        }
        if let Some(end) = group_end(g, id) {
            // Group offsets: cumulative ends, so non-decreasing within [0, end].
            let mut t = random(&mut rng, &shape, meta.dtype, 1.0, end.saturating_add(1))?;
            if let crate::host::Data::I64(a) = &mut t.data {
                let mut v: Vec<i64> = a.iter().copied().collect();
                v.sort_unstable();
                *a = ArrayD::from_shape_vec(IxDyn(&shape), v)
                    .map_err(|e| e.to_string())?
                    .into_shared();
            }
            return Ok(t);
        }
        random(
            &mut rng,
            &shape,
            meta.dtype,
            1.0,
            int_bound(g, id).unwrap_or(2),
        )
    }

    /// Reads the tensors of `path`: a `.safetensors` file (every tensor, by its name), a file
    /// `NAME.npy` (the input `NAME`), or a directory (every `.npy` in it).
    pub fn load(&mut self, path: &Path) -> Result<(), InputError> {
        let file_err = |f: &Path, message: String| InputError::File {
            file: f.display().to_string(),
            message,
        };
        if path.extension().is_some_and(|x| x == "safetensors") {
            for (name, tensor) in read_safetensors(path).map_err(|m| file_err(path, m))? {
                let file = path.display().to_string();
                self.given.insert(name, Given { tensor, file });
            }
            return Ok(());
        }
        let files: Vec<std::path::PathBuf> = if path.is_dir() {
            let mut v: Vec<_> = std::fs::read_dir(path)
                .map_err(|e| file_err(path, e.to_string()))?
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
                .ok_or_else(|| file_err(&f, "no name".into()))?
                .to_owned();
            let tensor = read_npy(&f).map_err(|m| file_err(&f, m))?;
            let file = f.display().to_string();
            self.given.insert(name, Given { tensor, file });
        }
        Ok(())
    }

    /// Reads every tensor of a safetensors document held in memory (the Python binding's
    /// inputs); `file` names it in messages.
    pub fn load_safetensors(&mut self, bytes: &[u8], file: &str) -> Result<(), InputError> {
        let tensors = safetensors_tensors(bytes).map_err(|message| InputError::File {
            file: file.to_owned(),
            message,
        })?;
        for (name, tensor) in tensors {
            let file = file.to_owned();
            self.given.insert(name, Given { tensor, file });
        }
        Ok(())
    }

    /// Checks every given tensor against the program: it names a placeholder or parameter of
    /// some graph, with that graph's shape and dtype.
    pub fn check(&self, p: &Program) -> Result<(), InputError> {
        for (name, t) in &self.given {
            let mut found = false;
            for g in &p.graphs {
                for pa in g.params.iter().filter(|pa| &pa.name == name) {
                    let shape: Vec<usize> = pa.shape.iter().map(|d| d.hint() as usize).collect();
                    fits(name, t, g.label(), &shape, pa.dtype)?;
                    found = true;
                }
                let Some(id) = g.node_by_name(name) else {
                    continue;
                };
                let n = g.node(id);
                if n.op != Op::Placeholder || g.param_of(id).is_some() {
                    continue;
                }
                if let Some(Val::Tensor(meta)) = &n.meta.val {
                    fits(name, t, g.label(), &meta.hint_dims(), meta.dtype)?;
                    found = true;
                }
            }
            if !found {
                return Err(InputError::Unknown {
                    input: name.clone(),
                    file: t.file.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Whether a given tensor has the shape and dtype the graph declares.
fn fits(
    name: &str,
    t: &Given,
    graph: &str,
    shape: &[usize],
    dtype: Dtype,
) -> Result<(), InputError> {
    let mismatch = |field, found: String, expected: String| {
        InputError::Mismatch(Box::new(Mismatch {
            input: name.to_owned(),
            file: t.file.clone(),
            graph: graph.to_owned(),
            field,
            found,
            expected,
        }))
    };
    if t.tensor.shape() != shape {
        return Err(mismatch(
            "shape",
            format!("{:?}", t.tensor.shape()),
            format!("{shape:?}"),
        ));
    }
    if t.tensor.dtype != dtype {
        return Err(mismatch(
            "dtype",
            t.tensor.dtype.to_string(),
            dtype.to_string(),
        ));
    }
    Ok(())
}

fn read_npy(f: &Path) -> Result<Tensor, String> {
    use crate::host::Data;
    use ndarray_npy::ReadNpyExt;
    let bytes = std::fs::read(f).map_err(|e| e.to_string())?;
    let b = bytes.as_slice();
    if let Ok(a) = ArrayD::<f32>::read_npy(b) {
        return Ok(Tensor {
            dtype: Dtype::Float32,
            data: Data::F32(a.into_shared()),
        });
    }
    if let Ok(a) = ArrayD::<f64>::read_npy(b) {
        return Ok(Tensor {
            dtype: Dtype::Float64,
            data: Data::F64(a.into_shared()),
        });
    }
    if let Ok(a) = ArrayD::<i32>::read_npy(b) {
        return Ok(Tensor {
            dtype: Dtype::Int32,
            data: Data::I64(a.mapv(i64::from).into_shared()),
        });
    }
    if let Ok(a) = ArrayD::<bool>::read_npy(b) {
        return Ok(Tensor {
            dtype: Dtype::Bool,
            data: Data::Bool(a.into_shared()),
        });
    }
    match ArrayD::<i64>::read_npy(b) {
        Ok(a) => Ok(Tensor {
            dtype: Dtype::Int64,
            data: Data::I64(a.into_shared()),
        }),
        Err(e) => Err(format!(
            "not a float32, float64, int64, int32 or bool array: {e}"
        )),
    }
}

/// Every tensor of a safetensors file, by name (little-endian data, as the format stores it).
fn read_safetensors(f: &Path) -> Result<Vec<(String, Tensor)>, String> {
    safetensors_tensors(&std::fs::read(f).map_err(|e| e.to_string())?)
}

fn safetensors_tensors(bytes: &[u8]) -> Result<Vec<(String, Tensor)>, String> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    st.iter()
        .map(|(name, v)| {
            decode(v.dtype(), v.shape(), v.data())
                .map(|t| (name.to_owned(), t))
                .map_err(|m| format!("tensor `{name}`: {m}"))
        })
        .collect()
}

/// A safetensors tensor's bytes as a CPU tensor of the matching dtype.
fn decode(dtype: safetensors::Dtype, shape: &[usize], data: &[u8]) -> Result<Tensor, String> {
    use crate::host::Data;
    use safetensors::Dtype as S;
    fn le<const W: usize>(c: &[u8]) -> [u8; W] {
        let mut b = [0; W];
        b.copy_from_slice(c);
        b
    }
    fn arr<T: Clone>(shape: &[usize], v: Vec<T>) -> Result<crate::host::Arr<T>, String> {
        ArrayD::from_shape_vec(IxDyn(shape), v)
            .map(ArrayD::into_shared)
            .map_err(|e| e.to_string())
    }
    let (dt, width) = match dtype {
        S::F64 => (Dtype::Float64, 8),
        S::F32 => (Dtype::Float32, 4),
        S::BF16 => (Dtype::BFloat16, 2),
        S::F16 => (Dtype::Float16, 2),
        S::I64 => (Dtype::Int64, 8),
        S::I32 => (Dtype::Int32, 4),
        S::U32 => (Dtype::UInt32, 4),
        S::I16 => (Dtype::Int16, 2),
        S::U16 => (Dtype::UInt16, 2),
        S::I8 => (Dtype::Int8, 1),
        S::U8 => (Dtype::UInt8, 1),
        S::BOOL => (Dtype::Bool, 1),
        other => return Err(format!("dtype {other} is not supported")),
    };
    let n: usize = shape.iter().product();
    if data.len() != n * width {
        return Err(format!(
            "{} bytes for {n} elements of {width} bytes",
            data.len()
        ));
    }
    // On every core: a real model's parameters are gigabytes.
    let c = || data.par_chunks_exact(width);
    // Floats widen to f32 (f64 stays), integers to i64: what the CPU backend computes in.
    let floats = |f: fn(&[u8]) -> f32| arr(shape, c().map(f).collect()).map(Data::F32);
    let ints = |f: fn(&[u8]) -> i64| arr(shape, c().map(f).collect()).map(Data::I64);
    let data = match dt {
        Dtype::Float64 => Data::F64(arr(
            shape,
            c().map(|b| f64::from_le_bytes(le(b))).collect(),
        )?),
        Dtype::Float32 => floats(|b| f32::from_le_bytes(le(b)))?,
        Dtype::BFloat16 => floats(|b| half::bf16::from_le_bytes(le(b)).to_f32())?,
        Dtype::Float16 => floats(|b| half::f16::from_le_bytes(le(b)).to_f32())?,
        Dtype::Int64 => ints(|b| i64::from_le_bytes(le(b)))?,
        Dtype::Int32 => ints(|b| i32::from_le_bytes(le(b)).into())?,
        Dtype::UInt32 => ints(|b| u32::from_le_bytes(le(b)).into())?,
        Dtype::Int16 => ints(|b| i16::from_le_bytes(le(b)).into())?,
        Dtype::UInt16 => ints(|b| u16::from_le_bytes(le(b)).into())?,
        Dtype::Int8 => ints(|b| i8::from_le_bytes(le(b)).into())?,
        Dtype::UInt8 => ints(|b| b[0].into())?,
        _ => Data::Bool(arr(shape, c().map(|b| b[0] != 0).collect())?),
    };
    Ok(Tensor { dtype: dt, data })
}

/// `n` elements of `rng`'s stream, element `i` from its `i`-th draw (on every core: a draw is
/// the stream's position, so the values do not depend on how the work is split).
fn draws<T: Send>(
    rng: &mut SplitMix,
    n: usize,
    f: impl Fn(u64) -> T + Sync + Send,
) -> Result<Vec<T>, String> {
    let mut v: Vec<T> = reserve(n)?;
    let base = *rng;
    (0..n)
        .into_par_iter()
        .map(|i| f(base.at(i as u64)))
        .collect_into_vec(&mut v);
    rng.skip(n as u64);
    Ok(v)
}

fn random(
    rng: &mut SplitMix,
    shape: &[usize],
    dtype: Dtype,
    scale: f64,
    bound: i64,
) -> Result<Tensor, String> {
    use crate::host::{Data, Kind, round_to};
    let n = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("{shape:?} has more elements than this machine can address"))?;
    fn arr<T>(shape: &[usize], v: Vec<T>) -> Result<ArrayD<T>, String> {
        ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| e.to_string())
    }
    if dtype.is_floating() {
        let x = move |d: u64| (unit(d) * 2.0 - 1.0) * scale;
        // Held as the host holds the dtype, rounded to it: bf16 values stay 4 bytes, not 8.
        let data = match crate::host::kind(dtype)? {
            Kind::F32 => Data::F32(
                arr(shape, draws(rng, n, move |d| round_to(dtype, x(d) as f32))?)?.into_shared(),
            ),
            _ => Data::F64(arr(shape, draws(rng, n, x)?)?.into_shared()),
        };
        Ok(Tensor { dtype, data })
    } else {
        let hi = bound.max(1) as u64;
        let v = draws(rng, n, move |d| (d % hi) as i64)?;
        <i64 as crate::host::Elem>::wrap(arr(shape, v)?, dtype)
    }
}

/// An empty vector with room for `n` elements, or an error (not an abort) when the memory
/// cannot be had.
fn reserve<T>(n: usize) -> Result<Vec<T>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        format!(
            "cannot allocate {} bytes for its data",
            (n as u64).saturating_mul(std::mem::size_of::<T>() as u64)
        )
    })?;
    Ok(v)
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

/// The nodes that read `id`'s values, followed through views: (reader, the value it reads).
fn readers(g: &Graph, id: NodeId) -> Vec<(NodeId, NodeId)> {
    let mut out = Vec::new();
    let mut stack = vec![id];
    let mut seen = std::collections::BTreeSet::new();
    while let Some(v) = stack.pop() {
        if !seen.insert(v) {
            continue;
        }
        for u in g.users(v) {
            let t = g.node(u).target.as_str();
            if zerosched_ir::aten::is_view(t) || t == "aten.clone.default" {
                stack.push(u);
            } else {
                out.push((u, v));
            }
        }
    }
    out
}

/// The smallest size any consumer indexes with `id`'s values, followed through views.
pub fn int_bound(g: &Graph, id: NodeId) -> Option<i64> {
    readers(g, id)
        .into_iter()
        .filter_map(|(u, v)| {
            let n = g.node(u);
            let is = |a: Option<&Arg<NodeId>>| a.and_then(Arg::as_node) == Some(&v);
            let position_in = |a: Option<&Arg<NodeId>>| {
                a.and_then(Arg::as_list)
                    .and_then(|l| l.iter().position(|x| x.as_node() == Some(&v)))
            };
            match n.target.as_str() {
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
                _ => None,
            }
        })
        .min()
}

/// When `id` gives a grouped matrix product its group offsets: the size of the dimension they
/// split (rows of a 2-d first operand against a 3-d second, columns of a 2-d second against a
/// 3-d first, the contraction dimension of two 2-d operands).
pub fn group_end(g: &Graph, id: NodeId) -> Option<i64> {
    readers(g, id).into_iter().find_map(|(u, v)| {
        let n = g.node(u);
        let offs = n.args.get(2).or_else(|| n.kwargs.get("offs"));
        if n.target != "aten._grouped_mm.default" || offs.and_then(Arg::as_node) != Some(&v) {
            return None;
        }
        let rank = |a: Option<&Arg<NodeId>>| match a
            .and_then(Arg::as_node)
            .map(|&x| &g.node(x).meta.val)
        {
            Some(Some(Val::Tensor(t))) => Some(t.shape.len()),
            _ => None,
        };
        let (a, b) = (n.args.first(), n.args.get(1));
        match (rank(a)?, rank(b)?) {
            (2, 3) => dim_size(g, a, 0),
            (3, 2) => dim_size(g, b, 1),
            (2, 2) => dim_size(g, a, 1),
            _ => None,
        }
    })
}

/// SplitMix64 (Steele, Lea and Flood 2014): a 64-bit state, one multiply-xorshift per draw.
#[derive(Clone, Copy)]
struct SplitMix(u64);

const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) from a draw's 53 high bits.
fn unit(d: u64) -> f64 {
    (d >> 11) as f64 / (1u64 << 53) as f64
}

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        mix(self.0)
    }

    /// The draw `i` places ahead (`at(0)` is what `next` returns), without moving.
    fn at(self, i: u64) -> u64 {
        mix(self.0.wrapping_add(i.wrapping_add(1).wrapping_mul(GAMMA)))
    }

    fn skip(&mut self, n: u64) {
        self.0 = self.0.wrapping_add(n.wrapping_mul(GAMMA));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drawn on every core, a tensor's elements are the stream's draws in order, as one
    /// sequential walk of it gives them, and the stream ends where that walk ends.
    #[test]
    fn parallel_draws_are_the_sequential_stream() {
        let n = 3 * (1 << 16) + 5;
        let mut par = Inputs::new(7).rng("w", 1);
        let mut seq = par;
        let got = draws(&mut par, n, |d| d).unwrap();
        let want: Vec<u64> = (0..n).map(|_| seq.next()).collect();
        assert_eq!(got, want);
        assert_eq!(par.next(), seq.next());
    }

    /// A bf16 input holds its values rounded to bf16 (as f32), drawn in [-scale, scale).
    #[test]
    fn a_bf16_input_is_rounded_and_in_range() {
        let mut rng = Inputs::new(0).rng("w", 0);
        let t = random(&mut rng, &[64, 3], Dtype::BFloat16, 0.1, 2).unwrap();
        let v = t.to_f64_vec();
        assert_eq!(v.len(), 192);
        for x in v {
            assert!((-0.1..0.1).contains(&x), "{x}");
            assert_eq!(f64::from(half::bf16::from_f64(x).to_f32()), x);
        }
    }
}
