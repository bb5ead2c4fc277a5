//! headroom-attn on the CPU: naive (the baseline), chunked and flash attention, forward and
//! forward+backward, causal f32, batch 1, 8 heads, head_dim 64, N = 1024 / 2048 / 4096 tokens —
//! the shapes of issue 5 and of `benches/torch/attn.py`, which times PyTorch's
//! `scaled_dot_product_attention` on the same shapes.
//!
//! Criterion groups `attn/fwd` and `attn/fwd_bwd`: functions `flash`, `chunked` and
//! `baseline_naive`, parameter `T<N>`, throughput in FLOPs by FlashAttention's count (forward
//! 4·N²·d per head, halved for causal; backward 2.5× forward), so criterion's "elements/s" read
//! as FLOP/s.
//!
//! Records (`headroom_benches::record`):
//! - `attn/<pass>/<algo>/T<N>`: `median_time` (ms) and `throughput` (GFLOP/s) from the same
//!   criterion samples, with naive as the baseline;
//! - `attn/memory/<algo>/T<N>`: `peak_extra_bytes`, the peak of `Workspace` + `Activations`
//!   bytes reported to an allocation hook during one forward+backward (what attention adds
//!   beyond its inputs and results), for flash from N = 1024 to 16384 (8192 in a quick run)
//!   and for naive and chunked where they are timed; naive is the baseline.
//!
//! The torch script's records name `attn/<pass>/flash/T<N>` as their baseline, so the report
//! shows torch / headroom-flash for the same run.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use headroom_attn::{AttentionBackend, AttentionConfig, AttentionDims};
use headroom_benches::{record, Better, Record};
use headroom_tensor::{AllocEvent, AllocHook, Backend, BoxedError, Cpu, CpuTensor, MemoryCategory};

const HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const SEQ_LENS: [usize; 3] = [1024, 2048, 4096];
const MEMORY_SEQ_LENS: [usize; 5] = [1024, 2048, 4096, 8192, 16384];

struct Inputs {
    q: CpuTensor,
    k: CpuTensor,
    v: CpuTensor,
    d_out: CpuTensor,
}

fn inputs(cpu: &Cpu, n: usize) -> Inputs {
    let shape = [1, HEADS, n, HEAD_DIM];
    let len = HEADS * n * HEAD_DIM;
    let mut state = 0x2545_f491u32;
    let mut values = || -> Vec<f32> {
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    };
    let mut t = || cpu.upload(&values(), shape).expect("upload");
    Inputs {
        q: t(),
        k: t(),
        v: t(),
        d_out: t(),
    }
}

fn algorithms() -> [(&'static str, AttentionConfig); 3] {
    [
        ("flash", AttentionConfig::flash().causal(true)),
        ("chunked", AttentionConfig::chunked().causal(true)),
        ("baseline_naive", AttentionConfig::naive().causal(true)),
    ]
}

fn dims(n: usize) -> AttentionDims {
    AttentionDims {
        batch: 1,
        q_heads: HEADS,
        kv_heads: HEADS,
        q_len: n,
        kv_len: n,
        head_dim: HEAD_DIM,
        dtype: headroom_tensor::DType::F32,
    }
}

fn run_once(cpu: &Cpu, x: &Inputs, config: &AttentionConfig, backward: bool) {
    let fwd = cpu
        .attention_forward(&x.q, &x.k, &x.v, config)
        .expect("forward");
    if backward {
        let g = cpu
            .attention_backward(&x.q, &x.k, &x.v, &fwd, &x.d_out)
            .expect("backward");
        black_box(g);
    }
    black_box(fwd);
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => xs[n / 2],
        n => 0.5 * (xs[n / 2 - 1] + xs[n / 2]),
    }
}

fn algo_id(name: &str) -> &str {
    name.strip_prefix("baseline_").unwrap_or(name)
}

fn write(r: Record) {
    if let Err(e) = record(&r) {
        eprintln!("attn bench: could not write record {}: {e}", r.bench);
    }
}

/// Median ms and GFLOP/s of every algorithm, recorded against naive.
fn record_timings(pass: &str, n: usize, medians_s: &HashMap<&'static str, f64>, flops: f64) {
    let naive_s = medians_s.get("baseline_naive").copied();
    for (name, &s) in medians_s {
        let algo = algo_id(name);
        let bench = format!("attn/{pass}/{algo}/T{n}");
        let baseline = (algo != "naive").then(|| format!("attn/{pass}/naive/T{n}"));
        let base_s = naive_s.filter(|_| baseline.is_some());
        write(Record {
            bench: bench.clone(),
            metric: "median_time".into(),
            value: s * 1e3,
            unit: "ms".into(),
            baseline: baseline.clone(),
            baseline_value: base_s.map(|b| b * 1e3),
            ratio: base_s.map(|b| s / b),
            better: Better::Lower,
        });
        write(Record {
            bench,
            metric: "throughput".into(),
            value: flops / s / 1e9,
            unit: "GFLOP/s".into(),
            baseline,
            baseline_value: base_s.map(|b| flops / b / 1e9),
            ratio: base_s.map(|b| b / s),
            better: Better::Higher,
        });
    }
}

fn timings(c: &mut Criterion) {
    let cpu = Cpu::new();
    for (pass, backward) in [("fwd", false), ("fwd_bwd", true)] {
        let mut group = c.benchmark_group(format!("attn/{pass}"));
        // Each call takes 10 ms to seconds: flat sampling and few samples bound the run time.
        group.sampling_mode(SamplingMode::Flat);
        group.sample_size(10);
        group.warm_up_time(Duration::from_millis(500));
        for n in SEQ_LENS {
            let x = inputs(&cpu, n);
            let fwd_flops = dims(n).forward_flops(true);
            let flops = if backward { 3.5 * fwd_flops } else { fwd_flops };
            group.throughput(Throughput::Elements(flops as u64));
            let mut medians_s = HashMap::new();
            for (name, config) in algorithms() {
                let mut per_call = Vec::new();
                group.bench_function(BenchmarkId::new(name, format!("T{n}")), |b| {
                    b.iter_custom(|iters| {
                        let start = Instant::now();
                        for _ in 0..iters {
                            run_once(&cpu, &x, &config, backward);
                        }
                        let took = start.elapsed();
                        per_call.push(took.as_secs_f64() / iters.max(1) as f64);
                        took
                    })
                });
                medians_s.insert(name, median(per_call));
            }
            record_timings(pass, n, &medians_s, flops);
        }
        group.finish();
    }
}

/// Live and peak bytes of `Workspace` + `Activations`.
#[derive(Default)]
struct ExtraBytes {
    live: Mutex<(usize, usize)>,
}

fn is_extra(c: MemoryCategory) -> bool {
    matches!(c, MemoryCategory::Workspace | MemoryCategory::Activations)
}

impl AllocHook for ExtraBytes {
    fn on_alloc(&self, e: &AllocEvent) -> Result<(), BoxedError> {
        if is_extra(e.category) {
            let mut s = self.live.lock().map_err(|_| "poisoned")?;
            s.0 += e.bytes;
            s.1 = s.1.max(s.0);
        }
        Ok(())
    }
    fn on_free(&self, e: &AllocEvent) {
        if is_extra(e.category) {
            if let Ok(mut s) = self.live.lock() {
                s.0 -= e.bytes;
            }
        }
    }
}

fn peak_extra_bytes(n: usize, config: &AttentionConfig) -> usize {
    let hook = Arc::new(ExtraBytes::default());
    let cpu = Cpu::new().with_alloc_hook(hook.clone());
    let x = inputs(&cpu, n);
    run_once(&cpu, &x, config, true);
    let peak = hook.live.lock().map(|s| s.1).unwrap_or(0);
    peak
}

fn memory(_c: &mut Criterion) {
    let quick = std::env::args().any(|a| a == "--measurement-time");
    for n in MEMORY_SEQ_LENS {
        if quick && n > 8192 {
            continue;
        }
        let mut measured = HashMap::new();
        for (name, config) in algorithms() {
            // Naive and chunked only where they are also timed: naive needs 2·8·N² floats.
            if name != "flash" && n > *SEQ_LENS.last().unwrap_or(&0) {
                continue;
            }
            measured.insert(algo_id(name), peak_extra_bytes(n, &config) as f64);
        }
        let naive = measured.get("naive").copied();
        for (&algo, &bytes) in &measured {
            let baseline =
                (algo != "naive" && naive.is_some()).then(|| format!("attn/memory/naive/T{n}"));
            let base = naive.filter(|_| baseline.is_some());
            println!("attn/memory/{algo}/T{n}: peak extra {bytes} bytes");
            write(Record {
                bench: format!("attn/memory/{algo}/T{n}"),
                metric: "peak_extra_bytes".into(),
                value: bytes,
                unit: "bytes".into(),
                baseline,
                baseline_value: base,
                ratio: base.map(|b| bytes / b),
                better: Better::Lower,
            });
        }
    }
}

criterion_group!(benches, memory, timings);
criterion_main!(benches);
