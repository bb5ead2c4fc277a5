//! Multiple-choice evaluation as EleutherAI's lm-evaluation-harness scores it (HellaSwag, ARC,
//! PIQA, MMLU as log-likelihoods): each choice's log-likelihood after the question's context,
//! and from them the question's `acc`, `acc_norm`, `acc_bytes` and `exact_match`.
//!
//! ```
//! use headroom_trainer::choices::{Gold, Question};
//! let q = Question::parse(r#"{"context": "2 + 2 =", "choices": ["4", "5"], "gold": "4"}"#).unwrap();
//! assert_eq!(q.gold, Gold::One(0));
//! // What lm-eval scores for each choice: the context, then the target delimiter and the choice.
//! assert_eq!(q.continuation(1, " "), " 5");
//! ```
//!
//! A question is one JSON line: `context` (text), `choices` (non-empty texts) and `gold`, the
//! right choice's index, its text, or a list of indices when several are right. Each choice
//! is scored as lm-eval's `HFLM` scores the request `(context, delimiter + choice)`:
//!
//! - the context's trailing whitespace moves to the front of the continuation;
//! - the context and context + continuation are each encoded with the tokenizer's own special
//!   tokens (a Llama tokenizer's `<s>`; none when the text already starts with the prefix
//!   token's text), and the continuation's tokens are those of the whole past the context's;
//! - an empty context becomes the prefix token (the tokenizer's `bos_token`, else its
//!   `eos_token`) unless the continuation starts with it;
//! - the input is the last `context + 1` tokens less the last, cut from the left;
//! - the log-likelihood is the sum of the continuation tokens' log-softmax, and `is_greedy`
//!   whether each of them is its position's argmax.
//!
//! The question is right (`acc`) when the highest log-likelihood is a gold choice's (the first
//! of equals, numpy's `argmax`); `acc_norm` divides each by the choice's length in characters,
//! `acc_bytes` by its UTF-8 bytes; `exact_match` is whether a gold choice is the greedy
//! continuation. Each metric is a mean over questions with its standard error (the sample
//! standard deviation over √n, lm-eval's `mean_stderr`). `tests/choices.rs` checks every
//! request, log-likelihood, flag and metric against lm-eval 0.4.13 runs
//! (`benches/torch/make_choices_fixture.py`).
//!
//! Multiple input (lm-eval's Winogrande): the choices are alternative contexts and one
//! `continuation` is scored after each (`{"choices": [...], "continuation": ..., "gold": i}`,
//! or Winogrande's own `sentence` with its `_` blank, `option1`, `option2` and `answer`,
//! split as lm-eval's `winogrande` task splits it). `acc_norm` and `acc_bytes` then divide
//! by the contexts' lengths, as lm-eval does; a few-shot example shows its gold context, the
//! target delimiter and the continuation; each context runs after the keys and values of the
//! one before ([`Question::context_for`]).
//!
//! Two differences, both on input lm-eval scores as wrong without saying why: a gold index
//! out of range or a gold text that is not a choice is an error here (lm-eval warns and counts
//! the question wrong), and so is an empty choice (lm-eval divides by its length 0).
//!
//! Few-shot prompts ([`Fewshot`], [`fewshot_contexts`]) are lm-eval's: the description, then
//! each example's context, the target delimiter, its gold choice and the few-shot delimiter,
//! then the question's context; examples come from their own file or from the questions'
//! (each question left out of its own, as lm-eval leaves it out when the few-shot split is the
//! test split), drawn by lm-eval's `default` sampler, CPython's `random.Random(seed).sample`
//! question after question ([`PyRandom`]), or its `first_n` (MMLU's).
//!
//! Compute and memory: a question's context is run once, its keys and values cached, and each
//! question's continuations run together after copies of them ([`Model::repeat_cache`],
//! [`Model::decode_at`]; one-token choices need nothing more), and only the continuations'
//! rows reach the head, so no `[tokens, vocabulary]` logits exist, as they do in lm-eval. Choices whose input is cut to the model's context (so no longer shares
//! the context's start) run as one batch padded on the right (a causal model's positions never
//! see the padding), with only the continuations' rows reaching the head
//! ([`Model::logits_at`]). A context's keys and values are kept for the next question, which
//! runs only what follows the prefix the two share ([`score_reusing`]): a few-shot prompt's
//! description and examples, run once for a whole MMLU subject.

use std::path::Path;

use crate::doc_template::{DocTemplates, ProcessDocs, Setting};
use crate::model::{Geometry, Model, ModelOps};
use crate::pyrandom::PyRandom;
use crate::sample::PromptCache;
use crate::tokenize::Tokenizer;
use crate::{Result, TrainError};

/// The largest questions file read (MMLU's 14 042 test questions are 7 MiB as JSONL).
pub const MAX_QUESTIONS_BYTES: u64 = 1 << 30;

/// The most token positions one padded batch holds (a question's choices cut to the model's
/// context, a document's windows); more run in several batches. Small on purpose: on the CPU
/// a longer batch is hardly faster (GPT-2 124M scored 16 README paragraphs in 42 s at 16 K
/// and at 2 K), while its activations grow with it (3 119 against 1 306 MiB of RSS).
const MAX_BATCH_TOKENS: usize = 2 << 10;

/// Which of a question's choices are right.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gold {
    /// This one.
    One(usize),
    /// Any of these (lm-eval's multiple targets).
    Any(Vec<usize>),
}

impl Gold {
    fn contains(&self, i: usize) -> bool {
        match self {
            Gold::One(g) => *g == i,
            Gold::Any(gs) => gs.contains(&i),
        }
    }

    fn indices(&self) -> &[usize] {
        match self {
            Gold::One(g) => std::slice::from_ref(g),
            Gold::Any(gs) => gs,
        }
    }
}

/// One multiple-choice question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Question {
    /// The text the choices continue; with `continuation`, the text before each choice (a
    /// few-shot prompt's examples, empty without them).
    pub context: String,
    /// The answers to score, each non-empty; with `continuation`, the alternative contexts.
    pub choices: Vec<String>,
    /// The right ones, each an index into `choices`.
    pub gold: Gold,
    /// lm-eval's multiple input (Winogrande's partial scoring): the text scored after each
    /// choice, the choices being contexts; `None` when the choices are what is scored.
    pub continuation: Option<String>,
}

impl Question {
    /// A question from its JSON object (`context`, `choices`, `gold`; or `choices`,
    /// `continuation`, `gold` for multiple input; or Winogrande's own `sentence`, `option1`,
    /// `option2`, `answer`); the error says which field is wrong.
    pub fn parse(line: &str) -> std::result::Result<Question, String> {
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        let object = value.as_object().ok_or("not a JSON object")?;
        if object.contains_key("sentence") {
            return Question::winogrande(object);
        }
        let continuation = match object.get("continuation") {
            Some(serde_json::Value::String(s)) if !s.is_empty() => Some(s.clone()),
            Some(_) => return Err("\"continuation\" is not non-empty text".into()),
            None => None,
        };
        let context = match (object.get("context"), &continuation) {
            (Some(serde_json::Value::String(s)), None) => s.clone(),
            (Some(_), None) => return Err("\"context\" is not text".into()),
            (None, None) => return Err("no \"context\"".into()),
            (None, Some(_)) => String::new(),
            (Some(_), Some(_)) => {
                return Err(
                    "both \"context\" and \"continuation\": with a continuation the \
                            choices are the contexts"
                        .into(),
                )
            }
        };
        let choices: Vec<String> = match object.get("choices") {
            Some(serde_json::Value::Array(items)) if !items.is_empty() => items
                .iter()
                .enumerate()
                .map(|(i, c)| match c.as_str() {
                    Some("") => Err(format!(
                        "choice {i} is empty (acc_norm divides by its length)"
                    )),
                    Some(s) => Ok(s.to_owned()),
                    None => Err(format!("choice {i} is not text")),
                })
                .collect::<std::result::Result<_, _>>()?,
            Some(_) => return Err("\"choices\" is not a non-empty list".into()),
            None => return Err("no \"choices\"".into()),
        };
        let index = |v: &serde_json::Value| -> std::result::Result<usize, String> {
            v.as_u64()
                .and_then(|i| usize::try_from(i).ok())
                .filter(|&i| i < choices.len())
                .ok_or_else(|| {
                    format!(
                        "gold {v} is not the index of one of the {} choices",
                        choices.len()
                    )
                })
        };
        let gold = match object.get("gold") {
            Some(serde_json::Value::String(text)) => Gold::One(
                choices
                    .iter()
                    .position(|c| c == text)
                    .ok_or_else(|| format!("gold {text:?} is not one of the choices"))?,
            ),
            Some(serde_json::Value::Array(items)) if !items.is_empty() => Gold::Any(
                items
                    .iter()
                    .map(index)
                    .collect::<std::result::Result<_, _>>()?,
            ),
            Some(serde_json::Value::Array(_)) => return Err("\"gold\" is an empty list".into()),
            Some(v) => Gold::One(index(v)?),
            None => return Err("no \"gold\"".into()),
        };
        if continuation.is_some() && matches!(gold, Gold::Any(_)) {
            return Err("several gold contexts: lm-eval's multiple input has one".into());
        }
        Ok(Question {
            context,
            choices,
            gold,
            continuation,
        })
    }

    /// Winogrande's document: the `sentence` with `_` where `option1` or `option2` goes, the
    /// `answer` `"1"` or `"2"`, split as lm-eval's `winogrande` task splits it: each choice
    /// the sentence up to the blank with the option, the continuation what follows the blank,
    /// stripped.
    fn winogrande(
        object: &serde_json::Map<String, serde_json::Value>,
    ) -> std::result::Result<Question, String> {
        let text = |key: &str| match object.get(key) {
            Some(serde_json::Value::String(s)) => Ok(s.as_str()),
            _ => Err(format!("no \"{key}\" text (a Winogrande document)")),
        };
        let sentence = text("sentence")?;
        let blank = sentence
            .find('_')
            .ok_or("the sentence has no \"_\" for the option")?;
        let continuation =
            sentence[blank + 1..].trim_matches(crate::chat_template::is_python_space);
        if continuation.is_empty() {
            return Err("nothing follows the sentence's blank".into());
        }
        let gold = match text("answer")? {
            "1" => 0,
            "2" => 1,
            other => return Err(format!("answer {other:?} is not \"1\" or \"2\"")),
        };
        let choices = [text("option1")?, text("option2")?]
            .map(|o| format!("{}{o}", &sentence[..blank]))
            .to_vec();
        Ok(Question {
            context: String::new(),
            choices,
            gold: Gold::One(gold),
            continuation: Some(continuation.to_owned()),
        })
    }

    /// The text scored for choice `i`: the delimiter, then the choice (or, with multiple
    /// input, the shared continuation).
    pub fn continuation(&self, i: usize, delimiter: &str) -> String {
        match &self.continuation {
            Some(c) => format!("{delimiter}{c}"),
            None => format!("{delimiter}{}", self.choices[i]),
        }
    }

    /// The context choice `i` is scored after: the question's, or with multiple input the
    /// text before the choices followed by choice `i`.
    pub fn context_for(&self, i: usize) -> String {
        match &self.continuation {
            Some(_) => format!("{}{}", self.context, self.choices[i]),
            None => self.context.clone(),
        }
    }
}

/// The questions of a JSONL file, one per non-blank line (or of a Parquet or Arrow file, one
/// per row); an error names the line.
pub fn read_questions(path: &Path) -> Result<Vec<Question>> {
    read_questions_with(path, None)
}

/// [`read_questions`], each document first mapped by a task's templates
/// ([`DocTemplates::question_line`]) when given.
pub fn read_questions_with(path: &Path, templates: Option<&DocTemplates>) -> Result<Vec<Question>> {
    let map = templates.map(|t| move |doc: &serde_json::Value| t.question_line(doc));
    read_jsonl_mapped(
        path,
        MAX_QUESTIONS_BYTES,
        "questions",
        map.as_ref().map(|m| m as LineMap<'_>),
        Question::parse,
    )
}

/// A question with the JSON object it was read from: lm-eval's document, which it compares
/// whole to keep a question out of its own few-shot examples.
#[derive(Clone, Debug, PartialEq)]
pub struct Doc {
    /// The question.
    pub question: Question,
    /// Its line, parsed.
    pub json: serde_json::Value,
}

/// [`read_questions`], each with its JSON object.
pub fn read_docs(path: &Path) -> Result<Vec<Doc>> {
    read_docs_with(path, None)
}

/// [`read_questions_with`], each with its JSON object (mapped, the document under `doc`).
pub fn read_docs_with(path: &Path, templates: Option<&DocTemplates>) -> Result<Vec<Doc>> {
    let map = templates.map(|t| move |doc: &serde_json::Value| t.question_line(doc));
    read_jsonl_mapped(
        path,
        MAX_QUESTIONS_BYTES,
        "questions",
        map.as_ref().map(|m| m as LineMap<'_>),
        |line| {
            Ok(Doc {
                question: Question::parse(line)?,
                json: serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?,
            })
        },
    )
}

/// A multiple-choice task's lm-eval settings (`eval --choices --preset NAME`): what makes
/// its dataset's rows questions, and how its prompts are built.
#[derive(Clone, Debug)]
pub struct ChoicesPreset {
    /// `doc_to_text`.
    pub doc_to_text: Setting,
    /// `doc_to_target`.
    pub doc_to_target: Setting,
    /// `doc_to_choice`.
    pub doc_to_choice: Setting,
    /// `process_docs`, where the task has one (HellaSwag's).
    pub process_docs: Option<ProcessDocs>,
    /// `description`.
    pub description: Option<String>,
    /// `fewshot_config.sampler`, when not lm-eval's default.
    pub sampler: Option<Sampler>,
}

/// The multiple-choice presets besides MMLU's (`mmlu` and `mmlu_<subject>`).
pub const CHOICES_TASKS: [&str; 9] = [
    "arc_easy",
    "arc_challenge",
    "boolq",
    "commonsense_qa",
    "hellaswag",
    "openbookqa",
    "piqa",
    "sciq",
    "social_iqa",
];

impl ChoicesPreset {
    /// The task `name`'s settings, as its lm-eval 0.4.13 YAML writes them:
    ///
    /// - `arc_easy`, `arc_challenge` (`allenai/ai2_arc`), `openbookqa`: the question, the
    ///   `choices.text`, the index of `answerKey` among `choices.label`;
    /// - `piqa`: `goal`, `[sol1, sol2]`, `label`; `sciq`: the `support` and the question,
    ///   the three distractors and then the correct answer (the target is 3);
    /// - `boolq` (`super_glue`): the passage and the question, `no`/`yes`, `label`;
    /// - `commonsense_qa`: the question and five lettered choices, the letters, `answerKey`;
    ///   `social_iqa`: the context and the question, `[answerA, answerB, answerC]`, the
    ///   string `label` less one;
    /// - `hellaswag`: its `process_docs` ([`hellaswag_process_docs`]), then `query`,
    ///   `choices` and `label`;
    /// - `mmlu` and `mmlu_<subject>` (57 subjects; the subject's description): the question
    ///   and the four lettered choices, the letters as choices, `answer`; few-shot examples
    ///   from the `dev` split in order (`first_n`).
    pub fn named(name: &str) -> Result<ChoicesPreset> {
        let text = |t: &str| Setting::Template(t.to_owned());
        let letters = |items: &[&str]| Setting::Value(serde_json::json!(items));
        let preset = |t: &str, target: Setting, choice: Setting| ChoicesPreset {
            doc_to_text: text(t),
            doc_to_target: target,
            doc_to_choice: choice,
            process_docs: None,
            description: None,
            sampler: None,
        };
        let arc = || {
            preset(
                "Question: {{question}}\nAnswer:",
                text("{{choices.label.index(answerKey)}}"),
                text("{{choices.text}}"),
            )
        };
        let mmlu = || {
            ChoicesPreset {
            sampler: Some(Sampler::FirstN),
            ..preset(
                "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD. \
                 {{choices[3]}}\nAnswer:",
                text("answer"),
                letters(&["A", "B", "C", "D"]),
            )
        }
        };
        if let Some(subject) = name.strip_prefix("mmlu_") {
            if !crate::generation::MMLU_SUBJECTS.contains(&subject) {
                return Err(TrainError::Input(format!(
                    "no task preset {name:?}: {subject:?} is not one of MMLU's 57 subjects"
                )));
            }
            return Ok(ChoicesPreset {
                description: Some(format!(
                    "The following are multiple choice questions (with answers) about {}.\n\n",
                    subject.replace('_', " ")
                )),
                ..mmlu()
            });
        }
        Ok(match name {
            "mmlu" => mmlu(),
            "arc_easy" | "arc_challenge" => arc(),
            "openbookqa" => preset(
                "question_stem",
                text("{{choices.label.index(answerKey.lstrip())}}"),
                text("{{choices.text}}"),
            ),
            "piqa" => preset(
                "Question: {{goal}}\nAnswer:",
                text("label"),
                text("{{[sol1, sol2]}}"),
            ),
            "sciq" => preset(
                "{{support.lstrip()}}\nQuestion: {{question}}\nAnswer:",
                Setting::Value(serde_json::json!(3)),
                text("{{[distractor1, distractor2, distractor3, correct_answer]}}"),
            ),
            "boolq" => preset(
                "{{passage}}\nQuestion: {{question}}?\nAnswer:",
                text("label"),
                letters(&["no", "yes"]),
            ),
            "commonsense_qa" => preset(
                "Question: {{ question.strip() }}\nA. {{choices['text'][0]}}\nB. \
                 {{choices['text'][1]}}\nC. {{choices['text'][2]}}\nD. {{choices['text'][3]}}\nE. \
                 {{choices['text'][4]}}\nAnswer:",
                text("answerKey"),
                letters(&["A", "B", "C", "D", "E"]),
            ),
            "social_iqa" => preset(
                "Q: {{context}} {{question}}\nA:",
                text("{{ (label|int) - 1 }}"),
                text("{{[answerA, answerB, answerC]}}"),
            ),
            "hellaswag" => ChoicesPreset {
                process_docs: Some(hellaswag_process_docs),
                ..preset("{{query}}", text("{{label}}"), text("choices"))
            },
            other => {
                return Err(TrainError::Input(format!(
                    "no multiple-choice preset {other:?} (there are {}, mmlu and mmlu_<subject>)",
                    CHOICES_TASKS.join(", ")
                )))
            }
        })
    }
}

/// HellaSwag's `process_docs` (lm-eval's `hellaswag/utils.py`): the `query` is the activity
/// label, `": "`, `ctx_a`, a space and `ctx_b` capitalized; it and each of the `endings`
/// (the `choices`) are stripped, `" [title]"` becomes `". "`, bracketed WikiHow markers
/// (`[header]`, `[step]`) are removed, and each double space becomes one; `gold` is the
/// `label` as an integer.
pub fn hellaswag_process_docs(
    doc: &serde_json::Value,
) -> std::result::Result<serde_json::Value, String> {
    let text = |key: &str| {
        doc.get(key)
            .and_then(|v| v.as_str())
            .ok_or_else(|| format!("no text {key:?} (HellaSwag's rows have it)"))
    };
    let ctx_b = crate::doc_template::python_capitalize(text("ctx_b")?);
    let query = preprocess_hellaswag(&format!(
        "{}: {} {ctx_b}",
        text("activity_label")?,
        text("ctx_a")?
    ));
    let endings = doc
        .get("endings")
        .and_then(|v| v.as_array())
        .ok_or("no list \"endings\" (HellaSwag's rows have it)")?
        .iter()
        .map(|e| {
            e.as_str()
                .map(preprocess_hellaswag)
                .ok_or("an ending that is not text")
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let label = text("label")?;
    let gold: i64 = label
        .trim()
        .parse()
        .map_err(|_| format!("label {label:?} is not an integer"))?;
    let mut out = doc.as_object().cloned().unwrap_or_default();
    out.insert("query".into(), serde_json::Value::String(query));
    out.insert("choices".into(), serde_json::json!(endings));
    out.insert("gold".into(), serde_json::json!(gold));
    Ok(serde_json::Value::Object(out))
}

/// HellaSwag's `preprocess`: strip, `" [title]"` to `". "`, `re.sub("\\[.*?\\]", "", …)`,
/// `"  "` to `" "`.
fn preprocess_hellaswag(text: &str) -> String {
    let text = text.trim().replace(" [title]", ". ");
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    // `.` does not cross a newline: an unclosed bracket on its line stays.
    while let Some(open) = rest.find('[') {
        let after = &rest[open + 1..];
        let line_end = after.find('\n').unwrap_or(after.len());
        match after[..line_end].find(']') {
            Some(close) => {
                out.push_str(&rest[..open]);
                rest = &after[close + 1..];
            }
            None => {
                out.push_str(&rest[..=open]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out.replace("  ", " ")
}

/// How lm-eval picks a question's few-shot examples (a task's `fewshot_config.sampler`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sampler {
    /// `default`: CPython's `random.Random(seed).sample` of the pool ([`PyRandom`]), one
    /// generator for the run, drawn question after question in file order (lm-eval's
    /// `fewshot_random_seed`, 1234 unless set).
    Random {
        /// The generator's seed.
        seed: u64,
    },
    /// `first_n`: the pool's first questions in order, the same for every question (MMLU's).
    FirstN,
}

/// A document a few-shot prompt can show as a solved example: its context and the answer
/// lm-eval writes after it (a question's gold choice, a generation task's first target).
pub trait Example {
    /// The text before the answer when it is an example (lm-eval's `doc_to_text`; a multiple
    /// input question's gold context).
    fn context(&self) -> &str;
    /// The text of its own turn when it is the question (its context, or nothing for a
    /// multiple input question, whose contexts follow the prompt one by one).
    fn prompt(&self) -> &str {
        self.context()
    }
    /// The line it was read from, parsed: lm-eval compares documents whole to keep one out
    /// of its own examples.
    fn json(&self) -> &serde_json::Value;
    /// The answer an example shows, or why it has none.
    fn shown_answer(&self) -> std::result::Result<&str, String>;
}

impl Example for Doc {
    fn context(&self) -> &str {
        let q = &self.question;
        match (&q.continuation, &q.gold) {
            (Some(_), Gold::One(g)) => &q.choices[*g],
            _ => &q.context,
        }
    }

    fn prompt(&self) -> &str {
        &self.question.context
    }

    fn json(&self) -> &serde_json::Value {
        &self.json
    }

    fn shown_answer(&self) -> std::result::Result<&str, String> {
        if let Some(c) = &self.question.continuation {
            return Ok(c);
        }
        match self.question.gold {
            Gold::One(g) => Ok(&self.question.choices[g]),
            Gold::Any(_) => Err(
                "has several gold answers: which one an example shows is not \
                                 defined (lm-eval fails on it too)"
                    .into(),
            ),
        }
    }
}

/// Solved questions before each question's context, as lm-eval writes a `num_fewshot` prompt:
/// the description, then for each example its context, the target delimiter, its gold
/// choice and the few-shot delimiter, then the question's context.
#[derive(Clone, Debug)]
pub struct Fewshot<E = Doc> {
    /// Examples per question (`num_fewshot`).
    pub shots: usize,
    /// The questions examples come from (lm-eval's `fewshot_split`); `None`: the evaluated
    /// questions themselves, where lm-eval (a `fewshot_split` equal to the test split) leaves
    /// each question out of its own examples (every question equal to it, by its JSON).
    pub pool: Option<Vec<E>>,
    /// How they are picked.
    pub sampler: Sampler,
    /// Text before the examples (a task's `description`).
    pub description: String,
    /// A system prompt before the description (lm-eval's `--system_instruction`), joined to
    /// it by the few-shot delimiter.
    pub system_instruction: Option<String>,
    /// Text after each example (`fewshot_delimiter`, `"\n\n"` in lm-eval).
    pub delimiter: String,
    /// Text the answer starts with (lm-eval's `gen_prefix`, such as `"The best answer is"`):
    /// the start of the assistant's turn after the question, which the model continues, and
    /// before each example's answer. `None` (or empty) for none.
    pub gen_prefix: Option<String>,
}

/// One message of a prompt as lm-eval builds it (its `Message`): as plain text, the content
/// and then the delimiter; for a chat template, the role and the content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Turn {
    /// `system`, `user` or `assistant`.
    pub role: &'static str,
    /// The text.
    pub content: String,
    /// What follows it in plain text (the target delimiter after a question, the few-shot
    /// delimiter after an answer).
    pub delimiter: String,
}

/// How a prompt's turns become the context text (lm-eval's `apply_chat_template` and
/// `fewshot_as_multiturn`).
#[derive(Clone, Copy, Debug)]
pub enum PromptFormat<'a> {
    /// Each turn's content and delimiter, one after another.
    Plain,
    /// Rendered by the tokenizer's chat template with its generation prompt: every example a
    /// user and an assistant message (`multiturn`), or all of them in one user message
    /// written as plain text (the system message kept apart). A template that fails on the
    /// system message is rendered again without it, as lm-eval's `HFLM` does.
    Chat {
        /// The template.
        template: &'a crate::chat_template::ChatTemplate,
        /// Examples as turns of their own.
        multiturn: bool,
        /// The template's further variables (lm-eval's `chat_template_args`, such as
        /// `enable_thinking`).
        extra: &'a [(String, crate::chat_template::ChatValue)],
    },
}

/// Whether `c` is whitespace to Python's `str.isspace`.
fn python_space(c: Option<char>) -> bool {
    c.is_some_and(|c| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
}

/// Whether joining `prefix` and `suffix` takes a delimiter: neither has whitespace at the
/// join and `prefix` is not empty (lm-eval's `requires_delimiter`).
fn requires_delimiter(prefix: &str, suffix: &str) -> bool {
    !(prefix.is_empty()
        || python_space(prefix.chars().last())
        || python_space(suffix.chars().next()))
}

/// Whether `text` ends with whitespace (lm-eval's `ends_with_whitespace`): after a
/// `gen_prefix` that does not, a chat-rendered choice takes the target delimiter.
pub fn ends_with_whitespace(text: &str) -> bool {
    python_space(text.chars().last())
}

/// `prefix` and `suffix` joined by `delimiter` unless either has whitespace at the join
/// (lm-eval's `maybe_delimit`, with Python's `isspace`).
fn maybe_delimit(prefix: &str, suffix: &str, delimiter: &str) -> String {
    if prefix.is_empty() {
        return suffix.to_owned();
    }
    if suffix.is_empty() {
        return prefix.to_owned();
    }
    if requires_delimiter(prefix, suffix) {
        format!("{prefix}{delimiter}{suffix}")
    } else {
        format!("{prefix}{suffix}")
    }
}

/// Each question's prompt as lm-eval's `fewshot_context` builds it, in question order: a
/// system message (`--system-instruction` and the description, joined by the few-shot
/// delimiter) if there is one, each example as the user's context (then `target_delimiter`)
/// and the assistant's gold choice (then the few-shot delimiter), then the question's
/// context. An example must have one gold answer (lm-eval fails on one with several), and the
/// pool must hold enough questions. With a `gen_prefix` (lm-eval's `build_qa_turn`), each
/// example's answer is the prefix and the answer joined by a space where neither has one, the
/// question's context takes the target delimiter only where it and the prefix have no
/// whitespace between them, and the prompt ends with an assistant turn of the prefix alone.
pub fn fewshot_turns<E: Example>(
    questions: &[E],
    fewshot: &Fewshot<E>,
    target_delimiter: &str,
) -> Result<Vec<Vec<Turn>>> {
    let pool: &[E] = fewshot.pool.as_deref().unwrap_or(questions);
    let leave_out = fewshot.pool.is_none();
    let shots = fewshot.shots;
    let mut rng = match fewshot.sampler {
        Sampler::Random { seed } => Some(PyRandom::new(seed)),
        Sampler::FirstN => None,
    };
    let too_few = |available: usize| {
        TrainError::Input(format!(
            "{shots} few-shot examples from a pool of {available} question{}{}",
            if available == 1 { "" } else { "s" },
            if leave_out {
                " (the question itself left out)"
            } else {
                ""
            }
        ))
    };
    let answer = |i: usize| -> Result<&str> {
        pool[i].shown_answer().map_err(|why| {
            TrainError::Input(format!("question {} of the few-shot pool {why}", i + 1))
        })
    };
    let system = maybe_delimit(
        fewshot.system_instruction.as_deref().unwrap_or(""),
        &fewshot.description,
        &fewshot.delimiter,
    );
    let turn = |role, content: &str, delimiter: &str| Turn {
        role,
        content: content.to_owned(),
        delimiter: delimiter.to_owned(),
    };
    questions
        .iter()
        .map(|doc| {
            let others = |i: &usize| !leave_out || pool[*i].json() != doc.json();
            let chosen: Vec<usize> = match (&mut rng, shots) {
                (_, 0) => Vec::new(),
                (None, _) => {
                    let first: Vec<usize> = (0..pool.len()).filter(others).take(shots).collect();
                    if first.len() < shots {
                        return Err(too_few(first.len()));
                    }
                    first
                }
                (Some(rng), _) if !leave_out => rng
                    .sample(pool.len(), shots)
                    .ok_or_else(|| too_few(pool.len()))?,
                (Some(rng), _) => {
                    // One more than asked, then the question itself taken out.
                    let drawn = rng
                        .sample(pool.len(), shots.saturating_add(1))
                        .ok_or_else(|| too_few(pool.len().saturating_sub(1)))?;
                    let kept: Vec<usize> = drawn.into_iter().filter(others).take(shots).collect();
                    if kept.len() == shots {
                        kept
                    } else {
                        // Copies of the question were drawn: again from the pool without any.
                        let rest: Vec<usize> = (0..pool.len()).filter(others).collect();
                        rng.sample(rest.len(), shots)
                            .ok_or_else(|| too_few(rest.len()))?
                            .into_iter()
                            .map(|i| rest[i])
                            .collect()
                    }
                }
            };
            let mut turns = Vec::with_capacity(2 * chosen.len() + 2);
            if !system.is_empty() {
                turns.push(turn("system", &system, ""));
            }
            let prefix = fewshot.gen_prefix.as_deref().unwrap_or("");
            // After a question: the target delimiter before an answer, or before the prefix
            // where the two would otherwise touch.
            let after = |question: &str| {
                if prefix.is_empty() || requires_delimiter(question, prefix) {
                    target_delimiter
                } else {
                    ""
                }
            };
            for i in chosen {
                turns.push(turn("user", pool[i].context(), after(pool[i].context())));
                let shown = maybe_delimit(prefix, answer(i)?, " ");
                turns.push(turn("assistant", &shown, &fewshot.delimiter));
            }
            if prefix.is_empty() {
                turns.push(turn("user", doc.prompt(), ""));
            } else {
                turns.push(turn("user", doc.prompt(), after(doc.prompt())));
                turns.push(turn("assistant", prefix, ""));
            }
            Ok(turns)
        })
        .collect()
}

/// A prompt's context text in `format` (lm-eval's, character for character). A prompt that
/// ends with an assistant turn (a `gen_prefix`) is rendered continuing that turn
/// (`continue_final_message`) instead of opening a new one.
pub fn render_prompt(turns: &[Turn], format: PromptFormat<'_>) -> Result<String> {
    let plain = |turns: &[Turn]| -> String {
        turns
            .iter()
            .flat_map(|t| [t.content.as_str(), t.delimiter.as_str()])
            .collect()
    };
    let PromptFormat::Chat {
        template,
        multiturn,
        extra,
    } = format
    else {
        return Ok(plain(turns));
    };
    let message = |role: &str, content: &str| {
        crate::chat_template::ChatValue::from(serde_json::json!({"role": role, "content": content}))
    };
    let (system, rest) = match turns.split_first() {
        Some((first, rest)) if first.role == "system" => (Some(first), rest),
        _ => (None, turns),
    };
    let mut messages: Vec<crate::chat_template::ChatValue> = system
        .map(|s| message(s.role, &s.content))
        .into_iter()
        .collect();
    let (asked, continued) = match rest.split_last() {
        Some((last, before)) if last.role == "assistant" => (before, Some(last)),
        _ => (rest, None),
    };
    if multiturn {
        messages.extend(rest.iter().map(|t| message(t.role, &t.content)));
    } else {
        // One user message: the turns as plain text, the last one's delimiter left off; then
        // the prefix's assistant turn, if any.
        let mut text = plain(asked);
        if let Some(last) = asked.last() {
            text.truncate(text.len() - last.delimiter.len());
        }
        messages.push(message("user", &text));
        messages.extend(continued.map(|t| message(t.role, &t.content)));
    }
    let render = |messages: &[crate::chat_template::ChatValue]| {
        template
            .render_request(&crate::chat_template::ChatRequest {
                messages,
                add_generation_prompt: continued.is_none(),
                continue_final_message: continued.map(|_| "content"),
                extra,
                ..Default::default()
            })
            .map(|r| r.text)
    };
    match render(&messages) {
        Ok(text) => Ok(text),
        Err(e) if system.is_none() => Err(e),
        // lm-eval's HFLM renders again without the system message when the template fails.
        Err(_) => render(&messages[1..]),
    }
}

/// Each question's context with `fewshot`'s examples before it as plain text, in question
/// order: [`fewshot_turns`] then [`render_prompt`]'s plain text.
pub fn fewshot_contexts(
    questions: &[Doc],
    fewshot: &Fewshot,
    target_delimiter: &str,
) -> Result<Vec<String>> {
    fewshot_turns(questions, fewshot, target_delimiter)?
        .iter()
        .map(|turns| render_prompt(turns, PromptFormat::Plain))
        .collect()
}

/// Each non-blank line of the JSONL file at `path` (at most `limit` bytes) through `parse`;
/// an error names the file and the line, and a file without any is one too (`what` it
/// lacks). A Parquet or Arrow file (a Hugging Face dataset's split as the Hub serves it or as
/// `datasets` saved it, known by its magic bytes) is read too: each row becomes the JSON line
/// `datasets`' `to_json` would write for it ([`table_lines`]).
pub(crate) fn read_jsonl<T>(
    path: &Path,
    limit: u64,
    what: &str,
    parse: impl Fn(&str) -> std::result::Result<T, String>,
) -> Result<Vec<T>> {
    read_jsonl_mapped(path, limit, what, None, parse)
}

/// A document's line rewritten before it is parsed (a task's [`DocTemplates`]).
pub(crate) type LineMap<'a> =
    &'a dyn Fn(&serde_json::Value) -> std::result::Result<serde_json::Value, String>;

/// [`read_jsonl`], each line first rewritten by `map` when given.
pub(crate) fn read_jsonl_mapped<T>(
    path: &Path,
    limit: u64,
    what: &str,
    map: Option<LineMap<'_>>,
    parse: impl Fn(&str) -> std::result::Result<T, String>,
) -> Result<Vec<T>> {
    let bad = |why: String| TrainError::Input(format!("{}: {why}", path.display()));
    let bytes = crate::bounded::read_file(path, limit).map_err(bad)?;
    let one = |line: &str| -> std::result::Result<T, String> {
        match map {
            None => parse(line),
            Some(map) => {
                let doc: serde_json::Value =
                    serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
                parse(&map(&doc)?.to_string())
            }
        }
    };
    let items = if is_table(&bytes) {
        table_lines(&bytes)
            .map_err(|e| bad(e.to_string()))?
            .iter()
            .enumerate()
            .map(|(i, l)| one(l).map_err(|why| bad(format!("row {}: {why}", i + 1))))
            .collect::<Result<Vec<_>>>()?
    } else {
        let text = std::str::from_utf8(&bytes).map_err(|e| bad(e.to_string()))?;
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| one(l).map_err(|why| bad(format!("line {}: {why}", i + 1))))
            .collect::<Result<Vec<_>>>()?
    };
    if items.is_empty() {
        return Err(bad(format!("no {what}")));
    }
    Ok(items)
}

/// Whether `bytes` are a Parquet file (`PAR1` at both ends) or Arrow IPC (`ARROW1`, a
/// stream's `ff ff ff ff`): JSON text cannot start so.
pub(crate) fn is_table(bytes: &[u8]) -> bool {
    headroom_parquet::TableFormat::of(bytes).is_some()
}

/// The rows of the Parquet or Arrow file `bytes`, each as a JSON object's text: what the
/// JSONL readers parse. A row's fields are the file's top-level columns; lists are arrays,
/// structs objects, text strings, NaN null ([`headroom_parquet`]).
pub(crate) fn table_lines(
    bytes: &[u8],
) -> std::result::Result<Vec<String>, headroom_parquet::TableError> {
    let file = headroom_parquet::TableFile::parse(bytes)?;
    Ok(row_lines(
        file.rows(&headroom_parquet::ReadOptions::default())?,
    ))
}

/// Parquet or Arrow rows as JSON lines.
pub(crate) fn row_lines(rows: Vec<headroom_parquet::Row>) -> Vec<String> {
    rows.into_iter()
        .map(|row| serde_json::Value::Object(row).to_string())
        .collect()
}

/// A request's tokens: the context's and the continuation's, as lm-eval splits them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// The context (at least one token).
    pub context: Vec<u32>,
    /// The continuation scored (at least one token).
    pub continuation: Vec<u32>,
}

/// The token lm-eval conditions an empty context on (`prefix_token_id`): the tokenizer's
/// `bos_token`, else its `eos_token`; with its text, which, starting a text, keeps the
/// tokenizer from adding its special tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixToken {
    /// Its id.
    pub id: u32,
    /// Its text.
    pub text: String,
}

impl PrefixToken {
    /// `tok`'s, if it has a beginning or end of sequence token.
    pub fn of(tok: &Tokenizer) -> Result<Option<PrefixToken>> {
        let Some(id) = tok.bos_token()?.or(tok.eos_token()?) else {
            return Ok(None);
        };
        Ok(Some(PrefixToken {
            id,
            text: tok.decode(&[id])?,
        }))
    }
}

/// The tokens of the request `(context, continuation)` as lm-eval's `HFLM` makes them (see
/// the module docs).
pub fn request(
    tok: &Tokenizer,
    prefix: Option<&PrefixToken>,
    context: &str,
    continuation: &str,
) -> Result<Request> {
    let bad = |why: &str| {
        TrainError::Input(format!(
            "the continuation {continuation:?} of {context:?} {why}"
        ))
    };
    if context.is_empty() {
        let prefix = prefix.ok_or_else(|| {
            bad("has an empty context, which takes the tokenizer's bos or eos token, and it has neither")
        })?;
        let ids = tok.encode(continuation)?;
        let (context, continuation) = match ids.first() {
            Some(&first) if first == prefix.id => (vec![first], ids[1..].to_vec()),
            _ => (vec![prefix.id], ids),
        };
        if continuation.is_empty() {
            return Err(bad("has no tokens"));
        }
        return Ok(Request {
            context,
            continuation,
        });
    }
    let kept = context.trim_end_matches(crate::chat_template::is_python_space);
    let (context, continuation) = if kept.len() < context.len() {
        (kept, format!("{}{continuation}", &context[kept.len()..]))
    } else {
        (context, continuation.to_owned())
    };
    // lm-eval's `tok_encode`: the tokenizer's special tokens unless the text starts with the
    // prefix token's text.
    let encode = |text: &str| match prefix {
        Some(p) if text.starts_with(p.text.as_str()) => tok.encode(text),
        _ => tok.encode_sequence(text),
    };
    let whole = encode(&format!("{context}{continuation}"))?;
    let context_ids = encode(context)?;
    let continuation_ids = whole.get(context_ids.len()..).unwrap_or_default().to_vec();
    if context_ids.is_empty() {
        return Err(bad("has a context of no tokens"));
    }
    if continuation_ids.is_empty() {
        return Err(bad("has no tokens past the context's"));
    }
    Ok(Request {
        context: context_ids,
        continuation: continuation_ids,
    })
}

/// A request's score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scored {
    /// The continuation's log-likelihood (nats, the sum over its tokens).
    pub loglikelihood: f64,
    /// Whether every continuation token is its position's most likely one.
    pub is_greedy: bool,
}

/// The scores of `requests` under `model`, in order, each request's input its last
/// `context + 1` tokens less the last. Requests of one context that fit the model's context
/// whole (a question's choices, uncut) share it: its keys and values are computed once, and
/// the continuations run after copies of them; the others run in batches padded on the right.
pub fn score<B: ModelOps>(model: &Model<B>, requests: &[Request]) -> Result<Vec<Scored>> {
    Ok(score_reusing(model, requests, &mut PromptCache::new())?.0)
}

/// [`score`], a shared context run after the keys and values of the last one `kept` holds,
/// cut back to the prefix the two share (a few-shot prompt's description and examples, the
/// same for every question of MMLU's sampler), and kept in turn. Returns the scores and, when
/// the requests shared a context run this way, how many of its positions were reused. A reused position's keys and values come from the
/// step that ran it for an earlier question, so log-likelihoods differ from a fresh run's in
/// float rounding only.
pub fn score_reusing<B: ModelOps>(
    model: &Model<B>,
    requests: &[Request],
    kept: &mut PromptCache<B::Tensor>,
) -> Result<(Vec<Scored>, Option<usize>)> {
    let max = model.cfg.max_seq;
    let vocab = model.cfg.vocab;
    for r in requests {
        if r.continuation.len() > max {
            return Err(TrainError::Input(format!(
                "a continuation of {} tokens is longer than the model's context of {max}",
                r.continuation.len()
            )));
        }
        let mut ids = r.context.iter().chain(&r.continuation);
        if let Some(&id) = ids.find(|&&i| i as usize >= vocab) {
            return Err(TrainError::Input(format!(
                "token {id} is outside the model's vocabulary of {vocab}"
            )));
        }
    }
    let Some(first) = requests.first() else {
        return Ok((Vec::new(), None));
    };
    let shared = requests
        .iter()
        .all(|r| r.context == first.context && r.context.len() + r.continuation.len() <= max + 1);
    if shared {
        let (scores, reused) = score_after_shared_context(model, &first.context, requests, kept)?;
        Ok((scores, Some(reused)))
    } else {
        Ok((score_padded(model, requests)?, None))
    }
}

/// The most choices continued in one batch after a shared context (each holds a copy of the
/// context's keys and values).
const MAX_SHARED_BATCH: usize = 8;

/// [`score`] of requests of one context that fits with each continuation: the context once
/// (its last row predicts every continuation's first token; the prefix it shares with `kept`'s
/// not run again), then the continuations' other tokens in batches, padded on the right,
/// after copies of its keys and values.
fn score_after_shared_context<B: ModelOps>(
    model: &Model<B>,
    context: &[u32],
    requests: &[Request],
    kept: &mut PromptCache<B::Tensor>,
) -> Result<(Vec<Scored>, usize)> {
    let vocab = model.cfg.vocab;
    let (mut cache, reused) = kept.take_prefix(model, context)?;
    let after_context = model.decode(&mut cache, &context[reused..])?;
    let mut kept_tokens = context.to_vec();
    let mut out = Vec::with_capacity(requests.len());
    for group in requests.chunks(MAX_SHARED_BATCH) {
        // Each continuation's tokens but the last are inputs.
        let t = group
            .iter()
            .map(|r| r.continuation.len() - 1)
            .max()
            .unwrap_or(0);
        let logits = if t == 0 {
            Vec::new()
        } else {
            let mut tokens = vec![0u32; group.len() * t];
            let mut rows = Vec::new();
            for (i, r) in group.iter().enumerate() {
                let inputs = &r.continuation[..r.continuation.len() - 1];
                tokens[i * t..i * t + inputs.len()].copy_from_slice(inputs);
                rows.extend((0..inputs.len()).map(|p| i * t + p));
            }
            if requests.len() == 1 {
                // One continuation: it runs in the context's own cache, no copy made, and the
                // cache keeps it (a single-target document, whose next context rarely shares
                // it, loses nothing).
                let logits = model.decode_at(&mut cache, &tokens, &rows)?;
                kept_tokens.extend_from_slice(&tokens);
                logits
            } else {
                let mut copies = model.repeat_cache(&cache, group.len())?;
                model.decode_at(&mut copies, &tokens, &rows)?
            }
        };
        let mut rows = logits.chunks_exact(vocab);
        for r in group {
            let rest = rows.by_ref().take(r.continuation.len() - 1);
            out.push(scored(
                std::iter::once(&after_context[..]).chain(rest),
                &r.continuation,
            ));
        }
    }
    kept.keep(cache, kept_tokens);
    Ok((out, reused))
}

/// [`score`] in batches of requests padded on the right (a causal model's positions never
/// see the padding after them).
fn score_padded<B: ModelOps>(model: &Model<B>, requests: &[Request]) -> Result<Vec<Scored>> {
    let max = model.cfg.max_seq;
    let vocab = model.cfg.vocab;
    let inputs: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| {
            let all: Vec<u32> = r.context.iter().chain(&r.continuation).copied().collect();
            let window = &all[all.len().saturating_sub(max + 1)..];
            window[..window.len() - 1].to_vec()
        })
        .collect();
    let mut out = Vec::with_capacity(requests.len());
    let mut start = 0;
    while start < requests.len() {
        // As many requests as fit the batch's tokens, at least one.
        let mut end = start + 1;
        let mut t = inputs[start].len();
        while end < requests.len() {
            let t_next = t.max(inputs[end].len());
            if t_next * (end + 1 - start) > MAX_BATCH_TOKENS {
                break;
            }
            t = t_next;
            end += 1;
        }
        let b = end - start;
        let mut tokens = vec![0u32; b * t];
        let mut rows = Vec::new();
        for (i, input) in inputs[start..end].iter().enumerate() {
            tokens[i * t..i * t + input.len()].copy_from_slice(input);
            // The positions whose next token is a continuation token.
            let n = requests[start + i].continuation.len();
            rows.extend((input.len() - n..input.len()).map(|p| i * t + p));
        }
        let logits = model.logits_at(&tokens, Geometry::new(b, t), &rows)?;
        let mut rows = logits.chunks_exact(vocab);
        for r in &requests[start..end] {
            let n = r.continuation.len();
            out.push(scored(rows.by_ref().take(n), &r.continuation));
        }
        start = end;
    }
    Ok(out)
}

/// The score of `continuation` from the logits rows that predict each of its tokens.
fn scored<'a>(rows: impl Iterator<Item = &'a [f32]>, continuation: &[u32]) -> Scored {
    let mut loglikelihood = 0.0f64;
    let mut is_greedy = true;
    for (row, &target) in rows.zip(continuation) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
        loglikelihood += f64::from(row[target as usize] - max) - sum.ln();
        // numpy's and torch's argmax: the first of equal maxima.
        let argmax = row.iter().position(|&x| x == max).unwrap_or(0);
        is_greedy &= argmax == target as usize;
    }
    Scored {
        loglikelihood,
        is_greedy,
    }
}

/// What a question's scores make of it.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// Each choice's score.
    pub scored: Vec<Scored>,
    /// The choice of the highest log-likelihood.
    pub pred: usize,
    /// `pred` is right.
    pub acc: bool,
    /// The choice of the highest log-likelihood per character is right.
    pub acc_norm: bool,
    /// The choice of the highest log-likelihood per UTF-8 byte is right.
    pub acc_bytes: bool,
    /// A right choice is the greedy continuation.
    pub exact_match: bool,
}

/// The first index of the largest of `xs` (numpy's `argmax`; a NaN counts as the largest).
fn argmax(xs: impl Iterator<Item = f64>) -> usize {
    let mut best: Option<(usize, f64)> = None;
    for (i, x) in xs.enumerate() {
        match best {
            Some((_, b)) if b.is_nan() || !(x > b || x.is_nan()) => {}
            _ => best = Some((i, x)),
        }
    }
    best.map_or(0, |(i, _)| i)
}

impl Outcome {
    /// The outcome of `question` whose choices scored `scored` (one each, in order).
    pub fn of(question: &Question, scored: Vec<Scored>) -> Outcome {
        let lls = || scored.iter().map(|s| s.loglikelihood);
        let pred = argmax(lls());
        let by = |len: &dyn Fn(&str) -> usize| {
            argmax(
                lls()
                    .zip(&question.choices)
                    .map(|(ll, c)| ll / len(c) as f64),
            )
        };
        let pred_norm = by(&|c| c.chars().count());
        let pred_bytes = by(&str::len);
        let exact_match = question
            .gold
            .indices()
            .iter()
            .any(|&g| scored.get(g).is_some_and(|s| s.is_greedy));
        Outcome {
            pred,
            acc: question.gold.contains(pred),
            acc_norm: question.gold.contains(pred_norm),
            acc_bytes: question.gold.contains(pred_bytes),
            exact_match,
            scored,
        }
    }
}

/// A metric's mean over the questions and its standard error (`None` for one question).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Metric {
    /// The mean.
    pub mean: f64,
    /// The sample standard deviation over √n.
    pub stderr: Option<f64>,
}

impl Metric {
    /// Of values that are each 0 or 1.
    pub fn of(values: &[bool]) -> Metric {
        let n = values.len() as f64;
        let xs = values.iter().map(|&v| f64::from(u8::from(v)));
        let mean = xs.clone().sum::<f64>() / n;
        let stderr = (values.len() > 1).then(|| {
            let var = xs.map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
            var.sqrt() / n.sqrt()
        });
        Metric { mean, stderr }
    }
}

/// A run's metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct ChoicesReport {
    /// Questions.
    pub questions: usize,
    /// Choices scored.
    pub requests: usize,
    /// Continuation tokens scored.
    pub tokens: u64,
    /// Context tokens of the questions scored after a shared context.
    pub context_tokens: u64,
    /// Of those, the ones whose keys and values the question before had computed.
    pub reused_context_tokens: u64,
    /// Right by log-likelihood.
    pub acc: Metric,
    /// Right by log-likelihood per character.
    pub acc_norm: Metric,
    /// Right by log-likelihood per byte.
    pub acc_bytes: Metric,
    /// A right choice is the greedy continuation.
    pub exact_match: Metric,
}

/// Score every question (each choice as `delimiter + choice`, lm-eval's `target_delimiter`,
/// `" "` by default there), calling `each` with each question's index and outcome as it is
/// done.
pub fn evaluate<B: ModelOps>(
    model: &Model<B>,
    tok: &Tokenizer,
    questions: &[Question],
    delimiter: &str,
    mut each: impl FnMut(usize, &Outcome) -> Result<()>,
) -> Result<ChoicesReport> {
    if questions.is_empty() {
        return Err(TrainError::Input("no questions".into()));
    }
    let prefix = PrefixToken::of(tok)?;
    let mut outcomes = Vec::with_capacity(questions.len());
    let (mut requests, mut tokens) = (0, 0u64);
    let (mut kept, mut context_tokens, mut reused_context_tokens) = (PromptCache::new(), 0, 0);
    for (i, q) in questions.iter().enumerate() {
        let reqs = (0..q.choices.len())
            .map(|c| {
                request(
                    tok,
                    prefix.as_ref(),
                    &q.context_for(c),
                    &q.continuation(c, delimiter),
                )
            })
            .collect::<Result<Vec<_>>>()
            .map_err(|e| TrainError::Input(format!("question {}: {e}", i + 1)))?;
        requests += reqs.len();
        tokens += reqs
            .iter()
            .map(|r| r.continuation.len() as u64)
            .sum::<u64>();
        // One shared context, or with multiple input one context per choice, each run after
        // the keys and values of the last (the prompt and the sentence up to the choice
        // repeat).
        let groups: Vec<&[Request]> = if q.continuation.is_some() {
            reqs.chunks(1).collect()
        } else {
            vec![&reqs[..]]
        };
        let mut scores = Vec::with_capacity(reqs.len());
        for group in groups {
            let (scored, reused) = score_reusing(model, group, &mut kept)?;
            if let Some(reused) = reused {
                context_tokens += group[0].context.len() as u64;
                reused_context_tokens += reused as u64;
            }
            scores.extend(scored);
        }
        let outcome = Outcome::of(q, scores);
        each(i, &outcome)?;
        outcomes.push((
            outcome.acc,
            outcome.acc_norm,
            outcome.acc_bytes,
            outcome.exact_match,
        ));
    }
    let metric = |f: fn(&(bool, bool, bool, bool)) -> bool| {
        Metric::of(&outcomes.iter().map(f).collect::<Vec<_>>())
    };
    Ok(ChoicesReport {
        questions: questions.len(),
        requests,
        tokens,
        context_tokens,
        reused_context_tokens,
        acc: metric(|o| o.0),
        acc_norm: metric(|o| o.1),
        acc_bytes: metric(|o| o.2),
        exact_match: metric(|o| o.3),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A question `context` with answer `answer`, as a pool line.
    fn doc(context: &str, answer: &str) -> Doc {
        let json = serde_json::json!({"context": context, "choices": ["no", answer], "gold": 1});
        Doc {
            question: Question::parse(&json.to_string()).unwrap(),
            json,
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Whatever the pool (copies included) and sampler: each context is the description,
        /// `shots` examples of the pool (distinct ones where it has no copies), each its context, the delimiter, its gold answer
        /// and few-shot delimiter, then the question; a question drawing from its own file
        /// never sees itself (nor a copy); `first_n` from another file gives every question
        /// the same examples; and the same seed gives the same contexts.
        #[test]
        fn few_shot_contexts_hold_distinct_other_examples(
            labels in proptest::collection::vec(0u8..6, 2..12),
            shots_frac in 0.0f64..1.0,
            seed in 0u64..1000,
            random in proptest::bool::ANY,
            own_file in proptest::bool::ANY,
        ) {
            let questions: Vec<Doc> =
                labels.iter().map(|l| doc(&format!("q{l}"), &format!("a{l}"))).collect();
            let pool: Vec<Doc> = (0..5).map(|i| doc(&format!("p{i}"), &format!("b{i}"))).collect();
            let available = if own_file {
                labels.iter().map(|l| labels.iter().filter(|m| *m != l).count()).min().unwrap()
            } else {
                pool.len()
            };
            let shots = (shots_frac * (available + 1) as f64) as usize;
            let fewshot = Fewshot {
                shots,
                pool: (!own_file).then(|| pool.clone()),
                sampler: if random { Sampler::Random { seed } } else { Sampler::FirstN },
                description: "D|".into(),
                system_instruction: None,
                delimiter: "|".into(),
                gen_prefix: None,
            };
            let contexts = match fewshot_contexts(&questions, &fewshot, "=") {
                Ok(c) => c,
                Err(e) => {
                    // Only where some question has too few others (first_n counts per
                    // question; random draws shots + 1 from the whole file).
                    proptest::prop_assert!(shots > available || (random && own_file && shots + 1 > labels.len()), "{e}");
                    return Ok(());
                }
            };
            proptest::prop_assert_eq!(contexts.len(), questions.len());
            for (c, q) in contexts.iter().zip(&questions) {
                let body = c.strip_prefix("D|").unwrap();
                let examples = body.strip_suffix(q.question.context.as_str()).unwrap();
                let shown: Vec<&str> = examples.split_terminator('|').collect();
                proptest::prop_assert_eq!(shown.len(), shots);
                // Distinct questions of the pool (the pool's copies may each be drawn).
                let mut distinct = shown.clone();
                distinct.sort_unstable();
                distinct.dedup();
                let copies = own_file && {
                    let mut l = labels.clone();
                    l.sort_unstable();
                    l.windows(2).any(|w| w[0] == w[1])
                };
                proptest::prop_assert!(distinct.len() == shots || copies);
                for e in shown {
                    let (context, answer) = e.split_once('=').unwrap();
                    proptest::prop_assert_eq!(&answer[1..], &context[1..]);
                    proptest::prop_assert!(context != q.question.context);
                }
            }
            if !random && !own_file {
                let examples = |c: &String| c[..c.rfind('|').unwrap()].to_owned();
                proptest::prop_assert!(contexts.iter().all(|c| examples(c) == examples(&contexts[0])));
            }
            proptest::prop_assert_eq!(fewshot_contexts(&questions, &fewshot, "=").unwrap(), contexts);
        }
    }

    #[test]
    fn maybe_delimit_joins_as_lm_eval_does() {
        assert_eq!(maybe_delimit("sys", "desc", "\n\n"), "sys\n\ndesc");
        assert_eq!(maybe_delimit("sys ", "desc", "\n\n"), "sys desc");
        assert_eq!(maybe_delimit("sys", "\tdesc", "\n\n"), "sys\tdesc");
        // Python's isspace: the file, group, record and unit separators too.
        assert_eq!(maybe_delimit("sys\u{1f}", "desc", "|"), "sys\u{1f}desc");
        assert_eq!(maybe_delimit("", "desc", "|"), "desc");
        assert_eq!(maybe_delimit("sys", "", "|"), "sys");
        // A system instruction alone is written with no delimiter after it in plain text,
        // as lm-eval writes its system message.
        let questions = vec![doc("q", "a")];
        let fewshot = Fewshot {
            shots: 0,
            pool: None,
            sampler: Sampler::FirstN,
            description: String::new(),
            system_instruction: Some("Be brief.".into()),
            delimiter: "\n\n".into(),
            gen_prefix: None,
        };
        assert_eq!(
            fewshot_contexts(&questions, &fewshot, " ").unwrap(),
            ["Be brief.q"]
        );
    }

    #[test]
    fn questions_parse_or_say_what_is_wrong() {
        let q =
            Question::parse(r#"{"context": "c", "choices": ["a", "b"], "gold": [1, 0]}"#).unwrap();
        assert_eq!(q.gold, Gold::Any(vec![1, 0]));
        for (line, why) in [
            ("[1]", "not a JSON object"),
            ("{", "not JSON"),
            (r#"{"choices": ["a"], "gold": 0}"#, "no \"context\""),
            (
                r#"{"context": 1, "choices": ["a"], "gold": 0}"#,
                "\"context\" is not text",
            ),
            (
                r#"{"context": "", "choices": [], "gold": 0}"#,
                "non-empty list",
            ),
            (
                r#"{"context": "", "choices": ["a", ""], "gold": 0}"#,
                "choice 1 is empty",
            ),
            (
                r#"{"context": "", "choices": ["a", 2], "gold": 0}"#,
                "choice 1 is not text",
            ),
            (
                r#"{"context": "", "choices": ["a"], "gold": 1}"#,
                "index of one of the 1",
            ),
            (
                r#"{"context": "", "choices": ["a"], "gold": -1}"#,
                "index of one",
            ),
            (
                r#"{"context": "", "choices": ["a"], "gold": 0.5}"#,
                "index of one",
            ),
            (
                r#"{"context": "", "choices": ["a"], "gold": "b"}"#,
                "not one of the choices",
            ),
            (
                r#"{"context": "", "choices": ["a"], "gold": []}"#,
                "empty list",
            ),
            (
                r#"{"context": "", "choices": ["a"], "gold": [0, 3]}"#,
                "gold 3",
            ),
            (r#"{"context": "", "choices": ["a"]}"#, "no \"gold\""),
        ] {
            let e = Question::parse(line).unwrap_err();
            assert!(e.contains(why), "{line}: {e}");
        }
    }

    /// The crate's tiny GPT-2 or Llama, vocabulary 37, context 20, in fp32 or bf16.
    fn tiny_model(llama: bool, bf16: bool, seed: u64) -> Model {
        use crate::model::{ModelConfig, ModelOptions, Precision};
        let shape = if llama {
            ModelConfig::llama_tiny(37)
        } else {
            ModelConfig::tiny(37)
        };
        let cfg = ModelConfig {
            max_seq: 20,
            ..shape
        };
        let opts = ModelOptions {
            precision: if bf16 {
                Precision::Bf16
            } else {
                Precision::Fp32
            },
            ..ModelOptions::default()
        };
        Model::new(&headroom_tensor::Cpu::new(), cfg, opts, seed).unwrap()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

        /// A shared context's keys and values continued from copies (more choices than one
        /// batch of them holds, too) give each choice the log-likelihood the padded batch of
        /// whole inputs gives (another summation order: cached attention and row counts), in
        /// fp32 and bf16.
        #[test]
        fn a_shared_context_scores_as_the_whole_inputs_do(
            llama in proptest::prelude::any::<bool>(),
            context in proptest::collection::vec(0u32..37, 1..12),
            continuations in proptest::collection::vec(
                proptest::collection::vec(0u32..37, 1..8), 1..12),
            bf16 in proptest::prelude::any::<bool>(),
            seed in proptest::prelude::any::<u64>(),
        ) {
            let model = tiny_model(llama, bf16, seed);
            let requests: Vec<Request> = continuations
                .into_iter()
                .map(|continuation| Request { context: context.clone(), continuation })
                .collect();
            let shared = score_after_shared_context(&model, &context, &requests, &mut PromptCache::new())
                .unwrap()
                .0;
            let padded = score_padded(&model, &requests).unwrap();
            // bf16 rounds activations stored in another order to other neighbours.
            let tolerance = if bf16 { 2e-2 } else { 1e-5 };
            proptest::prop_assert_eq!(shared.len(), requests.len());
            for (s, p) in shared.iter().zip(&padded) {
                proptest::prop_assert!(
                    (s.loglikelihood - p.loglikelihood).abs()
                        <= tolerance * p.loglikelihood.abs().max(1.0),
                    "{:?} vs {:?}", s, p
                );
            }
            proptest::prop_assert_eq!(score(&model, &requests).unwrap(), shared);
        }

        /// A context scored after the keys and values kept from another runs only what it
        /// does not share with it (the longest common prefix, a token at least left to run),
        /// and each choice's log-likelihood is a fresh scoring's to rounding.
        #[test]
        fn a_context_after_a_kept_one_scores_as_a_fresh_one(
            llama in proptest::prelude::any::<bool>(),
            prefix in proptest::collection::vec(0u32..37, 0..9),
            first in proptest::collection::vec(0u32..37, 1..6),
            second in proptest::collection::vec(0u32..37, 0..6),
            continuations in proptest::collection::vec(
                proptest::collection::vec(0u32..37, 1..7), 1..5),
            bf16 in proptest::prelude::any::<bool>(),
            seed in proptest::prelude::any::<u64>(),
        ) {
            let model = tiny_model(llama, bf16, seed);
            let requests = |context: Vec<u32>| -> Vec<Request> {
                continuations
                    .iter()
                    .map(|c| Request { context: context.clone(), continuation: c.clone() })
                    .collect()
            };
            let one: Vec<u32> = prefix.iter().chain(&first).copied().collect();
            let mut two: Vec<u32> = prefix.iter().chain(&second).copied().collect();
            if two.is_empty() {
                two.push(first[0]);
            }
            let mut kept = PromptCache::new();
            let (_, reused) = score_reusing(&model, &requests(one.clone()), &mut kept).unwrap();
            proptest::prop_assert_eq!(reused, Some(0));
            // What the cache holds: the context, and a lone continuation's inputs (it ran in
            // the context's cache).
            let held = |context: &[u32]| -> Vec<u32> {
                let mut held = context.to_vec();
                if let [only] = continuations.as_slice() {
                    held.extend_from_slice(&only[..only.len() - 1]);
                }
                held
            };
            proptest::prop_assert_eq!(kept.len(), held(&one).len());
            let (after, reused) = score_reusing(&model, &requests(two.clone()), &mut kept).unwrap();
            let common = held(&one).iter().zip(&two).take_while(|(a, b)| a == b).count();
            proptest::prop_assert_eq!(reused, Some(common.min(two.len() - 1)));
            proptest::prop_assert_eq!(kept.len(), held(&two).len());
            let fresh = score(&model, &requests(two)).unwrap();
            let tolerance = if bf16 { 2e-2 } else { 1e-5 };
            for (a, f) in after.iter().zip(&fresh) {
                proptest::prop_assert!(
                    (a.loglikelihood - f.loglikelihood).abs()
                        <= tolerance * f.loglikelihood.abs().max(1.0),
                    "{:?} vs {:?}", a, f
                );
            }
        }
    }

    #[test]
    fn argmax_takes_the_first_of_equals_and_nan_as_numpy_does() {
        assert_eq!(argmax([1.0, 3.0, 3.0, 2.0].into_iter()), 1);
        assert_eq!(argmax([1.0, f64::NAN, 5.0].into_iter()), 1);
        assert_eq!(
            argmax([f64::NEG_INFINITY, f64::NEG_INFINITY].into_iter()),
            0
        );
    }

    #[test]
    fn metrics_are_means_with_the_sample_standard_error() {
        let m = Metric::of(&[true, false, true, true]);
        assert_eq!(m.mean, 0.75);
        // Sample variance 0.25 (3 × 0.0625 + 0.5625 over 3), over √4.
        assert!((m.stderr.unwrap() - 0.25).abs() < 1e-12);
        assert_eq!(Metric::of(&[true]).stderr, None);
    }
}
