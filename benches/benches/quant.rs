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
//!
//! Group `quant/bf16_products` (where the trainer's bf16 products run on AMX; skipped
//! elsewhere): the trainer's 4-bit linear in a bf16 run (`ops::quant_matmul`: the weight
//! dequantized to bf16 a 1024 × 512 block at a time) against the dense bf16 products over
//! the whole dequantized weight already in bf16 (what a bf16-base LoRA linear costs), forward and
//! input gradient, bf16 activations, interleaved rounds. The ratio is the price of storing the
//! weight in 4 bits; the printout also names the f32 fused kernel's time from the first group.

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
    record_throughputs(
        &format!("quant/matmul_fwd/baseline_f32_gemm/{size}"),
        flops / td / 1e9,
        &format!("quant/matmul_fwd/headroom_nf4_fused/{size}"),
        flops / tf / 1e9,
        ratio,
    );
}

/// Records a baseline's throughput (GFLOP/s) and one measured against it, with the ratio of
/// the interleaved rounds.
fn record_throughputs(base: &str, base_gflops: f64, bench: &str, gflops: f64, ratio: f64) {
    let throughput = |bench: &str, value: f64| Record {
        bench: bench.into(),
        metric: "throughput".into(),
        value,
        unit: "GFLOP/s".into(),
        baseline: None,
        baseline_value: None,
        ratio: None,
        better: Better::Higher,
    };
    for r in [
        throughput(base, base_gflops),
        Record {
            baseline: Some(base.into()),
            baseline_value: Some(base_gflops),
            ratio: Some(ratio),
            ..throughput(bench, gflops)
        },
    ] {
        if let Err(e) = record(&r) {
            eprintln!("could not record {}: {e}", r.bench);
        }
    }
}

/// Median seconds of `ROUNDS` interleaved rounds of `run(0)`, …, `run(N - 1)`.
fn interleaved<const N: usize>(mut run: impl FnMut(usize)) -> [f64; N] {
    let mut times = vec![Vec::new(); N];
    for _ in 0..ROUNDS {
        for (i, t) in times.iter_mut().enumerate() {
            let start = Instant::now();
            run(i);
            t.push(start.elapsed().as_secs_f64());
        }
    }
    let mut out = [0.0; N];
    for (o, t) in out.iter_mut().zip(times) {
        *o = median(t);
    }
    out
}

fn bench_bf16(_: &mut Criterion) {
    use half::bf16;
    use headroom_trainer::ops::{matmul, quant_matmul};
    if !matmul::bf16_products() {
        println!("quant/bf16_products: skipped (no AMX bf16 products on this CPU)");
        return;
    }
    let cpu = Cpu::new();
    let q = QuantizedTensor::quantize(&cpu, &values(OUT * IN, 1), &[OUT, IN], QuantConfig::qlora())
        .expect("quantize");
    let wb: Vec<bf16> = q.dequantize().into_iter().map(bf16::from_f32).collect();
    let x: Vec<bf16> = values(ROWS * IN, 2)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let dy = values(ROWS * OUT, 3);
    let (mut y, mut dx) = (vec![0f32; ROWS * OUT], vec![0f32; ROWS * IN]);
    let threads = rayon::current_num_threads();
    let (fb, fp) = quant_matmul::forward_scratch(ROWS, &q, threads);
    let (bb, bp) = quant_matmul::backward_scratch(ROWS, &q, threads);
    let mut block = vec![bf16::ZERO; fb.max(bb)];
    let mut pack = vec![0u16; fp.max(bp)];
    let mut dense = vec![
        0f32;
        matmul::forward_scratch(ROWS, IN, OUT)
            .max(matmul::backward_scratch(ROWS, IN, OUT))
    ];
    let flops = 2.0 * (ROWS * OUT * IN) as f64;
    let size = format!("{OUT}x{IN}_n{ROWS}");
    let [qf, df, qb, db] = interleaved(|case| match case {
        0 => quant_matmul::forward(&mut y, &x, &q, &mut block, &mut pack).expect("forward"),
        1 => matmul::forward_bf16_products(&mut y, &x, &wb, None, ROWS, IN, OUT, &mut dense),
        2 => quant_matmul::backward_input(&mut dx, &dy, &q, &mut block, &mut pack)
            .expect("input gradient"),
        _ => matmul::backward_bf16_products(
            &mut dx,
            None,
            None,
            &dy,
            &[] as &[bf16],
            &wb,
            ROWS,
            IN,
            OUT,
            &mut dense,
        ),
    });
    println!(
        "quant/bf16_products {size}: forward nf4 {:.1} GFLOP/s ({:.1} ms) vs dense bf16 {:.1} GFLOP/s ({:.1} ms), \
         ratio {:.3}; input gradient nf4 {:.1} GFLOP/s ({:.1} ms) vs dense bf16 {:.1} GFLOP/s ({:.1} ms), ratio {:.3}; \
         scratch {} + {} bytes; {threads} threads",
        flops / qf / 1e9,
        qf * 1e3,
        flops / df / 1e9,
        df * 1e3,
        df / qf,
        flops / qb / 1e9,
        qb * 1e3,
        flops / db / 1e9,
        db * 1e3,
        db / qb,
        2 * fb.max(bb),
        2 * fp.max(bp),
    );
    for (name, t, base_name, base) in [
        ("forward", qf, "forward_dense_bf16", df),
        ("input_grad", qb, "input_grad_dense_bf16", db),
    ] {
        record_throughputs(
            &format!("quant/bf16_products/{base_name}/{size}"),
            flops / base / 1e9,
            &format!("quant/bf16_products/{name}_nf4/{size}"),
            flops / t / 1e9,
            base / t,
        );
    }
}

criterion_group!(benches, bench, bench_bf16);
criterion_main!(benches);
