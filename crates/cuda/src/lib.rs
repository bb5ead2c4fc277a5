//! # headroom-cuda
//!
//! The CUDA backend of headroom, on [cudarc]: a device probe that reports a missing driver or
//! GPU as a typed error, run-time compilation of `headroom-kernels` with NVRTC for the device's
//! compute capability (once per process), and [`Cuda`], which implements
//! [`headroom_tensor::Backend`] with the same semantics and errors as the CPU backend.
//!
//! Beyond the shared primitives it runs the reference GPT's whole step on the device: the
//! linear layers' three products on cuBLASLt ([`Cuda::gemm`], [`Cuda::matmul_forward`],
//! [`Cuda::matmul_backward`]; row-major, bf16/f16/f32 inputs, f32 accumulation, fused bias),
//! and NVRTC kernels with the CPU ops' argument order and semantics for embedding, layer norm,
//! tanh-GELU, the residual add, fused softmax cross-entropy, AdamW
//! ([`Cuda::adamw_step`]), f32 → bf16 stochastic rounding ([`Cuda::stochastic_round_bf16`]) and
//! the attention-head permutes between linear-layer rows and flash attention's layout
//! ([`Cuda::split_heads`], [`Cuda::merge_heads`], one launch each).
//!
//! It builds on machines with no CUDA at all (the driver and NVRTC are loaded at run time), and
//! nothing in it panics when there is no GPU:
//!
//! ```
//! use headroom_cuda::{Cuda, CudaError};
//! use headroom_tensor::{Backend, DType, MemoryCategory};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! match Cuda::new(0) {
//!     Ok(cuda) => {
//!         println!("{} (sm {:?})", cuda.device_name(), cuda.compute_capability());
//!         let _g = MemoryCategory::Gradients.enter(); // tag the allocations below
//!         let x = cuda.upload(&[3.0f32, -4.0], [2])?;
//!         let mut h = cuda.zeros([2], DType::BF16)?;
//!         cuda.cast(&x, &mut h)?;
//!         assert_eq!(cuda.sum_squares(&h)?, 25.0);
//!         // A trainer op: y += x, bitwise like the CPU.
//!         let mut y = cuda.upload(&[1.0f32, 2.0], [2])?;
//!         cuda.residual_add(&mut y, &x)?;
//!         assert_eq!(cuda.download::<f32>(&y)?, vec![4.0, -2.0]);
//!     }
//!     Err(CudaError::NoDevice { reason }) => println!("no GPU here: {reason}"),
//!     Err(other) => return Err(other.into()),
//! }
//! # Ok(())
//! # }
//! ```
//!
//! ## Invariants
//! - No GPU, no driver, no NVRTC: every entry point returns an error
//!   ([`CudaError::NoDevice`], [`CudaError::NvrtcUnavailable`]); none panics. The driver library
//!   is probed before any cudarc call that could panic.
//! - Results agree with the CPU backend: casts bit for bit (NaN payloads included), scale, axpy
//!   and unscale bit for bit on every non-NaN result (NaN stays NaN), sum of squares to f64
//!   rounding, and bitwise deterministic from run to run and GPU to GPU.
//! - Every device allocation — tensors and per-operation workspace — is reported to the
//!   allocation hook, tensors in the thread's current category, scratch as `Workspace`.
//! - Kernels are loaded as CUBIN for the device's exact architecture, so PTX from an NVRTC newer
//!   than the driver is never JIT-compiled.
//! - Trainer ops: embedding, GELU, residual add, AdamW and stochastic rounding are bitwise
//!   equal to their CPU references (headroom-trainer's ops, headroom-offload's AdamW reference,
//!   headroom-amp's rounding hash); layer norm, cross-entropy, bias gradients and GEMMs agree
//!   to rounding. Every op is deterministic: no float atomics anywhere (gradient scatters are
//!   owner-computes, column sums use fixed row chunks chosen from the shape alone).
//! - Every op checks devices, dtypes and sizes — returning [`headroom_tensor::Error`] — before
//!   it allocates or launches anything, and every launch's arguments are compared with
//!   [`OP_LAUNCH_SIGNATURES`], which is tested against the kernels' PTX without a GPU.
//! - This crate depends on `headroom-tensor` and `headroom-kernels` only (no technique crate).

mod backend;
mod device;
mod error;
mod gemm;
mod nvrtc;
mod ops;
mod tensor;

pub use device::{device_count, driver_library_present, Cuda};
pub use error::{CudaError, CudaResult, DriverErrorCode};
pub use gemm::{cublaslt_available, GemmOp, GemmShape};
pub use nvrtc::{
    arch_for, compile, compile_cached, nvrtc_available, nvrtc_version, CompiledKernel,
    COMPILE_OPTIONS,
};
pub use ops::{AdamWStep, HeadLayout, ParamKind, StochasticRoundingKey, OP_LAUNCH_SIGNATURES};
pub use tensor::CudaTensor;

/// cudarc, re-exported so extension crates launch their own kernels with the same version.
pub use cudarc;
