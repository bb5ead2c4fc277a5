#!/usr/bin/env python3
"""Where a GPT-2 training step's GPU time goes, kernel by kernel: headroom's and PyTorch's.

A profiling tool for a GPU session, not one of benches/torch's comparison scripts (`cargo xtask
bench` does not run it). It puts both trainers' kernels into the same categories (matrix
products, attention, layer norm, GELU, loss, optimizer, casts, ...) so the step-time gap to
PyTorch eager can be read category by category.

- `--ncu FILE`: headroom's kernels, from Nsight Compute's CSV of a `headroom train` run,
  written with
      ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
          headroom train --model gpt2 --precision bf16 ... --steps S > FILE
  (every kernel of S steps, each timed alone under ncu's replay); `--steps S` divides by S.
- `--torch`: PyTorch eager's kernels for benches/torch/trainer_gpt.py's step (same model,
  bf16 autocast, SDPA, fused AdamW, clipping) at batch 8 x 1024, timed by torch.profiler over
  `--steps` steps after two warm-up steps.

Both print the total kernel time per step, a table by category (ms per step, launches per
step) and the kernels that take the most time. The sum of kernel times is not the step time:
gaps between kernels (launch latency, host work, synchronisation) come on top, and the step's
wall time measured outside the profiler says how much.
"""

import argparse
import collections
import csv
import importlib.util
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# First match wins: more specific patterns first ("layer_norm" before "norm", the loss's
# softmax before elementwise).
CATEGORIES = [
    ("attention", r"flash|fmha|sdpa|attention|mha"),
    ("layer norm", r"layer_?norm|rms_?norm|gammabeta"),
    ("loss (softmax, cross-entropy)", r"cross_entropy|softmax|nll_loss"),
    ("optimizer (AdamW)", r"adam"),
    ("reductions (gradient norm, sums)", r"sum_squares|norm|reduce_kernel"),
    ("matrix products", r"gemm|xmma|cutlass|cublas|nvjet|sm90_|sm80_|ampere|wgmma|splitk"),
    ("GELU", r"gelu"),
    ("embedding", r"embedding|index_select|indexing_backward|index_put|radix|segment"),
    ("column sums (bias gradients)", r"column_sum"),
    ("casts and rounding", r"round_|cast|copy|convert|to_bf16|bfloat16_copy"),
    ("head permutes", r"permute"),
    ("residual adds, scaling, fills", r"residual|add|axpy|scale|mul|fill|zero|memset"),
]


def category(name):
    low = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, low):
            return label
    return "other"


def short(name, width=90):
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 1] + "…"


def report(title, kernels, steps):
    """kernels: list of (name, nanoseconds)."""
    total = sum(ns for _, ns in kernels)
    by_cat = collections.defaultdict(lambda: [0.0, 0])
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for name, ns in kernels:
        by_cat[category(name)][0] += ns
        by_cat[category(name)][1] += 1
        by_name[name][0] += ns
        by_name[name][1] += 1
    print(f"== {title}: {len(kernels) / steps:.0f} kernels per step, "
          f"{total / steps / 1e6:.3f} ms of kernel time per step")
    print(f"{'category':34} {'ms/step':>9} {'share':>7} {'launches/step':>14}")
    for label, (ns, n) in sorted(by_cat.items(), key=lambda kv: -kv[1][0]):
        print(f"{label:34} {ns / steps / 1e6:9.3f} {100 * ns / max(total, 1):6.1f}% "
              f"{n / steps:14.1f}")
    print("top kernels (ms/step, launches/step, category):")
    for name, (ns, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"  {ns / steps / 1e6:8.3f} {n / steps:7.1f}  {category(name):28} {short(name)}")
    print(flush=True)


def read_ncu(path):
    """(name, ns) per kernel launch from ncu's --csv output (log lines before the header are
    skipped)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    kernels = []
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6,
                 "ms": 1e6, "second": 1e9, "s": 1e9}.get(unit)
        if scale is None:
            raise SystemExit(f"unknown unit {unit!r} in {path}")
        kernels.append((row["Kernel Name"], value * scale))
    return kernels


def torch_kernels(steps, batch, seq):
    import torch
    from torch.profiler import ProfilerActivity, profile

    spec = importlib.util.spec_from_file_location(
        "trainer_gpt", os.path.join(HERE, "..", "..", "benches", "torch", "trainer_gpt.py"))
    tg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tg)
    layers, heads, channels, context, vocab = tg.CONFIGS["gpt2"]
    torch.manual_seed(tg.SEED)
    model = tg.build_model(torch, layers, heads, channels, context, vocab).cuda()
    opt = tg.make_optimizer(torch, model)
    gen = torch.Generator().manual_seed(tg.SEED)
    idx = torch.randint(vocab, (batch, seq), generator=gen).cuda()
    targets = torch.randint(vocab, (batch, seq), generator=gen).cuda()
    params = list(model.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tg.CLIP_NORM)
        opt.step()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((e.name, e.time_range.elapsed_us() * 1e3))
    return kernels


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ncu", help="Nsight Compute CSV of a headroom run")
    p.add_argument("--torch", action="store_true", help="profile PyTorch eager's step")
    p.add_argument("--steps", type=int, default=2, help="steps the kernels cover")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args(argv)
    if not args.ncu and not args.torch:
        p.error("give --ncu FILE, --torch, or both")
    if args.ncu:
        report(f"headroom ({args.ncu}, {args.steps} steps)", read_ncu(args.ncu), args.steps)
    if args.torch:
        report(f"torch eager, bf16 autocast ({args.steps} steps)",
               torch_kernels(args.steps, args.batch, args.seq), args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
