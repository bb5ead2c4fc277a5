//! # headroom-mmap-data
//!
//! Training data that costs page cache, not heap: token files are memory-mapped and read in
//! place, windows are cut by seeded samplers, and worker threads fill a bounded set of reused
//! batch buffers ahead of the training loop.
//!
//! - **Formats** ([`formats`]): raw little-endian `u16`/`u32` files (nanoGPT `.bin`), llm.c
//!   shards (256 × i32 header), Megatron-LM indexed datasets (`.idx` + `.bin`), and a directory
//!   or glob of shards as one dataset — read as they are, with writers for each, and a
//!   writer that cuts one stream into numbered shards ([`formats::shards`], llm.c's layout).
//! - **Samplers** ([`WindowSampler`]): random windows (nanoGPT), shuffled non-overlapping
//!   windows exactly once per epoch, document-aware windows, sharded by (rank, world).
//! - **Blends** ([`blend`], [`TokenDataset::from_blend`]): several datasets drawn from in
//!   fixed proportions by Megatron-LM's greedy rule, each through its own sampler.
//! - **Loader** ([`Loader`]): crossbeam workers, bounded prefetch, no allocation per batch,
//!   `u32` or `i64` output, a serialisable position ([`LoaderState`]) that resumes the identical
//!   stream.
//! - **Synthetic data** ([`MarkovChain`]): a random sparse Markov chain with an exactly
//!   computed entropy rate — the loss floor of a run trained on it.
//! - **Loss masks** ([`loss_mask`]): `<file>.lossmask` beside a token file says which targets
//!   count in the loss (supervised fine-tuning's completion-only loss); [`open`] attaches it and
//!   the loader hands each batch's flags out with its targets.
//! - **Text** ([`text`]): byte-level tokenisation of UTF-8 files, with an optional
//!   end-of-text token between documents.
//! - **Tools** ([`tools`]): what `headroom data synth|build|inspect` calls — write the
//!   synthetic source or a tokenised text file in any format, describe any token file.
//!
//! ```
//! use std::sync::Arc;
//! use headroom_mmap_data::{
//!     formats, Loader, LoaderConfig, MarkovChain, OutputType, SamplerConfig, SamplingMode,
//!     Shard, TokenFileFormat, TokenType,
//! };
//!
//! # fn main() -> headroom_mmap_data::Result<()> {
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("train.bin");
//! let chain = MarkovChain::random(512, 4, 1)?;
//! chain.write(&path, 100_000, 7, TokenFileFormat::Raw(TokenType::U16))?;
//!
//! let data = Arc::new(formats::open(&path, &Default::default())?.with_vocab_size(512));
//! let sampler = SamplerConfig {
//!     mode: SamplingMode::EpochWindows,
//!     seq_len: 64,
//!     seed: 42,
//!     shard: Shard::SINGLE,
//! };
//! let mut config = LoaderConfig::new(8);
//! config.output = OutputType::U32;
//! let mut loader = Loader::new(Arc::clone(&data), sampler, config.clone(), None)?;
//! let first = loader.next_batch()?.targets_u32().unwrap().to_vec();
//! assert_eq!(first.len(), 8 * 64);
//!
//! // Save the position, resume elsewhere: the stream continues identically.
//! let saved = serde_json::to_string(&loader.state()).unwrap();
//! let expected = loader.next_batch()?.inputs_u32().unwrap().to_vec();
//! let mut resumed = Loader::resume(data, &serde_json::from_str(&saved).unwrap(), config, None)?;
//! assert_eq!(resumed.next_batch()?.inputs_u32().unwrap(), &expected[..]);
//! assert!(chain.entropy_rate() > 0.0); // nats/token: the loss floor on this data
//! # Ok(())
//! # }
//! ```
//!
//! ## Invariants
//! - This crate depends on `headroom-tensor` only; never on another technique crate.
//! - Token bytes are never copied out of the map except into a batch: no import step, no heap
//!   copy of the dataset. Batch buffers are allocated once per loader and reported to the
//!   allocation hook as [`headroom_tensor::MemoryCategory::Data`].
//! - Every parser validates every field (magic, version, dtype, lengths, pointers, document
//!   index) and returns a [`DataError`]; no input makes it panic, hang or read out of bounds,
//!   and buffers whose size a file decides are allocated fallibly ([`DataError::Allocation`],
//!   never an abort). `tests/fuzz_readers.rs` fuzzes every reader to keep it so. Token ids are
//!   checked against the vocabulary as they are copied.
//! - A sampler is a pure function of (dataset shape, config, position): the epoch samplers
//!   visit every window exactly once per epoch, shards are disjoint and cover the data, and a
//!   restored [`LoaderState`] replays the identical batch stream whatever the worker count.
//! - Every writer streams through [`formats::writer::TokenWriter`]: a temporary file beside the
//!   target, fsynced and renamed into place, so a reader never sees a partial file and a failed
//!   write leaves the previous file intact. The tools first check that the file fits its file
//!   system's free space ([`formats::writer::check_room`]): a mistyped size is refused, not
//!   streamed until the disk is full.
//! - Files must not be modified while a dataset over them is open (as with any memory map).

pub mod blend;
mod dataset;
mod error;
pub mod formats;
mod loader;
pub mod loss_mask;
pub mod permutation;
pub mod rng;
mod sampler;
mod synthetic;
pub mod text;
mod tokens;
pub mod tools;

pub use blend::{Blend, BlendSchedule, BlendSource};
pub use dataset::{Document, DocumentBoundaries, Segment, SequenceIndex, TokenDataset};
pub use error::{DataError, Result};
pub use formats::llmc::LlmcFlavor;
pub use formats::{open, OpenOptions, TokenFileFormat};
pub use loader::{fill_batch, Batch, BatchBuffer, Loader, LoaderConfig, LoaderState};
pub use loss_mask::{loss_mask_path, write_loss_mask, LossMask, LossMaskWriter};
pub use sampler::{SamplerConfig, SamplingMode, Shard, Window, WindowSampler};
pub use synthetic::{MarkovChain, MarkovStream};
pub use tokens::{OutputToken, OutputType, TokenSlice, TokenType};
pub use tools::{
    build_from_text, inspect, synthesize, BuildSpec, DatasetSummary, DetectedFormat, DtypeSource,
    FileDescription, InspectOptions, SynthSpec,
};
