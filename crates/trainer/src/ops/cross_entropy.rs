//! Softmax cross-entropy over the vocabulary, fused: per-row losses, and
//! `dlogits = (softmax − onehot) · dloss` without storing the probabilities. Rows are split
//! over threads; each row's arithmetic is independent of the split, so results do not depend
//! on the thread count.

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

/// `Σ exp(x − max)` over the row, in [`LANES`] partial sums; with `out`, each term is also
/// written there (so the gradient pass does not compute the exponentials again).
#[inline(always)]
fn row_exp_sum(row: &[f32], max: f32, out: Option<&mut [f32]>) -> f32 {
    let mut acc = [0f32; LANES];
    let mut tail_sum = 0f32;
    let n = row.len() - row.len() % LANES;
    match out {
        Some(out) => {
            for (c, o) in row[..n]
                .chunks_exact(LANES)
                .zip(out[..n].chunks_exact_mut(LANES))
            {
                for ((a, &x), o) in acc.iter_mut().zip(c).zip(o) {
                    let e = exp(x - max);
                    *o = e;
                    *a += e;
                }
            }
            for (&x, o) in row[n..].iter().zip(&mut out[n..]) {
                let e = exp(x - max);
                *o = e;
                tail_sum += e;
            }
        }
        None => {
            for c in row[..n].chunks_exact(LANES) {
                for (a, &x) in acc.iter_mut().zip(c) {
                    *a += exp(x - max);
                }
            }
            tail_sum = row[n..].iter().map(|&x| exp(x - max)).sum();
        }
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
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked just above).
        return unsafe { row_loss_avx2(row, t) };
    }
    row_loss_plain(row, t)
}

#[inline(always)]
fn row_loss_plain(row: &[f32], t: u32) -> f32 {
    let max = row_max(row);
    let sum = row_exp_sum(row, max, None);
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
    let mut scratch = vec![0f32; targets.len()];
    forward_backward(&mut scratch, dlogits, logits, targets, dloss, v);
}

/// [`forward`] and [`backward`] in one pass over the logits.
pub fn forward_backward(
    losses: &mut [f32],
    dlogits: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    dloss: &[f32],
    v: usize,
) {
    losses
        .par_iter_mut()
        .zip(dlogits.par_chunks_exact_mut(v))
        .zip(logits.par_chunks_exact(v))
        .zip(targets)
        .zip(dloss)
        .with_min_len(ROWS_PER_TASK)
        .for_each(|((((l, d), row), &t), &dl)| *l = row_gradient(row, d, t, dl));
}

/// One row's loss, with `d` = its logits' gradient scaled by `dl`. On AVX2 machines the same
/// code compiled for AVX2: Rust never contracts `a·b + c` into a fused multiply-add and the
/// [`LANES`] partial sums fix the order of every addition, so both builds give the same bits
/// (tested), with twice the lanes of the baseline's SSE2. The exponentials were ~10% of a
/// `small` step's samples on the baseline build.
fn row_gradient(row: &[f32], d: &mut [f32], t: u32, dl: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked just above).
        return unsafe { row_gradient_avx2(row, d, t, dl) };
    }
    row_gradient_plain(row, d, t, dl)
}

#[inline(always)]
fn row_gradient_plain(row: &[f32], d: &mut [f32], t: u32, dl: f32) -> f32 {
    let max = row_max(row);
    let sum = row_exp_sum(row, max, Some(d));
    let loss = (sum.ln() + max) - row[t as usize];
    let scale = dl / sum;
    for dj in d.iter_mut() {
        *dj *= scale;
    }
    d[t as usize] -= dl;
    loss
}

/// [`row_gradient_plain`] compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_gradient_avx2(row: &[f32], d: &mut [f32], t: u32, dl: f32) -> f32 {
    row_gradient_plain(row, d, t, dl)
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
            let (mut fast, mut plain) = (vec![0f32; v], vec![0f32; v]);
            let a = row_gradient(&row, &mut fast, t, 0.37);
            let b = row_gradient_plain(&row, &mut plain, t, 0.37);
            assert_eq!(a.to_bits(), b.to_bits(), "loss, v = {v}");
            assert!(
                fast.iter()
                    .zip(&plain)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "gradient, v = {v}"
            );
        }
    }
}
