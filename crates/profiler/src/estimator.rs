//! Analytical memory estimate for training a GPT-2-style model: peak bytes per category from the
//! model's shape and the technique settings, without running anything.
//!
//! The activation terms are not fitted constants: they are the byte sizes of the tensors each
//! layer saves for backward, listed by name in [`block_saved_tensors`] and
//! [`outside_saved_tensors`], in the llm.c layout (`train_gpt2.c`'s `ActivationTensors`): a
//! trainer-independent estimate for GPT-2-style models. headroom's own reference trainer saves a
//! slightly different set and predicts it to the byte with `headroom_trainer::estimate` (this
//! crate cannot depend on the trainer). Notation below: `L` layers, `H` heads, `C` width, `V` vocabulary,
//! `b` micro-batch, `T` sequence length, `a` bytes per element of the compute dtype, `P`
//! parameter count.
//!
//! **Parameters** (`P = V·C + T_ctx·C + L·(12C² + 13C) + 2C`: token and position embeddings,
//! per block two layernorms (2C each), QKV (3C² + 3C), attention projection (C² + C), MLP up
//! (4C² + 4C) and down (4C² + C), final layernorm, tied head): the working copy `P·a`, plus fp32
//! master weights `4P` when training in bf16/fp16 with master weights (on the host when the
//! optimizer is offloaded).
//!
//! **Gradients**: `P·4` in fp32 (or with `fp32_grads`), else `P·a`; with offload also a `4P`
//! fp32 gradient copy on the host for the CPU optimizer.
//!
//! **Optimizer state**: AdamW keeps two fp32 moments, `8P`; 8-bit AdamW keeps two u8 moments and
//! one fp32 absmax scale per block of each, `2P + 2·⌈P/block⌉·4`. On the host when offloaded.
//!
//! **Activations** (peak, at the start of backward): per block the saved tensors
//! `ln1, qkv, atty, attproj, residual2, ln2, fch, fch_gelu, fcproj, residual3` =
//! `18·b·T·C` elements at `a` bytes, layernorm means and reciprocal standard deviations
//! `4·b·T` fp32, and the attention's saved state: naive attention keeps the pre-softmax scores
//! and the softmax output (`preatt`, `att`: `2·b·H·T²` at `a` bytes), chunked and flash keep
//! only the row log-sum-exp (`b·H·T` fp32). Outside the blocks: `encoded`, `lnf` (`b·T·C` each
//! at `a`), `lnf` statistics (`2·b·T` fp32), `logits` (`b·T·V` at `a`), `probs` (`b·T·V` fp32),
//! `losses` (`b·T` fp32). With bf16 and naive attention a block is `36·bTC + 4·H·T²·b + 16·bT`
//! bytes; Megatron's `sbh(34 + 5as/h)` counts dropout masks this model does not have and does
//! not count the projection outputs and pre-softmax scores llm.c keeps
//! (32 + 4 = 36, 2·a·s²b + 2·a·s²b = 4).
//!
//! Checkpointing changes what is held:
//! - none: `outside + L·block`;
//! - every k (√n uses `k = ⌈√L⌉`): the layers form `n = ⌈L/k⌉` segments; forward keeps only each
//!   segment's input (`b·T·C` at `a`; segment 0's input is `encoded`), backward recomputes one
//!   segment at a time in full. While segment `s` (counted from 0) is recomputed, the inputs of
//!   segments `1..=s` and the full activations of its layers are live, so the peak is
//!   `outside + max_s(s·bTC·a + len_s·block)`;
//! - selective: every block keeps its matmul outputs, residuals and layernorm statistics and drops
//!   what is cheap to recompute — layernorm outputs (`ln1`, `ln2`), the GELU output and the
//!   attention scores — which come back for one block at a time in backward:
//!   `outside + L·kept + (block − kept)`.
//!
//! **Workspace** (transient gradient buffers in backward, at `a` bytes): the residual-stream
//! gradient and the sub-layer output gradient (`2·bTC`) plus the largest of the MLP's
//! `dfch`/`dfch_gelu` (`8·bTC`), the attention's `dqkv` (`3·bTC`) plus for naive attention `datt`
//! and `dpreatt` (`2·bHT²`) or for chunked attention two fp32 score chunks (`2·bH·chunk·T·4`),
//! and the head's `dlogits` (`bTV`). Forward-pass scratch is smaller and not counted.
//!
//! **Data**: the micro-batch's inputs and targets, `2·b·T` tokens of `token_bytes`.
//!
//! ## Lining a trainer up with the estimate
//! The prediction matches a tracked run when the trainer tags its buffers the way the terms
//! above count them: working and master weights as `Parameters`; parameter gradients (and the
//! host copy an offloaded optimizer reads) as `Gradients`; moments and 8-bit scales as
//! `OptimizerState`; every tensor of [`block_saved_tensors`] / [`outside_saved_tensors`] —
//! including ones recomputed in backward — as `Activations`; gradients of activations and
//! other per-op scratch as `Workspace`; the token batch as `Data`. A trainer that saves a
//! different set (say, no `preatt`) should compare against its own list: the lists are public
//! so the difference is visible by name.

use headroom_tensor::{DType, MemoryCategory};
use serde::Serialize;

use crate::error::ProfilerError;
use crate::per_category::PerCategory;

/// The shape of a GPT-2-style model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GptConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads (must divide `width`).
    pub heads: usize,
    /// Model width (channels).
    pub width: usize,
    /// Maximum sequence length (rows of the position embedding).
    pub context: usize,
    /// Vocabulary size as allocated (llm.c pads GPT-2's 50257 to 50304).
    pub vocab: usize,
}

impl GptConfig {
    /// GPT-2 small (124M) with the unpadded vocabulary.
    pub const GPT2_124M: GptConfig = GptConfig {
        layers: 12,
        heads: 12,
        width: 768,
        context: 1024,
        vocab: 50257,
    };

    fn validate(&self) -> Result<(), ProfilerError> {
        for (field, value) in [
            ("layers", self.layers),
            ("heads", self.heads),
            ("width", self.width),
            ("context", self.context),
            ("vocab", self.vocab),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        if !self.width.is_multiple_of(self.heads) {
            return Err(invalid(
                "heads",
                format!("{} heads do not divide width {}", self.heads, self.width),
            ));
        }
        Ok(())
    }

    /// Number of parameters (weights and biases; the output head is tied to the embedding).
    pub fn parameter_count(&self) -> Result<u64, ProfilerError> {
        self.validate()?;
        let c = u128::from(self.width as u64);
        let l = self.layers as u128;
        // At most 2^64 · 2^64 · 12 per term: u128 overflow is impossible only for the first two
        // terms, so the sum saturates and the conversion reports it.
        let per_block = sum(&[prod(&[12, c, c]), prod(&[13, c])]);
        let p = sum(&[
            prod(&[self.vocab as u128, c]),
            prod(&[self.context as u128, c]),
            prod(&[l, per_block]),
            prod(&[2, c]),
        ]);
        to_u64(p, "parameter count")
    }
}

/// Numeric precision of training.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Precision {
    /// Dtype of the working weights and activations: F32, BF16 or F16.
    pub compute: DType,
    /// Keep fp32 master weights beside low-precision working weights (ignored for F32).
    pub master_weights: bool,
    /// Keep gradients in fp32 even when computing in low precision.
    pub fp32_grads: bool,
}

impl Precision {
    /// Everything in fp32.
    pub const FP32: Precision = Precision {
        compute: DType::F32,
        master_weights: false,
        fp32_grads: true,
    };

    /// Low-precision weights, activations and gradients with fp32 master weights (llm.c's
    /// mixed precision).
    pub const fn mixed(compute: DType) -> Precision {
        Precision {
            compute,
            master_weights: true,
            fp32_grads: false,
        }
    }

    fn is_low(&self) -> bool {
        self.compute != DType::F32
    }
}

/// The optimizer's state format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum OptimizerState {
    /// Two fp32 moments per parameter.
    AdamW,
    /// Two u8 moments per parameter with one fp32 absmax scale per `block_size` values each.
    AdamW8bit {
        /// Values sharing one scale.
        block_size: usize,
    },
}

/// Where the optimizer runs and what form its state takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct OptimizerSetup {
    /// State format.
    pub state: OptimizerState,
    /// Run the optimizer on the host: its state, the fp32 master weights and an fp32 gradient
    /// copy live in host memory.
    pub offload: bool,
}

impl OptimizerSetup {
    /// fp32 AdamW on the training device.
    pub const ADAMW: OptimizerSetup = OptimizerSetup {
        state: OptimizerState::AdamW,
        offload: false,
    };
}

/// Which activations are stored and which are recomputed in backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum CheckpointPolicy {
    /// Store every activation.
    None,
    /// Store the input of every k-th block; recompute segments of k blocks.
    EveryK(usize),
    /// Every k with `k = ⌈√layers⌉`.
    SqrtN,
    /// Keep matmul outputs, residuals and statistics; recompute layernorm outputs, GELU and
    /// attention scores.
    Selective,
}

/// How attention is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum AttentionKind {
    /// Materialise the `b·H·T·T` scores and probabilities and save both.
    Naive,
    /// Process `chunk` query rows at a time; save only the row log-sum-exp.
    Chunked {
        /// Query rows per chunk.
        chunk: usize,
    },
    /// Tiled online softmax; save only the row log-sum-exp.
    Flash,
}

/// Batch shape and technique settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TrainingSetup {
    /// Sequences per optimizer step.
    pub batch: usize,
    /// Sequences per forward/backward (must divide `batch`); activations scale with this.
    pub micro_batch: usize,
    /// Tokens per sequence (at most the context).
    pub seq_len: usize,
    /// Numeric precision.
    pub precision: Precision,
    /// Optimizer and offload.
    pub optimizer: OptimizerSetup,
    /// Checkpoint policy.
    pub checkpoint: CheckpointPolicy,
    /// Attention implementation.
    pub attention: AttentionKind,
    /// Bytes per token id in the data batch (4 for i32/u32).
    pub token_bytes: usize,
}

impl TrainingSetup {
    /// fp32, AdamW, no checkpointing, naive attention, no micro-batching.
    pub fn baseline(batch: usize, seq_len: usize) -> Self {
        TrainingSetup {
            batch,
            micro_batch: batch,
            seq_len,
            precision: Precision::FP32,
            optimizer: OptimizerSetup::ADAMW,
            checkpoint: CheckpointPolicy::None,
            attention: AttentionKind::Naive,
            token_bytes: 4,
        }
    }
}

/// One tensor a layer saves for backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SavedTensor {
    /// llm.c's name for it.
    pub name: &'static str,
    /// Element count.
    pub elements: u64,
    /// Element type.
    pub dtype: DType,
    /// Whether selective checkpointing drops it and recomputes it in backward.
    pub recomputed_by_selective: bool,
}

impl SavedTensor {
    /// Byte size.
    pub fn bytes(&self) -> u64 {
        self.elements
            .saturating_mul(self.dtype.size_in_bytes() as u64)
    }
}

/// Sizes of the activation terms, in bytes, that the estimate combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ActivationTerms {
    /// Everything one block saves.
    pub block: u64,
    /// What one block keeps under selective checkpointing.
    pub block_selective_kept: u64,
    /// Tensors saved outside the blocks (embedding output, final layernorm, head, loss).
    pub outside: u64,
    /// One checkpointed block input (`b·T·C` at the compute dtype).
    pub block_input: u64,
    /// Blocks per segment under every-k / √n checkpointing (`layers` otherwise).
    pub segment_len: usize,
}

/// Predicted peak bytes per category.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryEstimate {
    /// Parameters in the model.
    pub parameter_count: u64,
    /// Peak bytes per category on the training device.
    pub device: PerCategory<u64>,
    /// Bytes per category the offloaded optimizer keeps in host memory.
    pub host: PerCategory<u64>,
    /// The activation terms behind `device[Activations]`.
    pub activations: ActivationTerms,
}

impl MemoryEstimate {
    /// Sum of the device categories' peaks (an upper bound on the device's total peak; in
    /// practice they coincide at the start of backward).
    pub fn device_total(&self) -> u64 {
        self.device.total()
    }

    /// Device and host added up, for runs where the "device" is the host (CPU training).
    pub fn combined(&self) -> PerCategory<u64> {
        let mut sum = self.device;
        for (c, bytes) in self.host.iter() {
            sum[c] = sum[c].saturating_add(bytes);
        }
        sum
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ProfilerError {
    ProfilerError::InvalidConfig {
        field,
        reason: reason.into(),
    }
}

fn to_u64(v: u128, what: &'static str) -> Result<u64, ProfilerError> {
    u64::try_from(v).map_err(|_| ProfilerError::Overflow { what })
}

fn validate(config: &GptConfig, setup: &TrainingSetup) -> Result<(), ProfilerError> {
    config.validate()?;
    if setup.batch == 0 || setup.micro_batch == 0 || setup.seq_len == 0 {
        return Err(invalid(
            "batch",
            "batch, micro-batch and sequence length must be at least 1",
        ));
    }
    if !setup.batch.is_multiple_of(setup.micro_batch) {
        return Err(invalid(
            "micro_batch",
            format!(
                "{} does not divide batch {}",
                setup.micro_batch, setup.batch
            ),
        ));
    }
    if setup.seq_len > config.context {
        return Err(invalid(
            "seq_len",
            format!("{} exceeds the context {}", setup.seq_len, config.context),
        ));
    }
    if !setup.precision.compute.is_float() {
        return Err(invalid(
            "precision",
            "compute dtype must be f32, f16 or bf16",
        ));
    }
    if setup.token_bytes == 0 {
        return Err(invalid("token_bytes", "must be at least 1"));
    }
    if let CheckpointPolicy::EveryK(0) = setup.checkpoint {
        return Err(invalid("checkpoint", "k must be at least 1"));
    }
    if let AttentionKind::Chunked { chunk: 0 } = setup.attention {
        return Err(invalid("attention", "chunk must be at least 1"));
    }
    if let OptimizerState::AdamW8bit { block_size: 0 } = setup.optimizer.state {
        return Err(invalid("optimizer", "8-bit block size must be at least 1"));
    }
    Ok(())
}

fn elems(factors: &[usize]) -> Result<u64, ProfilerError> {
    let mut p: u128 = 1;
    for f in factors {
        p = p.checked_mul(*f as u128).ok_or(ProfilerError::Overflow {
            what: "tensor size",
        })?;
    }
    to_u64(p, "tensor size")
}

/// The tensors one transformer block saves for backward, in the llm.c layout.
pub fn block_saved_tensors(
    config: &GptConfig,
    setup: &TrainingSetup,
) -> Result<Vec<SavedTensor>, ProfilerError> {
    validate(config, setup)?;
    let (b, t, c, h) = (setup.micro_batch, setup.seq_len, config.width, config.heads);
    let a = setup.precision.compute;
    let saved = |name, elements, dtype, recomputed_by_selective| SavedTensor {
        name,
        elements,
        dtype,
        recomputed_by_selective,
    };
    let btc = elems(&[b, t, c])?;
    let bt = elems(&[b, t])?;
    let mut out = vec![
        saved("ln1", btc, a, true),
        saved("ln1_mean", bt, DType::F32, false),
        saved("ln1_rstd", bt, DType::F32, false),
        saved("qkv", elems(&[3, b, t, c])?, a, false),
        saved("atty", btc, a, false),
    ];
    match setup.attention {
        AttentionKind::Naive => {
            let scores = elems(&[b, h, t, t])?;
            out.push(saved("preatt", scores, a, true));
            out.push(saved("att", scores, a, true));
        }
        AttentionKind::Chunked { .. } | AttentionKind::Flash => {
            out.push(saved("att_lse", elems(&[b, h, t])?, DType::F32, false));
        }
    }
    out.extend([
        saved("attproj", btc, a, false),
        saved("residual2", btc, a, false),
        saved("ln2", btc, a, true),
        saved("ln2_mean", bt, DType::F32, false),
        saved("ln2_rstd", bt, DType::F32, false),
        saved("fch", elems(&[4, b, t, c])?, a, false),
        saved("fch_gelu", elems(&[4, b, t, c])?, a, true),
        saved("fcproj", btc, a, false),
        saved("residual3", btc, a, false),
    ]);
    Ok(out)
}

/// The tensors saved outside the blocks: embedding output, final layernorm, head and loss.
pub fn outside_saved_tensors(
    config: &GptConfig,
    setup: &TrainingSetup,
) -> Result<Vec<SavedTensor>, ProfilerError> {
    validate(config, setup)?;
    let (b, t, c, v) = (setup.micro_batch, setup.seq_len, config.width, config.vocab);
    let a = setup.precision.compute;
    let saved = |name, elements, dtype| SavedTensor {
        name,
        elements,
        dtype,
        recomputed_by_selective: false,
    };
    let bt = elems(&[b, t])?;
    Ok(vec![
        saved("encoded", elems(&[b, t, c])?, a),
        saved("lnf", elems(&[b, t, c])?, a),
        saved("lnf_mean", bt, DType::F32),
        saved("lnf_rstd", bt, DType::F32),
        saved("logits", elems(&[b, t, v])?, a),
        saved("probs", elems(&[b, t, v])?, DType::F32),
        saved("losses", bt, DType::F32),
    ])
}

fn sum_bytes<'a>(tensors: impl IntoIterator<Item = &'a SavedTensor>) -> Result<u64, ProfilerError> {
    let total: u128 = tensors.into_iter().map(|t| u128::from(t.bytes())).sum();
    to_u64(total, "activation bytes")
}

/// `⌈√n⌉` for the √n checkpoint schedule, exact for every `usize`.
fn ceil_sqrt(n: usize) -> usize {
    let mut k = (n as f64).sqrt() as usize;
    while k.saturating_mul(k) < n {
        k += 1;
    }
    while k > 1 && (k - 1) * (k - 1) >= n {
        k -= 1;
    }
    k.max(1)
}

/// Saturating product: a saturated result exceeds `u64` and becomes [`ProfilerError::Overflow`]
/// when converted, so absurd inputs are an error rather than a panic or a wrapped number.
fn prod(factors: &[u128]) -> u128 {
    factors.iter().fold(1u128, |acc, f| acc.saturating_mul(*f))
}

/// Saturating sum, see [`prod`].
fn sum(terms: &[u128]) -> u128 {
    terms.iter().fold(0u128, |acc, t| acc.saturating_add(*t))
}

/// Predict peak bytes per category for training `config` with `setup`. See the module
/// documentation for every formula.
pub fn estimate(
    config: &GptConfig,
    setup: &TrainingSetup,
) -> Result<MemoryEstimate, ProfilerError> {
    validate(config, setup)?;
    let p = u128::from(config.parameter_count()?);
    let a = setup.precision.compute.size_in_bytes() as u128;
    let low = setup.precision.is_low();
    let offload = setup.optimizer.offload;
    let mut device = PerCategory::<u128>::default();
    let mut host = PerCategory::<u128>::default();

    // Parameters: working copy, plus fp32 masters beside low-precision weights.
    device[MemoryCategory::Parameters] = prod(&[p, a]);
    if low && setup.precision.master_weights {
        let target = if offload { &mut host } else { &mut device };
        target[MemoryCategory::Parameters] =
            sum(&[target[MemoryCategory::Parameters], prod(&[p, 4])]);
    }

    // Gradients.
    let grad_bytes = if !low || setup.precision.fp32_grads {
        4
    } else {
        a
    };
    device[MemoryCategory::Gradients] = prod(&[p, grad_bytes]);
    if offload {
        host[MemoryCategory::Gradients] = prod(&[p, 4]);
    }

    // Optimizer state.
    let state = match setup.optimizer.state {
        OptimizerState::AdamW => prod(&[8, p]),
        OptimizerState::AdamW8bit { block_size } => {
            sum(&[prod(&[2, p]), prod(&[2, p.div_ceil(block_size as u128), 4])])
        }
    };
    let target = if offload { &mut host } else { &mut device };
    target[MemoryCategory::OptimizerState] = state;

    // Activations.
    let block_tensors = block_saved_tensors(config, setup)?;
    let block = u128::from(sum_bytes(&block_tensors)?);
    let kept = u128::from(sum_bytes(
        block_tensors.iter().filter(|t| !t.recomputed_by_selective),
    )?);
    let outside = u128::from(sum_bytes(&outside_saved_tensors(config, setup)?)?);
    let (b, t, c, h, v) = (
        setup.micro_batch as u128,
        setup.seq_len as u128,
        config.width as u128,
        config.heads as u128,
        config.vocab as u128,
    );
    let block_input = prod(&[b, t, c, a]);
    let layers = config.layers;
    let segmented = |k: usize| -> u128 {
        let k = k.min(layers);
        let segments = layers.div_ceil(k);
        (0..segments)
            .map(|s| {
                let len = if s + 1 == segments { layers - s * k } else { k };
                sum(&[prod(&[s as u128, block_input]), prod(&[len as u128, block])])
            })
            .max()
            .unwrap_or(0)
    };
    let (blocks_peak, segment_len) = match setup.checkpoint {
        CheckpointPolicy::None => (prod(&[layers as u128, block]), layers),
        CheckpointPolicy::EveryK(k) => (segmented(k), k.min(layers)),
        CheckpointPolicy::SqrtN => {
            let k = ceil_sqrt(layers);
            (segmented(k), k.min(layers))
        }
        CheckpointPolicy::Selective => (
            sum(&[prod(&[layers as u128, kept]), block.saturating_sub(kept)]),
            layers,
        ),
    };
    device[MemoryCategory::Activations] = sum(&[outside, blocks_peak]);

    // Workspace: backward's transient gradients.
    let attention_scores = match setup.attention {
        AttentionKind::Naive => prod(&[2, b, h, t, t, a]),
        AttentionKind::Chunked { chunk } => {
            prod(&[2, b, h, chunk.min(setup.seq_len) as u128, t, 4])
        }
        AttentionKind::Flash => 0,
    };
    let attention_bwd = sum(&[prod(&[3, b, t, c, a]), attention_scores]);
    let mlp_bwd = prod(&[8, b, t, c, a]);
    let head_bwd = prod(&[b, t, v, a]);
    device[MemoryCategory::Workspace] = sum(&[
        prod(&[2, b, t, c, a]),
        attention_bwd.max(mlp_bwd).max(head_bwd),
    ]);

    // Data: inputs and targets of one micro-batch.
    device[MemoryCategory::Data] = prod(&[2, b, t, setup.token_bytes as u128]);

    let convert = |values: PerCategory<u128>| -> Result<PerCategory<u64>, ProfilerError> {
        let mut out = PerCategory::<u64>::default();
        for (slot, v) in out.0.iter_mut().zip(values.0) {
            *slot = to_u64(v, "category bytes")?;
        }
        Ok(out)
    };
    Ok(MemoryEstimate {
        parameter_count: to_u64(p, "parameter count")?,
        device: convert(device)?,
        host: convert(host)?,
        activations: ActivationTerms {
            block: to_u64(block, "block activations")?,
            block_selective_kept: to_u64(kept, "block activations")?,
            outside: to_u64(outside, "activations")?,
            block_input: to_u64(block_input, "block input")?,
            segment_len,
        },
    })
}

#[cfg(test)]
mod tests {
    //! Expected values are worked out by hand in the comments, not with the code under test.
    use super::*;

    /// L=2, H=2, C=4, context 3, V=5; one sequence of 3 tokens.
    /// P = V·C 20 + T·C 12 + 2·(12·16 + 13·4 = 244) + 2·4 = 528.
    const TINY: GptConfig = GptConfig {
        layers: 2,
        heads: 2,
        width: 4,
        context: 3,
        vocab: 5,
    };

    fn tiny_setup() -> TrainingSetup {
        TrainingSetup::baseline(1, 3)
    }

    fn cat(e: &MemoryEstimate, c: MemoryCategory) -> u64 {
        e.device[c]
    }

    #[test]
    fn parameter_counts() {
        assert_eq!(TINY.parameter_count().unwrap(), 528);
        // GPT-2 small: the published 124,439,808 (unpadded vocabulary, tied head).
        assert_eq!(GptConfig::GPT2_124M.parameter_count().unwrap(), 124_439_808);
    }

    #[test]
    fn tiny_fp32_naive_no_checkpoint() {
        let e = estimate(&TINY, &tiny_setup()).unwrap();
        assert_eq!(e.parameter_count, 528);
        assert_eq!(cat(&e, MemoryCategory::Parameters), 528 * 4);
        assert_eq!(cat(&e, MemoryCategory::Gradients), 528 * 4);
        assert_eq!(cat(&e, MemoryCategory::OptimizerState), 528 * 8);
        // Block: 18·BTC = 216 elements, 4 stats·BT = 12, preatt+att 2·B·H·T·T = 36;
        // 264 elements · 4 B = 1056. Outside: encoded 12 + lnf 12 + lnf stats 6 + logits 15 +
        // probs 15 + losses 3 = 63 elements = 252 B. Total 252 + 2·1056 = 2364.
        assert_eq!(e.activations.block, 1056);
        assert_eq!(e.activations.outside, 252);
        assert_eq!(cat(&e, MemoryCategory::Activations), 2364);
        // Workspace: 2·BTC·4 = 96 + max(MLP 8·12·4 = 384, attention 3·12·4 + 2·18·4 = 288,
        // head 15·4 = 60) = 480.
        assert_eq!(cat(&e, MemoryCategory::Workspace), 480);
        // Data: inputs and targets, 2·3 tokens · 4 B.
        assert_eq!(cat(&e, MemoryCategory::Data), 24);
        assert_eq!(cat(&e, MemoryCategory::Other), 0);
        assert_eq!(e.host.total(), 0);
        assert_eq!(e.device_total(), 2112 + 2112 + 4224 + 2364 + 480 + 24);
    }

    #[test]
    fn tiny_bf16_flash_8bit() {
        let setup = TrainingSetup {
            precision: Precision::mixed(DType::BF16),
            attention: AttentionKind::Flash,
            optimizer: OptimizerSetup {
                state: OptimizerState::AdamW8bit { block_size: 256 },
                offload: false,
            },
            ..tiny_setup()
        };
        let e = estimate(&TINY, &setup).unwrap();
        // bf16 working copy 528·2 + fp32 master 528·4.
        assert_eq!(cat(&e, MemoryCategory::Parameters), 1056 + 2112);
        assert_eq!(cat(&e, MemoryCategory::Gradients), 1056);
        // u8 moments 2·528 + two scale arrays of ⌈528/256⌉ = 3 fp32 each.
        assert_eq!(cat(&e, MemoryCategory::OptimizerState), 1056 + 24);
        // Block: 216·2 + stats 12·4 + lse B·H·T = 6 fp32 · 4 = 432 + 48 + 24 = 504.
        // Outside: encoded 24 + lnf 24 + stats 24 + logits 30 + probs (fp32) 60 + losses 12 = 174.
        assert_eq!(e.activations.block, 504);
        assert_eq!(e.activations.outside, 174);
        assert_eq!(cat(&e, MemoryCategory::Activations), 174 + 2 * 504);
        // Workspace: 2·12·2 = 48 + max(MLP 8·12·2 = 192, attention 3·12·2 = 72, head 30) = 240.
        assert_eq!(cat(&e, MemoryCategory::Workspace), 240);
    }

    #[test]
    fn checkpoint_policies_on_five_layers() {
        let five = GptConfig { layers: 5, ..TINY };
        let with = |checkpoint| {
            let setup = TrainingSetup {
                checkpoint,
                ..tiny_setup()
            };
            estimate(&five, &setup).unwrap().device[MemoryCategory::Activations]
        };
        // Block 1056 B, block input BTC·4 = 48 B, outside 252 B.
        assert_eq!(with(CheckpointPolicy::None), 252 + 5 * 1056);
        // k=2: segments of 2, 2, 1 blocks. Backward of segment 2: 2 inputs + 1 block = 1152;
        // of segment 1: 1 input + 2 blocks = 2160; of segment 0: 2 blocks = 2112.
        assert_eq!(with(CheckpointPolicy::EveryK(2)), 252 + 2160);
        // √5 → k=3: segments 3, 2. Segment 1: 48 + 2·1056 = 2160; segment 0: 3·1056 = 3168.
        assert_eq!(with(CheckpointPolicy::SqrtN), 252 + 3168);
        // k ≥ L is one segment: the same as no checkpointing.
        assert_eq!(
            with(CheckpointPolicy::EveryK(5)),
            with(CheckpointPolicy::None)
        );
        assert_eq!(
            with(CheckpointPolicy::EveryK(99)),
            with(CheckpointPolicy::None)
        );
        // k=1: segment s holds s inputs + 1 block; s=4 → 4·48 + 1056 = 1248.
        assert_eq!(with(CheckpointPolicy::EveryK(1)), 252 + 1248);
    }

    #[test]
    fn selective_drops_layernorm_gelu_and_scores() {
        let setup = TrainingSetup {
            checkpoint: CheckpointPolicy::Selective,
            ..tiny_setup()
        };
        let e = estimate(&TINY, &setup).unwrap();
        // Dropped per block: ln1 12 + ln2 12 + fch_gelu 48 + preatt 18 + att 18 = 108 elements
        // = 432 B; kept 1056 − 432 = 624. Peak: 252 + 2·624 + 432 = 1932.
        assert_eq!(e.activations.block_selective_kept, 624);
        assert_eq!(e.device[MemoryCategory::Activations], 1932);
    }

    #[test]
    fn offload_moves_state_masters_and_a_gradient_copy_to_the_host() {
        let setup = TrainingSetup {
            precision: Precision::mixed(DType::BF16),
            optimizer: OptimizerSetup {
                state: OptimizerState::AdamW,
                offload: true,
            },
            ..tiny_setup()
        };
        let e = estimate(&TINY, &setup).unwrap();
        assert_eq!(e.device[MemoryCategory::Parameters], 1056);
        assert_eq!(e.device[MemoryCategory::Gradients], 1056);
        assert_eq!(e.device[MemoryCategory::OptimizerState], 0);
        assert_eq!(e.host[MemoryCategory::Parameters], 2112);
        assert_eq!(e.host[MemoryCategory::Gradients], 2112);
        assert_eq!(e.host[MemoryCategory::OptimizerState], 4224);
        assert_eq!(e.combined()[MemoryCategory::Parameters], 3168);
    }

    #[test]
    fn chunked_attention_scores_workspace() {
        // H=4 so the score chunks dominate the workspace.
        let config = GptConfig { heads: 4, ..TINY };
        let setup = TrainingSetup {
            attention: AttentionKind::Chunked { chunk: 8 },
            ..tiny_setup()
        };
        let e = estimate(&config, &setup).unwrap();
        // Chunk clamps to T=3. Attention: 3·BTC·4 = 144 + 2·B·H·3·T·4 = 2·4·9·4 = 288 → 432.
        // MLP 384, head 60. Workspace 96 + 432 = 528.
        assert_eq!(e.device[MemoryCategory::Workspace], 528);
        // Saved: lse B·H·T = 12 fp32 = 48 B instead of 2·B·H·T·T.
        assert_eq!(e.activations.block, 216 * 4 + 12 * 4 + 48);
    }

    #[test]
    fn activations_follow_the_micro_batch() {
        let full = estimate(&TINY, &TrainingSetup::baseline(4, 3)).unwrap();
        let micro = estimate(
            &TINY,
            &TrainingSetup {
                micro_batch: 1,
                ..TrainingSetup::baseline(4, 3)
            },
        )
        .unwrap();
        assert_eq!(micro.device[MemoryCategory::Activations], 2364);
        assert_eq!(full.device[MemoryCategory::Activations], 4 * 2364);
        assert_eq!(
            micro.device[MemoryCategory::Parameters],
            full.device[MemoryCategory::Parameters]
        );
    }

    #[test]
    fn bf16_naive_block_matches_the_closed_form() {
        // 36·bTC + 4·H·T²·b + 16·bT bytes (see the module docs), b=2, T=64, C=96, H=4:
        // 442368 + 131072 + 2048 = 575488.
        let config = GptConfig {
            layers: 1,
            heads: 4,
            width: 96,
            context: 64,
            vocab: 10,
        };
        let setup = TrainingSetup {
            precision: Precision::mixed(DType::BF16),
            ..TrainingSetup::baseline(2, 64)
        };
        assert_eq!(
            estimate(&config, &setup).unwrap().activations.block,
            575_488
        );
        let names: Vec<_> = block_saved_tensors(&config, &setup)
            .unwrap()
            .iter()
            .map(|t| t.name)
            .collect();
        assert_eq!(names.len(), 16);
        assert!(names.contains(&"preatt") && names.contains(&"fch_gelu"));
    }

    #[test]
    fn bad_configs_are_typed_errors() {
        let bad_configs = [
            GptConfig { layers: 0, ..TINY },
            GptConfig { heads: 3, ..TINY },
            GptConfig { vocab: 0, ..TINY },
        ];
        for config in bad_configs {
            assert!(matches!(
                estimate(&config, &tiny_setup()),
                Err(ProfilerError::InvalidConfig { .. })
            ));
        }
        let bad_setups = [
            TrainingSetup {
                micro_batch: 3,
                ..TrainingSetup::baseline(4, 3)
            },
            TrainingSetup::baseline(0, 3),
            TrainingSetup::baseline(1, 4),
            TrainingSetup {
                checkpoint: CheckpointPolicy::EveryK(0),
                ..tiny_setup()
            },
            TrainingSetup {
                attention: AttentionKind::Chunked { chunk: 0 },
                ..tiny_setup()
            },
            TrainingSetup {
                token_bytes: 0,
                ..tiny_setup()
            },
            TrainingSetup {
                precision: Precision {
                    compute: DType::U16,
                    ..Precision::FP32
                },
                ..tiny_setup()
            },
            TrainingSetup {
                optimizer: OptimizerSetup {
                    state: OptimizerState::AdamW8bit { block_size: 0 },
                    offload: false,
                },
                ..tiny_setup()
            },
        ];
        for setup in bad_setups {
            assert!(
                matches!(
                    estimate(&TINY, &setup),
                    Err(ProfilerError::InvalidConfig { .. })
                ),
                "{setup:?}"
            );
        }
    }

    #[test]
    fn absurd_sizes_overflow_instead_of_panicking() {
        let huge = GptConfig {
            layers: usize::MAX,
            heads: 1,
            width: usize::MAX,
            context: usize::MAX,
            vocab: usize::MAX,
        };
        assert!(matches!(
            huge.parameter_count(),
            Err(ProfilerError::Overflow { .. })
        ));
        let wide = GptConfig {
            layers: 1,
            heads: 1,
            width: 1 << 20,
            context: 1 << 40,
            vocab: 1 << 20,
        };
        let setup = TrainingSetup::baseline(1 << 20, 1 << 40);
        assert!(matches!(
            estimate(&wide, &setup),
            Err(ProfilerError::Overflow { .. })
        ));
    }

    #[test]
    fn ceil_sqrt_is_exact() {
        for (n, k) in [
            (1, 1),
            (2, 2),
            (4, 2),
            (5, 3),
            (9, 3),
            (10, 4),
            (12, 4),
            (48, 7),
            (49, 7),
        ] {
            assert_eq!(ceil_sqrt(n), k, "{n}");
        }
        assert_eq!(ceil_sqrt(0), 1);
        let big = ceil_sqrt(usize::MAX);
        assert!((big as u128) * (big as u128) >= usize::MAX as u128);
    }
}
