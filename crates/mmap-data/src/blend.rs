//! Dataset blending: several token datasets drawn from in fixed proportions, as Megatron-LM's
//! `--data-path 0.7 web 0.3 code` does.
//!
//! A [`Blend`] gives each source an integer share of a period of `P` samples (its weight's
//! fraction of the total, exact when the weights are ratios of small integers, such as 0.3 and
//! 0.7, else rounded to 1/65 536). A [`BlendSchedule`] says which source each sample of the
//! stream reads, by Megatron's greedy rule (`build_blending_indices` in its `helpers.cpp`):
//! sample `i` goes to the source furthest behind its share, the one with the largest
//! `w_d · max(i, 1) − drawn_d`, the first of equals on a tie. Here the rule runs in exact
//! integer arithmetic. Every source is then exactly on its share at each multiple of `P`, so
//! the schedule repeats with period `P` after its first period, and the source and the
//! source-local index of any sample are a table lookup: a pure function of the position, as
//! every sampler in this crate is (workers fill any batch, a resumed run replays exactly).
//!
//! Megatron computes the same rule in floating point and precomputes it for the whole run.
//! Where two sources tie exactly, its rounding can choose the other one. The two schedules then
//! differ at that sample and come back together within a few samples. Every prefix of either
//! schedule holds each source's share to within one sample; `tests/blend.rs` compares the two
//! on fixtures written by Megatron's own code.
//!
//! Each source keeps its own sampler (its own windows, shuffles and epochs), so the `k`-th
//! sample drawn from a source is the `k`-th window of that source read alone. A source smaller
//! than its share of the run is repeated, epoch by epoch, as in Megatron and in Hugging Face's
//! `interleave_datasets(..., stopping_strategy="all_exhausted")`.

use std::ops::Range;

use crate::{DataError, Result};

/// Most samples in a blend's period: the resolution of weights that are not ratios of small
/// integers. A period's schedule costs 10 bytes per sample (two periods are kept).
pub const MAX_BLEND_PERIOD: u64 = 1 << 16;

/// The seed of blend source `source`'s own sampler under the blend's seed `seed`: its windows
/// are those of a sampler over that source alone with this seed.
pub fn source_seed(seed: u64, source: usize) -> u64 {
    // "blends"
    crate::rng::derive_seed(&[seed, 0x626c_656e_6473, source as u64])
}

/// One source of a [`Blend`].
#[derive(Clone, Debug, PartialEq)]
pub struct BlendSource {
    /// What the source is called in messages (its path, as given).
    pub name: String,
    /// The weight as given.
    pub weight: f64,
    /// Samples of each period of [`Blend::period`] that come from this source.
    pub share: u64,
    /// The source's segments within the blended dataset.
    pub segments: Range<usize>,
}

impl BlendSource {
    /// The source's fraction of all samples (`share / period`).
    pub fn fraction(&self, period: u64) -> f64 {
        self.share as f64 / period as f64
    }
}

/// The sources of a blended dataset and their shares of each period.
#[derive(Clone, Debug, PartialEq)]
pub struct Blend {
    sources: Vec<BlendSource>,
    period: u64,
}

impl Blend {
    /// Sources named `names`, with weights `weights` (any positive, finite numbers: only their
    /// ratios matter) over consecutive segment ranges `segments`.
    pub(crate) fn new(
        names: Vec<String>,
        weights: &[f64],
        segments: Vec<Range<usize>>,
    ) -> Result<Self> {
        let shares = blend_shares(weights)?;
        let period = shares.iter().sum();
        let sources = names
            .into_iter()
            .zip(weights)
            .zip(shares)
            .zip(segments)
            .map(|(((name, &weight), share), segments)| BlendSource {
                name,
                weight,
                share,
                segments,
            })
            .collect();
        Ok(Blend { sources, period })
    }

    /// The sources, in the order given.
    pub fn sources(&self) -> &[BlendSource] {
        &self.sources
    }

    /// Samples per period: every source has exactly its share of each period.
    pub fn period(&self) -> u64 {
        self.period
    }

    /// The shares of a period, source by source.
    pub fn shares(&self) -> Vec<u64> {
        self.sources.iter().map(|s| s.share).collect()
    }

    /// The words a dataset's fingerprint adds for the blend: a saved position resumes only
    /// under the same shares of the same segments.
    pub(crate) fn fingerprint_words(&self) -> impl Iterator<Item = u64> + '_ {
        // "blend", the period, then each source's share and segment range.
        [0x62_6c65_6e64, self.period, self.sources.len() as u64]
            .into_iter()
            .chain(
                self.sources
                    .iter()
                    .flat_map(|s| [s.share, s.segments.start as u64, s.segments.end as u64]),
            )
    }
}

/// Each weight's integer share of a period: the smallest period `P ≤` [`MAX_BLEND_PERIOD`] in
/// which every weight's fraction is a whole number of samples (to 1e-9 of a sample); failing
/// that, shares of [`MAX_BLEND_PERIOD`] by largest remainders. Weights must be positive and
/// finite, and none may round to no sample at all.
pub fn blend_shares(weights: &[f64]) -> Result<Vec<u64>> {
    let invalid = |m: String| Err(DataError::InvalidConfig(m));
    if weights.is_empty() {
        return invalid("a blend needs at least one source".into());
    }
    if weights.len() as u64 > MAX_BLEND_PERIOD {
        return invalid(format!(
            "a blend of {} sources: at most {MAX_BLEND_PERIOD} are supported",
            weights.len()
        ));
    }
    if let Some((d, w)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !(w.is_finite() && **w > 0.0))
    {
        return invalid(format!(
            "blend weight {w} of source {d}: weights must be positive, finite numbers (leave \
             out a source that should not be read)"
        ));
    }
    let total: f64 = weights.iter().sum();
    if !total.is_finite() {
        return invalid("the blend weights sum to more than a float can hold".into());
    }
    let fractions: Vec<f64> = weights.iter().map(|w| w / total).collect();
    for period in weights.len() as u64..=MAX_BLEND_PERIOD {
        let p = period as f64;
        let mut shares = Vec::with_capacity(fractions.len());
        for &f in &fractions {
            let exact = f * p;
            let share = exact.round();
            if (exact - share).abs() > 1e-9 || share < 1.0 {
                break;
            }
            shares.push(share as u64);
        }
        if shares.len() == fractions.len() && shares.iter().sum::<u64>() == period {
            return Ok(shares);
        }
    }
    // Largest remainders: the floors, then one more sample to the largest fractional parts.
    let p = MAX_BLEND_PERIOD as f64;
    let mut shares: Vec<u64> = fractions.iter().map(|f| (f * p).floor() as u64).collect();
    let mut order: Vec<usize> = (0..fractions.len()).collect();
    order.sort_by(|&a, &b| {
        let rest = |d: usize| fractions[d] * p - (fractions[d] * p).floor();
        rest(b).total_cmp(&rest(a)).then(a.cmp(&b))
    });
    let missing = MAX_BLEND_PERIOD.saturating_sub(shares.iter().sum());
    for &d in order.iter().cycle().take(missing as usize) {
        shares[d] += 1;
    }
    if let Some(d) = shares.iter().position(|&s| s == 0) {
        return invalid(format!(
            "blend weight {} of source {d} is less than 1/{MAX_BLEND_PERIOD} of the total {total}: \
             too small to be drawn from",
            weights[d]
        ));
    }
    Ok(shares)
}

/// One period of a schedule, position by position.
#[derive(Clone, Debug)]
struct Period {
    /// The source each sample of the period reads.
    source: Vec<u32>,
    /// Samples of that source earlier in the period.
    index: Vec<u32>,
    /// Per source: the period's positions that read it, ascending.
    positions: Vec<Vec<u32>>,
}

/// Which source every sample of a blended stream reads, and which of that source's samples it
/// is: Megatron's greedy rule, periodic, looked up in constant time.
///
/// ```
/// use headroom_mmap_data::blend::BlendSchedule;
///
/// # fn main() -> headroom_mmap_data::Result<()> {
/// let schedule = BlendSchedule::new(&[3, 7])?; // 30% and 70%
/// let sources: Vec<usize> = (0..10).map(|i| schedule.source_of(i).0).collect();
/// assert_eq!(sources, [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]);
/// assert_eq!(schedule.source_of(1_000_003), (1, 700_002)); // sample 700 002 of the 70% source
/// assert_eq!(schedule.drawn(0, 1_000_000), 300_000);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct BlendSchedule {
    shares: Vec<u64>,
    period: u64,
    /// Samples `0..P`: the first one is chosen by the weights alone (`max(i, 1)`).
    first: Period,
    /// Samples `P..2P`, and every later period: each starts with every source on its share.
    steady: Period,
}

impl BlendSchedule {
    /// The schedule of sources with `shares` samples in each period (all at least 1, their sum
    /// at most [`MAX_BLEND_PERIOD`]).
    pub fn new(shares: &[u64]) -> Result<Self> {
        let period: u64 = shares
            .iter()
            .try_fold(0u64, |a, &s| a.checked_add(s))
            .ok_or_else(|| DataError::InvalidConfig("blend shares overflow".into()))?;
        if shares.is_empty() || shares.contains(&0) || period > MAX_BLEND_PERIOD {
            return Err(DataError::InvalidConfig(format!(
                "blend shares {shares:?}: each must be at least 1 and their sum at most \
                 {MAX_BLEND_PERIOD}"
            )));
        }
        let first = greedy_period(shares, period, true)?;
        let steady = greedy_period(shares, period, false)?;
        Ok(BlendSchedule {
            shares: shares.to_vec(),
            period,
            first,
            steady,
        })
    }

    /// Samples per period.
    pub fn period(&self) -> u64 {
        self.period
    }

    /// Each source's samples per period.
    pub fn shares(&self) -> &[u64] {
        &self.shares
    }

    /// The source sample `position` of the stream reads, and how many samples of that source
    /// come before it (its position in the source's own stream).
    pub fn source_of(&self, position: u64) -> (usize, u64) {
        let (table, done, offset) = self.locate(position);
        let i = offset as usize;
        let source = table.source[i] as usize;
        (
            source,
            done.saturating_mul(self.shares[source]) + u64::from(table.index[i]),
        )
    }

    /// Samples of source `source` among the stream's first `position` samples (0 for a source
    /// that does not exist).
    pub fn drawn(&self, source: usize, position: u64) -> u64 {
        let Some(&share) = self.shares.get(source) else {
            return 0;
        };
        let (table, done, offset) = self.locate(position);
        let before = table.positions[source].partition_point(|&p| u64::from(p) < offset);
        done.saturating_mul(share) + before as u64
    }

    /// The period table that holds `position`, whole periods before it, and its offset there.
    fn locate(&self, position: u64) -> (&Period, u64, u64) {
        if position < self.period {
            (&self.first, 0, position)
        } else {
            let rest = position - self.period;
            (&self.steady, 1 + rest / self.period, rest % self.period)
        }
    }
}

/// One period of the greedy rule from every source on its share. In units of `1/period`, the
/// deficit of source `d` at sample `i` is `share_d · m − drawn_d · period`, with `m = max(i, 1)`
/// in the first period (Megatron's rule at sample 0) and `m = i` after it.
fn greedy_period(shares: &[u64], period: u64, first: bool) -> Result<Period> {
    let n = period as usize;
    let mut drawn = vec![0u64; shares.len()];
    let mut source = Vec::with_capacity(n);
    let mut index = Vec::with_capacity(n);
    let mut positions: Vec<Vec<u32>> = shares
        .iter()
        .map(|&s| Vec::with_capacity(s as usize))
        .collect();
    for i in 0..period {
        let m = if first { i.max(1) } else { i };
        let mut best = 0usize;
        let mut best_deficit = i128::MIN;
        for (d, (&share, &got)) in shares.iter().zip(&drawn).enumerate() {
            let deficit = i128::from(share) * i128::from(m) - i128::from(got) * i128::from(period);
            if deficit > best_deficit {
                best = d;
                best_deficit = deficit;
            }
        }
        source.push(best as u32);
        index.push(drawn[best] as u32);
        positions[best].push(i as u32);
        drawn[best] += 1;
    }
    // Every deficit stays above -1 sample, so a period ends with each source on its share
    // exactly; checked, since the lookup's arithmetic rests on it.
    if drawn != shares {
        return Err(DataError::InvalidConfig(format!(
            "blend schedule drew {drawn:?} in a period of shares {shares:?}"
        )));
    }
    Ok(Period {
        source,
        index,
        positions,
    })
}
