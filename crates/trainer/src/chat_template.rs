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
//! The environment is transformers': blocks trimmed (`trim_blocks`, `lstrip_blocks`), loop
//! controls, `raise_exception(message)` (an error naming the template), Python's string and
//! dict methods (`.strip()`, `.startswith()`, `.items()`; minijinja-contrib's `pycompat`), and
//! the tokenizer's special tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`) beside
//! `messages` and `add_generation_prompt`, and `strftime_now(format)` ([`strftime`] of the
//! current time in UTC where transformers takes local time, or of a fixed time:
//! [`ChatTemplate::with_fixed_time`]). Messages keep their keys' order ([`ChatValue`]), as
//! Python's dicts. Five templates in the style of Llama 3.1's, Qwen 2.5's, Mistral's, Gemma's
//! and one of filters render as transformers renders them (`tests/sft_trl.rs`). Not provided:
//! tools and documents, the `{% generation %}` tag of `return_assistant_tokens_mask`, and
//! transformers' own `tojson` (minijinja's escapes HTML characters and writes no spaces; tool
//! templates use it).
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

/// A chat template, parsed once, with the special tokens it may refer to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    special_tokens: BTreeMap<String, String>,
    path: PathBuf,
    /// The time `strftime_now` formats (seconds since the Unix epoch, UTC); `None` is now.
    fixed_time: Option<i64>,
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

impl ChatTemplate {
    /// The chat template of the tokenizer at `tokenizer_json`: from the `tokenizer_config.json`
    /// beside it. `None` when there is no such file or it has no template.
    pub fn beside(tokenizer_json: &Path) -> Result<Option<ChatTemplate>> {
        let path = tokenizer_json
            .parent()
            .unwrap_or(Path::new("."))
            .join("tokenizer_config.json");
        if !path.is_file() {
            return Ok(None);
        }
        let bytes =
            crate::bounded::read_file(&path, MAX_CONFIG_BYTES).map_err(|e| err(&path, e))?;
        let text = std::str::from_utf8(&bytes).map_err(|e| err(&path, e.to_string()))?;
        ChatTemplate::from_config(text, &path)
    }

    /// The template in a `tokenizer_config.json`'s text (`path` names it in errors): its
    /// `chat_template`, a string or a list of named templates (the one named `default`), and
    /// its special tokens. `None` when it has no template.
    pub fn from_config(text: &str, path: impl AsRef<Path>) -> Result<Option<ChatTemplate>> {
        let path = path.as_ref();
        let config: serde_json::Value =
            serde_json::from_str(text).map_err(|e| err(path, format!("not JSON: {e}")))?;
        let Some(config) = config.as_object() else {
            return Err(err(path, "not a JSON object"));
        };
        let source = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_owned))
                .ok_or_else(|| {
                    err(
                        path,
                        "chat_template is a list of named templates without one named \"default\"",
                    )
                })?,
            Some(_) => return Err(err(path, "chat_template is neither a string nor a list")),
        };
        let special_tokens = ["bos_token", "eos_token", "unk_token", "pad_token"]
            .iter()
            .filter_map(|&k| Some((k.to_owned(), token_text(config.get(k)?)?)))
            .collect();
        // A template that does not parse is refused when loaded, not at the first example.
        Ok(Some(ChatTemplate {
            env: environment(source, path)?,
            special_tokens,
            path: path.to_path_buf(),
            fixed_time: None,
        }))
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
}

/// transformers' Jinja environment (see the module documentation) holding `source` as the
/// template `chat`.
fn environment(source: String, path: &Path) -> Result<minijinja::Environment<'static>> {
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
    env.add_template_owned("chat", source)
        .map_err(|e| err(path, format!("chat template: {e}")))?;
    Ok(env)
}

impl ChatTemplate {
    /// The text of the conversation `messages` (JSON objects with a string `role` and a string
    /// `content`; other keys are passed to the template in their order, null ones dropped as
    /// transformers drops them), ending with the assistant's turn header when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[ChatValue], add_generation_prompt: bool) -> Result<String> {
        let mut clean = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let ChatValue::Object(m) = m else {
                return Err(err(&self.path, format!("message {i} is not an object")));
            };
            for key in ["role", "content"] {
                if !m
                    .iter()
                    .any(|(k, v)| k == key && matches!(v, ChatValue::String(_)))
                {
                    return Err(err(
                        &self.path,
                        format!("message {i} has no string \"{key}\""),
                    ));
                }
            }
            let kept = m
                .iter()
                .filter(|(_, v)| *v != ChatValue::Null)
                .cloned()
                .collect();
            clean.push(ChatValue::Object(kept));
        }
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| err(&self.path, e.to_string()))?;
        let mut context: BTreeMap<String, minijinja::Value> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), minijinja::Value::from(v.as_str())))
            .collect();
        context.insert("messages".into(), minijinja::Value::from_serialize(&clean));
        context.insert(
            "add_generation_prompt".into(),
            minijinja::Value::from(add_generation_prompt),
        );
        let now = self.fixed_time.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64)
        });
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
        Ok(text)
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
        assert!(ChatTemplate::from_config("{}", "c").unwrap().is_none());
        for bad in [
            "[1]",
            "not json",
            r#"{"chat_template": 3}"#,
            r#"{"chat_template": [{"name": "x", "template": "y"}]}"#,
            r#"{"chat_template": "{% for %}"}"#,
        ] {
            let e = ChatTemplate::from_config(bad, "c").unwrap_err().to_string();
            assert!(e.contains('c'), "{bad}: {e}");
        }
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
        for bad in [
            serde_json::json!("text"),
            serde_json::json!({"role": "user"}),
            serde_json::json!({"role": 1, "content": "x"}),
        ] {
            assert!(t.render(&[bad.into()], false).is_err());
        }
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
