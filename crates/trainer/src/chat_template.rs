//! A Hugging Face chat template: the Jinja program in a tokenizer's `tokenizer_config.json`
//! that turns a conversation (`[{"role": …, "content": …}, …]`) into the text a chat model
//! was trained on, rendered as transformers' `apply_chat_template` renders it.
//!
//! ```
//! use headroom_trainer::chat_template::ChatTemplate;
//! let config = r#"{"chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content.strip() }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
//!                  "eos_token": "</s>"}"#;
//! let chat = ChatTemplate::from_config(config, "tokenizer_config.json").unwrap().unwrap();
//! let messages: Vec<_> = serde_json::from_str(r#"[{"role": "user", "content": " hi "}]"#).unwrap();
//! let text = chat.render(&messages, true).unwrap();
//! assert_eq!(text, "<|user|>hi</s><|assistant|>");
//! ```
//!
//! Where transformers finds it: `chat_template.jinja` and `additional_chat_templates/*.jinja`
//! beside the tokenizer (what transformers 5 saves), else `tokenizer_config.json`'s
//! `chat_template` (a string, or a list of named templates). Of named templates, `tool_use`
//! renders a conversation given tools, `default` any other.
//!
//! The environment is transformers': blocks trimmed (`trim_blocks`, `lstrip_blocks`), loop
//! controls, `raise_exception(message)` (an error naming the template), Python's string and
//! dict methods (`.strip()`, `.startswith()`, `.items()`; minijinja-contrib's `pycompat`),
//! transformers' `tojson` (Python's `json.dumps`: its spacing, `indent`, `separators`,
//! `sort_keys`, `ensure_ascii`, no HTML escaping), the tokenizer's special tokens (`bos_token`,
//! `eos_token`, …) beside `messages`, `tools`, `documents` and `add_generation_prompt`, any
//! further variables ([`ChatRequest::extra`], TRL's `chat_template_kwargs`), and
//! `strftime_now(format)` ([`strftime`] of the current time in UTC where transformers takes
//! local time, or of a fixed time: [`ChatTemplate::with_fixed_time`]). Messages keep their
//! keys' order ([`ChatValue`]), as Python's dicts, and a message's reasoning is offered under
//! `reasoning_content` and `thinking` whichever of those or `reasoning` it came as
//! (transformers 5's aliases).
//!
//! `{% generation %}…{% endgeneration %}` blocks render their body and report where it lies
//! ([`Rendered::generation`]), the spans of transformers' `return_assistant_tokens_mask`
//! (TRL's `assistant_only_loss`). They are rewritten, before parsing, into block tags that
//! write markers (two Unicode noncharacters, refused in inputs) which rendering removes again;
//! the tags' whitespace control (`-`, `+`, `trim_blocks`, `lstrip_blocks`) is kept. One difference: transformers measures
//! a block's start in the output of the template's top level, so a block inside a macro or a
//! `{% set %}` block gets a span there that does not hold its text; here the span is where its
//! text is. Nested blocks are an error.
//!
//! A conversation's final message can be left open for the model to continue, a "prefill"
//! ([`ChatRequest::continue_final_message`]), cut as transformers cuts it: the text ends where
//! that message's text ends, found by a tag appended to it before rendering.
//!
//! Templates in the style of Llama 3.1's, Qwen 2.5's, Mistral's, Gemma's, one of filters, and
//! ones with tools and generation blocks render as transformers renders them
//! (`tests/sft_trl.rs`).
//!
//! A template is code from a file: its rendering is bounded (fuel for at most
//! [`MAX_RENDER_STEPS`] instructions, output of at most [`MAX_RENDERED_BYTES`]), so a hostile
//! one ends in an error, not a hang.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::{Result, TrainError};

/// The largest `tokenizer_config.json` read (real ones are tens of KiB; a few with every
/// added token spelled out reach a few MiB).
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;
/// Instructions a render may run: a long conversation through a real template takes well under
/// a million.
pub const MAX_RENDER_STEPS: u64 = 50_000_000;
/// The longest rendered conversation.
pub const MAX_RENDERED_BYTES: usize = 64 << 20;

/// A JSON value whose objects keep their keys in the order they were written, as Python's
/// dicts do: a template that iterates a message's `items()` sees transformers' order.
/// (`serde_json::Value` sorts keys.) Reads from JSON text with serde, or from a
/// `serde_json::Value` (whose keys are then sorted).
#[derive(Clone, Debug, PartialEq)]
pub enum ChatValue {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number.
    Number(serde_json::Number),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<ChatValue>),
    /// An object, keys in written order.
    Object(Vec<(String, ChatValue)>),
}

impl From<serde_json::Value> for ChatValue {
    fn from(v: serde_json::Value) -> Self {
        match v {
            serde_json::Value::Null => ChatValue::Null,
            serde_json::Value::Bool(b) => ChatValue::Bool(b),
            serde_json::Value::Number(n) => ChatValue::Number(n),
            serde_json::Value::String(s) => ChatValue::String(s),
            serde_json::Value::Array(a) => {
                ChatValue::Array(a.into_iter().map(Into::into).collect())
            }
            serde_json::Value::Object(o) => {
                ChatValue::Object(o.into_iter().map(|(k, v)| (k, v.into())).collect())
            }
        }
    }
}

impl serde::Serialize for ChatValue {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        match self {
            ChatValue::Null => s.serialize_unit(),
            ChatValue::Bool(b) => s.serialize_bool(*b),
            ChatValue::Number(n) => n.serialize(s),
            ChatValue::String(t) => s.serialize_str(t),
            ChatValue::Array(a) => {
                let mut seq = s.serialize_seq(Some(a.len()))?;
                for v in a {
                    seq.serialize_element(v)?;
                }
                seq.end()
            }
            ChatValue::Object(o) => {
                let mut map = s.serialize_map(Some(o.len()))?;
                for (k, v) in o {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

impl<'de> serde::Deserialize<'de> for ChatValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = ChatValue;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E>(self) -> std::result::Result<ChatValue, E> {
                Ok(ChatValue::Null)
            }
            fn visit_none<E>(self) -> std::result::Result<ChatValue, E> {
                Ok(ChatValue::Null)
            }
            fn visit_bool<E>(self, b: bool) -> std::result::Result<ChatValue, E> {
                Ok(ChatValue::Bool(b))
            }
            fn visit_i64<E>(self, n: i64) -> std::result::Result<ChatValue, E> {
                Ok(ChatValue::Number(n.into()))
            }
            fn visit_u64<E>(self, n: u64) -> std::result::Result<ChatValue, E> {
                Ok(ChatValue::Number(n.into()))
            }
            fn visit_f64<E>(self, n: f64) -> std::result::Result<ChatValue, E> {
                Ok(serde_json::Number::from_f64(n).map_or(ChatValue::Null, ChatValue::Number))
            }
            fn visit_str<E>(self, t: &str) -> std::result::Result<ChatValue, E> {
                Ok(ChatValue::String(t.to_owned()))
            }
            fn visit_string<E>(self, t: String) -> std::result::Result<ChatValue, E> {
                Ok(ChatValue::String(t))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<ChatValue, A::Error> {
                let mut out = Vec::new();
                while let Some(v) = seq.next_element()? {
                    out.push(v);
                }
                Ok(ChatValue::Array(out))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<ChatValue, A::Error> {
                let mut out: Vec<(String, ChatValue)> = Vec::new();
                // Where each key is in `out`: a hostile object of many keys stays linear.
                let mut place: std::collections::HashMap<String, usize> = Default::default();
                while let Some((k, v)) = map.next_entry::<String, ChatValue>()? {
                    // A repeated key keeps its first place and its last value, as Python's
                    // json.loads.
                    match place.get(&k) {
                        Some(&i) => out[i].1 = v,
                        None => {
                            place.insert(k.clone(), out.len());
                            out.push((k, v));
                        }
                    }
                }
                Ok(ChatValue::Object(out))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Named templates a tokenizer may carry (`additional_chat_templates/*.jinja`; real ones have
/// two or three); together with the default they hold at most [`MAX_CONFIG_BYTES`].
pub const MAX_NAMED_TEMPLATES: usize = 64;
/// The special tokens transformers passes to a template (its `special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];
/// What `{% generation %}` and `{% endgeneration %}` become in the rendered text before the
/// spans are taken out: noncharacters, which no tokenizer or conversation should hold (inputs
/// holding them are refused while a template has generation blocks).
const GENERATION_START: char = '\u{FDD0}';
const GENERATION_END: char = '\u{FDD1}';

/// A chat template, parsed once, with the special tokens it may refer to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    /// The templates by name (`default`, `tool_use`, …), each with whether it has
    /// `{% generation %}` blocks.
    templates: BTreeMap<String, bool>,
    special_tokens: BTreeMap<String, String>,
    path: PathBuf,
    /// The time `strftime_now` formats (seconds since the Unix epoch, UTC); `None` is now.
    fixed_time: Option<i64>,
}

/// What a template renders: a conversation, and what goes with it, as the keyword arguments
/// of transformers' `apply_chat_template`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ChatRequest<'a> {
    /// The conversation: JSON objects (`role`, `content`, and any others such as `tool_calls`),
    /// passed to the template with their keys in order, null ones dropped as transformers
    /// drops them.
    pub messages: &'a [ChatValue],
    /// End with the assistant's turn header.
    pub add_generation_prompt: bool,
    /// The tools the model may call (JSON schemas); `none` to the template when absent.
    pub tools: Option<&'a [ChatValue]>,
    /// Documents for retrieval-augmented templates (objects); `none` when absent.
    pub documents: Option<&'a [ChatValue]>,
    /// Further variables (TRL's `chat_template_kwargs`, such as `enable_thinking`); they
    /// replace special tokens of the same name, as in transformers.
    pub extra: &'a [(String, ChatValue)],
    /// Leave the final message open for the model to continue ("prefill"), as transformers'
    /// `continue_final_message`: the field it continues, `"content"` (of a list of content
    /// blocks, the last one with `text`) or a reasoning field such as `"reasoning_content"`.
    /// The text ends where that field's text ends, whatever the template writes after it;
    /// refused together with `add_generation_prompt`, and where the template does not write
    /// the field's text as it is.
    pub continue_final_message: Option<&'a str>,
}

/// A rendered conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    /// The text.
    pub text: String,
    /// The byte ranges of `text` that `{% generation %}` blocks rendered, in order
    /// (transformers' `generation_indices`, in bytes rather than characters).
    pub generation: Vec<std::ops::Range<usize>>,
}

fn err(path: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::Tokenizer {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// A special token in `tokenizer_config.json`: its text, or an added-token object whose
/// `content` is the text.
fn token_text(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// The text of the file `path`, at most [`MAX_CONFIG_BYTES`] of UTF-8.
fn read_text(path: &Path) -> Result<String> {
    read_text_within(path, MAX_CONFIG_BYTES)
}

/// The text of the file `path`, at most `limit` bytes of UTF-8.
fn read_text_within(path: &Path, limit: u64) -> Result<String> {
    let bytes = crate::bounded::read_file(path, limit).map_err(|e| err(path, e))?;
    String::from_utf8(bytes).map_err(|e| err(path, e.to_string()))
}

/// A `tokenizer_config.json`'s text as a JSON object.
fn parse_config(text: &str, path: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(o)) => Ok(o),
        Ok(_) => Err(err(path, "not a JSON object")),
        Err(e) => Err(err(path, format!("not JSON: {e}"))),
    }
}

/// The special tokens of a `tokenizer_config.json`.
fn special_tokens_of(
    config: &serde_json::Map<String, serde_json::Value>,
) -> BTreeMap<String, String> {
    SPECIAL_TOKENS
        .iter()
        .filter_map(|&k| Some((k.to_owned(), token_text(config.get(k)?)?)))
        .collect()
}

/// The special tokens of a `tokenizer_config.json`'s text (read from `path`).
pub(crate) fn special_tokens_in(text: &str, path: &Path) -> Result<BTreeMap<String, String>> {
    Ok(special_tokens_of(&parse_config(text, path)?))
}

/// The special tokens (`eos_token`, `bos_token`, …) of the `tokenizer_config.json` beside a
/// `tokenizer.json`, as transformers' tokenizer takes them; empty without that file.
pub fn special_tokens_beside(tokenizer_json: &Path) -> Result<BTreeMap<String, String>> {
    let dir = tokenizer_json.parent().unwrap_or(Path::new("."));
    let path = dir.join("tokenizer_config.json");
    if !path.is_file() {
        return Ok(BTreeMap::new());
    }
    Ok(special_tokens_of(&parse_config(&read_text(&path)?, &path)?))
}

/// The templates of a `tokenizer_config.json`: its `chat_template`, a string (named
/// `default`) or a list of `{"name", "template"}`.
fn config_templates(
    config: &serde_json::Map<String, serde_json::Value>,
    path: &Path,
) -> Result<Vec<(String, String)>> {
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::String(s)) => Ok(vec![("default".into(), s.clone())]),
        Some(serde_json::Value::Array(named)) => named
            .iter()
            .map(|t| {
                let name = t.get("name").and_then(|n| n.as_str());
                let source = t.get("template").and_then(|n| n.as_str());
                match (name, source) {
                    (Some(n), Some(s)) => Ok((n.to_owned(), s.to_owned())),
                    _ => Err(err(
                        path,
                        "chat_template's list holds an entry without a string \"name\" and \
                         \"template\"",
                    )),
                }
            })
            .collect(),
        Some(_) => Err(err(path, "chat_template is neither a string nor a list")),
    }
}

impl ChatTemplate {
    /// The chat template of the tokenizer at `tokenizer_json`, from the files beside it, as
    /// transformers loads them: `chat_template.jinja` (the default) and
    /// `additional_chat_templates/NAME.jinja` if any, else `tokenizer_config.json`'s
    /// `chat_template`; the special tokens from `tokenizer_config.json`. `None` when it has no
    /// template.
    pub fn beside(tokenizer_json: &Path) -> Result<Option<ChatTemplate>> {
        let dir = tokenizer_json.parent().unwrap_or(Path::new("."));
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            parse_config(&read_text(&config_path)?, &config_path)?
        } else {
            Default::default()
        };
        let mut sources = Vec::new();
        let mut path = config_path.clone();
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            sources.push(("default".to_owned(), read_text(&jinja)?));
            path = jinja;
        }
        let named = dir.join("additional_chat_templates");
        if named.is_dir() {
            let mut files = Vec::new();
            for entry in std::fs::read_dir(&named).map_err(|e| err(&named, e.to_string()))? {
                let file = entry.map_err(|e| err(&named, e.to_string()))?.path();
                let name = file
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or_default();
                if let Some(stem) = name.strip_suffix(".jinja").filter(|_| file.is_file()) {
                    if files.len() == MAX_NAMED_TEMPLATES {
                        return Err(err(
                            &named,
                            format!("more than {MAX_NAMED_TEMPLATES} templates"),
                        ));
                    }
                    files.push((stem.to_owned(), file.clone()));
                }
            }
            files.sort();
            if sources.is_empty() && !files.is_empty() {
                path = named.clone();
            }
            // All of them together within one file's bound: each is read with what is left.
            let mut left =
                MAX_CONFIG_BYTES.saturating_sub(sources.iter().map(|(_, t)| t.len() as u64).sum());
            for (name, file) in files {
                let text = read_text_within(&file, left)?;
                left -= text.len() as u64;
                sources.push((name, text));
            }
        }
        // Template files take the place of the configuration's templates, as in transformers.
        if sources.is_empty() {
            sources = config_templates(&config, &config_path)?;
        }
        if sources.is_empty() {
            return Ok(None);
        }
        ChatTemplate::from_sources(sources, special_tokens_of(&config), &path).map(Some)
    }

    /// The template in a `tokenizer_config.json`'s text (`path` names it in errors): its
    /// `chat_template`, a string or a list of named templates, and its special tokens. `None`
    /// when it has no template.
    pub fn from_config(text: &str, path: impl AsRef<Path>) -> Result<Option<ChatTemplate>> {
        let path = path.as_ref();
        let config = parse_config(text, path)?;
        let sources = config_templates(&config, path)?;
        if sources.is_empty() {
            return Ok(None);
        }
        ChatTemplate::from_sources(sources, special_tokens_of(&config), path).map(Some)
    }

    /// The Jinja file `template` as the only (default) template, with the special tokens of
    /// the `tokenizer_config.json` beside `tokenizer_json` if there is one: transformers'
    /// `apply_chat_template(chat_template=…)`, TRL's `chat_template_path` of a `.jinja` file
    /// (such as TRL's training templates, which add `{% generation %}` blocks).
    pub fn from_file(template: &Path, tokenizer_json: Option<&Path>) -> Result<ChatTemplate> {
        let config_path = tokenizer_json.map(|t| {
            t.parent()
                .unwrap_or(Path::new("."))
                .join("tokenizer_config.json")
        });
        let special = match config_path.filter(|p| p.is_file()) {
            Some(p) => special_tokens_of(&parse_config(&read_text(&p)?, &p)?),
            None => BTreeMap::new(),
        };
        let source = read_text(template)?;
        ChatTemplate::from_sources(vec![("default".into(), source)], special, template)
    }

    /// Parse every template now: one that does not parse is refused when loaded, not at the
    /// first example.
    fn from_sources(
        sources: Vec<(String, String)>,
        special_tokens: BTreeMap<String, String>,
        path: &Path,
    ) -> Result<ChatTemplate> {
        let mut env = environment();
        let mut templates = BTreeMap::new();
        for (name, source) in sources {
            let (marked, generation) = mark_generation_blocks(&source);
            let marked_tokens = special_tokens.values().any(|t| holds_marker(t));
            if generation && (holds_marker(&source) || marked_tokens) {
                return Err(err(
                    path,
                    format!(
                        "chat template {name}: it or a special token holds U+FDD0 or U+FDD1, \
                         which mark generation blocks"
                    ),
                ));
            }
            env.add_template_owned(name.clone(), marked)
                .map_err(|e| err(path, format!("chat template {name}: {e}")))?;
            templates.insert(name, generation);
        }
        Ok(ChatTemplate {
            env,
            templates,
            special_tokens,
            path: path.to_path_buf(),
            fixed_time: None,
        })
    }

    /// The template with `strftime_now` formatting `unix_seconds` (UTC) instead of the current
    /// time: renders that do not change with the day (Llama 3.1's template writes today's date
    /// into its system turn).
    pub fn with_fixed_time(mut self, unix_seconds: i64) -> Self {
        self.fixed_time = Some(unix_seconds);
        self
    }

    /// A special token's text from the configuration (`"eos_token"`, `"bos_token"`, …): a
    /// chat model's end of turn is usually its `eos_token`.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.get(name).map(String::as_str)
    }

    /// The file the template came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The names of its templates (`default`, and any others such as `tool_use`).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.templates.keys().map(String::as_str)
    }

    /// Whether the default template marks the assistant's text with `{% generation %}`
    /// blocks (TRL's `has_generation_markers`, which `assistant_only_loss` needs).
    pub fn has_generation_blocks(&self) -> bool {
        self.templates.get("default").copied().unwrap_or(false)
    }

    /// The template a request renders with, as transformers chooses among named ones:
    /// `tool_use` when tools are given and it exists, else `default`.
    fn select(&self, tools: bool) -> Result<(&str, bool)> {
        let pick = |name: &str| self.templates.get_key_value(name);
        let chosen = if tools { pick("tool_use") } else { None }.or_else(|| pick("default"));
        match chosen {
            Some((name, &generation)) => Ok((name.as_str(), generation)),
            None => Err(err(
                &self.path,
                format!(
                    "several chat templates ({}) and none named \"default\"",
                    self.names().collect::<Vec<_>>().join(", ")
                ),
            )),
        }
    }
}

/// `source` with each `{% generation %}` and `{% endgeneration %}` tag replaced by
/// `{% if true %}{{ "M" }}{% endif %}`, M being [`GENERATION_START`] or [`GENERATION_END`], and
/// whether it had any. The tag's whitespace control (`-`, `+`) goes to the `if` on its left and
/// to the `endif` on its right, so the blanks before it (`lstrip_blocks`) and the newline after
/// it (`trim_blocks`) go as the tag's would, and the marker is written where the block's text
/// starts or ends.
fn mark_generation_blocks(source: &str) -> (String, bool) {
    let bytes = source.as_bytes();
    let mut out = String::with_capacity(source.len());
    let (mut copied, mut from, mut found) = (0, 0, false);
    let control = |j: &mut usize| match bytes.get(*j) {
        Some(&c @ (b'-' | b'+')) => {
            *j += 1;
            char::from(c).to_string()
        }
        _ => String::new(),
    };
    while let Some(offset) = source[from..].find("{%") {
        let at = from + offset;
        from = at + 2;
        let mut j = at + 2;
        let left = control(&mut j);
        while bytes.get(j).is_some_and(u8::is_ascii_whitespace) {
            j += 1;
        }
        let word_end = j + bytes[j..]
            .iter()
            .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_')
            .count();
        let marker = match &source[j..word_end] {
            "generation" => GENERATION_START,
            "endgeneration" => GENERATION_END,
            _ => continue,
        };
        j = word_end;
        while bytes.get(j).is_some_and(u8::is_ascii_whitespace) {
            j += 1;
        }
        let right = control(&mut j);
        if !source[j..].starts_with("%}") {
            continue;
        }
        out.push_str(&source[copied..at]);
        out.push_str(&format!(
            "{{%{left} if true %}}{{{{ \"{marker}\" }}}}{{% endif {right}%}}"
        ));
        copied = j + 2;
        from = copied;
        found = true;
    }
    out.push_str(&source[copied..]);
    (out, found)
}

/// `text` without its generation markers, and the byte ranges (in the text without them) that
/// each pair enclosed.
fn take_generation_spans(text: &str) -> std::result::Result<Rendered, &'static str> {
    let mut clean = String::with_capacity(text.len());
    let mut spans = Vec::new();
    let mut open = None;
    let mut copied = 0;
    for (i, c) in text.char_indices() {
        if c != GENERATION_START && c != GENERATION_END {
            continue;
        }
        clean.push_str(&text[copied..i]);
        copied = i + c.len_utf8();
        match (c == GENERATION_START, open) {
            (true, None) => open = Some(clean.len()),
            (true, Some(_)) => return Err("a {% generation %} block inside another"),
            (false, Some(start)) => {
                spans.push(start..clean.len());
                open = None;
            }
            (false, None) => return Err("{% endgeneration %} outside a generation block"),
        }
    }
    if open.is_some() {
        return Err("a {% generation %} block without its {% endgeneration %}");
    }
    clean.push_str(&text[copied..]);
    Ok(Rendered {
        text: clean,
        generation: spans,
    })
}

/// Whether `text` holds a generation marker.
fn holds_marker(text: &str) -> bool {
    text.contains([GENERATION_START, GENERATION_END])
}

/// Whether a string anywhere in `v` (keys included) holds a generation marker.
fn holds_generation_marker(v: &ChatValue) -> bool {
    match v {
        ChatValue::String(s) => holds_marker(s),
        ChatValue::Array(a) => a.iter().any(holds_generation_marker),
        ChatValue::Object(o) => o
            .iter()
            .any(|(k, v)| holds_marker(k) || holds_generation_marker(v)),
        ChatValue::Null | ChatValue::Bool(_) | ChatValue::Number(_) => false,
    }
}

/// The names under which transformers offers a message's reasoning; the first is the one
/// templates read.
const REASONING_KEYS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// transformers 5's reasoning aliases: a message with reasoning under any of
/// [`REASONING_KEYS`] gets it as `thinking` (first, unless it has its own) and
/// `reasoning_content` (replacing its own, or last).
fn alias_reasoning(message: Vec<(String, ChatValue)>) -> Vec<(String, ChatValue)> {
    let Some(reasoning) = REASONING_KEYS.iter().find_map(|key| {
        message
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }) else {
        return message;
    };
    let own_thinking = message
        .iter()
        .find(|(k, _)| k == "thinking")
        .map(|(_, v)| v.clone());
    let mut out = vec![(
        "thinking".to_owned(),
        own_thinking.unwrap_or(reasoning.clone()),
    )];
    out.extend(message.into_iter().filter(|(k, _)| k != "thinking"));
    match out.iter_mut().find(|(k, _)| k == "reasoning_content") {
        Some(slot) => slot.1 = reasoning,
        None => out.push(("reasoning_content".into(), reasoning)),
    }
    out
}

/// transformers' Jinja environment (see the module documentation), without templates.
fn environment() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(MAX_RENDER_STEPS));
    env.set_recursion_limit(100);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("the template raised: {message}"),
            ))
        },
    );
    env.add_filter("tojson", python_tojson);
    // Jinja's `iterable` is Python's iter(): false for none (minijinja iterates none as empty),
    // which templates lean on before `| length` (`tools is iterable and tools | length > 0`).
    env.add_test("iterable", |value: minijinja::Value| {
        use minijinja::value::ValueKind;
        match value.kind() {
            ValueKind::None | ValueKind::Bool | ValueKind::Number => false,
            ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Iterable => true,
            _ => value.try_iter().is_ok(),
        }
    });
    env
}

impl ChatTemplate {
    /// The text of the conversation `messages`, ending with the assistant's turn header when
    /// `add_generation_prompt` ([`ChatTemplate::render_request`] without tools, documents or
    /// further variables).
    pub fn render(&self, messages: &[ChatValue], add_generation_prompt: bool) -> Result<String> {
        let request = ChatRequest {
            messages,
            add_generation_prompt,
            ..Default::default()
        };
        Ok(self.render_request(&request)?.text)
    }

    /// The text of a request, and the spans of its generation blocks.
    pub fn render_request(&self, request: &ChatRequest<'_>) -> Result<Rendered> {
        let (name, generation) = self.select(request.tools.is_some())?;
        let template = self
            .env
            .get_template(name)
            .map_err(|e| err(&self.path, e.to_string()))?;
        let mut clean = Vec::with_capacity(request.messages.len());
        for (i, m) in request.messages.iter().enumerate() {
            // Only objects, as transformers: an assistant's tool call often has no content
            // (or a null one, dropped below), and templates check what they need.
            let ChatValue::Object(m) = m else {
                return Err(err(&self.path, format!("message {i} is not an object")));
            };
            let kept = m
                .iter()
                .filter(|(_, v)| *v != ChatValue::Null)
                .cloned()
                .collect();
            clean.push(ChatValue::Object(alias_reasoning(kept)));
        }
        for (what, list) in [("tool", request.tools), ("document", request.documents)] {
            if let Some(i) = list
                .unwrap_or_default()
                .iter()
                .position(|v| !matches!(v, ChatValue::Object(_)))
            {
                return Err(err(&self.path, format!("{what} {i} is not a JSON object")));
            }
        }
        if generation {
            let mut values = clean
                .iter()
                .chain(request.tools.unwrap_or_default())
                .chain(request.documents.unwrap_or_default())
                .chain(request.extra.iter().map(|(_, v)| v));
            if values.any(holds_generation_marker)
                || request.extra.iter().any(|(k, _)| holds_marker(k))
            {
                return Err(err(
                    &self.path,
                    "the conversation holds U+FDD0 or U+FDD1, which mark generation blocks",
                ));
            }
        }
        let continued = match request.continue_final_message {
            None => None,
            Some(_) if request.add_generation_prompt => {
                return Err(err(
                    &self.path,
                    "continue_final_message and add_generation_prompt together: the first \
                     continues the final message, the second starts a new assistant turn",
                ))
            }
            Some(field) => Some(
                tag_final_message(&mut clean, field, template.source())
                    .map_err(|e| err(&self.path, format!("continue_final_message: {e}")))?,
            ),
        };
        let now = self.fixed_time.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64)
        });
        let mut context: BTreeMap<String, minijinja::Value> = BTreeMap::new();
        context.insert(
            "strftime_now".into(),
            minijinja::Value::from_function(
                move |format: String| -> std::result::Result<String, minijinja::Error> {
                    strftime(&format, now).map_err(|e| {
                        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e)
                    })
                },
            ),
        );
        for (k, v) in &self.special_tokens {
            context.insert(k.clone(), minijinja::Value::from(v.as_str()));
        }
        const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];
        for (k, v) in request.extra {
            if RESERVED.contains(&k.as_str()) {
                return Err(err(
                    &self.path,
                    format!("the variable {k:?} is set by the conversation itself"),
                ));
            }
            context.insert(k.clone(), minijinja::Value::from_serialize(v));
        }
        let list = |l: Option<&[ChatValue]>| match l {
            Some(l) => minijinja::Value::from_serialize(l),
            None => minijinja::Value::from(()),
        };
        context.insert("messages".into(), minijinja::Value::from_serialize(&clean));
        context.insert("tools".into(), list(request.tools));
        context.insert("documents".into(), list(request.documents));
        context.insert(
            "add_generation_prompt".into(),
            minijinja::Value::from(request.add_generation_prompt),
        );
        let text = template
            .render(context)
            .map_err(|e| err(&self.path, format!("rendering the chat template: {e}")))?;
        if text.len() > MAX_RENDERED_BYTES {
            return Err(err(
                &self.path,
                format!(
                    "the rendered conversation is {} bytes, over the limit of {MAX_RENDERED_BYTES}",
                    text.len()
                ),
            ));
        }
        let mut rendered = if generation {
            take_generation_spans(&text)
                .map_err(|e| err(&self.path, format!("rendering the chat template: {e}")))?
        } else {
            Rendered {
                text,
                generation: Vec::new(),
            }
        };
        if let Some(final_text) = continued {
            let end = continuation_end(&rendered.text, &final_text)
                .map_err(|e| err(&self.path, format!("continue_final_message: {e}")))?;
            rendered.text.truncate(end);
            // transformers refuses assistant masks with a continued message; here a block
            // keeps what lies before the cut.
            rendered.generation.retain_mut(|span| {
                span.end = span.end.min(end);
                span.start < span.end
            });
        }
        Ok(rendered)
    }
}

/// What transformers appends to the text a continued message ends with, so that the end can be
/// found in the rendered conversation.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Python's `str.isspace` of one character: Rust's whitespace and the four information
/// separators U+001C–U+001F, which Python strips too.
pub(crate) fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Appends [`CONTINUE_TAG`] to the text the conversation's final message is continued from,
/// as transformers does, and returns that text as it was. `field` is the message's key; of a
/// reasoning key, every alias holding the same text is tagged (the template reads whichever
/// it reads). `source` is the template's text, which must name the field.
fn tag_final_message(
    messages: &mut [ChatValue],
    field: &str,
    source: &str,
) -> std::result::Result<String, String> {
    let Some(ChatValue::Object(last)) = messages.last_mut() else {
        return Err("the conversation is empty".into());
    };
    let Some(value) = last
        .iter()
        .find(|(k, _)| k == field)
        .map(|(_, v)| v.clone())
    else {
        return Err(format!("the final message has no {field:?} to continue"));
    };
    let fields: Vec<String> = if REASONING_KEYS.contains(&field) {
        REASONING_KEYS
            .iter()
            .filter(|&&key| last.iter().any(|(k, v)| k == key && *v == value))
            .map(|&key| key.to_owned())
            .collect()
    } else {
        vec![field.to_owned()]
    };
    if !fields.iter().any(|f| source.contains(f.as_str())) {
        return Err(format!(
            "the chat template never names {field:?}, so it cannot be continued"
        ));
    }
    match value {
        ChatValue::String(text) => {
            for (k, v) in last.iter_mut() {
                if fields.contains(k) {
                    *v = ChatValue::String(format!("{text}{CONTINUE_TAG}"));
                }
            }
            Ok(text)
        }
        // The last content block with text, as transformers picks it.
        ChatValue::Array(mut blocks) => {
            let mut chosen = None;
            for (i, block) in blocks.iter().enumerate().rev() {
                // Python's `"text" in block`: a key of an object, a substring of a string,
                // an item of a list; only an object can then be indexed by "text".
                let names_text = match block {
                    ChatValue::Object(pairs) => pairs.iter().any(|(k, _)| k == "text"),
                    ChatValue::String(s) => s.contains("text"),
                    ChatValue::Array(items) => items.contains(&ChatValue::String("text".into())),
                    _ => false,
                };
                if names_text {
                    chosen = Some(i);
                    break;
                }
            }
            let Some(i) = chosen else {
                return Err("the final message has no text to continue".into());
            };
            let ChatValue::Object(pairs) = &mut blocks[i] else {
                return Err("a content block of the final message is not an object".into());
            };
            let Some((_, ChatValue::String(text))) = pairs.iter_mut().find(|(k, _)| k == "text")
            else {
                return Err("the final message's last text block is not a string".into());
            };
            let original = text.clone();
            text.push_str(CONTINUE_TAG);
            if let Some((_, v)) = last.iter_mut().find(|(k, _)| k == field) {
                *v = ChatValue::Array(blocks);
            }
            Ok(original)
        }
        _ => Err(format!("the final message's {field:?} is not text")),
    }
}

/// Where the rendered `text` ends when the final message, whose text was `final_text`, is
/// continued: just before [`CONTINUE_TAG`], or, where the template trimmed the space the tag
/// ends with, before the whitespace ahead of it too (transformers' rule).
fn continuation_end(text: &str, final_text: &str) -> std::result::Result<usize, String> {
    let tag = CONTINUE_TAG.trim_end();
    let stripped = final_text.trim_matches(is_python_space);
    let Some(at) = text.rfind(tag).filter(|_| text.contains(stripped)) else {
        return Err(
            "the final message is not in the rendered conversation as it was written (the \
             chat template changes or drops it), so it cannot be continued"
                .into(),
        );
    };
    Ok(if text[at..].starts_with(CONTINUE_TAG) {
        at
    } else {
        text[..at].trim_end_matches(is_python_space).len()
    })
}

/// How [`python_tojson`] lays out JSON.
struct JsonLayout {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, the four taken by position or by name as in Python.
fn python_tojson(
    value: minijinja::Value,
    args: minijinja::value::Rest<minijinja::Value>,
) -> std::result::Result<String, minijinja::Error> {
    use minijinja::{Error, ErrorKind, Value};
    let bad = |why: String| Error::new(ErrorKind::InvalidOperation, format!("tojson: {why}"));
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    let mut positional = args.0;
    let keywords = match positional.last() {
        Some(v) if v.is_kwargs() => positional.pop(),
        _ => None,
    };
    if positional.len() > NAMES.len() {
        return Err(bad(format!(
            "{} arguments after the value",
            positional.len()
        )));
    }
    let mut slots: [Option<Value>; 4] = Default::default();
    for (slot, v) in slots.iter_mut().zip(positional) {
        *slot = Some(v);
    }
    if let Some(keywords) = keywords {
        for key in keywords.try_iter()? {
            let name = key.as_str().unwrap_or_default();
            let Some(i) = NAMES.iter().position(|n| *n == name) else {
                return Err(bad(format!("unexpected argument {key}")));
            };
            if slots[i].is_some() {
                return Err(bad(format!("{name} given twice")));
            }
            slots[i] = Some(keywords.get_item(&key)?);
        }
    }
    let given = |v: &Option<Value>| v.as_ref().filter(|v| !v.is_none()).cloned();
    let indent = match given(&slots[1]) {
        None => None,
        Some(v) if v.as_str().is_some() => Some(v.as_str().unwrap_or_default().to_owned()),
        Some(v) if v.is_integer() || v.kind() == minijinja::value::ValueKind::Bool => {
            let n = if v.kind() == minijinja::value::ValueKind::Bool {
                i64::from(v.is_true())
            } else {
                v.as_i64().ok_or_else(|| bad(format!("indent {v}")))?
            };
            if n > 1024 {
                return Err(bad(format!("indent {n} is over 1024")));
            }
            Some(" ".repeat(n.max(0) as usize))
        }
        Some(v) => {
            return Err(bad(format!(
                "indent must be an integer or a string, not {v}"
            )))
        }
    };
    let (item_separator, key_separator) = match given(&slots[2]) {
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_owned(),
                    b.as_str().unwrap_or_default().to_owned(),
                ),
                _ => return Err(bad("separators must be two strings".into())),
            }
        }
    };
    let layout = JsonLayout {
        ensure_ascii: given(&slots[0]).is_some_and(|v| v.is_true()),
        indent,
        item_separator,
        key_separator,
        sort_keys: given(&slots[3]).is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    write_python_json(&value, &layout, 0, &mut out).map_err(bad)?;
    Ok(out)
}

/// `value` as Python's `json.dumps` writes it, appended to `out`.
/// Python's `json.dumps(value, ensure_ascii=…, sort_keys=…)` with its default separators
/// (`", "`, `": "`) and no indent.
pub(crate) fn python_json_dumps(
    value: &minijinja::Value,
    ensure_ascii: bool,
    sort_keys: bool,
) -> std::result::Result<String, String> {
    let layout = JsonLayout {
        ensure_ascii,
        indent: None,
        item_separator: ", ".into(),
        key_separator: ": ".into(),
        sort_keys,
    };
    let mut out = String::new();
    write_python_json(value, &layout, 0, &mut out)?;
    Ok(out)
}

fn write_python_json(
    value: &minijinja::Value,
    layout: &JsonLayout,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), String> {
    use minijinja::value::ValueKind;
    if depth > 256 {
        return Err("nested deeper than 256".into());
    }
    if out.len() > MAX_RENDERED_BYTES {
        return Err(format!("output over {MAX_RENDERED_BYTES} bytes"));
    }
    let e = |x: minijinja::Error| x.to_string();
    // Where each item of a list or object starts: a newline and the indent of its level.
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &layout.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => {
            let x = f64::try_from(value.clone()).map_err(e)?;
            out.push_str(&python_float_repr(x));
        }
        ValueKind::String => python_json_string(value.as_str().unwrap_or_default(), layout, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<_> = value.try_iter().map_err(e)?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&layout.item_separator);
                }
                newline(out, depth + 1);
                write_python_json(item, layout, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut items = Vec::new();
            for key in value.try_iter().map_err(e)? {
                let item = value.get_item(&key).map_err(e)?;
                items.push((key, item));
            }
            if items.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if layout.sort_keys {
                if items.iter().all(|(k, _)| k.kind() == ValueKind::String) {
                    items.sort_by(|a, b| a.0.as_str().cmp(&b.0.as_str()));
                } else if items.iter().all(|(k, _)| k.kind() == ValueKind::Number) {
                    let number = |k: &minijinja::Value| f64::try_from(k.clone()).unwrap_or(0.0);
                    items.sort_by(|a, b| number(&a.0).total_cmp(&number(&b.0)));
                } else {
                    return Err("sort_keys with keys of different types".into());
                }
            }
            out.push('{');
            for (i, (key, item)) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&layout.item_separator);
                }
                newline(out, depth + 1);
                // Python's json turns keys that are not strings into strings.
                let key = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
                    ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
                    ValueKind::None => "null".into(),
                    ValueKind::Number if key.is_integer() => key.to_string(),
                    ValueKind::Number => python_float_repr(f64::try_from(key.clone()).map_err(e)?),
                    other => return Err(format!("a key of type {other} is not JSON")),
                };
                python_json_string(&key, layout, out);
                out.push_str(&layout.key_separator);
                write_python_json(item, layout, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        other => return Err(format!("a value of type {other} is not JSON serializable")),
    }
    Ok(())
}

/// A JSON string as Python's `json` writes it: `"` `\` and control characters escaped
/// (`\n` `\r` `\t` `\b` `\f`, others as `\u00xx`), and with `ensure_ascii` everything outside
/// printable ASCII as `\uxxxx` (UTF-16 surrogate pairs above U+FFFF).
fn python_json_string(s: &str, layout: &JsonLayout, out: &mut String) {
    use std::fmt::Write;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (layout.ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that read back as `x`, written out in full
/// when the decimal point falls between 4 places before the first digit and 16 after it,
/// else as `d.ddde±XX`; `.0` on whole numbers; `NaN`, `Infinity` and `-Infinity` as Python's
/// `json` writes them.
pub fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the same shortest round-trip digits: "-1.2345e-7".
    let scientific = format!("{x:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    // Where the decimal point falls, counted in digits from the first.
    let point = exponent + 1;
    let n = digits.len() as i32;
    if !(-4 < point && point <= 16) {
        let rest = if digits.len() > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let esign = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{}{rest}e{esign}{:02}", &digits[..1], exponent.abs());
    }
    if point <= 0 {
        format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
    } else if point < n {
        format!(
            "{sign}{}.{}",
            &digits[..point as usize],
            &digits[point as usize..]
        )
    } else {
        format!("{sign}{digits}{}.0", "0".repeat((point - n) as usize))
    }
}

/// Python's `time.strftime(format)` at `unix_seconds` in UTC, for the directives chat
/// templates use (`%d %b %Y` in Llama 3.1's): `%a %A %b %B %d %H %I %j %m %M %p %S %y %Y %%`;
/// any other is an error rather than a guess.
pub fn strftime(format: &str, unix_seconds: i64) -> std::result::Result<String, String> {
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (hour, minute, second) = (secs / 3600, secs % 3600 / 60, secs % 60);
    // The proleptic Gregorian date of a day count (Howard Hinnant's civil_from_days).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let day = doy_march - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    let day_of_year = before + day + i64::from(leap && month > 2);
    // 1970-01-01 was a Thursday.
    let weekday = (days + 3).rem_euclid(7) as usize;
    let month_name = MONTHS[month as usize - 1];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('Y') => out.push_str(&year.to_string()),
            Some('%') => out.push('%'),
            Some(other) => return Err(format!("strftime_now: %{other} is not supported")),
            None => return Err("strftime_now: the format ends with %".into()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        let config = serde_json::json!({
            "chat_template": source,
            "bos_token": {"content": "<s>", "special": true},
            "eos_token": "</s>",
        });
        ChatTemplate::from_config(&config.to_string(), "t.json")
            .unwrap()
            .unwrap()
    }

    fn user(text: &str) -> Vec<ChatValue> {
        vec![serde_json::json!({"role": "user", "content": text}).into()]
    }

    #[test]
    fn special_tokens_blocks_and_python_methods_render_as_transformers_does() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}\n  {%- if m['role'] == 'user' %}\n[{{ m['content'].strip().upper() }}]{{ eos_token }}\n  {% endif %}\n{% endfor %}",
        );
        // Jinja2 with transformers' settings gives the same (checked with jinja2 3.1.6).
        assert_eq!(t.render(&user("  hi "), false).unwrap(), "<s>[HI]</s>\n");
    }

    #[test]
    fn named_templates_missing_templates_and_bad_configs() {
        let named = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
        let t = ChatTemplate::from_config(&named.to_string(), "c")
            .unwrap()
            .unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "D");
        // transformers' choice: tool_use when tools are given.
        let tools = [serde_json::json!({"type": "function"}).into()];
        let with_tools = ChatRequest {
            tools: Some(&tools),
            ..Default::default()
        };
        assert_eq!(t.render_request(&with_tools).unwrap().text, "T");
        assert_eq!(t.names().collect::<Vec<_>>(), ["default", "tool_use"]);
        assert!(ChatTemplate::from_config("{}", "c").unwrap().is_none());
        // Without a default, a conversation without tools has no template.
        let only = r#"{"chat_template": [{"name": "x", "template": "y"}]}"#;
        let t = ChatTemplate::from_config(only, "c").unwrap().unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("none named \"default\""), "{e}");
        for bad in [
            "[1]",
            "not json",
            r#"{"chat_template": 3}"#,
            r#"{"chat_template": [{"name": "x"}]}"#,
            r#"{"chat_template": "{% for %}"}"#,
        ] {
            let e = ChatTemplate::from_config(bad, "c").unwrap_err().to_string();
            assert!(e.contains('c'), "{bad}: {e}");
        }
    }

    #[test]
    fn generation_tags_become_markers_with_their_whitespace_control() {
        let (marked, found) = mark_generation_blocks("a {%- generation +%} b {% endgeneration -%}");
        assert!(found);
        assert_eq!(
            marked,
            "a {%- if true %}{{ \"\u{FDD0}\" }}{% endif +%} b \
             {% if true %}{{ \"\u{FDD1}\" }}{% endif -%}"
        );
        // Other tags, and text that only looks like one, are left alone.
        for source in [
            "{% if x %}{% endif %}",
            "{% generations %}",
            "{% generation",
            "{%",
        ] {
            assert_eq!(mark_generation_blocks(source), (source.to_owned(), false));
        }
        let t = template("[{% generation %}{{ messages[0].content }}{% endgeneration %}]");
        let r = t
            .render_request(&ChatRequest {
                messages: &user("héllo"),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(r.text, "[héllo]");
        assert_eq!(r.generation, vec![std::ops::Range { start: 1, end: 7 }]);
        // A block opened and never closed, or closed twice, at render time.
        for source in [
            "{% generation %}{% if false %}{% endgeneration %}{% endif %}",
            "{% if false %}{% generation %}{% endif %}{% endgeneration %}",
        ] {
            let e = template(source).render(&[], false).unwrap_err().to_string();
            assert!(e.contains("generation"), "{source}: {e}");
        }
    }

    #[test]
    fn iterable_is_pythons() {
        // Jinja2 3.1.6 renders "FalseTrueTrueFalseTrueTrue".
        let t = template(
            "{{ none is iterable }}{{ [] is iterable }}{{ 'a' is iterable }}{{ 1 is iterable }}\
             {{ nothing is iterable }}{{ {} is iterable }}",
        );
        assert_eq!(t.render(&[], false).unwrap(), "FalseTrueTrueFalseTrueTrue");
    }

    #[test]
    fn reasoning_is_offered_under_transformers_names() {
        let m: Vec<ChatValue> = serde_json::from_str(
            r#"[{"role": "assistant", "content": "c", "reasoning": "r"},
                {"role": "assistant", "thinking": "t", "content": "c", "reasoning_content": "rc"},
                {"role": "user", "content": "plain"}]"#,
        )
        .unwrap();
        let t = template(
            "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v }},{% endfor %};{% endfor %}",
        );
        // Checked against transformers 5.24's _alias_reasoning_fields.
        assert_eq!(
            t.render(&m, false).unwrap(),
            "thinking=r,role=assistant,content=c,reasoning=r,reasoning_content=r,;\
             thinking=t,role=assistant,content=c,reasoning_content=rc,;\
             role=user,content=plain,;"
        );
    }

    #[test]
    fn python_float_repr_spells_floats_as_python() {
        // Each checked with Python 3.11's repr.
        for (x, want) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (-1.5e-7, "-1.5e-07"),
            (1.2345678901234567e300, "1.2345678901234567e+300"),
            (5e-324, "5e-324"),
            (123456789.125, "123456789.125"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(python_float_repr(x), want);
        }
    }

    fn messages(json: &str) -> Vec<ChatValue> {
        serde_json::from_str(json).unwrap()
    }

    fn continued(t: &ChatTemplate, messages: &[ChatValue], field: &str) -> Result<Rendered> {
        t.render_request(&ChatRequest {
            messages,
            continue_final_message: Some(field),
            ..Default::default()
        })
    }

    #[test]
    fn continuing_refuses_what_transformers_refuses() {
        let t = template(
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}\
             {% if add_generation_prompt %}<|assistant|>{% endif %}",
        );
        let prefill = messages(
            r#"[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}]"#,
        );
        let both = t.render_request(&ChatRequest {
            messages: &prefill,
            add_generation_prompt: true,
            continue_final_message: Some("content"),
            ..Default::default()
        });
        let refusals = [
            (both, "add_generation_prompt"),
            (continued(&t, &[], "content"), "empty"),
            (
                continued(&t, &prefill, "reasoning_content"),
                "no \"reasoning_content\"",
            ),
            (
                continued(
                    &t,
                    &messages(r#"[{"role": "user", "content": 7}]"#),
                    "content",
                ),
                "not text",
            ),
            (
                continued(
                    &t,
                    &messages(r#"[{"role": "user", "content": [{"type": "image"}]}]"#),
                    "content",
                ),
                "no text",
            ),
            (
                continued(
                    &t,
                    &messages(r#"[{"role": "user", "content": [{"text": 1}]}]"#),
                    "content",
                ),
                "not a string",
            ),
            // The template writes the message changed.
            (
                continued(
                    &template("{{ messages[0].content | upper }}"),
                    &prefill,
                    "content",
                ),
                "as it was written",
            ),
            // The template never names the field.
            (
                continued(&template("{{ messages | length }}"), &prefill, "content"),
                "never names",
            ),
        ];
        for (i, (result, why)) in refusals.into_iter().enumerate() {
            let e = result.unwrap_err().to_string();
            assert!(
                e.contains(why) && e.contains("continue_final_message"),
                "{i}: {e}"
            );
        }
        assert_eq!(
            continued(&t, &prefill, "content").unwrap().text,
            "<|user|>Hi</s><|assistant|>Sure"
        );
    }

    #[test]
    fn a_trimmed_continuation_is_cut_before_pythons_whitespace() {
        // The template trimmed the tag's space: the cut falls before the whitespace ahead of the
        // tag, as Python's rstrip finds it (U+001C–U+001F too, which Rust's trim keeps).
        assert_eq!(
            continuation_end("ab \u{1c}\tCONTINUE_FINAL_MESSAGE_TAG</s>", "b"),
            Ok(2)
        );
        assert_eq!(
            continuation_end("ab CONTINUE_FINAL_MESSAGE_TAG </s>", "b "),
            Ok(3)
        );
        // The last tag counts, as Python's rindex.
        assert_eq!(
            continuation_end(
                "CONTINUE_FINAL_MESSAGE_TAG xCONTINUE_FINAL_MESSAGE_TAG ",
                "x"
            ),
            Ok(28)
        );
        assert!(continuation_end("ab</s>", "b").is_err());
        assert!(continuation_end("aCONTINUE_FINAL_MESSAGE_TAG ", "b").is_err());
    }

    #[test]
    fn a_continued_generation_block_ends_at_the_cut() {
        let t = template(
            "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}\
             </s>{% endgeneration %}{% else %}[{{ m.content }}]{% endif %}{% endfor %}",
        );
        let m = messages(
            r#"[{"role": "user", "content": "q"}, {"role": "assistant", "content": "one"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "tw"}]"#,
        );
        let r = continued(&t, &m, "content").unwrap();
        assert_eq!(r.text, "[q]one</s>[again]tw");
        assert_eq!(r.generation, vec![3..10, 17..19]);
        // An empty continuation leaves no empty span behind.
        let m =
            messages(r#"[{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]"#);
        let r = continued(&t, &m, "content").unwrap();
        assert_eq!((r.text.as_str(), r.generation.len()), ("[q]", 0));
    }

    proptest::proptest! {
        /// A continued message ends the text where its content ends: the whole conversation's
        /// text without the end of turn, whether the template writes the content as it is or
        /// trimmed (the space the template trims is not in the prefill).
        #[test]
        fn a_continued_message_ends_where_its_content_ends(
            earlier in proptest::collection::vec(".{0,12}", 0..3),
            last in "\\PC{0,12}[ \t\n\u{a0}\u{1c}]{0,3}",
            trimmed in proptest::prelude::any::<bool>(),
        ) {
            proptest::prop_assume!(!last.contains("CONTINUE_FINAL_MESSAGE_TAG"));
            let content = if trimmed { "m.content | trim" } else { "m.content" };
            let t = template(&format!(
                "{{% for m in messages %}}<|{{{{ m.role }}}}|>{{{{ {content} }}}}</s>{{% endfor %}}"
            ));
            let roles = ["user", "assistant"];
            let mut conversation: Vec<ChatValue> = earlier
                .iter()
                .enumerate()
                .map(|(i, text)| serde_json::json!({"role": roles[i % 2], "content": text}).into())
                .collect();
            let head = t.render(&conversation, false).unwrap() + "<|assistant|>";
            conversation.push(serde_json::json!({"role": "assistant", "content": last}).into());
            let want = if trimmed {
                last.trim_start().trim_end_matches(is_python_space)
            } else {
                last.as_str()
            };
            let got = continued(&t, &conversation, "content").unwrap().text;
            proptest::prop_assert_eq!(got, format!("{head}{want}"));
        }

        /// Python's spelling reads back as the same float.
        #[test]
        fn python_float_repr_round_trips(bits in proptest::prelude::any::<u64>()) {
            let x = f64::from_bits(bits);
            proptest::prop_assume!(x.is_finite());
            let back: f64 = python_float_repr(x).parse().unwrap();
            proptest::prop_assert_eq!(back.to_bits(), x.to_bits());
        }

        /// `tojson` writes JSON that reads back as the value, whatever the layout.
        #[test]
        fn tojson_reads_back_as_the_value(
            value in json_value(),
            indent in proptest::option::of(0usize..4),
            ascii in proptest::prelude::any::<bool>(),
        ) {
            let args = match indent {
                Some(n) => format!("ensure_ascii={ascii}, indent={n}"),
                None => format!("ensure_ascii={ascii}"),
            };
            let t = template(&format!("{{{{ v | tojson({args}) }}}}"));
            let extra = [("v".to_owned(), ChatValue::from(value.clone()))];
            let out = t
                .render_request(&ChatRequest { extra: &extra, ..Default::default() })
                .unwrap()
                .text;
            let back: serde_json::Value = serde_json::from_str(&out).unwrap();
            proptest::prop_assert_eq!(back, value);
            if ascii {
                proptest::prop_assert!(out.is_ascii());
            }
        }
    }

    /// JSON values of strings with any characters, whole and fractional numbers, nesting.
    fn json_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>()
                .prop_filter("finite", |x| x.is_finite())
                .prop_map(serde_json::Value::from),
            any::<String>().prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::btree_map(any::<String>(), inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    #[test]
    fn hostile_templates_and_messages_are_errors() {
        // 10⁸ iterations: out of fuel long before.
        let forever = template(
            "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
        );
        assert!(forever.render(&[], false).is_err());
        let raises = template("{{ raise_exception('no system role') }}");
        let e = raises.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
        let recursive = template("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
        assert!(recursive.render(&[], false).is_err());
        let t = template("{% for m in messages %}{{ m.content }}{% endfor %}");
        for bad in [serde_json::json!("text"), serde_json::json!(["a"])] {
            assert!(t.render(&[bad.into()], false).is_err());
        }
        // Messages are passed on as transformers passes them; the template decides.
        let no_content = serde_json::json!({"role": "assistant", "tool_calls": []});
        assert_eq!(t.render(&[no_content.into()], false).unwrap(), "");
        // Tools and documents are objects; the conversation's own variables are not replaced.
        let list = [serde_json::json!("get_weather").into()];
        for request in [
            ChatRequest {
                tools: Some(&list),
                ..Default::default()
            },
            ChatRequest {
                documents: Some(&list),
                ..Default::default()
            },
            ChatRequest {
                extra: &[("messages".into(), ChatValue::Null)],
                ..Default::default()
            },
        ] {
            assert!(t.render_request(&request).is_err());
        }
        let t = template("{{ tools is none }}{{ documents is none }}{{ enable_thinking }}");
        let extra = [("enable_thinking".into(), ChatValue::Bool(false))];
        let r = t.render_request(&ChatRequest {
            extra: &extra,
            ..Default::default()
        });
        assert_eq!(r.unwrap().text, "TrueTrueFalse");
        // Null keys are dropped, others passed through.
        let m = serde_json::json!({"role": "user", "content": "x", "name": null, "tag": "t"});
        let t = template("{% for m in messages %}{{ m.tag }}{{ m.name is defined }}{% endfor %}");
        assert_eq!(t.render(&[m.into()], false).unwrap(), "tFalse");
        // Keys keep the order they were written in, as Python's dicts.
        let m: Vec<ChatValue> =
            serde_json::from_str(r#"[{"role": "user", "z": 1, "content": "x", "a": 2}]"#).unwrap();
        let t = template("{% for k, v in messages[0].items() %}{{ k }},{% endfor %}");
        assert_eq!(t.render(&m, false).unwrap(), "role,z,content,a,");
        // A repeated key keeps its first place and its last value, as Python's json.loads.
        let m: Vec<ChatValue> =
            serde_json::from_str(r#"[{"role": "x", "content": "c", "role": "user"}]"#).unwrap();
        let t = template("{% for k, v in messages[0].items() %}{{ k }}={{ v }},{% endfor %}");
        assert_eq!(t.render(&m, false).unwrap(), "role=user,content=c,");
    }
}
