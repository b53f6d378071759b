//! Matrix products beyond mm and bmm: `addmm` (a product plus a broadcast bias) and
//! `_grouped_mm` (one cuBLAS product per group of rows or of the contraction dimension; the
//! group offsets are read to the host, one synchronisation).

use super::{CudaTensor, Env, Temps, Value, dense};
use crate::backend::{Cuda, elem, number, one, out_dtype, product, tensor};
use crate::device::StreamKind;
use crate::matmul::Gemm;
use zerosched_ir::{Arg, Dtype};

/// `addmm(bias, a, b, beta=1, alpha=1)`: `beta * bias + alpha * (a · b)`.
pub fn addmm(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let (bias, a, b) = (tensor(env, 0)?, tensor(env, 1)?, tensor(env, 2)?);
    let kw = |k: &str| env.node().kwargs.get(k).and_then(number).unwrap_or(1.0);
    let (beta, alpha) = (kw("beta"), kw("alpha"));
    if a.shape.len() != 2 || b.shape.len() != 2 {
        return Err(format!("addmm of {:?} and {:?}", a.shape, b.shape));
    }
    let dt = out_dtype(env, a.dtype);
    let mut ab = product(c, a, b, dt)?;
    if alpha != 1.0 {
        let scaled = c.ew("mul_scalar", &[&ab], dt, alpha);
        c.release(&ab);
        ab = scaled?;
    }
    // `add` is `a + s * b`: the product plus beta times the bias.
    let out = c.ew("add", &[&ab, bias], dt, beta);
    c.release(&ab);
    one(out?)
}

/// The `(start, end)` of each group from cumulative ends `offs` over a dimension of `len`.
pub fn group_ranges(offs: &[i64], len: usize) -> Result<Vec<(usize, usize)>, String> {
    let mut start = 0usize;
    offs.iter()
        .map(|&end| {
            let e = usize::try_from(end)
                .ok()
                .filter(|&e| e >= start && e <= len)
                .ok_or_else(|| {
                    format!("group offsets {offs:?} must be non-decreasing and at most {len}")
                })?;
            let r = (start, e);
            start = e;
            Ok(r)
        })
        .collect()
}

fn read_offsets(c: &mut Cuda, offs: &CudaTensor) -> Result<Vec<i64>, String> {
    let mut temps = Temps(vec![]);
    let res = (|| {
        let o = dense(c, offs, Dtype::Int64, &mut temps)?;
        let mut b = vec![0u8; o.numel() * 8];
        c.dev
            .download(StreamKind::Compute, o.block.ptr, &mut b)
            .map_err(|e| e.to_string())?;
        Ok(b.chunks_exact(8)
            .map(|w| i64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
            .collect())
    })();
    temps.release(c);
    res
}

/// `_grouped_mm(a, b, offs)`: `[M, K] × [G, K, N]` (row groups of `a`), `[M, K] × [K, N]`
/// (groups of the contraction, giving `[G, M, N]`) or `[G, M, K] × [G, K, N]` without offsets.
pub fn grouped_mm(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let (a, b) = (tensor(env, 0)?, tensor(env, 1)?);
    if matches!(env.arg_or_kw(3, "bias"), Some(Arg::Node(_))) {
        return Err("a bias in a grouped matrix product is not supported (nor by torch)".into());
    }
    let dt = out_dtype(env, a.dtype);
    let offs = match env.arg_or_kw(2, "offs") {
        Some(o @ Arg::Node(_)) => Some(read_offsets(c, env.tensor(o)?)?),
        _ => None,
    };
    let mismatch = || format!("grouped matrix product of {:?} and {:?}", a.shape, b.shape);
    let need = || {
        offs.clone()
            .ok_or_else(|| "group offsets are needed when an operand is 2-d".to_string())
    };
    let e = elem(dt)?;
    let bytes = e.bytes() as u64;
    let mut temps = Temps(vec![]);
    let res = (|| match (a.shape.len(), b.shape.len()) {
        (2, 3) => {
            let (m, k) = (a.shape[0], a.shape[1]);
            let (g, kb, n) = (b.shape[0], b.shape[1], b.shape[2]);
            if k != kb {
                return Err(mismatch());
            }
            let ranges = group_ranges(&need()?, m)?;
            if ranges.len() != g {
                return Err(format!("{} group offsets for {g} matrices", ranges.len()));
            }
            let ac = dense(c, a, dt, &mut temps)?;
            let bc = dense(c, b, dt, &mut temps)?;
            let out = c.full(dt, &[m, n], 0.0)?;
            for (i, &(lo, hi)) in ranges.iter().enumerate() {
                if hi == lo {
                    continue;
                }
                let gm = Gemm {
                    m: hi - lo,
                    n,
                    k,
                    batch: 1,
                    trans_a: false,
                    trans_b: false,
                    stride_a: 0,
                    stride_b: 0,
                    elem: e,
                };
                let r = c.blas.gemm(
                    &gm,
                    ac.block.ptr + (lo * k) as u64 * bytes,
                    bc.block.ptr + (i * k * n) as u64 * bytes,
                    out.block.ptr + (lo * n) as u64 * bytes,
                );
                if let Err(err) = r {
                    c.release(&out);
                    return Err(err.to_string());
                }
            }
            Ok(out)
        }
        (2, 2) => {
            let (m, k) = (a.shape[0], a.shape[1]);
            let (kb, n) = (b.shape[0], b.shape[1]);
            if k != kb {
                return Err(mismatch());
            }
            let ranges = group_ranges(&need()?, k)?;
            // `a`'s column groups are read as rows of its transpose.
            let at = a.restride(vec![k, m], vec![a.strides[1], a.strides[0]], a.offset);
            let atc = dense(c, &at, dt, &mut temps)?;
            let bc = dense(c, b, dt, &mut temps)?;
            let out = c.full(dt, &[ranges.len(), m, n], 0.0)?;
            for (i, &(lo, hi)) in ranges.iter().enumerate() {
                if hi == lo {
                    continue;
                }
                let gm = Gemm {
                    m,
                    n,
                    k: hi - lo,
                    batch: 1,
                    trans_a: true,
                    trans_b: false,
                    stride_a: 0,
                    stride_b: 0,
                    elem: e,
                };
                let r = c.blas.gemm(
                    &gm,
                    atc.block.ptr + (lo * m) as u64 * bytes,
                    bc.block.ptr + (lo * n) as u64 * bytes,
                    out.block.ptr + (i * m * n) as u64 * bytes,
                );
                if let Err(err) = r {
                    c.release(&out);
                    return Err(err.to_string());
                }
            }
            Ok(out)
        }
        (3, 3) if offs.is_none() => product(c, a, b, dt),
        (3, 3) => Err("group offsets given for two 3-d operands".into()),
        (p, q) => Err(format!(
            "grouped matrix product of {p}-d and {q}-d operands (the GPU takes 2-d×3-d, 2-d×2-d and 3-d×3-d)"
        )),
    })();
    temps.release(c);
    one(res?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_ranges_follow_cumulative_ends_and_refuse_decreasing_ones() {
        assert_eq!(
            group_ranges(&[2, 2, 5], 5).unwrap(),
            vec![(0, 2), (2, 2), (2, 5)]
        );
        assert!(group_ranges(&[3, 2], 5).is_err());
        assert!(group_ranges(&[6], 5).is_err());
    }
}
