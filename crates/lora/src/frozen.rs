//! The frozen base a LoRA adapter wraps: [`FrozenLinear`], and [`DenseLinear`] for an f32
//! weight.

use headroom_tensor::BoxedError;

use crate::error::{check_len, mul, LoraError, Result};
use crate::gemm::{gemm_into, Strided};

/// A linear layer whose weight is frozen: `y = x·Wᵀ (+ b)` and the input gradient
/// `dx += dy·W`. There is deliberately no weight gradient: a frozen base never allocates one.
///
/// The contract every implementation (dense f32 here; bf16 working weights and NF4 packed
/// weights in the trainer) keeps:
/// - **Shapes.** `W` is `[out_features, in_features]` in the linear's own orientation
///   (`y[n, out] = x[n, in]·Wᵀ`), whatever the storage; `x` and `dx` are dense row-major
///   `[rows, in_features]`, `y` and `dy` `[rows, out_features]`. A length that disagrees is an
///   error, never a panic.
/// - **Overwrite vs accumulate.** [`forward`](Self::forward) overwrites `y` (its previous
///   contents never matter, NaN included); [`backward_input`](Self::backward_input) adds to
///   `dx`, so several consumers of one input sum their gradients into one buffer.
/// - **Arithmetic.** Inputs and outputs are f32; an implementation may store the weight in any
///   format and compute in f32 from it (bf16, NF4), but must use the same weight values in
///   both directions.
/// - **Determinism.** The same inputs give the same bits, for any thread count.
/// - **Memory.** Whatever scratch an implementation needs is its own business (reported to
///   its backend's hook as `Workspace`); it allocates nothing of the weight's size for a
///   gradient.
pub trait FrozenLinear: Send + Sync {
    /// Columns of `x` (`in_features`).
    fn in_features(&self) -> usize;
    /// Columns of `y` (`out_features`).
    fn out_features(&self) -> usize;
    /// `y = x·Wᵀ (+ b)`; `x` is `[rows, in]`, `y` `[rows, out]` and is overwritten.
    fn forward(&self, x: &[f32], y: &mut [f32], rows: usize) -> Result<(), BoxedError>;
    /// `dx += dy·W`; `dy` is `[rows, out]`, `dx` `[rows, in]` and is accumulated into.
    fn backward_input(&self, dy: &[f32], dx: &mut [f32], rows: usize) -> Result<(), BoxedError>;
}

impl<T: FrozenLinear + ?Sized> FrozenLinear for &T {
    fn in_features(&self) -> usize {
        (**self).in_features()
    }
    fn out_features(&self) -> usize {
        (**self).out_features()
    }
    fn forward(&self, x: &[f32], y: &mut [f32], rows: usize) -> Result<(), BoxedError> {
        (**self).forward(x, y, rows)
    }
    fn backward_input(&self, dy: &[f32], dx: &mut [f32], rows: usize) -> Result<(), BoxedError> {
        (**self).backward_input(dy, dx, rows)
    }
}

/// A dense f32 weight `[out, in]` (row-major, as PyTorch's `nn.Linear` stores it) with an
/// optional bias `[out]`, borrowed: the base weight stays wherever its owner keeps (and
/// counts) it.
#[derive(Clone, Copy, Debug)]
pub struct DenseLinear<'a> {
    weight: &'a [f32],
    bias: Option<&'a [f32]>,
    out_features: usize,
    in_features: usize,
}

impl<'a> DenseLinear<'a> {
    /// A view of `weight` (`[out_features, in_features]`) and `bias` (`[out_features]`);
    /// lengths are checked.
    pub fn new(
        weight: &'a [f32],
        bias: Option<&'a [f32]>,
        out_features: usize,
        in_features: usize,
    ) -> Result<Self> {
        check_len(
            "weight",
            weight.len(),
            mul("weight elements", out_features, in_features)?,
        )?;
        if let Some(b) = bias {
            check_len("bias", b.len(), out_features)?;
        }
        Ok(DenseLinear {
            weight,
            bias,
            out_features,
            in_features,
        })
    }

    /// The weight, `[out, in]` row-major.
    pub fn weight(&self) -> &'a [f32] {
        self.weight
    }

    /// The bias, if any.
    pub fn bias(&self) -> Option<&'a [f32]> {
        self.bias
    }

    fn check(
        &self,
        a: (&'static str, usize, usize),
        b: (&'static str, usize, usize),
        rows: usize,
    ) -> Result<()> {
        check_len(a.0, a.1, mul("rows × features", rows, a.2)?)?;
        check_len(b.0, b.1, mul("rows × features", rows, b.2)?)
    }

    fn forward_impl(&self, x: &[f32], y: &mut [f32], rows: usize) -> Result<()> {
        let (i, o) = (self.in_features, self.out_features);
        self.check(("x", x.len(), i), ("y", y.len(), o), rows)?;
        gemm_into(
            y,
            Strided::rows(x, i),
            Strided::transposed(self.weight, i),
            rows,
            o,
            i,
            1.0,
            false,
        )?;
        if let Some(b) = self.bias {
            for row in y.chunks_exact_mut(o.max(1)) {
                for (v, b) in row.iter_mut().zip(b) {
                    *v += b;
                }
            }
        }
        Ok(())
    }

    fn backward_impl(&self, dy: &[f32], dx: &mut [f32], rows: usize) -> Result<()> {
        let (i, o) = (self.in_features, self.out_features);
        self.check(("dy", dy.len(), o), ("dx", dx.len(), i), rows)?;
        gemm_into(
            dx,
            Strided::rows(dy, o),
            Strided::rows(self.weight, i),
            rows,
            i,
            o,
            1.0,
            true,
        )
    }
}

impl FrozenLinear for DenseLinear<'_> {
    fn in_features(&self) -> usize {
        self.in_features
    }
    fn out_features(&self) -> usize {
        self.out_features
    }
    fn forward(&self, x: &[f32], y: &mut [f32], rows: usize) -> Result<(), BoxedError> {
        self.forward_impl(x, y, rows).map_err(box_err)
    }
    fn backward_input(&self, dy: &[f32], dx: &mut [f32], rows: usize) -> Result<(), BoxedError> {
        self.backward_impl(dy, dx, rows).map_err(box_err)
    }
}

fn box_err(e: LoraError) -> BoxedError {
    Box::new(e)
}
