//! Blockwise 8-bit optimizer state, in the spirit of 8-bit Adam (Dettmers et al.).
//!
//! Each moment is stored as one byte per element plus one f32 scale (the block's absolute
//! maximum) per block of [`QUANT_BLOCK`] elements: ≈ 1.002 bytes per element per moment instead
//! of 4. A byte indexes a 256-entry "dynamic" code book whose entries are spread over seven
//! decades (1e-6 … 1), so small and large values inside one block both keep ~2 significant
//! digits.
//!
//! Trade-off: the second moment is stored as its square root `s = √v`. Quantising `v` itself
//! loses every element below ~1e-7 of the block maximum to zero, and with `v = 0` the update
//! becomes `m / ε` — a huge step. `√v` has the dynamic range of `m` (both scale like the
//! gradient), so the ratio `m / √v` that Adam actually uses stays well conditioned.

use std::sync::OnceLock;

/// Elements per quantisation block (one f32 scale each).
pub const QUANT_BLOCK: usize = 2048;

/// A sorted 256-entry code book, the 255 midpoints between neighbours, and a lookup table
/// that makes encoding two loads and a compare instead of a binary search.
pub(crate) struct CodeBook {
    pub(crate) values: [f32; 256],
    /// `midpoints[i]` separates `values[i]` and `values[i + 1]`; a 256th entry of NaN (every
    /// comparison false) lets the fast path index `midpoints[255]` without a special case.
    midpoints: [f32; 256],
    /// For each value of the top 16 bits of an f32 (sign, exponent, 7 mantissa bits): the code
    /// of the smallest value with those bits. Every such bucket holds at most one midpoint
    /// (checked when the table is built), so one comparison finishes the encoding.
    bucket_code: Box<[u8]>,
    /// The same lookup for vectors, one 32-bit entry per bucket so that one gather finishes the
    /// encoding with integer compares: the bucket's code in the low 8 bits and, above them (as a
    /// signed value), `t - 1`, where `t` is the threshold on the key `low16(x)` (sign-flipped
    /// for negative buckets: `low16(x) ^ 0xffff`) at and above which `x` reaches the midpoint
    /// inside the bucket; `t = 0x1_0000` (never reached) for a bucket without one.
    pub(crate) bucket_entry: Box<[u32]>,
}

impl CodeBook {
    fn from_values(mut v: Vec<f32>) -> CodeBook {
        v.sort_by(f32::total_cmp);
        debug_assert_eq!(v.len(), 256);
        let mut values = [0f32; 256];
        values.copy_from_slice(&v);
        let mut midpoints = [f32::NAN; 256];
        for i in 0..255 {
            midpoints[i] = 0.5 * (values[i] + values[i + 1]);
        }
        let mut book = CodeBook {
            values,
            midpoints,
            bucket_code: vec![0u8; 1 << 16].into_boxed_slice(),
            bucket_entry: vec![0u32; 1 << 16].into_boxed_slice(),
        };
        for hi in 0..=u16::MAX {
            let a = f32::from_bits((hi as u32) << 16);
            let b = f32::from_bits(((hi as u32) << 16) | 0xffff);
            // Buckets next to ±∞ are half NaN; NaN itself never reaches the encoder from finite
            // optimizer arithmetic and gets an arbitrary code.
            let (lo, up) = match (a.is_nan(), b.is_nan()) {
                (true, true) => continue,
                (false, true) => (a, a),
                (true, false) => (b, b),
                (false, false) if a <= b => (a, b),
                (false, false) => (b, a),
            };
            let (c_lo, c_up) = (book.encode_exact(lo), book.encode_exact(up));
            // The code book's spacing is never finer than 2^-7 relative, so no bucket can
            // contain two midpoints; a future code book that breaks this fails this assert in
            // every test that touches 8-bit state.
            assert!(
                c_up - c_lo <= 1,
                "bucket {hi:#06x} spans codes {c_lo}..={c_up}"
            );
            book.bucket_code[hi as usize] = c_lo;
        }
        for hi in 0..=u16::MAX as u32 {
            let c = book.bucket_code[hi as usize];
            let mid = book.midpoints[c as usize];
            // `x >= mid` for `x` in this bucket: false throughout unless `mid` lies inside it
            // (the bucket's smallest value encodes to `c`, so `mid` is above it); inside it,
            // the top 16 bits agree and the order of the low 16 bits decides, reversed for
            // negative floats.
            let t: i32 = if !mid.is_nan() && mid.to_bits() >> 16 == hi {
                let low = mid.to_bits() & 0xffff;
                (if hi & 0x8000 == 0 { low } else { low ^ 0xffff }) as i32
            } else {
                0x1_0000
            };
            book.bucket_entry[hi as usize] = (((t - 1) << 8) as u32) | c as u32;
        }
        book
    }

    /// The code of the entry nearest to `x` (ties toward the larger entry): a table lookup on
    /// the top 16 bits and one comparison with the next midpoint.
    #[inline(always)]
    pub(crate) fn encode(&self, x: f32) -> u8 {
        let c = self.bucket_code[(x.to_bits() >> 16) as usize];
        c + (x >= self.midpoints[c as usize]) as u8
    }

    /// The same as [`CodeBook::encode`] by binary search over the midpoints; the reference the
    /// table is built from and tested against.
    pub(crate) fn encode_exact(&self, x: f32) -> u8 {
        let mut lo = 0usize;
        let mut step = 128usize;
        while step > 0 {
            // `lo + step - 1` indexes the midpoint below the candidate entry `lo + step`.
            let probe = lo + step - 1;
            lo += if x >= self.midpoints[probe] { step } else { 0 };
            step /= 2;
        }
        lo as u8
    }

    /// [`CodeBook::encode`] through [`CodeBook::bucket_entry`], integer operations only: the
    /// scalar statement of what the vector encoders compute.
    #[cfg(test)]
    fn encode_by_entry(&self, x: f32) -> u8 {
        let bits = x.to_bits();
        let e = self.bucket_entry[(bits >> 16) as usize];
        let key = ((bits ^ ((bits as i32 >> 31) as u32)) & 0xffff) as i32;
        (e as u8) + (key > (e as i32 >> 8)) as u8
    }

    #[inline(always)]
    pub(crate) fn decode(&self, code: u8) -> f32 {
        self.values[code as usize]
    }
}

/// Magnitudes of the dynamic code book: for decade `i` (scale 10^(i-6)), `count(i)` linearly
/// spaced fractions in (0.1, 1].
fn decade_values(count: impl Fn(u32) -> usize) -> Vec<f32> {
    let mut out = Vec::new();
    for i in 0..7u32 {
        let n = count(i);
        let scale = 10f64.powi(i as i32 - 6);
        // Midpoints of n equal bins between 0.1 and 1.
        for k in 0..n {
            let lo = 0.1 + 0.9 * k as f64 / n as f64;
            let hi = 0.1 + 0.9 * (k + 1) as f64 / n as f64;
            out.push((scale * 0.5 * (lo + hi)) as f32);
        }
    }
    out
}

/// Code book for signed values in [-1, 1] (the first moment): 127 magnitudes, both signs, 0, 1.
pub(crate) fn signed_book() -> &'static CodeBook {
    static BOOK: OnceLock<CodeBook> = OnceLock::new();
    BOOK.get_or_init(|| {
        let mags = decade_values(|i| 1usize << i); // 1 + 2 + … + 64 = 127
        let mut v: Vec<f32> = mags
            .iter()
            .copied()
            .chain(mags.iter().map(|m| -m))
            .collect();
        v.push(0.0);
        v.push(1.0);
        CodeBook::from_values(v)
    })
}

/// Code book for values in [0, 1] (the square root of the second moment): 254 magnitudes, 0, 1.
pub(crate) fn unsigned_book() -> &'static CodeBook {
    static BOOK: OnceLock<CodeBook> = OnceLock::new();
    BOOK.get_or_init(|| {
        let mut v = decade_values(|i| 2usize << i); // 2 + 4 + … + 128 = 254
        v.push(0.0);
        v.push(1.0);
        CodeBook::from_values(v)
    })
}

/// `1 / a` for a finite positive block maximum, else 0 (an all-zero or non-finite block
/// encodes as zeros): the factor every 8-bit encoder scales a block by.
#[inline(always)]
pub(crate) fn inverse_scale(a: f32) -> f32 {
    if a > 0.0 && a.is_finite() {
        1.0 / a
    } else {
        0.0
    }
}

/// Quantise `x` into `codes` with one shared scale (its absolute maximum), returned.
#[inline(always)]
pub(crate) fn quantize_block(book: &CodeBook, x: &[f32], codes: &mut [u8]) -> f32 {
    let absmax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let inv = inverse_scale(absmax);
    for (c, v) in codes.iter_mut().zip(x) {
        *c = book.encode(v * inv);
    }
    absmax
}

/// Inverse of [`quantize_block`].
#[inline(always)]
pub(crate) fn dequantize_block(book: &CodeBook, codes: &[u8], absmax: f32, out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(codes) {
        *o = book.decode(*c) * absmax;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn books_are_sorted_unique_and_span_the_unit_range() {
        for book in [signed_book(), unsigned_book()] {
            assert!(book.values.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(book.values[255], 1.0);
            assert!(book.values.contains(&0.0));
        }
        assert_eq!(signed_book().values[0], -signed_book().values[254]);
        assert_eq!(unsigned_book().values[0], 0.0);
    }

    #[test]
    fn table_encoding_equals_binary_search_for_every_bucket_edge_and_more() {
        for book in [signed_book(), unsigned_book()] {
            let mut s = 0x2545_f491u32;
            for hi in 0..=u16::MAX as u32 {
                for lo in [0u32, 1, 0x7fff, 0x8000, 0xfffe, 0xffff] {
                    let x = f32::from_bits((hi << 16) | lo);
                    if !x.is_nan() {
                        assert_eq!(book.encode(x), book.encode_exact(x), "{x:e}");
                    }
                    assert_eq!(book.encode_by_entry(x), book.encode(x), "{x:e}");
                }
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let x = f32::from_bits((hi << 16) | (s & 0xffff));
                if !x.is_nan() {
                    assert_eq!(book.encode(x), book.encode_exact(x), "{x:e}");
                }
                assert_eq!(book.encode_by_entry(x), book.encode(x), "{x:e}");
            }
            for &m in &book.midpoints[..255] {
                for x in [
                    m,
                    f32::from_bits(m.to_bits() + 1),
                    f32::from_bits(m.to_bits().wrapping_sub(1)),
                ] {
                    assert_eq!(book.encode(x), book.encode_exact(x), "{x:e}");
                    assert_eq!(book.encode_by_entry(x), book.encode(x), "{x:e}");
                    assert_eq!(book.encode_by_entry(-x), book.encode(-x), "{x:e}");
                }
            }
        }
    }

    #[test]
    fn encode_is_the_nearest_entry() {
        for book in [signed_book(), unsigned_book()] {
            for i in 0..4000 {
                let x = -1.0 + 2.0 * (i as f32 / 3999.0);
                let code = book.encode(x);
                let best = (0..256)
                    .min_by(|&a, &b| {
                        (book.values[a] - x)
                            .abs()
                            .total_cmp(&(book.values[b] - x).abs())
                    })
                    .unwrap();
                let d_got = (book.decode(code) - x).abs();
                let d_best = (book.values[best] - x).abs();
                assert!(d_got <= d_best + 1e-7, "x={x} code={code} best={best}");
            }
            // Every entry encodes to itself.
            for (i, &v) in book.values.iter().enumerate() {
                assert_eq!(book.encode(v) as usize, i);
            }
        }
    }

    #[test]
    fn relative_error_is_small_across_decades() {
        let x: Vec<f32> = (0..QUANT_BLOCK)
            .map(|i| {
                10f32.powf(-2.0 * (i as f32 / QUANT_BLOCK as f32))
                    * if i % 2 == 0 { 1.0 } else { -1.0 }
            })
            .collect();
        let mut codes = vec![0u8; x.len()];
        let scale = quantize_block(signed_book(), &x, &mut codes);
        let mut back = vec![0f32; x.len()];
        dequantize_block(signed_book(), &codes, scale, &mut back);
        for (a, b) in x.iter().zip(&back) {
            // The two top decades have 64 and 32 bins: at worst half a bin of 0.9e-2/32 at 0.01.
            assert!((a - b).abs() <= 0.15 * a.abs(), "{a} vs {b}");
        }
    }
}
