"""Check that PEFT loads a LoRA adapter headroom trained, and scores it as headroom does.

    python benches/torch/check_peft_adapter.py BASE_DIR ADAPTER_DIR --tokens FILE --batch B \
        --seq T --batches K [--expect LOSS] [--merged MERGED_DIR]

BASE_DIR is the Hugging Face model the adapter was trained on (`headroom train --init-from
BASE_DIR --lora-rank R ...`); ADAPTER_DIR one `step-N` directory of that run
(`adapter_config.json` + `adapter_model.safetensors`). The base is loaded with
`AutoModelForCausalLM.from_pretrained(BASE_DIR, attn_implementation="eager")` (fp32) and wrapped
with `PeftModel.from_pretrained(model, ADAPTER_DIR)`. Then:

- every `lora_A` / `lora_B` tensor of the file must be one PEFT holds, under the same name and
  with the same values, and PEFT must hold no other adapter tensor (a name mismatch would
  otherwise leave an adapter at its initialisation, B = 0, silently);
- PEFT's loss (adapter applied, not merged) is computed on the windows
  `headroom eval --from BASE_DIR --adapter ADAPTER_DIR --data FILE --batch B --seq T --batches K`
  scores: window w = tokens w·T ..= w·T + T of the llm.c token file (u16 or u32 flavour), the
  mean over batches of each batch's mean cross-entropy (the windowing of check_hf_export.py).
  The base's own loss (`disable_adapter()`) is printed beside it, to show the adapter matters;
- `--expect LOSS` (what headroom eval printed): |PEFT loss - LOSS| must be at most 1e-4;
- `--merged MERGED_DIR` (written by `headroom train ... --merge-into MERGED_DIR` or `headroom
  merge`): transformers' loss of that directory on the same windows must equal PEFT's within
  1e-4. The largest difference between its weights and PEFT's own `merge_and_unload()` is
  printed too (not checked).

Exits 0 when every check asked for passes, 1 otherwise (a PEFT load error ends it with the
traceback). Without `--expect` and `--merged` it only prints the losses and the tensor check.

Not a comparison bench: it prints no records. Run by `cargo xtask bench` (with `--quick` and no
directories) it exits with code 3 ("skipped").
"""

import argparse
import sys

TOLERANCE = 1e-4  # nats/token, on a mean loss, as check_hf_export.py's round trip
LLMC = {20240520: "<u2", 20240801: "<u4"}  # llm.c magic -> token dtype (GPT-2, Llama 3 flavour)


def read_tokens(path):
    import numpy as np

    header = np.fromfile(path, dtype="<i4", count=256)
    if len(header) < 256 or int(header[0]) not in LLMC:
        sys.exit(f"{path}: not an llm.c token file (write one with `headroom data synth`)")
    dtype = LLMC[int(header[0])]
    return np.fromfile(path, dtype=dtype, offset=1024, count=int(header[2])).astype(np.int64)


def read_loss_mask(path, n):
    """The flags of `<path>.lossmask` (headroom's loss mask: a 24-byte header, then one bit per
    token, least significant first), or None when the file has no mask."""
    import os

    import numpy as np

    mask = path + ".lossmask"
    if not os.path.exists(mask):
        return None
    raw = np.fromfile(mask, dtype=np.uint8)
    if bytes(raw[:8]) != b"HRLMASK1" or int(raw[8:16].view("<u8")[0]) != n:
        sys.exit(f"{mask}: not a loss mask of {n} tokens")
    return np.unpackbits(raw[24:], bitorder="little")[:n].astype(bool)


def windowed_loss(model, tokens, b, t, k, flags=None):
    """headroom eval's loss: batch i holds windows i·b .. i·b+b-1, window w = tokens[w·t ..= w·t+t].

    With loss-mask `flags`, a target whose flag is off is transformers' label -100, and the loss
    is the mean over every counted target of the K batches (headroom eval's weighting)."""
    import numpy as np
    import torch

    need = (k * b - 1) * t + t + 1
    if need > len(tokens):
        sys.exit(f"{k} batches of {b}×{t} need {need} tokens; the file has {len(tokens)}")
    total, counted = 0.0, 0
    with torch.no_grad():
        for batch in range(k):
            windows = range(batch * b, batch * b + b)
            rows = [tokens[w * t: w * t + t + 1] for w in windows]
            data = torch.from_numpy(np.stack(rows))
            logits = model(input_ids=data[:, :-1]).logits.float()
            labels = data[:, 1:].clone()
            if flags is None:
                total += torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()
                counted += 1
                continue
            keep = torch.from_numpy(np.stack([flags[w * t + 1: w * t + t + 1] for w in windows]))
            labels[~keep] = -100
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                reduction="sum").item()
            counted += int(keep.sum())
    return total / counted


def check_tensors(model, adapter):
    """Every adapter tensor of the file is in PEFT under its name with its values, and no other."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(f"{adapter}/adapter_model.safetensors")
    held = get_peft_model_state_dict(model)
    missing = sorted(set(saved) - set(held))
    extra = sorted(set(held) - set(saved))
    worst = 0.0
    for name in set(saved) & set(held):
        a, b = saved[name].float(), held[name].detach().float().cpu()
        worst = max(worst, (a - b).abs().max().item() if a.shape == b.shape else float("inf"))
    print(f"adapter tensors: {len(saved)} in the file, {len(held)} held by PEFT; "
          f"max |file - PEFT| = {worst:.1e}")
    for name in missing:
        print(f"  not used by PEFT: {name}")
    for name in extra:
        print(f"  PEFT tensor not in the file (left at its initialisation): {name}")
    nonzero_b = any(v.abs().max().item() > 0 for n, v in saved.items() if "lora_B" in n)
    if not nonzero_b:
        print("  every lora_B is zero: the adapter changes nothing")
    return not missing and not extra and worst == 0.0 and bool(saved)


def max_weight_diff(merged_model, peft_model):
    import copy

    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    mine = merged_model.state_dict()
    worst, name = 0.0, None
    for key, value in reference.items():
        if key not in mine:
            print(f"  merged directory lacks {key}")
            return float("inf"), key
        d = (mine[key].float() - value.float()).abs().max().item()
        if d > worst:
            worst, name = d, key
    return worst, name


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base")
    p.add_argument("adapter")
    p.add_argument("--tokens", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--expect", type=float, help="the loss headroom eval printed")
    p.add_argument("--merged", help="a merged directory (headroom train --merge-into / merge)")
    args = p.parse_args()

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tokens = read_tokens(args.tokens)
    base = AutoModelForCausalLM.from_pretrained(
        args.base, attn_implementation="eager", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, args.adapter).eval()
    config = model.peft_config["default"]
    print(f"{type(base).__name__} from {args.base} + adapter {args.adapter}: r={config.r}, "
          f"alpha={config.lora_alpha}, rslora={config.use_rslora}, "
          f"fan_in_fan_out={config.fan_in_fan_out}, targets={sorted(config.target_modules)}")
    ok = check_tensors(model, args.adapter)

    loss = windowed_loss(model, tokens, args.batch, args.seq, args.batches)
    with model.disable_adapter():
        base_loss = windowed_loss(model, tokens, args.batch, args.seq, args.batches)
    print(f"PEFT loss {loss:.6f} (base without the adapter {base_loss:.6f})")

    if args.expect is not None:
        diff = abs(loss - args.expect)
        good = diff <= TOLERANCE
        ok &= good
        print(f"headroom eval {args.expect:.6f}: |difference| {diff:.2e} "
              f"({'ok' if good else 'FAIL'}, tolerance {TOLERANCE:.0e})")

    if args.merged:
        merged = AutoModelForCausalLM.from_pretrained(
            args.merged, attn_implementation="eager", dtype=torch.float32).eval()
        merged_loss = windowed_loss(merged, tokens, args.batch, args.seq, args.batches)
        diff = abs(merged_loss - loss)
        good = diff <= TOLERANCE
        ok &= good
        worst, name = max_weight_diff(merged, model)
        print(f"merged {args.merged}: loss {merged_loss:.6f}, |difference to PEFT| {diff:.2e} "
              f"({'ok' if good else 'FAIL'}, tolerance {TOLERANCE:.0e}); "
              f"max |weight - PEFT merge_and_unload| {worst:.1e} ({name})")

    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    dirs = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--tokens" not in sys.argv or len(dirs) < 2:
        print("needs BASE_DIR ADAPTER_DIR --tokens FILE ... (not a comparison bench)",
              file=sys.stderr)
        sys.exit(3)
    main()
