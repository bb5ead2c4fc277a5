//! The GPT forward and backward on a CUDA device: [`CudaGpt`], the CPU model's twin op for op
//! (see [`crate::model`]), on [`headroom_cuda::Cuda`]'s cuBLASLt GEMMs and NVRTC kernels and
//! headroom-attn's flash attention on tensor cores.
//!
//! ```no_run
//! use headroom_ckpt::Schedule;
//! use headroom_tensor::Cpu;
//! use headroom_trainer::cuda::CudaGpt;
//! use headroom_trainer::model::{params, Geometry, ModelConfig, ModelOptions, Precision};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cfg = ModelConfig { vocab: 64, max_seq: 16, layers: 2, heads: 2, channels: 128, family: crate::model::Family::Gpt2 };
//! let opts = ModelOptions { precision: Precision::Bf16, ..Default::default() };
//! let masters = params::init_params(&Cpu::new(), &cfg, 0)?; // the optimizer's, on the host
//! let gpt = match CudaGpt::on_device(0, cfg, opts, &masters) {
//!     Ok(gpt) => gpt,
//!     Err(e) if e.is_no_device() => return Ok(()), // no GPU here: a typed error, no panic
//!     Err(e) => return Err(e.into()),
//! };
//! let mut grads = gpt.alloc_grads()?;
//! let g = Geometry { b: 2, t: 16 };
//! let tokens: Vec<u32> = (0..32).map(|i| i % 64).collect();
//! let targets: Vec<u32> = (1..33).map(|i| i % 64).collect();
//! let schedule = Schedule::every_k(cfg.layers, 2)?;
//! let (loss, _stats) =
//!     gpt.forward_backward(&tokens, &targets, g, &mut grads, 1.0 / 32.0, &schedule)?;
//! let host_grads: Vec<Vec<f32>> = gpt.download_grads(&grads)?; // for CPU AdamW
//! # let _ = (loss, host_grads);
//! # Ok(())
//! # }
//! ```
//!
//! ## Numerics (what differs from the CPU model in bf16)
//! - Working weights are the masters rounded to bf16 (round to nearest even, bitwise the CPU's
//!   working copies). Matrix weights live on the device in bf16 only (GEMM inputs); embeddings,
//!   layer-norm parameters and biases as f32 holding those bf16 values (the f32 kernels' inputs,
//!   the CPU's "f32 views"). The fp32 masters are the optimizer's: on the host
//!   ([`CudaGpt::upload_masters`]) or on the device ([`CudaGpt::refresh_from_device_masters`],
//!   [`CudaGpt::adamw_step_parameter`]); both derive the working copies by the same rounding.
//! - Forward GEMMs read bf16, accumulate in f32 (cuBLASLt, other summation order than the
//!   CPU) and write f32 with the f32 bias fused; the result is rounded to bf16 where the CPU
//!   model rounds it (kept activations, q/k/v, logits). Elementwise ops run in f32 on f32
//!   copies of the bf16 activations, as on the CPU.
//! - Backward GEMMs read the activation gradient rounded to bf16 (PyTorch autocast's choice;
//!   the CPU keeps it f32); bias gradients sum the f32 gradient. Flash attention's backward
//!   reads and returns bf16 gradients (the CPU's flash path is f32 throughout on bf16 inputs).
//! - Parameter gradients are f32 on the device, accumulated (`+=`) like the CPU's.
//!
//! ## Memory
//! Every device allocation goes through the backend, so its allocation hook sees it: working
//! weights as `Parameters`, gradients as `Gradients` ([`CudaGpt::alloc_grads`]), kept
//! activations as `Activations` (bf16, the f32 statistics and flash's logsumexp), everything
//! transient — f32 copies of bf16 activations, activation gradients, GEMM and head scratch,
//! the token ids — as `Workspace`. The head keeps the final layer norm's output in bf16 (the
//! CPU keeps it f32); under [`ModelOptions::loss_chunk`] its logits exist `chunk` rows at a time.
//!
//! ## Limits
//! bf16 only ([`Precision::Bf16`]), flash attention only, head dimension 64 or 128 (the CUDA
//! flash kernels'), compute capability 8.0 or newer. Anything else is a typed error before
//! anything runs on the device (the compute capability when attention first runs).
//! [`ModelOptions::offload_grads`] has no effect here: every gradient stays in the caller's
//! device buffers until the caller downloads them.

mod block;
mod error;
mod layout;

pub use block::{CudaBlock, CudaBlockSaved};
pub use error::{CudaGptError, CudaGptResult};

use headroom_attn::Algorithm;
use headroom_ckpt::{Chain, Schedule, ScheduleStats};
use headroom_cuda::{Cuda, CudaTensor, GemmOp, GemmShape};
use headroom_tensor::cpu::kernels::{axpy, FloatSlice};
use headroom_tensor::{Backend, CpuTensor, DType, MemoryCategory, Shape, Tensor};

use crate::model::params::{self, layer as o, PER_LAYER, WPE, WTE};
use crate::model::{Geometry, Model, ModelConfig, ModelOptions, Precision};
use crate::TrainError;
use error::into_tensor_error;
use layout::{row_copy, run_copies};

/// A GPT-2 whose forward and backward run on a CUDA device: bf16 working weights derived
/// from fp32 masters the optimizer keeps (on the host or on the device), f32 gradients on the
/// device. Parameters are in [`params::param_infos`] order throughout.
pub struct CudaGpt {
    /// Shape.
    pub cfg: ModelConfig,
    /// How it computes (causal flash attention, bf16).
    pub opts: ModelOptions,
    cuda: Cuda,
    /// bf16 working copies of the weights GEMMs read (`wte` and each block's four matrices);
    /// `None` for the others.
    gemm_weights: Vec<Option<CudaTensor>>,
    /// f32 tensors holding the bf16-rounded working values of the weights f32 kernels read
    /// (embeddings, layer norms, biases); `None` for the block matrices.
    f32_weights: Vec<Option<CudaTensor>>,
    /// Host ones the bias gradients' ones column is uploaded from (grow-only; see
    /// [`CudaGpt::ones`]).
    ones_host: std::sync::Mutex<Vec<f32>>,
}

/// An f32 view of a device tensor (the CPU model's view type over `CudaTensor`).
pub(crate) type View<'a> = crate::model::View<'a, CudaTensor>;

/// True for the parameters GEMMs read (bf16 on the device).
fn is_gemm_weight(cfg: &ModelConfig, i: usize) -> bool {
    if i == WTE {
        return true;
    }
    let first_block = 2;
    let past_blocks = params::final_norm_index(cfg);
    (first_block..past_blocks).contains(&i)
        && matches!(
            (i - first_block) % PER_LAYER,
            o::QKV_W | o::ATTN_PROJ_W | o::FC_W | o::FC_PROJ_W
        )
}

/// True for the parameters f32 kernels read (`wte` is read by both the embedding and the
/// head's GEMM).
fn is_f32_weight(cfg: &ModelConfig, i: usize) -> bool {
    i == WTE || !is_gemm_weight(cfg, i)
}

impl CudaGpt {
    /// A model on `cuda` over the host's fp32 `masters` (in [`params::param_infos`] order).
    ///
    /// Errors before touching the device for a config the CUDA path does not run: precision
    /// other than bf16, attention other than flash, a head dimension other than 64 or 128, a
    /// zero loss chunk, or masters of the wrong shapes.
    pub fn new(
        cuda: &Cuda,
        cfg: ModelConfig,
        opts: ModelOptions,
        masters: &[CpuTensor],
    ) -> CudaGptResult<Self> {
        check_config(&cfg, &opts)?;
        let infos = params::param_infos(&cfg);
        if masters.len() != infos.len()
            || masters
                .iter()
                .zip(&infos)
                .any(|(m, i)| m.shape().dims() != i.shape.as_slice() || m.dtype() != DType::F32)
        {
            return Err(TrainError::Config(
                "master weights do not match the model's parameter shapes".into(),
            )
            .into());
        }
        let _g = MemoryCategory::Parameters.enter();
        let mut gemm_weights = Vec::with_capacity(infos.len());
        let mut f32_weights = Vec::with_capacity(infos.len());
        for (i, info) in infos.iter().enumerate() {
            let shape = Shape::from(info.shape.clone());
            gemm_weights.push(if is_gemm_weight(&cfg, i) {
                Some(cuda.zeros(shape.clone(), DType::BF16)?)
            } else {
                None
            });
            f32_weights.push(if is_f32_weight(&cfg, i) {
                Some(cuda.zeros(shape, DType::F32)?)
            } else {
                None
            });
        }
        let mut gpt = CudaGpt {
            cfg,
            opts: ModelOptions {
                attention: opts.attention.causal(true),
                ..opts
            },
            cuda: cuda.clone(),
            gemm_weights,
            f32_weights,
            ones_host: std::sync::Mutex::new(Vec::new()),
        };
        gpt.upload_masters(masters)?;
        Ok(gpt)
    }

    /// [`CudaGpt::new`] on device `ordinal`, creating the backend: on a machine without a GPU
    /// or driver this is [`CudaGptError::Device`] with [`headroom_cuda::CudaError::NoDevice`]
    /// (see [`CudaGptError::is_no_device`]), never a panic.
    pub fn on_device(
        ordinal: usize,
        cfg: ModelConfig,
        opts: ModelOptions,
        masters: &[CpuTensor],
    ) -> CudaGptResult<Self> {
        check_config(&cfg, &opts)?;
        let cuda = Cuda::new(ordinal)?;
        Self::new(&cuda, cfg, opts, masters)
    }

    /// The device twin of a CPU model: same shape, options and (rounded) weights.
    pub fn from_cpu(cuda: &Cuda, gpt: &Model) -> CudaGptResult<Self> {
        Self::new(cuda, gpt.cfg, gpt.opts, gpt.masters())
    }

    /// The backend everything lives on.
    pub fn backend(&self) -> &Cuda {
        &self.cuda
    }

    /// Re-derive the device working weights from the host's fp32 masters (after an optimizer
    /// step): each is uploaded as f32 into a transient `Workspace` buffer and rounded to bf16
    /// on the device (bitwise the CPU's round to nearest even).
    pub fn upload_masters(&mut self, masters: &[CpuTensor]) -> CudaGptResult<()> {
        // Every shape is checked before the first upload, so a bad list changes nothing.
        self.check_masters(masters)?;
        let cuda = &self.cuda;
        for ((m, w16), w32) in masters
            .iter()
            .zip(&mut self.gemm_weights)
            .zip(&mut self.f32_weights)
        {
            let _ws = MemoryCategory::Workspace.enter();
            let up = cuda.upload(m.as_slice::<f32>()?, m.shape().clone())?;
            round_into_working(cuda, &up, w16.as_mut(), w32.as_mut())?;
        }
        Ok(())
    }

    /// Re-derive the device working weights from fp32 masters that live on this device (the
    /// device-resident optimizer's): the same rounding as [`CudaGpt::upload_masters`] without
    /// the upload.
    pub fn refresh_from_device_masters(&mut self, masters: &[CudaTensor]) -> CudaGptResult<()> {
        self.check_masters(masters)?;
        let cuda = &self.cuda;
        for ((m, w16), w32) in masters
            .iter()
            .zip(&mut self.gemm_weights)
            .zip(&mut self.f32_weights)
        {
            let _ws = MemoryCategory::Workspace.enter();
            round_into_working(cuda, m, w16.as_mut(), w32.as_mut())?;
        }
        Ok(())
    }

    /// One AdamW step of parameter `index` on the device (`master`, `m`, `v` f32; `grad` f32
    /// or bf16), writing the updated master rounded to bf16 in the same sweep — into the
    /// parameter's bf16 GEMM weight, or a transient for the others — and then the f32 view
    /// from that bf16, so the working weights end bitwise as [`CudaGpt::upload_masters`] of
    /// the updated master would leave them.
    pub fn adamw_step_parameter(
        &mut self,
        index: usize,
        step: &headroom_cuda::AdamWStep,
        master: &mut CudaTensor,
        grad: &CudaTensor,
        m: &mut CudaTensor,
        v: &mut CudaTensor,
    ) -> CudaGptResult<()> {
        let count = self.gemm_weights.len();
        let (Some(w16), Some(w32)) = (
            self.gemm_weights.get_mut(index),
            self.f32_weights.get_mut(index),
        ) else {
            return Err(
                TrainError::Input(format!("parameter {index} of a model with {count}")).into(),
            );
        };
        let cuda = &self.cuda;
        let _ws = MemoryCategory::Workspace.enter();
        let mut transient;
        let rounded = match w16 {
            Some(t) => t,
            None => {
                transient = cuda.uninit(master.shape().clone(), DType::BF16)?;
                &mut transient
            }
        };
        cuda.adamw_step(step, master, grad, m, v, Some(&mut *rounded))?;
        if let Some(w32) = w32 {
            cuda.cast(rounded, w32)?;
        }
        Ok(())
    }

    /// Check a list of fp32 masters (host or device) against the model's parameters.
    fn check_masters<T: Tensor>(&self, masters: &[T]) -> CudaGptResult<()> {
        self.check_per_parameter(masters, "master")
            .map_err(|e| TrainError::Config(e).into())
    }

    /// Whether `list` holds one f32 tensor per parameter, in parameter order, each of its
    /// parameter's shape; the reason when not (`what` names the list's tensors).
    fn check_per_parameter<T: Tensor>(&self, list: &[T], what: &str) -> Result<(), String> {
        let infos = params::param_infos(&self.cfg);
        if list.len() != infos.len() {
            return Err(format!(
                "{} {what} tensors for a model with {}",
                list.len(),
                infos.len()
            ));
        }
        match list
            .iter()
            .zip(&infos)
            .find(|(t, i)| t.shape().dims() != i.shape.as_slice() || t.dtype() != DType::F32)
        {
            Some((t, info)) => Err(format!(
                "{what} {} is {:?} {:?}, expected f32 {:?}",
                info.name,
                t.dtype(),
                t.shape().dims(),
                info.shape
            )),
            None => Ok(()),
        }
    }

    /// Zeroed f32 gradients for every parameter, on the device, as `Gradients`.
    pub fn alloc_grads(&self) -> CudaGptResult<Vec<CudaTensor>> {
        let _g = MemoryCategory::Gradients.enter();
        params::param_infos(&self.cfg)
            .iter()
            .map(|i| Ok(self.cuda.zeros(i.shape.clone(), DType::F32)?))
            .collect()
    }

    /// Zero every gradient (between optimizer steps).
    pub fn zero_grads(&self, grads: &mut [CudaTensor]) -> CudaGptResult<()> {
        for g in grads {
            self.cuda.fill_zero(g)?;
        }
        Ok(())
    }

    /// The gradients as host f32 vectors, in parameter order.
    pub fn download_grads(&self, grads: &[CudaTensor]) -> CudaGptResult<Vec<Vec<f32>>> {
        grads
            .iter()
            .map(|g| Ok(self.cuda.download::<f32>(g)?))
            .collect()
    }

    /// The gradients copied into host f32 tensors of the same shapes (overwriting them), e.g.
    /// the CPU trainer's gradient buffers before its optimizer step.
    pub fn download_grads_into(
        &self,
        grads: &[CudaTensor],
        host: &mut [CpuTensor],
    ) -> CudaGptResult<()> {
        if grads.len() != host.len() {
            return Err(TrainError::Input(format!(
                "{} device gradients for {} host tensors",
                grads.len(),
                host.len()
            ))
            .into());
        }
        for (g, h) in grads.iter().zip(host) {
            self.cuda.download_into(g, h.as_mut_slice::<f32>()?)?;
        }
        Ok(())
    }

    /// Add the gradients into host f32 tensors of the same shapes (`host += grads`, in f32),
    /// e.g. a micro-batch's device gradients into the accumulator's host buffers.
    pub fn add_grads_into(
        &self,
        grads: &[CudaTensor],
        host: &mut [CpuTensor],
    ) -> CudaGptResult<()> {
        if grads.len() != host.len() {
            return Err(TrainError::Input(format!(
                "{} device gradients for {} host tensors",
                grads.len(),
                host.len()
            ))
            .into());
        }
        let mut staging = Vec::new();
        for (g, h) in grads.iter().zip(host) {
            let dst = h.as_mut_slice::<f32>()?;
            staging.resize(dst.len(), 0.0f32);
            // Synchronous: `staging` holds the gradient when this returns.
            self.cuda.download_into(g, &mut staging)?;
            // The tensor crate's threaded `y += 1·x` (no FMA): the same bits as a plain loop,
            // on every core — at GPT-2 sizes a single-threaded add of every gradient costs
            // about as much as the micro-batch's backward on the device.
            axpy(1.0, FloatSlice::F32(&staging), dst);
        }
        Ok(())
    }

    /// Check tokens and targets: `[B, T]` ids below the vocab, `T ≤ max_seq` (the CPU
    /// model's checks and messages).
    pub fn check_batch(&self, tokens: &[u32], targets: &[u32], g: Geometry) -> CudaGptResult<()> {
        Ok(crate::model::check_batch(&self.cfg, tokens, targets, g)?)
    }

    /// The bf16 working copy of GEMM weight `i`.
    pub(crate) fn w16(&self, i: usize) -> CudaGptResult<&CudaTensor> {
        self.gemm_weights
            .get(i)
            .and_then(Option::as_ref)
            .ok_or_else(|| missing_weight(i, "bf16"))
    }

    /// The f32 (bf16-valued) working copy of weight `i`.
    pub(crate) fn w32(&self, i: usize) -> CudaGptResult<&CudaTensor> {
        self.f32_weights
            .get(i)
            .and_then(Option::as_ref)
            .ok_or_else(|| missing_weight(i, "f32"))
    }

    pub(crate) fn view<'a>(&self, t: &'a CudaTensor) -> CudaGptResult<View<'a>> {
        if t.dtype() == DType::F32 {
            return Ok(View::Borrowed(t));
        }
        let _g = MemoryCategory::Workspace.enter();
        let mut out = self.cuda.uninit(t.shape().clone(), DType::F32)?;
        self.cuda.cast(t, &mut out)?;
        Ok(View::Owned(out))
    }

    /// Transient f32 (an op's output before [`CudaGpt::keep`], gradients, scratch).
    pub(crate) fn scratch(&self, shape: impl Into<Shape>) -> CudaGptResult<CudaTensor> {
        let _g = MemoryCategory::Workspace.enter();
        Ok(self.cuda.zeros(shape, DType::F32)?)
    }

    /// A transient bf16 buffer that copies fill completely.
    pub(crate) fn scratch_bf16(&self, shape: impl Into<Shape>) -> CudaGptResult<CudaTensor> {
        let _g = MemoryCategory::Workspace.enter();
        Ok(self.cuda.uninit(shape, DType::BF16)?)
    }

    /// A kept f32 activation (statistics).
    pub(crate) fn stat(&self, shape: impl Into<Shape>) -> CudaGptResult<CudaTensor> {
        let _g = MemoryCategory::Activations.enter();
        Ok(self.cuda.zeros(shape, DType::F32)?)
    }

    /// Keep an f32 result as a bf16 activation (round to nearest even).
    pub(crate) fn keep(&self, t: &CudaTensor) -> CudaGptResult<CudaTensor> {
        let _g = MemoryCategory::Activations.enter();
        let mut out = self.cuda.uninit(t.shape().clone(), DType::BF16)?;
        self.cuda.cast(t, &mut out)?;
        Ok(out)
    }

    /// A transient bf16 copy of an f32 tensor (a GEMM operand).
    pub(crate) fn to_bf16_scratch(&self, t: &CudaTensor) -> CudaGptResult<CudaTensor> {
        let mut out = self.scratch_bf16(t.shape().clone())?;
        self.cuda.cast(t, &mut out)?;
        Ok(out)
    }

    /// `out[n, oc] = inp[n, c]·W[oc, c]ᵀ + b[oc]`: bf16 `inp` and weight `w`, f32 `out`
    /// and bias `b`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_forward(
        &self,
        out: &mut CudaTensor,
        inp: &CudaTensor,
        w: usize,
        b: usize,
        n: usize,
        c: usize,
        oc: usize,
    ) -> CudaGptResult<()> {
        Ok(self
            .cuda
            .matmul_forward(out, inp, self.w16(w)?, Some(self.w32(b)?), n, c, oc)?)
    }

    /// The linear layer's backward: `dinp = dout·W` (overwritten), `dW += doutᵀ·inp` from the
    /// bf16 gradient `dout16`, `db += Σ_rows dout` from the f32 one (as a GEMM against a
    /// column of ones: cuBLASLt's fixed reduction, no atomics).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_backward(
        &self,
        dinp: &mut CudaTensor,
        (dw, db): (&mut CudaTensor, &mut CudaTensor),
        dout: &CudaTensor,
        dout16: &CudaTensor,
        inp: &CudaTensor,
        w: usize,
        ones: &CudaTensor,
        (n, c, oc): (usize, usize, usize),
    ) -> CudaGptResult<()> {
        let shape = GemmShape { m: n, n: oc, k: c };
        let cuda = &self.cuda;
        cuda.gemm(
            GemmOp::InputGrad,
            shape,
            dinp,
            dout16,
            self.w16(w)?,
            None,
            false,
        )?;
        cuda.gemm(GemmOp::WeightGrad, shape, dw, dout16, inp, None, true)?;
        let column = GemmShape { m: n, n: oc, k: 1 };
        cuda.gemm(GemmOp::WeightGrad, column, db, dout, ones, None, true)?;
        Ok(())
    }

    /// A `[n, 1]` f32 column of ones in workspace memory (the bias gradients' reducer).
    ///
    /// The host source is kept in the model rather than a temporary: CUDA documents an
    /// upload from pageable memory only as "might be synchronous", so a buffer freed right
    /// after the call could in principle still be read. It only grows, and grows only for a
    /// larger batch — in a later step, after that step's loss download waited for the stream
    /// and so for every earlier upload from the buffer it replaces.
    pub(crate) fn ones(&self, n: usize) -> CudaGptResult<CudaTensor> {
        let mut host = self.ones_host.lock().unwrap_or_else(|p| p.into_inner());
        if host.len() < n {
            host.resize(n, 1.0);
        }
        let _g = MemoryCategory::Workspace.enter();
        Ok(self.cuda.upload(&host[..n], [n, 1])?)
    }

    /// Token + position embeddings `[B, T, C]`, kept in bf16 (the chain's input); `tokens`
    /// are the batch's ids on the device.
    pub fn embed(&self, tokens: &CudaTensor, g: Geometry) -> CudaGptResult<CudaTensor> {
        let c = self.cfg.channels;
        let mut out = self.scratch([g.b, g.t, c])?;
        self.cuda
            .embedding_forward(&mut out, tokens, self.w32(WTE)?, self.w32(WPE)?, g.t, c)?;
        self.keep(&out)
    }

    /// Final layer norm, tied head and loss, forward and backward at once (the chain's loss):
    /// the mean loss and the f32 gradient `[B, T, C]` of the residual stream for
    /// `loss = Σ losses · dloss_per_token`; accumulates into `grads`' `wte`, `ln_f.weight`,
    /// `ln_f.bias`. With [`ModelOptions::loss_chunk`] the logits exist that many rows at a time.
    ///
    /// Trade-off: the logits come out of the GEMM in bf16 (the CPU's rounding) and are
    /// widened to f32 for the cross-entropy kernel, so a chunk costs 6 bytes a logit plus the
    /// f32 gradient and its bf16 copy.
    pub fn head(
        &self,
        residual: &CudaTensor,
        targets: &[u32],
        g: Geometry,
        dloss_per_token: f32,
        grads: CudaHeadGrads<'_>,
    ) -> CudaGptResult<(f32, CudaTensor)> {
        let cuda = &self.cuda;
        let (c, v) = (self.cfg.channels, self.cfg.vocab);
        let n = g.rows();
        if n == 0 || targets.len() != n {
            return Err(TrainError::Input(format!(
                "{} targets for a {}×{} batch (need at least one row)",
                targets.len(),
                g.b,
                g.t
            ))
            .into());
        }
        let lf = params::final_norm_index(&self.cfg);
        let x = self.view(residual)?;
        let mut lnf32 = self.scratch([g.b, g.t, c])?;
        let mut lnf_mean = self.stat([g.b, g.t])?;
        let mut lnf_rstd = self.stat([g.b, g.t])?;
        cuda.layernorm_forward(
            &mut lnf32,
            &mut lnf_mean,
            &mut lnf_rstd,
            x.tensor(),
            self.w32(lf)?,
            self.w32(lf + 1)?,
            c,
        )?;
        let lnf = self.keep(&lnf32)?;
        drop(lnf32);
        let wte = self.w16(WTE)?;
        let mut dlnf = self.scratch([g.b, g.t, c])?;
        let rows = self.opts.loss_chunk.unwrap_or(n).clamp(1, n);
        let logits_category = if rows < n {
            MemoryCategory::Workspace
        } else {
            MemoryCategory::Activations
        };
        // Every chunk's per-token losses land in one device buffer that is downloaded once,
        // after the loop: a download per chunk would stall the host on the device as many
        // times as there are chunks. The targets go up once too (chunks are device copies),
        // and the `dloss` host values outlive every upload that reads them.
        let dloss_host = vec![dloss_per_token; rows];
        let (mut losses_all, targets_all, dloss_full) = {
            let _g = MemoryCategory::Workspace.enter();
            (
                cuda.zeros([n], DType::F32)?,
                cuda.upload(targets, [n])?,
                cuda.upload(&dloss_host, [rows])?,
            )
        };
        for (r0, r) in loss_chunks(n, rows) {
            let whole = r == n;
            let lnf_chunk = if whole {
                None
            } else {
                let mut t = self.scratch_bf16([r, c])?;
                run_copies(cuda, &mut t, &lnf, &[row_copy(r0, 0, r, c * 2)])?;
                Some(t)
            };
            let lnf_rows = lnf_chunk.as_ref().unwrap_or(&lnf);
            let mut logits16 = self.scratch_bf16([r, v])?;
            cuda.matmul_forward(&mut logits16, lnf_rows, wte, None, r, c, v)?;
            let logits = {
                let _g = logits_category.enter();
                let mut t = cuda.uninit([r, v], DType::F32)?;
                cuda.cast(&logits16, &mut t)?;
                t
            };
            drop(logits16);
            let mut dlogits = {
                let _g = MemoryCategory::Workspace.enter();
                cuda.zeros([r, v], DType::F32)?
            };
            if whole {
                cuda.cross_entropy_forward_backward(
                    &mut losses_all,
                    &mut dlogits,
                    &logits,
                    &targets_all,
                    &dloss_full,
                    v,
                )?;
            } else {
                let (mut losses, targets_dev, dloss_short) = {
                    let _g = MemoryCategory::Workspace.enter();
                    let mut t = cuda.uninit([r], DType::U32)?;
                    run_copies(cuda, &mut t, &targets_all, &[row_copy(r0, 0, r, 4)])?;
                    let dloss_short = if r == rows {
                        None
                    } else {
                        Some(cuda.upload(&dloss_host[..r], [r])?)
                    };
                    (cuda.zeros([r], DType::F32)?, t, dloss_short)
                };
                cuda.cross_entropy_forward_backward(
                    &mut losses,
                    &mut dlogits,
                    &logits,
                    &targets_dev,
                    dloss_short.as_ref().unwrap_or(&dloss_full),
                    v,
                )?;
                run_copies(cuda, &mut losses_all, &losses, &[row_copy(0, r0, r, 4)])?;
            }
            drop(logits);
            let dlogits16 = self.to_bf16_scratch(&dlogits)?;
            drop(dlogits);
            let shape = GemmShape { m: r, n: v, k: c };
            if whole {
                cuda.gemm(
                    GemmOp::InputGrad,
                    shape,
                    &mut dlnf,
                    &dlogits16,
                    wte,
                    None,
                    false,
                )?;
            } else {
                let mut d = self.scratch([r, c])?;
                cuda.gemm(
                    GemmOp::InputGrad,
                    shape,
                    &mut d,
                    &dlogits16,
                    wte,
                    None,
                    false,
                )?;
                run_copies(cuda, &mut dlnf, &d, &[row_copy(0, r0, r, c * 4)])?;
            }
            // The tied head accumulates into wte's gradient; it has no bias.
            cuda.gemm(
                GemmOp::WeightGrad,
                shape,
                grads.wte,
                &dlogits16,
                lnf_rows,
                None,
                true,
            )?;
        }
        // In token order, in f64, like the CPU model's mean. The download waits for the
        // stream, so every upload above has finished reading `dloss_host` and `targets`.
        let loss_sum: f64 = cuda
            .download::<f32>(&losses_all)?
            .iter()
            .map(|&l| l as f64)
            .sum();
        drop((losses_all, targets_all, dloss_full, dloss_host));
        drop(lnf);
        let mut dres = self.scratch([g.b, g.t, c])?;
        cuda.layernorm_backward(
            &mut dres,
            grads.lnf_w,
            grads.lnf_b,
            &dlnf,
            x.tensor(),
            self.w32(lf)?,
            &lnf_mean,
            &lnf_rstd,
            c,
        )?;
        Ok(((loss_sum / n as f64) as f32, dres))
    }

    /// Embedding backward: accumulates `dwte`, `dwpe` from the residual stream's gradient.
    pub fn embed_backward(
        &self,
        dres: &CudaTensor,
        tokens: &CudaTensor,
        dwte: &mut CudaTensor,
        dwpe: &mut CudaTensor,
        g: Geometry,
    ) -> CudaGptResult<()> {
        Ok(self
            .cuda
            .embedding_backward(dwte, dwpe, dres, tokens, g.t, self.cfg.channels)?)
    }

    /// Forward and backward of a batch under a checkpoint `schedule` over the blocks, like
    /// [`Model::forward_backward`]: returns the mean loss and the executor's figures, and *adds*
    /// to `grads` (device f32, parameter order, from [`CudaGpt::alloc_grads`]) the gradient of
    /// `Σ losses · dloss_per_token`.
    pub fn forward_backward(
        &self,
        tokens: &[u32],
        targets: &[u32],
        g: Geometry,
        grads: &mut [CudaTensor],
        dloss_per_token: f32,
        schedule: &Schedule,
    ) -> CudaGptResult<(f32, ScheduleStats)> {
        self.check_batch(tokens, targets, g)?;
        self.check_per_parameter(grads, "gradient")
            .map_err(TrainError::Input)?;
        let nl = self.cfg.layers;
        let tokens_dev = {
            let _g = MemoryCategory::Workspace.enter();
            self.cuda.upload(tokens, [g.b, g.t])?
        };
        let (emb, rest) = grads.split_at_mut(2);
        let (blocks, lnf) = rest.split_at_mut(nl * PER_LAYER);
        let (dwte, dwpe) = emb.split_at_mut(1);
        let (dlnf_w, dlnf_b) = lnf.split_at_mut(1);
        let x = self.embed(&tokens_dev, g)?;
        let layers = blocks
            .chunks_mut(PER_LAYER)
            .enumerate()
            .map(|(l, grads)| CudaBlock {
                gpt: self,
                index: l,
                grads,
                g,
            })
            .collect();
        let mut chain = Chain::new(layers);
        let mut loss = 0.0f32;
        let device = self.cuda.device();
        let out = chain.step(&self.cuda, schedule, &x, |y| {
            let grads = CudaHeadGrads {
                wte: &mut dwte[0],
                lnf_w: &mut dlnf_w[0],
                lnf_b: &mut dlnf_b[0],
            };
            let (l, d) = self
                .head(y, targets, g, dloss_per_token, grads)
                .map_err(|e| into_tensor_error(device, e))?;
            loss = l;
            Ok(d)
        })?;
        drop(x);
        self.embed_backward(&out.input_grad, &tokens_dev, &mut dwte[0], &mut dwpe[0], g)?;
        Ok((loss, out.stats))
    }

    /// Index of block `l`'s parameter `offset` (see [`params::layer`]).
    pub(crate) fn li(&self, l: usize, offset: usize) -> usize {
        params::layer_index(&self.cfg, l, offset)
    }
}

/// The gradients the head accumulates into (device f32).
pub struct CudaHeadGrads<'a> {
    /// `wte`'s (the tied output head).
    pub wte: &'a mut CudaTensor,
    /// `ln_f.weight`'s.
    pub lnf_w: &'a mut CudaTensor,
    /// `ln_f.bias`'s.
    pub lnf_b: &'a mut CudaTensor,
}

/// Round an f32 master on the device into a parameter's working copies: to bf16 (into its
/// GEMM weight, or a transient `Workspace` buffer when it has none), then the f32 view from
/// that bf16. The one place the working copies are derived, for host and device masters.
fn round_into_working(
    cuda: &Cuda,
    master: &CudaTensor,
    w16: Option<&mut CudaTensor>,
    w32: Option<&mut CudaTensor>,
) -> CudaGptResult<()> {
    let _ws = MemoryCategory::Workspace.enter();
    let mut transient;
    let rounded = match w16 {
        Some(t) => t,
        None => {
            transient = cuda.uninit(master.shape().clone(), DType::BF16)?;
            &mut transient
        }
    };
    cuda.cast(master, rounded)?;
    if let Some(w32) = w32 {
        cuda.cast(rounded, w32)?;
    }
    Ok(())
}

fn missing_weight(i: usize, kind: &str) -> CudaGptError {
    TrainError::Config(format!(
        "parameter {i} has no {kind} working copy on the device"
    ))
    .into()
}

/// The head's row chunks `(first row, rows)` for `n` token rows in chunks of at most `chunk`
/// (`chunk ≥ 1`): consecutive, covering `0..n` once, every chunk but the last full.
fn loss_chunks(n: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..n).step_by(chunk).map(move |r0| (r0, chunk.min(n - r0)))
}

/// What the CUDA path runs, checked before any device work.
fn check_config(cfg: &ModelConfig, opts: &ModelOptions) -> CudaGptResult<()> {
    cfg.validate()?;
    let refuse = |m: String| Err(TrainError::Config(m).into());
    if opts.precision != Precision::Bf16 {
        return refuse(format!(
            "the CUDA model runs in bf16 only, not {}",
            opts.precision.name()
        ));
    }
    if !matches!(opts.attention.algorithm, Algorithm::Flash { .. }) {
        return refuse(format!(
            "the CUDA model runs flash attention only, not {}",
            opts.attention.algorithm.name()
        ));
    }
    let hd = cfg.head_dim();
    if hd != 64 && hd != 128 {
        return refuse(format!(
            "the CUDA flash kernels need head dimension 64 or 128, not {hd} ({} channels / {} heads)",
            cfg.channels, cfg.heads
        ));
    }
    if let Some(0) = opts.loss_chunk {
        return refuse("loss chunk must be at least 1 row".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        ModelConfig {
            vocab: 32,
            max_seq: 8,
            layers: 2,
            heads: 2,
            channels: 128,
            family: crate::model::Family::Gpt2,
        }
    }

    #[test]
    fn every_parameter_has_the_copies_its_kernels_read() {
        let cfg = cfg();
        let gemm: Vec<usize> = (0..params::param_infos(&cfg).len())
            .filter(|&i| is_gemm_weight(&cfg, i))
            .collect();
        let mut want = vec![WTE];
        for l in 0..cfg.layers {
            for off in [o::QKV_W, o::ATTN_PROJ_W, o::FC_W, o::FC_PROJ_W] {
                want.push(params::layer_index(&cfg, l, off));
            }
        }
        assert_eq!(gemm, want);
        // Everything else, and wte (embedding), has an f32 copy; block matrices do not.
        for (i, info) in params::param_infos(&cfg).iter().enumerate() {
            let matrix = info.shape.len() == 2 && i != WTE && i != WPE;
            assert_eq!(is_f32_weight(&cfg, i), !matrix, "{}", info.name);
        }
    }

    #[test]
    fn the_estimator_counts_the_working_copies_this_model_allocates() {
        use crate::techniques::{OptimizerPlacement, Techniques};
        let cfg = cfg();
        let infos = params::param_infos(&cfg);
        let numel = |i: usize| infos[i].shape.iter().product::<usize>() as u64;
        let working: u64 = (0..infos.len())
            .map(|i| {
                let bf16 = if is_gemm_weight(&cfg, i) { 2 } else { 0 };
                let f32_view = if is_f32_weight(&cfg, i) { 4 } else { 0 };
                (bf16 + f32_view) * numel(i)
            })
            .sum();
        let mut tech = Techniques::baseline();
        tech.optimizer.placement = OptimizerPlacement::HostRam;
        let est = crate::estimate::cuda_parameter_state(&cfg, &tech).unwrap();
        assert_eq!(est.device[MemoryCategory::Parameters], working);
    }

    #[test]
    fn loss_chunks_tile_the_rows_once_in_order() {
        for n in 1..40 {
            for chunk in 1..45 {
                let chunks: Vec<(usize, usize)> = loss_chunks(n, chunk).collect();
                let mut next = 0;
                for (i, &(r0, r)) in chunks.iter().enumerate() {
                    assert_eq!(r0, next, "n {n} chunk {chunk}");
                    assert!(r >= 1 && r <= chunk);
                    assert!(r == chunk || i + 1 == chunks.len(), "a short chunk inside");
                    next += r;
                }
                assert_eq!(next, n);
                // One chunk exactly when the chunk holds every row: the head's `whole` case.
                assert_eq!(chunks.len() == 1, chunk >= n);
            }
        }
    }

    #[test]
    fn unsupported_configs_are_refused_before_the_device() {
        let bf16 = ModelOptions {
            precision: Precision::Bf16,
            ..Default::default()
        };
        assert!(check_config(&cfg(), &bf16).is_ok());
        let bad = [
            (cfg(), ModelOptions::default()), // fp32
            (
                cfg(),
                ModelOptions {
                    attention: headroom_attn::AttentionConfig::naive(),
                    ..bf16
                },
            ),
            (
                ModelConfig {
                    channels: 96,
                    ..cfg()
                },
                bf16,
            ), // head_dim 48
            (
                cfg(),
                ModelOptions {
                    loss_chunk: Some(0),
                    ..bf16
                },
            ),
        ];
        for (c, o) in bad {
            let e = check_config(&c, &o).unwrap_err();
            assert!(
                matches!(e, CudaGptError::Train(TrainError::Config(_))),
                "{e}"
            );
            assert!(!e.is_no_device());
        }
    }
}
