// GELU with the tanh approximation (GPT-2's gelu_new), Gemma's GeGLU gate built on it, and
// the residual add, f32.
//
// The formulas are headroom-trainer's ops::gelu operation for operation, with the same
// exp/tanh (hr_tanh_f32 ports its fast_math), every step an explicitly rounded intrinsic and
// the module compiled with --fmad=false: results are bitwise equal to the CPU's.
// All launches: grid-stride, any grid.

#define HR_GELU_SQRT_2_OVER_PI 0.7978846f
#define HR_GELU_K 0.044715f

__device__ __forceinline__ float hr_gelu_inner(float x) {
    // SQRT_2_OVER_PI * (x + K * x * x * x)
    float cube = __fmul_rn(__fmul_rn(__fmul_rn(HR_GELU_K, x), x), x);
    return __fmul_rn(HR_GELU_SQRT_2_OVER_PI, __fadd_rn(x, cube));
}

// 0.5·x·(1 + t), t = tanh(u(x)).
__device__ __forceinline__ float hr_gelu_from_tanh(float x, float t) {
    return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, t));
}

// gelu'(x) = 0.5·(1 + t) + 0.5·x·(1 − t²)·u'(x), t = tanh(u(x)).
__device__ __forceinline__ float hr_gelu_derivative(float x, float t) {
    float sech2 = __fsub_rn(1.0f, __fmul_rn(t, t));
    // SQRT_2_OVER_PI * (1.0 + 3.0 * K * x * x)
    float three_k = __fmul_rn(3.0f, HR_GELU_K);
    float du = __fmul_rn(HR_GELU_SQRT_2_OVER_PI,
                         __fadd_rn(1.0f, __fmul_rn(__fmul_rn(three_k, x), x)));
    float left = __fmul_rn(0.5f, __fadd_rn(1.0f, t));
    float right = __fmul_rn(__fmul_rn(__fmul_rn(0.5f, x), sech2), du);
    return __fadd_rn(left, right);
}

// out = 0.5·x·(1 + tanh(u)).
extern "C" __global__ void gelu_forward_f32(float* __restrict__ out,
                                            const float* __restrict__ inp, hr_u64 n) {
    HR_GRID_STRIDE(i, n) {
        float x = inp[i];
        out[i] = hr_gelu_from_tanh(x, hr_tanh_f32(hr_gelu_inner(x)));
    }
}

// dinp += gelu'(inp) · dout (accumulates, like the CPU op).
extern "C" __global__ void gelu_backward_f32(float* __restrict__ dinp,
                                             const float* __restrict__ inp,
                                             const float* __restrict__ dout, hr_u64 n) {
    HR_GRID_STRIDE(i, n) {
        float x = inp[i];
        float derivative = hr_gelu_derivative(x, hr_tanh_f32(hr_gelu_inner(x)));
        dinp[i] = __fadd_rn(dinp[i], __fmul_rn(derivative, dout[i]));
    }
}

// GeGLU's gate (Gemma's MLP): out = gelu(gate)·up, the forward's GELU operation for operation.
extern "C" __global__ void geglu_forward_f32(float* __restrict__ out,
                                             const float* __restrict__ gate,
                                             const float* __restrict__ up, hr_u64 n) {
    HR_GRID_STRIDE(i, n) {
        float x = gate[i];
        out[i] = __fmul_rn(hr_gelu_from_tanh(x, hr_tanh_f32(hr_gelu_inner(x))), up[i]);
    }
}

// dgate += gelu'(gate)·up·dout, dup += gelu(gate)·dout (accumulate, like the CPU op).
extern "C" __global__ void geglu_backward_f32(float* __restrict__ dgate,
                                              float* __restrict__ dup,
                                              const float* __restrict__ gate,
                                              const float* __restrict__ up,
                                              const float* __restrict__ dout, hr_u64 n) {
    HR_GRID_STRIDE(i, n) {
        float x = gate[i];
        float d = dout[i];
        float t = hr_tanh_f32(hr_gelu_inner(x));
        float derivative = hr_gelu_derivative(x, t);
        dgate[i] = __fadd_rn(dgate[i], __fmul_rn(__fmul_rn(derivative, up[i]), d));
        dup[i] = __fadd_rn(dup[i], __fmul_rn(hr_gelu_from_tanh(x, t), d));
    }
}

// y += x: the residual connection (forward), and equally a gradient accumulation (backward).
extern "C" __global__ void residual_add_f32(float* __restrict__ y, const float* __restrict__ x,
                                            hr_u64 n) {
    HR_GRID_STRIDE(i, n) { y[i] = __fadd_rn(y[i], x[i]); }
}
