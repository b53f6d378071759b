//! CUDA C source of the generated kernels, one function per (kernel kind, op, dtypes).
//!
//! The source includes no CUDA header (the GPU machines have NVRTC but not always the
//! toolkit's include directory): bf16 and f16 are stored as 16-bit integers and converted
//! with bit operations and PTX `cvt` instructions, computing in f32 as the CPU backend does
//! (one rounding per op, at the store); infinity is spelled `ZS_INF` (math.h's `INFINITY` is
//! a header macro).

use super::ops::OpExpr;
use zerosched_ir::Dtype;

/// Most dimensions an elementwise kernel indexes (larger tensors are refused).
pub const MAX_DIMS: usize = 8;
/// Threads per block of every generated kernel.
pub const BLOCK: u32 = 256;

/// An element type a kernel reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    F32,
    BF16,
    F16,
    I64,
    I32,
    Bool,
}

impl Elem {
    pub fn of(d: Dtype) -> Option<Elem> {
        Some(match d {
            Dtype::Float32 => Elem::F32,
            Dtype::BFloat16 => Elem::BF16,
            Dtype::Float16 => Elem::F16,
            // Stored as int64, as the CPU backend stores it (PyTorch has few uint64 ops;
            // the GPU attention's RNG state is one).
            Dtype::Int64 | Dtype::UInt64 => Elem::I64,
            Dtype::Int32 => Elem::I32,
            Dtype::Bool => Elem::Bool,
            _ => return None,
        })
    }

    pub fn bytes(self) -> usize {
        match self {
            Elem::F32 | Elem::I32 => 4,
            Elem::BF16 | Elem::F16 => 2,
            Elem::I64 => 8,
            Elem::Bool => 1,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, Elem::F32 | Elem::BF16 | Elem::F16)
    }

    /// Short name used in kernel names.
    pub fn tag(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::BF16 => "bf16",
            Elem::F16 => "f16",
            Elem::I64 => "i64",
            Elem::I32 => "i32",
            Elem::Bool => "bool",
        }
    }

    /// The C storage type.
    pub fn ctype(self) -> &'static str {
        match self {
            Elem::F32 => "float",
            Elem::BF16 | Elem::F16 => "unsigned short",
            Elem::I64 => "long long",
            Elem::I32 => "int",
            Elem::Bool => "unsigned char",
        }
    }
}

/// Conversions between storage types and the compute types, shared by every kernel.
pub const PRELUDE: &str = r#"
__device__ __forceinline__ float ld_f32(float x) { return x; }
__device__ __forceinline__ float st_f32(float v) { return v; }
__device__ __forceinline__ float ld_bf16(unsigned short x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ unsigned short st_bf16(float v) {
  unsigned int u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float ld_f16(unsigned short x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }
__device__ __forceinline__ unsigned short st_f16(float v) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); return h; }
__device__ __forceinline__ long long ld_i64(long long x) { return x; }
__device__ __forceinline__ long long st_i64(long long v) { return v; }
__device__ __forceinline__ long long ld_i32(int x) { return x; }
__device__ __forceinline__ int st_i32(long long v) { return (int)v; }
__device__ __forceinline__ long long ld_bool(unsigned char x) { return x != 0; }
__device__ __forceinline__ unsigned char st_bool(double v) { return v != 0; }
struct Lay { long long shape[8]; long long st[3][8]; long long off[3]; long long ost[8]; long long ooff; };
#define ZS_INF __int_as_float(0x7f800000)
// torch's maximum/minimum and max/min reductions propagate NaN (fmaxf would drop it).
__device__ __forceinline__ float zs_max(float a, float b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ float zs_min(float a, float b) { return (a < b || a != a) ? a : b; }
__device__ __forceinline__ long long zs_max(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ long long zs_min(long long a, long long b) { return a < b ? a : b; }
// Python's floor division, and C's truncating one, for both compute types.
__device__ __forceinline__ float zs_floordiv(float a, float b) { return floorf(a / b); }
__device__ __forceinline__ long long zs_floordiv(long long a, long long b) {
  long long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ float zs_truncdiv(float a, float b) { return truncf(a / b); }
__device__ __forceinline__ long long zs_truncdiv(long long a, long long b) { return a / b; }
// Atomic accumulation into each storage type (16- and 8-bit ones by compare-and-swap on the
// aligned 32-bit word that holds them).
__device__ __forceinline__ void atomic_add_f32(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add_i64(long long* p, long long v) { atomicAdd((unsigned long long*)p, (unsigned long long)v); }
__device__ __forceinline__ void atomic_add_i32(int* p, long long v) { atomicAdd(p, (int)v); }
__device__ __forceinline__ void atomic_add_bool(unsigned char* p, long long v) {
  unsigned long long a = (unsigned long long)p;
  if (v != 0) atomicOr((unsigned int*)(a & ~3ull), 1u << (8 * (unsigned int)(a & 3ull)));
}
#define ZS_ATOMIC16(TAG) \
__device__ __forceinline__ void atomic_add_##TAG(unsigned short* p, float v) { \
  unsigned long long a = (unsigned long long)p; \
  unsigned int* w = (unsigned int*)(a & ~3ull); \
  unsigned int shift = (a & 2ull) ? 16u : 0u; \
  unsigned int old = *w, assumed; \
  do { \
    assumed = old; \
    unsigned short h = st_##TAG(ld_##TAG((unsigned short)((assumed >> shift) & 0xffffu)) + v); \
    old = atomicCAS(w, assumed, (assumed & ~(0xffffu << shift)) | ((unsigned int)h << shift)); \
  } while (assumed != old); \
}
ZS_ATOMIC16(bf16)
ZS_ATOMIC16(f16)
"#;

/// The compute type of a kernel over these element types: f32 if any is floating point.
pub(crate) fn compute_type(elems: &[Elem]) -> &'static str {
    if elems.iter().any(|e| e.is_float()) {
        "float"
    } else {
        "long long"
    }
}

/// Name of the elementwise kernel of `op` reading `ins` and writing `out`.
pub fn elementwise_name(op: &OpExpr, ins: &[Elem], out: Elem) -> String {
    let ins: Vec<&str> = ins.iter().map(|e| e.tag()).collect();
    format!("ew_{}_{}_to_{}", op.name, ins.join("_"), out.tag())
}

/// An elementwise kernel: `out[io] = op(a[ia], b[ib], c[ic])` over the `n` elements of the
/// output's shape (`i` their row-major index, which an expression may read), the output and
/// each input addressed through its own strides (0 on broadcast dimensions) and offset.
/// Signature: `(out[, a[, b[, c]]], n, ndim, Lay, s, t)`.
pub fn elementwise(op: &OpExpr, ins: &[Elem], out: Elem) -> Result<String, String> {
    if ins.len() != op.arity {
        return Err(format!(
            "`{}` takes {} operands, not {}",
            op.name,
            op.arity,
            ins.len()
        ));
    }
    let mut all = ins.to_vec();
    all.push(out);
    let c = compute_type(&all);
    if op.float_only && c != "float" {
        return Err(format!(
            "`{}` is defined for floating-point tensors only",
            op.name
        ));
    }
    let vars = ["a", "b", "c"];
    let name = elementwise_name(op, ins, out);
    let mut params = format!("{}* __restrict__ out", out.ctype());
    for (v, e) in vars.iter().zip(ins) {
        params += &format!(", const {}* __restrict__ p{v}", e.ctype());
    }
    let offsets: String = (0..ins.len())
        .map(|k| format!(" long long i{} = lay.off[{k}];", vars[k]))
        .collect();
    let steps: String = (0..ins.len())
        .map(|k| format!(" i{} += q * lay.st[{k}][d];", vars[k]))
        .collect();
    let loads: String = ins
        .iter()
        .enumerate()
        .map(|(k, e)| {
            format!(
                "    C {v} = (C)ld_{t}(p{v}[i{v}]);\n",
                v = vars[k],
                t = e.tag()
            )
        })
        .collect();
    Ok(format!(
        r#"
extern "C" __global__ void {name}({params}, long long n, int ndim, Lay lay, double s, double t) {{
  typedef {c} C;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {{
    long long r = i; long long io = lay.ooff;{offsets}
    for (int d = ndim - 1; d >= 0; --d) {{ long long q = r % lay.shape[d]; r /= lay.shape[d]; io += q * lay.ost[d];{steps} }}
{loads}    out[io] = st_{o}({expr});
  }}
}}
"#,
        o = out.tag(),
        expr = op.expr,
    ))
}

/// A reduction of the middle axis of a contiguous `[outer, r, inner]` tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reduce {
    Sum,
    /// Sum times the `scale` parameter (1/r for a mean).
    Mean,
    /// NaN-propagating, as torch's.
    Max,
    Min,
    /// Whether any element is non-zero (1 or 0).
    Any,
}

impl Reduce {
    fn parts(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Reduce::Sum => ("sum", "0.0f", "acc + v"),
            Reduce::Mean => ("mean", "0.0f", "acc + v"),
            Reduce::Max => ("max", "-ZS_INF", "zs_max(acc, v)"),
            Reduce::Min => ("min", "ZS_INF", "zs_min(acc, v)"),
            Reduce::Any => ("any", "0.0f", "((acc != 0.0f || v != 0.0f) ? 1.0f : 0.0f)"),
        }
    }
}

pub fn reduce_name(op: Reduce, input: Elem, out: Elem) -> String {
    format!("reduce_{}_{}_to_{}", op.parts().0, input.tag(), out.tag())
}

/// One warp per output element; f32 accumulation. Signature:
/// `(out, x, outer, r, inner, scale)`.
pub fn reduce(op: Reduce, input: Elem, out: Elem) -> String {
    let (_, init, combine) = op.parts();
    let finish = if op == Reduce::Mean {
        "acc * scale"
    } else {
        "acc"
    };
    format!(
        r#"
extern "C" __global__ void {name}({o}* __restrict__ out, const {i}* __restrict__ x, long long outer, long long r, long long inner, float scale) {{
  long long warps = (long long)gridDim.x * (blockDim.x / 32);
  int lane = threadIdx.x % 32;
  for (long long o = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; o < outer * inner; o += warps) {{
    const {i}* base = x + (o / inner) * r * inner + (o % inner);
    float acc = {init};
    for (long long j = lane; j < r; j += 32) {{ float v = (float)ld_{it}(base[j * inner]); acc = {combine}; }}
    for (int off = 16; off > 0; off >>= 1) {{ float v = __shfl_down_sync(0xffffffffu, acc, off); acc = {combine}; }}
    if (lane == 0) out[o] = st_{ot}({finish});
  }}
}}
"#,
        name = reduce_name(op, input, out),
        o = out.ctype(),
        i = input.ctype(),
        it = input.tag(),
        ot = out.tag(),
    )
}

/// What a softmax-family row kernel writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Softmax {
    Plain,
    Log,
    /// `_safe_softmax`: a row of only `-inf` is 0, not NaN (attention's masked rows).
    Safe,
}

pub fn softmax_name(e: Elem, mode: Softmax) -> String {
    let kind = match mode {
        Softmax::Plain => "softmax",
        Softmax::Log => "log_softmax",
        Softmax::Safe => "safe_softmax",
    };
    format!("{kind}_{}", e.tag())
}

/// Softmax (or log-softmax) over the last axis of a contiguous `[rows, cols]` tensor, one
/// warp per row, f32 throughout; `lse`, when not null, receives each row's f32 log-sum-exp
/// (`-inf` for a row of only `-inf`). Signature: `(out, x, rows, cols, lse)`.
pub fn softmax(e: Elem, mode: Softmax) -> String {
    let write = match mode {
        Softmax::Log => "v - m - logf(sum)",
        Softmax::Plain => "expf(v - m) / sum",
        Softmax::Safe => "(m == -ZS_INF ? 0.0f : expf(v - m) / sum)",
    };
    format!(
        r#"
extern "C" __global__ void {name}({t}* __restrict__ out, const {t}* __restrict__ x, long long rows, long long cols, float* lse) {{
  long long warps = (long long)gridDim.x * (blockDim.x / 32);
  int lane = threadIdx.x % 32;
  for (long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {{
    const {t}* in = x + row * cols;
    float m = -ZS_INF;
    for (long long j = lane; j < cols; j += 32) m = zs_max(m, ld_{g}(in[j]));
    for (int off = 16; off > 0; off >>= 1) m = zs_max(m, __shfl_xor_sync(0xffffffffu, m, off));
    float sum = 0.0f;
    for (long long j = lane; j < cols; j += 32) sum += expf(ld_{g}(in[j]) - m);
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    for (long long j = lane; j < cols; j += 32) {{ float v = ld_{g}(in[j]); out[row * cols + j] = st_{g}({write}); }}
    if (lse != 0 && lane == 0) lse[row] = (m == -ZS_INF) ? -ZS_INF : m + logf(sum);
  }}
}}
"#,
        name = softmax_name(e, mode),
        t = e.ctype(),
        g = e.tag(),
    )
}

pub fn index_select_name(e: Elem, idx: Elem) -> String {
    format!("index_select_{}_{}", e.tag(), idx.tag())
}

/// `out[o, i, n] = src[o, idx[i], n]` over `[outer, nidx, inner]` (embedding is `outer = 1`);
/// an index outside `[-dim, dim)` writes 0 and sets `*bad`. Signature:
/// `(out, src, idx, outer, dim, nidx, inner, bad)`.
pub fn index_select(e: Elem, idx: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({t}* __restrict__ out, const {t}* __restrict__ src, const {it}* __restrict__ idx, long long outer, long long dim, long long nidx, long long inner, unsigned int* bad) {{
  long long n = outer * nidx * inner;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {{
    long long k = i % inner, j = (i / inner) % nidx, o = i / (inner * nidx);
    long long at = (long long)idx[j];
    if (at < 0) at += dim;
    if (at < 0 || at >= dim) {{ out[i] = ({t})0; atomicOr(bad, 1u); continue; }}
    out[i] = src[(o * dim + at) * inner + k];
  }}
}}
"#,
        name = index_select_name(e, idx),
        t = e.ctype(),
        it = idx.ctype(),
    )
}

pub fn gather_name(e: Elem, idx: Elem) -> String {
    format!("gather_{}_{}", e.tag(), idx.tag())
}

/// `out[o, j, n] = src[o, idx[o, j, n], n]` (aten.gather) over `[outer, len, inner]` with
/// `src` of `[outer, dim, inner]`; an index outside `[0, dim)` writes 0 and sets `*bad`.
/// Signature: `(out, src, idx, outer, dim, len, inner, bad)`.
pub fn gather(e: Elem, idx: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({t}* __restrict__ out, const {t}* __restrict__ src, const {it}* __restrict__ idx, long long outer, long long dim, long long len, long long inner, unsigned int* bad) {{
  long long n = outer * len * inner;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {{
    long long k = i % inner, o = i / (inner * len);
    long long at = (long long)idx[i];
    if (at < 0 || at >= dim) {{ out[i] = ({t})0; atomicOr(bad, 1u); continue; }}
    out[i] = src[(o * dim + at) * inner + k];
  }}
}}
"#,
        name = gather_name(e, idx),
        t = e.ctype(),
        it = idx.ctype(),
    )
}

pub fn cat_name(e: Elem) -> String {
    format!("cat_{}", e.tag())
}

/// Copies a contiguous `[outer, len, inner]` part into `[outer, total, inner]` at `offset`
/// along the middle axis (one launch per input of a cat). Signature:
/// `(out, src, outer, len, inner, total, offset)`.
pub fn cat(e: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({t}* __restrict__ out, const {t}* __restrict__ src, long long outer, long long len, long long inner, long long total, long long offset) {{
  long long n = outer * len * inner;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {{
    long long k = i % inner, j = (i / inner) % len, o = i / (inner * len);
    out[(o * total + offset + j) * inner + k] = src[i];
  }}
}}
"#,
        name = cat_name(e),
        t = e.ctype(),
    )
}

/// Spins on the global nanosecond timer for `ns` nanoseconds (replay mode's compute node).
/// Signature: `(ns)`.
pub const SPIN: &str = r#"
extern "C" __global__ void spin_ns(long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while ((long long)(now - start) < ns);
}
"#;

#[cfg(test)]
mod tests {
    use super::super::ops::find;
    use super::*;

    fn op(name: &str) -> &'static OpExpr {
        find(name).unwrap()
    }

    #[test]
    fn a_binary_kernel_loads_each_operand_through_its_own_strides() {
        let src = elementwise(op("add"), &[Elem::BF16, Elem::F32], Elem::F32).unwrap();
        assert!(src.contains("void ew_add_bf16_f32_to_f32(float* __restrict__ out, const unsigned short* __restrict__ pa, const float* __restrict__ pb, long long n, int ndim, Lay lay, double s, double t)"), "{src}");
        assert!(src.contains("typedef float C;"));
        assert!(src.contains(
            "long long io = lay.ooff; long long ia = lay.off[0]; long long ib = lay.off[1];"
        ));
        assert!(
            src.contains("io += q * lay.ost[d]; ia += q * lay.st[0][d]; ib += q * lay.st[1][d];")
        );
        assert!(
            src.contains("C a = (C)ld_bf16(pa[ia]);") && src.contains("C b = (C)ld_f32(pb[ib]);")
        );
        assert!(src.contains("out[io] = st_f32(a + (C)s * b);"), "{src}");
    }

    #[test]
    fn integer_kernels_compute_in_64_bits_and_refuse_math_functions() {
        let src = elementwise(op("lt"), &[Elem::I64, Elem::I64], Elem::Bool).unwrap();
        assert!(
            src.contains("typedef long long C;") && src.contains("st_bool((C)(a < b))"),
            "{src}"
        );
        let e = elementwise(op("exp"), &[Elem::I64], Elem::I64).unwrap_err();
        assert!(e.contains("floating-point"), "{e}");
        let e = elementwise(op("where"), &[Elem::Bool, Elem::F32], Elem::F32).unwrap_err();
        assert!(e.contains("takes 3 operands, not 2"), "{e}");
    }

    #[test]
    fn reductions_accumulate_in_f32_and_scale_only_the_mean() {
        let mean = reduce(Reduce::Mean, Elem::F16, Elem::F16);
        assert!(mean.contains("reduce_mean_f16_to_f16(unsigned short* __restrict__ out, const unsigned short* __restrict__ x"));
        assert!(
            mean.contains("float acc = 0.0f;") && mean.contains("st_f16(acc * scale)"),
            "{mean}"
        );
        let max = reduce(Reduce::Max, Elem::F32, Elem::F32);
        assert!(
            max.contains("float acc = -ZS_INF;") && max.contains("acc = zs_max(acc, v);"),
            "NaN-propagating: {max}"
        );
        assert!(max.contains("st_f32(acc)"), "{max}");
    }

    #[test]
    fn kernels_differ_by_name_for_every_dtype_and_need_no_header() {
        let names = [
            softmax_name(Elem::BF16, Softmax::Plain),
            softmax_name(Elem::BF16, Softmax::Log),
            softmax_name(Elem::BF16, Softmax::Safe),
            index_select_name(Elem::BF16, Elem::I64),
            gather_name(Elem::BF16, Elem::I64),
            cat_name(Elem::BF16),
            cat_name(Elem::F16),
        ];
        for (i, n) in names.iter().enumerate() {
            assert!(!names[..i].contains(n), "{n} twice");
        }
        for src in [
            PRELUDE,
            &softmax(Elem::F16, Softmax::Log),
            &cat(Elem::F32),
            SPIN,
        ] {
            assert!(!src.contains("#include"), "{src}");
        }
        assert!(softmax(Elem::F16, Softmax::Log).contains("st_f16(v - m - logf(sum))"));
    }
}
