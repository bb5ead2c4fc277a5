// RMSNorm over the last dimension (Llama's), f32: forward saves each row's reciprocal root mean
// square; backward accumulates dinp and dweight.
//
// Same formulas as headroom-trainer's ops::rmsnorm: the mean square and the backward's dot
// product are summed in f64 (here a fixed-order block tree instead of the CPU's sequential
// loop, so the f64 sums can differ in their last bits and, rarely, the rounded f32 result by
// one ulp), every f32 step an explicitly rounded intrinsic in the CPU's order. Identical from
// run to run on any GPU.
//
// dweight is a column sum over rows without atomics: rmsnorm_backward_weight_partials_f32
// writes one partial per fixed chunk of rows (rows_per_chunk chosen by the host from the shape
// only), then column_sum_finish_f32 (column_sum.cu) adds the partials in chunk order.

// Sum of one f64 per thread, a fixed tree; every thread gets the total (trailing barrier as in
// hr_block_sum_f32).
__device__ __forceinline__ double hr_block_sum_f64(double v) {
    __shared__ double lanes[HR_BLOCK_THREADS];
    lanes[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int half = HR_BLOCK_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            lanes[threadIdx.x] = __dadd_rn(lanes[threadIdx.x], lanes[threadIdx.x + half]);
        }
        __syncthreads();
    }
    double total = lanes[0];
    __syncthreads();
    return total;
}

// out = weight·(x·rstd), rstd = 1/sqrt(mean(x²) + eps).
// Launch: grid (rows), block HR_BLOCK_THREADS.
extern "C" __global__ void rmsnorm_forward_f32(float* __restrict__ out,
                                               float* __restrict__ rstd,
                                               const float* __restrict__ inp,
                                               const float* __restrict__ weight, hr_u64 rows,
                                               hr_u32 c, float eps) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* x = inp + row * c;
        float* o = out + row * c;
        double s = 0.0;
        for (hr_u32 i = threadIdx.x; i < c; i += blockDim.x) {
            double v = (double)x[i];
            s = __dadd_rn(s, __dmul_rn(v, v));
        }
        float ms = (float)__ddiv_rn(hr_block_sum_f64(s), (double)c);
        float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
        for (hr_u32 i = threadIdx.x; i < c; i += blockDim.x) {
            o[i] = __fmul_rn(weight[i], __fmul_rn(x[i], r));
        }
        if (threadIdx.x == 0) {
            rstd[row] = r;
        }
    }
}

// dinp += (weight·dout − norm·mean(weight·dout·norm))·rstd, norm = x·rstd.
// Launch: grid (rows), block HR_BLOCK_THREADS.
extern "C" __global__ void rmsnorm_backward_input_f32(float* __restrict__ dinp,
                                                      const float* __restrict__ dout,
                                                      const float* __restrict__ inp,
                                                      const float* __restrict__ weight,
                                                      const float* __restrict__ rstd,
                                                      hr_u64 rows, hr_u32 c) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* x = inp + row * c;
        const float* d = dout + row * c;
        float* di = dinp + row * c;
        float r = rstd[row];
        double dot = 0.0;
        for (hr_u32 i = threadIdx.x; i < c; i += blockDim.x) {
            double wd = (double)__fmul_rn(weight[i], d[i]);
            dot = __dadd_rn(dot, __dmul_rn(wd, (double)__fmul_rn(x[i], r)));
        }
        float mean = (float)__ddiv_rn(hr_block_sum_f64(dot), (double)c);
        for (hr_u32 i = threadIdx.x; i < c; i += blockDim.x) {
            float norm = __fmul_rn(x[i], r);
            float g = __fsub_rn(__fmul_rn(weight[i], d[i]), __fmul_rn(norm, mean));
            di[i] = __fadd_rn(di[i], __fmul_rn(g, r));
        }
    }
}

// Per-chunk column sums of (x·rstd)·dout into partials [chunks, c].
// Launch: grid (chunks, ceil(c / HR_BLOCK_THREADS)), block HR_BLOCK_THREADS,
// chunks = ceil(rows / rows_per_chunk).
extern "C" __global__ void rmsnorm_backward_weight_partials_f32(
    float* __restrict__ partials, const float* __restrict__ dout,
    const float* __restrict__ inp, const float* __restrict__ rstd, hr_u64 rows, hr_u32 c,
    hr_u32 rows_per_chunk) {
    hr_u64 j = (hr_u64)blockIdx.y * HR_BLOCK_THREADS + threadIdx.x;
    if (j >= c) {
        return;
    }
    hr_u64 first = (hr_u64)blockIdx.x * rows_per_chunk;
    hr_u64 last = first + rows_per_chunk;
    if (last > rows) {
        last = rows;
    }
    float w = 0.0f;
    for (hr_u64 row = first; row < last; ++row) {
        float norm = __fmul_rn(inp[row * c + j], rstd[row]);
        w = __fadd_rn(w, __fmul_rn(norm, dout[row * c + j]));
    }
    partials[(hr_u64)blockIdx.x * c + j] = w;
}
