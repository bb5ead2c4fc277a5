//! The GPT-2 model: configuration, parameters, and explicit forward/backward.

mod config;
mod gpt;
pub mod params;

pub use config::GptConfig;
pub use gpt::{BlockActivations, Geometry, Gpt, HeadActivations};
