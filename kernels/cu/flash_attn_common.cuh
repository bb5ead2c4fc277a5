// Tensor-core building blocks shared by the flash attention kernels (sm_80 and newer).
//
// Prepended (after float_bits.cuh) to flash_attn_fwd.cu and flash_attn_bwd.cu by
// headroom-kernels, so it holds only constants, inline device functions and templates, never a
// kernel. Everything is inline PTX: the NVRTC that CI installs ships no toolkit headers.
//
// Layout conventions (PTX ISA, "Matrix fragments for mma.m16n8k16"): lane = 32·warp + lane,
// g = lane / 4 (the "group"), t = lane % 4 (the thread in the group).
//   A (16×16, row-major), 4 registers of two 16-bit values each:
//     a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1], a2 = A[g][2t+8..2t+9], a3 = A[g+8][2t+8..2t+9]
//   B (16×8, "col"), 2 registers: b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C/D (16×8, f32), 4 registers: c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]
// so two neighbouring 16×8 accumulator tiles (columns 0–7 and 8–15) are, packed to 16 bits,
// exactly the A fragment of a 16×16 operand — which is how P (and dS) feed the next matmul
// straight from registers, as in FlashAttention-2.
//
// Shared-memory tiles hold rows of D 16-bit values padded by HR_FLASH_SMEM_PAD elements: a row
// stride of D+8 elements (16 bytes more than a multiple of 128 bytes for D = 64 and 128) puts the
// eight 16-byte rows one ldmatrix phase reads into eight different bank quads, conflict-free.

// Threads per block of every flash kernel: four warps. headroom_kernels::FLASH_WARPS says the
// same to the host. The tile macros here and in the kernels are #ifndef-guarded so that
// kernels/tune/flash_tiles.py can compile other tilings with -D; the host's constants (tested
// against these lines) stay the one configuration the library launches.
#ifndef HR_FLASH_WARPS
#define HR_FLASH_WARPS 4
#endif
#define HR_FLASH_THREADS (HR_FLASH_WARPS * 32)
// Padding (in 16-bit elements) after each shared-memory row.
#define HR_FLASH_SMEM_PAD 8

// -inf without <math.h>.
#define HR_NEG_INF __int_as_float(0xff800000)
// log2(e) and ln(2) in f32: scores are scaled into the base-2 domain once, so the softmax uses
// exp2 (one ex2 instruction) instead of exp.
#define HR_LOG2E 1.4426950408889634f
#define HR_LN2 0.6931471805599453f

// The dynamic shared memory every flash kernel carves its tiles from (16-bit elements).
extern __shared__ __align__(128) hr_u16 hr_flash_smem[];

// Element types, as tags: how two f32s are packed into one register, and which mma runs.
struct HrBf16 {
    static __device__ __forceinline__ hr_u32 pack(float lo, float hi) {
        hr_u32 r;
        // cvt.rn.bf16x2.f32 d, a, b puts a in the upper half and b in the lower half.
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float load(const hr_u16* p, hr_u64 i) {
        return hr_bf16_bits_to_f32(p[i]);
    }
    static __device__ __forceinline__ hr_u16 bits(float v) { return hr_f32_to_bf16_bits(v); }
    // d += a·b on one 16×8×16 tile, f32 accumulation.
    static __device__ __forceinline__ void mma(float (&d)[4], const hr_u32 (&a)[4], hr_u32 b0,
                                               hr_u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

struct HrF16 {
    static __device__ __forceinline__ hr_u32 pack(float lo, float hi) {
        hr_u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float load(const hr_u16* p, hr_u64 i) {
        return hr_f16_bits_to_f32(p[i]);
    }
    static __device__ __forceinline__ hr_u16 bits(float v) { return hr_f32_to_f16_bits(v); }
    static __device__ __forceinline__ void mma(float (&d)[4], const hr_u32 (&a)[4], hr_u32 b0,
                                               hr_u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// The 32-bit shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ hr_u32 hr_smem_addr(const void* p) {
    hr_u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// Four 8×8 matrices of 16-bit values; lanes 8i..8i+7 give the row addresses of matrix i, and
// register i of lane l receives row l/4, columns 2(l%4)..2(l%4)+1 of matrix i.
__device__ __forceinline__ void hr_ldmatrix_x4(hr_u32 (&r)[4], hr_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// The same, transposed: register i of lane l receives rows 2(l%4)..2(l%4)+1, column l/4.
__device__ __forceinline__ void hr_ldmatrix_x4_trans(hr_u32 (&r)[4], hr_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// 16 bytes global -> shared without passing through registers; with valid == false nothing is
// read and the 16 bytes are zero-filled (how tiles past the end of a sequence become zeros).
__device__ __forceinline__ void hr_cp_async_16(hr_u32 smem, const void* gmem, bool valid) {
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem),
                 "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void hr_cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits for every cp.async this thread issued; a __syncthreads() must follow before other
// threads read what it copied.
__device__ __forceinline__ void hr_cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}

// Waits for every committed group but the most recent one (the prefetch of the next tile in a
// double-buffered loop); a __syncthreads() must follow, as above.
__device__ __forceinline__ void hr_cp_async_wait_all_but_last() {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// The shared-window address of a pointer into the flash tiles (hr_flash_smem). Why not
// hr_smem_addr(p) at every use: that converts a 64-bit generic pointer each time (three or four
// integer instructions per ldmatrix or cp.async, in loops that issue dozens per tile, and an
// H200 profile showed the integer pipe as the busiest at 40-45%). Here the base is converted
// once (identical inline asm is computed once) and the offset is 32-bit arithmetic whose
// constant parts fold into the instructions' immediate offsets.
__device__ __forceinline__ hr_u32 hr_flash_smem_addr(const hr_u16* p) {
    return hr_smem_addr(hr_flash_smem) + (hr_u32)(p - hr_flash_smem) * 2u;
}

// Copy rows [row0, row0 + ROWS) of a [rows_total, D] tensor slice into a padded shared tile,
// zero-filling rows at or past rows_total. All HR_FLASH_THREADS threads take part: each owns
// one 16-byte column chunk and every ROWS_PER_PASS-th row from its first, so its source and
// destination move by constants from pass to pass and a pass costs one 32-bit compare.
template <int ROWS, int D>
__device__ __forceinline__ void hr_flash_load_tile(hr_u16* tile, const hr_u16* __restrict__ src,
                                                   long long row0, long long rows_total,
                                                   const hr_u16* __restrict__ any_valid) {
    constexpr int CHUNKS_PER_ROW = D / 8;  // 16-byte chunks
    constexpr int STRIDE = D + HR_FLASH_SMEM_PAD;
    static_assert(HR_FLASH_THREADS % CHUNKS_PER_ROW == 0, "a thread keeps one column chunk");
    constexpr int ROWS_PER_PASS = HR_FLASH_THREADS / CHUNKS_PER_ROW;
    constexpr int PASSES = (ROWS + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
    const int first = threadIdx.x / CHUNKS_PER_ROW;
    const int col = (threadIdx.x % CHUNKS_PER_ROW) * 8;
    // Rows of the tensor at or after this thread's first row, capped to the tile (0 or less:
    // none).
    long long left_rows = rows_total - row0 - first;
    const int left = left_rows > ROWS ? ROWS : (left_rows < 0 ? 0 : (int)left_rows);
    const hr_u16* from = src + (hr_u64)(row0 + first) * D + col;
    const hr_u32 to = hr_flash_smem_addr(tile + first * STRIDE + col);
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
        const int r = pass * ROWS_PER_PASS;
        if (ROWS % ROWS_PER_PASS != 0 && first + r >= ROWS) break;
        const bool valid = r < left;
        // A skipped copy still needs a mapped address: give it the tensor's first element.
        hr_cp_async_16(to + (hr_u32)(r * STRIDE * 2), valid ? from + (hr_u64)r * D : any_valid,
                       valid);
    }
}

// A fragments of the warp's 16 rows [row0, row0 + 16) of a padded tile, columns
// [col0, col0 + 16): matrix i = lane/8 covers rows 8(i&1).., columns 8(i>>1)..
template <int D>
__device__ __forceinline__ void hr_load_a(hr_u32 (&a)[4], const hr_u16* tile, int row0, int col0) {
    constexpr int STRIDE = D + HR_FLASH_SMEM_PAD;
    int lane = threadIdx.x & 31;
    int row = row0 + (lane & 7) + 8 * ((lane >> 3) & 1);
    int col = col0 + 8 * (lane >> 4);
    hr_ldmatrix_x4(a, hr_flash_smem_addr(tile + row * STRIDE + col));
}

// B fragments of two neighbouring n-tiles for B = Xᵀ, X stored [n][k] in a padded tile (keys for
// Q·Kᵀ): n rows [n0, n0 + 16), k columns [k0, k0 + 16). b[0], b[1] belong to n-tile n0..n0+7,
// b[2], b[3] to n0+8..n0+15. Matrix i covers n rows 8(i>>1).., k columns 8(i&1)..
template <int D>
__device__ __forceinline__ void hr_load_b_nk(hr_u32 (&b)[4], const hr_u16* tile, int n0, int k0) {
    constexpr int STRIDE = D + HR_FLASH_SMEM_PAD;
    int lane = threadIdx.x & 31;
    int row = n0 + (lane & 7) + 8 * (lane >> 4);
    int col = k0 + 8 * ((lane >> 3) & 1);
    hr_ldmatrix_x4(b, hr_flash_smem_addr(tile + row * STRIDE + col));
}

// B fragments of two neighbouring n-tiles for B = X, X stored [k][n] in a padded tile (values
// for P·V): k rows [k0, k0 + 16), n columns [n0, n0 + 16), through the transposing ldmatrix.
// b[0], b[1] belong to n0..n0+7, b[2], b[3] to n0+8..n0+15. Matrix i covers k rows 8(i&1)..,
// n columns 8(i>>1)..
template <int D>
__device__ __forceinline__ void hr_load_b_kn(hr_u32 (&b)[4], const hr_u16* tile, int k0, int n0) {
    constexpr int STRIDE = D + HR_FLASH_SMEM_PAD;
    int lane = threadIdx.x & 31;
    int row = k0 + (lane & 7) + 8 * ((lane >> 3) & 1);
    int col = n0 + 8 * (lane >> 4);
    hr_ldmatrix_x4_trans(b, hr_flash_smem_addr(tile + row * STRIDE + col));
}

// The A fragment of k-step kk (columns 16kk..16kk+15) of an accumulator held as 16×8 tiles,
// packed to 16 bits.
template <typename E, int NT>
__device__ __forceinline__ void hr_acc_to_a(hr_u32 (&a)[4], const float (&acc)[NT][4], int kk) {
    a[0] = E::pack(acc[2 * kk][0], acc[2 * kk][1]);
    a[1] = E::pack(acc[2 * kk][2], acc[2 * kk][3]);
    a[2] = E::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[3] = E::pack(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// Whether query row `row` sees key `col` (bottom-right aligned causal mask, as on the CPU:
// key j is visible to row i when j <= i + kv_len - q_len), and both are inside the sequences.
__device__ __forceinline__ bool hr_flash_visible(long long row, long long col, long long q_len,
                                                 long long kv_len, bool causal) {
    return row < q_len && col < kv_len && (!causal || col <= row + kv_len - q_len);
}

// Number of keys row block [row0, row0 + rows) can see at most: a prefix of the key rows.
__device__ __forceinline__ long long hr_flash_key_limit(long long row0, long long rows,
                                                        long long q_len, long long kv_len,
                                                        bool causal) {
    if (!causal) return kv_len;
    long long last_row = row0 + rows - 1;
    if (last_row > q_len - 1) last_row = q_len - 1;
    long long limit = last_row + kv_len - q_len + 1;
    if (limit < 0) return 0;
    return limit < kv_len ? limit : kv_len;
}

// Whether any element of the tile rows [row0, row0 + rows) × keys [col0, col0 + cols) is
// invisible, i.e. whether the tile needs the per-element mask at all.
__device__ __forceinline__ bool hr_flash_tile_needs_mask(long long row0, long long rows,
                                                         long long col0, long long cols,
                                                         long long q_len, long long kv_len,
                                                         bool causal) {
    if (row0 + rows > q_len || col0 + cols > kv_len) return true;
    return causal && col0 + cols - 1 > row0 + kv_len - q_len;
}

// Sum and max across the four threads of a quad (the threads that share an accumulator row).
__device__ __forceinline__ float hr_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float hr_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
