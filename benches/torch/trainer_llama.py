#!/usr/bin/env python3
"""PyTorch eager training step of the Llama that headroom's reference trainer builds
(`--model llama-small`: crates/trainer/src/model/llama_block.rs), with transformers'
`LlamaForCausalLM` itself, for the trainer's step-time comparison (issue 16).

The model is transformers' own (SDPA attention, fp32): 6 layers, 6 query heads over 2
key/value heads, width 384, SwiGLU width 1024, context 256, vocabulary 50257, untied head,
RMSNorm eps 1e-5, rope theta 10000. The loss is the mean cross-entropy of its logits against
random targets, as headroom's. Fused AdamW (lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on
parameters with two or more dimensions, 0 on norm gains) and gradient clipping at 1.0. A step
is zero_grad, forward, backward, clip, optimizer step; 2 warm-up steps, then the median of 3
(`--quick`) or 10. Threads: `HEADROOM_THREADS`, else every CPU.

Records `trainer/step/torch_eager/<prec>/llama-small` (step_seconds, s) and
`trainer/tokens_per_s/torch_eager/<prec>/llama-small` (tokens_per_s) for fp32 and bf16
autocast. Exits 3 when torch or transformers is missing.
"""

import json
import os
import statistics
import sys
import time

EXIT_CANNOT_RUN = 3
LAYERS, HEADS, KV_HEADS, CHANNELS, FFN, CONTEXT, VOCAB = 6, 6, 2, 384, 1024, 256, 50257
BATCH, SEQ = 8, 256
WARMUP_STEPS = 2


def record(bench, metric, value, unit, better):
    return json.dumps({"bench": bench, "metric": metric, "value": value, "unit": unit,
                       "baseline": None, "baseline_value": None, "ratio": None,
                       "better": better})


def expected_param_count():
    """headroom's count (ModelConfig::parameter_count): embedding and untied head V·C each,
    per block q and o C×C, k and v C×KV·hs, three C×F, two norms; the final norm."""
    c, kv = CHANNELS, KV_HEADS * (CHANNELS // HEADS)
    return 2 * VOCAB * c + LAYERS * (2 * c * (c + kv) + 3 * c * FFN + 2 * c) + c


def main(argv):
    quick = "--quick" in argv
    # `--only fp32` or `--only bf16`: one precision (bf16 autocast is slow on CPUs without
    # bf16 instructions).
    only = argv[argv.index("--only") + 1] if "--only" in argv[:-1] else None
    try:
        import torch
        import torch.nn.functional as F
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        print(f"torch and transformers are needed ({e})", file=sys.stderr)
        return EXIT_CANNOT_RUN
    threads = int(os.environ.get("HEADROOM_THREADS") or os.cpu_count() or 1)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=CHANNELS, intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        attention_dropout=0.0, hidden_act="silu")
    model = LlamaForCausalLM(config).float()
    model.config._attn_implementation = "sdpa"
    model.train()
    params = sum(p.numel() for p in model.parameters())
    if params != expected_param_count():
        print(f"{params} parameters, headroom's formula gives {expected_param_count()}",
              file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(VOCAB, (BATCH, SEQ), generator=gen)
    targets = torch.randint(VOCAB, (BATCH, SEQ), generator=gen)
    tokens = BATCH * SEQ
    steps = 3 if quick else 10
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}; llama-small {params} parameters, "
          f"batch {BATCH}x{SEQ}, {steps} timed steps after {WARMUP_STEPS} warm-up", flush=True)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    for prec, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        if only is not None and prec != only:
            continue
        model.load_state_dict(initial)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=3e-4, betas=(0.9, 0.95), fused=True)
        plist = list(model.parameters())

        def step():
            opt.zero_grad(set_to_none=True)
            if dtype is None:
                logits = model(input_ids=idx).logits
            else:
                with torch.autocast("cpu", dtype=dtype):
                    logits = model(input_ids=idx).logits
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plist, 1.0)
            opt.step()
            return loss

        for _ in range(WARMUP_STEPS):
            step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - start)
            print(f"{prec}: step {times[-1]:.3f} s", flush=True)
        med = statistics.median(times)
        print(f"{prec}: step {med:.3f} s, {tokens / med:.0f} tokens/s, loss {loss.item():.6f}",
              flush=True)
        print(record(f"trainer/step/torch_eager/{prec}/llama-small", "step_seconds", med, "s",
                     "lower"), flush=True)
        print(record(f"trainer/tokens_per_s/torch_eager/{prec}/llama-small", "tokens_per_s",
                     tokens / med, "tokens/s", "higher"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
