//! The model on a CUDA device (`Model<Cuda>`, the CPU's code over the CUDA ops) against the
//! CPU model, for both families. Everything that needs a GPU is
//! `#[ignore = "needs a CUDA device"]` (run with `--include-ignored` on a GPU machine, e.g. from
//! `cargo xtask device-bundle`); the no-device error is checked everywhere.
//!
//! Tolerances (bf16): the CPU model computes in f32 on bf16-rounded weights and activations;
//! the device differs by GEMM summation order (cuBLASLt), by rounding activation gradients to
//! bf16 before the backward GEMMs, and by flash attention's bf16 P/dS and bf16 gradients. So
//! the loss is compared to 1e-2 relative and each gradient tensor by its relative L2 error
//! `‖g_cuda − g_cpu‖ / ‖g_cpu‖ ≤ 5e-2` (bf16's unit roundoff is 3.9e-3; a handful of roundings
//! compound through the blocks). Checkpoint schedules, by contrast, are compared bit for bit.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use headroom_ckpt::Schedule;
use headroom_cuda::Cuda;
use headroom_profiler::MemoryTracker;
use headroom_tensor::{Backend, Cpu, MemoryCategory, Tensor};
use headroom_trainer::cuda::{self as device, CudaGptError};
use headroom_trainer::model::{
    counted_targets, params, Family, Geometry, LlamaShape, Model, ModelConfig, ModelOptions,
    Precision, IGNORE_TARGET,
};
use headroom_trainer::TrainError;

/// Two heads of 64 (the smallest head dimension the CUDA flash kernels have).
fn cfg() -> ModelConfig {
    ModelConfig {
        vocab: 96,
        max_seq: 32,
        layers: 3,
        heads: 2,
        channels: 128,
        family: Family::Gpt2,
    }
}

/// Llama with grouped-query attention: four query heads of 64 sharing two key/value heads,
/// an untied head.
fn llama() -> ModelConfig {
    ModelConfig {
        vocab: 96,
        max_seq: 32,
        layers: 2,
        heads: 4,
        channels: 256,
        family: Family::Llama(LlamaShape {
            kv_heads: 2,
            head_dim: None,
            sliding_window: None,
            no_rope_interval: None,
            query_pre_attn_scalar: None,
            multipliers: None,
            padding_idx: None,
            ffn: 384,
            rope_theta: 10_000.0,
            rope_scaling: Default::default(),
            class: Default::default(),
            norm_eps: 1e-5,
            tied_head: false,
        }),
    }
}

fn bf16() -> ModelOptions {
    ModelOptions {
        precision: Precision::Bf16,
        ..Default::default()
    }
}

const G: Geometry<'static> = Geometry::new(2, 24);

fn batch(cfg: &ModelConfig) -> (Vec<u32>, Vec<u32>) {
    let n = G.rows();
    let v = cfg.vocab as u32;
    let tokens = (0..n as u32).map(|i| (i * 7 + 3) % v).collect();
    let targets = (0..n as u32).map(|i| (i * 13 + 5) % v).collect();
    (tokens, targets)
}

fn cuda() -> Cuda {
    Cuda::new(0).expect("this test needs a CUDA device")
}

/// The CUDA twin of a CPU model: same shape, options and (rounded) weights.
fn on_device(cpu: &Model) -> Model<Cuda> {
    device::model_over_host_masters(&cuda(), cpu.cfg, cpu.opts, cpu.masters()).unwrap()
}

/// The standard batch with each sequence's first 9 targets and every 7th row ignored, as
/// supervised fine-tuning ignores a prompt's: the counted rows straddle every head chunk's
/// edges of `loss_chunk: Some(10)`.
fn masked_batch(cfg: &ModelConfig) -> (Vec<u32>, Vec<u32>) {
    let (tokens, mut targets) = batch(cfg);
    for (i, t) in targets.iter_mut().enumerate() {
        if i % G.t < 9 || i % 7 == 0 {
            *t = IGNORE_TARGET;
        }
    }
    (tokens, targets)
}

/// The gradient weight of one counted target: the mean over the counted rows.
fn per_counted(targets: &[u32]) -> f32 {
    1.0 / counted_targets(targets).max(1) as f32
}

/// CPU loss and gradients (f32 host vectors) of `gpt` for a batch.
fn cpu_step_on(
    gpt: &Model,
    schedule: &Schedule,
    (tokens, targets): &(Vec<u32>, Vec<u32>),
) -> (f32, Vec<Vec<f32>>) {
    let mut grads =
        params::alloc_like_params(gpt.backend(), &gpt.cfg, MemoryCategory::Gradients).unwrap();
    let (loss, _) = gpt
        .forward_backward(
            tokens,
            targets,
            G,
            &mut grads,
            per_counted(targets),
            schedule,
        )
        .unwrap();
    let host = grads
        .iter()
        .map(|g| g.as_slice::<f32>().unwrap().to_vec())
        .collect();
    (loss, host)
}

/// CUDA loss and gradients for the standard batch.
fn cuda_step(gpt: &Model<Cuda>, schedule: &Schedule) -> (f32, Vec<Vec<f32>>) {
    cuda_step_on(gpt, schedule, &batch(&gpt.cfg))
}

fn cuda_step_on(
    gpt: &Model<Cuda>,
    schedule: &Schedule,
    (tokens, targets): &(Vec<u32>, Vec<u32>),
) -> (f32, Vec<Vec<f32>>) {
    let mut grads = device::alloc_grads(gpt.backend(), &gpt.cfg).unwrap();
    let (loss, _) = gpt
        .forward_backward(
            tokens,
            targets,
            G,
            &mut grads,
            per_counted(targets),
            schedule,
        )
        .unwrap();
    (loss, device::download_grads(gpt.backend(), &grads).unwrap())
}

fn relative_l2(got: &[f32], want: &[f32]) -> f64 {
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|&b| (b as f64).powi(2)).sum();
    (diff / norm.max(1e-30)).sqrt()
}

fn assert_matches_cpu(cfg: ModelConfig, opts: ModelOptions) {
    assert_matches_cpu_on(cfg, opts, &batch(&cfg));
}

fn assert_matches_cpu_on(cfg: ModelConfig, opts: ModelOptions, batch: &(Vec<u32>, Vec<u32>)) {
    let cpu_gpt = Model::new(&Cpu::new(), cfg, opts, 7).unwrap();
    let cuda_gpt = on_device(&cpu_gpt);
    let store_all = Schedule::store_all(cfg.layers).unwrap();
    let (cpu_loss, cpu_grads) = cpu_step_on(&cpu_gpt, &store_all, batch);
    let (cuda_loss, cuda_grads) = cuda_step_on(&cuda_gpt, &store_all, batch);
    let infos = params::param_infos(&cfg);
    assert_eq!(cuda_grads.len(), infos.len());
    // Every tensor's error is printed before anything is asserted: one GPU run then shows
    // every op that disagrees, not only the first.
    println!("loss: cuda {cuda_loss} vs cpu {cpu_loss}");
    let mut failures = Vec::new();
    for ((got, want), info) in cuda_grads.iter().zip(&cpu_grads).zip(&infos) {
        if got.len() != want.len() {
            failures.push(format!(
                "{}: {} values vs {}",
                info.name,
                got.len(),
                want.len()
            ));
            continue;
        }
        if want.iter().all(|&x| x == 0.0) {
            failures.push(format!("{}: the CPU gradient is all zeros", info.name));
            continue;
        }
        let err = relative_l2(got, want);
        println!("{:>24}: relative L2 error {err:.3e}", info.name);
        if err.is_nan() || err > 5e-2 {
            failures.push(format!("{}: relative L2 error {err}", info.name));
        }
    }
    assert!(cuda_loss.is_finite(), "loss {cuda_loss}");
    assert!(
        ((cuda_loss - cpu_loss) / cpu_loss).abs() < 1e-2,
        "loss: cuda {cuda_loss} vs cpu {cpu_loss}"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA device"]
fn loss_and_every_gradient_match_the_cpu_in_bf16() {
    assert_matches_cpu(cfg(), bf16());
}

#[test]
#[ignore = "needs a CUDA device"]
fn llama_with_grouped_query_attention_matches_the_cpu_in_bf16() {
    assert_matches_cpu(llama(), bf16());
}

/// Gemma 3 on the device: head norms, output norms, offset gains (the device's gains are
/// `1 + w` built beside the kernels), the GELU gate, the scaled embedding, and windowed blocks
/// with their own rotary base (a window as long as the batch: the device has no narrowed
/// masks).
#[test]
#[ignore = "needs a CUDA device"]
fn gemma3_matches_the_cpu_in_bf16() {
    use headroom_trainer::model::{LlamaClass, SlidingWindow};
    let mut cfg = llama();
    if let Family::Llama(s) = &mut cfg.family {
        s.class = LlamaClass::Gemma3;
        s.head_dim = Some(128);
        s.sliding_window = Some(SlidingWindow {
            full_every: Some(2),
            rope_theta: Some(100.0),
            ..SlidingWindow::from_layer(cfg.max_seq, 0)
        });
    }
    assert_matches_cpu(cfg, bf16());
}

/// OLMo 2 on the device: no input norms, the output norms, and the query and key norms over
/// the whole projections (rows of `heads · head_dim`), before the split into heads.
#[test]
#[ignore = "needs a CUDA device"]
fn olmo2_matches_the_cpu_in_bf16() {
    let mut cfg = llama();
    if let Family::Llama(s) = &mut cfg.family {
        s.class = headroom_trainer::model::LlamaClass::Olmo2;
    }
    assert_matches_cpu(cfg, bf16());
}

/// Granite on the device: its four scalars (the device's scale op on the embedding, each
/// residual branch and the final norm's output; the softmax scale in the flash kernels).
#[test]
#[ignore = "needs a CUDA device"]
fn granite_matches_the_cpu_in_bf16() {
    let mut cfg = llama();
    if let Family::Llama(s) = &mut cfg.family {
        s.class = headroom_trainer::model::LlamaClass::Granite;
        s.multipliers = Some(headroom_trainer::model::Multipliers {
            embedding: 12.0,
            residual: 0.22,
            attention: 0.05,
            logits_scaling: 8.0,
        });
    }
    assert_matches_cpu(cfg, bf16());
}

#[test]
#[ignore = "needs a CUDA device"]
fn chunked_head_and_selective_recomputation_match_the_cpu() {
    // 48 rows in chunks of 10: the last chunk is short.
    let opts = ModelOptions {
        loss_chunk: Some(10),
        selective: true,
        ..bf16()
    };
    assert_matches_cpu(cfg(), opts);
    assert_matches_cpu(llama(), opts);
}

#[test]
#[ignore = "needs a CUDA device"]
fn ignored_targets_match_the_cpu_whole_and_in_head_chunks() {
    for cfg in [cfg(), llama()] {
        let masked = masked_batch(&cfg);
        assert!(counted_targets(&masked.1) > 0 && counted_targets(&masked.1) < G.rows());
        assert_matches_cpu_on(cfg, bf16(), &masked);
        let chunked = ModelOptions {
            loss_chunk: Some(10),
            ..bf16()
        };
        assert_matches_cpu_on(cfg, chunked, &masked);
        // The mask is not a no-op on the device: the masked step differs from the unmasked.
        let gpt = on_device(&Model::new(&Cpu::new(), cfg, bf16(), 7).unwrap());
        let store_all = Schedule::store_all(cfg.layers).unwrap();
        let (all, _) = cuda_step(&gpt, &store_all);
        let (some, _) = cuda_step_on(&gpt, &store_all, &masked);
        assert!((all - some).abs() > 1e-4 * all.abs(), "{all} vs {some}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_batch_with_no_counted_target_has_zero_loss_and_gradient_on_the_device() {
    for cfg in [cfg(), llama()] {
        let (tokens, _) = batch(&cfg);
        let none = (tokens, vec![IGNORE_TARGET; G.rows()]);
        let masters = params::init_params(&Cpu::new(), &cfg, 7).unwrap();
        for loss_chunk in [None, Some(10)] {
            let opts = ModelOptions {
                loss_chunk,
                ..bf16()
            };
            let gpt = device::model_over_host_masters(&cuda(), cfg, opts, &masters).unwrap();
            let (loss, grads) =
                cuda_step_on(&gpt, &Schedule::store_all(cfg.layers).unwrap(), &none);
            assert_eq!(loss, 0.0);
            assert!(grads.iter().flatten().all(|&g| g == 0.0), "{loss_chunk:?}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn checkpoint_schedules_give_bitwise_the_store_all_gradients() {
    for cfg in [cfg(), llama()] {
        let masters = params::init_params(&Cpu::new(), &cfg, 3).unwrap();
        let gpt = device::model_over_host_masters(&cuda(), cfg, bf16(), &masters).unwrap();
        let (loss, grads) = cuda_step(&gpt, &Schedule::store_all(cfg.layers).unwrap());
        for schedule in [
            Schedule::every_k(cfg.layers, 2).unwrap(),
            Schedule::sqrt_n(cfg.layers).unwrap(),
        ] {
            let (l, gr) = cuda_step(&gpt, &schedule);
            assert_eq!(l.to_bits(), loss.to_bits());
            for (a, b) in gr.iter().zip(&grads) {
                assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
        }
        // The selective policy recomputes inside blocks, bit for bit too.
        let opts = ModelOptions {
            selective: true,
            ..bf16()
        };
        let selective = device::model_over_host_masters(&cuda(), cfg, opts, &masters).unwrap();
        let (l, gr) = cuda_step(&selective, &Schedule::every_k(cfg.layers, 2).unwrap());
        assert_eq!(l.to_bits(), loss.to_bits());
        assert_eq!(gr, grads);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn gradients_reach_the_host_exactly() {
    let cfg = cfg();
    let cpu = Cpu::new();
    let masters = params::init_params(&cpu, &cfg, 5).unwrap();
    let cuda = cuda();
    let gpt = device::model_over_host_masters(&cuda, cfg, bf16(), &masters).unwrap();
    let (tokens, targets) = batch(&cfg);
    let mut grads = device::alloc_grads(&cuda, &cfg).unwrap();
    let schedule = Schedule::store_all(cfg.layers).unwrap();
    let step = |grads: &mut [headroom_cuda::CudaTensor]| {
        gpt.forward_backward(&tokens, &targets, G, grads, 0.5, &schedule)
            .unwrap()
    };
    step(&mut grads);
    let once = device::download_grads(&cuda, &grads).unwrap();
    // forward_backward adds: a second pass doubles every gradient (to f32 rounding: kernels
    // that sum rows into the existing value round in another order than into zero).
    step(&mut grads);
    let twice = device::download_grads(&cuda, &grads).unwrap();
    for (a, b) in once.iter().zip(&twice) {
        let doubled: Vec<f32> = a.iter().map(|x| 2.0 * x).collect();
        assert!(relative_l2(b, &doubled) < 1e-5);
        assert!(a.iter().any(|&x| x != 0.0));
    }
    // Into host tensors: added twice onto zeros.
    let mut host = params::alloc_like_params(&cpu, &cfg, MemoryCategory::Gradients).unwrap();
    device::add_grads_into(&cuda, &grads, &mut host).unwrap();
    device::add_grads_into(&cuda, &grads, &mut host).unwrap();
    for (h, t) in host.iter().zip(&twice) {
        let h = h.as_slice::<f32>().unwrap();
        assert!(h
            .iter()
            .zip(t)
            .all(|(x, y)| x.to_bits() == (2.0 * y).to_bits()));
    }
    device::zero_grads(&cuda, &mut grads).unwrap();
    assert!(device::download_grads(&cuda, &grads)
        .unwrap()
        .iter()
        .flatten()
        .all(|&x| x == 0.0));
}

#[test]
#[ignore = "needs a CUDA device"]
fn host_masters_refresh_the_device_working_copies_bitwise() {
    let cfg = llama();
    let cpu = Cpu::new();
    let cpu_model = Model::new(&cpu, cfg, bf16(), 11).unwrap();
    let mut gpt = on_device(&cpu_model);
    // Both sides round the same masters to nearest even: the same bf16 bits.
    let mut masters = params::init_params(&cpu, &cfg, 12).unwrap();
    for m in &mut masters {
        for x in m.as_mut_slice::<f32>().unwrap() {
            *x *= 3.0;
        }
    }
    device::upload_working(&mut gpt, &masters).unwrap();
    let cpu_model = Model::from_masters(&cpu, cfg, bf16(), masters).unwrap();
    for i in 0..params::param_infos(&cfg).len() {
        let want = cpu_model.weights.working(i).unwrap();
        let got = gpt.weights.working(i).unwrap();
        let got: Vec<half::bf16> = gpt.backend().download(got).unwrap();
        assert_eq!(
            got.as_slice(),
            want.as_slice::<half::bf16>().unwrap(),
            "{i}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_alloc_hook_sees_every_activation_freed_after_backward() {
    let tracker = Arc::new(MemoryTracker::new());
    let cuda = cuda().with_alloc_hook(tracker.clone());
    let cfg = cfg();
    let masters = params::init_params(&Cpu::new(), &cfg, 1).unwrap();
    let gpt = device::model_over_host_masters(&cuda, cfg, bf16(), &masters).unwrap();
    let mut grads = device::alloc_grads(&cuda, &cfg).unwrap();
    let (tokens, targets) = batch(&cfg);
    let device = cuda.device();
    tracker.reset_peak();
    let before = tracker.snapshot().device(device).unwrap().clone();
    assert_eq!(before.live[MemoryCategory::Activations], 0);
    let (_, stats) = gpt
        .forward_backward(
            &tokens,
            &targets,
            G,
            &mut grads,
            1.0 / G.rows() as f32,
            &Schedule::store_all(cfg.layers).unwrap(),
        )
        .unwrap();
    cuda.synchronize().unwrap();
    let after = tracker.snapshot().device(device).unwrap().clone();
    // Activations existed (at least everything the executor kept) and are all gone.
    assert!(after.peak[MemoryCategory::Activations] >= stats.peak_saved_bytes);
    assert!(stats.peak_saved_bytes > 0);
    assert_eq!(after.live[MemoryCategory::Activations], 0);
    assert_eq!(after.live[MemoryCategory::Workspace], 0);
    // Parameters and gradients are what they were: nothing leaked into them, nothing freed.
    for cat in [MemoryCategory::Parameters, MemoryCategory::Gradients] {
        assert_eq!(after.live[cat], before.live[cat], "{cat:?}");
    }
    let grad_bytes: usize = grads.iter().map(|g| g.size_in_bytes()).sum();
    assert_eq!(after.live[MemoryCategory::Gradients], grad_bytes as u64);
}

#[test]
fn a_missing_device_is_a_typed_error_not_a_panic() {
    // No machine has a ten-thousandth GPU: this fails the same way everywhere, GPU or not.
    let err: CudaGptError = match Cuda::new(10_000) {
        Err(e) => e.into(),
        Ok(_) => panic!("device 10000 exists?"),
    };
    assert!(err.is_no_device(), "{err}");
    assert!(matches!(
        err,
        CudaGptError::Device(headroom_cuda::CudaError::NoDevice { .. })
    ));
    // Through the trainer's error, the chain of sources still says so.
    let train: TrainError = err.into();
    let mut chain = vec![train.to_string()];
    let mut source = std::error::Error::source(&train);
    while let Some(s) = source {
        chain.push(s.to_string());
        source = s.source();
    }
    assert!(
        chain.iter().any(|m| m.contains("no CUDA device")),
        "{chain:?}"
    );
    // On a machine without any GPU, device 0 is refused the same way.
    if headroom_cuda::device_count() == 0 {
        let err: CudaGptError = match Cuda::new(0) {
            Err(e) => e.into(),
            Ok(_) => panic!("device_count() is 0 but device 0 opened"),
        };
        assert!(err.is_no_device(), "{err}");
    }
}

#[test]
fn options_the_device_cannot_run_are_refused_before_it_is_touched() {
    // fp32 attention has no CUDA kernel: a config error, whatever the machine.
    for cfg in [cfg(), llama()] {
        let err = device::check_options(&cfg, &ModelOptions::default()).unwrap_err();
        assert!(matches!(err, TrainError::Config(_)), "{err}");
        device::check_options(&cfg, &bf16()).unwrap();
    }
}

/// A decode on the device: a prompt cached, repeated for three rows, a step of two tokens per
/// row, rows dropped, and single-token steps past the first allocation's room. Every op the
/// cache uses on the device (`write_seq`, `truncate_seq`, `concat_seq`, `select_batch`, the
/// attention over the rows in use) against the CPU model's logits.
fn assert_decoding_matches_cpu(cfg: ModelConfig) {
    let cpu_model = Model::new(&Cpu::new(), cfg, bf16(), 5).unwrap();
    let gpu_model = on_device(&cpu_model);
    let v = cfg.vocab as u32;
    let prompt: Vec<u32> = (0..7).map(|i| (i * 5 + 1) % v).collect();
    let tails: Vec<u32> = (0..6).map(|i| (i * 11 + 2) % v).collect();
    let close = |got: &[f32], want: &[f32], what: &str| {
        let err = relative_l2(got, want);
        assert!(err <= 2e-2, "{what}: relative L2 {err}");
    };
    let (mut cpu_one, mut gpu_one) = (cpu_model.kv_cache(1), gpu_model.kv_cache(1));
    let want = cpu_model.decode(&mut cpu_one, &prompt).unwrap();
    close(
        &gpu_model.decode(&mut gpu_one, &prompt).unwrap(),
        &want,
        "prompt",
    );
    let mut cpu_cache = cpu_model.repeat_cache(&cpu_one, 3).unwrap();
    let mut gpu_cache = gpu_model.repeat_cache(&gpu_one, 3).unwrap();
    let want = cpu_model.decode(&mut cpu_cache, &tails).unwrap();
    close(
        &gpu_model.decode(&mut gpu_cache, &tails).unwrap(),
        &want,
        "tails",
    );
    cpu_model.keep_rows(&mut cpu_cache, &[0, 2]).unwrap();
    gpu_model.keep_rows(&mut gpu_cache, &[0, 2]).unwrap();
    for step in 0..(cfg.max_seq - 9) as u32 {
        let next = [(step * 3 + 1) % v, (step * 7 + 4) % v];
        let want = cpu_model.decode(&mut cpu_cache, &next).unwrap();
        let got = gpu_model.decode(&mut gpu_cache, &next).unwrap();
        close(&got, &want, &format!("step {step}"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn decoding_with_a_shared_prompt_and_dropped_rows_matches_the_cpu() {
    assert_decoding_matches_cpu(cfg());
    assert_decoding_matches_cpu(llama());
}
