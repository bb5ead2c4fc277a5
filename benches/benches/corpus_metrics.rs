//! Corpus translation metrics (`eval --generate --metric bleu|ter|chrf`): the aggregate and
//! lm-eval's bootstrap standard error over a synthetic corpus, against lm-eval's own
//! (`benches/torch/corpus_metrics.py`, sacreBLEU, 100 resamples each scored again from the
//! text). headroom scores each document once and resamples sums of its statistics.
//!
//! The corpus is the script's, built by the same 64-bit LCG: references of 10-39 words from a
//! skewed 3 000-word vocabulary, hypotheses with a quarter of the words replaced and a phrase
//! moved in a third of them. Both sides print each score and standard error.

use std::time::Instant;

use headroom_benches::{record, Better, Record};
use headroom_trainer::corpus_metrics::CorpusMetric;

/// Knuth's MMIX LCG; each draw is the state's top 31 bits (the script's `Lcg`).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// `pairs` (hypothesis, reference) sentence pairs, as `corpus_metrics.py` builds them.
fn corpus(pairs: usize, seed: u64) -> Vec<(String, String)> {
    fn word(rng: &mut Lcg) -> String {
        let (a, b) = (rng.next() % 3000, rng.next() % 3000);
        format!("w{}", a.min(b))
    }
    let mut rng = Lcg(seed);
    (0..pairs)
        .map(|_| {
            let length = 10 + (rng.next() % 30) as usize;
            let reference: Vec<String> = (0..length).map(|_| word(&mut rng)).collect();
            let mut hyp = reference.clone();
            for w in hyp.iter_mut() {
                if rng.next().is_multiple_of(4) {
                    *w = word(&mut rng);
                }
            }
            if rng.next().is_multiple_of(3) {
                let start = (rng.next() % (length as u64 - 4)) as usize;
                let size = 1 + (rng.next() % 3) as usize;
                let phrase: Vec<String> = hyp.drain(start..start + size).collect();
                let target = (rng.next() % (hyp.len() as u64 + 1)) as usize;
                hyp.splice(target..target, phrase);
            }
            let dot = if rng.next().is_multiple_of(2) {
                " ."
            } else {
                ""
            };
            (hyp.join(" ") + dot, reference.join(" ") + " .")
        })
        .collect()
}

/// Seconds to score `pairs` and bootstrap the standard error, median of `runs`.
fn measure(metric: CorpusMetric, pairs: &[(String, String)], runs: usize) -> (f64, f64, f64) {
    let mut times = Vec::with_capacity(runs);
    let (mut score, mut stderr) = (0.0, 0.0);
    for _ in 0..runs {
        let start = Instant::now();
        let stats: Vec<Vec<f64>> = pairs
            .iter()
            .map(|(h, r)| {
                metric
                    .segment(h, std::slice::from_ref(r))
                    .expect("a sentence pair scores")
            })
            .collect();
        score = metric.corpus(&stats);
        stderr = metric.stderr(&stats).unwrap_or(f64::NAN);
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], score, stderr)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick")
        || std::env::var_os("HEADROOM_BENCH_QUICK").is_some();
    // cargo passes `--bench`; under `cargo test --benches` it does not: run nothing then.
    if !std::env::args().any(|a| a == "--bench" || a == "--quick") {
        return;
    }
    // The script's size (its side is slow), and WMT16 de-en's test set (2 999 pairs).
    let (compared, runs) = if quick { (200, 3) } else { (500, 11) };
    for pairs in [compared, 3000] {
        let corpus = corpus(pairs, 2026);
        for metric in [CorpusMetric::Bleu, CorpusMetric::Ter, CorpusMetric::Chrf] {
            let (seconds, score, stderr) = measure(metric, &corpus, runs);
            let name = metric.name();
            eprintln!("{name} over {pairs} pairs: {score:?} ± {stderr:?}");
            let bench = format!("trainer/corpus_metrics/headroom/{name}/{pairs}");
            println!("{bench}: {:.1} ms", seconds * 1e3);
            let r = Record {
                bench,
                metric: "seconds".into(),
                value: seconds,
                unit: "s".into(),
                baseline: (pairs == compared)
                    .then(|| format!("trainer/corpus_metrics/lm_eval/{name}/{pairs}")),
                baseline_value: None,
                ratio: None,
                better: Better::Lower,
            };
            if let Err(e) = record(&r) {
                eprintln!("could not record {}: {e}", r.bench);
            }
        }
    }
}
