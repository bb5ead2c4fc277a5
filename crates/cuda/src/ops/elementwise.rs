//! Tanh-GELU (headroom-trainer's `ops::gelu`) and the residual add on the device: elementwise,
//! bitwise equal to the CPU (the kernels port the trainer's exp/tanh operation for operation).

use headroom_tensor::{Result, Tensor};

use super::{expect_f32, OpLaunch};
use crate::device::Cuda;
use crate::tensor::CudaTensor;

impl Cuda {
    /// `out = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, f32, same element count.
    pub fn gelu_forward(&self, out: &mut CudaTensor, inp: &CudaTensor) -> Result<()> {
        const OP: &str = "gelu_forward";
        self.check_devices(OP, &[out, inp])?;
        let n = inp.numel();
        expect_f32(OP, inp, n)?;
        expect_f32(OP, out, n)?;
        if n == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, "gelu_forward_f32")?;
        let n64 = n as u64;
        let inp_b = self.buffer(OP, inp)?;
        let out_b = self.buffer_mut(OP, out)?;
        let mut launch = OpLaunch::new(self, "gelu_forward_f32", &func);
        launch.output(out_b).input(inp_b).u64(&n64);
        // SAFETY: both hold n f32 (checked) and do not alias.
        unsafe { launch.launch(self, OP, self.elementwise_config(n)) }
    }

    /// `dinp += gelu'(inp) · dout` (accumulates, like the CPU op).
    pub fn gelu_backward(
        &self,
        dinp: &mut CudaTensor,
        inp: &CudaTensor,
        dout: &CudaTensor,
    ) -> Result<()> {
        const OP: &str = "gelu_backward";
        self.check_devices(OP, &[dinp, inp, dout])?;
        let n = inp.numel();
        expect_f32(OP, inp, n)?;
        expect_f32(OP, dout, n)?;
        expect_f32(OP, dinp, n)?;
        if n == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, "gelu_backward_f32")?;
        let n64 = n as u64;
        let (inp_b, dout_b) = (self.buffer(OP, inp)?, self.buffer(OP, dout)?);
        let dinp_b = self.buffer_mut(OP, dinp)?;
        let mut launch = OpLaunch::new(self, "gelu_backward_f32", &func);
        launch.output(dinp_b).input(inp_b).input(dout_b).u64(&n64);
        // SAFETY: all three hold n f32 (checked); dinp is a distinct mutable borrow.
        unsafe { launch.launch(self, OP, self.elementwise_config(n)) }
    }

    /// `y += x` in f32: the residual connection in forward (the trainer's `*y += r`), and a
    /// gradient accumulation in backward.
    pub fn residual_add(&self, y: &mut CudaTensor, x: &CudaTensor) -> Result<()> {
        const OP: &str = "residual_add";
        self.check_devices(OP, &[y, x])?;
        let n = y.numel();
        expect_f32(OP, y, n)?;
        expect_f32(OP, x, n)?;
        if n == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, "residual_add_f32")?;
        let n64 = n as u64;
        let x_b = self.buffer(OP, x)?;
        let y_b = self.buffer_mut(OP, y)?;
        let mut launch = OpLaunch::new(self, "residual_add_f32", &func);
        launch.output(y_b).input(x_b).u64(&n64);
        // SAFETY: both hold n f32 (checked) and do not alias.
        unsafe { launch.launch(self, OP, self.elementwise_config(n)) }
    }
}
