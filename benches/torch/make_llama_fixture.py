"""Write the tiny LlamaForCausalLM fixtures that crates/trainer/tests/hf_llama.rs reads.

transformers builds two small random Llama models (one with grouped-query attention and an
untied head, one with multi-head attention and a tied head), saves each with
`save_pretrained` (config.json + model.safetensors, f32), and writes `reference.safetensors`
beside it: fixed tokens and targets, the model's logits on them (eager attention, f32), and
the mean cross-entropy of those logits against the targets.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Run from the repository root:
    python benches/torch/make_llama_fixture.py --write
(needs torch, transformers and safetensors; CI only reads the committed outputs).
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

OUT = os.path.join("crates", "trainer", "tests", "fixtures")


def build(name, *, kv_heads, tied, seed):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # Weights far from the 0.02 initialisation, so every term moves the logits measurably;
    # norm gains away from 1, so a missing gain shows.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    directory = os.path.join(OUT, name)
    model.save_pretrained(directory, safe_serialization=True)

    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=g)
    targets = torch.randint(0, config.vocab_size, (2, 16), generator=g)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, config.vocab_size), targets.reshape(-1)
    )
    save_file(
        {
            "tokens": tokens.to(torch.int32).contiguous(),
            "targets": targets.to(torch.int32).contiguous(),
            "logits": logits.contiguous(),
            "loss": loss.reshape(1).contiguous(),
        },
        os.path.join(directory, "reference.safetensors"),
    )
    print(f"{directory}: loss {loss.item():.6f}", file=sys.stderr)


def main():
    import transformers

    build("hf-llama-gqa-untied", kv_heads=2, tied=False, seed=0)
    build("hf-llama-mha-tied", kv_heads=4, tied=True, seed=10)
    with open(os.path.join(OUT, "hf-llama-versions.json"), "w") as f:
        json.dump(
            {"torch": torch.__version__, "transformers": transformers.__version__}, f, indent=1
        )


if __name__ == "__main__":
    if "--write" not in sys.argv[1:]:
        print("writes fixtures only with --write (not a comparison bench)", file=sys.stderr)
        sys.exit(3)
    main()
