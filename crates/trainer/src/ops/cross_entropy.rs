//! Softmax cross-entropy over the vocabulary, fused: per-row losses, and
//! `dlogits = (softmax − onehot) · dloss` without storing the probabilities. Rows are split
//! over threads; each row's arithmetic is independent of the split, so results do not depend
//! on the thread count.

#[cfg(target_arch = "x86_64")]
use headroom_tensor::isa::{self, IsaLevel};
use rayon::prelude::*;

use crate::ops::fast_math::exp;

/// Rows per rayon task: a 50k-wide row is 200 KB, so a few rows amortise the dispatch.
const ROWS_PER_TASK: usize = 4;

/// Lanes of the row reductions: independent partial maxima and sums the compiler keeps in
/// vector registers (a single f32 accumulator is a serial dependency chain it may not
/// reorder). The lane count fixes the summation order, so results do not depend on the ISA.
const LANES: usize = 16;

#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    let mut m = [f32::NEG_INFINITY; LANES];
    for c in chunks {
        for (m, &x) in m.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    tail.iter()
        .chain(&m)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// `Σ exp(x − max)` over the row, in [`LANES`] partial sums.
#[inline(always)]
fn row_exp_sum(row: &[f32], max: f32) -> f32 {
    let n = row.len() - row.len() % LANES;
    let mut acc = [0f32; LANES];
    for c in row[..n].chunks_exact(LANES) {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += exp(x - max);
        }
    }
    let tail_sum: f32 = row[n..].iter().map(|&x| exp(x - max)).sum();
    acc.iter().sum::<f32>() + tail_sum
}

/// [`row_exp_sum`] that also replaces each logit by its term `exp(x − max)`, so the gradient
/// pass does not compute the exponentials again. The additions are [`row_exp_sum`]'s, in the
/// same order, so the sum has the same bits.
#[inline(always)]
fn row_exp_sum_in_place(row: &mut [f32], max: f32) -> f32 {
    let n = row.len() - row.len() % LANES;
    let mut acc = [0f32; LANES];
    for c in row[..n].chunks_exact_mut(LANES) {
        for (a, x) in acc.iter_mut().zip(c) {
            let e = exp(*x - max);
            *x = e;
            *a += e;
        }
    }
    let mut tail_sum = 0f32;
    for x in &mut row[n..] {
        let e = exp(*x - max);
        *x = e;
        tail_sum += e;
    }
    acc.iter().sum::<f32>() + tail_sum
}

/// Per-row loss `-log softmax(logits)[target]`, computed stably; `losses[n]`.
pub fn forward(losses: &mut [f32], logits: &[f32], targets: &[u32], v: usize) {
    losses
        .par_iter_mut()
        .zip(logits.par_chunks_exact(v))
        .zip(targets)
        .with_min_len(ROWS_PER_TASK)
        .for_each(|((l, row), &t)| *l = row_loss(row, t));
}

/// One row's loss, on the widest vectors the CPU has (see [`row_gradient`]).
fn row_loss(row: &[f32], t: u32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && isa::allows(IsaLevel::Avx2) {
        // SAFETY: AVX2 is present (checked just above).
        return unsafe { row_loss_avx2(row, t) };
    }
    row_loss_plain(row, t)
}

#[inline(always)]
fn row_loss_plain(row: &[f32], t: u32) -> f32 {
    let max = row_max(row);
    let sum = row_exp_sum(row, max);
    (sum.ln() + max) - row[t as usize]
}

/// [`row_loss_plain`] compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_loss_avx2(row: &[f32], t: u32) -> f32 {
    row_loss_plain(row, t)
}

/// `dlogits[row] = (softmax(row) − onehot(target)) · dloss[row]` (overwrites `dlogits`).
pub fn backward(dlogits: &mut [f32], logits: &[f32], targets: &[u32], dloss: &[f32], v: usize) {
    dlogits.copy_from_slice(logits);
    let mut scratch = vec![0f32; targets.len()];
    forward_backward_in_place(&mut scratch, dlogits, targets, dloss, v);
}

/// [`forward`] and [`backward`] in one pass over the logits, which the gradient then
/// overwrites: `logits[row] ← (softmax(row) − onehot(target)) · dloss[row]`.
///
/// Why in place: the head's matmul backward reads only the gradient, and the logits are the
/// run's largest tensor (`[B·T, V]` f32, 411 MB for `small`'s 8×256 batch), so a separate
/// gradient buffer would double it (llm.c's fused classifier makes the same choice).
pub fn forward_backward_in_place(
    losses: &mut [f32],
    logits: &mut [f32],
    targets: &[u32],
    dloss: &[f32],
    v: usize,
) {
    losses
        .par_iter_mut()
        .zip(logits.par_chunks_exact_mut(v))
        .zip(targets)
        .zip(dloss)
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(((l, row), &t), &dl)| *l = row_gradient(row, t, dl));
}

/// One row's loss, the row replaced by its logits' gradient scaled by `dl`. On AVX2 machines
/// the same code compiled for AVX2: Rust never contracts `a·b + c` into a fused multiply-add
/// and the [`LANES`] partial sums fix the order of every addition, so both builds give the
/// same bits (tested), with twice the lanes of the baseline's SSE2. The exponentials were ~10%
/// of a `small` step's samples on the baseline build.
fn row_gradient(row: &mut [f32], t: u32, dl: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && isa::allows(IsaLevel::Avx2) {
        // SAFETY: AVX2 is present (checked just above).
        return unsafe { row_gradient_avx2(row, t, dl) };
    }
    row_gradient_plain(row, t, dl)
}

#[inline(always)]
fn row_gradient_plain(row: &mut [f32], t: u32, dl: f32) -> f32 {
    // Read before the row is overwritten by its exponentials.
    let target_logit = row[t as usize];
    let max = row_max(row);
    let sum = row_exp_sum_in_place(row, max);
    let loss = (sum.ln() + max) - target_logit;
    let scale = dl / sum;
    for dj in row.iter_mut() {
        *dj *= scale;
    }
    row[t as usize] -= dl;
    loss
}

/// [`row_gradient_plain`] compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_gradient_avx2(row: &mut [f32], t: u32, dl: f32) -> f32 {
    row_gradient_plain(row, t, dl)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatched rows (AVX2 where present) give the baseline build's bits: losses and
    /// gradients, rows of every tail length, logits spread wide enough to underflow some
    /// exponentials.
    #[test]
    fn the_avx2_build_gives_the_baseline_bits() {
        let mut s = 0x2545_f491u32;
        for v in [1usize, 7, 16, 17, 33, 1000, 50257] {
            let row: Vec<f32> = (0..v)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 17;
                    s ^= s << 5;
                    (s >> 8) as f32 / (1u32 << 24) as f32 * 120.0 - 60.0
                })
                .collect();
            let t = (s as usize % v) as u32;
            assert_eq!(
                row_loss(&row, t).to_bits(),
                row_loss_plain(&row, t).to_bits()
            );
            let (mut fast, mut plain) = (row.clone(), row.clone());
            let a = row_gradient(&mut fast, t, 0.37);
            let b = row_gradient_plain(&mut plain, t, 0.37);
            assert_eq!(a.to_bits(), b.to_bits(), "loss, v = {v}");
            assert!(
                fast.iter()
                    .zip(&plain)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "gradient, v = {v}"
            );
        }
    }

    proptest::proptest! {
        /// In place, each row's loss has the bits of the read-only [`forward`] (so the target's
        /// logit is read before the row is overwritten), and the row becomes
        /// `(softmax − onehot)·dloss` of an f64 reference, for every target position
        /// (the tail's included) and any row count.
        #[test]
        fn the_in_place_gradient_replaces_the_logits(
            v in 1usize..80,
            rows in proptest::collection::vec(
                (proptest::collection::vec(-30f32..30.0, 80), 0usize..80, -2f32..2.0),
                1..6,
            ),
        ) {
            let n = rows.len();
            let logits: Vec<f32> = rows.iter().flat_map(|(r, _, _)| r[..v].to_vec()).collect();
            let targets: Vec<u32> = rows.iter().map(|(_, t, _)| (t % v) as u32).collect();
            let dloss: Vec<f32> = rows.iter().map(|(_, _, d)| *d).collect();
            let mut want_losses = vec![0f32; n];
            forward(&mut want_losses, &logits, &targets, v);
            let (mut losses, mut grad) = (vec![0f32; n], logits.clone());
            forward_backward_in_place(&mut losses, &mut grad, &targets, &dloss, v);
            for i in 0..n {
                proptest::prop_assert_eq!(losses[i].to_bits(), want_losses[i].to_bits());
                let row = &logits[i * v..][..v];
                let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
                let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
                for j in 0..v {
                    let p = (row[j] as f64 - max).exp() / sum;
                    let onehot = if j == targets[i] as usize { 1.0 } else { 0.0 };
                    let want = (p - onehot) * dloss[i] as f64;
                    let got = grad[i * v + j] as f64;
                    proptest::prop_assert!(
                        (got - want).abs() <= 1e-5 * dloss[i].abs() as f64 + 1e-30,
                        "row {} col {}: {} vs {}", i, j, got, want
                    );
                }
            }
        }
    }
}
