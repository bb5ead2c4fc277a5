#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the CPU, forward and forward+backward, on the
shapes of benches/benches/attn.rs: batch 1, 8 heads, head_dim 64, causal, f32, N = 1024 /
2048 / 4096.

Prints one JSON record per line (the headroom_benches::Record fields). Each names headroom's
flash record of the same pass and size (`attn/<pass>/flash/T<N>`) as its baseline with
`baseline_value: null`, so `cargo xtask bench` fills in the ratio torch / headroom-flash.
FLOPs follow FlashAttention's count: forward 4·N²·d per head, halved for causal; backward
2.5× forward.

Exits with code 3 and a reason on stderr when torch is not installed.
"""

import json
import statistics
import sys
import time

HEADS = 8
HEAD_DIM = 64
SEQ_LENS = (1024, 2048, 4096)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def forward_flops(n):
    return 4.0 * HEADS * n * n * HEAD_DIM / 2.0  # causal halves the work


def record(bench, metric, value, unit, baseline, better):
    return json.dumps(
        {
            "bench": bench,
            "metric": metric,
            "value": value,
            "unit": unit,
            "baseline": baseline,
            "baseline_value": None,
            "ratio": None,
            "better": better,
        }
    )


def main():
    quick = "--quick" in sys.argv[1:]
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:  # no torch: the comparison is skipped, not failed
        print(f"torch is not installed ({e})", file=sys.stderr)
        return 3

    samples = 3 if quick else 7
    torch.manual_seed(0)
    log(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}"
    )
    for n in SEQ_LENS:
        shape = (1, HEADS, n, HEAD_DIM)
        q, k, v, d_out = (torch.rand(shape, dtype=torch.float32) * 2 - 1 for _ in range(4))

        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

        def fwd_bwd():
            for t in (qg, kg, vg):
                t.grad = None
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            out.backward(d_out)

        for pass_name, fn, flops in (
            ("fwd", fwd, forward_flops(n)),
            ("fwd_bwd", fwd_bwd, 3.5 * forward_flops(n)),
        ):
            fn()  # warm-up: thread pool, allocator
            times = []
            for _ in range(samples):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            med = statistics.median(times)
            ours = f"attn/{pass_name}/flash/T{n}"
            bench = f"attn/{pass_name}/torch_sdpa/T{n}"
            print(record(bench, "median_time", med * 1e3, "ms", ours, "lower"), flush=True)
            print(
                record(bench, "throughput", flops / med / 1e9, "GFLOP/s", ours, "higher"),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
