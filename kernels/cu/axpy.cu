// y += alpha * x with x in f32/f16/bf16 and y in f32.
//
// __fmul_rn/__fadd_rn are never contracted into an FMA, so the product is rounded to f32 before
// the sum exactly as on the CPU (Rust never contracts), and results are bitwise equal.

#define HR_AXPY_KERNEL(NAME, T, TY)                                                     \
    extern "C" __global__ void NAME(float alpha, const TY* __restrict__ x,              \
                                    float* __restrict__ y, hr_u64 n) {                  \
        HR_GRID_STRIDE(i, n) { y[i] = __fadd_rn(y[i], __fmul_rn(alpha, hr_load_##T(x, i))); } \
    }

HR_AXPY_KERNEL(axpy_f32, f32, float)
HR_AXPY_KERNEL(axpy_f16, f16, hr_u16)
HR_AXPY_KERNEL(axpy_bf16, bf16, hr_u16)
