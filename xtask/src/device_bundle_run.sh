#!/usr/bin/env bash
# headroom device bundle: the workspace's test and bench binaries, built in release mode with
# every feature (CUDA included) by `cargo xtask device-bundle`. Needs no Rust toolchain; the
# CUDA driver and NVRTC libraries are opened at run time.
#
#   ./run.sh [test]     every test binary with --include-ignored (GPU tests included); goes on
#                       after a failure, prints pass/fail per binary, exits 1 if any failed
#   ./run.sh bench      every criterion bench binary with --bench and short settings
#   ./run.sh all        both
#   ./run.sh compare    every comparison script that takes `--device` (benches/torch/*.py of
#                       the checkout run.sh is started from, or $HEADROOM_TORCH_SCRIPTS), run
#                       with `--device cuda` by $HEADROOM_PYTHON (else python3); their records
#                       go beside the benches' records
#   ./run.sh pack       replace everything under $OUT by one archive, $OUT/device-run.tar.gz
#                       (the device tool brings back at most 8 files, 2 folders deep); unpack
#                       it and give the folder to `cargo xtask bench-report`
#
# bin/ holds the `headroom` program; the trainer's command-line tests run it (HEADROOM_BIN).
# Extra arguments after the mode go to every binary (e.g. a test name filter).
# With $OUT set, each binary's log goes to $OUT/logs/, criterion's output to $OUT/criterion/
# and bench records to $OUT/headroom-bench/ (so `cargo xtask` can report them elsewhere).
set -uo pipefail

caller="$PWD"
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
# The trainer's command-line tests run the `headroom` program beside them, not the path cargo
# compiled in (which exists only where the bundle was built).
if [ -z "${HEADROOM_BIN:-}" ] && [ -x "$here/bin/headroom" ]; then
  export HEADROOM_BIN="$here/bin/headroom"
fi
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"

# cudarc opens libcuda, libnvrtc, libcublasLt and libnccl by name at run time. Where the loader
# cannot find one (NVRTC, cuBLASLt and NCCL often live only in the CUDA toolkit or in PyTorch's
# nvidia wheels, 9 folders below /opt), add the first folder that holds it.
# (By exact name: a registered libnccl.so.2 alone does not give cudarc a libnccl.so.)
need_lib() { ! ldconfig -p 2>/dev/null | grep -q "[[:space:]]$1 ("; }
find_lib() {
  find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /opt /usr/lib /usr/local/lib \
    -maxdepth 10 -name "$1*" 2>/dev/null | sort | head -n 1
}
for lib in libnvrtc.so libcublasLt.so libnccl.so; do
  need_lib "$lib" || continue
  found="$(find_lib "$lib")"
  [ -n "$found" ] || continue
  dir="$(dirname "$found")"
  export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "run.sh: $lib from $dir"
done
# NVIDIA's nccl wheel ships only libnccl.so.2, a name cudarc does not try (it tries libnccl.so
# and libnccl.so.<CUDA major>); give it the plain name in a folder of our own.
if need_lib libnccl.so && ! find_lib libnccl.so | grep -q 'libnccl\.so$'; then
  found="$(find_lib libnccl.so.2)"
  if [ -n "$found" ]; then
    links="$(mktemp -d)"
    ln -s "$found" "$links/libnccl.so"
    export LD_LIBRARY_PATH="$links:$LD_LIBRARY_PATH"
    echo "run.sh: libnccl.so -> $found"
  fi
fi

case "$mode" in
  test | bench | all | compare) ;;
  pack)
    [ -n "$out" ] || { echo "pack needs \$OUT" >&2; exit 2; }
    archive="$(mktemp -d)/device-run.tar.gz"
    tar -czf "$archive" -C "$out" . || exit 1
    find "$out" -mindepth 1 -delete && mv "$archive" "$out/" || exit 1
    echo "packed into $out/device-run.tar.gz"
    exit 0
    ;;
  *)
    echo "usage: $0 [test|bench|all|compare|pack] [args for every binary...]" >&2
    exit 2
    ;;
esac

bench_dirs() {
  if [ -n "$out" ]; then
    export CRITERION_HOME="$out/criterion"
    export HEADROOM_BENCH_DIR="$out/headroom-bench"
  else
    export CRITERION_HOME="${CRITERION_HOME:-$here/criterion}"
    export HEADROOM_BENCH_DIR="${HEADROOM_BENCH_DIR:-$here/headroom-bench}"
  fi
  mkdir -p "$HEADROOM_BENCH_DIR"
}

if [ "$mode" = test ] || [ "$mode" = all ]; then
  run_kind tests --include-ignored "$@"
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  bench_dirs
  run_kind benches "${bench_args[@]}" "$@"
fi
if [ "$mode" = compare ]; then
  bench_dirs
  scripts="${HEADROOM_TORCH_SCRIPTS:-$caller/benches/torch}"
  python="${HEADROOM_PYTHON:-python3}"
  for script in "$scripts"/*.py; do
    [ -f "$script" ] && grep -q -- "--device" "$script" || continue
    name="compare/$(basename "$script" .py)"
    echo "=== $name"
    # Records (JSON lines) join the benches' records; everything else is log.
    "$python" "$script" --device cuda 2>&1 | tee "$HEADROOM_BENCH_DIR/$(basename "$script" .py).log" |
      grep '^{' >>"$HEADROOM_BENCH_DIR/records.jsonl"
    status=${PIPESTATUS[0]}
    if [ "$status" -eq 0 ]; then passed+=("$name"); else failed+=("$name (exit $status)"); fi
  done
fi

echo
echo "=== summary: ${#passed[@]} passed, ${#failed[@]} failed"
for name in "${passed[@]}"; do echo "  pass  $name"; done
for name in "${failed[@]}"; do echo "  FAIL  $name"; done
[ "${#failed[@]}" -eq 0 ]
