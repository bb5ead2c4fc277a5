//! The model's analytic gradients against central finite differences of its loss, for every
//! parameter tensor of both families (GPT-2; Llama with grouped-query attention and an untied
//! head, and with a tied one) and every attention algorithm.
//!
//! f32 throughout, h = 1e-2: a sampled element passes when |numeric − analytic| ≤ 3e-3 +
//! 5% · max|analytic| of its tensor. The loss is summed in f64, so its rounding (≈1e-7) is far
//! below the differences measured; a wrong formula (a missing residual, a transposed weight, a
//! lost 1/N) misses by orders of magnitude.

use headroom_attn::AttentionConfig;
use headroom_ckpt::Schedule;
use headroom_tensor::{Cpu, MemoryCategory};
use headroom_trainer::model::{
    params, Family, Geometry, LlamaShape, Model, ModelConfig, ModelOptions,
};

fn opts(attention: AttentionConfig) -> ModelOptions {
    ModelOptions {
        attention,
        ..ModelOptions::default()
    }
}

fn gpt2() -> ModelConfig {
    ModelConfig {
        vocab: 11,
        max_seq: 7,
        layers: 2,
        heads: 2,
        channels: 8,
        family: Family::Gpt2,
    }
}

/// Four query heads over two key/value heads of 4 dimensions (so the rotary embedding rotates
/// two pairs per head), a SwiGLU width that is no multiple of the model width.
fn llama(kv_heads: usize, tied_head: bool) -> ModelConfig {
    ModelConfig {
        vocab: 11,
        max_seq: 7,
        layers: 2,
        heads: 4,
        channels: 16,
        family: Family::Llama(LlamaShape {
            kv_heads,
            head_dim: None,
            sliding_window: None,
            no_rope_interval: None,
            query_pre_attn_scalar: None,
            multipliers: None,
            padding_idx: None,
            ffn: 24,
            // A small base, so that the 6 positions turn every frequency measurably.
            rope_theta: 100.0,
            rope_scaling: Default::default(),
            class: Default::default(),
            norm_eps: 1e-5,
            tied_head,
        }),
    }
}

fn check(cfg: ModelConfig, attention: AttentionConfig) {
    let cpu = Cpu::new();
    let mut gpt = Model::new(&cpu, cfg, opts(attention), 3).unwrap();
    // Larger than GPT-2's 0.02 init, so every path carries a measurable gradient.
    for t in gpt.masters_mut().iter_mut() {
        for (i, v) in t.as_mut_slice::<f32>().unwrap().iter_mut().enumerate() {
            *v += 0.3 * ((i as f32 * 1.37).sin());
        }
    }
    let g = Geometry::new(2, 6);
    let tokens: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 11).collect();
    let targets: Vec<u32> = (0..12).map(|i| (i * 5 + 1) % 11).collect();
    let mut grads = params::alloc_like_params(&cpu, &cfg, MemoryCategory::Gradients).unwrap();
    let all = Schedule::store_all(cfg.layers).unwrap();
    gpt.forward_backward(&tokens, &targets, g, &mut grads, 1.0 / 12.0, &all)
        .unwrap();

    let h = 1e-2f32;
    for (pi, info) in params::param_infos(&cfg).iter().enumerate() {
        let analytic = grads[pi].as_slice::<f32>().unwrap().to_vec();
        let scale = analytic.iter().fold(0f32, |a, v| a.max(v.abs()));
        let n = analytic.len();
        // Up to 12 elements per tensor, spread over it.
        for k in 0..n.min(12) {
            let i = k * n / n.min(12);
            let orig = gpt.masters_mut()[pi].as_slice::<f32>().unwrap()[i];
            gpt.masters_mut()[pi].as_mut_slice::<f32>().unwrap()[i] = orig + h;
            let up = gpt.loss(&tokens, &targets, g).unwrap();
            gpt.masters_mut()[pi].as_mut_slice::<f32>().unwrap()[i] = orig - h;
            let down = gpt.loss(&tokens, &targets, g).unwrap();
            gpt.masters_mut()[pi].as_mut_slice::<f32>().unwrap()[i] = orig;
            let numeric = (up - down) / (2.0 * h);
            assert!(
                (numeric - analytic[i]).abs() <= 3e-3 + 0.05 * scale,
                "{} [{i}] ({:?}): analytic {} numeric {numeric}",
                info.name,
                attention.algorithm,
                analytic[i]
            );
        }
        assert!(scale > 0.0, "{} has an all-zero gradient", info.name);
    }
}

#[test]
fn gradients_match_finite_differences_naive() {
    check(gpt2(), AttentionConfig::naive());
}

#[test]
fn gradients_match_finite_differences_flash() {
    check(gpt2(), AttentionConfig::flash());
}

#[test]
fn llama_gradients_match_finite_differences_naive() {
    check(llama(2, false), AttentionConfig::naive());
}

#[test]
fn llama_gradients_match_finite_differences_flash() {
    check(llama(2, false), AttentionConfig::flash());
}

#[test]
fn llama_tied_multi_head_gradients_match_finite_differences() {
    check(llama(4, true), AttentionConfig::chunked());
}

/// Qwen2's q/k/v biases (a key bias moves the scores only through the rotation, which
/// differs per position) and Llama 3's rescaled frequencies, whose backward rotates by the
/// same rescaled angles.
#[test]
fn qwen2_biases_and_llama3_rope_gradients_match_finite_differences() {
    let mut cfg = llama(2, true);
    if let Family::Llama(s) = &mut cfg.family {
        s.class = headroom_trainer::model::LlamaClass::Qwen2;
        s.rope_scaling = headroom_trainer::model::RopeScaling::Llama3 {
            factor: 4.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8,
        };
    }
    assert_eq!(params::param_infos(&cfg).len(), cfg.tensor_count().unwrap());
    check(cfg, AttentionConfig::flash());
}

/// Qwen3: each query and key head RMS-normalised before the rotation (the norms' gains get
/// gradients through the rotation and the attention), with heads 6 wide on a model 16 wide,
/// so q is 24 wide and o_proj maps 24 back to 16.
#[test]
fn qwen3_head_norms_and_own_head_width_gradients_match_finite_differences() {
    let mut cfg = llama(2, true);
    if let Family::Llama(s) = &mut cfg.family {
        s.class = headroom_trainer::model::LlamaClass::Qwen3;
        s.head_dim = Some(6);
    }
    assert_eq!(cfg.attention_width(), 24);
    assert_eq!(params::param_infos(&cfg).len(), cfg.tensor_count().unwrap());
    check(cfg, AttentionConfig::flash());
    check(cfg, AttentionConfig::naive());
}

/// Gemma 3: head norms, norms on the attention's and the MLP's outputs, gains stored as
/// offsets from 1, a GELU gate, the embedding scaled by √C, and a window of 3 keys in block 0
/// (block 1 attends to everything) with its own rotary base.
#[test]
fn gemma3_gradients_match_finite_differences() {
    use headroom_trainer::model::{LlamaClass, SlidingWindow};
    let mut cfg = llama(2, true);
    if let Family::Llama(s) = &mut cfg.family {
        s.class = LlamaClass::Gemma3;
        s.head_dim = Some(6);
        s.sliding_window = Some(SlidingWindow {
            full_every: Some(2),
            rope_theta: Some(100.0),
            ..SlidingWindow::from_layer(3, 0)
        });
    }
    assert_eq!(params::param_infos(&cfg).len(), cfg.tensor_count().unwrap());
    check(cfg, AttentionConfig::flash());
    check(cfg, AttentionConfig::naive());
}

/// OLMo 2: no input norms, the output norms, and the query and key norms over the whole 24-
/// and 12-wide projections (heads 6 wide on a model 16 wide); OLMo 3: the same block with a
/// window of 3 keys in block 0 and its own rotary base there.
#[test]
fn olmo_gradients_match_finite_differences() {
    use headroom_trainer::model::{LlamaClass, SlidingWindow};
    for class in [LlamaClass::Olmo2, LlamaClass::Olmo3] {
        let mut cfg = llama(2, true);
        if let Family::Llama(s) = &mut cfg.family {
            s.class = class;
            s.head_dim = Some(6);
            s.sliding_window = (class == LlamaClass::Olmo3).then_some(SlidingWindow {
                full_every: Some(2),
                rope_theta: Some(100.0),
                ..SlidingWindow::from_layer(3, 0)
            });
        }
        assert_eq!(params::param_infos(&cfg).len(), cfg.tensor_count().unwrap());
        check(cfg, AttentionConfig::flash());
        check(cfg, AttentionConfig::naive());
    }
}

/// Granite: the embedding, each residual branch, `q·kᵀ` and the logits scaled by its four
/// scalars (the logits' divisor not a power of two).
#[test]
fn granite_gradients_match_finite_differences() {
    let mut cfg = llama(2, true);
    if let Family::Llama(s) = &mut cfg.family {
        s.class = headroom_trainer::model::LlamaClass::Granite;
        s.multipliers = Some(headroom_trainer::model::Multipliers {
            embedding: 3.0,
            residual: 0.5,
            attention: 0.3,
            logits_scaling: 3.0,
        });
    }
    check(cfg, AttentionConfig::flash());
    check(cfg, AttentionConfig::naive());
}

/// Sliding windows of 3 keys over the 6 positions: Mistral's in both blocks, Qwen2's from
/// block 1 on. The backward must give the hidden keys no gradient from the queries past them.
#[test]
fn sliding_window_gradients_match_finite_differences() {
    use headroom_trainer::model::{LlamaClass, SlidingWindow};
    for (class, first_layer) in [(LlamaClass::Mistral, 0), (LlamaClass::Qwen2, 1)] {
        let mut cfg = llama(2, false);
        if let Family::Llama(s) = &mut cfg.family {
            s.class = class;
            s.sliding_window = Some(SlidingWindow::from_layer(3, first_layer));
        }
        check(cfg, AttentionConfig::flash());
        check(cfg, AttentionConfig::chunked());
    }
}

/// YaRN scales cos and sin by its attention factor: the rotation is no longer orthogonal, and
/// its backward (the negative angle, same scale) must still be its transpose.
#[test]
fn yarn_rope_gradients_match_finite_differences() {
    let mut cfg = llama(2, false);
    if let Family::Llama(s) = &mut cfg.family {
        s.rope_scaling = headroom_trainer::model::RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 8,
            beta_fast: 4.0,
            beta_slow: 0.5,
            attention_factor: 1.3,
            truncate: false,
        };
    }
    check(cfg, AttentionConfig::naive());
}

#[test]
fn attention_algorithms_give_the_same_gradients() {
    let cpu = Cpu::new();
    let cfg = ModelConfig {
        vocab: 13,
        max_seq: 16,
        layers: 2,
        heads: 2,
        channels: 16,
        family: headroom_trainer::model::Family::Gpt2,
    };
    let g = Geometry::new(2, 16);
    let tokens: Vec<u32> = (0..32).map(|i| (i * 7 + 3) % 13).collect();
    let targets: Vec<u32> = (0..32).map(|i| (i * 5 + 1) % 13).collect();
    let run = |a: AttentionConfig| {
        let gpt = Model::new(&cpu, cfg, opts(a), 9).unwrap();
        let mut grads = params::alloc_like_params(&cpu, &cfg, MemoryCategory::Gradients).unwrap();
        let all = Schedule::store_all(cfg.layers).unwrap();
        let (loss, _) = gpt
            .forward_backward(&tokens, &targets, g, &mut grads, 1.0 / 32.0, &all)
            .unwrap();
        (
            loss,
            grads
                .iter()
                .map(|t| t.as_slice::<f32>().unwrap().to_vec())
                .collect::<Vec<_>>(),
        )
    };
    let (l0, g0) = run(AttentionConfig::naive());
    for a in [AttentionConfig::chunked(), AttentionConfig::flash()] {
        let (l, gr) = run(a);
        assert!((l - l0).abs() < 1e-5);
        for (x, y) in gr.iter().zip(&g0) {
            let scale = y.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            assert!(x.iter().zip(y).all(|(a, b)| (a - b).abs() <= 1e-4 * scale));
        }
    }
}

#[test]
fn bad_batches_are_typed_errors() {
    let cpu = Cpu::new();
    let cfg = ModelConfig {
        vocab: 5,
        max_seq: 4,
        layers: 1,
        heads: 1,
        channels: 4,
        family: headroom_trainer::model::Family::Gpt2,
    };
    let gpt = Model::new(&cpu, cfg, ModelOptions::default(), 0).unwrap();
    let all = Schedule::store_all(1).unwrap();
    let mut grads = params::alloc_like_params(&cpu, &cfg, MemoryCategory::Gradients).unwrap();
    assert!(gpt
        .forward_backward(
            &[0, 1, 2, 9],
            &[0; 4],
            Geometry::new(1, 4),
            &mut grads,
            1.0,
            &all
        )
        .is_err());
    assert!(gpt
        .forward_backward(&[0; 5], &[0; 5], Geometry::new(1, 5), &mut grads, 1.0, &all)
        .is_err());
    assert!(gpt
        .forward_backward(&[0; 3], &[0; 4], Geometry::new(1, 4), &mut grads, 1.0, &all)
        .is_err());
    assert!(Model::new(
        &cpu,
        ModelConfig { heads: 3, ..cfg },
        ModelOptions::default(),
        0
    )
    .is_err());
}
