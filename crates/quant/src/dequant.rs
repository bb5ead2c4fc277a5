//! Dequantization kernels: a portable scalar reference and an AVX2 path chosen at run time.
//!
//! Every path computes `code[q] * absmax` as one f32 multiplication per element, so all of
//! them (and bitsandbytes' `dequantize_4bit`) give the same bits; the tests check that.
//!
//! The bf16 kernels give that f32 value rounded to bf16 (to nearest even, as torch's `.to`
//! does). They round the block's 16 possible values once (`code[i] * absmax` for every code
//! `i`, the same f32 multiplications) and then only look codes up: a byte shuffle per half of
//! the bf16 bits on AVX2.

use half::bf16;

/// An instruction set a dequantization kernel is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable scalar code: the reference.
    Scalar,
    /// 256-bit vectors (`avx2`): a 16-entry table lookup by two in-register permutes.
    Avx2,
}

impl Isa {
    /// The fastest path this CPU supports. AVX-512 machines run the AVX2 path: a 512-bit
    /// lookup (one `vpermps` over the 16 entries) needs `core::arch` intrinsics stabilised in
    /// Rust 1.89, after this workspace's minimum 1.85 (clippy's `incompatible_msrv` refuses
    /// them), and the dequantization is ≈ 3 % of the fused matmul, whose gemm uses AVX-512
    /// itself.
    ///
    /// `HEADROOM_CPU_ISA=baseline` keeps the scalar path ([`headroom_tensor::isa`]).
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2")
                && headroom_tensor::isa::allows(headroom_tensor::isa::IsaLevel::Avx2)
            {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => std::is_x86_feature_detected!("avx2"),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 => false,
        }
    }

    /// Every path this CPU supports, the reference first.
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2]
            .into_iter()
            .filter(|i| i.is_supported())
            .collect()
    }

    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
        }
    }
}

/// The code of element `i` (first element of a byte in its high nibble).
#[inline(always)]
pub(crate) fn nibble(codes: &[u8], i: usize) -> u8 {
    let b = codes[i / 2];
    if i.is_multiple_of(2) {
        b >> 4
    } else {
        b & 0x0f
    }
}

/// `out[j] = table[code(start + j)] * scale` for every `j`: elements `start..start + out.len()`
/// of one block. The caller guarantees `codes` covers them and `isa` is supported.
#[inline]
pub(crate) fn decode_segment(
    isa: Isa,
    table: &[f32; 16],
    codes: &[u8],
    start: usize,
    out: &mut [f32],
    scale: f32,
) {
    match isa {
        Isa::Scalar => decode_scalar(table, codes, start, out, scale),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: `Isa::Avx2` is only used after `is_supported` confirmed avx2 (the public
            // entry points check it); the ranges are the caller's contract, checked by slicing.
            unsafe { avx2::decode_segment(table, codes, start, out, scale) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 => decode_scalar(table, codes, start, out, scale),
    }
}

/// [`decode_segment`] rounded to bf16: `out[j] = bf16(table[code(start + j)] * scale)`.
#[inline]
pub(crate) fn decode_segment_bf16(
    isa: Isa,
    table: &[f32; 16],
    codes: &[u8],
    start: usize,
    out: &mut [bf16],
    scale: f32,
) {
    match isa {
        Isa::Scalar => decode_scalar_bf16(table, codes, start, out, scale),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: as in `decode_segment`.
            unsafe { avx2::decode_segment_bf16(table, codes, start, out, scale) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 => decode_scalar_bf16(table, codes, start, out, scale),
    }
}

pub(crate) fn decode_scalar_bf16(
    table: &[f32; 16],
    codes: &[u8],
    start: usize,
    out: &mut [bf16],
    scale: f32,
) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = bf16::from_f32(table[nibble(codes, start + j) as usize] * scale);
    }
}

pub(crate) fn decode_scalar(
    table: &[f32; 16],
    codes: &[u8],
    start: usize,
    out: &mut [f32],
    scale: f32,
) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = table[nibble(codes, start + j) as usize] * scale;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::{decode_scalar, decode_scalar_bf16};

    /// Bytes decoded per vector step: 16 bytes, 32 elements.
    const STEP: usize = 16;

    /// How `len` elements from `start` split for the vector loop: `(head, steps)`, the elements
    /// decoded one by one first (1 when an odd start begins in a byte's low nibble, after
    /// which elements pair up with bytes) and the vector steps after them; the rest is the
    /// scalar tail.
    fn vector_span(start: usize, len: usize) -> (usize, usize) {
        let head = usize::from(start % 2 == 1 && len > 0);
        (head, (len - head) / 2 / STEP)
    }

    /// # Safety
    /// The CPU must support avx2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn decode_segment(
        table: &[f32; 16],
        codes: &[u8],
        start: usize,
        out: &mut [f32],
        scale: f32,
    ) {
        let (mut j, steps) = vector_span(start, out.len());
        decode_scalar(table, codes, start, &mut out[..j], scale);
        let first_byte = (start + j) / 2;
        if steps > 0 {
            let bytes = &codes[first_byte..first_byte + steps * STEP];
            let dst = &mut out[j..j + steps * STEP * 2];
            // SAFETY: avx2 is enabled on this function; `table` has 16 floats (two unaligned
            // 8-float loads); every chunk of `bytes` has 16 bytes and of `dst` 32 floats
            // (chunks_exact), read and written unaligned.
            unsafe {
                let t_lo = _mm256_loadu_ps(table.as_ptr());
                let t_hi = _mm256_loadu_ps(table.as_ptr().add(8));
                let vscale = _mm256_set1_ps(scale);
                let mask = _mm_set1_epi8(0x0f);
                // Eight codes (the low 8 bytes of `$idx`) through the 16-entry table, scaled:
                // two permutes, and bit 3 of the code (shifted into the sign) picks between them.
                macro_rules! lookup {
                    ($idx:expr) => {{
                        let i = _mm256_cvtepu8_epi32($idx);
                        let a = _mm256_permutevar8x32_ps(t_lo, i);
                        let b = _mm256_permutevar8x32_ps(t_hi, i);
                        let sel = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(i));
                        _mm256_mul_ps(_mm256_blendv_ps(a, b, sel), vscale)
                    }};
                }
                for (src, dst) in bytes.chunks_exact(STEP).zip(dst.chunks_exact_mut(STEP * 2)) {
                    let v = _mm_loadu_si128(src.as_ptr().cast());
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), mask);
                    let lo = _mm_and_si128(v, mask);
                    // Element order: byte k's high nibble, then its low nibble.
                    let first = _mm_unpacklo_epi8(hi, lo);
                    let second = _mm_unpackhi_epi8(hi, lo);
                    let p = dst.as_mut_ptr();
                    _mm256_storeu_ps(p, lookup!(first));
                    _mm256_storeu_ps(p.add(8), lookup!(_mm_srli_si128::<8>(first)));
                    _mm256_storeu_ps(p.add(16), lookup!(second));
                    _mm256_storeu_ps(p.add(24), lookup!(_mm_srli_si128::<8>(second)));
                }
            }
            j += steps * STEP * 2;
        }
        decode_scalar(table, codes, start + j, &mut out[j..], scale);
    }

    /// bf16 bits of eight f32 values (u32 lanes, the bits in the low half), to nearest even,
    /// NaN kept quiet: `half::bf16::from_f32`'s bits (tested against it).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn round_to_bf16(x: __m256) -> __m256i {
        let b = _mm256_castps_si256(x);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb);
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
        let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
        _mm256_blendv_epi8(rounded, quiet, nan)
    }

    /// # Safety
    /// The CPU must support avx2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn decode_segment_bf16(
        table: &[f32; 16],
        codes: &[u8],
        start: usize,
        out: &mut [bf16],
        scale: f32,
    ) {
        let (mut j, steps) = vector_span(start, out.len());
        decode_scalar_bf16(table, codes, start, &mut out[..j], scale);
        let first_byte = (start + j) / 2;
        if steps > 0 {
            let bytes = &codes[first_byte..first_byte + steps * STEP];
            let dst = &mut out[j..j + steps * STEP * 2];
            // SAFETY: avx2 is enabled on this function; `table` has 16 floats (two unaligned
            // 8-float loads); every chunk of `bytes` has 16 bytes and of `dst` 32 bf16 values
            // (chunks_exact), read and written unaligned.
            unsafe {
                let vscale = _mm256_set1_ps(scale);
                // The block's 16 values in bf16, as two byte tables: low bytes, high bytes.
                let v0 = round_to_bf16(_mm256_mul_ps(_mm256_loadu_ps(table.as_ptr()), vscale));
                let v1 = round_to_bf16(_mm256_mul_ps(
                    _mm256_loadu_ps(table.as_ptr().add(8)),
                    vscale,
                ));
                // u16 lanes 0–3 of v0, 0–3 of v1, 4–7 of v0, 4–7 of v1; reordered to 0–15.
                let words = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(v0, v1));
                // Per 128-bit lane: the 8 low bytes, then the 8 high bytes.
                let split = _mm256_setr_epi8(
                    0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                    14, 1, 3, 5, 7, 9, 11, 13, 15,
                );
                let halves =
                    _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(words, split));
                let lo_table = _mm256_castsi256_si128(halves);
                let hi_table = _mm256_extracti128_si256::<1>(halves);
                let mask = _mm_set1_epi8(0x0f);
                for (src, dst) in bytes.chunks_exact(STEP).zip(dst.chunks_exact_mut(STEP * 2)) {
                    let v = _mm_loadu_si128(src.as_ptr().cast());
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), mask);
                    let lo = _mm_and_si128(v, mask);
                    let p = dst.as_mut_ptr().cast::<__m128i>();
                    // Element order: byte k's high nibble, then its low nibble.
                    for (h, idx) in [_mm_unpacklo_epi8(hi, lo), _mm_unpackhi_epi8(hi, lo)]
                        .into_iter()
                        .enumerate()
                    {
                        let l = _mm_shuffle_epi8(lo_table, idx);
                        let u = _mm_shuffle_epi8(hi_table, idx);
                        _mm_storeu_si128(p.add(2 * h), _mm_unpacklo_epi8(l, u));
                        _mm_storeu_si128(p.add(2 * h + 1), _mm_unpackhi_epi8(l, u));
                    }
                }
            }
            j += steps * STEP * 2;
        }
        decode_scalar_bf16(table, codes, start + j, &mut out[j..], scale);
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    /// The AVX2 rounding is `half::bf16::from_f32` on the values where rounding is delicate:
    /// ties (to even, both ways), just off ties, the largest finite values (rounding up to
    /// infinity), infinities, NaNs (quieted, sign and payload kept), denormals and zeros.
    #[test]
    fn avx2_rounding_to_bf16_is_halfs() {
        if !std::is_x86_feature_detected!("avx2") {
            return;
        }
        let bits: Vec<u32> = vec![
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_7fff,
            0xbf80_8000,
            0xbf81_8000,
            0x7f7f_ffff,
            0x7f7f_8000,
            0x7f7f_7fff,
            0xff7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0xffc0_0001,
            0x7f80_0001,
            0xff81_2345,
            0x0000_0001,
            0x0000_8000,
            0x0001_8000,
            0x8000_0000,
            0x0000_0000,
            0x0080_0000,
            0x007f_ffff,
            0x4049_0fdb,
        ];
        for chunk in bits.chunks(8) {
            let mut lanes = [0f32; 8];
            for (l, &b) in lanes.iter_mut().zip(chunk) {
                *l = f32::from_bits(b);
            }
            let mut got = [0u32; 8];
            // SAFETY: avx2 checked above; both arrays hold 8 lanes.
            unsafe {
                use std::arch::x86_64::*;
                let r = super::avx2::round_to_bf16(_mm256_loadu_ps(lanes.as_ptr()));
                _mm256_storeu_si256(got.as_mut_ptr().cast(), r);
            }
            for (l, g) in lanes.iter().zip(got) {
                let want = half::bf16::from_f32(*l).to_bits() as u32;
                assert_eq!(g, want, "{:#010x}", l.to_bits());
            }
        }
    }
}

#[cfg(test)]
mod cap_tests {
    use super::Isa;

    /// `HEADROOM_CPU_ISA=baseline` keeps [`Isa::detect`] on the scalar path: this test binary
    /// re-run under each cap, on the ignored probe below (the choice is made once per process).
    #[test]
    fn the_cpu_isa_cap_bounds_detect() {
        let avx2 = Isa::Avx2.is_supported();
        for (cap, want) in [
            ("baseline", Isa::Scalar),
            ("avx2", if avx2 { Isa::Avx2 } else { Isa::Scalar }),
        ] {
            let probe = "dequant::cap_tests::probe_detect";
            let text = headroom_tensor::isa::rerun_test_with_cap(probe, cap).unwrap();
            assert!(
                text.lines().any(|l| l == format!("detect={want:?}")),
                "{cap}: want {want:?} in {text}"
            );
        }
    }

    #[test]
    #[ignore = "run by the_cpu_isa_cap_bounds_detect"]
    fn probe_detect() {
        println!("detect={:?}", Isa::detect());
    }
}
