"""Write what crates/trainer/tests/sft_trl.rs compares `data build --jsonl --pack` against:
TRL's own packing (`SFTConfig(packing=True)`, its default `packing_strategy="bfd"`, best-fit
decreasing).

`crates/trainer/tests/fixtures/sft/trl_packing.json` holds:
- `bfd`: 300 seeded lengths from 1 to 40 (many ties) packed into rows of 40 by
  `trl.data_utils.pack_dataset`, each row as the indices of its examples in TRL's order — what
  `headroom_trainer::tokenize::best_fit_decreasing` must return;
- `sft`: 40 seeded prompt-completion lines, and TRL 1.16's packed training rows for them with
  `max_length=128` and the committed chat fixture tokenizer (`fixtures/sft/chat`): each row's
  `input_ids`, `labels` (-100 where a token does not count) and `seq_lengths` (the examples in
  it) — the documents, ids and flags `data build --jsonl --max-length 128 --pack` must write
  (each row padded to 128 with one uncounted document; an example's first token uncounted, as
  TRL's padding-free collator labels it);
- `sft_long`: the same with `max_length=64` and prompts of up to 30 words: TRL's packing cuts
  each example to its first 64 tokens (whatever `truncation_mode` says) and keeps an example
  the cut leaves without a counted token (only unpacked datasets drop those);
- `sft_split`: the same examples with `packing_strategy="bfd_split"`: each example longer than
  64 tokens split from its start into pieces of 64, each packed as an example of its own.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Run from the repository root (needs torch, transformers, datasets and trl):
    python benches/torch/make_pack_fixture.py --write
"""

import json
import os
import random
import sys
import tempfile

if "--quick" in sys.argv:
    sys.exit(3)

OUT = os.path.join("crates", "trainer", "tests", "fixtures", "sft")
WORDS = "the a dog cat park went ran home blue red".split()


def bfd_case():
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    rng = random.Random(11)
    lengths = [rng.choice([1, 2, 3, 5, 8, 13, 20, 21, 34, 39, 40]) if rng.random() < 0.5
               else rng.randint(1, 40) for _ in range(300)]
    # Each example's ids are its index, so a row says which examples it holds.
    ds = Dataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lengths)]})
    packed = pack_dataset(ds, 40, "bfd")
    rows = []
    for ids, seq_lengths in zip(packed["input_ids"], packed["seq_lengths"]):
        row, at = [], 0
        for n in seq_lengths:
            row.append(ids[at])
            at += n
        rows.append(row)
    return {"capacity": 40, "lengths": lengths, "rows": rows}


def sft_case(tmp, max_length=128, prompt_words=6, seed=5, strategy="bfd"):
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    rng = random.Random(seed)
    examples = [
        {
            "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, prompt_words))),
            "completion": " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))),
        }
        for _ in range(40)
    ]
    tok = AutoTokenizer.from_pretrained(os.path.join(OUT, "chat"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=8,
                                         intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1))
    args = SFTConfig(output_dir=os.path.join(tmp, "out"), packing=True, max_length=max_length,
                     packing_strategy=strategy, report_to="none", use_cpu=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                         processing_class=tok)
    rows = [
        {"input_ids": list(r["input_ids"]), "labels": list(r["labels"]),
         "seq_lengths": list(r["seq_lengths"])}
        for r in trainer.train_dataset
    ]
    return {"max_length": max_length, "strategy": strategy, "examples": examples, "rows": rows}


def main():
    if "--write" not in sys.argv:
        print(__doc__)
        sys.exit(2)
    import transformers
    import trl

    with tempfile.TemporaryDirectory() as tmp:
        fixture = {
            "about": "TRL's bfd packing (make_pack_fixture.py)",
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__},
            "bfd": bfd_case(),
            "sft": sft_case(tmp),
            # Rows of 64 tokens and prompts of up to 30 words: examples longer than a row,
            # some of them cut inside their prompt, so that no token of theirs counts.
            "sft_long": sft_case(tmp, max_length=64, prompt_words=30, seed=6),
            # The same examples under `packing_strategy="bfd_split"`: the long ones split into
            # pieces of 64 tokens, each packed as an example of its own.
            "sft_split": sft_case(tmp, max_length=64, prompt_words=30, seed=6,
                                  strategy="bfd_split"),
        }
    path = os.path.join(OUT, "trl_packing.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path}: {len(fixture['bfd']['rows'])} bfd rows, "
          f"{len(fixture['sft']['rows'])} SFT rows")


if __name__ == "__main__":
    main()
