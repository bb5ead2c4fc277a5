"""Writes the fixture that pins headroom's dataset blending to Megatron-LM's `build_blending_indices`.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Usage, from the workspace root, with g++, numpy, pybind11 and a checkout of NVIDIA/Megatron-LM
(or any directory holding `megatron/core/datasets/helpers.cpp` and `utils.py`):

    python3 benches/torch/make_megatron_blend_fixture.py --megatron PATH --write   # (re)write it
    python3 benches/torch/make_megatron_blend_fixture.py --megatron PATH --check   # compare only

`--commit SHA` records Megatron-LM's commit when PATH is not a git checkout (an exported tree).
The committed files were written against Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553
(2026-08-22). Nothing of Megatron-LM is copied into this repository.

What it runs: Megatron's own `megatron/core/datasets/helpers.cpp`, compiled at run time into a
temporary directory as its Makefile does (`g++ -O3 -shared -std=c++17 -fPIC`, pybind11's
includes, module `helpers_cpp`), and called as `BlendedDataset._build_indices` calls it when a
size is given (`blended_dataset.py`):

    dataset_index = numpy.zeros(size, dtype=numpy.int16)
    dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, weights,
                                   len(datasets), size, _VERBOSE)   # _VERBOSE = False

The weights are what `--data-path 0.3 A 0.7 B` becomes: `get_blend_from_list` (float() of each
weight string), then `normalize` twice: once in `BlendedMegatronDatasetBuilder` and again in
`BlendedDataset.__init__` (both functions are taken from the checkout's `utils.py` source, not
re-typed here). Megatron's builder itself passes `size = sum(ceil(size_requested * w_d))`, not
the requested size; the fixture calls the helper with each case's size directly (the builder's
size is recorded as `builder_size`, for reference only).

The C++ loop: for sample i, error_d = w_d * max(i, 1.0) - count_d in f64; the dataset with the
largest error is taken, scanning d = 0.. with a strict `>`, so the lowest index wins a tie;
then dataset_index[i] = d and dataset_sample_index[i] = count_d, count_d += 1.

`exact_schedule` below is the same rule in exact rational arithmetic (weights
Fraction('0.3') etc., normalised exactly): what headroom's Rust implementation is expected to
match. The script prints, per case, how many positions have an exact tie at the maximum and
whether Megatron's f64 sequence equals the exact one (differing positions and the largest
|prefix count difference| per dataset).

Output: `crates/mmap-data/tests/fixtures/megatron_blend/`: `manifest.json` and, per case,
`NAME.dataset_index.u16` (u16 little-endian per sample) and `NAME.dataset_sample_index.i64`
(i64 little-endian per sample).
"""
import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
from fractions import Fraction

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "crates", "mmap-data", "tests", "fixtures", "megatron_blend")
HELPERS = os.path.join("megatron", "core", "datasets", "helpers.cpp")
UTILS = os.path.join("megatron", "core", "datasets", "utils.py")

# (name, weights as written after --data-path, size)
CASES = [
    ("w03_07_n1000", ["0.3", "0.7"], 1000),
    ("w1_1_1_n999", ["1", "1", "1"], 999),
    ("w05_025_0125_0125_n1024", ["0.5", "0.25", "0.125", "0.125"], 1024),
    ("w01_02_07_n2000", ["0.1", "0.2", "0.7"], 2000),
    ("w2_3_n500", ["2", "3"], 500),
    ("w06_04_n777", ["0.6", "0.4"], 777),
    ("w01_03_06_n600", ["0.1", "0.3", "0.6"], 600),
]


def exact_schedule(weights, size):
    """The blending rule in exact rational arithmetic.

    weights: the weights as decimal strings (or anything Fraction accepts), normalised here
    exactly. At sample i the dataset d maximising w_d * max(i, 1) - c_d is taken, the lowest d
    on a tie; c_d counts the samples taken from d so far. Returns (dataset_index,
    dataset_sample_index, ties), ties being the positions where the maximum is attained by two
    or more datasets.
    """
    w = [Fraction(x) for x in weights]
    total = sum(w)
    w = [x / total for x in w]
    counts = [0] * len(w)
    index, sample_index, ties = [], [], []
    for i in range(size):
        t = max(i, 1)
        errors = [wd * t - cd for wd, cd in zip(w, counts)]
        best = max(errors)
        d = errors.index(best)
        if errors.count(best) > 1:
            ties.append(i)
        index.append(d)
        sample_index.append(counts[d])
        counts[d] += 1
    return index, sample_index, ties


def megatron_functions(megatron):
    """`get_blend_from_list` and `normalize` from the checkout's utils.py, by their source."""
    import numpy
    from typing import List, Optional, Tuple

    with open(os.path.join(megatron, UTILS)) as f:
        tree = ast.parse(f.read())
    wanted = {"get_blend_from_list", "normalize"}
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    if {n.name for n in defs} != wanted:
        sys.exit(f"{UTILS} lacks one of {sorted(wanted)}")
    namespace = dict(numpy=numpy, List=List, Optional=Optional, Tuple=Tuple)
    exec(compile(ast.Module(body=defs, type_ignores=[]), UTILS, "exec"), namespace)
    return namespace["get_blend_from_list"], namespace["normalize"]


def compile_helpers(megatron, tmp):
    import pybind11

    src = os.path.join(megatron, HELPERS)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    so = os.path.join(tmp, "helpers_cpp" + suffix)
    includes = ["-I" + sysconfig.get_paths()["include"], "-I" + pybind11.get_include()]
    subprocess.run(
        ["g++", "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC", *includes, src, "-o", so],
        check=True,
    )
    spec = importlib.util.spec_from_file_location("helpers_cpp", so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(megatron):
    import numpy

    for rel in (HELPERS, UTILS):
        if not os.path.isfile(os.path.join(megatron, rel)):
            sys.exit(f"{rel} not found under {megatron}: --megatron must name a Megatron-LM tree")
    get_blend_from_list, normalize = megatron_functions(megatron)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        helpers = compile_helpers(megatron, tmp)
        for name, given, size in CASES:
            blend = []
            for k, weight in enumerate(given):
                blend += [weight, f"prefix_{k}"]
            _, weights = get_blend_from_list(blend)
            weights = normalize(weights)  # BlendedMegatronDatasetBuilder
            builder_size = sum(int(math.ceil(math.ceil(size * w) * (1 + 0.0))) for w in weights)
            weights = normalize(weights)  # BlendedDataset.__init__ (size is not None)
            dataset_index = numpy.zeros(size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
            helpers.build_blending_indices(
                dataset_index, dataset_sample_index, weights, len(given), size, False
            )
            assert dataset_index.min() >= 0
            results.append(
                dict(
                    name=name,
                    weights=given,
                    normalized_weights=[float(w) for w in weights],
                    size=size,
                    builder_size=builder_size,
                    dataset_index=dataset_index.astype("<u2").tobytes(),
                    dataset_sample_index=dataset_sample_index.astype("<i8").tobytes(),
                    index_list=dataset_index.tolist(),
                )
            )
    return results


def compare(result):
    """Megatron's sequence against exact_schedule; returns a dict of the comparison."""
    given, size, got = result["weights"], result["size"], result["index_list"]
    exact, _, ties = exact_schedule(given, size)
    n = len(given)
    differing = [i for i in range(size) if got[i] != exact[i]]
    max_prefix = [0] * n
    a, b = [0] * n, [0] * n
    for i in range(size):
        a[got[i]] += 1
        b[exact[i]] += 1
        for d in range(n):
            max_prefix[d] = max(max_prefix[d], abs(a[d] - b[d]))
    return dict(
        exact_ties=len(ties),
        tie_positions=ties[:8],
        matches_exact=not differing,
        differing_positions=len(differing),
        first_differing=differing[:8],
        max_prefix_count_difference=max_prefix,
    )


def manifest(commit, results):
    cases = []
    for r in results:
        cases.append(
            dict(
                name=r["name"],
                weights=r["weights"],
                normalized_weights=r["normalized_weights"],
                size=r["size"],
                builder_size=r["builder_size"],
                megatron_commit=commit,
                dataset_index=r["name"] + ".dataset_index.u16",
                dataset_sample_index=r["name"] + ".dataset_sample_index.i64",
            )
        )
    return dict(
        source="NVIDIA/Megatron-LM megatron/core/datasets/helpers.cpp build_blending_indices "
        "(via BlendedDataset._build_indices); written by "
        "benches/torch/make_megatron_blend_fixture.py",
        megatron_commit=commit,
        dataset_index_format="u16 little-endian per sample (Megatron: int16)",
        dataset_sample_index_format="i64 little-endian per sample",
        cases=cases,
    )


def megatron_commit(megatron, args):
    if "--commit" in args:
        return args[args.index("--commit") + 1]
    git = subprocess.run(
        ["git", "-C", megatron, "rev-parse", "--verify", "HEAD"], capture_output=True, text=True
    )
    return git.stdout.strip() if git.returncode == 0 else "unknown"


def without_commit(m):
    m = json.loads(json.dumps(m))
    m.pop("megatron_commit", None)
    for c in m["cases"]:
        c.pop("megatron_commit", None)
    return m


def main():
    args = sys.argv[1:]
    if "--megatron" not in args or not ({"--write", "--check"} & set(args)):
        print("fixture writer: needs --megatron PATH and --write or --check", file=sys.stderr)
        sys.exit(3)
    try:
        import numpy  # noqa: F401
        import pybind11  # noqa: F401
    except ImportError as e:
        print(f"needs numpy and pybind11: {e}", file=sys.stderr)
        sys.exit(3)
    megatron = args[args.index("--megatron") + 1]
    results = run(megatron)
    commit = megatron_commit(megatron, args)
    for r in results:
        c = compare(r)
        print(
            f"{r['name']}: weights {r['weights']} size {r['size']}: "
            f"{c['exact_ties']} exact ties at the maximum (first {c['tie_positions']}); "
            f"Megatron {'equals' if c['matches_exact'] else 'differs from'} the exact rule: "
            f"{c['differing_positions']} differing positions (first {c['first_differing']}), "
            f"max |prefix count difference| per dataset {c['max_prefix_count_difference']}"
        )
    m = manifest(commit, results)
    files = {}
    for r in results:
        files[r["name"] + ".dataset_index.u16"] = r["dataset_index"]
        files[r["name"] + ".dataset_sample_index.i64"] = r["dataset_sample_index"]
    if "--write" in args:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "manifest.json"), "w") as f:
            json.dump(m, f, indent=1)
            f.write("\n")
        for name, data in files.items():
            with open(os.path.join(OUT, name), "wb") as f:
                f.write(data)
        total = sum(len(d) for d in files.values())
        print(f"wrote {OUT}: {len(results)} cases, {len(files)} files, {total} bytes of indices")
        return
    bad = []
    with open(os.path.join(OUT, "manifest.json")) as f:
        committed = json.load(f)
    if without_commit(committed) != without_commit(m):
        bad.append("manifest.json")
    if committed.get("megatron_commit") != commit:
        print(f"note: fixture written against {committed.get('megatron_commit')}, checked "
              f"against {commit}")
    for name, data in files.items():
        path = os.path.join(OUT, name)
        if not os.path.isfile(path) or open(path, "rb").read() != data:
            bad.append(name)
    if bad:
        sys.exit(f"Megatron-LM gives other blending indices than the committed fixture: {bad}")
    print("the committed fixture matches Megatron-LM")


if __name__ == "__main__":
    main()
