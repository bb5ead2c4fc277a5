// A host emulator of the CUDA features headroom's flash attention kernels use, so the kernels'
// own source runs on a CPU (kernels/tests/flash_emulator.rs compiles and runs it with a C++20
// compiler). Not a general CUDA emulator: exactly what flash_attn_*.cu need.
//
// - Every thread of a block is a std::thread; __syncthreads and the warp-collective
//   instructions (mma.sync, ldmatrix, shfl) are real barriers, so the kernels' synchronisation
//   is exercised, not assumed. Blocks run one after another.
// - mma.sync.m16n8k16 and ldmatrix(.trans) are implemented from the PTX ISA's fragment layouts
//   (written out in flash_attn_common.cuh), independently of how the kernels index them: a
//   kernel that misplaces a fragment computes the wrong numbers here too.
// - cp.async copies are deferred until the issuing thread's cp.async.wait_group retires their
//   commit group (wait_group 1 leaves the newest group in flight), so reading a tile before
//   waiting for it sees stale data; sources and destinations are bounds- and
//   alignment-checked (so are ldmatrix rows), and shared memory starts as garbage.
// - The test replaces each inline-PTX function body of flash_attn_common.cuh with a call to the
//   emu_* function here; everything else in the kernels is compiled verbatim.
//
// Include order: this file, float_bits.cuh, the emulated common header, the kernel sources.

#ifndef HR_EMULATOR_OPS
#include <atomic>
#include <barrier>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(x)
#define __restrict__ __restrict
#define __align__(x) alignas(x)
#define __shared__

static inline float __int_as_float(int v) { float f; memcpy(&f, &v, 4); return f; }
static inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
static inline unsigned __float_as_uint(float v) { unsigned u; memcpy(&u, &v, 4); return u; }
static inline int __clz(unsigned v) { return v == 0 ? 32 : __builtin_clz(v); }
#include <math.h>

static std::barrier<>* g_block_barrier;
static std::barrier<>* g_warp_barrier[32];
static unsigned char* g_smem;
static size_t g_smem_bytes;
static std::atomic<long> g_errors{0};
#define EMU_CHECK(c, ...) do { if (!(c)) { if (g_errors++ < 10) { fprintf(stderr, "EMU CHECK FAILED %s: ", #c); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); } } } while (0)

static inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
static inline void warp_sync() { g_warp_barrier[threadIdx.x / 32]->arrive_and_wait(); }

struct WarpScratch { uint32_t a[32][4]; uint32_t b[32][2]; uint32_t addr[32]; float f[32]; };
static WarpScratch g_scratch[32];

static inline float __shfl_xor_sync(unsigned mask, float v, int m) {
    EMU_CHECK(mask == 0xffffffffu, "mask");
    auto& s = g_scratch[threadIdx.x / 32];
    unsigned l = threadIdx.x % 32;
    s.f[l] = v; warp_sync();
    float r = s.f[l ^ m]; warp_sync();
    return r;
}

#else
// Part two, after float_bits.cuh.
// Warp-collective tensor-core instructions on the host (after float_bits.cuh).
static inline float emu_half(uint32_t reg, int half, bool f16) {
    hr_u16 bits = (hr_u16)(half ? (reg >> 16) : (reg & 0xffffu));
    return f16 ? hr_f16_bits_to_f32(bits) : hr_bf16_bits_to_f32(bits);
}

static inline void emu_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool f16) {
    auto& s = g_scratch[threadIdx.x / 32];
    unsigned l = threadIdx.x % 32;
    for (int i = 0; i < 4; ++i) s.a[l][i] = a[i];
    s.b[l][0] = b0; s.b[l][1] = b1;
    warp_sync();
    unsigned g = l / 4, t = l % 4;
    for (int e = 0; e < 4; ++e) {
        int r = g + 8 * (e >> 1), c = 2 * t + (e & 1);
        float sum = d[e];
        for (int k = 0; k < 16; ++k) {
            unsigned alane = (r % 8) * 4 + (k % 8) / 2;
            int areg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
            unsigned blane = c * 4 + (k % 8) / 2;
            int breg = k >= 8 ? 1 : 0;
            sum += emu_half(s.a[alane][areg], k % 2, f16) * emu_half(s.b[blane][breg], k % 2, f16);
        }
        d[e] = sum;
    }
    warp_sync();
}

static inline hr_u32 emu_smem_addr(const void* p) {
    const unsigned char* c = (const unsigned char*)p;
    EMU_CHECK(c >= g_smem && c < g_smem + g_smem_bytes, "smem pointer outside the block's %zu bytes", g_smem_bytes);
    return (hr_u32)(c - g_smem);
}

static inline void emu_ldmatrix(hr_u32 (&r)[4], hr_u32 addr, bool trans) {
    auto& s = g_scratch[threadIdx.x / 32];
    unsigned l = threadIdx.x % 32;
    EMU_CHECK(addr % 16 == 0, "ldmatrix row address %u not 16-byte aligned", addr);
    EMU_CHECK(addr + 16 <= g_smem_bytes, "ldmatrix row %u past shared memory (%zu)", addr, g_smem_bytes);
    s.addr[l] = addr;
    warp_sync();
    auto elem = [&](int m, int row, int col) -> hr_u32 {
        hr_u32 a = s.addr[8 * m + row];
        hr_u16 v; memcpy(&v, g_smem + a + 2 * col, 2); return v;
    };
    for (int m = 0; m < 4; ++m) {
        if (!trans) r[m] = elem(m, l / 4, 2 * (l % 4)) | (elem(m, l / 4, 2 * (l % 4) + 1) << 16);
        else r[m] = elem(m, 2 * (l % 4), l / 4) | (elem(m, 2 * (l % 4) + 1, l / 4) << 16);
    }
    warp_sync();
}

extern thread_local hr_u16* hr_flash_smem;
// Each copy is tagged with the commit group it will belong to (the number of commits before it).
struct PendingCopy { hr_u32 smem; const void* gmem; bool valid; long group; };
thread_local std::vector<PendingCopy> t_pending;
thread_local long t_committed = 0;
// Registered global buffers, to bounds-check cp.async sources.
struct Buffer { const unsigned char* base; size_t bytes; };
static std::vector<Buffer> g_buffers;
static inline void emu_cp_async(hr_u32 smem, const void* gmem, bool valid) {
    EMU_CHECK(smem % 16 == 0 && smem + 16 <= g_smem_bytes, "cp.async dst %u", smem);
    if (valid) {
        EMU_CHECK(((uintptr_t)gmem) % 16 == 0, "cp.async src not 16-byte aligned");
        bool inside = false;
        for (auto& b : g_buffers) {
            const unsigned char* p = (const unsigned char*)gmem;
            if (p >= b.base && p + 16 <= b.base + b.bytes) inside = true;
        }
        EMU_CHECK(inside, "cp.async reads outside every buffer");
    }
    t_pending.push_back({smem, gmem, valid, t_committed});
}
static inline void emu_cp_async_commit() { ++t_committed; }
// cp.async.wait_group n: every committed group but the n most recent has landed. Copies not yet
// committed, and the n most recent groups, stay in flight (their data is not in shared memory).
static inline void emu_cp_async_wait(long n) {
    std::vector<PendingCopy> still;
    for (auto& c : t_pending) {
        if (c.group < t_committed - n) {
            if (c.valid) memcpy(g_smem + c.smem, c.gmem, 16);
            else memset(g_smem + c.smem, 0, 16);
        } else {
            still.push_back(c);
        }
    }
    t_pending.swap(still);
}

// Run `kernel` on a grid of `blocks` blocks of `threads` threads with `smem` bytes.
static void emu_launch(unsigned blocks, unsigned threads, size_t smem, const std::function<void()>& kernel) {
    gridDim = dim3{blocks, 1, 1};
    blockDim = dim3{threads, 1, 1};
    std::vector<unsigned char> shared(smem + 64);
    for (unsigned b = 0; b < blocks; ++b) {
        // Garbage in shared memory, so nothing relies on zeros it did not write.
        for (auto& x : shared) x = 0xA5;
        g_smem = shared.data();
        g_smem_bytes = smem;
        std::barrier<> block_barrier(threads);
        for (unsigned w = 0; w < threads / 32; ++w) { g_warp_barrier[w] = new std::barrier<>(32); }
        g_block_barrier = &block_barrier;
        std::vector<std::thread> pool;
        for (unsigned t = 0; t < threads; ++t) {
            pool.emplace_back([&, t, b] {
                threadIdx = dim3{t, 0, 0};
                blockIdx = dim3{b, 0, 0};
                hr_flash_smem = (hr_u16*)g_smem;
                kernel();
                EMU_CHECK(t_pending.empty(), "block %u thread %u exits with pending cp.async", b, t);
                t_pending.clear();
                t_committed = 0;
            });
        }
        for (auto& th : pool) th.join();
        for (unsigned w = 0; w < threads / 32; ++w) delete g_warp_barrier[w];
    }
}
#endif
