//! The models' CPU kernels in f32, each a forward and an accumulating backward on plain slices,
//! in llm.c's layouts. The model wires them together; the tests check each backward against
//! central finite differences of its forward.
//!
//! The element-wise kernels and the norms read their activation inputs in the stored type
//! ([`matmul::Operand`]: f32, bf16 or f16), widened a block or a row at a time
//! ([`widened_blocks`], [`widened_rows`]): a bf16 run's block backward holds no f32 copy of a
//! kept activation for them, and computes the bits an f32 copy would give.

pub mod bf16_gemm;
pub mod cross_entropy;
pub mod embedding;
mod fast_math;
pub mod gelu;
pub mod glu;
pub mod layernorm;
pub mod matmul;
pub mod quant_matmul;
pub mod rmsnorm;
pub mod rope;
pub mod strided;
pub mod swiglu;
pub mod widening_gemm;

use matmul::Operand;

/// Values [`widened_blocks`] widens at a time: 4 KiB of f32 on the stack, well inside L1.
pub const WIDEN_BLOCK: usize = 1024;

/// Calls `f(start, values)` on consecutive pieces of `src` read as f32, in order, covering it:
/// the slice itself when it is f32, else pieces of [`WIDEN_BLOCK`] values widened into a stack
/// buffer. Widening bf16/f16 is exact, so a kernel reading the pieces computes on exactly the
/// stored values, with the bits it has on an f32 copy of them; the difference is memory: a
/// 4 KiB buffer per task instead of a whole-tensor f32 copy (the "view" this replaces).
pub fn widened_blocks<X: Operand>(src: &[X], mut f: impl FnMut(usize, &[f32])) {
    if let Some(s) = X::as_f32(src) {
        return f(0, s);
    }
    let mut buf = [0f32; WIDEN_BLOCK];
    for (i, piece) in src.chunks(WIDEN_BLOCK).enumerate() {
        let b = &mut buf[..piece.len()];
        X::widen(piece, b);
        f(i * WIDEN_BLOCK, b);
    }
}

/// [`widened_blocks`] for two operands of the same length, widened piece by piece in step.
pub fn widened_block_pairs<X: Operand>(a: &[X], b: &[X], mut f: impl FnMut(usize, &[f32], &[f32])) {
    debug_assert_eq!(a.len(), b.len());
    if let (Some(a), Some(b)) = (X::as_f32(a), X::as_f32(b)) {
        return f(0, a, b);
    }
    let (mut ba, mut bb) = ([0f32; WIDEN_BLOCK], [0f32; WIDEN_BLOCK]);
    for (i, (pa, pb)) in a.chunks(WIDEN_BLOCK).zip(b.chunks(WIDEN_BLOCK)).enumerate() {
        let (wa, wb) = (&mut ba[..pa.len()], &mut bb[..pb.len()]);
        X::widen(pa, wa);
        X::widen(pb, wb);
        f(i * WIDEN_BLOCK, wa, wb);
    }
}

/// Calls `f` on each whole row of `c` values of `src`, read as f32: the row itself when `src`
/// is f32, else the row widened into one reused `c`-value buffer (a row at a time: the norms
/// read each row two or three times, from L1).
pub fn widened_rows<X: Operand>(src: &[X], c: usize, mut f: impl FnMut(&[f32])) {
    if c == 0 {
        return;
    }
    if let Some(s) = X::as_f32(src) {
        s.chunks_exact(c).for_each(f);
        return;
    }
    let mut row = vec![0f32; c];
    for piece in src.chunks_exact(c) {
        X::widen(piece, &mut row);
        f(&row);
    }
}

/// `n` values whose magnitudes spread over `2^-(octaves/2)`…`2^(octaves/2)` (a 24-bit
/// mantissa in [−½, ½) times a random power of two), the same for a seed on every machine: any
/// other association of their sums changes low bits, which is what the run-time probes (and
/// the tests) that compare summation orders bit for bit need.
pub(crate) fn spread_values(seed: u64, n: usize, octaves: u32) -> Vec<f32> {
    let octaves = u64::from(octaves.max(1));
    let half = (octaves / 2) as i32;
    let mut next = xorshift(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1);
    (0..n)
        .map(|_| {
            let s = next();
            let mantissa = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            mantissa * f32::powi(2.0, (s % octaves) as i32 - half)
        })
        .collect()
}

/// xorshift64 from a non-zero `state`: the generator behind [`spread_values`] and the tests'
/// values.
fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

/// The ops' tests' inputs: `n` values uniform in [−1, 1) on a 2⁻²³ grid (24 random bits,
/// exactly representable, so scaling by a power of two is exact too), the same for a seed on
/// every machine.
#[cfg(test)]
pub(crate) fn test_values(seed: u64, n: usize) -> Vec<f32> {
    let mut next = xorshift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..n)
        .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
        .collect()
}

#[cfg(test)]
mod gradient_checks {
    //! Each op's analytic gradient against central differences of its forward, in f32 with
    //! h = 1e-2 on O(1) inputs: the tolerance is 2% of the gradient's max magnitude, which a
    //! wrong formula (missing term, wrong sign, transposed index) exceeds by far.

    use super::*;

    fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
        super::test_values(seed, n)
    }

    /// Check `analytic` ≈ d(loss)/d(x) where loss(x) = Σ f(x) · w for fixed random w.
    fn check(name: &str, x: &mut [f32], analytic: &[f32], loss: &mut dyn FnMut(&[f32]) -> f64) {
        let h = 1e-2f32;
        let scale = analytic.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
        for i in 0..x.len() {
            let orig = x[i];
            x[i] = orig + h;
            let up = loss(x);
            x[i] = orig - h;
            let down = loss(x);
            x[i] = orig;
            let numeric = ((up - down) / (2.0 * h as f64)) as f32;
            assert!(
                (numeric - analytic[i]).abs() <= 0.02 * scale,
                "{name}[{i}]: analytic {} vs numeric {numeric}",
                analytic[i]
            );
        }
    }

    fn dot(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
    }

    #[test]
    fn matmul_gradients() {
        let (n, c, oc) = (5, 7, 4);
        let mut inp = rand_vec(1, n * c);
        let mut w = rand_vec(2, oc * c);
        let mut b = rand_vec(3, oc);
        let dout = rand_vec(4, n * oc);
        let (mut dinp, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; oc * c], vec![0.0; oc]);
        matmul::backward(&mut dinp, &mut dw, Some(&mut db), &dout, &inp, &w, n, c, oc);
        let f = |inp: &[f32], w: &[f32], b: &[f32]| {
            let mut out = vec![0.0; n * oc];
            matmul::forward(&mut out, inp, w, Some(b), n, c, oc);
            dot(&out, &dout)
        };
        let (w0, b0) = (w.clone(), b.clone());
        check("dinp", &mut inp.clone(), &dinp, &mut |x| f(x, &w0, &b0));
        check("dweight", &mut w, &dw, &mut |x| f(&inp, x, &b0));
        let w0 = w.clone();
        check("dbias", &mut b, &db, &mut |x| f(&inp, &w0, x));
        // Accumulates rather than overwrites.
        let before = dinp.clone();
        matmul::backward(&mut dinp, &mut dw, None, &dout, &inp, &w, n, c, oc);
        assert!(dinp
            .iter()
            .zip(&before)
            .all(|(a, b)| (a - 2.0 * b).abs() < 1e-5));
        inp.clear();
    }

    #[test]
    fn layernorm_gradients() {
        let (n, c) = (3, 8);
        let inp = rand_vec(5, n * c);
        let w = rand_vec(6, c)
            .iter()
            .map(|v| 1.0 + 0.5 * v)
            .collect::<Vec<_>>();
        let b = rand_vec(7, c);
        let dout = rand_vec(8, n * c);
        let f = |inp: &[f32], w: &[f32], b: &[f32]| {
            let (mut out, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            layernorm::forward(&mut out, &mut m, &mut r, inp, w, b, c);
            dot(&out, &dout)
        };
        let (mut out, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm::forward(&mut out, &mut m, &mut r, &inp, &w, &b, c);
        let (mut di, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
        layernorm::backward(&mut di, &mut dw, &mut db, &dout, &inp, &w, &m, &r, c);
        check("dinp", &mut inp.clone(), &di, &mut |x| f(x, &w, &b));
        check("dweight", &mut w.clone(), &dw, &mut |x| f(&inp, x, &b));
        check("dbias", &mut b.clone(), &db, &mut |x| f(&inp, &w, x));
    }

    #[test]
    fn gelu_gradient() {
        let inp: Vec<f32> = rand_vec(9, 40).iter().map(|v| 3.0 * v).collect();
        let dout = rand_vec(10, 40);
        let mut di = vec![0.0; 40];
        gelu::backward(&mut di, &inp, &dout);
        check("dinp", &mut inp.clone(), &di, &mut |x| {
            let mut out = vec![0.0; 40];
            gelu::forward(&mut out, x);
            dot(&out, &dout)
        });
    }

    #[test]
    fn cross_entropy_gradient_and_value() {
        let (n, v) = (4, 6);
        let logits: Vec<f32> = rand_vec(11, n * v).iter().map(|x| 2.0 * x).collect();
        let targets = [0u32, 5, 2, 2];
        let dloss = [0.25f32; 4];
        let mut d = vec![0.0; n * v];
        cross_entropy::backward(&mut d, &logits, &targets, &dloss, v);
        check("dlogits", &mut logits.clone(), &d, &mut |x| {
            let mut l = vec![0.0; n];
            cross_entropy::forward(&mut l, x, &targets, v);
            l.iter().map(|v| *v as f64 * 0.25).sum()
        });
        // Uniform logits: loss is ln(v).
        let mut l = vec![0.0; 1];
        cross_entropy::forward(&mut l, &[3.0; 6], &[1], 6);
        assert!((l[0] - (6f32).ln()).abs() < 1e-6);
    }

    #[test]
    fn embedding_gradients_scatter_by_token_and_position() {
        let (t, c, vocab) = (3, 2, 4);
        let tokens = [1u32, 3, 1, 0, 1, 2];
        let dout: Vec<f32> = (0..tokens.len() * c).map(|i| i as f32).collect();
        let (mut dwte, mut dwpe) = (vec![0.0; vocab * c], vec![0.0; t * c]);
        embedding::backward(&mut dwte, &mut dwpe, &dout, &tokens, t, c);
        // Token 1 appears at rows 0, 2, 4: its gradient is the sum of those rows.
        assert_eq!(&dwte[2..4], &[0.0 + 4.0 + 8.0, 1.0 + 5.0 + 9.0]);
        // Position 0 is rows 0 and 3.
        assert_eq!(&dwpe[0..2], &[0.0 + 6.0, 1.0 + 7.0]);
        let wte = rand_vec(12, vocab * c);
        let wpe = rand_vec(13, t * c);
        let mut out = vec![0.0; tokens.len() * c];
        embedding::forward(&mut out, &tokens, &wte, &wpe, t, c);
        assert_eq!(out[8], wte[2] + wpe[2]); // row 4: token 1, position 1
    }

    #[test]
    fn rmsnorm_gradients() {
        let (n, c) = (3, 8);
        let inp = rand_vec(21, n * c);
        let w = rand_vec(22, c)
            .iter()
            .map(|v| 1.0 + 0.5 * v)
            .collect::<Vec<_>>();
        let dout = rand_vec(23, n * c);
        // Llama's gains, and Gemma's stored as their difference from 1.
        for offset in [0.0f32, 1.0] {
            let w: Vec<f32> = w.iter().map(|v| v - offset).collect();
            let f = |inp: &[f32], w: &[f32]| {
                let (mut out, mut r) = (vec![0.0; n * c], vec![0.0; n]);
                rmsnorm::forward(&mut out, &mut r, inp, w, (1e-5, offset), c);
                dot(&out, &dout)
            };
            let (mut out, mut r) = (vec![0.0; n * c], vec![0.0; n]);
            rmsnorm::forward(&mut out, &mut r, &inp, &w, (1e-5, offset), c);
            // Each output row has unit root mean square before the gain.
            for (row, &s) in inp.chunks(c).zip(&r) {
                let ms: f32 = row.iter().map(|v| (v * s) * (v * s)).sum::<f32>() / c as f32;
                assert!((ms - 1.0).abs() < 1e-3, "{ms}");
            }
            let (mut di, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
            rmsnorm::backward(&mut di, &mut dw, &dout, &inp, &w, &r, offset, c);
            check("dinp", &mut inp.clone(), &di, &mut |x| f(x, &w));
            check("dweight", &mut w.clone(), &dw, &mut |x| f(&inp, x));
        }
    }

    #[test]
    fn geglu_gradients_and_gelu_bits() {
        use glu::{Gate, GeluTanh};
        let n = 40;
        let gate: Vec<f32> = rand_vec(27, n).iter().map(|v| 3.0 * v).collect();
        let up = rand_vec(28, n);
        let dout = rand_vec(29, n);
        let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
        glu::backward::<GeluTanh, f32>(&mut dg, &mut du, &gate, &up, &dout);
        let f = |g: &[f32], u: &[f32]| {
            let mut out = vec![0.0; n];
            glu::forward::<GeluTanh, f32>(&mut out, g, u);
            dot(&out, &dout)
        };
        check("dgate", &mut gate.clone(), &dg, &mut |x| f(x, &up));
        check("dup", &mut up.clone(), &du, &mut |x| f(&gate, x));
        // The gate is GPT-2's GELU: with up = 1, the same bits.
        let (mut gated, mut plain) = (vec![0.0; n], vec![0.0; n]);
        glu::forward::<GeluTanh, f32>(&mut gated, &gate, &vec![1.0; n]);
        gelu::forward(&mut plain, &gate);
        assert_eq!(gated, plain);
        // In place: the bits of the accumulating backward into a zeroed up gradient.
        let (mut dg2, mut d) = (vec![0.0; n], dout.clone());
        glu::backward_in_place::<GeluTanh, f32>(&mut dg2, &mut d, &gate, &up);
        assert_eq!((dg2, d), (dg, du));
        assert_eq!(GeluTanh::value(2.0, 0.5), 0.5 * gelu::value(2.0));
    }

    #[test]
    fn swiglu_gradients() {
        let n = 40;
        let gate: Vec<f32> = rand_vec(24, n).iter().map(|v| 3.0 * v).collect();
        let up = rand_vec(25, n);
        let dout = rand_vec(26, n);
        let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
        swiglu::backward(&mut dg, &mut du, &gate, &up, &dout);
        let f = |g: &[f32], u: &[f32]| {
            let mut out = vec![0.0; n];
            swiglu::forward(&mut out, g, u);
            dot(&out, &dout)
        };
        check("dgate", &mut gate.clone(), &dg, &mut |x| f(x, &up));
        check("dup", &mut up.clone(), &du, &mut |x| f(&gate, x));
    }

    #[test]
    fn embedding_without_positions_gathers_and_scatters_rows() {
        let (c, vocab) = (2, 4);
        let tokens = [1u32, 3, 1];
        let wte = rand_vec(27, vocab * c);
        let mut out = vec![0.0; tokens.len() * c];
        embedding::forward_tokens(&mut out, &tokens, &wte, c);
        assert_eq!(&out[2..4], &wte[6..8]);
        let dout: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let mut dwte = vec![0.0; vocab * c];
        embedding::backward_tokens(&mut dwte, &dout, &tokens, c, None);
        assert_eq!(&dwte[2..4], &[0.0 + 4.0, 1.0 + 5.0]);
        assert_eq!(&dwte[6..8], &[2.0, 3.0]);
        // A padding index: its rows add nothing, the others as before.
        let mut skipped = vec![0.5; vocab * c];
        embedding::backward_tokens(&mut skipped, &dout, &tokens, c, Some(1));
        assert_eq!(&skipped[2..4], &[0.5, 0.5]);
        assert_eq!(&skipped[6..8], &[2.5, 3.5]);
    }
}

#[cfg(test)]
mod rope_reference {
    //! The rotary embedding against transformers' formula written out plainly in f64:
    //! `x·cos + rotate_half(x)·sin` with `cos`, `sin` of `cat(freqs, freqs)` and
    //! `rotate_half(x) = cat(−x₂, x₁)`.

    use super::rope;
    use proptest::prelude::*;

    fn reference(x: &[f32], t: usize, hs: usize, theta: f32) -> Vec<f64> {
        let half = hs / 2;
        let mut out = vec![0f64; x.len()];
        for (head, o) in x.chunks(t * hs).zip(out.chunks_mut(t * hs)) {
            for pos in 0..t {
                let row = &head[pos * hs..][..hs];
                for d in 0..hs {
                    let i = d % half;
                    let freq = 1.0 / (theta as f64).powf((2 * i) as f64 / hs as f64);
                    let angle = pos as f64 * freq;
                    let rotated = if d < half {
                        -(row[d + half] as f64)
                    } else {
                        row[d - half] as f64
                    };
                    o[pos * hs + d] = row[d] as f64 * angle.cos() + rotated * angle.sin();
                }
            }
        }
        out
    }

    proptest! {
        #[test]
        fn rope_matches_the_rotate_half_formula_and_inverts(
            heads in 1usize..4,
            t in 1usize..40,
            half in 1usize..9,
            theta in prop::sample::select(vec![100.0f32, 10_000.0, 500_000.0]),
            seed in any::<u64>(),
        ) {
            let hs = 2 * half;
            let mut s = seed | 1;
            let x: Vec<f32> = (0..heads * t * hs)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                })
                .collect();
            let (cos, sin) = rope::tables(t, hs, rope::Rope::plain(theta));
            let mut y = x.clone();
            rope::apply(&mut y, t, hs, &cos, &sin, false);
            let want = reference(&x, t, hs, theta);
            // f32 angles: t·inv_freq is rounded once (≤ 40·2⁻²⁴ rad), then two products.
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                prop_assert!((*a as f64 - b).abs() <= 2e-5, "{i}: {a} vs {b}");
            }
            rope::apply(&mut y, t, hs, &cos, &sin, true);
            for (a, b) in y.iter().zip(&x) {
                prop_assert!((a - b).abs() <= 1e-5);
            }
        }

        /// YaRN's frequencies lie between the interpolated (`p/factor`) and the kept (`p`)
        /// ones and fall; its attention factor scales the tables' cos and sin. (When the
        /// ramp's low end passes its clipped high end, every dimension is interpolated, the
        /// first included, as in transformers.)
        #[test]
        fn yarn_frequencies_ramp_from_kept_to_interpolated(
            half in 1usize..65,
            theta in prop::sample::select(vec![100.0f32, 10_000.0, 1_000_000.0]),
            factor in 1.0f32..64.0,
            beta_fast in 2.0f64..64.0,
            beta_slow in 0.25f64..2.0,
            original in 16usize..65_536,
            truncate in any::<bool>(),
        ) {
            let hs = 2 * half;
            let scaling = rope::RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast,
                beta_slow,
                attention_factor: 1.25,
                truncate,
            };
            prop_assert!(scaling.check().is_ok());
            let yarn = rope::Rope { theta, scaling };
            let plain = rope::Rope::plain(theta).inv_freq(hs);
            let scaled = yarn.inv_freq(hs);
            for (i, (&p, &s)) in plain.iter().zip(&scaled).enumerate() {
                let interpolated = 1.0 / (factor * theta.powf((2 * i) as f32 / hs as f32));
                let (lo, hi) = (interpolated.min(p), interpolated.max(p));
                let slack = 4.0 * f32::EPSILON * hi;
                prop_assert!(s >= lo - slack && s <= hi + slack, "{}: {} not in [{}, {}]", i, s, lo, hi);
                if i > 0 {
                    prop_assert!(s <= scaled[i - 1] * (1.0 + 4.0 * f32::EPSILON), "{} rises", i);
                }
            }
            let (cos, sin) = rope::tables_at(3, 1, hs, yarn);
            let (cos1, sin1) = rope::tables_at(3, 1, hs, rope::Rope { theta, scaling: rope::RopeScaling::Yarn {
                factor, original_max_position_embeddings: original, beta_fast, beta_slow,
                attention_factor: 1.0, truncate,
            }});
            for i in 0..half {
                prop_assert_eq!(cos[i], cos1[i] * 1.25);
                prop_assert_eq!(sin[i], sin1[i] * 1.25);
            }
        }

        /// Llama 3's rescaling, against its definition in f64: a frequency whose wavelength is
        /// below `original / high_freq_factor` is kept bit for bit, one above
        /// `original / low_freq_factor` is divided by `factor` bit for bit, and one between is
        /// the blend, within a few f32 ulps, between the two; the frequencies still fall.
        #[test]
        fn llama3_rescaling_keeps_blends_or_stretches_each_frequency(
            half in 1usize..65,
            theta in prop::sample::select(vec![100.0f32, 10_000.0, 500_000.0]),
            factor in 1.0f32..64.0,
            low in 0.5f32..2.0,
            high_extra in 0.5f32..8.0,
            original in 16usize..16_384,
        ) {
            let hs = 2 * half;
            let high = low + high_extra;
            let scaling = rope::RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            };
            prop_assert!(scaling.check().is_ok());
            let plain = rope::Rope::plain(theta).inv_freq(hs);
            let scaled = rope::Rope { theta, scaling }.inv_freq(hs);
            for (i, (&p, &s)) in plain.iter().zip(&scaled).enumerate() {
                let wavelen = (2.0 * std::f64::consts::PI) as f32 / p;
                if wavelen < (original as f64 / high as f64) as f32 {
                    prop_assert_eq!(s.to_bits(), p.to_bits(), "{} kept", i);
                } else if wavelen > (original as f64 / low as f64) as f32 {
                    prop_assert_eq!(s.to_bits(), (p / factor).to_bits(), "{} stretched", i);
                } else {
                    let smooth = (original as f64 / wavelen as f64 - low as f64)
                        / (high as f64 - low as f64);
                    let want = (1.0 - smooth) * p as f64 / factor as f64 + smooth * p as f64;
                    // f32's `original / wavelen − low` cancels near the low edge: the blend
                    // weight is off by about ε·high/(high − low), which moves the frequency
                    // by that much of `p` (the blend lies in [p/factor, p]).
                    let span = (high - low) as f64;
                    let tolerance = f32::EPSILON as f64 * p as f64 * (high as f64 / span + 6.0);
                    prop_assert!(
                        (s as f64 - want).abs() <= tolerance,
                        "{} blended: {} vs {}", i, s, want
                    );
                }
                if i > 0 {
                    prop_assert!(s <= scaled[i - 1] * (1.0 + 4.0 * f32::EPSILON), "{} rises", i);
                }
            }
        }
    }
}

#[cfg(test)]
mod stored_inputs {
    //! The kernels that read their inputs in the stored type give, for bf16 and f16 inputs,
    //! the bits they give on an f32 copy of those inputs (the views they replace): lengths
    //! across several widening blocks with tails, rows longer than one block.

    use super::*;
    use half::{bf16, f16};
    use proptest::prelude::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Runs `kernel` on `x` as f32, as bf16 and as f16 (each rounded from `x`), and checks
    /// the low-precision runs against the f32 run on the same rounded values.
    fn same_as_f32_copy(
        x: &[f32],
        kernel: &dyn Fn(Stored<'_>) -> Vec<f32>,
    ) -> Result<(), TestCaseError> {
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let wb: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let wh: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
        prop_assert_eq!(
            bits(&kernel(Stored::Bf16(&xb))),
            bits(&kernel(Stored::F32(&wb)))
        );
        prop_assert_eq!(
            bits(&kernel(Stored::F16(&xh))),
            bits(&kernel(Stored::F32(&wh)))
        );
        Ok(())
    }

    #[derive(Clone, Copy)]
    enum Stored<'a> {
        F32(&'a [f32]),
        Bf16(&'a [bf16]),
        F16(&'a [f16]),
    }

    macro_rules! on_stored {
        ($x:expr, |$s:ident| $body:expr) => {
            match $x {
                Stored::F32($s) => $body,
                Stored::Bf16($s) => $body,
                Stored::F16($s) => $body,
            }
        };
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        #[test]
        fn norms_read_stored_rows(rows in 1usize..5, c in 1usize..1500, seed in any::<u64>()) {
            let x: Vec<f32> = test_values(seed, rows * c).iter().map(|v| v * 3.0).collect();
            let w = test_values(seed ^ 1, c);
            let b = test_values(seed ^ 2, c);
            let dy = test_values(seed ^ 3, rows * c);
            let layernorm = |x: Stored<'_>| {
                let (mut y, mut mean, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
                on_stored!(x, |s| layernorm::forward(&mut y, &mut mean, &mut rstd, s, &w, &b, c));
                let (mut dx, mut dw, mut db) = (vec![0.5; rows * c], vec![0.25; c], vec![0.0; c]);
                on_stored!(x, |s| layernorm::backward(&mut dx, &mut dw, &mut db, &dy, s, &w, &mean, &rstd, c));
                [y, mean, rstd, dx, dw, db].concat()
            };
            same_as_f32_copy(&x, &layernorm)?;
            let rmsnorm = |x: Stored<'_>| {
                let (mut y, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows]);
                on_stored!(x, |s| rmsnorm::forward(&mut y, &mut rstd, s, &w, (1e-5, 0.0), c));
                let (mut dx, mut dw) = (vec![0.5; rows * c], vec![0.25; c]);
                on_stored!(x, |s| rmsnorm::backward(&mut dx, &mut dw, &dy, s, &w, &rstd, 0.0, c));
                [y, rstd, dx, dw].concat()
            };
            same_as_f32_copy(&x, &rmsnorm)?;
        }

        /// The in-place backwards give the bits of the accumulating ones into zeroed
        /// gradients, signed zeros included (every 7th output gradient is −0).
        #[test]
        fn in_place_backwards_match_zeroed_accumulation(n in 0usize..5000, seed in any::<u64>()) {
            let x: Vec<f32> = test_values(seed, n).iter().map(|v| v * 4.0).collect();
            let up: Vec<f32> = test_values(seed ^ 1, n);
            let dy: Vec<f32> = test_values(seed ^ 2, n)
                .into_iter()
                .enumerate()
                .map(|(i, v)| if i % 7 == 0 { -0.0 } else { v })
                .collect();
            let mut want = vec![0.0; n];
            gelu::backward(&mut want, &x, &dy);
            let mut got = dy.clone();
            gelu::backward_in_place(&mut got, &x);
            prop_assert_eq!(bits(&got), bits(&want));
            let (mut dgate, mut dup) = (vec![0.5; n], vec![0.0; n]);
            swiglu::backward(&mut dgate, &mut dup, &x, &up, &dy);
            let (mut dgate_in_place, mut d) = (vec![0.5; n], dy.clone());
            swiglu::backward_in_place(&mut dgate_in_place, &mut d, &x, &up);
            prop_assert_eq!(bits(&dgate_in_place), bits(&dgate));
            prop_assert_eq!(bits(&d), bits(&dup));
        }

        #[test]
        fn element_wise_ops_read_stored_blocks(n in 0usize..40_000, seed in any::<u64>()) {
            let x: Vec<f32> = test_values(seed, n).iter().map(|v| v * 4.0).collect();
            let dy = test_values(seed ^ 1, n);
            let gelu = |x: Stored<'_>| {
                let mut y = vec![0.0; n];
                on_stored!(x, |s| gelu::forward(&mut y, s));
                let mut dx = vec![0.5; n];
                on_stored!(x, |s| gelu::backward(&mut dx, s, &dy));
                [y, dx].concat()
            };
            same_as_f32_copy(&x, &gelu)?;
            // SwiGLU's two inputs: gate is `x`, up is `x` reversed, in the same stored type.
            let swiglu = |x: Stored<'_>| {
                let (mut y, mut dg, mut du) = (vec![0.0; n], vec![0.5; n], vec![0.25; n]);
                on_stored!(x, |s| {
                    let up: Vec<_> = s.iter().rev().copied().collect();
                    swiglu::forward(&mut y, s, &up);
                    swiglu::backward(&mut dg, &mut du, s, &up, &dy);
                });
                [y, dg, du].concat()
            };
            same_as_f32_copy(&x, &swiglu)?;
        }
    }
}
