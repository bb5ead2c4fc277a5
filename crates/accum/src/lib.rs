//! # headroom-accum
//!
//! Gradient accumulation that is exactly equivalent to the big batch: micro-batching by
//! sequence count or token budget, token-weighted loss normalisation, and the end-of-step
//! hygiene (unscale once, skip non-finite steps, global-norm clipping in f64).
//!
//! A training loop over a batch of four sequences with uneven loss masks, one sequence per
//! micro-batch (so 2, 1, 1 and 4 counted tokens), fitting `y = 3x` with one weight:
//!
//! ```
//! use headroom_accum::{GradAccumulator, MicroBatchPlan, MicroBatchStats, NoLossScaling, SplitBy};
//! use headroom_tensor::{Backend, Cpu};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let xs = [vec![1.0f32, 2.0, 3.0], vec![0.5], vec![2.0, -1.0], vec![4.0, 1.0, 0.0, 2.0]];
//! let masks = [vec![true, true, false], vec![true], vec![false, true], vec![true; 4]];
//! let plan = MicroBatchPlan::from_loss_masks(&masks, SplitBy::Sequences(1))?;
//! assert_eq!(plan.micro_batches().len(), 4);
//! assert_eq!(plan.counted_tokens(), 8);
//!
//! let cpu = Cpu::new();
//! let mut acc = GradAccumulator::new(cpu.clone(), [[1]])?; // one f32 buffer for w
//! let mut w = 0.0f32;
//! for step in 0..40 {
//!     acc.begin_step(plan.step_tokens()?)?; // the total is known before any backward
//!     for mb in plan.micro_batches() {
//!         // Forward and backward of the *summed* squared error over counted tokens.
//!         let (mut loss_sum, mut grad) = (0.0f64, 0.0f32);
//!         for s in mb.sequences.clone() {
//!             for (&x, &counted) in xs[s].iter().zip(&masks[s]) {
//!                 if counted {
//!                     let r = w * x - 3.0 * x;
//!                     loss_sum += f64::from(0.5 * r * r);
//!                     grad += r * x;
//!                 }
//!             }
//!         }
//!         let g = cpu.upload(&[grad], [1])?;
//!         acc.accumulate([&g], MicroBatchStats { counted_tokens: mb.counted_tokens, loss_sum })?;
//!     }
//!     let report = acc.finish_step(&mut NoLossScaling, Some(10.0))?;
//!     if step == 0 {
//!         // Mean over the 8 counted tokens of the whole batch, not a mean of 4 means.
//!         let big_batch_loss = 0.5 * 9.0 * (1.0 + 4.0 + 0.25 + 1.0 + 16.0 + 1.0 + 0.0 + 4.0) / 8.0;
//!         assert!((report.loss - big_batch_loss).abs() < 1e-9);
//!     }
//!     if report.outcome.is_applied() {
//!         w -= 0.2 * acc.gradients()[0].as_slice::<f32>()?[0]; // plain SGD
//!     }
//! }
//! assert!((w - 3.0).abs() < 1e-4, "w = {w}");
//! # Ok(())
//! # }
//! ```
//!
//! ## How a step works
//!
//! 1. [`MicroBatchPlan`] cuts the batch ([`SplitBy::Sequences`] or [`SplitBy::TokenBudget`])
//!    and counts the step's counted (unmasked) tokens before anything runs.
//! 2. [`GradAccumulator::begin_step`] takes those counts as [`StepTokens`]; every micro-batch's
//!    loss gradient is weighted by `1 / global`, either by the accumulator
//!    ([`accumulate`](GradAccumulator::accumulate), gradients of the summed loss) or by the
//!    caller's seed ([`accumulate_prescaled`](GradAccumulator::accumulate_prescaled),
//!    [`accumulate_in_place`](GradAccumulator::accumulate_in_place)).
//! 3. [`GradAccumulator::finish_step`] unscales once through a [`GradUnscaler`] (the
//!    trainer adapts its loss scaler to it), skips the step and zeroes the buffers on
//!    non-finite values, and otherwise clips to a global norm ([`clip_grad_norm`]).
//!
//! ## Connecting `headroom-amp`
//!
//! This crate cannot name `headroom_amp::LossScaler`; the trainer wraps it (both traits'
//! contracts line up: unscale once, then update once):
//!
//! ```text
//! struct AmpUnscaler<'a>(&'a mut headroom_amp::LossScaler);
//! impl<B: Backend> GradUnscaler<B> for AmpUnscaler<'_> {
//!     fn unscale_and_check(&mut self, b: &B, grads: &mut [B::Tensor]) -> Result<bool, BoxedError> {
//!         let mut refs: Vec<&mut B::Tensor> = grads.iter_mut().collect();
//!         Ok(!self.0.unscale(b, &mut refs)?.should_step())
//!     }
//!     fn update(&mut self, _found_non_finite: bool) -> Result<(), BoxedError> {
//!         self.0.update()?; // the scaler remembers its own verdict
//!         Ok(())
//!     }
//! }
//! ```
//!
//! ## Invariants
//! - This crate depends only on `headroom-tensor`: never on `headroom-amp` or any other
//!   technique crate. A loss scaler joins through the [`GradUnscaler`] trait.
//! - The gradient buffers are f32, allocated once per accumulator under
//!   [`MemoryCategory::Gradients`](headroom_tensor::MemoryCategory::Gradients) and reused by
//!   every step; accumulation allocates nothing on the backend. Activation memory therefore
//!   scales with the micro-batch, never with the effective batch.
//! - For any split of a batch into micro-batches, the accumulated gradient equals the
//!   big-batch gradient of the mean loss per counted token up to f32 summation order, and the
//!   reported loss equals the big-batch mean loss (property-tested in `tests/`).
//! - The normaliser is a global token count: on several devices, summing counts and then
//!   gradients gives the single-device result.
//! - Per optimizer step the unscaler's `unscale_and_check` and `update` run exactly once each;
//!   a non-finite step is skipped and the next one starts from zeroed buffers.
//! - Clipping multiplies by exactly `max_norm / norm` (as f32) when `norm > max_norm`, and
//!   touches nothing otherwise; the norm is accumulated in f64.
//! - Bad input (wrong gradient count, shape or dtype, token counts that do not add up,
//!   out-of-budget sequences) is a typed [`AccumError`] and changes nothing.

mod accumulator;
mod clip;
mod error;
mod grad_unscaler;
mod micro_batch;

pub use accumulator::{GradAccumulator, MicroBatchStats, StepOutcome, StepReport, StepTokens};
pub use clip::{clip_grad_norm, global_grad_norm, ClipReport};
pub use error::{AccumError, Result};
pub use grad_unscaler::{GradUnscaler, NoLossScaling, StaticLossScale};
pub use micro_batch::{MicroBatch, MicroBatchPlan, SequenceTokens, SplitBy};
