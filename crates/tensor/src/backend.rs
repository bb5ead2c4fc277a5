//! The two traits every backend implements: [`Tensor`] (what a buffer is) and [`Backend`]
//! (what can be done to it that more than one crate needs).
//!
//! The trait is small on purpose. Heavy kernels — matmul, attention, Adam, layer norm — belong
//! to the crate that owns them, as extension traits implemented for each backend.

use std::sync::Arc;

use crate::{AllocHook, DType, Device, Element, Result, Shape};

/// A dense, contiguous, row-major buffer on some device.
pub trait Tensor: Send + Sync {
    /// The shape.
    fn shape(&self) -> &Shape;
    /// The element type.
    fn dtype(&self) -> DType;
    /// Where the data lives.
    fn device(&self) -> Device;
    /// Reinterpret with another shape of the same element count (metadata only).
    fn reshape(&mut self, shape: Shape) -> Result<()>;

    /// Number of elements.
    fn numel(&self) -> usize {
        self.shape().numel()
    }
    /// Exact size of the data in bytes.
    fn size_in_bytes(&self) -> usize {
        self.numel() * self.dtype().size_in_bytes()
    }
}

/// A device and the primitives that several headroom crates share.
///
/// Float primitives (`cast`, `scale`, `axpy`, `sum_squares`, `unscale_and_check`) accept f32,
/// f16 and bf16 tensors and compute in f32 (f64 for sums); results stored in f16/bf16 are
/// rounded to nearest-even. Every allocation is tagged with the calling thread's
/// [`MemoryCategory`](crate::MemoryCategory) and reported to the backend's
/// [`AllocHook`], if it has one.
pub trait Backend: Send + Sync {
    /// The tensor type this backend allocates.
    type Tensor: Tensor;

    /// The device this backend computes on.
    fn device(&self) -> Device;

    /// The allocation hook this backend reports to, so other crates can report memory they
    /// allocate beside it with [`TrackedAllocation`](crate::TrackedAllocation).
    fn alloc_hook(&self) -> Option<&Arc<dyn AllocHook>>;

    /// A zero-filled tensor.
    fn zeros(&self, shape: impl Into<Shape>, dtype: DType) -> Result<Self::Tensor>;

    /// A tensor whose contents are unspecified (the caller overwrites all of it). Backends may
    /// return zeros when that costs nothing extra.
    fn uninit(&self, shape: impl Into<Shape>, dtype: DType) -> Result<Self::Tensor>;

    /// A tensor holding a copy of host data; `data.len()` must equal the shape's element count.
    fn upload<T: Element>(&self, data: &[T], shape: impl Into<Shape>) -> Result<Self::Tensor>;

    /// Copy a tensor's data into a host slice of the same length and element type.
    fn download_into<T: Element>(&self, src: &Self::Tensor, dst: &mut [T]) -> Result<()>;

    /// Copy a tensor's data into a new host vector.
    fn download<T: Element>(&self, src: &Self::Tensor) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); src.numel()];
        self.download_into(src, &mut out)?;
        Ok(out)
    }

    /// Set every element to zero bits (`+0.0` for floats), whatever it held. Unlike
    /// `scale(x, 0.0)` this also clears infinities and NaNs (`0 × inf` is NaN).
    fn fill_zero(&self, x: &mut Self::Tensor) -> Result<()>;

    /// `dst = src`; same dtype and element count.
    fn copy(&self, src: &Self::Tensor, dst: &mut Self::Tensor) -> Result<()>;

    /// `dst = src` converted between f32, f16 and bf16 (round-to-nearest-even, NaN stays NaN);
    /// same element count. Equal dtypes are a copy.
    fn cast(&self, src: &Self::Tensor, dst: &mut Self::Tensor) -> Result<()>;

    /// `x *= alpha`.
    fn scale(&self, x: &mut Self::Tensor, alpha: f32) -> Result<()>;

    /// `y += alpha * x` with `x` in f32, f16 or bf16 and `y` in f32; same element count.
    /// No fused multiply-add: the product is rounded to f32 before the sum.
    fn axpy(&self, alpha: f32, x: &Self::Tensor, y: &mut Self::Tensor) -> Result<()>;

    /// `Σ x²` accumulated in f64, bitwise reproducible: the summation order depends only on
    /// the element count, never on the number of threads.
    fn sum_squares(&self, x: &Self::Tensor) -> Result<f64>;

    /// For each tensor, `x *= inv_scale`; returns `true` if any input element was infinite or
    /// NaN. The gradients are unscaled in place either way (as PyTorch's
    /// `_amp_foreach_non_finite_check_and_unscale_` does); the caller skips the step.
    fn unscale_and_check(&self, tensors: &mut [&mut Self::Tensor], inv_scale: f32) -> Result<bool>;

    /// Wait until all work queued on this backend has finished (a no-op on the CPU).
    fn synchronize(&self) -> Result<()>;
}
