//! Fused softmax cross-entropy (headroom-trainer's `ops::cross_entropy`) on the device: one
//! block per vocabulary row, the probabilities never stored.

use headroom_tensor::{DType, Result, Tensor};

use super::{dim_u32, expect_dtype, expect_f32, row_config, rows_of, OpLaunch};
use crate::device::Cuda;
use crate::tensor::CudaTensor;

/// Rows, and the vocabulary as the kernels take it, after checking logits (f32) and targets.
fn check_rows(
    op: &'static str,
    logits: &CudaTensor,
    targets: &CudaTensor,
    v: usize,
) -> Result<(usize, u32)> {
    expect_dtype(op, logits, DType::F32)?;
    check_rows_any(op, logits, targets, v)
}

/// [`check_rows`] for the entries that also take bf16 logits: whether they are bf16, the rows
/// and the vocabulary.
fn check_rows_f32_or_bf16(
    op: &'static str,
    logits: &CudaTensor,
    targets: &CudaTensor,
    v: usize,
) -> Result<(bool, usize, u32)> {
    let bf16 = logits.dtype() == DType::BF16;
    if !bf16 {
        expect_dtype(op, logits, DType::F32)?;
    }
    let (rows, v32) = check_rows_any(op, logits, targets, v)?;
    Ok((bf16, rows, v32))
}

fn check_rows_any(
    op: &'static str,
    logits: &CudaTensor,
    targets: &CudaTensor,
    v: usize,
) -> Result<(usize, u32)> {
    expect_dtype(op, targets, DType::U32)?;
    let v32 = dim_u32(op, logits, "v must be in 1..=u32::MAX", v)?;
    let rows = rows_of(op, logits, v, "the element count is not a multiple of v")?;
    super::expect_numel(op, targets, rows)?;
    Ok((rows, v32))
}

impl Cuda {
    /// Per-row loss `−log softmax(logits)[target]` into `losses` (f32 `[rows]`); `logits` is f32
    /// or bf16 `[rows, v]` (f32 arithmetic either way), `targets` u32 `[rows]`. A target ≥ v
    /// gives a NaN loss (never an out-of-bounds read).
    pub fn cross_entropy_forward(
        &self,
        losses: &mut CudaTensor,
        logits: &CudaTensor,
        targets: &CudaTensor,
        v: usize,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_forward";
        self.check_devices(OP, &[losses, logits, targets])?;
        let (bf16, rows, v32) = check_rows_f32_or_bf16(OP, logits, targets, v)?;
        expect_f32(OP, losses, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let kernel = if bf16 {
            "cross_entropy_forward_bf16"
        } else {
            "cross_entropy_forward_f32"
        };
        let func = self.op_function(OP, kernel)?;
        let rows64 = rows as u64;
        let (logits_b, targets_b) = (self.buffer(OP, logits)?, self.buffer(OP, targets)?);
        let losses_b = self.buffer_mut(OP, losses)?;
        let mut launch = OpLaunch::new(self, kernel, &func);
        launch
            .output(losses_b)
            .input(logits_b)
            .input(targets_b)
            .u64(&rows64)
            .u32(&v32);
        // SAFETY: losses holds rows f32, logits rows·v f32 or bf16 (the kernel's element
        // type), targets rows u32 (checked).
        unsafe { launch.launch(self, OP, row_config(rows64)) }
    }

    /// Losses and `dlogits = (softmax − onehot(target))·dloss[row]` in one pass over the
    /// logits; `dlogits` is overwritten (as on the CPU), `dloss` is f32 `[rows]`.
    pub fn cross_entropy_forward_backward(
        &self,
        losses: &mut CudaTensor,
        dlogits: &mut CudaTensor,
        logits: &CudaTensor,
        targets: &CudaTensor,
        dloss: &CudaTensor,
        v: usize,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_forward_backward";
        self.check_devices(OP, &[losses, dlogits, logits, targets, dloss])?;
        let (rows, v32) = check_rows(OP, logits, targets, v)?;
        expect_f32(OP, losses, rows)?;
        expect_f32(OP, dloss, rows)?;
        expect_f32(OP, dlogits, rows * v)?;
        if rows == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, "cross_entropy_forward_backward_f32")?;
        let rows64 = rows as u64;
        let (logits_b, targets_b, dloss_b) = (
            self.buffer(OP, logits)?,
            self.buffer(OP, targets)?,
            self.buffer(OP, dloss)?,
        );
        let losses_b = self.buffer_mut(OP, losses)?;
        let dlogits_b = self.buffer_mut(OP, dlogits)?;
        let mut launch = OpLaunch::new(self, "cross_entropy_forward_backward_f32", &func);
        launch
            .output(losses_b)
            .output(dlogits_b)
            .input(logits_b)
            .input(targets_b)
            .input(dloss_b)
            .u64(&rows64)
            .u32(&v32);
        // SAFETY: losses/dloss hold rows f32, dlogits/logits rows·v f32, targets rows u32
        // (checked); the two outputs are distinct mutable borrows.
        unsafe { launch.launch(self, OP, row_config(rows64)) }
    }

    /// [`Cuda::cross_entropy_forward_backward`] with the gradient written over `logits`
    /// (f32 or bf16 `[rows, v]`; bf16 logits get the f32 gradient rounded to nearest even):
    /// the head needs only the gradient afterwards, and the logits are the largest tensor of a
    /// step, so this spares a second buffer of their size.
    pub fn cross_entropy_forward_backward_in_place(
        &self,
        losses: &mut CudaTensor,
        logits: &mut CudaTensor,
        targets: &CudaTensor,
        dloss: &CudaTensor,
        v: usize,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_forward_backward_in_place";
        self.check_devices(OP, &[losses, logits, targets, dloss])?;
        let (bf16, rows, v32) = check_rows_f32_or_bf16(OP, logits, targets, v)?;
        expect_f32(OP, losses, rows)?;
        expect_f32(OP, dloss, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let kernel = if bf16 {
            "cross_entropy_forward_backward_in_place_bf16"
        } else {
            "cross_entropy_forward_backward_in_place_f32"
        };
        let func = self.op_function(OP, kernel)?;
        let rows64 = rows as u64;
        let (targets_b, dloss_b) = (self.buffer(OP, targets)?, self.buffer(OP, dloss)?);
        let losses_b = self.buffer_mut(OP, losses)?;
        let logits_b = self.buffer_mut(OP, logits)?;
        let mut launch = OpLaunch::new(self, kernel, &func);
        launch
            .output(losses_b)
            .output(logits_b)
            .input(targets_b)
            .input(dloss_b)
            .u64(&rows64)
            .u32(&v32);
        // SAFETY: losses/dloss hold rows f32, logits rows·v f32 or bf16 (the kernel's element
        // type), targets rows u32 (checked); the kernel reads and writes the logits through one
        // pointer (see its source).
        unsafe { launch.launch(self, OP, row_config(rows64)) }
    }

    /// `dlogits = (softmax − onehot(target))·dloss[row]` alone (the losses go to a
    /// `Workspace` scratch buffer, as the CPU op's go to a scratch vector).
    pub fn cross_entropy_backward(
        &self,
        dlogits: &mut CudaTensor,
        logits: &CudaTensor,
        targets: &CudaTensor,
        dloss: &CudaTensor,
        v: usize,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_backward";
        self.check_devices(OP, &[dlogits, logits, targets, dloss])?;
        let (rows, _) = check_rows(OP, logits, targets, v)?;
        let _scratch_category = headroom_tensor::MemoryCategory::Workspace.enter();
        let mut losses =
            self.alloc_tensor(headroom_tensor::Shape::from(vec![rows]), DType::F32, false)?;
        self.cross_entropy_forward_backward(&mut losses, dlogits, logits, targets, dloss, v)
    }
}
