// Round f32 values in place to bf16 or f16 and back (what storing them would cost): the bits
// of headroom-trainer's round_to (round to nearest even, NaN stays NaN), via the prelude's
// bit-exact conversions. Launch: grid-stride, any grid.

extern "C" __global__ void round_bf16_f32(float* __restrict__ x, hr_u64 n) {
    HR_GRID_STRIDE(i, n) { x[i] = hr_bf16_bits_to_f32(hr_f32_to_bf16_bits(x[i])); }
}

extern "C" __global__ void round_f16_f32(float* __restrict__ x, hr_u64 n) {
    HR_GRID_STRIDE(i, n) { x[i] = hr_f16_bits_to_f32(hr_f32_to_f16_bits(x[i])); }
}
