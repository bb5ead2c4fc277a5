//! The models — GPT-2 and Llama — written once over the backend: configuration, parameters,
//! numeric precision, the ops a backend implements ([`ModelOps`]), and the explicit forward
//! and backward (blocks as ckpt layers).

mod config;
mod cpu_ops;
#[cfg(feature = "cuda")]
mod cuda_ops;
mod decode;
pub mod finetune;
mod gpt2_block;
mod llama_block;
pub mod ops;
pub mod params;
mod precision;
mod transformer;

pub use crate::ops::rope::{Rope, RopeScaling};
pub use config::{
    Family, LlamaClass, LlamaShape, MlpGate, ModelConfig, Multipliers, QkNorm, RmsNorm,
    SlidingWindow,
};
pub use decode::{KvCache, LayerKv, KV_GROWTH};
pub use finetune::{AdaptedModule, FinetuneBuilder, FinetuneSpec, QuantSpec};
pub use ops::{HeadLossGrads, ModelOps};
pub use precision::Precision;
#[cfg(feature = "cuda")]
pub(crate) use transformer::View;
pub use transformer::{
    check_batch, counted_targets, BlockOutput, BlockSaved, Documents, Geometry, Gpt2Saved,
    HeadGrads, HeadWeights, KeptNorm, LlamaSaved, Model, ModelOptions, NormStats, Part, PartStore,
    IGNORE_TARGET,
};
