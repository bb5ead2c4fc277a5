//! Fuzzing the reader with damaged Parquet files: pyarrow's fixtures (every codec, page
//! version and encoding the reader knows) with bits flipped, bytes cut, chunks repeated and the
//! footer's length set to extreme values. Whatever parses is read whole under small bounds and
//! must hold its own row count and fields; everything else must be a typed error. 0 panics and
//! 0 hangs.
//!
//! `HEADROOM_FUZZ_ITERS` scales the random inputs per campaign
//! (`scripts/fuzz-long.sh --filter fuzz_parquet`).

mod common;

use std::path::Path;

use headroom_fuzzkit::{fuzz_seeds, iterations, Field, Seed};
use headroom_parquet::{ParquetError, ParquetFile};

const CI_ITERATIONS: u64 = 1500;

fn seed(name: &str) -> Seed {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let bytes = std::fs::read(path).unwrap();
    // The footer's length, the one fixed-width header field of the format.
    let footer_len = Field::new("footer length", bytes.len() - 8, 4);
    Seed {
        name: name.into(),
        bytes,
        fields: vec![footer_len],
    }
}

fn read(bytes: &[u8]) -> Result<(), ParquetError> {
    let file = ParquetFile::parse(bytes)?;
    let rows = file.rows(&common::fuzz_options())?;
    assert_eq!(rows.len() as u64, file.num_rows());
    for row in &rows {
        assert!(row.keys().all(|k| file.fields().contains(k)));
        assert_eq!(row.len(), file.fields().len());
    }
    Ok(())
}

fn seeds() -> Vec<Seed> {
    [
        "types_snappy.parquet",
        "types_zstd.parquet",
        "types_gzip.parquet",
        "types_lz4.parquet",
        "pages_v2.parquet",
        "delta.parquet",
        "delta_v2.parquet",
        "format_1_0.parquet",
        "small_pages.parquet",
        "ultrachat_like.parquet",
    ]
    .iter()
    .map(|n| seed(n))
    .collect()
}

fn check(report: headroom_fuzzkit::FuzzReport) {
    println!("{report}");
    report.assert_clean();
    assert!(
        report.ok > 0,
        "no input was accepted: the seeds are broken\n{report}"
    );
    assert!(
        report.errors > 0,
        "no input was refused: the mutator is broken\n{report}"
    );
}

#[test]
fn fuzz_parquet_files() {
    check(fuzz_seeds(
        "parquet",
        &seeds(),
        iterations(CI_ITERATIONS),
        read,
    ));
}

/// The same damage with `PAR1` written back at both ends, so that cut and extended files
/// reach the footer and page parsers instead of stopping at the magic.
#[test]
fn fuzz_parquet_files_resealed() {
    check(fuzz_seeds(
        "parquet resealed",
        &seeds(),
        iterations(CI_ITERATIONS),
        |bytes: &[u8]| {
            let mut bytes = bytes.to_vec();
            if bytes.len() >= 12 {
                let end = bytes.len() - 4;
                bytes[..4].copy_from_slice(b"PAR1");
                bytes[end..].copy_from_slice(b"PAR1");
            }
            read(&bytes)
        },
    ));
}
