// f32 -> bf16 with stochastic rounding, bit for bit headroom-amp's stochastic_rounding.rs:
// add 16 random bits to the low half of the f32 and truncate; NaN stays NaN (quieted, sign
// kept). The random bits of element i are a hash of (seed, step, tensor, i): SplitMix64's
// finaliser derives two 32-bit stream keys per high index word (i >> 32), then two rounds of
// lowbias32 mix the low word. Integer arithmetic only, so the result is bitwise identical to
// the CPU's on any GPU and any grid.
// Launch: grid-stride, any grid.

__device__ __forceinline__ hr_u64 hr_mix64(hr_u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ hr_u32 hr_lowbias32(hr_u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

// The stream keys of the elements whose index has high word index_hi (amp's stream_keys).
__device__ __forceinline__ void hr_sr_stream_keys(hr_u64 seed, hr_u64 step, hr_u32 tensor,
                                                  hr_u32 index_hi, hr_u32* k1, hr_u32* k2) {
    const hr_u64 golden = 0x9e3779b97f4a7c15ull;
    hr_u64 h = hr_mix64(seed + golden);
    h = hr_mix64(h ^ (step * golden));
    h = hr_mix64(h ^ ((((hr_u64)tensor) << 32) | (hr_u64)index_hi));
    *k1 = (hr_u32)(h >> 32);
    *k2 = (hr_u32)h;
}

extern "C" __global__ void stochastic_round_f32_bf16(const float* __restrict__ src,
                                                     hr_u16* __restrict__ dst, hr_u64 n,
                                                     hr_u64 seed, hr_u64 step, hr_u32 tensor) {
    // Keys change only when the index crosses a multiple of 2^32: cache them per thread.
    hr_u32 cached_hi = 0;
    hr_u32 k1 = 0;
    hr_u32 k2 = 0;
    bool have_keys = false;
    HR_GRID_STRIDE(i, n) {
        hr_u32 hi = (hr_u32)(i >> 32);
        if (!have_keys || hi != cached_hi) {
            hr_sr_stream_keys(seed, step, tensor, hi, &k1, &k2);
            cached_hi = hi;
            have_keys = true;
        }
        hr_u32 random = hr_lowbias32(hr_lowbias32(((hr_u32)i) ^ k1) + k2) >> 16;
        hr_u32 b = __float_as_uint(src[i]);
        bool is_nan = (b & 0x7fffffffu) > 0x7f800000u;
        hr_u32 rounded = (b + (random & 0xffffu)) >> 16;
        hr_u32 quiet_nan = (b >> 16) | 0x0040u;
        dst[i] = (hr_u16)(is_nan ? quiet_nan : rounded);
    }
}
