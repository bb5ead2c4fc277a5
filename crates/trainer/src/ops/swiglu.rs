//! SwiGLU's elementwise gate (Llama's MLP): `silu(gate) · up`, `silu(g) = g · σ(g)`.

use rayon::prelude::*;

use super::matmul::Operand;
use super::widened_block_pairs;

const CHUNK: usize = 1 << 14;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `out = silu(gate) · up`, `gate` and `up` in their stored type (see
/// [`super::widened_block_pairs`]).
pub fn forward<X: Operand>(out: &mut [f32], gate: &[X], up: &[X]) {
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((o, g), u)| {
            widened_block_pairs(g, u, |at, g, u| {
                for ((o, &g), &u) in o[at..].iter_mut().zip(g).zip(u) {
                    *o = g * sigmoid(g) * u;
                }
            })
        });
}

/// One element's `(silu'(g) · u · d, silu(g) · d)`: what [`backward`] and
/// [`backward_in_place`] add into the gate's and up's gradients.
#[inline(always)]
fn gradient_terms(g: f32, u: f32, d: f32) -> (f32, f32) {
    let s = sigmoid(g);
    (s * (1.0 + g * (1.0 - s)) * u * d, g * s * d)
}

/// Accumulate `dgate += silu'(gate) · up · dout` and `dup += silu(gate) · dout`, with
/// `silu'(g) = σ(g) · (1 + g · (1 − σ(g)))`; `gate` and `up` in their stored type.
pub fn backward<X: Operand>(
    dgate: &mut [f32],
    dup: &mut [f32],
    gate: &[X],
    up: &[X],
    dout: &[f32],
) {
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .zip(dout.par_chunks(CHUNK))
        .for_each(|((((dg, du), g), u), d)| {
            widened_block_pairs(g, u, |at, g, u| {
                let (dg, du, d) = (&mut dg[at..], &mut du[at..], &d[at..]);
                for i in 0..g.len() {
                    let (to_gate, to_up) = gradient_terms(g[i], u[i], d[i]);
                    dg[i] += to_gate;
                    du[i] += to_up;
                }
            })
        });
}

/// [`backward`] with `dup` written over `dout` (its only other reader is `dgate`'s term,
/// computed first for each element): `dgate += silu'(gate) · up · dout`, then
/// `dout = 0 + silu(gate) · dout` — the bits `backward` gives into a zeroed `dup`.
pub fn backward_in_place<X: Operand>(dgate: &mut [f32], dout: &mut [f32], gate: &[X], up: &[X]) {
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dout.par_chunks_mut(CHUNK))
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|(((dg, d), g), u)| {
            widened_block_pairs(g, u, |at, g, u| {
                let (dg, d) = (&mut dg[at..], &mut d[at..]);
                for i in 0..g.len() {
                    let (to_gate, to_up) = gradient_terms(g[i], u[i], d[i]);
                    dg[i] += to_gate;
                    d[i] = 0.0 + to_up;
                }
            })
        });
}
