//! Row-wise softmax pieces of the tiled kernels: a vectorisable `exp`, the online-softmax
//! update, exact softmax, probability recomputation from a saved logsumexp, `dS = P∘(dP − D)`
//! and dot products.
//!
//! Each kernel is written once as plain array code (`*_body`, `#[inline(always)]`) and compiled
//! three times (`headroom_tensor::multiversion!`): for AVX-512, for AVX2+FMA and for the
//! baseline target, chosen at run time. The crate is compiled for generic x86-64, so without
//! this the loops would only use SSE2.
//! Rust never contracts `a*b+c` into an FMA, so all three builds give bitwise identical results.

/// Below this, `exp` underflows f32's normal range; the kernels return exactly 0 there.
const EXP_LOWEST: f32 = -87.336_54;
/// Above this `exp` overflows; inputs are clamped (softmax never gets here: it subtracts the max).
const EXP_HIGHEST: f32 = 88.0;
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in a part exact in f32 and a remainder (Cody–Waite), as in Cephes' `expf`.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5·2²³: adding it rounds to an integer and leaves that integer in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;
const ROUND_MAGIC_BITS: u32 = 0x4B40_0000;

/// `eˣ` to about 2 ulp for `x` in [-87.3, 88], exactly 0 below, NaN for NaN; branch-free so
/// loops over it vectorise.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    let xc = x.clamp(EXP_LOWEST, EXP_HIGHEST);
    let rounded = xc * LOG2_E + ROUND_MAGIC;
    let n = rounded - ROUND_MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    // Cephes expf polynomial for e^r on [-ln2/2, ln2/2].
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * (r * r) + r + 1.0;
    // 2ⁿ built from the integer left in `rounded`'s mantissa: exponent field n + 127.
    let two_n = f32::from_bits(
        rounded
            .to_bits()
            .wrapping_sub(ROUND_MAGIC_BITS)
            .wrapping_add(127)
            << 23,
    );
    let y = e_r * two_n;
    if x < EXP_LOWEST {
        0.0
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

const LANES: usize = 16;

#[inline(always)]
fn max_body(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = l.max(x);
        }
    }
    let mut m = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    for l in lanes {
        m = m.max(l);
    }
    m
}

#[inline(always)]
fn sum_body(xs: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += x;
        }
    }
    let mut s = chunks.remainder().iter().sum::<f32>();
    for l in lanes {
        s += l;
    }
    s
}

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for ((l, &p), &q) in lanes.iter_mut().zip(x).zip(y) {
            *l += p * q;
        }
    }
    let mut s = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(p, q)| p * q)
        .sum::<f32>();
    for l in lanes {
        s += l;
    }
    s
}

/// `row[j] = exp(row[j] − shift)` for `j < valid`, 0 after; returns the sum.
#[inline(always)]
fn exp_shifted_body(row: &mut [f32], valid: usize, shift: f32) -> f32 {
    let valid = valid.min(row.len());
    let (live, masked) = row.split_at_mut(valid);
    for x in live.iter_mut() {
        *x = exp_f32(*x - shift);
    }
    masked.fill(0.0);
    sum_body(live)
}

/// Online softmax step for one row of a score tile (FlashAttention-2): updates the running max
/// `m` and running sum `l`, turns `row` into unnormalised probabilities, and returns the factor
/// the row's output accumulator must be multiplied by (`exp(m_old − m_new)`).
#[inline(always)]
fn online_softmax_body(row: &mut [f32], valid: usize, m: &mut f32, l: &mut f32) -> f32 {
    if valid == 0 {
        row.fill(0.0);
        return 1.0;
    }
    let tile_max = max_body(&row[..valid.min(row.len())]);
    let m_new = m.max(tile_max);
    if m_new == f32::NEG_INFINITY {
        // Every visible score is -inf: nothing contributes yet.
        row.fill(0.0);
        return 1.0;
    }
    // m = -inf (first visible tile) gives exp(-inf) = 0: the empty accumulator is dropped.
    let correction = exp_f32(*m - m_new);
    let tile_sum = exp_shifted_body(row, valid, m_new);
    *l = *l * correction + tile_sum;
    *m = m_new;
    correction
}

/// Exact softmax of `row[..valid]` in place (0 after); returns the row's logsumexp, or -inf
/// (and an all-zero row) when nothing is visible.
#[inline(always)]
fn softmax_body(row: &mut [f32], valid: usize) -> f32 {
    let valid = valid.min(row.len());
    let m = max_body(&row[..valid]);
    if valid == 0 || m == f32::NEG_INFINITY {
        row.fill(0.0);
        return f32::NEG_INFINITY;
    }
    let sum = exp_shifted_body(row, valid, m);
    let inv = 1.0 / sum;
    for x in row[..valid].iter_mut() {
        *x *= inv;
    }
    m + sum.ln()
}

/// `row[j] = exp(row[j] − lse)` for `j < valid`, 0 after (all 0 for a row with lse = -inf).
#[inline(always)]
fn probs_from_lse_body(row: &mut [f32], valid: usize, lse: f32) {
    if lse == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    exp_shifted_body(row, valid, lse);
}

/// `dp[j] = p[j]·(dp[j] − d)`: the softmax backward, turning `dP` into `dS` in place.
#[inline(always)]
fn softmax_grad_body(p: &[f32], dp: &mut [f32], d: f32) {
    for (g, &pj) in dp.iter_mut().zip(p) {
        *g = pj * (*g - d);
    }
}

/// `x *= alpha`.
#[inline(always)]
fn scale_body(x: &mut [f32], alpha: f32) {
    for v in x.iter_mut() {
        *v *= alpha;
    }
}

headroom_tensor::multiversion!(
    /// Online softmax update of one score row; see `online_softmax_body`.
    pub(crate) fn online_softmax_row => online_softmax_body(row: &mut [f32], valid: usize, m: &mut f32, l: &mut f32) -> f32
);
headroom_tensor::multiversion!(
    /// Exact softmax of one row, returning its logsumexp.
    pub(crate) fn softmax_row => softmax_body(row: &mut [f32], valid: usize) -> f32
);
headroom_tensor::multiversion!(
    /// Probabilities of one row recomputed from its saved logsumexp.
    pub(crate) fn probs_from_lse_row => probs_from_lse_body(row: &mut [f32], valid: usize, lse: f32) -> ()
);
headroom_tensor::multiversion!(
    /// `dS = P∘(dP − D)` for one row, in place over `dP`.
    pub(crate) fn softmax_grad_row => softmax_grad_body(p: &[f32], dp: &mut [f32], d: f32) -> ()
);
headroom_tensor::multiversion!(
    /// `x *= alpha`.
    pub(crate) fn scale_row => scale_body(x: &mut [f32], alpha: f32) -> ()
);
headroom_tensor::multiversion!(
    /// Dot product with 16 fixed lanes (the summation order depends only on the length).
    pub(crate) fn dot => dot_body(a: &[f32], b: &[f32]) -> f32
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_a_few_ulp_of_f64_exp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_37;
        }
        assert!(worst < 3.0e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn dispatched_kernels_equal_the_portable_build_bitwise() {
        let row: Vec<f32> = (0..77)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.13)
            .collect();
        for valid in [0, 1, 16, 40, 77] {
            let (mut a, mut b) = (row.clone(), row.clone());
            let (mut ma, mut la, mut mb, mut lb) = (0.5f32, 2.0f32, 0.5f32, 2.0f32);
            let ca = online_softmax_row(&mut a, valid, &mut ma, &mut la);
            let cb = online_softmax_body(&mut b, valid, &mut mb, &mut lb);
            assert_eq!((a.clone(), ca, ma, la), (b.clone(), cb, mb, lb));
            let (mut a, mut b) = (row.clone(), row.clone());
            assert_eq!(
                softmax_row(&mut a, valid).to_bits(),
                softmax_body(&mut b, valid).to_bits()
            );
            assert_eq!(a, b);
        }
        assert_eq!(dot(&row, &row).to_bits(), dot_body(&row, &row).to_bits());
    }

    #[test]
    fn softmax_rows_match_a_plain_softmax_and_mask_the_tail() {
        let row: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin() * 4.0).collect();
        let valid = 33;
        let m = row[..valid]
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let z: f64 = row[..valid].iter().map(|&x| (x as f64 - m).exp()).sum();
        let mut got = row.clone();
        let lse = softmax_row(&mut got, valid);
        assert!((lse as f64 - (m + z.ln())).abs() < 1e-5);
        for (j, &p) in got.iter().enumerate() {
            let want = if j < valid {
                (row[j] as f64 - m).exp() / z
            } else {
                0.0
            };
            assert!((p as f64 - want).abs() < 1e-6, "{j}: {p} vs {want}");
        }
        // Recomputing from the logsumexp gives the same probabilities.
        let mut again = row.clone();
        probs_from_lse_row(&mut again, valid, lse);
        for (a, b) in again.iter().zip(&got) {
            assert!((a - b).abs() < 1e-6);
        }
        // Two online steps over halves equal one exact softmax after normalising.
        let (mut m_run, mut l_run) = (f32::NEG_INFINITY, 0.0f32);
        let mut first = row[..25].to_vec();
        online_softmax_row(&mut first, 25, &mut m_run, &mut l_run);
        let mut second = row[25..].to_vec();
        let c = online_softmax_row(&mut second, valid - 25, &mut m_run, &mut l_run);
        assert!(((m_run + l_run.ln()) - lse).abs() < 1e-5);
        for j in 0..25 {
            assert!((first[j] * c / l_run - got[j]).abs() < 1e-6);
        }
    }

    /// Document masks set the scores of keys before a row's document to -inf and rely on
    /// every helper giving them probability (and gradient) exactly 0, and on a tile of only
    /// -inf leaving the online state alone whether or not it saw something before.
    #[test]
    fn minus_infinity_scores_get_probability_zero() {
        let ninf = f32::NEG_INFINITY;
        let mut row = vec![ninf, ninf, 0.5, 1.5, -2.0];
        let lse = softmax_row(&mut row, 5);
        let mut plain = vec![0.5, 1.5, -2.0];
        assert_eq!(lse, softmax_row(&mut plain, 3));
        assert_eq!(row[..2], [0.0, 0.0]);
        assert_eq!(row[2..], plain[..]);
        let mut again = vec![ninf, ninf, 0.5, 1.5, -2.0];
        probs_from_lse_row(&mut again, 5, lse);
        assert_eq!(again[..2], [0.0, 0.0]);
        let mut ds = vec![3.0f32, -1.0, 0.5, 0.25, 2.0];
        softmax_grad_row(&again, &mut ds, 0.7);
        assert_eq!(ds[..2], [0.0, 0.0]);

        // A whole tile of -inf first (nothing seen yet), then after a finite one.
        let (mut m, mut l) = (ninf, 0.0f32);
        let mut tile = vec![ninf; 4];
        assert_eq!(online_softmax_row(&mut tile, 4, &mut m, &mut l), 1.0);
        assert_eq!((tile, m, l), (vec![0.0; 4], ninf, 0.0));
        let mut tile = vec![0.25f32, -1.0];
        online_softmax_row(&mut tile, 2, &mut m, &mut l);
        let (m_seen, l_seen) = (m, l);
        let mut tile = vec![ninf; 3];
        assert_eq!(online_softmax_row(&mut tile, 3, &mut m, &mut l), 1.0);
        assert_eq!((tile, m, l), (vec![0.0; 3], m_seen, l_seen));
    }

    #[test]
    fn a_row_that_sees_nothing_is_zero_not_nan() {
        let mut row = vec![1.0f32; 8];
        assert_eq!(softmax_row(&mut row, 0), f32::NEG_INFINITY);
        assert_eq!(row, vec![0.0; 8]);
        let mut row = vec![1.0f32; 8];
        probs_from_lse_row(&mut row, 8, f32::NEG_INFINITY);
        assert_eq!(row, vec![0.0; 8]);
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0);
        let mut row = vec![f32::NEG_INFINITY; 4];
        assert_eq!(online_softmax_row(&mut row, 4, &mut m, &mut l), 1.0);
        assert_eq!((row, m, l), (vec![0.0; 4], f32::NEG_INFINITY, 0.0));
    }
}
