//! Where the model computes, and where its optimizer runs.
//!
//! - `Engine`: the CPU model, or (feature `cuda`) the CUDA model with its fp32 masters,
//!   gradient accumulation and AdamW on the host — ZeRO-Offload's split, the CUDA path of the
//!   offloaded placements. The training loop runs a micro-batch adding its gradients into host
//!   f32 buffers, reads and updates the fp32 masters, refreshes what the model computes with.
//! - `CudaResident` (feature `cuda`): the CUDA model with everything on the device — fp32
//!   masters, the gradient accumulator's buffers (the model's backward adds straight into
//!   them), and AdamW's `m` and `v` — the CUDA path of the resident placement, as PyTorch
//!   eager trains. Nothing crosses PCIe in a step but the tokens, the per-token losses and one
//!   f64 per gradient tensor for the clipping norm.
//!
//! ## The device optimizer follows the host's exactly
//! Per tensor it uses the hyper-parameters of the tensor's group and the tensor's own step
//! count, as [`headroom_offload::CpuAdamW`] does; its constants are headroom-cuda's
//! `AdamWStep`, the same formulas as headroom-offload's [`headroom_offload::StepScalars`],
//! and its kernel is bitwise the CPU reference. Its state checkpoints in the host optimizer's
//! format ([`headroom_offload::AdamWState`] plus the moment bytes `[m: numel][v: numel]` in
//! f32), so a run saved on either placement resumes on the other.

use headroom_ckpt::{Schedule, ScheduleStats};
use headroom_tensor::{CpuTensor, Device};

use crate::model::{Geometry, Model};
use crate::Result;

/// Which device a run computes on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ComputeDevice {
    /// The CPU backend (the reference path; every technique).
    #[default]
    Cpu,
    /// A CUDA device (feature `cuda`): bf16, flash attention; AdamW on the device for the
    /// resident placement, on the host for the offloaded ones.
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
    Cpu(Model),
    /// The CUDA model; masters on the host; `grads` are the device gradient buffers one
    /// micro-batch writes before they are added into the host accumulator.
    #[cfg(feature = "cuda")]
    Cuda {
        model: Model<headroom_cuda::Cuda>,
        masters: Vec<CpuTensor>,
        grads: Vec<headroom_cuda::CudaTensor>,
    },
}

impl Engine {
    /// The fp32 tensors training updates, in gradient order: every master, or a
    /// fine-tuning model's adapters.
    pub(crate) fn masters(&self) -> &[CpuTensor] {
        match self {
            Engine::Cpu(g) => g.trainable(),
            #[cfg(feature = "cuda")]
            Engine::Cuda { masters, .. } => masters,
        }
    }

    /// The fp32 masters, mutably; call [`Engine::refresh`] after changing them.
    pub(crate) fn masters_mut(&mut self) -> &mut [CpuTensor] {
        match self {
            Engine::Cpu(g) => g.trainable_mut(),
            #[cfg(feature = "cuda")]
            Engine::Cuda { masters, .. } => masters,
        }
    }

    /// Re-derive what the model computes with from the masters.
    pub(crate) fn refresh(&mut self) -> Result<()> {
        match self {
            Engine::Cpu(g) => g.refresh_trainable(),
            #[cfg(feature = "cuda")]
            Engine::Cuda { model, masters, .. } => crate::cuda::upload_working(model, masters),
        }
    }

    /// One micro-batch: adds the gradient of `Σ losses · dloss_per_token` into `host_grads`
    /// (f32, parameter order) and returns the mean loss and the schedule's figures.
    pub(crate) fn micro_batch(
        &mut self,
        tokens: &[u32],
        targets: &[u32],
        g: Geometry<'_>,
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
                let cuda = model.backend();
                crate::cuda::zero_grads(cuda, grads)?;
                let out =
                    model.forward_backward(tokens, targets, g, grads, dloss_per_token, schedule)?;
                crate::cuda::add_grads_into(cuda, grads, host_grads)?;
                Ok(out)
            }
        }
    }
}

/// The device optimizer's bookkeeping that needs no device: step numbering, and the host
/// optimizer's checkpoint format (pure functions, tested on the CPU).
#[cfg(any(feature = "cuda", test))]
mod optimizer_state {
    use headroom_offload::{AdamWHyper, AdamWState, OffloadError, ParamSpec, StatePrecision};

    use crate::{Result, TrainError};

    /// The hyper-parameters and the 1-based step number of parameter `index`'s next AdamW update:
    /// its group's hyper-parameters and its own step count plus one — what
    /// [`headroom_offload::CpuAdamW::step`] computes its constants from.
    pub(crate) fn adamw_step_of(
        groups: &[AdamWHyper],
        specs: &[ParamSpec],
        steps: &[u64],
        index: usize,
    ) -> Result<(AdamWHyper, u64)> {
        let unknown = OffloadError::UnknownParam {
            index,
            count: specs.len(),
        };
        let (spec, taken) = specs.get(index).zip(steps.get(index)).ok_or(unknown)?;
        let h = groups.get(spec.group).ok_or(OffloadError::UnknownGroup {
            index: spec.group,
            count: groups.len(),
        })?;
        let t = taken.checked_add(1).ok_or_else(|| {
            OffloadError::StateMismatch(format!("parameter {index} has taken u64::MAX steps"))
        })?;
        Ok((*h, t))
    }

    /// Check that a saved optimizer state fits a device optimizer over `specs`: f32 moments, the
    /// same parameters and sizes, one step count per parameter, valid groups, and exactly
    /// `8·numel` moment bytes. A checkpoint of 8-bit state cannot continue on the device (the
    /// device path keeps f32 moments only).
    pub(crate) fn check_f32_state(
        state: &AdamWState,
        specs: &[ParamSpec],
        moment_bytes: usize,
    ) -> Result<()> {
        let bad = |m: String| Err(TrainError::Optimizer(OffloadError::StateMismatch(m)));
        if state.precision != StatePrecision::F32 {
            return bad(
                "the checkpoint's optimizer state is 8-bit; the device-resident optimizer keeps \
                 f32 moments (resume with an offloaded placement)"
                    .into(),
            );
        }
        if state.params != specs {
            return bad("the checkpoint's parameters differ from the model's".into());
        }
        if state.steps.len() != specs.len() {
            return bad(format!(
                "{} step counts for {} parameters",
                state.steps.len(),
                specs.len()
            ));
        }
        for g in &state.groups {
            g.validate()?;
        }
        if let Some(p) = specs.iter().find(|p| p.group >= state.groups.len()) {
            return Err(OffloadError::UnknownGroup {
                index: p.group,
                count: state.groups.len(),
            }
            .into());
        }
        let numel: usize = specs.iter().map(|p| p.numel).sum();
        if numel.checked_mul(8) != Some(moment_bytes) {
            return bad(format!(
                "{moment_bytes} moment bytes, expected {} (f32 m and v of {numel} parameters)",
                numel.saturating_mul(8)
            ));
        }
        Ok(())
    }

    /// One f32 vector per parameter, in parameter order.
    pub(crate) type PerParameter = Vec<Vec<f32>>;

    /// Split the host optimizer's f32 moment bytes `[m: numel][v: numel]` (native-endian f32, as
    /// [`headroom_offload::CpuAdamW::moments`] holds them) into per-parameter `m` and `v`.
    pub(crate) fn split_f32_moments(
        bytes: &[u8],
        numels: &[usize],
    ) -> Result<(PerParameter, PerParameter)> {
        let total: usize = numels.iter().sum();
        if total.checked_mul(8) != Some(bytes.len()) {
            return Err(OffloadError::StateMismatch(format!(
                "{} moment bytes for {total} parameters (expected {})",
                bytes.len(),
                total.saturating_mul(8)
            ))
            .into());
        }
        let floats: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let (m_all, v_all) = floats.split_at(total);
        let mut m = Vec::with_capacity(numels.len());
        let mut v = Vec::with_capacity(numels.len());
        let mut at = 0;
        for &n in numels {
            m.push(m_all[at..at + n].to_vec());
            v.push(v_all[at..at + n].to_vec());
            at += n;
        }
        Ok((m, v))
    }

    /// The inverse of [`split_f32_moments`]: per-parameter `m` and `v` as the host optimizer's
    /// moment bytes.
    pub(crate) fn join_f32_moments(m: &[Vec<f32>], v: &[Vec<f32>]) -> Vec<u8> {
        m.iter()
            .chain(v)
            .flatten()
            .flat_map(|x| x.to_ne_bytes())
            .collect()
    }
}

#[cfg(any(feature = "cuda", test))]
use optimizer_state::{adamw_step_of, check_f32_state, join_f32_moments, split_f32_moments};

#[cfg(feature = "cuda")]
pub(crate) use resident::CudaResident;

#[cfg(feature = "cuda")]
mod resident {
    use headroom_ckpt::{Schedule, ScheduleStats};
    use headroom_cuda::{AdamWStep, Cuda, CudaTensor};
    use headroom_offload::{AdamWHyper, AdamWState, OffloadError, ParamSpec, StatePrecision};
    use headroom_tensor::{Backend, Cpu, CpuTensor, MemoryCategory, Tensor};

    use super::{adamw_step_of, check_f32_state, join_f32_moments, split_f32_moments};
    use crate::model::{params, Geometry, Model, ModelConfig, ModelOptions};
    use crate::Result;

    /// The AdamW constants of one update (headroom-cuda's type; the formulas of
    /// headroom-offload's `StepScalars`).
    pub(crate) fn adamw_constants(h: &AdamWHyper, t: u64) -> AdamWStep {
        AdamWStep::new(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, t)
    }

    /// The CUDA model with its fp32 masters and AdamW state on the device (the resident
    /// placement). The gradients are the caller's device buffers (a
    /// `GradAccumulator<Cuda>`'s), which [`CudaResident::micro_batch`] adds into.
    pub(crate) struct CudaResident {
        /// The model over its fp32 device masters (`Parameters`, in parameter order).
        model: Model<Cuda>,
        groups: Vec<AdamWHyper>,
        specs: Vec<ParamSpec>,
        /// Updates taken per parameter (as `CpuAdamW` keeps them).
        steps: Vec<u64>,
        /// First moments, `OptimizerState`.
        m: Vec<CudaTensor>,
        /// Second moments, `OptimizerState`.
        v: Vec<CudaTensor>,
    }

    impl CudaResident {
        /// The model on `cuda` over `host_masters` (copied to the device), with zeroed moments
        /// or, given `resume`, the saved optimizer state and moment bytes (the host
        /// optimizer's format; checked before anything is allocated for them).
        pub(crate) fn new(
            cuda: &Cuda,
            cfg: ModelConfig,
            opts: ModelOptions,
            host_masters: &[CpuTensor],
            groups: Vec<AdamWHyper>,
            specs: Vec<ParamSpec>,
            resume: Option<(&AdamWState, &[u8])>,
        ) -> Result<Self> {
            for g in &groups {
                g.validate()?;
            }
            if let Some(p) = specs.iter().find(|p| p.group >= groups.len()) {
                return Err(OffloadError::UnknownGroup {
                    index: p.group,
                    count: groups.len(),
                }
                .into());
            }
            if let Some((state, bytes)) = resume {
                check_f32_state(state, &specs, bytes.len())?;
            }
            // Checks the config and the masters' shapes before anything else is allocated.
            let model = crate::cuda::model_over_device_masters(cuda, cfg, opts, host_masters)?;
            let shapes: Vec<Vec<usize>> = params::param_infos(&cfg)
                .into_iter()
                .map(|i| i.shape)
                .collect();
            if shapes.len() != specs.len() {
                return Err(OffloadError::StateMismatch(format!(
                    "{} optimizer parameters for a model with {}",
                    specs.len(),
                    shapes.len()
                ))
                .into());
            }
            let _g = MemoryCategory::OptimizerState.enter();
            let (groups, steps, m, v) = match resume {
                None => {
                    let zeros = || {
                        shapes
                            .iter()
                            .map(|s| cuda.zeros(s.clone(), headroom_tensor::DType::F32))
                            .collect::<headroom_tensor::Result<Vec<_>>>()
                    };
                    (groups, vec![0; specs.len()], zeros()?, zeros()?)
                }
                Some((state, bytes)) => {
                    let numels: Vec<usize> = specs.iter().map(|p| p.numel).collect();
                    let (hm, hv) = split_f32_moments(bytes, &numels)?;
                    let up = |host: &[Vec<f32>]| {
                        host.iter()
                            .zip(&shapes)
                            .map(|(x, s)| cuda.upload(x, s.clone()))
                            .collect::<headroom_tensor::Result<Vec<_>>>()
                    };
                    (
                        state.groups.clone(),
                        state.steps.clone(),
                        up(&hm)?,
                        up(&hv)?,
                    )
                }
            };
            Ok(CudaResident {
                model,
                groups,
                specs,
                steps,
                m,
                v,
            })
        }

        /// The device backend (for the gradient accumulator's buffers).
        pub(crate) fn backend(&self) -> &Cuda {
            self.model.backend()
        }

        /// One micro-batch: *adds* the gradient of `Σ losses · dloss_per_token` into `grads`
        /// (device f32, parameter order) and returns the mean loss and the schedule's figures.
        pub(crate) fn micro_batch(
            &self,
            tokens: &[u32],
            targets: &[u32],
            g: Geometry<'_>,
            grads: &mut [CudaTensor],
            dloss_per_token: f32,
            schedule: &Schedule,
        ) -> Result<(f32, ScheduleStats)> {
            self.model
                .forward_backward(tokens, targets, g, grads, dloss_per_token, schedule)
        }

        /// Set group `g`'s learning rate (checked as `CpuAdamW::set_lr` checks it).
        pub(crate) fn set_lr(&mut self, g: usize, lr: f64) -> Result<()> {
            let count = self.groups.len();
            let h = self
                .groups
                .get_mut(g)
                .ok_or(OffloadError::UnknownGroup { index: g, count })?;
            *h = h.with_lr(lr)?;
            Ok(())
        }

        /// One AdamW step of every parameter from the (clipped) step gradients `grads`, then
        /// the model's working weights from the updated masters.
        pub(crate) fn apply(&mut self, grads: &[CudaTensor]) -> Result<()> {
            let count = self.model.masters().len();
            if grads.len() != count {
                return Err(OffloadError::UnknownParam {
                    index: grads.len(),
                    count,
                }
                .into());
            }
            for (i, ((grad, m), v)) in grads.iter().zip(&mut self.m).zip(&mut self.v).enumerate() {
                let (h, t) = adamw_step_of(&self.groups, &self.specs, &self.steps, i)?;
                let step = adamw_constants(&h, t);
                crate::cuda::adamw_step_parameter(&mut self.model, i, &step, grad, m, v)?;
                self.steps[i] = t;
            }
            // The working copies from the updated masters, as the host path refreshes them.
            self.model.refresh_working()
        }

        /// The bytes [`CudaResident::checkpoint_parts`] gives: the f32 masters and their two
        /// f32 moments.
        pub(crate) fn checkpoint_bytes(&self) -> u64 {
            use headroom_tensor::Tensor as _;
            3 * self
                .model
                .masters()
                .iter()
                .map(|t| t.numel() as u64 * 4)
                .sum::<u64>()
        }

        /// What a checkpoint saves, in the host optimizer's format: the masters as host
        /// tensors (allocated on `host` as `Workspace`: a transient staging copy), the
        /// optimizer's state and its moment bytes.
        pub(crate) fn checkpoint_parts(
            &self,
            host: &Cpu,
        ) -> Result<(Vec<CpuTensor>, AdamWState, Vec<u8>)> {
            let cuda = self.model.backend();
            let _g = MemoryCategory::Workspace.enter();
            let mut masters = Vec::with_capacity(self.model.masters().len());
            for d in self.model.masters() {
                let mut h = host.zeros(d.shape().clone(), headroom_tensor::DType::F32)?;
                cuda.download_into(d, h.as_mut_slice::<f32>()?)?;
                masters.push(h);
            }
            let download = |ts: &[CudaTensor]| {
                ts.iter()
                    .map(|t| cuda.download::<f32>(t))
                    .collect::<headroom_tensor::Result<Vec<_>>>()
            };
            let bytes = join_f32_moments(&download(&self.m)?, &download(&self.v)?);
            let state = AdamWState {
                precision: StatePrecision::F32,
                groups: self.groups.clone(),
                params: self.specs.clone(),
                steps: self.steps.clone(),
            };
            Ok((masters, state, bytes))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TrainError;
    use headroom_offload::{
        AdamWHyper, AdamWState, CpuAdamW, OffloadError, ParamSpec, StatePrecision, StoreSpec,
    };
    use headroom_tensor::cpu::kernels::FloatSlice;
    use headroom_tensor::Cpu;
    use proptest::prelude::*;

    fn groups() -> Vec<AdamWHyper> {
        vec![
            AdamWHyper {
                lr: 3e-3,
                weight_decay: 0.1,
                beta2: 0.95,
                ..Default::default()
            },
            AdamWHyper {
                lr: 3e-3,
                weight_decay: 0.0,
                beta2: 0.95,
                ..Default::default()
            },
        ]
    }

    fn specs(numels: &[usize]) -> Vec<ParamSpec> {
        numels
            .iter()
            .enumerate()
            .map(|(i, &numel)| ParamSpec {
                numel,
                group: i % 2,
            })
            .collect()
    }

    /// A host optimizer after `updates` steps of parameter 0 and one of the others, with its
    /// moments from a deterministic gradient.
    fn stepped_host_optimizer(numels: &[usize], updates: usize) -> CpuAdamW {
        let cpu = Cpu::new();
        let mut opt = CpuAdamW::new(
            groups(),
            &specs(numels),
            StatePrecision::F32,
            StoreSpec::Ram(&cpu),
        )
        .unwrap();
        for (i, &n) in numels.iter().enumerate() {
            let mut p: Vec<f32> = (0..n).map(|k| (k as f32 * 0.37).sin()).collect();
            let g: Vec<f32> = (0..n).map(|k| (k as f32 * 1.3 + i as f32).cos()).collect();
            let times = if i == 0 { updates } else { 1 };
            for _ in 0..times {
                opt.step(i, &mut p, FloatSlice::F32(&g), None).unwrap();
            }
        }
        opt
    }

    #[test]
    fn step_numbering_and_groups_follow_the_host_optimizer() {
        let numels = [5, 3, 4];
        let opt = stepped_host_optimizer(&numels, 3);
        let state = opt.state();
        assert_eq!(state.steps, vec![3, 1, 1]);
        for i in 0..numels.len() {
            let (h, t) = adamw_step_of(&state.groups, &state.params, &state.steps, i).unwrap();
            assert_eq!(t, state.steps[i] + 1, "the next update is 1-based");
            assert_eq!(h, state.groups[i % 2], "the parameter's group");
        }
        // Out of range is a typed error, never a panic.
        let e = adamw_step_of(&state.groups, &state.params, &state.steps, 3).unwrap_err();
        assert!(matches!(
            e,
            TrainError::Optimizer(OffloadError::UnknownParam { .. })
        ));
        let bad_group = [ParamSpec { numel: 1, group: 7 }];
        let e = adamw_step_of(&state.groups, &bad_group, &[0], 0).unwrap_err();
        assert!(matches!(
            e,
            TrainError::Optimizer(OffloadError::UnknownGroup { .. })
        ));
        let e = adamw_step_of(&state.groups, &state.params[..1], &[u64::MAX], 0).unwrap_err();
        assert!(matches!(
            e,
            TrainError::Optimizer(OffloadError::StateMismatch(_))
        ));
    }

    #[test]
    fn host_moments_split_into_each_parameters_m_and_v() {
        // Parameter 0's m and v after one host step from p, g are the reference's.
        let numels = [6, 2, 3];
        let opt = stepped_host_optimizer(&numels, 1);
        let (m, v) = split_f32_moments(opt.moments(), &numels).unwrap();
        let n = numels[0];
        let mut p: Vec<f32> = (0..n).map(|k| (k as f32 * 0.37).sin()).collect();
        let g: Vec<f32> = (0..n).map(|k| (k as f32 * 1.3).cos()).collect();
        let (mut rm, mut rv) = (vec![0.0; n], vec![0.0; n]);
        let h = groups()[0];
        let s =
            headroom_offload::StepScalars::new(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, 1);
        headroom_offload::reference::adamw_step(&s, &mut p, &g, &mut rm, &mut rv);
        assert_eq!(m[0], rm);
        assert_eq!(v[0], rv);
        assert_eq!(m.iter().map(Vec::len).collect::<Vec<_>>(), numels);
        assert_eq!(v.iter().map(Vec::len).collect::<Vec<_>>(), numels);
        // And joining gives the host optimizer's bytes back.
        assert_eq!(join_f32_moments(&m, &v), opt.moments());
        // A wrong length is a typed error.
        assert!(split_f32_moments(&opt.moments()[1..], &numels).is_err());
    }

    #[test]
    fn a_saved_host_state_passes_the_device_check_and_bad_ones_do_not() {
        let numels = [4, 2];
        let opt = stepped_host_optimizer(&numels, 2);
        let state = opt.state();
        let bytes = opt.moments().len();
        check_f32_state(&state, &specs(&numels), bytes).unwrap();
        let int8 = AdamWState {
            precision: StatePrecision::Int8,
            ..state.clone()
        };
        let other_sizes = specs(&[4, 3]);
        let short_steps = AdamWState {
            steps: vec![1],
            ..state.clone()
        };
        let cases: [(&AdamWState, &[ParamSpec], usize); 4] = [
            (&int8, &specs(&numels), bytes),
            (&state, &other_sizes, bytes),
            (&short_steps, &specs(&numels), bytes),
            (&state, &specs(&numels), bytes - 4),
        ];
        for (s, p, b) in cases {
            let e = check_f32_state(s, p, b).unwrap_err();
            assert!(matches!(e, TrainError::Optimizer(_)), "{e}");
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_step_constants_are_the_host_optimizers() {
        for (h, t) in groups()
            .into_iter()
            .flat_map(|h| [1u64, 2, 7, 1000].map(|t| (h, t)))
        {
            let d = resident::adamw_constants(&h, t);
            let s = headroom_offload::StepScalars::new(
                h.lr,
                h.beta1,
                h.beta2,
                h.eps,
                h.weight_decay,
                t,
            );
            assert_eq!(
                (d.decay, d.one_minus_beta1, d.beta2, d.one_minus_beta2),
                (s.decay, s.one_minus_beta1, s.beta2, s.one_minus_beta2)
            );
            assert_eq!(
                (d.step_size, d.bc2_sqrt, d.eps),
                (s.step_size, s.bc2_sqrt, s.eps)
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn moments_round_trip_through_split_and_join(
            numels in prop::collection::vec(0usize..9, 1..6),
            seed in any::<u32>(),
        ) {
            let total: usize = numels.iter().sum();
            let floats: Vec<f32> = (0..2 * total)
                .map(|k| {
                    // Finite bit patterns only (the top exponent value is masked off).
                    let bits = seed.wrapping_mul(2_654_435_761).wrapping_add(k as u32);
                    f32::from_bits(bits & 0x7f7f_ffff)
                })
                .collect();
            let bytes: Vec<u8> = floats.iter().flat_map(|x| x.to_ne_bytes()).collect();
            let (m, v) = split_f32_moments(&bytes, &numels).unwrap();
            prop_assert_eq!(join_f32_moments(&m, &v), bytes);
            // m holds the first half in parameter order, v the second.
            let flat_m: Vec<f32> = m.concat();
            prop_assert_eq!(flat_m.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                floats[..total].iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
    }
}
