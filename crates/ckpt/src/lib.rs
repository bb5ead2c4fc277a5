//! # headroom-ckpt
//!
//! Activation checkpointing for chains of layers with an explicit forward and backward: the
//! layer contract ([`Layer`]), schedules ([`Schedule`]: store-all, checkpoint lists, every-k,
//! √n, Revolve's binomial schedule, or any planner-made sequence of [`Op`]s, validated before
//! it runs), the executor ([`Chain`]) that counts every saved byte, selective recomputation
//! inside a layer ([`RecomputePolicy`]), and a planner ([`Planner`]) that picks the schedule
//! with the least recomputation for a memory budget over layers of different costs.
//!
//! ```
//! use headroom_ckpt::cpu_layers::Dense;
//! use headroom_ckpt::{Chain, Planner, Schedule};
//! use headroom_tensor::{Backend, Cpu};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cpu = Cpu::new();
//! let widths = [8, 16, 16, 16, 16, 16, 16, 4];
//! let layers = widths.windows(2).enumerate().map(|(i, w)| Dense::new(w[0], w[1], i as u64)).collect();
//! let mut chain = Chain::new(layers);
//! let x = cpu.upload(&[0.5f32; 2 * 8], [2, 8])?;
//! // Loss = sum of the outputs: its gradient is all ones.
//! let loss = |y: &headroom_tensor::CpuTensor| cpu.upload(&vec![1.0f32; 2 * 4], [2, 4]);
//!
//! // Measure one store-all step, then plan for half of its peak of saved bytes.
//! let (costs, baseline) = chain.profile(&cpu, &x, loss)?;
//! let plan = Planner::default().optimal(&costs, baseline.stats.peak_saved_bytes / 2)?;
//! assert!(plan.predicted.peak_saved_bytes <= baseline.stats.peak_saved_bytes / 2);
//!
//! for layer in chain.layers_mut() { layer.zero_grads(); }
//! let out = chain.step(&cpu, &plan.schedule, &x, loss)?;
//! // The executor's measured peak is exactly the planner's prediction.
//! assert_eq!(out.stats.peak_saved_bytes, plan.predicted.peak_saved_bytes);
//! assert!(out.stats.forward_count > widths.len() - 1); // something was recomputed
//!
//! // Fixed schedules are validated too; a hand-written one that skips a layer is an error.
//! assert!(Schedule::sqrt_n(7).is_ok());
//! assert!(Schedule::new(7, vec![headroom_ckpt::Op::Backward(6)]).is_err());
//! # Ok(())
//! # }
//! ```
//!
//! ## Invariants
//! - This crate depends only on `headroom-tensor`: never on another technique crate or the
//!   trainer.
//! - Gradients (parameter and input) are bitwise the same under every schedule and every
//!   recomputation policy, given layers with deterministic kernels (property-tested with the
//!   [`cpu_layers`]).
//! - A schedule is validated completely before anything runs; an invalid one is a typed
//!   [`ScheduleError`], never a half-run chain or a panic.
//! - The executor's count of live saved bytes (checkpoints, saved states with their inputs,
//!   the activation at hand) equals what the backend's allocation hook sees allocated under
//!   [`MemoryCategory::Activations`](headroom_tensor::MemoryCategory::Activations), and equals
//!   [`Schedule::simulate`]'s prediction when the cost model holds the layers' real sizes.
//! - A [`Plan`]'s predicted peak never exceeds its budget, and its recomputation is never
//!   more than store-all's or any every-k schedule's that fits the same budget.
//! - Library code does not panic on bad input: shapes, schedules, budgets and costs are checked
//!   and reported as typed errors.

mod boxed_layer;
mod cost;
pub mod cpu_layers;
mod error;
mod executor;
mod layer;
mod meter;
mod planner;
mod revolve;
mod schedule;
mod selective;

pub use boxed_layer::{AnySaved, BoxedLayer};
pub use cost::{ChainCost, LayerCost};
pub use error::{CkptError, PlanError, ScheduleError};
pub use executor::{Chain, StepOutput};
pub use layer::{Layer, SavedState};
pub use meter::CategoryMeter;
pub use planner::{min_memory, Plan, Planner, DEFAULT_SLOTS, MAX_PLANNER_LAYERS};
pub use revolve::{revolve_forward_count, MAX_REVOLVE_LAYERS};
pub use schedule::{sqrt_segment, Op, Schedule, ScheduleStats};
pub use selective::{Intermediate, KeepMatmuls, RecomputePolicy, SaveAll, Selective};
