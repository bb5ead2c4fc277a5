//! CPU AdamW throughput (parameters per second) at 10M and 50M parameters.
//!
//! Group `offload/adamw`: `headroom_f32` (f32 moments), `headroom_int8` (8-bit moments) and
//! `baseline_bandwidth_28B`, a threaded pass that moves exactly AdamW's 28 bytes per parameter
//! (reads param, grad, m, v; writes param, m, v) with trivial arithmetic: the memory-bandwidth
//! bound measured in the same run. `headroom_f32 / baseline` is the fraction of that bound.
//!
//! Outside criterion, a short timing of `headroom_f32` is recorded against PyTorch's fused
//! AdamW (`benches/torch/offload_adam.py`, same sizes); xtask fills in the ratio when torch ran.

use std::hint::black_box;
use std::time::Instant;

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use headroom_benches::{record, Better, Record};
use headroom_offload::{AdamWHyper, CpuAdamW, ParamSpec, StatePrecision, StoreSpec};
use headroom_tensor::cpu::kernels::FloatSlice;
use headroom_tensor::Cpu;
use rayon::prelude::*;

const SIZES: [(usize, &str); 2] = [(10_000_000, "10M"), (50_000_000, "50M")];

fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            ((s >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

fn optimizer(cpu: &Cpu, n: usize, precision: StatePrecision) -> CpuAdamW {
    CpuAdamW::new(
        vec![AdamWHyper::default()],
        &[ParamSpec { numel: n, group: 0 }],
        precision,
        StoreSpec::Ram(cpu),
    )
    .expect("optimizer")
}

/// Reads p, g, m, v and writes p, m, v: the bytes AdamW must move, with no real arithmetic.
fn bandwidth_pass(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    const CHUNK: usize = 1 << 15;
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| {
            for i in 0..p.len() {
                let gi = g[i];
                m[i] += gi;
                v[i] += gi;
                p[i] -= gi;
            }
        });
}

fn bench_adamw(c: &mut Criterion) {
    let cpu = Cpu::new();
    let mut group = c.benchmark_group("offload/adamw");
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    for (n, label) in SIZES {
        let grad = values(n, 7, 0.01);
        let mut param = values(n, 3, 1.0);
        group.throughput(Throughput::Elements(n as u64));

        let mut opt = optimizer(&cpu, n, StatePrecision::F32);
        group.bench_function(BenchmarkId::new("headroom_f32", label), |b| {
            b.iter(|| {
                opt.step(0, &mut param, FloatSlice::F32(black_box(&grad)), None)
                    .expect("step")
            })
        });
        drop(opt);

        let mut opt = optimizer(&cpu, n, StatePrecision::Int8);
        group.bench_function(BenchmarkId::new("headroom_int8", label), |b| {
            b.iter(|| {
                opt.step(0, &mut param, FloatSlice::F32(black_box(&grad)), None)
                    .expect("step")
            })
        });
        let _ = record(&Record {
            bench: format!("offload/adamw_state_bytes_per_param/int8/{label}"),
            metric: "state_bytes_per_param".into(),
            value: opt.state_bytes_per_param(),
            unit: "bytes".into(),
            baseline: Some(format!("offload/adamw_state_bytes_per_param/f32/{label}")),
            baseline_value: Some(8.0),
            ratio: Some(opt.state_bytes_per_param() / 8.0),
            better: Better::Lower,
        });
        drop(opt);

        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        group.bench_function(BenchmarkId::new("baseline_bandwidth_28B", label), |b| {
            b.iter(|| bandwidth_pass(&mut param, black_box(&grad), &mut m, &mut v))
        });
        drop((m, v));

        // Against PyTorch (adam.py): a median of our own timing, recorded for xtask to pair.
        let mut opt = optimizer(&cpu, n, StatePrecision::F32);
        let mut times: Vec<f64> = (0..9)
            .map(|_| {
                let t = Instant::now();
                opt.step(0, &mut param, FloatSlice::F32(&grad), None)
                    .expect("step");
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let _ = record(&Record {
            bench: format!("offload/adamw_vs_torch/headroom_f32/{label}"),
            metric: "params_per_s".into(),
            value: n as f64 / times[times.len() / 2],
            unit: "params/s".into(),
            baseline: Some(format!("offload/adamw_vs_torch/torch_fused/{label}")),
            baseline_value: None,
            ratio: None,
            better: Better::Higher,
        });
    }
    group.finish();
}

criterion_group!(benches, bench_adamw);
criterion_main!(benches);
