//! GPT-2 forward and backward, written out op by op as llm.c does. Every activation kept for
//! backward is a named field of [`BlockActivations`] or [`HeadActivations`] with its shape
//! beside it, allocated in one place ([`Gpt::block_forward`], [`Gpt::head_forward`]) under
//! [`MemoryCategory::Activations`] so the tracker counts it.
//!
//! Notation: B batch, T sequence, C channels, NH heads, hs = C/NH, V vocab.

use headroom_attn::{AttentionBackend, AttentionConfig, AttentionForward};
use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory, Tensor};

use crate::model::params::{self, layer, layer_index, ln_f_index, WPE, WTE};
use crate::model::GptConfig;
use crate::ops::{cross_entropy, embedding, gelu, layernorm, matmul};
use crate::{Result, TrainError};

/// What one block keeps for its backward.
pub struct BlockActivations {
    /// `[B, T, C]` residual stream entering the block.
    pub inp: CpuTensor,
    /// `[B, T, C]` first layer norm.
    pub ln1: CpuTensor,
    /// `[B, T]` its mean.
    pub ln1_mean: CpuTensor,
    /// `[B, T]` its reciprocal standard deviation.
    pub ln1_rstd: CpuTensor,
    /// `[B, NH, T, hs]` queries, keys and values (the attention inputs, split from `ln1·Wqkvᵀ`).
    pub q: CpuTensor,
    /// `[B, NH, T, hs]`.
    pub k: CpuTensor,
    /// `[B, NH, T, hs]`.
    pub v: CpuTensor,
    /// Attention output `[B, NH, T, hs]` and its logsumexp `[B, NH, T]` (naive also keeps
    /// probabilities `[B, NH, T, T]`).
    pub attn: AttentionForward<CpuTensor>,
    /// `[B, T, C]` attention output with heads merged.
    pub atty: CpuTensor,
    /// `[B, T, C]` residual after attention.
    pub res2: CpuTensor,
    /// `[B, T, C]` second layer norm.
    pub ln2: CpuTensor,
    /// `[B, T]`.
    pub ln2_mean: CpuTensor,
    /// `[B, T]`.
    pub ln2_rstd: CpuTensor,
    /// `[B, T, 4C]` MLP pre-activation.
    pub fch: CpuTensor,
    /// `[B, T, 4C]` after GELU.
    pub fch_gelu: CpuTensor,
}

impl BlockActivations {
    /// Bytes this block keeps for backward.
    pub fn bytes(&self) -> usize {
        let t = [
            &self.inp,
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.q,
            &self.k,
            &self.v,
            &self.atty,
            &self.res2,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &self.fch_gelu,
        ];
        let a = &self.attn;
        t.iter().map(|t| t.size_in_bytes()).sum::<usize>()
            + a.output.size_in_bytes()
            + a.logsumexp.size_in_bytes()
            + a.probs.as_ref().map_or(0, |p| p.size_in_bytes())
    }
}

/// What the final layer norm, the tied head and the loss keep.
pub struct HeadActivations {
    /// `[B, T, C]` residual stream after the last block.
    pub residual: CpuTensor,
    /// `[B, T, C]` final layer norm.
    pub lnf: CpuTensor,
    /// `[B, T]`.
    pub lnf_mean: CpuTensor,
    /// `[B, T]`.
    pub lnf_rstd: CpuTensor,
    /// `[B, T, V]` logits.
    pub logits: CpuTensor,
    /// `[B, T]` per-token losses.
    pub losses: CpuTensor,
}

/// The batch geometry of one forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Sequences.
    pub b: usize,
    /// Tokens per sequence.
    pub t: usize,
}

/// A GPT-2 on the CPU backend: parameters and the attention algorithm.
pub struct Gpt {
    /// Shape.
    pub cfg: GptConfig,
    /// Parameters in [`params::param_infos`] order.
    pub params: Vec<CpuTensor>,
    /// Attention algorithm (causal is forced on).
    pub attention: AttentionConfig,
    cpu: Cpu,
}

fn f32s(t: &CpuTensor) -> Result<&[f32]> {
    Ok(t.as_slice::<f32>()?)
}
fn f32s_mut(t: &mut CpuTensor) -> Result<&mut [f32]> {
    Ok(t.as_mut_slice::<f32>()?)
}

impl Gpt {
    /// A freshly initialised model.
    pub fn new(cpu: &Cpu, cfg: GptConfig, attention: AttentionConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let params = params::init_params(cpu, &cfg, seed)?;
        Ok(Gpt {
            cfg,
            params,
            attention: attention.causal(true),
            cpu: cpu.clone(),
        })
    }

    /// The backend.
    pub fn backend(&self) -> &Cpu {
        &self.cpu
    }

    fn p(&self, i: usize) -> Result<&[f32]> {
        f32s(&self.params[i])
    }

    fn act(&self, shape: impl Into<headroom_tensor::Shape>) -> Result<CpuTensor> {
        let _g = MemoryCategory::Activations.enter();
        Ok(self.cpu.zeros(shape, DType::F32)?)
    }

    fn work(&self, shape: impl Into<headroom_tensor::Shape>) -> Result<CpuTensor> {
        let _g = MemoryCategory::Workspace.enter();
        Ok(self.cpu.zeros(shape, DType::F32)?)
    }

    /// Check tokens and targets: `[B, T]` ids below the vocab, `T ≤ max_seq`.
    pub fn check_batch(&self, tokens: &[u32], targets: &[u32], g: Geometry) -> Result<()> {
        let n = g.b * g.t;
        if g.t == 0 || g.t > self.cfg.max_seq {
            return Err(TrainError::Input(format!(
                "sequence length {} not in 1..={}",
                g.t, self.cfg.max_seq
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
            .find(|&&t| t as usize >= self.cfg.vocab)
        {
            return Err(TrainError::Input(format!(
                "token id {bad} ≥ vocab {}",
                self.cfg.vocab
            )));
        }
        Ok(())
    }

    /// Token + position embeddings: `[B, T, C]`.
    pub fn embed(&self, tokens: &[u32], g: Geometry) -> Result<CpuTensor> {
        let c = self.cfg.channels;
        let mut out = self.act([g.b, g.t, c])?;
        embedding::forward(
            f32s_mut(&mut out)?,
            tokens,
            self.p(WTE)?,
            self.p(WPE)?,
            g.t,
            c,
        );
        Ok(out)
    }

    /// Block `l` forward: returns the output residual `[B, T, C]` and what backward needs.
    pub fn block_forward(
        &self,
        l: usize,
        inp: CpuTensor,
        g: Geometry,
    ) -> Result<(CpuTensor, BlockActivations)> {
        let (c, nh) = (self.cfg.channels, self.cfg.heads);
        let hs = c / nh;
        let n = g.b * g.t;
        let w = |o| self.p(layer_index(l, o));

        let mut ln1 = self.act([g.b, g.t, c])?;
        let mut ln1_mean = self.act([g.b, g.t])?;
        let mut ln1_rstd = self.act([g.b, g.t])?;
        layernorm::forward(
            f32s_mut(&mut ln1)?,
            f32s_mut(&mut ln1_mean)?,
            f32s_mut(&mut ln1_rstd)?,
            f32s(&inp)?,
            w(layer::LN1_W)?,
            w(layer::LN1_B)?,
            c,
        );
        // qkv is only a stepping stone to q, k, v: workspace, dropped at the end of forward.
        let mut qkv = self.work([g.b, g.t, 3 * c])?;
        matmul::forward(
            f32s_mut(&mut qkv)?,
            f32s(&ln1)?,
            w(layer::QKV_W)?,
            Some(w(layer::QKV_B)?),
            n,
            c,
            3 * c,
        );
        let mut q = self.act([g.b, nh, g.t, hs])?;
        let mut k = self.act([g.b, nh, g.t, hs])?;
        let mut v = self.act([g.b, nh, g.t, hs])?;
        split_heads(
            f32s(&qkv)?,
            [f32s_mut(&mut q)?, f32s_mut(&mut k)?, f32s_mut(&mut v)?],
            g,
            nh,
            hs,
        );
        drop(qkv);
        let attn = {
            let _g = MemoryCategory::Activations.enter();
            self.cpu.attention_forward(&q, &k, &v, &self.attention)?
        };
        let mut atty = self.act([g.b, g.t, c])?;
        merge_heads(f32s(&attn.output)?, f32s_mut(&mut atty)?, g, nh, hs);
        let mut res2 = self.act([g.b, g.t, c])?;
        matmul::forward(
            f32s_mut(&mut res2)?,
            f32s(&atty)?,
            w(layer::ATTN_PROJ_W)?,
            Some(w(layer::ATTN_PROJ_B)?),
            n,
            c,
            c,
        );
        for (r, x) in f32s_mut(&mut res2)?.iter_mut().zip(f32s(&inp)?) {
            *r += x;
        }
        let mut ln2 = self.act([g.b, g.t, c])?;
        let mut ln2_mean = self.act([g.b, g.t])?;
        let mut ln2_rstd = self.act([g.b, g.t])?;
        layernorm::forward(
            f32s_mut(&mut ln2)?,
            f32s_mut(&mut ln2_mean)?,
            f32s_mut(&mut ln2_rstd)?,
            f32s(&res2)?,
            w(layer::LN2_W)?,
            w(layer::LN2_B)?,
            c,
        );
        let mut fch = self.act([g.b, g.t, 4 * c])?;
        matmul::forward(
            f32s_mut(&mut fch)?,
            f32s(&ln2)?,
            w(layer::FC_W)?,
            Some(w(layer::FC_B)?),
            n,
            c,
            4 * c,
        );
        let mut fch_gelu = self.act([g.b, g.t, 4 * c])?;
        gelu::forward(f32s_mut(&mut fch_gelu)?, f32s(&fch)?);
        // The block output is the next block's input: an activation it keeps.
        let mut out = self.act([g.b, g.t, c])?;
        matmul::forward(
            f32s_mut(&mut out)?,
            f32s(&fch_gelu)?,
            w(layer::FC_PROJ_W)?,
            Some(w(layer::FC_PROJ_B)?),
            n,
            4 * c,
            c,
        );
        for (o, r) in f32s_mut(&mut out)?.iter_mut().zip(f32s(&res2)?) {
            *o += r;
        }
        let saved = BlockActivations {
            inp,
            ln1,
            ln1_mean,
            ln1_rstd,
            q,
            k,
            v,
            attn,
            atty,
            res2,
            ln2,
            ln2_mean,
            ln2_rstd,
            fch,
            fch_gelu,
        };
        Ok((out, saved))
    }

    /// Block `l` backward: accumulates parameter gradients into `grads`, returns `dinp`.
    pub fn block_backward(
        &self,
        l: usize,
        dout: CpuTensor,
        s: BlockActivations,
        grads: &mut [CpuTensor],
        g: Geometry,
    ) -> Result<CpuTensor> {
        let (c, nh) = (self.cfg.channels, self.cfg.heads);
        let hs = c / nh;
        let n = g.b * g.t;
        let w = |o| self.p(layer_index(l, o));
        let gi = |o| layer_index(l, o);

        // out = res2 + fcproj(fch_gelu): dres2 starts as dout, dfch_gelu from the projection.
        let mut dfch_gelu = self.work([g.b, g.t, 4 * c])?;
        {
            let (dw, db) = two_mut(grads, gi(layer::FC_PROJ_W), gi(layer::FC_PROJ_B));
            matmul::backward(
                f32s_mut(&mut dfch_gelu)?,
                f32s_mut(dw)?,
                Some(f32s_mut(db)?),
                f32s(&dout)?,
                f32s(&s.fch_gelu)?,
                w(layer::FC_PROJ_W)?,
                n,
                4 * c,
                c,
            );
        }
        let mut dfch = self.work([g.b, g.t, 4 * c])?;
        gelu::backward(f32s_mut(&mut dfch)?, f32s(&s.fch)?, f32s(&dfch_gelu)?);
        drop(dfch_gelu);
        let mut dln2 = self.work([g.b, g.t, c])?;
        {
            let (dw, db) = two_mut(grads, gi(layer::FC_W), gi(layer::FC_B));
            matmul::backward(
                f32s_mut(&mut dln2)?,
                f32s_mut(dw)?,
                Some(f32s_mut(db)?),
                f32s(&dfch)?,
                f32s(&s.ln2)?,
                w(layer::FC_W)?,
                n,
                c,
                4 * c,
            );
        }
        drop(dfch);
        let mut dres2 = dout; // reuse the incoming gradient buffer as the residual's gradient
        {
            let (dw, db) = two_mut(grads, gi(layer::LN2_W), gi(layer::LN2_B));
            layernorm::backward(
                f32s_mut(&mut dres2)?,
                f32s_mut(dw)?,
                f32s_mut(db)?,
                f32s(&dln2)?,
                f32s(&s.res2)?,
                w(layer::LN2_W)?,
                f32s(&s.ln2_mean)?,
                f32s(&s.ln2_rstd)?,
                c,
            );
        }
        drop(dln2);
        // res2 = inp + attproj(atty).
        let mut datty = self.work([g.b, g.t, c])?;
        {
            let (dw, db) = two_mut(grads, gi(layer::ATTN_PROJ_W), gi(layer::ATTN_PROJ_B));
            matmul::backward(
                f32s_mut(&mut datty)?,
                f32s_mut(dw)?,
                Some(f32s_mut(db)?),
                f32s(&dres2)?,
                f32s(&s.atty)?,
                w(layer::ATTN_PROJ_W)?,
                n,
                c,
                c,
            );
        }
        let mut dy = self.work([g.b, nh, g.t, hs])?;
        split_single(f32s(&datty)?, f32s_mut(&mut dy)?, g, nh, hs);
        drop(datty);
        let ag = {
            let _g = MemoryCategory::Workspace.enter();
            self.cpu
                .attention_backward(&s.q, &s.k, &s.v, &s.attn, &dy)?
        };
        drop(dy);
        let mut dqkv = self.work([g.b, g.t, 3 * c])?;
        merge_qkv(
            [f32s(&ag.dq)?, f32s(&ag.dk)?, f32s(&ag.dv)?],
            f32s_mut(&mut dqkv)?,
            g,
            nh,
            hs,
        );
        drop(ag);
        let mut dln1 = self.work([g.b, g.t, c])?;
        {
            let (dw, db) = two_mut(grads, gi(layer::QKV_W), gi(layer::QKV_B));
            matmul::backward(
                f32s_mut(&mut dln1)?,
                f32s_mut(dw)?,
                Some(f32s_mut(db)?),
                f32s(&dqkv)?,
                f32s(&s.ln1)?,
                w(layer::QKV_W)?,
                n,
                c,
                3 * c,
            );
        }
        drop(dqkv);
        // The residual passes dres2 straight through to the block input.
        let mut dinp = dres2;
        {
            let (dw, db) = two_mut(grads, gi(layer::LN1_W), gi(layer::LN1_B));
            layernorm::backward(
                f32s_mut(&mut dinp)?,
                f32s_mut(dw)?,
                f32s_mut(db)?,
                f32s(&dln1)?,
                f32s(&s.inp)?,
                w(layer::LN1_W)?,
                f32s(&s.ln1_mean)?,
                f32s(&s.ln1_rstd)?,
                c,
            );
        }
        Ok(dinp)
    }

    /// Final layer norm, tied head and loss: returns the mean loss over the batch.
    pub fn head_forward(
        &self,
        residual: CpuTensor,
        targets: &[u32],
        g: Geometry,
    ) -> Result<(f32, HeadActivations)> {
        let (c, v) = (self.cfg.channels, self.cfg.vocab);
        let n = g.b * g.t;
        let lf = ln_f_index(&self.cfg);
        let mut lnf = self.act([g.b, g.t, c])?;
        let mut lnf_mean = self.act([g.b, g.t])?;
        let mut lnf_rstd = self.act([g.b, g.t])?;
        layernorm::forward(
            f32s_mut(&mut lnf)?,
            f32s_mut(&mut lnf_mean)?,
            f32s_mut(&mut lnf_rstd)?,
            f32s(&residual)?,
            self.p(lf)?,
            self.p(lf + 1)?,
            c,
        );
        let mut logits = self.act([g.b, g.t, v])?;
        matmul::forward(
            f32s_mut(&mut logits)?,
            f32s(&lnf)?,
            self.p(WTE)?,
            None,
            n,
            c,
            v,
        );
        let mut losses = self.act([g.b, g.t])?;
        cross_entropy::forward(f32s_mut(&mut losses)?, f32s(&logits)?, targets, v);
        let mean = f32s(&losses)?.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        Ok((
            mean as f32,
            HeadActivations {
                residual,
                lnf,
                lnf_mean,
                lnf_rstd,
                logits,
                losses,
            },
        ))
    }

    /// Backward of [`Gpt::head_forward`] for `loss = Σ losses · dloss_per_token`; returns the
    /// gradient of the residual stream `[B, T, C]`.
    pub fn head_backward(
        &self,
        h: HeadActivations,
        targets: &[u32],
        dloss_per_token: f32,
        grads: &mut [CpuTensor],
        g: Geometry,
    ) -> Result<CpuTensor> {
        let (c, v) = (self.cfg.channels, self.cfg.vocab);
        let n = g.b * g.t;
        let lf = ln_f_index(&self.cfg);
        let dloss = vec![dloss_per_token; n];
        let mut dlogits = self.work([g.b, g.t, v])?;
        cross_entropy::backward(
            f32s_mut(&mut dlogits)?,
            f32s(&h.logits)?,
            targets,
            &dloss,
            v,
        );
        drop(h.logits);
        let mut dlnf = self.work([g.b, g.t, c])?;
        // The tied head accumulates into wte's gradient; it has no bias.
        matmul::backward(
            f32s_mut(&mut dlnf)?,
            f32s_mut(&mut grads[WTE])?,
            None,
            f32s(&dlogits)?,
            f32s(&h.lnf)?,
            self.p(WTE)?,
            n,
            c,
            v,
        );
        drop(dlogits);
        let mut dres = self.work([g.b, g.t, c])?;
        let (dw, db) = two_mut(grads, lf, lf + 1);
        layernorm::backward(
            f32s_mut(&mut dres)?,
            f32s_mut(dw)?,
            f32s_mut(db)?,
            f32s(&dlnf)?,
            f32s(&h.residual)?,
            self.p(lf)?,
            f32s(&h.lnf_mean)?,
            f32s(&h.lnf_rstd)?,
            c,
        );
        Ok(dres)
    }

    /// Embedding backward.
    pub fn embed_backward(
        &self,
        dres: &CpuTensor,
        tokens: &[u32],
        grads: &mut [CpuTensor],
        g: Geometry,
    ) -> Result<()> {
        let (dwte, dwpe) = two_mut(grads, WTE, WPE);
        embedding::backward(
            f32s_mut(dwte)?,
            f32s_mut(dwpe)?,
            f32s(dres)?,
            tokens,
            g.t,
            self.cfg.channels,
        );
        Ok(())
    }

    /// Mean loss of a batch, forward only (activations are dropped as soon as possible).
    pub fn loss(&self, tokens: &[u32], targets: &[u32], g: Geometry) -> Result<f32> {
        self.check_batch(tokens, targets, g)?;
        let mut x = self.embed(tokens, g)?;
        for l in 0..self.cfg.layers {
            x = self.block_forward(l, x, g)?.0;
        }
        Ok(self.head_forward(x, targets, g)?.0)
    }

    /// Forward and backward of a whole batch, storing every activation: returns the mean loss
    /// and accumulates `grads` (of the mean loss times `loss_weight`).
    pub fn forward_backward(
        &self,
        tokens: &[u32],
        targets: &[u32],
        g: Geometry,
        grads: &mut [CpuTensor],
        loss_weight: f32,
    ) -> Result<f32> {
        self.check_batch(tokens, targets, g)?;
        let mut x = self.embed(tokens, g)?;
        let mut saved = Vec::with_capacity(self.cfg.layers);
        for l in 0..self.cfg.layers {
            let (y, s) = self.block_forward(l, x, g)?;
            saved.push(s);
            x = y;
        }
        let (loss, head) = self.head_forward(x, targets, g)?;
        let mut d =
            self.head_backward(head, targets, loss_weight / (g.b * g.t) as f32, grads, g)?;
        for l in (0..self.cfg.layers).rev() {
            let s = saved
                .pop()
                .ok_or_else(|| TrainError::Input("activation stack underflow".into()))?;
            d = self.block_backward(l, d, s, grads, g)?;
        }
        self.embed_backward(&d, tokens, grads, g)?;
        Ok(loss)
    }
}

/// Two distinct mutable elements of a slice.
fn two_mut<T>(v: &mut [T], i: usize, j: usize) -> (&mut T, &mut T) {
    debug_assert!(i < j);
    let (a, b) = v.split_at_mut(j);
    (&mut a[i], &mut b[0])
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
