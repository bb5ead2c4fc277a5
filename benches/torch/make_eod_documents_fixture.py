"""Write what crates/mmap-data/tests/documents.rs compares its separator-ended documents
(`DocumentBoundaries::EndsWith`, `train --document-separator`) against: Megatron-LM's own
`_get_ltor_masks_and_position_ids` with `reset_position_ids`, `reset_attention_mask` and
`eod_mask_loss` on.

`crates/mmap-data/tests/fixtures/megatron_eod.json` holds, for seeded token windows of
`seq + 1` ids (Megatron's `text`: the sample's inputs and its last target) with the EOD token
scattered through them — at the first and last input, twice in a row, or not at all:
- `position_ids`: Megatron's position ids of the `seq` inputs;
- `loss_mask`: its loss mask of the `seq` targets (0 where the input is EOD: the target starts
  the next document);
- `first_visible`: for each input row, the first key its attention mask lets it see (the row's
  document start) — the whole `seq × seq` mask follows from it, causal to the right.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Run from the repository root (needs torch and megatron-core; `pip install --no-deps
megatron-core` is enough for this function):
    python benches/torch/make_eod_documents_fixture.py --write
"""

import json
import os
import random
import sys

if "--quick" in sys.argv:
    sys.exit(3)

OUT = os.path.join("crates", "mmap-data", "tests", "fixtures", "megatron_eod.json")
EOD = 50256
VOCAB = 50257


def window(rng, seq, eod_rate, forced):
    text = [rng.randrange(EOD) if rng.random() >= eod_rate else EOD for _ in range(seq + 1)]
    for i in forced:
        text[i] = EOD
    return text


def main():
    import torch
    from megatron.core import package_info
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    rng = random.Random(20261130)
    cases = []
    shapes = [
        (16, 0.2, [0]),
        (16, 0.2, [15]),
        (16, 0.0, []),
        (16, 0.3, [4, 5]),
        (31, 0.1, [30]),
        (64, 0.05, [0, 1, 63]),
        (64, 0.5, []),
        (128, 0.03, [16]),
    ]
    for seq, rate, forced in shapes:
        text = window(rng, seq, rate, forced)
        tokens = torch.tensor(text[:-1], dtype=torch.long)
        mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
            tokens,
            EOD,
            reset_position_ids=True,
            reset_attention_mask=True,
            eod_mask_loss=True,
            create_attention_mask=True,
        )
        # True is masked out; each row's first False is its document's first key.
        visible = ~mask[0]
        first_visible = [int(row.nonzero()[0]) for row in visible]
        # The mask is causal and contiguous: everything from that key to the row is visible.
        for i, f in enumerate(first_visible):
            assert visible[i, f : i + 1].all() and not visible[i, i + 1 :].any()
        cases.append(
            {
                "seq": seq,
                "text": text,
                "position_ids": position_ids.tolist(),
                "loss_mask": [int(x) for x in loss_mask.tolist()],
                "first_visible": first_visible,
            }
        )
    fixture = {
        "megatron_core": package_info.__version__,
        "torch": torch.__version__,
        "eod": EOD,
        "vocab": VOCAB,
        "cases": cases,
    }
    if "--write" in sys.argv:
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        with open(OUT, "w") as f:
            json.dump(fixture, f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {OUT}: {len(cases)} windows (megatron-core {package_info.__version__})")
    else:
        print(json.dumps(fixture)[:400])


if __name__ == "__main__":
    main()
