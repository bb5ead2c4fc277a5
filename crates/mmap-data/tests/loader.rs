//! The loader against a plain reference; resume; buffer reuse and memory accounting.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use headroom_mmap_data::{
    fill_batch, BatchBuffer, Loader, LoaderConfig, LoaderState, OutputType, SamplerConfig,
    SamplingMode, Shard, TokenDataset, TokenType, WindowSampler,
};
use headroom_tensor::{AllocEvent, AllocHook, BoxedError, MemoryCategory};
use proptest::prelude::*;

fn data(n: usize, seed: u32) -> Arc<TokenDataset> {
    let tokens: Vec<u32> = (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761) ^ seed) % 50_000)
        .collect();
    Arc::new(
        TokenDataset::from_tokens(&tokens, TokenType::U16)
            .unwrap()
            .with_vocab_size(50_000),
    )
}

fn sampler(mode: SamplingMode, seq_len: u64, seed: u64) -> SamplerConfig {
    SamplerConfig {
        mode,
        seq_len,
        seed,
        shard: Shard::SINGLE,
    }
}

fn mode() -> impl Strategy<Value = SamplingMode> {
    prop_oneof![
        Just(SamplingMode::RandomWindows),
        Just(SamplingMode::EpochWindows)
    ]
}

/// Batch `b` computed token by token from the dataset and the sampler.
fn reference_batch(
    ds: &TokenDataset,
    s: &WindowSampler,
    b: u64,
    batch: usize,
) -> (Vec<u64>, Vec<u64>) {
    let t = s.config().seq_len;
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for row in 0..batch as u64 {
        let w = s.window(b * batch as u64 + row);
        for c in 0..t {
            x.push(ds.token(w.segment, w.start + c).unwrap() as u64);
            y.push(ds.token(w.segment, w.start + c + 1).unwrap() as u64);
        }
    }
    (x, y)
}

fn as_u64(b: &BatchBuffer) -> (Vec<u64>, Vec<u64>) {
    match b.output_type() {
        OutputType::U32 => (
            b.inputs_u32().unwrap().iter().map(|&v| v as u64).collect(),
            b.targets_u32().unwrap().iter().map(|&v| v as u64).collect(),
        ),
        OutputType::I64 => (
            b.inputs_i64().unwrap().iter().map(|&v| v as u64).collect(),
            b.targets_i64().unwrap().iter().map(|&v| v as u64).collect(),
        ),
    }
}

fn loader_config(batch: usize, output: OutputType, workers: usize, buffers: usize) -> LoaderConfig {
    LoaderConfig {
        batch_size: batch,
        output,
        workers,
        max_buffered_batches: buffers,
        max_buffered_bytes: None,
        documents: None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn loader_matches_reference_for_any_worker_count(
        mode in mode(),
        seq_len in 1u64..40,
        // Past 64 rows too: the copy computes windows 64 rows at a time.
        batch in prop_oneof![1usize..6, 60usize..140],
        workers in 0usize..4,
        i64_out in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let ds = data(3000, seed as u32);
        let output = if i64_out { OutputType::I64 } else { OutputType::U32 };
        let cfg = sampler(mode, seq_len, seed);
        let s = WindowSampler::new(&ds, cfg.clone()).unwrap();
        let mut loader = Loader::new(Arc::clone(&ds), cfg, loader_config(batch, output, workers, workers.max(1) * 2), None).unwrap();
        for b in 0..12u64 {
            let got = loader.next_batch().unwrap();
            prop_assert_eq!(got.index(), b);
            prop_assert_eq!(as_u64(&got), reference_batch(&ds, &s, b, batch));
        }
    }

    #[test]
    fn resume_continues_the_identical_stream(
        mode in mode(),
        seq_len in 1u64..24,
        batch in 1usize..5,
        workers_before in 0usize..3,
        workers_after in 0usize..4,
        stop_at in 0u64..40,
        seed in any::<u64>(),
    ) {
        let ds = data(1500, 9);
        let cfg = sampler(mode, seq_len, seed);
        let mut straight = Loader::new(Arc::clone(&ds), cfg.clone(), loader_config(batch, OutputType::U32, 1, 3), None).unwrap();
        let expected: Vec<_> = (0..stop_at + 10).map(|_| as_u64(&straight.next_batch().unwrap())).collect();

        let mut first = Loader::new(Arc::clone(&ds), cfg, loader_config(batch, OutputType::U32, workers_before, 4), None).unwrap();
        for b in 0..stop_at {
            prop_assert_eq!(&as_u64(&first.next_batch().unwrap()), &expected[b as usize]);
        }
        let saved = serde_json::to_string(&first.state()).unwrap();
        drop(first);
        let state: LoaderState = serde_json::from_str(&saved).unwrap();
        prop_assert_eq!(state.next_batch, stop_at);
        let mut resumed = Loader::resume(Arc::clone(&ds), &state, loader_config(batch, OutputType::U32, workers_after, 4), None).unwrap();
        for b in stop_at..stop_at + 10 {
            prop_assert_eq!(&as_u64(&resumed.next_batch().unwrap()), &expected[b as usize]);
        }
    }
}

#[test]
fn epoch_is_reported_and_follows_the_sampler() {
    let ds = data(1001, 1); // 100 windows of 10
    let mut loader = Loader::new(
        Arc::clone(&ds),
        sampler(SamplingMode::EpochWindows, 10, 3),
        loader_config(10, OutputType::I64, 2, 2),
        None,
    )
    .unwrap();
    let mut targets = std::collections::BTreeSet::new();
    for b in 0..10 {
        let batch = loader.next_batch().unwrap();
        assert_eq!(batch.epoch(), 0, "batch {b}");
        for row in 0..10 {
            targets.insert(batch.target(row, 0).unwrap());
        }
    }
    assert_eq!(loader.state().epoch, 1);
    assert_eq!(loader.next_batch().unwrap().epoch(), 1);
}

#[test]
fn resume_refuses_other_data_or_batch_size() {
    let ds = data(500, 1);
    let loader = Loader::new(
        Arc::clone(&ds),
        sampler(SamplingMode::EpochWindows, 8, 3),
        loader_config(4, OutputType::I64, 0, 1),
        None,
    )
    .unwrap();
    let state = loader.state();
    let other = data(501, 1);
    assert!(Loader::resume(other, &state, loader_config(4, OutputType::I64, 0, 1), None).is_err());
    assert!(Loader::resume(
        Arc::clone(&ds),
        &state,
        loader_config(5, OutputType::I64, 0, 1),
        None
    )
    .is_err());
    assert!(Loader::resume(ds, &state, loader_config(4, OutputType::I64, 0, 1), None).is_ok());
}

#[derive(Default)]
struct Counting {
    allocs: AtomicUsize,
    frees: AtomicUsize,
    live: AtomicUsize,
    categories: Mutex<Vec<MemoryCategory>>,
}

impl AllocHook for Counting {
    fn on_alloc(&self, e: &AllocEvent) -> Result<(), BoxedError> {
        if self.live.load(Ordering::SeqCst) + e.bytes > 1 << 20 {
            return Err("data budget exceeded".into());
        }
        self.allocs.fetch_add(1, Ordering::SeqCst);
        self.live.fetch_add(e.bytes, Ordering::SeqCst);
        self.categories.lock().unwrap().push(e.category);
        Ok(())
    }
    fn on_free(&self, e: &AllocEvent) {
        self.frees.fetch_add(1, Ordering::SeqCst);
        self.live.fetch_sub(e.bytes, Ordering::SeqCst);
    }
}

#[test]
fn buffers_are_reused_counted_as_data_and_freed() {
    let ds = data(20_000, 4);
    let hook = Arc::new(Counting::default());
    let dyn_hook: Arc<dyn AllocHook> = hook.clone();
    let config = loader_config(8, OutputType::I64, 3, 6);
    let mut loader = Loader::new(
        ds,
        sampler(SamplingMode::RandomWindows, 32, 1),
        config,
        Some(dyn_hook),
    )
    .unwrap();
    assert_eq!(loader.buffer_count(), 6);
    let batch_bytes = 2 * 8 * 32 * 8;
    assert_eq!(hook.allocs.load(Ordering::SeqCst), 6);
    assert_eq!(hook.live.load(Ordering::SeqCst), 6 * batch_bytes);
    let mut pointers = std::collections::BTreeSet::new();
    for _ in 0..200 {
        let b = loader.next_batch().unwrap();
        pointers.insert(b.inputs_ptr() as usize);
    }
    assert_eq!(
        hook.allocs.load(Ordering::SeqCst),
        6,
        "no allocation per batch"
    );
    assert!(pointers.len() <= 6, "{} distinct buffers", pointers.len());
    assert!(hook
        .categories
        .lock()
        .unwrap()
        .iter()
        .all(|&c| c == MemoryCategory::Data));
    drop(loader);
    assert_eq!(hook.frees.load(Ordering::SeqCst), 6);
    assert_eq!(hook.live.load(Ordering::SeqCst), 0);
}

#[test]
fn memory_cap_bounds_buffers_and_budget_refusal_is_typed() {
    let ds = data(20_000, 4);
    let batch_bytes = 2 * 4 * 16 * 4;
    let mut config = loader_config(4, OutputType::U32, 2, 100);
    config.max_buffered_bytes = Some(5 * batch_bytes + 1);
    let loader = Loader::new(
        Arc::clone(&ds),
        sampler(SamplingMode::RandomWindows, 16, 1),
        config.clone(),
        None,
    )
    .unwrap();
    assert!(loader.buffer_count() <= 5 && loader.buffer_count() >= 2);
    config.max_buffered_bytes = Some(batch_bytes);
    assert!(
        Loader::new(
            Arc::clone(&ds),
            sampler(SamplingMode::RandomWindows, 16, 1),
            config,
            None
        )
        .is_err(),
        "cap below one buffer per worker"
    );

    // A hook with a 1 MiB budget refuses 64 buffers of 64 KiB.
    let hook: Arc<dyn AllocHook> = Arc::new(Counting::default());
    let big = loader_config(64, OutputType::I64, 1, 64);
    let err = Loader::new(
        ds,
        sampler(SamplingMode::RandomWindows, 64, 1),
        big,
        Some(hook),
    )
    .unwrap_err();
    assert!(
        matches!(err, headroom_mmap_data::DataError::Allocation(_)),
        "{err}"
    );
}

#[test]
fn fill_batch_is_the_reference_path_for_inline_use() {
    let ds = data(4000, 2);
    let s = WindowSampler::new(&ds, sampler(SamplingMode::EpochWindows, 20, 8)).unwrap();
    let mut buf = BatchBuffer::new(3, 20, OutputType::U32, None).unwrap();
    fill_batch(&ds, &s, 7, &mut buf).unwrap();
    assert_eq!(as_u64(&buf), reference_batch(&ds, &s, 7, 3));
    let mut wrong = BatchBuffer::new(3, 21, OutputType::U32, None).unwrap();
    assert!(fill_batch(&ds, &s, 0, &mut wrong).is_err());
}

#[test]
fn end_to_end_from_mapped_files_in_every_mode() {
    use headroom_mmap_data::{formats, MarkovChain, OpenOptions, TokenFileFormat};
    let dir = tempfile::tempdir().unwrap();
    let chain = MarkovChain::random(1000, 4, 21).unwrap();
    let raw = dir.path().join("train.bin");
    chain
        .write(&raw, 50_000, 1, TokenFileFormat::Raw(TokenType::U16))
        .unwrap();
    let mega = dir.path().join("corpus");
    chain
        .write(
            &mega,
            50_000,
            2,
            TokenFileFormat::Megatron {
                token_type: TokenType::I32,
                document_len: 700,
            },
        )
        .unwrap();
    for (path, mode) in [
        (&raw, SamplingMode::RandomWindows),
        (&raw, SamplingMode::EpochWindows),
        (&mega, SamplingMode::DocumentWindows),
    ] {
        let ds = Arc::new(
            formats::open(path, &OpenOptions::default())
                .unwrap()
                .with_vocab_size(1000),
        );
        assert!(ds.segments().iter().all(|s| s.is_mapped()));
        let cfg = SamplerConfig {
            mode,
            seq_len: 64,
            seed: 3,
            shard: Shard::new(1, 2).unwrap(),
        };
        let s = WindowSampler::new(&ds, cfg.clone()).unwrap();
        let mut loader = Loader::new(
            Arc::clone(&ds),
            cfg,
            loader_config(4, OutputType::I64, 2, 4),
            None,
        )
        .unwrap();
        for b in 0..20 {
            let batch = loader.next_batch().unwrap();
            let (x, y) = as_u64(&batch);
            assert_eq!(
                (x.clone(), y.clone()),
                reference_batch(&ds, &s, b, 4),
                "{mode:?}"
            );
            // Every input→target pair is a transition the chain can make: the windows are
            // real, contiguous token runs read through the map. (Document boundaries are
            // checked in the sampler tests.)
            for (xi, yi) in x.iter().zip(&y) {
                assert!(chain.probability(*xi as u32, *yi as u32) > 0.0);
            }
        }
    }
}
