//! The factories AOTAutograd leaves without a decomposition table: `zeros` / `ones`, the
//! `_like` forms and the `new_` forms (the dtype of `self` unless given). Shapes come from the
//! arguments, dtypes from the node's recorded metadata first; `empty` forms (`empty_like`) are
//! zero-filled,
//! so runs are reproducible.

use super::{Env, Value, ints, number, one};
use crate::create::{filled, kw_dtype};
use zerosched_exec::host::Tensor;
use zerosched_ir::Dtype;

fn size(env: &Env<'_, Tensor>, i: usize) -> Result<Vec<usize>, String> {
    ints(env.arg(i)?)?
        .into_iter()
        .map(|d| usize::try_from(d).map_err(|_| format!("negative size {d}")))
        .collect()
}

fn fresh(env: &Env<'_, Tensor>, v: f64) -> Result<Value<Tensor>, String> {
    one(filled(&size(env, 0)?, v, kw_dtype(env, Dtype::Float32))?)
}

fn like(env: &Env<'_, Tensor>, v: f64) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    one(filled(x.shape(), v, kw_dtype(env, x.dtype))?)
}

fn new(env: &Env<'_, Tensor>, v: f64) -> Result<Value<Tensor>, String> {
    let x = env.tensor(env.arg(0)?)?;
    one(filled(&size(env, 1)?, v, kw_dtype(env, x.dtype))?)
}

pub fn zeros(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    fresh(env, 0.0)
}
pub fn ones(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    fresh(env, 1.0)
}
pub fn zeros_like(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    like(env, 0.0)
}
pub fn ones_like(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    like(env, 1.0)
}
pub fn new_zeros(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    new(env, 0.0)
}
pub fn new_ones(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    new(env, 1.0)
}

/// `new_full(self, size, fill_value)`.
pub fn new_full(env: &Env<'_, Tensor>) -> Result<Value<Tensor>, String> {
    let v = number(env.arg(2)?).ok_or("new_full: fill value is not a number")?;
    new(env, v)
}
