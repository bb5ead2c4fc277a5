//! One transformer block as a [`headroom_ckpt::Layer`]: its explicit forward (keeping
//! [`BlockSaved`]) and backward, so any checkpoint schedule can run the blocks.
//!
//! In low precision each kept tensor is rounded to bf16/fp16 as soon as it is computed, and
//! every later reader (the rest of forward, a recomputation, backward) reads the rounded
//! values; so forward-with-save and forward-with-discard produce the same bits, which is what
//! makes checkpointed gradients equal stored ones.

use headroom_attn::{AttentionBackend, AttentionForward};
use headroom_ckpt::Layer;
use headroom_tensor::{Cpu, CpuTensor, MemoryCategory, Tensor};

use crate::model::gpt::{f32s_mut, into_tensor_error, BlockSaved, Geometry, Gpt};
use crate::model::params::{layer as o, layer_index};
use crate::ops::{gelu, layernorm, matmul};
use crate::Result;

/// Block `index` of a model, with its 12 gradient tensors, for one batch geometry.
pub struct Block<'m> {
    /// The model.
    pub gpt: &'m Gpt,
    /// Which block.
    pub index: usize,
    /// Its parameter gradients (f32, in [`o`] order), accumulated by backward.
    pub grads: &'m mut [CpuTensor],
    /// Batch geometry.
    pub g: Geometry,
}

impl Layer<Cpu> for Block<'_> {
    type Saved = BlockSaved;

    fn forward_save(
        &self,
        _: &Cpu,
        input: &CpuTensor,
    ) -> headroom_tensor::Result<(CpuTensor, BlockSaved)> {
        let (out, saved) = self
            .gpt
            .block_forward(self.index, input, self.g, true)
            .map_err(into_tensor_error)?;
        match saved {
            Some(s) => Ok((out, s)),
            None => Err(into_tensor_error(crate::TrainError::Input(
                "block forward kept nothing".into(),
            ))),
        }
    }

    fn forward_discard(&self, _: &Cpu, input: &CpuTensor) -> headroom_tensor::Result<CpuTensor> {
        Ok(self
            .gpt
            .block_forward(self.index, input, self.g, false)
            .map_err(into_tensor_error)?
            .0)
    }

    fn backward(
        &mut self,
        _: &Cpu,
        input: &CpuTensor,
        saved: BlockSaved,
        grad_output: &CpuTensor,
    ) -> headroom_tensor::Result<CpuTensor> {
        let (gpt, l, g) = (self.gpt, self.index, self.g);
        let _t = gpt.tag(l, "backward");
        gpt.with_staged_grads(self.grads, |grads| {
            gpt.block_backward(l, input, saved, grad_output, grads, g)
        })
        .map_err(into_tensor_error)
    }
}

/// Two distinct mutable elements of a slice (`i < j`).
fn two_mut<T>(v: &mut [T], i: usize, j: usize) -> (&mut T, &mut T) {
    let (a, b) = v.split_at_mut(j);
    (&mut a[i], &mut b[0])
}

impl Gpt {
    /// Layer norm of `x` with block `l`'s parameters `w_off`, `b_off`: the output (kept in the
    /// storage precision) and its f32 statistics.
    fn block_layernorm(
        &self,
        l: usize,
        x: &[f32],
        w_off: usize,
        b_off: usize,
        g: Geometry,
    ) -> Result<(CpuTensor, CpuTensor, CpuTensor)> {
        let c = self.cfg.channels;
        let mut out = self.fresh([g.b, g.t, c])?;
        let mut mean = self.stat([g.b, g.t])?;
        let mut rstd = self.stat([g.b, g.t])?;
        layernorm::forward(
            f32s_mut(&mut out)?,
            f32s_mut(&mut mean)?,
            f32s_mut(&mut rstd)?,
            x,
            self.w(layer_index(l, w_off))?.s()?,
            self.w(layer_index(l, b_off))?.s()?,
            c,
        );
        Ok((self.keep(out)?, mean, rstd))
    }

    /// GELU of the kept pre-activation, kept.
    fn block_gelu(&self, fch: &CpuTensor) -> Result<CpuTensor> {
        let mut out = self.fresh(fch.shape().clone())?;
        gelu::forward(f32s_mut(&mut out)?, self.view(fch)?.s()?);
        self.keep(out)
    }

    /// Block `l` forward on `inp` `[B, T, C]`: the output residual `[B, T, C]` (storage
    /// precision) and, when `save`, what backward needs.
    pub fn block_forward(
        &self,
        l: usize,
        inp: &CpuTensor,
        g: Geometry,
        save: bool,
    ) -> Result<(CpuTensor, Option<BlockSaved>)> {
        let (c, nh) = (self.cfg.channels, self.cfg.heads);
        let hs = c / nh;
        let n = g.rows();
        let w = |off| self.w(layer_index(l, off));
        let x = self.view(inp)?;

        // Every allocation below is labelled for the profiler's tables and traces; the guards
        // shadow each other, so each label holds until the next one and all end with the block.
        let _t = self.tag(l, "ln1");
        let (ln1, ln1_mean, ln1_rstd) = self.block_layernorm(l, x.s()?, o::LN1_W, o::LN1_B, g)?;
        // qkv is only a stepping stone to q, k, v: workspace, dropped once split.
        let _t = self.tag(l, "attn.qkv");
        let mut qkv = self.scratch([g.b, g.t, 3 * c])?;
        matmul::forward(
            f32s_mut(&mut qkv)?,
            self.view(&ln1)?.s()?,
            w(o::QKV_W)?.s()?,
            Some(w(o::QKV_B)?.s()?),
            n,
            c,
            3 * c,
        );
        let mut q = self.fresh([g.b, nh, g.t, hs])?;
        let mut k = self.fresh([g.b, nh, g.t, hs])?;
        let mut v = self.fresh([g.b, nh, g.t, hs])?;
        split_heads(
            qkv.as_slice::<f32>()?,
            [f32s_mut(&mut q)?, f32s_mut(&mut k)?, f32s_mut(&mut v)?],
            g,
            nh,
            hs,
        );
        drop(qkv);
        let (q, k, v) = (self.keep(q)?, self.keep(k)?, self.keep(v)?);
        let _t = self.tag(l, "attn.out");
        let attn = {
            let (qv, kv, vv) = (self.view(&q)?, self.view(&k)?, self.view(&v)?);
            let out_cat = if self.opts.precision.is_low() {
                MemoryCategory::Workspace
            } else {
                MemoryCategory::Activations
            };
            let _g = out_cat.enter();
            let f = self.backend().attention_forward(
                qv.tensor(),
                kv.tensor(),
                vv.tensor(),
                &self.opts.attention,
            )?;
            AttentionForward {
                output: self.keep(f.output)?,
                ..f
            }
        };
        let _t = self.tag(l, "attn.proj");
        let mut atty = self.scratch([g.b, g.t, c])?;
        merge_heads(
            self.view(&attn.output)?.s()?,
            f32s_mut(&mut atty)?,
            g,
            nh,
            hs,
        );
        let mut res2 = self.fresh([g.b, g.t, c])?;
        matmul::forward(
            f32s_mut(&mut res2)?,
            atty.as_slice::<f32>()?,
            w(o::ATTN_PROJ_W)?.s()?,
            Some(w(o::ATTN_PROJ_B)?.s()?),
            n,
            c,
            c,
        );
        drop(atty);
        for (r, xi) in f32s_mut(&mut res2)?.iter_mut().zip(x.s()?) {
            *r += xi;
        }
        let res2 = self.keep(res2)?;
        let res2v = self.view(&res2)?;
        let _t = self.tag(l, "ln2");
        let (ln2, ln2_mean, ln2_rstd) =
            self.block_layernorm(l, res2v.s()?, o::LN2_W, o::LN2_B, g)?;
        let _t = self.tag(l, "mlp.fc");
        let mut fch = self.fresh([g.b, g.t, 4 * c])?;
        matmul::forward(
            f32s_mut(&mut fch)?,
            self.view(&ln2)?.s()?,
            w(o::FC_W)?.s()?,
            Some(w(o::FC_B)?.s()?),
            n,
            c,
            4 * c,
        );
        let fch = self.keep(fch)?;
        let _t = self.tag(l, "mlp.gelu");
        let fch_gelu = self.block_gelu(&fch)?;
        // The block output is the next block's input: the chain decides whether it is kept.
        let _t = self.tag(l, "mlp.proj");
        let mut out = self.fresh([g.b, g.t, c])?;
        matmul::forward(
            f32s_mut(&mut out)?,
            self.view(&fch_gelu)?.s()?,
            w(o::FC_PROJ_W)?.s()?,
            Some(w(o::FC_PROJ_B)?.s()?),
            n,
            4 * c,
            c,
        );
        for (y, r) in f32s_mut(&mut out)?.iter_mut().zip(res2v.s()?) {
            *y += r;
        }
        drop(res2v);
        let out = self.keep(out)?;
        if !save {
            return Ok((out, None));
        }
        let sel = self.opts.selective;
        let keep_unless_selective = |t: CpuTensor| if sel { None } else { Some(t) };
        let saved = BlockSaved {
            ln1: keep_unless_selective(ln1),
            ln1_mean,
            ln1_rstd,
            q,
            k,
            v,
            attn,
            res2,
            ln2: keep_unless_selective(ln2),
            ln2_mean,
            ln2_rstd,
            fch,
            fch_gelu: keep_unless_selective(fch_gelu),
        };
        Ok((out, Some(saved)))
    }

    /// Block `l` backward: accumulates parameter gradients into `grads` (the block's 12),
    /// returns the gradient of `inp`.
    pub fn block_backward(
        &self,
        l: usize,
        inp: &CpuTensor,
        s: BlockSaved,
        dout: &CpuTensor,
        grads: &mut [CpuTensor],
        g: Geometry,
    ) -> Result<CpuTensor> {
        let (c, nh) = (self.cfg.channels, self.cfg.heads);
        let hs = c / nh;
        let n = g.rows();
        let w = |off| self.w(layer_index(l, off));
        let x = self.view(inp)?;
        let res2v = self.view(&s.res2)?;
        // Selective recomputation: what forward dropped comes back, bit for bit, from what
        // it kept (the statistics are recomputed too and discarded).
        let _t = self.tag(l, "recompute");
        let ln1 = match s.ln1 {
            Some(t) => t,
            None => self.block_layernorm(l, x.s()?, o::LN1_W, o::LN1_B, g)?.0,
        };
        let ln2 = match s.ln2 {
            Some(t) => t,
            None => {
                self.block_layernorm(l, res2v.s()?, o::LN2_W, o::LN2_B, g)?
                    .0
            }
        };
        let fch_gelu = match s.fch_gelu {
            Some(t) => t,
            None => self.block_gelu(&s.fch)?,
        };

        // out = res2 + fcproj(fch_gelu): dres2 starts as dout, dfch_gelu from the projection.
        let _t = self.tag(l, "mlp.backward");
        let mut dfch_gelu = self.scratch([g.b, g.t, 4 * c])?;
        {
            let (dw, db) = two_mut(grads, o::FC_PROJ_W, o::FC_PROJ_B);
            matmul::backward(
                f32s_mut(&mut dfch_gelu)?,
                f32s_mut(dw)?,
                Some(f32s_mut(db)?),
                dout.as_slice::<f32>()?,
                self.view(&fch_gelu)?.s()?,
                w(o::FC_PROJ_W)?.s()?,
                n,
                4 * c,
                c,
            );
        }
        drop(fch_gelu);
        let mut dfch = self.scratch([g.b, g.t, 4 * c])?;
        gelu::backward(
            f32s_mut(&mut dfch)?,
            self.view(&s.fch)?.s()?,
            dfch_gelu.as_slice::<f32>()?,
        );
        drop(dfch_gelu);
        let mut dln2 = self.scratch([g.b, g.t, c])?;
        {
            let (dw, db) = two_mut(grads, o::FC_W, o::FC_B);
            matmul::backward(
                f32s_mut(&mut dln2)?,
                f32s_mut(dw)?,
                Some(f32s_mut(db)?),
                dfch.as_slice::<f32>()?,
                self.view(&ln2)?.s()?,
                w(o::FC_W)?.s()?,
                n,
                c,
                4 * c,
            );
        }
        drop((dfch, ln2));
        let _t = self.tag(l, "ln2.backward");
        let mut dres2 = self.scratch([g.b, g.t, c])?;
        f32s_mut(&mut dres2)?.copy_from_slice(dout.as_slice::<f32>()?);
        {
            let (dw, db) = two_mut(grads, o::LN2_W, o::LN2_B);
            layernorm::backward(
                f32s_mut(&mut dres2)?,
                f32s_mut(dw)?,
                f32s_mut(db)?,
                dln2.as_slice::<f32>()?,
                res2v.s()?,
                w(o::LN2_W)?.s()?,
                s.ln2_mean.as_slice::<f32>()?,
                s.ln2_rstd.as_slice::<f32>()?,
                c,
            );
        }
        drop((dln2, res2v));
        // res2 = inp + attproj(atty), atty = the attention output with heads merged.
        let _t = self.tag(l, "attn.backward");
        let mut atty = self.scratch([g.b, g.t, c])?;
        merge_heads(
            self.view(&s.attn.output)?.s()?,
            f32s_mut(&mut atty)?,
            g,
            nh,
            hs,
        );
        let mut datty = self.scratch([g.b, g.t, c])?;
        {
            let (dw, db) = two_mut(grads, o::ATTN_PROJ_W, o::ATTN_PROJ_B);
            matmul::backward(
                f32s_mut(&mut datty)?,
                f32s_mut(dw)?,
                Some(f32s_mut(db)?),
                dres2.as_slice::<f32>()?,
                atty.as_slice::<f32>()?,
                w(o::ATTN_PROJ_W)?.s()?,
                n,
                c,
                c,
            );
        }
        drop(atty);
        let mut dy = self.scratch([g.b, nh, g.t, hs])?;
        split_single(datty.as_slice::<f32>()?, f32s_mut(&mut dy)?, g, nh, hs);
        drop(datty);
        let ag = {
            let _g = MemoryCategory::Workspace.enter();
            let fwd = AttentionForward {
                output: self.to_f32_owned(s.attn.output)?,
                ..s.attn
            };
            let (qv, kv, vv) = (self.view(&s.q)?, self.view(&s.k)?, self.view(&s.v)?);
            self.backend()
                .attention_backward(qv.tensor(), kv.tensor(), vv.tensor(), &fwd, &dy)?
        };
        drop(dy);
        let mut dqkv = self.scratch([g.b, g.t, 3 * c])?;
        merge_qkv(
            [
                ag.dq.as_slice::<f32>()?,
                ag.dk.as_slice::<f32>()?,
                ag.dv.as_slice::<f32>()?,
            ],
            f32s_mut(&mut dqkv)?,
            g,
            nh,
            hs,
        );
        drop(ag);
        let _t = self.tag(l, "ln1.backward");
        let mut dln1 = self.scratch([g.b, g.t, c])?;
        {
            let (dw, db) = two_mut(grads, o::QKV_W, o::QKV_B);
            matmul::backward(
                f32s_mut(&mut dln1)?,
                f32s_mut(dw)?,
                Some(f32s_mut(db)?),
                dqkv.as_slice::<f32>()?,
                self.view(&ln1)?.s()?,
                w(o::QKV_W)?.s()?,
                n,
                c,
                3 * c,
            );
        }
        drop((dqkv, ln1));
        // The residual passes dres2 straight through to the block input.
        let mut dinp = dres2;
        {
            let (dw, db) = two_mut(grads, o::LN1_W, o::LN1_B);
            layernorm::backward(
                f32s_mut(&mut dinp)?,
                f32s_mut(dw)?,
                f32s_mut(db)?,
                dln1.as_slice::<f32>()?,
                x.s()?,
                w(o::LN1_W)?.s()?,
                s.ln1_mean.as_slice::<f32>()?,
                s.ln1_rstd.as_slice::<f32>()?,
                c,
            );
        }
        Ok(dinp)
    }
}

/// `[B, T, 3C]` → three `[B, NH, T, hs]`.
fn split_heads(qkv: &[f32], out: [&mut [f32]; 3], g: Geometry, nh: usize, hs: usize) {
    let c = nh * hs;
    let [q, k, v] = out;
    for b in 0..g.b {
        for t in 0..g.t {
            let row = &qkv[(b * g.t + t) * 3 * c..][..3 * c];
            for h in 0..nh {
                let dst = ((b * nh + h) * g.t + t) * hs;
                q[dst..dst + hs].copy_from_slice(&row[h * hs..][..hs]);
                k[dst..dst + hs].copy_from_slice(&row[c + h * hs..][..hs]);
                v[dst..dst + hs].copy_from_slice(&row[2 * c + h * hs..][..hs]);
            }
        }
    }
}

/// Three `[B, NH, T, hs]` → `[B, T, 3C]` (inverse of [`split_heads`]).
fn merge_qkv(parts: [&[f32]; 3], qkv: &mut [f32], g: Geometry, nh: usize, hs: usize) {
    let c = nh * hs;
    for b in 0..g.b {
        for t in 0..g.t {
            let row = &mut qkv[(b * g.t + t) * 3 * c..][..3 * c];
            for h in 0..nh {
                let src = ((b * nh + h) * g.t + t) * hs;
                for (p, part) in parts.iter().enumerate() {
                    row[p * c + h * hs..][..hs].copy_from_slice(&part[src..src + hs]);
                }
            }
        }
    }
}

/// `[B, NH, T, hs]` → `[B, T, C]`.
fn merge_heads(y: &[f32], out: &mut [f32], g: Geometry, nh: usize, hs: usize) {
    let c = nh * hs;
    for b in 0..g.b {
        for h in 0..nh {
            for t in 0..g.t {
                let src = ((b * nh + h) * g.t + t) * hs;
                out[(b * g.t + t) * c + h * hs..][..hs].copy_from_slice(&y[src..src + hs]);
            }
        }
    }
}

/// `[B, T, C]` → `[B, NH, T, hs]` (inverse of [`merge_heads`]).
fn split_single(x: &[f32], out: &mut [f32], g: Geometry, nh: usize, hs: usize) {
    let c = nh * hs;
    for b in 0..g.b {
        for h in 0..nh {
            for t in 0..g.t {
                let dst = ((b * nh + h) * g.t + t) * hs;
                out[dst..dst + hs].copy_from_slice(&x[(b * g.t + t) * c + h * hs..][..hs]);
            }
        }
    }
}
