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
    /// The most blocks a config may have (GPT-3 175B has 96).
    pub const MAX_LAYERS: usize = 4096;
    /// The widest model (GPT-3 175B is 12288 wide).
    pub const MAX_CHANNELS: usize = 1 << 17;
    /// The longest context.
    pub const MAX_CONTEXT: usize = 1 << 24;
    /// The most parameters (2⁴⁰, 4 TiB of f32 masters): anything larger is a typo or a hostile
    /// file, and would overflow the byte sizes derived from it.
    pub const MAX_PARAMETERS: u64 = 1 << 40;

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

    /// Parameter tensors: `wte`, `wpe`, 12 per block, `ln_f`'s two.
    pub fn tensor_count(&self) -> Result<usize> {
        self.layers
            .checked_mul(crate::model::params::PER_LAYER)
            .and_then(|n| n.checked_add(4))
            .ok_or_else(|| TrainError::Config(format!("{} layers overflow", self.layers)))
    }

    /// Parameters, `V·C + T·C + L·(12C² + 13C) + 2C`, every product checked.
    pub fn parameter_count(&self) -> Result<u64> {
        let (v, t, l, c) = (
            self.vocab as u64,
            self.max_seq as u64,
            self.layers as u64,
            self.channels as u64,
        );
        let per_layer = c
            .checked_mul(c)
            .and_then(|c2| c2.checked_mul(12))
            .and_then(|x| x.checked_add(c.checked_mul(13)?));
        v.checked_add(t)
            .and_then(|vt| vt.checked_mul(c))
            .and_then(|e| e.checked_add(l.checked_mul(per_layer?)?))
            .and_then(|x| x.checked_add(c.checked_mul(2)?))
            .ok_or_else(|| {
                TrainError::Config(format!("the parameter count of {self:?} overflows 64 bits"))
            })
    }

    /// Check that the shapes are consistent and within [`GptConfig::MAX_PARAMETERS`] and the
    /// per-dimension limits, with every size product checked (so a config read from a file
    /// can be trusted to size allocations).
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
        for (name, value, max) in [
            ("layers", self.layers, Self::MAX_LAYERS),
            ("channels", self.channels, Self::MAX_CHANNELS),
            ("max_seq (context)", self.max_seq, Self::MAX_CONTEXT),
        ] {
            if value > max {
                return bad(format!("{name} {value} exceeds the supported {max}"));
            }
        }
        let n = self.parameter_count()?;
        if n > Self::MAX_PARAMETERS {
            return bad(format!(
                "{n} parameters exceed the supported {} ({self:?})",
                Self::MAX_PARAMETERS
            ));
        }
        Ok(())
    }
}
