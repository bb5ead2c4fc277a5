// SwiGLU's gate (Llama's MLP), f32, elementwise: y = silu(gate)·up and its backward.
//
// The formulas are headroom-trainer's ops::swiglu operation for operation (sigmoid as
// 1 / (1 + e^-x), products left to right), every step an explicitly rounded intrinsic and
// the module compiled with --fmad=false. e^x is hr_exp_f32 (the trainer's fast_math port:
// deterministic, no FMA, no flush to zero, unlike libdevice's expf) where the CPU op calls its
// libm's exp, so results agree with the CPU to a few ulp, not bitwise.
// All launches: grid-stride, any grid.

__device__ __forceinline__ float hr_sigmoid_f32(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, hr_exp_f32(-x)));
}

// out = gate·sigmoid(gate)·up.
extern "C" __global__ void swiglu_forward_f32(float* __restrict__ out,
                                              const float* __restrict__ gate,
                                              const float* __restrict__ up, hr_u64 n) {
    HR_GRID_STRIDE(i, n) {
        float g = gate[i];
        out[i] = __fmul_rn(__fmul_rn(g, hr_sigmoid_f32(g)), up[i]);
    }
}

// dgate += s·(1 + g·(1 − s))·up·dout, dup += g·s·dout, s = sigmoid(g) (accumulate, like the
// CPU op).
extern "C" __global__ void swiglu_backward_f32(float* __restrict__ dgate,
                                               float* __restrict__ dup,
                                               const float* __restrict__ gate,
                                               const float* __restrict__ up,
                                               const float* __restrict__ dout, hr_u64 n) {
    HR_GRID_STRIDE(i, n) {
        float g = gate[i];
        float d = dout[i];
        float s = hr_sigmoid_f32(g);
        float ds = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s))));
        dgate[i] = __fadd_rn(dgate[i], __fmul_rn(__fmul_rn(ds, up[i]), d));
        dup[i] = __fadd_rn(dup[i], __fmul_rn(__fmul_rn(g, s), d));
    }
}
