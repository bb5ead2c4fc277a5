//! GELU with the tanh approximation (GPT-2's `gelu_new`), split over threads in fixed chunks.

use rayon::prelude::*;

use super::matmul::Operand;
use super::widened_blocks;
use crate::ops::fast_math::tanh;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const K: f32 = 0.044_715;
/// Elements per rayon task.
const CHUNK: usize = 1 << 14;

/// `out = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, `inp` in its stored type (see
/// [`super::widened_blocks`]).
pub fn forward<X: Operand>(out: &mut [f32], inp: &[X]) {
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, i)| widened_blocks(i, |at, xs| forward_piece(&mut o[at..], xs)));
}

/// `gelu(x)`, one element: [`forward`]'s operations.
#[inline(always)]
pub(crate) fn value(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + K * x * x * x);
    0.5 * x * (1.0 + tanh(u))
}

/// `gelu'(x)`.
#[inline(always)]
pub(crate) fn derivative(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + K * x * x * x);
    let t = tanh(u);
    let sech2 = 1.0 - t * t;
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * K * x * x);
    0.5 * (1.0 + t) + 0.5 * x * sech2 * du
}

/// Accumulate `dinp += gelu'(inp) · dout`, `inp` in its stored type.
pub fn backward<X: Operand>(dinp: &mut [f32], inp: &[X], dout: &[f32]) {
    dinp.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .zip(dout.par_chunks(CHUNK))
        .for_each(|((di, i), d)| {
            widened_blocks(i, |at, xs| backward_piece(&mut di[at..], xs, &d[at..]))
        });
}

/// `dout = gelu'(inp) · dout` in place: the input's gradient written over the output's (llm.c's
/// choice; the output's gradient has no other reader), with the bits [`backward`] gives into
/// a zeroed `dinp` — `0 + g`, which turns a −0 product into +0 as the accumulation does.
pub fn backward_in_place<X: Operand>(dout: &mut [f32], inp: &[X]) {
    dout.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(d, i)| widened_blocks(i, |at, xs| backward_in_place_piece(&mut d[at..], xs)));
}

// The element loops, each compiled for AVX-512, AVX2 and the baseline and chosen at run time.
// The tanh's exponential and selects are a few dozen operations per element, so the baseline's
// SSE2 made GELU 3% of a GPT `small` step on AVX2 paths; the wider copies give the same bits
// (plain f32 arithmetic, no reduction; `the_isa_paths_give_the_baseline_bits`).

#[inline(always)]
fn forward_body(out: &mut [f32], xs: &[f32]) {
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = value(x);
    }
}

#[inline(always)]
fn backward_body(dinp: &mut [f32], xs: &[f32], dout: &[f32]) {
    for ((di, &x), &d) in dinp.iter_mut().zip(xs).zip(dout) {
        *di += derivative(x) * d;
    }
}

#[inline(always)]
fn backward_in_place_body(dout: &mut [f32], xs: &[f32]) {
    for (d, &x) in dout.iter_mut().zip(xs) {
        *d = 0.0 + derivative(x) * *d;
    }
}

headroom_tensor::multiversion!(
    /// [`forward_body`] on the widest vectors allowed here.
    fn forward_piece => forward_body(out: &mut [f32], xs: &[f32]) -> ()
);
headroom_tensor::multiversion!(
    /// [`backward_body`] on the widest vectors allowed here.
    fn backward_piece => backward_body(dinp: &mut [f32], xs: &[f32], dout: &[f32]) -> ()
);
headroom_tensor::multiversion!(
    /// [`backward_in_place_body`] on the widest vectors allowed here.
    fn backward_in_place_piece => backward_in_place_body(dout: &mut [f32], xs: &[f32]) -> ()
);

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path gives the baseline's bits: the kernels run at the widest level allowed
    /// here and are compared with the bodies as the baseline build compiles them, on values
    /// that cross the tanh's branches (|u| below 0.3, between, beyond 9), its extremes and
    /// signed zeros, at lengths with every vector tail.
    #[test]
    fn the_isa_paths_give_the_baseline_bits() {
        let mut xs = crate::ops::test_values(7, 1000);
        for (i, x) in xs.iter_mut().enumerate() {
            *x *= [0.2f32, 1.0, 4.0, 12.0, 40.0][i % 5];
        }
        xs.extend([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, f32::MIN_POSITIVE]);
        let ds = crate::ops::test_values(8, xs.len());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for n in [0usize, 1, 7, 8, 15, 16, 17, 33, 100, xs.len()] {
            let (x, d) = (&xs[..n], &ds[..n]);
            let (mut fast, mut plain) = (vec![0f32; n], vec![0f32; n]);
            forward_piece(&mut fast, x);
            forward_body(&mut plain, x);
            assert_eq!(bits(&fast), bits(&plain), "forward, n = {n}");
            let (mut fast, mut plain) = (d.to_vec(), d.to_vec());
            backward_piece(&mut fast, x, d);
            backward_body(&mut plain, x, d);
            assert_eq!(bits(&fast), bits(&plain), "backward, n = {n}");
            let (mut fast, mut plain) = (d.to_vec(), d.to_vec());
            backward_in_place_piece(&mut fast, x);
            backward_in_place_body(&mut plain, x);
            assert_eq!(bits(&fast), bits(&plain), "in place, n = {n}");
        }
    }
}
