//! Corpus-level translation metrics as lm-evaluation-harness aggregates them for its
//! `generate_until` tasks (WMT, IWSLT, FLORES): sacreBLEU's `corpus_bleu` (the `13a`
//! tokenizer, exponential smoothing), `corpus_chrf` (character 6-grams, β = 2) and chrF++ (with
//! word 1- and 2-grams), each with lm-eval's bootstrap standard error (100 resamples of the
//! documents).
//!
//! ```
//! use headroom_trainer::corpus_metrics::CorpusMetric;
//! let hypotheses = ["The cat sat on the mat.", "It rained all day"];
//! let references = ["The cat sat on a mat.", "It rained all day long."];
//! let stats: Vec<Vec<u64>> = hypotheses
//!     .iter()
//!     .zip(references)
//!     .map(|(h, r)| CorpusMetric::Bleu.segment(h, &[r.to_string()]))
//!     .collect();
//! let bleu = CorpusMetric::Bleu.corpus(&stats);
//! assert!(bleu > 40.0 && bleu < 100.0, "{bleu}");
//! // A perfect copy scores 100.
//! let same = CorpusMetric::Chrf.segment("a b c d", &["a b c d".to_string()]);
//! assert!((CorpusMetric::Chrf.corpus(&[same]) - 100.0).abs() < 1e-9);
//! ```
//!
//! Each document gives its sufficient statistics ([`CorpusMetric::segment`]: BLEU's lengths and
//! n-gram matches, chrF's n-gram counts against its best reference), which add up over the
//! corpus; the score is computed from the sums ([`CorpusMetric::score`]), as sacreBLEU does,
//! so a bootstrap resample costs a sum. `tests/corpus_metrics.rs` checks scores and standard
//! errors against sacreBLEU 2.6 under lm-eval 0.4.13 (`benches/torch/make_generation_fixture.py`).

use std::collections::HashMap;

use crate::chat_template::is_python_space;
use crate::{Result, TrainError};

/// lm-eval's bootstrap resamples for BLEU, chrF and TER (`min(bootstrap_iters, 100)`).
pub const CORPUS_BOOTSTRAP_ITERS: usize = 100;

/// BLEU's n-gram orders.
const BLEU_ORDER: usize = 4;
/// chrF's character n-gram orders.
const CHRF_CHAR_ORDER: usize = 6;
/// chrF's β² (recall weighs β = 2 times as much as precision).
const CHRF_BETA_SQUARED: f64 = 4.0;

/// A corpus-level metric of lm-eval's `metric_list`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CorpusMetric {
    /// `bleu`: sacreBLEU's corpus BLEU, 0–100.
    Bleu,
    /// `chrf`: character n-gram F-score (orders 1–6, β = 2), 0–100.
    Chrf,
    /// `chrf++`: chrF with word unigrams and bigrams.
    ChrfPlusPlus,
}

impl CorpusMetric {
    /// The metric named `name` in lm-eval's `metric_list`.
    pub fn named(name: &str) -> Result<CorpusMetric> {
        match name {
            "bleu" => Ok(CorpusMetric::Bleu),
            "chrf" => Ok(CorpusMetric::Chrf),
            "chrf++" => Ok(CorpusMetric::ChrfPlusPlus),
            other => Err(TrainError::Input(format!(
                "no corpus metric {other:?} (there are bleu, chrf and chrf++; lm-eval's ter is \
                 not one)"
            ))),
        }
    }

    /// Its name in lm-eval's results (`bleu,<filter>`).
    pub fn name(self) -> &'static str {
        match self {
            CorpusMetric::Bleu => "bleu",
            CorpusMetric::Chrf => "chrf",
            CorpusMetric::ChrfPlusPlus => "chrf++",
        }
    }

    /// One document's statistics: the `hypothesis` against its `references` (at least one).
    pub fn segment(self, hypothesis: &str, references: &[String]) -> Vec<u64> {
        match self {
            CorpusMetric::Bleu => bleu_segment(hypothesis, references),
            CorpusMetric::Chrf => chrf_segment(hypothesis, references, 0),
            CorpusMetric::ChrfPlusPlus => chrf_segment(hypothesis, references, 2),
        }
    }

    /// The score of statistics summed over a corpus.
    pub fn score(self, summed: &[u64]) -> f64 {
        match self {
            CorpusMetric::Bleu => bleu_score(summed),
            CorpusMetric::Chrf | CorpusMetric::ChrfPlusPlus => chrf_f_score(summed),
        }
    }

    /// The score of a corpus given each document's statistics.
    pub fn corpus(self, segments: &[Vec<u64>]) -> f64 {
        self.score(&sum_segments(segments.iter().map(Vec::as_slice)))
    }

    /// lm-eval's bootstrap standard error of the corpus score: [`CORPUS_BOOTSTRAP_ITERS`]
    /// resamples of the documents drawn by Python's `random.Random(0).choices`; `None` below
    /// two documents (lm-eval's `N/A`).
    pub fn stderr(self, segments: &[Vec<u64>]) -> Option<f64> {
        crate::completions::bootstrap_stderr_of(
            segments.len(),
            CORPUS_BOOTSTRAP_ITERS,
            |drawn: &[usize]| {
                self.score(&sum_segments(drawn.iter().map(|&i| segments[i].as_slice())))
            },
        )
    }
}

/// Element-wise sums (sacreBLEU's `sum_of_lists`).
fn sum_segments<'a>(segments: impl Iterator<Item = &'a [u64]>) -> Vec<u64> {
    let mut sum: Vec<u64> = Vec::new();
    for s in segments {
        if sum.len() < s.len() {
            sum.resize(s.len(), 0);
        }
        for (t, &v) in sum.iter_mut().zip(s) {
            *t += v;
        }
    }
    sum
}

/// Python's `str.split()`.
fn python_words(text: &str) -> impl Iterator<Item = &str> {
    text.split(is_python_space).filter(|w| !w.is_empty())
}

/// sacreBLEU's `13a` tokenizer (mteval-v13a's, used by WMT): `<skipped>` and hyphenated line
/// breaks removed, four HTML entities decoded, ASCII punctuation split off except apostrophes
/// and `-`, `.`, `,` between digits, then whitespace collapsed.
pub fn tokenize_13a(line: &str) -> Vec<String> {
    let mut line = line
        .replace("<skipped>", "")
        .replace("-\n", "")
        .replace('\n', " ");
    if line.contains('&') {
        line = line
            .replace("&quot;", "\"")
            .replace("&amp;", "&")
            .replace("&lt;", "<")
            .replace("&gt;", ">");
    }
    let chars: Vec<char> = format!(" {line} ").chars().collect();
    // `([\{-\~\[-\` -\&\(-\+\:-\@\/])` → ` \1 `.
    let mut spaced = Vec::with_capacity(chars.len() * 2);
    for &c in &chars {
        let split_off =
            matches!(c, '{'..='~' | '['..='`' | ' '..='&' | '('..='+' | ':'..='@' | '/');
        if split_off {
            spaced.extend([' ', c, ' ']);
        } else {
            spaced.push(c);
        }
    }
    // The next three are `re.sub` over two-character matches, scanned left to right.
    let pairs =
        |text: Vec<char>, matches: fn(char, char) -> bool, out: fn(char, char) -> [char; 4]| {
            let mut result = Vec::with_capacity(text.len() * 2);
            let mut i = 0;
            while i < text.len() {
                if i + 1 < text.len() && matches(text[i], text[i + 1]) {
                    result.extend(out(text[i], text[i + 1]));
                    i += 2;
                } else {
                    result.push(text[i]);
                    i += 1;
                }
            }
            result
        };
    // `([^0-9])([\.,])` → `\1 \2 `.
    let text = pairs(
        spaced,
        |a, b| !a.is_ascii_digit() && (b == '.' || b == ','),
        |a, b| [a, ' ', b, ' '],
    );
    // `([\.,])([^0-9])` → ` \1 \2`.
    let text = pairs(
        text,
        |a, b| (a == '.' || a == ',') && !b.is_ascii_digit(),
        |a, b| [' ', a, ' ', b],
    );
    // `([0-9])(-)` → `\1 \2 `.
    let text = pairs(
        text,
        |a, b| a.is_ascii_digit() && b == '-',
        |a, b| [a, ' ', b, ' '],
    );
    let text: String = text.into_iter().collect();
    python_words(&text).map(str::to_owned).collect()
}

/// Counts of each n-gram of `items`, orders `1..=max_order`.
fn ngram_counts<T: std::hash::Hash + Eq>(
    items: &[T],
    orders: std::ops::RangeInclusive<usize>,
) -> HashMap<&[T], u64> {
    let mut counts = HashMap::new();
    for n in orders {
        for gram in items.windows(n) {
            *counts.entry(gram).or_insert(0) += 1;
        }
    }
    counts
}

/// BLEU's statistics: `[hypothesis length, closest reference length, matches per order…,
/// hypothesis n-grams per order…]`.
fn bleu_segment(hypothesis: &str, references: &[String]) -> Vec<u64> {
    let hyp = tokenize_13a(hypothesis.trim_end_matches(is_python_space));
    let refs: Vec<Vec<String>> = references
        .iter()
        .map(|r| tokenize_13a(r.trim_end_matches(is_python_space)))
        .collect();
    // Each n-gram's largest count in any one reference.
    let mut most: HashMap<&[String], u64> = HashMap::new();
    for r in &refs {
        for (gram, count) in ngram_counts(r, 1..=BLEU_ORDER) {
            let m = most.entry(gram).or_insert(0);
            *m = (*m).max(count);
        }
    }
    // The reference length closest to the hypothesis's, the shorter on a tie.
    let hyp_len = hyp.len() as u64;
    let mut closest: Option<(u64, u64)> = None;
    for r in &refs {
        let len = r.len() as u64;
        let diff = hyp_len.abs_diff(len);
        closest = match closest {
            Some((d, l)) if d < diff || (d == diff && l <= len) => Some((d, l)),
            _ => Some((diff, len)),
        };
    }
    let mut stats = vec![0u64; 2 + 2 * BLEU_ORDER];
    stats[0] = hyp_len;
    stats[1] = closest.map_or(0, |(_, l)| l);
    for (gram, count) in ngram_counts(&hyp, 1..=BLEU_ORDER) {
        let n = gram.len() - 1;
        stats[2 + BLEU_ORDER + n] += count;
        if let Some(&r) = most.get(gram) {
            stats[2 + n] += count.min(r);
        }
    }
    stats
}

/// sacreBLEU's `compute_bleu` with `smooth_method='exp'` over summed statistics.
fn bleu_score(stats: &[u64]) -> f64 {
    if stats.len() < 2 + 2 * BLEU_ORDER {
        return 0.0;
    }
    let (sys_len, ref_len) = (stats[0], stats[1]);
    let correct = &stats[2..2 + BLEU_ORDER];
    let total = &stats[2 + BLEU_ORDER..2 + 2 * BLEU_ORDER];
    let brevity = if sys_len < ref_len {
        if sys_len > 0 {
            (1.0 - ref_len as f64 / sys_len as f64).exp()
        } else {
            0.0
        }
    } else {
        1.0
    };
    if correct.iter().all(|&c| c == 0) {
        return 0.0;
    }
    let mut precisions = [0.0f64; BLEU_ORDER];
    let mut smooth = 1.0f64;
    for n in 0..BLEU_ORDER {
        if total[n] == 0 {
            break;
        }
        precisions[n] = if correct[n] == 0 {
            smooth *= 2.0;
            100.0 / (smooth * total[n] as f64)
        } else {
            100.0 * correct[n] as f64 / total[n] as f64
        };
    }
    // sacreBLEU's `my_log`: log 0 is -9999999999.
    let log = |p: f64| if p == 0.0 { -9_999_999_999.0 } else { p.ln() };
    let sum = precisions.iter().fold(0.0f64, |s, &p| s + log(p));
    brevity * (sum / BLEU_ORDER as f64).exp()
}

/// chrF's word tokens: words split on whitespace, one ASCII punctuation character split off
/// the end (else the start) of a word longer than one character (sacreBLEU's
/// `_remove_punctuation`).
fn chrf_words(text: &str) -> Vec<&str> {
    const PUNCTUATION: &str = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";
    let mut words = Vec::new();
    for w in python_words(text) {
        let mut chars = w.chars();
        let (first, last) = (chars.next(), chars.next_back());
        match (first, last) {
            (Some(_), None) => words.push(w),
            (Some(f), Some(l)) => {
                if PUNCTUATION.contains(l) {
                    let cut = w.len() - l.len_utf8();
                    words.extend([&w[..cut], &w[cut..]]);
                } else if PUNCTUATION.contains(f) {
                    let cut = f.len_utf8();
                    words.extend([&w[..cut], &w[cut..]]);
                } else {
                    words.push(w);
                }
            }
            (None, _) => {}
        }
    }
    words
}

/// Per order, the n-gram counts of one text: characters (whitespace removed) of orders
/// 1–6, then words of orders `1..=word_order`.
fn chrf_ngrams(text: &str, word_order: usize) -> (Vec<char>, Vec<&str>) {
    let chars: Vec<char> = text.chars().filter(|&c| !is_python_space(c)).collect();
    let words = if word_order > 0 {
        chrf_words(text)
    } else {
        Vec::new()
    };
    (chars, words)
}

/// `[hypothesis n-grams, reference n-grams, matches]` of one order.
fn chrf_order_stats<T: std::hash::Hash + Eq>(hyp: &[T], reference: &[T], n: usize) -> [u64; 3] {
    let hyp_counts = ngram_counts(hyp, n..=n);
    let ref_counts = ngram_counts(reference, n..=n);
    let (mut matches, mut hyp_total) = (0, 0);
    for (gram, &count) in &hyp_counts {
        hyp_total += count;
        if let Some(&r) = ref_counts.get(gram) {
            matches += count.min(r);
        }
    }
    [
        // No hits are counted where the reference has no n-gram of this order.
        if ref_counts.is_empty() { 0 } else { hyp_total },
        ref_counts.values().sum(),
        matches,
    ]
}

/// chrF's statistics against the reference with the best F-score (the first on a tie).
fn chrf_segment(hypothesis: &str, references: &[String], word_order: usize) -> Vec<u64> {
    let (hyp_chars, hyp_words) = chrf_ngrams(hypothesis, word_order);
    let mut best: Option<(f64, Vec<u64>)> = None;
    for reference in references {
        let (ref_chars, ref_words) = chrf_ngrams(reference, word_order);
        let mut stats = Vec::with_capacity(3 * (CHRF_CHAR_ORDER + word_order));
        for n in 1..=CHRF_CHAR_ORDER {
            stats.extend(chrf_order_stats(&hyp_chars, &ref_chars, n));
        }
        for n in 1..=word_order {
            stats.extend(chrf_order_stats(&hyp_words, &ref_words, n));
        }
        let f = chrf_f_score(&stats);
        if best.as_ref().is_none_or(|(b, _)| f > *b) {
            best = Some((f, stats));
        }
    }
    best.map(|(_, s)| s).unwrap_or_default()
}

/// sacreBLEU's chrF F-score: precision and recall averaged over the orders both sides have,
/// then combined with β.
fn chrf_f_score(stats: &[u64]) -> f64 {
    let (mut precision, mut recall, mut orders) = (0.0f64, 0.0f64, 0u32);
    for order in stats.chunks_exact(3) {
        let (hyp, reference, matches) = (order[0], order[1], order[2]);
        if hyp > 0 && reference > 0 {
            precision += matches as f64 / hyp as f64;
            recall += matches as f64 / reference as f64;
            orders += 1;
        }
    }
    if orders == 0 {
        return 0.0;
    }
    precision /= f64::from(orders);
    recall /= f64::from(orders);
    if precision + recall == 0.0 {
        return 0.0;
    }
    let score = (1.0 + CHRF_BETA_SQUARED) * precision * recall;
    100.0 * (score / (CHRF_BETA_SQUARED * precision + recall))
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: [CorpusMetric; 3] = [
        CorpusMetric::Bleu,
        CorpusMetric::Chrf,
        CorpusMetric::ChrfPlusPlus,
    ];

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Scores lie in 0–100, do not depend on the documents' order, and a corpus that
        /// copies its references (four tokens or more each) scores 100.
        #[test]
        fn scores_are_bounded_orderless_and_100_for_copies(
            pairs in proptest::collection::vec(
                ("[a-c .,!-]{0,12}", "[a-c .,!-]{0,12}"), 1..6),
            copies in proptest::collection::vec("[a-c]{1,3}( [a-c]{1,3}){3,6}[.!]?", 1..4),
        ) {
            for metric in METRICS {
                let stats: Vec<Vec<u64>> = pairs
                    .iter()
                    .map(|(h, r)| metric.segment(h, std::slice::from_ref(r)))
                    .collect();
                let score = metric.corpus(&stats);
                proptest::prop_assert!((0.0..=100.0 + 1e-9).contains(&score), "{}", score);
                let reversed: Vec<Vec<u64>> = stats.iter().rev().cloned().collect();
                proptest::prop_assert_eq!(metric.corpus(&reversed), score);
                let same: Vec<Vec<u64>> = copies
                    .iter()
                    .map(|c| metric.segment(c, std::slice::from_ref(c)))
                    .collect();
                let perfect = metric.corpus(&same);
                proptest::prop_assert!((perfect - 100.0).abs() < 1e-9, "{:?} {}", metric, perfect);
            }
        }
    }
}
