//! A seeded pseudo-random permutation of `0..n` computed index by index.
//!
//! Shuffling an epoch by materialising and Fisher–Yates-shuffling a window list costs 8 bytes
//! per window and a pass per epoch; a Feistel network with cycle walking gives a bijection on
//! `0..n` in O(1) memory and O(1) expected time per index, so a sampler's whole state is
//! `(seed, position)` and any position can be recomputed after a resume.

use crate::rng::mix64;

/// Rounds of the Feistel network. Six is well past what mixing quality needs for shuffling.
const ROUNDS: usize = 6;

/// A bijection on `0..n`, fixed by `(n, key)`.
#[derive(Clone, Debug)]
pub struct FeistelPermutation {
    n: u64,
    half_bits: u32,
    keys: [u64; ROUNDS],
}

impl FeistelPermutation {
    /// The permutation of `0..n` selected by `key`.
    pub fn new(n: u64, key: u64) -> Self {
        // Smallest even bit count 2h with 2^(2h) >= n: the walk visits < 4 values on average.
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let mut keys = [0u64; ROUNDS];
        for (i, k) in keys.iter_mut().enumerate() {
            *k = mix64(key ^ mix64(i as u64 + 1));
        }
        FeistelPermutation { n, half_bits, keys }
    }

    /// Size of the domain.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// True for the empty permutation.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The image of `index` (which must be `< n`; larger values are reduced modulo `n`).
    pub fn apply(&self, index: u64) -> u64 {
        if self.n <= 1 {
            return 0;
        }
        // Cycle walking: the network permutes 0..2^(2h); iterating from a point < n until the
        // orbit re-enters 0..n restricts it to a bijection on 0..n.
        let mut x = index % self.n;
        loop {
            x = self.encrypt(x);
            if x < self.n {
                return x;
            }
        }
    }

    fn encrypt(&self, x: u64) -> u64 {
        let h = self.half_bits;
        let mask = if h >= 64 { u64::MAX } else { (1u64 << h) - 1 };
        let mut left = (x >> h) & mask;
        let mut right = x & mask;
        for &k in &self.keys {
            let f = mix64(right ^ k) & mask;
            let new_right = left ^ f;
            left = right;
            right = new_right;
        }
        (left << h) | right
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn is_a_bijection(n in 0u64..3000, key in any::<u64>()) {
            let p = FeistelPermutation::new(n, key);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = p.apply(i);
                prop_assert!(j < n);
                prop_assert!(!seen[j as usize], "{j} hit twice");
                seen[j as usize] = true;
            }
        }
    }

    #[test]
    fn different_keys_give_different_orders() {
        let a: Vec<u64> = (0..100)
            .map(|i| FeistelPermutation::new(100, 1).apply(i))
            .collect();
        let b: Vec<u64> = (0..100)
            .map(|i| FeistelPermutation::new(100, 2).apply(i))
            .collect();
        assert_ne!(a, b);
        let identity: Vec<u64> = (0..100).collect();
        assert_ne!(a, identity);
    }
}
