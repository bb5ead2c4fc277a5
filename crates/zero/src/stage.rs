//! [`Stage`]: what ZeRO shards, and the order gradients are summed in.

use std::fmt;

use crate::error::{Result, ZeroError};

/// A ZeRO stage: which of the training state's three terms are sharded across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Plain data parallelism: everything replicated, gradients all-reduced.
    Zero0,
    /// Optimizer state (and, in mixed precision, the fp32 masters) sharded; gradients
    /// reduce-scattered at the step; updated parameters all-gathered.
    Zero1,
    /// Stage 1 plus gradients: reduce-scattered bucket by bucket during backward, each rank
    /// keeping only its gradient shard.
    Zero2,
    /// Stage 2 plus parameters: each rank keeps a parameter shard; a layer's full parameters
    /// exist only between its `gather` and `release`.
    Zero3,
}

impl Stage {
    /// Every stage, in order.
    pub const ALL: [Stage; 4] = [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3];

    /// The stage numbered `n` (0–3).
    pub fn from_index(n: u8) -> Result<Stage> {
        Stage::ALL
            .get(usize::from(n))
            .copied()
            .ok_or_else(|| ZeroError::InvalidConfig(format!("ZeRO stage {n} (expected 0-3)")))
    }

    /// The stage's number.
    pub const fn index(self) -> u8 {
        match self {
            Stage::Zero0 => 0,
            Stage::Zero1 => 1,
            Stage::Zero2 => 2,
            Stage::Zero3 => 3,
        }
    }

    /// Whether optimizer state is sharded (stages 1–3).
    pub const fn shards_optimizer(self) -> bool {
        !matches!(self, Stage::Zero0)
    }
    /// Whether gradients are sharded (stages 2–3).
    pub const fn shards_gradients(self) -> bool {
        matches!(self, Stage::Zero2 | Stage::Zero3)
    }
    /// Whether parameters are sharded (stage 3).
    pub const fn shards_parameters(self) -> bool {
        matches!(self, Stage::Zero3)
    }

    /// The order in which this stage sums gradients over ranks and micro-batches, which a
    /// single-process reference must follow to agree bit for bit.
    pub const fn reduction_order(self) -> ReductionOrder {
        if self.shards_gradients() {
            ReductionOrder::MicroBatchesOfRankSums
        } else {
            ReductionOrder::RankSumOfLocalAccumulations
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ZeRO-{}", self.index())
    }
}

/// How gradients of micro-batch `a` on rank `r`, `g[r][a]`, become the step's gradient. Every
/// `+` is an f32 addition, performed in exactly this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReductionOrder {
    /// Stages 0 and 1: each rank accumulates its micro-batches locally,
    /// `L[r] = ((0 + g[r][0]) + g[r][1]) + …`, then the ranks' sums are added in rank order,
    /// `(L[0] + L[1]) + … + L[N-1]`.
    RankSumOfLocalAccumulations,
    /// Stages 2 and 3: each micro-batch is reduced over ranks in rank order,
    /// `R[a] = (g[0][a] + g[1][a]) + … + g[N-1][a]`, and the rank's shard accumulates those,
    /// `((0 + R[0]) + R[1]) + …`.
    MicroBatchesOfRankSums,
}

impl ReductionOrder {
    /// Sum `grads[r][a]` (rank `r`, micro-batch `a`, each a gradient vector of equal length)
    /// in this order: the single-process reference of what a group computes.
    pub fn reduce(self, grads: &[Vec<Vec<f32>>]) -> Vec<f32> {
        let len = grads.first().and_then(|r| r.first()).map_or(0, Vec::len);
        let add = |acc: &mut Vec<f32>, x: &[f32]| {
            for (a, &v) in acc.iter_mut().zip(x) {
                *a += v;
            }
        };
        match self {
            ReductionOrder::RankSumOfLocalAccumulations => {
                let mut total: Option<Vec<f32>> = None;
                for rank in grads {
                    let mut local = vec![0.0f32; len];
                    for g in rank {
                        add(&mut local, g);
                    }
                    match &mut total {
                        None => total = Some(local),
                        Some(t) => add(t, &local),
                    }
                }
                total.unwrap_or_else(|| vec![0.0; len])
            }
            ReductionOrder::MicroBatchesOfRankSums => {
                let micro = grads.first().map_or(0, Vec::len);
                let mut acc = vec![0.0f32; len];
                for a in 0..micro {
                    let mut sum: Option<Vec<f32>> = None;
                    for rank in grads {
                        let Some(g) = rank.get(a) else { continue };
                        match &mut sum {
                            None => sum = Some(g.clone()),
                            Some(s) => add(s, g),
                        }
                    }
                    if let Some(s) = sum {
                        add(&mut acc, &s);
                    }
                }
                acc
            }
        }
    }
}
