// Softmax cross-entropy over a vocabulary row, fused with its gradient, one block per row:
// loss[row] = log Σ exp(logits - max) + max - logits[target], and
// dlogits[row] = (softmax(row) - onehot(target)) · dloss[row], overwriting dlogits. The
// probabilities are never stored. dlogits may be the logits themselves (the in-place entries,
// as headroom-trainer's ops::cross_entropy::forward_backward_in_place): each thread then reads
// and overwrites only its own elements, and the one element read across threads, the target's
// logit, is read before the block reductions, whose barriers order it before any write.
//
// Logits are f32, or bf16 (the `_bf16` entries: a bf16 run's logits, which the head rounds to
// bf16 anyway, stored at half the bytes). The arithmetic is f32 either way; a bf16 gradient is
// the f32 gradient rounded to nearest even, so these entries give the f32 entries' losses and
// the bf16 bits of their gradients, bit for bit, on bf16-valued logits.
//
// exp is the trainer's fast_math port (bitwise), but the row max/sum are fixed-order block
// trees and log is CUDA's logf (within 1 ulp), so losses and gradients agree with the CPU to
// rounding, not bitwise; they are identical from run to run on any GPU.
// A target >= v is never dereferenced: its loss and gradient row are NaN.

__device__ __forceinline__ float hr_ce_load(const float* x, hr_u64 i) { return x[i]; }
__device__ __forceinline__ float hr_ce_load(const hr_u16* x, hr_u64 i) {
    return hr_bf16_bits_to_f32(x[i]);
}
__device__ __forceinline__ void hr_ce_store(float* x, hr_u64 i, float value) { x[i] = value; }
__device__ __forceinline__ void hr_ce_store(hr_u16* x, hr_u64 i, float value) {
    x[i] = hr_f32_to_bf16_bits(value);
}

// logits and dlogits are not __restrict__: they alias in the in-place entries.
template <typename T>
__device__ __forceinline__ void hr_cross_entropy_row(float* __restrict__ losses, T* dlogits,
                                                     const T* logits,
                                                     const hr_u32* __restrict__ targets,
                                                     const float* __restrict__ dloss,
                                                     hr_u64 row, hr_u32 v, bool grad) {
    const T* x = logits + row * v;
    hr_u32 target = targets[row];
    bool valid = target < v;
    float target_logit = (threadIdx.x == 0 && valid) ? hr_ce_load(x, target) : 0.0f;
    float m = __uint_as_float(0xff800000u);  // -inf
    for (hr_u32 j = threadIdx.x; j < v; j += blockDim.x) {
        float xj = hr_ce_load(x, j);
        m = (xj != xj || xj > m) ? xj : m;
    }
    float max = hr_block_max_f32(m);
    float s = 0.0f;
    for (hr_u32 j = threadIdx.x; j < v; j += blockDim.x) {
        s = __fadd_rn(s, hr_exp_f32(__fsub_rn(hr_ce_load(x, j), max)));
    }
    float sum = hr_block_sum_f32(s);
    const float nan = __uint_as_float(0x7fc00000u);
    if (threadIdx.x == 0) {
        losses[row] = valid ? __fsub_rn(__fadd_rn(logf(sum), max), target_logit) : nan;
    }
    if (grad) {
        float dl = dloss[row];
        float scale = __fdiv_rn(dl, sum);
        T* d = dlogits + row * v;
        for (hr_u32 j = threadIdx.x; j < v; j += blockDim.x) {
            float g = __fmul_rn(hr_exp_f32(__fsub_rn(hr_ce_load(x, j), max)), scale);
            hr_ce_store(d, j, !valid ? nan : ((j == target) ? __fsub_rn(g, dl) : g));
        }
    }
}

// Losses only. Launch: grid (rows) or fewer (blocks stride over rows), block HR_BLOCK_THREADS.
extern "C" __global__ void cross_entropy_forward_f32(float* __restrict__ losses,
                                                     const float* __restrict__ logits,
                                                     const hr_u32* __restrict__ targets,
                                                     hr_u64 rows, hr_u32 v) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        hr_cross_entropy_row<float>(losses, (float*)0, logits, targets, (const float*)0, row,
                                    v, false);
    }
}

// Losses and dlogits in one pass. Launch: as cross_entropy_forward_f32.
extern "C" __global__ void cross_entropy_forward_backward_f32(
    float* __restrict__ losses, float* __restrict__ dlogits, const float* __restrict__ logits,
    const hr_u32* __restrict__ targets, const float* __restrict__ dloss, hr_u64 rows,
    hr_u32 v) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        hr_cross_entropy_row<float>(losses, dlogits, logits, targets, dloss, row, v, true);
    }
}

// Losses, and each logits row overwritten by its gradient. Launch: as
// cross_entropy_forward_f32.
extern "C" __global__ void cross_entropy_forward_backward_in_place_f32(
    float* __restrict__ losses, float* logits, const hr_u32* __restrict__ targets,
    const float* __restrict__ dloss, hr_u64 rows, hr_u32 v) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        hr_cross_entropy_row<float>(losses, logits, logits, targets, dloss, row, v, true);
    }
}

// cross_entropy_forward_f32 on bf16 logits. Launch: as cross_entropy_forward_f32.
extern "C" __global__ void cross_entropy_forward_bf16(float* __restrict__ losses,
                                                      const hr_u16* __restrict__ logits,
                                                      const hr_u32* __restrict__ targets,
                                                      hr_u64 rows, hr_u32 v) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        hr_cross_entropy_row<hr_u16>(losses, (hr_u16*)0, logits, targets, (const float*)0,
                                     row, v, false);
    }
}

// cross_entropy_forward_backward_in_place_f32 on bf16 logits, overwritten by their gradient
// in bf16. Launch: as cross_entropy_forward_f32.
extern "C" __global__ void cross_entropy_forward_backward_in_place_bf16(
    float* __restrict__ losses, hr_u16* logits, const hr_u32* __restrict__ targets,
    const float* __restrict__ dloss, hr_u64 rows, hr_u32 v) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        hr_cross_entropy_row<hr_u16>(losses, logits, logits, targets, dloss, row, v, true);
    }
}
