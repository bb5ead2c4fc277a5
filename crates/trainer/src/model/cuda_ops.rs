//! [`ModelOps`] on the CUDA backend: headroom-cuda's cuBLASLt GEMMs and NVRTC kernels, and
//! headroom-attn's flash attention on tensor cores. The model itself is [`crate::model::Model`],
//! the same code the CPU runs; only the numerics below are the device's.
//!
//! ## Numerics (what differs from the CPU ops)
//! - GEMM operands are in the working weights' dtype: under bf16 the activation a linear layer
//!   reads is rounded to bf16 if it is not stored so already (every activation the model keeps
//!   is; the f32 scratch it reads — merged heads, the final norm — holds bf16 values, so the
//!   rounding is exact there), and cuBLASLt multiplies bf16 with f32 accumulation
//!   (`CUBLAS_COMPUTE_32F`, its own summation order) into an f32 output with the f32 bias fused
//!   in its epilogue. Under fp32 the GEMMs are f32 (no TF32).
//! - Backward GEMMs read the activation gradient rounded to the weights' dtype (PyTorch
//!   autocast's choice; the CPU keeps it f32); bias gradients are a fixed-order column sum of
//!   the f32 gradient. Weight and input gradients are accumulated in f32 by the GEMM (beta = 1).
//! - Layer norm, RMSNorm, GELU, SwiGLU, the embedding and the cross-entropy run in f32 on f32
//!   copies of their low-precision inputs, as on the CPU. Norm row sums are fixed-order block
//!   trees (RMSNorm's in f64, like the CPU's), so statistics agree with the CPU to rounding;
//!   GELU, the embedding, the rotary embedding and the roundings are bitwise the CPU's, SwiGLU
//!   within a few ulp (its `exp` is the fast_math port, the CPU op's is libm's).
//! - Attention is flash attention on bf16 `q`, `k`, `v` as kept (no f32 copies): P and dS are
//!   rounded to bf16 inside the kernels, the output is bf16, and the backward reads the output
//!   gradient rounded to bf16 and returns bf16 gradients, widened to f32 here. So the CUDA
//!   model needs bf16 with flash attention (headroom-attn refuses anything else with a typed
//!   error), head dimension 64 or 128 and compute capability 8.0.
//! - The head's logits come out of the GEMM in f32 and are rounded to the storage precision in
//!   place, as the CPU rounds them; the rotary tables are the CPU's, computed on the host.
//!
//! ## Memory
//! Every device allocation goes through the backend, so the allocation hook sees it. The
//! transient copies made here (bf16 GEMM operands, f32 views, token ids, rotary tables, head
//! chunks) are `Workspace`, like the CPU's f32 views. Everything is deterministic: cuBLASLt
//! picks the same algorithm for the same shapes, no kernel uses atomics, so checkpointed
//! gradients equal stored ones bit for bit, as on the CPU.

use headroom_attn::{AttentionForward, AttentionGradients};
use headroom_cuda::{Cuda, CudaTensor, GemmOp, GemmShape, HeadLayout};
use headroom_tensor::{Backend, DType, MemoryCategory, Tensor};

use crate::model::ops::{HeadLossGrads, ModelOps};
use crate::model::{MlpGate, Precision, RmsNorm, View};
use crate::{Result, TrainError};

fn bad(op: &str, what: String) -> TrainError {
    TrainError::Input(format!("{op}: {what}"))
}

/// `t` in `dtype`: itself, or a converted copy in workspace memory while the view lives.
fn as_dtype<'a>(cuda: &Cuda, t: &'a CudaTensor, dtype: DType) -> Result<View<'a, CudaTensor>> {
    if t.dtype() == dtype {
        return Ok(View::Borrowed(t));
    }
    let _g = MemoryCategory::Workspace.enter();
    let mut out = cuda.uninit(t.shape().clone(), dtype)?;
    cuda.cast(t, &mut out)?;
    Ok(View::Owned(out))
}

fn f32_of<'a>(cuda: &Cuda, t: &'a CudaTensor) -> Result<View<'a, CudaTensor>> {
    as_dtype(cuda, t, DType::F32)
}

/// An RMSNorm's f32 gain: the stored one, or `w + offset` (Gemma's `1 + w`) in workspace
/// memory — the sum one f32 rounding, as the CPU's op makes it — so the kernels stay the
/// plain gain's.
fn rms_gain<'a>(cuda: &Cuda, w: &'a CudaTensor, norm: RmsNorm) -> Result<View<'a, CudaTensor>> {
    if norm.gain_offset == 0.0 {
        return f32_of(cuda, w);
    }
    let wv = f32_of(cuda, w)?;
    let _g = MemoryCategory::Workspace.enter();
    let mut gain = cuda.upload(&vec![norm.gain_offset; w.numel()], w.shape().clone())?;
    cuda.axpy(1.0, wv.tensor(), &mut gain)?;
    Ok(View::Owned(gain))
}

/// The last dimension of `t`.
fn cols(t: &CudaTensor) -> usize {
    t.shape().dims().last().copied().unwrap_or(1).max(1)
}

/// `[out, in]` of a linear weight.
fn weight_dims(op: &str, w: &CudaTensor) -> Result<(usize, usize)> {
    match w.shape().dims() {
        &[o, i] => Ok((o, i)),
        other => Err(bad(
            op,
            format!("weight of shape {other:?} is not [out, in]"),
        )),
    }
}

/// Host token ids (checked below `vocab`) as a device u32 tensor in workspace memory.
fn upload_tokens(cuda: &Cuda, op: &str, tokens: &[u32], vocab: usize) -> Result<CudaTensor> {
    check_tokens(op, tokens, vocab)?;
    let _g = MemoryCategory::Workspace.enter();
    Ok(cuda.upload(tokens, [tokens.len()])?)
}

/// Every token a row of a `vocab`-row embedding.
fn check_tokens(op: &str, tokens: &[u32], vocab: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(t) => Err(bad(op, format!("token {t} ≥ vocab {vocab}"))),
        None => Ok(()),
    }
}

/// The head layout of `heads` `[B, H, T, hs]` against columns `[col, col + H·hs)` of `wide`
/// `[B, T, W]`: headroom-cuda's permute moves part `col / (H·hs)` of `W / (H·hs)` parts, so
/// both must divide (they do for every split the models make: q, k, v of a fused projection).
fn head_layout(op: &str, heads: &CudaTensor, wide: &CudaTensor, col: usize) -> Result<HeadLayout> {
    let &[b, h, t, hs] = heads.shape().dims() else {
        return Err(bad(
            op,
            format!("heads of shape {:?}", heads.shape().dims()),
        ));
    };
    let (w, block) = (cols(wide), h * hs);
    if block == 0
        || wide.numel() != b * t * w
        || w % block != 0
        || !col.is_multiple_of(block)
        || col >= w
    {
        return Err(bad(
            op,
            format!(
                "{:?} at column {col} of {:?}: not a whole head block",
                heads.shape().dims(),
                wide.shape().dims()
            ),
        ));
    }
    Ok(HeadLayout::single(b, t, h, hs).part_of(w / block, col / block))
}

impl ModelOps for Cuda {
    type Quantized = headroom_quant::cuda::CudaQuantizedTensor;

    fn linear_quantized(
        &self,
        y: &mut CudaTensor,
        x: &CudaTensor,
        w: &Self::Quantized,
        b: Option<&CudaTensor>,
        // The CUDA kernel multiplies the f32 dequantized weight in every precision.
        _: Precision,
    ) -> Result<()> {
        if b.is_some() {
            return Err(TrainError::Config(
                "a 4-bit linear with a bias (GPT-2's) has no CUDA kernel yet".into(),
            ));
        }
        let xv = f32_of(self, x)?;
        Ok(w.matmul_forward(self, xv.tensor(), y, &Default::default())?)
    }

    fn dropout(
        &self,
        _: &mut CudaTensor,
        _: &CudaTensor,
        _: &headroom_lora::DropoutMask,
    ) -> Result<()> {
        Err(TrainError::Config(
            "LoRA dropout has no CUDA kernel yet".into(),
        ))
    }

    fn dropout_in_place(&self, _: &mut CudaTensor, _: &headroom_lora::DropoutMask) -> Result<()> {
        Err(TrainError::Config(
            "LoRA dropout has no CUDA kernel yet".into(),
        ))
    }

    fn linear_quantized_input_grad(
        &self,
        dx: &mut CudaTensor,
        dy: &CudaTensor,
        w: &Self::Quantized,
        _: Precision,
    ) -> Result<()> {
        // The fused kernel overwrites its output; the op's contract is to add.
        let dyv = f32_of(self, dy)?;
        let mut part = {
            let _g = MemoryCategory::Workspace.enter();
            self.zeros(dx.shape().clone(), DType::F32)?
        };
        w.matmul_backward_input(self, dyv.tensor(), &mut part, &Default::default())?;
        self.axpy(1.0, &part, dx)?;
        Ok(())
    }

    fn linear(
        &self,
        y: &mut CudaTensor,
        x: &CudaTensor,
        w: &CudaTensor,
        b: Option<&CudaTensor>,
    ) -> Result<()> {
        let (oc, c) = weight_dims("linear", w)?;
        let n = x.numel() / c;
        let xv = as_dtype(self, x, w.dtype())?;
        let bv = b.map(|b| f32_of(self, b)).transpose()?;
        Ok(self.matmul_forward(y, xv.tensor(), w, bv.as_ref().map(View::tensor), n, c, oc)?)
    }

    fn linear_backward(
        &self,
        dx: &mut CudaTensor,
        dw: Option<&mut CudaTensor>,
        db: Option<&mut CudaTensor>,
        dy: &CudaTensor,
        x: &CudaTensor,
        w: &CudaTensor,
    ) -> Result<()> {
        let (oc, c) = weight_dims("linear backward", w)?;
        let shape = GemmShape {
            m: x.numel() / c,
            n: oc,
            k: c,
        };
        let dy_low = as_dtype(self, dy, w.dtype())?;
        let xv = as_dtype(self, x, w.dtype())?;
        self.gemm(GemmOp::InputGrad, shape, dx, dy_low.tensor(), w, None, true)?;
        if let Some(dw) = dw {
            self.gemm(
                GemmOp::WeightGrad,
                shape,
                dw,
                dy_low.tensor(),
                xv.tensor(),
                None,
                true,
            )?;
        }
        drop((dy_low, xv));
        if let Some(db) = db {
            self.column_sum(db, f32_of(self, dy)?.tensor())?;
        }
        Ok(())
    }

    fn layernorm(
        &self,
        y: &mut CudaTensor,
        mean: &mut CudaTensor,
        rstd: &mut CudaTensor,
        x: &CudaTensor,
        w: &CudaTensor,
        b: &CudaTensor,
    ) -> Result<()> {
        let (xv, wv, bv) = (f32_of(self, x)?, f32_of(self, w)?, f32_of(self, b)?);
        let (x, w, b) = (xv.tensor(), wv.tensor(), bv.tensor());
        Ok(self.layernorm_forward(y, mean, rstd, x, w, b, cols(x))?)
    }

    fn layernorm_backward(
        &self,
        dx: &mut CudaTensor,
        dw: &mut CudaTensor,
        db: &mut CudaTensor,
        dy: &CudaTensor,
        x: &CudaTensor,
        w: &CudaTensor,
        mean: &CudaTensor,
        rstd: &CudaTensor,
    ) -> Result<()> {
        let (dyv, xv, wv) = (f32_of(self, dy)?, f32_of(self, x)?, f32_of(self, w)?);
        let (dy, x, w) = (dyv.tensor(), xv.tensor(), wv.tensor());
        Ok(Cuda::layernorm_backward(
            self,
            dx,
            dw,
            db,
            dy,
            x,
            w,
            mean,
            rstd,
            cols(x),
        )?)
    }

    fn rmsnorm(
        &self,
        y: &mut CudaTensor,
        rstd: &mut CudaTensor,
        x: &CudaTensor,
        w: &CudaTensor,
        norm: RmsNorm,
    ) -> Result<()> {
        let (xv, wv) = (f32_of(self, x)?, rms_gain(self, w, norm)?);
        let (x, w) = (xv.tensor(), wv.tensor());
        Ok(self.rmsnorm_forward(y, rstd, x, w, cols(x), norm.eps)?)
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut CudaTensor,
        dw: &mut CudaTensor,
        dy: &CudaTensor,
        x: &CudaTensor,
        w: &CudaTensor,
        rstd: &CudaTensor,
        norm: RmsNorm,
    ) -> Result<()> {
        let (dyv, xv, wv) = (
            f32_of(self, dy)?,
            f32_of(self, x)?,
            rms_gain(self, w, norm)?,
        );
        let (dy, x, w) = (dyv.tensor(), xv.tensor(), wv.tensor());
        Ok(Cuda::rmsnorm_backward(
            self,
            dx,
            dw,
            dy,
            x,
            w,
            rstd,
            cols(x),
        )?)
    }

    fn gelu(&self, y: &mut CudaTensor, x: &CudaTensor) -> Result<()> {
        Ok(self.gelu_forward(y, f32_of(self, x)?.tensor())?)
    }

    fn gelu_backward(&self, dx: &mut CudaTensor, x: &CudaTensor, dy: &CudaTensor) -> Result<()> {
        let (xv, dyv) = (f32_of(self, x)?, f32_of(self, dy)?);
        Ok(Cuda::gelu_backward(self, dx, xv.tensor(), dyv.tensor())?)
    }

    fn gated(
        &self,
        y: &mut CudaTensor,
        gate: &CudaTensor,
        up: &CudaTensor,
        act: MlpGate,
    ) -> Result<()> {
        let (gv, uv) = (f32_of(self, gate)?, f32_of(self, up)?);
        let (gate, up) = (gv.tensor(), uv.tensor());
        match act {
            MlpGate::Silu => self.swiglu_forward(y, gate, up)?,
            MlpGate::GeluTanh => self.geglu_forward(y, gate, up)?,
        }
        Ok(())
    }

    fn gated_backward(
        &self,
        dgate: &mut CudaTensor,
        dup: &mut CudaTensor,
        gate: &CudaTensor,
        up: &CudaTensor,
        dy: &CudaTensor,
        act: MlpGate,
    ) -> Result<()> {
        let (gv, uv, dyv) = (f32_of(self, gate)?, f32_of(self, up)?, f32_of(self, dy)?);
        let (gate, up, dy) = (gv.tensor(), uv.tensor(), dyv.tensor());
        match act {
            MlpGate::Silu => Cuda::swiglu_backward(self, dgate, dup, gate, up, dy)?,
            MlpGate::GeluTanh => Cuda::geglu_backward(self, dgate, dup, gate, up, dy)?,
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        rope: crate::ops::rope::Rope,
        pos0: usize,
        inverse: bool,
    ) -> Result<()> {
        let &[_, _, t, hs] = x.shape().dims() else {
            return Err(bad("rope", format!("{:?} is not 4-d", x.shape().dims())));
        };
        if hs % 2 != 0 {
            return Err(bad("rope", format!("odd head dimension {hs}")));
        }
        // The CPU's tables, bit for bit: the angles never depend on the device's sin/cos.
        let (cos, sin) = crate::ops::rope::tables_at(pos0, t, hs, rope);
        let (cos, sin) = {
            let _g = MemoryCategory::Workspace.enter();
            (
                self.upload(&cos, [t, hs / 2])?,
                self.upload(&sin, [t, hs / 2])?,
            )
        };
        Ok(Cuda::rope(self, x, &cos, &sin, t, hs, inverse)?)
    }

    fn concat_seq(&self, y: &mut CudaTensor, a: &CudaTensor, b: &CudaTensor) -> Result<()> {
        let dims = |t: &CudaTensor| match *t.shape().dims() {
            [n, h, t, hs] => Ok((n * h, t, hs)),
            ref other => Err(bad("concat_seq", format!("{other:?} is not 4-d"))),
        };
        let ((heads, t, hs), (ha, ta, hsa), (hb, tb, hsb)) = (dims(y)?, dims(a)?, dims(b)?);
        if (ha, hsa) != (heads, hs) || (hb, hsb) != (heads, hs) || ta + tb != t {
            return Err(bad(
                "concat_seq",
                format!(
                    "{:?} ++ {:?} is not {:?}",
                    a.shape().dims(),
                    b.shape().dims(),
                    y.shape().dims()
                ),
            ));
        }
        // Trade-off: two copy-engine commands per head instead of a kernel. A cache is repeated
        // once per batch, so this is a few hundred small copies then — nothing next to the
        // steps' GEMMs — and keeps the logic on the host, where the CPU tests run it.
        let (ra, rb) = (ta * hs, tb * hs);
        for i in 0..heads {
            self.copy_elements(a, i * ra, y, i * (ra + rb), ra)?;
            self.copy_elements(b, i * rb, y, i * (ra + rb) + ra, rb)?;
        }
        Ok(())
    }

    fn write_seq(&self, y: &mut CudaTensor, at: usize, x: &CudaTensor, rows: usize) -> Result<()> {
        let dims = |t: &CudaTensor| match *t.shape().dims() {
            [n, h, t, hs] => Ok((n * h, t, hs)),
            ref other => Err(bad("write_seq", format!("{other:?} is not 4-d"))),
        };
        let ((heads, ty, hs), (hx, tx, hsx)) = (dims(y)?, dims(x)?);
        let fits = at.checked_add(rows).is_some_and(|end| end <= ty) && rows <= tx;
        if (hx, hsx) != (heads, hs) || !fits {
            return Err(bad(
                "write_seq",
                format!(
                    "{rows} positions of {:?} at {at} of {:?}",
                    x.shape().dims(),
                    y.shape().dims()
                ),
            ));
        }
        // One copy-engine command per head, as concat_seq: a decode step writes each layer's
        // keys and values once, a few hundred small copies per token.
        for i in 0..heads {
            self.copy_elements(x, i * tx * hs, y, (i * ty + at) * hs, rows * hs)?;
        }
        Ok(())
    }

    fn select_batch(
        &self,
        y: &mut CudaTensor,
        x: &CudaTensor,
        rows: &[usize],
        positions: usize,
    ) -> Result<()> {
        let ([_, h, ty, hs], tx) = super::ops::select_batch_shapes(y, x, rows, positions)?;
        // One copy-engine command per kept head: a batch drops rows a few times per batch.
        for (j, &r) in rows.iter().enumerate() {
            for i in 0..h {
                let (from, to) = ((r * h + i) * tx * hs, (j * h + i) * ty * hs);
                self.copy_elements(x, from, y, to, positions * hs)?;
            }
        }
        Ok(())
    }

    fn truncate_seq(&self, y: &mut CudaTensor, x: &CudaTensor) -> Result<()> {
        let dims = |t: &CudaTensor| match *t.shape().dims() {
            [n, h, t, hs] => Ok((n * h, t, hs)),
            ref other => Err(bad("truncate_seq", format!("{other:?} is not 4-d"))),
        };
        let ((heads, ty, hs), (hx, tx, hsx)) = (dims(y)?, dims(x)?);
        if (hx, hsx) != (heads, hs) || ty > tx {
            return Err(bad(
                "truncate_seq",
                format!(
                    "{:?} is not a prefix of {:?}",
                    y.shape().dims(),
                    x.shape().dims()
                ),
            ));
        }
        // One copy-engine command per head, as concat_seq (a cut happens once per chat turn).
        for i in 0..heads {
            self.copy_elements(x, i * tx * hs, y, i * ty * hs, ty * hs)?;
        }
        Ok(())
    }

    fn embed(
        &self,
        y: &mut CudaTensor,
        tokens: &[u32],
        wte: &CudaTensor,
        wpe: Option<&CudaTensor>,
    ) -> Result<()> {
        let c = cols(wte);
        let tok = upload_tokens(self, "embed", tokens, wte.numel() / c)?;
        let wv = f32_of(self, wte)?;
        match wpe {
            Some(wpe) => {
                let t = y.shape().dims().get(1).copied().unwrap_or(1);
                let pv = f32_of(self, wpe)?;
                Ok(self.embedding_forward(y, &tok, wv.tensor(), pv.tensor(), t, c)?)
            }
            None => Ok(self.embedding_forward_tokens(y, &tok, wv.tensor(), c)?),
        }
    }

    fn embed_backward(
        &self,
        dwte: &mut CudaTensor,
        dwpe: Option<&mut CudaTensor>,
        dy: &CudaTensor,
        tokens: &[u32],
        skip: Option<u32>,
    ) -> Result<()> {
        let c = cols(dwte);
        let vocab = dwte.numel() / c;
        let tok = match skip {
            None => upload_tokens(self, "embed backward", tokens, vocab)?,
            Some(skip) => {
                if dwpe.is_some() {
                    return Err(bad(
                        "embed backward",
                        "a padding index with learned positions".into(),
                    ));
                }
                // The kernel skips a token past the vocabulary (embedding.cu): the skipped
                // token's rows are renamed so, after the usual check.
                check_tokens("embed backward", tokens, vocab)?;
                let renamed: Vec<u32> = tokens
                    .iter()
                    .map(|&t| if t == skip { u32::MAX } else { t })
                    .collect();
                let _g = MemoryCategory::Workspace.enter();
                self.upload(&renamed, [renamed.len()])?
            }
        };
        let dyv = f32_of(self, dy)?;
        match dwpe {
            Some(dwpe) => {
                let t = dy.shape().dims().get(1).copied().unwrap_or(1);
                Ok(self.embedding_backward(dwte, dwpe, dyv.tensor(), &tok, t, c)?)
            }
            None => Ok(self.embedding_backward_tokens(dwte, dyv.tensor(), &tok, c)?),
        }
    }

    fn split_heads(&self, y: &mut CudaTensor, x: &CudaTensor, col: usize) -> Result<()> {
        let layout = head_layout("split heads", y, x, col)?;
        let xv = as_dtype(self, x, y.dtype())?;
        Ok(Cuda::split_heads(self, y, xv.tensor(), layout)?)
    }

    fn merge_heads(&self, y: &mut CudaTensor, x: &CudaTensor, col: usize) -> Result<()> {
        let layout = head_layout("merge heads", x, y, col)?;
        let xv = as_dtype(self, x, y.dtype())?;
        Ok(Cuda::merge_heads(self, y, xv.tensor(), layout)?)
    }

    fn round_to(&self, x: &mut CudaTensor, precision: Precision) -> Result<()> {
        Ok(self.round_in_place(x, precision.storage())?)
    }

    fn attention_backward_kept(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        attn: AttentionForward<CudaTensor>,
        dy: &CudaTensor,
    ) -> Result<AttentionGradients<CudaTensor>> {
        // The kernels take the output gradient in the inputs' dtype and return theirs.
        let dy_low = as_dtype(self, dy, q.dtype())?;
        let g = headroom_attn::AttentionBackend::attention_backward(
            self,
            q,
            k,
            v,
            &attn,
            dy_low.tensor(),
        )?;
        drop((dy_low, attn));
        let widen = |t: CudaTensor| -> Result<CudaTensor> {
            if t.dtype() == DType::F32 {
                return Ok(t);
            }
            let _g = MemoryCategory::Workspace.enter();
            let mut out = self.uninit(t.shape().clone(), DType::F32)?;
            self.cast(&t, &mut out)?;
            Ok(out)
        };
        Ok(AttentionGradients {
            dq: widen(g.dq)?,
            dk: widen(g.dk)?,
            dv: widen(g.dv)?,
        })
    }

    fn head_loss(
        &self,
        losses: &mut CudaTensor,
        x: &CudaTensor,
        w: &CudaTensor,
        targets: &[u32],
        rows: usize,
        precision: Precision,
        logits_category: MemoryCategory,
        grads: Option<HeadLossGrads<'_, CudaTensor>>,
    ) -> Result<()> {
        let (v, c) = weight_dims("head", w)?;
        let n = targets.len();
        if x.numel() != n * c || losses.numel() != n {
            return Err(bad(
                "head",
                format!("{n} targets for input {:?}", x.shape().dims()),
            ));
        }
        let rows = rows.clamp(1, n.max(1));
        let targets_dev = upload_tokens(self, "head", targets, v)?;
        let dloss = grads.as_ref().map_or(0.0, |g| g.dloss_per_token);
        let counted = grads.as_ref().and_then(|g| g.counted);
        if counted.is_some_and(|c| c.len() != n) {
            return Err(bad("head", format!("counted flags for {n} rows expected")));
        }
        let mut grads = grads;
        let xl = as_dtype(self, x, w.dtype())?;
        let scratch = |len: usize, width: usize, dtype| -> Result<CudaTensor> {
            let _g = MemoryCategory::Workspace.enter();
            Ok(self.uninit([len, width], dtype)?)
        };
        let mut r0 = 0;
        while r0 < n {
            let r = rows.min(n - r0);
            // This chunk's rows of a row-indexed tensor: a copy, or `None` when one chunk
            // holds every row (the tensor itself).
            let take = |t: &CudaTensor, width: usize| -> Result<Option<CudaTensor>> {
                if r == n {
                    return Ok(None);
                }
                let mut out = scratch(r, width, t.dtype())?;
                self.copy_elements(t, r0 * width, &mut out, 0, r * width)?;
                Ok(Some(out))
            };
            let (x_rows, t_rows) = (take(xl.tensor(), c)?, take(&targets_dev, 1)?);
            let x_rows = x_rows.as_ref().unwrap_or(xl.tensor());
            let t_rows = t_rows.as_ref().unwrap_or(&targets_dev);
            let _l = headroom_profiler::label_absolute(if r < n {
                "head.logits[chunk]"
            } else {
                "head.logits"
            });
            // bf16 weights: the logits are kept in bf16 — the values the f32 path rounds them
            // to, at half the bytes — and the loss overwrites them with the bf16 gradient the
            // GEMMs read, so the head holds one `[r, V]` bf16 buffer where it held an f32 one
            // and a bf16 copy of it (1.5 GiB of GPT-2's 8 × 1024 step). cuBLASLt rounds its f32
            // accumulators to bf16 (to nearest even) as the round-trip below does.
            let logits_dtype = if w.dtype() == DType::BF16 && precision.storage() == DType::BF16 {
                DType::BF16
            } else {
                DType::F32
            };
            let mut logits = {
                let _g = logits_category.enter();
                self.uninit([r, v], logits_dtype)?
            };
            self.matmul_forward(&mut logits, x_rows, w, None, r, c, v)?;
            if logits_dtype == DType::F32 {
                self.round_in_place(&mut logits, precision.storage())?;
            }
            let mut l_rows = scratch(r, 1, DType::F32)?;
            match grads.as_mut() {
                Some(g) => {
                    let dloss_dev = {
                        let _g = MemoryCategory::Workspace.enter();
                        // A row that does not count is seeded with 0: its gradient row is 0.
                        let seeds: Vec<f32> = match counted {
                            Some(c) => c[r0..r0 + r]
                                .iter()
                                .map(|&k| if k { dloss } else { 0.0 })
                                .collect(),
                            None => vec![dloss; r],
                        };
                        self.upload(&seeds, [r])?
                    };
                    // The gradient overwrites the logits: one `[r, V]` buffer, not two.
                    self.cross_entropy_forward_backward_in_place(
                        &mut l_rows,
                        &mut logits,
                        t_rows,
                        &dloss_dev,
                        v,
                    )?;
                    let dlogits = logits;
                    let dlogits_low = as_dtype(self, &dlogits, w.dtype())?;
                    let dlow = dlogits_low.tensor();
                    let shape = GemmShape { m: r, n: v, k: c };
                    // dx accumulates: a chunk's rows of it go out to a copy and back.
                    match take(g.dx, c)? {
                        Some(mut dx) => {
                            self.gemm(GemmOp::InputGrad, shape, &mut dx, dlow, w, None, true)?;
                            self.copy_elements(&dx, 0, g.dx, r0 * c, r * c)?;
                        }
                        None => self.gemm(GemmOp::InputGrad, shape, g.dx, dlow, w, None, true)?,
                    }
                    // A tied head accumulates into the token embedding's gradient; no bias.
                    if let Some(dw) = g.dw.as_deref_mut() {
                        self.gemm(GemmOp::WeightGrad, shape, dw, dlow, x_rows, None, true)?;
                    }
                }
                None => self.cross_entropy_forward(&mut l_rows, &logits, t_rows, v)?,
            }
            self.copy_elements(&l_rows, 0, losses, r0, r)?;
            r0 += r;
        }
        Ok(())
    }
}
