//! Generation tasks against lm-evaluation-harness: the prompt, generated texts, filtered
//! answers and exact_match of every document of ten greedy lm-eval 0.4.13 `generate_until`
//! runs (zero-shot, few-shot by both samplers, a chat template, several targets, greedy
//! repeats through `take_first_k` and `majority_vote`, a `gen_prefix`, corpus BLEU and chrF)
//! on two transformers models, and each filter's aggregate; a sampled run's answers from
//! lm-eval's own draws
//! (`fixtures/generation/lm_eval_generation.json`, written by
//! `benches/torch/make_generation_fixture.py`); Python's `re.findall` and `re.sub`, lm-eval's
//! `RegexFilter`, `MultiChoiceRegexFilter`, filter pipelines and `exact_match` on hand-made
//! strings; the presets; and `headroom eval --generate`.

use crate::common;

use std::path::PathBuf;

use headroom_tensor::Cpu;
use headroom_trainer::choices::{self, Sampler};
use headroom_trainer::corpus_metrics::CorpusMetric;
use headroom_trainer::generation::{
    self, ExactMatch, FilterPipeline, FilterStep, Found, GenerationDoc, GenerationSettings,
    PyRegex, TaskPreset,
};
use headroom_trainer::sample::{load_model, GenerationConfig, Sampling, SamplingRequest};
use headroom_trainer::tokenize::Tokenizer;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn fixture() -> serde_json::Value {
    let text =
        std::fs::read_to_string(fixtures().join("generation/lm_eval_generation.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The Llama tokenizer `make_choices_fixture.py` saves.
fn llama_tokenizer() -> Tokenizer {
    let path = fixtures().join("choices/llama/tokenizer.json");
    Tokenizer::from_name(path.to_str().unwrap()).unwrap()
}

/// The exact_match settings of a task's metric entry.
fn metric_of(kwargs: &serde_json::Value) -> ExactMatch {
    let flag = |k: &str| kwargs.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
    ExactMatch {
        regexes_to_ignore: kwargs
            .get("regexes_to_ignore")
            .and_then(|r| r.as_array())
            .map(|r| {
                r.iter()
                    .map(|p| PyRegex::new(p.as_str().unwrap()).unwrap())
                    .collect()
            })
            .unwrap_or_default(),
        ignore_case: flag("ignore_case"),
        ignore_punctuation: flag("ignore_punctuation"),
        ignore_numbers: flag("ignore_numbers"),
    }
}

/// The sampler lm-eval's run `run` had transformers build (the model directory's generation
/// config under its `generation_kwargs`).
fn sampling_of(run: &serde_json::Value, model_dir: &std::path::Path) -> Sampling {
    let kwargs = &run["generation_kwargs"];
    generation::lm_eval_sampling(
        &GenerationConfig::beside(model_dir)
            .unwrap()
            .unwrap_or_default(),
        kwargs.get("do_sample").and_then(|d| d.as_bool()),
        &SamplingRequest {
            temperature: kwargs
                .get("temperature")
                .and_then(|t| t.as_f64())
                .map(|t| t as f32),
            ..SamplingRequest::default()
        },
    )
    .unwrap()
}

/// A document's texts in the fixture: every repeat's, or its one.
fn responses_of(doc: &serde_json::Value) -> Vec<String> {
    match doc.get("responses") {
        Some(all) => strings(all),
        None => vec![doc["response"].as_str().unwrap().to_owned()],
    }
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn every_run_generates_and_scores_as_lm_eval() {
    let fixture = fixture();
    let runs = fixture["runs"].as_object().unwrap();
    assert_eq!(runs.len(), 11);
    let (mut docs_checked, mut right, mut nonempty_fallbacks) = (0, 0, 0);
    for (name, run) in runs {
        if run["generation_kwargs"]["do_sample"] == true {
            continue; // torch's draws: `sampled_repeats_are_voted_as_lm_eval` reads them.
        }
        let model_dir = fixtures().join(run["model"].as_str().unwrap());
        let model = load_model(&model_dir, &Cpu::new()).unwrap();
        let tok_path = fixtures()
            .join("choices")
            .join(run["tokenizer"].as_str().unwrap())
            .join("tokenizer.json");
        let tok = Tokenizer::from_name(tok_path.to_str().unwrap()).unwrap();
        let docs = generation::read_generation_docs(
            &fixtures()
                .join("generation")
                .join(run["docs_file"].as_str().unwrap()),
        )
        .unwrap();
        let mut fewshot_delimiter = "\n\n".to_owned();
        let turns = match run.get("fewshot") {
            None => choices::fewshot_turns(
                &docs,
                &choices::Fewshot {
                    shots: 0,
                    pool: None,
                    sampler: Sampler::FirstN,
                    description: String::new(),
                    system_instruction: None,
                    delimiter: fewshot_delimiter.clone(),
                    gen_prefix: run["gen_prefix"].as_str().map(str::to_owned),
                },
                " ",
            )
            .unwrap(),
            Some(f) => {
                fewshot_delimiter = f["delimiter"].as_str().unwrap().to_owned();
                let fewshot = choices::Fewshot {
                    shots: f["shots"].as_u64().unwrap() as usize,
                    pool: f["file"].as_str().map(|file| {
                        generation::read_generation_docs(&fixtures().join("generation").join(file))
                            .unwrap()
                    }),
                    sampler: match f["sampler"].as_str().unwrap() {
                        "first_n" => Sampler::FirstN,
                        _ => Sampler::Random {
                            seed: f["seed"].as_u64().unwrap(),
                        },
                    },
                    description: f["description"].as_str().unwrap().to_owned(),
                    system_instruction: f["system_instruction"].as_str().map(str::to_owned),
                    delimiter: fewshot_delimiter.clone(),
                    gen_prefix: run["gen_prefix"].as_str().map(str::to_owned),
                };
                choices::fewshot_turns(&docs, &fewshot, " ").unwrap()
            }
        };
        let template = run
            .get("fewshot")
            .and_then(|f| f.get("chat"))
            .map(|_| tok.chat_template().unwrap().unwrap());
        let format = match (&template, run.get("fewshot").and_then(|f| f.get("chat"))) {
            (Some(template), Some(chat)) => choices::PromptFormat::Chat {
                template,
                multiturn: chat["multiturn"].as_bool().unwrap(),
                extra: &[],
            },
            _ => choices::PromptFormat::Plain,
        };
        let contexts: Vec<String> = turns
            .iter()
            .map(|t| choices::render_prompt(t, format).unwrap())
            .collect();
        let want = run["docs"].as_array().unwrap();
        assert_eq!(contexts.len(), want.len(), "{name}");
        for (i, (c, w)) in contexts.iter().zip(want).enumerate() {
            assert_eq!(
                c,
                w["prompt"].as_str().unwrap(),
                "{name} document {i}'s prompt"
            );
        }
        let kwargs = &run["generation_kwargs"];
        // lm-eval's default `until` is the few-shot delimiter.
        let until = kwargs
            .get("until")
            .map(strings)
            .unwrap_or_else(|| vec![fewshot_delimiter.clone()]);
        let filters = match &run["filter_list"] {
            serde_json::Value::Null => vec![FilterPipeline::none()],
            list => FilterPipeline::parse_list(list).unwrap(),
        };
        let names: Vec<String> = filters.iter().map(|f| f.name.clone()).collect();
        assert_eq!(names, strings(&run["filters"]), "{name}");
        // Alone, and in batches of 2 and 3 (a shared few-shot start computed once, ragged
        // tails padded): the same texts, answers and aggregates.
        for batch_size in [1, 2, 3] {
            let settings = GenerationSettings {
                until: until.clone(),
                max_gen_toks: kwargs["max_gen_toks"].as_u64().unwrap() as usize,
                stop_tokens: generation::generation_eos_ids(&model_dir).unwrap(),
                filters: filters.clone(),
                metric: metric_of(&run["metric"]),
                corpus_metrics: run
                    .get("corpus_metrics")
                    .map_or_else(Vec::new, strings)
                    .iter()
                    .map(|m| CorpusMetric::named(m).unwrap())
                    .collect(),
                batch_size,
                sampling: sampling_of(run, &model_dir),
                seed: 0,
                repeats: run["repeats"].as_u64().unwrap() as usize,
            };
            assert_eq!(settings.sampling, Sampling::greedy());
            let mut seen = 0;
            let report = generation::evaluate(&model, &tok, &docs, &contexts, &settings, |i, g| {
                let w = &want[i];
                assert_eq!(i, seen, "{name}: documents in order");
                assert_eq!(
                    g.responses,
                    responses_of(w),
                    "{name} document {i}'s texts, batches of {batch_size}"
                );
                for (f, name_f) in names.iter().enumerate() {
                    assert_eq!(
                        g.filtered[f],
                        w["filtered"][name_f].as_str().unwrap(),
                        "{name} document {i}, filter {name_f}"
                    );
                    if let Some(flag) = w["exact_match"].get(name_f) {
                        assert_eq!(
                            g.exact_match[f],
                            flag.as_bool().unwrap(),
                            "{name} document {i}, filter {name_f}'s exact_match"
                        );
                    }
                    // lm-eval reports no exact_match for a run with corpus metrics.
                    if batch_size == 1 && settings.corpus_metrics.is_empty() {
                        right += usize::from(g.exact_match[f]);
                        nonempty_fallbacks += usize::from(g.filtered[f].starts_with('['));
                    }
                }
                // Greedy repeats run once.
                assert!(g.new_tokens <= settings.max_gen_toks);
                assert!(g.prompt_tokens + settings.max_gen_toks <= model.cfg.max_seq);
                assert!(g.reused_tokens < g.prompt_tokens);
                seen += 1;
                Ok(())
            })
            .unwrap();
            assert_eq!(seen, want.len());
            if batch_size == 1 {
                docs_checked += seen;
            }
            // Corpus metrics: sacreBLEU's scores and lm-eval's bootstrap, to the bit.
            assert_eq!(
                report.corpus.len(),
                settings.corpus_metrics.len() * filters.len()
            );
            for c in &report.corpus {
                let metric = c.metric.name();
                assert_eq!(
                    c.score,
                    run["corpus"][metric][&c.filter].as_f64().unwrap(),
                    "{name} {metric},{}",
                    c.filter
                );
                assert_eq!(
                    c.stderr,
                    run["corpus_stderr"][metric][&c.filter].as_f64(),
                    "{name} {metric}_stderr,{}",
                    c.filter
                );
            }
            if run.get("metrics").is_none() {
                continue;
            }
            for (filter, metric) in &report.exact_match {
                let close = |a: f64, b: f64| (a - b).abs() <= 1e-12;
                assert!(
                    close(metric.mean, run["metrics"][filter].as_f64().unwrap()),
                    "{name} {filter}: {} vs lm-eval's {}",
                    metric.mean,
                    run["metrics"][filter]
                );
                assert!(
                    close(
                        metric.stderr.unwrap(),
                        run["stderr"][filter].as_f64().unwrap()
                    ),
                    "{name} {filter}'s stderr"
                );
            }
        }
    }
    // The fixture exercises what it means to: right answers and fallbacks both occur.
    assert_eq!(docs_checked, 77);
    assert!(right >= 5, "{right} right answers");
    assert!(nonempty_fallbacks >= 2);
}

#[test]
fn regexes_run_as_pythons_re_and_lm_evals_filter() {
    let fixture = fixture();
    let cases = fixture["python"]["regex"].as_array().unwrap();
    assert!(cases.len() >= 15);
    for case in cases {
        let pattern = case["pattern"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let regex = PyRegex::new(pattern).unwrap();
        let found: Vec<serde_json::Value> = regex
            .findall(text)
            .unwrap()
            .into_iter()
            .map(|f| match f {
                Found::Whole(s) | Found::Group(s) => s.into(),
                Found::Groups(g) => g.into(),
            })
            .collect();
        assert_eq!(
            serde_json::Value::from(found),
            case["findall"],
            "findall {pattern:?} on {text:?}"
        );
        assert_eq!(
            regex.remove_all(text).unwrap(),
            case["sub"].as_str().unwrap(),
            "sub {pattern:?} on {text:?}"
        );
        for select in [0i64, -1] {
            let filter = FilterPipeline {
                name: "f".into(),
                steps: vec![FilterStep::Regex {
                    regex: regex.clone(),
                    group_select: select,
                    fallback: "[fb]".into(),
                }],
            };
            assert_eq!(
                filter.apply(&[text.to_owned()]).unwrap(),
                case["filtered"][select.to_string()].as_str().unwrap(),
                "RegexFilter {pattern:?} group_select {select} on {text:?}"
            );
        }
    }
    for case in fixture["python"]["exact_match"].as_array().unwrap() {
        let metric = metric_of(&case["kwargs"]);
        assert_eq!(
            metric
                .matches(case["answer"].as_str().unwrap(), &strings(&case["targets"]))
                .unwrap(),
            case["exact_match"].as_bool().unwrap(),
            "{case}"
        );
    }
}

#[test]
fn headroom_eval_generate_prints_lm_evals_metrics_and_samples() {
    let fixture = fixture();
    let run = &fixture["runs"]["llama_zero_shot"];
    let dir = tempfile::tempdir().unwrap();
    let samples = dir.path().join("samples.jsonl");
    let mut args: Vec<String> = vec![
        "eval".into(),
        "--from".into(),
        fixtures().join("hf-llama-gqa-untied").display().to_string(),
        "--tokenizer".into(),
        fixtures()
            .join("choices/llama/tokenizer.json")
            .display()
            .to_string(),
        "--generate".into(),
        fixtures()
            .join("generation/docs.jsonl")
            .display()
            .to_string(),
        "--max-gen-toks".into(),
        run["generation_kwargs"]["max_gen_toks"].to_string(),
        "--filters".into(),
        run["filter_list"].to_string(),
        "--ignore-case".into(),
        "--samples".into(),
        samples.display().to_string(),
    ];
    for u in strings(&run["generation_kwargs"]["until"]) {
        args.extend(["--until".into(), u]);
    }
    for r in strings(&run["metric"]["regexes_to_ignore"]) {
        args.extend(["--regexes-to-ignore".into(), r]);
    }
    let out = common::headroom_command().args(&args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for filter in strings(&run["filters"]) {
        let line = format!("exact_match,{filter}",);
        let printed = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{line} ")))
            .unwrap_or_else(|| panic!("no {line} in {stdout}"));
        let want = format!(
            "{:.4} ± {:.4}",
            run["metrics"][&filter].as_f64().unwrap(),
            run["stderr"][&filter].as_f64().unwrap()
        );
        assert!(printed.ends_with(&want), "{printed} vs {want}");
    }
    // The gsm8k preset: its two filters, its 5 examples (too many for 4 of these documents'
    // pool, which leaves each out of its own) replaced by --num-fewshot.
    let preset_batched = |shots: &str, batch: &str| {
        common::headroom_command()
            .args(&args[..9])
            .args(["--preset", "gsm8k", "--num-fewshot", shots])
            .args(["--batch-size", batch])
            .output()
            .unwrap()
    };
    let preset = |shots: &str| preset_batched(shots, "1");
    let metric_lines = |out: &std::process::Output| -> Vec<String> {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with("exact_match"))
            .map(str::to_owned)
            .collect()
    };
    let out = preset("1");
    // Batched: the same metrics (the fixture's texts are compared batch by batch above).
    let batched = preset_batched("1", "3");
    assert!(batched.status.success());
    assert_eq!(metric_lines(&batched), metric_lines(&out));
    assert_eq!(metric_lines(&out).len(), 2);
    assert!(!preset_batched("1", "0").status.success());
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(printed.contains("exact_match,strict-match "), "{printed}");
    assert!(
        printed.contains("exact_match,flexible-extract "),
        "{printed}"
    );
    let out = preset("8");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("8 few-shot examples from a pool of"));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&samples)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let want = run["docs"].as_array().unwrap();
    assert_eq!(lines.len(), want.len());
    for (got, w) in lines.iter().zip(want) {
        assert_eq!(got["response"], w["response"]);
        assert_eq!(got["filtered"], w["filtered"]);
        assert_eq!(got["exact_match"], w["exact_match"]);
        assert!(got.get("responses").is_none());
    }
    // Self-consistency: the preset's eight examples, its sampler and filters, 8 samples per
    // document in batches of 3; the samples file holds each repeat's text.
    let voted = dir.path().join("voted.jsonl");
    let self_consistency = |repeats: &str| {
        common::headroom_command()
            .args(&args[..7])
            .args([
                "--preset",
                "gsm8k_cot_self_consistency",
                "--repeats",
                repeats,
            ])
            .args(["--max-gen-toks", "3", "--batch-size", "3", "--samples"])
            .arg(&voted)
            .output()
            .unwrap()
    };
    let out = self_consistency("8");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        printed.contains("8 generations per document, sampling at temperature 0.2, top-k 50"),
        "{printed}"
    );
    for filter in ["score-first", "maj@64", "maj@8"] {
        assert!(
            printed.contains(&format!("exact_match,{filter} ")),
            "{printed}"
        );
    }
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&voted)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), want.len());
    for line in &lines {
        let responses = strings(&line["responses"]);
        assert_eq!(responses.len(), 8);
        assert_eq!(line["response"], responses[0].as_str());
    }
    // Its maj@8 needs 8 repeats.
    let out = self_consistency("4");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("take_first_k 8"));
    // --gen-prefix: lm-eval's texts after the prefix, examples answered with it.
    let run = &fixture["runs"]["llama_gen_prefix"];
    let prefixed = dir.path().join("prefixed.jsonl");
    let out = common::headroom_command()
        .args(&args[..7])
        .args(["--gen-prefix", run["gen_prefix"].as_str().unwrap()])
        .args([
            "--num-fewshot",
            "2",
            "--fewshot-sampler",
            "first-n",
            "--fewshot-file",
        ])
        .arg(fixtures().join("generation/fewshot.jsonl"))
        .args(["--until", "\n", "--max-gen-toks", "5", "--samples"])
        .arg(&prefixed)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&prefixed)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let want = run["docs"].as_array().unwrap();
    assert_eq!(lines.len(), want.len());
    for (got, w) in lines.iter().zip(want) {
        assert_eq!(got["response"], w["response"]);
    }
}

/// `headroom eval --generate docs` with the Llama fixture model and tokenizer.
fn llama_generate(docs: &std::path::Path) -> std::process::Command {
    let mut command = common::headroom_command();
    command
        .args(["eval", "--from"])
        .arg(fixtures().join("hf-llama-gqa-untied"))
        .arg("--tokenizer")
        .arg(fixtures().join("choices/llama/tokenizer.json"))
        .arg("--generate")
        .arg(docs);
    command
}

/// A pipeline's steps in words, to compare two.
fn described(filters: &[FilterPipeline]) -> Vec<(String, Vec<String>)> {
    filters
        .iter()
        .map(|f| {
            let steps = f
                .steps
                .iter()
                .map(|s| match s {
                    FilterStep::Regex {
                        regex,
                        group_select,
                        fallback,
                    } => format!("regex {:?} {group_select} {fallback:?}", regex.pattern()),
                    other => format!("{other:?}"),
                })
                .collect();
            (f.name.clone(), steps)
        })
        .collect()
}

/// A preset's stop strings, sampling switch, filters, exact_match settings and shots against
/// lm-eval's task as the fixture holds it.
fn assert_preset_is_lm_evals(preset: &TaskPreset, want: &serde_json::Value) {
    assert_eq!(preset.until, strings(&want["until"]));
    assert_eq!(preset.do_sample, want["do_sample"].as_bool());
    assert_eq!(
        described(&preset.filters),
        described(&FilterPipeline::parse_list(&want["filter_list"]).unwrap())
    );
    let metric = metric_of(&want["metric"]);
    let patterns = |m: &ExactMatch| -> Vec<String> {
        m.regexes_to_ignore
            .iter()
            .map(|r| r.pattern().to_owned())
            .collect()
    };
    assert_eq!(patterns(&preset.metric), patterns(&metric));
    assert_eq!(
        (
            preset.metric.ignore_case,
            preset.metric.ignore_punctuation,
            preset.metric.ignore_numbers
        ),
        (
            metric.ignore_case,
            metric.ignore_punctuation,
            metric.ignore_numbers
        )
    );
    assert_eq!(
        preset.num_fewshot as u64,
        want["num_fewshot"].as_u64().unwrap()
    );
}

#[test]
fn the_gsm8k_preset_is_lm_evals_gsm8k_task() {
    let fixture = fixture();
    let preset = TaskPreset::named("gsm8k").unwrap();
    assert_preset_is_lm_evals(&preset, &fixture["gsm8k"]);
    assert_eq!(fixture["gsm8k"]["do_sample"], false);
    // A GSM8K answer and a generation in its format.
    let answer = "Natalia sold 48/2 = 24 clips in May.\n#### 72";
    let generated = " She sold 48 + 24 = 72 clips.\n#### 72.\n\n";
    for (filter, right) in preset.filters.iter().zip([true, true]) {
        let got = filter.apply(&[generated.into()]).unwrap();
        assert_eq!(
            preset.metric.matches(&got, &[answer.to_owned()]).unwrap(),
            right,
            "{} took {got:?}",
            filter.name
        );
    }
    assert!(TaskPreset::named("mmlu")
        .unwrap_err()
        .to_string()
        .contains("gsm8k"));
}

#[test]
fn bad_tasks_are_refused_with_the_reason() {
    let list = |steps: serde_json::Value| {
        FilterPipeline::parse_list(&serde_json::json!([{"name": "f", "filter": steps}]))
            .unwrap_err()
            .to_string()
    };
    assert!(list(serde_json::json!([{"function": "regex"}])).contains("no take_first"));
    assert!(
        list(serde_json::json!([{"function": "take_first"}, {"function": "lowercase"}]))
            .contains("after take_first")
    );
    assert!(list(serde_json::json!([{"function": "majority_vote"}])).contains("no take_first"));
    for (k, why) in [
        (
            serde_json::json!({"function": "take_first_k"}),
            "without its k",
        ),
        (
            serde_json::json!({"function": "take_first_k", "k": 0}),
            "≥ 1",
        ),
        (
            serde_json::json!({"function": "take_first_k", "k": "2"}),
            "≥ 1",
        ),
        (
            serde_json::json!({"function": "take_first_k", "k": -1}),
            "≥ 1",
        ),
    ] {
        let e = list(serde_json::json!([k, {"function": "take_first"}]));
        assert!(e.contains(why), "{e}");
    }
    // lm-eval's part-of-speech filter is not one of headroom's.
    assert!(list(serde_json::json!([{"function": "regex_pos"}])).contains("\"regex_pos\""));
    // map: text values only (exact_match compares texts); no entry and no default is an
    // error when met (lm-eval would pass None on).
    assert!(list(serde_json::json!([
        {"function": "map", "mapping_dict": {"A": 1}}, {"function": "take_first"}
    ]))
    .contains("not text"));
    assert!(list(serde_json::json!([
        {"function": "map", "mapping_dict": ["A"]}, {"function": "take_first"}
    ]))
    .contains("not an object"));
    let mapped = FilterPipeline::parse_list(&serde_json::json!([{"name": "m", "filter": [
        {"function": "map", "mapping_dict": {"A": "yes"}}, {"function": "take_first"}]}]))
    .unwrap();
    assert_eq!(mapped[0].apply(&["A".into()]).unwrap(), "yes");
    assert!(mapped[0]
        .apply(&["B".into()])
        .unwrap_err()
        .to_string()
        .contains("no default_value"));
    assert!(list(serde_json::json!([
        {"function": "regex", "regex_pattern": "(unclosed"},
        {"function": "take_first"}
    ]))
    .contains("does not compile"));
    assert!(FilterPipeline::parse_list(&serde_json::json!([]))
        .unwrap_err()
        .to_string()
        .contains("non-empty"));
    // group_select past the matches: Python's IndexError, an error here.
    let pipeline = FilterPipeline::parse_list(&serde_json::json!([{"name": "f", "filter": [
        {"function": "regex", "regex_pattern": "a", "group_select": 3},
        {"function": "take_first"}]}]))
    .unwrap();
    assert!(pipeline[0]
        .apply(&["aa".into()])
        .unwrap_err()
        .to_string()
        .contains("IndexError"));
    for (line, why) in [
        (r#"{"target": "x"}"#, "no \"context\""),
        (r#"{"context": "a"}"#, "no \"target\""),
        (r#"{"context": "a", "target": []}"#, "empty list"),
        (r#"{"context": "a", "target": {"x": 1}}"#, "neither"),
        (r#"{"context": 3, "target": "x"}"#, "not text"),
    ] {
        let e = GenerationDoc::parse(line).unwrap_err();
        assert!(e.contains(why), "{line}: {e}");
    }
    // A number target is its text; a few-shot example shows the first of several.
    let doc = GenerationDoc::parse(r#"{"context": "a", "target": [12, "b"]}"#).unwrap();
    assert_eq!(doc.targets, ["12", "b"]);
    // max_gen_toks must leave the prompt room in the context.
    let model = load_model(&fixtures().join("hf-llama-gqa-untied"), &Cpu::new()).unwrap();
    let tok = llama_tokenizer();
    let settings = GenerationSettings {
        until: vec![],
        max_gen_toks: model.cfg.max_seq,
        stop_tokens: vec![],
        filters: vec![FilterPipeline::none()],
        metric: ExactMatch::default(),
        corpus_metrics: Vec::new(),
        batch_size: 1,
        sampling: Sampling::greedy(),
        seed: 0,
        repeats: 1,
    };
    let refused = |settings: &GenerationSettings| {
        generation::evaluate(
            &model,
            &tok,
            std::slice::from_ref(&doc),
            &["a".to_owned()],
            settings,
            |_, _| Ok(()),
        )
        .unwrap_err()
        .to_string()
    };
    let e = refused(&settings);
    assert!(e.contains("max_gen_toks"), "{e}");
    let e = refused(&GenerationSettings {
        max_gen_toks: 4,
        batch_size: 0,
        ..settings.clone()
    });
    assert!(e.contains("batch size"), "{e}");
    let e = refused(&GenerationSettings {
        max_gen_toks: 4,
        repeats: 0,
        ..settings.clone()
    });
    assert!(e.contains("0 repeats"), "{e}");
    // take_first_k past the repeats: refused before anything runs (lm-eval asserts).
    let voted = FilterPipeline::parse_list(&serde_json::json!([{"name": "maj@3", "filter": [
        {"function": "take_first_k", "k": 3}, {"function": "majority_vote"},
        {"function": "take_first"}]}]))
    .unwrap();
    let e = refused(&GenerationSettings {
        max_gen_toks: 4,
        repeats: 2,
        filters: voted.clone(),
        ..settings.clone()
    });
    assert!(
        e.contains("take_first_k 3") && e.contains("there are 2"),
        "{e}"
    );
    assert!(voted[0]
        .apply(&["a".into(), "b".into()])
        .unwrap_err()
        .to_string()
        .contains("take_first_k 3 of 2"));
    // Sampling at temperature 0 is refused, as transformers refuses it; a temperature alone
    // samples only where the generation config samples.
    let plain = GenerationConfig::default();
    let asked = |t: f32| SamplingRequest {
        temperature: Some(t),
        ..SamplingRequest::default()
    };
    assert!(
        generation::lm_eval_sampling(&plain, Some(true), &SamplingRequest::default())
            .unwrap_err()
            .to_string()
            .contains("temperature 0")
    );
    assert_eq!(
        generation::lm_eval_sampling(&plain, None, &asked(0.5)).unwrap(),
        Sampling::greedy()
    );
    let sampling_config = GenerationConfig {
        do_sample: Some(true),
        top_p: Some(0.9),
        repetition_penalty: Some(1.1),
        ..GenerationConfig::default()
    };
    assert_eq!(
        generation::lm_eval_sampling(&sampling_config, None, &asked(0.5)).unwrap(),
        Sampling {
            temperature: 0.5,
            top_k: Some(50),
            top_p: Some(0.9),
            min_p: None,
            repetition_penalty: Some(1.1),
        }
    );
    // Greedy, the config's repetition penalty still applies (transformers merges it).
    assert_eq!(
        generation::lm_eval_sampling(&sampling_config, Some(false), &asked(0.5)).unwrap(),
        Sampling {
            repetition_penalty: Some(1.1),
            ..Sampling::greedy()
        }
    );
}

#[test]
fn filter_pipelines_run_as_lm_evals() {
    let fixture = fixture();
    let cases = fixture["python"]["filters"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let steps: Vec<serde_json::Value> = case["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|step| {
                let mut f = step[1].as_object().cloned().unwrap_or_default();
                f.insert("function".into(), step[0].clone());
                serde_json::Value::Object(f)
            })
            .collect();
        let pipeline =
            FilterPipeline::parse_list(&serde_json::json!([{"name": "f", "filter": steps}]))
                .unwrap();
        let responses = strings(&case["responses"]);
        assert_eq!(
            pipeline[0].apply(&responses).unwrap(),
            case["answer"].as_str().unwrap(),
            "{case}"
        );
    }
}

#[test]
fn sampled_repeats_are_voted_as_lm_eval() {
    let fixture = fixture();
    let run = &fixture["runs"]["llama_sampled_repeats"];
    let model_dir = fixtures().join(run["model"].as_str().unwrap());
    let filters = FilterPipeline::parse_list(&run["filter_list"]).unwrap();
    let metric = metric_of(&run["metric"]);
    let docs = generation::read_generation_docs(
        &fixtures()
            .join("generation")
            .join(run["docs_file"].as_str().unwrap()),
    )
    .unwrap();
    let want = run["docs"].as_array().unwrap();
    let repeats = run["repeats"].as_u64().unwrap() as usize;
    // lm-eval's own draws through headroom's filters and metric: its answers, flags and
    // aggregates. The majority differs from the first answer somewhere, so voting is tested.
    let mut flags = vec![Vec::new(); filters.len()];
    let mut votes_differ = false;
    for (doc, w) in docs.iter().zip(want) {
        let responses = responses_of(w);
        assert_eq!(responses.len(), repeats);
        let answers: Vec<String> = filters
            .iter()
            .map(|f| f.apply(&responses).unwrap())
            .collect();
        votes_differ |= answers.iter().any(|a| a != &answers[0]);
        for (f, answer) in filters.iter().zip(&answers) {
            assert_eq!(answer, w["filtered"][&f.name].as_str().unwrap());
        }
        for (i, (f, answer)) in filters.iter().zip(&answers).enumerate() {
            let right = metric.matches(answer, &doc.targets).unwrap();
            assert_eq!(right, w["exact_match"][&f.name].as_bool().unwrap());
            flags[i].push(right);
        }
    }
    assert!(votes_differ);
    for (f, flags) in filters.iter().zip(&flags) {
        let m = choices::Metric::of(flags);
        assert!((m.mean - run["metrics"][&f.name].as_f64().unwrap()).abs() < 1e-12);
        assert!((m.stderr.unwrap() - run["stderr"][&f.name].as_f64().unwrap()).abs() < 1e-12);
    }
    // headroom's own draws: transformers' sampler for these settings, each (document, repeat)
    // its own generator, so the texts do not depend on the batch size or order; a repeat's
    // texts differ from another's; another seed draws otherwise.
    let sampling = sampling_of(run, &model_dir);
    assert_eq!(
        sampling,
        Sampling {
            temperature: 0.7,
            top_k: Some(50),
            ..Sampling::default()
        }
    );
    let model = load_model(&model_dir, &Cpu::new()).unwrap();
    let tok = llama_tokenizer();
    let contexts: Vec<String> = docs.iter().map(|d| d.context.clone()).collect();
    let generate = |batch_size: usize, seed: u64| {
        let settings = GenerationSettings {
            until: strings(&run["generation_kwargs"]["until"]),
            max_gen_toks: run["generation_kwargs"]["max_gen_toks"].as_u64().unwrap() as usize,
            stop_tokens: generation::generation_eos_ids(&model_dir).unwrap(),
            filters: filters.clone(),
            metric: metric.clone(),
            corpus_metrics: Vec::new(),
            batch_size,
            sampling,
            seed,
            repeats,
        };
        let mut texts = Vec::new();
        let report = generation::evaluate(&model, &tok, &docs, &contexts, &settings, |_, g| {
            assert_eq!(g.responses.len(), repeats);
            texts.push(g.responses.clone());
            Ok(())
        })
        .unwrap();
        assert_eq!(report.documents, docs.len());
        texts
    };
    let alone = generate(1, 7);
    assert!(alone
        .iter()
        .all(|doc| doc.iter().any(|t| t != &doc[0]) || doc.iter().all(String::is_empty)));
    for batch_size in [2, 3, 7] {
        assert_eq!(generate(batch_size, 7), alone, "batches of {batch_size}");
    }
    assert_ne!(generate(1, 8), alone);
}

#[test]
fn the_self_consistency_preset_is_lm_evals_task() {
    let fixture = fixture();
    let want = &fixture["gsm8k_cot_self_consistency"];
    let preset = TaskPreset::named("gsm8k_cot_self_consistency").unwrap();
    assert_preset_is_lm_evals(&preset, want);
    assert_eq!(
        preset.temperature.map(f64::from),
        want["temperature"].as_f64().map(|t| t as f32 as f64)
    );
    assert_eq!(preset.repeats as u64, want["repeats"].as_u64().unwrap());
    // Its examples: `doc_to_text` of each sample, and its target, in order (`first_n`).
    assert_eq!(want["fewshot_sampler"], "first_n");
    assert_eq!(want["doc_to_text"], "Q: {{question}}\nA:");
    assert_eq!(want["target_delimiter"], " ");
    assert_eq!(want["fewshot_delimiter"], "\n\n");
    let examples = preset.examples.as_ref().unwrap();
    let samples = want["fewshot_samples"].as_array().unwrap();
    assert_eq!(examples.len(), samples.len());
    for (e, s) in examples.iter().zip(samples) {
        assert_eq!(
            e.context,
            format!("Q: {}\nA:", s["question"].as_str().unwrap())
        );
        assert_eq!(e.targets, [s["target"].as_str().unwrap()]);
    }
    // A chain of thought, voted: 2 of 3 say 72.
    let responses: Vec<String> = [
        " She sold 24 in May. The answer is 72.",
        " The answer is 70.",
        " 48 + 24 = 72. The answer is 72.\n",
    ]
    .map(str::to_owned)
    .to_vec();
    let mut three = preset.filters.clone();
    for f in &mut three {
        for step in &mut f.steps {
            if let FilterStep::TakeFirstK(k) = step {
                *k = 3;
            }
        }
    }
    let answers: Vec<String> = three.iter().map(|f| f.apply(&responses).unwrap()).collect();
    assert_eq!(answers, ["72", "72", "72"]);
    let tie: Vec<String> = [" The answer is 70.", "The answer is 72.", "x"]
        .map(str::to_owned)
        .to_vec();
    let answers: Vec<String> = three.iter().map(|f| f.apply(&tie).unwrap()).collect();
    assert_eq!(answers, ["70", "70", "70"]);
    assert!(preset
        .metric
        .matches("72", &["#### 72".to_owned()])
        .unwrap());
}

/// A `multi_choice_regex` step with `kwargs` (lm-eval's arguments), then `take_first`.
fn multi_choice_pipeline(kwargs: &serde_json::Value) -> FilterPipeline {
    let mut step = kwargs.as_object().cloned().unwrap_or_default();
    step.insert("function".into(), "multi_choice_regex".into());
    FilterPipeline::parse_list(&serde_json::json!([{"name": "mc", "filter": [
        serde_json::Value::Object(step), {"function": "take_first"}]}]))
    .unwrap()
    .remove(0)
}

#[test]
fn multi_choice_regex_runs_as_lm_evals() {
    let fixture = fixture();
    let cases = fixture["python"]["multi_choice"].as_array().unwrap();
    assert!(cases.len() >= 10);
    let mut by_stage = [0usize; 3];
    for case in cases {
        let pipeline = multi_choice_pipeline(&case["kwargs"]);
        let doc = match &case["choices"] {
            serde_json::Value::Null => serde_json::json!({}),
            choices => serde_json::json!({ "choices": choices }),
        };
        let answers: headroom_trainer::Result<Vec<String>> = strings(&case["responses"])
            .iter()
            .map(|r| pipeline.apply_to(std::slice::from_ref(r), &doc))
            .collect();
        match case.get("error").and_then(|e| e.as_str()) {
            None => {
                let answers = answers.unwrap_or_else(|e| panic!("{case}: {e}"));
                assert_eq!(answers, strings(&case["answers"]), "{case}");
                for a in &answers {
                    // A letter (the regex's, or a choice's), the fallback, or a text the
                    // regex found that names no choice.
                    let fallback = case["kwargs"]["fallback"].as_str().unwrap_or("[invalid]");
                    by_stage[if a.len() == 3 && a.starts_with('(') {
                        0
                    } else if a == fallback {
                        1
                    } else {
                        2
                    }] += 1;
                }
            }
            Some(error) => {
                let why = answers.unwrap_err().to_string();
                let expected = match error {
                    "IndexError" => "IndexError",
                    "KeyError" => "\"choices\"",
                    other => panic!("{other}"),
                };
                assert!(why.contains(expected), "{case}: {why}");
            }
        }
    }
    assert!(by_stage.iter().all(|&n| n >= 4), "{by_stage:?}");
}

#[test]
fn bad_multi_choice_regex_steps_and_documents_are_refused() {
    let refused = |kwargs: serde_json::Value| {
        let mut step = kwargs.as_object().cloned().unwrap();
        step.insert("function".into(), "multi_choice_regex".into());
        FilterPipeline::parse_list(&serde_json::json!([{"name": "mc", "filter": [
            serde_json::Value::Object(step), {"function": "take_first"}]}]))
        .unwrap_err()
        .to_string()
    };
    assert!(refused(serde_json::json!({"ignore_case": "yes"})).contains("ignore_case"));
    assert!(refused(serde_json::json!({"regexes_to_ignore": "x"})).contains("not a list"));
    assert!(refused(serde_json::json!({"regexes_to_ignore": [1]})).contains("not text"));
    assert!(refused(serde_json::json!({"regex_pattern": "("})).contains("does not compile"));
    assert!(refused(serde_json::json!({"group_select": 0.5})).contains("group_select"));
    let pipeline = multi_choice_pipeline(&serde_json::json!({}));
    let answer = |doc: serde_json::Value| pipeline.apply_to(&["a B".into()], &doc);
    // No document fields at all: apply() has none to give.
    assert!(pipeline
        .apply(&["a".into()])
        .unwrap_err()
        .to_string()
        .contains("\"choices\""));
    assert!(answer(serde_json::json!({"choices": "ab"}))
        .unwrap_err()
        .to_string()
        .contains("\"choices\""));
    assert!(answer(serde_json::json!({"choices": ["a", 2]}))
        .unwrap_err()
        .to_string()
        .contains("choice 1 is not text"));
    let letters: Vec<String> = (0..27).map(|i| format!("choice {i}")).collect();
    assert!(answer(serde_json::json!({ "choices": letters }))
        .unwrap_err()
        .to_string()
        .contains("at most 26"));
    // 26 are lettered A to Z.
    let mut letters = letters;
    letters.truncate(26);
    letters[25] = "zed".into();
    assert_eq!(
        answer(serde_json::json!({ "choices": letters })).unwrap(),
        "[invalid]"
    );
    assert_eq!(
        pipeline
            .apply_to(
                &["it is zed".into()],
                &serde_json::json!({ "choices": letters })
            )
            .unwrap(),
        "(Z)"
    );
}

#[test]
fn the_chain_of_thought_multiple_choice_presets_are_lm_evals_tasks() {
    let fixture = fixture();
    let tasks = fixture["multi_choice_tasks"].as_object().unwrap();
    assert_eq!(tasks.len(), 4);
    for (name, want) in tasks {
        let preset = TaskPreset::named(name).unwrap();
        assert_preset_is_lm_evals(&preset, want);
        assert_eq!(want["do_sample"], false, "{name}");
        assert_eq!(want["temperature"], 0.0, "{name}");
        assert_eq!(preset.repeats, 1);
        assert!(preset.examples.is_none());
        // A chain of thought that ends with the letter, one that names the choice's text,
        // and one that states neither.
        let doc = serde_json::json!({"choices": ["Paris", "London", "Rome", "Berlin"]});
        let target = ["(B)".to_owned()];
        for (response, strict, flexible) in [
            (" London is the capital, so the answer is (B).", true, true),
            (
                " Well, London. I think (C) is wrong; The answer is (B).",
                true,
                true,
            ),
            (" It must be london!", false, true),
            (" It must be Rome.", false, false),
            (" No idea.", false, false),
        ] {
            let right: Vec<bool> = preset
                .filters
                .iter()
                .map(|f| {
                    let answer = f.apply_to(&[response.to_owned()], &doc).unwrap();
                    preset.metric.matches(&answer, &target).unwrap()
                })
                .collect();
            let strict = strict && (name.starts_with("mmlu") || response.contains("The answer"));
            assert_eq!(right, [strict, flexible], "{name}: {response:?}");
        }
    }
}

#[test]
fn documents_choices_reach_multi_choice_regex_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let contexts: Vec<String> = std::fs::read_to_string(fixtures().join("generation/docs.jsonl"))
        .unwrap()
        .lines()
        .map(|l| GenerationDoc::parse(l).unwrap().context)
        .collect();
    let dummies = ["qqzz one", "qqzz two", "qqzz three", "qqzz four"];
    let run = |choices: &[Vec<String>], targets: &[&str], name: &str| {
        let docs = dir.path().join(format!("{name}.jsonl"));
        let lines: String = contexts
            .iter()
            .zip(choices)
            .zip(targets)
            .map(|((c, ch), t)| {
                serde_json::json!({"context": c, "target": t, "choices": ch}).to_string() + "\n"
            })
            .collect();
        std::fs::write(&docs, lines).unwrap();
        let samples = dir.path().join(format!("{name}.samples.jsonl"));
        let out = llama_generate(&docs)
            .args(["--preset", "gpqa_main_cot_zeroshot", "--max-gen-toks", "8"])
            .arg("--samples")
            .arg(&samples)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&samples)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        (stdout, lines)
    };
    let dummy: Vec<Vec<String>> = vec![dummies.map(str::to_owned).to_vec(); contexts.len()];
    let (_, first) = run(&dummy, &vec!["(A)"; contexts.len()], "first");
    // Each document whose text holds a word of three letters or more gets it as choice C
    // and the target (C); the others keep choices the model does not write.
    let mut choices = dummy.clone();
    let mut targets = vec!["(A)"; contexts.len()];
    for (i, line) in first.iter().enumerate() {
        let response = line["response"].as_str().unwrap();
        if let Some(word) = response
            .split(|c: char| !c.is_alphanumeric())
            .find(|w| w.chars().count() >= 3)
        {
            choices[i][2] = format!(" {word} ");
            targets[i] = "(C)";
        }
    }
    let lettered = targets.iter().filter(|&&t| t == "(C)").count();
    assert!(lettered >= 3, "{first:?}");
    let (stdout, second) = run(&choices, &targets, "second");
    for (line, target) in second.iter().zip(&targets) {
        let flexible = line["filtered"]["flexible-extract"].as_str().unwrap();
        let want = if *target == "(C)" { "(C)" } else { "[invalid]" };
        assert_eq!(flexible, want, "{line}");
    }
    let printed = stdout
        .lines()
        .find(|l| l.starts_with("exact_match,flexible-extract "))
        .unwrap_or_else(|| panic!("{stdout}"));
    let mean = lettered as f64 / contexts.len() as f64;
    assert!(
        printed.contains(&format!("{mean:.4} ±")),
        "{printed} vs {mean}"
    );
    // Documents without choices are refused, naming the document and the field.
    let docs = dir.path().join("bare.jsonl");
    std::fs::write(&docs, "{\"context\": \"a red\", \"target\": \"(A)\"}\n").unwrap();
    let out = llama_generate(&docs)
        .args(["--preset", "mmlu_flan_cot_zeroshot", "--max-gen-toks", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("document 1") && stderr.contains("\"choices\""),
        "{stderr}"
    );
}

#[test]
fn corpus_metrics_print_lm_evals_scores_from_the_command_line() {
    let fixture = fixture();
    let run = &fixture["runs"]["llama_translation"];
    assert_eq!(run["model"], "hf-llama-gqa-untied");
    let eval = |docs: &std::path::Path, metrics: &[&str]| {
        let mut command = llama_generate(docs);
        command
            .args(["--until", "\n", "--max-gen-toks"])
            .arg(run["generation_kwargs"]["max_gen_toks"].to_string())
            .arg("--filters")
            .arg(run["filter_list"].to_string())
            .args(["--batch-size", "3"]);
        for m in metrics {
            command.args(["--metric", m]);
        }
        command.output().unwrap()
    };
    let docs = fixtures().join("generation/translation.jsonl");
    let metrics = strings(&run["corpus_metrics"]);
    let out = eval(
        &docs,
        &metrics.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = 0;
    for metric in &metrics {
        for filter in strings(&run["filters"]) {
            let label = format!("{metric},{filter} ");
            let printed = stdout
                .lines()
                .find(|l| l.starts_with(&label))
                .unwrap_or_else(|| panic!("no {label} in {stdout}"));
            let want = format!(
                "{:.4} ± {:.4}",
                run["corpus"][metric][&filter].as_f64().unwrap(),
                run["corpus_stderr"][metric][&filter].as_f64().unwrap()
            );
            assert!(printed.ends_with(&want), "{printed} vs {want}");
            lines += 1;
        }
    }
    assert_eq!(lines, 8);
    assert!(!stdout.contains("exact_match"), "{stdout}");
    // exact_match asked for too.
    let out = eval(&docs, &["exact_match", "bleu"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(stdout.contains("exact_match,none "), "{stdout}");
    assert!(stdout.contains("bleu,first-words "), "{stdout}");
    assert!(!stdout.contains("chrf"), "{stdout}");
    // The wmt16-de-en preset: the same stop string, BLEU, TER and chrF, no exact_match.
    let out = llama_generate(&docs)
        .args(["--preset", "wmt16-de-en", "--max-gen-toks"])
        .arg(run["generation_kwargs"]["max_gen_toks"].to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let printed: Vec<&str> = stdout.lines().filter(|l| l.contains(",none ")).collect();
    assert_eq!(printed.len(), 3, "{stdout}");
    for (line, metric) in printed.iter().zip(["bleu", "ter", "chrf"]) {
        let want = format!(
            "{:.4} ± {:.4}",
            run["corpus"][metric]["none"].as_f64().unwrap(),
            run["corpus_stderr"][metric]["none"].as_f64().unwrap()
        );
        assert!(
            line.starts_with(&format!("{metric},none ")) && line.ends_with(&want),
            "{line} vs {want}"
        );
    }
    // An unknown metric, and a list of targets, are refused before anything runs.
    let out = eval(&docs, &["meteor"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no corpus metric \"meteor\""));
    let dir = tempfile::tempdir().unwrap();
    let listed = dir.path().join("listed.jsonl");
    std::fs::write(
        &listed,
        "{\"context\": \"a red\", \"target\": \"x\"}\n\
         {\"context\": \"the cat\", \"target\": [\"y\", \"z\"]}\n",
    )
    .unwrap();
    let out = eval(&listed, &["chrf"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("document 2") && stderr.contains("one reference"),
        "{stderr}"
    );
}

#[test]
fn the_translation_presets_are_lm_evals_tasks() {
    let fixture = fixture();
    let tasks = fixture["translation_tasks"].as_object().unwrap();
    assert_eq!(tasks.len(), generation::TRANSLATION_TASKS.len());
    for (name, want) in tasks {
        let preset = TaskPreset::named(name).unwrap();
        assert_eq!(preset.until, strings(&want["until"]), "{name}");
        assert_eq!(want["do_sample"], false);
        assert_eq!(preset.do_sample, Some(false));
        assert_eq!(want["temperature"], 0.0);
        let metrics: Vec<&str> = preset.corpus_metrics.iter().map(|m| m.name()).collect();
        assert_eq!(metrics, strings(&want["metrics"]), "{name}");
        assert!(!preset.exact_match);
        assert_eq!(
            preset.num_fewshot as u64,
            want["num_fewshot"].as_u64().unwrap()
        );
        assert_eq!(preset.repeats as u64, want["repeats"].as_u64().unwrap());
        // No filter_list: lm-eval's `none` (take_first).
        assert!(want["filter_list"].is_null());
        assert_eq!(
            described(&preset.filters),
            described(&[FilterPipeline::none()])
        );
    }
}

#[test]
fn the_open_question_presets_are_lm_evals_tasks() {
    let fixture = fixture();
    let tasks = fixture["open_qa_tasks"].as_object().unwrap();
    assert_eq!(tasks.len(), 2);
    for (name, want) in tasks {
        let preset = TaskPreset::named(name).unwrap();
        assert_preset_is_lm_evals(&preset, want);
        assert_eq!(want["do_sample"], false);
        assert_eq!(preset.description.as_deref(), want["description"].as_str());
        assert_eq!(
            preset.fewshot_delimiter.as_deref().unwrap_or("\n\n"),
            want["fewshot_delimiter"].as_str().unwrap()
        );
        assert_eq!(want["target_delimiter"], " ");
        assert!(preset.exact_match && preset.corpus_metrics.is_empty());
        // Answers cut at the stop strings, stripped, compared without case and punctuation
        // (and articles in nq_open).
        let filter = &preset.filters[0];
        let right = |response: &str, targets: &[&str]| {
            let answer = filter.apply(&[response.to_owned()]).unwrap();
            let targets: Vec<String> = targets.iter().map(|t| t.to_string()).collect();
            preset.metric.matches(&answer, &targets).unwrap()
        };
        assert!(right(" PARIS! ", &["Paris", "Paris, France"]));
        assert!(!right(" Lyon", &["Paris"]));
        assert_eq!(
            right(" The Eiffel Tower", &["Eiffel Tower"]),
            name == "nq_open",
            "{name}"
        );
    }
}

#[test]
fn a_presets_description_and_delimiter_reach_the_prompt_unless_given() {
    let dir = tempfile::tempdir().unwrap();
    // Short documents, so that a prompt with an example fits the fixture model's context.
    let docs = dir.path().join("short.jsonl");
    std::fs::write(
        &docs,
        "{\"context\": \"a red\", \"target\": \"x\"}\n\
         {\"context\": \"the cat\", \"target\": [\"y\", \"z\"]}\n\
         {\"context\": \"old dog\", \"target\": \"w\"}\n",
    )
    .unwrap();
    let prompt_lengths = |extra: &[&str]| -> Vec<u64> {
        let samples = dir.path().join("samples.jsonl");
        let out = llama_generate(&docs)
            .args(["--max-gen-toks", "2", "--samples"])
            .arg(&samples)
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read_to_string(&samples)
            .unwrap()
            .lines()
            .map(|l| {
                let line: serde_json::Value = serde_json::from_str(l).unwrap();
                line["prompt_tokens"].as_u64().unwrap()
            })
            .collect()
    };
    let plain = prompt_lengths(&["--preset", "triviaqa"]);
    let described = prompt_lengths(&["--preset", "nq_open"]);
    // "Answer these questions:\n\n" before each prompt.
    assert!(
        plain.iter().zip(&described).all(|(p, d)| d > p),
        "{plain:?} {described:?}"
    );
    assert_eq!(
        prompt_lengths(&["--preset", "nq_open", "--description", ""]),
        plain
    );
    // One example: nq_open's "\n" after it, unless another delimiter is given (newlines are
    // byte tokens to this tokenizer; no description, so that the prompt fits the context).
    let shot = |delimiter: Option<&str>| {
        let mut args = vec![
            "--preset",
            "nq_open",
            "--description",
            "",
            "--num-fewshot",
            "1",
        ];
        args.extend(["--fewshot-sampler", "first-n"]);
        if let Some(d) = delimiter {
            args.extend(["--fewshot-delimiter", d]);
        }
        prompt_lengths(&args)
    };
    let (preset, one, four) = (shot(None), shot(Some("\n")), shot(Some("\n\n\n\n")));
    assert_eq!(preset, one);
    assert!(
        one.iter().zip(&four).all(|(o, f)| f > o),
        "{one:?} {four:?}"
    );
}

#[test]
fn the_gsm8k_chain_of_thought_presets_are_lm_evals_tasks() {
    let fixture = fixture();
    let tasks = fixture["gsm8k_cot_tasks"].as_object().unwrap();
    assert_eq!(tasks.len(), 2);
    for (name, want) in tasks {
        let preset = TaskPreset::named(name).unwrap();
        assert_preset_is_lm_evals(&preset, want);
        assert_eq!(want["do_sample"], false);
        assert_eq!(preset.repeats as u64, want["repeats"].as_u64().unwrap());
        match (&preset.examples, want["fewshot_config"].get("samples")) {
            (None, None) => assert_eq!(name, "gsm8k_cot_zeroshot"),
            (Some(examples), Some(samples)) => {
                assert_eq!(want["fewshot_config"]["sampler"], "first_n");
                assert_eq!(want["doc_to_text"], "Q: {{question}}\nA:");
                let samples = samples.as_array().unwrap();
                assert_eq!(examples.len(), samples.len());
                for (e, s) in examples.iter().zip(samples) {
                    assert_eq!(
                        e.context,
                        format!("Q: {}\nA:", s["question"].as_str().unwrap())
                    );
                    assert_eq!(e.targets, [s["target"].as_str().unwrap()]);
                }
            }
            (e, s) => panic!("{name}: examples {e:?} against {s:?}"),
        }
        // A chain of thought ending as the examples end.
        let answers: Vec<String> = preset
            .filters
            .iter()
            .map(|f| f.apply(&[" 48 / 2 = 24. 48 + 24 = 72. The answer is 72.\n".into()]))
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(answers, ["72", "72."]);
        for a in &answers {
            assert!(preset.metric.matches(a, &["#### 72".to_owned()]).unwrap());
        }
    }
}

#[test]
fn each_mmlu_subjects_preset_is_the_template_with_its_description() {
    let fixture = fixture();
    let subjects = fixture["mmlu_flan_cot_subjects"].as_object().unwrap();
    assert_eq!(subjects.len(), generation::MMLU_SUBJECTS.len());
    let template = TaskPreset::named("mmlu_flan_cot_zeroshot").unwrap();
    assert_eq!(template.description, None);
    for (name, want) in subjects {
        assert_eq!(want["template_otherwise"], true, "{name}");
        let preset = TaskPreset::named(name).unwrap();
        assert_eq!(
            preset.description.as_deref(),
            want["description"].as_str(),
            "{name}"
        );
        assert_eq!(preset.until, template.until);
        assert_eq!(described(&preset.filters), described(&template.filters));
        assert_eq!(preset.num_fewshot, template.num_fewshot);
    }
    let e = TaskPreset::named("mmlu_flan_cot_zeroshot_cooking")
        .unwrap_err()
        .to_string();
    assert!(e.contains("57 subjects"), "{e}");
}

/// Each preset's `doc_to_text` and `doc_to_target` are its lm-eval task's, as the fixtures
/// read them from lm-eval's YAML (GPQA's documents come out of Python preprocessing, so its
/// presets have none).
#[test]
fn presets_carry_their_tasks_doc_templates() {
    use headroom_trainer::doc_template::Setting;
    let fixture = fixture();
    let template = |s: &Option<Setting>| match s {
        Some(Setting::Template(t)) => Some(t.clone()),
        Some(other) => panic!("{other:?}"),
        None => None,
    };
    let mut checked = 0;
    for group in [
        "multi_choice_tasks",
        "gsm8k_cot_tasks",
        "open_qa_tasks",
        "translation_tasks",
    ] {
        for (name, want) in fixture[group].as_object().unwrap() {
            let preset = TaskPreset::named(name).unwrap();
            if name.starts_with("gpqa") {
                assert_eq!((&preset.doc_to_text, &preset.doc_to_target), (&None, &None));
                continue;
            }
            assert_eq!(
                template(&preset.doc_to_text).as_deref(),
                want["doc_to_text"].as_str(),
                "{name}"
            );
            assert_eq!(
                template(&preset.doc_to_target).as_deref(),
                want["doc_to_target"].as_str(),
                "{name}"
            );
            checked += 1;
        }
    }
    let consistency = TaskPreset::named("gsm8k_cot_self_consistency").unwrap();
    assert_eq!(
        template(&consistency.doc_to_text).as_deref(),
        fixture["gsm8k_cot_self_consistency"]["doc_to_text"].as_str()
    );
    assert_eq!(
        consistency.doc_to_target,
        TaskPreset::named("gsm8k_cot").unwrap().doc_to_target
    );
    // gsm8k's own, from the templates fixture (lm_eval/tasks/gsm8k/gsm8k.yaml).
    let templates: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("doc_templates.json")).unwrap(),
    )
    .unwrap();
    let gsm8k = templates["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "gsm8k")
        .unwrap();
    let preset = TaskPreset::named("gsm8k").unwrap();
    assert_eq!(
        template(&preset.doc_to_text).as_deref(),
        gsm8k["doc_to_text"].as_str()
    );
    assert_eq!(
        template(&preset.doc_to_target).as_deref(),
        gsm8k["doc_to_target"].as_str()
    );
    let subject = TaskPreset::named("mmlu_flan_cot_zeroshot_anatomy").unwrap();
    assert_eq!(
        subject.doc_to_text,
        TaskPreset::named("mmlu_flan_cot_zeroshot")
            .unwrap()
            .doc_to_text
    );
    assert!(checked >= 12, "{checked}");
}

/// GSM8K's own rows (`question`, `answer`) under `--preset gsm8k` generate and score as the
/// same documents written as `context` and `target`, five examples drawn from the rows; a
/// row already in headroom's shape is read as it is, and `--doc-to-text` replaces the
/// preset's.
#[test]
fn a_presets_templates_read_a_datasets_rows() {
    let dir = tempfile::tempdir().unwrap();
    let questions = [
        ("what sat on the mat?", "the cat sat.\n#### 1"),
        ("what ran under the old tree?", "a small dog.\n#### 2"),
        ("where did the red bird sleep?", "near a big box.\n#### 3"),
        ("what jumped on the small log?", "the old fox.\n#### 4"),
    ];
    let (mut rows, mut converted) = (String::new(), String::new());
    for (question, answer) in questions {
        rows += &serde_json::json!({"question": question, "answer": answer}).to_string();
        rows.push('\n');
        let context = format!("Question: {question}\nAnswer:");
        converted += &serde_json::json!({"context": context, "target": answer}).to_string();
        converted.push('\n');
    }
    // A document already in headroom's shape is read as it is under a preset.
    let shaped = "{\"context\": \"Question: a big dog?\\nAnswer:\", \"target\": \"#### 5\"}\n";
    rows += shaped;
    converted += shaped;
    let rows_file = dir.path().join("rows.jsonl");
    std::fs::write(&rows_file, rows).unwrap();
    let converted_file = dir.path().join("converted.jsonl");
    std::fs::write(&converted_file, converted).unwrap();
    let run = |file: &std::path::Path, extra: &[&str], samples: &str| {
        let samples = dir.path().join(samples);
        let o = llama_generate(file)
            .args([
                "--preset",
                "gsm8k",
                "--num-fewshot",
                "2",
                "--max-gen-toks",
                "8",
            ])
            .args(extra)
            .arg("--samples")
            .arg(&samples)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let lines: Vec<String> = out
            .lines()
            .filter(|l| l.contains('±'))
            .map(String::from)
            .collect();
        (lines, std::fs::read_to_string(samples).unwrap())
    };
    let from_rows = run(&rows_file, &[], "rows.jsonl");
    let from_converted = run(&converted_file, &[], "converted.jsonl");
    assert_eq!(from_rows.0.len(), 2, "{:?}", from_rows.0);
    assert_eq!(from_rows, from_converted);
    // The user's template wins over the preset's, and applies to every document.
    let o = llama_generate(&rows_file)
        .args(["--preset", "gsm8k", "--doc-to-text", "{{missing}}"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("line 1: doc_to_text \"{{missing}}\""));
}
