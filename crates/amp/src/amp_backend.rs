//! The kernels mixed precision needs beyond the shared [`Backend`] primitives, as an
//! extension trait: implemented here for the CPU backend, and by a CUDA backend behind the
//! crate's future `cuda` feature (same bits — the random stream is defined by
//! [`random_bits`](crate::stochastic_rounding::random_bits), not by the device).

use headroom_tensor::{Backend, Cpu, CpuTensor, DType, Tensor};

use crate::stochastic_rounding::{self, RoundingKey};
use crate::{AmpError, Result};

/// Backend kernels for mixed precision.
pub trait AmpBackend: Backend {
    /// `dst = stochastic_round(src)`: f32 → bf16, unbiased, deterministic in `(src, key)`
    /// (see [`stochastic_rounding`]). `src` must be f32, `dst` bf16, same element count.
    fn stochastic_round_bf16(
        &self,
        src: &Self::Tensor,
        dst: &mut Self::Tensor,
        key: RoundingKey,
    ) -> Result<()>;
}

/// Shared argument checks, so every backend rejects the same inputs the same way.
pub(crate) fn check_stochastic_round_args<T: Tensor>(src: &T, dst: &T) -> Result<()> {
    if src.dtype() != DType::F32 {
        return Err(AmpError::DTypeMismatch {
            what: "stochastic rounding source",
            expected: DType::F32,
            got: src.dtype(),
        });
    }
    if dst.dtype() != DType::BF16 {
        return Err(AmpError::DTypeMismatch {
            what: "stochastic rounding destination",
            expected: DType::BF16,
            got: dst.dtype(),
        });
    }
    if src.numel() != dst.numel() {
        return Err(AmpError::LengthMismatch {
            what: "stochastic rounding",
            expected: src.numel(),
            got: dst.numel(),
        });
    }
    Ok(())
}

impl AmpBackend for Cpu {
    fn stochastic_round_bf16(
        &self,
        src: &CpuTensor,
        dst: &mut CpuTensor,
        key: RoundingKey,
    ) -> Result<()> {
        check_stochastic_round_args(src, dst)?;
        let s = src.as_slice::<f32>()?;
        let d = dst.as_mut_slice::<half::bf16>()?;
        self.install(|| stochastic_rounding::stochastic_round_bf16(s, d, key));
        Ok(())
    }
}

/// The CUDA backend's stochastic rounding: headroom-cuda's kernel, bitwise the CPU's (the
/// random stream is a function of the key and the index, not of the device).
#[cfg(feature = "cuda")]
impl AmpBackend for headroom_cuda::Cuda {
    fn stochastic_round_bf16(
        &self,
        src: &headroom_cuda::CudaTensor,
        dst: &mut headroom_cuda::CudaTensor,
        key: RoundingKey,
    ) -> Result<()> {
        check_stochastic_round_args(src, dst)?;
        let key = headroom_cuda::StochasticRoundingKey {
            seed: key.seed,
            step: key.step,
            tensor: key.tensor,
        };
        Ok(headroom_cuda::Cuda::stochastic_round_bf16(
            self, src, dst, key,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_matches_reference_and_rejects_bad_arguments() {
        let cpu = Cpu::with_threads(2).unwrap();
        let host: Vec<f32> = (0..70_000)
            .map(|i| (i as f32).sqrt() * 0.001 - 0.1)
            .collect();
        let key = RoundingKey {
            seed: 1,
            step: 2,
            tensor: 3,
        };
        let src = cpu.upload(&host, [host.len()]).unwrap();
        let mut dst = cpu.zeros([host.len()], DType::BF16).unwrap();
        cpu.stochastic_round_bf16(&src, &mut dst, key).unwrap();
        let expected = stochastic_rounding::stochastic_round_bf16_reference(&host, key);
        assert_eq!(cpu.download::<half::bf16>(&dst).unwrap(), expected);

        let mut short = cpu.zeros([3], DType::BF16).unwrap();
        assert!(matches!(
            cpu.stochastic_round_bf16(&src, &mut short, key),
            Err(AmpError::LengthMismatch { .. })
        ));
        let mut wrong = cpu.zeros([host.len()], DType::F16).unwrap();
        assert!(matches!(
            cpu.stochastic_round_bf16(&src, &mut wrong, key),
            Err(AmpError::DTypeMismatch { .. })
        ));
        let bf_src = cpu.zeros([host.len()], DType::BF16).unwrap();
        assert!(matches!(
            cpu.stochastic_round_bf16(&bf_src, &mut dst, key),
            Err(AmpError::DTypeMismatch { .. })
        ));
    }
}
