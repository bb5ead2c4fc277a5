//! The typed errors of this crate: every bad shape, dtype or configuration is reported here
//! before any memory is allocated or any output is written.

use headroom_tensor::{DType, Shape};

/// Everything attention can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttnError {
    /// A tensor is not `[batch, heads, seq, head_dim]`.
    #[error("{tensor}: expected a rank-4 [batch, heads, seq, head_dim] tensor, got shape {shape}")]
    NotRank4 {
        /// Which argument (`"q"`, `"k"`, `"v"`, `"d_out"`, …).
        tensor: &'static str,
        /// Its shape.
        shape: Shape,
    },
    /// A tensor's shape disagrees with the shapes it must match.
    #[error("{tensor}: expected shape {expected}, got {got} ({reason})")]
    ShapeMismatch {
        /// Which argument.
        tensor: &'static str,
        /// The shape it must have.
        expected: Shape,
        /// The shape it has.
        got: Shape,
        /// What relation is broken.
        reason: &'static str,
    },
    /// Query heads are not a whole multiple of key/value heads (GQA/MQA needs a divisor).
    #[error("query heads ({q_heads}) must be a positive multiple of key/value heads ({kv_heads})")]
    HeadGrouping {
        /// Heads of `q`.
        q_heads: usize,
        /// Heads of `k` and `v`.
        kv_heads: usize,
    },
    /// `head_dim` is 0 or larger than [`MAX_HEAD_DIM`](crate::MAX_HEAD_DIM).
    #[error("head_dim {head_dim} is outside 1..={max}")]
    HeadDim {
        /// The head dimension given.
        head_dim: usize,
        /// The largest supported head dimension.
        max: usize,
    },
    /// Two tensors that must share a dtype do not.
    #[error("{tensor}: expected dtype {expected}, got {got}")]
    DTypeMismatch {
        /// Which argument.
        tensor: &'static str,
        /// The dtype of `q` (or the dtype the argument must have).
        expected: DType,
        /// The dtype given.
        got: DType,
    },
    /// Attention computes on f32 or bf16 inputs only.
    #[error("unsupported dtype {0}: attention takes f32 or bf16 inputs")]
    UnsupportedDType(DType),
    /// A configuration value is out of range (zero chunk or tile size, non-finite scale).
    #[error("invalid attention config: {0}")]
    InvalidConfig(&'static str),
    /// The inputs handed to backward are not those the forward state was made from (shape,
    /// dtype or algorithm disagree).
    #[error("backward: {0}")]
    ForwardMismatch(&'static str),
    /// The tensor backend failed (allocation refused by a hook, out of memory, …).
    #[error(transparent)]
    Tensor(#[from] headroom_tensor::Error),
    /// A kernel's internal bounds check failed. This is a bug in headroom-attn, reported as an
    /// error rather than a panic so the caller keeps control.
    #[error("internal error in {0}: operand out of bounds (please report)")]
    Internal(&'static str),
}

/// `Result` with [`AttnError`].
pub type Result<T, E = AttnError> = std::result::Result<T, E>;
