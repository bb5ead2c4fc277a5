"""Check `train`/`eval --document-attention` end to end against TRL's padding-free labels and
transformers' packed-sequence attention:

    python benches/torch/check_packed_sft.py TOKENIZER_DIR MODEL_DIR EXAMPLES.jsonl \
        --seq T --batch B --batches K --expect LOSS

Each `{"messages": [...]}` line goes through transformers' `apply_chat_template(...,
return_assistant_tokens_mask=True)` (TRL's `assistant_only_loss` tokenisation); the examples
are concatenated in file order, as `data build --jsonl --format megatron` writes them, and cut
into windows of T tokens (window w: tokens w·T ..= w·T + T). In each window the position ids
restart at the window's start and at every example's first token, and the labels are TRL's
padding-free collator's: the next token where the assistant mask counts it, -100 elsewhere
and wherever the next token starts an example (`labels[position_ids == 0] = -100`). The
windows run through transformers with those `position_ids` and no attention mask or cache, so
that transformers keeps attention inside each example. Its cross-entropy over the counted
targets of all K batches of B windows, in one mean, must equal the LOSS that `headroom eval
--from MODEL_DIR --data FILE --batch B --seq T --batches K --document-attention` printed,
within 1e-4.

Not a comparison bench: with `--quick` it exits 3 ("skipped").
"""

import json
import sys


def arg(name):
    return sys.argv[sys.argv.index(name) + 1]


def main():
    if "--quick" in sys.argv:
        sys.exit(3)
    positional = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(positional) < 3 or "--expect" not in sys.argv:
        print(__doc__)
        sys.exit(2)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir, model_dir, examples = positional[:3]
    t, b, k = int(arg("--seq")), int(arg("--batch")), int(arg("--batches"))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids, counts, starts = [], [], []
    with open(examples, encoding="utf-8") as f:
        for line in f:
            enc = tok.apply_chat_template(json.loads(line)["messages"], tokenize=True,
                                          return_dict=True, return_assistant_tokens_mask=True)
            ids += enc["input_ids"]
            counts += [bool(m) for m in enc["assistant_masks"]]
            starts += [i == 0 for i in range(len(enc["input_ids"]))]
    needed = b * k * t + 1
    if len(ids) < needed:
        sys.exit(f"{len(ids)} tokens; {needed} needed")
    total, counted = 0.0, 0
    with torch.no_grad():
        for batch in range(k):
            rows, positions, labels = [], [], []
            for w in range(batch * b, batch * b + b):
                span = range(w * t, w * t + t + 1)
                pos, p = [], 0
                for j, i in enumerate(span):
                    p = 0 if j == 0 or starts[i] else p + 1
                    pos.append(p)
                # Labels aligned with the inputs, as transformers' loss shifts them: label j is
                # token j's own id where it counts; the shift makes token j - 1 predict it.
                lab = [ids[i] if counts[i] and pos[j] != 0 else -100 for j, i in enumerate(span)]
                rows.append(ids[w * t: w * t + t + 1])
                positions.append(pos)
                labels.append(lab)
            x = torch.tensor([r[:t] for r in rows])
            position_ids = torch.tensor([p[:t] for p in positions])
            y = torch.tensor([lab[1:] for lab in labels])
            logits = model(input_ids=x, position_ids=position_ids, use_cache=False).logits.float()
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                ignore_index=-100, reduction="sum").item()
            counted += int((y != -100).sum())
    loss, expect = total / counted, float(arg("--expect"))
    print(f"transformers on packed windows (position_ids per example): {loss:.6f} over "
          f"{counted} counted targets; headroom {expect:.6f}; |difference| {abs(loss - expect):.2e}")
    sys.exit(0 if abs(loss - expect) <= 1e-4 else 1)


if __name__ == "__main__":
    main()
