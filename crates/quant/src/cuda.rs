//! The 4-bit weights on an NVIDIA GPU (feature `cuda`): the packed layout uploaded as it is, and
//! the same fused matmul as on the CPU — each panel of `W` dequantized by
//! `headroom_kernels::QUANT4` into a `Workspace` tile, multiplied by cuBLASLt (f32), and its
//! result copied into its columns of the output. Panels run one after another on the backend's
//! stream, so one dequantized panel (and its `[n, panel]` product) is alive at a time.
//!
//! With double quantization the device keeps the 8-bit absmax codes; each call expands them
//! into a `Workspace` f32 absmax (one float per block, 1/16 of the f32 weight at block 64)
//! first. Not yet run on a GPU: the kernels are checked by NVRTC and, on the CPU, by
//! `tests/cuda_emulator.rs`.

use cudarc::driver::{DriverError, LaunchConfig, PushKernelArg};
use headroom_cuda::{cudarc, Cuda, CudaTensor, GemmOp, GemmShape};
use headroom_tensor::{Backend, DType, Error as TensorError, MemoryCategory};

use crate::tensor::{AbsmaxStorage, NESTED_BLOCKSIZE};
use crate::{MatmulOptions, QuantError, QuantizedTensor, Result};

/// Largest grid of the grid-stride kernels.
const MAX_BLOCKS: u64 = 65_535;

fn backend_error(
    cuda: &Cuda,
    op: &'static str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> QuantError {
    QuantError::Tensor(TensorError::Backend {
        device: cuda.device(),
        op,
        source: Box::new(e),
    })
}

fn grid(n: u64) -> LaunchConfig {
    let threads = headroom_kernels::BLOCK_THREADS;
    let blocks = n.div_ceil(threads as u64).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn slice<'a>(t: &'a CudaTensor, what: &'static str) -> Result<&'a cudarc::driver::CudaSlice<u8>> {
    t.slice().ok_or(QuantError::ShapeMismatch {
        op: "cuda",
        detail: format!("{what} is empty"),
    })
}

fn slice_mut<'a>(
    t: &'a mut CudaTensor,
    what: &'static str,
) -> Result<&'a mut cudarc::driver::CudaSlice<u8>> {
    t.slice_mut().ok_or(QuantError::ShapeMismatch {
        op: "cuda",
        detail: format!("{what} is empty"),
    })
}

/// The scales on the device.
enum DeviceAbsmax {
    Plain(CudaTensor),
    Double(Box<DeviceDoubleQuant>),
}

/// Double-quantized scales on the device.
struct DeviceDoubleQuant {
    codes: CudaTensor,
    offset: f32,
    absmax2: CudaTensor,
    code2: CudaTensor,
}

/// A [`QuantizedTensor`] resident on a GPU, as `Parameters` at its packed size.
pub struct CudaQuantizedTensor {
    rows: usize,
    cols: usize,
    blocks: usize,
    blocksize: usize,
    codes: CudaTensor,
    table: CudaTensor,
    absmax: DeviceAbsmax,
}

impl CudaQuantizedTensor {
    /// Upload `q` (its bytes as they are; nothing is dequantized).
    pub fn upload(cuda: &Cuda, q: &QuantizedTensor) -> Result<Self> {
        let _p = MemoryCategory::Parameters.enter();
        let cols = q.shape().last().copied().unwrap_or(1);
        let absmax = match q.absmax_storage() {
            AbsmaxStorage::Plain(_) => {
                let a = q.absmax_f32();
                DeviceAbsmax::Plain(cuda.upload(&a, [a.len()])?)
            }
            AbsmaxStorage::Double(d) => DeviceAbsmax::Double(Box::new(DeviceDoubleQuant {
                codes: cuda.upload(d.codes(), [d.codes().len()])?,
                offset: d.offset(),
                absmax2: cuda.upload(d.absmax2(), [d.absmax2().len()])?,
                code2: cuda.upload(d.code2(), [d.code2().len()])?,
            })),
        };
        Ok(CudaQuantizedTensor {
            rows: q.numel() / cols,
            cols,
            blocks: q.num_blocks(),
            blocksize: q.blocksize().get(),
            codes: cuda.upload(q.packed(), [q.packed().len()])?,
            table: cuda.upload(&q.dequant_table()[..], [16])?,
            absmax,
        })
    }

    /// `[rows, cols]` of the weight as a matrix.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The f32 absmax of every block: the stored tensor, or a `Workspace` expansion of the
    /// double-quantized one.
    fn absmax_f32(&self, cuda: &Cuda) -> Result<Option<CudaTensor>> {
        let DeviceAbsmax::Double(d) = &self.absmax else {
            return Ok(None);
        };
        let DeviceDoubleQuant {
            codes,
            offset,
            absmax2,
            code2,
        } = &**d;
        debug_assert_eq!(NESTED_BLOCKSIZE, 256); // the kernel's `b >> 8`
        let mut out = {
            let _ws = MemoryCategory::Workspace.enter();
            cuda.uninit([self.blocks], DType::F32)?
        };
        let function = cuda
            .function("quant4_absmax_dq_f32")
            .map_err(|e| backend_error(cuda, "quant4_absmax_dq_f32", e))?;
        let blocks = self.blocks as u64;
        let mut args = cuda.stream().launch_builder(&function);
        args.arg(slice(codes, "absmax codes")?)
            .arg(slice(code2, "code map")?)
            .arg(slice(absmax2, "nested absmax")?)
            .arg(offset)
            .arg(&blocks)
            .arg(slice_mut(&mut out, "absmax")?);
        // SAFETY: quant4_absmax_dq_f32(const u8* qabsmax, const float* code2, const float*
        // absmax2, float offset, u64 blocks, float* absmax): qabsmax and absmax hold `blocks`
        // elements, absmax2 ceil(blocks / 256) and code2 256 (checked by from_parts before
        // upload); grid-stride over `blocks`.
        unsafe { args.launch(grid(blocks)) }
            .map_err(|e: DriverError| backend_error(cuda, "quant4_absmax_dq_f32", e))?;
        Ok(Some(out))
    }

    /// The f32 scales to decode with: the expansion when there is one, else the stored ones.
    fn scales<'a>(&'a self, expanded: &'a Option<CudaTensor>) -> Result<&'a CudaTensor> {
        match (expanded, &self.absmax) {
            (Some(a), _) | (None, DeviceAbsmax::Plain(a)) => Ok(a),
            (None, DeviceAbsmax::Double(_)) => Err(QuantError::ShapeMismatch {
                op: "cuda",
                detail: "double-quantized scales were not expanded".into(),
            }),
        }
    }

    /// Dequantize the tile `[row0 .. row0 + rows] × [col0 .. col0 + width]` into a new
    /// `Workspace` tensor.
    fn tile(
        &self,
        cuda: &Cuda,
        absmax: &CudaTensor,
        (row0, rows): (usize, usize),
        (col0, width): (usize, usize),
    ) -> Result<CudaTensor> {
        let mut out = {
            let _ws = MemoryCategory::Workspace.enter();
            cuda.uninit([rows, width], DType::F32)?
        };
        let function = cuda
            .function("quant4_dequant_tile_f32")
            .map_err(|e| backend_error(cuda, "quant4_dequant_tile_f32", e))?;
        let [r0, nr, nc, c0, w, bs] =
            [row0, rows, self.cols, col0, width, self.blocksize].map(|v| v as u64);
        let mut args = cuda.stream().launch_builder(&function);
        args.arg(slice(&self.codes, "codes")?)
            .arg(slice(absmax, "absmax")?)
            .arg(slice(&self.table, "table")?)
            .arg(&r0)
            .arg(&nr)
            .arg(&nc)
            .arg(&c0)
            .arg(&w)
            .arg(&bs)
            .arg(slice_mut(&mut out, "tile")?);
        // SAFETY: quant4_dequant_tile_f32(codes, absmax, table, row0, rows, cols, col0, width,
        // blocksize, out): the tile lies inside the [self.rows, self.cols] weight (callers
        // pass ranges inside it), so every element index is below numel, every code byte below
        // ceil(numel / 2) and every block below `blocks`; `out` holds rows·width floats.
        unsafe { args.launch(grid(nr * w)) }
            .map_err(|e: DriverError| backend_error(cuda, "quant4_dequant_tile_f32", e))?;
        Ok(out)
    }

    fn scatter(
        cuda: &Cuda,
        src: &CudaTensor,
        n: usize,
        width: usize,
        dst: &mut CudaTensor,
        ld: usize,
        col0: usize,
    ) -> Result<()> {
        let function = cuda
            .function("quant4_scatter_cols_f32")
            .map_err(|e| backend_error(cuda, "quant4_scatter_cols_f32", e))?;
        let [n, w, ld, c0] = [n, width, ld, col0].map(|v| v as u64);
        let mut args = cuda.stream().launch_builder(&function);
        args.arg(slice(src, "tile product")?)
            .arg(&n)
            .arg(&w)
            .arg(slice_mut(dst, "output")?)
            .arg(&ld)
            .arg(&c0);
        // SAFETY: quant4_scatter_cols_f32(src, n, width, dst, ld, col0): src holds n·width
        // floats, dst n·ld with col0 + width ≤ ld (the caller's tiling).
        unsafe { args.launch(grid(n * w)) }
            .map_err(|e: DriverError| backend_error(cuda, "quant4_scatter_cols_f32", e))?;
        Ok(())
    }

    fn check(
        &self,
        op: &'static str,
        a: &CudaTensor,
        a_cols: usize,
        out: &CudaTensor,
        out_cols: usize,
    ) -> Result<usize> {
        use headroom_tensor::Tensor;
        let wrong = |detail: String| QuantError::ShapeMismatch { op, detail };
        if a.dtype() != DType::F32 || out.dtype() != DType::F32 {
            return Err(wrong("operands must be f32".into()));
        }
        if !a.numel().is_multiple_of(a_cols) {
            return Err(wrong(format!(
                "input of {} elements has rows of {a_cols}",
                a.numel()
            )));
        }
        let n = a.numel() / a_cols;
        if n.checked_mul(out_cols) != Some(out.numel()) {
            return Err(wrong(format!(
                "output of {} elements, expected {n} × {out_cols}",
                out.numel()
            )));
        }
        Ok(n)
    }

    /// `y = x · Wᵀ` on the GPU: `x` `[n, in]`, `y` `[n, out]`, f32; panels as
    /// [`MatmulOptions::forward_panel_rows`] gives them.
    pub fn matmul_forward(
        &self,
        cuda: &Cuda,
        x: &CudaTensor,
        y: &mut CudaTensor,
        opts: &MatmulOptions,
    ) -> Result<()> {
        let n = self.check("cuda matmul_forward", x, self.cols, y, self.rows)?;
        if n == 0 {
            return Ok(());
        }
        let expanded = self.absmax_f32(cuda)?;
        let absmax = self.scales(&expanded)?;
        let pr = opts.forward_panel_rows(self.rows, self.cols);
        for o0 in (0..self.rows).step_by(pr) {
            let rows = pr.min(self.rows - o0);
            let panel = self.tile(cuda, absmax, (o0, rows), (0, self.cols))?;
            let mut prod = {
                let _ws = MemoryCategory::Workspace.enter();
                cuda.uninit([n, rows], DType::F32)?
            };
            cuda.gemm(
                GemmOp::Forward,
                GemmShape {
                    m: n,
                    n: rows,
                    k: self.cols,
                },
                &mut prod,
                x,
                &panel,
                None,
                false,
            )?;
            Self::scatter(cuda, &prod, n, rows, y, self.rows, o0)?;
        }
        Ok(())
    }

    /// `dx = dy · W` on the GPU: `dy` `[n, out]`, `dx` `[n, in]` (overwritten), f32; strips as
    /// [`MatmulOptions::backward_panel_cols`] gives them. No weight gradient exists.
    pub fn matmul_backward_input(
        &self,
        cuda: &Cuda,
        dy: &CudaTensor,
        dx: &mut CudaTensor,
        opts: &MatmulOptions,
    ) -> Result<()> {
        let n = self.check("cuda matmul_backward_input", dy, self.rows, dx, self.cols)?;
        if n == 0 {
            return Ok(());
        }
        let expanded = self.absmax_f32(cuda)?;
        let absmax = self.scales(&expanded)?;
        let pc = opts.backward_panel_cols(self.rows, self.cols);
        for c0 in (0..self.cols).step_by(pc) {
            let width = pc.min(self.cols - c0);
            let strip = self.tile(cuda, absmax, (0, self.rows), (c0, width))?;
            let mut prod = {
                let _ws = MemoryCategory::Workspace.enter();
                cuda.uninit([n, width], DType::F32)?
            };
            // InputGrad: out[M, K] = a[M, N] · b[N, K] with M = n, N = out rows, K = width.
            cuda.gemm(
                GemmOp::InputGrad,
                GemmShape {
                    m: n,
                    n: self.rows,
                    k: width,
                },
                &mut prod,
                dy,
                &strip,
                None,
                false,
            )?;
            Self::scatter(cuda, &prod, n, width, dx, self.cols, c0)?;
        }
        Ok(())
    }
}
