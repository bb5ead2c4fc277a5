"""PyTorch's fused CPU AdamW (torch >= 2.4) at the sizes of benches/benches/offload.rs.

Prints one JSON record per size (see benches/torch/README.md). Exits with code 3 and a reason
on stderr when torch (or its fused CPU AdamW) is not available.

The offload bench also calls it once per round, alternating with its own timing, as
`offload_adam.py --size 10M --repeats 7 --prefix offload/adamw_interleaved`: one size, a given
number of timed steps, and records named under that prefix.
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

SIZES = [(10_000_000, "10M"), (50_000_000, "50M")]


def arg(name, default):
    if name in sys.argv:
        i = sys.argv.index(name)
        if i + 1 < len(sys.argv):
            return sys.argv[i + 1]
    return default


QUICK = "--quick" in sys.argv
REPEATS = int(arg("--repeats", 5 if QUICK else 15))
ONLY_SIZE = arg("--size", None)
PREFIX = arg("--prefix", "offload/adamw_vs_torch")


def main() -> None:
    torch.manual_seed(0)
    sizes = [(n, label) for n, label in SIZES if ONLY_SIZE in (None, label)]
    if not sizes:
        print(f"unknown size {ONLY_SIZE}; known: {[l for _, l in SIZES]}", file=sys.stderr)
        sys.exit(2)
    for n, label in sizes:
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
            "bench": f"{PREFIX}/torch_fused/{label}",
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
