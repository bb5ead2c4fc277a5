//! Multiple-choice evaluation against lm-evaluation-harness: every request, log-likelihood,
//! greedy flag, per-question metric and aggregate of twelve lm-eval 0.4.13 runs (four with
//! few-shot prompts, whose example draws are CPython's, and four through a chat template)
//! (`fixtures/choices/lm_eval_choices.json`, written by
//! `benches/torch/make_choices_fixture.py`) on two transformers models with two tokenizers,
//! and `headroom eval --choices` on one of them; the head on chosen rows alone equals those
//! rows of the full logits.

use crate::common;

use std::path::PathBuf;

use headroom_tensor::Cpu;
use headroom_trainer::choices::{self, Outcome, Question};
use headroom_trainer::model::{Geometry, Model, ModelConfig, ModelOptions, Precision};
use headroom_trainer::sample::load_model;
use headroom_trainer::tokenize::Tokenizer;
use proptest::prelude::*;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn fixture() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("choices/lm_eval_choices.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A fixture run's transformers model and the tokenizer the script saved for it.
fn model_and_tokenizer(run: &serde_json::Value) -> (Model, Tokenizer) {
    let model = load_model(
        &fixtures().join(run["model"].as_str().unwrap()),
        &Cpu::new(),
    )
    .unwrap();
    let tok_path = fixtures()
        .join("choices")
        .join(run["tokenizer"].as_str().unwrap())
        .join("tokenizer.json");
    (
        model,
        Tokenizer::from_name(tok_path.to_str().unwrap()).unwrap(),
    )
}

/// `headroom eval` of the Llama fixture with the tokenizer the script saved as
/// `choices/<tokenizer>/`, then `args`.
fn eval_llama(tokenizer: &str, args: &[&str]) -> std::process::Output {
    let model = fixtures().join("hf-llama-gqa-untied");
    let tokenizer = fixtures()
        .join("choices")
        .join(tokenizer)
        .join("tokenizer.json");
    common::headroom_command()
        .args([
            "eval",
            "--from",
            model.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap(),
        ])
        .args(args)
        .output()
        .unwrap()
}

/// The line `headroom eval` prints for `run`'s `acc` (mean ± standard error) as lm-eval
/// measured it.
fn acc_line(run: &serde_json::Value) -> String {
    format!(
        "acc          {:.4} ± {:.4}",
        run["metrics"]["acc"].as_f64().unwrap(),
        run["stderr"]["acc"].as_f64().unwrap()
    )
}

/// A question's outcome against lm-eval's sample `want`: its log-likelihoods, greedy flags
/// and metrics; returns how many choices were greedy.
fn assert_outcome_is_lm_evals(what: &str, o: &Outcome, want: &serde_json::Value) -> usize {
    let lls: Vec<f64> = serde_json::from_value(want["loglikelihoods"].clone()).unwrap();
    let greedy: Vec<bool> = serde_json::from_value(want["is_greedy"].clone()).unwrap();
    assert_eq!(o.scored.len(), lls.len(), "{what}");
    for (c, (s, (ll, g))) in o.scored.iter().zip(lls.iter().zip(&greedy)).enumerate() {
        // PyTorch's f32 log-softmax summed in f32 against f64 sums of our f32 logits.
        assert!(
            (s.loglikelihood - ll).abs() < 2e-4 * ll.abs().max(1.0),
            "{what} choice {c}: {} vs lm-eval {ll}",
            s.loglikelihood
        );
        assert_eq!(s.is_greedy, *g, "{what} choice {c}");
    }
    for (metric, got) in [
        ("acc", o.acc),
        ("acc_norm", o.acc_norm),
        ("acc_bytes", o.acc_bytes),
        ("exact_match", o.exact_match),
    ] {
        assert_eq!(
            f64::from(u8::from(got)),
            want[metric].as_f64().unwrap(),
            "{what} {metric}"
        );
    }
    greedy.iter().filter(|&&g| g).count()
}

/// A run's aggregates against lm-eval's: each metric's mean and standard error.
fn assert_report_is_lm_evals(name: &str, report: &choices::ChoicesReport, run: &serde_json::Value) {
    for (metric, got) in [
        ("acc", report.acc),
        ("acc_norm", report.acc_norm),
        ("acc_bytes", report.acc_bytes),
        ("exact_match", report.exact_match),
    ] {
        let mean = run["metrics"][metric].as_f64().unwrap();
        let stderr = run["stderr"][metric].as_f64().unwrap();
        assert!(
            (got.mean - mean).abs() < 1e-12,
            "{name} {metric}: {got:?} vs {mean}"
        );
        assert!(
            (got.stderr.unwrap() - stderr).abs() < 1e-9,
            "{name} {metric}: {got:?} vs ± {stderr}"
        );
    }
}

#[test]
fn every_run_scores_as_lm_eval_scores_it() {
    let fixture = fixture();
    let runs = fixture["runs"].as_object().unwrap();
    assert_eq!(runs.len(), 15);
    let (mut questions_checked, mut greedy_seen, mut fewshot_runs) = (0, 0, 0);
    for (name, run) in runs {
        let (model, tok) = model_and_tokenizer(run);
        let path = fixtures()
            .join("choices")
            .join(run["questions"].as_str().unwrap());
        let mut delimiter = run["target_delimiter"].as_str().unwrap();
        let questions = match run.get("fewshot") {
            None => choices::read_questions(&path).unwrap(),
            Some(f) => {
                // The contexts lm-eval's few-shot prompts are: its sampler's draws (CPython's
                // generator), the description and the delimiters.
                fewshot_runs += 1;
                let docs = choices::read_docs(&path).unwrap();
                let fewshot = choices::Fewshot {
                    shots: f["shots"].as_u64().unwrap() as usize,
                    pool: f["file"].as_str().map(|file| {
                        choices::read_docs(&fixtures().join("choices").join(file)).unwrap()
                    }),
                    sampler: match f["sampler"].as_str().unwrap() {
                        "first_n" => choices::Sampler::FirstN,
                        _ => choices::Sampler::Random {
                            seed: f["seed"].as_u64().unwrap(),
                        },
                    },
                    description: f["description"].as_str().unwrap().to_owned(),
                    system_instruction: f["system_instruction"].as_str().map(str::to_owned),
                    delimiter: f["delimiter"].as_str().unwrap().to_owned(),
                    gen_prefix: f["gen_prefix"].as_str().map(str::to_owned),
                };
                let turns = choices::fewshot_turns(&docs, &fewshot, delimiter).unwrap();
                let template = f.get("chat").map(|_| tok.chat_template().unwrap().unwrap());
                // HFLM's chat_template_args.
                let extra: Vec<(String, headroom_trainer::chat_template::ChatValue)> = f
                    .get("chat")
                    .and_then(|c| c.get("kwargs"))
                    .and_then(|k| k.as_object())
                    .map(|k| {
                        k.iter()
                            .map(|(key, v)| (key.clone(), v.clone().into()))
                            .collect()
                    })
                    .unwrap_or_default();
                let format = match (&template, f.get("chat")) {
                    (Some(template), Some(chat)) => {
                        // lm-eval scores a choice right after the generation prompt, or after
                        // a gen_prefix with the target delimiter unless the prefix ends with
                        // whitespace.
                        let prefix = fewshot.gen_prefix.as_deref().unwrap_or("");
                        if prefix.is_empty() || choices::ends_with_whitespace(prefix) {
                            delimiter = "";
                        }
                        choices::PromptFormat::Chat {
                            template,
                            multiturn: chat["multiturn"].as_bool().unwrap(),
                            extra: &extra,
                        }
                    }
                    _ => choices::PromptFormat::Plain,
                };
                docs.into_iter()
                    .zip(&turns)
                    .map(|(d, turns)| Question {
                        context: choices::render_prompt(turns, format).unwrap(),
                        ..d.question
                    })
                    .collect()
            }
        };
        let want = run["scored"].as_array().unwrap();
        assert_eq!(questions.len(), want.len(), "{name}");
        let mut outcomes: Vec<Outcome> = Vec::new();
        let report = choices::evaluate(&model, &tok, &questions, delimiter, |i, o| {
            assert_eq!(i, outcomes.len());
            outcomes.push(o.clone());
            Ok(())
        })
        .unwrap();
        for (i, ((q, o), w)) in questions.iter().zip(&outcomes).zip(want).enumerate() {
            let what = format!("{name} question {i}");
            // lm-eval's requests: the context and delimiter + choice, as text.
            let requests: Vec<(String, String)> =
                serde_json::from_value(w["requests"].clone()).unwrap();
            let ours: Vec<(String, String)> = (0..q.choices.len())
                .map(|c| (q.context.clone(), q.continuation(c, delimiter)))
                .collect();
            assert_eq!(ours, requests, "{what}");
            greedy_seen += assert_outcome_is_lm_evals(&what, o, w);
            questions_checked += 1;
        }
        assert_report_is_lm_evals(name, &report, run);
    }
    assert_eq!(fewshot_runs, 11);
    // The three gen_prefix runs score the 12 questions of questions.jsonl each.
    assert_eq!(questions_checked, 10 * 12 + 3 + 4 + 3 * 12);
    // Greedy continuations were found and matched, not only their absence.
    assert!(greedy_seen >= 3, "{greedy_seen}");
}

/// Winogrande's multiple input: each option's filled-in sentence is a context and the rest of
/// the sentence is scored after each, as lm-eval's `winogrande` task splits and scores them
/// (zero-shot with both pairs, and one example from the documents themselves); `eval
/// --choices` reads the documents as they come and prints lm-eval's acc.
#[test]
fn winogrande_documents_score_as_lm_evals_multiple_input() {
    let fixture = fixture();
    let runs = fixture["winogrande"].as_object().unwrap();
    assert_eq!(runs.len(), 3);
    let path = fixtures().join("choices/winogrande.jsonl");
    let mut checked = 0;
    for (name, run) in runs {
        let (model, tok) = model_and_tokenizer(run);
        let docs = choices::read_docs(&path).unwrap();
        let shots = run["shots"].as_u64().unwrap() as usize;
        let fewshot = choices::Fewshot {
            shots,
            pool: None,
            sampler: choices::Sampler::Random {
                seed: run["seed"].as_u64().unwrap(),
            },
            description: String::new(),
            system_instruction: None,
            delimiter: "\n\n".into(),
            gen_prefix: None,
        };
        let contexts = choices::fewshot_contexts(&docs, &fewshot, " ").unwrap();
        let questions: Vec<Question> = docs
            .into_iter()
            .zip(contexts)
            .map(|(d, context)| Question {
                context,
                ..d.question
            })
            .collect();
        let want = run["scored"].as_array().unwrap();
        let mut outcomes: Vec<Outcome> = Vec::new();
        let report = choices::evaluate(&model, &tok, &questions, " ", |_, o| {
            outcomes.push(o.clone());
            Ok(())
        })
        .unwrap();
        assert_eq!(outcomes.len(), want.len());
        for (i, ((q, o), w)) in questions.iter().zip(&outcomes).zip(want).enumerate() {
            let what = format!("winogrande {name} document {i}");
            let requests: Vec<(String, String)> =
                serde_json::from_value(w["requests"].clone()).unwrap();
            let ours: Vec<(String, String)> = (0..q.choices.len())
                .map(|c| (q.context_for(c), q.continuation(c, " ")))
                .collect();
            assert_eq!(ours, requests, "{what}");
            assert_outcome_is_lm_evals(&what, o, w);
            checked += 1;
        }
        assert_report_is_lm_evals(name, &report, run);
        if name == "llama" {
            let o = eval_llama("llama", &["--choices", path.to_str().unwrap()]);
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let line = format!(
                "{:<12} {:.4} ± {:.4}",
                "acc",
                run["metrics"]["acc"].as_f64().unwrap(),
                run["stderr"]["acc"].as_f64().unwrap()
            );
            assert!(out.contains(&line), "{line:?} in {out}");
        }
    }
    assert_eq!(checked, 18);
    // Malformed documents are refused with the reason.
    for (line, why) in [
        (
            r#"{"sentence": "no blank", "option1": "a", "option2": "b", "answer": "1"}"#,
            "\"_\"",
        ),
        (
            r#"{"sentence": "a _", "option1": "a", "option2": "b", "answer": "1"}"#,
            "follows",
        ),
        (
            r#"{"sentence": "a _ b", "option1": "a", "option2": "b", "answer": "3"}"#,
            "\"1\" or \"2\"",
        ),
        (
            r#"{"sentence": "a _ b", "option2": "b", "answer": "1"}"#,
            "option1",
        ),
        (
            r#"{"context": "x", "continuation": "y", "choices": ["a"], "gold": 0}"#,
            "both",
        ),
        (
            r#"{"continuation": "y", "choices": ["a", "b"], "gold": [0, 1]}"#,
            "several gold",
        ),
    ] {
        let e = Question::parse(line).unwrap_err();
        assert!(e.contains(why), "{line}: {e}");
    }
}

/// The command prints lm-eval's metrics of the `llama` run and writes a line per question;
/// a bad question is an error naming its line, before the model loads.
#[test]
fn eval_choices_prints_lm_eval_s_metrics_and_writes_samples() {
    let fixture = fixture();
    let run = &fixture["runs"]["llama"];
    let dir = tempfile::tempdir().unwrap();
    let samples = dir.path().join("samples.jsonl");
    let questions = fixtures().join("choices/questions.jsonl");
    let run_eval = |questions: &std::path::Path, extra: &[&str]| {
        let mut args = vec!["--choices", questions.to_str().unwrap()];
        args.extend_from_slice(extra);
        eval_llama("llama", &args)
    };
    let o = run_eval(&questions, &["--samples", samples.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for metric in ["acc", "acc_norm", "acc_bytes", "exact_match"] {
        let line = format!(
            "{metric:<12} {:.4} ± {:.4}",
            run["metrics"][metric].as_f64().unwrap(),
            run["stderr"][metric].as_f64().unwrap()
        );
        assert!(out.contains(&line), "{line:?} in {out}");
    }
    assert!(out.contains("12 questions, 27 choices"), "{out}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&samples)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 12);
    for (line, want) in lines.iter().zip(run["scored"].as_array().unwrap()) {
        assert_eq!(line["is_greedy"], want["is_greedy"]);
        assert_eq!(
            line["acc"].as_bool().unwrap(),
            want["acc"].as_f64().unwrap() == 1.0
        );
    }

    // The delimiter reaches the requests: lm-eval's run without one.
    let o = run_eval(&questions, &["--target-delimiter", ""]);
    let out = String::from_utf8_lossy(&o.stdout);
    let acc = fixture["runs"]["llama_no_delimiter"]["metrics"]["acc"]
        .as_f64()
        .unwrap();
    assert!(out.contains(&format!("acc          {acc:.4}")), "{out}");

    // Few-shot prompts reach the requests: lm-eval's runs with its two samplers.
    let fewshot_file = fixtures().join("choices/fewshot.jsonl");
    for (name, extra) in [
        (
            "llama_fewshot_first_n",
            vec![
                "--num-fewshot",
                "3",
                "--fewshot-file",
                fewshot_file.to_str().unwrap(),
                "--fewshot-sampler",
                "first-n",
            ],
        ),
        (
            "llama_fewshot_random",
            vec![
                "--num-fewshot",
                "2",
                "--description",
                "Pick the ending.\n\n",
            ],
        ),
    ] {
        let o = run_eval(&questions, &extra);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        for metric in ["acc", "acc_norm"] {
            let line = format!(
                "{metric:<12} {:.4} ± {:.4}",
                fixture["runs"][name]["metrics"][metric].as_f64().unwrap(),
                fixture["runs"][name]["stderr"][metric].as_f64().unwrap()
            );
            assert!(out.contains(&line), "{name}: {line:?} in {out}");
        }
    }

    // Through the chat template: lm-eval's --apply_chat_template runs, with the tokenizer
    // that has one; the one without is refused.
    for (name, extra) in [
        (
            "llama_chat_multiturn",
            vec![
                "--num-fewshot",
                "2",
                "--fewshot-file",
                fewshot_file.to_str().unwrap(),
                "--fewshot-sampler",
                "first-n",
            ],
        ),
        (
            "llama_chat_singleturn",
            vec![
                "--num-fewshot",
                "2",
                "--description",
                "Pick the ending.",
                "--fewshot-as-multiturn",
                "false",
            ],
        ),
    ] {
        let mut args = vec![
            "--choices",
            questions.to_str().unwrap(),
            "--apply-chat-template",
            "--system-instruction",
            "You answer briefly.",
        ];
        args.extend(extra);
        let o = eval_llama("chat", &args);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let line = acc_line(&fixture["runs"][name]);
        assert!(out.contains(&line), "{name}: {line:?} in {out}");
    }
    let o = run_eval(&questions, &["--apply-chat-template"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("has no chat template"), "{err}");
    // The template's own variables (HFLM's chat_template_args), and a value that is not JSON.
    for (kwargs, ok) in [(r#"{"enable_thinking": false}"#, true), ("{enable", false)] {
        let o = eval_llama(
            "chat_no_system",
            &[
                "--choices",
                questions.to_str().unwrap(),
                "--apply-chat-template",
                "--chat-template-kwargs",
                kwargs,
                "--num-fewshot",
                "1",
                "--fewshot-file",
                fewshot_file.to_str().unwrap(),
                "--fewshot-sampler",
                "first-n",
            ],
        );
        let (out, err) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert_eq!(o.status.success(), ok, "{kwargs}: {err}");
        if ok {
            let run = &fixture["runs"]["llama_chat_no_thinking"];
            let line = acc_line(run);
            assert!(out.contains(&line), "{line:?} in {out}");
        } else {
            assert!(err.contains("--chat-template-kwargs: not JSON"), "{err}");
        }
    }

    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"context\": \"a\", \"choices\": [\"b\"], \"gold\": 0}\n\n{\"context\": \"a\", \"choices\": [\"b\"], \"gold\": 2}\n",
    )
    .unwrap();
    let o = run_eval(&bad, &[]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("bad.jsonl: line 3: gold 2"), "{err}");
    assert!(o.stdout.is_empty());

    // Refused before the model loads: more examples than the pool has (the question itself
    // left out), an unknown sampler, and an example with several gold answers.
    let several = fixtures().join("choices/several_gold.jsonl");
    for (extra, why) in [
        (
            vec!["--num-fewshot", "12"],
            "12 few-shot examples from a pool of 11",
        ),
        // The largest count: no overflow, the same refusal, with either sampler.
        (
            vec!["--num-fewshot", "18446744073709551615"],
            "few-shot examples from a pool of 11",
        ),
        (
            vec![
                "--num-fewshot",
                "18446744073709551615",
                "--fewshot-sampler",
                "first-n",
            ],
            "few-shot examples from a pool of 11",
        ),
        (
            vec![
                "--num-fewshot",
                "7",
                "--fewshot-file",
                fewshot_file.to_str().unwrap(),
            ],
            "pool of 6",
        ),
        (
            vec!["--num-fewshot", "1", "--fewshot-sampler", "balanced"],
            "expected random or first-n",
        ),
        (
            vec![
                "--num-fewshot",
                "1",
                "--fewshot-file",
                several.to_str().unwrap(),
            ],
            "several gold answers",
        ),
    ] {
        let o = run_eval(&questions, &extra);
        assert!(!o.status.success(), "{extra:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(why), "{extra:?}: {err}");
        assert!(o.stdout.is_empty(), "{extra:?}");
    }
}

/// The few-shot sampler's generator draws what CPython's `random.Random(seed).sample` draws,
/// call after call on one generator, in both of its algorithms.
#[test]
fn python_s_random_sample_is_drawn_as_cpython_draws_it() {
    let fixture = fixture();
    let mut draws = 0;
    for case in fixture["python_random"]["calls"].as_array().unwrap() {
        let mut rng = headroom_trainer::pyrandom::PyRandom::new(case["seed"].as_u64().unwrap());
        for d in case["draws"].as_array().unwrap() {
            let (n, k) = (d["n"].as_u64().unwrap(), d["k"].as_u64().unwrap());
            let want: Vec<usize> = serde_json::from_value(d["sample"].clone()).unwrap();
            assert_eq!(
                rng.sample(n as usize, k as usize).unwrap(),
                want,
                "seed {} sample({n}, {k})",
                case["seed"]
            );
            draws += 1;
        }
        // Then floats (53 bits of two outputs) and choices with replacement, on the same
        // generator.
        for want in case["random"].as_array().unwrap() {
            assert_eq!(
                rng.random(),
                want.as_f64().unwrap(),
                "seed {}",
                case["seed"]
            );
        }
        let want: Vec<usize> = serde_json::from_value(case["choices"].clone()).unwrap();
        assert_eq!(rng.choices(7, 9), want, "seed {}", case["seed"]);
    }
    assert_eq!(draws, 13);
}

/// Single targets (LAMBADA) as lm-eval's `loglikelihood` tasks score them: each document's
/// request (lm-eval's split of its text), log-likelihood and greedy flag; acc with its
/// standard error; perplexity, and its standard error by lm-eval's bootstrap, draw for draw
/// (on lm-eval's own log-likelihoods to 1e-12, on ours to their difference); and the
/// command's lines.
#[test]
fn completions_score_as_lm_eval_s_loglikelihood() {
    use headroom_trainer::completions;
    let fixture = fixture();
    let path = fixtures().join("choices/completions.jsonl");
    let documents = completions::read_completions(&path).unwrap();
    let mut greedy_seen = 0;
    for (name, run) in fixture["completions"].as_object().unwrap() {
        let (model, tok) = model_and_tokenizer(run);
        let mut scores = Vec::new();
        let report = completions::evaluate(&model, &tok, &documents, |_, s| {
            scores.push(*s);
            Ok(())
        })
        .unwrap();
        let want = run["documents"].as_array().unwrap();
        assert_eq!(scores.len(), want.len(), "{name}");
        let mut theirs = Vec::new();
        for (i, ((s, w), d)) in scores.iter().zip(want).zip(&documents).enumerate() {
            let request: (String, String) = serde_json::from_value(w["request"].clone()).unwrap();
            assert_eq!((d.context.clone(), d.target.clone()), request, "{name} {i}");
            let ll = w["loglikelihood"].as_f64().unwrap();
            assert!(
                (s.loglikelihood - ll).abs() < 2e-4 * ll.abs().max(1.0),
                "{name} document {i}: {} vs lm-eval {ll}",
                s.loglikelihood
            );
            assert_eq!(s.is_greedy, w["is_greedy"].as_bool().unwrap(), "{name} {i}");
            greedy_seen += usize::from(s.is_greedy);
            theirs.push(ll);
        }
        let metric = |m: &str| run["metrics"][m].as_f64().unwrap();
        let stderr = |m: &str| run["stderr"][m].as_f64().unwrap();
        assert!((report.acc.mean - metric("acc")).abs() < 1e-12, "{name}");
        assert!(
            (report.acc.stderr.unwrap() - stderr("acc")).abs() < 1e-9,
            "{name}"
        );
        let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
        assert!(
            rel(report.perplexity, metric("perplexity")) < 1e-5,
            "{name}"
        );
        // The bootstrap itself, on lm-eval's log-likelihoods: the same replicates.
        let replayed = completions::bootstrap_stderr(
            &theirs,
            completions::BOOTSTRAP_ITERS,
            completions::perplexity,
        )
        .unwrap();
        assert!(
            rel(replayed, stderr("perplexity")) < 1e-12,
            "{name}: {replayed} vs lm-eval {}",
            stderr("perplexity")
        );
        assert!(
            rel(report.perplexity_stderr.unwrap(), stderr("perplexity")) < 1e-4,
            "{name}"
        );
    }
    assert!(greedy_seen >= 2, "{greedy_seen}");

    let run = &fixture["completions"]["llama"];
    let o = eval_llama("llama", &["--completions", path.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let acc = acc_line(run);
    assert!(out.contains(&acc), "{acc:?} in {out}");
    assert!(out.contains("perplexity   "), "{out}");
    assert!(out.contains("8 documents"), "{out}");
}

/// The crate's tiny GPT-2 or Llama, vocabulary 53, context 24.
fn tiny(llama: bool) -> ModelConfig {
    let shape = if llama {
        ModelConfig::llama_tiny(53)
    } else {
        ModelConfig::tiny(53)
    };
    ModelConfig {
        max_seq: 24,
        ..shape
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The head on chosen rows gives those rows of the full logits: the rows are any of the
    /// batch's, in any order, repeated or not, in fp32 and bf16. Not bit for bit: the head's
    /// GEMM over n rows sums in another order than over all of them (a few f32 ulps, which
    /// the rounding to bf16 may carry to one bf16 ulp).
    #[test]
    fn logits_at_chosen_rows_are_those_rows_of_the_logits(
        llama in any::<bool>(),
        bf16 in any::<bool>(),
        b in 1usize..4,
        t in 1usize..24,
        picks in proptest::collection::vec(any::<prop::sample::Index>(), 0..12),
        seed in any::<u64>(),
    ) {
        let cfg = tiny(llama);
        let opts = ModelOptions {
            precision: if bf16 { Precision::Bf16 } else { Precision::Fp32 },
            ..Default::default()
        };
        let model = Model::new(&Cpu::new(), cfg, opts, seed).unwrap();
        let tokens: Vec<u32> = (0..b * t).map(|i| ((i as u64 * 7 + seed) % 53) as u32).collect();
        let g = Geometry::new(b, t);
        let rows: Vec<usize> = picks.iter().map(|p| p.index(b * t)).collect();
        let full = model.logits(&tokens, g).unwrap();
        let at = model.logits_at(&tokens, g, &rows).unwrap();
        let v = cfg.vocab;
        prop_assert_eq!(at.len(), rows.len() * v);
        let tolerance = if bf16 { 1.0 / 128.0 } else { 1e-5 };
        for (k, &r) in rows.iter().enumerate() {
            let want = &full[r * v..(r + 1) * v];
            let got = &at[k * v..(k + 1) * v];
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
            for (j, (a, w)) in got.iter().zip(want).enumerate() {
                prop_assert!(
                    (a - w).abs() <= tolerance * scale,
                    "row {} logit {}: {} vs {}", r, j, a, w
                );
            }
        }
        prop_assert!(model.logits_at(&tokens, g, &[b * t]).is_err());
    }
}

/// A request's tokens as lm-eval splits them, on the Llama tokenizer that adds `<s>`: the
/// context's trailing spaces go to the continuation; an empty context is the prefix token, or
/// the continuation's own first token when that is it; a text that starts with `<s>` gets no
/// second one.
#[test]
fn requests_split_the_tokens_as_lm_eval_does() {
    let path = fixtures().join("choices/llama/tokenizer.json");
    let tok = Tokenizer::from_name(path.to_str().unwrap()).unwrap();
    let prefix = choices::PrefixToken::of(&tok).unwrap().unwrap();
    assert_eq!(prefix.text, "<s>");
    let bos = prefix.id;
    let r = choices::request(&tok, Some(&prefix), "the cat  ", "sat").unwrap();
    assert_eq!(r.context, tok.encode_sequence("the cat").unwrap());
    let whole = tok.encode_sequence("the cat  sat").unwrap();
    assert_eq!(r.continuation, whole[r.context.len()..]);
    assert_eq!(r.context[0], bos);

    let r = choices::request(&tok, Some(&prefix), "", " the cat").unwrap();
    assert_eq!(r.context, vec![bos]);
    assert_eq!(r.continuation, tok.encode(" the cat").unwrap());
    let r = choices::request(&tok, Some(&prefix), "", "<s>the cat").unwrap();
    assert_eq!(r.context, vec![bos]);
    assert_eq!(r.continuation, tok.encode("the cat").unwrap());
    let e = choices::request(&tok, None, "", "x").unwrap_err();
    assert!(e.to_string().contains("neither"), "{e}");
    let e = choices::request(&tok, Some(&prefix), "", "<s>").unwrap_err();
    assert!(e.to_string().contains("no tokens"), "{e}");

    let r = choices::request(&tok, Some(&prefix), "<s>the", " cat").unwrap();
    assert_eq!(r.context, tok.encode("<s>the").unwrap());
    assert_eq!(r.context.iter().filter(|&&i| i == bos).count(), 1);

    // A question whose gold is a choice's text.
    let q = Question::parse(r#"{"context": "x", "choices": ["a", "b"], "gold": "b"}"#).unwrap();
    assert_eq!(q.gold, choices::Gold::One(1));
}

/// Perplexity as lm-eval's `loglikelihood_rolling` measures it: each document's
/// log-likelihood, words and bytes, and the word and byte perplexities and bits per byte, on
/// both fixture pairs (documents longer than the 32-token context take several windows); the
/// command prints them.
#[test]
fn documents_score_as_lm_eval_s_rolling_log_likelihood() {
    let fixture = fixture();
    let documents = choices_documents();
    let texts = headroom_trainer::rolling::read_documents(&documents).unwrap();
    for (name, run) in fixture["rolling"].as_object().unwrap() {
        let (model, tok) = model_and_tokenizer(run);
        let mut lls = Vec::new();
        let report = headroom_trainer::rolling::evaluate(&model, &tok, &texts, |_, ll| {
            lls.push(ll);
            Ok(())
        })
        .unwrap();
        let want = run["documents"].as_array().unwrap();
        assert_eq!(lls.len(), want.len());
        for (i, ((ll, w), text)) in lls.iter().zip(want).zip(&texts).enumerate() {
            let lm = w["loglikelihood"].as_f64().unwrap();
            assert!(
                (ll - lm).abs() < 2e-4 * lm.abs().max(1.0),
                "{name} document {i}: {ll} vs {lm}"
            );
            assert_eq!(
                headroom_trainer::rolling::count_words(text) as u64,
                w["words"].as_u64().unwrap(),
                "{name} document {i}"
            );
            assert_eq!(text.len() as u64, w["bytes"].as_u64().unwrap());
        }
        for (metric, got) in [
            ("word_perplexity", report.word_perplexity),
            ("byte_perplexity", report.byte_perplexity),
            ("bits_per_byte", report.bits_per_byte),
        ] {
            let want = run["metrics"][metric].as_f64().unwrap();
            assert!(
                (got - want).abs() < 1e-5 * want,
                "{name} {metric}: {got} vs {want}"
            );
        }
    }

    let run = &fixture["rolling"]["llama"];
    let o = eval_llama("llama", &["--documents", documents.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for metric in ["word_perplexity", "byte_perplexity", "bits_per_byte"] {
        // Printed to 4 decimals: compared as numbers, the last digit may round either way.
        let want = run["metrics"][metric].as_f64().unwrap();
        let printed: f64 = out
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{metric:<16} ")))
            .unwrap_or_else(|| panic!("no {metric} in {out}"))
            .trim()
            .parse()
            .unwrap();
        assert!(
            (printed - want).abs() <= 1e-4 + 1e-6 * want,
            "{metric}: {printed} vs {want} in {out}"
        );
    }
    assert!(out.contains("6 documents, 73 words, 313 bytes"), "{out}");
}

fn choices_documents() -> PathBuf {
    fixtures().join("choices/documents.jsonl")
}

#[test]
fn headroom_eval_choices_takes_lm_evals_gen_prefix() {
    let fixture = fixture();
    let questions = fixtures().join("choices/questions.jsonl");
    let fewshot_file = fixtures().join("choices/fewshot.jsonl");
    // Through the chat template (the prefix continued as the assistant's turn, the choice
    // after the target delimiter) and in plain text.
    for (name, tokenizer, chat) in [
        ("llama_chat_gen_prefix", "chat", true),
        ("llama_gen_prefix", "llama", false),
    ] {
        let run = &fixture["runs"][name];
        let mut args = vec![
            "--choices",
            questions.to_str().unwrap(),
            "--gen-prefix",
            run["fewshot"]["gen_prefix"].as_str().unwrap(),
            "--num-fewshot",
            "1",
            "--fewshot-file",
            fewshot_file.to_str().unwrap(),
            "--fewshot-sampler",
            "first-n",
        ];
        if chat {
            args.push("--apply-chat-template");
        }
        let o = eval_llama(tokenizer, &args);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let line = acc_line(run);
        assert!(out.contains(&line), "{name}: {line:?} in {out}");
    }
    // Winogrande's multiple input takes no prefix here.
    let winogrande = fixtures().join("choices/winogrande.jsonl");
    let o = eval_llama(
        "llama",
        &[
            "--choices",
            winogrande.to_str().unwrap(),
            "--gen-prefix",
            "Answer:",
        ],
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--gen-prefix with multiple-input"));
}

/// MMLU's own rows (a Parquet split as the Hub serves it, or Arrow as `datasets` saves it)
/// under lm-eval's MMLU settings
/// (`--doc-to-text`, `--doc-to-choice`, `--doc-to-target`) score as the same questions
/// written out in headroom's shape, with five first-n examples from the rows themselves:
/// every printed metric and every sample line equal. A template over a field a row lacks
/// names the row.
#[test]
fn a_datasets_rows_under_its_templates_score_as_converted_questions() {
    let dir = tempfile::tempdir().unwrap();
    let rows_file = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../parquet/tests/fixtures/mmlu_like.parquet");
    let rows = std::fs::read_to_string(rows_file.with_extension("jsonl")).unwrap();
    let mut converted = String::new();
    for line in rows.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        let choice = |i: usize| match &row["choices"][i] {
            serde_json::Value::Null => "None".to_string(),
            v => v.as_str().unwrap().to_string(),
        };
        let context = format!(
            "{}\nA. {}\nB. {}\nC. {}\nD. {}\nAnswer:",
            row["question"].as_str().unwrap().trim(),
            choice(0),
            choice(1),
            choice(2),
            choice(3)
        );
        converted += &serde_json::json!({
            "context": context,
            "choices": ["A", "B", "C", "D"],
            "gold": row["answer"],
        })
        .to_string();
        converted.push('\n');
    }
    let converted_file = dir.path().join("mmlu.jsonl");
    std::fs::write(&converted_file, converted).unwrap();
    let shots = ["--num-fewshot", "5"];
    let run = |file: &std::path::Path, extra: &[&str], samples: &str| {
        let samples = dir.path().join(samples);
        let mut args = vec!["--choices", file.to_str().unwrap(), "--samples"];
        args.push(samples.to_str().unwrap());
        args.extend_from_slice(&shots);
        args.extend_from_slice(extra);
        let o = eval_llama("llama", &args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let metrics: Vec<String> = out
            .lines()
            .filter(|l| l.contains('±'))
            .map(String::from)
            .collect();
        (metrics, std::fs::read_to_string(samples).unwrap())
    };
    let templates = [
        "--fewshot-sampler",
        "first-n",
        "--doc-to-text",
        "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:",
        "--doc-to-choice",
        "['A', 'B', 'C', 'D']",
        "--doc-to-target",
        "answer",
    ];
    let (from_rows, rows_samples) = run(&rows_file, &templates, "rows.jsonl");
    let (from_converted, converted_samples) = run(
        &converted_file,
        &["--fewshot-sampler", "first-n"],
        "converted.jsonl",
    );
    assert_eq!(from_rows.len(), 4, "{from_rows:?}");
    assert_eq!(from_rows, from_converted);
    assert_eq!(rows_samples.lines().count(), 20);
    assert_eq!(rows_samples, converted_samples);
    // The same split as `datasets` keeps it on disk (Arrow IPC) scores the same.
    let arrow_file = rows_file.with_file_name("arrow/mmlu_like.arrow");
    let (from_arrow, arrow_samples) = run(&arrow_file, &templates, "arrow.jsonl");
    assert_eq!(from_arrow, from_rows);
    assert_eq!(arrow_samples, rows_samples);
    // The task's preset: the same settings, its first-n sampler and the subject's
    // description (no --fewshot-sampler given).
    let description =
        "The following are multiple choice questions (with answers) about anatomy.\n\n";
    let (from_preset, preset_samples) =
        run(&rows_file, &["--preset", "mmlu_anatomy"], "preset.jsonl");
    let (from_described, described_samples) = run(
        &converted_file,
        &["--fewshot-sampler", "first-n", "--description", description],
        "described.jsonl",
    );
    assert_eq!(from_preset, from_described);
    // (The fixture model's 32 positions cut the description off the left of these prompts,
    // so its text is checked in `tests/doc_templates.rs`.)
    assert_eq!(preset_samples, described_samples);
    // A template over a field the rows lack is refused, naming the row and the template.
    let o = eval_llama(
        "llama",
        &[
            "--choices",
            rows_file.to_str().unwrap(),
            "--doc-to-text",
            "{{goal}}",
            "--doc-to-choice",
            "choices",
            "--doc-to-target",
            "answer",
        ],
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("row 1: doc_to_text \"{{goal}}\"") && err.contains("undefined"),
        "{err}"
    );
}

/// `--documents --preset wikitext` reads WikiText's own rows (`page`), scores each page
/// detokenized (the same log-likelihoods as the detokenized texts given as `text`), and counts
/// the pages' words and bytes before detokenization, as lm-eval's `wikitext` task does.
#[test]
fn wikitext_pages_are_scored_detokenized_and_counted_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("doc_templates.json")).unwrap(),
    )
    .unwrap();
    let (mut pages, mut texts) = (String::new(), String::new());
    let (mut words, mut bytes) = (0, 0);
    for p in fixture["wikitext"].as_array().unwrap() {
        pages += &serde_json::json!({"page": p["page"], "title": "ignored"}).to_string();
        pages.push('\n');
        texts += &serde_json::json!({"text": p["detokenized"]}).to_string();
        texts.push('\n');
        words += p["words"].as_u64().unwrap();
        bytes += p["bytes"].as_u64().unwrap();
    }
    let (pages_file, texts_file) = (
        dir.path().join("pages.jsonl"),
        dir.path().join("texts.jsonl"),
    );
    std::fs::write(&pages_file, pages).unwrap();
    std::fs::write(&texts_file, texts).unwrap();
    let run = |file: &std::path::Path, extra: &[&str], samples: &str| {
        let samples = dir.path().join(samples);
        let mut args = vec![
            "--documents",
            file.to_str().unwrap(),
            "--samples",
            samples.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = eval_llama("llama", &args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (
            String::from_utf8_lossy(&o.stdout).to_string(),
            std::fs::read_to_string(samples).unwrap(),
        )
    };
    let (out, scored) = run(&pages_file, &["--preset", "wikitext"], "pages.jsonl");
    let (_, scored_texts) = run(&texts_file, &[], "texts.jsonl");
    assert_eq!(scored, scored_texts);
    assert!(
        out.contains(&format!("5 documents, {words} words, {bytes} bytes")),
        "{out}"
    );
    let o = eval_llama(
        "llama",
        &[
            "--documents",
            texts_file.to_str().unwrap(),
            "--preset",
            "wikitext",
        ],
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("line 1: no \"page\""));
    let o = eval_llama(
        "llama",
        &[
            "--documents",
            pages_file.to_str().unwrap(),
            "--preset",
            "pile",
        ],
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("there is wikitext"));
}
