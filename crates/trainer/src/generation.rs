//! Generation tasks as EleutherAI's lm-evaluation-harness runs its `generate_until` tasks
//! (GSM8K, TriviaQA, Natural Questions): each document's context continued greedily until a
//! stop string, the answer taken out of the text by the task's filters (a regex and
//! `take_first`), and `exact_match` against the document's target under each filter.
//!
//! ```
//! use headroom_trainer::generation::{ExactMatch, FilterPipeline, PyRegex};
//! // GSM8K's "strict-match" filter and its exact_match settings.
//! let filters = FilterPipeline::parse_list(&serde_json::json!([{"name": "strict-match",
//!     "filter": [{"function": "regex", "regex_pattern": "#### (\\-?[0-9\\.\\,]+)"},
//!                {"function": "take_first"}]}])).unwrap();
//! let answer = filters[0].apply(&[" 3 + 4 = 7 apples.\n#### 7.\n".into()]).unwrap();
//! assert_eq!(answer, "7.");
//! let metric = ExactMatch {
//!     regexes_to_ignore: [",", "\\$", "(?s).*#### ", "\\.$"]
//!         .iter().map(|r| PyRegex::new(r).unwrap()).collect(),
//!     ignore_case: true,
//!     ..ExactMatch::default()
//! };
//! assert!(metric.matches(&answer, &["She has #### 7".to_string()]).unwrap());
//! ```
//!
//! A document is one JSON line: `context` (the prompt's text, before any few-shot examples)
//! and `target`, a text or a list of texts (any of them right; a few-shot example shows the
//! first, as lm-eval does). Each document runs as lm-eval's `HFLM.generate_until` runs it at
//! batch size 1:
//!
//! - the context is encoded with the tokenizer's special tokens unless it starts with the
//!   `bos_token`'s text, and cut from the left to the model's context less `max_gen_toks`;
//! - greedy decoding (the argmax, transformers' `do_sample=False`) for at most
//!   `max_gen_toks` tokens, stopping after an end-of-sequence token (the tokenizer's and the
//!   generation config's) or once the text holds a stop string;
//! - the text is the new tokens decoded without special tokens, cut at each stop string in
//!   turn (`text.split(s)[0]`); the stop strings are the task's `until` and the tokenizer's
//!   end-of-sequence text.
//!
//! lm-eval checks its stop strings on the last few tokens decoded on their own, so it may run
//! past the first one; what it returns is cut at it all the same, so the texts agree. The
//! filters ([`FilterPipeline`]) and `exact_match` ([`ExactMatch`]) are lm-eval's, with its
//! regexes run as Python's `re` runs them ([`PyRegex`]); `multi_choice_regex`
//! ([`MultiChoiceRegex`]) reads a document's `choices`. `tests/generation.rs` checks the
//! prompts, texts, filtered answers and metrics against lm-eval 0.4.13 runs
//! (`benches/torch/make_generation_fixture.py`).
//!
//! Compute: a document's prompt runs after the keys and values of the last document's, cut
//! back to the prefix the two share ([`PromptCache`]), so a few-shot prompt's description and
//! examples that repeat run once.

use std::path::Path;

use crate::choices::{self, Example, Metric};
use crate::corpus_metrics::CorpusMetric;
use crate::doc_template::{DocTemplates, Setting};
use headroom_mmap_data::rng::derive_seed;

use crate::model::{Model, ModelOps};
use crate::sample::{generate_batch_cached, generate_cached, PromptCache, SampleOptions, Sampling};
use crate::tokenize::Tokenizer;
use crate::{Result, TrainError};

/// The largest documents file read (GSM8K's 1 319 test problems are 0.7 MiB as JSONL).
pub const MAX_GENERATION_DOCS_BYTES: u64 = 1 << 30;

/// lm-eval's default `max_gen_toks`.
pub const DEFAULT_MAX_GEN_TOKS: usize = 256;

/// One document of a generation task.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationDoc {
    /// The prompt's text.
    pub context: String,
    /// The right answers (at least one).
    pub targets: Vec<String>,
    /// Its line, parsed (to keep it out of its own few-shot examples).
    pub json: serde_json::Value,
}

impl GenerationDoc {
    /// A document from its JSON object (`context`, and `target` as a text, a number, or a
    /// non-empty list of them); the error says which field is wrong.
    pub fn parse(line: &str) -> std::result::Result<GenerationDoc, String> {
        let json: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        let object = json.as_object().ok_or("not a JSON object")?;
        let context = match object.get("context") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(_) => return Err("\"context\" is not text".into()),
            None => return Err("no \"context\"".into()),
        };
        // lm-eval renders a target through its Jinja template, so a number arrives as its text.
        let text = |v: &serde_json::Value| match v {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Number(n) => Some(n.to_string()),
            _ => None,
        };
        let targets = match object.get("target") {
            Some(serde_json::Value::Array(items)) if !items.is_empty() => items
                .iter()
                .enumerate()
                .map(|(i, v)| text(v).ok_or_else(|| format!("target {i} is not text")))
                .collect::<std::result::Result<Vec<_>, _>>()?,
            Some(serde_json::Value::Array(_)) => return Err("\"target\" is an empty list".into()),
            Some(v) => vec![text(v).ok_or("\"target\" is neither text nor a list of texts")?],
            None => return Err("no \"target\"".into()),
        };
        Ok(GenerationDoc {
            context,
            targets,
            json,
        })
    }
}

impl Example for GenerationDoc {
    fn context(&self) -> &str {
        &self.context
    }

    fn json(&self) -> &serde_json::Value {
        &self.json
    }

    fn shown_answer(&self) -> std::result::Result<&str, String> {
        Ok(&self.targets[0])
    }
}

/// The documents of a JSONL file, one per non-blank line (or of a Parquet or Arrow file, one
/// per row); an error names the line.
pub fn read_generation_docs(path: &Path) -> Result<Vec<GenerationDoc>> {
    read_generation_docs_with(path, None)
}

/// [`read_generation_docs`], each document first mapped by a task's templates
/// ([`DocTemplates::generation_line`]) when given.
pub fn read_generation_docs_with(
    path: &Path,
    templates: Option<&DocTemplates>,
) -> Result<Vec<GenerationDoc>> {
    let map = templates.map(|t| move |doc: &serde_json::Value| t.generation_line(doc));
    choices::read_jsonl_mapped(
        path,
        MAX_GENERATION_DOCS_BYTES,
        "documents",
        map.as_ref().map(|m| m as choices::LineMap<'_>),
        GenerationDoc::parse,
    )
}

/// A regular expression written for Python's `re`, run as `re.findall` and `re.sub` run it.
///
/// The pattern is translated for [`fancy_regex`] (which has Python's lookarounds and
/// backreferences): `$` outside a class matches at the end or before a final newline, as
/// Python's does without `MULTILINE`; `\Z` is the end; a `{` that opens no repetition, a `}`,
/// and `[`, `&`, `~` inside a class are literal characters, as in Python; `{,n}` is `{0,n}`.
/// The matches are Python's: leftmost, non-overlapping, an empty match allowed right after
/// a non-empty one. One difference: after an empty match Python may still find a non-empty
/// one at the same position by backtracking into an alternative (`|a` on `"a"`); here the
/// search moves one character on. Patterns that prefer the empty match are rare in
/// evaluation filters.
#[derive(Clone, Debug)]
pub struct PyRegex {
    pattern: String,
    regex: fancy_regex::Regex,
}

/// One `re.findall` item: the whole match without groups, the only group's text, or every
/// group's text (an unmatched group is empty, as in Python).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// A pattern without groups: the match.
    Whole(String),
    /// One group: its text.
    Group(String),
    /// Several groups: each one's text (Python's tuple).
    Groups(Vec<String>),
}

impl PyRegex {
    /// `pattern` (Python syntax), compiled; the error quotes it.
    pub fn new(pattern: &str) -> Result<PyRegex> {
        let translated = python_to_fancy(pattern);
        let regex = fancy_regex::Regex::new(&translated).map_err(|e| {
            TrainError::Input(format!("the regex {pattern:?} does not compile: {e}"))
        })?;
        Ok(PyRegex {
            pattern: pattern.to_owned(),
            regex,
        })
    }

    /// The pattern as given.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Each match's captures, in order, as Python's `finditer` steps through `text`.
    fn each_match(
        &self,
        text: &str,
        mut on: impl FnMut(&fancy_regex::Captures<'_, str>),
    ) -> Result<()> {
        let failed = |e: fancy_regex::Error| {
            TrainError::Input(format!("the regex {:?} failed: {e}", self.pattern))
        };
        let mut pos = 0;
        let mut last_was_empty = false;
        while pos <= text.len() {
            let Some(caps) = self.regex.captures_from_pos(text, pos).map_err(failed)? else {
                break;
            };
            let Some(m) = caps.get(0) else { break };
            if last_was_empty && m.start() == pos && m.end() == pos {
                // Python's `must_advance`: no second empty match at one position.
                match text[pos..].chars().next() {
                    Some(c) => pos += c.len_utf8(),
                    None => break,
                }
                last_was_empty = false;
                continue;
            }
            on(&caps);
            last_was_empty = m.start() == m.end();
            pos = m.end();
        }
        Ok(())
    }

    /// `re.findall(pattern, text)`.
    pub fn findall(&self, text: &str) -> Result<Vec<Found>> {
        let groups = self.regex.captures_len() - 1;
        let group = |caps: &fancy_regex::Captures<'_, str>, i: usize| {
            caps.get(i).map_or(String::new(), |m| m.as_str().to_owned())
        };
        let mut found = Vec::new();
        self.each_match(text, |caps| {
            found.push(match groups {
                0 => Found::Whole(group(caps, 0)),
                1 => Found::Group(group(caps, 1)),
                n => Found::Groups((1..=n).map(|i| group(caps, i)).collect()),
            });
        })?;
        Ok(found)
    }

    /// `re.sub(pattern, repl, text, count=count)` (`count` 0: every match): `repl`'s
    /// `\1`, `\g<1>` and `\g<name>` are the groups (an unmatched one empty), `\n`, `\t`
    /// and Python's other escapes their characters; an unknown letter escape or group is an
    /// error, as there.
    pub fn sub(&self, text: &str, repl: &str, count: usize) -> Result<String> {
        enum Piece {
            Text(String),
            Group(usize),
        }
        let bad = |why: String| {
            TrainError::Input(format!(
                "the replacement {repl:?} for {:?}: {why}",
                self.pattern
            ))
        };
        let groups = self.regex.captures_len() - 1;
        let names: Vec<Option<&str>> = self.regex.capture_names().collect();
        let mut pieces = Vec::new();
        let mut literal = String::new();
        let mut chars = repl.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '\\' {
                literal.push(c);
                continue;
            }
            let Some(e) = chars.next() else {
                return Err(bad("a trailing backslash".into()));
            };
            let group = match e {
                '0'..='9' => {
                    let mut n = e.to_digit(10).expect("digit") as usize;
                    if let Some(d) = chars.peek().and_then(|d| d.to_digit(10)) {
                        n = n * 10 + d as usize;
                        chars.next();
                    }
                    Some(n)
                }
                'g' => {
                    if chars.next() != Some('<') {
                        return Err(bad("\\g without <".into()));
                    }
                    let name: String = chars.by_ref().take_while(|&c| c != '>').collect();
                    let n = match name.parse::<usize>() {
                        Ok(n) => n,
                        Err(_) => names
                            .iter()
                            .position(|n| *n == Some(name.as_str()))
                            .ok_or_else(|| bad(format!("no group named {name:?}")))?,
                    };
                    Some(n)
                }
                'n' => {
                    literal.push('\n');
                    None
                }
                't' => {
                    literal.push('\t');
                    None
                }
                'r' => {
                    literal.push('\r');
                    None
                }
                'f' => {
                    literal.push('\u{c}');
                    None
                }
                'v' => {
                    literal.push('\u{b}');
                    None
                }
                'a' => {
                    literal.push('\u{7}');
                    None
                }
                'b' => {
                    literal.push('\u{8}');
                    None
                }
                '\\' => {
                    literal.push('\\');
                    None
                }
                c if c.is_ascii_alphabetic() => return Err(bad(format!("bad escape \\{c}"))),
                c => {
                    literal.push('\\');
                    literal.push(c);
                    None
                }
            };
            if let Some(n) = group {
                if n > groups {
                    return Err(bad(format!("invalid group reference {n}")));
                }
                pieces.push(Piece::Text(std::mem::take(&mut literal)));
                pieces.push(Piece::Group(n));
            }
        }
        pieces.push(Piece::Text(literal));
        let mut out = String::with_capacity(text.len());
        let mut kept_from = 0;
        let mut done = 0;
        self.each_match(text, |caps| {
            if count > 0 && done == count {
                return;
            }
            let Some(m) = caps.get(0) else { return };
            out.push_str(&text[kept_from..m.start()]);
            for piece in &pieces {
                match piece {
                    Piece::Text(t) => out.push_str(t),
                    Piece::Group(n) => out.push_str(caps.get(*n).map_or("", |g| g.as_str())),
                }
            }
            kept_from = m.end();
            done += 1;
        })?;
        out.push_str(&text[kept_from..]);
        Ok(out)
    }

    /// `re.sub(pattern, "", text)`: every match removed.
    pub fn remove_all(&self, text: &str) -> Result<String> {
        let mut out = String::with_capacity(text.len());
        let mut kept_from = 0;
        self.each_match(text, |caps| {
            if let Some(m) = caps.get(0) {
                out.push_str(&text[kept_from..m.start()]);
                kept_from = m.end();
            }
        })?;
        out.push_str(&text[kept_from..]);
        Ok(out)
    }
}

/// Whether `pattern` sets Python's `MULTILINE` flag (`(?m)`, `(?im)`, `(?m:…)`), under which
/// `$` matches before every newline in both dialects.
fn sets_multiline(pattern: &str) -> bool {
    let bytes = pattern.as_bytes();
    let mut i = 0;
    while i + 1 < bytes.len() {
        if bytes[i] == b'\\' {
            i += 2;
            continue;
        }
        if bytes[i] == b'(' && bytes[i + 1] == b'?' {
            let flags: Vec<u8> = bytes[i + 2..]
                .iter()
                .copied()
                .take_while(|b| b"aiLmsux".contains(b))
                .collect();
            let after = bytes.get(i + 2 + flags.len());
            if flags.contains(&b'm') && matches!(after, Some(b')' | b':' | b'-')) {
                return true;
            }
        }
        i += 1;
    }
    false
}

/// `pattern` in Python's syntax rewritten where [`fancy_regex`] reads it differently (see
/// [`PyRegex`]).
fn python_to_fancy(pattern: &str) -> String {
    let multiline = sets_multiline(pattern);
    let chars: Vec<char> = pattern.chars().collect();
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut in_class = false;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        i += 1;
        match c {
            '\\' => match chars.get(i) {
                Some('Z') if !in_class => {
                    out.push_str("\\z");
                    i += 1;
                }
                Some(&n) => {
                    out.push('\\');
                    out.push(n);
                    i += 1;
                }
                None => out.push('\\'),
            },
            '[' if !in_class => {
                in_class = true;
                out.push('[');
                if chars.get(i) == Some(&'^') {
                    out.push('^');
                    i += 1;
                }
                // A `]` first in a class is a literal in Python.
                if chars.get(i) == Some(&']') {
                    out.push_str("\\]");
                    i += 1;
                }
            }
            ']' if in_class => {
                in_class = false;
                out.push(']');
            }
            // Nested classes and set operations in fancy_regex's dialect; literals in Python's.
            '[' | '&' | '~' if in_class => {
                out.push('\\');
                out.push(c);
            }
            '$' if !in_class && !multiline => out.push_str("(?=\\n?\\z)"),
            '{' if !in_class => {
                // A repetition `{m}`, `{m,}`, `{m,n}` or `{,n}`; anything else is literal.
                let close = chars[i..].iter().position(|&c| c == '}');
                let body: Option<String> = close.map(|n| chars[i..i + n].iter().collect());
                let repetition = body.as_deref().and_then(|b| {
                    let (lo, hi) = b.split_once(',').unwrap_or((b, b));
                    let digits = |s: &str| s.chars().all(|c| c.is_ascii_digit());
                    let valid = digits(lo) && digits(hi) && !(lo.is_empty() && hi.is_empty());
                    valid.then(|| {
                        let lo = if lo.is_empty() { "0" } else { lo };
                        if b.contains(',') {
                            format!("{{{lo},{hi}}}")
                        } else {
                            format!("{{{lo}}}")
                        }
                    })
                });
                match (repetition, close) {
                    (Some(r), Some(n)) => {
                        out.push_str(&r);
                        i += n + 1;
                    }
                    _ => out.push_str("\\{"),
                }
            }
            '}' if !in_class => out.push_str("\\}"),
            _ => out.push(c),
        }
    }
    out
}

/// Python's `str.strip()`: whitespace as `str.isspace` counts it.
fn python_strip(s: &str) -> &str {
    s.trim_matches(crate::chat_template::is_python_space)
}

/// One step of an lm-eval filter pipeline.
#[derive(Clone, Debug)]
pub enum FilterStep {
    /// `regex`: the `group_select`-th `findall` item (negative from the end), the first
    /// non-empty group of a tuple, stripped; `fallback` when nothing matches.
    Regex {
        /// The pattern.
        regex: PyRegex,
        /// Which match (Python's index).
        group_select: i64,
        /// The answer when nothing matches.
        fallback: String,
    },
    /// `remove_whitespace`: `strip()`.
    RemoveWhitespace,
    /// `lowercase`.
    Lowercase,
    /// `uppercase`.
    Uppercase,
    /// `take_first_k`: the first `k` responses (lm-eval asserts there are that many; here it
    /// is checked against the repeats before anything runs).
    TakeFirstK(usize),
    /// `majority_vote`: the response given most often, the first given among equals
    /// (`Counter.most_common(1)`, which keeps first-seen order).
    MajorityVote,
    /// `multi_choice_regex`: the regex as in `regex`, else the document's `choices` found in
    /// the response by their texts, else a letter after a colon (`: B`); see
    /// [`MultiChoiceRegex`].
    MultiChoiceRegex(Box<MultiChoiceRegex>),
    /// `map`: each response replaced by its entry in `mapping_dict`, else `default_value`
    /// (an error without one: lm-eval would pass `None` on to the metric).
    Map {
        /// The entries (text to text).
        mapping: Vec<(String, String)>,
        /// The text for a response without an entry.
        default: Option<String>,
    },
}

/// lm-eval's `multi_choice_regex` filter (GPQA's and MMLU's chain-of-thought tasks): an
/// answer letter `(A)`, `(B)`, … out of a response to a question whose document lists its
/// `choices`. In order, the first that finds something:
///
/// 1. `regex` on the response, the `group_select`-th match (a tuple's first non-empty group),
///    stripped;
/// 2. the choices' texts, each stripped and then normalised as the response is (the
///    `regexes_to_ignore` removed, lower case if `ignore_case`, Unicode punctuation removed if
///    `ignore_punctuation`), searched for in the normalised response, longest pattern first
///    so that a choice cannot hide a longer one it starts; the match's letter;
/// 3. `: X` with `X` a choice's letter, in the response as it is; `(X)`;
///
/// else `fallback`. A found text that names no choice is kept as it is, as lm-eval keeps it.
/// Punctuation is Unicode's `P` categories from the `regex` crate's tables; Python 3.11 has
/// Unicode 14's, so a character made punctuation since then would differ.
#[derive(Clone, Debug)]
pub struct MultiChoiceRegex {
    /// `regex_pattern`.
    pub regex: PyRegex,
    /// `group_select` (Python's index; it also picks among the choices found).
    pub group_select: i64,
    /// `fallback`.
    pub fallback: String,
    /// `ignore_case` (for the choices' texts).
    pub ignore_case: bool,
    /// `ignore_punctuation` (for the choices' texts).
    pub ignore_punctuation: bool,
    /// `regexes_to_ignore` (for the choices' texts).
    pub regexes_to_ignore: Vec<PyRegex>,
}

/// The most choices `multi_choice_regex` letters (A to Z; lm-eval's 27th letter `[` breaks
/// its regex).
pub const MAX_LETTERED_CHOICES: usize = 26;

/// Python's `re.escape` (3.7 and later): the characters special in a pattern, and
/// whitespace, behind a backslash. Its length orders `multi_choice_regex`'s alternatives.
fn python_re_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if "()[]{}?*+-|^$\\.&~# \t\n\r\u{b}\u{c}".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// One stage of [`MultiChoiceRegex`]: a regex and what its found texts stand for.
struct ChoiceStage {
    regex: PyRegex,
    letters: Vec<(String, String)>,
}

impl MultiChoiceRegex {
    /// `text` as the choices are looked for in it.
    fn normalise(&self, text: &str) -> Result<String> {
        let mut text = text.to_owned();
        for regex in &self.regexes_to_ignore {
            text = regex.remove_all(&text)?;
        }
        if self.ignore_case {
            text = text.to_lowercase();
        }
        if self.ignore_punctuation {
            static PUNCTUATION: std::sync::OnceLock<fancy_regex::Regex> =
                std::sync::OnceLock::new();
            let punctuation = PUNCTUATION.get_or_init(|| {
                fancy_regex::Regex::new(r"\p{P}").expect("a Unicode category class compiles")
            });
            text = punctuation.replace_all(&text, "").into_owned();
        }
        Ok(text)
    }

    /// The document's choices as stages 2 and 3 look for them.
    fn stages(&self, doc: &serde_json::Value) -> Result<(ChoiceStage, ChoiceStage)> {
        let choices = doc
            .get("choices")
            .and_then(|c| c.as_array())
            .ok_or_else(|| {
                TrainError::Input(
                    "multi_choice_regex needs the document's \"choices\", a list of texts".into(),
                )
            })?;
        if choices.len() > MAX_LETTERED_CHOICES {
            return Err(TrainError::Input(format!(
                "multi_choice_regex letters at most {MAX_LETTERED_CHOICES} choices; the \
                 document has {}",
                choices.len()
            )));
        }
        let mut by_text: Vec<(String, String)> = Vec::with_capacity(choices.len());
        let mut escaped = Vec::with_capacity(choices.len());
        let mut letters = Vec::with_capacity(choices.len());
        for (i, choice) in choices.iter().enumerate() {
            let text = choice.as_str().ok_or_else(|| {
                TrainError::Input(format!("multi_choice_regex: choice {i} is not text"))
            })?;
            let letter = char::from(b'A' + i as u8);
            let text = self.normalise(python_strip(text))?;
            escaped.push(python_re_escape(&text));
            // A repeated text takes the later letter, as a Python dict's key does.
            by_text.retain(|(t, _)| *t != text);
            by_text.push((text, format!("({letter})")));
            letters.push((letter.to_string(), format!("({letter})")));
        }
        // Longest first, equals in order (Python's stable `sorted(..., reverse=True)`).
        escaped.sort_by_key(|e| std::cmp::Reverse(e.chars().count()));
        let by_letter = PyRegex::new(&format!(
            r":[\s]*({})",
            letters
                .iter()
                .map(|(l, _)| l.as_str())
                .collect::<Vec<_>>()
                .join("|")
        ))?;
        Ok((
            ChoiceStage {
                regex: PyRegex::new(&escaped.join("|"))?,
                letters: by_text,
            },
            ChoiceStage {
                regex: by_letter,
                letters,
            },
        ))
    }

    /// lm-eval's `find_match`: the `group_select`-th match, stripped and looked up in
    /// `letters`; empty when nothing matches.
    fn find(&self, regex: &PyRegex, text: &str, letters: &[(String, String)]) -> Result<String> {
        let Some(Some(text)) =
            selected_match(regex, text, self.group_select, "multi_choice_regex")?
        else {
            return Ok(String::new());
        };
        Ok(
            match letters.iter().find(|(t, _)| !text.is_empty() && *t == text) {
                Some((_, letter)) => letter.clone(),
                None => text,
            },
        )
    }

    /// The answer this filter takes from each of a document's `responses`.
    fn apply(&self, responses: &mut [String], doc: &serde_json::Value) -> Result<()> {
        let (by_text, by_letter) = self.stages(doc)?;
        for response in responses {
            let mut answer = self.find(&self.regex, response, &[])?;
            if answer.is_empty() {
                answer = self.find(&by_text.regex, &self.normalise(response)?, &by_text.letters)?;
            }
            if answer.is_empty() {
                answer = self.find(&by_letter.regex, response, &by_letter.letters)?;
            }
            *response = if answer.is_empty() {
                self.fallback.clone()
            } else {
                answer
            };
        }
        Ok(())
    }
}

/// lm-eval's pick of a regex's matches in `text`: the `group_select`-th `findall` item
/// (Python's index; out of range is an error, as Python's IndexError, named after `who`),
/// stripped, a tuple's first non-empty group. `None` without a match; `Some(None)` when the
/// item is a tuple of empty groups.
fn selected_match(
    regex: &PyRegex,
    text: &str,
    group_select: i64,
    who: &str,
) -> Result<Option<Option<String>>> {
    let found = regex.findall(text)?;
    if found.is_empty() {
        return Ok(None);
    }
    let item = python_index(&found, group_select).ok_or_else(|| {
        TrainError::Input(format!(
            "{who}: group_select {group_select} of {} matches of {:?} (Python raises \
             IndexError)",
            found.len(),
            regex.pattern()
        ))
    })?;
    Ok(Some(match item {
        Found::Whole(s) | Found::Group(s) => Some(python_strip(s).to_owned()),
        Found::Groups(groups) => groups
            .iter()
            .find(|g| !g.is_empty())
            .map(|g| python_strip(g).to_owned()),
    }))
}

/// `items[at]` with Python's negative indices.
fn python_index<T>(items: &[T], at: i64) -> Option<&T> {
    let at = if at < 0 { items.len() as i64 + at } else { at };
    usize::try_from(at).ok().and_then(|at| items.get(at))
}

/// A named filter (a task's `filter_list` entry): its steps over a document's responses (one
/// per repeat), then `take_first`. As in lm-eval, `regex`, `remove_whitespace`, `lowercase`
/// and `uppercase` apply to each response, `take_first_k` and `majority_vote` to the list.
#[derive(Clone, Debug)]
pub struct FilterPipeline {
    /// Its name (`strict-match`), which names its metrics.
    pub name: String,
    /// The steps before `take_first`.
    pub steps: Vec<FilterStep>,
}

impl FilterPipeline {
    /// lm-eval's filter when a task names none: `none`, `take_first` alone.
    pub fn none() -> FilterPipeline {
        FilterPipeline {
            name: "none".into(),
            steps: Vec::new(),
        }
    }

    /// A task's `filter_list` as JSON (a list of `{"name", "filter": [{"function", …}]}`,
    /// the YAML's structure; or an object holding it under `filter_list`). Each pipeline
    /// must end with `take_first` (lm-eval would otherwise compare a list, or run a later
    /// step over each character of the taken answer); `take_first_k` needs its `k`, at
    /// least 1.
    pub fn parse_list(json: &serde_json::Value) -> Result<Vec<FilterPipeline>> {
        let bad = |why: String| TrainError::Input(format!("filter list: {why}"));
        let list = match json {
            serde_json::Value::Object(o) => o
                .get("filter_list")
                .ok_or_else(|| bad("an object without \"filter_list\"".into()))?,
            other => other,
        };
        let items = list
            .as_array()
            .filter(|a| !a.is_empty())
            .ok_or_else(|| bad("not a non-empty list".into()))?;
        let mut pipelines: Vec<FilterPipeline> = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let name = item
                .get("name")
                .and_then(|n| n.as_str())
                .ok_or_else(|| bad(format!("entry {i} has no \"name\" text")))?;
            if pipelines.iter().any(|p| p.name == name) {
                return Err(bad(format!("two filters are named {name:?}")));
            }
            let functions = item
                .get("filter")
                .and_then(|f| f.as_array())
                .ok_or_else(|| bad(format!("{name}: no \"filter\" list")))?;
            let mut steps = Vec::new();
            let mut took_first = false;
            for function in functions {
                let which = function
                    .get("function")
                    .and_then(|f| f.as_str())
                    .ok_or_else(|| bad(format!("{name}: a step without \"function\" text")))?;
                if took_first {
                    return Err(bad(format!(
                        "{name}: {which} after take_first (lm-eval would run it over each \
                         character of the answer)"
                    )));
                }
                let text_arg = |key: &str, default: &str| -> Result<String> {
                    match function.get(key) {
                        None => Ok(default.to_owned()),
                        Some(serde_json::Value::String(s)) => Ok(s.clone()),
                        Some(_) => Err(bad(format!("{name}: {which}'s {key} is not text"))),
                    }
                };
                let group_select = || match function.get("group_select") {
                    None => Ok(0),
                    Some(v) => v.as_i64().ok_or_else(|| {
                        bad(format!("{name}: {which}'s group_select is not an integer"))
                    }),
                };
                steps.push(match which {
                    "take_first" => {
                        took_first = true;
                        continue;
                    }
                    "regex" => FilterStep::Regex {
                        regex: PyRegex::new(&text_arg("regex_pattern", r"#### (\-?[0-9\.\,]+)")?)?,
                        group_select: group_select()?,
                        fallback: text_arg("fallback", "[invalid]")?,
                    },
                    "multi_choice_regex" => {
                        let flag = |key: &str| match function.get(key) {
                            None | Some(serde_json::Value::Null) => Ok(false),
                            Some(serde_json::Value::Bool(b)) => Ok(*b),
                            Some(_) => {
                                Err(bad(format!("{name}: {which}'s {key} is not true/false")))
                            }
                        };
                        let regexes_to_ignore = match function.get("regexes_to_ignore") {
                            None | Some(serde_json::Value::Null) => Vec::new(),
                            Some(serde_json::Value::Array(items)) => items
                                .iter()
                                .map(|r| {
                                    r.as_str().map(PyRegex::new).unwrap_or_else(|| {
                                        Err(bad(format!(
                                            "{name}: {which}'s regexes_to_ignore holds {r}, \
                                             not text"
                                        )))
                                    })
                                })
                                .collect::<Result<_>>()?,
                            Some(_) => {
                                return Err(bad(format!(
                                    "{name}: {which}'s regexes_to_ignore is not a list"
                                )))
                            }
                        };
                        FilterStep::MultiChoiceRegex(Box::new(MultiChoiceRegex {
                            regex: PyRegex::new(&text_arg(
                                "regex_pattern",
                                r"#### (\-?[0-9\.\,]+)",
                            )?)?,
                            group_select: group_select()?,
                            fallback: text_arg("fallback", "[invalid]")?,
                            ignore_case: flag("ignore_case")?,
                            ignore_punctuation: flag("ignore_punctuation")?,
                            regexes_to_ignore,
                        }))
                    }
                    "remove_whitespace" => FilterStep::RemoveWhitespace,
                    "lowercase" => FilterStep::Lowercase,
                    "uppercase" => FilterStep::Uppercase,
                    "majority_vote" => FilterStep::MajorityVote,
                    "map" => {
                        let mapping = match function.get("mapping_dict") {
                            None | Some(serde_json::Value::Null) => Vec::new(),
                            Some(serde_json::Value::Object(entries)) => entries
                                .iter()
                                .map(|(k, v)| match v {
                                    serde_json::Value::String(v) => Ok((k.clone(), v.clone())),
                                    other => Err(bad(format!(
                                        "{name}: map's value {other} for {k:?} is not text \
                                         (exact_match compares texts)"
                                    ))),
                                })
                                .collect::<Result<_>>()?,
                            Some(_) => {
                                return Err(bad(format!(
                                    "{name}: map's mapping_dict is not an object"
                                )))
                            }
                        };
                        let default = match function.get("default_value") {
                            None | Some(serde_json::Value::Null) => None,
                            Some(serde_json::Value::String(d)) => Some(d.clone()),
                            Some(other) => {
                                return Err(bad(format!(
                                    "{name}: map's default_value {other} is not text"
                                )))
                            }
                        };
                        FilterStep::Map { mapping, default }
                    }
                    "take_first_k" => match function.get("k").map(|k| (k, k.as_u64())) {
                        Some((_, Some(k))) if k >= 1 => FilterStep::TakeFirstK(
                            usize::try_from(k)
                                .map_err(|_| bad(format!("{name}: take_first_k's k {k}")))?,
                        ),
                        Some((k, _)) => {
                            return Err(bad(format!(
                                "{name}: take_first_k's k {k} is not a whole number ≥ 1"
                            )))
                        }
                        None => return Err(bad(format!("{name}: take_first_k without its k"))),
                    },
                    other => {
                        return Err(bad(format!(
                            "{name}: the filter function {other:?} is not one of regex, \
                             multi_choice_regex, take_first, take_first_k, majority_vote, map, \
                             remove_whitespace, lowercase, uppercase"
                        )))
                    }
                });
            }
            if !took_first {
                return Err(bad(format!(
                    "{name}: no take_first (lm-eval would compare a list of answers)"
                )));
            }
            pipelines.push(FilterPipeline {
                name: name.to_owned(),
                steps,
            });
        }
        Ok(pipelines)
    }

    /// The responses this pipeline needs: the largest `take_first_k` (1 without one).
    pub fn responses_needed(&self) -> usize {
        self.steps
            .iter()
            .map(|s| match s {
                FilterStep::TakeFirstK(k) => *k,
                _ => 1,
            })
            .max()
            .unwrap_or(1)
    }

    /// The answer this pipeline takes from `responses` to a document without fields
    /// ([`FilterPipeline::apply_to`]; a `multi_choice_regex` is refused, having no choices).
    pub fn apply(&self, responses: &[String]) -> Result<String> {
        self.apply_to(responses, &serde_json::Value::Null)
    }

    /// The answer this pipeline takes from a document's `responses` (one per repeat, at least
    /// one; a `take_first_k` needs at least its `k`). `doc` is the document's JSON, whose
    /// `choices` a `multi_choice_regex` reads.
    pub fn apply_to(&self, responses: &[String], doc: &serde_json::Value) -> Result<String> {
        let mut list = responses.to_vec();
        for step in &self.steps {
            match step {
                FilterStep::TakeFirstK(k) => {
                    if list.len() < *k {
                        return Err(TrainError::Input(format!(
                            "filter {}: take_first_k {k} of {} responses (lm-eval asserts \
                             there are k; raise the repeats)",
                            self.name,
                            list.len()
                        )));
                    }
                    list.truncate(*k);
                }
                FilterStep::MajorityVote => {
                    // Counted in first-seen order; the first of the most frequent wins.
                    let mut counts: Vec<(&String, usize)> = Vec::new();
                    for r in &list {
                        match counts.iter_mut().find(|(seen, _)| *seen == r) {
                            Some((_, n)) => *n += 1,
                            None => counts.push((r, 1)),
                        }
                    }
                    let top = counts.iter().map(|&(_, n)| n).max().unwrap_or(0);
                    list = counts
                        .iter()
                        .find(|&&(_, n)| n == top)
                        .map(|&(r, _)| vec![r.clone()])
                        .unwrap_or_default();
                }
                FilterStep::MultiChoiceRegex(step) => step
                    .apply(&mut list, doc)
                    .map_err(|e| TrainError::Input(format!("filter {}: {e}", self.name)))?,
                each => {
                    for text in &mut list {
                        *text = self.apply_one(each, text)?;
                    }
                }
            }
        }
        list.into_iter().next().ok_or_else(|| {
            TrainError::Input(format!("filter {}: no response to take first", self.name))
        })
    }

    /// One per-response step on `text`.
    fn apply_one(&self, step: &FilterStep, text: &str) -> Result<String> {
        Ok(match step {
            FilterStep::Regex {
                regex,
                group_select,
                fallback,
            } => {
                let who = format!("filter {}", self.name);
                match selected_match(regex, text, *group_select, &who)? {
                    None => fallback.clone(),
                    // A tuple of empty groups: the fallback, stripped as a match would be.
                    Some(None) => python_strip(fallback).to_owned(),
                    Some(Some(answer)) => answer,
                }
            }
            FilterStep::RemoveWhitespace => python_strip(text).to_owned(),
            FilterStep::Lowercase => text.to_lowercase(),
            FilterStep::Uppercase => text.to_uppercase(),
            FilterStep::Map { mapping, default } => match mapping.iter().find(|(k, _)| k == text) {
                Some((_, v)) => v.clone(),
                None => default.clone().ok_or_else(|| {
                    TrainError::Input(format!(
                        "filter {}: map has no entry for {text:?} and no default_value \
                             (lm-eval would pass None to the metric)",
                        self.name
                    ))
                })?,
            },
            FilterStep::TakeFirstK(_)
            | FilterStep::MajorityVote
            | FilterStep::MultiChoiceRegex(_) => text.to_owned(),
        })
    }
}

/// lm-eval's `exact_match` (Hugging Face evaluate's): each regex's matches removed from the
/// answer and the target, in order, then lower case, then ASCII punctuation and digits
/// removed if asked, then equality. With several targets, right when any one is.
#[derive(Clone, Debug, Default)]
pub struct ExactMatch {
    /// `regexes_to_ignore`.
    pub regexes_to_ignore: Vec<PyRegex>,
    /// `ignore_case`.
    pub ignore_case: bool,
    /// `ignore_punctuation` (Python's `string.punctuation`).
    pub ignore_punctuation: bool,
    /// `ignore_numbers` (`string.digits`).
    pub ignore_numbers: bool,
}

impl ExactMatch {
    /// `text` as the metric compares it.
    pub fn normalize(&self, text: &str) -> Result<String> {
        let mut text = text.to_owned();
        for regex in &self.regexes_to_ignore {
            text = regex.remove_all(&text)?;
        }
        if self.ignore_case {
            text = text.to_lowercase();
        }
        if self.ignore_punctuation {
            text.retain(|c| !c.is_ascii_punctuation());
        }
        if self.ignore_numbers {
            text.retain(|c| !c.is_ascii_digit());
        }
        // numpy's fixed-width strings, which the metric compares, drop trailing NULs.
        let kept = text.trim_end_matches('\0').len();
        text.truncate(kept);
        Ok(text)
    }

    /// Whether `answer` equals one of `targets` once both are normalised.
    pub fn matches(&self, answer: &str, targets: &[String]) -> Result<bool> {
        let answer = self.normalize(answer)?;
        for target in targets {
            if self.normalize(target)? == answer {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// lm-eval's `gsm8k` task (`tasks/gsm8k/gsm8k.yaml`, version 3): its filters.
const GSM8K_FILTERS: &str = r#####"[
  {"name": "strict-match", "filter": [
    {"function": "regex", "regex_pattern": "#### (\\-?[0-9\\.\\,]+)"},
    {"function": "take_first"}]},
  {"name": "flexible-extract", "filter": [
    {"function": "regex", "group_select": -1, "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)"},
    {"function": "take_first"}]}
]"#####;

/// lm-eval's `gsm8k_cot_self_consistency` task (`gsm8k-cot-self-consistency.yaml`, version 2,
/// over `gsm8k-cot.yaml`): its filters, the first answer and the majority of 64 and of 8.
const GSM8K_SELF_CONSISTENCY_FILTERS: &str = r#####"[
  {"name": "score-first", "filter": [
    {"function": "regex", "regex_pattern": "The answer is (\\-?[0-9\\.\\,]*[0-9]+)"},
    {"function": "take_first"}]},
  {"name": "maj@64", "filter": [
    {"function": "regex", "regex_pattern": "The answer is (\\-?[0-9\\.\\,]*[0-9]+)"},
    {"function": "majority_vote"},
    {"function": "take_first"}]},
  {"name": "maj@8", "filter": [
    {"function": "take_first_k", "k": 8},
    {"function": "regex", "regex_pattern": "The answer is (\\-?[0-9\\.\\,]*[0-9]+)"},
    {"function": "majority_vote"},
    {"function": "take_first"}]}
]"#####;

/// lm-eval's GPQA chain-of-thought zero-shot tasks (`gpqa/cot_zeroshot`, version 2.2): the
/// text after "The answer is", else the last `(X)` or a choice's text.
const GPQA_COT_FILTERS: &str = r#####"[
  {"name": "strict-match", "filter": [
    {"function": "regex", "regex_pattern": "(?<=The answer is )(.*)(?=.)"},
    {"function": "take_first"}]},
  {"name": "flexible-extract", "filter": [
    {"function": "multi_choice_regex", "group_select": -1, "ignore_case": true,
     "ignore_punctuation": true, "regex_pattern": "(\\([A-Z]\\))"},
    {"function": "take_first"}]}
]"#####;

/// lm-eval's `mmlu_flan_cot_zeroshot` tasks (version 3): as GPQA's, with three more ways
/// of stating the answer.
const MMLU_FLAN_COT_FILTERS: &str = r#####"[
  {"name": "strict-match", "filter": [
    {"function": "regex", "regex_pattern": "((?<=The answer is )(.*)(?=.)|(?<=answer is )(.*)(?=.)|(?<=The answer: )(.*)(?=.)|(?<=The final answer: )(.*)(?=.))"},
    {"function": "take_first"}]},
  {"name": "flexible-extract", "filter": [
    {"function": "multi_choice_regex", "group_select": -1, "ignore_case": true,
     "ignore_punctuation": true, "regex_pattern": "(\\([A-Z]\\))"},
    {"function": "take_first"}]}
]"#####;

/// lm-eval's `gsm8k_cot` and `gsm8k_cot_zeroshot` tasks (version 3): the number after "The
/// answer is", else the last number.
const GSM8K_COT_FILTERS: &str = r#####"[
  {"name": "strict-match", "filter": [
    {"function": "regex", "regex_pattern": "The answer is (\\-?[0-9\\.\\,]+)."},
    {"function": "take_first"}]},
  {"name": "flexible-extract", "filter": [
    {"function": "regex", "group_select": -1, "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)"},
    {"function": "take_first"}]}
]"#####;

/// `gsm8k-cot.yaml`'s eight chain-of-thought examples (Wei et al.'s), as documents rendered by
/// its `doc_to_text` (`Q: {question}\nA:`) with their targets.
const GSM8K_COT_EXAMPLES: &str = r#####"{"context": "Q: There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, there will be 21 trees. How many trees did the grove workers plant today?\nA:", "target": "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have been 21 - 15 = 6. The answer is 6."}
{"context": "Q: If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?\nA:", "target": "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."}
{"context": "Q: Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?\nA:", "target": "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, they had 74 - 35 = 39. The answer is 39."}
{"context": "Q: Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did Jason give to Denny?\nA:", "target": "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. The answer is 8."}
{"context": "Q: Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have now?\nA:", "target": "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. The answer is 9."}
{"context": "Q: There were nine computers in the server room. Five more computers were installed each day, from monday to thursday. How many computers are now in the server room?\nA:", "target": "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 computers were added. 9 + 20 is 29. The answer is 29."}
{"context": "Q: Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf balls did he have at the end of wednesday?\nA:", "target": "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, he had 35 - 2 = 33 golf balls. The answer is 33."}
{"context": "Q: Olivia has $23. She bought five bagels for $3 each. How much money does she have left?\nA:", "target": "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars left. 23 - 15 is 8. The answer is 8."}"#####;

/// `gsm8k-cot.yaml`'s examples, parsed (`name` is the task, for the error).
fn gsm8k_cot_examples(name: &str) -> Result<Vec<GenerationDoc>> {
    GSM8K_COT_EXAMPLES
        .lines()
        .map(GenerationDoc::parse)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| TrainError::Input(format!("{name}'s examples: {e}")))
}

/// lm-eval's GSM8K `exact_match` settings (the same in `gsm8k` and the chain-of-thought tasks).
fn gsm8k_metric() -> Result<ExactMatch> {
    Ok(ExactMatch {
        regexes_to_ignore: [",", "\\$", "(?s).*#### ", "\\.$"]
            .iter()
            .map(|r| PyRegex::new(r))
            .collect::<Result<_>>()?,
        ignore_case: true,
        ignore_punctuation: false,
        ignore_numbers: false,
    })
}

/// MMLU's 57 subjects (lm-eval's `dataset_name`s), as its per-subject tasks name them.
pub const MMLU_SUBJECTS: [&str; 57] = [
    "abstract_algebra",
    "anatomy",
    "astronomy",
    "business_ethics",
    "clinical_knowledge",
    "college_biology",
    "college_chemistry",
    "college_computer_science",
    "college_mathematics",
    "college_medicine",
    "college_physics",
    "computer_security",
    "conceptual_physics",
    "econometrics",
    "electrical_engineering",
    "elementary_mathematics",
    "formal_logic",
    "global_facts",
    "high_school_biology",
    "high_school_chemistry",
    "high_school_computer_science",
    "high_school_european_history",
    "high_school_geography",
    "high_school_government_and_politics",
    "high_school_macroeconomics",
    "high_school_mathematics",
    "high_school_microeconomics",
    "high_school_physics",
    "high_school_psychology",
    "high_school_statistics",
    "high_school_us_history",
    "high_school_world_history",
    "human_aging",
    "human_sexuality",
    "international_law",
    "jurisprudence",
    "logical_fallacies",
    "machine_learning",
    "management",
    "marketing",
    "medical_genetics",
    "miscellaneous",
    "moral_disputes",
    "moral_scenarios",
    "nutrition",
    "philosophy",
    "prehistory",
    "professional_accounting",
    "professional_law",
    "professional_medicine",
    "professional_psychology",
    "public_relations",
    "security_studies",
    "sociology",
    "us_foreign_policy",
    "virology",
    "world_religions",
];

/// lm-eval's translation tasks (`tasks/translation`, over `wmt_common_yaml`, version 1): one
/// line each, scored by BLEU, TER and chrF.
pub const TRANSLATION_TASKS: [&str; 8] = [
    "wmt14-en-fr",
    "wmt14-fr-en",
    "wmt16-de-en",
    "wmt16-en-de",
    "wmt16-en-ro",
    "wmt16-ro-en",
    "iwslt2017-en-ar",
    "iwslt2017-ar-en",
];

/// A named task's generation settings as lm-eval's task YAML writes them (`eval --preset`).
#[derive(Clone, Debug)]
pub struct TaskPreset {
    /// `generation_kwargs.until`.
    pub until: Vec<String>,
    /// `filter_list`.
    pub filters: Vec<FilterPipeline>,
    /// `metric_list`'s `exact_match` settings.
    pub metric: ExactMatch,
    /// `num_fewshot`.
    pub num_fewshot: usize,
    /// `generation_kwargs.do_sample` (`None`: unset, lm-eval's greedy default).
    pub do_sample: Option<bool>,
    /// `generation_kwargs.temperature`.
    pub temperature: Option<f32>,
    /// `repeats`.
    pub repeats: usize,
    /// `fewshot_config.samples`: the examples every prompt shows, in order (its `first_n`
    /// sampler); `None` when the task draws them from a split.
    pub examples: Option<Vec<GenerationDoc>>,
    /// `description` (text before every prompt), when the task sets one.
    pub description: Option<String>,
    /// `fewshot_delimiter`, when the task sets one (lm-eval's default is `"\n\n"`).
    pub fewshot_delimiter: Option<String>,
    /// Whether `metric_list` holds `exact_match`.
    pub exact_match: bool,
    /// `metric_list`'s corpus metrics.
    pub corpus_metrics: Vec<CorpusMetric>,
    /// `doc_to_text`, for documents that are the dataset's own rows (GPQA's `None`: its
    /// documents come out of Python preprocessing).
    pub doc_to_text: Option<Setting>,
    /// `doc_to_target`, likewise.
    pub doc_to_target: Option<Setting>,
}

/// lm-eval's `doc_to_text` and `doc_to_target` of the preset `name`: what makes a dataset's
/// row (GSM8K's `question` and `answer`, TriviaQA's `answer.aliases`, WMT's `translation`)
/// a document; none for GPQA, whose documents lm-eval makes in Python (shuffled choices).
fn lm_eval_doc_settings(name: &str) -> (Option<String>, Option<String>) {
    let both = |text: &str, target: &str| (Some(text.to_owned()), Some(target.to_owned()));
    let gsm8k_cot_target = "{{answer.split('####')[-1].strip() if answer is defined else target}}";
    if name.starts_with("mmlu_flan_cot_zeroshot") {
        return both(
            "Q: {{question.strip()}}\n(A) {{choices[0]}} (B) {{choices[1]}} (C) {{choices[2]}} \
             (D) {{choices[3]}}\nA: Let's think step by step.",
            "{{['(A)', '(B)', '(C)', '(D)'][answer]}}",
        );
    }
    if TRANSLATION_TASKS.contains(&name) {
        fn language(code: &str) -> &str {
            match code {
                "en" => "English",
                "fr" => "French",
                "de" => "German",
                "ro" => "Romanian",
                "ar" => "Arabic",
                _ => code,
            }
        }
        let pair = name
            .rsplit_once(['-'])
            .map(|(head, tgt)| (head.rsplit('-').next().unwrap_or(head), tgt));
        if let Some((src, tgt)) = pair {
            return both(
                &format!(
                    "{} phrase: {{{{translation[\"{src}\"]}}}}\n{} phrase:",
                    language(src),
                    language(tgt)
                ),
                &format!(" {{{{translation[\"{tgt}\"]}}}}"),
            );
        }
    }
    match name {
        "gsm8k" => both("Question: {{question}}\nAnswer:", "{{answer}}"),
        "gsm8k_cot" | "gsm8k-cot" | "gsm8k_cot_self_consistency" | "gsm8k-cot-self-consistency" => {
            both("Q: {{question}}\nA:", gsm8k_cot_target)
        }
        "gsm8k_cot_zeroshot" => both(
            "Q: {{question}}\nA: Let's think step by step.",
            "{{answer}}",
        ),
        "triviaqa" => both("Question: {{question}}?\nAnswer:", "{{answer.aliases}}"),
        "nq_open" => both("Q: {{question}}?\nA:", "{{answer}}"),
        _ => (None, None),
    }
}

impl TaskPreset {
    /// The task `name`'s settings, with its lm-eval `doc_to_text` and `doc_to_target`
    /// ([`TaskPreset::doc_to_text`]) for documents that are the dataset's own rows:
    ///
    /// - `gsm8k`: its documents `{"context": "Question: …\nAnswer:", "target": answer}`,
    ///   examples from its train split;
    /// - `gsm8k_cot_self_consistency`: `{"context": "Q: …\nA:", "target": answer}`, its own
    ///   eight examples, 64 samples at temperature 0.2 per document;
    /// - `gsm8k_cot`: the same documents and eight examples, greedy; `gsm8k_cot_zeroshot`:
    ///   `{"context": "Q: …\nA: Let's think step by step.", "target": answer}`, no examples;
    /// - `gpqa_main_cot_zeroshot` (and `_diamond_`, `_extended_`): zero-shot,
    ///   `{"context": "What is the correct answer to this question:…\nChoices:\n(A) …\n…
    ///   Let's think step by step: ", "target": "(B)", "choices": [four texts]}`;
    /// - `mmlu_flan_cot_zeroshot` (every subject's task; `mmlu_flan_cot_zeroshot_<subject>`
    ///   adds the subject's description): zero-shot, `{"context": "Q: …\n(A) …
    ///   (B) … (C) … (D) …\nA: Let's think step by step.", "target": "(C)", "choices": […]}`;
    /// - `triviaqa`: `{"context": "Question: …?\nAnswer:", "target": [the aliases]}`, and
    ///   `nq_open`: `{"context": "Q: …?\nA:", "target": [the answers]}` (its description and
    ///   `"\n"` between examples): one line, compared after `remove_whitespace` in lower case
    ///   without punctuation (and, in `nq_open`, articles);
    /// - the translation tasks ([`TRANSLATION_TASKS`]): zero-shot, one line, `{"context":
    ///   "German phrase: …\nEnglish phrase:", "target": " …"}`, scored by corpus BLEU, TER
    ///   and chrF.
    ///
    /// GPQA's and MMLU's take the answer letter by `multi_choice_regex`, which reads
    /// `choices`.
    pub fn named(name: &str) -> Result<TaskPreset> {
        let mut preset = TaskPreset::settings(name)?;
        let (text, target) = lm_eval_doc_settings(name);
        preset.doc_to_text = text.map(Setting::Template);
        preset.doc_to_target = target.map(Setting::Template);
        Ok(preset)
    }

    /// The task `name`'s settings without its documents' templates.
    fn settings(name: &str) -> Result<TaskPreset> {
        let filters = |json: &str| {
            FilterPipeline::parse_list(
                &serde_json::from_str(json)
                    .map_err(|e| TrainError::Input(format!("{name}'s filter list: {e}")))?,
            )
        };
        // `mmlu_flan_cot_zeroshot_<subject>`: the template's settings and the subject's
        // description.
        if let Some(subject) = name.strip_prefix("mmlu_flan_cot_zeroshot_") {
            if !MMLU_SUBJECTS.contains(&subject) {
                return Err(TrainError::Input(format!(
                    "no task preset {name:?}: {subject:?} is not one of MMLU's 57 subjects"
                )));
            }
            return Ok(TaskPreset {
                description: Some(format!(
                    "The following are multiple choice questions (with answers) about {}.\n\n",
                    subject.replace('_', " ")
                )),
                ..TaskPreset::named("mmlu_flan_cot_zeroshot")?
            });
        }
        match name {
            "gsm8k" => Ok(TaskPreset {
                until: ["Question:", "</s>", "<|im_end|>"]
                    .map(str::to_owned)
                    .to_vec(),
                filters: filters(GSM8K_FILTERS)?,
                metric: gsm8k_metric()?,
                num_fewshot: 5,
                do_sample: Some(false),
                temperature: None,
                repeats: 1,
                examples: None,
                description: None,
                fewshot_delimiter: None,
                exact_match: true,
                corpus_metrics: Vec::new(),
                doc_to_text: None,
                doc_to_target: None,
            }),
            "gsm8k_cot_self_consistency" | "gsm8k-cot-self-consistency" => Ok(TaskPreset {
                until: ["Q:", "\n\n"].map(str::to_owned).to_vec(),
                filters: filters(GSM8K_SELF_CONSISTENCY_FILTERS)?,
                metric: gsm8k_metric()?,
                num_fewshot: 8,
                do_sample: Some(true),
                temperature: Some(0.2),
                repeats: 64,
                examples: Some(gsm8k_cot_examples(name)?),
                description: None,
                fewshot_delimiter: None,
                exact_match: true,
                corpus_metrics: Vec::new(),
                doc_to_text: None,
                doc_to_target: None,
            }),
            "gsm8k_cot" | "gsm8k-cot" | "gsm8k_cot_zeroshot" => Ok(TaskPreset {
                until: ["Q:", "</s>", "<|im_end|>"].map(str::to_owned).to_vec(),
                filters: filters(GSM8K_COT_FILTERS)?,
                metric: gsm8k_metric()?,
                num_fewshot: if name == "gsm8k_cot_zeroshot" { 0 } else { 8 },
                do_sample: Some(false),
                temperature: None,
                repeats: 1,
                examples: if name == "gsm8k_cot_zeroshot" {
                    None
                } else {
                    Some(gsm8k_cot_examples(name)?)
                },
                description: None,
                fewshot_delimiter: None,
                exact_match: true,
                corpus_metrics: Vec::new(),
                doc_to_text: None,
                doc_to_target: None,
            }),
            "gpqa_main_cot_zeroshot"
            | "gpqa_diamond_cot_zeroshot"
            | "gpqa_extended_cot_zeroshot"
            | "mmlu_flan_cot_zeroshot" => Ok(TaskPreset {
                until: if name.starts_with("gpqa") {
                    vec!["</s>".to_owned()]
                } else {
                    ["</s>", "Q:", "<|im_end|>"].map(str::to_owned).to_vec()
                },
                filters: filters(if name.starts_with("gpqa") {
                    GPQA_COT_FILTERS
                } else {
                    MMLU_FLAN_COT_FILTERS
                })?,
                metric: ExactMatch {
                    ignore_case: true,
                    ignore_punctuation: true,
                    ..ExactMatch::default()
                },
                num_fewshot: 0,
                do_sample: Some(false),
                temperature: None,
                repeats: 1,
                examples: None,
                description: None,
                fewshot_delimiter: None,
                exact_match: true,
                corpus_metrics: Vec::new(),
                doc_to_text: None,
                doc_to_target: None,
            }),
            "triviaqa" | "nq_open" => Ok(TaskPreset {
                until: ["\n", ".", ","].map(str::to_owned).to_vec(),
                filters: filters(
                    r#"[{"name": "remove_whitespace", "filter": [
                        {"function": "remove_whitespace"}, {"function": "take_first"}]}]"#,
                )?,
                metric: ExactMatch {
                    regexes_to_ignore: if name == "nq_open" {
                        vec![PyRegex::new(r"\b(?:The |the |An |A |The |a |an )")?]
                    } else {
                        Vec::new()
                    },
                    ignore_case: true,
                    ignore_punctuation: true,
                    ignore_numbers: false,
                },
                num_fewshot: 0,
                do_sample: Some(false),
                temperature: None,
                repeats: 1,
                examples: None,
                description: (name == "nq_open").then(|| "Answer these questions:\n\n".to_owned()),
                fewshot_delimiter: (name == "nq_open").then(|| "\n".to_owned()),
                exact_match: true,
                corpus_metrics: Vec::new(),
                doc_to_text: None,
                doc_to_target: None,
            }),
            _ if TRANSLATION_TASKS.contains(&name) => Ok(TaskPreset {
                until: vec!["\n".to_owned()],
                filters: vec![FilterPipeline::none()],
                metric: ExactMatch::default(),
                num_fewshot: 0,
                do_sample: Some(false),
                temperature: None,
                repeats: 1,
                examples: None,
                description: None,
                fewshot_delimiter: None,
                exact_match: false,
                corpus_metrics: vec![CorpusMetric::Bleu, CorpusMetric::Ter, CorpusMetric::Chrf],
                doc_to_text: None,
                doc_to_target: None,
            }),
            other => Err(TrainError::Input(format!(
                "no task preset {other:?} (there are gsm8k, gsm8k_cot, gsm8k_cot_zeroshot, \
                 gsm8k_cot_self_consistency, \
                 gpqa_main_cot_zeroshot, gpqa_diamond_cot_zeroshot, gpqa_extended_cot_zeroshot, \
                 mmlu_flan_cot_zeroshot, triviaqa, nq_open and the translation tasks {})",
                TRANSLATION_TASKS.join(", ")
            ))),
        }
    }
}

/// How each document is generated.
#[derive(Clone, Debug)]
pub struct GenerationSettings {
    /// Stop strings (lm-eval's `until`); the tokenizer's end-of-sequence text is added.
    pub until: Vec<String>,
    /// The most new tokens (`max_gen_toks`), less than the model's context.
    pub max_gen_toks: usize,
    /// Token ids generation stops after (the generation config's end-of-sequence ids; the
    /// tokenizer's is added).
    pub stop_tokens: Vec<u32>,
    /// The filters answers are taken by (at least one).
    pub filters: Vec<FilterPipeline>,
    /// How an answer is compared with the targets.
    pub metric: ExactMatch,
    /// Corpus-level metrics of each filter's answers against the documents' one target each
    /// (lm-eval's `bleu`, `chrf`, `chrf++`), besides `exact_match`.
    pub corpus_metrics: Vec<CorpusMetric>,
    /// Documents generated together (lm-eval's `--batch_size`), longest prompts first as
    /// lm-eval orders them; 1 runs each alone, in document order.
    pub batch_size: usize,
    /// How each token is chosen: greedy (lm-eval's default), or sampling as a task's
    /// `do_sample: true` asks ([`lm_eval_sampling`]).
    pub sampling: Sampling,
    /// Seed of the sampler. Document `d`'s repeat `r` draws from its own generator, seeded
    /// from `(seed, d, r)`, so it draws the same whatever the batch size and the order.
    pub seed: u64,
    /// Generations per document (lm-eval's `repeats`, 64 in `gsm8k_cot_self_consistency`),
    /// at least 1; the filters see them all. Greedy repeats are one generation copied.
    pub repeats: usize,
}

/// A document's generation and what the filters made of it.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// The prompt's tokens after the cut to the context.
    pub prompt_tokens: usize,
    /// Of those, summed over the document's generations, the ones whose keys and values an
    /// earlier generation had computed.
    pub reused_tokens: usize,
    /// Tokens generated, summed over the generations run.
    pub new_tokens: usize,
    /// Each repeat's text, cut at the stop strings (lm-eval's `resps`).
    pub responses: Vec<String>,
    /// Each filter's answer (lm-eval's `filtered_resps`), in filter order.
    pub filtered: Vec<String>,
    /// Each filter's answer is right.
    pub exact_match: Vec<bool>,
}

/// A run's metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationReport {
    /// Documents.
    pub documents: usize,
    /// Tokens generated.
    pub new_tokens: u64,
    /// Prompt tokens, counted once per generation run.
    pub prompt_tokens: u64,
    /// Of those, the ones whose keys and values an earlier generation had computed.
    pub reused_prompt_tokens: u64,
    /// `exact_match` under each filter, by its name.
    pub exact_match: Vec<(String, Metric)>,
    /// Each corpus metric under each filter (filters outer, metrics inner).
    pub corpus: Vec<CorpusScore>,
}

/// A corpus metric of one filter's answers.
#[derive(Clone, Debug, PartialEq)]
pub struct CorpusScore {
    /// The filter's name.
    pub filter: String,
    /// The metric.
    pub metric: CorpusMetric,
    /// Its score over every document (0–100).
    pub score: f64,
    /// lm-eval's bootstrap standard error (`None` below two documents).
    pub stderr: Option<f64>,
}

/// The end-of-sequence ids transformers' `generate` stops at for the model in `dir`: its
/// `generation_config.json`'s, or without one its `config.json`'s `eos_token_id` (an id or a
/// list), as `GenerationConfig.from_model_config` takes them; none without either.
pub fn generation_eos_ids(dir: &Path) -> Result<Vec<u32>> {
    if let Some(config) = crate::sample::GenerationConfig::beside(dir)? {
        return Ok(config.eos_token_ids);
    }
    // Checked by `config_token_ids`: each an id that fits u32.
    let ids = crate::companions::config_token_ids(dir)?;
    Ok(match ids.as_ref().and_then(|m| m.get("eos_token_id")) {
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .filter_map(|v| v.as_u64().and_then(|i| u32::try_from(i).ok()))
            .collect(),
        Some(v) => v
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .into_iter()
            .collect(),
        None => Vec::new(),
    })
}

/// The prompt tokens lm-eval generates after for `context`: encoded with the tokenizer's
/// special tokens unless the text starts with its `bos_token`'s, cut from the left to
/// `max_tokens`.
pub fn prompt_tokens(tok: &Tokenizer, context: &str, max_tokens: usize) -> Result<Vec<u32>> {
    let bos_text = match tok.bos_token()? {
        Some(id) => Some(tok.decode(&[id])?),
        None => None,
    };
    let ids = match &bos_text {
        Some(bos) if !bos.is_empty() && context.starts_with(bos.as_str()) => tok.encode(context)?,
        _ => tok.encode_sequence(context)?,
    };
    if ids.is_empty() {
        return Err(TrainError::Input(format!(
            "the context {context:?} encodes to no tokens"
        )));
    }
    Ok(ids[ids.len().saturating_sub(max_tokens)..].to_vec())
}

/// `text` cut before the first occurrence of each stop string in turn (lm-eval's
/// `postprocess_generated_text`; empty strings skipped).
pub fn cut_at_stops(text: &str, until: &[String]) -> String {
    let mut text = text;
    for stop in until.iter().filter(|s| !s.is_empty()) {
        if let Some(at) = text.find(stop.as_str()) {
            text = &text[..at];
        }
    }
    text.to_owned()
}

/// The sampler lm-eval's `HFLM` has transformers' `generate` build from a task's
/// `generation_kwargs` and the model's `config` (its `generation_config.json`, else
/// transformers' defaults): `temperature` is 0 unless given; `do_sample` unset is `false` at
/// temperature 0 and otherwise the config's (so a temperature alone samples only where the
/// config samples); sampling takes top-k, top-p and min-p from `asked`, else from the config,
/// else top-k 50. The config's repetition penalty applies unless `asked` sets one, greedy or
/// not. Sampling at temperature 0 is refused, as transformers refuses it.
pub fn lm_eval_sampling(
    config: &crate::sample::GenerationConfig,
    do_sample: Option<bool>,
    asked: &crate::sample::SamplingRequest,
) -> Result<Sampling> {
    let temperature = asked.temperature.unwrap_or(0.0);
    let do_sample = match do_sample {
        Some(d) => d,
        None if temperature == 0.0 => false,
        None => config.do_sample.unwrap_or(false),
    };
    if !do_sample {
        return config.sampling(&crate::sample::SamplingRequest {
            temperature: Some(0.0),
            ..*asked
        });
    }
    if temperature == 0.0 {
        return Err(TrainError::Input(
            "sampling (do_sample) at temperature 0: lm-eval passes it to transformers, which \
             refuses it; give a temperature above 0"
                .into(),
        ));
    }
    config.sampling(&crate::sample::SamplingRequest {
        temperature: Some(temperature),
        ..*asked
    })
}

/// Generate each document's answers after its `contexts` entry (its prompt text, few-shot
/// examples and chat template applied), `settings.repeats` of them, and score them under
/// each filter, calling `each` with each document's index and result in document order, as
/// soon as it and every document before it are done. With `settings.batch_size` above 1 the
/// generations run in batches, longest prompts first, as lm-eval batches them (a document's
/// repeats side by side, sharing their whole prompt).
pub fn evaluate<B: ModelOps>(
    model: &Model<B>,
    tok: &Tokenizer,
    docs: &[GenerationDoc],
    contexts: &[String],
    settings: &GenerationSettings,
    mut each: impl FnMut(usize, &Generated) -> Result<()>,
) -> Result<GenerationReport> {
    if docs.is_empty() || docs.len() != contexts.len() {
        return Err(TrainError::Input(format!(
            "{} documents with {} prompts",
            docs.len(),
            contexts.len()
        )));
    }
    let (filters, metric) = (&settings.filters, &settings.metric);
    if filters.is_empty() {
        return Err(TrainError::Input("no filters".into()));
    }
    if settings.repeats == 0 {
        return Err(TrainError::Input("0 repeats per document".into()));
    }
    if let Some(f) = filters
        .iter()
        .find(|f| f.responses_needed() > settings.repeats)
    {
        return Err(TrainError::Input(format!(
            "filter {}: take_first_k {} needs as many repeats; there are {}",
            f.name,
            f.responses_needed(),
            settings.repeats
        )));
    }
    if !settings.corpus_metrics.is_empty() {
        // lm-eval hands a corpus metric the target as it is: a list of targets breaks it.
        if let Some(i) = docs.iter().position(|d| d.targets.len() != 1) {
            return Err(TrainError::Input(format!(
                "document {}: {} has {} targets; lm-eval's corpus metrics take one reference \
                 per document",
                i + 1,
                settings.corpus_metrics[0].name(),
                docs[i].targets.len()
            )));
        }
        // Refused before anything runs, as sacreBLEU would take it whole.
        if let Some(i) = docs
            .iter()
            .position(|d| d.targets[0].len() > crate::corpus_metrics::MAX_SEGMENT_BYTES)
        {
            return Err(TrainError::Input(format!(
                "document {}: a target of {} bytes; corpus metrics score at most {} per segment",
                i + 1,
                docs[i].targets[0].len(),
                crate::corpus_metrics::MAX_SEGMENT_BYTES
            )));
        }
    }
    let max_seq = model.cfg.max_seq;
    if settings.max_gen_toks == 0 || settings.max_gen_toks >= max_seq {
        return Err(TrainError::Input(format!(
            "max_gen_toks {} must be at least 1 and below the model's context of {max_seq} \
             (lm-eval keeps the prompt within the rest)",
            settings.max_gen_toks
        )));
    }
    settings.sampling.validate()?;
    let eos = tok.eos_token()?;
    let mut until = settings.until.clone();
    if let Some(id) = eos {
        let text = tok.decode(&[id])?;
        if !until.contains(&text) {
            until.push(text);
        }
    }
    let mut stop_tokens: Vec<u32> = settings.stop_tokens.iter().copied().chain(eos).collect();
    stop_tokens.sort_unstable();
    stop_tokens.dedup();
    let opts = SampleOptions {
        tokens: settings.max_gen_toks,
        sampling: settings.sampling,
        seed: settings.seed,
        stop_tokens,
        // transformers' argmax and draws run over every row of the head, a padded
        // vocabulary's rows past the tokenizer's too (they decode to nothing).
        vocab_limit: None,
    };
    if settings.batch_size == 0 {
        return Err(TrainError::Input("a batch size of 0 documents".into()));
    }
    let stops_text = |generated: &[u32]| -> Result<bool> {
        // lm-eval cuts its text at the stop strings, so generation may end once the text holds
        // one.
        let text = tok.decode_skipping_special(generated)?;
        Ok(until
            .iter()
            .any(|s| !s.is_empty() && text.contains(s.as_str())))
    };
    let flow = |stop: bool| {
        if stop {
            std::ops::ControlFlow::Break(())
        } else {
            std::ops::ControlFlow::Continue(())
        }
    };
    let mut kept = PromptCache::new();
    let mut results = vec![Vec::with_capacity(docs.len()); filters.len()];
    // Per filter, per corpus metric, each document's statistics.
    let mut segments: Vec<Vec<Vec<Vec<f64>>>> =
        vec![vec![Vec::with_capacity(docs.len()); settings.corpus_metrics.len()]; filters.len()];
    let (mut new_tokens, mut prompt_total, mut reused_total) = (0u64, 0u64, 0u64);
    let in_doc =
        |i: usize| move |e: TrainError| TrainError::Input(format!("document {}: {e}", i + 1));
    let prompts = contexts
        .iter()
        .enumerate()
        .map(|(i, context)| {
            prompt_tokens(tok, context, max_seq - settings.max_gen_toks).map_err(in_doc(i))
        })
        .collect::<Result<Vec<_>>>()?;
    // Greedy repeats are identical: one is run and copied (lm-eval runs each).
    let runs = if settings.sampling.temperature == 0.0 {
        1
    } else {
        settings.repeats
    };
    let mut doc_order: Vec<usize> = (0..docs.len()).collect();
    if settings.batch_size > 1 {
        // lm-eval's batched generate_until runs the longest prompts first (its Collator), so a
        // batch's tails pad little; the answers still come back in document order.
        doc_order.sort_by_key(|&d| std::cmp::Reverse(prompts[d].len()));
    }
    // (document, repeat) for every generation, a document's repeats side by side, made as
    // the batches take them (documents × repeats can be large).
    let mut generations = doc_order
        .iter()
        .flat_map(|&d| (0..runs).map(move |r| (d, r)));
    let seed_of = |(d, r): (usize, usize)| derive_seed(&[settings.seed, d as u64, r as u64]);
    // Each document's finished generations (repeat, new tokens, reused prompt positions),
    // until its turn to be reported.
    let mut done: Vec<Vec<(usize, Vec<u32>, usize)>> = vec![Vec::new(); docs.len()];
    let mut next = 0;
    loop {
        let batch: Vec<(usize, usize)> = generations.by_ref().take(settings.batch_size).collect();
        if batch.is_empty() {
            break;
        }
        let (outputs, reused) = if let [(d, r)] = batch[..] {
            let mut generated = Vec::new();
            let this = SampleOptions {
                seed: seed_of((d, r)),
                ..opts.clone()
            };
            let (new, reused) = generate_cached(model, &mut kept, &prompts[d], &this, |id| {
                generated.push(id);
                Ok(flow(stops_text(&generated).map_err(in_doc(d))?))
            })?;
            (vec![new], vec![reused])
        } else {
            let rows: Vec<&[u32]> = batch.iter().map(|&(d, _)| prompts[d].as_slice()).collect();
            let seeds: Vec<u64> = batch.iter().map(|&row| seed_of(row)).collect();
            let mut generated = vec![Vec::new(); rows.len()];
            generate_batch_cached(model, &mut kept, &rows, &seeds, &opts, |row, id| {
                generated[row].push(id);
                Ok(flow(
                    stops_text(&generated[row]).map_err(in_doc(batch[row].0))?,
                ))
            })?
        };
        for ((&(d, r), new), reused) in batch.iter().zip(outputs).zip(reused) {
            done[d].push((r, new, reused));
        }
        // Report in document order, as soon as every earlier document is done.
        while next < docs.len() && done[next].len() == runs {
            let (i, doc, prompt) = (next, &docs[next], &prompts[next]);
            next += 1;
            let in_doc = in_doc(i);
            let mut responses = Vec::with_capacity(settings.repeats);
            let (mut generated, mut reused) = (0, 0);
            let mut finished = std::mem::take(&mut done[i]);
            finished.sort_by_key(|&(r, _, _)| r);
            for (_, new, r) in finished {
                responses.push(cut_at_stops(&tok.decode_skipping_special(&new)?, &until));
                generated += new.len();
                reused += r;
            }
            while responses.len() < settings.repeats {
                responses.push(responses[0].clone());
            }
            let filtered = filters
                .iter()
                .map(|f| f.apply_to(&responses, &doc.json))
                .collect::<Result<Vec<_>>>()
                .map_err(in_doc)?;
            let exact_match = filtered
                .iter()
                .map(|answer| metric.matches(answer, &doc.targets))
                .collect::<Result<Vec<_>>>()
                .map_err(in_doc)?;
            for (r, &m) in results.iter_mut().zip(&exact_match) {
                r.push(m);
            }
            for (per_metric, answer) in segments.iter_mut().zip(&filtered) {
                for (stats, metric) in per_metric.iter_mut().zip(&settings.corpus_metrics) {
                    stats.push(metric.segment(answer, &doc.targets).map_err(&in_doc)?);
                }
            }
            new_tokens += generated as u64;
            prompt_total += (prompt.len() * runs) as u64;
            reused_total += reused as u64;
            each(
                i,
                &Generated {
                    prompt_tokens: prompt.len(),
                    reused_tokens: reused,
                    new_tokens: generated,
                    responses,
                    filtered,
                    exact_match,
                },
            )?;
        }
    }
    if next != docs.len() {
        return Err(TrainError::Input(format!(
            "{next} of {} documents reported",
            docs.len()
        )));
    }
    Ok(GenerationReport {
        documents: docs.len(),
        new_tokens,
        prompt_tokens: prompt_total,
        reused_prompt_tokens: reused_total,
        exact_match: filters
            .iter()
            .zip(&results)
            .map(|(f, r)| (f.name.clone(), Metric::of(r)))
            .collect(),
        corpus: filters
            .iter()
            .zip(&segments)
            .flat_map(|(f, per_metric)| {
                settings
                    .corpus_metrics
                    .iter()
                    .zip(per_metric)
                    .map(|(&metric, stats)| CorpusScore {
                        filter: f.name.clone(),
                        metric,
                        score: metric.corpus(stats),
                        stderr: metric.stderr(stats),
                    })
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn py(pattern: &str) -> PyRegex {
        PyRegex::new(pattern).unwrap()
    }

    #[test]
    fn python_dialect_is_translated() {
        // `$` before a final newline, as Python's.
        assert_eq!(py(r"\.$").remove_all("72.\n").unwrap(), "72\n");
        assert_eq!(py(r"\.$").remove_all("7.2.").unwrap(), "7.2");
        assert_eq!(py(r"a\Z").remove_all("aa").unwrap(), "a");
        // Literal braces and brackets.
        assert_eq!(py(r"{x}").remove_all("a{x}b").unwrap(), "ab");
        assert_eq!(py(r"a{,2}").remove_all("aaab").unwrap(), "b");
        assert_eq!(py(r"[][&~]").remove_all("a[b]&c~").unwrap(), "abc");
        // (?m): `$` before every newline in both dialects.
        assert_eq!(py(r"(?m)x$").remove_all("x\nx\n").unwrap(), "\n\n");
    }

    #[test]
    fn findall_and_sub_step_as_python() {
        // Python 3.7+: an empty match right after a non-empty one counts.
        assert_eq!(py("x*").remove_all("abxd").unwrap(), "abd");
        let found = py("x*").findall("abxd").unwrap();
        let whole: Vec<&str> = found
            .iter()
            .map(|f| match f {
                Found::Whole(s) => s.as_str(),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(whole, ["", "", "x", "", ""]);
        assert_eq!(
            py(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
                .findall("a 7 b 12.5")
                .unwrap(),
            [
                Found::Groups(vec!["".into(), "7".into()]),
                Found::Groups(vec!["12.5".into(), "".into()])
            ]
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

        /// Cutting at the stop strings leaves a prefix that holds none of them, and cutting
        /// again changes nothing.
        #[test]
        fn cut_text_holds_no_stop_string(
            text in "[ab\n]{0,40}",
            stops in proptest::collection::vec("[ab\n]{0,3}", 0..4),
        ) {
            let cut = cut_at_stops(&text, &stops);
            proptest::prop_assert!(text.starts_with(&cut));
            // Each cut leaves a text without its string, and later cuts keep prefixes of it.
            for s in stops.iter().filter(|s| !s.is_empty()) {
                proptest::prop_assert!(!cut.contains(s.as_str()), "{:?} in {:?}", s, cut);
            }
            // Nothing is cut that held no stop string.
            if stops.iter().all(|s| s.is_empty() || !text.contains(s.as_str())) {
                proptest::prop_assert_eq!(&cut, &text);
            }
            proptest::prop_assert_eq!(cut_at_stops(&cut, &stops), cut.clone());
        }

        /// `multi_choice_regex` finds a choice written anywhere in a response by its text,
        /// whatever characters the text holds (they are escaped as Python's `re.escape`
        /// escapes them), and names it by its letter; a choice written nowhere is not found.
        #[test]
        fn choices_are_found_by_their_escaped_text(
            choices in proptest::collection::vec(
                "[a-cé]([a-c(){}\\[\\]?*+|^$.&~#\\\\ é¿—_-]{0,4}[a-cé])?",
                1..6,
            ),
            pick in 0usize..6,
            ignore_punctuation in proptest::prelude::any::<bool>(),
        ) {
            let step = MultiChoiceRegex {
                // Never matches, so the choices decide.
                regex: PyRegex::new("(?!)").unwrap(),
                group_select: 0,
                fallback: "none".into(),
                ignore_case: false,
                ignore_punctuation,
                regexes_to_ignore: Vec::new(),
            };
            let pick = pick % choices.len();
            let doc = serde_json::json!({ "choices": choices });
            let normalised: Vec<String> = choices
                .iter()
                .map(|c| step.normalise(python_strip(c)).unwrap())
                .collect();
            let chosen = &normalised[pick];
            // A text that punctuation leaves with outer spaces is found stripped, and a stripped
            // match is looked up as it is (lm-eval keeps the text then): not checked here.
            proptest::prop_assume!(!chosen.is_empty() && python_strip(chosen) == chosen);
            // Only the unambiguous cases are checked: no other choice in the response.
            let response = format!("so {} it is", choices[pick]);
            let seen = step.normalise(&response).unwrap();
            proptest::prop_assume!(normalised
                .iter()
                .all(|other| other == chosen || !seen.contains(other.as_str())));
            let mut responses = vec![response];
            step.apply(&mut responses, &doc).unwrap();
            // A repeated text takes its last letter.
            let last = normalised.iter().rposition(|n| n == chosen).unwrap();
            let letter = format!("({})", char::from(b'A' + last as u8));
            proptest::prop_assert_eq!(&responses[0], &letter);
            let mut nowhere = vec!["xyz".to_owned()];
            step.apply(&mut nowhere, &doc).unwrap();
            proptest::prop_assert!(
                nowhere[0] == "none" || normalised.iter().any(|n| n.is_empty() || "xyz".contains(n.as_str())),
                "{:?}", nowhere
            );
        }

        /// The regex filter's answer is a stripped match of the pattern or the fallback, and
        /// exact_match is reflexive and insensitive to what it is told to ignore.
        #[test]
        fn filter_answers_are_matches_and_exact_match_ignores_what_it_is_told(
            words in proptest::collection::vec("[a-z]{1,4}|[0-9]{1,3}|#### [0-9]{1,3}", 0..8),
            select in -3i64..3,
        ) {
            let text = words.join(" ");
            let pipeline = FilterPipeline {
                name: "f".into(),
                steps: vec![FilterStep::Regex {
                    regex: py(r"(-?[0-9]+)"),
                    group_select: select,
                    fallback: "[invalid]".into(),
                }],
            };
            let numbers: Vec<&str> = text
                .split(|c: char| !c.is_ascii_digit())
                .filter(|s| !s.is_empty())
                .collect();
            let n = numbers.len() as i64;
            match pipeline.apply(std::slice::from_ref(&text)) {
                Ok(answer) if numbers.is_empty() => proptest::prop_assert_eq!(answer, "[invalid]"),
                Ok(answer) => {
                    let at = if select < 0 { n + select } else { select };
                    proptest::prop_assert_eq!(answer, numbers[at as usize]);
                }
                Err(_) => proptest::prop_assert!(select >= n || -select > n),
            }
            let metric = ExactMatch {
                regexes_to_ignore: vec![py(",")],
                ignore_case: true,
                ignore_punctuation: true,
                ignore_numbers: false,
            };
            proptest::prop_assert!(metric.matches(&text, std::slice::from_ref(&text)).unwrap());
            let shouted = format!("{}!,", text.to_uppercase());
            proptest::prop_assert!(metric.matches(&shouted, std::slice::from_ref(&text)).unwrap());
        }
    }
}
