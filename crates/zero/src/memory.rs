//! Per-rank memory of each stage: the ZeRO paper's formulas, exactly as the engine allocates.

use crate::error::{Result, ZeroError};
use crate::layout::{BucketPlan, FlatLayout};
use crate::Stage;

/// The number formats of a training state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// fp32 parameters and gradients; the parameters are the masters (no separate copy).
    Fp32,
    /// bf16 working parameters and gradients (2 bytes each) with fp32 master weights kept
    /// with the optimizer state (4 more bytes per parameter there), as in the ZeRO paper.
    MixedBf16,
}

impl Precision {
    /// Bytes per working parameter.
    pub const fn param_bytes(self) -> usize {
        match self {
            Precision::Fp32 => 4,
            Precision::MixedBf16 => 2,
        }
    }
    /// Bytes per gradient element.
    pub const fn grad_bytes(self) -> usize {
        self.param_bytes()
    }
    /// Bytes per parameter kept with the optimizer besides its own state (fp32 masters).
    pub const fn master_bytes(self) -> usize {
        match self {
            Precision::Fp32 => 0,
            Precision::MixedBf16 => 4,
        }
    }
}

/// One rank's persistent and transient training-state bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerRankBytes {
    /// Parameters kept between steps (the full replica in stages 0–2, the shard in stage 3).
    pub parameters: u64,
    /// Gradients kept between steps (the full buffer in stages 0–1, the shard in 2–3).
    pub gradients: u64,
    /// Optimizer state (and fp32 masters in mixed precision).
    pub optimizer_state: u64,
    /// Padding elements included above (per layer, fewer than the world size each).
    pub padding_elements: u64,
    /// Stage 3: bytes of the largest layer's gathered parameters; one such buffer is live per
    /// gathered or prefetched layer. 0 in other stages.
    pub gathered_layer_max: u64,
    /// Stages 2–3: bytes of the largest gradient bucket (its padded gradients); one is live
    /// per bucket being filled or in flight. 0 in other stages.
    pub bucket_max: u64,
}

impl PerRankBytes {
    /// Persistent bytes: parameters + gradients + optimizer state.
    pub fn persistent(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer_state
    }
}

/// The bytes one rank holds for a model of `layer_numels` parameters per layer, sharded by
/// `stage` over `world` ranks, exactly as [`ZeroEngine`](crate::ZeroEngine) lays them out:
/// each layer is its own flat buffer padded to a multiple of `world` (stage 0 has no padding).
///
/// Per parameter, without padding, with `K = optimizer_bytes_per_param` (8 for Adam) and
/// `P`/`G` the parameter/gradient bytes of `precision`, `M` its master bytes:
/// stage 0 `P + G + (M+K)`; stage 1 `P + G + (M+K)/N`; stage 2 `P + (G+M+K)/N`;
/// stage 3 `(P+G+M+K)/N`. fp32 Adam: 16, 8 + 8/N, 4 + 12/N, 16/N; mixed bf16 Adam:
/// 16, 4 + 12/N, 2 + 14/N, 16/N. `bucket_bytes` sizes the gradient buckets (stages 2–3).
pub fn per_rank_bytes(
    stage: Stage,
    layer_numels: &[usize],
    world: usize,
    precision: Precision,
    optimizer_bytes_per_param: usize,
    bucket_bytes: usize,
) -> Result<PerRankBytes> {
    if world == 0 {
        return Err(ZeroError::InvalidConfig(
            "world size must be at least 1".into(),
        ));
    }
    let (mut full, mut padded, mut shard, mut gathered_max) = (0u64, 0u64, 0u64, 0u64);
    let mut padded_bytes = Vec::with_capacity(layer_numels.len());
    for &n in layer_numels {
        let l = FlatLayout::new(&[n], world)?;
        full += n as u64;
        padded += l.padded_len() as u64;
        shard += l.shard_len() as u64;
        let pb = (l.padded_len() as u64).saturating_mul(precision.grad_bytes() as u64);
        padded_bytes.push(usize::try_from(pb).unwrap_or(usize::MAX));
        gathered_max = gathered_max.max(pb);
    }
    let p = precision.param_bytes() as u64;
    let g = precision.grad_bytes() as u64;
    let k = (precision.master_bytes() + optimizer_bytes_per_param) as u64;
    let bucket_max = || {
        let plan = BucketPlan::new(&padded_bytes, bucket_bytes);
        plan.buckets()
            .iter()
            .map(|b| b.iter().map(|&l| padded_bytes[l] as u64).sum::<u64>())
            .max()
            .unwrap_or(0)
    };
    let out = match stage {
        Stage::Zero0 => PerRankBytes {
            parameters: full * p,
            gradients: full * g,
            optimizer_state: full * k,
            ..PerRankBytes::default()
        },
        Stage::Zero1 => PerRankBytes {
            parameters: padded * p,
            gradients: padded * g,
            optimizer_state: shard * k,
            padding_elements: padded - full,
            ..PerRankBytes::default()
        },
        Stage::Zero2 => PerRankBytes {
            parameters: padded * p,
            gradients: shard * g,
            optimizer_state: shard * k,
            padding_elements: padded - full,
            bucket_max: bucket_max(),
            ..PerRankBytes::default()
        },
        Stage::Zero3 => PerRankBytes {
            parameters: shard * p,
            gradients: shard * g,
            optimizer_state: shard * k,
            padding_elements: padded - full,
            gathered_layer_max: gathered_max * p / g.max(1),
            bucket_max: bucket_max(),
        },
    };
    Ok(out)
}

/// The paper's bytes per parameter for one rank, ignoring padding and transients (see
/// [`per_rank_bytes`] for the terms).
pub fn paper_bytes_per_param(
    stage: Stage,
    world: usize,
    precision: Precision,
    optimizer_bytes_per_param: usize,
) -> f64 {
    let n = world.max(1) as f64;
    let p = precision.param_bytes() as f64;
    let g = precision.grad_bytes() as f64;
    let k = (precision.master_bytes() + optimizer_bytes_per_param) as f64;
    match stage {
        Stage::Zero0 => p + g + k,
        Stage::Zero1 => p + g + k / n,
        Stage::Zero2 => p + (g + k) / n,
        Stage::Zero3 => (p + g + k) / n,
    }
}
