//! CPU AdamW throughput (parameters per second) at 10M and 50M parameters.
//!
//! Group `offload/adamw`: `headroom_f32` (f32 moments), `headroom_int8` and `headroom_float8`
//! (the two 8-bit formats: code book, and small floats as `--adam-8bit` uses) and
//! `baseline_bandwidth_28B`, a threaded pass that moves exactly AdamW's 28 bytes per parameter
//! (reads param, grad, m, v; writes param, m, v) with trivial arithmetic: the memory-bandwidth
//! bound measured in the same run. `headroom_f32 / baseline` is the fraction of that bound.
//! `baseline_bandwidth_16B` is the same for the 8-bit step's 16 bytes (reads param, grad and
//! the two code bytes; writes param and both codes), split into the step's 2048-element
//! blocks on the same thread pool, so the 8-bit step is compared with a pass that moves its
//! bytes with its threads; `adamw_{int8,float8}_vs_bandwidth_16B` record their ratios from
//! [`ROUNDS`] rounds that alternate the two 8-bit steps and the pass.
//!
//! Those rounds repeat one step on the same buffers, so where the last-level cache holds a
//! step's bytes (10M parameters move 160 MB; some Xeons have a 300 MiB L3) both sides run
//! from the cache and the "bound" is the cache's bandwidth, not memory's. A training step
//! meets its optimizer state after the forward and backward passes have streamed the
//! activations through that cache, so `adamw_{int8,float8}_vs_bandwidth_16B_cold` repeat the
//! rounds with the cache flushed before every timed call (a read of a buffer twice the
//! last-level cache's size, untimed) on both sides: the 16-byte bound from memory.
//!
//! Every buffer is a CPU-backend tensor, as in the trainer, so large ones sit on transparent
//! huge pages where the kernel allows them (see headroom-tensor's host memory).
//!
//! Against PyTorch's fused AdamW (`benches/torch/offload_adam.py`, same sizes), two records:
//! - `adamw_vs_torch/headroom_f32`: a median of our own steps, which xtask pairs with the
//!   script's standalone run after the benches;
//! - `adamw_interleaved/{headroom_f32,torch_fused}`: [`ROUNDS`] rounds that alternate a fresh
//!   torch process's median with ours, so slow drifts of this VM's memory bandwidth hit both
//!   sides alike. The ratio recorded is the median of the per-round ratios. Skipped with a
//!   message when `$HEADROOM_PYTHON` (else `python3`) has no torch.

use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use headroom_benches::{record, Better, Record};
use headroom_offload::{AdamWHyper, CpuAdamW, ParamSpec, StatePrecision, StoreSpec};
use headroom_tensor::cpu::kernels::FloatSlice;
use headroom_tensor::{Backend, Cpu, CpuTensor, DType};
use rayon::prelude::*;

const SIZES: [(usize, &str); 2] = [(10_000_000, "10M"), (50_000_000, "50M")];
/// Alternating torch/headroom rounds per size.
const ROUNDS: usize = 7;
/// Timed steps per side per round (each side reports its median).
const STEPS_PER_ROUND: usize = 7;

/// A host tensor of `n` pseudo-random f32 in `[-scale/2, scale/2)`.
fn values(cpu: &Cpu, n: usize, seed: u32, scale: f32) -> CpuTensor {
    let mut t = cpu.zeros([n], DType::F32).expect("host tensor");
    let mut s = seed | 1;
    for x in t.as_mut_slice::<f32>().expect("f32") {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        *x = ((s >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * scale;
    }
    t
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Parameters per second of `steps` timed calls of `step`: the median.
fn rate(n: usize, steps: usize, step: impl FnMut()) -> f64 {
    rate_after(n, steps, None, step)
}

/// [`rate`], with `flush` (when given) run untimed before every timed call.
fn rate_after(n: usize, steps: usize, flush: Option<&CacheFlush>, mut step: impl FnMut()) -> f64 {
    median(
        (0..steps)
            .map(|_| {
                if let Some(flush) = flush {
                    flush.flush();
                }
                let t = Instant::now();
                step();
                n as f64 / t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// The largest cache's size in bytes, from Linux's sysfs (64 MiB where it cannot be read).
fn last_level_cache_bytes() -> usize {
    let largest = (0..8)
        .filter_map(|i| {
            let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
            let kind = std::fs::read_to_string(format!("{dir}/type")).ok()?;
            if kind.trim() == "Instruction" {
                return None;
            }
            let size = std::fs::read_to_string(format!("{dir}/size")).ok()?;
            let size = size.trim();
            let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit())?);
            let n: usize = digits.parse().ok()?;
            Some(match unit {
                "K" => n << 10,
                "M" => n << 20,
                "G" => n << 30,
                _ => n,
            })
        })
        .max();
    largest.unwrap_or(64 << 20)
}

/// A buffer twice the last-level cache's size whose read, in parallel, leaves none of the
/// step's lines cached: what the step's state meets after a forward and backward pass.
struct CacheFlush(Vec<u64>);

impl CacheFlush {
    /// `None` where the memory cannot be had.
    fn new() -> Option<CacheFlush> {
        let words = (2 * last_level_cache_bytes()).clamp(64 << 20, 2 << 30) / 8;
        let mut buf = Vec::new();
        buf.try_reserve_exact(words).ok()?;
        // Non-zero, so the pages are real and not the kernel's shared zero page.
        buf.resize(words, 1u64);
        Some(CacheFlush(buf))
    }

    fn flush(&self) {
        let sum: u64 = self
            .0
            .par_chunks(1 << 16)
            .map(|c| c.iter().sum::<u64>())
            .sum();
        black_box(sum);
    }
}

/// One round of PyTorch's fused AdamW in a fresh process, or why it could not run.
fn torch_round(label: &str) -> Result<f64, String> {
    let python = std::env::var_os("HEADROOM_PYTHON").unwrap_or_else(|| "python3".into());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/torch/offload_adam.py");
    let out = Command::new(&python)
        .args([
            script,
            "--size",
            label,
            "--repeats",
            &STEPS_PER_ROUND.to_string(),
        ])
        .args(["--prefix", "offload/adamw_interleaved"])
        .output()
        .map_err(|e| format!("{}: {e}", python.to_string_lossy()))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with('{'))
        .ok_or("no record")?;
    let rec: Record = serde_json::from_str(line).map_err(|e| e.to_string())?;
    Ok(rec.value)
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

/// Reads p, g and two code bytes and writes p and both codes: the 16 bytes the 8-bit step
/// moves per parameter, in its 2048-element blocks, with no real arithmetic. Two loops per
/// block so that each vectorises on its own.
fn bandwidth_pass_16(p: &mut [f32], g: &[f32], mc: &mut [u8], sc: &mut [u8]) {
    const BLOCK: usize = 2048;
    p.par_chunks_mut(BLOCK)
        .zip(g.par_chunks(BLOCK))
        .zip(mc.par_chunks_mut(BLOCK))
        .zip(sc.par_chunks_mut(BLOCK))
        .for_each(|(((p, g), mc), sc)| {
            for (p, g) in p.iter_mut().zip(g) {
                *p -= g;
            }
            for (m, s) in mc.iter_mut().zip(sc.iter_mut()) {
                *m = m.wrapping_add(1);
                *s = s.wrapping_sub(1);
            }
        });
}

fn bench_adamw(c: &mut Criterion) {
    let cpu = Cpu::new();
    println!(
        "offload/adamw: {} threads (the AdamW steps and both bandwidth passes)",
        rayon::current_num_threads()
    );
    // Allocated once: the cold rounds' flush.
    let flush = CacheFlush::new();
    if flush.is_none() {
        println!("offload/adamw: no memory for the cache flush; the cold rounds are skipped");
    }
    let mut group = c.benchmark_group("offload/adamw");
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    for (n, label) in SIZES {
        let grad_t = values(&cpu, n, 7, 0.01);
        let grad = grad_t.as_slice::<f32>().expect("f32");
        let mut param_t = values(&cpu, n, 3, 1.0);
        let param = param_t.as_mut_slice::<f32>().expect("f32");
        group.throughput(Throughput::Elements(n as u64));

        let mut opt = optimizer(&cpu, n, StatePrecision::F32);
        group.bench_function(BenchmarkId::new("headroom_f32", label), |b| {
            b.iter(|| {
                opt.step(0, param, FloatSlice::F32(black_box(grad)), None)
                    .expect("step")
            })
        });
        drop(opt);

        // The two 8-bit formats: the code book (`Int8`, kept for old state) and the small
        // floats (`Float8`, what `--adam-8bit` uses).
        let mut book = optimizer(&cpu, n, StatePrecision::Int8);
        group.bench_function(BenchmarkId::new("headroom_int8", label), |b| {
            b.iter(|| {
                book.step(0, param, FloatSlice::F32(black_box(grad)), None)
                    .expect("step")
            })
        });
        let mut float8 = optimizer(&cpu, n, StatePrecision::Float8);
        group.bench_function(BenchmarkId::new("headroom_float8", label), |b| {
            b.iter(|| {
                float8
                    .step(0, param, FloatSlice::F32(black_box(grad)), None)
                    .expect("step")
            })
        });
        let code_bytes = || cpu.zeros([n], DType::U8).expect("host tensor");
        let mut codes_t = (code_bytes(), code_bytes());
        let codes = (
            codes_t.0.as_mut_slice::<u8>().expect("u8"),
            codes_t.1.as_mut_slice::<u8>().expect("u8"),
        );
        group.bench_function(BenchmarkId::new("baseline_bandwidth_16B", label), |b| {
            b.iter(|| bandwidth_pass_16(param, black_box(grad), codes.0, codes.1))
        });
        // On an AVX-512 machine, `Float8` also through its AVX2 kernel, in the same rounds:
        // what the wider kernel gains.
        let mut float8_avx2 = (headroom_offload::Isa::detect() == headroom_offload::Isa::Avx512)
            .then(|| {
                optimizer(&cpu, n, StatePrecision::Float8)
                    .with_isa(headroom_offload::Isa::Avx2)
                    .expect("AVX2 on an AVX-512 machine")
            });
        let rounded = |r: &[f64]| {
            r.iter()
                .map(|r| (r * 100.0).round() / 100.0)
                .collect::<Vec<_>>()
        };
        // Both 8-bit steps against their own bound, alternating, three steps a side per round:
        // first as the rounds always ran (warm: the buffers stay where the last call left
        // them), then with the cache flushed before every timed call (cold).
        for cold in [false, true] {
            let suffix = if cold { "_cold" } else { "" };
            if cold && flush.is_none() {
                break;
            }
            let time = |f: &mut dyn FnMut()| rate_after(n, 3, flush.as_ref().filter(|_| cold), f);
            let (mut book_rates, mut float8_rates, mut bound) = (vec![], vec![], vec![]);
            let (mut book_ratios, mut float8_ratios, mut avx2_ratios) = (vec![], vec![], vec![]);
            for _ in 0..ROUNDS {
                let narrow = float8_avx2.as_mut().map(|opt| {
                    time(&mut || {
                        opt.step(0, param, FloatSlice::F32(grad), None)
                            .expect("step")
                    })
                });
                let b = time(&mut || {
                    book.step(0, param, FloatSlice::F32(grad), None)
                        .expect("step")
                });
                let f = time(&mut || {
                    float8
                        .step(0, param, FloatSlice::F32(grad), None)
                        .expect("step")
                });
                let pass = time(&mut || bandwidth_pass_16(param, grad, codes.0, codes.1));
                book_ratios.push(b / pass);
                float8_ratios.push(f / pass);
                if let Some(narrow) = narrow {
                    avx2_ratios.push(narrow / pass);
                }
                book_rates.push(b);
                float8_rates.push(f);
                bound.push(pass);
            }
            println!(
                "offload/adamw_bandwidth_16B{suffix}/{label}: per-round bound {:?} G params/s",
                rounded(&bound.iter().map(|b| b / 1e9).collect::<Vec<_>>())
            );
            if float8_avx2.is_some() {
                println!(
                    "offload/adamw_float8_avx2_kernel_vs_bandwidth_16B{suffix}/{label}: per-round \
                     ratios {:?} (median {:.2}; the AVX-512 kernel below is what `Isa::detect` \
                     runs)",
                    rounded(&avx2_ratios),
                    median(avx2_ratios.clone())
                );
            }
            for (name, rates, ratios) in [
                ("int8", book_rates, book_ratios),
                ("float8", float8_rates, float8_ratios),
            ] {
                println!(
                    "offload/adamw_{name}_vs_bandwidth_16B{suffix}/{label}: per-round ratios {:?} \
                     (median {:.2})",
                    rounded(&ratios),
                    median(ratios.clone())
                );
                let _ = record(&Record {
                    bench: format!("offload/adamw_{name}_vs_bandwidth_16B{suffix}/{name}/{label}"),
                    metric: "params_per_s".into(),
                    value: median(rates),
                    unit: "params/s".into(),
                    baseline: Some(format!(
                        "offload/adamw_{name}_vs_bandwidth_16B{suffix}/bandwidth_16B/{label}"
                    )),
                    baseline_value: Some(median(bound.clone())),
                    ratio: Some(median(ratios)),
                    better: Better::Higher,
                });
            }
        }
        drop((codes_t, float8_avx2));
        for (name, opt) in [("int8", &book), ("float8", &float8)] {
            let _ = record(&Record {
                bench: format!("offload/adamw_state_bytes_per_param/{name}/{label}"),
                metric: "state_bytes_per_param".into(),
                value: opt.state_bytes_per_param(),
                unit: "bytes".into(),
                baseline: Some(format!("offload/adamw_state_bytes_per_param/f32/{label}")),
                baseline_value: Some(8.0),
                ratio: Some(opt.state_bytes_per_param() / 8.0),
                better: Better::Lower,
            });
        }
        drop((book, float8));

        let (mut m_t, mut v_t) = (values(&cpu, n, 5, 0.0), values(&cpu, n, 9, 0.0));
        let (m, v) = (
            m_t.as_mut_slice::<f32>().expect("f32"),
            v_t.as_mut_slice::<f32>().expect("f32"),
        );
        group.bench_function(BenchmarkId::new("baseline_bandwidth_28B", label), |b| {
            b.iter(|| bandwidth_pass(param, black_box(grad), m, v))
        });
        drop((m_t, v_t));

        // Against PyTorch (offload_adam.py): a median of our own timing, for xtask to pair.
        let mut opt = optimizer(&cpu, n, StatePrecision::F32);
        let mut step = || {
            opt.step(0, param, FloatSlice::F32(grad), None)
                .expect("step")
        };
        step(); // first touch of the moments, as torch's untimed first step
        let _ = record(&Record {
            bench: format!("offload/adamw_vs_torch/headroom_f32/{label}"),
            metric: "params_per_s".into(),
            value: rate(n, 9, &mut step),
            unit: "params/s".into(),
            baseline: Some(format!("offload/adamw_vs_torch/torch_fused/{label}")),
            baseline_value: None,
            ratio: None,
            better: Better::Higher,
        });

        // Alternating with torch, round by round.
        let (mut ours, mut theirs, mut ratios) = (vec![], vec![], vec![]);
        for _ in 0..ROUNDS {
            let torch = match torch_round(label) {
                Ok(r) => r,
                Err(why) => {
                    println!("offload/adamw_interleaved/{label}: torch skipped: {why}");
                    break;
                }
            };
            let own = rate(n, STEPS_PER_ROUND, &mut step);
            ratios.push(own / torch);
            ours.push(own);
            theirs.push(torch);
        }
        if !ratios.is_empty() {
            let torch_median = median(theirs.clone());
            println!(
                "offload/adamw_interleaved/{label}: per-round ratios {:?}",
                ratios
                    .iter()
                    .map(|r| (r * 100.0).round() / 100.0)
                    .collect::<Vec<_>>()
            );
            let _ = record(&Record {
                bench: format!("offload/adamw_interleaved/torch_fused/{label}"),
                metric: "params_per_s".into(),
                value: torch_median,
                unit: "params/s".into(),
                baseline: None,
                baseline_value: None,
                ratio: None,
                better: Better::Higher,
            });
            let _ = record(&Record {
                bench: format!("offload/adamw_interleaved/headroom_f32/{label}"),
                metric: "params_per_s".into(),
                value: median(ours),
                unit: "params/s".into(),
                baseline: Some(format!("offload/adamw_interleaved/torch_fused/{label}")),
                baseline_value: Some(torch_median),
                ratio: Some(median(ratios)),
                better: Better::Higher,
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_adamw);
criterion_main!(benches);
