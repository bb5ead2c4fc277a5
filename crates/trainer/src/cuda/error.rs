//! What a CUDA run can fail with: the device itself (no GPU, no driver), or anything the CPU
//! model can fail with.

use headroom_cuda::CudaError;
use headroom_tensor::Device;

use crate::TrainError;

/// Everything a CUDA run can fail with, with [`CudaGptError::is_no_device`] to tell a machine
/// without a GPU from a failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaGptError {
    /// The CUDA backend could not be created or used: [`CudaError::NoDevice`] on a machine
    /// without a GPU or driver, NVRTC or cuBLASLt missing, a driver call failing.
    #[error(transparent)]
    Device(#[from] CudaError),
    /// What the CPU model can fail with too: bad configs and batches, tensor and attention
    /// errors, the checkpoint executor.
    #[error(transparent)]
    Train(#[from] TrainError),
}

impl CudaGptError {
    /// True when the error says there is no usable CUDA device (driver missing, no GPU,
    /// ordinal out of range), however deep in a tensor error it was reported.
    pub fn is_no_device(&self) -> bool {
        match self {
            CudaGptError::Device(e) => matches!(e, CudaError::NoDevice { .. }),
            CudaGptError::Train(TrainError::Tensor(t)) => {
                let mut source: Option<&(dyn std::error::Error + 'static)> = Some(t);
                while let Some(s) = source {
                    if let Some(CudaError::NoDevice { .. }) = s.downcast_ref::<CudaError>() {
                        return true;
                    }
                    source = s.source();
                }
                false
            }
            CudaGptError::Train(_) => false,
        }
    }
}

macro_rules! through_train_error {
    ($($t:ty),*) => {$(
        impl From<$t> for CudaGptError {
            fn from(e: $t) -> Self {
                CudaGptError::Train(e.into())
            }
        }
    )*};
}

through_train_error!(
    headroom_tensor::Error,
    headroom_attn::AttnError,
    headroom_ckpt::CkptError
);

/// The CUDA errors inside the trainer's error type, so a training loop that speaks
/// [`TrainError`] can `?` them: device errors become the source of a tensor backend error on
/// `cuda:0`'s device tag (the chain of sources still names `CudaError::NoDevice`).
impl From<CudaGptError> for TrainError {
    fn from(e: CudaGptError) -> Self {
        match e {
            CudaGptError::Train(t) => t,
            CudaGptError::Device(d) => TrainError::Tensor(headroom_tensor::Error::Backend {
                device: Device::Cuda(0),
                op: "cuda device",
                source: Box::new(d),
            }),
        }
    }
}

/// `Result` with [`CudaGptError`].
pub type CudaGptResult<T> = std::result::Result<T, CudaGptError>;
