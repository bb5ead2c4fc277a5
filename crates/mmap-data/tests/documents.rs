//! Position ids per document: the index's answer and the loader's batches against a plain
//! reference built from the documents' lengths.

use std::sync::Arc;

use headroom_mmap_data::formats::megatron::{open_megatron, write_megatron};
use headroom_mmap_data::{
    loss_mask_path, write_loss_mask, DataError, Loader, LoaderConfig, OutputType, SamplerConfig,
    SamplingMode, Shard, TokenDataset, TokenType, WindowSampler,
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
            documents: true,
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

#[test]
fn data_without_document_boundaries_is_refused_by_name() {
    let tokens: Vec<u32> = (0..100).collect();
    let data = Arc::new(TokenDataset::from_tokens(&tokens, TokenType::U16).unwrap());
    let sampler = SamplerConfig {
        mode: SamplingMode::EpochWindows,
        seq_len: 8,
        seed: 1,
        shard: Shard::SINGLE,
    };
    let config = LoaderConfig {
        documents: true,
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
    let sampler = SamplerConfig {
        mode: SamplingMode::EpochWindows,
        seq_len: 7,
        seed: 1,
        shard: Shard::SINGLE,
    };
    let config = LoaderConfig {
        output: OutputType::U32,
        workers: 0,
        documents: true,
        ..LoaderConfig::new(3)
    };
    let mut loader = Loader::new(data, sampler, config, None).unwrap();
    let batch = loader.next_batch().unwrap();
    let want: Vec<u32> = (0..3).flat_map(|_| 0..7).collect();
    assert_eq!(batch.positions().unwrap(), &want[..]);
    assert!(batch.target_flags().unwrap().iter().all(|&f| f));
}
