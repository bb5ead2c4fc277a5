"""Writes the fixtures that pin headroom-quant's 4-bit layout to bitsandbytes', byte for byte.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Usage, from the workspace root, with a Python that has torch, bitsandbytes (>= 0.46, whose CPU
backend implements quantize_4bit / dequantize_4bit without a GPU) and safetensors:

    python3 benches/torch/make_quant_fixture.py --write   # (re)write the committed fixtures
    python3 benches/torch/make_quant_fixture.py --check   # recompute, compare, write nothing

What it runs, all on the CPU with bitsandbytes' own functions:
- `bitsandbytes.functional.quantize_4bit(x, blocksize=B, quant_type=Q, compress_statistics=D)`
  for NF4 and FP4, block sizes 32, 64, 128 and 4096, with and without double quantization, on
  fixed inputs whose lengths leave a short tail block (and one with an odd length, so the last
  byte holds one code and a pad nibble);
- `bitsandbytes.functional.dequantize_4bit(packed, state)` on each result;
- `torch.Tensor.mean` on f32 vectors of several lengths: double quantization subtracts the mean
  of the absmax values, and torch's f32 sum has its own summation order (ATen's cascade sum, 8
  lanes on an AVX2 build), which headroom reproduces.

Output (kept well under 1 MiB), under `crates/quant/tests/fixtures/`:
- `bnb_4bit.bin`: arrays one after another, little-endian (f32 or u8), and `bnb_4bit.json`,
  which names each array with its byte offset, length and element type, lists the cases with
  their parameters and records the versions and the CPU. Per input `I`: `input/I` (f32). Per
  case `C`: `C/packed` (u8), `C/absmax` (f32; without double quantization) or `C/qabsmax` (u8),
  `C/offset` (f32, one value), `C/absmax2` (f32, the second-level absmax per 256 block) and
  `C/code2` (f32, the 256-entry code map as bitsandbytes stores it), then `C/dequant` (f32).
  `mean/N/input` and `mean/N/torch` for the summation checks; `code/nf4`, `code/fp4`. The
  JSON's `mean_formula_bits` holds torch's mean (f32 bits) of `x_i = (i·7919) mod 1000` for
  longer vectors, which the test recomputes instead of storing.
- `bnb_nf4_dq.safetensors` and `bnb_fp4.safetensors`: one quantized linear weight each, named
  as transformers / PEFT save a `bnb.nn.Linear4bit` (`weight`, `weight.absmax`,
  `weight.quant_map`, `weight.nested_absmax`, `weight.nested_quant_map`,
  `weight.quant_state.bitsandbytes__nf4`, i.e. `QuantState.as_dict(packed=True)` under the
  module's prefix), with the input and the dequantized weight beside them as `ref.input` and
  `ref.dequant` (f32) for the loader test.

Note: bitsandbytes' CPU `quantize_blockwise` overwrites the first entry of the dynamic code map
with -1.0 (its binary search needs the range to reach -1); the stored `code2` shows that.
"""
import json
import os
import platform
import sys

try:
    import torch
    import bitsandbytes
    import bitsandbytes.functional as F
    from safetensors.torch import save_file
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"torch, bitsandbytes and safetensors are needed: {e}", file=sys.stderr)
    sys.exit(3)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT_DIR = os.path.join(ROOT, "crates", "quant", "tests", "fixtures")
BIN = os.path.join(OUT_DIR, "bnb_4bit.bin")
JSON = os.path.join(OUT_DIR, "bnb_4bit.json")
ST_NF4 = os.path.join(OUT_DIR, "bnb_nf4_dq.safetensors")
ST_FP4 = os.path.join(OUT_DIR, "bnb_fp4.safetensors")

# name -> shape. Lengths leave tails for every block size used with them; "odd" has an odd
# element count; "wide" has more than 256 blocks at block size 32, so the second-level
# quantization has two 256-blocks, the second one short.
INPUTS = {
    "small": (37, 70),
    "odd": (3, 37),
    "big": (50, 100),
    "wide": (33, 300),
}
# (input, block size) pairs; every one runs for nf4/fp4 x plain/double.
PAIRS = [("small", 64), ("small", 128), ("odd", 64), ("big", 4096), ("wide", 32)]
MEAN_SIZES = [1, 7, 8, 31, 33, 300, 517, 1000, 4099, 20000]
# Longer vectors whose values are a formula the Rust test recomputes exactly:
# x_i = float((i * 7919) % 1000). Their sums exceed 2^24, so f32 rounding makes the summation
# order visible; torch runs on one thread (above 32 768 elements its order depends on the
# thread count).
MEAN_FORMULA_SIZES = [65_537, 262_144, 1_000_003]


def make_input(name, shape, seed):
    g = torch.Generator().manual_seed(seed)
    n = shape[0] * shape[1]
    x = torch.randn(n, generator=g, dtype=torch.float32)
    # Vary the scale along the tensor, so block maxima differ by orders of magnitude and the
    # double quantization has something to do.
    scale = torch.exp(torch.linspace(-3.0, 2.0, n, dtype=torch.float32))
    x = x * scale
    # A run of exact zeros (an all-zero block at small block sizes) and a few exact code
    # values and midpoints, where rounding ties are decided.
    x[5:45] = 0.0
    if n > 200:
        x[100] = 1.0
        x[101] = -1.0
        x[102] = 0.5
        x[103] = -0.5
    return x.reshape(shape)


def run():
    torch.set_num_threads(1)
    arrays = {}  # name -> (dtype, bytes)
    cases = []

    def put(name, t):
        t = t.detach().contiguous().cpu()
        if t.dtype == torch.float32:
            arrays[name] = ("f32", t.reshape(-1).numpy().tobytes())
        elif t.dtype == torch.uint8:
            arrays[name] = ("u8", t.reshape(-1).numpy().tobytes())
        else:
            raise TypeError(t.dtype)

    inputs = {}
    for i, (name, shape) in enumerate(INPUTS.items()):
        inputs[name] = make_input(name, shape, 1234 + i)
        put(f"input/{name}", inputs[name])

    put("code/nf4", F.get_4bit_type("nf4", device="cpu"))
    put("code/fp4", F.get_4bit_type("fp4", device="cpu"))

    for inp, bs in PAIRS:
        x = inputs[inp]
        for qt in ("nf4", "fp4"):
            for dq in (False, True):
                cname = f"{qt}/{inp}/b{bs}/{'dq' if dq else 'plain'}"
                packed, state = F.quantize_4bit(
                    x, blocksize=bs, quant_type=qt, compress_statistics=dq
                )
                put(f"{cname}/packed", packed)
                if dq:
                    put(f"{cname}/qabsmax", state.absmax)
                    put(f"{cname}/offset", state.offset.reshape(1).float())
                    put(f"{cname}/absmax2", state.state2.absmax)
                    put(f"{cname}/code2", state.state2.code)
                    assert state.state2.blocksize == 256
                else:
                    put(f"{cname}/absmax", state.absmax)
                out = F.dequantize_4bit(packed, state)
                assert out.dtype == torch.float32 and tuple(out.shape) == tuple(x.shape)
                put(f"{cname}/dequant", out)
                cases.append(
                    {
                        "name": cname,
                        "input": inp,
                        "shape": list(x.shape),
                        "blocksize": bs,
                        "quant_type": qt,
                        "double_quant": dq,
                    }
                )

    g = torch.Generator().manual_seed(99)
    for n in MEAN_SIZES:
        v = torch.rand(n, generator=g, dtype=torch.float32) * 3.0
        put(f"mean/{n}/input", v)
        put(f"mean/{n}/torch", v.mean().reshape(1))

    formula_means = {}
    for n in MEAN_FORMULA_SIZES:
        v = ((torch.arange(n, dtype=torch.int64) * 7919) % 1000).to(torch.float32)
        formula_means[str(n)] = v.mean().view(torch.int32).item() & 0xFFFFFFFF

    meta = {
        "mean_formula_bits": formula_means,
        "bitsandbytes": bitsandbytes.__version__,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "processor": cpu_name(),
        "inputs": {k: list(v) for k, v in INPUTS.items()},
        "cases": cases,
        "mean_sizes": MEAN_SIZES,
    }

    # Loader fixtures: a Linear4bit's serialized state as transformers writes it.
    st = {}
    for path, qt, dq, bs, inp in (
        (ST_NF4, "nf4", True, 64, "wide"),
        (ST_FP4, "fp4", False, 128, "small"),
    ):
        x = inputs[inp]
        packed, state = F.quantize_4bit(x, blocksize=bs, quant_type=qt, compress_statistics=dq)
        tensors = {"weight": packed}
        for k, v in state.as_dict(packed=True).items():
            tensors[f"weight.{k}"] = v
        tensors["ref.input"] = x.contiguous()
        tensors["ref.dequant"] = F.dequantize_4bit(packed, state).contiguous()
        st[path] = {k: v.contiguous() for k, v in tensors.items()}
    return arrays, meta, st


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def serialize(arrays, meta):
    blob = bytearray()
    index = {}
    for name, (dtype, data) in arrays.items():
        index[name] = {"offset": len(blob), "bytes": len(data), "dtype": dtype}
        blob += data
    meta = dict(meta)
    meta["arrays"] = index
    return bytes(blob), json.dumps(meta, indent=1, sort_keys=True) + "\n"


def main():
    if "--quick" in sys.argv:
        print("make_quant_fixture: a fixture writer, not a bench", file=sys.stderr)
        sys.exit(3)
    if "--write" not in sys.argv and "--check" not in sys.argv:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    arrays, meta, st = run()
    blob, text = serialize(arrays, meta)
    if "--check" in sys.argv:
        with open(BIN, "rb") as f:
            same = f.read() == blob
        print("fixture matches" if same else "fixture DIFFERS", file=sys.stderr)
        sys.exit(0 if same else 1)
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(BIN, "wb") as f:
        f.write(blob)
    with open(JSON, "w") as f:
        f.write(text)
    for path, tensors in st.items():
        save_file(tensors, path)
    total = len(blob) + len(text) + sum(os.path.getsize(p) for p in st)
    print(f"wrote {len(arrays)} arrays, {total} bytes in all", file=sys.stderr)


if __name__ == "__main__":
    main()
