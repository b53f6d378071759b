//! Indexing kernels: advanced indexing (`index`, `index_put` and embedding's backward) and
//! scatter along one dimension. Both address a strided tensor through a [`Lay`], so the
//! indexed tensor is never copied; an index out of range is skipped and raises the `bad`
//! flag the caller reads.

use super::source::Elem;
use super::{KArg, Kernels, Lay, grid};
use crate::error::Result;

/// What an [`index`] kernel does at each addressed element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IndexMode {
    /// `out[i] = t[at]` (`aten.index`).
    Gather,
    /// `t[at] = v[i]` (`index_put`).
    Put,
    /// `t[at] += v[i]`, atomically (`index_put` with `accumulate`, embedding's backward).
    Accumulate,
}

impl IndexMode {
    fn tag(self) -> &'static str {
        match self {
            IndexMode::Gather => "gather",
            IndexMode::Put => "put",
            IndexMode::Accumulate => "acc",
        }
    }
}

pub fn index_name(mode: IndexMode, e: Elem) -> String {
    format!("index_{}_{}", mode.tag(), e.tag())
}

/// Advanced indexing of a tensor `t` whose dimensions are ordered `[pre..., indexed (k)...,
/// post...]` (`lay.shape`, `lay.st[0]`, `lay.off[0]`): element `i = (p, j, q)` of the
/// `[P, J, Q]` result addresses `t` at the coordinates of `p` over the `np` pre dimensions,
/// `idx[m * J + j]` (i64, negative from the end) on indexed dimension `m`, and `q` over the
/// post ones. An index equal to `skip` (embedding's padding index) is left alone.
/// Signature: `(t, v, idx, P, J, Q, np, k, ndim, lay, skip, bad)`: for `Gather`, `v` is the
/// contiguous output; otherwise the contiguous `[P, J, Q]` values written into `t`.
pub fn index(mode: IndexMode, e: Elem) -> String {
    let body = match mode {
        IndexMode::Gather => "v[i] = t[at];".to_string(),
        IndexMode::Put => "t[at] = v[i];".to_string(),
        IndexMode::Accumulate => format!("atomic_add_{g}(&t[at], ld_{g}(v[i]));", g = e.tag()),
    };
    let (tc, vc) = match mode {
        IndexMode::Gather => ("const ", ""),
        _ => ("", "const "),
    };
    format!(
        r#"
extern "C" __global__ void {name}({tc}{ty}* t, {vc}{ty}* v, const long long* __restrict__ idx, long long P, long long J, long long Q, int np, int k, int ndim, Lay lay, long long skip, unsigned int* bad) {{
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < P * J * Q; i += (long long)gridDim.x * blockDim.x) {{
    long long q = i % Q, j = (i / Q) % J, p = i / (Q * J);
    long long at = lay.off[0];
    for (int d = ndim - 1; d >= np + k; --d) {{ at += (q % lay.shape[d]) * lay.st[0][d]; q /= lay.shape[d]; }}
    for (int d = np - 1; d >= 0; --d) {{ at += (p % lay.shape[d]) * lay.st[0][d]; p /= lay.shape[d]; }}
    bool ok = true;
    for (int m = 0; m < k; ++m) {{
      long long x = idx[m * J + j];
      if (k == 1 && x == skip) {{ ok = false; break; }}
      long long n = lay.shape[np + m];
      if (x < 0) x += n;
      if (x < 0 || x >= n) {{ atomicOr(bad, 1u); ok = false; break; }}
      at += x * lay.st[0][np + m];
    }}
    if (!ok) {{ {skipped} continue; }}
    {body}
  }}
}}
"#,
        name = index_name(mode, e),
        ty = e.ctype(),
        skipped = if mode == IndexMode::Gather {
            format!("v[i] = ({})0;", e.ctype())
        } else {
            String::new()
        },
    )
}

pub fn scatter_name(add: bool, e: Elem, idx: Elem) -> String {
    format!(
        "scatter_{}_{}_{}",
        if add { "add" } else { "set" },
        e.tag(),
        idx.tag()
    )
}

/// `aten.scatter` along `dim`: for each element of the index tensor (shape `lay.shape`,
/// strides `lay.st[1]`), the output (strides `lay.ost`) at the same coordinates but `idx` on
/// `dim` (of size `n`) gets the source element at those coordinates (`lay.st[2]`; a null
/// source means the scalar `value`), or has it added (atomically). Signature: `(out, idx,
/// src, count, ndim, dim, n, lay, value, bad)`.
pub fn scatter(add: bool, e: Elem, idx: Elem) -> String {
    let write = if add {
        format!("atomic_add_{g}(&out[at], x);", g = e.tag())
    } else {
        format!("out[at] = st_{g}(x);", g = e.tag())
    };
    let compute = if e.is_float() { "float" } else { "long long" };
    format!(
        r#"
extern "C" __global__ void {name}({t}* out, const {it}* __restrict__ idx, const {t}* src, long long count, int ndim, int dim, long long n, Lay lay, double value, unsigned int* bad) {{
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (long long)gridDim.x * blockDim.x) {{
    long long r = i, at = lay.ooff, ii = lay.off[1], is = lay.off[2];
    for (int d = ndim - 1; d >= 0; --d) {{
      long long c = r % lay.shape[d]; r /= lay.shape[d];
      ii += c * lay.st[1][d]; is += c * lay.st[2][d];
      if (d != dim) at += c * lay.ost[d];
    }}
    long long x_at = (long long)idx[ii];
    if (x_at < 0) x_at += n;
    if (x_at < 0 || x_at >= n) {{ atomicOr(bad, 1u); continue; }}
    at += x_at * lay.ost[dim];
    {c} x = src != 0 ? ({c})ld_{g}(src[is]) : ({c})value;
    {write}
  }}
}}
"#,
        name = scatter_name(add, e, idx),
        t = e.ctype(),
        it = idx.ctype(),
        g = e.tag(),
        c = compute,
    )
}

impl Kernels {
    /// [`index`]: `t` the indexed tensor's storage, `v` the output or values, `idx` the
    /// `[k, J]` i64 indices; `dims = [P, J, Q, np, k]`.
    #[allow(clippy::too_many_arguments)]
    pub fn index(
        &mut self,
        mode: IndexMode,
        e: Elem,
        [t, v, idx]: [u64; 3],
        [p, j, q, np, k]: [usize; 5],
        lay: &Lay,
        ndim: usize,
        skip: i64,
        bad: u64,
    ) -> Result<()> {
        let n = (p * j * q) as u64;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            &index_name(mode, e),
            || Ok(index(mode, e)),
            grid(n),
            &[
                KArg::Ptr(t),
                KArg::Ptr(v),
                KArg::Ptr(idx),
                KArg::I64(p as i64),
                KArg::I64(j as i64),
                KArg::I64(q as i64),
                KArg::I32(np as i32),
                KArg::I32(k as i32),
                KArg::I32(ndim as i32),
                KArg::Lay(Box::new(*lay)),
                KArg::I64(skip),
                KArg::Ptr(bad),
            ],
        )
    }

    /// [`scatter`] of `count` index elements; `src` 0 scatters `value`.
    #[allow(clippy::too_many_arguments)]
    pub fn scatter(
        &mut self,
        add: bool,
        [e, ie]: [Elem; 2],
        [out, idx, src]: [u64; 3],
        count: usize,
        ndim: usize,
        dim: usize,
        n: usize,
        lay: &Lay,
        value: f64,
        bad: u64,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        self.launch(
            &scatter_name(add, e, ie),
            || Ok(scatter(add, e, ie)),
            grid(count as u64),
            &[
                KArg::Ptr(out),
                KArg::Ptr(idx),
                KArg::Ptr(src),
                KArg::I64(count as i64),
                KArg::I32(ndim as i32),
                KArg::I32(dim as i32),
                KArg::I64(n as i64),
                KArg::Lay(Box::new(*lay)),
                KArg::F64(value),
                KArg::Ptr(bad),
            ],
        )
    }
}
