//! Rotary position embeddings in Hugging Face's rotate-half layout: in a head of `hs`
//! dimensions, dimension `i < hs/2` and dimension `i + hs/2` form one pair, rotated by the
//! angle `t · inv_freq[i]` at position `t`, where `inv_freq[i] = θ^(−2i/hs)`, rescaled as
//! [`RopeScaling`] says (Llama 3.1 and later stretch the low frequencies).
//!
//! The angles follow transformers' `LlamaRotaryEmbedding` in f32 (inverse frequencies as
//! `1 / θ^(2i/hs)`, rescaled by `ROPE_INIT_FUNCTIONS`' f32 arithmetic, the angle as the f32
//! product `t · inv_freq`); cos and sin are evaluated in f64 and rounded, within an ulp of
//! torch's f32 ones.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// How the rotary frequencies are rescaled (Hugging Face's `rope_type`). Every kind here
/// keeps transformers' attention factor of 1, so only the frequencies change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeScaling {
    /// `default`: the frequencies as they are.
    #[default]
    None,
    /// `linear` (position interpolation): every frequency divided by `factor`.
    Linear {
        /// How many times longer the context is than the one trained with.
        factor: f32,
    },
    /// `llama3` (Llama 3.1, 3.2, 3.3): wavelengths longer than
    /// `original_max_position_embeddings / low_freq_factor` are stretched by `factor`, those
    /// shorter than `original_max_position_embeddings / high_freq_factor` are kept, and those
    /// between are blended linearly in `original / wavelength`.
    Llama3 {
        /// The stretch of the lowest frequencies (8 in Llama 3.1, 32 in 3.2).
        factor: f32,
        /// Below this many turns over the original context a frequency is stretched.
        low_freq_factor: f32,
        /// Above this many turns over the original context a frequency is kept.
        high_freq_factor: f32,
        /// The context the model was first trained with (8192 for Llama 3).
        original_max_position_embeddings: usize,
    },
    /// `yarn` (YaRN, as Qwen2.5's long-context settings add it): frequencies that turn fewer
    /// than `beta_slow` times over the original context are divided by `factor`, those that
    /// turn more than `beta_fast` times are kept, a linear ramp over the dimensions between;
    /// cos and sin are multiplied by `attention_factor`.
    Yarn {
        /// How many times longer the context is than the original.
        factor: f32,
        /// The context the model was first trained with.
        original_max_position_embeddings: usize,
        /// Rotations over the original context above which a frequency is kept (32).
        beta_fast: f64,
        /// Rotations over the original context below which a frequency is divided (1).
        beta_slow: f64,
        /// The factor on cos and sin: `0.1·ln(factor) + 1` unless the config names it
        /// (or its `mscale`s).
        attention_factor: f32,
        /// Whether the ramp's ends are rounded outwards to whole dimensions (transformers'
        /// default).
        truncate: bool,
    },
}

impl RopeScaling {
    /// Hugging Face's name of the kind (`rope_type`).
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::None => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }

    /// Why the parameters cannot be used, if they cannot: the bounds transformers'
    /// `rope_config_validation` checks, and finiteness.
    pub fn check(&self) -> Result<(), String> {
        let factor_ok = |f: f32| f.is_finite() && f >= 1.0;
        match *self {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } if factor_ok(factor) => Ok(()),
            RopeScaling::Linear { factor } => Err(format!(
                "linear rope factor {factor} must be finite and at least 1"
            )),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                if !factor_ok(factor) {
                    return Err(format!(
                        "llama3 rope factor {factor} must be finite and at least 1"
                    ));
                }
                if !(low_freq_factor.is_finite()
                    && high_freq_factor.is_finite()
                    && 0.0 < low_freq_factor
                    && low_freq_factor < high_freq_factor)
                {
                    return Err(format!(
                        "llama3 rope: low_freq_factor {low_freq_factor} must be positive and \
                         below high_freq_factor {high_freq_factor}"
                    ));
                }
                check_original(original_max_position_embeddings)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            } => {
                if !factor_ok(factor) {
                    return Err(format!(
                        "yarn rope factor {factor} must be finite and at least 1"
                    ));
                }
                if !(beta_fast.is_finite() && beta_slow.is_finite() && beta_fast > 0.0)
                    || beta_slow <= 0.0
                {
                    return Err(format!(
                        "yarn rope: beta_fast {beta_fast} and beta_slow {beta_slow} must be \
                         finite and positive"
                    ));
                }
                if !(attention_factor.is_finite() && attention_factor > 0.0) {
                    return Err(format!(
                        "yarn rope: attention_factor {attention_factor} must be finite and \
                         positive"
                    ));
                }
                check_original(original_max_position_embeddings)
            }
        }
    }
}

/// An original context's bounds, as for the model's own.
fn check_original(original: usize) -> Result<(), String> {
    if original == 0 || original > 1 << 24 {
        return Err(format!(
            "rope: original_max_position_embeddings {original} out of 1..={}",
            1 << 24
        ));
    }
    Ok(())
}

/// A model's rotary embedding: the base and its rescaling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// The base `θ` (`rope_theta`).
    pub theta: f32,
    /// How the frequencies are rescaled.
    pub scaling: RopeScaling,
}

impl Rope {
    /// The rotary embedding of base `theta`, unscaled.
    pub fn plain(theta: f32) -> Rope {
        Rope {
            theta,
            scaling: RopeScaling::None,
        }
    }

    /// The `hs/2` inverse frequencies, as transformers computes them in f32: `1 / θ^(2i/hs)`,
    /// then the rescaling, operation by operation (no fused multiply-add, as torch's
    /// element-wise kernels run them one at a time).
    pub fn inv_freq(&self, hs: usize) -> Vec<f32> {
        let base = (0..hs / 2).map(|i| 1.0 / self.theta.powf((2 * i) as f32 / hs as f32));
        match self.scaling {
            RopeScaling::None => base.collect(),
            RopeScaling::Linear { factor } => base.map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                // transformers' `_compute_llama3_parameters`, with Python's scalars rounded to
                // f32 where torch meets them with an f32 tensor.
                let old = original_max_position_embeddings as f32;
                let low_freq_wavelen =
                    (original_max_position_embeddings as f64 / low_freq_factor as f64) as f32;
                let high_freq_wavelen =
                    (original_max_position_embeddings as f64 / high_freq_factor as f64) as f32;
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                let span = (high_freq_factor as f64 - low_freq_factor as f64) as f32;
                base.map(|f| {
                    let wavelen = two_pi / f;
                    let stretched = if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        f
                    };
                    // `~(w < high) * ~(w > low)`; the same for the finite wavelengths here.
                    let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                    if medium {
                        let smooth = (old / wavelen - low_freq_factor) / span;
                        (1.0 - smooth) * stretched / factor + smooth * stretched
                    } else {
                        stretched
                    }
                })
                .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                // transformers' `_compute_yarn_parameters`: the ramp's ends in f64 as Python
                // computes them, the blend in f32 as torch does.
                let dim = hs as f64;
                let theta = self.theta as f64;
                let original = original_max_position_embeddings as f64;
                let correction = |rotations: f64| {
                    dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, high) = (low.max(0.0), high.min(dim - 1.0));
                // Python's `max += 0.001` when the ends meet, then `max - min`.
                let span = if low == high {
                    (high + 0.001) - low
                } else {
                    high - low
                };
                (0..hs / 2)
                    .map(|i| {
                        let pos_freq = self.theta.powf((2 * i) as f32 / hs as f32);
                        let extrapolation = 1.0 / pos_freq;
                        let interpolation = 1.0 / (factor * pos_freq);
                        let ramp = ((i as f32 - low as f32) / span as f32).clamp(0.0, 1.0);
                        let kept = 1.0 - ramp;
                        interpolation * (1.0 - kept) + extrapolation * kept
                    })
                    .collect()
            }
        }
    }

    /// The factor on cos and sin: 1 but for YaRN's `attention_factor`.
    pub fn attention_factor(&self) -> f32 {
        match self.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor,
            _ => 1.0,
        }
    }
}

/// `cos` and `sin` of every (position, frequency): two `[t, hs/2]` tables.
pub fn tables(t: usize, hs: usize, rope: Rope) -> (Vec<f32>, Vec<f32>) {
    tables_at(0, t, hs, rope)
}

/// [`tables`] for positions `pos0 .. pos0 + t` (a cached decode's new rows): row `r` holds
/// the angles of position `pos0 + r`, the same values [`tables`] gives at that position.
pub fn tables_at(pos0: usize, t: usize, hs: usize, rope: Rope) -> (Vec<f32>, Vec<f32>) {
    tables_of((pos0..pos0 + t).map(|p| p as f32), t, hs, rope)
}

/// [`tables`] for the given positions: row `r` holds the angles of `positions[r]`, the same
/// values [`tables`] gives at that position.
pub fn tables_for(positions: &[u32], hs: usize, rope: Rope) -> (Vec<f32>, Vec<f32>) {
    tables_of(
        positions.iter().map(|&p| p as f32),
        positions.len(),
        hs,
        rope,
    )
}

/// The `[rows, hs/2]` tables of `rows` positions, one row per position in order.
fn tables_of(
    positions: impl Iterator<Item = f32>,
    rows: usize,
    hs: usize,
    rope: Rope,
) -> (Vec<f32>, Vec<f32>) {
    let half = hs / 2;
    let inv_freq = rope.inv_freq(hs);
    // transformers multiplies its f32 cos and sin by the factor (YaRN's), in f32; 1 leaves
    // them as they are. The rotation is then scaled, and its backward (the negative angle)
    // is still its transpose.
    let scale = rope.attention_factor();
    let mut cos = vec![0f32; rows * half];
    let mut sin = vec![0f32; rows * half];
    for (row, pos) in positions.take(rows).enumerate() {
        for (i, &f) in inv_freq.iter().enumerate() {
            let angle = (pos * f) as f64;
            cos[row * half + i] = angle.cos() as f32 * scale;
            sin[row * half + i] = angle.sin() as f32 * scale;
        }
    }
    (cos, sin)
}

/// One row's pairs by the angles whose cosines and sines are `c` and `s` (`hs/2` each).
#[inline]
fn rotate(row: &mut [f32], c: &[f32], s: &[f32], sign: f32) {
    let (a, b) = row.split_at_mut(c.len());
    for i in 0..c.len() {
        let (x1, x2) = (a[i], b[i]);
        let si = sign * s[i];
        a[i] = x1 * c[i] - x2 * si;
        b[i] = x2 * c[i] + x1 * si;
    }
}

/// [`apply`] to `x` `[B, heads, t, hs]` with row `r` of sequence `b` at table row
/// `positions[b·t + r]` (packed documents): the same arithmetic as at that position in `apply`.
#[allow(clippy::too_many_arguments)]
pub fn apply_at(
    x: &mut [f32],
    heads: usize,
    t: usize,
    hs: usize,
    cos: &[f32],
    sin: &[f32],
    positions: &[u32],
    inverse: bool,
) {
    let half = hs / 2;
    let sign = if inverse { -1.0f32 } else { 1.0 };
    x.par_chunks_mut(t * hs).enumerate().for_each(|(bh, head)| {
        let rows = &positions[(bh / heads.max(1)) * t..][..t];
        for (row, &pos) in head.chunks_exact_mut(hs).zip(rows) {
            let pos = pos as usize;
            rotate(
                row,
                &cos[pos * half..][..half],
                &sin[pos * half..][..half],
                sign,
            );
        }
    });
}

/// Rotate `x` `[B·H, t, hs]` in place: `(a, b) → (a·cos − b·sin, b·cos + a·sin)` for each pair
/// `(a, b) = (x[i], x[i + hs/2])`, or by the negative angle when `inverse` (the backward).
pub fn apply(x: &mut [f32], t: usize, hs: usize, cos: &[f32], sin: &[f32], inverse: bool) {
    let half = hs / 2;
    let sign = if inverse { -1.0f32 } else { 1.0 };
    x.par_chunks_mut(t * hs).for_each(|head| {
        for (pos, row) in head.chunks_exact_mut(hs).enumerate() {
            rotate(
                row,
                &cos[pos * half..][..half],
                &sin[pos * half..][..half],
                sign,
            );
        }
    });
}
