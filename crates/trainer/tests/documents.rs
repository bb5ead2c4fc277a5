//! Packed documents (`Geometry::with_documents`): a batch whose rows hold several documents
//! gives each document's loss and gradients as if it were alone in its own row — what a batch
//! of padded examples computes — for both families (GPT-2's learned positions, Llama's rotary
//! ones with grouped-query attention), every attention algorithm and a recomputing schedule.
//! One document per row is bitwise the plain batch.

use headroom_attn::{Algorithm, AttentionConfig};
use headroom_ckpt::Schedule;
use headroom_mmap_data::DocumentBoundaries;
use headroom_tensor::{Cpu, CpuTensor, MemoryCategory};
use headroom_trainer::model::{
    counted_targets, params, Documents, Family, Geometry, LlamaShape, Model, ModelConfig,
    ModelOptions, IGNORE_TARGET,
};
use proptest::prelude::*;

const T: usize = 20;
const VOCAB: usize = 17;

fn config(llama: bool) -> ModelConfig {
    ModelConfig {
        vocab: VOCAB,
        max_seq: T,
        layers: 2,
        heads: 4,
        channels: 16,
        family: if llama {
            Family::Llama(LlamaShape {
                kv_heads: 2,
                head_dim: None,
                sliding_window: None,
                no_rope_interval: None,
                query_pre_attn_scalar: None,
                multipliers: None,
                padding_idx: None,
                ffn: 24,
                // A small base, so that every frequency turns measurably within 20 positions.
                rope_theta: 100.0,
                rope_scaling: Default::default(),
                class: Default::default(),
                norm_eps: 1e-5,
                tied_head: false,
            })
        } else {
            Family::Gpt2
        },
    }
}

fn model(cpu: &Cpu, cfg: ModelConfig, attention: AttentionConfig) -> Model {
    let opts = ModelOptions {
        attention,
        ..ModelOptions::default()
    };
    let mut m = Model::new(cpu, cfg, opts, 5).unwrap();
    // Larger than the 0.02 init, so that attention's mixing (and any leak) is measurable.
    for t in m.masters_mut().iter_mut() {
        for (i, v) in t.as_mut_slice::<f32>().unwrap().iter_mut().enumerate() {
            *v += 0.2 * (i as f32 * 0.91).sin();
        }
    }
    m.refresh_working().unwrap();
    m
}

/// Positions of rows cut into documents of `lengths` (cycled, each row starting a new one).
fn positions(rows: usize, lengths: &[usize]) -> Vec<u32> {
    let mut out = Vec::new();
    let mut k = 0;
    for _ in 0..rows {
        let mut left = T;
        while left > 0 {
            let n = lengths[k % lengths.len()].clamp(1, left);
            k += 1;
            out.extend(0..n as u32);
            left -= n;
        }
    }
    out
}

fn grads_of(
    m: &Model,
    cpu: &Cpu,
    tokens: &[u32],
    targets: &[u32],
    g: Geometry<'_>,
    schedule: &Schedule,
) -> (f32, Vec<Vec<f32>>) {
    let mut grads: Vec<CpuTensor> =
        params::alloc_like_params(cpu, &m.cfg, MemoryCategory::Gradients).unwrap();
    // The gradient of the summed losses, so that documents' gradients simply add up.
    let (mean, _) = m
        .forward_backward(tokens, targets, g, &mut grads, 1.0, schedule)
        .unwrap();
    let grads = grads
        .iter()
        .map(|t| t.as_slice::<f32>().unwrap().to_vec())
        .collect();
    (mean, grads)
}

/// `a` within 2e-4 of `b`'s largest value, or of `floor` where that is larger: a tensor whose
/// exact gradient is zero holds only rounding noise, of the order of f32's epsilon times the
/// magnitudes that cancelled in it.
fn close(a: &[f32], b: &[f32], what: &str, floor: f32) {
    let scale = b.iter().fold(floor.max(1e-3), |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 2e-4 * scale,
            "{what}[{i}]: packed {x}, alone {y} (scale {scale})"
        );
    }
}

fn algorithms() -> impl Strategy<Value = AttentionConfig> {
    prop_oneof![
        Just(AttentionConfig::naive()),
        (1usize..7)
            .prop_map(|c| AttentionConfig::with_algorithm(Algorithm::Chunked { chunk_size: c })),
        (1usize..9, 1usize..9).prop_map(|(q, k)| AttentionConfig::with_algorithm(
            Algorithm::Flash {
                block_q: q,
                block_k: k
            }
        )),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn packed_documents_train_as_if_each_were_alone(
        llama in any::<bool>(),
        attention in algorithms(),
        lengths in prop::collection::vec(1usize..12, 1..6),
        recompute in any::<bool>(),
        seed in 0u32..1000,
    ) {
        let cpu = Cpu::new();
        let cfg = config(llama);
        let m = model(&cpu, cfg, attention);
        let rows = 2;
        let pos = positions(rows, &lengths);
        let tokens: Vec<u32> = (0..rows * T)
            .map(|i| ((i as u32 * 7 + seed).wrapping_mul(2654435761) >> 7) % VOCAB as u32)
            .collect();
        // A target that starts a document is not counted (the loader leaves those out).
        let targets: Vec<u32> = (0..rows * T)
            .map(|i| {
                let starts_next = i + 1 < rows * T && (i + 1) % T != 0 && pos[i + 1] == 0;
                if starts_next {
                    IGNORE_TARGET
                } else {
                    ((i as u32 * 5 + seed).wrapping_mul(40503) >> 3) % VOCAB as u32
                }
            })
            .collect();
        let documents = Documents::from_positions(rows, T, &pos).unwrap();
        let g = Geometry::new(rows, T).with_documents(&documents).unwrap();
        let schedule = if recompute {
            Schedule::checkpoint_inputs(cfg.layers, &[0]).unwrap()
        } else {
            Schedule::store_all(cfg.layers).unwrap()
        };
        let (packed_mean, packed) = grads_of(&m, &cpu, &tokens, &targets, g, &schedule);
        prop_assert!((m.loss(&tokens, &targets, g).unwrap() - packed_mean).abs() < 1e-5);

        // Every document alone, in a row of its own length.
        let mut sum = 0.0f64;
        let mut alone: Vec<Vec<f32>> = packed.iter().map(|t| vec![0.0; t.len()]).collect();
        let starts: Vec<usize> = (0..rows * T).filter(|&i| pos[i] == 0).collect();
        for (k, &a) in starts.iter().enumerate() {
            let b = starts.get(k + 1).copied().unwrap_or(rows * T);
            let (tok, tgt) = (&tokens[a..b], &targets[a..b]);
            let n = counted_targets(tgt);
            if n == 0 {
                continue;
            }
            let one = Geometry::new(1, b - a);
            let (mean, grads) = grads_of(&m, &cpu, tok, tgt, one, &Schedule::store_all(cfg.layers).unwrap());
            sum += mean as f64 * n as f64;
            for (acc, g) in alone.iter_mut().zip(&grads) {
                for (x, y) in acc.iter_mut().zip(g) {
                    *x += y;
                }
            }
        }
        let counted = counted_targets(&targets) as f64;
        let want = (sum / counted) as f32;
        prop_assert!(
            (packed_mean - want).abs() <= 1e-5 * want.abs().max(1.0),
            "loss: packed {} alone {}", packed_mean, want
        );
        // With one-token documents the query and key projections' exact gradients are zero
        // (a softmax over one key has no slope): their noise is measured against 1% of the
        // model's largest gradient (CI found 2.6e-7 apart where the largest was 2.0).
        let largest = alone.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (p, a)) in packed.iter().zip(&alone).enumerate() {
            close(p, a, &format!("gradient {i}"), 1e-2 * largest);
        }
    }
}

#[test]
fn one_document_per_row_is_the_plain_batch_bit_for_bit() {
    let cpu = Cpu::new();
    for llama in [false, true] {
        let cfg = config(llama);
        let m = model(&cpu, cfg, AttentionConfig::flash());
        let tokens: Vec<u32> = (0..2 * T as u32)
            .map(|i| (i * 7 + 3) % VOCAB as u32)
            .collect();
        let targets: Vec<u32> = (0..2 * T as u32)
            .map(|i| (i * 5 + 1) % VOCAB as u32)
            .collect();
        let pos: Vec<u32> = (0..2).flat_map(|_| 0..T as u32).collect();
        let documents = Documents::from_positions(2, T, &pos).unwrap();
        let plain = Geometry::new(2, T);
        let all = Schedule::store_all(cfg.layers).unwrap();
        let a = grads_of(&m, &cpu, &tokens, &targets, plain, &all);
        let b = grads_of(
            &m,
            &cpu,
            &tokens,
            &targets,
            plain.with_documents(&documents).unwrap(),
            &all,
        );
        assert_eq!(a.0.to_bits(), b.0.to_bits(), "llama {llama}: loss");
        for (x, y) in a.1.iter().zip(&b.1) {
            assert!(
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "llama {llama}"
            );
        }
    }
}

#[test]
fn documents_that_do_not_fit_the_batch_are_refused() {
    let pos: Vec<u32> = (0..2).flat_map(|_| 0..8u32).collect();
    let d = Documents::from_positions(2, 8, &pos).unwrap();
    assert!(Geometry::new(2, 9).with_documents(&d).is_err());
    assert!(Geometry::new(1, 8).with_documents(&d).is_err());
    // Positions that neither restart nor count on, or a row that does not start at 0.
    assert!(Documents::from_positions(1, 4, &[0, 1, 3, 4]).is_err());
    assert!(Documents::from_positions(1, 4, &[1, 2, 3, 4]).is_err());
    assert!(Documents::from_positions(1, 4, &[0, 1, 2]).is_err());
    let rows = d.rows(1..2).unwrap();
    assert_eq!(rows.positions(), &pos[8..]);
    assert!(d.rows(1..3).is_err());
}

/// `evaluate` with documents reads them from the file's Megatron index: its loss is, bit for
/// bit, the model's loss on the windows with positions restarting at each document and the
/// targets that start one left out — and differs from reading the same windows unpacked.
#[test]
fn evaluate_reads_the_documents_of_the_index() {
    use headroom_mmap_data::formats::megatron::{open_megatron, write_megatron};
    use headroom_mmap_data::TokenType;
    let cpu = Cpu::new();
    let cfg = config(false);
    let m = model(&cpu, cfg, AttentionConfig::flash());
    let lengths = [7usize, 3, 12, 1, 9, 5, 8];
    let docs: Vec<Vec<u32>> = lengths
        .iter()
        .enumerate()
        .map(|(d, &n)| {
            (0..n as u32)
                .map(|i| (i * 3 + d as u32 * 5) % VOCAB as u32)
                .collect()
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("docs");
    write_megatron(&prefix, &docs, TokenType::U16).unwrap();
    let data = open_megatron(&prefix).unwrap();
    let stream: Vec<u32> = docs.concat();
    let starts: Vec<bool> = lengths
        .iter()
        .flat_map(|&n| (0..n).map(|i| i == 0))
        .collect();

    let (got, scored) =
        headroom_trainer::evaluate::evaluate(&m, &data, 2, T, 1, Some(DocumentBoundaries::Index))
            .unwrap();
    let tokens = stream[..2 * T].to_vec();
    let mut targets = Vec::new();
    let mut pos = Vec::new();
    for w in 0..2 {
        let mut p = 0u32;
        for i in 0..T {
            let at = w * T + i;
            p = if i == 0 || starts[at] { 0 } else { p + 1 };
            pos.push(p);
            targets.push(if starts[at + 1] {
                IGNORE_TARGET
            } else {
                stream[at + 1]
            });
        }
    }
    let documents = Documents::from_positions(2, T, &pos).unwrap();
    let g = Geometry::new(2, T).with_documents(&documents).unwrap();
    let want = m.loss(&tokens, &targets, g).unwrap();
    assert_eq!(scored, counted_targets(&targets) as u64);
    assert_eq!((got as f32).to_bits(), want.to_bits(), "{got} vs {want}");
    let (unpacked, all) = headroom_trainer::evaluate::evaluate(&m, &data, 2, T, 1, None).unwrap();
    assert_eq!(all, 2 * T as u64);
    assert!((unpacked - got).abs() > 1e-4, "{unpacked} vs {got}");
}

/// Documents that each end with a separator token, in a file without an index, score bit for
/// bit as the same documents (separator included) do through a Megatron index; a separator
/// outside the model's vocabulary is refused.
#[test]
fn evaluate_reads_separator_ended_documents_as_their_index() {
    use headroom_mmap_data::formats::megatron::{open_megatron, write_megatron};
    use headroom_mmap_data::{TokenDataset, TokenType};
    const SEPARATOR: u32 = VOCAB as u32 - 1;
    let cpu = Cpu::new();
    let m = model(&cpu, config(true), AttentionConfig::flash());
    let docs: Vec<Vec<u32>> = [6usize, 0, 11, 2, 9, 4, 13]
        .iter()
        .enumerate()
        .map(|(d, &n)| {
            (0..n as u32)
                .map(|i| (i * 5 + d as u32 * 3) % SEPARATOR)
                .chain([SEPARATOR])
                .collect()
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("docs");
    write_megatron(&prefix, &docs, TokenType::U16).unwrap();
    let indexed = open_megatron(&prefix).unwrap();
    let raw = TokenDataset::from_tokens(&docs.concat(), TokenType::U16).unwrap();
    let eval = |data, documents| headroom_trainer::evaluate::evaluate(&m, data, 2, T, 1, documents);
    let by_index = eval(&indexed, Some(DocumentBoundaries::Index)).unwrap();
    let by_separator = eval(&raw, Some(DocumentBoundaries::EndsWith(SEPARATOR))).unwrap();
    assert_eq!(by_separator.1, by_index.1);
    assert_eq!(by_separator.0.to_bits(), by_index.0.to_bits());
    let unpacked = eval(&raw, None).unwrap();
    assert!(
        unpacked.1 > by_separator.1,
        "{unpacked:?} vs {by_separator:?}"
    );
    let e = eval(&raw, Some(DocumentBoundaries::EndsWith(VOCAB as u32))).unwrap_err();
    assert!(e.to_string().contains("vocabulary"), "{e}");
}

/// transformers' own packed batches (`benches/torch/make_packed_documents_fixture.py`): the
/// committed Llama (grouped-query attention, rotary positions) and GPT-2 (learned positions)
/// fixtures run on 2 rows of packed documents, read from `position_ids` as transformers
/// reads them. The same logits within 1e-4 of the largest and the same loss within 1e-5.
#[test]
fn packed_batches_match_transformers() {
    use safetensors::SafeTensors;
    for name in ["hf-llama-gqa-untied", "hf-gpt2-sharded"] {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        let cpu = Cpu::new();
        let (cfg, masters) = headroom_trainer::hf::load(&dir, &cpu).unwrap();
        let m = Model::from_masters(&cpu, cfg, ModelOptions::default(), masters).unwrap();
        let bytes = std::fs::read(dir.join("packed.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let words = |n: &str| -> Vec<[u8; 4]> {
            st.tensor(n)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| [b[0], b[1], b[2], b[3]])
                .collect()
        };
        let ints = |n: &str| -> Vec<i32> { words(n).into_iter().map(i32::from_le_bytes).collect() };
        let floats =
            |n: &str| -> Vec<f32> { words(n).into_iter().map(f32::from_le_bytes).collect() };
        let tokens: Vec<u32> = ints("tokens").iter().map(|&t| t as u32).collect();
        let positions: Vec<u32> = ints("positions").iter().map(|&p| p as u32).collect();
        let targets: Vec<u32> = ints("targets")
            .iter()
            .map(|&t| if t < 0 { IGNORE_TARGET } else { t as u32 })
            .collect();
        let (rows, t) = (2, tokens.len() / 2);
        let documents = Documents::from_positions(rows, t, &positions).unwrap();
        let g = Geometry::new(rows, t).with_documents(&documents).unwrap();

        let want = floats("logits");
        let got = m.logits(&tokens, g).unwrap();
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-4 * scale,
            "{name}: logits differ by {worst} (scale {scale})"
        );
        let loss = m.loss(&tokens, &targets, g).unwrap();
        let want_loss = floats("loss")[0];
        eprintln!(
            "{name}: largest logit {scale}, worst difference {worst:e}; loss {loss} vs \
             transformers' {want_loss}"
        );
        assert!(
            (loss - want_loss).abs() <= 1e-5 * want_loss.abs().max(1.0),
            "{name}: loss {loss} vs transformers' {want_loss}"
        );
        // Without the documents the same batch is another computation altogether.
        let plain = m.loss(&tokens, &targets, Geometry::new(rows, t)).unwrap();
        assert!(
            (plain - want_loss).abs() > 1e-3,
            "{name}: {plain} vs {want_loss}"
        );
    }
}
