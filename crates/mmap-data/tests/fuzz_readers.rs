//! Fuzz tests for every reader of token files: raw nanoGPT files, llm.c shards, Megatron
//! `.idx` (alone and with its `.bin`), shard directories and globs, and `inspect`'s format
//! detection.
//!
//! Seeds are valid files written by this crate's writers; headerful formats declare their
//! header fields so the mutator sets them to extreme values. Every mutated input is written to
//! its own temporary file and opened; whatever opens is read completely — every token, every
//! document and sequence boundary, windows of every sampler mode through the loader's
//! `fill_batch` — and checked against what the reader claimed, so an out-of-bounds read or a
//! wrong answer is a panic and a finding. Each test asserts 0 panics and 0 hangs.
//!
//! `HEADROOM_FUZZ_ITERS` scales the random inputs per campaign (CI runs the small default);
//! `scripts/fuzz-long.sh` runs each test as its own process with a large count.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use headroom_fuzzkit::{
    bundle, fuzz_seeds, iterations, unbundle, Cleanup, Field, FuzzReport, ScratchDir, Seed,
};
use headroom_mmap_data::formats::llmc::{self, parse_llmc, LLMC_HEADER_BYTES};
use headroom_mmap_data::formats::megatron::{self, MegatronIndex};
use headroom_mmap_data::formats::{self, raw, OpenOptions, TokenFileFormat};
use headroom_mmap_data::text::decode_bytes;
use headroom_mmap_data::{
    build_from_text, fill_batch, inspect, BatchBuffer, BuildSpec, DataError, DocumentBoundaries,
    InspectOptions, LlmcFlavor, Loader, LoaderConfig, LoaderState, OutputType, SamplerConfig,
    SamplingMode, Shard, TokenDataset, TokenType, WindowSampler,
};

/// Random inputs per campaign in an ordinary `cargo test` (plus the systematic ones).
const CI_ITERATIONS: u64 = 300;

/// Bytes of the fixed part of a Megatron `.idx` header (magic 9, version 8, dtype 1, two
/// counts of 8); the arrays follow.
const IDX_HEADER: usize = 34;

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

fn first_error(slot: &mut Option<DataError>, r: Result<(), DataError>) {
    if let (None, Err(e)) = (&slot, r) {
        *slot = Some(e);
    }
}

/// Read everything `ds` claims to hold and check it is consistent; panics on any
/// inconsistency (a finding), returns the first typed error met along the way.
fn exercise(ds: &TokenDataset) -> Result<(), DataError> {
    let mut err = None;
    assert!(ds.total_tokens() > 0, "an opened dataset is never empty");
    for (i, seg) in ds.segments().iter().enumerate() {
        let tokens = seg.tokens();
        assert_eq!(
            tokens.len(),
            seg.len(),
            "segment {i}: view and length differ"
        );
        assert_eq!(tokens.token_type(), seg.token_type());
        let len = seg.len() as u64;
        if len > 0 {
            assert!(ds.token(i, 0).is_some() && ds.token(i, len - 1).is_some());
        }
        assert!(
            ds.token(i, len).is_none(),
            "segment {i}: token past the end"
        );
        // Decode every token in chunks, as the loader does.
        let mut out = vec![0i64; 4096];
        let mut start = 0;
        while start < tokens.len() {
            let n = out.len().min(tokens.len() - start);
            let sub = tokens.sub(start, n).expect("a chunk inside the segment");
            let _ = sub.decode_into(&mut out[..n], 1 << 32);
            start += n;
        }
        if let Some(seq) = seg.sequence_index() {
            check_sequences(ds, i, seq);
        }
    }
    first_error(&mut err, ds.validate_tokens());
    if let Some(docs) = ds.documents() {
        for d in docs {
            let seg = &ds.segments()[d.segment];
            assert!(
                d.start.checked_add(d.len).expect("document end overflows") <= seg.len() as u64,
                "document {d:?} beyond its segment of {}",
                seg.len()
            );
            if d.len > 0 {
                assert!(ds.token(d.segment, d.start + d.len - 1).is_some());
            }
        }
    }
    for mode in [
        SamplingMode::RandomWindows,
        SamplingMode::EpochWindows,
        SamplingMode::DocumentWindows,
    ] {
        for seq_len in [1u64, 2, 7, 64] {
            first_error(&mut err, sample(ds, mode, seq_len));
        }
    }
    err.map_or(Ok(()), Err)
}

/// A sampler over `ds` and two batches through the loader's copy path. A window that does
/// not fit the data or a mode the data has no index for is a configuration mismatch, not a
/// refusal of the file: only the batch copy's errors (tokens outside the vocabulary) count.
fn sample(ds: &TokenDataset, mode: SamplingMode, seq_len: u64) -> Result<(), DataError> {
    let config = SamplerConfig {
        mode,
        seq_len,
        seed: 11,
        shard: Shard::SINGLE,
    };
    let sampler = match WindowSampler::new(ds, config) {
        Ok(s) => s,
        Err(DataError::WindowTooLong { .. } | DataError::InvalidConfig(_)) => return Ok(()),
        Err(e) => return Err(e),
    };
    let per_epoch = sampler.windows_per_epoch().unwrap_or(1);
    for pos in [
        0,
        1,
        per_epoch.saturating_sub(1),
        per_epoch,
        3 * per_epoch + 1,
    ] {
        let w = sampler.window(pos);
        let seg = &ds.segments()[w.segment];
        assert!(
            w.start + seq_len < seg.len() as u64,
            "window {w:?} of {} tokens beyond its segment of {}",
            seq_len + 1,
            seg.len()
        );
    }
    let mut buffer = BatchBuffer::new(2, seq_len as usize, OutputType::I64, None)?;
    if ds.has_loss_mask() {
        buffer = buffer.with_target_flags(None)?;
    }
    fill_batch(ds, &sampler, 0, &mut buffer)?;
    if let Some(flags) = buffer.target_flags() {
        // Each flag is its target's mask bit.
        for (k, &f) in flags.iter().enumerate() {
            let (row, col) = (k / seq_len as usize, k % seq_len as usize);
            let w = sampler.window(row as u64);
            let mask = ds.segments()[w.segment].loss_mask();
            let bit = mask.map_or(Some(true), |m| m.get(w.start as usize + col + 1));
            assert_eq!(Some(f), bit, "flag {k} of window {w:?}");
        }
    }
    // Documents ended by a separator (the data's first token, so that it occurs): each
    // position follows from the input before it, and a target after a separator is out.
    if let Some(separator) = ds.token(0, 0).and_then(|t| u32::try_from(t).ok()) {
        let t = seq_len as usize;
        let mut packed = BatchBuffer::new(2, t, OutputType::I64, None)?
            .with_positions(DocumentBoundaries::EndsWith(separator), None)?;
        fill_batch(ds, &sampler, 1, &mut packed)?;
        let positions = packed.positions().expect("a buffer with positions");
        let flags = packed.target_flags().expect("a buffer with flags");
        for (k, &p) in positions.iter().enumerate() {
            let (row, col) = (k / t, k % t);
            let ends = |c: usize| packed.input(row, c) == Some(u64::from(separator));
            let want = if col == 0 || ends(col - 1) {
                0
            } else {
                positions[k - 1] + 1
            };
            assert_eq!(p, want, "position {k}");
            if ends(col) {
                assert!(!flags[k], "target {k} starts a document");
            }
        }
    }
    fill_batch(ds, &sampler, 5, &mut buffer)
}

/// The sequence table agrees with the segment and with the document spans.
fn check_sequences(ds: &TokenDataset, segment: usize, seq: &headroom_mmap_data::SequenceIndex) {
    let seg_len = ds.segments()[segment].len() as u64;
    let bounds: Vec<u64> = seq.boundaries().collect();
    assert_eq!(bounds.len(), seq.len() + 1);
    assert_eq!(bounds.first(), Some(&0));
    assert_eq!(bounds.last(), Some(&seg_len));
    assert!(
        bounds.windows(2).all(|w| w[0] <= w[1]),
        "unsorted boundaries"
    );
    for (i, w) in bounds.windows(2).enumerate() {
        assert_eq!(seq.span(i), Some(w[0]..w[1]));
        if w[1] > w[0] {
            assert_eq!(seq.sequence_at(w[0]), Some(i));
            assert_eq!(seq.sequence_at(w[1] - 1), Some(i));
        }
    }
    assert_eq!(seq.span(seq.len()), None);
    assert_eq!(seq.sequence_at(seg_len), None);
    if let Some(docs) = ds.documents() {
        let mine: Vec<_> = docs.iter().filter(|d| d.segment == segment).collect();
        assert_eq!(mine.len(), seq.document_count());
        for (d, doc) in mine.iter().enumerate() {
            let r = seq.document_sequences(d).expect("document in range");
            assert!(r.start <= r.end && r.end <= seq.len());
            assert_eq!(doc.start, bounds[r.start]);
            assert_eq!(doc.start + doc.len, bounds[r.end]);
            assert_eq!(seq.document_start(d), Some(doc.start));
        }
    }
    // Position ids per document (packed training): 0 at the first token and at every
    // document's start, else one more than the token before.
    let starts: std::collections::HashSet<u64> = (0..seq.document_count())
        .filter_map(|d| seq.document_start(d))
        .collect();
    let mut positions = vec![u32::MAX; seg_len.min(512) as usize];
    seq.document_positions(0, &mut positions)
        .expect("the positions of an index the reader accepted");
    for (i, &p) in positions.iter().enumerate() {
        let want = if i == 0 || starts.contains(&(i as u64)) {
            0
        } else {
            positions[i - 1] + 1
        };
        assert_eq!(p, want, "position {i}");
    }
}

/// `inspect` either refuses or describes consistently.
fn check_inspect(path: &Path, options: &InspectOptions) -> Result<(), DataError> {
    let d = inspect(path, options)?;
    assert!(d.tokens > 0);
    assert!(d.min_id <= d.max_id);
    assert!(d.distinct_ids >= 1 && d.distinct_ids <= d.tokens);
    assert_eq!(
        d.first_tokens.len() as u64,
        d.tokens.min(options.preview_tokens as u64)
    );
    assert_eq!(d.file_bytes, d.files.iter().map(|(_, n)| n).sum::<u64>());
    let _ = d.to_string();
    Ok(())
}

fn all_token_types() -> [TokenType; 5] {
    [
        TokenType::U8,
        TokenType::U16,
        TokenType::U32,
        TokenType::I32,
        TokenType::I64,
    ]
}

fn tokens(n: usize, modulo: u32, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ salt) % modulo)
        .collect()
}

fn raw_bytes(tokens: &[u32], t: TokenType) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("r.bin");
    raw::write_raw(&p, tokens, t).unwrap();
    std::fs::read(p).unwrap()
}

fn llmc_bytes(tokens: &[u32], flavor: LlmcFlavor) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.bin");
    llmc::write_llmc(&p, tokens, flavor).unwrap();
    std::fs::read(p).unwrap()
}

fn megatron_bytes(docs: &[Vec<u32>], t: TokenType) -> (Vec<u8>, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m");
    megatron::write_megatron(&p, docs, t).unwrap();
    (
        std::fs::read(p.with_extension("idx")).unwrap(),
        std::fs::read(p.with_extension("bin")).unwrap(),
    )
}

/// The llm.c header fields: magic, version, token count, two reserved words, and the first
/// token after the header.
fn llmc_fields(token_width: usize) -> Vec<Field> {
    vec![
        Field::new("magic", 0, 4),
        Field::new("version", 4, 4),
        Field::new("token count", 8, 4),
        Field::new("reserved[3]", 12, 4),
        Field::new("reserved[255]", LLMC_HEADER_BYTES - 4, 4),
        Field::new("token[0]", LLMC_HEADER_BYTES, token_width),
    ]
}

/// Every field of a Megatron `.idx`: version, dtype code, sequence count S, document count D,
/// each sequence length and pointer, each document index entry.
fn megatron_fields(idx: &[u8]) -> Vec<Field> {
    let word = |at: usize| u64::from_le_bytes(idx[at..at + 8].try_into().unwrap()) as usize;
    let (s, d) = (word(18), word(26));
    let mut fields = vec![
        Field::new("version", 9, 8),
        Field::new("dtype", 17, 1),
        Field::new("sequences", 18, 8),
        Field::new("documents", 26, 8),
    ];
    for i in 0..s {
        fields.push(Field::new(format!("length[{i}]"), IDX_HEADER + 4 * i, 4));
        fields.push(Field::new(
            format!("pointer[{i}]"),
            IDX_HEADER + 4 * s + 8 * i,
            8,
        ));
    }
    for k in 0..d {
        fields.push(Field::new(
            format!("document[{k}]"),
            IDX_HEADER + 12 * s + 8 * k,
            8,
        ));
    }
    fields
}

fn check(report: FuzzReport) {
    println!("{report}");
    report.assert_clean();
    assert!(
        report.ok > 0,
        "no input was accepted: the seeds are broken\n{report}"
    );
    assert!(
        report.errors > 0,
        "no input was refused: the mutator is broken\n{report}"
    );
}

#[test]
fn fuzz_raw_files() {
    let seeds = vec![
        Seed::new(
            "u16 x200",
            raw_bytes(&tokens(200, 50_257, 1), TokenType::U16),
        ),
        Seed::new(
            "u32 x120",
            raw_bytes(&tokens(120, 200_000, 2), TokenType::U32),
        ),
        Seed::new("u8 x101", raw_bytes(&tokens(101, 256, 3), TokenType::U8)),
        Seed::new("i64 x40", raw_bytes(&tokens(40, 1000, 4), TokenType::I64)),
    ]
    .into_iter()
    .map(|s| s.with_fields([Field::new("word[0]", 0, 4), Field::new("word[1]", 4, 4)]))
    .collect::<Vec<_>>();
    let scratch = ScratchDir::new("headroom-fuzz").unwrap();
    let report = fuzz_seeds("raw", &seeds, iterations(CI_ITERATIONS), move |bytes| {
        let path = scratch.fresh().with_extension("bin");
        let _cleanup = Cleanup(vec![path.clone()]);
        write(&path, bytes);
        for t in all_token_types() {
            if let Ok(ds) = raw::open_raw(&path, t) {
                assert_eq!(ds.total_tokens(), (bytes.len() / t.width()) as u64);
                let _ = exercise(&ds);
            }
        }
        let _ = check_inspect(&path, &InspectOptions::default());
        let ds = formats::open(&path, &OpenOptions::default())?;
        exercise(&ds)
    });
    check(report);
}

/// A loss mask beside a fixed raw file: every field of its header at extreme values,
/// truncations, bit flips. Whatever opens must agree with its own bits.
#[test]
fn fuzz_loss_masks() {
    let flags = |n: usize, salt: usize| {
        (0..n)
            .map(|i| !(i * 7 + salt).is_multiple_of(3))
            .collect::<Vec<_>>()
    };
    let mask_bytes = |f: &[bool]| {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m");
        headroom_mmap_data::write_loss_mask(&p, f).unwrap();
        std::fs::read(p).unwrap()
    };
    let fields = || {
        [
            Field::new("magic", 0, 8),
            Field::new("tokens", 8, 8),
            Field::new("counted", 16, 8),
            Field::new("bits[0]", 24, 1),
        ]
    };
    let seeds = vec![
        Seed::new("100 tokens", mask_bytes(&flags(100, 1))).with_fields(fields()),
        Seed::new("64 tokens", mask_bytes(&flags(64, 2))).with_fields(fields()),
    ];
    let scratch = ScratchDir::new("headroom-fuzz").unwrap();
    let report = fuzz_seeds(
        "lossmask",
        &seeds,
        iterations(CI_ITERATIONS),
        move |bytes| {
            let path = scratch.fresh().with_extension("bin");
            let mask = headroom_mmap_data::loss_mask_path(&path);
            let _cleanup = Cleanup(vec![path.clone(), mask.clone()]);
            // The token file is as long as the mask says it is, when that is small.
            let declared = bytes
                .get(8..16)
                .map_or(0, |w| u64::from_le_bytes(w.try_into().unwrap()));
            let n = if (1..=4096).contains(&declared) {
                declared as usize
            } else {
                100
            };
            write(&path, &raw_bytes(&tokens(n, 50_257, 9), TokenType::U16));
            write(&mask, bytes);
            if let Ok(m) = headroom_mmap_data::LossMask::open(&mask) {
                let ones = (0..m.len()).filter(|&i| m.get(i) == Some(true)).count() as u64;
                assert_eq!(ones, m.counted());
                assert_eq!(m.get(m.len()), None);
            }
            let ds = formats::open(&path, &OpenOptions::default())?;
            assert!(ds.has_loss_mask());
            exercise(&ds)
        },
    );
    check(report);
}

#[test]
fn fuzz_llmc_shards() {
    let seeds = vec![
        Seed::new(
            "gpt2 x300",
            llmc_bytes(&tokens(300, 50_257, 5), LlmcFlavor::Gpt2),
        )
        .with_fields(llmc_fields(2)),
        Seed::new(
            "llama3 x150",
            llmc_bytes(&tokens(150, 128_256, 6), LlmcFlavor::Llama3),
        )
        .with_fields(llmc_fields(4)),
        Seed::new("gpt2 x1", llmc_bytes(&[7], LlmcFlavor::Gpt2)).with_fields(llmc_fields(2)),
    ];
    let scratch = ScratchDir::new("headroom-fuzz").unwrap();
    let report = fuzz_seeds("llmc", &seeds, iterations(CI_ITERATIONS), move |bytes| {
        let parsed = parse_llmc(bytes, "fuzz");
        if let Ok(h) = &parsed {
            let width = h.token_type().width() as u64;
            assert_eq!(
                bytes.len() as u64,
                LLMC_HEADER_BYTES as u64 + h.num_tokens * width
            );
        }
        let path = scratch.fresh().with_extension("bin");
        let _cleanup = Cleanup(vec![path.clone()]);
        write(&path, bytes);
        let opened = llmc::open_llmc(&path);
        assert_eq!(opened.is_ok(), parsed.is_ok(), "parse and open disagree");
        if let (Ok(ds), Ok(h)) = (&opened, &parsed) {
            assert_eq!(ds.total_tokens(), h.num_tokens);
            assert_eq!(ds.segments()[0].token_type(), h.token_type());
        }
        let _ = check_inspect(&path, &InspectOptions::default());
        if let Ok(ds) = formats::open(&path, &OpenOptions::default()) {
            let _ = exercise(&ds);
        }
        exercise(&opened?)
    });
    check(report);
}

/// The `.bin` every index seed of [`fuzz_megatron_index`] describes: 48 bytes, which are 48
/// u8, 24 u16, 12 i32 or 6 i64 tokens, all small and non-negative.
fn shared_bin() -> Vec<u8> {
    (0..6i64).flat_map(|v| (v * 3).to_le_bytes()).collect()
}

#[test]
fn fuzz_megatron_index() {
    // Index seeds for every dtype, all describing the same 48-byte .bin (document lengths
    // in tokens of that width), including an empty document.
    let layouts: [(TokenType, &[usize]); 5] = [
        (TokenType::U8, &[10, 0, 30, 8]),
        (TokenType::U16, &[24]),
        (TokenType::U16, &[5, 7, 0, 12]),
        (TokenType::I32, &[3, 9]),
        (TokenType::I64, &[1, 1, 4]),
    ];
    let seeds: Vec<Seed> = layouts
        .iter()
        .map(|(t, lengths)| {
            let docs: Vec<Vec<u32>> = lengths.iter().map(|&n| vec![1; n]).collect();
            let (idx, bin) = megatron_bytes(&docs, *t);
            assert_eq!(bin.len(), shared_bin().len());
            let fields = megatron_fields(&idx);
            Seed::new(format!("{t} {lengths:?}"), idx).with_fields(fields)
        })
        .collect();
    let scratch = ScratchDir::new("headroom-fuzz").unwrap();
    let bin = shared_bin();
    let report = fuzz_seeds(
        "megatron-idx",
        &seeds,
        iterations(CI_ITERATIONS),
        move |idx| {
            let parsed = MegatronIndex::parse(idx, bin.len() as u64, "fuzz");
            let prefix = scratch.fresh();
            let (idx_path, bin_path) = megatron::megatron_paths(&prefix);
            let _cleanup = Cleanup(vec![idx_path.clone(), bin_path.clone()]);
            write(&idx_path, idx);
            write(&bin_path, &bin);
            let opened = megatron::open_megatron(&prefix);
            assert_eq!(opened.is_ok(), parsed.is_ok(), "parse and open disagree");
            if let (Ok(ds), Ok(index)) = (&opened, &parsed) {
                assert_eq!(ds.total_tokens(), index.total_tokens());
                assert_eq!(
                    ds.documents().map(<[_]>::len),
                    Some(index.document_indices.len() - 1)
                );
                let seq = ds
                    .sequence_index(0)
                    .expect("a Megatron segment has sequences");
                assert_eq!(seq.len(), index.sequence_lengths.len());
                for (i, &n) in index.sequence_lengths.iter().enumerate() {
                    assert_eq!(seq.length(i), Some(u64::from(n)));
                }
            }
            for path in [&idx_path, &bin_path] {
                if let Ok(ds) = formats::open(path, &OpenOptions::default()) {
                    let _ = exercise(&ds);
                }
            }
            let _ = check_inspect(&prefix, &InspectOptions::default());
            exercise(&opened?)
        },
    );
    check(report);
}

#[test]
fn fuzz_megatron_pairs() {
    let seeds: Vec<Seed> = [
        (
            TokenType::U16,
            vec![tokens(20, 50_000, 1), tokens(7, 50_000, 2)],
        ),
        (
            TokenType::I32,
            vec![tokens(5, 1 << 30, 3), vec![], tokens(9, 100, 4)],
        ),
        (TokenType::I64, vec![tokens(6, 1000, 5)]),
        (TokenType::U8, vec![tokens(40, 256, 6), tokens(3, 256, 7)]),
    ]
    .iter()
    .map(|(t, docs)| {
        let (idx, bin) = megatron_bytes(docs, *t);
        let fields = megatron_fields(&idx);
        bundle(
            &format!("{t} x{}", docs.len()),
            &[("idx", &idx, &fields), ("bin", &bin, &[])],
        )
    })
    .collect();
    let scratch = ScratchDir::new("headroom-fuzz").unwrap();
    let report = fuzz_seeds(
        "megatron-pair",
        &seeds,
        iterations(CI_ITERATIONS),
        move |input| {
            let parts = unbundle(input, 2);
            let prefix = scratch.fresh();
            let (idx_path, bin_path) = megatron::megatron_paths(&prefix);
            let _cleanup = Cleanup(vec![idx_path.clone(), bin_path.clone()]);
            write(&idx_path, parts[0]);
            write(&bin_path, parts[1]);
            let parsed = MegatronIndex::parse(parts[0], parts[1].len() as u64, "fuzz");
            if let Ok(index) = &parsed {
                let width = index.token_type.width() as u64;
                for (&p, &n) in index.sequence_pointers.iter().zip(&index.sequence_lengths) {
                    assert!(p + u64::from(n) * width <= parts[1].len() as u64);
                }
            }
            let _ = check_inspect(&bin_path, &InspectOptions::default());
            if let Ok(ds) = formats::open(&idx_path, &OpenOptions::default()) {
                let _ = exercise(&ds);
            }
            let ds = megatron::open_megatron(&prefix);
            // An empty .bin cannot be mapped: the file-level reader refuses what the
            // in-memory parser (which never sees the file) may accept.
            if !parts[1].is_empty() {
                assert_eq!(ds.is_ok(), parsed.is_ok(), "parse and open disagree");
            }
            exercise(&ds?)
        },
    );
    check(report);
}

/// File names of the parts of a shard-set seed, in order.
const SHARD_FILES: [&str; 4] = ["000.bin", "001.bin", "002.idx", "002.bin"];

#[test]
fn fuzz_shard_sets() {
    let gpt2 = llmc_bytes(&tokens(100, 50_257, 8), LlmcFlavor::Gpt2);
    let llama = llmc_bytes(&tokens(60, 128_256, 9), LlmcFlavor::Llama3);
    let raw16 = raw_bytes(&tokens(80, 50_257, 10), TokenType::U16);
    let (idx, bin) = megatron_bytes(&[tokens(30, 500, 11), tokens(12, 500, 12)], TokenType::U16);
    let (fg, fl, fi) = (llmc_fields(2), llmc_fields(4), megatron_fields(&idx));
    let seeds = vec![
        bundle(
            "llmc + raw + megatron",
            &[
                ("000.bin", &gpt2, &fg),
                ("001.bin", &raw16, &[]),
                ("002.idx", &idx, &fi),
                ("002.bin", &bin, &[]),
            ],
        ),
        bundle(
            "llmc + llmc + megatron",
            &[
                ("000.bin", &gpt2, &fg),
                ("001.bin", &llama, &fl),
                ("002.idx", &idx, &fi),
                ("002.bin", &bin, &[]),
            ],
        ),
    ];
    let scratch = ScratchDir::new("headroom-fuzz").unwrap();
    let report = fuzz_seeds(
        "shard-set",
        &seeds,
        iterations(CI_ITERATIONS),
        move |input| {
            let dir = scratch.fresh();
            let _cleanup = Cleanup(vec![dir.clone()]);
            std::fs::create_dir(&dir).unwrap();
            let parts = unbundle(input, SHARD_FILES.len());
            for (name, bytes) in SHARD_FILES.iter().zip(&parts) {
                write(&dir.join(name), bytes);
            }
            let options = OpenOptions::default();
            if let Ok(ds) = formats::open(dir.join("00?.bin"), &options) {
                let _ = exercise(&ds);
            }
            let listed: Vec<PathBuf> = SHARD_FILES[..3].iter().map(|n| dir.join(n)).collect();
            if let Ok(ds) = formats::open_shards(&listed, &options, "fuzz") {
                let _ = exercise(&ds);
            }
            let ds = formats::open(&dir, &options)?;
            assert!(ds.segments().len() <= SHARD_FILES.len());
            exercise(&ds)
        },
    );
    check(report);
}

#[test]
fn fuzz_format_detection() {
    // u32 data that the guesser recognises (high halves zero), and the other raw shapes.
    let guessable_u32 = raw_bytes(&tokens(100, 60_000, 13), TokenType::U32);
    let mut seeds = vec![
        Seed::new(
            "raw u16",
            raw_bytes(&tokens(150, 50_257, 14), TokenType::U16),
        ),
        Seed::new("raw u32", guessable_u32),
        Seed::new("raw u8 odd", raw_bytes(&tokens(77, 256, 15), TokenType::U8)),
        Seed::new(
            "gpt2",
            llmc_bytes(&tokens(90, 50_257, 16), LlmcFlavor::Gpt2),
        ),
        Seed::new(
            "llama3",
            llmc_bytes(&tokens(50, 128_256, 17), LlmcFlavor::Llama3),
        ),
    ];
    for s in &mut seeds {
        s.fields = llmc_fields(2);
    }
    let scratch = ScratchDir::new("headroom-fuzz").unwrap();
    let report = fuzz_seeds("detect", &seeds, iterations(CI_ITERATIONS), move |bytes| {
        let path = scratch.fresh().with_extension("bin");
        let _cleanup = Cleanup(vec![path.clone()]);
        write(&path, bytes);
        for t in all_token_types() {
            let given = InspectOptions {
                raw_token_type: Some(t),
                preview_tokens: 3,
                distinct_id_limit: 1000,
            };
            let _ = check_inspect(&path, &given);
            if let Ok(ds) = formats::open(&path, &OpenOptions { raw_token_type: t }) {
                let _ = exercise(&ds);
            }
        }
        check_inspect(&path, &InspectOptions::default())
    });
    check(report);
}

/// Text is a file the crate reads too (`headroom data build`): any bytes, with or without a
/// document separator, tokenise into a file that reads back to the same bytes.
#[test]
fn fuzz_text_build() {
    let texts: [&[u8]; 4] = [
        b"Once upon a time<|endoftext|>there was a fox.<|endoftext|>The end.",
        "Grüße, 世界!\n\nSecond paragraph.\n\n".as_bytes(),
        b"<|endoftext|><|endoftext|>",
        b"x",
    ];
    let seeds: Vec<Seed> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| Seed::new(format!("text {i}"), *t))
        .collect();
    let specs: Vec<BuildSpec> = vec![
        BuildSpec {
            format: TokenFileFormat::Megatron {
                token_type: TokenType::U16,
                document_len: 7,
            },
            document_separator: Some(b"<|endoftext|>".to_vec()),
            require_utf8: true,
        },
        BuildSpec {
            format: TokenFileFormat::Raw(TokenType::U16),
            document_separator: Some(b"\n\n".to_vec()),
            require_utf8: false,
        },
        BuildSpec {
            format: TokenFileFormat::Llmc(LlmcFlavor::Gpt2),
            document_separator: None,
            require_utf8: false,
        },
        BuildSpec::new(TokenFileFormat::Raw(TokenType::U8)),
    ];
    let scratch = ScratchDir::new("headroom-fuzz").unwrap();
    let report = fuzz_seeds(
        "text-build",
        &seeds,
        iterations(CI_ITERATIONS),
        move |text| {
            let input = scratch.fresh().with_extension("txt");
            let _input_cleanup = Cleanup(vec![input.clone()]);
            write(&input, text);
            let mut err = None;
            for spec in &specs {
                let out = scratch.fresh();
                let (idx, bin) = megatron::megatron_paths(&out);
                let _cleanup = Cleanup(vec![out.clone(), idx, bin]);
                let options = OpenOptions {
                    raw_token_type: spec.format.token_type(),
                };
                let built = build_from_text(&input, spec, &out).and_then(|summary| {
                    let ds = formats::open(&out, &options)?;
                    assert_eq!(ds.total_tokens(), summary.tokens);
                    let mut tokens = Vec::new();
                    for seg in ds.segments() {
                        let t = seg.tokens();
                        tokens.extend((0..t.len()).map(|i| t.get(i).unwrap() as u32));
                    }
                    let back = decode_bytes(&tokens, spec.document_separator.as_deref())?;
                    assert_eq!(back, text, "text does not round-trip");
                    exercise(&ds)
                });
                first_error(&mut err, built);
            }
            err.map_or(Ok(()), Err)
        },
    );
    check(report);
}

/// A saved loader position in a fixed binary layout, so its fields can be set to extreme
/// values (the trainer stores it as JSON in `state.json`; the harness round-trips it through
/// JSON too). `fingerprint` is stored XOR the dataset's real one, so 0 matches.
const STATE_FIELDS: [(&str, usize, usize); 10] = [
    ("next_batch", 0, 8),
    ("epoch", 8, 8),
    ("batch_size", 16, 8),
    ("seq_len", 24, 8),
    ("seed", 32, 8),
    ("rank", 40, 4),
    ("world", 44, 4),
    ("mode", 48, 1),
    ("fingerprint", 49, 8),
    ("workers", 57, 1),
];
const STATE_BYTES: usize = 58;

fn encode_state(s: &LoaderState, fingerprint: u64, workers: u8) -> Vec<u8> {
    let mode = match s.sampler.mode {
        SamplingMode::RandomWindows => 0u8,
        SamplingMode::EpochWindows => 1,
        SamplingMode::DocumentWindows => 2,
    };
    let mut b = Vec::with_capacity(STATE_BYTES);
    for v in [
        s.next_batch,
        s.epoch,
        s.batch_size,
        s.sampler.seq_len,
        s.sampler.seed,
    ] {
        b.extend(v.to_le_bytes());
    }
    b.extend(s.sampler.shard.rank.to_le_bytes());
    b.extend(s.sampler.shard.world.to_le_bytes());
    b.push(mode);
    b.extend((s.dataset_fingerprint ^ fingerprint).to_le_bytes());
    b.push(workers);
    b
}

fn decode_state(b: &[u8], fingerprint: u64) -> Result<(LoaderState, usize), DataError> {
    if b.len() != STATE_BYTES {
        return Err(DataError::InvalidConfig(format!("{} state bytes", b.len())));
    }
    let field = |i: usize| -> u64 {
        let (_, at, w) = STATE_FIELDS[i];
        let mut le = [0u8; 8];
        le[..w].copy_from_slice(&b[at..at + w]);
        u64::from_le_bytes(le)
    };
    let mode = match field(7) {
        0 => SamplingMode::RandomWindows,
        1 => SamplingMode::EpochWindows,
        2 => SamplingMode::DocumentWindows,
        m => return Err(DataError::InvalidConfig(format!("mode {m}"))),
    };
    let state = LoaderState {
        sampler: SamplerConfig {
            mode,
            seq_len: field(3),
            seed: field(4),
            shard: Shard {
                rank: field(5) as u32,
                world: field(6) as u32,
            },
        },
        batch_size: field(2),
        next_batch: field(0),
        epoch: field(1),
        dataset_fingerprint: field(8) ^ fingerprint,
    };
    Ok((state, field(9) as usize % 4))
}

/// A saved position is a file too (the trainer's `state.json`): resuming from any of its
/// values must be a typed error or a working loader.
#[test]
fn fuzz_loader_state() {
    const BATCH: usize = 4;
    let docs: Vec<Vec<u32>> = (0..12)
        .map(|d| tokens(20 + 7 * d, 1000, d as u32))
        .collect();
    let ds = Arc::new(
        TokenDataset::from_documents(&docs, TokenType::U16)
            .unwrap()
            .with_vocab_size(1000),
    );
    let fingerprint = ds.fingerprint();
    let mut seeds = Vec::new();
    for (mode, workers) in [
        (SamplingMode::RandomWindows, 0u8),
        (SamplingMode::EpochWindows, 2),
        (SamplingMode::DocumentWindows, 1),
    ] {
        let sampler = SamplerConfig {
            mode,
            seq_len: 8,
            seed: 5,
            shard: Shard::SINGLE,
        };
        let mut config = LoaderConfig::new(BATCH);
        config.workers = usize::from(workers);
        let mut loader = Loader::new(Arc::clone(&ds), sampler, config, None).unwrap();
        for _ in 0..3 {
            loader.next_batch().unwrap();
        }
        let bytes = encode_state(&loader.state(), fingerprint, workers);
        let fields = STATE_FIELDS.iter().map(|&(n, at, w)| Field::new(n, at, w));
        seeds.push(Seed::new(format!("{mode:?}"), bytes).with_fields(fields));
    }
    let report = fuzz_seeds(
        "loader-state",
        &seeds,
        iterations(CI_ITERATIONS),
        move |b| {
            let (state, workers) = decode_state(b, fingerprint)?;
            let json = serde_json::to_string(&state).unwrap();
            assert_eq!(serde_json::from_str::<LoaderState>(&json).unwrap(), state);
            let mut config = LoaderConfig::new(BATCH);
            config.workers = workers;
            config.output = OutputType::U32;
            let mut loader = Loader::resume(Arc::clone(&ds), &state, config, None)?;
            let mut err = None;
            for _ in 0..3 {
                match loader.next_batch() {
                    Ok(batch) => {
                        let x = batch.inputs_u32().unwrap();
                        assert_eq!(x.len(), BATCH * state.sampler.seq_len as usize);
                        assert!(x.iter().all(|&t| t < 1000));
                    }
                    Err(e) => {
                        assert!(!matches!(e, DataError::WorkerStopped(_)), "{e}");
                        first_error(&mut err, Err(e));
                    }
                }
            }
            let after = loader.state();
            assert_eq!(after.sampler, state.sampler);
            err.map_or(Ok(()), Err)
        },
    );
    check(report);
}

// ---------------------------------------------------------------------------------------------
// Regression tests for what the campaigns (and the audit that went with them) found.

/// Run `f` on its own thread; `None` when it has not finished within `limit` (the thread is
/// then left to finish on its own).
fn within<T: Send + 'static>(
    limit: std::time::Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

/// A valid `.idx` whose `D` document-index entries are `[0, S, S, …, S]`: one document with
/// every sequence, then `D − 2` empty documents at the end. Resolving each empty document
/// used to recompute the total token count (a pass over all `S` lengths), so opening took
/// O(S·D) time: about a minute for this 3 MB index, hours for a real one.
#[test]
fn regression_trailing_empty_documents_open_in_linear_time() {
    const S: usize = 150_000;
    const D: usize = 150_000;
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes());
    idx.push(1); // u8 tokens
    idx.extend((S as u64).to_le_bytes());
    idx.extend((D as u64).to_le_bytes());
    for _ in 0..S {
        idx.extend(1i32.to_le_bytes());
    }
    for i in 0..S {
        idx.extend((i as i64).to_le_bytes());
    }
    idx.extend(0i64.to_le_bytes());
    for _ in 1..D {
        idx.extend((S as i64).to_le_bytes());
    }
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("wide");
    write(&prefix.with_extension("idx"), &idx);
    write(&prefix.with_extension("bin"), &vec![3u8; S]);
    let opened = within(std::time::Duration::from_secs(15), move || {
        megatron::open_megatron(&prefix).map(|ds| {
            let docs = ds.documents().unwrap();
            (docs.len(), docs[0], docs[D - 2])
        })
    });
    let (count, first, last) = opened
        .expect("opening took more than 15 s: quadratic again")
        .unwrap();
    assert_eq!(count, D - 1);
    assert_eq!((first.start, first.len), (0, S as u64));
    assert_eq!((last.start, last.len), (S as u64, 0));
}

/// A saved position at the end of the `u64` range (input #32 of the `loader-state`
/// campaign: `next_batch = 0xffff_ffff_ffff_ffff`) made `Loader::next_batch`, the worker
/// threads and `fill_batch` overflow their batch and row counters: a panic in debug builds,
/// a silent wrap to batch 0 in release builds.
#[test]
fn regression_loader_positions_at_the_end_of_u64_are_typed_errors() {
    let ds = Arc::new(TokenDataset::from_tokens(&tokens(200, 100, 1), TokenType::U16).unwrap());
    let sampler = SamplerConfig {
        mode: SamplingMode::EpochWindows,
        seq_len: 4,
        seed: 1,
        shard: Shard::SINGLE,
    };
    for workers in [0, 2] {
        let mut config = LoaderConfig::new(1);
        config.workers = workers;
        let mut state = Loader::new(Arc::clone(&ds), sampler.clone(), config.clone(), None)
            .unwrap()
            .state();
        state.next_batch = u64::MAX;
        assert!(matches!(
            Loader::resume(Arc::clone(&ds), &state, config.clone(), None),
            Err(DataError::ResumeMismatch(_))
        ));
        // The last representable batch is served; the one after it is an error, not a wrap.
        state.next_batch = u64::MAX - 1;
        let mut loader = Loader::resume(Arc::clone(&ds), &state, config, None).unwrap();
        let first = loader.next_batch().map(|b| b.index());
        assert_eq!(first.unwrap(), u64::MAX - 1, "workers {workers}");
        let second = loader.next_batch().map(|b| b.index());
        assert!(
            matches!(second, Err(DataError::InvalidConfig(_))),
            "workers {workers}: {second:?}"
        );
    }
    let s = WindowSampler::new(&ds, sampler).unwrap();
    let mut buffer = BatchBuffer::new(3, 4, OutputType::U32, None).unwrap();
    for batch in [u64::MAX / 3, u64::MAX] {
        assert!(matches!(
            fill_batch(&ds, &s, batch, &mut buffer),
            Err(DataError::InvalidConfig(_))
        ));
    }
}

/// Batch buffers are sized by a sampler configuration that can come from a saved position;
/// a size no allocator can satisfy (2^59 i64 = 4 EiB, beyond any address space) used to abort
/// the process (`vec![0; n]`), and is now a typed error.
#[test]
fn regression_impossible_batch_buffers_are_typed_errors() {
    let huge = BatchBuffer::new(1 << 29, 1 << 30, OutputType::I64, None);
    assert!(
        matches!(huge, Err(DataError::Allocation(_))),
        "{:?}",
        huge.err()
    );
    assert!(BatchBuffer::new(2, 3, OutputType::I64, None).is_ok());
}
