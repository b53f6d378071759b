//! The kernel generator: CUDA C from [`source`] (elementwise kernels from the one table in
//! [`ops`]; the row kernels of [`rows`], the indexing kernels of [`index`] and the image
//! kernels of [`image`]), compiled with NVRTC the first time a (kernel, dtypes) pair is
//! launched. PTX is cached per process (every device of the process shares it) and each device
//! loads a module once; every launch goes on the rank's compute stream.

pub mod image;
pub mod index;
pub mod ops;
pub mod rows;
pub mod source;

use crate::device::{Device, StreamKind};
use crate::error::{CudaError, Result};
use crate::libs::{self, Lib};
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use source::{BLOCK, Elem, MAX_DIMS, Reduce, Softmax};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// A strided view of a device buffer, in elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    pub ptr: u64,
    pub elem: Elem,
    pub shape: Vec<usize>,
    pub strides: Vec<i64>,
    pub offset: i64,
}

impl View {
    /// A contiguous (row-major) view.
    pub fn contiguous(ptr: u64, elem: Elem, shape: &[usize]) -> View {
        View {
            ptr,
            elem,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

pub fn contiguous_strides(shape: &[usize]) -> Vec<i64> {
    let mut st = vec![0i64; shape.len()];
    let mut acc = 1i64;
    for (d, s) in shape.iter().enumerate().rev() {
        st[d] = acc;
        acc *= *s as i64;
    }
    st
}

/// The strides that read `v` broadcast to `out` (numpy rules: trailing dimensions aligned, a
/// size-1 or missing dimension repeats with stride 0).
pub fn broadcast_strides(out: &[usize], v: &View) -> std::result::Result<Vec<i64>, String> {
    if v.shape.len() > out.len() {
        return Err(format!("{:?} does not broadcast to {out:?}", v.shape));
    }
    let lead = out.len() - v.shape.len();
    let mut st = vec![0i64; out.len()];
    for (d, (&n, &s)) in v.shape.iter().zip(&v.strides).enumerate() {
        match n {
            _ if n == out[lead + d] => st[lead + d] = s,
            1 => {}
            _ => return Err(format!("{:?} does not broadcast to {out:?}", v.shape)),
        }
    }
    Ok(st)
}

/// The layout parameter of a strided kernel (`struct Lay` of [`source::PRELUDE`]): a shape,
/// up to three operands' strides and offsets, and the output's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lay {
    pub shape: [i64; MAX_DIMS],
    pub st: [[i64; MAX_DIMS]; 3],
    pub off: [i64; 3],
    pub ost: [i64; MAX_DIMS],
    pub ooff: i64,
}

impl Lay {
    /// The layout of `out` (any strides) with `ins` broadcast to its shape.
    pub fn of(out: &View, ins: &[&View]) -> std::result::Result<Lay, String> {
        if out.shape.len() > MAX_DIMS {
            return Err(format!(
                "{} dimensions (at most {MAX_DIMS})",
                out.shape.len()
            ));
        }
        if ins.len() > 3 {
            return Err(format!("{} operands (at most 3)", ins.len()));
        }
        let mut lay = Lay::default();
        for (d, n) in out.shape.iter().enumerate() {
            lay.shape[d] = *n as i64;
        }
        lay.ost[..out.strides.len()].copy_from_slice(&out.strides);
        lay.ooff = out.offset;
        for (k, v) in ins.iter().enumerate() {
            let st = broadcast_strides(&out.shape, v)?;
            lay.st[k][..st.len()].copy_from_slice(&st);
            lay.off[k] = v.offset;
        }
        Ok(lay)
    }
}

/// One argument of a generated kernel, in the generated signature's order.
#[derive(Clone, Debug)]
pub enum KArg {
    /// A device address.
    Ptr(u64),
    I64(i64),
    I32(i32),
    F32(f32),
    F64(f64),
    Lay(Box<Lay>),
}

// SAFETY: plain `#[repr(C)]` integers, the same layout as the C struct.
unsafe impl DeviceRepr for Lay {}

fn ptx_cache() -> &'static Mutex<HashMap<String, Ptx>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Ptx>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Blocks of [`BLOCK`] threads for `n` work items (grid-stride loops cover the rest).
pub fn grid(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(u64::from(BLOCK)).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Blocks for `n` warps of work.
pub fn warp_grid(n: u64) -> LaunchConfig {
    grid(n.saturating_mul(32))
}

/// A device's compiled kernels.
pub struct Kernels {
    dev: Device,
    arch: String,
    funcs: HashMap<String, CudaFunction>,
}

impl Kernels {
    pub fn new(dev: &Device) -> Result<Kernels> {
        libs::check(Lib::Nvrtc)?;
        let (major, minor) = dev.capability()?;
        Ok(Kernels {
            dev: dev.clone(),
            arch: format!("compute_{major}{minor}"),
            funcs: HashMap::new(),
        })
    }

    /// Number of kernels this device has loaded.
    pub fn loaded(&self) -> usize {
        self.funcs.len()
    }

    fn function(
        &mut self,
        name: &str,
        src: impl FnOnce() -> std::result::Result<String, String>,
    ) -> Result<CudaFunction> {
        if let Some(f) = self.funcs.get(name) {
            return Ok(f.clone());
        }
        let ptx = {
            let mut cache = ptx_cache().lock().unwrap_or_else(|p| p.into_inner());
            match cache.get(name) {
                Some(p) => p.clone(),
                None => {
                    let body = src().map_err(CudaError::Invalid)?;
                    let opts = CompileOptions {
                        options: vec![format!("--gpu-architecture={}", self.arch)],
                        name: Some(format!("{name}.cu")),
                        ..Default::default()
                    };
                    let p = compile_ptx_with_opts(format!("{}{body}", source::PRELUDE), opts)
                        .map_err(|e| CudaError::Compile {
                            kernel: name.to_string(),
                            log: e.to_string(),
                        })?;
                    cache.insert(name.to_string(), p.clone());
                    p
                }
            }
        };
        let module = self
            .dev
            .context()
            .load_module(ptx)
            .map_err(CudaError::driver("cuModuleLoadData"))?;
        let f = module
            .load_function(name)
            .map_err(CudaError::driver("cuModuleGetFunction"))?;
        self.funcs.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// `out = op(ins...)` into `out` (any strides: a view of a larger tensor is written in
    /// place), inputs broadcast to its shape; `s`, `t` are the op's scalars (see [`ops`]).
    pub fn elementwise(
        &mut self,
        op: &str,
        ins: &[&View],
        out: &View,
        s: f64,
        t: f64,
    ) -> Result<()> {
        let expr =
            ops::find(op).ok_or_else(|| CudaError::Invalid(format!("no elementwise op `{op}`")))?;
        let lay = Lay::of(out, ins).map_err(CudaError::Invalid)?;
        let elems: Vec<Elem> = ins.iter().map(|v| v.elem).collect();
        let name = source::elementwise_name(expr, &elems, out.elem);
        let n = out.numel() as i64;
        if n == 0 {
            return Ok(());
        }
        let mut args = vec![KArg::Ptr(out.ptr)];
        args.extend(ins.iter().map(|v| KArg::Ptr(v.ptr)));
        args.extend([
            KArg::I64(n),
            KArg::I32(out.shape.len() as i32),
            KArg::Lay(Box::new(lay)),
            KArg::F64(s),
            KArg::F64(t),
        ]);
        // The generated signature is `source::elementwise`'s; every pointer is a live pool
        // block holding its view's extent.
        self.launch(
            &name,
            || source::elementwise(expr, &elems, out.elem),
            grid(n as u64),
            &args,
        )
    }

    /// Launches the generated kernel `name` (its source from `src` the first time) with
    /// `args` in its signature's order. The callers pass live pool blocks of the extents the
    /// kernel's documented signature reads and writes.
    pub fn launch(
        &mut self,
        name: &str,
        src: impl FnOnce() -> std::result::Result<String, String>,
        cfg: LaunchConfig,
        args: &[KArg],
    ) -> Result<()> {
        let f = self.function(name, src)?;
        let stream = self.dev.stream(StreamKind::Compute);
        let mut b = stream.launch_builder(&f);
        for a in args {
            match a {
                KArg::Ptr(v) => b.arg(v),
                KArg::I64(v) => b.arg(v),
                KArg::I32(v) => b.arg(v),
                KArg::F32(v) => b.arg(v),
                KArg::F64(v) => b.arg(v),
                KArg::Lay(v) => b.arg(&**v),
            };
        }
        // SAFETY: `args` follow the generated signature of `name` (each caller builds them
        // from the signature documented beside its source), and every pointer is a live pool
        // block of the extent that signature reads or writes.
        unsafe { b.launch(cfg) }.map_err(CudaError::driver("cuLaunchKernel"))?;
        Ok(())
    }

    /// Reduces the middle axis of contiguous `[outer, r, inner]` `x` into `out` (`[outer, inner]`).
    #[allow(clippy::too_many_arguments)]
    pub fn reduce(
        &mut self,
        op: Reduce,
        x: u64,
        input: Elem,
        out: u64,
        out_elem: Elem,
        outer: usize,
        r: usize,
        inner: usize,
    ) -> Result<()> {
        let name = source::reduce_name(op, input, out_elem);
        let f = self.function(&name, || Ok(source::reduce(op, input, out_elem)))?;
        let (outer, r, inner) = (outer as i64, r as i64, inner as i64);
        let scale = if r == 0 { 0.0f32 } else { 1.0 / r as f32 };
        let stream = self.dev.stream(StreamKind::Compute);
        let mut b = stream.launch_builder(&f);
        b.arg(&out)
            .arg(&x)
            .arg(&outer)
            .arg(&r)
            .arg(&inner)
            .arg(&scale);
        // SAFETY: generated signature; `x` holds outer*r*inner and `out` outer*inner elements.
        unsafe { b.launch(warp_grid((outer * inner) as u64)) }
            .map_err(CudaError::driver("cuLaunchKernel"))?;
        Ok(())
    }

    /// A softmax-family kernel over the last axis of contiguous `[rows, cols]` `x`; `lse`
    /// (0 for none) receives each row's f32 log-sum-exp.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax(
        &mut self,
        x: u64,
        out: u64,
        e: Elem,
        rows: usize,
        cols: usize,
        mode: Softmax,
        lse: u64,
    ) -> Result<()> {
        self.launch(
            &source::softmax_name(e, mode),
            || Ok(source::softmax(e, mode)),
            warp_grid(rows as u64),
            &[
                KArg::Ptr(out),
                KArg::Ptr(x),
                KArg::I64(rows as i64),
                KArg::I64(cols as i64),
                KArg::Ptr(lse),
            ],
        )
    }

    /// `out[o, i, n] = src[o, idx[i], n]`; `bad` is a zeroed u32 set to 1 on an index out of range.
    #[allow(clippy::too_many_arguments)]
    pub fn index_select(
        &mut self,
        out: u64,
        src: u64,
        idx: u64,
        e: Elem,
        idx_elem: Elem,
        [outer, dim, nidx, inner]: [usize; 4],
        bad: u64,
    ) -> Result<()> {
        let name = source::index_select_name(e, idx_elem);
        let f = self.function(&name, || Ok(source::index_select(e, idx_elem)))?;
        self.launch_indexed(&f, [out, src, idx], [outer, dim, nidx, inner], bad)
    }

    /// `out[o, j, n] = src[o, idx[o, j, n], n]` with `src` of `[outer, dim, inner]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather(
        &mut self,
        out: u64,
        src: u64,
        idx: u64,
        e: Elem,
        idx_elem: Elem,
        [outer, dim, len, inner]: [usize; 4],
        bad: u64,
    ) -> Result<()> {
        let name = source::gather_name(e, idx_elem);
        let f = self.function(&name, || Ok(source::gather(e, idx_elem)))?;
        self.launch_indexed(&f, [out, src, idx], [outer, dim, len, inner], bad)
    }

    fn launch_indexed(
        &self,
        f: &CudaFunction,
        ptrs: [u64; 3],
        dims: [usize; 4],
        bad: u64,
    ) -> Result<()> {
        let [outer, dim, len, inner] = dims.map(|d| d as i64);
        let stream = self.dev.stream(StreamKind::Compute);
        let mut b = stream.launch_builder(f);
        b.arg(&ptrs[0]).arg(&ptrs[1]).arg(&ptrs[2]);
        b.arg(&outer).arg(&dim).arg(&len).arg(&inner).arg(&bad);
        // SAFETY: generated signature (index_select and gather share it); buffers hold their
        // extents, and out-of-range indices are caught in the kernel.
        unsafe { b.launch(grid((outer * len * inner) as u64)) }
            .map_err(CudaError::driver("cuLaunchKernel"))?;
        Ok(())
    }

    /// Copies contiguous `[outer, len, inner]` `src` into `[outer, total, inner]` `out` at
    /// `offset` along the middle axis.
    #[allow(clippy::too_many_arguments)]
    pub fn cat(
        &mut self,
        out: u64,
        src: u64,
        e: Elem,
        outer: usize,
        len: usize,
        inner: usize,
        total: usize,
        offset: usize,
    ) -> Result<()> {
        let name = source::cat_name(e);
        let f = self.function(&name, || Ok(source::cat(e)))?;
        let [outer, len, inner, total, offset] =
            [outer, len, inner, total, offset].map(|d| d as i64);
        let stream = self.dev.stream(StreamKind::Compute);
        let mut b = stream.launch_builder(&f);
        b.arg(&out)
            .arg(&src)
            .arg(&outer)
            .arg(&len)
            .arg(&inner)
            .arg(&total)
            .arg(&offset);
        // SAFETY: generated signature; `out` holds outer*total*inner elements and
        // offset+len <= total.
        unsafe { b.launch(grid((outer * len * inner) as u64)) }
            .map_err(CudaError::driver("cuLaunchKernel"))?;
        Ok(())
    }

    /// One thread spinning `ns` nanoseconds on `stream`.
    pub fn spin(&mut self, ns: i64, stream: StreamKind) -> Result<()> {
        let f = self.function("spin_ns", || Ok(source::SPIN.to_string()))?;
        let s = self.dev.stream(stream);
        let mut b = s.launch_builder(&f);
        b.arg(&ns);
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the spin kernel takes one integer and touches no memory.
        unsafe { b.launch(one) }.map_err(CudaError::driver("cuLaunchKernel"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the generator makes, for every dtype it takes, compiles with NVRTC (where
    /// libnvrtc is loadable: the GPU machine, or a development machine with NVRTC's wheel on
    /// `LD_LIBRARY_PATH`; elsewhere there is nothing to compile with).
    #[test]
    fn every_generated_kernel_compiles_with_nvrtc_where_it_is_present() {
        if let Err(e) = libs::check(Lib::Nvrtc) {
            eprintln!("skipped: {e}");
            return;
        }
        let all = [
            Elem::F32,
            Elem::BF16,
            Elem::F16,
            Elem::I64,
            Elem::I32,
            Elem::Bool,
        ];
        let mut sources = vec![];
        for op in ops::OPS {
            for e in all {
                let ins = vec![e; op.arity];
                if let Ok(src) = source::elementwise(op, &ins, e) {
                    sources.push(src);
                }
            }
        }
        let where_ = ops::find("where").unwrap();
        sources.push(
            source::elementwise(where_, &[Elem::Bool, Elem::BF16, Elem::BF16], Elem::BF16).unwrap(),
        );
        sources.push(
            source::elementwise(
                ops::find("lt").unwrap(),
                &[Elem::F16, Elem::F32],
                Elem::Bool,
            )
            .unwrap(),
        );
        const FLOATS: [Elem; 3] = [Elem::F32, Elem::BF16, Elem::F16];
        for e in FLOATS {
            for op in [Reduce::Sum, Reduce::Mean, Reduce::Max, Reduce::Min] {
                sources.push(source::reduce(op, e, e));
            }
            if e != Elem::F32 {
                sources.push(source::reduce(Reduce::Sum, e, Elem::F32));
            }
            for mode in [Softmax::Plain, Softmax::Log, Softmax::Safe] {
                sources.push(source::softmax(e, mode));
            }
        }
        for e in all {
            for idx in [Elem::I64, Elem::I32] {
                sources.push(source::index_select(e, idx));
                sources.push(source::gather(e, idx));
            }
            sources.push(source::cat(e));
            for mode in [
                index::IndexMode::Gather,
                index::IndexMode::Put,
                index::IndexMode::Accumulate,
            ] {
                sources.push(index::index(mode, e));
            }
            for add in [false, true] {
                for idx in [Elem::I64, Elem::I32] {
                    sources.push(index::scatter(add, e, idx));
                }
            }
            sources.push(rows::sort(e));
            for out in all {
                sources.push(rows::cumsum(e, out));
            }
        }
        for e in FLOATS {
            sources.push(source::reduce(Reduce::Any, e, Elem::Bool));
            sources.extend([
                rows::layer_norm(e),
                rows::layer_norm_backward(e),
                rows::layer_norm_params_backward(e),
                rows::histc(e),
                image::im2col(e),
                image::col2im(e),
            ]);
            for idx in [Elem::I64, Elem::I32] {
                sources.push(rows::nll_loss(e, idx));
                sources.push(rows::nll_loss_backward(e, idx));
            }
        }
        sources.push(source::reduce(Reduce::Any, Elem::Bool, Elem::Bool));
        sources.push(source::SPIN.to_string());
        // One program: every name is distinct, so a clash would fail here too.
        let program = format!("{}{}", source::PRELUDE, sources.concat());
        let opts = CompileOptions {
            options: vec!["--gpu-architecture=compute_90".into()],
            ..Default::default()
        };
        if let Err(e) = compile_ptx_with_opts(&program, opts) {
            panic!("{e}");
        }
    }

    #[test]
    fn broadcasting_gives_zero_strides_to_repeated_dimensions() {
        let v = View::contiguous(0, Elem::F32, &[3, 1]);
        assert_eq!(broadcast_strides(&[2, 3, 4], &v).unwrap(), vec![0, 1, 0]);
        let t = View {
            strides: vec![1, 3],
            ..View::contiguous(0, Elem::F32, &[3, 4])
        };
        assert_eq!(
            broadcast_strides(&[3, 4], &t).unwrap(),
            vec![1, 3],
            "a transposed view keeps its strides"
        );
        let e = broadcast_strides(&[3, 4], &View::contiguous(0, Elem::F32, &[2, 4])).unwrap_err();
        assert!(e.contains("[2, 4] does not broadcast to [3, 4]"), "{e}");
    }
}
