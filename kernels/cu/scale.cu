// x *= alpha, computed in f32 (round-to-nearest multiply) and rounded back to the storage type.

#define HR_SCALE_KERNEL(NAME, T, TY)                                                    \
    extern "C" __global__ void NAME(TY* __restrict__ x, float alpha, hr_u64 n) {        \
        HR_GRID_STRIDE(i, n) { hr_store_##T(x, i, __fmul_rn(hr_load_##T(x, i), alpha)); } \
    }

HR_SCALE_KERNEL(scale_f32, f32, float)
HR_SCALE_KERNEL(scale_f16, f16, hr_u16)
HR_SCALE_KERNEL(scale_bf16, bf16, hr_u16)
