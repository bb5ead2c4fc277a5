//! A tiny deterministic random number generator (SplitMix64), so a campaign is a pure function
//! of its seed and no random-number crate is needed.

/// Weyl-sequence increment of SplitMix64 (the odd integer nearest 2⁶⁴/φ).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 output function: a bijection on `u64` with full avalanche.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash a name into a 64-bit value (FNV-1a, then [`mix64`]); used to give every campaign its
/// own stream for the same user seed.
pub fn hash_name(name: &str) -> u64 {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01B3);
    }
    mix64(h)
}

/// SplitMix64: one word of state, fast, good enough to drive mutations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// The generator of input number `iteration` of a campaign seeded with `campaign`: every
    /// input has its own independent stream, so any one input can be rebuilt from
    /// `(campaign, iteration)` without replaying the ones before it.
    pub fn for_iteration(campaign: u64, iteration: u64) -> Self {
        Rng::new(mix64(campaign ^ mix64(iteration.wrapping_add(GAMMA))))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix64(self.state)
    }

    /// A value in `0..n` (0 when `n` is 0). Uses the high half of a 128-bit product; the bias
    /// (at most n/2⁶⁴) does not matter for fuzzing.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// An index into a slice of `len` elements (0 when `len` is 0).
    pub fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    /// A value in `lo..=hi` (`lo` when `hi < lo`).
    pub fn range_inclusive(&mut self, lo: usize, hi: usize) -> usize {
        if hi <= lo {
            return lo;
        }
        lo + self.index(hi - lo + 1)
    }

    /// True with probability `numerator / denominator` (false when the denominator is 0).
    pub fn chance(&mut self, numerator: u64, denominator: u64) -> bool {
        denominator > 0 && self.below(denominator) < numerator
    }

    /// A uniformly chosen element, `None` for an empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        items.get(self.index(items.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_deterministic_and_distinct() {
        let a: Vec<u64> = (0..4).map(|_| Rng::new(1).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut r = Rng::for_iteration(7, 0);
        let mut s = Rng::for_iteration(7, 1);
        assert_ne!(r.next_u64(), s.next_u64());
        assert_eq!(
            Rng::for_iteration(7, 1).next_u64(),
            Rng::for_iteration(7, 1).next_u64()
        );
        assert_ne!(hash_name("a"), hash_name("b"));
    }

    #[test]
    fn bounded_draws_stay_in_range_and_cover_it() {
        let mut r = Rng::new(3);
        let mut seen = [false; 7];
        for _ in 0..1000 {
            let v = r.below(7);
            assert!(v < 7);
            seen[v as usize] = true;
            let w = r.range_inclusive(3, 5);
            assert!((3..=5).contains(&w));
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(r.below(0), 0);
        assert_eq!(r.range_inclusive(4, 2), 4);
        assert!(!r.chance(1, 0));
        assert!(r.pick::<u8>(&[]).is_none());
    }
}
