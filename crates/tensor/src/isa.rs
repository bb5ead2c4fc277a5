//! Which of headroom's own SIMD paths may run: what the CPU has, capped by the
//! `HEADROOM_CPU_ISA` environment variable.
//!
//! Every kernel in the workspace that is compiled for several instruction sets (the fused
//! AdamW, the 4-bit dequantization, the softmax rows of attention, the cross-entropy rows,
//! stochastic rounding, the bf16 widening, decoding's row dot products, the AMX bf16 GEMM)
//! asks [`allows`] before it takes a path above the baseline. Setting
//! `HEADROOM_CPU_ISA=baseline` (or `avx2`, `avx512`) therefore runs the portable (or AVX2) code
//! on a machine that has more, the way PyTorch's `ATEN_CPU_CAPABILITY` and oneDNN's
//! `ONEDNN_MAX_CPU_ISA` do: to test a fallback end to end where it would never be chosen, to
//! compare with a machine that lacks the wider vectors, or to rule a kernel out while
//! debugging. Unset, or `native`, caps nothing.
//!
//! The cap is read once per process. It reaches only headroom's kernels: the `gemm` crate's
//! f32 products choose their own micro-kernels from the CPU (and so do the tests that predict
//! them), so a capped run on an AVX-512 machine is not an AVX2 machine's run;
//! `scripts/avx2-emulation.sh` also builds gemm without its AVX-512 kernels for that.
//!
//! ```
//! use headroom_tensor::isa::{self, IsaLevel};
//!
//! assert_eq!(IsaLevel::parse("avx2"), Some(IsaLevel::Avx2));
//! assert!(IsaLevel::Baseline < IsaLevel::Avx2 && IsaLevel::Avx512 < IsaLevel::Amx);
//! // The baseline is always allowed; what runs is never above what the CPU has.
//! assert!(isa::allows(IsaLevel::Baseline));
//! assert!(isa::active() <= isa::detected());
//! ```

use std::sync::OnceLock;

/// The environment variable that caps the instruction set of headroom's kernels.
pub const ENV: &str = "HEADROOM_CPU_ISA";

/// An instruction-set level headroom's kernels are built for, lowest first. Each level
/// includes the ones below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IsaLevel {
    /// What the compilation target guarantees (SSE2 on x86-64): the portable reference code.
    Baseline,
    /// 256-bit vectors with FMA (`avx2`, `fma`; x86-64-v3).
    Avx2,
    /// 512-bit vectors (`avx512f`, `avx512dq`, `avx512bw`, `avx512vl`; x86-64-v4).
    Avx512,
    /// Intel AMX tiles with bf16 products (`amx_tile`, `amx_bf16`), granted by the kernel.
    Amx,
}

impl IsaLevel {
    /// Every level, lowest first.
    pub const ALL: [IsaLevel; 4] = [
        IsaLevel::Baseline,
        IsaLevel::Avx2,
        IsaLevel::Avx512,
        IsaLevel::Amx,
    ];

    /// The name `HEADROOM_CPU_ISA` takes for this level.
    pub fn name(self) -> &'static str {
        match self {
            IsaLevel::Baseline => "baseline",
            IsaLevel::Avx2 => "avx2",
            IsaLevel::Avx512 => "avx512",
            IsaLevel::Amx => "amx",
        }
    }

    /// The level a `HEADROOM_CPU_ISA` value names (case and surrounding blanks ignored);
    /// `native` names the top level, which caps nothing.
    pub fn parse(value: &str) -> Option<IsaLevel> {
        let value = value.trim().to_ascii_lowercase();
        if value == "native" {
            return Some(IsaLevel::Amx);
        }
        IsaLevel::ALL.into_iter().find(|l| l.name() == value)
    }
}

impl std::fmt::Display for IsaLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A `HEADROOM_CPU_ISA` value that names no level.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{ENV}={value:?} names no instruction set: expected one of baseline, avx2, avx512, amx, native"
)]
pub struct UnknownIsa {
    /// The value as it was set.
    pub value: String,
}

/// The cap `HEADROOM_CPU_ISA` sets in this process: `Ok(None)` when it is unset, empty or
/// `native`; an error when it names nothing (the command line refuses to start then, rather
/// than run a path the user did not ask for).
pub fn env_cap() -> Result<Option<IsaLevel>, UnknownIsa> {
    let Some(raw) = std::env::var_os(ENV) else {
        return Ok(None);
    };
    let value = raw.to_string_lossy().into_owned();
    if value.trim().is_empty() {
        return Ok(None);
    }
    match IsaLevel::parse(&value) {
        Some(IsaLevel::Amx) => Ok(None),
        Some(level) => Ok(Some(level)),
        None => Err(UnknownIsa { value }),
    }
}

/// The highest level headroom's kernels may use in this process: the cap, read once. A value
/// that names no level caps nothing here; [`env_cap`] reports it.
pub fn cap() -> IsaLevel {
    static CAP: OnceLock<IsaLevel> = OnceLock::new();
    *CAP.get_or_init(|| env_cap().ok().flatten().unwrap_or(IsaLevel::Amx))
}

/// Whether a kernel may take its `level` path: the cap allows it. The caller still checks
/// that the CPU has the features its path is compiled for.
#[inline]
pub fn allows(level: IsaLevel) -> bool {
    level <= cap()
}

/// The highest level this CPU supports, whatever the cap, detected once.
pub fn detected() -> IsaLevel {
    static LEVEL: OnceLock<IsaLevel> = OnceLock::new();
    *LEVEL.get_or_init(detect)
}

/// The level headroom's kernels run at here: [`detected`] capped by [`cap`].
pub fn active() -> IsaLevel {
    detected().min(cap())
}

/// One line for reports: the active level, and the cap when it lowered it
/// (`"avx2 (HEADROOM_CPU_ISA caps avx512)"`).
pub fn describe() -> String {
    let (have, run) = (detected(), active());
    if run < have {
        format!("{run} ({ENV} caps {have})")
    } else {
        run.to_string()
    }
}

/// Test support for code whose choice is made once per process: runs the test `test` (its
/// full path, e.g. `dequant::cap_tests::probe`) of the current test binary in a fresh process
/// with `HEADROOM_CPU_ISA=cap`, ignored tests included, and returns its standard output, or
/// that output and its standard error when it could not start or failed.
#[doc(hidden)]
pub fn rerun_test_with_cap(test: &str, cap: &str) -> Result<String, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = std::process::Command::new(exe)
        .args(["--exact", test, "--ignored", "--nocapture"])
        .env(ENV, cap)
        .output()
        .map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
    }
}

/// The CPU's `model name` from `/proc/cpuinfo`, where there is one: what reports name the
/// machine by.
pub fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split_once(':')?.1.trim().to_string())
}

fn detect() -> IsaLevel {
    match detect_vectors() {
        IsaLevel::Avx512 if amx_granted() => IsaLevel::Amx,
        level => level,
    }
}

/// The widest vectors this CPU has: [`IsaLevel::Avx512`] at most, without asking the kernel
/// for AMX's tile state.
#[cfg(target_arch = "x86_64")]
fn detect_vectors() -> IsaLevel {
    use std::arch::is_x86_feature_detected as has;
    if !(has!("avx2") && has!("fma")) {
        return IsaLevel::Baseline;
    }
    if !(has!("avx512f") && has!("avx512dq") && has!("avx512bw") && has!("avx512vl")) {
        return IsaLevel::Avx2;
    }
    IsaLevel::Avx512
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_vectors() -> IsaLevel {
    IsaLevel::Baseline
}

/// The vector level [`multiversion!`](crate::multiversion) kernels run at: the CPU's widest vectors
/// (AVX-512 at most) capped by [`cap`]. Unlike [`active`] it never asks the kernel for AMX's
/// tile state, so a cast or a GELU does not change what the process is permitted.
pub fn vector_level() -> IsaLevel {
    static LEVEL: OnceLock<IsaLevel> = OnceLock::new();
    (*LEVEL.get_or_init(detect_vectors)).min(cap())
}

/// AMX-TILE and AMX-BF16 in CPUID leaf 7 (EDX bits 24 and 22), and the kernel's permission
/// for this process to use the tile data state (`arch_prctl ARCH_REQ_XCOMP_PERM`, which fails
/// where the OS or hypervisor does not enable it). Asked once per process.
pub fn amx_granted() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(request_amx)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_amx() -> bool {
    // Leaf 7 only where leaf 0 reports it.
    let max_leaf = std::arch::x86_64::__cpuid(0).eax;
    if max_leaf < 7 {
        return false;
    }
    let edx7 = std::arch::x86_64::__cpuid_count(7, 0).edx;
    if edx7 & (1 << 24) == 0 || edx7 & (1 << 22) == 0 {
        return false;
    }
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: the arch_prctl system call with these arguments only changes this process's
    // permitted extended state; it reads and writes no user memory.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_amx() -> bool {
    false
}

/// Defines `$vis fn $name(args) -> ret` that runs `$body` (an `#[inline(always)]` function of
/// the same arguments, in scope where the macro is called) compiled for the widest level
/// [`vector_level`] allows: AVX-512 (with AVX2 and FMA), AVX2 with FMA, or the baseline.
///
/// The three copies are one source, so a body of element-wise f32 arithmetic gives the same
/// bits on every path: Rust never contracts `a·b + c` into a fused multiply-add, and
/// vectorising a loop without a reduction reorders nothing. A body that reduces must fix its
/// order of additions itself (partial sums in lanes), and calls `mul_add` only where it wants
/// the fused result on every path.
///
/// ```
/// #[inline(always)]
/// fn double_body(x: &mut [f32]) {
///     x.iter_mut().for_each(|v| *v *= 2.0);
/// }
/// headroom_tensor::multiversion!(
///     /// Doubles every value, on the widest vectors allowed here.
///     fn double => double_body(x: &mut [f32]) -> ()
/// );
/// let mut x = [1.0f32, -3.5, 0.25];
/// double(&mut x);
/// assert_eq!(x, [2.0, -7.0, 0.5]);
/// ```
#[macro_export]
macro_rules! multiversion {
    ($(#[$doc:meta])* $vis:vis fn $name:ident => $body:ident ($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty) => {
        $(#[$doc])*
        #[inline]
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                match $crate::isa::vector_level() {
                    $crate::isa::IsaLevel::Avx512 | $crate::isa::IsaLevel::Amx => {
                        // SAFETY: `vector_level` never exceeds what detection found: AVX-512F,
                        // DQ, BW and VL (with AVX2 and FMA) on this CPU for these levels.
                        return unsafe { avx512($($arg),*) };
                    }
                    $crate::isa::IsaLevel::Avx2 => {
                        // SAFETY: as above; this level means AVX2 and FMA were detected.
                        return unsafe { avx2($($arg),*) };
                    }
                    $crate::isa::IsaLevel::Baseline => {}
                }
            }
            $body($($arg),*)
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_native_is_the_top() {
        for level in IsaLevel::ALL {
            assert_eq!(IsaLevel::parse(level.name()), Some(level));
            assert_eq!(
                IsaLevel::parse(&format!(" {} ", level.name().to_uppercase())),
                Some(level)
            );
        }
        assert_eq!(IsaLevel::parse("native"), Some(IsaLevel::Amx));
        assert_eq!(IsaLevel::parse("sse2"), None);
        assert_eq!(IsaLevel::parse(""), None);
    }

    #[test]
    fn levels_are_ordered_lowest_first() {
        let mut sorted = IsaLevel::ALL;
        sorted.sort();
        assert_eq!(sorted, IsaLevel::ALL);
    }

    #[test]
    fn what_runs_is_within_both_the_cpu_and_the_cap() {
        assert_eq!(active(), detected().min(cap()));
        // The vector level is the active one without AMX, found without asking for it.
        assert_eq!(vector_level(), active().min(IsaLevel::Avx512));
        assert!(allows(IsaLevel::Baseline));
        assert_eq!(allows(IsaLevel::Amx), cap() == IsaLevel::Amx);
        #[cfg(target_arch = "x86_64")]
        if detected() >= IsaLevel::Avx2 {
            assert!(std::arch::is_x86_feature_detected!("avx2"));
        }
    }

    #[test]
    fn an_unknown_value_is_a_typed_error_naming_it() {
        let e = UnknownIsa {
            value: "avx1024".into(),
        };
        let text = e.to_string();
        assert!(
            text.contains("HEADROOM_CPU_ISA") && text.contains("avx1024"),
            "{text}"
        );
    }

    /// The cap as a fresh process sees it: this test binary re-run with the variable set, on
    /// the ignored probe below.
    #[test]
    fn the_environment_sets_the_cap_in_a_fresh_process() {
        for (value, want) in [
            ("baseline", "cap=baseline"),
            ("AVX2", "cap=avx2"),
            ("native", "cap=amx"),
            ("bogus", "cap=amx err"),
        ] {
            let text = rerun_test_with_cap("isa::tests::probe_cap", value).unwrap();
            let line = text.lines().find(|l| l.starts_with("cap=")).unwrap_or("");
            assert_eq!(line.trim(), want, "{value}: {text}");
        }
    }

    #[test]
    #[ignore = "run by the_environment_sets_the_cap_in_a_fresh_process"]
    fn probe_cap() {
        let err = if env_cap().is_err() { " err" } else { "" };
        println!("cap={}{err}", cap());
        assert!(active() <= cap());
    }
}
