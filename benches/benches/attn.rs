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
//!
//! Criterion group `attn/window` (sliding windows, Mistral's and Qwen2's): flash
//! forward+backward at N = 4096 with windows of 512 and 1024 keys (`DocumentMask::narrowed`),
//! function `flash_W<w>`, next to plain causal flash (`baseline_flash_causal`) in the same run.
//! Records `attn/window/fwd_bwd/flash_W<w>/T4096`: `median_time` (ms) with the causal run as
//! the baseline. Key tiles before a query tile's window are skipped, so the work falls from
//! N²/2 to about N·W.
//!
//! With the `cuda` feature (issue 11) a GPU section runs after the CPU part: headroom's bf16
//! FlashAttention-2 kernels, forward and forward+backward, at the shape of
//! `benches/torch/attn.py --device cuda` (batch 4, 16 heads, N = 4096, head_dim 128, causal),
//! first checked against the CPU flash path on two small cases with the tolerances of
//! `headroom_attn::accuracy` (a bench must not time a wrong kernel), then timed with CUDA
//! events like the torch script (10 warm-up calls, median of 50). Records
//! `attn/cuda/<pass>/flash/bf16/T4096_D128`: `median_time` (ms) and `throughput`
//! (TFLOP/s, the same FLOP count), each naming torch's
//! `attn/cuda/<pass>/torch_sdpa/bf16/T4096_D128` as its baseline. Without a GPU, or when the
//! kernels do not load or disagree with the CPU, it prints `attn/cuda: skipped: <why>` and the
//! bench still succeeds with the CPU results written. Under `cargo test --benches` (no
//! `--bench` argument) each pass runs once and nothing is recorded.

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

const WINDOW_SEQ: usize = 4096;
const WINDOWS: [usize; 2] = [512, 1024];

fn windows(c: &mut Criterion) {
    use headroom_attn::DocumentMask;
    let cpu = Cpu::new();
    let n = WINDOW_SEQ;
    let x = inputs(&cpu, n);
    let config = AttentionConfig::flash().causal(true);
    let mut group = c.benchmark_group("attn/window");
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(500));
    let mut medians_s: Vec<(String, Option<usize>, f64)> = Vec::new();
    let runs = std::iter::once(None).chain(WINDOWS.map(Some));
    for window in runs {
        let mask = window.map(|w| {
            DocumentMask::causal(1, n)
                .and_then(|m| m.narrowed(|_, i| (i + 1).saturating_sub(w)))
                .expect("window mask")
        });
        let name = match window {
            Some(w) => format!("flash_W{w}"),
            None => "baseline_flash_causal".into(),
        };
        let mut per_call = Vec::new();
        group.bench_function(BenchmarkId::new(&name, format!("T{n}")), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    let fwd = match &mask {
                        Some(m) => cpu.attention_forward_documents(&x.q, &x.k, &x.v, &config, m),
                        None => cpu.attention_forward(&x.q, &x.k, &x.v, &config),
                    }
                    .expect("forward");
                    let g = cpu
                        .attention_backward(&x.q, &x.k, &x.v, &fwd, &x.d_out)
                        .expect("backward");
                    black_box((fwd, g));
                }
                let took = start.elapsed();
                per_call.push(took.as_secs_f64() / iters.max(1) as f64);
                took
            })
        });
        medians_s.push((name, window, median(per_call)));
    }
    group.finish();
    let causal_s = medians_s
        .iter()
        .find(|(_, w, _)| w.is_none())
        .map(|&(_, _, s)| s);
    for (name, window, s) in &medians_s {
        let bench = format!("attn/window/fwd_bwd/{}/T{n}", algo_id(name));
        let baseline = window.map(|_| format!("attn/window/fwd_bwd/flash_causal/T{n}"));
        let base_s = causal_s.filter(|_| baseline.is_some());
        println!("{bench}: {:.1} ms", s * 1e3);
        write(Record {
            bench,
            metric: "median_time".into(),
            value: s * 1e3,
            unit: "ms".into(),
            baseline,
            baseline_value: base_s.map(|b| b * 1e3),
            ratio: base_s.map(|b| s / b),
            better: Better::Lower,
        });
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

/// The GPU section (issue 11): headroom's bf16 flash attention on a CUDA device, next to torch
/// SDPA on the same GPU (`benches/torch/attn.py --device cuda`).
#[cfg(feature = "cuda")]
mod on_cuda {
    use criterion::Criterion;
    use headroom_attn::accuracy::{compare, compare_lse, BF16_GRAD, BF16_OUTPUT, LSE_TOLERANCE};
    use headroom_attn::{AttentionBackend, AttentionConfig, AttentionDims};
    use headroom_benches::{Better, Record};
    use headroom_cuda::cudarc::driver::sys::CUevent_flags;
    use headroom_cuda::cudarc::driver::CudaEvent;
    use headroom_cuda::{Cuda, CudaTensor};
    use headroom_tensor::{bf16, Backend, Cpu, DType};

    use super::{median, write};

    /// The shape of `attn.py --device cuda`: FlashAttention-2's benchmark shape (batch × N =
    /// 16k tokens, width 16 · 128 = 2048), issue 11's N = 4096, D = 128, causal, bf16.
    const BATCH: usize = 4;
    const HEADS: usize = 16;
    const HEAD_DIM: usize = 128;
    const SEQ_LEN: usize = 4096;
    /// The record label `attn.py` uses for that shape.
    const LABEL: &str = "bf16/T4096_D128";
    /// Warm-up calls and timed calls per pass, as in `attn.py --device cuda` without `--quick`:
    /// a call takes milliseconds, so the full count costs seconds even on a slow kernel.
    const WARMUP_CALLS: usize = 10;
    const TIMED_CALLS: usize = 50;

    /// The numerics check: the benchmarked head_dim, causal, no GQA (as timed), batch 2 and 4
    /// heads; one length on the kernels' 64-row tiles (as N = 4096 is) and one off them.
    const CHECK_BATCH: usize = 2;
    const CHECK_HEADS: usize = 4;
    const CHECK_LENGTHS: [usize; 2] = [256, 300];

    /// Why the GPU section did not run (or stopped); printed as `attn/cuda: skipped: <why>`.
    type Skip = String;

    /// How the bench binary was started: `cargo bench` and the device bundle pass `--bench`;
    /// `cargo test --benches` does not, and then (like criterion's test mode) every pass runs
    /// once as a smoke test and nothing is recorded.
    #[derive(Clone, Copy, PartialEq)]
    enum Mode {
        Bench,
        Test,
    }

    /// Criterion's entry point for the GPU section; never panics for lack of a GPU.
    pub fn timings(_c: &mut Criterion) {
        let args: Vec<String> = std::env::args().collect();
        if args.iter().any(|a| a == "--list") {
            return; // nothing here is a criterion benchmark to list
        }
        let mode = if args.iter().any(|a| a == "--bench") {
            Mode::Bench
        } else {
            Mode::Test
        };
        if let Err(why) = run(mode) {
            println!("attn/cuda: skipped: {why}");
        }
    }

    fn run(mode: Mode) -> Result<(), Skip> {
        if let Err(e) = check_self_test() {
            // A broken check is this bench's own bug: fail `cargo test --benches` loudly.
            assert!(
                mode == Mode::Bench,
                "attn/cuda: the numerics check is broken: {e}"
            );
            return Err(format!("the numerics check is broken: {e}"));
        }
        println!(
            "attn/cuda: numerics check self-test passed (the CPU's bf16 flash passes it, a 5% \
             error in one dK value fails it)"
        );
        let cuda = Cuda::new(0).map_err(|e| e.to_string())?;
        println!(
            "attn/cuda: device {} ({}, compute capability {}.{}), driver CUDA {}.{}",
            cuda.device_name(),
            cuda.arch(),
            cuda.compute_capability().0,
            cuda.compute_capability().1,
            cuda.driver_version() / 1000,
            cuda.driver_version() % 1000 / 10,
        );
        // Compiles (NVRTC) and loads every attention kernel now, so no timed call pays for it.
        headroom_attn::load_attention_kernels(&cuda)
            .map_err(|e| format!("the attention kernels did not load: {}", with_sources(&e)))?;
        if let Err(e) = check_numerics(&cuda) {
            eprintln!("!!! attn/cuda: the CUDA flash kernels FAILED the check against the CPU !!!");
            eprintln!("!!! {e}");
            eprintln!("!!! nothing was timed: a bench must not time a wrong kernel");
            return Err(format!("numerics check failed: {e}"));
        }
        time_benchmark_shape(&cuda, mode)
    }

    /// `e` and its chain of sources (a kernel load failure wraps NVRTC's or the driver's).
    fn with_sources(e: &dyn std::error::Error) -> String {
        let mut text = e.to_string();
        let mut source = e.source();
        while let Some(s) = source {
            text.push_str(": ");
            text.push_str(&s.to_string());
            source = s.source();
        }
        text
    }

    // --------------------------------------------------------------------------------------
    // Inputs.

    /// `len` deterministic values, uniform in [-√3, √3): unit variance, like the
    /// `torch.randn` inputs of `attn.py` (kernel time does not depend on the values).
    fn unit_variance_values(len: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.max(1);
        let half_width = 3.0f32.sqrt();
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let unit = (state >> 8) as f32 / (1u32 << 24) as f32; // [0, 1)
                (2.0 * unit - 1.0) * half_width
            })
            .collect()
    }

    fn to_bf16(x: &[f32]) -> Vec<bf16> {
        x.iter().map(|&v| bf16::from_f32(v)).collect()
    }

    /// q, k, v and the output gradient of one problem, as bf16 host values.
    struct HostInputs {
        q: Vec<bf16>,
        k: Vec<bf16>,
        v: Vec<bf16>,
        d_out: Vec<bf16>,
    }

    fn host_inputs(len: usize, seed: u32) -> HostInputs {
        let next = |i: u32| to_bf16(&unit_variance_values(len, seed.wrapping_add(i)));
        HostInputs {
            q: next(0),
            k: next(1),
            v: next(2),
            d_out: next(3),
        }
    }

    struct DeviceInputs {
        q: CudaTensor,
        k: CudaTensor,
        v: CudaTensor,
        d_out: CudaTensor,
    }

    fn upload(cuda: &Cuda, x: &HostInputs, shape: [usize; 4]) -> Result<DeviceInputs, Skip> {
        let up = |data: &[bf16]| {
            cuda.upload(data, shape)
                .map_err(|e| format!("upload of {shape:?} bf16: {e}"))
        };
        Ok(DeviceInputs {
            q: up(&x.q)?,
            k: up(&x.k)?,
            v: up(&x.v)?,
            d_out: up(&x.d_out)?,
        })
    }

    // --------------------------------------------------------------------------------------
    // The numerics check.

    /// Output, logsumexp and gradients as host f32.
    struct Results {
        out: Vec<f32>,
        lse: Vec<f32>,
        dq: Vec<f32>,
        dk: Vec<f32>,
        dv: Vec<f32>,
    }

    fn widen(v: &[bf16]) -> Vec<f32> {
        v.iter().map(|b| b.to_f32()).collect()
    }

    /// Causal flash forward and backward on `backend`, from `x` uploaded by `upload`, results
    /// brought back to the host by `as_f32` (the logsumexp is f32 on every backend).
    fn flash_results<B: AttentionBackend>(
        backend: &B,
        x: &HostInputs,
        upload: impl Fn(&[bf16]) -> Result<B::Tensor, String>,
        as_f32: impl Fn(&B::Tensor) -> Result<Vec<f32>, String>,
    ) -> Result<Results, String> {
        let (q, k, v, d_out) = (
            upload(&x.q)?,
            upload(&x.k)?,
            upload(&x.v)?,
            upload(&x.d_out)?,
        );
        let config = AttentionConfig::flash().causal(true);
        let fwd = backend
            .attention_forward(&q, &k, &v, &config)
            .map_err(|e| format!("forward: {e}"))?;
        let g = backend
            .attention_backward(&q, &k, &v, &fwd, &d_out)
            .map_err(|e| format!("backward: {e}"))?;
        Ok(Results {
            out: as_f32(&fwd.output)?,
            lse: backend
                .download::<f32>(&fwd.logsumexp)
                .map_err(|e| format!("download of the logsumexp: {e}"))?,
            dq: as_f32(&g.dq)?,
            dk: as_f32(&g.dk)?,
            dv: as_f32(&g.dv)?,
        })
    }

    /// `backend`'s flash on bf16 inputs and results.
    fn bf16_flash<B: AttentionBackend>(
        backend: &B,
        x: &HostInputs,
        shape: [usize; 4],
    ) -> Result<Results, String> {
        flash_results(
            backend,
            x,
            |data| {
                backend
                    .upload(data, shape)
                    .map_err(|e| format!("upload: {e}"))
            },
            |t| {
                backend
                    .download::<bf16>(t)
                    .map(|v| widen(&v))
                    .map_err(|e| format!("download: {e}"))
            },
        )
    }

    /// The reference: the CPU's f32 flash on the same (bf16-rounded) inputs.
    fn cpu_f32_flash(cpu: &Cpu, x: &HostInputs, shape: [usize; 4]) -> Result<Results, String> {
        flash_results(
            cpu,
            x,
            |data| {
                cpu.upload(&widen(data), shape)
                    .map_err(|e| format!("upload: {e}"))
            },
            |t| cpu.download::<f32>(t).map_err(|e| format!("download: {e}")),
        )
    }

    /// Every tensor within its tolerance; on success the errors, as one printable line.
    fn check(got: &Results, want: &Results) -> Result<String, String> {
        let out = compare("output", &got.out, &want.out, &BF16_OUTPUT)?;
        let lse = compare_lse(&got.lse, &want.lse)?;
        let dq = compare("dq", &got.dq, &want.dq, &BF16_GRAD)?;
        let dk = compare("dk", &got.dk, &want.dk, &BF16_GRAD)?;
        let dv = compare("dv", &got.dv, &want.dv, &BF16_GRAD)?;
        Ok(format!(
            "max |error| / max |ref|: output {out:.2e} (tol {:.0e}), dq {dq:.2e}, dk {dk:.2e}, \
             dv {dv:.2e} (tol {:.0e}); lse {lse:.2e} (tol {LSE_TOLERANCE:.0e})",
            BF16_OUTPUT.max, BF16_GRAD.max
        ))
    }

    /// The check must be able to fail: it passes the CPU's own bf16 flash (a correct
    /// implementation with the GPU kernels' rounding) and rejects it once one dK value is off by
    /// 5% of the largest. Runs everywhere, GPU or not.
    fn check_self_test() -> Result<(), String> {
        let cpu = Cpu::new();
        let shape = [1, 2, 65, HEAD_DIM];
        let x = host_inputs(shape.iter().product(), 0x0dd_5eed);
        let want = cpu_f32_flash(&cpu, &x, shape)?;
        let mut got = bf16_flash(&cpu, &x, shape)?;
        check(&got, &want).map_err(|e| format!("the CPU's bf16 flash fails the check: {e}"))?;
        let largest = want.dk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let Some(one) = got.dk.get_mut(3) else {
            return Err("the self-test's dK has fewer than 4 values".into());
        };
        *one += 0.05 * largest;
        match check(&got, &want) {
            Err(e) if e.starts_with("dk") => Ok(()),
            Err(e) => Err(format!("a wrong dK was rejected for another reason: {e}")),
            Ok(_) => Err("a dK off by 5% of its largest value passed the check".into()),
        }
    }

    /// The GPU's bf16 flash against the CPU's f32 flash on every check length; prints the
    /// errors.
    fn check_numerics(cuda: &Cuda) -> Result<(), String> {
        let cpu = Cpu::new();
        for n in CHECK_LENGTHS {
            let shape = [CHECK_BATCH, CHECK_HEADS, n, HEAD_DIM];
            let case = format!("{shape:?} causal");
            let x = host_inputs(shape.iter().product(), 0x5eed_0000 + n as u32);
            let want = cpu_f32_flash(&cpu, &x, shape).map_err(|e| format!("{case}: CPU {e}"))?;
            let got = bf16_flash(cuda, &x, shape).map_err(|e| format!("{case}: CUDA {e}"))?;
            let errors = check(&got, &want).map_err(|e| format!("{case}: {e}"))?;
            println!("attn/cuda: numerics {case} vs the CPU's f32 flash: {errors}");
        }
        Ok(())
    }

    // --------------------------------------------------------------------------------------
    // Timing.

    fn timing_event(cuda: &Cuda) -> Result<CudaEvent, Skip> {
        cuda.context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| format!("cuEventCreate: {e:?}"))
    }

    /// One call of the pass: forward, and backward when `backward`; results dropped (freed
    /// stream-ordered) inside the call, as torch frees its outputs.
    fn call(cuda: &Cuda, x: &DeviceInputs, backward: bool) -> Result<(), Skip> {
        let config = AttentionConfig::flash().causal(true);
        let fwd = cuda
            .attention_forward(&x.q, &x.k, &x.v, &config)
            .map_err(|e| format!("forward: {e}"))?;
        if backward {
            let grads = cuda
                .attention_backward(&x.q, &x.k, &x.v, &fwd, &x.d_out)
                .map_err(|e| format!("backward: {e}"))?;
            drop(grads);
        }
        drop(fwd);
        Ok(())
    }

    /// Device milliseconds of each of `calls` calls, each bracketed by two events on the
    /// backend's stream (what `torch.cuda.Event` measures in `attn.py`).
    fn event_times_ms(
        cuda: &Cuda,
        x: &DeviceInputs,
        backward: bool,
        calls: usize,
    ) -> Result<Vec<f64>, Skip> {
        let (start, end) = (timing_event(cuda)?, timing_event(cuda)?);
        let mut times = Vec::with_capacity(calls);
        for _ in 0..calls {
            start
                .record(cuda.stream())
                .map_err(|e| format!("cuEventRecord: {e:?}"))?;
            call(cuda, x, backward)?;
            end.record(cuda.stream())
                .map_err(|e| format!("cuEventRecord: {e:?}"))?;
            // Waits for both events; a kernel fault surfaces here.
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| format!("cuEventElapsedTime: {e:?}"))?;
            times.push(f64::from(ms));
        }
        Ok(times)
    }

    fn time_benchmark_shape(cuda: &Cuda, mode: Mode) -> Result<(), Skip> {
        let shape = [BATCH, HEADS, SEQ_LEN, HEAD_DIM];
        let x = upload(
            cuda,
            &host_inputs(shape.iter().product(), 0x2545_f491),
            shape,
        )?;
        let dims = AttentionDims {
            batch: BATCH,
            q_heads: HEADS,
            kv_heads: HEADS,
            q_len: SEQ_LEN,
            kv_len: SEQ_LEN,
            head_dim: HEAD_DIM,
            dtype: DType::BF16,
        };
        // attn.py's count: 4·N²·d per head, halved for causal; forward+backward 3.5×.
        let forward_flops = dims.forward_flops(true);
        let (warmup, timed) = match mode {
            Mode::Bench => (WARMUP_CALLS, TIMED_CALLS),
            Mode::Test => (1, 1),
        };
        println!(
            "attn/cuda: batch {BATCH}, {HEADS} heads, head_dim {HEAD_DIM}, N {SEQ_LEN}, bf16, \
             causal; {warmup} warm-up calls, median of {timed}"
        );
        for (pass, backward, flops) in [
            ("fwd", false, forward_flops),
            ("fwd_bwd", true, 3.5 * forward_flops),
        ] {
            event_times_ms(cuda, &x, backward, warmup)?;
            let ms = median(event_times_ms(cuda, &x, backward, timed)?);
            let tflops = flops / (ms * 1e-3) / 1e12;
            let bench = format!("attn/cuda/{pass}/flash/{LABEL}");
            println!("{bench}: {ms:.3} ms, {tflops:.1} TFLOP/s");
            if mode == Mode::Test {
                continue;
            }
            // torch SDPA's records come from attn.py; xtask pairs them (baseline_value None).
            let baseline = Some(format!("attn/cuda/{pass}/torch_sdpa/{LABEL}"));
            write(Record {
                bench: bench.clone(),
                metric: "median_time".into(),
                value: ms,
                unit: "ms".into(),
                baseline: baseline.clone(),
                baseline_value: None,
                ratio: None,
                better: Better::Lower,
            });
            write(Record {
                bench,
                metric: "throughput".into(),
                value: tflops,
                unit: "TFLOP/s".into(),
                baseline,
                baseline_value: None,
                ratio: None,
                better: Better::Higher,
            });
        }
        Ok(())
    }
}

#[cfg(not(feature = "cuda"))]
criterion_group!(benches, memory, timings, windows);
#[cfg(feature = "cuda")]
criterion_group!(benches, memory, timings, windows, on_cuda::timings);
criterion_main!(benches);
