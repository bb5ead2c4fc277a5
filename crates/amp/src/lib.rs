//! # headroom-amp
//!
//! Mixed precision for any [`headroom_tensor::Backend`]: a dynamic [`LossScaler`] with PyTorch
//! `GradScaler` semantics, an explicit [`AutocastPolicy`] table, fp32 [`MasterWeights`] with
//! f16/bf16 working copies, and deterministic bf16 [`stochastic_rounding`].
//!
//! A tiny linear model trained in fp16: forward and backward read the f16 working copy and
//! produce f16 gradients of the scaled loss, the optimizer updates the f32 masters. At step 5 a
//! corrupt batch makes the f16 gradient overflow: the step is skipped, the weights stay as
//! they were and the scale halves; training then goes on and converges.
//!
//! ```
//! use headroom_amp::{
//!     AutocastPreset, LossScaler, LossScalerConfig, MasterWeights, MasterWeightsConfig,
//!     StepDecision,
//! };
//! use headroom_tensor::{f16, Backend, Cpu, DType};
//!
//! # fn main() -> Result<(), headroom_amp::AmpError> {
//! let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| a * b).sum::<f32>();
//! let target = [0.5f32, -1.0, 0.25, 2.0];
//! let xs: Vec<[f32; 4]> = (0..16)
//!     .map(|i| {
//!         let t = i as f32;
//!         [(0.7 * t).sin(), (1.3 * t).cos(), (0.4 * t).sin(), 1.0]
//!     })
//!     .collect();
//! let ys: Vec<f32> = xs.iter().map(|x| dot(x, &target)).collect();
//!
//! let cpu = Cpu::new();
//! let mut weights = MasterWeights::upload(
//!     &cpu,
//!     [([4], &[0.0f32; 4][..])],
//!     MasterWeightsConfig::preset(AutocastPreset::Fp16),
//! )?;
//! let config = LossScalerConfig { init_scale: 1024.0, ..Default::default() };
//! let mut scaler = LossScaler::new(config)?;
//! let mut master_grad = cpu.zeros([4], DType::F32)?;
//! let (lr, n) = (0.5f32, xs.len() as f32);
//! let mut losses = Vec::new();
//!
//! for step in 0..60u64 {
//!     let w: Vec<f32> = cpu
//!         .download::<f16>(weights.working(0)?)?
//!         .iter()
//!         .map(|v| v.to_f32())
//!         .collect();
//!     let mut batch = xs.clone();
//!     if step == 5 {
//!         batch[3][0] = 3.0e4; // a corrupt sample
//!     }
//!     // Forward and backward of the scaled mean squared error, gradients in f16.
//!     let (mut loss, mut grad16) = (0.0f32, [f16::ZERO; 4]);
//!     for (x, y) in batch.iter().zip(&ys) {
//!         let err = dot(x, &w) - y;
//!         loss += err * err / n;
//!         for (g, xi) in grad16.iter_mut().zip(x) {
//!             *g += f16::from_f32(scaler.scale_loss(2.0 * err * xi / n));
//!         }
//!     }
//!     losses.push(loss);
//!     let grad = cpu.upload(&grad16, [4])?;
//!     cpu.cast(&grad, &mut master_grad)?; // f16 → f32; an overflow stays ∞
//!
//!     let before = cpu.download::<f32>(&weights.masters()[0])?;
//!     match scaler.unscale(&cpu, &mut [&mut master_grad])? {
//!         StepDecision::Apply => {
//!             cpu.axpy(-lr, &master_grad, &mut weights.masters_mut()[0])?; // SGD on the masters
//!             weights.refresh(&cpu, step)?; // new f16 working copy
//!         }
//!         StepDecision::Skip => {
//!             assert_eq!(step, 5);
//!             assert!(grad16.iter().any(|g| g.is_infinite()));
//!         }
//!     }
//!     let update = scaler.update()?;
//!     if update.skipped {
//!         assert_eq!(cpu.download::<f32>(&weights.masters()[0])?, before, "weights untouched");
//!         assert_eq!((update.previous_scale, update.scale), (1024.0, 512.0));
//!     }
//! }
//!
//! assert_eq!((scaler.steps_taken(), scaler.steps_skipped()), (59, 1));
//! assert_eq!(scaler.scale(), 512.0); // no growth: 2000 clean steps are needed
//! assert!(losses[0] > 1.0);
//! assert!(losses[59] < 1e-4 * losses[0], "final loss {}", losses[59]);
//! let learned = cpu.download::<f32>(&weights.masters()[0])?;
//! for (w, t) in learned.iter().zip(&target) {
//!     assert!((w - t).abs() < 1e-2, "{learned:?}");
//! }
//! # Ok(())
//! # }
//! ```
//!
//! ## Invariants
//! - This crate depends only on `headroom-tensor` — never on another technique crate or the
//!   trainer. Device kernels beyond [`headroom_tensor::Backend`] live in the [`AmpBackend`]
//!   extension trait (CPU here; a CUDA implementation can be added without changing callers).
//! - The loss scaler follows PyTorch's rules exactly: `1/scale` is computed in f64 and rounded
//!   to f32; an overflow multiplies the scale by `backoff_factor` and resets the growth
//!   tracker; after exactly `growth_interval` consecutive clean steps the scale is multiplied
//!   by `growth_factor`, never to infinity; optional `min_scale`/`max_scale` clamp it.
//!   Unscaling twice in one step is [`AmpError::AlreadyUnscaled`], never a double division.
//!   Its state serialises, and a restored scaler continues the same trajectory.
//! - The autocast policy is a value, not a global mode; each decision depends only on the
//!   table, the op and its input dtypes.
//! - Master weights and working copies are allocated through the backend in
//!   `MemoryCategory::Parameters`: f32 costs 4 bytes/param, f16 and bf16 presets 6.
//! - Stochastic rounding never leaves the two bf16 neighbours of a value, is unbiased, keeps
//!   NaN and ±∞, and its output depends only on `(value, seed, step, tensor, index)` — never
//!   on the thread count.
//! - Bad input is a typed [`AmpError`], never a panic, and a failed call changes nothing.

mod amp_backend;
mod autocast;
mod error;
mod loss_scaler;
mod master_weights;
pub mod stochastic_rounding;

pub use amp_backend::AmpBackend;
pub use autocast::{
    AutocastDecision, AutocastPolicy, AutocastPreset, FloatDType, OpCategory, OpPrecision,
    PrecisionRule,
};
pub use error::{AmpError, Result};
pub use loss_scaler::{
    LossScaler, LossScalerConfig, LossScalerState, ScaleUpdate, StepDecision, StepPhase,
};
pub use master_weights::{MasterWeights, MasterWeightsConfig, ParameterMemory, WorkingRounding};
pub use stochastic_rounding::RoundingKey;
