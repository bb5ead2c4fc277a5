//! AdamW on the device, exactly headroom-offload's `reference.rs` formula.

use headroom_tensor::{DType, Error, Result, Tensor};

use super::{expect_dtype, expect_f32, expect_numel, OpLaunch};
use crate::device::Cuda;
use crate::tensor::CudaTensor;

/// The per-step constants of AdamW, computed once per update in f64 and rounded to f32 — the
/// same fields and formulas as `headroom_offload::StepScalars` (this crate does not depend on
/// headroom-offload; a test pins the formulas).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// `1 − lr·weight_decay` (decoupled weight decay).
    pub decay: f32,
    /// `1 − β1`.
    pub one_minus_beta1: f32,
    /// β2.
    pub beta2: f32,
    /// `1 − β2`.
    pub one_minus_beta2: f32,
    /// `lr / (1 − β1^t)`.
    pub step_size: f32,
    /// `sqrt(1 − β2^t)`.
    pub bc2_sqrt: f32,
    /// ε, added outside the square root.
    pub eps: f32,
}

impl AdamWStep {
    /// Constants for step `t` (1-based; 0 is treated as 1).
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64, t: u64) -> Self {
        let t = i32::try_from(t.max(1)).unwrap_or(i32::MAX);
        let bc1 = 1.0 - beta1.powi(t);
        let bc2 = 1.0 - beta2.powi(t);
        AdamWStep {
            decay: (1.0 - lr * weight_decay) as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            step_size: (lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: eps as f32,
        }
    }
}

impl Cuda {
    /// One AdamW step on a whole parameter: `param`, `m`, `v` f32; `grad` f32 or bf16; all the
    /// same element count. With `copy` (bf16, same count) the updated parameter is also
    /// written rounded to nearest even, in the same sweep. Bitwise equal to the CPU reference
    /// (`--fmad=false`, correctly rounded sqrt and division).
    pub fn adamw_step(
        &self,
        s: &AdamWStep,
        param: &mut CudaTensor,
        grad: &CudaTensor,
        m: &mut CudaTensor,
        v: &mut CudaTensor,
        copy: Option<&mut CudaTensor>,
    ) -> Result<()> {
        const OP: &str = "adamw_step";
        self.check_devices(OP, &[param, grad, m, v])?;
        if let Some(c) = copy.as_deref() {
            self.check_device(OP, c)?;
        }
        let n = param.numel();
        expect_f32(OP, param, n)?;
        expect_f32(OP, m, n)?;
        expect_f32(OP, v, n)?;
        expect_numel(OP, grad, n)?;
        let grad_is_bf16 = match grad.dtype() {
            DType::F32 => false,
            DType::BF16 => true,
            dtype => return Err(Error::UnsupportedDType { op: OP, dtype }),
        };
        if let Some(c) = copy.as_deref() {
            expect_dtype(OP, c, DType::BF16)?;
            expect_numel(OP, c, n)?;
        }
        if n == 0 {
            return Ok(());
        }
        let function = match (copy.is_some(), grad_is_bf16) {
            (false, false) => "adamw_f32",
            (false, true) => "adamw_bf16",
            (true, false) => "adamw_copy_bf16_f32",
            (true, true) => "adamw_copy_bf16_bf16",
        };
        let func = self.op_function(OP, function)?;
        let n64 = n as u64;
        let grad_b = self.buffer(OP, grad)?;
        let param_b = self.buffer_mut(OP, param)?;
        let m_b = self.buffer_mut(OP, m)?;
        let v_b = self.buffer_mut(OP, v)?;
        let mut launch = OpLaunch::new(self, function, &func);
        launch.output(param_b).input(grad_b).output(m_b).output(v_b);
        if let Some(c) = copy {
            launch.output(self.buffer_mut(OP, c)?);
        }
        launch
            .u64(&n64)
            .f32(&s.decay)
            .f32(&s.one_minus_beta1)
            .f32(&s.beta2)
            .f32(&s.one_minus_beta2)
            .f32(&s.step_size)
            .f32(&s.bc2_sqrt)
            .f32(&s.eps);
        // SAFETY: param, m, v hold n f32, grad n elements of its dtype (the kernel chosen by
        // that dtype), copy n bf16 (all checked); the outputs are distinct mutable borrows.
        unsafe { launch.launch(self, OP, self.elementwise_config(n)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_constants_follow_the_offload_formulas() {
        let s = AdamWStep::new(1e-3, 0.9, 0.95, 1e-8, 0.1, 3);
        assert_eq!(s.decay, (1.0 - 1e-3 * 0.1) as f32);
        assert_eq!(s.one_minus_beta1, (1.0f64 - 0.9) as f32);
        assert_eq!(s.beta2, 0.95f32);
        assert_eq!(s.one_minus_beta2, (1.0f64 - 0.95) as f32);
        assert_eq!(s.step_size, (1e-3 / (1.0 - 0.9f64.powi(3))) as f32);
        assert_eq!(s.bc2_sqrt, (1.0 - 0.95f64.powi(3)).sqrt() as f32);
        assert_eq!(s.eps, 1e-8f32);
        // Step 0 is step 1, and huge steps saturate instead of overflowing.
        assert_eq!(
            AdamWStep::new(1e-3, 0.9, 0.95, 1e-8, 0.1, 0),
            AdamWStep::new(1e-3, 0.9, 0.95, 1e-8, 0.1, 1)
        );
        let late = AdamWStep::new(1e-3, 0.9, 0.95, 1e-8, 0.1, u64::MAX);
        assert_eq!(late.step_size, 1e-3f32);
        assert_eq!(late.bc2_sqrt, 1.0f32);
    }
}
