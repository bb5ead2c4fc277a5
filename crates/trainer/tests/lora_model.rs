//! LoRA and QLoRA on the model (`Model::finetune`), both families:
//! - with B = 0 the adapted model is the base model bit for bit (fp32 and bf16);
//! - the adapters' gradients are the merged weight's gradient projected — `dA = s·Bᵀ·dW'`,
//!   `dB = s·dW'·Aᵀ`, with `dW'` the full model's gradient at `W' = W + s·B·A` — and match
//!   central finite differences of the loss;
//! - recomputation under a checkpoint schedule gives the same adapter gradients, bit for bit;
//! - a 4-bit base computes what its dequantized weights compute, within f32 tolerance;
//! - no gradient of the base's size exists (tracker bytes), and the 4-bit base is held at its
//!   packed size.

use std::sync::Arc;

use headroom_attn::AttentionConfig;
use headroom_ckpt::Schedule;
use headroom_lora::LoraConfig;
use headroom_profiler::MemoryTracker;
use headroom_tensor::{Backend, Cpu, CpuTensor, Device, MemoryCategory};
use headroom_trainer::model::{
    params, Family, FinetuneSpec, Geometry, LlamaShape, Model, ModelConfig, ModelOptions,
    Precision, QuantSpec,
};

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

fn llama() -> ModelConfig {
    ModelConfig {
        vocab: 11,
        max_seq: 7,
        layers: 3,
        heads: 4,
        channels: 16,
        family: Family::Llama(LlamaShape {
            kv_heads: 2,
            head_dim: None,
            sliding_window: None,
            no_rope_interval: None,
            query_pre_attn_scalar: None,
            multipliers: None,
            padding_idx: None,
            ffn: 24,
            rope_theta: 100.0,
            rope_scaling: Default::default(),
            class: Default::default(),
            norm_eps: 1e-5,
            tied_head: false,
        }),
    }
}

fn opts(precision: Precision) -> ModelOptions {
    ModelOptions {
        attention: AttentionConfig::naive(),
        precision,
        ..ModelOptions::default()
    }
}

/// Base weights larger than the init's, so every path carries a measurable gradient.
fn base(cpu: &Cpu, cfg: &ModelConfig) -> Vec<Vec<f32>> {
    params::init_params(cpu, cfg, 3)
        .unwrap()
        .iter()
        .map(|t| {
            t.as_slice::<f32>()
                .unwrap()
                .iter()
                .enumerate()
                .map(|(i, v)| v + 0.3 * (i as f32 * 1.37).sin())
                .collect()
        })
        .collect()
}

fn upload(cpu: &Cpu, cfg: &ModelConfig, data: &[Vec<f32>]) -> Vec<CpuTensor> {
    let _g = MemoryCategory::Parameters.enter();
    params::param_infos(cfg)
        .iter()
        .zip(data)
        .map(|(i, d)| cpu.upload(d, i.shape.clone()).unwrap())
        .collect()
}

fn batch() -> (Vec<u32>, Vec<u32>, Geometry<'static>) {
    let tokens: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 11).collect();
    let targets: Vec<u32> = (0..12).map(|i| (i * 5 + 1) % 11).collect();
    (tokens, targets, Geometry::new(2, 6))
}

fn spec(cfg: &ModelConfig, r: usize, quantize: Option<QuantSpec>) -> FinetuneSpec {
    let mut lora = LoraConfig::new(
        r,
        2.0 * r as f32,
        headroom_trainer::model::finetune::all_linear_targets(cfg),
    );
    lora.seed = 7;
    FinetuneSpec { lora, quantize }
}

fn nf4(double_quant: bool) -> QuantSpec {
    QuantSpec {
        quant_type: "nf4".into(),
        blocksize: 32,
        double_quant,
    }
}

/// Give every B (and A) nonzero values, so the adapters change the function.
fn perturb_adapters(model: &mut Model) {
    for (k, t) in model.trainable_mut().iter_mut().enumerate() {
        for (i, v) in t.as_mut_slice::<f32>().unwrap().iter_mut().enumerate() {
            *v += 0.2 * ((i as f32 + 1.0) * 0.71 + k as f32).cos();
        }
    }
    model.refresh_trainable().unwrap();
}

fn alloc_trainable_grads(cpu: &Cpu, model: &Model) -> Vec<CpuTensor> {
    let _g = MemoryCategory::Gradients.enter();
    model
        .trainable_infos()
        .unwrap()
        .iter()
        .map(|i| {
            cpu.zeros(i.shape.clone(), headroom_tensor::DType::F32)
                .unwrap()
        })
        .collect()
}

fn grads_of(cpu: &Cpu, model: &Model, schedule: &Schedule) -> (f32, Vec<Vec<f32>>) {
    let (tokens, targets, g) = batch();
    let mut grads = alloc_trainable_grads(cpu, model);
    let (loss, _) = model
        .forward_backward(&tokens, &targets, g, &mut grads, 1.0 / 12.0, schedule)
        .unwrap();
    (
        loss,
        grads
            .iter()
            .map(|t| t.as_slice::<f32>().unwrap().to_vec())
            .collect(),
    )
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |a, x| a.max(x.abs()))
}

/// Central differences (h = 1e-2) of `loss` at `samples` elements spread over every trainable
/// tensor against `analytic`: |numeric − analytic| ≤ 3e-3 + 5% of the tensor's largest.
fn assert_finite_differences(
    tuned: &mut Model,
    analytic: &[Vec<f32>],
    samples: usize,
    family: Family,
    loss: impl Fn(&Model) -> f64,
) {
    let h = 1e-2f32;
    for (k, an) in analytic.iter().enumerate() {
        let scale = max_abs(an);
        for step in 0..samples {
            let i = step * an.len() / samples;
            let orig = tuned.trainable()[k].as_slice::<f32>().unwrap()[i];
            let mut at = |v: f32| {
                tuned.trainable_mut()[k].as_mut_slice::<f32>().unwrap()[i] = v;
                tuned.refresh_trainable().unwrap();
                loss(tuned)
            };
            let num = (at(orig + h) - at(orig - h)) / (2.0 * h as f64);
            at(orig);
            assert!(
                (num - an[i] as f64).abs() <= 3e-3 + 0.05 * scale as f64,
                "{family:?} adapter tensor {k} element {i}: numeric {num} analytic {}",
                an[i]
            );
        }
    }
}

/// An fp32 fine-tuning model over `data` with `spec`'s adapters.
fn tuned_fp32(cpu: &Cpu, cfg: &ModelConfig, data: &[Vec<f32>], spec: FinetuneSpec) -> Model {
    Model::finetune(
        cpu,
        *cfg,
        opts(Precision::Fp32),
        upload(cpu, cfg, data),
        spec,
        None,
    )
    .unwrap()
}

#[test]
fn zero_b_gives_the_base_model_bit_for_bit() {
    let cpu = Cpu::new();
    for cfg in [gpt2(), llama()] {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let data = base(&cpu, &cfg);
            let full =
                Model::from_masters(&cpu, cfg, opts(precision), upload(&cpu, &cfg, &data)).unwrap();
            let tuned = Model::finetune(
                &cpu,
                cfg,
                opts(precision),
                upload(&cpu, &cfg, &data),
                spec(&cfg, 4, None),
                None,
            )
            .unwrap();
            assert!(tuned.adapted_modules().len() >= cfg.layers * 3);
            // A is nonzero (Kaiming-uniform), B zero: PEFT's initialisation.
            assert!(tuned.trainable()[0]
                .as_slice::<f32>()
                .unwrap()
                .iter()
                .any(|&v| v != 0.0));
            assert!(tuned.trainable()[1]
                .as_slice::<f32>()
                .unwrap()
                .iter()
                .all(|&v| v == 0.0));
            let (tokens, _, g) = batch();
            let want = full.logits(&tokens, g).unwrap();
            let got = tuned.logits(&tokens, g).unwrap();
            assert_eq!(got, want, "{:?} {precision:?}", cfg.family);
        }
    }
}

/// The merged model `W' = W + s·B·A` as a plain model, and the adapters' gradients predicted
/// from its weight gradients.
fn merged_and_projected(
    cpu: &Cpu,
    cfg: &ModelConfig,
    data: &[Vec<f32>],
    tuned: &Model,
    dequantized: Option<&[Vec<f32>]>,
) -> (f32, Vec<Vec<f64>>) {
    let spec = tuned.finetune_spec().unwrap();
    let s = spec.lora.scaling() as f64;
    let r = spec.lora.r;
    let mut merged: Vec<Vec<f32>> = dequantized.unwrap_or(data).to_vec();
    let adapters: Vec<Vec<f32>> = tuned
        .trainable()
        .iter()
        .map(|t| t.as_slice::<f32>().unwrap().to_vec())
        .collect();
    for (k, m) in tuned.adapted_modules().iter().enumerate() {
        let (a, b) = (&adapters[2 * k], &adapters[2 * k + 1]);
        let w = &mut merged[m.param];
        for o in 0..m.out_features {
            for i in 0..m.in_features {
                let d: f64 = (0..r)
                    .map(|j| b[o * r + j] as f64 * a[j * m.in_features + i] as f64)
                    .sum();
                w[o * m.in_features + i] += (s * d) as f32;
            }
        }
    }
    let full =
        Model::from_masters(cpu, *cfg, opts(Precision::Fp32), upload(cpu, cfg, &merged)).unwrap();
    let (tokens, targets, g) = batch();
    let mut grads = params::alloc_like_params(cpu, cfg, MemoryCategory::Gradients).unwrap();
    let all = Schedule::store_all(cfg.layers).unwrap();
    let (loss, _) = full
        .forward_backward(&tokens, &targets, g, &mut grads, 1.0 / 12.0, &all)
        .unwrap();
    let mut want = Vec::new();
    for (k, m) in tuned.adapted_modules().iter().enumerate() {
        let (a, b) = (&adapters[2 * k], &adapters[2 * k + 1]);
        let dw = grads[m.param].as_slice::<f32>().unwrap();
        let (o_n, i_n) = (m.out_features, m.in_features);
        // dA[j, i] = s Σ_o B[o, j] dW[o, i]
        let da: Vec<f64> = (0..r * i_n)
            .map(|x| {
                let (j, i) = (x / i_n, x % i_n);
                s * (0..o_n)
                    .map(|o| b[o * r + j] as f64 * dw[o * i_n + i] as f64)
                    .sum::<f64>()
            })
            .collect();
        // dB[o, j] = s Σ_i dW[o, i] A[j, i]
        let db: Vec<f64> = (0..o_n * r)
            .map(|x| {
                let (o, j) = (x / r, x % r);
                s * (0..i_n)
                    .map(|i| dw[o * i_n + i] as f64 * a[j * i_n + i] as f64)
                    .sum::<f64>()
            })
            .collect();
        want.push(da);
        want.push(db);
    }
    (loss, want)
}

fn assert_close(what: &str, got: &[Vec<f32>], want: &[Vec<f64>], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: tensor count");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        let scale = w.iter().fold(0f64, |a, x| a.max(x.abs())).max(1e-3);
        for (i, (x, y)) in g.iter().zip(w).enumerate() {
            assert!(
                (*x as f64 - y).abs() <= rel * scale,
                "{what}: tensor {k} element {i}: {x} vs {y} (scale {scale})"
            );
        }
    }
}

#[test]
fn adapter_gradients_are_the_merged_weights_gradients_projected() {
    let cpu = Cpu::new();
    for cfg in [gpt2(), llama()] {
        let data = base(&cpu, &cfg);
        let mut tuned = tuned_fp32(&cpu, &cfg, &data, spec(&cfg, 3, None));
        perturb_adapters(&mut tuned);
        let all = Schedule::store_all(cfg.layers).unwrap();
        let (loss, got) = grads_of(&cpu, &tuned, &all);
        let (want_loss, want) = merged_and_projected(&cpu, &cfg, &data, &tuned, None);
        assert!(
            (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
            "{:?}: loss {loss} vs merged {want_loss}",
            cfg.family
        );
        assert!(got.iter().all(|g| max_abs(g) > 0.0));
        assert_close(&format!("{:?}", cfg.family), &got, &want, 1e-4);

        // Recomputation (every block's input kept, its inside recomputed): the same bits.
        let every = Schedule::every_k(cfg.layers, 1).unwrap();
        let (loss2, again) = grads_of(&cpu, &tuned, &every);
        assert_eq!(loss2.to_bits(), loss.to_bits());
        assert_eq!(again, got, "{:?}: recomputed adapter gradients", cfg.family);
    }
}

#[test]
fn adapter_gradients_match_finite_differences() {
    let cpu = Cpu::new();
    for cfg in [gpt2(), llama()] {
        let data = base(&cpu, &cfg);
        let mut tuned = tuned_fp32(&cpu, &cfg, &data, spec(&cfg, 2, None));
        perturb_adapters(&mut tuned);
        let all = Schedule::store_all(cfg.layers).unwrap();
        let (_, analytic) = grads_of(&cpu, &tuned, &all);
        let (tokens, targets, g) = batch();
        assert_finite_differences(&mut tuned, &analytic, 4, cfg.family, |m| {
            m.loss(&tokens, &targets, g).unwrap() as f64
        });
    }
}

/// The base's block linears dequantized, as a plain model would hold them.
fn dequantized_base(cfg: &ModelConfig, data: &[Vec<f32>], q: &QuantSpec) -> Vec<Vec<f32>> {
    let cpu = Cpu::new();
    let qc = q.config().unwrap();
    let infos = params::param_infos(cfg);
    let mut out = data.to_vec();
    for l in 0..cfg.layers {
        for &off in headroom_trainer::model::finetune::block_linear_offsets(cfg) {
            let i = params::layer_index(cfg, l, off);
            let t = headroom_quant::QuantizedTensor::quantize(&cpu, &data[i], &infos[i].shape, qc)
                .unwrap();
            out[i] = t.dequantize();
        }
    }
    out
}

#[test]
fn a_4bit_base_computes_what_its_dequantized_weights_compute() {
    let cpu = Cpu::new();
    for cfg in [gpt2(), llama()] {
        for dq in [false, true] {
            let q = nf4(dq);
            let data = base(&cpu, &cfg);
            let deq = dequantized_base(&cfg, &data, &q);
            let mut tuned = tuned_fp32(&cpu, &cfg, &data, spec(&cfg, 3, Some(q)));
            // B = 0: the dequantized plain model's logits.
            let plain =
                Model::from_masters(&cpu, cfg, opts(Precision::Fp32), upload(&cpu, &cfg, &deq))
                    .unwrap();
            let (tokens, _, g) = batch();
            let (want, got) = (
                plain.logits(&tokens, g).unwrap(),
                tuned.logits(&tokens, g).unwrap(),
            );
            let scale = max_abs(&want);
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-5 * scale,
                    "{:?} dq {dq}: {a} vs {b}",
                    cfg.family
                );
            }
            // Trained adapters: the gradients of the merged dequantized model, projected.
            perturb_adapters(&mut tuned);
            let all = Schedule::store_all(cfg.layers).unwrap();
            let (loss, grads) = grads_of(&cpu, &tuned, &all);
            let (want_loss, want) = merged_and_projected(&cpu, &cfg, &data, &tuned, Some(&deq));
            assert!((loss - want_loss).abs() <= 1e-5 * want_loss.abs());
            assert_close(
                &format!("{:?} 4-bit dq {dq}", cfg.family),
                &grads,
                &want,
                1e-4,
            );
        }
    }
}

#[test]
fn no_gradient_of_the_base_exists_and_the_4bit_base_is_held_packed() {
    for quantize in [None, Some(nf4(true))] {
        let cfg = llama();
        let tracker = Arc::new(MemoryTracker::new());
        let cpu = Cpu::new().with_alloc_hook(tracker.clone());
        let data = base(&Cpu::new(), &cfg);
        let tuned = tuned_fp32(&cpu, &cfg, &data, spec(&cfg, 2, quantize.clone()));
        let live = tracker.snapshot();
        let params_live = live.device(Device::Cpu).unwrap().live[MemoryCategory::Parameters];
        let adapter_bytes: usize = tuned
            .trainable()
            .iter()
            .map(|t| t.as_slice::<f32>().unwrap().len() * 4)
            .sum();
        let infos = params::param_infos(&cfg);
        let linear: std::collections::BTreeSet<usize> = (0..cfg.layers)
            .flat_map(|l| {
                headroom_trainer::model::finetune::block_linear_offsets(&cfg)
                    .iter()
                    .map(move |&o| params::layer_index(&cfg, l, o))
            })
            .collect();
        let dense_bytes: usize = infos
            .iter()
            .enumerate()
            .filter(|(i, _)| quantize.is_none() || !linear.contains(i))
            .map(|(_, i)| i.shape.iter().product::<usize>() * 4)
            .sum();
        // Parameters: the frozen base (dense or packed), the adapters' masters — nothing else.
        assert_eq!(
            params_live as usize,
            dense_bytes + tuned.quantized_bytes() + adapter_bytes,
            "{quantize:?}"
        );
        if let Some(q) = &quantize {
            // Exactly the packed tensors headroom-quant makes of those weights (at these tiny
            // sizes the per-tensor code map dominates; the bits per parameter of real shapes
            // are the ladder's figure).
            let qc = q.config().unwrap();
            let packed: usize = linear
                .iter()
                .map(|&i| {
                    headroom_quant::QuantizedTensor::quantize(
                        &Cpu::new(),
                        &data[i],
                        &infos[i].shape,
                        qc,
                    )
                    .unwrap()
                    .stored_bytes()
                })
                .sum();
            assert_eq!(tuned.quantized_bytes(), packed);
        }
        let all = Schedule::store_all(cfg.layers).unwrap();
        let before =
            tracker.snapshot().device(Device::Cpu).unwrap().peak[MemoryCategory::Gradients];
        assert_eq!(before, 0);
        grads_of(&cpu, &tuned, &all);
        let peak = tracker.snapshot().device(Device::Cpu).unwrap().peak[MemoryCategory::Gradients];
        // The only gradients ever allocated are the adapters' (the caller's buffers).
        assert_eq!(peak as usize, adapter_bytes, "{quantize:?}");
    }
}

/// LoRA dropout: the adapter's input is `x ⊙ mask` with headroom-lora's mask of (seed, step,
/// micro-batch, module). Gradients match finite differences of the loss under the same mask;
/// recomputation regenerates the mask (the same bits); another micro-batch drops other
/// elements; forward-only evaluation drops nothing.
#[test]
fn lora_dropout_gradients_masks_and_evaluation() {
    let cpu = Cpu::new();
    for cfg in [gpt2(), llama()] {
        let data = base(&cpu, &cfg);
        let mut s = spec(&cfg, 2, None);
        s.lora.dropout = 0.3;
        let mut tuned = tuned_fp32(&cpu, &cfg, &data, s.clone());
        perturb_adapters(&mut tuned);
        tuned.set_dropout_position(4, 1);
        let all = Schedule::store_all(cfg.layers).unwrap();
        let (loss, analytic) = grads_of(&cpu, &tuned, &all);
        let every = Schedule::every_k(cfg.layers, 1).unwrap();
        let (loss2, again) = grads_of(&cpu, &tuned, &every);
        assert_eq!((loss2.to_bits(), &again), (loss.to_bits(), &analytic));

        // Forward-only evaluation ignores dropout: the same as the model without it.
        let (tokens, targets, g) = batch();
        let mut plain_spec = s.clone();
        plain_spec.lora.dropout = 0.0;
        let mut plain = tuned_fp32(&cpu, &cfg, &data, plain_spec);
        perturb_adapters(&mut plain);
        let eval = tuned.loss(&tokens, &targets, g).unwrap();
        assert_eq!(eval, plain.loss(&tokens, &targets, g).unwrap());
        // Training drops something: its loss differs from evaluation's, and from another
        // micro-batch's mask.
        assert_ne!(loss, eval);
        tuned.set_dropout_position(4, 2);
        let (other, _) = grads_of(&cpu, &tuned, &all);
        assert_ne!(other, loss);
        tuned.set_dropout_position(4, 1);

        // Finite differences of the training loss under the same mask.
        assert_finite_differences(&mut tuned, &analytic, 3, cfg.family, |m| {
            grads_of(&cpu, m, &all).0 as f64
        });
    }
}
