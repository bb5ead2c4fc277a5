//! # headroom-zero
//!
//! ZeRO (DeepSpeed) for a chain of layers: the optimizer state (stage 1), the gradients
//! (stage 2) and the parameters (stage 3) are sharded across data-parallel ranks, so each
//! rank's memory falls roughly as 1/N. Ranks talk through a small [`Collective`] trait; this
//! crate ships an in-process group ([`InProcessGroup`], ranks as threads, deterministic
//! reduction order) and `headroom-zero-mpi` implements it on MPI.
//!
//! Two ranks fit `y = 2x` with one weight under stage 3, each rank on its own sample:
//!
//! ```
//! use std::time::Duration;
//! use headroom_tensor::{BoxedError, Cpu};
//! use headroom_zero::{InProcessGroup, ShardOptimizer, Stage, UpdatePiece, ZeroConfig, ZeroEngine};
//!
//! struct Sgd(f32);
//! impl ShardOptimizer for Sgd {
//!     fn state_per_param(&self) -> usize { 0 }
//!     fn update(&mut self, _: &UpdatePiece, p: &mut [f32], g: &[f32], _: &mut [f32])
//!         -> Result<(), BoxedError> {
//!         p.iter_mut().zip(g).for_each(|(p, g)| *p -= self.0 * g);
//!         Ok(())
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let comms = InProcessGroup::create(2, Duration::from_secs(30))?;
//! let threads: Vec<_> = comms.into_iter().map(|comm| std::thread::spawn(move || {
//!     let x = [1.0f32, 3.0][comm_rank(&comm)];
//!     // One layer holding one tensor of one element.
//!     let mut zero = ZeroEngine::new(Cpu::new(), comm, &[vec![1]], ZeroConfig::new(Stage::Zero3))?;
//!     zero.load_layer(0, &[&[0.0]])?;
//!     for _ in 0..50 {
//!         zero.gather(0)?;                      // full parameters, just before use
//!         let w = zero.params(0)?[0];
//!         let grad = (w * x - 2.0 * x) * x / 2.0; // mean squared error over 2 samples
//!         zero.release(0)?;                     // freed right after
//!         zero.push_grads(0, &[&[grad]])?;      // reduce-scattered over the ranks
//!         zero.step(&mut Sgd(0.1))?;            // each rank updates its shard
//!     }
//!     let w = zero.full_parameters()?[0][0];
//!     Ok::<f32, headroom_zero::ZeroError>(w)
//! })).collect();
//! # fn comm_rank(c: &headroom_zero::InProcessComm) -> usize { use headroom_zero::Collective; c.rank() }
//! for t in threads {
//!     let w = t.join().expect("rank thread")?;
//!     assert!((w - 2.0).abs() < 1e-5, "w = {w}");
//! }
//! # Ok(())
//! # }
//! ```
//!
//! ## A training step
//!
//! Every rank owns a [`ZeroEngine`] built from its communicator and the model's tensor sizes
//! per layer, and makes the same calls in the same order:
//!
//! - forward, for each layer `l`: [`gather(l)`](ZeroEngine::gather),
//!   [`prefetch(l + 1)`](ZeroEngine::prefetch), compute with
//!   [`params(l)`](ZeroEngine::params), [`release(l)`](ZeroEngine::release);
//! - backward, for each layer from the last: `gather(l)` (also before recomputing it under
//!   checkpointing), `prefetch(l - 1)`, compute, [`push_grads(l, …)`](ZeroEngine::push_grads),
//!   `release(l)`;
//! - repeat forward and backward for every micro-batch of gradient accumulation;
//! - [`step(optimizer)`](ZeroEngine::step) with a [`ShardOptimizer`].
//!
//! `gather`, `prefetch` and `release` do nothing in stages 0–2, so one loop serves every
//! stage. Collectives run on a [`CommThread`] in call order: a gradient bucket's
//! reduce-scatter and the next layer's all-gather overlap with computation.
//!
//! ## Determinism
//!
//! The in-process group sums in rank order whatever order threads arrive in, so a run is
//! bitwise reproducible, and equals one process that sums the ranks' micro-batch gradients in
//! the same order: [`Stage::reduction_order`] states that order and
//! [`ReductionOrder::reduce`] computes it. With an elementwise optimizer, updating shards
//! piece by piece gives the bits of updating whole tensors.
//!
//! ## Memory
//!
//! The engine allocates on the [`Cpu`](headroom_tensor::Cpu) backend it is given, under
//! `Parameters`, `Gradients`, `OptimizerState` and `Workspace`, so an allocation hook
//! (headroom-profiler's tracker) counts each rank exactly; [`per_rank_bytes`] is the same
//! figure computed from the layer sizes (fp32 Adam: 16, 8 + 8/N, 4 + 12/N and 16/N bytes
//! per parameter for stages 0–3, plus padding of fewer than N elements per layer).
//! [`CountingCollective`] counts the bytes each kind of collective moves.
//!
//! ## Precision
//!
//! [`ZeroConfig::precision`] is fp32 throughout ([`Precision::Fp32`], bit-exact parity with
//! one process) or [`Precision::MixedBf16`]: bf16 working parameters (gathered in bf16,
//! read with [`ZeroEngine::params_bf16`]) and bf16 gradients (reduced in bf16: f32
//! accumulation in rank order, one rounding), with fp32 masters sharded beside the optimizer
//! state, as in the ZeRO paper. Gradients are handed over in f32 either way.
//!
//! [`ZeroEngine::step_clipped`] clips to a global gradient norm taken over every rank's
//! shard. With the `cuda` feature, `NcclCollective` runs the same collectives on NCCL
//! (one process per GPU; not yet run on a GPU); [`rendezvous`] is how such processes learn
//! their rank from a launcher and share the communicator's id without MPI.

mod collective;
mod comm_thread;
mod counting;
mod engine;
mod error;
mod in_process;
mod layout;
mod memory;
#[cfg(feature = "cuda")]
mod nccl;
pub mod rendezvous;
mod stage;
mod timed_worker;

pub use collective::{
    check_scatter_gather, reference, ring_bytes, Buf, BufMut, Collective, CommDType, CommKind,
};
pub use comm_thread::{CommThread, Handle};
pub use counting::{CommCounters, CommStats, CountingCollective, KindStats};
pub use engine::{
    ShardOptimizer, ShardPiece, ShardPieceRef, StepReport, UpdatePiece, ZeroConfig, ZeroEngine,
};
pub use error::{CommError, Result, ZeroError};
pub use in_process::{InProcessComm, InProcessGroup};
pub use layout::{BucketPlan, FlatLayout, Piece};
pub use memory::{paper_bytes_per_param, per_rank_bytes, PerRankBytes, Precision};
#[cfg(feature = "cuda")]
pub use nccl::{nccl_version, NcclCollective, NcclId};
pub use stage::{ReductionOrder, Stage};
pub use timed_worker::TimedWorker;
