//! # headroom-cuda
//!
//! The CUDA backend of headroom, on [cudarc]: a device probe that reports a missing driver or
//! GPU as a typed error, run-time compilation of `headroom-kernels` with NVRTC for the device's
//! compute capability (once per process), and [`Cuda`], which implements
//! [`headroom_tensor::Backend`] with the same semantics and errors as the CPU backend.
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
//! - This crate depends on `headroom-tensor` and `headroom-kernels` only (no technique crate).

mod backend;
mod device;
mod error;
mod nvrtc;
mod tensor;

pub use device::{device_count, driver_library_present, Cuda};
pub use error::{CudaError, CudaResult, DriverErrorCode};
pub use nvrtc::{
    arch_for, compile, compile_cached, nvrtc_available, nvrtc_version, CompiledKernel,
    COMPILE_OPTIONS,
};
pub use tensor::CudaTensor;

/// cudarc, re-exported so extension crates launch their own kernels with the same version.
pub use cudarc;
