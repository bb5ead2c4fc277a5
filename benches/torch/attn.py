#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the CPU, forward and forward+backward, on the
shapes of benches/benches/attn.rs: batch 1, 8 heads, head_dim 64, causal, f32, N = 1024 /
2048 / 4096.

Prints one JSON record per line (the headroom_benches::Record fields). Each names headroom's
flash record of the same pass and size (`attn/<pass>/flash/T<N>`) as its baseline with
`baseline_value: null`, so `cargo xtask bench` fills in the ratio torch / headroom-flash.
FLOPs follow FlashAttention's count: forward 4·N²·d per head, halved for causal; backward
2.5× forward.

With `--device cuda` (issue 11; `cargo xtask bench` never passes it): torch SDPA on the GPU in
bf16, causal, N = 4096, head_dim 128, batch 4 and 16 heads (FlashAttention-2's benchmark shape:
batch x N = 16k tokens, width 2048), forward and forward+backward. Records
`attn/cuda/<pass>/torch_sdpa/bf16/T4096_D128` (median_time in ms, throughput in TFLOP/s, same
FLOP count), each naming `attn/cuda/<pass>/flash/bf16/T4096_D128` as its baseline.

Exits with code 3 and a reason on stderr when torch is not installed, or with `--device cuda`
when torch sees no CUDA device.
"""

import argparse
import json
import statistics
import sys
import time

HEADS = 8
HEAD_DIM = 64
SEQ_LENS = (1024, 2048, 4096)

# --device cuda: issue 11's shape, at FlashAttention-2's benchmark batch (16k tokens per step).
CUDA_BATCH = 4
CUDA_HEADS = 16
CUDA_HEAD_DIM = 128
CUDA_SEQ_LEN = 4096


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def forward_flops(n, heads=HEADS, head_dim=HEAD_DIM):
    return 4.0 * heads * n * n * head_dim / 2.0  # causal halves the work


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


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer timed repeats")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    quick = args.quick
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:  # no torch: the comparison is skipped, not failed
        print(f"torch is not installed ({e})", file=sys.stderr)
        return 3
    if args.device == "cuda":
        return cuda_main(torch, F, quick)

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


def cuda_main(torch, F, quick):
    if not torch.cuda.is_available():
        print(
            f"--device cuda: no CUDA device visible to torch {torch.__version__} "
            f"(built for CUDA {torch.version.cuda})",
            file=sys.stderr,
        )
        return 3
    if not torch.cuda.is_bf16_supported():
        print(f"--device cuda: {torch.cuda.get_device_name()} has no bf16", file=sys.stderr)
        return 3
    # Kernels take microseconds to milliseconds: more repeats than on the CPU are cheap.
    warmup, samples = (3, 10) if quick else (10, 50)
    torch.manual_seed(0)
    n = CUDA_SEQ_LEN
    log(
        f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, "
        f"batch {CUDA_BATCH}, {CUDA_HEADS} heads, head_dim {CUDA_HEAD_DIM}, N {n}, bf16, causal; "
        f"sdpa flash {torch.backends.cuda.flash_sdp_enabled()}, "
        f"cudnn {torch.backends.cuda.cudnn_sdp_enabled()}, "
        f"mem_efficient {torch.backends.cuda.mem_efficient_sdp_enabled()}"
    )
    shape = (CUDA_BATCH, CUDA_HEADS, n, CUDA_HEAD_DIM)
    q, k, v, d_out = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def fwd_bwd():
        for t in (qg, kg, vg):
            t.grad = None
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        out.backward(d_out)

    flops = CUDA_BATCH * forward_flops(n, CUDA_HEADS, CUDA_HEAD_DIM)
    label = f"bf16/T{n}_D{CUDA_HEAD_DIM}"
    for pass_name, fn, pass_flops in (("fwd", fwd, flops), ("fwd_bwd", fwd_bwd, 3.5 * flops)):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(samples):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        med = statistics.median(times)
        ours = f"attn/cuda/{pass_name}/flash/{label}"
        bench = f"attn/cuda/{pass_name}/torch_sdpa/{label}"
        log(f"{pass_name}: {med * 1e3:.3f} ms, {pass_flops / med / 1e12:.1f} TFLOP/s")
        print(record(bench, "median_time", med * 1e3, "ms", ours, "lower"), flush=True)
        print(
            record(bench, "throughput", pass_flops / med / 1e12, "TFLOP/s", ours, "higher"),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
