// Token + position embeddings, forward and a deterministic backward, llm.c layout:
// out[row, :] = wte[tokens[row], :] + wpe[row % t, :] for rows = B·T.
//
// Backward without float atomics, by ownership: every gradient element is owned by exactly one
// thread, which adds the dout rows that touch it in row order, exactly as the CPU loop does.
// The result is therefore bitwise equal to headroom-trainer's ops::embedding::backward, for any
// grid, and identical from run to run.
// - dwpe: one thread per (position, channel) walks the B rows of its position.
// - dwte: block (x, y) owns vocabulary rows [x·vocab_per_block, (x+1)·vocab_per_block) and
//   channels [y·HR_BLOCK_THREADS, (y+1)·HR_BLOCK_THREADS). It streams every token through
//   shared memory (one read per block, a broadcast in shared memory) and adds the dout rows
//   of the tokens it owns. No sort, no scratch memory; the price is that every block scans
//   all B·T tokens, which is cheap next to the dout rows it reads.
//
// A token >= vocab is never dereferenced: forward writes a NaN row for it (so the loss shows
// it) and backward skips it. The host validates tokens before upload, as the CPU trainer does.

// Launch: grid-stride, any grid.
extern "C" __global__ void embedding_forward_f32(float* __restrict__ out,
                                                 const hr_u32* __restrict__ tokens,
                                                 const float* __restrict__ wte,
                                                 const float* __restrict__ wpe, hr_u64 rows,
                                                 hr_u32 t, hr_u32 c, hr_u32 vocab) {
    hr_u64 n = rows * (hr_u64)c;
    HR_GRID_STRIDE(i, n) {
        hr_u64 row = i / c;
        hr_u64 j = i % c;
        hr_u32 tok = tokens[row];
        hr_u64 pos = row % t;
        out[i] = (tok < vocab) ? __fadd_rn(wte[(hr_u64)tok * c + j], wpe[pos * c + j])
                               : __uint_as_float(0x7fc00000u);
    }
}

// Token embedding alone (Llama's, which has no learned positions): out[row, :] =
// wte[tokens[row], :], a copy (so bitwise the CPU's); its backward is
// embedding_backward_wte_f32 alone. Launch: grid-stride, any grid.
extern "C" __global__ void embedding_forward_tokens_f32(float* __restrict__ out,
                                                        const hr_u32* __restrict__ tokens,
                                                        const float* __restrict__ wte,
                                                        hr_u64 rows, hr_u32 c, hr_u32 vocab) {
    hr_u64 n = rows * (hr_u64)c;
    HR_GRID_STRIDE(i, n) {
        hr_u32 tok = tokens[i / c];
        out[i] = (tok < vocab) ? wte[(hr_u64)tok * c + i % c] : __uint_as_float(0x7fc00000u);
    }
}

// Launch: grid (ceil(vocab / vocab_per_block), ceil(c / HR_BLOCK_THREADS)),
// block HR_BLOCK_THREADS.
extern "C" __global__ void embedding_backward_wte_f32(float* __restrict__ dwte,
                                                      const float* __restrict__ dout,
                                                      const hr_u32* __restrict__ tokens,
                                                      hr_u64 rows, hr_u32 c, hr_u32 vocab,
                                                      hr_u32 vocab_per_block) {
    __shared__ hr_u32 tile[HR_BLOCK_THREADS];
    hr_u64 lo = (hr_u64)blockIdx.x * vocab_per_block;
    hr_u64 hi = lo + vocab_per_block;
    if (hi > vocab) {
        hi = vocab;
    }
    hr_u64 j = (hr_u64)blockIdx.y * HR_BLOCK_THREADS + threadIdx.x;
    for (hr_u64 base = 0; base < rows; base += HR_BLOCK_THREADS) {
        hr_u64 r = base + threadIdx.x;
        tile[threadIdx.x] = (r < rows) ? tokens[r] : 0xffffffffu;
        __syncthreads();
        hr_u64 count = rows - base;
        if (count > HR_BLOCK_THREADS) {
            count = HR_BLOCK_THREADS;
        }
        if (j < c) {
            for (hr_u64 k = 0; k < count; ++k) {
                hr_u64 tok = tile[k];  // the same for every thread: no divergence
                if (tok >= lo && tok < hi) {
                    hr_u64 dst = tok * c + j;
                    dwte[dst] = __fadd_rn(dwte[dst], dout[(base + k) * c + j]);
                }
            }
        }
        __syncthreads();
    }
}

// Launch: grid-stride over t·c, any grid. rows is a multiple of t (checked by the host).
extern "C" __global__ void embedding_backward_wpe_f32(float* __restrict__ dwpe,
                                                      const float* __restrict__ dout,
                                                      hr_u64 rows, hr_u32 t, hr_u32 c) {
    hr_u64 n = (hr_u64)t * c;
    hr_u64 batches = rows / t;
    HR_GRID_STRIDE(i, n) {
        float acc = dwpe[i];
        for (hr_u64 b = 0; b < batches; ++b) {
            acc = __fadd_rn(acc, dout[b * n + i]);
        }
        dwpe[i] = acc;
    }
}
