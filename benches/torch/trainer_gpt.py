#!/usr/bin/env python3
"""PyTorch eager training step of the GPT-2 that headroom's reference trainer builds
(crates/trainer/src/model/*.rs), for the trainer's step-time comparison (issue 10) and, with
`--device cuda`, the GPU comparison (issue 11).

The model matches headroom's op for op: learned token and position embeddings, pre-LayerNorm
blocks (eps 1e-5), causal multi-head attention through F.scaled_dot_product_attention with one
qkv Linear(C, 3C) and a Linear(C, C) projection, MLP Linear(C, 4C) -> tanh-GELU ->
Linear(4C, C), final LayerNorm, output head tied to wte, no dropout; mean cross-entropy over
tokens. Fused AdamW (lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on parameters with two or more
dimensions, 0 on biases and norm gains) and gradient clipping at norm 1.0, as headroom's
`headroom train` uses. A step is zero_grad, forward, backward, clip, optimizer step.

Modes:
- `--device cpu` (default, what `cargo xtask bench` runs): config `small` (6 layers, 6 heads,
  width 384, context 256, vocab 50257), batch 8x256, threads `HEADROOM_THREADS` else every CPU.
  fp32 and bf16 (torch.autocast('cpu', bfloat16)) are each timed: 2 warm-up steps, then the
  median of 3 (`--quick`) or 10 steps. Records `trainer/step/torch_eager/<prec>/small`
  (step_seconds, s) and `trainer/tokens_per_s/torch_eager/<prec>/small` (tokens_per_s).
- `--device cuda`: config `gpt2` (124M), bf16 autocast, batch 8x1024 unless `--batch/--seq`
  say otherwise. Records `trainer/cuda/torch_eager/bf16/gpt2/tokens_per_s` and
  `trainer/cuda/torch_eager/bf16/gpt2/peak_bytes` (torch.cuda.max_memory_allocated over the
  timed steps, after the warm-up allocated the optimizer state); the device name is logged.

Records carry no baseline: headroom's own trainer bench names these ids as its baseline, so the
report's ratio reads headroom / torch (issue 10's target is <= 1.0x for fp32).

Log lines go to stdout (they never start with '{'); stderr carries only the reason when the
script exits with code 3 (no torch, no fused AdamW, no CUDA device).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

EXIT_CANNOT_RUN = 3

# name: (layers, heads, channels, context, vocab) -- crates/trainer/src/model/config.rs
CONFIGS = {
    "small": (6, 6, 384, 256, 50257),
    "gpt2": (12, 12, 768, 1024, 50257),
}
DEFAULTS = {  # device: (config, batch, seq)
    "cpu": ("small", 8, 256),
    "cuda": ("gpt2", 8, 1024),
}
WARMUP_STEPS = 2
LR = 3e-4
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0
LN_EPS = 1e-5
SEED = 0


def log(msg):
    print(msg, flush=True)


def cannot_run(reason):
    print(reason, file=sys.stderr, flush=True)
    return EXIT_CANNOT_RUN


def record(bench, metric, value, unit, better):
    return json.dumps(
        {
            "bench": bench,
            "metric": metric,
            "value": value,
            "unit": unit,
            "baseline": None,
            "baseline_value": None,
            "ratio": None,
            "better": better,
        }
    )


def expected_param_count(layers, channels, context, vocab):
    """headroom's count: wte + wpe + per block (qkv, proj, fc, fc_proj weights and biases, two
    LayerNorms) + ln_f; the tied head adds nothing."""
    c = channels
    return vocab * c + context * c + layers * (12 * c * c + 13 * c) + 2 * c


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 timed steps instead of 10")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precisions", default="fp32,bf16",
                   help="cpu only: comma-separated, of fp32 and bf16 (default both); torch's bf16 "
                        "step takes minutes on a CPU without AVX512-BF16")
    p.add_argument("--config", choices=sorted(CONFIGS), help="default: small on cpu, gpt2 on cuda")
    p.add_argument("--batch", type=int, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int,
                   help="tokens per sequence (default: 256 on cpu, 1024 on cuda)")
    args = p.parse_args(argv)
    config, batch, seq = DEFAULTS[args.device]
    args.config = args.config or config
    args.batch = batch if args.batch is None else args.batch
    args.seq = seq if args.seq is None else args.seq
    context = CONFIGS[args.config][3]
    if args.batch < 1:
        p.error(f"--batch must be positive, got {args.batch}")
    if not 1 <= args.seq <= context:
        p.error(f"--seq must be in 1..={context} for config {args.config}, got {args.seq}")
    unknown = set(args.precisions.split(",")) - {"fp32", "bf16"}
    if unknown:
        p.error(f"--precisions takes fp32 and bf16, got {sorted(unknown)}")
    return args


def build_model(torch, layers, heads, channels, context, vocab):
    nn = torch.nn
    F = torch.nn.functional

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(channels, 3 * channels)
            self.c_proj = nn.Linear(channels, channels)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(c, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(channels, 4 * channels)
            self.c_proj = nn.Linear(4 * channels, channels)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(channels, eps=LN_EPS)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(channels, eps=LN_EPS)
            self.mlp = Mlp()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, channels)
            self.wpe = nn.Embedding(context, channels)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(channels, eps=LN_EPS)
            self.lm_head = nn.Linear(channels, vocab, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as headroom's head reuses wte
            # headroom's init (params.rs): N(0, 0.02), residual projections / sqrt(2 layers),
            # zero biases, unit gains. Timing does not depend on it; the loss scale does.
            residual_std = 0.02 / math.sqrt(2 * layers)
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif ".ln_" in name or name.startswith("ln_"):
                    nn.init.ones_(p)
                else:
                    std = residual_std if name.endswith("c_proj.weight") else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)

        def forward(self, idx, targets):
            b, t = idx.shape
            pos = torch.arange(t, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    return Gpt()


def make_optimizer(torch, model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=True)


def timed_steps(torch, model, opt, idx, targets, autocast_device, dtype, steps, sync):
    """Median seconds of `steps` full training steps after WARMUP_STEPS untimed ones, and the
    last loss. `dtype` None means fp32 (no autocast)."""
    params = list(model.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        if dtype is None:
            loss = model(idx, targets)
        else:
            with torch.autocast(autocast_device, dtype=dtype):
                loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
        opt.step()
        return loss

    for _ in range(WARMUP_STEPS):
        step()
    sync()
    if autocast_device == "cuda":
        # Steady state: the warm-up allocated the optimizer state, which stays counted.
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), loss.detach().item()


def main(argv):
    args = parse_args(argv)
    try:
        import torch
    except ImportError as e:  # no torch: the comparison is skipped, not failed
        return cannot_run(f"torch is not installed ({e})")

    if args.device == "cuda":
        if not torch.cuda.is_available():
            return cannot_run(
                f"--device cuda: no CUDA device visible to torch {torch.__version__} "
                f"(built for CUDA {torch.version.cuda})"
            )
        if not torch.cuda.is_bf16_supported():
            return cannot_run(f"--device cuda: {torch.cuda.get_device_name()} has no bf16")
        device = torch.device("cuda")
    else:
        threads = int(os.environ.get("HEADROOM_THREADS") or os.cpu_count() or 1)
        torch.set_num_threads(threads)
        device = torch.device("cpu")

    layers, heads, channels, context, vocab = CONFIGS[args.config]
    torch.manual_seed(SEED)
    model = build_model(torch, layers, heads, channels, context, vocab).to(device)
    params = sum(p.numel() for p in model.parameters())  # the tied head counts once
    expected = expected_param_count(layers, channels, context, vocab)
    log(f"config {args.config}: {layers} layers, {heads} heads, width {channels}, "
        f"context {context}, vocab {vocab}: {params} parameters (headroom's formula: {expected})")
    if params != expected:
        print(f"parameter count {params} differs from headroom's {expected}: the models differ",
              file=sys.stderr)
        return 1
    try:
        opt = make_optimizer(torch, model)
    except (RuntimeError, TypeError, ValueError) as e:
        return cannot_run(f"fused AdamW unavailable in torch {torch.__version__} on {device}: {e}")

    gen = torch.Generator().manual_seed(SEED)
    idx = torch.randint(vocab, (args.batch, args.seq), generator=gen).to(device)
    targets = torch.randint(vocab, (args.batch, args.seq), generator=gen).to(device)
    tokens = args.batch * args.seq
    steps = 3 if args.quick else 10

    if args.device == "cuda":
        log(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, "
            f"batch {args.batch}x{args.seq}, {steps} timed steps after {WARMUP_STEPS} warm-up")
        med, loss = timed_steps(torch, model, opt, idx, targets, "cuda", torch.bfloat16, steps,
                                torch.cuda.synchronize)
        peak = torch.cuda.max_memory_allocated()
        log(f"bf16: step {med * 1e3:.1f} ms, {tokens / med:.0f} tokens/s, "
            f"peak allocated {peak / 2**30:.2f} GiB, reserved "
            f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB, loss {loss:.6f}")
        prefix = f"trainer/cuda/torch_eager/bf16/{args.config}"
        print(record(f"{prefix}/tokens_per_s", "tokens_per_s", tokens / med, "tokens/s",
                     "higher"), flush=True)
        print(record(f"{prefix}/peak_bytes", "peak_bytes", float(peak), "bytes", "lower"),
              flush=True)
        return 0

    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability "
        f"{torch.backends.cpu.get_cpu_capability()}, batch {args.batch}x{args.seq}, "
        f"{steps} timed steps after {WARMUP_STEPS} warm-up")
    # Each precision starts from the same weights and fresh optimizer state, so the two
    # timings see the same work.
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    wanted = args.precisions.split(",")
    for prec, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        if prec not in wanted:
            continue
        model.load_state_dict(initial)
        opt = make_optimizer(torch, model)
        med, loss = timed_steps(torch, model, opt, idx, targets, "cpu", dtype, steps,
                                lambda: None)
        log(f"{prec}: step {med:.3f} s, {tokens / med:.0f} tokens/s, loss {loss:.6f}")
        print(record(f"trainer/step/torch_eager/{prec}/{args.config}", "step_seconds", med, "s",
                     "lower"), flush=True)
        print(record(f"trainer/tokens_per_s/torch_eager/{prec}/{args.config}", "tokens_per_s",
                     tokens / med, "tokens/s", "higher"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
