//! The CPU implementation of [`AttentionBackend`]: input checks, f32 staging of bf16 data, and
//! dispatch to the naive, chunked and flash kernels.
//!
//! Memory goes through the backend so an [`AllocHook`](headroom_tensor::AllocHook) sees it:
//! outputs and gradients in the caller's category, saved state as `Activations`, everything
//! else (bf16→f32 copies, score tiles, partial gradients) as `Workspace`.

mod chunked;
mod flash;
mod matmul;
mod naive;
mod parallel;
mod softmax_rows;

use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory, Shape, Tensor};

use crate::dims::{check_backward_inputs, check_same};
use crate::{
    Algorithm, AttentionBackend, AttentionConfig, AttentionDims, AttentionForward,
    AttentionGradients, AttnError, Result,
};

/// An input as f32: borrowed when it already is, else a `Workspace` copy.
enum F32Input<'a> {
    Borrowed(&'a [f32]),
    Converted(CpuTensor),
}

impl F32Input<'_> {
    fn slice(&self) -> Result<&[f32]> {
        match self {
            F32Input::Borrowed(s) => Ok(s),
            F32Input::Converted(t) => Ok(t.as_slice::<f32>()?),
        }
    }
}

fn f32_input<'a>(cpu: &Cpu, t: &'a CpuTensor) -> Result<F32Input<'a>> {
    if t.dtype() == DType::F32 {
        return Ok(F32Input::Borrowed(t.as_slice::<f32>()?));
    }
    // Trade-off: one up-front O(N·d) copy instead of converting every tile on every reuse;
    // it keeps the kernels single-typed and is still O(N), never O(N²).
    let _workspace = MemoryCategory::Workspace.enter();
    let mut f = cpu.uninit(t.shape().clone(), DType::F32)?;
    cpu.cast(t, &mut f)?;
    Ok(F32Input::Converted(f))
}

/// A result tensor in the inputs' dtype, computed in f32: written in place when the dtype is
/// f32, else through a `Workspace` f32 staging buffer cast at the end.
struct F32Output {
    tensor: CpuTensor,
    staging: Option<CpuTensor>,
}

impl F32Output {
    /// Allocates the result in the calling thread's current category.
    fn new(cpu: &Cpu, shape: Shape, dtype: DType) -> Result<Self> {
        let tensor = cpu.zeros(shape.clone(), dtype)?;
        let staging = if dtype == DType::F32 {
            None
        } else {
            let _workspace = MemoryCategory::Workspace.enter();
            Some(cpu.zeros(shape, DType::F32)?)
        };
        Ok(F32Output { tensor, staging })
    }

    fn slice_mut(&mut self) -> Result<&mut [f32]> {
        Ok(match &mut self.staging {
            Some(s) => s.as_mut_slice::<f32>()?,
            None => self.tensor.as_mut_slice::<f32>()?,
        })
    }

    fn finish(mut self, cpu: &Cpu) -> Result<CpuTensor> {
        if let Some(staging) = self.staging.take() {
            cpu.cast(&staging, &mut self.tensor)?;
        }
        Ok(self.tensor)
    }
}

/// One attention problem with every input as f32, `[batch·heads, seq, head_dim]` per tensor.
pub(crate) struct Problem<'a> {
    pub(crate) dims: AttentionDims,
    pub(crate) causal: bool,
    pub(crate) scale: f32,
    pub(crate) q: &'a [f32],
    pub(crate) k: &'a [f32],
    pub(crate) v: &'a [f32],
}

impl Problem<'_> {
    /// Flat index `b·q_heads + h` of the key/value head that query head `bh` reads.
    pub(crate) fn kv_head_of(&self, bh: usize) -> usize {
        let d = &self.dims;
        let (b, h) = (bh / d.q_heads.max(1), bh % d.q_heads.max(1));
        b * d.kv_heads + h / d.group_size().max(1)
    }

    /// Rows `head·rows_per_head ..` of a `[heads, rows_per_head, head_dim]` slice.
    pub(crate) fn head<'s>(&self, data: &'s [f32], head: usize, rows: usize) -> Result<&'s [f32]> {
        let len = rows * self.dims.head_dim;
        data.get(head * len..(head + 1) * len)
            .ok_or(AttnError::Internal("head slice"))
    }

    /// Elements `head·len .. (head+1)·len` of a per-head slice.
    pub(crate) fn head_rows<'s>(
        &self,
        data: &'s [f32],
        head: usize,
        len: usize,
    ) -> Result<&'s [f32]> {
        data.get(head * len..(head + 1) * len)
            .ok_or(AttnError::Internal("head slice"))
    }

    /// Keys visible to query row `row` (a prefix of the key rows).
    pub(crate) fn visible(&self, row: usize) -> usize {
        self.dims.visible_keys(row, self.causal)
    }
}

/// The forward state chunked and flash backward read, as f32.
pub(crate) struct SavedRows<'a> {
    pub(crate) out: &'a [f32],
    pub(crate) d_out: &'a [f32],
    pub(crate) lse: &'a [f32],
}

/// One query head's slices of everything a chunked or flash backward reads: its `q`, `d_out`,
/// `out` and logsumexp rows, and the `k`, `v` of the key/value head it attends to.
pub(crate) struct HeadBackward<'a> {
    pub(crate) q: &'a [f32],
    pub(crate) d_out: &'a [f32],
    pub(crate) out: &'a [f32],
    pub(crate) lse: &'a [f32],
    pub(crate) k: &'a [f32],
    pub(crate) v: &'a [f32],
}

impl<'a> HeadBackward<'a> {
    pub(crate) fn new(p: &Problem<'a>, saved: &SavedRows<'a>, bh: usize) -> Result<Self> {
        let (nq, nk) = (p.dims.q_len, p.dims.kv_len);
        let kv = p.kv_head_of(bh);
        Ok(HeadBackward {
            q: p.head(p.q, bh, nq)?,
            d_out: p.head(saved.d_out, bh, nq)?,
            out: p.head(saved.out, bh, nq)?,
            lse: saved
                .lse
                .get(bh * nq..(bh + 1) * nq)
                .ok_or(AttnError::Internal("backward lse"))?,
            k: p.head(p.k, kv, nk)?,
            v: p.head(p.v, kv, nk)?,
        })
    }
}

/// The algorithm with chunk and tile sizes clamped to the sequence lengths: a tile larger than
/// the sequence computes the same thing, and clamping keeps scratch sizes from overflowing when
/// a caller passes something like `usize::MAX`.
fn effective(algorithm: Algorithm, dims: &AttentionDims) -> Algorithm {
    let q_rows = dims.q_len.max(1);
    let k_rows = dims.kv_len.max(1);
    match algorithm {
        Algorithm::Naive => Algorithm::Naive,
        Algorithm::Chunked { chunk_size } => Algorithm::Chunked {
            chunk_size: chunk_size.min(q_rows),
        },
        Algorithm::Flash { block_q, block_k } => Algorithm::Flash {
            block_q: block_q.min(q_rows),
            block_k: block_k.min(k_rows),
        },
    }
}

/// The `Workspace` bytes the CPU backward of `dims` under `config` allocates for itself, all
/// live at once at its peak, on a pool of `threads` threads: naive's probability gradient;
/// chunked's and flash's `dK`/`dV` partials (with grouped-query heads or several segments per
/// head) and one scratch buffer per task that can run at once. Not included: the f32 copies of
/// bf16 inputs and the f32 staging of bf16 gradients, each the size of a tensor the caller
/// holds. A function of the shape, the configuration and the thread count only, so a memory
/// estimator can equal the tracker.
pub fn cpu_backward_scratch_bytes(
    dims: &AttentionDims,
    config: &AttentionConfig,
    threads: usize,
) -> u64 {
    let heads = dims.batch.saturating_mul(dims.q_heads);
    if dims.q_len == 0 || dims.kv_len == 0 || heads == 0 {
        return 0;
    }
    let elems = match effective(config.algorithm, dims) {
        Algorithm::Naive => heads.saturating_mul(dims.q_len).saturating_mul(dims.kv_len),
        Algorithm::Chunked { chunk_size } => {
            let seg_rows = parallel::segment_rows(dims, chunk_size, config.backward_segments);
            parallel::BackwardLayout::new(dims, config.causal, seg_rows).workspace_elems(
                dims,
                chunked::backward_scratch_len(chunk_size, dims.kv_len),
                threads,
            )
        }
        Algorithm::Flash { block_q, block_k } => {
            let seg_rows = parallel::segment_rows(dims, block_q, config.backward_segments);
            parallel::BackwardLayout::new(dims, config.causal, seg_rows).workspace_elems(
                dims,
                flash::backward_scratch_len(block_q, block_k, seg_rows),
                threads,
            )
        }
    };
    (elems as u64).saturating_mul(4)
}

impl AttentionBackend for Cpu {
    fn attention_forward(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        config: &AttentionConfig,
    ) -> Result<AttentionForward<CpuTensor>> {
        config.validate()?;
        let dims = AttentionDims::new(
            (q.shape(), q.dtype()),
            (k.shape(), k.dtype()),
            (v.shape(), v.dtype()),
        )?;
        let mut output = F32Output::new(self, dims.q_shape(), dims.dtype)?;
        let mut logsumexp = {
            let _saved = MemoryCategory::Activations.enter();
            self.zeros(dims.lse_shape(), DType::F32)?
        };
        let (qf, kf, vf) = (
            f32_input(self, q)?,
            f32_input(self, k)?,
            f32_input(self, v)?,
        );
        let problem = Problem {
            dims,
            causal: config.causal,
            scale: config.scale_for(dims.head_dim),
            q: qf.slice()?,
            k: kf.slice()?,
            v: vf.slice()?,
        };
        let out = output.slice_mut()?;
        let lse = logsumexp.as_mut_slice::<f32>()?;
        let probs = match effective(config.algorithm, &dims) {
            Algorithm::Naive => Some(naive::forward(self, &problem, out, lse)?),
            Algorithm::Chunked { chunk_size } => {
                chunked::forward(self, &problem, chunk_size, out, lse)?;
                None
            }
            Algorithm::Flash { block_q, block_k } => {
                flash::forward(self, &problem, block_q, block_k, out, lse)?;
                None
            }
        };
        Ok(AttentionForward {
            output: output.finish(self)?,
            logsumexp,
            probs,
            config: *config,
            dims,
        })
    }

    fn attention_backward(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        forward: &AttentionForward<CpuTensor>,
        d_out: &CpuTensor,
    ) -> Result<AttentionGradients<CpuTensor>> {
        let config = forward.config;
        let dims = check_backward_inputs(q, k, v, forward, d_out)?;
        let q_shape = dims.q_shape();
        let mut dq = F32Output::new(self, q_shape, dims.dtype)?;
        let mut dk = F32Output::new(self, dims.kv_shape(), dims.dtype)?;
        let mut dv = F32Output::new(self, dims.kv_shape(), dims.dtype)?;
        let (qf, kf, vf) = (
            f32_input(self, q)?,
            f32_input(self, k)?,
            f32_input(self, v)?,
        );
        let d_out_f = f32_input(self, d_out)?;
        let problem = Problem {
            dims,
            causal: config.causal,
            scale: config.scale_for(dims.head_dim),
            q: qf.slice()?,
            k: kf.slice()?,
            v: vf.slice()?,
        };
        let grads = parallel::Grads {
            dq: dq.slice_mut()?,
            dk: dk.slice_mut()?,
            dv: dv.slice_mut()?,
        };
        match effective(config.algorithm, &dims) {
            Algorithm::Naive => {
                let probs = forward.probs.as_ref().ok_or(AttnError::ForwardMismatch(
                    "naive backward needs the probabilities its forward saved",
                ))?;
                check_same(
                    "probs",
                    probs,
                    &dims.probs_shape(),
                    DType::F32,
                    "probs is [batch, q_heads, q_len, kv_len] f32",
                )?;
                naive::backward(
                    self,
                    &problem,
                    probs.as_slice::<f32>()?,
                    d_out_f.slice()?,
                    grads,
                )?;
            }
            Algorithm::Chunked { chunk_size } => {
                let out_f = f32_input(self, &forward.output)?;
                let saved = SavedRows {
                    out: out_f.slice()?,
                    d_out: d_out_f.slice()?,
                    lse: forward.logsumexp.as_slice::<f32>()?,
                };
                chunked::backward(self, &problem, &saved, chunk_size, &config, grads)?;
            }
            Algorithm::Flash { block_q, block_k } => {
                let out_f = f32_input(self, &forward.output)?;
                let saved = SavedRows {
                    out: out_f.slice()?,
                    d_out: d_out_f.slice()?,
                    lse: forward.logsumexp.as_slice::<f32>()?,
                };
                flash::backward(self, &problem, &saved, block_q, block_k, &config, grads)?;
            }
        }
        Ok(AttentionGradients {
            dq: dq.finish(self)?,
            dk: dk.finish(self)?,
            dv: dv.finish(self)?,
        })
    }
}
