//! Blockwise 8-bit optimizer state whose codes are small floats, read and written with a few
//! integer operations and no table ([`StatePrecision::Float8`](crate::StatePrecision::Float8)).
//!
//! Like the code-book format ([`quantized`](crate::quantized)), each moment keeps one byte per
//! element and one f32 scale (the block's absolute maximum) per [`QUANT_BLOCK`] elements, and
//! the second moment is stored as `s = √v` (see there why). What differs is the code: the
//! value a byte stands for, relative to its block's scale, is the byte's own bits read as a
//! tiny float:
//!
//! - **`m`, signed**: the byte is a two's-complement `i8` `c`; `k = |c|` is `eee mmmm`, an
//!   E3M4 magnitude with exponent bias 7 and subnormals: `(1 + mmmm/16)·2^(eee−7)` for
//!   `eee ≥ 1`, `(mmmm/16)·2^−6` for `eee = 0`, negative for `c < 0`. Codes ±112 are ±1; the
//!   smallest non-zero magnitude is 2^−10 of the scale.
//! - **`√v`, unsigned**: the byte `k` is `eeee mmmm`, an E4M4 magnitude with bias 15 and
//!   subnormals: `(1 + mmmm/16)·2^(eeee−15)`, or `(mmmm/16)·2^−14` for `eeee = 0`. Code 240
//!   is 1; the smallest non-zero value is 2^−18 of the scale (the code book's smallest is
//!   about 2^−20).
//!
//! Not OCP FP8: the exponent biases are chosen so that 1 (the block maximum) is the largest
//! code in use, and there is no infinity or NaN. Codes above 1 (`|c|` 113–128, `k` 241–255)
//! arise only from a NaN and decode to values below 2.
//!
//! **Why four mantissa bits.** Measured on `tests/int8_state.rs`'s least-squares problem
//! (120 steps, final loss; f32 AdamW 6.22e-3, the code book 6.34e-3): E4M3 for `m` with E5M3
//! for `√v` ended at 7.30e-3, E4M3 with E4M4 at 6.85e-3, E3M4 with E5M3 at 7.03e-3, and
//! E3M4 with E4M4 — this format — at 6.59e-3. Precision near the block maximum matters more
//! there than range. The price: an `m` below 2^−11 of its block's largest is stored as 0,
//! where the code book keeps values down to about 2^−20; a `√v` below 2^−19 is stored as 0,
//! about as with the code book.
//!
//! **Why floats instead of a code book.** A code book needs a table lookup per value to decode
//! and another to encode, four per parameter; on AVX2 those are scalar loads and vector
//! inserts, and they cost more than the whole update (see `int8_avx2.rs`). Here a code's bits,
//! shifted into an f32's exponent and mantissa fields and offset by a constant exponent, are
//! its value; encoding rounds an f32's mantissa to four bits by adding half a unit of the
//! fifth to its bits (a carry moves into the exponent, as it should) and shifts back. The
//! subnormal codes take a second reading one binade up ([`Code::magnitude`],
//! [`Code::encode_magnitude`]), so that no f32 subnormal is ever an operand: AMD's Zen 3
//! runs those several times slower. Every step is exact or an IEEE operation, so every ISA
//! path gives the scalar reference's bits.
//!
//! **Precision.** Four mantissa bits: a stored value is within 1/32 (3.1%) of the value
//! encoded, relative, down to 2^−6 of the block maximum for `m` and 2^−14 for `√v`, and within
//! half the smallest step below that. The code book keeps more digits near the block maximum
//! (64 steps in its top decade) and reaches further down.
//!
//! **The update** is PyTorch's AdamW in f32 as in [`adamw_kernel`](crate::adamw_kernel), with
//! one change: the denominator is `√v̂·(1/√(1−β2^t)) + ε` by one fused multiply-add with the
//! reciprocal computed once per step, instead of a division and an addition. Bit-compatibility
//! with PyTorch is not a goal of an 8-bit state (quantisation already departs from it), and a
//! division per parameter is the largest single cost left in this kernel.
//!
//! **Speed.** From memory the step moves its 16 bytes per parameter at about 0.8 of what a
//! plain pass over those bytes reaches (0.71–0.87 per run; AVX-512 kernel, 10M and 50M
//! parameters, the AMX Xeon). From cache it is compute-bound: about 58 vector operations per 16 parameters, which
//! that core issues for 512-bit vectors on two ports only, hence at least 0.85 ns per
//! parameter on one thread. A state that a large L3 holds whole (10M parameters in 300 MiB)
//! is therefore updated at 0.6–0.7 of that cache's bandwidth. The square root and the
//! division cost about a fifth of the cached time; Newton steps in their place would cost more
//! operations than they save on those ports (measured:
//! `benches/results/2026-11-28-cpu-2core-adamw-float8-cold.md`). The AVX2 kernel is
//! compute-bound at about 2.0 G params/s on two Zen 4 cores: where memory streams the 16
//! bytes at 2.7–3.9 G params/s, it reaches 0.5–0.66 of that, and neither the square root and
//! division nor the prefetch distance is what limits it
//! (`benches/results/2026-11-29-cpu-2core-avx2-zen4.md`).

use headroom_tensor::cpu::kernels::{bf16_bits_to_f32, FloatSlice};

use crate::quantized::{inverse_scale, QUANT_BLOCK};
use crate::StepScalars;

/// The layout of one of the two codes: a magnitude of `7` (`m`) or `8` (`√v`) bits, its low
/// [`MANT`] bits the mantissa, the rest the exponent field, with subnormals.
pub(crate) struct Code {
    /// The f32 biased exponent of the smallest normal magnitude, `2^(1 − bias)`.
    min_normal_exp: i32,
    /// `2^(1 − bias)`.
    min_normal: f32,
}

/// Mantissa bits of both codes.
pub(crate) const MANT: i32 = 4;
/// Where a magnitude goes in an f32 so that its mantissa meets the f32's top mantissa bits.
pub(crate) const SHIFT: i32 = 23 - MANT;

impl Code {
    /// The exponent bias is the largest exponent field, so that its smallest magnitude is 1.
    const fn new(magnitude_bits: i32) -> Code {
        let bias = (1 << (magnitude_bits - MANT)) - 1;
        let min_normal_exp = 127 + 1 - bias;
        Code {
            min_normal_exp,
            min_normal: f32::from_bits((min_normal_exp as u32) << 23),
        }
    }

    /// The value of magnitude `k` relative to the block scale, exactly: the larger of two
    /// readings of `k`'s bits is wrong, the smaller right. Read with the normal exponent
    /// offset, a subnormal `k` comes out as `r = 2^−bias·(1 + k/16)`; `2·r − 2^(1 − bias)` is
    /// then `k/16·2^(1 − bias)` — its value, and smaller (Sterbenz: the subtraction is
    /// exact). For a normal `k`, `r` is its value and `2·r − 2^(1 − bias)` is not smaller
    /// (rounding is monotone). No operand or result is ever an f32 subnormal, which AMD's
    /// Zen 3 slows down several times (measured: 0.60–0.66 of the 16-byte bound with
    /// subnormal arithmetic, 0.79–0.83 without). `2·r` is exact, so the AVX2 kernel's one
    /// fused `2·r − 2^(1 − bias)` gives these bits.
    #[inline(always)]
    pub(crate) fn magnitude(&self, k: u32) -> f32 {
        let bits = k << SHIFT;
        let normal = f32::from_bits(bits.wrapping_add(((self.min_normal_exp - 1) as u32) << 23));
        normal.min(2.0 * normal - self.min_normal)
    }

    /// The magnitude code of `a = |y|` (relative to the block scale), nearest with ties away
    /// from zero, as an unclamped `i32` (a NaN gives a large positive value). Two readings
    /// again, and the larger is right: rounding `a`'s own bits to [`MANT`] mantissa bits is
    /// the code for a normal `a` and too small for a subnormal one; rounding the bits of
    /// `a + 2^(1 − bias)` (which is normal) is the subnormal code, and too small for a normal
    /// `a`. In the subnormal range `a` is thereby rounded twice, first to an f32 in the binade
    /// of `2^(1 − bias)`: within 2^−24 of that binade of a midpoint between two codes the
    /// result may be the farther code. The larger is taken before the shift, which is
    /// monotone: one shift instead of two.
    #[inline(always)]
    pub(crate) fn encode_magnitude(&self, a: f32) -> i32 {
        let half = 1i32 << (SHIFT - 1);
        let direct = (a.to_bits() as i32).wrapping_add(half - ((self.min_normal_exp - 1) << 23));
        let sub = ((a + self.min_normal).to_bits() as i32)
            .wrapping_add(half - (self.min_normal_exp << 23));
        direct.max(sub) >> SHIFT
    }
}

/// The first moment's code: a 7-bit E3M4 magnitude and a sign.
pub(crate) const M_CODE: Code = Code::new(7);
/// The second moment's (`√v`'s) code: an 8-bit E4M4 magnitude.
pub(crate) const S_CODE: Code = Code::new(8);

/// The value of a first-moment code relative to its block's scale.
#[inline(always)]
pub(crate) fn decode_m(code: u8) -> f32 {
    let c = code as i8;
    let mag = M_CODE.magnitude(c.unsigned_abs() as u32);
    if c < 0 {
        -mag
    } else {
        mag
    }
}

/// The value of a `√v` code relative to its block's scale.
#[inline(always)]
pub(crate) fn decode_s(code: u8) -> f32 {
    S_CODE.magnitude(code as u32)
}

/// The signed code nearest to `y` (see [`Code::encode_magnitude`]), `y` relative to the block's
/// scale (so `|y| ≤ 1` for every finite value of the block). A NaN saturates to 127 or −128.
#[inline(always)]
pub(crate) fn encode_m(y: f32) -> u8 {
    let k = M_CODE.encode_magnitude(y.abs());
    let c = if (y.to_bits() as i32) < 0 { -k } else { k };
    c.clamp(-128, 127) as i8 as u8
}

/// The unsigned code nearest to `y ≥ 0`, relative to the block's scale. A NaN saturates to 255
/// or, with its sign bit set (x86's default NaN), to 0.
#[inline(always)]
pub(crate) fn encode_s(y: f32) -> u8 {
    S_CODE.encode_magnitude(y).clamp(0, 255) as u8
}

/// One block of the 8-bit update: `p`, `g`, `mc`, `sc` of equal length at most
/// [`QUANT_BLOCK`]; `ms`, `ss` the block's scales.
pub(crate) struct Block<'a, 'g> {
    pub(crate) p: &'a mut [f32],
    pub(crate) g: FloatSlice<'g>,
    pub(crate) mc: &'a mut [u8],
    pub(crate) sc: &'a mut [u8],
    pub(crate) ms: &'a mut f32,
    pub(crate) ss: &'a mut f32,
}

/// The f32 update of one element: new `m` and `√v` from the decoded `m` and `√v`'s code
/// value `s_rel` (relative to its block scale), `p` in place. `s_b2` is the block's
/// `scale² · β2`, so that `β2·v` is `s_rel² · s_b2`: two multiplications where decoding `√v`
/// first would take three.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn update<const SMALL_WEIGHT: bool>(
    s: &StepScalars,
    inv_bc2: f32,
    p: &mut f32,
    g: f32,
    m: f32,
    s_rel: f32,
    s_b2: f32,
) -> (f32, f32) {
    let v_b2 = (s_rel * s_rel) * s_b2;
    let decayed = *p * s.decay;
    let diff = g - m;
    // ATen's lerp, as in `adamw_kernel::update`.
    let mn = if SMALL_WEIGHT {
        s.one_minus_beta1.mul_add(diff, m)
    } else {
        (s.one_minus_beta1 - 1.0).mul_add(diff, g)
    };
    let vn = (s.one_minus_beta2 * g).mul_add(g, v_b2);
    let root = vn.sqrt();
    let denom = root.mul_add(inv_bc2, s.eps);
    *p = decayed - (s.step_size * mn) / denom;
    (mn, root)
}

/// The portable path and the scalar reference of the block update: decode, update, block
/// maxima, encode. The AVX2 kernel performs the same operations per element.
pub(crate) fn block_portable(s: &StepScalars, b: Block<'_, '_>) {
    if s.lerp_weight_is_small() {
        block_portable_impl::<true>(s, b)
    } else {
        block_portable_impl::<false>(s, b)
    }
}

fn block_portable_impl<const SMALL_WEIGHT: bool>(s: &StepScalars, b: Block<'_, '_>) {
    let n = b.p.len();
    let inv_bc2 = 1.0 / s.bc2_sqrt;
    let m_scale = *b.ms;
    let s_b2 = (*b.ss * *b.ss) * s.beta2;
    let mut m_new = [0f32; QUANT_BLOCK];
    let mut s_new = [0f32; QUANT_BLOCK];
    let (mut m_max, mut s_max) = (0f32, 0f32);
    for i in 0..n {
        let g = match b.g {
            FloatSlice::F32(g) => g[i],
            FloatSlice::BF16(g) => bf16_bits_to_f32(g[i].to_bits()),
            FloatSlice::F16(g) => g[i].to_f32(),
        };
        let m = decode_m(b.mc[i]) * m_scale;
        let (mn, root) =
            update::<SMALL_WEIGHT>(s, inv_bc2, &mut b.p[i], g, m, decode_s(b.sc[i]), s_b2);
        m_new[i] = mn;
        s_new[i] = root;
        m_max = m_max.max(mn.abs());
        s_max = s_max.max(root);
    }
    let (inv_m, inv_s) = (inverse_scale(m_max), inverse_scale(s_max));
    for i in 0..n {
        b.mc[i] = encode_m(m_new[i] * inv_m);
        b.sc[i] = encode_s(s_new[i] * inv_s);
    }
    *b.ms = m_max;
    *b.ss = s_max;
}

/// A gradient slice the kernels are compiled for, one instance per element type so that their
/// loops hold no per-element branch on it.
#[cfg(target_arch = "x86_64")]
trait GradIn: Copy {
    fn len(self) -> usize;
    fn at(self, i: usize) -> f32;
    /// The address of element `i`, for prefetching (may be past the end).
    fn ptr(self, i: usize) -> *const u8;
    /// Elements `i..i + 8` widened to f32.
    ///
    /// # Safety
    /// AVX2; `i + 8 <= self.len()`.
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256;
    /// Elements `i..i + 16` widened to f32.
    ///
    /// # Safety
    /// AVX-512F; `i + 16 <= self.len()`.
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512;
}

#[cfg(target_arch = "x86_64")]
impl GradIn for &[f32] {
    #[inline(always)]
    fn len(self) -> usize {
        <[f32]>::len(self)
    }
    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        self[i]
    }
    #[inline(always)]
    fn ptr(self, i: usize) -> *const u8 {
        self.as_ptr().wrapping_add(i) as *const u8
    }
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        // SAFETY: as the caller guarantees.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(self.as_ptr().add(i)) }
    }
    #[inline(always)]
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512 {
        // SAFETY: as the caller guarantees.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(self.as_ptr().add(i)) }
    }
}

#[cfg(target_arch = "x86_64")]
impl GradIn for &[half::bf16] {
    #[inline(always)]
    fn len(self) -> usize {
        <[half::bf16]>::len(self)
    }
    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        bf16_bits_to_f32(self[i].to_bits())
    }
    #[inline(always)]
    fn ptr(self, i: usize) -> *const u8 {
        self.as_ptr().wrapping_add(i) as *const u8
    }
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller guarantees.
        unsafe {
            let halves = _mm_loadu_si128(self.as_ptr().add(i) as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
        }
    }
    #[inline(always)]
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller guarantees.
        unsafe {
            let halves = _mm256_loadu_si256(self.as_ptr().add(i) as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
        }
    }
}

/// The block update by the AVX2 kernel: the same bits as [`block_portable`]. f16 gradients are
/// widened into a buffer first (exactly).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn block_avx2(s: &StepScalars, b: Block<'_, '_>) {
    let mut wide = None;
    let g = avx2::Grad::of(b.g, &mut wide);
    // SAFETY: the caller guarantees AVX2 and FMA.
    unsafe { avx2::block(s, b.p, g, b.mc, b.sc, b.ms, b.ss) }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The block update in AVX2 intrinsics, eight elements per vector.
    //!
    //! Pass 1 decodes both codes, runs the update, and keeps the new `m` and `√v` in two 8 KiB
    //! stack buffers (L1) with their running maxima; pass 2 encodes them against the maxima,
    //! 32 at a time so that the codes leave as whole 32-byte stores. Elements past the last
    //! multiple of 8 (pass 1) or 32 (pass 2) run through the scalar operations of the
    //! reference.
    //!
    //! Decoding and encoding are [`Code::magnitude`] and [`Code::encode_magnitude`] eight
    //! lanes at a time, integer adds and shifts with one float operation and a min or max,
    //! never touching an f32 subnormal.
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use super::*;

    // A block's gradient as both 8-bit kernels read it.
    pub(super) use crate::int8_avx2::Grad;

    /// How far ahead pass 1 asks for the f32 streams' cache lines: 1024 elements, half a
    /// block. The update costs about as much time as moving its bytes, and without this the
    /// two barely overlapped: the hardware prefetcher alone left the step at 0.65–0.7 of the
    /// 16-byte bound, software prefetching 4 KiB ahead took a prototype from 0.75–0.80 to
    /// 0.87–0.95 (8 KiB: within noise of 4). Past a thread's last block the addresses may
    /// belong to another thread's blocks or to nothing; a prefetch never faults.
    pub(super) const PREFETCH_BYTES: usize = 4096;

    /// A hint to fetch the cache line `ahead` bytes past `at` into L1.
    #[inline(always)]
    pub(super) fn prefetch_ahead(at: *const u8, ahead: usize) {
        // SAFETY: a prefetch is a hint; it reads nothing architecturally and never faults,
        // whatever the address (computed with wrapping arithmetic, so no pointer rule is
        // broken either). SSE is part of x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(ahead) as *const i8) }
    }

    /// # Safety
    /// AVX2 and FMA; `p`, `g`, `mc`, `sc` of equal length at most [`QUANT_BLOCK`].
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block(
        s: &StepScalars,
        p: &mut [f32],
        g: Grad<'_>,
        mc: &mut [u8],
        sc: &mut [u8],
        ms: &mut f32,
        ss: &mut f32,
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match (g, s.lerp_weight_is_small()) {
                (Grad::F32(g), true) => block_impl::<true, _>(s, p, g, mc, sc, ms, ss),
                (Grad::F32(g), false) => block_impl::<false, _>(s, p, g, mc, sc, ms, ss),
                (Grad::Bf16(g), true) => block_impl::<true, _>(s, p, g, mc, sc, ms, ss),
                (Grad::Bf16(g), false) => block_impl::<false, _>(s, p, g, mc, sc, ms, ss),
            }
        }
    }

    /// [`Code::magnitude`] of eight magnitudes.
    #[inline(always)]
    unsafe fn magnitude8(code: &Code, k: __m256i) -> __m256 {
        // SAFETY: AVX2, as every caller has.
        unsafe {
            let bits = _mm256_slli_epi32::<SHIFT>(k);
            let normal = _mm256_castsi256_ps(_mm256_add_epi32(
                bits,
                _mm256_set1_epi32((code.min_normal_exp - 1) << 23),
            ));
            let sub = _mm256_fmsub_ps(normal, _mm256_set1_ps(2.0), _mm256_set1_ps(code.min_normal));
            _mm256_min_ps(normal, sub)
        }
    }

    /// [`Code::encode_magnitude`] of eight magnitudes `a`.
    #[inline(always)]
    unsafe fn encode_magnitude8(code: &Code, a: __m256) -> __m256i {
        // SAFETY: AVX2, as every caller has.
        unsafe {
            let half = 1i32 << (SHIFT - 1);
            let direct = _mm256_add_epi32(
                _mm256_castps_si256(a),
                _mm256_set1_epi32(half - ((code.min_normal_exp - 1) << 23)),
            );
            let shifted = _mm256_add_ps(a, _mm256_set1_ps(code.min_normal));
            let sub = _mm256_add_epi32(
                _mm256_castps_si256(shifted),
                _mm256_set1_epi32(half - (code.min_normal_exp << 23)),
            );
            _mm256_srai_epi32::<SHIFT>(_mm256_max_epi32(direct, sub))
        }
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block_impl<const SMALL_WEIGHT: bool, G: GradIn>(
        s: &StepScalars,
        p: &mut [f32],
        g: G,
        mc: &mut [u8],
        sc: &mut [u8],
        ms: &mut f32,
        ss: &mut f32,
    ) {
        let n = p.len();
        assert!(n <= QUANT_BLOCK && mc.len() == n && sc.len() == n && g.len() == n);
        // SAFETY: AVX2 and FMA as the caller guarantees; every pointer below stays inside its
        // slice (vector loops end at a multiple of their width not above `n`; prefetches are
        // hints), and the stack buffers are written up to `n` in pass 1 before pass 2 reads
        // them.
        unsafe {
            let mut m_buf = MaybeUninit::<[f32; QUANT_BLOCK]>::uninit();
            let mut s_buf = MaybeUninit::<[f32; QUANT_BLOCK]>::uninit();
            let (m_new, s_new) = (
                m_buf.as_mut_ptr() as *mut f32,
                s_buf.as_mut_ptr() as *mut f32,
            );
            let m_scale = *ms;
            let s_b2 = (*ss * *ss) * s.beta2;
            let inv_bc2 = 1.0 / s.bc2_sqrt;
            let lerp_w = if SMALL_WEIGHT {
                s.one_minus_beta1
            } else {
                s.one_minus_beta1 - 1.0
            };
            let (v_m_scale, v_s_b2) = (_mm256_set1_ps(m_scale), _mm256_set1_ps(s_b2));
            let v_decay = _mm256_set1_ps(s.decay);
            let v_w = _mm256_set1_ps(lerp_w);
            let v_omb2 = _mm256_set1_ps(s.one_minus_beta2);
            let v_inv_bc2 = _mm256_set1_ps(inv_bc2);
            let v_eps = _mm256_set1_ps(s.eps);
            let v_step = _mm256_set1_ps(s.step_size);
            let sign_bit = _mm256_set1_epi32(i32::MIN);
            let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
            let mut max_m = _mm256_setzero_ps();
            let mut max_s = _mm256_setzero_ps();
            let (pp, mcp, scp) = (p.as_mut_ptr(), mc.as_mut_ptr(), sc.as_mut_ptr());

            // Pass 1: decode, update, maxima.
            let n8 = n / 8 * 8;
            let mut i = 0;
            while i < n8 {
                if i % 16 == 0 {
                    prefetch_ahead(pp.add(i) as *const u8, PREFETCH_BYTES);
                    prefetch_ahead(g.ptr(i), PREFETCH_BYTES);
                    if i % 64 == 0 {
                        // One code byte per element: the same elements ahead.
                        prefetch_ahead(mcp.add(i), PREFETCH_BYTES / 4);
                        prefetch_ahead(scp.add(i), PREFETCH_BYTES / 4);
                    }
                }
                let m_code = _mm256_cvtepi8_epi32(_mm_loadl_epi64(mcp.add(i) as *const __m128i));
                let m_mag = magnitude8(&M_CODE, _mm256_abs_epi32(m_code));
                let m_sign = _mm256_castsi256_ps(_mm256_and_si256(m_code, sign_bit));
                let m = _mm256_mul_ps(_mm256_or_ps(m_mag, m_sign), v_m_scale);
                let s_code = _mm256_cvtepu8_epi32(_mm_loadl_epi64(scp.add(i) as *const __m128i));
                let s_rel = magnitude8(&S_CODE, s_code);
                let v_b2 = _mm256_mul_ps(_mm256_mul_ps(s_rel, s_rel), v_s_b2);
                let gv = g.load8(i);
                let pv = _mm256_loadu_ps(pp.add(i));
                let decayed = _mm256_mul_ps(pv, v_decay);
                let diff = _mm256_sub_ps(gv, m);
                let mn = if SMALL_WEIGHT {
                    _mm256_fmadd_ps(v_w, diff, m)
                } else {
                    _mm256_fmadd_ps(v_w, diff, gv)
                };
                let vn = _mm256_fmadd_ps(_mm256_mul_ps(v_omb2, gv), gv, v_b2);
                let root = _mm256_sqrt_ps(vn);
                let denom = _mm256_fmadd_ps(root, v_inv_bc2, v_eps);
                let pn = _mm256_sub_ps(decayed, _mm256_div_ps(_mm256_mul_ps(v_step, mn), denom));
                _mm256_storeu_ps(pp.add(i), pn);
                _mm256_storeu_ps(m_new.add(i), mn);
                _mm256_storeu_ps(s_new.add(i), root);
                // `max_ps` returns its second operand when either is NaN, so a NaN element is
                // skipped as `f32::max` skips it in the reference.
                max_m = _mm256_max_ps(_mm256_and_ps(mn, abs_mask), max_m);
                max_s = _mm256_max_ps(root, max_s);
                i += 8;
            }
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), max_m);
            let mut m_max = lanes.iter().fold(0f32, |a, &x| a.max(x));
            _mm256_storeu_ps(lanes.as_mut_ptr(), max_s);
            let mut s_max = lanes.iter().fold(0f32, |a, &x| a.max(x));
            for i in n8..n {
                let m = decode_m(mc[i]) * m_scale;
                let (mn, root) = update::<SMALL_WEIGHT>(
                    s,
                    inv_bc2,
                    &mut p[i],
                    g.at(i),
                    m,
                    decode_s(sc[i]),
                    s_b2,
                );
                m_new.add(i).write(mn);
                s_new.add(i).write(root);
                m_max = m_max.max(mn.abs());
                s_max = s_max.max(root);
            }

            // Pass 2: encode against the maxima.
            let (inv_m, inv_s) = (inverse_scale(m_max), inverse_scale(s_max));
            let (v_inv_m, v_inv_s) = (_mm256_set1_ps(inv_m), _mm256_set1_ps(inv_s));
            // `packs` interleaves 128-bit halves; this puts the 32 codes back in order.
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            let n32 = n / 32 * 32;
            let mut i = 0;
            while i < n32 {
                let mut mk = [_mm256_setzero_si256(); 4];
                let mut sk = [_mm256_setzero_si256(); 4];
                for j in 0..4 {
                    let y = _mm256_mul_ps(_mm256_loadu_ps(m_new.add(i + 8 * j)), v_inv_m);
                    let k = encode_magnitude8(&M_CODE, _mm256_and_ps(y, abs_mask));
                    // Negated where `y`'s sign bit is set; a zero magnitude stays zero.
                    mk[j] = _mm256_sign_epi32(k, _mm256_castps_si256(y));
                    let y = _mm256_mul_ps(_mm256_loadu_ps(s_new.add(i + 8 * j)), v_inv_s);
                    // `√v ≥ 0`: no sign to clear (a NaN keeps its sign, as in `encode_s`).
                    sk[j] = encode_magnitude8(&S_CODE, y);
                }
                // Saturating packs clamp as `encode_m` (to −128..=127) and `encode_s` (to
                // 0..=255) do; only a NaN reaches the clamp.
                let lo = _mm256_packs_epi32(mk[0], mk[1]);
                let hi = _mm256_packs_epi32(mk[2], mk[3]);
                let codes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order);
                _mm256_storeu_si256(mcp.add(i) as *mut __m256i, codes);
                let lo = _mm256_packus_epi32(sk[0], sk[1]);
                let hi = _mm256_packus_epi32(sk[2], sk[3]);
                let codes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(lo, hi), order);
                _mm256_storeu_si256(scp.add(i) as *mut __m256i, codes);
                i += 32;
            }
            for i in n32..n {
                mc[i] = encode_m(m_new.add(i).read() * inv_m);
                sc[i] = encode_s(s_new.add(i).read() * inv_s);
            }
            *ms = m_max;
            *ss = s_max;
        }
    }
}

/// The block update by the AVX-512 kernel: the same bits as [`block_portable`], sixteen
/// elements per vector. f16 gradients are widened into a buffer first (exactly).
///
/// # Safety
/// The CPU must support AVX-512F and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) unsafe fn block_avx512(s: &StepScalars, b: Block<'_, '_>) {
    let mut wide = None;
    let g = avx2::Grad::of(b.g, &mut wide);
    // SAFETY: the caller guarantees AVX-512F and FMA.
    unsafe { avx512::block(s, b.p, g, b.mc, b.sc, b.ms, b.ss) }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The AVX2 kernel's operations on sixteen lanes. Beyond the width, AVX-512 saves two
    //! steps per vector: the codes are narrowed to bytes by one saturating conversion
    //! (`vpmovsdb`, `vpmovusdb`) instead of two packs and a permutation, and `m`'s sign is a
    //! masked negation instead of `vpsignd`. Measured on the AMX Xeon against the AVX2 kernel
    //! on the same machine: `benches/results/2026-11-24-cpu-2core-amx-bf16.md`.
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use super::avx2::{prefetch_ahead, Grad};
    use super::*;

    /// How far ahead pass 1 prefetches (the AVX2 kernel's reasoning). Measured on the AMX
    /// Xeon, per-round ratios to the 16-byte pass at 50M parameters, the AVX2 kernel in the
    /// same rounds in brackets: no prefetch 0.62–0.66 (0.72–0.78), 1 KiB 0.76–0.83
    /// (0.77–0.82), 2 KiB 0.77–0.83 (0.75–0.80), 3 KiB 0.75–0.81 (0.74–0.79), 4 KiB (the AVX2
    /// kernel's distance) 0.76–0.77 (0.76–0.78), 8 KiB 0.66–0.69 (0.74–0.77).
    const PREFETCH_BYTES_512: usize = 2048;

    /// # Safety
    /// AVX-512F and FMA; `p`, `g`, `mc`, `sc` of equal length at most [`QUANT_BLOCK`].
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block(
        s: &StepScalars,
        p: &mut [f32],
        g: Grad<'_>,
        mc: &mut [u8],
        sc: &mut [u8],
        ms: &mut f32,
        ss: &mut f32,
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match (g, s.lerp_weight_is_small()) {
                (Grad::F32(g), true) => block_impl::<true, _>(s, p, g, mc, sc, ms, ss),
                (Grad::F32(g), false) => block_impl::<false, _>(s, p, g, mc, sc, ms, ss),
                (Grad::Bf16(g), true) => block_impl::<true, _>(s, p, g, mc, sc, ms, ss),
                (Grad::Bf16(g), false) => block_impl::<false, _>(s, p, g, mc, sc, ms, ss),
            }
        }
    }

    /// [`Code::magnitude`] of sixteen magnitudes.
    #[inline(always)]
    unsafe fn magnitude16(code: &Code, k: __m512i) -> __m512 {
        // SAFETY: AVX-512F and FMA, as every caller has.
        unsafe {
            let bits = _mm512_slli_epi32::<{ SHIFT as u32 }>(k);
            let normal = _mm512_castsi512_ps(_mm512_add_epi32(
                bits,
                _mm512_set1_epi32((code.min_normal_exp - 1) << 23),
            ));
            let sub = _mm512_fmsub_ps(normal, _mm512_set1_ps(2.0), _mm512_set1_ps(code.min_normal));
            _mm512_min_ps(normal, sub)
        }
    }

    /// [`Code::encode_magnitude`] of sixteen magnitudes `a`.
    #[inline(always)]
    unsafe fn encode_magnitude16(code: &Code, a: __m512) -> __m512i {
        // SAFETY: AVX-512F, as every caller has.
        unsafe {
            let half = 1i32 << (SHIFT - 1);
            let direct = _mm512_add_epi32(
                _mm512_castps_si512(a),
                _mm512_set1_epi32(half - ((code.min_normal_exp - 1) << 23)),
            );
            let shifted = _mm512_add_ps(a, _mm512_set1_ps(code.min_normal));
            let sub = _mm512_add_epi32(
                _mm512_castps_si512(shifted),
                _mm512_set1_epi32(half - (code.min_normal_exp << 23)),
            );
            _mm512_srai_epi32::<{ SHIFT as u32 }>(_mm512_max_epi32(direct, sub))
        }
    }

    /// The largest lane, `f32::max` over the lanes as the reference folds them.
    #[inline(always)]
    unsafe fn fold_max(v: __m512) -> f32 {
        let mut lanes = [0f32; 16];
        // SAFETY: AVX-512F, as every caller has; `lanes` holds 16 f32.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), v) };
        lanes.iter().fold(0f32, |a, &x| a.max(x))
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block_impl<const SMALL_WEIGHT: bool, G: GradIn>(
        s: &StepScalars,
        p: &mut [f32],
        g: G,
        mc: &mut [u8],
        sc: &mut [u8],
        ms: &mut f32,
        ss: &mut f32,
    ) {
        let n = p.len();
        assert!(n <= QUANT_BLOCK && mc.len() == n && sc.len() == n && g.len() == n);
        // SAFETY: AVX-512F and FMA as the caller guarantees; every pointer below stays inside
        // its slice (vector loops end at a multiple of 16 not above `n`; prefetches are
        // hints), and the stack buffers are written up to `n` in pass 1 before pass 2 reads
        // them.
        unsafe {
            let mut m_buf = MaybeUninit::<[f32; QUANT_BLOCK]>::uninit();
            let mut s_buf = MaybeUninit::<[f32; QUANT_BLOCK]>::uninit();
            let (m_new, s_new) = (
                m_buf.as_mut_ptr() as *mut f32,
                s_buf.as_mut_ptr() as *mut f32,
            );
            let m_scale = *ms;
            let s_b2 = (*ss * *ss) * s.beta2;
            let inv_bc2 = 1.0 / s.bc2_sqrt;
            let lerp_w = if SMALL_WEIGHT {
                s.one_minus_beta1
            } else {
                s.one_minus_beta1 - 1.0
            };
            let (v_m_scale, v_s_b2) = (_mm512_set1_ps(m_scale), _mm512_set1_ps(s_b2));
            let v_decay = _mm512_set1_ps(s.decay);
            let v_w = _mm512_set1_ps(lerp_w);
            let v_omb2 = _mm512_set1_ps(s.one_minus_beta2);
            let v_inv_bc2 = _mm512_set1_ps(inv_bc2);
            let v_eps = _mm512_set1_ps(s.eps);
            let v_step = _mm512_set1_ps(s.step_size);
            let sign_bit = _mm512_set1_epi32(i32::MIN);
            let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
            let mut max_m = _mm512_setzero_ps();
            let mut max_s = _mm512_setzero_ps();
            let (pp, mcp, scp) = (p.as_mut_ptr(), mc.as_mut_ptr(), sc.as_mut_ptr());

            // Pass 1: decode, update, maxima.
            let n16 = n / 16 * 16;
            let mut i = 0;
            while i < n16 {
                // One cache line of `p` and of an f32 `g` per vector.
                prefetch_ahead(pp.add(i) as *const u8, PREFETCH_BYTES_512);
                prefetch_ahead(g.ptr(i), PREFETCH_BYTES_512);
                if i % 64 == 0 {
                    // One code byte per element: the same elements ahead.
                    prefetch_ahead(mcp.add(i), PREFETCH_BYTES_512 / 4);
                    prefetch_ahead(scp.add(i), PREFETCH_BYTES_512 / 4);
                }
                let m_code = _mm512_cvtepi8_epi32(_mm_loadu_si128(mcp.add(i) as *const __m128i));
                let m_mag = magnitude16(&M_CODE, _mm512_abs_epi32(m_code));
                let m_sign = _mm512_and_si512(m_code, sign_bit);
                let m = _mm512_mul_ps(
                    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(m_mag), m_sign)),
                    v_m_scale,
                );
                let s_code = _mm512_cvtepu8_epi32(_mm_loadu_si128(scp.add(i) as *const __m128i));
                let s_rel = magnitude16(&S_CODE, s_code);
                let v_b2 = _mm512_mul_ps(_mm512_mul_ps(s_rel, s_rel), v_s_b2);
                let gv = g.load16(i);
                let pv = _mm512_loadu_ps(pp.add(i));
                let decayed = _mm512_mul_ps(pv, v_decay);
                let diff = _mm512_sub_ps(gv, m);
                let mn = if SMALL_WEIGHT {
                    _mm512_fmadd_ps(v_w, diff, m)
                } else {
                    _mm512_fmadd_ps(v_w, diff, gv)
                };
                let vn = _mm512_fmadd_ps(_mm512_mul_ps(v_omb2, gv), gv, v_b2);
                let root = _mm512_sqrt_ps(vn);
                let denom = _mm512_fmadd_ps(root, v_inv_bc2, v_eps);
                let pn = _mm512_sub_ps(decayed, _mm512_div_ps(_mm512_mul_ps(v_step, mn), denom));
                _mm512_storeu_ps(pp.add(i), pn);
                _mm512_storeu_ps(m_new.add(i), mn);
                _mm512_storeu_ps(s_new.add(i), root);
                // As `vmaxps` on eight lanes: the second operand when either is NaN, so a NaN
                // element is skipped as `f32::max` skips it in the reference.
                let m_abs =
                    _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(mn), abs_mask));
                max_m = _mm512_max_ps(m_abs, max_m);
                max_s = _mm512_max_ps(root, max_s);
                i += 16;
            }
            let mut m_max = fold_max(max_m);
            let mut s_max = fold_max(max_s);
            for i in n16..n {
                let m = decode_m(mc[i]) * m_scale;
                let (mn, root) = update::<SMALL_WEIGHT>(
                    s,
                    inv_bc2,
                    &mut p[i],
                    g.at(i),
                    m,
                    decode_s(sc[i]),
                    s_b2,
                );
                m_new.add(i).write(mn);
                s_new.add(i).write(root);
                m_max = m_max.max(mn.abs());
                s_max = s_max.max(root);
            }

            // Pass 2: encode against the maxima, sixteen codes per store.
            let (inv_m, inv_s) = (inverse_scale(m_max), inverse_scale(s_max));
            let (v_inv_m, v_inv_s) = (_mm512_set1_ps(inv_m), _mm512_set1_ps(inv_s));
            let zero = _mm512_setzero_si512();
            let mut i = 0;
            while i < n16 {
                let y = _mm512_mul_ps(_mm512_loadu_ps(m_new.add(i)), v_inv_m);
                let y_bits = _mm512_castps_si512(y);
                let k = encode_magnitude16(
                    &M_CODE,
                    _mm512_castsi512_ps(_mm512_and_si512(y_bits, abs_mask)),
                );
                // Negated where `y`'s sign bit is set, as `encode_m` does.
                let k = _mm512_mask_sub_epi32(k, _mm512_cmplt_epi32_mask(y_bits, zero), zero, k);
                // Signed saturation: `encode_m`'s clamp to −128..=127.
                _mm_storeu_si128(mcp.add(i) as *mut __m128i, _mm512_cvtsepi32_epi8(k));
                let y = _mm512_mul_ps(_mm512_loadu_ps(s_new.add(i)), v_inv_s);
                let k = encode_magnitude16(&S_CODE, y);
                // `encode_s`'s clamp to 0..=255: negatives (a NaN with its sign bit) to 0 first,
                // then unsigned saturation.
                let k = _mm512_max_epi32(k, zero);
                _mm_storeu_si128(scp.add(i) as *mut __m128i, _mm512_cvtusepi32_epi8(k));
                i += 16;
            }
            for i in n16..n {
                mc[i] = encode_m(m_new.add(i).read() * inv_m);
                sc[i] = encode_s(s_new.add(i).read() * inv_s);
            }
            *ms = m_max;
            *ss = s_max;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exponent biases the module documentation states.
    const M_BIAS: i32 = 7;
    const S_BIAS: i32 = 15;

    /// The value the format defines for a signed code, in f64 from its fields.
    fn m_value(code: u8) -> f64 {
        let c = code as i8 as i32;
        let k = c.unsigned_abs();
        let mag = field_value(k, MANT, M_BIAS);
        if c < 0 {
            -mag
        } else {
            mag
        }
    }

    fn s_value(code: u8) -> f64 {
        field_value(code as u32, MANT, S_BIAS)
    }

    /// `k` as a float with `mant` mantissa bits above its exponent field, exponent bias `bias`
    /// and subnormals, from its fields in f64.
    fn field_value(k: u32, mant: i32, bias: i32) -> f64 {
        let (e, f) = (
            (k >> mant) as i32,
            (k & ((1 << mant) - 1)) as f64 / (1 << mant) as f64,
        );
        if e == 0 {
            f * 2f64.powi(1 - bias)
        } else {
            (1.0 + f) * 2f64.powi(e - bias)
        }
    }

    /// The code of 1 (the block maximum): the largest exponent field of a 7-bit (`m`) or 8-bit
    /// (`√v`) magnitude, mantissa zero.
    const M_ONE: i32 = M_BIAS << MANT;
    const S_ONE: i32 = S_BIAS << MANT;

    #[test]
    fn the_smallest_normal_magnitudes_are_the_documented_ones() {
        assert_eq!(M_CODE.min_normal as f64, 2f64.powi(1 - M_BIAS));
        assert_eq!(S_CODE.min_normal as f64, 2f64.powi(1 - S_BIAS));
        assert_eq!((M_ONE, S_ONE), (112, 240));
    }

    #[test]
    fn every_code_decodes_to_its_fields() {
        for c in 0..=255u8 {
            assert_eq!(decode_m(c) as f64, m_value(c), "m code {c}");
            assert_eq!(decode_s(c) as f64, s_value(c), "s code {c}");
        }
        assert_eq!(decode_m(M_ONE as u8), 1.0);
        assert_eq!(decode_m(-M_ONE as u8), -1.0);
        assert_eq!(decode_s(S_ONE as u8), 1.0);
        assert_eq!(decode_m(1) as f64, 2f64.powi(1 - M_BIAS - MANT));
        assert_eq!(decode_s(1) as f64, 2f64.powi(1 - S_BIAS - MANT));
        assert_eq!((decode_m(0), decode_s(0)), (0.0, 0.0));
    }

    #[test]
    fn every_code_in_range_encodes_to_itself() {
        for c in -M_ONE..=M_ONE {
            assert_eq!(encode_m(decode_m(c as u8)), c as u8, "m code {c}");
        }
        for c in 0..=S_ONE as u8 {
            assert_eq!(encode_s(decode_s(c)), c, "s code {c}");
        }
        assert_eq!(encode_m(-0.0), 0);
        assert_eq!(encode_m(f32::NAN), 127);
        assert_eq!(encode_m(-f32::NAN), -128i8 as u8);
        assert_eq!(encode_s(f32::NAN), 255);
        // A NaN's sign after the encoder's addition is the hardware's (x86 keeps it) or the
        // constant folder's: either extreme.
        assert!(matches!(encode_s(-f32::NAN), 0 | 255));
    }

    mod prop {
        use super::*;
        use proptest::prelude::*;

        /// Values in [-1, 1] spread over every binade the codes cover and below.
        fn relative() -> impl Strategy<Value = f32> {
            prop_oneof![
                -1.0f32..=1.0,
                (-40i32..=0, 1.0f32..2.0, any::<bool>()).prop_map(|(e, f, neg)| {
                    let x = (f * 2f32.powi(e)).min(1.0);
                    if neg {
                        -x
                    } else {
                        x
                    }
                }),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(4000))]

            /// Encoding picks the nearest code: no neighbour is strictly closer, and a tie goes
            /// away from zero — up to the subnormal range's first rounding, which may make a
            /// value within an f32 ulp of `2^(1 − bias)` of a midpoint a tie.
            #[test]
            fn encoding_is_nearest(y in relative()) {
                let slack = |bias: i32| 2f64.powi(1 - bias - 24);
                let c = encode_m(y) as i8;
                let got = (m_value(c as u8) - y as f64).abs();
                for n in [c.saturating_sub(1), c.saturating_add(1)].into_iter().filter(|&n| n != c) {
                    let other = (m_value(n as u8) - y as f64).abs();
                    prop_assert!(got < other || (got <= other + slack(M_BIAS) && n.unsigned_abs() < c.unsigned_abs()),
                        "m: y = {y:e}, code {c} ({got:e} away), neighbour {n} ({other:e} away)");
                }
                let y = y.abs();
                let c = encode_s(y);
                let got = (s_value(c) - y as f64).abs();
                for n in [c.saturating_sub(1), c.saturating_add(1)].into_iter().filter(|&n| n != c) {
                    let other = (s_value(n) - y as f64).abs();
                    prop_assert!(got < other || (got <= other + slack(S_BIAS) && n < c),
                        "s: y = {y:e}, code {c} ({got:e} away), neighbour {n} ({other:e} away)");
                }
            }

            /// The two readings of the encoder agree with a plain statement of rounding: scale
            /// `|y|` into units of the code's step in its binade and round half away.
            #[test]
            fn encoding_matches_rounding_in_f64(y in relative()) {
                let code = |a: f64, bias: i32| -> i64 {
                    if a == 0.0 {
                        return 0;
                    }
                    let e = (a.log2().floor() as i32).max(1 - bias);
                    let step = 2f64.powi(e - MANT);
                    let units = (a / step + 0.5).floor() as i64;
                    // The binade's first code plus units of `step` above its start.
                    if e == 1 - bias { units } else { (e + bias - 1) as i64 * 16 + units }
                };
                let a = y.abs();
                // Skip the subnormal range's rare double-rounding ties (see above).
                let near_tie = |bias: i32| {
                    let step = 2f64.powi(1 - bias - MANT);
                    let r = (a as f64 / step).fract();
                    a < 2f32.powi(1 - bias) && (r - 0.5).abs() < 2f64.powi(-18)
                };
                if !near_tie(M_BIAS) {
                    let c = encode_m(y) as i8;
                    prop_assert_eq!(c.unsigned_abs() as i64, code(a as f64, M_BIAS), "m {:e}", y);
                }
                if !near_tie(S_BIAS) {
                    prop_assert_eq!(encode_s(a) as i64, code(a as f64, S_BIAS), "s {:e}", a);
                }
            }

            /// The stored value is within half a mantissa step of the value, relative, above
            /// the subnormal range; below it, within half the smallest step plus the subnormal
            /// range's first rounding (half an f32 ulp of `2^(1 − bias)`, see
            /// [`Code::encode_magnitude`]): a value that close below a midpoint may take the
            /// farther code (CI found `y = 4.882811e-4`, just under half of M's smallest step).
            #[test]
            fn relative_error_is_at_most_half_a_mantissa_step(y in relative()) {
                let subnormal_bound =
                    |bias: i32| 2f64.powi(-bias - MANT) + 2f64.powi(1 - bias - 24);
                let back = decode_m(encode_m(y)) as f64;
                let err = (back - y as f64).abs();
                let bound = (y.abs() as f64 * 2f64.powi(-MANT - 1)).max(subnormal_bound(M_BIAS));
                prop_assert!(err <= bound, "m {y:e} -> {back:e}");
                let y = y.abs();
                let back = decode_s(encode_s(y)) as f64;
                let err = (back - y as f64).abs();
                let bound = (y as f64 * 2f64.powi(-MANT - 1)).max(subnormal_bound(S_BIAS));
                prop_assert!(err <= bound, "s {y:e} -> {back:e}");
            }
        }
    }
}
