"""Write the generation fixture that crates/trainer/tests/generation.rs reads.

EleutherAI's lm-evaluation-harness runs its `generate_until` tasks (GSM8K, TriviaQA) by
greedy generation: each document's prompt (few-shot examples, a chat template) is encoded as
its `HFLM` encodes a batch (the tokenizer's special tokens unless the text starts with the
BOS text), cut from the left to the model's context less `max_gen_toks`, continued by
transformers' `generate(do_sample=False)` until a stop string of `until` (plus the
tokenizer's EOS text) or an end-of-sequence token, decoded without special tokens and cut at
each stop string. The task's filters (`regex`, `take_first`, ...) then take an answer from
the text, and `exact_match` compares it with the target after `regexes_to_ignore`,
`ignore_case`, `ignore_punctuation` and `ignore_numbers`.

This script runs lm-eval 0.4.13's `simple_evaluate` with `HFLM` (float32, CPU, batch size 1)
on five generation tasks over documents written here, with the committed transformers models
and the tokenizers `make_choices_fixture.py` saves (`fixtures/choices/<tokenizer>/`):

- `llama_zero_shot`: stop strings, a prompt longer than the context, a prompt that starts
  with `<s>`, GSM8K-style filters (group_select 0 and -1, a tuple of groups, a fallback),
  `ignore_case` and `regexes_to_ignore`;
- `llama_fewshot_random`: two examples from `fewshot.jsonl` by the default sampler, a
  description, no `until` (lm-eval's default, the few-shot delimiter);
- `gpt2_first_n`: the story tokenizer (no BOS), one example by `first_n`, `remove_whitespace`,
  `uppercase`, `ignore_punctuation` and `ignore_numbers`;
- `llama_chat`: through the chat template, examples as turns, a system instruction;
- `llama_several_targets`: a list of targets per document (any one right; an example shows
  the first), examples drawn from the documents themselves;
- `llama_repeats_greedy`: `repeats: 3` under greedy decoding (three equal texts), through
  `take_first_k`, `majority_vote` and `take_first`;
- `llama_sampled_repeats`: `do_sample: true` at temperature 0.7, `repeats: 5`, the same
  filters. Its texts are torch's draws, which headroom's generator does not reproduce: the
  Rust test feeds lm-eval's texts to headroom's filters and metric and compares the answers,
  flags and aggregates;
- `llama_gen_prefix`, `llama_chat_gen_prefix`, `llama_chat_single_gen_prefix`: a `gen_prefix`
  (the answer's start, which the model continues) in plain text, through the chat template
  with examples as turns (`continue_final_message`), and with them in one user message and a
  prefix ending in a space.
- `llama_translation`: lm-eval's corpus metrics `bleu`, `chrf`, `chrf++` and `ter` under two
  filters,
  the references made from a first run's texts (as they came, with the last word changed, or
  unrelated).

Targets are set from a first run's answers (half the documents right, some in another
case; the sampled run's from its own first run, which draws the same with the same seeds),
then the tasks run again; the fixture holds the second run: each document's prompt, texts,
filtered answers and exact_match, and each filter's aggregate and standard error. It also
holds Python's `re.findall`/`re.sub`, lm-eval's `RegexFilter` and `exact_match` on
hand-made strings, for the regex dialect, lm-eval's filter pipelines (`take_first_k`,
`majority_vote`) on hand-made lists of responses, lm-eval's `MultiChoiceRegexFilter` on
hand-made responses and documents' choices (and the errors it raises), and lm-eval's own
`gsm8k`, `gsm8k_cot`, `gsm8k_cot_zeroshot`, `gsm8k_cot_self_consistency`, GPQA
chain-of-thought zero-shot,
`mmlu_flan_cot_zeroshot`, `triviaqa`, `nq_open` and translation task settings (what
`eval --preset` sets).

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

    python benches/torch/make_generation_fixture.py --write   # needs lm_eval, transformers, torch
    python benches/torch/make_generation_fixture.py --check   # the committed fixture is lm-eval's
"""

import copy
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FIXTURES = os.path.join("crates", "trainer", "tests", "fixtures")
OUT = os.path.join(FIXTURES, "generation")

# Story-grammar prompts: determiner, adjective, noun, verb, preposition.
DOCS = [
    {"context": "the small cat", "target": "x"},
    {"context": "Question: what sat on the mat?\nAnswer:", "target": "x"},
    {"context": "a big dog ran under the", "target": "x"},
    # Longer than the context less max_gen_toks: cut from the left.
    {
        "context": "the big cat sat on a mat. a small dog ran under the old tree. the red bird "
        "slept near a big box. the old fox jumped on the small log. a big",
        "target": "x",
    },
    # Starts with the BOS text: no special tokens added.
    {"context": "<s>the old fox", "target": "x"},
    {"context": "the café bird", "target": "x"},
    {"context": "a red", "target": "x"},
    {"context": "the old dog slept near", "target": "x"},
]
FEWSHOT = [
    {"context": "the cat sat on the", "target": "mat."},
    {"context": "a small dog ran", "target": "under the tree."},
    {"context": "the red bird", "target": "slept."},
    {"context": "a big fox", "target": "jumped on a log."},
]
SEVERAL = [
    {"context": "the small bird", "target": ["sat.", "x"]},
    {"context": "a old cat", "target": ["ran.", "x"]},
    {"context": "the big box", "target": ["slept.", "x"]},
    {"context": "a red dog sat on", "target": ["the mat.", "x"]},
    {"context": "the old fox", "target": ["jumped.", "x"]},
]

GSM8K_LIKE = [
    {"name": "strict-match", "filter": [
        {"function": "regex", "regex_pattern": r"(\w+)\.", "fallback": "[none]"},
        {"function": "take_first"},
    ]},
    {"name": "flexible-extract", "filter": [
        {"function": "regex", "group_select": -1, "regex_pattern": r"(\w{4,})|(\w+)"},
        {"function": "take_first"},
    ]},
    {"name": "none", "filter": [{"function": "take_first"}]},
]

# lm-eval's gsm8k_cot_self_consistency filters, in miniature: the first answer, the majority
# of all, the majority of the first two. The answer is a text's first vowel, so that the
# random model's varied texts still agree often enough for the majority to differ from the first.
SELF_CONSISTENCY_LIKE = [
    {"name": "score-first", "filter": [
        {"function": "regex", "regex_pattern": r"([aeiou])"},
        {"function": "take_first"},
    ]},
    {"name": "maj", "filter": [
        {"function": "regex", "regex_pattern": r"([aeiou])"},
        {"function": "majority_vote"},
        {"function": "take_first"},
    ]},
    {"name": "maj@2", "filter": [
        {"function": "take_first_k", "k": 2},
        {"function": "regex", "regex_pattern": r"([aeiou])"},
        {"function": "majority_vote"},
        {"function": "take_first"},
    ]},
]

# name, model, tokenizer, documents, task fields, few-shot settings, answers to target.
RUNS = [
    (
        "llama_zero_shot",
        "hf-llama-gqa-untied",
        "llama",
        "docs.jsonl",
        {
            "generation_kwargs": {"until": ["\n", " box"], "do_sample": False, "max_gen_toks": 10},
            "filter_list": GSM8K_LIKE,
            "metric": {"ignore_case": True, "regexes_to_ignore": [",", r"\.$", "(?s).*: "]},
        },
        None,
    ),
    (
        "llama_fewshot_random",
        "hf-llama-gqa-untied",
        "llama",
        "docs.jsonl",
        {
            "generation_kwargs": {"do_sample": False, "max_gen_toks": 8},
            "filter_list": None,
            "metric": {},
        },
        {"shots": 2, "file": "fewshot.jsonl", "sampler": "default", "seed": 1234,
         "description": "Continue.\n", "delimiter": "\n\n"},
    ),
    (
        "gpt2_first_n",
        "hf-gpt2-sharded",
        "story",
        "docs.jsonl",
        {
            "generation_kwargs": {"until": ["."], "do_sample": False, "max_gen_toks": 12},
            "filter_list": [
                {"name": "upper", "filter": [
                    {"function": "remove_whitespace"},
                    {"function": "uppercase"},
                    {"function": "take_first"},
                ]},
                {"name": "last-word", "filter": [
                    {"function": "regex", "regex_pattern": r"[a-z]+", "group_select": -1},
                    {"function": "lowercase"},
                    {"function": "take_first"},
                ]},
            ],
            "metric": {"ignore_punctuation": True, "ignore_numbers": True},
        },
        {"shots": 1, "file": "fewshot.jsonl", "sampler": "first_n", "seed": 1234,
         "description": "", "delimiter": "\n"},
    ),
    (
        "llama_chat",
        "hf-llama-gqa-untied",
        "chat",
        "docs.jsonl",
        {
            "generation_kwargs": {"until": ["\n\n"], "do_sample": False, "max_gen_toks": 6},
            "filter_list": None,
            "metric": {"ignore_case": True},
        },
        {"shots": 1, "file": "fewshot.jsonl", "sampler": "first_n", "seed": 1234,
         "description": "", "delimiter": "\n\n", "system_instruction": "Be brief.",
         "chat": {"multiturn": True}},
    ),
    (
        "llama_several_targets",
        "hf-llama-gqa-untied",
        "llama",
        "several.jsonl",
        {
            "generation_kwargs": {"until": ["."], "do_sample": False, "max_gen_toks": 8},
            "filter_list": [{"name": "stripped", "filter": [
                {"function": "remove_whitespace"}, {"function": "take_first"}]}],
            "metric": {},
        },
        {"shots": 1, "file": None, "sampler": "default", "seed": 3,
         "description": "", "delimiter": "\n\n"},
    ),
    (
        "llama_repeats_greedy",
        "hf-llama-gqa-untied",
        "llama",
        "docs.jsonl",
        {
            "generation_kwargs": {"until": ["\n"], "do_sample": False, "max_gen_toks": 6},
            "repeats": 3,
            "filter_list": SELF_CONSISTENCY_LIKE,
            "metric": {"ignore_case": True},
        },
        None,
    ),
    (
        "llama_sampled_repeats",
        "hf-llama-gqa-untied",
        "llama",
        "sampled.jsonl",
        {
            "generation_kwargs": {"until": ["\n"], "do_sample": True, "temperature": 0.7,
                                  "max_gen_toks": 4},
            "repeats": 5,
            "filter_list": SELF_CONSISTENCY_LIKE,
            "metric": {"ignore_case": True},
        },
        None,
    ),
    (
        "llama_gen_prefix",
        "hf-llama-gqa-untied",
        "llama",
        "docs.jsonl",
        {
            "generation_kwargs": {"until": ["\n"], "do_sample": False, "max_gen_toks": 5},
            "gen_prefix": "The answer is",
            "filter_list": None,
            "metric": {},
        },
        {"shots": 2, "file": "fewshot.jsonl", "sampler": "first_n", "seed": 1234,
         "description": "", "delimiter": "\n\n"},
    ),
    (
        "llama_chat_gen_prefix",
        "hf-llama-gqa-untied",
        "chat",
        "docs.jsonl",
        {
            "generation_kwargs": {"until": ["\n\n"], "do_sample": False, "max_gen_toks": 5},
            "gen_prefix": "Answer:",
            "filter_list": None,
            "metric": {},
        },
        {"shots": 1, "file": "fewshot.jsonl", "sampler": "first_n", "seed": 1234,
         "description": "", "delimiter": "\n\n", "chat": {"multiturn": True}},
    ),
    (
        "llama_chat_single_gen_prefix",
        "hf-llama-gqa-untied",
        "chat",
        "docs.jsonl",
        {
            "generation_kwargs": {"until": ["\n\n"], "do_sample": False, "max_gen_toks": 5},
            "gen_prefix": "So: ",
            "filter_list": None,
            "metric": {},
        },
        {"shots": 1, "file": "fewshot.jsonl", "sampler": "first_n", "seed": 1234,
         "description": "", "delimiter": "\n\n", "system_instruction": "Be brief.",
         "chat": {"multiturn": False}},
    ),
    (
        # Corpus metrics: the first run's texts, edited, are the references.
        "llama_translation",
        "hf-llama-gqa-untied",
        "llama",
        "translation.jsonl",
        {
            "generation_kwargs": {"until": ["\n"], "do_sample": False, "max_gen_toks": 12},
            "filter_list": [
                {"name": "none", "filter": [{"function": "take_first"}]},
                {"name": "first-words", "filter": [
                    {"function": "regex", "regex_pattern": r"^(\S+(?: \S+)?)"},
                    {"function": "take_first"}]},
            ],
            "metric": {},
            "corpus_metrics": ["bleu", "chrf", "chrf++", "ter"],
        },
        None,
    ),
]

# lm-eval's filter pipelines on hand-made responses: (steps, responses).
FILTER_CASES = [
    ([["majority_vote", None], ["take_first", None]], ["7", "8", "8", "7"]),
    ([["majority_vote", None], ["take_first", None]], ["a", "b", "b", "c", "b", "a"]),
    ([["majority_vote", None], ["take_first", None]], ["only"]),
    ([["take_first_k", {"k": 2}], ["majority_vote", None], ["take_first", None]],
     ["x", "y", "y", "y"]),
    ([["regex", {"regex_pattern": r"is (\d+)"}], ["majority_vote", None], ["take_first", None]],
     ["it is 3.", "no answer", "so it is 4", "it is 4!", "hm"]),
    ([["regex", {"regex_pattern": r"is (\d+)"}], ["majority_vote", None], ["take_first", None]],
     ["nothing", "it is 5", "none here", "it is 5", "x"]),
    ([["remove_whitespace", None], ["lowercase", None], ["majority_vote", None],
      ["take_first", None]], [" A", "a ", "B", "b", "b"]),
    ([["take_first_k", {"k": 3}], ["take_first", None]], ["1", "2", "3", "4"]),
    ([["map", {"mapping_dict": {"A": "yes", "B": "no"}, "default_value": "?"}],
      ["majority_vote", None], ["take_first", None]], ["A", "C", "B", "C", "B"]),
    ([["regex", {"regex_pattern": r"\b([AB])\b"}],
      ["map", {"mapping_dict": {"A": "first", "B": "second", "[invalid]": "none"}}],
      ["take_first", None]], ["so B it is"]),
]

# lm-eval's multi_choice_regex on hand-made responses: (arguments, the document's choices,
# responses). GPQA's and MMLU's chain-of-thought settings first; then a choice that starts
# a longer one, Unicode punctuation beside ASCII symbols (which are not punctuation),
# regexes_to_ignore before lower case, a tuple of groups, repeated choices, escaped
# characters, a letter after a colon, and Python's errors.
COT_MULTI_CHOICE = {"group_select": -1, "ignore_case": True, "ignore_punctuation": True,
                    "regex_pattern": r"(\([A-Z]\))"}
MULTI_CHOICE_CASES = [
    (COT_MULTI_CHOICE, ["Paris", "London", "Rome", "Berlin"],
     ["I think (A) but no, (C) is right", "The capital is rome.", "Answer: B", "no idea",
      "London or Paris, then London", "so: D", "(E) of course", "PARIS!"]),
    ({}, ["Guilty", "Guilty of Romance", "Innocent"],
     ["It is Guilty of Romance.", "guilty", "Guilty, then Innocent", "#### 12"]),
    ({"ignore_punctuation": True, "ignore_case": True},
     ["\u00bfQu\u00e9?", "$5 + x", "a\u2014b", "\u00abquote\u00bb", "x_y"],
     ["la respuesta es qu\u00e9", "it is $5 + x!", "ab", "QUOTE", "xy", "x_y"]),
    ({"ignore_punctuation": False}, ["\u00bfQu\u00e9?", "a\u2014b"],
     ["qu\u00e9", "a\u2014b", "ab"]),
    ({"regexes_to_ignore": [r"\bthe\b"], "ignore_case": True}, ["The Cat", "Dog"],
     ["I pick the cat", "THE CAT!", "the dog"]),
    ({"regex_pattern": r"answer is \(([A-D])\)|answer: ([A-D])", "group_select": 0},
     ["red", "green", "blue", "white"],
     ["the answer is (B)", "answer: C", "neither, so green"]),
    ({"regex_pattern": r"(x)?(y)?"}, ["zz", "q"], ["zz", "yq"]),
    ({"regex_pattern": r"is(\s*)\."}, ["it", "one"], ["it is .", "one is  ."]),
    ({}, ["same", "other", "same"], ["same", "other"]),
    ({"fallback": "?"}, ["1.5 (approx)", "2*3", "a|b"],
     ["maybe 2*3 then", "1.5 (approx)", "1x5 (approx)", "a|b", "ab", "answer:c",
      "answer:\n\t A"]),
    # Whitespace that re.escape escapes (a backslash before a tab, newline, \v, \f).
    ({"regex_pattern": "(?!)"}, ["a\tb", "x\ny\x0bz\x0cw"],
     ["so a\tb it", "x\ny\x0bz\x0cw here", "nothing"]),
    ({"group_select": 1}, ["up", "down"], ["up", "up and down"]),
    ({}, None, ["anything"]),
]

# Corpora for lm-eval's bleu, chrf, chrf++ and ter aggregations (sacreBLEU's corpus scores):
# (hypotheses, references). Punctuation and numbers as mteval's 13a tokenizer splits them,
# HTML entities, <skipped>, hyphenated line breaks, trailing spaces, an empty hypothesis, a
# short one (the brevity penalty), orders without a match (exponential smoothing), Unicode,
# no match at all, one document, and a seeded random corpus for the bootstrap.
def _random_corpus(seed, n):
    import random

    words = ["the", "cat", "sat", "on", "a", "mat", ".", ",", "dog", "ran", "3.5", "big",
             "Haus", "grün", "(", ")", "it's", "1,000"]
    rnd = random.Random(seed)
    hyps, refs = [], []
    for _ in range(n):
        ref = [rnd.choice(words) for _ in range(rnd.randint(3, 12))]
        hyp = [w if rnd.random() < 0.7 else rnd.choice(words) for w in ref]
        if rnd.random() < 0.3:
            hyp = hyp[: rnd.randint(1, len(hyp))]
        refs.append(" ".join(ref))
        hyps.append(" ".join(hyp))
    return hyps, refs


def _shuffled_corpus(seed, n, length):
    import random

    rnd = random.Random(seed)
    hyps, refs = [], []
    for _ in range(n):
        ref = [rnd.choice("abcdef") for _ in range(length)]
        hyp = list(ref)
        for _ in range(length // 4):
            i, j = rnd.randrange(length), rnd.randrange(length)
            hyp[i], hyp[j] = hyp[j], hyp[i]
        refs.append(" ".join(ref))
        hyps.append(" ".join(hyp))
    return hyps, refs


CORPUS_CASES = [
    (["The cat sat on the mat.", "It costs $3.50, or 1,000 yen.", "Well-known 5-4 results!",
      "She said &quot;hi&quot; &amp; left", "a <skipped>line-\nbreak", "trailing space   "],
     ["The cat sat on a mat.", "It costs $3.50 or 1,000 yen.", "Well known 5-4 results.",
      "She said \"hi\" & left.", "a linebreak", "trailing space"]),
    (["", "short", "the big dog ran far away today", "(x) [y] {z}"],
     ["something here", "a much longer reference sentence", "the big dog ran away",
      "(x) [y] {z}"]),
    (["Das Haus ist grün.", "\u4eca\u5929\u5929\u6c14\u5f88\u597d", "caf\u00e9 au lait"],
     ["Das Haus ist gr\u00fcn.", "\u4eca\u5929\u5929\u6c14\u597d", "caf\u00e9 au lait"]),
    (["alpha beta", "gamma"], ["delta epsilon", "zeta eta"]),
    (["one two three four five"], ["one two three four six"]),
    _random_corpus(7, 40),
    # TER: phrases to shift, case (TER compares in lower case), a reference 60 times longer
    # than its hypothesis and the reverse (a wider band), empty sides, and shuffled long
    # sentences of few words (many shift candidates, past Tercom's 1000).
    (["the cat sat on the mat today", "a b c d e f", "on the mat the cat sat", "The CAT",
      "x y", " ".join(["w%d" % (i % 7) for i in range(130)]), "", "words"],
     ["today the cat sat on the mat", "d e f a b c", "the cat sat on the mat", "the cat",
      " ".join(["w%d" % (i % 5) for i in range(120)]), "w1 w2 w3", "", ""]),
    _shuffled_corpus(3, 4, 36),
    # Long enough that one sentence tries Tercom's 1000 shift candidates (scores only: 100
    # resamples of it would take minutes in Python).
    _shuffled_corpus(5, 2, 60) + (False,),
]
TOKENIZE_13A_CASES = [
    "Hello, world! It's 3.5-4 (approx.) &amp; <skipped>done-\nok",
    "a.b,c 1.000,5 x,1 .5 5. -3 3- $10/20 ~{tilde}",
    "tab\there\u00a0nbsp\u2003em",
]

# Python's regex dialect: (pattern, text) for findall and sub, and lm-eval's RegexFilter.
REGEX_CASES = [
    (r"#### (\-?[0-9\.\,]+)", "so 3 + 4 = 7.\n#### 7.\nQuestion"),
    (r"(-?[$0-9.,]{2,})|(-?[0-9]+)", "a 7 b $12.5, c 3"),
    (r"\.$", "72.\n"),
    (r"\.$", "7.2."),
    (r"(?s).*#### ", "x\n#### 12"),
    (r"x*", "abxd"),
    (r"a\Z", "aa"),
    (r"{x}", "a{x}b"),
    (r"a{,2}", "aaab"),
    (r"[][&~]", "a[b]&c~"),
    (r"(?m)x$", "x\nx\n"),
    (r"(?<=\$)\d+", "cost $12 and $3"),
    (r"(\w)(\d)?", "a1 b c2"),
    (r"é+", "café éé"),
    (r"\bthe\b", "the other theme, the"),
]
EXACT_MATCH_CASES = [
    ("Dog.", ["dog"], {"ignore_case": True, "regexes_to_ignore": [r"\.$"]}),
    ("A, B!", ["a b"], {"ignore_case": True, "ignore_punctuation": True}),
    ("x12y", ["xy"], {"ignore_numbers": True}),
    ("1,000", ["1000"], {"regexes_to_ignore": [","]}),
    ("The answer: 5", ["5"], {"regexes_to_ignore": ["(?s).*: "]}),
    ("ÉTÉ", ["été"], {"ignore_case": True}),
    ("cat", ["dog", "cat"], {}),
    ("cat ", ["cat"], {}),
]


def regex_cases():
    import re

    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    cases = []
    for pattern, text in REGEX_CASES:
        found = re.findall(pattern, text)
        filtered = {}
        for select in (0, -1):
            f = RegexFilter(regex_pattern=pattern, group_select=select, fallback="[fb]")
            filtered[str(select)] = list(f.apply([[text]], None))[0][0]
        cases.append({
            "pattern": pattern,
            "text": text,
            "findall": [list(m) if isinstance(m, tuple) else m for m in found],
            "sub": re.sub(pattern, "", text),
            "filtered": filtered,
        })
    matches = []
    for answer, targets, kwargs in EXACT_MATCH_CASES:
        score = exact_match_hf_evaluate(
            predictions=[answer] * len(targets), references=targets, **kwargs
        )["exact_match"]
        matches.append({"answer": answer, "targets": targets, "kwargs": kwargs,
                        "exact_match": bool(score > 0)})
    from lm_eval.api.registry import get_filter

    pipelines = []
    for steps, responses in FILTER_CASES:
        resps = [list(responses)]
        for name, kwargs in steps:
            resps = get_filter(name)(**(kwargs or {})).apply(resps, None)
        pipelines.append({"steps": steps, "responses": responses, "answer": list(resps)[0]})
    from lm_eval.filters.extraction import MultiChoiceRegexFilter

    multi_choice = []
    for kwargs, choices, responses in MULTI_CHOICE_CASES:
        doc = {} if choices is None else {"choices": choices}
        case = {"kwargs": kwargs, "choices": choices, "responses": responses}
        try:
            case["answers"] = MultiChoiceRegexFilter(**kwargs).apply([responses], [doc])[0]
        except (IndexError, KeyError) as e:
            case["error"] = type(e).__name__
        multi_choice.append(case)
    return {"regex": cases, "exact_match": matches, "filters": pipelines,
            "multi_choice": multi_choice}


def corpus_metric_cases():
    """lm-eval's bleu, chrf, chrf++ and ter aggregations and their bootstrap standard errors (100
    resamples, as lm-eval caps them) on hand-made corpora; sacreBLEU's 13a tokenizer."""
    import sacrebleu
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    from lm_eval.api import metrics

    os.environ["DISABLE_MULTIPROC"] = "1"
    corpora = []
    for hyps, refs, *bootstrap in CORPUS_CASES:
        items = list(zip(refs, hyps))
        case = {"hypotheses": hyps, "references": refs, "bootstrapped": bootstrap != [False]}
        for name, fn in (("bleu", metrics.bleu), ("chrf", metrics.chrf),
                         ("chrf++", metrics.chrfpp), ("ter", metrics.ter)):
            case[name] = fn(items)
            if len(items) > 1 and bootstrap != [False]:
                case[name + "_stderr"] = metrics.bootstrap_stderr(fn, items, iters=100)
        corpora.append(case)
    tokenizer = Tokenizer13a()
    return {
        "sacrebleu": sacrebleu.__version__,
        "corpora": corpora,
        "tokenize_13a": [{"text": t, "tokens": tokenizer(t).split()} for t in TOKENIZE_13A_CASES],
    }


def gsm8k_settings():
    """lm-eval's own gsm8k task: what `headroom eval --preset gsm8k` must set."""
    import yaml
    import lm_eval

    path = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "gsm8k", "gsm8k.yaml")
    with open(path, encoding="utf-8") as f:
        task = yaml.safe_load(f)
    metric = {k: v for k, v in task["metric_list"][0].items()
              if k not in ("metric", "aggregation", "higher_is_better")}
    return {
        "until": task["generation_kwargs"]["until"],
        "do_sample": task["generation_kwargs"]["do_sample"],
        "filter_list": task["filter_list"],
        "metric": metric,
        "num_fewshot": task["num_fewshot"],
        "version": task["metadata"]["version"],
    }


def self_consistency_settings():
    """lm-eval's own gsm8k_cot_self_consistency task (with the gsm8k-cot.yaml it includes):
    what `headroom eval --preset gsm8k_cot_self_consistency` must set."""
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    path = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "gsm8k",
                        "gsm8k-cot-self-consistency.yaml")
    task = load_yaml(path)
    metric = {k: v for k, v in task["metric_list"][0].items()
              if k not in ("metric", "aggregation", "higher_is_better")}
    return {
        "until": task["generation_kwargs"]["until"],
        "do_sample": task["generation_kwargs"]["do_sample"],
        "temperature": task["generation_kwargs"]["temperature"],
        "repeats": task["repeats"],
        "filter_list": task["filter_list"],
        "metric": metric,
        "num_fewshot": task["num_fewshot"],
        "fewshot_sampler": task["fewshot_config"]["sampler"],
        "fewshot_samples": task["fewshot_config"]["samples"],
        "doc_to_text": task["doc_to_text"],
        "target_delimiter": task.get("target_delimiter", " "),
        "fewshot_delimiter": task.get("fewshot_delimiter", "\n\n"),
        "version": task["metadata"]["version"],
    }


def task_settings(*parts):
    """One lm-eval task's YAML (with what it includes) under `lm_eval/tasks/<parts>`: what
    `headroom eval --preset <task>` must set."""
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    task = load_yaml(os.path.join(os.path.dirname(lm_eval.__file__), "tasks", *parts))
    kwargs = task["generation_kwargs"]
    return {
        "until": kwargs["until"],
        "do_sample": kwargs["do_sample"],
        "temperature": kwargs.get("temperature"),
        "filter_list": task.get("filter_list"),
        # The first metric's settings (exact_match's, where it is first).
        "metric": {k: v for k, v in task["metric_list"][0].items()
                   if k not in ("metric", "aggregation", "higher_is_better")},
        "metrics": [m["metric"] for m in task["metric_list"]],
        "num_fewshot": task.get("num_fewshot", 0),
        "repeats": task.get("repeats", 1),
        "description": task.get("description"),
        "fewshot_delimiter": task.get("fewshot_delimiter", "\n\n"),
        "target_delimiter": task.get("target_delimiter", " "),
        "fewshot_config": task.get("fewshot_config"),
        "doc_to_text": task["doc_to_text"],
        "doc_to_target": task["doc_to_target"],
        "version": task["metadata"]["version"],
    }


# The presets checked against their tasks' YAML, by group: task name, path under tasks/.
PRESET_TASKS = {
    "multi_choice_tasks": {
        "gpqa_main_cot_zeroshot": ("gpqa", "cot_zeroshot", "gpqa_main_cot_zeroshot.yaml"),
        "gpqa_diamond_cot_zeroshot": ("gpqa", "cot_zeroshot", "gpqa_diamond_cot_zeroshot.yaml"),
        "gpqa_extended_cot_zeroshot": ("gpqa", "cot_zeroshot",
                                       "gpqa_extended_cot_zeroshot.yaml"),
        # Every subject's task is the template and its description.
        "mmlu_flan_cot_zeroshot": ("mmlu", "flan_cot_zeroshot", "mmlu_abstract_algebra.yaml"),
    },
    "gsm8k_cot_tasks": {
        "gsm8k_cot": ("gsm8k", "gsm8k-cot.yaml"),
        "gsm8k_cot_zeroshot": ("gsm8k", "gsm8k-cot-zeroshot.yaml"),
    },
    "open_qa_tasks": {
        "triviaqa": ("triviaqa", "default.yaml"),
        "nq_open": ("nq_open", "nq_open.yaml"),
    },
    "translation_tasks": {
        name.replace("_", "-"): ("translation", name + ".yaml")
        for name in ["wmt14_en-fr", "wmt14_fr-en", "wmt16_de-en", "wmt16_en-de", "wmt16_en-ro",
                     "wmt16_ro-en", "iwslt2017_en-ar", "iwslt2017_ar-en"]
    },
}


def mmlu_subject_settings():
    """Each `mmlu_flan_cot_zeroshot_<subject>` task: its description, and whether the rest
    of its settings are the template's (`mmlu_flan_cot_zeroshot` in PRESET_TASKS)."""
    import lm_eval

    folder = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "mmlu", "flan_cot_zeroshot")
    template = task_settings(*PRESET_TASKS["multi_choice_tasks"]["mmlu_flan_cot_zeroshot"])
    subjects = {}
    for file in sorted(os.listdir(folder)):
        if not (file.startswith("mmlu_") and file.endswith(".yaml")):
            continue
        settings = task_settings("mmlu", "flan_cot_zeroshot", file)
        description = settings.pop("description")
        rest = {k: v for k, v in template.items() if k != "description"}
        subjects["mmlu_flan_cot_zeroshot_" + file[len("mmlu_"):-len(".yaml")]] = {
            "description": description,
            "template_otherwise": settings == rest,
        }
    return subjects


def run_task(directory, docs_path, fewshot_path, fields, fewshot, tmp, tag):
    """One lm-eval generation run: each document's prompt, text, and per filter its answer and
    exact_match; each filter's aggregate and standard error."""
    from make_choices_fixture import evaluate_task, json_task

    task_dir = os.path.join(tmp, "generate-" + tag)
    os.makedirs(task_dir, exist_ok=True)
    extra = {}
    if fields.get("repeats"):
        extra["repeats"] = fields["repeats"]
    if fields.get("gen_prefix"):
        extra["gen_prefix"] = fields["gen_prefix"]
    if fields["filter_list"]:
        extra["filter_list"] = fields["filter_list"]
    if fewshot:
        extra.update({
            "fewshot_split": "fewshot" if fewshot["file"] else "test",
            "fewshot_config": {"sampler": fewshot["sampler"]},
            "description": fewshot["description"],
            "fewshot_delimiter": fewshot["delimiter"],
        })
    task = json_task(
        "headroom_generate",
        docs_path,
        "generate_until",
        fewshot_path=fewshot_path if fewshot and fewshot["file"] else None,
        doc_to_text="context",
        doc_to_target="target",
        generation_kwargs=copy.deepcopy(fields["generation_kwargs"]),
        metric_list=[{"metric": m} for m in fields["corpus_metrics"]]
        if fields.get("corpus_metrics")
        else [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
               **fields["metric"]}],
        **extra,
    )
    results = evaluate_task(
        directory,
        task,
        task_dir,
        num_fewshot=fewshot["shots"] if fewshot else 0,
        fewshot_seed=fewshot["seed"] if fewshot else 0,
        chat=fewshot.get("chat") if fewshot else None,
        system_instruction=fewshot.get("system_instruction") if fewshot else None,
    )
    samples = results["samples"]["headroom_generate"]
    names = [f["name"] for f in fields["filter_list"]] if fields["filter_list"] else ["none"]
    per_doc = {}
    for s in samples:
        d = per_doc.setdefault(s["doc_id"], {
            "prompt": s["arguments"][0][0],
            "response": s["resps"][0][0],
            **({"responses": s["resps"][0]} if fields.get("repeats") else {}),
            "filtered": {},
            "exact_match": {},
        })
        d["filtered"][s["filter"]] = s["filtered_resps"][0]
        if "exact_match" in s:
            d["exact_match"][s["filter"]] = bool(s["exact_match"])
    aggregate = results["results"]["headroom_generate"]
    corpus = fields.get("corpus_metrics")
    if corpus:
        return {
            "filters": names,
            "docs": [per_doc[i] for i in sorted(per_doc)],
            "corpus": {m: {n: aggregate[f"{m},{n}"] for n in names} for m in corpus},
            "corpus_stderr": {m: {n: aggregate[f"{m}_stderr,{n}"] for n in names}
                              for m in corpus},
        }
    return {
        "filters": names,
        "docs": [per_doc[i] for i in sorted(per_doc)],
        "metrics": {n: aggregate["exact_match," + n] for n in names},
        "stderr": {n: aggregate["exact_match_stderr," + n] for n in names},
    }


def write_jsonl(path, docs):
    text = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text


def make():
    import lm_eval
    import transformers

    from make_choices_fixture import model_dir, tokenizer_dirs

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = tokenizer_dirs(tmp)
        fewshot_path = os.path.join(tmp, "fewshot.jsonl")
        files = {"fewshot.jsonl": write_jsonl(fewshot_path, FEWSHOT)}
        # First run: the answers, from which the targets are set.
        docs = copy.deepcopy(DOCS)
        several = copy.deepcopy(SEVERAL)
        write_jsonl(os.path.join(tmp, "docs.jsonl"), docs)
        write_jsonl(os.path.join(tmp, "several.jsonl"), several)
        name, model, tok, _, fields, fewshot = RUNS[0]
        first = run_task(model_dir(tmp, model, tokenizers[tok]), os.path.join(tmp, "docs.jsonl"),
                         fewshot_path, fields, fewshot, tmp, "first")
        for i, (doc, got) in enumerate(zip(docs, first["docs"])):
            if i % 2 == 0:
                # Right under flexible-extract; in upper case on every fourth (ignore_case).
                answer = got["filtered"]["flexible-extract"]
                doc["target"] = answer.upper() if i % 4 == 0 else answer
        name, model, tok, _, fields, fewshot = RUNS[4]
        first = run_task(model_dir(tmp, model, tokenizers[tok]),
                         os.path.join(tmp, "several.jsonl"), fewshot_path, fields, fewshot, tmp,
                         "first-several")
        for i, (doc, got) in enumerate(zip(several, first["docs"])):
            if i % 2 == 1:
                # The second target right (the example shows the first, unchanged).
                doc["target"][1] = got["filtered"]["stripped"]
        # The sampled run's targets: the majority answer on even documents, the first
        # answer on every third (torch draws the same again with the same seeds).
        sampled = [{"context": d["context"], "target": "x"} for d in DOCS[:5]]
        write_jsonl(os.path.join(tmp, "sampled.jsonl"), sampled)
        name, model, tok, _, fields, fewshot = RUNS[6]
        first = run_task(model_dir(tmp, model, tokenizers[tok]),
                         os.path.join(tmp, "sampled.jsonl"), fewshot_path, fields, fewshot, tmp,
                         "first-sampled")
        for i, (doc, got) in enumerate(zip(sampled, first["docs"])):
            if i % 2 == 0:
                doc["target"] = got["filtered"]["maj"]
            elif i % 3 == 0:
                doc["target"] = got["filtered"]["score-first"]
        # The translation run's references: a text as it came, a text with its last word
        # changed, or an unrelated sentence, in turn.
        translation = [{"context": d["context"], "target": "x"} for d in DOCS]
        translation_path = os.path.join(tmp, "translation.jsonl")
        write_jsonl(translation_path, translation)
        name, model, tok, _, fields, fewshot = next(r for r in RUNS
                                                    if r[0] == "llama_translation")
        first = run_task(model_dir(tmp, model, tokenizers[tok]), translation_path, fewshot_path,
                         fields, fewshot, tmp, "first-translation")
        for i, (doc, got) in enumerate(zip(translation, first["docs"])):
            words = got["response"].split()
            if i % 3 == 0 and words:
                doc["target"] = got["response"]
            elif i % 3 == 1 and words:
                doc["target"] = " ".join(words[:-1] + ["zebra"])
            else:
                doc["target"] = "an unrelated reference sentence"
        files["translation.jsonl"] = write_jsonl(translation_path, translation)
        files["docs.jsonl"] = write_jsonl(os.path.join(tmp, "docs.jsonl"), docs)
        files["several.jsonl"] = write_jsonl(os.path.join(tmp, "several.jsonl"), several)
        files["sampled.jsonl"] = write_jsonl(os.path.join(tmp, "sampled.jsonl"), sampled)
        fixture = {
            "lm_eval": lm_eval.__version__,
            "transformers": transformers.__version__,
            "runs": {},
        }
        for name, model, tok, docs_file, fields, fewshot in RUNS:
            directory = model_dir(tmp, model, tokenizers[tok])
            result = run_task(directory, os.path.join(tmp, docs_file), fewshot_path, fields,
                              fewshot, tmp, name)
            fixture["runs"][name] = {
                "model": model,
                "tokenizer": tok,
                "docs_file": docs_file,
                "generation_kwargs": fields["generation_kwargs"],
                "repeats": fields.get("repeats", 1),
                **({"gen_prefix": fields["gen_prefix"]} if fields.get("gen_prefix") else {}),
                "filter_list": fields["filter_list"],
                "metric": fields["metric"],
                **({"corpus_metrics": fields["corpus_metrics"]}
                   if fields.get("corpus_metrics") else {}),
                **({"fewshot": fewshot} if fewshot else {}),
                **result,
            }
        fixture["python"] = regex_cases()
        fixture["gsm8k"] = gsm8k_settings()
        fixture["gsm8k_cot_self_consistency"] = self_consistency_settings()
        fixture["corpus_metrics"] = corpus_metric_cases()
        for group, tasks in PRESET_TASKS.items():
            fixture[group] = {name: task_settings(*parts) for name, parts in tasks.items()}
        fixture["mmlu_flan_cot_subjects"] = mmlu_subject_settings()
    return fixture, files


def main():
    if "--quick" in sys.argv:
        sys.exit(3)
    fixture, files = make()
    fixture_path = os.path.join(OUT, "lm_eval_generation.json")
    if "--write" in sys.argv:
        os.makedirs(OUT, exist_ok=True)
        for name, text in files.items():
            with open(os.path.join(OUT, name), "w", encoding="utf-8") as f:
                f.write(text)
        with open(fixture_path, "w", encoding="utf-8") as f:
            json.dump(fixture, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"wrote {fixture_path} and the documents beside it")
    elif "--check" in sys.argv:
        with open(fixture_path, encoding="utf-8") as f:
            committed = json.load(f)
        if committed != json.loads(json.dumps(fixture)):
            raise SystemExit(f"{fixture_path} differs from what lm-eval writes now")
        for name, text in files.items():
            with open(os.path.join(OUT, name), encoding="utf-8") as f:
                if f.read() != text:
                    raise SystemExit(f"{name} differs from what this script writes")
        print(f"{fixture_path} matches lm-eval {fixture['lm_eval']}")
    else:
        raise SystemExit("pass --write or --check")


if __name__ == "__main__":
    main()
