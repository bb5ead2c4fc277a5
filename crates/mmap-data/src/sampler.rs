//! Window samplers: which `seq_len + 1`-token window the n-th sample of this rank is.
//!
//! Every sampler is a pure function of `(dataset shape, config, position)`. Nothing is
//! consumed or mutated, so a loader's whole position is one counter, any number of worker
//! threads can compute windows independently, and a resumed run replays exactly.

use serde::{Deserialize, Serialize};

use crate::blend::BlendSchedule;
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

/// The windows of one source: the whole dataset, or one source of a blend.
#[derive(Clone, Debug)]
struct SourceWindows {
    /// The seed of this source's random choices.
    seed: u64,
    /// The shard this source's windows are dealt to (a blend's sources are not sharded).
    shard: Shard,
    units: Vec<Unit>,
    /// `ends[i]`: windows in units `0..=i`.
    ends: Vec<u64>,
    total: u64,
    /// Random mode: this rank's range of global window starts.
    rank_range: (u64, u64),
    /// Epoch modes: windows this rank visits per epoch.
    per_rank: u64,
}

/// The sampler for one dataset and one [`SamplerConfig`].
#[derive(Clone, Debug)]
pub struct WindowSampler {
    config: SamplerConfig,
    /// One per blend source, or one for the whole dataset.
    sources: Vec<SourceWindows>,
    /// Which source each sample reads, for a blended dataset.
    blend: Option<BlendSchedule>,
}

impl WindowSampler {
    /// Build the sampler; fails if the configuration is invalid or no window fits the data
    /// (or, for a blend, one of its sources).
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
        let Some(blend) = dataset.blend() else {
            let source = SourceWindows::new(&config, config.seed, window, &runs)?;
            return Ok(WindowSampler {
                config,
                sources: vec![source],
                blend: None,
            });
        };
        // A blend is sharded at the level of its own samples, as one process would read
        // them: rank r of w takes samples r, r + w, … of the blend, and the sources' samplers
        // are not sharded. So `w` ranks together read exactly the windows one process reads.
        let mut source_config = config.clone();
        source_config.shard = Shard::SINGLE;
        let sources = blend
            .sources()
            .iter()
            .enumerate()
            .map(|(d, source)| {
                // Runs are in segment order, so each source's are one contiguous stretch.
                let first = runs.partition_point(|r| r.0 < source.segments.start);
                let end = runs.partition_point(|r| r.0 < source.segments.end);
                let seed = crate::blend::source_seed(config.seed, d);
                SourceWindows::new(&source_config, seed, window, &runs[first..end]).map_err(|e| {
                    DataError::InvalidConfig(format!("blend source {d} ({}): {e}", source.name))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(WindowSampler {
            config,
            sources,
            blend: Some(BlendSchedule::new(&blend.shares())?),
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

    /// Distinct windows over all ranks: possible starts (random mode) or windows per epoch
    /// (for a blend, summed over its sources).
    pub fn total_windows(&self) -> u64 {
        self.sources.iter().map(|s| s.total).sum()
    }

    /// Windows this rank visits per epoch; `None` in random mode (no epochs) and for a blend
    /// (each source has its own epochs: [`WindowSampler::source_epoch`]).
    pub fn windows_per_epoch(&self) -> Option<u64> {
        match (self.config.mode, &self.blend, self.sources.first()) {
            (SamplingMode::RandomWindows, _, _) | (_, Some(_), _) | (_, _, None) => None,
            (_, None, Some(s)) => Some(s.per_rank),
        }
    }

    /// The epoch that the window at `position` belongs to (always 0 in random mode). For a
    /// blend, the furthest epoch any source has reached by then.
    pub fn epoch_of(&self, position: u64) -> u64 {
        (0..self.sources.len())
            .map(|d| self.source_epoch(d, position))
            .max()
            .unwrap_or(0)
    }

    /// The blend schedule of a blended dataset's sampler.
    pub fn blend(&self) -> Option<&BlendSchedule> {
        self.blend.as_ref()
    }

    /// This rank's window at `position` as a sample of the blend: ranks take the blend's
    /// samples in turn (`position · world + rank`).
    fn blend_sample(&self, position: u64) -> u64 {
        let Shard { rank, world } = self.config.shard;
        position
            .saturating_mul(u64::from(world))
            .saturating_add(u64::from(rank))
    }

    /// Windows read from source `source` before this rank's window at `position`: for a
    /// blend, by all ranks together (the blend's samples before it); for other data, by this
    /// rank (`position` for source 0, 0 for any other).
    pub fn source_windows(&self, source: usize, position: u64) -> u64 {
        match &self.blend {
            Some(b) => b.drawn(source, self.blend_sample(position)),
            None if source == 0 => position,
            None => 0,
        }
    }

    /// The epoch of source `source` that this rank's window at `position` falls in, or would
    /// if the window came from that source (0 in random mode and for no such source).
    pub fn source_epoch(&self, source: usize, position: u64) -> u64 {
        match (self.config.mode, self.sources.get(source)) {
            (SamplingMode::RandomWindows, _) | (_, None) => 0,
            (_, Some(s)) => self.source_windows(source, position) / s.per_rank,
        }
    }

    /// Windows per epoch of source `source` (for a blend: all ranks' together, since a blend
    /// is sharded at its own samples); `None` in random mode and for no such source.
    pub fn source_windows_per_epoch(&self, source: usize) -> Option<u64> {
        match self.config.mode {
            SamplingMode::RandomWindows => None,
            _ => self.sources.get(source).map(|s| s.per_rank),
        }
    }

    /// Global window number `g` (`0..total_windows`) as a window; a blend's sources' windows
    /// follow one another in source order.
    pub fn global_window(&self, g: u64) -> Window {
        let mut g = g;
        for (d, s) in self.sources.iter().enumerate() {
            if g < s.total || d + 1 == self.sources.len() {
                return s.global_window(&self.config, g);
            }
            g -= s.total;
        }
        unreachable!("a sampler has at least one source")
    }

    /// The window this rank uses at `position` of its stream (0, 1, 2, …).
    pub fn window(&self, position: u64) -> Window {
        match &self.blend {
            Some(b) => {
                let (d, local) = b.source_of(self.blend_sample(position));
                self.sources[d].window(&self.config, local)
            }
            None => self.sources[0].window(&self.config, position),
        }
    }
}

impl SourceWindows {
    /// The windows of `runs` (segment, start, length) under `config`, drawn with `seed`.
    fn new(
        config: &SamplerConfig,
        seed: u64,
        window: u64,
        runs: &[(usize, u64, u64)],
    ) -> Result<Self> {
        let longest = runs.iter().map(|r| r.2).max().unwrap_or(0);
        let units: Vec<Unit> = runs
            .iter()
            .filter(|&&(_, _, len)| len >= window)
            .map(|&(segment, start, len)| Unit {
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
        Ok(SourceWindows {
            seed,
            shard: config.shard,
            units,
            ends,
            total,
            rank_range,
            per_rank,
        })
    }

    /// Window number `g` (`0..total`) of this source.
    fn global_window(&self, config: &SamplerConfig, g: u64) -> Window {
        let i = self
            .ends
            .partition_point(|&end| end <= g)
            .min(self.units.len() - 1);
        let before = if i == 0 { 0 } else { self.ends[i - 1] };
        let unit = self.units[i];
        let local = g - before;
        let offset = match config.mode {
            SamplingMode::RandomWindows => local,
            _ => local * config.seq_len,
        };
        Window {
            segment: unit.segment,
            start: unit.start + offset,
        }
    }

    /// The window this rank reads at `position` of this source's own stream.
    fn window(&self, config: &SamplerConfig, position: u64) -> Window {
        let Shard { rank, world } = self.shard;
        match config.mode {
            SamplingMode::RandomWindows => {
                let (lo, hi) = self.rank_range;
                // A counter-based stream per position: position p's draw never depends on any
                // other position's, which is what makes resuming and parallel filling exact.
                let mut rng = SplitMix64::new(self.seed ^ mix64(position ^ 0x5EED_0000_0000_0001));
                self.global_window(config, lo + below_with(hi - lo, || rng.next_u64()))
            }
            SamplingMode::EpochWindows | SamplingMode::DocumentWindows => {
                let epoch = position / self.per_rank;
                let j = position % self.per_rank;
                let i = j * u64::from(world) + u64::from(rank);
                let order = FeistelPermutation::new(self.total, derive_seed(&[self.seed, epoch]));
                self.global_window(config, order.apply(i))
            }
        }
    }
}
