//! Plain scalar AdamW: PyTorch's single-tensor `torch.optim.AdamW` (`foreach=False`,
//! `fused=False`, `amsgrad=False`, `maximize=False`) on the CPU, operation for operation, as
//! torch 2.15's AVX2 and AVX-512 kernels compute it. Checked bit for bit against torch's own
//! output (`tests/fixtures/torch_adamw.*`, written by `benches/torch/make_adamw_fixture.py`).
//!
//! Per element, in torch's order (the scalars are [`StepScalars`], f64 rounded to f32):
//!
//! 1. `param.mul_(1 - lr·weight_decay)`: `p·decay`.
//! 2. `exp_avg.lerp_(grad, w)` with `w = 1 - β1`: ATen's lerp, one fused multiply-add after the
//!    difference: `fma(w, g - m, m)` when `|w| < 0.5`, else `fma(w - 1, g - m, g)`.
//! 3. `exp_avg_sq.mul_(β2).addcmul_(grad, grad, value=1 - β2)`: `fma((1 - β2)·g, g, v·β2)`
//!    (GCC contracts ATen's `self + value·t1·t2` into a fused multiply-add).
//! 4. `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: `√v / bc2_sqrt + ε`,
//!    the square root correctly rounded.
//! 5. `param.addcdiv_(exp_avg, denom, value=-step_size)`: `p + ((-step_size)·m) / denom`
//!    (the fused kernel writes `p - (step_size·m) / denom`: the same bits, negation is exact).
//!
//! Every other operation rounds separately. Two things in torch are outside this formula:
//! - x86-64 builds of torch compute a contiguous f32 `sqrt` with MKL's vector math library
//!   (`vmsSqrt`, VML_HA), which is not correctly rounded (one result in six is one ulp off on
//!   the AMD EPYC the fixture was made on) and depends on MKL's per-CPU code path. Step 4 uses
//!   the IEEE square root, which is what ATen's own vectorised `sqrt` computes in builds
//!   without MKL. The fixture's bit-exact run replaces only `Tensor.sqrt` with a correctly
//!   rounded one; its stock run shows `exp_avg` and `exp_avg_sq` equal to stock torch's bit for
//!   bit (they never see the root) and `param` within `t·(ulp + lr·2^-19)` after `t` steps.
//! - torch's `DEFAULT` CPU capability (a CPU without AVX2) has no FMA and rounds steps 2 and 3
//!   twice; those bits differ from torch on AVX2/AVX-512 machines and from this reference.

use crate::StepScalars;

/// ATen's `lerp(start, end, weight)` for a scalar weight, as its vectorised CPU kernel computes
/// it (the weight-small / weight-large split keeps the result exact at both ends).
#[inline]
pub fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    let diff = end - start;
    if weight.abs() < 0.5 {
        weight.mul_add(diff, start)
    } else {
        (weight - 1.0).mul_add(diff, end)
    }
}

/// One AdamW step on slices, element by element. All four slices should have the same length;
/// elements beyond the shortest are left untouched.
pub fn adamw_step(s: &StepScalars, param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
    let rows = param
        .iter_mut()
        .zip(grad)
        .zip(m.iter_mut().zip(v.iter_mut()));
    for ((p, &g), (m, v)) in rows {
        // param.mul_(1 - lr * weight_decay)
        let decayed = *p * s.decay;
        // exp_avg.lerp_(grad, 1 - beta1)
        let exp_avg = lerp(*m, g, s.one_minus_beta1);
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        let scaled = *v * s.beta2;
        let exp_avg_sq = (s.one_minus_beta2 * g).mul_add(g, scaled);
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = exp_avg_sq.sqrt() / s.bc2_sqrt + s.eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        *p = decayed + (-s.step_size * exp_avg) / denom;
        *m = exp_avg;
        *v = exp_avg_sq;
    }
}
