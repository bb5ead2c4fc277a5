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
3. `generation_configs`: `generation_config.json` files (Llama 3.1 and Qwen 2.5 Instruct's
   kind, unset and null values, a top-k of 0) with settings given beside them, and what
   `generate` makes of them: greedy or sampling, the logits processors it builds in order with
   their parameters, the end ids; or its error.
4. `stop_strings`: transformers' `StopStringCriteria` (`generate(stop_strings=…)`) after every
   token of sequences from a SentencePiece-style and a byte-level tokenizer, for stop strings
   cut from their own text at random places and ones they never hold.

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


# generation_config.json files (in the style of released models': Llama 3.1 Instruct's,
# Qwen 2.5 Instruct's, and edge cases) and the settings a user gives with them (`sample`'s
# flags: a sampling setting passes do_sample=True, a temperature of 0 do_sample=False).
LLAMA31 = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
           "temperature": 0.6, "top_p": 0.9}
QWEN25 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
          "pad_token_id": 151643, "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20,
          "top_p": 0.8}
GENERATION_CONFIG_CASES = [
    ({"eos_token_id": 2}, {}),
    (LLAMA31, {}),
    (QWEN25, {}),
    ({"do_sample": True}, {}),
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, {}),
    ({"do_sample": True, "top_k": 0, "min_p": 0.05, "eos_token_id": None}, {}),
    ({"do_sample": True, "top_k": None, "temperature": None}, {}),
    ({"do_sample": True, "repetition_penalty": 1.0, "top_p": 1.0}, {}),
    (LLAMA31, {"temperature": 0.0}),
    (QWEN25, {"temperature": 0.0}),
    (LLAMA31, {"temperature": 1.2, "top_k": 5}),
    ({"eos_token_id": 2}, {"top_p": 0.5}),
    ({"eos_token_id": 2}, {"temperature": 0.8}),
    ({"eos_token_id": 2}, {"repetition_penalty": 1.3}),
    (QWEN25, {"repetition_penalty": 1.0, "top_k": 0}),
    (QWEN25, {"min_p": 0.1}),
    ({"do_sample": True, "temperature": 0.0}, {}),
]


def generation_config_cases():
    """What transformers' `generate` builds from each generation_config.json and settings:
    greedy or sampling, its logits processors in order with their parameters, and the end
    ids; or its error."""
    import tempfile

    from transformers import GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="eager").eval()
    out = []
    for config, asked in GENERATION_CONFIG_CASES:
        case = {"generation_config": config, "asked": asked}
        kwargs = dict(asked)
        if kwargs.get("temperature") == 0.0:
            kwargs = {k: v for k, v in kwargs.items() if k != "temperature"}
            kwargs["do_sample"] = False
        elif any(k in kwargs for k in ("temperature", "top_k", "top_p", "min_p")):
            kwargs["do_sample"] = True
        try:
            with tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(tmp, "generation_config.json"), "w") as f:
                    json.dump(config, f)
                model.generation_config = GenerationConfig.from_pretrained(tmp)
            resolved, _ = model._prepare_generation_config(None, **kwargs)
            steps = model._get_logits_processor(resolved, input_ids_seq_length=3, device="cpu")
            eos = resolved.eos_token_id
            case["sampling"] = resolved.get_generation_mode() == "sample"
            case["processors"] = [
                [type(p).__name__, getattr(p, "penalty", None) or getattr(p, "temperature", None)
                 or getattr(p, "top_k", None) or getattr(p, "top_p", None) or getattr(p, "min_p", None)]
                for p in steps
            ]
            case["eos_token_id"] = [] if eos is None else eos if isinstance(eos, list) else [eos]
        except Exception as e:  # the Rust test checks that headroom refuses it too
            case["error"] = f"{type(e).__name__}: {e}"[:300]
        out.append(case)
    return out


def stop_string_cases():
    """transformers' `StopStringCriteria` over every prefix of token sequences, for a
    SentencePiece-style tokenizer (Metaspace decoder, the story tokenizer) and a byte-level one
    (GPT-2's kind): after which tokens it fires for each set of stop strings. The stop strings
    are pieces of the sequence's own text, cut at random places (inside tokens, across them,
    inside a multi-byte character's token pieces), and strings it never holds."""
    from transformers import PreTrainedTokenizerFast, StopStringCriteria

    gen = torch.Generator().manual_seed(20261130)
    texts = {
        "tokenizer/story/tokenizer.json": "the small dog saw a big cat. the cat ran to the sun.",
        "tokenizer/tokenizer.json": open(
            os.path.join(FIXTURES, "tokenizer", "gpt2-text.txt"), encoding="utf-8"
        ).read()[:260],
    }
    out = []
    for name, text in texts.items():
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(FIXTURES, name))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        decoded = tok.decode(ids)
        pieces = []
        while len(pieces) < 24:
            start = int(torch.randint(0, len(decoded) - 1, (), generator=gen))
            length = int(torch.randint(1, 9, (), generator=gen))
            piece = decoded[start:start + length]
            if piece.strip() and piece not in pieces:
                pieces.append(piece)
        sets = [[p] for p in pieces] + [[pieces[i], pieces[i + 1]] for i in range(0, 8, 2)]
        sets += [["zq"], ["the", "zq"], [decoded[-3:]]]
        for stops in sets:
            case = {"tokenizer": name, "ids": ids, "stop_strings": stops}
            try:
                criteria = StopStringCriteria(tokenizer=tok, stop_strings=stops)
            except ValueError as e:  # no token can end one of them: transformers refuses
                case["error"] = str(e)[:200]
                out.append(case)
                continue
            case["fired_after"] = [
                n
                for n in range(1, len(ids) + 1)
                if bool(criteria(torch.tensor([ids[:n]]), None)[0])
            ]
            out.append(case)
    return out


def stop_string_generations():
    """Greedy `generate(stop_strings=…)` on the committed Llama with the story tokenizer: the
    stop strings are pieces of the continuation it writes without them (ending inside a token,
    and spanning the prompt's end), so generation stops early; the end ids are the model's and
    the tokenizer's `</s>` (headroom stops at both), and ids the tokenizer lacks are never
    drawn."""
    from transformers import PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="eager").eval()
    tok = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(FIXTURES, "tokenizer", "story", "tokenizer.json")
    )
    out = []
    for text in ("the small dog", "a cat saw", "the sun ran to", "big old tree"):
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt])
        # Ids past the tokenizer's are never drawn, as headroom's sampler draws none it cannot
        # decode.
        kwargs = dict(max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids),
                      pad_token_id=0, eos_token_id=[model.generation_config.eos_token_id, 1],
                      suppress_tokens=list(range(len(tok), model.config.vocab_size)))
        with torch.no_grad():
            free = model.generate(ids, **kwargs)[0, len(prompt):].tolist()
        continuation = tok.decode(free)
        whole = tok.decode(prompt + free)
        tail = len(whole) - len(continuation)
        for stop in (continuation[4:7], continuation[9:10], whole[tail - 2 : tail + 2]):
            if not stop.strip():
                continue
            with torch.no_grad():
                seq = model.generate(ids, stop_strings=[stop], tokenizer=tok, **kwargs)
            out.append({"prompt": prompt, "free": free, "stop": stop,
                        "new_tokens": seq[0, len(prompt):].tolist(),
                        "text": tok.decode(seq[0].tolist())})
    return out


def main():
    import transformers

    gen = torch.Generator().manual_seed(20261125)
    fixture = {
        "written_by": f"benches/torch/make_sampling_fixture.py, transformers {transformers.__version__}, torch {torch.__version__}",
        "warpers": warper_cases(gen),
        "greedy": greedy_cases(),
        "generation_configs": generation_config_cases(),
        "stop_strings": stop_string_cases(),
        "stop_string_generations": stop_string_generations(),
    }
    with open(OUT, "w") as f:
        json.dump(fixture, f)
        f.write("\n")
    print(
        f"wrote {OUT}: {len(fixture['warpers'])} warper cases, {len(fixture['greedy'])} greedy runs, "
        f"{len(fixture['generation_configs'])} generation configs, "
        f"{len(fixture['stop_strings'])} stop-string cases"
    )


if __name__ == "__main__":
    if "--write" not in sys.argv[1:]:
        print("writes fixtures only with --write (not a comparison bench)", file=sys.stderr)
        sys.exit(3)
    main()
