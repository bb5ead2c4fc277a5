//! # headroom-trainer
//!
//! The reference trainer — GPT-2 and Llama written once over the backend's model ops, with an
//! explicit forward and backward per layer and every saved activation named with its shape —
//! and the `headroom` command.
//!
//! ```
//! use headroom_attn::AttentionConfig;
//! use headroom_tensor::Cpu;
//! use headroom_ckpt::Schedule;
//! use headroom_trainer::model::{params, Geometry, Model, ModelConfig, ModelOptions, Precision};
//! use headroom_trainer::model::Family;
//!
//! # fn main() -> headroom_trainer::Result<()> {
//! let cpu = Cpu::new();
//! // A GPT-2 shape; `ModelConfig::llama_tiny(32)` gives a Llama (RMSNorm, rotary, SwiGLU, GQA).
//! let cfg = ModelConfig { vocab: 32, max_seq: 8, layers: 4, heads: 2, channels: 16, family: Family::Gpt2 };
//! let opts = ModelOptions { attention: AttentionConfig::flash(), precision: Precision::Bf16, ..Default::default() };
//! let gpt = Model::new(&cpu, cfg, opts, 0)?;
//! let mut grads = params::alloc_like_params(&cpu, &cfg, headroom_tensor::MemoryCategory::Gradients)?;
//! let tokens: Vec<u32> = (0..16).map(|i| i % 32).collect();
//! let targets: Vec<u32> = (1..17).map(|i| i % 32).collect();
//! // Keep every second block's input, recompute the rest in backward.
//! let schedule = Schedule::every_k(cfg.layers, 2)?;
//! let g = Geometry::new(2, 8);
//! let (loss, stats) = gpt.forward_backward(&tokens, &targets, g, &mut grads, 1.0 / 16.0, &schedule)?;
//! // An untrained model predicts roughly uniformly: loss ≈ ln(vocab).
//! assert!((loss - (32f32).ln()).abs() < 0.1);
//! assert!(stats.forward_count > cfg.layers); // some blocks ran forward twice
//! # Ok(())
//! # }
//! ```
//!
//! ## Invariants
//! - Every technique is a setting of one run ([`techniques::Techniques`]); each can be switched
//!   on alone, and none changes the gradients beyond its stated numerics: checkpoint schedules
//!   and selective recomputation are bitwise, micro-batching and the fused loss differ by f32
//!   summation order, bf16/fp16 by their rounding.
//! - The only crate that depends on technique crates; none depends on it.
//! - Every activation is allocated through the backend in a named field, so the tracker's
//!   activation bytes are exactly the model's.
//! - LoRA / QLoRA ([`model::finetune`]) is the same model with its base frozen: no gradient or
//!   optimizer state exists for a frozen tensor, and with the adapters' B at zero the output is
//!   the base's bit for bit.

pub mod adapters;
mod bounded;
pub mod chat_template;
pub mod checkpoint;
pub mod choices;
pub mod cli;
pub mod companions;
pub mod completions;
pub mod corpus_metrics;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod doc_template;
pub mod engine;
pub mod environment;
mod error;
pub mod estimate;
pub mod evaluate;
pub mod generation;
pub mod hf;
pub mod ladder;
pub mod model;
pub mod ops;
pub mod pyrandom;
pub mod rolling;
pub mod sample;
pub mod techniques;
pub mod tokenize;
pub mod train;
pub mod zero_checkpoint;
pub mod zero_estimate;
pub mod zero_train;

pub use error::{Result, TrainError};
