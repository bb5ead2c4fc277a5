"""Check `data build --jsonl --assistant-only-loss --max-length N --pad` end to end against
TRL's own data path and transformers' loss:

    python benches/torch/check_padded_sft.py TOKENIZER_DIR CHECKPOINT_DIR EXAMPLES.jsonl \
        --max-length N --batch B --batches K --expect LOSS

Each `{"messages": [...]}` line goes through transformers' `apply_chat_template(...,
return_assistant_tokens_mask=True)` (TRL's `assistant_only_loss` tokenisation), is cut to N
tokens, and K batches of B examples are right-padded with an attention mask. That is TRL's
collator, with a pad id (0) that is not the one headroom's file pads with. transformers'
cross-entropy over the counted targets of all K batches, in one mean (headroom eval's weighting;
transformers' `num_items_in_batch` weighting within a step), must equal the LOSS that `headroom
eval --from CHECKPOINT_DIR --data FILE --batch B --seq N --batches K` printed for the padded
file, within 1e-4.

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

    tokenizer_dir, checkpoint, examples = positional[:3]
    n, b, k = int(arg("--max-length")), int(arg("--batch")), int(arg("--batches"))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    rows = []
    with open(examples, encoding="utf-8") as f:
        for line in f:
            enc = tok.apply_chat_template(json.loads(line)["messages"], tokenize=True,
                                          return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = enc["input_ids"][:n], enc["assistant_masks"][:n]
            labels = [i if m else -100 for i, m in zip(ids, mask)]
            # TRL drops an example the cut left without a counted label.
            if any(label != -100 for label in labels):
                rows.append((ids, labels))
    total, counted = 0.0, 0
    with torch.no_grad():
        for batch in range(k):
            group = rows[batch * b: batch * b + b]
            width = max(len(ids) for ids, _ in group)
            pad = [width - len(ids) for ids, _ in group]
            ids = torch.tensor([r[0] + [0] * p for r, p in zip(group, pad)])
            attention = torch.tensor([[1] * len(r[0]) + [0] * p for r, p in zip(group, pad)])
            labels = torch.tensor([r[1] + [-100] * p for r, p in zip(group, pad)])
            logits = model(input_ids=ids, attention_mask=attention).logits.float()
            # Position j predicts label j + 1, as transformers' causal-LM loss shifts them.
            total += torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                ignore_index=-100, reduction="sum").item()
            counted += int((labels[:, 1:] != -100).sum())
    loss, expect = total / counted, float(arg("--expect"))
    print(f"transformers on TRL's padded batches: {loss:.6f} over {counted} counted targets; "
          f"headroom {expect:.6f}; |difference| {abs(loss - expect):.2e}")
    sys.exit(0 if abs(loss - expect) <= 1e-4 else 1)


if __name__ == "__main__":
    main()
