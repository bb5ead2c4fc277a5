//! # headroom-offload
//!
//! Optimizer state off the accelerator: PyTorch's AdamW fused into one bandwidth-bound pass on
//! the CPU (AVX-512 / AVX2 / baseline chosen at run time, threaded, bit-identical for any thread
//! count, and bit-identical to torch 2.15's single-tensor `torch.optim.AdamW` on an AVX2 or
//! AVX-512 CPU wherever torch's square root is correctly rounded: see
//! [`reference`](mod@reference)), optional blockwise 8-bit moments (≈ 2 bytes per parameter
//! instead of 8), moments in RAM or in a memory-mapped file, and a pipeline that updates
//! finished gradient buckets while backward continues.
//!
//! ```
//! use headroom_offload::{AdamWHyper, CpuAdamW, ParamSpec, StatePrecision, StoreSpec};
//! use headroom_tensor::{bf16, cpu::kernels::{FloatSlice, FloatSliceMut}, Cpu};
//!
//! # fn main() -> headroom_offload::Result<()> {
//! let cpu = Cpu::new();
//! let params = [ParamSpec { numel: 4, group: 0 }];
//! let mut opt = CpuAdamW::new(vec![AdamWHyper::default()], &params, StatePrecision::F32, StoreSpec::Ram(&cpu))?;
//!
//! let mut master = vec![1.0f32, -1.0, 0.5, 0.0];
//! let grad = [bf16::from_f32(0.1); 4]; // gradients may arrive in bf16
//! let mut working = [bf16::ZERO; 4]; // the copy to upload back, written in the same pass
//! opt.step(0, &mut master, FloatSlice::BF16(&grad), Some(FloatSliceMut::BF16(&mut working)))?;
//!
//! // First AdamW step: each weight moves by ≈ lr against the gradient's sign (after decay).
//! assert!((master[0] - (1.0 * (1.0 - 1e-3 * 1e-2) - 1e-3)).abs() < 1e-6);
//! assert_eq!(working[1], bf16::from_f32(master[1]));
//! assert_eq!(opt.state_bytes_per_param(), 8.0);
//! # Ok(())
//! # }
//! ```
//!
//! ## Invariants
//! - Depends only on `headroom-tensor`; never on another technique crate.
//! - Every ISA path equals the scalar reference ([`reference::adamw_step`]) bit for bit: the
//!   same operations in the same order, fused multiply-adds exactly where PyTorch's CPU kernels
//!   fuse (the first-moment lerp and the second moment's `addcmul`), IEEE sqrt and division.
//!   The 8-bit formats ([`StatePrecision::Int8`], [`StatePrecision::Float8`]) are our own;
//!   each ISA path of each equals its portable reference bit for bit.
//! - The reference equals `torch.optim.AdamW(foreach=False, fused=False)` (torch 2.15, CPU
//!   capability AVX2) bit for bit in `param`, `exp_avg` and `exp_avg_sq` when torch's square root
//!   is correctly rounded; stock x86-64 torch takes it from MKL, which is not (the moments still
//!   match exactly). `tests/torch_fixture.rs` checks both against torch's own output.
//! - An instruction set the CPU lacks is an error ([`OffloadError::UnsupportedIsa`]), never a
//!   silent fallback.
//! - Results do not depend on the number of threads, on RAM versus file storage, or on whether
//!   the pipeline was used.
//! - RAM moments are allocated through the CPU backend as
//!   [`MemoryCategory::OptimizerState`](headroom_tensor::MemoryCategory); file-backed moments
//!   are page cache and are not reported as allocations.
//! - Offloading from a device is planned on the host ([`StagingPlan`]: every parameter in
//!   exactly one bucket, each at a [`STAGING_ALIGN`]-aligned region of its bucket's staging
//!   buffers) and updated by the same [`CpuAdamW`] with bit-identical results.
//! - With the `cuda` feature, `CudaOffloadPipeline` copies each finished bucket's gradients
//!   device→host on its own stream into ordinary (not write-combined) pinned memory, ordered
//!   after backward by events, and uploads the updated parameters on another stream before the
//!   next forward. Its pinned buffers are allocated once and reported to the allocation hook;
//!   it allocates nothing on the device. Its GPU tests are `#[ignore = "needs a CUDA device"]`.

mod adamw_kernel;
#[cfg(feature = "cuda")]
mod cuda_pipeline;
mod error;
mod float8;
mod int8_avx2;
mod optimizer;
mod pipeline;
mod quantized;
pub mod reference;
mod staging;
mod state_store;

pub use adamw_kernel::{fused_step, Isa, StepScalars, WorkingCopy};
#[cfg(feature = "cuda")]
pub use cuda_pipeline::CudaOffloadPipeline;
pub use error::{OffloadError, Result};
pub use optimizer::{AdamWHyper, AdamWState, CpuAdamW, ParamSpec, StatePrecision, StoreSpec};
pub use pipeline::{HostVec, OffloadPipeline, UpdatedBucket};
pub use quantized::QUANT_BLOCK;
pub use staging::{
    update_staged_bucket, BucketLayout, DeviceParamSpec, StagedParam, StagingPlan, TensorRole,
    STAGING_ALIGN,
};
pub use state_store::{StateStore, StoreIdentity};
