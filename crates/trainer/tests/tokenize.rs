//! Tokenizers against what their own implementations give: a Hugging Face `tokenizer.json`
//! trained and applied by Python's `tokenizers` (committed fixture, written by
//! `benches/torch/make_tokenizer_fixture.py`), GPT-2's BPE against the ids Python's `tiktoken`
//! and transformers give for a committed text;
//! and token files built from text in pieces equal to a whole-text encode.

#[allow(dead_code)] // only `dir_files` is used here
use crate::common;

use std::path::{Path, PathBuf};

use headroom_mmap_data::formats::shards::Sharding;
use headroom_mmap_data::{open, OpenOptions, TokenType};
use headroom_trainer::tokenize::{
    build, build_corpus, build_from_parquet, build_from_records, corpus_inputs, format_for,
    Compression, CorpusKind, CorpusOptions, DocumentToken, Tokenizer, GPT2_EOT, GPT2_VOCAB,
};
use headroom_trainer::TrainError;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name)
}

fn read_tokens(path: &std::path::Path) -> (Vec<u32>, TokenType) {
    let d = open(path, &OpenOptions::default()).unwrap();
    let n = d.total_tokens();
    let ty = d.segments()[0].tokens().token_type();
    ((0..n).map(|i| d.token(0, i).unwrap() as u32).collect(), ty)
}

#[test]
fn a_hugging_face_tokenizer_gives_pythons_ids() {
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("expected.json")).unwrap()).unwrap();
    let tok = Tokenizer::from_name(fixture("tokenizer.json").to_str().unwrap()).unwrap();
    assert_eq!(tok.vocab_size() as u64, expected["vocab"].as_u64().unwrap());
    assert_eq!(tok.end_of_text().map(u64::from), expected["eot"].as_u64());
    for case in expected["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode(text).unwrap(), want, "{text:?}");
        assert_eq!(
            tok.decode(&want).unwrap(),
            case["decoded"].as_str().unwrap()
        );
    }
    // A directory holding a tokenizer.json names it too.
    assert!(Tokenizer::from_name(fixture("").to_str().unwrap()).is_ok());
}

/// Ids written by Python's `tiktoken` (r50k_base) and transformers' `GPT2Tokenizer` on
/// OpenAI's `encoder.json`/`vocab.bpe`, which agreed with each other, for a text with
/// contractions, numbers, whitespace runs, many scripts, emoji, code and the text of
/// `<|endoftext|>`.
#[test]
fn gpt2_bpe_gives_the_ids_of_tiktoken_and_transformers() {
    let text = std::fs::read_to_string(fixture("gpt2-text.txt")).unwrap();
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("gpt2-ids.json")).unwrap()).unwrap();
    let want: Vec<u32> = expected["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert!(want.len() > 250);
    let tok = Tokenizer::from_name("gpt2").unwrap();
    assert_eq!(tok.encode(&text).unwrap(), want);
    assert_eq!(tok.decode(&want).unwrap(), text);
}

#[test]
fn gpt2_bpe_gives_gpt2_ids_without_a_download() {
    let tok = Tokenizer::from_name("gpt2").unwrap();
    assert_eq!(tok.vocab_size(), GPT2_VOCAB);
    assert_eq!(tok.end_of_text(), Some(GPT2_EOT));
    assert_eq!(tok.encode("Hello world").unwrap(), vec![15496, 995]);
    // Data cannot inject the control token: the text of <|endoftext|> is ordinary text.
    assert!(!tok.encode("a<|endoftext|>b").unwrap().contains(&GPT2_EOT));
    let text = "naïve café, 東京 🙂\n\nnumbers 12345";
    assert_eq!(tok.decode(&tok.encode(text).unwrap()).unwrap(), text);
    assert!(matches!(
        tok.decode(&[GPT2_VOCAB as u32]),
        Err(TrainError::Tokenizer { .. })
    ));
}

#[test]
fn token_files_built_in_pieces_equal_a_whole_text_encode() {
    let dir = tempfile::tempdir().unwrap();
    let tok = Tokenizer::from_name("gpt2").unwrap();
    // Over two pieces of 1 MiB, newlines before letters, spaces, digits and blank lines.
    let mut text = String::new();
    let mut i = 0u64;
    while text.len() < (5 << 19) {
        text.push_str(&format!(
            "Line {i} of the story: memory {} bytes.\n",
            i * 7919 % 1000
        ));
        if i.is_multiple_of(7) {
            text.push_str("\n  indented\n");
        }
        i += 1;
    }
    let input = dir.path().join("in.txt");
    std::fs::write(&input, &text).unwrap();
    let out = dir.path().join("out.bin");
    let format = format_for("raw", tok.vocab_size()).unwrap();
    let r = build(&input, &tok, format, None, &out, false).unwrap();
    let (tokens, ty) = read_tokens(&out);
    assert_eq!(ty, TokenType::U16);
    assert_eq!(tokens, tok.encode(&text).unwrap());
    assert_eq!(r.tokens, tokens.len() as u64);

    // Documents: each encoded on its own and followed by <|endoftext|>, but the last.
    let docs = ["First story.", "Second one\nwith two lines.", "Third."];
    std::fs::write(&input, docs.join("<|endoftext|>")).unwrap();
    let out = dir.path().join("docs.bin");
    let r = build(&input, &tok, format, Some("<|endoftext|>"), &out, false).unwrap();
    let mut want = Vec::new();
    for (k, d) in docs.iter().enumerate() {
        want.extend(tok.encode(d).unwrap());
        if k + 1 < docs.len() {
            want.push(GPT2_EOT);
        }
    }
    assert_eq!(read_tokens(&out).0, want);
    assert_eq!(r.documents, 3);
}

#[test]
fn the_token_type_fits_the_vocabulary_and_bad_input_is_refused() {
    assert_eq!(
        format_for("raw", 50257).unwrap().token_type(),
        TokenType::U16
    );
    assert_eq!(
        format_for("raw", 65536).unwrap().token_type(),
        TokenType::U16
    );
    assert_eq!(
        format_for("raw", 65537).unwrap().token_type(),
        TokenType::U32
    );
    assert_eq!(
        format_for("llmc", 128_256).unwrap().token_type(),
        TokenType::U32
    );
    assert_eq!(
        format_for("megatron", 32000).unwrap().token_type(),
        TokenType::U16
    );
    assert!(format_for("parquet", 10).is_err());
    let dir = tempfile::tempdir().unwrap();
    let tok = Tokenizer::from_name("gpt2").unwrap();
    let bin = dir.path().join("bin.dat");
    std::fs::write(&bin, [0xffu8, 0xfe, 0x00, 0x80]).unwrap();
    let out = dir.path().join("o.bin");
    let format = format_for("raw", tok.vocab_size()).unwrap();
    assert!(matches!(
        build(&bin, &tok, format, None, &out, false),
        Err(TrainError::Tokenizer { .. })
    ));
    assert!(!out.exists(), "a refused build leaves no file");
    assert!(matches!(
        Tokenizer::from_name(dir.path().join("missing.json").to_str().unwrap()),
        Err(TrainError::Tokenizer { .. })
    ));
}

/// The committed tokenizer.json with `edit` applied, written into `dir` as `name`.
fn variant(dir: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("tokenizer.json")).unwrap()).unwrap();
    edit(&mut json);
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    path
}

fn load(path: &Path) -> Result<Tokenizer, TrainError> {
    Tokenizer::from_name(path.to_str().unwrap())
}

/// A Tokenizer error whose message mentions `needle`.
fn tokenizer_error<T: std::fmt::Debug>(r: Result<T, TrainError>, needle: &str) {
    match r {
        Err(e @ TrainError::Tokenizer { .. }) => {
            assert!(e.to_string().contains(needle), "{e} lacks {needle:?}")
        }
        other => panic!("wanted a tokenizer error about {needle:?}, got {other:?}"),
    }
}

/// The tokens `build` writes for `text` (documents separated by `<|endoftext|>`).
fn built(tok: &Tokenizer, dir: &Path, text: &str) -> Result<Vec<u32>, TrainError> {
    let input = dir.join("text.txt");
    std::fs::write(&input, text).unwrap();
    let out = dir.join("tokens.bin");
    let _ = std::fs::remove_file(&out);
    let format = format_for("raw", tok.vocab_size()).unwrap();
    build(&input, tok, format, Some("<|endoftext|>"), &out, false)?;
    Ok(read_tokens(&out).0)
}

/// Truncation and padding in a tokenizer.json are for batches fed to a model: applied to the
/// pieces of a token file they would cut or pad every piece. They are cleared on loading,
/// including values the tokenizers crate panics on (a stride not below max_length; a fixed
/// length no buffer can hold).
#[test]
fn truncation_and_padding_of_the_file_do_not_change_the_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("expected.json")).unwrap()).unwrap();
    let texts: Vec<&str> = expected["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    let text = texts.join("<|endoftext|>");
    let plain = load(&fixture("tokenizer.json")).unwrap();
    let want = built(&plain, dir.path(), &text).unwrap();
    assert!(want.len() > 40);
    let truncation = |max_length: u64, stride: u64| {
        serde_json::json!({
            "direction": "Right", "max_length": max_length, "strategy": "LongestFirst",
            "stride": stride,
        })
    };
    let padding = |length: u64| {
        serde_json::json!({
            "strategy": {"Fixed": length}, "direction": "Right", "pad_to_multiple_of": null,
            "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>",
        })
    };
    let cases = [
        ("truncation", truncation(4, 0), serde_json::Value::Null),
        ("stride", truncation(4, 4), serde_json::Value::Null),
        ("padding", serde_json::Value::Null, padding(64)),
        ("huge-padding", serde_json::Value::Null, padding(u64::MAX)),
        ("both", truncation(4, 1), padding(64)),
    ];
    for (name, trunc, pad) in cases {
        let tok = load(&variant(dir.path(), name, |j| {
            j["truncation"] = trunc;
            j["padding"] = pad;
        }))
        .unwrap();
        for t in &texts {
            assert_eq!(
                tok.encode(t).unwrap(),
                plain.encode(t).unwrap(),
                "{name}: {t:?}"
            );
        }
        assert_eq!(built(&tok, dir.path(), &text).unwrap(), want, "{name}");
    }
}

/// BPE dropout skips merges at random: a token file built with it would differ run to run.
#[test]
fn a_bpe_model_with_dropout_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = variant(dir.path(), "dropout.json", |j| {
        j["model"]["dropout"] = 0.1.into()
    });
    tokenizer_error(load(&path), "dropout");
    // Dropout 0 is no dropout.
    let path = variant(dir.path(), "dropout0.json", |j| {
        j["model"]["dropout"] = 0.0.into()
    });
    let tok = load(&path).unwrap();
    let plain = load(&fixture("tokenizer.json")).unwrap();
    assert_eq!(
        tok.encode("hello world").unwrap(),
        plain.encode("hello world").unwrap()
    );
}

/// Settings the tokenizers crate accepts but panics on when used are typed errors naming the
/// file: a Strip decoder that strips a token's only character from both ends (it slices
/// `[1..0]`), a precompiled normalizer whose character map is not one (it indexes past it).
#[test]
fn settings_the_tokenizers_crate_panics_on_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let decoder = serde_json::json!({"type": "Strip", "content": "a", "start": 1, "stop": 1});
    let strip = variant(dir.path(), "strip.json", |j| j["decoder"] = decoder);
    let tok = load(&strip).unwrap();
    let ids = tok.encode("a").unwrap();
    assert_eq!(ids.len(), 1);
    tokenizer_error(tok.decode(&ids), "panicked");
    tokenizer_error(tok.decode(&ids), "strip.json");

    let normalizer = serde_json::json!({"type": "Precompiled", "precompiled_charsmap": "AAAAAA=="});
    let precompiled = variant(dir.path(), "precompiled.json", |j| {
        j["normalizer"] = normalizer
    });
    let tok = load(&precompiled).unwrap();
    tokenizer_error(tok.encode("hello world"), "panicked");
    tokenizer_error(tok.encode("hello world"), "precompiled.json");
    // Inside build the encodes run on threads: the error still comes back as one.
    tokenizer_error(
        built(&tok, dir.path(), "hello<|endoftext|>world"),
        "panicked",
    );
}

/// A vocabulary's ids need not be dense: its size is the highest id + 1, so every id it
/// encodes to decodes and fits the token type chosen for it.
#[test]
fn the_vocabulary_size_is_the_highest_id_plus_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse.json");
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 60000}, "unk_token": "a"},
    });
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    let tok = load(&path).unwrap();
    assert_eq!(tok.vocab_size(), 60001);
    assert_eq!(tok.encode("a b").unwrap(), vec![0, 60000]);
    assert_eq!(tok.decode(&[0, 60000]).unwrap(), "a b");
    tokenizer_error(tok.decode(&[60001]), "outside the vocabulary of 60001");
    // Past u16: the token type follows the highest id.
    let mut json = json;
    json["model"]["vocab"]["b"] = 70000.into();
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    let tok = load(&path).unwrap();
    assert_eq!(
        format_for("raw", tok.vocab_size()).unwrap().token_type(),
        TokenType::U32
    );
}

/// A tokenizer.json that is a symlink to a device (which reports no size) is refused at once,
/// not read until memory runs out.
#[cfg(unix)]
#[test]
fn a_tokenizer_file_that_is_a_device_is_refused_without_reading_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
    tokenizer_error(load(&path), "not a regular file");
}

/// A Hugging Face tokenizer maps the text of its added tokens to their ids, as transformers'
/// does (and TRL relies on when it appends the end-of-text token's text to a completion);
/// GPT-2's BPE keeps the text ordinary (`gpt2_bpe_gives_gpt2_ids_without_a_download`).
#[test]
fn hugging_face_added_token_text_encodes_to_its_id() {
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer/story/tokenizer.json");
    let tok = Tokenizer::from_name(file.to_str().unwrap()).unwrap();
    let eot = tok.end_of_text().unwrap();
    let ids = tok.encode("the dog</s>cat").unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == eot).count(), 1, "{ids:?}");
}

fn parquet_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../parquet/tests/fixtures")
        .join(name)
}

/// A Parquet corpus (FineWeb's columns, three row groups, one empty text) is one document a
/// row, each its text's ids and <|endoftext|>, in row order: the rows pyarrow read from it.
#[test]
fn a_parquet_corpus_is_one_document_a_row() {
    let dir = tempfile::tempdir().unwrap();
    let tok = Tokenizer::from_name("gpt2").unwrap();
    let mut want = Vec::new();
    let rows = std::fs::read_to_string(parquet_fixture("fineweb_like.jsonl")).unwrap();
    for line in rows.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        want.extend(tok.encode(row["text"].as_str().unwrap()).unwrap());
        want.push(GPT2_EOT);
    }
    let input = parquet_fixture("fineweb_like.parquet");
    for format in ["llmc", "megatron"] {
        let out = dir.path().join(format!("fineweb-{format}.bin"));
        let format = format_for(format, tok.vocab_size()).unwrap();
        let r = build_from_parquet(&input, &tok, format, "text", &out, false).unwrap();
        assert_eq!(read_tokens(&out).0, want);
        assert_eq!((r.documents, r.tokens), (30, want.len() as u64));
        let d = open(&out, &OpenOptions::default()).unwrap();
        if matches!(format, headroom_mmap_data::TokenFileFormat::Megatron { .. }) {
            assert_eq!(d.documents().map(<[_]>::len), Some(30));
        }
    }
    // Another column; a column that is not there; a column with nulls (the row is named).
    let out = dir.path().join("other.bin");
    let format = format_for("llmc", tok.vocab_size()).unwrap();
    let r = build_from_parquet(&input, &tok, format, "language", &out, false).unwrap();
    assert_eq!(r.documents, 30);
    let e = build_from_parquet(&input, &tok, format, "body", &out, false).unwrap_err();
    assert!(e.to_string().contains("no column \"body\""), "{e}");
    let types = parquet_fixture("types_snappy.parquet");
    let e = build_from_parquet(&types, &tok, format, "string", &out, false).unwrap_err();
    assert!(e.to_string().contains("is null, not text"), "{e}");
    let e = build_from_parquet(&types, &tok, format, "int64", &out, false).unwrap_err();
    assert!(e.to_string().contains("not text"), "{e}");
}

/// A JSONL corpus, plain, gzip- or zstd-compressed (known by its magic bytes, whatever its
/// name), builds the token file its Parquet twin builds; a line that is not a record, or
/// whose text is missing, is an error naming the line.
#[test]
fn a_jsonl_corpus_plain_or_compressed_builds_as_its_parquet_twin() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let tok = Tokenizer::from_name("gpt2").unwrap();
    let format = format_for("llmc", tok.vocab_size()).unwrap();
    let parquet_out = dir.path().join("parquet.bin");
    build_from_parquet(
        &parquet_fixture("fineweb_like.parquet"),
        &tok,
        format,
        "text",
        &parquet_out,
        false,
    )
    .unwrap();
    let want = read_tokens(&parquet_out).0;
    let jsonl = std::fs::read(parquet_fixture("fineweb_like.jsonl")).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&jsonl).unwrap();
    let gz = gz.finish().unwrap();
    // Two frames with skippable frames before and between them, as `pzstd` writes and `cat`
    // joins: a decoder stopping after the first frame would lose half the corpus.
    let fastest = ruzstd::encoding::CompressionLevel::Fastest;
    let half = jsonl.len() / 2
        + jsonl[jsonl.len() / 2..]
            .iter()
            .position(|&b| b == b'\n')
            .unwrap()
        + 1;
    let skippable = |zst: &mut Vec<u8>| {
        zst.extend(0x184D_2A50u32.to_le_bytes());
        zst.extend(3u32.to_le_bytes());
        zst.extend([1, 2, 3]);
    };
    // `pzstd` starts with a skippable frame: the file is known as zstd by it too.
    let mut zst = Vec::new();
    skippable(&mut zst);
    zst.extend(ruzstd::encoding::compress_to_vec(&jsonl[..half], fastest));
    skippable(&mut zst);
    zst.extend(ruzstd::encoding::compress_to_vec(&jsonl[half..], fastest));
    for (name, bytes, kind) in [
        ("corpus.jsonl", jsonl.clone(), Compression::None),
        ("corpus.json.gz", gz, Compression::Gzip),
        ("corpus.data", zst, Compression::Zstd),
    ] {
        let input = dir.path().join(name);
        std::fs::write(&input, bytes).unwrap();
        assert_eq!(
            CorpusKind::of(&input, false).unwrap(),
            CorpusKind::Jsonl(kind),
            "{name}"
        );
        let out = dir.path().join(format!("{name}.bin"));
        let r = build_from_records(
            &input,
            CorpusKind::Jsonl(kind),
            &tok,
            format,
            "text",
            &out,
            false,
        )
        .unwrap();
        assert_eq!(read_tokens(&out).0, want, "{name}");
        assert_eq!(r.documents, 30);
    }
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "plain words").unwrap();
    assert_eq!(CorpusKind::of(&text, false).unwrap(), CorpusKind::Text);
    assert_eq!(
        CorpusKind::of(&text, true).unwrap(),
        CorpusKind::Jsonl(Compression::None)
    );
    let bad = dir.path().join("bad.jsonl");
    let out = dir.path().join("bad.bin");
    for (lines, needle) in [
        ("{\"text\": \"a\"}\n\n[1]\n", "line 3: not a JSON object"),
        (
            "{\"text\": \"a\"}\n{\"body\": \"b\"}\n",
            "line 2: \"text\" is missing",
        ),
        ("{\"text\": \"a\"\n", "line 1: not JSON"),
        ("\n\n", "no lines"),
    ] {
        std::fs::write(&bad, lines).unwrap();
        let e = build_from_records(
            &bad,
            CorpusKind::Jsonl(Compression::None),
            &tok,
            format,
            "text",
            &out,
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains(needle), "{needle:?} in {e}");
    }
}

fn llmc_fineweb(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llmc_fineweb")
        .join(name)
}

/// The shards llm.c's own `dev/data/fineweb.py` wrote (shards of 3000 tokens, the first the
/// validation split, `<|endoftext|>` before each document; see
/// `benches/torch/make_llmc_shards_fixture.py`) from the Parquet fixture's rows followed by
/// its JSONL twin's: `--shard-tokens 3000 --val-shards 1 --document-token start` over the two
/// files writes the same files, byte for byte, under the same names.
#[test]
fn shards_equal_llmc_fineweb_py_byte_for_byte() {
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(llmc_fineweb("MANIFEST.json")).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tok = Tokenizer::from_name("gpt2").unwrap();
    let format = format_for("llmc", tok.vocab_size()).unwrap();
    let inputs = [
        parquet_fixture("fineweb_like.parquet"),
        parquet_fixture("fineweb_like.jsonl"),
    ];
    let options = CorpusOptions {
        document_token: DocumentToken::Start,
        sharding: Some(Sharding {
            shard_tokens: 3000,
            val_shards: 1,
        }),
        ..CorpusOptions::default()
    };
    let out = dir.path().join("fineweb.bin");
    let r = build_corpus(&inputs, &tok, format, &options, &out, false).unwrap();
    let shards = manifest["shards"].as_array().unwrap();
    assert!(shards.len() >= 3, "the fixture has several train shards");
    assert_eq!(r.shards.len(), shards.len());
    assert_eq!(r.documents, manifest["documents"].as_u64().unwrap());
    for (written, shard) in r.shards.iter().zip(shards) {
        let name = shard["file"].as_str().unwrap();
        assert_eq!(written.file_name().unwrap().to_str().unwrap(), name);
        let theirs = std::fs::read(llmc_fineweb(name)).unwrap();
        assert!(std::fs::read(written).unwrap() == theirs, "{name} differs");
    }
    let total: u64 = shards.iter().map(|s| s["tokens"].as_u64().unwrap()).sum();
    assert_eq!(r.tokens, total);
}

/// Several inputs are one stream: shards of any size, read back in order, are the one-file
/// build of the same inputs, which is each input's own build one after the other; a
/// directory is its corpus files in path order, its subdirectories' included.
#[test]
fn several_inputs_and_shards_are_one_stream() {
    let dir = tempfile::tempdir().unwrap();
    let tok = Tokenizer::from_name("gpt2").unwrap();
    let format = format_for("llmc", tok.vocab_size()).unwrap();
    let parquet = parquet_fixture("fineweb_like.parquet");
    let jsonl = parquet_fixture("fineweb_like.jsonl");
    // Each input alone, as before.
    let alone = dir.path().join("alone.bin");
    build_from_parquet(&parquet, &tok, format, "text", &alone, false).unwrap();
    let first = read_tokens(&alone).0;
    let kind = CorpusKind::Jsonl(Compression::None);
    build_from_records(&jsonl, kind, &tok, format, "text", &alone, false).unwrap();
    let second = read_tokens(&alone).0;
    let inputs = vec![parquet.clone(), jsonl.clone()];
    let one = dir.path().join("one.bin");
    let r = build_corpus(
        &inputs,
        &tok,
        format,
        &CorpusOptions::default(),
        &one,
        false,
    )
    .unwrap();
    let stream = read_tokens(&one).0;
    assert_eq!(stream, [first, second].concat());
    assert_eq!((r.documents, r.cuts_inside_documents), (60, 0));
    for (shard_tokens, val_shards) in [(1000, 0), (4096, 2), (7, 1), (100_000, 1)] {
        let sub = dir.path().join(format!("s{shard_tokens}"));
        std::fs::create_dir(&sub).unwrap();
        let options = CorpusOptions {
            sharding: Some(Sharding {
                shard_tokens,
                val_shards,
            }),
            ..CorpusOptions::default()
        };
        let r = build_corpus(&inputs, &tok, format, &options, &sub.join("c.bin"), false).unwrap();
        assert_eq!(r.tokens, stream.len() as u64);
        let mut read = Vec::new();
        for shard in &r.shards {
            let tokens = read_tokens(shard).0;
            assert!(tokens.len() as u64 <= shard_tokens);
            read.extend(tokens);
        }
        assert_eq!(read, stream, "shards of {shard_tokens}");
        assert_eq!(
            r.shards.len() as u64,
            (stream.len() as u64).div_ceil(shard_tokens)
        );
    }
    // A directory: its corpus files in name order; hidden and other files are not read.
    let corpus = dir.path().join("corpus");
    std::fs::create_dir(&corpus).unwrap();
    std::fs::copy(&parquet, corpus.join("train-00001-of-00002.parquet")).unwrap();
    std::fs::copy(&parquet, corpus.join("train-00000-of-00002.parquet")).unwrap();
    std::fs::write(corpus.join(".gitattributes"), "*.parquet lfs").unwrap();
    std::fs::write(corpus.join("README.md"), "# a dataset card").unwrap();
    let listed = corpus_inputs(std::slice::from_ref(&corpus)).unwrap();
    assert_eq!(
        listed,
        [
            corpus.join("train-00000-of-00002.parquet"),
            corpus.join("train-00001-of-00002.parquet")
        ]
    );
    // Subdirectories too, in path order (FineWeb's data/CC-MAIN-*/ layout), but not hidden
    // ones nor the datasets library's metadata.
    let nested = dir.path().join("fineweb");
    for sub in ["data/CC-MAIN-2024-10", "data/CC-MAIN-2013-20", ".cache/x"] {
        std::fs::create_dir_all(nested.join(sub)).unwrap();
    }
    for file in [
        "data/CC-MAIN-2024-10/000_00000.parquet",
        "data/CC-MAIN-2013-20/001_00000.parquet",
        "data/CC-MAIN-2013-20/000_00000.parquet",
        ".cache/x/000.parquet",
    ] {
        std::fs::copy(&parquet, nested.join(file)).unwrap();
    }
    for metadata in ["dataset_info.json", "state.json", "data/dataset_dict.json"] {
        std::fs::write(nested.join(metadata), "{}").unwrap();
    }
    let listed = corpus_inputs(std::slice::from_ref(&nested)).unwrap();
    assert_eq!(
        listed,
        [
            nested.join("data/CC-MAIN-2013-20/000_00000.parquet"),
            nested.join("data/CC-MAIN-2013-20/001_00000.parquet"),
            nested.join("data/CC-MAIN-2024-10/000_00000.parquet"),
        ]
    );
    #[cfg(unix)]
    {
        // A link back up is refused, not followed for ever.
        std::os::unix::fs::symlink(&nested, nested.join("data/loop")).unwrap();
        let e = corpus_inputs(std::slice::from_ref(&nested)).unwrap_err();
        assert!(e.to_string().contains("directory levels"), "{e}");
    }
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert!(corpus_inputs(&[empty]).is_err());
}

/// A dataset `datasets` saved (`save_to_disk`: two Arrow shards beside its metadata) builds
/// the token file its Parquet twin builds, one document a row; a cache file `map` left beside
/// it is not read from the directory, but reads as a corpus of its own when named; a
/// `DatasetDict` of two splits is refused unless one split is named.
#[test]
fn a_saved_hf_dataset_builds_as_its_parquet_twin() {
    let dir = tempfile::tempdir().unwrap();
    let tok = Tokenizer::from_name("gpt2").unwrap();
    let format = format_for("llmc", tok.vocab_size()).unwrap();
    let twin = dir.path().join("parquet.bin");
    build_from_parquet(
        &parquet_fixture("fineweb_like.parquet"),
        &tok,
        format,
        "text",
        &twin,
        false,
    )
    .unwrap();
    let want = read_tokens(&twin).0;
    let saved = dir.path().join("saved");
    std::fs::create_dir(&saved).unwrap();
    let fixture = parquet_fixture("arrow/hf_save_to_disk");
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), saved.join(entry.file_name())).unwrap();
    }
    let cache = parquet_fixture("arrow/hf_cache_map.arrow");
    std::fs::copy(&cache, saved.join("cache-5f1a2b3c4d5e6f70.arrow")).unwrap();
    let inputs = corpus_inputs(std::slice::from_ref(&saved)).unwrap();
    assert_eq!(
        inputs,
        [
            saved.join("data-00000-of-00002.arrow"),
            saved.join("data-00001-of-00002.arrow")
        ]
    );
    assert_eq!(
        CorpusKind::of(&inputs[0], false).unwrap(),
        CorpusKind::Arrow
    );
    let out = dir.path().join("arrow.bin");
    let r = build_corpus(
        &inputs,
        &tok,
        format,
        &CorpusOptions::default(),
        &out,
        false,
    )
    .unwrap();
    assert_eq!(read_tokens(&out).0, want);
    assert_eq!(r.documents, 30);
    // The cache file alone: the same texts, beside a tokenized column.
    let kind = CorpusKind::of(&cache, false).unwrap();
    build_from_records(&cache, kind, &tok, format, "text", &out, false).unwrap();
    assert_eq!(read_tokens(&out).0, want);
    let e = build_from_records(&cache, kind, &tok, format, "input_ids", &out, false).unwrap_err();
    assert!(e.to_string().contains("row 1: \"input_ids\" is []"), "{e}");
    // A DatasetDict (`DatasetDict.save_to_disk`: dataset_dict.json, a directory a split) is
    // refused whole, so that its test split is not trained on; one split reads.
    let dict = dir.path().join("dict");
    for split in ["train", "test"] {
        std::fs::create_dir_all(dict.join(split)).unwrap();
        for shard in ["data-00000-of-00002.arrow", "state.json"] {
            std::fs::copy(saved.join(shard), dict.join(split).join(shard)).unwrap();
        }
    }
    std::fs::write(
        dict.join("dataset_dict.json"),
        r#"{"splits": ["train", "test"]}"#,
    )
    .unwrap();
    let e = corpus_inputs(std::slice::from_ref(&dict)).unwrap_err();
    assert!(
        e.to_string().contains("DatasetDict") && e.to_string().contains("train, test"),
        "{e}"
    );
    let train = corpus_inputs(&[dict.join("train")]).unwrap();
    assert_eq!(train, [dict.join("train/data-00000-of-00002.arrow")]);
    // A damaged shard is an Arrow error naming the file.
    let mut bytes = std::fs::read(&inputs[1]).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&inputs[1], bytes).unwrap();
    let e = build_corpus(
        &inputs,
        &tok,
        format,
        &CorpusOptions::default(),
        &out,
        false,
    )
    .unwrap_err();
    let e = e.to_string();
    assert!(
        e.contains("data-00001-of-00002.arrow") && e.contains("Arrow"),
        "{e}"
    );
}

/// Text files among the inputs: each one's documents, and the end-of-text token between
/// files (never two files run together); with the token at the start, every document,
/// the first included, starts with it.
#[test]
fn text_inputs_are_delimited_between_files() {
    let dir = tempfile::tempdir().unwrap();
    let tok = Tokenizer::from_name("gpt2").unwrap();
    let format = format_for("raw-u16", tok.vocab_size()).unwrap();
    let a = dir.path().join("a.txt");
    let b = dir.path().join("b.txt");
    std::fs::write(&a, "first file|second doc").unwrap();
    std::fs::write(&b, "last file").unwrap();
    let ids = |t: &str| tok.encode(t).unwrap();
    let out = dir.path().join("out.bin");
    let run = |options: &CorpusOptions| {
        build_corpus(&[a.clone(), b.clone()], &tok, format, options, &out, false).unwrap();
        read_tokens(&out).0
    };
    let end = run(&CorpusOptions {
        separator: Some("|".into()),
        ..CorpusOptions::default()
    });
    let want = [
        ids("first file"),
        vec![GPT2_EOT],
        ids("second doc"),
        vec![GPT2_EOT],
        ids("last file"),
    ]
    .concat();
    assert_eq!(end, want);
    let start = run(&CorpusOptions {
        separator: Some("|".into()),
        document_token: DocumentToken::Start,
        ..CorpusOptions::default()
    });
    let want = [
        vec![GPT2_EOT],
        ids("first file"),
        vec![GPT2_EOT],
        ids("second doc"),
        vec![GPT2_EOT],
        ids("last file"),
    ]
    .concat();
    assert_eq!(start, want);
    // One text file and no separator: no token at all, as before.
    build(&b, &tok, format, None, &out, false).unwrap();
    assert_eq!(read_tokens(&out).0, ids("last file"));
}

/// A build refuses inputs it would destroy: the output itself, or a file named as one of the
/// output's shards (which a sharded build removes first). Nothing is written or removed.
#[test]
fn a_build_never_overwrites_its_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let tok = Tokenizer::from_name("gpt2").unwrap();
    let format = format_for("raw-u16", tok.vocab_size()).unwrap();
    let shard_named = dir.path().join("c_000003.bin");
    std::fs::write(&shard_named, "words in a text file").unwrap();
    let options = CorpusOptions {
        sharding: Some(Sharding {
            shard_tokens: 10,
            val_shards: 0,
        }),
        ..CorpusOptions::default()
    };
    let out = dir.path().join("c.bin");
    let e = build_corpus(
        std::slice::from_ref(&shard_named),
        &tok,
        format,
        &options,
        &out,
        false,
    )
    .unwrap_err();
    assert!(e.to_string().contains("one of the output's shards"), "{e}");
    assert!(shard_named.is_file());
    let e = build_corpus(
        std::slice::from_ref(&shard_named),
        &tok,
        format,
        &CorpusOptions::default(),
        &shard_named,
        false,
    )
    .unwrap_err();
    assert!(e.to_string().contains("is the output file"), "{e}");
    assert_eq!(
        std::fs::read_to_string(&shard_named).unwrap(),
        "words in a text file"
    );
    // A record corpus with a separator.
    let e = build_corpus(
        &[parquet_fixture("fineweb_like.parquet")],
        &tok,
        format,
        &CorpusOptions {
            separator: Some("|".into()),
            ..CorpusOptions::default()
        },
        &out,
        false,
    )
    .unwrap_err();
    assert!(e.to_string().contains("records are its documents"), "{e}");
}

/// Every file in `dir` by name, with its bytes.
fn files_in(dir: &Path) -> Vec<(String, Vec<u8>)> {
    common::dir_files(dir, None, &[])
}

/// A sharded build stopped after any number of shards and resumed, as many times as it
/// takes, writes the same files byte for byte as one uninterrupted build, with the same
/// counts: records (Parquet then JSON lines, llm.c's layout) and text files (documents cut
/// into pieces, Megatron pairs whose indexes record the documents), shard sizes that cut
/// inside documents and inside a unit's tokens.
#[test]
fn a_stopped_build_resumes_to_the_same_shards() {
    let tok = Tokenizer::from_name("gpt2").unwrap();
    let root = tempfile::tempdir().unwrap();
    let text_a = root.path().join("a.txt");
    let text_b = root.path().join("b.txt");
    let words = std::fs::read_to_string(parquet_fixture("fineweb_like.jsonl")).unwrap();
    std::fs::write(&text_a, words.replace("\"}", "|")).unwrap();
    std::fs::write(&text_b, &words[..5000]).unwrap();
    let records = vec![
        parquet_fixture("fineweb_like.parquet"),
        parquet_fixture("fineweb_like.jsonl"),
    ];
    let texts = vec![text_a, text_b];
    let cases: [(&[PathBuf], &str, Option<&str>, DocumentToken); 2] = [
        (&records, "llmc", None, DocumentToken::Start),
        (&texts, "megatron", Some("|"), DocumentToken::End),
    ];
    for (inputs, format_name, separator, document_token) in cases {
        let format = format_for(format_name, tok.vocab_size()).unwrap();
        for shard_tokens in [997u64, 4000] {
            let options = |resume: bool, stop: Option<u64>| CorpusOptions {
                separator: separator.map(str::to_owned),
                document_token,
                sharding: Some(Sharding {
                    shard_tokens,
                    val_shards: 1,
                }),
                resume,
                stop_after_shards: stop,
                ..CorpusOptions::default()
            };
            let whole_dir = root
                .path()
                .join(format!("whole-{format_name}-{shard_tokens}"));
            std::fs::create_dir(&whole_dir).unwrap();
            let whole = build_corpus(
                inputs,
                &tok,
                format,
                &options(false, None),
                &whole_dir.join("c.bin"),
                false,
            )
            .unwrap();
            assert!(!whole.stopped && whole.shards.len() >= 3);
            assert!(
                whole.cuts_inside_documents > 0,
                "cuts fall inside documents"
            );
            let want = files_in(&whole_dir);
            for stride in [1u64, 2] {
                let dir = root
                    .path()
                    .join(format!("steps-{format_name}-{shard_tokens}-{stride}"));
                std::fs::create_dir(&dir).unwrap();
                let out = dir.join("c.bin");
                let mut r = build_corpus(
                    inputs,
                    &tok,
                    format,
                    &options(false, Some(stride)),
                    &out,
                    false,
                )
                .unwrap();
                let mut runs = 1;
                while r.stopped {
                    // A stopped build keeps its finished shards and its progress; a dead
                    // one may also leave a shard it finished after saving its progress,
                    // which the resume must rewrite rather than keep.
                    assert!(dir.join(".c.bin.build.json").is_file());
                    let ahead = shard_named(&dir, r.shards.len());
                    std::fs::write(&ahead, b"a shard the progress does not know").unwrap();
                    r = build_corpus(
                        inputs,
                        &tok,
                        format,
                        &options(true, Some(stride)),
                        &out,
                        false,
                    )
                    .unwrap();
                    assert!(r.removed.contains(&ahead) || !ahead.exists());
                    runs += 1;
                }
                assert!(runs >= 2, "the build stopped at least once");
                assert!(!dir.join(".c.bin.build.json").exists());
                let got = files_in(&dir);
                let names = |f: &[(String, Vec<u8>)]| -> Vec<String> {
                    f.iter().map(|(n, _)| n.clone()).collect()
                };
                assert_eq!(names(&got), names(&want), "{format_name} {shard_tokens}");
                for ((name, a), (_, b)) in got.iter().zip(&want) {
                    assert!(
                        a == b,
                        "{name} differs ({format_name}, {shard_tokens}, {stride})"
                    );
                }
                assert_eq!(
                    (r.tokens, r.documents, r.text_bytes, r.cuts_inside_documents),
                    (
                        whole.tokens,
                        whole.documents,
                        whole.text_bytes,
                        whole.cuts_inside_documents
                    ),
                    "{format_name} {shard_tokens} {stride}"
                );
            }
        }
    }
}

/// The path of shard `index` of `c.bin` in `dir` (validation shard 0, then train).
fn shard_named(dir: &Path, index: usize) -> PathBuf {
    let split = if index == 0 { "val" } else { "train" };
    dir.join(format!("c_{split}_{index:06}.bin"))
}

/// `--resume` continues only the same build: changed settings or inputs, no progress, or an
/// unsharded build are refused with what changed, and nothing is removed.
#[test]
fn a_resume_of_another_build_is_refused() {
    let tok = Tokenizer::from_name("gpt2").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let format = format_for("llmc", tok.vocab_size()).unwrap();
    let input = dir.path().join("corpus.jsonl");
    std::fs::copy(parquet_fixture("fineweb_like.jsonl"), &input).unwrap();
    let out = dir.path().join("c.bin");
    let options = |shard_tokens: u64, resume: bool| CorpusOptions {
        sharding: Some(Sharding {
            shard_tokens,
            val_shards: 0,
        }),
        resume,
        stop_after_shards: Some(2),
        ..CorpusOptions::default()
    };
    let inputs = std::slice::from_ref(&input);
    let e = build_corpus(inputs, &tok, format, &options(1000, true), &out, false).unwrap_err();
    assert!(
        e.to_string().contains("no build of these shards to resume"),
        "{e}"
    );
    let r = build_corpus(inputs, &tok, format, &options(1000, false), &out, false).unwrap();
    assert!(r.stopped && r.shards.len() == 2);
    let before = files_in(dir.path());
    let e = build_corpus(inputs, &tok, format, &options(999, true), &out, false).unwrap_err();
    assert!(e.to_string().contains("sharding changed"), "{e}");
    let mut other = options(1000, true);
    other.document_token = DocumentToken::Start;
    let e = build_corpus(inputs, &tok, format, &other, &out, false).unwrap_err();
    assert!(e.to_string().contains("document_token changed"), "{e}");
    let mut longer = std::fs::read(&input).unwrap();
    longer.extend_from_slice(b"{\"text\": \"one more\"}\n");
    std::fs::write(&input, longer).unwrap();
    let e = build_corpus(inputs, &tok, format, &options(1000, true), &out, false).unwrap_err();
    assert!(e.to_string().contains("inputs changed"), "{e}");
    assert_eq!(
        files_in(dir.path())
            .into_iter()
            .filter(|(n, _)| n != "corpus.jsonl")
            .collect::<Vec<_>>(),
        before
            .into_iter()
            .filter(|(n, _)| n != "corpus.jsonl")
            .collect::<Vec<_>>()
    );
    let e = build_corpus(
        inputs,
        &tok,
        format,
        &CorpusOptions {
            resume: true,
            ..CorpusOptions::default()
        },
        &out,
        false,
    )
    .unwrap_err();
    assert!(e.to_string().contains("only a sharded build"), "{e}");
}
