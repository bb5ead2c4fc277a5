"""Write what crates/trainer/tests/documents.rs compares packed documents against.

transformers reads several documents packed in one row from `position_ids` alone: where a
position is 0 a new document starts, attention stays inside each document (its masking
utilities build the block-diagonal causal mask from the positions), and rotary or learned
positions restart with it. That is TRL's padding-free packing, and what
`headroom train --document-attention` computes.

For two of the committed model fixtures (`hf-llama-gqa-untied`: grouped-query attention,
rotary positions; `hf-gpt2-sharded`: learned positions), this loads the model with
transformers, packs a fixed batch of 2 rows × 24 tokens with documents of several lengths, and
writes `packed.safetensors` beside the model:
- `tokens`, `positions` (the `position_ids`), `targets` (the next token; -100 where the next
  token starts a document, as transformers' `DataCollatorWithFlattening` labels it);
- `logits` of the packed batch (eager attention, f32) and `loss`, the mean cross-entropy over
  the counted targets;
- `alone_loss`: the same, with every document run alone in its own batch — which the script
  checks agrees with the packed loss before it writes anything, so the fixture also records
  that transformers itself treats the positions as document boundaries.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Run from the repository root (needs torch, transformers and safetensors; CI only reads the
committed outputs):
    python benches/torch/make_packed_documents_fixture.py --write
"""

import os
import sys

if "--quick" in sys.argv:
    sys.exit(3)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

FIXTURES = os.path.join("crates", "trainer", "tests", "fixtures")
ROWS, T = 2, 24
# Each row cut into documents of these lengths (a document of one token included).
LENGTHS = [[5, 1, 9, 9], [11, 3, 10]]


def packed_batch(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (ROWS, T), generator=g)
    following = torch.randint(0, vocab, (ROWS, 1), generator=g)
    positions = torch.cat(
        [torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in LENGTHS]
    )
    assert positions.shape == (ROWS, T)
    # The next token in the row (and past its end, one more drawn token) is the target; a
    # target that starts a document is left out.
    nxt = torch.cat([tokens[:, 1:], following], dim=1)
    next_pos = torch.cat([positions[:, 1:], torch.zeros(ROWS, 1, dtype=torch.long)], dim=1)
    starts_next = next_pos == 0
    starts_next[:, -1] = False  # the token past the row continues its last document
    targets = torch.where(starts_next, torch.full_like(nxt, -100), nxt)
    return tokens, positions, targets


def losses(model, vocab, seed):
    tokens, positions, targets = packed_batch(vocab, seed)
    with torch.no_grad():
        # No cache: transformers reads packed documents from the positions only without one.
        logits = model(input_ids=tokens, position_ids=positions, use_cache=False).logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )
    counted = (targets != -100).sum()
    # Every document alone, from position 0.
    alone = torch.zeros((), dtype=torch.float64)
    for r, row in enumerate(LENGTHS):
        a = 0
        for n in row:
            tok = tokens[r : r + 1, a : a + n]
            tgt = targets[r : r + 1, a : a + n]
            with torch.no_grad():
                lg = model(input_ids=tok, use_cache=False).logits.float()
            alone += torch.nn.functional.cross_entropy(
                lg.reshape(-1, vocab), tgt.reshape(-1), ignore_index=-100, reduction="sum"
            ).double()
            a += n
    mean = (loss / counted).item()
    alone_mean = (alone / counted).item()
    return tokens, positions, targets, logits, mean, alone_mean


def main():
    if "--write" not in sys.argv:
        print(__doc__)
        sys.exit(2)
    for name, seed in [("hf-llama-gqa-untied", 11), ("hf-gpt2-sharded", 12)]:
        directory = os.path.join(FIXTURES, name)
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        vocab = model.config.vocab_size
        tokens, positions, targets, logits, mean, alone = losses(model, vocab, seed)
        print(f"{name}: packed {mean:.7f}, every document alone {alone:.7f}")
        if abs(mean - alone) > 1e-5 * max(1.0, abs(alone)):
            sys.exit(f"{name}: transformers did not keep attention inside the documents")
        save_file(
            {
                "tokens": tokens.to(torch.int32).contiguous(),
                "positions": positions.to(torch.int32).contiguous(),
                "targets": targets.to(torch.int32).contiguous(),
                "logits": logits.contiguous(),
                "loss": torch.tensor([mean], dtype=torch.float32),
                "alone_loss": torch.tensor([alone], dtype=torch.float32),
            },
            os.path.join(directory, "packed.safetensors"),
            metadata={"transformers": __import__("transformers").__version__},
        )


if __name__ == "__main__":
    main()
