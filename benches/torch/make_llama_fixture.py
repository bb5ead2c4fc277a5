"""Write the tiny Hugging Face model fixtures that crates/trainer/tests/hf_llama.rs reads.

transformers builds small random models and saves each with `save_pretrained`:
- two LlamaForCausalLM (grouped-query attention with an untied head; multi-head attention with
  a tied head), f32, one file each;
- the first again in bf16 (`hf-llama-gqa-untied-bf16`): its reference is computed in f32 from
  the bf16-rounded weights, as a loader that widens them computes;
- a GPT2LMHeadModel (tanh GELU, tied head), f32, sharded into several files with
  transformers' `model.safetensors.index.json`.
Beside each, `reference.safetensors`: fixed tokens and targets, the model's logits on them
(eager attention, f32), and the mean cross-entropy of those logits against the targets.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Run from the repository root:
    python benches/torch/make_llama_fixture.py --write

`--gpt2-124m DIR` instead writes a random GPT-2 small (124M parameters, f32, one file) to DIR
for the load bench (`crates/trainer/tests/hf_load_rss.rs`; not committed: 500 MB).
(needs torch, transformers and safetensors; CI only reads the committed outputs).
"""

import copy
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

OUT = os.path.join("crates", "trainer", "tests", "fixtures")


def perturb(model):
    # Weights far from the 0.02 initialisation, so every term moves the logits measurably;
    # norm gains away from 1, so a missing gain shows.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or ".ln_" in pname or pname.startswith("transformer.ln_f"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


def reference(model, directory, vocab, seed):
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (2, 16), generator=g)
    targets = torch.randint(0, vocab, (2, 16), generator=g)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
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


def build_gpt2(name, seed):
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, bos_token_id=96, eos_token_id=96,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config).to(torch.float32).eval()
    perturb(model)
    directory = os.path.join(OUT, name)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="40KB")
    reference(model, directory, config.vocab_size, seed)


def build(name, *, kv_heads, tied, seed, bf16=False):
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
    perturb(model)
    directory = os.path.join(OUT, name)
    if bf16:
        # The reference runs the f32 model on bf16-rounded parameters; its rotary frequencies
        # stay f32 (`.to(bfloat16)` would round that buffer too, which no loader of the
        # saved file sees).
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    else:
        model.save_pretrained(directory, safe_serialization=True)
    reference(model, directory, config.vocab_size, seed)


def main():
    import transformers

    build("hf-llama-gqa-untied", kv_heads=2, tied=False, seed=0)
    build("hf-llama-mha-tied", kv_heads=4, tied=True, seed=10)
    build("hf-llama-gqa-untied-bf16", kv_heads=2, tied=False, seed=0, bf16=True)
    build_gpt2("hf-gpt2-sharded", seed=20)
    with open(os.path.join(OUT, "hf-llama-versions.json"), "w") as f:
        json.dump(
            {"torch": torch.__version__, "transformers": transformers.__version__}, f, indent=1
        )


def write_gpt2_124m(directory):
    torch.manual_seed(124)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(directory, safe_serialization=True)
    print(f"{directory}: GPT-2 small, random weights", file=sys.stderr)


if __name__ == "__main__":
    if "--gpt2-124m" in sys.argv[1:]:
        write_gpt2_124m(sys.argv[sys.argv.index("--gpt2-124m") + 1])
        sys.exit(0)
    if "--write" not in sys.argv[1:]:
        print("writes fixtures only with --write (not a comparison bench)", file=sys.stderr)
        sys.exit(3)
    main()
