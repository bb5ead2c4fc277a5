//! ZeRO-Offload's step on a CUDA device: gradients leave the device bucket by bucket while
//! backward is still running, the CPU runs AdamW on each bucket as soon as it has arrived, and
//! the updated parameters go back to the device before the next forward.
//!
//! # Streams and events (one step)
//!
//! ```text
//! compute (the backend's stream):  backward(bucket 0) ─ready[0]─ backward(bucket 1) ─ready[1]─ … ─wait(step_uploaded)─ next forward
//! d2h stream:                      wait(ready[0]) copy grads→pinned ─copied[0]─ wait(ready[1]) copy ─copied[1]─ …
//! CPU worker thread:                         sync(copied[0]) AdamW(bucket 0) ─┐      sync(copied[1]) AdamW(bucket 1) ─┐
//! h2d stream (issued by the caller's thread): wait(ready[0]) copy pinned→params ─uploaded[0]─ … ─step_uploaded─
//! ```
//!
//! - `ready[b]` is recorded on the compute stream when bucket `b` is handed over: everything
//!   backward queued so far — the kernels that wrote `b`'s gradients and the last kernels that
//!   read `b`'s parameters — comes before it.
//! - The d2h stream waits on `ready[b]` before copying `b`'s gradients (read after write) and
//!   records `copied[b]`; the worker thread blocks on `copied[b]` (a blocking-sync event, so it
//!   sleeps instead of spinning) before reading the staging buffer.
//! - Uploads are issued on the h2d stream by the caller's thread, for buckets the worker has
//!   finished, at every later `hand_bucket` and in `finish`. The h2d stream waits on `ready[b]`
//!   first, so an upload never overtakes backward's last read of those parameters (write after
//!   read; by then it has completed anyway, since `copied[b]` did).
//! - `finish` waits for the worker, issues the remaining uploads, records `step_uploaded` on the
//!   h2d stream and makes the compute stream wait on it: the next forward reads updated
//!   parameters, and the next backward cannot overwrite a gradient a copy still reads (every
//!   copy completed before its bucket's update even started).
//! - Before the worker writes a bucket's upload buffer it also waits on `uploaded[b]` of the
//!   previous step, so the CPU never overwrites bytes a copy engine is still reading.
//! - The two copy streams are non-blocking streams: they do not synchronise implicitly with the
//!   legacy default stream the backend computes on, which is what lets copies overlap
//!   backward. Separate d2h and h2d streams let both directions use their own copy engine
//!   instead of queueing uploads behind gradient copies that wait for later buckets.
//!
//! # Memory
//! Staging buffers (one gradient buffer and one upload buffer per bucket) are pinned host
//! memory allocated once, reported to the backend's allocation hook as host memory
//! ([`MemoryCategory::Gradients`] and [`MemoryCategory::Parameters`]) and reused every step.
//! Nothing is allocated on the device, ever; per step only events are re-recorded.

use std::ptr::NonNull;
use std::sync::Arc;

use headroom_cuda::cudarc::driver::{
    result as driver, sys, CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DriverError,
};
use headroom_cuda::{Cuda, CudaError, CudaTensor};
use headroom_tensor::{Backend, DType, Device, MemoryCategory, Tensor, TrackedAllocation};

use crate::staging::{
    Finished, StagedBuffers, StagingPlan, StepProgress, TensorRole, UpdateWorker,
};
use crate::{CpuAdamW, OffloadError, Result};

/// A failed driver call in `op` as this crate's error.
fn driver_error(op: &'static str) -> impl Fn(DriverError) -> OffloadError {
    move |e| {
        OffloadError::Cuda(CudaError::Driver {
            op,
            source: e.into(),
        })
    }
}

/// Page-locked host memory from `cuMemHostAlloc` with flags 0 (ordinary, cached, not
/// write-combined), zero-filled once, reported to the allocation hook as host memory.
///
/// Crate-private on purpose: freeing it while a copy into or out of it is still queued would
/// corrupt memory, and only the pipeline knows when its copies are done.
struct PinnedBuffer {
    /// Dangling (never dereferenced for more than 0 bytes) when `bytes == 0`.
    ptr: NonNull<u8>,
    bytes: usize,
    context: Arc<CudaContext>,
    // Dropped after `Drop::drop` freed the memory: the hook hears of the free afterwards.
    _ledger: TrackedAllocation,
}

// SAFETY: the buffer exclusively owns its allocation (like a `Box<[u8]>`); page-locked host
// memory may be used from any thread, and the context handle is itself Send + Sync.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only hands out `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    fn new(cuda: &Cuda, bytes: usize, category: MemoryCategory) -> Result<Self> {
        // Report first: a refused allocation never pins memory.
        let ledger = TrackedAllocation::register_as(
            cuda.alloc_hook(),
            bytes,
            DType::U8,
            Device::Cpu,
            category,
        )?;
        let context = cuda.context().clone();
        if bytes == 0 {
            return Ok(PinnedBuffer {
                ptr: NonNull::dangling(),
                bytes,
                context,
                _ledger: ledger,
            });
        }
        context
            .bind_to_thread()
            .map_err(driver_error("bind_to_thread"))?;
        // Flags 0, NOT `CU_MEMHOSTALLOC_WRITECOMBINED` (which cudarc's `alloc_pinned` uses):
        // write-combined pages are mapped uncached, so CPU *reads* bypass the caches and crawl
        // (NVIDIA: reading them from the host is "prohibitively slow"); they only pay off for
        // buffers the CPU writes once and never reads. The AdamW worker reads every gradient
        // byte of these buffers. The upload buffers are only written by the CPU and could be
        // write-combined (some systems upload faster from them); they stay ordinary until a
        // measurement on a GPU machine shows the gain, so that any CPU read of them (tests,
        // debugging) stays fast.
        // SAFETY: `cuMemHostAlloc` with a non-zero size in a context bound to this thread.
        let raw =
            unsafe { driver::malloc_host(bytes, 0) }.map_err(driver_error("cuMemHostAlloc"))?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| {
            OffloadError::Cuda(CudaError::Driver {
                op: "cuMemHostAlloc",
                source: DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY).into(),
            })
        })?;
        // SAFETY: `ptr` points to `bytes` freshly allocated, writable bytes; zero them so the
        // slices handed out below never expose uninitialised memory.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        Ok(PinnedBuffer {
            ptr,
            bytes,
            context,
            _ledger: ledger,
        })
    }

    fn as_bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `bytes` initialised bytes (or dangling with length 0) for
        // as long as `self` lives; `&self` excludes a concurrent `&mut` borrow.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.bytes) }
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.bytes) }
    }

    /// The flags the driver reports for this allocation (`cuMemHostGetFlags`); `None` for an
    /// empty buffer, which has no allocation.
    fn host_alloc_flags(&self) -> Result<Option<u32>> {
        if self.bytes == 0 {
            return Ok(None);
        }
        self.context
            .bind_to_thread()
            .map_err(driver_error("bind_to_thread"))?;
        let mut flags: std::ffi::c_uint = 0;
        // SAFETY: `flags` is valid for writes and `ptr` came from `cuMemHostAlloc`.
        unsafe { sys::cuMemHostGetFlags(&mut flags, self.ptr.as_ptr().cast()) }
            .result()
            .map_err(driver_error("cuMemHostGetFlags"))?;
        Ok(Some(flags))
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        // Errors cannot be returned from drop; cudarc keeps them for `CudaContext::check_err`.
        self.context.record_err(self.context.bind_to_thread());
        // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once; the pipeline synchronises
        // both copy streams before its buffers drop, so no copy still uses it.
        self.context
            .record_err(unsafe { driver::free_host(self.ptr.as_ptr().cast()) });
    }
}

/// One bucket's staging buffers and the events that say when they may be touched.
struct CudaStaging {
    /// Device→host gradient copies land here; the worker reads them.
    grads: PinnedBuffer,
    /// The worker writes updated parameters here; host→device copies read them.
    upload: PinnedBuffer,
    /// Recorded on the d2h stream after this bucket's gradient copies.
    copied: CudaEvent,
    /// Recorded on the h2d stream after this bucket's uploads.
    uploaded: CudaEvent,
}

impl StagedBuffers for CudaStaging {
    fn wait_until_writable(&self) -> Result<()> {
        self.copied
            .synchronize()
            .map_err(driver_error("cuEventSynchronize (gradients copied)"))?;
        // An event never recorded (the first step) counts as complete.
        self.uploaded
            .synchronize()
            .map_err(driver_error("cuEventSynchronize (previous upload)"))
    }

    fn split(&mut self) -> (&[u8], &mut [u8]) {
        (self.grads.as_bytes(), self.upload.as_bytes_mut())
    }
}

/// The gradient offload pipeline on a CUDA device (see the module docs for the stream and
/// event ordering).
///
/// Per step: after backward has queued the kernels that finish a bucket's gradients (and the
/// last kernels that read its parameters), call [`hand_bucket`](Self::hand_bucket); when every
/// bucket is handed over, call [`finish`](Self::finish) before the next forward. Parameter and
/// gradient tensors are passed as lists indexed by parameter index; they must stay alive and
/// keep their shapes until `finish` returns. From a bucket's `hand_bucket` until `finish`, no
/// device work may write that bucket's gradients (the d2h copy is still reading them) or read
/// or write its parameters (the h2d copy writes them): only the pipeline's own events order
/// those copies, and cudarc's per-buffer tracking, when it is on, keeps only the latest read
/// of a buffer. Results are bit-identical to running [`CpuAdamW::step`] on the downloaded
/// gradients.
///
/// ```
/// use headroom_cuda::{Cuda, CudaError};
/// use headroom_offload::{
///     AdamWHyper, CpuAdamW, CudaOffloadPipeline, DeviceParamSpec, ParamSpec, StagingPlan,
///     StatePrecision, StoreSpec,
/// };
/// use headroom_tensor::{Backend, Cpu, DType};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let cuda = match Cuda::new(0) {
///     Ok(cuda) => cuda,
///     Err(CudaError::NoDevice { reason }) => {
///         println!("no GPU here: {reason}");
///         return Ok(());
///     }
///     Err(other) => return Err(other.into()),
/// };
/// // Two bf16 parameters of 1024 elements; backward finishes parameter 1 first. 2 KiB buckets
/// // put each in a bucket of its own: bucket 0 = parameter 1, bucket 1 = parameter 0.
/// let n = 1024;
/// let spec = DeviceParamSpec { numel: n, grad_dtype: DType::BF16, param_dtype: DType::BF16 };
/// let plan = StagingPlan::by_size(vec![spec; 2], &[1, 0], 2048)?;
/// assert_eq!(plan.num_buckets(), 2);
///
/// let cpu = Cpu::new();
/// let params_spec = [ParamSpec { numel: n, group: 0 }; 2];
/// let opt = CpuAdamW::new(vec![AdamWHyper::default()], &params_spec, StatePrecision::F32, StoreSpec::Ram(&cpu))?;
/// let masters = vec![vec![0.0f32; n]; 2]; // equal to the device parameters below
/// let mut params = vec![cuda.zeros([n], DType::BF16)?, cuda.zeros([n], DType::BF16)?];
/// let grads = vec![cuda.zeros([n], DType::BF16)?, cuda.zeros([n], DType::BF16)?];
///
/// let mut pipe = CudaOffloadPipeline::new(&cuda, opt, masters, plan)?;
/// for _step in 0..2 {
///     // forward, then backward: … kernels that finish grads[1] …
///     pipe.hand_bucket(0, &mut params, &grads)?;
///     // … kernels that finish grads[0] …
///     pipe.hand_bucket(1, &mut params, &grads)?;
///     pipe.finish(&mut params)?; // the next forward reads the updated parameters
/// }
/// let (_optimizer, _masters) = pipe.shutdown()?;
/// # Ok(())
/// # }
/// ```
pub struct CudaOffloadPipeline {
    // Drop order: the worker (joined) before the buffers it may hold come back and drop; the
    // `Drop` impl synchronises the copy streams before any field drops.
    worker: UpdateWorker<CudaStaging>,
    /// Each bucket's staging, `None` while the bucket is with the worker.
    staging: Vec<Option<CudaStaging>>,
    /// Recorded on the compute stream when a bucket is handed over.
    ready: Vec<CudaEvent>,
    /// Recorded on the h2d stream after the step's last upload; the compute stream waits on it.
    step_uploaded: CudaEvent,
    d2h: Arc<CudaStream>,
    h2d: Arc<CudaStream>,
    cuda: Cuda,
    plan: StagingPlan,
    progress: StepProgress,
    /// The first error of the step that happened after its bucket was accepted (an update or
    /// an upload), reported by `finish`.
    deferred: Option<OffloadError>,
}

impl std::fmt::Debug for CudaOffloadPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaOffloadPipeline")
            .field("device", &self.cuda.ordinal())
            .field("buckets", &self.plan.num_buckets())
            .field("params", &self.plan.num_params())
            .field("in_flight", &self.progress.in_flight())
            .finish()
    }
}

impl CudaOffloadPipeline {
    /// A pipeline on `cuda`'s device. `optimizer` and `masters` (the f32 master copy of every
    /// parameter, equal to the device parameters at the start) move to the worker thread;
    /// `plan` says which parameters form each bucket and their device dtypes. Allocates all
    /// pinned staging memory now.
    pub fn new(
        cuda: &Cuda,
        optimizer: CpuAdamW,
        masters: Vec<Vec<f32>>,
        plan: StagingPlan,
    ) -> Result<Self> {
        plan.check_optimizer(&optimizer, &masters)?;
        let context = cuda.context();
        let d2h = context
            .new_stream()
            .map_err(driver_error("cuStreamCreate (d2h)"))?;
        let h2d = context
            .new_stream()
            .map_err(driver_error("cuStreamCreate (h2d)"))?;
        // Blocking-sync events: the worker thread sleeps on them instead of spinning on a core
        // the AdamW update needs.
        let blocking = || {
            context
                .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
                .map_err(driver_error("cuEventCreate"))
        };
        let mut staging = Vec::with_capacity(plan.num_buckets());
        let mut ready = Vec::with_capacity(plan.num_buckets());
        for layout in plan.buckets() {
            staging.push(Some(CudaStaging {
                grads: PinnedBuffer::new(cuda, layout.grad_bytes, MemoryCategory::Gradients)?,
                upload: PinnedBuffer::new(cuda, layout.upload_bytes, MemoryCategory::Parameters)?,
                copied: blocking()?,
                uploaded: blocking()?,
            }));
            ready.push(
                context
                    .new_event(None)
                    .map_err(driver_error("cuEventCreate"))?,
            );
        }
        let step_uploaded = context
            .new_event(None)
            .map_err(driver_error("cuEventCreate"))?;
        let worker = UpdateWorker::spawn(optimizer, masters, plan.buckets().to_vec())?;
        Ok(CudaOffloadPipeline {
            worker,
            staging,
            ready,
            step_uploaded,
            d2h,
            h2d,
            cuda: cuda.clone(),
            progress: StepProgress::new(plan.num_buckets()),
            plan,
            deferred: None,
        })
    }

    /// The bucket plan.
    pub fn plan(&self) -> &StagingPlan {
        &self.plan
    }

    /// True between the first `hand_bucket` of a step and its `finish`.
    pub fn step_in_progress(&self) -> bool {
        self.progress.started()
    }

    /// Hand over bucket `bucket` (an index into the plan) once backward has queued everything
    /// that writes its gradients and reads its parameters. Queues the gradients' copy to pinned
    /// memory behind that work, passes the bucket to the CPU worker, and uploads any buckets
    /// the worker has finished meanwhile. Never blocks on the device.
    ///
    /// Errors (nothing is queued and the bucket may be handed over again): unknown bucket,
    /// bucket already handed over this step, a missing tensor or one whose element count,
    /// dtype or device differs from the plan.
    pub fn hand_bucket(
        &mut self,
        bucket: usize,
        params: &mut [CudaTensor],
        grads: &[CudaTensor],
    ) -> Result<()> {
        self.progress.check_hand(bucket)?;
        self.check_tensors(bucket, TensorRole::Gradient, grads)?;
        self.check_tensors(bucket, TensorRole::Parameter, params)?;
        let mut staging = self
            .staging
            .get_mut(bucket)
            .and_then(Option::take)
            .ok_or(OffloadError::PipelineClosed)?;
        if let Err(e) = self.copy_gradients(bucket, &mut staging, grads) {
            self.staging[bucket] = Some(staging);
            return Err(e);
        }
        if let Err(staging) = self.worker.submit(bucket, staging) {
            self.staging[bucket] = Some(staging);
            return Err(OffloadError::PipelineClosed);
        }
        self.progress.mark_handed(bucket);
        self.upload_finished(params, false)
    }

    /// Wait until every bucket of the step is updated, queue the remaining uploads, and make
    /// the compute stream wait for all uploads: work queued on the backend after `finish`
    /// (the next forward) sees the updated parameters. Blocks the calling thread until the CPU
    /// updates are done, not until the uploads are.
    ///
    /// If some buckets were not handed over, returns [`OffloadError::BucketsMissing`] and
    /// changes nothing. Otherwise the step ends even on error; the error is the first update
    /// or upload failure of the step (the f32 masters, from [`shutdown`](Self::shutdown), are
    /// then the truth).
    pub fn finish(&mut self, params: &mut [CudaTensor]) -> Result<()> {
        let missing = self.progress.not_handed();
        if !missing.is_empty() {
            return Err(OffloadError::BucketsMissing { missing });
        }
        let drained = self.upload_finished(params, true);
        let ordered = self
            .step_uploaded
            .record(&self.h2d)
            .and_then(|()| self.cuda.stream().wait(&self.step_uploaded))
            .map_err(driver_error("order the next forward after the uploads"));
        self.progress.reset();
        let deferred = self.deferred.take();
        drained?;
        ordered?;
        deferred.map_or(Ok(()), Err)
    }

    /// Change the learning rate of parameter group `group` (a schedule). Between steps only:
    /// every bucket of a step is updated with the same hyper-parameters.
    pub fn set_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        if self.progress.started() {
            return Err(OffloadError::Pipeline(
                "the learning rate can only change between steps".into(),
            ));
        }
        self.worker.set_lr(group, lr)
    }

    /// The `cuMemHostGetFlags` flags of every non-empty staging buffer (gradient and upload
    /// buffers of each bucket), to check that none is write-combined. Between steps only.
    pub fn pinned_host_alloc_flags(&self) -> Result<Vec<u32>> {
        if self.progress.started() {
            return Err(OffloadError::Pipeline(
                "staging buffers are in use until the step is finished".into(),
            ));
        }
        let mut flags = Vec::new();
        for staging in self.staging.iter().flatten() {
            for buffer in [&staging.grads, &staging.upload] {
                flags.extend(buffer.host_alloc_flags()?);
            }
        }
        Ok(flags)
    }

    /// Stop the worker and take back the optimizer and the f32 masters (to checkpoint them).
    /// Buckets already handed over are updated first but not uploaded.
    pub fn shutdown(mut self) -> Result<(CpuAdamW, Vec<Vec<f32>>)> {
        self.worker.shutdown()
    }

    /// The plan's checks plus: every tensor is on this pipeline's device.
    fn check_tensors(&self, bucket: usize, role: TensorRole, tensors: &[CudaTensor]) -> Result<()> {
        self.plan.check_bucket_tensors(bucket, role, tensors)?;
        let here = Device::Cuda(self.cuda.ordinal());
        for staged in &self.plan.bucket(bucket)?.params {
            if let Some(t) = tensors.get(staged.param) {
                if t.device() != here {
                    return Err(OffloadError::TensorMismatch {
                        role: role.name(),
                        param: staged.param,
                        expected: format!("{here:?}"),
                        got: format!("{:?}", t.device()),
                    });
                }
            }
        }
        Ok(())
    }

    /// Queue `bucket`'s gradient copies on the d2h stream behind the compute stream's work so
    /// far, and record `copied`.
    fn copy_gradients(
        &self,
        bucket: usize,
        staging: &mut CudaStaging,
        grads: &[CudaTensor],
    ) -> Result<()> {
        self.cuda
            .context()
            .bind_to_thread()
            .map_err(driver_error("bind_to_thread"))?;
        let ready = &self.ready[bucket];
        ready
            .record(self.cuda.stream())
            .map_err(driver_error("cuEventRecord (bucket ready)"))?;
        self.d2h
            .wait(ready)
            .map_err(driver_error("cuStreamWaitEvent (d2h after backward)"))?;
        let layout = self.plan.bucket(bucket)?;
        let staging_bytes = staging.grads.as_bytes_mut();
        for staged in &layout.params {
            let bytes = staged.grad_bytes();
            if bytes == 0 {
                continue; // empty tensors have no device allocation
            }
            let src = grads
                .get(staged.param)
                .and_then(CudaTensor::slice)
                .filter(|s| s.len() >= bytes)
                .ok_or_else(|| short_tensor(TensorRole::Gradient, staged.param, bytes))?;
            let dst = staging_bytes
                .get_mut(staged.grad_offset..staged.grad_offset + bytes)
                .ok_or_else(|| OffloadError::Pipeline("staging layout out of range".into()))?;
            // `_read` records the copy as a read of the gradient for cudarc's own cross-stream
            // tracking when it drops, after the copy is queued.
            let (src_ptr, _read) = src.device_ptr(&self.d2h);
            // SAFETY: `src_ptr` is a live device allocation of at least `bytes` bytes (checked
            // above; the caller keeps it alive until `finish`); `dst` is pinned memory owned by
            // this bucket's staging, which nothing touches until `copied` has completed (the
            // worker waits on it; `Drop` synchronises the stream before freeing it).
            unsafe { driver::memcpy_dtoh_async(dst, src_ptr, self.d2h.cu_stream()) }
                .map_err(driver_error("cuMemcpyDtoHAsync"))?;
        }
        staging
            .copied
            .record(&self.d2h)
            .map_err(driver_error("cuEventRecord (gradients copied)"))
    }

    /// Queue the upload of one updated bucket on the h2d stream and record `uploaded`.
    fn upload_bucket(
        &self,
        bucket: usize,
        staging: &CudaStaging,
        params: &mut [CudaTensor],
    ) -> Result<()> {
        self.check_tensors(bucket, TensorRole::Parameter, params)?;
        self.cuda
            .context()
            .bind_to_thread()
            .map_err(driver_error("bind_to_thread"))?;
        self.h2d
            .wait(&self.ready[bucket])
            .map_err(driver_error("cuStreamWaitEvent (h2d after backward)"))?;
        let layout = self.plan.bucket(bucket)?;
        let staging_bytes = staging.upload.as_bytes();
        for staged in &layout.params {
            let bytes = staged.upload_bytes();
            if bytes == 0 {
                continue;
            }
            let dst = params
                .get_mut(staged.param)
                .and_then(CudaTensor::slice_mut)
                .filter(|s| s.len() >= bytes)
                .ok_or_else(|| short_tensor(TensorRole::Parameter, staged.param, bytes))?;
            let src = staging_bytes
                .get(staged.upload_offset..staged.upload_offset + bytes)
                .ok_or_else(|| OffloadError::Pipeline("staging layout out of range".into()))?;
            let (dst_ptr, _write) = dst.device_ptr_mut(&self.h2d);
            // SAFETY: `dst_ptr` is a live device allocation of at least `bytes` bytes; `src` is
            // pinned memory the worker finished writing (it sent the bucket back) and will not
            // write again before `uploaded` completes (it waits on it).
            unsafe { driver::memcpy_htod_async(dst_ptr, src, self.h2d.cu_stream()) }
                .map_err(driver_error("cuMemcpyHtoDAsync"))?;
        }
        staging
            .uploaded
            .record(&self.h2d)
            .map_err(driver_error("cuEventRecord (bucket uploaded)"))
    }

    /// Upload the buckets the worker has finished: those ready now, or (`block`) all that are
    /// in flight. Failures of individual buckets are kept for `finish`; only losing the
    /// worker is returned.
    fn upload_finished(&mut self, params: &mut [CudaTensor], block: bool) -> Result<()> {
        loop {
            let finished = if block {
                if self.progress.in_flight() == 0 {
                    return Ok(());
                }
                self.worker.wait_finished()?
            } else {
                match self.worker.try_finished() {
                    Some(f) => f,
                    None => return Ok(()),
                }
            };
            let Finished {
                bucket,
                buffers,
                result,
            } = finished;
            let uploaded = result.and_then(|()| self.upload_bucket(bucket, &buffers, params));
            if let Some(slot) = self.staging.get_mut(bucket) {
                *slot = Some(buffers);
            }
            self.progress.mark_returned(bucket);
            if let Err(e) = uploaded {
                self.deferred.get_or_insert(e);
            }
        }
    }
}

fn short_tensor(role: TensorRole, param: usize, bytes: usize) -> OffloadError {
    OffloadError::TensorMismatch {
        role: role.name(),
        param,
        expected: format!("a device allocation of at least {bytes} bytes"),
        got: "a smaller one".into(),
    }
}

impl Drop for CudaOffloadPipeline {
    fn drop(&mut self) {
        // Every copy into or out of a staging buffer must be complete before the buffers are
        // freed. Errors cannot be returned here; cudarc keeps them for `check_err`.
        let context = self.cuda.context();
        context.record_err(self.d2h.synchronize());
        context.record_err(self.h2d.synchronize());
    }
}
