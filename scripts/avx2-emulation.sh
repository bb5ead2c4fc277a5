#!/usr/bin/env bash
# Run a cargo command on headroom as an AVX2-only CPU runs it, on a machine with AVX-512.
#
# Two things choose SIMD code at run time, and both must be held to AVX2 + FMA:
#   - headroom's own kernels (AdamW, attention's softmax rows, cross-entropy, widening, the
#     4-bit dequantization, AMX ...): capped by HEADROOM_CPU_ISA=avx2, which this sets;
#   - the `gemm` crate's f32 products, which dispatch on the CPU alone and ignore that cap.
#     Their AVX-512 kernels exist only when gemm is built with its `x86-v4` feature, which
#     the workspace turns on. This builds a copy of the work tree with that feature off, so
#     gemm takes its FMA kernel (2x8 x 6 tiles), as on an AVX2-only CPU.
#
# What it does not emulate is the core: cache sizes, the number of FMA ports and memory
# bandwidth stay this machine's. Figures from it are "the AVX2 code paths on <this CPU>",
# not an AVX2-only machine's; ratios against a baseline built and run the same way compare
# code paths fairly. For torch, the matching caps are ATEN_CPU_CAPABILITY=avx2,
# MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2.
#
# Usage: scripts/avx2-emulation.sh CARGO-ARGS...
#   e.g. scripts/avx2-emulation.sh build --release -p headroom-trainer --bin headroom
#        scripts/avx2-emulation.sh bench -p headroom-benches --bench attn -- attn/fwd_bwd/flash
#
# Timing only: the bits are not an AVX2 machine's (the committed AVX2 loss trace does not
# replay here; gemm's cache-dependent blocking is the likely reason).
#
# The copy lives in target/avx2-emulation/tree and builds into target/avx2-emulation/target,
# so the ordinary build is untouched; it is laid anew from the work tree (tracked and
# untracked files, not ignored ones, with their times, so cargo rebuilds only what changed) on
# every call. Run the binaries it builds with HEADROOM_CPU_ISA=avx2.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if (($# == 0)); then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
base="$root/target/avx2-emulation/tree"
target="$root/target/avx2-emulation/target"
rm -rf "$base"
mkdir -p "$base" "$target"

# The work tree's files, as git sees them (committed or not, never ignored ones; a deleted file
# that is still tracked is skipped).
git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - | tar -xf - -C "$base"

manifest="$base/Cargo.toml"
if ! grep -q '^gemm = { version = "[^"]*", features = \["x86-v4"\] }' "$manifest"; then
    echo "avx2-emulation: Cargo.toml's gemm line is not the one this script knows how to edit" >&2
    exit 1
fi
sed -i 's/^\(gemm = { version = "[^"]*"\), features = \["x86-v4"\] }/\1 }/' "$manifest"

cd "$base"
export CARGO_TARGET_DIR="$target" HEADROOM_CPU_ISA=avx2
echo "avx2-emulation: gemm without x86-v4, HEADROOM_CPU_ISA=avx2, in $base" >&2
exec cargo "$@"
