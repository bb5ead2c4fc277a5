//! The extension trait every backend implements, and what forward and backward return.

use headroom_tensor::{Backend, DType, MemoryCategory, Tensor};

use crate::{AttentionConfig, AttentionDims, AttnError, BackendLimit, DocumentMask, Result};

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
    /// The document mask of
    /// [`attention_forward_documents`](AttentionBackend::attention_forward_documents), which
    /// the backward applies as well; `None` for plain attention.
    pub documents: Option<DocumentMask>,
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

    /// Causal attention over packed sequences: query row `i` of batch row `b` sees key `j`
    /// only when `documents.document_start(b, i) ≤ j ≤ i`, so no document attends to another
    /// packed in the same row (flash-attention's varlen, transformers' packed sequences). The
    /// forward state keeps `documents`, and [`attention_backward`](Self::attention_backward)
    /// and [`attention_backward_f32`](Self::attention_backward_f32) apply it too.
    ///
    /// A [`DocumentMask::padding`] mask instead hides a range of keys from each batch row, and
    /// its queries may be the last of more keys (a cached decode step).
    ///
    /// `config.causal` must be true, `q` and `k` must have equal lengths (unless the mask is a
    /// padding mask), and `documents` must cover `[batch, q_len]`; otherwise a typed error ([`AttnError::InvalidConfig`],
    /// [`AttnError::ShapeMismatch`]) before anything is computed. With one document per row it
    /// computes exactly what [`attention_forward`](Self::attention_forward) with a causal config does.
    ///
    /// The default refuses with [`AttnError::Unsupported`] ([`BackendLimit::DocumentMask`]);
    /// the CPU backend implements it (and skips key tiles no query of a tile can see, the
    /// compute that packing saves); the CUDA backend refuses it.
    fn attention_forward_documents(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        config: &AttentionConfig,
        documents: &DocumentMask,
    ) -> Result<AttentionForward<Self::Tensor>> {
        let _ = (q, k, v, config, documents);
        Err(AttnError::Unsupported {
            backend: std::any::type_name::<Self>(),
            limit: BackendLimit::DocumentMask,
        })
    }

    /// Inference attention over a cache with room to grow: `k` and `v` are `[batch,
    /// kv_heads, capacity, head_dim]` of which the first `kv_len` rows of each head are the
    /// keys and values (the rest is never read), so a cache appended in place needs no
    /// exact-length copy per step. With `documents` (a [`DocumentMask::padding`] mask, or
    /// packed documents when `kv_len` equals `q`'s length) it masks as
    /// [`attention_forward_documents`](Self::attention_forward_documents) does. Returns the
    /// output alone, in `q`'s dtype: nothing is kept for a backward.
    ///
    /// Equals [`attention_forward`](Self::attention_forward) (or the documents call) on
    /// tensors holding just the `kv_len` rows, bit for bit on the CPU. Errors as those calls,
    /// plus [`AttnError::InvalidConfig`] for `kv_len` past the capacity. The default refuses
    /// with [`AttnError::Unsupported`] ([`BackendLimit::CachedKeys`]): a caller copies the rows
    /// out and calls the exact-length entry (the trainer's decoding does).
    fn attention_forward_cached(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        kv_len: usize,
        config: &AttentionConfig,
        documents: Option<&DocumentMask>,
    ) -> Result<Self::Tensor> {
        let _ = (q, k, v, kv_len, config, documents);
        Err(AttnError::Unsupported {
            backend: std::any::type_name::<Self>(),
            limit: BackendLimit::CachedKeys,
        })
    }

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

    /// [`attention_backward`](Self::attention_backward) with **f32** gradients whatever the
    /// inputs' dtype, for a caller that keeps `q`, `k`, `v` and the output in bf16/f16 and
    /// accumulates gradients in f32 (mixed-precision training). `d_out` may be f32 or the
    /// inputs' dtype; the forward state is consumed, so its output can be freed as early as the
    /// backend allows. The gradients are those `attention_backward` gives on f32 copies of the
    /// inputs, bit for bit (widening is exact).
    ///
    /// The default makes those copies (`Workspace`; the kept output is freed once copied); the
    /// CPU backend reads low-precision inputs a few heads at a time instead.
    fn attention_backward_f32(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        forward: AttentionForward<Self::Tensor>,
        d_out: &Self::Tensor,
    ) -> Result<AttentionGradients<Self::Tensor>> {
        backward_f32_via_copies(self, q, k, v, forward, d_out)
    }
}

/// [`AttentionBackend::attention_backward_f32`] through whole f32 copies (`Workspace`) of what
/// is not f32: the output first (the kept one is freed as soon as it is copied), then `q`,
/// `k`, `v` and `d_out`; then [`AttentionBackend::attention_backward`] on the copies.
pub fn backward_f32_via_copies<B: AttentionBackend + ?Sized>(
    be: &B,
    q: &B::Tensor,
    k: &B::Tensor,
    v: &B::Tensor,
    forward: AttentionForward<B::Tensor>,
    d_out: &B::Tensor,
) -> Result<AttentionGradients<B::Tensor>> {
    let f32_copy = |t: &B::Tensor| -> Result<Option<B::Tensor>> {
        if t.dtype() == DType::F32 {
            return Ok(None);
        }
        let _g = MemoryCategory::Workspace.enter();
        let mut out = be.uninit(t.shape().clone(), DType::F32)?;
        be.cast(t, &mut out)?;
        Ok(Some(out))
    };
    let AttentionForward {
        output,
        logsumexp,
        probs,
        config,
        dims,
        documents,
    } = forward;
    let output = f32_copy(&output)?.unwrap_or(output);
    let (qc, kc, vc, dc) = (f32_copy(q)?, f32_copy(k)?, f32_copy(v)?, f32_copy(d_out)?);
    let forward = AttentionForward {
        output,
        logsumexp,
        probs,
        config,
        dims: AttentionDims {
            dtype: DType::F32,
            ..dims
        },
        documents,
    };
    be.attention_backward(
        qc.as_ref().unwrap_or(q),
        kc.as_ref().unwrap_or(k),
        vc.as_ref().unwrap_or(v),
        &forward,
        dc.as_ref().unwrap_or(d_out),
    )
}
