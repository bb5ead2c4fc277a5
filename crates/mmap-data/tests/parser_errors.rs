//! Bad input gets a typed error — specific cases, then fuzz-style random bytes and mutations.

use headroom_mmap_data::formats::llmc::{parse_llmc, write_llmc, LLMC_HEADER_BYTES};
use headroom_mmap_data::formats::megatron::{write_megatron, MegatronIndex};
use headroom_mmap_data::formats::raw::{open_raw, raw_token_count, write_raw};
use headroom_mmap_data::formats::{self, megatron};
use headroom_mmap_data::{
    DataError, LlmcFlavor, Loader, LoaderConfig, OpenOptions, SamplerConfig, SamplingMode, Shard,
    TokenDataset, TokenType, WindowSampler,
};
use proptest::prelude::*;
use std::sync::Arc;

fn llmc_bytes(tokens: &[u32], flavor: LlmcFlavor) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.bin");
    write_llmc(&p, tokens, flavor).unwrap();
    std::fs::read(p).unwrap()
}

fn megatron_bytes(docs: &[Vec<u32>], t: TokenType) -> (Vec<u8>, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m");
    write_megatron(&p, docs, t).unwrap();
    (
        std::fs::read(p.with_extension("idx")).unwrap(),
        std::fs::read(p.with_extension("bin")).unwrap(),
    )
}

#[test]
fn llmc_errors_are_typed() {
    let good = llmc_bytes(&[1, 2, 3], LlmcFlavor::Gpt2);
    assert_eq!(parse_llmc(&good, "s").unwrap().num_tokens, 3);
    assert!(matches!(parse_llmc(&[], "s"), Err(DataError::Empty { .. })));
    assert!(matches!(
        parse_llmc(&good[..3], "s"),
        Err(DataError::Truncated { .. })
    ));
    assert!(matches!(
        parse_llmc(&good[..100], "s"),
        Err(DataError::Truncated { .. })
    ));
    assert!(matches!(
        parse_llmc(&good[..good.len() - 1], "s"),
        Err(DataError::Truncated { .. })
    ));
    let mut long = good.clone();
    long.push(0);
    assert!(matches!(
        parse_llmc(&long, "s"),
        Err(DataError::Corrupt { .. })
    ));
    let mut bad = good.clone();
    bad[0] ^= 1;
    assert!(matches!(
        parse_llmc(&bad, "s"),
        Err(DataError::BadMagic { .. })
    ));
    let mut v = good.clone();
    v[4] = 2;
    assert!(matches!(
        parse_llmc(&v, "s"),
        Err(DataError::UnsupportedVersion { found: 2, .. })
    ));
    let mut neg = good.clone();
    neg[8..12].copy_from_slice(&(-1i32).to_le_bytes());
    assert!(matches!(
        parse_llmc(&neg, "s"),
        Err(DataError::Corrupt { .. })
    ));
    let mut zero = good[..LLMC_HEADER_BYTES].to_vec();
    zero[8..12].copy_from_slice(&0i32.to_le_bytes());
    assert!(matches!(
        parse_llmc(&zero, "s"),
        Err(DataError::Empty { .. })
    ));
}

#[test]
fn megatron_errors_are_typed() {
    let (idx, bin) = megatron_bytes(&[vec![1, 2, 3], vec![4, 5]], TokenType::U16);
    let n = bin.len() as u64;
    assert!(MegatronIndex::parse(&idx, n, "m").is_ok());
    assert!(matches!(
        MegatronIndex::parse(&idx, n - 2, "m"),
        Err(DataError::PointerOutOfBounds { sequence: 1, .. })
    ));
    assert!(matches!(
        MegatronIndex::parse(&idx, n + 2, "m"),
        Err(DataError::Corrupt { .. })
    ));
    assert!(matches!(
        MegatronIndex::parse(&idx[..5], n, "m"),
        Err(DataError::Truncated { .. })
    ));
    assert!(matches!(
        MegatronIndex::parse(&idx[..idx.len() - 1], n, "m"),
        Err(DataError::Truncated { .. })
    ));
    assert!(matches!(
        MegatronIndex::parse(b"NOTMAGIC!", n, "m"),
        Err(DataError::BadMagic { .. })
    ));
    let mut v = idx.clone();
    v[9] = 2;
    assert!(matches!(
        MegatronIndex::parse(&v, n, "m"),
        Err(DataError::UnsupportedVersion { found: 2, .. })
    ));
    let mut d = idx.clone();
    d[17] = 7; // float32
    assert!(matches!(
        MegatronIndex::parse(&d, n, "m"),
        Err(DataError::UnsupportedDtype { code: 7, .. })
    ));
    // Pointer of sequence 1 moved past the end of .bin.
    let mut p = idx.clone();
    let ptr1 = 34 + 2 * 4 + 8;
    p[ptr1..ptr1 + 8].copy_from_slice(&1000i64.to_le_bytes());
    assert!(matches!(
        MegatronIndex::parse(&p, n, "m"),
        Err(DataError::PointerOutOfBounds { sequence: 1, .. })
    ));
    // Huge counts must not allocate or overflow.
    let mut huge = idx.clone();
    huge[18..26].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        MegatronIndex::parse(&huge, n, "m"),
        Err(DataError::Truncated { .. })
    ));
    // Document index not ending at the sequence count.
    let mut di = idx.clone();
    let last = di.len() - 8;
    di[last..].copy_from_slice(&1i64.to_le_bytes());
    assert!(matches!(
        MegatronIndex::parse(&di, n, "m"),
        Err(DataError::Corrupt { .. })
    ));
    // Multimodal mode bytes are accepted, other trailing bytes are not.
    let mut modes = idx.clone();
    modes.extend([0, 0]);
    assert!(MegatronIndex::parse(&modes, n, "m").is_ok());
    modes.push(0);
    assert!(matches!(
        MegatronIndex::parse(&modes, n, "m"),
        Err(DataError::Corrupt { .. })
    ));
}

#[test]
fn raw_and_file_errors_are_typed() {
    assert!(matches!(
        raw_token_count(0, TokenType::U16, "x"),
        Err(DataError::Empty { .. })
    ));
    assert!(matches!(
        raw_token_count(5, TokenType::U16, "x"),
        Err(DataError::OddLength {
            bytes: 5,
            width: 2,
            ..
        })
    ));
    assert!(matches!(
        raw_token_count(6, TokenType::U32, "x"),
        Err(DataError::OddLength { .. })
    ));
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.bin");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        open_raw(&empty, TokenType::U16),
        Err(DataError::Empty { .. })
    ));
    let odd = dir.path().join("odd.bin");
    std::fs::write(&odd, [1u8, 2, 3]).unwrap();
    assert!(matches!(
        open_raw(&odd, TokenType::U16),
        Err(DataError::OddLength { .. })
    ));
    assert!(matches!(
        open_raw(dir.path().join("missing"), TokenType::U16),
        Err(DataError::Io { .. })
    ));
    assert!(matches!(
        formats::open(dir.path().join("nothing_*.bin"), &OpenOptions::default()),
        Err(DataError::Empty { .. })
    ));
    // .idx present but .bin missing.
    let (idx, _) = megatron_bytes(&[vec![1, 2]], TokenType::U16);
    std::fs::write(dir.path().join("lonely.idx"), idx).unwrap();
    assert!(matches!(
        megatron::open_megatron(dir.path().join("lonely")),
        Err(DataError::Io { .. })
    ));
}

#[test]
fn windows_and_vocab_errors_are_typed() {
    let ds = Arc::new(
        TokenDataset::from_tokens(&[1, 2, 3, 4, 5], TokenType::U16)
            .unwrap()
            .with_vocab_size(4),
    );
    let cfg = |seq_len| SamplerConfig {
        mode: SamplingMode::EpochWindows,
        seq_len,
        seed: 0,
        shard: Shard::SINGLE,
    };
    assert!(matches!(
        WindowSampler::new(&ds, cfg(5)),
        Err(DataError::WindowTooLong {
            window: 6,
            longest: 5
        })
    ));
    assert!(matches!(
        WindowSampler::new(&ds, cfg(0)),
        Err(DataError::InvalidConfig(_))
    ));
    let docs_needed = SamplerConfig {
        mode: SamplingMode::DocumentWindows,
        ..cfg(2)
    };
    assert!(matches!(
        WindowSampler::new(&ds, docs_needed),
        Err(DataError::InvalidConfig(_))
    ));
    let bad_shard = SamplerConfig {
        shard: Shard { rank: 2, world: 2 },
        ..cfg(2)
    };
    assert!(matches!(
        WindowSampler::new(&ds, bad_shard),
        Err(DataError::InvalidConfig(_))
    ));
    // Tokens 4 and 5 are outside the vocabulary of 4.
    assert!(matches!(
        ds.validate_tokens(),
        Err(DataError::TokenOutOfRange {
            position: 3,
            value: 4,
            vocab_size: 4,
            ..
        })
    ));
    let mut config = LoaderConfig::new(2);
    config.workers = 0;
    let mut loader = Loader::new(Arc::clone(&ds), cfg(2), config, None).unwrap();
    let err = loader.next_batch().unwrap_err();
    assert!(
        matches!(err, DataError::TokenOutOfRange { value: 4 | 5, .. }),
        "{err}"
    );
    assert!(matches!(
        TokenDataset::from_tokens(&[], TokenType::U16),
        Err(DataError::Empty { .. })
    ));
}

/// Mutations of a valid file: flip, overwrite, truncate, extend.
fn mutate(mut bytes: Vec<u8>, ops: &[(u8, usize, u8)]) -> Vec<u8> {
    for &(op, at, val) in ops {
        let len = bytes.len().max(1);
        match op % 4 {
            0 => {
                if let Some(b) = bytes.get_mut(at % len) {
                    *b ^= val | 1;
                }
            }
            1 => {
                let i = at % len;
                if i + 8 <= bytes.len() {
                    bytes[i..i + 8].copy_from_slice(&(val as i64 * 1_000_003 - 500).to_le_bytes());
                }
            }
            2 => bytes.truncate(at % len),
            _ => bytes.extend(std::iter::repeat_n(val, at % 17)),
        }
    }
    bytes
}

fn ops() -> impl Strategy<Value = Vec<(u8, usize, u8)>> {
    prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 1..6)
}

/// Opening through files exercises the whole stack (map, detect, parse, segment).
fn open_all_ways(dir: &std::path::Path, bytes: &[u8]) {
    let p = dir.join("f.bin");
    std::fs::write(&p, bytes).unwrap();
    for t in [
        TokenType::U8,
        TokenType::U16,
        TokenType::U32,
        TokenType::I64,
    ] {
        if let Ok(ds) = formats::open(&p, &OpenOptions { raw_token_type: t }) {
            let _ = ds.validate_tokens();
            let s = SamplerConfig {
                mode: SamplingMode::RandomWindows,
                seq_len: 3,
                seed: 1,
                shard: Shard::SINGLE,
            };
            if let Ok(sampler) = WindowSampler::new(&ds, s) {
                for pos in 0..4 {
                    let w = sampler.window(pos);
                    assert!(w.start + 4 <= ds.segments()[w.segment].len() as u64);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2048), bin_len in 0u64..4096) {
        let _ = parse_llmc(&bytes, "fuzz");
        let _ = MegatronIndex::parse(&bytes, bin_len, "fuzz");
        let _ = raw_token_count(bytes.len() as u64, TokenType::U16, "fuzz");
        let mut with_magic = b"MMIDIDX\x00\x00".to_vec();
        with_magic.extend(&bytes);
        let _ = MegatronIndex::parse(&with_magic, bin_len, "fuzz");
        let mut with_llmc = 20240520i32.to_le_bytes().to_vec();
        with_llmc.extend(&bytes);
        let _ = parse_llmc(&with_llmc, "fuzz");
    }

    #[test]
    fn mutated_llmc_never_panics(tokens in prop::collection::vec(0u32..65536, 1..64), ops in ops(), gpt2 in any::<bool>()) {
        let flavor = if gpt2 { LlmcFlavor::Gpt2 } else { LlmcFlavor::Llama3 };
        let bytes = mutate(llmc_bytes(&tokens, flavor), &ops);
        if let Ok(h) = parse_llmc(&bytes, "fuzz") {
            // Whatever was accepted is self-consistent.
            prop_assert_eq!(bytes.len() as u64, LLMC_HEADER_BYTES as u64 + h.num_tokens * h.token_type().width() as u64);
        }
        let dir = tempfile::tempdir().unwrap();
        open_all_ways(dir.path(), &bytes);
    }

    #[test]
    fn mutated_megatron_never_panics(
        docs in prop::collection::vec(prop::collection::vec(0u32..256, 1..20), 1..6),
        idx_ops in ops(),
        bin_ops in prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 0..2),
    ) {
        let (idx, bin) = megatron_bytes(&docs, TokenType::U16);
        let idx = mutate(idx, &idx_ops);
        let bin = mutate(bin, &bin_ops);
        if let Ok(index) = MegatronIndex::parse(&idx, bin.len() as u64, "fuzz") {
            for (p, &n) in index.sequence_pointers.iter().zip(&index.sequence_lengths) {
                prop_assert!(p + u64::from(n) * 2 <= bin.len() as u64);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("m.idx"), &idx).unwrap();
        std::fs::write(dir.path().join("m.bin"), &bin).unwrap();
        if let Ok(ds) = megatron::open_megatron(dir.path().join("m")) {
            for d in ds.documents().unwrap() {
                prop_assert!(ds.token(d.segment, d.start + d.len.saturating_sub(1)).is_some() || d.len == 0);
            }
            let s = SamplerConfig { mode: SamplingMode::DocumentWindows, seq_len: 2, seed: 3, shard: Shard::SINGLE };
            if let Ok(sampler) = WindowSampler::new(&ds, s) {
                for pos in 0..8 {
                    let w = sampler.window(pos);
                    prop_assert!(ds.token(w.segment, w.start + 2).is_some());
                }
            }
        }
    }

    #[test]
    fn mutated_raw_never_panics(tokens in prop::collection::vec(any::<u32>(), 1..64), ops in ops()) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.bin");
        write_raw(&p, &tokens, TokenType::U32).unwrap();
        let bytes = mutate(std::fs::read(&p).unwrap(), &ops);
        open_all_ways(dir.path(), &bytes);
    }
}
