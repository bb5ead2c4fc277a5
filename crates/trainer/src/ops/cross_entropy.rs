//! Softmax cross-entropy over the vocabulary, fused: per-row losses, and
//! `dlogits = (softmax − onehot) · dloss` without storing the probabilities. Rows are split
//! over threads; each row's arithmetic is independent of the split, so results do not depend
//! on the thread count.

use half::bf16;
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
    row_max_of(row, |x| x)
}

/// The maximum of `row`'s values read through `f32_of`, in [`LANES`] partial maxima folded in
/// one fixed order (so a bf16 row and its widened copy give the same bits).
#[inline(always)]
fn row_max_of<T: Copy>(row: &[T], f32_of: impl Fn(T) -> f32) -> f32 {
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    let mut m = [f32::NEG_INFINITY; LANES];
    for c in chunks {
        for (m, &x) in m.iter_mut().zip(c) {
            *m = m.max(f32_of(x));
        }
    }
    tail.iter()
        .map(|&x| f32_of(x))
        .chain(m)
        .fold(f32::NEG_INFINITY, |a, b| a.max(b))
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

headroom_tensor::multiversion!(
    /// One row's loss, on the widest vectors allowed here (see [`row_gradient`]).
    fn row_loss => row_loss_plain(row: &[f32], t: u32) -> f32
);

#[inline(always)]
fn row_loss_plain(row: &[f32], t: u32) -> f32 {
    let max = row_max(row);
    let sum = row_exp_sum(row, max);
    (sum.ln() + max) - row[t as usize]
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
    forward_backward_in_place_rounded(losses, logits, targets, dloss, v, |_| {});
}

/// [`forward_backward_in_place`] on logits that a low-precision head rounds first (a bf16
/// autocast product's output): each row goes through `round`, in place, just before its loss
/// and gradient. The results are those of rounding the whole buffer first, since rows are
/// independent; what changes is memory traffic. A separate rounding pass reads and writes the
/// whole `[rows, V]` buffer (411 MB on `small`'s 8×256 batch) from memory, about 1% of a bf16
/// step on the widening path, where this rounds a row while the loss's passes hold it in cache.
pub fn forward_backward_in_place_rounded(
    losses: &mut [f32],
    logits: &mut [f32],
    targets: &[u32],
    dloss: &[f32],
    v: usize,
    round: impl Fn(&mut [f32]) + Sync,
) {
    losses
        .par_iter_mut()
        .zip(logits.par_chunks_exact_mut(v))
        .zip(targets)
        .zip(dloss)
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(((l, row), &t), &dl)| {
            round(row);
            *l = row_gradient(row, t, dl)
        });
}

/// [`forward`] over bf16 logits: each row widened (exactly) into an f32 row and given
/// [`forward`]'s arithmetic, so the losses have the bits [`forward`] gives on the widened
/// values.
pub fn forward_bf16(losses: &mut [f32], logits: &[bf16], targets: &[u32], v: usize) {
    losses
        .par_iter_mut()
        .zip(logits.par_chunks_exact(v))
        .zip(targets)
        .with_min_len(ROWS_PER_TASK)
        .for_each_init(Vec::new, |row, ((l, logits), &t)| {
            widen_row(row, logits);
            *l = row_loss(row, t);
        });
}

/// [`forward_backward_in_place`] over bf16 logits, the gradient written over them in bf16:
/// each row is given [`forward_backward_in_place`]'s arithmetic on its widened (exact) values,
/// and its gradient rounded to nearest even (NaN kept quiet). So the losses have the bits the
/// f32 function gives on the widened values, and the gradient is its gradient rounded — what
/// torch's bf16 `matmul` receives, and what the AMX products would round an f32 one to.
///
/// The row's exponentials go to an f32 row (`4·V` bytes, 200 KB for GPT-2's vocabulary), one
/// per rayon worker, reused, and not counted by the tracker.
pub fn forward_backward_in_place_bf16(
    losses: &mut [f32],
    logits: &mut [bf16],
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
        .for_each_init(Vec::new, |exps, (((l, row), &t), &dl)| {
            // Every element is overwritten: only a change of length writes (zeros) first.
            exps.resize(v, 0.0);
            *l = row_gradient_bf16(row, exps, t, dl);
        });
}

headroom_tensor::multiversion!(
    /// [`row_gradient`] over a bf16 row, the gradient written back in bf16, the exponentials
    /// kept in `exps` (the row's length): the widening and the rounding happen in the passes
    /// the arithmetic makes anyway. Converting in separate passes over the row cost about 1%
    /// of a bf16 `small` step on the AVX2 paths (two more trips through L2 per row).
    fn row_gradient_bf16 => row_gradient_bf16_plain(
        row: &mut [bf16],
        exps: &mut [f32],
        t: u32,
        dl: f32
    ) -> f32
);

#[inline(always)]
fn row_gradient_bf16_plain(row: &mut [bf16], exps: &mut [f32], t: u32, dl: f32) -> f32 {
    use headroom_tensor::cpu::kernels::{bf16_bits_to_f32, f32_to_bf16_bits};
    let wide = |x: bf16| bf16_bits_to_f32(x.to_bits());
    let narrow = |x: f32| bf16::from_bits(f32_to_bf16_bits(x));
    let t = t as usize;
    let target_logit = wide(row[t]);
    let max = row_max_of(row, wide);
    // `row_exp_sum_in_place`'s additions, in the same order, its terms stored in `exps`.
    let n = row.len() - row.len() % LANES;
    let mut acc = [0f32; LANES];
    for (c, e) in row[..n]
        .chunks_exact(LANES)
        .zip(exps[..n].chunks_exact_mut(LANES))
    {
        for ((a, &x), e) in acc.iter_mut().zip(c).zip(e) {
            let term = exp(wide(x) - max);
            *e = term;
            *a += term;
        }
    }
    let mut tail_sum = 0f32;
    for (&x, e) in row[n..].iter().zip(&mut exps[n..]) {
        let term = exp(wide(x) - max);
        *e = term;
        tail_sum += term;
    }
    let sum = acc.iter().sum::<f32>() + tail_sum;
    let loss = (sum.ln() + max) - target_logit;
    let scale = dl / sum;
    for (d, &e) in row.iter_mut().zip(exps.iter()) {
        *d = narrow(e * scale);
    }
    row[t] = narrow(exps[t] * scale - dl);
    loss
}

/// `row` ← `logits` widened to f32 (exact), reusing `row`'s allocation. The tensor crate's
/// conversions, on the widest vectors allowed here (the same bits as the scalar formulas).
fn widen_row(row: &mut Vec<f32>, logits: &[bf16]) {
    use headroom_tensor::cpu::kernels::widen_bf16;
    // Every element is overwritten: only a change of length writes (zeros) first.
    row.resize(logits.len(), 0.0);
    widen_bf16(logits, row);
}

headroom_tensor::multiversion!(
    /// One row's loss, the row replaced by its logits' gradient scaled by `dl`, compiled for
    /// AVX-512, AVX2 and the baseline and chosen at run time. Rust never contracts `a·b + c`
    /// into a fused multiply-add and the [`LANES`] partial sums fix the order of every
    /// addition, so every path gives the same bits (tested), with two or four times the
    /// baseline SSE2's lanes. The rows were 10% of the gemm kernel's samples in an fp32 step
    /// on the AVX-512 Xeon with either copy until `fast_math::exp` stopped converting to an
    /// integer lane by lane; now 3.7% (2.5% on the AVX2 copy).
    fn row_gradient => row_gradient_plain(row: &mut [f32], t: u32, dl: f32) -> f32
);

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatched rows (the widest path allowed here) give the baseline build's bits: losses and
    /// gradients, rows of every tail length, logits spread wide enough to underflow some
    /// exponentials.
    #[test]
    fn the_isa_paths_give_the_baseline_bits() {
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
            // The bf16 rows: the same bits as the baseline's, and as the f32 row's on the
            // widened values, rounded.
            let row16: Vec<bf16> = row.iter().map(|&x| bf16::from_f32(x)).collect();
            let (mut fast16, mut plain16) = (row16.clone(), row16.clone());
            let (mut e1, mut e2) = (vec![0f32; v], vec![0f32; v]);
            let a = row_gradient_bf16(&mut fast16, &mut e1, t, 0.37);
            let b = row_gradient_bf16_plain(&mut plain16, &mut e2, t, 0.37);
            let mut wide: Vec<f32> = row16.iter().map(|x| x.to_f32()).collect();
            let c = row_gradient_plain(&mut wide, t, 0.37);
            assert_eq!(a.to_bits(), b.to_bits(), "bf16 loss, v = {v}");
            assert_eq!(a.to_bits(), c.to_bits(), "bf16 loss against f32, v = {v}");
            let bits16 = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits16(&fast16), bits16(&plain16), "bf16 gradient, v = {v}");
            let rounded: Vec<bf16> = wide.iter().map(|&x| bf16::from_f32(x)).collect();
            assert_eq!(bits16(&fast16), bits16(&rounded), "bf16 gradient, v = {v}");
        }
    }

    proptest::proptest! {
        /// Rounding each row inside the loss gives the bits of rounding the whole buffer first
        /// and then taking the loss: losses, gradients, and the rows left behind.
        #[test]
        fn rounding_rows_inside_the_loss_is_rounding_the_buffer_first(
            v in 1usize..70,
            rows in proptest::collection::vec(
                (proptest::collection::vec(-40f32..40.0, 70), 0usize..70, -2f32..2.0),
                1..6,
            ),
        ) {
            use headroom_tensor::cpu::kernels::round_to_bf16_in_place;
            let n = rows.len();
            let logits: Vec<f32> = rows.iter().flat_map(|(r, _, _)| r[..v].to_vec()).collect();
            let targets: Vec<u32> = rows.iter().map(|(_, t, _)| (t % v) as u32).collect();
            let dloss: Vec<f32> = rows.iter().map(|(_, _, d)| *d).collect();
            let (mut want, mut got) = (logits.clone(), logits);
            let (mut want_losses, mut losses) = (vec![0f32; n], vec![0f32; n]);
            round_to_bf16_in_place(&mut want);
            forward_backward_in_place(&mut want_losses, &mut want, &targets, &dloss, v);
            forward_backward_in_place_rounded(
                &mut losses,
                &mut got,
                &targets,
                &dloss,
                v,
                round_to_bf16_in_place,
            );
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            proptest::prop_assert_eq!(bits(&losses), bits(&want_losses));
            proptest::prop_assert_eq!(bits(&got), bits(&want));
        }

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

        /// Over bf16 logits, the losses have the bits of the f32 functions on the widened
        /// values, and the gradient written in bf16 is the f32 gradient rounded to nearest
        /// even, for rows of every tail length (more than one row per task) and logits spread
        /// wide enough to underflow exponentials.
        #[test]
        fn bf16_logits_give_the_f32_bits_rounded(
            v in 1usize..70,
            n in 1usize..11,
            seed in proptest::prelude::any::<u64>(),
            spread in 1f32..80.0,
        ) {
            let logits: Vec<bf16> = crate::ops::test_values(seed, n * v)
                .into_iter()
                .map(|x| bf16::from_f32((x - 0.5) * spread))
                .collect();
            let wide: Vec<f32> = logits.iter().map(|x| x.to_f32()).collect();
            let targets: Vec<u32> = (0..n).map(|i| ((seed as usize >> 3) + 7 * i) as u32 % v as u32).collect();
            let dloss: Vec<f32> = (0..n).map(|i| 0.25 + i as f32 / 7.0).collect();
            let (mut want_fwd, mut got_fwd) = (vec![0f32; n], vec![0f32; n]);
            forward(&mut want_fwd, &wide, &targets, v);
            forward_bf16(&mut got_fwd, &logits, &targets, v);
            let (mut want_losses, mut want_grad) = (vec![0f32; n], wide.clone());
            forward_backward_in_place(&mut want_losses, &mut want_grad, &targets, &dloss, v);
            let (mut losses, mut grad) = (vec![0f32; n], logits.clone());
            forward_backward_in_place_bf16(&mut losses, &mut grad, &targets, &dloss, v);
            for i in 0..n {
                proptest::prop_assert_eq!(got_fwd[i].to_bits(), want_fwd[i].to_bits());
                proptest::prop_assert_eq!(losses[i].to_bits(), want_losses[i].to_bits());
            }
            for (g, w) in grad.iter().zip(&want_grad) {
                proptest::prop_assert_eq!(g.to_bits(), bf16::from_f32(*w).to_bits());
            }
        }
    }
}
