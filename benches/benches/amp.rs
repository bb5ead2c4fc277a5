//! headroom-amp: the two memory-bound kernels of a mixed-precision step, each beside a plain
//! `copy_from_slice` of the same 64 MiB of f32 in the same run, plus the parameter memory of
//! each precision preset (a non-timing record).
//!
//! Throughput counts bytes read + written: unscale reads and writes 64 MiB in place; the
//! stochastic-rounding cast reads 64 MiB of f32 and writes 32 MiB of bf16; the copy reads and
//! writes 64 MiB.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use headroom_amp::{
    AmpBackend, AutocastPreset, LossScaler, LossScalerConfig, MasterWeights, MasterWeightsConfig,
    RoundingKey,
};
use headroom_benches::{record, size_label, Better, Record};
use headroom_tensor::{Backend, Cpu, DType};

const SOURCE_BYTES: usize = 64 << 20;

fn source() -> Vec<f32> {
    (0..SOURCE_BYTES / 4)
        .map(|i| ((i % 4099) as f32 - 2049.0) * 0.013)
        .collect()
}

fn baseline_copy(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    src: &[f32],
) {
    let mut dst = vec![0f32; src.len()];
    group.throughput(Throughput::Bytes(2 * SOURCE_BYTES as u64));
    group.bench_function(
        BenchmarkId::new("baseline_copy_from_slice", size_label(SOURCE_BYTES)),
        |b| {
            b.iter(|| {
                dst.copy_from_slice(black_box(src));
                black_box(&mut dst);
            })
        },
    );
}

fn unscale_and_check(c: &mut Criterion) {
    let cpu = Cpu::new();
    let host = source();
    let mut grads = cpu.upload(&host, [host.len()]).expect("upload");
    // Scale 1: the same gradients are unscaled on every iteration, and any other factor would
    // drift them into subnormals and time the FPU's slow path instead of memory.
    let config = LossScalerConfig {
        init_scale: 1.0,
        growth_interval: u32::MAX,
        ..Default::default()
    };
    let mut scaler = LossScaler::new(config).expect("scaler");
    let mut group = c.benchmark_group("amp/unscale_and_check");
    group.throughput(Throughput::Bytes(2 * SOURCE_BYTES as u64));
    group.bench_function(
        BenchmarkId::new("headroom", size_label(SOURCE_BYTES)),
        |b| {
            b.iter(|| {
                let decision = scaler.unscale(&cpu, &mut [&mut grads]).expect("unscale");
                scaler.update().expect("update");
                black_box(decision)
            })
        },
    );
    baseline_copy(&mut group, &host);
    group.finish();
}

fn stochastic_round_bf16(c: &mut Criterion) {
    let cpu = Cpu::new();
    let host = source();
    let src = cpu.upload(&host, [host.len()]).expect("upload");
    let mut dst = cpu.zeros([host.len()], DType::BF16).expect("alloc");
    let mut group = c.benchmark_group("amp/stochastic_round_bf16");
    group.throughput(Throughput::Bytes((SOURCE_BYTES + SOURCE_BYTES / 2) as u64));
    let mut step = 0u64;
    group.bench_function(
        BenchmarkId::new("headroom", size_label(SOURCE_BYTES)),
        |b| {
            b.iter(|| {
                step += 1;
                let key = RoundingKey {
                    seed: 1234,
                    step,
                    tensor: 0,
                };
                cpu.stochastic_round_bf16(&src, &mut dst, key)
                    .expect("round");
                black_box(&mut dst);
            })
        },
    );
    baseline_copy(&mut group, &host);
    group.finish();
}

/// Bytes per parameter of masters + working copies for each preset, from the allocated
/// tensors, next to the fp32 preset.
fn parameter_memory(_c: &mut Criterion) {
    let cpu = Cpu::new();
    let shapes: [&[usize]; 3] = [&[768, 3072], &[3072], &[50257, 768]];
    let data: Vec<Vec<f32>> = shapes
        .iter()
        .map(|s| vec![0.0; s.iter().product()])
        .collect();
    let per_param = |preset| {
        let weights = MasterWeights::upload(
            &cpu,
            shapes
                .iter()
                .zip(&data)
                .map(|(s, d)| (s.to_vec(), d.as_slice())),
            MasterWeightsConfig::preset(preset),
        )
        .expect("upload");
        weights.memory().bytes_per_param()
    };
    let fp32 = per_param(AutocastPreset::Fp32);
    for (name, preset) in [
        ("fp32", AutocastPreset::Fp32),
        ("bf16", AutocastPreset::Bf16),
        ("fp16", AutocastPreset::Fp16),
    ] {
        let value = per_param(preset);
        let r = Record {
            bench: format!("amp/parameter_memory/{name}"),
            metric: "bytes_per_param".into(),
            value,
            unit: "bytes".into(),
            baseline: Some("amp/parameter_memory/fp32".into()),
            baseline_value: Some(fp32),
            ratio: Some(value / fp32),
            better: Better::Lower,
        };
        if let Err(e) = record(&r) {
            eprintln!("could not record {}: {e}", r.bench);
        }
    }
}

criterion_group!(
    benches,
    unscale_and_check,
    stochastic_round_bf16,
    parameter_memory
);
criterion_main!(benches);
