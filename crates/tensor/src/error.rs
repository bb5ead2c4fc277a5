//! The error type shared by every backend.

use crate::{DType, Device, Shape};

/// A boxed error from a backend driver or an allocation hook, kept as the `source` of an
/// [`Error`] so callers can downcast it (the profiler's out-of-memory report, a CUDA driver code).
pub type BoxedError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything a backend operation can fail with. Bad input is reported here, never by a panic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Two tensors (or a tensor and a host slice) disagree in element count.
    #[error("{op}: length mismatch: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// The operation that checked.
        op: &'static str,
        /// The element count required.
        expected: usize,
        /// The element count given.
        got: usize,
    },
    /// Two shapes that must agree do not.
    #[error("{op}: shape mismatch: expected {expected}, got {got}")]
    ShapeMismatch {
        /// The operation that checked.
        op: &'static str,
        /// The shape required.
        expected: Shape,
        /// The shape given.
        got: Shape,
    },
    /// A tensor has a dtype the operation requires to be something else.
    #[error("{op}: dtype mismatch: expected {expected}, got {got}")]
    DTypeMismatch {
        /// The operation that checked.
        op: &'static str,
        /// The dtype required.
        expected: DType,
        /// The dtype given.
        got: DType,
    },
    /// The operation is not defined for this dtype (for example a cast from an integer type).
    #[error("{op}: unsupported dtype {dtype}")]
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The offending dtype.
        dtype: DType,
    },
    /// A tensor belongs to another device than the backend it was handed to.
    #[error("{op}: tensor is on {got}, backend is {expected}")]
    DeviceMismatch {
        /// The operation.
        op: &'static str,
        /// The backend's device.
        expected: Device,
        /// The tensor's device.
        got: Device,
    },
    /// The byte size of a shape does not fit in `usize`.
    #[error("shape {shape} at {dtype} overflows the address space")]
    SizeOverflow {
        /// The requested shape.
        shape: Shape,
        /// The requested dtype.
        dtype: DType,
    },
    /// The operating system (or the device allocator) had no memory for the request.
    #[error("out of memory on {device}: could not allocate {bytes} bytes")]
    OutOfMemory {
        /// Where the allocation was attempted.
        device: Device,
        /// The size requested.
        bytes: usize,
    },
    /// An allocation hook refused the allocation (for example a profiler budget); the hook's
    /// own error, with its breakdown of live memory, is the source.
    #[error("allocation of {bytes} bytes on {device} rejected by the allocation hook")]
    AllocationRejected {
        /// Where the allocation was attempted.
        device: Device,
        /// The size requested.
        bytes: usize,
        /// The hook's reason.
        #[source]
        source: BoxedError,
    },
    /// A shape argument is invalid for the operation (for example a reshape that changes the
    /// element count).
    #[error("{op}: invalid shape {shape}: {reason}")]
    InvalidShape {
        /// The operation.
        op: &'static str,
        /// The offending shape.
        shape: Shape,
        /// Why it is invalid.
        reason: &'static str,
    },
    /// A device backend failed (driver, compiler, library); the backend's error is the source.
    #[error("{device} backend error in {op}")]
    Backend {
        /// The failing device.
        device: Device,
        /// The operation.
        op: &'static str,
        /// The backend's error.
        #[source]
        source: BoxedError,
    },
}

impl Error {
    /// `Ok` when `got == expected`, else [`Error::LengthMismatch`]: the element-count check
    /// every backend makes before touching two buffers.
    pub fn check_len(op: &'static str, expected: usize, got: usize) -> Result<()> {
        if expected != got {
            return Err(Error::LengthMismatch { op, expected, got });
        }
        Ok(())
    }
}

/// `Result` with the tensor [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
