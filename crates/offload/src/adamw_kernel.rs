//! The fused AdamW update over (param, grad, m, v), one pass, with run-time ISA dispatch.
//!
//! One `#[inline(always)]` body is compiled three times: with AVX-512F + FMA, with AVX2 + FMA,
//! and for the baseline target; [`Isa::detect`] picks the widest the CPU supports, once. The
//! body performs exactly the operations of [`crate::reference`] (PyTorch's single-tensor AdamW
//! as its AVX2/AVX-512 CPU kernels compute it): a fused multiply-add (`f32::mul_add`) in the
//! first-moment lerp and in the second moment's `addcmul`, everything else a separately
//! rounded IEEE operation (correctly rounded sqrt and division). A fused multiply-add is one
//! rounding whatever the hardware, so every path gives the reference's bits; the property tests
//! and the PyTorch fixture check exactly that. The baseline build has no FMA instruction on
//! x86-64 and calls the C library's `fmaf` instead: the same bits, more slowly.
//!
//! Trade-off: `denom = sqrt(v) / bc2_sqrt + eps` and `(step_size · m) / denom` keep PyTorch's
//! two divisions instead of multiplying by reciprocals. A divide costs more than a multiply,
//! but the kernel is bound by memory (28 bytes per parameter), not arithmetic, and keeping the
//! formula keeps the bits.

use std::hint::black_box;
use std::sync::OnceLock;

use half::bf16;
use half::slice::HalfFloatSliceExt;
use headroom_tensor::cpu::kernels::{
    bf16_bits_to_f32, f32_to_bf16_bits, FloatSlice, FloatSliceMut,
};
use rayon::prelude::*;

use crate::{OffloadError, Result};

/// Parameters per parallel task. Elementwise, so any split gives the same bits.
pub(crate) const CHUNK: usize = 1 << 15;
/// Elements widened at a time for f16 gradients and narrowed for f16 working copies.
const BLOCK: usize = 1024;

/// The per-step constants of AdamW, computed as `torch.optim.AdamW` computes them: in Python
/// floats (f64), then rounded to f32 where a float tensor operation takes them as a scalar.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    /// `1 - lr · weight_decay` (decoupled weight decay, `param.mul_`).
    pub decay: f32,
    /// `1 - β1`, the weight of `exp_avg.lerp_(grad, 1 - β1)`.
    pub one_minus_beta1: f32,
    /// β2 (`exp_avg_sq.mul_(β2)`).
    pub beta2: f32,
    /// `1 - β2` (the `value` of `addcmul_`).
    pub one_minus_beta2: f32,
    /// `lr / (1 - β1^t)` (its negation is the `value` of `addcdiv_`).
    pub step_size: f32,
    /// `(1 - β2^t) ** 0.5`.
    pub bc2_sqrt: f32,
    /// ε, added outside the square root.
    pub eps: f32,
}

impl StepScalars {
    /// Constants for step `t` (1-based; 0 is treated as 1) with the given hyper-parameters.
    ///
    /// `β^t` and `x ** 0.5` are the C library's `pow`, as Python evaluates `beta1 ** step` and
    /// `bias_correction2 ** 0.5` (PyTorch keeps the step as a float; below 2^24 steps it is
    /// exact, so the values agree).
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64, t: u64) -> Self {
        let t = t.max(1) as f64;
        let bias_correction1 = 1.0 - c_pow(beta1, t);
        let bias_correction2 = 1.0 - c_pow(beta2, t);
        StepScalars {
            decay: (1.0 - lr * weight_decay) as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            step_size: (lr / bias_correction1) as f32,
            bc2_sqrt: c_pow(bias_correction2, 0.5) as f32,
            eps: eps as f32,
        }
    }

    /// True when the lerp weight `1 - β1` is below one half in magnitude: ATen's lerp then
    /// computes `start + w·(end - start)`, otherwise `end + (w - 1)·(end - start)`.
    pub fn lerp_weight_is_small(&self) -> bool {
        self.one_minus_beta1.abs() < 0.5
    }
}

/// `x ** y` as CPython computes it for floats: the C library's `pow`. The operands go through
/// `black_box` because LLVM rewrites `pow(x, 0.5)` into `sqrt(x)` and folds constant operands,
/// and glibc's `pow(x, 0.5)` differs from the correctly rounded square root for about one
/// double in a thousand.
fn c_pow(x: f64, y: f64) -> f64 {
    black_box(x).powf(black_box(y))
}

/// The instruction set the fused kernel runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// 512-bit vectors with FMA (`avx512f` and `fma`).
    Avx512,
    /// 256-bit vectors with FMA (`avx2` and `fma`).
    Avx2,
    /// Whatever the compilation target guarantees (SSE2 on x86-64); fused multiply-adds go
    /// through the C library's `fmaf` where the target has no FMA instruction.
    Baseline,
}

impl Isa {
    /// The widest instruction set this CPU supports and `HEADROOM_CPU_ISA` allows
    /// ([`headroom_tensor::isa`]), detected once.
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            [Isa::Avx512, Isa::Avx2]
                .into_iter()
                .find(|isa| isa.is_supported() && headroom_tensor::isa::allows(isa.level()))
                .unwrap_or(Isa::Baseline)
        })
    }

    /// The level of [`headroom_tensor::isa`] this path belongs to.
    pub fn level(self) -> headroom_tensor::isa::IsaLevel {
        use headroom_tensor::isa::IsaLevel;
        match self {
            Isa::Avx512 => IsaLevel::Avx512,
            Isa::Avx2 => IsaLevel::Avx2,
            Isa::Baseline => IsaLevel::Baseline,
        }
    }

    /// True when this CPU can run `self`.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Baseline => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The CPU features `self` needs, as `/proc/cpuinfo` names them.
    pub fn required_features(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512f, fma",
            Isa::Avx2 => "avx2, fma",
            Isa::Baseline => "none",
        }
    }

    /// `self` if this CPU supports it, else [`OffloadError::UnsupportedIsa`].
    pub(crate) fn checked(self) -> Result<SupportedIsa> {
        if self.is_supported() {
            Ok(SupportedIsa(self))
        } else {
            Err(OffloadError::UnsupportedIsa {
                isa: self,
                features: self.required_features(),
            })
        }
    }
}

/// An [`Isa`] this CPU was confirmed to support: the only value the `unsafe` calls into
/// `#[target_feature]` code accept, so no unchecked ISA can reach them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SupportedIsa(Isa);

impl SupportedIsa {
    /// The widest supported instruction set.
    pub(crate) fn detect() -> SupportedIsa {
        SupportedIsa(Isa::detect())
    }

    /// The instruction set.
    pub(crate) fn isa(self) -> Isa {
        self.0
    }
}

/// The update for one element, shared by every path (the reference spells the same operations
/// out with PyTorch's names). `SMALL_WEIGHT` is [`StepScalars::lerp_weight_is_small`], decided
/// once per call instead of once per element.
#[inline(always)]
fn update<const SMALL_WEIGHT: bool>(
    s: &StepScalars,
    p: &mut f32,
    g: f32,
    m: &mut f32,
    v: &mut f32,
) {
    let decayed = *p * s.decay;
    let diff = g - *m;
    let mn = if SMALL_WEIGHT {
        s.one_minus_beta1.mul_add(diff, *m)
    } else {
        (s.one_minus_beta1 - 1.0).mul_add(diff, g)
    };
    let vn = (s.one_minus_beta2 * g).mul_add(g, *v * s.beta2);
    let denom = vn.sqrt() / s.bc2_sqrt + s.eps;
    *p = decayed - (s.step_size * mn) / denom;
    *m = mn;
    *v = vn;
}

#[inline(always)]
fn loop_f32<const SMALL_WEIGHT: bool>(
    s: &StepScalars,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        update::<SMALL_WEIGHT>(s, &mut p[i], g[i], &mut m[i], &mut v[i]);
    }
}

#[inline(always)]
fn loop_bf16<const SMALL_WEIGHT: bool>(
    s: &StepScalars,
    p: &mut [f32],
    g: &[bf16],
    m: &mut [f32],
    v: &mut [f32],
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let g = bf16_bits_to_f32(g[i].to_bits());
        update::<SMALL_WEIGHT>(s, &mut p[i], g, &mut m[i], &mut v[i]);
    }
}

#[inline(always)]
fn body_f32(s: &StepScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    if s.lerp_weight_is_small() {
        loop_f32::<true>(s, p, g, m, v)
    } else {
        loop_f32::<false>(s, p, g, m, v)
    }
}

#[inline(always)]
fn body_bf16(s: &StepScalars, p: &mut [f32], g: &[bf16], m: &mut [f32], v: &mut [f32]) {
    if s.lerp_weight_is_small() {
        loop_bf16::<true>(s, p, g, m, v)
    } else {
        loop_bf16::<false>(s, p, g, m, v)
    }
}

#[inline(always)]
fn narrow_bf16_body(p: &[f32], out: &mut [bf16]) {
    for (o, p) in out.iter_mut().zip(p) {
        *o = bf16::from_bits(f32_to_bf16_bits(*p));
    }
}

macro_rules! isa_variants {
    ($name:ident, $body:ident, $g:ty) => {
        mod $name {
            use super::*;
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx2,fma")]
            pub(super) unsafe fn avx512(
                s: &StepScalars,
                p: &mut [f32],
                g: &[$g],
                m: &mut [f32],
                v: &mut [f32],
            ) {
                $body(s, p, g, m, v)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            pub(super) unsafe fn avx2(
                s: &StepScalars,
                p: &mut [f32],
                g: &[$g],
                m: &mut [f32],
                v: &mut [f32],
            ) {
                $body(s, p, g, m, v)
            }
            pub(super) fn baseline(
                s: &StepScalars,
                p: &mut [f32],
                g: &[$g],
                m: &mut [f32],
                v: &mut [f32],
            ) {
                $body(s, p, g, m, v)
            }
            pub(super) fn run(
                isa: SupportedIsa,
                s: &StepScalars,
                p: &mut [f32],
                g: &[$g],
                m: &mut [f32],
                v: &mut [f32],
            ) {
                match isa.isa() {
                    // SAFETY: a `SupportedIsa` exists only for an ISA that
                    // `Isa::is_supported` confirmed (avx512f and fma present).
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => unsafe { avx512(s, p, g, m, v) },
                    // SAFETY: as above (avx2 and fma present).
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => unsafe { avx2(s, p, g, m, v) },
                    _ => baseline(s, p, g, m, v),
                }
            }
        }
    };
}

isa_variants!(grad_f32, body_f32, f32);
isa_variants!(grad_bf16, body_bf16, bf16);

/// Where the optional low-precision copy of the updated parameters goes.
pub type WorkingCopy<'a> = FloatSliceMut<'a>;

/// One fused AdamW update of a whole parameter: `param`, `m`, `v` in f32, `grad` in f32, bf16 or
/// f16, optionally writing the updated parameter to `copy` in its precision in the same pass.
/// Threaded over fixed chunks; the bits do not depend on the thread count.
///
/// Errors: [`OffloadError::UnsupportedIsa`] when this CPU cannot run `isa` (nothing falls back
/// silently: ask [`Isa::is_supported`] or use [`Isa::detect`]), and
/// [`OffloadError::LengthMismatch`] when `grad`, `m`, `v` or `copy` is not as long as `param`.
/// Nothing is written when either is returned.
pub fn fused_step(
    isa: Isa,
    s: &StepScalars,
    param: &mut [f32],
    grad: FloatSlice<'_>,
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<WorkingCopy<'_>>,
) -> Result<()> {
    let isa = isa.checked()?;
    let n = param.len();
    let lengths = [
        ("grad", grad.len()),
        ("m", m.len()),
        ("v", v.len()),
        ("working copy", copy.as_ref().map_or(n, |c| c.len())),
    ];
    for (what, got) in lengths {
        if got != n {
            return Err(OffloadError::LengthMismatch {
                what,
                expected: n,
                got,
            });
        }
    }
    fused_step_unchecked(isa, s, param, grad, m, v, copy);
    Ok(())
}

/// [`fused_step`] with the ISA checked and every length equal to `param.len()`.
pub(crate) fn fused_step_unchecked(
    isa: SupportedIsa,
    s: &StepScalars,
    param: &mut [f32],
    grad: FloatSlice<'_>,
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<WorkingCopy<'_>>,
) {
    let chunk = |p: &mut [f32],
                 g: FloatSlice<'_>,
                 m: &mut [f32],
                 v: &mut [f32],
                 c: Option<WorkingCopy<'_>>| { step_serial(isa, s, p, g, m, v, c) };
    let n = param.len();
    if n <= CHUNK {
        chunk(param, grad, m, v, copy);
        return;
    }
    let grads = split_float(grad, CHUNK);
    let copies: Vec<Option<WorkingCopy<'_>>> = match copy {
        None => (0..n.div_ceil(CHUNK)).map(|_| None).collect(),
        Some(c) => split_float_mut(c, CHUNK).into_iter().map(Some).collect(),
    };
    param
        .par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(grads.into_par_iter())
        .zip(copies.into_par_iter())
        .for_each(|((((p, m), v), g), c)| chunk(p, g, m, v, c));
}

pub(crate) fn split_float(x: FloatSlice<'_>, size: usize) -> Vec<FloatSlice<'_>> {
    match x {
        FloatSlice::F32(x) => x.chunks(size).map(FloatSlice::F32).collect(),
        FloatSlice::F16(x) => x.chunks(size).map(FloatSlice::F16).collect(),
        FloatSlice::BF16(x) => x.chunks(size).map(FloatSlice::BF16).collect(),
    }
}

pub(crate) fn split_float_mut(x: FloatSliceMut<'_>, size: usize) -> Vec<FloatSliceMut<'_>> {
    match x {
        FloatSliceMut::F32(x) => x.chunks_mut(size).map(FloatSliceMut::F32).collect(),
        FloatSliceMut::F16(x) => x.chunks_mut(size).map(FloatSliceMut::F16).collect(),
        FloatSliceMut::BF16(x) => x.chunks_mut(size).map(FloatSliceMut::BF16).collect(),
    }
}

/// The update of one contiguous piece on the calling thread; the copy is narrowed right after
/// its piece is updated, while that piece is still in cache. Every slice must be as long as `p`.
pub(crate) fn step_serial(
    isa: SupportedIsa,
    s: &StepScalars,
    p: &mut [f32],
    g: FloatSlice<'_>,
    m: &mut [f32],
    v: &mut [f32],
    c: Option<WorkingCopy<'_>>,
) {
    match g {
        FloatSlice::F32(g) => grad_f32::run(isa, s, p, g, m, v),
        FloatSlice::BF16(g) => grad_bf16::run(isa, s, p, g, m, v),
        FloatSlice::F16(g) => {
            let mut buf = [0f32; BLOCK];
            for (b, ((p, m), v)) in g.chunks(BLOCK).zip(
                p.chunks_mut(BLOCK)
                    .zip(m.chunks_mut(BLOCK))
                    .zip(v.chunks_mut(BLOCK)),
            ) {
                let w = &mut buf[..b.len()];
                b.convert_to_f32_slice(w);
                grad_f32::run(isa, s, p, w, m, v);
            }
        }
    }
    write_copy(p, c);
}

/// Writes the updated `p` to the working copy `c` (if any) in its precision.
#[inline]
pub(crate) fn write_copy(p: &[f32], c: Option<WorkingCopy<'_>>) {
    match c {
        None => {}
        Some(FloatSliceMut::F32(c)) => c.copy_from_slice(p),
        Some(FloatSliceMut::BF16(c)) => narrow_bf16_body(p, c),
        Some(FloatSliceMut::F16(c)) => c.convert_from_f32_slice(p),
    }
}

#[cfg(test)]
mod cap_tests {
    use super::Isa;

    /// `HEADROOM_CPU_ISA` reaches [`Isa::detect`]: this test binary re-run under each cap, on
    /// the ignored probe below (the choice is made once per process).
    #[test]
    fn the_cpu_isa_cap_bounds_detect() {
        for (cap, most) in [
            ("baseline", Isa::Baseline),
            ("avx2", Isa::Avx2),
            ("native", Isa::Avx512),
        ] {
            let probe = "adamw_kernel::cap_tests::probe_detect";
            let text = headroom_tensor::isa::rerun_test_with_cap(probe, cap).unwrap();
            let want = [most, Isa::Avx2, Isa::Baseline]
                .into_iter()
                .filter(|isa| isa.level() <= most.level())
                .find(|isa| isa.is_supported())
                .unwrap_or(Isa::Baseline);
            assert!(
                text.lines().any(|l| l == format!("detect={want:?}")),
                "{cap}: want {want:?} in {text}"
            );
        }
    }

    #[test]
    #[ignore = "run by the_cpu_isa_cap_bounds_detect"]
    fn probe_detect() {
        println!("detect={:?}", Isa::detect());
    }
}
