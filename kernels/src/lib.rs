//! # headroom-kernels
//!
//! headroom's CUDA kernels as CUDA C source text, compiled at run time by NVRTC (see
//! `headroom-cuda`). Nothing here needs CUDA to build: a source is a `&'static str`.
//!
//! ```
//! use headroom_kernels::{find, ALL, CAST};
//!
//! // Every kernel module is listed once, with its entry points.
//! assert!(ALL.iter().any(|k| k.name == CAST.name));
//! let module = find("cast_f32_bf16").expect("a registered entry point");
//! assert_eq!(module.name, "cast");
//! // The source is self-contained: the shared bit-conversion prelude comes first.
//! assert!(module.source.starts_with(headroom_kernels::FLOAT_BITS_PRELUDE));
//! assert!(module.source.contains("cast_f32_bf16"));
//! ```
//!
//! ## Invariants
//! - This crate depends on nothing, not even `headroom-tensor`; it is text and constants.
//! - Every [`KernelSource::source`] compiles alone: it includes no toolkit header (the NVRTC that
//!   CI installs from PyPI ships none), only the [`FLOAT_BITS_PRELUDE`] prepended to it.
//! - Every entry point is `extern "C"` (unmangled) and listed in exactly one
//!   [`KernelSource::functions`]; `headroom-cuda`'s NVRTC test checks the PTX has exactly the
//!   listed entries.
//! - f16/bf16 conversions are bit operations, bit-identical to the `half` crate and to
//!   `headroom_tensor::cpu::kernels` (round-to-nearest-even, NaN stays NaN).
//! - Elementwise kernels are grid-stride loops: any element count (0 included) and any grid size
//!   give the same result. Reductions are deterministic: fixed grid, fixed-order combination.

/// Threads per block for every kernel in this crate (the `HR_BLOCK_THREADS` of the sources).
/// The sum-of-squares reductions require exactly this block size.
pub const BLOCK_THREADS: u32 = 256;

/// Blocks of the first sum-of-squares pass, and so the number of f64 partials the host
/// allocates. Fixed — never derived from the device — because it defines the summation order:
/// the same input gives the same bits on any GPU.
pub const SUM_SQUARES_BLOCKS: u32 = 1024;

/// Bit-exact f32⇄f16⇄bf16 conversions, loads/stores per storage type and the grid-stride loop
/// macro, prepended to every kernel source.
pub const FLOAT_BITS_PRELUDE: &str = include_str!("../cu/float_bits.cuh");

/// One NVRTC compilation unit: a name (used in cache keys and error messages), its full
/// source, and its `extern "C"` entry points.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelSource {
    /// Short module name, e.g. `"cast"`.
    pub name: &'static str,
    /// Complete CUDA C source: [`FLOAT_BITS_PRELUDE`] followed by the module's own file.
    pub source: &'static str,
    /// Every `extern "C" __global__` function the module defines.
    pub functions: &'static [&'static str],
}

// `concat!` needs literals; `include_str!` expands to one, so the prelude and each module become a
// single `&'static str` at compile time with no run-time concatenation.
macro_rules! kernel_source {
    ($name:literal, $file:literal, [$($f:literal),* $(,)?]) => {
        KernelSource {
            name: $name,
            source: concat!(include_str!("../cu/float_bits.cuh"), "\n", include_str!($file)),
            functions: &[$($f),*],
        }
    };
}

/// Casts between f32, f16 and bf16, all six directions: `cast_<src>_<dst>(src, dst, n)`.
pub const CAST: KernelSource = kernel_source!(
    "cast",
    "../cu/cast.cu",
    [
        "cast_f32_f16",
        "cast_f32_bf16",
        "cast_f16_f32",
        "cast_bf16_f32",
        "cast_f16_bf16",
        "cast_bf16_f16",
    ]
);

/// In-place `x *= alpha`: `scale_<t>(x, alpha, n)`.
pub const SCALE: KernelSource = kernel_source!(
    "scale",
    "../cu/scale.cu",
    ["scale_f32", "scale_f16", "scale_bf16"]
);

/// `y += alpha * x` (no FMA), x in any float type, y f32: `axpy_<t>(alpha, x, y, n)`.
pub const AXPY: KernelSource = kernel_source!(
    "axpy",
    "../cu/axpy.cu",
    ["axpy_f32", "axpy_f16", "axpy_bf16"]
);

/// Deterministic `Σ x²` in f64: `sum_squares_partials_<t>(x, n, partials)` on exactly
/// [`SUM_SQUARES_BLOCKS`] × [`BLOCK_THREADS`], then `sum_squares_finish(partials, count, out)`
/// on one block of [`BLOCK_THREADS`].
pub const SUM_SQUARES: KernelSource = kernel_source!(
    "sum_squares",
    "../cu/sum_squares.cu",
    [
        "sum_squares_partials_f32",
        "sum_squares_partials_f16",
        "sum_squares_partials_bf16",
        "sum_squares_finish",
    ]
);

/// In-place `x *= inv_scale` that sets a device `int` flag to 1 if any input element was
/// infinite or NaN: `unscale_check_<t>(x, inv_scale, n, found)`.
pub const UNSCALE: KernelSource = kernel_source!(
    "unscale",
    "../cu/unscale.cu",
    [
        "unscale_check_f32",
        "unscale_check_f16",
        "unscale_check_bf16"
    ]
);

/// Every kernel module, each compiled as one NVRTC program.
pub const ALL: &[KernelSource] = &[CAST, SCALE, AXPY, SUM_SQUARES, UNSCALE];

/// The module that defines the entry point `function`, if any.
pub fn find(function: &str) -> Option<&'static KernelSource> {
    ALL.iter().find(|k| k.functions.contains(&function))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Names as written in a macro invocation `HR_..._KERNEL(name, ...)` or a plain
    /// `extern "C" __global__ void name(`: every identifier that follows one of those.
    fn declared_entry_points(source: &str) -> Vec<String> {
        let mut names = Vec::new();
        for line in source.lines() {
            let line = line.trim_start();
            let rest = if line.starts_with("HR_") && line.contains("_KERNEL(") {
                line.split_once("_KERNEL(").map(|(_, r)| r)
            } else if line.starts_with("extern \"C\" __global__ void ") && !line.contains("NAME") {
                line.strip_prefix("extern \"C\" __global__ void ")
            } else {
                None
            };
            if let Some(rest) = rest {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                // Skip the macro definitions themselves (`#define HR_CAST_KERNEL(NAME, ...`).
                if name != "NAME" && !name.is_empty() {
                    names.push(name);
                }
            }
        }
        names
    }

    #[test]
    fn registry_matches_the_sources_exactly() {
        for k in ALL {
            let mut declared = declared_entry_points(k.source);
            let mut listed: Vec<String> = k.functions.iter().map(|s| s.to_string()).collect();
            declared.sort();
            listed.sort();
            assert_eq!(declared, listed, "module {}", k.name);
        }
    }

    #[test]
    fn names_are_unique_and_findable() {
        let mut modules = HashSet::new();
        let mut functions = HashSet::new();
        for k in ALL {
            assert!(modules.insert(k.name), "duplicate module {}", k.name);
            for f in k.functions {
                assert!(functions.insert(*f), "duplicate entry point {f}");
                assert_eq!(find(f).map(|m| m.name), Some(k.name));
            }
        }
        assert!(find("no_such_kernel").is_none());
        // 6 casts + 3 scales + 3 axpys + 4 sum-of-squares + 3 unscales.
        assert_eq!(functions.len(), 19);
    }

    #[test]
    fn sources_are_self_contained() {
        for k in ALL {
            assert!(k.source.starts_with(FLOAT_BITS_PRELUDE), "{}", k.name);
            assert!(
                !k.source
                    .lines()
                    .any(|l| l.trim_start().starts_with("#include")),
                "{} includes a header; the CI NVRTC ships none",
                k.name
            );
            assert!(!k.source.contains('\0'), "{} has a NUL byte", k.name);
        }
        // The Rust constant and the C macro agree.
        let define = format!("#define HR_BLOCK_THREADS {BLOCK_THREADS}");
        assert!(FLOAT_BITS_PRELUDE.contains(&define));
    }
}
