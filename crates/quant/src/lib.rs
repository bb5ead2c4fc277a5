//! # headroom-quant
//!
//! Blockwise 4-bit quantization in bitsandbytes' exact layout (NF4 and FP4, block sizes
//! 32…4096, double quantization of the absmax values), and a fused tiled dequantize-matmul for
//! frozen weights: the forward `X·Wᵀ` and the input gradient `dY·W` without ever holding more
//! than one dequantized panel per thread, and without a weight gradient.
//!
//! ```
//! use headroom_quant::{matmul_forward, MatmulOptions, QuantConfig, QuantizedTensor};
//! use headroom_tensor::Cpu;
//!
//! let cpu = Cpu::new();
//! let (out, inn) = (8, 64);
//! let w: Vec<f32> = (0..out * inn).map(|i| ((i * 37) % 17) as f32 / 8.0 - 1.0).collect();
//! let q = QuantizedTensor::quantize(&cpu, &w, &[out, inn], QuantConfig::qlora())?;
//! // 4 bits per weight, one 8-bit scale per 64 weights, one f32 per 256 scales, the code map.
//! assert!(q.bits_per_parameter() < 4.2 + 8.0 * 1024.0 / (out * inn) as f64);
//!
//! let x = vec![0.5f32; 3 * inn];
//! let mut y = vec![0f32; 3 * out];
//! matmul_forward(&cpu, &x, &q, &mut y, &MatmulOptions::default())?;
//! // Equal (within f32 rounding) to multiplying by the dequantized weight.
//! let wd = q.dequantize();
//! let y0: f32 = (0..inn).map(|k| 0.5 * wd[k]).sum();
//! assert!((y[0] - y0).abs() <= 1e-4 * y0.abs().max(1.0));
//! # Ok::<(), headroom_quant::QuantError>(())
//! ```
//!
//! ## Invariants
//! - Quantization is bitsandbytes' `quantize_4bit` on the CPU byte for byte: packed codes
//!   (first element in the high nibble), absmax values, and with `compress_statistics` the
//!   8-bit absmax codes, the offset (torch's single-threaded f32 mean, reproduced) and the
//!   second-level absmax;
//!   dequantization is bit-identical to `dequantize_4bit`. Pinned by fixtures written by
//!   bitsandbytes itself (`benches/torch/make_quant_fixture.py`).
//! - Every dequantization path (scalar reference, AVX2) gives the same bits, in f32 and in bf16
//!   (the f32 value rounded to nearest even, [`QuantizedTensor::dequantize_range_bf16`]: what a
//!   bf16 product reads, at half the bytes); the fused matmul
//!   equals dequantize-then-multiply within [`reference::f32_dot_tolerance`], forward and
//!   backward, and its result does not depend on the thread count.
//! - Packed weights are allocated through the backend as `Parameters` at their exact size;
//!   the fused matmul's only extra memory is one dequantized panel per task (`Workspace`).
//! - Malformed input (lengths, block sizes, shapes, non-finite scales, overflowing sizes,
//!   corrupt files) is a [`QuantError`], never a panic; no size read from input reaches an
//!   allocation before it is checked against the data actually present.

mod bnb_format;
mod codebook;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dequant;
mod error;
mod matmul;
pub mod reference;
mod tensor;
mod torch_sum;

pub use bnb_format::BnbEntry;
pub use codebook::{dynamic_map_signed, QuantType, FP4_CODE, FP4_DEQUANT_CODE, NF4_CODE};
pub use dequant::Isa;
pub use error::{QuantError, Result};
pub use matmul::{
    matmul_backward_input, matmul_forward, MatmulOptions, DEFAULT_PANEL_ELEMENTS, MIN_PANEL_WIDTH,
};
pub use tensor::{
    AbsmaxParts, AbsmaxStorage, BlockSize, DoubleQuant, QuantConfig, QuantParts, QuantizedTensor,
    Quantizer, NESTED_BLOCKSIZE,
};

/// torch's f32 mean as the double quantization computes its offset (exposed for the fixture
/// tests; see the crate's invariants).
#[doc(hidden)]
pub fn torch_mean_f32(x: &[f32]) -> f32 {
    torch_sum::torch_mean_f32(x)
}
