//! Parameter-efficient fine-tuning on the model (LoRA, QLoRA): every base parameter frozen,
//! low-rank adapters `scaling · B·A` on chosen block linears as the only trainable tensors,
//! and optionally the block linears stored in 4 bits (bitsandbytes' NF4/FP4 layout).
//!
//! The blocks call `Model::block_linear` and `Model::block_linear_backward` for every
//! projection; those pick the base (dense working weight, or 4-bit through the fused
//! dequantize-matmul) and add the adapter when the module has one. So LoRA is not a second
//! copy of the model: the same block code runs full training and fine-tuning on any backend.
//!
//! Memory, as the tracker sees it:
//! - the frozen base: working copies only (bf16 under bf16, f32 under fp32; no fp32
//!   masters, no gradient, no optimizer state), the 4-bit linears at their packed size;
//! - adapters: fp32 masters (+ working copies in low precision), their gradients and moments;
//! - per adapted projection in forward: `h = x·Aᵀ` `[N, r]` and `u = h·Bᵀ` `[N, out]` as
//!   workspace, dropped at once. Trade-off: backward recomputes `h` (one `[N, in]×[in, r]`
//!   GEMM, small beside the base's) instead of keeping `N·r` floats per module, so the kept
//!   activations are exactly the full model's — which checkpointing then trims as usual.
//! - a frozen 4-bit base's input gradient goes through a `[N, in]` workspace buffer (the
//!   fused kernel overwrites; the op adds);
//! - with LoRA dropout, the dropped input `[N, in]` (f32 workspace) while the adapter runs,
//!   and in backward a second `[N, in]` for the adapter's share of the input gradient, which
//!   the mask then multiplies.
//!
//! Order of the trainable tensors: the adapted modules in parameter order, each as
//! `[A, B]` (A `[r, in]`, B `[out, r]`, PEFT's shapes); a block's adapters are contiguous.

use headroom_amp::MasterWeights;
use headroom_lora::{LoraConfig, LoraLinear};
use headroom_quant::{BlockSize, QuantConfig, QuantType, QuantizedTensor};
use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory, Tensor};
use serde::{Deserialize, Serialize};

use crate::model::gpt2_block::at;
use crate::model::ops::ModelOps;
use crate::model::params::{self, layer, llama_layer, ParamInfo, TensorSink};
use crate::model::transformer::{weights_config, ModelOptions};
use crate::model::{Family, Model, ModelConfig};
use crate::{Result, TrainError};

/// How the frozen block linears are stored in 4 bits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuantSpec {
    /// `nf4` or `fp4`.
    pub quant_type: String,
    /// Elements per absmax block (bitsandbytes' default 64).
    pub blocksize: usize,
    /// Quantize the absmax values too (bitsandbytes' `compress_statistics`, QLoRA's double
    /// quantization).
    pub double_quant: bool,
}

impl QuantSpec {
    /// headroom-quant's configuration (checked).
    pub fn config(&self) -> Result<QuantConfig> {
        Ok(QuantConfig {
            quant_type: QuantType::from_name(&self.quant_type)?,
            blocksize: BlockSize::new(self.blocksize as u64)?,
            double_quant: self.double_quant,
        })
    }
}

/// A fine-tuning set-up: the adapters, and how the frozen base is stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FinetuneSpec {
    /// Rank, alpha, rsLoRA, targets (PEFT's names and suffix rule), initialisation seed.
    pub lora: LoraConfig,
    /// 4-bit storage of every block linear (QLoRA), or `None`: the base in the run's
    /// precision.
    pub quantize: Option<QuantSpec>,
}

impl FinetuneSpec {
    /// One line: `LoRA r 8 (alpha 16) on q_proj,v_proj, base nf4 (block 64, double quant)`.
    pub fn describe(&self) -> String {
        let l = &self.lora;
        format!(
            "LoRA r {} (alpha {}{}{}) on {}, base {}",
            l.r,
            l.alpha,
            if l.use_rslora { ", rsLoRA" } else { "" },
            if l.dropout > 0.0 {
                format!(", dropout {}", l.dropout)
            } else {
                String::new()
            },
            l.target_modules.join(","),
            match &self.quantize {
                Some(q) => format!(
                    "{} (block {}{})",
                    q.quant_type,
                    q.blocksize,
                    if q.double_quant { ", double quant" } else { "" }
                ),
                None => "frozen in the run's precision".into(),
            }
        )
    }
}

/// One block linear that has an adapter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdaptedModule {
    /// The base weight's index in [`params::param_infos`] order.
    pub param: usize,
    /// Its block.
    pub layer: usize,
    /// PEFT's module name (`model.layers.0.self_attn.q_proj`, `transformer.h.0.attn.c_attn`).
    pub name: String,
    /// Output features (B's rows).
    pub out_features: usize,
    /// Input features (A's columns).
    pub in_features: usize,
}

/// The block linears' weight offsets of `cfg`'s family (no biases, norms or embeddings).
pub fn block_linear_offsets(cfg: &ModelConfig) -> &'static [usize] {
    use llama_layer as ll;
    match cfg.family {
        Family::Gpt2 => &[
            layer::QKV_W,
            layer::ATTN_PROJ_W,
            layer::FC_W,
            layer::FC_PROJ_W,
        ],
        Family::Llama(_) => &[ll::Q, ll::K, ll::V, ll::O, ll::GATE, ll::UP, ll::DOWN],
    }
}

/// Module-name suffixes that select every block linear of `cfg`'s family (what PEFT's
/// `target_modules="all-linear"` selects, the output head excepted).
pub fn all_linear_targets(cfg: &ModelConfig) -> Vec<&'static str> {
    match cfg.family {
        Family::Gpt2 => vec!["c_attn", "c_proj", "c_fc"],
        Family::Llama(_) => vec![
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    }
}

/// PEFT's module name for a headroom parameter name of `cfg`'s family (`.weight` removed;
/// GPT-2's modules sit under `transformer.` in `GPT2LMHeadModel`).
pub fn peft_module(cfg: &ModelConfig, weight_name: &str) -> Option<String> {
    let module = weight_name.strip_suffix(".weight")?;
    Some(match cfg.family {
        Family::Gpt2 if module != "lm_head" => format!("transformer.{module}"),
        _ => module.to_owned(),
    })
}

/// The block linears `lora` targets, in parameter order. No match is an error, as in PEFT.
pub fn adapted_modules(cfg: &ModelConfig, lora: &LoraConfig) -> Result<Vec<AdaptedModule>> {
    let infos = params::param_infos(cfg);
    let mut out = Vec::new();
    for l in 0..cfg.layers {
        for &off in block_linear_offsets(cfg) {
            let i = params::layer_index(cfg, l, off);
            let info = &infos[i];
            let Some(name) = peft_module(cfg, &info.name) else {
                continue;
            };
            if lora.matches(&name) {
                out.push(AdaptedModule {
                    param: i,
                    layer: l,
                    name,
                    out_features: info.shape[0],
                    in_features: info.shape[1],
                });
            }
        }
    }
    if out.is_empty() {
        return Err(headroom_lora::LoraError::NoTargetMatched {
            targets: lora.target_modules.clone(),
        }
        .into());
    }
    Ok(out)
}

/// The trainable tensors of a fine-tuning run: PEFT's tensor names and shapes, in training
/// order (`[A, B]` per adapted module).
pub fn adapter_infos(cfg: &ModelConfig, lora: &LoraConfig) -> Result<Vec<ParamInfo>> {
    let r = lora.r;
    Ok(adapted_modules(cfg, lora)?
        .into_iter()
        .flat_map(|m| {
            [
                ParamInfo {
                    name: headroom_lora::peft_tensor_name(&m.name, headroom_lora::LoraMatrix::A),
                    shape: vec![r, m.in_features],
                    transposed_in_hf: false,
                },
                ParamInfo {
                    name: headroom_lora::peft_tensor_name(&m.name, headroom_lora::LoraMatrix::B),
                    shape: vec![m.out_features, r],
                    transposed_in_hf: false,
                },
            ]
        })
        .collect())
}

/// The frozen base's storage and the adapters of a fine-tuned [`Model`].
pub(crate) struct Finetune<B: ModelOps> {
    pub(crate) spec: FinetuneSpec,
    scaling: f32,
    pub(crate) modules: Vec<AdaptedModule>,
    /// By base parameter index: the adapted module's position in `modules`.
    slot_of: Vec<Option<usize>>,
    /// `first[l]..first[l + 1]` are block `l`'s modules.
    first: Vec<usize>,
    /// `[A, B]` per module: fp32 masters and their working copies.
    pub(crate) adapters: MasterWeights<B>,
    /// By base parameter index: the 4-bit weight, when the base is quantized.
    quantized: Vec<Option<B::Quantized>>,
    /// Where dropout masks come from: set per micro-batch by the trainer, `training` only
    /// inside `forward_backward` (so `loss`, `logits` and decoding never drop anything).
    dropout: DropoutPosition,
}

/// The (step, micro-batch) a training forward belongs to: LoRA dropout's mask key, together
/// with the seed and the module name. Atomics so the model stays `Sync`.
#[derive(Default)]
pub(crate) struct DropoutPosition {
    training: std::sync::atomic::AtomicBool,
    step: std::sync::atomic::AtomicU64,
    micro_batch: std::sync::atomic::AtomicU64,
}

/// Marks a fine-tuning model as training until dropped (also on an error's early return).
pub(crate) struct TrainingGuard<'a>(Option<&'a DropoutPosition>);

impl Drop for TrainingGuard<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.0 {
            p.training
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl<B: ModelOps> Finetune<B> {
    /// The range of trainable tensors (2 per module) that belong to block `l`.
    pub(crate) fn block_range(&self, l: usize) -> std::ops::Range<usize> {
        2 * self.first[l]..2 * self.first[l + 1]
    }
}

/// Builds a fine-tuning [`Model`] from base tensors fed one at a time (in
/// [`params::param_infos`] order): each fp32 tensor is turned into its frozen form — kept as
/// it is under fp32, rounded to bf16/fp16, or quantized to 4 bits — and freed at once, so the
/// whole fp32 base never exists (a 7B base streams through one tensor's fp32 copy). As the
/// sink of a load ([`TensorSink`]) it takes bf16/f16 tensors a chunk at a time and quantizes
/// 4-bit linears as their chunks arrive, so those never exist in f32 at all. It also
/// fingerprints the base (xxh3-64 of the fp32 values), so a resume can refuse another base.
pub struct FinetuneBuilder {
    cpu: Cpu,
    cfg: ModelConfig,
    opts: ModelOptions,
    spec: FinetuneSpec,
    quant: Option<QuantConfig>,
    quantize_at: Vec<bool>,
    infos: Vec<ParamInfo>,
    working: Vec<CpuTensor>,
    quantized: Vec<Option<QuantizedTensor>>,
    hasher: xxhash_rust::xxh3::Xxh3,
    /// `false` for [`FinetuneBuilder::frozen`]: no adapters at all.
    with_adapters: bool,
    /// (index, count) of the f32 values [`TensorSink::values`] fingerprinted since the last
    /// push: a tensor pushed already rounded must have had all of its values seen.
    streamed: (usize, u64),
    /// The 4-bit linear being quantized from its streamed values, and its index.
    quantizer: Option<(usize, headroom_quant::Quantizer)>,
}

impl FinetuneBuilder {
    /// A builder for `cfg` computing with `opts`, adapters and base storage per `spec`.
    pub fn new(
        cpu: &Cpu,
        cfg: ModelConfig,
        opts: ModelOptions,
        spec: FinetuneSpec,
    ) -> Result<Self> {
        spec.lora.validate()?;
        adapted_modules(&cfg, &spec.lora)?;
        Self::build(cpu, cfg, opts, spec, true)
    }

    /// A builder for an inference model (`headroom sample` and `eval`): the base stored as
    /// [`FinetuneBuilder::new`] stores it — working copies only, in `opts`' precision, the
    /// block linears in 4 bits when `quantize` says so (bitsandbytes' `load_in_4bit`) — and
    /// no adapters. Its [`finish`](Self::finish) takes no adapter tensors.
    pub fn frozen(
        cpu: &Cpu,
        cfg: ModelConfig,
        opts: ModelOptions,
        quantize: Option<QuantSpec>,
    ) -> Result<Self> {
        // No target: the LoRA configuration only fills the spec's slot.
        let lora = LoraConfig::new(1, 1.0, Vec::<String>::new());
        Self::build(cpu, cfg, opts, FinetuneSpec { lora, quantize }, false)
    }

    fn build(
        cpu: &Cpu,
        cfg: ModelConfig,
        opts: ModelOptions,
        spec: FinetuneSpec,
        with_adapters: bool,
    ) -> Result<Self> {
        cfg.validate()?;
        let quant = spec.quantize.as_ref().map(QuantSpec::config).transpose()?;
        let infos = params::param_infos(&cfg);
        let mut quantize_at = vec![false; infos.len()];
        if quant.is_some() {
            for l in 0..cfg.layers {
                for &off in block_linear_offsets(&cfg) {
                    quantize_at[params::layer_index(&cfg, l, off)] = true;
                }
            }
        }
        Ok(FinetuneBuilder {
            cpu: cpu.clone(),
            cfg,
            opts,
            spec,
            quant,
            quantize_at,
            working: Vec::with_capacity(infos.len()),
            quantized: Vec::with_capacity(infos.len()),
            infos,
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            with_adapters,
            streamed: (0, 0),
            quantizer: None,
        })
    }

    /// The dtype base tensor `index` is stored in when it is not quantized: the run's storage
    /// dtype. A 4-bit linear pushed whole is quantized from f32, so it is wanted in f32 (a
    /// load's sink [consumes](TensorSink::consumes) it instead, chunk by chunk).
    fn stored_dtype(&self, index: usize) -> DType {
        match (self.quant, self.quantize_at.get(index)) {
            (Some(_), Some(true)) => DType::F32,
            _ => self.opts.precision.storage(),
        }
    }

    /// The next base tensor (its parameter's shape); `index` must be the next one. It is f32,
    /// or already in the stored dtype (bf16/f16) after its f32 values were given to
    /// [`TensorSink::values`] — the fingerprint is over the f32 values either way, so the
    /// same base fingerprints the same however it arrives.
    pub fn push(&mut self, index: usize, tensor: CpuTensor) -> Result<()> {
        let i = self.working.len();
        let info = self.infos.get(i).ok_or_else(|| {
            TrainError::Config(format!(
                "base tensor {index} of a model of {}",
                self.infos.len()
            ))
        })?;
        let streamed = std::mem::take(&mut self.streamed);
        if let Some((qi, quantizer)) = self.quantizer.take() {
            // A consumed 4-bit linear: its values went to the quantizer, this is the marker.
            if qi != index || index != i || tensor.shape().numel() != 0 {
                return Err(TrainError::Config(format!(
                    "base tensor {index} pushed while tensor {qi} {} was being quantized",
                    info.name
                )));
            }
            if streamed != (index, info.shape.iter().product::<usize>() as u64) {
                return Err(TrainError::Config(format!(
                    "base tensor {index} {} pushed before all of its values arrived",
                    info.name
                )));
            }
            let _l = headroom_profiler::label_absolute(&format!("{} (frozen)", info.name));
            let q = quantizer.finish()?;
            self.quantized.push(Some(q));
            // A placeholder: nothing reads a quantized weight's dense form.
            let _g = MemoryCategory::Parameters.enter();
            let storage = self.opts.precision.storage();
            self.working.push(self.cpu.zeros([0], storage)?);
            return Ok(());
        }
        let pre_rounded = tensor.dtype() != DType::F32;
        if index != i
            || tensor.shape().dims() != info.shape.as_slice()
            || (pre_rounded && tensor.dtype() != self.stored_dtype(i))
        {
            return Err(TrainError::Config(format!(
                "base tensor {index} ({:?} {:?}) is not the model's tensor {i} {} {:?} in f32 \
                 or {:?}",
                tensor.shape().dims(),
                tensor.dtype(),
                info.name,
                info.shape,
                self.stored_dtype(i)
            )));
        }
        if pre_rounded {
            if streamed != (index, tensor.shape().numel() as u64) {
                return Err(TrainError::Config(format!(
                    "base tensor {index} {} came in {:?} without its f32 values",
                    info.name,
                    tensor.dtype()
                )));
            }
            self.quantized.push(None);
            self.working.push(tensor);
            return Ok(());
        }
        let master = tensor;
        self.hasher
            .update(bytemuck::cast_slice(master.as_slice::<f32>()?));
        let cpu = &self.cpu;
        let storage = self.opts.precision.storage();
        let _l = headroom_profiler::label_absolute(&format!("{} (frozen)", info.name));
        let _g = MemoryCategory::Parameters.enter();
        match (self.quant, self.quantize_at[i]) {
            (Some(qc), true) => {
                let q = QuantizedTensor::quantize(
                    cpu,
                    master.as_slice::<f32>()?,
                    master.shape().dims(),
                    qc,
                )?;
                drop(master);
                self.quantized.push(Some(q));
                // A placeholder: nothing reads a quantized weight's dense form.
                self.working.push(cpu.zeros([0], storage)?);
            }
            _ if storage == DType::F32 => {
                self.quantized.push(None);
                self.working.push(master);
            }
            _ => {
                let mut w = cpu.uninit(master.shape().clone(), storage)?;
                cpu.cast(&master, &mut w)?;
                drop(master);
                self.quantized.push(None);
                self.working.push(w);
            }
        }
        Ok(())
    }

    /// The fingerprint of the base pushed so far (see [`crate::checkpoint::FinetuneState`]).
    pub fn fingerprint(&self) -> String {
        format!("{:016x}", self.hasher.digest())
    }

    /// The model: the frozen base (every tensor pushed) and adapters initialised as PEFT does
    /// from `spec.lora.seed`, or `adapters` (the trainable tensors in [`adapter_infos`] order)
    /// when given.
    pub fn finish(self, adapters: Option<&[Vec<f32>]>) -> Result<Model> {
        let FinetuneBuilder {
            cpu,
            cfg,
            opts,
            spec,
            infos,
            working,
            quantized,
            with_adapters,
            ..
        } = self;
        if working.len() != infos.len() {
            return Err(TrainError::Config(format!(
                "{} of the model's {} base tensors were given",
                working.len(),
                infos.len()
            )));
        }
        let modules = if with_adapters {
            adapted_modules(&cfg, &spec.lora)?
        } else {
            Vec::new()
        };
        let r = spec.lora.r;
        if let Some(saved) = adapters {
            if saved.len() != 2 * modules.len() {
                return Err(TrainError::Config(format!(
                    "{} adapter tensors for {} modules",
                    saved.len(),
                    modules.len()
                )));
            }
        }
        let adapter_masters = {
            let _l = headroom_profiler::label_absolute("adapters (fp32 masters)");
            let _g = MemoryCategory::Parameters.enter();
            // PEFT's initialisation is drawn into untracked memory and copied: only the
            // masters are the run's.
            let scratch = Cpu::new();
            let mut out = Vec::with_capacity(2 * modules.len());
            for (k, m) in modules.iter().enumerate() {
                let (a_shape, b_shape) = ([r, m.in_features], [m.out_features, r]);
                match adapters {
                    Some(saved) => {
                        out.push(cpu.upload(&saved[2 * k], a_shape)?);
                        out.push(cpu.upload(&saved[2 * k + 1], b_shape)?);
                    }
                    None => {
                        let fresh = LoraLinear::new(
                            &scratch,
                            &m.name,
                            m.out_features,
                            m.in_features,
                            &spec.lora,
                        )?;
                        out.push(cpu.upload(fresh.a(), a_shape)?);
                        out.push(cpu.upload(fresh.b(), b_shape)?);
                    }
                }
            }
            out
        };
        let wc = weights_config(opts.precision);
        let adapters = {
            let _l = headroom_profiler::label_absolute("adapters (working copies)");
            MasterWeights::new(&cpu, adapter_masters, wc)?
        };
        let mut slot_of = vec![None; infos.len()];
        let mut first = vec![0; cfg.layers + 1];
        for (k, m) in modules.iter().enumerate() {
            slot_of[m.param] = Some(k);
            first[m.layer + 1] = k + 1;
        }
        for l in 1..=cfg.layers {
            first[l] = first[l].max(first[l - 1]);
        }
        let finetune = Finetune {
            scaling: spec.lora.scaling(),
            spec,
            modules,
            slot_of,
            first,
            adapters,
            quantized,
            dropout: DropoutPosition::default(),
        };
        let mut model =
            Model::from_weights(&cpu, cfg, opts, MasterWeights::working_only(working, wc)?)?;
        model.finetune = Some(finetune);
        Ok(model)
    }
}

/// The builder as the sink of an HF load ([`crate::hf::load_into`]) or a seeded initialisation
/// ([`params::init_params_into`]): tensors stored in bf16 or f16 arrive in that dtype, filled
/// a chunk at a time and fingerprinted on the way, so building a bf16 or 4-bit base never
/// holds an f32 copy of its embedding or head.
impl TensorSink for FinetuneBuilder {
    fn dtype(&self, index: usize) -> DType {
        self.stored_dtype(index)
    }

    fn consumes(&self, index: usize) -> bool {
        self.quant.is_some() && self.quantize_at.get(index) == Some(&true)
    }

    fn values(&mut self, index: usize, values: &[f32]) -> Result<()> {
        if self.consumes(index) {
            if self.quantizer.as_ref().is_none_or(|(qi, _)| *qi != index) {
                let (Some(qc), Some(info)) = (self.quant, self.infos.get(index)) else {
                    return Err(TrainError::Config(format!("no 4-bit tensor {index}")));
                };
                let _l = headroom_profiler::label_absolute(&format!("{} (frozen)", info.name));
                let q = headroom_quant::Quantizer::new(&self.cpu, &info.shape, qc)?;
                self.quantizer = Some((index, q));
            }
            if let Some((_, q)) = &mut self.quantizer {
                q.push(values)?;
            }
        }
        self.hasher.update(bytemuck::cast_slice(values));
        let seen = if self.streamed.0 == index {
            self.streamed.1
        } else {
            0
        };
        self.streamed = (index, seen + values.len() as u64);
        Ok(())
    }

    fn push(&mut self, index: usize, tensor: CpuTensor) -> Result<()> {
        FinetuneBuilder::push(self, index, tensor)
    }
}

impl Model<Cpu> {
    /// A model for fine-tuning from a whole fp32 `base` ([`params::param_infos`] order,
    /// consumed tensor by tensor): [`FinetuneBuilder`] in one call.
    pub fn finetune(
        cpu: &Cpu,
        cfg: ModelConfig,
        opts: ModelOptions,
        base: Vec<CpuTensor>,
        spec: FinetuneSpec,
        adapters: Option<&[Vec<f32>]>,
    ) -> Result<Self> {
        let mut b = FinetuneBuilder::new(cpu, cfg, opts, spec)?;
        for (i, t) in base.into_iter().enumerate() {
            b.push(i, t)?;
        }
        b.finish(adapters)
    }
}

impl<B: ModelOps> Model<B> {
    /// Whether every base parameter is frozen (a fine-tuning model).
    pub fn is_finetune(&self) -> bool {
        self.finetune.is_some()
    }

    /// The fine-tuning set-up, when this is a fine-tuning model.
    pub fn finetune_spec(&self) -> Option<&FinetuneSpec> {
        self.finetune.as_ref().map(|f| &f.spec)
    }

    /// The adapted modules, in training order (empty for a fully trained model).
    pub fn adapted_modules(&self) -> &[AdaptedModule] {
        self.finetune.as_ref().map_or(&[], |f| &f.modules)
    }

    /// The tensors training updates, fp32, in the order `forward_backward`'s gradients have:
    /// the adapters (`[A, B]` per module) when fine-tuning, else every master.
    pub fn trainable(&self) -> &[B::Tensor] {
        match &self.finetune {
            Some(f) => f.adapters.masters(),
            None => self.weights.masters(),
        }
    }

    /// [`Model::trainable`], mutably: call [`Model::refresh_trainable`] after changing them.
    pub fn trainable_mut(&mut self) -> &mut [B::Tensor] {
        match &mut self.finetune {
            Some(f) => f.adapters.masters_mut(),
            None => self.weights.masters_mut(),
        }
    }

    /// Re-derive the working copies of the trainable tensors.
    pub fn refresh_trainable(&mut self) -> Result<()> {
        match &mut self.finetune {
            Some(f) => Ok(f.adapters.refresh(&self.backend, 0)?),
            None => self.refresh_working(),
        }
    }

    /// The names and shapes of [`Model::trainable`].
    pub fn trainable_infos(&self) -> Result<Vec<ParamInfo>> {
        match &self.finetune {
            Some(f) => adapter_infos(&self.cfg, &f.spec.lora),
            None => Ok(params::param_infos(&self.cfg)),
        }
    }

    /// Bytes of the 4-bit base weights (packed codes and scales), 0 when none.
    pub fn quantized_bytes(&self) -> usize
    where
        B::Quantized: QuantizedBytes,
    {
        self.finetune.as_ref().map_or(0, |f| {
            f.quantized
                .iter()
                .flatten()
                .map(QuantizedBytes::stored_bytes)
                .sum()
        })
    }

    /// The parameter gradients of block-local offsets `w_off` (and `b_off`) in `grads`, or
    /// `None` for a frozen base (whose block gradients the caller does not hold).
    pub(crate) fn param_grads<'g>(
        &self,
        grads: &'g mut [B::Tensor],
        w_off: usize,
        b_off: Option<usize>,
    ) -> (Option<&'g mut B::Tensor>, Option<&'g mut B::Tensor>) {
        if self.finetune.is_some() {
            return (None, None);
        }
        match b_off {
            Some(b) => {
                let (w, bias) = crate::model::gpt2_block::two_mut(grads, w_off, b);
                (Some(w), Some(bias))
            }
            None => (grads.get_mut(w_off), None),
        }
    }

    /// The optimizer step and micro-batch of the next training forward: with LoRA dropout,
    /// the key of its masks (with the seed and the module name), so every micro-batch drops
    /// its own elements and a recomputed forward drops the same ones. Nothing for a model that
    /// is not fine-tuning.
    pub fn set_dropout_position(&self, step: u64, micro_batch: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        if let Some(f) = &self.finetune {
            f.dropout.step.store(step, Relaxed);
            f.dropout.micro_batch.store(micro_batch, Relaxed);
        }
    }

    /// Dropout on for the guard's life (`forward_backward`).
    pub(crate) fn training(&self) -> TrainingGuard<'_> {
        let p = self.finetune.as_ref().map(|f| &f.dropout);
        if let Some(p) = p {
            p.training.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        TrainingGuard(p)
    }

    /// Module `slot`'s dropout mask in the current forward, if it drops anything.
    fn dropout_mask(&self, slot: usize) -> Option<headroom_lora::DropoutMask> {
        use std::sync::atomic::Ordering::Relaxed;
        let f = self.finetune.as_ref()?;
        if !f.dropout.training.load(Relaxed) {
            return None;
        }
        let mode = headroom_lora::Mode::Train {
            step: f.dropout.step.load(Relaxed),
            micro_batch: f.dropout.micro_batch.load(Relaxed),
        };
        let l = &f.spec.lora;
        headroom_lora::DropoutMask::new(l.seed, &f.modules.get(slot)?.name, l.dropout, mode)
    }

    /// The adapter of base parameter `i`.
    fn adapter_of(&self, i: usize) -> Result<Option<AdapterRef<'_, B::Tensor>>> {
        let Some(f) = &self.finetune else {
            return Ok(None);
        };
        let Some(k) = f.slot_of.get(i).copied().flatten() else {
            return Ok(None);
        };
        Ok(Some(AdapterRef {
            a: f.adapters.working(2 * k)?,
            b: f.adapters.working(2 * k + 1)?,
            scaling: f.scaling,
            slot: k,
        }))
    }

    fn quantized_of(&self, i: usize) -> Option<&B::Quantized> {
        self.finetune
            .as_ref()
            .and_then(|f| f.quantized.get(i))
            .and_then(Option::as_ref)
    }

    /// `y = x·Wᵀ (+ b)` for block `l`'s linear at `w_off` (bias at `b_off`), plus
    /// `scaling · (x·Aᵀ)·Bᵀ` when it has an adapter. `x` `[.., in]`, `y` `[.., out]` f32,
    /// overwritten.
    pub(crate) fn block_linear(
        &self,
        l: usize,
        bw: &[B::Tensor],
        w_off: usize,
        b_off: Option<usize>,
        y: &mut B::Tensor,
        x: &B::Tensor,
    ) -> Result<()> {
        let be = self.backend();
        let i = params::layer_index(&self.cfg, l, w_off);
        let bias = b_off.map(|b| at(bw, b)).transpose()?;
        match self.quantized_of(i) {
            Some(q) => be.linear_quantized(y, x, q, bias, self.opts.precision)?,
            None => be.linear(y, x, at(bw, w_off)?, bias)?,
        }
        if let Some(AdapterRef {
            a,
            b,
            scaling,
            slot,
            ..
        }) = self.adapter_of(i)?
        {
            let (r, inp, out) = (
                a.shape().dims()[0],
                a.shape().dims()[1],
                b.shape().dims()[0],
            );
            let rows = y.numel() / out.max(1);
            // LoRA dropout acts on the adapter's input only: `dropout(x)` `[N, in]` f32.
            let dropped = match self.dropout_mask(slot) {
                Some(m) => {
                    let mut xd = self.scratch([rows, inp])?;
                    be.dropout(&mut xd, x, &m)?;
                    Some(xd)
                }
                None => None,
            };
            let mut h = self.scratch([rows, r])?;
            be.linear(&mut h, dropped.as_ref().unwrap_or(x), a, None)?;
            drop(dropped);
            let mut u = self.scratch([rows, out])?;
            be.linear(&mut u, &h, b, None)?;
            drop(h);
            // PEFT's order: `base + (x·Aᵀ·Bᵀ) · scaling`. With B = 0 this adds zeros, so the
            // adapted output is the base's bit for bit.
            be.axpy(scaling, &u, y)?;
        }
        Ok(())
    }

    /// The backward of [`Model::block_linear`]: adds `dy·W` (and the adapter's path) into
    /// `dx`; a trained base's weight and bias gradients into `grads` at `w_off`/`b_off`, a
    /// fine-tuning model's adapter gradients into `grads` at the module's place in the block.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn block_linear_backward(
        &self,
        l: usize,
        bw: &[B::Tensor],
        w_off: usize,
        b_off: Option<usize>,
        dx: &mut B::Tensor,
        grads: &mut [B::Tensor],
        dy: &B::Tensor,
        x: &B::Tensor,
    ) -> Result<()> {
        let be = self.backend();
        let i = params::layer_index(&self.cfg, l, w_off);
        match self.quantized_of(i) {
            Some(q) => be.linear_quantized_input_grad(dx, dy, q, self.opts.precision)?,
            None => {
                let (dw, db) = self.param_grads(grads, w_off, b_off);
                be.linear_backward(dx, dw, db, dy, x, at(bw, w_off)?)?;
            }
        }
        let (
            Some(AdapterRef {
                a,
                b,
                scaling,
                slot: k,
            }),
            Some(f),
        ) = (self.adapter_of(i)?, &self.finetune)
        else {
            return Ok(());
        };
        let local = 2 * (k - f.first[l]);
        let (ga, gb) = match grads.get_mut(local..local + 2) {
            Some([ga, gb]) => (ga, gb),
            _ => {
                return Err(TrainError::Input(format!(
                    "block {l} was given {} adapter gradients",
                    grads.len()
                )))
            }
        };
        let (r, inp) = (a.shape().dims()[0], a.shape().dims()[1]);
        let rows = dy.numel() / b.shape().dims()[0].max(1);
        // h is recomputed rather than kept (see the module documentation), then scaled:
        // dB += dyᵀ·(s·h), dh = s·(dy·B), dA += dhᵀ·x', dx += (dh·A) ⊙ mask, where x' is the
        // adapter's input — `dropout(x)` regenerated from the same mask, or x.
        let mask = self.dropout_mask(k);
        let dropped = match &mask {
            Some(m) => {
                let mut xd = self.scratch([rows, inp])?;
                be.dropout(&mut xd, x, m)?;
                Some(xd)
            }
            None => None,
        };
        let xa = dropped.as_ref().unwrap_or(x);
        let mut h = self.scratch([rows, r])?;
        be.linear(&mut h, xa, a, None)?;
        be.scale(&mut h, scaling)?;
        let mut dh = self.scratch([rows, r])?;
        be.linear_backward(&mut dh, Some(gb), None, dy, &h, b)?;
        drop(h);
        be.scale(&mut dh, scaling)?;
        match &mask {
            None => be.linear_backward(dx, Some(ga), None, &dh, xa, a)?,
            Some(m) => {
                let mut part = self.scratch([rows, inp])?;
                be.linear_backward(&mut part, Some(ga), None, &dh, xa, a)?;
                be.dropout_in_place(&mut part, m)?;
                be.axpy(1.0, &part, dx)?;
            }
        }
        Ok(())
    }
}

/// One module's adapter as the ops read it: working A `[r, in]` and B `[out, r]`, the scaling,
/// and the module's position among the adapted ones.
struct AdapterRef<'a, T> {
    a: &'a T,
    b: &'a T,
    scaling: f32,
    slot: usize,
}

/// The stored size of a backend's 4-bit weight.
pub trait QuantizedBytes {
    /// Bytes held (packed codes, scales, second-level scales).
    fn stored_bytes(&self) -> usize;
}

impl QuantizedBytes for QuantizedTensor {
    fn stored_bytes(&self) -> usize {
        QuantizedTensor::stored_bytes(self)
    }
}
