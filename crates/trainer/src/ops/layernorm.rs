//! Layer normalisation over the last dimension, llm.c style: forward saves the per-row mean
//! and reciprocal standard deviation so backward needs no second pass over statistics.

use super::matmul::Operand;
use super::widened_rows;

const EPS: f32 = 1e-5;

/// `out = (x - mean) · rstd · weight + bias` per row of `c`; writes `mean[n]` and `rstd[n]`.
/// `inp` in its stored type (see [`super::widened_rows`]).
pub fn forward<X: Operand>(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[X],
    weight: &[f32],
    bias: &[f32],
    c: usize,
) {
    let mut rows = out
        .chunks_exact_mut(c.max(1))
        .zip(mean.iter_mut())
        .zip(rstd.iter_mut());
    widened_rows(inp, c, |x| {
        let Some(((o, m), r)) = rows.next() else {
            return;
        };
        let mu = x.iter().sum::<f32>() / c as f32;
        let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / c as f32;
        let s = 1.0 / (var + EPS).sqrt();
        for i in 0..c {
            o[i] = (x[i] - mu) * s * weight[i] + bias[i];
        }
        *m = mu;
        *r = s;
    });
}

/// Accumulate `dinp`, `dweight`, `dbias` from `dout`, using the saved `mean` and `rstd`;
/// `inp` in its stored type.
#[allow(clippy::too_many_arguments)]
pub fn backward<X: Operand>(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[X],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    c: usize,
) {
    let mut rows = dinp
        .chunks_exact_mut(c.max(1))
        .zip(dout.chunks_exact(c.max(1)))
        .zip(mean)
        .zip(rstd);
    widened_rows(inp, c, |x| {
        let Some((((di, d), &mu), &s)) = rows.next() else {
            return;
        };
        // Two reductions over the row: mean of dnorm and of dnorm · norm.
        let (mut dnorm_mean, mut dnorm_norm_mean) = (0f32, 0f32);
        for i in 0..c {
            let norm = (x[i] - mu) * s;
            let dnorm = weight[i] * d[i];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean /= c as f32;
        dnorm_norm_mean /= c as f32;
        for i in 0..c {
            let norm = (x[i] - mu) * s;
            let dnorm = weight[i] * d[i];
            dbias[i] += d[i];
            dweight[i] += norm * d[i];
            di[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
    });
}
