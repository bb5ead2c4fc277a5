//! # headroom-trainer
//!
//! The reference GPT trainer — GPT-2's architecture with an explicit forward and backward per
//! layer, every saved activation named with its shape — and the `headroom` command.
//!
//! ```
//! use headroom_attn::AttentionConfig;
//! use headroom_tensor::Cpu;
//! use headroom_trainer::model::{params, Geometry, Gpt, GptConfig};
//!
//! # fn main() -> headroom_trainer::Result<()> {
//! let cpu = Cpu::new();
//! let cfg = GptConfig { vocab: 32, max_seq: 8, layers: 1, heads: 2, channels: 16 };
//! let gpt = Gpt::new(&cpu, cfg, AttentionConfig::flash(), 0)?;
//! let mut grads = params::alloc_like_params(&cpu, &cfg, headroom_tensor::MemoryCategory::Gradients)?;
//! let tokens: Vec<u32> = (0..16).map(|i| i % 32).collect();
//! let targets: Vec<u32> = (1..17).map(|i| i % 32).collect();
//! let loss = gpt.forward_backward(&tokens, &targets, Geometry { b: 2, t: 8 }, &mut grads, 1.0)?;
//! // An untrained model predicts roughly uniformly: loss ≈ ln(vocab).
//! assert!((loss - (32f32).ln()).abs() < 0.1);
//! # Ok(())
//! # }
//! ```
//!
//! ## Invariants
//! - The only crate that depends on technique crates; none depends on it.
//! - Every activation is allocated through the backend in a named field, so the tracker's
//!   activation bytes are exactly the model's.

pub mod checkpoint;
mod error;
pub mod model;
pub mod ops;
pub mod train;

pub use error::{Result, TrainError};
