//! What several integration tests share.

use std::ffi::OsString;
use std::process::Command;

/// The `headroom` program under test: `$HEADROOM_BIN` where set, else the one cargo built for
/// these tests. The variable points the tests at a copy that a rebuild cannot replace half-way
/// (long campaigns), and at the program beside the test binaries in a device bundle, where the
/// path cargo compiled in does not exist.
pub fn headroom_path() -> OsString {
    std::env::var_os("HEADROOM_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_headroom").into())
}

/// A command running [`headroom_path`].
pub fn headroom_command() -> Command {
    Command::new(headroom_path())
}

/// Odd values for any one JSON setting, for the structural fuzz tests of JSON readers: null,
/// a boolean, zero, negative, one, small, 2³¹, 2³², 2⁵³, `u64::MAX`, a fraction, ±1e300, strings
/// empty and not, an array and an object.
#[allow(dead_code)] // only the fuzz_* tests use it
pub fn odd_json_values() -> Vec<serde_json::Value> {
    use serde_json::json;
    vec![
        serde_json::Value::Null,
        json!(true),
        json!(0),
        json!(-1),
        json!(1),
        json!(3),
        json!(1u64 << 31),
        json!(1u64 << 32),
        json!(1u64 << 53),
        json!(u64::MAX),
        json!(0.5),
        json!(1e300),
        json!(-1e300),
        json!(""),
        json!("relu"),
        json!("x".repeat(4096)),
        json!([]),
        json!({}),
    ]
}

/// The files of directory `dir`, sorted by name, `last` (when given) moved to the end and
/// names in `skip` left out: the parts of a fuzz test's bundled input, or a set of shards to
/// compare.
#[allow(dead_code)] // the fuzz_* tests and the shard tests use it
pub fn dir_files(
    dir: &std::path::Path,
    last: Option<&str>,
    skip: &[&str],
) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !skip.contains(&n.as_str()))
        .map(|n| {
            let bytes = std::fs::read(dir.join(&n)).unwrap();
            (n, bytes)
        })
        .collect();
    files.sort_by_key(|(n, _)| (Some(n.as_str()) == last, n.clone()));
    files
}

/// `files` bundled as one fuzz seed, each safetensors file's header length (u64
/// little-endian, its one binary header field) marked for the extreme values.
#[allow(dead_code)] // only the fuzz_* tests use it
pub fn safetensors_bundle(name: &str, files: &[(String, Vec<u8>)]) -> headroom_fuzzkit::Seed {
    let header = [headroom_fuzzkit::Field::new(
        "safetensors header length",
        0,
        8,
    )];
    let parts: Vec<(&str, &[u8], &[headroom_fuzzkit::Field])> = files
        .iter()
        .map(|(n, b)| {
            let fields: &[headroom_fuzzkit::Field] = if n.ends_with(".safetensors") {
                &header
            } else {
                &[]
            };
            (n.as_str(), b.as_slice(), fields)
        })
        .collect();
    headroom_fuzzkit::bundle(name, &parts)
}

/// The `hf-granite` fixture's scalars (Granite 3's embedding 12 and residual 0.22; an attention
/// multiplier of 0.2 and a logits divisor of 6, not a power of two).
pub fn granite_multipliers() -> headroom_trainer::model::Multipliers {
    headroom_trainer::model::Multipliers {
        embedding: 12.0,
        residual: 0.22,
        attention: 0.2,
        logits_scaling: 6.0,
    }
}
