//! [`LoraConfig`]: rank, scaling, dropout, which modules get an adapter.

use serde::{Deserialize, Serialize};

use crate::error::{LoraError, Result};

/// The largest rank accepted (from a caller or a file): far beyond any practical LoRA, small
/// enough that `r × features` stays a sane allocation.
pub const MAX_RANK: usize = 1 << 16;

/// A LoRA configuration, with PEFT's meaning for every field of the same name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Rank `r` of the update `B·A` (A is `[r, in]`, B `[out, r]`).
    pub r: usize,
    /// `lora_alpha`: the update is scaled by `alpha / r` (or `alpha / √r` with rsLoRA).
    pub alpha: f32,
    /// rsLoRA (Kalajdzievski 2023): scale by `alpha / √r`, so the update's size does not
    /// shrink as the rank grows.
    pub use_rslora: bool,
    /// Dropout probability on the adapter's input, in `[0, 1)`; the base sees the input
    /// unchanged.
    pub dropout: f32,
    /// Module names (or name suffixes) that get an adapter; see [`LoraConfig::matches`].
    pub target_modules: Vec<String>,
    /// Module names (or suffixes) excluded even when a target matches (PEFT's
    /// `exclude_modules` as a list).
    pub exclude_modules: Vec<String>,
    /// PEFT's `fan_in_fan_out`: the Python base stores its weight as `[in, out]` (GPT-2's
    /// `Conv1D`). The LoRA tensors have the same shapes either way (A `[r, in]`, B
    /// `[out, r]`); the flag only tells a merge which layout the base weight has (see
    /// [`WeightLayout`](crate::WeightLayout)). Saved so PEFT merges into `Conv1D` correctly.
    pub fan_in_fan_out: bool,
    /// Seed of A's initialisation and of the dropout masks.
    pub seed: u64,
    /// PEFT's `task_type` (`"CAUSAL_LM"`), written to and read from `adapter_config.json`.
    pub task_type: Option<String>,
    /// PEFT's `base_model_name_or_path`.
    pub base_model_name_or_path: Option<String>,
}

impl LoraConfig {
    /// Rank `r`, `alpha`, the target module names; no dropout, no rsLoRA, seed 0, task
    /// `CAUSAL_LM`.
    pub fn new(
        r: usize,
        alpha: f32,
        target_modules: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        LoraConfig {
            r,
            alpha,
            use_rslora: false,
            dropout: 0.0,
            target_modules: target_modules.into_iter().map(Into::into).collect(),
            exclude_modules: Vec::new(),
            fan_in_fan_out: false,
            seed: 0,
            task_type: Some("CAUSAL_LM".to_owned()),
            base_model_name_or_path: None,
        }
    }

    /// Check every field's range: `1 ≤ r ≤` [`MAX_RANK`], finite `alpha`, `0 ≤ dropout < 1`, at
    /// least one non-empty target.
    pub fn validate(&self) -> Result<()> {
        if self.r == 0 || self.r > MAX_RANK {
            return Err(LoraError::InvalidConfig(format!(
                "r = {} (must be 1..={MAX_RANK})",
                self.r
            )));
        }
        if !self.alpha.is_finite() {
            return Err(LoraError::InvalidConfig(format!(
                "lora_alpha = {} (must be finite)",
                self.alpha
            )));
        }
        // `!(p < 1)` also refuses NaN. p = 1 would make the kept inputs' scale 1/(1-p) infinite.
        if !(self.dropout >= 0.0 && self.dropout < 1.0) {
            return Err(LoraError::InvalidConfig(format!(
                "lora_dropout = {} (must be in [0, 1))",
                self.dropout
            )));
        }
        if self.target_modules.is_empty() || self.target_modules.iter().any(String::is_empty) {
            return Err(LoraError::InvalidConfig(format!(
                "target_modules = {:?} (needs at least one non-empty name)",
                self.target_modules
            )));
        }
        Ok(())
    }

    /// The factor the update `B·A·x` is multiplied by: `alpha / r`, or `alpha / √r` with
    /// rsLoRA (computed in f64 and rounded once, as Python computes it before torch sees it).
    pub fn scaling(&self) -> f32 {
        scaling(self.alpha, self.r, self.use_rslora)
    }

    /// Whether `module` gets an adapter, by PEFT's rule for a list of targets: the name equals
    /// a target or ends with `"." + target` (so `"q_proj"` selects
    /// `model.layers.0.self_attn.q_proj` but not `model.layers.0.self_attn.xq_proj`), and no
    /// entry of `exclude_modules` selects it by the same rule. Names are never interpreted as
    /// regular expressions.
    pub fn matches(&self, module: &str) -> bool {
        let hit = |list: &[String]| list.iter().any(|t| name_selects(t, module));
        hit(&self.target_modules) && !hit(&self.exclude_modules)
    }
}

/// PEFT's suffix rule for one target.
fn name_selects(target: &str, module: &str) -> bool {
    module == target
        || (module.len() > target.len()
            && module.ends_with(target)
            && module.as_bytes()[module.len() - target.len() - 1] == b'.')
}

/// `alpha / r` or `alpha / √r` (f64, rounded once to f32).
pub(crate) fn scaling(alpha: f32, r: usize, rslora: bool) -> f32 {
    let r = r as f64;
    let d = if rslora { r.sqrt() } else { r };
    (f64::from(alpha) / d) as f32
}
