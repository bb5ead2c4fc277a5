//! Token + position embeddings (headroom-trainer's `ops::embedding`) on the device.

use headroom_tensor::{DType, Result, Tensor};

use super::{column_grid, dim_u32, expect_dtype, expect_f32, rows_of, OpLaunch};
use crate::device::Cuda;
use crate::tensor::CudaTensor;

/// Vocabulary rows owned by one block of the `dwte` scatter. Any value gives the same bits
/// (each element's additions happen in token order whatever the split); it only trades
/// parallelism (more blocks) against every block scanning all tokens once.
const VOCAB_PER_BLOCK: u32 = 512;

/// The sizes both directions share, after checking them.
struct EmbeddingDims {
    rows: u64,
    t: u32,
    c: u32,
    vocab: u32,
}

fn check_dims(
    op: &'static str,
    tokens: &CudaTensor,
    wte: &CudaTensor,
    wpe: &CudaTensor,
    t: usize,
    c: usize,
) -> Result<EmbeddingDims> {
    expect_dtype(op, tokens, DType::U32)?;
    expect_dtype(op, wte, DType::F32)?;
    expect_dtype(op, wpe, DType::F32)?;
    let c32 = dim_u32(op, wte, "c must be in 1..=u32::MAX", c)?;
    let t32 = dim_u32(op, tokens, "t must be in 1..=u32::MAX", t)?;
    // tokens is [B, T]: whole sequences only, like the CPU op's `i % t`.
    rows_of(op, tokens, t, "the element count is not a multiple of t")?;
    let vocab = rows_of(op, wte, c, "the element count is not a multiple of c")?;
    let vocab = dim_u32(op, wte, "vocab must be in 1..=u32::MAX", vocab)?;
    // wpe is [max_t, C] with max_t >= t.
    let positions = rows_of(op, wpe, c, "the element count is not a multiple of c")?;
    if positions < t {
        return Err(headroom_tensor::Error::InvalidShape {
            op,
            shape: wpe.shape().clone(),
            reason: "wpe has fewer positions than the sequence length t",
        });
    }
    Ok(EmbeddingDims {
        rows: tokens.numel() as u64,
        t: t32,
        c: c32,
        vocab,
    })
}

/// `(rows, c, vocab)` of the token-only embedding, after checking dtypes and sizes.
fn check_tokens(
    op: &'static str,
    tokens: &CudaTensor,
    wte: &CudaTensor,
    c: usize,
) -> Result<(u64, u32, u32)> {
    expect_dtype(op, tokens, DType::U32)?;
    expect_dtype(op, wte, DType::F32)?;
    let c32 = dim_u32(op, wte, "c must be in 1..=u32::MAX", c)?;
    let vocab = rows_of(op, wte, c, "the element count is not a multiple of c")?;
    let vocab = dim_u32(op, wte, "vocab must be in 1..=u32::MAX", vocab)?;
    Ok((tokens.numel() as u64, c32, vocab))
}

impl Cuda {
    /// `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]`, bitwise equal to the CPU op.
    ///
    /// `tokens` is u32 `[B, T]` (any shape of `B·T` elements), `wte` f32 `[V, c]`, `wpe` f32
    /// `[max_t ≥ t, c]`, `out` f32 with `B·T·c` elements. Tokens are validated by the caller
    /// (as on the CPU); a token ≥ V is never read out of bounds: its row becomes NaN.
    pub fn embedding_forward(
        &self,
        out: &mut CudaTensor,
        tokens: &CudaTensor,
        wte: &CudaTensor,
        wpe: &CudaTensor,
        t: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_forward";
        self.check_devices(OP, &[out, tokens, wte, wpe])?;
        let d = check_dims(OP, tokens, wte, wpe, t, c)?;
        expect_f32(OP, out, tokens.numel() * c)?;
        if d.rows == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, "embedding_forward_f32")?;
        let (tok, wte_b, wpe_b) = (
            self.buffer(OP, tokens)?,
            self.buffer(OP, wte)?,
            self.buffer(OP, wpe)?,
        );
        let out_b = self.buffer_mut(OP, out)?;
        let cfg = self.elementwise_config(d.rows as usize * c);
        let mut launch = OpLaunch::new(self, "embedding_forward_f32", &func);
        launch
            .output(out_b)
            .input(tok)
            .input(wte_b)
            .input(wpe_b)
            .u64(&d.rows)
            .u32(&d.t)
            .u32(&d.c)
            .u32(&d.vocab);
        // SAFETY: out holds rows·c f32, tokens rows u32, wte vocab·c f32, wpe at least t·c f32
        // (all checked above); out is borrowed mutably, so it aliases nothing.
        unsafe { launch.launch(self, OP, cfg) }
    }

    /// Accumulate `dwte` and `dwpe` from `dout` — bitwise equal to the CPU op, without
    /// atomics: every gradient element is owned by one thread, which adds the rows that touch
    /// it in row order (see `kernels/cu/embedding.cu`). Tokens ≥ V are skipped.
    pub fn embedding_backward(
        &self,
        dwte: &mut CudaTensor,
        dwpe: &mut CudaTensor,
        dout: &CudaTensor,
        tokens: &CudaTensor,
        t: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_backward";
        self.check_devices(OP, &[dwte, dwpe, dout, tokens])?;
        let d = check_dims(OP, tokens, dwte, dwpe, t, c)?;
        expect_f32(OP, dout, tokens.numel() * c)?;
        if d.rows == 0 {
            return Ok(());
        }
        let wte_fn = self.op_function(OP, "embedding_backward_wte_f32")?;
        let wpe_fn = self.op_function(OP, "embedding_backward_wpe_f32")?;
        let (dout_b, tok) = (self.buffer(OP, dout)?, self.buffer(OP, tokens)?);
        {
            let vocab_blocks = d.vocab.div_ceil(VOCAB_PER_BLOCK);
            let dwte_b = self.buffer_mut(OP, dwte)?;
            let mut launch = OpLaunch::new(self, "embedding_backward_wte_f32", &wte_fn);
            launch
                .output(dwte_b)
                .input(dout_b)
                .input(tok)
                .u64(&d.rows)
                .u32(&d.c)
                .u32(&d.vocab)
                .u32(&VOCAB_PER_BLOCK);
            // SAFETY: dwte holds vocab·c f32, dout rows·c f32, tokens rows u32 (checked); the
            // grid covers every (vocabulary block, channel block) pair.
            unsafe { launch.launch(self, OP, column_grid(vocab_blocks, d.c))? };
        }
        let positions = d.t as usize * c;
        let cfg = self.elementwise_config(positions);
        let dwpe_b = self.buffer_mut(OP, dwpe)?;
        let mut launch = OpLaunch::new(self, "embedding_backward_wpe_f32", &wpe_fn);
        launch
            .output(dwpe_b)
            .input(dout_b)
            .u64(&d.rows)
            .u32(&d.t)
            .u32(&d.c);
        // SAFETY: dwpe holds at least t·c f32, dout rows·c f32 with rows a multiple of t.
        unsafe { launch.launch(self, OP, cfg) }
    }

    /// `out[row, :] = wte[tokens[row], :]`: the token embedding alone (no learned positions),
    /// bitwise the CPU's copy. `tokens` u32 `[rows]`, `wte` f32 `[V, c]`, `out` f32
    /// `[rows, c]`; a token ≥ V gives a NaN row, never an out-of-bounds read.
    pub fn embedding_forward_tokens(
        &self,
        out: &mut CudaTensor,
        tokens: &CudaTensor,
        wte: &CudaTensor,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_forward_tokens";
        self.check_devices(OP, &[out, tokens, wte])?;
        let (rows, c32, vocab) = check_tokens(OP, tokens, wte, c)?;
        expect_f32(OP, out, tokens.numel() * c)?;
        if rows == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, "embedding_forward_tokens_f32")?;
        let (tok, wte_b) = (self.buffer(OP, tokens)?, self.buffer(OP, wte)?);
        let out_b = self.buffer_mut(OP, out)?;
        let mut launch = OpLaunch::new(self, "embedding_forward_tokens_f32", &func);
        launch
            .output(out_b)
            .input(tok)
            .input(wte_b)
            .u64(&rows)
            .u32(&c32)
            .u32(&vocab);
        // SAFETY: out holds rows·c f32, tokens rows u32, wte vocab·c f32 (checked); out is
        // borrowed mutably, so it aliases nothing.
        unsafe { launch.launch(self, OP, self.elementwise_config(rows as usize * c)) }
    }

    /// Accumulate `dwte` from `dout` for the token embedding alone: the owner-computes
    /// scatter of [`Cuda::embedding_backward`] without the positions, bitwise the CPU's.
    pub fn embedding_backward_tokens(
        &self,
        dwte: &mut CudaTensor,
        dout: &CudaTensor,
        tokens: &CudaTensor,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_backward_tokens";
        self.check_devices(OP, &[dwte, dout, tokens])?;
        let (rows, c32, vocab) = check_tokens(OP, tokens, dwte, c)?;
        expect_f32(OP, dout, tokens.numel() * c)?;
        if rows == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, "embedding_backward_wte_f32")?;
        let (dout_b, tok) = (self.buffer(OP, dout)?, self.buffer(OP, tokens)?);
        let vocab_blocks = vocab.div_ceil(VOCAB_PER_BLOCK);
        let dwte_b = self.buffer_mut(OP, dwte)?;
        let mut launch = OpLaunch::new(self, "embedding_backward_wte_f32", &func);
        launch
            .output(dwte_b)
            .input(dout_b)
            .input(tok)
            .u64(&rows)
            .u32(&c32)
            .u32(&vocab)
            .u32(&VOCAB_PER_BLOCK);
        // SAFETY: dwte holds vocab·c f32, dout rows·c f32, tokens rows u32 (checked); the grid
        // covers every (vocabulary block, channel block) pair.
        unsafe { launch.launch(self, OP, column_grid(vocab_blocks, c32)) }
    }
}
