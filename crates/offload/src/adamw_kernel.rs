//! The fused AdamW update over (param, grad, m, v), one pass, with run-time ISA dispatch.
//!
//! One `#[inline(always)]` body is compiled three times: with AVX-512F, with AVX2, and for the
//! baseline target; [`Isa::detect`] picks the widest the CPU supports, once. The body uses no
//! fused multiply-add and only IEEE-exact operations (sqrt and division are correctly rounded in
//! every ISA), so all three paths produce the same bits as the scalar reference in
//! [`crate::reference`] — the property tests check exactly that.
//!
//! Trade-off: `denom = sqrt(v) / bc2_sqrt + eps` keeps PyTorch's division instead of multiplying
//! by a precomputed reciprocal. A divide costs more than a multiply, but the kernel is bound by
//! memory (28 bytes per parameter), not arithmetic, and keeping the formula keeps the bits.

use std::sync::OnceLock;

use half::bf16;
use half::slice::HalfFloatSliceExt;
use headroom_tensor::cpu::kernels::{
    bf16_bits_to_f32, f32_to_bf16_bits, FloatSlice, FloatSliceMut,
};
use rayon::prelude::*;

/// Parameters per parallel task. Elementwise, so any split gives the same bits.
pub(crate) const CHUNK: usize = 1 << 15;
/// Elements widened at a time for f16 gradients and narrowed for f16 working copies.
const BLOCK: usize = 1024;

/// The per-step constants of AdamW, computed once per parameter update in f64 and rounded to
/// f32, as PyTorch's fused kernel does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    /// `1 - lr · weight_decay` (decoupled weight decay).
    pub decay: f32,
    /// `1 - β1`, the weight of the gradient in the first-moment lerp.
    pub one_minus_beta1: f32,
    /// β2.
    pub beta2: f32,
    /// `1 - β2`.
    pub one_minus_beta2: f32,
    /// `lr / (1 - β1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - β2^t)`.
    pub bc2_sqrt: f32,
    /// ε, added outside the square root.
    pub eps: f32,
}

impl StepScalars {
    /// Constants for step `t` (1-based) with the given hyper-parameters.
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64, t: u64) -> Self {
        let t = t.max(1) as i32;
        let bc1 = 1.0 - beta1.powi(t);
        let bc2 = 1.0 - beta2.powi(t);
        StepScalars {
            decay: (1.0 - lr * weight_decay) as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            step_size: (lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: eps as f32,
        }
    }
}

/// The instruction set the fused kernel runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// 512-bit vectors.
    Avx512,
    /// 256-bit vectors.
    Avx2,
    /// Whatever the compilation target guarantees (SSE2 on x86-64).
    Baseline,
}

impl Isa {
    /// The widest instruction set this CPU supports, detected once.
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx512f") {
                    return Isa::Avx512;
                }
                if std::is_x86_feature_detected!("avx2") {
                    return Isa::Avx2;
                }
            }
            Isa::Baseline
        })
    }

    /// True when this CPU can run `self`.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Baseline => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => std::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// The update for one element, shared by every path (and mirrored by the reference).
#[inline(always)]
fn update(s: &StepScalars, p: &mut f32, g: f32, m: &mut f32, v: &mut f32) {
    let pd = *p * s.decay;
    let mn = *m + s.one_minus_beta1 * (g - *m);
    let vn = *v * s.beta2 + (s.one_minus_beta2 * g) * g;
    let denom = vn.sqrt() / s.bc2_sqrt + s.eps;
    *p = pd - s.step_size * (mn / denom);
    *m = mn;
    *v = vn;
}

#[inline(always)]
fn body_f32(s: &StepScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        update(s, &mut p[i], g[i], &mut m[i], &mut v[i]);
    }
}

#[inline(always)]
fn body_bf16(s: &StepScalars, p: &mut [f32], g: &[bf16], m: &mut [f32], v: &mut [f32]) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        update(
            s,
            &mut p[i],
            bf16_bits_to_f32(g[i].to_bits()),
            &mut m[i],
            &mut v[i],
        );
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
            #[target_feature(enable = "avx512f")]
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
            #[target_feature(enable = "avx2")]
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
                isa: Isa,
                s: &StepScalars,
                p: &mut [f32],
                g: &[$g],
                m: &mut [f32],
                v: &mut [f32],
            ) {
                match isa {
                    // SAFETY: `fused_step` only passes an ISA that `Isa::is_supported` confirmed.
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => unsafe { avx512(s, p, g, m, v) },
                    // SAFETY: as above.
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
/// All lengths must already be equal (the optimizer checks). Threaded over fixed chunks.
pub fn fused_step(
    isa: Isa,
    s: &StepScalars,
    param: &mut [f32],
    grad: FloatSlice<'_>,
    m: &mut [f32],
    v: &mut [f32],
    copy: Option<WorkingCopy<'_>>,
) {
    let isa = if isa.is_supported() {
        isa
    } else {
        Isa::Baseline
    };
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
/// its piece is updated, while that piece is still in cache. `isa` must be supported.
pub(crate) fn step_serial(
    isa: Isa,
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
    match c {
        None => {}
        Some(FloatSliceMut::F32(c)) => c.copy_from_slice(p),
        Some(FloatSliceMut::BF16(c)) => narrow_bf16_body(p, c),
        Some(FloatSliceMut::F16(c)) => c.convert_from_f32_slice(p),
    }
}
