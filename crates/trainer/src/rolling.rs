//! Perplexity of whole documents as EleutherAI's lm-evaluation-harness measures it
//! (`loglikelihood_rolling`: WikiText, Pile subsets): each document's log-likelihood over
//! windows of the model's context, and the word perplexity, byte perplexity and bits per byte
//! of all of them.
//!
//! ```
//! use headroom_trainer::rolling::{count_words, windows};
//! // Python's `len(re.split(r"\s+", doc))`: a leading space makes an empty first word.
//! assert_eq!(count_words("two words"), 2);
//! assert_eq!(count_words(" lead"), 2);
//! // Tokens 1..=5 under a context of 3, the first conditioned on the prefix token 0.
//! let w: Vec<_> = windows(&[1, 2, 3, 4, 5], 0, 3).collect();
//! assert_eq!(w[0].context, [0]);
//! assert_eq!(w[0].continuation, [1, 2, 3]);
//! assert_eq!(w[1].context, [2, 3]);
//! assert_eq!(w[1].continuation, [4, 5]);
//! ```
//!
//! A document (a JSON line with its `text`) is tokenised as lm-eval's `HFLM.tok_encode` does,
//! with the tokenizer's own special tokens (a Llama tokenizer's `<s>` starts it, and is
//! scored); its tokens are cut into windows of the model's context, each predicting the tokens
//! the ones before it did not (`get_rolling_token_windows` with a context of one token, then
//! `make_disjoint_window`): the first predicts the first window's tokens after the prefix
//! token (the tokenizer's `bos_token`, else `eos_token`), each later one the next tokens after
//! as many earlier ones as fit. The windows are scored as multiple-choice continuations are
//! ([`crate::choices::score`]). Over all documents: word perplexity `exp(−Σ ll / Σ words)`,
//! byte perplexity `exp(−Σ ll / Σ bytes)`, bits per byte `−Σ ll / Σ bytes / ln 2`, words
//! counted as Python's `len(re.split(r"\s+", text))` and bytes as UTF-8. `tests/choices.rs`
//! checks documents, windows and metrics against lm-eval 0.4.13.
//!
//! WikiText's own rows (a `page` each) are read as lm-eval's `wikitext` task reads them
//! ([`read_wikitext`]): each page detokenized by its `wikitext_detokenizer` and scored, its
//! words and bytes counted on the page as written ([`evaluate_counting`]);
//! `tests/doc_templates.rs` checks the detokenizer against lm-eval's on pages meeting each of
//! its rules.
//!
//! One difference: a document of empty text is an error (lm-eval scores it as no tokens and
//! one word).

use std::path::Path;

use crate::choices::{PrefixToken, Request};
use crate::model::{Model, ModelOps};
use crate::tokenize::Tokenizer;
use crate::{Result, TrainError};

/// The largest documents file read.
pub const MAX_DOCUMENTS_BYTES: u64 = 1 << 30;

/// The texts of a JSONL file of documents, `{"text": …}` one per non-blank line; an error
/// names the line.
pub fn read_documents(path: &Path) -> Result<Vec<String>> {
    crate::choices::read_jsonl(path, MAX_DOCUMENTS_BYTES, "documents", |line| {
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        match value.get("text") {
            Some(serde_json::Value::String(s)) if s.is_empty() => Err("\"text\" is empty".into()),
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(_) => Err("\"text\" is not text".into()),
            None => Err("no \"text\"".into()),
        }
    })
}

/// WikiText's documents (`EleutherAI/wikitext_document_level`'s rows, a `page` each; JSONL or
/// Parquet) as lm-eval's `wikitext` task reads them: each `(detokenized, page)`, the first
/// scored ([`wikitext_detokenize`]), the second counted (its `process_results` counts the
/// page's words and bytes before detokenization).
pub fn read_wikitext(path: &Path) -> Result<Vec<(String, String)>> {
    crate::choices::read_jsonl(path, MAX_DOCUMENTS_BYTES, "pages", |line| {
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        match value.get("page") {
            Some(serde_json::Value::String(page)) => {
                let text = wikitext_detokenize(page).map_err(|e| e.to_string())?;
                if text.is_empty() {
                    return Err("\"page\" is empty".into());
                }
                Ok((text, page.clone()))
            }
            Some(_) => Err("\"page\" is not text".into()),
            None => Err("no \"page\" (WikiText's documents have one)".into()),
        }
    })
}

/// lm-eval's `wikitext_detokenizer` (`tasks/wikitext/preprocess_wikitext.py`), rule for rule
/// in its order: contractions, the `@-@`/`@,@`/`@.@` number separators, spaced punctuation,
/// the insides of brackets and quotes, `= =` headings, the degree sign, spaces around
/// newlines, ` N ` and ` 's`. Its regexes run as Python's `re.sub` runs them (the second
/// rule's replacement is the literal `/'[0-9]/`, as there).
pub fn wikitext_detokenize(page: &str) -> Result<String> {
    use crate::generation::PyRegex;
    enum Rule {
        Replace(&'static str, &'static str),
        Sub(&'static str, &'static str),
    }
    use Rule::{Replace, Sub};
    const RULES: [Rule; 24] = [
        Replace("s '", "s'"),
        Sub(r"/' [0-9]/", r"/'[0-9]/"),
        Replace(" @-@ ", "-"),
        Replace(" @,@ ", ","),
        Replace(" @.@ ", "."),
        Replace(" : ", ": "),
        Replace(" ; ", "; "),
        Replace(" . ", ". "),
        Replace(" ! ", "! "),
        Replace(" ? ", "? "),
        Replace(" , ", ", "),
        Sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)"),
        Sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]"),
        Sub(r"{\s*([^}]*?)\s*}", r"{\1}"),
        Sub(r#"\"\s*([^\"]*?)\s*\""#, r#""\1""#),
        Sub(r"'\s*([^']*?)\s*'", r"'\1'"),
        Replace("= = = =", "===="),
        Replace("= = =", "==="),
        Replace("= =", "=="),
        Replace(" \u{b0} ", "\u{b0}"),
        Replace(" \n", "\n"),
        Replace("\n ", "\n"),
        Replace(" N ", " 1 "),
        Replace(" 's", "'s"),
    ];
    static COMPILED: std::sync::OnceLock<Vec<Option<PyRegex>>> = std::sync::OnceLock::new();
    let compiled = COMPILED.get_or_init(|| {
        RULES
            .iter()
            .map(|r| match r {
                Sub(pattern, _) => {
                    Some(PyRegex::new(pattern).expect("the detokenizer's regexes compile"))
                }
                Replace(..) => None,
            })
            .collect()
    });
    let mut text = page.to_owned();
    for (rule, regex) in RULES.iter().zip(compiled) {
        text = match (rule, regex) {
            (Replace(from, to), _) => text.replace(from, to),
            (Sub(_, repl), Some(regex)) => regex.sub(&text, repl, 0)?,
            (Sub(..), None) => unreachable!("compiled above"),
        };
    }
    Ok(text)
}

/// Python's `len(re.split(r"\s+", text))`: one more than the runs of whitespace (so a
/// leading or trailing run counts an empty word, as there).
pub fn count_words(text: &str) -> usize {
    let mut runs = 0;
    let mut in_run = false;
    for c in text.chars() {
        let space = crate::chat_template::is_python_space(c);
        if space && !in_run {
            runs += 1;
        }
        in_run = space;
    }
    runs + 1
}

/// The disjoint scoring windows of `tokens` under a context of `max_seq` positions (lm-eval's
/// `get_rolling_token_windows(context_len=1)` then `make_disjoint_window`): every token is
/// predicted once.
pub fn windows(tokens: &[u32], prefix: u32, max_seq: usize) -> impl Iterator<Item = Request> + '_ {
    let first = tokens.len().min(max_seq);
    let mut predicted = 0;
    std::iter::from_fn(move || {
        if predicted >= tokens.len() || max_seq == 0 {
            return None;
        }
        if predicted == 0 {
            predicted = first;
            let mut context = vec![prefix];
            context.extend_from_slice(&tokens[..first - 1]);
            // Disjoint: the context keeps what the continuation does not predict.
            context.truncate(context.len() - (first - 1));
            return Some(Request {
                context,
                continuation: tokens[..first].to_vec(),
            });
        }
        let n = (tokens.len() - predicted).min(max_seq);
        let end = predicted + n;
        let input = &tokens[(end - 1).saturating_sub(max_seq)..end - 1];
        predicted = end;
        Some(Request {
            context: input[..input.len() - (n - 1)].to_vec(),
            continuation: tokens[end - n..end].to_vec(),
        })
    })
}

/// Perplexities of a set of documents.
#[derive(Clone, Debug, PartialEq)]
pub struct RollingReport {
    /// Documents.
    pub documents: usize,
    /// Their words ([`count_words`]).
    pub words: u64,
    /// Their UTF-8 bytes.
    pub bytes: u64,
    /// Tokens scored.
    pub tokens: u64,
    /// The sum of the documents' log-likelihoods (nats).
    pub loglikelihood: f64,
    /// `exp(−Σ ll / Σ words)`.
    pub word_perplexity: f64,
    /// `exp(−Σ ll / Σ bytes)`.
    pub byte_perplexity: f64,
    /// `−Σ ll / Σ bytes / ln 2`.
    pub bits_per_byte: f64,
}

/// Score every document, calling `each` with each one's index and log-likelihood.
pub fn evaluate<B: ModelOps>(
    model: &Model<B>,
    tok: &Tokenizer,
    documents: &[String],
    each: impl FnMut(usize, f64) -> Result<()>,
) -> Result<RollingReport> {
    let pairs: Vec<(&str, &str)> = documents.iter().map(|d| (d.as_str(), d.as_str())).collect();
    evaluate_counting(model, tok, &pairs, each)
}

/// [`evaluate`] of `(scored, counted)` pairs: each document's log-likelihood is the scored
/// text's, its words and bytes the counted text's (WikiText's: lm-eval scores the
/// detokenized page and counts the page as it was, [`read_wikitext`]).
pub fn evaluate_counting<B: ModelOps>(
    model: &Model<B>,
    tok: &Tokenizer,
    documents: &[(&str, &str)],
    mut each: impl FnMut(usize, f64) -> Result<()>,
) -> Result<RollingReport> {
    if documents.is_empty() {
        return Err(TrainError::Input("no documents".into()));
    }
    let prefix = PrefixToken::of(tok)?.ok_or_else(|| {
        TrainError::Input(
            "the tokenizer has no bos or eos token for the first window to start from".into(),
        )
    })?;
    let (mut words, mut bytes, mut tokens, mut total) = (0u64, 0u64, 0u64, 0.0f64);
    for (i, &(text, counted)) in documents.iter().enumerate() {
        // lm-eval's `tok_encode`: the tokenizer's special tokens unless the text starts with
        // the prefix token's text.
        let ids = if text.starts_with(prefix.text.as_str()) {
            tok.encode(text)?
        } else {
            tok.encode_sequence(text)?
        };
        let requests: Vec<Request> = windows(&ids, prefix.id, model.cfg.max_seq).collect();
        let ll: f64 = crate::choices::score(model, &requests)
            .map_err(|e| TrainError::Input(format!("document {}: {e}", i + 1)))?
            .iter()
            .map(|s| s.loglikelihood)
            .sum();
        each(i, ll)?;
        words += count_words(counted) as u64;
        bytes += counted.len() as u64;
        tokens += ids.len() as u64;
        total += ll;
    }
    Ok(RollingReport {
        documents: documents.len(),
        words,
        bytes,
        tokens,
        loglikelihood: total,
        word_perplexity: (-total / words as f64).exp(),
        byte_perplexity: (-total / bytes as f64).exp(),
        bits_per_byte: -total / bytes as f64 / std::f64::consts::LN_2,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `get_rolling_token_windows` + `make_disjoint_window` written as lm-eval writes them.
    fn reference(tokens: &[u32], prefix: u32, max: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
        let mut out = Vec::new();
        if tokens.is_empty() {
            return out;
        }
        let first = max.min(tokens.len());
        let mut a = vec![prefix];
        a.extend_from_slice(&tokens[..first - 1]);
        out.push((a, tokens[..first].to_vec()));
        let mut predicted = first;
        while predicted < tokens.len() {
            let n = (tokens.len() - predicted).min(max);
            let end = predicted + n;
            // Python's slice with a negative start counts from the end: clamp as it does.
            let start = end as i64 - max as i64 - 1;
            let start = if start < 0 {
                (tokens.len() as i64 + start).max(0) as usize
            } else {
                start as usize
            };
            let a = tokens.get(start..end - 1).unwrap_or_default().to_vec();
            out.push((a, tokens[end - n..end].to_vec()));
            predicted = end;
        }
        out.into_iter()
            .map(|(a, b)| (a[..a.len() - (b.len() - 1)].to_vec(), b))
            .collect()
    }

    proptest::proptest! {
        /// Every token is predicted once, in order, and the windows are lm-eval's.
        #[test]
        fn windows_predict_every_token_once_as_lm_eval_cuts_them(
            tokens in proptest::collection::vec(1u32..50, 0..80),
            max in 1usize..20,
        ) {
            let got: Vec<Request> = windows(&tokens, 0, max).collect();
            let predicted: Vec<u32> = got.iter().flat_map(|r| r.continuation.clone()).collect();
            proptest::prop_assert_eq!(&predicted, &tokens);
            for r in &got {
                proptest::prop_assert!(!r.context.is_empty() && r.context.len() + r.continuation.len() <= max + 1);
            }
            let want = reference(&tokens, 0, max);
            let got: Vec<(Vec<u32>, Vec<u32>)> =
                got.into_iter().map(|r| (r.context, r.continuation)).collect();
            proptest::prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn a_bad_document_is_an_error_naming_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("docs.jsonl");
        for (text, why) in [
            (
                "{\"text\": \"ok\"}\n\n{\"text\": \"\"}\n",
                "line 3: \"text\" is empty",
            ),
            ("{\"body\": \"x\"}\n", "line 1: no \"text\""),
            ("{\"text\": 3}\n", "line 1: \"text\" is not text"),
            ("[\n", "line 1: not JSON"),
            ("\n\n", "no documents"),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = read_documents(&path).unwrap_err().to_string();
            assert!(e.contains(why), "{text:?}: {e}");
        }
        std::fs::write(&path, "{\"text\": \"a b\"}\n").unwrap();
        assert_eq!(read_documents(&path).unwrap(), ["a b"]);
    }

    #[test]
    fn words_are_counted_as_python_splits_them() {
        assert_eq!(count_words(""), 1);
        assert_eq!(count_words("a"), 1);
        assert_eq!(count_words("a  b\n\tc"), 3);
        assert_eq!(count_words("a "), 2);
        assert_eq!(count_words("\u{1f}a\u{a0}b"), 3);
    }
}
