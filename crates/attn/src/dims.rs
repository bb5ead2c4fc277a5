//! [`AttentionDims`]: the validated sizes of one attention call, and the causal mask geometry.

use headroom_tensor::{DType, Shape, Tensor};

use crate::{AttnError, Result, MAX_HEAD_DIM};

/// The sizes of one attention call, checked for consistency.
///
/// Layout: every tensor is dense row-major `[batch, heads, seq, head_dim]`; `q` has
/// `q_heads` heads of `q_len` rows, `k` and `v` have `kv_heads` heads of `kv_len` rows, and
/// query head `h` reads key/value head `h / (q_heads / kv_heads)` (grouped-query attention;
/// `kv_heads == 1` is multi-query attention).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    /// Batch size.
    pub batch: usize,
    /// Heads of `q` (and of the output).
    pub q_heads: usize,
    /// Heads of `k` and `v`; divides `q_heads`.
    pub kv_heads: usize,
    /// Query rows per head.
    pub q_len: usize,
    /// Key/value rows per head.
    pub kv_len: usize,
    /// Features per head, `1..=MAX_HEAD_DIM`.
    pub head_dim: usize,
    /// The element type shared by `q`, `k`, `v` (f32, bf16 or f16).
    pub dtype: DType,
}

fn rank4(tensor: &'static str, shape: &Shape) -> Result<[usize; 4]> {
    match shape.dims() {
        &[b, h, n, d] => Ok([b, h, n, d]),
        _ => Err(AttnError::NotRank4 {
            tensor,
            shape: shape.clone(),
        }),
    }
}

impl AttentionDims {
    /// A forward call's checks, in the order every backend runs them: the config, then the
    /// shapes and dtypes of `q`, `k`, `v`.
    pub(crate) fn of_forward<T: Tensor>(
        q: &T,
        k: &T,
        v: &T,
        config: &crate::AttentionConfig,
    ) -> Result<Self> {
        config.validate()?;
        Self::new(
            (q.shape(), q.dtype()),
            (k.shape(), k.dtype()),
            (v.shape(), v.dtype()),
        )
    }

    /// Check `q`, `k`, `v` shapes and dtypes against each other.
    pub fn new(
        q: (&Shape, DType),
        k: (&Shape, DType),
        v: (&Shape, DType),
    ) -> Result<AttentionDims> {
        let [batch, q_heads, q_len, head_dim] = rank4("q", q.0)?;
        let [kb, kv_heads, kv_len, kd] = rank4("k", k.0)?;
        rank4("v", v.0)?;
        if !matches!(q.1, DType::F32 | DType::BF16 | DType::F16) {
            return Err(AttnError::UnsupportedDType(q.1));
        }
        for (name, dtype) in [("k", k.1), ("v", v.1)] {
            if dtype != q.1 {
                return Err(AttnError::DTypeMismatch {
                    tensor: name,
                    expected: q.1,
                    got: dtype,
                });
            }
        }
        if head_dim == 0 || head_dim > MAX_HEAD_DIM {
            return Err(AttnError::HeadDim {
                head_dim,
                max: MAX_HEAD_DIM,
            });
        }
        if kb != batch || kd != head_dim {
            return Err(AttnError::ShapeMismatch {
                tensor: "k",
                expected: Shape::new(vec![batch, kv_heads, kv_len, head_dim]),
                got: k.0.clone(),
                reason: "k must share batch and head_dim with q",
            });
        }
        if v.0 != k.0 {
            return Err(AttnError::ShapeMismatch {
                tensor: "v",
                expected: k.0.clone(),
                got: v.0.clone(),
                reason: "v must have the shape of k",
            });
        }
        if kv_heads == 0 || q_heads % kv_heads != 0 {
            return Err(AttnError::HeadGrouping { q_heads, kv_heads });
        }
        Ok(AttentionDims {
            batch,
            q_heads,
            kv_heads,
            q_len,
            kv_len,
            head_dim,
            dtype: q.1,
        })
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.q_heads / self.kv_heads.max(1)
    }

    /// The shape of `q`, the output and `dQ`.
    pub fn q_shape(&self) -> Shape {
        Shape::new(vec![self.batch, self.q_heads, self.q_len, self.head_dim])
    }

    /// The shape of `k`, `v`, `dK` and `dV`.
    pub fn kv_shape(&self) -> Shape {
        Shape::new(vec![self.batch, self.kv_heads, self.kv_len, self.head_dim])
    }

    /// The shape of the saved per-row logsumexp, `[batch, q_heads, q_len]`.
    pub fn lse_shape(&self) -> Shape {
        Shape::new(vec![self.batch, self.q_heads, self.q_len])
    }

    /// The shape of naive attention's probability matrix, `[batch, q_heads, q_len, kv_len]`.
    pub fn probs_shape(&self) -> Shape {
        Shape::new(vec![self.batch, self.q_heads, self.q_len, self.kv_len])
    }

    /// How many keys (a prefix `0..n` of the key rows) query row `row` attends to.
    ///
    /// Causal masks are bottom-right aligned: row `i` sees keys `j ≤ i + kv_len − q_len`, so
    /// with `q_len > kv_len` the first rows see nothing (0).
    pub fn visible_keys(&self, row: usize, causal: bool) -> usize {
        if !causal {
            return self.kv_len;
        }
        // row + 1 + kv_len − q_len, clamped to 0..=kv_len, without signed overflow.
        (row + 1 + self.kv_len)
            .saturating_sub(self.q_len)
            .min(self.kv_len)
    }

    /// Forward FLOPs by FlashAttention's count: `4·q_len·kv_len·head_dim` per query head
    /// (two matmuls), halved when causal. Backward is counted as 2.5× this.
    pub fn forward_flops(&self, causal: bool) -> f64 {
        let full = 4.0
            * self.batch as f64
            * self.q_heads as f64
            * self.q_len as f64
            * self.kv_len as f64
            * self.head_dim as f64;
        if causal {
            full / 2.0
        } else {
            full
        }
    }
}

/// `Ok` when `t` has exactly `shape` and `dtype`, else the typed mismatch naming `tensor`.
/// Shared by every backend so they reject the same inputs with the same errors.
pub(crate) fn check_same<T: Tensor>(
    tensor: &'static str,
    t: &T,
    shape: &Shape,
    dtype: DType,
    reason: &'static str,
) -> Result<()> {
    if t.shape() != shape {
        return Err(AttnError::ShapeMismatch {
            tensor,
            expected: shape.clone(),
            got: t.shape().clone(),
            reason,
        });
    }
    if t.dtype() != dtype {
        return Err(AttnError::DTypeMismatch {
            tensor,
            expected: dtype,
            got: t.dtype(),
        });
    }
    Ok(())
}

/// The dims of a cached call ([`crate::AttentionBackend::attention_forward_cached`]) from those
/// of its stored tensors: the first `kv_len` of the rows `k` and `v` hold per head.
pub(crate) fn cached_dims(stored: AttentionDims, kv_len: usize) -> Result<AttentionDims> {
    if kv_len > stored.kv_len {
        return Err(AttnError::InvalidConfig(
            "a cached call reads more key rows than k holds per head",
        ));
    }
    Ok(AttentionDims { kv_len, ..stored })
}

/// What a document-masked call needs beyond the plain checks, in one order shared by every
/// backend: a causal config, as many keys as queries (a document's positions are both) unless
/// the mask is a padding mask, a mask of exactly `[batch, q_len]`, and hidden keys that exist.
pub(crate) fn check_documents(
    dims: &AttentionDims,
    config: &crate::AttentionConfig,
    documents: &crate::DocumentMask,
) -> Result<()> {
    if !config.causal {
        return Err(AttnError::InvalidConfig(
            "document-masked attention is causal: set config.causal",
        ));
    }
    if dims.kv_len != dims.q_len && !documents.is_padding() {
        return Err(AttnError::ShapeMismatch {
            tensor: "k",
            expected: Shape::new(vec![dims.batch, dims.kv_heads, dims.q_len, dims.head_dim]),
            got: dims.kv_shape(),
            reason: "document-masked attention needs as many keys as queries",
        });
    }
    if documents.batch() != dims.batch || documents.seq() != dims.q_len {
        return Err(AttnError::ShapeMismatch {
            tensor: "q",
            expected: Shape::new(vec![
                documents.batch(),
                dims.q_heads,
                documents.seq(),
                dims.head_dim,
            ]),
            got: dims.q_shape(),
            reason: "the document mask must cover q's [batch, seq]",
        });
    }
    if (0..dims.batch).any(|b| documents.hidden_keys(b).end > dims.kv_len) {
        return Err(AttnError::InvalidConfig(
            "a padding mask hides keys past the end of k",
        ));
    }
    Ok(())
}

/// The checks every backend's `attention_backward` makes before touching memory, in one
/// order: the config, q/k/v's shapes and dtypes, that they are the forward's, that d_out,
/// the forward output and its logsumexp have the shapes and dtypes the forward gave them, and
/// that a kept document mask fits.
pub(crate) fn check_backward_inputs<T: Tensor>(
    q: &T,
    k: &T,
    v: &T,
    forward: &crate::AttentionForward<T>,
    d_out: &T,
) -> Result<AttentionDims> {
    forward.config.validate()?;
    let dims = AttentionDims::new(
        (q.shape(), q.dtype()),
        (k.shape(), k.dtype()),
        (v.shape(), v.dtype()),
    )?;
    if dims != forward.dims {
        return Err(AttnError::ForwardMismatch(
            "q, k, v differ in shape or dtype from the forward's inputs",
        ));
    }
    let q_shape = dims.q_shape();
    check_same("d_out", d_out, &q_shape, dims.dtype, "d_out has q's shape")?;
    check_same(
        "output",
        &forward.output,
        &q_shape,
        dims.dtype,
        "the forward output has q's shape",
    )?;
    check_same(
        "logsumexp",
        &forward.logsumexp,
        &dims.lse_shape(),
        DType::F32,
        "logsumexp is [batch, q_heads, q_len] f32",
    )?;
    // The field is public: a mask swapped in after the forward must still fit, so the
    // kernels never index past it.
    if let Some(documents) = &forward.documents {
        check_documents(&dims, &forward.config, documents)?;
    }
    Ok(dims)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(q_len: usize, kv_len: usize) -> AttentionDims {
        AttentionDims {
            batch: 1,
            q_heads: 1,
            kv_heads: 1,
            q_len,
            kv_len,
            head_dim: 4,
            dtype: DType::F32,
        }
    }

    #[test]
    fn causal_mask_is_bottom_right_aligned() {
        let square = dims(4, 4);
        let seen: Vec<_> = (0..4).map(|i| square.visible_keys(i, true)).collect();
        assert_eq!(seen, [1, 2, 3, 4]);
        let more_queries = dims(5, 2);
        let seen: Vec<_> = (0..5).map(|i| more_queries.visible_keys(i, true)).collect();
        assert_eq!(seen, [0, 0, 0, 1, 2]);
        let more_keys = dims(2, 5);
        let seen: Vec<_> = (0..2).map(|i| more_keys.visible_keys(i, true)).collect();
        assert_eq!(seen, [4, 5]);
        assert_eq!(more_keys.visible_keys(0, false), 5);
    }
}
