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

/// `make_sft_fixture.py`'s fixture.
fn sft_fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("sft/trl_sft.json")).unwrap())
        .unwrap()
}

/// The fixture's prompt-completion then text examples, as JSONL lines.
fn prompt_completion_and_text_lines(fixture: &Value) -> Vec<String> {
    fixture["prompt_completion"]
        .as_array()
        .unwrap()
        .iter()
        .chain(fixture["text"].as_array().unwrap())
        .map(Value::to_string)
        .collect()
}

/// The examples of a fixture list, as JSONL lines.
fn lines_of(examples: &Value) -> Vec<String> {
    examples
        .as_array()
        .unwrap()
        .iter()
        .map(Value::to_string)
        .collect()
}

/// TRL's ids and loss flags of the row lists `keys` of `trl`, one after another.
fn trl_stream_of(trl: &Value, keys: &[&str]) -> (Vec<u32>, Vec<bool>) {
    let rows: Vec<Value> = keys
        .iter()
        .flat_map(|k| trl[*k].as_array().unwrap())
        .cloned()
        .collect();
    trl_stream(&rows)
}

/// TRL's ids and loss flags of the prompt-completion then text examples with one tokenizer
/// (`trl`: its entry).
fn prompt_completion_and_text_stream(trl: &Value) -> (Vec<u32>, Vec<bool>) {
    trl_stream_of(trl, &["prompt_completion", "text"])
}

#[test]
fn prompt_completion_examples_get_trls_ids_and_labels() {
    let fixture = sft_fixture();
    let lines = prompt_completion_and_text_lines(&fixture);
    let tokenizers = [
        ("bpe", fixtures().join("tokenizer/tokenizer.json")),
        ("llama", fixtures().join("sft/llama-tokenizer.json")),
    ];
    for (name, file) in tokenizers {
        let (want_ids, want_flags) =
            prompt_completion_and_text_stream(&fixture["tokenizers"][name]);

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

/// A tokenizer whose `tokenizer_config.json` names an end of turn as `eos_token` (an instruct
/// model's `<|im_end|>`, beside the vocabulary's `</s>`): TRL ends text and prompt-completion
/// examples with that token, loaded as transformers' `AutoTokenizer` loads the directory, and
/// so does `data build --jsonl`.
#[test]
fn examples_end_with_the_configured_eos_token() {
    let fixture = sft_fixture();
    let lines = prompt_completion_and_text_lines(&fixture);
    let trl = &fixture["tokenizers"]["eos_config"];
    let (want_ids, want_flags) = prompt_completion_and_text_stream(trl);
    let file = fixtures().join("sft/eos-config/tokenizer.json");
    let (got, flags, _) = build(&lines, &file);
    assert_eq!((got, flags), (want_ids, want_flags));
    let tok = Tokenizer::from_name(file.to_str().unwrap()).unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    assert_eq!(tok.eos_token().unwrap(), Some(im_end));
    assert_ne!(
        tok.end_of_text(),
        Some(im_end),
        "the separator is another token"
    );
    // TRL's eos_token setting replaces the configured one; a token the vocabulary lacks is
    // refused.
    let text = lines_of(&fixture["text"]);
    let (want_ids, want_flags) = trl_stream(trl["text_eos_token"].as_array().unwrap());
    let with = |eos: &str| headroom_trainer::tokenize::SftOptions {
        eos_token: Some(eos.into()),
        ..Default::default()
    };
    assert_eq!(
        {
            let (ids, flags, _) = build_with(&text, &file, &with("</s>"));
            (ids, flags)
        },
        (want_ids, want_flags)
    );
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("x.jsonl");
    std::fs::write(&input, &text[0]).unwrap();
    let e = headroom_trainer::tokenize::build_prompt_completion_with(
        &input,
        &tok,
        TokenFileFormat::Raw(TokenType::U16),
        &dir.path().join("x.bin"),
        false,
        &with("<|nowhere|>"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("<|nowhere|>") && e.contains("not in the vocabulary"),
        "{e}"
    );
    // A configured eos_token the vocabulary lacks is refused by name.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(&file, dir.path().join("tokenizer.json")).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "<|missing|>"}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_name(dir.path().join("tokenizer.json").to_str().unwrap()).unwrap();
    let e = tok.eos_token().unwrap_err().to_string();
    assert!(e.contains("<|missing|>"), "{e}");
}

/// TRL's `dataset_text_field`: language-modelling lines whose text is under another key (a
/// `text` beside it is ignored) get TRL's ids and labels; a line without the key is refused by
/// name.
#[test]
fn a_dataset_text_field_reads_another_key_as_trl_does() {
    let fixture = sft_fixture();
    let lines = lines_of(&fixture["content"]);
    let options = headroom_trainer::tokenize::SftOptions {
        text_field: Some("content".into()),
        ..Default::default()
    };
    for (name, file) in [
        ("bpe", fixtures().join("tokenizer/tokenizer.json")),
        ("llama", fixtures().join("sft/llama-tokenizer.json")),
    ] {
        let rows = fixture["tokenizers"][name]["content"].as_array().unwrap();
        let (want_ids, want_flags) = trl_stream(rows);
        let (got, flags, _) = build_with(&lines, &file, &options);
        assert_eq!((got, flags), (want_ids, want_flags), "{name}");
    }
    // Prompt-completion lines do not read it; a language-modelling line without it is refused.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("x.jsonl");
    std::fs::write(
        &input,
        "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"text\": \"t\"}\n",
    )
    .unwrap();
    let tok = Tokenizer::from_name(
        fixtures()
            .join("tokenizer/tokenizer.json")
            .to_str()
            .unwrap(),
    )
    .unwrap();
    let e = headroom_trainer::tokenize::build_prompt_completion_with(
        &input,
        &tok,
        TokenFileFormat::Raw(TokenType::U16),
        &dir.path().join("x.bin"),
        false,
        &options,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("line 2") && e.contains("no \"content\""), "{e}");
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
    build_with(lines, tokenizer, &Default::default())
}

/// [`build`] with options.
fn build_with(
    lines: &[String],
    tokenizer: &Path,
    options: &headroom_trainer::tokenize::SftOptions,
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
    let report = headroom_trainer::tokenize::build_prompt_completion_with(
        &input, &tok, format, &out, false, options,
    )
    .unwrap();
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

    let (want_ids, want_flags) = trl_stream_of(&fixture["trl"], &["prompt_completion", "messages"]);
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

    // TRL's eos_token setting: the template renders it as `eos_token`, and it would end a
    // text example; TRL's ids and labels with eos_token="<|user|>".
    let (want_ids, want_flags) = trl_stream_of(
        &fixture["trl"],
        &["prompt_completion_eos_token", "messages_eos_token"],
    );
    let options = headroom_trainer::tokenize::SftOptions {
        eos_token: Some("<|user|>".into()),
        ..Default::default()
    };
    let (got, flags, _) = build_with(&lines, &dir.join("tokenizer.json"), &options);
    assert_eq!((got, flags), (want_ids, want_flags), "eos_token <|user|>");
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
        // transformers passes a message without content on; this template needs it.
        (r#"{"messages": [{"role": "user"}]}"#, "undefined"),
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

/// transformers' `continue_final_message` (`make_chat_sft_fixture.py`): with each style
/// template and one that writes reasoning and content blocks, the rendered text ends where the
/// final message's text (content, a content block, or reasoning under each of its names) ends;
/// where the template trims or changes that text, or lacks the field, it is an error in both.
#[test]
fn continued_final_messages_end_where_transformers_ends_them() {
    use headroom_trainer::chat_template::{ChatRequest, ChatTemplate, ChatValue};
    let (fixture, ordered) = chat_fixture();
    let styles = &fixture["styles"];
    let continued = &fixture["continued"];
    let ChatValue::Array(cases) = field(&field(&ordered, "continued"), "cases") else {
        panic!("cases")
    };
    let mut failures = Vec::new();
    let (mut texts, mut errors) = (0, 0);
    for (i, case) in cases.iter().enumerate() {
        let want = &continued["cases"][i];
        let name = want["template"].as_str().unwrap();
        let mut config = styles["special_tokens"].clone();
        config["chat_template"] = styles["templates"]
            .get(name)
            .unwrap_or(&continued["templates"][name])
            .clone();
        let chat = ChatTemplate::from_config(&config.to_string(), name)
            .unwrap()
            .unwrap()
            .with_fixed_time(styles["frozen_time"].as_i64().unwrap());
        let ChatValue::Array(messages) = field(case, "messages") else {
            panic!("messages")
        };
        let got = chat.render_request(&ChatRequest {
            messages: &messages,
            continue_final_message: want["field"].as_str(),
            ..Default::default()
        });
        match (&got, want["text"].as_str()) {
            (Ok(r), Some(text)) if r.text == text => texts += 1,
            (Err(_), None) => errors += 1,
            _ => failures.push(format!("case {i} ({name}): {got:?} vs {want}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Both outcomes are exercised: most cases continue, a few are refused.
    assert!(
        texts >= 15 && errors >= 3,
        "{texts} continued, {errors} refused"
    );
}

/// The chat fixture, its objects' keys in the file's order ([`ChatValue`]) and as
/// `serde_json::Value`.
fn chat_fixture() -> (Value, headroom_trainer::chat_template::ChatValue) {
    let text = std::fs::read_to_string(fixtures().join("sft/chat/trl_chat_sft.json")).unwrap();
    (
        serde_json::from_str(&text).unwrap(),
        serde_json::from_str(&text).unwrap(),
    )
}

/// `v[key]` of an ordered fixture value.
fn field(
    v: &headroom_trainer::chat_template::ChatValue,
    key: &str,
) -> headroom_trainer::chat_template::ChatValue {
    use headroom_trainer::chat_template::ChatValue;
    match v {
        ChatValue::Object(o) => o.iter().find(|(k, _)| k == key).unwrap().1.clone(),
        ChatValue::Array(a) => a[key.parse::<usize>().unwrap()].clone(),
        _ => panic!("{key}: not an object or array"),
    }
}

fn items(
    v: &headroom_trainer::chat_template::ChatValue,
) -> Vec<headroom_trainer::chat_template::ChatValue> {
    match v {
        headroom_trainer::chat_template::ChatValue::Array(a) => a.clone(),
        _ => panic!("not an array"),
    }
}

/// A tokenizer directory as transformers 5 saves it (`chat_template.jinja`, and
/// `additional_chat_templates/tool_use.jinja` beside it; none in `tokenizer_config.json`):
/// both templates load, the tool-use one renders a conversation given tools (transformers'
/// choice), with transformers' `tojson` and a `chat_template_kwargs` variable, and the default
/// one a conversation without.
#[test]
fn a_transformers_5_tokenizer_directory_renders_with_its_named_templates() {
    use headroom_trainer::chat_template::ChatRequest;
    let (fixture, ordered) = chat_fixture();
    let dir = fixtures().join("sft/chat-jinja");
    let config = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    assert!(
        !config.contains("chat_template"),
        "the template is in its own file"
    );
    let tok = Tokenizer::from_name(dir.to_str().unwrap()).unwrap();
    let chat = tok.chat_template().unwrap().expect("chat_template.jinja");
    assert_eq!(chat.names().collect::<Vec<_>>(), ["default", "tool_use"]);
    assert!(chat.has_generation_blocks());
    let jinja = field(&ordered, "jinja");
    let tools = items(&field(&field(&jinja, "tools"), "tools"));
    let conversation = items(&field(
        &field(&field(&field(&jinja, "examples"), "tools"), "0"),
        "messages",
    ));
    let no_thinking = [(
        "enable_thinking".to_owned(),
        headroom_trainer::chat_template::ChatValue::Bool(false),
    )];
    let with_tools = chat
        .render_request(&ChatRequest {
            messages: &conversation,
            add_generation_prompt: true,
            tools: Some(&tools),
            extra: &no_thinking,
            ..Default::default()
        })
        .unwrap();
    let want = &fixture["jinja"]["tools"]["rendered"];
    assert_eq!(with_tools.text, want["with_tools"].as_str().unwrap());
    // The tool-use template has no generation blocks.
    assert!(with_tools.generation.is_empty());
    let without = chat.render(&conversation[..1], false).unwrap();
    assert_eq!(without, want["without_tools"].as_str().unwrap());
}

/// transformers' `tojson` (Python's `json.dumps`): its spacing, `indent` as a number or a
/// string, `separators`, `sort_keys`, `ensure_ascii` (surrogate pairs), positional
/// arguments, no HTML escaping, and Python's float spellings (`1e+16`, `1e-05`, `-0.0`).
#[test]
fn tojson_writes_what_transformers_tojson_writes() {
    use headroom_trainer::chat_template::{ChatRequest, ChatTemplate, ChatValue};
    let (fixture, _) = chat_fixture();
    let case = &fixture["jinja"]["tojson"];
    let config = serde_json::json!({"chat_template": case["template"]});
    let chat = ChatTemplate::from_config(&config.to_string(), "tojson")
        .unwrap()
        .unwrap();
    let values: ChatValue = serde_json::from_str(case["values"].as_str().unwrap()).unwrap();
    let user: Vec<ChatValue> = vec![serde_json::json!({"role": "user", "content": "x"}).into()];
    let got = chat
        .render_request(&ChatRequest {
            messages: &user,
            extra: &[("values".to_owned(), values)],
            ..Default::default()
        })
        .unwrap()
        .text;
    let want = fixture["jinja"]["tools"]["rendered"]["tojson"]
        .as_str()
        .unwrap();
    for (g, w) in got.lines().zip(want.lines()) {
        assert_eq!(g, w);
    }
    assert_eq!(got, want);
}

/// `{% generation %}` blocks under every kind of whitespace control around their tags give
/// transformers' rendered text, and over the tokens' offsets its `return_assistant_tokens_mask`
/// (with a Metaspace BPE, and with a byte-level BPE whose tokens split multi-byte characters
/// and whose offsets are trimmed of spaces); and TRL's verdict on whether the end of turn is
/// inside the blocks.
#[test]
fn generation_blocks_give_transformers_assistant_masks() {
    use headroom_trainer::chat_template::{ChatRequest, ChatTemplate};
    use headroom_trainer::tokenize::stop_token_counted;
    let (fixture, ordered) = chat_fixture();
    let generation = &fixture["jinja"]["generation"];
    let conversations = items(&field(
        &field(&field(&ordered, "jinja"), "generation"),
        "conversations",
    ));
    let tokenizers = [
        (
            "chat",
            fixtures().join("sft/chat-jinja/tokenizer.json"),
            serde_json::json!({"bos_token": "<s>", "eos_token": "</s>"}),
        ),
        (
            "bpe",
            fixtures().join("tokenizer/tokenizer.json"),
            serde_json::json!({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}),
        ),
    ];
    let mut checked = 0;
    let mut differ_with_eos = 0;
    for (tok_name, file, tokens) in tokenizers {
        let tok = Tokenizer::from_name(file.to_str().unwrap()).unwrap();
        for (name, template) in generation["templates"].as_object().unwrap() {
            let mut config = tokens.clone();
            config["chat_template"] = template.clone();
            let chat = ChatTemplate::from_config(&config.to_string(), name)
                .unwrap()
                .unwrap();
            assert!(chat.has_generation_blocks(), "{name}");
            let want = &generation["rendered"][tok_name][name];
            for (c, conversation) in conversations.iter().enumerate() {
                let what = format!("{tok_name} {name} conversation {c}");
                let r = chat
                    .render_request(&ChatRequest {
                        messages: &items(conversation),
                        ..Default::default()
                    })
                    .unwrap();
                let row = &want["renders"][c];
                assert_eq!(r.text, row["text"].as_str().unwrap(), "{what}");
                let (ids, mask) = tok.encode_marking(&r.text, &r.generation).unwrap();
                let want_ids: Vec<u32> = serde_json::from_value(row["input_ids"].clone()).unwrap();
                let want_mask: Vec<u8> =
                    serde_json::from_value(row["assistant_masks"].clone()).unwrap();
                assert_eq!(ids, want_ids, "{what}");
                let mask: Vec<u8> = mask.into_iter().map(u8::from).collect();
                assert_eq!(mask, want_mask, "{what}");
                checked += 1;
            }
            assert_eq!(
                stop_token_counted(&tok, &chat, None).unwrap(),
                want["stop_token_trained"].as_bool().unwrap(),
                "{tok_name} {name}"
            );
            // TRL's eos_token setting (make_chat_sft_fixture.py's PLAIN_EOS), which the
            // template renders: a plain word ends no turn.
            let with_eos = want["stop_token_trained_with_eos"].as_bool().unwrap();
            assert_eq!(
                stop_token_counted(&tok, &chat, Some("ree")).unwrap(),
                with_eos,
                "{tok_name} {name} with eos_token"
            );
            differ_with_eos += usize::from(with_eos != want["stop_token_trained"]);
        }
    }
    assert_eq!(checked, 2 * 5 * 3);
    // The setting decides some of them: the check reads it.
    assert!(differ_with_eos >= 2, "{differ_with_eos}");
}

/// `data build --jsonl --assistant-only-loss` gives TRL's ids and labels with
/// `assistant_only_loss=True`: of conversations, only the tokens of the assistant's turns
/// count (a message's `reasoning` reaches the template as `reasoning_content`); of
/// prompt-completion conversations, only the assistant's tokens of the completion. Examples
/// with `tools` (as JSON text or as a list) and `chat_template_kwargs` get TRL's ids too.
#[test]
fn assistant_only_loss_and_tools_get_trls_ids_and_labels() {
    use headroom_trainer::tokenize::SftOptions;
    let (fixture, _) = chat_fixture();
    let jinja = &fixture["jinja"];
    let tokenizer = fixtures().join("sft/chat-jinja/tokenizer.json");
    let run = |lines: &[String], assistant_only_loss: bool, count_prompts: bool| {
        let options = SftOptions {
            assistant_only_loss,
            count_prompts,
            ..Default::default()
        };
        build_with(lines, &tokenizer, &options)
    };
    for set in [
        "assistant_only_loss_messages",
        "assistant_only_loss_prompt_completion",
    ] {
        // The lines in the file's key order, as a JSONL file of them would be.
        let lines = lines_of(&jinja["examples"][set]);
        let (want_ids, want_flags) = trl_stream(jinja["trl"][set].as_array().unwrap());
        let (ids, flags, report) = run(&lines, true, false);
        assert_eq!(ids, want_ids, "{set}: ids");
        assert_eq!(flags, want_flags, "{set}: flags");
        assert_eq!(report.stop_token_counted, Some(true));
        assert!(
            flags.iter().any(|f| !f) && flags.iter().any(|f| *f),
            "{set}"
        );
    }
    // TRL's completion_only_loss=False: the prompt counts too; with assistant_only_loss, the
    // prompt's assistant turns.
    let prompt_completion = lines_of(&fixture["prompt_completion"]);
    let aol = lines_of(&jinja["examples"]["assistant_only_loss_prompt_completion"]);
    for (lines, assistant_only, set) in [
        (
            &prompt_completion,
            false,
            "prompt_completion_counting_prompts",
        ),
        (&aol, true, "assistant_only_loss_counting_prompts"),
    ] {
        let (want_ids, want_flags) = trl_stream(jinja["trl"][set].as_array().unwrap());
        let (ids, flags, _) = run(lines, assistant_only, true);
        assert_eq!(ids, want_ids, "{set}: ids");
        assert_eq!(flags, want_flags, "{set}: flags");
    }
    let tools = jinja["examples"]["tools"].as_array().unwrap();
    let (want_ids, want_flags) = trl_stream(jinja["trl"]["tools"].as_array().unwrap());
    let as_text: Vec<String> = tools.iter().map(Value::to_string).collect();
    // The tools as a list, their keys in the order written (a serde_json::Value would sort
    // them, and transformers' tojson keeps the order).
    let as_list: Vec<String> = tools
        .iter()
        .map(|ex| {
            use headroom_trainer::chat_template::ChatValue;
            let list: ChatValue = serde_json::from_str(ex["tools"].as_str().unwrap()).unwrap();
            let mut line: ChatValue = serde_json::from_str(&ex.to_string()).unwrap();
            if let ChatValue::Object(o) = &mut line {
                o.iter_mut().find(|(k, _)| k == "tools").unwrap().1 = list;
            }
            serde_json::to_string(&line).unwrap()
        })
        .collect();
    for lines in [as_text, as_list] {
        let (ids, flags, report) = run(&lines, false, false);
        assert_eq!(ids, want_ids, "tools: ids");
        assert_eq!(flags, want_flags, "tools: flags");
        assert_eq!(report.stop_token_counted, None);
    }
}

/// What `assistant_only_loss` refuses, each as an error naming the cause: a template without
/// generation blocks, an example that is not conversational, a conversation with no assistant
/// token, a conversation holding the generation markers' characters, nested blocks; and a
/// template file given in place of the tokenizer's (`--chat-template`).
#[test]
fn assistant_only_loss_refuses_what_it_cannot_mask() {
    use headroom_trainer::chat_template::ChatTemplate;
    use headroom_trainer::tokenize::{build_prompt_completion_with, SftOptions};
    let tmp = tempfile::tempdir().unwrap();
    let format = TokenFileFormat::Raw(TokenType::U16);
    let jinja_dir = fixtures().join("sft/chat-jinja");
    let build = |tokenizer: &Path, template: Option<ChatTemplate>, line: &str| {
        let input = tmp.path().join("x.jsonl");
        let ok = r#"{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}"#;
        std::fs::write(&input, format!("{ok}\n{line}\n")).unwrap();
        let tok = Tokenizer::from_name(tokenizer.to_str().unwrap()).unwrap();
        let options = SftOptions {
            assistant_only_loss: true,
            chat_template: template,
            ..Default::default()
        };
        build_prompt_completion_with(
            &input,
            &tok,
            format,
            &tmp.path().join("o.bin"),
            false,
            &options,
        )
        .map_err(|e| e.to_string())
    };
    // The old directory's template has no generation blocks.
    let e = build(&fixtures().join("sft/chat/tokenizer.json"), None, "").unwrap_err();
    assert!(
        e.contains("{% generation %}") && e.contains("--chat-template"),
        "{e}"
    );
    // The same tokenizer with a template file that has them.
    let file = tmp.path().join("training.jinja");
    std::fs::write(
        &file,
        std::fs::read_to_string(jinja_dir.join("chat_template.jinja")).unwrap(),
    )
    .unwrap();
    let chat = fixtures().join("sft/chat/tokenizer.json");
    let tok = Tokenizer::from_name(chat.to_str().unwrap()).unwrap();
    let from_file = tok.chat_template_from(&file).unwrap();
    assert_eq!(from_file.special_token("eos_token"), Some("</s>"));
    let r = build(&chat, Some(from_file.clone()), "").unwrap();
    assert!(r.counted > 0 && r.counted < r.tokens, "{r:?}");
    for (line, needle) in [
        (r#"{"text": "plain"}"#, "conversational"),
        (
            r#"{"messages": [{"role": "user", "content": "only me"}]}"#,
            "no token",
        ),
        (
            "{\"messages\": [{\"role\": \"assistant\", \"content\": \"\u{FDD1}x\u{FDD0}\"}]}",
            "U+FDD0",
        ),
    ] {
        let e = build(&chat, Some(from_file.clone()), line).unwrap_err();
        assert!(e.contains("line 2") && e.contains(needle), "{line}: {e}");
    }
    let nested = tmp.path().join("nested.jinja");
    std::fs::write(
        &nested,
        "{% for m in messages %}{% generation %}{% generation %}{{ m.content }}\
         {% endgeneration %}{% endgeneration %}{% endfor %}",
    )
    .unwrap();
    let nested = tok.chat_template_from(&nested).unwrap();
    let e = build(&chat, Some(nested), "").unwrap_err();
    assert!(e.contains("inside another"), "{e}");
}

/// Template files beside a tokenizer take the place of `tokenizer_config.json`'s template, as
/// in transformers; damaged ones are errors naming the file, and a directory of them is
/// bounded.
#[test]
fn template_files_beside_a_tokenizer_are_read_as_transformers_reads_them() {
    use headroom_trainer::chat_template::{ChatTemplate, MAX_NAMED_TEMPLATES};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let tokenizer = dir.join("tokenizer.json");
    std::fs::copy(fixtures().join("sft/chat/tokenizer.json"), &tokenizer).unwrap();
    std::fs::copy(
        fixtures().join("sft/chat/tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    let user: Vec<headroom_trainer::chat_template::ChatValue> =
        serde_json::from_str(r#"[{"role": "user", "content": "hi"}]"#).unwrap();
    let render = || -> Result<String, String> {
        let t = ChatTemplate::beside(&tokenizer).map_err(|e| e.to_string())?;
        t.unwrap().render(&user, false).map_err(|e| e.to_string())
    };
    // The configuration's template, then the file's in its place (its special tokens kept).
    assert!(render().unwrap().starts_with("<s><|system|>"));
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ eos_token }}{{ messages[0].content }}",
    )
    .unwrap();
    assert_eq!(render().unwrap(), "</s>hi");
    std::fs::write(dir.join("chat_template.jinja"), [0xff, 0xfe]).unwrap();
    assert!(render().unwrap_err().contains("chat_template.jinja"));
    std::fs::write(dir.join("chat_template.jinja"), "{% for %}").unwrap();
    assert!(render().unwrap_err().contains("default"));
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    // Named templates alone: no default for a conversation without tools.
    let named = dir.join("additional_chat_templates");
    std::fs::create_dir(&named).unwrap();
    std::fs::write(named.join("tool_use.jinja"), "T").unwrap();
    assert!(render().unwrap_err().contains("none named"));
    // Two templates of 33 MiB (sparse files of NULs): each within a file's bound, together
    // over it.
    for name in ["a.jinja", "b.jinja"] {
        let f = std::fs::File::create(named.join(name)).unwrap();
        f.set_len(33 << 20).unwrap();
    }
    let e = render().unwrap_err();
    assert!(e.contains("b.jinja"), "{e}");
    for i in 0..MAX_NAMED_TEMPLATES {
        std::fs::write(named.join(format!("t{i}.jinja")), "x").unwrap();
    }
    assert!(render().unwrap_err().contains("more than"));
}

/// TRL's `max_length` and `truncation_mode`: each example cut to 16 tokens from its start or
/// its end, and those left with no counted token left out (five of seven from the start, where
/// the prompts fill the 16 tokens); the same ids and flags as TRL's.
#[test]
fn max_length_cuts_and_drops_examples_as_trl_does() {
    use headroom_trainer::tokenize::{SftOptions, Truncation};
    let (fixture, _) = chat_fixture();
    let lines: Vec<String> = fixture["prompt_completion"]
        .as_array()
        .unwrap()
        .iter()
        .chain(fixture["messages"].as_array().unwrap())
        .map(Value::to_string)
        .collect();
    let tokenizer = fixtures().join("sft/chat-jinja/tokenizer.json");
    for (truncation, set, dropped) in [
        (Truncation::KeepStart, "keep_start_16", 5),
        (Truncation::KeepEnd, "keep_end_16", 0),
    ] {
        let options = SftOptions {
            max_length: Some(16),
            truncation,
            ..Default::default()
        };
        let (ids, flags, report) = build_with(&lines, &tokenizer, &options);
        let (want_ids, want_flags) = trl_stream(fixture["jinja"]["trl"][set].as_array().unwrap());
        assert_eq!(ids, want_ids, "{set}: ids");
        assert_eq!(flags, want_flags, "{set}: flags");
        assert_eq!((report.truncated, report.dropped), (7, dropped), "{set}");
    }
    // Nothing left is an error, not an empty file; so is a length of 0.
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("x.jsonl");
    std::fs::write(&input, lines[..5].join("\n")).unwrap();
    let tok = Tokenizer::from_name(tokenizer.to_str().unwrap()).unwrap();
    for (max, needle) in [(3, "no example has a counted token"), (0, "length of 0")] {
        let options = SftOptions {
            max_length: Some(max),
            ..Default::default()
        };
        let out = tmp.path().join("o.bin");
        let format = TokenFileFormat::Raw(TokenType::U16);
        let e = headroom_trainer::tokenize::build_prompt_completion_with(
            &input, &tok, format, &out, false, &options,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(needle), "{max}: {e}");
    }
}

/// `--pad`: every example padded to `max_length`, so that the trainer's windows (stride
/// `seq`, from token 0) hold one example each from position 0, TRL's padded batches: TRL's ids
/// then padding, TRL's labels but for the first token (no window's target; TRL's shift never
/// uses it) and the padding; one token past the last example for its last target.
#[test]
fn padded_examples_sit_one_per_training_window() {
    use headroom_mmap_data::{SamplerConfig, SamplingMode, Shard, WindowSampler};
    use headroom_trainer::tokenize::SftOptions;
    let (fixture, _) = chat_fixture();
    let jinja = &fixture["jinja"];
    let lines = lines_of(&jinja["examples"]["assistant_only_loss_messages"]);
    let rows = jinja["trl"]["assistant_only_loss_messages"]
        .as_array()
        .unwrap();
    const N: usize = 100;
    let options = SftOptions {
        assistant_only_loss: true,
        max_length: Some(N),
        pad: true,
        ..Default::default()
    };
    let tokenizer = fixtures().join("sft/chat-jinja/tokenizer.json");
    let (ids, flags, report) = build_with(&lines, &tokenizer, &options);
    assert_eq!(ids.len(), rows.len() * N + 1);
    assert_eq!((report.truncated, report.dropped), (0, 0));
    let eot = Tokenizer::from_name(tokenizer.to_str().unwrap())
        .unwrap()
        .end_of_text()
        .unwrap();
    for (k, row) in rows.iter().enumerate() {
        let (mut want_ids, mut want_flags) = trl_stream(std::slice::from_ref(row));
        assert!(want_ids.len() < N, "example {k} needs padding");
        want_flags[0] = false;
        want_ids.resize(N, eot);
        want_flags.resize(N, false);
        assert_eq!(ids[k * N..(k + 1) * N], want_ids, "example {k}");
        assert_eq!(flags[k * N..(k + 1) * N], want_flags, "example {k}");
    }
    // The trainer's sampler cuts exactly one window per example, at its start.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("padded.bin");
    let raw: Vec<u8> = ids.iter().flat_map(|&i| (i as u16).to_le_bytes()).collect();
    std::fs::write(&file, raw).unwrap();
    let ds = formats::open(&file, &Default::default()).unwrap();
    let sampler = WindowSampler::new(
        &ds,
        SamplerConfig {
            mode: SamplingMode::EpochWindows,
            seq_len: N as u64,
            seed: 7,
            shard: Shard::SINGLE,
        },
    )
    .unwrap();
    assert_eq!(sampler.total_windows(), rows.len() as u64);
    for g in 0..rows.len() as u64 {
        assert_eq!(sampler.global_window(g).start, g * N as u64);
    }
}

fn packing_fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("sft/trl_packing.json")).unwrap())
        .unwrap()
}

fn numbers(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

/// TRL's best-fit decreasing (`trl.data_utils.pack_dataset(..., "bfd")`), row for row and
/// example for example, on 300 lengths with many ties (`benches/torch/make_pack_fixture.py`).
#[test]
fn best_fit_decreasing_places_examples_as_trl() {
    let bfd = &packing_fixture()["bfd"];
    let capacity = bfd["capacity"].as_u64().unwrap() as usize;
    let lengths: Vec<usize> = numbers(&bfd["lengths"])
        .iter()
        .map(|&n| n as usize)
        .collect();
    let want: Vec<Vec<usize>> = bfd["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| numbers(r).iter().map(|&i| i as usize).collect())
        .collect();
    let got = headroom_trainer::tokenize::best_fit_decreasing(&lengths, capacity);
    assert_eq!(got, want);
    assert!(got
        .iter()
        .all(|r| r.iter().map(|&i| lengths[i]).sum::<usize>() <= capacity));
}

/// `data build --jsonl --max-length 128 --pack`: TRL's packed rows (`SFTConfig(packing=True)`)
/// — the same examples in the same rows and order, their ids, and their flags (TRL's labels,
/// with each example's first token left out as TRL's padding-free collator does) — each row
/// padded to 128 with one uncounted document, as the Megatron index records.
#[test]
fn packed_rows_are_trls() {
    let (report, input, dir) = packs_as_trl("sft");
    assert_eq!(report.packed_uncounted, 0);
    // Without the Megatron format there is no index to record the examples: refused.
    let options = headroom_trainer::tokenize::SftOptions {
        max_length: Some(128),
        pack: Some(headroom_trainer::tokenize::PackStrategy::Bfd),
        ..Default::default()
    };
    let tok = Tokenizer::from_name(fixtures().join("sft/chat").to_str().unwrap()).unwrap();
    let raw = headroom_trainer::tokenize::build_prompt_completion_with(
        &input,
        &tok,
        TokenFileFormat::Raw(TokenType::U16),
        &dir.path().join("raw.bin"),
        false,
        &options,
    )
    .unwrap_err();
    assert!(raw.to_string().contains("Megatron"), "{raw}");
}

/// Examples longer than a row (`sft_long`: rows of 64 tokens, prompts of up to 30 words): TRL's
/// packing keeps each one's first 64 tokens and packs those the cut leaves without a counted
/// token rather than dropping them, and so does `--pack`; keep-end, which TRL's packing does
/// not apply, is refused.
#[test]
fn examples_longer_than_a_row_pack_as_trl_packs_them() {
    use headroom_trainer::tokenize::{
        build_prompt_completion_with, PackStrategy, SftOptions, Truncation,
    };
    let (report, input, dir) = packs_as_trl("sft_long");
    // The fixture's examples that TRL packed with no counted label.
    let uncounted = uncounted_pieces("sft_long");
    assert!(uncounted > 0 && report.truncated > uncounted, "{report:?}");
    assert_eq!(report.packed_uncounted, uncounted);
    assert_eq!(report.dropped, 0);
    let tok = Tokenizer::from_name(fixtures().join("sft/chat").to_str().unwrap()).unwrap();
    let options = SftOptions {
        max_length: Some(64),
        pack: Some(PackStrategy::Bfd),
        truncation: Truncation::KeepEnd,
        ..Default::default()
    };
    let format = TokenFileFormat::Megatron {
        token_type: TokenType::U16,
        document_len: 1 << 20,
    };
    let e = build_prompt_completion_with(
        &input,
        &tok,
        format,
        &dir.path().join("end"),
        false,
        &options,
    )
    .unwrap_err();
    assert!(e.to_string().contains("keep-end"), "{e}");
}

/// Pieces of examples that TRL packed with no counted label, in a fixture case's rows.
fn uncounted_pieces(case: &str) -> u64 {
    let rows = packing_fixture()[case]["rows"].clone();
    let mut uncounted = 0;
    for row in rows.as_array().unwrap() {
        let labels = numbers(&row["labels"]);
        let mut at = 0;
        for n in numbers(&row["seq_lengths"]) {
            uncounted += labels[at..at + n as usize].iter().all(|&l| l == -100) as u64;
            at += n as usize;
        }
    }
    uncounted
}

/// `--pack --packing-strategy bfd_split` (`sft_split`: `sft_long`'s examples under TRL's
/// `packing_strategy="bfd_split"`): each example longer than a row split from its start into
/// pieces of the row's length, each packed as an example — TRL's rows, piece for piece, and
/// every token of every example kept.
#[test]
fn long_examples_split_as_trl_splits_them() {
    let (split, _, _) = packs_as_trl("sft_split");
    let (cut, _, _) = packs_as_trl("sft_long");
    // The same examples are longer than a row under both strategies.
    assert_eq!(split.truncated, cut.truncated);
    assert!(split.truncated > 0);
    assert_eq!(split.packed_uncounted, uncounted_pieces("sft_split"));
    assert_eq!(split.dropped, 0);
    // Splitting loses no token: more of them are written and counted than cutting keeps.
    let kept = |r: &headroom_trainer::tokenize::PromptCompletionReport| {
        r.tokens - r.packed.unwrap().padding
    };
    assert!(kept(&split) > kept(&cut), "{split:?} vs {cut:?}");
    assert!(split.counted > cut.counted);
}

/// `data build --jsonl --max-length N --pack` of the fixture's `case` gives TRL's rows, example
/// for example (see [`packed_rows_are_trls`]); the report, the JSONL input and its directory.
fn packs_as_trl(
    case: &str,
) -> (
    headroom_trainer::tokenize::PromptCompletionReport,
    std::path::PathBuf,
    tempfile::TempDir,
) {
    use headroom_trainer::tokenize::{build_prompt_completion_with, PackStrategy, SftOptions};
    let sft = &packing_fixture()[case];
    let strategy = match sft["strategy"].as_str() {
        None | Some("bfd") => PackStrategy::Bfd,
        Some("bfd_split") => PackStrategy::BfdSplit,
        Some(other) => panic!("strategy {other}"),
    };
    let max = sft["max_length"].as_u64().unwrap() as usize;
    let lines = lines_of(&sft["examples"]);
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("sft.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let tok = Tokenizer::from_name(fixtures().join("sft/chat").to_str().unwrap()).unwrap();
    let out = dir.path().join("packed.bin");
    let format = TokenFileFormat::Megatron {
        token_type: TokenType::U16,
        document_len: 1 << 20,
    };
    let options = SftOptions {
        max_length: Some(max),
        pack: Some(strategy),
        ..Default::default()
    };
    let report = build_prompt_completion_with(&input, &tok, format, &out, false, &options).unwrap();
    let ds = formats::open(&out, &Default::default()).unwrap();
    let mask = LossMask::open(loss_mask_path(&out)).unwrap();
    let index = ds.sequence_index(0).unwrap();
    let eot = tok.end_of_text().unwrap();

    let rows = sft["rows"].as_array().unwrap();
    let packed = report.packed.unwrap();
    assert_eq!(packed.rows, rows.len() as u64);
    // Every row is `max` tokens, then one closing token.
    assert_eq!(ds.total_tokens(), (rows.len() * max + 1) as u64);
    let mut document = 0;
    let mut padding = 0;
    for (r, row) in rows.iter().enumerate() {
        let ids = numbers(&row["input_ids"]);
        let labels = numbers(&row["labels"]);
        let lengths = numbers(&row["seq_lengths"]);
        let start = (r * max) as u64;
        // The row's examples, one document each, in TRL's order.
        let mut at = 0usize;
        for &n in &lengths {
            let span = index
                .span(document)
                .unwrap_or_else(|| panic!("row {r}: document {document}"));
            assert_eq!(
                span,
                start + at as u64..start + (at + n as usize) as u64,
                "row {r}"
            );
            document += 1;
            at += n as usize;
        }
        let got: Vec<i64> = (start..start + at as u64)
            .map(|i| ds.token(0, i).unwrap())
            .collect();
        assert_eq!(got, ids, "row {r}: ids");
        let mut first = vec![false; at];
        let mut k = 0;
        for &n in &lengths {
            first[k] = true;
            k += n as usize;
        }
        for i in 0..at {
            let want = labels[i] != -100 && !first[i];
            assert_eq!(
                mask.get(start as usize + i),
                Some(want),
                "row {r} token {i}"
            );
        }
        // The room: one uncounted padding document.
        if at < max {
            assert_eq!(
                index.span(document),
                Some(start + at as u64..start + max as u64)
            );
            document += 1;
            for i in at..max {
                assert_eq!(ds.token(0, start + i as u64), Some(i64::from(eot)));
                assert_eq!(mask.get(start as usize + i), Some(false));
            }
            padding += (max - at) as u64;
        }
    }
    assert_eq!(packed.padding, padding);
    assert_eq!(report.counted, mask.counted());
    (report, input, dir)
}

proptest::proptest! {
    /// Every example is placed exactly once, no row overflows, and rows open in decreasing
    /// order of their first example (examples are placed longest first).
    #[test]
    fn best_fit_decreasing_places_every_example_once(
        lengths in proptest::collection::vec(1usize..50, 0..200),
        capacity in 50usize..80,
    ) {
        let rows = headroom_trainer::tokenize::best_fit_decreasing(&lengths, capacity);
        let mut seen: Vec<usize> = rows.iter().flatten().copied().collect();
        seen.sort_unstable();
        proptest::prop_assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>());
        let used: Vec<usize> = rows.iter().map(|r| r.iter().map(|&i| lengths[i]).sum()).collect();
        proptest::prop_assert!(used.iter().all(|&u| u <= capacity));
        for (k, row) in rows.iter().enumerate().skip(1) {
            let first = lengths[row[0]];
            let earlier_first = lengths[rows[k - 1][0]];
            proptest::prop_assert!(first <= earlier_first);
        }
    }
}
