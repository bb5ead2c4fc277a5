//! `headroom data build --jsonl` against TRL: the token ids and loss flags of TRL's own
//! `SFTTrainer` (its prepared dataset's `input_ids` and `labels`, -100 where a token does not
//! count), written by `benches/torch/make_sft_fixture.py` with TRL 1.16 for a byte-level BPE
//! and a Llama-style tokenizer that adds `<s>`. The examples include an empty prompt, an empty
//! completion, non-ASCII text, and a prompt whose last token merges with the completion's
//! first under the byte-level BPE.

use std::path::{Path, PathBuf};

use headroom_mmap_data::{formats, loss_mask_path, LossMask, TokenFileFormat, TokenType};
use headroom_trainer::tokenize::{build_prompt_completion, Tokenizer};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

#[test]
fn prompt_completion_examples_get_trls_ids_and_labels() {
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("sft/trl_sft.json")).unwrap(),
    )
    .unwrap();
    let lines: Vec<String> = fixture["prompt_completion"]
        .as_array()
        .unwrap()
        .iter()
        .chain(fixture["text"].as_array().unwrap())
        .map(Value::to_string)
        .collect();
    let tokenizers = [
        ("bpe", fixtures().join("tokenizer/tokenizer.json")),
        ("llama", fixtures().join("sft/llama-tokenizer.json")),
    ];
    for (name, file) in tokenizers {
        let trl = &fixture["tokenizers"][name];
        let rows: Vec<Value> = trl["prompt_completion"]
            .as_array()
            .unwrap()
            .iter()
            .chain(trl["text"].as_array().unwrap())
            .cloned()
            .collect();
        let (want_ids, want_flags) = trl_stream(&rows);

        let (got, flags, report) = build(&lines, &file);
        assert_eq!(got, want_ids, "{name}: ids");
        assert_eq!(flags, want_flags, "{name}: loss flags");
        assert_eq!(report.examples, lines.len() as u64);
        assert_eq!(
            report.counted,
            want_flags.iter().filter(|&&f| f).count() as u64
        );
        // The byte-level BPE merges "Hello wor" + "ld …" across the boundary (the flags above
        // show where TRL starts that completion); the Metaspace one cuts before "ld".
        let merges = if name == "bpe" { 1 } else { 0 };
        assert_eq!(report.boundary_merges, merges, "{name}: {report:?}");
    }
}

/// `build_prompt_completion` of `lines` with the tokenizer at `tokenizer`: the token file's
/// ids, its mask's flags and the report.
fn build(
    lines: &[String],
    tokenizer: &Path,
) -> (
    Vec<u32>,
    Vec<bool>,
    headroom_trainer::tokenize::PromptCompletionReport,
) {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("sft.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let tok = Tokenizer::from_name(tokenizer.to_str().unwrap()).unwrap();
    let out = dir.path().join("sft.bin");
    let format = TokenFileFormat::Raw(TokenType::U16);
    let report = build_prompt_completion(&input, &tok, format, &out, false).unwrap();
    let ds = formats::open(&out, &Default::default()).unwrap();
    let ids = (0..ds.total_tokens())
        .map(|i| ds.token(0, i).unwrap() as u32)
        .collect();
    let mask = LossMask::open(loss_mask_path(&out)).unwrap();
    let flags = (0..mask.len()).map(|i| mask.get(i).unwrap()).collect();
    (ids, flags, report)
}

/// TRL's ids and labels (-100 where a token does not count) as one packed stream.
fn trl_stream(rows: &[Value]) -> (Vec<u32>, Vec<bool>) {
    let ids = |v: &Value| -> Vec<i64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect()
    };
    let (mut want_ids, mut want_flags) = (Vec::new(), Vec::new());
    for row in rows {
        let (input, labels) = (ids(&row["input_ids"]), ids(&row["labels"]));
        assert_eq!(input.len(), labels.len());
        for (&i, &l) in input.iter().zip(&labels) {
            assert!(l == -100 || l == i, "TRL's labels are the ids or -100");
            want_ids.push(i as u32);
            want_flags.push(l != -100);
        }
    }
    (want_ids, want_flags)
}

/// Conversational examples (`benches/torch/make_chat_sft_fixture.py`): the chat template in
/// `tokenizer_config.json` renders each conversation as transformers does, and the builder
/// gives TRL's ids and loss flags — the completion of a prompt-completion conversation after
/// the generation prompt, every token of a `messages` conversation, no end-of-text appended.
#[test]
fn conversational_examples_get_trls_rendering_ids_and_labels() {
    use headroom_trainer::chat_template::{ChatTemplate, ChatValue};
    let dir = fixtures().join("sft/chat");
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("trl_chat_sft.json")).unwrap())
            .unwrap();
    let chat = ChatTemplate::beside(&dir.join("tokenizer.json"))
        .unwrap()
        .expect("the fixture's tokenizer_config.json has a template");
    let messages = |v: &Value| -> Vec<ChatValue> {
        v.as_array()
            .unwrap()
            .iter()
            .cloned()
            .map(Into::into)
            .collect()
    };
    let examples = fixture["prompt_completion"].as_array().unwrap();
    for (ex, want) in examples
        .iter()
        .zip(fixture["rendered"]["prompt_completion"].as_array().unwrap())
    {
        let prompt = messages(&ex["prompt"]);
        let whole = [prompt.clone(), messages(&ex["completion"])].concat();
        assert_eq!(chat.render(&prompt, true).unwrap(), want["prompt"]);
        assert_eq!(chat.render(&whole, false).unwrap(), want["whole"]);
    }
    let conversations = fixture["messages"].as_array().unwrap();
    for (ex, want) in conversations
        .iter()
        .zip(fixture["rendered"]["messages"].as_array().unwrap())
    {
        assert_eq!(
            chat.render(&messages(&ex["messages"]), false).unwrap(),
            *want
        );
    }

    let rows: Vec<Value> = fixture["trl"]["prompt_completion"]
        .as_array()
        .unwrap()
        .iter()
        .chain(fixture["trl"]["messages"].as_array().unwrap())
        .cloned()
        .collect();
    let (want_ids, want_flags) = trl_stream(&rows);
    let lines: Vec<String> = examples
        .iter()
        .chain(conversations)
        .map(Value::to_string)
        .collect();
    let (got, flags, report) = build(&lines, &dir.join("tokenizer.json"));
    assert_eq!(got, want_ids, "ids");
    assert_eq!(flags, want_flags, "loss flags");
    assert_eq!(report.examples, lines.len() as u64);
    assert_eq!(report.boundary_merges, 0);
}

/// A conversation needs a template; a template that raises, a message without content and a
/// prompt of messages with a completion of text are errors naming the line.
#[test]
fn conversational_examples_without_a_usable_template_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let format = TokenFileFormat::Raw(TokenType::U16);
    let build = |tokenizer: PathBuf, line: &str| -> String {
        let input = tmp.path().join("bad.jsonl");
        std::fs::write(&input, format!("{{\"text\": \"fine\"}}\n{line}\n")).unwrap();
        let tok = Tokenizer::from_name(tokenizer.to_str().unwrap()).unwrap();
        build_prompt_completion(&input, &tok, format, &tmp.path().join("o.bin"), false)
            .unwrap_err()
            .to_string()
    };
    let conversation = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
    // fixtures/sft holds no tokenizer_config.json: no template.
    let e = build(fixtures().join("sft/llama-tokenizer.json"), conversation);
    assert!(e.contains("line 2") && e.contains("chat template"), "{e}");
    let chat = fixtures().join("sft/chat/tokenizer.json");
    for (line, needle) in [
        (
            r#"{"messages": [{"role": "tool", "content": "x"}]}"#,
            "unknown role tool",
        ),
        (r#"{"messages": [{"role": "user"}]}"#, "content"),
        (
            r#"{"prompt": [{"role": "user", "content": "a"}], "completion": "b"}"#,
            "both text or both messages",
        ),
    ] {
        let e = build(chat.clone(), line);
        assert!(e.contains("line 2") && e.contains(needle), "{line}: {e}");
    }
}

/// Templates in the style of Llama 3.1's, Qwen 2.5's, Mistral's and Gemma's, and one of
/// filters and Python methods, render each conversation as transformers does (its clock
/// frozen for `strftime_now`); `strftime` is Python's `time.strftime` in UTC.
#[test]
fn style_templates_render_as_transformers_renders_them() {
    use headroom_trainer::chat_template::{strftime, ChatTemplate, ChatValue};
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("sft/chat/trl_chat_sft.json")).unwrap(),
    )
    .unwrap();
    let styles = &fixture["styles"];
    let frozen = styles["frozen_time"].as_i64().unwrap();
    // The conversations read again as ChatValue, whose objects keep the file's key order
    // (serde_json::Value sorts keys; Python's dicts, which transformers rendered, do not).
    let ordered: ChatValue = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("sft/chat/trl_chat_sft.json")).unwrap(),
    )
    .unwrap();
    let field = |v: &ChatValue, key: &str| -> ChatValue {
        match v {
            ChatValue::Object(o) => o.iter().find(|(k, _)| k == key).unwrap().1.clone(),
            _ => panic!("not an object"),
        }
    };
    let ChatValue::Array(conversations) = field(&field(&ordered, "styles"), "conversations") else {
        panic!("conversations")
    };
    let mut failures = Vec::new();
    for (name, template) in styles["templates"].as_object().unwrap() {
        let mut config = styles["special_tokens"].clone();
        config["chat_template"] = template.clone();
        let chat = ChatTemplate::from_config(&config.to_string(), name)
            .unwrap()
            .unwrap()
            .with_fixed_time(frozen);
        for (c, conversation) in conversations.iter().enumerate() {
            for (g, want) in styles["rendered"][name][c]
                .as_array()
                .unwrap()
                .iter()
                .enumerate()
            {
                let ChatValue::Array(messages) = conversation else {
                    panic!("a conversation")
                };
                let got = chat.render(messages, g == 1);
                if got.as_deref().ok() != want.as_str() {
                    failures.push(format!(
                        "{name} conversation {c} prompt {g}: {got:?} vs {want}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    for case in fixture["strftime"].as_array().unwrap() {
        let (format, at, want) = (
            case[0].as_str().unwrap(),
            case[1].as_i64().unwrap(),
            &case[2],
        );
        assert_eq!(strftime(format, at).unwrap(), *want, "{format} at {at}");
    }
    assert!(strftime("%Z", 0).is_err() && strftime("%", 0).is_err());
}
