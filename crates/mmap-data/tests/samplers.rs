//! Sampler properties: exactly once per epoch, sharding disjoint and covering, windows inside
//! their segment or document, determinism.

use std::collections::BTreeSet;

use headroom_mmap_data::{
    SamplerConfig, SamplingMode, Shard, TokenDataset, TokenType, Window, WindowSampler,
};
use proptest::prelude::*;

fn dataset(lens: &[usize], docs: bool) -> TokenDataset {
    let parts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| vec![i as u32; n])
        .collect();
    if docs {
        TokenDataset::from_documents(&parts, TokenType::U16).unwrap()
    } else {
        TokenDataset::from_tokens(&parts.concat(), TokenType::U16).unwrap()
    }
}

/// Every non-overlapping window of each run, computed the obvious way.
fn expected_windows(runs: &[(usize, u64, u64)], seq_len: u64) -> BTreeSet<Window> {
    let mut out = BTreeSet::new();
    for &(segment, start, len) in runs {
        let mut s = 0;
        while s + seq_len < len {
            out.insert(Window {
                segment,
                start: start + s,
            });
            s += seq_len;
        }
    }
    out
}

fn config(mode: SamplingMode, seq_len: u64, seed: u64, shard: Shard) -> SamplerConfig {
    SamplerConfig {
        mode,
        seq_len,
        seed,
        shard,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn epoch_windows_are_visited_exactly_once_per_epoch(
        lens in prop::collection::vec(1usize..200, 1..6),
        seq_len in 1u64..16,
        seed in any::<u64>(),
        docs in any::<bool>(),
    ) {
        let ds = dataset(&lens, docs);
        let mode = if docs { SamplingMode::DocumentWindows } else { SamplingMode::EpochWindows };
        let runs: Vec<(usize, u64, u64)> = if docs {
            ds.documents().unwrap().iter().map(|d| (d.segment, d.start, d.len)).collect()
        } else {
            vec![(0, 0, ds.total_tokens())]
        };
        let want = expected_windows(&runs, seq_len);
        let Ok(s) = WindowSampler::new(&ds, config(mode, seq_len, seed, Shard::SINGLE)) else {
            prop_assert!(want.is_empty());
            return Ok(());
        };
        let n = s.windows_per_epoch().unwrap();
        prop_assert_eq!(n as usize, want.len());
        let mut orders = Vec::new();
        for epoch in 0..3 {
            let got: Vec<Window> = (epoch * n..(epoch + 1) * n).map(|p| s.window(p)).collect();
            prop_assert!((epoch * n..(epoch + 1) * n).all(|p| s.epoch_of(p) == epoch));
            let set: BTreeSet<Window> = got.iter().copied().collect();
            prop_assert_eq!(set.len(), got.len(), "a window repeated within epoch {}", epoch);
            prop_assert_eq!(&set, &want);
            if docs {
                // Never across a document boundary.
                for w in &got {
                    let d = ds.documents().unwrap().iter().find(|d| d.start <= w.start && w.start < d.start + d.len).unwrap();
                    prop_assert!(w.start + seq_len < d.start + d.len);
                }
            }
            orders.push(got);
        }
        if n >= 8 {
            prop_assert!(orders[0] != orders[1], "epochs reshuffle");
        }
    }

    #[test]
    fn epoch_shards_are_disjoint_and_cover(
        len in 50usize..2000,
        seq_len in 1u64..32,
        world in 1u32..6,
        seed in any::<u64>(),
    ) {
        let ds = dataset(&[len], false);
        let all = expected_windows(&[(0, 0, len as u64)], seq_len);
        prop_assume!(all.len() >= world as usize);
        for epoch in 0..2u64 {
            let mut union = BTreeSet::new();
            let mut count = 0;
            for rank in 0..world {
                let s = WindowSampler::new(&ds, config(SamplingMode::EpochWindows, seq_len, seed, Shard::new(rank, world).unwrap())).unwrap();
                let n = s.windows_per_epoch().unwrap();
                for p in epoch * n..(epoch + 1) * n {
                    union.insert(s.window(p));
                    count += 1;
                }
            }
            prop_assert_eq!(count, all.len(), "disjoint: no window dealt twice");
            prop_assert_eq!(&union, &all, "covering");
        }
    }

    #[test]
    fn random_windows_stay_in_their_shard_and_segment(
        lens in prop::collection::vec(1usize..300, 1..5),
        seq_len in 1u64..20,
        world in 1u32..4,
        seed in any::<u64>(),
    ) {
        // Random-mode shards own disjoint ranges of window starts that together cover them all.
        let parts: Vec<Vec<u32>> = lens.iter().map(|&n| vec![0; n]).collect();
        let ds = TokenDataset::from_documents(&parts, TokenType::U16).unwrap();
        let single = WindowSampler::new(&ds, config(SamplingMode::RandomWindows, seq_len, seed, Shard::SINGLE));
        let Ok(single) = single else { return Ok(()); };
        let total = single.total_windows();
        prop_assume!(total >= u64::from(world));
        let mut owner = vec![None; total as usize];
        let mut all_starts = Vec::new();
        for g in 0..total {
            all_starts.push(single.global_window(g));
        }
        for rank in 0..world {
            let s = WindowSampler::new(&ds, config(SamplingMode::RandomWindows, seq_len, seed, Shard::new(rank, world).unwrap())).unwrap();
            for p in 0..200 {
                let w = s.window(p);
                prop_assert!(w.start + seq_len < ds.segments()[w.segment].len() as u64);
                let g = all_starts.iter().position(|x| *x == w).unwrap();
                prop_assert!(owner[g].is_none() || owner[g] == Some(rank), "start shared by two ranks");
                owner[g] = Some(rank);
            }
        }
    }
}

#[test]
fn random_windows_are_deterministic_and_spread() {
    let ds = dataset(&[10_000], false);
    let c = config(SamplingMode::RandomWindows, 16, 5, Shard::SINGLE);
    let a = WindowSampler::new(&ds, c.clone()).unwrap();
    let b = WindowSampler::new(&ds, c.clone()).unwrap();
    let wa: Vec<Window> = (0..1000).map(|p| a.window(p)).collect();
    let wb: Vec<Window> = (0..1000).map(|p| b.window(p)).collect();
    assert_eq!(wa, wb);
    let other = WindowSampler::new(&ds, SamplerConfig { seed: 6, ..c }).unwrap();
    assert_ne!(wa, (0..1000).map(|p| other.window(p)).collect::<Vec<_>>());
    // Uniform over 9 985 starts: each tenth of the range gets about 100 of 1 000 draws.
    let mut deciles = [0u32; 10];
    for w in &wa {
        deciles[(w.start * 10 / 9985) as usize] += 1;
    }
    assert!(
        deciles.iter().all(|&d| (50..160).contains(&d)),
        "{deciles:?}"
    );
    assert_eq!(a.total_windows(), 10_000 - 17 + 1);
    assert_eq!(a.windows_per_epoch(), None);
}
