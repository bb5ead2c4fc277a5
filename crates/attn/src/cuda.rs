//! The CUDA implementation of [`AttentionBackend`] for [`headroom_cuda::Cuda`]: FlashAttention-2
//! forward and backward on tensor cores, from `headroom_kernels::ATTENTION` (compiled by NVRTC
//! for the device on first use).
//!
//! Same API, argument checks (in the same order) and typed errors as the CPU backend, then what
//! the kernels cannot do, as [`AttnError::Unsupported`] before anything is allocated:
//! - only the flash algorithm. Its `block_q`/`block_k` and the config's `backward_segments` are
//!   the CPU kernels' knobs and are ignored: the CUDA tiles are fixed at compile time (see
//!   `headroom_kernels::FLASH_*`), and results never depend on tiling beyond rounding;
//! - bf16 inputs only. f32 inputs are refused rather than silently computed in bf16 (cast them
//!   with `Backend::cast` first, and say so in your numbers); the kernels also exist for f16,
//!   which [`AttentionDims`] does not admit on any backend yet;
//! - head_dim 64 or 128 (the instantiated kernels), devices of compute capability 8.0 or newer,
//!   and sizes that fit the kernels' 32-bit arguments;
//! - no document masks (`attention_forward_documents`, and a backward whose forward state
//!   carries one): the kernels have none, and a kernel change needs a GPU to validate it.
//!
//! Memory, as on the CPU: output and gradients in the caller's current category, the logsumexp
//! as `Activations`, the backward's per-row `rowsum(dO∘O)` (4 bytes per query row) as
//! `Workspace`; nothing else, and nothing that grows with N². The backward is deterministic (a
//! separate dQ pass instead of atomics; see `kernels/cu/flash_attn_bwd.cu`), so gradients are
//! bitwise identical from run to run.
//!
//! Numerics against the CPU flash path on the same (bf16-rounded) inputs: f32 accumulation
//! everywhere, but P and dS are rounded to bf16 before the second matmul of each pair (as in
//! FlashAttention-2) and results are stored as bf16; the parity tests in `tests/cuda.rs` state
//! the tolerance.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, DriverError, LaunchArgs, LaunchConfig, PushKernelArg};
use headroom_cuda::{cudarc, Cuda, CudaError, CudaTensor};
use headroom_kernels as kernels;
use headroom_tensor::{Backend, DType, Error as TensorError, MemoryCategory, Tensor};

use crate::dims::{check_backward_inputs, check_documents};
use crate::{
    Algorithm, AttentionBackend, AttentionConfig, AttentionDims, AttentionForward,
    AttentionGradients, AttnError, BackendLimit, DocumentMask, Result,
};

const BACKEND: &str = "cuda";
/// Input dtypes the CUDA kernels are dispatched for.
const DTYPES: &[DType] = &[DType::BF16];
/// `mma.sync` on bf16, `ldmatrix` and `cp.async` need Ampere or newer.
const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);
/// The largest grid x dimension CUDA accepts.
const MAX_GRID_BLOCKS: usize = i32::MAX as usize;
/// Grid cap of the grid-stride `dot` kernel (8 rows per block; more rows loop).
const DOT_MAX_BLOCKS: usize = 1 << 16;

/// The entry points for one head dimension.
struct HeadDimKernels {
    head_dim: usize,
    forward: &'static str,
    dq: &'static str,
    dkdv: &'static str,
}

/// Every head dimension with kernels, and their bf16 entry points.
const BF16_KERNELS: [HeadDimKernels; 2] = [
    HeadDimKernels {
        head_dim: 64,
        forward: "flash_attn_fwd_bf16_d64",
        dq: "flash_attn_bwd_dq_bf16_d64",
        dkdv: "flash_attn_bwd_dkdv_bf16_d64",
    },
    HeadDimKernels {
        head_dim: 128,
        forward: "flash_attn_fwd_bf16_d128",
        dq: "flash_attn_bwd_dq_bf16_d128",
        dkdv: "flash_attn_bwd_dkdv_bf16_d128",
    },
];
const BF16_DOT: &str = "flash_attn_bwd_dot_bf16";
/// The head dimensions of [`BF16_KERNELS`], for error messages.
const HEAD_DIMS: &[usize] = &[64, 128];

fn unsupported(limit: BackendLimit) -> AttnError {
    AttnError::Unsupported {
        backend: BACKEND,
        limit,
    }
}

/// A CUDA failure in `op` as the shared tensor error (what `headroom-cuda` itself returns).
fn cuda_failure(cuda: &Cuda, op: &'static str, e: CudaError) -> AttnError {
    AttnError::Tensor(TensorError::Backend {
        device: cuda.device(),
        op,
        source: Box::new(e),
    })
}

fn driver_failure(cuda: &Cuda, op: &'static str, e: DriverError) -> AttnError {
    cuda_failure(
        cuda,
        op,
        CudaError::Driver {
            op,
            source: e.into(),
        },
    )
}

fn same_device(cuda: &Cuda, op: &'static str, tensors: &[&CudaTensor]) -> Result<()> {
    for t in tensors {
        if t.device() != cuda.device() {
            return Err(TensorError::DeviceMismatch {
                op,
                expected: cuda.device(),
                got: t.device(),
            }
            .into());
        }
    }
    Ok(())
}

/// `ceil(len / tile) · heads · batch` blocks, if that fits one grid.
fn grid_blocks(
    what: &'static str,
    len: usize,
    tile: u32,
    heads: usize,
    batch: usize,
) -> Result<u32> {
    let blocks = len
        .div_ceil(tile as usize)
        .checked_mul(heads)
        .and_then(|b| b.checked_mul(batch));
    match blocks {
        Some(b) if b <= MAX_GRID_BLOCKS => Ok(b as u32),
        _ => Err(unsupported(BackendLimit::Size {
            what,
            value: blocks.unwrap_or(usize::MAX),
            max: MAX_GRID_BLOCKS,
        })),
    }
}

fn to_u32(what: &'static str, value: usize) -> Result<u32> {
    u32::try_from(value).map_err(|_| {
        unsupported(BackendLimit::Size {
            what,
            value,
            max: u32::MAX as usize,
        })
    })
}

/// One flash attention call, checked against what the kernels support, with every launch
/// argument in the kernels' types.
struct FlashLaunch {
    kernels: &'static HeadDimKernels,
    q_len: u32,
    kv_len: u32,
    q_heads: u32,
    kv_heads: u32,
    head_dim: u32,
    causal: u32,
    scale: f32,
    /// `scale · log2 e`: the kernels run the softmax in base 2.
    scale_log2: f32,
    /// Query rows in all heads and batches (rows of the logsumexp).
    rows: usize,
    forward_blocks: u32,
    dq_blocks: u32,
    dkdv_blocks: u32,
}

impl FlashLaunch {
    fn new(cuda: &Cuda, dims: AttentionDims, config: &AttentionConfig) -> Result<Self> {
        if !matches!(config.algorithm, Algorithm::Flash { .. }) {
            return Err(unsupported(BackendLimit::Algorithm {
                requested: config.algorithm.name(),
                supported: "flash",
            }));
        }
        if !DTYPES.contains(&dims.dtype) {
            return Err(unsupported(BackendLimit::DType {
                dtype: dims.dtype,
                supported: DTYPES,
            }));
        }
        let kernels = BF16_KERNELS
            .iter()
            .find(|k| k.head_dim == dims.head_dim)
            .ok_or_else(|| {
                unsupported(BackendLimit::HeadDim {
                    head_dim: dims.head_dim,
                    supported: HEAD_DIMS,
                })
            })?;
        let found = cuda.compute_capability();
        if found < MIN_COMPUTE_CAPABILITY {
            return Err(unsupported(BackendLimit::ComputeCapability {
                found,
                required: MIN_COMPUTE_CAPABILITY,
            }));
        }
        // The dK/dV kernel counts its (query head, query tile) steps in an `int`.
        let steps = dims.group_size().checked_mul(
            dims.q_len
                .div_ceil(kernels::flash_dkdv_block_q(dims.head_dim as u32) as usize),
        );
        if steps.is_none_or(|s| s > i32::MAX as usize) {
            return Err(unsupported(BackendLimit::Size {
                what: "group size · query tiles",
                value: steps.unwrap_or(usize::MAX),
                max: i32::MAX as usize,
            }));
        }
        let scale = config.scale_for(dims.head_dim);
        let rows = dims
            .batch
            .checked_mul(dims.q_heads)
            .and_then(|r| r.checked_mul(dims.q_len))
            .ok_or_else(|| {
                unsupported(BackendLimit::Size {
                    what: "batch · q_heads · q_len",
                    value: usize::MAX,
                    max: usize::MAX,
                })
            })?;
        Ok(FlashLaunch {
            kernels,
            q_len: to_u32("q_len", dims.q_len)?,
            kv_len: to_u32("kv_len", dims.kv_len)?,
            q_heads: to_u32("q_heads", dims.q_heads)?,
            kv_heads: to_u32("kv_heads", dims.kv_heads)?,
            head_dim: to_u32("head_dim", dims.head_dim)?,
            causal: u32::from(config.causal),
            scale,
            scale_log2: scale * std::f32::consts::LOG2_E,
            rows,
            forward_blocks: grid_blocks(
                "forward blocks",
                dims.q_len,
                kernels::FLASH_FWD_BLOCK_Q,
                dims.q_heads,
                dims.batch,
            )?,
            dq_blocks: grid_blocks(
                "dQ blocks",
                dims.q_len,
                kernels::FLASH_DQ_BLOCK_Q,
                dims.q_heads,
                dims.batch,
            )?,
            dkdv_blocks: grid_blocks(
                "dK/dV blocks",
                dims.kv_len,
                kernels::FLASH_DKDV_BLOCK_K,
                dims.kv_heads,
                dims.batch,
            )?,
        })
    }

    /// The loaded entry point, allowed `smem_bytes` of dynamic shared memory (more than the
    /// 48 KiB default needs the opt-in attribute; setting it every time costs one driver call).
    fn function(
        &self,
        cuda: &Cuda,
        op: &'static str,
        name: &'static str,
        smem_bytes: u32,
    ) -> Result<CudaFunction> {
        let function = cuda.function(name).map_err(|e| cuda_failure(cuda, op, e))?;
        function
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_bytes as i32,
            )
            .map_err(|e| driver_failure(cuda, op, e))?;
        Ok(function)
    }

    fn tile_config(blocks: u32, smem_bytes: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (kernels::FLASH_THREADS, 1, 1),
            shared_mem_bytes: smem_bytes,
        }
    }

    fn forward(
        &self,
        cuda: &Cuda,
        [q, k, v]: [&CudaTensor; 3],
        out: &mut CudaTensor,
        lse: &mut CudaTensor,
    ) -> Result<()> {
        const OP: &str = "attention_forward";
        if self.forward_blocks == 0 {
            return Ok(()); // no query rows: nothing to write
        }
        let smem = kernels::flash_fwd_smem_bytes(self.head_dim);
        let function = self.function(cuda, OP, self.kernels.forward, smem)?;
        let null = NULL_POINTER;
        let mut args = cuda.stream().launch_builder(&function);
        push_input(&mut args, q, &null);
        push_input(&mut args, k, &null);
        push_input(&mut args, v, &null);
        push_output(&mut args, out, &null);
        push_output(&mut args, lse, &null);
        args.arg(&self.q_len)
            .arg(&self.kv_len)
            .arg(&self.q_heads)
            .arg(&self.kv_heads)
            .arg(&self.scale_log2)
            .arg(&self.causal);
        // SAFETY: flash_attn_fwd_bf16_d<D>(const u16* q, k, v, u16* out, float* lse, u32 q_len,
        // kv_len, q_heads, kv_heads, float scale_log2, u32 causal). The shapes were checked by
        // AttentionDims (q/out [B, Hq, Nq, D], k/v [B, Hkv, Nkv, D], lse [B, Hq, Nq] f32, bf16
        // elements, D = this kernel's head dim), the grid has one block per query tile per
        // query head, each block touches only its own rows of out/lse, and a null pointer is
        // passed only for an empty k/v, which the kernel never reads (kv_len = 0 → no key tile).
        unsafe { args.launch(Self::tile_config(self.forward_blocks, smem)) }
            .map_err(|e| driver_failure(cuda, OP, e))?;
        Ok(())
    }

    fn backward(
        &self,
        cuda: &Cuda,
        [q, k, v, out, d_out, lse]: [&CudaTensor; 6],
        dot: &mut CudaTensor,
        [dq, dk, dv]: [&mut CudaTensor; 3],
    ) -> Result<()> {
        const OP: &str = "attention_backward";
        let null = NULL_POINTER;
        let stream = cuda.stream();
        if self.rows > 0 {
            let function = cuda
                .function(BF16_DOT)
                .map_err(|e| cuda_failure(cuda, OP, e))?;
            let rows = self.rows as u64;
            let rows_per_block = (kernels::BLOCK_THREADS / 32) as usize;
            let blocks = self.rows.div_ceil(rows_per_block).min(DOT_MAX_BLOCKS) as u32;
            let mut args = stream.launch_builder(&function);
            push_input(&mut args, out, &null);
            push_input(&mut args, d_out, &null);
            push_output(&mut args, dot, &null);
            args.arg(&rows).arg(&self.head_dim);
            let config = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (kernels::BLOCK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: flash_attn_bwd_dot_bf16(const u16* out, const u16* d_out, float* dot,
            // u64 rows, u32 head_dim): out and d_out hold rows · head_dim bf16 values (q's
            // shape, checked), dot holds `rows` f32s; a grid-stride loop bounds every access.
            unsafe { args.launch(config) }.map_err(|e| driver_failure(cuda, OP, e))?;
        }
        if self.dq_blocks > 0 {
            let smem = kernels::flash_dq_smem_bytes(self.head_dim);
            let function = self.function(cuda, OP, self.kernels.dq, smem)?;
            let mut args = stream.launch_builder(&function);
            for t in [q, k, v, d_out, lse] {
                push_input(&mut args, t, &null);
            }
            push_input(&mut args, dot, &null);
            push_output(&mut args, dq, &null);
            self.push_sizes(&mut args);
            // SAFETY: flash_attn_bwd_dq_bf16_d<D>(const u16* q, k, v, d_out, const float* lse,
            // dot, u16* dq, u32 q_len, kv_len, q_heads, kv_heads, float scale, scale_log2,
            // u32 causal). Shapes as in the forward (d_out and dq have q's shape, lse and dot
            // are [B, Hq, Nq] f32, all checked); one block per query tile per query head, each
            // writing only its own dq rows; k/v are null only when empty, and never read then.
            unsafe { args.launch(Self::tile_config(self.dq_blocks, smem)) }
                .map_err(|e| driver_failure(cuda, OP, e))?;
        }
        if self.dkdv_blocks > 0 {
            let smem = kernels::flash_dkdv_smem_bytes(self.head_dim);
            let function = self.function(cuda, OP, self.kernels.dkdv, smem)?;
            let mut args = stream.launch_builder(&function);
            for t in [q, k, v, d_out, lse] {
                push_input(&mut args, t, &null);
            }
            push_input(&mut args, dot, &null);
            push_output(&mut args, dk, &null);
            push_output(&mut args, dv, &null);
            self.push_sizes(&mut args);
            // SAFETY: flash_attn_bwd_dkdv_bf16_d<D>(const u16* q, k, v, d_out, const float*
            // lse, dot, u16* dk, dv, u32 q_len, kv_len, q_heads, kv_heads, float scale,
            // scale_log2, u32 causal). dk/dv have k's shape; one block per key tile per key/value
            // head, each writing only its own rows; q, d_out, lse and dot are null only when
            // q_len = 0, and the kernel then visits no query tile.
            unsafe { args.launch(Self::tile_config(self.dkdv_blocks, smem)) }
                .map_err(|e| driver_failure(cuda, OP, e))?;
        }
        Ok(())
    }

    /// The size arguments both backward tile kernels end with.
    fn push_sizes<'a>(&'a self, args: &mut LaunchArgs<'a>) {
        args.arg(&self.q_len)
            .arg(&self.kv_len)
            .arg(&self.q_heads)
            .arg(&self.kv_heads)
            .arg(&self.scale)
            .arg(&self.scale_log2)
            .arg(&self.causal);
    }
}

/// The device pointer passed for an empty tensor (which has no allocation); kernels never
/// dereference it.
const NULL_POINTER: u64 = 0;

fn push_input<'a>(args: &mut LaunchArgs<'a>, t: &'a CudaTensor, null: &'a u64) {
    match t.slice() {
        Some(s) => args.arg(s),
        None => args.arg(null),
    };
}

fn push_output<'a>(args: &mut LaunchArgs<'a>, t: &'a mut CudaTensor, null: &'a u64) {
    match t.slice_mut() {
        Some(s) => args.arg(s),
        None => args.arg(null),
    };
}

impl AttentionBackend for Cuda {
    fn attention_forward(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        config: &AttentionConfig,
    ) -> Result<AttentionForward<CudaTensor>> {
        let dims = AttentionDims::of_forward(q, k, v, config)?;
        same_device(self, "attention_forward", &[q, k, v])?;
        let launch = FlashLaunch::new(self, dims, config)?;
        // Every element of both is written by the kernel, so neither is cleared first.
        let mut output = self.uninit(dims.q_shape(), dims.dtype)?;
        let mut logsumexp = {
            let _saved = MemoryCategory::Activations.enter();
            self.uninit(dims.lse_shape(), DType::F32)?
        };
        launch.forward(self, [q, k, v], &mut output, &mut logsumexp)?;
        Ok(AttentionForward {
            output,
            logsumexp,
            probs: None,
            config: *config,
            dims,
            documents: None,
        })
    }

    /// The same checks as the CPU backend, then [`AttnError::Unsupported`]: the kernels have
    /// no document mask (a change to them needs a GPU to validate it).
    fn attention_forward_documents(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        config: &AttentionConfig,
        documents: &DocumentMask,
    ) -> Result<AttentionForward<CudaTensor>> {
        let dims = AttentionDims::of_forward(q, k, v, config)?;
        check_documents(&dims, config, documents)?;
        Err(unsupported(BackendLimit::DocumentMask))
    }

    fn attention_backward(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        forward: &AttentionForward<CudaTensor>,
        d_out: &CudaTensor,
    ) -> Result<AttentionGradients<CudaTensor>> {
        let config = forward.config;
        let dims = check_backward_inputs(q, k, v, forward, d_out)?;
        if forward.documents.is_some() {
            // No CUDA forward makes one; refused rather than computed without the mask.
            return Err(unsupported(BackendLimit::DocumentMask));
        }
        let q_shape = dims.q_shape();
        same_device(
            self,
            "attention_backward",
            &[q, k, v, d_out, &forward.output, &forward.logsumexp],
        )?;
        let launch = FlashLaunch::new(self, dims, &config)?;
        // The kernels write every element of the gradients (rows that see no key get zeros).
        let mut dq = self.uninit(q_shape, dims.dtype)?;
        let mut dk = self.uninit(dims.kv_shape(), dims.dtype)?;
        let mut dv = self.uninit(dims.kv_shape(), dims.dtype)?;
        let mut dot = {
            let _scratch = MemoryCategory::Workspace.enter();
            self.uninit(dims.lse_shape(), DType::F32)?
        };
        launch.backward(
            self,
            [q, k, v, &forward.output, d_out, &forward.logsumexp],
            &mut dot,
            [&mut dq, &mut dk, &mut dv],
        )?;
        // `dot` is freed here, but the kernels reading it are only queued: the stream-ordered
        // free of headroom-cuda's allocator runs after them on the same stream.
        drop(dot);
        Ok(AttentionGradients { dq, dk, dv })
    }
}

/// Compile (NVRTC, cached per process) and load every flash attention kernel on `cuda` now, so
/// the first attention call does not pay for it (several seconds; call it before timing
/// anything). Without it the kernels load on first use. `Cuda::load_all_kernels` covers only
/// the backend's own kernels.
pub fn load_attention_kernels(cuda: &Cuda) -> Result<()> {
    for module in kernels::ATTENTION {
        for &function in module.functions {
            cuda.function(function)
                .map_err(|e| cuda_failure(cuda, "load_attention_kernels", e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_named_here_is_registered() {
        let mut named = vec![BF16_DOT];
        for k in &BF16_KERNELS {
            named.extend([k.forward, k.dq, k.dkdv]);
            for name in [k.forward, k.dq, k.dkdv] {
                assert!(name.ends_with(&format!("_d{}", k.head_dim)), "{name}");
                assert!(name.contains("_bf16_"), "{name}");
            }
        }
        for name in named {
            let module = kernels::find(name).unwrap_or_else(|| panic!("{name} not registered"));
            assert!(
                kernels::ATTENTION.contains(module),
                "{name} not an attention kernel"
            );
        }
        let dims: Vec<usize> = BF16_KERNELS.iter().map(|k| k.head_dim).collect();
        assert_eq!(dims, HEAD_DIMS);
        let compiled: Vec<usize> = kernels::FLASH_HEAD_DIMS
            .iter()
            .map(|&d| d as usize)
            .collect();
        assert_eq!(compiled, HEAD_DIMS);
    }

    #[test]
    fn grids_are_counted_in_tiles_and_bounded() {
        assert_eq!(grid_blocks("x", 0, 64, 8, 2).unwrap(), 0);
        assert_eq!(grid_blocks("x", 1, 64, 8, 2).unwrap(), 16);
        assert_eq!(grid_blocks("x", 64, 64, 8, 2).unwrap(), 16);
        assert_eq!(grid_blocks("x", 65, 64, 8, 2).unwrap(), 32);
        assert!(grid_blocks("x", 1 << 20, 64, 1 << 12, 1 << 4).is_ok()); // 2^30
        assert!(matches!(
            grid_blocks("blocks", 1 << 20, 64, 1 << 12, 1 << 5), // 2^31 > i32::MAX
            Err(AttnError::Unsupported {
                limit: BackendLimit::Size { what: "blocks", .. },
                ..
            })
        ));
        assert!(matches!(
            grid_blocks("overflow", usize::MAX, 1, 2, 1),
            Err(AttnError::Unsupported { .. })
        ));
        assert!(to_u32("q_len", u32::MAX as usize).is_ok());
        assert!(matches!(
            to_u32("q_len", u32::MAX as usize + 1),
            Err(AttnError::Unsupported {
                limit: BackendLimit::Size { what: "q_len", .. },
                ..
            })
        ));
    }
}
