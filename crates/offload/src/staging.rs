//! The host side of offloading from an accelerator, with no device code: how parameters are
//! grouped into buckets, where each parameter's gradient and updated copy sit inside a bucket's
//! staging buffers, which buckets a step has seen, the AdamW update of one staged bucket, and
//! the worker thread that runs those updates while backward continues.
//!
//! The CUDA pipeline (`cuda_pipeline.rs`, feature `cuda`) moves bytes between device tensors
//! and these staging buffers; everything that decides *what* goes *where* lives here so that
//! it is tested on any machine.

use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Receiver, Sender};
use half::{bf16, f16};
use headroom_tensor::cpu::kernels::{FloatSlice, FloatSliceMut};
use headroom_tensor::{DType, Tensor};

use crate::{CpuAdamW, OffloadError, Result};

/// Byte alignment of every parameter's region inside a staging buffer. 256 bytes keeps each
/// region aligned for any element type, on its own cache lines (the CPU worker writes one
/// region while a DMA engine may read a neighbour), and at the alignment copy engines like
/// best.
pub const STAGING_ALIGN: usize = 256;

/// One parameter as the device holds it: its size, the dtype its gradient is produced in, and
/// the dtype of the device copy the updated value is uploaded into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceParamSpec {
    /// Number of elements.
    pub numel: usize,
    /// Dtype of the gradient tensor backward writes (f32, bf16 or f16).
    pub grad_dtype: DType,
    /// Dtype of the device parameter tensor the update is uploaded into (f32, bf16 or f16).
    pub param_dtype: DType,
}

/// Where one parameter's data sits inside its bucket's two staging buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedParam {
    /// Index of the parameter (into the optimizer and the caller's tensor lists).
    pub param: usize,
    /// Its element count and dtypes.
    pub spec: DeviceParamSpec,
    /// Byte offset of its gradient in the bucket's gradient staging buffer.
    pub grad_offset: usize,
    /// Byte offset of its updated copy in the bucket's upload staging buffer.
    pub upload_offset: usize,
}

impl StagedParam {
    /// Bytes of the gradient.
    pub fn grad_bytes(&self) -> usize {
        self.spec
            .numel
            .saturating_mul(self.spec.grad_dtype.size_in_bytes())
    }
    /// Bytes of the uploaded copy.
    pub fn upload_bytes(&self) -> usize {
        self.spec
            .numel
            .saturating_mul(self.spec.param_dtype.size_in_bytes())
    }
}

/// One bucket: its parameters in the order given, and the size of its staging buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketLayout {
    /// The bucket's parameters and their staging offsets.
    pub params: Vec<StagedParam>,
    /// Size of the gradient (device→host) staging buffer in bytes.
    pub grad_bytes: usize,
    /// Size of the upload (host→device) staging buffer in bytes.
    pub upload_bytes: usize,
}

/// Buckets of parameters, in the order backward is expected to finish them, with the staging
/// layout of each. Every parameter is in exactly one bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingPlan {
    specs: Vec<DeviceParamSpec>,
    buckets: Vec<BucketLayout>,
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F16 | DType::BF16)
}

/// `x` rounded up to a multiple of [`STAGING_ALIGN`], or an error when that overflows.
fn align_up(x: usize) -> Result<usize> {
    x.checked_next_multiple_of(STAGING_ALIGN)
        .ok_or_else(|| OffloadError::Pipeline("staging buffer size overflows".into()))
}

impl StagingPlan {
    /// A plan for parameters `specs` grouped into `buckets` (lists of parameter indices; bucket
    /// 0 is the one backward finishes first). Errors when a parameter is in no bucket or in two,
    /// an index does not exist, a bucket is empty, or a dtype is not f32/bf16/f16.
    pub fn new(specs: Vec<DeviceParamSpec>, buckets: Vec<Vec<usize>>) -> Result<Self> {
        for (i, s) in specs.iter().enumerate() {
            for (what, dtype) in [("gradient", s.grad_dtype), ("parameter", s.param_dtype)] {
                if !is_float(dtype) {
                    return Err(OffloadError::Pipeline(format!(
                        "parameter {i}: {what} dtype {dtype:?} is not f32, bf16 or f16"
                    )));
                }
            }
        }
        let mut seen = vec![false; specs.len()];
        let mut layouts = Vec::with_capacity(buckets.len());
        for (b, members) in buckets.iter().enumerate() {
            if members.is_empty() {
                return Err(OffloadError::Pipeline(format!("bucket {b} is empty")));
            }
            let (mut grad_bytes, mut upload_bytes) = (0usize, 0usize);
            let mut params = Vec::with_capacity(members.len());
            for &p in members {
                match seen.get_mut(p) {
                    None => {
                        return Err(OffloadError::UnknownParam {
                            index: p,
                            count: specs.len(),
                        })
                    }
                    Some(true) => {
                        return Err(OffloadError::Pipeline(format!(
                            "parameter {p} is in two buckets"
                        )))
                    }
                    Some(s) => *s = true,
                }
                let spec = specs[p];
                let staged = StagedParam {
                    param: p,
                    spec,
                    grad_offset: grad_bytes,
                    upload_offset: upload_bytes,
                };
                let overflow = || OffloadError::Pipeline("staging buffer size overflows".into());
                let g = spec
                    .numel
                    .checked_mul(spec.grad_dtype.size_in_bytes())
                    .ok_or_else(overflow)?;
                let u = spec
                    .numel
                    .checked_mul(spec.param_dtype.size_in_bytes())
                    .ok_or_else(overflow)?;
                grad_bytes = align_up(grad_bytes.checked_add(g).ok_or_else(overflow)?)?;
                upload_bytes = align_up(upload_bytes.checked_add(u).ok_or_else(overflow)?)?;
                params.push(staged);
            }
            layouts.push(BucketLayout {
                params,
                grad_bytes,
                upload_bytes,
            });
        }
        if let Some(p) = seen.iter().position(|s| !s) {
            return Err(OffloadError::Pipeline(format!(
                "parameter {p} is in no bucket (it would never be updated)"
            )));
        }
        Ok(StagingPlan {
            specs,
            buckets: layouts,
        })
    }

    /// A plan that walks `backward_order` (every parameter index once, in the order backward
    /// finishes their gradients) and closes a bucket before the gradient bytes would pass
    /// `max_bucket_bytes`; a parameter larger than that gets a bucket of its own.
    ///
    /// Trade-off: small buckets start the CPU update earlier and overlap more of backward;
    /// large buckets mean fewer events, copies and worker hand-offs. A few MiB per bucket keeps
    /// per-bucket overheads (tens of microseconds) far below the copy time.
    ///
    /// ```
    /// use headroom_offload::{DeviceParamSpec, StagingPlan, STAGING_ALIGN};
    /// use headroom_tensor::DType;
    ///
    /// let bf16 = |numel| DeviceParamSpec { numel, grad_dtype: DType::BF16, param_dtype: DType::BF16 };
    /// // Gradients of 1000, 3000 and 500 bf16 elements; backward finishes parameter 2 first.
    /// let plan = StagingPlan::by_size(vec![bf16(1000), bf16(3000), bf16(500)], &[2, 1, 0], 4096)?;
    /// let members: Vec<Vec<usize>> =
    ///     plan.buckets().iter().map(|b| b.params.iter().map(|s| s.param).collect()).collect();
    /// assert_eq!(members, [vec![2], vec![1], vec![0]]); // 1000 + 6000 bytes would pass 4096
    /// assert_eq!(plan.buckets()[1].grad_bytes % STAGING_ALIGN, 0);
    /// # Ok::<(), headroom_offload::OffloadError>(())
    /// ```
    pub fn by_size(
        specs: Vec<DeviceParamSpec>,
        backward_order: &[usize],
        max_bucket_bytes: usize,
    ) -> Result<Self> {
        let bytes = |p: usize| {
            specs
                .get(p)
                .map(|s| s.numel.saturating_mul(s.grad_dtype.size_in_bytes()))
        };
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut current: Vec<usize> = Vec::new();
        let mut current_bytes = 0usize;
        for &p in backward_order {
            let b = bytes(p).ok_or(OffloadError::UnknownParam {
                index: p,
                count: specs.len(),
            })?;
            if !current.is_empty() && current_bytes.saturating_add(b) > max_bucket_bytes {
                buckets.push(std::mem::take(&mut current));
                current_bytes = 0;
            }
            current.push(p);
            current_bytes = current_bytes.saturating_add(b);
        }
        if !current.is_empty() {
            buckets.push(current);
        }
        Self::new(specs, buckets)
    }

    /// Number of buckets.
    pub fn num_buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.specs.len()
    }

    /// Every parameter's spec, by index.
    pub fn specs(&self) -> &[DeviceParamSpec] {
        &self.specs
    }

    /// Every bucket's layout, in hand-over order.
    pub fn buckets(&self) -> &[BucketLayout] {
        &self.buckets
    }

    /// The layout of `bucket`.
    pub fn bucket(&self, bucket: usize) -> Result<&BucketLayout> {
        self.buckets.get(bucket).ok_or(OffloadError::UnknownBucket {
            bucket,
            count: self.buckets.len(),
        })
    }

    /// Pinned host bytes of all gradient staging buffers together.
    pub fn total_grad_staging_bytes(&self) -> usize {
        self.buckets.iter().map(|b| b.grad_bytes).sum()
    }

    /// Pinned host bytes of all upload staging buffers together.
    pub fn total_upload_staging_bytes(&self) -> usize {
        self.buckets.iter().map(|b| b.upload_bytes).sum()
    }

    /// Check that `tensors[p]` exists with the planned element count and dtype for every
    /// parameter `p` of `bucket`; `role` chooses gradients or parameters. Works with any
    /// [`Tensor`] so the checks are the same on every backend.
    pub fn check_bucket_tensors<T: Tensor>(
        &self,
        bucket: usize,
        role: TensorRole,
        tensors: &[T],
    ) -> Result<()> {
        for staged in &self.bucket(bucket)?.params {
            let p = staged.param;
            let t = tensors.get(p).ok_or(OffloadError::MissingTensor {
                role: role.name(),
                param: p,
                given: tensors.len(),
            })?;
            let expected_dtype = match role {
                TensorRole::Gradient => staged.spec.grad_dtype,
                TensorRole::Parameter => staged.spec.param_dtype,
            };
            if t.numel() != staged.spec.numel {
                return Err(OffloadError::TensorMismatch {
                    role: role.name(),
                    param: p,
                    expected: format!("{} elements", staged.spec.numel),
                    got: format!("{} elements", t.numel()),
                });
            }
            if t.dtype() != expected_dtype {
                return Err(OffloadError::TensorMismatch {
                    role: role.name(),
                    param: p,
                    expected: format!("{expected_dtype:?}"),
                    got: format!("{:?}", t.dtype()),
                });
            }
        }
        Ok(())
    }

    /// Check that the optimizer and the masters describe the same parameters as this plan.
    // Used by the CUDA pipeline; compiled and tested without it too.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn check_optimizer(&self, optimizer: &CpuAdamW, masters: &[Vec<f32>]) -> Result<()> {
        let state = optimizer.state();
        if state.params.len() != self.specs.len() || masters.len() != self.specs.len() {
            return Err(OffloadError::Pipeline(format!(
                "the plan has {} parameters, the optimizer {} and the masters {}",
                self.specs.len(),
                state.params.len(),
                masters.len()
            )));
        }
        for (p, ((spec, opt), master)) in self
            .specs
            .iter()
            .zip(&state.params)
            .zip(masters)
            .enumerate()
        {
            if opt.numel != spec.numel || master.len() != spec.numel {
                return Err(OffloadError::Pipeline(format!(
                    "parameter {p}: the plan has {} elements, the optimizer {} and the master {}",
                    spec.numel,
                    opt.numel,
                    master.len()
                )));
            }
        }
        Ok(())
    }
}

/// Which of a parameter's device tensors a check is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// The gradient backward wrote (copied device→host).
    Gradient,
    /// The parameter the update is uploaded into (copied host→device).
    Parameter,
}

impl TensorRole {
    pub(crate) fn name(self) -> &'static str {
        match self {
            TensorRole::Gradient => "gradient",
            TensorRole::Parameter => "parameter",
        }
    }
}

/// Which buckets the current step has handed over and which have come back updated.
// Used by the CUDA pipeline; compiled and tested without it too.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct StepProgress {
    handed: Vec<bool>,
    returned: Vec<bool>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl StepProgress {
    pub(crate) fn new(buckets: usize) -> Self {
        StepProgress {
            handed: vec![false; buckets],
            returned: vec![false; buckets],
        }
    }

    /// May `bucket` be handed over now? (It exists and was not handed this step.)
    pub(crate) fn check_hand(&self, bucket: usize) -> Result<()> {
        match self.handed.get(bucket) {
            None => Err(OffloadError::UnknownBucket {
                bucket,
                count: self.handed.len(),
            }),
            Some(true) => Err(OffloadError::BucketHandedTwice { bucket }),
            Some(false) => Ok(()),
        }
    }

    pub(crate) fn mark_handed(&mut self, bucket: usize) {
        if let Some(h) = self.handed.get_mut(bucket) {
            *h = true;
        }
    }

    pub(crate) fn mark_returned(&mut self, bucket: usize) {
        if let Some(r) = self.returned.get_mut(bucket) {
            *r = true;
        }
    }

    /// Buckets not handed over yet this step.
    pub(crate) fn not_handed(&self) -> Vec<usize> {
        (0..self.handed.len())
            .filter(|&b| !self.handed[b])
            .collect()
    }

    /// Buckets handed over whose update has not come back yet.
    pub(crate) fn in_flight(&self) -> usize {
        self.handed
            .iter()
            .zip(&self.returned)
            .filter(|(h, r)| **h && !**r)
            .count()
    }

    /// True when some bucket was handed over this step.
    pub(crate) fn started(&self) -> bool {
        self.handed.iter().any(|&h| h)
    }

    pub(crate) fn reset(&mut self) {
        self.handed.iter_mut().for_each(|h| *h = false);
        self.returned.iter_mut().for_each(|r| *r = false);
    }
}

/// A typed view of `numel` elements of `dtype` at `offset` in `bytes`.
fn float_view(bytes: &[u8], offset: usize, numel: usize, dtype: DType) -> Result<FloatSlice<'_>> {
    let len = numel.saturating_mul(dtype.size_in_bytes());
    let region = offset
        .checked_add(len)
        .and_then(|end| bytes.get(offset..end))
        .ok_or(OffloadError::LengthMismatch {
            what: "gradient staging buffer",
            expected: offset.saturating_add(len),
            got: bytes.len(),
        })?;
    let misaligned = |_| OffloadError::Pipeline("misaligned staging buffer".into());
    Ok(match dtype {
        DType::F32 => FloatSlice::F32(bytemuck::try_cast_slice(region).map_err(misaligned)?),
        DType::F16 => {
            FloatSlice::F16(bytemuck::try_cast_slice::<u8, f16>(region).map_err(misaligned)?)
        }
        DType::BF16 => {
            FloatSlice::BF16(bytemuck::try_cast_slice::<u8, bf16>(region).map_err(misaligned)?)
        }
        other => {
            return Err(OffloadError::Pipeline(format!(
                "{other:?} is not a float dtype"
            )))
        }
    })
}

/// A typed mutable view of `numel` elements of `dtype` at `offset` in `bytes`.
fn float_view_mut(
    bytes: &mut [u8],
    offset: usize,
    numel: usize,
    dtype: DType,
) -> Result<FloatSliceMut<'_>> {
    let len = numel.saturating_mul(dtype.size_in_bytes());
    let available = bytes.len();
    let region = offset
        .checked_add(len)
        .and_then(|end| bytes.get_mut(offset..end))
        .ok_or(OffloadError::LengthMismatch {
            what: "upload staging buffer",
            expected: offset.saturating_add(len),
            got: available,
        })?;
    let misaligned = |_| OffloadError::Pipeline("misaligned staging buffer".into());
    Ok(match dtype {
        DType::F32 => FloatSliceMut::F32(bytemuck::try_cast_slice_mut(region).map_err(misaligned)?),
        DType::F16 => {
            FloatSliceMut::F16(bytemuck::try_cast_slice_mut::<u8, f16>(region).map_err(misaligned)?)
        }
        DType::BF16 => FloatSliceMut::BF16(
            bytemuck::try_cast_slice_mut::<u8, bf16>(region).map_err(misaligned)?,
        ),
        other => {
            return Err(OffloadError::Pipeline(format!(
                "{other:?} is not a float dtype"
            )))
        }
    })
}

/// Run AdamW on every parameter of one staged bucket: gradients are read from `grads` (the
/// bucket's gradient staging buffer), f32 masters are updated in place, and the updated values
/// are written to `upload` (the upload staging buffer) in each parameter's device dtype, in
/// the same pass. Bit-identical to calling [`CpuAdamW::step`] on the same gradients.
pub fn update_staged_bucket(
    optimizer: &mut CpuAdamW,
    masters: &mut [Vec<f32>],
    layout: &BucketLayout,
    grads: &[u8],
    upload: &mut [u8],
) -> Result<()> {
    // Check every view first: a bad buffer fails before any parameter of the bucket moves.
    for staged in &layout.params {
        let s = staged.spec;
        float_view(grads, staged.grad_offset, s.numel, s.grad_dtype)?;
        float_view_mut(upload, staged.upload_offset, s.numel, s.param_dtype)?;
        if staged.param >= masters.len() {
            return Err(OffloadError::UnknownParam {
                index: staged.param,
                count: masters.len(),
            });
        }
    }
    for staged in &layout.params {
        let s = staged.spec;
        let g = float_view(grads, staged.grad_offset, s.numel, s.grad_dtype)?;
        let c = float_view_mut(upload, staged.upload_offset, s.numel, s.param_dtype)?;
        let count = masters.len();
        let master = masters
            .get_mut(staged.param)
            .ok_or(OffloadError::UnknownParam {
                index: staged.param,
                count,
            })?;
        optimizer.step(staged.param, master, g, Some(c))?;
    }
    Ok(())
}

/// A bucket's pair of staging buffers as the update worker sees them, whatever memory they
/// live in (pinned host memory on CUDA, ordinary memory in tests).
// Used by the CUDA pipeline; compiled and tested without it too.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) trait StagedBuffers: Send + 'static {
    /// Block until the gradient bytes have fully arrived and the previous upload out of the
    /// upload buffer has finished reading it.
    fn wait_until_writable(&self) -> Result<()>;
    /// The gradient bytes and the upload bytes.
    fn split(&mut self) -> (&[u8], &mut [u8]);
}

/// A message to the worker, handled in the order sent.
// Used by the CUDA pipeline; compiled and tested without it too.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum Job<S> {
    /// Update one staged bucket.
    Update { bucket: usize, buffers: S },
    /// Change a group's learning rate (schedules); the result comes back on `reply`.
    SetLr {
        group: usize,
        lr: f64,
        reply: Sender<Result<()>>,
    },
}

/// One bucket coming back: its buffers always return, with or without an error.
// Used by the CUDA pipeline; compiled and tested without it too.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Finished<S> {
    pub(crate) bucket: usize,
    pub(crate) buffers: S,
    pub(crate) result: Result<()>,
}

/// A thread that owns the optimizer and the f32 masters and updates staged buckets in the
/// order they arrive, while the caller keeps issuing backward work.
// Used by the CUDA pipeline; compiled and tested without it too.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct UpdateWorker<S: StagedBuffers> {
    jobs: Option<Sender<Job<S>>>,
    done: Receiver<Finished<S>>,
    handle: Option<JoinHandle<(CpuAdamW, Vec<Vec<f32>>)>>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl<S: StagedBuffers> UpdateWorker<S> {
    /// Start the worker. `layouts` is the plan's buckets (checked against the optimizer by the
    /// caller).
    pub(crate) fn spawn(
        mut optimizer: CpuAdamW,
        mut masters: Vec<Vec<f32>>,
        layouts: Vec<BucketLayout>,
    ) -> Result<Self> {
        // Unbounded: there are never more jobs in flight than buckets (each bucket's buffers
        // exist once), so the channels cannot grow without bound, and the caller never blocks
        // handing a bucket over.
        let (job_tx, job_rx) = unbounded::<Job<S>>();
        let (done_tx, done_rx) = unbounded::<Finished<S>>();
        let handle = std::thread::Builder::new()
            .name("headroom-offload-update".into())
            .spawn(move || {
                for job in job_rx {
                    let (bucket, mut buffers) = match job {
                        Job::Update { bucket, buffers } => (bucket, buffers),
                        Job::SetLr { group, lr, reply } => {
                            // The caller may have stopped waiting; nothing to do then.
                            let _ = reply.send(optimizer.set_lr(group, lr));
                            continue;
                        }
                    };
                    let result = match layouts.get(bucket) {
                        None => Err(OffloadError::UnknownBucket {
                            bucket,
                            count: layouts.len(),
                        }),
                        Some(layout) => buffers.wait_until_writable().and_then(|()| {
                            let (grads, upload) = buffers.split();
                            update_staged_bucket(
                                &mut optimizer,
                                &mut masters,
                                layout,
                                grads,
                                upload,
                            )
                        }),
                    };
                    let finished = Finished {
                        bucket,
                        buffers,
                        result,
                    };
                    if done_tx.send(finished).is_err() {
                        break;
                    }
                }
                (optimizer, masters)
            })
            .map_err(|e| OffloadError::Pipeline(format!("cannot start the update worker: {e}")))?;
        Ok(UpdateWorker {
            jobs: Some(job_tx),
            done: done_rx,
            handle: Some(handle),
        })
    }

    /// Queue a bucket. On failure (the worker is gone) the buffers come back in the error.
    pub(crate) fn submit(&self, bucket: usize, buffers: S) -> std::result::Result<(), S> {
        match &self.jobs {
            None => Err(buffers),
            Some(jobs) => match jobs.send(Job::Update { bucket, buffers }) {
                Ok(()) => Ok(()),
                Err(e) => match e.into_inner() {
                    Job::Update { buffers, .. } => Err(buffers),
                    // Not reachable: the message sent was an update.
                    Job::SetLr { .. } => Ok(()),
                },
            },
        }
    }

    /// Change the learning rate of parameter group `group`, after every bucket already queued
    /// (blocks until the worker has applied it).
    pub(crate) fn set_lr(&self, group: usize, lr: f64) -> Result<()> {
        let jobs = self.jobs.as_ref().ok_or(OffloadError::PipelineClosed)?;
        let (reply, answer) = crossbeam_channel::bounded(1);
        jobs.send(Job::SetLr { group, lr, reply })
            .map_err(|_| OffloadError::PipelineClosed)?;
        answer.recv().map_err(|_| OffloadError::PipelineClosed)?
    }

    /// A finished bucket if one is ready, without blocking.
    pub(crate) fn try_finished(&self) -> Option<Finished<S>> {
        self.done.try_recv().ok()
    }

    /// The next finished bucket, blocking.
    pub(crate) fn wait_finished(&self) -> Result<Finished<S>> {
        self.done.recv().map_err(|_| OffloadError::PipelineClosed)
    }

    /// Stop the worker after the queued buckets and take back the optimizer and masters.
    /// Buckets that finish meanwhile stay in the channel (their buffers drop with it).
    pub(crate) fn shutdown(&mut self) -> Result<(CpuAdamW, Vec<Vec<f32>>)> {
        self.jobs = None; // closing the channel ends the worker's loop once it is drained
        let handle = self.handle.take().ok_or(OffloadError::PipelineClosed)?;
        handle.join().map_err(|_| OffloadError::PipelineClosed)
    }
}

impl<S: StagedBuffers> Drop for UpdateWorker<S> {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AdamWHyper, ParamSpec, StatePrecision, StoreSpec};
    use headroom_tensor::{Backend, Cpu};
    use proptest::prelude::*;

    fn spec(numel: usize, grad_dtype: DType, param_dtype: DType) -> DeviceParamSpec {
        DeviceParamSpec {
            numel,
            grad_dtype,
            param_dtype,
        }
    }

    fn float_dtype() -> impl Strategy<Value = DType> {
        prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)]
    }

    fn specs_strategy() -> impl Strategy<Value = Vec<DeviceParamSpec>> {
        prop::collection::vec(
            // One size in ten is 0, 1 or 2 elements (empty tensors and tiny tails).
            (0usize..3000, float_dtype(), float_dtype())
                .prop_map(|(n, g, p)| spec(if n < 300 { n % 3 } else { n }, g, p)),
            1..12,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Every parameter lands in exactly one bucket, in backward order, with aligned,
        /// disjoint regions inside its bucket's buffers; buckets respect the size bound unless
        /// a single parameter exceeds it.
        #[test]
        fn by_size_partitions_in_order_with_disjoint_aligned_regions(
            specs in specs_strategy(),
            max_bytes in 1usize..20_000,
            seed in any::<u64>(),
        ) {
            // A shuffled backward order.
            let mut order: Vec<usize> = (0..specs.len()).collect();
            let mut x = seed | 1;
            for i in (1..order.len()).rev() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let plan = StagingPlan::by_size(specs.clone(), &order, max_bytes).unwrap();
            let flat: Vec<usize> = plan.buckets().iter()
                .flat_map(|b| b.params.iter().map(|s| s.param)).collect();
            prop_assert_eq!(&flat, &order);
            for b in plan.buckets() {
                let raw: usize = b.params.iter().map(|s| s.grad_bytes()).sum();
                prop_assert!(raw <= max_bytes || b.params.len() == 1);
                let mut grad_end = 0;
                let mut upload_end = 0;
                for s in &b.params {
                    prop_assert_eq!(s.spec, specs[s.param]);
                    prop_assert_eq!(s.grad_offset % STAGING_ALIGN, 0);
                    prop_assert_eq!(s.upload_offset % STAGING_ALIGN, 0);
                    prop_assert!(s.grad_offset >= grad_end);
                    prop_assert!(s.upload_offset >= upload_end);
                    grad_end = s.grad_offset + s.grad_bytes();
                    upload_end = s.upload_offset + s.upload_bytes();
                }
                prop_assert!(grad_end <= b.grad_bytes && b.grad_bytes - grad_end < STAGING_ALIGN);
                prop_assert!(upload_end <= b.upload_bytes && b.upload_bytes - upload_end < STAGING_ALIGN);
            }
            prop_assert_eq!(
                plan.total_grad_staging_bytes(),
                plan.buckets().iter().map(|b| b.grad_bytes).sum::<usize>()
            );
        }
    }

    #[test]
    fn plan_rejects_bad_bucketings_with_typed_errors() {
        let specs = vec![spec(4, DType::F32, DType::F32); 3];
        let err = |buckets: Vec<Vec<usize>>| StagingPlan::new(specs.clone(), buckets).unwrap_err();
        assert!(
            matches!(err(vec![vec![0, 1], vec![1, 2]]), OffloadError::Pipeline(m) if m.contains("two buckets"))
        );
        assert!(
            matches!(err(vec![vec![0, 1]]), OffloadError::Pipeline(m) if m.contains("no bucket"))
        );
        assert!(matches!(
            err(vec![vec![0, 1, 2, 7]]),
            OffloadError::UnknownParam { index: 7, count: 3 }
        ));
        assert!(
            matches!(err(vec![vec![0, 1, 2], vec![]]), OffloadError::Pipeline(m) if m.contains("empty"))
        );
        let ints = vec![spec(4, DType::I32, DType::F32)];
        assert!(StagingPlan::new(ints, vec![vec![0]]).is_err());
        assert!(matches!(
            StagingPlan::by_size(specs.clone(), &[0, 5], 100),
            Err(OffloadError::UnknownParam { index: 5, .. })
        ));
        let plan = StagingPlan::new(specs, vec![vec![2], vec![1, 0]]).unwrap();
        assert!(matches!(
            plan.bucket(2),
            Err(OffloadError::UnknownBucket {
                bucket: 2,
                count: 2
            })
        ));
    }

    #[test]
    fn step_progress_rejects_twice_and_unknown_and_lists_missing() {
        let mut p = StepProgress::new(3);
        assert!(!p.started());
        p.check_hand(1).unwrap();
        p.mark_handed(1);
        assert!(p.started());
        assert!(matches!(
            p.check_hand(1),
            Err(OffloadError::BucketHandedTwice { bucket: 1 })
        ));
        assert!(matches!(
            p.check_hand(3),
            Err(OffloadError::UnknownBucket {
                bucket: 3,
                count: 3
            })
        ));
        assert_eq!(p.not_handed(), vec![0, 2]);
        assert_eq!(p.in_flight(), 1);
        p.mark_returned(1);
        assert_eq!(p.in_flight(), 0);
        p.reset();
        assert_eq!(p.not_handed(), vec![0, 1, 2]);
        p.check_hand(1).unwrap();
    }

    #[test]
    fn tensor_checks_name_the_parameter_and_what_is_wrong() {
        let cpu = Cpu::new();
        let specs = vec![
            spec(6, DType::BF16, DType::F32),
            spec(2, DType::F32, DType::F16),
        ];
        let plan = StagingPlan::new(specs, vec![vec![1], vec![0]]).unwrap();
        let good_grads = vec![
            cpu.zeros([6], DType::BF16).unwrap(),
            cpu.zeros([2], DType::F32).unwrap(),
        ];
        plan.check_bucket_tensors(0, TensorRole::Gradient, &good_grads)
            .unwrap();
        plan.check_bucket_tensors(1, TensorRole::Gradient, &good_grads)
            .unwrap();
        // Wrong size.
        let wrong_size = vec![
            cpu.zeros([5], DType::BF16).unwrap(),
            cpu.zeros([2], DType::F32).unwrap(),
        ];
        match plan.check_bucket_tensors(1, TensorRole::Gradient, &wrong_size) {
            Err(OffloadError::TensorMismatch {
                role: "gradient",
                param: 0,
                expected,
                got,
            }) => {
                assert_eq!(
                    (expected.as_str(), got.as_str()),
                    ("6 elements", "5 elements")
                );
            }
            other => panic!("{other:?}"),
        }
        // Wrong dtype: the parameter is planned as f16.
        let params = vec![
            cpu.zeros([6], DType::F32).unwrap(),
            cpu.zeros([2], DType::F32).unwrap(),
        ];
        assert!(matches!(
            plan.check_bucket_tensors(0, TensorRole::Parameter, &params),
            Err(OffloadError::TensorMismatch {
                role: "parameter",
                param: 1,
                ..
            })
        ));
        // Missing tensor.
        assert!(matches!(
            plan.check_bucket_tensors(1, TensorRole::Gradient, &good_grads[..0]),
            Err(OffloadError::MissingTensor {
                role: "gradient",
                param: 0,
                given: 0
            })
        ));
    }

    /// Deterministic pseudo-random values in [-scale, scale).
    fn data(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// Ordinary host memory standing in for a bucket's pinned buffers; `u64` storage keeps
    /// every region aligned.
    struct HostStaging {
        grads: Vec<u64>,
        upload: Vec<u64>,
    }

    impl HostStaging {
        fn new(layout: &BucketLayout) -> Self {
            HostStaging {
                grads: vec![0; layout.grad_bytes.div_ceil(8)],
                upload: vec![0; layout.upload_bytes.div_ceil(8)],
            }
        }
        /// Encode f32 gradients into the staging bytes in each parameter's gradient dtype.
        fn write_grads(&mut self, layout: &BucketLayout, grads: &[Vec<f32>]) {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.grads);
            for s in &layout.params {
                let g = &grads[s.param];
                match float_view_mut(bytes, s.grad_offset, s.spec.numel, s.spec.grad_dtype).unwrap()
                {
                    FloatSliceMut::F32(d) => d.copy_from_slice(g),
                    FloatSliceMut::F16(d) => d
                        .iter_mut()
                        .zip(g)
                        .for_each(|(d, &x)| *d = f16::from_f32(x)),
                    FloatSliceMut::BF16(d) => d
                        .iter_mut()
                        .zip(g)
                        .for_each(|(d, &x)| *d = bf16::from_f32(x)),
                }
            }
        }
    }

    impl StagedBuffers for HostStaging {
        fn wait_until_writable(&self) -> Result<()> {
            Ok(())
        }
        fn split(&mut self) -> (&[u8], &mut [u8]) {
            (
                bytemuck::cast_slice(&self.grads),
                bytemuck::cast_slice_mut(&mut self.upload),
            )
        }
    }

    fn optimizer(specs: &[DeviceParamSpec], cpu: &Cpu) -> CpuAdamW {
        let params: Vec<ParamSpec> = specs
            .iter()
            .map(|s| ParamSpec {
                numel: s.numel,
                group: 0,
            })
            .collect();
        let hyper = AdamWHyper {
            lr: 3e-3,
            weight_decay: 0.05,
            ..AdamWHyper::default()
        };
        CpuAdamW::new(
            vec![hyper],
            &params,
            StatePrecision::F32,
            StoreSpec::Ram(cpu),
        )
        .unwrap()
    }

    /// The serial reference: `CpuAdamW::step` on each parameter with the gradient decoded from
    /// its device dtype, writing the working copy in the parameter's dtype.
    fn serial_step(
        opt: &mut CpuAdamW,
        specs: &[DeviceParamSpec],
        masters: &mut [Vec<f32>],
        grads: &[Vec<f32>],
    ) -> Vec<Vec<u8>> {
        let mut copies = Vec::new();
        for (p, s) in specs.iter().enumerate() {
            let g16: Vec<f16> = grads[p].iter().map(|&x| f16::from_f32(x)).collect();
            let gb: Vec<bf16> = grads[p].iter().map(|&x| bf16::from_f32(x)).collect();
            let g = match s.grad_dtype {
                DType::F32 => FloatSlice::F32(&grads[p]),
                DType::F16 => FloatSlice::F16(&g16),
                _ => FloatSlice::BF16(&gb),
            };
            let mut copy = vec![0u64; (s.numel * s.param_dtype.size_in_bytes()).div_ceil(8)];
            let c = float_view_mut(
                bytemuck::cast_slice_mut(&mut copy),
                0,
                s.numel,
                s.param_dtype,
            )
            .unwrap();
            opt.step(p, &mut masters[p], g, Some(c)).unwrap();
            let bytes: &[u8] = bytemuck::cast_slice(&copy);
            copies.push(bytes[..s.numel * s.param_dtype.size_in_bytes()].to_vec());
        }
        copies
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// The worker, fed staged buckets in backward order over several steps, gives the same
        /// masters and the same uploaded bytes as serial `CpuAdamW::step` calls, bit for bit.
        #[test]
        fn worker_on_staged_buckets_equals_serial_adamw(
            specs in specs_strategy(),
            max_bytes in 1usize..8000,
            steps in 1usize..4,
            seed in any::<u64>(),
        ) {
            let cpu = Cpu::new();
            let order: Vec<usize> = (0..specs.len()).rev().collect();
            let plan = StagingPlan::by_size(specs.clone(), &order, max_bytes).unwrap();
            let masters0: Vec<Vec<f32>> = specs.iter().enumerate()
                .map(|(p, s)| data(seed ^ p as u64, s.numel, 1.0)).collect();

            let mut ref_opt = optimizer(&specs, &cpu);
            let mut ref_masters = masters0.clone();

            let opt = optimizer(&specs, &cpu);
            plan.check_optimizer(&opt, &masters0).unwrap();
            let mut worker = UpdateWorker::<HostStaging>::spawn(opt, masters0, plan.buckets().to_vec()).unwrap();
            let mut staging: Vec<Option<HostStaging>> = plan.buckets().iter().map(|b| Some(HostStaging::new(b))).collect();

            for step in 0..steps {
                if step == 1 {
                    // A schedule changes the learning rate between steps.
                    ref_opt.set_lr(0, 7e-3).unwrap();
                    worker.set_lr(0, 7e-3).unwrap();
                }
                let grads: Vec<Vec<f32>> = specs.iter().enumerate()
                    .map(|(p, s)| data(seed.wrapping_add(1000 * step as u64 + p as u64 + 7), s.numel, 0.1)).collect();
                let expected = serial_step(&mut ref_opt, &specs, &mut ref_masters, &grads);
                for (b, layout) in plan.buckets().iter().enumerate() {
                    let mut st = staging[b].take().unwrap();
                    st.write_grads(layout, &grads);
                    prop_assert!(worker.submit(b, st).is_ok());
                }
                for _ in 0..plan.num_buckets() {
                    let f = worker.wait_finished().unwrap();
                    f.result.unwrap();
                    let layout = plan.bucket(f.bucket).unwrap();
                    let upload: &[u8] = bytemuck::cast_slice(&f.buffers.upload);
                    for s in &layout.params {
                        prop_assert_eq!(&upload[s.upload_offset..s.upload_offset + s.upload_bytes()], &expected[s.param][..]);
                    }
                    staging[f.bucket] = Some(f.buffers);
                }
            }
            let (opt, masters) = worker.shutdown().unwrap();
            for (a, b) in masters.iter().zip(&ref_masters) {
                prop_assert_eq!(bytemuck::cast_slice::<f32, u32>(a), bytemuck::cast_slice::<f32, u32>(b));
            }
            prop_assert_eq!(opt.moments(), ref_opt.moments());
            prop_assert_eq!(opt.state(), ref_opt.state());
        }
    }

    #[test]
    fn worker_rejects_bad_learning_rates_and_keeps_the_old_one() {
        let cpu = Cpu::new();
        let specs = vec![spec(8, DType::F32, DType::F32)];
        let plan = StagingPlan::new(specs.clone(), vec![vec![0]]).unwrap();
        let masters = vec![vec![0.5f32; 8]];
        let worker = UpdateWorker::<HostStaging>::spawn(
            optimizer(&specs, &cpu),
            masters,
            plan.buckets().to_vec(),
        )
        .unwrap();
        assert!(matches!(
            worker.set_lr(0, f64::NAN),
            Err(OffloadError::InvalidHyper { name: "lr", .. })
        ));
        assert!(matches!(
            worker.set_lr(3, 1e-3),
            Err(OffloadError::UnknownGroup { index: 3, count: 1 })
        ));
        let mut worker = worker;
        let (opt, _) = worker.shutdown().unwrap();
        assert_eq!(opt.hyper(0).unwrap().lr, 3e-3);
        assert!(matches!(
            worker.set_lr(0, 1e-3),
            Err(OffloadError::PipelineClosed)
        ));
    }

    #[test]
    fn update_reports_short_or_misaligned_staging_instead_of_panicking() {
        let cpu = Cpu::new();
        let specs = vec![spec(8, DType::F32, DType::BF16)];
        let plan = StagingPlan::new(specs.clone(), vec![vec![0]]).unwrap();
        let mut opt = optimizer(&specs, &cpu);
        let mut masters = vec![vec![0.5f32; 8]];
        let mut upload = vec![0u64; 64];
        let short = [0u8; 16];
        let up: &mut [u8] = bytemuck::cast_slice_mut(&mut upload);
        assert!(matches!(
            update_staged_bucket(&mut opt, &mut masters, &plan.buckets()[0], &short, up),
            Err(OffloadError::LengthMismatch { .. })
        ));
        let storage = vec![0u64; 64];
        let bytes: &[u8] = bytemuck::cast_slice(&storage);
        assert!(matches!(
            update_staged_bucket(&mut opt, &mut masters, &plan.buckets()[0], &bytes[1..], up),
            Err(OffloadError::Pipeline(m)) if m.contains("misaligned")
        ));
        // Nothing was updated by the failed calls.
        assert_eq!(masters[0], vec![0.5f32; 8]);
        assert_eq!(opt.state().steps, vec![0]);
    }
}
