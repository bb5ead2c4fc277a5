//! Arrow IPC files pyarrow and Hugging Face `datasets` wrote (`benches/torch/make_arrow_fixture.py`)
//! read as the rows pyarrow reads from them (`NAME.jsonl`, the Parquet fixtures' conversions):
//! both layouts, both metadata versions, the pre-0.15 stream, compressed buffers, dictionaries
//! extended and replaced, `save_to_disk` shards and a `Dataset.map` cache file. The columns this
//! reader refuses are refused by name and the others still read; damaged files are typed
//! errors, never panics.

mod common;

use std::path::{Path, PathBuf};

use headroom_fuzzkit::{fuzz_seeds, iterations, Field, Seed};
use headroom_parquet::{
    is_arrow, ArrowError, ArrowFile, ArrowFormat, ParquetFile, ReadOptions, Row,
};
use serde_json::Value;

fn fixtures() -> PathBuf {
    common::fixture_dir("arrow")
}

fn manifest() -> Value {
    common::manifest(&fixtures())
}

fn expected(name: &str) -> Vec<Row> {
    common::expected(&fixtures(), name)
}

fn unsupported_of(entry: &Value) -> Vec<(String, String)> {
    entry["unsupported"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn every_fixture_reads_as_pyarrow_reads_it() {
    let manifest = manifest();
    let files = manifest["fixtures"].as_array().unwrap();
    assert!(files.len() >= 13, "the manifest lists {}", files.len());
    for entry in files {
        let name = entry["file"].as_str().unwrap();
        let bytes = std::fs::read(fixtures().join(name)).unwrap();
        // A stream from before Arrow 0.15 has no marker to know it by; it still parses.
        let legacy = name == "types_legacy.arrow";
        assert_eq!(is_arrow(&bytes[..8]), !legacy, "{name}: by its head");
        let file = ArrowFile::parse(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = expected(entry["expected"].as_str().unwrap());
        assert_eq!(file.num_rows(), want.len() as u64, "{name}");
        assert_eq!(
            file.num_batches() as u64,
            entry["batches"].as_u64().unwrap(),
            "{name}"
        );
        let refused = unsupported_of(entry);
        let readable: Vec<String> = file
            .fields()
            .iter()
            .filter(|f| !refused.iter().any(|(r, _)| r == *f))
            .cloned()
            .collect();
        let options = ReadOptions {
            columns: Some(readable.clone()),
            ..ReadOptions::default()
        };
        let rows = file
            .rows(&options)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(rows.len(), want.len(), "{name}");
        for (i, (got, want)) in rows.iter().zip(&want).enumerate() {
            assert_eq!(got, want, "{name}, row {i}");
        }
        // A batch at a time gives the same rows, in order, each batch its announced size.
        let mut by_batch: Vec<Row> = Vec::new();
        for b in 0..file.num_batches() {
            let batch = file.batch(b, &options).unwrap();
            assert_eq!(Some(batch.len() as u64), file.batch_rows(b), "{name}");
            by_batch.extend(batch);
        }
        assert_eq!(by_batch, rows, "{name}");
        if let Some(first) = want.first() {
            let keys: Vec<&String> = first.keys().collect();
            let mut fields: Vec<&String> = readable.iter().collect();
            fields.sort();
            let mut keys = keys;
            keys.sort();
            assert_eq!(fields, keys, "{name}");
        }
        // Fewer columns read only those, with the same values.
        let one = ReadOptions {
            columns: Some(vec![readable.last().unwrap().clone()]),
            ..ReadOptions::default()
        };
        for (got, full) in file.rows(&one).unwrap().iter().zip(&rows) {
            assert_eq!(got.len(), 1, "{name}");
            let (k, v) = got.iter().next().unwrap();
            assert_eq!(Some(v), full.get(k), "{name}");
        }
    }
}

#[test]
fn the_types_table_reads_alike_from_arrow_and_parquet() {
    let parquet = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/types_none.parquet"),
    )
    .unwrap();
    let from_parquet = ParquetFile::parse(&parquet)
        .unwrap()
        .rows(&ReadOptions::default())
        .unwrap();
    for name in [
        "types_stream.arrow",
        "types_file.arrow",
        "types_zstd.arrow",
        "types_lz4.arrow",
        "types_v4.arrow",
        "types_legacy.arrow",
    ] {
        let bytes = std::fs::read(fixtures().join(name)).unwrap();
        let file = ArrowFile::parse(&bytes).unwrap();
        let format = if name == "types_file.arrow" {
            ArrowFormat::File
        } else {
            ArrowFormat::Stream
        };
        assert_eq!(file.format(), format, "{name}");
        assert_eq!(
            file.rows(&ReadOptions::default()).unwrap(),
            from_parquet,
            "{name}"
        );
        assert!(file.unreadable_fields().is_empty(), "{name}");
    }
}

#[test]
fn unsupported_columns_are_refused_by_name_and_the_rest_read() {
    let manifest = manifest();
    let entry = manifest["fixtures"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["file"] == "unsupported.arrow")
        .unwrap();
    let refused = unsupported_of(entry);
    assert_eq!(refused.len(), 5);
    let bytes = std::fs::read(fixtures().join("unsupported.arrow")).unwrap();
    let file = ArrowFile::parse(&bytes).unwrap();
    let unreadable = file.unreadable_fields();
    for (column, why) in &refused {
        let listed = unreadable
            .iter()
            .find(|(c, _)| c == column)
            .unwrap_or_else(|| panic!("{column} not listed as unreadable: {unreadable:?}"));
        assert!(listed.1.contains(why.as_str()), "{column}: {}", listed.1);
        let only = ReadOptions {
            columns: Some(vec![column.clone()]),
            ..ReadOptions::default()
        };
        match file.rows(&only) {
            Err(ArrowError::Unsupported(msg)) => {
                assert!(
                    msg.contains(column.as_str()) && msg.contains(why.as_str()),
                    "{msg}"
                )
            }
            other => panic!("{column}: {other:?}"),
        }
    }
    assert!(matches!(
        file.rows(&ReadOptions::default()),
        Err(ArrowError::Unsupported(_))
    ));
    // The column after all of them: every unsupported layout was stepped over.
    let after = ReadOptions {
        columns: Some(vec!["after".into()]),
        ..ReadOptions::default()
    };
    let rows = file.rows(&after).unwrap();
    assert_eq!(rows[5]["after"], "🦀");
    assert!(matches!(
        file.rows(&ReadOptions {
            columns: Some(vec!["nope".into()]),
            ..ReadOptions::default()
        }),
        Err(ArrowError::UnknownColumn(c, _)) if c == "nope"
    ));
    assert!(matches!(
        file.batch(99, &after),
        Err(ArrowError::NoBatch { index: 99, .. })
    ));
}

#[test]
fn datasets_metadata_and_tokenized_columns() {
    let bytes = std::fs::read(fixtures().join("hf_cache_map.arrow")).unwrap();
    let file = ArrowFile::parse(&bytes).unwrap();
    let features = file
        .metadata()
        .iter()
        .find(|(k, _)| k == "huggingface")
        .map(|(_, v)| v.clone())
        .expect("datasets keeps its features in the schema metadata");
    assert!(features.contains("input_ids"), "{features}");
    let rows = file.rows(&ReadOptions::default()).unwrap();
    let ids = rows
        .iter()
        .find(|r| r["text"].as_str().is_some_and(|t| !t.is_empty()))
        .unwrap()["input_ids"]
        .as_array()
        .unwrap()
        .clone();
    assert!(!ids.is_empty() && ids.iter().all(|v| v.is_u64()));
    // Both save_to_disk shards together are the table, in order.
    let mut saved = Vec::new();
    for shard in ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"] {
        let bytes = std::fs::read(fixtures().join("hf_save_to_disk").join(shard)).unwrap();
        saved.extend(
            ArrowFile::parse(&bytes)
                .unwrap()
                .rows(&ReadOptions::default())
                .unwrap(),
        );
    }
    let texts = |rows: &[Row]| -> Vec<Value> { rows.iter().map(|r| r["text"].clone()).collect() };
    assert_eq!(texts(&saved), texts(&rows));
    assert_eq!(saved.len(), 30);
}

#[test]
fn bounds_are_typed_errors() {
    let bytes = std::fs::read(fixtures().join("types_zstd.arrow")).unwrap();
    let file = ArrowFile::parse(&bytes).unwrap();
    let few_values = ReadOptions {
        max_values: 100,
        ..ReadOptions::default()
    };
    assert!(matches!(
        file.rows(&few_values),
        Err(ArrowError::OverBudget(_))
    ));
    let small_buffers = ReadOptions {
        max_page_bytes: 16,
        ..ReadOptions::default()
    };
    assert!(matches!(
        file.rows(&small_buffers),
        Err(ArrowError::OverBudget(_))
    ));
    // A dictionary-encoded column within its bounds, and over them.
    let bytes = std::fs::read(fixtures().join("dict_delta.arrow")).unwrap();
    let file = ArrowFile::parse(&bytes).unwrap();
    let rows = file.rows(&ReadOptions::default()).unwrap();
    assert_eq!(rows.len(), 9);
    let tight = ReadOptions {
        max_values: 20,
        ..ReadOptions::default()
    };
    assert!(matches!(file.rows(&tight), Err(ArrowError::OverBudget(_))));
}

#[test]
fn what_is_not_arrow_is_refused() {
    let parquet =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/plain.parquet"))
            .unwrap();
    assert!(!is_arrow(&parquet[..4]));
    assert!(matches!(
        ArrowFile::parse(&parquet),
        Err(ArrowError::NotArrow(_))
    ));
    assert!(matches!(
        ArrowFile::parse(b"{\"text\": \"a json line\"}\n"),
        Err(ArrowError::NotArrow(_))
    ));
    assert!(ArrowFile::parse(&[]).is_err());
}

fn seed(name: &str) -> Seed {
    let bytes = std::fs::read(fixtures().join(name)).unwrap();
    let fields = if bytes.starts_with(b"ARROW1") {
        vec![Field::new("footer length", bytes.len() - 10, 4)]
    } else {
        vec![Field::new("schema message length", 4, 4)]
    };
    Seed {
        name: name.into(),
        bytes,
        fields,
    }
}

fn read(bytes: &[u8]) -> Result<(), ArrowError> {
    let file = ArrowFile::parse(bytes)?;
    let rows = file.rows(&common::fuzz_options())?;
    assert_eq!(rows.len() as u64, file.num_rows());
    for row in &rows {
        assert_eq!(row.len(), file.fields().len());
        assert!(row.keys().all(|k| file.fields().contains(k)));
    }
    Ok(())
}

#[test]
fn fuzz_arrow_files() {
    let seeds: Vec<Seed> = [
        "types_stream.arrow",
        "types_file.arrow",
        "types_zstd.arrow",
        "types_lz4.arrow",
        "types_legacy.arrow",
        "dict_delta.arrow",
        "dict_file.arrow",
        "hf_cache_map.arrow",
    ]
    .iter()
    .map(|n| seed(n))
    .collect();
    let report = fuzz_seeds("arrow", &seeds, iterations(1500), read);
    println!("{report}");
    report.assert_clean();
    assert!(report.ok > 0, "no input was accepted\n{report}");
    assert!(report.errors > 0, "no input was refused\n{report}");
}

/// The same damage with the markers written back (a stream's continuation word, the file
/// format's `ARROW1` at both ends), so that cut and flipped files reach the message, schema
/// and batch parsers instead of stopping at the first bytes.
#[test]
fn fuzz_arrow_files_resealed() {
    let streams: Vec<Seed> = ["types_stream.arrow", "types_zstd.arrow", "dict_delta.arrow"]
        .iter()
        .map(|n| seed(n))
        .collect();
    let files: Vec<Seed> = ["types_file.arrow", "dict_file.arrow"]
        .iter()
        .map(|n| seed(n))
        .collect();
    for report in [
        fuzz_seeds(
            "arrow stream resealed",
            &streams,
            iterations(1000),
            |b: &[u8]| {
                let mut b = b.to_vec();
                if b.len() >= 8 {
                    b[..4].copy_from_slice(&[0xff; 4]);
                }
                read(&b)
            },
        ),
        fuzz_seeds(
            "arrow file resealed",
            &files,
            iterations(1000),
            |b: &[u8]| {
                let mut b = b.to_vec();
                if b.len() >= 18 {
                    let n = b.len();
                    b[..6].copy_from_slice(b"ARROW1");
                    b[n - 6..].copy_from_slice(b"ARROW1");
                }
                read(&b)
            },
        ),
    ] {
        println!("{report}");
        report.assert_clean();
        assert!(report.ok > 0, "no input was accepted\n{report}");
        assert!(report.errors > 0, "no input was refused\n{report}");
    }
}
