#!/usr/bin/env python3
"""lm-eval's corpus translation metrics, as the baseline for headroom's `corpus_metrics` bench.

lm-eval aggregates a translation task's `bleu`, `ter` and `chrf` with sacreBLEU over the whole
corpus, then estimates each one's standard error by bootstrap: 100 resamples of the documents,
each scored again from the text (`lm_eval.api.metrics.bootstrap_stderr`, with its default
multiprocessing pool). This times exactly that (the aggregate and its standard error) on a
synthetic corpus of sentence pairs that `benches/benches/corpus_metrics.rs` builds identically
(the same 64-bit LCG): references of 10-39 words from a skewed 3 000-word vocabulary,
hypotheses with a quarter of the words replaced, a phrase moved in a third of them.

Prints one JSON record per metric: bench "trainer/corpus_metrics/lm_eval/<metric>/<pairs>",
metric "seconds" (the aggregate plus its standard error, median of the runs), and on stderr
each score and standard error, which headroom's bench prints too for comparison.
Exit code 3 (with a reason on stderr) when lm_eval or sacrebleu is missing.
"""

import json
import sys
import time

try:
    import sacrebleu  # noqa: F401
    from lm_eval.api import metrics
except ImportError as e:
    print(f"lm_eval with sacrebleu is not installed: {e}", file=sys.stderr)
    sys.exit(3)

MASK = (1 << 64) - 1


class Lcg:
    """Knuth's MMIX LCG; each draw is the state's top 31 bits."""

    def __init__(self, seed):
        self.state = seed & MASK

    def next(self):
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) & MASK
        return self.state >> 33


def corpus(pairs, seed=2026):
    rng = Lcg(seed)

    def word():
        return "w%d" % min(rng.next() % 3000, rng.next() % 3000)

    hyps, refs = [], []
    for _ in range(pairs):
        length = 10 + rng.next() % 30
        ref = [word() for _ in range(length)]
        hyp = list(ref)
        for i in range(length):
            if rng.next() % 4 == 0:
                hyp[i] = word()
        if rng.next() % 3 == 0:
            start = rng.next() % (length - 4)
            size = 1 + rng.next() % 3
            phrase = hyp[start:start + size]
            del hyp[start:start + size]
            target = rng.next() % (len(hyp) + 1)
            hyp[target:target] = phrase
        refs.append(" ".join(ref) + " .")
        hyps.append(" ".join(hyp) + (" ." if rng.next() % 2 == 0 else ""))
    return hyps, refs


def main():
    quick = "--quick" in sys.argv
    pairs = 200 if quick else 500
    runs = 1 if quick else 3
    hyps, refs = corpus(pairs)
    items = list(zip(refs, hyps))
    for name, fn in (("bleu", metrics.bleu), ("ter", metrics.ter), ("chrf", metrics.chrf)):
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            score = fn(items)
            stderr = metrics.bootstrap_stderr(fn, items, iters=100)
            times.append(time.perf_counter() - start)
        times.sort()
        print(f"{name} over {pairs} pairs: {score!r} ± {stderr!r}", file=sys.stderr)
        print(json.dumps({
            "bench": f"trainer/corpus_metrics/lm_eval/{name}/{pairs}",
            "metric": "seconds",
            "value": times[len(times) // 2],
            "unit": "s",
            "better": "lower",
        }))


if __name__ == "__main__":
    main()
