//! Shared helpers for headroom's benchmarks.
//!
//! Criterion benches follow one naming convention so `cargo xtask bench` can pair every
//! measurement with its baseline: the group is `"<crate>/<what>"`, the function under test is
//! named `"headroom"` (or a variant name), the baseline measured beside it is named
//! `"baseline_<name>"`, and the parameter is the size (`"64MiB"`). Benchmarks that measure
//! something other than time (bytes from the memory tracker, a comparison script) append a
//! [`Record`] with [`record`].

use std::io::Write;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Whether a larger or a smaller value is better.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    /// Throughput-like metrics.
    Higher,
    /// Time-like and memory-like metrics.
    Lower,
}

/// One line of `results.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Benchmark id, `"<crate>/<what>/<variant>/<size>"`.
    pub bench: String,
    /// What was measured (`"bandwidth"`, `"median_time"`, `"peak_bytes"`, …).
    pub metric: String,
    /// The measured value.
    pub value: f64,
    /// Unit of `value` (`"GB/s"`, `"ns"`, `"bytes"`).
    pub unit: String,
    /// The baseline's benchmark id, when there is one.
    pub baseline: Option<String>,
    /// The baseline's value in the same unit, measured in the same run.
    pub baseline_value: Option<f64>,
    /// `value / baseline_value`.
    pub ratio: Option<f64>,
    /// Which direction is better.
    pub better: Better,
}

/// Directory where bench output goes: `$HEADROOM_BENCH_DIR`, else `target/headroom-bench`
/// under the workspace.
pub fn output_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("HEADROOM_BENCH_DIR") {
        return PathBuf::from(d);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("headroom-bench")
}

/// Append a record to `<output_dir>/records.jsonl` (merged into `results.json` by xtask).
pub fn record(r: &Record) -> std::io::Result<()> {
    let dir = output_dir();
    std::fs::create_dir_all(&dir)?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("records.jsonl"))?;
    let line = serde_json::to_string(r).map_err(std::io::Error::other)?;
    writeln!(f, "{line}")
}

/// A human size label for benchmark parameters: `1MiB`, `64MiB`, `3KiB`, `100B`.
pub fn size_label(bytes: usize) -> String {
    const MIB: usize = 1 << 20;
    const KIB: usize = 1 << 10;
    if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{}MiB", bytes / MIB)
    } else if bytes >= KIB && bytes.is_multiple_of(KIB) {
        format!("{}KiB", bytes / KIB)
    } else {
        format!("{bytes}B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(size_label(64 << 20), "64MiB");
        assert_eq!(size_label(3 << 10), "3KiB");
        assert_eq!(size_label(100), "100B");
    }
}
