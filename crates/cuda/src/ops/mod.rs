//! The reference GPT's ops as NVRTC kernels (`headroom_kernels::TRAINER_OPS`), as methods on
//! [`Cuda`] taking [`CudaTensor`]s with the argument order and semantics of
//! headroom-trainer's CPU ops (`crates/trainer/src/ops/*.rs`): row-major f32, llm.c layouts,
//! backward passes that accumulate where the CPU's do.
//!
//! Every wrapper checks devices, dtypes and element counts first and returns the shared
//! [`headroom_tensor::Error`] before anything is allocated or launched. Every launch pushes
//! its arguments through [`OpLaunch`], which compares them with [`OP_LAUNCH_SIGNATURES`]
//! before launching; a test compares that table with the PTX of every entry point, without a
//! GPU.

mod adamw;
mod column_sum;
mod cross_entropy;
mod elementwise;
mod embedding;
mod layernorm;
mod permute;
mod rmsnorm;
mod stochastic_round;

pub use adamw::AdamWStep;
pub use permute::HeadLayout;
pub use stochastic_round::StochasticRoundingKey;

use cudarc::driver::{CudaFunction, CudaSlice, LaunchArgs, LaunchConfig, PushKernelArg};
use headroom_tensor::{DType, Error, Result, Tensor};

use crate::device::Cuda;
use crate::error::CudaError;
use crate::tensor::CudaTensor;

/// The type of one kernel parameter as a launch pushes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// A device pointer (any element type).
    Ptr,
    /// A 64-bit unsigned count or key.
    U64,
    /// A 32-bit unsigned count.
    U32,
    /// A 32-bit float.
    F32,
}

impl ParamKind {
    /// The PTX parameter type NVRTC gives this kind (`.param .u64` for pointers).
    pub fn ptx_type(self) -> &'static str {
        match self {
            ParamKind::Ptr | ParamKind::U64 => "u64",
            ParamKind::U32 => "u32",
            ParamKind::F32 => "f32",
        }
    }
}

use ParamKind::{Ptr, F32, U32, U64};

const ADAMW_SCALARS: [ParamKind; 7] = [F32; 7];

/// The parameter list of every `TRAINER_OPS` entry point, in order, as the wrappers push it.
/// `OpLaunch` refuses a launch that differs; `tests/nvrtc_trainer_ops.rs` checks each entry
/// against the compiled PTX.
pub const OP_LAUNCH_SIGNATURES: &[(&str, &[ParamKind])] = &[
    // out, tokens, wte, wpe, rows, t, c, vocab
    (
        "embedding_forward_f32",
        &[Ptr, Ptr, Ptr, Ptr, U64, U32, U32, U32],
    ),
    // out, tokens, wte, rows, c, vocab
    (
        "embedding_forward_tokens_f32",
        &[Ptr, Ptr, Ptr, U64, U32, U32],
    ),
    // dwte, dout, tokens, rows, c, vocab, vocab_per_block
    (
        "embedding_backward_wte_f32",
        &[Ptr, Ptr, Ptr, U64, U32, U32, U32],
    ),
    // dwpe, dout, rows, t, c
    ("embedding_backward_wpe_f32", &[Ptr, Ptr, U64, U32, U32]),
    // out, mean, rstd, inp, weight, bias, rows, c
    (
        "layernorm_forward_f32",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U32],
    ),
    // dinp, dout, inp, weight, mean, rstd, rows, c
    (
        "layernorm_backward_input_f32",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U32],
    ),
    // partials_w, partials_b, dout, inp, mean, rstd, rows, c, rows_per_chunk
    (
        "layernorm_backward_param_partials_f32",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U64, U32, U32],
    ),
    // partials, x, rows, cols, rows_per_chunk
    ("column_sum_partials_f32", &[Ptr, Ptr, U64, U32, U32]),
    // dst, partials, chunks, cols
    ("column_sum_finish_f32", &[Ptr, Ptr, U32, U32]),
    // out, inp, n
    ("gelu_forward_f32", &[Ptr, Ptr, U64]),
    // dinp, inp, dout, n
    ("gelu_backward_f32", &[Ptr, Ptr, Ptr, U64]),
    // out, gate, up, n
    ("geglu_forward_f32", &[Ptr, Ptr, Ptr, U64]),
    // dgate, dup, gate, up, dout, n
    ("geglu_backward_f32", &[Ptr, Ptr, Ptr, Ptr, Ptr, U64]),
    // y, x, n
    ("residual_add_f32", &[Ptr, Ptr, U64]),
    // losses, logits, targets, rows, v
    ("cross_entropy_forward_f32", &[Ptr, Ptr, Ptr, U64, U32]),
    // losses, dlogits, logits, targets, dloss, rows, v
    (
        "cross_entropy_forward_backward_f32",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, U64, U32],
    ),
    // losses, logits (overwritten by their gradient), targets, dloss, rows, v
    (
        "cross_entropy_forward_backward_in_place_f32",
        &[Ptr, Ptr, Ptr, Ptr, U64, U32],
    ),
    // losses, logits (bf16), targets, rows, v
    ("cross_entropy_forward_bf16", &[Ptr, Ptr, Ptr, U64, U32]),
    // losses, logits (bf16, overwritten by their gradient), targets, dloss, rows, v
    (
        "cross_entropy_forward_backward_in_place_bf16",
        &[Ptr, Ptr, Ptr, Ptr, U64, U32],
    ),
    // param, grad, m, v, n, then the seven step scalars
    ("adamw_f32", &concat_kinds::<12>(&[Ptr, Ptr, Ptr, Ptr, U64])),
    (
        "adamw_bf16",
        &concat_kinds::<12>(&[Ptr, Ptr, Ptr, Ptr, U64]),
    ),
    // param, grad, m, v, copy, n, then the seven step scalars
    (
        "adamw_copy_bf16_f32",
        &concat_kinds::<13>(&[Ptr, Ptr, Ptr, Ptr, Ptr, U64]),
    ),
    (
        "adamw_copy_bf16_bf16",
        &concat_kinds::<13>(&[Ptr, Ptr, Ptr, Ptr, Ptr, U64]),
    ),
    // src, dst, n, seed, step, tensor
    ("stochastic_round_f32_bf16", &[Ptr, Ptr, U64, U64, U64, U32]),
    // dst, src, batch, seq, heads, head_units, parts, part, merge
    ("permute_heads_b1", &PERMUTE_HEADS_PARAMS),
    ("permute_heads_b2", &PERMUTE_HEADS_PARAMS),
    ("permute_heads_b4", &PERMUTE_HEADS_PARAMS),
    ("permute_heads_b8", &PERMUTE_HEADS_PARAMS),
    ("permute_heads_b16", &PERMUTE_HEADS_PARAMS),
    // out, rstd, inp, weight, rows, c, eps
    ("rmsnorm_forward_f32", &[Ptr, Ptr, Ptr, Ptr, U64, U32, F32]),
    // dinp, dout, inp, weight, rstd, rows, c
    (
        "rmsnorm_backward_input_f32",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, U64, U32],
    ),
    // partials, dout, inp, rstd, rows, c, rows_per_chunk
    (
        "rmsnorm_backward_weight_partials_f32",
        &[Ptr, Ptr, Ptr, Ptr, U64, U32, U32],
    ),
    // out, gate, up, n
    ("swiglu_forward_f32", &[Ptr, Ptr, Ptr, U64]),
    // dgate, dup, gate, up, dout, n
    ("swiglu_backward_f32", &[Ptr, Ptr, Ptr, Ptr, Ptr, U64]),
    // x, cos, sin, rows, t, half, inverse
    ("rope_f32", &[Ptr, Ptr, Ptr, U64, U32, U32, U32]),
    // x, n
    ("round_bf16_f32", &[Ptr, U64]),
    ("round_f16_f32", &[Ptr, U64]),
];

/// Every `permute_heads_b<unit>` entry point takes the same parameters.
const PERMUTE_HEADS_PARAMS: [ParamKind; 9] = [Ptr, Ptr, U32, U32, U32, U32, U32, U32, U32];

/// `head` followed by AdamW's seven f32 step scalars, as an array of `N` kinds.
const fn concat_kinds<const N: usize>(head: &[ParamKind]) -> [ParamKind; N] {
    let mut out = [F32; N];
    let mut i = 0;
    while i < head.len() {
        out[i] = head[i];
        i += 1;
    }
    // The tail is already F32; this pins that the arity is what the scalars need.
    assert!(N == head.len() + ADAMW_SCALARS.len());
    out
}

/// The recorded parameter list of `function`.
fn signature(function: &str) -> Option<&'static [ParamKind]> {
    OP_LAUNCH_SIGNATURES
        .iter()
        .find(|(name, _)| *name == function)
        .map(|(_, kinds)| *kinds)
}

/// A kernel launch that records the kind of every argument it pushes and, before launching,
/// compares them with [`OP_LAUNCH_SIGNATURES`].
pub(crate) struct OpLaunch<'a> {
    function: &'static str,
    args: LaunchArgs<'a>,
    kinds: Vec<ParamKind>,
}

impl<'a> OpLaunch<'a> {
    pub(crate) fn new(cuda: &'a Cuda, function: &'static str, func: &'a CudaFunction) -> Self {
        OpLaunch {
            function,
            args: cuda.stream().launch_builder(func),
            kinds: Vec::with_capacity(16),
        }
    }

    pub(crate) fn input(&mut self, buffer: &'a CudaSlice<u8>) -> &mut Self {
        self.args.arg(buffer);
        self.kinds.push(Ptr);
        self
    }

    pub(crate) fn output(&mut self, buffer: &'a mut CudaSlice<u8>) -> &mut Self {
        self.args.arg(buffer);
        self.kinds.push(Ptr);
        self
    }

    pub(crate) fn output_f32(&mut self, buffer: &'a mut CudaSlice<f32>) -> &mut Self {
        self.args.arg(buffer);
        self.kinds.push(Ptr);
        self
    }

    pub(crate) fn input_f32(&mut self, buffer: &'a CudaSlice<f32>) -> &mut Self {
        self.args.arg(buffer);
        self.kinds.push(Ptr);
        self
    }

    pub(crate) fn u64(&mut self, value: &'a u64) -> &mut Self {
        self.args.arg(value);
        self.kinds.push(U64);
        self
    }

    pub(crate) fn u32(&mut self, value: &'a u32) -> &mut Self {
        self.args.arg(value);
        self.kinds.push(U32);
        self
    }

    pub(crate) fn f32(&mut self, value: &'a f32) -> &mut Self {
        self.args.arg(value);
        self.kinds.push(F32);
        self
    }

    /// Launch, after checking the pushed argument kinds against the recorded signature.
    ///
    /// # Safety
    /// Every pointer argument must hold as many elements of the kernel's type as the kernel
    /// reads or writes for the count arguments pushed (the wrappers check element counts and
    /// dtypes before they get here), and output buffers must not alias inputs.
    pub(crate) unsafe fn launch(
        mut self,
        cuda: &Cuda,
        op: &'static str,
        cfg: LaunchConfig,
    ) -> Result<()> {
        match signature(self.function) {
            Some(want) if want == self.kinds.as_slice() => {}
            _ => {
                return Err(cuda.fail(op)(CudaError::LaunchSignature {
                    function: self.function,
                    pushed: format!("{:?}", self.kinds),
                }))
            }
        }
        // SAFETY: the caller upholds the buffer contract; the argument kinds match the kernel's
        // parameter list (checked just above against the table the PTX is tested against).
        unsafe { self.args.launch(cfg) }.map_err(cuda.driver_fail(op))?;
        Ok(())
    }
}

/// Grid-stride elementwise work and per-row blocks never need more blocks than this; more rows
/// or elements loop inside the kernel.
pub(crate) const MAX_ROW_BLOCKS: u64 = 1 << 16;

/// One block of `BLOCK_THREADS` per row (up to [`MAX_ROW_BLOCKS`]; blocks stride over rows).
pub(crate) fn row_config(rows: u64) -> LaunchConfig {
    let blocks = rows.clamp(1, MAX_ROW_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (headroom_kernels::BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A 2-D grid of `(x, ceil(cols / BLOCK_THREADS))` blocks of `BLOCK_THREADS`.
pub(crate) fn column_grid(x: u32, cols: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x, cols.div_ceil(headroom_kernels::BLOCK_THREADS), 1),
        block_dim: (headroom_kernels::BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

// ------------------------------------------------------------------------------------------
// Argument checks, generic over `Tensor` so they are unit-tested on CPU tensors.

/// `t` has dtype `want`.
pub(crate) fn expect_dtype(op: &'static str, t: &impl Tensor, want: DType) -> Result<()> {
    if t.dtype() != want {
        return Err(Error::DTypeMismatch {
            op,
            expected: want,
            got: t.dtype(),
        });
    }
    Ok(())
}

/// `t` holds exactly `want` elements.
pub(crate) fn expect_numel(op: &'static str, t: &impl Tensor, want: usize) -> Result<()> {
    Error::check_len(op, want, t.numel())
}

/// `t` is f32 with exactly `want` elements.
pub(crate) fn expect_f32(op: &'static str, t: &impl Tensor, want: usize) -> Result<()> {
    expect_dtype(op, t, DType::F32)?;
    expect_numel(op, t, want)
}

/// A dimension argument that must be positive and fit the kernels' 32-bit parameters.
pub(crate) fn dim_u32(
    op: &'static str,
    t: &impl Tensor,
    what: &'static str,
    value: usize,
) -> Result<u32> {
    match u32::try_from(value) {
        Ok(v) if v > 0 => Ok(v),
        _ => Err(Error::InvalidShape {
            op,
            shape: t.shape().clone(),
            reason: what,
        }),
    }
}

/// `total / per` when `per` divides `total` exactly.
pub(crate) fn rows_of(
    op: &'static str,
    t: &impl Tensor,
    per: usize,
    what: &'static str,
) -> Result<usize> {
    let total = t.numel();
    if per == 0 || !total.is_multiple_of(per) {
        return Err(Error::InvalidShape {
            op,
            shape: t.shape().clone(),
            reason: what,
        });
    }
    Ok(total / per)
}

impl Cuda {
    /// The device buffer of a tensor the checks proved non-empty.
    pub(crate) fn buffer<'t>(
        &self,
        op: &'static str,
        t: &'t CudaTensor,
    ) -> Result<&'t CudaSlice<u8>> {
        t.data.as_ref().ok_or_else(|| empty_tensor(op, t))
    }

    /// The device buffer of a tensor the checks proved non-empty, mutably.
    pub(crate) fn buffer_mut<'t>(
        &self,
        op: &'static str,
        t: &'t mut CudaTensor,
    ) -> Result<&'t mut CudaSlice<u8>> {
        let shape = t.shape.clone();
        t.data.as_mut().ok_or_else(|| Error::InvalidShape {
            op,
            shape,
            reason: EMPTY,
        })
    }

    /// The loaded entry point `function`, as the shared error of `op`.
    pub(crate) fn op_function(
        &self,
        op: &'static str,
        function: &'static str,
    ) -> Result<CudaFunction> {
        self.function(function).map_err(self.fail(op))
    }

    /// Device checks for every tensor of an op, before anything else.
    pub(crate) fn check_devices(&self, op: &'static str, tensors: &[&CudaTensor]) -> Result<()> {
        tensors.iter().try_for_each(|t| self.check_device(op, t))
    }
}

const EMPTY: &str = "the tensor is empty where the operation needs data";

fn empty_tensor(op: &'static str, t: &CudaTensor) -> Error {
    Error::InvalidShape {
        op,
        shape: t.shape().clone(),
        reason: EMPTY,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_tensor::{Backend, Cpu};

    #[test]
    fn every_trainer_op_entry_point_has_exactly_one_signature() {
        let mut names: Vec<&str> = OP_LAUNCH_SIGNATURES.iter().map(|(n, _)| *n).collect();
        names.sort();
        let before = names.len();
        names.dedup();
        assert_eq!(names.len(), before, "a function is listed twice");
        let mut registered: Vec<&str> = headroom_kernels::TRAINER_OPS
            .iter()
            .flat_map(|k| k.functions.iter().copied())
            .collect();
        registered.sort();
        assert_eq!(names, registered);
        assert_eq!(signature("adamw_copy_bf16_bf16").map(|s| s.len()), Some(13));
        assert_eq!(signature("adamw_f32").map(|s| s[4]), Some(U64));
        assert!(signature("cast_f32_bf16").is_none());
    }

    #[test]
    fn checks_report_the_offending_argument() {
        let cpu = Cpu::new();
        let t = cpu.zeros([6], DType::F32).unwrap();
        assert!(expect_f32("op", &t, 6).is_ok());
        assert!(matches!(
            expect_f32("op", &t, 5),
            Err(Error::LengthMismatch {
                expected: 5,
                got: 6,
                ..
            })
        ));
        assert!(matches!(
            expect_dtype("op", &t, DType::BF16),
            Err(Error::DTypeMismatch {
                expected: DType::BF16,
                got: DType::F32,
                ..
            })
        ));
        assert_eq!(
            rows_of("op", &t, 3, "the element count is not a multiple of c").unwrap(),
            2
        );
        assert!(matches!(
            rows_of("op", &t, 4, "the element count is not a multiple of c"),
            Err(Error::InvalidShape { .. })
        ));
        assert!(matches!(
            rows_of("op", &t, 0, "the element count is not a multiple of c"),
            Err(Error::InvalidShape { .. })
        ));
        assert_eq!(
            dim_u32("op", &t, "c must be in 1..=u32::MAX", 7).unwrap(),
            7
        );
        assert!(dim_u32("op", &t, "c must be in 1..=u32::MAX", 0).is_err());
        assert!(dim_u32("op", &t, "c must be in 1..=u32::MAX", 1 << 33).is_err());
    }

    #[test]
    fn launch_configs_cover_every_row_and_column() {
        let cfg = row_config(0);
        assert_eq!(cfg.grid_dim.0, 1);
        assert_eq!(row_config(5).grid_dim.0, 5);
        assert_eq!(row_config(1 << 40).grid_dim.0 as u64, MAX_ROW_BLOCKS);
        let g = column_grid(3, 769);
        assert_eq!(g.grid_dim, (3, 4, 1));
        assert_eq!(g.block_dim.0, headroom_kernels::BLOCK_THREADS);
    }
}
