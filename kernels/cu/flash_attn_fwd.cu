// FlashAttention-2 forward on tensor cores: O = softmax(scale·Q·Kᵀ + mask)·V and the per-row
// logsumexp, for 16-bit inputs [batch, heads, seq, D] with f32 accumulation.
//
// Launch (headroom-attn's CUDA backend):
//   grid  = ceil(q_len / HR_FLASH_FWD_BLOCK_Q) · batch · q_heads blocks (one query tile of one
//           query head each; flattened into x so no grid dimension limit applies),
//   block = HR_FLASH_THREADS (4 warps, 16 query rows each),
//   dynamic shared memory = (HR_FLASH_FWD_BLOCK_Q + 2·HR_FLASH_FWD_BLOCK_K)·(D + 8)·2 bytes
//           (Q, K and V tiles; 27 KiB for D = 64, 51 KiB for D = 128, so the host raises the
//           function's dynamic shared memory limit before launching).
//
// Per block: the Q tile is copied to shared memory once and each warp keeps its 16×D slice in
// registers as mma A fragments. Key/value tiles stream through one K and one V buffer with
// cp.async: V_j is fetched while S = Q·K_jᵀ and its softmax are computed, K_{j+1} while P·V_j
// is. The softmax is online in the base-2 domain (scores pre-multiplied by scale·log2 e): a
// running row max m and unnormalised row sum l, the accumulator rescaled by exp2(m_old - m_new)
// when the max grows, and one division by l at the end. P goes from the S accumulators to the
// A operand of P·V in registers, rounded to the input type (as FlashAttention-2 does).
//
// Masking: key tiles past the causal limit of the whole query tile are never visited; the
// per-element mask (causal, bottom-right aligned, and sequence tails) runs only on tiles that
// straddle it. A row that sees no key keeps m = -inf; it is evaluated against 0 instead so no
// inf - inf appears, and it ends with l = 0: output 0 and logsumexp -inf, never NaN.
//
// Causal work grows with the query tile index, so blocks are issued heaviest tile first.

#define HR_FLASH_FWD_BLOCK_Q (HR_FLASH_WARPS * 16)
#ifndef HR_FLASH_FWD_BLOCK_K
#define HR_FLASH_FWD_BLOCK_K 64
#endif

template <typename E, int D>
__device__ __forceinline__ void hr_flash_fwd(const hr_u16* __restrict__ q,
                                             const hr_u16* __restrict__ k,
                                             const hr_u16* __restrict__ v, hr_u16* __restrict__ out,
                                             float* __restrict__ lse, unsigned int q_len_u,
                                             unsigned int kv_len_u, unsigned int q_heads,
                                             unsigned int kv_heads, float scale_log2,
                                             unsigned int causal_u) {
    constexpr int BR = HR_FLASH_FWD_BLOCK_Q;
    constexpr int BC = HR_FLASH_FWD_BLOCK_K;
    constexpr int STRIDE = D + HR_FLASH_SMEM_PAD;
    constexpr int KSTEPS = D / 16;   // k-steps of Q·Kᵀ
    constexpr int S_TILES = BC / 8;  // 16×8 score tiles per warp
    constexpr int O_TILES = D / 8;   // 16×8 output tiles per warp

    const long long q_len = q_len_u, kv_len = kv_len_u;
    const bool causal = causal_u != 0;
    const unsigned int q_tiles = (q_len_u + BR - 1) / BR;
    const unsigned int q_tile = q_tiles - 1 - blockIdx.x % q_tiles;  // heaviest first
    const unsigned int bh = blockIdx.x / q_tiles;                     // batch · q_heads + head
    const unsigned int group = q_heads / kv_heads;
    const hr_u64 kv_bh = (hr_u64)(bh / q_heads) * kv_heads + (bh % q_heads) / group;

    const hr_u16* qh = q + (hr_u64)bh * q_len_u * D;
    const hr_u16* kh = k + kv_bh * kv_len_u * D;
    const hr_u16* vh = v + kv_bh * kv_len_u * D;

    hr_u16* q_s = hr_flash_smem;
    hr_u16* k_s = q_s + BR * STRIDE;
    hr_u16* v_s = k_s + BC * STRIDE;

    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const long long q0 = (long long)q_tile * BR;
    // The two rows this thread accumulates: r = 0 → row g, r = 1 → row g + 8 of the warp's 16.
    const long long row_base = q0 + warp * 16 + g;

    const long long key_limit = hr_flash_key_limit(q0, BR, q_len, kv_len, causal);
    const int kv_tiles = (int)((key_limit + BC - 1) / BC);

    hr_flash_load_tile<BR, D>(q_s, qh, q0, q_len, q);
    if (kv_tiles > 0) hr_flash_load_tile<BC, D>(k_s, kh, 0, kv_len, k);
    hr_cp_async_commit();
    hr_cp_async_wait_all();
    __syncthreads();

    hr_u32 q_frag[KSTEPS][4];
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) hr_load_a<D>(q_frag[ks], q_s, warp * 16, ks * 16);

    float o[O_TILES][4];
#pragma unroll
    for (int i = 0; i < O_TILES; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float row_max[2] = {HR_NEG_INF, HR_NEG_INF};
    float row_sum[2] = {0.0f, 0.0f};  // this thread's share; the quad is summed at the end

    for (int j = 0; j < kv_tiles; ++j) {
        const long long k0 = (long long)j * BC;
        // K_j is resident (waited for and synchronised); fetch V_j behind the score matmul.
        hr_flash_load_tile<BC, D>(v_s, vh, k0, kv_len, v);
        hr_cp_async_commit();

        float s[S_TILES][4];
#pragma unroll
        for (int i = 0; i < S_TILES; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
            for (int n2 = 0; n2 < S_TILES / 2; ++n2) {
                hr_u32 b[4];
                hr_load_b_nk<D>(b, k_s, n2 * 16, ks * 16);
                E::mma(s[2 * n2], q_frag[ks], b[0], b[1]);
                E::mma(s[2 * n2 + 1], q_frag[ks], b[2], b[3]);
            }
        }

        const bool masked = hr_flash_tile_needs_mask(q0, BR, k0, BC, q_len, kv_len, causal);
        float tile_max[2] = {HR_NEG_INF, HR_NEG_INF};
#pragma unroll
        for (int i = 0; i < S_TILES; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[i][e] * scale_log2;
                if (masked) {
                    long long row = row_base + 8 * (e >> 1);
                    long long col = k0 + i * 8 + 2 * t + (e & 1);
                    if (!hr_flash_visible(row, col, q_len, kv_len, causal)) x = HR_NEG_INF;
                }
                s[i][e] = x;
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
            }
        }
        float scale_old[2];
        float m_use[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float m_new = fmaxf(row_max[r], hr_quad_max(tile_max[r]));
            // A row that has seen only masked keys so far subtracts 0, not -inf.
            m_use[r] = (m_new == HR_NEG_INF) ? 0.0f : m_new;
            scale_old[r] = exp2f(row_max[r] - m_use[r]);  // exp2(-inf) = 0 for the first tile
            row_max[r] = m_new;
            row_sum[r] *= scale_old[r];
        }
#pragma unroll
        for (int i = 0; i < S_TILES; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float p = exp2f(s[i][e] - m_use[e >> 1]);
                s[i][e] = p;
                row_sum[e >> 1] += p;
            }
        }
#pragma unroll
        for (int i = 0; i < O_TILES; ++i) {
            o[i][0] *= scale_old[0];
            o[i][1] *= scale_old[0];
            o[i][2] *= scale_old[1];
            o[i][3] *= scale_old[1];
        }

        // V_j lands; every warp is done with K_j, so K_{j+1} may overwrite it behind P·V_j.
        hr_cp_async_wait_all();
        __syncthreads();
        if (j + 1 < kv_tiles) {
            hr_flash_load_tile<BC, D>(k_s, kh, k0 + BC, kv_len, k);
        }
        hr_cp_async_commit();

#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            hr_u32 p_frag[4];
            hr_acc_to_a<E, S_TILES>(p_frag, s, kk);
#pragma unroll
            for (int n2 = 0; n2 < O_TILES / 2; ++n2) {
                hr_u32 b[4];
                hr_load_b_kn<D>(b, v_s, kk * 16, n2 * 16);
                E::mma(o[2 * n2], p_frag, b[0], b[1]);
                E::mma(o[2 * n2 + 1], p_frag, b[2], b[3]);
            }
        }
        // K_{j+1} lands; every warp is done with V_j before the next iteration refills it.
        hr_cp_async_wait_all();
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const long long row = row_base + 8 * r;
        const float l = hr_quad_sum(row_sum[r]);
        if (row >= q_len) continue;
        hr_u16* orow = out + ((hr_u64)bh * q_len_u + (hr_u64)row) * D;
#pragma unroll
        for (int i = 0; i < O_TILES; ++i) {
            // The one division of the online softmax; a row that saw no key has l = 0 → 0.
            float lo = l > 0.0f ? o[i][2 * r] / l : 0.0f;
            float hi = l > 0.0f ? o[i][2 * r + 1] / l : 0.0f;
            hr_u32 packed = (hr_u32)E::bits(lo) | ((hr_u32)E::bits(hi) << 16);
            *reinterpret_cast<hr_u32*>(orow + i * 8 + 2 * t) = packed;
        }
        if (t == 0) {
            // Natural-log logsumexp of the scaled scores: (m / log2 e) + ln l = m·ln 2 + ln l.
            const float m = row_max[r] == HR_NEG_INF ? 0.0f : row_max[r];
            lse[(hr_u64)bh * q_len_u + (hr_u64)row] = l > 0.0f ? m * HR_LN2 + logf(l) : HR_NEG_INF;
        }
    }
}

#define HR_FLASH_FWD_KERNEL(NAME, E, D)                                                        \
    extern "C" __global__ void __launch_bounds__(HR_FLASH_THREADS) NAME(                       \
        const hr_u16* __restrict__ q, const hr_u16* __restrict__ k,                            \
        const hr_u16* __restrict__ v, hr_u16* __restrict__ out, float* __restrict__ lse,      \
        unsigned int q_len, unsigned int kv_len, unsigned int q_heads, unsigned int kv_heads,  \
        float scale_log2, unsigned int causal) {                                               \
        hr_flash_fwd<E, D>(q, k, v, out, lse, q_len, kv_len, q_heads, kv_heads, scale_log2,   \
                           causal);                                                            \
    }

HR_FLASH_FWD_KERNEL(flash_attn_fwd_bf16_d64, HrBf16, 64)
HR_FLASH_FWD_KERNEL(flash_attn_fwd_bf16_d128, HrBf16, 128)
HR_FLASH_FWD_KERNEL(flash_attn_fwd_f16_d64, HrF16, 64)
HR_FLASH_FWD_KERNEL(flash_attn_fwd_f16_d128, HrF16, 128)
