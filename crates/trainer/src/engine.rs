//! Where the model computes: the CPU model, or (feature `cuda`) the CUDA model with its fp32
//! masters, gradient accumulation and optimizer on the host — ZeRO-Offload's split, which is
//! the only one the CUDA path has yet.
//!
//! The training loop sees one interface: run a micro-batch adding its gradients into host f32
//! buffers, read and update the fp32 masters, refresh what the model computes with.

use headroom_ckpt::{Schedule, ScheduleStats};
use headroom_tensor::{CpuTensor, Device};

use crate::model::{Geometry, Gpt};
use crate::Result;

/// Which device a run computes on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ComputeDevice {
    /// The CPU backend (the reference path; every technique).
    #[default]
    Cpu,
    /// A CUDA device (feature `cuda`): bf16, flash attention, optimizer on the host.
    Cuda {
        /// Device ordinal.
        ordinal: usize,
    },
}

impl ComputeDevice {
    /// The tracker's device for this choice.
    pub fn tracked(self) -> Device {
        match self {
            ComputeDevice::Cpu => Device::Cpu,
            ComputeDevice::Cuda { ordinal } => Device::Cuda(ordinal),
        }
    }
}

/// The model a run trains, on its device.
pub(crate) enum Engine {
    /// Masters and working copies on the (tracked) CPU backend.
    Cpu(Gpt),
    /// The CUDA model; masters on the host; `grads` are the device gradient buffers one
    /// micro-batch writes before they are added into the host accumulator.
    #[cfg(feature = "cuda")]
    Cuda {
        model: crate::cuda::CudaGpt,
        masters: Vec<CpuTensor>,
        grads: Vec<headroom_cuda::CudaTensor>,
    },
}

impl Engine {
    /// The fp32 masters, in parameter order.
    pub(crate) fn masters(&self) -> &[CpuTensor] {
        match self {
            Engine::Cpu(g) => g.masters(),
            #[cfg(feature = "cuda")]
            Engine::Cuda { masters, .. } => masters,
        }
    }

    /// The fp32 masters, mutably; call [`Engine::refresh`] after changing them.
    pub(crate) fn masters_mut(&mut self) -> &mut [CpuTensor] {
        match self {
            Engine::Cpu(g) => g.masters_mut(),
            #[cfg(feature = "cuda")]
            Engine::Cuda { masters, .. } => masters,
        }
    }

    /// Re-derive what the model computes with from the masters.
    pub(crate) fn refresh(&mut self) -> Result<()> {
        match self {
            Engine::Cpu(g) => g.refresh_working(),
            #[cfg(feature = "cuda")]
            Engine::Cuda { model, masters, .. } => Ok(model.upload_masters(masters)?),
        }
    }

    /// One micro-batch: adds the gradient of `Σ losses · dloss_per_token` into `host_grads`
    /// (f32, parameter order) and returns the mean loss and the schedule's figures.
    pub(crate) fn micro_batch(
        &mut self,
        tokens: &[u32],
        targets: &[u32],
        g: Geometry,
        host_grads: &mut [CpuTensor],
        dloss_per_token: f32,
        schedule: &Schedule,
    ) -> Result<(f32, ScheduleStats)> {
        match self {
            Engine::Cpu(gpt) => {
                gpt.forward_backward(tokens, targets, g, host_grads, dloss_per_token, schedule)
            }
            #[cfg(feature = "cuda")]
            Engine::Cuda { model, grads, .. } => {
                model.zero_grads(grads)?;
                let out =
                    model.forward_backward(tokens, targets, g, grads, dloss_per_token, schedule)?;
                model.add_grads_into(grads, host_grads)?;
                Ok(out)
            }
        }
    }
}
