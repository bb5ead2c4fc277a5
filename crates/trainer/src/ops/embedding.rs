//! Token + learned position embeddings.

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
