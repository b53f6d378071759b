//! 2-d convolution (`convolution`, `convolution_backward`) as im2col and one batched cuBLAS
//! product: `out[n] = W · cols[n]`; the weight gradient `Σₙ gO[n] · cols[n]ᵀ`, the bias
//! gradient a sum, the input gradient `col2im(Wᵀ · gO[n])`. Groups of one, not transposed.

use super::{CudaTensor, Env, Temps, Value, dense};
use crate::backend::{Cuda, elem, ints, one, out_dtype, reduce_dims, tensor};
use crate::kernels::image::Conv2d;
use crate::kernels::source::Reduce;
use crate::matmul::Gemm;
use zerosched_ir::{Arg, NodeId};

fn pair(a: &Arg<NodeId>, what: &str) -> Result<[usize; 2], String> {
    let v = ints(a)?;
    let get = |i: usize| v.get(i).or(v.first()).copied().unwrap_or(0);
    let (x, y) = (get(0), get(1));
    if x < 0 || y < 0 || v.is_empty() || v.len() > 2 {
        return Err(format!("convolution {what} {v:?}"));
    }
    Ok([x as usize, y as usize])
}

/// The geometry of `input` `[n, c, h, w]` under `weight` `[o, c, kh, kw]` with the
/// convolution's `(stride, padding, dilation, transposed, output_padding, groups)` at `at`.
fn geometry(
    env: &Env<'_, CudaTensor>,
    x: &CudaTensor,
    w: &CudaTensor,
    at: usize,
) -> Result<Conv2d, String> {
    let (&[n, ch, h, wd], &[_, wc, kh, kw]) = (x.shape.as_slice(), w.shape.as_slice()) else {
        return Err(format!(
            "convolution of {:?} by {:?} (the GPU takes 2-d convolutions)",
            x.shape, w.shape
        ));
    };
    if matches!(env.arg(at + 3)?, Arg::Bool(true)) {
        return Err("transposed convolution is not supported on the GPU".into());
    }
    if crate::backend::int(env.arg(at + 5)?)? != 1 || wc != ch {
        return Err("grouped convolution is not supported on the GPU".into());
    }
    let g = Conv2d {
        n,
        c: ch,
        h,
        w: wd,
        kh,
        kw,
        stride: pair(env.arg(at)?, "stride")?,
        pad: pair(env.arg(at + 1)?, "padding")?,
        dil: pair(env.arg(at + 2)?, "dilation")?,
    };
    if g.stride.contains(&0) || g.dil.contains(&0) || g.out_hw().is_none() {
        return Err(format!("convolution geometry {g:?}"));
    }
    Ok(g)
}

/// `im2col` of `x`: `[n, c*kh*kw, oh*ow]`, pushed to `temps`.
fn columns(
    c: &mut Cuda,
    x: &CudaTensor,
    g: &Conv2d,
    temps: &mut Temps,
) -> Result<CudaTensor, String> {
    let [oh, ow] = g.out_hw().unwrap_or([0, 0]);
    let cols = c.empty(x.dtype, &[g.n, g.c * g.kh * g.kw, oh * ow])?;
    temps.0.push(cols.clone());
    c.k.image(false, x.elem()?, cols.block.ptr, x.block.ptr, g)
        .map_err(|e| e.to_string())?;
    Ok(cols)
}

/// `convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
/// groups)`.
pub fn convolution(c: &mut Cuda, env: &Env<'_, CudaTensor>) -> Result<Value<CudaTensor>, String> {
    let (x, w) = (tensor(env, 0)?, tensor(env, 1)?);
    let bias = match env.arg(2)? {
        a @ Arg::Node(_) => Some(env.tensor(a)?),
        _ => None,
    };
    let g = geometry(env, x, w, 3)?;
    let dt = out_dtype(env, x.dtype);
    let [oh, ow] = g.out_hw().unwrap_or([0, 0]);
    let o = w.shape[0];
    let mut temps = Temps(vec![]);
    let res = (|| {
        let xc = dense(c, x, dt, &mut temps)?;
        let wc = dense(c, w, dt, &mut temps)?;
        let cols = columns(c, &xc, &g, &mut temps)?;
        let ck = g.c * g.kh * g.kw;
        let out = c.empty(dt, &[g.n, o, oh, ow])?;
        let gm = Gemm {
            m: o,
            n: oh * ow,
            k: ck,
            batch: g.n,
            trans_a: false,
            trans_b: false,
            stride_a: 0,
            stride_b: ck * oh * ow,
            elem: elem(dt)?,
        };
        if let Err(e) = c
            .blas
            .gemm(&gm, wc.block.ptr, cols.block.ptr, out.block.ptr)
        {
            c.release(&out);
            return Err(e.to_string());
        }
        let Some(b) = bias else { return Ok(out) };
        let b = b.restride(
            vec![o, 1, 1],
            vec![b.strides.first().copied().unwrap_or(1), 0, 0],
            b.offset,
        );
        let r = c.ew("add", &[&out, &b], dt, 1.0);
        c.release(&out);
        r
    })();
    temps.release(c);
    one(res?)
}

/// `convolution_backward(grad, input, weight, bias_sizes, stride, padding, dilation,
/// transposed, output_padding, groups, output_mask)`: `[grad_input, grad_weight, grad_bias]`.
pub fn convolution_backward(
    c: &mut Cuda,
    env: &Env<'_, CudaTensor>,
) -> Result<Value<CudaTensor>, String> {
    let (go, x, w) = (tensor(env, 0)?, tensor(env, 1)?, tensor(env, 2)?);
    let g = geometry(env, x, w, 4)?;
    let mask: Vec<bool> = match env.arg_or_kw(10, "output_mask") {
        Some(Arg::List(l)) => l.iter().map(|a| matches!(a, Arg::Bool(true))).collect(),
        _ => vec![true; 3],
    };
    let want = |k: usize| mask.get(k).copied().unwrap_or(true);
    let dt = out_dtype(env, x.dtype);
    let e = elem(dt)?;
    let [oh, ow] = g.out_hw().unwrap_or([0, 0]);
    let (o, ck, l) = (w.shape[0], g.c * g.kh * g.kw, oh * ow);
    if go.shape != [g.n, o, oh, ow] {
        return Err(format!(
            "convolution gradient {:?} for output [{}, {o}, {oh}, {ow}]",
            go.shape, g.n
        ));
    }
    let mut temps = Temps(vec![]);
    let mut made: Vec<CudaTensor> = vec![];
    let res = (|| {
        let gc = dense(c, go, dt, &mut temps)?;
        let mut outs: Vec<Option<CudaTensor>> = vec![None, None, None];
        if want(0) {
            let wc = dense(c, w, dt, &mut temps)?;
            let dcols = c.empty(dt, &[g.n, ck, l])?;
            temps.0.push(dcols.clone());
            let gm = Gemm {
                m: ck,
                n: l,
                k: o,
                batch: g.n,
                trans_a: true,
                trans_b: false,
                stride_a: 0,
                stride_b: o * l,
                elem: e,
            };
            c.blas
                .gemm(&gm, wc.block.ptr, gc.block.ptr, dcols.block.ptr)
                .map_err(|e| e.to_string())?;
            let dx = c.empty(dt, &x.shape.clone())?;
            made.push(dx.clone());
            c.k.image(true, e, dx.block.ptr, dcols.block.ptr, &g)
                .map_err(|e| e.to_string())?;
            outs[0] = Some(dx);
        }
        if want(1) {
            let xc = dense(c, x, dt, &mut temps)?;
            let cols = columns(c, &xc, &g, &mut temps)?;
            // Per image gO[n] · cols[n]ᵀ, then summed over the images.
            let per = c.empty(dt, &[g.n, o, ck])?;
            temps.0.push(per.clone());
            let gm = Gemm {
                m: o,
                n: ck,
                k: l,
                batch: g.n,
                trans_a: false,
                trans_b: true,
                stride_a: o * l,
                stride_b: ck * l,
                elem: e,
            };
            c.blas
                .gemm(&gm, gc.block.ptr, cols.block.ptr, per.block.ptr)
                .map_err(|e| e.to_string())?;
            let dw = reduce_dims(c, &per, &[0], false, Reduce::Sum, dt)?;
            made.push(dw.clone());
            outs[1] = Some(dw.restride(
                w.shape.clone(),
                crate::kernels::contiguous_strides(&w.shape),
                0,
            ));
        }
        if want(2) {
            let db = reduce_dims(c, &gc, &[0, 2, 3], false, Reduce::Sum, dt)?;
            made.push(db.clone());
            outs[2] = Some(db);
        }
        Ok(Value::List(outs))
    })();
    temps.release(c);
    if res.is_err() {
        for t in &made {
            c.release(t);
        }
    }
    res
}
