// AdamW, one element per thread, exactly headroom-offload's reference.rs: PyTorch's
// single-tensor torch.optim.AdamW (non-amsgrad) as its AVX2/AVX-512 CPU kernels compute it.
// f32 parameters and moments, f32 or bf16 gradients, optionally writing the updated parameter
// as bf16 (round to nearest even) for the forward pass in the same sweep.
//
// The module is compiled with --fmad=false, so nothing is contracted behind our back; the two
// fused multiply-adds torch's CPU kernels perform (ATen's lerp, and addcmul as GCC contracts
// it) are explicit __fmaf_rn, everything else an explicitly rounded intrinsic (sqrt and
// division correctly rounded). The result is bitwise the CPU reference. The step constants
// (headroom_offload::StepScalars' fields) come from the host.
// All launches: grid-stride, any grid.

__device__ __forceinline__ float hr_adamw_update(float* __restrict__ param, float g,
                                                 float* __restrict__ m, float* __restrict__ v,
                                                 hr_u64 i, float decay, float one_minus_beta1,
                                                 float beta2, float one_minus_beta2,
                                                 float step_size, float bc2_sqrt, float eps) {
    // param.mul_(1 - lr * weight_decay)
    float p = __fmul_rn(param[i], decay);
    // exp_avg.lerp_(grad, w): ATen's two formulas, split at |w| < 0.5 (uniform across the grid).
    float m0 = m[i];
    float diff = __fsub_rn(g, m0);
    float mi = fabsf(one_minus_beta1) < 0.5f
                   ? __fmaf_rn(one_minus_beta1, diff, m0)
                   : __fmaf_rn(__fsub_rn(one_minus_beta1, 1.0f), diff, g);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    float vi = __fmaf_rn(__fmul_rn(one_minus_beta2, g), g, __fmul_rn(v[i], beta2));
    // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
    // param.addcdiv_(exp_avg, denom, value=-step_size)
    float updated = __fsub_rn(p, __fdiv_rn(__fmul_rn(step_size, mi), denom));
    param[i] = updated;
    m[i] = mi;
    v[i] = vi;
    return updated;
}

#define HR_ADAMW_KERNEL(NAME, G, GTY)                                                     \
    extern "C" __global__ void NAME(float* __restrict__ param, const GTY* __restrict__ grad, \
                                    float* __restrict__ m, float* __restrict__ v, hr_u64 n, \
                                    float decay, float one_minus_beta1, float beta2,       \
                                    float one_minus_beta2, float step_size, float bc2_sqrt, \
                                    float eps) {                                            \
        HR_GRID_STRIDE(i, n) {                                                              \
            hr_adamw_update(param, hr_load_##G(grad, i), m, v, i, decay, one_minus_beta1,   \
                            beta2, one_minus_beta2, step_size, bc2_sqrt, eps);              \
        }                                                                                   \
    }

#define HR_ADAMW_COPY_KERNEL(NAME, G, GTY)                                                \
    extern "C" __global__ void NAME(float* __restrict__ param, const GTY* __restrict__ grad, \
                                    float* __restrict__ m, float* __restrict__ v,          \
                                    hr_u16* __restrict__ copy, hr_u64 n, float decay,      \
                                    float one_minus_beta1, float beta2,                    \
                                    float one_minus_beta2, float step_size, float bc2_sqrt, \
                                    float eps) {                                            \
        HR_GRID_STRIDE(i, n) {                                                              \
            float p = hr_adamw_update(param, hr_load_##G(grad, i), m, v, i, decay,          \
                                      one_minus_beta1, beta2, one_minus_beta2, step_size,   \
                                      bc2_sqrt, eps);                                       \
            hr_store_bf16(copy, i, p);                                                      \
        }                                                                                   \
    }

HR_ADAMW_KERNEL(adamw_f32, f32, float)
HR_ADAMW_KERNEL(adamw_bf16, bf16, hr_u16)
HR_ADAMW_COPY_KERNEL(adamw_copy_bf16_f32, f32, float)
HR_ADAMW_COPY_KERNEL(adamw_copy_bf16_bf16, bf16, hr_u16)
