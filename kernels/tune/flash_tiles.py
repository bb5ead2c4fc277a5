#!/usr/bin/env python3
"""Tile-size sweep of headroom's flash attention kernels on a GPU, next to torch SDPA.

A tuning tool for a GPU session, not one of benches/torch's comparison scripts (`cargo xtask
bench` does not run it). It compiles `kernels/cu/flash_attn_{fwd,bwd}.cu` with NVRTC (through
CuPy, with the options headroom-cuda uses: --fmad=false --ftz=false) once per tile
configuration, overriding the `#ifndef`-guarded tile macros with -D; launches each kernel as
headroom-attn's CUDA backend does (grid, block, dynamic shared memory); checks its output
against an f32 reference computed by torch (math SDPA and autograd on f32 copies of the same
bf16 inputs); and times it with CUDA events (median of --iters launches after --warmup). torch
SDPA (bf16, causal) is timed in the same process on the same tensors.

A configuration is ranked only if its output is within the accuracy module's bf16 tolerances
(output 1e-2, gradients 2e-2, relative to the reference's largest magnitude). Register counts
and local (spill) bytes come from the loaded function's attributes.

Usage (on the GPU machine, from the repository root):
    python3 kernels/tune/flash_tiles.py [--shapes target,gpt2] [--quick] [--cu DIR]
        [--cubins DIR] [--label TEXT] [--json FILE]
--quick runs only the sources' own tile sizes; --cu points at another copy of the sources
(e.g. an older commit's, for an A/B in one session). Compiling every configuration takes a
minute or two of device time, so `--write-cubins DIR` (with $NVRTC naming an NVRTC library)
compiles them for sm_90 ahead on any machine, and `--cubins DIR` loads them there (a cubin
that does not load is compiled again).

Needs torch with CUDA and cupy; prints one JSON object per measurement and a table.
"""

import argparse
import json
import math
import os
import statistics
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CU = os.path.join(HERE, "..", "cu")
COMPILE_OPTIONS = ("--fmad=false", "--ftz=false")
SMEM_PAD = 8
BLOCK_THREADS = 256  # HR_BLOCK_THREADS, the dot kernel's block
DOT_MAX_BLOCKS = 1 << 16

# Shapes: (name, batch, heads, seq, head_dim). "target" is issue 11's flash figure; "gpt2" is
# GPT-2 124M's attention at 8 x 1024.
SHAPES = {
    "target": (4, 16, 4096, 128),
    "gpt2": (8, 12, 1024, 64),
}


def source(module):
    parts = [open(os.path.join(CU, f)).read() for f in ("float_bits.cuh", "flash_attn_common.cuh")]
    parts.append(open(os.path.join(CU, module)).read())
    return "\n".join(parts)


def source_default(macro):
    """The value a `#define MACRO value` (guarded or not) gives in the kernel sources."""
    for f in ("flash_attn_common.cuh", "flash_attn_fwd.cu", "flash_attn_bwd.cu"):
        for line in open(os.path.join(CU, f)):
            parts = line.split()
            if len(parts) == 3 and parts[0] == "#define" and parts[1] == macro:
                return int(parts[2])
    raise KeyError(macro)


_modules = {}

# (warps, BLOCK_K) of the forward and of dQ; (warps, BLOCK_Q) of dK/dV per head dim. --quick
# runs only the sources' own defaults.
FWD_GRID = [(4, 64), (4, 128), (8, 64), (8, 128), (4, 32)]
DQ_GRID = [(4, 64), (4, 32), (8, 64), (8, 32), (4, 128)]
DKDV_GRID = {64: [(4, 64), (4, 32), (8, 64), (8, 32), (4, 128)],
             128: [(4, 64), (4, 32), (8, 64), (8, 32), (4, 16)]}


def every_configuration():
    for warps, bk in FWD_GRID:
        yield "flash_attn_fwd.cu", {"HR_FLASH_WARPS": warps, "HR_FLASH_FWD_BLOCK_K": bk}
    for warps, bk in DQ_GRID:
        yield "flash_attn_bwd.cu", {"HR_FLASH_WARPS": warps, "HR_FLASH_DQ_BLOCK_K": bk}
    for d, grid in DKDV_GRID.items():
        macro = "HR_FLASH_DKDV_BLOCK_Q_D64" if d <= 64 else "HR_FLASH_DKDV_BLOCK_Q_D128"
        for warps, bq in grid:
            yield "flash_attn_bwd.cu", {"HR_FLASH_WARPS": warps, macro: bq}
    yield "flash_attn_fwd.cu", {}
    yield "flash_attn_bwd.cu", {}


def write_cubins(folder):
    """Compile every configuration ahead with NVRTC through ctypes (no GPU, no CuPy)."""
    import ctypes
    lib = ctypes.CDLL(os.environ.get("NVRTC", "libnvrtc.so"))
    os.makedirs(folder, exist_ok=True)
    seen = set()
    for name, defines in every_configuration():
        out = os.path.join(folder, cubin_name(name, defines, "sm_90"))
        if out in seen:
            continue
        seen.add(out)
        prog = ctypes.c_void_p()
        if lib.nvrtcCreateProgram(ctypes.byref(prog), source(name).encode(), name.encode(), 0,
                                  None, None) != 0:
            raise RuntimeError("nvrtcCreateProgram failed")
        opts = [o.encode() for o in options(defines, "sm_90")]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            raise RuntimeError(f"{name} {defines}: {log.value.decode()}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        with open(out, "wb") as fh:
            fh.write(cubin.raw)
        print(out, size.value, flush=True)
    return 0


def options(defines, arch):
    opts = COMPILE_OPTIONS + (f"--gpu-architecture={arch}",)
    return opts + tuple(f"-D{k}={v}" for k, v in sorted(defines.items()))


def cubin_name(name, defines, arch):
    """File name of a module compiled ahead (--write-cubins) for one source and set of defines."""
    import hashlib
    tag = "-".join(f"{k}={v}" for k, v in sorted(defines.items())) or "default"
    digest = hashlib.sha1(source(name).encode()).hexdigest()[:10]
    return f"{name}.{digest}.{arch}.{tag}.cubin"


CUBIN_DIR = None


def module(cp, name, defines, arch):
    key = (name, tuple(sorted(defines.items())))
    if key not in _modules:
        path = CUBIN_DIR and os.path.join(CUBIN_DIR, cubin_name(name, defines, arch))
        loaded = None
        if path and os.path.exists(path):
            try:  # compiled ahead by the same NVRTC options; fall back to compiling here
                loaded = cp.RawModule(path=path)
                loaded.get_function("flash_attn_fwd_bf16_d64" if "fwd" in name
                                    else "flash_attn_bwd_dot_bf16")
            except Exception as e:
                print(f"cubin {path} did not load ({e}); compiling", flush=True)
                loaded = None
        if loaded is None:
            loaded = cp.RawModule(code=source(name), options=options(defines, arch))
        _modules[key] = loaded
    return _modules[key]


def function(cp, name, defines, arch, entry, smem):
    f = module(cp, name, defines, arch).get_function(entry)
    if smem > 48 * 1024:
        f.max_dynamic_shared_size_bytes = smem
    return f


def tile_bytes(rows, d):
    return rows * (d + SMEM_PAD) * 2


def ptr(t):
    return np.uint64(t.data_ptr())


def time_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rel_err(x, ref):
    x = x.float()
    ref = ref.float()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def attr(f):
    try:
        a = f.attributes
        return {"regs": a.get("num_regs"), "local_bytes": a.get("local_size_bytes")}
    except Exception as e:  # attributes are a report, never a reason to skip a timing
        return {"attr_error": str(e)[:100]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="target,gpt2")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="the default tiles only")
    ap.add_argument("--cubins", default=None, help="folder of modules compiled ahead")
    ap.add_argument("--cu", default=None, help="kernel source folder (default kernels/cu)")
    ap.add_argument("--label", default="", help="added to every record")
    ap.add_argument("--write-cubins", default=None, metavar="DIR",
                    help="compile every configuration for sm_90 with the NVRTC library named "
                         "by $NVRTC into DIR and exit (no GPU needed)")
    args = ap.parse_args()
    global CU
    if args.cu:
        CU = args.cu
    if args.write_cubins:
        return write_cubins(args.write_cubins)
    global CUBIN_DIR
    CUBIN_DIR = args.cubins

    import cupy as cp

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    arch = f"sm_{props.major}{props.minor}"
    print(f"device {props.name}, {arch}, torch {torch.__version__}, cupy {cp.__version__}",
          flush=True)
    records = []

    def emit(rec):
        if args.label:
            rec["label"] = args.label
        records.append(rec)
        print(json.dumps(rec), flush=True)

    for shape_name in args.shapes.split(","):
        b, h, n, d = SHAPES[shape_name]
        torch.manual_seed(0)
        q, k, v, d_o = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
        scale = 1.0 / math.sqrt(d)
        scale_log2 = scale * 1.4426950408889634
        flops_fwd = 4 * b * h * n * n * d / 2  # causal: half the score matrix
        flops_bwd = 2.5 * flops_fwd  # the usual count (5 of the forward's 2 matmuls)

        # f32 reference (torch, math on f32 copies of the same bf16 values).
        qf, kf, vf = (t.float().requires_grad_(True) for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out_ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
        dq_ref, dk_ref, dv_ref = torch.autograd.grad(out_ref, (qf, kf, vf), d_o.float())
        out_ref = out_ref.detach()
        del qf, kf, vf
        torch.cuda.empty_cache()

        # torch SDPA, bf16, in this process.
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))

        def sdpa_fwd():
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

        def sdpa_fwd_bwd():
            o = sdpa_fwd()
            torch.autograd.grad(o, (qs, ks, vs), d_o)

        with torch.no_grad():
            t_sdpa_fwd = time_ms(sdpa_fwd, args.warmup, args.iters)
        t_sdpa_fb = time_ms(sdpa_fwd_bwd, args.warmup, args.iters)
        emit({"shape": shape_name, "kernel": "torch_sdpa", "fwd_ms": t_sdpa_fwd,
              "fwd_bwd_ms": t_sdpa_fb, "bwd_ms": t_sdpa_fb - t_sdpa_fwd,
              "fwd_tflops": flops_fwd / t_sdpa_fwd / 1e9,
              "fwd_bwd_tflops": (flops_fwd + flops_bwd) / t_sdpa_fb / 1e9})

        out = torch.empty_like(q)
        lse = torch.empty(b, h, n, device=dev, dtype=torch.float32)
        dot = torch.empty(b, h, n, device=dev, dtype=torch.float32)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        sizes = (np.uint32(n), np.uint32(n), np.uint32(h), np.uint32(h))
        ent = f"bf16_d{d}"

        def measure(rec, module_name, defs, entry, blocks, warps, kernel_args, checks,
                    flops=None):
            """Compile one configuration, launch it once, compare each output named in `checks`
            ({record key: (output, reference, tolerance)}), time it and emit its record. Returns
            (median ms, defs) when every output is within tolerance, else None."""
            try:
                f = function(cp, module_name, defs, arch, entry, rec["smem"])
                rec.update(attr(f))

                def run():
                    f((blocks,), (warps * 32,), kernel_args, shared_mem=rec["smem"])

                run()
                torch.cuda.synchronize()
                for key, (got, ref, _) in checks.items():
                    rec[key] = rel_err(got, ref)
                rec["ok"] = all(rec[key] < tol for key, (_, _, tol) in checks.items())
                rec["ms"] = time_ms(run, args.warmup, args.iters)
                if flops:
                    rec["tflops"] = flops / rec["ms"] / 1e9
            except Exception as e:  # a configuration that does not compile or launch
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
                rec["ok"] = False
            emit(rec)
            return (rec["ms"], defs) if rec["ok"] else None

        def fastest(results):
            results = [r for r in results if r is not None]
            return min(results, key=lambda r: r[0]) if results else None

        def tiling(kernel, warps, block_q, block_k, smem):
            return {"shape": shape_name, "kernel": kernel, "warps": warps, "block_q": block_q,
                    "block_k": block_k, "smem": smem}

        scalars = (np.float32(scale), np.float32(scale_log2), np.uint32(1))

        # Forward: warps (BLOCK_Q = 16 · warps) and BLOCK_K.
        warps0 = source_default("HR_FLASH_WARPS")
        fwd_grid = [(warps0, source_default("HR_FLASH_FWD_BLOCK_K"))] if args.quick else FWD_GRID
        best_fwd = fastest(
            measure(tiling("fwd", warps, 16 * warps, bk, tile_bytes(16 * warps + 2 * bk, d)),
                    "flash_attn_fwd.cu", {"HR_FLASH_WARPS": warps, "HR_FLASH_FWD_BLOCK_K": bk},
                    f"flash_attn_fwd_{ent}", math.ceil(n / (16 * warps)) * b * h, warps,
                    (ptr(q), ptr(k), ptr(v), ptr(out), ptr(lse), *sizes, *scalars[1:]),
                    {"err_out": (out, out_ref, 1e-2)}, flops_fwd)
            for warps, bk in fwd_grid)

        # Recompute the reference forward's out/lse with the default tiles for the backward.
        fbq, fbk = 16 * warps0, source_default("HR_FLASH_FWD_BLOCK_K")
        f = function(cp, "flash_attn_fwd.cu", {}, arch, f"flash_attn_fwd_{ent}",
                     tile_bytes(fbq + 2 * fbk, d))
        f((math.ceil(n / fbq) * b * h,), (32 * warps0,),
          (ptr(q), ptr(k), ptr(v), ptr(out), ptr(lse), *sizes, np.float32(scale_log2),
           np.uint32(1)), shared_mem=tile_bytes(fbq + 2 * fbk, d))
        rows = b * h * n
        fdot = function(cp, "flash_attn_bwd.cu", {}, arch, "flash_attn_bwd_dot_bf16", 0)
        dot_blocks = min(math.ceil(rows / (BLOCK_THREADS // 32)), DOT_MAX_BLOCKS)

        def run_dot():
            fdot((dot_blocks,), (BLOCK_THREADS,),
                 (ptr(out), ptr(d_o), ptr(dot), np.uint64(rows), np.uint32(d)))

        run_dot()
        torch.cuda.synchronize()
        t_dot = time_ms(run_dot, args.warmup, args.iters)
        emit({"shape": shape_name, "kernel": "dot", "ms": t_dot})
        bwd_inputs = (ptr(q), ptr(k), ptr(v), ptr(d_o), ptr(lse), ptr(dot))

        # dQ: warps (BLOCK_Q = 16 · warps) and BLOCK_K.
        dq_grid = [(warps0, source_default("HR_FLASH_DQ_BLOCK_K"))] if args.quick else DQ_GRID
        best_dq = fastest(
            measure(tiling("dq", warps, 16 * warps, bk, tile_bytes(2 * 16 * warps + 2 * 2 * bk, d)),
                    "flash_attn_bwd.cu", {"HR_FLASH_WARPS": warps, "HR_FLASH_DQ_BLOCK_K": bk},
                    f"flash_attn_bwd_dq_{ent}", math.ceil(n / (16 * warps)) * b * h, warps,
                    (*bwd_inputs, ptr(dq), *sizes, *scalars), {"err_dq": (dq, dq_ref, 2e-2)})
            for warps, bk in dq_grid)

        # dK/dV: warps (BLOCK_K = 16 · warps) and BLOCK_Q for this head dim.
        bq_macro = "HR_FLASH_DKDV_BLOCK_Q_D64" if d <= 64 else "HR_FLASH_DKDV_BLOCK_Q_D128"
        default_bq = source_default(bq_macro)
        dkdv_grid = [(warps0, default_bq)] if args.quick else DKDV_GRID[d]
        best_dkdv = fastest(
            measure(tiling("dkdv", warps, bq, 16 * warps,
                           tile_bytes(2 * 16 * warps + 2 * 2 * bq, d) + 2 * 2 * bq * 4),
                    "flash_attn_bwd.cu", {"HR_FLASH_WARPS": warps, bq_macro: bq},
                    f"flash_attn_bwd_dkdv_{ent}", math.ceil(n / (16 * warps)) * b * h, warps,
                    (*bwd_inputs, ptr(dk), ptr(dv), *sizes, *scalars),
                    {"err_dk": (dk, dk_ref, 2e-2), "err_dv": (dv, dv_ref, 2e-2)})
            for warps, bq in dkdv_grid)

        default = {r["kernel"]: r for r in records
                   if r.get("shape") == shape_name and r.get("ok") and r.get("warps") == warps0
                   and ((r["kernel"] == "fwd"
                         and r["block_k"] == source_default("HR_FLASH_FWD_BLOCK_K"))
                        or (r["kernel"] == "dq"
                            and r["block_k"] == source_default("HR_FLASH_DQ_BLOCK_K"))
                        or (r["kernel"] == "dkdv" and r["block_q"] == default_bq))}
        if {"fwd", "dq", "dkdv"} <= default.keys() and best_fwd and best_dq and best_dkdv:
            t_default = default["fwd"]["ms"] + t_dot + default["dq"]["ms"] + default["dkdv"]["ms"]
            t_best = best_fwd[0] + t_dot + best_dq[0] + best_dkdv[0]
            emit({"shape": shape_name, "kernel": "summary",
                  "default_fwd_bwd_ms": t_default, "best_fwd_bwd_ms": t_best,
                  "best": {"fwd": best_fwd[1], "dq": best_dq[1], "dkdv": best_dkdv[1]},
                  "sdpa_fwd_bwd_ms": t_sdpa_fb,
                  "default_vs_sdpa_time": t_default / t_sdpa_fb,
                  "best_vs_sdpa_time": t_best / t_sdpa_fb,
                  "default_fwd_bwd_tflops": (flops_fwd + flops_bwd) / t_default / 1e9,
                  "best_fwd_bwd_tflops": (flops_fwd + flops_bwd) / t_best / 1e9})
        del q, k, v, d_o, out, dq, dk, dv, out_ref, dq_ref, dk_ref, dv_ref, qs, ks, vs
        torch.cuda.empty_cache()

    print()
    print(f"{'shape':7} {'kernel':6} {'warps':>5} {'bq':>4} {'bk':>4} {'regs':>4} {'spill':>5} "
          f"{'ms':>8} {'ok':>3}")
    for r in records:
        if r["kernel"] in ("fwd", "dq", "dkdv"):
            print(f"{r['shape']:7} {r['kernel']:6} {r['warps']:5} {r['block_q']:4} "
                  f"{r['block_k']:4} {r.get('regs', '-'):>4} {r.get('local_bytes', '-'):>5} "
                  f"{r.get('ms', float('nan')):8.3f} {'yes' if r.get('ok') else 'NO':>3}")
    if args.json:
        with open(args.json, "w") as fh:
            for r in records:
                fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
