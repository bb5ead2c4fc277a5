#!/usr/bin/env bash
# Property tests under many seeds: the search CI does not do.
#
# CI fixes proptest's seed (PROPTEST_RNG_SEED in .ci/run), so that a clone that passed once
# passes again and a rare case cannot turn a green change red at random. The search for such
# cases happens here instead: every test binary of the workspace runs --rounds times, each
# round under a new seed (and the CPU kernel level cycling: native, avx2, baseline), and a
# failure prints the seed, the level and the command that replays it. Binaries slower than
# --max-seconds on their first run are left out of the repeated rounds. --filter matches the
# binary's file name: a crate's unit tests are headroom_<crate>-<hash>, an integration test is
# named after its file (float8-<hash> for tests/float8.rs). The trainer's integration tests are
# one binary, integration-<hash>, slower than the default bound: hunt them with
# `--filter '^integration-' --max-seconds 300`.
#
# Usage: scripts/proptest-hunt.sh [--rounds N] [--max-seconds S] [--filter REGEX]
#                                 [--target-dir DIR]
#
# The exit status is 0 only if every run passed. A found case belongs in the test's
# proptest-regressions file (proptest writes it there) and its fix in the same commit.
set -euo pipefail

rounds=10
max_seconds=4
filter=""
target_dir="${CARGO_TARGET_DIR:-target}"
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --max-seconds) max_seconds="$2"; shift 2 ;;
        --filter) filter="$2"; shift 2 ;;
        --target-dir) target_dir="$2"; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="$target_dir"

mapfile -t binaries < <(cargo test --workspace --all-features --no-run 2>&1 |
    sed -n 's/.*Executable .* (\(.*\))$/\1/p' |
    while read -r b; do [[ "$(basename "$b")" =~ ${filter:-.} ]] && echo "$b"; done || true)
[ ${#binaries[@]} -gt 0 ] || { echo "no test binaries matched" >&2; exit 2; }

failures=0
# The first run, with this shell's seed if any: which binaries are fast enough to repeat.
fast=()
for b in "${binaries[@]}"; do
    start=$(date +%s%N)
    if ! timeout 600 "$b" -q >/dev/null 2>&1; then
        echo "FAIL (first run) $b"
        failures=$((failures + 1))
    fi
    elapsed=$((($(date +%s%N) - start) / 1000000))
    if [ "$elapsed" -le $((max_seconds * 1000)) ]; then fast+=("$b"); fi
done
echo "${#binaries[@]} test binaries, ${#fast[@]} of them under ${max_seconds} s: $rounds rounds"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
for round in $(seq 1 "$rounds"); do
    seed=$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')
    case $((round % 3)) in 0) isa=baseline ;; 1) isa=native ;; 2) isa=avx2 ;; esac
    for b in "${fast[@]}"; do
        # `headroom env` reports the machine's own level, so a capped run differs by design.
        skip=()
        [ "$isa" = native ] || skip=(--skip env_reports_the_machine)
        if ! PROPTEST_RNG_SEED=$seed HEADROOM_CPU_ISA=$isa timeout 300 "$b" -q "${skip[@]}" \
            >"$log" 2>&1; then
            failures=$((failures + 1))
            echo "FAIL round $round: PROPTEST_RNG_SEED=$seed HEADROOM_CPU_ISA=$isa $b"
            grep -E "panicked|minimal failing|Test failed" "$log" | head -8 || true
        fi
    done
    echo "round $round (seed $seed, $isa): done"
done
echo "$failures failing runs"
[ "$failures" -eq 0 ]
