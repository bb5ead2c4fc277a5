//! One transformer block on the device as a [`headroom_ckpt::Layer<Cuda>`]: the CPU block's
//! forward and backward op for op (see `crate::model::block`), so every checkpoint schedule
//! and the selective policy run it unchanged.
//!
//! Every kept tensor is rounded to bf16 as soon as it is computed and every later reader
//! (the rest of forward, a recomputation, backward) reads the rounded values; with the device
//! ops deterministic (cuBLASLt picks the same algorithm for the same shapes, no atomics in the
//! kernels or flash attention), forward-with-save and forward-with-discard produce the same
//! bits, which is what makes checkpointed gradients equal stored ones.

use headroom_attn::AttentionBackend;
use headroom_ckpt::Layer;
use headroom_cuda::{Cuda, CudaTensor, HeadLayout};
use headroom_tensor::{Backend, MemoryCategory, Tensor};

use super::error::into_tensor_error;
use super::{CudaGpt, CudaGptResult};
use crate::model::params::layer as o;
use crate::model::Geometry;
use crate::model::NormStats;

/// What a block keeps on the device for its backward: the CPU block's set field for field
/// (`q`, `k`, `v`, attention output and the kept activations in bf16; layer-norm statistics
/// and the logsumexp in f32), each with the shape written on [`crate::model::Gpt2Saved`].
pub type CudaBlockSaved = crate::model::Gpt2Saved<CudaTensor>;

/// Block `index` of a device model, with its 12 device gradient tensors, for one geometry.
pub struct CudaBlock<'m> {
    /// The model.
    pub gpt: &'m CudaGpt,
    /// Which block.
    pub index: usize,
    /// Its parameter gradients (f32, in [`o`] order), accumulated by backward.
    pub grads: &'m mut [CudaTensor],
    /// Batch geometry.
    pub g: Geometry,
}

impl Layer<Cuda> for CudaBlock<'_> {
    type Saved = CudaBlockSaved;

    fn forward_save(
        &self,
        cuda: &Cuda,
        input: &CudaTensor,
    ) -> headroom_tensor::Result<(CudaTensor, CudaBlockSaved)> {
        let (out, saved) = self
            .gpt
            .block_forward(self.index, input, self.g, true)
            .map_err(|e| into_tensor_error(cuda.device(), e))?;
        saved.map(|s| (out, s)).ok_or_else(|| {
            into_tensor_error(
                cuda.device(),
                crate::TrainError::Input("block forward kept nothing".into()).into(),
            )
        })
    }

    fn forward_discard(
        &self,
        cuda: &Cuda,
        input: &CudaTensor,
    ) -> headroom_tensor::Result<CudaTensor> {
        Ok(self
            .gpt
            .block_forward(self.index, input, self.g, false)
            .map_err(|e| into_tensor_error(cuda.device(), e))?
            .0)
    }

    fn backward(
        &mut self,
        cuda: &Cuda,
        input: &CudaTensor,
        saved: CudaBlockSaved,
        grad_output: &CudaTensor,
    ) -> headroom_tensor::Result<CudaTensor> {
        self.gpt
            .block_backward(self.index, input, saved, grad_output, self.grads, self.g)
            .map_err(|e| into_tensor_error(cuda.device(), e))
    }
}

/// Two distinct mutable elements of a slice (`i < j`); `None` when out of range.
fn two_mut<T>(v: &mut [T], i: usize, j: usize) -> Option<(&mut T, &mut T)> {
    if i >= j {
        return None;
    }
    let (a, b) = v.split_at_mut(j);
    Some((a.get_mut(i)?, b.first_mut()?))
}

impl CudaGpt {
    /// The 12 gradients of a block, or a typed error when the caller passed fewer.
    fn grad_pair(
        grads: &mut [CudaTensor],
        w: usize,
        b: usize,
    ) -> CudaGptResult<(&mut CudaTensor, &mut CudaTensor)> {
        let n = grads.len();
        two_mut(grads, w, b).ok_or_else(|| {
            crate::TrainError::Input(format!("{n} gradient tensors for a block with 12")).into()
        })
    }

    /// Layer norm of the f32 `x` with block `l`'s parameters at `w_off`, `b_off`: the output
    /// kept in bf16 and its f32 statistics.
    fn block_layernorm(
        &self,
        l: usize,
        x: &CudaTensor,
        w_off: usize,
        b_off: usize,
        g: Geometry,
    ) -> CudaGptResult<(CudaTensor, CudaTensor, CudaTensor)> {
        let c = self.cfg.channels;
        let mut out = self.scratch([g.b, g.t, c])?;
        let mut mean = self.stat([g.b, g.t])?;
        let mut rstd = self.stat([g.b, g.t])?;
        self.backend().layernorm_forward(
            &mut out,
            &mut mean,
            &mut rstd,
            x,
            self.w32(self.li(l, w_off))?,
            self.w32(self.li(l, b_off))?,
            c,
        )?;
        Ok((self.keep(&out)?, mean, rstd))
    }

    /// GELU of the kept pre-activation, kept.
    fn block_gelu(&self, fch: &CudaTensor) -> CudaGptResult<CudaTensor> {
        let mut out = self.scratch(fch.shape().clone())?;
        self.backend()
            .gelu_forward(&mut out, self.view(fch)?.tensor())?;
        self.keep(&out)
    }

    /// The heads of one `[B, T, C]` tensor (`parts` = 1) for this model and geometry;
    /// [`HeadLayout::part_of`] picks q, k or v of the fused `[B, T, 3C]` projection.
    fn head_layout(&self, g: Geometry) -> HeadLayout {
        let (c, nh) = (self.cfg.channels, self.cfg.heads);
        HeadLayout::single(g.b, g.t, nh, c / nh)
    }

    /// `[B, NH, T, hs]` bf16 → a fresh `[B, T, C]` bf16 workspace tensor.
    fn merge_heads(&self, heads: &CudaTensor, g: Geometry) -> CudaGptResult<CudaTensor> {
        let mut out = self.scratch_bf16([g.b, g.t, self.cfg.channels])?;
        self.backend()
            .merge_heads(&mut out, heads, self.head_layout(g))?;
        Ok(out)
    }

    /// Block `l` forward on `inp` `[B, T, C]` bf16: the output residual `[B, T, C]` bf16 and,
    /// when `save`, what backward needs.
    pub fn block_forward(
        &self,
        l: usize,
        inp: &CudaTensor,
        g: Geometry,
        save: bool,
    ) -> CudaGptResult<(CudaTensor, Option<CudaBlockSaved>)> {
        let cuda = self.backend();
        let (c, nh) = (self.cfg.channels, self.cfg.heads);
        let hs = c / nh;
        let n = g.rows();
        let li = |off| self.li(l, off);
        let x = self.view(inp)?;

        let (ln1, ln1_mean, ln1_rstd) =
            self.block_layernorm(l, x.tensor(), o::LN1_W, o::LN1_B, g)?;
        // qkv is only a stepping stone to q, k, v: workspace, dropped once split.
        let qkv = {
            let mut qkv32 = self.scratch([g.b, g.t, 3 * c])?;
            self.linear_forward(&mut qkv32, &ln1, li(o::QKV_W), li(o::QKV_B), n, c, 3 * c)?;
            self.to_bf16_scratch(&qkv32)?
        };
        let [q, k, v] = {
            let _g = MemoryCategory::Activations.enter();
            let split = |part| -> CudaGptResult<CudaTensor> {
                let mut t = cuda.uninit([g.b, nh, g.t, hs], headroom_tensor::DType::BF16)?;
                cuda.split_heads(&mut t, &qkv, self.head_layout(g).part_of(3, part))?;
                Ok(t)
            };
            [split(0)?, split(1)?, split(2)?]
        };
        drop(qkv);
        let attn = {
            let _g = MemoryCategory::Activations.enter();
            cuda.attention_forward(&q, &k, &v, &self.opts.attention)?
        };
        let atty = self.merge_heads(&attn.output, g)?;
        let mut res2 = self.scratch([g.b, g.t, c])?;
        self.linear_forward(
            &mut res2,
            &atty,
            li(o::ATTN_PROJ_W),
            li(o::ATTN_PROJ_B),
            n,
            c,
            c,
        )?;
        drop(atty);
        cuda.residual_add(&mut res2, x.tensor())?;
        let res2 = self.keep(&res2)?;
        let res2v = self.view(&res2)?;
        let (ln2, ln2_mean, ln2_rstd) =
            self.block_layernorm(l, res2v.tensor(), o::LN2_W, o::LN2_B, g)?;
        let fch = {
            let mut fch32 = self.scratch([g.b, g.t, 4 * c])?;
            self.linear_forward(&mut fch32, &ln2, li(o::FC_W), li(o::FC_B), n, c, 4 * c)?;
            self.keep(&fch32)?
        };
        let fch_gelu = self.block_gelu(&fch)?;
        // The block output is the next block's input: the chain decides whether it is kept.
        let mut out = self.scratch([g.b, g.t, c])?;
        self.linear_forward(
            &mut out,
            &fch_gelu,
            li(o::FC_PROJ_W),
            li(o::FC_PROJ_B),
            n,
            4 * c,
            c,
        )?;
        cuda.residual_add(&mut out, res2v.tensor())?;
        drop(res2v);
        let out = self.keep(&out)?;
        if !save {
            return Ok((out, None));
        }
        let sel = self.opts.selective;
        let keep_unless_selective = |t: CudaTensor| if sel { None } else { Some(t) };
        let saved = CudaBlockSaved {
            ln1: keep_unless_selective(ln1),
            ln1_stats: NormStats {
                mean: Some(ln1_mean),
                rstd: ln1_rstd,
            },
            q,
            k,
            v,
            attn,
            res2,
            ln2: keep_unless_selective(ln2),
            ln2_stats: NormStats {
                mean: Some(ln2_mean),
                rstd: ln2_rstd,
            },
            fch,
            fch_gelu: keep_unless_selective(fch_gelu),
        };
        Ok((out, Some(saved)))
    }

    /// Block `l` backward: accumulates parameter gradients into `grads` (the block's 12, f32)
    /// and returns the f32 gradient of `inp`.
    pub fn block_backward(
        &self,
        l: usize,
        inp: &CudaTensor,
        s: CudaBlockSaved,
        dout: &CudaTensor,
        grads: &mut [CudaTensor],
        g: Geometry,
    ) -> CudaGptResult<CudaTensor> {
        let cuda = self.backend();
        let (c, nh) = (self.cfg.channels, self.cfg.heads);
        let hs = c / nh;
        let n = g.rows();
        let li = |off| self.li(l, off);
        let x = self.view(inp)?;
        let res2v = self.view(&s.res2)?;
        // Selective recomputation: what forward dropped comes back, bit for bit, from what it
        // kept (the statistics are recomputed too and discarded).
        let ln1 = match s.ln1 {
            Some(t) => t,
            None => {
                self.block_layernorm(l, x.tensor(), o::LN1_W, o::LN1_B, g)?
                    .0
            }
        };
        let ln2 = match s.ln2 {
            Some(t) => t,
            None => {
                self.block_layernorm(l, res2v.tensor(), o::LN2_W, o::LN2_B, g)?
                    .0
            }
        };
        let fch_gelu = match s.fch_gelu {
            Some(t) => t,
            None => self.block_gelu(&s.fch)?,
        };
        let ones = self.ones(n)?;

        // out = res2 + fcproj(fch_gelu): dres2 starts as dout, dfch_gelu from the projection.
        let mut dfch_gelu = self.scratch([g.b, g.t, 4 * c])?;
        {
            let dout16 = self.to_bf16_scratch(dout)?;
            self.linear_backward(
                &mut dfch_gelu,
                Self::grad_pair(grads, o::FC_PROJ_W, o::FC_PROJ_B)?,
                dout,
                &dout16,
                &fch_gelu,
                li(o::FC_PROJ_W),
                &ones,
                (n, 4 * c, c),
            )?;
        }
        drop(fch_gelu);
        let mut dfch = self.scratch([g.b, g.t, 4 * c])?;
        cuda.gelu_backward(&mut dfch, self.view(&s.fch)?.tensor(), &dfch_gelu)?;
        drop(dfch_gelu);
        let mut dln2 = self.scratch([g.b, g.t, c])?;
        {
            let dfch16 = self.to_bf16_scratch(&dfch)?;
            self.linear_backward(
                &mut dln2,
                Self::grad_pair(grads, o::FC_W, o::FC_B)?,
                &dfch,
                &dfch16,
                &ln2,
                li(o::FC_W),
                &ones,
                (n, c, 4 * c),
            )?;
        }
        drop((dfch, ln2));
        let mut dres2 = self.scratch([g.b, g.t, c])?;
        cuda.copy(dout, &mut dres2)?;
        {
            let (dw, db) = Self::grad_pair(grads, o::LN2_W, o::LN2_B)?;
            cuda.layernorm_backward(
                &mut dres2,
                dw,
                db,
                &dln2,
                res2v.tensor(),
                self.w32(li(o::LN2_W))?,
                s.ln2_stats.mean.as_ref().ok_or_else(missing_mean)?,
                &s.ln2_stats.rstd,
                c,
            )?;
        }
        drop((dln2, res2v));
        // res2 = inp + attproj(atty), atty = the attention output with heads merged.
        let mut datty = self.scratch([g.b, g.t, c])?;
        {
            let atty = self.merge_heads(&s.attn.output, g)?;
            let dres2_16 = self.to_bf16_scratch(&dres2)?;
            self.linear_backward(
                &mut datty,
                Self::grad_pair(grads, o::ATTN_PROJ_W, o::ATTN_PROJ_B)?,
                &dres2,
                &dres2_16,
                &atty,
                li(o::ATTN_PROJ_W),
                &ones,
                (n, c, c),
            )?;
        }
        // Flash attention's backward takes its output gradient in the inputs' dtype.
        let dy = {
            let datty16 = self.to_bf16_scratch(&datty)?;
            drop(datty);
            let mut dy = self.scratch_bf16([g.b, nh, g.t, hs])?;
            cuda.split_heads(&mut dy, &datty16, self.head_layout(g))?;
            dy
        };
        let ag = {
            let _g = MemoryCategory::Workspace.enter();
            cuda.attention_backward(&s.q, &s.k, &s.v, &s.attn, &dy)?
        };
        drop(dy);
        // Each merge writes only its third of every row; the three fill the buffer.
        let mut dqkv16 = self.scratch_bf16([g.b, g.t, 3 * c])?;
        for (part, d) in [&ag.dq, &ag.dk, &ag.dv].into_iter().enumerate() {
            cuda.merge_heads(&mut dqkv16, d, self.head_layout(g).part_of(3, part))?;
        }
        drop(ag);
        let mut dln1 = self.scratch([g.b, g.t, c])?;
        {
            let dqkv = self.view(&dqkv16)?;
            self.linear_backward(
                &mut dln1,
                Self::grad_pair(grads, o::QKV_W, o::QKV_B)?,
                dqkv.tensor(),
                &dqkv16,
                &ln1,
                li(o::QKV_W),
                &ones,
                (n, c, 3 * c),
            )?;
        }
        drop((dqkv16, ln1));
        // The residual passes dres2 straight through to the block input.
        let mut dinp = dres2;
        {
            let (dw, db) = Self::grad_pair(grads, o::LN1_W, o::LN1_B)?;
            cuda.layernorm_backward(
                &mut dinp,
                dw,
                db,
                &dln1,
                x.tensor(),
                self.w32(li(o::LN1_W))?,
                s.ln1_stats.mean.as_ref().ok_or_else(missing_mean)?,
                &s.ln1_stats.rstd,
                c,
            )?;
        }
        Ok(dinp)
    }
}

/// A GPT-2 block's layer norm always keeps its mean; its absence is a logic error surfaced as
/// a typed one.
fn missing_mean() -> crate::cuda::CudaGptError {
    crate::cuda::CudaGptError::Train(crate::TrainError::Input("a layer norm kept no mean".into()))
}
