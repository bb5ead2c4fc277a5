//! A synthetic token source with a known entropy rate: a random sparse Markov chain.
//!
//! A model trained on its output cannot beat the chain's entropy rate in expected
//! cross-entropy per token, so the rate is the loss floor of a training run on it — a fresh
//! machine can train with no download and check that the loss approaches a known number.

use std::path::Path;

use crate::dataset::TokenDataset;
use crate::formats::{write_tokens, TokenFileFormat};
use crate::rng::{derive_seed, Xoshiro256};
use crate::tokens::TokenType;
use crate::{DataError, Result};

/// A first-order Markov chain over `0..vocab` where each token has `branching` possible
/// successors with random probabilities.
///
/// Every row includes the successor `(i + 1) mod vocab`, so the chain is irreducible and has
/// one stationary distribution π; the entropy rate is `Σ_i π_i · H(row i)` in nats per token.
#[derive(Clone, Debug)]
pub struct MarkovChain {
    vocab: u32,
    branching: u32,
    successors: Vec<u32>,
    probabilities: Vec<f64>,
    cumulative: Vec<f64>,
    stationary: Vec<f64>,
    entropy_rate: f64,
}

impl MarkovChain {
    /// A chain over `vocab` tokens (≥ 2) with `branching` successors per token
    /// (`2..=vocab`), all drawn from `seed`.
    pub fn random(vocab: u32, branching: u32, seed: u64) -> Result<Self> {
        if vocab < 2 || branching < 2 || branching > vocab {
            return Err(DataError::InvalidConfig(format!(
                "Markov chain needs vocab >= 2 and 2 <= branching <= vocab, got vocab {vocab}, branching {branching}"
            )));
        }
        let (v, k) = (vocab as usize, branching as usize);
        let mut rng =
            Xoshiro256::seed_from_u64(derive_seed(&[seed, u64::from(vocab), u64::from(branching)]));
        let mut successors = Vec::with_capacity(v * k);
        let mut probabilities = Vec::with_capacity(v * k);
        let mut row = Vec::with_capacity(k);
        for i in 0..vocab {
            row.clear();
            row.push((i + 1) % vocab);
            while row.len() < k {
                let s = rng.below(u64::from(vocab)) as u32;
                if !row.contains(&s) {
                    row.push(s);
                }
            }
            // Exponential weights normalised: a Dirichlet(1, …, 1) row.
            let weights: Vec<f64> = (0..k)
                .map(|_| -(1.0 - rng.next_f64()).ln() + 1e-12)
                .collect();
            let total: f64 = weights.iter().sum();
            successors.extend_from_slice(&row);
            probabilities.extend(weights.iter().map(|w| w / total));
        }
        let mut cumulative = Vec::with_capacity(v * k);
        for r in probabilities.chunks_exact(k) {
            let mut acc = 0.0;
            for &p in r {
                acc += p;
                cumulative.push(acc);
            }
            // Exactly 1 at the end so a uniform draw in [0, 1) always lands in the row.
            if let Some(last) = cumulative.last_mut() {
                *last = 1.0;
            }
        }
        let stationary = stationary_distribution(v, k, &successors, &probabilities)?;
        let entropy_rate = probabilities
            .chunks_exact(k)
            .zip(&stationary)
            .map(|(r, &pi)| {
                pi * r
                    .iter()
                    .filter(|&&p| p > 0.0)
                    .map(|&p| -p * p.ln())
                    .sum::<f64>()
            })
            .sum();
        Ok(MarkovChain {
            vocab,
            branching,
            successors,
            probabilities,
            cumulative,
            stationary,
            entropy_rate,
        })
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> u32 {
        self.vocab
    }

    /// Successors per token.
    pub fn branching(&self) -> u32 {
        self.branching
    }

    /// Entropy rate in nats per token: the expected cross-entropy loss floor.
    pub fn entropy_rate(&self) -> f64 {
        self.entropy_rate
    }

    /// Entropy rate in bits per token.
    pub fn entropy_rate_bits(&self) -> f64 {
        self.entropy_rate / std::f64::consts::LN_2
    }

    /// The stationary distribution π.
    pub fn stationary(&self) -> &[f64] {
        &self.stationary
    }

    /// `P(next = to | current = from)`; 0 for impossible transitions or ids out of range.
    pub fn probability(&self, from: u32, to: u32) -> f64 {
        let k = self.branching as usize;
        let Some(row) = (from as usize).checked_mul(k) else {
            return 0.0;
        };
        let succ = self.successors.get(row..row + k).unwrap_or(&[]);
        let prob = self.probabilities.get(row..row + k).unwrap_or(&[]);
        succ.iter()
            .zip(prob)
            .filter(|(&s, _)| s == to)
            .map(|(_, &p)| p)
            .sum()
    }

    /// `n` tokens of the chain, starting from a draw of π; deterministic in `seed`.
    pub fn generate(&self, n: usize, seed: u64) -> Vec<u32> {
        let mut out = vec![0u32; n];
        self.stream(seed).fill(&mut out);
        out
    }

    /// The token stream of `seed` as a resumable generator: filling buffers one after
    /// another yields exactly [`MarkovChain::generate`]'s tokens, in bounded memory.
    pub fn stream(&self, seed: u64) -> MarkovStream<'_> {
        MarkovStream {
            chain: self,
            rng: Xoshiro256::seed_from_u64(derive_seed(&[seed, 0x6E4E_7A7E])),
            state: None,
        }
    }

    /// A state drawn from π with one uniform `u` in `[0, 1)`.
    fn stationary_draw(&self, u: f64) -> u32 {
        let mut acc = 0.0;
        for (i, &p) in self.stationary.iter().enumerate() {
            acc += p;
            if u < acc {
                return i as u32;
            }
        }
        // Round-off can leave Σπ a hair below 1.
        self.vocab - 1
    }

    /// The successor of `state` picked by one uniform `u` in `[0, 1)`.
    fn step(&self, state: u32, u: f64) -> u32 {
        let k = self.branching as usize;
        let row = state as usize * k;
        let cum = self.cumulative.get(row..row + k).unwrap_or(&[]);
        let j = cum.iter().position(|&c| u < c).unwrap_or(k - 1);
        self.successors.get(row + j).copied().unwrap_or(0)
    }

    /// The smallest token type that holds this vocabulary.
    pub fn token_type(&self) -> TokenType {
        if self.vocab <= 1 << 16 {
            TokenType::U16
        } else {
            TokenType::U32
        }
    }

    /// `n` generated tokens as an in-memory dataset whose vocabulary bound is the chain's.
    pub fn dataset(&self, n: usize, seed: u64) -> Result<TokenDataset> {
        Ok(
            TokenDataset::from_tokens(&self.generate(n, seed), self.token_type())?
                .with_vocab_size(self.vocab),
        )
    }

    /// Write `n` generated tokens to `path` in `format`.
    pub fn write(
        &self,
        path: impl AsRef<Path>,
        n: usize,
        seed: u64,
        format: TokenFileFormat,
    ) -> Result<()> {
        write_tokens(path, &self.generate(n, seed), format)
    }
}

/// A [`MarkovChain`]'s token stream in progress (see [`MarkovChain::stream`]).
#[derive(Clone, Debug)]
pub struct MarkovStream<'a> {
    chain: &'a MarkovChain,
    rng: Xoshiro256,
    /// The last token handed out; `None` before the first (which is drawn from π).
    state: Option<u32>,
}

impl MarkovStream<'_> {
    /// Overwrite `out` with the next `out.len()` tokens of the stream.
    pub fn fill(&mut self, out: &mut [u32]) {
        for slot in out {
            let u = self.rng.next_f64();
            let next = match self.state {
                None => self.chain.stationary_draw(u),
                Some(s) => self.chain.step(s, u),
            };
            self.state = Some(next);
            *slot = next;
        }
    }
}

/// π of the chain, by power iteration on the lazy chain (P + I)/2, which has the same π and
/// converges even where P is periodic. Iterates to f64 round-off.
fn stationary_distribution(
    v: usize,
    k: usize,
    successors: &[u32],
    probabilities: &[f64],
) -> Result<Vec<f64>> {
    let mut pi = vec![1.0 / v as f64; v];
    let mut next = vec![0.0; v];
    for _ in 0..1_000_000 {
        next.iter_mut().for_each(|x| *x = 0.0);
        for ((row_s, row_p), &mass) in successors
            .chunks_exact(k)
            .zip(probabilities.chunks_exact(k))
            .zip(&pi)
        {
            for (&s, &p) in row_s.iter().zip(row_p) {
                if let Some(slot) = next.get_mut(s as usize) {
                    *slot += mass * p;
                }
            }
        }
        let mut diff = 0.0;
        let mut total = 0.0;
        for (x, &y) in pi.iter_mut().zip(&next) {
            let lazy = 0.5 * (*x + y);
            diff += (lazy - *x).abs();
            *x = lazy;
            total += lazy;
        }
        pi.iter_mut().for_each(|x| *x /= total);
        if diff < 1e-15 {
            return Ok(pi);
        }
    }
    Err(DataError::InvalidConfig(
        "stationary distribution did not converge (chain mixes too slowly)".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-shot generator as it was first written (one loop, one uniform per token):
    /// the plain reference the chunked stream must reproduce bit for bit, so data written
    /// by earlier versions (and the trainer's default stream) is unchanged.
    fn reference_generate(chain: &MarkovChain, n: usize, seed: u64) -> Vec<u32> {
        let mut rng = Xoshiro256::seed_from_u64(derive_seed(&[seed, 0x6E4E_7A7E]));
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return out;
        }
        let u = rng.next_f64();
        let mut acc = 0.0;
        let mut state = chain.vocab - 1;
        for (i, &p) in chain.stationary.iter().enumerate() {
            acc += p;
            if u < acc {
                state = i as u32;
                break;
            }
        }
        out.push(state);
        let k = chain.branching as usize;
        for _ in 1..n {
            let row = state as usize * k;
            let u = rng.next_f64();
            let cum = &chain.cumulative[row..row + k];
            let j = cum.iter().position(|&c| u < c).unwrap_or(k - 1);
            state = chain.successors[row + j];
            out.push(state);
        }
        out
    }

    #[test]
    fn chunked_stream_equals_the_one_shot_reference() {
        for (vocab, k, seed) in [(2, 2, 0), (37, 3, 5), (1000, 8, 42)] {
            let chain = MarkovChain::random(vocab, k, seed).unwrap();
            let want = reference_generate(&chain, 5000, seed + 1);
            assert_eq!(chain.generate(5000, seed + 1), want);
            // Uneven chunk sizes, including empty ones.
            let mut stream = chain.stream(seed + 1);
            let mut got = Vec::new();
            for len in [0usize, 1, 7, 0, 1000, 3992] {
                let mut buf = vec![u32::MAX; len];
                stream.fill(&mut buf);
                got.extend(buf);
            }
            assert_eq!(got, want);
        }
        assert!(MarkovChain::random(5, 2, 0)
            .unwrap()
            .generate(0, 1)
            .is_empty());
    }
}
