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
    /// Attention computes on f32, bf16 or f16 inputs only.
    #[error("unsupported dtype {0}: attention takes f32, bf16 or f16 inputs")]
    UnsupportedDType(DType),
    /// A configuration value is out of range (zero chunk or tile size, non-finite scale).
    #[error("invalid attention config: {0}")]
    InvalidConfig(&'static str),
    /// The inputs handed to backward are not those the forward state was made from (shape,
    /// dtype or algorithm disagree).
    #[error("backward: {0}")]
    ForwardMismatch(&'static str),
    /// A backend has no kernel for this otherwise valid call: the CUDA backend runs flash
    /// attention only, on bf16 inputs, for a few head dimensions, within 32-bit launch sizes,
    /// and without document masks.
    #[error("{backend} attention does not support {limit}")]
    Unsupported {
        /// The backend (`"cuda"`).
        backend: &'static str,
        /// What it lacks.
        limit: BackendLimit,
    },
    /// Position ids handed to [`DocumentMask::from_positions`](crate::DocumentMask::from_positions)
    /// are not one per position of a `batch × seq` batch.
    #[error("document mask of {batch} × {seq} positions: got {got} position ids ({reason})")]
    PositionCount {
        /// Batch rows asked for.
        batch: usize,
        /// Positions per row asked for.
        seq: usize,
        /// Position ids given.
        got: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// A position id neither starts a document (0) nor continues the previous position's
    /// (its id + 1), or a batch row does not begin with a document.
    #[error("document mask: batch row {row}, index {index}: position id {got}: {reason}")]
    PositionId {
        /// The batch row.
        row: usize,
        /// The position within the row.
        index: usize,
        /// The id found there.
        got: u32,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// A narrowed mask's first visible keys ([`DocumentMask::narrowed`](crate::DocumentMask::narrowed))
    /// decrease along a batch row, or exceed what a u32 holds.
    #[error("narrowed mask: batch row {row}, index {index}: first key {got}: {reason}")]
    MaskStart {
        /// The batch row.
        row: usize,
        /// The query within the row.
        index: usize,
        /// The first key the narrowing asked for there.
        got: usize,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// The tensor backend failed (allocation refused by a hook, out of memory, …).
    #[error(transparent)]
    Tensor(#[from] headroom_tensor::Error),
    /// A kernel's internal bounds check failed. This is a bug in headroom-attn, reported as an
    /// error rather than a panic so the caller keeps control.
    #[error("internal error in {0}: operand out of bounds (please report)")]
    Internal(&'static str),
}

/// What a backend cannot do, in [`AttnError::Unsupported`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendLimit {
    /// Only `supported` is implemented.
    Algorithm {
        /// The algorithm asked for (`Algorithm::name`).
        requested: &'static str,
        /// The one the backend implements.
        supported: &'static str,
    },
    /// Inputs of `dtype` are not taken.
    DType {
        /// The dtype given.
        dtype: DType,
        /// The dtypes the backend takes.
        supported: &'static [DType],
    },
    /// No kernel is built for `head_dim`.
    HeadDim {
        /// The head dimension given.
        head_dim: usize,
        /// The head dimensions with kernels.
        supported: &'static [usize],
    },
    /// Document (packed-sequence) masks: the backend has no kernel that reads them.
    DocumentMask,
    /// Keys and values with room past the rows read (a growing cache): the backend has no
    /// kernel that reads them in place.
    CachedKeys,
    /// A size exceeds what one kernel launch can index.
    Size {
        /// Which size.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The largest accepted.
        max: usize,
    },
    /// The device is older than the kernels need.
    ComputeCapability {
        /// The device's `(major, minor)`.
        found: (i32, i32),
        /// The oldest supported `(major, minor)`.
        required: (i32, i32),
    },
}

impl std::fmt::Display for BackendLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackendLimit::Algorithm {
                requested,
                supported,
            } => write!(f, "the {requested} algorithm (it implements {supported})"),
            BackendLimit::DType { dtype, supported } => {
                write!(f, "{dtype} inputs (it takes {supported:?})")
            }
            BackendLimit::HeadDim {
                head_dim,
                supported,
            } => write!(f, "head_dim {head_dim} (kernels exist for {supported:?})"),
            BackendLimit::DocumentMask => write!(f, "document masks (packed sequences)"),
            BackendLimit::CachedKeys => write!(f, "keys and values read in place from a cache"),
            BackendLimit::Size { what, value, max } => {
                write!(f, "{what} = {value} (at most {max})")
            }
            BackendLimit::ComputeCapability { found, required } => write!(
                f,
                "compute capability {}.{} (needs {}.{} or newer)",
                found.0, found.1, required.0, required.1
            ),
        }
    }
}

/// `Result` with [`AttnError`].
pub type Result<T, E = AttnError> = std::result::Result<T, E>;
