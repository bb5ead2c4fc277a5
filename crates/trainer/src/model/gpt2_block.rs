//! The GPT-2 block: pre-norm attention and GELU MLP with biases, forward (keeping
//! [`Gpt2Saved`]) and backward, written once over [`ModelOps`].
//!
//! In low precision each kept tensor is rounded to bf16/fp16 as soon as it is computed, and
//! every later reader (the rest of forward, a recomputation, backward) reads the rounded
//! values; so forward-with-save and forward-with-discard produce the same bits, which is what
//! makes checkpointed gradients equal stored ones.

use headroom_attn::AttentionForward;
use headroom_tensor::{CpuTensor, MemoryCategory, Tensor};

use crate::model::decode::LayerKv;
use crate::model::ops::ModelOps;
use crate::model::params::layer as o;
use crate::model::transformer::{BlockOutput, Geometry, Model, NormStats};
use crate::Result;
use crate::TrainError;

/// What one GPT-2 block keeps for its backward, besides its input (which the chain executor
/// keeps when the schedule says so). Low-precision modes keep these in bf16/f16, except the
/// f32 statistics and log-sum-exp.
pub struct Gpt2Saved<T = CpuTensor> {
    /// `[B, T, C]` first layer norm (`None` under selective recomputation).
    pub ln1: Option<T>,
    /// `[B, T]` f32 its mean and reciprocal standard deviation.
    pub ln1_stats: NormStats<T>,
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
    /// `[B, T]` f32 its statistics.
    pub ln2_stats: NormStats<T>,
    /// `[B, T, 4C]` MLP pre-activation.
    pub fch: T,
    /// `[B, T, 4C]` after GELU (`None` under selective recomputation).
    pub fch_gelu: Option<T>,
}

impl<T: Tensor> headroom_ckpt::SavedState for Gpt2Saved<T> {
    fn size_in_bytes(&self) -> usize {
        let opt = |t: &Option<T>| t.as_ref().map_or(0, |t| t.size_in_bytes());
        let a = &self.attn;
        [
            &self.q,
            &self.k,
            &self.v,
            &self.res2,
            &self.fch,
            &a.output,
            &a.logsumexp,
        ]
        .iter()
        .map(|t| t.size_in_bytes())
        .sum::<usize>()
            + self.ln1_stats.size_in_bytes()
            + self.ln2_stats.size_in_bytes()
            + opt(&self.ln1)
            + opt(&self.ln2)
            + opt(&self.fch_gelu)
            + opt(&a.probs)
    }
}

/// Two distinct mutable elements of a slice (`i < j`).
/// Tensor `off` of a block's weights (an error, not a panic, when the slice is short).
pub(crate) fn at<T>(bw: &[T], off: usize) -> Result<&T> {
    bw.get(off).ok_or_else(|| {
        TrainError::Input(format!(
            "block weight {off} of a block given {} tensors",
            bw.len()
        ))
    })
}

pub(crate) fn two_mut<T>(v: &mut [T], i: usize, j: usize) -> (&mut T, &mut T) {
    let (a, b) = v.split_at_mut(j);
    (&mut a[i], &mut b[0])
}

impl<B: ModelOps> Model<B> {
    /// Layer norm of `x` with block `l`'s parameters `w_off`, `b_off`: the output (kept in the
    /// storage precision) and its f32 statistics.
    fn block_layernorm(
        &self,
        bw: &[B::Tensor],
        x: &B::Tensor,
        w_off: usize,
        b_off: usize,
        g: Geometry<'_>,
    ) -> Result<(B::Tensor, NormStats<B::Tensor>)> {
        let mut out = self.fresh_overwritten([g.b, g.t, self.cfg.channels])?;
        let stats = self.norm(&mut out, x, at(bw, w_off)?, Some(at(bw, b_off)?), g)?;
        Ok((self.keep(out)?, stats))
    }

    /// GELU of the kept pre-activation, kept.
    fn block_gelu(&self, fch: &B::Tensor) -> Result<B::Tensor> {
        let mut out = self.fresh_overwritten(fch.shape().clone())?;
        self.backend().gelu(&mut out, fch)?;
        self.keep(out)
    }

    /// GPT-2 block `l` forward on `inp` `[B, T, C]`: the output residual `[B, T, C]` (storage
    /// precision) and, when `save`, what backward needs.
    ///
    /// With `kv`, a cached decode step: attention reads the cache grown by this step's keys
    /// and values (the caller embedded `inp` at positions `kv.len() ..`; nothing is saved).
    pub(crate) fn gpt2_block_forward(
        &self,
        l: usize,
        bw: &[B::Tensor],
        inp: &B::Tensor,
        g: Geometry<'_>,
        save: bool,
        kv: Option<&mut LayerKv<B::Tensor>>,
    ) -> Result<BlockOutput<B::Tensor, Gpt2Saved<B::Tensor>>> {
        let (c, nh) = (self.cfg.channels, self.cfg.heads);
        let hs = c / nh;
        let be = self.backend();

        // Every allocation below is labelled for the profiler's tables and traces; the guards
        // shadow each other, so each label holds until the next one and all end with the block.
        let _t = self.tag(l, "ln1");
        let (ln1, ln1_stats) = self.block_layernorm(bw, inp, o::LN1_W, o::LN1_B, g)?;
        // qkv is only a stepping stone to q, k, v: workspace, dropped once split.
        let _t = self.tag(l, "attn.qkv");
        let mut qkv = self.scratch_overwritten([g.b, g.t, 3 * c])?;
        self.block_linear(l, bw, o::QKV_W, Some(o::QKV_B), &mut qkv, &ln1)?;
        let mut q = self.fresh_overwritten([g.b, nh, g.t, hs])?;
        let mut k = self.fresh_overwritten([g.b, nh, g.t, hs])?;
        let mut v = self.fresh_overwritten([g.b, nh, g.t, hs])?;
        be.split_heads(&mut q, &qkv, 0)?;
        be.split_heads(&mut k, &qkv, c)?;
        be.split_heads(&mut v, &qkv, 2 * c)?;
        drop(qkv);
        let (q, k, v) = (self.keep(q)?, self.keep(k)?, self.keep(v)?);
        let _t = self.tag(l, "attn.out");
        let kv = self.extend_kv(kv, k, v)?;
        let attn = self.attend(&q, &kv, g)?;
        let _t = self.tag(l, "attn.proj");
        let mut atty = self.scratch_overwritten([g.b, g.t, c])?;
        be.merge_heads(&mut atty, attn.output(), 0)?;
        let mut res2 = self.fresh_overwritten([g.b, g.t, c])?;
        self.block_linear(
            l,
            bw,
            o::ATTN_PROJ_W,
            Some(o::ATTN_PROJ_B),
            &mut res2,
            &atty,
        )?;
        drop(atty);
        be.axpy(1.0, inp, &mut res2)?;
        let res2 = self.keep(res2)?;
        let _t = self.tag(l, "ln2");
        let (ln2, ln2_stats) = self.block_layernorm(bw, &res2, o::LN2_W, o::LN2_B, g)?;
        let _t = self.tag(l, "mlp.fc");
        let mut fch = self.fresh_overwritten([g.b, g.t, 4 * c])?;
        self.block_linear(l, bw, o::FC_W, Some(o::FC_B), &mut fch, &ln2)?;
        let fch = self.keep(fch)?;
        let _t = self.tag(l, "mlp.gelu");
        let fch_gelu = self.block_gelu(&fch)?;
        // The block output is the next block's input: the chain decides whether it is kept.
        let _t = self.tag(l, "mlp.proj");
        let mut out = self.fresh_overwritten([g.b, g.t, c])?;
        self.block_linear(l, bw, o::FC_PROJ_W, Some(o::FC_PROJ_B), &mut out, &fch_gelu)?;
        be.axpy(1.0, &res2, &mut out)?;
        let out = self.keep(out)?;
        if !save {
            return Ok((out, None));
        }
        let (k, v) = kv.into_fresh()?;
        let sel = self.opts.selective;
        let keep_unless_selective = |t: B::Tensor| if sel { None } else { Some(t) };
        let saved = Gpt2Saved {
            ln1: keep_unless_selective(ln1),
            ln1_stats,
            q,
            k,
            v,
            attn: attn.into_kept()?,
            res2,
            ln2: keep_unless_selective(ln2),
            ln2_stats,
            fch,
            fch_gelu: keep_unless_selective(fch_gelu),
        };
        Ok((out, Some(saved)))
    }

    /// Attention over kept `q`, `k`, `v`, read as they are stored (every backend's kernels
    /// take the storage precision; the CPU's widen bf16/f16 a few heads at a time): the output
    /// comes back in the storage precision and is kept as it is, the log-sum-exp in f32.
    /// Packed documents (`g.documents`) attend inside their own document only.
    pub(crate) fn attention(
        &self,
        q: &B::Tensor,
        k: &B::Tensor,
        v: &B::Tensor,
        g: Geometry<'_>,
    ) -> Result<AttentionForward<B::Tensor>> {
        let _g = MemoryCategory::Activations.enter();
        let be = self.backend();
        let f = match g.documents {
            Some(d) => be.attention_forward_documents(q, k, v, &self.opts.attention, d.mask())?,
            None => be.attention_forward(q, k, v, &self.opts.attention)?,
        };
        Ok(AttentionForward {
            output: self.keep(f.output)?,
            ..f
        })
    }

    /// Attention's backward from what [`Model::attention`] kept, `dy` the output's gradient
    /// `[B, NH, T, hs]` f32.
    pub(crate) fn attention_backward(
        &self,
        q: &B::Tensor,
        k: &B::Tensor,
        v: &B::Tensor,
        attn: AttentionForward<B::Tensor>,
        dy: &B::Tensor,
    ) -> Result<headroom_attn::AttentionGradients<B::Tensor>> {
        let _g = MemoryCategory::Workspace.enter();
        self.backend().attention_backward_kept(q, k, v, attn, dy)
    }

    /// GPT-2 block `l` backward: accumulates parameter gradients into `grads` (the block's
    /// 12), returns the gradient of `inp`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gpt2_block_backward(
        &self,
        l: usize,
        bw: &[B::Tensor],
        inp: &B::Tensor,
        s: Gpt2Saved<B::Tensor>,
        dout: &B::Tensor,
        grads: &mut [B::Tensor],
        g: Geometry<'_>,
    ) -> Result<B::Tensor> {
        let (c, be) = (self.cfg.channels, self.backend());
        // Selective recomputation: what forward dropped comes back, bit for bit, from what
        // it kept (the statistics are recomputed too and discarded).
        let _t = self.tag(l, "recompute");
        let ln1 = match s.ln1 {
            Some(t) => t,
            None => self.block_layernorm(bw, inp, o::LN1_W, o::LN1_B, g)?.0,
        };
        let ln2 = match s.ln2 {
            Some(t) => t,
            None => self.block_layernorm(bw, &s.res2, o::LN2_W, o::LN2_B, g)?.0,
        };
        let fch_gelu = match s.fch_gelu {
            Some(t) => t,
            None => self.block_gelu(&s.fch)?,
        };

        // out = res2 + fcproj(fch_gelu): dres2 starts as dout, dfch_gelu from the projection.
        let _t = self.tag(l, "mlp.backward");
        let mut dfch_gelu = self.scratch([g.b, g.t, 4 * c])?;
        self.block_linear_backward(
            l,
            bw,
            o::FC_PROJ_W,
            Some(o::FC_PROJ_B),
            &mut dfch_gelu,
            grads,
            dout,
            &fch_gelu,
        )?;
        drop(fch_gelu);
        // The GELU input's gradient is written over the output's.
        be.gelu_backward_in_place(&mut dfch_gelu, &s.fch)?;
        let dfch = dfch_gelu;
        let mut dln2 = self.scratch([g.b, g.t, c])?;
        self.block_linear_backward(l, bw, o::FC_W, Some(o::FC_B), &mut dln2, grads, &dfch, &ln2)?;
        drop((dfch, ln2));
        let _t = self.tag(l, "ln2.backward");
        let mut dres2 = self.scratch_overwritten([g.b, g.t, c])?;
        be.copy(dout, &mut dres2)?;
        {
            let (dw, db) = self.param_grads(grads, o::LN2_W, Some(o::LN2_B));
            self.norm_backward(
                &mut dres2,
                dw,
                db,
                &dln2,
                &s.res2,
                at(bw, o::LN2_W)?,
                &s.ln2_stats,
            )?;
        }
        drop(dln2);
        // res2 = inp + attproj(atty), atty = the attention output with heads merged.
        let _t = self.tag(l, "attn.backward");
        let mut atty = self.scratch_overwritten([g.b, g.t, c])?;
        be.merge_heads(&mut atty, &s.attn.output, 0)?;
        let mut datty = self.scratch([g.b, g.t, c])?;
        self.block_linear_backward(
            l,
            bw,
            o::ATTN_PROJ_W,
            Some(o::ATTN_PROJ_B),
            &mut datty,
            grads,
            &dres2,
            &atty,
        )?;
        drop(atty);
        let mut dy = self.scratch_overwritten(s.q.shape().clone())?;
        be.split_heads(&mut dy, &datty, 0)?;
        drop(datty);
        let ag = self.attention_backward(&s.q, &s.k, &s.v, s.attn, &dy)?;
        drop(dy);
        // q, k and v's gradients fill its three column ranges.
        let mut dqkv = self.scratch_overwritten([g.b, g.t, 3 * c])?;
        be.merge_heads(&mut dqkv, &ag.dq, 0)?;
        be.merge_heads(&mut dqkv, &ag.dk, c)?;
        be.merge_heads(&mut dqkv, &ag.dv, 2 * c)?;
        drop(ag);
        let _t = self.tag(l, "ln1.backward");
        let mut dln1 = self.scratch([g.b, g.t, c])?;
        self.block_linear_backward(
            l,
            bw,
            o::QKV_W,
            Some(o::QKV_B),
            &mut dln1,
            grads,
            &dqkv,
            &ln1,
        )?;
        drop((dqkv, ln1));
        // The residual passes dres2 straight through to the block input.
        let mut dinp = dres2;
        {
            let (dw, db) = self.param_grads(grads, o::LN1_W, Some(o::LN1_B));
            self.norm_backward(
                &mut dinp,
                dw,
                db,
                &dln1,
                inp,
                at(bw, o::LN1_W)?,
                &s.ln1_stats,
            )?;
        }
        Ok(dinp)
    }
}
