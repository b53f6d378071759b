//! Image kernels of 2-d convolution: `im2col` lays each output position's receptive field out
//! as a column (so a convolution is one cuBLAS product per image) and `col2im` sums columns
//! back into the image (the input gradient), each input element gathering the columns that
//! read it, so no atomics and a deterministic order.

use super::source::Elem;
use super::{KArg, Kernels, grid};
use crate::error::Result;

/// A 2-d convolution's geometry: input `[n, c, h, w]`, kernel `kh × kw`, stride, padding and
/// dilation per axis, output `oh × ow`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2d {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: [usize; 2],
    pub pad: [usize; 2],
    pub dil: [usize; 2],
}

impl Conv2d {
    /// Output height and width (torch's formula); `None` when the kernel does not fit.
    pub fn out_hw(&self) -> Option<[usize; 2]> {
        let one = |len: usize, k: usize, s: usize, p: usize, d: usize| {
            let span = d * (k.checked_sub(1)?) + 1;
            (len + 2 * p).checked_sub(span).map(|r| r / s.max(1) + 1)
        };
        Some([
            one(self.h, self.kh, self.stride[0], self.pad[0], self.dil[0])?,
            one(self.w, self.kw, self.stride[1], self.pad[1], self.dil[1])?,
        ])
    }

    fn args(&self) -> Vec<KArg> {
        let [oh, ow] = self.out_hw().unwrap_or([0, 0]);
        [
            self.n,
            self.c,
            self.h,
            self.w,
            self.kh,
            self.kw,
            self.stride[0],
            self.stride[1],
            self.pad[0],
            self.pad[1],
            self.dil[0],
            self.dil[1],
            oh,
            ow,
        ]
        .map(|v| KArg::I64(v as i64))
        .to_vec()
    }
}

const GEOMETRY: &str = "long long N, long long C, long long H, long long W, long long KH, long long KW, long long SH, long long SW, long long PH, long long PW, long long DH, long long DW, long long OH, long long OW";

pub fn im2col_name(e: Elem) -> String {
    format!("im2col_{}", e.tag())
}

/// `cols[n, (c*KH + i)*KW + j, y*OW + x] = img[n, c, y*SH - PH + i*DH, x*SW - PW + j*DW]`
/// (0 outside the image). Signature: `(cols, img, N, C, H, W, KH, KW, SH, SW, PH, PW, DH,
/// DW, OH, OW)`.
pub fn im2col(e: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({t}* __restrict__ cols, const {t}* __restrict__ img, {GEOMETRY}) {{
  long long total = N * C * KH * KW * OH * OW;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {{
    long long x = i % OW, y = (i / OW) % OH, j = (i / (OW * OH)) % KW, r = (i / (OW * OH * KW)) % KH;
    long long c = (i / (OW * OH * KW * KH)) % C, n = i / (OW * OH * KW * KH * C);
    long long iy = y * SH - PH + r * DH, ix = x * SW - PW + j * DW;
    cols[i] = (iy >= 0 && iy < H && ix >= 0 && ix < W) ? img[((n * C + c) * H + iy) * W + ix] : ({t})0;
  }}
}}
"#,
        name = im2col_name(e),
        t = e.ctype(),
    )
}

pub fn col2im_name(e: Elem) -> String {
    format!("col2im_{}", e.tag())
}

/// The adjoint of [`im2col`]: each image element sums the column entries that read it.
/// Signature: `(img, cols, N, C, H, W, KH, KW, SH, SW, PH, PW, DH, DW, OH, OW)`.
pub fn col2im(e: Elem) -> String {
    format!(
        r#"
extern "C" __global__ void {name}({t}* __restrict__ img, const {t}* __restrict__ cols, {GEOMETRY}) {{
  long long total = N * C * H * W;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {{
    long long ix = i % W, iy = (i / W) % H, c = (i / (W * H)) % C, n = i / (W * H * C);
    float acc = 0.0f;
    for (long long r = 0; r < KH; ++r) {{
      long long ty = iy + PH - r * DH;
      if (ty < 0 || ty % SH != 0 || ty / SH >= OH) continue;
      for (long long j = 0; j < KW; ++j) {{
        long long tx = ix + PW - j * DW;
        if (tx < 0 || tx % SW != 0 || tx / SW >= OW) continue;
        acc += ld_{g}(cols[((n * C + c) * KH * KW + r * KW + j) * OH * OW + (ty / SH) * OW + tx / SW]);
      }}
    }}
    img[i] = st_{g}(acc);
  }}
}}
"#,
        name = col2im_name(e),
        t = e.ctype(),
        g = e.tag(),
    )
}

impl Kernels {
    /// [`im2col`] (`backward` false: `a` the columns, `b` the image) or [`col2im`] (`a` the
    /// image, `b` the columns), both contiguous.
    pub fn image(&mut self, backward: bool, e: Elem, a: u64, b: u64, g: &Conv2d) -> Result<()> {
        let [oh, ow] = g.out_hw().unwrap_or([0, 0]);
        let mut args = vec![KArg::Ptr(a), KArg::Ptr(b)];
        args.extend(g.args());
        if backward {
            self.launch(
                &col2im_name(e),
                || Ok(col2im(e)),
                grid((g.n * g.c * g.h * g.w) as u64),
                &args,
            )
        } else {
            self.launch(
                &im2col_name(e),
                || Ok(im2col(e)),
                grid((g.n * g.c * g.kh * g.kw * oh * ow) as u64),
                &args,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_size_follows_torchs_formula() {
        let g = Conv2d {
            n: 2,
            c: 3,
            h: 16,
            w: 16,
            kh: 8,
            kw: 8,
            stride: [8, 8],
            pad: [0, 0],
            dil: [1, 1],
        };
        assert_eq!(g.out_hw(), Some([2, 2]), "vit's patch embedding");
        let padded = Conv2d {
            h: 5,
            w: 7,
            kh: 3,
            kw: 3,
            stride: [2, 1],
            pad: [1, 1],
            dil: [1, 2],
            ..g
        };
        assert_eq!(padded.out_hw(), Some([3, 5]));
        let too_big = Conv2d { kh: 17, ..g };
        assert_eq!(too_big.out_hw(), None);
    }
}
