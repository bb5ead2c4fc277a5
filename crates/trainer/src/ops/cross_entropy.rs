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
        .for_each(|((l, row), &t)| {
            let max = row_max(row);
            let sum = row_exp_sum(row, max, None);
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
            let max = row_max(row);
            let sum = row_exp_sum(row, max, Some(d));
            *l = (sum.ln() + max) - row[t as usize];
            let scale = dl / sum;
            for dj in d.iter_mut() {
                *dj *= scale;
            }
            d[t as usize] -= dl;
        });
}
