//! The fused NF4 dequantize-matmul against the f32 GEMM of the same shape, in the same run.
//!
//! Group `quant/matmul_fwd`: `headroom_nf4_fused` is headroom-quant's `matmul_forward`
//! (`Y = X·Wᵀ`, `W` 4096×4096 in NF4 with double quantization at block 64, `X` 512 rows),
//! `baseline_f32_gemm` the trainer's f32 linear forward (the gemm crate, threaded) on the
//! dequantized weight. Both use every thread of the global pool. The record
//! `quant/matmul_fwd/headroom_nf4_fused/4096x4096_n512` carries throughput in GFLOP/s and the
//! ratio to the baseline from interleaved rounds (medians), so slow drifts of a shared machine
//! hit both sides alike. The weight bytes each side reads per call are printed too (the fused
//! path reads 4.13 bits per weight, the baseline 32).

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use headroom_benches::{record, Better, Record};
use headroom_quant::{matmul_forward, Isa, MatmulOptions, QuantConfig, QuantizedTensor};
use headroom_tensor::Cpu;

const OUT: usize = 4096;
const IN: usize = 4096;
const ROWS: usize = 512;
const ROUNDS: usize = 5;

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn bench(c: &mut Criterion) {
    let cpu = Cpu::new();
    let w = values(OUT * IN, 1);
    let q =
        QuantizedTensor::quantize(&cpu, &w, &[OUT, IN], QuantConfig::qlora()).expect("quantize");
    let wd = q.dequantize();
    drop(w);
    let x = values(ROWS * IN, 2);
    let mut y = vec![0f32; ROWS * OUT];
    let opts = MatmulOptions::default();
    let flops = 2.0 * (ROWS * OUT * IN) as f64;
    let size = format!("{OUT}x{IN}_n{ROWS}");

    let fused = |y: &mut [f32]| matmul_forward(&cpu, &x, &q, y, &opts).expect("fused matmul");
    let dense =
        |y: &mut [f32]| headroom_trainer::ops::matmul::forward(y, &x, &wd, None, ROWS, IN, OUT);

    let mut group = c.benchmark_group("quant/matmul_fwd");
    group.sample_size(10);
    group.throughput(Throughput::Elements(flops as u64));
    group.bench_function(BenchmarkId::new("headroom_nf4_fused", &size), |b| {
        b.iter(|| fused(black_box(&mut y)))
    });
    group.bench_function(BenchmarkId::new("baseline_f32_gemm", &size), |b| {
        b.iter(|| dense(black_box(&mut y)))
    });
    group.finish();

    // Interleaved rounds: each side's time, then the ratio of throughputs per round.
    let (mut tf, mut td, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let t = Instant::now();
        fused(&mut y);
        let f = t.elapsed().as_secs_f64();
        let t = Instant::now();
        dense(&mut y);
        let d = t.elapsed().as_secs_f64();
        tf.push(f);
        td.push(d);
        ratios.push(d / f);
    }
    let (tf, td, ratio) = (median(tf), median(td), median(ratios));
    println!(
        "quant/matmul_fwd {size}: fused NF4 {:.1} GFLOP/s ({:.1} ms), f32 gemm {:.1} GFLOP/s ({:.1} ms), \
         ratio {ratio:.3}; weight bytes read: {} (NF4) vs {} (f32); dequant isa {}, {} threads",
        flops / tf / 1e9,
        tf * 1e3,
        flops / td / 1e9,
        td * 1e3,
        q.stored_bytes(),
        OUT * IN * 4,
        Isa::detect().name(),
        rayon::current_num_threads(),
    );
    let base = format!("quant/matmul_fwd/baseline_f32_gemm/{size}");
    for r in [
        Record {
            bench: base.clone(),
            metric: "throughput".into(),
            value: flops / td / 1e9,
            unit: "GFLOP/s".into(),
            baseline: None,
            baseline_value: None,
            ratio: None,
            better: Better::Higher,
        },
        Record {
            bench: format!("quant/matmul_fwd/headroom_nf4_fused/{size}"),
            metric: "throughput".into(),
            value: flops / tf / 1e9,
            unit: "GFLOP/s".into(),
            baseline: Some(base),
            baseline_value: Some(flops / td / 1e9),
            ratio: Some(ratio),
            better: Better::Higher,
        },
    ] {
        if let Err(e) = record(&r) {
            eprintln!("could not record {}: {e}", r.bench);
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
