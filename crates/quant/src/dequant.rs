//! Dequantization kernels: a portable scalar reference and an AVX2 path chosen at run time.
//!
//! Every path computes `code[q] * absmax` as one f32 multiplication per element, so all of
//! them (and bitsandbytes' `dequantize_4bit`) give the same bits; the tests check that.

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
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
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

    use super::{decode_scalar, nibble};

    /// Bytes decoded per vector step: 16 bytes, 32 elements.
    const STEP: usize = 16;

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
        let mut j = 0usize;
        // An odd start begins in a byte's low nibble; after it, elements pair up with bytes.
        if start % 2 == 1 && !out.is_empty() {
            out[0] = table[nibble(codes, start) as usize] * scale;
            j = 1;
        }
        let first_byte = (start + j) / 2;
        let pairs = (out.len() - j) / 2;
        let steps = pairs / STEP;
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
}
