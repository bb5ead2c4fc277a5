//! Splitting a batch of sequences into micro-batches, by sequence count or by token budget,
//! and counting the loss tokens each one holds.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::{AccumError, Result, StepTokens};

/// How to cut a batch into micro-batches. Sequences keep their order; every micro-batch is a
/// contiguous run of them, and only the last may be smaller than the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SplitBy {
    /// At most this many sequences per micro-batch.
    Sequences(usize),
    /// At most this many *padded* tokens per micro-batch: sequences × the longest sequence in
    /// it, which is what a dense `[sequences, length]` activation tensor holds. Sequences are
    /// packed greedily in order.
    TokenBudget(usize),
}

/// One sequence's size as the planner sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceTokens {
    /// Tokens in the sequence (its padded-free length).
    pub tokens: usize,
    /// Tokens whose loss counts (not masked out); at most `tokens`.
    pub counted: u64,
}

/// A contiguous run of sequences of the batch, with its token counts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MicroBatch {
    /// Indices of the sequences in the batch.
    pub sequences: Range<usize>,
    /// Total tokens of those sequences.
    pub tokens: usize,
    /// Sequences × the longest of them: the size of the dense tensor that holds them.
    pub padded_tokens: usize,
    /// Tokens whose loss counts.
    pub counted_tokens: u64,
}

impl MicroBatch {
    /// The items of this micro-batch from a per-sequence slice of the whole batch (inputs,
    /// targets, masks), or `None` when `items` is shorter than the batch.
    pub fn select<'a, T>(&self, items: &'a [T]) -> Option<&'a [T]> {
        items.get(self.sequences.clone())
    }

    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    /// True when the micro-batch holds no sequences (never the case in a plan).
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }
}

/// A batch cut into micro-batches, with the batch's total of counted tokens — the number every
/// micro-batch's loss gradient is divided by, known before the first backward.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MicroBatchPlan {
    micro_batches: Vec<MicroBatch>,
    counted_tokens: u64,
}

impl MicroBatchPlan {
    /// Plan from per-sequence loss masks (`true` = the token's loss counts); a mask's length is
    /// its sequence's length.
    pub fn from_loss_masks<M: AsRef<[bool]>>(loss_masks: &[M], split: SplitBy) -> Result<Self> {
        let sequences: Vec<SequenceTokens> = loss_masks
            .iter()
            .map(|m| {
                let m = m.as_ref();
                SequenceTokens {
                    tokens: m.len(),
                    counted: m.iter().filter(|&&c| c).count() as u64,
                }
            })
            .collect();
        Self::from_sequences(&sequences, split)
    }

    /// Plan from per-sequence token counts.
    pub fn from_sequences(sequences: &[SequenceTokens], split: SplitBy) -> Result<Self> {
        if sequences.is_empty() {
            return Err(AccumError::EmptyBatch);
        }
        for (index, s) in sequences.iter().enumerate() {
            if s.counted > s.tokens as u64 {
                return Err(AccumError::CountedExceedsLength {
                    index,
                    tokens: s.tokens,
                    counted: s.counted,
                });
            }
        }
        let ranges = match split {
            SplitBy::Sequences(0) => return Err(AccumError::ZeroMicroBatchSize),
            SplitBy::Sequences(n) => (0..sequences.len())
                .step_by(n)
                .map(|start| start..start.saturating_add(n).min(sequences.len()))
                .collect(),
            SplitBy::TokenBudget(0) => return Err(AccumError::ZeroTokenBudget),
            SplitBy::TokenBudget(budget) => pack_by_budget(sequences, budget)?,
        };
        let micro_batches: Vec<MicroBatch> = ranges
            .into_iter()
            .map(|r: Range<usize>| {
                let seqs = sequences.get(r.clone()).unwrap_or_default();
                let longest = seqs.iter().map(|s| s.tokens).max().unwrap_or(0);
                // Saturating: absurd user-supplied lengths must not panic or wrap.
                MicroBatch {
                    tokens: seqs.iter().fold(0, |a, s| a.saturating_add(s.tokens)),
                    padded_tokens: longest.saturating_mul(seqs.len()),
                    counted_tokens: seqs.iter().fold(0, |a, s| a.saturating_add(s.counted)),
                    sequences: r,
                }
            })
            .collect();
        let counted_tokens = micro_batches
            .iter()
            .fold(0u64, |a, m| a.saturating_add(m.counted_tokens));
        Ok(MicroBatchPlan {
            micro_batches,
            counted_tokens,
        })
    }

    /// The micro-batches, in batch order.
    pub fn micro_batches(&self) -> &[MicroBatch] {
        &self.micro_batches
    }

    /// Counted tokens in the whole batch.
    pub fn counted_tokens(&self) -> u64 {
        self.counted_tokens
    }

    /// The token counts to begin a single-device step with. For data parallelism build
    /// [`StepTokens::data_parallel`] from this device's count and the sum over devices.
    pub fn step_tokens(&self) -> Result<StepTokens> {
        StepTokens::single_device(self.counted_tokens)
    }

    /// The largest padded micro-batch: what sizes the activation memory.
    pub fn max_padded_tokens(&self) -> usize {
        self.micro_batches
            .iter()
            .map(|m| m.padded_tokens)
            .max()
            .unwrap_or(0)
    }
}

/// Greedy in-order packing: a sequence joins the open micro-batch while the padded size stays
/// within budget. Greedy is not the fewest micro-batches for arbitrary orders, but it keeps the
/// data order (and so the sampler's reproducibility) intact, which reordering would not.
fn pack_by_budget(sequences: &[SequenceTokens], budget: usize) -> Result<Vec<Range<usize>>> {
    let mut ranges = Vec::new();
    let mut start = 0usize;
    let mut longest = 0usize;
    for (i, s) in sequences.iter().enumerate() {
        if s.tokens > budget {
            return Err(AccumError::SequenceOverBudget {
                index: i,
                tokens: s.tokens,
                budget,
            });
        }
        let grown = longest.max(s.tokens);
        // `i - start + 1` sequences of length `grown`; overflow means "over budget".
        let fits = grown
            .checked_mul(i - start + 1)
            .is_some_and(|padded| padded <= budget);
        if fits {
            longest = grown;
        } else {
            ranges.push(start..i);
            start = i;
            longest = s.tokens;
        }
    }
    ranges.push(start..sequences.len());
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seqs(lens: &[(usize, u64)]) -> Vec<SequenceTokens> {
        lens.iter()
            .map(|&(tokens, counted)| SequenceTokens { tokens, counted })
            .collect()
    }

    #[test]
    fn by_sequences_last_is_smaller() {
        let plan = MicroBatchPlan::from_loss_masks(
            &[
                vec![true, false],
                vec![true],
                vec![false, false, true],
                vec![true, true, true],
                vec![],
            ],
            SplitBy::Sequences(2),
        )
        .unwrap();
        let mbs = plan.micro_batches();
        assert_eq!(mbs.len(), 3);
        assert_eq!(mbs[0].sequences, 0..2);
        assert_eq!(
            (mbs[0].tokens, mbs[0].padded_tokens, mbs[0].counted_tokens),
            (3, 4, 2)
        );
        assert_eq!(mbs[1].sequences, 2..4);
        assert_eq!(mbs[1].counted_tokens, 4);
        assert_eq!(mbs[2].sequences, 4..5);
        assert_eq!((mbs[2].tokens, mbs[2].counted_tokens), (0, 0));
        assert_eq!(plan.counted_tokens(), 6);
        assert_eq!(
            mbs[1].select(&["a", "b", "c", "d", "e"]),
            Some(&["c", "d"][..])
        );
        assert_eq!(mbs[1].select(&["a", "b", "c"]), None);
    }

    #[test]
    fn by_budget_counts_padding() {
        // Lengths 3, 1, 4, 2 with budget 6: [3,1] pads to 6; adding 4 would pad to 12;
        // [4] alone; [4,2] pads to 8 > 6, so [2] alone.
        let plan = MicroBatchPlan::from_sequences(
            &seqs(&[(3, 3), (1, 0), (4, 2), (2, 2)]),
            SplitBy::TokenBudget(6),
        )
        .unwrap();
        let ranges: Vec<_> = plan
            .micro_batches()
            .iter()
            .map(|m| m.sequences.clone())
            .collect();
        assert_eq!(ranges, vec![0..2, 2..3, 3..4]);
        assert_eq!(plan.max_padded_tokens(), 6);
        assert_eq!(
            plan.step_tokens().unwrap(),
            StepTokens::single_device(7).unwrap()
        );
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let s = seqs(&[(3, 1), (9, 0)]);
        assert!(matches!(
            MicroBatchPlan::from_sequences(&s, SplitBy::TokenBudget(8)),
            Err(AccumError::SequenceOverBudget {
                index: 1,
                tokens: 9,
                budget: 8
            })
        ));
        assert!(matches!(
            MicroBatchPlan::from_sequences(&s, SplitBy::TokenBudget(0)),
            Err(AccumError::ZeroTokenBudget)
        ));
        assert!(matches!(
            MicroBatchPlan::from_sequences(&s, SplitBy::Sequences(0)),
            Err(AccumError::ZeroMicroBatchSize)
        ));
        assert!(matches!(
            MicroBatchPlan::from_sequences(&[], SplitBy::Sequences(1)),
            Err(AccumError::EmptyBatch)
        ));
        assert!(matches!(
            MicroBatchPlan::from_sequences(&seqs(&[(2, 3)]), SplitBy::Sequences(1)),
            Err(AccumError::CountedExceedsLength {
                index: 0,
                tokens: 2,
                counted: 3
            })
        ));
        // A batch with no counted token plans fine but cannot begin a step.
        let plan = MicroBatchPlan::from_sequences(&seqs(&[(2, 0)]), SplitBy::Sequences(1)).unwrap();
        assert!(matches!(
            plan.step_tokens(),
            Err(AccumError::ZeroGlobalTokens)
        ));
    }

    #[test]
    fn absurd_lengths_saturate_instead_of_panicking() {
        let huge = seqs(&[(usize::MAX, usize::MAX as u64), (usize::MAX, 1)]);
        let plan = MicroBatchPlan::from_sequences(&huge, SplitBy::Sequences(2)).unwrap();
        let mb = &plan.micro_batches()[0];
        assert_eq!((mb.tokens, mb.padded_tokens), (usize::MAX, usize::MAX));
        assert_eq!(plan.counted_tokens(), (usize::MAX as u64).saturating_add(1));
        let plan = MicroBatchPlan::from_sequences(&huge, SplitBy::TokenBudget(usize::MAX)).unwrap();
        assert_eq!(plan.micro_batches().len(), 2);
    }

    fn batch() -> impl Strategy<Value = Vec<Vec<bool>>> {
        prop::collection::vec(prop::collection::vec(any::<bool>(), 0..12), 1..24)
    }

    /// Checks every plan must satisfy: contiguous in-order cover, consistent counts.
    fn check_cover(plan: &MicroBatchPlan, masks: &[Vec<bool>]) -> Result<(), TestCaseError> {
        let mut next = 0;
        for mb in plan.micro_batches() {
            prop_assert_eq!(mb.sequences.start, next);
            prop_assert!(!mb.is_empty());
            next = mb.sequences.end;
            let ms = mb.select(masks).unwrap();
            prop_assert_eq!(mb.tokens, ms.iter().map(Vec::len).sum::<usize>());
            let counted = ms.iter().flatten().filter(|&&c| c).count() as u64;
            prop_assert_eq!(mb.counted_tokens, counted);
            let longest = ms.iter().map(Vec::len).max().unwrap();
            prop_assert_eq!(mb.padded_tokens, longest * ms.len());
        }
        prop_assert_eq!(next, masks.len());
        let total = masks.iter().flatten().filter(|&&c| c).count() as u64;
        prop_assert_eq!(plan.counted_tokens(), total);
        Ok(())
    }

    proptest! {
        #[test]
        fn sequence_split_covers_in_order(masks in batch(), n in 1usize..8) {
            let plan = MicroBatchPlan::from_loss_masks(&masks, SplitBy::Sequences(n)).unwrap();
            check_cover(&plan, &masks)?;
            let mbs = plan.micro_batches();
            prop_assert_eq!(mbs.len(), masks.len().div_ceil(n));
            for mb in &mbs[..mbs.len() - 1] {
                prop_assert_eq!(mb.len(), n);
            }
            prop_assert!(mbs[mbs.len() - 1].len() <= n);
        }

        #[test]
        fn budget_split_fits_and_is_greedy(masks in batch(), budget in 11usize..64) {
            let plan = MicroBatchPlan::from_loss_masks(&masks, SplitBy::TokenBudget(budget)).unwrap();
            check_cover(&plan, &masks)?;
            let mbs = plan.micro_batches();
            for (i, mb) in mbs.iter().enumerate() {
                prop_assert!(mb.padded_tokens <= budget);
                // Greedy: the next sequence would not have fitted.
                if let Some(next) = mbs.get(i + 1) {
                    let first_next = next.sequences.start;
                    let longest = masks[mb.sequences.clone()]
                        .iter()
                        .chain(std::iter::once(&masks[first_next]))
                        .map(Vec::len)
                        .max()
                        .unwrap();
                    prop_assert!(longest * (mb.len() + 1) > budget);
                }
            }
        }
    }
}
