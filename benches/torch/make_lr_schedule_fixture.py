"""Writes the fixture that pins `headroom train --lr-schedule` to llm.c's learning-rate schedulers.

Not a comparison bench: it prints no records. `cargo xtask bench` runs every script in this
folder with `--quick`; this one then exits with code 3 ("skipped") and writes nothing.

Usage, from the workspace root, with a C compiler and a checkout of karpathy/llm.c:

    python3 benches/torch/make_lr_schedule_fixture.py --llmc PATH --write   # (re)write it
    python3 benches/torch/make_lr_schedule_fixture.py --llmc PATH --check   # compare only

`--commit SHA` records llm.c's commit when PATH is not a git checkout of it (an exported tree).

What it runs: llm.c's own `llmc/schedulers.h` (`lr_scheduler_init`, `get_learning_rate`),
compiled with `cc -O2` into a small driver that this script writes to a temporary directory
(nothing of llm.c is copied into this repository). For each case (scheduler, peak learning
rate, warmup, steps, final fraction) the driver prints the learning rate at the listed steps
as `%.9g`, which round-trips llm.c's f32 exactly. Steps: every step of short runs; for long
ones the warmup's edges, the decay's first steps (where llm.c's `(int)(0.8f * steps)` decides
wsd's turn) and the last steps.

llm.c's `constant` ignores the warmup, headroom's keeps it (transformers'
`constant_with_warmup`), so the constant cases have no warmup.

Output: `crates/trainer/tests/fixtures/llmc_lr_schedules.json`, read by
`crates/trainer/tests/lr_schedule_llmc.rs` (no C compiler needed there).
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "crates", "trainer", "tests", "fixtures", "llmc_lr_schedules.json")

# (scheduler, lr, warmup, steps, final_frac)
CASES = [
    ("cosine", 3e-3, 20, 600, 0.1),
    ("cosine", 6e-4, 10, 100, 0.1),
    ("cosine", 1e-3, 0, 37, 0.0),
    ("cosine", 6e-4, 700, 19073, 0.0),
    ("linear", 6e-4, 10, 100, 0.1),
    ("linear", 1e-3, 0, 37, 0.0),
    ("linear", 2e-4, 5, 64, 0.5),
    ("constant", 6e-4, 0, 50, 0.1),
    ("wsd", 6e-4, 10, 100, 0.0),
    ("wsd", 1e-3, 3, 37, 0.1),
    ("wsd", 3e-3, 20, 600, 0.0),
    ("wsd", 1e-3, 0, 5, 0.0),
    ("wsd", 1e-3, 2, 12345, 0.0),
    ("wsd", 6e-4, 700, 100000, 0.1),
]

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include "llmc/schedulers.h"

int main(void) {
    char type[32];
    float lr, frac;
    int warmup, steps, step;
    while (scanf("%31s %f %d %d %f %d", type, &lr, &warmup, &steps, &frac, &step) == 6) {
        LearningRateScheduler s;
        lr_scheduler_init(&s, type, lr, warmup, steps, frac);
        printf("%.9g\n", get_learning_rate(&s, step));
    }
    return 0;
}
"""


def steps_of(warmup, steps):
    if steps <= 700:
        return list(range(steps))
    decay = int(0.8 * steps)
    picked = set(range(0, 5))
    picked |= set(range(max(warmup - 3, 0), min(warmup + 3, steps)))
    picked |= set(range(decay - 3, min(decay + 4, steps)))
    picked |= set(range(steps - 4, steps))
    picked |= set(range(0, steps, steps // 50))
    return sorted(picked)


def run(llmc):
    header = os.path.join(llmc, "llmc", "schedulers.h")
    if not os.path.isfile(header):
        sys.exit(f"{header} not found: --llmc must name a checkout of karpathy/llm.c")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "driver.c")
        exe = os.path.join(tmp, "driver")
        with open(src, "w") as f:
            f.write(DRIVER)
        subprocess.run(["cc", "-O2", "-I", llmc, src, "-o", exe, "-lm"], check=True)
        lines, index = [], []
        for c, (kind, lr, warmup, steps, frac) in enumerate(CASES):
            for step in steps_of(warmup, steps):
                lines.append(f"{kind} {lr!r} {warmup} {steps} {frac!r} {step}")
                index.append((c, step))
        out = subprocess.run(
            [exe], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True
        ).stdout.split()
    if len(out) != len(index):
        sys.exit(f"the driver printed {len(out)} values for {len(index)} queries")
    cases = [
        dict(scheduler=k, lr=lr, warmup=w, steps=n, final_frac=f, at=[])
        for (k, lr, w, n, f) in CASES
    ]
    for (c, step), value in zip(index, out):
        cases[c]["at"].append([step, float(value)])
    return cases


def llmc_commit(llmc, args):
    if "--commit" in args:
        return args[args.index("--commit") + 1]
    git = subprocess.run(
        ["git", "-C", llmc, "rev-parse", "--verify", "HEAD"], capture_output=True, text=True
    )
    return git.stdout.strip() if git.returncode == 0 else "unknown"


def render(commit, cases):
    """One case per line, so a change shows as a change of that case."""
    head = json.dumps(dict(source="karpathy/llm.c llmc/schedulers.h, get_learning_rate (f32)",
                           llmc_commit=commit))
    body = ",\n".join("  " + json.dumps(c, separators=(",", ":")) for c in cases)
    return head[:-1] + ', "cases": [\n' + body + "\n]}\n"


def main():
    args = sys.argv[1:]
    if "--llmc" not in args or not ({"--write", "--check"} & set(args)):
        print("fixture writer: needs --llmc PATH and --write or --check", file=sys.stderr)
        sys.exit(3)
    llmc = args[args.index("--llmc") + 1]
    cases = run(llmc)
    if "--write" in args:
        with open(OUT, "w") as f:
            f.write(render(llmc_commit(llmc, args), cases))
        total = sum(len(c["at"]) for c in cases)
        print(f"wrote {OUT}: {len(cases)} cases, {total} learning rates")
    else:
        with open(OUT) as f:
            committed = json.load(f)
        if committed["cases"] != cases:
            sys.exit("llm.c gives other learning rates than the committed fixture")
        print("the committed fixture matches llm.c")


if __name__ == "__main__":
    main()
