//! Errors of the offload crate.

use std::path::PathBuf;

/// Everything the optimizer, its state stores and the pipeline can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OffloadError {
    /// Two buffers that must have the same length do not.
    #[error("{what}: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Required length.
        expected: usize,
        /// Given length.
        got: usize,
    },
    /// A parameter index the optimizer was not built with.
    #[error("no parameter {index} (the optimizer has {count})")]
    UnknownParam {
        /// The index asked for.
        index: usize,
        /// How many parameters exist.
        count: usize,
    },
    /// A parameter group index that does not exist.
    #[error("no parameter group {index} (the optimizer has {count})")]
    UnknownGroup {
        /// The index asked for.
        index: usize,
        /// How many groups exist.
        count: usize,
    },
    /// A hyper-parameter outside its valid range.
    #[error("invalid hyper-parameter {name} = {value}: {reason}")]
    InvalidHyper {
        /// Which hyper-parameter.
        name: &'static str,
        /// Its value.
        value: f64,
        /// The valid range.
        reason: &'static str,
    },
    /// An instruction set was asked for explicitly ([`CpuAdamW::with_isa`](crate::CpuAdamW::with_isa),
    /// [`fused_step`](crate::fused_step)) that this CPU does not have. Nothing falls back
    /// silently: a run asked to use AVX-512 either uses it or says why not.
    #[error("this CPU cannot run the {isa:?} AdamW kernel (it needs {features})")]
    UnsupportedIsa {
        /// The instruction set asked for.
        isa: crate::Isa,
        /// The CPU features it needs.
        features: &'static str,
    },
    /// Typed access to f32 moments ([`CpuAdamW::exp_avg`](crate::CpuAdamW::exp_avg),
    /// [`CpuAdamW::exp_avg_sq`](crate::CpuAdamW::exp_avg_sq)) on an optimizer whose moments
    /// are stored in another precision.
    #[error("the moments are stored as {precision:?}, not as f32 values")]
    MomentsNotF32 {
        /// How they are stored.
        precision: crate::StatePrecision,
    },
    /// A state file could not be created, opened, mapped or flushed.
    #[error("state file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The state file's blocks could not be reserved: its file system has no room for it
    /// (or a quota forbids it). Refused before the first step, rather than killed by SIGBUS
    /// when a store into the mapping first needs a block.
    #[error(
        "state file {path}: its {} MiB do not fit the free space of its file system: free \
         some, or put it elsewhere",
        bytes.div_ceil(1 << 20)
    )]
    StateFileNoSpace {
        /// The file.
        path: PathBuf,
        /// The bytes it needs (header and moments).
        bytes: u64,
    },
    /// Another optimizer's store holds the state file (another run, or another optimizer of
    /// this process, pointed at the same path): opening it would truncate or share the
    /// moments that one is training on.
    #[error(
        "state file {path} is in use by another run (its optimizer holds the file's lock): \
         give each run its own state file, or stop the other run first"
    )]
    StateFileInUse {
        /// The file.
        path: PathBuf,
    },
    /// A state file exists but does not hold the state this optimizer expects.
    #[error("state file {path} is not usable: {reason}")]
    CorruptStateFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Saved optimizer state does not match the optimizer it is loaded into.
    #[error("saved state does not match this optimizer: {0}")]
    StateMismatch(String),
    /// A tensor argument was unusable (wrong dtype, not host memory).
    #[error(transparent)]
    Tensor(#[from] headroom_tensor::Error),
    /// The pipeline worker stopped (it panicked or was shut down).
    #[error("the offload pipeline's worker is gone")]
    PipelineClosed,
    /// A bucket was submitted twice in one step, or names an unknown parameter.
    #[error("pipeline: {0}")]
    Pipeline(String),
    /// A bucket index the pipeline's plan does not have.
    #[error("no bucket {bucket} (the plan has {count})")]
    UnknownBucket {
        /// The bucket asked for.
        bucket: usize,
        /// How many buckets exist.
        count: usize,
    },
    /// A bucket was handed over a second time before the step was finished.
    #[error("bucket {bucket} was already handed over this step")]
    BucketHandedTwice {
        /// The bucket.
        bucket: usize,
    },
    /// `finish` was called before every bucket was handed over; nothing was changed, so the
    /// missing buckets can still be handed over and `finish` called again.
    #[error("cannot finish the step: buckets {missing:?} were not handed over")]
    BucketsMissing {
        /// The buckets not handed over yet.
        missing: Vec<usize>,
    },
    /// The caller's tensor list has no tensor for a parameter of the bucket.
    #[error("no {role} tensor for parameter {param} ({given} given)")]
    MissingTensor {
        /// `"gradient"` or `"parameter"`.
        role: &'static str,
        /// The parameter index.
        param: usize,
        /// How many tensors were given.
        given: usize,
    },
    /// A device tensor does not match the plan (element count, dtype or device).
    #[error("{role} tensor of parameter {param}: expected {expected}, got {got}")]
    TensorMismatch {
        /// `"gradient"` or `"parameter"`.
        role: &'static str,
        /// The parameter index.
        param: usize,
        /// What the plan says.
        expected: String,
        /// What the tensor is.
        got: String,
    },
    /// A CUDA driver call of the device pipeline failed, or there is no device.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] headroom_cuda::CudaError),
}

/// `Result` with [`OffloadError`].
pub type Result<T, E = OffloadError> = std::result::Result<T, E>;
