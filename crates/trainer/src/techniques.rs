//! The memory techniques of a run, each an independent setting: precision, attention and the
//! fused loss (in [`ModelOptions`]), block checkpointing, the optimizer's state format and
//! placement, and micro-batching. [`Techniques::baseline`] is what every saving is measured
//! against.

use std::path::PathBuf;

use headroom_attn::AttentionConfig;
use headroom_ckpt::{Planner, Schedule};
use headroom_offload::StatePrecision;

use crate::model::{FinetuneSpec, ModelConfig, ModelOptions};
use crate::Result;

/// Which block activations are kept and which are recomputed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointChoice {
    /// Keep everything.
    None,
    /// Keep the input of every k-th block; recompute segments of k.
    EveryK(usize),
    /// Every k with k = ⌈√layers⌉.
    SqrtN,
    /// Keep every block but drop its layer-norm and GELU outputs (recomputed in backward).
    Selective,
    /// The planner's least-recompute schedule whose saved activations fit this many bytes
    /// (`None`: what the run's budget leaves after the estimator's other categories).
    Optimal(Option<u64>),
}

impl CheckpointChoice {
    /// Short name for tables.
    pub fn name(&self) -> String {
        match self {
            CheckpointChoice::None => "none".into(),
            CheckpointChoice::EveryK(k) => format!("every-{k}"),
            CheckpointChoice::SqrtN => "sqrt-n".into(),
            CheckpointChoice::Selective => "selective".into(),
            CheckpointChoice::Optimal(_) => "optimal".into(),
        }
    }
}

/// Where the optimizer's moments (and, in low precision, the fp32 masters) live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OptimizerPlacement {
    /// On the device, beside the model.
    Resident,
    /// In host RAM (ZeRO-Offload).
    HostRam,
    /// In a memory-mapped file (ZeRO-Infinity's NVMe offload); masters in host RAM.
    File(PathBuf),
}

/// The optimizer's setup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptimizerChoice {
    /// Moment format: f32, or blockwise 8-bit.
    pub state: StatePrecision,
    /// Where the state lives.
    pub placement: OptimizerPlacement,
}

impl OptimizerChoice {
    /// f32 AdamW on the device.
    pub fn resident() -> Self {
        OptimizerChoice {
            state: StatePrecision::F32,
            placement: OptimizerPlacement::Resident,
        }
    }

    /// Whether the state is off the device.
    pub fn is_offloaded(&self) -> bool {
        self.placement != OptimizerPlacement::Resident
    }
}

/// Every memory technique of a run, each independent of the others.
#[derive(Clone, Debug, PartialEq)]
pub struct Techniques {
    /// Precision, attention algorithm, selective recomputation, fused loss.
    pub model: ModelOptions,
    /// Block checkpointing.
    pub checkpoint: CheckpointChoice,
    /// Optimizer state format and placement.
    pub optimizer: OptimizerChoice,
    /// Sequences per micro-batch (`None`: the whole batch at once).
    pub micro_batch: Option<usize>,
    /// LoRA / QLoRA: a frozen base (in the run's precision or 4 bits) and trainable adapters;
    /// `None` trains every parameter.
    pub finetune: Option<FinetuneSpec>,
}

impl Techniques {
    /// fp32, naive attention, nothing recomputed, resident AdamW: the baseline every saving is
    /// measured against.
    pub fn baseline() -> Self {
        Techniques {
            model: ModelOptions {
                attention: AttentionConfig::naive(),
                ..ModelOptions::default()
            },
            checkpoint: CheckpointChoice::None,
            optimizer: OptimizerChoice::resident(),
            micro_batch: None,
            finetune: None,
        }
    }

    /// One line naming every setting.
    pub fn describe(&self) -> String {
        let opt = format!(
            "{} AdamW {}",
            match self.optimizer.state {
                StatePrecision::F32 => "f32",
                StatePrecision::Int8 => "8-bit (code book)",
                StatePrecision::Float8 => "8-bit",
            },
            match &self.optimizer.placement {
                OptimizerPlacement::Resident => "resident".to_string(),
                OptimizerPlacement::HostRam => "offloaded to RAM".to_string(),
                OptimizerPlacement::File(p) => format!("offloaded to {}", p.display()),
            }
        );
        format!(
            "{}, {} attention, checkpoint {}{}, {}{}{}",
            self.model.precision.name(),
            self.model.attention.algorithm.name(),
            self.checkpoint.name(),
            if self.model.selective && self.checkpoint != CheckpointChoice::Selective {
                "+selective"
            } else {
                ""
            },
            opt,
            self.model
                .loss_chunk
                .map_or(String::new(), |r| format!(", fused loss ({r} rows)")),
            self.micro_batch
                .map_or(String::new(), |m| format!(", micro-batch {m}")),
        ) + &self
            .finetune
            .as_ref()
            .map_or(String::new(), |f| format!(", {}", f.describe()))
    }
}

/// The checkpoint schedule over the blocks for `choice`.
pub fn block_schedule(
    choice: CheckpointChoice,
    cfg: &ModelConfig,
    setup_bytes: impl FnOnce() -> Result<(headroom_ckpt::ChainCost, u64)>,
) -> Result<Schedule> {
    let n = cfg.layers;
    Ok(match choice {
        CheckpointChoice::None | CheckpointChoice::Selective => Schedule::store_all(n)?,
        CheckpointChoice::EveryK(k) => Schedule::every_k(n, k)?,
        CheckpointChoice::SqrtN => Schedule::sqrt_n(n)?,
        CheckpointChoice::Optimal(_) => {
            let (costs, budget) = setup_bytes()?;
            Planner::default().optimal(&costs, budget)?.schedule
        }
    })
}
