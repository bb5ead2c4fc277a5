"""Write (and check) the PEFT LoRA fixtures that crates/lora/tests/peft_fixture.rs reads.

`--write`: transformers loads the tiny Llama at crates/trainer/tests/fixtures/hf-llama-gqa-untied
(read only), peft wraps it with `LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj",
"v_proj", "down_proj"], lora_dropout=0.0)` (and once more with `use_rslora=True`), the A and B
matrices are overwritten with fixed random values (B is zero after peft's initialisation, which
would make the adapter invisible), and `save_pretrained` writes the adapter under
crates/lora/tests/fixtures/peft-llama-tiny[-rslora]/. Beside it, `reference.safetensors` holds:

- for a few adapted modules `<module>`: `<module>.x` (an input `[5, in]`) and `<module>.y` (the
  module's output computed by peft: base + adapter, f32);
- `tokens` (`[2, 16]`, i32) and `logits` (`[2, 16, vocab]`): the full adapted model's logits
  (eager attention), for the trainer;
- `merged_logits`: the logits after `merge_and_unload()`.

It also writes `peft-gpt2-conv1d/`: a tiny random GPT-2 (not saved) with `c_attn` and `c_fc`
adapted (`fan_in_fan_out=True`, r=2, alpha=6), whose reference holds each module's Conv1D
weight (`[in, out]`) and bias, an input, peft's output and the weight after peft's merge.

`--check-headroom DIR [--base BASE]`: load an adapter that headroom wrote (adapter_config.json +
adapter_model.safetensors, plus `expected.safetensors` with headroom's module outputs, written by
`cargo run -p headroom-lora --example write_peft_check -- DIR`) into the tiny Llama with
`PeftModel.from_pretrained`, check that every lora_A/lora_B tensor peft holds equals the file,
and compare peft's output of each module in `expected.safetensors` with headroom's. Prints the
largest differences and exits non-zero when a tensor is missing or a difference exceeds 1e-5.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Run from the repository root (needs torch, transformers, peft and safetensors):
    python benches/torch/make_lora_fixture.py --write
    python benches/torch/make_lora_fixture.py --check-headroom /tmp/headroom-adapter
"""

import json
import os
import sys

BASE = os.path.join("crates", "trainer", "tests", "fixtures", "hf-llama-gqa-untied")
OUT = os.path.join("crates", "lora", "tests", "fixtures")
MODULES = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.1.self_attn.v_proj",
    "model.layers.0.mlp.down_proj",
]


def load_base():
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(BASE, torch_dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    return model


def lora_module(peft_model, name):
    return peft_model.base_model.model.get_submodule(name)


def write_one(name, *, use_rslora, seed):
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    model = load_base()
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        lora_dropout=0.0,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_A" in pname:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "lora_B" in pname:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    directory = os.path.join(OUT, name)
    peft_model.save_pretrained(directory, safe_serialization=True)
    # The model card save_pretrained adds is boilerplate; the fixture is the two adapter files.
    card = os.path.join(directory, "README.md")
    if os.path.exists(card):
        os.remove(card)

    tensors = {}
    with torch.no_grad():
        for module in MODULES:
            layer = lora_module(peft_model, module)
            x = torch.randn((5, layer.in_features), generator=g)
            tensors[f"{module}.x"] = x.contiguous()
            tensors[f"{module}.y"] = layer(x).float().contiguous()
        tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        logits = peft_model(input_ids=tokens).logits.float()
        merged = peft_model.merge_and_unload()
        merged_logits = merged(input_ids=tokens).logits.float()
    tensors["tokens"] = tokens.to(torch.int32).contiguous()
    tensors["logits"] = logits.contiguous()
    tensors["merged_logits"] = merged_logits.contiguous()
    save_file(tensors, os.path.join(directory, "reference.safetensors"))
    diff = (logits - merged_logits).abs().max().item()
    print(f"{directory}: merged vs adapted logits max |diff| {diff:.3e}", file=sys.stderr)


def write_gpt2_conv1d(seed=99):
    """GPT-2's Conv1D stores its weight as [in, out]; peft needs `fan_in_fan_out=True` there.
    A tiny random GPT-2 (built here, not saved) with c_attn and c_fc adapted; the reference
    holds each module's Conv1D weight and bias as stored, an input, peft's output and the
    weight after peft's merge."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    ).eval()
    config = LoraConfig(
        r=2,
        lora_alpha=6,
        target_modules=["c_attn", "c_fc"],
        lora_dropout=0.0,
        fan_in_fan_out=True,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_A" in pname:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "lora_B" in pname:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    directory = os.path.join(OUT, "peft-gpt2-conv1d")
    peft_model.save_pretrained(directory, safe_serialization=True)
    card = os.path.join(directory, "README.md")
    if os.path.exists(card):
        os.remove(card)
    tensors = {}
    with torch.no_grad():
        for module in ["transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"]:
            layer = lora_module(peft_model, module)
            base = layer.base_layer
            x = torch.randn((3, base.weight.shape[0]), generator=g)
            tensors[f"{module}.base_weight"] = base.weight.detach().clone().contiguous()
            tensors[f"{module}.bias"] = base.bias.detach().clone().contiguous()
            tensors[f"{module}.x"] = x.contiguous()
            tensors[f"{module}.y"] = layer(x).float().contiguous()
            layer.merge()
            tensors[f"{module}.merged_weight"] = base.weight.detach().clone().contiguous()
    save_file(tensors, os.path.join(directory, "reference.safetensors"))
    print(f"{directory}: written", file=sys.stderr)


def write():
    import peft
    import torch
    import transformers

    write_one("peft-llama-tiny", use_rslora=False, seed=1234)
    write_one("peft-llama-tiny-rslora", use_rslora=True, seed=4321)
    write_gpt2_conv1d()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}",
        file=sys.stderr,
    )


def check_headroom(directory, base):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    global BASE
    BASE = base
    model = load_base()
    peft_model = PeftModel.from_pretrained(model, directory).eval()
    file_tensors = load_file(os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    ok = True
    held = {
        k: v
        for k, v in peft_model.state_dict().items()
        if "lora_A" in k or "lora_B" in k
    }
    # peft holds `...lora_A.default.weight`; the file names drop the adapter name.
    held = {k.replace(".default", ""): v for k, v in held.items()}
    if set(held) != set(file_tensors):
        print(f"tensor names differ: peft {sorted(held)} file {sorted(file_tensors)}")
        ok = False
    for k, v in file_tensors.items():
        if k in held and not torch.equal(held[k].float(), v.float()):
            print(f"{k}: peft holds different values than the file")
            ok = False
    print(
        f"loaded {len(file_tensors)} tensors, r={config['r']}, lora_alpha={config['lora_alpha']}, "
        f"use_rslora={config.get('use_rslora')}, scaling "
        f"{lora_module(peft_model, next(iter(sorted({k.rsplit('.lora_', 1)[0][len('base_model.model.'):] for k in file_tensors})))).scaling}"
    )
    expected = load_file(os.path.join(directory, "expected.safetensors"))
    modules = sorted({k.rsplit(".", 1)[0] for k in expected})
    worst = 0.0
    with torch.no_grad():
        for module in modules:
            layer = lora_module(peft_model, module)
            y = layer(expected[f"{module}.x"])
            want = expected[f"{module}.y"]
            diff = (y - want).abs().max().item()
            rel = diff / max(want.abs().max().item(), 1e-30)
            worst = max(worst, diff)
            print(f"{module}: max |peft - headroom| {diff:.3e} (relative {rel:.3e})")
    if worst > 1e-5:
        print(f"difference {worst:.3e} exceeds 1e-5")
        ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def main():
    args = sys.argv[1:]
    if "--write" in args:
        # peft keeps target_modules as a set and saves it in iteration order, which follows
        # string hashing: a fixed hash seed makes the written adapter_config.json reproducible.
        if os.environ.get("PYTHONHASHSEED") != "0":
            env = dict(os.environ, PYTHONHASHSEED="0")
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
        write()
        return 0
    if "--check-headroom" in args:
        i = args.index("--check-headroom")
        if i + 1 >= len(args):
            print("--check-headroom needs a directory", file=sys.stderr)
            return 2
        base = BASE
        if "--base" in args and args.index("--base") + 1 < len(args):
            base = args[args.index("--base") + 1]
        return check_headroom(args[i + 1], base)
    print(
        "fixture writer, not a bench: pass --write or --check-headroom DIR",
        file=sys.stderr,
    )
    return 3


if __name__ == "__main__":
    sys.exit(main())
