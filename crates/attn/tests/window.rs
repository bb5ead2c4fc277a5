//! Sliding-window attention ([`DocumentMask::narrowed`]) on the CPU: query `i` at key position
//! `p` sees keys `p − W < j ≤ p` (and, packed, only its own document's), as Mistral's and
//! Qwen2's `sliding_window` layers compute it in transformers.
//!
//! The reference is the definition: the scalar f64 attention of `tests/common` with exactly
//! those keys. Naive, chunked and flash (odd tile sizes) must equal it within
//! `tests/agreement.rs`'s f32 tolerance, forward and the three gradients, in training shapes
//! (as many keys as queries, with or without packed documents) and for cached steps (the
//! queries the last of more keys); a window as long as the row gives plain causal attention's
//! bits.

mod common;

use common::*;
use headroom_attn::{AttentionBackend, AttentionConfig, DocumentMask};
use headroom_tensor::{Backend, Cpu, DType};
use proptest::prelude::*;

const F32_TOL: f64 = 1e-5;

/// One windowed problem: sizes, the window, and (training shapes only) where documents begin.
#[derive(Clone, Debug)]
struct Case {
    sizes: Sizes,
    window: usize,
    /// Per batch row, per position: whether a document begins there (position 0 always).
    begins: Vec<Vec<bool>>,
}

impl Case {
    /// Key position of query `i` (the queries are the last `q_len` keys).
    fn position(&self, i: usize) -> usize {
        self.sizes.kv_len - self.sizes.q_len + i
    }

    /// The first key query `i` of row `b` sees: its window's, or its document's if later.
    fn first_key(&self, b: usize, i: usize) -> usize {
        let window = (self.position(i) + 1).saturating_sub(self.window);
        let document = (0..=i).rev().find(|&r| self.begins[b][r]).unwrap_or(0);
        window.max(document)
    }

    fn mask(&self) -> DocumentMask {
        let s = &self.sizes;
        let base = if s.kv_len == s.q_len {
            let positions: Vec<u32> = self
                .begins
                .iter()
                .flat_map(|row| {
                    let mut p = 0u32;
                    row.iter()
                        .map(move |&begin| {
                            p = if begin { 0 } else { p + 1 };
                            p
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            DocumentMask::from_positions(s.batch, s.q_len, &positions).unwrap()
        } else {
            DocumentMask::padding(s.batch, s.q_len, &vec![0..0; s.batch]).unwrap()
        };
        base.narrowed(|_, i| (self.position(i) + 1).saturating_sub(self.window))
            .unwrap()
    }
}

fn cases() -> impl Strategy<Value = Case> {
    (
        1usize..=2,
        1usize..=2,
        1usize..=3,
        1usize..=40,
        prop_oneof![Just(0usize), 1usize..=24],
        1usize..=9,
        1usize..=48,
    )
        .prop_flat_map(|(batch, kv_heads, group, q_len, extra, head_dim, window)| {
            let sizes = Sizes {
                batch,
                q_heads: kv_heads * group,
                kv_heads,
                q_len,
                kv_len: q_len + extra,
                head_dim,
            };
            // Documents only in training shapes; a cached step's queries are one sequence.
            let packed = extra == 0;
            let row =
                prop::collection::vec(prop::bool::weighted(0.15), q_len).prop_map(move |mut r| {
                    r[0] = true;
                    if !packed {
                        r[1..].iter_mut().for_each(|b| *b = false);
                    }
                    r
                });
            prop::collection::vec(row, batch).prop_map(move |begins| Case {
                sizes,
                window,
                begins,
            })
        })
}

fn check(name: &str, got: &[f32], want: &[f64], floor: f64) -> Result<(), TestCaseError> {
    let e = rel_err_floor(got, want, floor);
    prop_assert!(e <= F32_TOL, "{name}: relative error {e:e}");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn windowed_attention_equals_the_reference_with_exactly_the_windows_keys(
        case in cases(),
        tiles in (1usize..=40, 1usize..=40, 1usize..=80),
        seed in any::<u64>(),
    ) {
        let s = case.sizes;
        let x = inputs(&s, seed, DType::F32);
        let mask = case.mask();
        let scale = 1.0 / (s.head_dim as f64).sqrt();
        let want = reference_from(&s, &x, true, scale, &|b, i| case.first_key(b, i));
        let (dq_floor, dk_floor) = score_grad_floors(&s, &x, scale);
        let cpu = Cpu::new();
        let q = upload(&cpu, &x.q, s.q_shape(), DType::F32);
        let k = upload(&cpu, &x.k, s.kv_shape(), DType::F32);
        let v = upload(&cpu, &x.v, s.kv_shape(), DType::F32);
        let d_out = upload(&cpu, &x.d_out, s.q_shape(), DType::F32);
        for which in 0..3 {
            let config = AttentionConfig::with_algorithm(algorithm(which, tiles)).causal(true);
            let name = config.algorithm.name();
            let fwd = cpu.attention_forward_documents(&q, &k, &v, &config, &mask).unwrap();
            check(&format!("{name} out"), &download(&cpu, &fwd.output), &want.out, 0.0)?;
            let lse = cpu.download::<f32>(&fwd.logsumexp).unwrap();
            for (a, w) in lse.iter().zip(&want.lse) {
                prop_assert!(
                    (f64::from(*a) - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "{name} lse: {a} vs {w}"
                );
            }
            let g = cpu.attention_backward(&q, &k, &v, &fwd, &d_out).unwrap();
            check(&format!("{name} dq"), &download(&cpu, &g.dq), &want.dq, dq_floor)?;
            check(&format!("{name} dk"), &download(&cpu, &g.dk), &want.dk, dk_floor)?;
            check(&format!("{name} dv"), &download(&cpu, &g.dv), &want.dv, 0.0)?;
        }
    }

    /// A window no shorter than the keys hides nothing: plain causal attention's bits, forward
    /// and backward, on every algorithm.
    #[test]
    fn a_window_as_long_as_the_row_is_bitwise_plain_causal(
        case in cases().prop_filter("training shapes", |c| c.sizes.kv_len == c.sizes.q_len),
        tiles in (1usize..=40, 1usize..=40, 1usize..=80),
        seed in any::<u64>(),
    ) {
        let s = case.sizes;
        let x = inputs(&s, seed, DType::F32);
        let mask = DocumentMask::causal(s.batch, s.q_len)
            .unwrap()
            .narrowed(|_, i| (i + 1).saturating_sub(s.kv_len))
            .unwrap();
        let cpu = Cpu::new();
        for which in 0..3 {
            let config = AttentionConfig::with_algorithm(algorithm(which, tiles)).causal(true);
            let plain = run(&cpu, &s, &x, DType::F32, &config);
            let q = upload(&cpu, &x.q, s.q_shape(), DType::F32);
            let k = upload(&cpu, &x.k, s.kv_shape(), DType::F32);
            let v = upload(&cpu, &x.v, s.kv_shape(), DType::F32);
            let d_out = upload(&cpu, &x.d_out, s.q_shape(), DType::F32);
            let fwd = cpu.attention_forward_documents(&q, &k, &v, &config, &mask).unwrap();
            let g = cpu.attention_backward(&q, &k, &v, &fwd, &d_out).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&download(&cpu, &fwd.output)), bits(&plain.out));
            prop_assert_eq!(bits(&download(&cpu, &g.dq)), bits(&plain.dq));
            prop_assert_eq!(bits(&download(&cpu, &g.dk)), bits(&plain.dk));
            prop_assert_eq!(bits(&download(&cpu, &g.dv)), bits(&plain.dv));
        }
    }
}
