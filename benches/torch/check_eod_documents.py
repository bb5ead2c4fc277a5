"""Check `eval --document-attention --document-separator` end to end against Megatron-LM's masks
and transformers' packed-sequence attention:

    python benches/torch/check_eod_documents.py MODEL_DIR TOKENS.bin --separator ID \
        --seq T --batch B --batches K --expect LOSS

TOKENS.bin is an llm.c shard (GPT-2 or Llama 3 header) or a raw u16 file, cut into `headroom
eval`'s windows (window w: tokens w·T ..= w·T + T; batch k: windows k·B .. k·B + B). Each
window's inputs go through megatron-core's `_get_ltor_masks_and_position_ids` with the
separator as EOD and `reset_position_ids`, `reset_attention_mask`, `eod_mask_loss` on: its
position ids (restarting after every EOD) and its loss mask (0 where the input is EOD, whose
target starts the next document). The windows run through transformers with those
`position_ids` and no attention mask or cache, so that transformers keeps attention inside each
document; the cross-entropy over the targets the loss mask keeps, of all K batches in one mean,
must equal the LOSS that `headroom eval --from MODEL_DIR --data TOKENS.bin --batch B --seq T
--batches K --document-attention --document-separator ID` printed, within 1e-4.

Not a comparison bench: with `--quick` it exits 3 ("skipped"). Needs torch, transformers and
megatron-core (`pip install --no-deps megatron-core`).
"""

import struct
import sys


def arg(name):
    return sys.argv[sys.argv.index(name) + 1]


def read_tokens(path):
    import numpy as np

    with open(path, "rb") as f:
        data = f.read()
    magic, version, count = struct.unpack_from("<3i", data)
    if magic in (20240520, 20240801):
        dtype = np.uint16 if magic == 20240520 else np.uint32
        return np.frombuffer(data, dtype=dtype, offset=1024, count=count).astype(np.int64)
    return np.frombuffer(data, dtype=np.uint16).astype(np.int64)


def main():
    if "--quick" in sys.argv:
        sys.exit(3)
    positional = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(positional) < 2 or "--expect" not in sys.argv or "--separator" not in sys.argv:
        print(__doc__)
        sys.exit(2)
    import torch
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    from transformers import AutoModelForCausalLM

    model_dir, tokens_path = positional[0], positional[1]
    separator = int(arg("--separator"))
    t, b, k = int(arg("--seq")), int(arg("--batch")), int(arg("--batches"))
    ids = torch.from_numpy(read_tokens(tokens_path))
    needed = b * k * t + 1
    if len(ids) < needed:
        sys.exit(f"{len(ids)} tokens; {needed} needed")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    total, counted, restarts = 0.0, 0, 0
    with torch.no_grad():
        for batch in range(k):
            xs, positions, ys = [], [], []
            for w in range(batch * b, batch * b + b):
                window = ids[w * t : w * t + t + 1]
                x, y = window[:t], window[1:].clone()
                _, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
                    x, separator, reset_position_ids=True, reset_attention_mask=True,
                    eod_mask_loss=True, create_attention_mask=False)
                y[loss_mask == 0] = -100
                restarts += int((position_ids[1:] == 0).sum())
                xs.append(x)
                positions.append(position_ids)
                ys.append(y)
            x, y = torch.stack(xs), torch.stack(ys)
            logits = model(input_ids=x, position_ids=torch.stack(positions),
                           use_cache=False).logits.float()
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                ignore_index=-100, reduction="sum").item()
            counted += int((y != -100).sum())
    loss, expect = total / counted, float(arg("--expect"))
    print(f"transformers on Megatron's EOD documents ({restarts} restarts inside the windows): "
          f"{loss:.6f} over {counted} counted targets; headroom {expect:.6f}; "
          f"|difference| {abs(loss - expect):.2e}")
    sys.exit(0 if abs(loss - expect) <= 1e-4 else 1)


if __name__ == "__main__":
    main()
