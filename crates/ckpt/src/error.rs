//! Typed errors: an invalid schedule, an impossible plan, a failing layer.

use crate::schedule::Op;

/// Why a schedule cannot run. Found by [`Schedule::new`](crate::Schedule::new) before anything
/// is computed, so a bad schedule never leaves a chain half-run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// A chain needs at least one layer.
    #[error("a schedule needs at least one layer")]
    EmptyChain,
    /// An operation names a layer the chain does not have.
    #[error(
        "op {op_index} ({op:?}): layer {layer} is out of range for a chain of {num_layers} layers"
    )]
    LayerOutOfRange {
        /// Position of the operation in the schedule.
        op_index: usize,
        /// The operation.
        op: Op,
        /// The layer it names.
        layer: usize,
        /// Layers in the chain.
        num_layers: usize,
    },
    /// A forward needs the input of its layer, but that activation is neither the one at hand
    /// nor a checkpoint.
    #[error(
        "op {op_index} ({op:?}): the input of layer {layer} is neither at hand nor checkpointed"
    )]
    InputUnavailable {
        /// Position of the operation.
        op_index: usize,
        /// The operation.
        op: Op,
        /// The layer whose input is missing.
        layer: usize,
    },
    /// A forward of a layer whose backward has already run (its result could never be used).
    #[error("op {op_index} ({op:?}): layer {layer} is already reversed (next backward is layer {next_backward:?})")]
    ForwardPastFrontier {
        /// Position of the operation.
        op_index: usize,
        /// The operation.
        op: Op,
        /// The layer.
        layer: usize,
        /// The next layer due for backward, `None` once all are done.
        next_backward: Option<usize>,
    },
    /// A forward of a layer whose saved state is still waiting for its backward.
    #[error("op {op_index} ({op:?}): layer {layer} already holds saved state for its backward")]
    AlreadySaved {
        /// Position of the operation.
        op_index: usize,
        /// The operation.
        op: Op,
        /// The layer.
        layer: usize,
    },
    /// Backward must run from the last layer to the first, one layer at a time.
    #[error("op {op_index} ({op:?}): backward of layer {layer}, but the next due is {expected:?}")]
    BackwardOutOfOrder {
        /// Position of the operation.
        op_index: usize,
        /// The operation.
        op: Op,
        /// The layer named.
        layer: usize,
        /// The layer due, `None` once all are done.
        expected: Option<usize>,
    },
    /// Backward of a layer that was not run with [`Op::ForwardSave`] since.
    #[error("op {op_index} ({op:?}): layer {layer} has no saved state for its backward")]
    NotSaved {
        /// Position of the operation.
        op_index: usize,
        /// The operation.
        op: Op,
        /// The layer.
        layer: usize,
    },
    /// The schedule ends before every layer's backward has run.
    #[error("the schedule ends with {remaining} layers not reversed")]
    Incomplete {
        /// Layers whose backward never ran.
        remaining: usize,
    },
    /// The schedule was built for a chain of another length.
    #[error("schedule is for {schedule} layers, the chain has {chain}")]
    LengthMismatch {
        /// Layers the schedule covers.
        schedule: usize,
        /// Layers in the chain.
        chain: usize,
    },
    /// A fixed schedule's parameter is out of its range (every-k with k = 0, a checkpoint
    /// index past the chain).
    #[error("invalid schedule parameter: {0}")]
    InvalidParameter(String),
}

/// Why the planner found no schedule.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// No schedule keeps the live saved bytes within the budget. `required` is the smallest
    /// budget for which a schedule exists.
    #[error(
        "budget of {budget} bytes is infeasible: the smallest feasible budget is {required} bytes"
    )]
    BudgetTooSmall {
        /// The budget asked for.
        budget: u64,
        /// The smallest budget that fits some schedule.
        required: u64,
    },
    /// The cost model is unusable (no layers, a negative or non-finite time, zero slots).
    #[error("invalid cost model: {0}")]
    InvalidCosts(String),
    /// The schedule built from the plan failed validation (a planner bug; reported, not
    /// panicked on).
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
}

/// Why a step over a chain failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CkptError {
    /// The schedule does not fit the chain.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// A layer's forward failed.
    #[error("forward of layer {layer} failed")]
    Forward {
        /// The layer.
        layer: usize,
        /// The backend's error.
        #[source]
        source: headroom_tensor::Error,
    },
    /// A layer's backward failed.
    #[error("backward of layer {layer} failed")]
    Backward {
        /// The layer.
        layer: usize,
        /// The backend's error.
        #[source]
        source: headroom_tensor::Error,
    },
    /// The loss closure failed.
    #[error("loss failed")]
    Loss(#[source] headroom_tensor::Error),
    /// The loss returned a gradient whose shape differs from the chain's output.
    #[error("loss gradient has shape {got}, the chain output has shape {expected}")]
    LossGradientShape {
        /// The output's shape.
        expected: headroom_tensor::Shape,
        /// The gradient's shape.
        got: headroom_tensor::Shape,
    },
    /// The executor's state disagreed with the validated schedule (a bug, reported instead of
    /// panicking).
    #[error("internal executor error: {0}")]
    Internal(&'static str),
}
