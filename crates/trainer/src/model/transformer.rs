//! The model of both families, written once over the backend's [`ModelOps`]: embedding,
//! blocks as a [`headroom_ckpt::Chain`] under a [`headroom_ckpt::Schedule`], final norm, head
//! and loss — forward and backward op by op, as llm.c does. Every activation a block keeps for
//! its backward is a named field of [`Gpt2Saved`] or [`LlamaSaved`] with its shape beside it;
//! which blocks keep theirs, drop them or recompute them is the schedule's choice.
//!
//! Memory categories: kept activations are allocated under [`MemoryCategory::Activations`],
//! everything transient (activation gradients, f32 views of low-precision tensors, scratch)
//! under [`MemoryCategory::Workspace`], so the tracker's numbers are the model's.
//!
//! Notation: B batch, T sequence, C channels, NH heads, KV key/value heads, hs the head width
//! (C/NH unless a Llama sets its own), F the MLP width, V vocab.

use headroom_amp::{AutocastPreset, MasterWeights, MasterWeightsConfig};
use headroom_attn::{AttentionConfig, DocumentMask};
use headroom_ckpt::{Chain, Schedule, ScheduleStats};
use headroom_profiler::label_absolute;
use headroom_tensor::{Cpu, CpuTensor, DType, MemoryCategory, Shape, Tensor};

pub use crate::model::gpt2_block::Gpt2Saved;
pub use crate::model::llama_block::{KeptNorm, LlamaSaved};
use crate::model::ops::{HeadLossGrads, ModelOps};
use crate::model::params::{self, WPE, WTE};
use crate::model::{Family, ModelConfig, Precision};
use crate::{Result, TrainError};

/// How the model computes, independent of its shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelOptions {
    /// Attention algorithm (causal is forced on).
    pub attention: AttentionConfig,
    /// Format of working weights and kept activations.
    pub precision: Precision,
    /// Selective recomputation: blocks drop their layer-norm and GELU outputs after forward
    /// and recompute them in backward (cheap elementwise work, 6·B·T·C values per block).
    pub selective: bool,
    /// Fused head: compute logits, loss and their gradient this many token rows at a time, so
    /// the `[B, T, V]` logits never exist whole. `None` materialises them (llm.c's way).
    pub loss_chunk: Option<usize>,
    /// Gradient offload: the caller's gradient buffers live off the device, so each block's
    /// (and the head's, and the embedding's) gradients are computed into device buffers of
    /// that part alone and added into the caller's as soon as its backward finishes — the
    /// device never holds more than one part's gradients (ZeRO-Offload's order).
    pub offload_grads: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            attention: AttentionConfig::flash(),
            precision: Precision::Fp32,
            selective: false,
            loss_chunk: None,
            offload_grads: false,
        }
    }
}

/// What one block keeps for its backward, by family.
pub enum BlockSaved<T = CpuTensor> {
    /// A GPT-2 block's.
    Gpt2(Gpt2Saved<T>),
    /// A Llama block's.
    Llama(LlamaSaved<T>),
}

impl<T: Tensor> headroom_ckpt::SavedState for BlockSaved<T> {
    fn size_in_bytes(&self) -> usize {
        match self {
            BlockSaved::Gpt2(s) => s.size_in_bytes(),
            BlockSaved::Llama(s) => s.size_in_bytes(),
        }
    }
}

/// The statistics a norm keeps for its backward: layer norm's mean and reciprocal standard
/// deviation, RMSNorm's reciprocal root mean square; `[B, T]` f32.
pub struct NormStats<T = CpuTensor> {
    /// Layer norm's row means (`None` for RMSNorm).
    pub mean: Option<T>,
    /// Reciprocal standard deviation (layer norm) or root mean square (RMSNorm).
    pub rstd: T,
}

impl<T: Tensor> NormStats<T> {
    /// Bytes held.
    pub fn size_in_bytes(&self) -> usize {
        self.mean.as_ref().map_or(0, |m| m.size_in_bytes()) + self.rstd.size_in_bytes()
    }
}

/// A block forward's result: its output and, when it was asked to save, what its backward
/// needs.
pub type BlockOutput<T, S> = (T, Option<S>);

/// The batch geometry of one forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry<'d> {
    /// Sequences.
    pub b: usize,
    /// Tokens per sequence.
    pub t: usize,
    /// Packed documents: each row's tokens attend only within their document, and positions
    /// restart at each document. `None`: every row is one sequence from position 0.
    pub documents: Option<&'d Documents>,
}

impl Geometry<'static> {
    /// `b` sequences of `t` tokens, each one sequence from position 0.
    pub const fn new(b: usize, t: usize) -> Self {
        Geometry {
            b,
            t,
            documents: None,
        }
    }
}

impl<'d> Geometry<'d> {
    /// Token rows, `B·T`.
    pub fn rows(&self) -> usize {
        self.b * self.t
    }

    /// This geometry over packed `documents` (their shape must be `b × t`).
    pub fn with_documents(self, documents: &'d Documents) -> Result<Geometry<'d>> {
        if (documents.mask.batch(), documents.mask.seq()) != (self.b, self.t) {
            return Err(TrainError::Input(format!(
                "documents of {} × {} positions for a batch of {} × {}",
                documents.mask.batch(),
                documents.mask.seq(),
                self.b,
                self.t
            )));
        }
        Ok(Geometry {
            documents: Some(documents),
            ..self
        })
    }

    /// [`Geometry::with_documents`] when there are documents, else this geometry.
    pub fn packed(self, documents: Option<&'d Documents>) -> Result<Geometry<'d>> {
        match documents {
            Some(d) => self.with_documents(d),
            None => Ok(self),
        }
    }

    /// Each row's position ids `[B·T]` when the rows are packed documents.
    pub(crate) fn positions(&self) -> Option<&'d [u32]> {
        self.documents.map(|d| &d.positions[..])
    }
}

/// Several documents packed in each row of a batch, as transformers reads them from
/// `position_ids` (TRL's padding-free batches; Megatron's `--reset-position-ids` and
/// `--reset-attention-mask`): a document starts where the position is 0, attention stays inside
/// each document, and rotary or learned positions restart with it. A batch of padded examples
/// computes the same losses, without the padding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Documents {
    positions: Vec<u32>,
    mask: DocumentMask,
}

impl Documents {
    /// From position ids `[b·t]`: each row starts at 0, and every position is 0 (a new
    /// document) or its predecessor's + 1.
    pub fn from_positions(b: usize, t: usize, positions: &[u32]) -> Result<Self> {
        let mask = DocumentMask::from_positions(b, t, positions)
            .map_err(|e| TrainError::Input(format!("packed documents: {e}")))?;
        Ok(Documents {
            positions: positions.to_vec(),
            mask,
        })
    }

    /// Each row's own `positions` `[B·T]` with a mask the model built for them: a padded
    /// batch's cached decode step (the padding mask hiding each row's padding keys), or a
    /// block's sliding window narrowing what its queries see.
    pub(crate) fn padded(positions: Vec<u32>, mask: DocumentMask) -> Self {
        Documents { positions, mask }
    }

    /// Position ids `[B·T]`.
    pub fn positions(&self) -> &[u32] {
        &self.positions
    }

    /// The attention mask the positions give.
    pub fn mask(&self) -> &DocumentMask {
        &self.mask
    }

    /// Batch rows `rows` alone (a micro-batch of them).
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Result<Self> {
        let t = self.mask.seq();
        let positions = rows
            .start
            .checked_mul(t)
            .zip(rows.end.checked_mul(t))
            .and_then(|(a, b)| self.positions.get(a..b))
            .ok_or_else(|| {
                TrainError::Input(format!(
                    "rows {rows:?} of a batch of {} rows",
                    self.mask.batch()
                ))
            })?;
        Self::from_positions(rows.len(), t, positions)
    }
}

/// A model of either family on a backend: fp32 master weights with working copies in the
/// chosen precision, and how it computes.
pub struct Model<B: ModelOps = Cpu> {
    /// Shape.
    pub cfg: ModelConfig,
    /// fp32 masters (what the optimizer updates and checkpoints hold) and the working copies
    /// forward and backward read (the masters themselves under fp32).
    pub weights: MasterWeights<B>,
    /// How it computes.
    pub opts: ModelOptions,
    pub(crate) backend: B,
    /// The frozen base's storage and the adapters, when fine-tuning (LoRA, QLoRA).
    pub(crate) finetune: Option<crate::model::finetune::Finetune<B>>,
}

/// An f32 view of a tensor: the tensor itself when it is f32, else an upcast copy in
/// workspace memory that lives as long as the view.
pub(crate) enum View<'a, T = CpuTensor> {
    Borrowed(&'a T),
    Owned(T),
}

impl<T> View<'_, T> {
    pub(crate) fn tensor(&self) -> &T {
        match self {
            View::Borrowed(t) => t,
            View::Owned(t) => t,
        }
    }
}

impl View<'_> {
    pub(crate) fn s(&self) -> Result<&[f32]> {
        Ok(self.tensor().as_slice::<f32>()?)
    }
}

impl Model<Cpu> {
    /// A freshly initialised model whose masters live on `cpu`.
    pub fn new(cpu: &Cpu, cfg: ModelConfig, opts: ModelOptions, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let masters = params::init_params(cpu, &cfg, seed)?;
        Self::from_masters(cpu, cfg, opts, masters)
    }
}

impl<B: ModelOps + Clone> Model<B> {
    /// A model over existing fp32 masters, which may live on another backend than `backend`
    /// (the host, when the optimizer is offloaded): working copies are allocated on `backend`.
    pub fn from_masters(
        backend: &B,
        cfg: ModelConfig,
        opts: ModelOptions,
        masters: Vec<B::Tensor>,
    ) -> Result<Self> {
        check_shape_and_options(&cfg, &opts)?;
        let infos = params::param_infos(&cfg);
        if masters.len() != infos.len()
            || masters
                .iter()
                .zip(&infos)
                .any(|(m, i)| m.shape().dims() != i.shape.as_slice() || m.dtype() != DType::F32)
        {
            return Err(TrainError::Config(
                "master weights do not match the model's parameter shapes".into(),
            ));
        }
        let weights = {
            let _l = label_absolute("params (working copies)");
            MasterWeights::new(backend, masters, weights_config(opts.precision))?
        };
        Self::from_weights(backend, cfg, opts, weights)
    }

    /// A model over weights already built (no shape check: a fine-tuning model's 4-bit
    /// weights have placeholders there).
    pub(crate) fn from_weights(
        backend: &B,
        cfg: ModelConfig,
        opts: ModelOptions,
        weights: MasterWeights<B>,
    ) -> Result<Self> {
        check_shape_and_options(&cfg, &opts)?;
        Ok(Model {
            cfg,
            weights,
            opts: causal(&cfg, opts),
            backend: backend.clone(),
            finetune: None,
        })
    }

    /// A model that holds no weights: every forward and backward takes them from a
    /// [`PartStore`] ([`Model::forward_backward_parts`], [`Model::loss_parts`]); the methods
    /// that read the model's own weights fail with an error.
    pub fn parts_only(backend: &B, cfg: ModelConfig, opts: ModelOptions) -> Result<Self> {
        let weights = MasterWeights::working_only(Vec::new(), weights_config(opts.precision))?;
        Self::from_weights(backend, cfg, opts, weights)
    }

    /// A model over working copies alone, whose fp32 masters live elsewhere (the host, beside
    /// an offloaded optimizer): `working` holds one tensor per parameter in the storage dtype
    /// of `opts.precision`. [`Model::masters`] is empty and [`Model::refresh_working`] does
    /// nothing; their owner rewrites them through `weights.working_mut`.
    pub fn from_working(
        backend: &B,
        cfg: ModelConfig,
        opts: ModelOptions,
        working: Vec<B::Tensor>,
    ) -> Result<Self> {
        check_shape_and_options(&cfg, &opts)?;
        let infos = params::param_infos(&cfg);
        let dtype = opts.precision.storage();
        if working.len() != infos.len()
            || working
                .iter()
                .zip(&infos)
                .any(|(w, i)| w.shape().dims() != i.shape.as_slice() || w.dtype() != dtype)
        {
            return Err(TrainError::Config(
                "working weights do not match the model's parameter shapes and precision".into(),
            ));
        }
        let weights = MasterWeights::working_only(working, weights_config(opts.precision))?;
        Self::from_weights(backend, cfg, opts, weights)
    }
}

impl<B: ModelOps> Model<B> {
    /// The backend activations and working weights live on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The fp32 masters, in [`params::param_infos`] order.
    pub fn masters(&self) -> &[B::Tensor] {
        self.weights.masters()
    }

    /// The fp32 masters, mutably: call [`Model::refresh_working`] after changing them.
    pub fn masters_mut(&mut self) -> &mut [B::Tensor] {
        self.weights.masters_mut()
    }

    /// Re-derive the working copies from the masters (round to nearest even); nothing to do
    /// under fp32, where forward reads the masters.
    pub fn refresh_working(&mut self) -> Result<()> {
        Ok(self.weights.refresh(&self.backend, 0)?)
    }

    /// Working weight `i` as stored (the ops read it in whatever way the backend reads
    /// low-precision tensors).
    pub(crate) fn w(&self, i: usize) -> Result<&B::Tensor> {
        Ok(self.weights.working(i)?)
    }

    /// An f32 buffer for an op's output that will be kept: it *is* the kept tensor under
    /// fp32 (so `Activations`), and a transient before [`Model::keep`] rounds it otherwise.
    pub(crate) fn fresh(&self, shape: impl Into<Shape>) -> Result<B::Tensor> {
        let _g = self.fresh_category().enter();
        Ok(self.backend.zeros(shape, DType::F32)?)
    }

    /// [`Model::fresh`] for a tensor whose every element the next op writes (a norm's, a
    /// GELU's or a linear's output, heads split from a wider tensor): not cleared first.
    /// Clearing reused buffers that were then overwritten was about 1% of an fp32 `small` step
    /// and 2% of a bf16 one, in `memset`.
    pub(crate) fn fresh_overwritten(&self, shape: impl Into<Shape>) -> Result<B::Tensor> {
        let _g = self.fresh_category().enter();
        Ok(self.backend.uninit(shape, DType::F32)?)
    }

    fn fresh_category(&self) -> MemoryCategory {
        if self.opts.precision.is_low() {
            MemoryCategory::Workspace
        } else {
            MemoryCategory::Activations
        }
    }

    /// An f32 activation that is always kept in f32 (statistics).
    pub(crate) fn stat(&self, shape: impl Into<Shape>) -> Result<B::Tensor> {
        let _g = MemoryCategory::Activations.enter();
        Ok(self.backend.zeros(shape, DType::F32)?)
    }

    /// Transient f32 scratch.
    pub(crate) fn scratch(&self, shape: impl Into<Shape>) -> Result<B::Tensor> {
        let _g = MemoryCategory::Workspace.enter();
        Ok(self.backend.zeros(shape, DType::F32)?)
    }

    /// [`Model::scratch`] whose every element the next ops write before anything reads it
    /// (see [`Model::fresh_overwritten`]); a product's gradient, which accumulates, still
    /// takes [`Model::scratch`].
    pub(crate) fn scratch_overwritten(&self, shape: impl Into<Shape>) -> Result<B::Tensor> {
        let _g = MemoryCategory::Workspace.enter();
        Ok(self.backend.uninit(shape, DType::F32)?)
    }

    /// Keep an f32 result in the storage precision (rounding it, round to nearest even).
    pub(crate) fn keep(&self, t: B::Tensor) -> Result<B::Tensor> {
        let dt = self.opts.precision.storage();
        if dt == DType::F32 || t.dtype() == dt {
            return Ok(t);
        }
        let _g = MemoryCategory::Activations.enter();
        let mut out = self.backend.uninit(t.shape().clone(), dt)?;
        self.backend.cast(&t, &mut out)?;
        Ok(out)
    }

    /// Label the allocations of block `l` with `block.{l}.{what}` until the guard drops
    /// (the profiler's summary table, trace and snapshot name tensors by it).
    pub(crate) fn tag(&self, l: usize, what: &str) -> headroom_profiler::LabelGuard {
        headroom_profiler::label_absolute(&format!("block.{l}.{what}"))
    }

    /// Run `f` on gradient buffers for `dst`: `dst` itself, or — under
    /// [`ModelOptions::offload_grads`] — zeroed device buffers of the same shapes (category
    /// `Gradients`) whose contents are added into `dst` once `f` returns, then freed.
    pub(crate) fn with_staged_grads<R>(
        &self,
        dst: &mut [B::Tensor],
        f: impl FnOnce(&mut [B::Tensor]) -> Result<R>,
    ) -> Result<R> {
        if !self.opts.offload_grads {
            return f(dst);
        }
        let mut staged = {
            let _g = MemoryCategory::Gradients.enter();
            let _l = label_absolute(&format!(
                "{}.grad",
                headroom_profiler::LabelId::current()
                    .name()
                    .as_deref()
                    .unwrap_or("params")
            ));
            dst.iter()
                .map(|t| Ok(self.backend.zeros(t.shape().clone(), DType::F32)?))
                .collect::<Result<Vec<B::Tensor>>>()?
        };
        let out = f(&mut staged)?;
        for (d, s) in dst.iter_mut().zip(&staged) {
            self.backend.axpy(1.0, s, d)?;
        }
        Ok(out)
    }

    /// The norm of `x` `[B, T, C]` with gain `w` (and GPT-2's bias `b`): layer norm for GPT-2,
    /// RMSNorm for Llama. The output is a fresh f32 buffer (see [`Model::fresh`]).
    pub(crate) fn norm(
        &self,
        out: &mut B::Tensor,
        x: &B::Tensor,
        w: &B::Tensor,
        b: Option<&B::Tensor>,
        g: Geometry<'_>,
    ) -> Result<NormStats<B::Tensor>> {
        match (self.cfg.family, b) {
            (Family::Gpt2, Some(b)) => {
                let mut mean = self.stat([g.b, g.t])?;
                let mut rstd = self.stat([g.b, g.t])?;
                self.backend.layernorm(out, &mut mean, &mut rstd, x, w, b)?;
                Ok(NormStats {
                    mean: Some(mean),
                    rstd,
                })
            }
            (Family::Llama(s), None) => {
                let mut rstd = self.stat([g.b, g.t])?;
                self.backend.rmsnorm(out, &mut rstd, x, w, s.rms_norm())?;
                Ok(NormStats { mean: None, rstd })
            }
            _ => Err(TrainError::Config(
                "a norm's bias does not match the model family".into(),
            )),
        }
    }

    /// The backward of [`Model::norm`] with gain `w`, accumulating into `dx`, `dw` (and layer
    /// norm's `db`). A frozen norm passes `None`: its gain (and bias) gradient lands in a `[C]`
    /// scratch that is dropped at once.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_backward(
        &self,
        dx: &mut B::Tensor,
        dw: Option<&mut B::Tensor>,
        db: Option<&mut B::Tensor>,
        dy: &B::Tensor,
        x: &B::Tensor,
        w: &B::Tensor,
        stats: &NormStats<B::Tensor>,
    ) -> Result<()> {
        // A gain is `[C]`, or `[hs]` for query and key norms.
        let mut spare_w = None;
        let dw = match dw {
            Some(t) => t,
            None => spare_w.insert(self.scratch(w.shape().clone())?),
        };
        match &stats.mean {
            Some(mean) => {
                let mut spare_b = None;
                let db = match db {
                    Some(t) => t,
                    None => spare_b.insert(self.scratch(w.shape().clone())?),
                };
                self.backend
                    .layernorm_backward(dx, dw, db, dy, x, w, mean, &stats.rstd)
            }
            None => match (self.cfg.family, db) {
                (Family::Llama(s), None) => {
                    self.backend
                        .rmsnorm_backward(dx, dw, dy, x, w, &stats.rstd, s.rms_norm())
                }
                _ => Err(TrainError::Config(
                    "a norm's statistics do not match its gradients".into(),
                )),
            },
        }
    }

    /// Block `l`'s working weights, in its family's offset order ([`params::layer`] /
    /// [`params::llama_layer`]): what [`Model::block_forward`] reads.
    pub fn block_weights(&self, l: usize) -> Result<&[B::Tensor]> {
        let start = params::layer_index(&self.cfg, l, 0);
        Ok(self
            .weights
            .working_range(start..start + params::per_layer(&self.cfg))?)
    }

    /// Check tokens and targets: `[B, T]` ids below the vocab, `T ≤ max_seq`.
    pub fn check_batch(&self, tokens: &[u32], targets: &[u32], g: Geometry<'_>) -> Result<()> {
        check_batch(&self.cfg, tokens, targets, g)
    }

    /// Token (+ GPT-2's position) embeddings: `[B, T, C]` in the storage precision (the
    /// chain's input).
    pub fn embed(&self, tokens: &[u32], g: Geometry<'_>) -> Result<B::Tensor> {
        let wpe = match self.cfg.family {
            Family::Gpt2 => Some(self.w(WPE)?),
            Family::Llama(_) => None,
        };
        self.embed_with(tokens, g, self.w(WTE)?, wpe)
    }

    /// [`Model::embed`] with the token (and GPT-2's position) embedding given by the caller.
    pub fn embed_with(
        &self,
        tokens: &[u32],
        g: Geometry<'_>,
        wte: &B::Tensor,
        wpe: Option<&B::Tensor>,
    ) -> Result<B::Tensor> {
        let _l = label_absolute("embed.out");
        let c = self.cfg.channels;
        let mut out = self.fresh([g.b, g.t, c])?;
        match (wpe, g.positions()) {
            (Some(wpe), Some(positions)) => {
                self.embed_at_positions(&mut out, tokens, wte, wpe, positions)?
            }
            _ => self.backend.embed(&mut out, tokens, wte, wpe)?,
        }
        if let Some(scale) = self.embedding_scale() {
            self.backend.scale(&mut out, scale)?;
        }
        self.keep(out)
    }

    /// What the token embedding's rows are multiplied by (Gemma's `√C`), if anything.
    fn embedding_scale(&self) -> Option<f32> {
        match self.cfg.family {
            Family::Llama(s) => s.embedding_scale(self.cfg.channels),
            Family::Gpt2 => None,
        }
    }

    /// Token embeddings plus the learned position rows of `positions` (one per token), gathered
    /// like tokens and added: the same single f32 addition the fused embedding does, for
    /// positions that do not run `0..T` in every row (a cached decode, packed documents).
    pub(crate) fn embed_at_positions(
        &self,
        out: &mut B::Tensor,
        tokens: &[u32],
        wte: &B::Tensor,
        wpe: &B::Tensor,
        positions: &[u32],
    ) -> Result<()> {
        let be = &self.backend;
        be.embed(out, tokens, wte, None)?;
        let mut pos_rows = self.scratch(out.shape().clone())?;
        be.embed(&mut pos_rows, positions, wpe, None)?;
        be.axpy(1.0, &pos_rows, out)?;
        Ok(())
    }

    /// The head's weights as the model holds them.
    fn own_head_weights(&self) -> Result<HeadWeights<'_, B::Tensor>> {
        let (w, b) = self.final_norm_indices();
        Ok(HeadWeights {
            head: self.w(params::head_index(&self.cfg))?,
            norm_w: self.w(w)?,
            norm_b: b.map(|b| self.w(b)).transpose()?,
        })
    }

    /// Index and count of the final norm's tensors, and the bias's index (GPT-2).
    fn final_norm_indices(&self) -> (usize, Option<usize>) {
        let f = params::final_norm_index(&self.cfg);
        match self.cfg.family {
            Family::Gpt2 => (f, Some(f + 1)),
            Family::Llama(_) => (f, None),
        }
    }

    /// The final norm of `x` `[B, T, C]` with its statistics (kept for backward), the output
    /// rounded to the storage precision as the head's GEMM reads it. Granite's logits are
    /// divided by `logits_scaling`: the norm's output is multiplied by its inverse instead, the
    /// same logits bit for bit when it is a power of two (Granite's 8 and 16), and the head's
    /// backward multiplies the gradient it gives the norm by the same (see [`Model::head`]).
    fn final_norm(
        &self,
        x: &B::Tensor,
        g: Geometry<'_>,
        hw: &HeadWeights<'_, B::Tensor>,
    ) -> Result<(B::Tensor, NormStats<B::Tensor>)> {
        let mut out = self.stat([g.b, g.t, self.cfg.channels])?;
        let stats = self.norm(&mut out, x, hw.norm_w, hw.norm_b, g)?;
        if let Some(d) = self.logits_divisor() {
            self.backend.scale(&mut out, 1.0 / d)?;
        }
        self.backend.round_to(&mut out, self.opts.precision)?;
        Ok((out, stats))
    }

    /// Granite's `logits_scaling`, unless it is 1.
    fn logits_divisor(&self) -> Option<f32> {
        match self.cfg.family {
            Family::Llama(s) => s.logits_divisor(),
            Family::Gpt2 => None,
        }
    }

    /// Token rows per chunk of logits.
    fn head_rows(&self, n: usize) -> usize {
        self.opts.loss_chunk.unwrap_or(n).min(n)
    }

    /// Final norm, head and loss, forward and backward at once (the head is the chain's
    /// loss): returns the mean loss and the gradient `[B, T, C]` f32 of the residual stream
    /// for `loss = Σ losses · dloss_per_token`. Accumulates into the head's weight gradient
    /// (the token embedding's when tied) and the final norm's.
    ///
    /// Trade-off: the logits are f32 in every precision (the loss is computed in f32, as
    /// PyTorch's autocast does); low precision rounds their values. With
    /// [`ModelOptions::loss_chunk`] they exist `chunk` rows at a time instead of whole.
    pub fn head(
        &self,
        residual: &B::Tensor,
        targets: &[u32],
        g: Geometry<'_>,
        dloss_per_token: f32,
        head_grads: HeadGrads<'_, B::Tensor>,
    ) -> Result<(f32, B::Tensor)> {
        let hw = self.own_head_weights()?;
        self.head_with(residual, targets, g, dloss_per_token, head_grads, &hw)
    }

    /// [`Model::head`] with the final norm's and the head's weights given by the caller.
    pub fn head_with(
        &self,
        residual: &B::Tensor,
        targets: &[u32],
        g: Geometry<'_>,
        dloss_per_token: f32,
        head_grads: HeadGrads<'_, B::Tensor>,
        hw: &HeadWeights<'_, B::Tensor>,
    ) -> Result<(f32, B::Tensor)> {
        let c = self.cfg.channels;
        let n = g.rows();
        let _l = label_absolute("head.ln_f");
        let (lnf, stats) = self.final_norm(residual, g, hw)?;
        let _l = label_absolute("head.losses");
        let mut losses = self.stat([g.b, g.t])?;
        let _l = label_absolute("head.dln_f");
        let mut dlnf = self.scratch([g.b, g.t, c])?;
        let logits_category = if self.opts.loss_chunk.is_some() {
            MemoryCategory::Workspace
        } else {
            MemoryCategory::Activations
        };
        let masked = MaskedTargets::new(targets);
        self.backend.head_loss(
            &mut losses,
            &lnf,
            hw.head,
            masked.targets(targets),
            self.head_rows(n),
            self.opts.precision,
            logits_category,
            Some(HeadLossGrads {
                dloss_per_token,
                counted: masked.counted(),
                dx: &mut dlnf,
                dw: head_grads.head,
            }),
        )?;
        let mean = masked.mean(&self.backend.download::<f32>(&losses)?);
        if let Some(d) = self.logits_divisor() {
            self.backend.scale(&mut dlnf, 1.0 / d)?;
        }
        let _l = label_absolute("head.dresidual");
        let mut dres = self.scratch([g.b, g.t, c])?;
        self.norm_backward(
            &mut dres,
            head_grads.norm_w,
            head_grads.norm_b,
            &dlnf,
            residual,
            hw.norm_w,
            &stats,
        )?;
        Ok((mean, dres))
    }

    /// Embedding backward: into the token embedding's gradient (and GPT-2's positions', at
    /// the packed documents' positions when `g` has them). Gemma's scale multiplies `dres`
    /// in place first (the chain's input gradient has no other reader).
    pub fn embed_backward(
        &self,
        dres: &mut B::Tensor,
        tokens: &[u32],
        g: Geometry<'_>,
        dwte: &mut B::Tensor,
        dwpe: Option<&mut B::Tensor>,
    ) -> Result<()> {
        if let Some(scale) = self.embedding_scale() {
            self.backend.scale(dres, scale)?;
        }
        let dres = &*dres;
        let padding = match self.cfg.family {
            Family::Llama(s) => s.padding_idx,
            Family::Gpt2 => None,
        };
        match (dwpe, g.positions()) {
            (Some(dwpe), Some(positions)) => {
                // Position rows are gathered like tokens, so their gradient scatters the same way.
                self.backend
                    .embed_backward(dwte, None, dres, tokens, None)?;
                self.backend
                    .embed_backward(dwpe, None, dres, positions, None)
            }
            (dwpe, _) => self
                .backend
                .embed_backward(dwte, dwpe, dres, tokens, padding),
        }
    }

    /// Mean loss of a batch, forward only (activations are dropped as soon as possible): the
    /// same operations, in the same order, as the loss [`Model::forward_backward`] reports,
    /// without a gradient buffer anywhere (evaluation costs no more memory than training).
    pub fn loss(&self, tokens: &[u32], targets: &[u32], g: Geometry<'_>) -> Result<f32> {
        self.check_batch(tokens, targets, g)?;
        let mut x = self.embed(tokens, g)?;
        for l in 0..self.cfg.layers {
            x = self.block_forward(l, &x, g, false)?.0;
        }
        self.head_loss(&x, targets, g, &self.own_head_weights()?)
    }

    /// The logits `[B, T, V]` of a batch (f32, row-major), forward only: the values the
    /// loss is computed from (rounded to the storage precision, as the head rounds them).
    pub fn logits(&self, tokens: &[u32], g: Geometry<'_>) -> Result<Vec<f32>> {
        self.check_batch(tokens, tokens, g)?;
        let mut x = self.embed(tokens, g)?;
        for l in 0..self.cfg.layers {
            x = self.block_forward(l, &x, g, false)?.0;
        }
        self.logits_of(&x, g)
    }

    /// The logits `[n, V]` (f32, row-major) of the token rows `rows` of a batch (indices
    /// into its `B·T` rows, in the order given) alone: the forward of the whole batch, then
    /// the final norm and the head on those rows only, so `[B, T, V]` logits never exist (a
    /// continuation's few positions after a long context, over a vocabulary of 128 K). The
    /// values of those rows of [`Model::logits`] (the norm and head work row by row) up to the
    /// head GEMM's summation order, which depends on its row count: a few f32 ulps.
    pub fn logits_at(&self, tokens: &[u32], g: Geometry<'_>, rows: &[usize]) -> Result<Vec<f32>> {
        self.check_batch(tokens, tokens, g)?;
        if let Some(&r) = rows.iter().find(|&&r| r >= g.rows()) {
            return Err(TrainError::Input(format!(
                "row {r} of a batch of {} token rows",
                g.rows()
            )));
        }
        let mut x = self.embed(tokens, g)?;
        for l in 0..self.cfg.layers {
            x = self.block_forward(l, &x, g, false)?.0;
        }
        self.logits_of_rows(x, rows)
    }

    /// The final norm and head of the rows `rows` (indices into its `B·T` rows) of the
    /// residual `x` `[B, T, C]` alone: the logits `[rows, V]` (f32). `x` is dropped first.
    pub(crate) fn logits_of_rows(&self, x: B::Tensor, rows: &[usize]) -> Result<Vec<f32>> {
        let c = self.cfg.channels;
        let n = x.numel() / c.max(1);
        if let Some(&r) = rows.iter().find(|&&r| r >= n) {
            return Err(TrainError::Input(format!("row {r} of {n} token rows")));
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        // The chosen rows go through the host: [n, C] of the residual, a fraction of the
        // logits they stand for, and no backend needs a gather op for it.
        let residual = if x.dtype() == DType::F32 {
            self.backend.download::<f32>(&x)?
        } else {
            let mut f = self.scratch_overwritten(x.shape().clone())?;
            self.backend.cast(&x, &mut f)?;
            self.backend.download::<f32>(&f)?
        };
        drop(x);
        let picked: Vec<f32> = rows
            .iter()
            .flat_map(|&r| residual[r * c..(r + 1) * c].iter().copied())
            .collect();
        let picked = {
            let _g = MemoryCategory::Activations.enter();
            self.backend.upload(&picked, [1, rows.len(), c])?
        };
        // Stored as the residual was: the cast back is exact.
        let picked = self.keep(picked)?;
        self.logits_of(&picked, Geometry::new(1, rows.len()))
    }

    /// Final norm and head of the residual `x` `[B, T, C]`: the logits `[B, T, V]` (f32,
    /// rounded to the storage precision as the head rounds them), downloaded.
    pub(crate) fn logits_of(&self, x: &B::Tensor, g: Geometry<'_>) -> Result<Vec<f32>> {
        let (lnf, _) = self.final_norm(x, g, &self.own_head_weights()?)?;
        let _l = label_absolute("head.logits");
        let mut logits = self.scratch([g.b, g.t, self.cfg.vocab])?;
        let head = self.w(params::head_index(&self.cfg))?;
        self.backend.linear(&mut logits, &lnf, head, None)?;
        self.backend.round_to(&mut logits, self.opts.precision)?;
        Ok(self.backend.download::<f32>(&logits)?)
    }

    /// The head's forward alone: final norm, head (`loss_chunk` rows of logits at a time, as
    /// in [`Model::head`]) and the mean cross-entropy.
    fn head_loss(
        &self,
        residual: &B::Tensor,
        targets: &[u32],
        g: Geometry<'_>,
        hw: &HeadWeights<'_, B::Tensor>,
    ) -> Result<f32> {
        let n = g.rows();
        let _l = label_absolute("head.ln_f");
        let (lnf, _) = self.final_norm(residual, g, hw)?;
        let _l = label_absolute("head.losses");
        let mut losses = self.stat([g.b, g.t])?;
        let masked = MaskedTargets::new(targets);
        self.backend.head_loss(
            &mut losses,
            &lnf,
            hw.head,
            masked.targets(targets),
            self.head_rows(n),
            self.opts.precision,
            MemoryCategory::Workspace,
            None,
        )?;
        Ok(masked.mean(&self.backend.download::<f32>(&losses)?))
    }

    /// Block `l` forward on `inp` `[B, T, C]`: the output residual `[B, T, C]` (storage
    /// precision) and, when `save`, what backward needs.
    pub fn block_forward(
        &self,
        l: usize,
        inp: &B::Tensor,
        g: Geometry<'_>,
        save: bool,
    ) -> Result<BlockOutput<B::Tensor, BlockSaved<B::Tensor>>> {
        self.block_forward_with(l, self.block_weights(l)?, inp, g, save)
    }

    /// [`Model::block_forward`] reading the block's weights from `bw` (its family's tensors in
    /// offset order, in the working dtype) rather than from the model: the hook a sharded
    /// owner of the weights (ZeRO-3's gathered layer) calls the block through.
    pub fn block_forward_with(
        &self,
        l: usize,
        bw: &[B::Tensor],
        inp: &B::Tensor,
        g: Geometry<'_>,
        save: bool,
    ) -> Result<BlockOutput<B::Tensor, BlockSaved<B::Tensor>>> {
        self.check_block_weights(bw)?;
        match self.cfg.family {
            Family::Gpt2 => {
                let (out, saved) = self.gpt2_block_forward(l, bw, inp, g, save, None)?;
                Ok((out, saved.map(BlockSaved::Gpt2)))
            }
            Family::Llama(_) => {
                let (out, saved) = self.llama_block_forward(l, bw, inp, g, save, None)?;
                Ok((out, saved.map(BlockSaved::Llama)))
            }
        }
    }

    /// Block `l` backward: accumulates parameter gradients into `grads` (the block's own
    /// tensors, in [`params::layer`] / [`params::llama_layer`] order), returns the gradient
    /// of `inp`.
    pub fn block_backward(
        &self,
        l: usize,
        inp: &B::Tensor,
        saved: BlockSaved<B::Tensor>,
        dout: &B::Tensor,
        grads: &mut [B::Tensor],
        g: Geometry<'_>,
    ) -> Result<B::Tensor> {
        self.block_backward_with(l, self.block_weights(l)?, inp, saved, dout, grads, g)
    }

    /// [`Model::block_backward`] reading the block's weights from `bw` (see
    /// [`Model::block_forward_with`]).
    #[allow(clippy::too_many_arguments)]
    pub fn block_backward_with(
        &self,
        l: usize,
        bw: &[B::Tensor],
        inp: &B::Tensor,
        saved: BlockSaved<B::Tensor>,
        dout: &B::Tensor,
        grads: &mut [B::Tensor],
        g: Geometry<'_>,
    ) -> Result<B::Tensor> {
        self.check_block_weights(bw)?;
        match saved {
            BlockSaved::Gpt2(s) => self.gpt2_block_backward(l, bw, inp, s, dout, grads, g),
            BlockSaved::Llama(s) => self.llama_block_backward(l, bw, inp, s, dout, grads, g),
        }
    }

    /// A block's weights given from outside: one tensor per offset (their shapes and dtypes
    /// are checked by the ops that read them).
    fn check_block_weights(&self, bw: &[B::Tensor]) -> Result<()> {
        let want = params::per_layer(&self.cfg);
        if bw.len() != want {
            return Err(TrainError::Input(format!(
                "{} block weights for a block of {want}",
                bw.len()
            )));
        }
        Ok(())
    }

    /// Forward and backward of a batch under a checkpoint `schedule` over the blocks: returns
    /// the mean loss and the executor's figures, and *adds* to `grads` (f32, parameter order)
    /// the gradient of `Σ losses · dloss_per_token` (`1/(B·T)` gives the mean loss's).
    pub fn forward_backward(
        &self,
        tokens: &[u32],
        targets: &[u32],
        g: Geometry<'_>,
        grads: &mut [B::Tensor],
        dloss_per_token: f32,
        schedule: &Schedule,
    ) -> Result<(f32, ScheduleStats)> {
        self.check_batch(tokens, targets, g)?;
        if let Some(f) = &self.finetune {
            return self.finetune_forward_backward(
                f,
                tokens,
                targets,
                g,
                grads,
                dloss_per_token,
                schedule,
            );
        }
        let expected = self.cfg.tensor_count()?;
        if grads.len() != expected {
            return Err(TrainError::Input(format!(
                "{} gradient tensors for a model with {expected}",
                grads.len(),
            )));
        }
        let cfg = &self.cfg;
        let (embeddings, per_layer) = (params::embedding_count(cfg), params::per_layer(cfg));
        let final_norm = params::final_norm_index(cfg);
        let head = params::head_index(cfg);
        let (emb, rest) = grads.split_at_mut(embeddings);
        let (blocks, tail) = rest.split_at_mut(cfg.layers * per_layer);
        // The tail is the final norm's tensors, then an untied head's.
        let (norm, untied) = tail.split_at_mut(params::final_norm_count(cfg));
        let x = {
            let _g = MemoryCategory::Activations.enter();
            self.embed(tokens, g)?
        };
        let layers = blocks
            .chunks_mut(per_layer)
            .enumerate()
            .map(|(l, grads)| Block {
                model: self,
                index: l,
                io: BlockIo::Own(grads),
                g,
            })
            .collect();
        let mut chain = Chain::new(layers);
        let mut loss = 0.0f32;
        let mut out = chain.step(&self.backend, schedule, &x, |y| {
            let _l = label_absolute("head");
            let head_grad = if head == WTE {
                &mut emb[..1]
            } else {
                debug_assert_eq!(head, final_norm + norm.len());
                &mut untied[..1]
            };
            let (l, d) = self
                .with_staged_grads(head_grad, |hg| {
                    self.with_staged_grads(norm, |ng| {
                        let (w, b) = ng.split_at_mut(1);
                        let grads = HeadGrads {
                            head: hg.first_mut(),
                            norm_w: w.first_mut(),
                            norm_b: b.first_mut(),
                        };
                        self.head(y, targets, g, dloss_per_token, grads)
                    })
                })
                .map_err(into_tensor_error)?;
            loss = l;
            Ok(d)
        })?;
        drop(x);
        let _l = label_absolute("embed");
        self.with_staged_grads(emb, |emb| {
            let (wte, wpe) = emb.split_at_mut(1);
            self.embed_backward(&mut out.input_grad, tokens, g, &mut wte[0], wpe.first_mut())
        })?;
        Ok((loss, out.stats))
    }

    /// [`Model::forward_backward`] of a fine-tuning model: `grads` are the adapters' (see
    /// [`Model::trainable`]); the frozen head, norms and embeddings get no gradient, and the
    /// embedding's backward is skipped.
    #[allow(clippy::too_many_arguments)]
    fn finetune_forward_backward(
        &self,
        f: &crate::model::finetune::Finetune<B>,
        tokens: &[u32],
        targets: &[u32],
        g: Geometry<'_>,
        grads: &mut [B::Tensor],
        dloss_per_token: f32,
        schedule: &Schedule,
    ) -> Result<(f32, ScheduleStats)> {
        let _training = self.training();
        if grads.len() != 2 * f.modules.len() {
            return Err(TrainError::Input(format!(
                "{} gradient tensors for {} adapters",
                grads.len(),
                2 * f.modules.len()
            )));
        }
        let x = {
            let _g = MemoryCategory::Activations.enter();
            self.embed(tokens, g)?
        };
        let mut layers = Vec::with_capacity(self.cfg.layers);
        let mut rest = grads;
        for l in 0..self.cfg.layers {
            let (mine, tail) = rest.split_at_mut(f.block_range(l).len());
            rest = tail;
            layers.push(Block {
                model: self,
                index: l,
                io: BlockIo::Own(mine),
                g,
            });
        }
        let mut chain = Chain::new(layers);
        let mut loss = 0.0f32;
        let out = chain.step(&self.backend, schedule, &x, |y| {
            let _l = label_absolute("head");
            let frozen = HeadGrads {
                head: None,
                norm_w: None,
                norm_b: None,
            };
            let (l, d) = self
                .head(y, targets, g, dloss_per_token, frozen)
                .map_err(into_tensor_error)?;
            loss = l;
            Ok(d)
        })?;
        Ok((loss, out.stats))
    }

    /// [`Model::forward_backward`] with every weight read from `store` and every gradient
    /// handed to it, part by part, as soon as the part's backward is done: the head's first,
    /// then the blocks' from the last, then the embeddings' (with a tied head, the token
    /// embedding's gradient buffer is taken at the head and handed over after the embedding's
    /// backward). The model's own weights are not read. The same operations in the same
    /// order as `forward_backward`, so a store that hands out the model's values gives its
    /// bits.
    pub fn forward_backward_parts(
        &self,
        store: &dyn PartStore<B>,
        tokens: &[u32],
        targets: &[u32],
        g: Geometry<'_>,
        dloss_per_token: f32,
        schedule: &Schedule,
    ) -> Result<(f32, ScheduleStats)> {
        self.check_batch(tokens, targets, g)?;
        if self.finetune.is_some() {
            return Err(TrainError::Config(
                "a fine-tuning model keeps its frozen base itself; it cannot take its weights \
                 part by part"
                    .into(),
            ));
        }
        let tied = params::head_index(&self.cfg) == WTE;
        let x = {
            let ew = store.weights(Part::Embeddings)?;
            let _g = MemoryCategory::Activations.enter();
            self.embed_with(tokens, g, &ew[0], ew.get(1))?
        };
        let layers = (0..self.cfg.layers)
            .map(|l| Block {
                model: self,
                index: l,
                io: BlockIo::Store(store),
                g,
            })
            .collect();
        let mut chain = Chain::new(layers);
        let mut loss = 0.0f32;
        let mut emb_grads: Option<Vec<B::Tensor>> = None;
        let mut out = chain.step(&self.backend, schedule, &x, |y| {
            let _l = label_absolute("head");
            (|| {
                let (hw, tied_w) = self.head_parts(store)?;
                let weights = self.head_weights_of(&hw, tied_w.as_deref());
                let nf = params::final_norm_count(&self.cfg);
                let mut hg = store.grad_buffers(Part::Head)?;
                let eg = if tied {
                    Some(emb_grads.insert(store.grad_buffers(Part::Embeddings)?))
                } else {
                    None
                };
                let (norm, untied) = hg.split_at_mut(nf);
                let (norm_w, norm_b) = norm.split_at_mut(1);
                let grads = HeadGrads {
                    head: match eg {
                        Some(eg) => eg.first_mut(),
                        None => untied.first_mut(),
                    },
                    norm_w: norm_w.first_mut(),
                    norm_b: norm_b.first_mut(),
                };
                let (l, d) = self.head_with(y, targets, g, dloss_per_token, grads, &weights)?;
                drop((hw, tied_w));
                store.push_grads(Part::Head, hg)?;
                loss = l;
                Ok(d)
            })()
            .map_err(into_tensor_error)
        })?;
        drop(x);
        let _l = label_absolute("embed");
        let mut eg = match emb_grads {
            Some(eg) => eg,
            None => store.grad_buffers(Part::Embeddings)?,
        };
        let (wte, wpe) = eg.split_at_mut(1);
        self.embed_backward(&mut out.input_grad, tokens, g, &mut wte[0], wpe.first_mut())?;
        store.push_grads(Part::Embeddings, eg)?;
        Ok((loss, out.stats))
    }

    /// [`Model::loss`] with every weight read from `store`, part by part (forward only).
    pub fn loss_parts(
        &self,
        store: &dyn PartStore<B>,
        tokens: &[u32],
        targets: &[u32],
        g: Geometry<'_>,
    ) -> Result<f32> {
        self.check_batch(tokens, targets, g)?;
        let mut x = {
            let ew = store.weights(Part::Embeddings)?;
            self.embed_with(tokens, g, &ew[0], ew.get(1))?
        };
        for l in 0..self.cfg.layers {
            let w = store.weights(Part::Block(l))?;
            x = self.block_forward_with(l, &w, &x, g, false)?.0;
        }
        let (hw, tied_w) = self.head_parts(store)?;
        self.head_loss(
            &x,
            targets,
            g,
            &self.head_weights_of(&hw, tied_w.as_deref()),
        )
    }

    /// The head part's weights from `store`, and the embeddings' when the head is tied to
    /// the token embedding.
    #[allow(clippy::type_complexity)]
    fn head_parts(
        &self,
        store: &dyn PartStore<B>,
    ) -> Result<(Vec<B::Tensor>, Option<Vec<B::Tensor>>)> {
        let head = store.weights(Part::Head)?;
        let tied = if params::head_index(&self.cfg) == WTE {
            Some(store.weights(Part::Embeddings)?)
        } else {
            None
        };
        Ok((head, tied))
    }

    /// What the head reads, from [`Model::head_parts`]'s tensors: the final norm's (first in
    /// the head part), and the head weight (last in it, or the tied token embedding).
    fn head_weights_of<'a>(
        &self,
        head: &'a [B::Tensor],
        tied: Option<&'a [B::Tensor]>,
    ) -> HeadWeights<'a, B::Tensor> {
        let nf = params::final_norm_count(&self.cfg);
        HeadWeights {
            head: match tied {
                Some(ew) => &ew[0],
                None => &head[nf],
            },
            norm_w: &head[0],
            norm_b: head[..nf].get(1),
        }
    }
}

/// A part of the model as a data-parallel owner of its weights walks it, in order: the
/// embeddings, each block, then the head (the final norm and an untied head weight; a tied
/// head reads the embeddings' token embedding).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Part {
    /// The token embedding (and GPT-2's position embedding).
    Embeddings,
    /// Block `l`.
    Block(usize),
    /// The final norm and the untied head.
    Head,
}

impl Part {
    /// Every part of `cfg`, in order.
    pub fn all(cfg: &ModelConfig) -> Vec<Part> {
        let mut out = vec![Part::Embeddings];
        out.extend((0..cfg.layers).map(Part::Block));
        out.push(Part::Head);
        out
    }

    /// The part's position in [`Part::all`].
    pub fn index(self, cfg: &ModelConfig) -> usize {
        match self {
            Part::Embeddings => 0,
            Part::Block(l) => 1 + l,
            Part::Head => 1 + cfg.layers,
        }
    }

    /// The parts whose weights [`Model::forward_backward_parts`] asks for, in the order it
    /// asks, under `schedule`: the embeddings; a block for each of the schedule's operations
    /// (forwards, recomputations and backwards); the head (and a tied head's embeddings)
    /// right after the first forward of the last block. The embeddings' backward reads no
    /// weights.
    pub fn access_order(cfg: &ModelConfig, schedule: &Schedule) -> Vec<Part> {
        let mut out = vec![Part::Embeddings];
        let mut head_done = false;
        for op in schedule.ops() {
            let l = op.layer();
            out.push(Part::Block(l));
            if op.is_forward() && l + 1 == cfg.layers && !head_done {
                head_done = true;
                out.push(Part::Head);
                if params::head_index(cfg) == WTE {
                    out.push(Part::Embeddings);
                }
            }
        }
        out
    }

    /// The indices of the part's tensors in [`params::param_infos`] order.
    pub fn params(self, cfg: &ModelConfig) -> std::ops::Range<usize> {
        let emb = params::embedding_count(cfg);
        match self {
            Part::Embeddings => 0..emb,
            Part::Block(l) => {
                let start = params::layer_index(cfg, l, 0);
                start..start + params::per_layer(cfg)
            }
            Part::Head => params::final_norm_index(cfg)..params::param_infos(cfg).len(),
        }
    }
}

/// The owner of a model's weights and the receiver of its gradients, part by part, for
/// [`Model::forward_backward_parts`]: ZeRO's sharded engine, which gathers a part's weights
/// just before each use and reduces its gradients as soon as they are complete.
pub trait PartStore<B: ModelOps> {
    /// The part's working weights (its tensors in [`Part::params`] order, in the storage
    /// precision), for one use: they are dropped right after it. The uses of a micro-batch
    /// come in a fixed order ([`Part::access_order`]), so a store can fetch the next part
    /// while this one computes.
    fn weights(&self, part: Part) -> Result<Vec<B::Tensor>>;

    /// Zeroed f32 gradient buffers of the part's tensors, for one micro-batch's backward.
    fn grad_buffers(&self, part: Part) -> Result<Vec<B::Tensor>>;

    /// The part's gradients of this micro-batch, complete (once per part per micro-batch).
    fn push_grads(&self, part: Part, grads: Vec<B::Tensor>) -> Result<()>;
}

/// The weights the head reads: the final norm's and the output head's.
pub struct HeadWeights<'a, T = CpuTensor> {
    /// The head `[V, C]` (the token embedding when tied).
    pub head: &'a T,
    /// The final norm's gain.
    pub norm_w: &'a T,
    /// The final norm's bias (GPT-2).
    pub norm_b: Option<&'a T>,
}

/// What both constructors check before touching weights: a valid shape, a loss chunk of at
/// least one row.
fn check_shape_and_options(cfg: &ModelConfig, opts: &ModelOptions) -> Result<()> {
    cfg.validate()?;
    if let Some(0) = opts.loss_chunk {
        return Err(TrainError::Config(
            "loss chunk must be at least 1 row".into(),
        ));
    }
    Ok(())
}

/// The options a model of shape `cfg` runs with: a decoder's attention is always causal, and
/// scaled as its class scales it (Gemma 3 27B's `query_pre_attn_scalar`) unless the options
/// name a scale.
fn causal(cfg: &ModelConfig, opts: ModelOptions) -> ModelOptions {
    let mut attention = opts.attention.causal(true);
    if let (Family::Llama(s), None) = (cfg.family, attention.softmax_scale) {
        attention.softmax_scale = s.softmax_scale();
    }
    ModelOptions { attention, ..opts }
}

/// headroom-amp's working-copy policy for `precision`.
pub(crate) fn weights_config(precision: Precision) -> MasterWeightsConfig {
    MasterWeightsConfig::preset(match precision {
        Precision::Fp32 => AutocastPreset::Fp32,
        Precision::Bf16 => AutocastPreset::Bf16,
        Precision::Fp16 => AutocastPreset::Fp16,
    })
}

/// Where a block's weights come from and its gradients go.
pub(crate) enum BlockIo<'m, B: ModelOps> {
    /// The model's own weights; gradients accumulate into these tensors (f32, in the
    /// family's offset order).
    Own(&'m mut [B::Tensor]),
    /// A [`PartStore`]'s, fetched for every use and handed back after backward.
    Store(&'m dyn PartStore<B>),
}

/// Block `index` of a model, with where its weights and gradients live, for one batch
/// geometry: a [`headroom_ckpt::Layer`], so any checkpoint schedule can run the blocks.
pub(crate) struct Block<'m, B: ModelOps = Cpu> {
    pub(crate) model: &'m Model<B>,
    pub(crate) index: usize,
    pub(crate) io: BlockIo<'m, B>,
    pub(crate) g: Geometry<'m>,
}

impl<B: ModelOps> Block<'_, B> {
    fn forward(
        &self,
        input: &B::Tensor,
        save: bool,
    ) -> Result<BlockOutput<B::Tensor, BlockSaved<B::Tensor>>> {
        let (model, l, g) = (self.model, self.index, self.g);
        match &self.io {
            BlockIo::Own(_) => model.block_forward(l, input, g, save),
            BlockIo::Store(store) => {
                let w = store.weights(Part::Block(l))?;
                model.block_forward_with(l, &w, input, g, save)
            }
        }
    }
}

impl<B: ModelOps> headroom_ckpt::Layer<B> for Block<'_, B> {
    type Saved = BlockSaved<B::Tensor>;

    fn forward_save(
        &self,
        _: &B,
        input: &B::Tensor,
    ) -> headroom_tensor::Result<(B::Tensor, Self::Saved)> {
        let (out, saved) = self.forward(input, true).map_err(into_tensor_error)?;
        match saved {
            Some(s) => Ok((out, s)),
            None => Err(into_tensor_error(TrainError::Input(
                "block forward kept nothing".into(),
            ))),
        }
    }

    fn forward_discard(&self, _: &B, input: &B::Tensor) -> headroom_tensor::Result<B::Tensor> {
        Ok(self.forward(input, false).map_err(into_tensor_error)?.0)
    }

    fn backward(
        &mut self,
        _: &B,
        input: &B::Tensor,
        saved: Self::Saved,
        grad_output: &B::Tensor,
    ) -> headroom_tensor::Result<B::Tensor> {
        let (model, l, g) = (self.model, self.index, self.g);
        let _t = model.tag(l, "backward");
        match &mut self.io {
            BlockIo::Own(grads) => model.with_staged_grads(grads, |grads| {
                model.block_backward(l, input, saved, grad_output, grads, g)
            }),
            BlockIo::Store(store) => (|| {
                let part = Part::Block(l);
                let w = store.weights(part)?;
                let mut grads = store.grad_buffers(part)?;
                let dx =
                    model.block_backward_with(l, &w, input, saved, grad_output, &mut grads, g)?;
                drop(w);
                store.push_grads(part, grads)?;
                Ok(dx)
            })(),
        }
        .map_err(into_tensor_error)
    }
}

/// A target that does not count in the loss (PyTorch's `ignore_index`, Hugging Face's
/// `labels = -100`): a loss-masked token, such as a prompt's in supervised fine-tuning. Its
/// row contributes no gradient, and the mean loss is over the other rows.
pub const IGNORE_TARGET: u32 = u32::MAX;

/// The rows of a batch whose targets count, when some do not: the ops see target `0` on an
/// ignored row (any id in range; its loss is discarded and its gradient seeded with 0).
struct MaskedTargets {
    /// `None` when every target counts (no copy, no flags: the unmasked path is unchanged).
    masked: Option<(Vec<u32>, Vec<bool>)>,
}

impl MaskedTargets {
    fn new(targets: &[u32]) -> Self {
        MaskedTargets {
            masked: targets.contains(&IGNORE_TARGET).then(|| {
                let ops = targets
                    .iter()
                    .map(|&t| if t == IGNORE_TARGET { 0 } else { t })
                    .collect();
                let counted = targets.iter().map(|&t| t != IGNORE_TARGET).collect();
                (ops, counted)
            }),
        }
    }

    /// The targets the ops see.
    fn targets<'a>(&'a self, targets: &'a [u32]) -> &'a [u32] {
        self.masked.as_ref().map_or(targets, |(t, _)| t)
    }

    fn counted(&self) -> Option<&[bool]> {
        self.masked.as_ref().map(|(_, c)| &c[..])
    }

    /// The mean of the counted rows' losses (f64 sum); 0 when no row counts (its gradient is
    /// 0 too, and a caller weighting micro-batches by their counted rows gives it no weight).
    fn mean(&self, losses: &[f32]) -> f32 {
        match self.counted() {
            None => mean_loss(losses),
            Some(c) => {
                let (sum, n) = losses
                    .iter()
                    .zip(c)
                    .filter(|(_, &k)| k)
                    .fold((0f64, 0usize), |(s, n), (&l, _)| (s + l as f64, n + 1));
                if n == 0 {
                    0.0
                } else {
                    (sum / n as f64) as f32
                }
            }
        }
    }
}

/// The mean of per-token losses, summed in f64 (the head's and the forward-only loss's).
fn mean_loss(losses: &[f32]) -> f32 {
    (losses.iter().map(|&x| x as f64).sum::<f64>() / losses.len().max(1) as f64) as f32
}

/// How many of `targets` count in the loss (every one but [`IGNORE_TARGET`]).
pub fn counted_targets(targets: &[u32]) -> usize {
    targets.iter().filter(|&&t| t != IGNORE_TARGET).count()
}

/// Check a batch against a model shape: `[B, T]` token and target ids below the vocab (or
/// [`IGNORE_TARGET`] for a target), `1 ≤ T ≤ max_seq`, at least one sequence.
pub fn check_batch(
    cfg: &ModelConfig,
    tokens: &[u32],
    targets: &[u32],
    g: Geometry<'_>,
) -> Result<()> {
    let n = g.rows();
    if g.b == 0 || g.t == 0 || g.t > cfg.max_seq {
        return Err(TrainError::Input(format!(
            "batch {}×{}: need at least one sequence of 1..={} tokens",
            g.b, g.t, cfg.max_seq
        )));
    }
    if tokens.len() != n || targets.len() != n {
        return Err(TrainError::Input(format!(
            "{} tokens and {} targets for a {}×{} batch",
            tokens.len(),
            targets.len(),
            g.b,
            g.t
        )));
    }
    if let Some(bad) = tokens
        .iter()
        .chain(targets.iter().filter(|&&t| t != IGNORE_TARGET))
        .find(|&&t| t as usize >= cfg.vocab)
    {
        return Err(TrainError::Input(format!(
            "token id {bad} ≥ vocab {}",
            cfg.vocab
        )));
    }
    Ok(())
}

/// The gradients the head accumulates into (`None` for a frozen tensor).
pub struct HeadGrads<'a, T = CpuTensor> {
    /// The head weight's (the token embedding's when tied).
    pub head: Option<&'a mut T>,
    /// The final norm's gain.
    pub norm_w: Option<&'a mut T>,
    /// The final norm's bias (GPT-2's `ln_f.bias`).
    pub norm_b: Option<&'a mut T>,
}

/// A trainer error crossing the ckpt layer contract (which speaks headroom-tensor's error):
/// tensor errors pass through unchanged (so the tracker's out-of-budget report stays in the
/// chain), anything else is wrapped as the source of a backend error.
pub(crate) fn into_tensor_error(e: TrainError) -> headroom_tensor::Error {
    match e {
        TrainError::Tensor(t) => t,
        other => headroom_tensor::Error::Backend {
            device: headroom_tensor::Device::Cpu,
            op: "model",
            source: Box::new(other),
        },
    }
}
