//! `train` on a CUDA device: the same loop, with the model on the GPU and the optimizer either
//! resident on the device (masters, accumulation, clipping, AdamW) or offloaded to the host.
//! Needs the `cuda` feature; the GPU tests are ignored without a device.

// Only the `cuda` tests run the program; without the feature the module would be dead code.
#[cfg(feature = "cuda")]
use crate::common;

use headroom_attn::AttentionConfig;
use headroom_offload::StatePrecision;
use headroom_trainer::engine::ComputeDevice;
use headroom_trainer::model::{ModelConfig, Precision};
use headroom_trainer::techniques::{OptimizerChoice, OptimizerPlacement};
use headroom_trainer::train::{train, DataSource, SyntheticData, TrainOptions};
use headroom_trainer::TrainError;

/// bf16 + flash with 64-wide heads: what the CUDA path runs.
fn cuda_ready(steps: usize) -> TrainOptions {
    let data = SyntheticData {
        vocab: 64,
        branching: 4,
        tokens: 1 << 16,
        seed: 9,
    };
    let mut o = TrainOptions {
        model: ModelConfig {
            vocab: 64,
            max_seq: 64,
            layers: 2,
            heads: 2,
            channels: 128,
            family: headroom_trainer::model::Family::Gpt2,
        },
        data: DataSource::Synthetic(data),
        steps,
        batch: 8,
        seq: 64,
        ..TrainOptions::tiny_default()
    };
    o.techniques.model.precision = Precision::Bf16;
    o.techniques.model.attention = AttentionConfig::flash();
    o
}

/// An error and its sources, lower-cased, joined by " / ".
fn error_chain(err: &TrainError) -> String {
    let mut chain = vec![err.to_string()];
    let mut s = std::error::Error::source(err);
    while let Some(e) = s {
        chain.push(e.to_string());
        s = e.source();
    }
    chain.join(" / ").to_lowercase()
}

#[test]
fn a_cuda_run_without_a_gpu_is_a_typed_error() {
    if headroom_cuda::Cuda::new(0).is_ok() {
        eprintln!("a CUDA device is present: this test is about machines without one");
        return;
    }
    let o = TrainOptions {
        device: ComputeDevice::Cuda { ordinal: 0 },
        ..cuda_ready(1)
    };
    let err = train(&o, |_| {}).unwrap_err();
    let text = error_chain(&err);
    assert!(
        text.contains("no cuda device") || text.contains("without its `cuda` feature"),
        "{text}"
    );
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_training_tracks_the_cpu_run_and_reports_device_memory() {
    use headroom_trainer::techniques::CheckpointChoice;
    let cpu = train(&cuda_ready(30), |_| {}).unwrap();
    let mut o = cuda_ready(30);
    o.device = ComputeDevice::Cuda { ordinal: 0 };
    o.techniques.checkpoint = CheckpointChoice::SqrtN;
    let gpu = train(&o, |_| {}).unwrap();
    // Same data, same init, bf16 on both sides but different kernels and summation orders:
    // the first loss agrees closely, the trajectories stay within a few percent.
    let (c0, g0) = (cpu.steps[0].loss, gpu.steps[0].loss);
    assert!((c0 - g0).abs() <= 1e-2 * c0, "first loss {g0} vs CPU {c0}");
    let (c, g) = (cpu.final_loss(5), gpu.final_loss(5));
    assert!((c - g).abs() <= 0.05 * c, "final loss {g} vs CPU {c}");
    assert!(
        g < f64::from(g0) * 0.8,
        "the CUDA run did not learn: {g0} -> {g}"
    );
    let dev = gpu
        .memory
        .device(headroom_tensor::Device::Cuda(0))
        .expect("device allocations are tracked");
    assert!(dev.peak[headroom_tensor::MemoryCategory::Activations] > 0);
    assert!(dev.peak[headroom_tensor::MemoryCategory::Gradients] > 0);
}

/// A masked token file (its sequences' first halves are prompt, and a stretch of whole windows
/// has no counted target), trained on the GPU with two micro-batches per step, tracks the same
/// masked run on the CPU; skipped steps are skipped on both.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn a_loss_masked_cuda_run_tracks_the_cpu_run_and_skips_the_same_steps() {
    use headroom_mmap_data::{formats, loss_mask_path, write_loss_mask};
    use headroom_mmap_data::{TokenFileFormat, TokenType};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sft.bin");
    let n = 1 << 15;
    // Prompts are noise, completions a quadratic sequence: a loss over the prompts too would
    // sit near ln 64, the completions' falls.
    let tokens: Vec<u32> = (0..n as u32)
        .map(|i| match i % 64 >= 32 {
            true => (i * i + 3 * i) % 64,
            false => i.wrapping_mul(2_654_435_761) >> 26,
        })
        .collect();
    formats::write_tokens(&path, &tokens, TokenFileFormat::Raw(TokenType::U16)).unwrap();
    // Only the last quarter's second halves of 64 count: a shuffled batch of 8 windows holds
    // no counted target one time in ten, a micro-batch of 2 one time in two.
    let flags: Vec<bool> = (0..n).map(|i| i / 8192 == 3 && i % 64 >= 32).collect();
    write_loss_mask(loss_mask_path(&path), &flags).unwrap();
    let options = || {
        let mut o = cuda_ready(12);
        o.data = DataSource::File(path.clone());
        o.check_machine_memory = false;
        o.techniques.micro_batch = Some(4);
        o
    };
    let cpu = train(&options(), |_| {}).unwrap();
    let mut o = options();
    o.device = ComputeDevice::Cuda { ordinal: 0 };
    let gpu = train(&o, |_| {}).unwrap();
    assert_eq!(cpu.steps.len(), gpu.steps.len());
    let counted = |r: &headroom_trainer::train::TrainReport| -> Vec<u64> {
        r.steps.iter().map(|s| s.counted_targets).collect()
    };
    assert_eq!(counted(&cpu), counted(&gpu));
    for (c, g) in cpu.steps.iter().zip(&gpu.steps) {
        println!("step {}: cpu {} cuda {}", c.step, c.loss, g.loss);
        assert_eq!(c.applied, g.applied, "step {}", c.step);
        assert_eq!(g.applied, g.counted_targets > 0, "{g:?}");
    }
    assert!(gpu.steps.iter().any(|s| !s.applied), "{:?}", counted(&gpu));
    let first = gpu.steps.iter().position(|s| s.applied).unwrap();
    let (c1, g1) = (cpu.steps[first].loss, gpu.steps[first].loss);
    assert!(
        (c1 - g1).abs() <= 1e-2 * c1,
        "first counted loss {g1} vs CPU {c1}"
    );
    let (c, g) = (cpu.final_loss(5), gpu.final_loss(5));
    assert!((c - g).abs() <= 0.05 * c, "final loss {g} vs CPU {c}");
    assert!(
        g < f64::from(g1) * 0.8,
        "the CUDA run did not learn: {g1} -> {g}"
    );
}

/// `--zero` on CUDA without a GPU (or without the `cuda` feature): every rank stops with the
/// typed error, none hangs waiting for the others; and what the CUDA model cannot run (fp32)
/// is refused before any rank starts.
#[test]
fn zero_ranks_on_cuda_without_a_gpu_are_a_typed_error() {
    use headroom_trainer::zero_train::{train_zero, ZeroOptions};
    if headroom_cuda::Cuda::new(0).is_ok() {
        eprintln!("a CUDA device is present: this test is about machines without one");
        return;
    }
    let o = TrainOptions {
        device: ComputeDevice::Cuda { ordinal: 0 },
        ..cuda_ready(1)
    };
    let zero = ZeroOptions::new(headroom_zero::Stage::Zero3, 2);
    let err = train_zero(&o, zero, |_| {}).unwrap_err();
    let text = error_chain(&err);
    assert!(
        text.contains("no cuda device") || text.contains("without its `cuda` feature"),
        "{text}"
    );
    let mut fp32 = o.clone();
    fp32.techniques.model.precision = Precision::Fp32;
    let e = train_zero(&fp32, zero, |_| {}).unwrap_err();
    assert!(matches!(&e, TrainError::Config(_)), "{e}");
}

/// ZeRO ranks whose model runs on the GPU (the engine, its shards and the collectives stay in
/// host memory): stage 3 on 2 in-process ranks tracks the same run on CPU ranks (same data,
/// init and host AdamW; the model's kernels differ, so within a tolerance), equals stage 0 on
/// the GPU, and each rank's device holds no parameter, gradient or optimizer shard — only the
/// gathered parts it is using, their gradients and the activations.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn zero_ranks_on_cuda_track_cpu_ranks_and_keep_shards_on_the_host() {
    use headroom_tensor::MemoryCategory;
    use headroom_trainer::zero_train::{train_zero, ZeroOptions};
    use headroom_zero::Stage;
    let mut o = cuda_ready(12);
    o.grad_clip = f64::INFINITY;
    o.techniques.micro_batch = Some(2);
    o.techniques.checkpoint = headroom_trainer::techniques::CheckpointChoice::EveryK(1);
    let cpu = train_zero(&o, ZeroOptions::new(Stage::Zero3, 2), |_| {}).unwrap();
    o.device = ComputeDevice::Cuda { ordinal: 0 };
    let gpu3 = train_zero(&o, ZeroOptions::new(Stage::Zero3, 2), |_| {}).unwrap();
    let gpu0 = train_zero(&o, ZeroOptions::new(Stage::Zero0, 2), |_| {}).unwrap();
    let (c0, g0) = (cpu.steps[0].loss, gpu3.steps[0].loss);
    assert!(
        (c0 - g0).abs() <= 1e-2 * c0,
        "first loss {g0} vs CPU ranks {c0}"
    );
    let last = |r: &headroom_trainer::zero_train::ZeroReport| r.steps.last().unwrap().loss;
    let (c, g) = (last(&cpu), last(&gpu3));
    assert!((c - g).abs() <= 0.05 * c, "last loss {g} vs CPU ranks {c}");
    assert!(g < g0 * 0.9, "the GPU ranks did not learn: {g0} -> {g}");
    // Stages differ only in what is sharded: the same model inputs, the same reductions.
    for (a, b) in gpu3.steps.iter().zip(&gpu0.steps) {
        assert!(
            (a.loss - b.loss).abs() <= 1e-3 * b.loss,
            "step {}: stage 3 {} vs stage 0 {}",
            a.step,
            a.loss,
            b.loss
        );
    }
    for r in &gpu3.ranks {
        let dev = r
            .memory
            .devices
            .first()
            .expect("device allocations are tracked");
        assert!(matches!(dev.device, headroom_tensor::Device::Cuda(_)));
        assert_eq!(dev.peak[MemoryCategory::OptimizerState], 0);
        assert!(dev.peak[MemoryCategory::Activations] > 0);
        let host = r
            .host_memory
            .device(headroom_tensor::Device::Cpu)
            .expect("the engine is on the host");
        assert!(host.peak[MemoryCategory::OptimizerState] > 0);
        assert!(host.peak[MemoryCategory::Parameters] > 0);
    }
}

/// The resident placement's refusals come before any device work, so they are the same typed
/// configuration error with or without a GPU (and without the `cuda` feature).
#[test]
fn resident_cuda_refuses_8_bit_state_and_fp16_with_a_config_error() {
    let mut int8 = TrainOptions {
        device: ComputeDevice::Cuda { ordinal: 0 },
        ..cuda_ready(1)
    };
    int8.techniques.optimizer = OptimizerChoice {
        state: StatePrecision::Float8,
        placement: OptimizerPlacement::Resident,
    };
    let e = train(&int8, |_| {}).unwrap_err();
    assert!(
        matches!(&e, TrainError::Config(m) if m.contains("8-bit")),
        "{e}"
    );
    let mut fp16 = TrainOptions {
        device: ComputeDevice::Cuda { ordinal: 0 },
        ..cuda_ready(1)
    };
    fp16.techniques.model.precision = Precision::Fp16;
    let e = train(&fp16, |_| {}).unwrap_err();
    assert!(
        matches!(&e, TrainError::Config(m) if m.contains("fp16")),
        "{e}"
    );
}

#[cfg(feature = "cuda")]
mod on_the_device {
    use super::*;
    use headroom_tensor::{Device, MemoryCategory};
    use headroom_trainer::estimate::cuda_parameter_state;
    use headroom_trainer::model::params;
    use headroom_trainer::train::TrainReport;

    fn on_cuda(steps: usize, placement: OptimizerPlacement) -> TrainOptions {
        let mut o = TrainOptions {
            device: ComputeDevice::Cuda { ordinal: 0 },
            ..cuda_ready(steps)
        };
        o.techniques.optimizer.placement = placement;
        o
    }

    fn parameter_count(o: &TrainOptions) -> u64 {
        params::param_infos(&o.model)
            .iter()
            .map(|i| i.shape.iter().product::<usize>() as u64)
            .sum()
    }

    fn peak(r: &TrainReport, host: bool, c: MemoryCategory) -> u64 {
        let snap = if host { &r.host_memory } else { &r.memory };
        let d = if host { Device::Cpu } else { Device::Cuda(0) };
        snap.device(d).map_or(0, |s| s.peak[c])
    }

    /// Relative difference.
    fn rel(a: f64, b: f64) -> f64 {
        (a - b).abs() / a.abs().max(b.abs()).max(1e-30)
    }

    /// Why these agree (and when bitwise): both paths run the same forward/backward into
    /// zeroed f32 gradients (one micro-batch a step: the host adds them to a zeroed buffer,
    /// `0 + g = g`), clip with headroom-accum's one formula (the global norm's per-tensor f64
    /// sums come from different reductions, so the f32 coefficient can differ only when
    /// `max_norm / norm` lies within ~1e-15 of an f32 rounding boundary), and step with AdamW
    /// kernels that are bitwise the CPU reference, writing the same round-to-nearest bf16
    /// working copies. With deterministic kernels the losses are therefore bitwise equal;
    /// the device's backward may sum with atomics (run-to-run noise at the f32 ulp), so the
    /// test allows 1e-6 on the first loss (forward only) and 2e-3 after 12 steps of drift.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn resident_and_offloaded_cuda_runs_give_the_same_losses() {
        let resident = train(&on_cuda(12, OptimizerPlacement::Resident), |_| {}).unwrap();
        let offloaded = train(&on_cuda(12, OptimizerPlacement::HostRam), |_| {}).unwrap();
        let bitwise = resident
            .steps
            .iter()
            .zip(&offloaded.steps)
            .all(|(a, b)| a.loss.to_bits() == b.loss.to_bits());
        eprintln!("resident vs offloaded losses bitwise equal: {bitwise}");
        for (r, h) in resident.steps.iter().zip(&offloaded.steps) {
            let tol = if r.step == 0 { 1e-6 } else { 2e-3 };
            assert!(
                rel(r.loss.into(), h.loss.into()) <= tol,
                "step {}: resident {} vs offloaded {}",
                r.step,
                r.loss,
                h.loss
            );
            assert!(
                rel(r.grad_norm, h.grad_norm) <= 10.0 * tol,
                "step {}",
                r.step
            );
            assert!(r.applied && h.applied);
        }
        assert_eq!(resident.steps.len(), 12);
        assert!(resident.final_loss(3) < f64::from(resident.steps[0].loss));
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn the_tracker_shows_optimizer_state_on_the_device_only_when_resident() {
        let o = on_cuda(2, OptimizerPlacement::Resident);
        let p = parameter_count(&o);
        let resident = train(&o, |_| {}).unwrap();
        let offloaded = train(&on_cuda(2, OptimizerPlacement::HostRam), |_| {}).unwrap();
        // Resident: f32 m and v (8 bytes a parameter) on the device, none on the host; the
        // accumulator's f32 gradients and the fp32 masters on the device too.
        let opt = MemoryCategory::OptimizerState;
        assert_eq!(peak(&resident, false, opt), 8 * p);
        assert_eq!(peak(&resident, true, opt), 0);
        assert!(peak(&resident, false, MemoryCategory::Gradients) >= 4 * p);
        assert_eq!(peak(&resident, true, MemoryCategory::Gradients), 0);
        // Masters (4 bytes) plus at least the bf16 GEMM working copies.
        assert!(peak(&resident, false, MemoryCategory::Parameters) > 4 * p);
        // Offloaded: the moments and the accumulated gradients are on the host only.
        assert_eq!(peak(&offloaded, false, opt), 0);
        assert_eq!(peak(&offloaded, true, opt), 8 * p);
        assert_eq!(peak(&offloaded, true, MemoryCategory::Gradients), 4 * p);
        assert!(
            peak(&offloaded, false, MemoryCategory::Parameters)
                < peak(&resident, false, MemoryCategory::Parameters),
            "the offloaded run keeps no fp32 masters on the device"
        );
        // And the estimator predicts every parameter-state peak on both ledgers exactly.
        for (report, placement) in [
            (&resident, OptimizerPlacement::Resident),
            (&offloaded, OptimizerPlacement::HostRam),
        ] {
            let opts = on_cuda(2, placement.clone());
            let est = cuda_parameter_state(&opts.model, &opts.techniques).unwrap();
            for c in [
                MemoryCategory::Parameters,
                MemoryCategory::Gradients,
                MemoryCategory::OptimizerState,
            ] {
                assert_eq!(
                    peak(report, false, c),
                    est.device[c],
                    "{placement:?} device {c:?}"
                );
                assert_eq!(
                    peak(report, true, c),
                    est.host[c],
                    "{placement:?} host {c:?}"
                );
            }
        }
    }

    /// A resident run checkpointed after 3 steps resumes — resident or offloaded, since both
    /// save the host optimizer's format — and follows the uninterrupted run.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_resident_checkpoint_resumes_on_either_placement() {
        let whole = train(&on_cuda(6, OptimizerPlacement::Resident), |_| {}).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let first = TrainOptions {
            save: Some((dir.path().to_path_buf(), 3)),
            stop_after: Some(3),
            ..on_cuda(6, OptimizerPlacement::Resident)
        };
        assert_eq!(train(&first, |_| {}).unwrap().steps.len(), 3);
        let ck = headroom_trainer::checkpoint::load(dir.path()).unwrap();
        assert_eq!(ck.state.step, 3);
        assert_eq!(ck.state.optimizer.steps, vec![3; ck.params.len()]);
        assert_eq!(ck.moments.len() as u64, 8 * parameter_count(&first));
        for placement in [OptimizerPlacement::Resident, OptimizerPlacement::HostRam] {
            let resumed = TrainOptions {
                resume_from: Some(dir.path().to_path_buf()),
                ..on_cuda(6, placement.clone())
            };
            let rest = train(&resumed, |_| {}).unwrap();
            assert_eq!(rest.steps.first().map(|s| s.step), Some(3));
            for (r, w) in rest.steps.iter().zip(&whole.steps[3..]) {
                assert!(
                    rel(r.loss.into(), w.loss.into()) <= 2e-3,
                    "{placement:?} step {}: {} vs {}",
                    r.step,
                    r.loss,
                    w.loss
                );
            }
        }
    }

    /// The device step's pieces against the host's, bit for bit: one AdamW step of every
    /// parameter from the same (device-computed) gradients gives the same masters and moments
    /// as `CpuAdamW`, and leaves the working weights exactly as uploading the host's updated
    /// masters would (same loss bits); re-deriving them from the device masters changes
    /// nothing.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn the_device_adamw_step_is_the_host_step_bit_for_bit() {
        use headroom_ckpt::Schedule;
        use headroom_cuda::Cuda;
        use headroom_cuda::{AdamWStep, CudaTensor};
        use headroom_offload::{AdamWHyper, CpuAdamW, ParamSpec, StoreSpec};
        use headroom_tensor::cpu::kernels::FloatSlice;
        use headroom_tensor::{Backend, Cpu};
        use headroom_trainer::cuda as device;
        use headroom_trainer::model::{Geometry, Model, ModelOptions};

        let o = cuda_ready(1);
        let cfg = o.model;
        let opts = ModelOptions {
            precision: Precision::Bf16,
            attention: AttentionConfig::flash(),
            ..Default::default()
        };
        let cpu = Cpu::new();
        let mut host_masters = params::init_params(&cpu, &cfg, 5).unwrap();
        let cuda = Cuda::new(0).unwrap();
        let mut gpt = device::model_over_device_masters(&cuda, cfg, opts, &host_masters).unwrap();
        let g = Geometry::new(2, 32);
        let tokens: Vec<u32> = (0..64u32).map(|i| (i * 7 + 3) % 64).collect();
        let targets: Vec<u32> = (0..64u32).map(|i| (i * 13 + 5) % 64).collect();
        let schedule = Schedule::store_all(cfg.layers).unwrap();
        let loss_of = |gpt: &Model<Cuda>| {
            let mut grads = device::alloc_grads(&cuda, &cfg).unwrap();
            let (loss, _) = gpt
                .forward_backward(&tokens, &targets, g, &mut grads, 1.0 / 64.0, &schedule)
                .unwrap();
            (loss, grads)
        };
        let (_, grads) = loss_of(&gpt);
        let host_grads = device::download_grads(&cuda, &grads).unwrap();

        let infos = params::param_infos(&cfg);
        let specs: Vec<ParamSpec> = infos
            .iter()
            .map(|i| ParamSpec {
                numel: i.shape.iter().product(),
                group: if i.shape.len() >= 2 { 0 } else { 1 },
            })
            .collect();
        let groups = vec![
            AdamWHyper {
                lr: 1e-2,
                weight_decay: 0.1,
                beta2: 0.95,
                ..Default::default()
            },
            AdamWHyper {
                lr: 1e-2,
                weight_decay: 0.0,
                beta2: 0.95,
                ..Default::default()
            },
        ];
        let mut opt = CpuAdamW::new(
            groups.clone(),
            &specs,
            StatePrecision::F32,
            StoreSpec::Ram(&cpu),
        )
        .unwrap();
        let zeros = || -> Vec<CudaTensor> {
            infos
                .iter()
                .map(|i| {
                    cuda.zeros(i.shape.clone(), headroom_tensor::DType::F32)
                        .unwrap()
                })
                .collect()
        };
        let (mut m, mut v) = (zeros(), zeros());
        // Two steps, so the bias corrections of step 2 are covered too.
        for t in 1..=2u64 {
            for (i, spec) in specs.iter().enumerate() {
                let h = groups[spec.group];
                opt.step(
                    i,
                    host_masters[i].as_mut_slice::<f32>().unwrap(),
                    FloatSlice::F32(&host_grads[i]),
                    None,
                )
                .unwrap();
                let s = AdamWStep::new(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, t);
                device::adamw_step_parameter(&mut gpt, i, &s, &grads[i], &mut m[i], &mut v[i])
                    .unwrap();
            }
        }
        gpt.refresh_working().unwrap();
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let numel: usize = specs.iter().map(|p| p.numel).sum();
        let host_moments: Vec<f32> = opt
            .moments()
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut at = 0;
        for i in 0..specs.len() {
            let n = specs[i].numel;
            let dm = cuda.download::<f32>(&gpt.masters()[i]).unwrap();
            assert_eq!(
                bits(&dm),
                bits(host_masters[i].as_slice::<f32>().unwrap()),
                "master {i}"
            );
            let dmi = cuda.download::<f32>(&m[i]).unwrap();
            let dvi = cuda.download::<f32>(&v[i]).unwrap();
            assert_eq!(bits(&dmi), bits(&host_moments[at..at + n]), "m {i}");
            assert_eq!(
                bits(&dvi),
                bits(&host_moments[numel + at..numel + at + n]),
                "v {i}"
            );
            at += n;
        }
        // The refreshed working weights are the host masters' rounding: the same loss as a
        // model whose working copies were uploaded from the host.
        let (stepped, _) = loss_of(&gpt);
        let uploaded = device::model_over_host_masters(&cuda, cfg, opts, &host_masters).unwrap();
        let (reference, _) = loss_of(&uploaded);
        assert_eq!(stepped.to_bits(), reference.to_bits());
    }
}

/// `headroom train --zero 3 --device cuda --dist nccl` as two processes (torchrun's
/// variables, one GPU each) gives the losses of the same run with two in-process ranks, bit
/// for bit: NCCL only moves bytes, the sums are taken on the host in rank order. Needs two
/// GPUs (NCCL refuses two ranks on one).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs two CUDA devices"]
fn nccl_processes_equal_in_process_ranks() {
    assert!(headroom_cuda::device_count() >= 2, "needs two GPUs");
    let dir = tempfile::tempdir().unwrap();
    let base = [
        "train",
        "--model",
        "tiny",
        "--channels",
        "128",
        "--heads",
        "2",
        "--precision",
        "bf16",
        "--attention",
        "flash",
        "--device",
        "cuda",
        "--zero",
        "3",
        "--steps",
        "6",
        "--batch",
        "8",
        "--no-progress",
    ];
    let losses = |metrics: &std::path::Path| -> Vec<String> {
        std::fs::read_to_string(metrics)
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["loss"].to_string()
            })
            .collect()
    };
    let threads = dir.path().join("threads.jsonl");
    let o = common::headroom_command()
        .args(base)
        .args(["--ranks", "2", "--metrics", threads.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = dir.path().join("nccl-id");
    let nccl = dir.path().join("nccl.jsonl");
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            common::headroom_command()
                .args(base)
                .args(["--dist", "nccl", "--nccl-id-file", id.to_str().unwrap()])
                .args(["--metrics", nccl.to_str().unwrap()])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", r.to_string())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut r in ranks {
        assert!(r.wait().unwrap().success());
    }
    assert!(!id.exists(), "rank 0 removes the id");
    assert_eq!(losses(&nccl), losses(&threads));
}
