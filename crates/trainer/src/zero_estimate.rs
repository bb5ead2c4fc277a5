//! Per-rank memory of a trainer model under ZeRO (`headroom estimate --zero S --ranks N`),
//! before any rank runs: the answer to "how big a model fits on N devices".
//!
//! The model is split into ZeRO layers as a data-parallel trainer walks it: the embeddings,
//! each block, and the final norm with the (untied) head. The training state per rank —
//! parameters, gradients, optimizer state and fp32 masters, padding, stage 3's gathered
//! layers and stages 2–3's gradient buckets — is headroom-zero's [`per_rank_bytes`], the
//! layout its engine allocates (checked against its tracker in that crate's tests). What each
//! rank computes with — activations, workspace, the batch — is the single-process estimate of
//! one rank's micro-batch: ZeRO shards state, not activations.
//!
//! Two transients ride on top, bounded from above: stage 3 holds the gathered parameters of
//! two layers (the one computing and the one prefetched), stages 2–3 the gradient bucket being
//! filled plus at most `max_in_flight` (the engine's default, 2) being reduce-scattered, each
//! counted at the largest bucket's size.
//!
//! Not modelled (a typed error): an offloaded or 8-bit optimizer (ZeRO-Offload's host shard).

use headroom_offload::StatePrecision;
use headroom_tensor::MemoryCategory;
use headroom_zero::{per_rank_bytes, PerRankBytes, Stage, ZeroConfig};

use crate::estimate::estimate;
use crate::model::{params, ModelConfig, Precision};
use crate::techniques::{OptimizerPlacement, Techniques};
use crate::{Result, TrainError};

/// One rank's predicted bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZeroEstimate {
    /// The stage.
    pub stage: Stage,
    /// Data-parallel ranks.
    pub ranks: usize,
    /// Parameter count of the model.
    pub parameter_count: u64,
    /// The training state one rank holds (headroom-zero's layout).
    pub state: PerRankBytes,
    /// Stage 3's gathered parameters and stages 2–3's gradient buckets, bounded from above.
    pub transient_bytes: u64,
    /// Activations, workspace and batch of one rank's micro-batch at their simultaneous peak
    /// (the single-process estimate without its training state).
    pub compute_bytes: u64,
}

impl ZeroEstimate {
    /// One rank's peak: state + transients + compute.
    pub fn per_rank_peak(&self) -> u64 {
        self.state
            .persistent()
            .saturating_add(self.transient_bytes)
            .saturating_add(self.compute_bytes)
    }
}

/// The parameter count of each ZeRO layer of `cfg`: embeddings, blocks, final norm + head.
pub fn zero_layers(cfg: &ModelConfig) -> Vec<usize> {
    let infos = params::param_infos(cfg);
    let numel = |r: std::ops::Range<usize>| -> usize {
        infos[r]
            .iter()
            .map(|i| i.shape.iter().product::<usize>())
            .sum()
    };
    let emb = params::embedding_count(cfg);
    let per = params::per_layer(cfg);
    let mut out = vec![numel(0..emb)];
    for l in 0..cfg.layers {
        out.push(numel(emb + l * per..emb + (l + 1) * per));
    }
    out.push(numel(emb + cfg.layers * per..infos.len()));
    out
}

/// Predict one rank's memory for `ranks` data-parallel ranks under `stage`, each running
/// `batch` sequences of `seq` tokens in micro-batches of `micro` with `techniques`.
pub fn zero_estimate(
    cfg: &ModelConfig,
    seq: usize,
    micro: usize,
    batch: usize,
    techniques: &Techniques,
    stage: Stage,
    ranks: usize,
) -> Result<ZeroEstimate> {
    if ranks == 0 {
        return Err(TrainError::Input("--ranks must be at least 1".into()));
    }
    if techniques.optimizer.placement != OptimizerPlacement::Resident
        || techniques.optimizer.state != StatePrecision::F32
    {
        return Err(TrainError::Input(
            "the ZeRO estimate models f32 AdamW on the device; an offloaded or 8-bit \
             optimizer under ZeRO is not modelled"
                .into(),
        ));
    }
    let single = estimate(cfg, seq, micro, batch, techniques)?;
    let state_categories = [
        MemoryCategory::Parameters,
        MemoryCategory::Gradients,
        MemoryCategory::OptimizerState,
    ];
    let single_state: u64 = state_categories.iter().map(|&c| single.device[c]).sum();
    let compute_bytes = single.device_peak.saturating_sub(single_state);
    // fp16's working copies and gradients are as large as bf16's.
    let precision = match techniques.model.precision {
        Precision::Fp32 => headroom_zero::Precision::Fp32,
        Precision::Bf16 | Precision::Fp16 => headroom_zero::Precision::MixedBf16,
    };
    let config = ZeroConfig::new(stage);
    let state = per_rank_bytes(
        stage,
        &zero_layers(cfg),
        ranks,
        precision,
        8,
        config.bucket_bytes,
    )
    .map_err(|e| TrainError::Input(format!("ZeRO estimate: {e}")))?;
    let transient_bytes = state.gathered_layer_max.saturating_mul(2).saturating_add(
        state
            .bucket_max
            .saturating_mul(config.max_in_flight as u64 + 1),
    );
    Ok(ZeroEstimate {
        stage,
        ranks,
        parameter_count: single.parameter_count,
        state,
        transient_bytes,
        compute_bytes,
    })
}

/// The most layers (at `cfg`'s width, heads and vocabulary) whose per-rank peak fits
/// `budget` bytes, with that estimate; `None` when not even one layer fits. (The arguments are
/// [`zero_estimate`]'s plus the budget.)
#[allow(clippy::too_many_arguments)]
pub fn largest_fitting_depth(
    cfg: &ModelConfig,
    seq: usize,
    micro: usize,
    batch: usize,
    techniques: &Techniques,
    stage: Stage,
    ranks: usize,
    budget: u64,
) -> Result<Option<(usize, ZeroEstimate)>> {
    let at = |layers: usize| -> Result<ZeroEstimate> {
        let c = ModelConfig { layers, ..*cfg };
        // Schedules are per layer count; every-k and √n rebuild themselves from it.
        zero_estimate(&c, seq, micro, batch, techniques, stage, ranks)
    };
    let fits = |layers: usize| -> Result<Option<ZeroEstimate>> {
        let e = at(layers)?;
        Ok((e.per_rank_peak() <= budget).then_some(e))
    };
    let Some(mut best) = fits(1)? else {
        return Ok(None);
    };
    let (mut lo, mut hi) = (1usize, 2usize);
    // Double until it no longer fits (bounded: the state grows with every layer).
    while let Some(e) = fits(hi)? {
        (lo, best) = (hi, e);
        if hi >= 1 << 16 {
            return Ok(Some((lo, best)));
        }
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match fits(mid)? {
            Some(e) => (lo, best) = (mid, e),
            None => hi = mid,
        }
    }
    Ok(Some((lo, best)))
}
