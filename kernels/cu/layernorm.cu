// Layer normalisation over the last dimension, llm.c style, f32: forward saves each row's mean
// and reciprocal standard deviation; backward accumulates dinp, dweight and dbias.
//
// Same formulas as headroom-trainer's ops::layernorm (two-pass variance, eps = 1e-5,
// rstd = 1 / sqrt(var + eps) correctly rounded), but row sums are fixed-order block trees
// instead of a sequential loop, so results agree with the CPU to rounding (not bitwise), and
// are identical from run to run on any GPU.
//
// dweight/dbias are column sums over rows. Without atomics: layernorm_backward_param_partials
// writes one partial per fixed chunk of rows (rows_per_chunk is chosen by the host from the
// shape only, never from the device), then column_sum_finish_f32 (column_sum.cu) adds
// the partials in chunk order into dweight and dbias.

#define HR_LAYERNORM_EPS 1e-5f

// Launch: grid (rows), block HR_BLOCK_THREADS.
extern "C" __global__ void layernorm_forward_f32(float* __restrict__ out,
                                                 float* __restrict__ mean,
                                                 float* __restrict__ rstd,
                                                 const float* __restrict__ inp,
                                                 const float* __restrict__ weight,
                                                 const float* __restrict__ bias, hr_u64 rows,
                                                 hr_u32 c) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* x = inp + row * c;
        float* o = out + row * c;
        float s = 0.0f;
        for (hr_u32 i = threadIdx.x; i < c; i += blockDim.x) {
            s = __fadd_rn(s, x[i]);
        }
        float mu = __fdiv_rn(hr_block_sum_f32(s), (float)c);
        float v = 0.0f;
        for (hr_u32 i = threadIdx.x; i < c; i += blockDim.x) {
            float d = __fsub_rn(x[i], mu);
            v = __fadd_rn(v, __fmul_rn(d, d));
        }
        float var = __fdiv_rn(hr_block_sum_f32(v), (float)c);
        float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, HR_LAYERNORM_EPS)));
        for (hr_u32 i = threadIdx.x; i < c; i += blockDim.x) {
            // (x - mu) * s * weight + bias, in the CPU's order
            float norm = __fmul_rn(__fsub_rn(x[i], mu), r);
            o[i] = __fadd_rn(__fmul_rn(norm, weight[i]), bias[i]);
        }
        if (threadIdx.x == 0) {
            mean[row] = mu;
            rstd[row] = r;
        }
    }
}

// dinp += (dnorm - mean(dnorm) - norm·mean(dnorm·norm))·rstd, dnorm = weight·dout.
// Launch: grid (rows), block HR_BLOCK_THREADS.
extern "C" __global__ void layernorm_backward_input_f32(float* __restrict__ dinp,
                                                        const float* __restrict__ dout,
                                                        const float* __restrict__ inp,
                                                        const float* __restrict__ weight,
                                                        const float* __restrict__ mean,
                                                        const float* __restrict__ rstd,
                                                        hr_u64 rows, hr_u32 c) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* x = inp + row * c;
        const float* d = dout + row * c;
        float* di = dinp + row * c;
        float mu = mean[row];
        float r = rstd[row];
        float a = 0.0f;
        float b = 0.0f;
        for (hr_u32 i = threadIdx.x; i < c; i += blockDim.x) {
            float norm = __fmul_rn(__fsub_rn(x[i], mu), r);
            float dnorm = __fmul_rn(weight[i], d[i]);
            a = __fadd_rn(a, dnorm);
            b = __fadd_rn(b, __fmul_rn(dnorm, norm));
        }
        float dnorm_mean = __fdiv_rn(hr_block_sum_f32(a), (float)c);
        float dnorm_norm_mean = __fdiv_rn(hr_block_sum_f32(b), (float)c);
        for (hr_u32 i = threadIdx.x; i < c; i += blockDim.x) {
            float norm = __fmul_rn(__fsub_rn(x[i], mu), r);
            float dnorm = __fmul_rn(weight[i], d[i]);
            float g = __fsub_rn(__fsub_rn(dnorm, dnorm_mean), __fmul_rn(norm, dnorm_norm_mean));
            di[i] = __fadd_rn(di[i], __fmul_rn(g, r));
        }
    }
}

// Per-chunk column sums of norm·dout (into partials_w) and dout (into partials_b), both
// [chunks, c]. Launch: grid (chunks, ceil(c / HR_BLOCK_THREADS)), block HR_BLOCK_THREADS,
// chunks = ceil(rows / rows_per_chunk).
extern "C" __global__ void layernorm_backward_param_partials_f32(
    float* __restrict__ partials_w, float* __restrict__ partials_b,
    const float* __restrict__ dout, const float* __restrict__ inp,
    const float* __restrict__ mean, const float* __restrict__ rstd, hr_u64 rows, hr_u32 c,
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
    float b = 0.0f;
    for (hr_u64 row = first; row < last; ++row) {
        float d = dout[row * c + j];
        float norm = __fmul_rn(__fsub_rn(inp[row * c + j], mean[row]), rstd[row]);
        w = __fadd_rn(w, __fmul_rn(norm, d));
        b = __fadd_rn(b, d);
    }
    partials_w[(hr_u64)blockIdx.x * c + j] = w;
    partials_b[(hr_u64)blockIdx.x * c + j] = b;
}
