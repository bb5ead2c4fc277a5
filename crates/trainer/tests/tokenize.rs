//! Tokenizers against what their own implementations give: a Hugging Face `tokenizer.json`
//! trained and applied by Python's `tokenizers` (committed fixture, written by
//! `benches/torch/make_tokenizer_fixture.py`), GPT-2's BPE against the ids Python's `tiktoken`
//! and transformers give for a committed text;
//! and token files built from text in pieces equal to a whole-text encode.

use std::path::PathBuf;

use headroom_mmap_data::{open, OpenOptions, TokenType};
use headroom_trainer::tokenize::{build, format_for, Tokenizer, GPT2_EOT, GPT2_VOCAB};
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
