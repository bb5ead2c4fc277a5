//! Counter-based random numbers: every value is a pure function of (seed, what, index), so
//! initialisation and dropout masks are reproducible without carrying generator state, and
//! the backward regenerates exactly the forward's dropout mask.

/// SplitMix64's finaliser: a bijective 64-bit mix.
pub(crate) const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;
/// Domain tags so initialisation and dropout never draw the same numbers.
pub(crate) const DOMAIN_INIT: u64 = 0x4c6f_5241_2d69_6e69;
pub(crate) const DOMAIN_DROPOUT: u64 = 0x4c6f_5241_2d64_726f;

/// FNV-1a of a module name: a stable 64-bit id (unlike `std`'s hasher, fixed across builds).
pub(crate) fn name_hash(name: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A stream key from its parts.
pub(crate) fn key(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0u64, |k, &p| mix64(k ^ mix64(p.wrapping_add(GOLDEN))))
}

/// The 64 random bits at `index` of stream `key`.
#[inline]
pub(crate) fn bits(key: u64, index: u64) -> u64 {
    mix64(key ^ index.wrapping_mul(GOLDEN))
}

/// A uniform f32 in `[0, 1)` (24 random bits, so every value is exact).
#[inline]
pub(crate) fn unit(key: u64, index: u64) -> f32 {
    (bits(key, index) >> 40) as f32 * (1.0 / 16_777_216.0)
}
