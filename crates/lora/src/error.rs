//! The crate's one error type.

use std::path::PathBuf;

use headroom_tensor::BoxedError;

/// Everything that can go wrong in headroom-lora. Input read from a file or given by a caller
/// is checked and reported here; nothing in the crate panics on it.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// A configuration value is out of range (rank 0, a non-finite alpha, dropout outside
    /// `[0, 1)`, …).
    #[error("invalid LoRA configuration: {0}")]
    InvalidConfig(String),
    /// A valid PEFT setting that headroom does not implement (DoRA, rank patterns, a regular
    /// expression as target, trainable biases, …): refused rather than silently ignored.
    #[error("unsupported adapter setting {field} = {value}: {why}")]
    Unsupported {
        /// The `adapter_config.json` field.
        field: String,
        /// Its value as found.
        value: String,
        /// Why it is refused.
        why: &'static str,
    },
    /// `adapter_config.json` is not valid JSON or a field has the wrong type.
    #[error("adapter_config.json: {0}")]
    Json(String),
    /// `adapter_model.safetensors` is not a valid safetensors file.
    #[error("adapter_model.safetensors: {0}")]
    Safetensors(String),
    /// A module has only one of its two LoRA tensors.
    #[error("missing tensor {name}")]
    MissingTensor {
        /// The tensor name PEFT would use.
        name: String,
    },
    /// A tensor whose name is not `base_model.model.<module>.lora_{A,B}.weight`.
    #[error("unexpected tensor {name} (expected base_model.model.<module>.lora_A.weight / lora_B.weight)")]
    UnexpectedTensor {
        /// The tensor name found.
        name: String,
    },
    /// An adapter for a module that the configuration's `target_modules` does not select.
    #[error("adapter for {module}, which target_modules {targets:?} does not select")]
    NotTargeted {
        /// The module name.
        module: String,
        /// The configured targets.
        targets: Vec<String>,
    },
    /// A tensor has the wrong shape (not 2-D, or its sizes disagree with the base or with the
    /// other LoRA tensor of its module).
    #[error("{name}: shape {actual:?}, expected {expected}")]
    ShapeMismatch {
        /// The tensor (or module) name.
        name: String,
        /// What was expected, in words (`[4, 32]`, `[?, 4]`).
        expected: String,
        /// What was found.
        actual: Vec<usize>,
    },
    /// A tensor's rank dimension differs from the configuration's `r`.
    #[error("{name}: rank {actual}, but the configuration says r = {expected}")]
    RankMismatch {
        /// The tensor name.
        name: String,
        /// `r` from the configuration.
        expected: usize,
        /// The rank dimension found.
        actual: usize,
    },
    /// A tensor stored in a dtype other than f32, bf16 or f16.
    #[error("{name}: dtype {dtype} (adapters are read from f32, bf16 or f16)")]
    UnsupportedDType {
        /// The tensor name.
        name: String,
        /// The dtype found.
        dtype: String,
    },
    /// A size beyond what headroom accepts (checked before anything is allocated).
    #[error("{what} = {value} exceeds the limit {limit}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its value.
        value: u128,
        /// The limit.
        limit: u128,
    },
    /// A slice passed to a kernel has the wrong length for the stated shape.
    #[error("{what}: length {actual}, expected {expected}")]
    Length {
        /// Which argument.
        what: &'static str,
        /// The length the shape implies.
        expected: usize,
        /// The length given.
        actual: usize,
    },
    /// No module of the base matched `target_modules`.
    #[error("no module matches target_modules {targets:?}")]
    NoTargetMatched {
        /// The configured targets.
        targets: Vec<String>,
    },
    /// A base module selected by `target_modules` has no adapter.
    #[error("module {module} is targeted but the adapter has no tensors for it")]
    MissingModule {
        /// The module name.
        module: String,
    },
    /// The adapter has tensors for a module the base does not have.
    #[error("the adapter has tensors for {module}, which the base model does not have")]
    UnknownModule {
        /// The module name.
        module: String,
    },
    /// The frozen base failed (its own error as the source).
    #[error("frozen base linear failed")]
    Base(#[source] BoxedError),
    /// A backend allocation failed or was refused by its hook.
    #[error(transparent)]
    Tensor(#[from] headroom_tensor::Error),
    /// Reading or writing an adapter file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// `Result` with [`LoraError`].
pub type Result<T, E = LoraError> = std::result::Result<T, E>;

/// Check a slice length against what a shape implies.
pub(crate) fn check_len(what: &'static str, actual: usize, expected: usize) -> Result<()> {
    if actual == expected {
        Ok(())
    } else {
        Err(LoraError::Length {
            what,
            expected,
            actual,
        })
    }
}

/// `a · b`, or [`LoraError::TooLarge`] when it overflows `usize`.
pub(crate) fn mul(what: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or(LoraError::TooLarge {
        what,
        value: a as u128 * b as u128,
        limit: usize::MAX as u128,
    })
}
