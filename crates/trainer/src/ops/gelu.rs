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
        .for_each(|(o, i)| {
            widened_blocks(i, |at, xs| {
                for (o, &x) in o[at..].iter_mut().zip(xs) {
                    let u = SQRT_2_OVER_PI * (x + K * x * x * x);
                    *o = 0.5 * x * (1.0 + tanh(u));
                }
            })
        });
}

/// `gelu'(x)`.
#[inline(always)]
fn derivative(x: f32) -> f32 {
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
            widened_blocks(i, |at, xs| {
                for ((di, &x), &d) in di[at..].iter_mut().zip(xs).zip(&d[at..]) {
                    *di += derivative(x) * d;
                }
            })
        });
}

/// `dout = gelu'(inp) · dout` in place: the input's gradient written over the output's (llm.c's
/// choice; the output's gradient has no other reader), with the bits [`backward`] gives into
/// a zeroed `dinp` — `0 + g`, which turns a −0 product into +0 as the accumulation does.
pub fn backward_in_place<X: Operand>(dout: &mut [f32], inp: &[X]) {
    dout.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(d, i)| {
            widened_blocks(i, |at, xs| {
                for (d, &x) in d[at..].iter_mut().zip(xs) {
                    *d = 0.0 + derivative(x) * *d;
                }
            })
        });
}
