// Rotary position embedding in place, Hugging Face's rotate-half layout (Llama's), f32.
//
// x is [rows = B·H·T, hs] with position `row % t`; dimension i pairs with i + hs/2. The cos and
// sin tables [t, hs/2] are computed on the host by headroom-trainer's ops::rope::tables and
// uploaded, so the angles are the CPU's bits; the rotation is ops::rope::apply operation for
// operation (no contraction: --fmad=false and explicit intrinsics), so results are bitwise the
// CPU's. `inverse` rotates by the negative angle (the backward of the forward rotation).
// Launch: grid-stride over rows·(hs/2) pairs, any grid.

extern "C" __global__ void rope_f32(float* __restrict__ x, const float* __restrict__ cos_t,
                                    const float* __restrict__ sin_t, hr_u64 rows, hr_u32 t,
                                    hr_u32 half, hr_u32 inverse) {
    hr_u64 n = rows * (hr_u64)half;
    HR_GRID_STRIDE(k, n) {
        hr_u64 row = k / half;
        hr_u64 i = k % half;
        hr_u64 pos = row % t;
        float c = cos_t[pos * half + i];
        float s = sin_t[pos * half + i];
        float si = inverse ? -s : s;
        float* a = x + row * 2 * (hr_u64)half;
        float x1 = a[i];
        float x2 = a[i + half];
        a[i] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, si));
        a[i + half] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, si));
    }
}
