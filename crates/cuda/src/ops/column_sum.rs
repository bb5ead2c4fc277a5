//! Deterministic column sums (`dst[j] += Σ_rows x[row, j]`): the bias gradient of a linear
//! layer and the second pass of layer norm's parameter gradients.

use cudarc::driver::CudaSlice;
use headroom_tensor::{DType, Result, Tensor};

use super::{column_grid, OpLaunch};
use crate::device::Cuda;

/// Most row chunks of the first pass; fewer for small inputs.
const MAX_CHUNKS: usize = 256;
/// Fewest rows per chunk: below this the partials cost more than they save.
const MIN_ROWS_PER_CHUNK: usize = 16;

/// `(rows_per_chunk, chunks)` for `rows` rows, from the shape alone — never from the device —
/// because the chunking fixes the summation order and so the bits.
pub(crate) fn chunking(rows: usize) -> (usize, usize) {
    let per = rows.div_ceil(MAX_CHUNKS).max(MIN_ROWS_PER_CHUNK);
    (per, rows.div_ceil(per).max(1))
}

impl Cuda {
    /// `dst[j] += Σ_rows x[row, j]`: a linear layer's bias gradient from its f32 output
    /// gradient `x` `[rows, cols]` (any leading dims) into f32 `dst` `[cols]`, in a fixed order
    /// (deterministic, no atomics).
    pub fn column_sum(
        &self,
        dst: &mut crate::tensor::CudaTensor,
        x: &crate::tensor::CudaTensor,
    ) -> Result<()> {
        const OP: &str = "column_sum";
        self.check_devices(OP, &[dst, x])?;
        let cols = dst.numel();
        super::expect_dtype(OP, dst, DType::F32)?;
        let rows = super::rows_of(OP, x, cols, "the element count is not a multiple of cols")?;
        super::expect_f32(OP, x, rows * cols)?;
        if rows == 0 {
            return Ok(());
        }
        let cols32 = super::dim_u32(OP, dst, "cols must be in 1..=u32::MAX", cols)?;
        let x_b = self.buffer(OP, x)?;
        let dst_b = self.buffer_mut(OP, dst)?;
        self.column_sum_accumulate(OP, dst_b, x_b, rows, cols32)
    }

    /// Add the `chunks` partial rows of `partials` (`[chunks, cols]` f32) to `dst` in order.
    pub(crate) fn column_sum_finish(
        &self,
        op: &'static str,
        dst: &mut CudaSlice<u8>,
        partials: &CudaSlice<f32>,
        chunks: u32,
        cols: u32,
    ) -> Result<()> {
        let func = self.op_function(op, "column_sum_finish_f32")?;
        let cfg = self.elementwise_config(cols as usize);
        let mut launch = OpLaunch::new(self, "column_sum_finish_f32", &func);
        launch
            .output(dst)
            .input_f32(partials)
            .u32(&chunks)
            .u32(&cols);
        // SAFETY: dst holds cols f32 and partials chunks·cols f32 (the callers allocate and
        // check both); they are distinct allocations.
        unsafe { launch.launch(self, op, cfg) }
    }

    /// `dst[j] += Σ_rows x[row, j]` for f32 `x` `[rows, cols]` and f32 `dst` `[cols]`, in a
    /// fixed order (deterministic), with a `[chunks, cols]` f32 workspace.
    pub(crate) fn column_sum_accumulate(
        &self,
        op: &'static str,
        dst: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        rows: usize,
        cols: u32,
    ) -> Result<()> {
        let (per, chunks) = chunking(rows);
        let (per32, chunks32) = (to_u32(op, per)?, to_u32(op, chunks)?);
        let partials_fn = self.op_function(op, "column_sum_partials_f32")?;
        let mut partials = self.workspace::<f32>(chunks * cols as usize, DType::F32, false)?;
        let rows64 = rows as u64;
        {
            let mut launch = OpLaunch::new(self, "column_sum_partials_f32", &partials_fn);
            launch
                .output_f32(&mut partials.buffer)
                .input(x)
                .u64(&rows64)
                .u32(&cols)
                .u32(&per32);
            // SAFETY: x holds rows·cols f32 (checked by the caller); the workspace holds
            // chunks·cols f32 and the grid has one x-block per chunk.
            unsafe { launch.launch(self, op, column_grid(chunks32, cols))? };
        }
        self.column_sum_finish(op, dst, &partials.buffer, chunks32, cols)
    }
}

pub(crate) fn to_u32(op: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| headroom_tensor::Error::InvalidShape {
        op,
        shape: headroom_tensor::Shape::from(vec![v]),
        reason: "too large for the kernels' 32-bit parameters",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunking_covers_every_row_with_bounded_chunks() {
        for rows in [0usize, 1, 15, 16, 17, 255, 4096, 8192, 1 << 20, 12_345_677] {
            let (per, chunks) = chunking(rows);
            assert!(per >= MIN_ROWS_PER_CHUNK);
            assert!((1..=MAX_CHUNKS).contains(&chunks), "{rows}: {chunks}");
            assert!(per * chunks >= rows, "{rows} rows not covered");
            assert!(
                rows == 0 || per * (chunks - 1) < rows,
                "{rows}: an empty chunk"
            );
        }
    }
}
