//! The CUDA backend's error type, and its conversion into the shared tensor error.

use cudarc::driver::sys::CUresult;
use cudarc::driver::DriverError;
use headroom_tensor::{Device, Error};

/// Everything the CUDA backend can fail with besides bad tensor arguments (those are
/// [`headroom_tensor::Error`]s, exactly as on the CPU).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// No usable CUDA device: the driver library is missing, `cuInit` failed, the machine has
    /// no device, or the ordinal is out of range.
    #[error("no CUDA device: {reason}")]
    NoDevice {
        /// What the probe found.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {op}: {source}")]
    Driver {
        /// The operation that called the driver.
        op: &'static str,
        /// The driver's error code.
        #[source]
        source: DriverErrorCode,
    },
    /// libnvrtc could not be loaded (run-time compilation needs it).
    #[error("NVRTC is not available: {reason}")]
    NvrtcUnavailable {
        /// Why it could not be loaded.
        reason: String,
    },
    /// NVRTC rejected a kernel module.
    #[error("NVRTC failed to compile kernel module `{kernel}` for {arch}: {log}")]
    Nvrtc {
        /// The module name (`headroom_kernels::KernelSource::name`).
        kernel: &'static str,
        /// The target architecture, e.g. `sm_90`.
        arch: String,
        /// NVRTC's error and compilation log.
        log: String,
    },
    /// A compiled module could not be loaded into the device's context, typically because the
    /// NVRTC that compiled it is newer than the driver.
    #[error(
        "could not load kernel module `{kernel}` (NVRTC {nvrtc_version}, driver supports CUDA \
         {driver_version}): {source}"
    )]
    ModuleLoad {
        /// The module name.
        kernel: &'static str,
        /// NVRTC's version as `major.minor`.
        nvrtc_version: String,
        /// The newest CUDA version the driver supports, as `major.minor`.
        driver_version: String,
        /// The driver's error code.
        #[source]
        source: DriverErrorCode,
    },
    /// libcublasLt could not be loaded or initialised (the GEMMs need it).
    #[error("cuBLASLt is not available: {reason}")]
    CublasUnavailable {
        /// Why.
        reason: String,
    },
    /// A cuBLASLt call failed.
    #[error("cuBLASLt error in {op}: {status}")]
    Cublas {
        /// The call.
        op: &'static str,
        /// cuBLAS's status code, by name.
        status: String,
    },
    /// A launch pushed arguments that differ from its kernel's recorded parameter list (a bug
    /// in this crate, caught before the launch instead of corrupting memory).
    #[error("launch of `{function}` pushed {pushed}, which is not its recorded signature")]
    LaunchSignature {
        /// The entry point.
        function: &'static str,
        /// The argument kinds that were pushed.
        pushed: String,
    },
    /// An entry point is not listed in `headroom_kernels::ALL` (a bug in this crate).
    #[error("kernel entry point `{function}` is not in headroom_kernels::ALL")]
    UnknownKernel {
        /// The missing function name.
        function: String,
    },
}

/// A CUDA driver result code as an error, with its name (`CUDA_ERROR_OUT_OF_MEMORY`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DriverErrorCode(pub CUresult);

impl DriverErrorCode {
    /// True for `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn is_out_of_memory(&self) -> bool {
        self.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }
}

impl std::fmt::Debug for DriverErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::fmt::Display for DriverErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The enum's name is the driver's own (`CUDA_ERROR_...`); no driver call is needed to
        // print it, which matters when the driver is the thing that failed.
        write!(f, "{:?} ({})", self.0, self.0 as u32)
    }
}

impl std::error::Error for DriverErrorCode {}

impl From<DriverError> for DriverErrorCode {
    fn from(e: DriverError) -> Self {
        DriverErrorCode(e.0)
    }
}

impl CudaError {
    /// A driver failure in `op`.
    pub(crate) fn driver(op: &'static str, e: DriverError) -> Self {
        CudaError::Driver {
            op,
            source: e.into(),
        }
    }

    /// This error as the shared tensor error of a failed operation on `device`.
    pub(crate) fn into_tensor_error(self, device: Device, op: &'static str) -> Error {
        Error::Backend {
            device,
            op,
            source: Box::new(self),
        }
    }
}

/// `Result` with [`CudaError`].
pub type CudaResult<T> = std::result::Result<T, CudaError>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn driver_errors_name_their_code_and_survive_the_tensor_error() {
        let e = CudaError::driver(
            "cuMemAlloc",
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        );
        let shown = e.to_string();
        assert!(
            shown.contains("cuMemAlloc") && shown.contains("CUDA_ERROR_OUT_OF_MEMORY"),
            "{shown}"
        );
        match &e {
            CudaError::Driver { source, .. } => assert!(source.is_out_of_memory()),
            other => panic!("{other:?}"),
        }
        let t = e.into_tensor_error(Device::Cuda(1), "zeros");
        assert!(t.to_string().contains("cuda:1"), "{t}");
        let inner = t.source().and_then(|s| s.downcast_ref::<CudaError>());
        assert!(matches!(
            inner,
            Some(CudaError::Driver {
                op: "cuMemAlloc",
                ..
            })
        ));
        let not_oom = DriverErrorCode(CUresult::CUDA_ERROR_INVALID_VALUE);
        assert!(!not_oom.is_out_of_memory());
    }
}
