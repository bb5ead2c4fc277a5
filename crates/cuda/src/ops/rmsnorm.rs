//! RMSNorm (headroom-trainer's `ops::rmsnorm`) on the device.

use headroom_tensor::{DType, Result};

use super::column_sum::{chunking, to_u32};
use super::{column_grid, dim_u32, expect_f32, row_config, rows_of, OpLaunch};
use crate::device::Cuda;
use crate::tensor::CudaTensor;

impl Cuda {
    /// `out = weight·(x·rstd)` per row of `c`, writing each row's `rstd = 1/√(mean(x²) + eps)`
    /// (f32 `[rows]`) — the CPU op's formula with f64 block-tree row sums.
    pub fn rmsnorm_forward(
        &self,
        out: &mut CudaTensor,
        rstd: &mut CudaTensor,
        inp: &CudaTensor,
        weight: &CudaTensor,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_forward";
        self.check_devices(OP, &[out, rstd, inp, weight])?;
        let c32 = dim_u32(OP, inp, "c must be in 1..=u32::MAX", c)?;
        let rows = rows_of(OP, inp, c, "the element count is not a multiple of c")?;
        expect_f32(OP, inp, rows * c)?;
        expect_f32(OP, weight, c)?;
        expect_f32(OP, out, rows * c)?;
        expect_f32(OP, rstd, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, "rmsnorm_forward_f32")?;
        let rows64 = rows as u64;
        let (inp_b, w_b) = (self.buffer(OP, inp)?, self.buffer(OP, weight)?);
        let out_b = self.buffer_mut(OP, out)?;
        let rstd_b = self.buffer_mut(OP, rstd)?;
        let mut launch = OpLaunch::new(self, "rmsnorm_forward_f32", &func);
        launch
            .output(out_b)
            .output(rstd_b)
            .input(inp_b)
            .input(w_b)
            .u64(&rows64)
            .u32(&c32)
            .f32(&eps);
        // SAFETY: out/inp hold rows·c f32, rstd rows f32, weight c f32 (checked); the outputs
        // are distinct mutable borrows.
        unsafe { launch.launch(self, OP, row_config(rows64)) }
    }

    /// Accumulate `dinp` and `dweight` from `dout` with the saved `rstd`. `dweight` is a
    /// deterministic column sum (fixed row chunks, then the chunks in order).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(
        &self,
        dinp: &mut CudaTensor,
        dweight: &mut CudaTensor,
        dout: &CudaTensor,
        inp: &CudaTensor,
        weight: &CudaTensor,
        rstd: &CudaTensor,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_backward";
        self.check_devices(OP, &[dinp, dweight, dout, inp, weight, rstd])?;
        let c32 = dim_u32(OP, inp, "c must be in 1..=u32::MAX", c)?;
        let rows = rows_of(OP, inp, c, "the element count is not a multiple of c")?;
        for t in [&*dinp, dout, inp] {
            expect_f32(OP, t, rows * c)?;
        }
        expect_f32(OP, dweight, c)?;
        expect_f32(OP, weight, c)?;
        expect_f32(OP, rstd, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let input_fn = self.op_function(OP, "rmsnorm_backward_input_f32")?;
        let partials_fn = self.op_function(OP, "rmsnorm_backward_weight_partials_f32")?;
        let rows64 = rows as u64;
        let (dout_b, inp_b, w_b, rstd_b) = (
            self.buffer(OP, dout)?,
            self.buffer(OP, inp)?,
            self.buffer(OP, weight)?,
            self.buffer(OP, rstd)?,
        );
        {
            let dinp_b = self.buffer_mut(OP, dinp)?;
            let mut launch = OpLaunch::new(self, "rmsnorm_backward_input_f32", &input_fn);
            launch
                .output(dinp_b)
                .input(dout_b)
                .input(inp_b)
                .input(w_b)
                .input(rstd_b)
                .u64(&rows64)
                .u32(&c32);
            // SAFETY: dinp/dout/inp hold rows·c f32, weight c, rstd rows (checked).
            unsafe { launch.launch(self, OP, row_config(rows64))? };
        }
        let (per, chunks) = chunking(rows);
        let (per32, chunks32) = (to_u32(OP, per)?, to_u32(OP, chunks)?);
        let mut pw = self.workspace::<f32>(chunks * c, DType::F32, false)?;
        {
            let mut launch =
                OpLaunch::new(self, "rmsnorm_backward_weight_partials_f32", &partials_fn);
            launch
                .output_f32(&mut pw.buffer)
                .input(dout_b)
                .input(inp_b)
                .input(rstd_b)
                .u64(&rows64)
                .u32(&c32)
                .u32(&per32);
            // SAFETY: the partials workspace holds chunks·c f32 and the grid has one x-block
            // per chunk; the inputs are as above.
            unsafe { launch.launch(self, OP, column_grid(chunks32, c32))? };
        }
        let dweight_b = self.buffer_mut(OP, dweight)?;
        self.column_sum_finish(OP, dweight_b, &pw.buffer, chunks32, c32)
    }
}
