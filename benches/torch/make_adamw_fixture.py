"""Writes the fixture that pins headroom-offload's AdamW to PyTorch's, bit for bit.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Usage, from the workspace root, with a Python that has torch and numpy:

    python3 benches/torch/make_adamw_fixture.py --write   # (re)write the committed fixture
    python3 benches/torch/make_adamw_fixture.py --check   # recompute, compare, write nothing

`--check` exits 1 when this machine's torch gives other bits than the committed fixture (run it
on another CPU to see whether torch's own results move; the fixture records where it was made).

What it runs: `torch.optim.AdamW([p], ..., foreach=False, fused=False)` (the single-tensor
implementation) on the CPU, one thread, ten steps, for every hyper-parameter set in `HYPERS`
and every size in `SIZES` (none a multiple of 8 or 16, so ATen's vector loops have tails).
Gradients come from a seeded NumPy generator and are stored in the fixture; the Rust test
(`crates/offload/tests/torch_fixture.rs`) replays them and needs no Python.

Two runs per case, both of torch's own optimizer code:
- `ieee`: torch with `Tensor.sqrt` swapped for a correctly rounded square root. Every other
  operation (mul_, lerp_, addcmul_, div, add_, addcdiv_, and the Python-double step scalars) is
  torch's. headroom must equal this run bit for bit in p, exp_avg and exp_avg_sq.
- `stock`: torch untouched. x86-64 builds of torch route contiguous f32 `sqrt` through MKL's
  vector math library (`vmsSqrt`, VML_HA), which is not correctly rounded (≈17 % of results
  are one ulp off on an AMD EPYC; MKL picks its code path per CPU, so the bits can move between
  machines). exp_avg and exp_avg_sq never see the square root, so the script asserts they equal
  the `ieee` run's; only p can differ, and the fixture keeps the stock p so the Rust test can
  bound that difference.

Output (kept well under 1 MiB): `crates/offload/tests/fixtures/torch_adamw.bin`, every array as
little-endian f32 one after another, and `torch_adamw.json`, which names each array with its
element offset and length and records the torch version, its CPU capability, the CPU and the
hyper-parameters. Arrays: `p0/n{N}`, `grad/n{N}/t{T}` (T = 1..10), and per set S, size N and
saved step T (1 and 10): `ieee/s{S}/n{N}/t{T}/{p,exp_avg,exp_avg_sq}` and
`stock/s{S}/n{N}/t{T}/p`.
"""
import json
import os
import platform
import sys

try:
    import numpy as np
    import torch
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"torch and numpy are needed: {e}", file=sys.stderr)
    sys.exit(3)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT_DIR = os.path.join(ROOT, "crates", "offload", "tests", "fixtures")
BIN = os.path.join(OUT_DIR, "torch_adamw.bin")
JSON = os.path.join(OUT_DIR, "torch_adamw.json")

STEPS = 10
SAVED_STEPS = [1, 10]
SIZES = [1, 7, 17, 33, 100, 1031]
# (lr, beta1, beta2, eps, weight_decay). Set 0 is torch's default, 1 a GPT-style run, 2 has no
# weight decay; sets 3-5 put 1 - beta1 at or above 0.5, where ATen's lerp takes its other
# formula (end - (end - start)·(1 - w)).
HYPERS = [
    (1e-3, 0.9, 0.999, 1e-8, 1e-2),
    (3e-4, 0.9, 0.95, 1e-8, 0.1),
    (1e-2, 0.8, 0.95, 1e-6, 0.0),
    (5e-3, 0.3, 0.999, 1e-3, 0.05),
    (2e-3, 0.5, 0.99, 1e-8, 0.2),
    (1e-3, 0.0, 0.95, 1e-8, 1e-2),
]
SEED = 20_240_520


def inputs(rng, n):
    """Initial parameters and gradients with a spread of magnitudes and some exact zeros."""
    p0 = (rng.standard_normal(n) * np.exp(rng.uniform(-4, 1, n))).astype(np.float32)
    grads = []
    for _ in range(STEPS):
        g = rng.standard_normal(n) * np.exp(rng.uniform(-9, 0, n))
        g[rng.random(n) < 0.05] = 0.0
        grads.append(g.astype(np.float32))
    return p0, grads


class IeeeSqrt:
    """Within the block, `Tensor.sqrt` is NumPy's correctly rounded float32 square root."""

    def __enter__(self):
        self.calls = 0
        self.saved = torch.Tensor.sqrt
        outer = self

        def sqrt(t):
            outer.calls += 1
            assert t.dtype == torch.float32 and t.device.type == "cpu"
            return torch.from_numpy(np.sqrt(t.detach().numpy()))

        torch.Tensor.sqrt = sqrt
        return self

    def __exit__(self, *exc):
        torch.Tensor.sqrt = self.saved
        return False


def run(hyper, p0, grads):
    """torch's single-tensor AdamW; (p, exp_avg, exp_avg_sq) after every step."""
    lr, beta1, beta2, eps, wd = hyper
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.AdamW(
        [p],
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        weight_decay=wd,
        amsgrad=False,
        maximize=False,
        foreach=False,
        fused=False,
    )
    out = []
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        st = opt.state[p]
        out.append(
            tuple(x.detach().numpy().copy() for x in (p, st["exp_avg"], st["exp_avg_sq"]))
        )
    return out


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def same_bits(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


def build():
    torch.set_num_threads(1)
    rng = np.random.default_rng(SEED)
    arrays = []  # (name, float32 array)
    per_size = {}
    for n in SIZES:
        p0, grads = inputs(rng, n)
        per_size[n] = (p0, grads)
        arrays.append((f"p0/n{n}", p0))
        for t, g in enumerate(grads, 1):
            arrays.append((f"grad/n{n}/t{t}", g))
    sqrt_checked = sqrt_wrong = 0
    for s, hyper in enumerate(HYPERS):
        for n in SIZES:
            p0, grads = per_size[n]
            with IeeeSqrt() as patch:
                ieee = run(hyper, p0, grads)
            if patch.calls != STEPS:
                raise SystemExit(f"torch called Tensor.sqrt {patch.calls} times in {STEPS} steps")
            stock = run(hyper, p0, grads)
            for t in range(STEPS):
                for k in (1, 2):
                    if not same_bits(ieee[t][k], stock[t][k]):
                        raise SystemExit(f"moment {k} differs between runs: set {s} n {n} t {t}")
                v = torch.from_numpy(ieee[t][2])
                sqrt_checked += n
                sqrt_wrong += int((v.sqrt().numpy().view(np.uint32)
                                   != np.sqrt(ieee[t][2]).view(np.uint32)).sum())
            for t in SAVED_STEPS:
                p, m, v = ieee[t - 1]
                arrays.append((f"ieee/s{s}/n{n}/t{t}/p", p))
                arrays.append((f"ieee/s{s}/n{n}/t{t}/exp_avg", m))
                arrays.append((f"ieee/s{s}/n{n}/t{t}/exp_avg_sq", v))
                arrays.append((f"stock/s{s}/n{n}/t{t}/p", stock[t - 1][0]))
    index, offset = [], 0
    for name, a in arrays:
        index.append({"name": name, "offset": offset, "len": int(a.size)})
        offset += int(a.size)
    blob = b"".join(a.astype("<f4").tobytes() for _, a in arrays)
    meta = {
        "generator": "benches/torch/make_adamw_fixture.py",
        "torch_version": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_mkl": bool(torch.backends.mkl.is_available()),
        "numpy_version": np.__version__,
        "cpu": cpu_name(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "optimizer": "torch.optim.AdamW(foreach=False, fused=False, amsgrad=False, maximize=False)",
        "stock_sqrt_not_correctly_rounded": f"{sqrt_wrong} of {sqrt_checked}",
        "steps": STEPS,
        "saved_steps": SAVED_STEPS,
        "sizes": SIZES,
        "seed": SEED,
        "hypers": [
            dict(zip(("lr", "beta1", "beta2", "eps", "weight_decay"), h)) for h in HYPERS
        ],
        "arrays": index,
    }
    return meta, blob


def main():
    if "--write" not in sys.argv and "--check" not in sys.argv:
        print("fixture generator, not a bench: run with --write or --check", file=sys.stderr)
        sys.exit(3)
    meta, blob = build()
    text = json.dumps(meta, indent=1) + "\n"
    if "--check" in sys.argv:
        with open(BIN, "rb") as f:
            old_blob = f.read()
        with open(JSON) as f:
            old = json.load(f)
        if old["arrays"] != meta["arrays"]:
            print("the array layout differs from the committed fixture", file=sys.stderr)
            sys.exit(1)
        new = np.frombuffer(blob, "<u4")
        committed = np.frombuffer(old_blob, "<u4")
        bad = [a["name"] for a in meta["arrays"]
               if not np.array_equal(new[a["offset"]:a["offset"] + a["len"]],
                                     committed[a["offset"]:a["offset"] + a["len"]])]
        print(f"torch {meta['torch_version']} ({meta['torch_cpu_capability']}, {meta['cpu']}) "
              f"vs fixture from torch {old['torch_version']} ({old['torch_cpu_capability']}, "
              f"{old['cpu']}): {len(bad)} of {len(meta['arrays'])} arrays differ")
        for name in bad:
            print(f"  differs: {name}")
        sys.exit(1 if bad else 0)
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(BIN, "wb") as f:
        f.write(blob)
    with open(JSON, "w") as f:
        f.write(text)
    print(f"wrote {BIN} ({len(blob)} bytes) and {JSON}; "
          f"stock sqrt not correctly rounded: {meta['stock_sqrt_not_correctly_rounded']}")


if __name__ == "__main__":
    main()
