//! The flash attention kernels, run on the CPU: their own source, compiled by a C++20 compiler
//! against `emu/host_emulator.h` (threads for CUDA threads, barriers for `__syncthreads` and
//! warp-collective instructions, `mma.sync`/`ldmatrix` implemented from the PTX fragment
//! layouts), checked by `emu/flash_attn_check.cpp` against a double-precision reference of
//! attention and its gradients. This is the evidence a machine without a GPU can give that the
//! kernels compute attention: indexing, fragment layouts, masking, GQA, tails and the order of
//! copies and barriers. What it cannot show is timing, real tensor-core rounding, or a
//! misunderstanding of PTX shared by the kernels and the emulator.
//!
//! Only the inline-PTX function bodies of `cu/flash_attn_common.cuh` are replaced (by calls to
//! the emulator's `emu_*` functions); everything else compiles verbatim. Skipped with a message
//! when no C++20 compiler with `<barrier>` is found (`$CXX`, else `c++`, `g++`, `clang++`),
//! unless `HEADROOM_REQUIRE_CXX=1`, which makes that a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `(struct, function)` → the emulated body of every inline-PTX function of the common header.
const EMULATED_BODIES: &[(Option<&str>, &str, &str)] = &[
    (
        Some("HrBf16"),
        "pack",
        "return (hr_u32)hr_f32_to_bf16_bits(lo) | ((hr_u32)hr_f32_to_bf16_bits(hi) << 16);",
    ),
    (
        Some("HrF16"),
        "pack",
        "return (hr_u32)hr_f32_to_f16_bits(lo) | ((hr_u32)hr_f32_to_f16_bits(hi) << 16);",
    ),
    (Some("HrBf16"), "mma", "emu_mma(d, a, b0, b1, false);"),
    (Some("HrF16"), "mma", "emu_mma(d, a, b0, b1, true);"),
    (None, "hr_smem_addr", "return emu_smem_addr(p);"),
    (None, "hr_ldmatrix_x4", "emu_ldmatrix(r, addr, false);"),
    (None, "hr_ldmatrix_x4_trans", "emu_ldmatrix(r, addr, true);"),
    (None, "hr_cp_async_16", "emu_cp_async(smem, gmem, valid);"),
    (None, "hr_cp_async_commit", "emu_cp_async_commit();"),
    (None, "hr_cp_async_wait_all", "emu_cp_async_wait(0);"),
    (
        None,
        "hr_cp_async_wait_all_but_last",
        "emu_cp_async_wait(1);",
    ),
];

const SHARED_DECLARATION: &str = "extern __shared__ __align__(128) hr_u16 hr_flash_smem[];";

/// `common` with each function that contains inline PTX given its emulated body, and the
/// dynamic shared memory array turned into a per-thread pointer the emulator sets.
fn emulated_common(common: &str) -> String {
    assert!(
        common.contains(SHARED_DECLARATION),
        "flash_attn_common.cuh no longer declares `{SHARED_DECLARATION}`"
    );
    let src = common.replace(SHARED_DECLARATION, "thread_local hr_u16* hr_flash_smem;");
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::new();
    let mut done = 0; // bytes of `src` already copied to `out`
    let mut replaced = Vec::new();
    while let Some(at) = ["asm(", "asm volatile("]
        .iter()
        .filter_map(|p| src[done..].find(p))
        .min()
        .map(|i| done + i)
    {
        let head = src[..at]
            .rfind("__device__ __forceinline__")
            .expect("inline PTX outside a device function");
        let paren = head + src[head..].find('(').expect("a parameter list");
        let name = src[head..paren]
            .split(|c: char| !ident(c))
            .rfind(|s| !s.is_empty())
            .expect("a function name");
        // A member when the last `struct` before the function is not yet closed.
        let owner = src[..head]
            .rfind("struct ")
            .filter(|&s| !src[s..head].contains("};"))
            .map(|s| src[s + 7..].split(|c: char| !ident(c)).next().unwrap_or(""));
        let body = EMULATED_BODIES
            .iter()
            .find(|(o, n, _)| *n == name && *o == owner)
            .unwrap_or_else(|| panic!("no emulation for {owner:?}::{name}"))
            .2;
        let open = head + src[head..].find('{').expect("a body");
        let mut depth = 0;
        let close = src[open..]
            .char_indices()
            .find_map(|(i, c)| {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                (depth == 0).then_some(open + i)
            })
            .expect("a closing brace");
        out.push_str(&src[done..open]);
        out.push_str(&format!("{{ {body} }}"));
        replaced.push((owner.map(str::to_string), name.to_string()));
        done = close + 1;
    }
    out.push_str(&src[done..]);
    assert_eq!(
        replaced.len(),
        EMULATED_BODIES.len(),
        "every emulated function is used once: {replaced:?}"
    );
    out
}

/// A C++ compiler that builds a C++20 program using `<barrier>` and threads, if any.
fn cxx20(scratch: &Path) -> Option<String> {
    let probe = scratch.join("probe.cpp");
    std::fs::write(
        &probe,
        "#include <barrier>\n#include <thread>\nint main() { std::barrier<> b(1); \
         b.arrive_and_wait(); std::thread t([] {}); t.join(); }\n",
    )
    .unwrap();
    let candidates: Vec<String> = std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["c++", "g++", "clang++"].map(String::from))
        .collect();
    candidates.into_iter().find(|cxx| {
        Command::new(cxx)
            .args(["-std=c++20", "-pthread"])
            .arg(&probe)
            .arg("-o")
            .arg(scratch.join("probe"))
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[test]
fn flash_kernels_match_a_double_precision_reference_under_the_host_emulator() {
    let kernels = Path::new(env!("CARGO_MANIFEST_DIR"));
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("flash_emulator");
    std::fs::create_dir_all(&scratch).unwrap();
    let Some(cxx) = cxx20(&scratch) else {
        let required = std::env::var("HEADROOM_REQUIRE_CXX").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "HEADROOM_REQUIRE_CXX=1 but no C++20 compiler was found"
        );
        eprintln!("skipped: no C++20 compiler with <barrier> ($CXX, c++, g++, clang++)");
        return;
    };
    let common = std::fs::read_to_string(kernels.join("cu/flash_attn_common.cuh")).unwrap();
    std::fs::write(
        scratch.join("flash_attn_common_emulated.cuh"),
        emulated_common(&common),
    )
    .unwrap();
    let binary = scratch.join("flash_attn_check");
    let build = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O2",
            "-pthread",
            "-Wall",
            "-Wno-unknown-pragmas",
        ])
        .arg(format!("-I{}", scratch.display()))
        .arg(format!("-I{}", kernels.join("cu").display()))
        .arg(format!("-I{}", kernels.join("emu").display()))
        .arg(kernels.join("emu/flash_attn_check.cpp"))
        .arg("-o")
        .arg(&binary)
        .output()
        .unwrap();
    assert!(
        build.status.success(),
        "{cxx} failed:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&binary).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    eprintln!("{report}{}", String::from_utf8_lossy(&run.stderr));
    assert!(
        run.status.success(),
        "the emulated kernels disagree with the reference"
    );
    assert!(report.contains("ALL OK"), "{report}");
    // Every case ran all four kernels' checks.
    assert_eq!(report.matches("case ").count(), 10, "{report}");
    assert_eq!(report.matches(" ok").count(), 10 * 5, "{report}");
}

#[test]
fn every_inline_ptx_function_has_an_emulation() {
    let common = include_str!("../cu/flash_attn_common.cuh");
    let emulated = emulated_common(common);
    assert!(!emulated.contains("asm("));
    assert!(!emulated.contains("asm volatile("));
    assert!(emulated.contains("emu_mma(d, a, b0, b1, false);"));
    // Everything else survives verbatim.
    for kept in [
        "hr_flash_load_tile",
        "hr_load_b_kn",
        "hr_acc_to_a",
        "hr_flash_visible",
    ] {
        assert_eq!(
            common.matches(kept).count(),
            emulated.matches(kept).count(),
            "{kept}"
        );
    }
}
