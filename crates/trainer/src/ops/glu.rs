//! The gated MLPs' elementwise gate, `act(gate) · up`: SiLU for Llama's SwiGLU
//! ([`super::swiglu`]), GELU with the tanh approximation for Gemma's GeGLU (transformers'
//! `gelu_pytorch_tanh`). One loop for both; each [`Gate`] gives an element's value and
//! gradient terms.

use rayon::prelude::*;

use super::matmul::Operand;
use super::widened_block_pairs;

const CHUNK: usize = 1 << 14;

/// An activation that gates the up projection.
pub trait Gate: Sync {
    /// `act(g) · u`.
    fn value(g: f32, u: f32) -> f32;
    /// `(act'(g) · u · d, act(g) · d)`: what the gate's and up's gradients receive.
    fn gradient_terms(g: f32, u: f32, d: f32) -> (f32, f32);
}

/// `silu(g) = g · σ(g)`, `σ(g) = 1 / (1 + e^−g)` (Llama's SwiGLU).
pub struct Silu;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl Gate for Silu {
    #[inline(always)]
    fn value(g: f32, u: f32) -> f32 {
        g * sigmoid(g) * u
    }

    /// `silu'(g) = σ(g) · (1 + g · (1 − σ(g)))`.
    #[inline(always)]
    fn gradient_terms(g: f32, u: f32, d: f32) -> (f32, f32) {
        let s = sigmoid(g);
        (s * (1.0 + g * (1.0 - s)) * u * d, g * s * d)
    }
}

/// GELU with the tanh approximation, [`super::gelu`]'s operations element for element (so a
/// gate's values are GPT-2's GELU's bit for bit).
pub struct GeluTanh;

impl Gate for GeluTanh {
    #[inline(always)]
    fn value(g: f32, u: f32) -> f32 {
        super::gelu::value(g) * u
    }

    #[inline(always)]
    fn gradient_terms(g: f32, u: f32, d: f32) -> (f32, f32) {
        (
            super::gelu::derivative(g) * u * d,
            super::gelu::value(g) * d,
        )
    }
}

/// `out = act(gate) · up`, `gate` and `up` in their stored type (see
/// [`super::widened_block_pairs`]).
pub fn forward<A: Gate, X: Operand>(out: &mut [f32], gate: &[X], up: &[X]) {
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((o, g), u)| {
            widened_block_pairs(g, u, |at, g, u| {
                for ((o, &g), &u) in o[at..].iter_mut().zip(g).zip(u) {
                    *o = A::value(g, u);
                }
            })
        });
}

/// Accumulate `dgate += act'(gate) · up · dout` and `dup += act(gate) · dout`; `gate` and
/// `up` in their stored type.
pub fn backward<A: Gate, X: Operand>(
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
                    let (to_gate, to_up) = A::gradient_terms(g[i], u[i], d[i]);
                    dg[i] += to_gate;
                    du[i] += to_up;
                }
            })
        });
}

/// [`backward`] with `dup` written over `dout` (its only other reader is `dgate`'s term,
/// computed first for each element): `dgate += act'(gate) · up · dout`, then
/// `dout = 0 + act(gate) · dout` — the bits `backward` gives into a zeroed `dup`.
pub fn backward_in_place<A: Gate, X: Operand>(
    dgate: &mut [f32],
    dout: &mut [f32],
    gate: &[X],
    up: &[X],
) {
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dout.par_chunks_mut(CHUNK))
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|(((dg, d), g), u)| {
            widened_block_pairs(g, u, |at, g, u| {
                let (dg, d) = (&mut dg[at..], &mut d[at..]);
                for i in 0..g.len() {
                    let (to_gate, to_up) = A::gradient_terms(g[i], u[i], d[i]);
                    dg[i] += to_gate;
                    d[i] = 0.0 + to_up;
                }
            })
        });
}
