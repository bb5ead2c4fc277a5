//! Window samplers: which `seq_len + 1`-token window the n-th sample of this rank is.
//!
//! Every sampler is a pure function of `(dataset shape, config, position)`. Nothing is
//! consumed or mutated, so a loader's whole position is one counter, any number of worker
//! threads can compute windows independently, and a resumed run replays exactly.

use serde::{Deserialize, Serialize};

use crate::dataset::TokenDataset;
use crate::permutation::FeistelPermutation;
use crate::rng::{below_with, derive_seed, mix64, SplitMix64};
use crate::{DataError, Result};

/// This process's slice of the data in data-parallel training.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shard {
    /// Index of this process, `0..world`.
    pub rank: u32,
    /// Number of processes.
    pub world: u32,
}

impl Shard {
    /// The whole data for a single process.
    pub const SINGLE: Shard = Shard { rank: 0, world: 1 };

    /// Shard `rank` of `world`; `rank < world` is required.
    pub fn new(rank: u32, world: u32) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(DataError::InvalidConfig(format!(
                "shard rank {rank} is not in 0..{world}"
            )));
        }
        Ok(Shard { rank, world })
    }
}

/// How windows are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SamplingMode {
    /// nanoGPT's `get_batch`: every window start uniformly at random, with replacement.
    /// Sharding splits the set of possible starts into `world` contiguous, disjoint ranges.
    RandomWindows,
    /// Non-overlapping windows (stride `seq_len`, so every token is a target exactly once),
    /// visited in a seeded shuffled order that changes every epoch: each window exactly once
    /// per epoch. Sharding deals the shuffled epoch out round-robin, so a rank gets
    /// ⌊n/world⌋ or ⌈n/world⌉ of the n windows per epoch (ranks with one window fewer start
    /// their next epoch one window earlier).
    EpochWindows,
    /// Like `EpochWindows`, but windows are cut inside documents (a window never spans two
    /// documents). Needs a document index (Megatron data); documents shorter than a window
    /// contribute nothing.
    DocumentWindows,
}

/// What a sampler needs to know. Part of a saved loader position.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SamplerConfig {
    /// How windows are chosen.
    pub mode: SamplingMode,
    /// Tokens per input row T; windows are `T + 1` tokens (inputs and shifted targets).
    pub seq_len: u64,
    /// Seed of the random choices.
    pub seed: u64,
    /// Data-parallel shard.
    pub shard: Shard,
}

/// A window of `seq_len + 1` tokens starting at token `start` of segment `segment`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Window {
    /// Index of the segment.
    pub segment: usize,
    /// First token of the window, relative to the segment.
    pub start: u64,
}

/// A contiguous run windows are cut from: a segment, or a document.
#[derive(Clone, Copy, Debug)]
struct Unit {
    segment: usize,
    start: u64,
    windows: u64,
}

/// The sampler for one dataset and one [`SamplerConfig`].
#[derive(Clone, Debug)]
pub struct WindowSampler {
    config: SamplerConfig,
    units: Vec<Unit>,
    /// `ends[i]`: windows in units `0..=i`.
    ends: Vec<u64>,
    total: u64,
    /// Random mode: this rank's range of global window starts.
    rank_range: (u64, u64),
    /// Epoch modes: windows this rank visits per epoch.
    per_rank: u64,
}

impl WindowSampler {
    /// Build the sampler; fails if the configuration is invalid or no window fits the data.
    pub fn new(dataset: &TokenDataset, config: SamplerConfig) -> Result<Self> {
        Shard::new(config.shard.rank, config.shard.world)?;
        if config.seq_len == 0 {
            return Err(DataError::InvalidConfig(
                "seq_len must be at least 1".into(),
            ));
        }
        let window = config
            .seq_len
            .checked_add(1)
            .ok_or_else(|| DataError::InvalidConfig("seq_len too large".into()))?;
        let runs: Vec<(usize, u64, u64)> = match config.mode {
            SamplingMode::RandomWindows | SamplingMode::EpochWindows => dataset
                .segments()
                .iter()
                .enumerate()
                .map(|(i, s)| (i, 0, s.len() as u64))
                .collect(),
            SamplingMode::DocumentWindows => dataset
                .documents()
                .ok_or_else(|| {
                    DataError::InvalidConfig(
                        "document-aware sampling needs a dataset with a document index".into(),
                    )
                })?
                .iter()
                .map(|d| (d.segment, d.start, d.len))
                .collect(),
        };
        let longest = runs.iter().map(|r| r.2).max().unwrap_or(0);
        let units: Vec<Unit> = runs
            .into_iter()
            .filter(|&(_, _, len)| len >= window)
            .map(|(segment, start, len)| Unit {
                segment,
                start,
                windows: match config.mode {
                    SamplingMode::RandomWindows => len - window + 1,
                    _ => (len - 1) / config.seq_len,
                },
            })
            .collect();
        if units.is_empty() {
            return Err(DataError::WindowTooLong { window, longest });
        }
        let mut ends = Vec::with_capacity(units.len());
        let mut total = 0u64;
        for u in &units {
            total += u.windows;
            ends.push(total);
        }
        let Shard { rank, world } = config.shard;
        let (rank, world) = (u64::from(rank), u64::from(world));
        let split = |r: u64| (u128::from(total) * u128::from(r) / u128::from(world)) as u64;
        let rank_range = (split(rank), split(rank + 1));
        let per_rank = if rank < total {
            (total - rank).div_ceil(world)
        } else {
            0
        };
        let rank_has_windows = match config.mode {
            SamplingMode::RandomWindows => rank_range.1 > rank_range.0,
            _ => per_rank > 0,
        };
        if !rank_has_windows {
            return Err(DataError::InvalidConfig(format!(
                "{total} windows cannot give every one of {world} ranks at least one"
            )));
        }
        Ok(WindowSampler {
            config,
            units,
            ends,
            total,
            rank_range,
            per_rank,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Tokens per window (`seq_len + 1`).
    pub fn window_len(&self) -> u64 {
        self.config.seq_len + 1
    }

    /// Distinct windows over all ranks: possible starts (random mode) or windows per epoch.
    pub fn total_windows(&self) -> u64 {
        self.total
    }

    /// Windows this rank visits per epoch; `None` in random mode (no epochs).
    pub fn windows_per_epoch(&self) -> Option<u64> {
        match self.config.mode {
            SamplingMode::RandomWindows => None,
            _ => Some(self.per_rank),
        }
    }

    /// The epoch that the window at `position` belongs to (always 0 in random mode).
    pub fn epoch_of(&self, position: u64) -> u64 {
        match self.config.mode {
            SamplingMode::RandomWindows => 0,
            _ => position / self.per_rank,
        }
    }

    /// Global window number `g` (`0..total_windows`) as a window.
    pub fn global_window(&self, g: u64) -> Window {
        let i = self
            .ends
            .partition_point(|&end| end <= g)
            .min(self.units.len() - 1);
        let before = if i == 0 { 0 } else { self.ends[i - 1] };
        let unit = self.units[i];
        let local = g - before;
        let offset = match self.config.mode {
            SamplingMode::RandomWindows => local,
            _ => local * self.config.seq_len,
        };
        Window {
            segment: unit.segment,
            start: unit.start + offset,
        }
    }

    /// The window this rank uses at `position` of its stream (0, 1, 2, …).
    pub fn window(&self, position: u64) -> Window {
        let Shard { rank, world } = self.config.shard;
        match self.config.mode {
            SamplingMode::RandomWindows => {
                let (lo, hi) = self.rank_range;
                // A counter-based stream per position: position p's draw never depends on any
                // other position's, which is what makes resuming and parallel filling exact.
                let mut rng =
                    SplitMix64::new(self.config.seed ^ mix64(position ^ 0x5EED_0000_0000_0001));
                self.global_window(lo + below_with(hi - lo, || rng.next_u64()))
            }
            SamplingMode::EpochWindows | SamplingMode::DocumentWindows => {
                let epoch = position / self.per_rank;
                let j = position % self.per_rank;
                let i = j * u64::from(world) + u64::from(rank);
                let order =
                    FeistelPermutation::new(self.total, derive_seed(&[self.config.seed, epoch]));
                self.global_window(order.apply(i))
            }
        }
    }
}
