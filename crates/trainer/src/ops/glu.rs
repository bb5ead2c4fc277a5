//! The gated MLPs' elementwise gate, `act(gate) · up`: SiLU for Llama's SwiGLU
//! ([`super::swiglu`]), GELU with the tanh approximation for Gemma's GeGLU (transformers'
//! `gelu_pytorch_tanh`). One loop for both; each [`Gate`] gives an element's value and
//! gradient terms.
//!
//! Both activations are an exponential and a few dozen f32 operations per element, written
//! without libm (the crate's `fast_math::exp`) so that the loops vectorise; each gate's pieces
//! are compiled for AVX-512 and AVX2 and chosen at run time, and every level gives the
//! baseline build's bits (plain f32 arithmetic, no reduction, no contraction;
//! `isa_paths_give_the_baseline_bits`).

use rayon::prelude::*;

use super::matmul::Operand;
use super::widened_block_pairs;

const CHUNK: usize = 1 << 14;

/// An activation that gates the up projection.
pub trait Gate: Sync + Sized {
    /// `act(g) · u`.
    fn value(g: f32, u: f32) -> f32;
    /// `(act'(g) · u · d, act(g) · d)`: what the gate's and up's gradients receive.
    fn gradient_terms(g: f32, u: f32, d: f32) -> (f32, f32);

    /// [`forward_body`] on a piece; a gate may run it on wider vectors (same bits).
    fn forward_piece(out: &mut [f32], g: &[f32], u: &[f32]) {
        forward_body::<Self>(out, g, u)
    }

    /// [`backward_body`] on a piece (same freedom).
    fn backward_piece(dg: &mut [f32], du: &mut [f32], g: &[f32], u: &[f32], d: &[f32]) {
        backward_body::<Self>(dg, du, g, u, d)
    }

    /// [`backward_in_place_body`] on a piece (same freedom).
    fn backward_in_place_piece(dg: &mut [f32], d: &mut [f32], g: &[f32], u: &[f32]) {
        backward_in_place_body::<Self>(dg, d, g, u)
    }
}

/// `out[i] = act(g[i]) · u[i]`.
#[inline(always)]
pub fn forward_body<A: Gate>(out: &mut [f32], g: &[f32], u: &[f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = A::value(g, u);
    }
}

/// `dg[i] += act'(g[i]) · u[i] · d[i]`, `du[i] += act(g[i]) · d[i]`.
#[inline(always)]
pub fn backward_body<A: Gate>(dg: &mut [f32], du: &mut [f32], g: &[f32], u: &[f32], d: &[f32]) {
    let n = g
        .len()
        .min(u.len())
        .min(d.len())
        .min(dg.len())
        .min(du.len());
    for i in 0..n {
        let (to_gate, to_up) = A::gradient_terms(g[i], u[i], d[i]);
        dg[i] += to_gate;
        du[i] += to_up;
    }
}

/// `dg[i] += act'(g[i]) · u[i] · d[i]`, then `d[i] = 0 + act(g[i]) · d[i]`.
#[inline(always)]
pub fn backward_in_place_body<A: Gate>(dg: &mut [f32], d: &mut [f32], g: &[f32], u: &[f32]) {
    let n = g.len().min(u.len()).min(d.len()).min(dg.len());
    for i in 0..n {
        let (to_gate, to_up) = A::gradient_terms(g[i], u[i], d[i]);
        dg[i] += to_gate;
        d[i] = 0.0 + to_up;
    }
}

/// `silu(g) = g · σ(g)`, `σ(g) = 1 / (1 + e^−g)` (Llama's SwiGLU).
pub struct Silu;

/// `σ(x)` with `fast_math::exp`: within a few ulp of libm's
/// (as PyTorch's CPU SiLU, whose vectorised `exp` is not libm's either). Far below −87 the
/// clamped exponential leaves σ at about 3·10⁻³⁹ where libm's overflow gives 0: `silu` is then
/// −3·10⁻³⁷·|g|-ish instead of −0, beneath every tolerance.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + crate::ops::fast_math::exp(-x))
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

    fn forward_piece(out: &mut [f32], g: &[f32], u: &[f32]) {
        silu_pieces::forward_piece(out, g, u)
    }

    fn backward_piece(dg: &mut [f32], du: &mut [f32], g: &[f32], u: &[f32], d: &[f32]) {
        silu_pieces::backward_piece(dg, du, g, u, d)
    }

    fn backward_in_place_piece(dg: &mut [f32], d: &mut [f32], g: &[f32], u: &[f32]) {
        silu_pieces::backward_in_place_piece(dg, d, g, u)
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

    fn forward_piece(out: &mut [f32], g: &[f32], u: &[f32]) {
        gelu_pieces::forward_piece(out, g, u)
    }

    fn backward_piece(dg: &mut [f32], du: &mut [f32], g: &[f32], u: &[f32], d: &[f32]) {
        gelu_pieces::backward_piece(dg, du, g, u, d)
    }

    fn backward_in_place_piece(dg: &mut [f32], d: &mut [f32], g: &[f32], u: &[f32]) {
        gelu_pieces::backward_in_place_piece(dg, d, g, u)
    }
}

/// A gate's three loops ([`forward_body`], [`backward_body`], [`backward_in_place_body`]),
/// each compiled for the widest vectors allowed here, in a module of their own.
macro_rules! vectorized_gate {
    ($module:ident, $gate:ty) => {
        mod $module {
            use super::*;

            #[inline(always)]
            pub(super) fn forward_plain(out: &mut [f32], g: &[f32], u: &[f32]) {
                forward_body::<$gate>(out, g, u)
            }

            #[inline(always)]
            pub(super) fn backward_plain(
                dg: &mut [f32],
                du: &mut [f32],
                g: &[f32],
                u: &[f32],
                d: &[f32],
            ) {
                backward_body::<$gate>(dg, du, g, u, d)
            }

            #[inline(always)]
            pub(super) fn backward_in_place_plain(
                dg: &mut [f32],
                d: &mut [f32],
                g: &[f32],
                u: &[f32],
            ) {
                backward_in_place_body::<$gate>(dg, d, g, u)
            }

            headroom_tensor::multiversion!(
                /// [`forward_plain`] on the widest vectors allowed here.
                pub(super) fn forward_piece => forward_plain(
                    out: &mut [f32],
                    g: &[f32],
                    u: &[f32]
                ) -> ()
            );
            headroom_tensor::multiversion!(
                /// [`backward_plain`] on the widest vectors allowed here.
                pub(super) fn backward_piece => backward_plain(
                    dg: &mut [f32],
                    du: &mut [f32],
                    g: &[f32],
                    u: &[f32],
                    d: &[f32]
                ) -> ()
            );
            headroom_tensor::multiversion!(
                /// [`backward_in_place_plain`] on the widest vectors allowed here.
                pub(super) fn backward_in_place_piece => backward_in_place_plain(
                    dg: &mut [f32],
                    d: &mut [f32],
                    g: &[f32],
                    u: &[f32]
                ) -> ()
            );
        }
    };
}

vectorized_gate!(silu_pieces, Silu);
vectorized_gate!(gelu_pieces, GeluTanh);

/// `out = act(gate) · up`, `gate` and `up` in their stored type (see
/// [`super::widened_block_pairs`]).
pub fn forward<A: Gate, X: Operand>(out: &mut [f32], gate: &[X], up: &[X]) {
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((o, g), u)| {
            widened_block_pairs(g, u, |at, g, u| A::forward_piece(&mut o[at..], g, u))
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
                A::backward_piece(&mut dg[at..], &mut du[at..], g, u, &d[at..])
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
                A::backward_in_place_piece(&mut dg[at..], &mut d[at..], g, u)
            })
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    type BackwardBody = fn(&mut [f32], &mut [f32], &[f32], &[f32], &[f32]);
    type InPlaceBody = fn(&mut [f32], &mut [f32], &[f32], &[f32]);

    /// A gate's pieces at the widest level allowed here give the baseline build's bits, on
    /// values that cross the exponential's clamps and the tanh's branches, their extremes and
    /// signed zeros, at lengths with every vector tail.
    fn isa_paths_give_the_baseline_bits<A: Gate>(
        plain_forward: fn(&mut [f32], &[f32], &[f32]),
        plain_backward: BackwardBody,
        plain_in_place: InPlaceBody,
    ) {
        let mut g = crate::ops::test_values(11, 1000);
        for (i, x) in g.iter_mut().enumerate() {
            *x *= [0.2f32, 1.0, 4.0, 12.0, 40.0, 100.0][i % 6];
        }
        g.extend([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, f32::MIN_POSITIVE]);
        let (u, d) = (
            crate::ops::test_values(12, g.len()),
            crate::ops::test_values(13, g.len()),
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for n in [0usize, 1, 7, 8, 15, 16, 17, 33, 100, g.len()] {
            let (g, u, d) = (&g[..n], &u[..n], &d[..n]);
            let (mut fast, mut plain) = (vec![0f32; n], vec![0f32; n]);
            A::forward_piece(&mut fast, g, u);
            plain_forward(&mut plain, g, u);
            assert_eq!(bits(&fast), bits(&plain), "forward, n = {n}");
            let (mut fast_g, mut fast_u) = (d.to_vec(), u.to_vec());
            let (mut plain_g, mut plain_u) = (d.to_vec(), u.to_vec());
            A::backward_piece(&mut fast_g, &mut fast_u, g, u, d);
            plain_backward(&mut plain_g, &mut plain_u, g, u, d);
            assert_eq!(bits(&fast_g), bits(&plain_g), "backward gate, n = {n}");
            assert_eq!(bits(&fast_u), bits(&plain_u), "backward up, n = {n}");
            let (mut fast_g, mut fast_d) = (u.to_vec(), d.to_vec());
            let (mut plain_g, mut plain_d) = (u.to_vec(), d.to_vec());
            A::backward_in_place_piece(&mut fast_g, &mut fast_d, g, u);
            plain_in_place(&mut plain_g, &mut plain_d, g, u);
            assert_eq!(bits(&fast_g), bits(&plain_g), "in place gate, n = {n}");
            assert_eq!(bits(&fast_d), bits(&plain_d), "in place, n = {n}");
        }
    }

    #[test]
    fn silu_gate_isa_paths_give_the_baseline_bits() {
        isa_paths_give_the_baseline_bits::<Silu>(
            silu_pieces::forward_plain,
            silu_pieces::backward_plain,
            silu_pieces::backward_in_place_plain,
        );
    }

    #[test]
    fn gelu_gate_isa_paths_give_the_baseline_bits() {
        isa_paths_give_the_baseline_bits::<GeluTanh>(
            gelu_pieces::forward_plain,
            gelu_pieces::backward_plain,
            gelu_pieces::backward_in_place_plain,
        );
    }

    /// SiLU's value and both gradient terms against an f64 reference (libm's `exp` in f64) of
    /// the same f32 inputs: within 2·10⁻⁶ relative, plus 10⁻⁷·|u·d| absolute for the gate's
    /// term where `1 + g·(1 − σ)` cancels (near g ≈ −1.28) and 10⁻³⁰ in the clamp's tails.
    #[test]
    fn silu_gate_matches_an_f64_reference() {
        let (u, d) = (0.75f32, -1.25f32);
        let floors = [1e-30, 1e-7 * f64::from(u * d).abs(), 1e-30];
        let mut worst = [0f64; 3];
        let mut g = -90.0f32;
        while g < 90.0 {
            let s = 1.0 / (1.0 + (-f64::from(g)).exp());
            let (g64, u64_, d64) = (f64::from(g), f64::from(u), f64::from(d));
            let want = [
                g64 * s * u64_,
                s * (1.0 + g64 * (1.0 - s)) * u64_ * d64,
                g64 * s * d64,
            ];
            let (to_gate, to_up) = Silu::gradient_terms(g, u, d);
            let got = [Silu::value(g, u), to_gate, to_up];
            for k in 0..3 {
                let excess = (f64::from(got[k]) - want[k]).abs() - floors[k];
                worst[k] = worst[k].max(excess / want[k].abs().max(f64::MIN_POSITIVE));
            }
            g += 0.000_913;
        }
        for (k, what) in ["value", "gate gradient", "up gradient"].iter().enumerate() {
            assert!(
                worst[k] < 2e-6,
                "{what}: worst relative error {:e}",
                worst[k]
            );
        }
    }
}
