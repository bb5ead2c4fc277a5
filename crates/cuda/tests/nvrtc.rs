//! Every kernel in `headroom_kernels::ALL` compiles with NVRTC whenever libnvrtc can be loaded,
//! so a kernel syntax error fails CI even on machines without a GPU (`.ci/nvrtc-env.sh` installs
//! NVRTC from PyPI and sets `HEADROOM_REQUIRE_NVRTC=1`, which turns a missing libnvrtc into a
//! failure instead of a skip).

use std::collections::BTreeSet;
use std::sync::Arc;

use headroom_cuda::{
    compile, compile_cached, nvrtc_available, nvrtc_version, CudaError, COMPILE_OPTIONS,
};
use headroom_kernels::{KernelSource, ALL};

/// False (and says why) when NVRTC cannot be loaded and the environment does not require it.
fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc_available() {
        return true;
    }
    let required = std::env::var("HEADROOM_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "HEADROOM_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded (LD_LIBRARY_PATH={:?})",
        std::env::var("LD_LIBRARY_PATH").ok()
    );
    eprintln!(
        "{test}: skipped: libnvrtc cannot be loaded (source .ci/nvrtc-env.sh to install it, \
         or set HEADROOM_REQUIRE_NVRTC=1 to make this a failure)"
    );
    false
}

/// The `.entry` names of a PTX module.
fn ptx_entries(ptx: &str) -> BTreeSet<String> {
    ptx.lines()
        .filter_map(|line| line.split(".entry ").nth(1))
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

#[test]
fn nvrtc_compiles_every_kernel() {
    if !nvrtc_or_skip("nvrtc_compiles_every_kernel") {
        return;
    }
    let (major, minor) = nvrtc_version().expect("a loadable NVRTC reports its version");
    eprintln!("NVRTC {major}.{minor}, options {COMPILE_OPTIONS:?}");
    let mut compiled = 0;
    for arch in ["sm_80", "sm_90"] {
        for kernel in ALL {
            let out = compile(kernel, arch).unwrap_or_else(|e| panic!("{e}"));
            let listed: BTreeSet<String> = kernel.functions.iter().map(|f| f.to_string()).collect();
            assert_eq!(
                ptx_entries(&out.ptx),
                listed,
                "{}/{arch}: PTX entry points differ from the registry",
                kernel.name
            );
            assert!(
                out.ptx.contains(&format!(".target {arch}")),
                "{}: PTX not for {arch}",
                kernel.name
            );
            assert!(
                out.cubin.starts_with(b"\x7fELF"),
                "{}/{arch}: no CUBIN (ELF) produced",
                kernel.name
            );
            assert!(
                out.log.is_empty(),
                "{}/{arch} warnings:\n{}",
                kernel.name,
                out.log
            );
            // Bitwise agreement with the CPU rests on these: no contracted multiply-adds, no
            // flushing of subnormals to zero.
            assert!(
                !out.ptx.contains("fma."),
                "{}/{arch}: PTX has an FMA",
                kernel.name
            );
            assert!(
                !out.ptx.contains(".ftz"),
                "{}/{arch}: PTX flushes subnormals",
                kernel.name
            );
            compiled += 1;
            eprintln!(
                "compiled {}/{arch}: {} entries, {} B PTX, {} B CUBIN",
                kernel.name,
                kernel.functions.len(),
                out.ptx.len(),
                out.cubin.len()
            );
        }
    }
    assert_eq!(compiled, 2 * ALL.len());
}

/// The PTX parameter types of entry `name`, in order (`.u64` for pointers and `u64` counts).
fn ptx_params(ptx: &str, name: &str) -> Vec<String> {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("{name} not in PTX"));
    let body = &ptx[start..];
    let end = body.find(')').unwrap_or(body.len());
    body[..end]
        .lines()
        .filter_map(|l| l.trim().strip_prefix(".param ."))
        .map(|rest| rest.split_whitespace().next().unwrap_or("").to_string())
        .collect()
}

/// The argument list headroom-cuda's backend launches each kernel family with (see the SAFETY
/// comments in src/backend.rs). A kernel whose signature drifts from its launch fails here,
/// without a GPU.
#[test]
fn kernel_signatures_match_the_launches() {
    if !nvrtc_or_skip("kernel_signatures_match_the_launches") {
        return;
    }
    let launches: &[(&str, &[&str])] = &[
        ("cast_", &["u64", "u64", "u64"]),                 // src, dst, n
        ("scale_", &["u64", "f32", "u64"]),                // x, alpha, n
        ("axpy_", &["f32", "u64", "u64", "u64"]),          // alpha, x, y, n
        ("sum_squares_partials_", &["u64", "u64", "u64"]), // x, n, partials
        ("sum_squares_finish", &["u64", "u32", "u64"]),    // partials, count, out
        ("unscale_check_", &["u64", "f32", "u64", "u64"]), // x, inv_scale, n, found
    ];
    for kernel in ALL {
        let out = compile_cached(kernel, "sm_90").unwrap_or_else(|e| panic!("{e}"));
        for function in kernel.functions {
            let (_, want) = launches
                .iter()
                .find(|(prefix, _)| function.starts_with(prefix))
                .unwrap_or_else(|| panic!("no launch signature recorded for {function}"));
            assert_eq!(ptx_params(&out.ptx, function), *want, "{function}");
        }
    }
}

#[test]
fn compile_cached_compiles_once_per_kernel_and_arch() {
    if !nvrtc_or_skip("compile_cached_compiles_once_per_kernel_and_arch") {
        return;
    }
    let kernel = &ALL[0];
    let a = compile_cached(kernel, "sm_90").unwrap();
    let b = compile_cached(kernel, "sm_90").unwrap();
    assert!(Arc::ptr_eq(&a, &b), "second request must hit the cache");
    let c = compile_cached(kernel, "sm_80").unwrap();
    assert!(!Arc::ptr_eq(&a, &c), "another arch is another entry");
    assert_eq!(c.arch, "sm_80");
}

#[test]
fn a_syntax_error_is_reported_with_the_nvrtc_log() {
    if !nvrtc_or_skip("a_syntax_error_is_reported_with_the_nvrtc_log") {
        return;
    }
    let broken = KernelSource {
        name: "broken",
        source: "extern \"C\" __global__ void broken(float* x) { x[0] = undeclared_name; }",
        functions: &["broken"],
    };
    match compile(&broken, "sm_90") {
        Err(CudaError::Nvrtc { kernel, arch, log }) => {
            assert_eq!(kernel, "broken");
            assert_eq!(arch, "sm_90");
            assert!(
                log.contains("undeclared_name"),
                "log should point at the error: {log}"
            );
        }
        other => panic!("expected an Nvrtc error, got {other:?}"),
    }
}

#[test]
fn an_invalid_arch_is_an_error_not_a_panic() {
    // Checked before NVRTC is touched, so this runs on every machine.
    for arch in ["", "compute_90", "sm_9 0", "sm_90\0"] {
        match compile(&ALL[0], arch) {
            Err(CudaError::Nvrtc { log, .. }) => assert!(log.contains("architecture"), "{log}"),
            other => panic!("arch {arch:?}: expected an Nvrtc error, got {other:?}"),
        }
    }
}
