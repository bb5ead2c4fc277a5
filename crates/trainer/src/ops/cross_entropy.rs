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

fn row_max_sum(row: &[f32]) -> (f32, f32) {
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    let mut m = [f32::NEG_INFINITY; LANES];
    for c in chunks.clone() {
        for (m, &x) in m.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    let max = tail
        .iter()
        .chain(&m)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut acc = [0f32; LANES];
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += exp(x - max);
        }
    }
    let sum = acc.iter().sum::<f32>() + tail.iter().map(|&x| exp(x - max)).sum::<f32>();
    (max, sum)
}

/// Per-row loss `-log softmax(logits)[target]`, computed stably; `losses[n]`.
pub fn forward(losses: &mut [f32], logits: &[f32], targets: &[u32], v: usize) {
    losses
        .par_iter_mut()
        .zip(logits.par_chunks_exact(v))
        .zip(targets)
        .with_min_len(ROWS_PER_TASK)
        .for_each(|((l, row), &t)| {
            let (max, sum) = row_max_sum(row);
            *l = (sum.ln() + max) - row[t as usize];
        });
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
        .for_each(|((((l, d), row), &t), &dl)| {
            let (max, sum) = row_max_sum(row);
            *l = (sum.ln() + max) - row[t as usize];
            let scale = dl / sum;
            for (dj, &x) in d.iter_mut().zip(row) {
                *dj = exp(x - max) * scale;
            }
            d[t as usize] -= dl;
        });
}
