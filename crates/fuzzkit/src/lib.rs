//! # headroom-fuzzkit
//!
//! Deterministic mutation fuzzing for the workspace's file readers, as an ordinary `#[test]`:
//! start from valid files written by the crate's own writers, damage them (bit flips,
//! truncation inside the header, garbage appended, chunks duplicated or deleted, and known
//! header fields set to extreme values), feed every result to the reader, and count how it
//! answered. A reader must accept or return a typed error; a panic or an input that runs past
//! the time limit is a finding.
//!
//! ```
//! use headroom_fuzzkit::{fuzz, iterations, Field};
//!
//! // A toy format: magic "TOY1", a u32 element count, then that many u16 elements.
//! fn read_toy(bytes: &[u8]) -> Result<Vec<u16>, String> {
//!     let header = bytes.get(..8).ok_or("truncated header")?;
//!     if &header[..4] != b"TOY1" {
//!         return Err("bad magic".into());
//!     }
//!     let count = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
//!     // The count is untrusted: checked arithmetic, and compared with what is there.
//!     let body_len = usize::try_from(count).ok().and_then(|n| n.checked_mul(2));
//!     let body = &bytes[8..];
//!     if body_len != Some(body.len()) {
//!         return Err(format!("{count} elements announced, {} bytes present", body.len()));
//!     }
//!     Ok(body.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
//! }
//!
//! let mut valid = b"TOY1".to_vec();
//! valid.extend(3u32.to_le_bytes());
//! valid.extend([1, 0, 2, 0, 3, 0]);
//! let fields = [Field::new("count", 4, 4)];
//!
//! let report = fuzz("toy", &[valid], &fields, iterations(200), |bytes: &[u8]| {
//!     read_toy(bytes).map(drop)
//! });
//! report.assert_clean(); // 0 panics, 0 hangs
//! assert!(report.errors > 0 && report.ok > 0);
//! println!("{report}");
//! ```
//!
//! ## Pieces
//! - [`Mutator`] and [`Mutation`]: the damage; [`Field`] marks a header field and
//!   [`extreme_values`] lists what is written there (0, 1, 2³¹, 2³², 2⁴⁰, 2⁶², `MAX`, `MAX − 1`,
//!   negative values, …); [`systematic`] gives every field every extreme value, and cuts the
//!   seed inside the header and around every field ([`cut_points`]), before the random inputs.
//! - [`fuzz`], [`fuzz_seeds`], [`run`]: the runner, returning a [`FuzzReport`]; [`Campaign`]
//!   rebuilds any input from its number.
//! - [`bundle()`] and [`unbundle`]: several files (an index and its data) as one input.
//! - [`Rng`]: SplitMix64, so nothing depends on a random-number crate.
//!
//! ## Settings (environment)
//! - `HEADROOM_FUZZ_ITERS`: random inputs per campaign, read by [`iterations`]; tests pass a
//!   small default so the whole suite stays within seconds in CI.
//! - `HEADROOM_FUZZ_SEED`: the campaign seed (decimal or `0x…`).
//! - `HEADROOM_FUZZ_TIMEOUT_MS`: the per-input time limit (default 10 s).
//! - `HEADROOM_FUZZ_ONLY`: run only the input with this number (from a report).
//! - `HEADROOM_FUZZ_ARTIFACTS`: a directory where failing inputs are written whole.
//!
//! ## Panics, hangs and aborts
//! Panics are caught (`catch_unwind`) and recorded with their message and location. Each
//! input runs on a worker thread and the runner waits for it with a timeout: an input that
//! does not finish in time is a hang; the stuck thread is abandoned, a new one takes over, and
//! the campaign stops after a few hangs (see [`runner`]). Aborts (a failed huge allocation, a
//! stack overflow) kill the process: long campaigns run each target as its own process and
//! check its exit status (`scripts/fuzz-long.sh`).

pub mod bundle;
pub mod mutate;
pub mod rng;
pub mod runner;
pub mod scratch;

pub use bundle::{bundle, unbundle};
pub use mutate::{
    cut_points, extreme_values, length_values, systematic, Field, Mutated, Mutation, Mutator,
};
pub use rng::Rng;
pub use runner::{
    fuzz, fuzz_seeds, hex_preview, iterations, run, Campaign, Finding, FindingKind, FuzzConfig,
    FuzzReport, Seed, DEFAULT_ITERATIONS, DEFAULT_SEED, DEFAULT_TIMEOUT,
};
pub use scratch::{Cleanup, ScratchDir};
