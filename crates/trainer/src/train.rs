//! The training loop: the reference GPT composed with every technique crate — precision and
//! loss scaling from headroom-amp, checkpoint schedules from headroom-ckpt, attention from
//! headroom-attn, AdamW (resident or offloaded, f32 or 8-bit) from headroom-offload,
//! token-weighted accumulation and clipping from headroom-accum, data from
//! headroom-mmap-data, and the profiler's tracker on every allocation.
//!
//! ## Device and host on a CPU-only machine
//! The run has two ledgers: the *device* (the [`Cpu`] backend the model computes on, whose
//! tracker enforces `budget`) and the *host* (a second backend with its own tracker) where an
//! offloaded optimizer keeps its moments and, in bf16/fp16, the fp32 master weights. On a
//! GPU these are two memories; here both are RAM, and the split shows what would stay on the
//! device.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use headroom_accum::{GradAccumulator, GradUnscaler, MicroBatchStats, NoLossScaling, StepTokens};
use headroom_amp::{LossScaler, LossScalerConfig};
use headroom_ckpt::{Schedule, ScheduleStats};
use headroom_mmap_data::{
    DocumentBoundaries, Loader, LoaderConfig, MarkovChain, OutputType, SamplerConfig, SamplingMode,
    Shard, TokenDataset,
};
use headroom_offload::{AdamWHyper, AdamWState, CpuAdamW, ParamSpec, StatePrecision, StoreSpec};
use headroom_profiler::{memory_summary, MemorySnapshot, MemoryTracker, ReportContext};
use headroom_tensor::cpu::kernels::FloatSlice;
use headroom_tensor::{Backend, BoxedError, Cpu, CpuTensor, MemoryCategory};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, RunSpec, TrainingState};
use crate::companions::Companions;
#[cfg(feature = "cuda")]
use crate::engine::CudaResident;
use crate::engine::{ComputeDevice, Engine};
use crate::estimate;
use crate::model::{
    counted_targets, params, Documents, FinetuneBuilder, FinetuneSpec, Geometry, Model,
    ModelConfig, ModelOptions, IGNORE_TARGET,
};
use crate::techniques::{
    block_schedule, CheckpointChoice, OptimizerChoice, OptimizerPlacement, Techniques,
};
use crate::{Result, TrainError};

/// The built-in data: a random sparse Markov chain whose entropy rate is the loss floor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SyntheticData {
    /// Vocabulary (the model's vocab).
    pub vocab: u32,
    /// Successors per token.
    pub branching: u32,
    /// Tokens generated.
    pub tokens: usize,
    /// Chain and stream seed.
    pub seed: u64,
}

/// Where training tokens come from.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSource {
    /// The built-in Markov source (its entropy rate is the loss floor).
    Synthetic(SyntheticData),
    /// Any file headroom-mmap-data opens (nanoGPT raw u16, llm.c, Megatron, shards).
    File(PathBuf),
    /// Several token files (each anything [`DataSource::File`] takes) as one dataset
    /// ([`TokenDataset::concat`]): every window of every file once per epoch.
    Files(Vec<PathBuf>),
    /// Several token files (each anything [`DataSource::File`] takes), drawn from in
    /// proportion to their weights as Megatron-LM's `--data-path 0.7 web 0.3 code` draws
    /// ([`TokenDataset::from_blend`]): each file through its own shuffled epochs, a file
    /// smaller than its share of the run repeated.
    Blend(Vec<(f64, PathBuf)>),
}

/// How the learning rate moves after the linear warmup: llm.c's `-k` schedulers, by their
/// names there. All start at the peak `lr` when the warmup ends and (but `Constant`) reach
/// `min_lr_frac·lr` at the last step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// Half a cosine period down to the floor (nanoGPT's, llm.c's default). The only schedule
    /// of checkpoints written before the schedule was recorded.
    #[default]
    Cosine,
    /// A straight line down to the floor (the shape of transformers' `linear`, its Trainer's
    /// default, whose warmup starts at 0 rather than at `lr/warmup`).
    Linear,
    /// The peak rate to the end; the floor is unused (the shape of transformers'
    /// `constant_with_warmup`; llm.c's `constant` has no warmup, which `--warmup 0` gives).
    Constant,
    /// Warmup–stable–decay (Hägele et al. 2024, as llm.c): the peak rate until 80% of the
    /// steps, then down to the floor as `1 − √t` over the last 20%. A checkpoint of the
    /// stable phase resumes under another `--steps` (see [`RunSpec::same_rates_before`]), so
    /// one run can be extended, or branched into cooldowns of several lengths.
    Wsd,
}

impl LrSchedule {
    /// Every schedule.
    pub const ALL: [LrSchedule; 4] = [
        LrSchedule::Cosine,
        LrSchedule::Linear,
        LrSchedule::Constant,
        LrSchedule::Wsd,
    ];

    /// The name the command line and `state.json` use.
    pub fn name(self) -> &'static str {
        match self {
            LrSchedule::Cosine => "cosine",
            LrSchedule::Linear => "linear",
            LrSchedule::Constant => "constant",
            LrSchedule::Wsd => "wsd",
        }
    }
}

/// `x` in exponent notation with at most six significant digits (`6e-5`, not the
/// `6.000000000000001e-5` that `0.1 × 6e-4` is in f64).
pub(crate) fn short_float(x: f64) -> String {
    if x == 0.0 {
        return "0".into();
    }
    let s = format!("{x:.5e}");
    match s.split_once('e') {
        Some((mantissa, exp)) if mantissa.contains('.') => {
            let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
            format!("{mantissa}e{exp}")
        }
        _ => s,
    }
}

/// The first step of [`LrSchedule::Wsd`]'s decay: llm.c's `(int)(0.8f * steps)`, which is
/// ⌊4·steps/5⌋ for every step count a run can have (f32's 0.8 lies a little above 0.8);
/// written without overflow.
pub(crate) fn wsd_decay_start(steps: usize) -> usize {
    steps / 5 * 4 + steps % 5 * 4 / 5
}

/// The learning rate at `step` (0-based) of a run of `steps` steps: linear warmup over
/// `warmup` steps to `lr` (llm.c's `lr·(step + 1)/warmup`), then `schedule` down to
/// `min_lr_frac·lr`. Computed in f64 (llm.c computes in f32: the two agree within f32's
/// rounding, see `tests/lr_schedule_llmc.rs`).
pub(crate) fn lr_schedule(
    schedule: LrSchedule,
    lr: f64,
    min_lr_frac: f64,
    warmup: usize,
    steps: usize,
    step: usize,
) -> f64 {
    if step < warmup {
        return lr * (step + 1) as f64 / warmup as f64;
    }
    let min = lr * min_lr_frac;
    // The fraction of a phase done at `step`, in [0, 1] (a step past the end stays at it).
    let progress = |start: usize| {
        let span = steps.saturating_sub(start).max(1) as f64;
        (step.saturating_sub(start) as f64 / span).min(1.0)
    };
    match schedule {
        LrSchedule::Cosine => {
            min + 0.5 * (lr - min) * (1.0 + (std::f64::consts::PI * progress(warmup)).cos())
        }
        LrSchedule::Linear => lr - progress(warmup) * (lr - min),
        LrSchedule::Constant => lr,
        LrSchedule::Wsd => {
            let decay_start = wsd_decay_start(steps);
            // llm.c's `min + (1 − √t)·(lr − min)`, written so that the decay's first step
            // is `lr` exactly, as the stable phase's steps are: a run extended in its stable
            // phase then repeats the rates it took (`RunSpec::same_rates_before`).
            if step < decay_start {
                lr
            } else {
                lr - progress(decay_start).sqrt() * (lr - min)
            }
        }
    }
}

/// Everything a run needs.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Model shape (its vocab must cover the data's ids).
    pub model: ModelConfig,
    /// Training tokens.
    pub data: DataSource,
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate as a fraction of `lr` (the end of the decay).
    pub min_lr_frac: f64,
    /// Linear warmup steps.
    pub warmup: usize,
    /// The decay after the warmup.
    pub lr_schedule: LrSchedule,
    /// AdamW's first-moment decay β1.
    pub beta1: f64,
    /// AdamW's second-moment decay β2.
    pub beta2: f64,
    /// AdamW's ε (added outside the square root, as PyTorch's).
    pub eps: f64,
    /// Decoupled weight decay of matrices and embeddings (none for biases and norms).
    pub weight_decay: f64,
    /// Global gradient-norm clip.
    pub grad_clip: f64,
    /// fp16: the loss scale never backs off below this (None: GradScaler's behaviour, no
    /// floor).
    pub min_loss_scale: Option<f32>,
    /// Initialisation and data-order seed.
    pub seed: u64,
    /// Memory techniques.
    pub techniques: Techniques,
    /// Where the model computes.
    pub device: ComputeDevice,
    /// Optional device memory budget in bytes (simulates a smaller device).
    pub budget: Option<u64>,
    /// Checkpoint root and the steps between saves (0: only at the end). A run that ends
    /// (all its steps, or stopped through [`TrainOptions::stop`]) always saves its last step.
    /// A fresh run refuses a root that already holds checkpoints (resume it instead); a
    /// resumed one, a root holding checkpoints past the step it resumes.
    pub save: Option<(PathBuf, usize)>,
    /// Checkpoints kept in the root (the newest; at least 1).
    pub keep_checkpoints: usize,
    /// A checkpoint's model is split into shards of at most this many bytes, as transformers'
    /// `max_shard_size` (default [`checkpoint::MAX_SHARD_BYTES`], transformers' 50 GB).
    pub max_shard_bytes: u64,
    /// Continue from this checkpoint (a step directory, or a root: its newest checkpoint).
    pub resume_from: Option<PathBuf>,
    /// Stop after this many completed steps without a final save (as a crash would), keeping
    /// the schedule of the full run.
    pub stop_after: Option<usize>,
    /// Checked after every step: when set, the run saves a checkpoint (if it has a root) and
    /// returns early with [`TrainReport::stopped`] set. The command sets it on SIGINT/SIGTERM.
    pub stop: Option<Arc<AtomicBool>>,
    /// Refuse a CPU run whose predicted memory exceeds the machine's physical memory before
    /// allocating anything (on by default; off for runs that expect to swap).
    pub check_machine_memory: bool,
    /// Validation: a loss over fixed windows of another token file, every few steps.
    pub eval: Option<EvalOptions>,
    /// Start from the weights of a Hugging Face model directory (`config.json` and
    /// safetensors) instead of a random initialisation; its shape must be [`TrainOptions::model`]
    /// (see [`crate::hf::read_config`]).
    pub init_from: Option<PathBuf>,
    /// Memory reports to write when the run ends — also when it fails, out of budget
    /// included, so the files show the moment of the failure.
    pub memory_outputs: MemoryOutputs,
    /// After training, merge the adapters into the base and write a Hugging Face directory
    /// here (needs [`Techniques::finetune`]).
    pub merge_into: Option<PathBuf>,
    /// A Hugging Face tokenizer (its `tokenizer.json`, or the directory) whose files every
    /// checkpoint and export carries, in place of `init_from`'s tokenizer files: the
    /// tokenizer a run's data was built with (transformers Trainer's `processing_class`).
    pub tokenizer: Option<PathBuf>,
    /// TRL's `eos_token` (`train --eos-token`): the token `data build --eos-token` ended the
    /// examples with becomes the carried tokenizer's `eos_token` and the model's eos id
    /// ([`Companions::with_eos_token`]).
    pub eos_token: Option<String>,
    /// TRL's `chat_template_path` (`train --chat-template`): the Jinja template the data's
    /// conversations were rendered with becomes the carried tokenizer's chat template
    /// ([`Companions::with_chat_template`]).
    pub chat_template: Option<PathBuf>,
    /// Packed documents (`--document-attention`): each token attends only within its
    /// document, positions restart at each document, and a target that starts a document is
    /// not counted — the losses of a batch of padded examples (see
    /// [`crate::model::Documents`]). The documents are those of the data's Megatron index
    /// ([`DocumentBoundaries::Index`]: the data and `--val-data` must have one) or end with a
    /// separator token (`--document-separator`, [`DocumentBoundaries::EndsWith`]). On the CPU
    /// (ZeRO's ranks included).
    pub documents: Option<DocumentBoundaries>,
}

/// Validation during a run (`--val-data`, `--eval-every`, `--eval-batches`).
#[derive(Clone, Debug, PartialEq)]
pub struct EvalOptions {
    /// The validation sets, each measured on its own (as a dict of `eval_dataset`s in
    /// transformers' Trainer): a token file (any format headroom-mmap-data opens), several as
    /// one ([`DataSource::Files`]) or a blend ([`DataSource::Blend`]: one loss over windows
    /// drawn by its weights, as Megatron-LM blends its validation sets); not the synthetic
    /// source. At least one.
    pub sets: Vec<DataSource>,
    /// Steps between evaluations (0: only after the last step). The last step is always
    /// evaluated.
    pub every: usize,
    /// Batches of the run's shape (`batch × seq`) in the fixed validation set.
    pub batches: usize,
}

/// The sampler seed of the validation windows: a constant, so that runs with different seeds
/// are measured on the same windows.
const VALIDATION_SEED: u64 = 0x7661_6c69_6461_7465;

/// Files the device's memory timeline is written to (nothing is recorded when all are `None`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemoryOutputs {
    /// Chrome / Perfetto trace JSON: one counter per category, phases, step markers.
    pub trace: Option<PathBuf>,
    /// A stacked-area SVG plot by category.
    pub svg: Option<PathBuf>,
    /// Index the SVG's x axis by allocation event instead of wall time (backward and the
    /// peak stay visible when compute dominates the time).
    pub svg_by_event: bool,
    /// PyTorch's memory-snapshot pickle (`torch.cuda.memory._snapshot()` format), for
    /// pytorch.org/memory_viz.
    pub snapshot: Option<PathBuf>,
}

impl MemoryOutputs {
    /// True when a file is asked for.
    pub fn any(&self) -> bool {
        self.trace.is_some() || self.svg.is_some() || self.snapshot.is_some()
    }

    /// Write every requested file from `timeline` (of `device`, drawn against `budget`).
    pub fn write(
        &self,
        timeline: &headroom_profiler::Timeline,
        device: headroom_tensor::Device,
        budget: Option<u64>,
        title: &str,
    ) -> Result<()> {
        if let Some(p) = &self.trace {
            write_report(p, |w| headroom_profiler::write_chrome_trace(timeline, w))?;
        }
        if let Some(p) = &self.svg {
            let plot = headroom_profiler::PlotOptions {
                title: Some(title.to_string()),
                budget,
                x_axis: if self.svg_by_event {
                    headroom_profiler::XAxis::EventIndex
                } else {
                    headroom_profiler::XAxis::Time
                },
                ..Default::default()
            };
            let svg = headroom_profiler::stacked_timeline_svg(timeline, device, &plot);
            write_report(p, |w| Ok(std::io::Write::write_all(w, svg.as_bytes())?))?;
        }
        if let Some(p) = &self.snapshot {
            write_report(p, |w| {
                headroom_profiler::write_torch_snapshot(
                    timeline,
                    &headroom_profiler::TorchSnapshotOptions::default(),
                    w,
                )
                .map(drop)
            })?;
        }
        Ok(())
    }
}

/// Write one memory report through `body`, then flush: an error (a full disk) names the file
/// with its cause, and the truncated file is removed rather than left to look like a report.
fn write_report(
    path: &std::path::Path,
    body: impl FnOnce(
        &mut std::io::BufWriter<std::fs::File>,
    ) -> std::result::Result<(), headroom_profiler::ProfilerError>,
) -> Result<()> {
    use std::io::Write as _;
    let reason = |e: headroom_profiler::ProfilerError| match e {
        headroom_profiler::ProfilerError::Io(io) => io.to_string(),
        other => other.to_string(),
    };
    let file = std::fs::File::create(path).map_err(|e| TrainError::Report {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut w = std::io::BufWriter::new(file);
    let written = body(&mut w)
        .map_err(reason)
        .and_then(|()| w.flush().map_err(|e| e.to_string()));
    written.map_err(|reason| {
        drop(w);
        let _ = std::fs::remove_file(path);
        TrainError::Report {
            path: path.to_path_buf(),
            reason,
        }
    })
}

impl TrainOptions {
    /// What the run does to the tokenizer its checkpoints carry: `tokenizer`, `eos_token`
    /// and `chat_template` together.
    pub fn tokenizer_settings(&self) -> crate::companions::TokenizerSettings<'_> {
        crate::companions::TokenizerSettings {
            tokenizer: self.tokenizer.as_deref(),
            eos_token: self.eos_token.as_deref(),
            chat_template: self.chat_template.as_deref(),
        }
    }

    /// The default run: `tiny` on the synthetic source, well under a minute on 2 cores.
    pub fn tiny_default() -> Self {
        let data = SyntheticData {
            vocab: 64,
            branching: 4,
            tokens: 1 << 20,
            seed: 1337,
        };
        TrainOptions {
            model: ModelConfig::tiny(data.vocab as usize),
            data: DataSource::Synthetic(data),
            steps: 600,
            batch: 16,
            seq: 64,
            lr: 3e-3,
            min_lr_frac: 0.1,
            warmup: 20,
            lr_schedule: LrSchedule::Cosine,
            // GPT-2/GPT-3 practice (nanoGPT, llm.c): a shorter memory for v than PyTorch's
            // 0.999, which large-batch language-model runs find more stable.
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
            min_loss_scale: None,
            seed: 1337,
            techniques: Techniques {
                model: ModelOptions::default(),
                checkpoint: CheckpointChoice::None,
                optimizer: OptimizerChoice::resident(),
                micro_batch: None,
                finetune: None,
            },
            device: ComputeDevice::Cpu,
            budget: None,
            save: None,
            keep_checkpoints: 3,
            max_shard_bytes: checkpoint::MAX_SHARD_BYTES,
            resume_from: None,
            stop_after: None,
            stop: None,
            check_machine_memory: true,
            eval: None,
            init_from: None,
            merge_into: None,
            tokenizer: None,
            eos_token: None,
            chat_template: None,
            memory_outputs: MemoryOutputs::default(),
            documents: None,
        }
    }

    /// `small` (6 layers, 6 heads, width 384, context 256, GPT-2's vocabulary) on a synthetic
    /// source, batch 8×256: the comparison setting.
    pub fn small_default() -> Self {
        let data = SyntheticData {
            vocab: 50257,
            branching: 4,
            tokens: 1 << 20,
            seed: 1337,
        };
        TrainOptions {
            model: ModelConfig::small(data.vocab as usize),
            data: DataSource::Synthetic(data),
            steps: 20,
            batch: 8,
            seq: 256,
            lr: 6e-4,
            warmup: 2,
            ..Self::tiny_default()
        }
    }

    /// The learning rate at `step` (0-based): linear warmup, then [`TrainOptions::lr_schedule`]
    /// down to `min_lr_frac·lr`.
    pub fn lr_at(&self, step: usize) -> f64 {
        self.run_spec().lr_at(step)
    }

    /// The optimizer's settings in one line, as the command prints them before the first
    /// step (see [`RunSpec::describe_optimizer`]).
    pub fn describe_optimizer(&self) -> String {
        self.run_spec().describe_optimizer()
    }

    /// Sequences per micro-batch, checked to divide the batch.
    pub fn micro_batch(&self) -> Result<usize> {
        let m = self.techniques.micro_batch.unwrap_or(self.batch);
        if m == 0 {
            return Err(TrainError::Option {
                option: "--micro-batch",
                reason: "must be at least 1 sequence".into(),
            });
        }
        if !self.batch.is_multiple_of(m) {
            return Err(TrainError::Option {
                option: "--micro-batch",
                reason: format!("{m} does not divide the batch {}", self.batch),
            });
        }
        Ok(m)
    }

    /// The settings a checkpoint of this run records and a resume must match.
    pub fn run_spec(&self) -> RunSpec {
        RunSpec {
            batch: self.batch,
            seq: self.seq,
            seed: self.seed,
            steps: self.steps,
            lr: self.lr,
            min_lr_frac: self.min_lr_frac,
            warmup: self.warmup,
            lr_schedule: self.lr_schedule,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            grad_clip: self.grad_clip,
            precision: self.techniques.model.precision.name().to_string(),
            // Only a scaled run has a floor to honour; elsewhere a changed flag changes no bit.
            min_loss_scale: Some(
                self.min_loss_scale
                    .filter(|_| self.techniques.model.precision.needs_loss_scaling()),
            ),
            documents: self.documents.is_some(),
            document_separator: match self.documents {
                Some(DocumentBoundaries::EndsWith(separator)) => Some(separator),
                Some(DocumentBoundaries::Index) | None => None,
            },
        }
    }

    /// Check every size and setting before anything is allocated: positive, consistent and
    /// bounded, with every product that sizes an allocation checked. Errors name the option.
    pub fn validate(&self) -> Result<()> {
        let opt = |option: &'static str, reason: String| Err(TrainError::Option { option, reason });
        for (option, v) in [
            ("--steps", self.steps),
            ("--batch", self.batch),
            ("--seq", self.seq),
        ] {
            if v == 0 {
                return opt(option, "must be positive".into());
            }
        }
        self.model.validate()?;
        if let Some(boundaries) = self.documents {
            if let DocumentBoundaries::EndsWith(separator) = boundaries {
                if separator as usize >= self.model.vocab {
                    return opt(
                        "--document-separator",
                        format!(
                            "token {separator} is outside the model's vocabulary of {} ids",
                            self.model.vocab
                        ),
                    );
                }
            }
            if matches!(self.data, DataSource::Synthetic(_)) {
                return opt(
                    "--document-attention",
                    "needs a token file with documents (--data FILE: a Megatron .bin/.idx \
                     pair, or a file whose documents end with --document-separator); the \
                     synthetic data has none"
                        .into(),
                );
            }
            if matches!(self.device, ComputeDevice::Cuda { .. }) {
                return opt(
                    "--document-attention",
                    "runs on the CPU only: the CUDA attention kernels have no document mask yet"
                        .into(),
                );
            }
        }
        if self.seq > self.model.max_seq {
            return opt(
                "--seq",
                format!(
                    "{} exceeds the model's context {} (a preset's is set by --context)",
                    self.seq, self.model.max_seq
                ),
            );
        }
        if self
            .batch
            .checked_mul(self.seq)
            .is_none_or(|n| n as u64 > MAX_TOKENS_PER_STEP)
        {
            return opt(
                "--batch",
                format!(
                    "{} sequences of {} tokens exceed {MAX_TOKENS_PER_STEP} tokens per step",
                    self.batch, self.seq
                ),
            );
        }
        self.micro_batch()?;
        if let Some(m) = self.techniques.model.loss_chunk {
            if m == 0 {
                return opt("--loss-chunk", "must be at least 1 row".into());
            }
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return opt("--lr", format!("{} is not a positive number", self.lr));
        }
        if !(self.min_lr_frac.is_finite() && (0.0..=1.0).contains(&self.min_lr_frac)) {
            return opt(
                "--min-lr",
                format!(
                    "{} is not between 0 and the peak learning rate {}",
                    self.lr * self.min_lr_frac,
                    self.lr
                ),
            );
        }
        for (option, v) in [("--beta1", self.beta1), ("--beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return opt(option, format!("{v} is not in [0, 1)"));
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return opt(
                "--adam-eps",
                format!("{} is not a non-negative number", self.eps),
            );
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return opt(
                "--weight-decay",
                format!("{} is not a non-negative number", self.weight_decay),
            );
        }
        if self.grad_clip.is_nan() || self.grad_clip <= 0.0 {
            return opt(
                "--grad-clip",
                format!(
                    "{} is not a positive number (inf: no clipping)",
                    self.grad_clip
                ),
            );
        }
        if self.budget == Some(0) {
            return opt("--budget-mib", "must be positive".into());
        }
        if let Some(m) = self.min_loss_scale {
            if !(m.is_finite() && m > 0.0) {
                return opt("--min-loss-scale", format!("{m} is not a positive number"));
            }
        }
        if let Some(e) = &self.eval {
            if self.device != ComputeDevice::Cpu {
                return opt(
                    "--val-data",
                    "validation runs on the CPU model only (the CUDA model has no forward-only \
                     path yet)"
                        .into(),
                );
            }
            if e.batches == 0 {
                return opt("--eval-batches", "must be at least 1".into());
            }
            if e.batches
                .checked_mul(self.batch)
                .and_then(|n| n.checked_mul(self.seq))
                .is_none_or(|n| n as u64 > MAX_TOKENS_PER_STEP)
            {
                return opt(
                    "--eval-batches",
                    format!("{} batches exceed {MAX_TOKENS_PER_STEP} tokens", e.batches),
                );
            }
        }
        if self.max_shard_bytes == 0 {
            return Err(TrainError::Input(
                "a checkpoint's shards must hold at least one byte".into(),
            ));
        }
        if self.keep_checkpoints == 0 {
            return opt("--keep-checkpoints", "must keep at least 1".into());
        }
        if let Some(f) = &self.techniques.finetune {
            if self.device != ComputeDevice::Cpu {
                return opt(
                    "--lora-rank",
                    "LoRA fine-tuning runs on the CPU model in this version (the model code \
                     and the 4-bit CUDA kernels exist; the CUDA engine's set-up does not)"
                        .into(),
                );
            }
            if !(0.0..1.0).contains(&f.lora.dropout) {
                return opt(
                    "--lora-dropout",
                    format!("{} is not a probability below 1", f.lora.dropout),
                );
            }
            if !(f.lora.alpha.is_finite() && f.lora.alpha > 0.0) {
                return opt(
                    "--lora-alpha",
                    format!("{} is not a positive number", f.lora.alpha),
                );
            }
            f.lora.validate().map_err(|e| TrainError::Option {
                option: "--lora-rank",
                reason: e.to_string(),
            })?;
            if let Some(q) = &f.quantize {
                q.config().map_err(|e| TrainError::Option {
                    option: "--quantize",
                    reason: e.to_string(),
                })?;
            }
            crate::model::finetune::adapted_modules(&self.model, &f.lora).map_err(|e| {
                TrainError::Option {
                    option: "--lora-targets",
                    reason: e.to_string(),
                }
            })?;
        } else if self.merge_into.is_some() {
            return opt(
                "--merge-into",
                "needs LoRA fine-tuning (--lora-rank)".into(),
            );
        }
        Ok(())
    }
}

/// Tokens one step may hold (2³²): beyond it the batch buffers alone need tens of GiB.
pub const MAX_TOKENS_PER_STEP: u64 = 1 << 32;

/// Physical memory of this machine in bytes (Linux: `MemTotal` of /proc/meminfo).
pub fn machine_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// One step's figures.
#[derive(Clone, Debug, PartialEq)]
pub struct StepLog {
    /// 0-based step.
    pub step: usize,
    /// Mean training loss of the step's batch (nats/token).
    pub loss: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Gradient norm before clipping (NaN when the step was skipped).
    pub grad_norm: f64,
    /// Whether the optimizer ran (false: fp16 overflow, step skipped).
    pub applied: bool,
    /// Loss scale after the step (1 without loss scaling).
    pub loss_scale: f32,
    /// Block forwards run (more than the layer count when activations were recomputed).
    pub block_forwards: usize,
    /// Wall time of the step.
    pub seconds: f64,
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Live tracked device bytes after the step.
    pub live_bytes: u64,
    /// Peak tracked device bytes so far.
    pub peak_bytes: u64,
    /// Mean validation loss after this step, when the step was evaluated: over every counted
    /// target of every validation set (the one set's loss when there is one).
    pub val_loss: Option<f32>,
    /// Each validation set's loss, in [`EvalOptions::sets`] order, when the step was
    /// evaluated (empty otherwise).
    pub val_losses: Vec<f32>,
    /// Targets the step's loss is the mean of: every target of the batch, or those its loss
    /// mask keeps (0: the step was skipped, its loss is NaN).
    pub counted_targets: u64,
}

/// The outcome of a run.
#[derive(Debug)]
pub struct TrainReport {
    /// Every step's log (from the resumed step on, when resuming).
    pub steps: Vec<StepLog>,
    /// The synthetic source's entropy rate (the lowest achievable loss), if synthetic.
    pub entropy_floor: Option<f64>,
    /// Device tracker snapshot at the end (peaks by category).
    pub memory: MemorySnapshot,
    /// Host tracker snapshot (offloaded optimizer state and masters).
    pub host_memory: MemorySnapshot,
    /// The device memory table.
    pub memory_table: String,
    /// The checkpoint schedule the blocks ran under.
    pub schedule: Schedule,
    /// True when the run ended early because [`TrainOptions::stop`] was set.
    pub stopped: bool,
    /// The last checkpoint this run published.
    pub last_checkpoint: Option<PathBuf>,
    /// The last validation loss, and the tokens it was measured on.
    pub val_loss: Option<(f32, u64)>,
    /// The last validation loss of each set: its name, loss and tokens.
    pub val_losses: Vec<(String, f32, u64)>,
}

impl TrainReport {
    /// Mean loss of the last `k` steps (of all of them when fewer ran); a step whose batch
    /// held no counted target has no loss and is left out. NaN when none had one.
    pub fn final_loss(&self, k: usize) -> f64 {
        let tail = &self.steps[self.steps.len().saturating_sub(k)..];
        let (sum, n) = tail
            .iter()
            .filter(|s| s.counted_targets > 0)
            .fold((0f64, 0usize), |(sum, n), s| (sum + s.loss as f64, n + 1));
        if n == 0 {
            f64::NAN
        } else {
            sum / n as f64
        }
    }

    /// Median step time over steps after the first `skip` (warm-up).
    pub fn median_step_seconds(&self, skip: usize) -> f64 {
        let mut t: Vec<f64> = self.steps.iter().skip(skip).map(|s| s.seconds).collect();
        if t.is_empty() {
            t = self.steps.iter().map(|s| s.seconds).collect();
        }
        t.sort_by(f64::total_cmp);
        t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// The fp16 loss scaler behind headroom-accum's unscaling interface (the two crates do not
/// know each other; the trainer joins them).
struct ScalerAdapter<'a>(&'a mut LossScaler);

impl GradUnscaler<Cpu> for ScalerAdapter<'_> {
    fn unscale_and_check(
        &mut self,
        backend: &Cpu,
        grads: &mut [CpuTensor],
    ) -> std::result::Result<bool, BoxedError> {
        let mut refs: Vec<&mut CpuTensor> = grads.iter_mut().collect();
        let decision = self.0.unscale(backend, &mut refs)?;
        Ok(!decision.should_step())
    }

    fn update(&mut self, _found_non_finite: bool) -> std::result::Result<(), BoxedError> {
        self.0.update()?;
        Ok(())
    }
}

/// Refuse a file that is text rather than tokens: read as a raw token file, its bytes would
/// train silently on nonsense. Text here: the first 64 KiB are valid UTF-8 (a cut character at
/// the end allowed) without NUL bytes and at least 95% printable or whitespace; token files
/// fail this at once (llm.c and Megatron headers hold NUL bytes, as do small token ids).
/// A glob or a directory of shards is left to the reader, which names a missing one.
fn refuse_text(path: &std::path::Path) -> Result<()> {
    use std::io::Read;
    if !path.is_file() {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() || name.contains(['*', '?']) {
            return Ok(());
        }
    }
    let mut head = Vec::with_capacity(64 << 10);
    let read = std::fs::File::open(path)
        .and_then(|f| f.take(64 << 10).read_to_end(&mut head))
        .map_err(|e| TrainError::Input(format!("{}: {e}", path.display())))?;
    if read == 0 || head.contains(&0) {
        return Ok(());
    }
    let text = match std::str::from_utf8(&head) {
        Ok(t) => t,
        // A multi-byte character cut by the 64 KiB window still counts as text.
        Err(e) if e.error_len().is_none() => std::str::from_utf8(&head[..e.valid_up_to()])
            .map_err(|e| TrainError::Input(e.to_string()))?,
        Err(_) => return Ok(()),
    };
    let chars = text.chars().count().max(1);
    let printable = text
        .chars()
        .filter(|c| !c.is_control() || c.is_whitespace())
        .count();
    if printable * 100 >= chars * 95 {
        return Err(TrainError::Input(format!(
            "{} is UTF-8 text, not a token file: tokenise it first, e.g. `headroom data build \
             {} tokens.bin`",
            path.display(),
            path.display()
        )));
    }
    Ok(())
}

/// Refuses a batch holding a token id the model has no embedding for, naming the file: a
/// token file made with another tokenizer is a mistake of the data, and found in the model
/// it would only say which op refused it. Runs before the step touches anything.
pub(crate) fn check_token_ids(
    inputs: &[u32],
    targets: &[u32],
    vocab: usize,
    source: &dyn std::fmt::Display,
) -> Result<()> {
    match inputs
        .iter()
        .chain(targets)
        .find(|&&id| id as usize >= vocab)
    {
        Some(id) => Err(TrainError::Input(format!(
            "{source} holds token id {id}, outside the model's vocabulary of {vocab} ids: was \
             it tokenised for another model? (`headroom data inspect` shows a file's ids)"
        ))),
        None => Ok(()),
    }
}

/// A batch's inputs and targets as `u32` ids checked against the model's vocabulary, each
/// target its loss mask leaves out (a prompt's, in supervised fine-tuning) replaced by
/// [`IGNORE_TARGET`].
pub(crate) fn batch_tokens(
    batch: &headroom_mmap_data::BatchBuffer,
    vocab: usize,
    source: &dyn std::fmt::Display,
) -> Result<TokenBatch> {
    let inputs = batch
        .inputs_u32()
        .ok_or_else(|| TrainError::Input("loader gave no u32 inputs".into()))?
        .to_vec();
    let mut targets = batch
        .targets_u32()
        .ok_or_else(|| TrainError::Input("loader gave no u32 targets".into()))?
        .to_vec();
    check_token_ids(&inputs, &targets, vocab, source)?;
    if let Some(flags) = batch.target_flags() {
        for (t, &counts) in targets.iter_mut().zip(flags) {
            if !counts {
                *t = IGNORE_TARGET;
            }
        }
    }
    Ok(TokenBatch {
        tokens: inputs,
        targets,
        positions: batch.positions().map(<[u32]>::to_vec),
    })
}

/// The mean validation loss per counted target, chunk by chunk in order: each chunk's mean
/// (over its counted targets) weighted by its counted targets, so the result does not depend
/// on the chunking. Without a loss mask every chunk counts all its targets and the result is
/// the mean of the chunks' means, the arithmetic of every run before masks existed.
#[derive(Default)]
pub(crate) struct ValidationMean {
    weighted: f64,
    means: f64,
    chunks: usize,
    counted: u64,
    masked: bool,
}

impl ValidationMean {
    /// A chunk of `len` targets, `counted` of them counted, whose mean loss is `loss` (not
    /// read when nothing counts).
    pub(crate) fn add(&mut self, loss: f32, counted: u64, len: usize) {
        self.masked |= counted < len as u64;
        if counted > 0 {
            self.weighted += loss as f64 * counted as f64;
            self.means += loss as f64;
            self.chunks += 1;
            self.counted += counted;
        }
    }

    /// Targets counted so far.
    pub(crate) fn counted(&self) -> u64 {
        self.counted
    }

    /// The mean in f64; NaN when no target counted.
    pub(crate) fn mean_f64(&self) -> f64 {
        match (self.counted, self.masked) {
            (0, _) => f64::NAN,
            (_, false) => self.means / self.chunks as f64,
            (_, true) => self.weighted / self.counted as f64,
        }
    }

    /// [`ValidationMean::mean_f64`] rounded to f32.
    pub(crate) fn mean(&self) -> f32 {
        self.mean_f64() as f32
    }
}

/// [`ValidationMean`] over `batches`, `rows` tokens at a time through `loss`; chunks with no
/// counted target are not run.
pub(crate) fn validation_mean(
    batches: &[TokenBatch],
    rows: usize,
    mut loss: impl FnMut(&[u32], &[u32], Option<&[u32]>) -> Result<f32>,
) -> Result<f32> {
    let mut mean = ValidationMean::default();
    for b in batches {
        for (i, (tok, tgt)) in b
            .tokens
            .chunks(rows)
            .zip(b.targets.chunks(rows))
            .enumerate()
        {
            let n = counted_targets(tgt) as u64;
            let positions = b.positions.as_ref().and_then(|p| p.chunks(rows).nth(i));
            let l = if n > 0 {
                loss(tok, tgt, positions)?
            } else {
                0.0
            };
            mean.add(l, n, tgt.len());
        }
    }
    Ok(mean.mean())
}

/// One batch as the model reads it: inputs, targets (those left out as [`IGNORE_TARGET`])
/// and, for packed documents, each input's position id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenBatch {
    /// Input ids `[B·T]`.
    pub tokens: Vec<u32>,
    /// Target ids `[B·T]`.
    pub targets: Vec<u32>,
    /// Position ids `[B·T]` with [`TrainOptions::documents`], else `None`.
    pub positions: Option<Vec<u32>>,
}

/// The documents of `micro` sequences of `seq` tokens whose position ids are `positions`
/// (`None`: the rows are not packed documents).
pub(crate) fn packed_documents(
    positions: Option<&[u32]>,
    micro: usize,
    seq: usize,
) -> Result<Option<Documents>> {
    positions
        .map(|p| Documents::from_positions(micro, seq, p))
        .transpose()
}

/// [`packed_documents`] of micro-batch `index` (`micro` sequences) of a batch's `positions`.
pub(crate) fn micro_documents(
    positions: Option<&[u32]>,
    index: usize,
    micro: usize,
    seq: usize,
) -> Result<Option<Documents>> {
    let chunk = positions
        .map(|p| {
            p.chunks(micro * seq).nth(index).ok_or_else(|| {
                TrainError::Input(format!("micro-batch {index} is past the batch's positions"))
            })
        })
        .transpose()?;
    packed_documents(chunk, micro, seq)
}

/// What a run's training data is called in messages.
pub(crate) fn data_name(data: &DataSource) -> String {
    match data {
        DataSource::Synthetic(_) => "the synthetic data".into(),
        DataSource::File(path) => path.display().to_string(),
        DataSource::Files(paths) => {
            let paths: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            paths.join(" + ")
        }
        DataSource::Blend(parts) => {
            let parts: Vec<String> = parts
                .iter()
                .map(|(w, path)| format!("{w} {}", path.display()))
                .collect();
            format!("the blend {}", parts.join(" "))
        }
    }
}

/// The token files of `data` as one dataset, each refused when it is text; `None` for the
/// synthetic source.
fn open_files(data: &DataSource) -> Option<Result<TokenDataset>> {
    let open = |path: &std::path::Path| -> Result<TokenDataset> {
        refuse_text(path)?;
        Ok(headroom_mmap_data::open(path, &Default::default())?)
    };
    match data {
        DataSource::Synthetic(_) => None,
        DataSource::File(path) => Some(open(path)),
        DataSource::Files(paths) => Some((|| {
            let parts = paths.iter().map(|p| open(p)).collect::<Result<Vec<_>>>()?;
            Ok(TokenDataset::concat(parts)?)
        })()),
        DataSource::Blend(parts) => Some((|| {
            let sources = parts
                .iter()
                .map(|(weight, path)| Ok((path.display().to_string(), *weight, open(path)?)))
                .collect::<Result<Vec<_>>>()?;
            Ok(TokenDataset::from_blend(sources)?)
        })()),
    }
}

/// The line `headroom train` prints for a blend (`None` for other data, or a blend that does
/// not open: the run reports why): each file's share of the windows, its size, and how many
/// of its epochs the run's `steps × batch` windows take, so a small file repeated many times
/// is seen before the run rather than in its loss.
pub fn describe_blend(opts: &TrainOptions) -> Option<String> {
    if !matches!(opts.data, DataSource::Blend(_)) {
        return None;
    }
    let ds = open_files(&opts.data)?.ok()?;
    let blend = ds.blend()?;
    let sampler = SamplerConfig {
        mode: SamplingMode::EpochWindows,
        seq_len: opts.seq as u64,
        seed: opts.seed,
        shard: Shard::SINGLE,
    };
    let sampler = headroom_mmap_data::WindowSampler::new(&ds, sampler).ok()?;
    let windows = (opts.steps as u64).saturating_mul(opts.batch as u64);
    let lines: Vec<String> = blend
        .sources()
        .iter()
        .enumerate()
        .map(|(d, source)| {
            let tokens: u64 = ds.segments()[source.segments.clone()]
                .iter()
                .map(|s| s.len() as u64)
                .sum();
            let drawn = sampler.source_windows(d, windows);
            let epoch = sampler.source_windows_per_epoch(d).unwrap_or(1).max(1);
            let epochs = drawn as f64 / epoch as f64;
            format!(
                "  {:5.1}%  {}: {tokens} tokens, {epoch} windows an epoch; this run reads {drawn} \
                 windows, {epochs:.2} epochs{}",
                100.0 * source.fraction(blend.period()),
                source.name,
                if epochs > 1.0 { " (repeated)" } else { "" }
            )
        })
        .collect();
    Some(format!(
        "data: a blend of {} files, window by window by Megatron-LM's rule (each file is \
         shuffled through its own epochs):\n{}",
        blend.sources().len(),
        lines.join("\n")
    ))
}

/// One validation set of a run: its name in messages and its fixed batches.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidationSet {
    /// What the set is called (its path, or its blend's weights and paths).
    pub name: String,
    /// The set's windows, `batches` batches of the run's shape.
    pub batches: Vec<TokenBatch>,
}

impl ValidationSet {
    /// The targets the set's loss is the mean of (those its loss mask keeps).
    pub fn counted(&self) -> u64 {
        self.batches
            .iter()
            .map(|b| counted_targets(&b.targets) as u64)
            .sum()
    }
}

/// The loss over every counted target of several sets, from each set's `(loss, counted)`: each
/// set's loss weighted by its counted targets; one set's own loss when there is one (so a run
/// with one set reports exactly what it did before sets were several). NaN when none counts.
pub(crate) fn overall_loss(per_set: &[(f32, u64)]) -> f32 {
    if let [(loss, _)] = per_set {
        return *loss;
    }
    let (weighted, counted) = per_set
        .iter()
        .filter(|(_, n)| *n > 0)
        .fold((0.0f64, 0u64), |(w, c), &(l, n)| {
            (w + f64::from(l) * n as f64, c + n)
        });
    if counted == 0 {
        f32::NAN
    } else {
        (weighted / counted as f64) as f32
    }
}

/// The fixed validation sets of a run (`--val-data`): each `batches` batches of the run's
/// shape from a constant seed, read once (host vectors, outside the device ledger: a few KiB
/// to MiB of token ids); empty without validation.
pub fn validation_sets(opts: &TrainOptions) -> Result<Vec<ValidationSet>> {
    let Some(e) = &opts.eval else {
        return Ok(Vec::new());
    };
    if e.sets.is_empty() {
        return Err(TrainError::Config(
            "validation needs at least one set of token files".into(),
        ));
    }
    e.sets
        .iter()
        .map(|set| {
            let name = data_name(set);
            let ds = open_files(set).ok_or_else(|| {
                TrainError::Config("validation reads token files, not the synthetic source".into())
            })??;
            refuse_unindexed(&ds, opts.documents, &name)?;
            let sampler = SamplerConfig {
                mode: SamplingMode::EpochWindows,
                seq_len: opts.seq as u64,
                seed: VALIDATION_SEED,
                shard: Shard::SINGLE,
            };
            let mut cfg = LoaderConfig::new(opts.batch);
            cfg.output = OutputType::U32;
            cfg.documents = opts.documents;
            let mut val = Loader::new(Arc::new(ds), sampler, cfg, None)?;
            let batches = (0..e.batches)
                .map(|_| batch_tokens(&*val.next_batch()?, opts.model.vocab, &name))
                .collect::<Result<Vec<_>>>()?;
            Ok(ValidationSet { name, batches })
        })
        .collect()
}

/// Whether the run's data has a loss mask (a file that does not open has none here: the run
/// reports why when it opens it).
pub fn data_has_loss_mask(opts: &TrainOptions) -> bool {
    open_files(&opts.data).is_some_and(|d| d.is_ok_and(|d| d.has_loss_mask()))
}

/// [`estimate::estimate`] of `opts` under `tech`, for its data: with a loss mask, the loader's
/// flags too ([`estimate::TrainerEstimate::with_loss_mask_flags`]); with packed documents,
/// its position ids ([`estimate::TrainerEstimate::with_document_positions`]).
pub fn estimate_with_data(
    opts: &TrainOptions,
    micro: usize,
    tech: &Techniques,
) -> Result<estimate::TrainerEstimate> {
    let mut e = estimate::estimate(&opts.model, opts.seq, micro, opts.batch, tech)?;
    let masked = data_has_loss_mask(opts);
    if masked {
        e = e.with_loss_mask_flags(opts.batch, opts.seq);
    }
    if opts.documents.is_some() {
        e = e.with_document_positions(opts.batch, opts.seq, masked);
    }
    Ok(e)
}

/// Tokens [`describe_documents`] reads to count separator-ended documents: the start of the
/// data stands for the rest, at a bounded cost (milliseconds) before the run.
const DOCUMENT_SAMPLE_TOKENS: u64 = 1 << 24;

/// The line `headroom train` prints for packed documents (`None` without them, or for data
/// that does not open: the run reports why).
pub fn describe_documents(opts: &TrainOptions) -> Option<String> {
    let boundaries = opts.documents?;
    let ds = open_files(&opts.data)?.ok()?;
    const RULES: &str = "each token attends only within its own, positions restart at each, \
                         and a target that starts one is not counted";
    Some(match boundaries {
        DocumentBoundaries::Index => {
            let documents: usize = ds
                .segments()
                .iter()
                .filter_map(|s| s.sequence_index())
                .map(|i| i.document_count())
                .sum();
            format!(
                "documents: {documents} in the data's index, {:.1} tokens each on average; \
                 {RULES}",
                ds.total_tokens() as f64 / documents.max(1) as f64
            )
        }
        DocumentBoundaries::EndsWith(separator) => {
            let (read, ended) = count_separators(&ds, separator, DOCUMENT_SAMPLE_TOKENS);
            let sample = if read == ds.total_tokens() {
                format!("the data's {read} tokens")
            } else {
                format!("the first {read} tokens")
            };
            if ended == 0 {
                format!(
                    "documents: each ends with token {separator}, which does not occur in \
                     {sample}: every window there is one document (is {separator} the \
                     tokenizer's end-of-text id?)"
                )
            } else {
                format!(
                    "documents: each ends with token {separator}; {ended} end in {sample}, \
                     {:.1} tokens each on average; {RULES}",
                    read as f64 / ended as f64
                )
            }
        }
    })
}

/// How many of the first `limit` tokens of `data` (across its segments) there were, and how
/// many of them are `separator`.
fn count_separators(data: &TokenDataset, separator: u32, limit: u64) -> (u64, u64) {
    let (mut read, mut found) = (0u64, 0u64);
    for segment in data.segments() {
        let tokens = segment.tokens();
        let take = (limit - read).min(tokens.len() as u64) as usize;
        found += (0..take)
            .filter(|&i| tokens.get(i) == Some(i64::from(separator)))
            .count() as u64;
        read += take as u64;
        if read == limit {
            break;
        }
    }
    (read, found)
}

/// The line `headroom train` prints for a dataset with a loss mask beside it (`None` for data
/// without one, or that does not open: the run reports why).
pub fn describe_loss_mask(opts: &TrainOptions) -> Option<String> {
    let ds = open_files(&opts.data)?.ok()?;
    ds.has_loss_mask().then(|| {
        let (kept, total) = (ds.counted_tokens(), ds.total_tokens());
        format!(
            "loss mask: {kept} of {total} tokens count as targets ({:.1}%); the loss is their \
             mean, the others get no gradient",
            100.0 * kept as f64 / total.max(1) as f64
        )
    })
}

/// Packed documents from an index the data does not have: refused naming the options, before
/// the loader would refuse it naming its types.
fn refuse_unindexed(
    data: &TokenDataset,
    documents: Option<DocumentBoundaries>,
    name: &str,
) -> Result<()> {
    if documents == Some(DocumentBoundaries::Index)
        && data.segments().iter().any(|s| s.sequence_index().is_none())
    {
        return Err(TrainError::Option {
            option: "--document-attention",
            reason: format!(
                "{name} has no document index (a Megatron .bin/.idx pair has one: `headroom data \
                 build --format megatron`); if its documents each end with a separator token, \
                 name it with --document-separator (GPT-2's <|endoftext|> is 50256)",
            ),
        });
    }
    Ok(())
}

/// The token dataset a run trains on (a token file, or the synthetic source generated in
/// memory), with the synthetic source's entropy rate.
pub fn open_data(opts: &TrainOptions) -> Result<(Arc<TokenDataset>, Option<f64>)> {
    if let Some(files) = open_files(&opts.data) {
        let ds = files?;
        refuse_unindexed(&ds, opts.documents, &data_name(&opts.data))?;
        return Ok((Arc::new(ds), None));
    }
    let DataSource::Synthetic(d) = &opts.data else {
        return Err(TrainError::Config("no training data".into()));
    };
    if opts.model.vocab < d.vocab as usize {
        return Err(TrainError::Config(format!(
            "model vocab {} is smaller than the data's {}",
            opts.model.vocab, d.vocab
        )));
    }
    let chain = MarkovChain::random(d.vocab, d.branching, d.seed)?;
    let ds = chain.dataset(d.tokens, d.seed ^ 0x5eed)?;
    Ok((Arc::new(ds), Some(chain.entropy_rate())))
}

/// The CUDA model over host masters, its allocations reported to `tracker`.
#[cfg(feature = "cuda")]
fn cuda_engine(
    ordinal: usize,
    tracker: &Arc<MemoryTracker>,
    cfg: ModelConfig,
    opts: ModelOptions,
    masters: Vec<CpuTensor>,
) -> Result<Engine> {
    let cuda = headroom_cuda::Cuda::new(ordinal)
        .map_err(|e| TrainError::from(crate::cuda::CudaGptError::Device(e)))?
        .with_alloc_hook(tracker.clone());
    let model = crate::cuda::model_over_host_masters(&cuda, cfg, opts, &masters)?;
    let grads = crate::cuda::alloc_grads(&cuda, &cfg)?;
    Ok(Engine::Cuda {
        model,
        masters,
        grads,
    })
}

/// Without the `cuda` feature a CUDA run is a typed configuration error.
#[cfg(not(feature = "cuda"))]
fn cuda_engine(
    ordinal: usize,
    _: &Arc<MemoryTracker>,
    _: ModelConfig,
    _: ModelOptions,
    _: Vec<CpuTensor>,
) -> Result<Engine> {
    Err(TrainError::Config(format!(
        "cuda:{ordinal} requested, but headroom-trainer was built without its `cuda` feature"
    )))
}

/// What the device-resident optimizer starts from.
// Without the `cuda` feature a CUDA run is refused before these are read.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct ResidentSetup<'a> {
    groups: Vec<AdamWHyper>,
    specs: Vec<ParamSpec>,
    shapes: Vec<Vec<usize>>,
    /// A checkpoint's optimizer state and moment bytes, when resuming.
    saved: Option<(&'a AdamWState, &'a [u8])>,
}

/// The CUDA model with masters, gradient accumulation and AdamW on the device (the resident
/// placement), its allocations reported to `tracker`.
#[cfg(feature = "cuda")]
fn cuda_resident(
    ordinal: usize,
    tracker: &Arc<MemoryTracker>,
    cfg: ModelConfig,
    opts: ModelOptions,
    masters: Vec<CpuTensor>,
    setup: ResidentSetup<'_>,
) -> Result<Stepper> {
    // `masters` is the host copy the device's are uploaded from; it is dropped on return.
    let cuda = headroom_cuda::Cuda::new(ordinal)
        .map_err(|e| TrainError::from(crate::cuda::CudaGptError::Device(e)))?
        .with_alloc_hook(tracker.clone());
    let model = CudaResident::new(
        &cuda,
        cfg,
        opts,
        &masters,
        setup.groups,
        setup.specs,
        setup.saved,
    )?;
    let acc = GradAccumulator::new(model.backend().clone(), setup.shapes)?;
    Ok(Stepper::Device {
        model: Box::new(model),
        acc,
    })
}

/// Without the `cuda` feature a CUDA run is a typed configuration error.
#[cfg(not(feature = "cuda"))]
fn cuda_resident(
    ordinal: usize,
    _: &Arc<MemoryTracker>,
    _: ModelConfig,
    _: ModelOptions,
    _: Vec<CpuTensor>,
    _: ResidentSetup<'_>,
) -> Result<Stepper> {
    Err(TrainError::Config(format!(
        "cuda:{ordinal} requested, but headroom-trainer was built without its `cuda` feature"
    )))
}

/// What the device-resident optimizer does not run, refused before anything is allocated.
fn check_resident_cuda(tech: &Techniques) -> Result<()> {
    if tech.optimizer.state.is_8bit() {
        return Err(TrainError::Config(
            "8-bit optimizer state on CUDA runs only offloaded (the device-resident AdamW keeps \
             f32 moments): use an offloaded placement or f32 state"
                .into(),
        ));
    }
    if tech.model.precision.needs_loss_scaling() {
        return Err(TrainError::Config(format!(
            "{} on CUDA is not supported (the CUDA model runs bf16, which needs no loss scaling)",
            tech.model.precision.name()
        )));
    }
    Ok(())
}

/// Where a step's gradients accumulate and its optimizer runs, with the model they update.
// One per run, built once and never moved in the loop: boxing the host variant would buy
// nothing but an indirection.
#[allow(clippy::large_enum_variant)]
enum Stepper {
    /// f32 accumulation and `CpuAdamW` beside the masters on a `Cpu` backend: the CPU model
    /// (resident or offloaded), or the CUDA model with an offloaded placement.
    Host {
        engine: Engine,
        acc: GradAccumulator<Cpu>,
        opt: CpuAdamW,
    },
    /// The CUDA model with masters, accumulation and AdamW on the device (resident placement).
    #[cfg(feature = "cuda")]
    Device {
        model: Box<CudaResident>,
        acc: GradAccumulator<headroom_cuda::Cuda>,
    },
}

/// Run one micro-batch's `backward` into `acc`'s buffers (it must *add* the gradient of
/// `weight × Σ losses`); on failure the step is abandoned and the backward's error returned.
fn accumulate_micro_batch<B: Backend>(
    acc: &mut GradAccumulator<B>,
    counted: u64,
    backward: impl FnOnce(&mut [B::Tensor], f32) -> Result<(f32, ScheduleStats)>,
) -> Result<Option<(f32, ScheduleStats)>> {
    let mut out = None;
    let r = acc.accumulate_in_place(
        MicroBatchStats {
            counted_tokens: counted,
            loss_sum: 0.0,
        },
        |_, grads, weight| -> Result<()> {
            out = Some(backward(grads, weight)?);
            Ok(())
        },
    );
    if let Err(e) = r {
        // The step is lost either way; the original error is the one to report.
        let _ = acc.abandon_step();
        return Err(e.into());
    }
    Ok(out)
}

impl Stepper {
    /// LoRA dropout's masks are keyed by the step and the micro-batch (CPU model only; the
    /// CUDA path does not fine-tune).
    fn set_dropout_position(&self, step: usize, micro_batch: usize) {
        #[allow(irrefutable_let_patterns)]
        if let Stepper::Host {
            engine: Engine::Cpu(model),
            ..
        } = self
        {
            model.set_dropout_position(step as u64, micro_batch as u64);
        }
    }

    fn begin_step(&mut self, tokens: StepTokens) -> Result<()> {
        match self {
            Stepper::Host { acc, .. } => acc.begin_step(tokens)?,
            #[cfg(feature = "cuda")]
            Stepper::Device { acc, .. } => acc.begin_step(tokens)?,
        }
        Ok(())
    }

    /// One micro-batch of `g` rows, `counted` of whose targets count, its loss gradient
    /// seeded with the accumulator's token weight times `loss_scale`: its mean loss (over the
    /// counted targets) and the schedule's figures.
    fn micro_batch(
        &mut self,
        tokens: &[u32],
        targets: &[u32],
        counted: u64,
        g: Geometry<'_>,
        loss_scale: f32,
        schedule: &Schedule,
    ) -> Result<Option<(f32, ScheduleStats)>> {
        match self {
            Stepper::Host { engine, acc, .. } => {
                accumulate_micro_batch(acc, counted, |grads, w| {
                    engine.micro_batch(tokens, targets, g, grads, w * loss_scale, schedule)
                })
            }
            #[cfg(feature = "cuda")]
            Stepper::Device { model, acc } => accumulate_micro_batch(acc, counted, |grads, w| {
                model.micro_batch(tokens, targets, g, grads, w * loss_scale, schedule)
            }),
        }
    }

    /// Unscale (fp16), skip on overflow, clip to `max_norm`: headroom-accum's one
    /// implementation on either backend, so the device's clip coefficient is the host's
    /// formula (`max_norm / norm` from the per-tensor f64 sums of squares added in parameter
    /// order).
    fn finish_step(
        &mut self,
        scaler: Option<&mut LossScaler>,
        max_norm: f64,
    ) -> Result<headroom_accum::StepReport> {
        // An infinite clip (`--grad-clip inf`) is no clipping; the norm is still measured.
        let clip = max_norm.is_finite().then_some(max_norm);
        Ok(match self {
            Stepper::Host { acc, .. } => match scaler {
                Some(s) => acc.finish_step(&mut ScalerAdapter(s), clip)?,
                None => acc.finish_step(&mut NoLossScaling, clip)?,
            },
            #[cfg(feature = "cuda")]
            Stepper::Device { acc, .. } => {
                if scaler.is_some() {
                    return Err(TrainError::Config(
                        "loss scaling is not supported by the device-resident optimizer".into(),
                    ));
                }
                acc.finish_step(&mut NoLossScaling, clip)?
            }
        })
    }

    /// Mean loss over `batches` (forward only, `micro` sequences at a time).
    fn eval_loss(&self, batches: &[TokenBatch], micro: usize, seq: usize) -> Result<f32> {
        let gpt =
            match self {
                Stepper::Host {
                    engine: Engine::Cpu(gpt),
                    ..
                } => gpt,
                #[allow(unreachable_patterns)]
                _ => return Err(TrainError::Config(
                    "validation runs on the CPU model only (the CUDA model has no forward-only \
                     path yet)"
                        .into(),
                )),
            };
        let rows = micro * seq;
        let g = Geometry::new(micro, seq);
        validation_mean(batches, rows, |tok, tgt, positions| {
            let documents = packed_documents(positions, micro, seq)?;
            gpt.loss(tok, tgt, g.packed(documents.as_ref())?)
        })
    }

    /// Both groups' learning rate.
    fn set_lr(&mut self, lr: f64) -> Result<()> {
        for g in 0..2 {
            match self {
                Stepper::Host { opt, .. } => opt.set_lr(g, lr)?,
                #[cfg(feature = "cuda")]
                Stepper::Device { model, .. } => model.set_lr(g, lr)?,
            }
        }
        Ok(())
    }

    /// One AdamW step of every parameter from the finished step's gradients, and the
    /// refresh of what the model computes with.
    fn apply(&mut self) -> Result<()> {
        match self {
            Stepper::Host { engine, acc, opt } => {
                let grads = acc.gradients();
                for (i, (p, gr)) in engine.masters_mut().iter_mut().zip(grads).enumerate() {
                    opt.step(
                        i,
                        p.as_mut_slice::<f32>()?,
                        FloatSlice::F32(gr.as_slice::<f32>()?),
                        None,
                    )?;
                }
                engine.refresh()
            }
            #[cfg(feature = "cuda")]
            Stepper::Device { model, acc } => model.apply(acc.gradients()),
        }
    }

    /// The bytes a checkpoint of this run writes for its tensors: the f32 masters (the
    /// adapters of a fine-tuning run) and the optimizer's moments as saved. Its JSON files
    /// and headers come on top.
    fn checkpoint_bytes(&self) -> u64 {
        use headroom_tensor::Tensor as _;
        let f32_bytes = |ts: &[CpuTensor]| ts.iter().map(|t| t.numel() as u64 * 4).sum::<u64>();
        match self {
            Stepper::Host { engine, opt, .. } => {
                f32_bytes(engine.masters()) + opt.moments().len() as u64
            }
            #[cfg(feature = "cuda")]
            Stepper::Device { model, .. } => model.checkpoint_bytes(),
        }
    }

    /// Write a checkpoint after `step` completed steps (the device path in the host
    /// optimizer's format, through transient host copies on `host`).
    #[allow(clippy::too_many_arguments)]
    fn save(
        &mut self,
        dir: &std::path::Path,
        keep: usize,
        max_shard_bytes: u64,
        step: usize,
        config: ModelConfig,
        run: RunSpec,
        loader: &Loader,
        scaler: Option<headroom_amp::LossScalerState>,
        finetune: Option<checkpoint::FinetuneState>,
        companions: &Companions,
        host: &Cpu,
    ) -> Result<PathBuf> {
        match self {
            Stepper::Host { engine, opt, .. } => {
                // The masters are host tensors already: no staging copy.
                let _ = host;
                opt.flush()?;
                let mut state = TrainingState::new(step, config, run, opt.state(), loader.state());
                state.scaler = scaler;
                state.finetune = finetune;
                checkpoint::save_sharded(
                    dir,
                    &state,
                    engine.masters(),
                    opt.moments(),
                    keep,
                    max_shard_bytes,
                    companions,
                )
            }
            #[cfg(feature = "cuda")]
            Stepper::Device { model, .. } => {
                let (masters, opt_state, moments) = model.checkpoint_parts(host)?;
                let mut state = TrainingState::new(step, config, run, opt_state, loader.state());
                state.scaler = scaler;
                checkpoint::save_sharded(
                    dir,
                    &state,
                    &masters,
                    &moments,
                    keep,
                    max_shard_bytes,
                    companions,
                )
            }
        }
    }
}

/// Train from scratch (or resume), calling `on_step` after every step.
pub fn train(opts: &TrainOptions, mut on_step: impl FnMut(&StepLog)) -> Result<TrainReport> {
    opts.validate()?;
    let tech = &opts.techniques;
    let micro = opts.micro_batch()?;
    // The estimator is exact for the CPU model: a run that cannot fit this machine is refused
    // here, before the first allocation, rather than aborting or swapping half-way.
    if opts.device == ComputeDevice::Cpu && opts.check_machine_memory {
        let e = estimate_with_data(opts, micro, tech)?;
        let need = e.device_total().saturating_add(e.host.total());
        if let Some(have) = machine_memory_bytes() {
            if need > have {
                return Err(TrainError::MachineMemory { need, have });
            }
        }
    }
    if matches!(opts.device, ComputeDevice::Cuda { .. }) && !tech.optimizer.is_offloaded() {
        check_resident_cuda(tech)?;
    }
    let tracker = Arc::new(MemoryTracker::new());
    let dev = opts.device.tracked();
    tracker.set_budget(dev, opts.budget);
    let outputs = &opts.memory_outputs;
    if outputs.any() {
        tracker.start_timeline();
    }
    let result = train_tracked(opts, &tracker, &mut on_step);
    if outputs.any() {
        if let Some(timeline) = tracker.stop_timeline() {
            let written = outputs.write(&timeline, dev, opts.budget, &timeline_title(opts));
            // A failed run reports its own error; the files are best-effort then.
            if result.is_ok() {
                written?;
            }
        }
    }
    result
}

/// The memory plot's title: the model's shape and the techniques that set its memory. Short
/// enough for the plot's width; the techniques are in the trace's metadata too.
pub(crate) fn timeline_title(opts: &TrainOptions) -> String {
    let tech = &opts.techniques;
    format!(
        "{}, batch {}×{}, {}, checkpoint {}",
        opts.model.shape_name(),
        opts.batch,
        opts.seq,
        tech.model.precision.name(),
        tech.checkpoint.name()
    )
}

/// The run itself, its device allocations reported to `tracker`.
fn train_tracked(
    opts: &TrainOptions,
    tracker: &Arc<MemoryTracker>,
    on_step: &mut impl FnMut(&StepLog),
) -> Result<TrainReport> {
    let tech = &opts.techniques;
    let micro = opts.micro_batch()?;
    let precision = tech.model.precision;
    let dev = opts.device.tracked();
    // PEFT's flag for GPT-2's Conv1D bases (merges there transpose); headroom's own weights
    // are `[out, in]` either way.
    let finetune = tech.finetune.clone().map(|mut f| {
        f.lora.fan_in_fan_out = matches!(opts.model.family, crate::model::Family::Gpt2);
        f
    });
    // Every step allocates the same shapes: reuse freed buffers rather than fault in fresh
    // pages each step (the tracker still sees every tensor allocated and freed).
    let cpu = Cpu::new()
        .with_alloc_hook(tracker.clone())
        .with_buffer_cache(usize::MAX);
    let host_tracker = Arc::new(MemoryTracker::new());
    let host = Cpu::new().with_alloc_hook(host_tracker.clone());

    let (dataset, entropy_floor) = open_data(opts)?;
    let data_label = data_name(&opts.data);
    let sampler = SamplerConfig {
        mode: SamplingMode::EpochWindows,
        seq_len: opts.seq as u64,
        seed: opts.seed,
        shard: Shard::SINGLE,
    };
    let mut loader_cfg = LoaderConfig::new(opts.batch);
    loader_cfg.output = OutputType::U32;
    loader_cfg.documents = opts.documents;
    // Held for the run, taken before the root is inspected so nothing changes it meanwhile.
    let _root_lock = match &opts.save {
        Some((root, _)) => checkpoint::lock_root(root)?,
        None => None,
    };
    let resume = match &opts.resume_from {
        Some(dir) => {
            let ck = checkpoint::ResumePoint::open(dir)?;
            let mut differences = Vec::new();
            if ck.state.config != opts.model {
                differences.push(format!(
                    "model: checkpoint {:?}, this run {:?}",
                    ck.state.config, opts.model
                ));
            }
            differences.extend(ck.state.run.differences(&opts.run_spec(), ck.state.step));
            // Where the base lives may change between runs; what it holds is checked by its
            // fingerprint below.
            let comparable = |f: Option<&FinetuneSpec>| {
                f.cloned().map(|mut f| {
                    f.lora.base_model_name_or_path = None;
                    f
                })
            };
            let (was, now) = (
                comparable(ck.state.finetune.as_ref().map(|f| &f.spec)),
                comparable(finetune.as_ref()),
            );
            if was != now {
                let show = |f: &Option<FinetuneSpec>| match f {
                    Some(f) => format!("{} (seed {})", f.describe(), f.lora.seed),
                    None => "full training".into(),
                };
                differences.push(format!(
                    "fine-tuning: checkpoint {}, this run {}",
                    show(&was),
                    show(&now)
                ));
            }
            // A saved state resumes in its own format (both 8-bit formats count as 8-bit:
            // `--adam-8bit` resumes code-book state in the code book), but f32 and 8-bit are a
            // different optimizer, not a detail to override silently.
            let (was, now) = (ck.state.optimizer.precision, tech.optimizer.state);
            if was.is_8bit() != now.is_8bit() {
                let name = |p: StatePrecision| if p.is_8bit() { "8-bit" } else { "f32" };
                differences.push(format!(
                    "--adam-8bit: checkpoint's optimizer state {}, this run {}",
                    name(was),
                    name(now)
                ));
            }
            if ck.state.step > opts.steps {
                differences.push(format!(
                    "the checkpoint is at step {}, past this run's {} steps",
                    ck.state.step, opts.steps
                ));
            }
            if !differences.is_empty() {
                return Err(TrainError::ResumeMismatch {
                    path: ck.dir.clone(),
                    differences,
                });
            }
            if let Some((root, _)) = &opts.save {
                checkpoint::refuse_later_checkpoints(root, ck.state.step)?;
            }
            Some(ck)
        }
        None => {
            if let Some((root, _)) = &opts.save {
                checkpoint::refuse_used_root(root)?;
            }
            None
        }
    };
    // The tokenizer and generation config every checkpoint and export of the run carries, as
    // a Hugging Face Trainer's do: the resumed checkpoint's, else the base's. Read now, so a
    // bad file is refused before the first step.
    let settings = opts.tokenizer_settings();
    let companions =
        if opts.save.is_some() || opts.merge_into.is_some() || settings.changes_anything() {
            let saved = resume.as_ref().map(|ck| ck.companions()).transpose()?;
            Companions::of_run(saved, opts.init_from.as_deref(), &settings)?
        } else {
            Companions::none()
        };
    // Batch buffers are host memory: the device's ledger when the device is the CPU.
    let data_hook = match opts.device {
        ComputeDevice::Cpu => cpu.alloc_hook().cloned(),
        ComputeDevice::Cuda { .. } => host.alloc_hook().cloned(),
    };
    let mut loader = {
        let _g = MemoryCategory::Data.enter();
        let _l = headroom_profiler::label_absolute("data.batch");
        match &resume {
            Some(ck) => Loader::resume(dataset, &ck.state.loader, loader_cfg, data_hook)?,
            None => Loader::new(dataset, sampler, loader_cfg, data_hook)?,
        }
    };

    let val_sets = validation_sets(opts)?;

    // fp32 masters: on the host when offloading a low-precision run (the device keeps only the
    // working copy); otherwise they are the device's weights. On CUDA they start on the host:
    // an offloaded placement keeps them there (with accumulation and AdamW), the resident one
    // copies them to the device and drops the host copy.
    let on_cuda = matches!(opts.device, ComputeDevice::Cuda { .. });
    // The device ordinal when everything stays on a CUDA device.
    let resident_cuda = match opts.device {
        ComputeDevice::Cuda { ordinal } if !tech.optimizer.is_offloaded() => Some(ordinal),
        _ => None,
    };
    // CUDA with an offloaded placement: masters, accumulation and AdamW on the host.
    let on_host = on_cuda && resident_cuda.is_none();
    // A fine-tuning run's base never has masters: its working form is built on the device.
    let masters_on = if finetune.is_none()
        && (on_cuda || (precision.is_low() && tech.optimizer.is_offloaded()))
    {
        &host
    } else {
        &cpu
    };
    let mut model_opts = tech.model;
    if tech.checkpoint == CheckpointChoice::Selective {
        model_opts.selective = true;
    }
    // Offloading the optimizer offloads the gradients too: they reach the host part by part
    // as backward produces them (the accumulator and clipping work there).
    model_opts.offload_grads = tech.optimizer.is_offloaded() && !on_host;
    let check_shape = |cfg: ModelConfig, dir: &std::path::Path| -> Result<()> {
        if cfg != opts.model {
            return Err(TrainError::Option {
                option: "--init-from",
                reason: format!(
                    "{} holds {cfg:?}, the run's model is {:?}",
                    dir.display(),
                    opts.model
                ),
            });
        }
        Ok(())
    };
    // A fine-tuning run streams its base into its frozen form, one tensor at a time (the
    // whole fp32 base never exists), fingerprinting it: a resume must find the same base.
    let mut tuned: Option<(Model, checkpoint::FinetuneState)> = None;
    let masters = match &finetune {
        Some(spec) => {
            let mut b = FinetuneBuilder::new(&cpu, opts.model, model_opts, spec.clone())?;
            match &opts.init_from {
                Some(dir) => check_shape(crate::hf::load_into(dir, &cpu, &mut b)?, dir)?,
                None => params::init_params_into(&cpu, &opts.model, opts.seed, &mut b)?,
            }
            let state = checkpoint::FinetuneState {
                spec: spec.clone(),
                base_xxh3: b.fingerprint(),
            };
            if let Some(ck) = &resume {
                let saved = ck.state.finetune.as_ref().map(|f| f.base_xxh3.as_str());
                if saved != Some(state.base_xxh3.as_str()) {
                    return Err(TrainError::ResumeMismatch {
                        path: ck.dir.clone(),
                        differences: vec![format!(
                            "frozen base: checkpoint {saved:?}, this run {} (another \
                             --init-from or --seed)",
                            state.base_xxh3
                        )],
                    });
                }
            }
            let model = b.finish(resume.as_ref().and_then(|ck| ck.adapters.as_deref()))?;
            tuned = Some((model, state));
            Vec::new()
        }
        // A resumed run reads its masters from the checkpoint, tensor by tensor.
        None => match (&resume, &opts.init_from) {
            (Some(ck), _) => ck.read_masters(masters_on)?,
            (None, Some(dir)) => {
                let (cfg, masters) = crate::hf::load(dir, masters_on)?;
                check_shape(cfg, dir)?;
                masters
            }
            (None, None) => params::init_params(masters_on, &opts.model, opts.seed)?,
        },
    };
    let finetune_state = tuned.as_ref().map(|(_, s)| s.clone());
    let trainable_infos = match &finetune {
        Some(spec) => crate::model::finetune::adapter_infos(&opts.model, &spec.lora)?,
        None => params::param_infos(&opts.model),
    };
    let shapes: Vec<Vec<usize>> = trainable_infos.into_iter().map(|i| i.shape).collect();
    // GPT-2 practice: decay matrices and embeddings, not biases or norm gains.
    let specs: Vec<ParamSpec> = shapes
        .iter()
        .map(|s| ParamSpec {
            numel: s.iter().product(),
            group: if s.len() >= 2 { 0 } else { 1 },
        })
        .collect();
    let run = opts.run_spec();
    let groups = vec![run.adamw_hyper(opts.lr, 0), run.adamw_hyper(opts.lr, 1)];
    let mut stepper = if let Some(ordinal) = resident_cuda {
        // The device's moments are uploaded from host bytes: read whole.
        let moments = resume.as_ref().map(|ck| ck.moments()).transpose()?;
        let saved = resume
            .as_ref()
            .zip(moments.as_deref())
            .map(|(ck, m)| (&ck.state.optimizer, m));
        cuda_resident(
            ordinal,
            tracker,
            opts.model,
            model_opts,
            masters,
            ResidentSetup {
                groups,
                specs,
                shapes,
                saved,
            },
        )?
    } else {
        let grads_on_host = on_host || tech.optimizer.is_offloaded();
        let engine = match opts.device {
            ComputeDevice::Cpu => match tuned.take() {
                Some((model, _)) => Engine::Cpu(model),
                None => Engine::Cpu(Model::from_masters(&cpu, opts.model, model_opts, masters)?),
            },
            ComputeDevice::Cuda { ordinal } => {
                cuda_engine(ordinal, tracker, opts.model, model_opts, masters)?
            }
        };
        let acc_backend = if grads_on_host {
            host.clone()
        } else {
            cpu.clone()
        };
        let acc = {
            let _l = headroom_profiler::label_absolute("grads (accumulator)");
            GradAccumulator::new(acc_backend, shapes.iter().cloned())?
        };
        let _l = headroom_profiler::label_absolute("optimizer.moments");
        let state_backend = if on_host || tech.optimizer.is_offloaded() {
            &host
        } else {
            &cpu
        };
        let opt = match (&resume, &tech.optimizer.placement) {
            // The moments go from the checkpoint's file straight into the new store.
            (Some(ck), placement) => ck.read_moments(|len, reader, source| {
                let store = match placement {
                    OptimizerPlacement::File(path) => StoreSpec::File(path),
                    _ => StoreSpec::Ram(state_backend),
                };
                Ok(CpuAdamW::restore_from_reader(
                    &ck.state.optimizer,
                    store,
                    len,
                    reader,
                    source,
                )?)
            })?,
            (None, OptimizerPlacement::File(path)) => {
                CpuAdamW::new(groups, &specs, tech.optimizer.state, StoreSpec::File(path))?
            }
            (None, _) => CpuAdamW::new(
                groups,
                &specs,
                tech.optimizer.state,
                StoreSpec::Ram(state_backend),
            )?,
        };
        Stepper::Host { engine, acc, opt }
    };
    let mut scaler = if precision.needs_loss_scaling() {
        let cfg = LossScalerConfig {
            min_scale: opts.min_loss_scale,
            ..LossScalerConfig::default()
        };
        Some(match resume.as_ref().and_then(|ck| ck.state.scaler) {
            Some(state) => LossScaler::from_parts(cfg, state)?,
            None => LossScaler::new(cfg)?,
        })
    } else {
        None
    };
    let start = resume.as_ref().map_or(0, |ck| ck.state.step);
    drop(resume);
    // A save writes a whole checkpoint before it prunes an older one: a file system that
    // cannot hold one is refused now, not when the first save fails after hours of steps.
    let checkpoint_bytes = stepper.checkpoint_bytes() + companions.bytes();
    if let Some((root, _)) = &opts.save {
        checkpoint::check_room(root, checkpoint_bytes, "--checkpoint-dir")?;
    }

    let mg = Geometry::new(micro, opts.seq);
    let schedule = block_schedule(tech.checkpoint, &opts.model, || {
        let est = estimate_with_data(opts, micro, tech)?;
        let budget = match tech.checkpoint {
            CheckpointChoice::Optimal(Some(b)) => b,
            _ => {
                let total = opts.budget.ok_or_else(|| {
                    TrainError::Config(
                        "the optimal checkpoint schedule needs a byte budget (--budget-mib or an explicit one)"
                            .into(),
                    )
                })?;
                total.saturating_sub(est.device_total() - est.device[MemoryCategory::Activations])
            }
        };
        Ok((est.block_chain_cost()?, budget))
    })?;

    let tokens_per_step = (opts.batch * opts.seq) as u64;
    let end = opts.stop_after.map_or(opts.steps, |k| k.min(opts.steps));
    let mut logs = Vec::with_capacity(end.saturating_sub(start));
    let mut stopped = false;
    let mut last_checkpoint = None;
    let mut last_val = None;
    let mut last_vals = Vec::new();
    for step in start..end {
        if tracker.is_recording() {
            tracker.mark(&format!("step {step}"));
        }
        let t0 = Instant::now();
        let TokenBatch {
            tokens,
            targets,
            positions,
        } = batch_tokens(&*loader.next_batch()?, opts.model.vocab, &data_label)?;
        // Every target counts, or those the loss mask keeps: the step's mean is over these,
        // whichever micro-batch holds them (headroom-accum's token weighting).
        let counted = counted_targets(&targets) as u64;
        let mut block_forwards = 0;
        let mut loss_sum = 0.0f64;
        let lr = opts.lr_at(step);
        let (applied, grad_norm) = if counted == 0 {
            // A batch of prompts only has no loss and no gradient: the step is skipped, as
            // an fp16 overflow's is (the schedule still advances).
            stepper.set_lr(lr)?;
            (false, f64::NAN)
        } else {
            stepper.begin_step(StepTokens::single_device(counted)?)?;
            let loss_scale = scaler.as_ref().map_or(1.0, |s| s.scale());
            {
                let _phase = tracker.phase("forward+backward");
                let rows = micro * opts.seq;
                for (micro_index, (tok, tgt)) in
                    tokens.chunks(rows).zip(targets.chunks(rows)).enumerate()
                {
                    let mb_counted = counted_targets(tgt) as u64;
                    if mb_counted == 0 {
                        // Its gradient would be exactly 0.
                        continue;
                    }
                    stepper.set_dropout_position(step, micro_index);
                    let documents =
                        micro_documents(positions.as_deref(), micro_index, micro, opts.seq)?;
                    let g = mg.packed(documents.as_ref())?;
                    let out =
                        stepper.micro_batch(tok, tgt, mb_counted, g, loss_scale, &schedule)?;
                    let (mb_loss, stats) = out.unwrap_or_default();
                    block_forwards += stats.forward_count;
                    // Per-token losses are summed in f64 by the head; the micro-batch mean
                    // times its counted rows recovers that sum to f32 precision.
                    loss_sum += mb_loss as f64 * mb_counted as f64;
                }
            }
            let report = stepper.finish_step(scaler.as_mut(), opts.grad_clip)?;
            stepper.set_lr(lr)?;
            match report.outcome {
                headroom_accum::StepOutcome::Applied { grad_norm, .. } => (true, grad_norm),
                headroom_accum::StepOutcome::Skipped => (false, f64::NAN),
            }
        };
        if applied {
            let _phase = tracker.phase("optimizer");
            stepper.apply()?;
        }
        let seconds = t0.elapsed().as_secs_f64();
        let val_losses = match &opts.eval {
            Some(e) if (e.every > 0 && (step + 1) % e.every == 0) || step + 1 == end => {
                let _phase = tracker.phase("eval");
                // The targets scored: those each validation file's loss mask keeps.
                let per_set = val_sets
                    .iter()
                    .map(|set| {
                        Ok((
                            stepper.eval_loss(&set.batches, micro, opts.seq)?,
                            set.counted(),
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let counted = per_set.iter().map(|&(_, n)| n).sum();
                last_val = Some((overall_loss(&per_set), counted));
                last_vals = val_sets
                    .iter()
                    .zip(&per_set)
                    .map(|(set, &(loss, n))| (set.name.clone(), loss, n))
                    .collect();
                per_set.into_iter().map(|(loss, _)| loss).collect()
            }
            _ => Vec::new(),
        };
        let log = StepLog {
            step,
            loss: if counted == 0 {
                f32::NAN
            } else {
                (loss_sum / counted as f64) as f32
            },
            lr,
            grad_norm,
            applied,
            loss_scale: scaler.as_ref().map_or(1.0, |s| s.scale()),
            block_forwards,
            seconds,
            tokens_per_s: tokens_per_step as f64 / seconds,
            live_bytes: tracker.live_bytes(dev),
            peak_bytes: tracker.peak_bytes(dev),
            val_loss: (!val_losses.is_empty()).then(|| last_val.map_or(f32::NAN, |(v, _)| v)),
            val_losses,
            counted_targets: counted,
        };
        on_step(&log);
        logs.push(log);
        stopped = opts
            .stop
            .as_ref()
            .is_some_and(|flag| flag.load(Ordering::SeqCst));
        let done = step + 1;
        if let Some((dir, every)) = &opts.save {
            let periodic = *every > 0 && done % every == 0;
            if periodic || stopped || done == opts.steps {
                let scaler_state = scaler.as_ref().map(|s| *s.state());
                last_checkpoint = Some(stepper.save(
                    dir,
                    opts.keep_checkpoints,
                    opts.max_shard_bytes,
                    done,
                    opts.model,
                    opts.run_spec(),
                    &loader,
                    scaler_state,
                    finetune_state.clone(),
                    &companions,
                    &host,
                )?);
                if !stopped && done < opts.steps {
                    checkpoint::warn_if_no_room(dir, checkpoint_bytes);
                }
            }
        }
        if stopped {
            break;
        }
    }
    if let (Some(out), Some(f)) = (&opts.merge_into, &finetune_state) {
        let _phase = tracker.phase("merge");
        let engine = match &stepper {
            Stepper::Host { engine, .. } => engine,
            #[allow(unreachable_patterns)]
            _ => {
                return Err(TrainError::Config(
                    "fine-tuning runs on the host stepper only".into(),
                ))
            }
        };
        let slices = engine
            .masters()
            .iter()
            .map(|t| Ok(t.as_slice::<f32>()?))
            .collect::<Result<Vec<_>>>()?;
        let adapter = checkpoint::adapter_of(&opts.model, &f.spec, &slices)?;
        // The base again in fp32, on the host ledger (the trained run's device memory is
        // untouched); it must be the one trained on.
        let mut base = match &opts.init_from {
            Some(dir) => crate::hf::load(dir, &host)?.1,
            None => params::init_params(&host, &opts.model, opts.seed)?,
        };
        if checkpoint::base_fingerprint(&base)? != f.base_xxh3 {
            return Err(TrainError::Option {
                option: "--merge-into",
                reason: "the base model changed on disk during the run".into(),
            });
        }
        crate::adapters::merge(&opts.model, &mut base, &adapter, out)?;
        checkpoint::save_hf_with(out, &opts.model, &base, opts.max_shard_bytes, &companions)?;
    }
    let memory = tracker.snapshot();
    let memory_table = memory_summary(&memory, &ReportContext::with_process_memory());
    Ok(TrainReport {
        steps: logs,
        entropy_floor,
        memory,
        host_memory: host_tracker.snapshot(),
        memory_table,
        schedule,
        stopped,
        last_checkpoint,
        val_loss: last_val,
        val_losses: last_vals,
    })
}
#[cfg(test)]
mod tests {
    use super::*;

    /// A report is flushed whole, or, when writing it fails part-way (a full disk), the error
    /// names the file and its cause and no truncated file is left.
    #[test]
    fn a_report_is_written_whole_or_not_at_all() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("report.json");
        write_report(&path, |w| Ok(w.write_all(b"{\"complete\": true}")?)).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"complete\": true}");

        let e = write_report(&path, |w| {
            w.write_all(b"{\"half")?;
            w.flush()?;
            Err(std::io::Error::other("No space left on device").into())
        })
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("memory report {}: No space left on device", path.display())
        );
        assert!(!path.exists());
    }

    #[test]
    fn lr_schedule_warms_up_then_decays_to_the_floor() {
        let o = TrainOptions {
            steps: 100,
            warmup: 10,
            lr: 1.0,
            min_lr_frac: 0.1,
            ..TrainOptions::tiny_default()
        };
        assert!((o.lr_at(0) - 0.1).abs() < 1e-12);
        assert!((o.lr_at(9) - 1.0).abs() < 1e-12);
        assert!((o.lr_at(10) - 1.0).abs() < 1e-12);
        assert!((o.lr_at(55) - 0.55).abs() < 1e-12);
        assert!((o.lr_at(100) - 0.1).abs() < 1e-12);
        assert!((1..100).all(|s| s < 10 || o.lr_at(s) <= o.lr_at(s - 1)));
    }

    #[test]
    fn each_schedule_passes_its_landmarks() {
        let o = |lr_schedule| TrainOptions {
            steps: 100,
            warmup: 10,
            lr: 1.0,
            min_lr_frac: 0.1,
            lr_schedule,
            ..TrainOptions::tiny_default()
        };
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        let linear = o(LrSchedule::Linear);
        assert!(close(linear.lr_at(0), 0.1) && close(linear.lr_at(10), 1.0));
        assert!(close(linear.lr_at(55), 0.55) && close(linear.lr_at(100), 0.1));
        let constant = o(LrSchedule::Constant);
        assert!(close(constant.lr_at(4), 0.5));
        assert!((10..=100).all(|s| constant.lr_at(s) == 1.0));
        // wsd turns at step 80 and falls as 1 − √t over the last 20.
        let wsd = o(LrSchedule::Wsd);
        assert!((10..=80).all(|s| wsd.lr_at(s) == 1.0));
        assert!(close(wsd.lr_at(85), 0.1 + 0.9 * (1.0 - 0.25f64.sqrt())));
        assert!(close(wsd.lr_at(100), 0.1));
        assert_eq!(
            (0..=8).map(wsd_decay_start).collect::<Vec<_>>(),
            [0, 0, 1, 2, 3, 4, 4, 5, 6]
        );
        for n in [usize::MAX, usize::MAX - 1, usize::MAX - 3, 12_345] {
            assert_eq!(wsd_decay_start(n) as u128, n as u128 * 4 / 5);
        }
    }

    #[test]
    fn the_optimizer_line_names_every_setting() {
        let mut o = TrainOptions::small_default();
        assert_eq!(
            o.describe_optimizer(),
            "AdamW β (0.9, 0.95), ε 1e-8, weight decay 0.1; lr 6e-4, 2 warmup steps, cosine to \
             6e-5; grad clip 1"
        );
        o.lr_schedule = LrSchedule::Wsd;
        o.min_lr_frac = 0.0;
        o.grad_clip = f64::INFINITY;
        assert!(o
            .describe_optimizer()
            .ends_with("wsd: constant until step 16, then 1 − √t to 0; no grad clip"));
    }

    proptest::proptest! {
        /// `RunSpec::same_rates_before`, decided from the schedule, is what comparing every
        /// learning rate of the steps taken says, for every checkpoint a run can write.
        #[test]
        fn same_rates_before_is_the_rates_compared(
            which in 0usize..4,
            warmup in 0usize..12,
            steps in 1usize..40,
            other in 1usize..40,
            at_step in 0usize..40,
            floor_is_peak in proptest::bool::ANY,
        ) {
            // A checkpoint lies within its own run.
            let at_step = at_step.min(steps);
            let run = TrainOptions {
                lr: 3e-3,
                min_lr_frac: if floor_is_peak { 1.0 } else { 0.1 },
                warmup,
                steps,
                lr_schedule: LrSchedule::ALL[which],
                ..TrainOptions::tiny_default()
            }
            .run_spec();
            let longer = RunSpec { steps: other, ..run.clone() };
            let compared = (0..at_step).all(|s| run.lr_at(s).to_bits() == longer.lr_at(s).to_bits());
            proptest::prop_assert_eq!(run.same_rates_before(other, at_step), compared);
        }

        /// After the warmup every schedule stays between the floor and the peak and never
        /// rises; cosine, linear and constant start the decay at the peak, and all but
        /// constant end it at the floor.
        #[test]
        fn schedules_decay_between_the_peak_and_the_floor(
            which in 0usize..4,
            warmup in 0usize..50,
            extra in 1usize..400,
            lr in 1e-6f64..1.0,
            min_lr_frac in 0.0f64..=1.0,
        ) {
            let schedule = LrSchedule::ALL[which];
            let steps = warmup + extra;
            let at = |step| lr_schedule(schedule, lr, min_lr_frac, warmup, steps, step);
            let min = lr * min_lr_frac;
            let slack = 1e-12 * lr;
            for step in warmup..=steps {
                let v = at(step);
                proptest::prop_assert!(v >= min - slack && v <= lr + slack, "step {step}: {v}");
                if step > warmup {
                    proptest::prop_assert!(v <= at(step - 1) + slack, "rises at {step}");
                }
            }
            if schedule != LrSchedule::Wsd || warmup < wsd_decay_start(steps) {
                proptest::prop_assert!((at(warmup) - lr).abs() <= slack);
            }
            let end = if schedule == LrSchedule::Constant { lr } else { min };
            proptest::prop_assert!((at(steps) - end).abs() <= slack);
            for step in 0..warmup {
                proptest::prop_assert!(at(step) <= lr + slack && at(step) > 0.0);
            }
        }
    }
}
