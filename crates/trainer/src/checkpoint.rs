//! Checkpoints: the model as safetensors with Hugging Face GPT-2 names, plus everything needed
//! to continue a run bit for bit (optimizer state and moments, data position, step), written so
//! that a crash at any moment leaves either the previous complete checkpoint or the new one.
//!
//! ## Layout
//!
//! A checkpoint *root* (`--checkpoint-dir`) holds one directory per saved step:
//!
//! ```text
//! root/
//!   step-00000010/
//!     model.safetensors   f32 tensors named as transformers' `GPT2Model` expects
//!     config.json         transformers' GPT2Config or LlamaConfig for the shape
//!     optimizer.bin       the AdamW moments (headroom-offload's documented byte layout)
//!     state.json          step, model config, run settings, optimizer/loader/scaler state
//!     tokenizer.json …    the base model's tokenizer, chat templates and generation config
//!                         (a run from a Hugging Face directory; see [`crate::companions`])
//!     manifest.json       format version, step, and every file's size and xxh3-64 checksum
//!   step-00000020/
//!   .partial-step-00000030-4711/   a save in progress (never read)
//! ```
//!
//! A LoRA / QLoRA run's checkpoint holds its adapters instead of `model.safetensors`: PEFT's
//! `adapter_model.safetensors` and `adapter_config.json`, so a step directory loads in PEFT
//! (`PeftModel.from_pretrained(base, step_dir)`) and in `headroom merge --adapter`. The frozen
//! base is not copied; `state.json` records its fingerprint, and a resume refuses another base.
//!
//! A model larger than the shard limit ([`MAX_SHARD_BYTES`], transformers' default; or
//! [`save_sharded`]'s) is written as transformers shards it — `model-00001-of-0000N.safetensors`
//! … plus `model.safetensors.index.json` — every file in the manifest.
//!
//! `model.safetensors`: the four Conv1D weights (`attn.c_attn`, `attn.c_proj`, `mlp.c_fc`,
//! `mlp.c_proj`) are written transposed, `[in, out]`, exactly as Hugging Face stores them;
//! prefix the names with `transformer.` to load them into `GPT2LMHeadModel` (the head is tied
//! to `wte`), or load a step directory directly with `from_pretrained`.
//!
//! ## Why this is crash-consistent
//!
//! A checkpoint is one unit, not a set of files. [`save`] writes every file into a fresh
//! `.partial-…` directory, fsyncs each file, writes the manifest last, fsyncs the directory, and
//! only then *publishes* it with one `rename` to `step-N` (atomic on POSIX file systems) followed
//! by an fsync of the root. Readers only ever look at published `step-*` directories, so a kill
//! at any instant leaves the previous checkpoints untouched and the new one either absent or
//! complete. The manifest's checksums catch what a rename cannot: a directory edited, copied
//! half-way or corrupted afterwards is refused with [`TrainError::Checkpoint`], never resumed.
//!
//! The trade-off: a save rewrites every file (no hard links to an unchanged previous file), and
//! the last `keep` checkpoints occupy `keep`× the space; pruning happens after publishing, so a
//! crash while pruning leaves one checkpoint too many, never one too few. Pruning never removes
//! the checkpoint just published, and a resume refuses a root holding checkpoints past its
//! start (`refuse_later_checkpoints`): by step number alone, those would outlive the resumed
//! run's own and be what a later resume of the root continues.
//!
//! Space: a failed save ends the run, losing the steps since the last checkpoint, so a run
//! whose root cannot hold one checkpoint is refused at its start ([`check_room`]), a warning
//! follows any save after which the next would not fit, and a save that fails anyway (the
//! disk filled meanwhile) removes its `.partial-…` directory rather than keep its space.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use headroom_mmap_data::LoaderState;
use headroom_offload::{AdamWHyper, AdamWState, StatePrecision};
use headroom_tensor::{Backend, Cpu, CpuTensor};
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use headroom_lora::{LoraAdapter, LoraLinear};

use crate::companions::{is_companion, Companions};
use crate::model::{
    params, Family, FinetuneSpec, LlamaClass, Model, ModelConfig, ModelOptions, RopeScaling,
};
use crate::train::LrSchedule;
use crate::{Result, TrainError};

/// Layout version of a checkpoint. Version 1 (flat directory, no manifest) is refused: its
/// files cannot be shown to belong to the same step.
pub const FORMAT_VERSION: u32 = 2;
/// The manifest's file name inside a step directory.
pub const MANIFEST: &str = "manifest.json";
/// transformers' default `max_shard_size` ("50GB" in version 5): a model below it is one file,
/// as `save_pretrained` writes it.
pub const MAX_SHARD_BYTES: u64 = 50_000_000_000;
/// The index of a sharded model (transformers' name and layout).
pub const SHARD_INDEX: &str = "model.safetensors.index.json";
/// Files every checkpoint holds, in the order they are written (the manifest comes after); a
/// sharded one holds its shards and [`SHARD_INDEX`] instead of `model.safetensors`.
pub const FILES: [&str; 4] = [
    "model.safetensors",
    "config.json",
    "optimizer.bin",
    "state.json",
];
const STEP_PREFIX: &str = "step-";
pub(crate) const PARTIAL_PREFIX: &str = ".partial-";
const REPLACED_PREFIX: &str = ".replaced-";
/// JSON files larger than this are not parsed (a manifest is a few hundred bytes, a state a
/// few bytes per parameter tensor).
pub(crate) const MAX_JSON_BYTES: u64 = 256 << 20;

/// The settings of a run that decide its numbers: a checkpoint continues bit for bit only under
/// the same ones. Techniques that do not change a bit (checkpoint schedules, optimizer
/// placement) or that a user may change on purpose (attention algorithm, loss chunking,
/// micro-batching: same mathematics, other f32 summation order) are not part of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Initialisation and data-order seed.
    pub seed: u64,
    /// Planned steps (the learning-rate schedule's length).
    pub steps: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate as a fraction of `lr`.
    pub min_lr_frac: f64,
    /// Warmup steps.
    pub warmup: usize,
    /// The decay after the warmup (`cosine` when not recorded: the only one before it was).
    #[serde(default)]
    pub lr_schedule: LrSchedule,
    /// AdamW's β1 (0.9 when not recorded: the value every run used before it was).
    #[serde(default = "before_recorded::beta1")]
    pub beta1: f64,
    /// AdamW's β2 (0.95 when not recorded, as [`RunSpec::beta1`]).
    #[serde(default = "before_recorded::beta2")]
    pub beta2: f64,
    /// AdamW's ε (1e-8 when not recorded, as [`RunSpec::beta1`]).
    #[serde(default = "before_recorded::eps")]
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Gradient-norm clip (infinite: none, written as `null`, as JSON has no infinity).
    #[serde(with = "infinite_as_null")]
    pub grad_clip: f64,
    /// Working precision (`fp32`, `bf16`, `fp16`).
    pub precision: String,
    /// fp16's loss-scale floor (`--min-loss-scale`): `Some(None)` for none (and for every run
    /// without loss scaling, where it changes nothing), `None` when not recorded — a
    /// checkpoint written before it was, whose floor is unknown and so not compared.
    #[serde(
        default,
        deserialize_with = "recorded",
        skip_serializing_if = "Option::is_none"
    )]
    pub min_loss_scale: Option<Option<f32>>,
    /// Packed documents (`--document-attention`); written only when set, so a run without
    /// them writes the files it always did.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub documents: bool,
    /// The token packed documents end with (`--document-separator`); `None` for the documents
    /// of the data's index, or without packed documents. Written only when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document_separator: Option<u32>,
}

/// What every run used before its checkpoints recorded these settings: the values a
/// checkpoint without them was trained with (so it resumes with them, bit for bit).
mod before_recorded {
    pub fn beta1() -> f64 {
        0.9
    }
    pub fn beta2() -> f64 {
        0.95
    }
    pub fn eps() -> f64 {
        1e-8
    }
}

/// A field that may be `null` inside an optional one: present (even as `null`) is `Some`, so
/// only a missing field (with `#[serde(default)]`) is `None`.
fn recorded<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// An `f64` that may be infinite, as JSON `null` when it is (JSON numbers are finite).
mod infinite_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
        if x.is_finite() {
            s.serialize_f64(*x)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::INFINITY))
    }
}

impl RunSpec {
    /// The learning rate at `step` (0-based), as the run scheduled it.
    pub fn lr_at(&self, step: usize) -> f64 {
        crate::train::lr_schedule(
            self.lr_schedule,
            self.lr,
            self.min_lr_frac,
            self.warmup,
            self.steps,
            step,
        )
    }

    /// The optimizer's settings in one line: `AdamW β (0.9, 0.95), ε 1e-8, weight decay 0.1;
    /// lr 3e-3, 20 warmup steps, cosine to 3e-4; grad clip 1`.
    pub fn describe_optimizer(&self) -> String {
        let floor = crate::train::short_float(self.lr * self.min_lr_frac);
        let decay = match self.lr_schedule {
            LrSchedule::Constant => "constant".to_string(),
            LrSchedule::Wsd => format!(
                "wsd: constant until step {}, then 1 − √t to {floor}",
                crate::train::wsd_decay_start(self.steps)
            ),
            s => format!("{} to {floor}", s.name()),
        };
        let clip = if self.grad_clip.is_finite() {
            format!("grad clip {}", self.grad_clip)
        } else {
            "no grad clip".into()
        };
        format!(
            "AdamW β ({}, {}), ε {}, weight decay {}; lr {}, {} warmup steps, {decay}; {clip}",
            self.beta1,
            self.beta2,
            crate::train::short_float(self.eps),
            self.weight_decay,
            crate::train::short_float(self.lr),
            self.warmup
        )
    }

    /// AdamW's hyper-parameters of parameter group `group` at learning rate `lr`: group 0
    /// (matrices and embeddings) decays, group 1 (biases and norm gains) does not — GPT-2's
    /// practice.
    pub fn adamw_hyper(&self, lr: f64, group: usize) -> AdamWHyper {
        AdamWHyper {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: if group == 0 { self.weight_decay } else { 0.0 },
        }
    }

    /// Whether the learning rates of steps `0..at_step` stay the same, bit for bit, when the
    /// run's length becomes `steps`: always for `constant`, before either run's decay for
    /// `wsd`, and only through the warmup's end for `cosine` and `linear` (whose decay spans
    /// the run). Then a run resumed at `at_step` under the new length is the run that length
    /// would have trained from the start. Decided from the schedule, not by computing the
    /// rates, so a step count read from a file costs nothing (a test checks the rule against
    /// the rates).
    pub fn same_rates_before(&self, steps: usize, at_step: usize) -> bool {
        // A floor equal to the peak makes every decay the peak itself.
        if steps == self.steps || at_step <= self.warmup || self.lr * self.min_lr_frac == self.lr {
            return true;
        }
        match self.lr_schedule {
            LrSchedule::Constant => true,
            // The first decay step of either is still the peak.
            LrSchedule::Wsd => {
                let first_decay = crate::train::wsd_decay_start(self.steps)
                    .min(crate::train::wsd_decay_start(steps));
                at_step <= first_decay + 1
            }
            // The step the warmup ends on is the peak in both (no progress yet); a warmup as
            // long as both runs leaves both a decay of one step.
            LrSchedule::Cosine | LrSchedule::Linear => {
                let span = |n: usize| n.saturating_sub(self.warmup).max(1);
                at_step <= self.warmup + 1 || span(self.steps) == span(steps)
            }
        }
    }

    /// The settings in which `self` (a checkpoint's, saved after `at_step` steps) and `now`
    /// (this run's) differ, as `name: checkpoint → now` lines naming the command-line option.
    /// Another `--steps` is not one while the steps already taken keep their learning rates
    /// ([`RunSpec::same_rates_before`]): a `constant` run, or a `wsd` run in its stable phase,
    /// may be extended or shortened, keeping its moments.
    pub fn differences(&self, now: &RunSpec, at_step: usize) -> Vec<String> {
        let mut d = Vec::new();
        let mut cmp = |name: &str, a: String, b: String| {
            if a != b {
                d.push(format!("{name}: checkpoint {a}, this run {b}"));
            }
        };
        cmp("--batch", self.batch.to_string(), now.batch.to_string());
        cmp("--seq", self.seq.to_string(), now.seq.to_string());
        cmp("--seed", self.seed.to_string(), now.seed.to_string());
        cmp("--lr", self.lr.to_string(), now.lr.to_string());
        cmp(
            "--min-lr",
            (self.lr * self.min_lr_frac).to_string(),
            (now.lr * now.min_lr_frac).to_string(),
        );
        cmp("--warmup", self.warmup.to_string(), now.warmup.to_string());
        cmp(
            "--lr-schedule",
            self.lr_schedule.name().into(),
            now.lr_schedule.name().into(),
        );
        cmp("--beta1", self.beta1.to_string(), now.beta1.to_string());
        cmp("--beta2", self.beta2.to_string(), now.beta2.to_string());
        cmp("--adam-eps", self.eps.to_string(), now.eps.to_string());
        cmp(
            "--weight-decay",
            self.weight_decay.to_string(),
            now.weight_decay.to_string(),
        );
        cmp(
            "--grad-clip",
            self.grad_clip.to_string(),
            now.grad_clip.to_string(),
        );
        cmp("--precision", self.precision.clone(), now.precision.clone());
        cmp(
            "--document-attention",
            self.documents.to_string(),
            now.documents.to_string(),
        );
        let separator = |s: Option<u32>| s.map_or("none".into(), |t| t.to_string());
        cmp(
            "--document-separator",
            separator(self.document_separator),
            separator(now.document_separator),
        );
        if let (Some(was), Some(is)) = (self.min_loss_scale, now.min_loss_scale) {
            let show = |floor: Option<f32>| floor.map_or("none".into(), |f| f.to_string());
            cmp("--min-loss-scale", show(was), show(is));
        }
        // A decay spans --steps, so a run of another length would have taken other learning
        // rates from the decay's first step: past it, it is another run.
        if !self.same_rates_before(now.steps, at_step) {
            d.push(format!(
                "--steps: checkpoint {}, this run {} (the learning rates of the {at_step} steps \
                 taken would differ: the {} decay spans --steps; a constant run, or a wsd run \
                 before its decay, may change its length. To train on, start a new run from a \
                 full checkpoint's weights with --init-from)",
                self.steps,
                now.steps,
                self.lr_schedule.name()
            ));
        }
        d
    }
}

/// The small part of a checkpoint, as JSON (`state.json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainingState {
    /// Layout version of the checkpoint directory.
    pub format_version: u32,
    /// Optimizer steps completed.
    pub step: usize,
    /// The model's shape.
    pub config: ModelConfig,
    /// The run's settings (checked on resume).
    pub run: RunSpec,
    /// Optimizer state without the moments.
    pub optimizer: AdamWState,
    /// The data loader's position.
    pub loader: LoaderState,
    /// The fp16 loss scaler's state (absent in fp32/bf16 runs).
    #[serde(default)]
    pub scaler: Option<headroom_amp::LossScalerState>,
    /// A fine-tuning run's set-up and its frozen base's fingerprint (absent for full training).
    #[serde(default)]
    pub finetune: Option<FinetuneState>,
}

/// What a LoRA / QLoRA checkpoint records about its run beyond the adapters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FinetuneState {
    /// Adapters and base storage.
    pub spec: FinetuneSpec,
    /// xxh3-64 of the frozen base's fp32 values (parameter order, little-endian), 16 hex
    /// digits: a resume on another base would not continue the run.
    pub base_xxh3: String,
}

/// The fingerprint [`FinetuneState::base_xxh3`] records for fp32 `base` tensors.
pub fn base_fingerprint(base: &[CpuTensor]) -> Result<String> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for t in base {
        h.update(bytemuck::cast_slice(t.as_slice::<f32>()?));
    }
    Ok(hex64(h.digest()))
}

/// The adapters of a fine-tuning checkpoint as headroom-lora's [`LoraAdapter`]: `params` are
/// the trainable tensors in [`crate::model::finetune::adapter_infos`] order.
pub fn adapter_of(
    config: &ModelConfig,
    spec: &FinetuneSpec,
    params: &[&[f32]],
) -> Result<LoraAdapter> {
    let modules = crate::model::finetune::adapted_modules(config, &spec.lora)?;
    if params.len() != 2 * modules.len() {
        return Err(TrainError::Config(format!(
            "{} adapter tensors for {} modules",
            params.len(),
            modules.len()
        )));
    }
    let cpu = Cpu::new();
    let linears = modules
        .iter()
        .enumerate()
        .map(|(k, m)| {
            LoraLinear::from_weights(
                &cpu,
                &m.name,
                m.out_features,
                m.in_features,
                &spec.lora,
                params[2 * k],
                params[2 * k + 1],
            )
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(LoraAdapter::from_modules(spec.lora.clone(), linears)?)
}

impl TrainingState {
    /// A state for [`save`].
    pub fn new(
        step: usize,
        config: ModelConfig,
        run: RunSpec,
        optimizer: AdamWState,
        loader: LoaderState,
    ) -> Self {
        TrainingState {
            format_version: FORMAT_VERSION,
            step,
            config,
            run,
            optimizer,
            loader,
            scaler: None,
            finetune: None,
        }
    }
}

/// One file of a checkpoint as the manifest records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// File name inside the step directory.
    pub name: String,
    /// Exact size in bytes.
    pub bytes: u64,
    /// xxh3-64 of the content, 16 lowercase hex digits.
    pub xxh3: String,
}

impl ManifestFile {
    /// The entry of the file at `path` (its file name) with these length and checksum.
    fn of(path: &Path, bytes: u64, xxh3: String) -> Self {
        ManifestFile {
            name: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            bytes,
            xxh3,
        }
    }
}

/// `manifest.json`: what a complete checkpoint holds. Written last inside the step directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Layout version ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// Optimizer steps completed (equals `state.json`'s).
    pub step: usize,
    /// Every file, with size and checksum.
    pub files: Vec<ManifestFile>,
}

impl Manifest {
    /// The entry of the file `name` of the step directory `dir`; a typed error naming the
    /// manifest when it is not listed.
    pub(crate) fn entry(&self, dir: &Path, name: &str) -> Result<&ManifestFile> {
        self.files
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| err(&dir.join(MANIFEST), format!("does not list {name}")))
    }

    /// The model's files (the shards the index names, or the single file) and, when sharded,
    /// where the index puts each tensor.
    fn model_entries(&self, dir: &Path) -> Result<(Vec<&ManifestFile>, Option<WeightMap>)> {
        match self.entry(dir, SHARD_INDEX) {
            Ok(index) => {
                let (entries, map) = shard_entries(dir, self, index)?;
                Ok((entries, Some(map)))
            }
            Err(_) => Ok((vec![self.entry(dir, FILES[0])?], None)),
        }
    }
}

/// A loaded checkpoint, parameters in the trainer's layout.
pub struct Checkpoint {
    /// The step directory it was read from.
    pub dir: PathBuf,
    /// Step, config, optimizer and loader state.
    pub state: TrainingState,
    /// Parameters in [`params::param_infos`] order and layout.
    pub params: Vec<Vec<f32>>,
    /// The optimizer's moment bytes.
    pub moments: Vec<u8>,
}

const ADAPTERS_NOT_A_MODEL: &str = "holds LoRA adapters, not a model: pass the base model and \
     this directory as the adapter (--from BASE --adapter DIR), or merge them (headroom merge)";

impl Checkpoint {
    /// The config and the parameters uploaded to `backend` as fp32 masters (counted as
    /// parameters).
    pub fn into_masters(self, backend: &Cpu) -> Result<(ModelConfig, Vec<CpuTensor>)> {
        if self.state.finetune.is_some() {
            return Err(err(&self.dir, ADAPTERS_NOT_A_MODEL));
        }
        let infos = params::param_infos(&self.state.config);
        let _g = headroom_tensor::MemoryCategory::Parameters.enter();
        let masters = infos
            .iter()
            .zip(&self.params)
            .map(|(info, p)| backend.upload(p, info.shape.clone()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok((self.state.config, masters))
    }

    /// The model this checkpoint holds, its parameters uploaded to `backend`.
    pub fn into_model(self, backend: &Cpu, options: ModelOptions) -> Result<Model> {
        let (config, masters) = self.into_masters(backend)?;
        Model::from_masters(backend, config, options, masters)
    }
}

/// Build the model saved at `path` (a step directory, or a root whose newest checkpoint is
/// used) in one call: the manifest and state checked, the model files verified against the
/// manifest by streamed checksums and read tensor by tensor ([`ResumePoint::read_masters`]);
/// the optimizer state is not read.
pub fn load_model(path: &Path, backend: &Cpu, options: ModelOptions) -> Result<Model> {
    let point = ResumePoint::open(path)?;
    let masters = point.read_masters(backend)?;
    Model::from_masters(backend, point.state.config, options, masters)
}

pub(crate) fn err(path: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |e| err(path, e.to_string())
}

fn hex64(x: u64) -> String {
    format!("{x:016x}")
}

pub(crate) fn checksum(bytes: &[u8]) -> String {
    hex64(xxhash_rust::xxh3::xxh3_64(bytes))
}

/// Write `bytes` to `path` and fsync it (inside a partial directory: no rename needed).
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<ManifestFile> {
    let mut f = fs::File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))?;
    Ok(ManifestFile::of(path, bytes.len() as u64, checksum(bytes)))
}

/// fsync a directory, so the renames and creations inside it are durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))
}

/// `[rows, cols]` row-major → `[cols, rows]`.
fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = x[r * cols + c];
        }
    }
    out
}

/// transformers' config for this shape: with it beside `model.safetensors`,
/// `AutoModelForCausalLM.from_pretrained(dir)` loads the checkpoint — a `GPT2LMHeadModel` (no
/// dropout, tanh GELU, layer norm ε 1e-5, head tied to `wte`) or a `LlamaForCausalLM` (SiLU,
/// no biases, the run's RMSNorm ε, rotary base and rescaling, key/value heads and head tying;
/// a `MistralForCausalLM`, `Qwen2ForCausalLM` or `Qwen3ForCausalLM` for a model of that
/// class; the head width always written), with the token ids the run carries from its base
/// ([`Companions::token_ids`]) — but a Llama's `pad_token_id`, which is its embedding's padding
/// index (`LlamaShape::padding_idx`, null for none).
pub(crate) fn hf_config(
    c: &ModelConfig,
    token_ids: Option<&serde_json::Map<String, serde_json::Value>>,
    dir: &Path,
) -> Result<Vec<u8>> {
    let mut v = match c.family {
        Family::Gpt2 => serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": c.vocab,
            "n_positions": c.max_seq,
            "n_ctx": c.max_seq,
            "n_embd": c.channels,
            "n_layer": c.layers,
            "n_head": c.heads,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "tie_word_embeddings": true,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "torch_dtype": "float32",
        }),
        Family::Llama(s) => serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": c.vocab,
            "hidden_size": c.channels,
            "intermediate_size": s.ffn,
            "num_hidden_layers": c.layers,
            "num_attention_heads": c.heads,
            "num_key_value_heads": s.kv_heads,
            "head_dim": c.head_dim(),
            "max_position_embeddings": c.max_seq,
            "rms_norm_eps": s.norm_eps,
            "rope_theta": s.rope_theta,
            "tie_word_embeddings": s.tied_head,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "attention_dropout": 0.0,
            "torch_dtype": "float32",
        }),
    };
    if let (Family::Llama(s), Some(object)) = (c.family, v.as_object_mut()) {
        if let Some(scaling) = rope_scaling_json(&s.rope_scaling) {
            object.insert("rope_scaling".into(), scaling);
        }
        if s.class != LlamaClass::Llama {
            // Mistral's and Qwen2's classes have no bias settings (Qwen2's q, k and v biases
            // are built in), Qwen3's has attention_bias alone. A sliding window is written as
            // the class reads it (null: none).
            object.insert(
                "architectures".into(),
                serde_json::json!([s.class.architecture()]),
            );
            object.insert("model_type".into(), s.class.model_type().into());
            // Qwen3, Gemma 3 and OLMo have attention_bias, SmolLM3 and Granite both; OLMo 2
            // and Granite have no window.
            if !matches!(
                s.class,
                LlamaClass::Qwen3
                    | LlamaClass::SmolLM3
                    | LlamaClass::Gemma3
                    | LlamaClass::Olmo2
                    | LlamaClass::Olmo3
                    | LlamaClass::Granite
            ) {
                object.remove("attention_bias");
            }
            if !matches!(s.class, LlamaClass::SmolLM3 | LlamaClass::Granite) {
                object.remove("mlp_bias");
            }
            if !matches!(s.class, LlamaClass::Olmo2 | LlamaClass::Granite) {
                let window = s.sliding_window.map(|w| w.size);
                object.insert("sliding_window".into(), window.into());
            }
        }
        if let Some(m) = s.multipliers {
            // GraniteConfig's names.
            object.extend([
                ("embedding_multiplier".into(), m.embedding.into()),
                ("residual_multiplier".into(), m.residual.into()),
                ("attention_multiplier".into(), m.attention.into()),
                ("logits_scaling".into(), m.logits_scaling.into()),
            ]);
        }
        if s.class == LlamaClass::Olmo3 {
            // Olmo3Config's names: one layer type per block, and transformers 5's rotary
            // parameters per layer type (its reading of rope_theta alone would give the
            // windowed blocks its default base); rope_theta and rope_scaling stay beside them,
            // the full blocks', for transformers 4.
            let types = layer_types(c);
            let mut full = rope_scaling_json(&s.rope_scaling)
                .unwrap_or_else(|| serde_json::json!({ "rope_type": "default" }));
            if let Some(f) = full.as_object_mut() {
                f.insert("rope_theta".into(), s.rope_theta.into());
            }
            let sliding_theta = s
                .sliding_window
                .and_then(|w| w.rope_theta)
                .unwrap_or(s.rope_theta);
            object.extend([
                ("layer_types".into(), types.into()),
                (
                    "rope_parameters".into(),
                    serde_json::json!({
                        "full_attention": full,
                        "sliding_attention": {
                            "rope_type": "default",
                            "rope_theta": sliding_theta,
                        },
                    }),
                ),
            ]);
        }
        if let (LlamaClass::SmolLM3, Some(k)) = (s.class, s.no_rope_interval) {
            let rotates: Vec<u8> = (0..c.layers).map(|l| u8::from(c.rotates(l))).collect();
            object.insert("no_rope_layer_interval".into(), k.into());
            object.insert("no_rope_layers".into(), rotates.into());
            object.insert("use_sliding_window".into(), false.into());
        }
        if matches!(s.class, LlamaClass::Qwen2 | LlamaClass::Qwen3) {
            let window = s.sliding_window;
            object.insert("use_sliding_window".into(), window.is_some().into());
            let first = window.map_or(c.layers, |w| w.first_layer);
            object.insert("max_window_layers".into(), first.into());
        }
        if s.class == LlamaClass::Gemma3 {
            // Gemma3TextConfig's names, as the Hub's configs write them (transformers 5 reads
            // rope_theta, rope_local_base_freq and rope_scaling into its rope_parameters):
            // the activation, the attention scale (1/√head_dim here), no soft-capping, one
            // layer type per block.
            for key in ["hidden_act", "mlp_bias"] {
                object.remove(key);
            }
            let types = layer_types(c);
            object.extend([
                ("hidden_activation".into(), "gelu_pytorch_tanh".into()),
                (
                    "query_pre_attn_scalar".into(),
                    // Gemma3TextConfig types it as an int (strictly, in transformers 5).
                    match s.query_pre_attn_scalar {
                        Some(q) if q.fract() == 0.0 && q <= u32::MAX as f32 => (q as u32).into(),
                        Some(q) => q.into(),
                        None => c.head_dim().into(),
                    },
                ),
                ("layer_types".into(), types.into()),
                ("attn_logit_softcapping".into(), serde_json::Value::Null),
                ("final_logit_softcapping".into(), serde_json::Value::Null),
                ("use_bidirectional_attention".into(), false.into()),
            ]);
            if let Some(theta) = s.sliding_window.and_then(|w| w.rope_theta) {
                object.insert("rope_local_base_freq".into(), theta.into());
            }
        }
    }
    if let Some(object) = v.as_object_mut() {
        match token_ids {
            Some(ids) => object.extend(ids.iter().map(|(k, v)| (k.clone(), v.clone()))),
            None => {
                // No base and no tokenizer: the last id stands in for the end of text (GPT-2's
                // <|endoftext|> is its last id).
                let eos = c.vocab.saturating_sub(1);
                object.insert("bos_token_id".into(), eos.into());
                object.insert("eos_token_id".into(), eos.into());
            }
        }
    }

    // The embedding's padding index is the model's own: written so that transformers builds
    // the same `padding_idx` (null: none), whatever the class's default for a missing key.
    if let (Family::Llama(s), Some(object)) = (c.family, v.as_object_mut()) {
        object.insert("pad_token_id".into(), s.padding_idx.into());
    }
    serde_json::to_vec_pretty(&v).map_err(|e| err(dir, e.to_string()))
}

/// transformers' `layer_types`: `sliding_attention` for each windowed block,
/// `full_attention` for the others.
fn layer_types(c: &ModelConfig) -> Vec<&'static str> {
    (0..c.layers)
        .map(|l| match c.window_of(l) {
            Some(_) => "sliding_attention",
            None => "full_attention",
        })
        .collect()
}

/// `rope_scaling` as transformers 4 writes it beside `rope_theta` (transformers 5 reads it into
/// its `rope_parameters`), `None` when the frequencies are not rescaled.
fn rope_scaling_json(scaling: &RopeScaling) -> Option<serde_json::Value> {
    match *scaling {
        RopeScaling::None => None,
        RopeScaling::Linear { factor } => Some(serde_json::json!({
            "rope_type": "linear",
            "factor": factor,
        })),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => Some(serde_json::json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        })),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        } => Some(serde_json::json!({
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original_max_position_embeddings,
            "beta_fast": beta_fast,
            "beta_slow": beta_slow,
            // Resolved from the factor (or mscale) when read: written so it reads back alike.
            "attention_factor": attention_factor,
            "truncate": truncate,
        })),
    }
}

/// The model's files as transformers writes them, written into `dir` (fsynced) and returned
/// as manifest entries: `model.safetensors`, or shards of at most `max_shard_bytes` plus
/// [`SHARD_INDEX`] (see [`save_sharded`]), the Conv1D weights of GPT-2 transposed to Hugging
/// Face's `[in, out]`. Each file is streamed from the tensors ([`model_files_from`]), so a
/// save holds no copy of the model beside it — a checkpoint of a model that barely fits does
/// not run out of memory.
pub(crate) fn model_files(
    config: &ModelConfig,
    params: &[CpuTensor],
    max_shard_bytes: u64,
    root: &Path,
    dir: &Path,
) -> Result<Vec<ManifestFile>> {
    model_files_by(
        config,
        params,
        max_shard_bytes,
        root,
        dir,
        WRITE_CHUNK_BYTES,
    )
}

/// [`model_files`], transposing through a buffer of `chunk_bytes` (tests make it small).
fn model_files_by(
    config: &ModelConfig,
    params: &[CpuTensor],
    max_shard_bytes: u64,
    root: &Path,
    dir: &Path,
    chunk_bytes: usize,
) -> Result<Vec<ManifestFile>> {
    let count = params::param_infos(config).len();
    if count != params.len() {
        return Err(err(
            root,
            format!("{} parameters for a model of {count}", params.len()),
        ));
    }
    model_files_from(config, max_shard_bytes, root, dir, chunk_bytes, &mut |i| {
        Ok(std::borrow::Cow::Borrowed(params[i].as_slice::<f32>()?))
    })
}

/// [`model_files`] with parameter `i`'s values (our layout) from `values(i)`, asked for as
/// each is written: borrowed from tensors in memory, or read a tensor at a time from
/// elsewhere (a ZeRO checkpoint's rank files) so only one exists at once.
pub(crate) fn model_files_from<'v>(
    config: &ModelConfig,
    max_shard_bytes: u64,
    root: &Path,
    dir: &Path,
    chunk_bytes: usize,
    values: &mut dyn FnMut(usize) -> Result<std::borrow::Cow<'v, [f32]>>,
) -> Result<Vec<ManifestFile>> {
    let infos = params::param_infos(config);
    // Hugging Face layout: Conv1D weights transposed to [in, out].
    let shapes: Vec<Vec<usize>> = infos
        .iter()
        .map(|info| {
            if info.transposed_in_hf {
                vec![info.shape[1], info.shape[0]]
            } else {
                info.shape.clone()
            }
        })
        .collect();
    let numel: Vec<usize> = infos.iter().map(|i| i.shape.iter().product()).collect();
    let shards = shard_ranges(numel.iter().map(|&n| 4 * n as u64), max_shard_bytes);
    let mut files = Vec::with_capacity(shards.len() + 1);
    let mut weight_map = serde_json::Map::new();
    let mut band_values: Vec<f32> = Vec::new();
    for (s, range) in shards.iter().enumerate() {
        let name = if shards.len() == 1 {
            FILES[0].to_owned()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", s + 1, shards.len())
        };
        // safetensors' order within a file: by name (one dtype).
        let mut order: Vec<usize> = range.clone().collect();
        order.sort_by(|&a, &b| infos[a].name.cmp(&infos[b].name));
        for &i in &order {
            weight_map.insert(infos[i].name.clone(), serde_json::Value::from(name.clone()));
        }
        let layout: Vec<(&str, &[usize])> = order
            .iter()
            .map(|&i| (infos[i].name.as_str(), &shapes[i][..]))
            .collect();
        files.push(write_ordered(
            &dir.join(&name),
            &layout,
            root,
            chunk_bytes,
            |k, put| {
                let i = order[k];
                let v = values(i)?;
                if v.len() != numel[i] {
                    return Err(err(
                        root,
                        format!(
                            "{}: {} values, expected {}",
                            infos[i].name,
                            v.len(),
                            numel[i]
                        ),
                    ));
                }
                if !infos[i].transposed_in_hf {
                    // The values' bytes as they lie in memory: little-endian, as safetensors
                    // wants, on every machine we build for.
                    return put(bytemuck::cast_slice(&v));
                }
                // File row c is our column c: gather a band of them at a time.
                let (rows, cols) = (infos[i].shape[0], infos[i].shape[1]);
                let band = (chunk_bytes / 4 / rows.max(1)).max(1);
                for c0 in (0..cols).step_by(band) {
                    band_values.clear();
                    for c in c0..(c0 + band).min(cols) {
                        band_values.extend((0..rows).map(|r| v[r * cols + c]));
                    }
                    put(bytemuck::cast_slice(&band_values))?;
                }
                Ok(())
            },
        )?);
    }
    if shards.len() > 1 {
        let total: u64 = numel.iter().map(|&n| 4 * n as u64).sum();
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let index = serde_json::to_vec_pretty(&index).map_err(|e| err(root, e.to_string()))?;
        files.push(write_synced(&dir.join(SHARD_INDEX), &index)?);
    }
    Ok(files)
}

/// The write buffer of [`write_ordered`], and the most bytes of a transposed band.
pub(crate) const WRITE_CHUNK_BYTES: usize = 1 << 20;

/// A file written a piece at a time through a bounded buffer, checksummed on the way and
/// fsynced when finished: its manifest entry needs no second read.
pub(crate) struct StreamedFile {
    path: PathBuf,
    file: std::io::BufWriter<fs::File>,
    hasher: xxhash_rust::xxh3::Xxh3,
    written: u64,
}

impl StreamedFile {
    /// A new file at `path`, buffered by `chunk_bytes`.
    pub(crate) fn create(path: &Path, chunk_bytes: usize) -> Result<Self> {
        Ok(StreamedFile {
            path: path.to_path_buf(),
            file: std::io::BufWriter::with_capacity(
                chunk_bytes,
                fs::File::create(path).map_err(io(path))?,
            ),
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            written: 0,
        })
    }

    /// Append `bytes`.
    pub(crate) fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.hasher.update(bytes);
        self.written += bytes.len() as u64;
        self.file.write_all(bytes).map_err(io(&self.path))
    }

    /// Flush and fsync: the file's manifest entry.
    pub(crate) fn finish(self) -> Result<ManifestFile> {
        let file = self
            .file
            .into_inner()
            .map_err(|e| err(&self.path, format!("write: {}", e.error())))?;
        file.sync_all().map_err(io(&self.path))?;
        Ok(ManifestFile::of(
            &self.path,
            self.written,
            hex64(self.hasher.digest()),
        ))
    }
}

/// Write the safetensors file `path` of the f32 tensors `layout` (name, shape), their bytes in
/// that order: safetensors' own `Metadata` lays out the header, then `data(i, put)` hands
/// tensor `i`'s bytes to `put` (little-endian f32, exactly its length, in any number of
/// calls), streamed through a `chunk_bytes` buffer, checksummed on the way and fsynced. The
/// values need not exist before their turn: nothing of the file is held in memory.
pub(crate) fn write_ordered(
    path: &Path,
    layout: &[(&str, &[usize])],
    root: &Path,
    chunk_bytes: usize,
    mut data: impl FnMut(usize, &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
) -> Result<ManifestFile> {
    use safetensors::tensor::{Metadata, TensorInfo};
    let mut offset = 0usize;
    let mut infos = Vec::with_capacity(layout.len());
    for (name, shape) in layout {
        let n = shape
            .iter()
            .try_fold(4usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| err(root, format!("{name}: size overflows")))?;
        infos.push((
            (*name).to_owned(),
            TensorInfo {
                dtype: Dtype::F32,
                shape: shape.to_vec(),
                data_offsets: (offset, offset + n),
            },
        ));
        offset += n;
    }
    let metadata = Metadata::new(None, infos).map_err(|e| err(root, e.to_string()))?;
    let mut header = serde_json::to_string(&metadata)
        .map_err(|e| err(root, e.to_string()))?
        .into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');

    let mut file = StreamedFile::create(path, chunk_bytes)?;
    file.put(&(header.len() as u64).to_le_bytes())?;
    file.put(&header)?;
    let data_start = file.written;
    for i in 0..layout.len() {
        data(i, &mut |bytes| file.put(bytes))?;
    }
    if file.written - data_start != offset as u64 {
        return Err(err(
            path,
            format!(
                "{} data bytes written, the header holds {offset}",
                file.written - data_start
            ),
        ));
    }
    file.finish()
}

/// Write `params` as a Hugging Face model directory at `out` — `config.json` plus
/// `model.safetensors`, or shards and their index above `max_shard_bytes` — as transformers'
/// `save_pretrained` lays it out, without training state. Written into a `.partial-…` sibling,
/// every file fsynced, then renamed into place: `out` is complete or absent. An existing `out`
/// is refused, never overwritten.
pub fn save_hf(
    out: &Path,
    config: &ModelConfig,
    params: &[CpuTensor],
    max_shard_bytes: u64,
) -> Result<()> {
    save_hf_with(out, config, params, max_shard_bytes, &Companions::none())
}

/// [`save_hf`] with the model's companion files (its tokenizer and generation config) written
/// into the directory before it is published: the base model's `generation_config.json`,
/// which transformers' `save_pretrained` writes too, and its tokenizer, which a user saves
/// beside it (`tokenizer.save_pretrained(out)`) for the export to load as the base does.
pub fn save_hf_with(
    out: &Path,
    config: &ModelConfig,
    params: &[CpuTensor],
    max_shard_bytes: u64,
    companions: &Companions,
) -> Result<()> {
    if out.exists() {
        return Err(err(out, "already exists; refusing to overwrite it"));
    }
    let name = out
        .file_name()
        .ok_or_else(|| err(out, "not a directory name"))?
        .to_string_lossy()
        .into_owned();
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&parent).map_err(io(&parent))?;
    let bytes: u64 = params
        .iter()
        .map(|t| headroom_tensor::Tensor::numel(t) as u64 * 4)
        .sum::<u64>()
        + companions.bytes();
    if let Some(free) = short_of_room(&parent, bytes) {
        return Err(err(
            out,
            format!(
                "the model takes at least {:.1} MiB, but the file system of {} has {:.1} MiB \
                 free",
                bytes as f64 / 1048576.0,
                parent.display(),
                free as f64 / 1048576.0
            ),
        ));
    }
    let partial = parent.join(format!("{PARTIAL_PREFIX}{name}-{}", std::process::id()));
    if partial.exists() {
        fs::remove_dir_all(&partial).map_err(io(&partial))?;
    }
    fs::create_dir(&partial).map_err(io(&partial))?;
    removing_on_error(&partial, || {
        model_files(config, params, max_shard_bytes, out, &partial)?;
        write_synced(
            &partial.join(FILES[1]),
            &hf_config(config, companions.token_ids(), out)?,
        )?;
        companions.write_into(&partial)?;
        sync_dir(&partial)?;
        fs::rename(&partial, out).map_err(io(out))
    })?;
    sync_dir(&parent)
}

/// Run `write`, which fills the `.partial-…` directory `partial` and publishes it by a rename;
/// if it fails, remove what is left of `partial` before returning the error. A save most often
/// fails for want of space, and the unfinished files are never read: left behind, they would
/// hold that space until the next successful save prunes them. (After a rename `partial` no
/// longer exists and the removal finds nothing.)
fn removing_on_error<T>(partial: &Path, write: impl FnOnce() -> Result<T>) -> Result<T> {
    let result = write();
    if result.is_err() {
        let _ = fs::remove_dir_all(partial);
    }
    result
}

/// [`removing_on_error`] for a step's save: an error about a file inside `partial` (which no
/// longer exists) is told as the step's, by the file's name, with what it left behind.
pub(crate) fn saving_step<T>(
    root: &Path,
    partial: &Path,
    step: usize,
    write: impl FnOnce() -> Result<T>,
) -> Result<T> {
    removing_on_error(partial, write).map_err(|e| match e {
        TrainError::Checkpoint { path, reason } if path.starts_with(partial) => err(
            root,
            format!(
                "step {step} was not saved ({}: {reason}); its unfinished files were removed \
                 and the earlier checkpoints are as they were",
                path.strip_prefix(partial).unwrap_or(&path).display()
            ),
        ),
        other => other,
    })
}

/// Consecutive ranges of tensors (by their byte sizes), each at most `max` bytes unless a
/// single tensor is larger: transformers' greedy split.
fn shard_ranges(sizes: impl Iterator<Item = u64>, max: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = vec![];
    let (mut start, mut bytes, mut n) = (0, 0u64, 0);
    for size in sizes {
        if n > start && bytes.saturating_add(size) > max {
            out.push(start..n);
            (start, bytes) = (n, 0);
        }
        bytes = bytes.saturating_add(size);
        n += 1;
    }
    out.push(start..n);
    out
}

fn step_dir_name(step: usize) -> String {
    format!("{STEP_PREFIX}{step:08}")
}

/// The step of a published checkpoint directory name (`step-00000012` → 12).
fn parse_step_dir(name: &str) -> Option<usize> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The lock file a run holds in its checkpoint root ([`lock_root`]).
pub const ROOT_LOCK: &str = ".headroom-lock";

/// A run's exclusive hold on its checkpoint root, released when dropped (or when the process
/// ends, however it ends: the kernel drops the lock with the file).
#[derive(Debug)]
pub struct RootLock {
    _file: fs::File,
}

/// Lock `root` (created if missing) for one run: two runs saving into one root — a requeued
/// job whose first instance still runs, say — would remove each other's saves in progress
/// (pruning clears `.partial-*`) and interleave their steps. A root another run holds is
/// refused. Where the file system cannot lock (`ENOLCK` on an NFS mount without a lock
/// daemon), the run goes on unlocked after a warning rather than not saving at all.
pub fn lock_root(root: &Path) -> Result<Option<RootLock>> {
    fs::create_dir_all(root).map_err(io(root))?;
    let path = root.join(ROOT_LOCK);
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io(&path))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(RootLock { _file: file })),
        Err(fs::TryLockError::WouldBlock) => Err(err(
            root,
            format!(
                "another run is saving checkpoints here (it holds {ROOT_LOCK}): one run per \
                 checkpoint directory"
            ),
        )),
        Err(fs::TryLockError::Error(e)) => {
            let _ = writeln!(
                std::io::stderr(),
                "warning: cannot lock {} ({e}); saving without it: make sure no other run \
                 saves into {}",
                path.display(),
                root.display()
            );
            Ok(None)
        }
    }
}

/// A fresh run refuses a root that already holds checkpoints: its saves would interleave with
/// another run's (resume that run instead).
pub(crate) fn refuse_used_root(root: &Path) -> Result<()> {
    if let Some((step, _)) = list(root)?.pop() {
        return Err(TrainError::Checkpoint {
            path: root.to_path_buf(),
            reason: format!(
                "already holds checkpoints of a run (newest: step {step}); resume it (--resume) \
                 or save into an empty directory"
            ),
        });
    }
    Ok(())
}

/// A resume from step `start` refuses a save root holding checkpoints of later steps (an
/// abandoned continuation of the run, or another run): pruning keeps the newest by step
/// number, so those would outlive the resumed run's own checkpoints, and a later resume of
/// the root would continue the abandoned run. Nothing is deleted: they may be all the user has
/// of that run.
pub(crate) fn refuse_later_checkpoints(root: &Path, start: usize) -> Result<()> {
    let later: Vec<String> = list(root)?
        .into_iter()
        .filter(|&(step, _)| step > start)
        .map(|(step, _)| step.to_string())
        .collect();
    if !later.is_empty() {
        return Err(TrainError::Checkpoint {
            path: root.to_path_buf(),
            reason: format!(
                "holds checkpoints past the resumed step {start} (steps {}): the resumed run's \
                 checkpoints would be pruned before them and a later resume of this directory \
                 would continue them; move them aside, or save into another --checkpoint-dir",
                later.join(", ")
            ),
        });
    }
    Ok(())
}

/// The published checkpoints under `root`, oldest first, as (step, directory).
pub fn list(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut out = Vec::new();
    let entries = match fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(err(root, e.to_string())),
    };
    for entry in entries {
        let entry = entry.map_err(io(root))?;
        let name = entry.file_name();
        if let Some(step) = name.to_str().and_then(parse_step_dir) {
            if entry.file_type().map_err(io(root))?.is_dir() {
                out.push((step, entry.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Save a checkpoint as `root/step-N` (N = `state.step`) and keep the newest `keep` of them.
/// Returns the published directory. See the module docs for why a crash at any point of this
/// function leaves only complete checkpoints. The model is one `model.safetensors` up to
/// [`MAX_SHARD_BYTES`], shards beyond (see [`save_sharded`]).
pub fn save(
    root: &Path,
    state: &TrainingState,
    params: &[CpuTensor],
    moments: &[u8],
    keep: usize,
) -> Result<PathBuf> {
    save_sharded(
        root,
        state,
        params,
        moments,
        keep,
        MAX_SHARD_BYTES,
        &Companions::none(),
    )
}

/// [`save`], with the model split as transformers' `save_pretrained(max_shard_size=…)` splits
/// it when its tensors exceed `max_shard_bytes`: tensors in parameter order, a new shard
/// whenever the next tensor would overflow the current one (a tensor larger than the limit
/// gets a shard of its own), files `model-00001-of-0000N.safetensors` and a
/// `model.safetensors.index.json` mapping every tensor to its file. Every shard and the index
/// are in the manifest, so the crash-consistency argument is unchanged. The model's
/// `companions` (its tokenizer and generation config) go into the directory too, in the
/// manifest like every file.
pub fn save_sharded(
    root: &Path,
    state: &TrainingState,
    params: &[CpuTensor],
    moments: &[u8],
    keep: usize,
    max_shard_bytes: u64,
    companions: &Companions,
) -> Result<PathBuf> {
    if keep == 0 {
        return Err(err(
            root,
            "keeping 0 checkpoints would delete the one just saved",
        ));
    }
    let infos = match &state.finetune {
        Some(f) => crate::model::finetune::adapter_infos(&state.config, &f.spec.lora)?,
        None => params::param_infos(&state.config),
    };
    if infos.len() != params.len() {
        return Err(err(
            root,
            format!("{} parameters for a model of {}", params.len(), infos.len()),
        ));
    }
    write_step(
        root,
        state,
        Some(keep),
        companions,
        |partial, files| {
            match &state.finetune {
                Some(f) => {
                    let slices = params
                        .iter()
                        .map(|t| Ok(t.as_slice::<f32>()?))
                        .collect::<Result<Vec<_>>>()?;
                    let (config, weights) = adapter_of(&state.config, &f.spec, &slices)?
                        .to_peft_bytes()
                        .map_err(|e| err(root, e.to_string()))?;
                    files.push(write_synced(
                        &partial.join(headroom_lora::WEIGHTS_FILE),
                        &weights,
                    )?);
                    files.push(write_synced(
                        &partial.join(headroom_lora::CONFIG_FILE),
                        &config,
                    )?);
                }
                None => files.extend(model_files(
                    &state.config,
                    params,
                    max_shard_bytes,
                    root,
                    partial,
                )?),
            }
            Ok(())
        },
        |put| put(moments),
    )
}

/// [`save_sharded`] for a full model whose values are produced while the files are written,
/// so none of them needs to be in memory whole (a ZeRO checkpoint's consolidation):
/// `tensor(i)` gives parameter `i`'s values in our layout, one at a time, and `moments(put)`
/// writes `optimizer.bin`'s bytes through `put`. `keep: None` prunes nothing, not even
/// leftovers of interrupted saves (the root may be a live run's).
pub(crate) fn save_streamed(
    root: &Path,
    state: &TrainingState,
    keep: Option<usize>,
    max_shard_bytes: u64,
    companions: &Companions,
    mut tensor: impl FnMut(usize) -> Result<Vec<f32>>,
    moments: impl FnOnce(&mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
) -> Result<PathBuf> {
    if keep == Some(0) {
        return Err(err(
            root,
            "keeping 0 checkpoints would delete the one just saved",
        ));
    }
    if state.finetune.is_some() {
        return Err(err(
            root,
            "a streamed save writes a full model, not adapters",
        ));
    }
    write_step(
        root,
        state,
        keep,
        companions,
        |partial, files| {
            files.extend(model_files_from(
                &state.config,
                max_shard_bytes,
                root,
                partial,
                WRITE_CHUNK_BYTES,
                &mut |i| Ok(std::borrow::Cow::Owned(tensor(i)?)),
            )?);
            Ok(())
        },
        moments,
    )
}

/// One step directory written into a `.partial-…` sibling and published: `model` writes the
/// model's files (or the adapters) and records them, then `config.json`, `optimizer.bin`
/// (its bytes from `moments`, streamed), the companion files, `state.json` and the manifest,
/// every file fsynced. `keep` as [`publish`]'s.
fn write_step(
    root: &Path,
    state: &TrainingState,
    keep: Option<usize>,
    companions: &Companions,
    model: impl FnOnce(&Path, &mut Vec<ManifestFile>) -> Result<()>,
    moments: impl FnOnce(&mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
) -> Result<PathBuf> {
    fs::create_dir_all(root).map_err(io(root))?;
    let partial = root.join(format!(
        "{PARTIAL_PREFIX}{}-{}",
        step_dir_name(state.step),
        std::process::id()
    ));
    if partial.exists() {
        fs::remove_dir_all(&partial).map_err(io(&partial))?;
    }
    fs::create_dir(&partial).map_err(io(&partial))?;

    saving_step(root, &partial, state.step, || {
        let mut files = Vec::with_capacity(FILES.len() + 1);
        model(&partial, &mut files)?;
        files.push(write_synced(
            &partial.join(FILES[1]),
            &hf_config(&state.config, companions.token_ids(), root)?,
        )?);
        let mut optimizer = StreamedFile::create(&partial.join(FILES[2]), WRITE_CHUNK_BYTES)?;
        moments(&mut |bytes| optimizer.put(bytes))?;
        files.push(optimizer.finish()?);
        files.extend(companions.write_into(&partial)?);
        let state_json = serde_json::to_vec_pretty(state).map_err(|e| err(root, e.to_string()))?;
        files.push(write_synced(&partial.join(FILES[3]), &state_json)?);
        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            step: state.step,
            files,
        };
        let manifest_json =
            serde_json::to_vec_pretty(&manifest).map_err(|e| err(root, e.to_string()))?;
        write_synced(&partial.join(MANIFEST), &manifest_json)?;
        publish(root, &partial, state.step, keep)
    })
}

/// Publish a complete `partial` directory (manifest written last) as `root/step-N`, then keep
/// the newest `keep` checkpoints (`None`: prune nothing). A directory of the same step (a run
/// resumed before it) is moved aside first: rename cannot replace a non-empty directory.
///
/// Once the rename is durable the save has succeeded: failing to remove the replaced copy or
/// old checkpoints afterwards is reported on stderr, not returned, since an error would stop
/// a run whose new checkpoint is intact (and leave one checkpoint too many, never one too few).
pub(crate) fn publish(
    root: &Path,
    partial: &Path,
    step: usize,
    keep: Option<usize>,
) -> Result<PathBuf> {
    publish_with(
        root,
        partial,
        step,
        keep,
        &mut |from, to| fs::rename(from, to),
        &mut |dir| fs::remove_dir_all(dir),
    )
}

/// [`publish`], renaming `partial` into place through `place` and removing directories through
/// `remove` (tests make them fail).
fn publish_with(
    root: &Path,
    partial: &Path,
    step: usize,
    keep: Option<usize>,
    place: &mut dyn FnMut(&Path, &Path) -> std::io::Result<()>,
    remove: &mut dyn FnMut(&Path) -> std::io::Result<()>,
) -> Result<PathBuf> {
    sync_dir(partial)?;
    let published = root.join(step_dir_name(step));
    if published.exists() {
        let aside = root.join(format!(
            "{REPLACED_PREFIX}{}-{}",
            step_dir_name(step),
            std::process::id()
        ));
        fs::rename(&published, &aside).map_err(io(&published))?;
        if let Err(e) = place(partial, &published) {
            // Put the copy back: under its `.replaced-…` name it is not a checkpoint, and the
            // next prune would delete it.
            let _ = fs::rename(&aside, &published);
            return Err(io(&published)(e));
        }
        sync_dir(root)?;
        if let Err(e) = remove(&aside) {
            warn_after_publish(
                &published,
                "could not remove the copy it replaced",
                &aside,
                &e,
            );
        }
    } else {
        place(partial, &published).map_err(io(&published))?;
        sync_dir(root)?;
    }
    if let Some(keep) = keep {
        prune(root, keep, &published, step, remove);
    }
    Ok(published)
}

/// A failure after `published` was saved: a line on stderr naming both paths, so the user can
/// free the space by hand. A closed stderr is ignored rather than a panic.
fn warn_after_publish(published: &Path, what: &str, path: &Path, e: &dyn std::fmt::Display) {
    let _ = writeln!(
        std::io::stderr(),
        "warning: checkpoint {} saved, but {what} {}: {e}",
        published.display(),
        path.display()
    );
}

/// Remove all but the newest `keep` published checkpoints, and leftovers of interrupted saves.
/// `published` (of step `step`) is never removed: by step number alone it would be, were the
/// root to hold later steps, and the run would go on without its newest checkpoint. Failures
/// are warnings ([`publish`] says why) and do not stop the others being removed.
fn prune(
    root: &Path,
    keep: usize,
    published: &Path,
    step: usize,
    remove: &mut dyn FnMut(&Path) -> std::io::Result<()>,
) {
    let all = match list(root) {
        Ok(all) => all,
        Err(e) => return warn_after_publish(published, "could not list", root, &e),
    };
    let others: Vec<&PathBuf> = all
        .iter()
        .filter(|&&(s, _)| s != step)
        .map(|(_, dir)| dir)
        .collect();
    let excess = all.len().saturating_sub(keep.max(1)).min(others.len());
    for dir in &others[..excess] {
        if let Err(e) = remove(dir) {
            warn_after_publish(published, "could not remove the old checkpoint", dir, &e);
        }
    }
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) => return warn_after_publish(published, "could not list", root, &e),
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(PARTIAL_PREFIX) || name.starts_with(REPLACED_PREFIX) {
            // Another process's save in progress would be removed too: one writer per root.
            let _ = remove(&entry.path());
        }
    }
}

/// Refuse to save into `root` (given as `option`) when its file system has less free space
/// than one checkpoint's `bytes` (a lower bound of what a save writes): for a run, the first
/// save would fail, and a failed save ends the run with every step since the last checkpoint
/// lost. Where the free space is unknown nothing is refused.
pub fn check_room(root: &Path, bytes: u64, option: &'static str) -> Result<()> {
    match short_of_room(root, bytes) {
        Some(free) => Err(TrainError::Option {
            option,
            reason: format!(
                "a checkpoint of this model takes at least {:.1} MiB, but the file system of {} \
                 has {:.1} MiB free: free some space or save elsewhere",
                bytes as f64 / 1048576.0,
                root.display(),
                free as f64 / 1048576.0
            ),
        }),
        None => Ok(()),
    }
}

/// The free bytes of `dir`'s file system (or of its nearest existing ancestor's, for a
/// directory not made yet) when they are fewer than `bytes`; `None` when they suffice or
/// cannot be learnt.
fn short_of_room(dir: &Path, bytes: u64) -> Option<u64> {
    let existing = dir.ancestors().find(|d| d.is_dir())?;
    let free = headroom_mmap_data::formats::writer::free_space(existing)?;
    (free < bytes).then_some(free)
}

/// After a save: a warning on stderr when `root`'s file system no longer has room for
/// another checkpoint of `bytes` (older ones are pruned only after a new one is written), so
/// that the user can free space before the next save fails.
pub(crate) fn warn_if_no_room(root: &Path, bytes: u64) {
    if let Some(free) = short_of_room(root, bytes) {
        let _ = writeln!(
            std::io::stderr(),
            "warning: the file system of {} has {:.1} MiB free, less than the {:.1} MiB of a \
             checkpoint: the next save will fail unless space is freed",
            root.display(),
            free as f64 / 1048576.0,
            bytes as f64 / 1048576.0
        );
    }
}

/// The step directory `path` names: `path` itself when it holds a manifest, else the newest
/// published checkpoint under it.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    if let Some((_, newest)) = list(path)?.pop() {
        return Ok(newest);
    }
    if path.join("state.json").is_file() {
        return Err(err(
            path,
            "a checkpoint without manifest.json (an older headroom's layout, or a directory \
             whose save did not finish): its files cannot be shown to belong to one step",
        ));
    }
    Err(err(
        path,
        "no checkpoint here (no manifest.json, no step-* directories)",
    ))
}

/// Read a whole file whose size the manifest states, checking size and checksum.
pub(crate) fn read_verified(dir: &Path, entry: &ManifestFile) -> Result<Vec<u8>> {
    let path = dir.join(&entry.name);
    let meta = fs::metadata(&path).map_err(io(&path))?;
    if meta.len() != entry.bytes {
        return Err(err(
            &path,
            format!(
                "{} bytes, the manifest says {}: the checkpoint's files disagree",
                meta.len(),
                entry.bytes
            ),
        ));
    }
    let len = usize::try_from(entry.bytes)
        .map_err(|_| err(&path, "larger than this machine's address space"))?;
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(len)
        .map_err(|_| err(&path, format!("cannot allocate {len} bytes to read it")))?;
    fs::File::open(&path)
        .map_err(io(&path))?
        .take(entry.bytes)
        .read_to_end(&mut bytes)
        .map_err(io(&path))?;
    if bytes.len() as u64 != entry.bytes {
        return Err(err(&path, "changed size while being read"));
    }
    check_sum(&path, checksum(&bytes), entry)?;
    Ok(bytes)
}

/// A checkpoint's JSON file, refused when over [`MAX_JSON_BYTES`] or not a regular file.
pub(crate) fn read_json_bounded(path: &Path) -> Result<Vec<u8>> {
    crate::bounded::read_file(path, MAX_JSON_BYTES).map_err(|reason| err(path, reason))
}

/// Read and check the manifest of a step directory.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let m = parse_manifest(dir)?;
    let listed = |name: &str| m.files.iter().filter(|f| f.name == name).count();
    if listed(crate::zero_checkpoint::ZERO_STATE) > 0 {
        return Err(err(
            dir,
            "a ZeRO checkpoint (one shard per rank): resume it with --zero, or write one \
             ordinary checkpoint with `headroom checkpoint consolidate`",
        ));
    }
    for name in &FILES[1..] {
        if listed(name) != 1 {
            return Err(err(&path, format!("does not list {name} exactly once")));
        }
    }
    let adapters = listed(headroom_lora::WEIGHTS_FILE);
    if listed(FILES[0]) + listed(SHARD_INDEX) + adapters != 1 {
        return Err(err(
            &path,
            format!(
                "must list exactly one of {}, {SHARD_INDEX} and {}",
                FILES[0],
                headroom_lora::WEIGHTS_FILE
            ),
        ));
    }
    if listed(headroom_lora::CONFIG_FILE) != adapters {
        return Err(err(
            &path,
            format!(
                "lists {} without {} or the other way round",
                headroom_lora::WEIGHTS_FILE,
                headroom_lora::CONFIG_FILE
            ),
        ));
    }
    Ok(m)
}

/// `manifest.json` of `dir`, bounded, of this format version, no file listed twice; what
/// files it must list is the caller's check.
pub(crate) fn parse_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let bytes = read_json_bounded(&path)?;
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| err(&path, e.to_string()))?;
    if m.format_version != FORMAT_VERSION {
        return Err(err(
            &path,
            format!(
                "format version {} (this build reads {FORMAT_VERSION})",
                m.format_version
            ),
        ));
    }
    let mut names: Vec<&str> = m.files.iter().map(|f| f.name.as_str()).collect();
    names.sort_unstable();
    if names.windows(2).any(|w| w[0] == w[1]) {
        return Err(err(&path, "lists a file twice"));
    }
    Ok(m)
}

/// The manifest entries of a sharded model's files: the index read (bounded, verified) and
/// every shard it names, each a plain file name the manifest lists.
type WeightMap = std::collections::HashMap<String, String>;

fn shard_entries<'m>(
    dir: &Path,
    manifest: &'m Manifest,
    index: &ManifestFile,
) -> Result<(Vec<&'m ManifestFile>, WeightMap)> {
    let path = dir.join(SHARD_INDEX);
    if index.bytes > MAX_JSON_BYTES {
        return Err(err(&path, "implausibly large"));
    }
    let json: serde_json::Value = serde_json::from_slice(&read_verified(dir, index)?)
        .map_err(|e| err(&path, e.to_string()))?;
    let map = json["weight_map"]
        .as_object()
        .ok_or_else(|| err(&path, "no weight_map"))?;
    let weights: WeightMap = map
        .iter()
        .map(|(name, file)| match file.as_str() {
            // A shard is a file of this directory, never a path elsewhere.
            Some(f) if !f.contains(['/', '\\']) && !f.starts_with('.') => {
                Ok((name.clone(), f.to_owned()))
            }
            _ => Err(err(
                &path,
                format!("{name}: {file} is not a shard's file name"),
            )),
        })
        .collect::<Result<_>>()?;
    let mut files: Vec<&str> = weights.values().map(String::as_str).collect();
    files.sort_unstable();
    files.dedup();
    let entries = files
        .into_iter()
        .map(|f| {
            manifest
                .files
                .iter()
                .find(|e| e.name == f && f.ends_with(".safetensors"))
                .ok_or_else(|| {
                    err(
                        &path,
                        format!("names {f:?}, which the manifest does not list"),
                    )
                })
        })
        .collect::<Result<_>>()?;
    Ok((entries, weights))
}

/// `dir`'s `state.json`, checked against the manifest (listed, bounded, checksum, format and
/// step) and its config validated.
fn read_state(dir: &Path, manifest: &Manifest) -> Result<TrainingState> {
    let state_path = dir.join("state.json");
    let state_entry = manifest.entry(dir, "state.json")?;
    if state_entry.bytes > MAX_JSON_BYTES {
        return Err(err(&state_path, "implausibly large"));
    }
    let json = read_verified(dir, state_entry)?;
    let state: TrainingState =
        serde_json::from_slice(&json).map_err(|e| err(&state_path, e.to_string()))?;
    check_format_and_step(&state_path, state.format_version, state.step, manifest.step)?;
    state.config.validate()?;
    Ok(state)
}

/// For inference: the step directory of the checkpoint at `path` and its config, after
/// checking the manifest, the state and every model file's size and checksum — streamed, so
/// nothing of the model's size is held — and without reading the optimizer state. The
/// directory is then a Hugging Face one ([`crate::hf::load_each`] streams its tensors). A LoRA
/// checkpoint is refused as [`Checkpoint::into_masters`] refuses it.
pub fn verify_model_files(path: &Path) -> Result<(PathBuf, ModelConfig)> {
    let dir = resolve(path)?;
    let manifest = read_manifest(&dir)?;
    let state = read_state(&dir, &manifest)?;
    if state.finetune.is_some() {
        return Err(err(&dir, ADAPTERS_NOT_A_MODEL));
    }
    for e in manifest.model_entries(&dir)?.0 {
        verify_streamed(&dir, e)?;
    }
    Ok((dir, state.config))
}

/// The step directory of the checkpoint at `path` (a root: its newest), after checking the
/// companion files its manifest lists (the tokenizer, the generation config) against it, size
/// and checksum: the files `sample` reads beside the model, before it loads the model.
pub fn verify_companions(path: &Path) -> Result<PathBuf> {
    let dir = resolve(path)?;
    let manifest = read_manifest(&dir)?;
    for e in manifest.files.iter().filter(|f| is_companion(&f.name)) {
        verify_streamed(&dir, e)?;
    }
    Ok(dir)
}

/// What a checkpoint holds, as [`verify`] found it.
#[derive(Clone, Debug, PartialEq)]
pub enum CheckpointKind {
    /// A model and its AdamW moments.
    Full {
        /// How the moments are stored.
        optimizer: StatePrecision,
    },
    /// A LoRA / QLoRA step: PEFT's adapter files and the adapters' moments.
    Finetune(FinetuneState),
    /// One file per rank of a ZeRO run.
    Zero {
        /// The stage that wrote it.
        stage: u8,
        /// Ranks (and rank files).
        ranks: usize,
    },
}

/// A checkpoint whose every file matched its manifest ([`verify`]).
#[derive(Clone, Debug)]
pub struct Verified {
    /// The step directory.
    pub dir: PathBuf,
    /// Optimizer steps completed.
    pub step: usize,
    /// The model's shape.
    pub config: ModelConfig,
    /// The run's settings, which a resume must match.
    pub run: RunSpec,
    /// Full, fine-tuning or ZeRO.
    pub kind: CheckpointKind,
    /// The data loader's position (a ZeRO checkpoint keeps one per rank, in its rank file).
    pub loader: Option<LoaderState>,
    /// Every file the manifest lists, each checked.
    pub files: Vec<ManifestFile>,
}

/// Check the checkpoint at `path` (a step directory, or a root: its newest) without loading
/// it: what a resume checks before it reads any weight (the manifest; the state file's
/// checksum, format and step; the optimizer state's sizes against the model's, or a
/// fine-tuning step's adapters against its set-up; a ZeRO checkpoint's pieces tiling every
/// tensor), then every other file's size and checksum, read 1 MiB at a time, so nothing of
/// the model's size is held. For a copy before a long job starts from it, or a directory
/// after a crash. The model files' tensors are read (and so checked) by whatever loads them.
pub fn verify(path: &Path) -> Result<Verified> {
    let dir = resolve(path)?;
    if crate::zero_checkpoint::is_zero_checkpoint(&dir) {
        // `load` streams every rank file's checksum and reads `zero.json` verified.
        let z = crate::zero_checkpoint::load(&dir)?;
        let manifest = parse_manifest(&dir)?;
        let rank_files: Vec<String> = (0..z.state.ranks)
            .map(|r| crate::zero_checkpoint::rank_file(r, z.state.ranks))
            .collect();
        for f in &manifest.files {
            if f.name != crate::zero_checkpoint::ZERO_STATE && !rank_files.contains(&f.name) {
                verify_streamed(&dir, f)?;
            }
        }
        return Ok(Verified {
            dir,
            step: z.state.step,
            config: z.state.config,
            run: z.state.run,
            kind: CheckpointKind::Zero {
                stage: z.state.stage,
                ranks: z.state.ranks,
            },
            loader: None,
            files: manifest.files,
        });
    }
    let point = ResumePoint::open(&dir)?;
    let manifest = point.manifest;
    let kind = match point.state.finetune.clone() {
        // `open` read and checked the adapters and verified every file.
        Some(f) => CheckpointKind::Finetune(f),
        None => {
            // A sharded model's index names only files the manifest lists.
            manifest.model_entries(&dir)?;
            for f in &manifest.files {
                verify_streamed(&dir, f)?;
            }
            CheckpointKind::Full {
                optimizer: point.state.optimizer.precision,
            }
        }
    };
    Ok(Verified {
        dir,
        step: point.state.step,
        config: point.state.config,
        run: point.state.run,
        kind,
        loader: Some(point.state.loader),
        files: manifest.files,
    })
}

/// [`read_verified`]'s checks, reading `entry`'s file in 1 MiB pieces.
pub(crate) fn verify_streamed(dir: &Path, entry: &ManifestFile) -> Result<()> {
    let path = dir.join(&entry.name);
    let (total, sum) = hash_file(&path, entry.bytes)?;
    if total != entry.bytes {
        return Err(err(
            &path,
            format!(
                "{total}{} bytes, the manifest says {}: the checkpoint's files disagree",
                if total > entry.bytes { "+" } else { "" },
                entry.bytes
            ),
        ));
    }
    check_sum(&path, sum, entry)
}

/// The manifest entry of the file at `path` (its name, length and checksum), read a piece at a
/// time.
pub(crate) fn file_entry(path: &Path) -> Result<ManifestFile> {
    let (bytes, xxh3) = hash_file(path, u64::MAX)?;
    Ok(ManifestFile::of(path, bytes, xxh3))
}

/// The length and xxh3-64 of the file at `path`, read 1 MiB at a time; reading stops once
/// more than `limit` bytes were seen (the length returned is then above `limit`, the checksum
/// meaningless).
fn hash_file(path: &Path, limit: u64) -> Result<(u64, String)> {
    let mut file = fs::File::open(path).map_err(io(path))?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; WRITE_CHUNK_BYTES];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > limit {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok((total, hex64(hasher.digest())))
}

/// `sum` is the checksum `entry` states for `path`.
fn check_sum(path: &Path, sum: String, entry: &ManifestFile) -> Result<()> {
    if sum != entry.xxh3 {
        return Err(err(
            path,
            format!(
                "checksum {sum}, the manifest says {}: the file was changed or corrupted",
                entry.xxh3
            ),
        ));
    }
    Ok(())
}

/// A state file's format and step against the manifest's.
pub(crate) fn check_format_and_step(
    state_path: &Path,
    format_version: u32,
    step: usize,
    manifest_step: usize,
) -> Result<()> {
    if format_version != FORMAT_VERSION || step != manifest_step {
        return Err(err(
            state_path,
            format!(
                "format {format_version} step {step}, the manifest says format \
                 {FORMAT_VERSION} step {manifest_step}"
            ),
        ));
    }
    Ok(())
}

/// A checkpoint a run resumes from, opened without reading its model or its optimizer moments:
/// those are read straight into the run's own tensors and store, so resuming needs no more
/// memory than training does ([`load`] holds the model file's bytes, the parameters and the
/// moments beside what the run allocates: 2.8 GiB against training's 1.9 GiB for GPT-2
/// 124M).
pub struct ResumePoint {
    /// The step directory.
    pub dir: PathBuf,
    /// Step, config, optimizer and loader state (checked against the manifest).
    pub state: TrainingState,
    /// A fine-tuning checkpoint's adapter tensors ([`crate::model::finetune::adapter_infos`]
    /// order; small, read and checked when opened); `None` for a model checkpoint.
    pub adapters: Option<Vec<Vec<f32>>>,
    manifest: Manifest,
}

impl ResumePoint {
    /// The model's companion files (tokenizer, generation config) this checkpoint holds, read
    /// and checked against its manifest: what the resumed run writes into its checkpoints.
    pub fn companions(&self) -> Result<Companions> {
        Companions::listed_in(&self.dir, &self.manifest)
    }

    /// The checkpoint at `path` (a step directory, or a root: its newest checkpoint): its
    /// manifest and state, checked; a fine-tuning checkpoint's adapters, every file verified.
    pub fn open(path: &Path) -> Result<Self> {
        let dir = resolve(path)?;
        let manifest = read_manifest(&dir)?;
        let state = read_state(&dir, &manifest)?;
        if state.finetune.is_some() {
            let ck = load_adapters(dir.clone(), &manifest, state)?;
            return Ok(ResumePoint {
                dir,
                state: ck.state,
                adapters: Some(ck.params),
                manifest,
            });
        }
        // The optimizer's sizes are the model's before anything is allocated from them.
        check_model_optimizer_state(&dir, &manifest, &state)?;
        Ok(ResumePoint {
            dir,
            state,
            adapters: None,
            manifest,
        })
    }

    /// The model's fp32 masters on `backend` (counted as `Parameters`): every model file's
    /// checksum verified a piece at a time, then read tensor by tensor through the Hugging
    /// Face loader (a step directory is a Hugging Face directory), so neither the file's bytes
    /// nor a second copy of the model ever exists. The same values as [`load`]'s (test).
    pub fn read_masters(&self, backend: &Cpu) -> Result<Vec<CpuTensor>> {
        if self.adapters.is_some() {
            return Err(err(&self.dir, ADAPTERS_NOT_A_MODEL));
        }
        // Verified, and every tensor its parameter's f32 tensor, as `load` requires.
        let stored = self.stored_tensors()?;
        let cfg = crate::hf::read_config(&self.dir)?;
        if cfg != self.state.config {
            return Err(err(
                &self.dir.join(FILES[1]),
                format!("holds {cfg:?}, the state {:?}", self.state.config),
            ));
        }
        let mut f32s = params::EachF32(|_, _| Ok(()));
        params::param_infos(&cfg)
            .iter()
            .zip(&stored)
            .enumerate()
            .map(|(i, (info, t))| crate::hf::fill_param(backend, info, i, t, &mut f32s))
            .collect()
    }

    /// `read(len, reader)` over the optimizer's moment bytes, read from the checkpoint's file
    /// as `read` consumes them (into the optimizer's store: no copy of them in memory) and
    /// checksummed on the way. `read` must consume all `len` bytes; a short file, a longer
    /// one, or a checksum other than the manifest's is an error after it returns, and the
    /// caller discards what it built.
    pub fn read_moments<T>(
        &self,
        read: impl FnOnce(u64, &mut dyn Read, &Path) -> Result<T>,
    ) -> Result<T> {
        let entry = self.manifest.entry(&self.dir, FILES[2])?;
        let path = self.dir.join(&entry.name);
        let file = fs::File::open(&path).map_err(io(&path))?;
        let mut reader = HashingReader {
            inner: file.take(entry.bytes),
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            read: 0,
        };
        let out = read(entry.bytes, &mut reader, &path)?;
        // Anything `read` left, and whether the file goes on past the manifest's length.
        std::io::copy(&mut reader, &mut std::io::sink()).map_err(io(&path))?;
        let longer = reader
            .inner
            .into_inner()
            .read(&mut [0u8])
            .map_err(io(&path))?
            > 0;
        if reader.read != entry.bytes || longer {
            return Err(err(
                &path,
                format!(
                    "{}{} bytes, the manifest says {}: the checkpoint's files disagree",
                    reader.read,
                    if longer { "+" } else { "" },
                    entry.bytes
                ),
            ));
        }
        check_sum(&path, hex64(reader.hasher.digest()), entry)?;
        Ok(out)
    }

    /// Where each of the model's tensors lies (parameter order), every model file verified
    /// by streamed checksums first and each tensor checked to be its parameter's f32 tensor
    /// (GPT-2's `Conv1D` weights stored transposed): for a reader of a few tensors at a time.
    pub(crate) fn stored_tensors(&self) -> Result<Vec<crate::hf::Stored>> {
        if self.adapters.is_some() {
            return Err(err(&self.dir, ADAPTERS_NOT_A_MODEL));
        }
        let (entries, _) = self.manifest.model_entries(&self.dir)?;
        for e in &entries {
            verify_streamed(&self.dir, e)?;
        }
        // The Hugging Face reader (like transformers) prefers `model.safetensors` to an index:
        // one the manifest does not list would be read instead of the verified shards.
        let single = self.dir.join(FILES[0]);
        if single.is_file() && !entries.iter().any(|e| e.name == FILES[0]) {
            return Err(err(
                &single,
                "not in the manifest, which lists a sharded model: a file added after the save",
            ));
        }
        // `config.json` is read beside the tensors: verified too, as `load` verifies it.
        verify_streamed(&self.dir, self.manifest.entry(&self.dir, FILES[1])?)?;
        let mut stored = crate::hf::read_tensors(&self.dir)?;
        let tensors = params::param_infos(&self.state.config)
            .into_iter()
            .map(|info| {
                let t = stored
                    .remove(&info.name)
                    .ok_or_else(|| err(&self.dir, format!("{}: missing", info.name)))?;
                let want = if info.transposed_in_hf {
                    vec![info.shape[1], info.shape[0]]
                } else {
                    info.shape.clone()
                };
                if t.dtype != crate::hf::StoredDtype::F32 || t.shape != want {
                    return Err(err(
                        &t.file,
                        format!(
                            "{} is {:?} {:?}, expected F32 {want:?}",
                            info.name, t.dtype, t.shape
                        ),
                    ));
                }
                Ok(t)
            })
            .collect::<Result<Vec<_>>>()?;
        // Nothing beside the model's tensors, as `load` counts them.
        if let Some(extra) = stored.keys().next() {
            return Err(err(
                &self.dir,
                format!("{extra}: not a parameter of this model"),
            ));
        }
        Ok(tensors)
    }

    /// The optimizer's moments file, verified by a streamed checksum, and its length.
    pub(crate) fn verified_moments_file(&self) -> Result<(PathBuf, u64)> {
        let entry = self.manifest.entry(&self.dir, FILES[2])?;
        verify_streamed(&self.dir, entry)?;
        Ok((self.dir.join(&entry.name), entry.bytes))
    }

    /// The optimizer's moment bytes, whole and verified (for a store that cannot be filled
    /// from a reader).
    pub fn moments(&self) -> Result<Vec<u8>> {
        read_verified(&self.dir, self.manifest.entry(&self.dir, FILES[2])?)
    }
}

/// A reader that hashes and counts what passes through it.
struct HashingReader<R> {
    inner: R,
    hasher: xxhash_rust::xxh3::Xxh3,
    read: u64,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.read += n as u64;
        Ok(n)
    }
}

/// Load the checkpoint at `path` (a step directory, or a root: its newest checkpoint), checking
/// every file against the manifest, the state against the manifest, and every tensor's name,
/// dtype and shape against the config. Sizes are checked before anything is allocated for them.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let dir = resolve(path)?;
    let manifest = read_manifest(&dir)?;
    let state = read_state(&dir, &manifest)?;
    if state.finetune.is_some() {
        return load_adapters(dir, &manifest, state);
    }
    let entry = |name: &str| manifest.entry(&dir, name);
    let param_count = state.config.parameter_count()?;
    let tensors = state.config.tensor_count()? as u64;
    let (model_entries, weight_map) = manifest.model_entries(&dir)?;
    // f32 data plus a header of a few hundred bytes per tensor (and per shard): files much
    // larger than that are not this model's, and are refused before they are read.
    let max_model_bytes = param_count
        .checked_mul(4)
        .and_then(|b| b.checked_add(tensors.saturating_mul(512) + 4096))
        .and_then(|b| b.checked_add((model_entries.len() as u64).saturating_mul(4096)))
        .ok_or_else(|| err(&dir, "parameter bytes overflow"))?;
    let model_bytes = model_entries
        .iter()
        .fold(0u64, |acc, e| acc.saturating_add(e.bytes));
    if model_bytes > max_model_bytes {
        return Err(err(
            &dir.join(&model_entries[0].name),
            format!("{model_bytes} bytes of model files for a model of {param_count} parameters"),
        ));
    }
    let bytes = model_entries
        .iter()
        .map(|e| read_verified(&dir, e))
        .collect::<Result<Vec<_>>>()?;
    let mut found = std::collections::HashMap::new();
    for (e, b) in model_entries.iter().zip(&bytes) {
        let path = dir.join(&e.name);
        let st = SafeTensors::deserialize(b).map_err(|x| err(&path, x.to_string()))?;
        for (name, view) in st.tensors() {
            if let Some(map) = &weight_map {
                if map.get(&name) != Some(&e.name) {
                    return Err(err(&path, format!("{name} is not where the index says")));
                }
            }
            if found.insert(name.clone(), (view, path.clone())).is_some() {
                return Err(err(&path, format!("{name} is in two model files")));
            }
        }
    }
    if found.len() as u64 != tensors {
        return Err(err(
            &dir.join(&model_entries[0].name),
            format!("{} tensors, the config needs {tensors}", found.len()),
        ));
    }
    let mut out = Vec::with_capacity(found.len());
    for info in params::param_infos(&state.config) {
        let (t, model_path) = found.remove(&info.name).ok_or_else(|| {
            err(
                &dir.join(&model_entries[0].name),
                format!("{}: missing", info.name),
            )
        })?;
        if t.dtype() != Dtype::F32 {
            return Err(err(
                &model_path,
                format!("{} is {:?}, expected F32", info.name, t.dtype()),
            ));
        }
        let want: Vec<usize> = if info.transposed_in_hf {
            vec![info.shape[1], info.shape[0]]
        } else {
            info.shape.clone()
        };
        if t.shape() != want.as_slice() {
            return Err(err(
                &model_path,
                format!("{} has shape {:?}, expected {want:?}", info.name, t.shape()),
            ));
        }
        let data: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        out.push(if info.transposed_in_hf {
            transpose(&data, info.shape[1], info.shape[0])
        } else {
            data
        });
    }
    drop(bytes);
    let opt_entry = check_model_optimizer_state(&dir, &manifest, &state)?;
    let moments = read_verified(&dir, opt_entry)?;
    read_verified(&dir, entry("config.json")?)?;
    Ok(Checkpoint {
        dir,
        state,
        params: out,
        moments,
    })
}

/// The optimizer state against what it optimizes (`tensors` tensors of `numel` values, the
/// model's or the adapters'), before any of its sizes is used; at most two f32 moments per
/// value in `optimizer.bin` (8-bit state is smaller). Its manifest entry.
fn check_optimizer_state<'m>(
    dir: &Path,
    manifest: &'m Manifest,
    state: &TrainingState,
    (tensors, numel): (u64, u64),
    owner: &str,
) -> Result<&'m ManifestFile> {
    let state_path = dir.join("state.json");
    let opt_numel = state
        .optimizer
        .params
        .iter()
        .try_fold(0u64, |acc, p| acc.checked_add(p.numel as u64))
        .ok_or_else(|| err(&state_path, "optimizer parameter sizes overflow"))?;
    if state.optimizer.params.len() as u64 != tensors || opt_numel != numel {
        return Err(err(
            &state_path,
            format!(
                "optimizer state for {} tensors / {opt_numel} parameters, {owner} \
                 {tensors} / {numel}",
                state.optimizer.params.len()
            ),
        ));
    }
    let opt_entry = manifest.entry(dir, FILES[2])?;
    if opt_entry.bytes > numel.saturating_mul(8) {
        return Err(err(
            &dir.join(FILES[2]),
            format!(
                "{} bytes of moments for {numel} parameters",
                opt_entry.bytes
            ),
        ));
    }
    Ok(opt_entry)
}

/// [`check_optimizer_state`] for a full model.
fn check_model_optimizer_state<'m>(
    dir: &Path,
    manifest: &'m Manifest,
    state: &TrainingState,
) -> Result<&'m ManifestFile> {
    let sizes = (
        state.config.tensor_count()? as u64,
        state.config.parameter_count()?,
    );
    check_optimizer_state(dir, manifest, state, sizes, "the model has")
}

/// [`load`] of a fine-tuning checkpoint: every file verified against the manifest, the
/// adapters read with PEFT's rules and checked against the modules the state's set-up adapts
/// (names, shapes, rank), the optimizer state against the adapters' sizes.
fn load_adapters(dir: PathBuf, manifest: &Manifest, state: TrainingState) -> Result<Checkpoint> {
    let Some(f) = &state.finetune else {
        return Err(err(&dir, "not a fine-tuning checkpoint"));
    };
    let infos = crate::model::finetune::adapter_infos(&state.config, &f.spec.lora)
        .map_err(|e| err(&dir.join("state.json"), e.to_string()))?;
    let numel = infos.iter().try_fold(0u64, |acc, i| {
        i.shape
            .iter()
            .try_fold(1u64, |p, &d| p.checked_mul(d as u64))
            .and_then(|n| acc.checked_add(n))
    });
    let numel = numel.ok_or_else(|| err(&dir, "adapter sizes overflow"))?;
    for e in &manifest.files {
        let limit = match e.name.as_str() {
            "optimizer.bin" => numel.saturating_mul(8),
            n if n == headroom_lora::WEIGHTS_FILE => numel
                .saturating_mul(4)
                .saturating_add((infos.len() as u64).saturating_mul(512) + 4096),
            _ => MAX_JSON_BYTES,
        };
        if e.bytes > limit {
            return Err(err(
                &dir.join(&e.name),
                format!("{} bytes, at most {limit} expected", e.bytes),
            ));
        }
        read_verified(&dir, e)?;
    }
    let cpu = Cpu::new();
    let adapter = LoraAdapter::load(&cpu, &dir).map_err(|source| TrainError::Adapter {
        path: dir.clone(),
        source,
    })?;
    let modules = crate::model::finetune::adapted_modules(&state.config, &f.spec.lora)?;
    if adapter.len() != modules.len() || adapter.config().r != f.spec.lora.r {
        return Err(err(
            &dir.join(headroom_lora::WEIGHTS_FILE),
            format!(
                "{} modules of rank {}, the run adapts {} of rank {}",
                adapter.len(),
                adapter.config().r,
                modules.len(),
                f.spec.lora.r
            ),
        ));
    }
    let mut params = Vec::with_capacity(2 * modules.len());
    for m in &modules {
        let lora = adapter.get(&m.name).ok_or_else(|| {
            err(
                &dir.join(headroom_lora::WEIGHTS_FILE),
                format!("{}: missing", m.name),
            )
        })?;
        if (lora.out_features(), lora.in_features()) != (m.out_features, m.in_features) {
            return Err(err(
                &dir.join(headroom_lora::WEIGHTS_FILE),
                format!(
                    "{} adapts a {}×{} weight, the model's is {}×{}",
                    m.name,
                    lora.out_features(),
                    lora.in_features(),
                    m.out_features,
                    m.in_features
                ),
            ));
        }
        params.push(lora.a().to_vec());
        params.push(lora.b().to_vec());
    }
    let opt_entry = check_optimizer_state(
        &dir,
        manifest,
        &state,
        (infos.len() as u64, numel),
        "the adapters have",
    )?;
    let moments = read_verified(&dir, opt_entry)?;
    Ok(Checkpoint {
        dir,
        state,
        params,
        moments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LlamaShape;
    use safetensors::tensor::TensorView;

    fn configs() -> [ModelConfig; 2] {
        let base = ModelConfig {
            vocab: 37,
            max_seq: 16,
            layers: 2,
            heads: 2,
            channels: 12,
            family: Family::Gpt2,
        };
        let llama = ModelConfig {
            family: Family::Llama(LlamaShape {
                kv_heads: 1,
                head_dim: None,
                sliding_window: None,
                no_rope_interval: None,
                query_pre_attn_scalar: None,
                multipliers: None,
                padding_idx: None,
                ffn: 20,
                rope_theta: 10_000.0,
                rope_scaling: Default::default(),
                class: Default::default(),
                norm_eps: 1e-5,
                tied_head: false,
            }),
            ..base
        };
        [base, llama]
    }

    /// Once the new checkpoint is published the save has succeeded: a replaced copy or an old
    /// checkpoint that cannot be removed is a warning, not an error, and the other removals
    /// are still made. Pruning never takes the checkpoint just published, even below a later
    /// step, and `keep: None` removes nothing.
    #[test]
    fn cleanup_after_publishing_never_fails_the_save_or_takes_the_new_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let partial = |marker: &str| {
            let p = root.join(format!("{PARTIAL_PREFIX}test"));
            fs::create_dir(&p).unwrap();
            fs::write(p.join("marker"), marker).unwrap();
            p
        };
        let marker =
            |step: usize| fs::read_to_string(root.join(step_dir_name(step)).join("marker"));
        let steps = || {
            list(root)
                .unwrap()
                .into_iter()
                .map(|(s, _)| s)
                .collect::<Vec<_>>()
        };
        for step in [1, 2] {
            fs::create_dir(root.join(step_dir_name(step))).unwrap();
        }
        let refused = |_: &Path| Err(std::io::Error::other("refused"));
        let mut rename = |from: &Path, to: &Path| fs::rename(from, to);

        // Step 1 cannot be removed; step 2 still is.
        let mut not_step_1 = |d: &Path| {
            if d.ends_with(step_dir_name(1)) {
                refused(d)
            } else {
                fs::remove_dir_all(d)
            }
        };
        let p = partial("a");
        let published = publish_with(root, &p, 3, Some(1), &mut rename, &mut not_step_1).unwrap();
        assert_eq!(published, root.join(step_dir_name(3)));
        assert_eq!(steps(), vec![1, 3]);
        assert_eq!(marker(3).unwrap(), "a");

        // The same step again: the replaced copy cannot be removed, the new one is in place.
        let p = partial("b");
        publish_with(root, &p, 3, Some(1), &mut rename, &mut |d| refused(d)).unwrap();
        assert_eq!(marker(3).unwrap(), "b");
        assert_eq!(steps(), vec![1, 3]);
        assert!(fs::read_dir(root).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with(REPLACED_PREFIX)));

        // Nothing pruned without a `keep`.
        publish(root, &partial("c"), 2, None).unwrap();
        assert_eq!(steps(), vec![1, 2, 3]);

        // Below a later step 3, with one to keep: the new step 2 is the one kept, and the
        // leftovers of the failed removals go too.
        publish(root, &partial("d"), 2, Some(1)).unwrap();
        assert_eq!(steps(), vec![2]);
        assert_eq!(marker(2).unwrap(), "d");
        assert_eq!(fs::read_dir(root).unwrap().count(), 1);
    }

    /// A step's save that fails on a file of its partial directory removes the directory and
    /// says which file failed and that nothing of the step was kept; other errors pass as
    /// they are.
    #[test]
    fn a_failed_step_save_is_reported_by_its_step_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let partial = root.join(format!("{PARTIAL_PREFIX}step-00000007-1"));
        let e = saving_step(root, &partial, 7, || -> Result<()> {
            fs::create_dir(&partial).unwrap();
            fs::write(partial.join(FILES[0]), b"half").unwrap();
            Err(err(
                &partial.join(FILES[2]),
                "write: No space left on device",
            ))
        })
        .unwrap_err()
        .to_string();
        assert!(!partial.exists());
        assert_eq!(
            e,
            format!(
                "checkpoint {}: step 7 was not saved (optimizer.bin: write: No space left on \
                 device); its unfinished files were removed and the earlier checkpoints are as \
                 they were",
                root.display()
            )
        );
        let e = saving_step(root, &partial, 7, || -> Result<()> {
            Err(TrainError::Config("elsewhere".into()))
        })
        .unwrap_err();
        assert!(matches!(e, TrainError::Config(_)), "{e}");
    }

    /// A root whose file system cannot hold one checkpoint is refused by the option that
    /// names it, with both sizes; one that can is not.
    #[cfg(unix)]
    #[test]
    fn a_root_without_room_for_one_checkpoint_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        check_room(dir.path(), 1, "--checkpoint-dir").unwrap();
        let e = check_room(dir.path(), u64::MAX, "--checkpoint-dir")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--checkpoint-dir: a checkpoint of this model takes at least"),
            "{e}"
        );
        assert!(e.contains(&dir.path().display().to_string()), "{e}");
        // A directory not made yet is judged by the file system it will be made on.
        check_room(&dir.path().join("not/yet"), u64::MAX, "--checkpoint-dir").unwrap_err();
    }

    /// A publish whose rename fails after the same step's older copy was moved aside puts that
    /// copy back: under its `.replaced-…` name it would be no checkpoint, and the next prune
    /// would delete it.
    #[test]
    fn a_failed_publish_puts_back_the_copy_it_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let step = root.join(step_dir_name(2));
        fs::create_dir(&step).unwrap();
        fs::write(step.join("marker"), "old").unwrap();
        let partial = root.join(format!("{PARTIAL_PREFIX}new"));
        fs::create_dir(&partial).unwrap();
        let mut refused = |_: &Path, _: &Path| Err(std::io::Error::other("refused"));
        let e = publish_with(root, &partial, 2, Some(1), &mut refused, &mut |d| {
            fs::remove_dir_all(d)
        })
        .unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        fs::remove_dir(&partial).unwrap();
        assert_eq!(fs::read_to_string(step.join("marker")).unwrap(), "old");
        let names: Vec<String> = fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec![step_dir_name(2)]);
    }

    /// The streamed model files are, byte for byte, `safetensors::serialize` of the tensors in
    /// Hugging Face's layout (shard by shard, with the same index), and their manifest entries
    /// hold those bytes' length and checksum — both families, one file or shards, transposing
    /// a band of one row up to the whole tensor at a time.
    #[test]
    fn streamed_model_files_are_what_safetensors_serializes() {
        let cpu = Cpu::new();
        for cfg in configs() {
            let params = params::init_params(&cpu, &cfg, 5).unwrap();
            let infos = params::param_infos(&cfg);
            let owned: Vec<(String, Vec<usize>, Vec<u8>)> = infos
                .iter()
                .zip(&params)
                .map(|(info, t)| {
                    let x = t.as_slice::<f32>().unwrap();
                    let (shape, data) = if info.transposed_in_hf {
                        let (rows, cols) = (info.shape[0], info.shape[1]);
                        (vec![cols, rows], transpose(x, rows, cols))
                    } else {
                        (info.shape.clone(), x.to_vec())
                    };
                    (
                        info.name.clone(),
                        shape,
                        bytemuck::cast_slice(&data).to_vec(),
                    )
                })
                .collect();
            for (max_shard, chunk_bytes) in [(u64::MAX, WRITE_CHUNK_BYTES), (2000, 4), (700, 52)] {
                let dir = tempfile::tempdir().unwrap();
                let files = model_files_by(
                    &cfg,
                    &params,
                    max_shard,
                    dir.path(),
                    dir.path(),
                    chunk_bytes,
                )
                .unwrap();
                let shards = shard_ranges(owned.iter().map(|t| t.2.len() as u64), max_shard);
                assert_eq!(files.len(), shards.len() + usize::from(shards.len() > 1));
                for (file, range) in files.iter().zip(&shards) {
                    let views = owned[range.clone()].iter().map(|(n, s, b)| {
                        (
                            n.as_str(),
                            TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
                        )
                    });
                    let want = safetensors::serialize(views, None).unwrap();
                    let got = fs::read(dir.path().join(&file.name)).unwrap();
                    assert!(got == want, "{} ({max_shard}, {chunk_bytes})", file.name);
                    assert_eq!(
                        (file.bytes, file.xxh3.as_str()),
                        (want.len() as u64, checksum(&want).as_str())
                    );
                }
                if shards.len() > 1 {
                    let index = files.last().unwrap();
                    assert_eq!(index.name, SHARD_INDEX);
                    let got = fs::read(dir.path().join(SHARD_INDEX)).unwrap();
                    assert_eq!(checksum(&got), index.xxh3);
                }
            }
        }
    }
}
