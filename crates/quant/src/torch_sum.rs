//! torch's f32 `mean` of a contiguous vector on an AVX2 CPU build, reproduced operation for
//! operation, so the double quantization's offset (`absmax.mean()`) is bitwise bitsandbytes'.
//!
//! ATen sums f32 in f32 with a cascade: the vector is read as rows of 4 × 8 lanes, rows are
//! added into level-0 accumulators, and every `2^p` rows a level is carried into the next one
//! (4 levels), which keeps the error logarithmic. Lanes are combined at the end, after the
//! elements that do not fill a vector. `mean` divides that sum by the count in f32.
//!
//! Reproduced for one thread: torch splits reductions of more than 32 768 elements across its
//! threads, so beyond that its own offset depends on its thread count (and on AVX-512 builds
//! on 16 lanes). Any offset is a valid quantization state — it is stored — so this only
//! matters for byte-identity with a bitsandbytes run.

// The loops index lanes and accumulators explicitly to mirror ATen's order of additions,
// which is the whole point of this module.
#![allow(clippy::needless_range_loop)]

/// Lanes of a 256-bit f32 vector (ATen's `Vectorized<float>` on AVX2).
const LANES: usize = 8;
/// Independent accumulators per level (ATen's `ilp_factor`).
const ILP: usize = 4;
/// Levels of the cascade.
const LEVELS: usize = 4;

type Acc = [[f32; LANES]; ILP];

fn add_acc(dst: &mut Acc, src: &Acc) {
    for (d, s) in dst.iter_mut().zip(src) {
        for (a, b) in d.iter_mut().zip(s) {
            *a += *b;
        }
    }
}

/// `ceil(log2(x))` for x ≥ 1 (0 for x ≤ 1), as c10's `CeilLog2`.
fn ceil_log2(x: usize) -> u32 {
    if x <= 1 {
        0
    } else {
        usize::BITS - (x - 1).leading_zeros()
    }
}

/// torch's f32 sum of `x` (contiguous, one thread, 8-lane vectors).
pub(crate) fn torch_sum_f32(x: &[f32]) -> f32 {
    let n = x.len();
    if n < LANES {
        return scalar_row_sum(x);
    }
    let vecs = n / LANES;
    let rows = vecs / ILP;
    let load = |v: usize| -> [f32; LANES] { std::array::from_fn(|l| x[v * LANES + l]) };

    let level_power = (ceil_log2(rows) / LEVELS as u32).max(4);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let mut acc = [[[0f32; LANES]; ILP]; LEVELS];
    let mut i = 0usize;
    while i + level_step <= rows {
        for _ in 0..level_step {
            for k in 0..ILP {
                let v = load(i * ILP + k);
                for l in 0..LANES {
                    acc[0][k][l] += v[l];
                }
            }
            i += 1;
        }
        for j in 1..LEVELS {
            let lower = acc[j - 1];
            add_acc(&mut acc[j], &lower);
            acc[j - 1] = [[0.0; LANES]; ILP];
            let mask = level_mask << (j as u32 * level_power);
            if i & mask != 0 {
                break;
            }
        }
    }
    while i < rows {
        for k in 0..ILP {
            let v = load(i * ILP + k);
            for l in 0..LANES {
                acc[0][k][l] += v[l];
            }
        }
        i += 1;
    }
    for j in 1..LEVELS {
        let upper = acc[j];
        add_acc(&mut acc[0], &upper);
    }
    let mut partial = acc[0];
    // Vectors that do not fill a row of ILP go into the first accumulator.
    for v in rows * ILP..vecs {
        let v = load(v);
        for l in 0..LANES {
            partial[0][l] += v[l];
        }
    }
    for k in 1..ILP {
        for l in 0..LANES {
            partial[0][l] += partial[k][l];
        }
    }
    // The scalar tail is summed first, then the lanes are added to it in order.
    let mut total = 0f32;
    for &t in &x[vecs * LANES..] {
        total += t;
    }
    for l in 0..LANES {
        total += partial[0][l];
    }
    total
}

/// ATen's scalar `row_sum` (4 interleaved accumulators with the same cascade), used when the
/// vector is shorter than one SIMD vector.
fn scalar_row_sum(x: &[f32]) -> f32 {
    let rows = x.len() / ILP;
    let mut acc = [0f32; ILP];
    for r in 0..rows {
        for k in 0..ILP {
            acc[k] += x[r * ILP + k];
        }
    }
    for &t in &x[rows * ILP..] {
        acc[0] += t;
    }
    for k in 1..ILP {
        acc[0] += acc[k];
    }
    acc[0]
}

/// torch's `x.mean()` for a contiguous f32 vector (sum, then one f32 division by the count).
pub(crate) fn torch_mean_f32(x: &[f32]) -> f32 {
    if x.is_empty() {
        return f32::NAN;
    }
    torch_sum_f32(x) / x.len() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_close_to_the_exact_sum() {
        for n in [0usize, 1, 3, 7, 8, 9, 31, 32, 33, 100, 1000, 5000, 70_000] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 997.0).collect();
            let exact: f64 = x.iter().map(|&v| v as f64).sum();
            let got = torch_sum_f32(&x) as f64;
            assert!(
                (got - exact).abs() <= 1e-5 * exact.abs().max(1.0),
                "{n}: {got} {exact}"
            );
        }
        assert_eq!(ceil_log2(1), 0);
        assert_eq!(ceil_log2(2), 1);
        assert_eq!(ceil_log2(17), 5);
    }
}
