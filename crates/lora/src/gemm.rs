//! The one place this crate calls into `gemm`.
//!
//! Every output element's reduction over the inner dimension runs in one fixed order whatever
//! the thread count (gemm splits work over output rows and columns, never over the inner
//! dimension), so results are reproducible bit for bit, as in the trainer's own matmuls.

use gemm::Parallelism;

use crate::error::{LoraError, Result};

fn parallelism() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// A `[rows, cols]` view of a slice given by its strides in elements; a transposed dense
/// matrix is the same buffer with the strides swapped.
#[derive(Clone, Copy)]
pub(crate) struct Strided<'a> {
    data: &'a [f32],
    row_stride: usize,
    col_stride: usize,
}

impl<'a> Strided<'a> {
    /// A dense row-major matrix with `cols` columns.
    pub(crate) fn rows(data: &'a [f32], cols: usize) -> Self {
        Strided {
            data,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a dense row-major matrix with `cols` columns.
    pub(crate) fn transposed(data: &'a [f32], cols: usize) -> Self {
        Strided {
            data,
            row_stride: 1,
            col_stride: cols,
        }
    }

    /// Whether a `[rows, cols]` matrix with these strides lies inside the slice.
    fn fits(&self, rows: usize, cols: usize) -> bool {
        if rows == 0 || cols == 0 {
            return true;
        }
        let last = (rows - 1)
            .checked_mul(self.row_stride)
            .and_then(|a| (cols - 1).checked_mul(self.col_stride).map(|b| (a, b)))
            .and_then(|(a, b)| a.checked_add(b));
        matches!(last, Some(l) if l < self.data.len())
    }
}

/// `dst[m, n] = (accumulate ? dst : 0) + beta · lhs[m, k] · rhs[k, n]`, `dst` dense row-major.
///
/// The extents are checked in every build (a wrong length is an error, never an out-of-bounds
/// read), because the call below is `unsafe`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_into(
    dst: &mut [f32],
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    m: usize,
    n: usize,
    k: usize,
    beta: f32,
    accumulate: bool,
) -> Result<()> {
    let dst_len = m.checked_mul(n).ok_or(LoraError::TooLarge {
        what: "matmul output elements",
        value: m as u128 * n as u128,
        limit: usize::MAX as u128,
    })?;
    if dst.len() != dst_len || !lhs.fits(m, k) || !rhs.fits(k, n) {
        return Err(LoraError::Length {
            what: "matmul operand",
            expected: dst_len,
            actual: dst.len(),
        });
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return Ok(());
    }
    // gemm takes strides as isize; slices never exceed isize::MAX elements, and every stride
    // here is at most a slice length.
    let s = |v: usize| v as isize;
    // SAFETY: the strided extents of `lhs` and `rhs` lie inside their slices and `dst` is
    // exactly `m·n` dense elements (all checked above); `dst` is a distinct mutable borrow, so
    // nothing aliases it.
    unsafe {
        // gemm computes dst := alpha·dst + beta·lhs·rhs (alpha read only when read_dst).
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            s(n),
            accumulate,
            lhs.data.as_ptr(),
            s(lhs.col_stride),
            s(lhs.row_stride),
            rhs.data.as_ptr(),
            s(rhs.col_stride),
            s(rhs.row_stride),
            1.0,
            beta,
            false,
            false,
            false,
            parallelism(),
        );
    }
    Ok(())
}
