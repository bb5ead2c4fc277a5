// Runs headroom's flash attention kernels (forward, dot, dQ, dK/dV; bf16, head_dim 64 and 128)
// under host_emulator.h and compares them with a double-precision reference of attention and its
// gradients: causal and not, GQA, sequence tails, more queries than keys (rows that see no key)
// and empty sequences. Exit status 0 when every result is within tolerance.
//
// Built and run by kernels/tests/flash_emulator.rs:
//   c++ -std=c++20 -O2 -pthread -I<dir of flash_attn_common_emulated.cuh> -Ikernels/cu
//       -Ikernels/emu kernels/emu/flash_attn_check.cpp
#include "host_emulator.h"
#include "float_bits.cuh"
#define HR_EMULATOR_OPS
#include "host_emulator.h"
#include "flash_attn_common_emulated.cuh"
#include "flash_attn_fwd.cu"
#include "flash_attn_bwd.cu"
#include <algorithm>
#include <string>

static hr_u16 to_bf16(float v) { return hr_f32_to_bf16_bits(v); }
static float from_bf16(hr_u16 v) { return hr_bf16_bits_to_f32(v); }

struct Rng { uint64_t s; float next(float amp) { s = s * 6364136223846793005ull + 1442695040888963407ull; return ((s >> 40) / (float)(1 << 24) * 2 - 1) * amp; } };

template <typename T> struct Guarded {
    // Buffer with guard zones of 256 bytes on either side; registered for cp.async checks.
    std::vector<unsigned char> raw; size_t n;
    explicit Guarded(size_t n_) : raw(n_ * sizeof(T) + 512, 0xEE), n(n_) {
        g_buffers.push_back({raw.data() + 256, n * sizeof(T)});
    }
    T* data() { return (T*)(raw.data() + 256); }
    bool guards_intact() const {
        for (size_t i = 0; i < 256; ++i) if (raw[i] != 0xEE || raw[raw.size() - 1 - i] != 0xEE) return false;
        return true;
    }
};

struct Case { int B, Hq, Hkv, Nq, Nk, D; bool causal; };

static double maxabs(const std::vector<double>& v) { double m = 0; for (double x : v) m = std::max(m, std::fabs(x)); return m; }

// Same tolerances as headroom-attn's CUDA parity tests (tests/cuda.rs): max error relative to the
// largest reference magnitude, rms error relative to the reference's rms, both floored at 1e-3.
static bool compare(const char* what, const std::vector<double>& want, const float* got, size_t n,
                    double tol, double rms_tol) {
    double m = maxabs(want), worst = 0; size_t at = 0;
    for (size_t i = 0; i < n; ++i) {
        double e = std::isfinite(got[i]) ? std::fabs(got[i] - want[i]) : INFINITY;
        if (!(e <= worst)) { worst = e; at = i; }
    }
    double se = 0, sr = 0;
    for (size_t i = 0; i < n; ++i) { se += (got[i] - want[i]) * (got[i] - want[i]); sr += want[i] * want[i]; }
    double rms_err = n ? std::sqrt(se / n) : 0, rms_ref = n ? std::sqrt(sr / n) : 0;
    double rms_rel = rms_err / std::max(rms_ref, 1e-3);
    bool ok = worst <= tol * std::max(m, 1e-3) && rms_err <= rms_tol * std::max(rms_ref, 1e-3);
    printf("    %-6s max|ref| %.3e  max err %.3e (%.2e rel) at %zu, rms rel %.2e %s\n", what, m, worst, worst / std::max(m, 1e-30), at, rms_rel, ok ? "ok" : "FAIL");
    return ok;
}

static bool run_case(const Case& c) {
    const int B = c.B, Hq = c.Hq, Hkv = c.Hkv, Nq = c.Nq, Nk = c.Nk, D = c.D, G = Hq / Hkv;
    printf("case B=%d Hq=%d Hkv=%d Nq=%d Nk=%d D=%d causal=%d\n", B, Hq, Hkv, Nq, Nk, D, c.causal);
    size_t nq = (size_t)B * Hq * Nq * D, nk = (size_t)B * Hkv * Nk * D, rows = (size_t)B * Hq * Nq;
    Guarded<hr_u16> q(nq), k(nk), v(nk), dout(nq), out(nq), dq(nq), dk(nk), dv(nk);
    Guarded<float> lse(rows), dot(rows);
    Rng r{(uint64_t)(Nq * 131 + Nk * 7 + D + c.causal)};
    for (size_t i = 0; i < nq; ++i) q.data()[i] = to_bf16(r.next(1.5));
    for (size_t i = 0; i < nk; ++i) k.data()[i] = to_bf16(r.next(1.5));
    for (size_t i = 0; i < nk; ++i) v.data()[i] = to_bf16(r.next(1.0));
    for (size_t i = 0; i < nq; ++i) dout.data()[i] = to_bf16(r.next(1.0));
    for (size_t i = 0; i < nq; ++i) { out.data()[i] = 0x7fc1; dq.data()[i] = 0x7fc1; }  // NaN sentinels
    for (size_t i = 0; i < nk; ++i) { dk.data()[i] = 0x7fc1; dv.data()[i] = 0x7fc1; }
    for (size_t i = 0; i < rows; ++i) { lse.data()[i] = NAN; dot.data()[i] = NAN; }

    const float scale = 1.0f / std::sqrt((float)D);
    const float scale_log2 = scale * 1.4426950408889634f;
    // Reference, double.
    std::vector<double> ro(nq, 0), rl(rows), rdq(nq, 0), rdk(nk, 0), rdv(nk, 0);
    auto Q = [&](int b, int h, int i, int d) { return (double)from_bf16(q.data()[(((size_t)b * Hq + h) * Nq + i) * D + d]); };
    auto dO = [&](int b, int h, int i, int d) { return (double)from_bf16(dout.data()[(((size_t)b * Hq + h) * Nq + i) * D + d]); };
    auto K = [&](int b, int h, int j, int d) { return (double)from_bf16(k.data()[(((size_t)b * Hkv + h) * Nk + j) * D + d]); };
    auto V = [&](int b, int h, int j, int d) { return (double)from_bf16(v.data()[(((size_t)b * Hkv + h) * Nk + j) * D + d]); };
    for (int b = 0; b < B; ++b) for (int h = 0; h < Hq; ++h) {
        int kh = h / G;
        for (int i = 0; i < Nq; ++i) {
            std::vector<double> s(Nk), p(Nk, 0), dp(Nk, 0);
            double m = -INFINITY;
            for (int j = 0; j < Nk; ++j) {
                bool vis = !c.causal || (long)j <= (long)i + Nk - Nq;
                if (!vis) { s[j] = -INFINITY; continue; }
                double acc = 0; for (int d = 0; d < D; ++d) acc += Q(b, h, i, d) * K(b, kh, j, d);
                s[j] = acc * scale; m = std::max(m, s[j]);
            }
            size_t row = ((size_t)b * Hq + h) * Nq + i;
            double l = 0;
            if (m != -INFINITY) for (int j = 0; j < Nk; ++j) { p[j] = s[j] == -INFINITY ? 0 : std::exp(s[j] - m); l += p[j]; }
            rl[row] = l > 0 ? m + std::log(l) : -INFINITY;
            for (int j = 0; j < Nk; ++j) if (l > 0) p[j] /= l;
            for (int d = 0; d < D; ++d) { double acc = 0; for (int j = 0; j < Nk; ++j) acc += p[j] * V(b, kh, j, d); ro[row * D + d] = acc; }
            double Dd = 0;
            for (int j = 0; j < Nk; ++j) { double acc = 0; for (int d = 0; d < D; ++d) acc += dO(b, h, i, d) * V(b, kh, j, d); dp[j] = acc; Dd += p[j] * acc; }
            for (int j = 0; j < Nk; ++j) {
                double ds = p[j] * (dp[j] - Dd);
                for (int d = 0; d < D; ++d) {
                    rdq[row * D + d] += scale * ds * K(b, kh, j, d);
                    size_t kr = (((size_t)b * Hkv + kh) * Nk + j) * D + d;
                    rdk[kr] += scale * ds * Q(b, h, i, d);
                    rdv[kr] += p[j] * dO(b, h, i, d);
                }
            }
        }
    }
    // Launch configurations as the kernels' header comments (and headroom-attn) give them.
    const size_t row_bytes = (size_t)(D + HR_FLASH_SMEM_PAD) * 2;
    unsigned fwd_blocks = (unsigned)(((Nq + HR_FLASH_FWD_BLOCK_Q - 1) / HR_FLASH_FWD_BLOCK_Q) * B * Hq);
    size_t fwd_smem = (HR_FLASH_FWD_BLOCK_Q + 2 * HR_FLASH_FWD_BLOCK_K) * row_bytes;
    unsigned causal = c.causal;
    if (fwd_blocks) emu_launch(fwd_blocks, HR_FLASH_THREADS, fwd_smem, [&] {
        if (D == 64) flash_attn_fwd_bf16_d64(q.data(), k.data(), v.data(), out.data(), lse.data(), Nq, Nk, Hq, Hkv, scale_log2, causal);
        else flash_attn_fwd_bf16_d128(q.data(), k.data(), v.data(), out.data(), lse.data(), Nq, Nk, Hq, Hkv, scale_log2, causal);
    });
    // Backward kernels.
    if (rows) {
        // A small grid, so the grid-stride loop runs more than once per warp.
        unsigned blocks = (unsigned)std::min<size_t>((rows + 7) / 8, 3);
        emu_launch(blocks, HR_BLOCK_THREADS, 0, [&] { flash_attn_bwd_dot_bf16(out.data(), dout.data(), dot.data(), rows, D); });
    }
    unsigned dq_blocks = (unsigned)(((Nq + HR_FLASH_DQ_BLOCK_Q - 1) / HR_FLASH_DQ_BLOCK_Q) * B * Hq);
    size_t dq_smem = (2 * HR_FLASH_DQ_BLOCK_Q + HR_FLASH_DQ_KV_STAGES * 2 * HR_FLASH_DQ_BLOCK_K) * row_bytes;
    if (dq_blocks) emu_launch(dq_blocks, HR_FLASH_THREADS, dq_smem, [&] {
        if (D == 64) flash_attn_bwd_dq_bf16_d64(q.data(), k.data(), v.data(), dout.data(), lse.data(), dot.data(), dq.data(), Nq, Nk, Hq, Hkv, scale, scale_log2, causal);
        else flash_attn_bwd_dq_bf16_d128(q.data(), k.data(), v.data(), dout.data(), lse.data(), dot.data(), dq.data(), Nq, Nk, Hq, Hkv, scale, scale_log2, causal);
    });
    const int bq = HR_FLASH_DKDV_BLOCK_Q(D);
    unsigned dkdv_blocks = (unsigned)(((Nk + HR_FLASH_DKDV_BLOCK_K - 1) / HR_FLASH_DKDV_BLOCK_K) * B * Hkv);
    size_t dkdv_smem = (2 * HR_FLASH_DKDV_BLOCK_K + HR_FLASH_DKDV_Q_STAGES * 2 * bq) * row_bytes +
                       HR_FLASH_DKDV_Q_STAGES * 2 * bq * 4;
    if (dkdv_blocks) emu_launch(dkdv_blocks, HR_FLASH_THREADS, dkdv_smem, [&] {
        if (D == 64) flash_attn_bwd_dkdv_bf16_d64(q.data(), k.data(), v.data(), dout.data(), lse.data(), dot.data(), dk.data(), dv.data(), Nq, Nk, Hq, Hkv, scale, scale_log2, causal);
        else flash_attn_bwd_dkdv_bf16_d128(q.data(), k.data(), v.data(), dout.data(), lse.data(), dot.data(), dk.data(), dv.data(), Nq, Nk, Hq, Hkv, scale, scale_log2, causal);
    });

    auto widen = [](Guarded<hr_u16>& g) { std::vector<float> f(g.n); for (size_t i = 0; i < g.n; ++i) f[i] = from_bf16(g.data()[i]); return f; };
    bool ok = true;
    auto fo = widen(out), fdq = widen(dq), fdk = widen(dk), fdv = widen(dv);
    ok &= compare("out", ro, fo.data(), nq, 1e-2, 6e-3);
    // lse: -inf where due, else abs 1e-3.
    {
        double worst = 0; bool inf_ok = true;
        for (size_t i = 0; i < rows; ++i) {
            if (rl[i] == -INFINITY) { inf_ok &= lse.data()[i] == -INFINITY; continue; }
            double e = std::isfinite(lse.data()[i]) ? std::fabs(lse.data()[i] - rl[i]) : INFINITY;
            worst = std::max(worst, e);
        }
        bool l_ok = inf_ok && worst <= 1e-3;
        printf("    lse    max err %.3e, -inf rows %s %s\n", worst, inf_ok ? "match" : "DIFFER", l_ok ? "ok" : "FAIL");
        ok &= l_ok;
    }
    ok &= compare("dq", rdq, fdq.data(), nq, 2e-2, 1e-2);
    ok &= compare("dk", rdk, fdk.data(), nk, 2e-2, 1e-2);
    ok &= compare("dv", rdv, fdv.data(), nk, 2e-2, 1e-2);
    bool guards = q.guards_intact() && k.guards_intact() && v.guards_intact() && dout.guards_intact() && out.guards_intact() && dq.guards_intact() && dk.guards_intact() && dv.guards_intact() && lse.guards_intact() && dot.guards_intact();
    if (!guards) printf("    GUARD ZONE OVERWRITTEN\n");
    ok &= guards;
    g_buffers.clear();
    return ok;
}

int main(int argc, char** argv) {
    std::vector<Case> cases = {
        {1, 1, 1, 1, 1, 64, false},
        {1, 2, 1, 65, 65, 64, true},
        {1, 2, 2, 64, 64, 64, false},
        {1, 2, 1, 63, 130, 128, false},
        {1, 2, 1, 130, 63, 128, true},
        {1, 4, 2, 70, 3, 64, true},
        {1, 2, 1, 3, 70, 64, true},
        {2, 2, 1, 129, 129, 128, true},
        {1, 1, 1, 5, 0, 64, false},
        {1, 1, 1, 0, 5, 64, true},
    };
    // `long`: several key and query tiles per block in both directions.
    if (argc > 1 && std::string(argv[1]) == "long") cases = {
        {1, 4, 2, 300, 300, 64, true},
        {1, 2, 1, 300, 300, 128, false},
        {1, 2, 2, 200, 333, 128, true},
    };
    bool all = true;
    for (auto& c : cases) all &= run_case(c);
    printf("%s (%ld emulator check failures)\n", all && g_errors == 0 ? "ALL OK" : "FAILURES", (long)g_errors);
    return all && g_errors == 0 ? 0 : 1;
}
