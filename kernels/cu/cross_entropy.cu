// Softmax cross-entropy over a vocabulary row, fused with its gradient, f32, one block per row:
// loss[row] = log Σ exp(logits - max) + max - logits[target], and
// dlogits[row] = (softmax(row) - onehot(target)) · dloss[row], overwriting dlogits. The
// probabilities are never stored. dlogits may be the logits themselves (the in-place entry,
// as headroom-trainer's ops::cross_entropy::forward_backward_in_place): each thread then reads
// and overwrites only its own elements, and the one element read across threads, the target's
// logit, is read before the block reductions, whose barriers order it before any write.
//
// exp is the trainer's fast_math port (bitwise), but the row max/sum are fixed-order block
// trees and log is CUDA's logf (within 1 ulp), so losses and gradients agree with the CPU to
// rounding, not bitwise; they are identical from run to run on any GPU.
// A target >= v is never dereferenced: its loss and gradient row are NaN.

// logits and dlogits are not __restrict__: they alias in the in-place entry.
__device__ __forceinline__ void hr_cross_entropy_row(float* __restrict__ losses,
                                                     float* dlogits,
                                                     const float* logits,
                                                     const hr_u32* __restrict__ targets,
                                                     const float* __restrict__ dloss,
                                                     hr_u64 row, hr_u32 v, bool grad) {
    const float* x = logits + row * v;
    hr_u32 target = targets[row];
    bool valid = target < v;
    float target_logit = (threadIdx.x == 0 && valid) ? x[target] : 0.0f;
    float m = __uint_as_float(0xff800000u);  // -inf
    for (hr_u32 j = threadIdx.x; j < v; j += blockDim.x) {
        float xj = x[j];
        m = (xj != xj || xj > m) ? xj : m;
    }
    float max = hr_block_max_f32(m);
    float s = 0.0f;
    for (hr_u32 j = threadIdx.x; j < v; j += blockDim.x) {
        s = __fadd_rn(s, hr_exp_f32(__fsub_rn(x[j], max)));
    }
    float sum = hr_block_sum_f32(s);
    const float nan = __uint_as_float(0x7fc00000u);
    if (threadIdx.x == 0) {
        losses[row] = valid ? __fsub_rn(__fadd_rn(logf(sum), max), target_logit) : nan;
    }
    if (grad) {
        float dl = dloss[row];
        float scale = __fdiv_rn(dl, sum);
        float* d = dlogits + row * v;
        for (hr_u32 j = threadIdx.x; j < v; j += blockDim.x) {
            float g = __fmul_rn(hr_exp_f32(__fsub_rn(x[j], max)), scale);
            d[j] = !valid ? nan : ((j == target) ? __fsub_rn(g, dl) : g);
        }
    }
}

// Losses only. Launch: grid (rows) or fewer (blocks stride over rows), block HR_BLOCK_THREADS.
extern "C" __global__ void cross_entropy_forward_f32(float* __restrict__ losses,
                                                     const float* __restrict__ logits,
                                                     const hr_u32* __restrict__ targets,
                                                     hr_u64 rows, hr_u32 v) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        hr_cross_entropy_row(losses, (float*)0, logits, targets, (const float*)0, row, v,
                             false);
    }
}

// Losses and dlogits in one pass. Launch: as cross_entropy_forward_f32.
extern "C" __global__ void cross_entropy_forward_backward_f32(
    float* __restrict__ losses, float* __restrict__ dlogits, const float* __restrict__ logits,
    const hr_u32* __restrict__ targets, const float* __restrict__ dloss, hr_u64 rows,
    hr_u32 v) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        hr_cross_entropy_row(losses, dlogits, logits, targets, dloss, row, v, true);
    }
}

// Losses, and each logits row overwritten by its gradient. Launch: as
// cross_entropy_forward_f32.
extern "C" __global__ void cross_entropy_forward_backward_in_place_f32(
    float* __restrict__ losses, float* logits, const hr_u32* __restrict__ targets,
    const float* __restrict__ dloss, hr_u64 rows, hr_u32 v) {
    for (hr_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        hr_cross_entropy_row(losses, logits, logits, targets, dloss, row, v, true);
    }
}
