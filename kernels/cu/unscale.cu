// x *= inv_scale, and raise a device flag if any INPUT element was infinite or NaN.
//
// The flag is an int in device memory that the host zeroes once and reads once, so any number
// of tensors can be unscaled with a single readback (PyTorch's
// _amp_foreach_non_finite_check_and_unscale_). Threads only ever store 1, so the unordered
// stores race harmlessly. The test looks at the stored bits, before the multiply.

#define HR_UNSCALE_KERNEL(NAME, T, TY)                                                  \
    extern "C" __global__ void NAME(TY* __restrict__ x, float inv_scale, hr_u64 n,      \
                                    int* __restrict__ found) {                          \
        bool bad = false;                                                               \
        HR_GRID_STRIDE(i, n) {                                                          \
            bad |= hr_non_finite_##T(x, i);                                             \
            hr_store_##T(x, i, __fmul_rn(hr_load_##T(x, i), inv_scale));                \
        }                                                                               \
        if (bad) {                                                                      \
            *found = 1;                                                                 \
        }                                                                               \
    }

HR_UNSCALE_KERNEL(unscale_check_f32, f32, float)
HR_UNSCALE_KERNEL(unscale_check_f16, f16, hr_u16)
HR_UNSCALE_KERNEL(unscale_check_bf16, bf16, hr_u16)
