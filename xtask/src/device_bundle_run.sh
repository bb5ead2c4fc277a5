#!/usr/bin/env bash
# headroom device bundle: the workspace's test and bench binaries, built in release mode with
# every feature (CUDA included) by `cargo xtask device-bundle`. Needs no Rust toolchain; the
# CUDA driver and NVRTC libraries are opened at run time.
#
#   ./run.sh [test]     every test binary with --include-ignored (GPU tests included); goes on
#                       after a failure, prints pass/fail per binary, exits 1 if any failed
#   ./run.sh bench      every criterion bench binary with --bench and short settings
#   ./run.sh all        both
#
# Extra arguments after the mode go to every binary (e.g. a test name filter).
# With $OUT set, each binary's log goes to $OUT/logs/, criterion's output to $OUT/criterion/
# and bench records to $OUT/headroom-bench/ (so `cargo xtask` can report them elsewhere).
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mode="${1:-test}"
[ "$#" -gt 0 ] && shift
out="${OUT:-}"

# Criterion settings for `bench`: the same as `cargo xtask bench --quick`, slightly longer.
bench_args=(--bench --warm-up-time 1 --measurement-time 2 --sample-size 10 --nresamples 10000 --noplot)

passed=()
failed=()

# run_kind DIR ARGS...: run every executable in $here/DIR with ARGS, recording the outcome.
run_kind() {
  local kind="$1"
  shift
  local bin name status
  [ -d "$here/$kind" ] || return 0
  for bin in "$here/$kind"/*; do
    [ -f "$bin" ] && [ -x "$bin" ] || continue
    name="$kind/$(basename "$bin")"
    echo "=== $name"
    if [ -n "$out" ]; then
      mkdir -p "$out/logs/$kind"
      "$bin" "$@" 2>&1 | tee "$out/logs/$name.log"
      status=${PIPESTATUS[0]}
    else
      "$bin" "$@"
      status=$?
    fi
    if [ "$status" -eq 0 ]; then
      passed+=("$name")
    else
      failed+=("$name (exit $status)")
    fi
  done
}

# Tests run from the bundle directory so relative paths are the same on every machine.
cd "$here" || exit 1
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"

case "$mode" in
  test | bench | all) ;;
  *)
    echo "usage: $0 [test|bench|all] [args for every binary...]" >&2
    exit 2
    ;;
esac

if [ "$mode" = test ] || [ "$mode" = all ]; then
  run_kind tests --include-ignored "$@"
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  if [ -n "$out" ]; then
    export CRITERION_HOME="$out/criterion"
    export HEADROOM_BENCH_DIR="$out/headroom-bench"
  else
    export CRITERION_HOME="${CRITERION_HOME:-$here/criterion}"
    export HEADROOM_BENCH_DIR="${HEADROOM_BENCH_DIR:-$here/headroom-bench}"
  fi
  run_kind benches "${bench_args[@]}" "$@"
fi

echo
echo "=== summary: ${#passed[@]} passed, ${#failed[@]} failed"
for name in "${passed[@]}"; do echo "  pass  $name"; done
for name in "${failed[@]}"; do echo "  FAIL  $name"; done
[ "${#failed[@]}" -eq 0 ]
