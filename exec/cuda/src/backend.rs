//! The executor's CUDA backend: one rank's device behind `zerosched_exec::Backend`.
//!
//! A tensor is a strided view of a pool block; shape ops (view, permute, transpose, expand,
//! slice, select, split, squeeze, unsqueeze) make new views of the same block when the node
//! aliases its input, everything else launches generated kernels or cuBLAS on the compute
//! stream (the op families beyond elementwise, views, reductions and products are in
//! `ops/`). A free fences both streams (the communication stream may have read the
//! buffer) and returns the block to the pool, with any copy a view op made of it. The ops are
//! those of the fixtures (listed in [`resolve`]); a graph with another op is refused before it
//! runs, naming op and node.

use crate::device::{Device, StreamKind};
use crate::error::CudaError;
use crate::kernels::source::{Elem, Reduce, Softmax};
use crate::kernels::{Kernels, View, contiguous_strides};
use crate::matmul::{Blas, Gemm, Math};
use crate::ops::{attention, conv, create, index, linalg, loss, norm, regions, routing};
use crate::owners::Owners;
use crate::pool::{Block, Pool, PoolStats};
use crate::storage::{decode_tensor, encode, encode_tensor};
use zerosched_exec::host;
use zerosched_exec::{Backend, BackendError, Env, NodeError, Value};
use zerosched_ir::{Arg, Dtype, NodeId, TensorMeta};

/// A strided view of a pool block.
#[derive(Clone, Debug)]
pub struct CudaTensor {
    pub block: Block,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub strides: Vec<i64>,
    pub offset: i64,
}

impl CudaTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub(crate) fn elem(&self) -> Result<Elem, String> {
        elem(self.dtype)
    }

    pub(crate) fn is_contiguous(&self) -> bool {
        self.offset == 0 && self.strides == contiguous_strides(&self.shape)
    }

    pub(crate) fn view(&self) -> Result<View, String> {
        Ok(View {
            ptr: self.block.ptr,
            elem: self.elem()?,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            offset: self.offset,
        })
    }

    /// The same storage, another shape and strides.
    pub(crate) fn restride(&self, shape: Vec<usize>, strides: Vec<i64>, offset: i64) -> CudaTensor {
        CudaTensor {
            block: self.block,
            dtype: self.dtype,
            shape,
            strides,
            offset,
        }
    }
}

pub(crate) fn elem(d: Dtype) -> Result<Elem, String> {
    Elem::of(d).ok_or_else(|| format!("dtype {d} is not supported by the CUDA backend"))
}

/// A kernel of the backend.
pub type Kernel = fn(&mut Cuda, &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String>;

/// One rank's CUDA backend.
pub struct Cuda {
    pub dev: Device,
    pub pool: Pool,
    /// The generated kernels (replay's spin kernel among them).
    pub(crate) k: Kernels,
    pub(crate) blas: Blas,
    /// Who owns each block: copies view ops made, blocks carried to later graphs.
    owners: Owners,
}

fn kernel_err(e: impl std::fmt::Display) -> BackendError {
    BackendError::Kernel(e.to_string())
}

impl Cuda {
    pub fn new(dev: &Device) -> Result<Cuda, CudaError> {
        Ok(Cuda {
            dev: dev.clone(),
            pool: Pool::new(dev),
            k: Kernels::new(dev)?,
            blas: Blas::new(dev)?,
            owners: Owners::default(),
        })
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// A new contiguous tensor (uninitialised) used first on `stream`.
    pub fn empty_on(
        &mut self,
        dtype: Dtype,
        shape: &[usize],
        stream: StreamKind,
    ) -> Result<CudaTensor, String> {
        let n: usize = shape.iter().product();
        let bytes = (n * elem(dtype)?.bytes()) as u64;
        let block = self.pool.alloc(bytes, stream).map_err(|e| e.to_string())?;
        Ok(CudaTensor {
            block,
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        })
    }

    pub(crate) fn empty(&mut self, dtype: Dtype, shape: &[usize]) -> Result<CudaTensor, String> {
        self.empty_on(dtype, shape, StreamKind::Compute)
    }

    /// Returns a temporary (or any tensor the executor does not own) to the pool.
    pub fn release(&mut self, t: &CudaTensor) {
        // Errors here can only be a block the pool does not know, which the core never frees.
        let _ = self
            .pool
            .free(t.block, &[StreamKind::Compute, StreamKind::Comm]);
    }

    /// `op` of `ins` into a new contiguous tensor of `dtype` and the broadcast shape.
    pub(crate) fn ew(
        &mut self,
        op: &str,
        ins: &[&CudaTensor],
        dtype: Dtype,
        s: f64,
    ) -> Result<CudaTensor, String> {
        let shape = broadcast_shape(ins.iter().map(|t| t.shape.as_slice()))?;
        let out = self.empty(dtype, &shape)?;
        let views = ins
            .iter()
            .map(|t| t.view())
            .collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&View> = views.iter().collect();
        self.k
            .elementwise(op, &refs, &out.view()?, s, 0.0)
            .map_err(|e| e.to_string())?;
        Ok(out)
    }

    /// `op` of `ins` (broadcast) written into `out`, which may be a strided view.
    pub(crate) fn ew_into(
        &mut self,
        op: &str,
        ins: &[&CudaTensor],
        out: &CudaTensor,
        s: f64,
    ) -> Result<(), String> {
        let views = ins
            .iter()
            .map(|t| t.view())
            .collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&View> = views.iter().collect();
        self.k
            .elementwise(op, &refs, &out.view()?, s, 0.0)
            .map_err(|e| e.to_string())
    }

    /// A new tensor of `dtype` and `shape` holding `x` everywhere.
    pub(crate) fn full(
        &mut self,
        dtype: Dtype,
        shape: &[usize],
        x: f64,
    ) -> Result<CudaTensor, String> {
        let out = self.empty(dtype, shape)?;
        if let Err(e) = self.ew_into("fill", &[], &out, x) {
            self.release(&out);
            return Err(e);
        }
        Ok(out)
    }

    /// `t` as a contiguous tensor: itself, or a copy the caller releases (`true`).
    pub(crate) fn contiguous(&mut self, t: &CudaTensor) -> Result<(CudaTensor, bool), String> {
        if t.is_contiguous() {
            return Ok((t.clone(), false));
        }
        Ok((self.ew("copy", &[t], t.dtype, 0.0)?, true))
    }

    /// `t` flattened into a new contiguous buffer of `len` elements of `dtype`, zero past
    /// `t`'s elements (a collective's padded operand).
    pub fn copy_padded(
        &mut self,
        t: &CudaTensor,
        dtype: Dtype,
        len: usize,
    ) -> Result<CudaTensor, String> {
        let n = t.numel();
        if n > len {
            return Err(format!("{n} elements do not fit a buffer of {len}"));
        }
        let cast = if t.dtype == dtype && t.is_contiguous() {
            t.clone()
        } else {
            self.ew("copy", &[t], dtype, 0.0)?
        };
        let out = self.empty(dtype, &[len])?;
        let e = elem(dtype)?;
        let res = self
            .dev
            .zero(StreamKind::Compute, out.block.ptr, len * e.bytes())
            .map_err(|e| e.to_string())
            .and_then(|()| {
                self.k
                    .cat(out.block.ptr, cast.block.ptr, e, 1, n, 1, len, 0)
                    .map_err(|e| e.to_string())
            });
        if cast.block != t.block {
            self.release(&cast);
        }
        res?;
        Ok(out)
    }

    /// A 0-d tensor holding `x` (uploaded; used for scalar operands without a `*_scalar` row).
    pub(crate) fn scalar(&mut self, x: f64, dtype: Dtype) -> Result<CudaTensor, String> {
        let t = self.empty(dtype, &[])?;
        let bytes = encode(t.elem()?, &[x]);
        self.dev
            .upload(StreamKind::Compute, t.block.ptr, &bytes)
            .map_err(|e| e.to_string())?;
        Ok(t)
    }
}

/// numpy broadcasting of the shapes.
pub(crate) fn broadcast_shape<'a>(
    shapes: impl Iterator<Item = &'a [usize]>,
) -> Result<Vec<usize>, String> {
    let mut out: Vec<usize> = vec![];
    for s in shapes {
        if s.len() > out.len() {
            let mut grown = vec![1; s.len() - out.len()];
            grown.extend(&out);
            out = grown;
        }
        let lead = out.len() - s.len();
        for (d, &n) in s.iter().enumerate() {
            let o = &mut out[lead + d];
            if *o == 1 {
                *o = n;
            } else if n != 1 && n != *o {
                return Err(format!("shapes do not broadcast: {s:?} against {out:?}"));
            }
        }
    }
    Ok(out)
}

impl Backend for Cuda {
    type Tensor = CudaTensor;
    type Kernel = Kernel;
    const NAME: &'static str = "cuda";

    fn resolve(target: &str) -> Option<Kernel> {
        resolve(target)
    }

    fn compute(
        &mut self,
        k: &Kernel,
        env: &Env<'_, CudaTensor>,
    ) -> Result<Value<CudaTensor>, BackendError> {
        k(self, env).map_err(BackendError::Kernel)
    }

    fn numel(&self, t: &CudaTensor) -> u64 {
        t.numel() as u64
    }

    fn dtype(&self, t: &CudaTensor) -> Dtype {
        t.dtype
    }

    fn input(
        &mut self,
        meta: &TensorMeta,
        make: &mut dyn FnMut() -> Result<host::Tensor, String>,
    ) -> Result<CudaTensor, NodeError> {
        let t = make().map_err(NodeError::Input)?;
        let shape = meta.hint_dims();
        if t.shape() != shape.as_slice() {
            return Err(NodeError::Input(format!(
                "input has shape {:?}, metadata {shape:?}",
                t.shape()
            )));
        }
        let e = elem(meta.dtype).map_err(NodeError::Input)?;
        let out = self.empty(meta.dtype, &shape).map_err(NodeError::Input)?;
        let bytes = encode_tensor(e, &t);
        self.dev
            .upload(StreamKind::Compute, out.block.ptr, &bytes)
            .map_err(|e| NodeError::Input(e.to_string()))?;
        Ok(out)
    }

    fn download(&mut self, t: &CudaTensor) -> Result<Option<host::Tensor>, BackendError> {
        let (c, temp) = self.contiguous(t).map_err(kernel_err)?;
        let e = c.elem().map_err(kernel_err)?;
        let mut bytes = vec![0u8; c.numel() * e.bytes()];
        let at = c.block.ptr + (c.offset as u64) * e.bytes() as u64;
        let r = self
            .dev
            .download(StreamKind::Compute, at, &mut bytes)
            .map_err(kernel_err);
        if temp {
            self.release(&c);
        }
        r?;
        Ok(Some(
            decode_tensor(t.dtype, &t.shape, e, &bytes).map_err(kernel_err)?,
        ))
    }

    fn shard(
        &mut self,
        full: &CudaTensor,
        world: u32,
        rank: u32,
    ) -> Result<CudaTensor, BackendError> {
        let world = world.max(1) as usize;
        let n = full.numel();
        let per = n.div_ceil(world);
        let lo = (rank as usize * per).min(n);
        let hi = (lo + per).min(n);
        let (c, temp) = self.contiguous(full).map_err(kernel_err)?;
        let out = self.empty(full.dtype, &[per]).map_err(kernel_err)?;
        let e = c.elem().map_err(kernel_err)?;
        self.dev
            .zero(StreamKind::Compute, out.block.ptr, per * e.bytes())
            .map_err(kernel_err)?;
        if hi > lo {
            let src = c.restride(vec![hi - lo], vec![1], c.offset + lo as i64);
            let dst = out.restride(vec![hi - lo], vec![1], 0);
            self.k
                .cat(
                    dst.block.ptr,
                    src.block.ptr + (src.offset as u64) * e.bytes() as u64,
                    e,
                    1,
                    hi - lo,
                    1,
                    per,
                    0,
                )
                .map_err(kernel_err)?;
        }
        if temp {
            self.release(&c);
        }
        Ok(out)
    }

    fn unflatten(
        &mut self,
        flat: &CudaTensor,
        shape: &[usize],
    ) -> Result<CudaTensor, BackendError> {
        let n: usize = shape.iter().product();
        if n > flat.numel() || !flat.is_contiguous() {
            return Err(kernel_err(format!(
                "a buffer of {} elements cannot hold {shape:?}",
                flat.numel()
            )));
        }
        Ok(flat.restride(shape.to_vec(), contiguous_strides(shape), 0))
    }

    fn free(&mut self, t: CudaTensor) {
        for b in self.owners.free(t.block) {
            // Errors here can only be a block the pool does not know, which the core never frees.
            let _ = self.pool.free(b, &[StreamKind::Compute, StreamKind::Comm]);
        }
    }

    fn share(&mut self, t: &CudaTensor) -> CudaTensor {
        self.owners.share(t.block);
        t.clone()
    }

    fn held_bytes(&self) -> Option<u64> {
        Some(self.pool.stats().requested)
    }
}

// Argument readers.

pub(crate) fn int(a: &Arg<NodeId>) -> Result<i64, String> {
    match a {
        Arg::Bool(b) => Ok(i64::from(*b)),
        _ => a
            .as_int()
            .ok_or_else(|| format!("expected an integer, found {a:?}")),
    }
}

pub(crate) fn ints(a: &Arg<NodeId>) -> Result<Vec<i64>, String> {
    match a {
        Arg::List(items) => items.iter().map(int).collect(),
        _ => Ok(vec![int(a)?]),
    }
}

pub(crate) fn number(a: &Arg<NodeId>) -> Option<f64> {
    match a {
        Arg::Int(i) => Some(*i as f64),
        Arg::Float(x) => Some(*x),
        Arg::Bool(b) => Some(f64::from(u8::from(*b))),
        Arg::Sym(s) => Some(s.hint as f64),
        _ => None,
    }
}

pub(crate) fn norm_dim(d: i64, rank: usize) -> Result<usize, String> {
    let r = rank.max(1) as i64;
    let x = if d < 0 { d + r } else { d };
    if (0..r).contains(&x) {
        Ok(x as usize)
    } else {
        Err(format!("dimension {d} out of range for rank {rank}"))
    }
}

pub(crate) fn out_dtype(env: &Env<'_, CudaTensor>, fallback: Dtype) -> Dtype {
    env.out_meta().map_or(fallback, |m| m.dtype)
}

pub(crate) fn one(t: CudaTensor) -> Result<Value<CudaTensor>, String> {
    Ok(Value::Tensor(t))
}

/// The kernel of an aten target, if the backend has one.
pub fn resolve(target: &str) -> Option<Kernel> {
    Some(match target {
        "aten.add.Tensor" => |c, e| binary(c, e, "add", true),
        "aten.sub.Tensor" => |c, e| binary(c, e, "sub", true),
        "aten.mul.Tensor" | "aten.mul.Scalar" => |c, e| binary(c, e, "mul", false),
        "aten.div.Tensor" | "aten.div.Scalar" => |c, e| binary(c, e, "div", false),
        "aten.eq.Tensor" | "aten.eq.Scalar" => |c, e| binary(c, e, "eq", false),
        "aten.ne.Tensor" | "aten.ne.Scalar" => |c, e| binary(c, e, "ne", false),
        "aten.le.Tensor" | "aten.le.Scalar" => |c, e| binary(c, e, "le", false),
        "aten.lt.Tensor" | "aten.lt.Scalar" => |c, e| binary(c, e, "lt", false),
        "aten.ge.Tensor" | "aten.ge.Scalar" => |c, e| binary(c, e, "ge", false),
        "aten.gt.Tensor" | "aten.gt.Scalar" => |c, e| binary(c, e, "gt", false),
        "aten.bitwise_and.Tensor" => |c, e| binary(c, e, "bitwise_and", false),
        "aten.bitwise_or.Tensor" => |c, e| binary(c, e, "bitwise_or", false),
        "aten.where.self" => where_,
        "aten.neg.default" => |c, e| unary(c, e, "neg"),
        "aten.exp.default" => |c, e| unary(c, e, "exp"),
        "aten.cos.default" => |c, e| unary(c, e, "cos"),
        "aten.sin.default" => |c, e| unary(c, e, "sin"),
        "aten.rsqrt.default" => |c, e| unary(c, e, "rsqrt"),
        "aten.sqrt.default" => |c, e| unary(c, e, "sqrt"),
        "aten.sigmoid.default" => |c, e| unary(c, e, "sigmoid"),
        "aten.tanh.default" => |c, e| unary(c, e, "tanh"),
        "aten.reciprocal.default" => |c, e| unary(c, e, "reciprocal"),
        "aten.log.default" => |c, e| unary(c, e, "log"),
        "aten.pow.Tensor_Scalar" => pow_scalar,
        "aten._to_copy.default" | "prims.convert_element_type.default" => to_copy,
        "aten.clone.default" => |c, e| unary(c, e, "copy"),
        "aten.lift_fresh_copy.default" => |c, e| unary(c, e, "copy"),
        // The view ops: a view of the input's block when the node aliases its input (the
        // executor frees the storage class once, through either), else a copy of its own.
        "aten.alias.default" | "aten.detach.default" => {
            |c, e| viewing(c, e, |_, e| one(tensor(e, 0)?.clone()))
        }
        "aten.view.default" | "aten._unsafe_view.default" | "aten.reshape.default" => {
            |c, e| viewing(c, e, view)
        }
        "aten.unsqueeze.default" => |c, e| viewing(c, e, unsqueeze),
        "aten.squeeze.dims" | "aten.squeeze.dim" | "aten.squeeze.default" => {
            |c, e| viewing(c, e, squeeze)
        }
        "aten.permute.default" => |c, e| viewing(c, e, permute),
        "aten.t.default" => |c, e| viewing(c, e, |c, e| transpose_dims(c, e, Some((0, 1)))),
        "aten.transpose.int" => |c, e| viewing(c, e, |c, e| transpose_dims(c, e, None)),
        "aten.expand.default" => |c, e| viewing(c, e, expand),
        "aten.slice.Tensor" => |c, e| viewing(c, e, slice),
        "aten.select.int" => |c, e| viewing(c, e, select),
        "aten.split.Tensor" => |c, e| viewing(c, e, |c, e| split(c, e, false)),
        "aten.split_with_sizes.default" => |c, e| viewing(c, e, |c, e| split(c, e, true)),
        "aten.cat.default" => cat,
        "aten.sum.dim_IntList" | "aten.sum.default" => |c, e| reduce(c, e, Reduce::Sum),
        "aten.mean.dim" => |c, e| reduce(c, e, Reduce::Mean),
        "aten._softmax.default" => |c, e| softmax(c, e, Softmax::Plain),
        "aten._log_softmax.default" => |c, e| softmax(c, e, Softmax::Log),
        "aten._safe_softmax.default" => |c, e| softmax(c, e, Softmax::Safe),
        "aten.mm.default" => |c, e| matmul(c, e, false),
        "aten.bmm.default" => |c, e| matmul(c, e, true),
        "aten.embedding.default" => embedding,
        "aten.gather.default" => gather,
        "operator.getitem" => getitem,
        // Activations and their backward forms, from the elementwise table.
        "aten.relu.default" => |c, e| unary(c, e, "relu"),
        "aten.silu.default" => |c, e| unary(c, e, "silu"),
        "aten.erf.default" => |c, e| unary(c, e, "erf"),
        "aten.abs.default" => |c, e| unary(c, e, "abs"),
        "aten.logical_not.default" => |c, e| unary(c, e, "logical_not"),
        "aten.gelu.default" => |c, e| {
            let op = if gelu_tanh(e, 1)? {
                "gelu_tanh"
            } else {
                "gelu"
            };
            unary(c, e, op)
        },
        "aten.gelu_backward.default" => |c, e| {
            let op = if gelu_tanh(e, 2)? {
                "gelu_tanh_backward"
            } else {
                "gelu_backward"
            };
            binary(c, e, op, false)
        },
        "aten.silu_backward.default" => |c, e| binary(c, e, "silu_backward", false),
        "aten.threshold_backward.default" => threshold_backward,
        "aten.minimum.default" => |c, e| binary(c, e, "minimum", false),
        "aten.maximum.default" => |c, e| binary(c, e, "maximum", false),
        "aten.div.Tensor_mode" => |c, e| {
            let op = match e.node().kwargs.get("rounding_mode") {
                Some(Arg::Str(m)) if m == "floor" => "div_floor",
                Some(Arg::Str(m)) if m == "trunc" => "div_trunc",
                None | Some(Arg::None) => "div",
                Some(m) => return Err(format!("rounding_mode {m:?}")),
            };
            binary(c, e, op, false)
        },
        "aten.any.dim" | "aten.any.dims" | "aten.any.default" => |c, e| reduce(c, e, Reduce::Any),
        // Creation.
        "aten.full.default" => |c, e| create::sized(c, e, None),
        "aten.zeros.default" => |c, e| create::sized(c, e, Some(0.0)),
        "aten.ones.default" => |c, e| create::sized(c, e, Some(1.0)),
        "aten.full_like.default" => |c, e| create::like(c, e, None),
        "aten.zeros_like.default" => |c, e| create::like(c, e, Some(0.0)),
        "aten.ones_like.default" => |c, e| create::like(c, e, Some(1.0)),
        "aten.new_full.default" => |c, e| create::new(c, e, None),
        "aten.new_zeros.default" => |c, e| create::new(c, e, Some(0.0)),
        "aten.new_ones.default" => |c, e| create::new(c, e, Some(1.0)),
        "aten.scalar_tensor.default" => create::scalar_tensor,
        "aten.arange.start_step" | "aten.arange.start" | "aten.arange.default" => create::arange,
        "aten.empty_permuted.default" | "aten.empty.memory_format" => create::empty,
        // Region writes.
        "aten.slice_scatter.default" => regions::slice_scatter,
        "aten.select_scatter.default" => regions::select_scatter,
        "aten.slice_backward.default" => regions::slice_backward,
        "aten.select_backward.default" => regions::select_backward,
        "aten.constant_pad_nd.default" => regions::constant_pad_nd,
        "aten.copy.default" => regions::copy,
        "aten.fill.Scalar" | "aten.fill.Tensor" => regions::fill,
        "aten.masked_fill.Scalar" | "aten.masked_fill.Tensor" => regions::masked_fill,
        // Indexing.
        "aten.index.Tensor" => index::index,
        "aten.index_put.default" => index::index_put,
        "aten.scatter.src" | "aten.scatter.value" => |c, e| index::scatter(c, e, false),
        "aten.scatter_add.default" => |c, e| index::scatter(c, e, true),
        "aten.embedding_dense_backward.default" => index::embedding_dense_backward,
        // Normalisation, losses, softmax backward.
        "aten.native_layer_norm.default" => |c, e| norm::layer_norm(c, e, true),
        "aten.layer_norm.default" => |c, e| norm::layer_norm(c, e, false),
        "aten.native_layer_norm_backward.default" => norm::layer_norm_backward,
        "aten._softmax_backward_data.default" => |c, e| loss::softmax_backward(c, e, false),
        "aten._log_softmax_backward_data.default" => |c, e| loss::softmax_backward(c, e, true),
        "aten.nll_loss_forward.default" => loss::nll_loss_forward,
        "aten.nll_loss_backward.default" => loss::nll_loss_backward,
        // Attention, products, convolution, routing.
        "aten._scaled_dot_product_flash_attention_for_cpu.default"
        | "aten._scaled_dot_product_flash_attention.default" => attention::forward,
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
        | "aten._scaled_dot_product_flash_attention_backward.default" => attention::backward,
        "aten.addmm.default" => linalg::addmm,
        "aten._grouped_mm.default" => linalg::grouped_mm,
        "aten.convolution.default" => conv::convolution,
        "aten.convolution_backward.default" => conv::convolution_backward,
        "aten.cumsum.default" => routing::cumsum,
        "aten.sort.default" | "aten.sort.stable" => routing::sort,
        "aten.topk.default" => routing::topk,
        "aten.histc.default" => routing::histc,
        _ => return None,
    })
}

pub(crate) fn tensor<'a>(env: &Env<'a, CudaTensor>, i: usize) -> Result<&'a CudaTensor, String> {
    env.tensor(env.arg(i)?)
}

fn unary(c: &mut Cuda, env: &Env<'_, CudaTensor>, op: &str) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    one(c.ew(op, &[x], out_dtype(env, x.dtype), 0.0)?)
}

/// A binary op of two tensors, or of a tensor and a number (`alpha`: add/sub's keyword).
fn binary(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    op: &str,
    alpha: bool,
) -> Result<Value<CudaTensor>, String> {
    let s = if alpha {
        env.node()
            .kwargs
            .get("alpha")
            .and_then(number)
            .unwrap_or(1.0)
    } else {
        1.0
    };
    let (lhs, rhs) = (env.arg(0)?, env.arg(1)?);
    // Either side may be a number: `1 - x` reaches `sub.Tensor` with the number first.
    let (a, x, number_first) = match (lhs.as_node(), rhs.as_node()) {
        (Some(_), Some(_)) => {
            let (a, b) = (env.tensor(lhs)?, env.tensor(rhs)?);
            return one(c.ew(op, &[a, b], out_dtype(env, a.dtype), s)?);
        }
        (Some(_), None) => (env.tensor(lhs)?, rhs, false),
        (None, Some(_)) => (env.tensor(rhs)?, lhs, true),
        (None, None) => return Err(format!("expected a tensor argument, found {lhs:?}")),
    };
    let dt = out_dtype(env, a.dtype);
    let x = number(x).ok_or_else(|| format!("expected a tensor or a number, found {x:?}"))?;
    // The number as a 0-d tensor, broadcast: in the input's dtype, or the result's when an
    // integer tensor meets a number into a floating-point result (torch's promotion).
    let float = |d: Dtype| Elem::of(d).is_some_and(Elem::is_float);
    let sdt = if float(dt) && !float(a.dtype) {
        dt
    } else {
        a.dtype
    };
    let st = c.scalar(x, sdt)?;
    let operands = if number_first { [&st, a] } else { [a, &st] };
    let out = c.ew(op, &operands, dt, s);
    c.release(&st);
    one(out?)
}

fn where_(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let cond = tensor(env, 0)?;
    let dt = env
        .out_meta()
        .map(|m| m.dtype)
        .ok_or("where without output metadata")?;
    let mut temps = vec![];
    let mut operand = |c: &mut Cuda, i: usize| -> Result<CudaTensor, String> {
        let a = env.arg(i)?;
        if a.as_node().is_some() {
            Ok(env.tensor(a)?.clone())
        } else {
            let x =
                number(a).ok_or_else(|| format!("expected a tensor or a number, found {a:?}"))?;
            let t = c.scalar(x, dt)?;
            temps.push(t.clone());
            Ok(t)
        }
    };
    let (x, y) = (operand(c, 1)?, operand(c, 2)?);
    let out = c.ew("where", &[cond, &x, &y], dt, 0.0);
    for t in &temps {
        c.release(t);
    }
    one(out?)
}

/// Whether gelu's `approximate` argument (at `i`, or by keyword) is `'tanh'`.
fn gelu_tanh(env: &Env<'_, CudaTensor>, i: usize) -> Result<bool, String> {
    match env.arg_or_kw(i, "approximate") {
        None | Some(Arg::None) => Ok(false),
        Some(Arg::Str(s)) if s == "none" => Ok(false),
        Some(Arg::Str(s)) if s == "tanh" => Ok(true),
        Some(a) => Err(format!(
            "gelu: approximate={a:?} is neither 'none' nor 'tanh'"
        )),
    }
}

/// `threshold_backward(grad, x, threshold)`: the gradient where `x > threshold`, else 0.
fn threshold_backward(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
) -> Result<Value<CudaTensor>, String> {
    let (g, x) = (tensor(env, 0)?, tensor(env, 1)?);
    let th = number(env.arg(2)?).ok_or("threshold is not a number")?;
    one(c.ew("threshold_backward", &[g, x], out_dtype(env, g.dtype), th)?)
}

fn pow_scalar(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let p = number(env.arg(1)?).ok_or("pow exponent is not a number")?;
    one(c.ew("pow_scalar", &[x], out_dtype(env, x.dtype), p)?)
}

fn to_copy(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let dt = match env.arg_or_kw(1, "dtype") {
        Some(Arg::Dtype(d)) => *d,
        _ => out_dtype(env, x.dtype),
    };
    one(c.ew("copy", &[x], dt, 0.0)?)
}

/// The target shape of a view (one `-1` inferred).
pub(crate) fn view_shape(numel: usize, spec: &[i64]) -> Result<Vec<usize>, String> {
    let known: i64 = spec.iter().filter(|&&d| d != -1).product();
    spec.iter()
        .map(|&d| match d {
            -1 if known > 0 => Ok(numel / known as usize),
            d if d >= 0 => Ok(d as usize),
            _ => Err(format!("bad view shape {spec:?}")),
        })
        .collect()
}

fn view(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let shape = view_shape(x.numel(), &ints(env.arg(1)?)?)?;
    if shape.iter().product::<usize>() != x.numel() {
        return Err(format!("cannot view {:?} as {shape:?}", x.shape));
    }
    if x.is_contiguous() {
        return one(x.restride(shape.clone(), contiguous_strides(&shape), 0));
    }
    // A strided input: a contiguous copy (`reshape`'s semantics; an exported `view` of a
    // non-contiguous tensor is a reshape torch proved copy-free, the values are the same).
    let copy = c.ew("copy", &[x], x.dtype, 0.0)?;
    one(copy.restride(shape.clone(), contiguous_strides(&shape), 0))
}

/// Whether the node's output shares its first argument's storage: `meta.aliases` when the
/// exporter recorded it, else aten's table of view ops (the alias analysis's rule).
fn aliases_input(env: &Env<'_, CudaTensor>) -> bool {
    let n = env.node();
    match &n.meta.aliases {
        Some(idx) => !idx.is_empty(),
        None => zerosched_ir::aten::is_view(&n.target),
    }
}

/// Runs a view op `k` and makes its result agree with the storage class the executor gives
/// the node: a node that aliases its input returns views (a copy `k` had to make, a reshape of
/// a strided tensor, is freed with the viewed block); one that does not (an exported
/// `_unsafe_view` is its own allocation) returns storage of its own.
fn viewing(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    k: Kernel,
) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let alias = aliases_input(env);
    let own = |c: &mut Cuda, t: CudaTensor| -> Result<CudaTensor, String> {
        if t.block == x.block {
            if alias {
                return Ok(t);
            }
            return c.ew("copy", &[&t], t.dtype, 0.0);
        }
        if alias {
            c.owners.derive(x.block, t.block);
        }
        Ok(t)
    };
    Ok(match k(c, env)? {
        Value::Tensor(t) => Value::Tensor(own(c, t)?),
        Value::List(ts) => Value::List(
            ts.into_iter()
                .map(|t| t.map(|t| own(c, t)).transpose())
                .collect::<Result<_, _>>()?,
        ),
        v => v,
    })
}

fn select(_: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let d = norm_dim(int(env.arg(1)?)?, x.shape.len())?;
    one(regions::select_view(x, d, int(env.arg(2)?)?)?)
}

/// `split` (equal chunks of a size, the last smaller) or `split_with_sizes`: views.
fn split(
    _: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    sizes: bool,
) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let d = norm_dim(
        env.arg_or_kw(2, "dim").map(int).transpose()?.unwrap_or(0),
        x.shape.len(),
    )?;
    let n = x.shape[d];
    let parts: Vec<usize> = if sizes {
        ints(env.arg(1)?)?
            .into_iter()
            .map(|v| v.max(0) as usize)
            .collect()
    } else {
        let each = usize::try_from(int(env.arg(1)?)?)
            .ok()
            .filter(|&e| e > 0)
            .ok_or("split size must be positive")?;
        (0..n.div_ceil(each).max(1))
            .map(|i| each.min(n - (i * each).min(n)))
            .collect()
    };
    if parts.iter().sum::<usize>() != n {
        return Err(format!("split sizes {parts:?} of a dimension of {n}"));
    }
    let mut at = 0i64;
    let mut out = vec![];
    for p in parts {
        let mut shape = x.shape.clone();
        shape[d] = p;
        out.push(Some(x.restride(
            shape,
            x.strides.clone(),
            x.offset + at * x.strides[d],
        )));
        at += p as i64;
    }
    Ok(Value::List(out))
}

fn unsqueeze(_: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let d = norm_dim(int(env.arg(1)?)?, x.shape.len() + 1)?;
    let (mut shape, mut strides) = (x.shape.clone(), x.strides.clone());
    let st = if d < x.shape.len() {
        strides[d] * shape[d] as i64
    } else {
        1
    };
    shape.insert(d, 1);
    strides.insert(d, st);
    one(x.restride(shape, strides, x.offset))
}

fn squeeze(_: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let dims: Vec<usize> = match env.arg_or_kw(1, "dim") {
        Some(a) => ints(a)?
            .into_iter()
            .map(|d| norm_dim(d, x.shape.len()))
            .collect::<Result<_, _>>()?,
        None => (0..x.shape.len()).collect(),
    };
    let keep: Vec<usize> = (0..x.shape.len())
        .filter(|d| !(dims.contains(d) && x.shape[*d] == 1))
        .collect();
    one(x.restride(
        keep.iter().map(|&d| x.shape[d]).collect(),
        keep.iter().map(|&d| x.strides[d]).collect(),
        x.offset,
    ))
}

fn permute(_: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let dims: Vec<usize> = ints(env.arg(1)?)?
        .into_iter()
        .map(|d| norm_dim(d, x.shape.len()))
        .collect::<Result<_, _>>()?;
    if dims.len() != x.shape.len() {
        return Err(format!(
            "permutation {dims:?} of a {}-d tensor",
            x.shape.len()
        ));
    }
    one(x.restride(
        dims.iter().map(|&d| x.shape[d]).collect(),
        dims.iter().map(|&d| x.strides[d]).collect(),
        x.offset,
    ))
}

fn transpose_dims(
    _: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    fixed: Option<(i64, i64)>,
) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    if x.shape.len() < 2 && fixed.is_some() {
        return one(x.clone());
    }
    let (a, b) = match fixed {
        Some(p) => p,
        None => (int(env.arg(1)?)?, int(env.arg(2)?)?),
    };
    let (a, b) = (norm_dim(a, x.shape.len())?, norm_dim(b, x.shape.len())?);
    let (mut shape, mut strides) = (x.shape.clone(), x.strides.clone());
    shape.swap(a, b);
    strides.swap(a, b);
    one(x.restride(shape, strides, x.offset))
}

fn expand(_: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let spec = ints(env.arg(1)?)?;
    if spec.len() < x.shape.len() {
        return Err(format!("cannot expand {:?} to {spec:?}", x.shape));
    }
    let lead = spec.len() - x.shape.len();
    let mut shape = vec![];
    let mut strides = vec![];
    for (i, &s) in spec.iter().enumerate() {
        let (n, st) = if i < lead {
            (1, 0)
        } else {
            (x.shape[i - lead], x.strides[i - lead])
        };
        let target = if s == -1 { n } else { s as usize };
        match (n, target) {
            (n, t) if n == t => {
                shape.push(n);
                strides.push(st);
            }
            (1, t) => {
                shape.push(t);
                strides.push(0);
            }
            _ => return Err(format!("cannot expand {:?} to {spec:?}", x.shape)),
        }
    }
    one(x.restride(shape, strides, x.offset))
}

fn slice(_: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let d = norm_dim(
        env.arg_or_kw(1, "dim").map(int).transpose()?.unwrap_or(0),
        x.shape.len(),
    )?;
    let start = regions::opt_int(env.arg_or_kw(2, "start"))?;
    let end = regions::opt_int(env.arg_or_kw(3, "end"))?;
    let step = env.arg_or_kw(4, "step").map(int).transpose()?.unwrap_or(1);
    one(regions::slice_view(x, d, start, end, step)?)
}

fn cat(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let Arg::List(items) = env.arg(0)? else {
        return Err("cat of something that is not a list".into());
    };
    let ts: Vec<&CudaTensor> = items
        .iter()
        .map(|a| env.tensor(a))
        .collect::<Result<_, _>>()?;
    // torch skips 1-d empty tensors in a cat.
    let ts: Vec<&CudaTensor> = ts
        .into_iter()
        .filter(|t| !(t.shape.len() == 1 && t.shape[0] == 0))
        .collect();
    let first = ts.first().ok_or("cat of no tensors")?;
    let d = norm_dim(
        env.arg_or_kw(1, "dim").map(int).transpose()?.unwrap_or(0),
        first.shape.len(),
    )?;
    let total: usize = ts.iter().map(|t| t.shape[d]).sum();
    let mut shape = first.shape.clone();
    shape[d] = total;
    let dt = out_dtype(env, first.dtype);
    let out = c.empty(dt, &shape)?;
    let e = elem(dt)?;
    let outer: usize = shape[..d].iter().product();
    let inner: usize = shape[d + 1..].iter().product();
    let mut at = 0;
    for t in ts {
        let src = if t.is_contiguous() && t.dtype == dt {
            t.clone()
        } else {
            c.ew("copy", &[t], dt, 0.0)?
        };
        c.k.cat(
            out.block.ptr,
            src.block.ptr,
            e,
            outer,
            t.shape[d],
            inner,
            total,
            at,
        )
        .map_err(|e| e.to_string())?;
        if src.block != t.block {
            c.release(&src);
        }
        at += t.shape[d];
    }
    one(out)
}

/// Moves `dims` of `x` to the end, as a contiguous copy when that is not already its layout:
/// returns the tensor (released by the caller when `true`), the kept sizes and the reduced size.
pub(crate) fn gather_dims_last(
    c: &mut Cuda,
    x: &CudaTensor,
    dims: &[usize],
) -> Result<(CudaTensor, bool, Vec<usize>, usize), String> {
    let keep: Vec<usize> = (0..x.shape.len()).filter(|d| !dims.contains(d)).collect();
    let order: Vec<usize> = keep.iter().chain(dims).copied().collect();
    let moved = x.restride(
        order.iter().map(|&d| x.shape[d]).collect(),
        order.iter().map(|&d| x.strides[d]).collect(),
        x.offset,
    );
    let (t, temp) = c.contiguous(&moved)?;
    let r = dims.iter().map(|&d| x.shape[d]).product();
    Ok((t, temp, keep.iter().map(|&d| x.shape[d]).collect(), r))
}

fn reduce(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    op: Reduce,
) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let rank = x.shape.len();
    let dims: Vec<usize> = match env.arg_or_kw(1, "dim") {
        Some(Arg::None) | None => (0..rank).collect(),
        Some(Arg::List(l)) if l.is_empty() => (0..rank).collect(),
        Some(a) => ints(a)?
            .into_iter()
            .map(|d| norm_dim(d, rank))
            .collect::<Result<_, _>>()?,
    };
    let keepdim = matches!(env.arg_or_kw(2, "keepdim"), Some(Arg::Bool(true)));
    let dt = out_dtype(env, x.dtype);
    one(reduce_dims(c, x, &dims, keepdim, op, dt)?)
}

/// `op` of `x` over `dims` into a new tensor of `dt` (the reduced dimensions kept as size 1
/// with `keepdim`).
pub(crate) fn reduce_dims(
    c: &mut Cuda,
    x: &CudaTensor,
    dims: &[usize],
    keepdim: bool,
    op: Reduce,
    dt: Dtype,
) -> Result<CudaTensor, String> {
    let rank = x.shape.len();
    let (t, temp, kept, r) = gather_dims_last(c, x, dims)?;
    let outer: usize = kept.iter().product();
    let shape: Vec<usize> = if keepdim {
        (0..rank)
            .map(|d| if dims.contains(&d) { 1 } else { x.shape[d] })
            .collect()
    } else {
        kept
    };
    let out = c.empty(dt, &shape)?;
    let res =
        c.k.reduce(
            op,
            t.block.ptr,
            t.elem()?,
            out.block.ptr,
            elem(dt)?,
            outer,
            r,
            1,
        )
        .map_err(|e| e.to_string());
    if temp {
        c.release(&t);
    }
    if let Err(e) = res {
        c.release(&out);
        return Err(e);
    }
    Ok(out)
}

fn softmax(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    mode: Softmax,
) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let d = norm_dim(int(env.arg(1)?)?, x.shape.len())?;
    let dt = out_dtype(env, x.dtype);
    one(softmax_dim(c, x, d, dt, mode)?)
}

/// A softmax-family op of `x` along `d`, in `dt`.
pub(crate) fn softmax_dim(
    c: &mut Cuda,
    x: &CudaTensor,
    d: usize,
    dt: Dtype,
    mode: Softmax,
) -> Result<CudaTensor, String> {
    let rank = x.shape.len();
    let src = if dt == x.dtype {
        x.clone()
    } else {
        c.ew("copy", &[x], dt, 0.0)?
    };
    let (t, temp, kept, cols) = gather_dims_last(c, &src, &[d])?;
    let rows: usize = kept.iter().product();
    let out = c.empty(dt, &t.shape)?;
    let res =
        c.k.softmax(t.block.ptr, out.block.ptr, elem(dt)?, rows, cols, mode, 0)
            .map_err(|e| e.to_string());
    if temp {
        c.release(&t);
    }
    if src.block != x.block {
        c.release(&src);
    }
    res?;
    if d + 1 == rank.max(1) {
        return Ok(out);
    }
    // Back to the input's dimension order: the moved axis returns to `d`.
    let mut order: Vec<usize> = (0..rank - 1).collect();
    order.insert(d, rank - 1);
    let back = out.restride(
        order.iter().map(|&i| out.shape[i]).collect(),
        order.iter().map(|&i| out.strides[i]).collect(),
        0,
    );
    let result = c.ew("copy", &[&back], dt, 0.0);
    c.release(&out);
    result
}

fn matmul(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
    batched: bool,
) -> Result<Value<CudaTensor>, String> {
    let (a, b) = (tensor(env, 0)?, tensor(env, 1)?);
    let want = if batched { 3 } else { 2 };
    if a.shape.len() != want || b.shape.len() != want {
        return Err(format!(
            "{}-d product of {:?} and {:?}",
            want, a.shape, b.shape
        ));
    }
    let dt = out_dtype(env, a.dtype);
    one(product(c, a, b, dt)?)
}

/// `a · b` of two 2-d or two 3-d (batched) tensors into a new tensor of `dt`.
pub(crate) fn product(
    c: &mut Cuda,
    a: &CudaTensor,
    b: &CudaTensor,
    dt: Dtype,
) -> Result<CudaTensor, String> {
    product_scaled(c, a, b, dt, 1.0, Math::Exact)
}

/// `alpha · a · b` in `dt`, an f32 product multiplied as `math` says.
pub(crate) fn product_scaled(
    c: &mut Cuda,
    a: &CudaTensor,
    b: &CudaTensor,
    dt: Dtype,
    alpha: f32,
    math: Math,
) -> Result<CudaTensor, String> {
    let n = a.shape.len();
    if !(2..=3).contains(&n) || b.shape.len() != n {
        return Err(format!("product of {:?} and {:?}", a.shape, b.shape));
    }
    let batched = n == 3;
    // A matrix stored transposed (strides [.., 1, rows]) is read transposed in place; any
    // other layout is copied contiguous first.
    let operand = |c: &mut Cuda, t: &CudaTensor| -> Result<(CudaTensor, bool, bool), String> {
        let (r, k) = (t.shape[n - 2], t.shape[n - 1]);
        if t.dtype == dt && t.offset == 0 && (n == 2 || t.strides[0] == (r * k) as i64) {
            if t.strides[n - 1] == 1 && t.strides[n - 2] == k as i64 {
                return Ok((t.clone(), false, false));
            }
            if t.strides[n - 2] == 1 && t.strides[n - 1] == r as i64 {
                return Ok((t.clone(), true, false));
            }
        }
        Ok((c.ew("copy", &[t], dt, 0.0)?, false, true))
    };
    let (m, k, nn) = (a.shape[n - 2], a.shape[n - 1], b.shape[n - 1]);
    if b.shape[n - 2] != k || (batched && a.shape[0] != b.shape[0]) {
        return Err(format!("product of {:?} and {:?}", a.shape, b.shape));
    }
    let (ta, trans_a, temp_a) = operand(c, a)?;
    let (tb, trans_b, temp_b) = operand(c, b)?;
    let batch = if batched { a.shape[0] } else { 1 };
    let mut shape = vec![m, nn];
    if batched {
        shape.insert(0, batch);
    }
    let res = c.empty(dt, &shape).and_then(|out| {
        let g = Gemm {
            m,
            n: nn,
            k,
            batch,
            trans_a,
            trans_b,
            stride_a: m * k,
            stride_b: k * nn,
            elem: elem(dt)?,
        };
        match c
            .blas
            .gemm_scaled(&g, alpha, math, ta.block.ptr, tb.block.ptr, out.block.ptr)
        {
            Ok(()) => Ok(out),
            Err(e) => {
                c.release(&out);
                Err(e.to_string())
            }
        }
    });
    if temp_a {
        c.release(&ta);
    }
    if temp_b {
        c.release(&tb);
    }
    res
}

/// Reads the out-of-range flag of an indexing kernel (a host synchronisation: indices come
/// from data, and a bad one must fail the node, not later ones).
pub(crate) fn checked_flag(c: &mut Cuda, bad: &CudaTensor, what: &str) -> Result<(), String> {
    let mut flag = [0u8; 4];
    let r = c
        .dev
        .download(StreamKind::Compute, bad.block.ptr, &mut flag)
        .map_err(|e| e.to_string());
    c.release(bad);
    r?;
    if flag != [0; 4] {
        return Err(format!("{what}: an index is out of range"));
    }
    Ok(())
}

pub(crate) fn flag(c: &mut Cuda) -> Result<CudaTensor, String> {
    let bad = c.empty(Dtype::Int32, &[1])?;
    c.dev
        .zero(StreamKind::Compute, bad.block.ptr, 4)
        .map_err(|e| e.to_string())?;
    Ok(bad)
}

fn embedding(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let (w, idx) = (tensor(env, 0)?, tensor(env, 1)?);
    if w.shape.len() != 2 {
        return Err(format!("embedding table of shape {:?}", w.shape));
    }
    let (wc, tw) = c.contiguous(w)?;
    let (ic, ti) = c.contiguous(idx)?;
    let mut shape = idx.shape.clone();
    shape.push(w.shape[1]);
    let out = c.empty(w.dtype, &shape)?;
    let bad = flag(c)?;
    let res =
        c.k.index_select(
            out.block.ptr,
            wc.block.ptr,
            ic.block.ptr,
            wc.elem()?,
            ic.elem()?,
            [1, w.shape[0], idx.numel(), w.shape[1]],
            bad.block.ptr,
        )
        .map_err(|e| e.to_string());
    for (t, temp) in [(&wc, tw), (&ic, ti)] {
        if temp {
            c.release(t);
        }
    }
    res?;
    checked_flag(c, &bad, "embedding")?;
    one(out)
}

fn gather(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let x = tensor(env, 0)?;
    let d = norm_dim(int(env.arg(1)?)?, x.shape.len())?;
    let idx = tensor(env, 2)?;
    if idx.shape.len() != x.shape.len()
        || (0..x.shape.len()).any(|i| i != d && idx.shape[i] != x.shape[i])
    {
        return Err(format!(
            "gather of {:?} with indices {:?} (only the gathered dimension may differ)",
            x.shape, idx.shape
        ));
    }
    let (xc, tx) = c.contiguous(x)?;
    let (ic, ti) = c.contiguous(idx)?;
    let out = c.empty(x.dtype, &idx.shape)?;
    let bad = flag(c)?;
    let outer: usize = x.shape[..d].iter().product();
    let inner: usize = x.shape[d + 1..].iter().product();
    let res =
        c.k.gather(
            out.block.ptr,
            xc.block.ptr,
            ic.block.ptr,
            xc.elem()?,
            ic.elem()?,
            [outer, x.shape[d], idx.shape[d], inner],
            bad.block.ptr,
        )
        .map_err(|e| e.to_string());
    for (t, temp) in [(&xc, tx), (&ic, ti)] {
        if temp {
            c.release(t);
        }
    }
    res?;
    checked_flag(c, &bad, "gather")?;
    one(out)
}

fn getitem(_: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let src = *env.arg(0)?.as_node().ok_or("getitem of a literal")?;
    let k = usize::try_from(int(env.arg(1)?)?).map_err(|_| "negative index")?;
    match env.value(src)? {
        Value::List(items) => Ok(items
            .get(k)
            .cloned()
            .flatten()
            .map_or(Value::None, Value::Tensor)),
        _ => Err("getitem of a value that is not a list".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_broadcast_numpy_style() {
        let s = [&[4usize, 1, 3][..], &[5, 1][..], &[]];
        assert_eq!(broadcast_shape(s.into_iter()).unwrap(), vec![4, 5, 3]);
        let e = broadcast_shape([&[2usize][..], &[3][..]].into_iter()).unwrap_err();
        assert!(e.contains("do not broadcast"), "{e}");
    }

    #[test]
    fn view_shapes_infer_one_dimension() {
        assert_eq!(view_shape(24, &[2, -1, 3]).unwrap(), vec![2, 4, 3]);
        assert!(view_shape(24, &[-2, 12]).is_err());
    }

    #[test]
    fn the_backend_resolves_its_ops_and_refuses_others() {
        assert!(resolve("aten.mm.default").is_some());
        assert!(resolve("aten.native_layer_norm.default").is_some());
        assert!(resolve("aten.tril.default").is_none(), "no fixture uses it");
    }
}
