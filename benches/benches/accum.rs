//! headroom-accum: the cost of accumulation and of the end-of-step hygiene, each next to the
//! bare backend primitives it is built from (so the ratio is the crate's own overhead:
//! validation, phase tracking, token checks).
//!
//! - `accum/accumulate_f32`, `accum/accumulate_bf16`: add one micro-batch of gradients (8
//!   tensors) into the f32 buffers with weight `1/total`; baseline `baseline_axpy` calls
//!   `Backend::axpy` on the same tensors.
//! - `accum/step_overhead`: `begin_step` (zeroing the last step's buffers) + `finish_step`
//!   (unscale-and-check, f64 global norm, clip); baseline `baseline_primitives` runs the same
//!   zero/unscale/norm/scale passes by hand.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use headroom_accum::{GradAccumulator, GradUnscaler, MicroBatchStats, StaticLossScale, StepTokens};
use headroom_benches::size_label;
use headroom_tensor::{Backend, Cpu, CpuTensor, DType};

const TENSORS: usize = 8;
/// Total f32 gradient bytes per case.
const SIZES: [usize; 2] = [4 << 20, 32 << 20];

fn shapes(total_bytes: usize) -> Vec<[usize; 1]> {
    vec![[total_bytes / 4 / TENSORS]; TENSORS]
}

fn gradients(cpu: &Cpu, total_bytes: usize, dtype: DType) -> Vec<CpuTensor> {
    shapes(total_bytes)
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let data: Vec<f32> = (0..s[0])
                .map(|j| ((i * 31 + j) % 97) as f32 * 1e-3)
                .collect();
            let g = cpu.upload(&data, s).unwrap();
            let mut out = cpu.zeros(s, dtype).unwrap();
            cpu.cast(&g, &mut out).unwrap();
            out
        })
        .collect()
}

fn accumulate(c: &mut Criterion) {
    let cpu = Cpu::new();
    for (dtype, group_name) in [
        (DType::F32, "accum/accumulate_f32"),
        (DType::BF16, "accum/accumulate_bf16"),
    ] {
        let mut group = c.benchmark_group(group_name);
        group.sample_size(20);
        for bytes in SIZES {
            let grads = gradients(&cpu, bytes, dtype);
            let label = size_label(bytes);
            group.throughput(Throughput::Bytes(
                (bytes / 4 * dtype.size_in_bytes()) as u64,
            ));

            let mut acc = GradAccumulator::new(cpu.clone(), shapes(bytes)).unwrap();
            acc.begin_step(StepTokens::single_device(1).unwrap())
                .unwrap();
            // Micro-batches counting no tokens keep the step open for any number of iterations.
            let stats = MicroBatchStats {
                counted_tokens: 0,
                loss_sum: 0.0,
            };
            group.bench_function(BenchmarkId::new("headroom", &label), |b| {
                b.iter(|| acc.accumulate(black_box(&grads), stats).unwrap())
            });

            let mut buffers: Vec<CpuTensor> = shapes(bytes)
                .into_iter()
                .map(|s| cpu.zeros(s, DType::F32).unwrap())
                .collect();
            group.bench_function(BenchmarkId::new("baseline_axpy", &label), |b| {
                b.iter(|| {
                    for (g, y) in black_box(&grads).iter().zip(&mut buffers) {
                        cpu.axpy(0.5, g, y).unwrap();
                    }
                })
            });
        }
        group.finish();
    }
}

fn step_overhead(c: &mut Criterion) {
    let cpu = Cpu::new();
    let mut group = c.benchmark_group("accum/step_overhead");
    group.sample_size(20);
    for bytes in SIZES {
        let label = size_label(bytes);
        group.throughput(Throughput::Bytes(bytes as u64));
        let grads = gradients(&cpu, bytes, DType::F32);

        let mut acc = GradAccumulator::new(cpu.clone(), shapes(bytes)).unwrap();
        let mut scaler = StaticLossScale::new(1024.0).unwrap();
        group.bench_function(BenchmarkId::new("headroom", &label), |b| {
            b.iter(|| {
                acc.begin_step(StepTokens::single_device(1).unwrap())
                    .unwrap();
                acc.accumulate_in_place(
                    MicroBatchStats {
                        counted_tokens: 1,
                        loss_sum: 1.0,
                    },
                    |_, _, _| Ok::<_, std::convert::Infallible>(()),
                )
                .unwrap();
                black_box(acc.finish_step(&mut scaler, Some(1e-3)).unwrap())
            })
        });

        let mut buffers = grads;
        group.bench_function(BenchmarkId::new("baseline_primitives", &label), |b| {
            b.iter(|| {
                for g in &mut buffers {
                    cpu.fill_zero(g).unwrap();
                }
                let found = GradUnscaler::<Cpu>::unscale_and_check(&mut scaler, &cpu, &mut buffers)
                    .unwrap();
                let norm: f64 = buffers
                    .iter()
                    .map(|g| cpu.sum_squares(g).unwrap())
                    .sum::<f64>()
                    .sqrt();
                if !found && norm > 1e-3 {
                    let coef = (1e-3 / norm) as f32;
                    for g in &mut buffers {
                        cpu.scale(g, coef).unwrap();
                    }
                }
                black_box(norm)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, accumulate, step_overhead);
criterion_main!(benches);
