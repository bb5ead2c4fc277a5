//! GPT-2 shaped model configurations.

use serde::{Deserialize, Serialize};

use crate::{Result, TrainError};

/// The shape of a GPT-2 style model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence (rows of the position embedding).
    pub max_seq: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads per block.
    pub heads: usize,
    /// Model width.
    pub channels: usize,
}

impl GptConfig {
    /// For tests and the default run: trains in seconds on 2 cores.
    pub fn tiny(vocab: usize) -> Self {
        GptConfig {
            vocab,
            max_seq: 64,
            layers: 2,
            heads: 2,
            channels: 64,
        }
    }

    /// The size used for comparisons: 6 layers, 6 heads, width 384, context 256.
    pub fn small(vocab: usize) -> Self {
        GptConfig {
            vocab,
            max_seq: 256,
            layers: 6,
            heads: 6,
            channels: 384,
        }
    }

    /// GPT-2 124M.
    pub fn gpt2() -> Self {
        GptConfig {
            vocab: 50257,
            max_seq: 1024,
            layers: 12,
            heads: 12,
            channels: 768,
        }
    }

    /// Head dimension.
    pub fn head_dim(&self) -> usize {
        self.channels / self.heads.max(1)
    }

    /// Check that the shapes are consistent.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TrainError::Config(m));
        if self.vocab == 0
            || self.max_seq == 0
            || self.layers == 0
            || self.heads == 0
            || self.channels == 0
        {
            return bad(format!("every dimension must be positive: {self:?}"));
        }
        if self.channels % self.heads != 0 {
            return bad(format!(
                "channels {} not divisible by heads {}",
                self.channels, self.heads
            ));
        }
        if self.vocab > u32::MAX as usize {
            return bad(format!("vocab {} does not fit token ids (u32)", self.vocab));
        }
        Ok(())
    }
}
