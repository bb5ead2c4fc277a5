//! Token embeddings, plus learned position embeddings where the family has them (GPT-2).

/// `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]`. Tokens were validated against the vocab
/// by the caller.
pub fn forward(out: &mut [f32], tokens: &[u32], wte: &[f32], wpe: &[f32], t: usize, c: usize) {
    for (i, (o, &tok)) in out.chunks_exact_mut(c).zip(tokens).enumerate() {
        let pos = i % t;
        let e = &wte[tok as usize * c..(tok as usize + 1) * c];
        let p = &wpe[pos * c..(pos + 1) * c];
        for j in 0..c {
            o[j] = e[j] + p[j];
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
pub fn forward_tokens(out: &mut [f32], tokens: &[u32], wte: &[f32], c: usize) {
    for (o, &tok) in out.chunks_exact_mut(c).zip(tokens) {
        o.copy_from_slice(&wte[tok as usize * c..(tok as usize + 1) * c]);
    }
}

/// Accumulate `dwte` from `dout`, rows in token order (deterministic).
pub fn backward_tokens(dwte: &mut [f32], dout: &[f32], tokens: &[u32], c: usize) {
    for (d, &tok) in dout.chunks_exact(c).zip(tokens) {
        for (e, g) in dwte[tok as usize * c..(tok as usize + 1) * c]
            .iter_mut()
            .zip(d)
        {
            *e += g;
        }
    }
}
