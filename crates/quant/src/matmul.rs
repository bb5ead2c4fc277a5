//! The fused tiled dequantize-matmul of a frozen 4-bit weight `W` (`[out, in]`, row-major):
//! forward `Y = X·Wᵀ` and the input gradient `dX = dY·W`. No full f32 copy of `W` and no
//! weight gradient ever exist: each thread dequantizes one panel of `W` at a time into a
//! `Workspace` buffer and multiplies it with the gemm crate.
//!
//! - Forward tiles `W` by output rows: panel `p` (rows `o0..o1`) gives `Y[:, o0..o1]`.
//! - Backward tiles `W` by input columns: strip `c0..c1` (all rows) gives `dX[:, c0..c1]`, so
//!   every output element is written by one gemm call and nothing is accumulated across tasks.
//!
//! Panels are dealt round-robin to `min(threads, panels)` tasks, each owning one scratch buffer,
//! so at most one dequantized panel per thread is alive. The panel partition depends only on
//! the shapes and [`MatmulOptions`], never on the thread count, and each panel's gemm runs
//! single-threaded, so results are bitwise identical for any number of threads.

use headroom_tensor::{Backend, Cpu, DType, MemoryCategory};
use rayon::prelude::*;

use crate::dequant::Isa;
use crate::{QuantError, QuantizedTensor, Result};

/// Default f32 elements of one dequantized panel (4 MiB): large enough that the gemm crate's
/// packing of `X` is amortised over many output columns, small enough to stay in L2/L3.
pub const DEFAULT_PANEL_ELEMENTS: usize = 1 << 20;

/// Tiling of the fused matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulOptions {
    /// f32 elements per dequantized panel (rounded to whole rows/columns, at least one, and at
    /// least [`MIN_PANEL_WIDTH`] columns in the backward strips where the matrix allows).
    pub panel_elements: usize,
    /// Dequantization path; `None` picks the fastest this CPU supports.
    pub isa: Option<Isa>,
}

/// Narrowest backward strip (columns) unless the matrix is narrower: below this the vector
/// dequantization and the gemm micro-kernels run mostly on their tails.
pub const MIN_PANEL_WIDTH: usize = 32;

impl Default for MatmulOptions {
    fn default() -> Self {
        MatmulOptions {
            panel_elements: DEFAULT_PANEL_ELEMENTS,
            isa: None,
        }
    }
}

impl MatmulOptions {
    /// Rows of `W` per forward panel for a weight with `cols` input columns and `rows` rows.
    pub fn forward_panel_rows(&self, rows: usize, cols: usize) -> usize {
        (self.panel_elements / cols.max(1)).clamp(1, rows.max(1))
    }

    /// Columns of `W` per backward strip for a weight of `rows` × `cols`. Even, so that
    /// strips of a weight with an even row length start on byte boundaries.
    pub fn backward_panel_cols(&self, rows: usize, cols: usize) -> usize {
        let w = (self.panel_elements / rows.max(1)).max(MIN_PANEL_WIDTH);
        let w = if w > 1 { w & !1 } else { w };
        w.clamp(1, cols.max(1))
    }

    /// Bytes of dequantized workspace the forward holds at its peak with `threads` threads:
    /// one panel per task.
    pub fn forward_workspace_bytes(&self, rows: usize, cols: usize, threads: usize) -> usize {
        let pr = self.forward_panel_rows(rows, cols);
        let panels = rows.div_ceil(pr);
        panels.min(threads.max(1)) * pr * cols * 4
    }

    /// Bytes of dequantized workspace the backward holds at its peak with `threads` threads.
    pub fn backward_workspace_bytes(&self, rows: usize, cols: usize, threads: usize) -> usize {
        let pc = self.backward_panel_cols(rows, cols);
        let panels = cols.div_ceil(pc);
        panels.min(threads.max(1)) * pc * rows * 4
    }

    fn resolve_isa(&self) -> Result<Isa> {
        let isa = self.isa.unwrap_or_else(Isa::detect);
        if !isa.is_supported() {
            return Err(QuantError::UnsupportedIsa(isa.name()));
        }
        Ok(isa)
    }
}

/// A raw pointer that tasks writing disjoint parts of one output may share.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: the pointer is only used to write disjoint column ranges (one per panel, each panel
// owned by one task) while the owning `&mut [f32]` is borrowed for the whole parallel section.
unsafe impl Send for SharedOut {}
// SAFETY: as above; no two tasks write the same element.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    // A method, so closures capture the whole (Sync) wrapper rather than its raw field.
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// `W` viewed as a matrix: `[prod(leading dims), last dim]`.
fn matrix_dims(w: &QuantizedTensor) -> (usize, usize) {
    let shape = w.shape();
    let cols = shape.last().copied().unwrap_or(1);
    let rows = w.numel() / cols.max(1);
    (rows, cols)
}

fn rows_of(op: &'static str, name: &str, len: usize, cols: usize) -> Result<usize> {
    if cols == 0 || !len.is_multiple_of(cols) {
        return Err(QuantError::ShapeMismatch {
            op,
            detail: format!("{name} has {len} elements, not a multiple of its row length {cols}"),
        });
    }
    Ok(len / cols)
}

fn check_out(op: &'static str, name: &str, len: usize, rows: usize, cols: usize) -> Result<()> {
    match rows.checked_mul(cols) {
        Some(n) if n == len => Ok(()),
        _ => Err(QuantError::ShapeMismatch {
            op,
            detail: format!("{name} has {len} elements, expected {rows} × {cols}"),
        }),
    }
}

/// One single-threaded gemm: `dst[m × n] = lhs[m × k] · rhs[k × n]` with explicit strides.
///
/// # Safety
/// Every strided element of the three operands must lie inside live allocations, `dst` must
/// not overlap the inputs and no other thread may touch the written elements.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    lhs: *const f32,
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: *const f32,
    rhs_rs: usize,
    rhs_cs: usize,
) {
    // SAFETY: the caller's contract; strides are at most the operands' lengths, which fit in
    // isize because they are lengths of live allocations.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            false,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Forward of a frozen quantized linear: `y = x · Wᵀ`, `x` `[n, in]`, `W` `[out, in]`, `y`
/// `[n, out]` (row-major; `n` is `x.len() / in`). Dequantized panels are `Workspace`.
pub fn matmul_forward(
    cpu: &Cpu,
    x: &[f32],
    w: &QuantizedTensor,
    y: &mut [f32],
    opts: &MatmulOptions,
) -> Result<()> {
    const OP: &str = "matmul_forward";
    let (out, inn) = matrix_dims(w);
    let n = rows_of(OP, "x", x.len(), inn)?;
    check_out(OP, "y", y.len(), n, out)?;
    let isa = opts.resolve_isa()?;
    if n == 0 {
        return Ok(());
    }
    let pr = opts.forward_panel_rows(out, inn);
    let panels = out.div_ceil(pr);
    let tasks = panels.min(cpu.num_threads().max(1));
    let y_ptr = SharedOut(y.as_mut_ptr());
    cpu.install(|| {
        (0..tasks).into_par_iter().try_for_each(|t| -> Result<()> {
            let mut scratch = {
                let _ws = MemoryCategory::Workspace.enter();
                cpu.zeros([pr * inn], DType::F32)?
            };
            let panel = scratch.as_mut_slice::<f32>()?;
            for p in (t..panels).step_by(tasks) {
                let o0 = p * pr;
                let rows = pr.min(out - o0);
                let wp = &mut panel[..rows * inn];
                w.dequantize_range_with(isa, o0 * inn, wp);
                // SAFETY: y is [n, out]; this writes columns o0..o0+rows of every row, which
                // no other panel (and so no other task) writes; x is [n, inn] and the panel
                // [rows, inn], read as its transpose (row stride 1, column stride inn).
                unsafe {
                    gemm_f32(
                        n,
                        rows,
                        inn,
                        y_ptr.ptr().add(o0),
                        out,
                        x.as_ptr(),
                        inn,
                        1,
                        wp.as_ptr(),
                        1,
                        inn,
                    );
                }
            }
            Ok(())
        })
    })
}

/// Input gradient of a frozen quantized linear: `dx = dy · W`, `dy` `[n, out]`, `W`
/// `[out, in]`, `dx` `[n, in]` (overwritten). No gradient of `W` is computed or allocated.
pub fn matmul_backward_input(
    cpu: &Cpu,
    dy: &[f32],
    w: &QuantizedTensor,
    dx: &mut [f32],
    opts: &MatmulOptions,
) -> Result<()> {
    const OP: &str = "matmul_backward_input";
    let (out, inn) = matrix_dims(w);
    let n = rows_of(OP, "dy", dy.len(), out)?;
    check_out(OP, "dx", dx.len(), n, inn)?;
    let isa = opts.resolve_isa()?;
    if n == 0 {
        return Ok(());
    }
    let pc = opts.backward_panel_cols(out, inn);
    let panels = inn.div_ceil(pc);
    let tasks = panels.min(cpu.num_threads().max(1));
    let dx_ptr = SharedOut(dx.as_mut_ptr());
    cpu.install(|| {
        (0..tasks).into_par_iter().try_for_each(|t| -> Result<()> {
            let mut scratch = {
                let _ws = MemoryCategory::Workspace.enter();
                cpu.zeros([pc * out], DType::F32)?
            };
            let strip = scratch.as_mut_slice::<f32>()?;
            for p in (t..panels).step_by(tasks) {
                let c0 = p * pc;
                let cols = pc.min(inn - c0);
                let ws = &mut strip[..out * cols];
                for (r, row) in ws.chunks_exact_mut(cols).enumerate() {
                    w.dequantize_range_with(isa, r * inn + c0, row);
                }
                // SAFETY: dx is [n, inn]; this writes columns c0..c0+cols of every row, which
                // no other strip writes; dy is [n, out] and the strip [out, cols].
                unsafe {
                    gemm_f32(
                        n,
                        cols,
                        out,
                        dx_ptr.ptr().add(c0),
                        inn,
                        dy.as_ptr(),
                        out,
                        1,
                        ws.as_ptr(),
                        cols,
                        1,
                    );
                }
            }
            Ok(())
        })
    })
}
