//! Deterministic CPU kernels for the reference layers: matrix products, GELU, layer norm.
//!
//! Every output element is reduced in a fixed order that depends only on the shapes, never on
//! the number of threads (work is split by output rows), so recomputing a forward reproduces
//! it bit for bit — the property checkpointing relies on. The products are written as
//! row-times-matrix updates (`c[i, :] += a[i, k] · b[k, :]`), which LLVM vectorises without
//! reassociating any sum; the one dot-product form ([`matmul_bt`]) uses a fixed set of lanes.

use rayon::prelude::*;

/// Rows per parallel task: small matrices stay on one thread.
const ROWS_PER_TASK: usize = 16;

/// Lanes of the dot product in [`matmul_bt`].
const LANES: usize = 8;

/// `c[m×n] = a[m×k] · b[k×n]`. Each element sums over `k` in ascending order.
pub fn matmul(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    debug_assert!(a.len() == m * k && b.len() == k * n && c.len() == m * n);
    if n == 0 {
        return;
    }
    let row = |(i, c_row): (usize, &mut [f32])| {
        c_row.fill(0.0);
        let a_row = &a[i * k..(i + 1) * k];
        for (kk, &aik) in a_row.iter().enumerate() {
            let b_row = &b[kk * n..(kk + 1) * n];
            for (c, &b) in c_row.iter_mut().zip(b_row) {
                *c += aik * b;
            }
        }
    };
    if m * k * n < 1 << 16 {
        c.chunks_mut(n).enumerate().for_each(row);
    } else {
        c.par_chunks_mut(n)
            .with_min_len(ROWS_PER_TASK)
            .enumerate()
            .for_each(row);
    }
}

/// `c[m×n] = a[m×k] · bᵀ` with `b` stored `[n×k]`: dot products over 8 fixed lanes, combined in
/// a fixed order.
pub fn matmul_bt(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    debug_assert!(a.len() == m * k && b.len() == n * k && c.len() == m * n);
    if n == 0 {
        return;
    }
    let row = |(i, c_row): (usize, &mut [f32])| {
        let a_row = &a[i * k..(i + 1) * k];
        for (j, c) in c_row.iter_mut().enumerate() {
            *c = dot(a_row, &b[j * k..(j + 1) * k]);
        }
    };
    if m * k * n < 1 << 16 {
        c.chunks_mut(n).enumerate().for_each(row);
    } else {
        c.par_chunks_mut(n)
            .with_min_len(ROWS_PER_TASK)
            .enumerate()
            .for_each(row);
    }
}

#[inline]
fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut xs = x.chunks_exact(LANES);
    let mut ys = y.chunks_exact(LANES);
    for (xc, yc) in (&mut xs).zip(&mut ys) {
        for l in 0..LANES {
            acc[l] += xc[l] * yc[l];
        }
    }
    for (l, (&x, &y)) in xs.remainder().iter().zip(ys.remainder()).enumerate() {
        acc[l] += x * y;
    }
    let a = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (a[0] + a[2]) + (a[1] + a[3])
}

/// `g[k×n] += aᵀ · d` with `a` `[m×k]` and `d` `[m×n]` (a weight gradient), accumulating row
/// `i` of the batch in ascending order into each element.
pub fn matmul_at_acc(a: &[f32], d: &[f32], g: &mut [f32], m: usize, k: usize, n: usize) {
    debug_assert!(a.len() == m * k && d.len() == m * n && g.len() == k * n);
    if n == 0 {
        return;
    }
    let row = |(r, g_row): (usize, &mut [f32])| {
        for i in 0..m {
            let air = a[i * k + r];
            let d_row = &d[i * n..(i + 1) * n];
            for (g, &d) in g_row.iter_mut().zip(d_row) {
                *g += air * d;
            }
        }
    };
    if m * k * n < 1 << 16 {
        g.chunks_mut(n).enumerate().for_each(row);
    } else {
        g.par_chunks_mut(n)
            .with_min_len(ROWS_PER_TASK)
            .enumerate()
            .for_each(row);
    }
}

/// `g[n] += Σ_i d[i, :]` (a bias gradient), rows in ascending order.
pub fn sum_rows_acc(d: &[f32], g: &mut [f32], n: usize) {
    if n == 0 {
        return;
    }
    for d_row in d.chunks_exact(n) {
        for (g, &d) in g.iter_mut().zip(d_row) {
            *g += d;
        }
    }
}

/// `x[i, :] += bias` for every row.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    if bias.is_empty() {
        return;
    }
    for row in x.chunks_exact_mut(bias.len()) {
        for (x, &b) in row.iter_mut().zip(bias) {
            *x += b;
        }
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

/// GELU, tanh approximation (as GPT-2).
#[inline]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + GELU_C * x * x * x)).tanh())
}

/// Derivative of [`gelu`].
#[inline]
pub fn gelu_grad(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_C * x * x * x);
    let th = u.tanh();
    let sech2 = 1.0 - th * th;
    0.5 * (1.0 + th) + 0.5 * x * sech2 * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x)
}

/// `y = gelu(x)` elementwise.
pub fn gelu_into(x: &[f32], y: &mut [f32]) {
    y.par_iter_mut()
        .with_min_len(1 << 12)
        .zip(x.par_iter())
        .for_each(|(y, &x)| *y = gelu(x));
}

/// `d *= gelu'(x)` elementwise.
pub fn gelu_backward_inplace(x: &[f32], d: &mut [f32]) {
    d.par_iter_mut()
        .with_min_len(1 << 12)
        .zip(x.par_iter())
        .for_each(|(d, &x)| *d *= gelu_grad(x));
}

/// Layer-norm epsilon.
pub const LN_EPS: f32 = 1e-5;

/// Per-row mean and reciprocal standard deviation of `x[m×n]`, into `stats[m×2]`.
pub fn layernorm_stats(x: &[f32], stats: &mut [f32], n: usize) {
    if n == 0 {
        return;
    }
    for (row, st) in x.chunks_exact(n).zip(stats.chunks_exact_mut(2)) {
        let mean = row.iter().sum::<f32>() / n as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n as f32;
        st[0] = mean;
        st[1] = 1.0 / (var + LN_EPS).sqrt();
    }
}

/// `y = (x − mean) · rstd · gamma + beta` per row, from precomputed statistics.
pub fn layernorm_apply(x: &[f32], stats: &[f32], gamma: &[f32], beta: &[f32], y: &mut [f32]) {
    let n = gamma.len();
    if n == 0 {
        return;
    }
    for ((row, st), out) in x
        .chunks_exact(n)
        .zip(stats.chunks_exact(2))
        .zip(y.chunks_exact_mut(n))
    {
        for j in 0..n {
            out[j] = (row[j] - st[0]) * st[1] * gamma[j] + beta[j];
        }
    }
}

/// Layer-norm backward: `dx += …`, `dgamma += …`, `dbeta += …` from the output gradient `dy`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_acc(
    x: &[f32],
    stats: &[f32],
    gamma: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) {
    let n = gamma.len();
    if n == 0 {
        return;
    }
    for (((row, st), dyr), dxr) in x
        .chunks_exact(n)
        .zip(stats.chunks_exact(2))
        .zip(dy.chunks_exact(n))
        .zip(dx.chunks_exact_mut(n))
    {
        let (mean, rstd) = (st[0], st[1]);
        let mut dnorm_mean = 0.0f32;
        let mut dnorm_xhat_mean = 0.0f32;
        for j in 0..n {
            let xhat = (row[j] - mean) * rstd;
            let dnorm = gamma[j] * dyr[j];
            dnorm_mean += dnorm;
            dnorm_xhat_mean += dnorm * xhat;
        }
        dnorm_mean /= n as f32;
        dnorm_xhat_mean /= n as f32;
        for j in 0..n {
            let xhat = (row[j] - mean) * rstd;
            let dnorm = gamma[j] * dyr[j];
            dbeta[j] += dyr[j];
            dgamma[j] += xhat * dyr[j];
            dxr[j] += (dnorm - dnorm_mean - xhat * dnorm_xhat_mean) * rstd;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Plain triple loop, k ascending: the same order as `matmul`, so results are bitwise equal.
    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f32;
                for kk in 0..k {
                    s += a[i * k + kk] * b[kk * n + j];
                }
                c[i * n + j] = s;
            }
        }
        c
    }

    fn transpose(b: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut t = vec![0f32; b.len()];
        for r in 0..rows {
            for c in 0..cols {
                t[c * rows + r] = b[r * cols + c];
            }
        }
        t
    }

    #[test]
    fn products_match_the_naive_reference() {
        // Small (serial) and large (threaded) shapes.
        for &(m, k, n) in &[(3, 5, 7), (1, 1, 1), (0, 4, 3), (70, 33, 40), (64, 130, 96)] {
            let a = values(m * k, 3);
            let b = values(k * n, 7);
            let want = naive(&a, &b, m, k, n);
            let mut c = vec![0f32; m * n];
            matmul(&a, &b, &mut c, m, k, n);
            assert_eq!(
                c, want,
                "matmul {m}x{k}x{n}: same summation order, bitwise equal"
            );

            // a·bᵀ with b given as its transpose: different summation order, close.
            let bt = transpose(&b, k, n);
            let mut c2 = vec![0f32; m * n];
            matmul_bt(&a, &bt, &mut c2, m, k, n);
            for (x, y) in c2.iter().zip(&want) {
                assert!(
                    (x - y).abs() <= 1e-5 * (1.0 + y.abs()) * k as f32,
                    "{x} vs {y}"
                );
            }

            // g += aᵀ·d equals naive(aᵀ, d) added to g's previous contents.
            let d = values(m * n, 11);
            let mut g = values(k * n, 13);
            let g0 = g.clone();
            matmul_at_acc(&a, &d, &mut g, m, k, n);
            let at = transpose(&a, m, k);
            let prod = naive(&at, &d, k, m, n);
            for ((x, p), g0) in g.iter().zip(&prod).zip(&g0) {
                assert!((x - (g0 + p)).abs() <= 1e-5 * (1.0 + p.abs()) * m.max(1) as f32);
            }
        }
    }

    #[test]
    fn gelu_derivative_matches_finite_differences() {
        for i in -40..=40 {
            let x = i as f32 * 0.1;
            let h = 1e-3f64;
            let xd = x as f64;
            let f = |v: f64| {
                0.5 * v
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())
            };
            let fd = (f(xd + h) - f(xd - h)) / (2.0 * h);
            assert!((gelu_grad(x) as f64 - fd).abs() < 1e-4, "x = {x}");
            assert!((gelu(x) as f64 - f(xd)).abs() < 1e-5);
        }
    }

    #[test]
    fn layernorm_normalises_and_its_backward_matches_finite_differences() {
        let (m, n) = (3, 6);
        let x = values(m * n, 5);
        let gamma = values(n, 9);
        let beta = values(n, 21);
        let mut stats = vec![0f32; m * 2];
        layernorm_stats(&x, &mut stats, n);
        let ones = vec![1f32; n];
        let zeros = vec![0f32; n];
        let mut y = vec![0f32; m * n];
        layernorm_apply(&x, &stats, &ones, &zeros, &mut y);
        for row in y.chunks(n) {
            let mean: f32 = row.iter().sum::<f32>() / n as f32;
            let var: f32 = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n as f32;
            assert!(mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-3);
        }
        // Loss = Σ r ⊙ LN(x); check dL/dx along a random direction.
        let r = values(m * n, 17);
        let v = values(m * n, 19);
        let loss = |x: &[f32]| -> f64 {
            let mut st = vec![0f32; m * 2];
            layernorm_stats(x, &mut st, n);
            let mut y = vec![0f32; m * n];
            layernorm_apply(x, &st, &gamma, &beta, &mut y);
            y.iter()
                .zip(&r)
                .map(|(a, b)| (*a as f64) * (*b as f64))
                .sum()
        };
        let mut dx = vec![0f32; m * n];
        let mut dg = vec![0f32; n];
        let mut db = vec![0f32; n];
        layernorm_backward_acc(&x, &stats, &gamma, &r, &mut dx, &mut dg, &mut db);
        let eps = 1e-2f32;
        let xp: Vec<f32> = x.iter().zip(&v).map(|(a, b)| a + eps * b).collect();
        let xm: Vec<f32> = x.iter().zip(&v).map(|(a, b)| a - eps * b).collect();
        let fd = (loss(&xp) - loss(&xm)) / (2.0 * eps as f64);
        let an: f64 = dx
            .iter()
            .zip(&v)
            .map(|(a, b)| (*a as f64) * (*b as f64))
            .sum();
        assert!(
            (fd - an).abs() < 2e-2 * (1.0 + an.abs()),
            "fd {fd} vs analytic {an}"
        );
        // dbeta is the column sum of r.
        for j in 0..n {
            let want: f32 = (0..m).map(|i| r[i * n + j]).sum();
            assert!((db[j] - want).abs() < 1e-6);
        }
    }
}
