//! Memory, measured through the allocation hook: naive attention needs O(N²) extra bytes
//! (saved probabilities plus `dP`), flash attention O(N·head_dim), with the exact counts printed
//! (`cargo test -p headroom-attn --test memory -- --nocapture`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use headroom_attn::{
    AttentionBackend, AttentionConfig, DEFAULT_FLASH_BLOCK_K as BK, DEFAULT_FLASH_BLOCK_Q as BQ,
};
use headroom_tensor::{AllocEvent, AllocHook, Backend, BoxedError, Cpu, DType, MemoryCategory};

/// Live and peak bytes per category, plus the peak of workspace + saved activations together.
#[derive(Default)]
struct Peaks {
    state: Mutex<PeakState>,
}

#[derive(Default)]
struct PeakState {
    live: HashMap<MemoryCategory, usize>,
    peak: HashMap<MemoryCategory, usize>,
    peak_extra: usize,
}

impl AllocHook for Peaks {
    fn on_alloc(&self, e: &AllocEvent) -> Result<(), BoxedError> {
        let mut s = self.state.lock().unwrap();
        let live = s.live.entry(e.category).or_default();
        *live += e.bytes;
        let now = *live;
        let peak = s.peak.entry(e.category).or_default();
        *peak = (*peak).max(now);
        let extra = s.live.get(&MemoryCategory::Workspace).copied().unwrap_or(0)
            + s.live
                .get(&MemoryCategory::Activations)
                .copied()
                .unwrap_or(0);
        s.peak_extra = s.peak_extra.max(extra);
        Ok(())
    }
    fn on_free(&self, e: &AllocEvent) {
        let mut s = self.state.lock().unwrap();
        *s.live.entry(e.category).or_default() -= e.bytes;
    }
}

struct Measured {
    peak_workspace: usize,
    saved: usize,
    peak_extra: usize,
}

const THREADS: usize = 2;
const HEAD_DIM: usize = 64;

/// Forward + backward of one causal f32 head of `n` tokens; the inputs are `Data`, the results
/// `Other`, so `Workspace + Activations` is exactly what attention adds.
fn measure(config: AttentionConfig, n: usize) -> Measured {
    let hook = Arc::new(Peaks::default());
    let cpu = Cpu::with_threads(THREADS)
        .unwrap()
        .with_alloc_hook(hook.clone());
    let shape = [1, 1, n, HEAD_DIM];
    let data: Vec<f32> = (0..n * HEAD_DIM).map(|i| (i as f32 * 0.1).sin()).collect();
    let (q, k, v, d_out) = {
        let _data = MemoryCategory::Data.enter();
        let t = || cpu.upload(&data, shape).unwrap();
        (t(), t(), t(), t())
    };
    let fwd = cpu
        .attention_forward(&q, &k, &v, &config.causal(true))
        .unwrap();
    let saved = hook.state.lock().unwrap().live[&MemoryCategory::Activations];
    let grads = cpu.attention_backward(&q, &k, &v, &fwd, &d_out).unwrap();
    assert!(cpu
        .download::<f32>(&grads.dq)
        .unwrap()
        .iter()
        .all(|x| x.is_finite()));
    drop((fwd, grads));
    let s = hook.state.lock().unwrap();
    assert_eq!(
        s.live.get(&MemoryCategory::Workspace),
        Some(&0),
        "workspace is freed"
    );
    Measured {
        peak_workspace: s.peak.get(&MemoryCategory::Workspace).copied().unwrap_or(0),
        saved,
        peak_extra: s.peak_extra,
    }
}

/// The most flash may add for `n` tokens of one head: `lse` (4n), the backward's `dK`/`dV`
/// partials (2 × segments × n × head_dim f32, at most 8 segments) and one scratch of
/// `2·block_q·block_k + segment rows` floats per running thread.
fn flash_bound(n: usize) -> usize {
    4 * n + 2 * 8 * n * HEAD_DIM * 4 + THREADS * (2 * BQ * BK + n) * 4
}

#[test]
fn flash_extra_memory_is_linear_in_n_and_naive_is_quadratic() {
    let flash_1k = measure(AttentionConfig::flash(), 1024);
    let flash_2k = measure(AttentionConfig::flash(), 2048);
    let naive_1k = measure(AttentionConfig::naive(), 1024);
    let unsplit_1k = measure(AttentionConfig::flash().backward_segments(1), 1024);
    let unsplit_2k = measure(AttentionConfig::flash().backward_segments(1), 2048);
    let chunked_1k = measure(AttentionConfig::chunked(), 1024);
    let chunked_2k = measure(AttentionConfig::chunked(), 2048);
    for (name, n, m) in [
        ("flash", 1024, &flash_1k),
        ("flash", 2048, &flash_2k),
        ("flash/1seg", 1024, &unsplit_1k),
        ("flash/1seg", 2048, &unsplit_2k),
        ("naive", 1024, &naive_1k),
        ("chunked", 1024, &chunked_1k),
        ("chunked", 2048, &chunked_2k),
    ] {
        println!(
            "{name:10} N={n:5}: saved {:>10} B, peak workspace {:>11} B, peak extra {:>11} B",
            m.saved, m.peak_workspace, m.peak_extra
        );
    }
    // Flash saves exactly the f32 logsumexp: 4 bytes per query row.
    assert_eq!(flash_1k.saved, 4 * 1024);
    assert_eq!(flash_2k.saved, 4 * 2048);
    // Linear: doubling N at most doubles the extra bytes (plus per-thread scratch slack).
    assert!(flash_2k.peak_extra <= 2 * flash_1k.peak_extra + THREADS * 2 * BQ * BK * 4);
    assert!(flash_1k.peak_extra <= flash_bound(1024));
    assert!(flash_2k.peak_extra <= flash_bound(2048));
    // Naive keeps N² probabilities and materialises N² dP at the same time.
    assert_eq!(naive_1k.saved, 4 * 1024 * 1024 + 4 * 1024);
    assert!(naive_1k.peak_extra >= 2 * 4 * 1024 * 1024);
    // One backward segment (no dK/dV partials): only the logsumexp, `D` and per-thread tiles.
    let unsplit_bound = |n: usize| 4 * n + THREADS * (2 * BQ * BK + n) * 4;
    assert!(unsplit_1k.peak_extra <= unsplit_bound(1024));
    assert!(unsplit_2k.peak_extra <= unsplit_bound(2048));
    assert!(naive_1k.peak_extra > 50 * unsplit_1k.peak_extra);
    // Chunked: O(N·chunk) per thread; it saves only the logsumexp too.
    assert_eq!(chunked_1k.saved, 4 * 1024);
    assert!(chunked_2k.peak_extra <= 2 * chunked_1k.peak_extra + 4 * 4096);
}

#[test]
fn flash_at_16k_tokens_adds_megabytes_where_naive_needs_gigabytes() {
    let n = 16384;
    let m = measure(AttentionConfig::flash(), n);
    let naive_would_need = 2 * 4 * n * n;
    println!(
        "flash N={n}: saved {} B, peak workspace {} B, peak extra {} B ({:.1} MiB); naive needs ≥ {} B ({:.1} GiB)",
        m.saved,
        m.peak_workspace,
        m.peak_extra,
        m.peak_extra as f64 / (1 << 20) as f64,
        naive_would_need,
        naive_would_need as f64 / (1u64 << 30) as f64
    );
    assert_eq!(m.saved, 4 * n);
    assert!(m.peak_extra <= flash_bound(n));
    assert!(m.peak_extra * 16 < naive_would_need);
}

#[test]
fn bf16_inputs_are_staged_as_workspace_and_results_keep_the_callers_category() {
    let hook = Arc::new(Peaks::default());
    let cpu = Cpu::new().with_alloc_hook(hook.clone());
    let n = 100;
    let data: Vec<headroom_tensor::bf16> = (0..n * 16)
        .map(|i| headroom_tensor::bf16::from_f32((i as f32 * 0.3).cos()))
        .collect();
    let q = cpu.upload(&data, [1, 1, n, 16]).unwrap();
    let before = hook.state.lock().unwrap().live[&MemoryCategory::Other];
    let fwd = {
        let _acts = MemoryCategory::Parameters.enter();
        cpu.attention_forward(&q, &q, &q, &AttentionConfig::flash())
            .unwrap()
    };
    assert_eq!(fwd.output.dtype_size(), DType::BF16.size_in_bytes());
    let s = hook.state.lock().unwrap();
    assert_eq!(
        s.live[&MemoryCategory::Parameters],
        n * 16 * 2,
        "output in the caller's category"
    );
    assert_eq!(
        s.live[&MemoryCategory::Activations],
        n * 4,
        "only the logsumexp is saved"
    );
    assert_eq!(s.live[&MemoryCategory::Other], before);
    // Three f32 input copies + f32 output staging + tiles were workspace, now freed.
    assert!(s.peak[&MemoryCategory::Workspace] >= 4 * n * 16 * 4);
    assert_eq!(s.live[&MemoryCategory::Workspace], 0);
}

trait DTypeSize {
    fn dtype_size(&self) -> usize;
}
impl DTypeSize for headroom_tensor::CpuTensor {
    fn dtype_size(&self) -> usize {
        use headroom_tensor::Tensor;
        self.dtype().size_in_bytes()
    }
}

mod predicted_backward_workspace {
    use super::*;
    use headroom_attn::{cpu_backward_scratch_bytes, Algorithm, AttentionDims};
    use proptest::prelude::*;

    /// The backward's `Workspace` peak on `threads` threads, f32 inputs (no conversion copies),
    /// the gradients in the caller's category.
    fn backward_workspace(
        config: AttentionConfig,
        dims: [usize; 6],
        threads: usize,
    ) -> (usize, AttentionDims) {
        let [b, hq, hkv, nq, nk, hd] = dims;
        let hook = Arc::new(Peaks::default());
        let cpu = Cpu::with_threads(threads)
            .unwrap()
            .with_alloc_hook(hook.clone());
        let fill = |len: usize| {
            (0..len)
                .map(|i| (i as f32 * 0.37).sin())
                .collect::<Vec<_>>()
        };
        let (q, k, v, d_out) = {
            let _data = MemoryCategory::Data.enter();
            (
                cpu.upload(&fill(b * hq * nq * hd), [b, hq, nq, hd])
                    .unwrap(),
                cpu.upload(&fill(b * hkv * nk * hd), [b, hkv, nk, hd])
                    .unwrap(),
                cpu.upload(&fill(b * hkv * nk * hd), [b, hkv, nk, hd])
                    .unwrap(),
                cpu.upload(&fill(b * hq * nq * hd), [b, hq, nq, hd])
                    .unwrap(),
            )
        };
        let fwd = cpu.attention_forward(&q, &k, &v, &config).unwrap();
        {
            // Only the backward's own peak.
            let mut s = hook.state.lock().unwrap();
            let live = s.live.get(&MemoryCategory::Workspace).copied().unwrap_or(0);
            s.peak.insert(MemoryCategory::Workspace, live);
        }
        let _grads = cpu.attention_backward(&q, &k, &v, &fwd, &d_out).unwrap();
        let peak = hook.state.lock().unwrap().peak[&MemoryCategory::Workspace];
        (peak, fwd.dims)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// `cpu_backward_scratch_bytes` is the tracker's workspace peak of a backward, byte for
        /// byte: any algorithm, tile size, grouping, causality, segment count and thread count.
        #[test]
        fn the_prediction_is_the_measured_peak(
            b in 1usize..3,
            kv in 1usize..3,
            group in prop::sample::select(vec![1usize, 2, 3]),
            nq in 1usize..90,
            kv_extra in 0usize..20,
            hd in 1usize..20,
            algo in 0u8..3,
            tile in 1usize..40,
            tile_k in 1usize..40,
            causal in any::<bool>(),
            segments in prop::option::of(1usize..5),
            threads in 1usize..4,
        ) {
            let algorithm = match algo {
                0 => Algorithm::Naive,
                1 => Algorithm::Chunked { chunk_size: tile },
                _ => Algorithm::Flash { block_q: tile, block_k: tile_k },
            };
            // At least as many keys as queries (causal masks are bottom-right aligned).
            let nk = nq + kv_extra;
            let mut config = AttentionConfig::with_algorithm(algorithm).causal(causal);
            if let Some(s) = segments {
                config = config.backward_segments(s);
            }
            let (measured, dims) =
                backward_workspace(config, [b, kv * group, kv, nq, nk, hd], threads);
            prop_assert_eq!(
                measured as u64,
                cpu_backward_scratch_bytes(&dims, &config, threads),
                "{:?}", dims
            );
        }
    }
}

mod low_precision_inputs {
    use super::*;
    use headroom_attn::{
        cpu_backward_f32_workspace_bytes, cpu_forward_workspace_bytes, Algorithm, AttentionDims,
    };
    use headroom_tensor::{CpuTensor, Tensor};
    use proptest::prelude::*;

    fn bits(t: &CpuTensor) -> Vec<u32> {
        let cpu = Cpu::new();
        let mut f = cpu.zeros(t.shape().clone(), DType::F32).unwrap();
        cpu.cast(t, &mut f).unwrap();
        f.as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    fn to(cpu: &Cpu, t: &CpuTensor, dtype: DType) -> CpuTensor {
        let mut out = cpu.zeros(t.shape().clone(), dtype).unwrap();
        cpu.cast(t, &mut out).unwrap();
        out
    }

    /// Resets the workspace peak to what is live now.
    fn reset(hook: &Peaks) {
        let mut s = hook.state.lock().unwrap();
        let live = s.live.get(&MemoryCategory::Workspace).copied().unwrap_or(0);
        s.peak.insert(MemoryCategory::Workspace, live);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]
        /// bf16 or f16 inputs (the CPU backend's low precisions): the forward (heads widened a group at a time for chunked and flash)
        /// gives the output of the f32 forward on exact f32 copies, rounded; the f32-gradient
        /// backward gives that backward's gradients bit for bit (d_out f32 or low precision);
        /// and each call's workspace peak is what `cpu_forward_workspace_bytes` /
        /// `cpu_backward_f32_workspace_bytes` predict, byte for byte.
        #[test]
        fn grouped_heads_give_the_f32_bits_and_the_predicted_workspace(
            b in 1usize..3,
            kv in 1usize..4,
            group in prop::sample::select(vec![1usize, 2, 3]),
            nq in 1usize..70,
            kv_extra in 0usize..10,
            hd in 1usize..12,
            algo in 0u8..3,
            tile in 1usize..40,
            tile_k in 1usize..40,
            causal in any::<bool>(),
            segments in prop::option::of(1usize..5),
            threads in 1usize..4,
            d_out_low in any::<bool>(),
            low in prop::sample::select(vec![DType::BF16, DType::F16]),
        ) {
            let algorithm = match algo {
                0 => Algorithm::Naive,
                1 => Algorithm::Chunked { chunk_size: tile },
                _ => Algorithm::Flash { block_q: tile, block_k: tile_k },
            };
            let nk = nq + kv_extra;
            let hq = kv * group;
            let mut config = AttentionConfig::with_algorithm(algorithm).causal(causal);
            if let Some(s) = segments {
                config = config.backward_segments(s);
            }
            let hook = Arc::new(Peaks::default());
            let cpu = Cpu::with_threads(threads).unwrap().with_alloc_hook(hook.clone());
            let fill = |len: usize, s: f32| (0..len).map(|i| (i as f32 * s).sin()).collect::<Vec<_>>();
            let _data = MemoryCategory::Data.enter();
            let f32_of = |v: Vec<f32>, shape: [usize; 4]| {
                let t = cpu.upload(&v, shape).unwrap();
                // Exactly representable in the low dtype, so f32 and low hold the same values.
                to(&cpu, &to(&cpu, &t, low), DType::F32)
            };
            let (q, k, v, d_out) = (
                f32_of(fill(b * hq * nq * hd, 0.37), [b, hq, nq, hd]),
                f32_of(fill(b * kv * nk * hd, 0.53), [b, kv, nk, hd]),
                f32_of(fill(b * kv * nk * hd, 0.71), [b, kv, nk, hd]),
                f32_of(fill(b * hq * nq * hd, 0.29), [b, hq, nq, hd]),
            );
            let (ql, kl, vl) = (to(&cpu, &q, low), to(&cpu, &k, low), to(&cpu, &v, low));
            let d_out_l = if d_out_low { to(&cpu, &d_out, low) } else { to(&cpu, &d_out, DType::F32) };

            // The f32 reference, its backward reading the output as kept (rounded).
            let mut want_fwd = cpu.attention_forward(&q, &k, &v, &config).unwrap();
            let kept = to(&cpu, &want_fwd.output, low);
            let want_out = bits(&kept);
            want_fwd.output = to(&cpu, &kept, DType::F32);
            let want = cpu.attention_backward(&q, &k, &v, &want_fwd, &d_out).unwrap();

            reset(&hook);
            let fwd = cpu.attention_forward(&ql, &kl, &vl, &config).unwrap();
            let fwd_peak = hook.state.lock().unwrap().peak[&MemoryCategory::Workspace];
            prop_assert_eq!(fwd.output.dtype(), low);
            prop_assert_eq!(bits(&fwd.output), want_out);
            let dims: AttentionDims = fwd.dims;
            prop_assert_eq!(fwd_peak as u64, cpu_forward_workspace_bytes(&dims, &config, threads), "forward {:?}", dims);

            reset(&hook);
            let got = cpu.attention_backward_f32(&ql, &kl, &vl, fwd, &d_out_l).unwrap();
            let bwd_peak = hook.state.lock().unwrap().peak[&MemoryCategory::Workspace];
            for (g, w) in [(&got.dq, &want.dq), (&got.dk, &want.dk), (&got.dv, &want.dv)] {
                prop_assert_eq!(g.dtype(), DType::F32);
                prop_assert_eq!(bits(g), bits(w));
            }
            prop_assert_eq!(
                bwd_peak as u64,
                cpu_backward_f32_workspace_bytes(&dims, d_out_l.dtype(), &config, threads),
                "backward {:?}", dims
            );
        }
    }
}
