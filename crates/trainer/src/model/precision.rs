//! The numeric format of the working weights and of the activations kept for backward.

use headroom_tensor::DType;
use serde::{Deserialize, Serialize};

/// What forward and backward read and keep. Arithmetic is f32 in every mode (the CPU kernels
/// are f32); a low-precision mode rounds every working weight and every kept activation to its
/// format, so the numbers are those of a bf16/fp16 run and the kept bytes are halved. Parameter
/// gradients stay f32 (PyTorch AMP's choice), and fp32 master weights are what the optimizer
/// updates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Precision {
    /// Everything f32.
    #[default]
    Fp32,
    /// bf16 working weights and activations, fp32 masters.
    Bf16,
    /// fp16 working weights and activations, fp32 masters, dynamic loss scaling.
    Fp16,
}

impl Precision {
    /// The dtype of working weights and kept activations.
    pub fn storage(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        }
    }

    /// True for bf16 and fp16.
    pub fn is_low(self) -> bool {
        self != Precision::Fp32
    }

    /// Whether gradients need dynamic loss scaling (fp16's narrow exponent range).
    pub fn needs_loss_scaling(self) -> bool {
        self == Precision::Fp16
    }

    /// `fp32`, `bf16` or `fp16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// Round an f32 value to this format and back (what storing it costs in accuracy).
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::Fp32 => x,
            Precision::Bf16 => half::bf16::from_f32(x).to_f32(),
            Precision::Fp16 => half::f16::from_f32(x).to_f32(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_tensor::cpu::kernels::{bf16_bits_to_f32, f32_to_bf16_bits};

    /// The trainer rounds bf16 two ways (per value through `half`, in bulk through the tensor
    /// crate's bit trick); both must give the same bits, NaN aside.
    #[test]
    fn bulk_and_scalar_bf16_rounding_agree() {
        let mut s = 0x1234_5678u32;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let x = f32::from_bits(s);
            if x.is_nan() {
                continue;
            }
            let a = Precision::Bf16.round(x);
            let b = bf16_bits_to_f32(f32_to_bf16_bits(x));
            assert_eq!(a.to_bits(), b.to_bits(), "{x:e}");
        }
    }
}
