//! The crate's error type: every way a plan, a step or a gradient can be wrong.

use headroom_tensor::{BoxedError, DType, Shape};

/// Everything that can go wrong while planning micro-batches or accumulating a step.
///
/// An operation that returns an error has changed nothing (buffers, counts and phase are as
/// they were), except where a variant says otherwise.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AccumError {
    /// A backend operation failed.
    #[error(transparent)]
    Tensor(#[from] headroom_tensor::Error),

    /// A micro-batch plan was asked for a batch with no sequences.
    #[error("the batch holds no sequences")]
    EmptyBatch,
    /// A micro-batch size of zero sequences.
    #[error("a micro-batch must hold at least one sequence")]
    ZeroMicroBatchSize,
    /// A token budget of zero.
    #[error("the token budget of a micro-batch must be positive")]
    ZeroTokenBudget,
    /// One sequence alone is longer than the token budget, so no micro-batch can hold it.
    #[error(
        "sequence {index} has {tokens} tokens, more than the micro-batch token budget of {budget}"
    )]
    SequenceOverBudget {
        /// Index of the sequence in the batch.
        index: usize,
        /// Its length in tokens.
        tokens: usize,
        /// The budget.
        budget: usize,
    },
    /// A sequence claims more counted (unmasked) tokens than it has tokens.
    #[error("sequence {index} counts {counted} loss tokens but has only {tokens} tokens")]
    CountedExceedsLength {
        /// Index of the sequence in the batch.
        index: usize,
        /// Its length in tokens.
        tokens: usize,
        /// Its claimed counted tokens.
        counted: u64,
    },

    /// The accumulator was created with no parameter shapes.
    #[error("an accumulator needs at least one gradient buffer")]
    NoParameters,
    /// A micro-batch supplied a different number of gradient tensors than there are buffers.
    #[error("expected {expected} gradient tensors, got {got}")]
    GradientCount {
        /// Number of accumulator buffers.
        expected: usize,
        /// Number of gradients supplied.
        got: usize,
    },
    /// A gradient's shape differs from its buffer's.
    #[error("gradient {index}: shape {got} differs from its buffer's {expected}")]
    GradientShape {
        /// Position of the gradient.
        index: usize,
        /// The buffer's shape.
        expected: Shape,
        /// The gradient's shape.
        got: Shape,
    },
    /// A gradient is not f32, f16 or bf16.
    #[error("gradient {index}: dtype {dtype} is not a float type (f32, f16 or bf16)")]
    GradientDType {
        /// Position of the gradient.
        index: usize,
        /// Its dtype.
        dtype: DType,
    },

    /// A step operation was called with no step in progress.
    #[error("no step in progress: call begin_step first")]
    NoStepInProgress,
    /// `begin_step` was called while a step was in progress.
    #[error("a step is already in progress: finish or abandon it first")]
    StepInProgress,
    /// The step's global count of counted tokens is zero, so the mean loss is undefined.
    #[error("the step counts no loss tokens anywhere, so its mean loss is undefined")]
    ZeroGlobalTokens,
    /// This device's share of counted tokens exceeds the global count.
    #[error("local counted tokens ({local}) exceed the global count ({global})")]
    LocalExceedsGlobal {
        /// Tokens counted on this device.
        local: u64,
        /// Tokens counted on all devices.
        global: u64,
    },
    /// A micro-batch would take the step past the counted tokens it declared.
    #[error("micro-batch adds {adding} counted tokens to {accumulated}, past the {declared} the step declared")]
    TokenCountExceeded {
        /// Tokens declared for this device at `begin_step`.
        declared: u64,
        /// Tokens accumulated so far.
        accumulated: u64,
        /// Tokens the rejected micro-batch counts.
        adding: u64,
    },
    /// The step was finished with fewer counted tokens than it declared: a micro-batch is
    /// missing, so the normalisation would be wrong.
    #[error(
        "the step declared {declared} counted tokens but its micro-batches counted {accumulated}"
    )]
    TokenCountMismatch {
        /// Tokens declared for this device at `begin_step`.
        declared: u64,
        /// Tokens accumulated.
        accumulated: u64,
    },
    /// A clipping threshold that is not a positive finite number.
    #[error("max_norm must be positive and finite, got {0}")]
    InvalidMaxNorm(f64),
    /// The loss scaler failed while unscaling. The buffers may have been partly unscaled:
    /// abandon the step.
    #[error("the loss scaler failed to unscale the gradients")]
    Unscale(#[source] BoxedError),
    /// The loss scaler refused the step's verdict in `update`. The step itself completed.
    #[error("the loss scaler failed to update after the step")]
    ScalerUpdate(#[source] BoxedError),
    /// The caller's backward pass failed inside
    /// [`GradAccumulator::accumulate_in_place`](crate::GradAccumulator::accumulate_in_place).
    /// The buffers may hold part of that micro-batch: abandon the step.
    #[error("the backward pass of a micro-batch failed")]
    Backward(#[source] BoxedError),
}

/// `Result` with [`AccumError`].
pub type Result<T, E = AccumError> = std::result::Result<T, E>;
