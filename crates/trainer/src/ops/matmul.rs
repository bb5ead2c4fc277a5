//! Linear layers as llm.c lays them out: `out[N, OC] = inp[N, C] · W[OC, C]ᵀ + b[OC]`, and the
//! backward products, on the `gemm` crate (no system BLAS).
//!
//! Every output element's reduction over the inner dimension runs in one fixed order whatever
//! the thread count (gemm splits work over output rows and columns, never over the inner
//! dimension), so gradients are reproducible bit for bit; the bias gradient is a plain ordered
//! loop for the same reason.

use gemm::Parallelism;

fn parallelism() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// A row-major `[rows, cols]` view given by its strides in elements: `(row stride, column
/// stride)`; a transposed matrix is the same buffer with the strides swapped.
#[derive(Clone, Copy)]
struct Strided<'a> {
    data: &'a [f32],
    row_stride: usize,
    col_stride: usize,
}

impl<'a> Strided<'a> {
    /// A dense row-major matrix with `cols` columns.
    fn rows(data: &'a [f32], cols: usize) -> Self {
        Strided {
            data,
            row_stride: cols,
            col_stride: 1,
        }
    }
    /// The transpose of a dense row-major matrix with `cols` columns.
    fn transposed(data: &'a [f32], cols: usize) -> Self {
        Strided {
            data,
            row_stride: 1,
            col_stride: cols,
        }
    }
}

/// `dst[m, n] (+)= lhs[m, k] · rhs[k, n]`, `dst` dense row-major; accumulates when
/// `accumulate`, overwrites otherwise. The only place this module calls into gemm.
fn gemm_into(
    dst: &mut [f32],
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    debug_assert_eq!(dst.len(), m * n);
    debug_assert!(
        m == 0 || k == 0 || lhs.data.len() > (m - 1) * lhs.row_stride + (k - 1) * lhs.col_stride
    );
    debug_assert!(
        k == 0 || n == 0 || rhs.data.len() > (k - 1) * rhs.row_stride + (n - 1) * rhs.col_stride
    );
    // SAFETY: the callers pass matrices whose strided extents lie inside their slices (checked
    // in debug builds above), and `dst` is a distinct mutable borrow, so nothing aliases it.
    unsafe {
        // gemm computes dst := alpha·dst + beta·lhs·rhs (alpha read only when read_dst).
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        );
    }
}

/// `out = inp · Wᵀ (+ bias)`; `inp` is `[n, c]`, `weight` `[oc, c]`, `out` `[n, oc]`.
/// Lengths are the caller's contract (checked in debug builds).
pub fn forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    debug_assert_eq!(inp.len(), n * c);
    debug_assert_eq!(weight.len(), oc * c);
    gemm_into(
        out,
        Strided::rows(inp, c),
        Strided::transposed(weight, c),
        n,
        oc,
        c,
        false,
    );
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(oc) {
            for (o, b) in row.iter_mut().zip(b) {
                *o += b;
            }
        }
    }
}

/// Accumulate the gradients of [`forward`]: `dinp += dout · W`, `dweight += doutᵀ · inp`,
/// `dbias += Σ_rows dout`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    oc: usize,
) {
    debug_assert_eq!(dout.len(), n * oc);
    // dinp[n, c] += dout[n, oc] · W[oc, c]
    gemm_into(
        dinp,
        Strided::rows(dout, oc),
        Strided::rows(weight, c),
        n,
        c,
        oc,
        true,
    );
    // dweight[oc, c] += dout[n, oc]ᵀ · inp[n, c]
    gemm_into(
        dweight,
        Strided::transposed(dout, oc),
        Strided::rows(inp, c),
        oc,
        c,
        n,
        true,
    );
    if let Some(db) = dbias {
        for row in dout.chunks_exact(oc) {
            for (d, g) in db.iter_mut().zip(row) {
                *d += g;
            }
        }
    }
}
