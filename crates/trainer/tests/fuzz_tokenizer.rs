//! Fuzz test for the trainer's Hugging Face tokenizer reader (`Tokenizer::from_name` on a
//! `tokenizer.json`, then `encode` and `decode`) with headroom-fuzzkit.
//!
//! The seed is the committed story tokenizer (a BPE with a Metaspace pre-tokenizer and
//! decoder, and added tokens). Whatever loads is used: a text with every kind of character is
//! encoded, and ids decoded. The `tokenizers` crate panics on some settings it does not check;
//! the reader turns those into errors, so 0 panics are asserted here. Two campaigns:
//! - `fuzz_hugging_face_tokenizer`: byte-level damage (fuzzkit), which mostly breaks the JSON;
//! - `tokenizer_json_settings`: structural damage that keeps the JSON valid — every setting
//!   outside the vocabulary set to odd values or removed, and each component replaced by
//!   other component types with extreme parameters — so the library's own checks face them.
//!
//! `scripts/fuzz-long.sh` runs the fuzzkit campaign long.

use std::panic::{catch_unwind, AssertUnwindSafe};

use headroom_fuzzkit::{fuzz, iterations, Cleanup, ScratchDir};
use headroom_trainer::tokenize::Tokenizer;
use serde_json::{json, Value};

#[allow(dead_code)] // the command helpers are for the tests that run `headroom`
mod common;

const CI_ITERATIONS: u64 = 300;

const TEXT: &str = "the quick brown fox jumps over the lazy dog.\n  Tabs\tand ünïcödé, \
                    emoji 🦀, <|endoftext|> and digits 0123456789!";

fn load_and_use(scratch: &ScratchDir, bytes: &[u8]) -> Result<(), headroom_trainer::TrainError> {
    let path = scratch.fresh();
    let _cleanup = Cleanup(vec![path.clone()]);
    std::fs::write(&path, bytes).unwrap();
    let tok = Tokenizer::from_name(path.to_str().unwrap())?;
    let ids = tok.encode(TEXT)?;
    let vocab = tok.vocab_size();
    assert!(
        ids.iter().all(|&id| (id as usize) < vocab),
        "{ids:?} of {vocab}"
    );
    tok.decode(&ids)?;
    // Ids the reader says exist decode (to something) or are refused, never a panic.
    if vocab > 0 {
        tok.decode(&[0, (vocab - 1) as u32])?;
    }
    Ok(())
}

fn story_tokenizer() -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizer/story/tokenizer.json"),
    )
    .unwrap()
}

#[test]
fn fuzz_hugging_face_tokenizer() {
    let seed = story_tokenizer();
    let scratch = ScratchDir::new("headroom-fuzz-tokenizer").unwrap();
    let report = fuzz(
        "tokenizer-json",
        &[seed],
        &[],
        iterations(CI_ITERATIONS),
        move |bytes| load_and_use(&scratch, bytes),
    );
    println!("{report}");
    report.assert_clean();
    // Most damage breaks the JSON; some leaves a tokenizer that still works.
    assert!(report.errors > 0 && report.ok > 0, "{report}");
}

/// Components of other types, with extreme or inconsistent parameters, for the slots they
/// can fill.
fn other_components(slot: &str) -> Vec<Value> {
    let huge = u64::MAX;
    match slot {
        "normalizer" => vec![
            json!({"type": "Precompiled", "precompiled_charsmap": "AAAA"}),
            json!({"type": "Precompiled", "precompiled_charsmap": "not base64"}),
            json!({"type": "Replace", "pattern": {"Regex": "(("}, "content": "x"}),
            json!({"type": "Replace", "pattern": {"String": ""}, "content": "xx"}),
            json!({"type": "Prepend", "prepend": "▁"}),
            json!({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}),
            json!({"type": "Strip", "strip_left": true, "strip_right": true}),
        ],
        "pre_tokenizer" => vec![
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                   "use_regex": true}),
            json!({"type": "Split", "pattern": {"Regex": "(?<=x"}, "behavior": "Isolated",
                   "invert": false}),
            json!({"type": "Split", "pattern": {"String": ""}, "behavior": "Removed",
                   "invert": true}),
            json!({"type": "Digits", "individual_digits": true}),
            json!({"type": "Punctuation", "behavior": "Contiguous"}),
            json!({"type": "Sequence", "pretokenizers": [{"type": "Whitespace"},
                   {"type": "UnicodeScripts"}]}),
        ],
        "decoder" => vec![
            json!({"type": "Strip", "content": "a", "start": huge, "stop": huge}),
            json!({"type": "Strip", "content": "▁", "start": 1, "stop": 1}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
            json!({"type": "CTC", "pad_token": "<unk>", "word_delimiter_token": "",
                   "cleanup": true}),
            json!({"type": "WordPiece", "prefix": "", "cleanup": true}),
            json!({"type": "Replace", "pattern": {"Regex": "[a-"}, "content": ""}),
        ],
        "post_processor" => vec![
            json!({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "</s>",
                   "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                   "pair": [], "special_tokens": {}}),
            json!({"type": "BertProcessing", "sep": ["</s>", huge], "cls": ["<unk>", 0]}),
            json!({"type": "RobertaProcessing", "sep": ["</s>", 1], "cls": ["<s>", 999999],
                   "trim_offsets": true, "add_prefix_space": true}),
        ],
        "truncation" => vec![
            json!({"direction": "Right", "max_length": 0, "strategy": "LongestFirst",
                   "stride": huge}),
            json!({"direction": "Left", "max_length": 1, "strategy": "OnlySecond",
                   "stride": 5}),
        ],
        "padding" => vec![
            json!({"strategy": {"Fixed": huge}, "direction": "Right",
                   "pad_to_multiple_of": 0, "pad_id": huge, "pad_type_id": 0,
                   "pad_token": "<pad>"}),
            json!({"strategy": "BatchLongest", "direction": "Left",
                   "pad_to_multiple_of": huge, "pad_id": 0, "pad_type_id": 0,
                   "pad_token": ""}),
        ],
        "model" => vec![
            json!({"type": "WordPiece", "unk_token": "<missing>", "continuing_subword_prefix":
                   "##", "max_input_chars_per_word": 0, "vocab": {"a": 0, "##b": huge}}),
            json!({"type": "WordLevel", "vocab": {"a": 5, "b": 4000000000u64},
                   "unk_token": "<unk>"}),
            json!({"type": "Unigram", "unk_id": 7, "vocab": [["a", -1.0], ["b", 1e300]],
                   "byte_fallback": true}),
            json!({"type": "Unigram", "unk_id": null, "vocab": []}),
            json!({"type": "BPE", "dropout": 1.0, "unk_token": null, "vocab": {"a": 0},
                   "merges": ["a a"]}),
            json!({"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b", "ab ab"],
                   "unk_token": "<nope>", "byte_fallback": true, "fuse_unk": true}),
        ],
        _ => vec![],
    }
}

/// Every leaf and object key outside the vocabulary and merges, as a JSON pointer.
fn settings(value: &Value, at: String, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                let path = format!("{at}/{k}");
                out.push(path.clone());
                if k != "vocab" && k != "merges" {
                    settings(v, path, out);
                }
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                let path = format!("{at}/{i}");
                out.push(path.clone());
                settings(v, path, out);
            }
        }
        _ => {}
    }
}

/// Structural damage that keeps the JSON valid: each setting set to every odd value and
/// removed, each component slot filled with other component types. Every variant is loaded
/// and used; a panic is a finding (caught here so that all are listed at once).
#[test]
fn tokenizer_json_settings() {
    let seed: Value = serde_json::from_slice(&story_tokenizer()).unwrap();
    let mut paths = Vec::new();
    settings(&seed, String::new(), &mut paths);
    let mut variants: Vec<(String, Value)> = Vec::new();
    for path in &paths {
        for odd in common::odd_json_values() {
            let mut v = seed.clone();
            *v.pointer_mut(path).unwrap() = odd.clone();
            variants.push((format!("{path} = {odd:.40}"), v));
        }
        let (parent, key) = path.rsplit_once('/').unwrap();
        let mut v = seed.clone();
        let removed = match v.pointer_mut(parent).unwrap() {
            Value::Object(map) => map.remove(key).is_some(),
            Value::Array(items) => {
                items.remove(key.parse::<usize>().unwrap());
                true
            }
            _ => false,
        };
        if removed {
            variants.push((format!("{path} removed"), v));
        }
    }
    for slot in [
        "normalizer",
        "pre_tokenizer",
        "decoder",
        "post_processor",
        "truncation",
        "padding",
        "model",
    ] {
        for component in other_components(slot) {
            let mut v = seed.clone();
            v[slot] = component.clone();
            variants.push((format!("/{slot} = {component}"), v));
        }
    }
    assert!(variants.len() > 300, "{} variants", variants.len());

    let scratch = ScratchDir::new("headroom-fuzz-tokenizer-json").unwrap();
    let (mut ok, mut errors, mut panics) = (0, 0, Vec::new());
    for (what, v) in &variants {
        let bytes = serde_json::to_vec(v).unwrap();
        match catch_unwind(AssertUnwindSafe(|| load_and_use(&scratch, &bytes))) {
            Ok(Ok(())) => ok += 1,
            Ok(Err(_)) => errors += 1,
            Err(_) => panics.push(what.clone()),
        }
    }
    println!(
        "tokenizer.json settings: {} variants, {ok} ok, {errors} typed errors, {} panics",
        variants.len(),
        panics.len()
    );
    assert!(panics.is_empty(), "panicked on:\n{}", panics.join("\n"));
    assert!(ok > 0 && errors > 0);
}

/// A fuzz campaign of `data build --jsonl` over mutations of `seed` with the tokenizer at
/// `tokenizer` (relative to the crate). Whatever builds must be consistent: the mask covers
/// the token file exactly and counts no more than its tokens.
fn jsonl_campaign(
    name: &str,
    seed: &[&str],
    tokenizer: &str,
    options: headroom_trainer::tokenize::SftOptions,
) {
    use headroom_mmap_data::{formats, loss_mask_path, LossMask, TokenFileFormat, TokenType};
    let seed = seed.join("\n").into_bytes();
    let tokenizer = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(tokenizer);
    let tok = std::sync::Arc::new(Tokenizer::from_name(tokenizer.to_str().unwrap()).unwrap());
    let scratch = ScratchDir::new(&format!("headroom-fuzz-{name}")).unwrap();
    let report = fuzz(
        name,
        &[seed],
        &[],
        iterations(CI_ITERATIONS),
        move |bytes| -> Result<(), headroom_trainer::TrainError> {
            let input = scratch.fresh();
            let out = scratch.fresh();
            let mask = loss_mask_path(&out);
            let _cleanup = Cleanup(vec![input.clone(), out.clone(), mask.clone()]);
            std::fs::write(&input, bytes).unwrap();
            let format = TokenFileFormat::Raw(TokenType::U16);
            let r = headroom_trainer::tokenize::build_prompt_completion_with(
                &input, &tok, format, &out, false, &options,
            )?;
            let ds = formats::open(&out, &Default::default()).unwrap();
            let m = LossMask::open(&mask).unwrap();
            assert_eq!(m.len() as u64, ds.total_tokens());
            assert_eq!((r.tokens, r.counted), (ds.total_tokens(), m.counted()));
            assert!(r.counted <= r.tokens && r.examples > 0);
            Ok(())
        },
    );
    println!("{report}");
    report.assert_clean();
    assert!(report.errors > 0 && report.ok > 0, "{report}");
}

/// `data build --jsonl`'s reader on damaged JSONL: truncated lines, broken quotes and escapes,
/// invalid UTF-8, deep nesting, keys of the wrong type.
#[test]
fn fuzz_prompt_completion_jsonl() {
    let seed = [
        r#"{"prompt": "the small dog", "completion": " sat on the mat."}"#,
        r#"{"prompt": "", "completion": "a \"quoted\" \u00e9 line\n"}"#,
        r#"{"text": "plain text"}"#,
        r#"{"prompt": "the big fox ran near the", "completion": " red log."}"#,
    ];
    jsonl_campaign(
        "sft-jsonl",
        &seed,
        "tests/fixtures/sft/llama-tokenizer.json",
        Default::default(),
    );
}

/// Conversational JSONL with the chat fixture's tokenizer and template: damaged messages
/// (missing roles, wrong types, unknown roles the template refuses, mixed prompt and
/// completion kinds) are typed errors.
#[test]
fn fuzz_conversational_jsonl() {
    let seed = [
        r#"{"prompt": [{"role": "user", "content": "Where did the dog go?"}], "completion": [{"role": "assistant", "content": "To the park."}]}"#,
        r#"{"messages": [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}"#,
        r#"{"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}], "completion": [{"role": "assistant", "content": ""}]}"#,
    ];
    jsonl_campaign(
        "chat-jsonl",
        &seed,
        "tests/fixtures/sft/chat/tokenizer.json",
        Default::default(),
    );
}

/// The same with `assistant_only_loss` through a template with generation blocks (with a
/// message's reasoning and `chat_template_kwargs`), each example cut to its last 24 tokens
/// (TRL's `max_length`, `keep_end`).
#[test]
fn fuzz_assistant_only_jsonl() {
    let seed = [
        r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "reasoning": "r"}]}"#,
        r#"{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "assistant", "content": "b"}], "chat_template_kwargs": {"enable_thinking": false}}"#,
        r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}, {"role": "assistant", "content": ""}]}"#,
    ];
    jsonl_campaign(
        "chat-assistant-jsonl",
        &seed,
        "tests/fixtures/sft/chat-jinja/tokenizer.json",
        headroom_trainer::tokenize::SftOptions {
            assistant_only_loss: true,
            max_length: Some(24),
            truncation: headroom_trainer::tokenize::Truncation::KeepEnd,
            ..Default::default()
        },
    );
}

/// Lines with tools (as a list and as JSON text) through the tool-use template: transformers'
/// `tojson` over damaged schemas and tool calls.
#[test]
fn fuzz_tools_jsonl() {
    let seed = [
        r#"{"messages": [{"role": "user", "content": "w?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"city": "P", "n": 1.5e-7}}}]}, {"role": "tool", "content": "1"}, {"role": "assistant", "content": "ok"}], "tools": [{"type": "function", "function": {"name": "f", "description": "<b> & é", "parameters": {"type": "object", "properties": {"n": {"type": "number"}}}}}]}"#,
        r#"{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}], "tools": "[{\"type\": \"function\", \"function\": {\"name\": \"g\", \"parameters\": {}}}]", "chat_template_kwargs": {"enable_thinking": false}}"#,
    ];
    jsonl_campaign(
        "chat-tools-jsonl",
        &seed,
        "tests/fixtures/sft/chat-jinja/tokenizer.json",
        Default::default(),
    );
}

/// Damaged chat templates: loading and rendering a conversation end in a template or a typed
/// error, never a panic or a hang (rendering runs on fuel).
#[test]
fn fuzz_chat_templates() {
    use headroom_trainer::chat_template::ChatTemplate;
    let config: Value = serde_json::from_slice(
        &std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/sft/chat/tokenizer_config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let conversation: Vec<headroom_trainer::chat_template::ChatValue> = serde_json::from_str(
        r#"[{"role": "system", "content": " s "}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]"#,
    )
    .unwrap();
    // The fixture's template, and templates with the constructs that loop, recurse or raise.
    let fixture = config["chat_template"].as_str().unwrap().to_owned();
    let seeds = [
        fixture.as_str(),
        "{% for m in messages %}{% for i in range(m.content|length) %}{{ loop.index }}{% endfor %}{% endfor %}",
        "{% macro turn(m) %}<|{{ m.role }}|>{{ m.content.strip() }}{% endmacro %}{% for m in messages recursive %}{{ turn(m) }}{% endfor %}{{ raise_exception('x') if not messages }}",
        "{{ bos_token }}{{ messages|tojson }}{% set ns = namespace(n=0) %}{% if add_generation_prompt %}A:{% endif %}",
        // Generation blocks under whitespace control, and tojson's arguments over tools.
        "{% for m in messages %}\n  {%- if m.role == 'assistant' %}\n  {% generation %}\n{{ m.content }}{{ eos_token }}\n  {%+ endgeneration -%}\n{% else %}{{ m.content }}{% endif %}{% endfor %}",
        "{% if tools %}{{ tools|tojson(indent=2, sort_keys=true) }}{{ tools[0]|tojson(true, none, (',', ':')) }}{% endif %}{% generation %}{{ messages|length }}{% endgeneration %}",
    ];
    let tools: Vec<headroom_trainer::chat_template::ChatValue> = serde_json::from_str(
        r#"[{"type": "function", "function": {"name": "f", "parameters": {"x": [1.5, -0.0, 1e300, "é\u0000"]}}}]"#,
    )
    .unwrap();
    let report = fuzz(
        "chat-template",
        &seeds,
        &[],
        iterations(CI_ITERATIONS),
        move |bytes| -> Result<(), headroom_trainer::TrainError> {
            let mut config = config.clone();
            config["chat_template"] = Value::from(String::from_utf8_lossy(bytes).into_owned());
            let text = config.to_string();
            let check = |r: &headroom_trainer::chat_template::Rendered| {
                assert!(r.text.len() <= headroom_trainer::chat_template::MAX_RENDERED_BYTES);
                // The spans of generation blocks are in order, inside the text, on character
                // boundaries.
                let mut end = 0;
                for span in &r.generation {
                    assert!(end <= span.start && span.start <= span.end);
                    assert!(r.text.is_char_boundary(span.start));
                    assert!(r.text.is_char_boundary(span.end));
                    end = span.end;
                }
                assert!(end <= r.text.len());
            };
            if let Some(t) = ChatTemplate::from_config(&text, "tokenizer_config.json")? {
                // The final message continued: refused or cut, never a panic; what is left
                // holds its spans.
                let continued = t.render_request(&headroom_trainer::chat_template::ChatRequest {
                    messages: &conversation,
                    continue_final_message: Some("content"),
                    ..Default::default()
                });
                if let Ok(r) = &continued {
                    check(r);
                }
                for generation_prompt in [false, true] {
                    let r = t.render_request(&headroom_trainer::chat_template::ChatRequest {
                        messages: &conversation,
                        add_generation_prompt: generation_prompt,
                        tools: generation_prompt.then_some(tools.as_slice()),
                        ..Default::default()
                    })?;
                    check(&r);
                }
            }
            Ok(())
        },
    );
    println!("{report}");
    report.assert_clean();
    assert!(report.errors > 0 && report.ok > 0, "{report}");
}
