"""Write the sampling fixture that crates/trainer/tests/sample.rs reads.

1. `warpers`: random logits put through transformers' own logits processors in the order
   `GenerationMixin._get_logits_processor` builds them for `generate(do_sample=True)`:
   `RepetitionPenaltyLogitsProcessor`, `TemperatureLogitsWarper`, `TopKLogitsWarper`,
   `TopPLogitsWarper`, `MinPLogitsWarper`. Each case keeps the ids left with a finite score
   and the softmax of the processed scores over them (what `generate` draws from).
   - Top-p and min-p cut at a threshold computed in f32 here and in f64 by headroom, so a
     case is redrawn when a cumulative probability (or a probability ratio) lies within 1e-4
     of its cut: the kept set is then the same in any precision.
   - Some cases have integer logits with top-k alone, so that ties at the k-th score occur
     (transformers keeps every tied token).
2. `greedy`: `generate(do_sample=False)` on the committed `hf-llama-gqa-untied` fixture, with
   and without `repetition_penalty`: greedy search applies the penalty and nothing else.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

    python benches/torch/make_sampling_fixture.py --write
"""

import json
import os
import sys

import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

FIXTURES = os.path.join("crates", "trainer", "tests", "fixtures")
OUT = os.path.join(FIXTURES, "sampling.json")
MODEL = os.path.join(FIXTURES, "hf-llama-gqa-untied")
MARGIN = 1e-4


def processors(case):
    p = []
    if case["repetition_penalty"] is not None:
        p.append(RepetitionPenaltyLogitsProcessor(case["repetition_penalty"]))
    if case["temperature"] != 1.0:
        p.append(TemperatureLogitsWarper(case["temperature"]))
    if case["top_k"] is not None:
        p.append(TopKLogitsWarper(top_k=case["top_k"], min_tokens_to_keep=1))
    if case["top_p"] is not None:
        p.append(TopPLogitsWarper(top_p=case["top_p"], min_tokens_to_keep=1))
    if case["min_p"] is not None:
        p.append(MinPLogitsWarper(min_p=case["min_p"], min_tokens_to_keep=1))
    return LogitsProcessorList(p)


def far_from_cuts(case, logits, history):
    """Whether no top-p or min-p decision is within MARGIN of its threshold (f64)."""
    steps = processors(case)
    s = logits.clone()[None, :]
    ids = torch.tensor([history], dtype=torch.long) if history else torch.zeros((1, 0), dtype=torch.long)
    for step in steps:
        if isinstance(step, TopPLogitsWarper):
            probs = torch.softmax(s[0].double(), dim=-1)
            cum = torch.sort(probs).values.cumsum(0)
            if (cum - (1 - case["top_p"])).abs().min().item() < MARGIN:
                return False
        if isinstance(step, MinPLogitsWarper):
            probs = torch.softmax(s[0].double(), dim=-1)
            ratio = probs / probs.max()
            if (ratio - case["min_p"]).abs().min().item() < MARGIN:
                return False
        s = step(ids, s)
    return True


def warper_cases(gen):
    def uniform(lo, hi):
        return lo + (hi - lo) * torch.rand((), generator=gen).item()

    def maybe(p):
        return torch.rand((), generator=gen).item() < p

    cases = []
    while len(cases) < 48:
        vocab = int(torch.randint(8, 160, (), generator=gen))
        ties = len(cases) % 6 == 5
        if ties:
            logits = torch.randint(-3, 4, (vocab,), generator=gen).float()
        else:
            logits = torch.randn(vocab, generator=gen) * uniform(0.5, 4.0)
        history = torch.randint(0, vocab, (int(torch.randint(0, 24, (), generator=gen)),), generator=gen).tolist()
        case = {
            "temperature": [0.6, 1.0, 1.4][int(torch.randint(0, 3, (), generator=gen))],
            "top_k": int(torch.randint(1, vocab + 1, (), generator=gen)) if (ties or maybe(0.4)) else None,
            "top_p": None if ties or not maybe(0.6) else round(uniform(0.05, 0.99), 4),
            "min_p": None if ties or not maybe(0.4) else round(uniform(0.005, 0.5), 4),
            "repetition_penalty": None if ties or not maybe(0.5) else round(uniform(1.05, 1.8), 3),
        }
        if not far_from_cuts(case, logits, history):
            continue
        ids = torch.tensor([history], dtype=torch.long) if history else torch.zeros((1, 0), dtype=torch.long)
        scores = processors(case)(ids, logits.clone()[None, :])[0]
        kept = torch.isfinite(scores).nonzero().flatten()
        probs = torch.softmax(scores, dim=-1)[kept]
        case.update(
            logits=logits.tolist(),
            history=history,
            kept=kept.tolist(),
            probs=probs.tolist(),
        )
        cases.append(case)
    return cases


def greedy_cases():
    model = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="eager").eval()
    out = []
    for prompt in ([1, 5, 9, 5], [3, 3, 3], [40, 41, 7, 90, 12]):
        for penalty in (None, 1.3, 2.0):
            ids = torch.tensor([prompt])
            kwargs = dict(max_new_tokens=20, do_sample=False, top_k=None, top_p=None, temperature=None)
            if penalty is not None:
                kwargs["repetition_penalty"] = penalty
            with torch.no_grad():
                seq = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs)
            out.append(
                {
                    "prompt": prompt,
                    "repetition_penalty": penalty,
                    "eos_token_id": model.generation_config.eos_token_id,
                    "new_tokens": seq[0, len(prompt):].tolist(),
                }
            )
    return out


def main():
    import transformers

    gen = torch.Generator().manual_seed(20261125)
    fixture = {
        "written_by": f"benches/torch/make_sampling_fixture.py, transformers {transformers.__version__}, torch {torch.__version__}",
        "warpers": warper_cases(gen),
        "greedy": greedy_cases(),
    }
    with open(OUT, "w") as f:
        json.dump(fixture, f)
        f.write("\n")
    print(f"wrote {OUT}: {len(fixture['warpers'])} warper cases, {len(fixture['greedy'])} greedy runs")


if __name__ == "__main__":
    if "--write" not in sys.argv[1:]:
        print("writes fixtures only with --write (not a comparison bench)", file=sys.stderr)
        sys.exit(3)
    main()
