//! Layer normalisation (headroom-trainer's `ops::layernorm`) on the device.

use headroom_tensor::{DType, Result};

use super::column_sum::{chunking, to_u32};
use super::{column_grid, dim_u32, expect_f32, row_config, rows_of, OpLaunch};
use crate::device::Cuda;
use crate::tensor::CudaTensor;

impl Cuda {
    /// `out = (x − mean)·rstd·weight + bias` per row of `c`, writing each row's `mean` and
    /// `rstd` (f32 `[rows]`), eps = 1e-5 — the CPU op's formula with block-tree row sums.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward(
        &self,
        out: &mut CudaTensor,
        mean: &mut CudaTensor,
        rstd: &mut CudaTensor,
        inp: &CudaTensor,
        weight: &CudaTensor,
        bias: &CudaTensor,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "layernorm_forward";
        self.check_devices(OP, &[out, mean, rstd, inp, weight, bias])?;
        let c32 = dim_u32(OP, inp, "c must be in 1..=u32::MAX", c)?;
        let rows = rows_of(OP, inp, c, "the element count is not a multiple of c")?;
        expect_f32(OP, inp, rows * c)?;
        expect_f32(OP, weight, c)?;
        expect_f32(OP, bias, c)?;
        expect_f32(OP, out, rows * c)?;
        expect_f32(OP, mean, rows)?;
        expect_f32(OP, rstd, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, "layernorm_forward_f32")?;
        let rows64 = rows as u64;
        let (inp_b, w_b, b_b) = (
            self.buffer(OP, inp)?,
            self.buffer(OP, weight)?,
            self.buffer(OP, bias)?,
        );
        let out_b = self.buffer_mut(OP, out)?;
        let mean_b = self.buffer_mut(OP, mean)?;
        let rstd_b = self.buffer_mut(OP, rstd)?;
        let mut launch = OpLaunch::new(self, "layernorm_forward_f32", &func);
        launch
            .output(out_b)
            .output(mean_b)
            .output(rstd_b)
            .input(inp_b)
            .input(w_b)
            .input(b_b)
            .u64(&rows64)
            .u32(&c32);
        // SAFETY: out/inp hold rows·c f32, mean/rstd rows f32, weight/bias c f32 (checked);
        // outputs are distinct mutable borrows.
        unsafe { launch.launch(self, OP, row_config(rows64)) }
    }

    /// Accumulate `dinp`, `dweight`, `dbias` from `dout` with the saved `mean` and `rstd`.
    /// `dweight`/`dbias` are deterministic column sums (fixed row chunks, then the chunks in
    /// order), so they agree with the CPU's sequential sums to rounding and with themselves
    /// bit for bit.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward(
        &self,
        dinp: &mut CudaTensor,
        dweight: &mut CudaTensor,
        dbias: &mut CudaTensor,
        dout: &CudaTensor,
        inp: &CudaTensor,
        weight: &CudaTensor,
        mean: &CudaTensor,
        rstd: &CudaTensor,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "layernorm_backward";
        self.check_devices(OP, &[dinp, dweight, dbias, dout, inp, weight, mean, rstd])?;
        let c32 = dim_u32(OP, inp, "c must be in 1..=u32::MAX", c)?;
        let rows = rows_of(OP, inp, c, "the element count is not a multiple of c")?;
        for t in [&*dinp, dout, inp] {
            expect_f32(OP, t, rows * c)?;
        }
        for t in [&*dweight, &*dbias, weight] {
            expect_f32(OP, t, c)?;
        }
        expect_f32(OP, mean, rows)?;
        expect_f32(OP, rstd, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let input_fn = self.op_function(OP, "layernorm_backward_input_f32")?;
        let partials_fn = self.op_function(OP, "layernorm_backward_param_partials_f32")?;
        let rows64 = rows as u64;
        let (dout_b, inp_b, w_b, mean_b, rstd_b) = (
            self.buffer(OP, dout)?,
            self.buffer(OP, inp)?,
            self.buffer(OP, weight)?,
            self.buffer(OP, mean)?,
            self.buffer(OP, rstd)?,
        );
        {
            let dinp_b = self.buffer_mut(OP, dinp)?;
            let mut launch = OpLaunch::new(self, "layernorm_backward_input_f32", &input_fn);
            launch
                .output(dinp_b)
                .input(dout_b)
                .input(inp_b)
                .input(w_b)
                .input(mean_b)
                .input(rstd_b)
                .u64(&rows64)
                .u32(&c32);
            // SAFETY: dinp/dout/inp hold rows·c f32, weight c, mean/rstd rows (checked).
            unsafe { launch.launch(self, OP, row_config(rows64))? };
        }
        let (per, chunks) = chunking(rows);
        let (per32, chunks32) = (to_u32(OP, per)?, to_u32(OP, chunks)?);
        let mut pw = self.workspace::<f32>(chunks * c, DType::F32, false)?;
        let mut pb = self.workspace::<f32>(chunks * c, DType::F32, false)?;
        {
            let mut launch =
                OpLaunch::new(self, "layernorm_backward_param_partials_f32", &partials_fn);
            launch
                .output_f32(&mut pw.buffer)
                .output_f32(&mut pb.buffer)
                .input(dout_b)
                .input(inp_b)
                .input(mean_b)
                .input(rstd_b)
                .u64(&rows64)
                .u32(&c32)
                .u32(&per32);
            // SAFETY: each partials workspace holds chunks·c f32 and the grid has one x-block per
            // chunk; the inputs are as above.
            unsafe { launch.launch(self, OP, column_grid(chunks32, c32))? };
        }
        let dweight_b = self.buffer_mut(OP, dweight)?;
        self.column_sum_finish(OP, dweight_b, &pw.buffer, chunks32, c32)?;
        let dbias_b = self.buffer_mut(OP, dbias)?;
        self.column_sum_finish(OP, dbias_b, &pb.buffer, chunks32, c32)
    }
}
