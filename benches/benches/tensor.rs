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

use std::hint::black_box;

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode,
    Throughput,
};
use headroom_benches::size_label;
use headroom_tensor::{Backend, Cpu, CpuTensor, DType};

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

criterion_group!(benches, primitives);
criterion_main!(benches);
