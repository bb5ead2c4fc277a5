//! Every trainer-op kernel module (`headroom_kernels::TRAINER_OPS`) compiles with NVRTC for
//! sm_80 and sm_90, has exactly the registered entry points, and has the parameter list its
//! launch wrapper in `src/ops/` pushes — all without a GPU. Skipped (with a message) when
//! libnvrtc cannot be loaded, unless `HEADROOM_REQUIRE_NVRTC=1` makes that a failure
//! (`source .ci/nvrtc-env.sh`).

use std::collections::BTreeSet;

use headroom_cuda::{compile, compile_cached, nvrtc_available, OP_LAUNCH_SIGNATURES};
use headroom_kernels::{KernelSource, TRAINER_OPS};

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
    eprintln!("{test}: skipped: libnvrtc cannot be loaded (source .ci/nvrtc-env.sh)");
    false
}

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

/// The PTX parameter types of entry `name`, in order.
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

/// Modules whose results are specified as bitwise equal to a CPU reference: their PTX must
/// not contain a fused multiply-add (cross-entropy calls CUDA's `logf`, whose libdevice
/// implementation uses FMAs on purpose; its tolerance says so).
const FMA_ALLOWED: &[&str] = &["cross_entropy"];

/// Bitwise modules whose CPU reference fuses some multiply-adds on purpose (AdamW: PyTorch's
/// lerp and addcmul), written as explicit `__fmaf_rn` calls. Their PTX may hold `fma.rn.f32`,
/// but only where the source asks: [`without_explicit_fmas`] must compile to none.
const EXPLICIT_FMA: &[&str] = &["adamw"];

/// `kernel` with every `__fmaf_rn` replaced by a separately rounded multiply and add.
fn without_explicit_fmas(kernel: &KernelSource) -> KernelSource {
    let source = format!(
        "__device__ __forceinline__ float hr_unfused(float a, float b, float c) {{\n\
         return __fadd_rn(__fmul_rn(a, b), c);\n}}\n{}",
        kernel.source.replace("__fmaf_rn(", "hr_unfused(")
    );
    KernelSource {
        source: Box::leak(source.into_boxed_str()),
        ..*kernel
    }
}

#[test]
fn nvrtc_compiles_every_trainer_op_for_sm80_and_sm90() {
    if !nvrtc_or_skip("nvrtc_compiles_every_trainer_op_for_sm80_and_sm90") {
        return;
    }
    let mut compiled = 0;
    for arch in ["sm_80", "sm_90"] {
        for kernel in TRAINER_OPS {
            let out = compile(kernel, arch).unwrap_or_else(|e| panic!("{e}"));
            let listed: BTreeSet<String> = kernel.functions.iter().map(|f| f.to_string()).collect();
            assert_eq!(
                ptx_entries(&out.ptx),
                listed,
                "{}/{arch}: PTX entry points differ from the registry",
                kernel.name
            );
            assert!(out.ptx.contains(&format!(".target {arch}")));
            assert!(out.cubin.starts_with(b"\x7fELF"), "{}/{arch}", kernel.name);
            assert!(
                out.log.is_empty(),
                "{}/{arch} warnings:\n{}",
                kernel.name,
                out.log
            );
            if EXPLICIT_FMA.contains(&kernel.name) {
                let fmas: Vec<&str> = out.ptx.lines().filter(|l| l.contains("fma.")).collect();
                assert!(
                    !fmas.is_empty(),
                    "{}/{arch}: the explicit FMAs are gone",
                    kernel.name
                );
                assert!(
                    fmas.iter()
                        .all(|l| l.trim_start().starts_with("fma.rn.f32 ")),
                    "{}/{arch}: unexpected FMA kinds {fmas:?}",
                    kernel.name
                );
                let unfused =
                    compile(&without_explicit_fmas(kernel), arch).unwrap_or_else(|e| panic!("{e}"));
                assert!(
                    !unfused.ptx.contains("fma."),
                    "{}/{arch}: PTX has an FMA the source did not ask for",
                    kernel.name
                );
            } else if !FMA_ALLOWED.contains(&kernel.name) {
                assert!(
                    !out.ptx.contains("fma."),
                    "{}/{arch}: PTX has an FMA",
                    kernel.name
                );
            }
            assert!(
                !out.ptx.contains(".ftz"),
                "{}/{arch}: PTX flushes subnormals",
                kernel.name
            );
            // No float atomics anywhere: the reductions and scatters are deterministic.
            // (Instructions only: `ld.shared` contains "red." too.)
            let atomic =
                out.ptx.lines().map(str::trim_start).find(|l| {
                    l.starts_with("atom.") || l.starts_with("red.") || l.contains(" atom.")
                });
            assert!(
                atomic.is_none(),
                "{}/{arch}: PTX has an atomic: {atomic:?}",
                kernel.name
            );
            compiled += 1;
        }
    }
    assert_eq!(compiled, 2 * TRAINER_OPS.len());
}

/// Every launch in `src/ops/` and `src/gemm.rs` is described in `OP_LAUNCH_SIGNATURES` (the
/// wrappers push their arguments through the same table's helper), and every entry point of
/// `TRAINER_OPS` has exactly that PTX parameter list.
#[test]
fn trainer_op_signatures_match_the_launches() {
    if !nvrtc_or_skip("trainer_op_signatures_match_the_launches") {
        return;
    }
    let mut checked = BTreeSet::new();
    for kernel in TRAINER_OPS {
        let out = compile_cached(kernel, "sm_90").unwrap_or_else(|e| panic!("{e}"));
        for &function in kernel.functions {
            let (_, want) = OP_LAUNCH_SIGNATURES
                .iter()
                .find(|(name, _)| *name == function)
                .unwrap_or_else(|| panic!("no launch signature recorded for {function}"));
            let want: Vec<String> = want.iter().map(|p| p.ptx_type().to_string()).collect();
            assert_eq!(ptx_params(&out.ptx, function), want, "{function}");
            checked.insert(function);
        }
    }
    // And the table names nothing that is not a kernel.
    for (name, _) in OP_LAUNCH_SIGNATURES {
        assert!(
            checked.contains(name),
            "{name} is in the table but not in TRAINER_OPS"
        );
    }
}
