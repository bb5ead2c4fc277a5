//! Rotary position embeddings in Hugging Face's rotate-half layout: in a head of `hs`
//! dimensions, dimension `i < hs/2` and dimension `i + hs/2` form one pair, rotated by the
//! angle `t · θ^(−2i/hs)` at position `t`.
//!
//! The angles follow transformers' `LlamaRotaryEmbedding` in f32 (inverse frequencies as
//! `1 / θ^(2i/hs)`, the angle as the f32 product `t · inv_freq`); cos and sin are evaluated
//! in f64 and rounded, within an ulp of torch's f32 ones.

use rayon::prelude::*;

/// `cos` and `sin` of every (position, frequency): two `[t, hs/2]` tables.
pub fn tables(t: usize, hs: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    tables_at(0, t, hs, theta)
}

/// [`tables`] for positions `pos0 .. pos0 + t` (a cached decode's new rows): row `r` holds
/// the angles of position `pos0 + r`, the same values [`tables`] gives at that position.
pub fn tables_at(pos0: usize, t: usize, hs: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    tables_of((pos0..pos0 + t).map(|p| p as f32), t, hs, theta)
}

/// [`tables`] for the given positions: row `r` holds the angles of `positions[r]`, the same
/// values [`tables`] gives at that position.
pub fn tables_for(positions: &[u32], hs: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    tables_of(
        positions.iter().map(|&p| p as f32),
        positions.len(),
        hs,
        theta,
    )
}

/// The `[rows, hs/2]` tables of `rows` positions, one row per position in order.
fn tables_of(
    positions: impl Iterator<Item = f32>,
    rows: usize,
    hs: usize,
    theta: f32,
) -> (Vec<f32>, Vec<f32>) {
    let half = hs / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / hs as f32))
        .collect();
    let mut cos = vec![0f32; rows * half];
    let mut sin = vec![0f32; rows * half];
    for (row, pos) in positions.take(rows).enumerate() {
        for (i, &f) in inv_freq.iter().enumerate() {
            let angle = (pos * f) as f64;
            cos[row * half + i] = angle.cos() as f32;
            sin[row * half + i] = angle.sin() as f32;
        }
    }
    (cos, sin)
}

/// One row's pairs by the angles whose cosines and sines are `c` and `s` (`hs/2` each).
#[inline]
fn rotate(row: &mut [f32], c: &[f32], s: &[f32], sign: f32) {
    let (a, b) = row.split_at_mut(c.len());
    for i in 0..c.len() {
        let (x1, x2) = (a[i], b[i]);
        let si = sign * s[i];
        a[i] = x1 * c[i] - x2 * si;
        b[i] = x2 * c[i] + x1 * si;
    }
}

/// [`apply`] to `x` `[B, heads, t, hs]` with row `r` of sequence `b` at table row
/// `positions[b·t + r]` (packed documents): the same arithmetic as at that position in `apply`.
#[allow(clippy::too_many_arguments)]
pub fn apply_at(
    x: &mut [f32],
    heads: usize,
    t: usize,
    hs: usize,
    cos: &[f32],
    sin: &[f32],
    positions: &[u32],
    inverse: bool,
) {
    let half = hs / 2;
    let sign = if inverse { -1.0f32 } else { 1.0 };
    x.par_chunks_mut(t * hs).enumerate().for_each(|(bh, head)| {
        let rows = &positions[(bh / heads.max(1)) * t..][..t];
        for (row, &pos) in head.chunks_exact_mut(hs).zip(rows) {
            let pos = pos as usize;
            rotate(
                row,
                &cos[pos * half..][..half],
                &sin[pos * half..][..half],
                sign,
            );
        }
    });
}

/// Rotate `x` `[B·H, t, hs]` in place: `(a, b) → (a·cos − b·sin, b·cos + a·sin)` for each pair
/// `(a, b) = (x[i], x[i + hs/2])`, or by the negative angle when `inverse` (the backward).
pub fn apply(x: &mut [f32], t: usize, hs: usize, cos: &[f32], sin: &[f32], inverse: bool) {
    let half = hs / 2;
    let sign = if inverse { -1.0f32 } else { 1.0 };
    x.par_chunks_mut(t * hs).for_each(|head| {
        for (pos, row) in head.chunks_exact_mut(hs).enumerate() {
            rotate(
                row,
                &cos[pos * half..][..half],
                &sin[pos * half..][..half],
                sign,
            );
        }
    });
}
