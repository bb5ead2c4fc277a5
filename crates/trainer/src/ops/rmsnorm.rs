//! RMSNorm over the last dimension (Llama's): no mean subtraction, no bias. Forward keeps the
//! per-row reciprocal root-mean-square so backward needs no second pass over statistics.

use super::matmul::Operand;
use super::widened_rows;

/// `out = (weight + offset) · (x · rstd)` per row of `c`, `rstd = 1/√(mean(x²) + eps)`;
/// writes `rstd[n]`. The mean of squares is summed in f64 (one rounding at the end), so it
/// does not depend on the row's length or order of magnitude the way an f32 running sum does.
/// `inp` in its stored type (see [`super::widened_rows`]). `offset` is 0, or Gemma's 1 (its
/// gains are stored as their difference from 1); `weight + offset` is one f32 rounding, as
/// transformers' `1.0 + weight.float()` is.
pub fn forward<X: Operand>(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[X],
    weight: &[f32],
    (eps, offset): (f32, f32),
    c: usize,
) {
    let mut rows = out.chunks_exact_mut(c.max(1)).zip(rstd.iter_mut());
    widened_rows(inp, c, |x| {
        let Some((o, r)) = rows.next() else {
            return;
        };
        let ms = (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / c as f64) as f32;
        let s = 1.0 / (ms + eps).sqrt();
        for i in 0..c {
            o[i] = (weight[i] + offset) * (x[i] * s);
        }
        *r = s;
    });
}

/// Accumulate `dinp` and `dweight` from `dout`, using the saved `rstd`:
/// `dx = rstd · (w·dy − x̂ · mean(w·dy · x̂))` with `x̂ = x · rstd` and `w` the gain plus
/// `offset` (as [`forward`]); `inp` in its stored type. `dweight`, the stored gain's gradient,
/// does not depend on the offset.
#[allow(clippy::too_many_arguments)]
pub fn backward<X: Operand>(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[X],
    weight: &[f32],
    rstd: &[f32],
    offset: f32,
    c: usize,
) {
    let mut rows = dinp
        .chunks_exact_mut(c.max(1))
        .zip(dout.chunks_exact(c.max(1)))
        .zip(rstd);
    widened_rows(inp, c, |x| {
        let Some(((di, d), &s)) = rows.next() else {
            return;
        };
        let mut dot = 0f64;
        for i in 0..c {
            dot += ((weight[i] + offset) * d[i]) as f64 * (x[i] * s) as f64;
        }
        let mean = (dot / c as f64) as f32;
        for i in 0..c {
            let norm = x[i] * s;
            dweight[i] += norm * d[i];
            di[i] += ((weight[i] + offset) * d[i] - norm * mean) * s;
        }
    });
}
