//! Typed errors: [`CommError`] for collectives, [`ZeroError`] for partitioning and the engine.

use std::time::Duration;

use headroom_tensor::BoxedError;

use crate::collective::CommKind;

/// A collective operation failed. Every variant is final for the group: once one rank has
/// seen an error, the group refuses further operations rather than risk a hang.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A rank whose contribution this operation needs has left the group (its communicator
    /// was dropped, for example because its thread panicked or returned early).
    #[error("{op}: rank {rank} left the group before contributing")]
    PeerLost {
        /// The operation that could not complete.
        op: CommKind,
        /// The rank that left.
        rank: usize,
    },
    /// The operation waited longer than the group's time-out for other ranks.
    #[error("{op}: timed out after {waited:?} waiting for ranks {missing:?}")]
    Timeout {
        /// The operation that could not complete.
        op: CommKind,
        /// How long it waited.
        waited: Duration,
        /// The ranks that had not contributed.
        missing: Vec<usize>,
    },
    /// The ranks called different operations, or the same operation with different sizes,
    /// dtypes or roots, as the same step of the group's sequence.
    #[error("{op}: ranks disagree on the operation: {detail}")]
    Mismatch {
        /// The operation this rank called.
        op: CommKind,
        /// What differed.
        detail: String,
    },
    /// The buffers handed to an operation have the wrong lengths for the world size.
    #[error("{op}: {what}: expected {expected} elements, got {got}")]
    Length {
        /// The operation.
        op: CommKind,
        /// Which buffer.
        what: &'static str,
        /// The length the world size requires.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// Input and output buffers of one operation have different element types.
    #[error("{op}: input and output element types differ")]
    DTypeMismatch {
        /// The operation.
        op: CommKind,
    },
    /// A root rank outside `0..world`.
    #[error("{op}: root {root} is not a rank of a group of {world}")]
    InvalidRoot {
        /// The operation.
        op: CommKind,
        /// The root given.
        root: usize,
        /// The group size.
        world: usize,
    },
    /// A group of zero ranks was requested.
    #[error("a group needs at least one rank")]
    EmptyGroup,
    /// The communicator was not set up within the time-out: another rank failed to join or
    /// never started (NCCL, for one, waits in its set-up for every rank).
    #[error("{backend}: the group did not form within {waited:?} (a rank failed to join or never started)")]
    SetupTimeout {
        /// The collective implementation.
        backend: &'static str,
        /// How long this rank waited.
        waited: Duration,
    },
    /// An earlier error broke the group; nothing more can be exchanged on it.
    #[error("the group failed earlier: {reason}")]
    GroupFailed {
        /// What broke it.
        reason: String,
    },
    /// A lock was poisoned by a panicking thread.
    #[error("a thread panicked while holding the group's state")]
    Poisoned,
    /// The communication thread panicked running an operation.
    #[error("the communication thread panicked: {message}")]
    Panicked {
        /// The panic message, if it was a string.
        message: String,
    },
    /// The communication thread is gone (it could not be started, or it exited).
    #[error("the communication thread is not running")]
    ThreadLost,
    /// A failure inside a collective implementation (MPI, NCCL, …).
    #[error("collective backend failed: {source}")]
    Backend {
        /// The implementation's error.
        #[source]
        source: BoxedError,
    },
}

/// An error from partitioning or the [`ZeroEngine`](crate::ZeroEngine).
#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A tensor allocation or access failed (including a budget refusal).
    #[error(transparent)]
    Tensor(#[from] headroom_tensor::Error),
    /// The optimizer returned an error.
    #[error("optimizer failed on layer {layer}, tensor {tensor}: {source}")]
    Optimizer {
        /// Layer of the failing piece.
        layer: usize,
        /// Tensor within the layer.
        tensor: usize,
        /// The optimizer's error.
        #[source]
        source: BoxedError,
    },
    /// A size computation overflowed `usize`.
    #[error("size overflow: {what}")]
    SizeOverflow {
        /// What was being computed.
        what: &'static str,
    },
    /// The configuration or layout is not usable.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A layer index outside the model.
    #[error("layer {layer} out of range (the model has {layers} layers)")]
    LayerOutOfRange {
        /// The index given.
        layer: usize,
        /// Number of layers.
        layers: usize,
    },
    /// Data for a layer has the wrong number of tensors or a tensor the wrong length.
    #[error("layer {layer}: {what}: expected {expected}, got {got}")]
    Shape {
        /// The layer.
        layer: usize,
        /// What was wrong.
        what: &'static str,
        /// The expected count.
        expected: usize,
        /// The count given.
        got: usize,
    },
    /// Stage 3: the layer's parameters were asked for without being gathered.
    #[error("layer {layer}: parameters are not gathered (call gather first)")]
    NotGathered {
        /// The layer.
        layer: usize,
    },
    /// A layer's gradients were pushed twice in one micro-batch.
    #[error("layer {layer}: gradients already pushed in this micro-batch")]
    GradsPushedTwice {
        /// The layer.
        layer: usize,
    },
    /// `step` was called in the middle of a micro-batch's backward.
    #[error("step called with a micro-batch half done: layers {missing:?} have no gradients")]
    IncompleteBackward {
        /// Layers whose gradients were not pushed.
        missing: Vec<usize>,
    },
    /// `step` was called with no gradients accumulated since the last step.
    #[error("step called with no micro-batch since the last step")]
    NoGradients,
    /// The optimizer's state size changed between steps.
    #[error("optimizer state per parameter changed from {was} to {now}")]
    OptimizerStateChanged {
        /// Floats per parameter at the first step.
        was: usize,
        /// Floats per parameter now.
        now: usize,
    },
    /// Parameters were asked for in a precision the engine does not keep them in.
    #[error("parameters asked for as {wanted:?}, but the engine runs in {engine:?}")]
    Precision {
        /// The precision asked for.
        wanted: crate::Precision,
        /// The engine's precision.
        engine: crate::Precision,
    },
    /// An earlier failure left the engine without one of its buffers.
    #[error("the engine is unusable after an earlier failure")]
    Broken,
}

/// Result with a [`ZeroError`].
pub type Result<T, E = ZeroError> = std::result::Result<T, E>;
