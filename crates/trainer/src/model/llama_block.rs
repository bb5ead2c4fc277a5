//! The Llama block: RMSNorm, attention with rotary positions and grouped-query heads, RMSNorm,
//! SwiGLU MLP, no biases — forward (keeping [`LlamaSaved`]) and backward, written once over
//! [`ModelOps`]. Transformers' `LlamaDecoderLayer` computes the same function; its classes'
//! variations are here too: Qwen2's q/k/v biases, Qwen3's RMSNorm of each query and key
//! head before the rotation, SmolLM3's blocks without the rotation, and Gemma 3's
//! (`Gemma3DecoderLayer`): Qwen3's head norms, a norm of the attention's and of the MLP's
//! output before each residual addition, a GELU gate, its own rotary base in windowed blocks
//! (the `1 + w` gains are the norm op's); OLMo 2's (`Olmo2DecoderLayer`): Gemma's output norms
//! without the input norms — each sublayer reads the residual stream itself and its input
//! gradient adds straight into the residual's — and query/key norms over the whole
//! projections, before the split into heads.
//!
//! As in the GPT-2 block, every kept tensor is rounded to the storage precision as soon as it
//! is computed and every later reader reads the rounded values, so checkpointed gradients
//! equal stored ones bit for bit. The rotation is applied in f32 to the projection's output
//! and the rotated q, k are what is kept (attention's backward needs them).

use headroom_attn::{AttentionForward, DocumentMask};
use headroom_tensor::{CpuTensor, Tensor};

use crate::model::decode::LayerKv;
use crate::model::gpt2_block::at;
use crate::model::ops::ModelOps;
use crate::model::params::llama_layer as o;
use crate::model::transformer::{BlockOutput, Documents, Geometry, Model, NormStats};
use crate::model::{Family, MlpGate, QkNorm};
use crate::ops::rope::Rope;
use crate::{Result, TrainError};

/// What one Llama block keeps for its backward, besides its input. Low-precision modes keep
/// these in bf16/f16, except the f32 statistics and log-sum-exp.
pub struct LlamaSaved<T = CpuTensor> {
    /// `[B, T, C]` input RMSNorm (`None` under selective recomputation, and for OLMo 2,
    /// which has no input norms).
    pub norm1: Option<T>,
    /// `[B, T]` f32 its reciprocal root mean square (`None` for OLMo 2).
    pub norm1_stats: Option<NormStats<T>>,
    /// `[B, NH, T, hs]` queries after the rotary embedding.
    pub q: T,
    /// `[B, KV, T, hs]` keys after the rotary embedding.
    pub k: T,
    /// Qwen3's per-head norm of the queries: its `[B, NH, T, hs]` input and `[B, NH, T]`
    /// statistics; OLMo 2's norm of the query projection: `[B, T, NH·hs]` and `[B, T]`
    /// (`None` without query/key norms).
    pub q_norm: Option<KeptNorm<T>>,
    /// The keys' norm: `[B, KV, T, hs]` and `[B, KV, T]`, or OLMo 2's `[B, T, KV·hs]` and
    /// `[B, T]`.
    pub k_norm: Option<KeptNorm<T>>,
    /// `[B, KV, T, hs]` values.
    pub v: T,
    /// Attention output `[B, NH, T, hs]`, logsumexp `[B, NH, T]` f32 (and naive attention's
    /// probabilities `[B, NH, T, T]` f32).
    pub attn: AttentionForward<T>,
    /// `[B, T, C]` residual after attention.
    pub res2: T,
    /// `[B, T, C]` the MLP's input RMSNorm (`None` under selective recomputation, and for
    /// OLMo 2).
    pub norm2: Option<T>,
    /// `[B, T]` f32 its reciprocal root mean square (`None` for OLMo 2).
    pub norm2_stats: Option<NormStats<T>>,
    /// `[B, T, F]` gate projection (SiLU's input).
    pub gate: T,
    /// `[B, T, F]` up projection.
    pub up: T,
    /// `[B, T, F]` `act(gate) · up`, the down projection's input (`None` under selective
    /// recomputation).
    pub act: Option<T>,
    /// Gemma 3's and OLMo 2's norm of the attention's output: the `[B, T, C]` o_proj output
    /// it normalised and its statistics (`None` without output norms).
    pub attn_out_norm: Option<KeptNorm<T>>,
    /// The norm of the MLP's output: the `[B, T, C]` down projection's output and its
    /// statistics.
    pub mlp_out_norm: Option<KeptNorm<T>>,
}

/// What an RMSNorm whose input is not otherwise kept keeps for its backward: that input
/// (storage precision) and its f32 reciprocal root mean squares — a query or key head norm's
/// `[B, H, T, hs]` heads and `[B, H, T]` statistics, a projection norm's `[B, T, H·hs]` and
/// `[B, T]`, an output norm's `[B, T, C]` and `[B, T]`.
pub struct KeptNorm<T = CpuTensor> {
    /// The norm's input.
    pub input: T,
    /// f32 reciprocal root mean squares, one per row of the input.
    pub stats: NormStats<T>,
}

/// A kept result and what its norm keeps, when it has one: rotated queries or keys and their
/// norm's (Qwen3's, Gemma 3's, OLMo 2's), a residual sum and its sublayer's output norm (Gemma
/// 3's, OLMo 2's).
type WithNorm<T> = (T, Option<KeptNorm<T>>);

/// A sublayer's input norm and its statistics, or neither without input norms (OLMo 2).
type SublayerInput<T> = (Option<T>, Option<NormStats<T>>);

impl<T: Tensor> KeptNorm<T> {
    fn size_in_bytes(&self) -> usize {
        self.input.size_in_bytes() + self.stats.size_in_bytes()
    }
}

impl<T: Tensor> headroom_ckpt::SavedState for LlamaSaved<T> {
    fn size_in_bytes(&self) -> usize {
        let opt = |t: &Option<T>| t.as_ref().map_or(0, |t| t.size_in_bytes());
        let head_norm = |n: &Option<KeptNorm<T>>| n.as_ref().map_or(0, KeptNorm::size_in_bytes);
        let a = &self.attn;
        [
            &self.q,
            &self.k,
            &self.v,
            &self.res2,
            &self.gate,
            &self.up,
            &a.output,
            &a.logsumexp,
        ]
        .iter()
        .map(|t| t.size_in_bytes())
        .sum::<usize>()
            + self
                .norm1_stats
                .as_ref()
                .map_or(0, NormStats::size_in_bytes)
            + self
                .norm2_stats
                .as_ref()
                .map_or(0, NormStats::size_in_bytes)
            + opt(&self.norm1)
            + opt(&self.norm2)
            + opt(&self.act)
            + opt(&a.probs)
            + head_norm(&self.q_norm)
            + head_norm(&self.k_norm)
            + head_norm(&self.attn_out_norm)
            + head_norm(&self.mlp_out_norm)
    }
}

impl<B: ModelOps> Model<B> {
    /// Rotary embedding of `x` `[B, H, T, hs]` at positions `pos0 ..` of every row, or at the
    /// packed documents' own positions.
    fn rope(
        &self,
        x: &mut B::Tensor,
        rope: Rope,
        pos0: usize,
        g: Geometry<'_>,
        inverse: bool,
    ) -> Result<()> {
        match g.positions() {
            Some(positions) => self.backend().rope_at(x, rope, positions, inverse),
            None => self.backend().rope(x, rope, pos0, inverse),
        }
    }

    /// RMSNorm of `x` with block `l`'s gain at `w_off`: the output (kept in the storage
    /// precision) and its f32 statistics.
    fn block_rmsnorm(
        &self,
        bw: &[B::Tensor],
        x: &B::Tensor,
        w_off: usize,
        g: Geometry<'_>,
    ) -> Result<(B::Tensor, NormStats<B::Tensor>)> {
        let mut out = self.fresh_overwritten([g.b, g.t, self.cfg.channels])?;
        let stats = self.norm(&mut out, x, at(bw, w_off)?, None, g)?;
        Ok((self.keep(out)?, stats))
    }

    /// What a sublayer reads from the residual stream `x`: its RMSNorm with the gain at
    /// `w_off` (kept) and the norm's statistics, or nothing for a class without input norms
    /// (OLMo 2's sublayers read `x` itself).
    fn sublayer_input(
        &self,
        bw: &[B::Tensor],
        x: &B::Tensor,
        w_off: usize,
        g: Geometry<'_>,
    ) -> Result<SublayerInput<B::Tensor>> {
        if !self.input_norms() {
            return Ok((None, None));
        }
        let (out, stats) = self.block_rmsnorm(bw, x, w_off, g)?;
        Ok((Some(out), Some(stats)))
    }

    /// Granite's residual multiplier, unless it is 1.
    fn residual_scale(&self) -> Option<f32> {
        match self.cfg.family {
            Family::Llama(s) => s.residual_scale(),
            Family::Gpt2 => None,
        }
    }

    /// Whether the sublayers normalise their inputs (all but OLMo 2 and 3).
    fn input_norms(&self) -> bool {
        match self.cfg.family {
            Family::Llama(s) => s.input_norms(),
            Family::Gpt2 => true,
        }
    }

    /// The offsets of the attention's and the MLP's output norms ([`o::attn_out_norm`]).
    fn output_norm_offsets(&self) -> (usize, usize) {
        match self.cfg.family {
            Family::Llama(s) => (o::attn_out_norm(&s), o::mlp_out_norm(&s)),
            Family::Gpt2 => (o::ATTN_OUT_NORM, o::MLP_OUT_NORM),
        }
    }

    /// The MLP's gate, SiLU (SwiGLU) or Gemma's GELU (GeGLU).
    fn mlp_gate(&self) -> MlpGate {
        match self.cfg.family {
            Family::Llama(s) => s.mlp_gate(),
            Family::Gpt2 => MlpGate::Silu,
        }
    }

    /// `act(gate) · up` of the kept projections, kept.
    fn block_gated(&self, gate: &B::Tensor, up: &B::Tensor) -> Result<B::Tensor> {
        let mut out = self.fresh_overwritten(gate.shape().clone())?;
        self.backend().gated(&mut out, gate, up, self.mlp_gate())?;
        self.keep(out)
    }

    /// A sublayer's output `y` `[B, T, C]` (f32, fresh) added to the residual stream
    /// `residual`, kept: with Gemma's output norms, `residual + norm(y)` with the gain at
    /// `norm_off`, `y` kept first for the norm's backward; with Granite's residual multiplier
    /// `m`, `residual + y·m` (transformers' order: the product rounded, then the sum).
    fn add_to_residual(
        &self,
        bw: &[B::Tensor],
        mut y: B::Tensor,
        residual: &B::Tensor,
        norm_off: usize,
        g: Geometry<'_>,
    ) -> Result<WithNorm<B::Tensor>> {
        let output_norms = matches!(self.cfg.family, Family::Llama(s) if s.output_norms());
        if !output_norms {
            if let Some(m) = self.residual_scale() {
                self.backend().scale(&mut y, m)?;
            }
            self.backend().axpy(1.0, residual, &mut y)?;
            return Ok((self.keep(y)?, None));
        }
        if self.residual_scale().is_some() {
            return Err(TrainError::Config(
                "a residual multiplier with output norms (no class has both)".into(),
            ));
        }
        let input = self.keep(y)?;
        let (mut out, stats) = {
            let mut out = self.fresh_overwritten([g.b, g.t, self.cfg.channels])?;
            let stats = self.norm(&mut out, &input, at(bw, norm_off)?, None, g)?;
            (out, stats)
        };
        self.backend().axpy(1.0, residual, &mut out)?;
        Ok((self.keep(out)?, Some(KeptNorm { input, stats })))
    }

    /// The gradient that reaches a sublayer's output from `dres`, its residual sum's: itself,
    /// Granite's `dres · m` (a scratch copy: `dres` goes on to the block's input), or through
    /// Gemma's output norm (gain at `norm_off`, its gradient into `grads`).
    fn output_norm_backward<'a>(
        &self,
        grads: &mut [B::Tensor],
        bw: &[B::Tensor],
        dres: &'a B::Tensor,
        norm: Option<&KeptNorm<B::Tensor>>,
        norm_off: usize,
    ) -> Result<crate::model::transformer::View<'a, B::Tensor>> {
        let Some(n) = norm else {
            let Some(m) = self.residual_scale() else {
                return Ok(crate::model::transformer::View::Borrowed(dres));
            };
            let mut scaled = self.scratch_overwritten(dres.shape().clone())?;
            self.backend().copy(dres, &mut scaled)?;
            self.backend().scale(&mut scaled, m)?;
            return Ok(crate::model::transformer::View::Owned(scaled));
        };
        let mut dy = self.scratch(dres.shape().clone())?;
        self.norm_backward(
            &mut dy,
            self.param_grads(grads, norm_off, None).0,
            None,
            dres,
            &n.input,
            at(bw, norm_off)?,
            &n.stats,
        )?;
        Ok(crate::model::transformer::View::Owned(dy))
    }

    /// `x·Wᵀ` for block `l`'s projection `w_off`, split into `heads` heads `[B, heads, T, hs]`
    /// (f32, not yet kept): the projection's `[B, T, heads·hs]` output is workspace.
    fn project_heads(
        &self,
        l: usize,
        bw: &[B::Tensor],
        x: &B::Tensor,
        w_off: usize,
        heads: usize,
        g: Geometry<'_>,
    ) -> Result<B::Tensor> {
        let hs = self.cfg.head_dim();
        let mut flat = self.scratch_overwritten([g.b, g.t, heads * hs])?;
        self.block_linear(l, bw, w_off, self.qkv_bias_offset(w_off), &mut flat, x)?;
        let mut out = self.fresh_overwritten([g.b, heads, g.t, hs])?;
        self.backend().split_heads(&mut out, &flat, 0)?;
        Ok(out)
    }

    /// Queries or keys: `x` projected by `w_off` into `heads` heads, RMS-normalised with the
    /// gain at `norm_off` when the class has query/key norms (each head: Qwen3, Gemma 3; the
    /// whole projection before the split: OLMo 2), rotated by `rope` from position `pos0`
    /// (`None`: one of SmolLM3's NoPE blocks), kept. With the norm, its kept input and
    /// statistics come back for the backward.
    #[allow(clippy::too_many_arguments)]
    fn rotated_heads(
        &self,
        l: usize,
        bw: &[B::Tensor],
        x: &B::Tensor,
        (w_off, norm_off): (usize, usize),
        heads: usize,
        rope: Option<Rope>,
        pos0: usize,
        g: Geometry<'_>,
    ) -> Result<WithNorm<B::Tensor>> {
        let (mut rotated, norm) = match self.cfg.family {
            Family::Llama(s) if s.qk_norm_kind() == Some(QkNorm::Projection) => {
                self.projection_normed_heads(l, bw, x, (w_off, norm_off), heads, g)?
            }
            Family::Llama(s) if s.qk_norm() => {
                let projected = self.project_heads(l, bw, x, w_off, heads, g)?;
                // Kept before the norm reads it, so a recomputed or stored backward sees the
                // values the forward normalised. Keeping it costs B·T·(NH + KV)·hs elements
                // per block; the alternative, recovering it from the kept rotated output,
                // would divide by the gain (and by its bf16 rounding) or recompute the
                // projection's GEMM.
                let input = self.keep(projected)?;
                let mut rstd = self.stat([g.b, heads, g.t])?;
                let mut out = self.fresh_overwritten(input.shape().clone())?;
                self.backend().rmsnorm(
                    &mut out,
                    &mut rstd,
                    &input,
                    at(bw, norm_off)?,
                    s.rms_norm(),
                )?;
                let stats = NormStats { mean: None, rstd };
                (out, Some(KeptNorm { input, stats }))
            }
            _ => (self.project_heads(l, bw, x, w_off, heads, g)?, None),
        };
        // SmolLM3's NoPE blocks attend without positions.
        if let Some(rope) = rope {
            self.rope(&mut rotated, rope, pos0, g, false)?;
        }
        Ok((self.keep(rotated)?, norm))
    }

    /// OLMo 2's queries or keys before the rotation: the projection's `[B, T, heads·hs]`
    /// output is kept as the norm's input (fresh), the norm's output is workspace until it is
    /// split into `[B, heads, T, hs]` heads (fresh, not yet kept).
    fn projection_normed_heads(
        &self,
        l: usize,
        bw: &[B::Tensor],
        x: &B::Tensor,
        (w_off, norm_off): (usize, usize),
        heads: usize,
        g: Geometry<'_>,
    ) -> Result<WithNorm<B::Tensor>> {
        let hs = self.cfg.head_dim();
        let mut projected = self.fresh_overwritten([g.b, g.t, heads * hs])?;
        let bias = self.qkv_bias_offset(w_off);
        self.block_linear(l, bw, w_off, bias, &mut projected, x)?;
        let input = self.keep(projected)?;
        let mut normed = self.scratch_overwritten([g.b, g.t, heads * hs])?;
        let stats = self.norm(&mut normed, &input, at(bw, norm_off)?, None, g)?;
        let mut split = self.fresh_overwritten([g.b, heads, g.t, hs])?;
        self.backend().split_heads(&mut split, &normed, 0)?;
        Ok((split, Some(KeptNorm { input, stats })))
    }

    /// The backward of [`Model::rotated_heads`]' norm, when there is one: `dh`, the gradient
    /// of the normalised heads, becomes that of the projection's — `[B, H, T, hs]` after a
    /// per-head norm, `[B, T, H·hs]` after OLMo 2's projection norm; the gain's gradient
    /// accumulates into `grads`.
    fn head_norm_backward(
        &self,
        grads: &mut [B::Tensor],
        bw: &[B::Tensor],
        dh: B::Tensor,
        norm: Option<&KeptNorm<B::Tensor>>,
        norm_off: usize,
    ) -> Result<B::Tensor> {
        let Some(n) = norm else {
            return Ok(dh);
        };
        // OLMo 2's norm read the projection before the split: the heads' gradient is merged
        // back first (replacing dh, so no more is live than a per-head norm's backward holds).
        let dy = if n.input.shape().dims().len() == 3 {
            let mut merged = self.scratch_overwritten(n.input.shape().clone())?;
            self.backend().merge_heads(&mut merged, &dh, 0)?;
            drop(dh);
            merged
        } else {
            dh
        };
        let mut dinput = self.scratch(dy.shape().clone())?;
        self.norm_backward(
            &mut dinput,
            self.param_grads(grads, norm_off, None).0,
            None,
            &dy,
            &n.input,
            at(bw, norm_off)?,
            &n.stats,
        )?;
        Ok(dinput)
    }

    /// What block `l`'s attention sees when it has a sliding window that some query of this
    /// step would look past: `g`'s mask narrowed so that the query at key position `p` sees
    /// keys `p − W < j ≤ p` only (within its document, and past its row's padding). `None`
    /// when the block has no window or every query's window holds all its keys — the
    /// unwindowed computation, bit for bit.
    ///
    /// A cached step's queries are key positions `pos0 ..`; a padded row's window counts its
    /// own tokens, so a start that falls after the row's hidden padding moves past it.
    fn windowed(&self, l: usize, g: Geometry<'_>, pos0: usize) -> Result<Option<Documents>> {
        let Some(w) = self.cfg.window_of(l) else {
            return Ok(None);
        };
        if pos0 + g.t <= w {
            return Ok(None);
        }
        let (b, t) = (g.b, g.t);
        let first_of = |position: usize| (position + 1).saturating_sub(w);
        let rows = |b: usize| (0..b).flat_map(move |_| pos0..pos0 + t);
        let to_u32 = |p: usize| {
            u32::try_from(p).map_err(|_| TrainError::Input(format!("position {p} exceeds u32")))
        };
        let (mask, positions) = match g.documents {
            Some(d) if d.mask().is_padding() => {
                let (mask, positions) = (d.mask(), d.positions());
                if positions.len() != b * t {
                    return Err(TrainError::Input(format!(
                        "sliding window: {} positions for a step of {b} × {t}",
                        positions.len()
                    )));
                }
                let first = |row: usize, i: usize| {
                    let start = first_of(positions[row * t + i] as usize);
                    let hidden = mask.hidden_keys(row);
                    if start < hidden.start {
                        start
                    } else {
                        start + hidden.len()
                    }
                };
                (mask.narrowed(first), positions.to_vec())
            }
            Some(d) => (
                d.mask().narrowed(|_, i| first_of(pos0 + i)),
                d.positions().to_vec(),
            ),
            None => {
                // A cached step's queries are the last of the keys: a padding mask with
                // nothing hidden says so.
                let base = if pos0 == 0 {
                    DocumentMask::causal(b, t)
                } else {
                    DocumentMask::padding(b, t, &vec![0..0; b])
                };
                let positions = rows(b).map(to_u32).collect::<Result<Vec<_>>>()?;
                (
                    base.and_then(|m| m.narrowed(|_, i| first_of(pos0 + i))),
                    positions,
                )
            }
        };
        let mask = mask.map_err(|e| TrainError::Input(format!("sliding window: {e}")))?;
        Ok(Some(Documents::padded(positions, mask)))
    }

    /// Llama block `l` forward on `inp` `[B, T, C]`: the output residual `[B, T, C]`
    /// (storage precision) and, when `save`, what backward needs.
    ///
    /// With `kv`, a cached decode step: `inp`'s rows are positions `kv.len() ..`, the rotary
    /// angles start there, and attention reads the cache grown by this step's keys and values
    /// (nothing is saved for backward then).
    pub(crate) fn llama_block_forward(
        &self,
        l: usize,
        bw: &[B::Tensor],
        inp: &B::Tensor,
        g: Geometry<'_>,
        save: bool,
        kv: Option<&mut LayerKv<B::Tensor>>,
    ) -> Result<BlockOutput<B::Tensor, LlamaSaved<B::Tensor>>> {
        let (c, nh, kvh) = (self.cfg.channels, self.cfg.heads, self.cfg.kv_heads());
        let f = self.cfg.ffn();
        let rope = self.cfg.rope_of(l);
        let pos0 = kv.as_ref().map_or(0, |c| c.len());
        let be = self.backend();

        let (attn_out_off, mlp_out_off) = self.output_norm_offsets();

        let _t = self.tag(l, "input_norm");
        let (norm1, norm1_stats) = self.sublayer_input(bw, inp, o::INPUT_NORM, g)?;
        let x = norm1.as_ref().unwrap_or(inp);
        let _t = self.tag(l, "attn.q");
        let (q, q_norm) = self.rotated_heads(l, bw, x, (o::Q, o::Q_NORM), nh, rope, pos0, g)?;
        let _t = self.tag(l, "attn.k");
        let (k, k_norm) = self.rotated_heads(l, bw, x, (o::K, o::K_NORM), kvh, rope, pos0, g)?;
        let _t = self.tag(l, "attn.v");
        let v = self.project_heads(l, bw, x, o::V, kvh, g)?;
        let v = self.keep(v)?;
        let _t = self.tag(l, "attn.out");
        let kv = self.extend_kv(kv, k, v)?;
        let windowed = self.windowed(l, g, pos0)?;
        let attn = match &windowed {
            Some(d) => self.attend(
                &q,
                &kv,
                Geometry {
                    documents: Some(d),
                    ..g
                },
            )?,
            None => self.attend(&q, &kv, g)?,
        };
        drop(windowed);
        let _t = self.tag(l, "attn.o_proj");
        let mut atty = self.scratch_overwritten([g.b, g.t, self.cfg.attention_width()])?;
        be.merge_heads(&mut atty, attn.output(), 0)?;
        let mut attn_out = self.fresh_overwritten([g.b, g.t, c])?;
        self.block_linear(l, bw, o::O, None, &mut attn_out, &atty)?;
        drop(atty);
        let (res2, attn_out_norm) = self.add_to_residual(bw, attn_out, inp, attn_out_off, g)?;
        let _t = self.tag(l, "post_norm");
        let (norm2, norm2_stats) = self.sublayer_input(bw, &res2, o::POST_NORM, g)?;
        let x = norm2.as_ref().unwrap_or(&res2);
        let _t = self.tag(l, "mlp.gate");
        let mut gate = self.fresh_overwritten([g.b, g.t, f])?;
        self.block_linear(l, bw, o::GATE, None, &mut gate, x)?;
        let gate = self.keep(gate)?;
        let _t = self.tag(l, "mlp.up");
        let mut up = self.fresh_overwritten([g.b, g.t, f])?;
        self.block_linear(l, bw, o::UP, None, &mut up, x)?;
        let up = self.keep(up)?;
        let _t = self.tag(l, "mlp.act");
        let act = self.block_gated(&gate, &up)?;
        let _t = self.tag(l, "mlp.down");
        let mut mlp_out = self.fresh_overwritten([g.b, g.t, c])?;
        self.block_linear(l, bw, o::DOWN, None, &mut mlp_out, &act)?;
        let (out, mlp_out_norm) = self.add_to_residual(bw, mlp_out, &res2, mlp_out_off, g)?;
        if !save {
            return Ok((out, None));
        }
        let (k, v) = kv.into_fresh()?;
        let sel = self.opts.selective;
        let keep_unless_selective = |t: Option<B::Tensor>| if sel { None } else { t };
        let saved = LlamaSaved {
            norm1: keep_unless_selective(norm1),
            norm1_stats,
            q,
            k,
            q_norm,
            k_norm,
            v,
            attn: attn.into_kept()?,
            res2,
            norm2: keep_unless_selective(norm2),
            norm2_stats,
            gate,
            up,
            act: keep_unless_selective(Some(act)),
            attn_out_norm,
            mlp_out_norm,
        };
        Ok((out, Some(saved)))
    }

    /// The backward of [`Model::project_heads`] for one of q, k, v: merges the heads'
    /// gradient `dh` `[B, heads, T, hs]` (or takes it as it is, `[B, T, heads·hs]`, after
    /// OLMo 2's projection norm) and adds its input gradient into `dx`, its parameters'
    /// gradients into `grads`.
    #[allow(clippy::too_many_arguments)]
    fn project_heads_backward(
        &self,
        l: usize,
        bw: &[B::Tensor],
        dx: &mut B::Tensor,
        grads: &mut [B::Tensor],
        dh: &B::Tensor,
        x: &B::Tensor,
        w_off: usize,
    ) -> Result<()> {
        let bias = self.qkv_bias_offset(w_off);
        let (b, heads, t, hs) = match *dh.shape().dims() {
            [b, h, t, hs] => (b, h, t, hs),
            [_, _, _] => return self.block_linear_backward(l, bw, w_off, bias, dx, grads, dh, x),
            ref other => {
                return Err(TrainError::Input(format!(
                    "head gradient of shape {other:?} is not [B, H, T, hs]"
                )))
            }
        };
        let mut flat = self.scratch_overwritten([b, t, heads * hs])?;
        self.backend().merge_heads(&mut flat, dh, 0)?;
        self.block_linear_backward(l, bw, w_off, bias, dx, grads, &flat, x)
    }

    /// The offset of projection `w_off`'s bias: Qwen2's q, k and v have one, nothing else.
    fn qkv_bias_offset(&self, w_off: usize) -> Option<usize> {
        let Family::Llama(s) = self.cfg.family else {
            return None;
        };
        match w_off {
            o::Q if s.qkv_bias() => Some(o::Q_BIAS),
            o::K if s.qkv_bias() => Some(o::K_BIAS),
            o::V if s.qkv_bias() => Some(o::V_BIAS),
            _ => None,
        }
    }

    /// Llama block `l` backward: accumulates parameter gradients into `grads` (the block's 9 to 13),
    /// returns the gradient of `inp`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn llama_block_backward(
        &self,
        l: usize,
        bw: &[B::Tensor],
        inp: &B::Tensor,
        s: LlamaSaved<B::Tensor>,
        dout: &B::Tensor,
        grads: &mut [B::Tensor],
        g: Geometry<'_>,
    ) -> Result<B::Tensor> {
        let (c, f) = (self.cfg.channels, self.cfg.ffn());
        let be = self.backend();
        let input_norms = self.input_norms();
        let (attn_out_off, mlp_out_off) = self.output_norm_offsets();
        let _t = self.tag(l, "recompute");
        // What each sublayer read: its input norm (kept, or recomputed under selective
        // recomputation), or OLMo 2's residual stream itself.
        let norm1 = match s.norm1 {
            Some(t) => Some(t),
            None if input_norms => Some(self.block_rmsnorm(bw, inp, o::INPUT_NORM, g)?.0),
            None => None,
        };
        let norm2 = match s.norm2 {
            Some(t) => Some(t),
            None if input_norms => Some(self.block_rmsnorm(bw, &s.res2, o::POST_NORM, g)?.0),
            None => None,
        };
        let act = match s.act {
            Some(t) => t,
            None => self.block_gated(&s.gate, &s.up)?,
        };

        // out = res2 + down(act(gate)·up), or res2 + norm(down(…)) with output norms.
        let _t = self.tag(l, "mlp.backward");
        let ddown =
            self.output_norm_backward(grads, bw, dout, s.mlp_out_norm.as_ref(), mlp_out_off)?;
        drop(s.mlp_out_norm);
        let mut dact = self.scratch([g.b, g.t, f])?;
        let dy = ddown.tensor();
        self.block_linear_backward(l, bw, o::DOWN, None, &mut dact, grads, dy, &act)?;
        drop((act, ddown));
        let mut dgate = self.scratch([g.b, g.t, f])?;
        // up's gradient is written over the product's.
        be.gated_backward_in_place(&mut dgate, &mut dact, &s.gate, &s.up, self.mlp_gate())?;
        let dup = dact;
        // The gradient of the MLP's input: its norm's (dnorm2), or, without input norms, the
        // residual's own, which starts as the block output's and takes gate's and up's
        // input gradients directly.
        let mut dmlp_in = if input_norms {
            self.scratch([g.b, g.t, c])?
        } else {
            let mut dres2 = self.scratch_overwritten([g.b, g.t, c])?;
            be.copy(dout, &mut dres2)?;
            dres2
        };
        let x = norm2.as_ref().unwrap_or(&s.res2);
        self.block_linear_backward(l, bw, o::GATE, None, &mut dmlp_in, grads, &dgate, x)?;
        drop(dgate);
        self.block_linear_backward(l, bw, o::UP, None, &mut dmlp_in, grads, &dup, x)?;
        drop((dup, norm2));
        let _t = self.tag(l, "post_norm.backward");
        let dres2 = match &s.norm2_stats {
            Some(stats) => {
                let mut dres2 = self.scratch_overwritten([g.b, g.t, c])?;
                be.copy(dout, &mut dres2)?;
                self.norm_backward(
                    &mut dres2,
                    self.param_grads(grads, o::POST_NORM, None).0,
                    None,
                    &dmlp_in,
                    &s.res2,
                    at(bw, o::POST_NORM)?,
                    stats,
                )?;
                drop(dmlp_in);
                dres2
            }
            None => dmlp_in,
        };
        // res2 = inp + o_proj(atty) (or inp + norm(o_proj(atty))), atty = the attention
        // output with heads merged.
        let _t = self.tag(l, "attn.backward");
        let width = self.cfg.attention_width();
        let dattn_out =
            self.output_norm_backward(grads, bw, &dres2, s.attn_out_norm.as_ref(), attn_out_off)?;
        let mut atty = self.scratch_overwritten([g.b, g.t, width])?;
        be.merge_heads(&mut atty, &s.attn.output, 0)?;
        let mut datty = self.scratch([g.b, g.t, width])?;
        let dy = dattn_out.tensor();
        self.block_linear_backward(l, bw, o::O, None, &mut datty, grads, dy, &atty)?;
        drop((atty, dattn_out));
        drop(s.attn_out_norm);
        let mut dy = self.scratch_overwritten(s.q.shape().clone())?;
        be.split_heads(&mut dy, &datty, 0)?;
        drop(datty);
        let mut ag = self.attention_backward(&s.q, &s.k, &s.v, s.attn, &dy)?;
        drop(dy);
        // The rotation is orthogonal: its backward rotates the gradient back.
        if let Some(rope) = self.cfg.rope_of(l) {
            self.rope(&mut ag.dq, rope, 0, g, true)?;
            self.rope(&mut ag.dk, rope, 0, g, true)?;
        }
        let dq = self.head_norm_backward(grads, bw, ag.dq, s.q_norm.as_ref(), o::Q_NORM)?;
        let dk = self.head_norm_backward(grads, bw, ag.dk, s.k_norm.as_ref(), o::K_NORM)?;
        drop((s.q_norm, s.k_norm));
        let _t = self.tag(l, "input_norm.backward");
        // The residual passes dres2 straight through to the block input; the attention's
        // input gradient joins it through the input norm, or directly without one.
        let mut dinp = dres2;
        let x = norm1.as_ref().unwrap_or(inp);
        match &s.norm1_stats {
            Some(stats) => {
                let mut dnorm1 = self.scratch([g.b, g.t, c])?;
                for (dh, off) in [(&dq, o::Q), (&dk, o::K), (&ag.dv, o::V)] {
                    self.project_heads_backward(l, bw, &mut dnorm1, grads, dh, x, off)?;
                }
                drop((dq, dk, ag.dv, norm1));
                self.norm_backward(
                    &mut dinp,
                    self.param_grads(grads, o::INPUT_NORM, None).0,
                    None,
                    &dnorm1,
                    inp,
                    at(bw, o::INPUT_NORM)?,
                    stats,
                )?;
            }
            None => {
                for (dh, off) in [(&dq, o::Q), (&dk, o::K), (&ag.dv, o::V)] {
                    self.project_heads_backward(l, bw, &mut dinp, grads, dh, x, off)?;
                }
            }
        }
        Ok(dinp)
    }
}
