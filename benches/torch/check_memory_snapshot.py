"""Check a memory snapshot written by headroom (`headroom_profiler::write_torch_snapshot`, the
`--memory-snapshot FILE` of `headroom train`) against PyTorch's own readers.

    python3 benches/torch/check_memory_snapshot.py FILE [--out DIR]

Without FILE it looks for `$HEADROOM_BENCH_DIR/memory_snapshot.pickle` (so `cargo xtask bench`
can run it like the other scripts here) and exits with code 3 when there is none.

1. With the standard library only: unpickle FILE and check the structure of
   `torch.cuda.memory._snapshot()` (segments, blocks tiling each segment, trace entries and
   their keys, frees matching live blocks), and that the pickle uses only opcodes the
   JavaScript unpickler of pytorch.org/memory_viz understands.
2. With torch: run `torch.cuda._memory_viz` on it — `segsum` (which asserts the segment
   accounting), `trace`, `segments` and `memory` (flamegraph input), `compare`, and the HTML
   viewers `trace_plot` (allocations and segments) and `segment_plot`. With `--out DIR` the
   HTML pages are written there (open them in a browser; they load the viewer's JavaScript
   from a CDN).

Exit codes: 0 all checks passed; 1 a check failed (the reason on stderr); 3 torch is missing
or no file was given (the reason on stderr, per benches/torch/README.md).
"""

import argparse
import os
import pickle
import pickletools
import sys

SEGMENT_KEYS = {
    "device", "address", "total_size", "allocated_size", "active_size", "requested_size",
    "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks",
}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
ENTRY_KEYS = {"action", "addr", "size", "stream", "time_us", "frames"}
ACTIONS = {
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "oom", "snapshot", "annotate",
}
# The opcodes MemoryViz.js's unpickler implements (it throws on any other).
VIEWER_OPCODES = {
    "PROTO", "FRAME", "STOP", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2",
    "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "MEMOIZE", "BINPUT", "LONG_BINPUT",
    "BINGET", "LONG_BINGET", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_TUPLE", "TUPLE1", "TUPLE2",
    "TUPLE3", "TUPLE", "LIST", "DICT", "MARK", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
}


class CheckFailed(Exception):
    pass


def require(condition, message):
    if not condition:
        raise CheckFailed(message)


def frame_text(frames):
    return " <- ".join(f"{f['filename']}:{f['line']}:{f['name']}" for f in frames)


def check_frames(frames, where):
    require(isinstance(frames, list), f"{where}: frames is not a list")
    for f in frames:
        require(
            isinstance(f, dict) and {"filename", "line", "name"} <= f.keys(),
            f"{where}: a frame lacks filename/line/name: {f!r}",
        )


def check_structure(raw, data):
    ops = {op.name for op, _, _ in pickletools.genops(raw)}
    unknown = ops - VIEWER_OPCODES
    require(not unknown, f"opcodes the memory viewer cannot read: {sorted(unknown)}")
    require(isinstance(data, dict), "the snapshot is not a dict")
    require({"segments", "device_traces"} <= data.keys(), f"keys: {sorted(data)}")
    require(isinstance(data["device_traces"], list), "device_traces is not a list")

    live_at_end = {}
    ranges = {}
    for i, seg in enumerate(data["segments"]):
        missing = SEGMENT_KEYS - seg.keys()
        require(not missing, f"segment {i} lacks {sorted(missing)}")
        require(
            0 <= seg["device"] < len(data["device_traces"]),
            f"segment {i} is on device {seg['device']} with no trace list",
        )
        check_frames(seg["frames"], f"segment {i}")
        addr = seg["address"]
        allocated = requested = 0
        for j, block in enumerate(seg["blocks"]):
            missing = BLOCK_KEYS - block.keys()
            require(not missing, f"segment {i} block {j} lacks {sorted(missing)}")
            require(block["address"] == addr, f"segment {i} block {j} does not tile the segment")
            check_frames(block["frames"], f"segment {i} block {j}")
            if block["state"] == "active_allocated":
                allocated += block["size"]
                requested += block["requested_size"]
                require(block["requested_size"] <= block["size"], "requested > size")
                live_at_end.setdefault(seg["device"], {})[addr] = (
                    block["requested_size"], block["frames"])
            else:
                require(block["state"] in ("inactive", "active_pending_free"),
                        f"block state {block['state']!r}")
            addr += block["size"]
        require(addr - seg["address"] == seg["total_size"], f"segment {i}: blocks != total_size")
        ranges.setdefault(seg["device"], []).append((seg["address"], addr))
        require(seg["allocated_size"] == allocated, f"segment {i}: allocated_size")
        require(seg["requested_size"] == requested, f"segment {i}: requested_size")

    categories = set()
    report = []
    for device, trace in enumerate(data["device_traces"]):
        require(isinstance(trace, list), f"device_traces[{device}] is not a list")
        if not trace and device not in live_at_end:
            continue
        # Walk back from the end state to the state at the trace's start, then forward.
        live = dict(live_at_end.get(device, {}))
        for e in reversed(trace):
            if e["action"] == "alloc":
                require(e["addr"] in live, f"device {device}: alloc of a block not live later")
                del live[e["addr"]]
            elif e["action"] == "free_completed":
                require(e["addr"] not in live, f"device {device}: freed block live earlier")
                live[e["addr"]] = (e["size"], e["frames"])
        total = sum(size for size, _ in live.values())
        peak, peak_live = total, dict(live)
        last_time = None
        for k, e in enumerate(trace):
            missing = ENTRY_KEYS - e.keys()
            require(not missing, f"device {device} entry {k} lacks {sorted(missing)}")
            require(e["action"] in ACTIONS, f"device {device} entry {k}: action {e['action']!r}")
            check_frames(e["frames"], f"device {device} entry {k}")
            require(last_time is None or e["time_us"] >= last_time, "time_us goes back")
            last_time = e["time_us"]
            if "category" in e:
                categories.add(e["category"])
            if e["action"] in ("alloc", "free_requested", "free_completed"):
                # The viewer's segment view draws every block inside a segment.
                require(any(lo <= e["addr"] and e["addr"] + e["size"] <= hi
                            for lo, hi in ranges.get(device, [])),
                        f"device {device} entry {k}: block outside every segment")
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e["frames"])
                total += e["size"]
                if total > peak:
                    peak, peak_live = total, dict(live)
            elif e["action"] == "free_requested":
                require(live.get(e["addr"], (None,))[0] == e["size"],
                        f"device {device} entry {k}: free of a block not live")
            elif e["action"] == "free_completed":
                total -= live.pop(e["addr"])[0]
            elif e["action"] == "oom":
                require("device_free" in e, "oom without device_free")
        largest = sorted(peak_live.values(), key=lambda v: -v[0])[:3]
        report.append(
            f"device {device}: {len(trace)} trace entries, peak {peak} B; largest at the peak: "
            + "; ".join(f"{size} B {frame_text(frames)}" for size, frames in largest))
    # The viewer needs 'unknown' among the categories whenever entries carry any.
    require(not categories or "unknown" in categories,
            "entries carry categories but none is 'unknown' (the viewer would fail)")
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", help="the pickled snapshot")
    parser.add_argument("--out", help="write the HTML views into this directory")
    parser.add_argument("--quick", action="store_true", help="accepted for cargo xtask bench")
    args = parser.parse_args()

    path = args.file
    if path is None:
        bench_dir = os.environ.get("HEADROOM_BENCH_DIR")
        candidate = bench_dir and os.path.join(bench_dir, "memory_snapshot.pickle")
        if not candidate or not os.path.exists(candidate):
            print("no snapshot file given (and no $HEADROOM_BENCH_DIR/memory_snapshot.pickle)",
                  file=sys.stderr)
            return 3
        path = candidate

    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = pickle.loads(raw)
        for line in check_structure(raw, data):
            print(line)
    except (CheckFailed, KeyError, TypeError, pickle.UnpicklingError) as e:
        print(f"{path}: structure check failed: {e!r}", file=sys.stderr)
        return 1
    print(f"{path}: structure of torch.cuda.memory._snapshot() ok "
          f"({len(data['segments'])} segments, {len(data['device_traces'])} device traces)")

    try:
        import torch
        from torch.cuda import _memory_viz as viz
    except ImportError as e:
        print(f"torch is not installed ({e}); only the structure was checked", file=sys.stderr)
        return 3

    try:
        summary = viz.segsum(data)
        text = viz.trace(data)
        flame_segments = viz.segments(data, format_flamegraph=lambda lines: lines)
        flame_memory = viz.memory(data, format_flamegraph=lambda lines: lines)
        compared = viz.compare(data["segments"], data["segments"],
                               format_flamegraph=lambda lines: lines)
        pages = {
            "trace_plot.html": viz.trace_plot(data),
            "trace_plot_segments.html": viz.trace_plot(data, plot_segments=True),
            "segment_plot.html": viz.segment_plot(data),
        }
    except Exception as e:  # any failure inside torch's readers is a failed check
        print(f"{path}: torch.cuda._memory_viz failed: {e!r}", file=sys.stderr)
        return 1
    for name, html in pages.items():
        if "add_local_files" not in html or len(html) < 200:
            print(f"{path}: {name} looks empty", file=sys.stderr)
            return 1
    if data["segments"] and not flame_memory.strip():
        print(f"{path}: memory() produced no flamegraph lines", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}: segsum, trace, segments, memory, compare, trace_plot "
          f"(allocations and segments) and segment_plot read it")
    for line in summary.splitlines():
        if line.startswith(("segments:", "total_reserved", "total_allocated", "total_free")):
            print(f"segsum(): {line}")
    print(f"trace(): {len(text.splitlines())} lines; segments(): "
          f"{len(flame_segments.splitlines())} flamegraph lines; compare(): "
          f"{len(compared.splitlines())} lines")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for name, html in pages.items():
            with open(os.path.join(args.out, name), "w") as f:
                f.write(html)
        print(f"wrote {', '.join(pages)} into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
