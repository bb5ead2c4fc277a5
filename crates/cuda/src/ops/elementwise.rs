//! Tanh-GELU (headroom-trainer's `ops::gelu`) and the residual add on the device: elementwise,
//! bitwise equal to the CPU (the kernels port the trainer's exp/tanh operation for operation).
//! GeGLU (`ops::glu`'s tanh-GELU gate, bitwise like the GELU) and Llama's elementwise ops:
//! SwiGLU (`ops::swiglu`, to a few ulp: another `exp`),
//! the rotary embedding (`ops::rope::apply`, bitwise on the CPU's tables) and the in-place
//! rounding to bf16/f16 (bitwise).

use headroom_tensor::{DType, Error, Result, Tensor};

use super::{dim_u32, expect_f32, rows_of, OpLaunch};
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

    /// `out = gate·sigmoid(gate)·up`, f32, same element count.
    pub fn swiglu_forward(
        &self,
        out: &mut CudaTensor,
        gate: &CudaTensor,
        up: &CudaTensor,
    ) -> Result<()> {
        self.gated_forward("swiglu_forward", "swiglu_forward_f32", out, gate, up)
    }

    /// SwiGLU's backward: `dgate += ∂y/∂gate·dout`, `dup += silu(gate)·dout` (accumulates).
    pub fn swiglu_backward(
        &self,
        dgate: &mut CudaTensor,
        dup: &mut CudaTensor,
        gate: &CudaTensor,
        up: &CudaTensor,
        dout: &CudaTensor,
    ) -> Result<()> {
        let kernel = "swiglu_backward_f32";
        self.gated_backward("swiglu_backward", kernel, dgate, dup, gate, up, dout)
    }

    /// `out = gelu(gate)·up` (GeGLU, tanh GELU as [`Cuda::gelu_forward`]), f32, same element
    /// count.
    pub fn geglu_forward(
        &self,
        out: &mut CudaTensor,
        gate: &CudaTensor,
        up: &CudaTensor,
    ) -> Result<()> {
        self.gated_forward("geglu_forward", "geglu_forward_f32", out, gate, up)
    }

    /// GeGLU's backward: `dgate += gelu'(gate)·up·dout`, `dup += gelu(gate)·dout`
    /// (accumulates).
    pub fn geglu_backward(
        &self,
        dgate: &mut CudaTensor,
        dup: &mut CudaTensor,
        gate: &CudaTensor,
        up: &CudaTensor,
        dout: &CudaTensor,
    ) -> Result<()> {
        let kernel = "geglu_backward_f32";
        self.gated_backward("geglu_backward", kernel, dgate, dup, gate, up, dout)
    }

    /// A gated MLP's forward kernel `kernel(out, gate, up, n)`.
    fn gated_forward(
        &self,
        op: &'static str,
        kernel: &'static str,
        out: &mut CudaTensor,
        gate: &CudaTensor,
        up: &CudaTensor,
    ) -> Result<()> {
        self.check_devices(op, &[out, gate, up])?;
        let n = gate.numel();
        for t in [&*out, gate, up] {
            expect_f32(op, t, n)?;
        }
        if n == 0 {
            return Ok(());
        }
        let func = self.op_function(op, kernel)?;
        let n64 = n as u64;
        let (g_b, u_b) = (self.buffer(op, gate)?, self.buffer(op, up)?);
        let out_b = self.buffer_mut(op, out)?;
        let mut launch = OpLaunch::new(self, kernel, &func);
        launch.output(out_b).input(g_b).input(u_b).u64(&n64);
        // SAFETY: all three hold n f32 (checked); out is a distinct mutable borrow.
        unsafe { launch.launch(self, op, self.elementwise_config(n)) }
    }

    /// A gated MLP's backward kernel `kernel(dgate, dup, gate, up, dout, n)` (accumulates).
    #[allow(clippy::too_many_arguments)]
    fn gated_backward(
        &self,
        op: &'static str,
        kernel: &'static str,
        dgate: &mut CudaTensor,
        dup: &mut CudaTensor,
        gate: &CudaTensor,
        up: &CudaTensor,
        dout: &CudaTensor,
    ) -> Result<()> {
        self.check_devices(op, &[dgate, dup, gate, up, dout])?;
        let n = gate.numel();
        for t in [&*dgate, &*dup, gate, up, dout] {
            expect_f32(op, t, n)?;
        }
        if n == 0 {
            return Ok(());
        }
        let func = self.op_function(op, kernel)?;
        let n64 = n as u64;
        let (g_b, u_b, d_b) = (
            self.buffer(op, gate)?,
            self.buffer(op, up)?,
            self.buffer(op, dout)?,
        );
        let dg_b = self.buffer_mut(op, dgate)?;
        let du_b = self.buffer_mut(op, dup)?;
        let mut launch = OpLaunch::new(self, kernel, &func);
        launch
            .output(dg_b)
            .output(du_b)
            .input(g_b)
            .input(u_b)
            .input(d_b)
            .u64(&n64);
        // SAFETY: all five hold n f32 (checked); the outputs are distinct mutable borrows.
        unsafe { launch.launch(self, op, self.elementwise_config(n)) }
    }

    /// Rotate f32 `x` `[rows, hs]` in place by the rotary embedding of position `row % t`
    /// (Hugging Face's rotate-half layout), from the host-computed `cos` and `sin` tables
    /// `[t, hs/2]` f32; `inverse` rotates by the negative angle.
    pub fn rope(
        &self,
        x: &mut CudaTensor,
        cos: &CudaTensor,
        sin: &CudaTensor,
        t: usize,
        hs: usize,
        inverse: bool,
    ) -> Result<()> {
        const OP: &str = "rope";
        self.check_devices(OP, &[x, cos, sin])?;
        if !hs.is_multiple_of(2) {
            return Err(Error::InvalidShape {
                op: OP,
                shape: x.shape().clone(),
                reason: "the head dimension must be even",
            });
        }
        let half = dim_u32(OP, x, "hs must be in 2..=u32::MAX", hs / 2)?;
        let t32 = dim_u32(OP, x, "t must be in 1..=u32::MAX", t)?;
        let rows = rows_of(OP, x, hs, "the element count is not a multiple of hs")?;
        rows_of(OP, x, hs * t, "the rows are not whole sequences of t")?;
        expect_f32(OP, x, rows * hs)?;
        expect_f32(OP, cos, t * (hs / 2))?;
        expect_f32(OP, sin, t * (hs / 2))?;
        if rows == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, "rope_f32")?;
        let (rows64, inverse32) = (rows as u64, u32::from(inverse));
        let (c_b, s_b) = (self.buffer(OP, cos)?, self.buffer(OP, sin)?);
        let x_b = self.buffer_mut(OP, x)?;
        let mut launch = OpLaunch::new(self, "rope_f32", &func);
        launch
            .output(x_b)
            .input(c_b)
            .input(s_b)
            .u64(&rows64)
            .u32(&t32)
            .u32(&half)
            .u32(&inverse32);
        // SAFETY: x holds rows·hs f32, the tables t·hs/2 f32 each (checked); x is a distinct
        // mutable borrow.
        unsafe { launch.launch(self, OP, self.elementwise_config(rows * (hs / 2))) }
    }

    /// Round f32 `x` in place to `dtype` (bf16 or f16, round to nearest even) and back; f32
    /// leaves it as it is.
    pub fn round_in_place(&self, x: &mut CudaTensor, dtype: DType) -> Result<()> {
        const OP: &str = "round_in_place";
        self.check_devices(OP, &[x])?;
        let n = x.numel();
        expect_f32(OP, x, n)?;
        let function = match dtype {
            DType::F32 => return Ok(()),
            DType::BF16 => "round_bf16_f32",
            DType::F16 => "round_f16_f32",
            other => {
                return Err(Error::UnsupportedDType {
                    op: OP,
                    dtype: other,
                })
            }
        };
        if n == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, function)?;
        let n64 = n as u64;
        let x_b = self.buffer_mut(OP, x)?;
        let mut launch = OpLaunch::new(self, function, &func);
        launch.output(x_b).u64(&n64);
        // SAFETY: x holds n f32 (checked).
        unsafe { launch.launch(self, OP, self.elementwise_config(n)) }
    }
}
