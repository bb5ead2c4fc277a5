//! Plain scalar AdamW, written as PyTorch documents and implements it (`torch.optim.AdamW`,
//! non-amsgrad): decoupled weight decay, first moment as a lerp toward the gradient, second
//! moment as an exponential average of g², bias corrections, ε outside the square root.
//!
//! One element at a time, f32 arithmetic with f64 step constants: the reference every fast path
//! is tested against.

use crate::StepScalars;

/// One AdamW step on slices, element by element.
pub fn adamw_step(s: &StepScalars, param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
    for i in 0..param.len() {
        let g = grad[i];
        // param.mul_(1 - lr * weight_decay)
        let p = param[i] * s.decay;
        // exp_avg.lerp_(grad, 1 - beta1)
        let mi = m[i] + s.one_minus_beta1 * (g - m[i]);
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value = 1 - beta2)
        let vi = v[i] * s.beta2 + (s.one_minus_beta2 * g) * g;
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = vi.sqrt() / s.bc2_sqrt + s.eps;
        // param.addcdiv_(exp_avg, denom, value = -step_size)
        param[i] = p - s.step_size * (mi / denom);
        m[i] = mi;
        v[i] = vi;
    }
}
