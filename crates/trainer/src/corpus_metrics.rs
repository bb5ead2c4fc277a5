//! Corpus-level translation metrics as lm-evaluation-harness aggregates them for its
//! `generate_until` tasks (WMT, IWSLT, FLORES): sacreBLEU's `corpus_bleu` (the `13a`
//! tokenizer, exponential smoothing), `corpus_chrf` (character 6-grams, β = 2), chrF++ (with
//! word 1- and 2-grams) and `corpus_ter` (Tercom's shifts and banded edit distance, lower
//! case), each with lm-eval's bootstrap standard error (100 resamples of the documents).
//!
//! ```
//! use headroom_trainer::corpus_metrics::CorpusMetric;
//! let hypotheses = ["The cat sat on the mat.", "It rained all day"];
//! let references = ["The cat sat on a mat.", "It rained all day long."];
//! let stats: Vec<Vec<f64>> = hypotheses
//!     .iter()
//!     .zip(references)
//!     .map(|(h, r)| CorpusMetric::Bleu.segment(h, &[r.to_string()]))
//!     .collect::<Result<_, _>>()
//!     .unwrap();
//! let bleu = CorpusMetric::Bleu.corpus(&stats);
//! assert!(bleu > 40.0 && bleu < 100.0, "{bleu}");
//! // A perfect copy scores 100.
//! let same = CorpusMetric::Chrf.segment("a b c d", &["a b c d".to_string()]).unwrap();
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

/// The longest hypothesis or reference scored (bytes): a translation segment is a sentence
/// or a paragraph, and chrF's tables hold about 200 bytes per character.
pub const MAX_SEGMENT_BYTES: usize = 1 << 20;

/// The largest TER edit-distance matrix (hypothesis words + 1 by reference words + 1), 256 MiB
/// of cells; a sentence pair of 300 words each needs 90 601.
pub const MAX_TER_CELLS: usize = 1 << 24;

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
    /// `ter`: translation edit rate (Tercom's, in lower case), edits per 100 reference
    /// words; lower is better.
    Ter,
}

impl CorpusMetric {
    /// The metric named `name` in lm-eval's `metric_list`.
    pub fn named(name: &str) -> Result<CorpusMetric> {
        match name {
            "bleu" => Ok(CorpusMetric::Bleu),
            "chrf" => Ok(CorpusMetric::Chrf),
            "chrf++" => Ok(CorpusMetric::ChrfPlusPlus),
            "ter" => Ok(CorpusMetric::Ter),
            other => Err(TrainError::Input(format!(
                "no corpus metric {other:?} (there are bleu, chrf, chrf++ and ter)"
            ))),
        }
    }

    /// Its name in lm-eval's results (`bleu,<filter>`).
    pub fn name(self) -> &'static str {
        match self {
            CorpusMetric::Bleu => "bleu",
            CorpusMetric::Chrf => "chrf",
            CorpusMetric::ChrfPlusPlus => "chrf++",
            CorpusMetric::Ter => "ter",
        }
    }

    /// One document's statistics: the `hypothesis` against its `references` (at least one).
    /// A text past [`MAX_SEGMENT_BYTES`], or a TER matrix past [`MAX_TER_CELLS`], is refused:
    /// n-gram tables and edit matrices grow faster than the text.
    pub fn segment(self, hypothesis: &str, references: &[String]) -> Result<Vec<f64>> {
        if references.is_empty() {
            return Err(TrainError::Input(format!("{}: no reference", self.name())));
        }
        if let Some(long) = std::iter::once(hypothesis)
            .chain(references.iter().map(String::as_str))
            .find(|t| t.len() > MAX_SEGMENT_BYTES)
        {
            return Err(TrainError::Input(format!(
                "{}: a text of {} bytes; sentence-level metrics take at most {MAX_SEGMENT_BYTES}",
                self.name(),
                long.len()
            )));
        }
        Ok(match self {
            CorpusMetric::Bleu => bleu_segment(hypothesis, references),
            CorpusMetric::Chrf => chrf_segment(hypothesis, references, 0),
            CorpusMetric::ChrfPlusPlus => chrf_segment(hypothesis, references, 2),
            CorpusMetric::Ter => ter_segment(hypothesis, references)?,
        })
    }

    /// The score of statistics summed over a corpus.
    pub fn score(self, summed: &[f64]) -> f64 {
        match self {
            CorpusMetric::Bleu => bleu_score(summed),
            CorpusMetric::Chrf | CorpusMetric::ChrfPlusPlus => chrf_f_score(summed),
            CorpusMetric::Ter => ter_score(summed),
        }
    }

    /// The score of a corpus given each document's statistics.
    pub fn corpus(self, segments: &[Vec<f64>]) -> f64 {
        self.score(&sum_segments(segments.iter().map(Vec::as_slice)))
    }

    /// lm-eval's bootstrap standard error of the corpus score: [`CORPUS_BOOTSTRAP_ITERS`]
    /// resamples of the documents drawn by Python's `random.Random(0).choices`; `None` below
    /// two documents (lm-eval's `N/A`).
    pub fn stderr(self, segments: &[Vec<f64>]) -> Option<f64> {
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
fn sum_segments<'a>(segments: impl Iterator<Item = &'a [f64]>) -> Vec<f64> {
    let mut sum: Vec<f64> = Vec::new();
    for s in segments {
        if sum.len() < s.len() {
            sum.resize(s.len(), 0.0);
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
/// breaks removed, four HTML entities decoded, ASCII punctuation split off (not `'`; `.` and
/// `,` only where not between digits, as in `3.5` and `1,000`; `-` only after a digit), then
/// the words between whitespace.
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
fn bleu_segment(hypothesis: &str, references: &[String]) -> Vec<f64> {
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
    // Counts, exact in f64 (below 2⁵³), as sacreBLEU's Python integers are.
    stats.into_iter().map(|c| c as f64).collect()
}

/// sacreBLEU's `compute_bleu` with `smooth_method='exp'` over summed statistics.
fn bleu_score(stats: &[f64]) -> f64 {
    if stats.len() < 2 + 2 * BLEU_ORDER {
        return 0.0;
    }
    let (sys_len, ref_len) = (stats[0], stats[1]);
    let correct = &stats[2..2 + BLEU_ORDER];
    let total = &stats[2 + BLEU_ORDER..2 + 2 * BLEU_ORDER];
    let brevity = if sys_len < ref_len {
        if sys_len > 0.0 {
            (1.0 - ref_len / sys_len).exp()
        } else {
            0.0
        }
    } else {
        1.0
    };
    if correct.iter().all(|&c| c == 0.0) {
        return 0.0;
    }
    let mut precisions = [0.0f64; BLEU_ORDER];
    let mut smooth = 1.0f64;
    for n in 0..BLEU_ORDER {
        if total[n] == 0.0 {
            break;
        }
        precisions[n] = if correct[n] == 0.0 {
            smooth *= 2.0;
            100.0 / (smooth * total[n])
        } else {
            100.0 * correct[n] / total[n]
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

/// What chrF counts n-grams of in one text: its characters (whitespace removed) and, when
/// `word_order` is above 0 (chrF++), its words.
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
fn chrf_order_stats<T: std::hash::Hash + Eq>(hyp: &[T], reference: &[T], n: usize) -> [f64; 3] {
    let hyp_counts = ngram_counts(hyp, n..=n);
    let ref_counts = ngram_counts(reference, n..=n);
    let (mut matches, mut hyp_total) = (0u64, 0u64);
    for (gram, &count) in &hyp_counts {
        hyp_total += count;
        if let Some(&r) = ref_counts.get(gram) {
            matches += count.min(r);
        }
    }
    [
        // No hits are counted where the reference has no n-gram of this order.
        if ref_counts.is_empty() { 0 } else { hyp_total } as f64,
        ref_counts.values().sum::<u64>() as f64,
        matches as f64,
    ]
}

/// chrF's statistics against the reference with the best F-score (the first on a tie).
fn chrf_segment(hypothesis: &str, references: &[String], word_order: usize) -> Vec<f64> {
    let (hyp_chars, hyp_words) = chrf_ngrams(hypothesis, word_order);
    let mut best: Option<(f64, Vec<f64>)> = None;
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
fn chrf_f_score(stats: &[f64]) -> f64 {
    let (mut precision, mut recall, mut orders) = (0.0f64, 0.0f64, 0u32);
    for order in stats.chunks_exact(3) {
        let (hyp, reference, matches) = (order[0], order[1], order[2]);
        if hyp > 0.0 && reference > 0.0 {
            precision += matches / hyp;
            recall += matches / reference;
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

/// Tercom's limits, as sacreBLEU keeps them: the longest phrase shifted, the farthest it
/// moves, the band of the edit-distance matrix computed on each side of its diagonal, and
/// the shifts tried per sentence.
const TER_MAX_SHIFT_SIZE: usize = 10;
const TER_MAX_SHIFT_DIST: usize = 50;
const TER_BEAM_WIDTH: usize = 25;
const TER_MAX_SHIFT_CANDIDATES: usize = 1000;
/// An edit-distance cell outside the band.
const TER_INFINITY: i64 = 10_000_000_000_000_000;

/// One edit of the alignment (sacreBLEU's trace characters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Edit {
    /// `' '`: the words match.
    Keep,
    /// `'s'`.
    Substitute,
    /// `'i'`.
    Insert,
    /// `'d'`.
    Delete,
    /// `'x'`: a cell outside the band.
    Undefined,
}

/// TER's statistics: `[fewest edits over the references, mean reference length]`, the
/// words split on whitespace in lower case (sacreBLEU's default `tercom` tokenizer).
fn ter_segment(hypothesis: &str, references: &[String]) -> Result<Vec<f64>> {
    let words = |text: &str| -> Vec<String> {
        python_words(&text.trim_end_matches(is_python_space).to_lowercase())
            .map(str::to_owned)
            .collect()
    };
    let hyp = words(hypothesis);
    let mut best = TER_INFINITY as f64;
    let mut ref_lengths = 0usize;
    for reference in references {
        let reference = words(reference);
        let cells = (hyp.len() + 1).saturating_mul(reference.len() + 1);
        if cells > MAX_TER_CELLS {
            return Err(TrainError::Input(format!(
                "ter: {} hypothesis words against {} reference words need {cells} edit-distance \
                 cells; at most {MAX_TER_CELLS}",
                hyp.len(),
                reference.len()
            )));
        }
        let edits = translation_edit_rate(&hyp, &reference);
        ref_lengths += reference.len();
        best = best.min(edits as f64);
    }
    Ok(vec![
        best,
        ref_lengths as f64 / references.len().max(1) as f64,
    ])
}

/// sacreBLEU's TER over summed statistics: 100 × edits per reference word (100 for words
/// against empty references, 0 for nothing against nothing).
fn ter_score(stats: &[f64]) -> f64 {
    let (edits, ref_len) = match stats {
        [e, r, ..] => (*e, *r),
        _ => return 0.0,
    };
    let rate = if ref_len > 0.0 {
        edits / ref_len
    } else if edits > 0.0 {
        1.0
    } else {
        0.0
    };
    100.0 * rate
}

/// Tercom's edit count of `hyp` into `reference`: shifts of phrases found greedily (the one
/// that lowers the edit distance most, then the longest, the earliest, the earliest target)
/// plus the edit distance left.
fn translation_edit_rate(hyp: &[String], reference: &[String]) -> usize {
    if reference.is_empty() {
        return hyp.len();
    }
    let mut words: Vec<&str> = hyp.iter().map(String::as_str).collect();
    let reference: Vec<&str> = reference.iter().map(String::as_str).collect();
    let (mut shifts, mut checked) = (0, 0);
    loop {
        let (gain, shifted) = ter_best_shift(&words, &reference, &mut checked);
        if checked >= TER_MAX_SHIFT_CANDIDATES || gain <= 0 {
            break;
        }
        shifts += 1;
        words = shifted;
    }
    shifts + beam_edit_distance(&words, &reference).0 as usize
}

/// The shift of a phrase of `words` that lowers the edit distance to `reference` most, and by
/// how much (0 and `words` when no shift is a candidate); `checked` counts the candidates
/// tried.
fn ter_best_shift<'a>(
    words: &[&'a str],
    reference: &[&str],
    checked: &mut usize,
) -> (i64, Vec<&'a str>) {
    let (before, trace) = beam_edit_distance(words, reference);
    // The alignment read from the reference's side: each reference word's hypothesis
    // position, and which words of each side are in error.
    let mut pos_hyp = -1i64;
    let (mut hyp_err, mut ref_err, mut align) = (Vec::new(), Vec::new(), Vec::new());
    for edit in trace {
        match edit {
            Edit::Keep | Edit::Substitute => {
                pos_hyp += 1;
                align.push(pos_hyp);
                let wrong = u8::from(edit == Edit::Substitute);
                hyp_err.push(wrong);
                ref_err.push(wrong);
            }
            // The trace rewrites the hypothesis into the reference; read the other way an
            // insertion takes a hypothesis word and a deletion a reference word.
            Edit::Delete => {
                pos_hyp += 1;
                hyp_err.push(1);
            }
            Edit::Insert => {
                align.push(pos_hyp);
                ref_err.push(1);
            }
            Edit::Undefined => {}
        }
    }
    type Candidate<'a> = (i64, usize, i64, i64, Vec<&'a str>);
    let mut best: Option<Candidate<'a>> = None;
    'pairs: for start_h in 0..words.len() {
        for start_r in 0..reference.len() {
            if start_r.abs_diff(start_h) > TER_MAX_SHIFT_DIST {
                continue;
            }
            let mut length = 0;
            while length < TER_MAX_SHIFT_SIZE
                && start_h + length < words.len()
                && start_r + length < reference.len()
                && words[start_h + length] == reference[start_r + length]
            {
                length += 1;
                let in_error = |err: &[u8], start: usize| {
                    err.get(start..start + length)
                        .is_some_and(|e| e.iter().any(|&x| x != 0))
                };
                let aligned_inside = align
                    .get(start_r)
                    .is_some_and(|&a| start_h as i64 <= a && a < (start_h + length) as i64);
                if in_error(&hyp_err, start_h) && in_error(&ref_err, start_r) && !aligned_inside {
                    let mut previous = -1i64;
                    for offset in -1..length as i64 {
                        let at = start_r as i64 + offset;
                        let target = if at == -1 {
                            0
                        } else if let Some(&a) =
                            usize::try_from(at).ok().and_then(|at| align.get(at))
                        {
                            a + 1
                        } else {
                            break;
                        };
                        if target == previous {
                            continue;
                        }
                        previous = target;
                        let shifted = ter_shift(words, start_h, length, target as usize);
                        let gain = before - beam_edit_distance(&shifted, reference).0;
                        *checked += 1;
                        let candidate = (gain, length, -(start_h as i64), -target, shifted);
                        if best.as_ref().is_none_or(|b| candidate > *b) {
                            best = Some(candidate);
                        }
                    }
                    if *checked >= TER_MAX_SHIFT_CANDIDATES {
                        break 'pairs;
                    }
                }
            }
        }
    }
    match best {
        Some((gain, _, _, _, shifted)) => (gain, shifted),
        None => (0, words.to_vec()),
    }
}

/// `words` with its phrase `start..start + length` moved to `target` (sacreBLEU's
/// `_perform_shift`, Python's clamped slices).
fn ter_shift<'a>(words: &[&'a str], start: usize, length: usize, target: usize) -> Vec<&'a str> {
    let part =
        |a: usize, b: usize| &words[a.min(words.len())..b.min(words.len()).max(a.min(words.len()))];
    let mut out = Vec::with_capacity(words.len());
    if target < start {
        out.extend_from_slice(part(0, target));
        out.extend_from_slice(part(start, start + length));
        out.extend_from_slice(part(target, start));
        out.extend_from_slice(part(start + length, words.len()));
    } else if target > start + length {
        out.extend_from_slice(part(0, start));
        out.extend_from_slice(part(start + length, target));
        out.extend_from_slice(part(start, start + length));
        out.extend_from_slice(part(target, words.len()));
    } else {
        out.extend_from_slice(part(0, start));
        out.extend_from_slice(part(start + length, length + target));
        out.extend_from_slice(part(start, start + length));
        out.extend_from_slice(part(length + target, words.len()));
    }
    out
}

/// The edit distance of `hyp` into `reference` over a band of the matrix around its
/// (length-scaled) diagonal, and the edits, first to last (sacreBLEU's `BeamEditDistance`
/// without its cache, which only saves work).
fn beam_edit_distance(hyp: &[&str], reference: &[&str]) -> (i64, Vec<Edit>) {
    let (n_hyp, n_ref) = (hyp.len(), reference.len());
    let width = n_ref + 1;
    let mut dist: Vec<(i64, Edit)> = vec![(TER_INFINITY, Edit::Undefined); (n_hyp + 1) * width];
    for (j, cell) in dist[..width].iter_mut().enumerate() {
        *cell = (j as i64, Edit::Insert);
    }
    let ratio = if n_hyp == 0 {
        1.0
    } else {
        n_ref as f64 / n_hyp as f64
    };
    let beam = if (TER_BEAM_WIDTH as f64) < ratio / 2.0 {
        (ratio / 2.0 + TER_BEAM_WIDTH as f64).ceil() as usize
    } else {
        TER_BEAM_WIDTH
    };
    for i in 1..=n_hyp {
        let diagonal = (i as f64 * ratio).floor() as usize;
        let low = diagonal.saturating_sub(beam);
        let high = if i == n_hyp {
            n_ref + 1
        } else {
            (n_ref + 1).min(diagonal + beam)
        };
        for j in low..high {
            let up = dist[(i - 1) * width + j].0;
            if j == 0 {
                dist[i * width] = (up + 1, Edit::Delete);
                continue;
            }
            let (sub_cost, sub_edit) = if hyp[i - 1] == reference[j - 1] {
                (0, Edit::Keep)
            } else {
                (1, Edit::Substitute)
            };
            let options = [
                (dist[(i - 1) * width + j - 1].0 + sub_cost, sub_edit),
                (up + 1, Edit::Delete),
                (dist[i * width + j - 1].0 + 1, Edit::Insert),
            ];
            for (cost, edit) in options {
                if dist[i * width + j].0 > cost {
                    dist[i * width + j] = (cost, edit);
                }
            }
        }
    }
    let mut trace = Vec::with_capacity(n_hyp + n_ref);
    let (mut i, mut j) = (n_hyp, n_ref);
    while i > 0 || j > 0 {
        // sacreBLEU raises on a cell outside the band, which an optimal path never reaches;
        // here it counts as a deletion (an insertion in the first row).
        let edit = match dist[i * width + j].1 {
            Edit::Undefined if i > 0 => Edit::Delete,
            Edit::Undefined => Edit::Insert,
            edit => edit,
        };
        trace.push(edit);
        match edit {
            Edit::Keep | Edit::Substitute => {
                i -= 1;
                j -= 1;
            }
            Edit::Insert => j -= 1,
            Edit::Delete | Edit::Undefined => i -= 1,
        }
    }
    trace.reverse();
    (dist[n_hyp * width + n_ref].0, trace)
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: [CorpusMetric; 4] = [
        CorpusMetric::Bleu,
        CorpusMetric::Chrf,
        CorpusMetric::ChrfPlusPlus,
        CorpusMetric::Ter,
    ];

    /// Plain Levenshtein distance over words, the whole matrix (the band's reference).
    fn levenshtein(a: &[&str], b: &[&str]) -> usize {
        let mut row: Vec<usize> = (0..=b.len()).collect();
        for (i, x) in a.iter().enumerate() {
            let mut diagonal = row[0];
            row[0] = i + 1;
            for (j, y) in b.iter().enumerate() {
                let next = (diagonal + usize::from(x != y))
                    .min(row[j] + 1)
                    .min(row[j + 1] + 1);
                diagonal = row[j + 1];
                row[j + 1] = next;
            }
        }
        row[b.len()]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Under the band's width the banded distance is Levenshtein's, and TER's shifts only
        /// ever lower the edits: between the length difference and the distance without
        /// shifts.
        #[test]
        fn ter_edits_lie_between_the_length_gap_and_levenshtein(
            hyp in proptest::collection::vec("[a-d]", 0..20),
            reference in proptest::collection::vec("[a-d]", 1..20),
        ) {
            let h: Vec<&str> = hyp.iter().map(String::as_str).collect();
            let r: Vec<&str> = reference.iter().map(String::as_str).collect();
            let plain = levenshtein(&h, &r);
            proptest::prop_assert_eq!(beam_edit_distance(&h, &r).0 as usize, plain);
            let edits = translation_edit_rate(&hyp, &reference);
            proptest::prop_assert!(edits <= plain, "{} > {}", edits, plain);
            proptest::prop_assert!(edits >= hyp.len().abs_diff(reference.len()));
        }

        /// Scores lie in 0–100 (TER: at least 0), do not depend on the documents' order, and
        /// a corpus that copies its references (four tokens or more each) scores 100 (TER:
        /// 0).
        #[test]
        fn scores_are_bounded_orderless_and_100_for_copies(
            pairs in proptest::collection::vec(
                ("[a-c .,!-]{0,12}", "[a-c .,!-]{0,12}"), 1..6),
            copies in proptest::collection::vec("[a-c]{1,3}( [a-c]{1,3}){3,6}[.!]?", 1..4),
        ) {
            for metric in METRICS {
                let stats: Vec<Vec<f64>> = pairs
                    .iter()
                    .map(|(h, r)| metric.segment(h, std::slice::from_ref(r)).unwrap())
                    .collect();
                let score = metric.corpus(&stats);
                let ter = metric == CorpusMetric::Ter;
                proptest::prop_assert!(
                    score >= 0.0 && (ter || score <= 100.0 + 1e-9),
                    "{:?} {}", metric, score
                );
                let reversed: Vec<Vec<f64>> = stats.iter().rev().cloned().collect();
                proptest::prop_assert_eq!(metric.corpus(&reversed), score);
                let same: Vec<Vec<f64>> = copies
                    .iter()
                    .map(|c| metric.segment(c, std::slice::from_ref(c)).unwrap())
                    .collect();
                let perfect = metric.corpus(&same);
                let best = if ter { 0.0 } else { 100.0 };
                proptest::prop_assert!((perfect - best).abs() < 1e-9, "{:?} {}", metric, perfect);
            }
        }
    }
}
