//! Position ids per document: the index's answer and the loader's batches against a plain
//! reference built from the documents' lengths; documents ended by a separator token against
//! Megatron-LM's own masks (`fixtures/megatron_eod.json`, written by
//! `benches/torch/make_eod_documents_fixture.py`) and against the same documents' index.

use std::sync::Arc;

use headroom_mmap_data::formats::megatron::{open_megatron, write_megatron};
use headroom_mmap_data::{
    loss_mask_path, write_loss_mask, DataError, DocumentBoundaries, Loader, LoaderConfig,
    OutputType, SamplerConfig, SamplingMode, Shard, TokenDataset, TokenType, WindowSampler,
};
use proptest::prelude::*;

/// Documents of the given lengths (some empty), token ids counting up.
fn documents(lengths: &[usize]) -> Vec<Vec<u32>> {
    let mut next = 0u32;
    lengths
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    next += 1;
                    next % 1000
                })
                .collect()
        })
        .collect()
}

/// Whether each token of the file starts a document, from the lengths alone.
fn starts(lengths: &[usize]) -> Vec<bool> {
    let mut out = Vec::new();
    for &n in lengths {
        out.extend((0..n).map(|i| i == 0));
    }
    out
}

/// Position ids of `len` tokens from `start`: 0 at `start` and at each document's first token.
fn reference_positions(starts: &[bool], start: usize, len: usize) -> Vec<u32> {
    let mut p = 0u32;
    (start..start + len)
        .map(|i| {
            p = if i == start || starts[i] { 0 } else { p + 1 };
            p
        })
        .collect()
}

fn written(lengths: &[usize], dir: &tempfile::TempDir) -> TokenDataset {
    let prefix = dir.path().join("docs");
    write_megatron(&prefix, &documents(lengths), TokenType::U16).unwrap();
    open_megatron(&prefix).unwrap()
}

/// The tokens of `documents` in a row, and each with its separator appended (the last one's
/// only when `closed`): the same documents for a raw file and for a Megatron index.
fn separated(documents: &[Vec<u32>], closed: bool) -> (Vec<u32>, Vec<Vec<u32>>) {
    let ended: Vec<Vec<u32>> = documents
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut d: Vec<u32> = d.iter().map(|&t| t % SEPARATOR).collect();
            if closed || i + 1 < documents.len() {
                d.push(SEPARATOR);
            }
            d
        })
        .collect();
    (ended.concat(), ended)
}

/// The separator of the separator-ended documents (an id no document's own tokens use).
const SEPARATOR: u32 = 999;

/// One batch's inputs, targets, positions and flags, as plain vectors.
fn batch_contents(loader: &mut Loader) -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<bool>) {
    let b = loader.next_batch().unwrap();
    (
        b.inputs_u32().unwrap().to_vec(),
        b.targets_u32().unwrap().to_vec(),
        b.positions().unwrap().to_vec(),
        b.target_flags().unwrap().to_vec(),
    )
}

/// Epoch-ordered windows of `seq_len` tokens, one shard.
fn epoch_windows(seq_len: u64, seed: u64) -> SamplerConfig {
    SamplerConfig {
        mode: SamplingMode::EpochWindows,
        seq_len,
        seed,
        shard: Shard::SINGLE,
    }
}

fn lengths() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(prop_oneof![Just(0usize), 1usize..12, 12usize..40], 1..24)
        .prop_filter("some tokens", |l| l.iter().sum::<usize>() >= 2)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn index_positions_restart_at_every_document(lengths in lengths(), from in 0usize..1000, len in 1usize..80) {
        let dir = tempfile::tempdir().unwrap();
        let data = written(&lengths, &dir);
        let total: usize = lengths.iter().sum();
        let start = from % total;
        let len = len.min(total - start);
        let index = data.sequence_index(0).unwrap();
        let mut got = vec![u32::MAX; len];
        index.document_positions(start as u64, &mut got).unwrap();
        prop_assert_eq!(got, reference_positions(&starts(&lengths), start, len));
        // Every token's document is the last one starting at or before it.
        let first_tokens = starts(&lengths);
        let doc = index.document_at(start as u64).unwrap();
        prop_assert!(index.document_start(doc).unwrap() <= start as u64);
        let own = (0..=start).rev().find(|&i| first_tokens[i]).unwrap();
        prop_assert_eq!(index.document_start(doc), Some(own as u64));
    }

    #[test]
    fn loader_positions_and_flags_match_the_documents(
        lengths in lengths(),
        seq in 1u64..20,
        batch in 1usize..4,
        workers in 0usize..3,
        random in any::<bool>(),
        masked in any::<bool>(),
    ) {
        let total: usize = lengths.iter().sum();
        prop_assume!(total as u64 > seq);
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("docs");
        write_megatron(&prefix, &documents(&lengths), TokenType::U16).unwrap();
        // A loss mask that keeps every third token, to check the two combine.
        let mask: Vec<bool> = (0..total).map(|i| i % 3 != 1).collect();
        if masked {
            write_loss_mask(loss_mask_path(&prefix.with_extension("bin")), &mask).unwrap();
        }
        let data = Arc::new(headroom_mmap_data::open(&prefix, &Default::default()).unwrap());
        prop_assert_eq!(data.has_loss_mask(), masked);
        let sampler = SamplerConfig {
            mode: if random { SamplingMode::RandomWindows } else { SamplingMode::EpochWindows },
            seq_len: seq,
            seed: 7,
            shard: Shard::SINGLE,
        };
        let config = LoaderConfig {
            output: OutputType::U32,
            workers,
            documents: Some(DocumentBoundaries::Index),
            ..LoaderConfig::new(batch)
        };
        let windows = WindowSampler::new(&data, sampler.clone()).unwrap();
        let mut loader = Loader::new(Arc::clone(&data), sampler, config, None).unwrap();
        let first = starts(&lengths);
        let t = seq as usize;
        for b in 0..3u64 {
            let got = loader.next_batch().unwrap();
            let positions = got.positions().unwrap();
            let flags = got.target_flags().unwrap();
            for row in 0..batch {
                let w = windows.window(b * batch as u64 + row as u64);
                let start = w.start as usize;
                let want = reference_positions(&first, start, t + 1);
                prop_assert_eq!(&positions[row * t..(row + 1) * t], &want[..t]);
                for c in 0..t {
                    // Target c is token start + c + 1: it counts when the mask keeps it and it
                    // does not start a document.
                    let keep = (!masked || mask[start + c + 1]) && want[c + 1] != 0;
                    prop_assert_eq!(flags[row * t + c], keep, "row {} col {}", row, c);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A raw stream whose documents each end with the separator loads batch for batch as the
    /// Megatron pair of the same documents does with its index: the same inputs, targets,
    /// position ids and flags.
    #[test]
    fn separated_documents_load_as_their_index_does(
        lengths in lengths(),
        closed in any::<bool>(),
        seq in 1u64..20,
        batch in 1usize..4,
        workers in 0usize..3,
        random in any::<bool>(),
    ) {
        let (stream, ended) = separated(&documents(&lengths), closed);
        prop_assume!(stream.len() as u64 > seq);
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("docs");
        write_megatron(&prefix, &ended, TokenType::U16).unwrap();
        let indexed = Arc::new(open_megatron(&prefix).unwrap());
        let raw = Arc::new(TokenDataset::from_tokens(&stream, TokenType::U16).unwrap());
        let sampler = SamplerConfig {
            mode: if random { SamplingMode::RandomWindows } else { SamplingMode::EpochWindows },
            seq_len: seq,
            seed: 3,
            shard: Shard::SINGLE,
        };
        let config = |documents| LoaderConfig {
            output: OutputType::U32,
            workers,
            documents: Some(documents),
            ..LoaderConfig::new(batch)
        };
        let mut by_index =
            Loader::new(indexed, sampler.clone(), config(DocumentBoundaries::Index), None).unwrap();
        let mut by_separator = Loader::new(
            raw,
            sampler,
            config(DocumentBoundaries::EndsWith(SEPARATOR)),
            None,
        )
        .unwrap();
        for _ in 0..3 {
            prop_assert_eq!(batch_contents(&mut by_separator), batch_contents(&mut by_index));
        }
        // The segment's own answer (what `evaluate` reads) agrees, for any span.
        let total = stream.len() as u64;
        for start in [0, 1, total / 3, total / 2, total - 1] {
            let len = (total - start).min(seq + 7) as usize;
            let (mut got, mut want) = (vec![u32::MAX; len], vec![u32::MAX; len]);
            by_separator.dataset().segments()[0]
                .document_positions(DocumentBoundaries::EndsWith(SEPARATOR), start, &mut got)
                .unwrap();
            by_index.dataset().segments()[0]
                .document_positions(DocumentBoundaries::Index, start, &mut want)
                .unwrap();
            prop_assert_eq!(got, want, "start {}", start);
        }
    }
}

#[derive(serde::Deserialize)]
struct MegatronFixture {
    megatron_core: String,
    eod: u32,
    vocab: u32,
    cases: Vec<MegatronWindow>,
}

#[derive(serde::Deserialize)]
struct MegatronWindow {
    seq: usize,
    text: Vec<u32>,
    position_ids: Vec<u32>,
    loss_mask: Vec<u8>,
    first_visible: Vec<usize>,
}

/// Megatron-LM's `--reset-position-ids --reset-attention-mask --eod-mask-loss` of a sample:
/// the loader's positions are its position ids, its flags its loss mask, and each row's
/// document start (`row − position`) the first key its attention mask shows that row.
#[test]
fn separator_documents_match_megatron_lm() {
    let fixture: MegatronFixture =
        serde_json::from_str(include_str!("fixtures/megatron_eod.json")).unwrap();
    assert!(!fixture.megatron_core.is_empty());
    assert!(fixture.cases.len() >= 8);
    let mut restarts = 0;
    for case in &fixture.cases {
        let t = case.seq;
        assert_eq!(case.text.len(), t + 1);
        // Exactly one window: the whole text.
        let data = Arc::new(
            TokenDataset::from_tokens(&case.text, TokenType::U16)
                .unwrap()
                .with_vocab_size(fixture.vocab),
        );
        let sampler = epoch_windows(t as u64, 0);
        let config = LoaderConfig {
            output: OutputType::U32,
            workers: 0,
            documents: Some(DocumentBoundaries::EndsWith(fixture.eod)),
            ..LoaderConfig::new(1)
        };
        let mut loader = Loader::new(data, sampler, config, None).unwrap();
        let batch = loader.next_batch().unwrap();
        assert_eq!(batch.inputs_u32().unwrap(), &case.text[..t]);
        let positions = batch.positions().unwrap();
        assert_eq!(positions, &case.position_ids[..], "seq {t}");
        let flags: Vec<u8> = batch
            .target_flags()
            .unwrap()
            .iter()
            .map(|&f| f as u8)
            .collect();
        assert_eq!(flags, case.loss_mask, "seq {t}");
        let starts: Vec<usize> = positions
            .iter()
            .enumerate()
            .map(|(row, &p)| row - p as usize)
            .collect();
        assert_eq!(starts, case.first_visible, "seq {t}");
        restarts += positions[1..].iter().filter(|&&p| p == 0).count();
    }
    // The fixture does split documents inside its windows.
    assert!(restarts > 10, "{restarts}");
}

#[test]
fn a_separator_outside_the_vocabulary_is_refused() {
    let tokens: Vec<u32> = (0..100).collect();
    let data = Arc::new(
        TokenDataset::from_tokens(&tokens, TokenType::U16)
            .unwrap()
            .with_vocab_size(100),
    );
    let sampler = epoch_windows(8, 1);
    let config = |separator| LoaderConfig {
        documents: Some(DocumentBoundaries::EndsWith(separator)),
        ..LoaderConfig::new(2)
    };
    let e = Loader::new(Arc::clone(&data), sampler.clone(), config(100), None)
        .err()
        .unwrap();
    assert!(matches!(e, DataError::InvalidConfig(_)), "{e}");
    assert!(e.to_string().contains("token 100"), "{e}");
    assert!(Loader::new(data, sampler, config(99), None).is_ok());
}

#[test]
fn data_without_document_boundaries_is_refused_by_name() {
    let tokens: Vec<u32> = (0..100).collect();
    let data = Arc::new(TokenDataset::from_tokens(&tokens, TokenType::U16).unwrap());
    let sampler = epoch_windows(8, 1);
    let config = LoaderConfig {
        documents: Some(DocumentBoundaries::Index),
        ..LoaderConfig::new(2)
    };
    let e = Loader::new(data, sampler, config, None).err().unwrap();
    assert!(matches!(e, DataError::InvalidConfig(_)), "{e}");
    assert!(e.to_string().contains("Megatron"), "{e}");
}

#[test]
fn one_document_gives_plain_positions_and_counts_every_target() {
    let dir = tempfile::tempdir().unwrap();
    let data = Arc::new(written(&[50], &dir));
    let sampler = epoch_windows(7, 1);
    let config = LoaderConfig {
        output: OutputType::U32,
        workers: 0,
        documents: Some(DocumentBoundaries::Index),
        ..LoaderConfig::new(3)
    };
    let mut loader = Loader::new(data, sampler, config, None).unwrap();
    let batch = loader.next_batch().unwrap();
    let want: Vec<u32> = (0..3).flat_map(|_| 0..7).collect();
    assert_eq!(batch.positions().unwrap(), &want[..]);
    assert!(batch.target_flags().unwrap().iter().all(|&f| f));
}
