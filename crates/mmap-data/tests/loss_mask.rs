//! Loss masks beside token files: attached by `open`, handed out by the loader with the
//! targets they describe, part of the fingerprint, all-or-none across shards.

use std::sync::Arc;

use headroom_mmap_data::{
    formats, loss_mask_path, write_loss_mask, DataError, Loader, LoaderConfig, OutputType,
    SamplerConfig, SamplingMode, Shard, TokenFileFormat, TokenType,
};
use proptest::prelude::*;

fn sampler(seq: u64, mode: SamplingMode) -> SamplerConfig {
    SamplerConfig {
        mode,
        seq_len: seq,
        seed: 7,
        shard: Shard::SINGLE,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Every target's flag is the mask bit of the token it is: the targets are the tokens
    /// themselves here (token i holds id i), so the flag must be `mask[target]`.
    #[test]
    fn each_target_carries_its_own_tokens_flag(
        n in 20usize..400,
        seed in any::<u64>(),
        seq in 1u64..9,
        batch in 1usize..4,
        workers in 0usize..3,
        llmc in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.bin");
        let tokens: Vec<u32> = (0..n as u32).collect();
        let format = if llmc {
            TokenFileFormat::Llmc(headroom_mmap_data::LlmcFlavor::Gpt2)
        } else {
            TokenFileFormat::Raw(TokenType::U16)
        };
        formats::write_tokens(&path, &tokens, format).unwrap();
        let flags: Vec<bool> = (0..n).map(|i| (seed >> (i % 64)) & 1 == 1 || i % 7 == 0).collect();
        write_loss_mask(loss_mask_path(&path), &flags).unwrap();
        let ds = Arc::new(formats::open(&path, &Default::default()).unwrap());
        prop_assert!(ds.has_loss_mask());
        prop_assert_eq!(ds.counted_tokens(), flags.iter().filter(|&&f| f).count() as u64);
        let mut cfg = LoaderConfig::new(batch);
        cfg.output = OutputType::U32;
        cfg.workers = workers;
        let mut loader =
            Loader::new(ds, sampler(seq, SamplingMode::RandomWindows), cfg, None).unwrap();
        for _ in 0..5 {
            let b = loader.next_batch().unwrap();
            let targets = b.targets_u32().unwrap();
            let got = b.target_flags().unwrap();
            prop_assert_eq!(got.len(), targets.len());
            for (&t, &f) in targets.iter().zip(got) {
                prop_assert_eq!(f, flags[t as usize]);
            }
        }
    }
}

#[test]
fn a_mask_is_part_of_the_data_and_checked_against_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.bin");
    let tokens: Vec<u32> = (0..64).collect();
    formats::write_tokens(&path, &tokens, TokenFileFormat::Raw(TokenType::U16)).unwrap();
    let plain = formats::open(&path, &Default::default()).unwrap();
    assert!(!plain.has_loss_mask());
    assert_eq!(plain.counted_tokens(), 64);
    let loader_without_flags = {
        let mut cfg = LoaderConfig::new(2);
        cfg.output = OutputType::U32;
        let mut l = Loader::new(
            Arc::new(plain.clone()),
            sampler(4, SamplingMode::EpochWindows),
            cfg,
            None,
        )
        .unwrap();
        let b = l.next_batch().unwrap();
        b.target_flags().is_none()
    };
    assert!(loader_without_flags, "no mask, no flags");

    let mask = loss_mask_path(&path);
    write_loss_mask(&mask, &[true; 64]).unwrap();
    let all = formats::open(&path, &Default::default()).unwrap();
    // Same tokens, another mask: another fingerprint (a saved position will not resume).
    assert_ne!(all.fingerprint(), plain.fingerprint());
    let mut half = vec![true; 64];
    half[..32].fill(false);
    write_loss_mask(&mask, &half).unwrap();
    let masked = formats::open(&path, &Default::default()).unwrap();
    assert_ne!(masked.fingerprint(), all.fingerprint());
    assert_eq!(masked.counted_tokens(), 32);

    // A mask for another length of file is refused, naming both counts.
    write_loss_mask(&mask, &[true; 63]).unwrap();
    let err = formats::open(&path, &Default::default()).unwrap_err();
    assert!(err.to_string().contains("63 tokens"), "{err}");
    // A damaged one too.
    std::fs::write(&mask, b"HRLMASK1 but not a mask").unwrap();
    assert!(formats::open(&path, &Default::default()).is_err());
}

#[test]
fn shards_have_masks_all_or_none_and_a_mask_is_never_a_shard() {
    let dir = tempfile::tempdir().unwrap();
    let shard = |i: u32| dir.path().join(format!("shard_{i}.bin"));
    for i in 0..3 {
        formats::write_tokens(
            shard(i),
            &[i, i + 1, i + 2, i + 3, i + 4],
            TokenFileFormat::Raw(TokenType::U16),
        )
        .unwrap();
    }
    let glob = dir.path().join("shard_*");
    assert_eq!(
        formats::open(&glob, &Default::default())
            .unwrap()
            .segments()
            .len(),
        3
    );
    write_loss_mask(loss_mask_path(&shard(0)), &[false, true, true, true, true]).unwrap();
    for what in [glob.clone(), dir.path().to_path_buf()] {
        match formats::open(&what, &Default::default()) {
            Err(DataError::InvalidConfig(m)) => assert!(m.contains("1 of 3 shards"), "{m}"),
            other => panic!("mixed masks accepted: {other:?}"),
        }
    }
    for i in 1..3 {
        write_loss_mask(loss_mask_path(&shard(i)), &[true, false, true, false, true]).unwrap();
    }
    for what in [glob, dir.path().to_path_buf()] {
        let ds = formats::open(&what, &Default::default()).unwrap();
        assert_eq!(ds.segments().len(), 3, "masks are not shards");
        assert_eq!(ds.counted_tokens(), 4 + 3 + 3);
    }
}

#[test]
fn a_megatron_bin_takes_the_mask_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("corpus");
    formats::megatron::write_megatron(&prefix, &[vec![1, 2, 3], vec![4, 5]], TokenType::U16)
        .unwrap();
    let bin = dir.path().join("corpus.bin");
    write_loss_mask(loss_mask_path(&bin), &[false, true, true, false, true]).unwrap();
    for what in [prefix.clone(), bin.clone(), dir.path().join("corpus.idx")] {
        let ds = formats::open(&what, &Default::default()).unwrap();
        assert_eq!(ds.counted_tokens(), 3, "{}", what.display());
        assert_eq!(ds.documents().map(<[_]>::len), Some(2));
    }
}

#[test]
fn inspect_describes_the_mask_and_refuses_one_of_another_length() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.bin");
    formats::write_tokens(&path, &[1, 2, 3, 4], TokenFileFormat::Raw(TokenType::U16)).unwrap();
    let opts = headroom_mmap_data::InspectOptions::default();
    assert_eq!(
        headroom_mmap_data::inspect(&path, &opts).unwrap().loss_mask,
        None
    );
    write_loss_mask(loss_mask_path(&path), &[false, true, true, false]).unwrap();
    let d = headroom_mmap_data::inspect(&path, &opts).unwrap();
    assert_eq!(d.loss_mask, Some((loss_mask_path(&path), 2)));
    assert!(
        d.to_string().contains("2 of 4 tokens count as targets"),
        "{d}"
    );
    write_loss_mask(loss_mask_path(&path), &[true; 5]).unwrap();
    assert!(headroom_mmap_data::inspect(&path, &opts).is_err());
}
