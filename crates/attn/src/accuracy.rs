//! Judging an attention result against a reference: the tolerances headroom's bf16 flash kernels
//! are held to (their GPU tests and the GPU bench's check before timing use these), and the
//! comparisons that apply them. A backend author can hold their own kernel to the same bar.
//!
//! The reference `r` is the f32 CPU flash path on the same bf16-rounded inputs. The kernels take
//! bf16 inputs, accumulate in f32, round P and dS to bf16 before their second matmul as
//! FlashAttention-2 does, and store bf16 results, so per tensor:
//! - output: max |x − r| ≤ 1e-2 · max |r| and rms(x − r) ≤ 6e-3 · rms(r) ([`BF16_OUTPUT`]);
//! - dQ, dK, dV: max |x − r| ≤ 2e-2 · max |r| and rms(x − r) ≤ 1e-2 · rms(r) ([`BF16_GRAD`]);
//! - max |r| and rms(r) floored at [`MAGNITUDE_FLOOR`], so an all-zero reference (one visible
//!   key makes dS vanish) allows rounding noise;
//! - logsumexp (f32): |x − r| ≤ [`LSE_TOLERANCE`] · max(1, |r|), and `-inf` exactly where r is;
//! - nothing NaN or infinite anywhere else.

use std::fmt;

/// A per-tensor tolerance relative to the reference's magnitude.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// Largest error, as a fraction of the largest reference magnitude.
    pub max: f64,
    /// Root-mean-square error, as a fraction of the reference's root mean square.
    pub rms: f64,
}

/// The attention output of the bf16 kernels.
pub const BF16_OUTPUT: Tolerance = Tolerance {
    max: 1e-2,
    rms: 6e-3,
};

/// dQ, dK and dV of the bf16 kernels.
pub const BF16_GRAD: Tolerance = Tolerance {
    max: 2e-2,
    rms: 1e-2,
};

/// The logsumexp (kept in f32): relative to max(1, |reference|).
pub const LSE_TOLERANCE: f64 = 1e-3;

/// The smallest magnitude tolerances are relative to (inputs are O(1)).
pub const MAGNITUDE_FLOOR: f64 = 1e-3;

/// Why a result was rejected; the message starts with the tensor's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch(pub String);

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Mismatch {}

impl From<Mismatch> for String {
    fn from(m: Mismatch) -> String {
        m.0
    }
}

fn rms(x: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = x.fold((0.0, 0usize), |(s, n), v| (s + v * v, n + 1));
    if n == 0 {
        0.0
    } else {
        (sum / n as f64).sqrt()
    }
}

/// `got` against the reference `want` within `tol`; on success the largest error relative to
/// the (floored) largest reference magnitude.
pub fn compare(what: &str, got: &[f32], want: &[f32], tol: &Tolerance) -> Result<f64, Mismatch> {
    if got.len() != want.len() {
        return Err(Mismatch(format!(
            "{what}: {} values, want {}",
            got.len(),
            want.len()
        )));
    }
    if let Some(i) = got.iter().position(|x| !x.is_finite()) {
        return Err(Mismatch(format!("{what}[{i}] = {} is not finite", got[i])));
    }
    let largest = want
        .iter()
        .fold(0.0f64, |m, &w| m.max(f64::from(w).abs()))
        .max(MAGNITUDE_FLOOR);
    let (worst, at) = got
        .iter()
        .zip(want)
        .enumerate()
        .map(|(i, (&g, &w))| ((f64::from(g) - f64::from(w)).abs(), i))
        .fold((0.0, 0), |best, e| if e.0 > best.0 { e } else { best });
    if worst > tol.max * largest {
        return Err(Mismatch(format!(
            "{what}: |error| {worst:.3e} at {at} (got {}, want {}) exceeds {} of max |ref| \
             {largest:.3e}",
            got[at], want[at], tol.max
        )));
    }
    let error_rms = rms(got
        .iter()
        .zip(want)
        .map(|(&g, &w)| f64::from(g) - f64::from(w)));
    let want_rms = rms(want.iter().map(|&w| f64::from(w))).max(MAGNITUDE_FLOOR);
    if error_rms > tol.rms * want_rms {
        return Err(Mismatch(format!(
            "{what}: rms error {error_rms:.3e} exceeds {} of rms(ref) {want_rms:.3e}",
            tol.rms
        )));
    }
    Ok(worst / largest)
}

/// The logsumexp within [`LSE_TOLERANCE`], `-inf` exactly where the reference has it; on
/// success the largest error relative to max(1, |ref|).
pub fn compare_lse(got: &[f32], want: &[f32]) -> Result<f64, Mismatch> {
    if got.len() != want.len() {
        return Err(Mismatch(format!(
            "lse: {} values, want {}",
            got.len(),
            want.len()
        )));
    }
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == f32::NEG_INFINITY {
            if g != f32::NEG_INFINITY {
                return Err(Mismatch(format!("lse[{i}] = {g}, want -inf")));
            }
            continue;
        }
        let error = (f64::from(g) - f64::from(w)).abs();
        if !g.is_finite() || error > LSE_TOLERANCE * f64::from(w.abs()).max(1.0) {
            return Err(Mismatch(format!("lse[{i}] = {g}, want {w}")));
        }
        worst = worst.max(error / f64::from(w.abs()).max(1.0));
    }
    Ok(worst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_and_rms_errors_are_each_enforced() {
        let want: Vec<f32> = (0..100).map(|i| (i as f32 * 0.1).sin()).collect();
        assert!(compare("out", &want, &want, &BF16_OUTPUT).is_ok());
        // One value off by 5% of the largest: the max check.
        let mut one = want.clone();
        one[7] += 0.05;
        let e = compare("out", &one, &want, &BF16_OUTPUT).unwrap_err();
        assert!(e.0.starts_with("out: |error|"), "{e}");
        // A uniform 0.9% error everywhere: under the max check, over the rms check.
        let scaled: Vec<f32> = want.iter().map(|v| v * 1.009).collect();
        let e = compare("out", &scaled, &want, &BF16_OUTPUT).unwrap_err();
        assert!(e.0.contains("rms"), "{e}");
        let mut nan = want.clone();
        nan[0] = f32::NAN;
        assert!(compare("out", &nan, &want, &BF16_OUTPUT).is_err());
        assert!(compare("out", &want[1..], &want, &BF16_OUTPUT).is_err());
    }

    #[test]
    fn logsumexp_needs_minus_infinity_exactly_where_the_reference_has_it() {
        let want = [f32::NEG_INFINITY, 2.0, -30.0];
        assert_eq!(compare_lse(&want, &want), Ok(0.0));
        assert!(compare_lse(&[0.0, 2.0, -30.0], &want).is_err());
        assert!(compare_lse(&[f32::NEG_INFINITY, f32::NEG_INFINITY, -30.0], &want).is_err());
        let near = [f32::NEG_INFINITY, 2.001, -30.02];
        assert!(compare_lse(&near, &want).is_ok());
        assert!(compare_lse(&[f32::NEG_INFINITY, 2.01, -30.0], &want).is_err());
    }
}
