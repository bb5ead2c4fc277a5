//! Document-masked (packed-sequence) causal attention on the CPU: each query sees only the keys
//! of its own document, up to itself.
//!
//! The reference is the definition: every document of every batch row run alone through plain
//! causal naive attention, its results put back in place. Naive, chunked and flash under the
//! mask must equal it within `tests/agreement.rs`'s f32 tolerance (1e-5 of the largest
//! magnitude; dQ and dK against `score_grad_floors`), forward and all three gradients, across
//! random shapes (GQA and MQA, odd and even head dims), document layouts (length-1 documents
//! included), tiles, chunks and backward segments. A mask of one document per row is plain
//! causal attention bit for bit; bf16/f16 inputs give the f32 problem's bits on exact copies
//! with the predicted workspace; results do not depend on the thread count; bad input is a
//! typed error.

mod common;

use std::sync::Arc;

use common::*;
use headroom_attn::{
    cpu_backward_f32_workspace_bytes, cpu_backward_scratch_bytes, cpu_forward_workspace_bytes,
    Algorithm, AttentionBackend, AttentionConfig, AttnError, DocumentMask,
};
use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory, Tensor};
use proptest::prelude::*;

const F32_TOL: f64 = 1e-5;

// ------------------------------------------------------------------------------------------
// Problems: shapes, document layouts, and running them.

/// One masked problem: sizes (`q_len == kv_len`) and, per batch row, where documents begin.
#[derive(Clone, Debug)]
struct Case {
    sizes: Sizes,
    /// `[batch·seq]`: whether a document begins at each position (position 0 of a row always
    /// does, whatever this says).
    begins: Vec<bool>,
}

impl Case {
    fn seq(&self) -> usize {
        self.sizes.q_len
    }

    /// Position ids as transformers' packed sequences have them.
    fn positions(&self) -> Vec<u32> {
        let seq = self.seq();
        let mut out = Vec::with_capacity(self.begins.len());
        for (i, &begins) in self.begins.iter().enumerate() {
            let id = if i % seq == 0 || begins {
                0
            } else {
                out[i - 1] + 1
            };
            out.push(id);
        }
        out
    }

    fn mask(&self) -> DocumentMask {
        DocumentMask::from_positions(self.sizes.batch, self.seq(), &self.positions()).unwrap()
    }

    /// Each batch row's documents as position ranges.
    fn documents(&self) -> Vec<Vec<(usize, usize)>> {
        let seq = self.seq();
        let positions = self.positions();
        positions
            .chunks(seq)
            .map(|row| {
                let mut docs: Vec<(usize, usize)> = Vec::new();
                for (i, &id) in row.iter().enumerate() {
                    if id == 0 {
                        docs.push((i, i + 1));
                    } else if let Some(last) = docs.last_mut() {
                        last.1 = i + 1;
                    }
                }
                docs
            })
            .collect()
    }
}

/// Batch 1–3, GQA and MQA (up to 3 key/value heads, groups of 1–4), seq 1–70, head_dim 1–40,
/// and a density of document starts from none (one document per row) to every position
/// (length-1 documents only).
fn cases() -> impl Strategy<Value = Case> {
    (
        1usize..=3,
        1usize..=3,
        prop::sample::select(vec![1usize, 2, 3, 4]),
        1usize..=70,
        1usize..=40,
        prop::sample::select(vec![0.0f64, 0.03, 0.1, 0.3, 0.7, 1.0]),
    )
        .prop_flat_map(|(batch, kv_heads, group, seq, head_dim, density)| {
            let sizes = Sizes {
                batch,
                q_heads: kv_heads * group,
                kv_heads,
                q_len: seq,
                kv_len: seq,
                head_dim,
            };
            prop::collection::vec(prop::bool::weighted(density), batch * seq)
                .prop_map(move |begins| Case { sizes, begins })
        })
}

fn causal(algorithm: Algorithm, segments: Option<usize>) -> AttentionConfig {
    let mut c = AttentionConfig::with_algorithm(algorithm).causal(true);
    c.backward_segments = segments;
    c
}

/// Forward (masked when `mask` is given) and backward through the library, results as host f32.
fn run_with(
    cpu: &Cpu,
    s: &Sizes,
    x: &Inputs,
    dtype: DType,
    config: &AttentionConfig,
    mask: Option<&DocumentMask>,
) -> Run {
    let q = upload(cpu, &x.q, s.q_shape(), dtype);
    let k = upload(cpu, &x.k, s.kv_shape(), dtype);
    let v = upload(cpu, &x.v, s.kv_shape(), dtype);
    let d_out = upload(cpu, &x.d_out, s.q_shape(), dtype);
    let fwd = match mask {
        Some(m) => cpu.attention_forward_documents(&q, &k, &v, config, m),
        None => cpu.attention_forward(&q, &k, &v, config),
    }
    .unwrap();
    assert_eq!(fwd.documents.as_ref(), mask);
    let g = cpu.attention_backward(&q, &k, &v, &fwd, &d_out).unwrap();
    Run {
        out: download(cpu, &fwd.output),
        lse: cpu.download::<f32>(&fwd.logsumexp).unwrap(),
        dq: download(cpu, &g.dq),
        dk: download(cpu, &g.dk),
        dv: download(cpu, &g.dv),
    }
}

/// The reference: every document of every batch row through plain causal naive attention on
/// its own, the results put back where the document sits.
fn per_document(case: &Case, x: &Inputs) -> Run {
    let s = &case.sizes;
    let (seq, hd) = (case.seq(), s.head_dim);
    let cpu = Cpu::new();
    let mut r = Run {
        out: vec![0.0; s.q_numel()],
        lse: vec![f32::NEG_INFINITY; s.batch * s.q_heads * seq],
        dq: vec![0.0; s.q_numel()],
        dk: vec![0.0; s.kv_numel()],
        dv: vec![0.0; s.kv_numel()],
    };
    for (b, docs) in case.documents().into_iter().enumerate() {
        for (start, end) in docs {
            let len = end - start;
            let one = Sizes {
                batch: 1,
                q_len: len,
                kv_len: len,
                ..*s
            };
            // Rows start..end of every head of batch row b, `heads` heads per row.
            let span = |heads: usize, h: usize| {
                let first = (b * heads + h) * seq + start;
                first * hd..(first + len) * hd
            };
            let gather = |src: &[f32], heads: usize| -> Vec<f32> {
                (0..heads)
                    .flat_map(|h| src[span(heads, h)].to_vec())
                    .collect()
            };
            let xi = Inputs {
                q: gather(&x.q, s.q_heads),
                k: gather(&x.k, s.kv_heads),
                v: gather(&x.v, s.kv_heads),
                d_out: gather(&x.d_out, s.q_heads),
            };
            let ri = run(&cpu, &one, &xi, DType::F32, &causal(Algorithm::Naive, None));
            for (dst, src, heads) in [
                (&mut r.out, &ri.out, s.q_heads),
                (&mut r.dq, &ri.dq, s.q_heads),
                (&mut r.dk, &ri.dk, s.kv_heads),
                (&mut r.dv, &ri.dv, s.kv_heads),
            ] {
                for (h, part) in src.chunks(len * hd).enumerate() {
                    dst[span(heads, h)].copy_from_slice(part);
                }
            }
            for (h, part) in ri.lse.chunks(len).enumerate() {
                let first = (b * s.q_heads + h) * seq + start;
                r.lse[first..first + len].copy_from_slice(part);
            }
        }
    }
    r
}

/// `got` within the f32 tolerance of `want`: output, logsumexp and the three gradients.
fn close(name: &str, got: &Run, want: &Run, case: &Case, x: &Inputs) -> Result<(), TestCaseError> {
    let s = &case.sizes;
    let (dq_floor, dk_floor) = score_grad_floors(s, x, 1.0 / (s.head_dim as f64).sqrt());
    for (what, a, b, floor) in [
        ("out", &got.out, &want.out, 0.0),
        ("dq", &got.dq, &want.dq, dq_floor),
        ("dk", &got.dk, &want.dk, dk_floor),
        ("dv", &got.dv, &want.dv, 0.0),
    ] {
        prop_assert!(a.iter().all(|v| v.is_finite()), "{name} {what}: non-finite");
        let b64: Vec<f64> = b.iter().map(|&v| f64::from(v)).collect();
        let e = rel_err_floor(a, &b64, floor);
        prop_assert!(e <= F32_TOL, "{name} {what}: relative error {e:e}");
    }
    for (i, (a, b)) in got.lse.iter().zip(&want.lse).enumerate() {
        prop_assert!(
            a == b || (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{name} lse[{i}]: {a} vs {b}"
        );
    }
    Ok(())
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn same_bits(name: &str, a: &Run, b: &Run) -> Result<(), TestCaseError> {
    for (what, x, y) in [
        ("out", &a.out, &b.out),
        ("lse", &a.lse, &b.lse),
        ("dq", &a.dq, &b.dq),
        ("dk", &a.dk, &b.dk),
        ("dv", &a.dv, &b.dv),
    ] {
        prop_assert_eq!(bits(x), bits(y), "{} {}", name, what);
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Numerics.

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Every algorithm under the mask equals each document computed alone.
    #[test]
    fn masked_attention_equals_each_document_alone(
        case in cases(),
        tiles in (1usize..=40, 1usize..=40, 1usize..=80),
        segments in prop::option::of(1usize..=5),
        seed in any::<u64>(),
    ) {
        let x = inputs(&case.sizes, seed, DType::F32);
        let want = per_document(&case, &x);
        let cpu = Cpu::new();
        let mask = case.mask();
        for which in 0..3 {
            let config = causal(algorithm(which, tiles), segments);
            let got = run_with(&cpu, &case.sizes, &x, DType::F32, &config, Some(&mask));
            close(config.algorithm.name(), &got, &want, &case, &x)?;
        }
    }

    /// Chunked and flash agree with naive on masked problems (each against the other's
    /// numerics, not only against the reference).
    #[test]
    fn the_three_algorithms_agree_on_masked_problems(
        case in cases(),
        tiles in (1usize..=40, 1usize..=40, 1usize..=80),
        segments in prop::option::of(1usize..=5),
        seed in any::<u64>(),
    ) {
        let x = inputs(&case.sizes, seed, DType::F32);
        let cpu = Cpu::new();
        let mask = case.mask();
        let naive = run_with(&cpu, &case.sizes, &x, DType::F32, &causal(Algorithm::Naive, segments), Some(&mask));
        for which in 1..3 {
            let config = causal(algorithm(which, tiles), segments);
            let got = run_with(&cpu, &case.sizes, &x, DType::F32, &config, Some(&mask));
            close(config.algorithm.name(), &got, &naive, &case, &x)?;
        }
    }

    /// A mask of one document per row (positions 0..seq) is plain causal attention, bit for
    /// bit: every algorithm, forward and backward, f32 and bf16.
    #[test]
    fn one_document_per_row_is_bitwise_plain_causal(
        case in cases().prop_map(|c| Case { begins: vec![false; c.begins.len()], ..c }),
        tiles in (1usize..=40, 1usize..=40, 1usize..=80),
        segments in prop::option::of(1usize..=5),
        bf16 in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let dtype = if bf16 { DType::BF16 } else { DType::F32 };
        let x = inputs(&case.sizes, seed, dtype);
        let cpu = Cpu::new();
        let mask = case.mask();
        prop_assert_eq!(mask.documents(), case.sizes.batch);
        for which in 0..3 {
            let config = causal(algorithm(which, tiles), segments);
            let masked = run_with(&cpu, &case.sizes, &x, dtype, &config, Some(&mask));
            let plain = run_with(&cpu, &case.sizes, &x, dtype, &config, None);
            same_bits(config.algorithm.name(), &masked, &plain)?;
        }
    }
}

// ------------------------------------------------------------------------------------------
// Low precision and memory.

fn to(cpu: &Cpu, t: &CpuTensor, dtype: DType) -> CpuTensor {
    let mut out = cpu.zeros(t.shape().clone(), dtype).unwrap();
    cpu.cast(t, &mut out).unwrap();
    out
}

fn tensor_bits(cpu: &Cpu, t: &CpuTensor) -> Vec<u32> {
    to(cpu, t, DType::F32)
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// bf16 or f16 inputs under a mask (chunked and flash widen a group of heads at a time,
    /// whose batch rows the kernels must find from the whole call's head index): the forward
    /// gives the f32 forward's output on exact f32 copies, rounded; `attention_backward_f32`
    /// gives that backward's gradients bit for bit; and every pass's workspace peak — f32
    /// backward included — is the mask-free prediction, byte for byte (the mask allocates
    /// nothing).
    #[test]
    fn low_precision_masked_gives_the_f32_bits_and_the_predicted_workspace(
        case in cases(),
        tiles in (1usize..=40, 1usize..=40, 1usize..=80),
        which in 0u8..3,
        segments in prop::option::of(1usize..=5),
        threads in 1usize..=3,
        low in prop::sample::select(vec![DType::BF16, DType::F16]),
        d_out_low in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let s = case.sizes;
        let config = causal(algorithm(which, tiles), segments);
        let mask = case.mask();
        let hook = Arc::new(Peaks::default());
        let cpu = Cpu::with_threads(threads).unwrap().with_alloc_hook(hook.clone());
        let _data = MemoryCategory::Data.enter();
        let x = inputs(&s, seed, DType::F32);
        let exact = |data: &[f32], shape: [usize; 4]| {
            // Representable in `low`, so the f32 and low-precision tensors hold the same values.
            let t = cpu.upload(data, shape).unwrap();
            to(&cpu, &to(&cpu, &t, low), DType::F32)
        };
        let (q, k, v, d_out) = (
            exact(&x.q, s.q_shape()),
            exact(&x.k, s.kv_shape()),
            exact(&x.v, s.kv_shape()),
            exact(&x.d_out, s.q_shape()),
        );

        hook.reset();
        let mut want_fwd = cpu.attention_forward_documents(&q, &k, &v, &config, &mask).unwrap();
        prop_assert_eq!(hook.workspace_peak(), cpu_forward_workspace_bytes(&want_fwd.dims, &config, threads));
        let kept = to(&cpu, &want_fwd.output, low);
        want_fwd.output = to(&cpu, &kept, DType::F32);
        hook.reset();
        let want = cpu.attention_backward(&q, &k, &v, &want_fwd, &d_out).unwrap();
        prop_assert_eq!(hook.workspace_peak(), cpu_backward_scratch_bytes(&want_fwd.dims, &config, threads));

        let (ql, kl, vl) = (to(&cpu, &q, low), to(&cpu, &k, low), to(&cpu, &v, low));
        let d_out_l = to(&cpu, &d_out, if d_out_low { low } else { DType::F32 });
        hook.reset();
        let fwd = cpu.attention_forward_documents(&ql, &kl, &vl, &config, &mask).unwrap();
        let dims = fwd.dims;
        prop_assert_eq!(hook.workspace_peak(), cpu_forward_workspace_bytes(&dims, &config, threads), "forward {:?}", dims);
        prop_assert_eq!(tensor_bits(&cpu, &fwd.output), tensor_bits(&cpu, &kept));
        hook.reset();
        let got = cpu.attention_backward_f32(&ql, &kl, &vl, fwd, &d_out_l).unwrap();
        prop_assert_eq!(
            hook.workspace_peak(),
            cpu_backward_f32_workspace_bytes(&dims, d_out_l.dtype(), &config, threads),
            "backward {:?}", dims
        );
        for (g, w) in [(&got.dq, &want.dq), (&got.dk, &want.dk), (&got.dv, &want.dv)] {
            prop_assert_eq!(g.dtype(), DType::F32);
            prop_assert_eq!(tensor_bits(&cpu, g), tensor_bits(&cpu, w));
        }
    }
}

// ------------------------------------------------------------------------------------------
// Determinism.

/// A fixed packed batch: two rows of six documents, 1 to 79 positions long, GQA.
fn packed_case() -> Case {
    let sizes = Sizes {
        batch: 2,
        q_heads: 4,
        kv_heads: 2,
        q_len: 150,
        kv_len: 150,
        head_dim: 24,
    };
    let mut begins = vec![false; 2 * 150];
    for i in [1, 2, 40, 41, 100, 150, 151, 152, 153, 211, 290] {
        begins[i] = true;
    }
    Case { sizes, begins }
}

#[test]
fn masked_results_do_not_depend_on_the_thread_count() {
    let case = packed_case();
    let mask = case.mask();
    assert_eq!(mask.documents(), 12);
    for dtype in [DType::F32, DType::BF16] {
        let x = inputs(&case.sizes, 5, dtype);
        for config in [
            AttentionConfig::naive(),
            AttentionConfig::chunked(),
            AttentionConfig::flash(),
            AttentionConfig::with_algorithm(Algorithm::Flash {
                block_q: 16,
                block_k: 8,
            })
            .backward_segments(3),
            AttentionConfig::with_algorithm(Algorithm::Chunked { chunk_size: 7 }),
        ] {
            let config = config.causal(true);
            let run_on = |threads: usize| {
                let cpu = Cpu::with_threads(threads).unwrap();
                run_with(&cpu, &case.sizes, &x, dtype, &config, Some(&mask))
            };
            same_bits(&format!("{dtype} {config:?}"), &run_on(1), &run_on(3)).unwrap();
        }
    }
}

#[test]
fn a_fixed_packed_batch_equals_its_documents_alone() {
    let case = packed_case();
    let x = inputs(&case.sizes, 9, DType::F32);
    let want = per_document(&case, &x);
    let cpu = Cpu::new();
    for config in [
        AttentionConfig::naive(),
        AttentionConfig::chunked(),
        AttentionConfig::flash(),
        AttentionConfig::with_algorithm(Algorithm::Flash {
            block_q: 16,
            block_k: 8,
        }),
    ] {
        let config = config.causal(true);
        let got = run_with(
            &cpu,
            &case.sizes,
            &x,
            DType::F32,
            &config,
            Some(&case.mask()),
        );
        close(config.algorithm.name(), &got, &want, &case, &x).unwrap();
    }
}

// ------------------------------------------------------------------------------------------
// Errors.

#[test]
fn position_ids_that_are_not_packed_documents_are_typed_errors() {
    let ok = DocumentMask::from_positions(2, 4, &[0, 1, 0, 1, 0, 0, 1, 2]).unwrap();
    assert_eq!((ok.batch(), ok.seq(), ok.documents()), (2, 4, 4));
    assert_eq!(ok.document_start(0, 3), Some(2));
    assert_eq!(ok.document_start(1, 3), Some(1));
    assert_eq!(ok.document_start(2, 0), None);

    // Wrong length, either way.
    for positions in [&[0u32, 1, 2][..], &[0, 1, 2, 3, 4, 5, 6, 7, 8]] {
        let e = DocumentMask::from_positions(2, 4, positions).unwrap_err();
        assert!(
            matches!(
                e,
                AttnError::PositionCount {
                    batch: 2,
                    seq: 4,
                    ..
                }
            ),
            "{e}"
        );
    }
    // batch·seq overflows.
    assert!(matches!(
        DocumentMask::from_positions(usize::MAX, 3, &[0, 1, 2]),
        Err(AttnError::PositionCount { .. })
    ));
    // A row that does not begin with 0 (the second row here).
    let e = DocumentMask::from_positions(2, 3, &[0, 1, 2, 3, 4, 5]).unwrap_err();
    assert!(
        matches!(
            e,
            AttnError::PositionId {
                row: 1,
                index: 0,
                got: 3,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("batch row 1, index 0"), "{e}");
    // Neither 0 nor previous + 1: a jump, a repeat, a skipped 1.
    for (positions, index) in [(&[0u32, 1, 3][..], 2), (&[0, 1, 1], 2), (&[0, 2, 3], 1)] {
        let e = DocumentMask::from_positions(1, 3, positions).unwrap_err();
        assert!(
            matches!(e, AttnError::PositionId { row: 0, index: i, .. } if i == index),
            "{positions:?}: {e}"
        );
    }
    // Empty batches are fine.
    assert_eq!(
        DocumentMask::from_positions(0, 5, &[]).unwrap().documents(),
        0
    );
}

#[test]
fn document_masked_calls_are_checked_before_computing() {
    let cpu = Cpu::new();
    let t = |shape: [usize; 4]| {
        let n = shape.iter().product();
        cpu.upload(&vec![0.5f32; n], shape).unwrap()
    };
    let (q, kv) = (t([2, 4, 6, 8]), t([2, 2, 6, 8]));
    let mask = DocumentMask::from_positions(2, 6, &[0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 4, 5]).unwrap();
    for algorithm in [
        AttentionConfig::naive(),
        AttentionConfig::chunked(),
        AttentionConfig::flash(),
    ] {
        let causal = algorithm.causal(true);
        assert!(cpu
            .attention_forward_documents(&q, &kv, &kv, &causal, &mask)
            .is_ok());
        // Not causal.
        assert!(matches!(
            cpu.attention_forward_documents(&q, &kv, &kv, &algorithm, &mask),
            Err(AttnError::InvalidConfig(_))
        ));
        // More keys than queries.
        let long = t([2, 2, 7, 8]);
        assert!(matches!(
            cpu.attention_forward_documents(&q, &long, &long, &causal, &mask),
            Err(AttnError::ShapeMismatch { tensor: "k", .. })
        ));
        // A mask of another batch, or another length.
        let one_row = DocumentMask::from_positions(1, 6, &[0, 1, 2, 0, 1, 0]).unwrap();
        let shorter = DocumentMask::from_positions(2, 5, &[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]).unwrap();
        for bad in [&one_row, &shorter] {
            assert!(matches!(
                cpu.attention_forward_documents(&q, &kv, &kv, &causal, bad),
                Err(AttnError::ShapeMismatch { tensor: "q", .. })
            ));
        }
        // The shared checks still come first.
        let rank3 = cpu.upload(&[0.5f32; 48], [6, 8]).unwrap();
        assert!(matches!(
            cpu.attention_forward_documents(&rank3, &kv, &kv, &causal, &mask),
            Err(AttnError::NotRank4 { tensor: "q", .. })
        ));

        // A forward state whose mask was swapped for one that does not fit is refused by both
        // backward entry points, not read out of bounds.
        let mut fwd = cpu
            .attention_forward_documents(&q, &kv, &kv, &causal, &mask)
            .unwrap();
        assert!(cpu.attention_backward(&q, &kv, &kv, &fwd, &q).is_ok());
        fwd.documents = Some(shorter.clone());
        assert!(matches!(
            cpu.attention_backward(&q, &kv, &kv, &fwd, &q),
            Err(AttnError::ShapeMismatch { tensor: "q", .. })
        ));
        assert!(matches!(
            cpu.attention_backward_f32(&q, &kv, &kv, fwd, &q),
            Err(AttnError::ShapeMismatch { tensor: "q", .. })
        ));
    }
    // Empty problems: nothing to see, nothing to fail.
    let (q0, kv0) = (t([2, 4, 0, 8]), t([2, 2, 0, 8]));
    let empty = DocumentMask::from_positions(2, 0, &[]).unwrap();
    for config in [
        AttentionConfig::naive(),
        AttentionConfig::chunked(),
        AttentionConfig::flash(),
    ] {
        let fwd = cpu
            .attention_forward_documents(&q0, &kv0, &kv0, &config.causal(true), &empty)
            .unwrap();
        assert!(cpu.attention_backward(&q0, &kv0, &kv0, &fwd, &q0).is_ok());
    }
}
