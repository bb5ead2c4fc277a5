// Deterministic column sums of a row-major [rows, cols] f32 matrix, accumulated into a [cols]
// vector: the bias gradient of a linear layer (dbias += Σ_rows dout), and the second pass of
// layer norm's dweight/dbias.
//
// No atomics. Pass 1 (column_sum_partials_f32) sums fixed chunks of rows_per_chunk rows per
// column, in row order, into partials[chunk, col]; pass 2 (column_sum_finish_f32) adds the
// partials in chunk order to dst. The chunking comes from the shape only (the host picks
// rows_per_chunk from rows), so the bits depend on the input alone.

// Launch: grid (chunks, ceil(cols / HR_BLOCK_THREADS)), block HR_BLOCK_THREADS.
extern "C" __global__ void column_sum_partials_f32(float* __restrict__ partials,
                                                   const float* __restrict__ x, hr_u64 rows,
                                                   hr_u32 cols, hr_u32 rows_per_chunk) {
    hr_u64 j = (hr_u64)blockIdx.y * HR_BLOCK_THREADS + threadIdx.x;
    if (j >= cols) {
        return;
    }
    hr_u64 first = (hr_u64)blockIdx.x * rows_per_chunk;
    hr_u64 last = first + rows_per_chunk;
    if (last > rows) {
        last = rows;
    }
    float s = 0.0f;
    for (hr_u64 row = first; row < last; ++row) {
        s = __fadd_rn(s, x[row * cols + j]);
    }
    partials[(hr_u64)blockIdx.x * cols + j] = s;
}

// dst[j] += Σ_k partials[k, j], k in order. Launch: grid-stride over cols, any grid.
extern "C" __global__ void column_sum_finish_f32(float* __restrict__ dst,
                                                 const float* __restrict__ partials,
                                                 hr_u32 chunks, hr_u32 cols) {
    HR_GRID_STRIDE(j, (hr_u64)cols) {
        float s = dst[j];
        for (hr_u32 k = 0; k < chunks; ++k) {
            s = __fadd_rn(s, partials[(hr_u64)k * cols + j]);
        }
        dst[j] = s;
    }
}
