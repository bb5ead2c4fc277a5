//! # headroom-lora
//!
//! LoRA adapters (Hu et al. 2021) over any frozen linear layer: the base weight never gets a
//! gradient, only the low-rank update `scaling · B·A` trains. Initialisation, scaling
//! (rsLoRA included), target matching and the file format are PEFT's, so adapters move
//! between headroom and Python both ways.
//!
//! ```
//! use headroom_lora::{DenseLinear, LoraConfig, LoraLinear, Mode, WeightLayout};
//! use headroom_tensor::Cpu;
//!
//! # fn main() -> headroom_lora::Result<()> {
//! let cpu = Cpu::new();
//! let (out_f, in_f, rows) = (3, 4, 2);
//! let weight: Vec<f32> = (0..out_f * in_f).map(|i| i as f32 / 10.0).collect();
//! let base = DenseLinear::new(&weight, None, out_f, in_f)?;
//!
//! let config = LoraConfig::new(2, 4.0, ["q_proj"]); // r = 2, alpha = 4: scaling 2
//! assert!(config.matches("model.layers.0.self_attn.q_proj"));
//! let mut lora = LoraLinear::new(&cpu, "model.layers.0.self_attn.q_proj", out_f, in_f, &config)?;
//!
//! // B starts at zero, so the adapted layer is the base, bit for bit.
//! let x = [0.5f32, -1.0, 2.0, 0.25, 1.0, 0.0, -0.5, 3.0];
//! let mut y = vec![0.0; rows * out_f];
//! let saved = lora.forward(&base, &x, &mut y, rows, Mode::Train { step: 0, micro_batch: 0 })?;
//! let mut y_base = vec![0.0; rows * out_f];
//! headroom_lora::FrozenLinear::forward(&base, &x, &mut y_base, rows).unwrap();
//! assert_eq!(y, y_base);
//!
//! // Backward: gradients for A and B only, and the input gradient.
//! let mut grads = lora.alloc_grads()?;
//! let dy = vec![1.0f32; rows * out_f];
//! let mut dx = vec![0.0; rows * in_f];
//! lora.backward(&base, &saved, &x, &dy, &mut dx, &mut grads)?;
//! assert!(grads.b.as_slice::<f32>()?.iter().any(|&g| g != 0.0)); // dB ≠ 0 even with B = 0
//!
//! // Merge the update into a copy of the weight and back.
//! lora.params_mut().1.fill(0.1);
//! let mut merged = weight.clone();
//! lora.merge_into(&mut merged, WeightLayout::OutIn)?;
//! lora.unmerge_from(&mut merged, WeightLayout::OutIn)?;
//! assert!(merged.iter().zip(&weight).all(|(a, b)| (a - b).abs() <= 1e-6));
//! # Ok(())
//! # }
//! ```
//!
//! ## Pieces
//! - [`FrozenLinear`]: the base's contract (forward `y = x·Wᵀ (+ b)`, input gradient
//!   `dx += dy·W`, never a weight gradient); [`DenseLinear`] implements it for an f32 weight.
//!   The trainer implements it for bf16 working weights and NF4 quantized weights.
//! - [`LoraConfig`]: rank, alpha, rsLoRA, dropout, target modules (PEFT's suffix rule), seed.
//! - [`LoraLinear`]: one adapter — PEFT's initialisation from the seed, forward / backward
//!   with a deterministic dropout mask, merge / unmerge; [`LoraGrads`], [`LoraSaved`].
//! - [`LoraAdapter`]: a model's adapters, PEFT's file format ([`LoraAdapter::load`],
//!   [`LoraAdapter::save`]), memory sizing ([`AdapterMemory`]).
//!
//! ## Invariants
//! - Depends on headroom-tensor only (no other technique crate).
//! - Adapter parameters are `Parameters`, their gradients `Gradients`, optimizer moments
//!   `OptimizerState`, the kept `h = dropout(x)·Aᵀ` `Activations` (`rows · r` f32), scratch
//!   `Workspace` — all allocated through the [`Cpu`](headroom_tensor::Cpu) backend, so its
//!   hook counts them. Nothing of the base weight's size is ever allocated.
//! - With B = 0 the adapted output equals the base output bit for bit.
//! - Dropout is a pure function of (seed, step, micro-batch, module name, element index):
//!   identical in forward, backward and any recomputation; the same for any thread count.
//! - Results are bitwise reproducible for any thread count (gemm never splits the inner
//!   dimension; element-wise work is per element).
//! - Malformed adapters (JSON, safetensors, names, dtypes, shapes, ranks) are a
//!   [`LoraError`], never a panic; no size from a file reaches an allocation unchecked.

mod adapter;
mod config;
mod error;
mod frozen;
mod gemm;
mod linear;
mod peft;
mod rng;

pub use adapter::{AdapterMemory, LoraAdapter, ModuleShape};
pub use config::{LoraConfig, MAX_RANK};
pub use error::{LoraError, Result};
pub use frozen::{DenseLinear, FrozenLinear};
pub use linear::{DropoutMask, LoraGrads, LoraLinear, LoraSaved, Mode, WeightLayout};
pub use peft::{
    parse_peft_config, parse_peft_tensor_name, peft_config_json, peft_tensor_name, LoraMatrix,
    CONFIG_FILE, MAX_CONFIG_BYTES, MAX_WEIGHTS_BYTES, TENSOR_PREFIX, WEIGHTS_FILE,
};
