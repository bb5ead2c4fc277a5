// Attention heads between a linear layer's rows and flash attention's per-head layout.
//
//   wide:  [B, T, parts·NH·hs]  (part p's heads side by side: row (b, t), head h of part p at
//                                element (p·NH + h)·hs; parts = 3 for qkv, 1 otherwise)
//   heads: [B, NH, T, hs]        (one part)
//
// merge == 0 (split): heads[b, h, t, d] = wide[b, t, part·NH·hs + h·hs + d]
// merge != 0 (merge): the inverse; only part `part` of each wide row is written, so the other
//                     parts of the same buffer may be filled by other launches.
//
// A permutation moves bytes, never values, so the kernels work on opaque units: one entry point
// per unit size (permute_heads_b<bytes>, 1 to 16 bytes) and the host picks the widest unit that
// divides a head row (hs·element bytes). Every head row starts at a multiple of its own size in
// both layouts, so with allocations aligned to 256 bytes (every device allocation is) every
// access of a unit is aligned to the unit: bf16 heads of 64 or 128 move as 16-byte vector
// loads and stores, 8 or 16 of them per head row.
//
// head_units = hs·element bytes / unit bytes. The host checks B·NH·T ≤ 2³² − 1, so row
// arithmetic is 32-bit (two 32-bit divisions per row, none per unit); element offsets are 64-bit.
//
// Launch: any grid, any blockDim.x (the host uses HR_BLOCK_THREADS, a power of two). Each block
// takes blockDim.x / lanes rows at a time, lanes = the smallest power of two ≥ head_units, or
// the largest power of two that fits the block if that is smaller. Consecutive threads move
// consecutive units of a head row, so a warp moves whole contiguous head rows on both sides
// (coalesced). Rows grid-stride; a head row longer than the block loops over its units.
// Trade-off: when head_units is not a power of two, lanes − head_units threads of each row idle
// (hs = 64 or 128 in bf16 wastes none).

struct alignas(8) hr_unit_b8 {
    hr_u32 lo, hi;
};
struct alignas(16) hr_unit_b16 {
    hr_u32 x, y, z, w;
};

template <typename Unit>
__device__ __forceinline__ void hr_permute_heads(Unit* __restrict__ dst,
                                                 const Unit* __restrict__ src, hr_u32 batch,
                                                 hr_u32 seq, hr_u32 heads, hr_u32 head_units,
                                                 hr_u32 parts, hr_u32 part, hr_u32 merge) {
    hr_u32 lanes = 1;
    while (lanes < head_units && 2 * lanes <= blockDim.x) {
        lanes <<= 1;
    }
    hr_u32 rows_per_block = blockDim.x / lanes;
    hr_u32 lane = threadIdx.x % lanes;
    hr_u32 slot = threadIdx.x / lanes;
    // Only a block size that is not a power of two leaves threads past its last whole row;
    // they would otherwise repeat the next block's first row.
    if (slot >= rows_per_block) {
        return;
    }
    hr_u64 rows = (hr_u64)batch * heads * seq;
    hr_u64 stride = (hr_u64)gridDim.x * rows_per_block;
    for (hr_u64 r = (hr_u64)blockIdx.x * rows_per_block + slot; r < rows; r += stride) {
        hr_u32 row = (hr_u32)r;  // < 2^32, checked by the host
        hr_u32 t = row % seq;
        hr_u32 bh = row / seq;
        hr_u32 h = bh % heads;
        hr_u32 b = bh / heads;
        hr_u64 heads_base = (hr_u64)row * head_units;
        hr_u64 wide_row = (hr_u64)b * seq + t;
        hr_u64 wide_base = ((wide_row * parts + part) * heads + h) * head_units;
        for (hr_u32 d = lane; d < head_units; d += lanes) {
            if (merge) {
                dst[wide_base + d] = src[heads_base + d];
            } else {
                dst[heads_base + d] = src[wide_base + d];
            }
        }
    }
}

extern "C" __global__ void permute_heads_b1(unsigned char* __restrict__ dst,
                                            const unsigned char* __restrict__ src,
                                            hr_u32 batch, hr_u32 seq, hr_u32 heads,
                                            hr_u32 head_units, hr_u32 parts, hr_u32 part,
                                            hr_u32 merge) {
    hr_permute_heads(dst, src, batch, seq, heads, head_units, parts, part, merge);
}

extern "C" __global__ void permute_heads_b2(hr_u16* __restrict__ dst,
                                            const hr_u16* __restrict__ src, hr_u32 batch,
                                            hr_u32 seq, hr_u32 heads, hr_u32 head_units,
                                            hr_u32 parts, hr_u32 part, hr_u32 merge) {
    hr_permute_heads(dst, src, batch, seq, heads, head_units, parts, part, merge);
}

extern "C" __global__ void permute_heads_b4(hr_u32* __restrict__ dst,
                                            const hr_u32* __restrict__ src, hr_u32 batch,
                                            hr_u32 seq, hr_u32 heads, hr_u32 head_units,
                                            hr_u32 parts, hr_u32 part, hr_u32 merge) {
    hr_permute_heads(dst, src, batch, seq, heads, head_units, parts, part, merge);
}

extern "C" __global__ void permute_heads_b8(hr_unit_b8* __restrict__ dst,
                                            const hr_unit_b8* __restrict__ src, hr_u32 batch,
                                            hr_u32 seq, hr_u32 heads, hr_u32 head_units,
                                            hr_u32 parts, hr_u32 part, hr_u32 merge) {
    hr_permute_heads(dst, src, batch, seq, heads, head_units, parts, part, merge);
}

extern "C" __global__ void permute_heads_b16(hr_unit_b16* __restrict__ dst,
                                             const hr_unit_b16* __restrict__ src, hr_u32 batch,
                                             hr_u32 seq, hr_u32 heads, hr_u32 head_units,
                                             hr_u32 parts, hr_u32 part, hr_u32 merge) {
    hr_permute_heads(dst, src, batch, seq, heads, head_units, parts, part, merge);
}
