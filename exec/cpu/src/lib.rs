//! The CPU reference backend: every aten op of the fixtures (docs/export.md), in f32 and
//! f64 (bf16/f16 computed in f32 and rounded once per op: see [`zerosched_exec::host`]), over ndarray
//! with matrixmultiply's GEMM. One file per op family; [`kernel`] is the dispatch table (a new op
//! is one match arm), which plans resolve each node through once ([`Backend::resolve`]), so
//! that a graph with an op it lacks is refused, naming op and node, before anything runs.

// `deny`, not `forbid`: ndarray's `s!` macro expands to an `allow(unsafe_code)` of its own.
#![deny(unsafe_code)]

mod activation;
mod channel_norm;
mod clamp;
mod conv;
mod create;
mod elementwise;
mod factories;
mod index;
mod linalg;
mod logical;
mod loss;
mod masks;
mod math;
mod nn;
mod norm;
mod pointwise_loss;
mod pool;
mod random;
mod real;
mod reduce;
mod scatter;
mod shape;
mod softmax;
mod stats;
#[cfg(test)]
mod testkit;

use ndarray::{ArrayD, IxDyn};
use zerosched_exec::host::{self, Data, Tensor, map_data};
use zerosched_exec::{Backend, BackendError, Env, Local, NodeError, Value};
use zerosched_ir::{Arg, Dtype, NodeId, TensorMeta, Val};

/// A CPU kernel: the node's value from its arguments' values.
pub type Kernel = fn(&Env<'_, Tensor>) -> Result<Value<Tensor>, String>;

/// The kernel of an aten target, if the backend has one.
pub fn kernel(target: &str) -> Option<Kernel> {
    use elementwise as e;
    Some(match target {
        "aten.add.Tensor" | "aten.add.Scalar" => e::add,
        "aten.sub.Tensor" | "aten.sub.Scalar" => e::sub,
        "aten.mul.Tensor" | "aten.mul.Scalar" => e::mul,
        "aten.div.Tensor" | "aten.div.Scalar" => e::div,
        "aten.div.Tensor_mode" | "aten.div.Scalar_mode" => e::div_mode,
        "aten.eq.Tensor" | "aten.eq.Scalar" => e::eq,
        "aten.ne.Tensor" | "aten.ne.Scalar" => e::ne,
        "aten.le.Tensor" | "aten.le.Scalar" => e::le,
        "aten.lt.Tensor" | "aten.lt.Scalar" => e::lt,
        "aten.ge.Tensor" | "aten.ge.Scalar" => e::ge,
        "aten.gt.Tensor" | "aten.gt.Scalar" => e::gt,
        "aten.bitwise_and.Tensor" | "aten.bitwise_and.Scalar" => e::bitwise_and,
        "aten.bitwise_or.Tensor" | "aten.bitwise_or.Scalar" => e::bitwise_or,
        "aten.bitwise_xor.Tensor" | "aten.bitwise_xor.Scalar" => math::bitwise_xor,
        "aten.bitwise_not.default" => math::bitwise_not,
        "aten.acos.default" => math::acos,
        "aten.acosh.default" => math::acosh,
        "aten.asin.default" => math::asin,
        "aten.asinh.default" => math::asinh,
        "aten.atan.default" => math::atan,
        "aten.atanh.default" => math::atanh,
        "aten.cosh.default" => math::cosh,
        "aten.sinh.default" => math::sinh,
        "aten.tan.default" => math::tan,
        "aten.expm1.default" => math::expm1,
        "aten.log1p.default" => math::log1p,
        "aten.log10.default" => math::log10,
        "aten.log2.default" => math::log2,
        "aten.ceil.default" => math::ceil,
        "aten.floor.default" => math::floor,
        "aten.round.default" => math::round,
        "aten.trunc.default" => math::trunc,
        "aten.sign.default" => math::sign,
        "aten.isnan.default" => math::isnan,
        "aten.isinf.default" => math::isinf,
        "aten.atan2.default" => math::atan2,
        "aten.fmod.Tensor" | "aten.fmod.Scalar" => math::fmod,
        "aten.remainder.Tensor" | "aten.remainder.Scalar" => math::remainder,
        "aten.amax.default" | "aten.max.default" => stats::amax,
        "aten.amin.default" | "aten.min.default" => stats::amin,
        "aten.max.dim" => stats::max_dim,
        "aten.min.dim" => stats::min_dim,
        "aten.prod.default" | "aten.prod.dim_int" => stats::prod,
        "aten.var.correction" | "aten.var.dim" | "aten.std.correction" => stats::var,
        "aten.linalg_vector_norm.default" => stats::vector_norm,
        "aten.stack.default" => shape::stack,
        "aten.unbind.int" => shape::unbind,
        "aten.roll.default" => shape::roll,
        "aten.baddbmm.default" => linalg::baddbmm,
        "aten.index_add.default" => index::index_add,
        "aten.flip.default" => shape::flip,
        "aten.diagonal.default" => shape::diagonal,
        "aten.scatter_reduce.two" => index::scatter_reduce,
        "aten.randperm.default" => random::randperm,
        "aten.repeat.default" => shape::repeat,
        "aten.where.self" => e::where_,
        "aten.neg.default" => e::neg,
        "aten.exp.default" => e::exp,
        "aten.cos.default" => e::cos,
        "aten.sin.default" => e::sin,
        "aten.rsqrt.default" => e::rsqrt,
        "aten.sqrt.default" => e::sqrt,
        "aten.sigmoid.default" => e::sigmoid,
        "aten.tanh.default" => e::tanh,
        "aten.reciprocal.default" => e::reciprocal,
        "aten.log.default" => e::log,
        "aten.pow.Tensor_Scalar" => e::pow_scalar,
        "aten.pow.Tensor_Tensor" | "aten.pow.Scalar" => e::pow_tensor,
        "aten._to_copy.default" | "prims.convert_element_type.default" => e::to_copy,
        "aten.clone.default" | "aten.alias.default" => e::clone,
        "aten.view.default" | "aten._unsafe_view.default" | "aten.reshape.default" => shape::view,
        "aten.unsqueeze.default" => shape::unsqueeze,
        "aten.squeeze.dims" | "aten.squeeze.dim" | "aten.squeeze.default" => shape::squeeze,
        "aten.permute.default" => shape::permute,
        "aten.t.default" => shape::t,
        "aten.transpose.int" => shape::transpose,
        "aten.expand.default" => shape::expand,
        "aten.slice.Tensor" => shape::slice,
        "aten.cat.default" => shape::cat,
        "aten.split_with_sizes.default" => shape::split_with_sizes,
        "aten.split.Tensor" => shape::split,
        "aten.constant_pad_nd.default" => shape::constant_pad_nd,
        "aten.slice_scatter.default" => scatter::slice_scatter,
        "aten.sum.dim_IntList" | "aten.sum.default" => reduce::sum,
        "aten.mean.dim" | "aten.mean.default" => reduce::mean,
        "aten.cumsum.default" => reduce::cumsum,
        "aten._softmax.default" => reduce::softmax,
        "aten._log_softmax.default" => reduce::log_softmax,
        "aten.topk.default" => reduce::topk,
        "aten.sort.default" | "aten.sort.stable" => reduce::sort,
        "aten.histc.default" => reduce::histc,
        "aten.native_layer_norm.default" => nn::layer_norm,
        "aten.layer_norm.default" => nn::layer_norm_output,
        "aten._scaled_dot_product_flash_attention_for_cpu.default"
        | "aten._scaled_dot_product_flash_attention.default"
        | "aten._scaled_dot_product_efficient_attention.default"
        | "aten._scaled_dot_product_cudnn_attention.default" => nn::sdpa,
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
        | "aten._scaled_dot_product_flash_attention_backward.default"
        | "aten._scaled_dot_product_efficient_attention_backward.default"
        | "aten._scaled_dot_product_cudnn_attention_backward.default" => nn::sdpa_backward,
        "aten.mm.default" => linalg::mm,
        "aten.bmm.default" => linalg::bmm,
        "aten.addmm.default" => linalg::addmm,
        "aten._grouped_mm.default" => linalg::grouped_mm,
        "aten.embedding.default" => index::embedding,
        "aten.index.Tensor" | "aten._unsafe_index.Tensor" => index::index,
        "aten.index_put.default" | "aten._unsafe_index_put.default" => index::index_put,
        "aten.gather.default" => index::gather,
        "aten.scatter.value"
        | "aten.scatter.src"
        | "aten.scatter.reduce"
        | "aten.scatter.value_reduce" => index::scatter,
        "aten.scatter_add.default" => index::scatter_add,
        "aten.index_select.default" => index::index_select,
        "aten.cumprod.default" => reduce::cumprod,
        "aten.argmax.default" => reduce::argmax,
        "aten.argmin.default" => reduce::argmin,
        "aten.clamp.default" | "aten.clamp.Tensor" => clamp::clamp,
        "aten.clamp_min.default" | "aten.clamp_min.Tensor" => clamp::clamp_min,
        "aten.clamp_max.default" | "aten.clamp_max.Tensor" => clamp::clamp_max,
        "aten.hardtanh.default" => clamp::hardtanh,
        "aten.hardtanh_backward.default" => activation::hardtanh_backward,
        "aten.hardswish.default" => activation::hardswish,
        "aten.hardswish_backward.default" => activation::hardswish_backward,
        "aten.softplus.default" => activation::softplus,
        "aten.softplus_backward.default" => activation::softplus_backward,
        "aten.leaky_relu.default" => activation::leaky_relu,
        "aten.leaky_relu_backward.default" => activation::leaky_relu_backward,
        "aten.elu.default" => activation::elu,
        "aten.elu_backward.default" => activation::elu_backward,
        "aten.sigmoid_backward.default" => activation::sigmoid_backward,
        "aten.tanh_backward.default" => activation::tanh_backward,
        "aten.logical_and.default" => logical::logical_and,
        "aten.logical_or.default" => logical::logical_or,
        "aten.logical_xor.default" => logical::logical_xor,
        "aten._assert_async.default" | "aten._assert_async.msg" => logical::assert_async,
        "aten.mse_loss.default" => pointwise_loss::mse_loss,
        "aten.mse_loss_backward.default" => pointwise_loss::mse_loss_backward,
        "aten.smooth_l1_loss.default" => pointwise_loss::smooth_l1_loss,
        "aten.smooth_l1_loss_backward.default" => pointwise_loss::smooth_l1_loss_backward,
        "aten.binary_cross_entropy_with_logits.default" => {
            pointwise_loss::binary_cross_entropy_with_logits
        }
        "aten.max_pool2d_with_indices.default" => pool::max_pool2d,
        "aten.max_pool2d_with_indices_backward.default" => pool::max_pool2d_backward,
        "aten.avg_pool2d.default" => pool::avg_pool2d,
        "aten.avg_pool2d_backward.default" => pool::avg_pool2d_backward,
        "aten._adaptive_avg_pool2d.default" => pool::adaptive_avg_pool2d,
        "aten._adaptive_avg_pool2d_backward.default" => pool::adaptive_avg_pool2d_backward,
        "aten.native_batch_norm.default"
        | "aten._native_batch_norm_legit.default"
        | "aten._native_batch_norm_legit.no_stats"
        | "aten._native_batch_norm_legit_no_training.default"
        | "aten._native_batch_norm_legit_functional.default" => channel_norm::batch_norm,
        "aten.native_batch_norm_backward.default" => channel_norm::batch_norm_backward,
        "aten.native_group_norm.default" => channel_norm::group_norm,
        "aten.native_group_norm_backward.default" => channel_norm::group_norm_backward,
        "aten.native_dropout.default" => random::native_dropout,
        "aten.native_dropout_backward.default" => random::native_dropout_backward,
        "aten.rand.default" | "aten.rand_like.default" => random::rand,
        "aten.randn.default" | "aten.randn_like.default" => random::randn,
        "aten.randint.default"
        | "aten.randint.low"
        | "aten.randint_like.default"
        | "aten.randint_like.low_dtype" => random::randint,
        "aten.bernoulli.default" | "aten.bernoulli.p" | "aten.bernoulli.Tensor" => {
            random::bernoulli
        }
        "aten.full.default" => create::full,
        "aten.full_like.default" => create::full_like,
        "aten.scalar_tensor.default" => create::scalar_tensor,
        "aten.arange.start_step" | "aten.arange.start" | "aten.arange.default" => create::arange,
        "aten.empty_permuted.default"
        | "aten.empty.memory_format"
        | "aten.empty_strided.default" => create::empty,
        "aten.detach.default" | "aten.lift_fresh_copy.default" => e::clone,
        "aten.relu.default" => activation::relu,
        "aten.threshold_backward.default" => activation::threshold_backward,
        "aten.gelu.default" => activation::gelu,
        "aten.gelu_backward.default" => activation::gelu_backward,
        "aten.silu.default" => activation::silu,
        "aten.silu_backward.default" => activation::silu_backward,
        "aten.erf.default" => activation::erf,
        "aten.abs.default" => activation::abs,
        "aten.minimum.default" => activation::minimum,
        "aten.maximum.default" => activation::maximum,
        "aten.logical_not.default" => logical::logical_not,
        "aten.any.dim" | "aten.any.dims" | "aten.any.default" => logical::any,
        "aten._safe_softmax.default" => softmax::safe_softmax,
        "aten._softmax_backward_data.default" => softmax::softmax_backward,
        "aten._log_softmax_backward_data.default" => softmax::log_softmax_backward,
        "aten.nll_loss_forward.default" => loss::nll_loss_forward,
        "aten.nll_loss_backward.default" => loss::nll_loss_backward,
        "aten.native_layer_norm_backward.default" => norm::layer_norm_backward,
        "aten.select.int" => scatter::select,
        "aten.select_backward.default" => scatter::select_backward,
        "aten.slice_backward.default" => scatter::slice_backward,
        "aten.select_scatter.default" => scatter::select_scatter,
        "aten.copy.default" => scatter::copy,
        "aten.fill.Scalar" | "aten.fill.Tensor" => scatter::fill,
        "aten.masked_fill.Scalar" | "aten.masked_fill.Tensor" => scatter::masked_fill,
        "aten.embedding_dense_backward.default" => scatter::embedding_dense_backward,
        "aten.zeros.default" => factories::zeros,
        "aten.ones.default" => factories::ones,
        "aten.zeros_like.default" | "aten.empty_like.default" => factories::zeros_like,
        "aten.ones_like.default" => factories::ones_like,
        "aten.new_zeros.default" => factories::new_zeros,
        "aten.new_ones.default" => factories::new_ones,
        "aten.new_full.default" => factories::new_full,
        "aten.convolution.default" => conv::convolution,
        "aten.convolution_backward.default" => conv::convolution_backward,
        "aten.tril.default" => masks::tril,
        "aten.triu.default" => masks::triu,
        "operator.getitem" => getitem,
        _ => return None,
    })
}

/// The CPU backend: one per rank, holding nothing (its tensors are reference-counted host
/// arrays, freed when their last handle drops).
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

fn kernel_err(m: String) -> BackendError {
    BackendError::Kernel(m)
}

/// Bytes of the node's recorded outputs.
fn out_bytes(env: &Env<'_, Tensor>) -> u64 {
    let bytes = |m: &TensorMeta| m.numel().unwrap_or(0).saturating_mul(m.dtype.size());
    match &env.node().meta.val {
        Some(Val::Tensor(t)) => bytes(t),
        Some(Val::Tuple(ts)) => ts.iter().flatten().map(|t| bytes(t)).sum(),
        _ => 0,
    }
}

impl Backend for Cpu {
    type Tensor = Tensor;
    type Kernel = Kernel;
    const NAME: &'static str = "cpu";

    fn resolve(target: &str) -> Option<Kernel> {
        kernel(target)
    }

    fn compute(
        &mut self,
        k: &Kernel,
        env: &Env<'_, Tensor>,
    ) -> Result<Value<Tensor>, BackendError> {
        // The kernels allocate through ndarray, which aborts when memory runs out: reserving
        // the output's bytes first turns that into an error naming the node.
        let bytes = out_bytes(env);
        let probe = usize::try_from(bytes).map_err(|_| BackendError::OutOfMemory { bytes })?;
        Vec::<u8>::new()
            .try_reserve_exact(probe)
            .map_err(|_| BackendError::OutOfMemory { bytes })?;
        k(env).map_err(kernel_err)
    }

    fn numel(&self, t: &Tensor) -> u64 {
        t.numel() as u64
    }

    fn dtype(&self, t: &Tensor) -> Dtype {
        t.dtype
    }

    fn input(
        &mut self,
        meta: &TensorMeta,
        make: &mut dyn FnMut() -> Result<Tensor, String>,
    ) -> Result<Tensor, NodeError> {
        let t = make().map_err(NodeError::Input)?;
        let shape = meta.hint_dims();
        if t.shape() != shape.as_slice() {
            return Err(NodeError::Input(format!(
                "input has shape {:?}, metadata {shape:?}",
                t.shape()
            )));
        }
        Ok(t.cast(meta.dtype).map_err(kernel_err)?)
    }

    fn download(&mut self, t: &Tensor) -> Result<Option<Tensor>, BackendError> {
        Ok(Some(t.clone()))
    }

    fn shard(&mut self, full: &Tensor, world: u32, rank: u32) -> Result<Tensor, BackendError> {
        let world = world.max(1) as usize;
        let per = full.numel().div_ceil(world);
        let lo = (rank as usize * per).min(full.numel());
        let hi = (lo + per).min(full.numel());
        let pad = per - (hi - lo);
        Ok(map_data!(full, a => {
            let flat: Vec<_> = a.iter().cloned().collect();
            let mut v = flat[lo..hi].to_vec();
            v.extend(std::iter::repeat_n(zero_like(&flat), pad));
            ArrayD::from_shape_vec(IxDyn(&[per]), v).map_err(|e| kernel_err(e.to_string()))?.into_shared()
        }))
    }

    fn unflatten(&mut self, flat: &Tensor, shape: &[usize]) -> Result<Tensor, BackendError> {
        let n: usize = shape.iter().product();
        if n > flat.numel() {
            return Err(kernel_err(format!(
                "a buffer of {} elements cannot hold {shape:?}",
                flat.numel()
            )));
        }
        let t = map_data!(flat, a => {
            let v: Vec<_> = a.iter().take(n).cloned().collect();
            ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| kernel_err(e.to_string()))?.into_shared()
        });
        Ok(t)
    }

    fn free(&mut self, t: Tensor) {
        drop(t);
    }
}

impl Local for Cpu {
    fn concat(&mut self, shards: &[&Tensor], dtype: Option<Dtype>) -> Result<Tensor, BackendError> {
        let first = shards
            .first()
            .ok_or_else(|| kernel_err("no ranks".into()))?;
        let dtype = dtype.unwrap_or(first.dtype);
        let cast: Vec<Tensor> = shards
            .iter()
            .map(|s| s.cast(dtype))
            .collect::<Result<_, _>>()
            .map_err(kernel_err)?;
        let n: usize = cast.iter().map(Tensor::numel).sum();
        let t = match &cast[0].data {
            Data::F32(_) => cat_flat(
                &cast,
                n,
                |t| match &t.data {
                    Data::F32(a) => Some(a),
                    _ => None,
                },
                Data::F32,
            ),
            Data::F64(_) => cat_flat(
                &cast,
                n,
                |t| match &t.data {
                    Data::F64(a) => Some(a),
                    _ => None,
                },
                Data::F64,
            ),
            Data::I64(_) => cat_flat(
                &cast,
                n,
                |t| match &t.data {
                    Data::I64(a) => Some(a),
                    _ => None,
                },
                Data::I64,
            ),
            Data::Bool(_) => cat_flat(
                &cast,
                n,
                |t| match &t.data {
                    Data::Bool(a) => Some(a),
                    _ => None,
                },
                Data::Bool,
            ),
        }
        .map_err(kernel_err)?;
        Ok(Tensor { dtype, data: t })
    }

    fn sum(&mut self, parts: &[&Tensor]) -> Result<Tensor, BackendError> {
        sum_in_rank_order(parts).map_err(kernel_err)
    }
}

/// The elementwise sum of one tensor per rank, left to right in rank order (how every
/// reduction here sums, so a reference can reproduce its bits).
pub fn sum_in_rank_order(ts: &[&Tensor]) -> Result<Tensor, String> {
    let first = *ts.first().ok_or("no ranks")?;
    let mut sum = first.clone();
    for t in &ts[1..] {
        sum = elementwise::add_tensors(&sum, t, first.dtype)?;
    }
    Ok(sum)
}

fn zero_like<T: host::Elem>(_: &[T]) -> T {
    T::elem_zero()
}

fn cat_flat<T: Clone>(
    ts: &[Tensor],
    n: usize,
    get: impl Fn(&Tensor) -> Option<&host::Arr<T>>,
    wrap: impl Fn(host::Arr<T>) -> Data,
) -> Result<Data, String> {
    let mut v = Vec::with_capacity(n);
    for t in ts {
        v.extend(get(t).ok_or("shards of different dtypes")?.iter().cloned());
    }
    Ok(wrap(
        ArrayD::from_shape_vec(IxDyn(&[n]), v)
            .map_err(|e| e.to_string())?
            .into_shared(),
    ))
}

fn getitem(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let src = *env.arg(0)?.as_node().ok_or("getitem of a literal")?;
    let k = int(env.arg(1)?)?;
    match env.value(src)? {
        Value::List(items) => {
            let k = usize::try_from(k).map_err(|_| "negative index")?;
            Ok(items
                .get(k)
                .cloned()
                .flatten()
                .map_or(Value::None, Value::Tensor))
        }
        _ => Err("getitem of a value that is not a list".into()),
    }
}

// Argument readers shared by the op families.

pub(crate) fn one(t: Tensor) -> Result<Value<Tensor>, String> {
    Ok(Value::Tensor(t))
}

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

/// A Python number literal (int, float, bool, non-finite float).
pub(crate) fn number(a: &Arg<NodeId>) -> Option<f64> {
    match a {
        Arg::Int(i) => Some(*i as f64),
        Arg::Float(x) => Some(*x),
        Arg::Bool(b) => Some(f64::from(u8::from(*b))),
        Arg::Sym(s) => Some(s.hint as f64),
        _ => None,
    }
}

pub(crate) fn flag(a: Option<&Arg<NodeId>>, default: bool) -> bool {
    match a {
        Some(Arg::Bool(b)) => *b,
        Some(Arg::Int(i)) => *i != 0,
        _ => default,
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

/// The output dtype the node records, else `fallback`.
pub(crate) fn out_dtype(env: &Env<'_, Tensor>, fallback: Dtype) -> Dtype {
    env.out_meta().map_or(fallback, |m| m.dtype)
}

pub(crate) fn out_shape(env: &Env<'_, Tensor>) -> Option<Vec<usize>> {
    env.out_meta().map(TensorMeta::hint_dims)
}
