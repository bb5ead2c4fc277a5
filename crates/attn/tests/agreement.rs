//! Numerical agreement: naive against a scalar f64 reference (and finite differences), chunked
//! and flash against naive, across random shapes, masks, head groupings, tile sizes and dtypes.
//!
//! Tolerances are relative to the largest magnitude of the tensor compared (`rel_err`):
//! f32 — 1e-5 everywhere; bf16 — 1e-2 for the output and dV (rounded to bf16, 2⁻⁸ relative,
//! on both sides), 2e-2 for dQ and dK: their terms `P·(dP − D)` subtract `D`, which is computed
//! from the bf16-rounded output on each side, so a term carries two roundings where the output
//! carries one (CI drew a causal, one-dimensional head at 1.08e-2; it is a fixed test below).
//! dQ and dK are measured against at least a tenth of the terms they sum
//! (`score_grad_floors`): with one visible key or a saturated softmax they cancel to rounding
//! noise of those terms.

mod common;

use common::*;
use headroom_attn::{Algorithm, AttentionConfig};
use headroom_tensor::{Cpu, DType};
use proptest::prelude::*;

const F32_TOL: f64 = 1e-5;
const BF16_TOL: f64 = 1e-2;
/// bf16 dQ and dK (see the module docs).
const BF16_SCORE_GRAD_TOL: f64 = 2e-2;

fn sizes() -> impl Strategy<Value = Sizes> {
    (
        1usize..=2,
        1usize..=3,
        1usize..=3,
        1usize..=300,
        0usize..=2,
        1usize..=72,
    )
        .prop_map(
            |(batch, kv_heads, group, q_len, kv_shift, head_dim)| Sizes {
                batch,
                q_heads: kv_heads * group,
                kv_heads,
                q_len,
                // Mostly equal lengths; sometimes fewer or more keys (fully masked causal rows).
                kv_len: match kv_shift {
                    0 => q_len,
                    1 => (q_len / 2).max(1),
                    _ => q_len + 7,
                },
                head_dim,
            },
        )
}

fn check(
    name: &str,
    got: &Run,
    want: &Run,
    tol: f64,
    (dq_floor, dk_floor): (f64, f64),
) -> Result<(), TestCaseError> {
    // bf16's dQ/dK carry two roundings per term (module docs).
    let score_tol = if tol == BF16_TOL {
        BF16_SCORE_GRAD_TOL
    } else {
        tol
    };
    for (what, a, b, floor, tol) in [
        ("out", &got.out, &want.out, 0.0, tol),
        ("dq", &got.dq, &want.dq, dq_floor, score_tol),
        ("dk", &got.dk, &want.dk, dk_floor, score_tol),
        ("dv", &got.dv, &want.dv, 0.0, tol),
    ] {
        prop_assert!(a.iter().all(|x| x.is_finite()), "{name} {what}: non-finite");
        let b64: Vec<f64> = b.iter().map(|&x| f64::from(x)).collect();
        let e = rel_err_floor(a, &b64, floor);
        prop_assert!(e <= tol, "{name} {what}: relative error {e:e} > {tol:e}");
    }
    Ok(())
}

/// Flash and chunked against naive for one case (the body of the proptest below).
fn agree(
    s: &Sizes,
    causal: bool,
    bf16: bool,
    (block_q, block_k, chunk): (usize, usize, usize),
    segments: Option<usize>,
    seed: u64,
) -> Result<(), TestCaseError> {
    let dtype = if bf16 { DType::BF16 } else { DType::F32 };
    let tol = if bf16 { BF16_TOL } else { F32_TOL };
    let cpu = Cpu::new();
    let x = inputs(s, seed, dtype);
    let with = |a: Algorithm| {
        let mut c = AttentionConfig::with_algorithm(a).causal(causal);
        c.backward_segments = segments;
        c
    };
    let naive = run(&cpu, s, &x, dtype, &with(Algorithm::Naive));
    let flash = run(
        &cpu,
        s,
        &x,
        dtype,
        &with(Algorithm::Flash { block_q, block_k }),
    );
    let chunked = run(
        &cpu,
        s,
        &x,
        dtype,
        &with(Algorithm::Chunked { chunk_size: chunk }),
    );
    let floors = score_grad_floors(s, &x, 1.0 / (s.head_dim as f64).sqrt());
    check("flash", &flash, &naive, tol, floors)?;
    check("chunked", &chunked, &naive, tol, floors)?;
    for (name, r) in [("flash", &flash), ("chunked", &chunked)] {
        for (a, b) in r.lse.iter().zip(&naive.lse) {
            prop_assert!(
                a == b || (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{name} lse {a} vs {b}"
            );
        }
    }
    Ok(())
}

/// The case CI drew (an ISA other than this file's author's): a causal bf16 head of one
/// dimension over 80 positions, dQ at 1.08e-2 of its scale.
#[test]
fn a_causal_one_dimensional_bf16_head_agrees() {
    let s = Sizes {
        batch: 1,
        q_heads: 1,
        kv_heads: 1,
        q_len: 80,
        kv_len: 80,
        head_dim: 1,
    };
    agree(&s, true, true, (1, 1, 1), None, 15269796070541541694).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn flash_and_chunked_match_naive(
        s in sizes(),
        causal in any::<bool>(),
        bf16 in prop::bool::weighted(0.3),
        block_q in 1usize..=96,
        block_k in 1usize..=96,
        chunk in 1usize..=160,
        segments in prop::option::of(1usize..=5),
        seed in any::<u64>(),
    ) {
        agree(&s, causal, bf16, (block_q, block_k, chunk), segments, seed)?;
    }

    #[test]
    fn naive_matches_the_f64_reference(
        s in sizes().prop_filter("small", |s| s.q_len <= 48),
        causal in any::<bool>(),
        scale in prop::option::of(0.05f32..2.0),
        seed in any::<u64>(),
    ) {
        let cpu = Cpu::new();
        let x = inputs(&s, seed, DType::F32);
        let mut config = AttentionConfig::naive().causal(causal);
        config.softmax_scale = scale;
        let scale = scale.map_or(1.0 / (s.head_dim as f64).sqrt(), f64::from);
        let got = run(&cpu, &s, &x, DType::F32, &config);
        let want = reference(&s, &x, causal, scale);
        let (dq_floor, dk_floor) = score_grad_floors(&s, &x, scale);
        for (what, a, b, floor) in [
            ("out", &got.out, &want.out, 0.0),
            ("dq", &got.dq, &want.dq, dq_floor),
            ("dk", &got.dk, &want.dk, dk_floor),
            ("dv", &got.dv, &want.dv, 0.0),
        ] {
            let e = rel_err_floor(a, b, floor);
            prop_assert!(e <= F32_TOL, "naive {what}: relative error {e:e}");
        }
        for (a, b) in got.lse.iter().zip(&want.lse) {
            prop_assert!(
                (*a as f64 == *b) || (*a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0),
                "lse {a} vs {b}"
            );
        }
    }
}

#[test]
fn tile_and_chunk_sizes_do_not_change_results_beyond_rounding() {
    let s = Sizes {
        batch: 1,
        q_heads: 4,
        kv_heads: 2,
        q_len: 203,
        kv_len: 203,
        head_dim: 40,
    };
    let cpu = Cpu::new();
    let x = inputs(&s, 7, DType::F32);
    let base = run(
        &cpu,
        &s,
        &x,
        DType::F32,
        &AttentionConfig::flash().causal(true),
    );
    for algorithm in [
        Algorithm::Flash {
            block_q: 1,
            block_k: 1,
        },
        Algorithm::Flash {
            block_q: 17,
            block_k: 203,
        },
        Algorithm::Flash {
            block_q: 256,
            block_k: 5,
        },
        Algorithm::Chunked { chunk_size: 1 },
        Algorithm::Chunked { chunk_size: 203 },
    ] {
        let r = run(
            &cpu,
            &s,
            &x,
            DType::F32,
            &AttentionConfig::with_algorithm(algorithm).causal(true),
        );
        for (a, b) in [
            (&r.out, &base.out),
            (&r.dq, &base.dq),
            (&r.dk, &base.dk),
            (&r.dv, &base.dv),
        ] {
            let e = rel_err_f32(a, b);
            assert!(e <= F32_TOL, "{algorithm:?}: {e:e}");
        }
    }
}

#[test]
fn rows_that_see_no_key_are_zero_not_nan() {
    // Causal with 9 queries and 4 keys: rows 0..5 see nothing (bottom-right alignment).
    let s = Sizes {
        batch: 1,
        q_heads: 2,
        kv_heads: 1,
        q_len: 9,
        kv_len: 4,
        head_dim: 8,
    };
    let cpu = Cpu::new();
    let x = inputs(&s, 3, DType::F32);
    let want = reference(&s, &x, true, 1.0 / 8f64.sqrt());
    for config in [
        AttentionConfig::naive(),
        AttentionConfig::chunked(),
        AttentionConfig::flash(),
    ] {
        let r = run(&cpu, &s, &x, DType::F32, &config.causal(true));
        for head in 0..2 {
            for row in 0..5 {
                let i = head * 9 + row;
                assert_eq!(r.lse[i], f32::NEG_INFINITY);
                assert!(r.out[i * 8..(i + 1) * 8].iter().all(|&v| v == 0.0));
                assert!(r.dq[i * 8..(i + 1) * 8].iter().all(|&v| v == 0.0));
            }
        }
        assert!(rel_err(&r.out, &want.out) <= F32_TOL);
        assert!(rel_err(&r.dk, &want.dk) <= F32_TOL);
        assert!(r.dv.iter().chain(&r.dk).all(|v| v.is_finite()));
    }
    // No keys at all: everything is masked.
    let empty = Sizes { kv_len: 0, ..s };
    let x = inputs(&empty, 4, DType::F32);
    for config in [
        AttentionConfig::naive(),
        AttentionConfig::chunked(),
        AttentionConfig::flash(),
    ] {
        let r = run(&cpu, &empty, &x, DType::F32, &config);
        assert!(r.out.iter().chain(&r.dq).all(|&v| v == 0.0));
        assert!(r.lse.iter().all(|&l| l == f32::NEG_INFINITY));
        assert!(r.dk.is_empty() && r.dv.is_empty());
    }
}

#[test]
fn naive_backward_matches_finite_differences() {
    // L = Σ d_out ∘ attention(q, k, v); central differences in f32 on tiny shapes.
    for (causal, s) in [
        (
            false,
            Sizes {
                batch: 1,
                q_heads: 2,
                kv_heads: 1,
                q_len: 3,
                kv_len: 4,
                head_dim: 3,
            },
        ),
        (
            true,
            Sizes {
                batch: 2,
                q_heads: 1,
                kv_heads: 1,
                q_len: 4,
                kv_len: 4,
                head_dim: 2,
            },
        ),
    ] {
        let cpu = Cpu::new();
        let x = inputs(&s, 11, DType::F32);
        let config = AttentionConfig::naive().causal(causal);
        let analytic = run(&cpu, &s, &x, DType::F32, &config);
        let loss = |x: &Inputs| -> f64 {
            let r = run(&cpu, &s, x, DType::F32, &config);
            r.out
                .iter()
                .zip(&x.d_out)
                .map(|(&o, &g)| o as f64 * g as f64)
                .sum()
        };
        let eps = 1e-2f32;
        for (which, grad) in [(0usize, &analytic.dq), (1, &analytic.dk), (2, &analytic.dv)] {
            let max = grad.iter().fold(1e-3f32, |m, g| m.max(g.abs()));
            for idx in 0..grad.len() {
                let mut plus = Inputs {
                    q: x.q.clone(),
                    k: x.k.clone(),
                    v: x.v.clone(),
                    d_out: x.d_out.clone(),
                };
                let mut minus = Inputs {
                    q: x.q.clone(),
                    k: x.k.clone(),
                    v: x.v.clone(),
                    d_out: x.d_out.clone(),
                };
                let (p, m) = match which {
                    0 => (&mut plus.q, &mut minus.q),
                    1 => (&mut plus.k, &mut minus.k),
                    _ => (&mut plus.v, &mut minus.v),
                };
                p[idx] += eps;
                m[idx] -= eps;
                let numeric = (loss(&plus) - loss(&minus)) / (2.0 * eps as f64);
                let err = (numeric - grad[idx] as f64).abs() / max as f64;
                assert!(
                    err < 2e-3,
                    "input {which} index {idx}: {numeric} vs {}",
                    grad[idx]
                );
            }
        }
    }
}

#[test]
fn gradients_are_bitwise_identical_for_any_thread_count() {
    let s = Sizes {
        batch: 1,
        q_heads: 4,
        kv_heads: 1,
        q_len: 150,
        kv_len: 150,
        head_dim: 32,
    };
    let x = inputs(&s, 5, DType::F32);
    for config in [
        AttentionConfig::flash(),
        AttentionConfig::chunked(),
        AttentionConfig::naive(),
    ] {
        let config = config.causal(true);
        let one = run(&Cpu::with_threads(1).unwrap(), &s, &x, DType::F32, &config);
        let three = run(&Cpu::with_threads(3).unwrap(), &s, &x, DType::F32, &config);
        assert_eq!(one.out, three.out, "{config:?}");
        assert_eq!(one.dq, three.dq, "{config:?}");
        assert_eq!(one.dk, three.dk, "{config:?}");
        assert_eq!(one.dv, three.dv, "{config:?}");
    }
}
