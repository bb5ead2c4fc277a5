// Fixed-order block reductions in f32 for the trainer-op kernels (prepended after
// float_bits.cuh by headroom-kernels; inline device functions only, never a kernel).
//
// Every reduction is a fixed binary tree over HR_BLOCK_THREADS lanes, so a block's result
// depends only on its inputs, never on scheduling: the same input gives the same bits on any
// GPU. Requires blockDim.x == HR_BLOCK_THREADS (a power of two).

// Sum of one value per thread; every thread gets the total. The trailing barrier lets the
// caller reduce again at once (the next call overwrites the lanes thread 0 just read).
__device__ __forceinline__ float hr_block_sum_f32(float v) {
    __shared__ float lanes[HR_BLOCK_THREADS];
    lanes[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int half = HR_BLOCK_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            lanes[threadIdx.x] = __fadd_rn(lanes[threadIdx.x], lanes[threadIdx.x + half]);
        }
        __syncthreads();
    }
    float total = lanes[0];
    __syncthreads();
    return total;
}

// Maximum of one value per thread (NaN-propagating, unlike fmaxf); every thread gets it.
__device__ __forceinline__ float hr_block_max_f32(float v) {
    __shared__ float lanes[HR_BLOCK_THREADS];
    lanes[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int half = HR_BLOCK_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            float a = lanes[threadIdx.x];
            float b = lanes[threadIdx.x + half];
            lanes[threadIdx.x] = (a != a || a > b) ? a : b;
        }
        __syncthreads();
    }
    float total = lanes[0];
    __syncthreads();
    return total;
}

// e^x in f32, a bit-exact port of headroom-trainer's ops::fast_math::exp (Cephes expf's
// range reduction and polynomial). Every operation is an explicitly rounded intrinsic and the
// modules are compiled with --fmad=false, so the result equals the CPU's bit for bit.
__device__ __forceinline__ float hr_exp_f32(float x) {
    // Rust's clamp: NaN passes through unchanged.
    x = (x < -87.3f) ? -87.3f : ((x > 88.7f) ? 88.7f : x);
    const float log2e = 1.44269504088896340736f;
    const float ln2_hi = 0.6933594f;
    const float ln2_lo = -2.1219444e-4f;
    const float round = 12582912.0f;
    float n = __fsub_rn(__fadd_rn(__fmul_rn(x, log2e), round), round);
    float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, ln2_hi)), __fmul_rn(n, ln2_lo));
    float p = 1.9875691e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    float y = __fadd_rn(__fadd_rn(__fmul_rn(__fmul_rn(p, r), r), r), 1.0f);
    // Rust's `n as i32` saturates and maps NaN to 0; C's cast is undefined there, so mirror it.
    int ni = (n != n) ? 0 : (n >= 2147483647.0f ? 2147483647 : (n <= -2147483648.0f ? (-2147483647 - 1) : (int)n));
    float scale = __uint_as_float(((hr_u32)(ni + 127)) << 23);
    return __fmul_rn(y, scale);
}

// tanh in f32, a bit-exact port of headroom-trainer's ops::fast_math::tanh.
__device__ __forceinline__ float hr_tanh_f32(float x) {
    float a = fabsf(x);
    a = (a != a) ? 9.0f : ((a < 9.0f) ? a : 9.0f);  // Rust's f32::min: NaN yields the other
    float e = hr_exp_f32(__fmul_rn(2.0f, a));
    float t = __fsub_rn(1.0f, __fdiv_rn(2.0f, __fadd_rn(e, 1.0f)));
    float a2 = __fmul_rn(a, a);
    float c9 = __fdiv_rn(62.0f, 2835.0f);
    float c7 = __fdiv_rn(-17.0f, 315.0f);
    float c5 = __fdiv_rn(2.0f, 15.0f);
    float c3 = __fdiv_rn(-1.0f, 3.0f);
    float s = __fadd_rn(c7, __fmul_rn(a2, c9));
    s = __fadd_rn(c5, __fmul_rn(a2, s));
    s = __fadd_rn(c3, __fmul_rn(a2, s));
    s = __fadd_rn(1.0f, __fmul_rn(a2, s));
    float small = __fmul_rn(a, s);
    t = (a < 0.3f) ? small : t;
    t = (a >= 9.0f) ? 1.0f : t;
    return copysignf(t, x);
}
