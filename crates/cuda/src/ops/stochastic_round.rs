//! f32 → bf16 stochastic rounding on the device, bit for bit headroom-amp's
//! `stochastic_rounding.rs` (the same counter hash, so a tensor rounds identically on either).

use headroom_tensor::{DType, Result, Tensor};

use super::{expect_dtype, expect_numel, OpLaunch};
use crate::device::Cuda;
use crate::tensor::CudaTensor;

/// The coordinates that fix the random bits of one rounding of one tensor — the fields of
/// `headroom_amp::RoundingKey` (this crate does not depend on headroom-amp).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StochasticRoundingKey {
    /// The run's seed.
    pub seed: u64,
    /// The optimizer step (or any per-rounding counter).
    pub step: u64,
    /// Which tensor of the model.
    pub tensor: u32,
}

impl Cuda {
    /// `dst = stochastic_round(src)`: f32 `src`, bf16 `dst`, equal element counts. Element `i`
    /// rounds up with probability equal to its fraction of the bf16 gap, using the random bits
    /// `headroom_amp::random_bits(key, i)`; NaN stays NaN, ±∞ stays ±∞.
    pub fn stochastic_round_bf16(
        &self,
        src: &CudaTensor,
        dst: &mut CudaTensor,
        key: StochasticRoundingKey,
    ) -> Result<()> {
        const OP: &str = "stochastic_round_bf16";
        self.check_devices(OP, &[src, dst])?;
        let n = src.numel();
        expect_dtype(OP, src, DType::F32)?;
        expect_dtype(OP, dst, DType::BF16)?;
        expect_numel(OP, dst, n)?;
        if n == 0 {
            return Ok(());
        }
        let func = self.op_function(OP, "stochastic_round_f32_bf16")?;
        let n64 = n as u64;
        let src_b = self.buffer(OP, src)?;
        let dst_b = self.buffer_mut(OP, dst)?;
        let mut launch = OpLaunch::new(self, "stochastic_round_f32_bf16", &func);
        launch
            .input(src_b)
            .output(dst_b)
            .u64(&n64)
            .u64(&key.seed)
            .u64(&key.step)
            .u32(&key.tensor);
        // SAFETY: src holds n f32 and dst n bf16 (checked); they do not alias.
        unsafe { launch.launch(self, OP, self.elementwise_config(n)) }
    }
}
