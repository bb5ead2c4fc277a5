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
