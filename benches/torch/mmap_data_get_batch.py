#!/usr/bin/env python3
"""nanoGPT's get_batch, CPU side only, as the baseline for mmap-data's loader.

Exactly what nanoGPT's train.py does per batch: re-create the np.memmap (to avoid a memory
leak, as nanoGPT's comment says), draw batch_size random starts, slice block_size tokens for x
and the next block_size for y, convert to int64 and stack. numpy only (torch.from_numpy +
torch.stack costs about the same and is not needed to measure the data path).

Reads $HEADROOM_BENCH_DIR/data/tokens_u16_100M.bin (creates it if missing) and prints one JSON
record: bench "mmap-data/get_batch_64x256/python_numpy", metric "tokens_per_s".
Exit code 3 (with a reason on stderr) when numpy is missing.
"""

import json
import os
import sys
import time

try:
    import numpy as np
except ImportError:
    print("numpy is not installed", file=sys.stderr)
    sys.exit(3)

TOKENS = 100_000_000
VOCAB = 50257
BATCH_SIZE = 64
BLOCK_SIZE = 256


def bench_dir():
    d = os.environ.get("HEADROOM_BENCH_DIR")
    if d:
        return d
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "..", "target", "headroom-bench")


def token_file():
    data_dir = os.path.join(bench_dir(), "data")
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, "tokens_u16_100M.bin")
    if os.path.exists(path) and os.path.getsize(path) == 2 * TOKENS:
        return path
    print(f"writing {path}", file=sys.stderr)
    tmp = f"{path}.tmp{os.getpid()}"
    rng = np.random.default_rng(0)
    with open(tmp, "wb") as f:
        step = 1 << 24
        for start in range(0, TOKENS, step):
            n = min(step, TOKENS - start)
            rng.integers(0, VOCAB, size=n, dtype=np.uint16).tofile(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def get_batch(path):
    # nanoGPT: "We recreate np.memmap every batch to avoid a memory leak".
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = np.random.randint(len(data) - BLOCK_SIZE, size=(BATCH_SIZE,))
    x = np.stack([data[i : i + BLOCK_SIZE].astype(np.int64) for i in ix])
    y = np.stack([data[i + 1 : i + 1 + BLOCK_SIZE].astype(np.int64) for i in ix])
    return x, y


def main():
    quick = "--quick" in sys.argv[1:]
    path = token_file()
    # Pull the file into page cache, as the Rust side does with its validation scan.
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    np.random.seed(1337)
    batches, repeats = (300, 3) if quick else (1000, 5)
    rates = []
    for _ in range(repeats):
        for _ in range(batches // 10):
            get_batch(path)
        start = time.perf_counter()
        checksum = 0
        for _ in range(batches):
            x, y = get_batch(path)
            checksum += int(y[-1, -1])
        secs = time.perf_counter() - start
        rates.append(batches * BATCH_SIZE * BLOCK_SIZE / secs)
    rates.sort()
    value = rates[len(rates) // 2]
    print(f"python numpy get_batch: {value / 1e6:.2f} M tokens/s", file=sys.stderr)
    record = {
        "bench": "mmap-data/get_batch_64x256/python_numpy",
        "metric": "tokens_per_s",
        "value": value,
        "unit": "tokens/s",
        "baseline": None,
        "baseline_value": None,
        "ratio": None,
        "better": "higher",
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
