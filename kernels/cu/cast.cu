// Casts between f32, f16 and bf16: widen to f32 exactly, then round to nearest even.
// Bit-identical to headroom_tensor::cpu::kernels::cast, NaN payloads included.

#define HR_CAST_KERNEL(NAME, SRC_T, SRC, DST_T, DST)                                    \
    extern "C" __global__ void NAME(const SRC_T* __restrict__ src,                      \
                                    DST_T* __restrict__ dst, hr_u64 n) {                \
        HR_GRID_STRIDE(i, n) { hr_store_##DST(dst, i, hr_load_##SRC(src, i)); }         \
    }

HR_CAST_KERNEL(cast_f32_f16, float, f32, hr_u16, f16)
HR_CAST_KERNEL(cast_f32_bf16, float, f32, hr_u16, bf16)
HR_CAST_KERNEL(cast_f16_f32, hr_u16, f16, float, f32)
HR_CAST_KERNEL(cast_bf16_f32, hr_u16, bf16, float, f32)
HR_CAST_KERNEL(cast_f16_bf16, hr_u16, f16, hr_u16, bf16)
HR_CAST_KERNEL(cast_bf16_f16, hr_u16, bf16, hr_u16, f16)
