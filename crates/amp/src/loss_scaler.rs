//! Dynamic loss scaling with PyTorch `torch.amp.GradScaler` semantics.
//!
//! Per optimizer step:
//! 1. multiply the loss (or the gradient seed of backward) by [`LossScaler::scale`];
//! 2. [`LossScaler::unscale`] the gradients once: each is multiplied by `1/scale` — computed in
//!    f64 and rounded to f32, as PyTorch does — and checked for ∞/NaN in the same pass.
//!    When the gradients were unscaled elsewhere (a fused kernel, another device or rank),
//!    [`LossScaler::unscale_external`] records that pass's overflow flag instead, and
//!    [`LossScaler::record_found_inf`] merges further sources into the step (any ∞/NaN skips
//!    it);
//! 3. run the optimizer only if that returned [`StepDecision::Apply`];
//! 4. [`LossScaler::update`]: after an overflow the scale is multiplied by `backoff_factor` and
//!    the growth tracker resets; otherwise the tracker counts, and on reaching `growth_interval`
//!    consecutive clean steps the scale is multiplied by `growth_factor` (unless that would be
//!    infinite) and the tracker resets.
//!
//! The rules are those of PyTorch's `_amp_update_scale_` kernel, including its arithmetic (the
//! f32 scale times an f64 factor, rounded back to f32). Beyond PyTorch: an optional
//! `min_scale`/`max_scale` clamp, a typed error instead of a silent double division when
//! `unscale` is called twice, and a typed error when the scale has collapsed so far that
//! `1/scale` overflows.

use headroom_tensor::{Backend, DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::{AmpError, Result};

/// Loss-scaler settings. [`Default`] is PyTorch's: scale 2¹⁶, growth ×2, backoff ×0.5,
/// growth every 2000 clean steps, no clamp.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScalerConfig {
    /// The scale of the first step.
    pub init_scale: f32,
    /// Factor applied after `growth_interval` consecutive clean steps; > 1.
    pub growth_factor: f64,
    /// Factor applied after a step with a non-finite gradient; in (0, 1).
    pub backoff_factor: f64,
    /// Consecutive clean steps before the scale grows; ≥ 1.
    pub growth_interval: u32,
    /// The scale never backs off below this (PyTorch has no floor; a scale that underflows
    /// to 0 is a known failure of long fp16 runs).
    pub min_scale: Option<f32>,
    /// The scale never grows above this.
    pub max_scale: Option<f32>,
    /// Accept f16 gradients in [`LossScaler::unscale`] (PyTorch's `allow_fp16`). Off by
    /// default because dividing f16 in place flushes small gradients to zero.
    pub allow_f16_gradients: bool,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        LossScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: None,
            max_scale: None,
            allow_f16_gradients: false,
        }
    }
}

fn invalid(what: &'static str, reason: impl Into<String>) -> AmpError {
    AmpError::InvalidScaler {
        what,
        reason: reason.into(),
    }
}

impl LossScalerConfig {
    /// Check the rules every configuration must follow.
    pub fn validate(&self) -> Result<()> {
        let positive = |v: f32| v.is_finite() && v > 0.0;
        if !positive(self.init_scale) {
            return Err(invalid(
                "config",
                format!("init_scale {} must be finite and > 0", self.init_scale),
            ));
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return Err(invalid(
                "config",
                format!(
                    "growth_factor {} must be finite and > 1",
                    self.growth_factor
                ),
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return Err(invalid(
                "config",
                format!("backoff_factor {} must be in (0, 1)", self.backoff_factor),
            ));
        }
        if self.growth_interval == 0 {
            return Err(invalid("config", "growth_interval must be at least 1"));
        }
        for (name, bound) in [("min_scale", self.min_scale), ("max_scale", self.max_scale)] {
            if let Some(b) = bound {
                if !positive(b) {
                    return Err(invalid(
                        "config",
                        format!("{name} {b} must be finite and > 0"),
                    ));
                }
            }
        }
        if let (Some(lo), Some(hi)) = (self.min_scale, self.max_scale) {
            if lo > hi {
                return Err(invalid(
                    "config",
                    format!("min_scale {lo} exceeds max_scale {hi}"),
                ));
            }
        }
        self.check_bounds("config", self.init_scale)
    }

    fn check_bounds(&self, what: &'static str, scale: f32) -> Result<()> {
        if self.min_scale.is_some_and(|lo| scale < lo)
            || self.max_scale.is_some_and(|hi| scale > hi)
        {
            return Err(invalid(
                what,
                format!(
                    "scale {scale} lies outside [{:?}, {:?}]",
                    self.min_scale, self.max_scale
                ),
            ));
        }
        Ok(())
    }

    /// The rule: the scale and growth tracker after a step, given whether it overflowed.
    fn next(&self, scale: f32, growth_tracker: u32, found_inf: bool) -> (f32, u32) {
        if found_inf {
            // f32 × f64 → f32, as `_amp_update_scale_` computes it.
            let backed_off = (f64::from(scale) * self.backoff_factor) as f32;
            let clamped = self.min_scale.map_or(backed_off, |lo| backed_off.max(lo));
            return (clamped, 0);
        }
        let successful = growth_tracker.saturating_add(1);
        if successful < self.growth_interval {
            return (scale, successful);
        }
        let grown = (f64::from(scale) * self.growth_factor) as f32;
        // PyTorch keeps the old scale rather than grow to infinity.
        let grown = if grown.is_finite() { grown } else { scale };
        (self.max_scale.map_or(grown, |hi| grown.min(hi)), 0)
    }
}

/// Where the scaler is inside the current optimizer step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepPhase {
    /// Gradients of this step have not been unscaled yet.
    AwaitingUnscale,
    /// Gradients were unscaled; `found_inf` says whether any was non-finite.
    Unscaled {
        /// Whether an infinite or NaN gradient was seen.
        found_inf: bool,
    },
}

/// Everything that changes while training: save it with the checkpoint and a resumed run
/// continues exactly.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScalerState {
    /// The current scale.
    pub scale: f32,
    /// Consecutive clean steps since the last growth or overflow (`< growth_interval`).
    pub growth_tracker: u32,
    /// Optimizer steps applied.
    pub steps_taken: u64,
    /// Optimizer steps skipped because a gradient was non-finite.
    pub steps_skipped: u64,
    /// Progress inside the current step.
    pub phase: StepPhase,
}

/// What to do with this step's optimizer update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepDecision {
    /// Every gradient was finite: run the optimizer.
    Apply,
    /// A gradient was infinite or NaN: do not run the optimizer this step.
    Skip,
}

impl StepDecision {
    /// True for [`StepDecision::Apply`].
    pub fn should_step(self) -> bool {
        self == StepDecision::Apply
    }
}

/// What [`LossScaler::update`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleUpdate {
    /// Whether the step was skipped (a gradient overflowed).
    pub skipped: bool,
    /// The scale the step used.
    pub previous_scale: f32,
    /// The scale of the next step.
    pub scale: f32,
}

fn decision(found_inf: bool) -> StepDecision {
    if found_inf {
        StepDecision::Skip
    } else {
        StepDecision::Apply
    }
}

/// A dynamic loss scaler (PyTorch `GradScaler` semantics; see the module docs).
///
/// Serialises as `{config, state}`; deserialising validates both.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "LossScalerParts")]
pub struct LossScaler {
    config: LossScalerConfig,
    state: LossScalerState,
}

/// The unvalidated serialised form of a [`LossScaler`].
#[derive(Deserialize)]
struct LossScalerParts {
    config: LossScalerConfig,
    state: LossScalerState,
}

impl TryFrom<LossScalerParts> for LossScaler {
    type Error = AmpError;
    fn try_from(p: LossScalerParts) -> Result<Self> {
        LossScaler::from_parts(p.config, p.state)
    }
}

impl LossScaler {
    /// A scaler at the start of training.
    pub fn new(config: LossScalerConfig) -> Result<Self> {
        config.validate()?;
        Ok(LossScaler {
            config,
            state: LossScalerState {
                scale: config.init_scale,
                growth_tracker: 0,
                steps_taken: 0,
                steps_skipped: 0,
                phase: StepPhase::AwaitingUnscale,
            },
        })
    }

    /// A scaler resumed from a saved configuration and state (both validated).
    pub fn from_parts(config: LossScalerConfig, state: LossScalerState) -> Result<Self> {
        config.validate()?;
        if !(state.scale.is_finite() && state.scale >= 0.0) {
            return Err(invalid(
                "state",
                format!("scale {} must be finite and ≥ 0", state.scale),
            ));
        }
        config.check_bounds("state", state.scale)?;
        if state.growth_tracker >= config.growth_interval {
            return Err(invalid(
                "state",
                format!(
                    "growth_tracker {} must be below growth_interval {}",
                    state.growth_tracker, config.growth_interval
                ),
            ));
        }
        Ok(LossScaler { config, state })
    }

    /// The configuration.
    pub fn config(&self) -> &LossScalerConfig {
        &self.config
    }

    /// The state to save with a checkpoint.
    pub fn state(&self) -> &LossScalerState {
        &self.state
    }

    /// The current loss scale.
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// Consecutive clean steps counted towards the next growth.
    pub fn growth_tracker(&self) -> u32 {
        self.state.growth_tracker
    }

    /// Optimizer steps applied so far.
    pub fn steps_taken(&self) -> u64 {
        self.state.steps_taken
    }

    /// Optimizer steps skipped so far.
    pub fn steps_skipped(&self) -> u64 {
        self.state.steps_skipped
    }

    /// Whether this step's gradients overflowed; `None` before they are unscaled.
    pub fn found_inf(&self) -> Option<bool> {
        match self.state.phase {
            StepPhase::AwaitingUnscale => None,
            StepPhase::Unscaled { found_inf } => Some(found_inf),
        }
    }

    /// `loss × scale`, the value to differentiate (f32 arithmetic, as PyTorch's `scale()` of
    /// an f32 loss).
    pub fn scale_loss(&self, loss: f32) -> f32 {
        loss * self.state.scale
    }

    /// Multiply a tensor (the loss, or the gradient seed of backward) by the scale in place.
    pub fn scale_tensor<B: Backend>(&self, backend: &B, tensor: &mut B::Tensor) -> Result<()> {
        backend.scale(tensor, self.state.scale)?;
        Ok(())
    }

    /// `1/scale`: the reciprocal in f64 rounded to f32, exactly PyTorch's
    /// `scale.double().reciprocal().float()`.
    pub fn inv_scale(&self) -> f32 {
        (1.0 / f64::from(self.state.scale)) as f32
    }

    /// Unscale every gradient of this step in place and check them for ∞/NaN, in one fused
    /// pass per tensor ([`Backend::unscale_and_check`]).
    ///
    /// Call once per step with all gradients, before clipping or the optimizer; a second call
    /// before [`update`](Self::update) is [`AmpError::AlreadyUnscaled`]. Non-float and (unless
    /// allowed) f16 gradients are rejected before any tensor is touched. On error the scaler
    /// is unchanged.
    pub fn unscale<B: Backend>(
        &mut self,
        backend: &B,
        grads: &mut [&mut B::Tensor],
    ) -> Result<StepDecision> {
        if let StepPhase::Unscaled { .. } = self.state.phase {
            return Err(AmpError::AlreadyUnscaled);
        }
        for (index, g) in grads.iter().enumerate() {
            match g.dtype() {
                DType::F32 | DType::BF16 => {}
                DType::F16 if self.config.allow_f16_gradients => {}
                DType::F16 => return Err(AmpError::F16Gradient { index }),
                got => {
                    return Err(AmpError::DTypeMismatch {
                        what: "gradient",
                        expected: DType::F32,
                        got,
                    })
                }
            }
        }
        let inv_scale = self.inv_scale();
        if !inv_scale.is_finite() {
            return Err(AmpError::ScaleCollapsed {
                scale: self.state.scale,
            });
        }
        let found_inf = backend.unscale_and_check(grads, inv_scale)?;
        self.state.phase = StepPhase::Unscaled { found_inf };
        Ok(decision(found_inf))
    }

    /// Record that this step's gradients were unscaled elsewhere — by a fused kernel, on
    /// another device, by another rank — with `found_inf` the result of that pass's ∞/NaN
    /// check. Everything then proceeds as after [`unscale`](Self::unscale): the returned
    /// decision, [`found_inf`](Self::found_inf) and [`update`](Self::update) are exactly what
    /// `unscale` of gradients with that overflow outcome gives.
    ///
    /// The external pass must have multiplied by [`inv_scale`](Self::inv_scale). Unscaling is
    /// still once per step: after `unscale` or `unscale_external` this is
    /// [`AmpError::AlreadyUnscaled`] (and `unscale` after this is too); further sources of the
    /// same step are merged with [`record_found_inf`](Self::record_found_inf). A scale whose
    /// reciprocal is not a finite f32 is [`AmpError::ScaleCollapsed`], as for `unscale`,
    /// because the external pass could not have unscaled with it. On error the scaler is
    /// unchanged.
    pub fn unscale_external(&mut self, found_inf: bool) -> Result<StepDecision> {
        if let StepPhase::Unscaled { .. } = self.state.phase {
            return Err(AmpError::AlreadyUnscaled);
        }
        if !self.inv_scale().is_finite() {
            return Err(AmpError::ScaleCollapsed {
                scale: self.state.scale,
            });
        }
        self.state.phase = StepPhase::Unscaled { found_inf };
        Ok(decision(found_inf))
    }

    /// Merge one more overflow check into the current step: the step is skipped if any source
    /// found ∞/NaN, as GradScaler does with the per-device (and, under data parallelism, the
    /// all-reduced) flags. Typical callers: the OR of the other ranks' flags after the local
    /// [`unscale`](Self::unscale), or the check of gradients a fused kernel unscaled.
    ///
    /// Needs an [`unscale`](Self::unscale) or [`unscale_external`](Self::unscale_external)
    /// earlier in this step ([`AmpError::FoundInfBeforeUnscale`] otherwise: the flag would be
    /// about gradients that were never unscaled). May be called any number of times; a
    /// `false` changes nothing. Returns the step's decision with this flag included. The
    /// merged flag is part of [`LossScalerState`], so a scaler saved mid-step keeps it.
    pub fn record_found_inf(&mut self, found_inf: bool) -> Result<StepDecision> {
        let StepPhase::Unscaled { found_inf: before } = self.state.phase else {
            return Err(AmpError::FoundInfBeforeUnscale);
        };
        let merged = before || found_inf;
        self.state.phase = StepPhase::Unscaled { found_inf: merged };
        Ok(decision(merged))
    }

    /// Finish the step: count it as taken or skipped and move the scale by the rules. Requires
    /// an [`unscale`](Self::unscale) or [`unscale_external`](Self::unscale_external) in this
    /// step ([`AmpError::UpdateWithoutUnscale`]).
    pub fn update(&mut self) -> Result<ScaleUpdate> {
        let StepPhase::Unscaled { found_inf } = self.state.phase else {
            return Err(AmpError::UpdateWithoutUnscale);
        };
        let previous_scale = self.state.scale;
        let (scale, tracker) =
            self.config
                .next(previous_scale, self.state.growth_tracker, found_inf);
        self.state.scale = scale;
        self.state.growth_tracker = tracker;
        // Saturating: a restored state may carry any count, and a counter must not panic.
        if found_inf {
            self.state.steps_skipped = self.state.steps_skipped.saturating_add(1);
        } else {
            self.state.steps_taken = self.state.steps_taken.saturating_add(1);
        }
        self.state.phase = StepPhase::AwaitingUnscale;
        Ok(ScaleUpdate {
            skipped: found_inf,
            previous_scale,
            scale,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_tensor::{Cpu, CpuTensor};
    use proptest::prelude::*;

    /// GradScaler's update rule written out as plainly as possible, independent of
    /// `LossScalerConfig::next`.
    struct ReferenceScaler {
        scale: f32,
        tracker: u32,
        growth: f64,
        backoff: f64,
        interval: u32,
        min: Option<f32>,
        max: Option<f32>,
        taken: u64,
        skipped: u64,
    }

    impl ReferenceScaler {
        fn step(&mut self, found_inf: bool) {
            if found_inf {
                self.skipped += 1;
                self.scale = (self.scale as f64 * self.backoff) as f32;
                if let Some(min) = self.min {
                    if self.scale < min {
                        self.scale = min;
                    }
                }
                self.tracker = 0;
            } else {
                self.taken += 1;
                self.tracker += 1;
                if self.tracker == self.interval {
                    let grown = (self.scale as f64 * self.growth) as f32;
                    if grown.is_finite() {
                        self.scale = grown;
                    }
                    if let Some(max) = self.max {
                        if self.scale > max {
                            self.scale = max;
                        }
                    }
                    self.tracker = 0;
                }
            }
        }
    }

    fn grad(cpu: &Cpu, values: &[f32]) -> CpuTensor {
        cpu.upload(values, [values.len()]).unwrap()
    }

    #[test]
    fn defaults_are_pytorchs() {
        let c = LossScalerConfig::default();
        assert_eq!(c.init_scale, 65536.0);
        assert_eq!(c.growth_factor, 2.0);
        assert_eq!(c.backoff_factor, 0.5);
        assert_eq!(c.growth_interval, 2000);
        let s = LossScaler::new(c).unwrap();
        assert_eq!(
            (
                s.scale(),
                s.growth_tracker(),
                s.steps_taken(),
                s.steps_skipped()
            ),
            (65536.0, 0, 0, 0)
        );
    }

    #[test]
    fn bad_configs_are_rejected() {
        let base = LossScalerConfig::default();
        let bad = [
            LossScalerConfig {
                init_scale: 0.0,
                ..base
            },
            LossScalerConfig {
                init_scale: f32::INFINITY,
                ..base
            },
            LossScalerConfig {
                init_scale: f32::NAN,
                ..base
            },
            LossScalerConfig {
                growth_factor: 1.0,
                ..base
            },
            LossScalerConfig {
                backoff_factor: 1.0,
                ..base
            },
            LossScalerConfig {
                backoff_factor: 0.0,
                ..base
            },
            LossScalerConfig {
                growth_interval: 0,
                ..base
            },
            LossScalerConfig {
                min_scale: Some(-1.0),
                ..base
            },
            LossScalerConfig {
                min_scale: Some(4.0),
                max_scale: Some(2.0),
                init_scale: 3.0,
                ..base
            },
            LossScalerConfig {
                max_scale: Some(1024.0),
                ..base
            },
        ];
        for c in bad {
            assert!(
                matches!(
                    LossScaler::new(c),
                    Err(AmpError::InvalidScaler { what: "config", .. })
                ),
                "{c:?}"
            );
        }
    }

    #[test]
    fn unscale_divides_once_and_twice_is_an_error() {
        let cpu = Cpu::new();
        let mut s = LossScaler::new(LossScalerConfig {
            init_scale: 8.0,
            ..Default::default()
        })
        .unwrap();
        let mut g = grad(&cpu, &[8.0, -16.0, 4.0]);
        assert_eq!(s.unscale(&cpu, &mut [&mut g]).unwrap(), StepDecision::Apply);
        assert_eq!(cpu.download::<f32>(&g).unwrap(), [1.0, -2.0, 0.5]);
        assert!(matches!(
            s.unscale(&cpu, &mut [&mut g]),
            Err(AmpError::AlreadyUnscaled)
        ));
        assert_eq!(
            cpu.download::<f32>(&g).unwrap(),
            [1.0, -2.0, 0.5],
            "the failed call left g alone"
        );
        let u = s.update().unwrap();
        assert_eq!(
            u,
            ScaleUpdate {
                skipped: false,
                previous_scale: 8.0,
                scale: 8.0
            }
        );
        assert!(matches!(s.update(), Err(AmpError::UpdateWithoutUnscale)));
        assert_eq!(s.steps_taken(), 1);
    }

    #[test]
    fn scaling_the_loss_and_the_gradient_seed() {
        let cpu = Cpu::new();
        let s = LossScaler::new(LossScalerConfig {
            init_scale: 512.0,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.scale_loss(0.25), 128.0);
        let mut seed = cpu.upload(&[1.0f32, -0.5], [2]).unwrap();
        s.scale_tensor(&cpu, &mut seed).unwrap();
        assert_eq!(cpu.download::<f32>(&seed).unwrap(), [512.0, -256.0]);
        // An f16 seed that the scale overflows becomes ∞ — and the next unscale would see it.
        let mut half_seed = cpu.upload(&[half::f16::from_f32(200.0)], [1]).unwrap();
        s.scale_tensor(&cpu, &mut half_seed).unwrap();
        assert!(cpu.download::<half::f16>(&half_seed).unwrap()[0].is_infinite());
    }

    #[test]
    fn inv_scale_is_f64_reciprocal_rounded() {
        // 3 is not a power of two: 1/3 in f64 rounded to f32 differs from f32's 1/3 only by
        // where the rounding happens; both must be the correctly rounded f32 of 1/3.
        let s = LossScaler::new(LossScalerConfig {
            init_scale: 3.0,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.inv_scale(), (1.0f64 / 3.0) as f32);
        let odd = f32::from_bits(0x4b7f_fffd);
        let s = LossScaler::new(LossScalerConfig {
            init_scale: odd,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.inv_scale(), (1.0 / odd as f64) as f32);
    }

    #[test]
    fn bad_gradients_are_rejected_before_touching_anything() {
        let cpu = Cpu::new();
        let mut s = LossScaler::new(LossScalerConfig {
            init_scale: 4.0,
            ..Default::default()
        })
        .unwrap();
        let mut ok = grad(&cpu, &[4.0]);
        let mut half = cpu.zeros([1], DType::F16).unwrap();
        let mut ints = cpu.upload(&[1u32], [1]).unwrap();
        assert!(matches!(
            s.unscale(&cpu, &mut [&mut ok, &mut half]),
            Err(AmpError::F16Gradient { index: 1 })
        ));
        assert!(matches!(
            s.unscale(&cpu, &mut [&mut ok, &mut ints]),
            Err(AmpError::DTypeMismatch { .. })
        ));
        assert_eq!(cpu.download::<f32>(&ok).unwrap(), [4.0]);
        assert_eq!(s.found_inf(), None);
        let mut allowing = LossScaler::new(LossScalerConfig {
            init_scale: 4.0,
            allow_f16_gradients: true,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            allowing.unscale(&cpu, &mut [&mut ok, &mut half]).unwrap(),
            StepDecision::Apply
        );
    }

    #[test]
    fn collapsed_scale_is_a_typed_error() {
        let cpu = Cpu::new();
        let config = LossScalerConfig {
            init_scale: 1e-38,
            backoff_factor: 0.5,
            ..Default::default()
        };
        let mut s = LossScaler::new(config).unwrap();
        let mut g = grad(&cpu, &[f32::INFINITY]);
        // 1e-38 → 1/scale = 1e38 (finite); back off until 1/scale overflows f32.
        let mut collapsed = false;
        for _ in 0..200 {
            match s.unscale(&cpu, &mut [&mut g]) {
                Ok(_) => {
                    s.update().unwrap();
                }
                Err(AmpError::ScaleCollapsed { scale }) => {
                    assert!(scale < 1e-38);
                    collapsed = true;
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(collapsed);
        // With a floor it never collapses.
        let mut floored = LossScaler::new(LossScalerConfig {
            min_scale: Some(1.0),
            init_scale: 4.0,
            ..config
        })
        .unwrap();
        for _ in 0..10 {
            floored.unscale(&cpu, &mut [&mut g]).unwrap();
            floored.update().unwrap();
        }
        assert_eq!(floored.scale(), 1.0);
        assert_eq!(floored.steps_skipped(), 10);
    }

    #[test]
    fn growth_never_reaches_infinity() {
        let cpu = Cpu::new();
        let config = LossScalerConfig {
            init_scale: f32::MAX,
            growth_interval: 1,
            ..Default::default()
        };
        let mut s = LossScaler::new(config).unwrap();
        let mut g = grad(&cpu, &[0.0]);
        s.unscale(&cpu, &mut [&mut g]).unwrap();
        assert_eq!(s.update().unwrap().scale, f32::MAX);
        assert_eq!(s.growth_tracker(), 0);
    }

    #[test]
    fn restored_state_is_validated() {
        let config = LossScalerConfig {
            growth_interval: 10,
            ..Default::default()
        };
        let good = LossScalerState {
            scale: 2.0,
            growth_tracker: 9,
            steps_taken: 5,
            steps_skipped: 1,
            phase: StepPhase::AwaitingUnscale,
        };
        assert!(LossScaler::from_parts(config, good).is_ok());
        for bad in [
            LossScalerState {
                growth_tracker: 10,
                ..good
            },
            LossScalerState {
                scale: f32::NAN,
                ..good
            },
            LossScalerState {
                scale: -1.0,
                ..good
            },
        ] {
            assert!(matches!(
                LossScaler::from_parts(config, bad),
                Err(AmpError::InvalidScaler { what: "state", .. })
            ));
        }
        let json = r#"{"config":{"init_scale":1.0,"growth_factor":2.0,"backoff_factor":0.5,"growth_interval":0,"min_scale":null,"max_scale":null,"allow_f16_gradients":false},"state":{"scale":1.0,"growth_tracker":0,"steps_taken":0,"steps_skipped":0,"phase":"AwaitingUnscale"}}"#;
        assert!(
            serde_json::from_str::<LossScaler>(json).is_err(),
            "growth_interval 0 must not deserialize"
        );
    }

    fn config_strategy() -> impl Strategy<Value = LossScalerConfig> {
        (
            prop_oneof![Just(65536.0f32), 1.0f32..1e6],
            prop_oneof![Just(2.0f64), 1.01f64..8.0],
            prop_oneof![Just(0.5f64), 0.05f64..0.99],
            1u32..6,
            proptest::option::of(1e-3f32..1.0),
            proptest::option::of(1e6f32..1e9),
        )
            .prop_map(
                |(
                    init_scale,
                    growth_factor,
                    backoff_factor,
                    growth_interval,
                    min_scale,
                    max_scale,
                )| {
                    LossScalerConfig {
                        init_scale,
                        growth_factor,
                        backoff_factor,
                        growth_interval,
                        min_scale,
                        max_scale,
                        allow_f16_gradients: false,
                    }
                },
            )
    }

    /// The body of `trajectory_matches_reference`, shared with the fixed collapse case.
    fn check_trajectory(
        config: LossScalerConfig,
        flags: &[bool],
        resume_at: usize,
    ) -> std::result::Result<(), TestCaseError> {
        let cpu = Cpu::new();
        let mut scaler = LossScaler::new(config).unwrap();
        let mut reference = ReferenceScaler {
            scale: config.init_scale,
            tracker: 0,
            growth: config.growth_factor,
            backoff: config.backoff_factor,
            interval: config.growth_interval,
            min: config.min_scale,
            max: config.max_scale,
            taken: 0,
            skipped: 0,
        };
        for (i, &overflow) in flags.iter().enumerate() {
            if i == resume_at {
                let json = serde_json::to_string(&scaler).unwrap();
                let resumed: LossScaler = serde_json::from_str(&json).unwrap();
                prop_assert_eq!(&resumed, &scaler);
                scaler = resumed;
            }
            let scale = scaler.scale();
            let mut g = grad(
                &cpu,
                &[scale, if overflow { f32::INFINITY } else { -scale }],
            );
            let decision = match scaler.unscale(&cpu, &mut [&mut g]) {
                Ok(decision) => decision,
                Err(AmpError::ScaleCollapsed { scale: refused }) => {
                    // Without a floor, a run of overflows at a small backoff factor can
                    // drive the scale below 1/f32::MAX (0.05^30 is about 1e-39): the scaler
                    // refuses exactly when the reference's reciprocal is not a finite f32,
                    // and the refusal changes nothing.
                    prop_assert!(config.min_scale.is_none());
                    prop_assert_eq!(refused.to_bits(), reference.scale.to_bits());
                    prop_assert!(!((1.0 / f64::from(reference.scale)) as f32).is_finite());
                    prop_assert_eq!(scaler.found_inf(), None);
                    break;
                }
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            };
            prop_assert!(((1.0 / f64::from(reference.scale)) as f32).is_finite());
            prop_assert_eq!(decision.should_step(), !overflow);
            let update = scaler.update().unwrap();
            reference.step(overflow);
            prop_assert_eq!(update.skipped, overflow);
            prop_assert_eq!(update.previous_scale, scale);
            prop_assert_eq!(
                scaler.scale().to_bits(),
                reference.scale.to_bits(),
                "step {}",
                i
            );
            prop_assert_eq!(scaler.growth_tracker(), reference.tracker);
            prop_assert!(scaler.growth_tracker() < config.growth_interval);
            prop_assert_eq!(
                (scaler.steps_taken(), scaler.steps_skipped()),
                (reference.taken, reference.skipped)
            );
        }
        Ok(())
    }

    /// CI once drew a backoff factor near 0.05 and enough overflows to push the scale below
    /// 1/f32::MAX; that trajectory must end in a refusal, not a panic.
    #[test]
    fn trajectory_ending_in_a_collapsed_scale() {
        let config = LossScalerConfig {
            init_scale: 1.0,
            backoff_factor: 0.05,
            min_scale: None,
            ..Default::default()
        };
        check_trajectory(config, &[true; 40], 10).unwrap();
        let mut scaler = LossScaler::new(config).unwrap();
        let cpu = Cpu::new();
        let refused = (0..40).find(|_| {
            let mut g = grad(&cpu, &[f32::INFINITY]);
            match scaler.unscale(&cpu, &mut [&mut g]) {
                Ok(_) => scaler.update().map(|_| false).unwrap(),
                Err(_) => true,
            }
        });
        assert!(
            refused.is_some(),
            "40 overflows at backoff 0.05 collapse the scale"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// For any sequence of overflow flags, the scaler (driven through real tensors) follows
        /// the reference model step for step, and a serde round trip at any point changes
        /// nothing.
        #[test]
        fn trajectory_matches_reference(
            config in config_strategy(),
            flags in proptest::collection::vec(proptest::bool::weighted(0.3), 0..120),
            resume_at in 0usize..120,
        ) {
            check_trajectory(config, &flags, resume_at)?;
        }

        /// Random gradients with inf/NaN planted at random positions: the step is skipped and
        /// the scale halves (default backoff); without a plant it is applied and every value is
        /// exactly `g · (1/scale)`.
        #[test]
        fn planted_non_finite_skips_and_halves(
            sizes in proptest::collection::vec(1usize..3000, 1..4),
            seed_values in proptest::collection::vec(-1e4f32..1e4, 64),
            plant in proptest::option::of((any::<proptest::sample::Index>(), any::<proptest::sample::Index>(), 0u8..3)),
        ) {
            let cpu = Cpu::new();
            let mut scaler = LossScaler::new(LossScalerConfig::default()).unwrap();
            let mut host: Vec<Vec<f32>> = sizes.iter().enumerate()
                .map(|(t, &n)| (0..n).map(|i| seed_values[(i * 7 + t) % seed_values.len()]).collect())
                .collect();
            if let Some((which, at, kind)) = &plant {
                let t = which.index(host.len());
                let i = at.index(host[t].len());
                host[t][i] = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN][*kind as usize];
            }
            let mut tensors: Vec<CpuTensor> = host.iter().map(|h| grad(&cpu, h)).collect();
            let mut refs: Vec<&mut CpuTensor> = tensors.iter_mut().collect();
            let decision = scaler.unscale(&cpu, &mut refs).unwrap();
            let inv = scaler.inv_scale();
            for (t, h) in tensors.iter().zip(&host) {
                let got = cpu.download::<f32>(t).unwrap();
                for (g, &x) in got.iter().zip(h) {
                    let want = x * inv;
                    prop_assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()));
                }
            }
            let update = scaler.update().unwrap();
            if plant.is_some() {
                prop_assert_eq!(decision, StepDecision::Skip);
                prop_assert_eq!(update.scale, 32768.0);
                prop_assert_eq!(scaler.steps_skipped(), 1);
            } else {
                prop_assert_eq!(decision, StepDecision::Apply);
                prop_assert_eq!(update.scale, 65536.0);
                prop_assert_eq!(scaler.steps_taken(), 1);
            }
        }
    }

    #[test]
    fn external_unscale_follows_the_same_rules() {
        let config = LossScalerConfig {
            init_scale: 1024.0,
            growth_interval: 2,
            ..Default::default()
        };
        let mut s = LossScaler::new(config).unwrap();
        assert!(matches!(s.update(), Err(AmpError::UpdateWithoutUnscale)));
        assert!(matches!(
            s.record_found_inf(true),
            Err(AmpError::FoundInfBeforeUnscale)
        ));
        assert_eq!(s.found_inf(), None, "the refused record changed nothing");
        assert_eq!(s.unscale_external(false).unwrap(), StepDecision::Apply);
        assert_eq!(s.found_inf(), Some(false));
        // Unscaling twice stays an error, whichever path came first.
        assert!(matches!(
            s.unscale_external(false),
            Err(AmpError::AlreadyUnscaled)
        ));
        let cpu = Cpu::new();
        let mut g = grad(&cpu, &[1024.0]);
        assert!(matches!(
            s.unscale(&cpu, &mut [&mut g]),
            Err(AmpError::AlreadyUnscaled)
        ));
        assert_eq!(cpu.download::<f32>(&g).unwrap(), [1024.0], "g untouched");
        assert_eq!(s.update().unwrap().scale, 1024.0);
        // A second source with an overflow skips the step and backs off.
        assert_eq!(s.unscale(&cpu, &mut [&mut g]).unwrap(), StepDecision::Apply);
        assert!(matches!(
            s.unscale_external(false),
            Err(AmpError::AlreadyUnscaled)
        ));
        assert_eq!(s.record_found_inf(false).unwrap(), StepDecision::Apply);
        assert_eq!(s.record_found_inf(true).unwrap(), StepDecision::Skip);
        assert_eq!(
            s.record_found_inf(false).unwrap(),
            StepDecision::Skip,
            "a later clean source does not undo an overflow"
        );
        // Saved mid-step, the merged flag survives.
        let json = serde_json::to_string(&s).unwrap();
        let mut resumed: LossScaler = serde_json::from_str(&json).unwrap();
        assert_eq!(resumed.found_inf(), Some(true));
        let u = resumed.update().unwrap();
        assert_eq!(
            u,
            ScaleUpdate {
                skipped: true,
                previous_scale: 1024.0,
                scale: 512.0
            }
        );
        assert_eq!((resumed.steps_taken(), resumed.steps_skipped()), (1, 1));
        assert_eq!(resumed.growth_tracker(), 0);
        assert_eq!(resumed.unscale_external(true).unwrap(), StepDecision::Skip);
        assert_eq!(resumed.update().unwrap().scale, 256.0);
    }

    #[test]
    fn external_unscale_refuses_a_collapsed_scale() {
        let config = LossScalerConfig {
            init_scale: 1e-38,
            ..Default::default()
        };
        let mut s = LossScaler::new(config).unwrap();
        let mut collapsed = None;
        for step in 0..200 {
            match s.unscale_external(true) {
                Ok(d) => {
                    assert_eq!(d, StepDecision::Skip);
                    s.update().unwrap();
                }
                Err(AmpError::ScaleCollapsed { scale }) => {
                    collapsed = Some((step, scale));
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        let (_, scale) = collapsed.expect("the scale collapses");
        assert_eq!(s.scale(), scale);
        assert_eq!(s.found_inf(), None, "the refused call changed nothing");
    }

    /// How one step's overflow is reported to the scaler.
    #[derive(Clone, Copy, Debug)]
    enum Source {
        /// `unscale` of real gradients, an ∞ planted when the step overflows.
        Internal,
        /// `unscale_external(flag)`.
        External,
        /// A clean `unscale`, then the flag from `record_found_inf`.
        InternalThenRecord,
        /// `unscale_external(first)` then `record_found_inf(second)` with `first || second`
        /// equal to the step's flag.
        Split(bool),
    }

    fn source_strategy() -> impl Strategy<Value = Source> {
        prop_oneof![
            Just(Source::Internal),
            Just(Source::External),
            Just(Source::InternalThenRecord),
            any::<bool>().prop_map(Source::Split),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// For the same overflow flags, every way of reporting them (internal unscale,
        /// external flag, merged sources, saving mid-step) gives bit for bit the scale
        /// sequence and state of the internal path.
        #[test]
        fn external_flags_give_the_internal_scale_sequence(
            config in config_strategy(),
            steps in proptest::collection::vec((proptest::bool::weighted(0.3), source_strategy()), 0..120),
            save_at in 0usize..120,
        ) {
            let cpu = Cpu::new();
            let mut internal = LossScaler::new(config).unwrap();
            let mut other = LossScaler::new(config).unwrap();
            for (i, &(overflow, source)) in steps.iter().enumerate() {
                let scale = internal.scale();
                let mut g = grad(&cpu, &[scale, if overflow { f32::NAN } else { 1.0 }]);
                let want = match internal.unscale(&cpu, &mut [&mut g]) {
                    Ok(d) => d,
                    Err(AmpError::ScaleCollapsed { .. }) => {
                        // A collapsed scale is refused the same way on every path.
                        let mut h = grad(&cpu, &[1.0]);
                        let refused = match source {
                            Source::Internal | Source::InternalThenRecord => other.unscale(&cpu, &mut [&mut h]),
                            Source::External | Source::Split(_) => other.unscale_external(overflow),
                        };
                        let collapsed = matches!(refused, Err(AmpError::ScaleCollapsed { .. }));
                        prop_assert!(collapsed, "{:?}", refused);
                        prop_assert_eq!(&other, &internal);
                        break;
                    }
                    Err(e) => panic!("{e}"),
                };
                let got = match source {
                    Source::Internal => {
                        let mut h = grad(&cpu, &[scale, if overflow { f32::INFINITY } else { 2.0 }]);
                        other.unscale(&cpu, &mut [&mut h]).unwrap()
                    }
                    Source::External => other.unscale_external(overflow).unwrap(),
                    Source::InternalThenRecord => {
                        let mut h = grad(&cpu, &[scale]);
                        prop_assert_eq!(other.unscale(&cpu, &mut [&mut h]).unwrap(), StepDecision::Apply);
                        other.record_found_inf(overflow).unwrap()
                    }
                    Source::Split(first) => {
                        let first = first && overflow;
                        other.unscale_external(first).unwrap();
                        other.record_found_inf(overflow && !first).unwrap()
                    }
                };
                prop_assert_eq!(got, want);
                prop_assert_eq!(other.found_inf(), Some(overflow));
                if i == save_at {
                    let json = serde_json::to_string(&other).unwrap();
                    other = serde_json::from_str(&json).unwrap();
                }
                prop_assert_eq!(&other, &internal, "step {} before update", i);
                let a = internal.update().unwrap();
                let b = other.update().unwrap();
                prop_assert_eq!(a, b);
                prop_assert_eq!(other.scale().to_bits(), internal.scale().to_bits(), "step {}", i);
                prop_assert_eq!(&other, &internal);
            }
        }
    }
}
