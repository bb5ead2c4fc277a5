//! headroom-profiler: cost of the memory tracker per allocation + free pair, against a no-op
//! hook (the price of having any hook) and no hook at all, with and without a recording
//! timeline, and with two threads contending for one tracker.
//!
//! Each iteration registers one `TrackedAllocation` (what a backend does per tensor) and drops
//! it, so the figure is the whole per-tensor bookkeeping cost: the allocation id, the hook's
//! `on_alloc` and `on_free`, and the `Arc` clone the token keeps.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use headroom_profiler::{label, MemoryTracker};
use headroom_tensor::{
    AllocEvent, AllocHook, BoxedError, DType, Device, MemoryCategory, TrackedAllocation,
};

/// Accepts everything and records nothing: the floor any hook pays.
struct NoopHook;

impl AllocHook for NoopHook {
    fn on_alloc(&self, event: &AllocEvent) -> Result<(), BoxedError> {
        black_box(event);
        Ok(())
    }
    fn on_free(&self, event: &AllocEvent) {
        black_box(event);
    }
}

fn pair(hook: Option<&Arc<dyn AllocHook>>) {
    let allocation =
        TrackedAllocation::register(hook, 4096, DType::F32, Device::Cpu).expect("no budget set");
    drop(black_box(allocation));
}

/// Timeline events recorded before the timeline is restarted (untimed), so a long measurement
/// does not grow one vector without bound; 1 Mi events × 56 B is the size a long training
/// run's timeline reaches, so the growth cost measured is realistic.
const TIMELINE_CHUNK: u64 = 1 << 20;

fn alloc_free_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("profiler/alloc_free_pair");
    group.throughput(Throughput::Elements(1));
    let size = "4KiB";
    let _category = MemoryCategory::Activations.enter();
    let _label = label("block 0 / attn");

    group.bench_function(BenchmarkId::new("baseline_no_hook", size), |b| {
        b.iter(|| pair(None))
    });
    let noop: Arc<dyn AllocHook> = Arc::new(NoopHook);
    group.bench_function(BenchmarkId::new("baseline_noop_hook", size), |b| {
        b.iter(|| pair(Some(&noop)))
    });

    let tracker = Arc::new(MemoryTracker::new());
    // A realistic background: a few thousand live tensors in the outstanding table.
    let hook: Arc<dyn AllocHook> = tracker.clone();
    let background: Vec<_> = (0..4096)
        .map(|_| TrackedAllocation::register(Some(&hook), 64, DType::F32, Device::Cpu))
        .collect();
    group.bench_function(BenchmarkId::new("headroom", size), |b| {
        b.iter(|| pair(Some(&hook)))
    });

    group.bench_function(BenchmarkId::new("headroom_timeline", size), |b| {
        b.iter_custom(|iters| {
            let mut elapsed = Duration::ZERO;
            let mut done = 0;
            while done < iters {
                // Each pair records two events.
                let n = (iters - done).min(TIMELINE_CHUNK / 2);
                tracker.start_timeline();
                let start = Instant::now();
                for _ in 0..n {
                    pair(Some(&hook));
                }
                elapsed += start.elapsed();
                done += n;
            }
            black_box(tracker.stop_timeline());
            elapsed
        })
    });

    // Two threads sharing one tracker (time per pair per thread while both run).
    group.bench_function(BenchmarkId::new("headroom_2threads", size), |b| {
        b.iter_custom(|iters| {
            std::thread::scope(|s| {
                let workers: Vec<_> = (0..2)
                    .map(|_| {
                        let hook = hook.clone();
                        s.spawn(move || {
                            let start = Instant::now();
                            for _ in 0..iters {
                                pair(Some(&hook));
                            }
                            start.elapsed()
                        })
                    })
                    .collect();
                workers
                    .into_iter()
                    .map(|w| w.join().expect("worker panicked"))
                    .max()
                    .unwrap_or_default()
            })
        })
    });
    group.finish();
    drop(background);
}

criterion_group!(benches, alloc_free_pair);
criterion_main!(benches);
