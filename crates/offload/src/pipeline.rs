//! The gradient offload pipeline: while backward is still producing the gradients of earlier
//! layers, a worker thread already runs AdamW on the buckets that are complete and hands back
//! the updated working copies bucket by bucket.
//!
//! The worker owns the optimizer and the f32 master parameters for the whole run; gradient and
//! working-copy buffers travel to it and back with each bucket, so steady state allocates
//! nothing. Results are bit-identical to calling [`CpuAdamW::step`] serially in any order: each
//! parameter's update depends only on its own state.

use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver, Sender};
use half::{bf16, f16};
use headroom_tensor::cpu::kernels::{FloatSlice, FloatSliceMut};

use crate::{CpuAdamW, OffloadError, Result};

/// An owned host buffer of floats in one precision (a gradient or a working copy in transit).
#[derive(Clone, Debug, PartialEq)]
pub enum HostVec {
    /// f32 values.
    F32(Vec<f32>),
    /// f16 values.
    F16(Vec<f16>),
    /// bf16 values.
    BF16(Vec<bf16>),
}

impl HostVec {
    /// Borrow as a float slice.
    pub fn as_float_slice(&self) -> FloatSlice<'_> {
        match self {
            HostVec::F32(v) => FloatSlice::F32(v),
            HostVec::F16(v) => FloatSlice::F16(v),
            HostVec::BF16(v) => FloatSlice::BF16(v),
        }
    }
    /// Borrow mutably as a float slice.
    pub fn as_float_slice_mut(&mut self) -> FloatSliceMut<'_> {
        match self {
            HostVec::F32(v) => FloatSliceMut::F32(v),
            HostVec::F16(v) => FloatSliceMut::F16(v),
            HostVec::BF16(v) => FloatSliceMut::BF16(v),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.as_float_slice().len()
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

struct Job {
    bucket: usize,
    grads: Vec<HostVec>,
    copies: Vec<HostVec>,
}

/// A bucket whose parameters have been updated.
#[derive(Debug)]
pub struct UpdatedBucket {
    /// Which bucket.
    pub bucket: usize,
    /// The gradient buffers, handed back for reuse.
    pub grads: Vec<HostVec>,
    /// The updated working copies, one per parameter of the bucket, in bucket order.
    pub copies: Vec<HostVec>,
}

/// A worker thread running [`CpuAdamW`] on gradient buckets as they arrive.
pub struct OffloadPipeline {
    jobs: Option<Sender<Job>>,
    done: Receiver<Result<UpdatedBucket>>,
    worker: Option<JoinHandle<(CpuAdamW, Vec<Vec<f32>>)>>,
    buckets: Vec<Vec<usize>>,
    numels: Vec<usize>,
}

impl OffloadPipeline {
    /// Start the worker. `masters[i]` is parameter `i`'s f32 master copy; `buckets` partitions
    /// parameter indices into the groups that are submitted together (typically one layer's
    /// parameters, in the order backward finishes them). `depth` bounds the buckets in flight.
    pub fn spawn(
        mut optimizer: CpuAdamW,
        mut masters: Vec<Vec<f32>>,
        buckets: Vec<Vec<usize>>,
        depth: usize,
    ) -> Result<Self> {
        let state = optimizer.state();
        if masters.len() != state.params.len() {
            return Err(OffloadError::Pipeline(format!(
                "{} master tensors for {} parameters",
                masters.len(),
                state.params.len()
            )));
        }
        let numels: Vec<usize> = state.params.iter().map(|p| p.numel).collect();
        for (i, (m, &n)) in masters.iter().zip(&numels).enumerate() {
            if m.len() != n {
                return Err(OffloadError::Pipeline(format!(
                    "master {i} has {} elements, parameter has {n}",
                    m.len()
                )));
            }
        }
        let mut seen = vec![false; numels.len()];
        for b in &buckets {
            for &p in b {
                match seen.get_mut(p) {
                    None => {
                        return Err(OffloadError::Pipeline(format!(
                            "bucket names parameter {p}, which does not exist"
                        )))
                    }
                    Some(true) => {
                        return Err(OffloadError::Pipeline(format!(
                            "parameter {p} is in two buckets"
                        )))
                    }
                    Some(s) => *s = true,
                }
            }
        }
        let (job_tx, job_rx) = bounded::<Job>(depth.max(1));
        let (done_tx, done_rx) = bounded::<Result<UpdatedBucket>>(buckets.len().max(1));
        let worker_buckets = buckets.clone();
        let worker = std::thread::Builder::new()
            .name("headroom-offload".into())
            .spawn(move || {
                for mut job in job_rx {
                    let params = &worker_buckets[job.bucket];
                    let mut result = Ok(());
                    for (k, &p) in params.iter().enumerate() {
                        let g = job.grads[k].as_float_slice();
                        let c = job.copies[k].as_float_slice_mut();
                        result = optimizer.step(p, &mut masters[p], g, Some(c));
                        if result.is_err() {
                            break;
                        }
                    }
                    let msg = result.map(|()| UpdatedBucket {
                        bucket: job.bucket,
                        grads: job.grads,
                        copies: job.copies,
                    });
                    if done_tx.send(msg).is_err() {
                        break;
                    }
                }
                (optimizer, masters)
            })
            .map_err(|e| OffloadError::Pipeline(format!("cannot start worker: {e}")))?;
        Ok(OffloadPipeline {
            jobs: Some(job_tx),
            done: done_rx,
            worker: Some(worker),
            buckets,
            numels,
        })
    }

    /// Hand a finished bucket's gradients (and buffers for its working copies) to the worker.
    /// Blocks only when `depth` buckets are already waiting.
    pub fn submit(&self, bucket: usize, grads: Vec<HostVec>, copies: Vec<HostVec>) -> Result<()> {
        let params = self.buckets.get(bucket).ok_or_else(|| {
            OffloadError::Pipeline(format!(
                "no bucket {bucket} (there are {})",
                self.buckets.len()
            ))
        })?;
        if grads.len() != params.len() || copies.len() != params.len() {
            return Err(OffloadError::Pipeline(format!(
                "bucket {bucket} has {} parameters; got {} gradients and {} copies",
                params.len(),
                grads.len(),
                copies.len()
            )));
        }
        for ((&p, g), c) in params.iter().zip(&grads).zip(&copies) {
            for (what, got) in [("gradient", g.len()), ("working copy", c.len())] {
                if got != self.numels[p] {
                    return Err(OffloadError::LengthMismatch {
                        what,
                        expected: self.numels[p],
                        got,
                    });
                }
            }
        }
        let jobs = self.jobs.as_ref().ok_or(OffloadError::PipelineClosed)?;
        jobs.send(Job {
            bucket,
            grads,
            copies,
        })
        .map_err(|_| OffloadError::PipelineClosed)
    }

    /// The next bucket the worker finished (blocking).
    pub fn recv(&self) -> Result<UpdatedBucket> {
        self.done.recv().map_err(|_| OffloadError::PipelineClosed)?
    }

    /// Stop the worker and take back the optimizer and the master parameters.
    pub fn shutdown(mut self) -> Result<(CpuAdamW, Vec<Vec<f32>>)> {
        self.jobs = None; // closing the channel ends the worker's loop
        let worker = self.worker.take().ok_or(OffloadError::PipelineClosed)?;
        worker.join().map_err(|_| OffloadError::PipelineClosed)
    }
}

impl Drop for OffloadPipeline {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
