// Blockwise 4-bit weights in bitsandbytes' layout (headroom-quant): element e of a row-major
// [rows, cols] weight has its code in byte e/2 of `codes` (high nibble for even e) and its
// block's f32 scale in absmax[e / blocksize]; its value is table[code] * absmax, one f32
// multiplication, so the GPU, headroom-quant's CPU paths and bitsandbytes agree bit for bit.
//
// Launch configuration (every kernel): grid-stride, block of HR_BLOCK_THREADS threads, any
// grid size (the host uses min(ceil(n / 256), 65535) blocks).

__device__ __forceinline__ hr_u32 hr_q4_code(const unsigned char* codes, hr_u64 e) {
    unsigned char b = codes[e >> 1];
    return (e & 1u) ? (hr_u32)(b & 0x0fu) : (hr_u32)(b >> 4);
}

// Double quantization: absmax[b] = code2[qabsmax[b]] * absmax2[b / 256] + offset, each
// operation rounded on its own (no fused multiply-add), as bitsandbytes computes it.
extern "C" __global__ void quant4_absmax_dq_f32(const unsigned char* __restrict__ qabsmax,
                                                const float* __restrict__ code2,
                                                const float* __restrict__ absmax2, float offset,
                                                hr_u64 blocks, float* __restrict__ absmax) {
    HR_GRID_STRIDE(b, blocks) {
        absmax[b] = __fadd_rn(__fmul_rn(code2[qabsmax[b]], absmax2[b >> 8]), offset);
    }
}

// One tile of the weight in f32: out[r * width + j] = W[row0 + r, col0 + j] for r < rows,
// j < width. A forward panel is (row0, rows, col0 = 0, width = cols); a backward strip is
// (row0 = 0, rows = all, col0, width).
extern "C" __global__ void quant4_dequant_tile_f32(const unsigned char* __restrict__ codes,
                                                   const float* __restrict__ absmax,
                                                   const float* __restrict__ table,
                                                   hr_u64 row0, hr_u64 rows, hr_u64 cols,
                                                   hr_u64 col0, hr_u64 width, hr_u64 blocksize,
                                                   float* __restrict__ out) {
    HR_GRID_STRIDE(i, rows * width) {
        hr_u64 r = i / width;
        hr_u64 j = i - r * width;
        hr_u64 e = (row0 + r) * cols + col0 + j;
        out[i] = __fmul_rn(table[hr_q4_code(codes, e)], absmax[e / blocksize]);
    }
}

// Copy a [n, width] tile into columns col0..col0+width of a row-major [n, ld] matrix (the
// panel's part of the output).
extern "C" __global__ void quant4_scatter_cols_f32(const float* __restrict__ src, hr_u64 n,
                                                   hr_u64 width, float* __restrict__ dst,
                                                   hr_u64 ld, hr_u64 col0) {
    HR_GRID_STRIDE(i, n * width) {
        hr_u64 r = i / width;
        dst[r * ld + col0 + (i - r * width)] = src[i];
    }
}
