//! f32 → bf16 stochastic rounding with a counter-based random number generator.
//!
//! A value `x` between two neighbouring bf16 values `lo < x < hi` becomes `hi` with probability
//! `(x − lo) / (hi − lo)` and `lo` otherwise, so the rounding is unbiased: `E[round(x)] = x`.
//! On the bit level this is "add 16 uniform random bits to the low half of the f32, then
//! truncate": the low 16 bits of an f32 are linearly spaced between the two bf16 neighbours
//! (also across the subnormal range, where bf16 and f32 share the exponent), so the carry
//! happens with exactly the right probability. Magnitude rounds, sign stays, so negative values
//! behave like positive ones.
//!
//! The random bits come from a hash of `(seed, step, tensor, element index)`, not from a
//! sequential generator: every element's bits are fixed by its coordinates alone, so the result
//! is the same for any thread count, any chunking, and after a resume.
//!
//! Special values: NaN stays NaN (quieted, sign kept, as round-to-nearest does), ±∞ stays ±∞,
//! and a finite value above `bf16::MAX` may round up to ∞ — infinity *is* its upper
//! neighbour, and round-to-nearest sends the upper half of that interval there too.

use half::bf16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Elements per parallel task. Results never depend on it (every element's random bits come
/// from its global index); it only sets the grain of the work split. It divides 2³², so a
/// chunk never straddles a change of the index's high word.
const CHUNK: usize = 1 << 15;

/// The coordinates that fix the random bits of one rounding of one tensor.
///
/// Use the optimizer step as `step` and the parameter's position as `tensor`: two roundings
/// with the same key give the same bits, any other key gives independent ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RoundingKey {
    /// The run's seed.
    pub seed: u64,
    /// The optimizer step (or any per-rounding counter).
    pub step: u64,
    /// Which tensor of the model.
    pub tensor: u32,
}

/// SplitMix64's finaliser: a bijective 64-bit mixer with full avalanche.
#[inline(always)]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Chris Wellons' `lowbias32`: a bijective 32-bit mixer with low avalanche bias. 32-bit lanes
/// keep the per-element hash vectorisable without 64-bit vector multiplies.
#[inline(always)]
fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// Two 32-bit keys for the elements whose index has high word `index_hi`, derived from the
/// whole key with 64-bit mixing (once per chunk, so its cost does not matter).
#[inline]
fn stream_keys(key: RoundingKey, index_hi: u32) -> (u32, u32) {
    const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h = mix64(key.seed.wrapping_add(GOLDEN));
    h = mix64(h ^ key.step.wrapping_mul(GOLDEN));
    h = mix64(h ^ ((u64::from(key.tensor) << 32) | u64::from(index_hi)));
    ((h >> 32) as u32, h as u32)
}

/// 16 uniform random bits for the element with low index word `index_lo` in a stream. Two
/// rounds: the first is a bijection of the index, the second decorrelates streams whose first
/// keys happen to be related.
#[inline(always)]
fn random16(k1: u32, k2: u32, index_lo: u32) -> u32 {
    lowbias32(lowbias32(index_lo ^ k1).wrapping_add(k2)) >> 16
}

/// The random bits element `index` gets under `key` — what [`stochastic_round_bf16`] adds.
/// Exposed so tests and other backends (a CUDA kernel) can reproduce them.
pub fn random_bits(key: RoundingKey, index: u64) -> u16 {
    let (k1, k2) = stream_keys(key, (index >> 32) as u32);
    random16(k1, k2, index as u32) as u16
}

/// Round one f32 to bf16 given 16 random bits (only the low 16 bits of `random` are used).
///
/// The scalar definition every fast path must equal bit for bit.
#[inline(always)]
pub fn stochastic_round_bf16_bits(x: f32, random: u32) -> u16 {
    let b = x.to_bits();
    let is_nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    // No carry out of bit 31 for non-NaN inputs: the largest one, -∞ = 0xff80_0000, plus
    // 0xffff stays below 2³². NaN inputs may wrap; their result is replaced below.
    let rounded = b.wrapping_add(random & 0xffff) >> 16;
    let quiet_nan = (b >> 16) | 0x0040;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

/// The loop body every instruction-set variant shares: a plain indexed loop over equal-length
/// slices with a branch-free body, which LLVM vectorises for whatever features the caller
/// enables.
#[inline(always)]
fn round_chunk_body(src: &[f32], dst: &mut [bf16], k1: u32, k2: u32, base_lo: u32) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    for i in 0..n {
        let r = random16(k1, k2, base_lo.wrapping_add(i as u32));
        dst[i] = bf16::from_bits(stochastic_round_bf16_bits(src[i], r));
    }
}

/// Baseline x86-64 (SSE2) or any other architecture.
fn round_chunk_portable(src: &[f32], dst: &mut [bf16], k1: u32, k2: u32, base_lo: u32) {
    round_chunk_body(src, dst, k1, k2, base_lo)
}

/// The hash needs 32-bit lane multiplies, which SSE2 lacks (LLVM emulates them with two
/// 64-bit multiplies and shuffles): without a wider instruction set the kernel is compute
/// bound at roughly a quarter of memory bandwidth. The workspace builds for baseline x86-64,
/// so the AVX2 variant is chosen at run time. (An AVX-512 variant was about 10% faster in one
/// noisy measurement, but its target features need Rust 1.89; the workspace supports 1.85.)
/// Integer arithmetic only: every variant gives the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn round_chunk_avx2(src: &[f32], dst: &mut [bf16], k1: u32, k2: u32, base_lo: u32) {
    round_chunk_body(src, dst, k1, k2, base_lo)
}

/// One chunk: elements `[base, base + src.len())` of the tensor, on the widest instruction
/// set the CPU has.
#[inline]
fn round_chunk(src: &[f32], dst: &mut [bf16], key: RoundingKey, base: u64) {
    let (k1, k2) = stream_keys(key, (base >> 32) as u32);
    let base_lo = base as u32;
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2")
            && headroom_tensor::isa::allows(headroom_tensor::isa::IsaLevel::Avx2)
        {
            // SAFETY: the CPU supports AVX2, the only feature the function is compiled for
            // (checked just above); the function itself only touches its slices safely.
            return unsafe { round_chunk_avx2(src, dst, k1, k2, base_lo) };
        }
    }
    round_chunk_portable(src, dst, k1, k2, base_lo)
}

/// `dst = stochastic_round(src)` for element indices `0..len`, threaded with rayon in fixed
/// chunks. Lengths must match (callers check; a longer side's tail is left alone).
///
/// Deterministic: the output depends on `(src, key)` only — not on the thread count.
pub fn stochastic_round_bf16(src: &[f32], dst: &mut [bf16], key: RoundingKey) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    if n <= CHUNK {
        round_chunk(src, dst, key, 0);
    } else {
        src.par_chunks(CHUNK)
            .zip(dst.par_chunks_mut(CHUNK))
            .enumerate()
            .for_each(|(c, (s, d))| round_chunk(s, d, key, (c * CHUNK) as u64));
    }
}

/// The plain reference: one element at a time, no threads, [`random_bits`] per element.
pub fn stochastic_round_bf16_reference(src: &[f32], key: RoundingKey) -> Vec<bf16> {
    src.iter()
        .enumerate()
        .map(|(i, &x)| {
            bf16::from_bits(stochastic_round_bf16_bits(
                x,
                u32::from(random_bits(key, i as u64)),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KEY: RoundingKey = RoundingKey {
        seed: 7,
        step: 3,
        tensor: 1,
    };

    /// The two bf16 values around `x` (equal when `x` is representable), by magnitude.
    fn neighbours(x: f32) -> (u16, u16) {
        let hi16 = (x.to_bits() >> 16) as u16;
        if x.to_bits() & 0xffff == 0 {
            (hi16, hi16)
        } else {
            (hi16, hi16 + 1)
        }
    }

    #[test]
    fn special_values() {
        for r in [0u32, 1, 0x7fff, 0x8000, 0xffff] {
            for x in [f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1.0, -2.5] {
                assert_eq!(
                    bf16::from_bits(stochastic_round_bf16_bits(x, r))
                        .to_f32()
                        .to_bits(),
                    x.to_bits(),
                    "{x} is bf16-representable and must stay itself (r={r})"
                );
            }
            for nan in [
                f32::NAN,
                -f32::NAN,
                f32::from_bits(0x7f80_0001),
                f32::from_bits(0xffff_ffff),
            ] {
                let out = bf16::from_bits(stochastic_round_bf16_bits(nan, r));
                assert!(out.is_nan(), "{nan:?} r={r}");
                assert_eq!(out.is_sign_negative(), nan.is_sign_negative());
            }
        }
        // Above bf16::MAX the upper neighbour is infinity.
        let x = f32::MAX;
        assert_eq!(stochastic_round_bf16_bits(x, 0), 0x7f7f);
        assert_eq!(stochastic_round_bf16_bits(x, 0xffff), 0x7f80);
        // Round-to-nearest's NaN handling is the same.
        assert_eq!(
            stochastic_round_bf16_bits(f32::from_bits(0x7f80_0001), 0xffff),
            bf16::from_f32(f32::from_bits(0x7f80_0001)).to_bits()
        );
    }

    #[test]
    fn probability_of_rounding_up_is_the_fraction() {
        // x = lo + 0.25·(hi − lo): exactly a quarter of all 2¹⁶ random values carry.
        let x = f32::from_bits(0x3f80_4000);
        let ups = (0..=0xffffu32)
            .filter(|&r| stochastic_round_bf16_bits(x, r) == 0x3f81)
            .count();
        assert_eq!(ups, 0x4000);
    }

    #[test]
    fn random_bits_are_roughly_uniform() {
        // Bucket 2¹⁶ draws into 16 bins; each expects 4096 (σ ≈ 62).
        let mut bins = [0u32; 16];
        for i in 0..(1u64 << 16) {
            bins[(random_bits(KEY, i) >> 12) as usize] += 1;
        }
        for b in bins {
            assert!((3700..4500).contains(&b), "{bins:?}");
        }
    }

    #[test]
    fn thread_count_does_not_change_the_result() {
        let n = 3 * CHUNK + 123;
        let src: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        let expected = stochastic_round_bf16_reference(&src, KEY);
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut dst = vec![bf16::ZERO; n];
            pool.install(|| stochastic_round_bf16(&src, &mut dst, KEY));
            assert!(
                dst.iter()
                    .zip(&expected)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "threads={threads}"
            );
        }
    }

    /// Each instruction-set variant the CPU has equals the scalar reference bit for bit (the
    /// dispatcher picks only one of them, so the others are called directly here).
    #[test]
    fn every_instruction_set_variant_equals_the_reference() {
        let n = 4099;
        let src: Vec<f32> = (0..n)
            .map(|i| f32::from_bits((i as u32).wrapping_mul(0x9e37_79b9)))
            .collect();
        let expected = stochastic_round_bf16_reference(&src, KEY);
        let (k1, k2) = stream_keys(KEY, 0);
        let mut variants: Vec<(&str, Vec<bf16>)> = Vec::new();
        let mut dst = vec![bf16::ZERO; n];
        round_chunk_portable(&src, &mut dst, k1, k2, 0);
        variants.push(("portable", dst.clone()));
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 checked just above.
                unsafe { round_chunk_avx2(&src, &mut dst, k1, k2, 0) };
                variants.push(("avx2", dst.clone()));
            }
        }
        for (name, got) in variants {
            let same = got
                .iter()
                .zip(&expected)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name} differs from the reference");
        }
    }

    #[test]
    fn high_index_words_get_their_own_stream() {
        let lo = random_bits(KEY, 5);
        let hi = random_bits(KEY, 5 + (1u64 << 32));
        let other: Vec<u16> = (0..8).map(|i| random_bits(KEY, (i << 32) | 5)).collect();
        assert_eq!(lo, other[0]);
        assert_eq!(hi, other[1]);
        // Not all equal: the high word feeds the key.
        assert!(other.iter().any(|&v| v != lo));
    }

    fn finite_f32() -> impl Strategy<Value = f32> {
        prop_oneof![
            any::<u32>()
                .prop_map(f32::from_bits)
                .prop_filter("finite", |x| x.is_finite()),
            -1e4f32..1e4f32,
            (-1e-38f32..1e-38f32),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Never outside the two neighbouring bf16 values, whatever the random bits.
        #[test]
        fn stays_between_neighbours(x in finite_f32(), r in any::<u32>()) {
            let (lo, hi) = neighbours(x);
            let out = stochastic_round_bf16_bits(x, r);
            prop_assert!(out == lo || out == hi, "x={x:e} out={out:#x} lo={lo:#x} hi={hi:#x}");
        }

        /// The threaded kernel equals the scalar reference bit for bit, and is deterministic.
        #[test]
        fn kernel_equals_reference(
            src in proptest::collection::vec(finite_f32(), 0..2000),
            seed in any::<u64>(), step in any::<u64>(), tensor in any::<u32>(),
        ) {
            let key = RoundingKey { seed, step, tensor };
            let expected = stochastic_round_bf16_reference(&src, key);
            let mut dst = vec![bf16::ZERO; src.len()];
            stochastic_round_bf16(&src, &mut dst, key);
            for (i, (a, b)) in dst.iter().zip(&expected).enumerate() {
                prop_assert_eq!(a.to_bits(), b.to_bits(), "index {}", i);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Unbiased: the mean of N roundings (independent steps) is within 6σ of the value,
        /// σ = (hi − lo)·√(p(1−p)/N). A value that is exactly representable must never move.
        #[test]
        fn mean_of_many_roundings_is_the_value(
            bits in any::<u32>(), exponent in 100u32..160, seed in any::<u64>(),
        ) {
            // A normal value with random mantissa (low 16 bits included) and sign.
            let x = f32::from_bits((bits & 0x807f_ffff) | (exponent << 23));
            let (lo, hi) = neighbours(x);
            let (lo_v, hi_v) = (bf16::from_bits(lo).to_f32() as f64, bf16::from_bits(hi).to_f32() as f64);
            const N: u64 = 4096;
            let mut sum = 0f64;
            for step in 0..N {
                let key = RoundingKey { seed, step, tensor: 0 };
                let out = stochastic_round_bf16_bits(x, u32::from(random_bits(key, 17)));
                prop_assert!(out == lo || out == hi);
                sum += bf16::from_bits(out).to_f32() as f64;
            }
            let mean = sum / N as f64;
            let gap = (hi_v - lo_v).abs();
            let p = if gap == 0.0 { 0.0 } else { ((x as f64) - lo_v).abs() / gap };
            let sigma = gap * (p * (1.0 - p) / N as f64).sqrt();
            prop_assert!(
                (mean - x as f64).abs() <= 6.0 * sigma + gap * 1e-9,
                "x={x:e} mean={mean:e} sigma={sigma:e}"
            );

            // The same over a tensor: N copies of x rounded in one call (one key, N indices).
            let src = vec![x; N as usize];
            let mut dst = vec![bf16::ZERO; src.len()];
            stochastic_round_bf16(&src, &mut dst, RoundingKey { seed, step: 0, tensor: 9 });
            let tensor_mean = dst.iter().map(|v| v.to_f32() as f64).sum::<f64>() / N as f64;
            prop_assert!(
                (tensor_mean - x as f64).abs() <= 6.0 * sigma + gap * 1e-9,
                "x={x:e} tensor mean={tensor_mean:e} sigma={sigma:e}"
            );
        }
    }
}
