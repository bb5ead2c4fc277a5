//! Matrix products of linear layers on cuBLASLt, row-major, with f32 accumulation.
//!
//! cuBLAS(Lt) is column-major; headroom's tensors are row-major. The translation lives in one
//! place, [`Cuda::gemm_row_major`]: a row-major `[r, c]` buffer read column-major is its
//! transpose, so the row-major product `out = op(L)·op(R)` is issued as the column-major
//! product `outᵀ = op(R)ᵀ·op(L)ᵀ`, with cuBLAS's A = R's buffer and B = L's buffer, each
//! transposed exactly when the row-major operand is. Nothing is copied or transposed in memory.
//!
//! The three products of a linear layer `y = x·Wᵀ (+ b)` with `x [M, K]`, `W [N, K]`:
//! - [`GemmOp::Forward`]: `out[M, N] (+)= a[M, K]·b[N, K]ᵀ (+ bias[N])`;
//! - [`GemmOp::InputGrad`]: `out[M, K] (+)= a[M, N]·b[N, K]` (`dX = dY·W`);
//! - [`GemmOp::WeightGrad`]: `out[N, K] (+)= a[M, N]ᵀ·b[M, K]` (`dW = dYᵀ·X`).
//!
//! Inputs are f32, f16 or bf16 (both the same), accumulation is always f32
//! (`CUBLAS_COMPUTE_32F`: no TF32 for f32 inputs), the output is f32 or the inputs' dtype, and
//! `accumulate` adds into the output (beta = 1), which is how gradients are summed. The bias is
//! fused in cuBLASLt's epilogue and has the output's dtype. The workspace cuBLASLt may use is
//! allocated per call through the backend, so the allocation hook sees it as `Workspace`.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::cublaslt::sys::cublasLtMatmulDescAttributes_t as DescAttr;
use cudarc::cublaslt::sys::cublasLtMatmulPreferenceAttributes_t as PrefAttr;
use cudarc::driver::DevicePtr;
use headroom_tensor::{DType, Error, Result, Tensor};

use crate::device::Cuda;
use crate::error::CudaError;
use crate::tensor::CudaTensor;

/// Which product of a linear layer (see the module documentation for the shapes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmOp {
    /// `out[M, N] (+)= a[M, K]·b[N, K]ᵀ (+ bias[N])`: the forward `y = x·Wᵀ + b`.
    Forward,
    /// `out[M, K] (+)= a[M, N]·b[N, K]`: the input gradient `dX = dY·W`.
    InputGrad,
    /// `out[N, K] (+)= a[M, N]ᵀ·b[M, K]`: the weight gradient `dW = dYᵀ·X`.
    WeightGrad,
}

/// The sizes of a linear layer: `M` rows (tokens), `N` output and `K` input features.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmShape {
    /// Rows of `x` and `y` (batch × sequence).
    pub m: usize,
    /// Output features (rows of `W`).
    pub n: usize,
    /// Input features (columns of `x` and `W`).
    pub k: usize,
}

/// One operand as stored: a dense row-major `[rows, cols]` buffer, used as itself or as its
/// transpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OperandLayout {
    rows: usize,
    cols: usize,
    transposed: bool,
}

impl OperandLayout {
    /// Rows and columns of `op(X)`.
    fn logical(&self) -> (usize, usize) {
        if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}

/// A row-major product `out[out_rows, out_cols] = op(lhs)·op(rhs)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowMajorProduct {
    lhs: OperandLayout,
    rhs: OperandLayout,
    out_rows: usize,
    out_cols: usize,
}

/// The row-major product each [`GemmOp`] is (`a` is the left operand, `b` the right).
pub(crate) fn product(op: GemmOp, shape: GemmShape) -> RowMajorProduct {
    let GemmShape { m, n, k } = shape;
    let layout = |rows, cols, transposed| OperandLayout {
        rows,
        cols,
        transposed,
    };
    match op {
        GemmOp::Forward => RowMajorProduct {
            lhs: layout(m, k, false),
            rhs: layout(n, k, true),
            out_rows: m,
            out_cols: n,
        },
        GemmOp::InputGrad => RowMajorProduct {
            lhs: layout(m, n, false),
            rhs: layout(n, k, false),
            out_rows: m,
            out_cols: k,
        },
        GemmOp::WeightGrad => RowMajorProduct {
            lhs: layout(m, n, true),
            rhs: layout(m, k, false),
            out_rows: n,
            out_cols: k,
        },
    }
}

/// A column-major matrix as cuBLASLt's layout describes it: `rows × cols`, leading dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ColumnMajorLayout {
    rows: u64,
    cols: u64,
    ld: i64,
}

/// The cuBLASLt call for a row-major product: `D = op(A)·op(B)` column-major, A being the right
/// operand's buffer and B the left's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ColumnMajorGemm {
    trans_a: bool,
    trans_b: bool,
    a: ColumnMajorLayout,
    b: ColumnMajorLayout,
    d: ColumnMajorLayout,
}

impl RowMajorProduct {
    /// The one row-major → column-major translation (see the module docs): a row-major
    /// `[r, c]` buffer is a column-major `c × r` matrix with leading dimension `c`, i.e. the
    /// transpose, so `out = op(L)·op(R)` is issued as `outᵀ = op(R)ᵀ·op(L)ᵀ`.
    fn column_major(&self) -> Option<ColumnMajorGemm> {
        let (l_rows, inner) = self.lhs.logical();
        let (r_inner, r_cols) = self.rhs.logical();
        if l_rows != self.out_rows || r_cols != self.out_cols || r_inner != inner {
            return None;
        }
        let stored = |o: &OperandLayout| ColumnMajorLayout {
            rows: o.cols as u64,
            cols: o.rows as u64,
            ld: o.cols as i64,
        };
        Some(ColumnMajorGemm {
            trans_a: self.rhs.transposed,
            trans_b: self.lhs.transposed,
            a: stored(&self.rhs),
            b: stored(&self.lhs),
            d: ColumnMajorLayout {
                rows: self.out_cols as u64,
                cols: self.out_rows as u64,
                ld: self.out_cols as i64,
            },
        })
    }
}

impl std::fmt::Display for ColumnMajorGemm {
    /// The call as cuBLASLt sees it, for error messages: a failed heuristic on the GPU is only
    /// diagnosable with the transposes, sizes and leading dimensions it was asked about.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let op = |t: bool| if t { 'T' } else { 'N' };
        let k = if self.trans_a {
            self.a.rows
        } else {
            self.a.cols
        };
        write!(
            f,
            "column-major D[{}x{}] = op{}(A)·op{}(B), k = {k}, lda = {}, ldb = {}, ldd = {}",
            self.d.rows,
            self.d.cols,
            op(self.trans_a),
            op(self.trans_b),
            self.a.ld,
            self.b.ld,
            self.d.ld
        )
    }
}

/// The alignment cuBLASLt's heuristic assumes of every pointer unless told otherwise (its
/// `CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES` default), and the most it is told here.
const MAX_POINTER_ALIGNMENT: u32 = 256;

/// The largest power of two (at most [`MAX_POINTER_ALIGNMENT`]) that divides `ptr`: what the
/// heuristic may assume of that operand. Whole device allocations are at least 256-byte
/// aligned, so for them this is the default and changes nothing; a less aligned pointer would
/// otherwise get an algorithm that needs more than it has, and the call would fail (PyTorch
/// passes the same preference for the same reason).
pub(crate) fn pointer_alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        return MAX_POINTER_ALIGNMENT;
    }
    let lowest_bit = 1u64 << ptr.trailing_zeros();
    lowest_bit.min(u64::from(MAX_POINTER_ALIGNMENT)) as u32
}

/// Workspace offered to cuBLASLt: NVIDIA's recommendation (32 MiB on Hopper, 4 MiB before).
fn workspace_bytes(compute_capability: (i32, i32)) -> usize {
    if compute_capability.0 >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

fn cuda_type(dtype: DType) -> Option<sys::cudaDataType> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType_t::CUDA_R_32F),
        DType::F16 => Some(sys::cudaDataType_t::CUDA_R_16F),
        DType::BF16 => Some(sys::cudaDataType_t::CUDA_R_16BF),
        _ => None,
    }
}

/// Shape and dtype checks for one product, before anything touches the device. Generic over
/// [`Tensor`] so they are unit-tested on CPU tensors.
pub(crate) fn check_gemm<T: Tensor>(
    op: GemmOp,
    shape: GemmShape,
    out: &T,
    a: &T,
    b: &T,
    bias: Option<&T>,
) -> Result<()> {
    let name = op_name(op);
    let GemmShape { m, n, k } = shape;
    // Checked before any product is formed: an overflowing shape is bad input, not a panic.
    let (Some(mn), Some(mk), Some(nk)) = (m.checked_mul(n), m.checked_mul(k), n.checked_mul(k))
    else {
        return Err(Error::InvalidShape {
            op: name,
            shape: out.shape().clone(),
            reason: "m·n, m·k or n·k overflows usize",
        });
    };
    let (out_len, a_len, b_len, bias_len) = match op {
        GemmOp::Forward => (mn, mk, nk, n),
        GemmOp::InputGrad => (mk, mn, nk, k),
        GemmOp::WeightGrad => (nk, mn, mk, k),
    };
    if cuda_type(a.dtype()).is_none() {
        return Err(Error::UnsupportedDType {
            op: name,
            dtype: a.dtype(),
        });
    }
    if b.dtype() != a.dtype() {
        return Err(Error::DTypeMismatch {
            op: name,
            expected: a.dtype(),
            got: b.dtype(),
        });
    }
    if out.dtype() != DType::F32 && out.dtype() != a.dtype() {
        return Err(Error::DTypeMismatch {
            op: name,
            expected: DType::F32,
            got: out.dtype(),
        });
    }
    Error::check_len(name, a_len, a.numel())?;
    Error::check_len(name, b_len, b.numel())?;
    Error::check_len(name, out_len, out.numel())?;
    if let Some(bias) = bias {
        if bias.dtype() != out.dtype() {
            return Err(Error::DTypeMismatch {
                op: name,
                expected: out.dtype(),
                got: bias.dtype(),
            });
        }
        Error::check_len(name, bias_len, bias.numel())?;
    }
    // cuBLASLt takes 64-bit sizes but rejects an empty inner dimension; the trainer never has
    // one, and returning an error beats guessing what a bias over zero terms should mean.
    let inner = match op {
        GemmOp::Forward => k,
        GemmOp::InputGrad => n,
        GemmOp::WeightGrad => m,
    };
    if inner == 0 && out_len > 0 {
        return Err(Error::InvalidShape {
            op: name,
            shape: a.shape().clone(),
            reason: "the inner dimension of the product is 0",
        });
    }
    Ok(())
}

fn op_name(op: GemmOp) -> &'static str {
    match op {
        GemmOp::Forward => "gemm (forward)",
        GemmOp::InputGrad => "gemm (input gradient)",
        GemmOp::WeightGrad => "gemm (weight gradient)",
    }
}

/// Destroys a cuBLASLt descriptor when dropped, on every path out of a call.
struct Guard<F: FnMut()>(F);

impl<F: FnMut()> Drop for Guard<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

/// A cuBLASLt library handle, created once per backend on first use.
pub(crate) struct LtHandle(sys::cublasLtHandle_t);

// SAFETY: a cuBLASLt handle is not tied to the thread that created it; the backend only uses
// it under its mutex, so it is never used from two threads at once.
unsafe impl Send for LtHandle {}

impl Drop for LtHandle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `create_handle` and is destroyed only here.
        let _ = unsafe { lt::destroy_handle(self.0) };
    }
}

/// True when libcublasLt can be loaded.
pub fn cublaslt_available() -> bool {
    // SAFETY: only tries to dlopen each candidate name and closes it again.
    unsafe { sys::is_culib_present() }
}

fn cublas_error(op: &'static str) -> impl Fn(lt::CublasError) -> CudaError {
    move |e| CudaError::Cublas {
        op,
        status: format!("{:?}", e.0),
    }
}

/// [`cublas_error`] with the call's geometry and types appended to the status (described only
/// when the call fails: the success path formats nothing).
fn cublas_call_error<'d>(
    op: &'static str,
    describe: &'d impl Fn() -> String,
) -> impl Fn(lt::CublasError) -> CudaError + 'd {
    move |e| CudaError::Cublas {
        op,
        status: format!("{:?} ({})", e.0, describe()),
    }
}

impl Cuda {
    /// One product of a linear layer (see [`GemmOp`]): `out (+)= op(a)·op(b) (+ bias)` with
    /// row-major tensors, f32 accumulation, `accumulate` choosing beta = 1 (add into `out`)
    /// or beta = 0 (overwrite). Shapes and dtypes are checked — with the shared error types —
    /// before anything is allocated or launched.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        op: GemmOp,
        shape: GemmShape,
        out: &mut CudaTensor,
        a: &CudaTensor,
        b: &CudaTensor,
        bias: Option<&CudaTensor>,
        accumulate: bool,
    ) -> Result<()> {
        let name = op_name(op);
        self.check_devices(name, &[out, a, b])?;
        if let Some(bias) = bias {
            self.check_device(name, bias)?;
        }
        check_gemm(op, shape, &*out, a, b, bias)?;
        let p = product(op, shape);
        if p.out_rows == 0 || p.out_cols == 0 {
            return Ok(());
        }
        self.gemm_row_major(name, &p, out, a, b, bias, accumulate)
    }

    /// The trainer's `matmul::forward`: `out[n, oc] = inp[n, c]·weight[oc, c]ᵀ (+ bias[oc])`.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_forward(
        &self,
        out: &mut CudaTensor,
        inp: &CudaTensor,
        weight: &CudaTensor,
        bias: Option<&CudaTensor>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<()> {
        let shape = GemmShape { m: n, n: oc, k: c };
        self.gemm(GemmOp::Forward, shape, out, inp, weight, bias, false)
    }

    /// The trainer's `matmul::backward`: `dinp += dout·weight`, `dweight += doutᵀ·inp`,
    /// `dbias += Σ_rows dout` (a deterministic column sum; needs f32 `dout` and `dbias`).
    /// Everything is checked before the first launch.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward(
        &self,
        dinp: &mut CudaTensor,
        dweight: &mut CudaTensor,
        dbias: Option<&mut CudaTensor>,
        dout: &CudaTensor,
        inp: &CudaTensor,
        weight: &CudaTensor,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<()> {
        const OP: &str = "matmul_backward";
        let shape = GemmShape { m: n, n: oc, k: c };
        self.check_devices(OP, &[dinp, dweight, dout, inp, weight])?;
        check_gemm(GemmOp::InputGrad, shape, &*dinp, dout, weight, None)?;
        check_gemm(GemmOp::WeightGrad, shape, &*dweight, dout, inp, None)?;
        if let Some(db) = dbias.as_deref() {
            self.check_device(OP, db)?;
            crate::ops::expect_f32(OP, db, oc)?;
            crate::ops::expect_dtype(OP, dout, DType::F32)?;
        }
        self.gemm(GemmOp::InputGrad, shape, dinp, dout, weight, None, true)?;
        self.gemm(GemmOp::WeightGrad, shape, dweight, dout, inp, None, true)?;
        if let Some(db) = dbias {
            if n == 0 || oc == 0 {
                return Ok(());
            }
            let cols = crate::ops::dim_u32(OP, db, "oc must be in 1..=u32::MAX", oc)?;
            let dout_b = self.buffer(OP, dout)?;
            let db_b = self.buffer_mut(OP, db)?;
            self.column_sum_accumulate(OP, db_b, dout_b, n, cols)?;
        }
        Ok(())
    }

    /// Run the cuBLASLt handle's closure under the backend's handle lock, creating the handle
    /// on first use.
    fn with_cublaslt<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(sys::cublasLtHandle_t) -> Result<R>,
    ) -> Result<R> {
        let mut slot = self.cublaslt_slot();
        if slot.is_none() {
            if !cublaslt_available() {
                return Err(self.fail(op)(CudaError::CublasUnavailable {
                    reason: "libcublasLt could not be loaded (not on the library search path)"
                        .into(),
                }));
            }
            self.context()
                .bind_to_thread()
                .map_err(self.driver_fail(op))?;
            // cudarc panics if the library lacks a symbol; that must be an error here.
            let created = catch_unwind(AssertUnwindSafe(lt::create_handle)).unwrap_or(Err(
                lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_INITIALIZED),
            ));
            let handle = created.map_err(|e| self.fail(op)(cublas_error("cublasLtCreate")(e)))?;
            *slot = Some(LtHandle(handle));
        }
        // cuBLASLt launches on the stream through the runtime API, which needs the stream's
        // context current on this thread (a caller may have switched it).
        self.context()
            .bind_to_thread()
            .map_err(self.driver_fail(op))?;
        let handle = slot.as_ref().map(|h| h.0).ok_or_else(|| {
            self.fail(op)(CudaError::CublasUnavailable {
                reason: "no cuBLASLt handle".into(),
            })
        })?;
        f(handle)
    }

    /// `out[out_rows, out_cols] (+)= op(lhs)·op(rhs) (+ bias)`, all row-major: the one place
    /// that maps row-major products onto column-major cuBLASLt (see the module docs).
    #[allow(clippy::too_many_arguments)]
    fn gemm_row_major(
        &self,
        op: &'static str,
        p: &RowMajorProduct,
        out: &mut CudaTensor,
        lhs: &CudaTensor,
        rhs: &CudaTensor,
        bias: Option<&CudaTensor>,
        accumulate: bool,
    ) -> Result<()> {
        let plan = p.column_major().ok_or_else(|| Error::InvalidShape {
            // The public entry points build consistent products; this guards the mapping.
            op,
            shape: out.shape().clone(),
            reason: "inconsistent row-major product (a bug in headroom-cuda)",
        })?;
        let in_type = cuda_type(lhs.dtype()).ok_or(Error::UnsupportedDType {
            op,
            dtype: lhs.dtype(),
        })?;
        let out_type = cuda_type(out.dtype()).ok_or(Error::UnsupportedDType {
            op,
            dtype: out.dtype(),
        })?;
        let ws_bytes = workspace_bytes(self.compute_capability());
        let workspace = self.workspace::<u8>(ws_bytes, DType::U8, false)?;
        let stream = self.stream().clone();
        let lhs_buf = self.buffer(op, lhs)?;
        let rhs_buf = self.buffer(op, rhs)?;
        let bias_buf = match bias {
            Some(b) => Some(self.buffer(op, b)?),
            None => None,
        };
        let out_buf = self.buffer_mut(op, out)?;
        let fail = |e: CudaError| self.fail(op)(e);

        self.with_cublaslt(op, |handle| {
            // Column-major: cuBLAS A = the right operand's buffer, B = the left's, D = out.
            let layout = |dtype, l: ColumnMajorLayout, what| {
                lt::create_matrix_layout(dtype, l.rows, l.cols, l.ld)
                    .map_err(cublas_error(what))
                    .map_err(fail)
            };
            let a_layout = layout(in_type, plan.a, "a layout")?;
            let _a = Guard(|| {
                // SAFETY: each descriptor (this one and those of the guards below) is destroyed
                // exactly once, when its guard drops, after its last use.
                let _ = unsafe { lt::destroy_matrix_layout(a_layout) };
            });
            let b_layout = layout(in_type, plan.b, "b layout")?;
            let _b = Guard(|| {
                // SAFETY: see above.
                let _ = unsafe { lt::destroy_matrix_layout(b_layout) };
            });
            let d_layout = layout(out_type, plan.d, "d layout")?;
            let _d = Guard(|| {
                // SAFETY: see above.
                let _ = unsafe { lt::destroy_matrix_layout(d_layout) };
            });
            let desc = lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType_t::CUDA_R_32F,
            )
            .map_err(cublas_error("matmul desc"))
            .map_err(fail)?;
            let _desc = Guard(|| {
                // SAFETY: see above.
                let _ = unsafe { lt::destroy_matmul_desc(desc) };
            });
            let set = |attr, value: *const c_void, size: usize| {
                // SAFETY: `desc` is live; `value` points at `size` readable bytes.
                unsafe { lt::set_matmul_desc_attribute(desc, attr, value, size) }
                    .map_err(cublas_error("matmul desc attribute"))
                    .map_err(fail)
            };
            // cublasOperation_t as the attribute stores it: an int, CUBLAS_OP_N = 0, _T = 1.
            let op_of = |t: bool| -> i32 { i32::from(t) };
            let (trans_a, trans_b) = (op_of(plan.trans_a), op_of(plan.trans_b));
            set(
                DescAttr::CUBLASLT_MATMUL_DESC_TRANSA,
                (&trans_a as *const i32).cast(),
                std::mem::size_of::<i32>(),
            )?;
            set(
                DescAttr::CUBLASLT_MATMUL_DESC_TRANSB,
                (&trans_b as *const i32).cast(),
                std::mem::size_of::<i32>(),
            )?;
            let (bias_ptr, _bias_sync) = match bias_buf {
                Some(b) => {
                    let (p, s) = b.device_ptr(&stream);
                    (Some(p), Some(s))
                }
                None => (None, None),
            };
            if let Some(p) = bias_ptr.as_ref() {
                let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                set(
                    DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    (&epilogue as *const sys::cublasLtEpilogue_t).cast(),
                    std::mem::size_of::<sys::cublasLtEpilogue_t>(),
                )?;
                set(
                    DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (p as *const cudarc::driver::sys::CUdeviceptr).cast(),
                    std::mem::size_of::<cudarc::driver::sys::CUdeviceptr>(),
                )?;
            }
            let pref = lt::create_matmul_pref()
                .map_err(cublas_error("matmul preference"))
                .map_err(fail)?;
            let _pref = Guard(|| {
                // SAFETY: see above.
                let _ = unsafe { lt::destroy_matmul_pref(pref) };
            });
            // SAFETY: `pref` is live; the value is one usize.
            unsafe {
                lt::set_matmul_pref_attribute(
                    pref,
                    PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&ws_bytes as *const usize).cast(),
                    std::mem::size_of::<usize>(),
                )
            }
            .map_err(cublas_error("matmul preference attribute"))
            .map_err(fail)?;
            // The pointers are needed before the heuristic: it must know their alignment.
            let (a_ptr, _a_sync) = rhs_buf.device_ptr(&stream);
            let (b_ptr, _b_sync) = lhs_buf.device_ptr(&stream);
            let (d_ptr, _d_sync) = cudarc::driver::DevicePtrMut::device_ptr_mut(out_buf, &stream);
            let (w_ptr, _w_sync) = workspace.buffer.device_ptr(&stream);
            for (attr, ptr) in [
                (PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a_ptr),
                (PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b_ptr),
                // C is D (same buffer, same layout).
                (PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, d_ptr),
                (PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, d_ptr),
            ] {
                let alignment: u32 = pointer_alignment(ptr);
                // SAFETY: `pref` is live; the attribute is one uint32_t.
                unsafe {
                    lt::set_matmul_pref_attribute(
                        pref,
                        attr,
                        (&alignment as *const u32).cast(),
                        std::mem::size_of::<u32>(),
                    )
                }
                .map_err(cublas_error("matmul preference attribute"))
                .map_err(fail)?;
            }
            let with_bias = bias_ptr.is_some();
            let call = || {
                format!(
                    "{plan}, {in_type:?} inputs, {out_type:?} output, bias: {with_bias}, \
                     beta: {}",
                    u8::from(accumulate)
                )
            };
            // SAFETY: every descriptor is live and describes the buffers below. Zero
            // algorithms come back as CUBLAS_STATUS_NOT_SUPPORTED (cudarc checks the count).
            let heuristic = unsafe {
                lt::get_matmul_algo_heuristic(
                    handle, desc, a_layout, b_layout, d_layout, d_layout, pref,
                )
            }
            .map_err(cublas_call_error("cublasLtMatmulAlgoGetHeuristic", &call))
            .map_err(fail)?;

            let alpha = 1.0f32;
            let beta = if accumulate { 1.0f32 } else { 0.0f32 };
            // SAFETY: the layouts match the buffers' checked element counts and dtypes; D is
            // also C (read only when beta = 1); the workspace holds `ws_bytes` bytes; everything
            // stays alive until the call is queued, and the stream orders later frees after it.
            unsafe {
                lt::matmul(
                    handle,
                    desc,
                    (&alpha as *const f32).cast(),
                    (&beta as *const f32).cast(),
                    a_ptr as *const c_void,
                    a_layout,
                    b_ptr as *const c_void,
                    b_layout,
                    d_ptr as *const c_void,
                    d_layout,
                    d_ptr as *mut c_void,
                    d_layout,
                    &heuristic.algo,
                    w_ptr as *mut c_void,
                    ws_bytes,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            }
            .map_err(cublas_call_error("cublasLtMatmul", &call))
            .map_err(fail)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_tensor::{Backend, Cpu};

    fn t(cpu: &Cpu, n: usize, dtype: DType) -> headroom_tensor::CpuTensor {
        cpu.zeros([n], dtype).unwrap()
    }

    #[test]
    fn gemm_checks_shapes_and_dtypes_before_anything_runs() {
        let cpu = Cpu::new();
        let s = GemmShape { m: 4, n: 3, k: 5 };
        let (bf, f) = (DType::BF16, DType::F32);
        // Forward: out[m, n], a[m, k], b[n, k], bias[n].
        let ok = check_gemm(
            GemmOp::Forward,
            s,
            &t(&cpu, 12, f),
            &t(&cpu, 20, bf),
            &t(&cpu, 15, bf),
            Some(&t(&cpu, 3, f)),
        );
        assert!(ok.is_ok(), "{ok:?}");
        // Output in the inputs' dtype is allowed too.
        assert!(check_gemm(
            GemmOp::Forward,
            s,
            &t(&cpu, 12, bf),
            &t(&cpu, 20, bf),
            &t(&cpu, 15, bf),
            None
        )
        .is_ok());
        // Wrong lengths for each operand of each product.
        assert!(matches!(
            check_gemm(
                GemmOp::Forward,
                s,
                &t(&cpu, 12, f),
                &t(&cpu, 21, bf),
                &t(&cpu, 15, bf),
                None
            ),
            Err(Error::LengthMismatch {
                expected: 20,
                got: 21,
                ..
            })
        ));
        assert!(matches!(
            check_gemm(
                GemmOp::InputGrad,
                s,
                &t(&cpu, 20, f),
                &t(&cpu, 12, f),
                &t(&cpu, 14, f),
                None
            ),
            Err(Error::LengthMismatch {
                expected: 15,
                got: 14,
                ..
            })
        ));
        assert!(check_gemm(
            GemmOp::InputGrad,
            s,
            &t(&cpu, 20, f),
            &t(&cpu, 12, f),
            &t(&cpu, 15, f),
            None
        )
        .is_ok());
        assert!(check_gemm(
            GemmOp::WeightGrad,
            s,
            &t(&cpu, 15, f),
            &t(&cpu, 12, bf),
            &t(&cpu, 20, bf),
            None
        )
        .is_ok());
        assert!(matches!(
            check_gemm(
                GemmOp::WeightGrad,
                s,
                &t(&cpu, 12, f),
                &t(&cpu, 12, bf),
                &t(&cpu, 20, bf),
                None
            ),
            Err(Error::LengthMismatch {
                expected: 15,
                got: 12,
                ..
            })
        ));
        // Mixed input dtypes, an f16 output for bf16 inputs, integer inputs, bias dtype.
        assert!(matches!(
            check_gemm(
                GemmOp::Forward,
                s,
                &t(&cpu, 12, f),
                &t(&cpu, 20, bf),
                &t(&cpu, 15, DType::F16),
                None
            ),
            Err(Error::DTypeMismatch { .. })
        ));
        assert!(matches!(
            check_gemm(
                GemmOp::Forward,
                s,
                &t(&cpu, 12, DType::F16),
                &t(&cpu, 20, bf),
                &t(&cpu, 15, bf),
                None
            ),
            Err(Error::DTypeMismatch { .. })
        ));
        assert!(matches!(
            check_gemm(
                GemmOp::Forward,
                s,
                &t(&cpu, 12, f),
                &t(&cpu, 20, DType::U32),
                &t(&cpu, 15, DType::U32),
                None
            ),
            Err(Error::UnsupportedDType { .. })
        ));
        assert!(matches!(
            check_gemm(
                GemmOp::Forward,
                s,
                &t(&cpu, 12, f),
                &t(&cpu, 20, bf),
                &t(&cpu, 15, bf),
                Some(&t(&cpu, 3, bf))
            ),
            Err(Error::DTypeMismatch { .. })
        ));
        // Sizes whose products overflow are refused, not a panic (overflow checks are on in
        // debug builds).
        for op in [GemmOp::Forward, GemmOp::InputGrad, GemmOp::WeightGrad] {
            let huge = GemmShape {
                m: usize::MAX / 2,
                n: 3,
                k: 5,
            };
            assert!(matches!(
                check_gemm(
                    op,
                    huge,
                    &t(&cpu, 12, f),
                    &t(&cpu, 20, f),
                    &t(&cpu, 15, f),
                    None
                ),
                Err(Error::InvalidShape { .. })
            ));
        }
        // An empty inner dimension with a non-empty output is refused; empty outputs are fine.
        let k0 = GemmShape { m: 2, n: 2, k: 0 };
        assert!(matches!(
            check_gemm(
                GemmOp::Forward,
                k0,
                &t(&cpu, 4, f),
                &t(&cpu, 0, f),
                &t(&cpu, 0, f),
                None
            ),
            Err(Error::InvalidShape { .. })
        ));
        let m0 = GemmShape { m: 0, n: 2, k: 3 };
        assert!(check_gemm(
            GemmOp::Forward,
            m0,
            &t(&cpu, 0, f),
            &t(&cpu, 0, f),
            &t(&cpu, 6, f),
            None
        )
        .is_ok());
    }

    /// cuBLAS's column-major `D = op(A)·op(B)` with the given layouts, on host buffers: the
    /// semantics `gemm_row_major` relies on, emulated.
    fn column_major_gemm(g: &ColumnMajorGemm, a: &[f64], b: &[f64]) -> Vec<f64> {
        let at = |i: u64, p: u64| {
            let (r, c) = if g.trans_a { (p, i) } else { (i, p) };
            a[(r + c * g.a.ld as u64) as usize]
        };
        let bt = |p: u64, j: u64| {
            let (r, c) = if g.trans_b { (j, p) } else { (p, j) };
            b[(r + c * g.b.ld as u64) as usize]
        };
        let (m, n) = (g.d.rows, g.d.cols);
        let k = if g.trans_a { g.a.rows } else { g.a.cols };
        let mut d = vec![0.0; (m * n) as usize];
        for i in 0..m {
            for j in 0..n {
                d[(i + j * g.d.ld as u64) as usize] = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
            }
        }
        d
    }

    /// The three products by their row-major definitions, directly.
    fn row_major_reference(op: GemmOp, s: GemmShape, a: &[f64], b: &[f64]) -> Vec<f64> {
        let GemmShape { m, n, k } = s;
        match op {
            // out[i, j] = Σ_p a[i, p]·b[j, p]
            GemmOp::Forward => (0..m * n)
                .map(|x| {
                    (0..k)
                        .map(|p| a[(x / n) * k + p] * b[(x % n) * k + p])
                        .sum()
                })
                .collect(),
            // out[i, j] = Σ_p a[i, p]·b[p, j], a [m, n], b [n, k]
            GemmOp::InputGrad => (0..m * k)
                .map(|x| (0..n).map(|p| a[(x / k) * n + p] * b[p * k + x % k]).sum())
                .collect(),
            // out[i, j] = Σ_p a[p, i]·b[p, j], a [m, n], b [m, k]
            GemmOp::WeightGrad => (0..n * k)
                .map(|x| (0..m).map(|p| a[p * n + x / k] * b[p * k + x % k]).sum())
                .collect(),
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// The row-major → column-major translation computes each product's definition, for
        /// any sizes (exact in f64 on small integers).
        #[test]
        fn column_major_translation_computes_the_row_major_products(
            m in 1usize..7, n in 1usize..7, k in 1usize..7, seed in 0u64..1000,
        ) {
            let s = GemmShape { m, n, k };
            for op in [GemmOp::Forward, GemmOp::InputGrad, GemmOp::WeightGrad] {
                let p = product(op, s);
                let g = p.column_major().expect("consistent");
                let (a_len, b_len) = (p.lhs.rows * p.lhs.cols, p.rhs.rows * p.rhs.cols);
                let val =
                    |i: usize, salt: u64| ((i as u64 * 7 + seed * 13 + salt) % 11) as f64 - 5.0;
                let a: Vec<f64> = (0..a_len).map(|i| val(i, 1)).collect();
                let b: Vec<f64> = (0..b_len).map(|i| val(i, 3)).collect();
                // cuBLAS A is the right operand's buffer, B the left's.
                let got = column_major_gemm(&g, &b, &a);
                let want = row_major_reference(op, s, &a, &b);
                proptest::prop_assert_eq!(got, want, "{:?}", op);
            }
        }
    }

    #[test]
    fn pointer_alignment_is_the_lowest_set_bit_capped_at_the_default() {
        // Whole allocations (256-byte aligned or better) keep cuBLASLt's default.
        assert_eq!(pointer_alignment(0x7f00_0000_0000), 256);
        assert_eq!(pointer_alignment(0x7f00_0000_0100), 256);
        assert_eq!(pointer_alignment(0x7f00_0000_0200), 256);
        // Interior pointers report what they really have.
        assert_eq!(pointer_alignment(0x7f00_0000_0080), 128);
        assert_eq!(pointer_alignment(0x7f00_0000_0010), 16);
        assert_eq!(pointer_alignment(0x7f00_0000_0002), 2);
        assert_eq!(pointer_alignment(0x7f00_0000_0001), 1);
        assert_eq!(pointer_alignment(0), 256);
    }

    #[test]
    fn failed_calls_describe_the_column_major_geometry() {
        // Forward, m = 2 tokens, n = 3 outputs, k = 5: D is yᵀ (3×2), A is W's buffer read as
        // k×n and transposed, B is x's buffer read as k×m.
        let g = product(GemmOp::Forward, GemmShape { m: 2, n: 3, k: 5 })
            .column_major()
            .unwrap();
        assert_eq!(
            g.to_string(),
            "column-major D[3x2] = opT(A)·opN(B), k = 5, lda = 5, ldb = 5, ldd = 3"
        );
    }

    #[test]
    fn inconsistent_products_are_refused_and_constants_hold() {
        let mut p = product(GemmOp::Forward, GemmShape { m: 2, n: 3, k: 4 });
        assert!(p.column_major().is_some());
        p.out_cols = 5;
        assert!(p.column_major().is_none());
        assert_eq!(workspace_bytes((9, 0)), 32 << 20);
        assert_eq!(workspace_bytes((8, 6)), 4 << 20);
        assert!(cuda_type(DType::I32).is_none());
        assert_eq!(
            cuda_type(DType::BF16),
            Some(sys::cudaDataType_t::CUDA_R_16BF)
        );
    }
}
