//! SwiGLU's elementwise gate (Llama's MLP): `silu(gate) · up`, `silu(g) = g · σ(g)` — the
//! [`super::glu`] loops with [`Silu`].

use super::glu::{self, Silu};
use super::matmul::Operand;

/// `out = silu(gate) · up`, `gate` and `up` in their stored type (see
/// [`super::widened_block_pairs`]).
pub fn forward<X: Operand>(out: &mut [f32], gate: &[X], up: &[X]) {
    glu::forward::<Silu, X>(out, gate, up)
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
    glu::backward::<Silu, X>(dgate, dup, gate, up, dout)
}

/// [`backward`] with `dup` written over `dout`: the bits `backward` gives into a zeroed `dup`.
pub fn backward_in_place<X: Operand>(dgate: &mut [f32], dout: &mut [f32], gate: &[X], up: &[X]) {
    glu::backward_in_place::<Silu, X>(dgate, dout, gate, up)
}
