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
    debug_assert_eq!(out.len(), n * oc);
    debug_assert_eq!(inp.len(), n * c);
    debug_assert_eq!(weight.len(), oc * c);
    // SAFETY: the pointers cover exactly the described matrices (lengths asserted above by the
    // callers' contract); `out` does not alias the inputs (distinct borrows).
    unsafe {
        gemm::gemm(
            n,
            oc,
            c,
            out.as_mut_ptr(),
            1,
            oc as isize,
            false,
            inp.as_ptr(),
            1,
            c as isize,
            // Wᵀ as a [c, oc] matrix: row stride 1, column stride c.
            weight.as_ptr(),
            c as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        );
    }
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
    debug_assert_eq!(dinp.len(), n * c);
    debug_assert_eq!(dweight.len(), oc * c);
    debug_assert_eq!(dout.len(), n * oc);
    // SAFETY: as in `forward`; destinations are distinct from the sources.
    unsafe {
        // dinp[n, c] += dout[n, oc] · W[oc, c]
        gemm::gemm(
            n,
            c,
            oc,
            dinp.as_mut_ptr(),
            1,
            c as isize,
            true,
            dout.as_ptr(),
            1,
            oc as isize,
            weight.as_ptr(),
            1,
            c as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        );
        // dweight[oc, c] += dout[n, oc]ᵀ · inp[n, c]
        gemm::gemm(
            oc,
            c,
            n,
            dweight.as_mut_ptr(),
            1,
            c as isize,
            true,
            // doutᵀ as [oc, n]: column (inner) stride oc, row stride 1.
            dout.as_ptr(),
            oc as isize,
            1,
            inp.as_ptr(),
            1,
            c as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        );
    }
    if let Some(db) = dbias {
        for row in dout.chunks_exact(oc) {
            for (d, g) in db.iter_mut().zip(row) {
                *d += g;
            }
        }
    }
}
