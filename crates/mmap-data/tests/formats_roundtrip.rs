//! Write → read round trips for every format, shard sets, and format detection.

use headroom_mmap_data::formats::{self, llmc, megatron, raw};
use headroom_mmap_data::{LlmcFlavor, OpenOptions, TokenDataset, TokenFileFormat, TokenType};
use proptest::prelude::*;

fn all_tokens(ds: &TokenDataset) -> Vec<u32> {
    let mut out = Vec::new();
    for seg in ds.segments() {
        let t = seg.tokens();
        out.extend((0..t.len()).map(|i| t.get(i).unwrap() as u32));
    }
    out
}

fn token_type() -> impl Strategy<Value = TokenType> {
    prop_oneof![
        Just(TokenType::U8),
        Just(TokenType::U16),
        Just(TokenType::U32),
        Just(TokenType::I32),
        Just(TokenType::I64),
    ]
}

fn tokens_for(t: TokenType, max_len: usize) -> impl Strategy<Value = Vec<u32>> {
    let max = t.max_token().min(u64::from(u32::MAX)) as u32;
    prop::collection::vec(0..=max, 1..max_len)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn raw_round_trips((t, tokens) in token_type().prop_flat_map(|t| (Just(t), tokens_for(t, 300)))) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.bin");
        raw::write_raw(&p, &tokens, t).unwrap();
        let ds = raw::open_raw(&p, t).unwrap();
        prop_assert!(ds.segments()[0].is_mapped());
        prop_assert_eq!(all_tokens(&ds), tokens);
    }

    #[test]
    fn llmc_round_trips(gpt2 in any::<bool>(), tokens in prop::collection::vec(0u32..=65535, 1..300)) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("shard.bin");
        let flavor = if gpt2 { LlmcFlavor::Gpt2 } else { LlmcFlavor::Llama3 };
        llmc::write_llmc(&p, &tokens, flavor).unwrap();
        let ds = llmc::open_llmc(&p).unwrap();
        prop_assert_eq!(ds.segments()[0].token_type(), if gpt2 { TokenType::U16 } else { TokenType::U32 });
        prop_assert_eq!(&all_tokens(&ds), &tokens);
        // Detection picks llm.c over raw.
        let auto = formats::open(&p, &OpenOptions::default()).unwrap();
        prop_assert_eq!(all_tokens(&auto), tokens);
    }

    #[test]
    fn megatron_round_trips(
        t in prop_oneof![Just(TokenType::U8), Just(TokenType::U16), Just(TokenType::I32), Just(TokenType::I64)],
        docs in prop::collection::vec(prop::collection::vec(0u32..256, 0..40), 1..12),
    ) {
        prop_assume!(docs.iter().any(|d| !d.is_empty()));
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("corpus_text_document");
        megatron::write_megatron(&prefix, &docs, t).unwrap();
        for opened in [
            megatron::open_megatron(&prefix).unwrap(),
            formats::open(prefix.with_extension("idx"), &OpenOptions::default()).unwrap(),
            formats::open(&prefix, &OpenOptions::default()).unwrap(),
        ] {
            let flat: Vec<u32> = docs.iter().flatten().copied().collect();
            prop_assert_eq!(all_tokens(&opened), flat);
            let got = opened.documents().unwrap();
            prop_assert_eq!(got.len(), docs.len());
            for (d, want) in got.iter().zip(&docs) {
                let toks: Vec<u32> = (0..d.len).map(|i| opened.token(d.segment, d.start + i).unwrap() as u32).collect();
                prop_assert_eq!(&toks, want);
            }
        }
    }

    /// The sequence table of a file from the crate's writer: one sequence per document, its
    /// length, start, boundaries and lookup by token all agree with what was written, and with
    /// the document spans.
    #[test]
    fn megatron_sequence_boundaries_match_what_was_written(
        t in prop_oneof![Just(TokenType::U8), Just(TokenType::U16), Just(TokenType::I32), Just(TokenType::I64)],
        docs in prop::collection::vec(prop::collection::vec(0u32..256, 0..30), 1..10),
    ) {
        prop_assume!(docs.iter().any(|d| !d.is_empty()));
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("corpus");
        megatron::write_megatron(&prefix, &docs, t).unwrap();
        let ds = megatron::open_megatron(&prefix).unwrap();
        prop_assert!(ds.sequence_index(1).is_none());
        let seq = ds.sequence_index(0).unwrap();
        prop_assert_eq!(seq.len(), docs.len());
        prop_assert_eq!(seq.document_count(), docs.len());
        let mut want = vec![0u64];
        for d in &docs {
            want.push(want.last().unwrap() + d.len() as u64);
        }
        prop_assert_eq!(seq.boundaries().collect::<Vec<_>>(), want.clone());
        for (i, d) in docs.iter().enumerate() {
            prop_assert_eq!(seq.length(i), Some(d.len() as u64));
            prop_assert_eq!(seq.start(i), Some(want[i]));
            prop_assert_eq!(seq.span(i), Some(want[i]..want[i + 1]));
            prop_assert_eq!(seq.document_sequences(i), Some(i..i + 1));
            let doc = ds.documents().unwrap()[i];
            prop_assert_eq!((doc.start, doc.len), (want[i], d.len() as u64));
            for token in want[i]..want[i + 1] {
                prop_assert_eq!(seq.sequence_at(token), Some(i));
            }
        }
        let end = *want.last().unwrap();
        prop_assert_eq!(seq.sequence_at(end), None);
        prop_assert_eq!(seq.span(docs.len()), None);
        prop_assert_eq!(seq.document_sequences(docs.len()), None);
        // Through `formats::open` and its .idx path too.
        let via_open = formats::open(prefix.with_extension("idx"), &OpenOptions::default()).unwrap();
        prop_assert_eq!(via_open.sequence_index(0).unwrap().boundaries().collect::<Vec<_>>(), want);
    }

    #[test]
    fn directory_and_glob_open_shards_in_name_order(shards in prop::collection::vec(prop::collection::vec(0u32..1000, 1..50), 1..5)) {
        let dir = tempfile::tempdir().unwrap();
        for (i, s) in shards.iter().enumerate() {
            // Mix formats: detection must handle each shard on its own.
            let p = dir.path().join(format!("shard_{i:03}.bin"));
            if i % 2 == 0 {
                raw::write_raw(&p, s, TokenType::U16).unwrap();
            } else {
                llmc::write_llmc(&p, s, LlmcFlavor::Gpt2).unwrap();
            }
        }
        std::fs::write(dir.path().join("notes.txt"), b"ignored by the glob").unwrap();
        let flat: Vec<u32> = shards.iter().flatten().copied().collect();
        let glob = formats::open(dir.path().join("shard_*.bin"), &OpenOptions::default()).unwrap();
        prop_assert_eq!(glob.segments().len(), shards.len());
        prop_assert_eq!(all_tokens(&glob), flat.clone());
        std::fs::remove_file(dir.path().join("notes.txt")).unwrap();
        let whole = formats::open(dir.path(), &OpenOptions::default()).unwrap();
        prop_assert_eq!(all_tokens(&whole), flat);
    }
}

#[test]
fn directory_of_megatron_pairs_keeps_documents() {
    let dir = tempfile::tempdir().unwrap();
    megatron::write_megatron(
        dir.path().join("a"),
        &[vec![1, 2, 3], vec![4, 5]],
        TokenType::U16,
    )
    .unwrap();
    megatron::write_megatron(dir.path().join("b"), &[vec![6, 7, 8, 9]], TokenType::U16).unwrap();
    let ds = formats::open(dir.path(), &OpenOptions::default()).unwrap();
    assert_eq!(ds.segments().len(), 2);
    let docs = ds.documents().unwrap();
    assert_eq!(docs.len(), 3);
    assert_eq!((docs[2].segment, docs[2].start, docs[2].len), (1, 0, 4));
    assert_eq!(all_tokens(&ds), [1, 2, 3, 4, 5, 6, 7, 8, 9]);
    // Each pair keeps its own sequence table, in its own segment's token positions.
    let a: Vec<u64> = ds.sequence_index(0).unwrap().boundaries().collect();
    let b: Vec<u64> = ds.sequence_index(1).unwrap().boundaries().collect();
    assert_eq!((a, b), (vec![0, 3, 5], vec![0, 4]));
}

/// Formats without a sequence table have none; a mixed shard set has one exactly for its
/// Megatron segments.
#[test]
fn sequence_boundaries_exist_only_for_megatron_segments() {
    let dir = tempfile::tempdir().unwrap();
    raw::write_raw(dir.path().join("0.bin"), &[1, 2, 3], TokenType::U16).unwrap();
    llmc::write_llmc(dir.path().join("1.bin"), &[4, 5], LlmcFlavor::Gpt2).unwrap();
    megatron::write_megatron(dir.path().join("2"), &[vec![6], vec![7, 8]], TokenType::U16).unwrap();
    let ds = formats::open(dir.path(), &OpenOptions::default()).unwrap();
    assert_eq!(ds.segments().len(), 3);
    assert!(ds.sequence_index(0).is_none() && ds.sequence_index(1).is_none());
    let seq = ds.sequence_index(2).unwrap();
    assert_eq!(seq.boundaries().collect::<Vec<_>>(), [0, 1, 3]);
    assert!(ds.sequence_index(3).is_none());
    assert!(ds.documents().is_none(), "not every shard has documents");
    let memory = TokenDataset::from_documents(&[vec![1], vec![2]], TokenType::U16).unwrap();
    assert!(memory.sequence_index(0).is_none());
}

/// Megatron-LM's sentence-split datasets put several sequences in one document; the crate's
/// writer never does, so this index is built by hand: 3 sequences (2, 0 and 3 tokens), two
/// documents `[0, 2)` and `[2, 3)`.
#[test]
fn documents_of_several_sequences_map_to_their_sequence_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("split");
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes());
    idx.push(8); // uint16
    idx.extend(3u64.to_le_bytes());
    idx.extend(3u64.to_le_bytes());
    for len in [2i32, 0, 3] {
        idx.extend(len.to_le_bytes());
    }
    for pointer in [0i64, 4, 4] {
        idx.extend(pointer.to_le_bytes());
    }
    for d in [0i64, 2, 3] {
        idx.extend(d.to_le_bytes());
    }
    std::fs::write(prefix.with_extension("idx"), idx).unwrap();
    let bin: Vec<u8> = [10u16, 11, 12, 13, 14]
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .collect();
    std::fs::write(prefix.with_extension("bin"), bin).unwrap();
    let ds = megatron::open_megatron(&prefix).unwrap();
    let seq = ds.sequence_index(0).unwrap();
    assert_eq!(seq.boundaries().collect::<Vec<_>>(), [0, 2, 2, 5]);
    assert_eq!(seq.document_count(), 2);
    assert_eq!(seq.document_sequences(0), Some(0..2));
    assert_eq!(seq.document_sequences(1), Some(2..3));
    assert_eq!(seq.sequence_at(1), Some(0));
    assert_eq!(
        seq.sequence_at(2),
        Some(2),
        "the empty sequence 1 holds no token"
    );
    let docs = ds.documents().unwrap();
    assert_eq!((docs[0].start, docs[0].len), (0, 2));
    assert_eq!((docs[1].start, docs[1].len), (2, 3));
}

#[test]
fn write_tokens_dispatches_every_format() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..100).collect();
    for (name, f) in [
        ("r.bin", TokenFileFormat::Raw(TokenType::U32)),
        ("l.bin", TokenFileFormat::Llmc(LlmcFlavor::Llama3)),
        (
            "m",
            TokenFileFormat::Megatron {
                token_type: TokenType::U16,
                document_len: 30,
            },
        ),
    ] {
        let p = dir.path().join(name);
        formats::write_tokens(&p, &tokens, f).unwrap();
        let ds = formats::open(
            &p,
            &OpenOptions {
                raw_token_type: TokenType::U32,
            },
        )
        .unwrap();
        assert_eq!(all_tokens(&ds), tokens, "{name}");
        if name == "m" {
            let lens: Vec<u64> = ds.documents().unwrap().iter().map(|d| d.len).collect();
            assert_eq!(lens, [30, 30, 30, 10]);
        }
    }
}

#[test]
fn writers_refuse_tokens_that_do_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.bin");
    let err = raw::write_raw(&p, &[1, 70_000], TokenType::U16).unwrap_err();
    assert!(
        matches!(
            err,
            headroom_mmap_data::DataError::TokenTooWide {
                index: 1,
                value: 70_000,
                ..
            }
        ),
        "{err}"
    );
    assert!(!p.exists(), "nothing written on error");
    assert!(
        megatron::write_megatron(&p, &[vec![1]], TokenType::U32).is_err(),
        "Megatron has no u32 code"
    );
}
