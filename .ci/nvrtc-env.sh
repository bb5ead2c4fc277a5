# shellcheck shell=bash
# Make NVRTC loadable on a machine without a CUDA toolkit, so the kernel-compilation test
# (headroom-cuda's nvrtc_compiles_every_kernel) runs for real and kernel syntax errors fail CI.
#
# Source it (from .ci/run, under `set -euo pipefail`):   source .ci/nvrtc-env.sh
#
# It creates a throwaway venv under ${TMPDIR:-/tmp}, installs PyPI's nvidia-cuda-nvrtc 13.x
# (which ships nvidia/cu13/lib/libnvrtc.so.13 inside site-packages), prepends that directory to
# LD_LIBRARY_PATH and exports HEADROOM_REQUIRE_NVRTC=1, which turns "libnvrtc not found" from a
# skip into a test failure. The venv path is exported as HEADROOM_NVRTC_VENV.
#
# cudarc (feature cuda-13000) looks for, among others, libnvrtc.so and libnvrtc.so.13
# (cudarc::get_lib_name_candidates); the wheel's libnvrtc.so.13 matches the second. A
# libnvrtc.so link is added as well in case a future wheel renames its file.
#
# Uses $HEADROOM_PYTHON if set, else python3. Returns non-zero (failing a `set -e` caller) when
# the venv, the download or the library check fails.

_headroom_nvrtc_env() {
    local python="${HEADROOM_PYTHON:-python3}"
    local venv
    venv="$(mktemp -d "${TMPDIR:-/tmp}/headroom-nvrtc.XXXXXX")" || return 1
    echo "nvrtc-env: creating venv in $venv" >&2
    "$python" -m venv "$venv" || return 1
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "nvidia-cuda-nvrtc==13.*" || return 1

    # Find the directory holding libnvrtc.so.13 inside the venv's site-packages.
    local libdir
    libdir="$("$venv/bin/python" - <<'PY'
import glob, os, sysconfig
site = sysconfig.get_paths()["purelib"]
hits = sorted(glob.glob(os.path.join(site, "nvidia", "**", "libnvrtc.so.13*"), recursive=True))
hits = [h for h in hits if "builtins" not in os.path.basename(h)]
print(os.path.dirname(hits[0]) if hits else "")
PY
)" || return 1
    if [ -z "$libdir" ]; then
        echo "nvrtc-env: libnvrtc.so.13 not found in $venv" >&2
        return 1
    fi
    if [ ! -e "$libdir/libnvrtc.so.13" ]; then
        # Only a fully versioned file (libnvrtc.so.13.x.y) was shipped: give it the soname.
        local versioned
        versioned="$(find "$libdir" -maxdepth 1 -name 'libnvrtc.so.13.*' | head -n 1)"
        ln -s "$(basename "$versioned")" "$libdir/libnvrtc.so.13" || return 1
    fi
    if [ ! -e "$libdir/libnvrtc.so" ]; then
        ln -s libnvrtc.so.13 "$libdir/libnvrtc.so" || return 1
    fi

    export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export HEADROOM_REQUIRE_NVRTC=1
    export HEADROOM_NVRTC_VENV="$venv"

    # Prove the library loads under the name cudarc will ask for, and say which version it is.
    "$venv/bin/python" - <<'PY' || return 1
import ctypes, sys
lib = ctypes.CDLL("libnvrtc.so.13")
major, minor = ctypes.c_int(), ctypes.c_int()
if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
    sys.exit("nvrtc-env: nvrtcVersion failed")
print(f"nvrtc-env: NVRTC {major.value}.{minor.value} loadable via LD_LIBRARY_PATH", file=sys.stderr)
PY
}

_headroom_nvrtc_env || {
    echo "nvrtc-env: could not make libnvrtc loadable" >&2
    unset -f _headroom_nvrtc_env
    return 1 2>/dev/null || exit 1 # `return` when sourced, `exit` when run directly
}
unset -f _headroom_nvrtc_env
