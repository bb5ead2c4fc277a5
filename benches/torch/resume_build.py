#!/usr/bin/env python3
"""A sharded `headroom data build` killed half-way, then `--resume`d: its time, and that the
resumed shards are byte for byte those of an uninterrupted build.

Usage, from the workspace root, after `cargo build --release -p headroom-trainer` and a run
of `parquet_tokenize.py` (whose `hub_split` directory of four Parquet files it reads):

    python3 benches/torch/resume_build.py [--dir /tmp/headroom-parquet-bench/hub_split]
        [--shard-tokens 1000000] [--kill-at 11] [--runs 3]

Each round builds the directory whole, then again, sending SIGKILL as soon as the
`--kill-at`-th shard is on disk, then runs the same command with `--resume`; it prints the
three wall times and fails if the resumed set differs from the whole one. Not a paired
bench: `cargo xtask bench` runs every script here with `--quick`, which exits 3 ("skipped").
"""
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

if "--quick" in sys.argv:
    print("a standalone measurement; run it without --quick", file=sys.stderr)
    sys.exit(3)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def arg(name, default):
    if name in sys.argv:
        return type(default)(sys.argv[sys.argv.index(name) + 1])
    return default


def files(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def main():
    source = arg("--dir", "/tmp/headroom-parquet-bench/hub_split")
    shard_tokens = arg("--shard-tokens", 1_000_000)
    kill_at = arg("--kill-at", 11)
    runs = arg("--runs", 3)
    headroom = arg("--headroom", os.path.join(ROOT, "target", "release", "headroom"))
    if not os.path.isdir(source):
        print(f"{source}: run parquet_tokenize.py first", file=sys.stderr)
        sys.exit(3)
    print("| round | whole build | killed after | shards kept | `--resume` | identical |")
    print("|---|---:|---:|---:|---:|---|")
    for r in range(runs):
        with tempfile.TemporaryDirectory() as base:
            dirs = {d: os.path.join(base, d) for d in ("whole", "killed")}
            for d in dirs.values():
                os.makedirs(d)

            def command(d, extra=()):
                return [headroom, "data", "build", "--quiet", "--tokenizer", "gpt2",
                        "--shard-tokens", str(shard_tokens), "--val-shards", "1",
                        "--document-token", "start", *extra, source,
                        os.path.join(dirs[d], "fineweb.bin")]

            t = time.perf_counter()
            subprocess.run(command("whole"), check=True, stdout=subprocess.DEVNULL)
            whole = time.perf_counter() - t
            t = time.perf_counter()
            p = subprocess.Popen(command("killed"), stdout=subprocess.DEVNULL)
            while len(glob.glob(os.path.join(dirs["killed"], "fineweb_*.bin"))) < kill_at:
                if p.poll() is not None:
                    raise SystemExit("the build ended before the kill: lower --kill-at")
                time.sleep(0.005)
            p.send_signal(signal.SIGKILL)
            p.wait()
            killed = time.perf_counter() - t
            kept = len(glob.glob(os.path.join(dirs["killed"], "fineweb_*.bin")))
            t = time.perf_counter()
            subprocess.run(command("killed", ["--resume"]), check=True,
                           stdout=subprocess.DEVNULL)
            resumed = time.perf_counter() - t
            same = files(dirs["whole"]) == files(dirs["killed"])
            if not same:
                raise SystemExit("the resumed shards differ from the whole build's")
            print(f"| {r + 1} | {whole:.2f} s | {killed:.2f} s | {kept} | {resumed:.2f} s | "
                  f"byte-identical, {len(os.listdir(dirs['whole']))} files |")


if __name__ == "__main__":
    main()
