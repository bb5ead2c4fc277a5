//! Low-precision runs read their bf16/f16 working weights in place: the estimator's workspace
//! (with the widened panels in place of whole f32 views of weights) equals the tracker's peak
//! per category, at widths where the panels are narrower than the weights (several panels per
//! GEMM for the head, the projections and — for Llama — the MLP), and with a fused loss whose
//! last chunk is shorter than the others. With a small vocabulary the blocks' backward sets the
//! workspace peak, with a large one the head does.

use headroom_tensor::{Device, MemoryCategory};
use headroom_trainer::estimate::estimate;
use headroom_trainer::model::{Family, LlamaShape, ModelConfig, Precision};
use headroom_trainer::techniques::Techniques;
use headroom_trainer::train::{train, DataSource, SyntheticData, TrainOptions};

fn model(llama: bool, vocab: usize) -> ModelConfig {
    let family = if llama {
        Family::Llama(LlamaShape {
            kv_heads: 4,
            head_dim: None,
            sliding_window: None,
            no_rope_interval: None,
            query_pre_attn_scalar: None,
            multipliers: None,
            padding_idx: None,
            ffn: 2048,
            rope_theta: 10_000.0,
            rope_scaling: Default::default(),
            class: Default::default(),
            norm_eps: 1e-5,
            tied_head: false,
        })
    } else {
        Family::Gpt2
    };
    ModelConfig {
        vocab,
        max_seq: 32,
        layers: 2,
        heads: 12,
        channels: 768,
        family,
    }
}

fn check(llama: bool) {
    let mut failures = Vec::new();
    let cases = [
        (Precision::Bf16, None, 8192),
        (Precision::Bf16, Some(40), 8192),
        (Precision::Fp16, Some(40), 8192),
        (Precision::Bf16, None, 512),
        (Precision::Fp16, None, 512),
    ];
    for (precision, loss_chunk, vocab) in cases {
        {
            let mut tech = Techniques::baseline();
            tech.model.precision = precision;
            tech.model.loss_chunk = loss_chunk;
            let o = TrainOptions {
                model: model(llama, vocab),
                data: DataSource::Synthetic(SyntheticData {
                    vocab: vocab as u32,
                    branching: 4,
                    tokens: 1 << 14,
                    seed: 3,
                }),
                steps: 1,
                batch: 2,
                seq: 32,
                techniques: tech.clone(),
                ..TrainOptions::tiny_default()
            };
            let e = estimate(&o.model, o.seq, o.micro_batch().unwrap(), o.batch, &tech).unwrap();
            let r = train(&o, |_| {}).unwrap();
            let dev = r.memory.device(Device::Cpu).unwrap();
            for c in MemoryCategory::ALL {
                let (m, p) = (dev.peak[c], e.device[c]);
                eprintln!("{precision:?} chunk {loss_chunk:?} V {vocab} {c:?}: measured {m} predicted {p}");
                if m != p {
                    failures.push(format!(
                        "{precision:?} chunk {loss_chunk:?} V {vocab}: {c:?} measured {m} predicted {p}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn gpt2_low_precision_workspace_is_estimated_exactly() {
    check(false);
}

#[test]
fn llama_low_precision_workspace_is_estimated_exactly() {
    check(true);
}
