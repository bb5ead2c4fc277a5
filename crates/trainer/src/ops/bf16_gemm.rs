//! A bf16 GEMM: `c[m, n] (+)= a[m, k] · b[k, n]` with both operands rounded to bf16 and the
//! products summed in f32 — torch's bf16 `matmul` numerics — on Intel AMX tiles where the CPU
//! and the OS have them, and on the f32 `gemm` crate over the rounded values elsewhere.
//!
//! ```
//! use headroom_trainer::ops::bf16_gemm::gemm_bf16;
//! use headroom_trainer::ops::strided::Strided;
//! let a = [1.0f32, 2.0, 3.0, 4.0]; // [2, 2]
//! let b = [half::bf16::from_f32(0.5); 4]; // [2, 2]
//! let mut c = [0.0f32; 4];
//! gemm_bf16(&mut c, 2, Strided::rows(&a[..], 2), Strided::rows(&b[..], 2), 2, 2, 2, false);
//! assert_eq!(c, [1.5, 1.5, 3.5, 3.5]);
//! ```
//!
//! # Why AMX and not the AVX512-BF16 dot product
//! Measured on the Xeon (Sapphire Rapids class) these figures come from: `vdpbf16ps` on zmm
//! registers retires 0.6 of f32 `vfmadd`'s multiply-adds per cycle (61.6 vs 103 GMAC/s on one
//! core, 12 and 24 independent accumulators alike), so a `vdpbf16ps` GEMM would be *slower*
//! than gemm's f32 kernel. One AMX `tdpbf16ps` does 16×16×32 multiply-adds; the same core
//! retires 1 920 GMAC/s of them from L1 (`benches/results/2026-11-24-cpu-2core-amx-bf16.md`).
//!
//! # Numerics
//! - Operands: f32 inputs are rounded to bf16 to nearest even while they are packed (NaN stays
//!   NaN); bf16 inputs are taken as they are. Products of two bf16 values are exact in f32.
//! - Sums: `tdpbf16ps` adds each pair of products to the f32 accumulator, rounding to nearest
//!   even (denormal inputs and outputs are flushed to zero, as Intel documents for AMX-BF16).
//!   The depth is walked in blocks of [`KC`]; each block's sums go through the f32 output.
//!   A bf16 output ([`gemm_bf16_into_bf16`]) is one block of the whole depth instead, rounded
//!   once; the f32 values it rounds are the blocked ones bit for bit (an f32 partial sum
//!   passes through the f32 output unchanged).
//!   So `|c − exact| ≤ k·2⁻²³·Σ|a·b|` (plus flushed denormals) against an f64 product of the
//!   rounded inputs — the bound the tests check, on both paths.
//! - The fallback path (no AMX) widens the rounded values to f32 and calls the f32 GEMM: the
//!   same bound, other bits. The two paths are not bit-identical to each other.
//!
//! # Layout
//! AMX multiplies tiles of 16 rows × 64 bytes. `a` is packed as 16×32 bf16 tiles (rows of
//! `a`, 32 depth values each); `b` in the "VNNI" pairing the instruction wants: tile row `p`
//! holds `b[2p][j], b[2p+1][j]` for its 16 columns `j`. Depth, row and column tails are padded
//! with zeros, which add nothing. The kernel keeps a 2×2 block of 16×16 f32 output tiles in
//! the eight tile registers (four outputs, two of `a`, two of `b`). A tall product shares one
//! [`KC`] × [`NC`] panel of packed `b` (≤ 1 MiB) between the threads, each packing and running
//! its own [`MC`]-row slabs of `a`; a wide one (more columns than rows) gives each thread its
//! own column panels of `b`, packed into its own cache (measured: the head's 128-row products
//! went from 1.26–1.41× to 1.35–1.47× the f32 GEMM's throughput). Full tiles of `b` are
//! converted along contiguous memory and rearranged on the stack, not scattered element by
//! element (the head's products then rose to 1.69–1.80×).

use gemm::Parallelism;
use half::bf16;

use super::strided::Strided;

/// Depth of one packed block (a multiple of 32, the depth of one tile).
pub const KC: usize = 512;
/// Columns of one packed `b` panel (a multiple of 32: two tiles).
pub const NC: usize = 1024;
/// The deepest product whose bf16 output [`gemm_bf16_into_bf16`] rounds on the tiles: it runs
/// the whole depth as one block (GPT-2's 768 and 1024 channels as well as `small`'s 384), since
/// a value rounded between blocks would not be the finished sum. Past [`KC`] its panels of `b`
/// are narrowed so that one holds no more than [`KC`] × [`NC`] values.
pub const KC_BF16_OUTPUT: usize = 1024;
/// Rows of `a` one thread packs and runs at a time (a multiple of 32: two tiles).
pub const MC: usize = 64;

/// A value a bf16 GEMM operand may be given in.
pub trait Bf16Source: Copy + Send + Sync + 'static {
    /// The bf16 bits of this value (f32 rounds to nearest even; bf16 is itself).
    fn bf16_bits(self) -> u16;
    /// The value itself as f32 (exact for both: bf16 widens without rounding).
    fn to_f32(self) -> f32;
    /// `dst[i] = src[i].bf16_bits()`, equal lengths: the packing's inner loop.
    fn bits_into(src: &[Self], dst: &mut [u16]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d = s.bf16_bits());
    }
    /// [`Bf16Source::bits_into`] for one full tile row (32 values). The fixed length lets the
    /// copy be a few vector moves instead of a `memcpy` call per 64 bytes, which was 15% of
    /// the AMX bf16 training step when a bf16 activation was packed through `bits_into`.
    #[inline(always)]
    fn run_into(src: &[Self; 32], dst: &mut [u16; 32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s.bf16_bits();
        }
    }
}

/// f32 → bf16 bits, to nearest even, NaN kept quiet: `half::bf16::from_f32`'s bits (tested),
/// written without branches so that the packing loops vectorise. (On the baseline ISA: an
/// AVX-512 build of the packing's conversion loop made the bf16 training step ~10% slower on
/// the AMX machine these figures come from, so it is not dispatched to.)
#[inline(always)]
fn round_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((b >> 16) as u16) | 0x40;
    if x.is_nan() {
        quiet_nan
    } else {
        rounded
    }
}

impl Bf16Source for f32 {
    #[inline]
    fn bf16_bits(self) -> u16 {
        round_to_bf16_bits(self)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Bf16Source for bf16 {
    #[inline]
    fn bf16_bits(self) -> u16 {
        self.to_bits()
    }
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn bits_into(src: &[bf16], dst: &mut [u16]) {
        dst.copy_from_slice(bytemuck::cast_slice(src));
    }
    #[inline(always)]
    fn run_into(src: &[bf16; 32], dst: &mut [u16; 32]) {
        *dst = bytemuck::cast(*src);
    }
}

impl<T: Bf16Source> Strided<'_, T> {
    /// The bf16 bits of element `(r, c)`.
    #[inline]
    fn bits_at(&self, r: usize, c: usize) -> u16 {
        self.get(r, c).bf16_bits()
    }
}

/// Which path [`gemm_bf16`] takes on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16GemmPath {
    /// AMX-BF16 tiles (the CPU has AMX-TILE and AMX-BF16 and the OS granted the tile state).
    Amx,
    /// The rounded operands widened to f32, through the f32 `gemm` crate.
    F32Gemm,
}

/// The path [`gemm_bf16`] takes here, decided once per process.
pub fn bf16_gemm_path() -> Bf16GemmPath {
    static PATH: std::sync::OnceLock<Bf16GemmPath> = std::sync::OnceLock::new();
    *PATH.get_or_init(|| {
        if headroom_tensor::isa::allows(headroom_tensor::isa::IsaLevel::Amx) && amx::available() {
            Bf16GemmPath::Amx
        } else {
            Bf16GemmPath::F32Gemm
        }
    })
}

/// `c[m, n] (+)= a[m, k] · b[k, n]`, `c` row-major with row stride `ldc` ≥ `n`, both operands
/// rounded to bf16, f32 sums (see the module notes); accumulates into `c` when `accumulate`,
/// overwrites it otherwise. Threaded on rayon's pool.
///
/// # Panics
/// When a matrix does not lie inside its slice, or `ldc < n`.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16<A: Bf16Source, B: Bf16Source>(
    c: &mut [f32],
    ldc: usize,
    a: Strided<'_, A>,
    b: Strided<'_, B>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    gemm_bf16_with(c, ldc, a, b, m, n, k, accumulate, &mut []);
}

/// [`gemm_bf16`] packing `b` into `pack` where it holds at least one 32-column panel of the
/// depth block (`32 · min(k, KC)` rounded up to whole tiles, in u16), so that a caller's
/// tracked scratch holds the packed operand; otherwise into a buffer of its own of
/// [`NC`] columns. Panels are as wide as `pack` allows, up to [`NC`]. The results do not
/// depend on `pack`: each output element's sums run over the same depth blocks in the same
/// order whatever the panel width, the row split or the thread count.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_with<A: Bf16Source, B: Bf16Source>(
    c: &mut [f32],
    ldc: usize,
    a: Strided<'_, A>,
    b: Strided<'_, B>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    pack: &mut [u16],
) {
    check_shapes(c.len(), ldc, &a, &b, m, n, k);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.chunks_mut(ldc).take(m).for_each(|r| r[..n].fill(0.0));
        }
        return;
    }
    match bf16_gemm_path() {
        Bf16GemmPath::Amx => amx::gemm(c, ldc, a, b, m, n, k, accumulate, pack),
        Bf16GemmPath::F32Gemm => gemm_widened(c, ldc, a, b, m, n, k, accumulate),
    }
}

/// Whether [`gemm_bf16_into_bf16`] computes an `m × n` product of depth `k` on this machine:
/// on AMX tiles, in one depth block (at most [`KC_BF16_OUTPUT`]).
pub fn bf16_output_on_tiles(k: usize) -> bool {
    bf16_gemm_path() == Bf16GemmPath::Amx && k <= KC_BF16_OUTPUT
}

/// [`gemm_bf16_with`] overwriting a bf16 `c` with the f32 results rounded to nearest even (NaN
/// kept quiet): the bits of `gemm_bf16_with` followed by the tensor crate's `narrow_bf16`,
/// without an f32 output. Each output tile is rounded as it leaves the AMX tile registers,
/// after the whole depth (one block), so where [`bf16_output_on_tiles`] is false (no AMX, or a
/// depth past [`KC_BF16_OUTPUT`], whose partial sums would have to be kept in f32) it returns
/// `false` and leaves `c` untouched. Its packing buffer holds the whole depth: size it by
/// [`pack_len_into_bf16`].
///
/// # Panics
/// As [`gemm_bf16`].
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_into_bf16<A: Bf16Source, B: Bf16Source>(
    c: &mut [bf16],
    ldc: usize,
    a: Strided<'_, A>,
    b: Strided<'_, B>,
    m: usize,
    n: usize,
    k: usize,
    pack: &mut [u16],
) -> bool {
    if !bf16_output_on_tiles(k) {
        return false;
    }
    check_shapes(c.len(), ldc, &a, &b, m, n, k);
    if m == 0 || n == 0 {
        return true;
    }
    let bits: &mut [u16] = bytemuck::cast_slice_mut(c);
    if k == 0 {
        bits.chunks_mut(ldc).take(m).for_each(|r| r[..n].fill(0));
        return true;
    }
    amx::gemm_into_bf16(bits, ldc, a, b, m, n, k, pack);
    true
}

/// The shape checks of [`gemm_bf16_with`] and [`gemm_bf16_into_bf16`]: both matrices inside
/// their slices, `c` (`c_len` elements) holding `[m, n]` at row stride `ldc` ≥ `n`.
#[allow(clippy::too_many_arguments)]
fn check_shapes<A: Bf16Source, B: Bf16Source>(
    c_len: usize,
    ldc: usize,
    a: &Strided<'_, A>,
    b: &Strided<'_, B>,
    m: usize,
    n: usize,
    k: usize,
) {
    assert!(ldc >= n, "gemm_bf16: ldc {ldc} < n {n}");
    assert!(
        a.covers(m, k),
        "gemm_bf16: a is not [{m}, {k}] inside its slice"
    );
    assert!(
        b.covers(k, n),
        "gemm_bf16: b is not [{k}, {n}] inside its slice"
    );
    assert!(
        m == 0 || n == 0 || c_len >= (m - 1) * ldc + n,
        "gemm_bf16: c is not [{m}, {n}] at row stride {ldc}"
    );
}

/// The depth blocks of a product of depth `k`: [`KC`] for an f32 output, the whole depth for
/// a bf16 one ([`gemm_bf16_into_bf16`]). The block never moves a bit of an f32 output (each
/// block's sums go through it exactly); a bf16 output has to see the finished sums.
fn depth_block(k: usize, bf16_output: bool) -> usize {
    if bf16_output {
        k.max(1)
    } else {
        KC.min(k).max(1)
    }
}

/// The widest panel of `b` for depth blocks of `kc`: [`NC`] columns up to [`KC`], fewer for
/// deeper blocks, so that a packed panel never outgrows `KC × NC` values (1 MiB, which a
/// core's L2 holds beside its slab of `a`).
fn panel_width(kc: usize) -> usize {
    (NC * KC / kc.max(KC) / 32 * 32).max(32)
}

/// u16 elements of one pair of packed `b` tiles (32 columns) over a depth block of `kc`.
fn tile_pair(kc: usize) -> usize {
    2 * kc.div_ceil(32) * 512
}

/// How the AMX kernel splits the columns of a wide product (`n > m`, several threads):
/// `(groups, panels, width)`: `groups` threads each own the panels `p ≡ g (mod groups)` of
/// `width` columns (a multiple of 32, at most `widest`), `panels` of them in all.
fn column_split(n: usize, threads: usize, widest: usize) -> (usize, usize, usize) {
    let groups = threads.min(n.div_ceil(32));
    let panels = groups * n.div_ceil(groups * widest);
    let width = n.div_ceil(panels).next_multiple_of(32);
    let panels = n.div_ceil(width);
    (groups.min(panels), panels, width)
}

/// u16 elements of the packing buffer that lets [`gemm_bf16_with`] pack all of `b` for an
/// `m × n` product of depth `k` on `threads` threads in the caller's buffer (its widest panels),
/// so that the gemm allocates none of its own: what a caller sizes its tracked scratch by.
/// Zero when the product is empty.
pub fn pack_len(m: usize, n: usize, k: usize, threads: usize) -> usize {
    pack_len_for(m, n, k, threads, depth_block(k, false))
}

/// [`pack_len`] for [`gemm_bf16_into_bf16`], whose one depth block is the whole depth.
pub fn pack_len_into_bf16(m: usize, n: usize, k: usize, threads: usize) -> usize {
    pack_len_for(m, n, k, threads, depth_block(k, true))
}

/// [`pack_len`] for depth blocks of `kc`.
fn pack_len_for(m: usize, n: usize, k: usize, threads: usize, kc: usize) -> usize {
    if m == 0 || n == 0 || k == 0 {
        return 0;
    }
    let widest = panel_width(kc);
    if n > m && threads > 1 {
        let (groups, _, width) = column_split(n, threads, widest);
        groups * (width / 32) * tile_pair(kc)
    } else {
        n.min(widest).div_ceil(32) * tile_pair(kc)
    }
}

/// The portable path: both operands rounded to bf16 and widened into dense f32 copies, then
/// gemm's f32 product. Also the reference shape of the AMX path's results.
#[allow(clippy::too_many_arguments)]
pub fn gemm_widened<A: Bf16Source, B: Bf16Source>(
    c: &mut [f32],
    ldc: usize,
    a: Strided<'_, A>,
    b: Strided<'_, B>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    let widen = |bits: u16| f32::from_bits(u32::from(bits) << 16);
    let aw: Vec<f32> = (0..m * k).map(|i| widen(a.bits_at(i / k, i % k))).collect();
    let bw: Vec<f32> = (0..k * n).map(|i| widen(b.bits_at(i / n, i % n))).collect();
    let par = match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        t => Parallelism::Rayon(t),
    };
    // SAFETY: `aw` is [m, k] and `bw` [k, n], dense; `c` holds [m, n] at row stride `ldc`
    // (asserted by the caller) and is a distinct mutable borrow.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            accumulate,
            aw.as_ptr(),
            1,
            k as isize,
            bw.as_ptr(),
            1,
            n as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// Packing, shared by the AMX kernel and its tests (plain Rust, no AMX needed). Each layout is
/// filled by runs along the source's contiguous direction, converted a run at a time.
mod pack {
    use super::{Bf16Source, Strided};

    /// Rows `r0..r0 + rows` and depth `k0..k0 + depth` of `a` as 16×32 tiles, row tile by row
    /// tile, depth tile after depth tile within each: element `(r, d)` at
    /// `((r / 16) · kt + d / 32) · 512 + (r % 16) · 32 + d % 32`, `kt = ceil(depth / 32)`;
    /// rows and depth past the ends are zero. Every element of the `ceil(rows / 16) · kt`
    /// tiles is written, so `dst` may hold anything before.
    ///
    /// The order tiles are filled in follows the source, not `dst` (the layout is the same
    /// either way): a source cache line is read whole as soon as it arrives. With depth
    /// contiguous, each source row's run over the whole depth is read once from end to end;
    /// with rows contiguous (a transpose), depth tile by depth tile, every row tile of it,
    /// with the next depth tile's runs asked for ahead: consecutive depth values lie a whole
    /// source row apart (the head's logits gradient: 100 KiB), which the hardware prefetchers
    /// do not follow (measured: `benches/results/2026-11-29-cpu-2core-amx-a-packing-order.md`).
    pub(super) fn a_tiles<T: Bf16Source>(
        a: &Strided<'_, T>,
        r0: usize,
        rows: usize,
        k0: usize,
        depth: usize,
        dst: &mut [u16],
    ) {
        let kt = depth.div_ceil(32);
        let mt = rows.div_ceil(16);
        debug_assert!(dst.len() >= mt * kt * 512);
        if a.col_stride == 1 {
            let full_kt = depth / 32;
            for ti in 0..mt {
                let tile_rows = 16.min(rows - ti * 16);
                if tile_rows == 16 && full_kt > 0 {
                    // Each source row's run of `full_kt · 32` depth values, converted a tile
                    // row at a time into its place in each depth tile.
                    for tr in 0..16 {
                        let src =
                            &a.data[(r0 + ti * 16 + tr) * a.row_stride + k0..][..full_kt * 32];
                        for (tk, run) in src.chunks_exact(32).enumerate() {
                            T::run_into(
                                run.try_into().expect("32 values"),
                                (&mut dst[(ti * kt + tk) * 512 + tr * 32..][..32])
                                    .try_into()
                                    .expect("a tile row"),
                            );
                        }
                    }
                    if full_kt < kt {
                        a_tile(a, r0, rows, k0, depth, ti, full_kt, kt, dst);
                    }
                } else {
                    for tk in 0..kt {
                        a_tile(a, r0, rows, k0, depth, ti, tk, kt, dst);
                    }
                }
            }
        } else if a.row_stride == 1 {
            for tk in 0..kt {
                let next = (tk + 1) * 32;
                for dk in next..depth.min(next + 32) {
                    prefetch_run(&a.data[(k0 + dk) * a.col_stride + r0..][..rows]);
                }
                for ti in 0..mt {
                    a_tile(a, r0, rows, k0, depth, ti, tk, kt, dst);
                }
            }
        } else {
            for ti in 0..mt {
                for tk in 0..kt {
                    a_tile(a, r0, rows, k0, depth, ti, tk, kt, dst);
                }
            }
        }
    }

    /// Tile `(ti, tk)` of [`a_tiles`]'s layout, every element written.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn a_tile<T: Bf16Source>(
        a: &Strided<'_, T>,
        r0: usize,
        rows: usize,
        k0: usize,
        depth: usize,
        ti: usize,
        tk: usize,
        kt: usize,
        dst: &mut [u16],
    ) {
        let tile_rows = 16.min(rows - ti * 16);
        let tile_depth = 32.min(depth - tk * 32);
        let tile = &mut dst[(ti * kt + tk) * 512..][..512];
        let (r1, d1) = (r0 + ti * 16, k0 + tk * 32);
        let full = tile_rows == 16 && tile_depth == 32;
        if full && a.col_stride == 1 {
            // Each row's 32 depth values are one tile row.
            for (tr, row) in tile.chunks_exact_mut(32).enumerate() {
                let src = &a.data[(r1 + tr) * a.row_stride + d1..][..32];
                T::run_into(
                    src.try_into().expect("32 values"),
                    row.try_into().expect("a tile row"),
                );
            }
            return;
        }
        if full && a.row_stride == 1 {
            // A transpose (the weight gradient's `doutᵀ`): convert along the 16 contiguous
            // rows of each depth column, then transpose 32×16 → 16×32.
            full_transposed_a_tile(a, r1, d1, tile);
            return;
        }
        tile.fill(0);
        if a.col_stride == 1 {
            // Depth contiguous: each row's run is one tile row.
            for tr in 0..tile_rows {
                let src = &a.data[(r1 + tr) * a.row_stride + d1..][..tile_depth];
                T::bits_into(src, &mut tile[tr * 32..][..tile_depth]);
            }
        } else {
            // Rows contiguous (a transpose) or neither: a tile column at a time.
            let mut run = [0u16; 16];
            for dk in 0..tile_depth {
                let run = &mut run[..tile_rows];
                if a.row_stride == 1 {
                    T::bits_into(&a.data[(d1 + dk) * a.col_stride + r1..][..tile_rows], run);
                } else {
                    run.iter_mut()
                        .enumerate()
                        .for_each(|(tr, x)| *x = a.bits_at(r1 + tr, d1 + dk));
                }
                for (tr, &x) in run.iter().enumerate() {
                    tile[tr * 32 + dk] = x;
                }
            }
        }
    }

    /// Ask for the cache lines holding `run` ahead of use (a hint; no effect on results).
    #[inline(always)]
    fn prefetch_run<T>(run: &[T]) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let start = run.as_ptr() as usize;
            let end = start + std::mem::size_of_val(run);
            // Every line from the one holding the first byte to the one holding the last.
            let mut line = start & !63;
            while line < end {
                // SAFETY: a prefetch does not access memory architecturally; the line holds a
                // byte of `run`.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
                line += 64;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = run;
    }

    /// A full 16-row, 32-deep tile of an `a` whose rows are contiguous: depth column `dk`'s
    /// 16 values converted into `natural[dk]`, then `tile[tr·32 + dk] = natural[dk][tr]`.
    fn full_transposed_a_tile<T: Bf16Source>(
        a: &Strided<'_, T>,
        r1: usize,
        d1: usize,
        tile: &mut [u16],
    ) {
        let mut natural = [[0u16; 16]; 32];
        for (dk, column) in natural.iter_mut().enumerate() {
            T::bits_into(&a.data[(d1 + dk) * a.col_stride + r1..][..16], column);
        }
        for (tr, row) in tile.chunks_exact_mut(32).enumerate() {
            for (dk, slot) in row.iter_mut().enumerate() {
                *slot = natural[dk][tr];
            }
        }
    }

    /// Depth `k0..k0 + depth` and columns `c0..c0 + cols` of `b` as VNNI tiles: column tile by
    /// column tile, depth tile after depth tile within each; tile row `p` holds
    /// `b[2p][j], b[2p+1][j]` for `j` in the tile's 16 columns: element `(d, j)` at
    /// `((j / 16) · kt + d / 32) · 512 + ((d % 32) / 2) · 32 + (j % 16) · 2 + d % 2`. Zero past
    /// the ends.
    pub(super) fn b_tiles<T: Bf16Source>(
        b: &Strided<'_, T>,
        k0: usize,
        depth: usize,
        c0: usize,
        cols: usize,
        dst: &mut [u16],
    ) {
        let kt = depth.div_ceil(32);
        let nt = cols.div_ceil(16);
        debug_assert!(dst.len() >= nt * kt * 512);
        for tj in 0..nt {
            let tile_cols = 16.min(cols - tj * 16);
            for tk in 0..kt {
                let tile_depth = 32.min(depth - tk * 32);
                let tile = &mut dst[(tj * kt + tk) * 512..][..512];
                let (j1, d1) = (c0 + tj * 16, k0 + tk * 32);
                if tile_cols == 16 && tile_depth == 32 && (b.row_stride == 1 || b.col_stride == 1) {
                    // Every element written: no zeroing first (it was 4–7% of the head's
                    // products).
                    full_b_tile(b, d1, j1, tile);
                    continue;
                }
                tile.fill(0);
                if b.row_stride == 1 {
                    // Depth contiguous (a transposed weight): a column's run of the tile's
                    // depth is that column's pair slot in every tile row.
                    for cj in 0..tile_cols {
                        let src = &b.data[(j1 + cj) * b.col_stride + d1..][..tile_depth];
                        let mut pairs = src.chunks_exact(2);
                        for (p, two) in pairs.by_ref().enumerate() {
                            tile[p * 32 + cj * 2] = two[0].bf16_bits();
                            tile[p * 32 + cj * 2 + 1] = two[1].bf16_bits();
                        }
                        if let [last] = pairs.remainder() {
                            tile[(tile_depth / 2) * 32 + cj * 2] = last.bf16_bits();
                        }
                    }
                } else if b.col_stride == 1 {
                    // Columns contiguous: two depth rows interleave into one tile row.
                    for p in 0..tile_depth.div_ceil(2) {
                        let dk = 2 * p;
                        let row = &mut tile[p * 32..][..2 * tile_cols];
                        let even = &b.data[(d1 + dk) * b.row_stride + j1..][..tile_cols];
                        for (slot, x) in row.iter_mut().step_by(2).zip(even) {
                            *slot = x.bf16_bits();
                        }
                        if dk + 1 < tile_depth {
                            let odd = &b.data[(d1 + dk + 1) * b.row_stride + j1..][..tile_cols];
                            for (slot, x) in row.iter_mut().skip(1).step_by(2).zip(odd) {
                                *slot = x.bf16_bits();
                            }
                        }
                    }
                } else {
                    for dk in 0..tile_depth {
                        for cj in 0..tile_cols {
                            tile[(dk / 2) * 32 + cj * 2 + dk % 2] = b.bits_at(d1 + dk, j1 + cj);
                        }
                    }
                }
            }
        }
    }

    /// A full 32-deep, 16-wide tile of `b` (depth or columns contiguous) in VNNI pairs. The
    /// conversion runs along contiguous memory into a natural-order copy on the stack; the
    /// rearrangement is then a 16×16 transpose of 32-bit pairs (depth contiguous) or an
    /// interleave of row pairs (columns contiguous). Measured on the head's 128-row chunk: the
    /// element-at-a-time scatter this replaces was 37–44% of the product's time.
    fn full_b_tile<T: Bf16Source>(b: &Strided<'_, T>, d1: usize, j1: usize, tile: &mut [u16]) {
        let tile = &mut tile[..512];
        let mut natural = [0u32; 256];
        let bits: &mut [u16] = bytemuck::cast_slice_mut(&mut natural);
        if b.row_stride == 1 {
            // Column cj's 32 depth values at cj·32: as pairs, natural[cj·16 + p] = (2p, 2p + 1).
            for (cj, run) in bits.chunks_exact_mut(32).enumerate() {
                T::bits_into(&b.data[(j1 + cj) * b.col_stride + d1..][..32], run);
            }
            transpose_pairs(&natural, tile);
        } else {
            // Depth row d's 16 values at d·16.
            for (d, run) in bits.chunks_exact_mut(16).enumerate() {
                T::bits_into(&b.data[(d1 + d) * b.row_stride + j1..][..16], run);
            }
            let bits: &[u16] = bytemuck::cast_slice(&natural);
            for (p, row) in tile.chunks_exact_mut(32).enumerate() {
                let (even, odd) = bits[2 * p * 16..][..32].split_at(16);
                for ((slot, &e), &o) in row.chunks_exact_mut(2).zip(even).zip(odd) {
                    slot[0] = e;
                    slot[1] = o;
                }
            }
        }
    }

    /// `tile`'s pair `(p, j)` (u16 offset `p·32 + 2j`) = `natural[j·16 + p]`.
    fn transpose_pairs(natural: &[u32; 256], tile: &mut [u16]) {
        for (p, row) in tile.chunks_exact_mut(32).enumerate() {
            for (j, slot) in row.chunks_exact_mut(2).enumerate() {
                let pair = natural[j * 16 + p];
                slot[0] = pair as u16;
                slot[1] = (pair >> 16) as u16;
            }
        }
    }
}

/// The AMX-BF16 path (x86-64 Linux); elsewhere `available()` is false.
mod amx {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    pub(super) use imp::{available, gemm, gemm_into_bf16};

    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    pub(super) fn available() -> bool {
        false
    }

    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm<A: super::Bf16Source, B: super::Bf16Source>(
        c: &mut [f32],
        ldc: usize,
        a: super::Strided<'_, A>,
        b: super::Strided<'_, B>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        _: &mut [u16],
    ) {
        super::gemm_widened(c, ldc, a, b, m, n, k, accumulate)
    }

    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_into_bf16<A: super::Bf16Source, B: super::Bf16Source>(
        _: &mut [u16],
        _: usize,
        _: super::Strided<'_, A>,
        _: super::Strided<'_, B>,
        _: usize,
        _: usize,
        _: usize,
        _: &mut [u16],
    ) {
        unreachable!("no AMX path on this target")
    }

    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    mod imp {
        use std::arch::asm;

        use rayon::prelude::*;

        use headroom_tensor::cpu::kernels::f32_to_bf16_bits;

        use super::super::{depth_block, pack, Bf16Source, Strided, KC_BF16_OUTPUT, MC};

        /// The CPU has AMX-BF16 and the kernel granted the tile state
        /// ([`headroom_tensor::isa::amx_granted`]).
        pub(in super::super) fn available() -> bool {
            headroom_tensor::isa::amx_granted()
        }

        /// The tile configuration: palette 1, all eight tiles 16 rows × 64 bytes.
        #[repr(C, align(64))]
        struct TileConfig {
            palette: u8,
            start_row: u8,
            reserved: [u8; 14],
            colsb: [u16; 16],
            rows: [u8; 16],
        }

        const CONFIG: TileConfig = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
            rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
        };

        /// Tiles configured on this thread for the guard's life, released after.
        struct Tiles;

        impl Tiles {
            fn configure() -> Tiles {
                // SAFETY: `available()` granted the tile state (only then is this path
                // taken); CONFIG is a valid palette-1 configuration, 64-byte aligned.
                unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
                Tiles
            }
        }

        impl Drop for Tiles {
            fn drop(&mut self) {
                // SAFETY: releases the tile state configured in `configure`.
                unsafe { asm!("tilerelease", options(nostack, nomem)) };
            }
        }

        /// A 16×16 f32 output tile in memory: `ptr` with row stride `stride` bytes.
        #[derive(Clone, Copy)]
        struct OutTile {
            ptr: *mut f32,
            stride: usize,
        }

        /// `c_tiles[i][j] (+)= a_tiles[i] · b_tiles[j]` over `kt` depth tiles, i, j ∈ {0, 1}:
        /// tmm0–3 the outputs, tmm4–5 `a`, tmm6–7 `b`. Loads the outputs first when `load`,
        /// starts them at zero otherwise.
        ///
        /// # Safety
        /// Tiles configured on this thread; `a0`, `a1`, `b0`, `b1` each `kt` consecutive
        /// 1 KiB tiles; each output tile 16 rows of 16 f32 at its stride, writable.
        unsafe fn block_2x2(
            a: [*const u16; 2],
            b: [*const u16; 2],
            kt: usize,
            out: [OutTile; 4],
            load: bool,
        ) {
            // SAFETY: the caller's contract (tiles configured, operands and outputs in bounds); every tile row is 64 bytes.
            unsafe {
                if load {
                    asm!(
                        "tileloadd tmm0, [{p0} + {s0}*1]",
                        "tileloadd tmm1, [{p1} + {s1}*1]",
                        "tileloadd tmm2, [{p2} + {s2}*1]",
                        "tileloadd tmm3, [{p3} + {s3}*1]",
                        p0 = in(reg) out[0].ptr, s0 = in(reg) out[0].stride,
                        p1 = in(reg) out[1].ptr, s1 = in(reg) out[1].stride,
                        p2 = in(reg) out[2].ptr, s2 = in(reg) out[2].stride,
                        p3 = in(reg) out[3].ptr, s3 = in(reg) out[3].stride,
                        options(nostack, readonly),
                    );
                } else {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        "tilezero tmm3",
                        options(nostack, nomem)
                    );
                }
                for t in 0..kt {
                    asm!(
                        "tileloadd tmm4, [{a0} + {s}*1]",
                        "tileloadd tmm6, [{b0} + {s}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tileloadd tmm7, [{b1} + {s}*1]",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tileloadd tmm5, [{a1} + {s}*1]",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a0 = in(reg) a[0].add(t * 512),
                        a1 = in(reg) a[1].add(t * 512),
                        b0 = in(reg) b[0].add(t * 512),
                        b1 = in(reg) b[1].add(t * 512),
                        s = in(reg) 64usize,
                        options(nostack, readonly),
                    );
                }
                asm!(
                    "tilestored [{p0} + {s0}*1], tmm0",
                    "tilestored [{p1} + {s1}*1], tmm1",
                    "tilestored [{p2} + {s2}*1], tmm2",
                    "tilestored [{p3} + {s3}*1], tmm3",
                    p0 = in(reg) out[0].ptr, s0 = in(reg) out[0].stride,
                    p1 = in(reg) out[1].ptr, s1 = in(reg) out[1].stride,
                    p2 = in(reg) out[2].ptr, s2 = in(reg) out[2].stride,
                    p3 = in(reg) out[3].ptr, s3 = in(reg) out[3].stride,
                    options(nostack),
                );
            }
        }

        /// The output, shared by the threads: each writes only its own rows (row split) or its
        /// own columns (column split), through this pointer, so no two `&mut` views of `c`
        /// ever exist at once.
        #[derive(Clone, Copy)]
        struct Out {
            dest: Dest,
            /// Elements from the start that belong to the output: `(m − 1)·ldc + n`.
            len: usize,
            ldc: usize,
        }

        /// The output's storage: f32 (tiles stored in place), or bf16 (every tile stored
        /// through an f32 buffer and rounded to nearest even, NaN kept quiet: the tensor
        /// crate's `narrow_bf16`, element by element). A bf16 output is only ever written
        /// whole, in one depth block, so no partial sum is ever rounded.
        #[derive(Clone, Copy)]
        enum Dest {
            F32(*mut f32),
            Bf16(*mut u16),
        }

        // SAFETY: `Out` is only an address; the threads it is shared with write disjoint
        // elements (see `gemm`), and `c`'s borrow outlives them all (scoped rayon calls).
        unsafe impl Send for Out {}
        // SAFETY: as for `Send`.
        unsafe impl Sync for Out {}

        impl Out {
            /// The offset of element `(r, j)`, which must lie inside the output.
            fn index(&self, r: usize, j: usize) -> usize {
                let i = r * self.ldc + j;
                assert!(i < self.len, "output element ({r}, {j}) outside the output");
                i
            }

            /// The address of element `(r, j)` of an f32 output, inside it.
            fn at(&self, r: usize, j: usize) -> *mut f32 {
                match self.dest {
                    Dest::F32(ptr) => ptr.wrapping_add(self.index(r, j)),
                    Dest::Bf16(_) => unreachable!("an f32 address in a bf16 output"),
                }
            }

            /// Row `r`, columns `j..j + w` of the output ← `values` (`w` of them), rounded
            /// for a bf16 output.
            ///
            /// # Safety
            /// No other thread touches these elements meanwhile.
            unsafe fn store_row(&self, r: usize, j: usize, values: &[f32]) {
                if values.is_empty() {
                    return;
                }
                let first = self.index(r, j);
                // Checks that the last element lies inside the output too.
                self.index(r, j + values.len() - 1);
                // SAFETY: both ends lie inside the output (checked), the caller owns them.
                unsafe {
                    match self.dest {
                        Dest::F32(ptr) => std::ptr::copy_nonoverlapping(
                            values.as_ptr(),
                            ptr.add(first),
                            values.len(),
                        ),
                        Dest::Bf16(ptr) => {
                            for (x, &v) in values.iter().enumerate() {
                                *ptr.add(first + x) = f32_to_bf16_bits(v);
                            }
                        }
                    }
                }
            }
        }

        /// One task's work: rows `r0..r0 + rows`, columns `c0..c0 + cols`, depth block
        /// `k0..k0 + depth`, `b` packed (`b_tiles`, `kt` depth tiles per column tile). Full
        /// 16×16 output tiles are read and written in place; edge tiles go through a padded
        /// copy.
        ///
        /// # Safety
        /// No other thread touches this block of the output while it runs.
        #[allow(clippy::too_many_arguments)]
        unsafe fn block<A: Bf16Source>(
            out: Out,
            a: &Strided<'_, A>,
            b_packed: &[u16],
            r0: usize,
            rows: usize,
            k0: usize,
            depth: usize,
            c0: usize,
            cols: usize,
            load: bool,
        ) {
            let kt = depth.div_ceil(32);
            let mt = rows.div_ceil(16);
            // This thread's packing buffer, kept between blocks: a fresh zeroed one per block
            // cost a `calloc` (its clearing included) every `MC` rows.
            thread_local! {
                static A_PACKED: std::cell::RefCell<Vec<u16>> = const {
                    std::cell::RefCell::new(Vec::new())
                };
            }
            A_PACKED.with_borrow_mut(|a_packed| {
                let len = mt.next_multiple_of(2) * kt * 512;
                if a_packed.len() < len {
                    a_packed.resize(len, 0);
                }
                pack::a_tiles(a, r0, rows, k0, depth, a_packed);
                // The pair's second row tile past the rows adds nothing: zeros.
                a_packed[mt * kt * 512..len].fill(0);
                // SAFETY: the caller's contract, passed on.
                unsafe { block_packed(out, a_packed, b_packed, r0, rows, kt, c0, cols, load) }
            });
        }

        /// [`block`] after packing: `a_packed` holds `ceil(rows / 32) · 2` row tiles of `kt`
        /// depth tiles.
        ///
        /// # Safety
        /// As for [`block`].
        #[allow(clippy::too_many_arguments)]
        unsafe fn block_packed(
            out: Out,
            a_packed: &[u16],
            b_packed: &[u16],
            r0: usize,
            rows: usize,
            kt: usize,
            c0: usize,
            cols: usize,
            load: bool,
        ) {
            let mt = rows.div_ceil(16);
            let nt = cols.div_ceil(16);
            // Edge tiles: 16×16 f32 each, four of them (one 2×2 block).
            let mut edge = [0f32; 4 * 256];
            let _tiles = Tiles::configure();
            for tj in (0..nt).step_by(2) {
                for ti in (0..mt).step_by(2) {
                    let mut tiles = [OutTile {
                        ptr: std::ptr::null_mut(),
                        stride: 0,
                    }; 4];
                    let mut edges = [false; 4];
                    for (q, (di, dj)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
                        let (row, col) = ((ti + di) * 16, (tj + dj) * 16);
                        let (h, w) = (
                            16.min(rows.saturating_sub(row)),
                            16.min(cols.saturating_sub(col)),
                        );
                        if h == 16 && w == 16 && matches!(out.dest, Dest::F32(_)) {
                            // Both corners inside the output (checked), so every row is.
                            let _ = out.at(r0 + row + 15, c0 + col + 15);
                            tiles[q] = OutTile {
                                ptr: out.at(r0 + row, c0 + col),
                                stride: out.ldc * 4,
                            };
                        } else {
                            edges[q] = true;
                            let e = &mut edge[q * 256..][..256];
                            // Without `load` the kernel starts from zeroed tiles and stores
                            // all of each: nothing of `e` is read.
                            if load {
                                e.fill(0.0);
                                for r in 0..h {
                                    for x in 0..w {
                                        // SAFETY: inside the output (`at` checks) and this
                                        // task's block.
                                        e[r * 16 + x] =
                                            unsafe { *out.at(r0 + row + r, c0 + col + x) };
                                    }
                                }
                            }
                            tiles[q] = OutTile {
                                ptr: e.as_mut_ptr(),
                                stride: 64,
                            };
                        }
                    }
                    let a_t = [
                        a_packed[ti * kt * 512..].as_ptr(),
                        a_packed[(ti + 1) * kt * 512..].as_ptr(),
                    ];
                    let b_t = [
                        b_packed[tj * kt * 512..].as_ptr(),
                        b_packed[(tj + 1) * kt * 512..].as_ptr(),
                    ];
                    // SAFETY: tiles configured above; `a_packed` holds an even number of row
                    // tiles and `b_packed` an even number of column tiles (padded), `kt` depth
                    // tiles each; full output tiles lie inside the output (both corners
                    // checked) and in this task's block, and edge tiles are the 256-element
                    // buffers of `edge`.
                    unsafe { block_2x2(a_t, b_t, kt, tiles, load) };
                    for (q, (di, dj)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
                        if !edges[q] {
                            continue;
                        }
                        let (row, col) = ((ti + di) * 16, (tj + dj) * 16);
                        let (h, w) = (
                            16.min(rows.saturating_sub(row)),
                            16.min(cols.saturating_sub(col)),
                        );
                        let e = &edge[q * 256..][..256];
                        for r in 0..h {
                            // SAFETY: inside the output (`store_row` checks) and this task's
                            // block.
                            unsafe { out.store_row(r0 + row + r, c0 + col, &e[r * 16..][..w]) };
                        }
                    }
                }
            }
        }

        /// Work split. A wide product (`n > m`: the head's forward, say, 128 rows against
        /// 50257 columns) gives each thread its own column panels, which it packs itself and
        /// runs every row against: its `b` tiles stay in its own core's cache, and only the
        /// smaller `a` is packed once per thread. A tall one gives each thread row slabs of
        /// `MC` against a panel of `b` packed by all threads together. Either way every output
        /// element's sums are the same (the depth blocks do not move).
        #[allow(clippy::too_many_arguments)]
        pub(in super::super) fn gemm<A: Bf16Source, B: Bf16Source>(
            c: &mut [f32],
            ldc: usize,
            a: Strided<'_, A>,
            b: Strided<'_, B>,
            m: usize,
            n: usize,
            k: usize,
            accumulate: bool,
            pack: &mut [u16],
        ) {
            let out = Out {
                dest: Dest::F32(c.as_mut_ptr()),
                len: ((m - 1) * ldc + n).min(c.len()),
                ldc,
            };
            run(out, a, b, m, n, k, depth_block(k, false), accumulate, pack);
        }

        /// [`gemm`] overwriting a bf16 `c`: each output tile is rounded as it leaves the tile
        /// registers, so no f32 copy of the output exists. The whole depth is one block
        /// (`k ≤ KC_BF16_OUTPUT`), so every stored value is a finished sum.
        #[allow(clippy::too_many_arguments)]
        pub(in super::super) fn gemm_into_bf16<A: Bf16Source, B: Bf16Source>(
            c: &mut [u16],
            ldc: usize,
            a: Strided<'_, A>,
            b: Strided<'_, B>,
            m: usize,
            n: usize,
            k: usize,
            pack: &mut [u16],
        ) {
            assert!(
                k <= KC_BF16_OUTPUT,
                "a bf16 output takes one depth block, not {k}"
            );
            let out = Out {
                dest: Dest::Bf16(c.as_mut_ptr()),
                len: ((m - 1) * ldc + n).min(c.len()),
                ldc,
            };
            run(out, a, b, m, n, k, depth_block(k, true), false, pack);
        }

        /// [`gemm`]'s work on either output, in depth blocks of `kc`.
        #[allow(clippy::too_many_arguments)]
        fn run<A: Bf16Source, B: Bf16Source>(
            out: Out,
            a: Strided<'_, A>,
            b: Strided<'_, B>,
            m: usize,
            n: usize,
            k: usize,
            kc: usize,
            accumulate: bool,
            pack: &mut [u16],
        ) {
            let tile_pair = super::super::tile_pair(kc);
            let widest = super::super::panel_width(kc);
            let threads = rayon::current_num_threads().max(1);
            let mut own = Vec::new();
            if n > m && threads > 1 {
                // Column split: `groups` threads, each with panels p ≡ g (mod groups) of width
                // `width` (a multiple of 32, at most `widest`), packed into its own buffer.
                let (groups, panels, width) = super::super::column_split(n, threads, widest);
                let per_group = width / 32 * tile_pair;
                let bufs: &mut [u16] = if pack.len() >= groups * per_group {
                    &mut pack[..groups * per_group]
                } else {
                    own = vec![0u16; groups * per_group];
                    &mut own
                };
                bufs.par_chunks_mut(per_group)
                    .enumerate()
                    .for_each(|(g, buf)| {
                        for p in (g..panels).step_by(groups) {
                            let (c0, cols) = (p * width, width.min(n - p * width));
                            for k0 in (0..k).step_by(kc) {
                                let depth = kc.min(k - k0);
                                let (kt, tiles) = (depth.div_ceil(32), cols.div_ceil(16));
                                let packed = &mut buf[..tiles.next_multiple_of(2) * kt * 512];
                                pack::b_tiles(&b, k0, depth, c0, cols, packed);
                                // The last pair's second tile, when past the columns.
                                packed[tiles * kt * 512..].fill(0);
                                let load = accumulate || k0 > 0;
                                for r0 in (0..m).step_by(MC) {
                                    // SAFETY: panel p's columns belong to group g alone.
                                    unsafe {
                                        block(
                                            out,
                                            &a,
                                            packed,
                                            r0,
                                            MC.min(m - r0),
                                            k0,
                                            depth,
                                            c0,
                                            cols,
                                            load,
                                        )
                                    };
                                }
                            }
                        }
                    });
                return;
            }
            // Row split: panels as wide as the caller's buffer holds (whole pairs of tiles of
            // the deepest block), else `widest` in a buffer of our own.
            let nc = match (pack.len() / tile_pair * 32).min(widest) {
                0 => {
                    own = vec![0u16; widest / 32 * tile_pair];
                    widest
                }
                nc => nc,
            };
            let b_packed: &mut [u16] = if own.is_empty() { pack } else { &mut own };
            for c0 in (0..n).step_by(nc) {
                let cols = nc.min(n - c0);
                for k0 in (0..k).step_by(kc) {
                    let depth = kc.min(k - k0);
                    let kt = depth.div_ceil(32);
                    let nt = cols.div_ceil(16).next_multiple_of(2);
                    let packed = &mut b_packed[..nt * kt * 512];
                    // Column tiles packed in parallel, 2 at a time.
                    packed
                        .par_chunks_mut(2 * kt * 512)
                        .enumerate()
                        .for_each(|(p, dst)| {
                            // b_tiles zeroes the tiles it fills; a pair's second tile past the
                            // columns still holds the previous block.
                            let j0 = p * 32;
                            let width = 32.min(cols.saturating_sub(j0));
                            pack::b_tiles(&b, k0, depth, c0 + j0, width, dst);
                            dst[width.div_ceil(16) * kt * 512..].fill(0);
                        });
                    let packed = &*packed;
                    let load = accumulate || k0 > 0;
                    (0..m.div_ceil(MC)).into_par_iter().for_each(|s| {
                        let r0 = s * MC;
                        // SAFETY: rows r0..r0 + MC belong to this task alone.
                        unsafe {
                            block(
                                out,
                                &a,
                                packed,
                                r0,
                                MC.min(m - r0),
                                k0,
                                depth,
                                c0,
                                cols,
                                load,
                            )
                        };
                    });
                }
            }
        }
    }
}

/// `c[m, n] (+)= a · b` in f64 over the bf16-rounded operands, and `Σ|a·b|` per element: the
/// tests' reference.
#[cfg(test)]
fn reference<A: Bf16Source, B: Bf16Source>(
    a: Strided<'_, A>,
    b: Strided<'_, B>,
    m: usize,
    n: usize,
    k: usize,
) -> (Vec<f64>, Vec<f64>) {
    use rayon::prelude::*;
    let widen = |bits: u16| f64::from(f32::from_bits(u32::from(bits) << 16));
    let mut out = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    out.par_chunks_mut(n)
        .zip(mag.par_chunks_mut(n))
        .enumerate()
        .for_each(|(i, (o, g))| {
            for j in 0..n {
                for d in 0..k {
                    let p = widen(a.bits_at(i, d)) * widen(b.bits_at(d, j));
                    o[j] += p;
                    g[j] += p.abs();
                }
            }
        });
    (out, mag)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn values(seed: u64, n: usize) -> Vec<f32> {
        crate::ops::test_values(seed, n)
            .into_iter()
            .map(|v| v * 4.0)
            .collect()
    }

    /// `c` against the f64 reference within `k·2⁻²³·Σ|a·b|` (plus the start value's rounding
    /// when accumulating).
    #[allow(clippy::too_many_arguments)]
    fn check<A: Bf16Source, B: Bf16Source>(
        c: &[f32],
        ldc: usize,
        start: &[f32],
        a: Strided<'_, A>,
        b: Strided<'_, B>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<(), TestCaseError> {
        let (exact, mag) = reference(a, b, m, n, k);
        for i in 0..m {
            for j in 0..n {
                let s = if accumulate { start[i * ldc + j] } else { 0.0 };
                let want = exact[i * n + j] + f64::from(s);
                let tol = (k as f64 + 1.0) * 2f64.powi(-23) * (mag[i * n + j] + f64::from(s.abs()))
                    + 1e-30;
                let got = f64::from(c[i * ldc + j]);
                prop_assert!(
                    (got - want).abs() <= tol,
                    "[{i}, {j}] of {m}x{n}x{k}: {got} vs {want} (tol {tol}, path {:?})",
                    bf16_gemm_path()
                );
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// A bf16 output: the f32 product's bits rounded by the tensor crate's `narrow_bf16`,
        /// for tall and wide products (row and column splits), odd tails, a wider `ldc` (the
        /// columns past `n` untouched), a NaN among the inputs; and where the tiles cannot
        /// take it (no AMX, or more than one depth block) `c` untouched and `false`.
        #[test]
        fn a_bf16_output_is_the_f32_product_rounded(
            m in 1usize..90, n in 1usize..150, k in 1usize..(KC_BF16_OUTPUT + 40),
            b_t in any::<bool>(), pad in 0usize..3, nan in any::<bool>(), seed in any::<u64>(),
        ) {
            let mut av = values(seed, m * k);
            if nan {
                av[(seed as usize) % (m * k)] = f32::NAN;
            }
            let bb: Vec<bf16> = values(seed ^ 1, k * n).iter().map(|&x| bf16::from_f32(x)).collect();
            let a = Strided::rows(&av[..], k);
            let b = if b_t { Strided::transposed(&bb[..], k) } else { Strided::rows(&bb[..], n) };
            let ldc = n + pad;
            let sentinel = bf16::from_bits(0x7fc1);
            let mut c = vec![sentinel; m * ldc];
            let on_tiles = gemm_bf16_into_bf16(&mut c, ldc, a, b, m, n, k, &mut []);
            prop_assert_eq!(on_tiles, bf16_output_on_tiles(k));
            if !on_tiles {
                prop_assert!(c.iter().all(|x| x.to_bits() == sentinel.to_bits()));
                return Ok(());
            }
            let mut f = vec![0f32; m * ldc];
            gemm_bf16(&mut f, ldc, a, b, m, n, k, false);
            let mut want = vec![bf16::ZERO; m * ldc];
            headroom_tensor::cpu::kernels::narrow_bf16(&f, &mut want);
            for i in 0..m {
                for j in 0..ldc {
                    let got = c[i * ldc + j].to_bits();
                    if j < n {
                        prop_assert_eq!(got, want[i * ldc + j].to_bits(), "({}, {})", i, j);
                    } else {
                        prop_assert_eq!(got, sentinel.to_bits());
                    }
                }
            }
        }

        /// Odd shapes (tails of every tile dimension), both operand types, transposes, a wider
        /// `ldc`, overwrite and accumulate: within the f32-summation bound of the f64 product of
        /// the rounded operands; and the columns past `n` and rows past `m` untouched.
        #[test]
        fn matches_the_f64_product_of_the_rounded_operands(
            m in 1usize..70, n in 1usize..70, k in 1usize..600,
            a_t in any::<bool>(), b_t in any::<bool>(), b_bf16 in any::<bool>(),
            accumulate in any::<bool>(), pad in 0usize..3, seed in any::<u64>(),
        ) {
            let av = values(seed, m * k);
            let bv = values(seed ^ 1, k * n);
            let a = if a_t { Strided::transposed(&av[..], m) } else { Strided::rows(&av[..], k) };
            let ldc = n + pad;
            let start = values(seed ^ 2, m * ldc + 5);
            let mut c = start.clone();
            if b_bf16 {
                let bb: Vec<bf16> = bv.iter().map(|&x| bf16::from_f32(x)).collect();
                let b = if b_t { Strided::transposed(&bb[..], k) } else { Strided::rows(&bb[..], n) };
                gemm_bf16(&mut c, ldc, a, b, m, n, k, accumulate);
                check(&c, ldc, &start, a, b, m, n, k, accumulate)?;
            } else {
                let b = if b_t { Strided::transposed(&bv[..], k) } else { Strided::rows(&bv[..], n) };
                gemm_bf16(&mut c, ldc, a, b, m, n, k, accumulate);
                check(&c, ldc, &start, a, b, m, n, k, accumulate)?;
            }
            // The packing buffer changes the panel width only, never a bit of the result: one
            // 32-column panel, or a few.
            let tile_pair = 2 * KC.min(k).div_ceil(32) * 512;
            for panels in [1, 3] {
                let mut again = start.clone();
                let mut pack = vec![0u16; panels * tile_pair];
                if b_bf16 {
                    let bb: Vec<bf16> = bv.iter().map(|&x| bf16::from_f32(x)).collect();
                    let b = if b_t { Strided::transposed(&bb[..], k) } else { Strided::rows(&bb[..], n) };
                    gemm_bf16_with(&mut again, ldc, a, b, m, n, k, accumulate, &mut pack);
                } else {
                    let b = if b_t { Strided::transposed(&bv[..], k) } else { Strided::rows(&bv[..], n) };
                    gemm_bf16_with(&mut again, ldc, a, b, m, n, k, accumulate, &mut pack);
                }
                prop_assert!(again.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
            for i in 0..m {
                for j in n..ldc {
                    prop_assert_eq!(c[i * ldc + j].to_bits(), start[i * ldc + j].to_bits());
                }
            }
            prop_assert_eq!(&c[m * ldc..], &start[m * ldc..]);
        }
    }

    /// Larger than one packed block in every direction (several `NC` panels, `KC` blocks and
    /// `MC` slabs), as the trainer calls it.
    #[test]
    fn several_blocks_in_every_direction() {
        let (m, n, k) = (MC * 2 + 17, NC + 45, KC * 2 + 31);
        let av = values(3, m * k);
        let bv: Vec<bf16> = values(4, n * k)
            .iter()
            .map(|&x| bf16::from_f32(x))
            .collect();
        // The forward's shape: a · wᵀ with w [n, k].
        let a = Strided::rows(&av[..], k);
        let b = Strided::transposed(&bv[..], k);
        let mut c = vec![0.0; m * n];
        gemm_bf16(&mut c, n, a, b, m, n, k, false);
        check(&c, n, &[], a, b, m, n, k, false).unwrap();
    }

    /// A bf16 output of the deepest products the tiles round (GPT-2's 768, and
    /// [`KC_BF16_OUTPUT`]): one depth block over several of its narrower panels, split by rows
    /// (tall) and by columns (wide), in the caller's buffer of [`pack_len_into_bf16`] or none:
    /// the blocked f32 product's bits, rounded.
    #[test]
    fn deep_bf16_outputs_span_panels() {
        for k in [KC + 256, KC_BF16_OUTPUT] {
            let widest = panel_width(k);
            assert!(
                widest < NC && widest * k <= KC * NC,
                "{widest} columns at depth {k}"
            );
            for (m, n) in [(3 * MC + 5, 2 * widest + 40), (2 * widest + 40, 3 * MC + 5)] {
                let av = values(5, m * k);
                let bv: Vec<bf16> = values(6, n * k)
                    .iter()
                    .map(|&x| bf16::from_f32(x))
                    .collect();
                let (a, b) = (Strided::rows(&av[..], k), Strided::transposed(&bv[..], k));
                let mut f = vec![0f32; m * n];
                gemm_bf16(&mut f, n, a, b, m, n, k, false);
                let mut want = vec![bf16::ZERO; m * n];
                headroom_tensor::cpu::kernels::narrow_bf16(&f, &mut want);
                let threads = rayon::current_num_threads();
                for pack_len in [0, pack_len_into_bf16(m, n, k, threads)] {
                    let mut pack = vec![0u16; pack_len];
                    let mut c = vec![bf16::from_bits(0x7fc1); m * n];
                    if !gemm_bf16_into_bf16(&mut c, n, a, b, m, n, k, &mut pack) {
                        assert!(!bf16_output_on_tiles(k));
                        continue;
                    }
                    for (i, (x, y)) in c.iter().zip(&want).enumerate() {
                        assert_eq!(x.to_bits(), y.to_bits(), "{m}x{n}x{k}, element {i}");
                    }
                }
            }
        }
        assert!(!bf16_output_on_tiles(KC_BF16_OUTPUT + 1));
    }

    /// The packed layouts, element by element against their definitions.
    #[test]
    fn packing_layouts() {
        let (rows, depth) = (19, 37);
        let av: Vec<f32> = (0..rows * depth).map(|i| i as f32).collect();
        for a in [
            Strided::rows(&av[..], depth),
            Strided::transposed(&av[..], rows),
        ] {
            let mut dst = vec![7u16; 2 * 2 * 512];
            pack::a_tiles(&a, 0, rows, 0, depth, &mut dst);
            for r in 0..32 {
                for d in 0..64 {
                    let got = dst[((r / 16) * 2 + d / 32) * 512 + (r % 16) * 32 + d % 32];
                    let want = if r < rows && d < depth {
                        a.bits_at(r, d)
                    } else {
                        0
                    };
                    assert_eq!(got, want, "a ({r}, {d})");
                }
            }
        }
        let (depth, cols) = (37, 19);
        let bv: Vec<f32> = (0..depth * cols).map(|i| i as f32).collect();
        for b in [
            Strided::rows(&bv[..], cols),
            Strided::transposed(&bv[..], depth),
        ] {
            let mut dst = vec![7u16; 2 * 2 * 512];
            pack::b_tiles(&b, 0, depth, 0, cols, &mut dst);
            for d in 0..64 {
                for j in 0..32 {
                    let got = dst[((j / 16) * 2 + d / 32) * 512
                        + ((d % 32) / 2) * 32
                        + (j % 16) * 2
                        + d % 2];
                    let want = if d < depth && j < cols {
                        b.bits_at(d, j)
                    } else {
                        0
                    };
                    assert_eq!(got, want, "b ({d}, {j})");
                }
            }
        }
    }

    /// `b`'s packing from an offset inside a larger matrix, in both layouts, from f32 and
    /// from bf16: full tiles (rearranged whole) and edge tiles (element by element) alike.
    #[test]
    fn b_packing_from_an_offset() {
        fn check<T: Bf16Source>(values: &[T], rows: usize, cols: usize) {
            let (k0, depth, c0, width) = (3usize, 70usize, 5usize, 37usize);
            for b in [
                Strided::rows(values, cols),
                Strided::transposed(values, rows),
            ] {
                let (kt, nt) = (depth.div_ceil(32), width.div_ceil(16));
                let mut dst = vec![7u16; nt * kt * 512];
                pack::b_tiles(&b, k0, depth, c0, width, &mut dst);
                for d in 0..kt * 32 {
                    for j in 0..nt * 16 {
                        let got = dst[((j / 16) * kt + d / 32) * 512
                            + ((d % 32) / 2) * 32
                            + (j % 16) * 2
                            + d % 2];
                        let want = if d < depth && j < width {
                            b.bits_at(k0 + d, c0 + j)
                        } else {
                            0
                        };
                        assert_eq!(
                            got, want,
                            "b ({d}, {j}), strides {} {}",
                            b.row_stride, b.col_stride
                        );
                    }
                }
            }
        }
        let (rows, cols) = (80, 45);
        let (f, h) = packing_inputs(11, rows, cols);
        check(&f, rows, cols);
        check(&h, rows, cols);
    }

    /// A packing test's `[rows, cols]` operand as f32 and as bf16: values that round
    /// differently as bf16, a NaN and both infinities among them.
    fn packing_inputs(seed: u64, rows: usize, cols: usize) -> (Vec<f32>, Vec<bf16>) {
        let mut f: Vec<f32> = values(seed, rows * cols)
            .iter()
            .map(|v| v * 1.000_123)
            .collect();
        f[rows * cols / 2] = f32::NAN;
        f[7] = f32::INFINITY;
        f[cols * 4 + 9] = f32::NEG_INFINITY;
        let h = f.iter().map(|&v| bf16::from_f32(v)).collect();
        (f, h)
    }

    /// `a`'s packing from an offset inside a larger matrix, in both layouts, from f32 and from
    /// bf16, into a buffer holding garbage: full tiles (the fixed-length runs and the 32×16
    /// transpose) and edge tiles (zero-filled first) alike.
    #[test]
    fn a_packing_from_an_offset() {
        fn check<T: Bf16Source>(values: &[T], rows: usize, cols: usize) {
            let (r0, count, k0, depth) = (5usize, 37usize, 3usize, 70usize);
            for a in [
                Strided::rows(values, cols),
                Strided::transposed(values, rows),
            ] {
                let (mt, kt) = (count.div_ceil(16), depth.div_ceil(32));
                let mut dst = vec![7u16; mt * kt * 512];
                pack::a_tiles(&a, r0, count, k0, depth, &mut dst);
                for r in 0..mt * 16 {
                    for d in 0..kt * 32 {
                        let got = dst[((r / 16) * kt + d / 32) * 512 + (r % 16) * 32 + d % 32];
                        let want = if r < count && d < depth {
                            a.bits_at(r0 + r, k0 + d)
                        } else {
                            0
                        };
                        assert_eq!(
                            got, want,
                            "a ({r}, {d}), strides {} {}",
                            a.row_stride, a.col_stride
                        );
                    }
                }
            }
        }
        let (rows, cols) = (45, 80);
        let (f, h) = packing_inputs(12, rows, cols);
        check(&f, rows, cols);
        check(&h, rows, cols);
    }

    /// The branch-free rounding is half's, bit for bit, over every f32 class.
    #[test]
    fn rounding_is_halfs() {
        let mut s = 0x1234_5678u32;
        let specials = [
            0.0f32,
            -0.0,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x7f7f_ffff),
        ];
        let randoms = (0..200_000).map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            f32::from_bits(s)
        });
        for x in specials.into_iter().chain(randoms) {
            assert_eq!(
                round_to_bf16_bits(x),
                bf16::from_f32(x).to_bits(),
                "{:#x}",
                x.to_bits()
            );
        }
    }

    /// Which path ran, for the test log (CI machines differ).
    #[test]
    fn reports_its_path() {
        eprintln!("bf16 GEMM path on this machine: {:?}", bf16_gemm_path());
    }
}
