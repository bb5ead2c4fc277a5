//! Threaded, vectorisable CPU kernels on plain slices.
//!
//! Every kernel splits its input into fixed chunks of [`CHUNK`] elements and hands them to
//! rayon. Elementwise kernels do not care about the split; the reduction ([`sum_squares`])
//! sums per-chunk partials in chunk order, so its result depends only on the input length, never
//! on the number of threads. Inner loops are branch-free over plain arrays so LLVM vectorises
//! them; f16 conversions go through `half`'s slice routines, which use F16C when the CPU has it.
//!
//! These functions are public so other crates' CPU paths can reuse them on their own buffers.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// Elements per parallel task. Fixed: it defines the reduction order of [`sum_squares`].
pub const CHUNK: usize = 1 << 15;

/// Below this many elements an elementwise kernel runs on the calling thread: handing 1 MiB of
/// work to rayon costs more than doing it (measured: bf16→f32 at 1 MiB ran at ~31 GB/s through
/// the pool against 77–134 GB/s inline). Elementwise results do not depend on the split.
pub const PAR_MIN: usize = 1 << 19;

/// Elements converted at a time through an on-stack f32 buffer inside a chunk.
const BLOCK: usize = 512;

/// A borrowed float buffer of any supported precision.
#[derive(Clone, Copy, Debug)]
pub enum FloatSlice<'a> {
    /// f32 data.
    F32(&'a [f32]),
    /// f16 data.
    F16(&'a [f16]),
    /// bf16 data.
    BF16(&'a [bf16]),
}

/// A mutably borrowed float buffer of any supported precision.
#[derive(Debug)]
pub enum FloatSliceMut<'a> {
    /// f32 data.
    F32(&'a mut [f32]),
    /// f16 data.
    F16(&'a mut [f16]),
    /// bf16 data.
    BF16(&'a mut [bf16]),
}

impl FloatSlice<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            FloatSlice::F32(s) => s.len(),
            FloatSlice::F16(s) => s.len(),
            FloatSlice::BF16(s) => s.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl FloatSliceMut<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            FloatSliceMut::F32(s) => s.len(),
            FloatSliceMut::F16(s) => s.len(),
            FloatSliceMut::BF16(s) => s.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// ---------------------------------------------------------------------------------------------
// bf16 bit conversions, written branch-free so whole loops vectorise. They agree bit for bit
// with `half::bf16::{from_f32, to_f32}` (round-to-nearest-even; NaN quieted, sign kept).

/// f32 → bf16 bits, round to nearest even; NaN becomes a quiet NaN with the same sign.
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let is_nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    // Wrapping: only NaN inputs can overflow here, and their result is discarded below.
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x0040;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

/// bf16 bits → f32 (exact).
#[inline(always)]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

// ---------------------------------------------------------------------------------------------
// Parallel drivers.

fn par_zip<A: Sync, B: Send>(a: &[A], b: &mut [B], f: impl Fn(&[A], &mut [B]) + Sync) {
    debug_assert_eq!(a.len(), b.len());
    if a.len() <= PAR_MIN {
        f(a, b);
    } else {
        a.par_chunks(CHUNK)
            .zip(b.par_chunks_mut(CHUNK))
            .for_each(|(a, b)| f(a, b));
    }
}

fn par_each<A: Send>(a: &mut [A], f: impl Fn(&mut [A]) + Sync + Send) {
    if a.len() <= PAR_MIN {
        f(a);
    } else {
        a.par_chunks_mut(CHUNK).for_each(f);
    }
}

/// Run `f` on each `BLOCK` of `src` after widening it to f32 in a stack buffer.
#[inline(always)]
fn widen_blocks<T: Copy>(
    src: &[T],
    widen: impl Fn(&[T], &mut [f32]),
    mut f: impl FnMut(usize, &[f32]),
) {
    let mut buf = [0f32; BLOCK];
    for (i, block) in src.chunks(BLOCK).enumerate() {
        let w = &mut buf[..block.len()];
        widen(block, w);
        f(i * BLOCK, w);
    }
}

fn widen_f16(s: &[f16], d: &mut [f32]) {
    s.convert_to_f32_slice(d);
}

// The bf16 conversions below are a handful of integer operations per value; compiled for the
// baseline they ran 4 values per instruction, and a bf16 training step's casts and roundings
// were a few percent of it on AVX2 paths. The wider copies give the same bits (integer
// arithmetic and selects only).

#[inline(always)]
fn widen_bf16_body(s: &[bf16], d: &mut [f32]) {
    for (d, s) in d.iter_mut().zip(s) {
        *d = bf16_bits_to_f32(s.to_bits());
    }
}

crate::multiversion!(
    /// bf16 → f32, exact (a shift; NaN payloads kept), over the shorter of the two slices.
    /// One thread: for a panel or a chunk that a caller's own loop hands it.
    pub fn widen_bf16 => widen_bf16_body(s: &[bf16], d: &mut [f32]) -> ()
);

fn narrow_f16(s: &[f32], d: &mut [f16]) {
    d.convert_from_f32_slice(s);
}

#[inline(always)]
fn narrow_bf16_body(s: &[f32], d: &mut [bf16]) {
    for (d, s) in d.iter_mut().zip(s) {
        *d = bf16::from_bits(f32_to_bf16_bits(*s));
    }
}

crate::multiversion!(
    /// f32 → bf16, round to nearest even (NaN kept quiet), over the shorter of the two
    /// slices. One thread, as [`widen_bf16`].
    pub fn narrow_bf16 => narrow_bf16_body(s: &[f32], d: &mut [bf16]) -> ()
);

#[inline(always)]
fn round_to_bf16_body(x: &mut [f32]) {
    for v in x {
        *v = bf16_bits_to_f32(f32_to_bf16_bits(*v));
    }
}

crate::multiversion!(
    /// Rounds f32 values in place to the nearest bf16 (ties to even, NaN kept quiet), kept as
    /// f32: what storing them in bf16 and reading them back gives. One thread; for a row or a
    /// chunk that a caller's own parallel loop hands it.
    pub fn round_to_bf16_in_place => round_to_bf16_body(x: &mut [f32]) -> ()
);

// ---------------------------------------------------------------------------------------------
// Cast.

/// `dst = src` with conversion between precisions. Lengths must match (checked by callers;
/// mismatched tails are ignored here).
pub fn cast(src: FloatSlice<'_>, dst: FloatSliceMut<'_>) {
    use FloatSlice as S;
    use FloatSliceMut as D;
    match (src, dst) {
        (S::F32(s), D::F32(d)) => par_zip(s, d, |s, d| d.copy_from_slice(s)),
        (S::F16(s), D::F16(d)) => par_zip(s, d, |s, d| d.copy_from_slice(s)),
        (S::BF16(s), D::BF16(d)) => par_zip(s, d, |s, d| d.copy_from_slice(s)),
        (S::F32(s), D::BF16(d)) => par_zip(s, d, narrow_bf16),
        (S::F32(s), D::F16(d)) => par_zip(s, d, narrow_f16),
        (S::BF16(s), D::F32(d)) => par_zip(s, d, widen_bf16),
        (S::F16(s), D::F32(d)) => par_zip(s, d, widen_f16),
        (S::F16(s), D::BF16(d)) => par_zip(s, d, |s, d| {
            widen_blocks(s, widen_f16, |o, w| narrow_bf16(w, &mut d[o..o + w.len()]))
        }),
        (S::BF16(s), D::F16(d)) => par_zip(s, d, |s, d| {
            widen_blocks(s, widen_bf16, |o, w| narrow_f16(w, &mut d[o..o + w.len()]))
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Scale.

fn scale_f32(x: &mut [f32], alpha: f32) {
    for v in x {
        *v *= alpha;
    }
}

/// `x *= alpha`, computed in f32 and rounded back for f16/bf16.
pub fn scale(x: FloatSliceMut<'_>, alpha: f32) {
    match x {
        FloatSliceMut::F32(x) => par_each(x, |x| scale_f32(x, alpha)),
        FloatSliceMut::BF16(x) => par_each(x, |x| {
            for v in x {
                *v = bf16::from_bits(f32_to_bf16_bits(bf16_bits_to_f32(v.to_bits()) * alpha));
            }
        }),
        FloatSliceMut::F16(x) => par_each(x, |x| {
            let mut buf = [0f32; BLOCK];
            for block in x.chunks_mut(BLOCK) {
                let w = &mut buf[..block.len()];
                widen_f16(block, w);
                scale_f32(w, alpha);
                narrow_f16(w, block);
            }
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// axpy.

fn axpy_f32(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * *x;
    }
}

/// `y += alpha * x`, `x` in any precision, `y` f32, no fused multiply-add.
pub fn axpy(alpha: f32, x: FloatSlice<'_>, y: &mut [f32]) {
    match x {
        FloatSlice::F32(x) => par_zip(x, y, |x, y| axpy_f32(alpha, x, y)),
        FloatSlice::BF16(x) => par_zip(x, y, |x, y| {
            for (y, x) in y.iter_mut().zip(x) {
                *y += alpha * bf16_bits_to_f32(x.to_bits());
            }
        }),
        FloatSlice::F16(x) => par_zip(x, y, |x, y| {
            widen_blocks(x, widen_f16, |o, w| {
                axpy_f32(alpha, w, &mut y[o..o + w.len()])
            })
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Sum of squares.

/// Lanes of independent f64 accumulators inside a chunk: enough to fill two AVX-512 registers
/// of f64 and to let the compiler vectorise without reassociating anything.
const LANES: usize = 8;

#[inline(always)]
fn sum_squares_f32_chunk(x: &[f32]) -> f64 {
    let mut acc = [0f64; LANES];
    let mut it = x.chunks_exact(LANES);
    for c in &mut it {
        for l in 0..LANES {
            let v = c[l] as f64;
            acc[l] += v * v;
        }
    }
    for (l, &v) in it.remainder().iter().enumerate() {
        let v = v as f64;
        acc[l] += v * v;
    }
    // Fixed pairwise combination of the lanes.
    let a = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (a[0] + a[2]) + (a[1] + a[3])
}

fn chunked_sum(len: usize, partial: impl Fn(usize) -> f64 + Sync) -> f64 {
    let chunks = len.div_ceil(CHUNK);
    // The same chunk partials either way; only who computes them changes.
    let partials: Vec<f64> = if len <= PAR_MIN {
        (0..chunks).map(&partial).collect()
    } else {
        (0..chunks).into_par_iter().map(&partial).collect()
    };
    // Sequential in chunk order: the result does not depend on how chunks were scheduled.
    // (A fold from +0.0: `Sum` for floats starts at -0.0, which an empty input would return.)
    partials.iter().fold(0.0, |acc, p| acc + p)
}

/// `Σ x²` in f64, reproducible for any thread count.
pub fn sum_squares(x: FloatSlice<'_>) -> f64 {
    let range = |i: usize, len: usize| i * CHUNK..((i + 1) * CHUNK).min(len);
    match x {
        FloatSlice::F32(x) => {
            chunked_sum(x.len(), |i| sum_squares_f32_chunk(&x[range(i, x.len())]))
        }
        FloatSlice::BF16(x) => chunked_sum(x.len(), |i| {
            let mut total = 0f64;
            let mut buf = [0f32; BLOCK];
            // Blocks are summed in order into one chunk partial; block boundaries are fixed too.
            for block in x[range(i, x.len())].chunks(BLOCK) {
                let w = &mut buf[..block.len()];
                widen_bf16(block, w);
                total += sum_squares_f32_chunk(w);
            }
            total
        }),
        FloatSlice::F16(x) => chunked_sum(x.len(), |i| {
            let mut total = 0f64;
            let mut buf = [0f32; BLOCK];
            for block in x[range(i, x.len())].chunks(BLOCK) {
                let w = &mut buf[..block.len()];
                widen_f16(block, w);
                total += sum_squares_f32_chunk(w);
            }
            total
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Unscale and check.

/// Multiply by `inv_scale` and return whether any input was non-finite (branch-free).
#[inline(always)]
fn unscale_f32(x: &mut [f32], inv_scale: f32) -> bool {
    let mut bad = 0u32;
    for v in x {
        bad |= ((v.to_bits() & 0x7f80_0000) == 0x7f80_0000) as u32;
        *v *= inv_scale;
    }
    bad != 0
}

/// `x *= inv_scale`; returns `true` if any input element was infinite or NaN.
pub fn unscale_and_check(x: FloatSliceMut<'_>, inv_scale: f32) -> bool {
    fn any(len: usize, x_chunks: impl IndexedParallelIterator<Item = bool>) -> bool {
        if len == 0 {
            return false;
        }
        x_chunks.reduce(|| false, |a, b| a | b)
    }
    match x {
        FloatSliceMut::F32(x) => {
            if x.len() <= PAR_MIN {
                return unscale_f32(x, inv_scale);
            }
            any(
                x.len(),
                x.par_chunks_mut(CHUNK).map(|c| unscale_f32(c, inv_scale)),
            )
        }
        FloatSliceMut::BF16(x) => {
            let f = |c: &mut [bf16]| {
                let mut bad = 0u32;
                for v in c {
                    let b = v.to_bits();
                    bad |= ((b & 0x7f80) == 0x7f80) as u32;
                    *v = bf16::from_bits(f32_to_bf16_bits(bf16_bits_to_f32(b) * inv_scale));
                }
                bad != 0
            };
            if x.len() <= PAR_MIN {
                return f(x);
            }
            any(x.len(), x.par_chunks_mut(CHUNK).map(f))
        }
        FloatSliceMut::F16(x) => {
            let f = |c: &mut [f16]| {
                let mut bad = 0u32;
                let mut buf = [0f32; BLOCK];
                for block in c.chunks_mut(BLOCK) {
                    for v in block.iter() {
                        bad |= ((v.to_bits() & 0x7c00) == 0x7c00) as u32;
                    }
                    let w = &mut buf[..block.len()];
                    widen_f16(block, w);
                    scale_f32(w, inv_scale);
                    narrow_f16(w, block);
                }
                bad != 0
            };
            if x.len() <= PAR_MIN {
                return f(x);
            }
            any(x.len(), x.par_chunks_mut(CHUNK).map(f))
        }
    }
}
