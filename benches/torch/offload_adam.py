"""PyTorch's fused CPU AdamW (torch >= 2.4) at the sizes of benches/benches/offload.rs.

Prints one JSON record per size (see benches/torch/README.md). Exits with code 3 and a reason
on stderr when torch (or its fused CPU AdamW) is not available.
"""
import json
import statistics
import sys
import time

try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"torch is not importable: {e}", file=sys.stderr)
    sys.exit(3)

QUICK = "--quick" in sys.argv
SIZES = [(10_000_000, "10M"), (50_000_000, "50M")]
REPEATS = 5 if QUICK else 15


def main() -> None:
    torch.manual_seed(0)
    for n, label in SIZES:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 0.01
        try:
            opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
            opt.step()  # allocates state; not timed
        except (RuntimeError, TypeError) as e:
            print(f"fused CPU AdamW unavailable in torch {torch.__version__}: {e}", file=sys.stderr)
            sys.exit(3)
        times = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
        rate = n / statistics.median(times)
        print(json.dumps({
            "bench": f"offload/adamw_vs_torch/torch_fused/{label}",
            "metric": "params_per_s",
            "value": rate,
            "unit": "params/s",
            "baseline": None,
            "baseline_value": None,
            "ratio": None,
            "better": "higher",
        }))
        del opt, p


if __name__ == "__main__":
    main()
