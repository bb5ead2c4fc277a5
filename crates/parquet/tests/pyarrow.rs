//! Every fixture pyarrow wrote (`benches/torch/make_parquet_fixture.py`) reads as the rows
//! pyarrow reads from it (`NAME.jsonl`, `to_pylist()` with JSON's conversions), whole and one
//! row group at a time; the files using what this reader refuses are refused with a typed
//! error naming the column, and their other columns still read.

mod common;

use std::path::PathBuf;

use headroom_parquet::{ParquetError, ParquetFile, ReadOptions, Row};
use serde_json::Value;

fn fixtures() -> PathBuf {
    common::fixture_dir("")
}

fn manifest() -> Value {
    common::manifest(&fixtures())
}

fn expected(name: &str) -> Vec<Row> {
    common::expected(&fixtures(), name)
}

#[test]
fn every_fixture_reads_as_pyarrow_reads_it() {
    let manifest = manifest();
    let files = manifest["fixtures"].as_array().unwrap();
    assert!(
        files.len() >= 17,
        "the manifest lists {} fixtures",
        files.len()
    );
    for entry in files {
        let name = entry["file"].as_str().unwrap();
        let bytes = std::fs::read(fixtures().join(name)).unwrap();
        let file = ParquetFile::parse(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = expected(entry["expected"].as_str().unwrap());
        assert_eq!(file.num_rows(), want.len() as u64, "{name}");
        let rows = file
            .rows(&ReadOptions::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(rows.len(), want.len(), "{name}");
        for (i, (got, want)) in rows.iter().zip(&want).enumerate() {
            assert_eq!(got, want, "{name}, row {i}");
        }
        // A group at a time gives the same rows, in order.
        let by_group: Vec<Row> = (0..file.num_row_groups())
            .flat_map(|g| file.row_group(g, &ReadOptions::default()).unwrap())
            .collect();
        assert_eq!(by_group, rows, "{name}");
        // The fields are the schema's, in its order.
        if let Some(first) = want.first() {
            let mut fields = file.fields().to_vec();
            fields.sort();
            let mut keys: Vec<String> = first.keys().cloned().collect();
            keys.sort();
            assert_eq!(fields, keys, "{name}");
        }
    }
}

#[test]
fn fixtures_cover_what_they_say() {
    let manifest = manifest();
    let layouts: Vec<String> = manifest["fixtures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["layout"].to_string())
        .collect();
    for needed in [
        "PLAIN_DICTIONARY",
        "RLE_DICTIONARY",
        "DATA_PAGE_V2",
        "DELTA_BINARY_PACKED",
        "DELTA_LENGTH_BYTE_ARRAY",
        "DELTA_BYTE_ARRAY",
        "BYTE_STREAM_SPLIT",
        "GZIP",
        "ZSTD",
        "LZ4_RAW",
        "SNAPPY",
        "UNCOMPRESSED",
    ] {
        assert!(
            layouts.iter().any(|l| l.contains(needed)),
            "no fixture uses {needed}"
        );
    }
}

#[test]
fn a_projection_reads_only_its_columns() {
    let bytes = std::fs::read(fixtures().join("types_snappy.parquet")).unwrap();
    let file = ParquetFile::parse(&bytes).unwrap();
    let want = expected("types_snappy.jsonl");
    let options = ReadOptions {
        columns: Some(vec!["messages".into(), "int8".into()]),
        ..ReadOptions::default()
    };
    let rows = file.rows(&options).unwrap();
    for (got, want) in rows.iter().zip(&want) {
        assert_eq!(got.len(), 2);
        assert_eq!(got["messages"], want["messages"]);
        assert_eq!(got["int8"], want["int8"]);
    }
    let unknown = ReadOptions {
        columns: Some(vec!["nope".into()]),
        ..ReadOptions::default()
    };
    assert!(matches!(
        file.rows(&unknown),
        Err(ParquetError::UnknownColumn(name, _)) if name == "nope"
    ));
    assert!(matches!(
        file.row_group(9, &ReadOptions::default()),
        Err(ParquetError::NoRowGroup { index: 9, count: 1 })
    ));
}

#[test]
fn unsupported_columns_are_refused_by_name_and_the_rest_reads() {
    let manifest = manifest();
    for entry in manifest["unsupported"].as_array().unwrap() {
        let name = entry["file"].as_str().unwrap();
        let column = entry["column"].as_str().unwrap();
        let bytes = std::fs::read(fixtures().join(name)).unwrap();
        let file = ParquetFile::parse(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        // A codec is known only from the chunks read; a type from the footer.
        let unreadable = file.unreadable_fields();
        if name.contains("brotli") {
            assert!(unreadable.is_empty(), "{name}: {unreadable:?}");
        } else {
            assert_eq!(unreadable.len(), 1, "{name}: {unreadable:?}");
            assert_eq!(unreadable[0].0, column, "{name}");
            assert!(
                unreadable[0].1.starts_with(&format!("{column} (")),
                "{unreadable:?}"
            );
        }
        match file.rows(&ReadOptions::default()) {
            Err(ParquetError::Unsupported(why)) => {
                assert!(
                    why.contains(column),
                    "{name}: {why:?} does not name {column}"
                )
            }
            other => panic!("{name}: {other:?}"),
        }
        let others: Vec<String> = file
            .fields()
            .iter()
            .filter(|f| *f != column)
            .cloned()
            .collect();
        let options = ReadOptions {
            columns: Some(others.clone()),
            ..ReadOptions::default()
        };
        let read = file.rows(&options);
        if name.contains("brotli") {
            assert!(matches!(read, Err(ParquetError::Unsupported(_))), "{name}");
        } else {
            let rows = read.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(rows.len() as u64, file.num_rows(), "{name}");
            assert!(rows.iter().all(|r| r.len() == others.len()), "{name}");
        }
    }
}

#[test]
fn the_bounds_refuse_before_reading() {
    let bytes = std::fs::read(fixtures().join("fineweb_like.parquet")).unwrap();
    let file = ParquetFile::parse(&bytes).unwrap();
    let few = ReadOptions {
        max_values: 20,
        ..ReadOptions::default()
    };
    assert!(matches!(file.rows(&few), Err(ParquetError::OverBudget(_))));
    let small_pages = ReadOptions {
        max_page_bytes: 64,
        ..ReadOptions::default()
    };
    assert!(matches!(
        file.rows(&small_pages),
        Err(ParquetError::OverBudget(_))
    ));
    // Not Parquet at all, and a truncated one.
    assert!(matches!(
        ParquetFile::parse(b"{\"text\": \"hello\"}\n"),
        Err(ParquetError::NotParquet(_))
    ));
    assert!(ParquetFile::parse(&bytes[..bytes.len() - 1]).is_err());
}

#[test]
fn a_dictionary_value_copied_into_every_row_counts_its_text_each_time() {
    // 40 rows of one 1 025-byte string, stored once in the dictionary page: the file is small,
    // the rows are 41 KB of text. Counting one value per row (about 80 in all) would let a
    // hostile file expand by its dictionary's size times its row count under any bound.
    let bytes = std::fs::read(fixtures().join("dict_repeated.parquet")).unwrap();
    let file = ParquetFile::parse(&bytes).unwrap();
    let rows = file.rows(&ReadOptions::default()).unwrap();
    assert_eq!(rows, expected("dict_repeated.jsonl"));
    let text: usize = rows.iter().map(|r| r["s"].as_str().unwrap().len()).sum();
    assert_eq!(text, 40 * 1025);
    let tight = ReadOptions {
        max_values: 500,
        ..ReadOptions::default()
    };
    assert!(matches!(
        file.rows(&tight),
        Err(ParquetError::OverBudget(_))
    ));
    // 40 rows, 40 values, and 40 copies of 1 025 bytes at 32 bytes a value fit in 1 500.
    let enough = ReadOptions {
        max_values: 1_500,
        ..ReadOptions::default()
    };
    assert_eq!(file.rows(&enough).unwrap().len(), 40);
}
