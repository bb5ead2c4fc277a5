//! mmap-data: nanoGPT-style `get_batch` throughput (64 × 256 random windows from a 100M-token
//! `u16` file in page cache), compared with `benches/torch/mmap_data_get_batch.py` (numpy memmap
//! re-mapped per batch, as nanoGPT does) measured in the same `cargo xtask bench` run.
//!
//! Records tokens/s for the prefetching loader (`headroom`, i64 output like PyTorch's
//! embedding input), the loader with u32 output, and a single thread calling `fill_batch`
//! with no workers, each against the Python baseline (xtask fills in its value and the ratio);
//! and a single thread's u32 batches without and with position ids of documents ending with
//! `<|endoftext|>` (what `train --document-attention --document-separator 50256` loads), and
//! from a blend of the same file as 2 and as 8 sources (`train --data 0.7 A 0.3 B`: the blend
//! schedule's lookup per row) against the plain file.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use headroom_benches::{output_dir, record, Better, Record};
use headroom_mmap_data::blend::{blend_shares, BlendSchedule};
use headroom_mmap_data::rng::SplitMix64;
use headroom_mmap_data::{
    formats, DocumentBoundaries, Loader, LoaderConfig, OpenOptions, OutputType, SamplerConfig,
    SamplingMode, Shard, TokenDataset,
};

const TOKENS: usize = 100_000_000;
const VOCAB: u32 = 50_257; // GPT-2
const BATCH: usize = 64;
const SEQ_LEN: u64 = 256;
const BASELINE: &str = "mmap-data/get_batch_64x256/python_numpy";

/// The shared token file; written (random GPT-2 ids) through a temporary name if missing.
fn token_file() -> std::io::Result<PathBuf> {
    let dir = output_dir().join("data");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("tokens_u16_100M.bin");
    if path.metadata().map(|m| m.len()).ok() == Some(2 * TOKENS as u64) {
        return Ok(path);
    }
    eprintln!("writing {}", path.display());
    let tmp = dir.join(format!("tokens_u16_100M.bin.tmp{}", std::process::id()));
    let mut out = std::io::BufWriter::with_capacity(1 << 22, std::fs::File::create(&tmp)?);
    let mut rng = SplitMix64::new(0x4E41_4E4F_4750_5400);
    let mut chunk = Vec::with_capacity(1 << 20);
    for _ in 0..TOKENS / (1 << 19) + 1 {
        chunk.clear();
        for _ in 0..1 << 19 {
            chunk.extend_from_slice(&((rng.next_u64() % u64::from(VOCAB)) as u16).to_le_bytes());
        }
        out.write_all(&chunk)?;
    }
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.set_len(2 * TOKENS as u64)?;
    file.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Tokens per second of `batches` batches from a fresh loader (after a short warm-up),
/// median of `repeats` runs.
fn measure(
    data: &Arc<TokenDataset>,
    output: OutputType,
    workers: usize,
    documents: Option<DocumentBoundaries>,
    batches: usize,
    repeats: usize,
) -> f64 {
    let sampler = SamplerConfig {
        mode: SamplingMode::RandomWindows,
        seq_len: SEQ_LEN,
        seed: 1337,
        shard: Shard::SINGLE,
    };
    let config = LoaderConfig {
        batch_size: BATCH,
        output,
        workers,
        max_buffered_batches: (2 * workers).max(1),
        max_buffered_bytes: None,
        documents,
    };
    let mut runs = Vec::new();
    for r in 0..repeats {
        let mut sampler = sampler.clone();
        sampler.seed += r as u64;
        let mut loader =
            Loader::new(Arc::clone(data), sampler, config.clone(), None).expect("loader");
        let mut checksum = 0u64;
        for _ in 0..batches / 10 {
            checksum += loader.next_batch().expect("batch").input(0, 0).unwrap_or(0);
        }
        let start = Instant::now();
        for _ in 0..batches {
            let b = loader.next_batch().expect("batch");
            checksum += b.target(BATCH - 1, SEQ_LEN as usize - 1).unwrap_or(0);
        }
        let secs = start.elapsed().as_secs_f64();
        std::hint::black_box(checksum);
        runs.push((batches * BATCH * SEQ_LEN as usize) as f64 / secs);
    }
    median(runs)
}

fn emit(variant: &str, value: f64) {
    let bench = format!("mmap-data/get_batch_64x256/{variant}");
    println!("{bench}: {:.1} M tokens/s", value / 1e6);
    let r = Record {
        bench,
        metric: "tokens_per_s".into(),
        value,
        unit: "tokens/s".into(),
        baseline: Some(BASELINE.into()),
        baseline_value: None,
        ratio: None,
        better: Better::Higher,
    };
    if let Err(e) = record(&r) {
        eprintln!("could not record {}: {e}", r.bench);
    }
}

fn open_warm(path: &Path) -> Arc<TokenDataset> {
    let data = formats::open(path, &OpenOptions::default())
        .expect("open token file")
        .with_vocab_size(VOCAB);
    // A full scan: checks every id and pulls the file into page cache before timing.
    data.validate_tokens()
        .expect("token ids within the GPT-2 vocabulary");
    Arc::new(data)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick")
        || std::env::var_os("HEADROOM_BENCH_QUICK").is_some();
    // cargo passes `--bench`; under `cargo test --benches` it does not: run nothing then.
    if !std::env::args().any(|a| a == "--bench" || a == "--quick") {
        return;
    }
    let path = token_file().expect("create the shared token file");
    let data = open_warm(&path);
    let (batches, repeats) = if quick { (1000, 3) } else { (5000, 5) };
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let workers = cores.clamp(1, 8);
    emit(
        "headroom",
        measure(&data, OutputType::I64, workers, None, batches, repeats),
    );
    emit(
        "headroom_u32",
        measure(&data, OutputType::U32, workers, None, batches, repeats),
    );
    emit(
        "headroom_inline_i64",
        measure(&data, OutputType::I64, 0, None, batches, repeats),
    );
    // The separator's cost alone: one thread, the same batches with and without positions.
    emit(
        "headroom_inline_u32",
        measure(&data, OutputType::U32, 0, None, batches, repeats),
    );
    // A blend's cost: the same file as 2 sources (0.7/0.3: a period of 10 samples; 1/√2: the
    // longest period) and as 8 (weights 1..8), one thread, against the plain file measured in
    // turn with them (rounds alternate, so the VM's slow phases hit every variant alike).
    let blend = |weights: Vec<f64>| {
        let sources = weights
            .iter()
            .enumerate()
            .map(|(i, &w)| (format!("source{i}"), w, (*data).clone()))
            .collect();
        Arc::new(TokenDataset::from_blend(sources).expect("blend"))
    };
    let variants = [
        ("headroom_inline_u32_blend_baseline", Arc::clone(&data)),
        ("headroom_inline_u32_blend2", blend(vec![0.7, 0.3])),
        (
            "headroom_inline_u32_blend2_long_period",
            blend(vec![1.0, std::f64::consts::SQRT_2]),
        ),
        (
            "headroom_inline_u32_blend8",
            blend((1..=8).map(f64::from).collect()),
        ),
    ];
    let mut rounds = vec![Vec::new(); variants.len()];
    for _ in 0..repeats.max(7) {
        for (runs, (_, dataset)) in rounds.iter_mut().zip(&variants) {
            runs.push(measure(dataset, OutputType::U32, 0, None, batches, 1));
        }
    }
    for (runs, (variant, _)) in rounds.into_iter().zip(&variants) {
        emit(variant, median(runs));
    }
    // Building a schedule of the longest period (weights that are no ratio of small
    // integers), by source count: once per loader.
    for sources in [2usize, 64, 1024] {
        let weights: Vec<f64> = (0..sources).map(|i| ((i + 2) as f64).sqrt()).collect();
        let mut runs = Vec::new();
        for _ in 0..repeats {
            let start = Instant::now();
            let shares = blend_shares(&weights).expect("shares");
            std::hint::black_box(BlendSchedule::new(&shares).expect("schedule"));
            runs.push(start.elapsed().as_secs_f64());
        }
        let secs = median(runs);
        let bench = format!("mmap-data/blend_schedule_65536/{sources}_sources");
        println!("{bench}: {:.2} ms", secs * 1e3);
        let r = Record {
            bench,
            metric: "build_time".into(),
            value: secs,
            unit: "s".into(),
            baseline: None,
            baseline_value: None,
            ratio: None,
            better: Better::Lower,
        };
        if let Err(e) = record(&r) {
            eprintln!("could not record {}: {e}", r.bench);
        }
    }
    emit(
        "headroom_inline_u32_eot_documents",
        measure(
            &data,
            OutputType::U32,
            0,
            Some(DocumentBoundaries::EndsWith(VOCAB - 1)),
            batches,
            repeats,
        ),
    );
}
