//! The CUDA backend's op families beyond the elementwise, view, reduction and product ops of
//! [`crate::backend`], one module each, dispatched from [`crate::backend::resolve`]. Each
//! kernel reads its node's arguments as the CPU backend's kernel of the same target does and
//! writes the same values (within docs/exec.md's bounds).

pub mod attention;
pub mod conv;
pub mod create;
pub mod index;
pub mod linalg;
pub mod loss;
pub mod norm;
pub mod regions;
pub mod routing;

use crate::backend::{Cuda, CudaTensor};
use zerosched_exec::{Env, Value};
use zerosched_ir::Dtype;

/// Every temporary a kernel made, released on any exit.
pub(crate) struct Temps(pub Vec<CudaTensor>);

impl Temps {
    pub fn release(self, c: &mut Cuda) {
        for t in &self.0 {
            c.release(t);
        }
    }
}

/// A contiguous copy of `t` in `dt` unless it is one already (a copy joins `temps`).
pub(crate) fn dense(
    c: &mut Cuda,
    t: &CudaTensor,
    dt: Dtype,
    temps: &mut Temps,
) -> Result<CudaTensor, String> {
    if t.dtype == dt && t.is_contiguous() {
        return Ok(t.clone());
    }
    let d = c.ew("copy", &[t], dt, 0.0)?;
    temps.0.push(d.clone());
    Ok(d)
}
