//! Row kernels: layer norm and its backward, cumulative sums, sorting (sort, topk), the
//! histogram of routing (histc) and the negative log-likelihood loss. Each works on contiguous
//! rows (the caller copies a strided operand first) and computes in f32 (integers in 64 bits),
//! rounding once at the store as the elementwise kernels do.

use super::source::{Elem, compute_type};
use super::{KArg, Kernels, grid, warp_grid};
use crate::error::Result;

pub fn layer_norm_name(e: Elem) -> String {
    format!("layer_norm_{}", e.tag())
}

/// Layer norm over the last `n` elements of each of `rows` rows, one warp per row (two-pass
/// mean and biased variance, as the CPU backend); `w`, `b` may be null. Writes f32 `mean` and
/// `rstd` per row. Signature: `(y, mean, rstd, x, w, b, rows, n, eps)`.
pub fn layer_norm(e: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({t}* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, const {t}* __restrict__ x, const {t}* w, const {t}* b, long long rows, long long n, float eps) {{
  long long warps = (long long)gridDim.x * (blockDim.x / 32);
  int lane = threadIdx.x % 32;
  for (long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {{
    const {t}* in = x + row * n;
    float s = 0.0f;
    for (long long j = lane; j < n; j += 32) s += ld_{g}(in[j]);
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    float m = s / (float)n;
    float v = 0.0f;
    for (long long j = lane; j < n; j += 32) {{ float d = ld_{g}(in[j]) - m; v += d * d; }}
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    float r = 1.0f / sqrtf(v / (float)n + eps);
    for (long long j = lane; j < n; j += 32) {{
      float o = (ld_{g}(in[j]) - m) * r;
      if (w != 0) o = o * ld_{g}(w[j]);
      if (b != 0) o = o + ld_{g}(b[j]);
      y[row * n + j] = st_{g}(o);
    }}
    if (lane == 0) {{ mean[row] = m; rstd[row] = r; }}
  }}
}}
"#,
        name = layer_norm_name(e),
        t = e.ctype(),
        g = e.tag(),
    )
}

pub fn layer_norm_backward_name(e: Elem) -> String {
    format!("layer_norm_backward_{}", e.tag())
}

/// The input gradient of layer norm, one warp per row:
/// `dx = rstd / n * (n * g - Σg - x̂ Σ(g x̂))` with `g = dy * w` (`w` may be null).
/// Signature: `(dx, dy, x, mean, rstd, w, rows, n)`.
pub fn layer_norm_backward(e: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({t}* __restrict__ dx, const {t}* __restrict__ dy, const {t}* __restrict__ x, const float* __restrict__ mean, const float* __restrict__ rstd, const {t}* w, long long rows, long long n) {{
  long long warps = (long long)gridDim.x * (blockDim.x / 32);
  int lane = threadIdx.x % 32;
  for (long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {{
    float m = mean[row], r = rstd[row];
    float sg = 0.0f, sgx = 0.0f;
    for (long long j = lane; j < n; j += 32) {{
      float g = ld_{g}(dy[row * n + j]) * (w != 0 ? ld_{g}(w[j]) : 1.0f);
      sg += g; sgx += g * (ld_{g}(x[row * n + j]) - m) * r;
    }}
    for (int off = 16; off > 0; off >>= 1) {{
      sg += __shfl_xor_sync(0xffffffffu, sg, off);
      sgx += __shfl_xor_sync(0xffffffffu, sgx, off);
    }}
    for (long long j = lane; j < n; j += 32) {{
      float g = ld_{g}(dy[row * n + j]) * (w != 0 ? ld_{g}(w[j]) : 1.0f);
      float xh = (ld_{g}(x[row * n + j]) - m) * r;
      dx[row * n + j] = st_{g}(r / (float)n * ((float)n * g - sg - xh * sgx));
    }}
  }}
}}
"#,
        name = layer_norm_backward_name(e),
        t = e.ctype(),
        g = e.tag(),
    )
}

pub fn layer_norm_params_backward_name(e: Elem) -> String {
    format!("layer_norm_params_backward_{}", e.tag())
}

/// The weight and bias gradients of layer norm, one thread per column summing over the rows:
/// `dw = Σ dy x̂`, `db = Σ dy` (either may be null). Signature: `(dw, db, dy, x, mean, rstd,
/// rows, n)`.
pub fn layer_norm_params_backward(e: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({t}* dw, {t}* db, const {t}* __restrict__ dy, const {t}* __restrict__ x, const float* __restrict__ mean, const float* __restrict__ rstd, long long rows, long long n) {{
  for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (long long)gridDim.x * blockDim.x) {{
    float sw = 0.0f, sb = 0.0f;
    for (long long row = 0; row < rows; ++row) {{
      float g = ld_{g}(dy[row * n + j]);
      sw += g * (ld_{g}(x[row * n + j]) - mean[row]) * rstd[row];
      sb += g;
    }}
    if (dw != 0) dw[j] = st_{g}(sw);
    if (db != 0) db[j] = st_{g}(sb);
  }}
}}
"#,
        name = layer_norm_params_backward_name(e),
        t = e.ctype(),
        g = e.tag(),
    )
}

pub fn cumsum_name(input: Elem, out: Elem) -> String {
    format!("cumsum_{}_to_{}", input.tag(), out.tag())
}

/// Inclusive prefix sums along the middle axis of contiguous `[outer, r, inner]`, one thread
/// per line, in order (the CPU backend's order). Signature: `(out, x, outer, r, inner)`.
pub fn cumsum(input: Elem, out: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({o}* __restrict__ out, const {i}* __restrict__ x, long long outer, long long r, long long inner) {{
  typedef {c} C;
  for (long long l = (long long)blockIdx.x * blockDim.x + threadIdx.x; l < outer * inner; l += (long long)gridDim.x * blockDim.x) {{
    long long base = (l / inner) * r * inner + l % inner;
    C acc = (C)0;
    for (long long j = 0; j < r; ++j) {{ acc = acc + (C)ld_{it}(x[base + j * inner]); out[base + j * inner] = st_{ot}(acc); }}
  }}
}}
"#,
        name = cumsum_name(input, out),
        o = out.ctype(),
        i = input.ctype(),
        it = input.tag(),
        ot = out.tag(),
        c = compute_type(&[input, out]),
    )
}

pub fn sort_name(e: Elem) -> String {
    format!("sort_rows_{}", e.tag())
}

/// Stable sort of each contiguous row of `n` by rank: element `j`'s place is the number of
/// elements ordered before it (NaN after every number, as the CPU backend), ties in index
/// order; places below `k` are written (`vals` and i64 `idx` of `[rows, k]`: topk is a sort
/// keeping `k`). One thread per element, O(n) each. Signature: `(vals, idx, x, rows, n, k,
/// descending)`.
pub fn sort(e: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({t}* __restrict__ vals, long long* __restrict__ idx, const {t}* __restrict__ x, long long rows, long long n, long long k, int desc) {{
  typedef {c} C;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * n; i += (long long)gridDim.x * blockDim.x) {{
    long long row = i / n, j = i % n;
    const {t}* in = x + row * n;
    C v = (C)ld_{g}(in[j]);
    long long place = 0;
    for (long long q = 0; q < n; ++q) {{
      C u = (C)ld_{g}(in[q]);
      bool lt = (u < v) || (u == u && v != v);
      bool gt = (u > v) || (u != u && v == v);
      bool before = desc ? gt : lt;
      bool tie = !lt && !gt;
      if (before || (tie && q < j)) ++place;
    }}
    if (place < k) {{ vals[row * k + place] = in[j]; idx[row * k + place] = j; }}
  }}
}}
"#,
        name = sort_name(e),
        t = e.ctype(),
        g = e.tag(),
        c = compute_type(&[e]),
    )
}

pub fn histc_name(e: Elem) -> String {
    format!("histc_{}", e.tag())
}

/// Counts of the `n` values in each of `bins` equal bins over `[lo, hi]` (a value at `hi` in
/// the last bin, others outside ignored) into zeroed f32 `counts`. Signature: `(counts, x, n,
/// bins, lo, hi)`.
pub fn histc(e: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}(float* counts, const {t}* __restrict__ x, long long n, long long bins, float lo, float hi) {{
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {{
    float v = ld_{g}(x[i]);
    if (!(v >= lo && v <= hi)) continue;
    long long b = (long long)((v - lo) * (float)bins / (hi - lo));
    if (b > bins - 1) b = bins - 1;
    atomicAdd(&counts[b], 1.0f);
  }}
}}
"#,
        name = histc_name(e),
        t = e.ctype(),
        g = e.tag(),
    )
}

pub fn nll_loss_name(e: Elem, idx: Elem) -> String {
    format!("nll_loss_{}_{}", e.tag(), idx.tag())
}

/// The negative log-likelihood of `[n, c]` log-probabilities at `target` (class weights `w`
/// may be null; a target equal to `ignore` weighs 0), one warp: `loss` gets per-row losses
/// (`reduction` 0) or their sum (2) or sum over the total weight (1); `total` the total
/// weight. Signature: `(loss, total, logp, target, w, n, c, ignore, reduction)`.
pub fn nll_loss(e: Elem, idx: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({t}* loss, {t}* total, const {t}* __restrict__ logp, const {it}* __restrict__ target, const {t}* w, long long n, long long c, long long ignore, int reduction) {{
  int lane = threadIdx.x;
  if (lane >= 32) return;
  float s = 0.0f, tw = 0.0f;
  for (long long i = lane; i < n; i += 32) {{
    long long t = (long long)target[i];
    float wi = (t == ignore || t < 0 || t >= c) ? 0.0f : (w != 0 ? ld_{g}(w[t]) : 1.0f);
    float l = wi == 0.0f ? 0.0f : -wi * ld_{g}(logp[i * c + t]);
    if (reduction == 0) loss[i] = st_{g}(l);
    s += l; tw += wi;
  }}
  for (int off = 16; off > 0; off >>= 1) {{
    s += __shfl_xor_sync(0xffffffffu, s, off);
    tw += __shfl_xor_sync(0xffffffffu, tw, off);
  }}
  if (lane == 0) {{
    if (reduction == 1) loss[0] = st_{g}(s / tw);
    if (reduction == 2) loss[0] = st_{g}(s);
    total[0] = st_{g}(reduction == 0 ? 0.0f : tw);
  }}
}}
"#,
        name = nll_loss_name(e, idx),
        t = e.ctype(),
        g = e.tag(),
        it = idx.ctype(),
    )
}

pub fn nll_loss_backward_name(e: Elem, idx: Elem) -> String {
    format!("nll_loss_backward_{}_{}", e.tag(), idx.tag())
}

/// The gradient of [`nll_loss`] into zeroed `[n, c]` `dx`: `-w[t] * g` at each row's target
/// (`g` per row for reduction 0, else the 0-d gradient, over the total weight for the mean).
/// Signature: `(dx, g, target, w, total, n, c, ignore, reduction)`.
pub fn nll_loss_backward(e: Elem, idx: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({t}* dx, const {t}* __restrict__ g, const {it}* __restrict__ target, const {t}* w, const {t}* __restrict__ total, long long n, long long c, long long ignore, int reduction) {{
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {{
    long long t = (long long)target[i];
    if (t == ignore || t < 0 || t >= c) continue;
    float wi = w != 0 ? ld_{g}(w[t]) : 1.0f;
    float gi = ld_{g}(g[reduction == 0 ? i : 0]);
    if (reduction == 1) gi = gi / ld_{g}(total[0]);
    dx[i * c + t] = st_{g}(-wi * gi);
  }}
}}
"#,
        name = nll_loss_backward_name(e, idx),
        t = e.ctype(),
        g = e.tag(),
        it = idx.ctype(),
    )
}

impl Kernels {
    /// [`layer_norm`]: `w`, `b` 0 for none.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm(
        &mut self,
        [y, mean, rstd, x, w, b]: [u64; 6],
        e: Elem,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<()> {
        let mut args: Vec<KArg> = [y, mean, rstd, x, w, b].map(KArg::Ptr).to_vec();
        args.extend([KArg::I64(rows as i64), KArg::I64(n as i64), KArg::F32(eps)]);
        self.launch(
            &layer_norm_name(e),
            || Ok(layer_norm(e)),
            warp_grid(rows as u64),
            &args,
        )
    }

    /// [`layer_norm_backward`] then [`layer_norm_params_backward`] (when `dw` or `db` is
    /// wanted); pointers 0 for none.
    pub fn layer_norm_backward(
        &mut self,
        [dx, dw, db, dy, x, mean, rstd, w]: [u64; 8],
        e: Elem,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        let dims = [KArg::I64(rows as i64), KArg::I64(n as i64)];
        if dx != 0 {
            let mut args: Vec<KArg> = [dx, dy, x, mean, rstd, w].map(KArg::Ptr).to_vec();
            args.extend(dims.clone());
            self.launch(
                &layer_norm_backward_name(e),
                || Ok(layer_norm_backward(e)),
                warp_grid(rows as u64),
                &args,
            )?;
        }
        if dw != 0 || db != 0 {
            let mut args: Vec<KArg> = [dw, db, dy, x, mean, rstd].map(KArg::Ptr).to_vec();
            args.extend(dims);
            self.launch(
                &layer_norm_params_backward_name(e),
                || Ok(layer_norm_params_backward(e)),
                grid(n as u64),
                &args,
            )?;
        }
        Ok(())
    }

    /// [`cumsum`] of contiguous `[outer, r, inner]`.
    pub fn cumsum(
        &mut self,
        out: u64,
        x: u64,
        [input, oe]: [Elem; 2],
        [outer, r, inner]: [usize; 3],
    ) -> Result<()> {
        self.launch(
            &cumsum_name(input, oe),
            || Ok(cumsum(input, oe)),
            grid((outer * inner) as u64),
            &[
                KArg::Ptr(out),
                KArg::Ptr(x),
                KArg::I64(outer as i64),
                KArg::I64(r as i64),
                KArg::I64(inner as i64),
            ],
        )
    }

    /// [`sort`] of contiguous `[rows, n]` keeping `k` per row.
    #[allow(clippy::too_many_arguments)]
    pub fn sort(
        &mut self,
        vals: u64,
        idx: u64,
        x: u64,
        e: Elem,
        rows: usize,
        n: usize,
        k: usize,
        descending: bool,
    ) -> Result<()> {
        self.launch(
            &sort_name(e),
            || Ok(sort(e)),
            grid((rows * n) as u64),
            &[
                KArg::Ptr(vals),
                KArg::Ptr(idx),
                KArg::Ptr(x),
                KArg::I64(rows as i64),
                KArg::I64(n as i64),
                KArg::I64(k as i64),
                KArg::I32(i32::from(descending)),
            ],
        )
    }

    /// [`histc`] of `n` contiguous values into zeroed f32 `counts`.
    pub fn histc(
        &mut self,
        counts: u64,
        x: u64,
        e: Elem,
        n: usize,
        bins: usize,
        [lo, hi]: [f32; 2],
    ) -> Result<()> {
        self.launch(
            &histc_name(e),
            || Ok(histc(e)),
            grid(n as u64),
            &[
                KArg::Ptr(counts),
                KArg::Ptr(x),
                KArg::I64(n as i64),
                KArg::I64(bins as i64),
                KArg::F32(lo),
                KArg::F32(hi),
            ],
        )
    }

    /// [`nll_loss`] (`backward` false: `[loss, total, logp, target, w]`) or
    /// [`nll_loss_backward`] (`[dx, g, target, w, total]`); `w` 0 for none.
    #[allow(clippy::too_many_arguments)]
    pub fn nll_loss(
        &mut self,
        backward: bool,
        ptrs: [u64; 5],
        [e, idx]: [Elem; 2],
        n: usize,
        c: usize,
        ignore: i64,
        reduction: i32,
    ) -> Result<()> {
        let mut args: Vec<KArg> = ptrs.map(KArg::Ptr).to_vec();
        args.extend([
            KArg::I64(n as i64),
            KArg::I64(c as i64),
            KArg::I64(ignore),
            KArg::I32(reduction),
        ]);
        if backward {
            self.launch(
                &nll_loss_backward_name(e, idx),
                || Ok(nll_loss_backward(e, idx)),
                grid(n as u64),
                &args,
            )
        } else {
            let one_warp = cudarc::driver::LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch(
                &nll_loss_name(e, idx),
                || Ok(nll_loss(e, idx)),
                one_warp,
                &args,
            )
        }
    }
}
