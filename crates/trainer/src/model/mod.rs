//! The GPT-2 model: configuration, parameters, numeric precision, and the explicit forward and
//! backward (blocks as ckpt layers).

mod block;
mod config;
mod gpt;
pub mod params;
mod precision;

pub use block::Block;
pub use config::GptConfig;
#[cfg(feature = "cuda")]
pub(crate) use gpt::View;
pub use gpt::{check_batch, BlockSaved, Geometry, Gpt, GptOptions, HeadGrads};
pub use precision::Precision;
