// Bit-exact float conversions shared by every headroom kernel.
//
// NVRTC in CI ships without the toolkit headers, so nothing here includes <cuda_fp16.h>; the
// conversions are written on bits instead. They agree bit for bit with the `half` crate's
// software routines and with headroom_tensor::cpu::kernels (round-to-nearest-even, NaN stays
// NaN with its sign and top payload bits, quiet bit set). The hardware cvt instructions round
// the same way but canonicalise NaN payloads, which would break bitwise equality with the CPU.
//
// This file is prepended to every kernel source by headroom-kernels (it is not a header NVRTC
// looks up), so it must hold only inline device functions and macros, never a kernel.

typedef unsigned short hr_u16;
typedef unsigned int hr_u32;
typedef unsigned long long hr_u64;

// Threads per block of every elementwise kernel and of the sum-of-squares kernels. The Rust side
// reads the same constant from headroom_kernels::BLOCK_THREADS.
#define HR_BLOCK_THREADS 256

// f32 -> bf16 bits, round to nearest even; NaN keeps sign and top payload, quiet bit set.
// Same formula as headroom_tensor::cpu::kernels::f32_to_bf16_bits (u32 arithmetic wraps only
// for NaN inputs, whose result is taken from the other branch).
__device__ __forceinline__ hr_u16 hr_f32_to_bf16_bits(float value) {
    hr_u32 b = __float_as_uint(value);
    hr_u32 rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    hr_u32 quiet_nan = (b >> 16) | 0x0040u;
    return (hr_u16)(((b & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded);
}

// bf16 bits -> f32, exact. Like the CPU backend (and unlike half::bf16::to_f32) a signalling
// NaN is widened as is, without setting the quiet bit: a widening is a move of bits.
__device__ __forceinline__ float hr_bf16_bits_to_f32(hr_u16 bits) {
    return __uint_as_float(((hr_u32)bits) << 16);
}

// f32 -> f16 bits, round to nearest even. A port of half's f32_to_f16_fallback.
__device__ __forceinline__ hr_u16 hr_f32_to_f16_bits(float value) {
    hr_u32 x = __float_as_uint(value);
    hr_u32 sign = x & 0x80000000u;
    hr_u32 exp = x & 0x7f800000u;
    hr_u32 man = x & 0x007fffffu;

    if (exp == 0x7f800000u) {
        // Infinity keeps a zero mantissa; NaN gets the quiet bit plus its top payload bits.
        hr_u32 nan_bit = (man == 0u) ? 0u : 0x0200u;
        return (hr_u16)((sign >> 16) | 0x7c00u | nan_bit | (man >> 13));
    }

    hr_u32 half_sign = sign >> 16;
    int half_exp = (int)(exp >> 23) - 127 + 15;

    if (half_exp >= 0x1f) {
        return (hr_u16)(half_sign | 0x7c00u);  // overflow to infinity
    }

    if (half_exp <= 0) {
        if (14 - half_exp > 24) {
            return (hr_u16)half_sign;  // below half the smallest subnormal: signed zero
        }
        man |= 0x00800000u;  // the hidden bit becomes explicit in a subnormal
        hr_u32 half_man = man >> (14 - half_exp);
        hr_u32 round_bit = 1u << (13 - half_exp);
        // Round up when the round bit is set and either a sticky bit or the result's lsb is.
        if ((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u) {
            half_man += 1u;
        }
        return (hr_u16)(half_sign | half_man);
    }

    hr_u32 half_bits = half_sign | (((hr_u32)half_exp) << 10) | (man >> 13);
    hr_u32 round_bit = 0x00001000u;
    if ((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u) {
        half_bits += 1u;  // a carry into the exponent correctly rounds up to the next binade
    }
    return (hr_u16)half_bits;
}

// f16 bits -> f32, exact for numbers; NaN gets the quiet bit (as half and F16C do).
__device__ __forceinline__ float hr_f16_bits_to_f32(hr_u16 bits) {
    hr_u32 i = bits;
    if ((i & 0x7fffu) == 0u) {
        return __uint_as_float(i << 16);  // signed zero
    }
    hr_u32 half_sign = i & 0x8000u;
    hr_u32 half_exp = i & 0x7c00u;
    hr_u32 half_man = i & 0x03ffu;

    if (half_exp == 0x7c00u) {
        if (half_man == 0u) {
            return __uint_as_float((half_sign << 16) | 0x7f800000u);
        }
        return __uint_as_float((half_sign << 16) | 0x7fc00000u | (half_man << 13));
    }

    hr_u32 sign = half_sign << 16;
    if (half_exp == 0u) {
        // Subnormal: normalise by the number of leading zeros of the 10-bit mantissa.
        int e = (__clz(half_man) - 16) - 6;
        hr_u32 exp = ((hr_u32)(127 - 15 - e)) << 23;
        hr_u32 man = (half_man << (14 + e)) & 0x007fffffu;
        return __uint_as_float(sign | exp | man);
    }
    int unbiased_exp = (int)(half_exp >> 10) - 15;
    hr_u32 exp = ((hr_u32)(unbiased_exp + 127)) << 23;
    return __uint_as_float(sign | exp | (half_man << 13));
}

// Loads and stores of each storage type through f32. f16 and bf16 travel as raw u16 bits.
__device__ __forceinline__ float hr_load_f32(const float* p, hr_u64 i) { return p[i]; }
__device__ __forceinline__ float hr_load_f16(const hr_u16* p, hr_u64 i) {
    return hr_f16_bits_to_f32(p[i]);
}
__device__ __forceinline__ float hr_load_bf16(const hr_u16* p, hr_u64 i) {
    return hr_bf16_bits_to_f32(p[i]);
}
__device__ __forceinline__ void hr_store_f32(float* p, hr_u64 i, float v) { p[i] = v; }
__device__ __forceinline__ void hr_store_f16(hr_u16* p, hr_u64 i, float v) {
    p[i] = hr_f32_to_f16_bits(v);
}
__device__ __forceinline__ void hr_store_bf16(hr_u16* p, hr_u64 i, float v) {
    p[i] = hr_f32_to_bf16_bits(v);
}

// Non-finite test on the stored bits (all exponent bits set), so it never depends on how the
// compiler treats NaN comparisons.
__device__ __forceinline__ bool hr_non_finite_f32(const float* p, hr_u64 i) {
    return (__float_as_uint(p[i]) & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool hr_non_finite_f16(const hr_u16* p, hr_u64 i) {
    return (p[i] & 0x7c00u) == 0x7c00u;
}
__device__ __forceinline__ bool hr_non_finite_bf16(const hr_u16* p, hr_u64 i) {
    return (p[i] & 0x7f80u) == 0x7f80u;
}

// Grid-stride loop over [0, n): correct for any n (including 0) and any grid size.
#define HR_GRID_STRIDE(i, n)                                                            \
    for (hr_u64 i = (hr_u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);            \
         i += (hr_u64)blockDim.x * gridDim.x)
