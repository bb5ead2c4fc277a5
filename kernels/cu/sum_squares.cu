// Sum of squares in f64, deterministic.
//
// Pass 1 (sum_squares_partials_*) runs on a grid whose size the host fixes
// (headroom_kernels::SUM_SQUARES_BLOCKS blocks of HR_BLOCK_THREADS threads), never on one derived
// from the device: each thread sums its grid-stride elements in index order, each block reduces
// its threads with a fixed tree, and block b writes partials[b]. Pass 2 (sum_squares_finish, one
// block) reduces the partials the same way. No atomics, so the result depends only on the input,
// never on scheduling or on which GPU runs it.
//
// Squares of f32 values are exact in f64 (24-bit mantissas, 48-bit products); only the sums round.

// Fixed-order tree reduction of one value per thread; the block total is valid in thread 0.
// Requires blockDim.x == HR_BLOCK_THREADS (a power of two).
__device__ __forceinline__ double hr_block_sum(double v) {
    __shared__ double lanes[HR_BLOCK_THREADS];
    lanes[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int half = HR_BLOCK_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            lanes[threadIdx.x] = __dadd_rn(lanes[threadIdx.x], lanes[threadIdx.x + half]);
        }
        __syncthreads();
    }
    return lanes[0];
}

#define HR_SUM_SQUARES_KERNEL(NAME, T, TY)                                              \
    extern "C" __global__ void NAME(const TY* __restrict__ x, hr_u64 n,                 \
                                    double* __restrict__ partials) {                    \
        double acc = 0.0;                                                               \
        HR_GRID_STRIDE(i, n) {                                                          \
            double v = (double)hr_load_##T(x, i);                                       \
            acc = __dadd_rn(acc, __dmul_rn(v, v));                                      \
        }                                                                               \
        double total = hr_block_sum(acc);                                               \
        if (threadIdx.x == 0) {                                                         \
            partials[blockIdx.x] = total;                                               \
        }                                                                               \
    }

HR_SUM_SQUARES_KERNEL(sum_squares_partials_f32, f32, float)
HR_SUM_SQUARES_KERNEL(sum_squares_partials_f16, f16, hr_u16)
HR_SUM_SQUARES_KERNEL(sum_squares_partials_bf16, bf16, hr_u16)

// Launch with exactly one block of HR_BLOCK_THREADS threads.
extern "C" __global__ void sum_squares_finish(const double* __restrict__ partials,
                                              unsigned int count, double* __restrict__ out) {
    double acc = 0.0;
    for (unsigned int i = threadIdx.x; i < count; i += blockDim.x) {
        acc = __dadd_rn(acc, partials[i]);
    }
    double total = hr_block_sum(acc);
    if (threadIdx.x == 0) {
        *out = total;
    }
}
