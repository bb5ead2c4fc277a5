//! `train` on a CUDA device: the same loop (host masters, accumulation, clipping, AdamW), with
//! the model on the GPU. Needs the `cuda` feature; the GPU test is ignored without a device.

use headroom_attn::AttentionConfig;
use headroom_trainer::engine::ComputeDevice;
use headroom_trainer::model::{GptConfig, Precision};
use headroom_trainer::train::{train, DataSource, SyntheticData, TrainOptions};

/// bf16 + flash with 64-wide heads: what the CUDA path runs.
fn cuda_ready(steps: usize) -> TrainOptions {
    let data = SyntheticData {
        vocab: 64,
        branching: 4,
        tokens: 1 << 16,
        seed: 9,
    };
    let mut o = TrainOptions {
        model: GptConfig {
            vocab: 64,
            max_seq: 64,
            layers: 2,
            heads: 2,
            channels: 128,
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
    let mut chain = vec![err.to_string()];
    let mut s = std::error::Error::source(&err);
    while let Some(e) = s {
        chain.push(e.to_string());
        s = e.source();
    }
    let text = chain.join(" / ").to_lowercase();
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
