//! 2-d pooling over `[N, C, H, W]` or `[C, H, W]` inputs and its backward, by torch's CPU
//! loops: `max_pool2d_with_indices` (indices are flat positions `h * W + w` in the input's
//! plane; a NaN wins its window, the last one if several; a window of `-inf` points at its first
//! element), `avg_pool2d` (padding counted or not, a divisor override), `_adaptive_avg_pool2d`
//! (window `[floor(o I / O), ceil((o + 1) I / O))`), each with its backward.

use super::{Env, Value, flag, int, ints, one, out_dtype};
use crate::real::{Real, by_real};
use ndarray::{ArrayD, IxDyn};
use zerosched_exec::host::{Elem, Tensor};
use zerosched_ir::{Arg, Dtype};

/// An input's planes (`N * C`) and spatial size, and the shape before them.
struct Planes {
    lead: Vec<usize>,
    planes: usize,
    h: usize,
    w: usize,
}

fn planes(shape: &[usize], what: &str) -> Result<Planes, String> {
    match shape {
        [lead @ .., h, w] if (1..=2).contains(&lead.len()) => Ok(Planes {
            lead: lead.to_vec(),
            planes: lead.iter().product(),
            h: *h,
            w: *w,
        }),
        _ => Err(format!(
            "{what}: input of shape {shape:?} (3-d or 4-d only)"
        )),
    }
}

impl Planes {
    fn shape(&self, oh: usize, ow: usize) -> Vec<usize> {
        let mut s = self.lead.clone();
        s.extend([oh, ow]);
        s
    }
}

/// A 1- or 2-element list as (height, width); an empty list is `default`.
fn pair(
    a: Option<&Arg<zerosched_ir::NodeId>>,
    default: [i64; 2],
    what: &str,
) -> Result<[i64; 2], String> {
    let v = match a {
        None | Some(Arg::None) => Vec::new(),
        Some(a) => ints(a)?,
    };
    match v.as_slice() {
        [] => Ok(default),
        [x] => Ok([*x, *x]),
        [x, y] => Ok([*x, *y]),
        _ => Err(format!("pooling: {what} {v:?} is not 1 or 2 values")),
    }
}

/// Window sizes, strides, padding and dilation, and the output size they give.
struct Window {
    k: [i64; 2],
    s: [i64; 2],
    p: [i64; 2],
    d: [i64; 2],
    out: [usize; 2],
}

fn out_size(input: i64, k: i64, s: i64, p: i64, d: i64, ceil: bool) -> i64 {
    let num = input + 2 * p - d * (k - 1) - 1 + if ceil { s - 1 } else { 0 };
    let mut o = num.div_euclid(s) + 1;
    // The last window must start inside the input or its left padding.
    if ceil && (o - 1) * s >= input + p {
        o -= 1;
    }
    o
}

/// The window of arguments 1.. (kernel, stride, padding, then dilation when `dilated`).
fn window(
    env: &Env<'_, Tensor>,
    pl: &Planes,
    first: usize,
    dilated: bool,
) -> Result<Window, String> {
    let args = &env.node().args;
    let k = pair(args.get(first), [0, 0], "kernel_size")?;
    let s = pair(args.get(first + 1), k, "stride")?;
    let p = pair(args.get(first + 2), [0, 0], "padding")?;
    let d = if dilated {
        pair(args.get(first + 3), [1, 1], "dilation")?
    } else {
        [1, 1]
    };
    let ceil = flag(args.get(first + if dilated { 4 } else { 3 }), false);
    if k.iter().chain(&s).chain(&d).any(|&x| x <= 0) || p.iter().any(|&x| x < 0) {
        return Err(format!(
            "pooling: kernel {k:?}, stride {s:?}, padding {p:?}, dilation {d:?}"
        ));
    }
    if p[0] * 2 > k[0] || p[1] * 2 > k[1] {
        return Err(format!(
            "pooling: padding {p:?} is more than half the kernel {k:?}"
        ));
    }
    let dims = [pl.h as i64, pl.w as i64];
    let mut out = [0usize; 2];
    for i in 0..2 {
        let o = out_size(dims[i], k[i], s[i], p[i], d[i], ceil);
        out[i] = usize::try_from(o)
            .ok()
            .filter(|&o| o > 0)
            .ok_or_else(|| format!("pooling: input {dims:?} is smaller than the kernel {k:?}"))?;
    }
    Ok(Window { k, s, p, d, out })
}

fn arr<T: Elem>(v: Vec<T>, shape: &[usize], dt: Dtype) -> Result<Tensor, String> {
    T::wrap(
        ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| e.to_string())?,
        dt,
    )
}

fn vals<T: Real>(t: &Tensor) -> Vec<T> {
    T::get(t).iter().copied().collect()
}

fn max_fwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let xt = env.tensor(env.arg(0)?)?;
    let pl = planes(xt.shape(), "max_pool2d")?;
    let wd = window(env, &pl, 1, true)?;
    let x = vals::<T>(xt);
    let [oh, ow] = wd.out;
    let (h, w) = (pl.h as i64, pl.w as i64);
    let mut y = Vec::with_capacity(pl.planes * oh * ow);
    let mut idx = Vec::with_capacity(pl.planes * oh * ow);
    for p in 0..pl.planes {
        let plane = &x[p * pl.h * pl.w..(p + 1) * pl.h * pl.w];
        for i in 0..oh as i64 {
            for j in 0..ow as i64 {
                let mut h0 = i * wd.s[0] - wd.p[0];
                let mut w0 = j * wd.s[1] - wd.p[1];
                let h1 = (h0 + (wd.k[0] - 1) * wd.d[0] + 1).min(h);
                let w1 = (w0 + (wd.k[1] - 1) * wd.d[1] + 1).min(w);
                while h0 < 0 {
                    h0 += wd.d[0];
                }
                while w0 < 0 {
                    w0 += wd.d[1];
                }
                let (mut best, mut at) = (T::neg_infinity(), h0 * w + w0);
                let mut r = h0;
                while r < h1 {
                    let mut c = w0;
                    while c < w1 {
                        let v = plane[(r * w + c) as usize];
                        if v > best || v.is_nan() {
                            best = v;
                            at = r * w + c;
                        }
                        c += wd.d[1];
                    }
                    r += wd.d[0];
                }
                y.push(best);
                idx.push(at);
            }
        }
    }
    let shape = pl.shape(oh, ow);
    let d0 = env.out_meta_k(0).map_or(xt.dtype, |m| m.dtype);
    Ok(Value::List(vec![
        Some(arr(y, &shape, d0)?),
        Some(arr(idx, &shape, Dtype::Int64)?),
    ]))
}

/// `max_pool2d_with_indices(x, kernel, stride=[], padding=0, dilation=1, ceil_mode=False)`.
pub fn max_pool2d(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(0)?)?.dtype, "max_pool2d_with_indices", T => max_fwd::<T>(env))
}

fn max_bwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (gt, xt) = (env.tensor(env.arg(0)?)?, env.tensor(env.arg(1)?)?);
    let it = env.tensor(env.arg(7)?)?;
    let pl = planes(xt.shape(), "max_pool2d_with_indices_backward")?;
    let (g, idx) = (
        vals::<T>(gt),
        i64::get(it).iter().copied().collect::<Vec<_>>(),
    );
    if g.len() != idx.len() || pl.planes == 0 || g.len() % pl.planes != 0 {
        return Err(format!(
            "max_pool2d_with_indices_backward: gradient {:?}, indices {:?}, input {:?}",
            gt.shape(),
            it.shape(),
            xt.shape()
        ));
    }
    let per = g.len() / pl.planes;
    let area = pl.h * pl.w;
    let mut dx = vec![T::zero(); pl.planes * area];
    for (k, (&gv, &i)) in g.iter().zip(&idx).enumerate() {
        let i = usize::try_from(i)
            .ok()
            .filter(|&i| i < area)
            .ok_or_else(|| {
                format!("max_pool2d_with_indices_backward: index {i} outside a plane of {area}")
            })?;
        dx[(k / per) * area + i] += gv;
    }
    one(arr(dx, xt.shape(), out_dtype(env, xt.dtype))?)
}

/// `max_pool2d_with_indices_backward(grad, x, kernel, stride, padding, dilation, ceil_mode,
/// indices)`: each gradient to the position its index names.
pub fn max_pool2d_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(1)?)?.dtype, "max_pool2d_with_indices_backward", T => max_bwd::<T>(env))
}

/// An average window: its clamped bounds and the divisor.
struct Avg {
    h: [usize; 2],
    w: [usize; 2],
    div: i64,
}

fn avg_windows(
    env: &Env<'_, Tensor>,
    pl: &Planes,
    first: usize,
) -> Result<(Window, Vec<Avg>), String> {
    let wd = window(env, pl, first, false)?;
    let args = &env.node().args;
    let include_pad = flag(args.get(first + 4), true);
    let divisor = match args.get(first + 5) {
        None | Some(Arg::None) => None,
        Some(a) => Some(int(a)?).filter(|&d| d != 0),
    };
    let (h, w) = (pl.h as i64, pl.w as i64);
    let mut out = Vec::with_capacity(wd.out[0] * wd.out[1]);
    for i in 0..wd.out[0] as i64 {
        for j in 0..wd.out[1] as i64 {
            let h0 = i * wd.s[0] - wd.p[0];
            let w0 = j * wd.s[1] - wd.p[1];
            let h1 = (h0 + wd.k[0]).min(h + wd.p[0]);
            let w1 = (w0 + wd.k[1]).min(w + wd.p[1]);
            let pool = (h1 - h0) * (w1 - w0);
            let (h0, w0, h1, w1) = (h0.max(0), w0.max(0), h1.min(h), w1.min(w));
            let inside = (h1 - h0).max(0) * (w1 - w0).max(0);
            out.push(Avg {
                h: [h0 as usize, h1.max(h0) as usize],
                w: [w0 as usize, w1.max(w0) as usize],
                div: divisor.unwrap_or(if include_pad { pool } else { inside }),
            });
        }
    }
    Ok((wd, out))
}

fn avg_fwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let xt = env.tensor(env.arg(0)?)?;
    let pl = planes(xt.shape(), "avg_pool2d")?;
    let (wd, wins) = avg_windows(env, &pl, 1)?;
    let x = vals::<T>(xt);
    let mut y = Vec::with_capacity(pl.planes * wins.len());
    for p in 0..pl.planes {
        let base = p * pl.h * pl.w;
        for a in &wins {
            if a.h[0] >= a.h[1] || a.w[0] >= a.w[1] {
                y.push(T::zero());
                continue;
            }
            let mut s = T::zero();
            for r in a.h[0]..a.h[1] {
                for c in a.w[0]..a.w[1] {
                    s += x[base + r * pl.w + c];
                }
            }
            y.push(s / T::c(a.div as f64));
        }
    }
    one(arr(
        y,
        &pl.shape(wd.out[0], wd.out[1]),
        out_dtype(env, xt.dtype),
    )?)
}

/// `avg_pool2d(x, kernel, stride=[], padding=0, ceil_mode=False, count_include_pad=True,
/// divisor_override=None)`.
pub fn avg_pool2d(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(0)?)?.dtype, "avg_pool2d", T => avg_fwd::<T>(env))
}

fn avg_bwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (gt, xt) = (env.tensor(env.arg(0)?)?, env.tensor(env.arg(1)?)?);
    let pl = planes(xt.shape(), "avg_pool2d_backward")?;
    let (_, wins) = avg_windows(env, &pl, 2)?;
    let g = vals::<T>(gt);
    if g.len() != pl.planes * wins.len() {
        return Err(format!(
            "avg_pool2d_backward: gradient {:?} for input {:?}",
            gt.shape(),
            xt.shape()
        ));
    }
    let mut dx = vec![T::zero(); pl.planes * pl.h * pl.w];
    for p in 0..pl.planes {
        let base = p * pl.h * pl.w;
        for (k, a) in wins.iter().enumerate() {
            let gv = g[p * wins.len() + k] / T::c(a.div as f64);
            for r in a.h[0]..a.h[1] {
                for c in a.w[0]..a.w[1] {
                    dx[base + r * pl.w + c] += gv;
                }
            }
        }
    }
    one(arr(dx, xt.shape(), out_dtype(env, xt.dtype))?)
}

/// `avg_pool2d_backward(grad, x, kernel, stride, padding, ceil_mode, count_include_pad,
/// divisor_override)`.
pub fn avg_pool2d_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(1)?)?.dtype, "avg_pool2d_backward", T => avg_bwd::<T>(env))
}

/// Adaptive window `o` of `out` over `input` elements.
fn adaptive(o: usize, out: usize, input: usize) -> (usize, usize) {
    (o * input / out, ((o + 1) * input).div_ceil(out))
}

fn adaptive_out(env: &Env<'_, Tensor>, pl: &Planes) -> Result<[usize; 2], String> {
    let [oh, ow] = pair(env.node().args.get(1), [0, 0], "output_size")?;
    match (usize::try_from(oh), usize::try_from(ow)) {
        (Ok(oh), Ok(ow)) if oh > 0 && ow > 0 || pl.planes == 0 => Ok([oh, ow]),
        _ => Err(format!("_adaptive_avg_pool2d: output size {:?}", [oh, ow])),
    }
}

fn adaptive_fwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let xt = env.tensor(env.arg(0)?)?;
    let pl = planes(xt.shape(), "_adaptive_avg_pool2d")?;
    let [oh, ow] = adaptive_out(env, &pl)?;
    let x = vals::<T>(xt);
    let mut y = Vec::with_capacity(pl.planes * oh * ow);
    for p in 0..pl.planes {
        let base = p * pl.h * pl.w;
        for i in 0..oh {
            let (h0, h1) = adaptive(i, oh, pl.h);
            for j in 0..ow {
                let (w0, w1) = adaptive(j, ow, pl.w);
                let mut s = T::zero();
                for r in h0..h1 {
                    for c in w0..w1 {
                        s += x[base + r * pl.w + c];
                    }
                }
                y.push(s / T::c(((h1 - h0) * (w1 - w0)) as f64));
            }
        }
    }
    one(arr(y, &pl.shape(oh, ow), out_dtype(env, xt.dtype))?)
}

/// `_adaptive_avg_pool2d(x, output_size)`.
pub fn adaptive_avg_pool2d(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(0)?)?.dtype, "_adaptive_avg_pool2d", T => adaptive_fwd::<T>(env))
}

fn adaptive_bwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (gt, xt) = (env.tensor(env.arg(0)?)?, env.tensor(env.arg(1)?)?);
    let pl = planes(xt.shape(), "_adaptive_avg_pool2d_backward")?;
    let gs = gt.shape();
    let (oh, ow) = match gs {
        [.., oh, ow] if gs.len() == xt.shape().len() => (*oh, *ow),
        _ => {
            return Err(format!(
                "_adaptive_avg_pool2d_backward: gradient {gs:?} for input {:?}",
                xt.shape()
            ));
        }
    };
    let g = vals::<T>(gt);
    if g.len() != pl.planes * oh * ow {
        return Err(format!(
            "_adaptive_avg_pool2d_backward: gradient {gs:?} for input {:?}",
            xt.shape()
        ));
    }
    let mut dx = vec![T::zero(); pl.planes * pl.h * pl.w];
    for p in 0..pl.planes {
        let base = p * pl.h * pl.w;
        for i in 0..oh {
            let (h0, h1) = adaptive(i, oh, pl.h);
            for j in 0..ow {
                let (w0, w1) = adaptive(j, ow, pl.w);
                let gv = g[(p * oh + i) * ow + j] / T::c(((h1 - h0) * (w1 - w0)) as f64);
                for r in h0..h1 {
                    for c in w0..w1 {
                        dx[base + r * pl.w + c] += gv;
                    }
                }
            }
        }
    }
    one(arr(dx, xt.shape(), out_dtype(env, xt.dtype))?)
}

/// `_adaptive_avg_pool2d_backward(grad, x)`.
pub fn adaptive_avg_pool2d_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(1)?)?.dtype, "_adaptive_avg_pool2d_backward", T => adaptive_bwd::<T>(env))
}
