//! # headroom-attn
//!
//! Attention — `softmax(scale·Q·Kᵀ + mask)·V` — with a forward **and a backward** pass, in
//! three algorithms behind one API: naive (materialise the scores; the reference), chunked
//! (query chunks, O(N·chunk) extra memory) and flash (FlashAttention-2 tiling, O(N) extra
//! memory, backward recomputes probabilities from the saved logsumexp). Causal or not, grouped-
//! and multi-query attention, any sequence length, head_dim up to 256, f32, bf16 or f16 inputs
//! (the CUDA kernels: bf16) with f32 accumulation.
//!
//! Tensors are `[batch, heads, seq, head_dim]`, dense row-major (see [`AttentionDims`]).
//!
//! Packed sequences (several documents end to end in one row, as in packed SFT):
//! [`AttentionBackend::attention_forward_documents`] with a [`DocumentMask`] built from
//! transformers-style position ids makes each query see only the earlier keys of its own
//! document, forward and backward, on the CPU (the CUDA kernels refuse it).
//!
//! ```
//! use headroom_attn::{AttentionBackend, AttentionConfig};
//! use headroom_tensor::{Backend, Cpu};
//!
//! # fn main() -> Result<(), headroom_attn::AttnError> {
//! let cpu = Cpu::new();
//! let (batch, q_heads, kv_heads, seq, head_dim) = (1, 4, 2, 10, 8); // GQA: 2 query heads per kv head
//! let data = |n: usize, salt: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * salt).sin()).collect() };
//! let q = cpu.upload(&data(batch * q_heads * seq * head_dim, 0.3), [batch, q_heads, seq, head_dim])?;
//! let k = cpu.upload(&data(batch * kv_heads * seq * head_dim, 0.7), [batch, kv_heads, seq, head_dim])?;
//! let v = cpu.upload(&data(batch * kv_heads * seq * head_dim, 1.1), [batch, kv_heads, seq, head_dim])?;
//!
//! let flash = cpu.attention_forward(&q, &k, &v, &AttentionConfig::flash().causal(true))?;
//! let naive = cpu.attention_forward(&q, &k, &v, &AttentionConfig::naive().causal(true))?;
//! let (a, b) = (cpu.download::<f32>(&flash.output)?, cpu.download::<f32>(&naive.output)?);
//! assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-5));
//!
//! let d_out = cpu.upload(&vec![1.0f32; a.len()], [batch, q_heads, seq, head_dim])?;
//! let grads = cpu.attention_backward(&q, &k, &v, &flash, &d_out)?;
//! assert_eq!(grads.dk.shape().dims(), &[batch, kv_heads, seq, head_dim]);
//! # use headroom_tensor::Tensor;
//! # Ok(())
//! # }
//! ```
//!
//! ## Invariants
//! - This crate depends on `headroom-tensor` only (never on another technique crate); with the
//!   `cuda` feature also on `headroom-cuda` and `headroom-kernels`, and `headroom_cuda::Cuda`
//!   implements [`AttentionBackend`] with FlashAttention-2 kernels on tensor cores (bf16 inputs,
//!   head_dim 64 or 128, sm_80+; anything else is [`AttnError::Unsupported`]).
//! - Naive, chunked and flash agree up to rounding (property-tested: 1e-5 of the largest
//!   magnitude for f32, forward and all three gradients, across random shapes, causal masks and
//!   head groupings), and no result depends on chunk or tile size beyond that.
//! - Results are deterministic: the summation order depends on the shape and config only,
//!   never on the thread count or scheduling (backward sums per-segment partials of `dK`/`dV`
//!   in a fixed order instead of racing on shared accumulators).
//! - A query row that sees no key (causal with more queries than keys, or no keys) has output
//!   0, logsumexp `-inf` and gradient 0 — never NaN.
//! - Every buffer is allocated through the backend and reported to its allocation hook:
//!   results in the caller's category, saved state as `Activations`, temporaries as
//!   `Workspace`. Flash never allocates anything that grows with N².
//! - bf16 and f16 inputs to chunked and flash attention on the CPU are widened a few heads at a
//!   time (whole key/value groups, two tasks' worth per thread), never as whole-tensor f32 copies,
//!   with the bits of the f32 problem on exact copies; [`AttentionBackend::attention_backward_f32`]
//!   returns f32 gradients for a mixed-precision caller the same way. The workspace of both
//!   passes is predicted byte for byte ([`cpu_forward_workspace_bytes`],
//!   [`cpu_backward_f32_workspace_bytes`]).
//! - A document mask gives each query row `i` the keys `document_start(b, i) ≤ j ≤ i` and
//!   nothing else: every algorithm equals each document run alone through plain causal
//!   attention (property-tested, same tolerances), a mask of one document per row gives plain
//!   causal attention's bits, key tiles no query of a tile sees are skipped, and the mask
//!   allocates nothing (the workspace predictions hold unchanged).
//! - A sliding window is a mask too ([`DocumentMask::narrowed`]): each query's first visible
//!   key moves up to `position + 1 − W`, and every algorithm equals the scalar reference with
//!   exactly those keys (property-tested, with and without documents, in training shapes and
//!   cached steps).
//! - Bad shapes, dtypes or configs are a typed [`AttnError`] before anything is computed.

pub mod accuracy;
mod backend_ext;
mod config;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod dims;
mod documents;
mod error;

pub use backend_ext::{
    backward_f32_via_copies, AttentionBackend, AttentionForward, AttentionGradients,
};
pub use config::{
    Algorithm, AttentionConfig, DEFAULT_CHUNK_SIZE, DEFAULT_FLASH_BLOCK_K, DEFAULT_FLASH_BLOCK_Q,
    MAX_HEAD_DIM,
};
pub use cpu::{
    cpu_backward_f32_workspace_bytes, cpu_backward_scratch_bytes, cpu_forward_workspace_bytes,
};
#[cfg(feature = "cuda")]
pub use cuda::load_attention_kernels;
pub use dims::AttentionDims;
pub use documents::DocumentMask;
pub use error::{AttnError, BackendLimit, Result};
