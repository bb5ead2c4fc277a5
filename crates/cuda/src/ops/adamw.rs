//! AdamW on the device, exactly headroom-offload's `reference.rs`: PyTorch's single-tensor
//! `torch.optim.AdamW` as its AVX2/AVX-512 CPU kernels compute it (fused multiply-adds in the
//! first-moment lerp and the second moment's `addcmul`, everything else rounded alone).

use headroom_tensor::{DType, Error, Result, Tensor};

use super::{expect_dtype, expect_f32, expect_numel, OpLaunch};
use crate::device::Cuda;
use crate::tensor::CudaTensor;

/// The per-step constants of AdamW, computed once per update in f64 (Python floats, as
/// `torch.optim.AdamW` computes them) and rounded to f32 — the same fields and formulas as
/// `headroom_offload::StepScalars` (this crate does not depend on headroom-offload; a test pins
/// the formulas).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// `1 − lr·weight_decay` (decoupled weight decay).
    pub decay: f32,
    /// `1 − β1`, the lerp weight (the kernel takes ATen's other lerp formula from 0.5 up).
    pub one_minus_beta1: f32,
    /// β2.
    pub beta2: f32,
    /// `1 − β2`.
    pub one_minus_beta2: f32,
    /// `lr / (1 − β1^t)`.
    pub step_size: f32,
    /// `(1 − β2^t) ** 0.5`.
    pub bc2_sqrt: f32,
    /// ε, added outside the square root.
    pub eps: f32,
}

impl AdamWStep {
    /// Constants for step `t` (1-based; 0 is treated as 1). Powers are the C library's `pow`,
    /// as Python evaluates `beta1 ** step` and `bias_correction2 ** 0.5`.
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64, t: u64) -> Self {
        let t = t.max(1) as f64;
        let bc1 = 1.0 - c_pow(beta1, t);
        let bc2 = 1.0 - c_pow(beta2, t);
        AdamWStep {
            decay: (1.0 - lr * weight_decay) as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            step_size: (lr / bc1) as f32,
            bc2_sqrt: c_pow(bc2, 0.5) as f32,
            eps: eps as f32,
        }
    }
}

/// `x ** y` as CPython computes it for floats: the C library's `pow`. `black_box` keeps LLVM
/// from rewriting `pow(x, 0.5)` as `sqrt(x)` (glibc's `pow(x, 0.5)` differs from the correctly
/// rounded root for about one double in a thousand) or folding constant operands.
fn c_pow(x: f64, y: f64) -> f64 {
    std::hint::black_box(x).powf(std::hint::black_box(y))
}

impl Cuda {
    /// One AdamW step on a whole parameter: `param`, `m`, `v` f32; `grad` f32 or bf16; all the
    /// same element count. With `copy` (bf16, same count) the updated parameter is also
    /// written rounded to nearest even, in the same sweep. Bitwise equal to the CPU reference
    /// (`--fmad=false`, explicit fused multiply-adds where the reference has them, correctly
    /// rounded sqrt and division).
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
        assert_eq!(s.step_size, (1e-3 / (1.0 - 0.9f64 * 0.9 * 0.9)) as f32);
        assert_eq!(s.bc2_sqrt, (1.0 - 0.95f64 * 0.95 * 0.95).sqrt() as f32);
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
