//! lm-evaluation-harness's `doc_to_text`, `doc_to_target` and `doc_to_choice` against what
//! lm-eval 0.4.13 computes (`benches/torch/make_doc_template_fixture.py`): the settings of
//! its own tasks (ARC, PIQA, SciQ, OpenBookQA, MMLU, BoolQ, GSM8K, TriviaQA, NQ-Open,
//! LAMBADA, WMT16, HellaSwag after its preprocessing…) on documents shaped as their datasets'
//! rows, and hand-made cases that pin down Jinja2's and Python's behaviour. Every value and
//! its type must be lm-eval's, and an error where lm-eval raises one, except the few
//! deviations listed (and documented in `doc_template.rs`).

use std::path::PathBuf;

use headroom_trainer::doc_template::{DocTemplates, DocValue, Setting};
use serde_json::{json, Value};

fn fixture() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/doc_templates.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A JSON value in the fixture's typed form (`{"int": 3}`, `{"list": […]}`…).
fn typed(v: &Value) -> Value {
    match v {
        Value::String(s) => json!({ "str": s }),
        Value::Number(n) if n.is_i64() || n.is_u64() => json!({ "int": n }),
        Value::Number(n) => json!({ "float": n }),
        Value::Bool(b) => json!({ "bool": b }),
        Value::Null => json!({ "none": null }),
        Value::Array(items) => json!({ "list": items.iter().map(typed).collect::<Vec<_>>() }),
        Value::Object(map) => {
            let typed_map: serde_json::Map<String, Value> =
                map.iter().map(|(k, v)| (k.clone(), typed(v))).collect();
            json!({ "dict": typed_map })
        }
    }
}

fn typed_doc_value(v: DocValue) -> Value {
    match v {
        DocValue::Int(i) => json!({ "int": i }),
        DocValue::Text(s) => json!({ "str": s }),
        DocValue::Json(v) => typed(&v),
    }
}

/// lm-eval's tuples are lists here (JSON has no tuple).
fn without_tuples(v: &Value) -> Value {
    match v {
        Value::Object(map) if map.len() == 1 && map.contains_key("tuple") => {
            json!({ "list": without_tuples(&map["tuple"]) })
        }
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), without_tuples(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_tuples).collect()),
        other => other.clone(),
    }
}

fn setting(case: &Value, key: &str) -> Option<Setting> {
    match case.get(key)? {
        Value::String(s) => Some(Setting::Template(s.clone())),
        other => Some(Setting::Value(other.clone())),
    }
}

/// Ours against lm-eval's: equal values, or both an error (an unset setting is `None` here,
/// where lm-eval raises: the document's own field is kept instead).
fn same(ours: Result<Option<Value>, String>, theirs: &Value) -> bool {
    let theirs = without_tuples(theirs);
    match (ours, theirs.get("error")) {
        (Ok(Some(v)), None) => v == theirs,
        (Err(_) | Ok(None), Some(_)) => true,
        _ => false,
    }
}

/// The cases where headroom differs, each for a reason `doc_template.rs` documents; no
/// task's settings are among them.
const DEVIATIONS: [(&str, &str); 5] = [
    (
        "arithmetic",
        "Python's `%` formatting of strings: minijinja's `%` is the modulo only",
    ),
    (
        "choice_literals",
        "a tuple literal in a template prints as a list: minijinja has no tuples",
    ),
    (
        "dict_render",
        "a dict prints its keys sorted: the documents' objects do not keep order",
    ),
    (
        "dict_access",
        "a dict's keys and values iterate sorted, for the same reason",
    ),
    (
        "format_methods",
        "str.format's !r conversion and the printf-style format filter",
    ),
];

#[test]
fn settings_read_documents_as_lm_eval_does() {
    let fixture = fixture();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 60, "{} cases", cases.len());
    let mut mismatches = Vec::new();
    let mut compared = 0;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let templates = DocTemplates::new(
            setting(case, "doc_to_text"),
            setting(case, "doc_to_target"),
            setting(case, "doc_to_choice"),
        );
        for (i, d) in case["docs"].as_array().unwrap().iter().enumerate() {
            let doc = &d["doc"];
            let (text, target, choice) = match &templates {
                Ok(t) => (
                    t.text(doc).map(|v| v.map(typed_doc_value)),
                    t.target(doc).map(|v| v.map(typed_doc_value)),
                    t.choice(doc).map(|v| v.map(|v| typed(&v))),
                ),
                Err(e) => (Err(e.clone()), Err(e.clone()), Err(e.clone())),
            };
            for (what, ours, theirs) in [
                ("text", text, d.get("text")),
                ("target", target, d.get("target")),
                ("choice", choice, d.get("choice")),
            ] {
                let Some(theirs) = theirs else { continue };
                compared += 1;
                if !same(ours.clone(), theirs) && !DEVIATIONS.iter().any(|(n, _)| *n == name) {
                    mismatches.push(format!(
                        "{name}[{i}].{what}: ours {ours:?}, lm-eval {theirs}"
                    ));
                }
            }
        }
    }
    assert!(compared > 300, "{compared} values compared");
    // The deviations are the hand-made cases only: every real task is exact.
    for (name, _) in DEVIATIONS {
        let case = cases.iter().find(|c| c["name"] == name).unwrap();
        assert!(
            !case["why"].as_str().unwrap().contains("lm_eval/tasks/"),
            "{name}"
        );
    }
    assert!(
        mismatches.is_empty(),
        "{} of {compared}:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}

/// The multiple-choice presets hold their tasks' YAML settings as the fixture read them
/// from lm-eval, and HellaSwag's `process_docs` makes lm-eval's `query`, `choices` and
/// `gold` from the rows' own fields (WikiHow's bracketed markers, `[title]`, double
/// spaces, a capitalized `ctx_b`).
#[test]
fn choices_presets_are_their_tasks_settings() {
    use headroom_trainer::choices::{hellaswag_process_docs, ChoicesPreset, CHOICES_TASKS};
    let fixture = fixture();
    let case = |name: &str| {
        fixture["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no case {name}"))
            .clone()
    };
    let as_fixture = |s: &Setting| match s {
        Setting::Template(t) => Value::String(t.clone()),
        Setting::Value(v) => v.clone(),
    };
    let mut checked = 0;
    for (preset, task) in [
        ("arc_easy", "arc_easy"),
        ("arc_challenge", "arc_easy"),
        ("piqa", "piqa"),
        ("sciq", "sciq"),
        ("openbookqa", "openbookqa"),
        ("boolq", "boolq"),
        ("commonsense_qa", "commonsense_qa"),
        ("social_iqa", "social_iqa"),
        ("hellaswag", "hellaswag"),
        ("mmlu", "mmlu_abstract_algebra"),
        ("mmlu_abstract_algebra", "mmlu_abstract_algebra"),
    ] {
        let p = ChoicesPreset::named(preset).unwrap();
        let c = case(task);
        assert_eq!(as_fixture(&p.doc_to_text), c["doc_to_text"], "{preset}");
        assert_eq!(as_fixture(&p.doc_to_target), c["doc_to_target"], "{preset}");
        assert_eq!(as_fixture(&p.doc_to_choice), c["doc_to_choice"], "{preset}");
        checked += 1;
    }
    assert_eq!(checked, CHOICES_TASKS.len() + 2);
    let algebra = ChoicesPreset::named("mmlu_abstract_algebra").unwrap();
    assert_eq!(
        algebra.description.as_deref(),
        Some("The following are multiple choice questions (with answers) about abstract algebra.\n\n")
    );
    assert!(ChoicesPreset::named("mmlu_cooking").is_err());
    assert!(ChoicesPreset::named("gsm8k").is_err());

    let hellaswag = case("hellaswag");
    let docs = hellaswag["docs"].as_array().unwrap();
    assert!(docs.len() >= 2);
    for d in docs {
        let processed = &d["doc"];
        let mut row = processed.as_object().unwrap().clone();
        for key in ["query", "choices", "gold"] {
            row.remove(key);
        }
        let ours = hellaswag_process_docs(&Value::Object(row)).unwrap();
        for key in ["query", "choices", "gold"] {
            assert_eq!(ours[key], processed[key], "{key} of {}", processed["ctx"]);
        }
    }
}

/// lm-eval's `wikitext_detokenizer` on pages meeting each of its rules, and the words and
/// bytes its `process_results` counts on the page before it.
#[test]
fn wikitext_pages_detokenize_as_lm_eval_does() {
    use headroom_trainer::rolling::{count_words, wikitext_detokenize};
    let fixture = fixture();
    let pages = fixture["wikitext"].as_array().unwrap();
    assert!(pages.len() >= 5);
    for p in pages {
        let page = p["page"].as_str().unwrap();
        assert_eq!(
            wikitext_detokenize(page).unwrap(),
            p["detokenized"].as_str().unwrap(),
            "{page:?}"
        );
        assert_eq!(count_words(page) as u64, p["words"].as_u64().unwrap());
        assert_eq!(page.len() as u64, p["bytes"].as_u64().unwrap());
    }
}

/// A task's own settings read its dataset's rows, even one with a `context` field of its own
/// (SocialIQA's), and leave documents already in headroom's shape as they are.
#[test]
fn preset_settings_read_rows_and_pass_headroom_documents() {
    use headroom_trainer::choices::ChoicesPreset;
    let p = ChoicesPreset::named("social_iqa").unwrap();
    let templates = DocTemplates::new(
        Some(p.doc_to_text),
        Some(p.doc_to_target),
        Some(p.doc_to_choice),
    )
    .unwrap()
    .only_for_dataset_rows();
    let row = json!({"context": "Tracy went to the shop.", "question": "Why?", "answerA": "milk",
        "answerB": "sleep", "answerC": "nothing", "label": "1"});
    let line = templates.question_line(&row).unwrap();
    assert_eq!(line["context"], "Q: Tracy went to the shop. Why?\nA:");
    assert_eq!(line["choices"], json!(["milk", "sleep", "nothing"]));
    assert_eq!(line["gold"], 0);
    let shaped = json!({"context": "2 + 2 =", "choices": ["4", "5"], "gold": 0});
    assert_eq!(templates.question_line(&shaped).unwrap(), shaped);
    // Settings the user gives read every document.
    let given = DocTemplates::new(Some("{{question}}".into()), None, None).unwrap();
    assert!(given.question_line(&shaped).is_err());
}
