//! # headroom-tensor
//!
//! The floor of the headroom workspace: element types ([`DType`]), shapes ([`Shape`]), devices
//! ([`Device`]), the minimal [`Tensor`] and [`Backend`] traits every other crate is generic
//! over, the allocation hook ([`AllocHook`]) through which memory is measured, the
//! [`Cpu`] backend — threaded, vectorised, and the numerical reference — and [`isa`], which
//! decides how wide the workspace's SIMD kernels may go (`HEADROOM_CPU_ISA`).
//!
//! ```
//! use headroom_tensor::{Backend, Cpu, DType, MemoryCategory, Tensor};
//!
//! # fn main() -> headroom_tensor::Result<()> {
//! let cpu = Cpu::new();
//! let _grads = MemoryCategory::Gradients.enter(); // tag the allocations below
//! let x = cpu.upload(&[1.0f32, -2.0, 3.0], [3])?;
//! let mut y = cpu.zeros([3], DType::F32)?;
//! cpu.axpy(0.5, &x, &mut y)?; // y += 0.5·x
//! assert_eq!(cpu.download::<f32>(&y)?, [0.5, -1.0, 1.5]);
//! assert_eq!(cpu.sum_squares(&x)?, 14.0);
//!
//! let mut h = cpu.zeros(x.shape().clone(), DType::BF16)?;
//! cpu.cast(&x, &mut h)?; // f32 → bf16, round-to-nearest-even
//! let overflowed = cpu.unscale_and_check(&mut [&mut y], 1.0 / 1024.0)?;
//! assert!(!overflowed);
//! # Ok(())
//! # }
//! ```
//!
//! ## Invariants
//! - This crate depends on no other headroom crate.
//! - Tensors are dense and row-major; a tensor's byte size is `numel × dtype size`, exactly what
//!   the allocation hook is told.
//! - Reductions are bitwise reproducible for any thread count.
//! - Bad input is a typed [`Error`], never a panic.

mod alloc_hook;
mod backend;
pub mod cpu;
mod device;
mod dtype;
mod error;
pub mod isa;
pub mod reference;
mod shape;

pub use alloc_hook::{
    AllocEvent, AllocHook, AllocId, CategoryGuard, MemoryCategory, TrackedAllocation,
};
pub use backend::{Backend, Tensor};
pub use cpu::{Cpu, CpuTensor};
pub use device::Device;
pub use dtype::{DType, Element};
pub use error::{BoxedError, Error, Result};
pub use half::{bf16, f16};
pub use shape::Shape;
