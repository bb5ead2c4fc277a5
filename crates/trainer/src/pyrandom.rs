//! CPython's `random.Random`, as far as lm-evaluation-harness uses it to draw few-shot
//! examples: seeding with an integer, and `sample(population, k)`. The draws must be CPython's
//! exactly, or a question gets other examples than lm-eval gives it and the scores differ.
//!
//! ```
//! use headroom_trainer::pyrandom::PyRandom;
//! let mut a = PyRandom::new(1234);
//! let mut b = PyRandom::new(1234);
//! let drawn = a.sample(10, 3).unwrap();
//! assert_eq!(drawn, b.sample(10, 3).unwrap());
//! assert!(drawn.iter().all(|&i| i < 10));
//! assert!(a.sample(2, 3).is_none()); // more than the population
//! ```
//!
//! The generator is the Mersenne Twister MT19937 with CPython's `init_by_array` seeding (the
//! seed's absolute value as 32-bit words, least significant first). `getrandbits(k)` for
//! `k ≤ 32` is the next 32-bit output shifted right by `32 − k`; `_randbelow(n)` draws
//! `n.bit_length()` bits until the value is below `n`; `sample` picks from a shrinking pool
//! when the population is small against `k`, else redraws indices already taken, choosing
//! between the two by CPython's set-size rule. `tests/choices.rs` checks draws against
//! CPython's (`benches/torch/make_choices_fixture.py`).

const N: usize = 624;
const M: usize = 397;

/// CPython's `random.Random(seed)`.
#[derive(Clone)]
pub struct PyRandom {
    state: [u32; N],
    index: usize,
}

impl std::fmt::Debug for PyRandom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PyRandom {{ index: {} }}", self.index)
    }
}

impl PyRandom {
    /// `random.Random(seed)` for a non-negative integer seed (CPython seeds with its absolute
    /// value, so this covers negative seeds too).
    pub fn new(seed: u64) -> Self {
        let (low, high) = (seed as u32, (seed >> 32) as u32);
        let key: &[u32] = if high == 0 { &[low] } else { &[low, high] };
        let mut r = PyRandom {
            state: [0; N],
            index: N,
        };
        r.init_by_array(key);
        r
    }

    fn init_genrand(&mut self, seed: u32) {
        self.state[0] = seed;
        for i in 1..N {
            let prev = self.state[i - 1];
            self.state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        self.index = N;
    }

    fn init_by_array(&mut self, key: &[u32]) {
        self.init_genrand(19_650_218);
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..N.max(key.len()) {
            let prev = self.state[i - 1];
            self.state[i] = (self.state[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                self.state[0] = self.state[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let prev = self.state[i - 1];
            self.state[i] = (self.state[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1_566_083_941))
                .wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                self.state[0] = self.state[N - 1];
                i = 1;
            }
        }
        self.state[0] = 0x8000_0000;
    }

    /// The next 32-bit output (`genrand_uint32`).
    pub fn next_u32(&mut self) -> u32 {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        const MATRIX_A: u32 = 0x9908_b0df;
        if self.index >= N {
            for k in 0..N {
                let y = (self.state[k] & UPPER) | (self.state[(k + 1) % N] & LOWER);
                let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
                self.state[k] = self.state[(k + M) % N] ^ (y >> 1) ^ mag;
            }
            self.index = 0;
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `getrandbits(k)` for `k ≤ 32`.
    fn getrandbits(&mut self, k: u32) -> u32 {
        match k {
            0 => 0,
            k => self.next_u32() >> (32 - k.min(32)),
        }
    }

    /// `_randbelow(n)`: uniform in `0..n` for `1 ≤ n ≤ 2³²`, by rejection on
    /// `n.bit_length()` bits.
    fn randbelow(&mut self, n: u64) -> u64 {
        let bits = 64 - n.leading_zeros();
        loop {
            let r = u64::from(self.getrandbits(bits));
            if r < n {
                return r;
            }
        }
    }

    /// `random()`: a float in `[0, 1)` of 53 random bits from two outputs (`genrand_res53`).
    pub fn random(&mut self) -> f64 {
        let a = self.next_u32() >> 5;
        let b = self.next_u32() >> 6;
        (f64::from(a) * 67_108_864.0 + f64::from(b)) * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `choices(range(n), k=k)` without weights: `k` indices below `n` drawn with
    /// replacement, each `floor(random() · n)`. Empty when `n` is 0.
    pub fn choices(&mut self, n: usize, k: usize) -> Vec<usize> {
        if n == 0 {
            return Vec::new();
        }
        let scale = n as f64;
        (0..k)
            .map(|_| ((self.random() * scale).floor() as usize).min(n - 1))
            .collect()
    }

    /// `sample(range(n), k)`: `k` distinct indices below `n`, in CPython's order; `None` when
    /// `k > n` (CPython's `ValueError`) or `n` is past 2³² (never a question file's size).
    pub fn sample(&mut self, n: usize, k: usize) -> Option<Vec<usize>> {
        if k > n || n as u64 > 1 << 32 {
            return None;
        }
        // CPython: a list of n is cheaper than a set of k below this size.
        let mut set_size = 21usize;
        if k > 5 {
            let exponent = ((k * 3) as f64).ln() / 4f64.ln();
            set_size = set_size.saturating_add(4usize.saturating_pow(exponent.ceil() as u32));
        }
        let mut out = Vec::with_capacity(k);
        if n <= set_size {
            let mut pool: Vec<usize> = (0..n).collect();
            for i in 0..k {
                let j = self.randbelow((n - i) as u64) as usize;
                out.push(pool[j]);
                pool[j] = pool[n - i - 1];
            }
        } else {
            let mut taken = std::collections::HashSet::with_capacity(k);
            for _ in 0..k {
                let mut j = self.randbelow(n as u64) as usize;
                while !taken.insert(j) {
                    j = self.randbelow(n as u64) as usize;
                }
                out.push(j);
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_the_reference_mt19937() {
        // The reference implementation's published check (mt19937ar.c, init_by_array with
        // {0x123, 0x234, 0x345, 0x456}): its first outputs.
        let mut r = PyRandom {
            state: [0; N],
            index: N,
        };
        r.init_by_array(&[0x123, 0x234, 0x345, 0x456]);
        let first: Vec<u32> = (0..5).map(|_| r.next_u32()).collect();
        assert_eq!(
            first,
            [
                1_067_595_299,
                955_945_823,
                477_289_528,
                4_107_218_783,
                4_228_976_476
            ]
        );
    }

    proptest::proptest! {
        #[test]
        fn samples_are_distinct_indices_below_n(seed in 0u64..u64::MAX, n in 0usize..200, k in 0usize..40) {
            let mut r = PyRandom::new(seed);
            match r.sample(n, k) {
                None => proptest::prop_assert!(k > n),
                Some(s) => {
                    proptest::prop_assert_eq!(s.len(), k);
                    let mut sorted = s.clone();
                    sorted.sort_unstable();
                    sorted.dedup();
                    proptest::prop_assert_eq!(sorted.len(), k);
                    proptest::prop_assert!(s.iter().all(|&i| i < n));
                }
            }
        }
    }
}
