//! The trainer's error type: every crate's error, kept as the source so the CLI can print the
//! whole chain.

/// Everything training can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A model configuration that cannot be built.
    #[error("invalid model config: {0}")]
    Config(String),
    /// A run option out of range or inconsistent with the others; names the option.
    #[error("{option}: {reason}")]
    Option {
        /// The command-line option (`--batch`, `--micro-batch`, …).
        option: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// The run needs more memory than the machine has (predicted before allocating).
    #[error(
        "this run needs about {} MiB but the machine has {} MiB: reduce --batch or --seq, or \
         add techniques (try `headroom estimate` with --checkpoint, --precision bf16, \
         --loss-chunk, --offload, --micro-batch)",
        need >> 20,
        have >> 20
    )]
    MachineMemory {
        /// Predicted peak bytes (device and host ledgers together).
        need: u64,
        /// Physical memory of the machine.
        have: u64,
    },
    /// A checkpoint was written under other settings than this run's: resuming would not
    /// continue it bit for bit.
    #[error("cannot resume {path}: {}", differences.join("; "))]
    ResumeMismatch {
        /// The checkpoint's step directory.
        path: std::path::PathBuf,
        /// Each differing setting, `option: checkpoint value, this run value`.
        differences: Vec<String>,
    },
    /// A memory report file could not be written.
    #[error("memory report {path}: {reason}")]
    Report {
        /// The file.
        path: std::path::PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A batch or token that does not fit the model.
    #[error("invalid input: {0}")]
    Input(String),
    /// A checkpoint could not be written or read.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file or directory.
        path: std::path::PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A Hugging Face model directory that cannot be loaded: names the file and what is wrong
    /// (an unknown architecture, a missing, extra or misshapen tensor, a dtype, a corrupt
    /// header).
    #[error("pretrained model {path}: {reason}")]
    Pretrained {
        /// The file (or directory) at fault.
        path: std::path::PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A tokenizer could not be loaded or used (names the tokenizer file, or `gpt2`).
    #[error("tokenizer {path}: {reason}")]
    Tokenizer {
        /// The tokenizer file, or `gpt2`.
        path: std::path::PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A tensor operation failed (allocation refused, shape mismatch, …).
    #[error(transparent)]
    Tensor(#[from] headroom_tensor::Error),
    /// Attention failed.
    #[error(transparent)]
    Attention(#[from] headroom_attn::AttnError),
    /// The optimizer failed.
    #[error(transparent)]
    Optimizer(#[from] headroom_offload::OffloadError),
    /// Gradient clipping or accumulation failed.
    #[error(transparent)]
    Accum(#[from] headroom_accum::AccumError),
    /// Mixed precision (master weights, loss scaling) failed.
    #[error(transparent)]
    Amp(#[from] headroom_amp::AmpError),
    /// The checkpoint schedule or its executor failed.
    #[error(transparent)]
    Recompute(#[from] headroom_ckpt::CkptError),
    /// A checkpoint schedule could not be built or planned.
    #[error(transparent)]
    Schedule(#[from] headroom_ckpt::ScheduleError),
    /// The checkpoint planner found no schedule.
    #[error(transparent)]
    Plan(#[from] headroom_ckpt::PlanError),
    /// The memory estimator rejected the setup.
    #[error(transparent)]
    Profiler(#[from] headroom_profiler::ProfilerError),
    /// The data pipeline failed.
    #[error(transparent)]
    Data(#[from] headroom_mmap_data::DataError),
    /// 4-bit quantization of a frozen weight, or its fused matmul, failed.
    #[error(transparent)]
    Quant(#[from] headroom_quant::QuantError),
    /// LoRA adapters could not be built for the model (no target matched, a bad rank).
    #[error(transparent)]
    Lora(#[from] headroom_lora::LoraError),
    /// ZeRO's sharding engine or its collective failed (a rank that stopped answering
    /// included).
    #[error(transparent)]
    Zero(#[from] headroom_zero::ZeroError),
    /// One rank of a ZeRO run failed; the others stop too.
    #[error("ZeRO rank {rank}")]
    Rank {
        /// The rank.
        rank: usize,
        /// What it failed with.
        source: Box<TrainError>,
    },
    /// A LoRA adapter could not be read, checked against the model or merged.
    #[error("adapter {path}: {source}")]
    Adapter {
        /// The adapter directory.
        path: std::path::PathBuf,
        /// What went wrong.
        source: headroom_lora::LoraError,
    },
}

/// `Result` with [`TrainError`].
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
