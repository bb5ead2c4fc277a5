"""Load a headroom checkpoint with Hugging Face transformers and check its loss.

Usage: check_hf_export.py STEP_DIR BATCH_JSON

BATCH_JSON holds {"tokens": [[...], ...], "targets": [[...], ...], "loss": float}: a batch and
the mean loss headroom's own forward computed for it. The script loads
`GPT2LMHeadModel.from_pretrained(STEP_DIR)` (one published checkpoint, a `step-*` directory
with the model.safetensors + config.json headroom wrote) and exits 0 when transformers' loss
on the same batch agrees within 1e-4 relative, 1 when it does not, and 3 (with the reason on
stderr) when torch or transformers is missing.
"""
import json
import sys

try:
    import torch
    from transformers import GPT2LMHeadModel
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"needs torch and transformers: {e}", file=sys.stderr)
    sys.exit(3)


def main() -> int:
    ckpt, batch_path = sys.argv[1], sys.argv[2]
    with open(batch_path) as f:
        batch = json.load(f)
    model = GPT2LMHeadModel.from_pretrained(ckpt, torch_dtype=torch.float32)
    model.eval()
    tokens = torch.tensor(batch["tokens"], dtype=torch.long)
    targets = torch.tensor(batch["targets"], dtype=torch.long)
    with torch.no_grad():
        logits = model(tokens).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1)
        ).item()
    ours = batch["loss"]
    rel = abs(loss - ours) / max(abs(ours), 1e-12)
    print(f"transformers loss {loss:.7f}, headroom loss {ours:.7f}, relative difference {rel:.2e}")
    return 0 if rel <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
