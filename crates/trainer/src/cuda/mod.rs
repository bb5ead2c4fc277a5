//! What a CUDA run needs beyond the model. The model is [`Model<Cuda>`] — the same code the CPU
//! runs, over the CUDA implementation of [`crate::model::ModelOps`] (its numerics are
//! documented there, in `model/cuda_ops.rs`). Here: building it over host or device masters,
//! refreshing its working copies, the device AdamW step per parameter, and the gradient
//! buffers' allocation, zeroing and transfers.
//!
//! ```no_run
//! use headroom_ckpt::Schedule;
//! use headroom_tensor::Cpu;
//! use headroom_trainer::cuda;
//! use headroom_trainer::model::{params, Family, Geometry, ModelConfig, ModelOptions, Precision};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cfg = ModelConfig { vocab: 64, max_seq: 16, layers: 2, heads: 2, channels: 128, family: Family::Gpt2 };
//! let opts = ModelOptions { precision: Precision::Bf16, ..Default::default() };
//! let masters = params::init_params(&Cpu::new(), &cfg, 0)?; // the optimizer's, on the host
//! let device = match headroom_cuda::Cuda::new(0).map_err(cuda::CudaGptError::from) {
//!     Ok(d) => d,
//!     Err(e) if e.is_no_device() => return Ok(()), // no GPU: a typed error, no panic
//!     Err(e) => return Err(e.into()),
//! };
//! let model = cuda::model_over_host_masters(&device, cfg, opts, &masters)?;
//! let mut grads = cuda::alloc_grads(&device, &cfg)?;
//! let g = Geometry::new(2, 16);
//! let tokens: Vec<u32> = (0..32).map(|i| i % 64).collect();
//! let targets: Vec<u32> = (1..33).map(|i| i % 64).collect();
//! let schedule = Schedule::every_k(cfg.layers, 2)?;
//! let (loss, _stats) =
//!     model.forward_backward(&tokens, &targets, g, &mut grads, 1.0 / 32.0, &schedule)?;
//! let host_grads: Vec<Vec<f32>> = cuda::download_grads(&device, &grads)?; // for CPU AdamW
//! # let _ = (loss, host_grads);
//! # Ok(())
//! # }
//! ```
//!
//! ## Memory
//! Working weights are `Parameters`: the storage precision's copy of every parameter (bf16
//! under bf16), plus the fp32 masters when they live on the device ([`model_over_device_masters`],
//! the resident placement). Gradients are f32 `Gradients` ([`alloc_grads`]). Activations and
//! workspace are the model's (see [`crate::model`]).

mod error;

pub use error::{CudaGptError, CudaGptResult};

use headroom_cuda::{AdamWStep, Cuda, CudaTensor};
use headroom_tensor::cpu::kernels::{axpy, FloatSlice};
use headroom_tensor::{Backend, CpuTensor, DType, MemoryCategory, Tensor};

use crate::model::{params, Model, ModelConfig, ModelOptions};
use crate::{Result, TrainError};

/// Check a per-parameter list (host or device) against the model's parameters: one f32 tensor
/// of each parameter's shape, in parameter order; `what` names the list in the error.
fn check_per_parameter<T: Tensor>(cfg: &ModelConfig, list: &[T], what: &str) -> Result<()> {
    let infos = params::param_infos(cfg);
    if list.len() != infos.len() {
        return Err(TrainError::Input(format!(
            "{} {what} tensors for a model with {}",
            list.len(),
            infos.len()
        )));
    }
    match list
        .iter()
        .zip(&infos)
        .find(|(t, i)| t.shape().dims() != i.shape.as_slice() || t.dtype() != DType::F32)
    {
        Some((t, info)) => Err(TrainError::Input(format!(
            "{what} {} is {:?} {:?}, expected f32 {:?}",
            info.name,
            t.dtype(),
            t.shape().dims(),
            info.shape
        ))),
        None => Ok(()),
    }
}

/// What the CUDA path runs, checked before any device work
/// ([`crate::estimate::cuda_runs`]: flash attention on bf16, head dimension 64 or 128).
pub fn check_options(cfg: &ModelConfig, opts: &ModelOptions) -> Result<()> {
    crate::estimate::cuda_runs(cfg, opts)
}

/// The model on `cuda` with working copies only, derived from fp32 `masters` that stay on the
/// host (the offloaded placements: the optimizer updates the host masters, then
/// [`upload_working`] refreshes the device).
pub fn model_over_host_masters(
    cuda: &Cuda,
    cfg: ModelConfig,
    opts: ModelOptions,
    masters: &[CpuTensor],
) -> Result<Model<Cuda>> {
    check_options(&cfg, &opts)?;
    check_per_parameter(&cfg, masters, "master")?;
    let working = {
        let _g = MemoryCategory::Parameters.enter();
        let _l = headroom_profiler::label_absolute("params (working copies)");
        masters
            .iter()
            .map(|m| cuda.uninit(m.shape().clone(), opts.precision.storage()))
            .collect::<headroom_tensor::Result<Vec<_>>>()?
    };
    let mut model = Model::from_working(cuda, cfg, opts, working)?;
    upload_working(&mut model, masters)?;
    Ok(model)
}

/// The model on `cuda` with its fp32 masters on the device too (the resident placement):
/// the host's `masters` are uploaded as `Parameters` and the working copies derived from them.
pub fn model_over_device_masters(
    cuda: &Cuda,
    cfg: ModelConfig,
    opts: ModelOptions,
    masters: &[CpuTensor],
) -> Result<Model<Cuda>> {
    check_options(&cfg, &opts)?;
    check_per_parameter(&cfg, masters, "master")?;
    let device = {
        let _g = MemoryCategory::Parameters.enter();
        let _l = headroom_profiler::label_absolute("params (masters)");
        masters
            .iter()
            .map(|m| cuda.upload(m.as_slice::<f32>()?, m.shape().clone()))
            .collect::<headroom_tensor::Result<Vec<_>>>()?
    };
    Model::from_masters(cuda, cfg, opts, device)
}

/// Re-derive the device working copies from the host's fp32 `masters` (after an optimizer
/// step): each goes up as f32 into a transient `Workspace` buffer and is rounded on the device
/// (round to nearest even, bitwise the CPU's working copies). Every shape is checked before
/// the first upload, so a bad list changes nothing.
pub fn upload_working(model: &mut Model<Cuda>, masters: &[CpuTensor]) -> Result<()> {
    check_per_parameter(&model.cfg, masters, "master")?;
    let cuda = model.backend().clone();
    for (i, m) in masters.iter().enumerate() {
        let _g = MemoryCategory::Workspace.enter();
        let up = cuda.upload(m.as_slice::<f32>()?, m.shape().clone())?;
        cuda.cast(&up, model.weights.working_mut(i)?)?;
    }
    Ok(())
}

/// One AdamW step of parameter `index`'s device master (`grad`, `m`, `v` f32 on the device),
/// bitwise the host optimizer's. Call [`Model::refresh_working`] once every parameter has
/// stepped.
pub fn adamw_step_parameter(
    model: &mut Model<Cuda>,
    index: usize,
    step: &AdamWStep,
    grad: &CudaTensor,
    m: &mut CudaTensor,
    v: &mut CudaTensor,
) -> Result<()> {
    let cuda = model.backend().clone();
    let count = model.masters().len();
    let master = model
        .masters_mut()
        .get_mut(index)
        .ok_or_else(|| TrainError::Input(format!("parameter {index} of {count} device masters")))?;
    Ok(cuda.adamw_step(step, master, grad, m, v, None)?)
}

/// Zeroed f32 gradients for every parameter on `cuda`, as `Gradients`, labelled by Hugging
/// Face name like the CPU's.
pub fn alloc_grads(cuda: &Cuda, cfg: &ModelConfig) -> Result<Vec<CudaTensor>> {
    let _g = MemoryCategory::Gradients.enter();
    params::param_infos(cfg)
        .iter()
        .map(|i| {
            let _l = headroom_profiler::label_absolute(&format!("{}.grad", i.name));
            Ok(cuda.zeros(i.shape.clone(), DType::F32)?)
        })
        .collect()
}

/// Zero every gradient (between optimizer steps).
pub fn zero_grads(cuda: &Cuda, grads: &mut [CudaTensor]) -> Result<()> {
    for g in grads {
        cuda.fill_zero(g)?;
    }
    Ok(())
}

/// The gradients as host f32 vectors, in parameter order.
pub fn download_grads(cuda: &Cuda, grads: &[CudaTensor]) -> Result<Vec<Vec<f32>>> {
    grads.iter().map(|g| Ok(cuda.download::<f32>(g)?)).collect()
}

/// Add device gradients into host f32 tensors of the same shapes (`host += grads`, in f32),
/// e.g. a micro-batch's into the host accumulator's buffers.
pub fn add_grads_into(cuda: &Cuda, grads: &[CudaTensor], host: &mut [CpuTensor]) -> Result<()> {
    if grads.len() != host.len() {
        return Err(TrainError::Input(format!(
            "{} device gradients for {} host tensors",
            grads.len(),
            host.len()
        )));
    }
    let mut staging = Vec::new();
    for (g, h) in grads.iter().zip(host) {
        let dst = h.as_mut_slice::<f32>()?;
        staging.resize(dst.len(), 0.0f32);
        // Synchronous: `staging` holds the gradient when this returns.
        cuda.download_into(g, &mut staging)?;
        // The tensor crate's threaded `y += 1·x` (no FMA): the same bits as a plain loop, on
        // every core — at GPT-2 sizes a single-threaded add costs about a device backward.
        axpy(1.0, FloatSlice::F32(&staging), dst);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Precision;
    use headroom_tensor::Cpu;

    #[test]
    fn per_parameter_lists_are_checked_by_count_shape_and_dtype() {
        let cfg = ModelConfig {
            vocab: 32,
            max_seq: 8,
            layers: 2,
            heads: 2,
            channels: 128,
            family: crate::model::Family::Gpt2,
        };
        let cpu = Cpu::new();
        let masters = params::init_params(&cpu, &cfg, 0).unwrap();
        check_per_parameter(&cfg, &masters, "master").unwrap();
        let e = check_per_parameter(&cfg, &masters[1..], "master").unwrap_err();
        assert!(e.to_string().contains("tensors for a model with"), "{e}");
        let mut wrong = params::init_params(&cpu, &cfg, 0).unwrap();
        wrong[3] = cpu.zeros([7], DType::F32).unwrap();
        let e = check_per_parameter(&cfg, &wrong, "gradient").unwrap_err();
        assert!(e.to_string().contains("gradient"), "{e}");
        wrong[3] = cpu.zeros(masters[3].shape().clone(), DType::BF16).unwrap();
        assert!(check_per_parameter(&cfg, &wrong, "master").is_err());
    }

    #[test]
    fn unsupported_options_are_refused_before_the_device() {
        let cfg = ModelConfig {
            vocab: 32,
            max_seq: 8,
            layers: 2,
            heads: 2,
            channels: 128,
            family: crate::model::Family::Gpt2,
        };
        let bf16 = ModelOptions {
            precision: Precision::Bf16,
            ..Default::default()
        };
        check_options(&cfg, &bf16).unwrap();
        let naive = ModelOptions {
            attention: headroom_attn::AttentionConfig::naive(),
            ..bf16
        };
        let zero_chunk = ModelOptions {
            loss_chunk: Some(0),
            ..bf16
        };
        let head_dim_48 = ModelConfig {
            channels: 96,
            ..cfg
        };
        for (c, o) in [
            (cfg, ModelOptions::default()), // fp32
            (cfg, naive),
            (head_dim_48, bf16),
            (cfg, zero_chunk),
        ] {
            let e = check_options(&c, &o).unwrap_err();
            assert!(matches!(e, TrainError::Config(_)), "{e}");
        }
    }
}
