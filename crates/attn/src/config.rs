//! Which algorithm runs and how: [`Algorithm`] and [`AttentionConfig`].

use crate::{AttnError, Result};

/// The largest head dimension the kernels accept (FlashAttention's limit as well).
pub const MAX_HEAD_DIM: usize = 256;

/// Query chunk size of [`AttentionConfig::chunked`] when none is given.
pub const DEFAULT_CHUNK_SIZE: usize = 128;
/// Query tile rows of [`AttentionConfig::flash`].
pub const DEFAULT_FLASH_BLOCK_Q: usize = 128;
/// Key tile rows of [`AttentionConfig::flash`].
pub const DEFAULT_FLASH_BLOCK_K: usize = 128;

/// How attention is computed. All three give the same result up to rounding; they differ in
/// the extra memory they need for a sequence of `N` queries and keys per head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// Materialise the `[batch, heads, N, N]` score matrix, softmax it, multiply by `V`; keep
    /// the probabilities for backward. The reference, and the memory baseline: O(N²).
    Naive,
    /// Process `chunk_size` query rows at a time against all keys, with an exact two-pass
    /// softmax per chunk. Extra memory O(N·chunk_size) per running thread; only the per-row
    /// logsumexp is kept for backward.
    Chunked {
        /// Query rows per chunk (≥ 1).
        chunk_size: usize,
    },
    /// FlashAttention-2: tiles of `block_q` queries × `block_k` keys, online softmax with an
    /// unnormalised accumulator and one final division, per-row logsumexp saved. Backward
    /// recomputes the probabilities tile by tile from the logsumexp. Extra memory O(N).
    Flash {
        /// Query rows per tile (≥ 1).
        block_q: usize,
        /// Key rows per tile (≥ 1).
        block_k: usize,
    },
}

impl Algorithm {
    /// A short lowercase name for reports (`"naive"`, `"chunked"`, `"flash"`).
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Naive => "naive",
            Algorithm::Chunked { .. } => "chunked",
            Algorithm::Flash { .. } => "flash",
        }
    }
}

/// Everything that selects what attention computes and how.
///
/// Causal masking is aligned to the bottom-right corner, as in FlashAttention ≥ 2.1: query row
/// `i` of `q_len` sees key `j` of `kv_len` when `j ≤ i + kv_len − q_len`. With equal lengths
/// this is the usual lower triangle; with more queries than keys the first `q_len − kv_len`
/// rows see no key at all, and their output (and gradient) is zero rather than NaN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionConfig {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Mask keys after the query's position.
    pub causal: bool,
    /// Multiplier of `Q·Kᵀ` before the softmax; `None` means `1/√head_dim`.
    pub softmax_scale: Option<f32>,
    /// How many query segments the backward pass of chunked and flash attention splits each
    /// `(batch, head)` into. Each segment accumulates its own `dK`/`dV` partial (extra memory
    /// up to `segments × kv_len × head_dim` f32 per head for each of the two, about half that
    /// when causal, since a segment's partial stops at the last key it sees) that is summed in
    /// a fixed order, which is what keeps the gradients deterministic. With one segment and no
    /// GQA the gradients are written in place and no partial exists. `None` chooses from the shape alone (never from
    /// the thread count, so results are identical on every machine): enough segments for
    /// about 8 parallel tasks.
    pub backward_segments: Option<usize>,
}

impl AttentionConfig {
    /// Naive attention, non-causal, default scale.
    pub const fn naive() -> Self {
        Self::with_algorithm(Algorithm::Naive)
    }

    /// Chunked attention with [`DEFAULT_CHUNK_SIZE`] query rows per chunk.
    pub const fn chunked() -> Self {
        Self::with_algorithm(Algorithm::Chunked {
            chunk_size: DEFAULT_CHUNK_SIZE,
        })
    }

    /// Flash attention with the default tile sizes.
    pub const fn flash() -> Self {
        Self::with_algorithm(Algorithm::Flash {
            block_q: DEFAULT_FLASH_BLOCK_Q,
            block_k: DEFAULT_FLASH_BLOCK_K,
        })
    }

    /// A non-causal config with the default scale running `algorithm`.
    pub const fn with_algorithm(algorithm: Algorithm) -> Self {
        AttentionConfig {
            algorithm,
            causal: false,
            softmax_scale: None,
            backward_segments: None,
        }
    }

    /// The same config, causal or not.
    pub const fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// The same config with an explicit softmax scale.
    pub const fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = Some(scale);
        self
    }

    /// The same config with an explicit number of backward query segments per head.
    pub const fn backward_segments(mut self, segments: usize) -> Self {
        self.backward_segments = Some(segments);
        self
    }

    /// The scale actually applied for `head_dim`.
    pub fn scale_for(&self, head_dim: usize) -> f32 {
        self.softmax_scale
            .unwrap_or_else(|| 1.0 / (head_dim.max(1) as f32).sqrt())
    }

    /// Reject zero tile sizes, zero segments and non-finite scales.
    pub fn validate(&self) -> Result<()> {
        match self.algorithm {
            Algorithm::Naive => {}
            Algorithm::Chunked { chunk_size } => {
                if chunk_size == 0 {
                    return Err(AttnError::InvalidConfig("chunk_size must be at least 1"));
                }
            }
            Algorithm::Flash { block_q, block_k } => {
                if block_q == 0 || block_k == 0 {
                    return Err(AttnError::InvalidConfig(
                        "flash block_q and block_k must be at least 1",
                    ));
                }
            }
        }
        if let Some(s) = self.softmax_scale {
            if !s.is_finite() {
                return Err(AttnError::InvalidConfig("softmax_scale must be finite"));
            }
        }
        if self.backward_segments == Some(0) {
            return Err(AttnError::InvalidConfig(
                "backward_segments must be at least 1",
            ));
        }
        Ok(())
    }
}

impl Default for AttentionConfig {
    /// Flash attention, non-causal, default scale.
    fn default() -> Self {
        Self::flash()
    }
}
