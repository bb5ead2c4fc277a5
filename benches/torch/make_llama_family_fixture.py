"""Write the Llama-family fixtures that crates/trainer/tests/hf_llama.rs reads beside
make_llama_fixture.py's: the variants of the architecture people fine-tune today.

Llama 3.1, 3.2 and 3.3 checkpoints stretch their low rotary frequencies (`rope_type` "llama3"
in `rope_parameters`, `rope_scaling` before transformers 5); older long-context fine-tunes
divide every frequency (`linear`). Qwen2 and Qwen2.5 are Llama with biases on the query, key
and value projections; Mistral is Llama with a sliding window, which v0.2 and later turn off.
Qwen3 drops Qwen2's biases, normalises each query and key head (RMSNorm over the head
dimension, before the rotation) and sets its own head width, which Mistral Nemo does too.
transformers builds a small random model of each and saves it with `save_pretrained`:
- `hf-llama3-rope`: LlamaForCausalLM, factor 8, low/high frequency factors 1 and 4 over an
  original context of 32, so at head dimension 16 one frequency is kept, one is blended and
  six are stretched; the reference's 48 positions run past that original context;
- `hf-llama-linear-rope`: LlamaForCausalLM, factor 4;
- `hf-qwen2`: Qwen2ForCausalLM, grouped-query attention, tied head (as Qwen2.5-0.5B), rotary
  base 1e6, biases drawn like every other weight;
- `hf-mistral`: MistralForCausalLM without a sliding window (as Mistral 7B v0.2 and v0.3),
  rotary base 1e6, one key/value head;
- `hf-llama-yarn-rope`: LlamaForCausalLM with YaRN (as Qwen2.5's long-context settings add
  it): factor 4 over an original context of 32, betas 8 and 0.5 and unrounded ramp ends, so
  the ramp blends two frequencies; the attention factor 0.1·ln 4 + 1 scales cos and sin. Its
  reference also holds the frequencies and factor of YaRN with transformers' defaults;
- `hf-qwen3`: Qwen3ForCausalLM, 4 query heads of width 12 over 2 key/value heads on a model
  32 wide (so q is 48 wide, o_proj 48 → 32), q_norm and k_norm, tied head (as Qwen3-0.6B),
  rotary base 1e6. Its reference also holds PyTorch's gradient of the mean loss for every
  parameter (`grad.<name>`);
- `hf-mistral-head-dim`: MistralForCausalLM with head_dim 16 on a model 32 wide with 4 heads
  (as Mistral Nemo sets 128 on 5120 with 32);
- `hf-mistral-window`: MistralForCausalLM with a sliding window of 16 keys in every block (as
  Mistral 7B v0.1 has 4096 over a context of 32768), so the reference's 48 positions cross it;
- `hf-qwen2-window`: Qwen2ForCausalLM with `use_sliding_window`, a window of 16 keys from
  block 1 on (`max_window_layers` 1): block 0 attends to everything, block 1 to its window;
- `hf-smollm3`: SmolLM3ForCausalLM, 3 blocks with a NoPE block every 2 (block 1 attends without
  the rotary embedding; SmolLM3-3B has one every 4), tied head. Its reference also holds
  PyTorch's gradients.
- `hf-gemma3`: Gemma3ForCausalLM (Gemma 3 270M and 1B are this class): 3 blocks, block 1 with
  full attention and blocks 0 and 2 over a window of 16 keys with their own rotary base (the
  real models window five blocks of six), q/k norms, output norms, GeGLU, embedding scaled by
  sqrt(32), head width 12 on a model 32 wide, tied head; norm gains stored as offsets from 1.
  Its reference also holds PyTorch's gradients and the windowed blocks' `sliding_inv_freq`.
- `hf-gemma3-multimodal`: Gemma3ForConditionalGeneration (Gemma 3 4B, 12B, 27B are this
  class) around the same text model, with a one-layer SigLIP vision tower 16 wide and its
  projector; the reference is the multimodal model's logits on text alone (no image tokens).
- `hf-gemma3-scaled`: `hf-gemma3`'s shape with `query_pre_attn_scalar` 20 on heads of 12
  (Gemma 3 27B has 168 on 128): attention scales by 20^-1/2.
- `hf-olmo2`: Olmo2ForCausalLM (OLMo 2 1B, 7B, 13B, 32B): no input norms, a norm on the
  attention's and the MLP's outputs, q_norm and k_norm over the whole projections (48 and 24
  wide: head width 12 on a model 32 wide), untied head, Olmo2Config's padding id 1 (in every
  fifth input position). Its reference also holds PyTorch's gradients.
- `hf-olmo3`: Olmo3ForCausalLM (OLMo 3 7B, 32B): OLMo 2 with blocks 0 and 2 over a window of
  16 keys and block 1 full (the real models have three windowed blocks of four); the full
  block's rotary embedding is YaRN (factor 4 over an original context of 16), the windowed
  blocks' is not rescaled. Its reference also holds PyTorch's gradients and the windowed
  blocks' `sliding_inv_freq`.
- `hf-granite`: GraniteForCausalLM (IBM Granite 3.x dense): Llama with an embedding
  multiplier (12), a residual multiplier (0.22), an attention multiplier in place of
  1/sqrt(head_dim) (0.2) and a logits divisor (6, where the real models have 8 or 16: a power
  of two would hide a wrong order of rounding), tied head, padding id 0 (Granite's end of
  text; in every fifth input position). Its reference also holds PyTorch's gradients.
Beside each, `reference.safetensors`: fixed tokens `[2, 48]` and targets, the model's logits
on them (eager attention, f32), their mean cross-entropy, and the rotary embedding's own
`inv_freq` buffer and `attention_scaling` (which a loader must reproduce bit for bit).

Not a comparison bench: it prints no records; without `--write` it exits with code 3
("skipped"), which is what `cargo xtask bench --quick` sees.

Run from the repository root (needs torch, transformers and safetensors; CI only reads the
committed outputs, 1.6 MB):
    python benches/torch/make_llama_family_fixture.py --write
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    SiglipVisionConfig,
)

OUT = os.path.join("crates", "trainer", "tests", "fixtures")
# What every model here shares: small, f32, SiLU, 64 positions.
SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=72,
    max_position_embeddings=64,
    hidden_act="silu",
    torch_dtype="float32",
)
SEQ = 48


def perturb(model, norm_center=1.0):
    # As make_llama_fixture.py: weights far from the initialisation, norm gains away from 1
    # (Gemma stores each gain as its offset from 1: centre 0).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(norm_center + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


def llama(rope_parameters):
    config = LlamaConfig(
        **SMALL,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    return config, LlamaForCausalLM


def qwen2(**overrides):
    settings = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        hidden_act="silu",
        torch_dtype="float32",
    )
    # Given to the constructor, which derives layer_types from the window settings.
    return Qwen2Config(**{**settings, **overrides}), Qwen2ForCausalLM


def mistral():
    # Mistral 7B v0.3's settings in small: no sliding window, rotary base 1e6, 4 query heads
    # over 1 key/value head, untied.
    config = MistralConfig(
        **SMALL,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None,
        tie_word_embeddings=False,
    )
    return config, MistralForCausalLM


def qwen3():
    # Qwen3-0.6B's settings in small: head_dim not hidden_size / heads, tied, base 1e6.
    config = Qwen3Config(
        **SMALL,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
    )
    return config, Qwen3ForCausalLM


def mistral_head_dim():
    config, cls = mistral()
    config.head_dim = 16
    return config, cls


def mistral_window():
    config, cls = mistral()
    config.sliding_window = 16
    return config, cls


def qwen2_window():
    return qwen2(use_sliding_window=True, sliding_window=16, max_window_layers=1)


def smollm3():
    config = SmolLM3Config(
        **SMALL,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0},
        no_rope_layer_interval=2,
        # The defaults name ids of the 128k vocabulary; a padding id would also freeze its
        # embedding row (nn.Embedding padding_idx), which no checkpoint records.
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=True,
    )
    return config, SmolLM3ForCausalLM


def gemma3():
    # Gemma 3 270M's and 1B's settings in small: query/key norms, output norms, GeGLU, the
    # embedding scaled by sqrt(hidden_size), a head width of its own (48-wide q on a model 32
    # wide), and a window of 16 keys in every block but every second (the real pattern is
    # every sixth), whose rotary base is 1e4 against the full blocks' 1e6.
    config = Gemma3TextConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=72,
        max_position_embeddings=64,
        hidden_activation="gelu_pytorch_tanh",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        query_pre_attn_scalar=12,
        rms_norm_eps=1e-6,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        # As for SmolLM3: a padding id would freeze its embedding row, which no checkpoint
        # records.
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    return config, Gemma3ForCausalLM


def gemma3_scaled():
    # Gemma 3 27B's attention scale in small: query_pre_attn_scalar (20) is not the head width
    # (12), so q·k is scaled by 20^-1/2, not 12^-1/2.
    config, cls = gemma3()
    config.query_pre_attn_scalar = 20
    return config, cls


def gemma3_multimodal():
    # Gemma 3 4B, 12B and 27B are Gemma3ForConditionalGeneration: the text model above under
    # `language_model`, beside a SigLIP vision tower and its projector (tiny here, and unused
    # by text-only inputs).
    text, _ = gemma3()
    vision = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        # The image and image-boundary ids stay Gemma 3's (past this vocabulary): text alone.
        mm_tokens_per_image=4,
    )
    return config, Gemma3ForConditionalGeneration


def olmo2():
    # OLMo 2's settings in small: norms on the sublayers' outputs instead of their inputs,
    # q/k norms over the whole projections, untied head; a head width of its own (12 on 32,
    # which Olmo2Attention reads from head_dim when the config has it) so that the norms'
    # widths differ from the model's.
    config = Olmo2Config(
        **SMALL,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        # Olmo2Config's own padding id, 1: nn.Embedding(padding_idx=1) gives its row no
        # gradient from the inputs (the reference's tokens hold it; see build()).
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    return config, Olmo2ForCausalLM


def olmo3():
    # OLMo 3's pattern in small: a window of 16 keys in blocks 0 and 2, block 1 full; the full
    # block's rotary embedding YaRN-scaled (as OLMo 3's long-context checkpoints), the
    # windowed blocks' plain.
    config = Olmo3Config(
        **SMALL,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 500000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    return config, Olmo3ForCausalLM


def granite():
    # Granite 3's scalars in small (its 2B and 8B have 12, 0.22, 1/64 or 1/128, and 8 or 16).
    config = GraniteConfig(
        **SMALL,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.2,
        logits_scaling=6.0,
        # Granite's padding id is its end of text, 0: that row's gradient comes from the tied
        # head alone.
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
    )
    return config, GraniteForCausalLM


def yarn_defaults_inv_freq():
    # YaRN with every optional setting at transformers' default (betas 32 and 1, ends rounded
    # outwards, attention factor from the factor), for the rotary frequencies alone.
    config, _ = llama(
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    )
    fn = ROPE_INIT_FUNCTIONS["yarn"]
    inv_freq, attention_factor = fn(config, "cpu")
    return inv_freq.float(), attention_factor


def build(name, spec, seed, extra=None, gradients=False, norm_center=1.0):
    torch.manual_seed(seed)
    config, cls = spec
    model = cls(config).to(torch.float32).eval()
    perturb(model, norm_center)
    directory = os.path.join(OUT, name)
    model.save_pretrained(directory, safe_serialization=True)

    # A multimodal model's text settings are its text_config's.
    vocab = config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=g)
    targets = torch.randint(0, vocab, (2, SEQ), generator=g)
    # A model with a padding index sees it in every fifth input position, so the reference's
    # gradients show what padding_idx does.
    pad = config.get_text_config().pad_token_id
    if pad is not None:
        tokens[:, ::5] = pad
    model.config._attn_implementation = "eager"
    logits = model(input_ids=tokens).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    grads = {}
    if gradients:
        loss.backward()
        # A tied head's gradient is the embedding's: named once, as the model names it.
        grads = {f"grad.{n}": p.grad.float().contiguous() for n, p in model.named_parameters()}
    logits, loss = logits.detach(), loss.detach()
    rotary = getattr(model.model, "language_model", model.model).rotary_emb
    # Gemma 3 keeps one set of frequencies per layer type: the full blocks' are the model's.
    if hasattr(rotary, "inv_freq"):
        inv_freq, scaling = rotary.inv_freq.float(), rotary.attention_scaling
    else:
        inv_freq, scaling = rotary.full_attention_inv_freq.float(), rotary.full_attention_attention_scaling
        extra = {**(extra or {}), "sliding_inv_freq": rotary.sliding_attention_inv_freq.float().contiguous()}
    save_file(
        {
            "tokens": tokens.to(torch.int32).contiguous(),
            "targets": targets.to(torch.int32).contiguous(),
            "logits": logits.contiguous(),
            "loss": loss.reshape(1).contiguous(),
            "inv_freq": inv_freq.contiguous(),
            "attention_scaling": torch.tensor([float(scaling)]),
            **(extra or {}),
            **grads,
        },
        os.path.join(directory, "reference.safetensors"),
    )
    print(f"{directory}: loss {loss.item():.6f}, inv_freq {inv_freq.tolist()}", file=sys.stderr)


def main():
    import transformers

    build(
        "hf-llama3-rope",
        llama(
            {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
        seed=30,
    )
    build("hf-llama-linear-rope", llama({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}), seed=40)
    build("hf-qwen2", qwen2(), seed=50)
    build("hf-mistral", mistral(), seed=60)
    defaults, defaults_scaling = yarn_defaults_inv_freq()
    build(
        "hf-llama-yarn-rope",
        llama(
            {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 8.0,
                "beta_slow": 0.5,
                "truncate": False,
            }
        ),
        seed=70,
        extra={
            "yarn_defaults_inv_freq": defaults.contiguous(),
            "yarn_defaults_attention_scaling": torch.tensor([float(defaults_scaling)]),
        },
    )
    build("hf-qwen3", qwen3(), seed=80, gradients=True)
    build("hf-mistral-head-dim", mistral_head_dim(), seed=90)
    build("hf-mistral-window", mistral_window(), seed=100, gradients=True)
    build("hf-qwen2-window", qwen2_window(), seed=110)
    build("hf-smollm3", smollm3(), seed=120, gradients=True)
    build("hf-gemma3", gemma3(), seed=130, gradients=True, norm_center=0.0)
    build("hf-gemma3-multimodal", gemma3_multimodal(), seed=140, norm_center=0.0)
    build("hf-gemma3-scaled", gemma3_scaled(), seed=150, norm_center=0.0)
    build("hf-olmo2", olmo2(), seed=160, gradients=True)
    build("hf-olmo3", olmo3(), seed=170, gradients=True)
    build("hf-granite", granite(), seed=180, gradients=True)
    with open(os.path.join(OUT, "hf-llama-family-versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    if "--write" not in sys.argv[1:]:
        print("writes fixtures only with --write (not a comparison bench)", file=sys.stderr)
        sys.exit(3)
    main()
