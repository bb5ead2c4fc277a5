//! GPT-2 forward and backward, written out op by op as llm.c does. Every activation a block
//! keeps for its backward is a named field of [`BlockSaved`] with its shape beside it; the
//! blocks run as a chain under a [`headroom_ckpt::Schedule`] (see [`crate::model::block`]), so
//! which of them are kept, dropped or recomputed is the schedule's choice.
//!
//! Memory categories: kept activations are allocated under [`MemoryCategory::Activations`],
//! everything transient (activation gradients, f32 views of low-precision tensors, scratch)
//! under [`MemoryCategory::Workspace`], so the tracker's numbers are the model's.
//!
//! Notation: B batch, T sequence, C channels, NH heads, hs = C/NH, V vocab.

use headroom_amp::{AutocastPreset, MasterWeights, MasterWeightsConfig};
use headroom_attn::{AttentionConfig, AttentionForward};
use headroom_ckpt::{Chain, Schedule, ScheduleStats};
use headroom_profiler::label_absolute;
use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory, Shape, Tensor};

use crate::model::block::Block;
use crate::model::params::{self, ln_f_index, PER_LAYER, WPE, WTE};
use crate::model::{GptConfig, Precision};
use crate::ops::{cross_entropy, embedding, layernorm, matmul};
use crate::{Result, TrainError};

/// How the model computes, independent of its shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptOptions {
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

impl Default for GptOptions {
    fn default() -> Self {
        GptOptions {
            attention: AttentionConfig::flash(),
            precision: Precision::Fp32,
            selective: false,
            loss_chunk: None,
            offload_grads: false,
        }
    }
}

/// What one block keeps for its backward, besides its input (which the chain executor keeps
/// when the schedule says so). Low-precision modes keep these in bf16/f16, except the f32
/// statistics and log-sum-exp. Generic over the tensor type: the CUDA model keeps the same set
/// on the device (`crate::cuda::CudaBlockSaved`).
pub struct BlockSaved<T = CpuTensor> {
    /// `[B, T, C]` first layer norm (`None` under selective recomputation).
    pub ln1: Option<T>,
    /// `[B, T]` f32 its mean.
    pub ln1_mean: T,
    /// `[B, T]` f32 its reciprocal standard deviation.
    pub ln1_rstd: T,
    /// `[B, NH, T, hs]` queries (split from `ln1·Wqkvᵀ`).
    pub q: T,
    /// `[B, NH, T, hs]` keys.
    pub k: T,
    /// `[B, NH, T, hs]` values.
    pub v: T,
    /// Attention output `[B, NH, T, hs]`, its logsumexp `[B, NH, T]` f32, and for naive
    /// attention the probabilities `[B, NH, T, T]` f32. The heads-merged `[B, T, C]` copy the
    /// projection reads is rebuilt in backward rather than kept twice.
    pub attn: AttentionForward<T>,
    /// `[B, T, C]` residual after attention.
    pub res2: T,
    /// `[B, T, C]` second layer norm (`None` under selective recomputation).
    pub ln2: Option<T>,
    /// `[B, T]` f32.
    pub ln2_mean: T,
    /// `[B, T]` f32.
    pub ln2_rstd: T,
    /// `[B, T, 4C]` MLP pre-activation.
    pub fch: T,
    /// `[B, T, 4C]` after GELU (`None` under selective recomputation).
    pub fch_gelu: Option<T>,
}

impl<T: Tensor> headroom_ckpt::SavedState for BlockSaved<T> {
    fn size_in_bytes(&self) -> usize {
        let opt = |t: &Option<T>| t.as_ref().map_or(0, |t| t.size_in_bytes());
        let a = &self.attn;
        [
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.q,
            &self.k,
            &self.v,
            &self.res2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &a.output,
            &a.logsumexp,
        ]
        .iter()
        .map(|t| t.size_in_bytes())
        .sum::<usize>()
            + opt(&self.ln1)
            + opt(&self.ln2)
            + opt(&self.fch_gelu)
            + opt(&a.probs)
    }
}

/// The batch geometry of one forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Sequences.
    pub b: usize,
    /// Tokens per sequence.
    pub t: usize,
}

impl Geometry {
    /// Token rows, `B·T`.
    pub fn rows(&self) -> usize {
        self.b * self.t
    }
}

/// A GPT-2 on the CPU backend: fp32 master weights with working copies in the chosen
/// precision, and how it computes.
pub struct Gpt {
    /// Shape.
    pub cfg: GptConfig,
    /// fp32 masters (what the optimizer updates and checkpoints hold) and the working copies
    /// forward and backward read (the masters themselves under fp32).
    pub weights: MasterWeights<Cpu>,
    /// How it computes.
    pub opts: GptOptions,
    cpu: Cpu,
}

/// An f32 view of a tensor: the tensor itself when it is f32, else an upcast copy in
/// workspace memory that lives as long as the view. Used by the CPU and the CUDA model.
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

pub(crate) fn f32s_mut(t: &mut CpuTensor) -> Result<&mut [f32]> {
    Ok(t.as_mut_slice::<f32>()?)
}

impl Gpt {
    /// A freshly initialised model whose masters live on `cpu`.
    pub fn new(cpu: &Cpu, cfg: GptConfig, opts: GptOptions, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let masters = params::init_params(cpu, &cfg, seed)?;
        Self::from_masters(cpu, cfg, opts, masters)
    }

    /// A model over existing fp32 masters, which may live on another backend than `cpu` (the
    /// host, when the optimizer is offloaded): working copies are allocated on `cpu`.
    pub fn from_masters(
        cpu: &Cpu,
        cfg: GptConfig,
        opts: GptOptions,
        masters: Vec<CpuTensor>,
    ) -> Result<Self> {
        cfg.validate()?;
        if let Some(0) = opts.loss_chunk {
            return Err(TrainError::Config(
                "loss chunk must be at least 1 row".into(),
            ));
        }
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
        let preset = match opts.precision {
            Precision::Fp32 => AutocastPreset::Fp32,
            Precision::Bf16 => AutocastPreset::Bf16,
            Precision::Fp16 => AutocastPreset::Fp16,
        };
        let weights = {
            let _l = label_absolute("params (working copies)");
            MasterWeights::new(cpu, masters, MasterWeightsConfig::preset(preset))?
        };
        Ok(Gpt {
            cfg,
            weights,
            opts: GptOptions {
                attention: opts.attention.causal(true),
                ..opts
            },
            cpu: cpu.clone(),
        })
    }

    /// The backend activations and working weights live on.
    pub fn backend(&self) -> &Cpu {
        &self.cpu
    }

    /// The fp32 masters, in [`params::param_infos`] order.
    pub fn masters(&self) -> &[CpuTensor] {
        self.weights.masters()
    }

    /// The fp32 masters, mutably: call [`Gpt::refresh_working`] after changing them.
    pub fn masters_mut(&mut self) -> &mut [CpuTensor] {
        self.weights.masters_mut()
    }

    /// Re-derive the working copies from the masters (round to nearest even); nothing to do
    /// under fp32, where forward reads the masters.
    pub fn refresh_working(&mut self) -> Result<()> {
        Ok(self.weights.refresh(&self.cpu, 0)?)
    }

    /// Parameter `i` as f32 (an upcast copy of the working weight in low precision).
    pub(crate) fn w(&self, i: usize) -> Result<View<'_>> {
        self.view(self.weights.working(i)?)
    }

    pub(crate) fn view<'a>(&self, t: &'a CpuTensor) -> Result<View<'a>> {
        if t.dtype() == DType::F32 {
            return Ok(View::Borrowed(t));
        }
        let _g = MemoryCategory::Workspace.enter();
        let mut out = self.cpu.uninit(t.shape().clone(), DType::F32)?;
        self.cpu.cast(t, &mut out)?;
        Ok(View::Owned(out))
    }

    /// `t` as an owned f32 tensor (itself when already f32).
    pub(crate) fn to_f32_owned(&self, t: CpuTensor) -> Result<CpuTensor> {
        match self.view(&t)? {
            View::Borrowed(_) => Ok(t),
            View::Owned(o) => Ok(o),
        }
    }

    /// An f32 buffer for an op's output that will be kept: it *is* the kept tensor under
    /// fp32 (so `Activations`), and a transient before [`Gpt::keep`] rounds it otherwise.
    pub(crate) fn fresh(&self, shape: impl Into<Shape>) -> Result<CpuTensor> {
        let cat = if self.opts.precision.is_low() {
            MemoryCategory::Workspace
        } else {
            MemoryCategory::Activations
        };
        let _g = cat.enter();
        Ok(self.cpu.zeros(shape, DType::F32)?)
    }

    /// An f32 activation that is always kept in f32 (statistics).
    pub(crate) fn stat(&self, shape: impl Into<Shape>) -> Result<CpuTensor> {
        let _g = MemoryCategory::Activations.enter();
        Ok(self.cpu.zeros(shape, DType::F32)?)
    }

    /// Transient f32 scratch.
    pub(crate) fn scratch(&self, shape: impl Into<Shape>) -> Result<CpuTensor> {
        let _g = MemoryCategory::Workspace.enter();
        Ok(self.cpu.zeros(shape, DType::F32)?)
    }

    /// Keep an f32 result in the storage precision (rounding it, round to nearest even).
    pub(crate) fn keep(&self, t: CpuTensor) -> Result<CpuTensor> {
        let dt = self.opts.precision.storage();
        if dt == DType::F32 {
            return Ok(t);
        }
        let _g = MemoryCategory::Activations.enter();
        let mut out = self.cpu.uninit(t.shape().clone(), dt)?;
        self.cpu.cast(&t, &mut out)?;
        Ok(out)
    }

    /// Round f32 values in place to the storage precision (for transients whose rounded value
    /// is what a low-precision run would compute with).
    pub(crate) fn round_in_place(&self, x: &mut [f32]) {
        use headroom_tensor::cpu::kernels::{bf16_bits_to_f32, f32_to_bf16_bits};
        use rayon::prelude::*;
        // The logits are 100M values on `small`: split over threads, and for bf16 use the
        // tensor crate's branch-free rounding (the same bits as `half`), which vectorises.
        const CHUNK: usize = 1 << 15;
        match self.opts.precision {
            Precision::Fp32 => {}
            Precision::Bf16 => x.par_chunks_mut(CHUNK).for_each(|c| {
                for v in c {
                    *v = bf16_bits_to_f32(f32_to_bf16_bits(*v));
                }
            }),
            p @ Precision::Fp16 => x.par_chunks_mut(CHUNK).for_each(|c| {
                for v in c {
                    *v = p.round(*v);
                }
            }),
        }
    }

    /// Label the allocations of block `l` with `block.{l}.{what}` until the guard drops
    /// (the profiler's summary table, trace and snapshot name tensors by it).
    pub(crate) fn tag(&self, l: usize, what: &str) -> headroom_profiler::LabelGuard {
        headroom_profiler::label_absolute(&format!("block.{l}.{what}"))
    }

    /// Run `f` on gradient buffers for `dst`: `dst` itself, or — under
    /// [`GptOptions::offload_grads`] — zeroed device buffers of the same shapes (category
    /// `Gradients`) whose contents are added into `dst` once `f` returns, then freed.
    pub(crate) fn with_staged_grads<R>(
        &self,
        dst: &mut [CpuTensor],
        f: impl FnOnce(&mut [CpuTensor]) -> Result<R>,
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
                .map(|t| Ok(self.cpu.zeros(t.shape().clone(), DType::F32)?))
                .collect::<Result<Vec<CpuTensor>>>()?
        };
        let out = f(&mut staged)?;
        for (d, s) in dst.iter_mut().zip(&staged) {
            self.cpu.axpy(1.0, s, d)?;
        }
        Ok(out)
    }

    /// Check tokens and targets: `[B, T]` ids below the vocab, `T ≤ max_seq`.
    pub fn check_batch(&self, tokens: &[u32], targets: &[u32], g: Geometry) -> Result<()> {
        check_batch(&self.cfg, tokens, targets, g)
    }

    /// Token + position embeddings: `[B, T, C]` in the storage precision (the chain's input).
    pub fn embed(&self, tokens: &[u32], g: Geometry) -> Result<CpuTensor> {
        let _l = label_absolute("embed.out");
        let c = self.cfg.channels;
        let mut out = self.fresh([g.b, g.t, c])?;
        embedding::forward(
            f32s_mut(&mut out)?,
            tokens,
            self.w(WTE)?.s()?,
            self.w(WPE)?.s()?,
            g.t,
            c,
        );
        self.keep(out)
    }

    /// Final layer norm, tied head and loss, forward and backward at once (the head is the
    /// chain's loss): returns the mean loss and the gradient `[B, T, C]` f32 of the residual
    /// stream for `loss = Σ losses · dloss_per_token`. Accumulates into `dwte` and the final
    /// layer norm's `dlnf_w`, `dlnf_b`.
    ///
    /// Trade-off: the logits are f32 in every precision (the loss is computed in f32, as
    /// PyTorch's autocast does); low precision rounds their values. With
    /// [`GptOptions::loss_chunk`] they exist `chunk` rows at a time instead of whole.
    pub fn head(
        &self,
        residual: &CpuTensor,
        targets: &[u32],
        g: Geometry,
        dloss_per_token: f32,
        head_grads: HeadGrads<'_>,
    ) -> Result<(f32, CpuTensor)> {
        let (c, v) = (self.cfg.channels, self.cfg.vocab);
        let n = g.rows();
        let lf = ln_f_index(&self.cfg);
        let _l = label_absolute("head.ln_f");
        let x = self.view(residual)?;
        let (lnf, lnf_mean, lnf_rstd) = self.final_norm(x.s()?, g)?;
        let _l = label_absolute("head.wte (f32 view)");
        let wte = self.w(WTE)?;
        let _l = label_absolute("head.losses");
        let mut losses = self.stat([g.b, g.t])?;
        let _l = label_absolute("head.dln_f");
        let mut dlnf = self.scratch([g.b, g.t, c])?;
        let rows = self.opts.loss_chunk.unwrap_or(n).min(n);
        let _l = label_absolute(if rows < n {
            "head.logits[chunk]"
        } else {
            "head.logits"
        });
        let (mut logits, mut dlogits) = {
            let cat = if self.opts.loss_chunk.is_some() {
                MemoryCategory::Workspace
            } else {
                MemoryCategory::Activations
            };
            let _g = cat.enter();
            (
                self.cpu.zeros([rows, v], DType::F32)?,
                self.scratch([rows, v])?,
            )
        };
        let dloss = vec![dloss_per_token; rows];
        let lnf_s = lnf.as_slice::<f32>()?;
        let mut r0 = 0;
        while r0 < n {
            let r = rows.min(n - r0);
            let lg = &mut f32s_mut(&mut logits)?[..r * v];
            matmul::forward(lg, &lnf_s[r0 * c..][..r * c], wte.s()?, None, r, c, v);
            self.round_in_place(lg);
            let ls = &mut f32s_mut(&mut losses)?[r0..r0 + r];
            let dl = &mut f32s_mut(&mut dlogits)?[..r * v];
            cross_entropy::forward_backward(ls, dl, lg, &targets[r0..r0 + r], &dloss[..r], v);
            // The tied head accumulates into wte's gradient; it has no bias.
            matmul::backward(
                &mut f32s_mut(&mut dlnf)?[r0 * c..][..r * c],
                f32s_mut(head_grads.wte)?,
                None,
                dl,
                &lnf_s[r0 * c..][..r * c],
                wte.s()?,
                r,
                c,
                v,
            );
            r0 += r;
        }
        drop((logits, dlogits, wte));
        let mean = mean_loss(losses.as_slice::<f32>()?);
        let _l = label_absolute("head.dresidual");
        let mut dres = self.scratch([g.b, g.t, c])?;
        layernorm::backward(
            f32s_mut(&mut dres)?,
            f32s_mut(head_grads.lnf_w)?,
            f32s_mut(head_grads.lnf_b)?,
            dlnf.as_slice::<f32>()?,
            x.s()?,
            self.w(lf)?.s()?,
            lnf_mean.as_slice::<f32>()?,
            lnf_rstd.as_slice::<f32>()?,
            c,
        );
        Ok((mean, dres))
    }

    /// Embedding backward.
    pub fn embed_backward(
        &self,
        dres: &CpuTensor,
        tokens: &[u32],
        dwte: &mut CpuTensor,
        dwpe: &mut CpuTensor,
        g: Geometry,
    ) -> Result<()> {
        embedding::backward(
            f32s_mut(dwte)?,
            f32s_mut(dwpe)?,
            dres.as_slice::<f32>()?,
            tokens,
            g.t,
            self.cfg.channels,
        );
        Ok(())
    }

    /// Mean loss of a batch, forward only (activations are dropped as soon as possible): the
    /// same operations, in the same order, as the loss [`Gpt::forward_backward`] reports,
    /// without a gradient buffer anywhere (evaluation costs no more memory than training).
    pub fn loss(&self, tokens: &[u32], targets: &[u32], g: Geometry) -> Result<f32> {
        self.check_batch(tokens, targets, g)?;
        let mut x = self.embed(tokens, g)?;
        for l in 0..self.cfg.layers {
            x = self.block_forward(l, &x, g, false)?.0;
        }
        self.head_loss(&x, targets, g)
    }

    /// The final layer norm of `x` `[B, T, C]` with its statistics (kept for backward), the
    /// output rounded to the storage precision as the head's GEMM reads it.
    fn final_norm(&self, x: &[f32], g: Geometry) -> Result<(CpuTensor, CpuTensor, CpuTensor)> {
        let (c, lf) = (self.cfg.channels, ln_f_index(&self.cfg));
        let mut lnf = self.stat([g.b, g.t, c])?;
        let mut lnf_mean = self.stat([g.b, g.t])?;
        let mut lnf_rstd = self.stat([g.b, g.t])?;
        layernorm::forward(
            f32s_mut(&mut lnf)?,
            f32s_mut(&mut lnf_mean)?,
            f32s_mut(&mut lnf_rstd)?,
            x,
            self.w(lf)?.s()?,
            self.w(lf + 1)?.s()?,
            c,
        );
        self.round_in_place(f32s_mut(&mut lnf)?);
        Ok((lnf, lnf_mean, lnf_rstd))
    }

    /// The head's forward alone: final layer norm, tied head (`loss_chunk` rows of logits at a
    /// time, as in [`Gpt::head`]) and the mean cross-entropy.
    fn head_loss(&self, residual: &CpuTensor, targets: &[u32], g: Geometry) -> Result<f32> {
        let (c, v) = (self.cfg.channels, self.cfg.vocab);
        let n = g.rows();
        let _l = label_absolute("head.ln_f");
        let x = self.view(residual)?;
        let (lnf, _, _) = self.final_norm(x.s()?, g)?;
        let _l = label_absolute("head.wte (f32 view)");
        let wte = self.w(WTE)?;
        let _l = label_absolute("head.losses");
        let mut losses = self.stat([g.b, g.t])?;
        let rows = self.opts.loss_chunk.unwrap_or(n).min(n);
        let _l = label_absolute(if rows < n {
            "head.logits[chunk]"
        } else {
            "head.logits"
        });
        let mut logits = {
            let _g = MemoryCategory::Workspace.enter();
            self.cpu.zeros([rows, v], DType::F32)?
        };
        let lnf_s = lnf.as_slice::<f32>()?;
        let mut r0 = 0;
        while r0 < n {
            let r = rows.min(n - r0);
            let lg = &mut f32s_mut(&mut logits)?[..r * v];
            matmul::forward(lg, &lnf_s[r0 * c..][..r * c], wte.s()?, None, r, c, v);
            self.round_in_place(lg);
            let ls = &mut f32s_mut(&mut losses)?[r0..r0 + r];
            cross_entropy::forward(ls, lg, &targets[r0..r0 + r], v);
            r0 += r;
        }
        let mean = mean_loss(losses.as_slice::<f32>()?);
        Ok(mean)
    }

    /// Forward and backward of a batch under a checkpoint `schedule` over the blocks: returns
    /// the mean loss and the executor's figures, and *adds* to `grads` (f32, parameter order)
    /// the gradient of `Σ losses · dloss_per_token` (`1/(B·T)` gives the mean loss's).
    pub fn forward_backward(
        &self,
        tokens: &[u32],
        targets: &[u32],
        g: Geometry,
        grads: &mut [CpuTensor],
        dloss_per_token: f32,
        schedule: &Schedule,
    ) -> Result<(f32, ScheduleStats)> {
        self.check_batch(tokens, targets, g)?;
        let nl = self.cfg.layers;
        if grads.len() != 2 + nl * PER_LAYER + 2 {
            return Err(TrainError::Input(format!(
                "{} gradient tensors for a model with {}",
                grads.len(),
                2 + nl * PER_LAYER + 2
            )));
        }
        let (emb, rest) = grads.split_at_mut(2);
        let (blocks, lnf) = rest.split_at_mut(nl * PER_LAYER);
        let x = {
            let _g = MemoryCategory::Activations.enter();
            self.embed(tokens, g)?
        };
        let layers = blocks
            .chunks_mut(PER_LAYER)
            .enumerate()
            .map(|(l, grads)| Block {
                gpt: self,
                index: l,
                grads,
                g,
            })
            .collect();
        let mut chain = Chain::new(layers);
        let mut loss = 0.0f32;
        let out = chain.step(&self.cpu, schedule, &x, |y| {
            let _l = label_absolute("head");
            let (l, d) = self
                .with_staged_grads(&mut emb[..1], |wte| {
                    self.with_staged_grads(lnf, |lnf| {
                        let (w, b) = lnf.split_at_mut(1);
                        let grads = HeadGrads {
                            wte: &mut wte[0],
                            lnf_w: &mut w[0],
                            lnf_b: &mut b[0],
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
            self.embed_backward(&out.input_grad, tokens, &mut wte[0], &mut wpe[0], g)
        })?;
        Ok((loss, out.stats))
    }
}

/// The mean of per-token losses, summed in f64 (the head's and the forward-only loss's).
fn mean_loss(losses: &[f32]) -> f32 {
    (losses.iter().map(|&x| x as f64).sum::<f64>() / losses.len().max(1) as f64) as f32
}

/// Check a batch against a model shape (shared by the CPU and CUDA models): `[B, T]` token
/// and target ids below the vocab, `1 ≤ T ≤ max_seq`, at least one sequence.
pub fn check_batch(cfg: &GptConfig, tokens: &[u32], targets: &[u32], g: Geometry) -> Result<()> {
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
        .chain(targets)
        .find(|&&t| t as usize >= cfg.vocab)
    {
        return Err(TrainError::Input(format!(
            "token id {bad} ≥ vocab {}",
            cfg.vocab
        )));
    }
    Ok(())
}

/// The gradients the head accumulates into.
pub struct HeadGrads<'a> {
    /// `wte`'s (the tied output head).
    pub wte: &'a mut CpuTensor,
    /// `ln_f.weight`'s.
    pub lnf_w: &'a mut CpuTensor,
    /// `ln_f.bias`'s.
    pub lnf_b: &'a mut CpuTensor,
}

/// A trainer error crossing the ckpt layer contract (which speaks headroom-tensor's error):
/// tensor errors pass through unchanged (so the tracker's out-of-budget report stays in the
/// chain), anything else is wrapped as the source of a backend error.
pub(crate) fn into_tensor_error(e: TrainError) -> headroom_tensor::Error {
    match e {
        TrainError::Tensor(t) => t,
        other => headroom_tensor::Error::Backend {
            device: headroom_tensor::Device::Cpu,
            op: "gpt",
            source: Box::new(other),
        },
    }
}
