//! The crate's error type.

use headroom_tensor::DType;

/// Everything headroom-amp can fail with. Every error leaves the scaler, the weights and the
/// tensors it was handed as they were before the call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmpError {
    /// The backend refused or failed an operation (allocation, dtype, length).
    #[error(transparent)]
    Tensor(#[from] headroom_tensor::Error),

    /// A loss-scaler configuration or a restored state breaks the scaler's rules.
    #[error("invalid loss scaler {what}: {reason}")]
    InvalidScaler {
        /// `"config"` or `"state"`.
        what: &'static str,
        /// Which rule it breaks.
        reason: String,
    },

    /// `unscale` was called a second time before `update`: dividing twice would silently
    /// shrink the gradients by another factor of the scale.
    #[error("gradients were already unscaled in this step; call update() before unscaling again")]
    AlreadyUnscaled,

    /// `update` was called without an `unscale` in this step, so there is no overflow check to
    /// base the new scale on.
    #[error("update() called before unscale() in this step: no overflow check was recorded")]
    UpdateWithoutUnscale,

    /// `record_found_inf` was called before this step's `unscale` or `unscale_external`: an
    /// overflow flag can only be merged into a step whose gradients were unscaled.
    #[error("record_found_inf() called before unscale() in this step: unscale (or unscale_external) first")]
    FoundInfBeforeUnscale,

    /// An f16 gradient was handed to `unscale`. Dividing f16 in place flushes small
    /// gradients to zero; unscale f32 gradients instead, or opt in with
    /// `LossScalerConfig::allow_f16_gradients` (PyTorch's `allow_fp16`).
    #[error("gradient {index} is f16: unscaling f16 gradients in place loses precision (see allow_f16_gradients)")]
    F16Gradient {
        /// Position of the gradient in the slice.
        index: usize,
    },

    /// The loss scale fell so low that `1/scale` is not a finite f32; unscaling would turn
    /// every gradient into ∞ or NaN without the overflow check noticing. Set a `min_scale`.
    #[error("loss scale {scale:e} has collapsed (1/scale is not a finite f32); set a min_scale")]
    ScaleCollapsed {
        /// The collapsed scale.
        scale: f32,
    },

    /// A tensor has the wrong dtype for its role.
    #[error("{what}: expected {expected}, got {got}")]
    DTypeMismatch {
        /// The tensor's role.
        what: &'static str,
        /// The dtype required.
        expected: DType,
        /// The dtype given.
        got: DType,
    },

    /// Two tensors that must have the same number of elements do not.
    #[error("{what}: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// The tensors' role.
        what: &'static str,
        /// The element count required.
        expected: usize,
        /// The element count given.
        got: usize,
    },

    /// A working-copy dtype that master weights cannot use, or stochastic rounding asked for
    /// a dtype it is not defined for (only bf16 has it).
    #[error("unsupported working copy: {reason}")]
    UnsupportedWorkingCopy {
        /// Why.
        reason: String,
    },

    /// A parameter index beyond the number of parameters.
    #[error("parameter {index} does not exist ({len} parameters)")]
    NoSuchParameter {
        /// The index asked for.
        index: usize,
        /// The number of parameters.
        len: usize,
    },

    /// An autocast rule takes the widest input dtype but the op has no float input.
    #[error(
        "autocast: {op} takes the widest float input dtype, but its inputs {inputs:?} have none"
    )]
    NoFloatInput {
        /// The op (category or override name).
        op: String,
        /// The input dtypes given.
        inputs: Vec<DType>,
    },
}

/// `Result` with [`AmpError`].
pub type Result<T, E = AmpError> = std::result::Result<T, E>;
