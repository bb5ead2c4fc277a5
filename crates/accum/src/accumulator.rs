//! The gradient accumulator: f32 buffers allocated once, token-weighted accumulation of
//! micro-batch gradients, and the end-of-step hygiene (unscale once, skip on non-finite, clip).

use headroom_tensor::{Backend, BoxedError, DType, MemoryCategory, Shape, Tensor};
use serde::{Deserialize, Serialize};

use crate::clip::{check_max_norm, clip_grad_norm};
use crate::{AccumError, GradUnscaler, Result};

/// The counted (unmasked) tokens of one optimizer step, known before its first backward.
///
/// `global` is the normaliser: every loss gradient is divided by it, so the accumulated
/// gradient is that of the mean loss over the whole (possibly multi-device) batch. `local` is
/// this device's share, checked against what its micro-batches report. Data parallelism then
/// only has to sum token counts (to get `global`) and gradients (after accumulation).
///
/// Only serialisable (for logs): deserialising would bypass the validation of the
/// constructors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StepTokens {
    local: u64,
    global: u64,
}

impl StepTokens {
    /// One device: local and global are the same count.
    pub fn single_device(counted_tokens: u64) -> Result<Self> {
        Self::data_parallel(counted_tokens, counted_tokens)
    }

    /// This device counts `local` of the `global` tokens counted on all devices.
    pub fn data_parallel(local: u64, global: u64) -> Result<Self> {
        if global == 0 {
            return Err(AccumError::ZeroGlobalTokens);
        }
        if local > global {
            return Err(AccumError::LocalExceedsGlobal { local, global });
        }
        Ok(StepTokens { local, global })
    }

    /// Counted tokens on this device.
    pub fn local(&self) -> u64 {
        self.local
    }

    /// Counted tokens on all devices: the normaliser.
    pub fn global(&self) -> u64 {
        self.global
    }

    /// `1 / global` in f32: the weight of one counted token's loss gradient.
    pub fn loss_grad_weight(&self) -> f32 {
        (1.0 / self.global as f64) as f32
    }
}

/// What a micro-batch reports beside its gradients.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MicroBatchStats {
    /// Tokens whose loss counted in this micro-batch.
    pub counted_tokens: u64,
    /// The sum (not the mean) of the per-token losses over those tokens, unscaled.
    pub loss_sum: f64,
}

/// Whether the optimizer may use the gradients of a finished step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum StepOutcome {
    /// The gradients are finite, unscaled and clipped: run the optimizer on
    /// [`GradAccumulator::gradients`].
    Applied {
        /// Global L2 norm of the unscaled gradients before clipping.
        grad_norm: f64,
        /// The clipping factor, when clipping changed anything.
        clip_coefficient: Option<f32>,
    },
    /// Some gradient was infinite or NaN: skip the optimizer. The buffers are already zero.
    Skipped,
}

impl StepOutcome {
    /// True for [`StepOutcome::Applied`].
    pub fn is_applied(&self) -> bool {
        matches!(self, StepOutcome::Applied { .. })
    }
}

/// Summary of a finished step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// Mean loss per counted token: this device's loss sums divided by the global count (so
    /// devices' values add up to the global mean).
    pub loss: f64,
    /// Counted tokens on this device.
    pub counted_tokens: u64,
    /// Micro-batches accumulated.
    pub micro_batches: usize,
    /// Whether the optimizer may step.
    pub outcome: StepOutcome,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Between steps. `dirty` when the buffers still hold the last applied step's gradients.
    Idle { dirty: bool },
    /// Micro-batches are being added.
    Accumulating {
        tokens: StepTokens,
        counted: u64,
        loss_sum: f64,
        micro_batches: usize,
    },
}

/// Accumulates micro-batch gradients into f32 buffers so the result equals the gradient of the
/// mean loss over the whole batch, whatever the split and however uneven the loss masks.
///
/// A step is [`begin_step`](Self::begin_step) (with the step's counted tokens) → any number of
/// [`accumulate`](Self::accumulate) / [`accumulate_prescaled`](Self::accumulate_prescaled) /
/// [`accumulate_in_place`](Self::accumulate_in_place) → [`finish_step`](Self::finish_step).
/// The buffers are allocated once, in [`new`](Self::new), under
/// [`MemoryCategory::Gradients`], and reused by every step.
///
/// Why weight by tokens: the popular "divide each micro-batch's mean loss by the number of
/// micro-batches" gives every micro-batch the same weight, so tokens in sparse micro-batches
/// count more than tokens in dense ones. Dividing every token's loss gradient by the step's
/// total count gives each token the weight `1 / total` it has in the big batch.
pub struct GradAccumulator<B: Backend> {
    backend: B,
    grads: Vec<B::Tensor>,
    phase: Phase,
}

impl<B: Backend> std::fmt::Debug for GradAccumulator<B>
where
    B: std::fmt::Debug,
    B::Tensor: std::fmt::Debug,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradAccumulator")
            .field("backend", &self.backend)
            .field("grads", &self.grads)
            .field("phase", &self.phase)
            .finish()
    }
}

impl<B: Backend> GradAccumulator<B> {
    /// Allocate one zeroed f32 buffer per parameter shape, tagged
    /// [`MemoryCategory::Gradients`].
    pub fn new<S: Into<Shape>>(backend: B, shapes: impl IntoIterator<Item = S>) -> Result<Self> {
        let grads = {
            let _tag = MemoryCategory::Gradients.enter();
            shapes
                .into_iter()
                .map(|s| backend.zeros(s, DType::F32))
                .collect::<headroom_tensor::Result<Vec<_>>>()?
        };
        if grads.is_empty() {
            return Err(AccumError::NoParameters);
        }
        Ok(GradAccumulator {
            backend,
            grads,
            phase: Phase::Idle { dirty: false },
        })
    }

    /// The backend the buffers live on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The gradient buffers, in parameter order. After an applied step they hold the step's
    /// gradients; after a skipped one, zeros; during a step, the partial sum.
    pub fn gradients(&self) -> &[B::Tensor] {
        &self.grads
    }

    /// The buffers, mutably: for an optimizer that consumes them, or for a data-parallel
    /// all-reduce between the last micro-batch and [`finish_step`](Self::finish_step).
    pub fn gradients_mut(&mut self) -> &mut [B::Tensor] {
        &mut self.grads
    }

    /// Bytes held by the buffers.
    pub fn buffer_bytes(&self) -> usize {
        self.grads.iter().map(Tensor::size_in_bytes).sum()
    }

    /// True between `begin_step` and `finish_step`/`abandon_step`.
    pub fn in_step(&self) -> bool {
        matches!(self.phase, Phase::Accumulating { .. })
    }

    /// The current step's token counts, if a step is in progress.
    pub fn step_tokens(&self) -> Option<StepTokens> {
        match self.phase {
            Phase::Accumulating { tokens, .. } => Some(tokens),
            Phase::Idle { .. } => None,
        }
    }

    /// Start a step whose counted tokens are `tokens`; the buffers are zeroed if they hold
    /// the previous step's gradients.
    pub fn begin_step(&mut self, tokens: StepTokens) -> Result<()> {
        match self.phase {
            Phase::Accumulating { .. } => return Err(AccumError::StepInProgress),
            Phase::Idle { dirty: true } => self.zero_buffers()?,
            Phase::Idle { dirty: false } => {}
        }
        self.phase = Phase::Accumulating {
            tokens,
            counted: 0,
            loss_sum: 0.0,
            micro_batches: 0,
        };
        Ok(())
    }

    /// Add a micro-batch's gradients of its *summed* loss (each counted token's loss gradient
    /// seeded with 1, times the loss scale if any): they are added with weight `1 / global`.
    /// Gradients may be f32, f16 or bf16; shapes must match the buffers. On error nothing
    /// changes.
    pub fn accumulate<'g>(
        &mut self,
        grads: impl IntoIterator<Item = &'g B::Tensor>,
        stats: MicroBatchStats,
    ) -> Result<()>
    where
        B::Tensor: 'g,
    {
        let tokens = self.check_micro_batch(&stats)?;
        self.add(grads, tokens.loss_grad_weight(), stats)
    }

    /// Add a micro-batch's gradients that are already normalised: the caller seeded each
    /// counted token's loss gradient with [`StepTokens::loss_grad_weight`] (times the loss
    /// scale), as `loss = Σ losses / global; loss.backward()` would. They are added with
    /// weight 1. On error nothing changes.
    pub fn accumulate_prescaled<'g>(
        &mut self,
        grads: impl IntoIterator<Item = &'g B::Tensor>,
        stats: MicroBatchStats,
    ) -> Result<()>
    where
        B::Tensor: 'g,
    {
        self.check_micro_batch(&stats)?;
        self.add(grads, 1.0, stats)
    }

    /// Run a backward pass that adds straight into the buffers, so no second copy of the
    /// gradients ever exists. `backward(backend, buffers, weight)` must *add* the gradient of
    /// `weight × Σ counted losses` (times the loss scale, if any) to the buffers, where
    /// `weight` is [`StepTokens::loss_grad_weight`].
    ///
    /// If `backward` fails the buffers may hold part of this micro-batch: the error is
    /// [`AccumError::Backward`] and the step should be abandoned.
    pub fn accumulate_in_place<E: Into<BoxedError>>(
        &mut self,
        stats: MicroBatchStats,
        backward: impl FnOnce(&B, &mut [B::Tensor], f32) -> Result<(), E>,
    ) -> Result<()> {
        let tokens = self.check_micro_batch(&stats)?;
        backward(&self.backend, &mut self.grads, tokens.loss_grad_weight())
            .map_err(|e| AccumError::Backward(e.into()))?;
        self.record(stats);
        Ok(())
    }

    /// End the step: check that every declared token was accumulated, unscale exactly once
    /// through `unscaler`, skip (and zero the buffers) on non-finite values, otherwise compute
    /// the global norm in f64 and clip to `max_grad_norm` if given. `unscaler.update` is called
    /// once with the verdict.
    ///
    /// A token-count mismatch or an invalid `max_grad_norm` is returned before anything is
    /// touched, with the step still in progress. An `unscale_and_check` error leaves the
    /// buffers in an unknown state: call [`abandon_step`](Self::abandon_step). An `update`
    /// error ([`AccumError::ScalerUpdate`]) comes after the step completed: the buffers hold
    /// the clipped gradients, or zeros if non-finite values were found.
    pub fn finish_step<U: GradUnscaler<B>>(
        &mut self,
        unscaler: &mut U,
        max_grad_norm: Option<f64>,
    ) -> Result<StepReport> {
        let Phase::Accumulating {
            tokens,
            counted,
            loss_sum,
            micro_batches,
        } = self.phase
        else {
            return Err(AccumError::NoStepInProgress);
        };
        if let Some(m) = max_grad_norm {
            check_max_norm(m)?;
        }
        if counted != tokens.local {
            return Err(AccumError::TokenCountMismatch {
                declared: tokens.local,
                accumulated: counted,
            });
        }

        let mut found_non_finite = unscaler
            .unscale_and_check(&self.backend, &mut self.grads)
            .map_err(AccumError::Unscale)?;
        let mut clip = None;
        if !found_non_finite {
            let report = match max_grad_norm {
                Some(m) => clip_grad_norm(&self.backend, &mut self.grads, m)?,
                None => crate::ClipReport {
                    norm: crate::global_grad_norm(&self.backend, &self.grads)?,
                    coefficient: None,
                },
            };
            // Finite f32 values cannot overflow an f64 sum of squares, so this only fires if
            // an unscaler under-reports; it keeps a bad norm away from the optimizer anyway.
            found_non_finite = !report.norm.is_finite();
            clip = Some(report);
        }
        let outcome = match clip {
            Some(c) if !found_non_finite => StepOutcome::Applied {
                grad_norm: c.norm,
                clip_coefficient: c.coefficient,
            },
            _ => StepOutcome::Skipped,
        };
        if outcome.is_applied() {
            self.phase = Phase::Idle { dirty: true };
        } else {
            self.zero_buffers()?;
            self.phase = Phase::Idle { dirty: false };
        }
        // Last, so a refusing scaler cannot leave the accumulator mid-step: the buffers are
        // already final (applied or zeroed) when its error comes back.
        unscaler
            .update(found_non_finite)
            .map_err(AccumError::ScalerUpdate)?;
        Ok(StepReport {
            loss: loss_sum / tokens.global as f64,
            counted_tokens: counted,
            micro_batches,
            outcome,
        })
    }

    /// Drop the step in progress (if any) and zero the buffers.
    pub fn abandon_step(&mut self) -> Result<()> {
        self.zero_buffers()?;
        self.phase = Phase::Idle { dirty: false };
        Ok(())
    }

    fn zero_buffers(&mut self) -> Result<()> {
        for g in &mut self.grads {
            self.backend.fill_zero(g)?;
        }
        Ok(())
    }

    fn check_micro_batch(&self, stats: &MicroBatchStats) -> Result<StepTokens> {
        let Phase::Accumulating {
            tokens, counted, ..
        } = self.phase
        else {
            return Err(AccumError::NoStepInProgress);
        };
        let exceeded = counted
            .checked_add(stats.counted_tokens)
            .is_none_or(|sum| sum > tokens.local);
        if exceeded {
            return Err(AccumError::TokenCountExceeded {
                declared: tokens.local,
                accumulated: counted,
                adding: stats.counted_tokens,
            });
        }
        Ok(tokens)
    }

    fn record(&mut self, stats: MicroBatchStats) {
        if let Phase::Accumulating {
            counted,
            loss_sum,
            micro_batches,
            ..
        } = &mut self.phase
        {
            *counted += stats.counted_tokens;
            *loss_sum += stats.loss_sum;
            *micro_batches += 1;
        }
    }

    fn add<'g>(
        &mut self,
        grads: impl IntoIterator<Item = &'g B::Tensor>,
        weight: f32,
        stats: MicroBatchStats,
    ) -> Result<()>
    where
        B::Tensor: 'g,
    {
        let grads: Vec<&B::Tensor> = grads.into_iter().collect();
        // Validate everything before adding anything, so an error loses nothing.
        if grads.len() != self.grads.len() {
            return Err(AccumError::GradientCount {
                expected: self.grads.len(),
                got: grads.len(),
            });
        }
        for (index, (g, buf)) in grads.iter().zip(&self.grads).enumerate() {
            if g.shape() != buf.shape() {
                return Err(AccumError::GradientShape {
                    index,
                    expected: buf.shape().clone(),
                    got: g.shape().clone(),
                });
            }
            if !matches!(g.dtype(), DType::F32 | DType::F16 | DType::BF16) {
                return Err(AccumError::GradientDType {
                    index,
                    dtype: g.dtype(),
                });
            }
        }
        for (g, buf) in grads.into_iter().zip(&mut self.grads) {
            self.backend.axpy(weight, g, buf)?;
        }
        self.record(stats);
        Ok(())
    }
}
