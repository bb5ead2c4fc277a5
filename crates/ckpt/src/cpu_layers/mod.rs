//! Reference layers on the [`Cpu`] backend, with deterministic kernels:
//! a dense layer with GELU ([`Dense`]) and a transformer-style MLP block ([`MlpBlock`]). They
//! are what the property tests and benchmarks run, and a model for writing real layers.
//!
//! Parameters and their gradients live in plain host vectors (they are not activations and
//! are not reported to the allocation hook); saved intermediates and outputs are backend
//! tensors, allocated in the caller's memory category; temporaries are tagged
//! [`MemoryCategory::Workspace`].

mod dense;
pub mod kernels;
mod mlp_block;

pub use dense::{Dense, DenseSaved};
pub use mlp_block::{MlpBlock, MlpSaved};

use headroom_tensor::{
    Backend, Cpu, CpuTensor, DType, Error, MemoryCategory, Result, Shape, Tensor,
};

/// Deterministic pseudo-random values in `[-scale, scale)` from a seed (xorshift32).
pub fn seeded_values(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = (seed as u32 ^ (seed >> 32) as u32).wrapping_mul(0x9e37_79b9) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            ((s >> 8) as f32 / (1u32 << 23) as f32 - 1.0) * scale
        })
        .collect()
}

/// Rows of a `[rows, width]` tensor, or a typed error for any other shape.
fn rows_of(x: &CpuTensor, width: usize, op: &'static str) -> Result<usize> {
    match *x.shape().dims() {
        [rows, w] if w == width => Ok(rows),
        [rows, _] => Err(Error::ShapeMismatch {
            op,
            expected: Shape::from([rows, width]),
            got: x.shape().clone(),
        }),
        _ => Err(Error::InvalidShape {
            op,
            shape: x.shape().clone(),
            reason: "expected a [rows, features] tensor",
        }),
    }
}

/// An f32 tensor in the current category when `keep`, else as workspace (a temporary the
/// allocation hook must not count as a saved activation).
fn alloc_f32(cpu: &Cpu, shape: [usize; 2], keep: bool) -> Result<CpuTensor> {
    if keep {
        cpu.zeros(shape, DType::F32)
    } else {
        let _ws = MemoryCategory::Workspace.enter();
        cpu.zeros(shape, DType::F32)
    }
}

/// Bytes of an optional tensor.
fn opt_bytes(t: &Option<CpuTensor>) -> usize {
    t.as_ref().map_or(0, |t| t.size_in_bytes())
}
