//! Zeroing a buffer whatever it holds: the one primitive the accumulator needs beyond
//! [`Backend`].
//!
//! `Backend::scale(x, 0.0)` is not a zero fill: `0 × inf` and `0 × NaN` are NaN, and clearing
//! the buffers after a non-finite step is exactly when they hold those. So this crate defines a
//! small extension trait, implemented here for the CPU backend (a CUDA implementation would be
//! a `memset` behind the `cuda` feature).

use headroom_tensor::{Backend, Cpu, CpuTensor};

/// A backend that can set a tensor's bytes to zero (all-zero bits are `+0.0` in f32, f16 and
/// bf16).
pub trait ZeroFill: Backend {
    /// Set every element of `x` to zero, whatever it held.
    fn zero_fill(&self, x: &mut Self::Tensor) -> headroom_tensor::Result<()>;
}

impl ZeroFill for Cpu {
    fn zero_fill(&self, x: &mut CpuTensor) -> headroom_tensor::Result<()> {
        // One memset per buffer per step: memory-bound and far cheaper than the backward that
        // precedes it, so it is not worth threading.
        x.as_bytes_mut().fill(0);
        Ok(())
    }
}
