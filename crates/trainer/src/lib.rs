//! # headroom-trainer
//!
//! The reference GPT trainer (explicit forward and backward, every activation named) and the
//! `headroom` command. Under construction: the CPU kernels in [`ops`] exist and are
//! gradient-checked; the model, the training loop and the command arrive with the trainer issue.
//!
//! ```
//! use headroom_trainer::ops::gelu;
//! let mut out = [0.0f32; 2];
//! gelu::forward(&mut out, &[0.0, 10.0]);
//! assert_eq!(out[0], 0.0);
//! assert!((out[1] - 10.0).abs() < 1e-4);
//! ```
//!
//! ## Invariants
//! - The only crate that depends on technique crates; none depends on it.

pub mod ops;
