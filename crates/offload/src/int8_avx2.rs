//! The 8-bit AdamW block update in AVX2 intrinsics: the same IEEE operations as the portable
//! path (`optimizer::int8_block`: decode, the f32 update of `adamw_kernel.rs`, square root,
//! absmax, encode), in the same order per element, so the bits are the same; only the
//! schedule differs.
//!
//! The kernel is bound by instruction throughput, not by memory: a single thread on
//! cache-resident data is within a few per cent of the same thread streaming 10M parameters,
//! and four table lookups per parameter (decode m, decode √v, encode both) cost more than the
//! update with its two divisions and square root. So every choice below removes instructions:
//! - Decode: eight scalar loads from the 256-entry code book (1 KiB, in L1), each indexed by
//!   its own byte load, inserted straight into a vector. Going through a stack buffer (eight
//!   scalar stores, one vector load), as before, cost about 8% more over the whole step; AVX2
//!   gathers were slower than either on the AMD EPYC (Zen 3) this was tuned on, and so was
//!   computing the code book's values arithmetically (an exact two-term fused multiply-add
//!   exists, but its permutes compete for the vector ports the update needs).
//! - The update, the square root of the new second moment (computed once: the update's
//!   denominator and the encoder both use it) and both block maxima happen in one pass; the
//!   new `m` and `√v` wait in two 8 KiB stack buffers (L1) for the encoding pass, which needs
//!   the maxima. Interleaving one block's encoding with the next block's update, to avoid the
//!   second pass, measured no faster.
//! - Encode: one scalar load per value from [`CodeBook::bucket_entry`] (indexed by the top 16
//!   bits of the scaled value; a code and a threshold on the low 16 bits), the entries
//!   inserted straight into a vector, and vector integer compares finish eight codes and pack
//!   them. Packing the indices to 16 bits and moving them out 64 bits at a time, or storing
//!   the scaled values and reloading their top halves, was slower. The table's 256 KiB do not
//!   matter: only the entries of the few binades a block's values occupy are touched (keying
//!   every lookup into the first 4 KiB measured no faster).
//!
//! Elements past the last multiple of eight run through the portable scalar operations.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use half::bf16;
use headroom_tensor::cpu::kernels::bf16_bits_to_f32;

use crate::quantized::{inverse_scale, CodeBook, QUANT_BLOCK};
use crate::StepScalars;

/// A block's gradient as the fused 8-bit kernels (this one and `float8`'s) read it.
#[derive(Clone, Copy)]
pub(crate) enum Grad<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl<'a> Grad<'a> {
    /// The kernels' view of a block's gradient (at most [`QUANT_BLOCK`] elements): f32 and
    /// bf16 as they are, f16 widened (exactly) into `wide`, which only then is allocated and
    /// zeroed.
    pub(crate) fn of(
        g: headroom_tensor::cpu::kernels::FloatSlice<'a>,
        wide: &'a mut Option<[f32; QUANT_BLOCK]>,
    ) -> Grad<'a> {
        use half::slice::HalfFloatSliceExt;
        use headroom_tensor::cpu::kernels::FloatSlice;
        match g {
            FloatSlice::F32(g) => Grad::F32(g),
            FloatSlice::BF16(g) => Grad::Bf16(g),
            FloatSlice::F16(g) => {
                let w = &mut wide.insert([0f32; QUANT_BLOCK])[..g.len()];
                g.convert_to_f32_slice(w);
                Grad::F32(w)
            }
        }
    }
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
        let (mvals, svals) = (mb.values.as_ptr(), sb.values.as_ptr());
        let (mcp, scp) = (mc.as_ptr(), sc.as_ptr());
        // Pass 1: decode, update, square root, maxima.
        let mut i = 0;
        while i < vn8 {
            // decode: values[c] · absmax; v = (√v)².
            let m = _mm256_mul_ps(decode8(mvals, mcp.add(i)), v_ms);
            let sq = _mm256_mul_ps(decode8(svals, scp.add(i)), v_ss);
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
            let m = mb.decode(mc[i]) * m_scale;
            let sq = sb.decode(sc[i]) * s_scale;
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
        let (inv_m, inv_s) = (inverse_scale(m_max), inverse_scale(s_max));
        encode_both(mb, sb, mptr, sptr, n, inv_m, inv_s, mc, sc);
        *ms = m_max;
        *ss = s_max;
    }
}

/// `table[codes[k]]` for `k < 8`: eight scalar loads inserted into one vector.
///
/// # Safety
/// AVX2; `table` has 256 elements, `codes` at least 8.
#[inline(always)]
unsafe fn decode8(table: *const f32, codes: *const u8) -> __m256 {
    // SAFETY: as the caller guarantees; a code is below 256.
    unsafe {
        // One byte load per code, kept apart by `read_volatile`: LLVM otherwise merges the
        // eight into one 64-bit load and spends two or three shifts and masks per code to
        // take it apart, which measured about 8% slower over the whole step.
        let at = |k: usize| table.add(codes.add(k).read_volatile() as usize).read();
        let lo = _mm_setr_ps(at(0), at(1), at(2), at(3));
        let hi = _mm_setr_ps(at(4), at(5), at(6), at(7));
        _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(lo), hi)
    }
}

/// `table[bits(x[k] · inv) >> 16]` for `k < 8`: the bucket entries, by scalar loads inserted
/// into one vector.
///
/// # Safety
/// AVX2; `table` has 65536 elements, `x` at least 8.
#[inline(always)]
unsafe fn entries8(table: *const u32, x: *const f32, inv: f32) -> __m256i {
    // SAFETY: as the caller guarantees; the index is below 65536.
    unsafe {
        let at = |k: usize| {
            table
                .add(((x.add(k).read() * inv).to_bits() >> 16) as usize)
                .read() as i32
        };
        _mm256_setr_epi32(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7))
    }
}

/// `mc[i] = mb.encode(m[i] · inv_m)` and `sc[i] = sb.encode(s[i] · inv_s)` for `i < n`, eight
/// at a time through [`CodeBook::bucket_entry`].
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
        let (v_inv_m, v_inv_s) = (_mm256_set1_ps(inv_m), _mm256_set1_ps(inv_s));
        let mut i = 0;
        while i < vn8 {
            let me = entries8(mt, m.add(i), inv_m);
            finish8(m.add(i), v_inv_m, me, mc.as_mut_ptr().add(i));
            let se = entries8(st, s.add(i), inv_s);
            finish8(s.add(i), v_inv_s, se, sc.as_mut_ptr().add(i));
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
/// AVX2; eight elements at `x` and at `codes`.
#[inline(always)]
unsafe fn finish8(x: *const f32, v_inv: __m256, e: __m256i, codes: *mut u8) {
    // SAFETY: as the caller guarantees.
    unsafe {
        let bits = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x), v_inv));
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
