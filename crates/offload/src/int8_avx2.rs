//! The 8-bit AdamW block update in AVX2 intrinsics: the same IEEE operations as the portable
//! path (`optimizer::int8_block`: decode, the f32 update of `adamw_kernel.rs`, square root,
//! absmax, encode), in the same order per element, so the bits are the same; only the
//! schedule differs.
//!
//! - Decode: scalar loads from the 256-entry code books (1 KiB each, in L1), run a few
//!   elements ahead of the vector update in the same loop so that they overlap its divisions
//!   and square root. (AVX2 gathers were measured no faster than scalar loads on the AMD
//!   EPYC this was tuned on.)
//! - The update, the square root of the new second moment (computed once: the update's
//!   denominator and the encoder both use it) and both block maxima happen in one pass; the
//!   new `m` and `√v` wait in two 8 KiB stack buffers (L1) for the encoding pass, which needs
//!   the maxima.
//! - Encode: one scalar load per value from [`CodeBook::bucket_entry`] (indexed by the top 16
//!   bits of the scaled value; a code and a threshold on the low 16 bits), again run ahead
//!   of the vector code that finishes eight codes with integer compares and packs them.
//!
//! Elements past the last multiple of eight run through the portable scalar operations.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use half::bf16;
use headroom_tensor::cpu::kernels::bf16_bits_to_f32;

use crate::quantized::{CodeBook, QUANT_BLOCK};
use crate::StepScalars;

/// A block's gradient as the fused kernel reads it.
#[derive(Clone, Copy)]
pub(crate) enum Grad<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

/// The update for one block of at most [`QUANT_BLOCK`] elements: `p` and `g` as long as the
/// code slices; `ms`, `ss` the block's scales.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn block(
    mb: &CodeBook,
    sb: &CodeBook,
    s: &StepScalars,
    p: &mut [f32],
    g: Grad<'_>,
    mc: &mut [u8],
    sc: &mut [u8],
    ms: &mut f32,
    ss: &mut f32,
) {
    // SAFETY: the caller guarantees AVX2 and FMA.
    unsafe {
        if s.lerp_weight_is_small() {
            block_impl::<true>(mb, sb, s, p, g, mc, sc, ms, ss)
        } else {
            block_impl::<false>(mb, sb, s, p, g, mc, sc, ms, ss)
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block_impl<const SMALL_WEIGHT: bool>(
    mb: &CodeBook,
    sb: &CodeBook,
    s: &StepScalars,
    p: &mut [f32],
    g: Grad<'_>,
    mc: &mut [u8],
    sc: &mut [u8],
    ms: &mut f32,
    ss: &mut f32,
) {
    // SAFETY: the caller guarantees AVX2 and FMA; every pointer stays inside its slice.
    unsafe {
        let n = p.len();
        assert!(n <= QUANT_BLOCK && mc.len() == n && sc.len() == n);
        match g {
            Grad::F32(g) => assert_eq!(g.len(), n),
            Grad::Bf16(g) => assert_eq!(g.len(), n),
        }
        // Written below before they are read, element by element, up to `n`.
        let mut mbuf = MaybeUninit::<[f32; QUANT_BLOCK]>::uninit();
        let mut sbuf = MaybeUninit::<[f32; QUANT_BLOCK]>::uninit();
        let (mptr, sptr) = (mbuf.as_mut_ptr() as *mut f32, sbuf.as_mut_ptr() as *mut f32);
        let (m_scale, s_scale) = (*ms, *ss);
        let lerp_w = if SMALL_WEIGHT {
            s.one_minus_beta1
        } else {
            s.one_minus_beta1 - 1.0
        };

        let vn8 = n / 8 * 8;
        let (v_ms, v_ss) = (_mm256_set1_ps(m_scale), _mm256_set1_ps(s_scale));
        let v_decay = _mm256_set1_ps(s.decay);
        let v_w = _mm256_set1_ps(lerp_w);
        let v_b2 = _mm256_set1_ps(s.beta2);
        let v_omb2 = _mm256_set1_ps(s.one_minus_beta2);
        let v_bc2 = _mm256_set1_ps(s.bc2_sqrt);
        let v_eps = _mm256_set1_ps(s.eps);
        let v_step = _mm256_set1_ps(s.step_size);
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let mut amax_m = _mm256_setzero_ps();
        let mut amax_s = _mm256_setzero_ps();
        let pp = p.as_mut_ptr();
        // Pass 1: decode, update, square root, maxima. The decode (scalar loads, see
        // `lookup`) runs `AHEAD` elements ahead of the update in the same loop, so its loads
        // overlap the update's divisions; the buffers hold the looked-up book values until
        // the update scales them.
        let (mvals, svals) = (mb.values.as_ptr(), sb.values.as_ptr());
        let (mcp, scp) = (mc.as_ptr(), sc.as_ptr());
        lookup(mvals, mcp, mptr, n.min(AHEAD));
        lookup(svals, scp, sptr, n.min(AHEAD));
        let mut i = 0;
        while i < vn8 {
            // Decode [i + AHEAD, i + AHEAD + 8) ∩ [0, n): with the prologue's [0, AHEAD),
            // every element before it is read (n < vn8 + 8, so the iteration at i = vn8 - 16
            // decodes the scalar tail [vn8, n) too).
            let j = i + AHEAD;
            if j + 8 <= n {
                lookup8(mvals, mcp.add(j), mptr.add(j));
                lookup8(svals, scp.add(j), sptr.add(j));
            } else if j < n {
                lookup(mvals, mcp.add(j), mptr.add(j), n - j);
                lookup(svals, scp.add(j), sptr.add(j), n - j);
            }
            // decode: values[c] · absmax; v = (√v)².
            let m = _mm256_mul_ps(_mm256_loadu_ps(mptr.add(i)), v_ms);
            let sq = _mm256_mul_ps(_mm256_loadu_ps(sptr.add(i)), v_ss);
            let v = _mm256_mul_ps(sq, sq);
            let gv = match g {
                Grad::F32(g) => _mm256_loadu_ps(g.as_ptr().add(i)),
                Grad::Bf16(g) => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(g.as_ptr().add(i) as *const __m128i)),
                )),
            };
            let pv = _mm256_loadu_ps(pp.add(i));
            // The update of `adamw_kernel::update`, operation for operation.
            let decayed = _mm256_mul_ps(pv, v_decay);
            let diff = _mm256_sub_ps(gv, m);
            let mn = if SMALL_WEIGHT {
                _mm256_fmadd_ps(v_w, diff, m)
            } else {
                _mm256_fmadd_ps(v_w, diff, gv)
            };
            let vn = _mm256_fmadd_ps(_mm256_mul_ps(v_omb2, gv), gv, _mm256_mul_ps(v, v_b2));
            let root = _mm256_sqrt_ps(vn);
            let denom = _mm256_add_ps(_mm256_div_ps(root, v_bc2), v_eps);
            let pn = _mm256_sub_ps(decayed, _mm256_div_ps(_mm256_mul_ps(v_step, mn), denom));
            _mm256_storeu_ps(pp.add(i), pn);
            _mm256_storeu_ps(mptr.add(i), mn);
            _mm256_storeu_ps(sptr.add(i), root);
            // `a.max(|x|)` ignoring a NaN `x`: `max_ps` returns its second operand when either is
            // NaN, and the running maximum never is.
            amax_m = _mm256_max_ps(_mm256_and_ps(mn, abs_mask), amax_m);
            amax_s = _mm256_max_ps(_mm256_and_ps(root, abs_mask), amax_s);
            i += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), amax_m);
        let mut m_max = lanes.iter().fold(0f32, |a, &x| a.max(x));
        _mm256_storeu_ps(lanes.as_mut_ptr(), amax_s);
        let mut s_max = lanes.iter().fold(0f32, |a, &x| a.max(x));
        for i in vn8..n {
            let m = mptr.add(i).read() * m_scale;
            let sq = sptr.add(i).read() * s_scale;
            let v = sq * sq;
            let gi = match g {
                Grad::F32(g) => g[i],
                Grad::Bf16(g) => bf16_bits_to_f32(g[i].to_bits()),
            };
            let decayed = p[i] * s.decay;
            let diff = gi - m;
            let mn = if SMALL_WEIGHT {
                lerp_w.mul_add(diff, m)
            } else {
                lerp_w.mul_add(diff, gi)
            };
            let vn = (s.one_minus_beta2 * gi).mul_add(gi, v * s.beta2);
            let root = vn.sqrt();
            let denom = root / s.bc2_sqrt + s.eps;
            p[i] = decayed - (s.step_size * mn) / denom;
            mptr.add(i).write(mn);
            sptr.add(i).write(root);
            m_max = m_max.max(mn.abs());
            s_max = s_max.max(root.abs());
        }

        // Pass 2: encode against the maxima, as `quantize_block` does.
        let inv = |a: f32| {
            if a > 0.0 && a.is_finite() {
                1.0 / a
            } else {
                0.0
            }
        };
        let (inv_m, inv_s) = (inv(m_max), inv(s_max));
        encode_both(mb, sb, mptr, sptr, n, inv_m, inv_s, mc, sc);
        *ms = m_max;
        *ss = s_max;
    }
}

/// `out[i] = table[codes[i]]` for `i < n`, by scalar loads. Deliberately a plain function,
/// compiled without AVX2 and kept out of line: AVX2 would let the compiler turn it into
/// gathers, which on the AMD cores this was tuned on are several times slower than scalar
/// loads from an L1-resident table.
///
/// # Safety
/// `table` has 256 elements, `codes` and `out` at least `n`.
#[inline(never)]
unsafe fn lookup<T: Copy>(table: *const T, codes: *const u8, out: *mut T, n: usize) {
    for i in 0..n {
        // SAFETY: as the caller guarantees; a code is below 256.
        unsafe {
            out.add(i)
                .write(table.add(codes.add(i).read() as usize).read())
        };
    }
}

/// How far ahead of the vector work the scalar table loads run.
const AHEAD: usize = 16;

/// [`lookup`] of exactly eight codes, inlined into the vector loops (the codes as one 64-bit
/// load, the table loads scalar).
///
/// # Safety
/// As [`lookup`] with `n = 8`.
#[inline(always)]
unsafe fn lookup8(table: *const f32, codes: *const u8, out: *mut f32) {
    // SAFETY: as the caller guarantees; a code is below 256.
    unsafe {
        let c = (codes as *const u64).read_unaligned();
        for k in 0..8 {
            let code = ((c >> (8 * k)) & 0xff) as usize;
            out.add(k).write(table.add(code).read());
        }
    }
}

/// `out[k] = table[bits(x[k] · inv) >> 16]` for `k < 8`: bucket entries by scalar loads.
///
/// # Safety
/// `table` has 65536 elements, `x` and `out` at least 8.
#[inline(always)]
unsafe fn buckets8(table: *const u32, x: *const f32, inv: f32, out: *mut u32) {
    // SAFETY: as the caller guarantees; the index is below 65536.
    unsafe {
        for k in 0..8 {
            let hi = ((x.add(k).read() * inv).to_bits() >> 16) as usize;
            out.add(k).write(table.add(hi).read());
        }
    }
}

/// `mc[i] = mb.encode(m[i] · inv_m)` and `sc[i] = sb.encode(s[i] · inv_s)` for `i < n`: the
/// bucket entries by scalar loads `AHEAD` elements ahead of the vector code that finishes the
/// encoding (see [`CodeBook::bucket_entry`]).
///
/// # Safety
/// AVX2 and FMA; `m`, `s` initialised up to `n <= QUANT_BLOCK`; `mc`, `sc` at least `n` long.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn encode_both(
    mb: &CodeBook,
    sb: &CodeBook,
    m: *const f32,
    s: *const f32,
    n: usize,
    inv_m: f32,
    inv_s: f32,
    mc: &mut [u8],
    sc: &mut [u8],
) {
    // SAFETY: the caller guarantees AVX2 and FMA; every pointer stays inside its buffer.
    unsafe {
        let vn8 = n / 8 * 8;
        let (mt, st) = (mb.bucket_entry.as_ptr(), sb.bucket_entry.as_ptr());
        let mut me = MaybeUninit::<[u32; QUANT_BLOCK]>::uninit();
        let mut se = MaybeUninit::<[u32; QUANT_BLOCK]>::uninit();
        let (mep, sep) = (me.as_mut_ptr() as *mut u32, se.as_mut_ptr() as *mut u32);
        let mut j = 0;
        while j < vn8.min(AHEAD) {
            buckets8(mt, m.add(j), inv_m, mep.add(j));
            buckets8(st, s.add(j), inv_s, sep.add(j));
            j += 8;
        }
        let (v_inv_m, v_inv_s) = (_mm256_set1_ps(inv_m), _mm256_set1_ps(inv_s));
        let mut i = 0;
        while i < vn8 {
            let j = i + AHEAD;
            if j < vn8 {
                buckets8(mt, m.add(j), inv_m, mep.add(j));
                buckets8(st, s.add(j), inv_s, sep.add(j));
            }
            finish8(m.add(i), v_inv_m, mep.add(i), mc.as_mut_ptr().add(i));
            finish8(s.add(i), v_inv_s, sep.add(i), sc.as_mut_ptr().add(i));
            i += 8;
        }
        for i in vn8..n {
            mc[i] = mb.encode(m.add(i).read() * inv_m);
            sc[i] = sb.encode(s.add(i).read() * inv_s);
        }
    }
}

/// Eight codes from eight values (scaled here) and their bucket entries:
/// `code + (key > t - 1)`, the compare giving -1 for true.
///
/// # Safety
/// AVX2; eight elements at each pointer.
#[inline(always)]
unsafe fn finish8(x: *const f32, v_inv: __m256, e: *const u32, codes: *mut u8) {
    // SAFETY: as the caller guarantees.
    unsafe {
        let bits = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x), v_inv));
        let e = _mm256_loadu_si256(e as *const __m256i);
        let key = _mm256_and_si256(
            _mm256_xor_si256(bits, _mm256_srai_epi32::<31>(bits)),
            _mm256_set1_epi32(0xffff),
        );
        let code = _mm256_sub_epi32(
            _mm256_and_si256(e, _mm256_set1_epi32(0xff)),
            _mm256_cmpgt_epi32(key, _mm256_srai_epi32::<8>(e)),
        );
        // Byte 0 of each 32-bit lane to the low four bytes of its 128-bit half, then the
        // two halves together.
        let pick = _mm256_setr_epi8(
            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, //
            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
        );
        let join = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
        let packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(code, pick), join);
        _mm_storel_epi64(codes as *mut __m128i, _mm256_castsi256_si128(packed));
    }
}
