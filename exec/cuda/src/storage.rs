//! Host tensors to and from the bytes a device buffer stores, on every core of the host: a
//! numeric step at real size moves tens of gigabytes of inputs and outputs, which one core
//! converts slower than the GPU runs the step. Floats round to nearest even; each element
//! converts on its own, so the bytes do not depend on how the work is split.

use crate::kernels::source::Elem;
use rayon::prelude::*;
use zerosched_exec::host::{self, Data};
use zerosched_ir::Dtype;

/// Elements converted per task: large enough that scheduling costs nothing beside them.
const CHUNK: usize = 1 << 16;

/// Writes `x` as `e` stores it into `out` (`e.bytes()` long).
fn put(e: Elem, x: f64, out: &mut [u8]) {
    match e {
        Elem::F32 => out.copy_from_slice(&(x as f32).to_le_bytes()),
        Elem::BF16 => out.copy_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
        Elem::F16 => out.copy_from_slice(&half::f16::from_f64(x).to_le_bytes()),
        Elem::I64 => out.copy_from_slice(&(x as i64).to_le_bytes()),
        Elem::I32 => out.copy_from_slice(&(x as i32).to_le_bytes()),
        Elem::Bool => out[0] = u8::from(x != 0.0),
    }
}

/// The value of one element `e` stores in `c` (`e.bytes()` long).
fn get(e: Elem, c: &[u8]) -> f64 {
    match e {
        Elem::F32 => f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        Elem::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f64(),
        Elem::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f64(),
        Elem::I64 => i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f64,
        Elem::I32 => f64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        Elem::Bool => f64::from(c[0]),
    }
}

/// Writes integer `x` as `e` stores it: integers stay exact (through f64 one above 2^53 would
/// not).
fn put_int(e: Elem, x: i64, out: &mut [u8]) {
    match e {
        Elem::I64 => out.copy_from_slice(&x.to_le_bytes()),
        Elem::I32 => out.copy_from_slice(&(x as i32).to_le_bytes()),
        _ => put(e, x as f64, out),
    }
}

/// The integer one element `e` stores in `c`.
fn get_int(e: Elem, c: &[u8]) -> i64 {
    match e {
        Elem::I64 => i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]),
        Elem::I32 => i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        _ => get(e, c) as i64,
    }
}

/// Storage bytes of `v` in `e`.
pub(crate) fn encode(e: Elem, v: &[f64]) -> Vec<u8> {
    let mut b = vec![0u8; v.len() * e.bytes()];
    fill(e, &mut b, v, |&x, o| put(e, x, o));
    b
}

/// Storage bytes of a host tensor's elements in `e`, in row-major order.
pub(crate) fn encode_tensor(e: Elem, t: &host::Tensor) -> Vec<u8> {
    let mut b = vec![0u8; t.numel() * e.bytes()];
    match &t.data {
        Data::F32(a) => fill(e, &mut b, &host::row_major(a), |&x, o| put(e, x.into(), o)),
        Data::F64(a) => fill(e, &mut b, &host::row_major(a), |&x, o| put(e, x, o)),
        Data::I64(a) => fill(e, &mut b, &host::row_major(a), |&x, o| put_int(e, x, o)),
        Data::Bool(a) => fill(e, &mut b, &host::row_major(a), |&x, o| {
            put_int(e, i64::from(x), o)
        }),
    }
    b
}

/// Writes each element of `v` into its `e.bytes()` of `out` with `put`.
fn fill<T: Sync>(e: Elem, out: &mut [u8], v: &[T], put: impl Fn(&T, &mut [u8]) + Sync) {
    let w = e.bytes();
    out.par_chunks_mut(CHUNK * w)
        .zip(v.par_chunks(CHUNK))
        .for_each(|(o, v)| {
            for (o, x) in o.chunks_exact_mut(w).zip(v) {
                put(x, o);
            }
        });
}

/// A host tensor of `dtype` (held as the host holds that dtype) from the bytes `e` stores.
pub(crate) fn decode_tensor(
    dtype: Dtype,
    shape: &[usize],
    e: Elem,
    bytes: &[u8],
) -> Result<host::Tensor, String> {
    fn arr<T: Send + Clone>(
        shape: &[usize],
        e: Elem,
        bytes: &[u8],
        f: impl Fn(&[u8]) -> T + Sync + Send,
    ) -> Result<host::Arr<T>, String> {
        let mut v = Vec::new();
        bytes
            .par_chunks_exact(e.bytes())
            .map(f)
            .collect_into_vec(&mut v);
        ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(shape), v)
            .map(ndarray::ArrayD::into_shared)
            .map_err(|e| e.to_string())
    }
    let data = match host::kind(dtype)? {
        host::Kind::F32 => Data::F32(arr(shape, e, bytes, |c| get(e, c) as f32)?),
        host::Kind::F64 => Data::F64(arr(shape, e, bytes, |c| get(e, c))?),
        host::Kind::I64 => Data::I64(arr(shape, e, bytes, |c| get_int(e, c))?),
        host::Kind::Bool => Data::Bool(arr(shape, e, bytes, |c| get(e, c) != 0.0)?),
    };
    Ok(host::Tensor { dtype, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(e: Elem, b: &[u8]) -> Vec<f64> {
        b.chunks_exact(e.bytes()).map(|c| get(e, c)).collect()
    }

    #[test]
    fn storage_bytes_round_trip_per_dtype() {
        for (e, v) in [
            (Elem::F32, 1.5),
            (Elem::BF16, -2.0),
            (Elem::F16, 0.25),
            (Elem::I64, -7.0),
            (Elem::I32, 9.0),
            (Elem::Bool, 1.0),
        ] {
            assert_eq!(decode(e, &encode(e, &[v])), vec![v], "{e:?}");
        }
        assert_eq!(
            decode(Elem::BF16, &encode(Elem::BF16, &[1.0 + 1.0 / 256.0])),
            vec![1.0],
            "bf16 rounds to nearest even"
        );
    }

    /// A tensor larger than one task's chunk, not in row-major layout, goes through the bytes
    /// and back as its row-major elements.
    #[test]
    fn a_transposed_tensor_of_several_chunks_round_trips_in_row_major_order() {
        let (r, c) = (3, CHUNK / 2 + 7);
        let a = ndarray::Array2::from_shape_fn((c, r), |(j, i)| (i * c + j) as f32 / 8.0);
        let t = host::Tensor {
            dtype: Dtype::Float32,
            data: Data::F32(a.reversed_axes().into_dyn().into_shared()),
        };
        assert!(!matches!(&t.data, Data::F32(a) if a.is_standard_layout()));
        let bytes = encode_tensor(Elem::F32, &t);
        let back = decode_tensor(Dtype::Float32, &[r, c], Elem::F32, &bytes).unwrap();
        assert_eq!(back.to_f64_vec(), t.to_f64_vec());
        let bf = decode_tensor(
            Dtype::BFloat16,
            &[r, c],
            Elem::BF16,
            &encode_tensor(Elem::BF16, &t),
        )
        .unwrap();
        let want: Vec<f64> = t
            .to_f64_vec()
            .iter()
            .map(|&x| half::bf16::from_f64(x).to_f64())
            .collect();
        assert_eq!(bf.to_f64_vec(), want);
    }

    /// An int64 beyond f64's 53 bits of integers (a hash, a large index) goes up and comes
    /// back exact.
    #[test]
    fn an_int64_above_2_to_the_53_round_trips_exactly() {
        let x = (1i64 << 53) + 1;
        let t = host::Tensor {
            dtype: Dtype::Int64,
            data: Data::I64(ndarray::arr1(&[x, -x]).into_dyn().into_shared()),
        };
        let back = decode_tensor(Dtype::Int64, &[2], Elem::I64, &encode_tensor(Elem::I64, &t));
        assert!(back.unwrap().bitwise_eq(&t));
    }
}
