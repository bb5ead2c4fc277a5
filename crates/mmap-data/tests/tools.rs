//! The dataset tools: `synthesize`, `build_from_text` and `inspect` — determinism, round trips
//! through every format, document separation, format detection, and a typed error for every
//! bad input.

use std::path::{Path, PathBuf};

use headroom_mmap_data::formats::writer::TokenWriter;
use headroom_mmap_data::formats::{self, OpenOptions};
use headroom_mmap_data::text::{decode_bytes, BYTE_EOT};
use headroom_mmap_data::tools::{
    build_from_text, check_vocab_fits, inspect, synthesize, BuildSpec, DetectedFormat, DtypeSource,
    InspectOptions, SynthSpec,
};
use headroom_mmap_data::{DataError, LlmcFlavor, MarkovChain, TokenFileFormat, TokenType};
use proptest::prelude::*;

/// Every format the crate writes (Megatron with `document_len`), for a vocabulary of `vocab`.
fn formats_for(vocab: u32, document_len: usize) -> Vec<TokenFileFormat> {
    let mut all = vec![
        TokenFileFormat::Raw(TokenType::U16),
        TokenFileFormat::Raw(TokenType::U32),
        TokenFileFormat::Raw(TokenType::I32),
        TokenFileFormat::Raw(TokenType::I64),
        TokenFileFormat::Llmc(LlmcFlavor::Gpt2),
        TokenFileFormat::Llmc(LlmcFlavor::Llama3),
    ];
    for token_type in [TokenType::U16, TokenType::I32, TokenType::I64] {
        all.push(TokenFileFormat::Megatron {
            token_type,
            document_len,
        });
    }
    if vocab <= 256 {
        all.push(TokenFileFormat::Raw(TokenType::U8));
        all.push(TokenFileFormat::Megatron {
            token_type: TokenType::U8,
            document_len,
        });
    }
    all
}

/// Every token of the dataset at `path`, read back through the crate's readers.
fn read_back(path: &Path, raw_token_type: TokenType) -> Vec<u32> {
    let ds = formats::open(path, &OpenOptions { raw_token_type }).unwrap();
    let mut out = Vec::new();
    for (s, seg) in ds.segments().iter().enumerate() {
        for i in 0..seg.len() as u64 {
            out.push(u32::try_from(ds.token(s, i).unwrap()).unwrap());
        }
    }
    out
}

/// The bytes of every file a format writes at `path`.
fn file_bytes(path: &Path, format: TokenFileFormat) -> Vec<Vec<u8>> {
    match format {
        TokenFileFormat::Megatron { .. } => {
            let (idx, bin) = formats::megatron::megatron_paths(path);
            vec![std::fs::read(idx).unwrap(), std::fs::read(bin).unwrap()]
        }
        _ => vec![std::fs::read(path).unwrap()],
    }
}

/// Names in `dir` (to check that no temporary file is left behind).
fn dir_entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn spec(vocab: u32, tokens: u64, format: TokenFileFormat) -> SynthSpec {
    SynthSpec {
        vocab,
        branching: 4,
        tokens,
        chain_seed: 3,
        stream_seed: 4,
        format,
    }
}

#[test]
fn synthesize_is_deterministic_and_writes_the_chains_tokens_in_every_format() {
    let dir = tempfile::tempdir().unwrap();
    let chain = MarkovChain::random(200, 4, 3).unwrap();
    let want = chain.generate(3000, 4);
    for (i, format) in formats_for(200, 700).into_iter().enumerate() {
        let a = dir.path().join(format!("a{i}.bin"));
        let b = dir.path().join(format!("b{i}.bin"));
        let summary = synthesize(&spec(200, 3000, format), &a).unwrap();
        synthesize(&spec(200, 3000, format), &b).unwrap();
        assert_eq!(file_bytes(&a, format), file_bytes(&b, format), "{format}");

        assert_eq!(read_back(&a, format.token_type()), want, "{format}");
        assert_eq!(summary.tokens, 3000);
        assert_eq!(summary.format, format);
        assert_eq!(summary.token_type, format.token_type());
        assert_eq!(summary.vocab_size, 200);
        assert_eq!(summary.entropy_rate, Some(chain.entropy_rate()));
        let on_disk: u64 = file_bytes(&a, format).iter().map(|f| f.len() as u64).sum();
        assert_eq!(summary.file_bytes, on_disk, "{format}");
        let expected_docs = matches!(format, TokenFileFormat::Megatron { .. }).then_some(5);
        assert_eq!(
            summary.documents, expected_docs,
            "3000 tokens in documents of 700"
        );

        let other = SynthSpec {
            stream_seed: 5,
            ..spec(200, 3000, format)
        };
        synthesize(&other, &b).unwrap();
        assert_ne!(file_bytes(&a, format), file_bytes(&b, format), "{format}");
    }
    // Only the files asked for: no temporary file survives.
    assert!(dir_entries(dir.path()).iter().all(|n| !n.contains(".tmp")));
}

#[test]
fn synthesize_streams_across_chunks_and_reports_the_loss_floor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.bin");
    // More than two 65 536-token chunks, ending mid-chunk.
    let tokens = 150_001;
    let s = SynthSpec {
        branching: 3,
        ..spec(1000, tokens, TokenFileFormat::Raw(TokenType::U16))
    };
    let summary = synthesize(&s, &path).unwrap();
    let chain = MarkovChain::random(1000, 3, 3).unwrap();
    assert_eq!(
        read_back(&path, TokenType::U16),
        chain.generate(tokens as usize, 4)
    );
    assert_eq!(summary.file_bytes, 2 * tokens);
    let bits = summary.entropy_rate_bits().unwrap();
    assert!((bits - chain.entropy_rate_bits()).abs() < 1e-12);
    let shown = summary.to_string();
    assert!(shown.contains("150001"), "{shown}");
    assert!(shown.contains("loss floor"), "{shown}");
    assert!(
        shown.contains(&format!("{:.6}", chain.entropy_rate())),
        "{shown}"
    );
}

const TEXT: &str = "Once upon a time, a café served crème brûlée.\n日本語も。\n\nThe end.\n";

#[test]
fn text_round_trips_through_every_format() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.txt");
    std::fs::write(&input, TEXT).unwrap();
    for (i, format) in formats_for(256, 10).into_iter().enumerate() {
        let out = dir.path().join(format!("out{i}.bin"));
        let summary = build_from_text(&input, &BuildSpec::new(format), &out).unwrap();
        assert_eq!(summary.tokens, TEXT.len() as u64, "{format}");
        assert_eq!(summary.vocab_size, 256);
        assert_eq!(summary.entropy_rate, None);
        let tokens = read_back(&out, format.token_type());
        assert_eq!(
            decode_bytes(&tokens, None).unwrap(),
            TEXT.as_bytes(),
            "{format}"
        );
    }
}

#[test]
fn separators_become_end_of_text_tokens_and_megatron_documents() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("stories.txt");
    let sep = b"<|endoftext|>".to_vec();
    // A leading separator (empty first document) and a trailing one (empty last document).
    let text = "<|endoftext|>ab<|endoftext|>c<|endoftext|><|endoftext|>dé<|endoftext|>";
    std::fs::write(&input, text).unwrap();
    let e = BYTE_EOT;
    let want: Vec<u32> = vec![e, 97, 98, e, 99, e, e, 100, 0xC3, 0xA9, e];

    let mut raw = BuildSpec::new(TokenFileFormat::Raw(TokenType::U16));
    raw.document_separator = Some(sep.clone());
    let out = dir.path().join("raw.bin");
    let summary = build_from_text(&input, &raw, &out).unwrap();
    assert_eq!(summary.vocab_size, 257);
    let tokens = read_back(&out, TokenType::U16);
    assert_eq!(tokens, want);
    assert_eq!(decode_bytes(&tokens, Some(&sep)).unwrap(), text.as_bytes());
    // Without the separator the end-of-text id is not a byte.
    assert!(matches!(
        decode_bytes(&tokens, None),
        Err(DataError::TokenOutOfRange {
            position: 0,
            value: 256,
            ..
        })
    ));

    // Megatron: each document ends after its separator token; the empty last one is dropped.
    let mut mega = raw.clone();
    mega.format = TokenFileFormat::Megatron {
        token_type: TokenType::U16,
        document_len: 1000,
    };
    let prefix = dir.path().join("mega");
    let summary = build_from_text(&input, &mega, &prefix).unwrap();
    assert_eq!(summary.documents, Some(5));
    let ds = formats::open(&prefix, &OpenOptions::default()).unwrap();
    let lens: Vec<u64> = ds.documents().unwrap().iter().map(|d| d.len).collect();
    assert_eq!(lens, [1, 3, 2, 1, 4]);
    assert_eq!(read_back(&prefix, TokenType::U16), want);

    // document_len also cuts: documents of at most 2 tokens.
    mega.format = TokenFileFormat::Megatron {
        token_type: TokenType::U16,
        document_len: 2,
    };
    build_from_text(&input, &mega, &prefix).unwrap();
    let ds = formats::open(&prefix, &OpenOptions::default()).unwrap();
    let lens: Vec<u64> = ds.documents().unwrap().iter().map(|d| d.len).collect();
    assert_eq!(lens, [1, 2, 1, 2, 1, 2, 2]);
    assert_eq!(read_back(&prefix, TokenType::U16), want);
}

#[test]
fn long_inputs_stream_in_chunks_and_still_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("long.txt");
    // ~200 KB: several conversion chunks, separators straddling chunk boundaries.
    let text: String = (0..20_000)
        .map(|i| format!("line {i}\n{}", if i % 7 == 0 { "\n\n" } else { "" }))
        .collect();
    std::fs::write(&input, &text).unwrap();
    let mut spec = BuildSpec::new(TokenFileFormat::Llmc(LlmcFlavor::Gpt2));
    spec.document_separator = Some(b"\n\n".to_vec());
    let out = dir.path().join("long.bin");
    let summary = build_from_text(&input, &spec, &out).unwrap();
    let tokens = read_back(&out, TokenType::U16);
    assert_eq!(summary.tokens, tokens.len() as u64);
    let separators = text.matches("\n\n").count();
    assert_eq!(
        tokens.iter().filter(|&&t| t == BYTE_EOT).count(),
        separators
    );
    assert_eq!(tokens.len(), text.len() - separators);
    assert_eq!(
        decode_bytes(&tokens, Some(b"\n\n")).unwrap(),
        text.as_bytes()
    );
}

#[test]
fn arbitrary_bytes_are_tokenised_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("bytes.dat");
    let data: Vec<u8> = (0..=255u8).chain([0xFF, 0xFE, 0x80]).collect();
    std::fs::write(&input, &data).unwrap();
    let out = dir.path().join("bytes.bin");
    let mut spec = BuildSpec::new(TokenFileFormat::Raw(TokenType::U8));
    assert!(matches!(
        build_from_text(&input, &spec, &out),
        Err(DataError::InvalidUtf8 { offset: 128, .. })
    ));
    assert!(!out.exists());
    spec.require_utf8 = false;
    build_from_text(&input, &spec, &out).unwrap();
    assert_eq!(
        std::fs::read(&out).unwrap(),
        data,
        "u8 tokens are the bytes"
    );
}

#[test]
fn inspect_describes_what_synthesize_wrote_in_every_format() {
    let dir = tempfile::tempdir().unwrap();
    for (i, format) in formats_for(150, 400).into_iter().enumerate() {
        let path = dir.path().join(format!("d{i}.bin"));
        let written = synthesize(&spec(150, 1000, format), &path).unwrap();
        let options = InspectOptions {
            raw_token_type: Some(format.token_type()),
            ..InspectOptions::default()
        };
        let d = inspect(&path, &options).unwrap();
        let (want_format, want_source) = match format {
            TokenFileFormat::Raw(_) => (DetectedFormat::Raw, DtypeSource::Given),
            TokenFileFormat::Llmc(f) => (DetectedFormat::Llmc(f), DtypeSource::Header),
            TokenFileFormat::Megatron { .. } => (DetectedFormat::Megatron, DtypeSource::Header),
        };
        assert_eq!(
            (d.format, d.dtype_source),
            (want_format, want_source),
            "{format}"
        );
        assert_eq!(d.token_type, format.token_type());
        assert_eq!(d.tokens, 1000);
        assert_eq!(d.file_bytes, written.file_bytes, "{format}");
        assert_eq!(d.documents, written.documents, "{format}");
        assert_eq!(d.first_tokens.len(), 16);
    }
}

#[test]
fn inspect_finds_megatron_from_any_of_its_paths() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("corpus_text_document");
    let format = TokenFileFormat::Megatron {
        token_type: TokenType::U16,
        document_len: 64,
    };
    synthesize(&spec(300, 1000, format), &prefix).unwrap();
    for p in [
        prefix.clone(),
        prefix.with_extension("idx"),
        prefix.with_extension("bin"),
    ] {
        let d = inspect(&p, &InspectOptions::default()).unwrap();
        assert_eq!(d.format, DetectedFormat::Megatron, "{}", p.display());
        assert_eq!(d.documents, Some(16));
        assert_eq!(d.files.len(), 2);
        assert_eq!(d.files[0].0, prefix.with_extension("idx"));
    }
}

#[test]
fn raw_dtype_is_guessed_and_labelled() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = MarkovChain::random(5000, 4, 1).unwrap().generate(500, 2);
    let guess = |t: TokenType| {
        let p = dir.path().join(format!("g_{}.bin", t.name()));
        formats::raw::write_raw(&p, &tokens, t).unwrap();
        inspect(&p, &InspectOptions::default()).unwrap()
    };
    for t in [TokenType::U16, TokenType::U32] {
        let d = guess(t);
        assert_eq!((d.token_type, d.dtype_source), (t, DtypeSource::Guessed));
        assert_eq!(d.tokens, 500);
        assert_eq!(d.first_tokens, tokens[..16]);
    }
    // An odd byte length can only be bytes.
    let p = dir.path().join("odd.bin");
    std::fs::write(&p, b"abc").unwrap();
    let d = inspect(&p, &InspectOptions::default()).unwrap();
    assert_eq!((d.token_type, d.tokens), (TokenType::U8, 3));
    assert_eq!(d.first_tokens, [97, 98, 99]);
    assert!(d.to_string().contains("guessed"));
}

#[test]
fn distinct_ids_are_exact_below_the_limit_and_a_lower_bound_above() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("ids.bin");
    let tokens = [7u32, 3, 7, 1_000_000, 3, 64, 63, 999_999, 7];
    formats::raw::write_raw(&p, &tokens, TokenType::U32).unwrap();
    let exact = InspectOptions {
        raw_token_type: Some(TokenType::U32),
        ..InspectOptions::default()
    };
    let d = inspect(&p, &exact).unwrap();
    assert_eq!((d.min_id, d.max_id), (3, 1_000_000));
    assert_eq!((d.distinct_ids, d.distinct_ids_exact), (6, true));
    let capped = InspectOptions {
        distinct_id_limit: 64,
        preview_tokens: 4,
        ..exact
    };
    let d = inspect(&p, &capped).unwrap();
    // 3, 7, 63 below the limit, plus at least one above it.
    assert_eq!((d.distinct_ids, d.distinct_ids_exact), (4, false));
    assert_eq!(d.first_tokens, [7, 3, 7, 1_000_000]);
    let shown = d.to_string();
    assert!(shown.contains("at least 4"), "{shown}");
    assert!(shown.contains("[7, 3, 7, 1000000, …]"), "{shown}");
}

#[test]
fn inspect_prints_a_short_table() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.bin");
    formats::llmc::write_llmc(&p, &[5, 1, 5, 2], LlmcFlavor::Gpt2).unwrap();
    let shown = inspect(&p, &InspectOptions::default()).unwrap().to_string();
    let lines: Vec<&str> = shown.lines().collect();
    assert_eq!(lines.len(), 6, "{shown}");
    assert!(lines[0].starts_with("file") && lines[0].ends_with("(1032 bytes)"));
    assert!(lines[1].contains("llm.c") && lines[1].contains("20240520"));
    assert!(lines[2].contains("u16 (from the header)"));
    assert!(lines[3].ends_with(" 4"));
    assert!(lines[4].contains("min 1, max 5, 3 distinct"));
    assert!(lines[5].ends_with("[5, 1, 5, 2]"));
}

// ---- errors: typed, never a panic, and nothing half-written -------------------------------

#[test]
fn missing_files_are_io_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.bin");
    assert!(matches!(
        inspect(&missing, &InspectOptions::default()),
        Err(DataError::Io { .. })
    ));
    let out = dir.path().join("out.bin");
    let spec = BuildSpec::new(TokenFileFormat::Raw(TokenType::U16));
    assert!(matches!(
        build_from_text(&missing, &spec, &out),
        Err(DataError::Io { .. })
    ));
    assert!(!out.exists());
    // Writing into a directory that does not exist: the error names the file asked for, not
    // the temporary file it is written through.
    let s = spec_u16(10);
    let target = dir.path().join("no/such/dir.bin");
    match synthesize(&s, &target) {
        Err(DataError::Io { path, .. }) => assert_eq!(path, target),
        other => panic!("{other:?}"),
    }
}

/// A file that cannot fit its file system's free space is refused before a byte is written
/// (no file and no temporary left), by name and with both sizes; one that fits is written.
#[cfg(unix)]
#[test]
fn a_file_larger_than_the_free_space_is_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("huge.bin");
    // 2^62 u32 tokens are 16 EiB: no file system has that free.
    let huge = spec(100, 1 << 62, TokenFileFormat::Raw(TokenType::U32));
    let e = synthesize(&huge, &out).unwrap_err();
    match &e {
        DataError::NoSpace {
            path,
            needed,
            available,
        } => {
            assert_eq!(path, &out);
            // 2^64 bytes, saturated.
            assert_eq!(*needed, u64::MAX);
            assert!(available < needed);
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("16.0 EiB"), "{e}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    // A text with separators (its lower bound divides by their length) that fits.
    let text = dir.path().join("t.txt");
    std::fs::write(&text, b"a<s>b").unwrap();
    let mut b = BuildSpec::new(TokenFileFormat::Raw(TokenType::U16));
    b.document_separator = Some(b"<s>".to_vec());
    build_from_text(&text, &b, &out).unwrap();
    assert!(out.exists());
}

fn spec_u16(tokens: u64) -> SynthSpec {
    spec(100, tokens, TokenFileFormat::Raw(TokenType::U16))
}

#[test]
fn truncated_and_corrupt_headers_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let o = InspectOptions::default();
    // llm.c: magic then a header cut short.
    let p = dir.path().join("short.bin");
    std::fs::write(&p, &20240520i32.to_le_bytes()[..]).unwrap();
    assert!(matches!(inspect(&p, &o), Err(DataError::Truncated { .. })));
    // llm.c: a whole header announcing more tokens than are there.
    let good = dir.path().join("good.bin");
    formats::llmc::write_llmc(&good, &[1, 2, 3], LlmcFlavor::Gpt2).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 2]).unwrap();
    assert!(matches!(inspect(&p, &o), Err(DataError::Truncated { .. })));
    // llm.c: unknown version.
    let mut v = bytes.clone();
    v[4] = 9;
    std::fs::write(&p, &v).unwrap();
    assert!(matches!(
        inspect(&p, &o),
        Err(DataError::UnsupportedVersion { found: 9, .. })
    ));
    // Megatron: bad magic, unknown dtype code, a size that breaks the pointers.
    let prefix = dir.path().join("m");
    formats::megatron::write_megatron(&prefix, &[vec![1, 2], vec![3]], TokenType::U16).unwrap();
    let idx_path = prefix.with_extension("idx");
    let idx = std::fs::read(&idx_path).unwrap();
    let mut bad = idx.clone();
    bad[0] = b'X';
    std::fs::write(&idx_path, &bad).unwrap();
    assert!(matches!(
        inspect(&prefix, &o),
        Err(DataError::BadMagic { .. })
    ));
    let mut bad = idx.clone();
    bad[17] = 6; // float64
    std::fs::write(&idx_path, &bad).unwrap();
    assert!(matches!(
        inspect(&prefix, &o),
        Err(DataError::UnsupportedDtype { code: 6, .. })
    ));
    let mut bad = idx.clone();
    bad[34] = 9; // first sequence claims 9 tokens
    std::fs::write(&idx_path, &bad).unwrap();
    assert!(matches!(
        inspect(&prefix, &o),
        Err(DataError::PointerOutOfBounds { .. } | DataError::Corrupt { .. })
    ));
    std::fs::write(&idx_path, &idx[..idx.len() - 3]).unwrap();
    assert!(matches!(
        inspect(&prefix, &o),
        Err(DataError::Truncated { .. })
    ));
}

#[test]
fn unreadable_formats_and_conflicting_types_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    // A raw file that is not whole tokens of the type given.
    let p = dir.path().join("odd.bin");
    std::fs::write(&p, [1u8, 2, 3]).unwrap();
    let u16s = InspectOptions {
        raw_token_type: Some(TokenType::U16),
        ..InspectOptions::default()
    };
    assert!(matches!(
        inspect(&p, &u16s),
        Err(DataError::OddLength {
            bytes: 3,
            width: 2,
            ..
        })
    ));
    // A type that contradicts the header.
    let l = dir.path().join("l.bin");
    formats::llmc::write_llmc(&l, &[1, 2], LlmcFlavor::Gpt2).unwrap();
    let u32s = InspectOptions {
        raw_token_type: Some(TokenType::U32),
        ..InspectOptions::default()
    };
    assert!(matches!(
        inspect(&l, &u32s),
        Err(DataError::InvalidConfig(_))
    ));
    // A directory is read as a set of shards: these files are not one (their first, `l.bin`,
    // is an llm.c shard of u16 tokens; `odd.bin` is read as raw u16 and is not whole tokens).
    let e = inspect(dir.path(), &InspectOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::OddLength {
                bytes: 3,
                width: 2,
                ..
            }
        ),
        "{e:?}"
    );
    // Stored ids a token cannot be: negative.
    let n = dir.path().join("neg.bin");
    std::fs::write(&n, [1i32, -4].map(i32::to_le_bytes).concat()).unwrap();
    let i32s = InspectOptions {
        raw_token_type: Some(TokenType::I32),
        ..InspectOptions::default()
    };
    assert!(matches!(
        inspect(&n, &i32s),
        Err(DataError::TokenOutOfRange {
            position: 1,
            value: -4,
            ..
        })
    ));
    // Writing a format that has no encoding for the type.
    let m = TokenFileFormat::Megatron {
        token_type: TokenType::U32,
        document_len: 8,
    };
    assert!(matches!(
        synthesize(&spec(100, 10, m), &dir.path().join("m")),
        Err(DataError::InvalidConfig(_))
    ));
    let zero_docs = TokenFileFormat::Megatron {
        token_type: TokenType::U16,
        document_len: 0,
    };
    assert!(matches!(
        synthesize(&spec(100, 10, zero_docs), &dir.path().join("m")),
        Err(DataError::InvalidConfig(_))
    ));
    // An impossible chain.
    let bad_chain = SynthSpec {
        branching: 1,
        ..spec_u16(10)
    };
    assert!(matches!(
        synthesize(&bad_chain, &dir.path().join("c.bin")),
        Err(DataError::InvalidConfig(_))
    ));
    assert_eq!(dir_entries(dir.path()), ["l.bin", "neg.bin", "odd.bin"]);
}

#[test]
fn vocabularies_too_large_for_the_token_type_are_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("v.bin");
    for format in [
        TokenFileFormat::Raw(TokenType::U16),
        TokenFileFormat::Llmc(LlmcFlavor::Gpt2),
        TokenFileFormat::Megatron {
            token_type: TokenType::U16,
            document_len: 8,
        },
    ] {
        let s = spec(70_000, 10, format);
        assert!(
            matches!(
                synthesize(&s, &out),
                Err(DataError::VocabTooLarge {
                    vocab: 70_000,
                    width: "u16",
                    max_id: 65_535
                })
            ),
            "{format}"
        );
    }
    // 65 536 ids is exactly u16's range.
    check_vocab_fits(65_536, TokenType::U16).unwrap();
    assert!(check_vocab_fits(65_537, TokenType::U16).is_err());
    check_vocab_fits(1 << 32, TokenType::U32).unwrap();
    assert!(check_vocab_fits(1 << 31, TokenType::I32).is_ok());
    assert!(check_vocab_fits((1 << 31) + 1, TokenType::I32).is_err());
    // Bytes plus an end-of-text token do not fit u8.
    let input = dir.path().join("t.txt");
    std::fs::write(&input, "a\n\nb").unwrap();
    let mut b = BuildSpec::new(TokenFileFormat::Raw(TokenType::U8));
    b.document_separator = Some(b"\n\n".to_vec());
    assert!(matches!(
        build_from_text(&input, &b, &out),
        Err(DataError::VocabTooLarge {
            vocab: 257,
            width: "u8",
            ..
        })
    ));
    b.document_separator = Some(Vec::new());
    assert!(matches!(
        build_from_text(&input, &b, &out),
        Err(DataError::InvalidConfig(_))
    ));
    assert_eq!(dir_entries(dir.path()), ["t.txt"]);
}

#[test]
fn empty_inputs_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("e.bin");
    assert!(matches!(
        synthesize(&spec_u16(0), &out),
        Err(DataError::Empty { .. })
    ));
    let input = dir.path().join("empty.txt");
    std::fs::write(&input, b"").unwrap();
    let b = BuildSpec::new(TokenFileFormat::Raw(TokenType::U16));
    assert!(matches!(
        build_from_text(&input, &b, &out),
        Err(DataError::Empty { .. })
    ));
    assert!(matches!(
        inspect(&input, &InspectOptions::default()),
        Err(DataError::Empty { .. })
    ));
    assert_eq!(dir_entries(dir.path()), ["empty.txt"]);
}

#[test]
fn a_failed_or_abandoned_write_leaves_the_previous_file_intact() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keep.bin");
    synthesize(&spec_u16(100), &path).unwrap();
    let before = std::fs::read(&path).unwrap();

    let mut w = TokenWriter::create(&path, TokenFileFormat::Raw(TokenType::U16)).unwrap();
    w.write(&[1, 2, 3]).unwrap();
    let err = w.write(&[4, 70_000]).unwrap_err();
    assert!(matches!(
        err,
        DataError::TokenTooWide {
            index: 4,
            value: 70_000,
            ..
        }
    ));
    drop(w);
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(dir_entries(dir.path()), ["keep.bin"]);

    // A spec refused up front touches nothing either.
    let too_big = spec(70_000, 10, TokenFileFormat::Raw(TokenType::U16));
    assert!(synthesize(&too_big, &path).is_err());
    assert_eq!(std::fs::read(&path).unwrap(), before);

    // Empty writers refuse to produce an unreadable file.
    let w = TokenWriter::create(&path, TokenFileFormat::Llmc(LlmcFlavor::Gpt2)).unwrap();
    assert!(matches!(w.finish(), Err(DataError::Empty { .. })));
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(dir_entries(dir.path()), ["keep.bin"]);
}

// ---- property: what synthesize writes, inspect reports exactly ------------------------------

fn any_format(vocab: u32) -> impl Strategy<Value = TokenFileFormat> {
    (0usize..64, 1usize..300).prop_map(move |(pick, document_len)| {
        let all = formats_for(vocab, document_len);
        all[pick % all.len()]
    })
}

fn any_spec() -> impl Strategy<Value = SynthSpec> {
    (2u32..600)
        .prop_flat_map(|vocab| {
            (
                Just(vocab),
                2u32..=vocab.min(8),
                1u64..2500,
                any::<u64>(),
                any::<u64>(),
                any_format(vocab),
            )
        })
        .prop_map(
            |(vocab, branching, tokens, chain_seed, stream_seed, format)| SynthSpec {
                vocab,
                branching,
                tokens,
                chain_seed,
                stream_seed,
                format,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn inspect_reports_exactly_what_synthesize_wrote(spec in any_spec(), preview in 0usize..40) {
        let dir = tempfile::tempdir().unwrap();
        let path: PathBuf = dir.path().join("p.bin");
        let written = synthesize(&spec, &path).unwrap();
        let tokens = MarkovChain::random(spec.vocab, spec.branching, spec.chain_seed)
            .unwrap()
            .generate(spec.tokens as usize, spec.stream_seed);
        let options = InspectOptions {
            raw_token_type: Some(spec.format.token_type()),
            preview_tokens: preview,
            ..InspectOptions::default()
        };
        let d = inspect(&path, &options).unwrap();
        prop_assert_eq!(d.tokens, spec.tokens);
        prop_assert_eq!(written.tokens, spec.tokens);
        prop_assert_eq!(d.token_type, spec.format.token_type());
        prop_assert_eq!(d.min_id, *tokens.iter().min().unwrap());
        prop_assert_eq!(d.max_id, *tokens.iter().max().unwrap());
        let mut distinct = tokens.clone();
        distinct.sort_unstable();
        distinct.dedup();
        prop_assert_eq!(d.distinct_ids, distinct.len() as u64);
        prop_assert!(d.distinct_ids_exact);
        prop_assert_eq!(&d.first_tokens[..], &tokens[..preview.min(tokens.len())]);
        prop_assert_eq!(d.file_bytes, written.file_bytes);
        let expected_docs = match spec.format {
            TokenFileFormat::Megatron { document_len, .. } => {
                Some(spec.tokens.div_ceil(document_len as u64))
            }
            _ => None,
        };
        prop_assert_eq!(d.documents, expected_docs);
        prop_assert_eq!(written.documents, expected_docs);
        prop_assert_eq!(read_back(&path, spec.format.token_type()), tokens);
    }

    #[test]
    fn text_round_trips_with_any_separator(
        text in prop::collection::vec(prop_oneof![Just(b'a'), Just(b'b'), Just(b'\n'), any::<u8>()], 1..400),
        separator in prop::collection::vec(prop_oneof![Just(b'a'), Just(b'\n'), any::<u8>()], 1..4),
        document_len in 1usize..50,
        megatron in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.dat");
        std::fs::write(&input, &text).unwrap();
        let format = if megatron {
            TokenFileFormat::Megatron { token_type: TokenType::U16, document_len }
        } else {
            TokenFileFormat::Raw(TokenType::U16)
        };
        let spec = BuildSpec {
            format,
            document_separator: Some(separator.clone()),
            require_utf8: false,
        };
        let out = dir.path().join("out");
        let summary = build_from_text(&input, &spec, &out).unwrap();
        let tokens = read_back(&out, TokenType::U16);
        prop_assert_eq!(summary.tokens, tokens.len() as u64);
        prop_assert_eq!(decode_bytes(&tokens, Some(&separator)).unwrap(), text);
    }
}

/// `inspect` of a set of shards (a directory or a glob, as `train --data` reads one): the
/// shards' files, their tokens and ids over all of them, the first shard's format; Megatron
/// pairs with their indexes and documents; shards of two token types are refused.
#[test]
fn inspect_describes_a_set_of_shards() {
    use headroom_mmap_data::formats::shards::{ShardedWriter, Sharding};
    let dir = tempfile::tempdir().unwrap();
    let stream: Vec<u32> = (0..25).map(|i| (i * 7) % 50).collect();
    let sharding = Sharding {
        shard_tokens: 10,
        val_shards: 1,
    };
    let llmc = TokenFileFormat::Llmc(LlmcFlavor::Gpt2);
    let mut writer = ShardedWriter::create(dir.path().join("c.bin"), llmc, Some(sharding)).unwrap();
    writer.write(&stream).unwrap();
    writer.finish().unwrap();
    let all = inspect(dir.path(), &InspectOptions::default()).unwrap();
    assert_eq!((all.shards, all.tokens, all.files.len()), (3, 25, 3));
    assert_eq!(all.format, DetectedFormat::Llmc(LlmcFlavor::Gpt2));
    assert_eq!((all.min_id, all.max_id), (0, 49));
    let train = inspect(
        &dir.path().join("c_train_*.bin"),
        &InspectOptions::default(),
    )
    .unwrap();
    assert_eq!((train.shards, train.tokens), (2, 15));
    assert_eq!(train.first_tokens[0], stream[10]);
    assert!(train.to_string().contains("shards      2"), "{train}");
    // Megatron pairs: each shard's .idx beside its .bin, the documents of all.
    let meg_dir = dir.path().join("meg");
    std::fs::create_dir(&meg_dir).unwrap();
    let megatron = TokenFileFormat::Megatron {
        token_type: TokenType::U16,
        document_len: 1 << 20,
    };
    let mut writer = ShardedWriter::create(meg_dir.join("m"), megatron, Some(sharding)).unwrap();
    for doc in stream.chunks(4) {
        writer.write(doc).unwrap();
        writer.end_document().unwrap();
    }
    writer.finish().unwrap();
    let m = inspect(&meg_dir, &InspectOptions::default()).unwrap();
    assert_eq!((m.shards, m.tokens, m.files.len()), (3, 25, 6));
    assert_eq!(m.format, DetectedFormat::Megatron);
    // 7 documents of 4 tokens (the last of 1); the cut at 10 falls inside one, which each
    // side's index records; the cut at 20 falls between two.
    assert_eq!(m.documents, Some(8));
    // Two token types in one set.
    formats::write_tokens(
        dir.path().join("c_train_000009.bin"),
        &[1, 2, 3],
        TokenFileFormat::Llmc(LlmcFlavor::Llama3),
    )
    .unwrap();
    let e = inspect(dir.path(), &InspectOptions::default()).unwrap_err();
    assert!(e.to_string().contains("holds u32 tokens"), "{e}");
    let empty = dir.path().join("none_*.bin");
    assert!(inspect(&empty, &InspectOptions::default()).is_err());
}
