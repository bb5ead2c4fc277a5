//! Token embeddings, plus learned position embeddings where the family has them (GPT-2).
//! The tables may be stored in any [`Operand`] type (a bf16 run reads its working copy in
//! place); widening to f32 is exact, so the output is the same as from an f32 copy.

use super::matmul::Operand;

/// `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]`. Tokens were validated against the vocab
/// by the caller.
pub fn forward<W: Operand, P: Operand>(
    out: &mut [f32],
    tokens: &[u32],
    wte: &[W],
    wpe: &[P],
    t: usize,
    c: usize,
) {
    for (i, (o, &tok)) in out.chunks_exact_mut(c).zip(tokens).enumerate() {
        let pos = i % t;
        let e = &wte[tok as usize * c..(tok as usize + 1) * c];
        let p = &wpe[pos * c..(pos + 1) * c];
        for j in 0..c {
            o[j] = e[j].to_f32() + p[j].to_f32();
        }
    }
}

/// Accumulate `dwte` and `dwpe` from `dout`, rows in token order (deterministic).
pub fn backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    t: usize,
    c: usize,
) {
    for (i, (d, &tok)) in dout.chunks_exact(c).zip(tokens).enumerate() {
        let pos = i % t;
        let e = &mut dwte[tok as usize * c..(tok as usize + 1) * c];
        for j in 0..c {
            e[j] += d[j];
        }
        let p = &mut dwpe[pos * c..(pos + 1) * c];
        for j in 0..c {
            p[j] += d[j];
        }
    }
}

/// `out[b, t, :] = wte[tokens[b, t], :]` (Llama: positions enter through the rotary
/// embedding instead).
pub fn forward_tokens<W: Operand>(out: &mut [f32], tokens: &[u32], wte: &[W], c: usize) {
    for (o, &tok) in out.chunks_exact_mut(c).zip(tokens) {
        W::widen(&wte[tok as usize * c..(tok as usize + 1) * c], o);
    }
}

/// Accumulate `dwte` from `dout`, rows in token order (deterministic).
pub fn backward_tokens(
    dwte: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    c: usize,
    skip: Option<u32>,
) {
    for (d, &tok) in dout.chunks_exact(c).zip(tokens) {
        if Some(tok) == skip {
            continue;
        }
        for (e, g) in dwte[tok as usize * c..(tok as usize + 1) * c]
            .iter_mut()
            .zip(d)
        {
            *e += g;
        }
    }
}
