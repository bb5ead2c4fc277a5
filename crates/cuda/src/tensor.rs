//! Device tensors: a CUDA allocation plus shape, dtype and the allocation-hook token.

use std::fmt;

use cudarc::driver::CudaSlice;
use headroom_tensor::{DType, Device, Result, Shape, Tensor, TrackedAllocation};

/// A dense row-major tensor in device memory.
///
/// The data is raw bytes (`CudaSlice<u8>`); kernels reinterpret it by dtype. An empty tensor
/// holds no device allocation at all (the driver rejects zero-byte allocations), but is still
/// reported to the allocation hook with 0 bytes, like on the CPU.
pub struct CudaTensor {
    // Declared before `allocation`: fields drop in order, so the device memory is released before
    // the hook hears of the free.
    pub(crate) data: Option<CudaSlice<u8>>,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    pub(crate) ordinal: usize,
    pub(crate) allocation: TrackedAllocation,
}

impl CudaTensor {
    /// The device buffer, for extension kernels in other crates; `None` when the tensor is empty.
    pub fn slice(&self) -> Option<&CudaSlice<u8>> {
        self.data.as_ref()
    }

    /// The device buffer, mutably; `None` when the tensor is empty.
    pub fn slice_mut(&mut self) -> Option<&mut CudaSlice<u8>> {
        self.data.as_mut()
    }

    /// The allocation event this tensor was reported with.
    pub fn allocation(&self) -> &TrackedAllocation {
        &self.allocation
    }
}

impl Tensor for CudaTensor {
    fn shape(&self) -> &Shape {
        &self.shape
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }
    fn reshape(&mut self, shape: Shape) -> Result<()> {
        self.shape = self.shape.reshape_to(shape)?;
        Ok(())
    }
}

impl fmt::Debug for CudaTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaTensor")
            .field("device", &self.device())
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("category", &self.allocation.event().category)
            .finish()
    }
}
