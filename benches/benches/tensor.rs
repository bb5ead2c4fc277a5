//! Bandwidth of headroom-tensor's CPU primitives (through the `Backend` trait on `Cpu`), each
//! measured beside a plain `copy_from_slice` in the same group so the report can state
//! "primitive bandwidth / memcpy bandwidth" for the same machine and the same run.
//!
//! Groups are `tensor/<primitive>`; the function under test is `headroom`, the baseline
//! `baseline_copy_from_slice`; the parameter is the size of the f32 buffer each primitive reads
//! or writes (`1MiB`, `64MiB`, `256MiB`), so every primitive handles `size / 4` elements.
//! Throughput is the bytes read plus the bytes written by one call, so the two functions of a
//! group are compared as bandwidths.
//!
//! Trade-off: the baseline copies the f32 buffer's bytes in every group (also where the
//! primitive's source is bf16), so one size label always means the same copy. Both sides are
//! far larger than the caches at 64 MiB and 256 MiB, where the comparison matters.
//!
//! ## GEMMs with bf16 weights (issue 21)
//!
//! Groups `tensor/gemm_{forward,backward}/<rows>x<in>x<out>`: the trainer's linear layer
//! (`headroom_trainer::ops::matmul`) with the weight in f32 (`f32`, the baseline), in bf16
//! read in place and widened a panel at a time (`bf16_weight`), and in bf16 through a whole
//! f32 copy made for the call (`bf16_upcast_view`, what the trainer did before). Throughput is
//! the multiply-adds' flops (2·rows·in·out per product; backward has two products), so the
//! functions of a group compare as GFLOP/s. Shapes: GPT-2 124M's c_attn, c_fc and c_proj at
//! 8×256 rows, and the `small` model's head on one 128-row chunk of the fused loss (vocab
//! 50257, width 384). `cargo bench -p headroom-benches --bench tensor -- tensor/gemm` runs
//! only these.
//!
//! ## GELU (issue 21)
//!
//! Groups `tensor/gelu_forward` and `tensor/gelu_backward`: the trainer's GELU over
//! GPT-2 124M's MLP activation at 8×256 tokens, with an `f32` and a `bf16` input. Its element
//! loops are compiled per instruction set and chosen at run time, so running the group under
//! `HEADROOM_CPU_ISA=baseline`, `avx2` and unset compares those paths on one machine
//! (`cargo bench -p headroom-benches --bench tensor -- tensor/gelu`).
//!
//! ## Gated MLPs
//!
//! Groups `tensor/glu_forward` and `tensor/glu_backward`: SwiGLU's and Gemma's GeGLU gate
//! over Gemma 3 1B's MLP activation at 512 tokens, beside `silu_libm`, the SiLU gate as it was
//! before its loops vectorised (libm's scalar `exp`, the default pieces), the same-run
//! baseline; `HEADROOM_CPU_ISA=baseline` against unset compares the gates' paths (`cargo bench
//! -p headroom-benches --bench tensor -- tensor/glu`).
//!
//! On a shared or noisy machine criterion's one-function-after-another timing drifts with the
//! load; `HEADROOM_GEMM_PAIRED=<rounds>` first times the three variants *interleaved* (one call
//! of each per round, the order rotating), and prints each one's median and the ratios of the
//! medians per shape — the figures the results file quotes — then the bf16 GEMM's forward
//! from an f32 and from a bf16 input (the trainer's bf16 forward reads a kept bf16 activation),
//! interleaved the same way.

use std::hint::black_box;

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode,
    Throughput,
};
use half::bf16;
use headroom_benches::size_label;
use headroom_tensor::{Backend, Cpu, CpuTensor, DType};
use headroom_trainer::ops::bf16_gemm;
use headroom_trainer::ops::matmul;
use headroom_trainer::ops::strided::Strided;

/// Sizes of the f32 buffer of each primitive.
const SIZES: [usize; 3] = [1 << 20, 64 << 20, 256 << 20];

const F32_BYTES: usize = 4;

/// Deterministic finite values in [-2, 2): varied enough that no conversion takes a trivial
/// path (zeros, one exponent), cheap enough to fill 256 MiB quickly.
fn fill_values(x: &mut [f32]) {
    let mut state = 0x9e37_79b9u32;
    for v in x {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        *v = (state >> 8) as f32 / (1u32 << 22) as f32 - 2.0;
    }
}

fn f32_tensor(cpu: &Cpu, n: usize) -> CpuTensor {
    let mut t = cpu.zeros([n], DType::F32).expect("allocate f32 tensor");
    fill_values(t.as_mut_slice::<f32>().expect("f32 tensor"));
    t
}

/// A tensor of `dtype` holding the same values as an f32 tensor (rounded), written through
/// the backend so every page is touched before timing starts.
fn tensor_of(cpu: &Cpu, n: usize, dtype: DType) -> CpuTensor {
    let src = f32_tensor(cpu, n);
    if dtype == DType::F32 {
        return src;
    }
    let mut dst = cpu.zeros([n], dtype).expect("allocate tensor");
    cpu.cast(&src, &mut dst).expect("cast");
    dst
}

/// The baseline beside every primitive: a single `copy_from_slice` of `bytes` bytes, counted
/// as `bytes` read plus `bytes` written.
fn bench_copy_baseline(group: &mut BenchmarkGroup<'_, WallTime>, bytes: usize) {
    let n = bytes / F32_BYTES;
    let mut src = vec![0f32; n];
    fill_values(&mut src);
    // Written once so the destination's pages exist before timing, like the tensors' pages.
    let mut dst = src.clone();
    group.throughput(Throughput::Bytes((2 * bytes) as u64));
    group.bench_function(
        BenchmarkId::new("baseline_copy_from_slice", size_label(bytes)),
        |b| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&src));
                black_box(&mut dst);
            })
        },
    );
}

/// Large buffers take tens of milliseconds per call; flat sampling keeps the sample count
/// (and so the run time) bounded instead of growing iterations linearly per sample.
fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sampling_mode(SamplingMode::Flat);
    g
}

fn bench_cast(c: &mut Criterion, name: &str, from: DType, to: DType) {
    let mut g = group(c, name);
    for bytes in SIZES {
        let n = bytes / F32_BYTES;
        let cpu = Cpu::new();
        let src = tensor_of(&cpu, n, from);
        let mut dst = tensor_of(&cpu, n, to);
        let moved = n * (from.size_in_bytes() + to.size_in_bytes());
        g.throughput(Throughput::Bytes(moved as u64));
        g.bench_function(BenchmarkId::new("headroom", size_label(bytes)), |b| {
            b.iter(|| {
                cpu.cast(black_box(&src), black_box(&mut dst))
                    .expect("cast")
            })
        });
        drop((src, dst));
        bench_copy_baseline(&mut g, bytes);
    }
    g.finish();
}

fn bench_axpy(c: &mut Criterion, name: &str, x_dtype: DType) {
    let mut g = group(c, name);
    for bytes in SIZES {
        let n = bytes / F32_BYTES;
        let cpu = Cpu::new();
        let x = tensor_of(&cpu, n, x_dtype);
        let mut y = f32_tensor(&cpu, n);
        // x read, y read and written.
        let moved = n * (x_dtype.size_in_bytes() + 2 * F32_BYTES);
        g.throughput(Throughput::Bytes(moved as u64));
        // Alternating signs keep y bounded however many iterations criterion runs.
        let mut alpha = 0.5f32;
        g.bench_function(BenchmarkId::new("headroom", size_label(bytes)), |b| {
            b.iter(|| {
                alpha = -alpha;
                cpu.axpy(alpha, black_box(&x), black_box(&mut y))
                    .expect("axpy")
            })
        });
        drop((x, y));
        bench_copy_baseline(&mut g, bytes);
    }
    g.finish();
}

fn bench_unscale_and_check(c: &mut Criterion) {
    let mut g = group(c, "tensor/unscale_and_check_f32");
    for bytes in SIZES {
        let n = bytes / F32_BYTES;
        let cpu = Cpu::new();
        let mut grads = f32_tensor(&cpu, n);
        // In place: every element read and written.
        g.throughput(Throughput::Bytes((2 * n * F32_BYTES) as u64));
        // Alternating 2 and 1/2 (exact in binary) keeps the data unchanged on average, so
        // repeated calls never drift into subnormals (slow on some CPUs) or overflow.
        let mut inv_scale = 0.5f32;
        g.bench_function(BenchmarkId::new("headroom", size_label(bytes)), |b| {
            b.iter(|| {
                inv_scale = 1.0 / inv_scale;
                let found = cpu
                    .unscale_and_check(&mut [black_box(&mut grads)], inv_scale)
                    .expect("unscale_and_check");
                assert!(!found, "finite data reported as non-finite");
            })
        });
        drop(grads);
        bench_copy_baseline(&mut g, bytes);
    }
    g.finish();
}

fn primitives(c: &mut Criterion) {
    bench_cast(c, "tensor/cast_f32_to_bf16", DType::F32, DType::BF16);
    bench_cast(c, "tensor/cast_f32_to_f16", DType::F32, DType::F16);
    bench_cast(c, "tensor/cast_bf16_to_f32", DType::BF16, DType::F32);
    bench_axpy(c, "tensor/axpy_bf16_into_f32", DType::BF16);
    bench_axpy(c, "tensor/axpy_f32_into_f32", DType::F32);
    bench_unscale_and_check(c);
}

/// `(rows, in, out)` of the benchmarked linears.
const GEMM_SHAPES: [(usize, usize, usize); 4] = [
    (2048, 768, 2304),
    (2048, 768, 3072),
    (2048, 3072, 768),
    (128, 384, 50257),
];

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = vec![0.0f32; n];
    fill_values(&mut x);
    let k = seed as usize % n.max(1);
    x.rotate_left(k);
    x
}

/// The old path's whole-weight f32 copy, over the threads as the backend's cast is.
fn upcast(w: &[bf16], view: &mut [f32]) {
    use rayon::prelude::*;
    view.par_chunks_mut(1 << 16)
        .zip(w.par_chunks(1 << 16))
        .for_each(|(d, s)| matmul::widen_bf16(s, d));
}

/// Median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// The interleaved timing `HEADROOM_GEMM_PAIRED` asks for (see the module notes).
fn gemm_paired(rounds: usize) {
    use std::time::Instant;
    for (rows, inp, out) in GEMM_SHAPES {
        let x = values(rows * inp, 1);
        let dy = values(rows * out, 2);
        let s = 1.0 / (inp as f32).sqrt();
        let wb: Vec<bf16> = values(out * inp, 3)
            .iter()
            .map(|v| bf16::from_f32(v * s))
            .collect();
        let wf: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let mut view = vec![0.0f32; out * inp];
        let mut scratch = vec![
            0.0f32;
            matmul::forward_scratch(rows, inp, out)
                .max(matmul::backward_scratch(rows, inp, out))
        ];
        let mut y = vec![0.0f32; rows * out];
        let (mut dx, mut dw) = (vec![0.0f32; rows * inp], vec![0.0f32; out * inp]);
        let flops = (2 * rows * inp * out) as f64;
        for backward in [false, true] {
            let mut t = [vec![], vec![], vec![], vec![]];
            for r in 0..rounds + 1 {
                for j in 0..4 {
                    let v = (j + r) % 4;
                    let start = Instant::now();
                    match (backward, v) {
                        (false, 0) => matmul::forward(&mut y, &x, &wf, None, rows, inp, out),
                        (false, 1) => matmul::forward_with(
                            &mut y,
                            &x,
                            &wb,
                            None,
                            rows,
                            inp,
                            out,
                            &mut scratch,
                        ),
                        (false, 2) => {
                            upcast(&wb, &mut view);
                            matmul::forward(&mut y, &x, &view, None, rows, inp, out)
                        }
                        (false, _) => bf16_gemm::gemm_bf16(
                            &mut y,
                            out,
                            Strided::rows(&x[..], inp),
                            Strided::transposed(&wb[..], inp),
                            rows,
                            out,
                            inp,
                            false,
                        ),
                        (true, 0) => {
                            matmul::backward(&mut dx, &mut dw, None, &dy, &x, &wf, rows, inp, out)
                        }
                        (true, 1) => matmul::backward_with(
                            &mut dx,
                            Some(&mut dw),
                            None,
                            &dy,
                            &x,
                            &wb,
                            rows,
                            inp,
                            out,
                            &mut scratch,
                        ),
                        (true, 2) => {
                            upcast(&wb, &mut view);
                            matmul::backward(&mut dx, &mut dw, None, &dy, &x, &view, rows, inp, out)
                        }
                        (true, _) => {
                            bf16_gemm::gemm_bf16(
                                &mut dx,
                                inp,
                                Strided::rows(&dy[..], out),
                                Strided::rows(&wb[..], inp),
                                rows,
                                inp,
                                out,
                                true,
                            );
                            bf16_gemm::gemm_bf16(
                                &mut dw,
                                inp,
                                Strided::transposed(&dy[..], out),
                                Strided::rows(&x[..], inp),
                                out,
                                inp,
                                rows,
                                true,
                            );
                        }
                    }
                    black_box(&y);
                    // Round 0 is warm-up.
                    if r > 0 {
                        t[v].push(start.elapsed().as_secs_f64());
                    }
                }
            }
            let m: Vec<f64> = t.iter_mut().map(|v| median(v)).collect();
            let products = if backward { 2.0 } else { 1.0 };
            let gf = |s: f64| products * flops / s / 1e9;
            eprintln!(
                "paired {} {rows}x{inp}x{out} ({rounds} rounds): f32 {:.2} ms ({:.1} GFLOP/s), \
                 bf16_weight {:.2} ms ({:.1}), bf16_upcast_view {:.2} ms ({:.1}), \
                 bf16_gemm ({:?}) {:.2} ms ({:.1}); bf16_weight/f32 throughput {:.3}, \
                 bf16_weight/upcast_view {:.3}, bf16_gemm/f32 throughput {:.3}",
                if backward { "backward" } else { "forward" },
                m[0] * 1e3,
                gf(m[0]),
                m[1] * 1e3,
                gf(m[1]),
                m[2] * 1e3,
                gf(m[2]),
                bf16_gemm::bf16_gemm_path(),
                m[3] * 1e3,
                gf(m[3]),
                m[0] / m[1],
                m[2] / m[1],
                m[0] / m[3],
            );
        }
    }
}

/// The bf16 GEMM's forward product from an f32 input (rounded while packed) and from the same
/// values already bf16 (a kept activation, as the trainer's bf16 forward passes it), timed
/// interleaved: the two differ only in how `a` is packed.
fn gemm_paired_bf16_input(rounds: usize) {
    use std::time::Instant;
    for (rows, inp, out) in GEMM_SHAPES {
        let xb: Vec<bf16> = values(rows * inp, 1)
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        let xf: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let s = 1.0 / (inp as f32).sqrt();
        let wb: Vec<bf16> = values(out * inp, 3)
            .iter()
            .map(|v| bf16::from_f32(v * s))
            .collect();
        let mut y = vec![0.0f32; rows * out];
        let mut t = [vec![], vec![]];
        for r in 0..rounds + 1 {
            for j in 0..2 {
                let v = (j + r) % 2;
                let w = Strided::transposed(&wb[..], inp);
                let start = Instant::now();
                if v == 0 {
                    bf16_gemm::gemm_bf16(
                        &mut y,
                        out,
                        Strided::rows(&xf[..], inp),
                        w,
                        rows,
                        out,
                        inp,
                        false,
                    );
                } else {
                    bf16_gemm::gemm_bf16(
                        &mut y,
                        out,
                        Strided::rows(&xb[..], inp),
                        w,
                        rows,
                        out,
                        inp,
                        false,
                    );
                }
                black_box(&y);
                if r > 0 {
                    t[v].push(start.elapsed().as_secs_f64());
                }
            }
        }
        let (f, b) = (median(&mut t[0]), median(&mut t[1]));
        let gf = |s: f64| (2 * rows * inp * out) as f64 / s / 1e9;
        eprintln!(
            "paired bf16-input forward {rows}x{inp}x{out} ({rounds} rounds, {:?}): f32 input \
             {:.2} ms ({:.1} GFLOP/s), bf16 input {:.2} ms ({:.1}); bf16/f32 input throughput {:.3}",
            bf16_gemm::bf16_gemm_path(),
            f * 1e3,
            gf(f),
            b * 1e3,
            gf(b),
            f / b,
        );
    }
}

fn gemm(c: &mut Criterion) {
    if let Some(rounds) = std::env::var("HEADROOM_GEMM_PAIRED")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&r| r > 0)
    {
        gemm_paired(rounds);
        gemm_paired_bf16_input(rounds);
    }
    for (rows, inp, out) in GEMM_SHAPES {
        let label = format!("{rows}x{inp}x{out}");
        let x = values(rows * inp, 1);
        let dy = values(rows * out, 2);
        // Weights are O(1/√in) as initialised models have, kept exactly bf16-representable.
        let s = 1.0 / (inp as f32).sqrt();
        let wb: Vec<bf16> = values(out * inp, 3)
            .iter()
            .map(|v| bf16::from_f32(v * s))
            .collect();
        let wf: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let mut view = vec![0.0f32; out * inp];
        let scratch_len =
            matmul::forward_scratch(rows, inp, out).max(matmul::backward_scratch(rows, inp, out));
        let mut scratch = vec![0.0f32; scratch_len];
        let flops = 2 * rows * inp * out;

        let mut y = vec![0.0f32; rows * out];
        let mut g = c.benchmark_group(format!("tensor/gemm_forward/{label}"));
        g.sample_size(10).sampling_mode(SamplingMode::Flat);
        g.throughput(Throughput::Elements(flops as u64));
        g.bench_function("f32", |b| {
            b.iter(|| matmul::forward(&mut y, black_box(&x), black_box(&wf), None, rows, inp, out))
        });
        g.bench_function("bf16_weight", |b| {
            b.iter(|| {
                matmul::forward_with(
                    &mut y,
                    black_box(&x),
                    black_box(&wb),
                    None,
                    rows,
                    inp,
                    out,
                    &mut scratch,
                )
            })
        });
        g.bench_function("bf16_upcast_view", |b| {
            b.iter(|| {
                upcast(black_box(&wb), &mut view);
                matmul::forward(&mut y, black_box(&x), &view, None, rows, inp, out)
            })
        });
        g.finish();

        let (mut dx, mut dw) = (vec![0.0f32; rows * inp], vec![0.0f32; out * inp]);
        let mut g = c.benchmark_group(format!("tensor/gemm_backward/{label}"));
        g.sample_size(10).sampling_mode(SamplingMode::Flat);
        g.throughput(Throughput::Elements(2 * flops as u64));
        // Gradients accumulate across iterations; values stay finite (O(iterations) growth).
        g.bench_function("f32", |b| {
            b.iter(|| {
                matmul::backward(
                    &mut dx,
                    &mut dw,
                    None,
                    &dy,
                    &x,
                    black_box(&wf),
                    rows,
                    inp,
                    out,
                )
            })
        });
        g.bench_function("bf16_weight", |b| {
            b.iter(|| {
                matmul::backward_with(
                    &mut dx,
                    Some(&mut dw),
                    None,
                    &dy,
                    &x,
                    black_box(&wb),
                    rows,
                    inp,
                    out,
                    &mut scratch,
                )
            })
        });
        g.bench_function("bf16_upcast_view", |b| {
            b.iter(|| {
                upcast(black_box(&wb), &mut view);
                matmul::backward(&mut dx, &mut dw, None, &dy, &x, &view, rows, inp, out)
            })
        });
        g.finish();
    }
}

/// Elements of the GELU benches: GPT-2 124M's MLP activation at 8×256 tokens (2048 × 3072).
const GELU_ELEMS: usize = 2048 * 3072;

/// GELU forward and backward (the trainer's `ops::gelu`), on an f32 and a bf16 input;
/// throughput in elements. The kernels run on the widest vectors `HEADROOM_CPU_ISA` allows, so
/// runs of this group under `baseline`, `avx2` and the native level compare the paths.
///
/// Backward is the accumulating form (`dinp += gelu'(x)·dout`, the in-place one's arithmetic
/// plus one more stream): repeated in place, a gradient would shrink into subnormals, which
/// some CPUs process slowly, and time that instead.
fn gelu(c: &mut Criterion) {
    use headroom_trainer::ops::gelu;
    let x = values(GELU_ELEMS, 5);
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let dout = values(GELU_ELEMS, 6);
    let mut out = vec![0f32; GELU_ELEMS];
    for direction in ["forward", "backward"] {
        let mut g = group(c, &format!("tensor/gelu_{direction}"));
        g.throughput(Throughput::Elements(GELU_ELEMS as u64));
        g.bench_function("f32", |b| {
            b.iter(|| match direction {
                "forward" => gelu::forward(black_box(&mut out), black_box(&x)),
                _ => gelu::backward(black_box(&mut out), black_box(&x), black_box(&dout)),
            })
        });
        g.bench_function("bf16", |b| {
            b.iter(|| match direction {
                "forward" => gelu::forward(black_box(&mut out), black_box(&xb)),
                _ => gelu::backward(black_box(&mut out), black_box(&xb), black_box(&dout)),
            })
        });
        g.finish();
    }
}

/// Elements of the gated-MLP benches: Gemma 3 1B's MLP activation at 512 tokens (512 × 6912).
const GLU_ELEMS: usize = 512 * 6912;

/// SiLU through libm's scalar `exp` with the [`Gate`](headroom_trainer::ops::glu::Gate)
/// trait's default (unvectorised) pieces: the trainer's SwiGLU gate before its loops used
/// `fast_math::exp` and were compiled per instruction set.
struct SiluLibm;

impl headroom_trainer::ops::glu::Gate for SiluLibm {
    fn value(g: f32, u: f32) -> f32 {
        g * (1.0 / (1.0 + (-g).exp())) * u
    }

    fn gradient_terms(g: f32, u: f32, d: f32) -> (f32, f32) {
        let s = 1.0 / (1.0 + (-g).exp());
        (s * (1.0 + g * (1.0 - s)) * u * d, g * s * d)
    }
}

/// The gated MLPs' gate (the trainer's `ops::glu`): SwiGLU's SiLU and Gemma's tanh-GELU, f32,
/// forward and backward (the accumulating form, as the GELU group times it), and
/// [`SiluLibm`] as the baseline; throughput in elements. The gates' loops run on the widest
/// vectors `HEADROOM_CPU_ISA` allows, so runs under `baseline` and the native level compare
/// their paths.
fn glu(c: &mut Criterion) {
    use headroom_trainer::ops::glu::{self, GeluTanh, Silu};
    let gate = values(GLU_ELEMS, 7);
    let up = values(GLU_ELEMS, 8);
    let dout = values(GLU_ELEMS, 9);
    let mut out = vec![0f32; GLU_ELEMS];
    let mut dgate = vec![0f32; GLU_ELEMS];
    for direction in ["forward", "backward"] {
        let mut g = group(c, &format!("tensor/glu_{direction}"));
        g.throughput(Throughput::Elements(GLU_ELEMS as u64));
        g.bench_function("silu_libm", |b| {
            b.iter(|| match direction {
                "forward" => glu::forward::<SiluLibm, f32>(black_box(&mut out), &gate, &up),
                _ => glu::backward::<SiluLibm, f32>(&mut dgate, &mut out, &gate, &up, &dout),
            })
        });
        g.bench_function("silu", |b| {
            b.iter(|| match direction {
                "forward" => glu::forward::<Silu, f32>(black_box(&mut out), &gate, &up),
                _ => glu::backward::<Silu, f32>(&mut dgate, &mut out, &gate, &up, &dout),
            })
        });
        g.bench_function("gelu_tanh", |b| {
            b.iter(|| match direction {
                "forward" => glu::forward::<GeluTanh, f32>(black_box(&mut out), &gate, &up),
                _ => glu::backward::<GeluTanh, f32>(&mut dgate, &mut out, &gate, &up, &dout),
            })
        });
        g.finish();
    }
}

criterion_group!(benches, primitives, gemm, gelu, glu);
criterion_main!(benches);
