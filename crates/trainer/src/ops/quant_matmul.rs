//! A frozen 4-bit linear's two products with bf16 operands — bitsandbytes' `Linear4bit` with
//! `compute_dtype=bfloat16`: the weight is dequantized, rounded to bf16 and multiplied with the
//! bf16-rounded activations, the products summed in f32 ([`super::bf16_gemm`], AMX tiles).
//! The trainer takes this path for `--precision bf16` where the bf16 products run on AMX;
//! elsewhere (and in fp32) [`headroom_quant`]'s f32 kernel multiplies the f32 dequantized
//! weight.
//!
//! The weight is dequantized straight to bf16 one [`NC`]-column × [`KC`]-deep block at a time,
//! exactly the block the bf16 GEMM packs and walks, and a call per block accumulating from the
//! second depth block performs the additions one call over the whole weight would. So the results are bit for bit those of
//! [`forward_bf16_products`](super::matmul::forward_bf16_products) and
//! [`backward_bf16_products`](super::matmul::backward_bf16_products) over the whole dequantized
//! weight rounded to bf16 (tested), while the memory is one bf16 block (1 MiB at most) and the
//! packing buffer, never the whole weight in any format.
//!
//! Cost: each weight element is dequantized once per product, as in the f32 kernel, by a
//! lookup in the block's 16 values already rounded to bf16
//! ([`QuantizedTensor::dequantize_range_bf16`]); every block's dequantization is split over the
//! threads.

use half::bf16;
use headroom_quant::{Isa, QuantError, QuantizedTensor};
use rayon::prelude::*;

use super::bf16_gemm::{gemm_bf16_with, pack_len, Bf16Source, KC, NC};
use super::matmul::{dot_in_pieces, DOT_COLUMNS, DOT_PIECE, DOT_ROWS};
use super::strided::Strided;

/// Rows of one block the threads dequantize at a time (rayon's unit of work).
const DEQUANT_ROWS: usize = 16;

/// `[out, in]` of a weight viewed as a matrix (leading dimensions folded into rows).
fn matrix_dims(w: &QuantizedTensor) -> (usize, usize) {
    let cols = w.shape().last().copied().unwrap_or(1).max(1);
    (w.numel() / cols, cols)
}

/// Scratch of one product `[m, n]` of depth `k` walked in blocks of [`NC`] columns and [`KC`]
/// depth: `(bf16 elements of the dequantized block, u16 elements of the packing buffer)`, the largest over the block shapes that occur (the first and the tails).
fn blocked_scratch(m: usize, n: usize, k: usize, threads: usize) -> (usize, usize) {
    if m == 0 || n == 0 || k == 0 {
        return (0, 0);
    }
    let (nb, kb) = (n.min(NC), k.min(KC));
    let (n_tail, k_tail) = (n - (n.div_ceil(NC) - 1) * NC, k - (k.div_ceil(KC) - 1) * KC);
    let pack = [(nb, kb), (n_tail, kb), (nb, k_tail), (n_tail, k_tail)]
        .into_iter()
        .map(|(cols, depth)| pack_len(m, cols, depth, threads))
        .max()
        .unwrap_or(0);
    (nb * kb, pack)
}

/// Scratch of [`forward`] for `rows` rows of input and weight `w` on `threads` threads:
/// `(bf16 elements of the dequantized block, u16 elements of the packing buffer)`.
pub fn forward_scratch(rows: usize, w: &QuantizedTensor, threads: usize) -> (usize, usize) {
    let (out, inn) = matrix_dims(w);
    forward_scratch_dims(rows, out, inn, threads)
}

/// [`forward_scratch`] by the weight's `[out, in]` (for the estimator, which has no weight).
/// None at most [`DOT_ROWS`] rows: those are row dot products, a piece of a row dequantized on
/// the stack at a time.
pub fn forward_scratch_dims(rows: usize, out: usize, inn: usize, threads: usize) -> (usize, usize) {
    if rows <= DOT_ROWS {
        return (0, 0);
    }
    blocked_scratch(rows, out, inn, threads)
}

/// Scratch of [`backward_input`], as [`forward_scratch`].
pub fn backward_scratch(rows: usize, w: &QuantizedTensor, threads: usize) -> (usize, usize) {
    let (out, inn) = matrix_dims(w);
    backward_scratch_dims(rows, out, inn, threads)
}

/// [`backward_scratch`] by the weight's `[out, in]`.
pub fn backward_scratch_dims(
    rows: usize,
    out: usize,
    inn: usize,
    threads: usize,
) -> (usize, usize) {
    blocked_scratch(rows, inn, out, threads)
}

fn mismatch(op: &'static str, detail: String) -> QuantError {
    QuantError::ShapeMismatch { op, detail }
}

/// Checks `a` holds `rows × cols` (returning `rows`), `c` `rows × c_cols`, and the scratch the
/// blocked product needs.
#[allow(clippy::too_many_arguments)]
fn check(
    op: &'static str,
    a_len: usize,
    cols: usize,
    c_len: usize,
    c_cols: usize,
    block: usize,
    need: (usize, usize),
    pack: usize,
) -> Result<usize, QuantError> {
    if cols == 0 || !a_len.is_multiple_of(cols) {
        return Err(mismatch(
            op,
            format!("input of {a_len} elements is not rows of {cols}"),
        ));
    }
    let rows = a_len / cols;
    if rows.checked_mul(c_cols) != Some(c_len) {
        return Err(mismatch(
            op,
            format!("output has {c_len} elements, expected {rows} × {c_cols}"),
        ));
    }
    if block < need.0 || pack < need.1 {
        return Err(mismatch(
            op,
            format!(
                "scratch of {block} block and {pack} packing elements, {} and {} needed",
                need.0, need.1
            ),
        ));
    }
    Ok(rows)
}

/// `y = x · Wᵀ` (overwritten) for `x` `[N, in]` (f32 or bf16, rounded to bf16 while packed),
/// `W` `[out, in]` 4-bit, `y` `[N, out]` f32. `block` and `pack` hold at least
/// [`forward_scratch`] elements. Threaded on the current rayon pool, whose size `threads`
/// must be for `pack` to be all the packing memory.
pub fn forward<A: Bf16Source>(
    y: &mut [f32],
    x: &[A],
    w: &QuantizedTensor,
    block: &mut [bf16],
    pack: &mut [u16],
) -> Result<(), QuantError> {
    const OP: &str = "4-bit forward (bf16 products)";
    let (out, inn) = matrix_dims(w);
    let threads = rayon::current_num_threads();
    let need = forward_scratch_dims(x.len() / inn, out, inn, threads);
    let n = check(
        OP,
        x.len(),
        inn,
        y.len(),
        out,
        block.len(),
        need,
        pack.len(),
    )?;
    if n == 0 || out == 0 {
        return Ok(());
    }
    let isa = Isa::detect();
    if n <= DOT_ROWS {
        // A decoding step's rows: the dense bf16 products' row dots (the same values in the
        // same order, so the same bits), each weight row dequantized a piece at a time.
        for r in 0..n {
            let xr = &x[r * inn..][..inn];
            y[r * out..][..out]
                .par_chunks_mut(DOT_COLUMNS)
                .enumerate()
                .try_for_each(|(t, cols)| {
                    cols.iter_mut().enumerate().try_for_each(|(j, yo)| {
                        let row = (t * DOT_COLUMNS + j) * inn;
                        let mut failed = Ok(());
                        let mut piece = [bf16::ZERO; DOT_PIECE];
                        *yo = dot_in_pieces(inn, |k0, xs, ws| {
                            for (d, s) in xs.iter_mut().zip(&xr[k0..]) {
                                *d = f32::from_bits(u32::from(s.bf16_bits()) << 16);
                            }
                            let p = &mut piece[..ws.len()];
                            if let Err(e) = w.dequantize_range_bf16_isa(isa, row + k0, p) {
                                failed = Err(e);
                            }
                            for (d, s) in ws.iter_mut().zip(p.iter()) {
                                *d = s.to_f32();
                            }
                        });
                        failed
                    })
                })?;
        }
        return Ok(());
    }
    for c0 in (0..out).step_by(NC) {
        let cols = NC.min(out - c0);
        for k0 in (0..inn).step_by(KC) {
            let depth = KC.min(inn - k0);
            // block[j·depth + d] = W[c0 + j, k0 + d]: Wᵀ's depth block, depth contiguous.
            let blk = &mut block[..cols * depth];
            blk.par_chunks_mut(DEQUANT_ROWS * depth)
                .enumerate()
                .try_for_each(|(t, rows)| {
                    rows.chunks_exact_mut(depth)
                        .enumerate()
                        .try_for_each(|(j, row)| {
                            let r = c0 + t * DEQUANT_ROWS + j;
                            w.dequantize_range_bf16_isa(isa, r * inn + k0, row)
                        })
                })?;
            let a = Strided {
                data: &x[k0..],
                row_stride: inn,
                col_stride: 1,
            };
            let b = Strided::transposed(&blk[..], depth);
            gemm_bf16_with(&mut y[c0..], out, a, b, n, cols, depth, k0 > 0, pack);
        }
    }
    Ok(())
}

/// `dx += dy · W` for `dy` `[N, out]` (f32 or bf16, rounded to bf16 while packed), `W`
/// `[out, in]` 4-bit, `dx` `[N, in]` f32, accumulated in place (no partial gradient). `block`
/// and `pack` hold at least [`backward_scratch`] elements.
pub fn backward_input<A: Bf16Source>(
    dx: &mut [f32],
    dy: &[A],
    w: &QuantizedTensor,
    block: &mut [bf16],
    pack: &mut [u16],
) -> Result<(), QuantError> {
    const OP: &str = "4-bit input gradient (bf16 products)";
    let (out, inn) = matrix_dims(w);
    let threads = rayon::current_num_threads();
    let need = backward_scratch_dims(dy.len() / out.max(1), out, inn, threads);
    let n = check(
        OP,
        dy.len(),
        out,
        dx.len(),
        inn,
        block.len(),
        need,
        pack.len(),
    )?;
    if n == 0 || inn == 0 {
        return Ok(());
    }
    let isa = Isa::detect();
    for c0 in (0..inn).step_by(NC) {
        let cols = NC.min(inn - c0);
        for o0 in (0..out).step_by(KC) {
            let depth = KC.min(out - o0);
            // block[d·cols + j] = W[o0 + d, c0 + j]: W's depth block, columns contiguous.
            let blk = &mut block[..depth * cols];
            blk.par_chunks_mut(DEQUANT_ROWS * cols)
                .enumerate()
                .try_for_each(|(t, rows)| {
                    rows.chunks_exact_mut(cols)
                        .enumerate()
                        .try_for_each(|(d, row)| {
                            let r = o0 + t * DEQUANT_ROWS + d;
                            w.dequantize_range_bf16_isa(isa, r * inn + c0, row)
                        })
                })?;
            let a = Strided {
                data: &dy[o0..],
                row_stride: out,
                col_stride: 1,
            };
            let b = Strided::rows(&blk[..], cols);
            gemm_bf16_with(&mut dx[c0..], inn, a, b, n, cols, depth, true, pack);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::bf16_gemm::{bf16_gemm_path, Bf16GemmPath};
    use crate::ops::matmul::{backward_bf16_products, forward_bf16_products};
    use half::bf16;
    use headroom_quant::QuantConfig;
    use headroom_tensor::Cpu;
    use proptest::prelude::*;

    fn values(seed: u64, len: usize) -> Vec<f32> {
        crate::ops::test_values(seed, len)
            .into_iter()
            .map(|v| v * 2.0)
            .collect()
    }

    /// The dequantized weight rounded to bf16, as the products see it.
    fn rounded_weight(q: &QuantizedTensor) -> Vec<bf16> {
        q.dequantize().into_iter().map(bf16::from_f32).collect()
    }

    /// `|got − Σ a·b| ≤ k·2⁻²³·Σ|a·b| (+ 1e-30)` per element against the f64 product of the
    /// bf16-rounded operands: `a` `[m, k]`, `b` `[k, n]` as closures, `start` what `got` held
    /// before an accumulating product.
    #[allow(clippy::too_many_arguments)]
    fn within_bound(
        got: &[f32],
        start: Option<&[f32]>,
        a: impl Fn(usize, usize) -> f32,
        b: impl Fn(usize, usize) -> f32,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), TestCaseError> {
        let r = |x: f32| bf16::from_f32(x).to_f32() as f64;
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut abs) = (start.map_or(0.0, |s| s[i * n + j] as f64), 0.0f64);
                abs += s.abs();
                for p in 0..k {
                    let t = r(a(i, p)) * r(b(p, j));
                    s += t;
                    abs += t.abs();
                }
                let tol = (k + 1) as f64 * f64::powi(2.0, -23) * abs + 1e-30;
                let g = got[i * n + j] as f64;
                prop_assert!((g - s).abs() <= tol, "({i}, {j}): {g} vs {s} ± {tol}");
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// Shapes across the block edges (out or in past `NC` = 1024 and `KC` = 512, odd tails),
        /// f32 and bf16 activations: forward and input gradient within the f32-summation bound
        /// of the f64 product of the rounded operands, and — on AMX, where the blocked calls
        /// claim it — bit for bit the dense bf16 products over the rounded dequantized weight.
        #[test]
        fn blocked_products_equal_the_dense_bf16_products(
            out in prop_oneof![1usize..80, 1000usize..1100],
            inn in prop_oneof![1usize..80, 500usize..600],
            n in 1usize..9,
            bf16_input in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let cpu = Cpu::new();
            let wv = values(seed, out * inn);
            let q = QuantizedTensor::quantize(&cpu, &wv, &[out, inn], QuantConfig::qlora()).unwrap();
            let wd = q.dequantize();
            let wr = rounded_weight(&q);
            let threads = rayon::current_num_threads();
            let amx = bf16_gemm_path() == Bf16GemmPath::Amx;

            let xv = values(seed ^ 1, n * inn);
            let xb: Vec<bf16> = xv.iter().map(|&v| bf16::from_f32(v)).collect();
            let (be, pe) = forward_scratch(n, &q, threads);
            let (mut block, mut pack) = (vec![bf16::ZERO; be], vec![0u16; pe]);
            let mut y = vec![f32::NAN; n * out];
            if bf16_input {
                forward(&mut y, &xb, &q, &mut block, &mut pack).unwrap();
            } else {
                forward(&mut y, &xv, &q, &mut block, &mut pack).unwrap();
            }
            within_bound(&y, None, |i, p| xv[i * inn + p], |p, j| wd[j * inn + p], n, out, inn)?;
            if amx {
                let mut dense = vec![0f32; n * out];
                let dense_scratch = crate::ops::matmul::forward_scratch(n, inn, out);
                let mut scratch = vec![0f32; pe.div_ceil(2).max(dense_scratch)];
                forward_bf16_products(&mut dense, &xb, &wr, None, n, inn, out, &mut scratch);
                prop_assert!(y.iter().zip(&dense).all(|(a, b)| a.to_bits() == b.to_bits()));
            }

            let dyv = values(seed ^ 2, n * out);
            let dyb: Vec<bf16> = dyv.iter().map(|&v| bf16::from_f32(v)).collect();
            let start = values(seed ^ 3, n * inn);
            let (be, pe) = backward_scratch(n, &q, threads);
            let (mut block, mut pack) = (vec![bf16::ZERO; be], vec![0u16; pe]);
            let mut dx = start.clone();
            if bf16_input {
                backward_input(&mut dx, &dyb, &q, &mut block, &mut pack).unwrap();
            } else {
                backward_input(&mut dx, &dyv, &q, &mut block, &mut pack).unwrap();
            }
            within_bound(&dx, Some(&start), |i, p| dyv[i * out + p], |p, j| wd[p * inn + j], n, inn, out)?;
            if amx {
                let mut dense = start.clone();
                let mut scratch = vec![0f32; pe.div_ceil(2)];
                backward_bf16_products(
                    &mut dense, None, None, &dyv, &[] as &[f32], &wr, n, inn, out, &mut scratch,
                );
                prop_assert!(dx.iter().zip(&dense).all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    }

    /// Wrong lengths and a short scratch are typed errors, never a panic or a partial write
    /// (blocked products and row dots).
    #[test]
    fn bad_shapes_are_errors() {
        let cpu = Cpu::new();
        let q = QuantizedTensor::quantize(&cpu, &values(1, 8 * 64), &[8, 64], QuantConfig::qlora())
            .unwrap();
        let (be, pe) = forward_scratch(5, &q, rayon::current_num_threads());
        assert!(be > 0 && pe > 0);
        let (mut block, mut pack) = (vec![bf16::ZERO; be], vec![0u16; pe]);
        let x = values(2, 5 * 64);
        let mut y = vec![7.0f32; 5 * 8];
        assert!(forward(&mut y, &x[..319], &q, &mut block, &mut pack).is_err());
        assert!(forward(&mut y[..39], &x, &q, &mut block, &mut pack).is_err());
        assert!(forward(&mut y, &x, &q, &mut block[..be - 1], &mut pack).is_err());
        assert!(forward(&mut y, &x, &q, &mut block, &mut pack[..pe - 1]).is_err());
        assert!(y.iter().all(|&v| v == 7.0));
        assert_eq!(forward_scratch(DOT_ROWS, &q, 2), (0, 0));
        assert!(forward(&mut y[..16], &x[..127], &q, &mut [], &mut []).is_err());
        assert!(forward(&mut y[..15], &x[..128], &q, &mut [], &mut []).is_err());
        assert!(y.iter().all(|&v| v == 7.0));
        let mut dx = vec![7.0f32; 2 * 64];
        let dy = values(3, 2 * 8);
        assert!(backward_input(&mut dx, &dy[..15], &q, &mut block, &mut pack).is_err());
        assert!(backward_input(&mut dx[..127], &dy, &q, &mut block, &mut pack).is_err());
        assert!(dx.iter().all(|&v| v == 7.0));
    }
}
