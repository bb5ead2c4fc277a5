//! The extension trait every backend implements, and what forward and backward return.

use headroom_tensor::Backend;

use crate::{AttentionConfig, AttentionDims, Result};

/// What a forward pass returns: the output, and the state its backward needs.
///
/// Memory categories: `output` is allocated in the caller's current
/// [`MemoryCategory`](headroom_tensor::MemoryCategory); `logsumexp` and naive's `probs` (state
/// kept only for backward) are tagged `Activations`; temporaries inside the call are tagged
/// `Workspace` and freed before it returns.
#[derive(Debug)]
pub struct AttentionForward<T> {
    /// `[batch, q_heads, q_len, head_dim]`, the dtype of `q`.
    pub output: T,
    /// Per-row natural-log sum of exp of the scaled, masked scores, `[batch, q_heads, q_len]`
    /// f32; `-inf` for a row that sees no key.
    pub logsumexp: T,
    /// Naive attention's softmax probabilities `[batch, q_heads, q_len, kv_len]` f32, kept for
    /// its backward (this is the O(N²) activation the other algorithms avoid); `None` for
    /// chunked and flash.
    pub probs: Option<T>,
    /// The config the forward ran with; backward runs the same algorithm.
    pub config: AttentionConfig,
    /// The sizes the forward ran with; backward checks its inputs against them.
    pub dims: AttentionDims,
}

/// The gradients of attention with respect to its three inputs, in their dtypes and shapes.
/// Allocated in the caller's current memory category.
#[derive(Debug)]
pub struct AttentionGradients<T> {
    /// Gradient of `q`.
    pub dq: T,
    /// Gradient of `k` (summed over the query heads sharing each key head).
    pub dk: T,
    /// Gradient of `v` (summed over the query heads sharing each value head).
    pub dv: T,
}

/// Attention as an extension of a [`Backend`]: implemented by the CPU backend here, and by the
/// CUDA backend behind the `cuda` feature.
///
/// Inputs are `[batch, heads, seq, head_dim]` (see [`AttentionDims`]); `softmax(scale·Q·Kᵀ
/// + mask)·V` is computed with f32 accumulation whatever the input dtype.
pub trait AttentionBackend: Backend {
    /// `softmax(scale·Q·Kᵀ + mask)·V`, plus what backward needs.
    fn attention_forward(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        config: &AttentionConfig,
    ) -> Result<AttentionForward<Self::Tensor>>;

    /// Gradients of the forward's inputs given `d_out`, the gradient of its output (shape and
    /// dtype of `q`). `q`, `k`, `v` must be the forward's inputs, unchanged.
    fn attention_backward(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        forward: &AttentionForward<Self::Tensor>,
        d_out: &Self::Tensor,
    ) -> Result<AttentionGradients<Self::Tensor>>;
}
