//! `convolution` and `convolution_backward`, 1-d and 2-d (a 1-d convolution is a 2-d one of
//! height 1), with stride, padding, dilation and groups, by the definition
//! `y[n, o, i, j] = b[o] + sum over c in o's group, p, q of x[n, c, i s - pad + p d, ...] w[o, c, p, q]`
//! (direct loops: the graphs' convolutions are patch embeddings, not the hot path).
//! Transposed convolutions are refused.

use super::{Env, Value, flag, int, ints, one, out_dtype};
use crate::real::{Real, by_real};
use ndarray::{ArrayD, IxDyn};
use zerosched_exec::host::Tensor;
use zerosched_ir::Arg;

/// Sizes and hyper-parameters, every spatial list as 2-d.
struct Conv {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    stride: [usize; 2],
    pad: [usize; 2],
    dil: [usize; 2],
    groups: usize,
    /// The input's spatial rank (1 or 2), for the shapes of the results.
    rank: usize,
}

fn pair(a: &Arg<zerosched_ir::NodeId>, rank: usize, what: &str) -> Result<[usize; 2], String> {
    let v: Vec<usize> = ints(a)?
        .into_iter()
        .map(|x| usize::try_from(x).map_err(|_| format!("convolution: negative {what} {x}")))
        .collect::<Result<_, _>>()?;
    match (rank, v.as_slice()) {
        (_, [x]) => Ok(if rank == 1 { [1, *x] } else { [*x, *x] }),
        (2, [x, y]) => Ok([*x, *y]),
        _ => Err(format!(
            "convolution: {what} {v:?} for {rank} spatial dimensions"
        )),
    }
}

impl Conv {
    /// From the input and weight shapes and the arguments from `first` on (stride, padding,
    /// dilation, transposed, output_padding, groups).
    fn new(x: &[usize], wt: &[usize], env: &Env<'_, Tensor>, first: usize) -> Result<Conv, String> {
        let rank = x.len().saturating_sub(2);
        if !(1..=2).contains(&rank) || wt.len() != x.len() {
            return Err(format!(
                "convolution: input {x:?}, weight {wt:?} (1-d and 2-d only)"
            ));
        }
        if flag(env.node().args.get(first + 3), false) {
            return Err("convolution: transposed convolution is not implemented".into());
        }
        let sp = |s: &[usize]| if rank == 1 { [1, s[2]] } else { [s[2], s[3]] };
        let ([h, w], [kh, kw]) = (sp(x), sp(wt));
        let stride = pair(env.arg(first)?, rank, "stride")?;
        let pad = if rank == 1 {
            let p = pair(env.arg(first + 1)?, rank, "padding")?;
            [0, p[1]]
        } else {
            pair(env.arg(first + 1)?, rank, "padding")?
        };
        let dil = pair(env.arg(first + 2)?, rank, "dilation")?;
        let groups = usize::try_from(int(env.arg(first + 5)?)?).unwrap_or(0);
        let (c, o) = (x[1], wt[0]);
        if groups == 0 || c % groups != 0 || o % groups != 0 || wt[1] * groups != c {
            return Err(format!(
                "convolution: {c} input and {o} output channels, weight {wt:?}, {groups} groups"
            ));
        }
        let out = |n: usize, k: usize, i: usize| {
            (n + 2 * pad[i])
                .checked_sub(dil[i] * (k - 1) + 1)
                .map(|v| v / stride[i].max(1) + 1)
        };
        let (oh, ow) = match (out(h, kh, 0), out(w, kw, 1)) {
            (Some(a), Some(b)) if kh > 0 && kw > 0 => (a, b),
            _ => {
                return Err(format!(
                    "convolution: kernel {wt:?} larger than the padded input {x:?}"
                ));
            }
        };
        Ok(Conv {
            n: x[0],
            c,
            h,
            w,
            o,
            kh,
            kw,
            oh,
            ow,
            stride,
            pad,
            dil,
            groups,
            rank,
        })
    }

    /// The input position of output (i, j) and kernel tap (p, q), if inside the input.
    fn at(&self, i: usize, j: usize, p: usize, q: usize) -> Option<(usize, usize)> {
        let y = (i * self.stride[0] + p * self.dil[0]).checked_sub(self.pad[0])?;
        let x = (j * self.stride[1] + q * self.dil[1]).checked_sub(self.pad[1])?;
        (y < self.h && x < self.w).then_some((y, x))
    }

    fn shape(&self, a: usize, b: usize, h: usize, w: usize) -> Vec<usize> {
        if self.rank == 1 {
            vec![a, b, w]
        } else {
            vec![a, b, h, w]
        }
    }

    /// Calls `f(x index, w index, y index)` for every multiply of the convolution.
    fn each(&self, mut f: impl FnMut(usize, usize, usize)) {
        let (cg, og) = (self.c / self.groups, self.o / self.groups);
        for n in 0..self.n {
            for o in 0..self.o {
                let g = o / og;
                for i in 0..self.oh {
                    for j in 0..self.ow {
                        let yi = ((n * self.o + o) * self.oh + i) * self.ow + j;
                        for ci in 0..cg {
                            let c = g * cg + ci;
                            for p in 0..self.kh {
                                for q in 0..self.kw {
                                    if let Some((y, x)) = self.at(i, j, p, q) {
                                        let xi = ((n * self.c + c) * self.h + y) * self.w + x;
                                        let wi = ((o * cg + ci) * self.kh + p) * self.kw + q;
                                        f(xi, wi, yi);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn vals<T: Real>(t: &Tensor) -> Vec<T> {
    T::get(t).iter().copied().collect()
}

fn arr<T: Real>(v: Vec<T>, shape: &[usize], dt: zerosched_ir::Dtype) -> Result<Tensor, String> {
    T::wrap(
        ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| e.to_string())?,
        dt,
    )
}

fn fwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let (xt, wt) = (env.tensor(env.arg(0)?)?, env.tensor(env.arg(1)?)?);
    let cv = Conv::new(xt.shape(), wt.shape(), env, 3)?;
    let (x, w) = (vals::<T>(xt), vals::<T>(wt));
    let mut y = vec![T::zero(); cv.n * cv.o * cv.oh * cv.ow];
    cv.each(|xi, wi, yi| y[yi] += x[xi] * w[wi]);
    if let a @ Arg::Node(_) = env.arg(2)? {
        let b = vals::<T>(env.tensor(a)?);
        if b.len() != cv.o {
            return Err(format!(
                "convolution: bias of {} for {} channels",
                b.len(),
                cv.o
            ));
        }
        let plane = cv.oh * cv.ow;
        for (k, v) in y.iter_mut().enumerate() {
            *v += b[(k / plane) % cv.o];
        }
    }
    one(arr(
        y,
        &cv.shape(cv.n, cv.o, cv.oh, cv.ow),
        out_dtype(env, xt.dtype),
    )?)
}

fn bwd<T: Real>(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let gt = env.tensor(env.arg(0)?)?;
    let (xt, wt) = (env.tensor(env.arg(1)?)?, env.tensor(env.arg(2)?)?);
    let cv = Conv::new(xt.shape(), wt.shape(), env, 4)?;
    let (g, x, w) = (vals::<T>(gt), vals::<T>(xt), vals::<T>(wt));
    if g.len() != cv.n * cv.o * cv.oh * cv.ow {
        return Err(format!(
            "convolution_backward: gradient {:?} for output {:?}",
            gt.shape(),
            cv.shape(cv.n, cv.o, cv.oh, cv.ow)
        ));
    }
    let mask: Vec<bool> = match env.node().args.get(10) {
        Some(Arg::List(l)) => l.iter().map(|a| matches!(a, Arg::Bool(true))).collect(),
        _ => vec![true; 3],
    };
    let on = |k: usize| mask.get(k).copied().unwrap_or(true);
    let dt = |k: usize, t: &Tensor| env.out_meta_k(k).map_or(t.dtype, |m| m.dtype);
    let mut dx = vec![T::zero(); if on(0) { x.len() } else { 0 }];
    let mut dw = vec![T::zero(); if on(1) { w.len() } else { 0 }];
    cv.each(|xi, wi, yi| {
        if let Some(v) = dx.get_mut(xi) {
            *v += w[wi] * g[yi];
        }
        if let Some(v) = dw.get_mut(wi) {
            *v += x[xi] * g[yi];
        }
    });
    let plane = cv.oh * cv.ow;
    let mut db = vec![T::zero(); cv.o];
    for (k, &v) in g.iter().enumerate() {
        db[(k / plane) % cv.o] += v;
    }
    Ok(Value::List(vec![
        if on(0) {
            Some(arr(dx, xt.shape(), dt(0, xt))?)
        } else {
            None
        },
        if on(1) {
            Some(arr(dw, wt.shape(), dt(1, wt))?)
        } else {
            None
        },
        if on(2) {
            Some(arr(db, &[cv.o], dt(2, gt))?)
        } else {
            None
        },
    ]))
}

/// `convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)`.
pub fn convolution(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(0)?)?.dtype, "convolution", T => fwd::<T>(env))
}

/// `convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
/// output_padding, groups, output_mask)` → (grad_input, grad_weight, grad_bias).
pub fn convolution_backward(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    by_real!(env.tensor(env.arg(1)?)?.dtype, "convolution_backward", T => bwd::<T>(env))
}

#[cfg(test)]
mod tests {
    use crate::testkit::{f32s, run1};

    /// A kernel larger than the padded input is an error naming the shapes, not a panic.
    #[test]
    fn kernel_larger_than_the_input_is_refused() {
        let x = f32s(&[1, 1, 2, 2], &[1.0; 4]);
        let w = f32s(&[1, 1, 3, 3], &[1.0; 9]);
        let args = r#"[{"node":"x0"},{"node":"x1"},null,[1,1],[0,0],[1,1],false,[0,0],1]"#;
        let meta = r#"{"dtype":"float32","shape":[1,1,1,1]}"#;
        let err =
            run1("aten.convolution.default", &[x.clone(), w], args, meta).expect_err("too large");
        assert!(err.contains("larger than the padded input"), "{err}");
        // With padding 1 it fits: one output, the sum of the four inputs.
        let w = f32s(&[1, 1, 3, 3], &[1.0; 9]);
        let args = r#"[{"node":"x0"},{"node":"x1"},null,[1,1],[1,1],[1,1],false,[0,0],1]"#;
        let out = run1(
            "aten.convolution.default",
            &[x, w],
            args,
            r#"{"dtype":"float32","shape":[1,1,2,2]}"#,
        )
        .expect("run");
        assert_eq!(out[0].as_ref().expect("tensor").to_f64_vec(), [4.0; 4]);
    }
}
