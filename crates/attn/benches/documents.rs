//! Document-masked (packed-sequence) causal flash attention on the CPU, forward + backward:
//! f32, batch 1, 8 heads, head_dim 64, N = 2048 tokens, packed as one document (plain causal
//! work through the masked path), 8 equal documents and 32. Packing `k` equal documents does
//! about `1/k` of one document's score work (each key tile is visited only by the query tiles
//! of its own document), so the times should fall nearly as fast until per-tile overhead shows.
//!
//! Criterion group `attn_documents/fwd_bwd`, function `flash`, parameter `plain` (no mask: the
//! baseline) and `docs<k>`.
//! Run with `cargo bench -p headroom-attn --bench documents`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode};
use headroom_attn::{AttentionBackend, AttentionConfig, DocumentMask};
use headroom_tensor::{Backend, Cpu, CpuTensor};

const HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const SEQ: usize = 2048;
const DOCUMENTS: [usize; 3] = [1, 8, 32];

struct Inputs {
    q: CpuTensor,
    k: CpuTensor,
    v: CpuTensor,
    d_out: CpuTensor,
}

fn inputs(cpu: &Cpu) -> Inputs {
    let shape = [1, HEADS, SEQ, HEAD_DIM];
    let len = HEADS * SEQ * HEAD_DIM;
    let mut state = 0x2545_f491u32;
    let mut values = || -> Vec<f32> {
        (0..len)
            .map(|_| {
                // xorshift: the same inputs on every run, no rand dependency.
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    };
    let mut t = || cpu.upload(&values(), shape).expect("upload");
    Inputs {
        q: t(),
        k: t(),
        v: t(),
        d_out: t(),
    }
}

/// `documents` equal documents packed into one row of `SEQ` positions.
fn mask(documents: usize) -> DocumentMask {
    let len = SEQ / documents;
    let positions: Vec<u32> = (0..SEQ).map(|i| (i % len) as u32).collect();
    DocumentMask::from_positions(1, SEQ, &positions).expect("mask")
}

fn fwd_bwd(c: &mut Criterion) {
    let cpu = Cpu::new();
    let x = inputs(&cpu);
    let config = AttentionConfig::flash().causal(true);
    let mut group = c.benchmark_group("attn_documents/fwd_bwd");
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(500));
    // The baseline: plain causal attention, no mask at all.
    group.bench_function(BenchmarkId::new("flash", "plain"), |b| {
        b.iter(|| {
            let fwd = cpu
                .attention_forward(&x.q, &x.k, &x.v, &config)
                .expect("forward");
            let g = cpu
                .attention_backward(&x.q, &x.k, &x.v, &fwd, &x.d_out)
                .expect("backward");
            black_box((fwd, g));
        })
    });
    for documents in DOCUMENTS {
        let mask = mask(documents);
        group.bench_function(BenchmarkId::new("flash", format!("docs{documents}")), |b| {
            b.iter(|| {
                let fwd = cpu
                    .attention_forward_documents(&x.q, &x.k, &x.v, &config, &mask)
                    .expect("forward");
                let g = cpu
                    .attention_backward(&x.q, &x.k, &x.v, &fwd, &x.d_out)
                    .expect("backward");
                black_box((fwd, g));
            })
        });
    }
    group.finish();
}

criterion_group!(benches, fwd_bwd);
criterion_main!(benches);
