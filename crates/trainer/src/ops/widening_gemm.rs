//! The widening path's GEMM with the widening inside the packing: `c[m, n] (+)= a[m, k] ·
//! b[k, n]` for operands in any [`Operand`] type (f32, bf16, f16), f32 sums, computed by the
//! `gemm` crate's own f32 micro-kernel on panels this module packs, converting each value as it
//! is packed. No f32 copy of a low-precision operand exists beside the packed panels that gemm
//! would have made of the f32 copy anyway.
//!
//! ```
//! use headroom_trainer::ops::strided::Strided;
//! use headroom_trainer::ops::widening_gemm::gemm;
//! let a = [1.0f32, 2.0, 3.0, 4.0]; // [2, 2]
//! let b = [half::bf16::from_f32(0.5); 4]; // [2, 2]
//! let mut c = [0.0f32; 4];
//! // `false` where this machine's gemm runs another kernel: the caller widens instead.
//! if gemm(&mut c, 2, Strided::rows(&a[..], 2), Strided::rows(&b[..], 2), 2, 2, 2, false, &mut []) {
//!     assert_eq!(c, [1.5, 1.5, 3.5, 3.5]);
//! }
//! ```
//!
//! # Same bits as gemm on the widened operands
//! gemm computes every output element as the sum over depth blocks of `kc`
//! (`gemm_common::cache::kernel_params`: the depth, the tile and the caches): per block, an
//! accumulator started at zero takes one fused multiply-add per depth step in order, and the
//! block's sum is then added to the output once (overwritten by it for the first block of an
//! overwriting call). Which micro-kernel variant computes a tile, how the work is split between
//! threads, the row and column blocking: none of these changes an element's operations. So
//! calling the same micro-kernel over the same depth blocks gives gemm's bits; the operands'
//! values are the widened ones exactly (widening bf16 and f16 to f32 is exact).
//!
//! This module runs gemm's FMA (AVX2) kernel, 16 × 6 tiles, the one gemm itself takes on CPUs
//! without AVX-512 (and in builds without its `x86-v4` feature). [`gemm`](fn@gemm) answers `false`,
//! leaving the output alone, where gemm runs another kernel (AVX-512, other architectures) or
//! a shape takes one of gemm's special paths (vectors, small matrices), and where the
//! run-time check [`matches_gemm`] failed: the caller then widens the operands and calls
//! gemm as before.
//!
//! # Orientation
//! gemm turns a row-major output into a column-major one by transposing the problem
//! (`cᵀ = bᵀ · aᵀ`); so does this module. Its micro-kernel's "rows" are the output's columns:
//! a tile is 16 consecutive columns of `c` (two 8-wide vectors, from the packed panel of
//! `bᵀ`) by 6 rows of `c` (broadcast from the packed panel of `aᵀ`).

use rayon::prelude::*;

use super::matmul::Operand;
use super::strided::Strided;

/// The micro-kernel's tile, in gemm's (transposed) orientation: `MR` rows of `bᵀ` (columns of
/// the output) by `NR` columns of `aᵀ` (rows of the output).
const MR: usize = 16;
/// See [`MR`].
const NR: usize = 6;
/// f32 lanes of one vector of the FMA kernel.
const LANES: usize = 8;

impl<T: Operand> Strided<'_, T> {
    /// Element `(r, c)` as f32.
    #[inline]
    fn f32_at(&self, r: usize, c: usize) -> f32 {
        self.get(r, c).to_f32()
    }
}

/// `c[m, n] (+)= a[m, k] · b[k, n]`, `c` row-major at row stride `ldc` ≥ `n`, with gemm's bits
/// on the widened operands; threaded on rayon's pool. Returns `false` and leaves `c` alone
/// where this machine's gemm would compute the product otherwise (see the module notes).
///
/// `a`'s packed panels go to `pack` where it holds one tile of them (the caller's tracked
/// scratch: the widened copy this replaces), as many columns as fit; otherwise into a buffer of
/// this call's own, as gemm does. The results do not depend on `pack`.
///
/// # Panics
/// When a matrix does not lie inside its slice, or `ldc < n`.
#[allow(clippy::too_many_arguments)]
pub fn gemm<A: Operand, B: Operand>(
    c: &mut [f32],
    ldc: usize,
    a: Strided<'_, A>,
    b: Strided<'_, B>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    pack: &mut [f32],
) -> bool {
    assert!(ldc >= n, "widening gemm: ldc {ldc} < n {n}");
    assert!(a.covers(m, k), "widening gemm: a is not [{m}, {k}]");
    assert!(b.covers(k, n), "widening gemm: b is not [{k}, {n}]");
    assert!(
        m == 0 || n == 0 || c.len() >= (m - 1) * ldc + n,
        "widening gemm: c is not [{m}, {n}] at row stride {ldc}"
    );
    if !takes(m, n, k, ldc) || !matches_gemm() {
        return false;
    }
    // SAFETY: `takes` holds, so the FMA kernel exists on this CPU; the shapes were checked.
    unsafe { run(c, ldc, a, b, m, n, k, accumulate, pack) };
    true
}

/// Whether gemm runs an `m × n` product of depth `k` (output row stride `ldc`) on the blocked
/// path with the FMA kernel here, so [`gemm`](fn@gemm) can reproduce it: the kernel verified
/// (`matmul::gemm_f32_tile`), the problem transposed as gemm transposes it (`ldc > 1`), and
/// none of gemm's special shapes — vectors, `m, n ≤ 64` (another depth block), `m·n ≤ 256`
/// (its horizontal kernels), a depth of at most 2 (its outer products).
fn takes(m: usize, n: usize, k: usize, ldc: usize) -> bool {
    super::matmul::gemm_f32_tile() == Some((MR, NR))
        && ldc > 1
        && m >= 2
        && n >= 2
        && k > 2
        && !(m <= 64 && n <= 64)
        && m * n > 256
}

/// The depth blocks gemm uses for depth `k` with this kernel.
fn depth_block(k: usize) -> usize {
    gemm_common::cache::kernel_params(256, 256, k, MR, NR, std::mem::size_of::<f32>())
        .kc
        .clamp(1, k.max(1))
}

/// Whether [`gemm`](fn@gemm)'s kernel loop gives gemm's bits on this machine: a product with several depth blocks,
/// tails in every direction, both weight layouts, overwriting and accumulating, against gemm
/// on the widened operands; decided once per process, `false` where gemm runs another
/// kernel or this one does not exist.
pub fn matches_gemm() -> bool {
    static SAME: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SAME.get_or_init(|| {
        let (m, n, k) = (83, 77, 1300);
        if !takes(m, n, k, n) || depth_block(k) >= k {
            return false;
        }
        let a = super::spread_values(1, m * k, 13);
        let w: Vec<half::bf16> = super::spread_values(2, k * n, 13)
            .into_iter()
            .map(half::bf16::from_f32)
            .collect();
        let wide: Vec<f32> = w.iter().map(|x| x.to_f32()).collect();
        let start = super::spread_values(3, m * n, 13);
        [false, true].into_iter().all(|transposed| {
            [false, true].into_iter().all(|accumulate| {
                let (bw, bf) = if transposed {
                    (
                        Strided::transposed(&w[..], k),
                        Strided::transposed(&wide[..], k),
                    )
                } else {
                    (Strided::rows(&w[..], n), Strided::rows(&wide[..], n))
                };
                let mut ours = start.clone();
                let av = Strided::rows(&a[..], k);
                // SAFETY: `takes` holds (checked above), the shapes are in bounds.
                unsafe { run(&mut ours, n, av, bw, m, n, k, accumulate, &mut []) };
                let mut theirs = start.clone();
                // On the calling thread: this runs inside a `OnceLock` initialiser, which a
                // rayon worker must not wait on while another task re-enters it.
                reference_gemm(&mut theirs, n, &a, bf, m, n, k, accumulate);
                ours.iter()
                    .zip(&theirs)
                    .all(|(x, y)| x.to_bits() == y.to_bits())
            })
        })
    })
}

/// gemm itself on f32 operands (`a` dense row-major `[m, k]`), single-threaded: what
/// [`matches_gemm`] compares with.
#[allow(clippy::too_many_arguments)]
fn reference_gemm(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    b: Strided<'_, f32>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) {
    // SAFETY: `a` is dense `[m, k]`, `b` lies inside its slice and `c` holds `[m, n]` at row
    // stride `ldc` (the caller's shapes); `c` is a distinct mutable borrow.
    unsafe {
        ::gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            accumulate,
            a.as_ptr(),
            1,
            k as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            ::gemm::Parallelism::None,
        );
    }
}

/// Packs rows `i0..i0 + rows` (≤ [`MR`]) of `lhs`, depth `k0..k0 + depth`, as the kernel reads
/// them: depth step by depth step, [`MR`] values each (rows past `rows` zero).
fn pack_lhs<T: Operand>(
    lhs: &Strided<'_, T>,
    i0: usize,
    rows: usize,
    k0: usize,
    depth: usize,
    dst: &mut [f32],
) {
    let dst = &mut dst[..depth * MR];
    if rows < MR {
        dst.fill(0.0);
    }
    if lhs.row_stride == 1 {
        // Columns of `lhs` are contiguous: each depth step is one run of `rows` values.
        for (d, out) in dst.chunks_exact_mut(MR).enumerate() {
            let start = (k0 + d) * lhs.col_stride + i0;
            for (o, &x) in out[..rows].iter_mut().zip(&lhs.data[start..start + rows]) {
                *o = x.to_f32();
            }
        }
    } else {
        // Rows are contiguous: read each along the depth.
        for r in 0..rows {
            let start = (i0 + r) * lhs.row_stride + k0 * lhs.col_stride;
            if lhs.col_stride == 1 {
                for (d, &x) in lhs.data[start..start + depth].iter().enumerate() {
                    dst[d * MR + r] = x.to_f32();
                }
            } else {
                for d in 0..depth {
                    dst[d * MR + r] = lhs.f32_at(i0 + r, k0 + d);
                }
            }
        }
    }
}

/// Packs columns `j0..j0 + cols` of `rhs`, depth `k0..k0 + depth`, as `cols.div_ceil(NR)`
/// consecutive tiles: each depth step by depth step, [`NR`] values a step (columns past `cols`
/// zero).
fn pack_rhs<T: Operand>(
    rhs: &Strided<'_, T>,
    j0: usize,
    cols: usize,
    k0: usize,
    depth: usize,
    dst: &mut [f32],
) {
    let tiles = cols.div_ceil(NR);
    let dst = &mut dst[..tiles * NR * depth];
    if !cols.is_multiple_of(NR) {
        dst[(tiles - 1) * NR * depth..].fill(0.0);
    }
    if rhs.row_stride == 1 {
        // Each column is contiguous along the depth.
        for j in 0..cols {
            let tile = &mut dst[j / NR * NR * depth..][..NR * depth];
            let start = (j0 + j) * rhs.col_stride + k0;
            for (d, &x) in rhs.data[start..start + depth].iter().enumerate() {
                tile[d * NR + j % NR] = x.to_f32();
            }
        }
    } else if rhs.col_stride == 1 {
        // Each depth step is one run over all the tiles' columns: read once, along memory
        // (one tile at a time would fetch every line of a strided source several times).
        for d in 0..depth {
            let start = (k0 + d) * rhs.row_stride + j0;
            for (t, run) in rhs.data[start..start + cols].chunks(NR).enumerate() {
                let out = &mut dst[t * NR * depth + d * NR..][..run.len()];
                for (o, &x) in out.iter_mut().zip(run) {
                    *o = x.to_f32();
                }
            }
        }
    } else {
        for j in 0..cols {
            let tile = &mut dst[j / NR * NR * depth..][..NR * depth];
            for d in 0..depth {
                tile[d * NR + j % NR] = rhs.f32_at(k0 + d, j0 + j);
            }
        }
    }
}

/// The output, shared by the threads: each writes only the columns of its own panels, through
/// this pointer, so no two `&mut` views of `c` exist at once.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: an address only; the threads write disjoint columns and `c`'s borrow outlives them
// (scoped rayon calls).
unsafe impl Send for Out {}
// SAFETY: as for `Send`.
unsafe impl Sync for Out {}

impl Out {
    /// The address `offset` elements in (a method, so closures capture the whole `Out`).
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// [`gemm`](fn@gemm)'s work, with its conditions checked.
///
/// # Safety
/// [`takes`] holds for the shape (so the CPU has FMA and AVX2); the matrices lie inside their
/// slices and `c` holds `[m, n]` at row stride `ldc`.
#[allow(clippy::too_many_arguments)]
unsafe fn run<A: Operand, B: Operand>(
    c: &mut [f32],
    ldc: usize,
    a: Strided<'_, A>,
    b: Strided<'_, B>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    pack: &mut [f32],
) {
    // gemm's orientation: cᵀ[n, m] (+)= bᵀ[n, k] · aᵀ[k, m], cᵀ column-major.
    let (lhs, rhs) = (b.t(), a.t());
    let (rows, cols) = (n, m);
    let kc = depth_block(k);
    // Panels of `rhs` (output rows) packed per block and shared; each task owns a run of
    // whole `MR` panels of `lhs` (output columns) and sweeps every column tile against it.
    let params = gemm_common::cache::kernel_params(rows, cols, k, MR, NR, 4);
    let nc = params.nc.clamp(NR, cols.next_multiple_of(NR));
    let threads = rayon::current_num_threads().max(1);
    let panels = rows.div_ceil(MR);
    let panels_per_task = params
        .mc
        .div_ceil(MR)
        .clamp(1, panels.div_ceil(2 * threads).max(1));
    let out = Out(c.as_mut_ptr());
    // gemm packs an f32 rhs whose depth runs contiguously only for very wide products (more
    // than 128 tiles of output columns), and reads it in place otherwise; so does this (the
    // same values either way). Anything else is packed, converted.
    let rhs_f32 = A::as_f32(a.data).filter(|_| {
        rhs.row_stride == 1 && rows <= gemm_common::gemm::get_rhs_packing_threshold() * MR
    });
    let mut own;
    let (packed_rhs, nc): (&mut [f32], usize) = match rhs_f32 {
        Some(_) => (&mut [], nc),
        None if pack.len() >= NR * kc => {
            let nc = nc.min(pack.len() / kc / NR * NR);
            (pack, nc)
        }
        None => {
            own = vec![0f32; nc.next_multiple_of(NR) * kc];
            (&mut own[..], nc)
        }
    };
    for j0 in (0..cols).step_by(nc) {
        let ncols = nc.min(cols - j0);
        for k0 in (0..k).step_by(kc) {
            let depth = kc.min(k - k0);
            let tiles = ncols.div_ceil(NR);
            // Tile `t`'s first value and its strides (between depth steps, between columns).
            let rhs_tiles: (&[f32], usize, usize, usize) = match rhs_f32 {
                Some(data) => (
                    &data[j0 * rhs.col_stride + k0..],
                    NR * rhs.col_stride,
                    1,
                    rhs.col_stride,
                ),
                None => {
                    let per_task = (PACK_VALUES / (NR * depth)).max(1);
                    packed_rhs[..tiles * NR * depth]
                        .par_chunks_mut(per_task * NR * depth)
                        .enumerate()
                        .for_each(|(task, dst)| {
                            let j = j0 + task * per_task * NR;
                            let cols = (per_task * NR).min(j0 + ncols - j);
                            pack_rhs(&rhs, j, cols, k0, depth, dst);
                        });
                    (&packed_rhs[..], NR * depth, NR, 1)
                }
            };
            let (rhs_data, tile_step, rhs_rs, rhs_cs) = rhs_tiles;
            // gemm's alpha: the output is read from the second block on, or when accumulating.
            let alpha_status = u8::from(accumulate || k0 > 0);
            (0..panels.div_ceil(panels_per_task))
                .into_par_iter()
                .for_each(|task| {
                    let first = task * panels_per_task;
                    let last = (first + panels_per_task).min(panels);
                    PACKED_LHS.with_borrow_mut(|packed_lhs| {
                        let len = (last - first) * MR * depth;
                        if packed_lhs.len() < len {
                            packed_lhs.resize(len, 0.0);
                        }
                        for (p, panel) in (first..last).zip(packed_lhs.chunks_exact_mut(MR * depth))
                        {
                            let i0 = p * MR;
                            pack_lhs(&lhs, i0, MR.min(rows - i0), k0, depth, panel);
                        }
                        // As gemm: each rhs tile, once in L1, against every panel of the task,
                        // which stay in L2.
                        for t in 0..tiles {
                            let j = j0 + t * NR;
                            let w = NR.min(j0 + ncols - j);
                            let rhs_tile = rhs_data[t * tile_step..].as_ptr();
                            for (p, panel) in (first..last).zip(packed_lhs.chunks_exact(MR * depth))
                            {
                                let i0 = p * MR;
                                let h = MR.min(rows - i0);
                                let kernel = gemm_f32::microkernel::fma::f32::UKR
                                    [h.div_ceil(LANES) - 1][w - 1];
                                // cᵀ(i, j) is c[j·ldc + i]: row stride 1, column stride ldc.
                                let dst = out.at(j * ldc + i0);
                                // SAFETY: the FMA kernel runs on this CPU (the caller's
                                // contract); it reads `h` rounded up to whole vectors of the
                                // packed panel (`MR` values a step, zero-padded) for `depth`
                                // steps, `w` values a step of the rhs tile at its strides
                                // (inside the packed block, or inside `a`: `rhs.covers` held for
                                // the whole product), and writes the `h × w` block of cᵀ at
                                // (i0, j), inside `c` and in this task's columns alone.
                                unsafe {
                                    kernel(
                                        h,
                                        w,
                                        depth,
                                        dst,
                                        panel.as_ptr(),
                                        rhs_tile,
                                        ldc as isize,
                                        1,
                                        MR as isize,
                                        rhs_rs as isize,
                                        rhs_cs as isize,
                                        1.0,
                                        1.0,
                                        alpha_status,
                                        false,
                                        false,
                                        false,
                                        std::ptr::null(),
                                    );
                                }
                            }
                        }
                    });
                });
        }
    }
}

/// Values of `rhs` one packing task converts (256 KiB of f32).
const PACK_VALUES: usize = 1 << 16;

thread_local! {
    /// Each thread's packed panels of `lhs`, kept between calls (a fresh one per task cost a
    /// zeroed allocation every block).
    static PACKED_LHS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use proptest::prelude::*;

    fn values(seed: u64, n: usize) -> Vec<f32> {
        crate::ops::spread_values(seed, n, 11)
    }

    /// gemm's operations, written out: per depth block of `kc`, an accumulator from zero taking
    /// one fused multiply-add per step in order, then added to the output once (or written, for
    /// the first block of an overwriting call).
    #[allow(clippy::too_many_arguments)]
    fn blocked_fma_reference(
        c: &mut [f32],
        ldc: usize,
        a: &Strided<'_, f32>,
        b: &Strided<'_, bf16>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) {
        let kc = depth_block(k);
        for i in 0..m {
            for j in 0..n {
                let o = &mut c[i * ldc + j];
                for k0 in (0..k).step_by(kc) {
                    let mut acc = 0f32;
                    for d in k0..(k0 + kc).min(k) {
                        acc = a.f32_at(i, d).mul_add(b.f32_at(d, j), acc);
                    }
                    *o = if accumulate || k0 > 0 { acc + *o } else { acc };
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]

        /// On any CPU with FMA (this module's kernel runs wherever AVX2 does): the blocked
        /// fused multiply-adds, bit for bit, over odd shapes past one depth block, both weight
        /// layouts, a transposed `a`, a wider `ldc` (the columns past `n` untouched),
        /// overwriting and accumulating.
        #[test]
        fn the_kernel_does_gemms_operations(
            m in 2usize..90, n in 2usize..90, k in 1usize..1200,
            b_t in any::<bool>(), a_t in any::<bool>(), accumulate in any::<bool>(),
            pad in 0usize..3, seed in any::<u64>(),
        ) {
            let fma = std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("avx2");
            prop_assume!(fma && !(m <= 64 && n <= 64) && m * n > 256);
            let av = values(seed, m * k);
            let bv: Vec<bf16> = values(seed ^ 1, k * n).iter().map(|&x| bf16::from_f32(x)).collect();
            let a = if a_t { Strided::transposed(&av[..], m) } else { Strided::rows(&av[..], k) };
            let b = if b_t { Strided::transposed(&bv[..], k) } else { Strided::rows(&bv[..], n) };
            let ldc = n + pad;
            let start = values(seed ^ 2, m * ldc);
            let mut want = start.clone();
            blocked_fma_reference(&mut want, ldc, &a, &b, m, n, k, accumulate);
            let mut got = start.clone();
            // A packing buffer narrower than gemm's panels for some cases, none for others.
            let mut pack = vec![0f32; if b_t { 0 } else { NR * k + 5 }];
            // SAFETY: FMA and AVX2 present (assumed above), shapes in bounds.
            unsafe { run(&mut got, ldc, a, b, m, n, k, accumulate, &mut pack) };
            for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                prop_assert_eq!(x.to_bits(), y.to_bits(), "element {} ({}, {})", i, i / ldc, i % ldc);
            }
        }
    }

    /// Where gemm runs the FMA kernel (AVX2 CPUs, builds without `x86-v4`), it is gemm's bits:
    /// the trainer's shapes, through the public entry; elsewhere `gemm` declines and leaves
    /// `c` alone.
    #[test]
    fn gemms_bits_where_gemm_runs_this_kernel() {
        // The run-time check never turns the path off where gemm runs this kernel.
        assert_eq!(
            matches_gemm(),
            super::super::matmul::gemm_f32_tile() == Some((MR, NR))
        );
        for &(m, n, k, b_t) in &[
            (67, 2304, 768, true),
            (130, 768, 3072, false),
            (300, 384, 50257, false),
            (70, 100, 5, true),
            (20, 68, 2, false),
        ] {
            let av = values(7, m * k);
            let bv: Vec<bf16> = values(8, k * n)
                .iter()
                .map(|&x| bf16::from_f32(x))
                .collect();
            let wide: Vec<f32> = bv.iter().map(|x| x.to_f32()).collect();
            let (b, bf) = if b_t {
                (
                    Strided::transposed(&bv[..], k),
                    Strided::transposed(&wide[..], k),
                )
            } else {
                (Strided::rows(&bv[..], n), Strided::rows(&wide[..], n))
            };
            for accumulate in [false, true] {
                let start = values(9, m * n);
                let mut got = start.clone();
                let a = Strided::rows(&av[..], k);
                let taken = gemm(&mut got, n, a, b, m, n, k, accumulate, &mut []);
                if !taken {
                    assert_eq!(got, start, "{m}x{n}x{k}: declined, yet written");
                    continue;
                }
                let mut want = start.clone();
                reference_gemm(&mut want, n, &av, bf, m, n, k, accumulate);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{m}x{n}x{k} accumulate {accumulate}"
                );
            }
        }
    }
}
