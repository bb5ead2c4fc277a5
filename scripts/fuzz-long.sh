#!/usr/bin/env bash
# Long fuzz campaign: every fuzz test of the workspace, each in its own process.
#
# Fuzz tests are ordinary integration tests built on headroom-fuzzkit: any file
# `<crate>/tests/fuzz_*.rs` is a fuzz test binary, and every test in it whose name starts
# with `fuzz_` is one campaign. Each campaign runs as its own process, one at a time, with
# HEADROOM_FUZZ_ITERS set so that the campaigns together run at least --total mutated inputs.
# A process per campaign is what makes aborts visible: a failed allocation, a stack overflow
# or a SIGBUS kills the process, and its exit status says so (panics and hangs are counted
# by fuzzkit itself and make the test fail).
#
# Usage: scripts/fuzz-long.sh [--total N | --iters N] [--filter REGEX] [--markdown FILE]
#                             [--target-dir DIR] [--vmem-kb KB] [--timeout-ms MS]
#
#   --total N       random inputs over all campaigns (default 1000000); split evenly
#   --iters N       random inputs per campaign instead (overrides --total)
#   --filter REGEX  only campaigns whose "package/binary/test" matches (grep -E)
#   --markdown FILE also write the summary table (markdown) to FILE
#   --target-dir D  cargo target directory (default: $CARGO_TARGET_DIR or ./target)
#   --vmem-kb KB    virtual-memory limit per process (ulimit -v; default 8 GiB, 0 = none):
#                   an allocation sized by a corrupt header then fails at once instead of
#                   being overcommitted
#   --timeout-ms MS per-input hang limit (HEADROOM_FUZZ_TIMEOUT_MS; default fuzzkit's 10 s)
#
# HEADROOM_FUZZ_SEED is passed through. Logs go to <target-dir>/fuzz-long/. The exit status
# is 0 only if every campaign exited 0.
set -euo pipefail

total=1000000
iters=""
filter=""
markdown=""
target_dir="${CARGO_TARGET_DIR:-target}"
vmem_kb=$((8 * 1024 * 1024))
timeout_ms=""

while [ $# -gt 0 ]; do
    case "$1" in
        --total) total="$2"; shift 2 ;;
        --iters) iters="$2"; shift 2 ;;
        --filter) filter="$2"; shift 2 ;;
        --markdown) markdown="$2"; shift 2 ;;
        --target-dir) target_dir="$2"; shift 2 ;;
        --vmem-kb) vmem_kb="$2"; shift 2 ;;
        --timeout-ms) timeout_ms="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
mkdir -p "$target_dir"
target_dir="$(cd "$target_dir" && pwd)"
logs="$target_dir/fuzz-long"
mkdir -p "$logs"

# The package name of the crate that owns a tests/ file: the first `name = "..."` of the
# nearest Cargo.toml above it.
package_of() {
    local dir
    dir="$(dirname "$(dirname "$1")")"
    sed -n 's/^name *= *"\([^"]*\)".*/\1/p' "$dir/Cargo.toml" | head -n 1
}

# 1. Find and build the fuzz test binaries; list their campaigns.
campaigns=()   # entries: package|crate-dir|binary-stem|executable|test-name
while IFS= read -r file; do
    pkg="$(package_of "$file")"
    crate_dir="$(dirname "$(dirname "$file")")"
    stem="$(basename "$file" .rs)"
    echo "building $pkg --test $stem" >&2
    exe="$(cargo test -p "$pkg" --test "$stem" --no-run --message-format=json \
            --target-dir "$target_dir" 2>"$logs/build-$pkg-$stem.log" \
        | grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/' \
        | grep "/deps/$stem-" | tail -n 1)" || true
    # (a package with a binary target also builds it: only the test's own executable counts)
    if [ -z "$exe" ] || [ ! -x "$exe" ]; then
        echo "error: could not build $pkg --test $stem (see $logs/build-$pkg-$stem.log)" >&2
        exit 1
    fi
    while IFS= read -r name; do
        key="$pkg/$stem/$name"
        if [ -z "$filter" ] || echo "$key" | grep -Eq -- "$filter"; then
            campaigns+=("$pkg|$crate_dir|$stem|$exe|$name")
        fi
    done < <("$exe" --list --format terse 2>/dev/null | sed -n 's/^\(fuzz_[A-Za-z0-9_]*\): test$/\1/p')
done < <(find crates kernels xtask benches -path '*/tests/fuzz_*.rs' -type f 2>/dev/null | sort)

count=${#campaigns[@]}
if [ "$count" -eq 0 ]; then
    echo "no fuzz campaigns found (tests named fuzz_* in */tests/fuzz_*.rs)" >&2
    exit 1
fi
if [ -z "$iters" ]; then
    iters=$(( (total + count - 1) / count ))
fi

cpu="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1)"
cores="$(nproc 2>/dev/null || echo '?')"
header="fuzz-long: $count campaigns, $iters random inputs each (+ systematic), one process at a time
date: $(date -u '+%Y-%m-%d %H:%M UTC'); cpu: ${cpu:-unknown} ($cores logical cores)
rustc: $(rustc --version 2>/dev/null); seed: ${HEADROOM_FUZZ_SEED:-default}; vmem limit: ${vmem_kb} KiB"
echo "$header" >&2

# 2. Run each campaign in its own process.
table="| campaign | test | inputs | ok | typed errors | panics | hangs | slowest input (ms) | wall (s) | exit |
|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
failed=0
sum_inputs=0; sum_ok=0; sum_err=0; sum_panics=0; sum_hangs=0; sum_wall_ns=0
# One key=value field of the campaign's summary line.
field() { echo "$summary" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
for entry in "${campaigns[@]}"; do
    IFS='|' read -r pkg crate_dir stem exe name <<<"$entry"
    log="$logs/$pkg-$stem-$name.log"
    echo "running $pkg/$stem/$name ..." >&2
    start=$(date +%s%N)
    set +e
    (
        if [ "$vmem_kb" != "0" ]; then ulimit -v "$vmem_kb"; fi
        export HEADROOM_FUZZ_ITERS="$iters"
        if [ -n "$timeout_ms" ]; then export HEADROOM_FUZZ_TIMEOUT_MS="$timeout_ms"; fi
        cd "$crate_dir" # where `cargo test` runs it
        exec "$exe" --exact "$name" --test-threads=1 --nocapture
    ) >"$log" 2>&1
    status=$?
    set -e
    wall_ns=$(( $(date +%s%N) - start ))
    wall=$(awk -v ns="$wall_ns" 'BEGIN { printf "%.1f", ns / 1e9 }')
    case "$status" in
        0) verdict="ok" ;;
        101) verdict="FAILED (panic/hang found)" ;;
        134) verdict="ABORTED (SIGABRT)" ;;
        135) verdict="CRASHED (SIGBUS)" ;;
        137) verdict="KILLED (SIGKILL/OOM)" ;;
        139) verdict="CRASHED (SIGSEGV)" ;;
        *) verdict="FAILED (exit $status)" ;;
    esac
    [ "$status" -eq 0 ] || failed=$((failed + 1))
    summary="$(grep -ho 'FUZZKIT-SUMMARY .*' "$log" | tail -n 1 || true)"
    if [ -n "$summary" ]; then
        campaign="$(field name)"; inputs="$(field inputs)"; ok="$(field ok)"
        errs="$(field errors)"; panics="$(field panics)"; hangs="$(field hangs)"
        slowest="$(field slowest_ms)"
        sum_inputs=$((sum_inputs + inputs)); sum_ok=$((sum_ok + ok)); sum_err=$((sum_err + errs))
        sum_panics=$((sum_panics + panics)); sum_hangs=$((sum_hangs + hangs))
    else
        campaign="?"; inputs="-"; ok="-"; errs="-"; panics="-"; hangs="-"; slowest="-"
    fi
    sum_wall_ns=$((sum_wall_ns + wall_ns))
    row="| $campaign | $pkg/$stem::$name | $inputs | $ok | $errs | $panics | $hangs | $slowest | $wall | $verdict |"
    table="$table
$row"
    echo "$row" >&2
done
table="$table
| **total** | $count campaigns | **$sum_inputs** | $sum_ok | $sum_err | $sum_panics | $sum_hangs | | $(awk -v ns="$sum_wall_ns" 'BEGIN { printf "%.1f", ns / 1e9 }') | $failed failed |"

echo
echo "$header"
echo
echo "$table"
if [ -n "$markdown" ]; then
    {
        echo "$header" | sed 's/^/    /'
        echo
        echo "$table"
    } >"$markdown"
    echo "table written to $markdown" >&2
fi
echo "logs: $logs" >&2
[ "$failed" -eq 0 ]
