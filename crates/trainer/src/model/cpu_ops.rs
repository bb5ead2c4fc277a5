//! [`ModelOps`] on the CPU backend: the f32 kernels of [`crate::ops`] on tensor slices.
//!
//! Numerics: every kernel computes in f32 on exactly the rounded values a low-precision run
//! stores, so the arithmetic is the fp32 run's. How an activation stored in bf16/f16 is read:
//! the norms, GELU, SwiGLU, the residual adds and the head merge widen it a block or a row at
//! a time ([`crate::ops::widened_blocks`], no whole-tensor copy); the AMX products read a bf16
//! input in place; everything else (the widening GEMMs' input, the 4-bit products, dropout,
//! attention) reads an f32 copy made for the call (tagged `Workspace`, freed when the op
//! returns) — the "f32 views" whose bytes the estimator counts. A bf16/f16 *weight* is never
//! copied whole: the linear layers and the head hand it to [`matmul::forward_with`] /
//! [`matmul::backward_with`], which widen it a panel at a time into a workspace scratch of
//! [`matmul::forward_scratch`] / [`matmul::backward_scratch`] elements, with the same bits as
//! the f32 GEMM on a widened copy; the embedding and the norms read their weights row by row.
//! Where the CPU has AMX tiles ([`matmul::bf16_products`]), a bf16 weight's products instead
//! take torch's bf16 `matmul` numerics — the other operand rounded to bf16 too, f32 sums — in
//! the same scratch ([`matmul::forward_bf16_products`]): the bytes are the same, the bits are
//! not the widening path's.

use half::{bf16, f16};
use headroom_tensor::{Backend, Cpu, CpuTensor, DType, Element, MemoryCategory, Tensor};

use crate::model::ops::{HeadLossGrads, ModelOps};
use crate::model::transformer::View;
use crate::model::{MlpGate, Precision, RmsNorm};
use crate::ops::glu::{self, Gate};
use crate::ops::rope::Rope;
use crate::ops::{cross_entropy, embedding, gelu, layernorm, matmul, quant_matmul, rmsnorm, rope};
use crate::{Result, TrainError};

/// `t` as f32: itself, or an upcast copy in workspace memory for as long as the view lives.
pub(crate) fn f32_view<'a>(cpu: &Cpu, t: &'a CpuTensor) -> Result<View<'a, CpuTensor>> {
    if t.dtype() == DType::F32 {
        return Ok(View::Borrowed(t));
    }
    let _g = MemoryCategory::Workspace.enter();
    let mut out = cpu.uninit(t.shape().clone(), DType::F32)?;
    cpu.cast(t, &mut out)?;
    Ok(View::Owned(out))
}

/// `$body` with `$s` bound to `t`'s elements in their stored float type (`&[f32]`, `&[bf16]`
/// or `&[f16]`); any other dtype is an error. The kernels this calls read the stored values
/// directly (widened a block or a row at a time), so no whole-tensor f32 view is made.
macro_rules! with_stored {
    ($t:expr, |$s:ident| $body:expr) => {
        match $t.dtype() {
            DType::BF16 => {
                let $s = $t.as_slice::<bf16>()?;
                $body
            }
            DType::F16 => {
                let $s = $t.as_slice::<f16>()?;
                $body
            }
            _ => {
                let $s = $t.as_slice::<f32>()?;
                $body
            }
        }
    };
}

fn out(t: &mut CpuTensor) -> Result<&mut [f32]> {
    Ok(t.as_mut_slice::<f32>()?)
}

/// `dst[:, col..]` (row width `w`) = the heads of `src` `[b, h, t, hs]` merged, read in its
/// stored type (exactly: widening is exact).
fn merge_heads_rows<X: matmul::Operand>(
    dst: &mut [f32],
    src: &[X],
    [b, h, t, hs]: [usize; 4],
    w: usize,
    col: usize,
) {
    use rayon::prelude::*;
    if w == 0 {
        return;
    }
    // Row by row of `dst`, over the threads: each row is written once, whole, where a walk
    // in `src`'s order revisits every row once per head (one thread, 0.9% of an fp32 `small`
    // step in `memmove`).
    dst[..b * t * w]
        .par_chunks_mut(w)
        .with_min_len(MOVE_ROWS_PER_TASK)
        .enumerate()
        .for_each(|(r, row)| {
            let (bi, ti) = (r / t, r % t);
            for hi in 0..h {
                let s = ((bi * h + hi) * t + ti) * hs;
                X::widen(&src[s..s + hs], &mut row[col + hi * hs..][..hs]);
            }
        });
}

/// Rows per task when heads are split or merged: a few KiB each, so tasks of tens of KiB.
const MOVE_ROWS_PER_TASK: usize = 16;

/// Token (and position) embedding rows of `wte` stored as `W`; `wpe` with its sequence length.
fn embed_rows<W: matmul::Operand>(
    cpu: &Cpu,
    y: &mut [f32],
    tokens: &[u32],
    wte: &[W],
    wpe: Option<(&CpuTensor, usize)>,
    c: usize,
) -> Result<()> {
    match wpe {
        None => embedding::forward_tokens(y, tokens, wte, c),
        Some((p, t)) => match p.dtype() {
            DType::BF16 => embedding::forward(y, tokens, wte, p.as_slice::<bf16>()?, t, c),
            DType::F16 => embedding::forward(y, tokens, wte, p.as_slice::<f16>()?, t, c),
            _ => embedding::forward(y, tokens, wte, f32_view(cpu, p)?.s()?, t, c),
        },
    }
    Ok(())
}

/// A linear weight as the GEMMs read it: f32 (itself, or a view of another dtype), or bf16 /
/// f16 in place — never a whole f32 copy.
enum WeightRef<'a> {
    F32(View<'a, CpuTensor>),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl<'a> WeightRef<'a> {
    fn new(cpu: &Cpu, w: &'a CpuTensor) -> Result<Self> {
        Ok(match w.dtype() {
            DType::BF16 => WeightRef::Bf16(w.as_slice()?),
            DType::F16 => WeightRef::F16(w.as_slice()?),
            _ => WeightRef::F32(f32_view(cpu, w)?),
        })
    }

    /// The workspace scratch, `elems` f32 long; none for an f32 weight, so an fp32 run
    /// allocates exactly what it did before.
    fn scratch(&self, cpu: &Cpu, elems: usize) -> Result<Option<CpuTensor>> {
        if let WeightRef::F32(_) = self {
            return Ok(None);
        }
        let _g = MemoryCategory::Workspace.enter();
        Ok(Some(cpu.uninit([elems], DType::F32)?))
    }

    /// The bf16 weight and the bf16 slice of `x` when the products read `x` in place: a bf16
    /// input of a bf16 weight on the AMX products, which round their operands to bf16 anyway
    /// (exactly, for a value already bf16), so the f32 view they would otherwise read gives
    /// the same bits.
    fn bf16_in_place<'x>(&self, x: &'x CpuTensor) -> Result<Option<(&'a [bf16], &'x [bf16])>> {
        Ok(match (self, x.dtype()) {
            (WeightRef::Bf16(w), DType::BF16) if matmul::bf16_products() => {
                Some((w, x.as_slice()?))
            }
            _ => None,
        })
    }

    /// [`matmul::forward_with`]; a bias in the weight's dtype is read in place, any other
    /// through an f32 view.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        cpu: &Cpu,
        y: &mut [f32],
        x: &[f32],
        b: Option<&CpuTensor>,
        n: usize,
        c: usize,
        oc: usize,
        scratch: &mut [f32],
    ) -> Result<()> {
        let dims = (n, c, oc);
        match self {
            WeightRef::F32(w) => {
                with_bias(cpu, y, x, w.s()?, b, dims, scratch, matmul::forward_with)
            }
            WeightRef::Bf16(w) if matmul::bf16_products() => with_bias(
                cpu,
                y,
                x,
                w,
                b,
                dims,
                scratch,
                matmul::forward_bf16_products,
            ),
            WeightRef::Bf16(w) => with_bias(cpu, y, x, w, b, dims, scratch, matmul::forward_with),
            WeightRef::F16(w) => with_bias(cpu, y, x, w, b, dims, scratch, matmul::forward_with),
        }
    }

    /// [`matmul::backward_with`] (no bias: the caller's `db` is passed through). `x` is read
    /// for the weight's gradient only (it may be empty when `dw` is `None`).
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        dx: &mut [f32],
        dw: Option<&mut [f32]>,
        db: Option<&mut [f32]>,
        dy: &[f32],
        x: &[f32],
        n: usize,
        c: usize,
        oc: usize,
        scratch: &mut [f32],
    ) -> Result<()> {
        match self {
            WeightRef::F32(w) => {
                matmul::backward_with(dx, dw, db, dy, x, w.s()?, n, c, oc, scratch)
            }
            WeightRef::Bf16(w) if matmul::bf16_products() => {
                matmul::backward_bf16_products(dx, dw, db, dy, x, w, n, c, oc, scratch)
            }
            WeightRef::Bf16(w) => matmul::backward_with(dx, dw, db, dy, x, w, n, c, oc, scratch),
            WeightRef::F16(w) => matmul::backward_with(dx, dw, db, dy, x, w, n, c, oc, scratch),
        }
        Ok(())
    }
}

/// `product` is `matmul::forward_with` or, for bf16 on AMX, `forward_bf16_products`:
/// `(out, inp, weight, bias, n, c, oc, scratch)`.
type Product<A, W> = fn(&mut [f32], &[A], &[W], Option<&[W]>, usize, usize, usize, &mut [f32]);

/// `product` with the bias: one in the weight's dtype read in place by the product, any other
/// added through an f32 view afterwards.
#[allow(clippy::too_many_arguments)]
fn with_bias<A, W: matmul::Operand + Element>(
    cpu: &Cpu,
    y: &mut [f32],
    x: &[A],
    w: &[W],
    b: Option<&CpuTensor>,
    (n, c, oc): (usize, usize, usize),
    scratch: &mut [f32],
    product: Product<A, W>,
) -> Result<()> {
    match b {
        Some(b) if b.dtype() == W::DTYPE => {
            product(y, x, w, Some(b.as_slice::<W>()?), n, c, oc, scratch)
        }
        Some(b) => {
            let bv = f32_view(cpu, b)?;
            product(y, x, w, None, n, c, oc, scratch);
            // The `+=` the product does for a bias of its own dtype.
            for row in y.chunks_exact_mut(oc.max(1)) {
                for (o, b) in row.iter_mut().zip(bv.s()?) {
                    *o += b;
                }
            }
        }
        None => product(y, x, w, None, n, c, oc, scratch),
    }
    Ok(())
}

/// A scratch from [`WeightRef::scratch`] as the slice the GEMMs take (empty when none).
fn panel(scratch: &mut Option<CpuTensor>) -> Result<&mut [f32]> {
    match scratch {
        Some(t) => out(t),
        None => Ok(&mut []),
    }
}

/// A gated MLP's `y = act(gate) · up` ([`glu`]), checked. `up` is read in `gate`'s type: both
/// are kept in the run's storage precision (a mixed pair is a dtype error).
fn gated<A: Gate>(op: &str, y: &mut CpuTensor, gate: &CpuTensor, up: &CpuTensor) -> Result<()> {
    expect_len(op, "output", y, gate.numel())?;
    expect_len(op, "up", up, gate.numel())?;
    let y = out(y)?;
    with_stored!(gate, |gs| glu::forward::<A, _>(y, gs, up.as_slice()?));
    Ok(())
}

/// The backward of [`gated`], accumulating into `dgate` and `dup`.
fn gated_backward<A: Gate>(
    cpu: &Cpu,
    op: &str,
    dgate: &mut CpuTensor,
    dup: &mut CpuTensor,
    gate: &CpuTensor,
    up: &CpuTensor,
    dy: &CpuTensor,
) -> Result<()> {
    let n = gate.numel();
    for (what, t) in [
        ("gate gradient", &*dgate),
        ("up gradient", &*dup),
        ("up", up),
        ("output gradient", dy),
    ] {
        expect_len(op, what, t, n)?;
    }
    let (dgate, dup, dyv) = (out(dgate)?, out(dup)?, f32_view(cpu, dy)?);
    with_stored!(gate, |gs| glu::backward::<A, _>(
        dgate,
        dup,
        gs,
        up.as_slice()?,
        dyv.s()?
    ));
    Ok(())
}

/// The backward of [`gated`] with up's gradient written over `dy`.
fn gated_backward_in_place<A: Gate>(
    op: &str,
    dgate: &mut CpuTensor,
    dy: &mut CpuTensor,
    gate: &CpuTensor,
    up: &CpuTensor,
) -> Result<()> {
    let n = gate.numel();
    for (what, t) in [
        ("gate gradient", &*dgate),
        ("up", up),
        ("output gradient", &*dy),
    ] {
        expect_len(op, what, t, n)?;
    }
    let (dgate, dy) = (out(dgate)?, out(dy)?);
    with_stored!(gate, |gs| glu::backward_in_place::<A, _>(
        dgate,
        dy,
        gs,
        up.as_slice()?
    ));
    Ok(())
}

fn bad(op: &str, what: String) -> TrainError {
    TrainError::Input(format!("{op}: {what}"))
}

/// The last dimension of `t` and the number of rows before it.
fn rows_cols(t: &CpuTensor) -> (usize, usize) {
    let c = t.shape().dims().last().copied().unwrap_or(1).max(1);
    (t.numel() / c, c)
}

/// `(d0, d1, d2, d3)` of a 4-dimensional tensor.
fn dims4(op: &str, t: &CpuTensor) -> Result<[usize; 4]> {
    match t.shape().dims() {
        &[a, b, c, d] => Ok([a, b, c, d]),
        other => Err(bad(op, format!("expected a 4-d tensor, got {other:?}"))),
    }
}

/// Check that `t` holds `n` elements.
fn expect_len(op: &str, what: &str, t: &CpuTensor, n: usize) -> Result<()> {
    if t.numel() != n {
        return Err(bad(
            op,
            format!("{what} has {} elements, expected {n}", t.numel()),
        ));
    }
    Ok(())
}

/// `[out, in]` of a linear weight.
fn weight_dims(op: &str, w: &CpuTensor) -> Result<(usize, usize)> {
    match w.shape().dims() {
        &[o, i] => Ok((o, i)),
        other => Err(bad(
            op,
            format!("weight of shape {other:?} is not [out, in]"),
        )),
    }
}

/// Whether a 4-bit linear multiplies with bf16 operands ([`quant_matmul`]): a bf16 run whose
/// bf16 products run on AMX ([`matmul::bf16_products`]), reading an f32 or bf16 activation.
fn quant_bf16_products(precision: Precision, operand: DType) -> bool {
    precision == Precision::Bf16
        && matches!(operand, DType::F32 | DType::BF16)
        && matmul::bf16_products()
}

/// The dequantized block (`block` bf16 elements) and the packing buffer (`pack` u16
/// elements) of a 4-bit product with bf16 operands, as `Workspace` in that order, each held
/// in f32 pairs (whole 4-byte units, as the estimator counts).
fn quant_scratch(cpu: &Cpu, block: usize, pack: usize) -> Result<(CpuTensor, CpuTensor)> {
    let _ws = MemoryCategory::Workspace.enter();
    Ok((
        cpu.zeros([block.div_ceil(2)], DType::F32)?,
        cpu.zeros([pack.div_ceil(2)], DType::F32)?,
    ))
}

/// An f32 scratch as 16-bit elements (bf16 or the u16 packing buffer).
fn halves<T: bytemuck::Pod>(t: &mut CpuTensor) -> Result<&mut [T]> {
    Ok(bytemuck::cast_slice_mut(out(t)?))
}

impl ModelOps for Cpu {
    type Quantized = headroom_quant::QuantizedTensor;

    fn linear_quantized(
        &self,
        y: &mut CpuTensor,
        x: &CpuTensor,
        w: &Self::Quantized,
        b: Option<&CpuTensor>,
        precision: Precision,
    ) -> Result<()> {
        let ys = out(y)?;
        if quant_bf16_products(precision, x.dtype()) {
            let (block, pack) = quant_matmul::forward_scratch(
                x.numel() / w.shape().last().copied().unwrap_or(1).max(1),
                w,
                self.num_threads(),
            );
            let (mut block, mut pack) = quant_scratch(self, block, pack)?;
            let (block, pack) = (halves::<bf16>(&mut block)?, halves::<u16>(&mut pack)?);
            match x.dtype() {
                DType::BF16 => {
                    let xs = x.as_slice::<bf16>()?;
                    self.install(|| quant_matmul::forward(ys, xs, w, block, pack))?;
                }
                _ => {
                    let xs = x.as_slice::<f32>()?;
                    self.install(|| quant_matmul::forward(ys, xs, w, block, pack))?;
                }
            }
        } else {
            let xv = f32_view(self, x)?;
            headroom_quant::matmul_forward(self, xv.s()?, w, ys, &Default::default())?;
        }
        if let Some(b) = b {
            let oc = w.shape().first().copied().unwrap_or(0);
            expect_len("linear (4-bit)", "bias", b, oc)?;
            let bv = f32_view(self, b)?;
            for row in ys.chunks_exact_mut(oc.max(1)) {
                for (o, b) in row.iter_mut().zip(bv.s()?) {
                    *o += b;
                }
            }
        }
        Ok(())
    }

    fn dropout(
        &self,
        y: &mut CpuTensor,
        x: &CpuTensor,
        mask: &headroom_lora::DropoutMask,
    ) -> Result<()> {
        expect_len("dropout", "output", y, x.numel())?;
        let xv = f32_view(self, x)?;
        let (ys, xs) = (out(y)?, xv.s()?);
        self.install(|| mask.apply(ys, xs));
        Ok(())
    }

    fn dropout_in_place(&self, x: &mut CpuTensor, mask: &headroom_lora::DropoutMask) -> Result<()> {
        let xs = out(x)?;
        self.install(|| mask.apply_in_place(xs));
        Ok(())
    }

    fn linear_quantized_input_grad(
        &self,
        dx: &mut CpuTensor,
        dy: &CpuTensor,
        w: &Self::Quantized,
        precision: Precision,
    ) -> Result<()> {
        if quant_bf16_products(precision, dy.dtype()) {
            // The bf16 products accumulate into `dx` themselves: no partial gradient.
            let (block, pack) = quant_matmul::backward_scratch(
                dy.numel() / w.shape().first().copied().unwrap_or(1).max(1),
                w,
                self.num_threads(),
            );
            let (mut block, mut pack) = quant_scratch(self, block, pack)?;
            let (block, pack) = (halves::<bf16>(&mut block)?, halves::<u16>(&mut pack)?);
            let dxs = out(dx)?;
            match dy.dtype() {
                DType::BF16 => {
                    let dys = dy.as_slice::<bf16>()?;
                    self.install(|| quant_matmul::backward_input(dxs, dys, w, block, pack))?;
                }
                _ => {
                    let dys = dy.as_slice::<f32>()?;
                    self.install(|| quant_matmul::backward_input(dxs, dys, w, block, pack))?;
                }
            }
            return Ok(());
        }
        // The fused kernel overwrites its output; the op's contract is to add. The partial
        // input gradient is one more `[N, in]` of workspace, freed on return.
        let dyv = f32_view(self, dy)?;
        let mut part = {
            let _g = MemoryCategory::Workspace.enter();
            self.zeros(dx.shape().clone(), DType::F32)?
        };
        headroom_quant::matmul_backward_input(
            self,
            dyv.s()?,
            w,
            out(&mut part)?,
            &Default::default(),
        )?;
        self.axpy(1.0, &part, dx)?;
        Ok(())
    }

    fn linear(
        &self,
        y: &mut CpuTensor,
        x: &CpuTensor,
        w: &CpuTensor,
        b: Option<&CpuTensor>,
    ) -> Result<()> {
        let (oc, c) = weight_dims("linear", w)?;
        let n = x.numel() / c.max(1);
        expect_len("linear", "input", x, n * c)?;
        expect_len("linear", "output", y, n * oc)?;
        if let Some(b) = b {
            expect_len("linear", "bias", b, oc)?;
        }
        let wr = WeightRef::new(self, w)?;
        let mut scratch = wr.scratch(self, matmul::forward_scratch(n, c, oc))?;
        if let Some((w, xs)) = wr.bf16_in_place(x)? {
            let (y, dims, scratch) = (out(y)?, (n, c, oc), panel(&mut scratch)?);
            return with_bias(
                self,
                y,
                xs,
                w,
                b,
                dims,
                scratch,
                matmul::forward_bf16_products,
            );
        }
        let xv = f32_view(self, x)?;
        wr.forward(self, out(y)?, xv.s()?, b, n, c, oc, panel(&mut scratch)?)
    }

    fn linear_backward(
        &self,
        dx: &mut CpuTensor,
        dw: Option<&mut CpuTensor>,
        db: Option<&mut CpuTensor>,
        dy: &CpuTensor,
        x: &CpuTensor,
        w: &CpuTensor,
    ) -> Result<()> {
        let (oc, c) = weight_dims("linear backward", w)?;
        let n = x.numel() / c.max(1);
        expect_len("linear backward", "input", x, n * c)?;
        expect_len("linear backward", "input gradient", dx, n * c)?;
        expect_len("linear backward", "output gradient", dy, n * oc)?;
        if let Some(dw) = &dw {
            expect_len("linear backward", "weight gradient", dw, oc * c)?;
        }
        if let Some(db) = &db {
            expect_len("linear backward", "bias gradient", db, oc)?;
        }
        let dyv = f32_view(self, dy)?;
        let db = match db {
            Some(t) => Some(out(t)?),
            None => None,
        };
        let wr = WeightRef::new(self, w)?;
        let mut scratch = wr.scratch(self, matmul::backward_scratch(n, c, oc))?;
        let dw = match dw {
            Some(t) => Some(out(t)?),
            None => None,
        };
        let (dx, dy, scratch) = (out(dx)?, dyv.s()?, panel(&mut scratch)?);
        // The input is read for the weight's gradient only: a frozen weight's products never
        // see it (no view), a bf16 one on the AMX products reads it in place.
        if dw.is_none() {
            let no_input: &[f32] = &[];
            return wr.backward(dx, dw, db, dy, no_input, n, c, oc, scratch);
        }
        if let Some((w, xs)) = wr.bf16_in_place(x)? {
            matmul::backward_bf16_products(dx, dw, db, dy, xs, w, n, c, oc, scratch);
            return Ok(());
        }
        let xv = f32_view(self, x)?;
        wr.backward(dx, dw, db, dy, xv.s()?, n, c, oc, scratch)
    }

    fn layernorm(
        &self,
        y: &mut CpuTensor,
        mean: &mut CpuTensor,
        rstd: &mut CpuTensor,
        x: &CpuTensor,
        w: &CpuTensor,
        b: &CpuTensor,
    ) -> Result<()> {
        let (n, c) = rows_cols(x);
        expect_len("layernorm", "output", y, n * c)?;
        for (what, t) in [("mean", &*mean), ("rstd", &*rstd)] {
            expect_len("layernorm", what, t, n)?;
        }
        for (what, t) in [("weight", w), ("bias", b)] {
            expect_len("layernorm", what, t, c)?;
        }
        let (wv, bv) = (f32_view(self, w)?, f32_view(self, b)?);
        let (y, mean, rstd) = (out(y)?, out(mean)?, out(rstd)?);
        with_stored!(x, |xs| layernorm::forward(
            y,
            mean,
            rstd,
            xs,
            wv.s()?,
            bv.s()?,
            c
        ));
        Ok(())
    }

    fn layernorm_backward(
        &self,
        dx: &mut CpuTensor,
        dw: &mut CpuTensor,
        db: &mut CpuTensor,
        dy: &CpuTensor,
        x: &CpuTensor,
        w: &CpuTensor,
        mean: &CpuTensor,
        rstd: &CpuTensor,
    ) -> Result<()> {
        let (n, c) = rows_cols(x);
        for (what, t) in [("input gradient", &*dx), ("output gradient", dy)] {
            expect_len("layernorm backward", what, t, n * c)?;
        }
        for (what, t) in [
            ("weight", w),
            ("weight gradient", &*dw),
            ("bias gradient", &*db),
        ] {
            expect_len("layernorm backward", what, t, c)?;
        }
        for (what, t) in [("mean", mean), ("rstd", rstd)] {
            expect_len("layernorm backward", what, t, n)?;
        }
        let (wv, dyv) = (f32_view(self, w)?, f32_view(self, dy)?);
        let (dx, dw, db) = (out(dx)?, out(dw)?, out(db)?);
        let (mean, rstd) = (mean.as_slice::<f32>()?, rstd.as_slice::<f32>()?);
        with_stored!(x, |xs| layernorm::backward(
            dx,
            dw,
            db,
            dyv.s()?,
            xs,
            wv.s()?,
            mean,
            rstd,
            c
        ));
        Ok(())
    }

    fn rmsnorm(
        &self,
        y: &mut CpuTensor,
        rstd: &mut CpuTensor,
        x: &CpuTensor,
        w: &CpuTensor,
        norm: RmsNorm,
    ) -> Result<()> {
        let (n, c) = rows_cols(x);
        expect_len("rmsnorm", "output", y, n * c)?;
        expect_len("rmsnorm", "rstd", rstd, n)?;
        expect_len("rmsnorm", "weight", w, c)?;
        let wv = f32_view(self, w)?;
        let (y, rstd) = (out(y)?, out(rstd)?);
        let settings = (norm.eps, norm.gain_offset);
        with_stored!(x, |xs| rmsnorm::forward(y, rstd, xs, wv.s()?, settings, c));
        Ok(())
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut CpuTensor,
        dw: &mut CpuTensor,
        dy: &CpuTensor,
        x: &CpuTensor,
        w: &CpuTensor,
        rstd: &CpuTensor,
        norm: RmsNorm,
    ) -> Result<()> {
        let (n, c) = rows_cols(x);
        for (what, t) in [("input gradient", &*dx), ("output gradient", dy)] {
            expect_len("rmsnorm backward", what, t, n * c)?;
        }
        for (what, t) in [("weight", w), ("weight gradient", &*dw)] {
            expect_len("rmsnorm backward", what, t, c)?;
        }
        expect_len("rmsnorm backward", "rstd", rstd, n)?;
        let (dyv, wv) = (f32_view(self, dy)?, f32_view(self, w)?);
        let (dx, dw, rstd) = (out(dx)?, out(dw)?, rstd.as_slice::<f32>()?);
        with_stored!(x, |xs| rmsnorm::backward(
            dx,
            dw,
            dyv.s()?,
            xs,
            wv.s()?,
            rstd,
            norm.gain_offset,
            c
        ));
        Ok(())
    }

    fn gelu(&self, y: &mut CpuTensor, x: &CpuTensor) -> Result<()> {
        expect_len("gelu", "output", y, x.numel())?;
        let y = out(y)?;
        with_stored!(x, |xs| gelu::forward(y, xs));
        Ok(())
    }

    fn gelu_backward(&self, dx: &mut CpuTensor, x: &CpuTensor, dy: &CpuTensor) -> Result<()> {
        expect_len("gelu backward", "input gradient", dx, x.numel())?;
        expect_len("gelu backward", "output gradient", dy, x.numel())?;
        let (dx, dyv) = (out(dx)?, f32_view(self, dy)?);
        with_stored!(x, |xs| gelu::backward(dx, xs, dyv.s()?));
        Ok(())
    }

    fn gelu_backward_in_place(&self, dy: &mut CpuTensor, x: &CpuTensor) -> Result<()> {
        expect_len("gelu backward", "output gradient", dy, x.numel())?;
        let dy = out(dy)?;
        with_stored!(x, |xs| gelu::backward_in_place(dy, xs));
        Ok(())
    }

    fn gated(
        &self,
        y: &mut CpuTensor,
        gate: &CpuTensor,
        up: &CpuTensor,
        act: MlpGate,
    ) -> Result<()> {
        match act {
            MlpGate::Silu => gated::<glu::Silu>("swiglu", y, gate, up),
            MlpGate::GeluTanh => gated::<glu::GeluTanh>("geglu", y, gate, up),
        }
    }

    fn gated_backward(
        &self,
        dgate: &mut CpuTensor,
        dup: &mut CpuTensor,
        gate: &CpuTensor,
        up: &CpuTensor,
        dy: &CpuTensor,
        act: MlpGate,
    ) -> Result<()> {
        match act {
            MlpGate::Silu => {
                gated_backward::<glu::Silu>(self, "swiglu backward", dgate, dup, gate, up, dy)
            }
            MlpGate::GeluTanh => {
                gated_backward::<glu::GeluTanh>(self, "geglu backward", dgate, dup, gate, up, dy)
            }
        }
    }

    fn gated_backward_in_place(
        &self,
        dgate: &mut CpuTensor,
        dy: &mut CpuTensor,
        gate: &CpuTensor,
        up: &CpuTensor,
        act: MlpGate,
    ) -> Result<()> {
        match act {
            MlpGate::Silu => {
                gated_backward_in_place::<glu::Silu>("swiglu backward", dgate, dy, gate, up)
            }
            MlpGate::GeluTanh => {
                gated_backward_in_place::<glu::GeluTanh>("geglu backward", dgate, dy, gate, up)
            }
        }
    }

    fn rope(&self, x: &mut CpuTensor, rope: Rope, pos0: usize, inverse: bool) -> Result<()> {
        let [_, _, t, hs] = dims4("rope", x)?;
        if hs % 2 != 0 {
            return Err(bad("rope", format!("odd head dimension {hs}")));
        }
        let (cos, sin) = rope::tables_at(pos0, t, hs, rope);
        rope::apply(out(x)?, t, hs, &cos, &sin, inverse);
        Ok(())
    }

    fn rope_at(
        &self,
        x: &mut CpuTensor,
        rope: Rope,
        positions: &[u32],
        inverse: bool,
    ) -> Result<()> {
        let [b, h, t, hs] = dims4("rope", x)?;
        if hs % 2 != 0 {
            return Err(bad("rope", format!("odd head dimension {hs}")));
        }
        if positions.len() != b * t {
            return Err(bad(
                "rope",
                format!("{} positions for {b} rows of {t}", positions.len()),
            ));
        }
        // Packed documents' positions span at most a row: one table from the lowest serves
        // every document. A padded decode batch's rows sit at scattered positions: a table row
        // per token. Either way the table is no larger than `x`'s rows.
        let lo = positions.iter().copied().min().unwrap_or(0);
        let hi = positions.iter().copied().max().unwrap_or(0);
        let span = (hi - lo) as usize + 1;
        let (cos, sin, rows) = if span <= t {
            let (cos, sin) = rope::tables_at(lo as usize, span, hs, rope);
            (
                cos,
                sin,
                positions.iter().map(|&p| p - lo).collect::<Vec<_>>(),
            )
        } else {
            // Token r of sequence b reads table row b·t + r.
            let (cos, sin) = rope::tables_for(positions, hs, rope);
            let rows = (0..b * t)
                .map(|r| u32::try_from(r).map_err(|_| bad("rope", "rows exceed u32".into())))
                .collect::<Result<Vec<_>>>()?;
            (cos, sin, rows)
        };
        rope::apply_at(out(x)?, h, t, hs, &cos, &sin, &rows, inverse);
        Ok(())
    }

    fn concat_seq(&self, y: &mut CpuTensor, a: &CpuTensor, b: &CpuTensor) -> Result<()> {
        let [n, h, t, hs] = dims4("concat_seq", y)?;
        let [na, ha, ta, hsa] = dims4("concat_seq", a)?;
        let [nb, hb, tb, hsb] = dims4("concat_seq", b)?;
        if (na, ha, hsa) != (n, h, hs) || (nb, hb, hsb) != (n, h, hs) || ta + tb != t {
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
        if a.dtype() != y.dtype() || b.dtype() != y.dtype() {
            return Err(bad("concat_seq", "mixed dtypes".into()));
        }
        let row = hs * y.dtype().size_in_bytes();
        let (ra, rb) = (ta * row, tb * row);
        if ra + rb == 0 {
            return Ok(());
        }
        let (sa, sb) = (a.as_bytes(), b.as_bytes());
        for (i, dst) in y.as_bytes_mut().chunks_exact_mut(ra + rb).enumerate() {
            dst[..ra].copy_from_slice(&sa[i * ra..][..ra]);
            dst[ra..].copy_from_slice(&sb[i * rb..][..rb]);
        }
        Ok(())
    }

    fn write_seq(&self, y: &mut CpuTensor, at: usize, x: &CpuTensor, rows: usize) -> Result<()> {
        let [n, h, ty, hs] = dims4("write_seq", y)?;
        let [nx, hx, tx, hsx] = dims4("write_seq", x)?;
        let fits = at.checked_add(rows).is_some_and(|end| end <= ty) && rows <= tx;
        if (nx, hx, hsx) != (n, h, hs) || !fits {
            return Err(bad(
                "write_seq",
                format!(
                    "{rows} positions of {:?} at {at} of {:?}",
                    x.shape().dims(),
                    y.shape().dims()
                ),
            ));
        }
        if x.dtype() != y.dtype() {
            return Err(bad("write_seq", "mixed dtypes".into()));
        }
        let row = hs * y.dtype().size_in_bytes();
        let (len, from, to) = (rows * row, tx * row, ty * row);
        if len == 0 {
            return Ok(());
        }
        let src = x.as_bytes();
        for (i, dst) in y.as_bytes_mut().chunks_exact_mut(to).enumerate() {
            dst[at * row..][..len].copy_from_slice(&src[i * from..][..len]);
        }
        Ok(())
    }

    fn select_batch(
        &self,
        y: &mut CpuTensor,
        x: &CpuTensor,
        rows: &[usize],
        positions: usize,
    ) -> Result<()> {
        let ([_, h, ty, hs], tx) = super::ops::select_batch_shapes(y, x, rows, positions)?;
        let position = hs * y.dtype().size_in_bytes();
        let (len, from, to) = (positions * position, tx * position, ty * position);
        if len == 0 {
            return Ok(());
        }
        let src = x.as_bytes();
        for (dst_row, &r) in y.as_bytes_mut().chunks_exact_mut(h * to).zip(rows) {
            let src_row = &src[r * h * from..][..h * from];
            for (dst, head) in dst_row.chunks_exact_mut(to).zip(src_row.chunks_exact(from)) {
                dst[..len].copy_from_slice(&head[..len]);
            }
        }
        Ok(())
    }

    fn truncate_seq(&self, y: &mut CpuTensor, x: &CpuTensor) -> Result<()> {
        let [n, h, ty, hs] = dims4("truncate_seq", y)?;
        let [nx, hx, tx, hsx] = dims4("truncate_seq", x)?;
        if (nx, hx, hsx) != (n, h, hs) || ty > tx {
            return Err(bad(
                "truncate_seq",
                format!(
                    "{:?} is not a prefix of {:?}",
                    y.shape().dims(),
                    x.shape().dims()
                ),
            ));
        }
        if x.dtype() != y.dtype() {
            return Err(bad("truncate_seq", "mixed dtypes".into()));
        }
        let row = hs * y.dtype().size_in_bytes();
        let (keep, from) = (ty * row, tx * row);
        if keep == 0 {
            return Ok(());
        }
        let src = x.as_bytes();
        for (i, dst) in y.as_bytes_mut().chunks_exact_mut(keep).enumerate() {
            dst.copy_from_slice(&src[i * from..][..keep]);
        }
        Ok(())
    }

    fn embed(
        &self,
        y: &mut CpuTensor,
        tokens: &[u32],
        wte: &CpuTensor,
        wpe: Option<&CpuTensor>,
    ) -> Result<()> {
        let (vocab, c) = rows_cols(wte);
        expect_len("embed", "output", y, tokens.len() * c)?;
        if let Some(bad_id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(bad("embed", format!("token {bad_id} ≥ vocab {vocab}")));
        }
        let wpe = match wpe {
            Some(wpe) => {
                let t = y.shape().dims().get(1).copied().unwrap_or(1).max(1);
                if !tokens.len().is_multiple_of(t) || wpe.numel() < t * c {
                    return Err(bad("embed", format!("{t} positions do not fit the batch")));
                }
                Some((wpe, t))
            }
            None => None,
        };
        // The tables are read in place, row by row, whatever their dtype.
        let y = out(y)?;
        match wte.dtype() {
            DType::BF16 => embed_rows(self, y, tokens, wte.as_slice::<bf16>()?, wpe, c),
            DType::F16 => embed_rows(self, y, tokens, wte.as_slice::<f16>()?, wpe, c),
            _ => embed_rows(self, y, tokens, f32_view(self, wte)?.s()?, wpe, c),
        }
    }

    fn embed_backward(
        &self,
        dwte: &mut CpuTensor,
        dwpe: Option<&mut CpuTensor>,
        dy: &CpuTensor,
        tokens: &[u32],
        skip: Option<u32>,
    ) -> Result<()> {
        let (vocab, c) = rows_cols(dwte);
        expect_len("embed backward", "output gradient", dy, tokens.len() * c)?;
        if let Some(bad_id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(bad(
                "embed backward",
                format!("token {bad_id} ≥ vocab {vocab}"),
            ));
        }
        match dwpe {
            Some(_) if skip.is_some() => {
                return Err(bad(
                    "embed backward",
                    "a padding index with learned positions".into(),
                ))
            }
            Some(dwpe) => {
                let t = dy.shape().dims().get(1).copied().unwrap_or(1).max(1);
                if !tokens.len().is_multiple_of(t) || dwpe.numel() < t * c {
                    return Err(bad(
                        "embed backward",
                        format!("{t} positions do not fit the batch"),
                    ));
                }
                embedding::backward(out(dwte)?, out(dwpe)?, dy.as_slice::<f32>()?, tokens, t, c);
            }
            None => embedding::backward_tokens(out(dwte)?, dy.as_slice::<f32>()?, tokens, c, skip),
        }
        Ok(())
    }

    fn split_heads(&self, y: &mut CpuTensor, x: &CpuTensor, col: usize) -> Result<()> {
        let [b, h, t, hs] = dims4("split heads", y)?;
        let (rows, w) = rows_cols(x);
        if rows != b * t || col + h * hs > w {
            return Err(bad(
                "split heads",
                format!(
                    "{:?} columns {col}.. into {:?}",
                    x.shape().dims(),
                    y.shape().dims()
                ),
            ));
        }
        let (src, dst) = (x.as_slice::<f32>()?, out(y)?);
        if t * hs > 0 {
            use rayon::prelude::*;
            // Head by head of `dst` (each `[t, hs]`, contiguous), over the threads.
            dst[..b * h * t * hs]
                .par_chunks_mut(t * hs)
                .enumerate()
                .for_each(|(bh, head)| {
                    let (bi, hi) = (bh / h, bh % h);
                    for (ti, d) in head.chunks_exact_mut(hs).enumerate() {
                        d.copy_from_slice(&src[(bi * t + ti) * w + col + hi * hs..][..hs]);
                    }
                });
        }
        Ok(())
    }

    fn merge_heads(&self, y: &mut CpuTensor, x: &CpuTensor, col: usize) -> Result<()> {
        let [b, h, t, hs] = dims4("merge heads", x)?;
        let (rows, w) = rows_cols(y);
        if rows != b * t || col + h * hs > w {
            return Err(bad(
                "merge heads",
                format!(
                    "{:?} into columns {col}.. of {:?}",
                    x.shape().dims(),
                    y.shape().dims()
                ),
            ));
        }
        let dst = out(y)?;
        with_stored!(x, |src| merge_heads_rows(dst, src, [b, h, t, hs], w, col));
        Ok(())
    }

    fn round_to(&self, x: &mut CpuTensor, precision: Precision) -> Result<()> {
        round_slice(out(x)?, precision);
        Ok(())
    }

    fn head_loss(
        &self,
        losses: &mut CpuTensor,
        x: &CpuTensor,
        w: &CpuTensor,
        targets: &[u32],
        rows: usize,
        precision: Precision,
        logits_category: MemoryCategory,
        mut grads: Option<HeadLossGrads<'_, CpuTensor>>,
    ) -> Result<()> {
        let (v, c) = weight_dims("head", w)?;
        let n = targets.len();
        expect_len("head", "input", x, n * c)?;
        expect_len("head", "losses", losses, n)?;
        if let Some(bad_id) = targets.iter().find(|&&t| t as usize >= v) {
            return Err(bad("head", format!("target {bad_id} ≥ vocab {v}")));
        }
        if let Some(g) = &grads {
            expect_len("head", "input gradient", g.dx, n * c)?;
            if let Some(dw) = &g.dw {
                expect_len("head", "weight gradient", dw, v * c)?;
            }
        }
        let rows = rows.clamp(1, n.max(1));
        let wr = WeightRef::new(self, w)?;
        let train = grads.is_some();
        // Under bf16 the logits are stored in bf16, half the bytes: the loss reads them
        // widened (exactly) and writes its gradient rounded to bf16, as torch's bf16 `matmul`
        // receives it (on AMX the products would round it so anyway). The widening path reads
        // the gradient widened a piece at a time, cut where gemm cuts its sums. A small
        // vocabulary's stay f32, where the f32 strip the product goes through would cost more;
        // so do the widening path's where gemm's blocking is not known (see
        // `matmul::bf16_head_logits`).
        let bf16_logits = match wr {
            WeightRef::Bf16(w)
                if precision == Precision::Bf16
                    && matmul::bf16_head_logits(n, rows, c, v, train) =>
            {
                Some(w)
            }
            _ => None,
        };
        let mut scratch = {
            let _l = headroom_profiler::label_absolute("head.wte (f32 panel)");
            let bf16 = bf16_logits.is_some();
            wr.scratch(
                self,
                matmul::head_scratch(n, rows, c, v, train, bf16, self.num_threads()),
            )?
        };
        let _l = headroom_profiler::label_absolute(if rows < n {
            "head.logits[chunk]"
        } else {
            "head.logits"
        });
        // Overwritten chunk by chunk before it is read (the product does not read its
        // output): `uninit` spares clearing it (411 MB for `small`'s 8×256 batch without the
        // fused loss). In training the loss then overwrites each chunk with its gradient.
        let mut logits = {
            let _g = logits_category.enter();
            let dtype = if bf16_logits.is_some() {
                DType::BF16
            } else {
                DType::F32
            };
            self.uninit([rows, v], dtype)?
        };
        // bf16 logits: the weight, and the strip the product's f32 results pass through a
        // strip of columns at a time.
        let mut bf16_head = match bf16_logits {
            Some(w) => {
                let _l = headroom_profiler::label_absolute("head.logits (f32 strip)");
                let _g = MemoryCategory::Workspace.enter();
                Some((
                    w,
                    self.uninit([matmul::bf16_output_stage(n, rows, c, v)], DType::F32)?,
                ))
            }
            None => None,
        };
        if let Some(c) = grads.as_ref().and_then(|g| g.counted) {
            if c.len() != n {
                return Err(bad(
                    "head",
                    format!("{} counted flags for {n} rows", c.len()),
                ));
            }
        }
        let per_token = grads.as_ref().map_or(0.0, |g| g.dloss_per_token);
        let mut dloss = vec![per_token; rows];
        let xs = x.as_slice::<f32>()?;
        let mut r0 = 0;
        while r0 < n {
            let r = rows.min(n - r0);
            // A row that does not count is seeded with 0: its gradient row is exactly 0.
            if let Some(c) = grads.as_ref().and_then(|g| g.counted) {
                for (d, &k) in dloss.iter_mut().zip(&c[r0..r0 + r]) {
                    *d = if k { per_token } else { 0.0 };
                }
            }
            let xr = &xs[r0 * c..][..r * c];
            if let Some((w, stage)) = bf16_head.as_mut() {
                let w: &[bf16] = w;
                let lg = &mut logits.as_mut_slice::<bf16>()?[..r * v];
                let st = out(stage)?;
                let amx = matmul::bf16_products();
                if amx {
                    let sc = panel(&mut scratch)?;
                    matmul::forward_bf16_products_into_bf16(lg, xr, w, r, c, v, st, sc);
                } else {
                    let sc = panel(&mut scratch)?;
                    matmul::forward_with_into_bf16(lg, xr, w, r, c, v, st, sc);
                }
                let ls = &mut out(losses)?[r0..r0 + r];
                let tr = &targets[r0..r0 + r];
                match &mut grads {
                    Some(g) => {
                        cross_entropy::forward_backward_in_place_bf16(ls, lg, tr, &dloss[..r], v);
                        let dw = g.dw.as_deref_mut().map(out).transpose()?;
                        let dx = &mut out(g.dx)?[r0 * c..][..r * c];
                        let sc = panel(&mut scratch)?;
                        if amx {
                            matmul::backward_bf16_products(dx, dw, None, &*lg, xr, w, r, c, v, sc);
                        } else {
                            matmul::backward_with_bf16_grad(dx, dw, None, lg, xr, w, r, c, v, sc);
                        }
                    }
                    None => cross_entropy::forward_bf16(ls, lg, tr, v),
                }
                r0 += r;
                continue;
            }
            let lg = &mut out(&mut logits)?[..r * v];
            wr.forward(self, lg, xr, None, r, c, v, panel(&mut scratch)?)?;
            let ls = &mut out(losses)?[r0..r0 + r];
            match &mut grads {
                Some(g) => {
                    // The product's rounding to the run's precision happens row by row inside
                    // the loss, in cache (see `forward_backward_in_place_rounded`).
                    cross_entropy::forward_backward_in_place_rounded(
                        ls,
                        lg,
                        &targets[r0..r0 + r],
                        &dloss[..r],
                        v,
                        |row| round_row(row, precision),
                    );
                    let dl = &*lg;
                    // A tied head accumulates into the token embedding's gradient; no bias.
                    let dw = g.dw.as_deref_mut().map(out).transpose()?;
                    wr.backward(
                        &mut out(g.dx)?[r0 * c..][..r * c],
                        dw,
                        None,
                        dl,
                        xr,
                        r,
                        c,
                        v,
                        panel(&mut scratch)?,
                    )?;
                }
                None => {
                    // Evaluation only: a pass of its own is simpler, and no step waits on it.
                    round_slice(lg, precision);
                    cross_entropy::forward(ls, lg, &targets[r0..r0 + r], v)
                }
            }
            r0 += r;
        }
        Ok(())
    }
}

/// Round f32 values in place to `precision` and back.
fn round_slice(x: &mut [f32], precision: Precision) {
    use rayon::prelude::*;
    // Big buffers (an evaluation's logits are 100M values on `small`): split over threads.
    const CHUNK: usize = 1 << 15;
    if precision != Precision::Fp32 {
        x.par_chunks_mut(CHUNK)
            .for_each(|c| round_row(c, precision));
    }
}

/// [`round_slice`] on one thread: a row, or one task's chunk. bf16 takes the tensor crate's
/// branch-free rounding on the widest vectors allowed (the same bits as `half`).
fn round_row(x: &mut [f32], precision: Precision) {
    match precision {
        Precision::Fp32 => {}
        Precision::Bf16 => headroom_tensor::cpu::kernels::round_to_bf16_in_place(x),
        p @ Precision::Fp16 => {
            for v in x {
                *v = p.round(*v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use headroom_profiler::MemoryTracker;
    use headroom_quant::{MatmulOptions, QuantConfig, QuantizedTensor};
    use headroom_tensor::Device;

    use super::*;

    /// A bf16 run's 4-bit linear holds exactly the scratch the estimator counts for it, on
    /// top of its operands: with bf16 products one dequantized block and the packing buffer
    /// (no view of the input, no partial gradient); on the f32 kernel the input's f32 view and
    /// a panel per task forward, the partial gradient and a strip per task backward.
    #[test]
    fn bf16_four_bit_linear_scratch_is_what_the_estimator_counts() {
        let tracker = Arc::new(MemoryTracker::new());
        let cpu = Cpu::with_threads(2)
            .unwrap()
            .with_alloc_hook(tracker.clone());
        let (n, out_f, inn) = (16usize, 1100usize, 600usize);
        let wv = crate::ops::test_values(1, out_f * inn);
        let q = QuantizedTensor::quantize(&cpu, &wv, &[out_f, inn], QuantConfig::qlora()).unwrap();
        let xv: Vec<bf16> = crate::ops::test_values(2, n * inn)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let x = cpu.upload(&xv, [n, inn]).unwrap();
        let mut y = cpu.zeros([n, out_f], DType::F32).unwrap();
        let dy = cpu
            .upload(&crate::ops::test_values(3, n * out_f), [n, out_f])
            .unwrap();
        let mut dx = cpu.zeros([n, inn], DType::F32).unwrap();
        let workspace = || {
            let snap = tracker.snapshot();
            let dev = snap.device(Device::Cpu).unwrap();
            (
                dev.live[MemoryCategory::Workspace],
                dev.peak[MemoryCategory::Workspace],
            )
        };
        let (live, _) = workspace();
        tracker.reset_peak();
        cpu.linear_quantized(&mut y, &x, &q, None, Precision::Bf16)
            .unwrap();
        let fwd = workspace().1 - live;
        tracker.reset_peak();
        cpu.linear_quantized_input_grad(&mut dx, &dy, &q, Precision::Bf16)
            .unwrap();
        let bwd = workspace().1 - live;
        let threads = cpu.num_threads();
        let (want_fwd, want_bwd) = if matmul::bf16_products() {
            let bytes =
                |(block, pack): (usize, usize)| 4 * (block.div_ceil(2) + pack.div_ceil(2)) as u64;
            (
                bytes(quant_matmul::forward_scratch(n, &q, threads)),
                bytes(quant_matmul::backward_scratch(n, &q, threads)),
            )
        } else {
            let o = MatmulOptions::default();
            (
                (4 * n * inn + o.forward_workspace_bytes(out_f, inn, threads)) as u64,
                (4 * n * inn + o.backward_workspace_bytes(out_f, inn, threads)) as u64,
            )
        };
        assert_eq!((fwd, bwd), (want_fwd, want_bwd));
    }

    /// The bf16 head gives the bits of the f32-logits flow it replaces: the product in f32,
    /// rounded to bf16 values, the loss and its f32 gradient in place, the products reading
    /// that gradient rounded to bf16 where the logits are bf16 (on AMX the products round it
    /// so anyway) — whole and in chunks of rows, vocabularies below and above two bf16 output
    /// strips (where the logits become bf16: on the widening path too, for a product wide
    /// enough for gemm's depth cut, which 80 channels are), training and evaluation.
    #[test]
    fn bf16_head_gives_the_bits_of_the_f32_logits_flow() {
        let cpu = Cpu::with_threads(2).unwrap();
        let (n, c) = (21usize, 80usize);
        for v in [300usize, 2 * matmul::BF16_OUTPUT_STRIP + 77] {
            let xv: Vec<f32> = crate::ops::test_values(3, n * c)
                .into_iter()
                .map(|x| x * 4.0 - 2.0)
                .collect();
            let wv: Vec<bf16> = crate::ops::test_values(4, v * c)
                .into_iter()
                .map(|x| bf16::from_f32(x - 0.5))
                .collect();
            let targets: Vec<u32> = (0..n).map(|i| (i * 131 % v) as u32).collect();
            let dloss = 1.0 / n as f32;
            // The f32-logits flow, a chunk of `rows` at a time.
            let reference = |rows: usize, train: bool| {
                let mut losses = vec![0f32; n];
                let (mut dx, mut dw) = (vec![0f32; n * c], vec![0f32; v * c]);
                let mut scratch = vec![0f32; matmul::chunked_scratch(n, rows, c, v, true)];
                for r0 in (0..n).step_by(rows) {
                    let r = rows.min(n - r0);
                    let xr = &xv[r0 * c..][..r * c];
                    let mut lg = vec![0f32; r * v];
                    if matmul::bf16_products() {
                        matmul::forward_bf16_products(
                            &mut lg,
                            xr,
                            &wv,
                            None,
                            r,
                            c,
                            v,
                            &mut scratch,
                        );
                    } else {
                        matmul::forward_with(&mut lg, xr, &wv, None, r, c, v, &mut scratch);
                    }
                    round_slice(&mut lg, Precision::Bf16);
                    let ls = &mut losses[r0..r0 + r];
                    let tr = &targets[r0..r0 + r];
                    if !train {
                        cross_entropy::forward(ls, &lg, tr, v);
                        continue;
                    }
                    cross_entropy::forward_backward_in_place(ls, &mut lg, tr, &vec![dloss; r], v);
                    if matmul::bf16_head_logits(n, rows, c, v, true) {
                        round_slice(&mut lg, Precision::Bf16);
                    }
                    let dxr = &mut dx[r0 * c..][..r * c];
                    if matmul::bf16_products() {
                        matmul::backward_bf16_products(
                            dxr,
                            Some(&mut dw),
                            None,
                            &lg,
                            xr,
                            &wv,
                            r,
                            c,
                            v,
                            &mut scratch,
                        );
                    } else {
                        matmul::backward_with(
                            dxr,
                            Some(&mut dw),
                            None,
                            &lg,
                            xr,
                            &wv,
                            r,
                            c,
                            v,
                            &mut scratch,
                        );
                    }
                }
                [losses, dx, dw].concat()
            };
            let x = cpu.upload(&xv, [n, c]).unwrap();
            let w = cpu.upload(&wv, [v, c]).unwrap();
            for rows in [n, 8] {
                for train in [true, false] {
                    let mut losses = cpu.zeros([n], DType::F32).unwrap();
                    let mut dx = cpu.zeros([n, c], DType::F32).unwrap();
                    let mut dw = cpu.zeros([v, c], DType::F32).unwrap();
                    let grads = train.then_some(HeadLossGrads {
                        dloss_per_token: dloss,
                        counted: None,
                        dx: &mut dx,
                        dw: Some(&mut dw),
                    });
                    cpu.head_loss(
                        &mut losses,
                        &x,
                        &w,
                        &targets,
                        rows,
                        Precision::Bf16,
                        MemoryCategory::Activations,
                        grads,
                    )
                    .unwrap();
                    let got = [
                        cpu.download::<f32>(&losses).unwrap(),
                        cpu.download::<f32>(&dx).unwrap(),
                        cpu.download::<f32>(&dw).unwrap(),
                    ]
                    .concat();
                    let want = reference(rows, train);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "vocab {v}, rows {rows}, train {train}"
                    );
                }
            }
        }
    }
}
