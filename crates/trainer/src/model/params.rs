//! The parameter tensors: names (Hugging Face GPT-2's), shapes, initialisation, and the one
//! place they and their gradients are allocated.
//!
//! Linear weights are stored `[out, in]` (llm.c's layout, so `y = x·Wᵀ`). Hugging Face's GPT-2
//! keeps `attn.c_attn`, `attn.c_proj`, `mlp.c_fc` and `mlp.c_proj` as `Conv1D` weights of shape
//! `[in, out]`: those four are transposed when a checkpoint is exported for transformers.
//! `lm_head` is tied to `wte` and has no tensor of its own.

use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory};

use crate::model::GptConfig;
use crate::Result;

/// Tensors per transformer block.
pub const PER_LAYER: usize = 12;

/// Offsets of a block's tensors within its 12.
#[allow(missing_docs)]
pub mod layer {
    pub const LN1_W: usize = 0;
    pub const LN1_B: usize = 1;
    pub const QKV_W: usize = 2;
    pub const QKV_B: usize = 3;
    pub const ATTN_PROJ_W: usize = 4;
    pub const ATTN_PROJ_B: usize = 5;
    pub const LN2_W: usize = 6;
    pub const LN2_B: usize = 7;
    pub const FC_W: usize = 8;
    pub const FC_B: usize = 9;
    pub const FC_PROJ_W: usize = 10;
    pub const FC_PROJ_B: usize = 11;
}

/// Index of `wte` (also the tied output head).
pub const WTE: usize = 0;
/// Index of `wpe`.
pub const WPE: usize = 1;

/// A parameter's Hugging Face name and shape in our layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// e.g. `h.3.attn.c_attn.weight`.
    pub name: String,
    /// Shape (`[out, in]` for linear weights).
    pub shape: Vec<usize>,
    /// True for the four Conv1D weights transposed on export.
    pub transposed_in_hf: bool,
}

/// Every parameter in order: wte, wpe, the blocks, ln_f.
pub fn param_infos(cfg: &GptConfig) -> Vec<ParamInfo> {
    let c = cfg.channels;
    let p = |name: String, shape: Vec<usize>, t: bool| ParamInfo {
        name,
        shape,
        transposed_in_hf: t,
    };
    let mut v = vec![
        p("wte.weight".into(), vec![cfg.vocab, c], false),
        p("wpe.weight".into(), vec![cfg.max_seq, c], false),
    ];
    for l in 0..cfg.layers {
        let h = |s: &str| format!("h.{l}.{s}");
        v.push(p(h("ln_1.weight"), vec![c], false));
        v.push(p(h("ln_1.bias"), vec![c], false));
        v.push(p(h("attn.c_attn.weight"), vec![3 * c, c], true));
        v.push(p(h("attn.c_attn.bias"), vec![3 * c], false));
        v.push(p(h("attn.c_proj.weight"), vec![c, c], true));
        v.push(p(h("attn.c_proj.bias"), vec![c], false));
        v.push(p(h("ln_2.weight"), vec![c], false));
        v.push(p(h("ln_2.bias"), vec![c], false));
        v.push(p(h("mlp.c_fc.weight"), vec![4 * c, c], true));
        v.push(p(h("mlp.c_fc.bias"), vec![4 * c], false));
        v.push(p(h("mlp.c_proj.weight"), vec![c, 4 * c], true));
        v.push(p(h("mlp.c_proj.bias"), vec![c], false));
    }
    v.push(p("ln_f.weight".into(), vec![c], false));
    v.push(p("ln_f.bias".into(), vec![c], false));
    v
}

/// Index of block `l`'s tensor `offset` (see [`layer`]).
pub fn layer_index(l: usize, offset: usize) -> usize {
    2 + l * PER_LAYER + offset
}

/// Index of `ln_f.weight` (`ln_f.bias` follows).
pub fn ln_f_index(cfg: &GptConfig) -> usize {
    2 + cfg.layers * PER_LAYER
}

/// Allocate every parameter-shaped tensor, zeroed, in `category`.
pub fn alloc_like_params(
    cpu: &Cpu,
    cfg: &GptConfig,
    category: MemoryCategory,
) -> Result<Vec<CpuTensor>> {
    let _g = category.enter();
    // Labelled by Hugging Face name (`h.3.attn.c_attn.weight`, `wte.weight.grad`) so the
    // profiler's tables name them.
    let suffix = match category {
        MemoryCategory::Parameters => "",
        MemoryCategory::Gradients => ".grad",
        _ => ".copy",
    };
    param_infos(cfg)
        .iter()
        .map(|i| {
            let _l = headroom_profiler::label_absolute(&format!("{}{suffix}", i.name));
            Ok(cpu.zeros(i.shape.clone(), DType::F32)?)
        })
        .collect()
}

/// GPT-2 initialisation: N(0, 0.02) weights and embeddings, residual projections scaled by
/// 1/√(2·layers), zero biases, unit layer-norm gains. Deterministic in `seed`.
pub fn init_params(cpu: &Cpu, cfg: &GptConfig, seed: u64) -> Result<Vec<CpuTensor>> {
    let mut params = alloc_like_params(cpu, cfg, MemoryCategory::Parameters)?;
    let infos = param_infos(cfg);
    let mut rng = Normal::new(seed);
    let residual_std = 0.02 / ((2 * cfg.layers) as f32).sqrt();
    for (t, info) in params.iter_mut().zip(&infos) {
        let x = t.as_mut_slice::<f32>()?;
        let n = &info.name;
        if n.ends_with("bias") {
            continue;
        } else if n.contains("ln_") {
            x.fill(1.0);
        } else {
            let std = if n.ends_with("c_proj.weight") {
                residual_std
            } else {
                0.02
            };
            for v in x {
                *v = rng.sample() * std;
            }
        }
    }
    Ok(params)
}

/// Box–Muller over xorshift64*: a tiny deterministic normal sampler for initialisation.
struct Normal {
    state: u64,
    spare: Option<f32>,
}

impl Normal {
    fn new(seed: u64) -> Self {
        Normal {
            state: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            spare: None,
        }
    }
    fn uniform(&mut self) -> f64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let r = self.state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((r >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn sample(&mut self) -> f32 {
        if let Some(s) = self.spare.take() {
            return s;
        }
        let (u1, u2) = (self.uniform(), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let th = std::f64::consts::TAU * u2;
        self.spare = Some((r * th.sin()) as f32);
        (r * th.cos()) as f32
    }
}
