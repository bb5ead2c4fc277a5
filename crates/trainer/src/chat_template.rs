//! A Hugging Face chat template: the Jinja program in a tokenizer's `tokenizer_config.json`
//! that turns a conversation (`[{"role": …, "content": …}, …]`) into the text a chat model
//! was trained on, rendered as transformers' `apply_chat_template` renders it.
//!
//! ```
//! use headroom_trainer::chat_template::ChatTemplate;
//! let config = r#"{"chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content.strip() }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
//!                  "eos_token": "</s>"}"#;
//! let chat = ChatTemplate::from_config(config, "tokenizer_config.json").unwrap().unwrap();
//! let messages = serde_json::json!([{"role": "user", "content": " hi "}]);
//! let text = chat.render(messages.as_array().unwrap(), true).unwrap();
//! assert_eq!(text, "<|user|>hi</s><|assistant|>");
//! ```
//!
//! The environment is transformers': blocks trimmed (`trim_blocks`, `lstrip_blocks`), loop
//! controls, `raise_exception(message)` (an error naming the template), Python's string and
//! dict methods (`.strip()`, `.startswith()`, `.items()`; minijinja-contrib's `pycompat`), and
//! the tokenizer's special tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`) beside
//! `messages` and `add_generation_prompt`. Not provided: `strftime_now` (templates that use it
//! test `is defined` and fall back to a fixed date, so renders are reproducible), tools and
//! documents, and the `{% generation %}` tag of `return_assistant_tokens_mask`.
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

/// A chat template, parsed once, with the special tokens it may refer to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    special_tokens: BTreeMap<String, String>,
    path: PathBuf,
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
        }))
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
    /// `content`; other keys are passed to the template, null ones dropped as transformers
    /// drops them), ending with the assistant's turn header when `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut clean = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let Some(m) = m.as_object() else {
                return Err(err(&self.path, format!("message {i} is not an object")));
            };
            for key in ["role", "content"] {
                if !m.get(key).is_some_and(|v| v.is_string()) {
                    return Err(err(
                        &self.path,
                        format!("message {i} has no string \"{key}\""),
                    ));
                }
            }
            let kept: serde_json::Map<_, _> = m
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            clean.push(serde_json::Value::Object(kept));
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

    fn user(text: &str) -> Vec<serde_json::Value> {
        vec![serde_json::json!({"role": "user", "content": text})]
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
            assert!(t.render(&[bad], false).is_err());
        }
        // Null keys are dropped, others passed through.
        let m = serde_json::json!({"role": "user", "content": "x", "name": null, "tag": "t"});
        let t = template("{% for m in messages %}{{ m.tag }}{{ m.name is defined }}{% endfor %}");
        assert_eq!(t.render(&[m], false).unwrap(), "tFalse");
    }
}
