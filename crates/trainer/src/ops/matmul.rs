//! Linear layers as llm.c lays them out: `out[N, OC] = inp[N, C] · W[OC, C]ᵀ + b[OC]`, and the
//! backward products, on the `gemm` crate (no system BLAS).
//!
//! Every output element's reduction over the inner dimension runs in one fixed order whatever
//! the thread count (gemm splits work over output rows and columns, never over the inner
//! dimension), so gradients are reproducible bit for bit; the bias gradient is a plain ordered
//! loop for the same reason.
//!
//! # Low-precision weights
//!
//! [`forward_with`] and [`backward_with`] take the weight in any [`Operand`] type: f32, bf16 or
//! f16. A bf16/f16 weight is widened to f32 a *panel* at a time (a slab of whole output
//! columns, at most [`PANEL_BYTES`] unless one minimum-width panel is larger) into a scratch
//! buffer the caller owns, and each panel goes through the same f32 gemm as a full f32 weight
//! would. Numerics, written down because the trainer's loss trace depends on them:
//!
//! - Widening bf16/f16 → f32 is exact, so each product is the product of the rounded values
//!   the run stores; accumulation is f32 with fused multiply-adds, as in the f32 path.
//! - Splitting the output columns into panels does not change any output element's reduction:
//!   gemm's depth blocking (`kc`) is a function of `k` and the cache sizes only, once neither
//!   output dimension is tiny (gemm's small-matrix and matrix-vector paths block differently).
//!   Panels are therefore at least [`PANEL_MIN`] columns wide, and a product with at most
//!   [`SINGLE_PANEL_ROWS`] rows takes the whole weight as one panel — the input gradient's.
//!   A *forward* product of so few rows of a low-precision weight, and one of at most
//!   [`DOT_ROWS_BATCHED`] rows of any weight in a decoding step ([`DecodingProducts`]), is
//!   row dot products instead (`forward_dot_rows`): not gemm's bits, but each weight row is
//!   read once for all the rows and never copied, where gemm would pack the whole weight for
//!   a handful of rows. An f32 and a bf16 weight of the same values give the same bits there.
//! - A deep product is also cut along its depth, exactly where gemm cuts it: gemm sums each
//!   depth block in registers from zero and adds it to the output, so one gemm call per block
//!   (accumulating from the second) performs the same additions in the same order. The block
//!   length depends on the CPU's micro-kernel and L1 cache, so it is taken from gemm's own
//!   `kernel_params` and *checked once at run time* (a product cut there must give the uncut
//!   call's bits, and one cut elsewhere must not); where the check fails or the kernel is not
//!   one this module knows, panels span the whole depth as before. The cut lets a panel hold
//!   more columns in the same scratch, so the activation operand is packed once per depth block
//!   instead of once per narrow panel: the head's input gradient (depth = the vocabulary) went
//!   from four 96-column strips of the whole 50257-deep weight (19.3 MB of scratch, the
//!   `[rows, 50257]` logits gradient packed four times) to one 384-column panel per ~500-deep
//!   block (0.8 MB).
//! - So the result is *bit for bit* the f32 GEMM's on the widened weight (tested below), and
//!   a bf16 run's losses are those of the f32 views it replaces. Against an f64 product of the
//!   same bf16-rounded inputs the error is the f32 GEMM's: `|err| ≤ γ_k Σ|a·b|` with
//!   `γ_k ≈ k·2⁻²⁴` (the test checks `k·2⁻²³ · Σ|a·b| + 1e-30`).
//! - Why a separate widening pass and not inside the packing: the packing is gemm's and not
//!   ours to extend, and an own kernel with its own blocking would change the summation order
//!   (and the committed bf16 loss trace). So each panel is widened into an L2/L3-sized buffer
//!   just before gemm packs it. That is why bf16 products on AMX tiles
//!   ([`forward_bf16_products`], [`super::bf16_gemm`]) are a separate path with their own
//!   numerics, taken where [`bf16_products`] says so. There is no AVX512-BF16 (`vdpbf16ps`)
//!   path: on the AMX machine measured it retires 0.6 of the f32 FMA's multiply-adds per cycle.
//! - What it costs: one extra pass over the weight per call (widen, then gemm packs it), i.e.
//!   `O(k·n)` work next to the GEMM's `O(m·k·n)` — negligible at thousands of rows, but a
//!   fused loss calls the head once per 128-row chunk and so widens the 50257-row embedding
//!   twice per chunk where the old f32 view was made once per step; and the activation
//!   operand is re-read once per panel. Memory: the scratch of [`forward_scratch`] /
//!   [`backward_scratch`] elements instead of a whole f32 copy of the weight. Where the depth
//!   cut applies, the scratch depends on gemm's block length, i.e. on the CPU (the estimator
//!   calls the same functions, so its figures follow); products of depth ≤ 512 are never cut.
//!   Measured on AVX2 (`benches/results/2026-11-24-cpu-2core-bf16-depth-cut.md`): the head's
//!   input-gradient product went from 0.84 to 1.00 of the f32 GEMM's throughput.
//! - A bf16 *output* (the head's logits under bf16) and a bf16 *output gradient* take the same
//!   cuts: [`forward_with_into_bf16`] rounds the f32 product a strip of columns at a time, and
//!   [`backward_with_bf16_grad`] widens the gradient one depth block at a time, so both keep
//!   the f32 GEMM's bits on the widened values (the gradient's rounding to bf16 is the
//!   caller's, as in torch's bf16 `matmul`).

use std::ops::Range;

use gemm::Parallelism;
use half::{bf16, f16};
#[cfg(target_arch = "x86_64")]
use headroom_tensor::isa::{self, IsaLevel};

use super::strided::Strided;

fn parallelism() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// `dst[m, n] (+)= lhs[m, k] · rhs[k, n]`, `dst` dense row-major; accumulates when
/// `accumulate`, overwrites otherwise.
fn gemm_into(
    dst: &mut [f32],
    lhs: Strided<'_, f32>,
    rhs: Strided<'_, f32>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    debug_assert_eq!(dst.len(), m * n);
    gemm_rows_into(parallelism(), dst, n, lhs, rhs, m, n, k, accumulate);
}

/// [`gemm_into`] with `dst` row-major at row stride `dst_stride` ≥ `n` (a column slab of a
/// wider matrix, starting at `dst[0]`), on `parallelism`'s threads. The only place this
/// module calls into gemm.
#[allow(clippy::too_many_arguments)]
fn gemm_rows_into(
    parallelism: Parallelism,
    dst: &mut [f32],
    dst_stride: usize,
    lhs: Strided<'_, f32>,
    rhs: Strided<'_, f32>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    debug_assert!(m == 0 || n == 0 || dst.len() >= (m - 1) * dst_stride + n);
    debug_assert!(
        m == 0 || k == 0 || lhs.data.len() > (m - 1) * lhs.row_stride + (k - 1) * lhs.col_stride
    );
    debug_assert!(
        k == 0 || n == 0 || rhs.data.len() > (k - 1) * rhs.row_stride + (n - 1) * rhs.col_stride
    );
    // SAFETY: the callers pass matrices (and a `dst` row stride) whose strided extents lie
    // inside their slices (checked in debug builds above), and `dst` is a distinct mutable
    // borrow, so nothing aliases it.
    unsafe {
        // gemm computes dst := alpha·dst + beta·lhs·rhs (alpha read only when read_dst).
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_stride as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `out = inp · Wᵀ (+ bias)`; `inp` is `[n, c]`, `weight` `[oc, c]`, `out` `[n, oc]`.
pub fn forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    forward_with(out, inp, weight, bias, n, c, oc, &mut []);
}

/// Accumulate the gradients of [`forward`]: `dinp += dout · W`, `dweight += doutᵀ · inp`,
/// `dbias += Σ_rows dout`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    oc: usize,
) {
    backward_with(
        dinp,
        Some(dweight),
        dbias,
        dout,
        inp,
        weight,
        n,
        c,
        oc,
        &mut [],
    );
}

/// A storage type a GEMM operand may have, read as f32 (exactly: every bf16 and f16 value is
/// an f32 value).
pub trait Operand: Copy + Send + Sync + 'static {
    /// The slice itself when it already is f32 (no widening, no scratch).
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// One value as f32.
    fn to_f32(self) -> f32;
    /// `dst[i] = src[i]` as f32; equal lengths.
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Columns `col0..col0 + width` of the rows of `src` (row stride `stride`), as the dense
    /// `[dst.len() / width, width]` matrix `dst`.
    fn widen_strip(src: &[Self], stride: usize, col0: usize, width: usize, dst: &mut [f32]) {
        for (r, d) in dst.chunks_exact_mut(width).enumerate() {
            Self::widen(&src[r * stride + col0..][..width], d);
        }
    }
}

impl Operand for f32 {
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Operand for bf16 {
    fn as_f32(_: &[bf16]) -> Option<&[f32]> {
        None
    }
    fn to_f32(self) -> f32 {
        bf16_to_f32(self.to_bits())
    }
    fn widen(src: &[bf16], dst: &mut [f32]) {
        widen_bf16(src, dst);
    }
    fn widen_strip(src: &[bf16], stride: usize, col0: usize, width: usize, dst: &mut [f32]) {
        // The plain loop (which LLVM vectorises): on the head's ~100-value strips it measured
        // 2× faster than calling the AVX2 body per strip (Zen 3: 30 vs 57 ms for a 50257×96
        // strip set), and equal on wide ones.
        let rows = dst.len() / width.max(1);
        for (r, d) in dst.chunks_exact_mut(width).enumerate() {
            if r + PREFETCH_ROWS < rows {
                prefetch_run(&src[(r + PREFETCH_ROWS) * stride + col0..][..width]);
            }
            widen_bf16_portable(&src[r * stride + col0..][..width], d);
        }
    }
}

/// Rows ahead that [`Operand::widen_strip`] asks the cache for: a strip of a large matrix is a
/// short run per row at a stride of a whole row (the head's bf16 logits gradient: ~1 KiB per
/// 100 KiB row), which the hardware prefetchers do not follow across rows.
const PREFETCH_ROWS: usize = 4;

/// Ask for the cache lines of `run` ahead of use (a hint; no effect on results).
#[inline(always)]
fn prefetch_run<T>(run: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(run);
        let base = run.as_ptr().cast::<i8>();
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch does not access memory architecturally; the address lies
            // inside `run`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = run;
}

impl Operand for f16 {
    fn as_f32(_: &[f16]) -> Option<&[f32]> {
        None
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn widen(src: &[f16], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        // half picks F16C at run time where the CPU has it.
        src.convert_to_f32_slice(dst);
    }
}

/// bf16 is the top half of an f32: a shift, with no rounding and NaN payloads kept (the
/// tensor crate's cast gives the same bits, so a widened panel equals the old f32 view).
#[inline]
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `dst = src` widened, on the widest path the CPU has (the tensor crate's kernel, compiled
/// per ISA).
pub fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_bf16: lengths differ");
    headroom_tensor::cpu::kernels::widen_bf16(src, dst);
}

/// The reference the SIMD paths are tested against.
pub fn widen_bf16_portable(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16_to_f32(s.to_bits());
    }
}

/// The widened-panel budget: big enough that gemm sees wide panels (few passes over the
/// activation operand), small next to the weights (the head's f32 view was 73.6 MiB).
pub const PANEL_BYTES: usize = 2 << 20;
/// The narrowest panel (unless the whole operand is narrower): above 64 columns gemm never
/// takes its small-matrix path, whose depth blocking differs (see the module notes).
pub const PANEL_MIN: usize = 80;
/// At most this many rows, the whole weight is one panel: with fewer than 4 rows a
/// `PANEL_MIN`-wide panel could reach gemm's matrix-vector or tiny-matrix paths.
pub const SINGLE_PANEL_ROWS: usize = 3;

/// How a low-precision product is cut into calls of gemm: depth blocks of at most `depth`
/// (gemm's own depth blocks, so the cut does not change any sum — see [`gemm_depth_block`]) by
/// `count` column panels, the widest `widest` columns. One call widens a `depth × widest` piece
/// of the weight at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    depth: usize,
    count: usize,
    widest: usize,
}

impl Plan {
    /// Scratch elements (f32) one widened piece takes.
    fn scratch(&self) -> usize {
        self.depth * self.widest
    }
}

/// How an `m`-row product of depth `k` with `n` output columns splits. Panels are `n / count`
/// or one more columns wide, each ≥ [`PANEL_MIN`] when there is more than one, and as wide as
/// `budget` allows for one depth block: cutting the depth where gemm does lets a panel be wider
/// (the head's input gradient, depth 50257, becomes one panel of all 384 columns instead of
/// four 96-column strips), so the activation operand is packed once instead of once per panel.
fn panel_plan(m: usize, n: usize, k: usize, budget: usize) -> Plan {
    if n == 0 {
        return Plan {
            depth: k,
            count: 0,
            widest: 0,
        };
    }
    if m <= SINGLE_PANEL_ROWS {
        return Plan {
            depth: k,
            count: 1,
            widest: n,
        };
    }
    let depth = gemm_depth_block(m, n, k).unwrap_or(k);
    let target = (budget / (4 * depth.max(1)) / 16 * 16).max(PANEL_MIN);
    let count = (n / target).max(1);
    Plan {
        depth,
        count,
        widest: n.div_ceil(count),
    }
}

/// The depth blocks' length gemm uses for an `m × n` product of depth `k` (f32), when this
/// machine's blocking is known and the product takes gemm's blocked path: `None` otherwise.
///
/// gemm reduces the depth in blocks of `kc` (from `kernel_params`: the L1 cache and the
/// micro-kernel's tile), each block's products summed in registers from zero and then added
/// to the output, so an output element is `((0 + B₀) + B₁) + …`. Calling gemm once per block,
/// accumulating from the second, performs exactly those additions — provided the blocks are
/// gemm's. Which micro-kernel gemm takes (so `kc`) depends on the CPU, hence the run-time
/// check [`gemm_f32_tile`]; small products take other gemm paths (a different block
/// length, a vector path), which the shape conditions here exclude.
fn gemm_depth_block(m: usize, n: usize, k: usize) -> Option<usize> {
    // gemm's small-matrix path (`m, n ≤ 64`) blocks the depth by 512 instead; ≤ 256 outputs
    // may take the horizontal kernels; a row or column takes the vector paths. Panels are at
    // least `PANEL_MIN` (> 64) wide when there are several, so each call's shape passes too.
    if (m <= 64 && n <= 64) || m * n <= 256 || m < 2 || n < 2 || k == 0 {
        return None;
    }
    let (mr, nr) = gemm_f32_tile()?;
    let kc = gemm_kc(k, mr, nr);
    // A last block of ≤ 2 would go through gemm's outer-product path.
    let last = k - (k.div_ceil(kc) - 1) * kc;
    (kc < k && last > 2).then_some(kc)
}

/// gemm's depth block for depth `k` and micro-kernel tile `mr × nr` (f32).
fn gemm_kc(k: usize, mr: usize, nr: usize) -> usize {
    // The block length depends only on the depth, the tile and the caches, not on `m`, `n`.
    gemm_common::cache::kernel_params(256, 256, k, mr, nr, std::mem::size_of::<f32>()).kc
}

/// The f32 micro-kernel tiles gemm may pick on this CPU, `(mr, nr)`, most likely first:
/// gemm 0.19 takes its AVX-512 kernel (4×16 rows × 6 columns) where the CPU has AVX-512F and
/// gemm was built with its `x86-v4` feature (the workspace enables it), else the FMA kernel
/// (2×8 × 6). Whether `x86-v4` is on cannot be seen from here (a build for measuring the AVX2
/// path turns it off), so both are candidates on an AVX-512 CPU and the run-time probe tells
/// which one gemm runs. This follows the CPU and the build, not `HEADROOM_CPU_ISA`: gemm
/// dispatches on its own.
fn gemm_f32_tiles() -> &'static [(usize, usize)] {
    #[cfg(target_arch = "x86_64")]
    {
        let fma = std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("avx2");
        if std::arch::is_x86_feature_detected!("avx512f") {
            return if fma { &[(64, 6), (16, 6)] } else { &[(64, 6)] };
        }
        if fma {
            return &[(16, 6)];
        }
    }
    &[]
}

/// The f32 micro-kernel tile `(mr, nr)` gemm runs on this machine: the first of the candidate
/// tiles (`gemm_f32_tiles`) whose blocks gemm is checked to use, `(64, 6)` for its AVX-512
/// kernel, `(16, 6)` for its FMA (AVX2) kernel (which a gemm built without `x86-v4` runs on an
/// AVX-512 CPU too). The check: a product cut at the blocks that tile predicts must give the
/// uncut call's bits, and a cut one element off must not (so the check can tell). `None` where
/// no tile passes (another gemm version, a CPU whose kernel this module does not know): the
/// depth cut is then off and panels span the whole depth.
pub fn gemm_f32_tile() -> Option<(usize, usize)> {
    static VERIFIED: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    *VERIFIED.get_or_init(|| {
        gemm_f32_tiles()
            .iter()
            .copied()
            .find(|&(mr, nr)| probe_depth_blocks(mr, nr))
    })
}

/// Whether cutting at gemm's blocks reproduces the uncut product (both weight layouts, with
/// and without accumulation), and cutting elsewhere does not.
fn probe_depth_blocks(mr: usize, nr: usize) -> bool {
    let (m, n) = (72, 80);
    // Three or more blocks at any block length up to 1024.
    let k = 2100;
    let kc = gemm_kc(k, mr, nr);
    if kc >= k || kc < 4 {
        return false;
    }
    // Magnitudes over 2⁻⁸…2⁸ so that any other association changes low bits.
    let lhs = super::spread_values(1, m * k, 17);
    let w = super::spread_values(2, k * n, 17);
    let start = super::spread_values(3, m * n, 17);
    let lhs_view = Strided::rows(&lhs, k);
    // On the calling thread only: this runs inside a `OnceLock` initialiser, and a rayon
    // worker waiting there could steal a task that reaches the same initialiser (a re-entrant
    // initialisation, i.e. a deadlock). Threads do not change gemm's sums, so the verdict
    // holds for threaded calls too.
    let serial =
        |out: &mut [f32], lhs: Strided<'_, f32>, rhs: Strided<'_, f32>, k: usize, acc: bool| {
            gemm_rows_into(Parallelism::None, out, n, lhs, rhs, m, n, k, acc)
        };
    let mut all_equal = true;
    let mut off_by_one_differs = true;
    for transposed in [false, true] {
        let rhs = if transposed {
            Strided::transposed(&w, k)
        } else {
            Strided::rows(&w, n)
        };
        for accumulate in [false, true] {
            let mut whole = start.clone();
            serial(&mut whole, lhs_view, rhs, k, accumulate);
            let cut = |block: usize| {
                let mut out = start.clone();
                let mut k0 = 0;
                while k0 < k {
                    let kb = block.min(k - k0);
                    serial(
                        &mut out,
                        lhs_view.skip_cols(k0),
                        rhs.skip_rows(k0),
                        kb,
                        accumulate || k0 > 0,
                    );
                    k0 += kb;
                }
                out
            };
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            all_equal &= same(&cut(kc), &whole);
            off_by_one_differs &= !same(&cut(kc - 1), &whole);
        }
    }
    all_equal && off_by_one_differs
}

/// Panel `j`'s columns: the first `n % count` panels take one column more.
fn panel_range(n: usize, count: usize, j: usize) -> Range<usize> {
    let (base, extra) = (n / count, n % count);
    let start = j * base + j.min(extra);
    start..start + base + usize::from(j < extra)
}

/// Scratch elements (f32) an `m`-row product of depth `k` with `n` low-precision weight
/// columns needs: one widened panel.
fn panel_elems(m: usize, n: usize, k: usize) -> usize {
    panel_plan(m, n, k, PANEL_BYTES).scratch()
}

/// Scratch (f32 elements) [`forward_with`] needs for a low-precision weight: `n` rows of
/// input, weight `[oc, c]`. Zero for an f32 weight. At most [`DOT_ROWS`] rows, room for the
/// input rounded to bf16 (the bf16 products' row dots read it).
pub fn forward_scratch(n: usize, c: usize, oc: usize) -> usize {
    if n <= DOT_ROWS {
        return n * c;
    }
    panel_elems(n, oc, c)
}

/// At most this many rows (a decoding step's: one per sequence), a low-precision weight's
/// forward product is row dot products (`forward_dot_rows`) instead of gemm over the weight
/// widened whole — the only way gemm's bits could be kept at so few rows, which cost a decoding
/// step an f32 copy of every weight (73.6 MiB for GPT-2's head) and made bf16 decoding slower
/// than f32.
pub const DOT_ROWS: usize = SINGLE_PANEL_ROWS;

/// Output columns one task computes in [`forward_dot_rows`].
pub(crate) const DOT_COLUMNS: usize = 64;

/// Values [`dot_in_pieces`] takes at a time (a multiple of 8, on the stack).
pub(crate) const DOT_PIECE: usize = 256;

/// `Σ_k x_k·w_k` over `len` values that `fill(k0, xs, ws)` writes as f32, [`DOT_PIECE`] at a
/// time from `k0`: eight partial sums (k mod 8) of fused multiply-adds in k order, added
/// pairwise at the end. One fixed order: the row products of dense (`forward_dot_rows`) and
/// 4-bit (`quant_matmul`) weights give the same bits for the same values.
pub(crate) fn dot_in_pieces(
    len: usize,
    mut fill: impl FnMut(usize, &mut [f32], &mut [f32]),
) -> f32 {
    let mut acc = [0f32; 8];
    let (mut xb, mut wb) = ([0f32; DOT_PIECE], [0f32; DOT_PIECE]);
    for k0 in (0..len).step_by(DOT_PIECE) {
        let l = DOT_PIECE.min(len - k0);
        let (xs, ws) = (&mut xb[..l], &mut wb[..l]);
        fill(k0, xs, ws);
        accumulate8(xs, ws, &mut acc);
    }
    sum8(&acc)
}

/// Whether the row dots take their AVX2+FMA bodies: the CPU has both and the ISA cap allows
/// AVX2 (decided once).
#[cfg(target_arch = "x86_64")]
fn fma_allowed() -> bool {
    static FMA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FMA.get_or_init(|| {
        std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("avx2")
            && isa::allows(IsaLevel::Avx2)
    })
}

/// The eight partial sums of [`accumulate8`] added pairwise: the one order every row dot ends
/// in.
fn sum8(acc: &[f32; 8]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `acc[j] = fma(xs[i], ws[i], acc[j])` for every `i ≡ j (mod 8)`, in `i` order. With FMA
/// instructions where the CPU has them (the crate is built for baseline x86-64, where
/// `mul_add` is a call to a software fma, 3× slower than the f32 GEMM at decoding); the same
/// fused operations, so the same bits, on both paths (tested).
fn accumulate8(xs: &[f32], ws: &[f32], acc: &mut [f32; 8]) {
    #[cfg(target_arch = "x86_64")]
    {
        if fma_allowed() {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { accumulate8_fma(xs, ws, acc) };
            return;
        }
    }
    accumulate8_body(xs, ws, acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate8_fma(xs: &[f32], ws: &[f32], acc: &mut [f32; 8]) {
    accumulate8_body(xs, ws, acc);
}

#[inline(always)]
fn accumulate8_body(xs: &[f32], ws: &[f32], acc: &mut [f32; 8]) {
    let mut xc = xs.chunks_exact(8);
    let mut wc = ws.chunks_exact(8);
    for (x8, w8) in (&mut xc).zip(&mut wc) {
        for j in 0..8 {
            acc[j] = x8[j].mul_add(w8[j], acc[j]);
        }
    }
    for (j, (&a, &b)) in xc.remainder().iter().zip(wc.remainder()).enumerate() {
        acc[j] = a.mul_add(b, acc[j]);
    }
}

/// At most this many rows (a batched decoding step's), a forward product of any weight type
/// made while [`DecodingProducts`] is held is row dot products (`forward_dot_rows`) instead
/// of gemm: gemm packs the whole weight for so few rows, and that packing pass cost a GPT-2
/// 124M step of 8 rows as much as 8 single-row steps.
pub const DOT_ROWS_BATCHED: usize = 16;

thread_local! {
    static DECODING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While held, forward products of at most [`DOT_ROWS_BATCHED`] rows made on this thread are
/// row dot products whatever the weight type (a decoding step: the model's `decode` holds
/// one). Training never holds it, so its products keep gemm's bits whatever the row count
/// of a micro-batch — micro-batch splits and ZeRO stages compare bit for bit — and a
/// decoding step reads each weight once instead of having gemm pack it.
#[must_use = "the scope ends when this is dropped"]
pub struct DecodingProducts {
    previous: bool,
}

impl DecodingProducts {
    /// Row dot products for small forward products on this thread until dropped.
    pub fn enter() -> Self {
        DecodingProducts {
            previous: DECODING.with(|d| d.replace(true)),
        }
    }
}

impl Drop for DecodingProducts {
    fn drop(&mut self) {
        DECODING.with(|d| d.set(self.previous));
    }
}

/// Whether a forward product of `n` rows takes row dot products: a decoding step's of at most
/// [`DOT_ROWS_BATCHED`] rows, or at most [`DOT_ROWS`] rows of a low-precision weight.
fn row_dots<W: Operand>(n: usize, weight: &[W]) -> bool {
    if DECODING.with(std::cell::Cell::get) {
        n <= DOT_ROWS_BATCHED
    } else {
        n <= DOT_ROWS && W::as_f32(weight).is_none()
    }
}

/// Rows one pass over a weight row's piece serves at a time in [`forward_dot_rows`]: their
/// accumulators are independent chains of fused multiply-adds, so the FMA units stay busy
/// (one row alone waits on each add's latency).
const DOT_ROW_GROUP: usize = 4;

/// `out[r, o] = Σ_k x[r, k] · W[o, k]` for `n ≤` [`DOT_ROWS_BATCHED`] rows, each output
/// element the sum [`dot_in_pieces`] forms (eight FMA chains in k order, added pairwise), each
/// weight row read once for all `n` rows, a piece at a time, widened on the stack. Not gemm's
/// bits: within the f32-summation bound of the exact product of the same values (tested
/// against f64). The threads split the output columns, so the bits do not depend on their
/// number.
fn forward_dot_rows<W: Operand>(
    out: &mut [f32],
    x: &[f32],
    weight: &[W],
    n: usize,
    c: usize,
    oc: usize,
) {
    use rayon::prelude::*;
    if n == 0 || oc == 0 {
        return;
    }
    // Each task's columns for every row, `[task][n][width]`, scattered into `out` after: the
    // rows of `out` are not contiguous per column slab.
    let mut slabs = vec![0f32; n * oc];
    slabs
        .par_chunks_mut(n * DOT_COLUMNS)
        .enumerate()
        .for_each(|(t, slab)| {
            let width = slab.len() / n;
            let mut wb = [0f32; DOT_PIECE];
            for j in 0..width {
                let wr = &weight[(t * DOT_COLUMNS + j) * c..][..c];
                for r0 in (0..n).step_by(DOT_ROW_GROUP) {
                    let rows = DOT_ROW_GROUP.min(n - r0);
                    let mut acc = [[0f32; 8]; DOT_ROW_GROUP];
                    for k0 in (0..c).step_by(DOT_PIECE) {
                        let l = DOT_PIECE.min(c - k0);
                        let ws: &[f32] = match W::as_f32(&wr[k0..][..l]) {
                            Some(w) => w,
                            None => {
                                W::widen(&wr[k0..][..l], &mut wb[..l]);
                                &wb[..l]
                            }
                        };
                        let xs: [&[f32]; DOT_ROW_GROUP] = std::array::from_fn(|g| {
                            let r = r0 + g.min(rows - 1);
                            &x[r * c + k0..][..l]
                        });
                        accumulate8_rows(&xs, rows, ws, &mut acc);
                    }
                    for (g, a) in acc.iter().enumerate().take(rows) {
                        slab[(r0 + g) * width + j] = sum8(a);
                    }
                }
            }
        });
    for (t, slab) in slabs.chunks(n * DOT_COLUMNS).enumerate() {
        let width = slab.len() / n;
        for (r, row) in slab.chunks_exact(width).enumerate() {
            out[r * oc + t * DOT_COLUMNS..][..width].copy_from_slice(row);
        }
    }
}

/// [`accumulate8`] for the first `rows` (≤ [`DOT_ROW_GROUP`]) of `xs` against one weight
/// piece: `acc[g][j]` gets `fma(xs[g][i], ws[i], ·)` for every `i ≡ j (mod 8)`, in `i` order —
/// each row's sum exactly as [`accumulate8`] forms it (a vector FMA lane is the scalar fused
/// operation). Every `xs[g]` is at least `ws.len()` long.
fn accumulate8_rows(
    xs: &[&[f32]; DOT_ROW_GROUP],
    rows: usize,
    ws: &[f32],
    acc: &mut [[f32; 8]; DOT_ROW_GROUP],
) {
    assert!(rows <= DOT_ROW_GROUP && xs.iter().all(|x| x.len() >= ws.len()));
    #[cfg(target_arch = "x86_64")]
    {
        if fma_allowed() {
            // SAFETY: the CPU has AVX2 and FMA (checked above); the lengths are checked above.
            unsafe {
                match rows {
                    1 => accumulate8_rows_fma::<1>(xs, ws, acc),
                    2 => accumulate8_rows_fma::<2>(xs, ws, acc),
                    3 => accumulate8_rows_fma::<3>(xs, ws, acc),
                    _ => accumulate8_rows_fma::<4>(xs, ws, acc),
                }
            }
            return;
        }
    }
    for g in 0..rows {
        accumulate8_body(&xs[g][..ws.len()], ws, &mut acc[g]);
    }
}

/// The first `R` rows of [`accumulate8_rows`] in AVX2 registers: one load of each weight
/// chunk serves `R` independent FMA chains.
///
/// # Safety
/// The CPU must have AVX2 and FMA, and every `xs[g]` (`g < R`) be at least `ws.len()` long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate8_rows_fma<const R: usize>(
    xs: &[&[f32]; DOT_ROW_GROUP],
    ws: &[f32],
    acc: &mut [[f32; 8]; DOT_ROW_GROUP],
) {
    // SAFETY: the caller's contract: AVX2 and FMA, and every row at least `ws.len()` long,
    // so each load below stays inside its slice (`i + 8 ≤ full ≤ ws.len()`).
    unsafe {
        use std::arch::x86_64::{_mm256_fmadd_ps, _mm256_loadu_ps, _mm256_storeu_ps};
        let full = ws.len() / 8 * 8;
        let mut a = [_mm256_loadu_ps(acc[0].as_ptr()); R];
        for (g, v) in a.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(acc[g].as_ptr());
        }
        let mut i = 0;
        while i < full {
            let w = _mm256_loadu_ps(ws.as_ptr().add(i));
            for (g, v) in a.iter_mut().enumerate() {
                *v = _mm256_fmadd_ps(_mm256_loadu_ps(xs[g].as_ptr().add(i)), w, *v);
            }
            i += 8;
        }
        for (g, v) in a.iter().enumerate() {
            _mm256_storeu_ps(acc[g].as_mut_ptr(), *v);
            for (j, (&x, &w)) in xs[g][full..ws.len()].iter().zip(&ws[full..]).enumerate() {
                acc[g][j] = x.mul_add(w, acc[g][j]);
            }
        }
    }
}

/// Scratch (f32 elements) [`backward_with`] needs for a low-precision weight (the input
/// gradient's product; the weight gradient's does not read the weight).
pub fn backward_scratch(n: usize, c: usize, oc: usize) -> usize {
    panel_elems(n, c, oc)
}

/// Scratch (f32 elements) for a linear over `n` rows taken `rows` at a time (the last chunk
/// may be shorter; the head with a fused loss): forward and, when `backward`, the input
/// gradient's product, with one scratch shared by all chunks.
pub fn chunked_scratch(n: usize, rows: usize, c: usize, oc: usize, backward: bool) -> usize {
    most_over_chunks(n, rows, |r| {
        let f = forward_scratch(r, c, oc);
        if backward {
            f.max(backward_scratch(r, c, oc))
        } else {
            f
        }
    })
}

/// The largest `scratch(r)` over the chunk row counts of `n` rows taken `rows` at a time (0
/// for no rows): what one buffer shared by all the chunks must hold.
fn most_over_chunks(n: usize, rows: usize, scratch: impl Fn(usize) -> usize) -> usize {
    chunk_rows(n, rows).map(scratch).max().unwrap_or(0)
}

/// Widen `src` into `dst` over the threads when it is big enough to be worth splitting (the
/// copy is memory-bound, and the head's panels are megabytes).
fn widen_par<W: Operand>(src: &[W], dst: &mut [f32]) {
    use rayon::prelude::*;
    if dst.len() <= WIDEN_CHUNK {
        W::widen(src, dst);
    } else {
        dst.par_chunks_mut(WIDEN_CHUNK)
            .zip(src.par_chunks(WIDEN_CHUNK))
            .for_each(|(d, s)| W::widen(s, d));
    }
}

/// Values widened per parallel task (256 KiB of f32 output).
const WIDEN_CHUNK: usize = 1 << 16;

/// `dst[m, n] (+)= lhs[m, k] · Wᵀ` for `w` `[n, k]` row-major (`transposed`) or
/// `dst[m, n] (+)= lhs[m, k] · W` for `w` `[k, n]` row-major (not `transposed`), `dst` dense.
/// An f32 `w` goes straight to gemm; otherwise converted inside the packing where gemm runs
/// its FMA kernel ([`widening_gemm`](super::widening_gemm)), else panel by panel through
/// `scratch`.
#[allow(clippy::too_many_arguments)]
fn gemm_weight<W: Operand>(
    dst: &mut [f32],
    lhs: Strided<'_, f32>,
    w: &[W],
    transposed: bool,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    scratch: &mut [f32],
    budget: usize,
) {
    assert_eq!(w.len(), n * k, "weight length");
    assert_eq!(dst.len(), m * n, "output length");
    if let Some(w) = W::as_f32(w) {
        let rhs = if transposed {
            Strided::transposed(w, k)
        } else {
            Strided::rows(w, n)
        };
        gemm_into(dst, lhs, rhs, m, n, k, accumulate);
        return;
    }
    // Where gemm runs its FMA kernel, the weight is widened inside the packing instead: the
    // same bits, no widened panel (the scratch stays sized for the other CPUs).
    {
        use super::widening_gemm::gemm;
        let b = if transposed {
            Strided::transposed(w, k)
        } else {
            Strided::rows(w, n)
        };
        if gemm(dst, n, lhs, b, m, n, k, accumulate, scratch) {
            return;
        }
    }
    let plan = panel_plan(m, n, k, budget);
    assert!(
        scratch.len() >= plan.scratch(),
        "scratch of {} elements, need {}",
        scratch.len(),
        plan.scratch()
    );
    let blocks = k.div_ceil(plan.depth.max(1)).max(1);
    for j in 0..plan.count {
        let cols = panel_range(n, plan.count, j);
        let width = cols.len();
        // The slab `dst[:, cols]` starts at column `cols.start` with the full row stride.
        let slab = if m == 0 {
            &mut dst[..0]
        } else {
            &mut dst[cols.start..(m - 1) * n + cols.end]
        };
        for b in 0..blocks {
            let k0 = b * plan.depth;
            let kb = plan.depth.min(k - k0);
            let piece = &mut scratch[..kb * width];
            let rhs = if transposed {
                // Rows `cols`, columns `k0..k0 + kb` of `[n, k]`, as `[width, kb]`.
                widen_piece(w, k, cols.clone(), k0..k0 + kb, piece);
                Strided::transposed(piece, kb)
            } else {
                // Rows `k0..k0 + kb`, columns `cols` of `[k, n]`, as `[kb, width]`.
                widen_piece(w, n, k0..k0 + kb, cols.clone(), piece);
                Strided::rows(piece, width)
            };
            gemm_rows_into(
                parallelism(),
                slab,
                n,
                lhs.skip_cols(k0),
                rhs,
                m,
                width,
                kb,
                accumulate || b > 0,
            );
        }
    }
}

/// `dst = src[rows, cols]` widened, dense `[rows.len(), cols.len()]`, for `src` row-major with
/// `stride` columns; over the threads.
fn widen_piece<W: Operand>(
    src: &[W],
    stride: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    dst: &mut [f32],
) {
    use rayon::prelude::*;
    let width = cols.len();
    debug_assert_eq!(dst.len(), rows.len() * width);
    if width == stride {
        // Whole rows are contiguous: one flat pass.
        widen_par(&src[rows.start * stride..rows.end * stride], dst);
        return;
    }
    // A strip of each row. The strips can be short (the head's were ~100 values), so each
    // task takes a block of rows: one task per strip cost 4× the widening itself (measured).
    let rows_per_task = (WIDEN_CHUNK / width.max(1)).max(1);
    dst.par_chunks_mut(width * rows_per_task)
        .enumerate()
        .for_each(|(t, block)| {
            let r0 = rows.start + t * rows_per_task;
            W::widen_strip(&src[r0 * stride..], stride, cols.start, width, block);
        });
}

/// [`forward`] with the weight (and bias) in any [`Operand`] type: `out = inp · Wᵀ (+ bias)`,
/// f32 accumulation and output. `scratch` holds at least [`forward_scratch`] elements for a
/// low-precision weight (may be empty for f32). Bit for bit [`forward`] on the widened weight.
#[allow(clippy::too_many_arguments)]
pub fn forward_with<W: Operand>(
    out: &mut [f32],
    inp: &[f32],
    weight: &[W],
    bias: Option<&[W]>,
    n: usize,
    c: usize,
    oc: usize,
    scratch: &mut [f32],
) {
    assert_eq!(inp.len(), n * c, "input length");
    if row_dots(n, weight) {
        assert_eq!(weight.len(), oc * c, "weight length");
        assert_eq!(out.len(), n * oc, "output length");
        forward_dot_rows(out, inp, weight, n, c, oc);
        if let Some(b) = bias {
            add_bias(out, b, oc);
        }
        return;
    }
    gemm_weight(
        out,
        Strided::rows(inp, c),
        weight,
        true,
        n,
        oc,
        c,
        false,
        scratch,
        PANEL_BYTES,
    );
    if let Some(b) = bias {
        add_bias(out, b, oc);
    }
}

/// [`backward`] with the weight in any [`Operand`] type (gradients stay f32: they are the
/// master side): `dinp += dout · W`, `dweight += doutᵀ · inp` (skipped for a frozen weight,
/// `None`), `dbias += Σ_rows dout`. `scratch` holds at least [`backward_scratch`] elements for
/// a low-precision weight. `inp` is read for the weight gradient only: with `dweight` `None`
/// it may be empty (a frozen weight's caller need not materialise it).
#[allow(clippy::too_many_arguments)]
pub fn backward_with<W: Operand>(
    dinp: &mut [f32],
    dweight: Option<&mut [f32]>,
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[W],
    n: usize,
    c: usize,
    oc: usize,
    scratch: &mut [f32],
) {
    assert_eq!(dout.len(), n * oc, "output gradient length");
    assert!(
        dweight.is_none() || inp.len() == n * c,
        "input length {} for {n} rows of {c}",
        inp.len()
    );
    // dinp[n, c] += dout[n, oc] · W[oc, c]
    gemm_weight(
        dinp,
        Strided::rows(dout, oc),
        weight,
        false,
        n,
        c,
        oc,
        true,
        scratch,
        PANEL_BYTES,
    );
    // dweight[oc, c] += dout[n, oc]ᵀ · inp[n, c]
    if let Some(dweight) = dweight {
        assert_eq!(dweight.len(), oc * c, "weight gradient length");
        weight_grad_in_slabs(dweight, dout, inp, n, c, oc);
    }
    if let Some(db) = dbias {
        add_bias_grad(db, dout, oc);
    }
}

/// Output rows of one weight-gradient product at most: see [`weight_grad_in_slabs`].
const WEIGHT_GRAD_SLAB: usize = 4096;

/// `dweight[oc, c] += dout[n, oc]ᵀ · inp[n, c]`, as balanced slabs of at most
/// [`WEIGHT_GRAD_SLAB`] rows of `dweight` when `oc` is larger (the tied head's 50257). Measured
/// on the AMX Xeon for the `small` head (50257 × 384 from 2048 rows): one call ran at 216–299
/// GFLOP/s, slabs of ≤ 4096 rows at 350–352 (225 instead of 264–366 ms). The bits are the
/// same: gemm blocks the depth by `k` and the cache sizes alone (`gemm_common::cache::
/// kernel_params`), never by `m`, and balanced slabs keep every call far from the small-`m`
/// shapes gemm runs another way (tested).
fn weight_grad_in_slabs(
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    n: usize,
    c: usize,
    oc: usize,
) {
    let slabs = oc.div_ceil(WEIGHT_GRAD_SLAB).max(1);
    let rows = oc.div_ceil(slabs).max(1);
    for (s, dw) in dweight.chunks_mut(rows * c.max(1)).enumerate() {
        let (o0, m) = (s * rows, dw.len() / c.max(1));
        gemm_into(
            dw,
            Strided::transposed(&dout[o0..], oc),
            Strided::rows(inp, c),
            m,
            c,
            n,
            true,
        );
    }
}

/// `out[r, :] += bias` for every row of `out` (`oc` columns).
fn add_bias<W: Operand>(out: &mut [f32], bias: &[W], oc: usize) {
    assert_eq!(bias.len(), oc, "bias length");
    for row in out.chunks_exact_mut(oc) {
        for (o, b) in row.iter_mut().zip(bias) {
            *o += b.to_f32();
        }
    }
}

/// `db += Σ_rows dout`, an ordered loop (reproducible bit for bit).
fn add_bias_grad<D: super::bf16_gemm::Bf16Source>(db: &mut [f32], dout: &[D], oc: usize) {
    for row in dout.chunks_exact(oc) {
        for (d, g) in db.iter_mut().zip(row) {
            *d += g.to_f32();
        }
    }
}

/// Whether bf16 weights take [`forward_bf16_products`] / [`backward_bf16_products`] instead of
/// the widening path: where [`bf16_gemm`](super::bf16_gemm) has AMX tiles, unless
/// `HEADROOM_BF16_GEMM=widen` asks for the widening path's bits (those of the f32 GEMM on the
/// widened weight, the same on every machine of an ISA). Decided once per process.
pub fn bf16_products() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        super::bf16_gemm::bf16_gemm_path() == super::bf16_gemm::Bf16GemmPath::Amx
            && std::env::var("HEADROOM_BF16_GEMM").as_deref() != Ok("widen")
    })
}

/// The caller's f32 scratch as the u16 packing buffer of [`super::bf16_gemm`].
fn pack_buffer(scratch: &mut [f32]) -> &mut [u16] {
    bytemuck::cast_slice_mut(scratch)
}

/// [`forward_with`] for a bf16 weight with torch's bf16 `matmul` numerics: the input rounded to
/// bf16 too, products of the bf16 values summed in f32 ([`super::bf16_gemm`], on AMX tiles
/// where the CPU has them). Not bit for bit the widening path: the input's rounding and the
/// order of the sums differ; within the f32-summation bound of the exact product of the
/// rounded operands. `scratch` (at least [`forward_scratch`] elements, as for the widening path,
/// so the tracker and the estimator count the same bytes) holds the packed weight. `inp` may be
/// f32 or already bf16 (a kept activation, read in place: rounding a bf16 value is exact, so
/// the bits are those of its f32 copy).
#[allow(clippy::too_many_arguments)]
pub fn forward_bf16_products<A: super::bf16_gemm::Bf16Source>(
    out: &mut [f32],
    inp: &[A],
    weight: &[bf16],
    bias: Option<&[bf16]>,
    n: usize,
    c: usize,
    oc: usize,
    scratch: &mut [f32],
) {
    use super::bf16_gemm::gemm_bf16_with;
    assert_eq!(inp.len(), n * c, "input length");
    assert_eq!(weight.len(), oc * c, "weight length");
    assert_eq!(out.len(), n * oc, "output length");
    if n <= DOT_ROWS {
        // The input rounded to bf16 as the tiles would round it: the same operand values.
        let x = &mut scratch[..n * c];
        for (d, s) in x.iter_mut().zip(inp) {
            *d = f32::from_bits(u32::from(s.bf16_bits()) << 16);
        }
        forward_dot_rows(out, x, weight, n, c, oc);
        if let Some(b) = bias {
            add_bias(out, b, oc);
        }
        return;
    }
    gemm_bf16_with(
        out,
        oc,
        Strided::rows(inp, c),
        Strided::transposed(weight, c),
        n,
        oc,
        c,
        false,
        pack_buffer(scratch),
    );
    if let Some(b) = bias {
        add_bias(out, b, oc);
    }
}

/// Output columns [`forward_bf16_products_into_bf16`] computes at a time in f32.
pub const BF16_OUTPUT_STRIP: usize = 1024;

/// f32 elements of the staging strip that [`forward_bf16_products_into_bf16`] and
/// [`forward_with_into_bf16`] pass `oc` outputs of depth `c` through, over `n` rows taken
/// `rows` at a time: none for a chunk whose AMX tiles round their own output
/// ([`bf16_output_on_tiles`](super::bf16_gemm::bf16_output_on_tiles)).
pub fn bf16_output_stage(n: usize, rows: usize, c: usize, oc: usize) -> usize {
    most_over_chunks(n, rows, |r| {
        if bf16_output_direct(r, c) {
            0
        } else {
            r * oc.min(BF16_OUTPUT_STRIP)
        }
    })
}

/// Whether [`forward_bf16_products_into_bf16`] stores its bf16 output straight from the AMX
/// tiles (the whole depth one block; more rows than the row dot products take) instead of staging f32
/// strips.
fn bf16_output_direct(n: usize, c: usize) -> bool {
    bf16_products() && n > DOT_ROWS && super::bf16_gemm::bf16_output_on_tiles(c)
}

/// Whether [`forward_bf16_products_into_bf16`] holds fewer bytes than an f32 output: a bf16
/// `[n, oc]` output and its f32 strip against `[n, oc]` f32, so more than two strips wide.
pub fn bf16_output_saves(oc: usize) -> bool {
    oc > 2 * BF16_OUTPUT_STRIP
}

/// [`forward_bf16_products`] (no bias) with its output rounded to bf16 (to nearest even, NaN
/// kept quiet) and stored as bf16: the product's f32 results pass through `stage` (at least
/// [`bf16_output_stage`] elements) a balanced strip of at most [`BF16_OUTPUT_STRIP`] columns at
/// a time, so no `[n, oc]` f32 output ever exists. Each output element is the one
/// [`forward_bf16_products`] computes whole, then rounded (the bf16 GEMM's sums, and the
/// few-row dot products', do not depend on which columns are computed together; tested).
///
/// The trade-off: `a` is packed again for every strip, under 1% of the product's work at a
/// head's shapes (1024-column strips).
///
/// Where the AMX tiles take the whole depth as one block (up to
/// [`KC_BF16_OUTPUT`](super::bf16_gemm::KC_BF16_OUTPUT): `small`'s head, 384, and GPT-2's,
/// 768), there are no strips: the tiles round their own output
/// ([`bf16_gemm::gemm_bf16_into_bf16`], the same bits) and `stage` may be empty
/// ([`bf16_output_stage`]).
///
/// [`bf16_gemm::gemm_bf16_into_bf16`]: super::bf16_gemm::gemm_bf16_into_bf16
#[allow(clippy::too_many_arguments)]
pub fn forward_bf16_products_into_bf16<A: super::bf16_gemm::Bf16Source>(
    out: &mut [bf16],
    inp: &[A],
    weight: &[bf16],
    n: usize,
    c: usize,
    oc: usize,
    stage: &mut [f32],
    scratch: &mut [f32],
) {
    use super::bf16_gemm::gemm_bf16_into_bf16;
    assert_eq!(weight.len(), oc * c, "weight length");
    assert_eq!(inp.len(), n * c, "input length");
    assert_eq!(out.len(), n * oc, "output length");
    if bf16_output_direct(n, c)
        && gemm_bf16_into_bf16(
            out,
            oc,
            Strided::rows(inp, c),
            Strided::transposed(weight, c),
            n,
            oc,
            c,
            pack_buffer(scratch),
        )
    {
        return;
    }
    into_bf16_by_strips(out, n, oc, stage, |strip, cols| {
        let rows_of_w = &weight[cols.start * c..cols.end * c];
        forward_bf16_products(strip, inp, rows_of_w, None, n, c, cols.len(), scratch);
    });
}

/// `out[n, oc]` (bf16) ← `product(strip, cols)` rounded to nearest even (NaN kept quiet), for
/// the balanced column strips of [`output_strips`] in turn, each computed in f32 into `stage`
/// (at least `n` × the widest strip, which [`bf16_output_stage`] is).
fn into_bf16_by_strips(
    out: &mut [bf16],
    n: usize,
    oc: usize,
    stage: &mut [f32],
    mut product: impl FnMut(&mut [f32], Range<usize>),
) {
    use headroom_tensor::cpu::kernels::narrow_bf16;
    use rayon::prelude::*;
    assert_eq!(out.len(), n * oc, "output length");
    let count = output_strips(oc);
    assert!(
        stage.len() >= n * oc.div_ceil(count),
        "stage of {} elements for {n} rows of {oc}",
        stage.len()
    );
    for j in 0..count {
        let cols = panel_range(oc, count, j);
        let strip = &mut stage[..n * cols.len()];
        product(strip, cols.clone());
        out.par_chunks_mut(oc.max(1))
            .zip(strip.par_chunks(cols.len().max(1)))
            .with_min_len(16)
            .for_each(|(o, s)| narrow_bf16(s, &mut o[cols.clone()]));
    }
}

/// [`backward_with`] for a bf16 weight with the numerics of [`forward_bf16_products`]:
/// `dinp += dout · W` and `dweight += doutᵀ · inp` with `dout` and `inp` rounded to bf16,
/// f32 sums into the f32 gradients; `dbias` an ordered f32 sum as on the widening path. `inp`
/// f32 or bf16, as for [`forward_bf16_products`]; so is `dout` (a bf16 gradient is read in
/// place: the products would round an f32 one to the same bits, so both give the same
/// results, but `dbias` sums the values as given).
#[allow(clippy::too_many_arguments)]
pub fn backward_bf16_products<A: super::bf16_gemm::Bf16Source, D: super::bf16_gemm::Bf16Source>(
    dinp: &mut [f32],
    dweight: Option<&mut [f32]>,
    dbias: Option<&mut [f32]>,
    dout: &[D],
    inp: &[A],
    weight: &[bf16],
    n: usize,
    c: usize,
    oc: usize,
    scratch: &mut [f32],
) {
    use super::bf16_gemm::gemm_bf16_with;
    assert_eq!(dout.len(), n * oc, "output gradient length");
    assert!(
        dweight.is_none() || inp.len() == n * c,
        "input length {} for {n} rows of {c}",
        inp.len()
    );
    assert_eq!(weight.len(), oc * c, "weight length");
    assert_eq!(dinp.len(), n * c, "input gradient length");
    gemm_bf16_with(
        dinp,
        c,
        Strided::rows(dout, oc),
        Strided::rows(weight, c),
        n,
        c,
        oc,
        true,
        pack_buffer(scratch),
    );
    if let Some(dweight) = dweight {
        assert_eq!(dweight.len(), oc * c, "weight gradient length");
        gemm_bf16_with(
            dweight,
            c,
            Strided::transposed(dout, oc),
            Strided::rows(inp, c),
            oc,
            c,
            n,
            true,
            pack_buffer(scratch),
        );
    }
    if let Some(db) = dbias {
        add_bias_grad(db, dout, oc);
    }
}

// ---------------------------------------------------------------------------------------------
// bf16 outputs and output gradients on the widening path: the head's logits under bf16 where
// there are no AMX tiles. An f32 `[rows, V]` logits buffer is the largest tensor of a GPT-2
// step (392 MiB of `small`'s 1 GiB bf16 peak); in bf16 it is half that, and the GEMMs read it
// widened a cache-sized piece at a time, cut where gemm cuts its sums, so every product keeps
// the bits of the f32 GEMM on the widened values.

/// How many balanced column strips, each at most [`BF16_OUTPUT_STRIP`] wide, a bf16 output is
/// computed in (f32, then rounded). Balanced rather than full strips and a ragged last one:
/// every strip of a wide output stays far wider than [`PANEL_MIN`], so gemm blocks each one as
/// it blocks the whole product.
fn output_strips(oc: usize) -> usize {
    oc.div_ceil(BF16_OUTPUT_STRIP).max(1)
}

/// Scratch (f32 elements) [`forward_with_into_bf16`] needs: its widest strips' forward.
pub fn forward_into_bf16_scratch(n: usize, c: usize, oc: usize) -> usize {
    let count = output_strips(oc);
    [oc / count, oc.div_ceil(count)]
        .into_iter()
        .map(|w| forward_scratch(n, c, w))
        .max()
        .unwrap_or(0)
}

/// [`forward_with`] (no bias) with its output rounded to bf16 (to nearest even, NaN kept
/// quiet) and stored as bf16: the f32 results pass through `stage` (at least
/// [`bf16_output_stage`] elements) a strip of at most [`BF16_OUTPUT_STRIP`] columns at a time,
/// so no `[n, oc]` f32 output exists. Each element is [`forward_with`]'s on the whole weight,
/// rounded: a strip is a slab of output columns, which gemm sums as it sums the whole (see the
/// module notes; tested). `scratch` holds at least [`forward_into_bf16_scratch`] elements.
#[allow(clippy::too_many_arguments)]
pub fn forward_with_into_bf16<W: Operand>(
    out: &mut [bf16],
    inp: &[f32],
    weight: &[W],
    n: usize,
    c: usize,
    oc: usize,
    stage: &mut [f32],
    scratch: &mut [f32],
) {
    assert_eq!(weight.len(), oc * c, "weight length");
    into_bf16_by_strips(out, n, oc, stage, |strip, cols| {
        let rows_of_w = &weight[cols.start * c..cols.end * c];
        forward_with(strip, inp, rows_of_w, None, n, c, cols.len(), scratch);
    });
}

/// The row counts of a product over `n` rows taken `rows` at a time: `rows`, and the last
/// chunk's when it is shorter.
fn chunk_rows(n: usize, rows: usize) -> impl Iterator<Item = usize> {
    let rows = rows.clamp(1, n.max(1));
    [rows.min(n), n % rows].into_iter().filter(|&r| r > 0)
}

/// Whether a bf16 head (weight `[oc, c]`) over `n` rows taken `rows` at a time keeps its logits
/// in bf16: the vocabulary is wide enough for the f32 strip to cost less than f32 logits
/// ([`bf16_output_saves`]), and the products read a bf16 gradient without widening it whole —
/// always on AMX tiles, on the widening path where the depth cut applies to every chunk
/// ([`bf16_grad_pieces`]; an evaluation has no gradient). The loss's gradient is then rounded to
/// bf16, as torch's bf16 `matmul` receives it, on both paths.
pub fn bf16_head_logits(n: usize, rows: usize, c: usize, oc: usize, train: bool) -> bool {
    bf16_output_saves(oc)
        && (bf16_products() || !train || chunk_rows(n, rows).all(|r| bf16_grad_pieces(r, c, oc)))
}

/// Scratch (f32 elements) of a head over `n` rows taken `rows` at a time on `threads` threads,
/// with bf16 logits ([`bf16_head_logits`]) or not: the packing buffer of the bf16 products, or
/// the widened pieces of the widening path ([`chunked_scratch`], [`forward_into_bf16_scratch`],
/// [`backward_bf16_grad_scratch`]). bf16 logits that the AMX tiles round themselves come from
/// one product over the whole vocabulary, in which each thread packs its own panels
/// ([`pack_len`](super::bf16_gemm::pack_len)).
pub fn head_scratch(
    n: usize,
    rows: usize,
    c: usize,
    oc: usize,
    train: bool,
    bf16_logits: bool,
    threads: usize,
) -> usize {
    if !bf16_logits || bf16_products() {
        let products = chunked_scratch(n, rows, c, oc, train);
        if !bf16_logits {
            return products;
        }
        let direct = most_over_chunks(n, rows, |r| {
            if bf16_output_direct(r, c) {
                super::bf16_gemm::pack_len_into_bf16(r, oc, c, threads).div_ceil(2)
            } else {
                0
            }
        });
        return products.max(direct);
    }
    most_over_chunks(n, rows, |r| {
        let f = forward_into_bf16_scratch(r, c, oc);
        if train {
            f.max(backward_bf16_grad_scratch(r, c, oc))
        } else {
            f
        }
    })
}

/// Whether [`backward_with_bf16_grad`] reads an `[n, oc]` bf16 output gradient a cache-sized
/// piece at a time: the input gradient's depth (`oc`) is cut at gemm's own blocks, the last
/// one at least [`PANEL_MIN`] long (each block is also a slab of the weight gradient's rows,
/// kept far from gemm's small shapes). Where it is not (a CPU whose gemm blocking this module
/// does not know, at most [`SINGLE_PANEL_ROWS`] rows), the piece would be the whole gradient
/// widened, and a caller keeps f32 instead.
pub fn bf16_grad_pieces(n: usize, c: usize, oc: usize) -> bool {
    n > SINGLE_PANEL_ROWS
        && gemm_depth_block(n, c, oc).is_some_and(|kc| oc - (oc.div_ceil(kc) - 1) * kc >= PANEL_MIN)
}

/// Scratch (f32 elements) [`backward_with_bf16_grad`] needs: one widened piece of the
/// gradient (`n` rows × one depth block) beside one block's widened weight panel (a full
/// block's or the shorter last one's, whose panels may be wider).
pub fn backward_bf16_grad_scratch(n: usize, c: usize, oc: usize) -> usize {
    let depth = panel_plan(n, c, oc, PANEL_BYTES).depth;
    let last = oc - oc.saturating_sub(1) / depth.max(1) * depth;
    let panel = |kb: usize| panel_plan(n, c, kb, PANEL_BYTES).scratch();
    n * depth + panel(depth).max(panel(last))
}

/// [`backward_with`] with the output gradient in bf16: `dinp += dout · W`, `dweight += doutᵀ
/// · inp`, `dbias += Σ_rows dout`, the gradient read widened (exactly) one piece at a time into
/// `scratch` (at least [`backward_bf16_grad_scratch`] elements). Bit for bit [`backward_with`]
/// on the widened gradient:
/// - the input gradient's depth is walked in gemm's own blocks ([`bf16_grad_pieces`]), one
///   call per block accumulating in order, as gemm sums the uncut product (the weight, when
///   low-precision, is widened a panel of each block at a time, as in [`backward_with`]);
/// - the same piece `dout[:, block]` gives the weight gradient's rows of that block: slabs of
///   rows, which gemm sums as it sums the whole (the depth is `n` either way).
///
/// So each element of the gradient is widened once, not once per product: its columns are
/// strided reads of a buffer far larger than the caches. Where the depth is not cut (see
/// [`bf16_grad_pieces`]) it is still correct, with one piece of the whole depth.
#[allow(clippy::too_many_arguments)]
pub fn backward_with_bf16_grad<W: Operand>(
    dinp: &mut [f32],
    mut dweight: Option<&mut [f32]>,
    dbias: Option<&mut [f32]>,
    dout: &[bf16],
    inp: &[f32],
    weight: &[W],
    n: usize,
    c: usize,
    oc: usize,
    scratch: &mut [f32],
) {
    assert_eq!(dout.len(), n * oc, "output gradient length");
    assert_eq!(weight.len(), oc * c, "weight length");
    assert_eq!(dinp.len(), n * c, "input gradient length");
    if let Some(dw) = &dweight {
        assert_eq!(dw.len(), oc * c, "weight gradient length");
        assert_eq!(inp.len(), n * c, "input length for {n} rows of {c}");
    }
    assert!(
        scratch.len() >= backward_bf16_grad_scratch(n, c, oc),
        "scratch of {} elements, need {}",
        scratch.len(),
        backward_bf16_grad_scratch(n, c, oc)
    );
    let depth = panel_plan(n, c, oc, PANEL_BYTES).depth;
    if n > 0 && c > 0 {
        let (grad_piece, weight_piece) = scratch.split_at_mut(n * depth);
        for k0 in (0..oc).step_by(depth.max(1)) {
            let kb = depth.min(oc - k0);
            let piece = &mut grad_piece[..n * kb];
            // Widened here, not inside the products' packing: both read it, in two layouts,
            // and one contiguous pass measured cheaper than converting in either packing.
            widen_piece(dout, oc, 0..n, k0..k0 + kb, piece);
            // dinp[n, c] += dout[:, block] · W[block, :]: one of gemm's depth blocks, so
            // `gemm_weight` takes it whole (panels of columns, the weight widened per panel).
            gemm_weight(
                dinp,
                Strided::rows(piece, kb),
                &weight[k0 * c..(k0 + kb) * c],
                false,
                n,
                c,
                kb,
                true,
                weight_piece,
                PANEL_BYTES,
            );
            // dweight[block, c] += dout[:, block]ᵀ · inp[n, c].
            if let Some(dw) = dweight.as_deref_mut() {
                gemm_into(
                    &mut dw[k0 * c..(k0 + kb) * c],
                    Strided::transposed(piece, kb),
                    Strided::rows(inp, c),
                    kb,
                    c,
                    n,
                    true,
                );
            }
        }
    }
    if let Some(db) = dbias {
        add_bias_grad(db, dout, oc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Values of O(1) with random signs, already bf16 (so f32 and bf16 hold the same numbers).
    fn bf16_vec(seed: u64, len: usize) -> Vec<bf16> {
        // 2·(2u − 1) is 4u − 2 exactly (u on a 2⁻²⁴ grid).
        crate::ops::test_values(seed, len)
            .into_iter()
            .map(|v| bf16::from_f32(v * 2.0))
            .collect()
    }

    fn f32_vec(seed: u64, len: usize) -> Vec<f32> {
        bf16_vec(seed, len).iter().map(|v| v.to_f32()).collect()
    }

    fn widened(w: &[bf16]) -> Vec<f32> {
        w.iter().map(|v| v.to_f32()).collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The f32 gemm's forward `x · Wᵀ` whatever the row count (`forward` takes row dots at
    /// few rows): what the widening paths must equal bit for bit.
    fn gemm_forward(out: &mut [f32], x: &[f32], w: &[f32], m: usize, k: usize, n: usize) {
        gemm_into(
            out,
            Strided::rows(x, k),
            Strided::transposed(w, k),
            m,
            n,
            k,
            false,
        );
    }

    /// `Σ_k a[i,k]·b[k,j]` in f64 and the error bound `k·2⁻²³·Σ|a·b|` of an f32 reduction with
    /// fused multiply-adds over the same (exactly representable) inputs.
    fn reference(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<(f64, f64)> {
        let mut r = vec![(0.0, 0.0); m * n];
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut abs) = (0.0f64, 0.0f64);
                for p in 0..k {
                    let t = a[i * k + p] as f64 * b[p * n + j] as f64;
                    s += t;
                    abs += t.abs();
                }
                r[i * n + j] = (s, k as f64 * f64::powi(2.0, -23) * abs + 1e-30);
            }
        }
        r
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// The dispatched widening (the widest path allowed here) is the scalar formula, tails
        /// included.
        #[test]
        fn widen_matches_portable(raw in proptest::collection::vec(any::<u16>(), 0..200)) {
            let src: Vec<bf16> = raw.iter().map(|&b| bf16::from_bits(b)).collect();
            let (mut fast, mut slow) = (vec![0.0f32; src.len()], vec![1.0f32; src.len()]);
            widen_bf16(&src, &mut fast);
            widen_bf16_portable(&src, &mut slow);
            prop_assert_eq!(bits(&fast), bits(&slow));
            for (f, s) in fast.iter().zip(&src) {
                prop_assert_eq!(f.to_bits() >> 16, s.to_bits() as u32);
            }
        }

        /// Forward with a bf16 weight: within the f32 bound of the f64 product of the same
        /// rounded inputs, and bit for bit the f32 GEMM on the widened weight — also when the
        /// weight is split into several panels (budget 0: `PANEL_MIN`-wide panels).
        #[test]
        fn forward_bf16(m in 1usize..40, k in 1usize..70, n in 1usize..400,
                        seed in any::<u64>(), tiny_budget in any::<bool>()) {
            let x = f32_vec(seed, m * k);
            let w = bf16_vec(seed ^ 1, n * k);
            let wf = widened(&w);
            let mut want = vec![0.0f32; m * n];
            gemm_forward(&mut want, &x, &wf, m, k, n);
            let budget = if tiny_budget { 0 } else { PANEL_BYTES };
            let mut scratch = vec![f32::NAN; panel_plan(m, n, k, budget).scratch()];
            let mut got = vec![f32::NAN; m * n];
            gemm_weight(&mut got, Strided::rows(&x, k), &w, true, m, n, k, false,
                        &mut scratch, budget);
            prop_assert_eq!(bits(&got), bits(&want));
            // Wᵀ as [k, n] for the reference.
            let mut wt = vec![0.0f32; k * n];
            for j in 0..n {
                for p in 0..k {
                    wt[p * n + j] = wf[j * k + p];
                }
            }
            for (g, (r, tol)) in got.iter().zip(reference(&x, &wt, m, n, k)) {
                prop_assert!((*g as f64 - r).abs() <= tol, "{} vs {} (tol {})", g, r, tol);
            }
        }

        /// At most [`DOT_ROWS_BATCHED`] rows the forward is row dot products: bf16 and f16
        /// weights within the f32 bound of the f64 product of the same values, an f32 weight
        /// of the same values the same bits, every row the bits of [`dot_in_pieces`] alone
        /// (rows grouped or not), the bias added to that bit for bit, and at most
        /// [`DOT_ROWS`] rows the bf16 products (input rounded to bf16) the same bits as the
        /// widening entry on the rounded input. Depths past the 256-value pieces and the
        /// eight partial sums' tails, columns past one task's 64, row groups and their tails.
        #[test]
        fn few_row_forwards_are_row_dots(m in 1usize..=DOT_ROWS_BATCHED, k in 1usize..700,
                                         n in 1usize..300, seed in any::<u64>()) {
            let _decoding = DecodingProducts::enter();
            let x = f32_vec(seed, m * k);
            let w = bf16_vec(seed ^ 3, n * k);
            let w16: Vec<f16> = f32_vec(seed ^ 5, n * k).into_iter().map(f16::from_f32).collect();
            let bias = bf16_vec(seed ^ 4, n);
            let mut scratch = vec![f32::NAN; forward_scratch(m, k, n)];
            let transposed = |wf: &[f32]| {
                let mut wt = vec![0.0f32; k * n];
                for j in 0..n {
                    for p in 0..k {
                        wt[p * n + j] = wf[j * k + p];
                    }
                }
                wt
            };
            let mut plain = vec![f32::NAN; m * n];
            forward_with(&mut plain, &x, &w, None, m, k, n, &mut scratch);
            let mut plain16 = vec![f32::NAN; m * n];
            forward_with(&mut plain16, &x, &w16, None, m, k, n, &mut scratch);
            let wf16: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
            for (got, wf) in [(&plain, widened(&w)), (&plain16, wf16)] {
                for (g, (r, tol)) in got.iter().zip(reference(&x, &transposed(&wf), m, n, k)) {
                    prop_assert!((*g as f64 - r).abs() <= tol, "{} vs {} (tol {})", g, r, tol);
                }
            }
            let wf = widened(&w);
            let mut from_f32 = vec![f32::NAN; m * n];
            forward(&mut from_f32, &x, &wf, None, m, k, n);
            prop_assert_eq!(bits(&from_f32), bits(&plain));
            for (r, o) in [(0, 0), (m - 1, n - 1), (m / 2, n / 3)] {
                let alone = dot_in_pieces(k, |k0, xs, ws| {
                    xs.copy_from_slice(&x[r * k + k0..][..xs.len()]);
                    ws.copy_from_slice(&wf[o * k + k0..][..ws.len()]);
                });
                prop_assert_eq!(plain[r * n + o].to_bits(), alone.to_bits(), "row {} column {}", r, o);
            }
            let mut with_bias = vec![f32::NAN; m * n];
            forward_with(&mut with_bias, &x, &w, Some(&bias), m, k, n, &mut scratch);
            let mut want = plain.clone();
            add_bias(&mut want, &bias, n);
            prop_assert_eq!(bits(&with_bias), bits(&want));
            let rounded: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            let mut on_rounded = vec![f32::NAN; m * n];
            forward_with(&mut on_rounded, &rounded, &w, None, m, k, n, &mut scratch);
            if m <= DOT_ROWS {
                let mut products = vec![f32::NAN; m * n];
                forward_bf16_products(&mut products, &x, &w, None, m, k, n, &mut scratch);
                prop_assert_eq!(bits(&products), bits(&on_rounded));
            }
            drop(_decoding);
            // Outside a decoding step: row dots for a low-precision weight at most `DOT_ROWS`
            // rows (the same bits), gemm's bits for an f32 weight.
            let mut outside = vec![f32::NAN; m * n];
            forward_with(&mut outside, &x, &w, None, m, k, n, &mut scratch);
            if m <= DOT_ROWS {
                prop_assert_eq!(bits(&outside), bits(&plain));
            }
            let mut gemm_bits = vec![f32::NAN; m * n];
            gemm_forward(&mut gemm_bits, &x, &wf, m, k, n);
            forward(&mut from_f32, &x, &wf, None, m, k, n);
            prop_assert_eq!(bits(&from_f32), bits(&gemm_bits));
        }

        /// The row dots' FMA path is the portable one, bit for bit, tails included.
        #[test]
        fn row_dot_paths_agree(len in 0usize..100, seed in any::<u64>()) {
            let (x, w) = (f32_vec(seed, len), f32_vec(seed ^ 9, len));
            let start: [f32; 8] = std::array::from_fn(|j| j as f32 * 0.37 - 1.0);
            let (mut fast, mut portable) = (start, start);
            accumulate8(&x, &w, &mut fast);
            accumulate8_body(&x, &w, &mut portable);
            prop_assert_eq!(bits(&fast), bits(&portable));
            // Grouped rows: each row's sums are the single row's.
            let rows: Vec<Vec<f32>> = (0..DOT_ROW_GROUP as u64).map(|g| f32_vec(seed ^ (g + 20), len)).collect();
            for count in 1..=DOT_ROW_GROUP {
                let xs: [&[f32]; DOT_ROW_GROUP] = std::array::from_fn(|g| rows[g].as_slice());
                let mut grouped = [start; DOT_ROW_GROUP];
                accumulate8_rows(&xs, count, &w, &mut grouped);
                for (g, sums) in grouped.iter().enumerate().take(count) {
                    let mut one = start;
                    accumulate8_body(&rows[g], &w, &mut one);
                    prop_assert_eq!(bits(sums), bits(&one), "row {} of {}", g, count);
                }
            }
        }

        /// The input gradient with a bf16 weight accumulates onto what is there, equals the f32
        /// path bit for bit (panels or not) and the f64 reference within the bound.
        #[test]
        fn input_gradient_bf16(m in 1usize..40, k in 1usize..70, n in 1usize..400,
                               seed in any::<u64>(), tiny_budget in any::<bool>()) {
            let dy = f32_vec(seed, m * k);
            let w = bf16_vec(seed ^ 2, k * n);
            let wf = widened(&w);
            let start = f32_vec(seed ^ 3, m * n);
            let mut want = start.clone();
            gemm_into(&mut want, Strided::rows(&dy, k), Strided::rows(&wf, n), m, n, k, true);
            let budget = if tiny_budget { 0 } else { PANEL_BYTES };
            let mut scratch = vec![f32::NAN; panel_plan(m, n, k, budget).scratch()];
            let mut got = start.clone();
            gemm_weight(&mut got, Strided::rows(&dy, k), &w, false, m, n, k, true,
                        &mut scratch, budget);
            prop_assert_eq!(bits(&got), bits(&want));
            for ((g, s), (r, tol)) in got.iter().zip(&start).zip(reference(&dy, &wf, m, n, k)) {
                let r = r + *s as f64;
                // One more rounding for the `+=`.
                let tol = tol + (r.abs() + tol) * f64::powi(2.0, -23);
                prop_assert!((*g as f64 - r).abs() <= tol, "{} vs {} (tol {})", g, r, tol);
            }
        }

        /// The public entry points: forward (with a bf16 bias) and backward with a bf16 weight
        /// give the f32 path's bits on the widened weight and bias; f16 likewise. (A forward
        /// of at most [`DOT_ROWS`] rows is row dots, `few_row_forwards_are_row_dots`.)
        #[test]
        fn linear_bf16_and_f16_match_f32(n in 1usize..24, c in 1usize..50, oc in 1usize..90,
                                         seed in any::<u64>()) {
            let x = f32_vec(seed, n * c);
            let w = bf16_vec(seed ^ 4, oc * c);
            let b = bf16_vec(seed ^ 5, oc);
            let dy = f32_vec(seed ^ 6, n * oc);
            let (wf, bf) = (widened(&w), widened(&b));
            let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
            let whf: Vec<f32> = wh.iter().map(|v| v.to_f32()).collect();
            let mut scratch =
                vec![0.0; forward_scratch(n, c, oc).max(backward_scratch(n, c, oc))];

            let mut want = vec![0.0; n * oc];
            forward(&mut want, &x, &wf, Some(&bf), n, c, oc);
            let mut got = vec![0.0; n * oc];
            if n > DOT_ROWS {
                forward_with(&mut got, &x, &w, Some(&b), n, c, oc, &mut scratch);
                prop_assert_eq!(bits(&got), bits(&want));
                forward(&mut want, &x, &whf, None, n, c, oc);
                forward_with::<f16>(&mut got, &x, &wh, None, n, c, oc, &mut scratch);
                prop_assert_eq!(bits(&got), bits(&want));
            }

            let (mut dx0, mut dw0, mut db0) = (f32_vec(7, n * c), f32_vec(8, oc * c), vec![0.5; oc]);
            let (mut dx1, mut dw1, mut db1) = (dx0.clone(), dw0.clone(), db0.clone());
            backward(&mut dx0, &mut dw0, Some(&mut db0), &dy, &x, &wf, n, c, oc);
            backward_with(&mut dx1, Some(&mut dw1), Some(&mut db1), &dy, &x, &w, n, c, oc, &mut scratch);
            prop_assert_eq!(bits(&dx1), bits(&dx0));
            prop_assert_eq!(bits(&dw1), bits(&dw0));
            prop_assert_eq!(bits(&db1), bits(&db0));
        }
    }

    /// The trainer's widths with gemm's real blocking (depth up to 3072, several panels at the
    /// default budget): still the f32 GEMM's bits.
    /// The weight gradient in slabs of rows is the single product's bits (full-precision
    /// values, depths over several of gemm's depth blocks, accumulating into non-zero
    /// gradients), slab edges and uneven last slabs included.
    #[test]
    fn weight_gradient_slabs_match_one_product_bit_for_bit() {
        for (oc, c, n) in [(4097, 5, 1100), (9000, 3, 700), (12289, 2, 40), (100, 3, 9)] {
            let full = |seed, len| -> Vec<f32> {
                f32_vec(seed, len)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * (1.0 + (i % 97) as f32 * 1.37e-3))
                    .collect()
            };
            let (dout, inp, start) = (full(1, n * oc), full(2, n * c), full(3, oc * c));
            let mut one = start.clone();
            gemm_into(
                &mut one,
                Strided::transposed(&dout, oc),
                Strided::rows(&inp, c),
                oc,
                c,
                n,
                true,
            );
            let mut slabs = start;
            weight_grad_in_slabs(&mut slabs, &dout, &inp, n, c, oc);
            assert_eq!(bits(&slabs), bits(&one), "oc {oc}, c {c}, n {n}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// The bf16 products read a bf16 input in place with the bits of its f32 copy
        /// (forward, input and weight gradients), and a frozen weight's backward needs no
        /// input at all: the same input gradient and bias gradient from an empty one.
        #[test]
        fn bf16_products_read_bf16_inputs_in_place(n in 1usize..40, c in 1usize..70,
                                                   oc in 1usize..90, seed in any::<u64>()) {
            let x = bf16_vec(seed, n * c);
            let xf = widened(&x);
            let w = bf16_vec(seed ^ 1, oc * c);
            let b = bf16_vec(seed ^ 2, oc);
            let dy = f32_vec(seed ^ 3, n * oc);
            let mut scratch = vec![0.0; forward_scratch(n, c, oc).max(backward_scratch(n, c, oc))];
            let (mut y_in_place, mut y_copy) = (vec![0.0; n * oc], vec![0.0; n * oc]);
            forward_bf16_products(&mut y_in_place, &x, &w, Some(&b), n, c, oc, &mut scratch);
            forward_bf16_products(&mut y_copy, &xf, &w, Some(&b), n, c, oc, &mut scratch);
            prop_assert_eq!(bits(&y_in_place), bits(&y_copy));
            let grads = |inp: Option<&[bf16]>, inp_f32: Option<&[f32]>, with_dw: bool,
                         scratch: &mut [f32]| {
                let (mut dx, mut dw, mut db) = (vec![0.5; n * c], vec![0.25; oc * c], vec![0.0; oc]);
                let dw_arg = if with_dw { Some(&mut dw[..]) } else { None };
                match (inp, inp_f32) {
                    (Some(i), _) => backward_bf16_products(&mut dx, dw_arg, Some(&mut db), &dy, i, &w, n, c, oc, scratch),
                    (_, Some(i)) => backward_bf16_products(&mut dx, dw_arg, Some(&mut db), &dy, i, &w, n, c, oc, scratch),
                    _ => unreachable!(),
                }
                [dx, dw, db].concat()
            };
            let in_place = grads(Some(&x), None, true, &mut scratch);
            prop_assert_eq!(bits(&in_place), bits(&grads(None, Some(&xf), true, &mut scratch)));
            let empty: &[f32] = &[];
            let frozen = grads(None, Some(empty), false, &mut scratch);
            prop_assert_eq!(bits(&frozen), bits(&grads(None, Some(&xf), false, &mut scratch)));
            // The same for the widening path's frozen backward.
            let (mut dx_empty, mut dx_full) = (vec![0.5; n * c], vec![0.5; n * c]);
            backward_with(&mut dx_empty, None, None, &dy, empty, &w, n, c, oc, &mut scratch);
            backward_with(&mut dx_full, None, None, &dy, &xf, &w, n, c, oc, &mut scratch);
            prop_assert_eq!(bits(&dx_empty), bits(&dx_full));
        }

        /// A bf16 output gradient gives the products the bits of its f32 original: both paths
        /// round `dout` to bf16 as they read it.
        #[test]
        fn bf16_products_read_a_bf16_output_gradient_as_its_f32_original(
            n in 1usize..40, c in 1usize..70, oc in 1usize..90, seed in any::<u64>()) {
            let x = f32_vec(seed, n * c);
            let w = bf16_vec(seed ^ 1, oc * c);
            // Not bf16 values: the rounding is what is compared.
            let dy: Vec<f32> = crate::ops::test_values(seed ^ 3, n * oc)
                .into_iter()
                .map(|v| v * 3.0 - 1.5)
                .collect();
            let dy16: Vec<bf16> = dy.iter().map(|&v| bf16::from_f32(v)).collect();
            let mut scratch = vec![0.0; backward_scratch(n, c, oc)];
            let (mut dx, mut dw) = (vec![0.5; n * c], vec![0.25; oc * c]);
            backward_bf16_products(&mut dx, Some(&mut dw), None, &dy, &x, &w, n, c, oc, &mut scratch);
            let (mut dx16, mut dw16) = (vec![0.5; n * c], vec![0.25; oc * c]);
            backward_bf16_products(&mut dx16, Some(&mut dw16), None, &dy16, &x, &w, n, c, oc, &mut scratch);
            prop_assert_eq!(bits(&dx16), bits(&dx));
            prop_assert_eq!(bits(&dw16), bits(&dw));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// The bf16 output is the f32 product rounded to nearest even, across strip
        /// boundaries and strips of both balanced widths, on the few-row dot products and the
        /// GEMM: bit for bit where the sums do not depend on the columns computed together (AMX
        /// tiles, row dots), within one bf16 rounding of the product elsewhere (gemm's f32 blocking
        /// may depend on the width).
        #[test]
        fn bf16_outputs_are_the_products_rounded(
            n in 1usize..40,
            c in 1usize..50,
            extra in 1usize..BF16_OUTPUT_STRIP + 40,
            seed in any::<u64>(),
        ) {
            let oc = BF16_OUTPUT_STRIP + extra;
            let x = f32_vec(seed, n * c);
            let w = bf16_vec(seed ^ 1, oc * c);
            let mut scratch = vec![0.0; forward_scratch(n, c, oc)];
            let mut whole = vec![0.0; n * oc];
            forward_bf16_products(&mut whole, &x, &w, None, n, c, oc, &mut scratch);
            let mut out = vec![bf16::ZERO; n * oc];
            let mut stage = vec![0.0; bf16_output_stage(n, n, c, oc)];
            forward_bf16_products_into_bf16(&mut out, &x, &w, n, c, oc, &mut stage, &mut scratch);
            let exact = n <= DOT_ROWS
                || super::super::bf16_gemm::bf16_gemm_path()
                    == super::super::bf16_gemm::Bf16GemmPath::Amx;
            for (i, (o, &f)) in out.iter().zip(&whole).enumerate() {
                if exact {
                    prop_assert_eq!(o.to_bits(), bf16::from_f32(f).to_bits(), "element {}", i);
                } else {
                    let err = (o.to_f32() - f).abs();
                    prop_assert!(err <= f.abs() * 2f32.powi(-7) + 1e-6, "element {}: {} vs {}", i, o, f);
                }
            }
        }
    }

    /// Past the deepest product the AMX tiles round themselves the bf16 output goes through
    /// f32 strips again (the proptest above takes depths the tiles round directly): the same
    /// rounding of the same sums, and a stage of the size [`bf16_output_stage`] asks for.
    #[test]
    fn deep_bf16_outputs_go_through_strips() {
        let (n, c, oc) = (
            37,
            super::super::bf16_gemm::KC_BF16_OUTPUT + 20,
            BF16_OUTPUT_STRIP + 300,
        );
        let x = f32_vec(3, n * c);
        let w = bf16_vec(4, oc * c);
        let mut scratch = vec![0.0; forward_scratch(n, c, oc)];
        let mut whole = vec![0.0; n * oc];
        forward_bf16_products(&mut whole, &x, &w, None, n, c, oc, &mut scratch);
        let stage_len = bf16_output_stage(n, n, c, oc);
        assert_eq!(stage_len, n * BF16_OUTPUT_STRIP);
        let mut out = vec![bf16::from_bits(0x7fc1); n * oc];
        let mut stage = vec![f32::NAN; stage_len];
        forward_bf16_products_into_bf16(&mut out, &x, &w, n, c, oc, &mut stage, &mut scratch);
        if bf16_products() {
            for (i, (o, &f)) in out.iter().zip(&whole).enumerate() {
                assert_eq!(o.to_bits(), bf16::from_f32(f).to_bits(), "element {i}");
            }
        }
        // Where the tiles round their own output, no stage at all.
        let direct = bf16_products() && n > DOT_ROWS;
        assert_eq!(bf16_output_stage(n, n, 48, oc) == 0, direct);
        // The head's scratch holds the one product's packing on any thread count, so the
        // kernel never packs into a buffer of its own (which no tracker would see).
        for threads in [1, 2, 16, 64] {
            let head = head_scratch(2048, 2048, 384, 50257, true, true, threads);
            if direct {
                let pack = super::super::bf16_gemm::pack_len_into_bf16(2048, 50257, 384, threads);
                assert!(
                    2 * head >= pack,
                    "{threads} threads: {head} f32 for {pack} u16"
                );
            }
        }
        // A short last chunk that the row dot products take still gets a stage.
        assert_eq!(
            bf16_output_stage(n + 2, n, 48, oc),
            if direct {
                2 * BF16_OUTPUT_STRIP
            } else {
                n * BF16_OUTPUT_STRIP
            }
        );
    }

    #[test]
    fn trainer_widths_match_f32_bits() {
        for &(m, c, oc) in &[
            (67, 768, 2304),
            (130, 3072, 768),
            (5, 384, 1000),
            (2, 700, 300),
        ] {
            let x = f32_vec(11, m * c);
            let w = bf16_vec(12, oc * c);
            let wf = widened(&w);
            let mut scratch = vec![0.0; forward_scratch(m, c, oc).max(backward_scratch(m, c, oc))];
            let (mut want, mut got) = (vec![0.0; m * oc], vec![0.0; m * oc]);
            forward(&mut want, &x, &wf, None, m, c, oc);
            forward_with(&mut got, &x, &w, None, m, c, oc, &mut scratch);
            if m > DOT_ROWS {
                assert_eq!(bits(&got), bits(&want), "forward {m}x{c}x{oc}");
            }
            let dy = f32_vec(13, m * oc);
            let (mut dx0, mut dw0) = (vec![0.0; m * c], vec![0.0; oc * c]);
            let (mut dx1, mut dw1) = (dx0.clone(), dw0.clone());
            backward(&mut dx0, &mut dw0, None, &dy, &x, &wf, m, c, oc);
            backward_with(
                &mut dx1,
                Some(&mut dw1),
                None,
                &dy,
                &x,
                &w,
                m,
                c,
                oc,
                &mut scratch,
            );
            assert_eq!(bits(&dx1), bits(&dx0), "input gradient {m}x{c}x{oc}");
            assert_eq!(bits(&dw1), bits(&dw0), "weight gradient {m}x{c}x{oc}");
        }
    }

    /// `start + x · W` with the low-precision weight `w` `[k, n]` through the panels (cut at
    /// gemm's blocks where they apply), asserted bit for bit equal to the f32 GEMM on the
    /// widened weight; returns it.
    fn cut_input_gradient<W: Operand>(
        x: &[f32],
        w: &[W],
        start: &[f32],
        m: usize,
        n: usize,
        k: usize,
        scratch: &mut [f32],
    ) -> Vec<f32> {
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let (mut want, mut got) = (start.to_vec(), start.to_vec());
        let lhs = Strided::rows(x, k);
        gemm_into(&mut want, lhs, Strided::rows(&wf, n), m, n, k, true);
        gemm_weight(&mut got, lhs, w, false, m, n, k, true, scratch, PANEL_BYTES);
        assert_eq!(bits(&got), bits(&want), "input gradient {m}x{k}x{n}");
        got
    }

    /// Products deep enough for gemm to block their depth (several blocks, a shorter last
    /// one): cut at gemm's blocks, a bf16 weight still gives the f32 GEMM's bits in both
    /// layouts (an f16 one too), and the f64 reference within the bound.
    #[test]
    fn deep_products_cut_at_gemm_blocks_match_f32_bits() {
        for &(m, k, n) in &[
            (70, 1100, 90),
            (5, 2600, 200),
            (96, 4100, 64),
            (130, 20011, 40),
        ] {
            let plan = panel_plan(m, n, k, PANEL_BYTES);
            if gemm_f32_tile().is_some() && (m > 64 || n > 64) {
                assert!(
                    plan.depth < k,
                    "{m}x{k}x{n}: expected a depth cut, got {plan:?}"
                );
            }
            let x = f32_vec(21, m * k);
            let wt = bf16_vec(22, n * k);
            let mut scratch = vec![f32::NAN; plan.scratch()];
            let (mut want, mut got) = (vec![0.0; m * n], vec![f32::NAN; m * n]);
            gemm_forward(&mut want, &x, &widened(&wt), m, k, n);
            gemm_weight(
                &mut got,
                Strided::rows(&x, k),
                &wt,
                true,
                m,
                n,
                k,
                false,
                &mut scratch,
                PANEL_BYTES,
            );
            assert_eq!(bits(&got), bits(&want), "forward {m}x{k}x{n}");
            let w = bf16_vec(23, k * n);
            let wf = widened(&w);
            let start = f32_vec(24, m * n);
            let got = cut_input_gradient(&x, &w, &start, m, n, k, &mut scratch);
            // f16 weights take the same cut (their own widening).
            let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
            cut_input_gradient(&x, &wh, &start, m, n, k, &mut scratch);
            if k <= 4100 {
                for ((g, s), (r, tol)) in got.iter().zip(&start).zip(reference(&x, &wf, m, n, k)) {
                    let r = r + *s as f64;
                    let tol = tol + (r.abs() + tol) * f64::powi(2.0, -23);
                    assert!((*g as f64 - r).abs() <= tol, "{g} vs {r} (tol {tol})");
                }
            }
        }
    }

    /// [`backward_with_bf16_grad`] against [`backward_with`] on the widened gradient, bit for
    /// bit: input, weight and bias gradients accumulated onto non-zero starts. The weight as
    /// bf16 and as f32.
    fn check_bf16_grad_backward(n: usize, c: usize, oc: usize, seed: u64) {
        let dout = bf16_vec(seed, n * oc);
        let doutf = widened(&dout);
        let inp = f32_vec(seed ^ 1, n * c);
        let w = bf16_vec(seed ^ 2, oc * c);
        let wf = widened(&w);
        let (dx0, dw0, db0) = (
            f32_vec(seed ^ 3, n * c),
            f32_vec(seed ^ 4, oc * c),
            f32_vec(seed ^ 5, oc),
        );
        let (mut want_dx, mut want_dw, mut want_db) = (dx0.clone(), dw0.clone(), db0.clone());
        let mut want_scratch = vec![f32::NAN; backward_scratch(n, c, oc)];
        backward_with(
            &mut want_dx,
            Some(&mut want_dw),
            Some(&mut want_db),
            &doutf,
            &inp,
            &w,
            n,
            c,
            oc,
            &mut want_scratch,
        );
        let mut scratch = vec![f32::NAN; backward_bf16_grad_scratch(n, c, oc)];
        for as_f32 in [false, true] {
            let (mut dx, mut dw, mut db) = (dx0.clone(), dw0.clone(), db0.clone());
            let args = (
                &mut dx,
                Some(&mut dw[..]),
                Some(&mut db[..]),
                &dout[..],
                &inp[..],
            );
            if as_f32 {
                backward_with_bf16_grad(
                    args.0,
                    args.1,
                    args.2,
                    args.3,
                    args.4,
                    &wf,
                    n,
                    c,
                    oc,
                    &mut scratch,
                );
            } else {
                backward_with_bf16_grad(
                    args.0,
                    args.1,
                    args.2,
                    args.3,
                    args.4,
                    &w,
                    n,
                    c,
                    oc,
                    &mut scratch,
                );
            }
            let at = format!("{n}x{c}x{oc}, f32 weight {as_f32}");
            assert_eq!(bits(&dx), bits(&want_dx), "input gradient, {at}");
            assert_eq!(bits(&dw), bits(&want_dw), "weight gradient, {at}");
            assert_eq!(bits(&db), bits(&want_db), "bias gradient, {at}");
        }
    }

    /// [`forward_with_into_bf16`] against [`forward_with`] on the whole weight, rounded.
    fn check_forward_into_bf16(n: usize, c: usize, oc: usize, seed: u64) {
        let x = f32_vec(seed, n * c);
        let w = bf16_vec(seed ^ 7, oc * c);
        let mut whole = vec![f32::NAN; n * oc];
        let mut scratch = vec![f32::NAN; forward_scratch(n, c, oc)];
        forward_with(&mut whole, &x, &w, None, n, c, oc, &mut scratch);
        let want: Vec<u16> = whole
            .iter()
            .map(|&v| headroom_tensor::cpu::kernels::f32_to_bf16_bits(v))
            .collect();
        let mut got = vec![bf16::from_bits(0x7fc1); n * oc];
        let mut stage = vec![f32::NAN; n * oc.min(BF16_OUTPUT_STRIP)];
        let mut scratch = vec![f32::NAN; forward_into_bf16_scratch(n, c, oc)];
        forward_with_into_bf16(&mut got, &x, &w, n, c, oc, &mut stage, &mut scratch);
        let got: Vec<u16> = got.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "{n}x{c}x{oc}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Small shapes, cut or not: a bf16 output gradient gives [`backward_with`]'s bits on
        /// its widened values; a bf16 output is the whole f32 product rounded.
        #[test]
        fn bf16_outputs_and_output_gradients_on_the_widening_path(
            n in 1usize..40, c in 1usize..70, oc in 1usize..400, seed in any::<u64>(),
        ) {
            check_bf16_grad_backward(n, c, oc, seed);
            check_forward_into_bf16(n, c, oc, seed);
        }
    }

    /// The head's kind of shapes, with gemm's real blocking: outputs of several strips
    /// (balanced, none narrow), gradients deep enough for several of gemm's depth blocks and
    /// so several weight-gradient slabs, few-row products; all bit for bit the
    /// f32 paths'. Where gemm's blocking is known, the wide products are the cut ones.
    #[test]
    fn head_shaped_bf16_logits_keep_the_f32_paths_bits() {
        for &(n, c, oc) in &[
            (70, 90, 3100),
            (130, 48, 2049),
            (600, 40, 9000),
            (3, 64, 2500),
            (5, 200, 1100),
        ] {
            if gemm_f32_tile().is_some() && n > 64 {
                assert!(
                    bf16_grad_pieces(n, c, oc),
                    "{n}x{c}x{oc}: expected a depth cut"
                );
            }
            check_forward_into_bf16(n, c, oc, 31);
            check_bf16_grad_backward(n, c, oc, 32);
        }
        assert!(!bf16_grad_pieces(3, 64, 2500));
    }

    /// On the CPUs this module knows the tiles of, the run-time check accepts one of them (so
    /// the depth cut is in use where the benchmarks and CI run), the first that gemm's blocks
    /// match; and the check rejects a tile whose blocks are not gemm's.
    #[test]
    fn depth_blocking_is_verified_where_the_tile_is_known() {
        let tiles = gemm_f32_tiles();
        let verified = gemm_f32_tile();
        assert_eq!(verified.is_some(), !tiles.is_empty(), "{tiles:?}");
        if let Some((mr, nr)) = verified {
            let at = tiles.iter().position(|&t| t == (mr, nr)).unwrap();
            // Every more likely candidate was tried and failed.
            for &(r, c) in &tiles[..at] {
                assert!(
                    !probe_depth_blocks(r, c),
                    "tile {r}x{c} passed but was skipped"
                );
            }
            // A tile that gives a different block length must fail the probe.
            let kc = gemm_kc(2100, mr, nr);
            let wrong = [(4, 1), (1, 2), (256, 1), (8, 6), (128, 6)]
                .into_iter()
                .find(|&(r, c)| gemm_kc(2100, r, c) != kc);
            if let Some((r, c)) = wrong {
                assert!(!probe_depth_blocks(r, c), "tile {r}x{c} passed the probe");
            }
        }
    }

    /// Panels tile the columns exactly, each at least `PANEL_MIN` wide when there are several,
    /// and the widest fits the advertised scratch.
    #[test]
    fn panels_tile_the_columns() {
        for m in [1, 3, 4, 100] {
            for k in [1, 7, 384, 3072, 50257] {
                for n in [1, 79, 80, 159, 160, 161, 768, 2304, 50257] {
                    let plan = panel_plan(m, n, k, PANEL_BYTES);
                    let (count, widest) = (plan.count, plan.widest);
                    assert!(plan.depth >= 1.min(k) && plan.depth <= k);
                    if plan.depth < k {
                        assert!(count == 1 || plan.scratch() <= PANEL_BYTES / 4 * 2);
                    }
                    let mut next = 0;
                    for j in 0..count {
                        let r = panel_range(n, count, j);
                        assert_eq!(r.start, next);
                        assert!(r.len() <= widest);
                        assert!(count == 1 || r.len() >= PANEL_MIN);
                        next = r.end;
                    }
                    assert_eq!(next, n);
                }
            }
        }
    }
}
