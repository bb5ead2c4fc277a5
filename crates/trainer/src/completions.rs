//! Single-target evaluation as EleutherAI's lm-evaluation-harness runs its `loglikelihood`
//! tasks (LAMBADA): each document's target scored after its context, `acc` the share of
//! targets that are the model's greedy continuation, and `perplexity` `exp(−mean
//! log-likelihood)` with lm-eval's bootstrap standard error.
//!
//! ```
//! use headroom_trainer::completions::{perplexity, Completion};
//! // LAMBADA's split: the last word (after the last space) is the target.
//! let c = Completion::parse(r#"{"text": "she opened the door"}"#).unwrap();
//! assert_eq!((c.context.as_str(), c.target.as_str()), ("she opened the", " door"));
//! assert!((perplexity(&[-1.0, -3.0]) - 2f64.exp()).abs() < 1e-12);
//! ```
//!
//! A document is one JSON line: `context` and `target` (the target scored as it is, no
//! delimiter before it, as lm-eval's `loglikelihood` requests are), or `text`, split as
//! lm-eval's `lambada_openai` splits it: the context is every word but the last (words split
//! on single spaces), the target a space and the last word. Requests are tokenised and scored
//! as [`crate::choices`] scores a choice ([`crate::choices::request`],
//! [`crate::choices::score_reusing`]).
//!
//! The perplexity's standard error is lm-eval's bootstrap, reproduced draw for draw:
//! [`BOOTSTRAP_ITERS`] replicates in chunks of 1 000, chunk `i` drawing with CPython's
//! `random.Random(i).choices` ([`PyRandom::choices`]), each replicate the perplexity of as
//! many log-likelihoods drawn with replacement, and the standard error their sample standard
//! deviation. The chunks run on every thread; the replicates stay in lm-eval's order.

use std::path::Path;

use crate::choices::{self, Metric, PrefixToken, Scored};
use crate::model::{Model, ModelOps};
use crate::pyrandom::PyRandom;
use crate::sample::PromptCache;
use crate::tokenize::Tokenizer;
use crate::{Result, TrainError};

/// The largest documents file read (LAMBADA's 5 153 test passages are 1.8 MiB as JSONL).
pub const MAX_COMPLETIONS_BYTES: u64 = 1 << 30;

/// lm-eval's `bootstrap_iters` default.
pub const BOOTSTRAP_ITERS: usize = 100_000;

/// One document: the target scored after the context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The text before the target.
    pub context: String,
    /// The text scored (non-empty).
    pub target: String,
}

impl Completion {
    /// A document from its JSON object (`context` and `target`, or `text`); the error says
    /// which field is wrong.
    pub fn parse(line: &str) -> std::result::Result<Completion, String> {
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        let object = value.as_object().ok_or("not a JSON object")?;
        let text = |key: &str| -> std::result::Result<Option<String>, String> {
            match object.get(key) {
                None => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(format!("\"{key}\" is not text")),
            }
        };
        let completion = match (text("context")?, text("target")?, text("text")?) {
            (Some(context), Some(target), _) => Completion { context, target },
            (None, None, Some(text)) => Completion::of_text(&text),
            _ => {
                return Err(
                    "neither \"context\" and \"target\" nor \"text\" (split before its last \
                     word)"
                        .into(),
                )
            }
        };
        if completion.target.is_empty() {
            return Err("the target is empty".into());
        }
        Ok(completion)
    }

    /// `text` split as lm-eval's `lambada_openai` splits it: `text.split(' ')[:-1]` joined
    /// by spaces, then `' ' + text.split(' ')[-1]`.
    pub fn of_text(text: &str) -> Completion {
        let (context, last) = text.rsplit_once(' ').unwrap_or(("", text));
        Completion {
            context: context.to_owned(),
            target: format!(" {last}"),
        }
    }
}

/// The documents of a JSONL file, one per non-blank line; an error names the line.
pub fn read_completions(path: &Path) -> Result<Vec<Completion>> {
    read_completions_with(path, None)
}

/// [`read_completions`], each document first mapped by a task's templates
/// ([`crate::doc_template::DocTemplates::generation_line`]: `context` and `target`) when
/// given.
pub fn read_completions_with(
    path: &Path,
    templates: Option<&crate::doc_template::DocTemplates>,
) -> Result<Vec<Completion>> {
    let map = templates.map(|t| move |doc: &serde_json::Value| t.generation_line(doc));
    choices::read_jsonl_mapped(
        path,
        MAX_COMPLETIONS_BYTES,
        "documents",
        map.as_ref().map(|m| m as choices::LineMap<'_>),
        Completion::parse,
    )
}

/// lm-eval's `perplexity` aggregation: `exp(−mean)` of the log-likelihoods, summed in order.
pub fn perplexity(loglikelihoods: &[f64]) -> f64 {
    (-(loglikelihoods.iter().sum::<f64>() / loglikelihoods.len() as f64)).exp()
}

/// The sample standard deviation (lm-eval's `sample_stddev`); `None` below two values.
fn sample_stddev(xs: &[f64]) -> Option<f64> {
    if xs.len() < 2 {
        return None;
    }
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    let squares: f64 = xs.iter().map(|x| (x - mean) * (x - mean)).sum();
    Some((squares / (xs.len() - 1) as f64).sqrt())
}

/// lm-eval's `bootstrap_stderr` of `statistic` over `xs` with `iters` replicates (see the
/// module's documentation); `None` for fewer than two values (lm-eval reports `N/A`) or no
/// replicates.
pub fn bootstrap_stderr(
    xs: &[f64],
    iters: usize,
    statistic: impl Fn(&[f64]) -> f64 + Sync,
) -> Option<f64> {
    bootstrap_stderr_of(xs.len(), iters, |drawn: &[usize]| {
        let values: Vec<f64> = drawn.iter().map(|&j| xs[j]).collect();
        statistic(&values)
    })
}

/// [`bootstrap_stderr`] over `n` items of any kind: `statistic` gets each resample as the
/// drawn items' indices (a corpus metric sums their statistics).
pub fn bootstrap_stderr_of(
    n: usize,
    iters: usize,
    statistic: impl Fn(&[usize]) -> f64 + Sync,
) -> Option<f64> {
    use rayon::prelude::*;
    if n < 2 || iters == 0 {
        return None;
    }
    let chunk = iters.min(1000);
    let chunks: Vec<Vec<f64>> = (0..iters / chunk)
        .into_par_iter()
        .map(|i| {
            let mut rng = PyRandom::new(i as u64);
            (0..chunk).map(|_| statistic(&rng.choices(n, n))).collect()
        })
        .collect();
    sample_stddev(&chunks.concat())
}

/// A run's metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct CompletionsReport {
    /// Documents.
    pub documents: usize,
    /// Target tokens scored.
    pub tokens: u64,
    /// The target is the greedy continuation.
    pub acc: Metric,
    /// `exp(−mean log-likelihood)`.
    pub perplexity: f64,
    /// Its bootstrap standard error.
    pub perplexity_stderr: Option<f64>,
}

/// Score every document, calling `each` with each document's index and score as it is done.
pub fn evaluate<B: ModelOps>(
    model: &Model<B>,
    tok: &Tokenizer,
    documents: &[Completion],
    mut each: impl FnMut(usize, &Scored) -> Result<()>,
) -> Result<CompletionsReport> {
    if documents.is_empty() {
        return Err(TrainError::Input("no documents".into()));
    }
    let prefix = PrefixToken::of(tok)?;
    let mut kept = PromptCache::new();
    let (mut loglikelihoods, mut greedy) = (Vec::new(), Vec::new());
    let mut tokens = 0u64;
    for (i, d) in documents.iter().enumerate() {
        let request = choices::request(tok, prefix.as_ref(), &d.context, &d.target)
            .map_err(|e| TrainError::Input(format!("document {}: {e}", i + 1)))?;
        tokens += request.continuation.len() as u64;
        let (scores, _) = choices::score_reusing(model, &[request], &mut kept)?;
        let score = scores
            .into_iter()
            .next()
            .ok_or_else(|| TrainError::Input(format!("document {}: nothing scored", i + 1)))?;
        each(i, &score)?;
        loglikelihoods.push(score.loglikelihood);
        greedy.push(score.is_greedy);
    }
    Ok(CompletionsReport {
        documents: documents.len(),
        tokens,
        acc: Metric::of(&greedy),
        perplexity: perplexity(&loglikelihoods),
        perplexity_stderr: bootstrap_stderr(&loglikelihoods, BOOTSTRAP_ITERS, perplexity),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_parse_or_say_what_is_wrong() {
        let c = Completion::parse(r#"{"context": "a b", "target": "c"}"#).unwrap();
        assert_eq!((c.context.as_str(), c.target.as_str()), ("a b", "c"));
        // Python's split(' '): single spaces, so a double space leaves an empty word.
        let c = Completion::of_text("a  b");
        assert_eq!((c.context.as_str(), c.target.as_str()), ("a ", " b"));
        let c = Completion::of_text("word");
        assert_eq!((c.context.as_str(), c.target.as_str()), ("", " word"));
        for (line, why) in [
            (r#"{"context": "a"}"#, "neither"),
            (
                r#"{"context": 1, "target": "b"}"#,
                "\"context\" is not text",
            ),
            (r#"{"context": "a", "target": ""}"#, "empty"),
            (r#"{"text": 5}"#, "\"text\" is not text"),
            ("[1]", "not a JSON object"),
            ("{", "not JSON"),
        ] {
            let e = Completion::parse(line).unwrap_err();
            assert!(e.contains(why), "{line}: {e}");
        }
    }

    proptest::proptest! {
        /// The bootstrap's replicates are perplexities of values drawn from the input, so the
        /// standard error is zero for equal values and bounded by the spread otherwise; it is
        /// deterministic and independent of how the chunks were split over threads.
        #[test]
        fn the_bootstrap_is_deterministic_and_bounded(
            xs in proptest::collection::vec(-8.0f64..0.0, 2..40),
            iters in 1usize..3000,
        ) {
            let a = bootstrap_stderr(&xs, iters, perplexity);
            proptest::prop_assert_eq!(a, bootstrap_stderr(&xs, iters, perplexity));
            let chunk = iters.min(1000);
            let replicates = (iters / chunk) * chunk;
            match a {
                None => proptest::prop_assert!(replicates < 2),
                Some(se) => {
                    let (lo, hi) = xs.iter().fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
                    proptest::prop_assert!(se >= 0.0 && se <= (-lo).exp() - (-hi).exp() + 1e-12);
                }
            }
            let same = vec![xs[0]; xs.len()];
            if let Some(se) = bootstrap_stderr(&same, iters, perplexity) {
                // Equal replicates: only the rounding of their mean is left.
                proptest::prop_assert!(se.abs() <= 1e-12 * perplexity(&same));
            }
        }
    }
}
