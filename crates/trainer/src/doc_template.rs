//! lm-evaluation-harness's document templates: a task's `doc_to_text`, `doc_to_target` and
//! `doc_to_choice`, which turn a dataset's own rows (a Hugging Face split, as JSONL or
//! Parquet) into the prompt, the answer and the choices.
//!
//! ```
//! use headroom_trainer::doc_template::DocTemplates;
//! // ARC's settings (lm-eval's arc_easy.yaml) on one of its rows.
//! let arc = DocTemplates::new(
//!     Some("Question: {{question}}\nAnswer:".into()),
//!     Some("{{choices.label.index(answerKey)}}".into()),
//!     Some("{{choices.text}}".into()),
//! ).unwrap();
//! let row = serde_json::json!({"question": "Which is a gas?", "answerKey": "B",
//!     "choices": {"text": ["ice", "steam"], "label": ["A", "B"]}});
//! let line = arc.question_line(&row).unwrap();
//! assert_eq!(line["context"], "Question: Which is a gas?\nAnswer:");
//! assert_eq!(line["choices"], serde_json::json!(["ice", "steam"]));
//! assert_eq!(line["gold"], 1);
//! ```
//!
//! Each setting is read as lm-eval's `ConfigurableTask` reads it:
//!
//! - the name of one of the document's fields gives that field as it is;
//! - anything else is a Jinja template rendered with the document's fields as variables
//!   (Jinja2 with `StrictUndefined` and `keep_trailing_newline`, as lm-eval's `utils.env`;
//!   here minijinja with Python's string and list methods, `.index()` included);
//! - `doc_to_choice`'s rendering is read as a Python literal (`ast.literal_eval`), so
//!   `{{[sol1, sol2]}}` and `['A', 'B']` are lists;
//! - `doc_to_target`'s is an integer when it is all digits and the task has choices, a list
//!   when it is a Python list literal (`[1, 2]`), else text; `doc_to_text`'s is an integer
//!   when it is all digits and the task has choices (lm-eval's multiple input: the choices
//!   are contexts, the target the continuation).
//!
//! Values print as Python's `str()` prints them (`True`, `None`, `1e+20`, lists and dicts
//! in their `repr`: `['a', "it's"]`), and the filters and string methods minijinja has
//! differently are Jinja2's and Python's: `join`, `int`, `float`, `round`, `title`,
//! `capitalize`, `tojson`, lm-eval's `regex_replace`; `.title()`, `.capitalize()`,
//! `.swapcase()`, `.zfill()`, `.find()` (in characters), `.index()`, `.isdigit()`,
//! `.isdecimal()`. What remains different, none of it in lm-eval's own tasks' settings:
//!
//! - Python's `%` formatting of strings (`'%d' % n`), `str.format`'s `!r`, and the
//!   printf-style `format` filter are not there;
//! - a tuple literal in a template is a list (minijinja has no tuples);
//! - a dict prints and iterates its keys sorted (the documents' JSON objects do not keep
//!   their order);
//! - Unicode's tables are not here: `repr` escapes the controls, format characters and
//!   separators Python's does, but not every unassigned code point; `isdigit` knows the
//!   common digits, superscripts, circled digits, fractions and Roman numerals; `int()`
//!   reads ASCII, Arabic-Indic, Devanagari, Bengali, Thai and fullwidth digits.
//!
//! `tests/doc_templates.rs` checks the settings of 20 of lm-eval's tasks and 52 hand-made
//! cases against what lm-eval 0.4.13 computes (`benches/torch/make_doc_template_fixture.py`).

use minijinja::value::{Value, ValueKind};
use serde_json::Value as Json;

/// The most steps a template's rendering may take (a document's template runs once a
/// document; lm-eval's are a few dozen steps).
const MAX_RENDER_STEPS: u64 = 1_000_000;

/// One of a task's settings as lm-eval's YAML holds it.
#[derive(Clone, Debug, PartialEq)]
pub enum Setting {
    /// Text: a field's name or a Jinja template.
    Template(String),
    /// A value used as it is: YAML's `doc_to_target: 3`, `doc_to_choice: ["A", "B"]` (a
    /// list), or a dict of choices (its values).
    Value(Json),
}

impl From<&str> for Setting {
    fn from(text: &str) -> Setting {
        Setting::Template(text.to_owned())
    }
}

/// A task's `doc_to_text`, `doc_to_target` and `doc_to_choice`, compiled.
#[derive(Debug)]
pub struct DocTemplates {
    env: minijinja::Environment<'static>,
    text: Option<Setting>,
    target: Option<Setting>,
    choice: Option<Setting>,
    /// Whether a document that has a `context` is taken as it is (a task's own settings,
    /// which are for its dataset's rows).
    rows_only: bool,
    /// A task's `process_docs`, run on each row before the settings read it.
    process: Option<ProcessDocs>,
}

/// A task's `process_docs`: a row of its dataset made the document its settings read
/// (lm-eval's are Python functions; headroom's, Rust ones checked against them).
pub type ProcessDocs = fn(&Json) -> Result<Json, String>;

/// One setting's result, with the Python type lm-eval's would have.
#[derive(Clone, Debug, PartialEq)]
pub enum DocValue {
    /// An integer (a choice's index; a multiple-input text's gold context).
    Int(i64),
    /// Text.
    Text(String),
    /// Anything else a field or a literal holds (a list of choices or of golds).
    Json(Json),
}

impl DocTemplates {
    /// The settings (`None` where the task leaves one unset); a template that does not
    /// compile is an error naming the setting.
    pub fn new(
        text: Option<Setting>,
        target: Option<Setting>,
        choice: Option<Setting>,
    ) -> Result<DocTemplates, String> {
        let mut env = minijinja::Environment::new();
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
        env.set_keep_trailing_newline(true);
        env.set_fuel(Some(MAX_RENDER_STEPS));
        env.set_recursion_limit(100);
        env.set_unknown_method_callback(python_method);
        // Jinja2's filters where minijinja's differ from them.
        env.add_filter(
            "join",
            |value: Value, separator: Option<String>| -> Result<String, minijinja::Error> {
                let items = value
                    .try_iter()?
                    .map(|v| python_str(&v).map_err(invalid))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(items.join(separator.as_deref().unwrap_or("")))
            },
        );
        env.add_filter("int", |value: Value, default: Option<Value>| -> Value {
            jinja_int(&value).map_or_else(|| default.unwrap_or(Value::from(0)), Value::from)
        });
        env.add_filter("float", |value: Value, default: Option<Value>| -> Value {
            jinja_float(&value).map_or_else(|| default.unwrap_or(Value::from(0.0)), Value::from)
        });
        env.add_filter(
            "round",
            |value: Value, precision: Option<i32>, method: Option<String>| {
                jinja_round(
                    &value,
                    precision.unwrap_or(0),
                    method.as_deref().unwrap_or("common"),
                )
            },
        );
        env.add_filter("title", |value: String| jinja_title(&value));
        env.add_filter("capitalize", |value: String| python_capitalize(&value));
        env.add_filter(
            "tojson",
            |value: Value| -> Result<Value, minijinja::Error> {
                Ok(Value::from_safe_string(
                    html_safe_json(&value).map_err(invalid)?,
                ))
            },
        );
        // lm-eval's own filter: Python's `re.sub(pattern, repl, string, count=count)`.
        env.add_filter(
            "regex_replace",
            |text: String,
             pattern: String,
             repl: String,
             count: Option<usize>|
             -> Result<String, minijinja::Error> {
                let regex = crate::generation::PyRegex::new(&pattern)
                    .map_err(|e| invalid(e.to_string()))?;
                regex
                    .sub(&text, &repl, count.unwrap_or(0))
                    .map_err(|e| invalid(e.to_string()))
            },
        );
        env.set_formatter(|out, _state, value| {
            let text = python_str(value)
                .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e))?;
            out.write_str(&text).map_err(|e| {
                minijinja::Error::new(minijinja::ErrorKind::WriteFailure, e.to_string())
            })
        });
        for (name, setting) in [
            ("doc_to_text", &text),
            ("doc_to_target", &target),
            ("doc_to_choice", &choice),
        ] {
            if let Some(Setting::Template(t)) = setting {
                env.template_from_str(t)
                    .map_err(|e| format!("{name} {t:?} is not a Jinja template: {e}"))?;
            }
        }
        Ok(DocTemplates {
            env,
            text,
            target,
            choice,
            rows_only: false,
            process: None,
        })
    }

    /// These settings after the task's `process_docs`.
    pub fn with_process_docs(mut self, process: Option<ProcessDocs>) -> DocTemplates {
        self.process = process;
        self
    }

    /// The document the settings read: the row after `process_docs`, if any.
    fn processed(&self, doc: &Json) -> Result<Json, String> {
        match self.process {
            Some(process) => process(doc),
            None => Ok(doc.clone()),
        }
    }

    /// These settings for a dataset's own rows only: a document already in headroom's shape
    /// (a question's `gold`; a generation document's `context` and `target`) is read as it is.
    pub fn only_for_dataset_rows(mut self) -> DocTemplates {
        self.rows_only = true;
        self
    }

    /// Whether `doc` is read as it is: with settings for rows only, a document already in
    /// headroom's shape: a question with its `gold`, a generation document with its `context`
    /// and `target` (a dataset's row may well have a `context` of its own, SocialIQA's).
    fn passes_through(&self, doc: &Json, shape: &[&str]) -> bool {
        self.rows_only && shape.iter().all(|key| doc.get(key).is_some())
    }

    fn render(&self, template: &str, doc: &Json, name: &str) -> Result<String, String> {
        let variables = Value::from_serialize(doc);
        self.env
            .render_str(template, variables)
            .map_err(|e| format!("{name} {template:?}: {e}"))
    }

    /// `doc_to_text` of `doc`, or `None` when unset.
    pub fn text(&self, doc: &Json) -> Result<Option<DocValue>, String> {
        let t = match &self.text {
            None => return Ok(None),
            Some(Setting::Value(Json::Number(n))) if n.is_i64() => {
                return Ok(Some(DocValue::Int(n.as_i64().expect("checked"))))
            }
            Some(Setting::Value(v)) => {
                return Err(format!("doc_to_text {v} is neither text nor an integer"))
            }
            Some(Setting::Template(t)) => t,
        };
        if let Some(field) = doc.get(t) {
            return Ok(Some(raw(field)));
        }
        let s = self.render(t, doc, "doc_to_text")?;
        Ok(Some(match self.choice.is_some() && is_digits(&s) {
            true => DocValue::Int(digits(&s)?),
            false => DocValue::Text(s),
        }))
    }

    /// `doc_to_target` of `doc`, or `None` when unset.
    pub fn target(&self, doc: &Json) -> Result<Option<DocValue>, String> {
        let t = match &self.target {
            None => return Ok(None),
            Some(Setting::Value(Json::Number(n))) if n.is_i64() => {
                return Ok(Some(DocValue::Int(n.as_i64().expect("checked"))))
            }
            Some(Setting::Value(v @ Json::Array(_))) => return Ok(Some(DocValue::Json(v.clone()))),
            Some(Setting::Value(v)) => {
                return Err(format!(
                    "doc_to_target {v} is neither text, an integer nor a list"
                ))
            }
            Some(Setting::Template(t)) => t,
        };
        if let Some(field) = doc.get(t) {
            return Ok(Some(raw(field)));
        }
        let s = self.render(t, doc, "doc_to_target")?;
        if self.choice.is_some() && is_digits(&s) {
            return Ok(Some(DocValue::Int(digits(&s)?)));
        }
        if s.len() >= 2 && s.starts_with('[') && s.ends_with(']') {
            if let Ok(list) = python_literal(&s) {
                return Ok(Some(DocValue::Json(list)));
            }
        }
        Ok(Some(DocValue::Text(s)))
    }

    /// `doc_to_choice` of `doc`, or `None` when unset.
    pub fn choice(&self, doc: &Json) -> Result<Option<Json>, String> {
        let t = match &self.choice {
            None => return Ok(None),
            Some(Setting::Value(Json::Array(items))) => {
                return Ok(Some(Json::Array(items.clone())))
            }
            Some(Setting::Value(Json::Object(map))) => {
                return Ok(Some(Json::Array(map.values().cloned().collect())))
            }
            Some(Setting::Value(v)) => {
                return Err(format!(
                    "doc_to_choice {v} is neither text, a list nor a dict"
                ))
            }
            Some(Setting::Template(t)) => t,
        };
        if let Some(field) = doc.get(t) {
            return Ok(Some(field.clone()));
        }
        let s = self.render(t, doc, "doc_to_choice")?;
        python_literal(&s)
            .map(Some)
            .map_err(|e| format!("doc_to_choice {t:?} rendered {s:?}, not a Python literal: {e}"))
    }

    /// A multiple-choice document as `choices::Question` reads it: `context`, `choices` and
    /// `gold` (or, for multiple input, `choices` as the contexts, `continuation` and `gold`),
    /// with the document itself under `doc` (lm-eval compares whole documents to keep a
    /// question out of its own few-shot examples). Settings left unset keep the document's
    /// own `context`, `choices` and `gold`.
    pub fn question_line(&self, doc: &Json) -> Result<Json, String> {
        if self.passes_through(doc, &["gold"]) {
            return Ok(doc.clone());
        }
        let doc = &self.processed(doc)?;
        let mut line = serde_json::Map::new();
        let keep = |key: &str, line: &mut serde_json::Map<String, Json>| {
            if let Some(v) = doc.get(key) {
                line.insert(key.into(), v.clone());
            }
        };
        match self.choice(doc)? {
            Some(choices) => {
                line.insert("choices".into(), text_list(choices)?);
            }
            None => keep("choices", &mut line),
        }
        let text = self.text(doc)?;
        let target = self.target(doc)?;
        match (text, target) {
            (Some(DocValue::Int(gold)), target) => {
                // Multiple input: the choices are contexts, the target what follows them.
                let continuation = match target {
                    Some(DocValue::Text(s)) => s,
                    Some(other) => {
                        return Err(format!(
                            "a multiple-input document's target must be text, not {other:?}"
                        ))
                    }
                    None => return Err("multiple input needs doc_to_target".into()),
                };
                line.insert("continuation".into(), Json::String(continuation));
                line.insert("gold".into(), Json::from(gold));
            }
            (text, target) => {
                for (key, value) in [("context", text), ("gold", target)] {
                    match value {
                        Some(v) => {
                            line.insert(key.into(), v.into_json());
                        }
                        None => keep(key, &mut line),
                    }
                }
            }
        }
        line.insert("doc".into(), doc.clone());
        Ok(Json::Object(line))
    }

    /// A generation document as `generation::GenerationDoc` reads it: the document's own
    /// fields, with `context` and `target` set from `doc_to_text` and `doc_to_target` (a
    /// filter such as `multi_choice_regex` reads the document's other fields, as lm-eval's
    /// read the dataset's row).
    pub fn generation_line(&self, doc: &Json) -> Result<Json, String> {
        if self.passes_through(doc, &["context", "target"]) {
            return Ok(doc.clone());
        }
        let doc = &self.processed(doc)?;
        let mut line = match doc {
            Json::Object(m) => m.clone(),
            _ => return Err("not a JSON object".into()),
        };
        let text = self.text(doc)?;
        if let Some(DocValue::Int(i)) = text {
            return Err(format!(
                "doc_to_text gave the integer {i}: multiple input is for multiple-choice tasks"
            ));
        }
        for (key, value) in [("context", text), ("target", self.target(doc)?)] {
            if let Some(v) = value {
                line.insert(key.into(), v.into_json());
            }
        }
        Ok(Json::Object(line))
    }
}

impl DocValue {
    /// The value as a document line holds it.
    fn into_json(self) -> Json {
        match self {
            DocValue::Int(i) => Json::from(i),
            DocValue::Text(s) => Json::String(s),
            DocValue::Json(v) => v,
        }
    }
}

/// A field's value as lm-eval returns it (`doc[name]`).
fn raw(field: &Json) -> DocValue {
    match field {
        Json::String(s) => DocValue::Text(s.clone()),
        Json::Number(n) if n.is_i64() => DocValue::Int(n.as_i64().expect("checked")),
        other => DocValue::Json(other.clone()),
    }
}

/// Choices must be texts (lm-eval measures each one's length).
fn text_list(choices: Json) -> Result<Json, String> {
    match choices {
        Json::Array(items) => Ok(Json::Array(items)),
        // lm-eval's dict setting gives its values.
        Json::Object(map) => Ok(Json::Array(map.into_iter().map(|(_, v)| v).collect())),
        other => Err(format!("doc_to_choice gave {other}, not a list")),
    }
}

/// Python's `str.isdigit()` (as far as [`python_digit`] knows it).
fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| python_digit(c, false))
}

/// `ast.literal_eval` of text `isdigit` accepted: an ASCII integer without leading zeros
/// (`0` and `000` read, `007` and another script's digits are Python's SyntaxError).
fn digits(s: &str) -> Result<i64, String> {
    let ascii = s.bytes().all(|b| b.is_ascii_digit());
    let leading_zero = s.len() > 1 && s.starts_with('0') && s.bytes().any(|b| b != b'0');
    if !ascii || leading_zero {
        return Err(format!(
            "{s:?} is no Python integer literal (lm-eval's SyntaxError)"
        ));
    }
    s.parse()
        .map_err(|_| format!("{s} does not fit an integer"))
}

fn invalid(why: impl Into<String>) -> minijinja::Error {
    minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, why.into())
}

/// The code points of `0` in the scripts whose decimal digits Python's `int()` reads besides
/// ASCII's (Arabic-Indic, Extended Arabic-Indic, Devanagari, Bengali, Thai, fullwidth).
const DIGIT_ZEROS: [u32; 6] = [0x660, 0x6f0, 0x966, 0x9e6, 0xe50, 0xff10];

/// A decimal digit's value: ASCII's and [`DIGIT_ZEROS`]' scripts'.
fn decimal_value(c: char) -> Option<u32> {
    let n = c as u32;
    if c.is_ascii_digit() {
        return Some(n - '0' as u32);
    }
    DIGIT_ZEROS
        .iter()
        .find(|&&z| (z..z + 10).contains(&n))
        .map(|z| n - z)
}

/// A string's digits made ASCII, for Python's number parsing (`int(" ٣٤ ")` is 34).
fn ascii_digits(s: &str) -> String {
    s.trim()
        .chars()
        .map(|c| decimal_value(c).map_or(c, |d| char::from(b'0' + d as u8)))
        .collect()
}

/// Python's `int(text)`: a sign, digits, and underscores between digits.
fn python_int_text(text: &str) -> Option<i128> {
    let s = ascii_digits(text);
    let body = s.strip_prefix(['+', '-']).unwrap_or(&s);
    let ok = !body.is_empty()
        && !body.starts_with('_')
        && !body.ends_with('_')
        && !body.contains("__")
        && body.chars().all(|c| c.is_ascii_digit() || c == '_');
    ok.then(|| s.replace('_', "").parse().ok()).flatten()
}

/// Python's `float(text)`.
fn python_float_text(text: &str) -> Option<f64> {
    let s = ascii_digits(text);
    let lower = s.to_ascii_lowercase();
    let unsigned = lower.trim_start_matches(['+', '-']);
    if ["inf", "infinity", "nan"].contains(&unsigned) {
        return lower.parse().ok();
    }
    if s.contains("__") || s.starts_with('_') || s.ends_with('_') {
        return None;
    }
    s.replace('_', "").parse().ok()
}

/// Jinja2's `int` filter: Python's `int()`, else `int(float())`, else `None` (the default).
fn jinja_int(value: &Value) -> Option<i128> {
    // Python's integers have no bound; 128 bits hold every float below 1.7e38.
    let truncated = |f: f64| (f.is_finite() && f.abs() < 1.7e38).then_some(f as i128);
    match value.kind() {
        ValueKind::String => {
            let s = value.as_str().unwrap_or_default();
            python_int_text(s).or_else(|| python_float_text(s).and_then(truncated))
        }
        ValueKind::Bool => Some(i128::from(value.is_true())),
        ValueKind::Number if value.is_integer() => i128::try_from(value.clone()).ok(),
        ValueKind::Number => f64::try_from(value.clone()).ok().and_then(truncated),
        _ => None,
    }
}

/// Jinja2's `float` filter.
fn jinja_float(value: &Value) -> Option<f64> {
    match value.kind() {
        ValueKind::String => python_float_text(value.as_str().unwrap_or_default()),
        ValueKind::Bool => Some(if value.is_true() { 1.0 } else { 0.0 }),
        ValueKind::Number => f64::try_from(value.clone()).ok(),
        _ => None,
    }
}

/// Jinja2's `round` filter: Python's `round(value, precision)` (`common`, correctly rounded
/// from the binary value, as Rust's formatting is), or floor or ceil; always a float.
fn jinja_round(value: &Value, precision: i32, method: &str) -> Result<Value, minijinja::Error> {
    let x = f64::try_from(value.clone()).map_err(|_| invalid(format!("round of {value}")))?;
    let scale = 10f64.powi(precision);
    let rounded = match method {
        "common" if precision >= 0 => format!("{x:.*}", precision as usize).parse().unwrap_or(x),
        "common" => (x * scale).round_ties_even() / scale,
        "floor" => (x * scale).floor() / scale,
        "ceil" => (x * scale).ceil() / scale,
        other => return Err(invalid(format!("round's method {other:?}"))),
    };
    Ok(Value::from(rounded))
}

/// Python's title case of a character (`ǆ` is `ǅ`, `ﬁ` is `Fi`), else its upper case.
fn title_char(c: char) -> String {
    match c {
        'Ǆ' | 'ǅ' | 'ǆ' => "ǅ".into(),
        'Ǉ' | 'ǈ' | 'ǉ' => "ǈ".into(),
        'Ǌ' | 'ǋ' | 'ǌ' => "ǋ".into(),
        'Ǳ' | 'ǲ' | 'ǳ' => "ǲ".into(),
        'ﬀ' => "Ff".into(),
        'ﬁ' => "Fi".into(),
        'ﬂ' => "Fl".into(),
        'ﬃ' => "Ffi".into(),
        'ﬄ' => "Ffl".into(),
        'ﬅ' | 'ﬆ' => "St".into(),
        c => c.to_uppercase().collect(),
    }
}

fn cased(c: char) -> bool {
    c.is_lowercase() || c.is_uppercase() || matches!(c, 'ǅ' | 'ǈ' | 'ǋ' | 'ǲ')
}

/// Python's `str.title()`: a cased character after an uncased one in title case, the others
/// in lower case (`o'neil` is `O'Neil`, `2pm` is `2Pm`).
fn python_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut previous_cased = false;
    for c in s.chars() {
        if cased(c) {
            if previous_cased {
                out.extend(c.to_lowercase());
            } else {
                out.push_str(&title_char(c));
            }
            previous_cased = true;
        } else {
            out.push(c);
            previous_cased = false;
        }
    }
    out
}

/// Python's `str.capitalize()`: the first character in title case, the rest in lower case.
pub(crate) fn python_capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(first) => title_char(first) + &chars.as_str().to_lowercase(),
        None => String::new(),
    }
}

/// Jinja2's `title` filter: each piece between runs of whitespace, `-`, `(`, `{`, `[`, `<`
/// with its first character upper-cased and the rest lower-cased (`o'neil` is `O'neil`).
fn jinja_title(s: &str) -> String {
    let separator = |c: char| c.is_whitespace() || matches!(c, '-' | '(' | '{' | '[' | '<');
    let mut out = String::with_capacity(s.len());
    let mut at_start = true;
    for c in s.chars() {
        if separator(c) {
            out.push(c);
            at_start = true;
        } else if at_start {
            out.extend(c.to_uppercase());
            at_start = false;
        } else {
            out.extend(c.to_lowercase());
        }
    }
    out
}

/// Python's `str.swapcase()`.
fn python_swapcase(s: &str) -> String {
    s.chars()
        .flat_map(|c| -> Box<dyn Iterator<Item = char>> {
            if c.is_uppercase() {
                Box::new(c.to_lowercase())
            } else if c.is_lowercase() {
                Box::new(c.to_uppercase())
            } else {
                Box::new(std::iter::once(c))
            }
        })
        .collect()
}

/// Python's `str.isdecimal()` and `str.isdigit()` for one character, as far as known here:
/// a decimal digit of any script is numeric and not a superscript, subscript, circled or
/// parenthesised digit, fraction or Roman numeral (`isdigit` adds the superscripts and the
/// circled digits).
fn python_digit(c: char, decimal_only: bool) -> bool {
    let n = c as u32;
    let superscript = matches!(n, 0xb2 | 0xb3 | 0xb9 | 0x2070..=0x2079 | 0x2080..=0x2089);
    let circled = matches!(n, 0x2460..=0x249b | 0x24ea..=0x24ff | 0x2776..=0x2793);
    let other = matches!(n, 0xbc..=0xbe | 0x2150..=0x218b | 0x3007 | 0x3021..=0x3029);
    c.is_numeric() && !other && (!decimal_only || !(superscript || circled))
}

/// Jinja2's `tojson`: Python's `json.dumps(value, sort_keys=True)` (ASCII only, `", "` and
/// `": "` between items) with `<`, `>`, `&` and `'` escaped for HTML.
fn html_safe_json(value: &Value) -> Result<String, String> {
    Ok(crate::chat_template::python_json_dumps(value, true, true)?
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
        .replace('\'', "\\u0027"))
}

/// `.index()` on lists and strings (Python's, an error when absent), Python's string
/// methods minijinja-contrib's `pycompat` lacks or differs in (`title`, `capitalize`,
/// `swapcase`, `zfill`, `isdigit`, `isdecimal`, `isnumeric`), then pycompat's string, dict
/// and list methods.
fn python_method(
    state: &minijinja::State<'_, '_>,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, minijinja::Error> {
    if method == "index" {
        let [needle] = args else {
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                "index() takes one argument here",
            ));
        };
        let missing = || {
            minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("{needle} is not in {value} (Python's ValueError)"),
            )
        };
        return match value.kind() {
            ValueKind::Seq => {
                let position = value
                    .try_iter()?
                    .position(|item| item == *needle)
                    .ok_or_else(missing)?;
                Ok(Value::from(position))
            }
            ValueKind::String => {
                let (hay, sub) = (value.to_string(), needle.to_string());
                let byte = hay.find(&sub).ok_or_else(missing)?;
                Ok(Value::from(hay[..byte].chars().count()))
            }
            _ => Err(minijinja::Error::from(minijinja::ErrorKind::UnknownMethod)),
        };
    }
    if let (Some(text), []) = (value.as_str(), args) {
        let all = |f: fn(char) -> bool| Value::from(!text.is_empty() && text.chars().all(f));
        match method {
            "title" => return Ok(Value::from(python_title(text))),
            "capitalize" => return Ok(Value::from(python_capitalize(text))),
            "swapcase" => return Ok(Value::from(python_swapcase(text))),
            "isdecimal" => return Ok(all(|c| python_digit(c, true))),
            "isdigit" => return Ok(all(|c| python_digit(c, false))),
            "isnumeric" => return Ok(all(char::is_numeric)),
            _ => {}
        }
    }
    if let (Some(text), "find" | "rfind", [needle]) = (value.as_str(), method, args) {
        // Python counts characters, not bytes.
        let needle = needle.to_string();
        let byte = if method == "find" {
            text.find(&needle)
        } else {
            text.rfind(&needle)
        };
        return Ok(Value::from(
            byte.map_or(-1, |b| text[..b].chars().count() as i64),
        ));
    }
    if let (Some(text), "zfill", [width]) = (value.as_str(), method, args) {
        let width = usize::try_from(width.clone()).map_err(|_| invalid("zfill's width"))?;
        let len = text.chars().count();
        if len >= width {
            return Ok(Value::from(text));
        }
        let (sign, rest) = match text.chars().next() {
            Some(c @ ('+' | '-')) => (c.to_string(), &text[1..]),
            _ => (String::new(), text),
        };
        return Ok(Value::from(format!(
            "{sign}{}{rest}",
            "0".repeat(width - len)
        )));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// What Python's `str()` prints for a value, as Jinja2 renders `{{ value }}`.
fn python_str(value: &Value) -> Result<String, String> {
    match value.kind() {
        ValueKind::String => Ok(value.as_str().unwrap_or_default().to_owned()),
        ValueKind::Undefined => Ok(String::new()),
        _ => python_repr(value),
    }
}

/// Python's `repr()` of a value.
fn python_repr(value: &Value) -> Result<String, String> {
    Ok(match value.kind() {
        ValueKind::None => "None".into(),
        // Jinja2 prints an undefined value inside a list (`[nope]`) by its class's name.
        ValueKind::Undefined => "Undefined".into(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number if value.is_integer() => value.to_string(),
        ValueKind::Number => match f64::try_from(value.clone()) {
            Ok(f) => python_float(f),
            Err(_) => value.to_string(),
        },
        ValueKind::String => python_string_repr(value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items = value
                .try_iter()
                .map_err(|e| e.to_string())?
                .map(|v| python_repr(&v))
                .collect::<Result<Vec<_>, _>>()?;
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let mut items = Vec::new();
            for key in value.try_iter().map_err(|e| e.to_string())? {
                let item = value.get_item(&key).map_err(|e| e.to_string())?;
                items.push(format!("{}: {}", python_repr(&key)?, python_repr(&item)?));
            }
            format!("{{{}}}", items.join(", "))
        }
        _ => value.to_string(),
    })
}

/// Python's `repr()` of a float: the shortest digits that read back, in positional notation
/// for exponents from -4 to 15 and scientific (`1e+20`, `1e-07`) outside.
pub(crate) fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    let sci = format!("{f:e}"); // shortest digits: "1.5e-7", "-3e20", "0e0"
    let (mantissa, exp) = sci.split_once('e').expect("{:e} writes an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// Python's `repr()` of a string: single quotes unless it holds one and no double quote.
fn python_string_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !printable(c) => {
                let n = c as u32;
                out.push_str(&match n {
                    0..=0xff => format!("\\x{n:02x}"),
                    0x100..=0xffff => format!("\\u{n:04x}"),
                    _ => format!("\\U{n:08x}"),
                });
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python's `str.isprintable()` for one character, as far as it can be known without
/// Unicode's tables: controls, format characters, separators other than the space, private
/// use and noncharacters are not printable.
fn printable(c: char) -> bool {
    let n = c as u32;
    !matches!(n,
        0..=0x1f | 0x7f..=0xa0 | 0xad | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x890..=0x891
        | 0x8e2 | 0x1680 | 0x180e | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064
        | 0x2066..=0x206f | 0x3000 | 0xd800..=0xf8ff | 0xfdd0..=0xfdef | 0xfeff
        | 0xfff9..=0xfffb | 0x110bd | 0x110cd | 0x13430..=0x1343f | 0x1bca0..=0x1bca3
        | 0x1d173..=0x1d17a | 0xe0001 | 0xe0020..=0xe007f | 0xf0000..=0x10ffff)
        && (n & 0xfffe) != 0xfffe
}

/// A Python literal as `ast.literal_eval` reads it: strings, numbers, `True`, `False`,
/// `None`, lists, tuples (as arrays) and dicts with string keys.
pub fn python_literal(text: &str) -> Result<Json, String> {
    let mut p = Literal {
        chars: text.chars().collect(),
        pos: 0,
        depth: 0,
    };
    let value = p.value()?;
    p.space();
    if p.pos != p.chars.len() {
        return Err(format!("unexpected {:?} after the value", p.chars[p.pos]));
    }
    Ok(value)
}

struct Literal {
    chars: Vec<char>,
    pos: usize,
    depth: usize,
}

impl Literal {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn space(&mut self) {
        while self
            .peek()
            .is_some_and(|c| c == ' ' || c == '\t' || c == '\n' || c == '\r')
        {
            self.pos += 1;
        }
    }

    fn value(&mut self) -> Result<Json, String> {
        self.space();
        let Some(c) = self.peek() else {
            return Err("nothing to read".into());
        };
        match c {
            '[' | '(' => self.sequence(if c == '[' { ']' } else { ')' }),
            '{' => self.dict(),
            '\'' | '"' => self.strings(),
            'r' | 'R' | 'u' | 'U' if matches!(self.chars.get(self.pos + 1), Some('\'' | '"')) => {
                self.strings()
            }
            c if c.is_ascii_digit() || c == '-' || c == '+' || c == '.' => self.number(),
            _ => {
                let word: String = self.chars[self.pos..]
                    .iter()
                    .take_while(|c| c.is_alphanumeric() || **c == '_')
                    .collect();
                self.pos += word.chars().count();
                match word.as_str() {
                    "True" => Ok(Json::Bool(true)),
                    "False" => Ok(Json::Bool(false)),
                    "None" => Ok(Json::Null),
                    "" => Err(format!("unexpected {c:?}")),
                    other => Err(format!("{other} is not a literal")),
                }
            }
        }
    }

    fn nested<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T, String>) -> Result<T, String> {
        if self.depth >= 64 {
            return Err("nested too deep".into());
        }
        self.depth += 1;
        let out = f(self);
        self.depth -= 1;
        out
    }

    fn sequence(&mut self, close: char) -> Result<Json, String> {
        self.pos += 1;
        self.nested(|p| {
            let mut items = Vec::new();
            loop {
                p.space();
                if p.peek() == Some(close) {
                    p.pos += 1;
                    return Ok(Json::Array(items));
                }
                items.push(p.value()?);
                p.space();
                match p.peek() {
                    Some(',') => p.pos += 1,
                    Some(c) if c == close => {}
                    Some(c) => return Err(format!("unexpected {c:?} in a list")),
                    None => return Err("an unclosed list".into()),
                }
            }
        })
    }

    fn dict(&mut self) -> Result<Json, String> {
        self.pos += 1;
        self.nested(|p| {
            let mut map = serde_json::Map::new();
            loop {
                p.space();
                if p.peek() == Some('}') {
                    p.pos += 1;
                    return Ok(Json::Object(map));
                }
                let key = match p.value()? {
                    Json::String(s) => s,
                    other => other.to_string(),
                };
                p.space();
                if p.peek() != Some(':') {
                    return Err("a dict entry without ':'".into());
                }
                p.pos += 1;
                let value = p.value()?;
                map.insert(key, value);
                p.space();
                match p.peek() {
                    Some(',') => p.pos += 1,
                    Some('}') => {}
                    Some(c) => return Err(format!("unexpected {c:?} in a dict")),
                    None => return Err("an unclosed dict".into()),
                }
            }
        })
    }

    /// One or more adjacent string literals, joined (`'a' 'b'` is `'ab'`).
    fn strings(&mut self) -> Result<Json, String> {
        let mut out = String::new();
        loop {
            out.push_str(&self.string()?);
            self.space();
            match self.peek() {
                Some('\'' | '"') => continue,
                Some('r' | 'R' | 'u' | 'U')
                    if matches!(self.chars.get(self.pos + 1), Some('\'' | '"')) =>
                {
                    continue
                }
                _ => return Ok(Json::String(out)),
            }
        }
    }

    fn string(&mut self) -> Result<String, String> {
        let mut raw_string = false;
        if let Some(p) = self.peek().filter(|c| c.is_ascii_alphabetic()) {
            raw_string = p == 'r' || p == 'R';
            self.pos += 1;
        }
        let quote = self.peek().ok_or("an unclosed string")?;
        let triple = self.chars.get(self.pos..self.pos + 3) == Some(&[quote; 3][..]);
        self.pos += if triple { 3 } else { 1 };
        let mut out = String::new();
        loop {
            let c = self.peek().ok_or("an unclosed string")?;
            if c == quote
                && (!triple || self.chars.get(self.pos..self.pos + 3) == Some(&[quote; 3][..]))
            {
                self.pos += if triple { 3 } else { 1 };
                return Ok(out);
            }
            if c == '\n' && !triple {
                return Err("a newline inside a string".into());
            }
            self.pos += 1;
            if c != '\\' {
                out.push(c);
                continue;
            }
            let e = self.peek().ok_or("an unclosed string")?;
            self.pos += 1;
            if raw_string {
                out.push('\\');
                out.push(e);
                continue;
            }
            match e {
                '\n' => {}
                '\\' | '\'' | '"' => out.push(e),
                'n' => out.push('\n'),
                't' => out.push('\t'),
                'r' => out.push('\r'),
                'a' => out.push('\u{7}'),
                'b' => out.push('\u{8}'),
                'f' => out.push('\u{c}'),
                'v' => out.push('\u{b}'),
                '0'..='7' => {
                    let mut n = e.to_digit(8).expect("octal");
                    for _ in 0..2 {
                        match self.peek().and_then(|c| c.to_digit(8)) {
                            Some(d) => {
                                n = n * 8 + d;
                                self.pos += 1;
                            }
                            None => break,
                        }
                    }
                    out.push(char::from_u32(n).ok_or("a bad octal escape")?);
                }
                'x' | 'u' | 'U' => {
                    let len = match e {
                        'x' => 2,
                        'u' => 4,
                        _ => 8,
                    };
                    let hex: String = self
                        .chars
                        .get(self.pos..self.pos + len)
                        .ok_or("a short escape")?
                        .iter()
                        .collect();
                    let n = u32::from_str_radix(&hex, 16).map_err(|_| "a bad hex escape")?;
                    out.push(char::from_u32(n).ok_or("an escape that is no character")?);
                    self.pos += len;
                }
                other => {
                    // Python keeps an unknown escape as written.
                    out.push('\\');
                    out.push(other);
                }
            }
        }
    }

    fn number(&mut self) -> Result<Json, String> {
        let start = self.pos;
        let mut negative = false;
        while let Some(c @ ('-' | '+')) = self.peek() {
            negative ^= c == '-';
            self.pos += 1;
            self.space();
        }
        let digits_start = self.pos;
        while self.peek().is_some_and(|c| {
            c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '+' || c == '-'
        }) {
            // A sign continues a number only right after its exponent's `e`.
            if matches!(self.peek(), Some('+' | '-'))
                && !matches!(self.chars.get(self.pos - 1), Some('e' | 'E'))
            {
                break;
            }
            self.pos += 1;
        }
        let body: String = self.chars[digits_start..self.pos]
            .iter()
            .filter(|&&c| c != '_')
            .collect();
        let sign = if negative { "-" } else { "" };
        if body.chars().all(|c| c.is_ascii_digit()) && !body.is_empty() {
            let text = format!("{sign}{body}");
            if body.len() > 1 && body.starts_with('0') && body.chars().any(|c| c != '0') {
                return Err(format!("{text}: leading zeros in an integer"));
            }
            return text
                .parse::<i64>()
                .map(Json::from)
                .or_else(|_| text.parse::<u64>().map(Json::from))
                .map_err(|_| format!("{text} does not fit 64 bits"));
        }
        let f: f64 = body.parse().map_err(|_| {
            format!(
                "{:?} is not a number",
                &self.chars[start..self.pos].iter().collect::<String>()
            )
        })?;
        let f = if negative { -f } else { f };
        serde_json::Number::from_f64(f)
            .map(Json::Number)
            .ok_or_else(|| format!("{f} has no JSON form"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn python_floats_print_as_python_prints_them() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e20, "1e+20"),
            (1e-7, "1e-07"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (-2.5e-5, "-2.5e-05"),
            (123456.789, "123456.789"),
        ] {
            assert_eq!(python_float(f), want);
        }
    }

    #[test]
    fn literals_read_as_literal_eval_reads_them() {
        let cases = [
            ("['A', 'B']", serde_json::json!(["A", "B"])),
            (
                "(1, -2.5, True, None)",
                serde_json::json!([1, -2.5, true, null]),
            ),
            (
                "{'a': [1, 2], 'b': 'x'}",
                serde_json::json!({"a": [1, 2], "b": "x"}),
            ),
            ("\"it's\"", serde_json::json!("it's")),
            ("'a\\nb\\x41\\u00e9\\t'", serde_json::json!("a\nbA\u{e9}\t")),
            ("'ab' \"cd\"", serde_json::json!("abcd")),
            ("[[], [1, [2]], ]", serde_json::json!([[], [1, [2]]])),
            ("1e-07", serde_json::json!(1e-7)),
        ];
        for (text, want) in cases {
            assert_eq!(python_literal(text).unwrap(), want, "{text}");
        }
        for bad in ["[1, 2", "abc", "'open", "[1] 2", "007", "{1: }", ""] {
            assert!(python_literal(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        /// A list of strings printed as Python's repr reads back as the same list.
        #[test]
        fn string_reprs_read_back(items in prop::collection::vec(any::<String>(), 0..6)) {
            let value = Value::from_serialize(&items);
            let text = python_repr(&value).unwrap();
            prop_assert_eq!(python_literal(&text).unwrap(), serde_json::json!(items));
        }
    }
}
