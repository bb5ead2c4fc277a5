//! The model's ops as an extension trait of a backend: what the layers of both families need
//! and nothing else. [`crate::model::Model`] is written once against it; a backend adds
//! kernels (the CPU's are in [`crate::ops`], wired up in `cpu_ops`), never a copy of the
//! model.
//!
//! Conventions, for every implementation:
//! - Outputs (`y`, `mean`, `rstd`, `losses`) are f32 tensors the op overwrites; gradients
//!   (`dx`, `dw`, `db`, …) are f32 tensors the op *adds* into, so several consumers of one
//!   tensor accumulate and the caller decides when to zero.
//! - Inputs may be in any float dtype the backend reads (f32, or the run's bf16/f16 storage);
//!   the backend decides how it reads them (the CPU's element-wise ops and norms read them in
//!   place, its widening GEMMs and attention through a transient f32 copy tagged `Workspace`;
//!   a GPU reads bf16 straight into its GEMMs). Statistics are f32.
//! - Shapes come from the tensors: activations are `[B, T, W]` row-major (any leading dims
//!   whose product is the row count), per-head tensors `[B, H, T, hs]`, linear weights
//!   `[out, in]`. A mismatch is an error, never a panic.
//! - Reductions run in a fixed order whatever the thread count, so every op is deterministic
//!   and checkpointed gradients equal stored ones.

use headroom_attn::{AttentionBackend, AttentionForward, AttentionGradients};
use headroom_tensor::{DType, MemoryCategory, Tensor};

use crate::model::{MlpGate, Precision, RmsNorm};
use crate::ops::rope::Rope;
use crate::Result;

/// The gradients the fused head adds into, and the weight of each token's loss.
pub struct HeadLossGrads<'a, T> {
    /// `∂loss/∂loss_i` for every counted token (`1/(B·T)` gives the mean loss's gradient).
    pub dloss_per_token: f32,
    /// `[N]`: which rows' losses count (`None`: all). A row that does not count gets the
    /// gradient `0` (its loss is still computed, and ignored by the caller): a loss mask's
    /// prompt tokens, PyTorch's `ignore_index`.
    pub counted: Option<&'a [bool]>,
    /// `[N, C]` gradient of the head's input.
    pub dx: &'a mut T,
    /// `[V, C]` gradient of the head's weight (`None` when the head is frozen: no gradient is
    /// computed).
    pub dw: Option<&'a mut T>,
}

/// The model's ops on a backend (see the module documentation for the conventions).
pub trait ModelOps: AttentionBackend + headroom_amp::AmpBackend {
    /// A frozen linear weight stored in 4 bits (bitsandbytes' blockwise NF4/FP4 layout, see
    /// headroom-quant) on this backend.
    type Quantized;

    /// `y = x·wᵀ (+ b)` for a frozen 4-bit weight `w` `[out, in]`: `x` `[N, in]` in any float
    /// dtype, `y` `[N, out]` f32, overwritten. At most one dequantized panel per thread exists
    /// at a time (`Workspace`); never the whole f32 weight. `precision` is the run's (the
    /// compute dtype of bitsandbytes' `Linear4bit`): in bf16 a backend with bf16 products may
    /// multiply the dequantized weight rounded to bf16 by the bf16-rounded input, as its dense
    /// bf16 linears do; otherwise the dequantized f32 weight multiplies the input's f32 values.
    fn linear_quantized(
        &self,
        y: &mut Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Quantized,
        b: Option<&Self::Tensor>,
        precision: Precision,
    ) -> Result<()>;

    /// Adds `dy·w` into `dx` for a frozen 4-bit weight: the input gradient only (a frozen
    /// weight has no gradient). `precision` as for [`ModelOps::linear_quantized`].
    fn linear_quantized_input_grad(
        &self,
        dx: &mut Self::Tensor,
        dy: &Self::Tensor,
        w: &Self::Quantized,
        precision: Precision,
    ) -> Result<()>;

    /// `y = x·wᵀ (+ b)`: `x` `[N, in]`, `w` `[out, in]`, `b` `[out]`, `y` `[N, out]`.
    fn linear(
        &self,
        y: &mut Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Tensor,
        b: Option<&Self::Tensor>,
    ) -> Result<()>;

    /// Adds `dy·w` into `dx`, `dyᵀ·x` into `dw` and the column sums of `dy` into `db`. A
    /// frozen weight passes `dw: None`: its gradient is neither computed nor allocated.
    fn linear_backward(
        &self,
        dx: &mut Self::Tensor,
        dw: Option<&mut Self::Tensor>,
        db: Option<&mut Self::Tensor>,
        dy: &Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Tensor,
    ) -> Result<()>;

    /// `y = x ⊙ mask` (LoRA's dropout on an adapter's input): `x` any float dtype, `y` f32 of
    /// the same length, overwritten; the mask is headroom-lora's, a pure function of its key
    /// and the element index.
    fn dropout(
        &self,
        y: &mut Self::Tensor,
        x: &Self::Tensor,
        mask: &headroom_lora::DropoutMask,
    ) -> Result<()>;

    /// `x ⊙= mask` in place on f32 `x` (the dropout's backward).
    fn dropout_in_place(
        &self,
        x: &mut Self::Tensor,
        mask: &headroom_lora::DropoutMask,
    ) -> Result<()>;

    /// Layer norm over the last dimension (ε = 1e-5, GPT-2's): `y = (x - mean)·rstd·w + b`,
    /// with the per-row `mean` and `rstd` `[N]` kept for backward.
    fn layernorm(
        &self,
        y: &mut Self::Tensor,
        mean: &mut Self::Tensor,
        rstd: &mut Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Tensor,
        b: &Self::Tensor,
    ) -> Result<()>;

    /// Layer norm's backward from the forward's statistics (accumulating).
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward(
        &self,
        dx: &mut Self::Tensor,
        dw: &mut Self::Tensor,
        db: &mut Self::Tensor,
        dy: &Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Tensor,
        mean: &Self::Tensor,
        rstd: &Self::Tensor,
    ) -> Result<()>;

    /// RMSNorm (Llama's): `y = (w + offset) · (x · rstd)`, `rstd = 1/√(mean(x²) + eps)` per
    /// row, kept; `norm` gives `eps` and the gain offset (0, or Gemma's 1: the sum is one f32
    /// rounding, as transformers' `1.0 + weight.float()`).
    fn rmsnorm(
        &self,
        y: &mut Self::Tensor,
        rstd: &mut Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Tensor,
        norm: RmsNorm,
    ) -> Result<()>;

    /// RMSNorm's backward from the forward's `rstd` (accumulating); `dw` is the stored gain's
    /// gradient, which the offset does not change.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dx: &mut Self::Tensor,
        dw: &mut Self::Tensor,
        dy: &Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Tensor,
        rstd: &Self::Tensor,
        norm: RmsNorm,
    ) -> Result<()>;

    /// GELU, tanh approximation (GPT-2's `gelu_new`).
    fn gelu(&self, y: &mut Self::Tensor, x: &Self::Tensor) -> Result<()>;

    /// Adds `gelu'(x)·dy` into `dx`.
    fn gelu_backward(
        &self,
        dx: &mut Self::Tensor,
        x: &Self::Tensor,
        dy: &Self::Tensor,
    ) -> Result<()>;

    /// [`ModelOps::gelu_backward`] into a zeroed gradient that replaces `dy`: `dy = gelu'(x)·dy`
    /// (the bits of `gelu_backward` into zeros). The default allocates that gradient
    /// (`Workspace`) beside `dy` and moves it in; the CPU writes over `dy`, one `[N, 4C]` f32
    /// buffer fewer in a GPT-2 block's backward.
    fn gelu_backward_in_place(&self, dy: &mut Self::Tensor, x: &Self::Tensor) -> Result<()> {
        let mut dx = {
            let _g = MemoryCategory::Workspace.enter();
            self.zeros(dy.shape().clone(), DType::F32)?
        };
        self.gelu_backward(&mut dx, x, dy)?;
        *dy = dx;
        Ok(())
    }

    /// A gated MLP's gate, `y = act(gate) · up` elementwise: SiLU (Llama's SwiGLU) or GELU
    /// with the tanh approximation (Gemma's GeGLU, [`ModelOps::gelu`]'s).
    fn gated(
        &self,
        y: &mut Self::Tensor,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        act: MlpGate,
    ) -> Result<()>;

    /// The gate's backward: adds `act'(gate) · up · dy` into `dgate` and `act(gate) · dy` into
    /// `dup`.
    #[allow(clippy::too_many_arguments)]
    fn gated_backward(
        &self,
        dgate: &mut Self::Tensor,
        dup: &mut Self::Tensor,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        dy: &Self::Tensor,
        act: MlpGate,
    ) -> Result<()>;

    /// [`ModelOps::gated_backward`] with `dup` replacing `dy` (the bits `gated_backward` gives
    /// into a zeroed `dup`); adds into `dgate` as that does. The default allocates `dup`
    /// beside `dy` and moves it in; the CPU writes over `dy`, one `[N, F]` f32 buffer fewer in
    /// a Llama block's backward.
    fn gated_backward_in_place(
        &self,
        dgate: &mut Self::Tensor,
        dy: &mut Self::Tensor,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        act: MlpGate,
    ) -> Result<()> {
        let mut dup = {
            let _g = MemoryCategory::Workspace.enter();
            self.zeros(dy.shape().clone(), DType::F32)?
        };
        self.gated_backward(dgate, &mut dup, gate, up, dy, act)?;
        *dy = dup;
        Ok(())
    }

    /// Rotary position embedding in place on f32 `x` `[B, H, T, hs]`, position `pos0 + t` for
    /// row `t` of every sequence (`pos0` is 0 in training, the cache's length in a cached
    /// decode), in Hugging Face's rotate-half layout (dimension `i` pairs with `i + hs/2`,
    /// frequencies [`Rope::inv_freq`]). `inverse` rotates by the negative angle — the backward
    /// of the forward rotation, which is orthogonal.
    fn rope(&self, x: &mut Self::Tensor, rope: Rope, pos0: usize, inverse: bool) -> Result<()>;

    /// [`ModelOps::rope`] at given positions: row `t` of sequence `b` rotated by the angles of
    /// position `positions[b·T + t]` (packed documents restart at 0). The default refuses:
    /// a backend without it trains packed documents only through the CPU.
    fn rope_at(
        &self,
        x: &mut Self::Tensor,
        rope: Rope,
        positions: &[u32],
        inverse: bool,
    ) -> Result<()> {
        let _ = (x, rope, positions, inverse);
        Err(crate::TrainError::Config(
            "rotary embeddings at per-document positions are not implemented on this backend"
                .into(),
        ))
    }

    /// `y` `[B, H, Ta + Tb, hs]` = `a` `[B, H, Ta, hs]` followed by `b` `[B, H, Tb, hs]` along
    /// the sequence, per head (same dtype, any): how a KV cache is repeated for a batch (over
    /// flat views). A copy, bitwise.
    fn concat_seq(&self, y: &mut Self::Tensor, a: &Self::Tensor, b: &Self::Tensor) -> Result<()>;

    /// `y` `[B, H, Ty, hs]` = the first `Ty` positions of `x` `[B, H, Tx, hs]` (`Ty ≤ Tx`), per
    /// head (same dtype, any): a KV cache cut back to a prefix its next input shares. A copy,
    /// bitwise.
    fn truncate_seq(&self, y: &mut Self::Tensor, x: &Self::Tensor) -> Result<()>;

    /// Positions `at .. at + rows` of `y` `[B, H, Ty, hs]` = the first `rows` positions of `x`
    /// `[B, H, Tx, hs]`, per head (same dtype, any; `rows ≤ Tx`, `at + rows ≤ Ty`), the rest
    /// of `y` untouched: how a KV cache with room takes a step's keys and values in place, and
    /// moves to a larger buffer. A copy, bitwise.
    fn write_seq(
        &self,
        y: &mut Self::Tensor,
        at: usize,
        x: &Self::Tensor,
        rows: usize,
    ) -> Result<()>;

    /// The first `positions` positions of each head of batch row `j` of `y` `[By, H, Ty, hs]`
    /// = those of batch row `rows[j]` of `x` `[Bx, H, Tx, hs]` (same dtype, any; one entry
    /// of `rows` per row of `y`, each below `Bx`; `positions ≤ Ty, Tx`), the rest of `y`
    /// untouched: how a KV cache keeps the sequences still generating. A copy, bitwise.
    fn select_batch(
        &self,
        y: &mut Self::Tensor,
        x: &Self::Tensor,
        rows: &[usize],
        positions: usize,
    ) -> Result<()>;

    /// Token embedding plus, when given, the learned position embedding: `y` `[B, T, C]`
    /// from `tokens` `[B·T]` (host ids, checked below the vocab by the caller).
    fn embed(
        &self,
        y: &mut Self::Tensor,
        tokens: &[u32],
        wte: &Self::Tensor,
        wpe: Option<&Self::Tensor>,
    ) -> Result<()>;

    /// The embedding's backward: adds `dy`'s rows into the rows of `dwte` (and `dwpe`) they
    /// came from, in token order (deterministic). The rows of token `skip` add nothing
    /// (PyTorch's `padding_idx`; only without `dwpe`).
    fn embed_backward(
        &self,
        dwte: &mut Self::Tensor,
        dwpe: Option<&mut Self::Tensor>,
        dy: &Self::Tensor,
        tokens: &[u32],
        skip: Option<u32>,
    ) -> Result<()>;

    /// Columns `[col, col + H·hs)` of `x` `[B, T, W]` into heads `y` `[B, H, T, hs]`.
    fn split_heads(&self, y: &mut Self::Tensor, x: &Self::Tensor, col: usize) -> Result<()>;

    /// Heads `x` `[B, H, T, hs]` into columns `[col, col + H·hs)` of `y` `[B, T, W]`
    /// (the inverse of [`ModelOps::split_heads`]; other columns untouched).
    fn merge_heads(&self, y: &mut Self::Tensor, x: &Self::Tensor, col: usize) -> Result<()>;

    /// Round f32 `x` in place to `precision` and back (what storing it would cost).
    fn round_to(&self, x: &mut Self::Tensor, precision: Precision) -> Result<()>;

    /// Attention's backward from what the model kept — `q`, `k`, `v` and `attn` in the storage
    /// precision — and `dy`, the output's f32 gradient `[B, NH, T, hs]`: f32 gradients of `q`,
    /// `k`, `v`. The default is
    /// [`AttentionBackend::attention_backward_f32`](headroom_attn::AttentionBackend) (which
    /// makes f32 copies of what its kernels do not read; the CPU's reads bf16 and f16 a few
    /// heads at a time); a backend whose kernels want other dtypes converts as they need.
    fn attention_backward_kept(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        attn: AttentionForward<Self::Tensor>,
        dy: &Self::Tensor,
    ) -> Result<AttentionGradients<Self::Tensor>> {
        Ok(self.attention_backward_f32(q, k, v, attn, dy)?)
    }

    /// The output head and the loss, fused and `rows` token rows at a time (so the `[N, V]`
    /// logits exist one chunk at a time when `rows < N`): `logits = x·wᵀ` rounded to
    /// `precision`, `losses` `[N]` their per-token cross-entropy against `targets`; with
    /// `grads`, the gradients of `Σ losses · dloss_per_token` added into `dx` and `dw`.
    /// `x` `[N, C]` f32, `w` `[V, C]`. The logits buffer is tagged `logits_category`
    /// (`Activations` when it is the whole `[N, V]`, as unfused training keeps it), every other
    /// transient `Workspace`. In training the loss overwrites each chunk of logits with its
    /// gradient (llm.c's way): a backend allocates no second `[rows, V]` f32 buffer for it.
    /// Under bf16 a backend may store the logits in bf16 where the products read the gradient
    /// rounded to bf16 anyway (CUDA's cuBLASLt; the CPU's AMX products, for vocabularies wider
    /// than two of [`crate::ops::matmul::BF16_OUTPUT_STRIP`]): same losses, half the bytes.
    #[allow(clippy::too_many_arguments)]
    fn head_loss(
        &self,
        losses: &mut Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Tensor,
        targets: &[u32],
        rows: usize,
        precision: Precision,
        logits_category: headroom_tensor::MemoryCategory,
        grads: Option<HeadLossGrads<'_, Self::Tensor>>,
    ) -> Result<()>;
}

/// The shapes of a [`ModelOps::select_batch`] call, checked once for every backend: `y`'s
/// `[By, H, Ty, hs]` and `x`'s `Tx`.
pub(crate) fn select_batch_shapes<T: Tensor>(
    y: &T,
    x: &T,
    rows: &[usize],
    positions: usize,
) -> Result<([usize; 4], usize)> {
    let bad = |what: String| crate::TrainError::Input(format!("select_batch: {what}"));
    let dims = |t: &T| match *t.shape().dims() {
        [a, b, c, d] => Ok([a, b, c, d]),
        ref other => Err(bad(format!("expected a 4-d tensor, got {other:?}"))),
    };
    let ([n, h, ty, hs], [nx, hx, tx, hsx]) = (dims(y)?, dims(x)?);
    if (hx, hsx) != (h, hs)
        || rows.len() != n
        || positions > ty.min(tx)
        || rows.iter().any(|&r| r >= nx)
    {
        return Err(bad(format!(
            "rows {rows:?}, {positions} positions, of {:?} into {:?}",
            x.shape().dims(),
            y.shape().dims()
        )));
    }
    if x.dtype() != y.dtype() {
        return Err(bad("mixed dtypes".into()));
    }
    Ok(([n, h, ty, hs], tx))
}
