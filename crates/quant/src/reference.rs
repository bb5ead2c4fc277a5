//! Plain references the fused paths are tested against: whole-tensor dequantization (scalar)
//! followed by naive matrix products accumulated in f64.

use crate::dequant::Isa;
use crate::QuantizedTensor;

/// The whole tensor dequantized by the portable scalar path.
pub fn dequantize_scalar(w: &QuantizedTensor) -> Vec<f32> {
    let mut out = vec![0f32; w.numel()];
    w.dequantize_range_with(Isa::Scalar, 0, &mut out);
    out
}

/// `y = x · wᵀ` in f64, rounded to f32 once: `x` `[n, k]`, `w` `[m, k]`, `y` `[n, m]`. Also
/// returns `Σ_k |x·w|` per output, the scale of an f32 dot product's rounding error.
pub fn matmul_xwt(x: &[f32], w: &[f32], n: usize, k: usize, m: usize) -> (Vec<f32>, Vec<f64>) {
    let mut y = vec![0f32; n * m];
    let mut mag = vec![0f64; n * m];
    for i in 0..n {
        for j in 0..m {
            let (mut s, mut a) = (0f64, 0f64);
            for t in 0..k {
                let p = x[i * k + t] as f64 * w[j * k + t] as f64;
                s += p;
                a += p.abs();
            }
            y[i * m + j] = s as f32;
            mag[i * m + j] = a;
        }
    }
    (y, mag)
}

/// `dx = dy · w` in f64, rounded once: `dy` `[n, m]`, `w` `[m, k]`, `dx` `[n, k]`; with
/// `Σ |dy·w|` per output.
pub fn matmul_dyw(dy: &[f32], w: &[f32], n: usize, m: usize, k: usize) -> (Vec<f32>, Vec<f64>) {
    let mut dx = vec![0f32; n * k];
    let mut mag = vec![0f64; n * k];
    for i in 0..n {
        for t in 0..k {
            let (mut s, mut a) = (0f64, 0f64);
            for j in 0..m {
                let p = dy[i * m + j] as f64 * w[j * k + t] as f64;
                s += p;
                a += p.abs();
            }
            dx[i * k + t] = s as f32;
            mag[i * k + t] = a;
        }
    }
    (dx, mag)
}

/// The tolerance the fused matmul is held to against [`matmul_xwt`] / [`matmul_dyw`]: an f32
/// dot product of length `k` is off by at most `k·u·Σ|x·w|` (u = 2⁻²⁴); this allows twice that,
/// plus the final rounding of the f64 reference.
pub fn f32_dot_tolerance(k: usize, magnitude: f64) -> f64 {
    (2.0 * k as f64 * f64::from(f32::EPSILON) / 2.0 + f64::from(f32::EPSILON)) * magnitude + 1e-30
}
