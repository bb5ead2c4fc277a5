//! The estimator's per-category prediction against the tracker's measured peaks, for several
//! technique combinations on both families: byte for byte, every category, device and host
//! (the estimator's terms are the sizes of the model's named buffers, so there is nothing to
//! approximate).

use headroom_attn::AttentionConfig;
use headroom_offload::StatePrecision;
use headroom_tensor::{Device, MemoryCategory};
use headroom_trainer::estimate::estimate;
use headroom_trainer::model::{Family, LlamaShape, ModelConfig, Precision};
use headroom_trainer::techniques::{
    CheckpointChoice, OptimizerChoice, OptimizerPlacement, Techniques,
};
use headroom_trainer::train::{train, DataSource, SyntheticData, TrainOptions};

/// GPT-2 or a Llama with grouped-query attention, of the same width and depth.
fn model(llama: bool) -> ModelConfig {
    let family = if llama {
        Family::Llama(LlamaShape {
            kv_heads: 2,
            head_dim: None,
            sliding_window: None,
            no_rope_interval: None,
            query_pre_attn_scalar: None,
            multipliers: None,
            padding_idx: None,
            ffn: 176,
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
        vocab: 512,
        max_seq: 64,
        layers: 4,
        heads: 4,
        channels: 64,
        family,
    }
}

fn base(llama: bool) -> TrainOptions {
    let data = SyntheticData {
        vocab: 512,
        branching: 4,
        tokens: 1 << 16,
        seed: 5,
    };
    TrainOptions {
        model: model(llama),
        data: DataSource::Synthetic(data),
        steps: 2,
        batch: 8,
        seq: 64,
        ..TrainOptions::tiny_default()
    }
}

fn combos() -> Vec<(&'static str, Techniques)> {
    let b = Techniques::baseline();
    let flash = AttentionConfig::flash();
    let mut v = vec![("fp32 baseline", b.clone())];
    let mut t = b.clone();
    t.checkpoint = CheckpointChoice::SqrtN;
    v.push(("sqrt-n", t.clone()));
    t.model.precision = Precision::Bf16;
    v.push(("sqrt-n bf16", t.clone()));
    t.model.attention = flash;
    v.push(("sqrt-n bf16 flash", t.clone()));
    t.model.loss_chunk = Some(64);
    t.optimizer = OptimizerChoice {
        state: StatePrecision::F32,
        placement: OptimizerPlacement::HostRam,
    };
    v.push(("full stack", t.clone()));
    t.micro_batch = Some(2);
    v.push(("full stack + accumulation", t));
    let mut s = b.clone();
    s.checkpoint = CheckpointChoice::Selective;
    s.model.attention = flash;
    v.push(("selective flash", s));
    let mut e = b.clone();
    e.checkpoint = CheckpointChoice::EveryK(2);
    e.model.precision = Precision::Fp16;
    e.optimizer.state = StatePrecision::Float8;
    v.push(("every-2 fp16 8-bit", e.clone()));
    e.model.attention = flash;
    e.model.loss_chunk = Some(64);
    v.push(("every-2 fp16 flash fused", e.clone()));
    e.model.attention = AttentionConfig::chunked();
    e.checkpoint = CheckpointChoice::Selective;
    v.push(("selective fp16 chunked fused", e));
    v
}

/// The combinations of [`combos`] named in `keep`, all of them.
fn combos_named(keep: &[&str]) -> Vec<(&'static str, Techniques)> {
    let picked: Vec<_> = combos()
        .into_iter()
        .filter(|(name, _)| keep.contains(name))
        .collect();
    assert_eq!(picked.len(), keep.len(), "{keep:?}");
    picked
}

#[test]
fn estimates_equal_the_trackers_peaks() {
    check_family(false);
}

#[test]
fn llama_estimates_equal_the_trackers_peaks() {
    check_family(true);
}

/// A Llama so narrow (head dimension 12, one key/value head for two query heads, SwiGLU width
/// 40) that the attention backward's own workspace — flash's grouped-query dK/dV partials and
/// per-task tiles — is the block's largest moment, and with the loss in chunks of 8 rows the
/// run's largest workspace.
#[test]
fn narrow_grouped_heads_estimates_equal_the_trackers_peaks() {
    let mut cfg = model(true);
    cfg.channels = 24;
    cfg.heads = 2;
    cfg.family = Family::Llama(LlamaShape {
        kv_heads: 1,
        head_dim: None,
        sliding_window: None,
        no_rope_interval: None,
        query_pre_attn_scalar: None,
        multipliers: None,
        padding_idx: None,
        ffn: 40,
        rope_theta: 10_000.0,
        rope_scaling: Default::default(),
        class: Default::default(),
        norm_eps: 1e-5,
        tied_head: false,
    });
    let mut fp32 = Techniques::baseline();
    fp32.model.attention = AttentionConfig::flash();
    fp32.model.loss_chunk = Some(8);
    let mut bf16 = fp32.clone();
    bf16.model.precision = Precision::Bf16;
    let mut chunked = fp32.clone();
    chunked.model.attention = AttentionConfig::chunked();
    check(
        cfg,
        vec![
            ("narrow flash fp32", fp32),
            ("narrow flash bf16", bf16),
            ("narrow chunked fp32", chunked),
        ],
    );
}

/// The combinations that change what a block with head (and output) norms keeps and how its
/// backward's moments line up.
const HEAD_NORM_COMBOS: [&str; 5] = [
    "fp32 baseline",
    "sqrt-n bf16 flash",
    "full stack + accumulation",
    "selective flash",
    "every-2 fp16 flash fused",
];

/// Qwen3's shape: heads 24 wide on a model 64 wide (queries and the attention output 96
/// wide), each query and key head normalised (its input and statistics kept), under the
/// combinations that change what a block keeps and how its backward's moments line up.
#[test]
fn qwen3_estimates_equal_the_trackers_peaks() {
    let mut cfg = model(true);
    if let Family::Llama(s) = &mut cfg.family {
        s.class = headroom_trainer::model::LlamaClass::Qwen3;
        s.head_dim = Some(24);
    }
    check(cfg, combos_named(&HEAD_NORM_COMBOS));
}

/// Gemma 3's shape: Qwen3's head norms on heads 24 wide, the attention's and the MLP's outputs
/// normalised before the residual additions (each output and its statistics kept, and each
/// norm's input gradient beside its residual's in the backward), a GELU gate, and a window of
/// 16 keys in every block but every second, whose rotary base is its own.
#[test]
fn gemma3_estimates_equal_the_trackers_peaks() {
    let mut cfg = model(true);
    if let Family::Llama(s) = &mut cfg.family {
        s.class = headroom_trainer::model::LlamaClass::Gemma3;
        s.head_dim = Some(24);
        s.tied_head = true;
        s.sliding_window = Some(headroom_trainer::model::SlidingWindow {
            full_every: Some(2),
            rope_theta: Some(10_000.0),
            ..headroom_trainer::model::SlidingWindow::from_layer(16, 0)
        });
        s.rope_theta = 1e6;
    }
    check(cfg, combos_named(&HEAD_NORM_COMBOS));
}

/// OLMo 2's shape: no input norms (the projections read the residual stream, and their input
/// gradients add into the residual's), the output norms, and the query and key norms over the
/// whole projections (heads 24 wide: a 96-wide query norm, its input and one statistic per
/// position kept) under the same combinations.
#[test]
fn olmo2_estimates_equal_the_trackers_peaks() {
    let mut cfg = model(true);
    if let Family::Llama(s) = &mut cfg.family {
        s.class = headroom_trainer::model::LlamaClass::Olmo2;
        s.head_dim = Some(24);
    }
    check(cfg, combos_named(&HEAD_NORM_COMBOS));
}

/// OLMo 3's: OLMo 2's block under a window of 16 keys in every block but every second, with
/// its own rotary base.
#[test]
fn olmo3_estimates_equal_the_trackers_peaks() {
    let mut cfg = model(true);
    if let Family::Llama(s) = &mut cfg.family {
        s.class = headroom_trainer::model::LlamaClass::Olmo3;
        s.sliding_window = Some(headroom_trainer::model::SlidingWindow {
            full_every: Some(2),
            rope_theta: Some(10_000.0),
            ..headroom_trainer::model::SlidingWindow::from_layer(16, 0)
        });
    }
    check(cfg, combos_named(&HEAD_NORM_COMBOS));
}

/// Granite's scalars: the scaled copy of each residual gradient in the backward (the
/// embedding, attention and logits scalars allocate nothing), tied head.
#[test]
fn granite_estimates_equal_the_trackers_peaks() {
    let mut cfg = model(true);
    if let Family::Llama(s) = &mut cfg.family {
        s.class = headroom_trainer::model::LlamaClass::Granite;
        s.tied_head = true;
        s.multipliers = Some(super::common::granite_multipliers());
    }
    check(cfg, combos_named(&HEAD_NORM_COMBOS));
}

/// Mistral 7B v0.1's sliding window in small (16 keys of the 64 positions): the window is a
/// narrowed mask, which allocates nothing the estimator does not count.
#[test]
fn sliding_window_estimates_equal_the_trackers_peaks() {
    let mut cfg = model(true);
    if let Family::Llama(s) = &mut cfg.family {
        s.class = headroom_trainer::model::LlamaClass::Mistral;
        s.sliding_window = Some(headroom_trainer::model::SlidingWindow::from_layer(16, 0));
    }
    check(
        cfg,
        combos_named(&[
            "fp32 baseline",
            "sqrt-n bf16 flash",
            "selective fp16 chunked fused",
        ]),
    );
}

/// A vocabulary wider than two of the bf16 output's strips, so that under bf16 the head keeps
/// its logits in bf16 behind an f32 strip (`matmul::bf16_head_logits`): unfused (activations),
/// fused (workspace), and the full stack. On AMX all three; on the widening path the unfused
/// run (512 rows), while the fused runs' 48-row chunks of 64 channels are too small a product
/// for gemm's depth cut and keep f32 logits.
#[test]
fn wide_vocabulary_bf16_estimates_equal_the_trackers_peaks() {
    use headroom_trainer::ops::matmul;
    let mut cfg = model(false);
    cfg.vocab = 2 * matmul::BF16_OUTPUT_STRIP + 952;
    cfg.layers = 2;
    let mut bf16 = Techniques::baseline();
    bf16.model.precision = Precision::Bf16;
    bf16.model.attention = AttentionConfig::flash();
    if matmul::gemm_f32_tile().is_some() {
        let tokens = (base(false).batch * base(false).seq) as u64;
        let bytes = headroom_trainer::estimate::cpu_logit_bytes(&cfg, &bf16, tokens);
        assert_eq!(bytes, 2, "bf16 logits on this machine's path");
    }
    let mut fused = bf16.clone();
    fused.model.loss_chunk = Some(48);
    let mut stack = fused.clone();
    stack.checkpoint = CheckpointChoice::SqrtN;
    stack.optimizer = OptimizerChoice {
        state: StatePrecision::F32,
        placement: OptimizerPlacement::HostRam,
    };
    stack.micro_batch = Some(2);
    check(
        cfg,
        vec![
            ("wide bf16", bf16),
            ("wide bf16 fused", fused),
            ("wide full stack", stack),
        ],
    );
}

fn check_family(llama: bool) {
    check(model(llama), combos());
}

fn check(cfg: ModelConfig, combos: Vec<(&'static str, Techniques)>) {
    let mut failures = Vec::new();
    for (name, tech) in combos {
        let o = TrainOptions {
            techniques: tech.clone(),
            model: cfg,
            ..base(false)
        };
        let e = estimate(&o.model, o.seq, o.micro_batch().unwrap(), o.batch, &tech).unwrap();
        let r = train(&o, |_| {}).unwrap();
        let dev = r.memory.device(Device::Cpu).unwrap();
        for c in MemoryCategory::ALL {
            let (m, p) = (dev.peak[c], e.device[c]);
            let err = (p as f64 - m as f64) / (m.max(1) as f64);
            eprintln!(
                "{name:<28} {c:?}: measured {m} predicted {p} ({:+.1}%)",
                100.0 * err
            );
            if m != p {
                failures.push(format!("{name}: {c:?} measured {m} predicted {p}"));
            }
        }
        // The simultaneous peak bounds the tracker's, below the categories' peaks added.
        eprintln!(
            "{name:<28} simultaneous: measured {} predicted {} ({:+.1}%)",
            dev.peak_total,
            e.device_peak,
            100.0 * (e.device_peak as f64 / dev.peak_total as f64 - 1.0)
        );
        if dev.peak_total > e.device_peak || e.device_peak > e.device_total() {
            failures.push(format!(
                "{name}: simultaneous peak measured {} predicted {} (categories added {})",
                dev.peak_total,
                e.device_peak,
                e.device_total()
            ));
        }
        if let Some(h) = r.host_memory.device(Device::Cpu) {
            for c in MemoryCategory::ALL {
                let (m, p) = (h.peak[c], e.host[c]);
                if m != p {
                    failures.push(format!("{name}: host {c:?} measured {m} predicted {p}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
