//! What the Parquet and Arrow fixture tests share: where pyarrow's files are, their manifest
//! and expected rows, and the bounds the fuzz campaigns read under.
#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};

use headroom_parquet::{ReadOptions, Row};
use serde_json::Value;

/// `tests/fixtures`, or its subdirectory `sub` (`""` for the Parquet files themselves).
pub fn fixture_dir(sub: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(sub)
}

/// `dir`'s `MANIFEST.json`.
pub fn manifest(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("MANIFEST.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The rows pyarrow read from a fixture, as `dir/name` holds them (one JSON object a line).
pub fn expected(dir: &Path, name: &str) -> Vec<Row> {
    let text = std::fs::read_to_string(dir.join(name)).unwrap();
    text.lines()
        .map(|l| match serde_json::from_str(l).unwrap() {
            Value::Object(row) => row,
            other => panic!("{name}: {other} is not an object"),
        })
        .collect()
}

/// The bounds a damaged file is read under: small, so that a size the damage inflated is
/// refused rather than allocated.
pub fn fuzz_options() -> ReadOptions {
    ReadOptions {
        columns: None,
        max_values: 1 << 20,
        max_page_bytes: 1 << 22,
    }
}
