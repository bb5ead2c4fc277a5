//! sacreBLEU's corpus BLEU, chrF, chrF++ and TER as lm-eval 0.4.13 aggregates them, with its
//! bootstrap standard errors, on hand-made corpora; and the 13a tokenizer
//! (`fixtures/generation/lm_eval_generation.json`, written by
//! `benches/torch/make_generation_fixture.py`).

use std::path::PathBuf;

use headroom_trainer::corpus_metrics::{self, CorpusMetric};

fn fixture() -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/generation/lm_eval_generation.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn the_13a_tokenizer_splits_as_sacrebleus() {
    let fixture = fixture();
    let cases = fixture["corpus_metrics"]["tokenize_13a"]
        .as_array()
        .unwrap();
    assert!(cases.len() >= 3);
    for case in cases {
        assert_eq!(
            corpus_metrics::tokenize_13a(case["text"].as_str().unwrap()),
            strings(&case["tokens"]),
            "{case}"
        );
    }
}

#[test]
fn corpus_scores_and_standard_errors_are_lm_evals() {
    let fixture = fixture();
    let corpora = fixture["corpus_metrics"]["corpora"].as_array().unwrap();
    assert!(corpora.len() >= 6);
    let mut checked_stderr = 0;
    for case in corpora {
        let hyps = strings(&case["hypotheses"]);
        let refs = strings(&case["references"]);
        for metric in [
            CorpusMetric::Bleu,
            CorpusMetric::Chrf,
            CorpusMetric::ChrfPlusPlus,
            CorpusMetric::Ter,
        ] {
            let stats: Vec<Vec<f64>> = hyps
                .iter()
                .zip(&refs)
                .map(|(h, r)| metric.segment(h, std::slice::from_ref(r)).unwrap())
                .collect();
            let want = case[metric.name()].as_f64().unwrap();
            let got = metric.corpus(&stats);
            // The same operations in the same order as sacreBLEU's, and `exp`/`ln` from the
            // C library CPython calls too: equal bits.
            assert!(
                got == want,
                "{} on {hyps:?}: {got} vs {want}",
                metric.name()
            );
            match case.get(format!("{}_stderr", metric.name())) {
                Some(w) => {
                    let want = w.as_f64().unwrap();
                    let got = metric.stderr(&stats).unwrap();
                    assert!(
                        got == want,
                        "{} stderr on {hyps:?}: {got} vs {want}",
                        metric.name()
                    );
                    checked_stderr += 1;
                }
                // One document: lm-eval's N/A.
                None if case["bootstrapped"] == true => assert_eq!(metric.stderr(&stats), None),
                None => {}
            }
        }
    }
    assert!(checked_stderr >= 25);
}

#[test]
fn a_perfect_copy_scores_best_and_nothing_in_common_worst() {
    let refs: Vec<String> = ["The cat sat.", "Dogs run, fast!"]
        .map(str::to_owned)
        .to_vec();
    for metric in [
        CorpusMetric::Bleu,
        CorpusMetric::Chrf,
        CorpusMetric::ChrfPlusPlus,
        CorpusMetric::Ter,
    ] {
        // TER counts edits: none for a copy, one per reference word for nothing in common.
        let (best, worst) = if metric == CorpusMetric::Ter {
            (0.0, 100.0)
        } else {
            (100.0, 0.0)
        };
        let same: Vec<Vec<f64>> = refs
            .iter()
            .map(|r| metric.segment(r, std::slice::from_ref(r)).unwrap())
            .collect();
        assert!((metric.corpus(&same) - best).abs() < 1e-9, "{metric:?}");
        let none: Vec<Vec<f64>> = refs
            .iter()
            .map(|r| metric.segment("zq xv", std::slice::from_ref(r)).unwrap())
            .collect();
        assert_eq!(metric.corpus(&none), worst, "{metric:?}");
        assert_eq!(CorpusMetric::named(metric.name()).unwrap(), metric);
    }
    assert!(CorpusMetric::named("meteor")
        .unwrap_err()
        .to_string()
        .contains("bleu"));
}

#[test]
fn texts_too_long_to_score_are_refused_with_the_reason() {
    let long = "word ".repeat(corpus_metrics::MAX_SEGMENT_BYTES / 5 + 1);
    for metric in [CorpusMetric::Bleu, CorpusMetric::Chrf, CorpusMetric::Ter] {
        let e = metric
            .segment(&long, &["a reference".to_owned()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most") && e.contains(metric.name()), "{e}");
        let e = metric
            .segment("a", std::slice::from_ref(&long))
            .unwrap_err()
            .to_string();
        assert!(e.contains("bytes"), "{e}");
        assert!(metric.segment("a", &[]).is_err());
    }
    // 5 000 words against 5 000: within the byte limit, past TER's matrix (BLEU scores it).
    let words = |w: &str| vec![w; 5_000].join(" ");
    let (hyp, reference) = (words("a"), words("b"));
    let e = CorpusMetric::Ter
        .segment(&hyp, std::slice::from_ref(&reference))
        .unwrap_err()
        .to_string();
    assert!(e.contains("edit-distance cells"), "{e}");
    assert!(CorpusMetric::Bleu
        .segment(&hyp, std::slice::from_ref(&reference))
        .is_ok());
}
