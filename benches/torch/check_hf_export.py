"""Check that transformers loads a headroom checkpoint as it is.

    python benches/torch/check_hf_export.py CHECKPOINT_DIR REFERENCE_DIR
    python benches/torch/check_hf_export.py CHECKPOINT_DIR --tokens FILE --batch B --seq T \
        --batches K --expect LOSS

The second form is the round trip of a *trained* checkpoint: transformers' mean loss on the
windows `headroom eval --from CHECKPOINT_DIR --data FILE --batch B --seq T --batches K` scores
(window w = tokens w·T ..= w·T + T of the llm.c-format token file; the mean over batches of
each batch's mean cross-entropy) must equal the LOSS headroom printed within 1e-4. With a loss
mask beside the file (`FILE.lossmask`, as `headroom data build --jsonl` writes), the targets it
leaves out are transformers' label -100 and the loss is the mean over the counted targets.

Not a comparison bench: run by `cargo xtask bench` (with `--quick` and no directories) it
exits with code 3 ("skipped").

CHECKPOINT_DIR is a `step-N` directory headroom wrote (config.json + model.safetensors);
REFERENCE_DIR a directory of make_llama_fixture.py (its reference.safetensors holds tokens and
logits). `AutoModelForCausalLM.from_pretrained` loads the checkpoint and its logits on the
reference tokens are compared with the reference's: they agree when the checkpoint holds the
reference's weights (`headroom train --init-from REFERENCE_DIR --lr 1e-30 --steps 1` writes
such a checkpoint: the update is below f32 resolution).
"""

import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main(checkpoint, reference):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    ref = load_file(f"{reference}/reference.safetensors")
    with torch.no_grad():
        logits = model(input_ids=ref["tokens"].long()).logits.float()
    diff = (logits - ref["logits"]).abs().max().item()
    print(f"{type(model).__name__} from {checkpoint}: max |logits - reference| = {diff:.3e}")
    sys.exit(0 if diff <= 1e-5 else 1)


def arg(name):
    return sys.argv[sys.argv.index(name) + 1]


def round_trip(checkpoint):
    # The same token reading and windowing as check_peft_adapter.py (headroom eval's).
    from check_peft_adapter import read_loss_mask, read_tokens, windowed_loss

    path, b, t, k = arg("--tokens"), int(arg("--batch")), int(arg("--seq")), int(arg("--batches"))
    tokens = read_tokens(path)
    flags = read_loss_mask(path, len(tokens))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    loss = windowed_loss(model, tokens, b, t, k, flags)
    expect = float(arg("--expect"))
    print(f"{type(model).__name__} from {checkpoint}: transformers loss {loss:.6f}, "
          f"headroom {expect:.6f}, |difference| {abs(loss - expect):.2e}")
    sys.exit(0 if abs(loss - expect) <= 1e-4 else 1)


if __name__ == "__main__":
    if "--tokens" in sys.argv:
        round_trip(sys.argv[1])
    dirs = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(dirs) != 2:
        print("needs CHECKPOINT_DIR REFERENCE_DIR (not a comparison bench)", file=sys.stderr)
        sys.exit(3)
    main(dirs[0], dirs[1])
