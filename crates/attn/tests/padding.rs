//! Padding masks ([`DocumentMask::padding`]) on the CPU: a batch of rows decoded together after
//! a shared prefix, each row's ragged suffix lined up by padding whose keys are hidden.
//!
//! The reference is the definition: for each batch row, the keys with the hidden range cut out
//! and the queries that come after it (the row's own tokens), through the scalar f64 attention
//! of `tests/common`. Naive, chunked and flash must equal it within the f32 tolerance of
//! `tests/agreement.rs` on those rows, for queries that are the last of more keys (a cached
//! step) or as many; the padding's own queries stay finite. With the padding's output
//! gradient zero, backward gives the reference's gradients and exactly zero for the hidden
//! keys.

mod common;

use common::*;
use headroom_attn::{AttentionBackend, AttentionConfig, AttnError, DocumentMask};
use headroom_tensor::{Backend, Cpu, DType};
use proptest::prelude::*;

const F32_TOL: f64 = 1e-5;

/// One padded problem: sizes (`kv_len ≥ q_len`) and each batch row's hidden keys.
#[derive(Clone, Debug)]
struct Case {
    sizes: Sizes,
    hidden: Vec<std::ops::Range<usize>>,
}

impl Case {
    /// Key position of query `i` (the queries are the last `q_len` keys).
    fn position(&self, i: usize) -> usize {
        self.sizes.kv_len - self.sizes.q_len + i
    }

    /// The first query of row `b` past its hidden keys: the row's own tokens from there on.
    fn first_real(&self, b: usize) -> usize {
        (0..self.sizes.q_len)
            .find(|&i| self.position(i) >= self.hidden[b].end)
            .unwrap_or(self.sizes.q_len)
    }
}

fn cases() -> impl Strategy<Value = Case> {
    (
        1usize..=3,
        1usize..=3,
        1usize..=3,
        1usize..=24,
        0usize..=40,
        1usize..=9,
    )
        .prop_flat_map(|(batch, kv_heads, group, q_len, extra, head_dim)| {
            let sizes = Sizes {
                batch,
                q_heads: kv_heads * group,
                kv_heads,
                q_len,
                kv_len: q_len + extra,
                head_dim,
            };
            let kv_len = sizes.kv_len;
            let hole = (0..=kv_len).prop_flat_map(move |s| (Just(s), s..=kv_len));
            prop::collection::vec(hole, batch).prop_map(move |holes| Case {
                sizes,
                hidden: holes.into_iter().map(|(s, e)| s..e).collect(),
            })
        })
}

/// The rows `keep` accepts of every head of batch row `b` in `[batch, heads, len, hd]` data,
/// head after head.
fn rows_of(
    data: &[f32],
    b: usize,
    heads: usize,
    len: usize,
    hd: usize,
    keep: &dyn Fn(usize) -> bool,
) -> Vec<f32> {
    let mut out = Vec::new();
    for h in 0..heads {
        for i in (0..len).filter(|&i| keep(i)) {
            let at = ((b * heads + h) * len + i) * hd;
            out.extend_from_slice(&data[at..at + hd]);
        }
    }
    out
}

/// Row `b` of `x` as its own problem, hidden keys and queries before `first_real` removed.
fn reduced(case: &Case, x: &Inputs, b: usize) -> (Sizes, Inputs) {
    let s = &case.sizes;
    let (hd, first, hole) = (s.head_dim, case.first_real(b), case.hidden[b].clone());
    let rows = |data: &[f32], heads: usize, len: usize, keep: &dyn Fn(usize) -> bool| {
        rows_of(data, b, heads, len, hd, keep)
    };
    let key = |j: usize| !hole.contains(&j);
    let query = |i: usize| i >= first;
    let sizes = Sizes {
        batch: 1,
        q_len: s.q_len - first,
        kv_len: s.kv_len - hole.len(),
        ..*s
    };
    let inputs = Inputs {
        q: rows(&x.q, s.q_heads, s.q_len, &query),
        k: rows(&x.k, s.kv_heads, s.kv_len, &key),
        v: rows(&x.v, s.kv_heads, s.kv_len, &key),
        d_out: rows(&x.d_out, s.q_heads, s.q_len, &query),
    };
    (sizes, inputs)
}

/// `x` with the output gradient of every padding query set to zero.
fn zero_padding_grads(case: &Case, mut x: Inputs) -> Inputs {
    let s = &case.sizes;
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            for i in 0..case.first_real(b) {
                let at = ((b * s.q_heads + h) * s.q_len + i) * s.head_dim;
                x.d_out[at..at + s.head_dim].fill(0.0);
            }
        }
    }
    x
}

/// Compares the padded run's rows `b` (real queries, kept keys) with the reduced reference.
fn check_row(
    name: &str,
    case: &Case,
    got: &Run,
    b: usize,
    want: &Reference,
    grad_floors: Option<(f64, f64)>,
) -> Result<(), TestCaseError> {
    let s = &case.sizes;
    let (hd, first, hole) = (s.head_dim, case.first_real(b), case.hidden[b].clone());
    let pick = |data: &[f32], heads: usize, len: usize, keep: &dyn Fn(usize) -> bool| {
        rows_of(data, b, heads, len, hd, keep)
    };
    let query = |i: usize| i >= first;
    let kept = |j: usize| !hole.contains(&j);
    let out = pick(&got.out, s.q_heads, s.q_len, &query);
    let e = rel_err(&out, &want.out);
    prop_assert!(e <= F32_TOL, "{name} row {b} out: relative error {e:e}");
    let lse = pick(&got.lse, s.q_heads, s.q_len, &query);
    let lse: Vec<f32> = lse.into_iter().step_by(hd).collect();
    for (a, w) in lse.iter().zip(&want.lse) {
        prop_assert!(
            (f64::from(*a) - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{name} row {b} lse: {a} vs {w}"
        );
    }
    if let Some((dq_floor, dk_floor)) = grad_floors {
        let dq = pick(&got.dq, s.q_heads, s.q_len, &query);
        let e = rel_err_floor(&dq, &want.dq, dq_floor);
        prop_assert!(e <= F32_TOL, "{name} row {b} dq: relative error {e:e}");
        let padding_dq = pick(&got.dq, s.q_heads, s.q_len, &|i| i < first);
        prop_assert!(
            padding_dq.iter().all(|&v| v == 0.0),
            "{name} row {b}: padding dq"
        );
        for (what, all, want, floor) in [
            ("dk", &got.dk, &want.dk, dk_floor),
            ("dv", &got.dv, &want.dv, 0.0),
        ] {
            let kept_rows = pick(all, s.kv_heads, s.kv_len, &kept);
            let e = rel_err_floor(&kept_rows, want, floor);
            prop_assert!(e <= F32_TOL, "{name} row {b} {what}: relative error {e:e}");
            let hidden_rows = pick(all, s.kv_heads, s.kv_len, &|j| hole.contains(&j));
            prop_assert!(
                hidden_rows.iter().all(|&v| v == 0.0),
                "{name} row {b} {what}: a hidden key got a gradient"
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Every algorithm under a padding mask equals each row with its padding cut out, on the
    /// rows' own queries; the padding's queries stay finite.
    #[test]
    fn padded_rows_equal_their_unpadded_selves(
        case in cases(),
        tiles in (1usize..=40, 1usize..=40, 1usize..=80),
        seed in any::<u64>(),
    ) {
        let s = case.sizes;
        let x = inputs(&s, seed, DType::F32);
        let mask = DocumentMask::padding(s.batch, s.q_len, &case.hidden).unwrap();
        let cpu = Cpu::new();
        // Backward is compared where every query sees a key (key 0 is never hidden): a query
        // that sees none has no softmax to differentiate.
        let with_grads = case.hidden.iter().all(|h| h.start > 0 || h.is_empty());
        let x = zero_padding_grads(&case, x);
        for which in 0..3 {
            let config = AttentionConfig::with_algorithm(algorithm(which, tiles)).causal(true);
            let q = upload(&cpu, &x.q, s.q_shape(), DType::F32);
            let k = upload(&cpu, &x.k, s.kv_shape(), DType::F32);
            let v = upload(&cpu, &x.v, s.kv_shape(), DType::F32);
            let fwd = cpu.attention_forward_documents(&q, &k, &v, &config, &mask).unwrap();
            let mut got = Run {
                out: download(&cpu, &fwd.output),
                lse: cpu.download::<f32>(&fwd.logsumexp).unwrap(),
                dq: vec![],
                dk: vec![],
                dv: vec![],
            };
            // lse per query, spread to one per element so `check_row` picks it like `out`.
            got.lse = got.lse.iter().flat_map(|&l| std::iter::repeat_n(l, s.head_dim)).collect();
            prop_assert!(got.out.iter().all(|v| v.is_finite()), "non-finite output");
            if with_grads {
                let d_out = upload(&cpu, &x.d_out, s.q_shape(), DType::F32);
                let g = cpu.attention_backward(&q, &k, &v, &fwd, &d_out).unwrap();
                got.dq = download(&cpu, &g.dq);
                got.dk = download(&cpu, &g.dk);
                got.dv = download(&cpu, &g.dv);
            }
            for b in 0..s.batch {
                let (rs, rx) = reduced(&case, &x, b);
                let scale = 1.0 / (s.head_dim as f64).sqrt();
                let want = reference(&rs, &rx, true, scale);
                let floors = with_grads.then(|| score_grad_floors(&rs, &rx, scale));
                check_row(config.algorithm.name(), &case, &got, b, &want, floors)?;
            }
        }
    }
}

#[test]
#[allow(clippy::single_range_in_vec_init)] // one hidden range per batch row, one row
fn padding_masks_are_checked() {
    assert!(matches!(
        DocumentMask::padding(2, 1, &[0..1]),
        Err(AttnError::PositionCount { got: 1, .. })
    ));
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = DocumentMask::padding(1, 1, &[3..2]);
    assert!(matches!(backwards, Err(AttnError::PositionCount { .. })));
    let cpu = Cpu::new();
    let q = cpu.upload(&[0.5f32; 4], [1, 1, 1, 4]).unwrap();
    let k = cpu.upload(&[0.5f32; 12], [1, 1, 3, 4]).unwrap();
    let config = AttentionConfig::flash().causal(true);
    let past_the_keys = DocumentMask::padding(1, 1, &[1..4]).unwrap();
    assert!(matches!(
        cpu.attention_forward_documents(&q, &k, &k, &config, &past_the_keys),
        Err(AttnError::InvalidConfig(_))
    ));
    // A packed-documents mask still needs as many keys as queries.
    let packed = DocumentMask::from_positions(1, 1, &[0]).unwrap();
    assert!(matches!(
        cpu.attention_forward_documents(&q, &k, &k, &config, &packed),
        Err(AttnError::ShapeMismatch { .. })
    ));
    let not_causal = AttentionConfig::flash();
    let fine = DocumentMask::padding(1, 1, &[1..2]).unwrap();
    assert!(cpu
        .attention_forward_documents(&q, &k, &k, &not_causal, &fine)
        .is_err());
    assert!(cpu
        .attention_forward_documents(&q, &k, &k, &config, &fine)
        .is_ok());
}
