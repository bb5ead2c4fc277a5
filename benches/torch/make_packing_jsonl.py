"""Write synthetic prompt-completion conversations of spread-out lengths, for the packing
measurements in benches/results/2026-11-30-cpu-2core-packed-documents.md.

Words from a small list; prompt and answer lengths drawn log-normally (many short answers, a
long tail), seeded, so the file is the same on every run. Standard library only.

Not a comparison bench: `cargo xtask bench` runs every script in this folder with `--quick`;
this one then exits with code 3 ("skipped") and writes nothing.

    python benches/torch/make_packing_jsonl.py OUT.jsonl [--lines 3000] [--seed 7]

`--short-messages` writes instead `{"messages": [user, assistant]}` lines of 1–3 and 1–4 words
(the end-to-end check with `check_packed_sft.py`: `--short-messages --lines 120 --seed 3`).
"""

import argparse
import json
import random
import sys

WORDS = (
    "the a dog cat park went ran home blue red quick slow over under river tree bird song "
    "light dark morning evening found lost small large old new"
).split()


def main():
    if "--quick" in sys.argv:
        sys.exit(3)
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--lines", type=int, default=3000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--short-messages", action="store_true")
    a = p.parse_args()
    rng = random.Random(a.seed)
    if a.short_messages:
        words = WORDS[:10]
        with open(a.out, "w") as f:
            for _ in range(a.lines):
                u = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
                b = " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
                turns = [{"role": "user", "content": u}, {"role": "assistant", "content": b}]
                f.write(json.dumps({"messages": turns}) + "\n")
        return
    with open(a.out, "w") as f:
        for _ in range(a.lines):
            prompt = max(1, int(rng.lognormvariate(1.8, 0.5)))
            answer = max(1, int(rng.lognormvariate(2.4, 0.7)))
            line = {
                "prompt": [
                    {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(prompt))}
                ],
                "completion": [
                    {
                        "role": "assistant",
                        "content": " ".join(rng.choice(WORDS) for _ in range(answer)),
                    }
                ],
            }
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
