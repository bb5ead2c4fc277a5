//! A bounds-checked, safe wrapper over the `gemm` crate's f32 kernel for the strided tile
//! products attention needs (`Q·Kᵀ`, `P·V`, `Pᵀ·dO`, …).
//!
//! `gemm` picks AVX-512 / AVX2+FMA micro-kernels at run time, so these products are fast
//! without compiling the whole crate for a particular CPU.

use crate::{AttnError, Result};

/// A read-only strided matrix over an f32 slice: element `(r, c)` is
/// `data[r·row_stride + c·col_stride]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `rows × cols` matrix whose rows start `row_stride` elements apart.
    pub(crate) fn rows(data: &'a [f32], rows: usize, cols: usize, row_stride: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            row_stride,
            col_stride: 1,
        }
    }

    /// The transpose (a view, nothing is copied).
    pub(crate) fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }
}

/// Index one past the last element a strided `rows × cols` view touches (0 when empty).
fn extent(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> Option<usize> {
    if rows == 0 || cols == 0 {
        return Some(0);
    }
    (rows - 1)
        .checked_mul(row_stride)?
        .checked_add((cols - 1).checked_mul(col_stride)?)?
        .checked_add(1)
}

fn as_isize(x: usize) -> Result<isize> {
    isize::try_from(x).map_err(|_| AttnError::Internal("matmul stride"))
}

/// `dst = (accumulate ? dst : 0) + alpha·(a·b)`, with `dst` row-major `a.rows × b.cols` whose
/// rows start `dst_row_stride` apart. `threads` > 1 lets `gemm` split the product over rayon.
pub(crate) fn matmul(
    dst: &mut [f32],
    dst_row_stride: usize,
    a: MatRef<'_>,
    b: MatRef<'_>,
    alpha: f32,
    accumulate: bool,
    threads: usize,
) -> Result<()> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k {
        return Err(AttnError::Internal("matmul inner dimensions"));
    }
    let fits = |view: &MatRef<'_>| {
        extent(view.rows, view.cols, view.row_stride, view.col_stride)
            .is_some_and(|e| e <= view.data.len())
    };
    let dst_fits = extent(m, n, dst_row_stride, 1).is_some_and(|e| e <= dst.len());
    if !fits(&a) || !fits(&b) || !dst_fits {
        return Err(AttnError::Internal("matmul operand bounds"));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                let start = r * dst_row_stride;
                if let Some(row) = dst.get_mut(start..start + n) {
                    row.fill(0.0);
                }
            }
        }
        return Ok(());
    }
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let (dst_rs, a_rs, a_cs, b_rs, b_cs) = (
        as_isize(dst_row_stride)?,
        as_isize(a.row_stride)?,
        as_isize(a.col_stride)?,
        as_isize(b.row_stride)?,
        as_isize(b.col_stride)?,
    );
    // SAFETY: every element gemm reads or writes lies inside the slices: the extents of the
    // three strided views were checked against the slice lengths above, `dst` is borrowed
    // mutably and the inputs immutably, so nothing aliases a write.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs,
            accumulate,
            a.data.as_ptr(),
            a_cs,
            a_rs,
            b.data.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            alpha,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    #[test]
    fn strided_products_match_a_plain_triple_loop() {
        let (m, k, n) = (7, 5, 9);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        let want = plain(&a, &b, m, k, n);
        // dst = 2·A·B in a wider destination (row stride 12).
        let mut dst = vec![5.0f32; m * 12];
        matmul(
            &mut dst,
            12,
            MatRef::rows(&a, m, k, k),
            MatRef::rows(&b, k, n, n),
            2.0,
            false,
            1,
        )
        .unwrap();
        for i in 0..m {
            for j in 0..n {
                assert!((dst[i * 12 + j] - 2.0 * want[i * n + j]).abs() < 1e-5);
            }
            assert_eq!(dst[i * 12 + n], 5.0, "outside the product is untouched");
        }
        // Transposed operands: (Bᵀ)ᵀ·… via a stored Bᵀ, accumulated on top.
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        let mut acc = want.clone();
        matmul(
            &mut acc,
            n,
            MatRef::rows(&a, m, k, k),
            MatRef::rows(&bt, n, k, k).t(),
            1.0,
            true,
            1,
        )
        .unwrap();
        for (x, w) in acc.iter().zip(&want) {
            assert!((x - 2.0 * w).abs() < 1e-5);
        }
    }

    #[test]
    fn out_of_bounds_views_are_errors_not_panics() {
        let a = vec![1.0f32; 6];
        let mut dst = vec![0.0f32; 4];
        let err = matmul(
            &mut dst,
            2,
            MatRef::rows(&a, 3, 3, 3),
            MatRef::rows(&a, 3, 2, 2),
            1.0,
            false,
            1,
        );
        assert!(matches!(err, Err(AttnError::Internal(_))));
    }
}
