//! # headroom-kernels
//!
//! headroom's CUDA kernels as CUDA C source text, compiled at run time by NVRTC (see
//! `headroom-cuda`). Nothing here needs CUDA to build: a source is a `&'static str`.
//!
//! ```
//! use headroom_kernels::{find, ALL, CAST};
//!
//! // Every kernel module is listed once, with its entry points.
//! assert!(ALL.iter().any(|k| k.name == CAST.name));
//! let module = find("cast_f32_bf16").expect("a registered entry point");
//! assert_eq!(module.name, "cast");
//! // The source is self-contained: the shared bit-conversion prelude comes first.
//! assert!(module.source.starts_with(headroom_kernels::FLOAT_BITS_PRELUDE));
//! assert!(module.source.contains("cast_f32_bf16"));
//! ```
//!
//! ## Invariants
//! - This crate depends on nothing, not even `headroom-tensor`; it is text and constants.
//! - Every [`KernelSource::source`] compiles alone: it includes no toolkit header (the NVRTC that
//!   CI installs from PyPI ships none), only the [`FLOAT_BITS_PRELUDE`] prepended to it (and,
//!   for the [`ATTENTION`] modules, the tensor-core helpers of `cu/flash_attn_common.cuh`; for
//!   the [`TRAINER_OPS`] modules, the block reductions of [`BLOCK_REDUCE_PRELUDE`]).
//! - Every entry point is `extern "C"` (unmangled) and listed in exactly one
//!   [`KernelSource::functions`]; the NVRTC tests (`headroom-cuda`'s for [`ALL`] and
//!   [`TRAINER_OPS`], `headroom-attn`'s under its `cuda` feature for [`ATTENTION`]) check the
//!   PTX has exactly the listed entries. `headroom-cuda` also runs the [`TRAINER_OPS`] sources
//!   on the host under a small CUDA emulation (`tests/trainer_ops_emulator.rs`).
//! - The flash attention launch constants here ([`FLASH_THREADS`], tile sizes, shared memory)
//!   equal the sources' `#define`s (tested), so host and kernel agree on every tile.
//! - The flash attention kernels' own source also runs on the CPU: `tests/flash_emulator.rs`
//!   compiles it with a C++20 compiler against `emu/host_emulator.h` (threads, barriers,
//!   `mma.sync`/`ldmatrix`/`cp.async` from their PTX definitions) and checks forward and
//!   backward against a double-precision reference — the GPU-free evidence the kernels compute
//!   attention.
//! - f16/bf16 conversions are bit operations, bit-identical to the `half` crate and to
//!   `headroom_tensor::cpu::kernels` (round-to-nearest-even, NaN stays NaN).
//! - Elementwise kernels are grid-stride loops: any element count (0 included) and any grid size
//!   give the same result. Reductions are deterministic: fixed grid, fixed-order combination.
//!   No kernel uses floating-point atomics (gradient scatters are owner-computes).

/// Threads per block for every kernel in this crate but the flash attention tiles (those use
/// [`FLASH_THREADS`]); the `HR_BLOCK_THREADS` of the sources.
/// The sum-of-squares reductions require exactly this block size.
pub const BLOCK_THREADS: u32 = 256;

/// Blocks of the first sum-of-squares pass, and so the number of f64 partials the host
/// allocates. Fixed — never derived from the device — because it defines the summation order:
/// the same input gives the same bits on any GPU.
pub const SUM_SQUARES_BLOCKS: u32 = 1024;

/// Bit-exact f32⇄f16⇄bf16 conversions, loads/stores per storage type and the grid-stride loop
/// macro, prepended to every kernel source.
pub const FLOAT_BITS_PRELUDE: &str = include_str!("../cu/float_bits.cuh");

/// One NVRTC compilation unit: a name (used in cache keys and error messages), its full
/// source, and its `extern "C"` entry points.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelSource {
    /// Short module name, e.g. `"cast"`.
    pub name: &'static str,
    /// Complete CUDA C source: [`FLOAT_BITS_PRELUDE`] followed by the module's own file.
    pub source: &'static str,
    /// Every `extern "C" __global__` function the module defines.
    pub functions: &'static [&'static str],
}

// `concat!` needs literals; `include_str!` expands to one, so the prelude and each module become a
// single `&'static str` at compile time with no run-time concatenation.
macro_rules! kernel_source {
    ($name:literal, $file:literal, [$($f:literal),* $(,)?]) => {
        KernelSource {
            name: $name,
            source: concat!(include_str!("../cu/float_bits.cuh"), "\n", include_str!($file)),
            functions: &[$($f),*],
        }
    };
}

/// Casts between f32, f16 and bf16, all six directions: `cast_<src>_<dst>(src, dst, n)`.
pub const CAST: KernelSource = kernel_source!(
    "cast",
    "../cu/cast.cu",
    [
        "cast_f32_f16",
        "cast_f32_bf16",
        "cast_f16_f32",
        "cast_bf16_f32",
        "cast_f16_bf16",
        "cast_bf16_f16",
    ]
);

/// In-place `x *= alpha`: `scale_<t>(x, alpha, n)`.
pub const SCALE: KernelSource = kernel_source!(
    "scale",
    "../cu/scale.cu",
    ["scale_f32", "scale_f16", "scale_bf16"]
);

/// `y += alpha * x` (no FMA), x in any float type, y f32: `axpy_<t>(alpha, x, y, n)`.
pub const AXPY: KernelSource = kernel_source!(
    "axpy",
    "../cu/axpy.cu",
    ["axpy_f32", "axpy_f16", "axpy_bf16"]
);

/// Deterministic `Σ x²` in f64: `sum_squares_partials_<t>(x, n, partials)` on exactly
/// [`SUM_SQUARES_BLOCKS`] × [`BLOCK_THREADS`], then `sum_squares_finish(partials, count, out)`
/// on one block of [`BLOCK_THREADS`].
pub const SUM_SQUARES: KernelSource = kernel_source!(
    "sum_squares",
    "../cu/sum_squares.cu",
    [
        "sum_squares_partials_f32",
        "sum_squares_partials_f16",
        "sum_squares_partials_bf16",
        "sum_squares_finish",
    ]
);

/// In-place `x *= inv_scale` that sets a device `int` flag to 1 if any input element was
/// infinite or NaN: `unscale_check_<t>(x, inv_scale, n, found)`.
pub const UNSCALE: KernelSource = kernel_source!(
    "unscale",
    "../cu/unscale.cu",
    [
        "unscale_check_f32",
        "unscale_check_f16",
        "unscale_check_bf16"
    ]
);

/// Every module of `headroom-cuda`'s own `Backend`
/// primitives, each compiled as one NVRTC program. `headroom-cuda` pins the launch signature of
/// each of these in its tests; technique crates' modules are listed apart ([`ATTENTION`]) so
/// that adding one never touches those tests. [`find`] searches every list.
pub const ALL: &[KernelSource] = &[CAST, SCALE, AXPY, SUM_SQUARES, UNSCALE];

// The trainer-op modules carry one more prelude: fixed-order block reductions and the bit-exact
// exp/tanh ports of headroom-trainer's fast_math.
macro_rules! trainer_op_source {
    ($name:literal, $file:literal, [$($f:literal),* $(,)?]) => {
        KernelSource {
            name: $name,
            source: concat!(
                include_str!("../cu/float_bits.cuh"),
                "\n",
                include_str!("../cu/block_reduce.cuh"),
                "\n",
                include_str!($file)
            ),
            functions: &[$($f),*],
        }
    };
}

/// Fixed-order block reductions and the exp/tanh ports, prepended (after
/// [`FLOAT_BITS_PRELUDE`]) to every [`TRAINER_OPS`] module.
pub const BLOCK_REDUCE_PRELUDE: &str = include_str!("../cu/block_reduce.cuh");

/// Token + position embeddings: `embedding_forward_f32(out, tokens, wte, wpe, rows, t, c,
/// vocab)` (grid-stride), the token embedding alone `embedding_forward_tokens_f32(out, tokens,
/// wte, rows, c, vocab)` (grid-stride), `embedding_backward_wte_f32(dwte, dout, tokens, rows, c, vocab,
/// vocab_per_block)` on a grid of (vocabulary blocks, channel blocks) and
/// `embedding_backward_wpe_f32(dwpe, dout, rows, t, c)` (grid-stride). The backward is
/// deterministic without atomics (each gradient element has one owning thread).
pub const EMBEDDING: KernelSource = trainer_op_source!(
    "embedding",
    "../cu/embedding.cu",
    [
        "embedding_forward_f32",
        "embedding_forward_tokens_f32",
        "embedding_backward_wte_f32",
        "embedding_backward_wpe_f32",
    ]
);

/// Layer norm, one block per row: `layernorm_forward_f32(out, mean, rstd, inp, weight, bias,
/// rows, c)`, `layernorm_backward_input_f32(dinp, dout, inp, weight, mean, rstd, rows, c)` and
/// `layernorm_backward_param_partials_f32(partials_w, partials_b, dout, inp, mean, rstd, rows,
/// c, rows_per_chunk)` (finished by `column_sum_finish_f32`).
pub const LAYERNORM: KernelSource = trainer_op_source!(
    "layernorm",
    "../cu/layernorm.cu",
    [
        "layernorm_forward_f32",
        "layernorm_backward_input_f32",
        "layernorm_backward_param_partials_f32",
    ]
);

/// Deterministic column sums (bias gradients): `column_sum_partials_f32(partials, x, rows, cols,
/// rows_per_chunk)` then `column_sum_finish_f32(dst, partials, chunks, cols)`.
pub const COLUMN_SUM: KernelSource = trainer_op_source!(
    "column_sum",
    "../cu/column_sum.cu",
    ["column_sum_partials_f32", "column_sum_finish_f32"]
);

/// Tanh-GELU, GeGLU's gate and the residual add, grid-stride: `gelu_forward_f32(out, inp, n)`,
/// `gelu_backward_f32(dinp, inp, dout, n)` (accumulates), `geglu_forward_f32(out, gate, up,
/// n)`, `geglu_backward_f32(dgate, dup, gate, up, dout, n)` (accumulates),
/// `residual_add_f32(y, x, n)`.
pub const GELU: KernelSource = trainer_op_source!(
    "gelu",
    "../cu/gelu.cu",
    [
        "gelu_forward_f32",
        "gelu_backward_f32",
        "geglu_forward_f32",
        "geglu_backward_f32",
        "residual_add_f32",
    ]
);

/// Fused softmax cross-entropy, one block per row: `cross_entropy_forward_f32(losses, logits,
/// targets, rows, v)`, `cross_entropy_forward_backward_f32(losses, dlogits, logits, targets,
/// dloss, rows, v)` and `cross_entropy_forward_backward_in_place_f32(losses, logits, targets,
/// dloss, rows, v)`, which overwrites the logits with their gradient; and on bf16 logits
/// `cross_entropy_forward_bf16` and `cross_entropy_forward_backward_in_place_bf16` (same
/// arguments; the gradient written in bf16).
pub const CROSS_ENTROPY: KernelSource = trainer_op_source!(
    "cross_entropy",
    "../cu/cross_entropy.cu",
    [
        "cross_entropy_forward_f32",
        "cross_entropy_forward_backward_f32",
        "cross_entropy_forward_backward_in_place_f32",
        "cross_entropy_forward_bf16",
        "cross_entropy_forward_backward_in_place_bf16",
    ]
);

/// AdamW, grid-stride, f32 parameters and moments: `adamw_<grad>(param, grad, m, v, n, decay,
/// one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps)` and
/// `adamw_copy_bf16_<grad>(param, grad, m, v, copy, n, …)` which also writes a bf16 copy.
pub const ADAMW: KernelSource = trainer_op_source!(
    "adamw",
    "../cu/adamw.cu",
    [
        "adamw_f32",
        "adamw_bf16",
        "adamw_copy_bf16_f32",
        "adamw_copy_bf16_bf16",
    ]
);

/// f32 → bf16 stochastic rounding, headroom-amp's counter hash:
/// `stochastic_round_f32_bf16(src, dst, n, seed, step, tensor)`, grid-stride.
pub const STOCHASTIC_ROUND: KernelSource = trainer_op_source!(
    "stochastic_round",
    "../cu/stochastic_round.cu",
    ["stochastic_round_f32_bf16"]
);

/// RMSNorm, one block per row, f64 row sums: `rmsnorm_forward_f32(out, rstd, inp, weight,
/// rows, c, eps)`, `rmsnorm_backward_input_f32(dinp, dout, inp, weight, rstd, rows, c)` and
/// `rmsnorm_backward_weight_partials_f32(partials, dout, inp, rstd, rows, c, rows_per_chunk)`
/// (finished by `column_sum_finish_f32`).
pub const RMSNORM: KernelSource = trainer_op_source!(
    "rmsnorm",
    "../cu/rmsnorm.cu",
    [
        "rmsnorm_forward_f32",
        "rmsnorm_backward_input_f32",
        "rmsnorm_backward_weight_partials_f32",
    ]
);

/// SwiGLU's gate, grid-stride: `swiglu_forward_f32(out, gate, up, n)` and
/// `swiglu_backward_f32(dgate, dup, gate, up, dout, n)` (accumulates).
pub const SWIGLU: KernelSource = trainer_op_source!(
    "swiglu",
    "../cu/swiglu.cu",
    ["swiglu_forward_f32", "swiglu_backward_f32"]
);

/// Rotary position embedding in place (rotate-half layout, host-computed tables),
/// grid-stride: `rope_f32(x, cos, sin, rows, t, half, inverse)`.
pub const ROPE: KernelSource = trainer_op_source!("rope", "../cu/rope.cu", ["rope_f32"]);

/// f32 rounded in place to bf16 or f16 and back, grid-stride: `round_bf16_f32(x, n)`,
/// `round_f16_f32(x, n)`.
pub const ROUND: KernelSource = trainer_op_source!(
    "round",
    "../cu/round.cu",
    ["round_bf16_f32", "round_f16_f32"]
);

/// Attention heads between a linear layer's `[B, T, parts·NH·hs]` rows and flash attention's
/// `[B, NH, T, hs]`, either way: `permute_heads_b<unit>(dst, src, batch, seq, heads,
/// head_units, parts, part, merge)` moves opaque units of 1, 2, 4, 8 or 16 bytes (the host picks
/// the widest that divides a head row), rows grid-stride, any grid.
pub const PERMUTE_HEADS: KernelSource = trainer_op_source!(
    "permute_heads",
    "../cu/permute_heads.cu",
    [
        "permute_heads_b1",
        "permute_heads_b2",
        "permute_heads_b4",
        "permute_heads_b8",
        "permute_heads_b16",
    ]
);

/// Unit sizes of the [`PERMUTE_HEADS`] entry points, widest first, with their names.
pub const PERMUTE_HEADS_UNITS: &[(usize, &str)] = &[
    (16, "permute_heads_b16"),
    (8, "permute_heads_b8"),
    (4, "permute_heads_b4"),
    (2, "permute_heads_b2"),
    (1, "permute_heads_b1"),
];

/// The trainer's ops (used by `headroom-cuda`'s op wrappers), listed apart from [`ALL`] so the
/// backend primitives' tests stay as they are. [`find`] searches every list.
pub const TRAINER_OPS: &[KernelSource] = &[
    EMBEDDING,
    LAYERNORM,
    COLUMN_SUM,
    GELU,
    CROSS_ENTROPY,
    ADAMW,
    STOCHASTIC_ROUND,
    PERMUTE_HEADS,
    RMSNORM,
    SWIGLU,
    ROPE,
    ROUND,
];

/// Threads per block of every flash attention kernel but `flash_attn_bwd_dot_*` (which uses
/// [`BLOCK_THREADS`]): [`FLASH_WARPS`] warps.
pub const FLASH_THREADS: u32 = FLASH_WARPS * 32;
/// Warps per flash attention block; each owns 16 rows of the block's tile.
pub const FLASH_WARPS: u32 = 4;
/// Padding, in 16-bit elements, after every row of a flash kernel's shared-memory tiles.
pub const FLASH_SMEM_PAD: u32 = 8;
/// Query rows per block of `flash_attn_fwd_*`.
pub const FLASH_FWD_BLOCK_Q: u32 = FLASH_WARPS * 16;
/// Key rows per step of `flash_attn_fwd_*`.
pub const FLASH_FWD_BLOCK_K: u32 = 64;
/// Query rows per block of `flash_attn_bwd_dq_*`.
pub const FLASH_DQ_BLOCK_Q: u32 = FLASH_WARPS * 16;
/// Key rows per step of `flash_attn_bwd_dq_*`.
pub const FLASH_DQ_BLOCK_K: u32 = 64;
/// Key/value tiles in flight per `flash_attn_bwd_dq_*` block (double buffering).
pub const FLASH_DQ_KV_STAGES: u32 = 2;
/// Query tiles in flight per `flash_attn_bwd_dkdv_*` block (double buffering).
pub const FLASH_DKDV_Q_STAGES: u32 = 2;
/// Key rows per block of `flash_attn_bwd_dkdv_*`.
pub const FLASH_DKDV_BLOCK_K: u32 = FLASH_WARPS * 16;
/// Head dimensions the flash kernels are instantiated for.
pub const FLASH_HEAD_DIMS: &[u32] = &[64, 128];

/// Query rows per step of `flash_attn_bwd_dkdv_*_d<head_dim>` (the source's
/// `HR_FLASH_DKDV_BLOCK_Q_D<head_dim>`; the same for both head dims since an H200 sweep timed
/// 64 rows ahead of 32 at head dim 128).
pub const fn flash_dkdv_block_q(_head_dim: u32) -> u32 {
    64
}

/// Bytes of one padded shared-memory tile of `rows` rows of `head_dim` 16-bit values.
const fn flash_tile_bytes(rows: u32, head_dim: u32) -> u32 {
    rows * (head_dim + FLASH_SMEM_PAD) * 2
}

/// Dynamic shared memory of `flash_attn_fwd_*_d<head_dim>`: Q, K and V tiles.
pub const fn flash_fwd_smem_bytes(head_dim: u32) -> u32 {
    flash_tile_bytes(FLASH_FWD_BLOCK_Q + 2 * FLASH_FWD_BLOCK_K, head_dim)
}

/// Dynamic shared memory of `flash_attn_bwd_dq_*_d<head_dim>`: Q and dO tiles, then
/// [`FLASH_DQ_KV_STAGES`] stages of K and V tiles.
pub const fn flash_dq_smem_bytes(head_dim: u32) -> u32 {
    flash_tile_bytes(
        2 * FLASH_DQ_BLOCK_Q + FLASH_DQ_KV_STAGES * 2 * FLASH_DQ_BLOCK_K,
        head_dim,
    )
}

/// Dynamic shared memory of `flash_attn_bwd_dkdv_*_d<head_dim>`: K and V tiles, then
/// [`FLASH_DKDV_Q_STAGES`] stages of Q and dO tiles, then as many of the query tile's
/// logsumexp and `dot` rows (f32).
pub const fn flash_dkdv_smem_bytes(head_dim: u32) -> u32 {
    let block_q = flash_dkdv_block_q(head_dim);
    flash_tile_bytes(
        2 * FLASH_DKDV_BLOCK_K + FLASH_DKDV_Q_STAGES * 2 * block_q,
        head_dim,
    ) + FLASH_DKDV_Q_STAGES * 2 * block_q * 4
}

// The attention modules carry one more prelude, the tensor-core helpers both share.
macro_rules! attention_source {
    ($name:literal, $file:literal, [$($f:literal),* $(,)?]) => {
        KernelSource {
            name: $name,
            source: concat!(
                include_str!("../cu/float_bits.cuh"),
                "\n",
                include_str!("../cu/flash_attn_common.cuh"),
                "\n",
                include_str!($file)
            ),
            functions: &[$($f),*],
        }
    };
}

/// FlashAttention-2 forward on tensor cores (sm_80+), 16-bit inputs, f32 accumulation:
/// `flash_attn_fwd_<bf16|f16>_d<64|128>(q, k, v, out, lse, q_len, kv_len, q_heads, kv_heads,
/// scale_log2, causal)`. Launch configuration in the source's header comment.
pub const FLASH_ATTN_FWD: KernelSource = attention_source!(
    "flash_attn_fwd",
    "../cu/flash_attn_fwd.cu",
    [
        "flash_attn_fwd_bf16_d64",
        "flash_attn_fwd_bf16_d128",
        "flash_attn_fwd_f16_d64",
        "flash_attn_fwd_f16_d128",
    ]
);

/// FlashAttention-2 backward: `flash_attn_bwd_dot_<t>` (rowsum(dO∘O)), then
/// `flash_attn_bwd_dq_<t>_d<D>` and `flash_attn_bwd_dkdv_<t>_d<D>`, deterministic (no atomics).
/// Launch configurations in the source's header comment.
pub const FLASH_ATTN_BWD: KernelSource = attention_source!(
    "flash_attn_bwd",
    "../cu/flash_attn_bwd.cu",
    [
        "flash_attn_bwd_dot_bf16",
        "flash_attn_bwd_dot_f16",
        "flash_attn_bwd_dq_bf16_d64",
        "flash_attn_bwd_dq_bf16_d128",
        "flash_attn_bwd_dq_f16_d64",
        "flash_attn_bwd_dq_f16_d128",
        "flash_attn_bwd_dkdv_bf16_d64",
        "flash_attn_bwd_dkdv_bf16_d128",
        "flash_attn_bwd_dkdv_f16_d64",
        "flash_attn_bwd_dkdv_f16_d128",
    ]
);

/// The attention modules (used by `headroom-attn`'s `cuda` feature). They need sm_80 or newer
/// (`mma.sync` on 16-bit inputs, `ldmatrix`, `cp.async`).
pub const ATTENTION: &[KernelSource] = &[FLASH_ATTN_FWD, FLASH_ATTN_BWD];

/// headroom-quant's blockwise 4-bit weights (bitsandbytes' layout): the double-quantized
/// absmax `quant4_absmax_dq_f32(qabsmax, code2, absmax2, offset, blocks, absmax)`, a weight tile
/// in f32 `quant4_dequant_tile_f32(codes, absmax, table, row0, rows, cols, col0, width,
/// blocksize, out)` and `quant4_scatter_cols_f32(src, n, width, dst, ld, col0)`; grid-stride,
/// [`BLOCK_THREADS`] threads.
pub const QUANT4: KernelSource = kernel_source!(
    "quant4",
    "../cu/quant4.cu",
    [
        "quant4_absmax_dq_f32",
        "quant4_dequant_tile_f32",
        "quant4_scatter_cols_f32",
    ]
);

/// The quantization modules (used by headroom-quant's `cuda` feature), listed apart so adding
/// one never touches the other lists' tests. [`find`] searches every list.
pub const QUANT: &[KernelSource] = &[QUANT4];

/// Every registered module: [`ALL`], then [`ATTENTION`], then [`TRAINER_OPS`], then [`QUANT`].
pub fn modules() -> impl Iterator<Item = &'static KernelSource> {
    ALL.iter()
        .chain(ATTENTION.iter())
        .chain(TRAINER_OPS.iter())
        .chain(QUANT.iter())
}

/// The module that defines the entry point `function`, if any, in any list.
pub fn find(function: &str) -> Option<&'static KernelSource> {
    modules().find(|k| k.functions.contains(&function))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Names as written in a macro invocation `HR_..._KERNEL(name, ...)` or a plain
    /// `extern "C" __global__ void name(`: every identifier that follows one of those.
    fn declared_entry_points(source: &str) -> Vec<String> {
        let mut names = Vec::new();
        for line in source.lines() {
            let line = line.trim_start();
            let rest = if line.starts_with("HR_") && line.contains("_KERNEL(") {
                line.split_once("_KERNEL(").map(|(_, r)| r)
            } else if line.starts_with("extern \"C\" __global__ void ") && !line.contains("NAME") {
                line.strip_prefix("extern \"C\" __global__ void ")
            } else {
                None
            };
            if let Some(rest) = rest {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                // Skip the macro definitions themselves (`#define HR_CAST_KERNEL(NAME, ...`).
                if name != "NAME" && !name.is_empty() {
                    names.push(name);
                }
            }
        }
        names
    }

    #[test]
    fn registry_matches_the_sources_exactly() {
        for k in modules() {
            let mut declared = declared_entry_points(k.source);
            let mut listed: Vec<String> = k.functions.iter().map(|s| s.to_string()).collect();
            declared.sort();
            listed.sort();
            assert_eq!(declared, listed, "module {}", k.name);
        }
    }

    #[test]
    fn names_are_unique_and_findable() {
        let mut modules = HashSet::new();
        let mut functions = HashSet::new();
        for k in super::modules() {
            assert!(modules.insert(k.name), "duplicate module {}", k.name);
            for f in k.functions {
                assert!(functions.insert(*f), "duplicate entry point {f}");
                assert_eq!(find(f).map(|m| m.name), Some(k.name));
            }
        }
        assert!(find("no_such_kernel").is_none());
        // 6 casts + 3 scales + 3 axpys + 4 sum-of-squares + 3 unscales, then 4 flash forwards
        // and 2 dot + 8 dQ/dK/dV flash backwards, then the trainer ops: 3 embedding,
        // 3 layer norm, 2 column sum, 5 GELU/GeGLU/residual, 5 cross-entropy (3 f32, 2 on
        // bf16 logits), 4 AdamW, 1 rounding,
        // 5 head permutes, then the Llama ops: 1 token embedding, 3 RMSNorm, 2 SwiGLU,
        // 1 rotary embedding, 2 in-place roundings.
        // Then 3 quant4 kernels (headroom-quant).
        assert_eq!(functions.len(), 19 + 4 + 10 + 28 + 9 + 3);
        assert_eq!(find("flash_attn_bwd_dkdv_bf16_d128"), Some(&FLASH_ATTN_BWD));
        assert!(ALL.iter().all(|k| !ATTENTION.contains(k)));
        assert!(TRAINER_OPS
            .iter()
            .all(|k| !ALL.contains(k) && !ATTENTION.contains(k)));
        assert_eq!(find("adamw_copy_bf16_bf16"), Some(&ADAMW));
    }

    #[test]
    fn permute_units_name_every_entry_point_once_widest_first() {
        let names: Vec<&str> = PERMUTE_HEADS_UNITS.iter().map(|(_, n)| *n).collect();
        let mut listed = PERMUTE_HEADS.functions.to_vec();
        let mut sorted = names.clone();
        listed.sort();
        sorted.sort();
        assert_eq!(sorted, listed);
        for pair in PERMUTE_HEADS_UNITS.windows(2) {
            assert!(pair[0].0 > pair[1].0, "{pair:?}");
        }
        for (bytes, name) in PERMUTE_HEADS_UNITS {
            assert_eq!(*name, format!("permute_heads_b{bytes}"));
            assert!(bytes.is_power_of_two());
        }
        // A 1-byte unit exists, so every head row has a unit that divides it.
        assert_eq!(PERMUTE_HEADS_UNITS.last().map(|u| u.0), Some(1));
    }

    #[test]
    fn sources_are_self_contained() {
        for k in modules() {
            assert!(k.source.starts_with(FLOAT_BITS_PRELUDE), "{}", k.name);
            assert!(
                !k.source
                    .lines()
                    .any(|l| l.trim_start().starts_with("#include")),
                "{} includes a header; the CI NVRTC ships none",
                k.name
            );
            assert!(!k.source.contains('\0'), "{} has a NUL byte", k.name);
        }
        // The Rust constant and the C macro agree.
        let define = format!("#define HR_BLOCK_THREADS {BLOCK_THREADS}");
        assert!(FLOAT_BITS_PRELUDE.contains(&define));
    }

    /// The value of `#define NAME value` in `source` (the first token after the name).
    fn define<'s>(source: &'s str, name: &str) -> Option<&'s str> {
        source.lines().find_map(|l| {
            let rest = l.trim().strip_prefix("#define ")?.strip_prefix(name)?;
            // `NAME value`, not `NAME_LONGER value` or a function-like `NAME(x)`.
            rest.starts_with(' ').then(|| rest.trim())
        })
    }

    /// The host sizes its launches (threads, grid, dynamic shared memory) from the Rust
    /// constants; the kernels index their tiles with the C macros. They must agree exactly.
    #[test]
    fn flash_constants_match_the_kernel_macros() {
        for k in ATTENTION {
            let s = k.source;
            let flash_warps = FLASH_WARPS.to_string();
            let pad = FLASH_SMEM_PAD.to_string();
            assert_eq!(define(s, "HR_FLASH_WARPS"), Some(flash_warps.as_str()));
            assert_eq!(define(s, "HR_FLASH_THREADS"), Some("(HR_FLASH_WARPS * 32)"));
            assert_eq!(define(s, "HR_FLASH_SMEM_PAD"), Some(pad.as_str()));
        }
        let fwd = FLASH_ATTN_FWD.source;
        assert_eq!(FLASH_THREADS, FLASH_WARPS * 32);
        assert_eq!(
            define(fwd, "HR_FLASH_FWD_BLOCK_Q"),
            Some("(HR_FLASH_WARPS * 16)")
        );
        assert_eq!(FLASH_FWD_BLOCK_Q, FLASH_WARPS * 16);
        assert_eq!(
            define(fwd, "HR_FLASH_FWD_BLOCK_K"),
            Some(FLASH_FWD_BLOCK_K.to_string().as_str())
        );
        let bwd = FLASH_ATTN_BWD.source;
        assert_eq!(
            define(bwd, "HR_FLASH_DQ_BLOCK_Q"),
            Some("(HR_FLASH_WARPS * 16)")
        );
        assert_eq!(FLASH_DQ_BLOCK_Q, FLASH_WARPS * 16);
        assert_eq!(
            define(bwd, "HR_FLASH_DQ_BLOCK_K"),
            Some(FLASH_DQ_BLOCK_K.to_string().as_str())
        );
        assert_eq!(
            define(bwd, "HR_FLASH_DKDV_BLOCK_K"),
            Some("(HR_FLASH_WARPS * 16)")
        );
        assert_eq!(FLASH_DKDV_BLOCK_K, FLASH_WARPS * 16);
        for &d in FLASH_HEAD_DIMS {
            let name = format!("HR_FLASH_DKDV_BLOCK_Q_D{d}");
            assert_eq!(
                define(bwd, &name),
                Some(flash_dkdv_block_q(d).to_string().as_str()),
                "{name}"
            );
            // Every instantiated head dimension has a forward and both backward kernels.
            for t in ["bf16", "f16"] {
                for f in [
                    format!("flash_attn_fwd_{t}_d{d}"),
                    format!("flash_attn_bwd_dq_{t}_d{d}"),
                    format!("flash_attn_bwd_dkdv_{t}_d{d}"),
                ] {
                    assert!(find(&f).is_some(), "{f} is not registered");
                }
            }
        }
        // Shared memory: tiles of (rows) × (head_dim + pad) 16-bit values, as the sources say.
        assert_eq!(flash_fwd_smem_bytes(64), (64 + 128) * 72 * 2);
        assert_eq!(flash_fwd_smem_bytes(128), (64 + 128) * 136 * 2);
        // dQ: Q, dO and two stages of K, V; dK/dV: K, V and two stages of Q, dO, lse, dot.
        assert_eq!(flash_dq_smem_bytes(128), (128 + 256) * 136 * 2);
        assert_eq!(flash_dkdv_smem_bytes(64), (128 + 256) * 72 * 2 + 4 * 64 * 4);
        assert_eq!(
            flash_dkdv_smem_bytes(128),
            (128 + 256) * 136 * 2 + 4 * 64 * 4
        );
        // Within the 227 KiB an sm_90 block may opt into (sm_80: 163 KiB).
        for &d in FLASH_HEAD_DIMS {
            for bytes in [
                flash_fwd_smem_bytes(d),
                flash_dq_smem_bytes(d),
                flash_dkdv_smem_bytes(d),
            ] {
                assert!(bytes <= 163 * 1024, "d{d}: {bytes} B");
            }
        }
    }
}
