//! `ShardedWriter`: a stream cut into shards of exactly N tokens reads back, as a glob or a
//! directory, as the stream; llm.c's names; a dead build leaves only whole shards; an earlier
//! set's tail is removed.

use headroom_mmap_data::formats::shards::{shard_path, ShardedWriter, Sharding};
use headroom_mmap_data::formats::{self, megatron};
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

fn format_strategy() -> impl Strategy<Value = TokenFileFormat> {
    prop_oneof![
        Just(TokenFileFormat::Raw(TokenType::U16)),
        Just(TokenFileFormat::Llmc(LlmcFlavor::Gpt2)),
        Just(TokenFileFormat::Llmc(LlmcFlavor::Llama3)),
        Just(TokenFileFormat::Megatron {
            token_type: TokenType::U16,
            document_len: 1 << 30,
        }),
    ]
}

fn megatron(format: TokenFileFormat) -> bool {
    matches!(format, TokenFileFormat::Megatron { .. })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any documents, any shard size, any split into write calls: every shard but the last
    /// holds exactly `shard_tokens`, the shards in name order are the stream, the first
    /// `val_shards` are named `_val_`, and a Megatron set's documents are the stream's
    /// documents cut at the shard boundaries.
    #[test]
    fn shards_concatenate_to_the_stream(
        format in format_strategy(),
        documents in prop::collection::vec(prop::collection::vec(0u32..50_000, 1..40), 1..30),
        shard_tokens in 1u64..90,
        val_shards in 0u64..3,
        piece in 1usize..17,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("corpus.bin");
        let sharding = Sharding { shard_tokens, val_shards };
        let mut writer = ShardedWriter::create(&out, format, Some(sharding)).unwrap();
        let mut stream = Vec::new();
        let mut starts = vec![0u64];
        for doc in &documents {
            for chunk in doc.chunks(piece) {
                writer.write(chunk).unwrap();
            }
            writer.end_document().unwrap();
            stream.extend_from_slice(doc);
            starts.push(stream.len() as u64);
        }
        prop_assert_eq!(writer.tokens_written(), stream.len() as u64);
        let written = writer.finish().unwrap();
        let total = stream.len() as u64;
        let expected_shards = total.div_ceil(shard_tokens);
        prop_assert_eq!(written.shards.len() as u64, expected_shards);
        prop_assert_eq!(written.tokens, total);
        // Cuts that fall strictly inside a document.
        let cuts: Vec<u64> = (1..expected_shards).map(|k| k * shard_tokens).collect();
        let split = cuts
            .iter()
            .filter(|&&c| starts.windows(2).any(|w| w[0] < c && c < w[1]))
            .count() as u64;
        prop_assert_eq!(written.cuts_inside_documents, split);
        for (k, shard) in written.shards.iter().enumerate() {
            prop_assert_eq!(shard, &shard_path(&out, format, &sharding, k as u64));
            let name = shard.file_name().unwrap().to_str().unwrap();
            let split_name = match val_shards {
                0 => format!("corpus_{k:06}.bin"),
                v if (k as u64) < v => format!("corpus_val_{k:06}.bin"),
                _ => format!("corpus_train_{k:06}.bin"),
            };
            prop_assert_eq!(name, split_name.as_str());
            let ds = formats::open(shard, &OpenOptions::default()).unwrap();
            let want = if (k as u64) + 1 < expected_shards {
                shard_tokens
            } else {
                total - shard_tokens * k as u64
            };
            prop_assert_eq!(ds.total_tokens(), want);
        }
        // The set as `train --data` and `--val-data` read it: a glob per split, in name
        // order ("train" sorts before "val", so the splits are globbed apart, as llm.c's
        // users do).
        let ext = if megatron(format) { "idx" } else { "bin" };
        let globs: Vec<String> = match val_shards {
            0 => vec![format!("corpus_*.{ext}")],
            v if v >= expected_shards => vec![format!("corpus_val_*.{ext}")],
            _ => vec![format!("corpus_val_*.{ext}"), format!("corpus_train_*.{ext}")],
        };
        let sets: Vec<TokenDataset> = globs
            .iter()
            .map(|g| formats::open(dir.path().join(g), &OpenOptions::default()).unwrap())
            .collect();
        let read: Vec<u32> = sets.iter().flat_map(all_tokens).collect();
        prop_assert_eq!(read, stream.clone());
        if megatron(format) {
            let mut bounds: Vec<u64> = starts.clone();
            bounds.extend(cuts.iter().copied());
            bounds.sort_unstable();
            bounds.dedup();
            let docs: Vec<_> = sets.iter().flat_map(|s| s.documents().unwrap().to_vec()).collect();
            prop_assert_eq!(docs.len(), bounds.len() - 1);
            prop_assert_eq!(written.documents, Some(docs.len() as u64));
            let mut at = 0u64;
            for (d, w) in docs.iter().zip(bounds.windows(2)) {
                prop_assert_eq!(d.len, w[1] - w[0]);
                at += d.len;
            }
            prop_assert_eq!(at, total);
        } else {
            prop_assert_eq!(written.documents, None);
        }
    }
}

#[test]
fn an_unsharded_writer_writes_the_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("one.bin");
    let format = TokenFileFormat::Llmc(LlmcFlavor::Gpt2);
    let mut writer = ShardedWriter::create(&out, format, None).unwrap();
    writer.write(&[1, 2, 3]).unwrap();
    writer.end_document().unwrap();
    writer.write(&[4]).unwrap();
    let written = writer.finish().unwrap();
    assert_eq!(written.shards, vec![out.clone()]);
    assert_eq!((written.tokens, written.cuts_inside_documents), (4, 0));
    let ds = formats::open(&out, &OpenOptions::default()).unwrap();
    assert_eq!(all_tokens(&ds), vec![1, 2, 3, 4]);
}

#[test]
fn a_build_that_dies_leaves_only_whole_shards() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c.bin");
    let format = TokenFileFormat::Llmc(LlmcFlavor::Gpt2);
    let sharding = Sharding {
        shard_tokens: 5,
        val_shards: 0,
    };
    let mut writer = ShardedWriter::create(&out, format, Some(sharding)).unwrap();
    writer.write(&(0..13).collect::<Vec<u32>>()).unwrap();
    // Two shards are full and in place; the third is only a temporary file.
    assert!(dir.path().join("c_000001.bin").is_file());
    assert!(!dir.path().join("c_000002.bin").exists());
    drop(writer);
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["c_000000.bin", "c_000001.bin"]);
    let ds = formats::open(dir.path(), &OpenOptions::default()).unwrap();
    assert_eq!(all_tokens(&ds), (0..10).collect::<Vec<u32>>());
}

#[test]
fn an_earlier_sets_shards_are_removed_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let format = TokenFileFormat::Raw(TokenType::U16);
    for name in [
        "fw_000000.bin",
        "fw_val_000000.bin",
        "fw_train_000007.bin",
        "fw_train_000007.bin.lossmask",
        "fw.bin",
        "fw_notes.txt",
        "fw_train_000001.idx",
        "other_000001.bin",
    ] {
        std::fs::write(d.join(name), [0u8, 0]).unwrap();
    }
    let sharding = Sharding {
        shard_tokens: 2,
        val_shards: 1,
    };
    let mut writer = ShardedWriter::create(d.join("fw.bin"), format, Some(sharding)).unwrap();
    writer.write(&[1, 2, 3]).unwrap();
    let written = writer.finish().unwrap();
    let removed: Vec<String> = written
        .removed
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        removed,
        [
            "fw_000000.bin",
            "fw_train_000007.bin",
            "fw_train_000007.bin.lossmask",
            "fw_val_000000.bin"
        ]
    );
    let mut names: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "fw.bin",
            "fw_notes.txt",
            "fw_train_000001.bin",
            "fw_train_000001.idx",
            "fw_val_000000.bin",
            "other_000001.bin"
        ]
    );
}

#[test]
fn a_stream_ending_on_a_cut_leaves_no_empty_shard() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c");
    let format = TokenFileFormat::Megatron {
        token_type: TokenType::I32,
        document_len: 1 << 30,
    };
    let sharding = Sharding {
        shard_tokens: 4,
        val_shards: 0,
    };
    let mut writer = ShardedWriter::create(&out, format, Some(sharding)).unwrap();
    writer.write(&[1, 2, 3, 4]).unwrap();
    writer.end_document().unwrap();
    writer.write(&[5, 6, 7, 8]).unwrap();
    writer.end_document().unwrap();
    let written = writer.finish().unwrap();
    assert_eq!(written.shards.len(), 2);
    assert_eq!(
        (written.cuts_inside_documents, written.documents),
        (0, Some(2))
    );
    let (idx, bin) = megatron::megatron_paths(&dir.path().join("c_000001"));
    assert!(idx.is_file() && bin.is_file());
}

#[test]
fn bad_sizes_and_empty_streams_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c.bin");
    let llmc = TokenFileFormat::Llmc(LlmcFlavor::Gpt2);
    let zero = Sharding {
        shard_tokens: 0,
        val_shards: 0,
    };
    assert!(ShardedWriter::create(&out, llmc, Some(zero)).is_err());
    let huge = Sharding {
        shard_tokens: 1 << 31,
        val_shards: 0,
    };
    let e = ShardedWriter::create(&out, llmc, Some(huge)).unwrap_err();
    assert!(e.to_string().contains("at most 2147483647"), "{e}");
    // The raw format has no count to overflow.
    let raw = TokenFileFormat::Raw(TokenType::U16);
    assert!(ShardedWriter::create(&out, raw, Some(huge)).is_ok());
    let fine = Sharding {
        shard_tokens: 3,
        val_shards: 0,
    };
    let e = ShardedWriter::create(&out, llmc, Some(fine))
        .unwrap()
        .finish()
        .unwrap_err();
    assert!(e.to_string().contains("c.bin"), "{e}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// A set abandoned after its first `k` shards and resumed from there with the rest of
    /// the stream is the set written in one go, file for file, byte for byte; the split
    /// documents count the same when the resume says whether it continues a document.
    #[test]
    fn a_resumed_set_is_the_uninterrupted_set(
        format in format_strategy(),
        documents in prop::collection::vec(prop::collection::vec(0u32..50_000, 1..40), 2..25),
        shard_tokens in 1u64..60,
        stop in 1u64..6,
    ) {
        let sharding = Sharding { shard_tokens, val_shards: 1 };
        let whole = tempfile::tempdir().unwrap();
        let mut writer = ShardedWriter::create(whole.path().join("c.bin"), format, Some(sharding)).unwrap();
        for doc in &documents {
            writer.write(doc).unwrap();
            writer.end_document().unwrap();
        }
        let all = writer.finish().unwrap();
        let total: u64 = documents.iter().map(|d| d.len() as u64).sum();
        let kept = stop.min(total / shard_tokens);
        prop_assume!(kept >= 1);
        // Write until `kept` shards are finished, then abandon (a stray later shard too).
        let split = tempfile::tempdir().unwrap();
        let out = split.path().join("c.bin");
        let mut writer = ShardedWriter::create(&out, format, Some(sharding)).unwrap();
        let cut = kept * shard_tokens;
        let (mut at, mut continues) = (0u64, false);
        for doc in &documents {
            let end = at + doc.len() as u64;
            if end <= cut {
                writer.write(doc).unwrap();
                writer.end_document().unwrap();
            } else {
                if at < cut {
                    writer.write(&doc[..(cut - at) as usize]).unwrap();
                    continues = true;
                }
                break;
            }
            at = end;
        }
        prop_assert_eq!(writer.shards_finished(), kept);
        let partial = writer.abandon();
        prop_assert_eq!(partial.shards.len() as u64, kept);
        std::fs::write(shard_path(&out, format, &sharding, kept + 3), b"stray").unwrap();
        let mut writer = ShardedWriter::resume(&out, format, sharding, kept, continues).unwrap();
        let mut at = 0u64;
        for doc in &documents {
            let end = at + doc.len() as u64;
            if end > cut {
                let from = cut.saturating_sub(at) as usize;
                writer.write(&doc[from..]).unwrap();
                writer.end_document().unwrap();
            }
            at = end;
        }
        let rest = writer.finish().unwrap();
        let names = |f: &[std::path::PathBuf]| -> Vec<std::ffi::OsString> {
            f.iter().map(|p| p.file_name().unwrap().to_owned()).collect()
        };
        prop_assert_eq!(names(&rest.shards), names(&all.shards));
        prop_assert_eq!(rest.tokens, total);
        // The cut the stop fell at is counted once, by the writer that continues the document.
        prop_assert_eq!(partial.cuts_inside_documents + rest.cuts_inside_documents, all.cuts_inside_documents);
        for shard in &all.shards {
            let theirs = std::fs::read(shard).unwrap();
            let ours = std::fs::read(split.path().join(shard.file_name().unwrap())).unwrap();
            prop_assert!(ours == theirs, "{:?} differs", shard.file_name());
        }
        let count = |d: &std::path::Path| std::fs::read_dir(d).unwrap().count();
        prop_assert_eq!(count(split.path()), count(whole.path()));
    }
}

/// A kept shard that changed since it was written (truncated here) stops a resume with the
/// shard named, and nothing is removed.
#[test]
fn a_changed_kept_shard_stops_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("c.bin");
    let format = TokenFileFormat::Llmc(LlmcFlavor::Gpt2);
    let sharding = Sharding {
        shard_tokens: 4,
        val_shards: 0,
    };
    let mut writer = ShardedWriter::create(&out, format, Some(sharding)).unwrap();
    writer.write(&[1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
    writer.abandon();
    let first = shard_path(&out, format, &sharding, 0);
    let bytes = std::fs::read(&first).unwrap();
    std::fs::write(&first, &bytes[..bytes.len() - 2]).unwrap();
    let e = ShardedWriter::resume(&out, format, sharding, 2, false).unwrap_err();
    assert!(e.to_string().contains("c_000000.bin"), "{e}");
    assert!(
        e.to_string().contains("changed since it was written"),
        "{e}"
    );
    assert!(shard_path(&out, format, &sharding, 1).is_file());
    // Intact, it continues.
    std::fs::write(&first, &bytes).unwrap();
    let mut writer = ShardedWriter::resume(&out, format, sharding, 2, false).unwrap();
    writer.write(&[9]).unwrap();
    assert_eq!(writer.finish().unwrap().tokens, 9);
}
