//! Plain scalar reference implementations of the backend primitives.
//!
//! One element at a time, no threads, no SIMD, conversions through `half`'s scalar routines.
//! Every faster path (threaded CPU, CUDA) is tested against these; the tolerance each test
//! allows is stated beside it.

use half::{bf16, f16};

/// Widen any supported float to f32 through `half`.
pub trait ToF32Ref: Copy {
    /// The value as f32 (exact for f16 and bf16).
    fn to_f32_ref(self) -> f32;
    /// The nearest value of this type to an f32 (round-to-nearest-even).
    fn from_f32_ref(v: f32) -> Self;
}

impl ToF32Ref for f32 {
    fn to_f32_ref(self) -> f32 {
        self
    }
    fn from_f32_ref(v: f32) -> Self {
        v
    }
}

impl ToF32Ref for f16 {
    fn to_f32_ref(self) -> f32 {
        self.to_f32()
    }
    fn from_f32_ref(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl ToF32Ref for bf16 {
    fn to_f32_ref(self) -> f32 {
        self.to_f32()
    }
    fn from_f32_ref(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Reference cast: widen to f32, then round to the destination type.
pub fn cast<S: ToF32Ref, D: ToF32Ref>(src: &[S]) -> Vec<D> {
    src.iter()
        .map(|s| D::from_f32_ref(s.to_f32_ref()))
        .collect()
}

/// Reference `x * alpha`.
pub fn scale<T: ToF32Ref>(x: &[T], alpha: f32) -> Vec<T> {
    x.iter()
        .map(|v| T::from_f32_ref(v.to_f32_ref() * alpha))
        .collect()
}

/// Reference `y + alpha * x` (product rounded to f32, then the sum).
pub fn axpy<T: ToF32Ref>(alpha: f32, x: &[T], y: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(y)
        .map(|(x, y)| y + alpha * x.to_f32_ref())
        .collect()
}

/// Reference `Σ x²`, sequential in f64.
pub fn sum_squares<T: ToF32Ref>(x: &[T]) -> f64 {
    x.iter().map(|v| (v.to_f32_ref() as f64).powi(2)).sum()
}

/// Reference unscale: (`x * inv_scale`, whether any input was non-finite).
pub fn unscale_and_check<T: ToF32Ref>(x: &[T], inv_scale: f32) -> (Vec<T>, bool) {
    let found = x.iter().any(|v| !v.to_f32_ref().is_finite());
    (scale(x, inv_scale), found)
}
