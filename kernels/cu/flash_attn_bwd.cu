// FlashAttention-2 backward on tensor cores, for 16-bit inputs [batch, heads, seq, D] with f32
// accumulation. Three kernels, launched in this order on one stream:
//
// 1. flash_attn_bwd_dot_<t>(out, d_out, dot, rows, head_dim): dot[row] = Σ_d dO·O in f32, one
//    warp per row (grid-stride over rows; any grid, block HR_BLOCK_THREADS). This is the "D"
//    of the FlashAttention-2 paper: rowsum(dO ∘ O) = rowsum(P ∘ dP).
// 2. flash_attn_bwd_dq_<t>_d<D>: one block per query tile of one query head (grid =
//    ceil(q_len / HR_FLASH_DQ_BLOCK_Q) · batch · q_heads, block HR_FLASH_THREADS, dynamic shared
//    memory (2·BLOCK_Q + 2·2·BLOCK_K)·(D + 8)·2 bytes: Q, dO and two K/V stages). Loops over the
//    key tiles the query tile sees, fetching tile j+1 while tile j is used: S = Q·Kᵀ,
//    P = exp2(S·scale·log2 e − lse·log2 e), dP = dO·Vᵀ, dS = P∘(dP − dot), dQ += dS·K, all in
//    registers; dQ·scale is written once, in the input type.
// 3. flash_attn_bwd_dkdv_<t>_d<D>: one block per key tile of one key/value head (grid =
//    ceil(kv_len / HR_FLASH_DKDV_BLOCK_K) · batch · kv_heads, block HR_FLASH_THREADS, dynamic
//    shared memory (2·BLOCK_K + 2·2·BLOCK_Q(D))·(D + 8)·2 + 2·2·BLOCK_Q(D)·4 bytes: K, V and two
//    stages of Q, dO, lse and dot). Each warp owns 16 key rows and computes the transposed
//    products Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, so Pᵀ and dSᵀ are already A operands of dV += Pᵀ·dO
//    and dK += dSᵀ·Q. It loops over every query head of its group (GQA: the sum over the heads
//    sharing a key/value head happens in registers) and over the query tiles that see the key
//    tile, fetching the next (head, tile) step while this one is used, then writes dK·scale and
//    dV once.
//
// Trade-off — a separate dQ pass instead of FlashAttention-2's f32 atomics: the dK/dV kernel
// could add dS·K into an f32 dQ buffer with atomicAdd and skip kernel 2, doing 5 matmuls per
// tile pair instead of 7 (S and dP are recomputed by both passes, about 1.4× the backward
// FLOPs). Atomics make dQ's rounding depend on the order blocks finish in, so gradients would
// differ from run to run; headroom promises bitwise-reproducible gradients (checkpointing
// schedules are tested for bit-identical results), so the deterministic form is the default.
// It also needs no [batch, q_heads, q_len, D] f32 accumulator (4 bytes per element of Q).
//
// Masking is as in the forward (bottom-right aligned causal mask, sequence tails): probabilities
// of invisible pairs are exactly 0, so rows that see no key get dQ = 0 and add nothing to dK/dV.
// A logsumexp of -inf (such a row) is read as +inf, so exp2(x − lse) is 0 even unmasked.

#define HR_FLASH_DQ_BLOCK_Q (HR_FLASH_WARPS * 16)
#ifndef HR_FLASH_DQ_BLOCK_K
#define HR_FLASH_DQ_BLOCK_K 64
#endif
// Key/value tiles in flight per dQ block (double buffering).
#define HR_FLASH_DQ_KV_STAGES 2
#define HR_FLASH_DKDV_BLOCK_K (HR_FLASH_WARPS * 16)
// Query tiles in flight per dK/dV block (double buffering).
#define HR_FLASH_DKDV_Q_STAGES 2
// Query rows per dK/dV step, per head dim. 64 for both: at D = 128 the dK and dV accumulators
// (2·D/2 registers per thread) and 64-query score tiles fit sm_90's 255 registers without
// spilling, and an H200 sweep (kernels/tune/flash_tiles.py; benches/results/
// 2026-11-30-h200-flash-tiles.md) timed 64 rows 11% faster than 32 at N = 4096. 128 at D = 64
// spills.
#ifndef HR_FLASH_DKDV_BLOCK_Q_D64
#define HR_FLASH_DKDV_BLOCK_Q_D64 64
#endif
#ifndef HR_FLASH_DKDV_BLOCK_Q_D128
#define HR_FLASH_DKDV_BLOCK_Q_D128 64
#endif
#define HR_FLASH_DKDV_BLOCK_Q(D) \
    ((D) <= 64 ? HR_FLASH_DKDV_BLOCK_Q_D64 : HR_FLASH_DKDV_BLOCK_Q_D128)

// The logsumexp in the base-2 domain, with -inf (a row that sees no key) turned into +inf.
__device__ __forceinline__ float hr_flash_lse2(float lse) {
    return lse == HR_NEG_INF ? __int_as_float(0x7f800000) : lse * HR_LOG2E;
}

#define HR_FLASH_DOT_KERNEL(NAME, E)                                                           \
    extern "C" __global__ void NAME(const hr_u16* __restrict__ o,                              \
                                    const hr_u16* __restrict__ d_o, float* __restrict__ dot,   \
                                    hr_u64 rows, unsigned int head_dim) {                      \
        const unsigned int lane = threadIdx.x & 31;                                            \
        const hr_u64 warps = (hr_u64)gridDim.x * (blockDim.x >> 5);                            \
        for (hr_u64 row = (hr_u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);         \
             row < rows; row += warps) {                                                       \
            const hr_u64 base = row * head_dim;                                                \
            float acc = 0.0f;                                                                  \
            for (unsigned int d = lane; d < head_dim; d += 32) {                               \
                acc += E::load(o, base + d) * E::load(d_o, base + d);                          \
            }                                                                                  \
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off); \
            if (lane == 0) dot[row] = acc;                                                     \
        }                                                                                      \
    }

HR_FLASH_DOT_KERNEL(flash_attn_bwd_dot_bf16, HrBf16)
HR_FLASH_DOT_KERNEL(flash_attn_bwd_dot_f16, HrF16)

template <typename E, int D>
__device__ __forceinline__ void hr_flash_bwd_dq(
    const hr_u16* __restrict__ q, const hr_u16* __restrict__ k, const hr_u16* __restrict__ v,
    const hr_u16* __restrict__ d_o, const float* __restrict__ lse, const float* __restrict__ dot,
    hr_u16* __restrict__ dq, unsigned int q_len_u, unsigned int kv_len_u, unsigned int q_heads,
    unsigned int kv_heads, float scale, float scale_log2, unsigned int causal_u) {
    constexpr int BR = HR_FLASH_DQ_BLOCK_Q;
    constexpr int BC = HR_FLASH_DQ_BLOCK_K;
    constexpr int STRIDE = D + HR_FLASH_SMEM_PAD;
    constexpr int KSTEPS = D / 16;
    constexpr int S_TILES = BC / 8;
    constexpr int O_TILES = D / 8;

    const long long q_len = q_len_u, kv_len = kv_len_u;
    const bool causal = causal_u != 0;
    const unsigned int q_tiles = (q_len_u + BR - 1) / BR;
    const unsigned int q_tile = q_tiles - 1 - blockIdx.x % q_tiles;  // heaviest first
    const unsigned int bh = blockIdx.x / q_tiles;
    const unsigned int group = q_heads / kv_heads;
    const hr_u64 kv_bh = (hr_u64)(bh / q_heads) * kv_heads + (bh % q_heads) / group;

    const hr_u16* qh = q + (hr_u64)bh * q_len_u * D;
    const hr_u16* doh = d_o + (hr_u64)bh * q_len_u * D;
    const hr_u16* kh = k + kv_bh * kv_len_u * D;
    const hr_u16* vh = v + kv_bh * kv_len_u * D;

    // Q and dO once, then two stages of (K, V): the next key tile streams in while this one is
    // used.
    hr_u16* q_s = hr_flash_smem;
    hr_u16* do_s = q_s + BR * STRIDE;
    hr_u16* kv_stages = do_s + BR * STRIDE;  // HR_FLASH_DQ_KV_STAGES of (K, V)

    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const long long q0 = (long long)q_tile * BR;
    const long long row_base = q0 + warp * 16 + g;

    float lse2[2], row_dot[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const long long row = row_base + 8 * r;
        const bool valid = row < q_len;
        const hr_u64 at = (hr_u64)bh * q_len_u + (hr_u64)(valid ? row : 0);
        lse2[r] = valid ? hr_flash_lse2(lse[at]) : __int_as_float(0x7f800000);
        row_dot[r] = valid ? dot[at] : 0.0f;
    }

    const long long key_limit = hr_flash_key_limit(q0, BR, q_len, kv_len, causal);
    const int kv_tiles = (int)((key_limit + BC - 1) / BC);

    hr_flash_load_tile<BR, D>(q_s, qh, q0, q_len, q);
    hr_flash_load_tile<BR, D>(do_s, doh, q0, q_len, d_o);
    if (kv_tiles > 0) {
        hr_flash_load_tile<BC, D>(kv_stages, kh, 0, kv_len, k);
        hr_flash_load_tile<BC, D>(kv_stages + BC * STRIDE, vh, 0, kv_len, v);
    }
    hr_cp_async_commit();

    float acc[O_TILES][4];
#pragma unroll
    for (int i = 0; i < O_TILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    for (int j = 0; j < kv_tiles; ++j) {
        const long long k0 = (long long)j * BC;
        hr_u16* k_s = kv_stages + (j & 1) * 2 * BC * STRIDE;
        hr_u16* v_s = k_s + BC * STRIDE;
        if (j + 1 < kv_tiles) {
            // Stage (j+1)&1 was last read in iteration j-1, which ended with a barrier.
            hr_u16* k_next = kv_stages + ((j + 1) & 1) * 2 * BC * STRIDE;
            hr_flash_load_tile<BC, D>(k_next, kh, k0 + BC, kv_len, k);
            hr_flash_load_tile<BC, D>(k_next + BC * STRIDE, vh, k0 + BC, kv_len, v);
            hr_cp_async_commit();
            hr_cp_async_wait_all_but_last();  // tile j (and Q, dO) landed; j+1 may be in flight
        } else {
            hr_cp_async_wait_all();
        }
        __syncthreads();
        float s[S_TILES][4], dp[S_TILES][4];
#pragma unroll
        for (int i = 0; i < S_TILES; ++i) {
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
            dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
        }
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            hr_u32 qa[4], da[4];
            hr_load_a<D>(qa, q_s, warp * 16, ks * 16);
            hr_load_a<D>(da, do_s, warp * 16, ks * 16);
#pragma unroll
            for (int n2 = 0; n2 < S_TILES / 2; ++n2) {
                hr_u32 kb[4], vb[4];
                hr_load_b_nk<D>(kb, k_s, n2 * 16, ks * 16);
                hr_load_b_nk<D>(vb, v_s, n2 * 16, ks * 16);
                E::mma(s[2 * n2], qa, kb[0], kb[1]);
                E::mma(s[2 * n2 + 1], qa, kb[2], kb[3]);
                E::mma(dp[2 * n2], da, vb[0], vb[1]);
                E::mma(dp[2 * n2 + 1], da, vb[2], vb[3]);
            }
        }
        const bool masked = hr_flash_tile_needs_mask(q0, BR, k0, BC, q_len, kv_len, causal);
#pragma unroll
        for (int i = 0; i < S_TILES; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float p = exp2f(s[i][e] * scale_log2 - lse2[e >> 1]);
                if (masked) {
                    long long row = row_base + 8 * (e >> 1);
                    long long col = k0 + i * 8 + 2 * t + (e & 1);
                    if (!hr_flash_visible(row, col, q_len, kv_len, causal)) p = 0.0f;
                }
                s[i][e] = p * (dp[i][e] - row_dot[e >> 1]);  // dS, in place of S
            }
        }
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            hr_u32 ds_frag[4];
            hr_acc_to_a<E, S_TILES>(ds_frag, s, kk);
#pragma unroll
            for (int n2 = 0; n2 < O_TILES / 2; ++n2) {
                hr_u32 b[4];
                hr_load_b_kn<D>(b, k_s, kk * 16, n2 * 16);
                E::mma(acc[2 * n2], ds_frag, b[0], b[1]);
                E::mma(acc[2 * n2 + 1], ds_frag, b[2], b[3]);
            }
        }
        // Every warp is done with stage j&1 before iteration j+1 prefetches tile j+2 into it.
        __syncthreads();
    }
    // A query tile that sees no key still waits for its Q/dO copies before exiting.
    hr_cp_async_wait_all();

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const long long row = row_base + 8 * r;
        if (row >= q_len) continue;
        hr_u16* drow = dq + ((hr_u64)bh * q_len_u + (hr_u64)row) * D;
#pragma unroll
        for (int i = 0; i < O_TILES; ++i) {
            hr_u32 packed = (hr_u32)E::bits(acc[i][2 * r] * scale) |
                            ((hr_u32)E::bits(acc[i][2 * r + 1] * scale) << 16);
            *reinterpret_cast<hr_u32*>(drow + i * 8 + 2 * t) = packed;
        }
    }
}

template <typename E, int D>
__device__ __forceinline__ void hr_flash_bwd_dkdv(
    const hr_u16* __restrict__ q, const hr_u16* __restrict__ k, const hr_u16* __restrict__ v,
    const hr_u16* __restrict__ d_o, const float* __restrict__ lse, const float* __restrict__ dot,
    hr_u16* __restrict__ dk, hr_u16* __restrict__ dv, unsigned int q_len_u,
    unsigned int kv_len_u, unsigned int q_heads, unsigned int kv_heads, float scale,
    float scale_log2, unsigned int causal_u) {
    constexpr int BC = HR_FLASH_DKDV_BLOCK_K;
    constexpr int BR = HR_FLASH_DKDV_BLOCK_Q(D);
    constexpr int STRIDE = D + HR_FLASH_SMEM_PAD;
    constexpr int KSTEPS = D / 16;
    constexpr int S_TILES = BR / 8;  // 16×8 tiles of Sᵀ per warp (16 key rows × BR queries)
    constexpr int O_TILES = D / 8;

    const long long q_len = q_len_u, kv_len = kv_len_u;
    const bool causal = causal_u != 0;
    const unsigned int kv_tiles = (kv_len_u + BC - 1) / BC;
    // Causal work shrinks with the key tile index, so the natural order is heaviest first.
    const unsigned int kv_tile = blockIdx.x % kv_tiles;
    const unsigned int bkv = blockIdx.x / kv_tiles;  // batch · kv_heads + kv head
    const unsigned int b = bkv / kv_heads, kv_head = bkv % kv_heads;
    const unsigned int group = q_heads / kv_heads;

    const hr_u16* kh = k + (hr_u64)bkv * kv_len_u * D;
    const hr_u16* vh = v + (hr_u64)bkv * kv_len_u * D;

    // K and V once, then two stages of (Q, dO) and two of (lse, dot): the next query tile
    // streams in while this one is used.
    hr_u16* k_s = hr_flash_smem;
    hr_u16* v_s = k_s + BC * STRIDE;
    hr_u16* qdo_stages = v_s + BC * STRIDE;
    float* row_stages =
        reinterpret_cast<float*>(qdo_stages + HR_FLASH_DKDV_Q_STAGES * 2 * BR * STRIDE);

    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const long long k0 = (long long)kv_tile * BC;
    const long long key_base = k0 + warp * 16 + g;  // this thread's key rows: +0 and +8

    // The first query row that sees key k0 (causal: k0 <= row + kv_len - q_len).
    long long first_row = causal ? k0 - (kv_len - q_len) : 0;
    if (first_row < 0) first_row = 0;
    const int q_tiles = (int)((q_len + BR - 1) / BR);
    const int first_tile = (int)(first_row / BR);

    // The (query head of the group, query tile) pairs this key tile meets, as one sequence of
    // steps, so the prefetch runs across head boundaries too.
    const int tiles_per_head = q_tiles > first_tile ? q_tiles - first_tile : 0;
    const int steps = (int)group * tiles_per_head;
    // Stage `stage` ← the Q/dO tile (cp.async) and lse/dot rows (plain loads) of step `step`.
    auto load_step = [&](int step, int stage) {
        const hr_u64 bh = (hr_u64)b * q_heads + (hr_u64)kv_head * group + step / tiles_per_head;
        const long long row0 = (long long)(first_tile + step % tiles_per_head) * BR;
        hr_u16* q_dst = qdo_stages + stage * 2 * BR * STRIDE;
        hr_flash_load_tile<BR, D>(q_dst, q + bh * q_len_u * D, row0, q_len, q);
        hr_flash_load_tile<BR, D>(q_dst + BR * STRIDE, d_o + bh * q_len_u * D, row0, q_len, d_o);
        float* rows_dst = row_stages + stage * 2 * BR;
        for (int r = threadIdx.x; r < BR; r += HR_FLASH_THREADS) {
            const long long row = row0 + r;
            const bool valid = row < q_len;
            const hr_u64 at = bh * q_len_u + (hr_u64)(valid ? row : 0);
            rows_dst[r] = valid ? hr_flash_lse2(lse[at]) : __int_as_float(0x7f800000);
            rows_dst[BR + r] = valid ? dot[at] : 0.0f;
        }
    };

    hr_flash_load_tile<BC, D>(k_s, kh, k0, kv_len, k);
    hr_flash_load_tile<BC, D>(v_s, vh, k0, kv_len, v);
    if (steps > 0) load_step(0, 0);
    hr_cp_async_commit();

    float dk_acc[O_TILES][4], dv_acc[O_TILES][4];
#pragma unroll
    for (int i = 0; i < O_TILES; ++i) {
        dk_acc[i][0] = dk_acc[i][1] = dk_acc[i][2] = dk_acc[i][3] = 0.0f;
        dv_acc[i][0] = dv_acc[i][1] = dv_acc[i][2] = dv_acc[i][3] = 0.0f;
    }

    for (int step = 0; step < steps; ++step) {
        const int stage = step & 1;
        if (step + 1 < steps) {
            // Stage (step+1)&1 was last read in the previous step, which ended with a barrier.
            load_step(step + 1, stage ^ 1);
            hr_cp_async_commit();
            hr_cp_async_wait_all_but_last();  // this step's tiles (and K, V) landed
        } else {
            hr_cp_async_wait_all();
        }
        __syncthreads();
        const long long row0 = (long long)(first_tile + step % tiles_per_head) * BR;
        const hr_u16* q_s = qdo_stages + stage * 2 * BR * STRIDE;
        const hr_u16* do_s = q_s + BR * STRIDE;
        const float* lse_s = row_stages + stage * 2 * BR;
        const float* dot_s = lse_s + BR;

        float s[S_TILES][4], dp[S_TILES][4];
#pragma unroll
        for (int i = 0; i < S_TILES; ++i) {
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
            dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.0f;
        }
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            hr_u32 ka[4], va[4];
            hr_load_a<D>(ka, k_s, warp * 16, ks * 16);
            hr_load_a<D>(va, v_s, warp * 16, ks * 16);
#pragma unroll
            for (int n2 = 0; n2 < S_TILES / 2; ++n2) {
                hr_u32 qb[4], db[4];
                hr_load_b_nk<D>(qb, q_s, n2 * 16, ks * 16);
                hr_load_b_nk<D>(db, do_s, n2 * 16, ks * 16);
                E::mma(s[2 * n2], ka, qb[0], qb[1]);
                E::mma(s[2 * n2 + 1], ka, qb[2], qb[3]);
                E::mma(dp[2 * n2], va, db[0], db[1]);
                E::mma(dp[2 * n2 + 1], va, db[2], db[3]);
            }
        }
        // Element (i, e) of Sᵀ: key row key_base + 8(e>>1), query column row0 + 8i + 2t + (e&1).
        const bool masked = hr_flash_tile_needs_mask(row0, BR, k0, BC, q_len, kv_len, causal);
#pragma unroll
        for (int i = 0; i < S_TILES; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = i * 8 + 2 * t + (e & 1);
                float p = exp2f(s[i][e] * scale_log2 - lse_s[c]);
                if (masked) {
                    long long key = key_base + 8 * (e >> 1);
                    if (!hr_flash_visible(row0 + c, key, q_len, kv_len, causal)) p = 0.0f;
                }
                s[i][e] = p;                            // Pᵀ
                dp[i][e] = p * (dp[i][e] - dot_s[c]);  // dSᵀ
            }
        }
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk) {
            hr_u32 pa[4], dsa[4];
            hr_acc_to_a<E, S_TILES>(pa, s, kk);
            hr_acc_to_a<E, S_TILES>(dsa, dp, kk);
#pragma unroll
            for (int n2 = 0; n2 < O_TILES / 2; ++n2) {
                hr_u32 dob[4], qb[4];
                hr_load_b_kn<D>(dob, do_s, kk * 16, n2 * 16);
                hr_load_b_kn<D>(qb, q_s, kk * 16, n2 * 16);
                E::mma(dv_acc[2 * n2], pa, dob[0], dob[1]);
                E::mma(dv_acc[2 * n2 + 1], pa, dob[2], dob[3]);
                E::mma(dk_acc[2 * n2], dsa, qb[0], qb[1]);
                E::mma(dk_acc[2 * n2 + 1], dsa, qb[2], qb[3]);
            }
        }
        // Every warp is done with this stage before the next step prefetches into it.
        __syncthreads();
    }
    // A block with no query tile to visit still waits for its K/V copies before exiting.
    hr_cp_async_wait_all();

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const long long key = key_base + 8 * r;
        if (key >= kv_len) continue;
        const hr_u64 at = ((hr_u64)bkv * kv_len_u + (hr_u64)key) * D;
#pragma unroll
        for (int i = 0; i < O_TILES; ++i) {
            hr_u32 dk_packed = (hr_u32)E::bits(dk_acc[i][2 * r] * scale) |
                               ((hr_u32)E::bits(dk_acc[i][2 * r + 1] * scale) << 16);
            hr_u32 dv_packed = (hr_u32)E::bits(dv_acc[i][2 * r]) |
                               ((hr_u32)E::bits(dv_acc[i][2 * r + 1]) << 16);
            *reinterpret_cast<hr_u32*>(dk + at + i * 8 + 2 * t) = dk_packed;
            *reinterpret_cast<hr_u32*>(dv + at + i * 8 + 2 * t) = dv_packed;
        }
    }
}

#define HR_FLASH_BWD_DQ_KERNEL(NAME, E, D)                                                     \
    extern "C" __global__ void __launch_bounds__(HR_FLASH_THREADS) NAME(                       \
        const hr_u16* __restrict__ q, const hr_u16* __restrict__ k,                            \
        const hr_u16* __restrict__ v, const hr_u16* __restrict__ d_o,                          \
        const float* __restrict__ lse, const float* __restrict__ dot, hr_u16* __restrict__ dq, \
        unsigned int q_len, unsigned int kv_len, unsigned int q_heads, unsigned int kv_heads,  \
        float scale, float scale_log2, unsigned int causal) {                                  \
        hr_flash_bwd_dq<E, D>(q, k, v, d_o, lse, dot, dq, q_len, kv_len, q_heads, kv_heads,    \
                              scale, scale_log2, causal);                                      \
    }

#define HR_FLASH_BWD_DKDV_KERNEL(NAME, E, D)                                                   \
    extern "C" __global__ void __launch_bounds__(HR_FLASH_THREADS) NAME(                       \
        const hr_u16* __restrict__ q, const hr_u16* __restrict__ k,                            \
        const hr_u16* __restrict__ v, const hr_u16* __restrict__ d_o,                          \
        const float* __restrict__ lse, const float* __restrict__ dot, hr_u16* __restrict__ dk, \
        hr_u16* __restrict__ dv, unsigned int q_len, unsigned int kv_len,                      \
        unsigned int q_heads, unsigned int kv_heads, float scale, float scale_log2,            \
        unsigned int causal) {                                                                 \
        hr_flash_bwd_dkdv<E, D>(q, k, v, d_o, lse, dot, dk, dv, q_len, kv_len, q_heads,        \
                                kv_heads, scale, scale_log2, causal);                          \
    }

HR_FLASH_BWD_DQ_KERNEL(flash_attn_bwd_dq_bf16_d64, HrBf16, 64)
HR_FLASH_BWD_DQ_KERNEL(flash_attn_bwd_dq_bf16_d128, HrBf16, 128)
HR_FLASH_BWD_DQ_KERNEL(flash_attn_bwd_dq_f16_d64, HrF16, 64)
HR_FLASH_BWD_DQ_KERNEL(flash_attn_bwd_dq_f16_d128, HrF16, 128)
HR_FLASH_BWD_DKDV_KERNEL(flash_attn_bwd_dkdv_bf16_d64, HrBf16, 64)
HR_FLASH_BWD_DKDV_KERNEL(flash_attn_bwd_dkdv_bf16_d128, HrBf16, 128)
HR_FLASH_BWD_DKDV_KERNEL(flash_attn_bwd_dkdv_f16_d64, HrF16, 64)
HR_FLASH_BWD_DKDV_KERNEL(flash_attn_bwd_dkdv_f16_d128, HrF16, 128)
