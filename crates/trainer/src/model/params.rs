//! The parameter tensors: names (Hugging Face's), shapes, initialisation, and the one place
//! they and their gradients are allocated.
//!
//! Linear weights are stored `[out, in]` (llm.c's and `nn.Linear`'s layout, so `y = x·Wᵀ`).
//! Hugging Face's GPT-2 keeps `attn.c_attn`, `attn.c_proj`, `mlp.c_fc` and `mlp.c_proj` as
//! `Conv1D` weights of shape `[in, out]`: those four are transposed when a checkpoint is
//! exported for transformers. A tied head has no tensor of its own.
//!
//! Order: the embeddings, then each block's tensors (its [`layer`] or [`llama_layer`]
//! offsets), then the final norm, then an untied head.

use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory};

use crate::model::{Family, ModelConfig};
use crate::Result;

/// Tensors per GPT-2 block.
pub const PER_LAYER: usize = 12;

/// Tensors per Llama block.
pub const LLAMA_PER_LAYER: usize = 9;

/// Offsets of a GPT-2 block's tensors within its 12.
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

/// Offsets of a Llama block's tensors within its 9.
#[allow(missing_docs)]
pub mod llama_layer {
    pub const INPUT_NORM: usize = 0;
    pub const Q: usize = 1;
    pub const K: usize = 2;
    pub const V: usize = 3;
    pub const O: usize = 4;
    pub const POST_NORM: usize = 5;
    pub const GATE: usize = 6;
    pub const UP: usize = 7;
    pub const DOWN: usize = 8;
}

/// Index of the token embedding (`wte`, `model.embed_tokens`; also a tied output head).
pub const WTE: usize = 0;
/// Index of GPT-2's position embedding `wpe`.
pub const WPE: usize = 1;

/// A parameter's Hugging Face name and shape in our layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// e.g. `h.3.attn.c_attn.weight`, `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    /// Shape (`[out, in]` for linear weights).
    pub shape: Vec<usize>,
    /// True for the four GPT-2 Conv1D weights transposed on export.
    pub transposed_in_hf: bool,
}

/// Tensors per block of `cfg`'s family.
pub fn per_layer(cfg: &ModelConfig) -> usize {
    match cfg.family {
        Family::Gpt2 => PER_LAYER,
        Family::Llama(_) => LLAMA_PER_LAYER,
    }
}

/// Embedding tensors before the first block: `wte`, `wpe` (GPT-2) or `embed_tokens` (Llama).
pub fn embedding_count(cfg: &ModelConfig) -> usize {
    match cfg.family {
        Family::Gpt2 => 2,
        Family::Llama(_) => 1,
    }
}

/// Index of block `l`'s tensor `offset` (see [`layer`] and [`llama_layer`]).
pub fn layer_index(cfg: &ModelConfig, l: usize, offset: usize) -> usize {
    embedding_count(cfg) + l * per_layer(cfg) + offset
}

/// Index of the final norm's gain (GPT-2's `ln_f.bias` follows it).
pub fn final_norm_index(cfg: &ModelConfig) -> usize {
    embedding_count(cfg) + cfg.layers * per_layer(cfg)
}

/// Tensors of the final norm: gain and bias (GPT-2) or gain alone (Llama).
pub fn final_norm_count(cfg: &ModelConfig) -> usize {
    match cfg.family {
        Family::Gpt2 => 2,
        Family::Llama(_) => 1,
    }
}

/// Index of the output head's weight `[V, C]`: the token embedding when tied, else the last.
pub fn head_index(cfg: &ModelConfig) -> usize {
    match cfg.family {
        Family::Llama(s) if !s.tied_head => final_norm_index(cfg) + 1,
        _ => WTE,
    }
}

/// Every parameter in order: embeddings, blocks, final norm, untied head.
pub fn param_infos(cfg: &ModelConfig) -> Vec<ParamInfo> {
    let c = cfg.channels;
    let p = |name: String, shape: Vec<usize>, t: bool| ParamInfo {
        name,
        shape,
        transposed_in_hf: t,
    };
    match cfg.family {
        Family::Gpt2 => {
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
        Family::Llama(s) => {
            let hs = cfg.head_dim();
            let (q, kv, f) = (cfg.heads * hs, s.kv_heads * hs, s.ffn);
            let mut v = vec![p(
                "model.embed_tokens.weight".into(),
                vec![cfg.vocab, c],
                false,
            )];
            for l in 0..cfg.layers {
                let h = |s: &str| format!("model.layers.{l}.{s}");
                v.push(p(h("input_layernorm.weight"), vec![c], false));
                v.push(p(h("self_attn.q_proj.weight"), vec![q, c], false));
                v.push(p(h("self_attn.k_proj.weight"), vec![kv, c], false));
                v.push(p(h("self_attn.v_proj.weight"), vec![kv, c], false));
                v.push(p(h("self_attn.o_proj.weight"), vec![c, q], false));
                v.push(p(h("post_attention_layernorm.weight"), vec![c], false));
                v.push(p(h("mlp.gate_proj.weight"), vec![f, c], false));
                v.push(p(h("mlp.up_proj.weight"), vec![f, c], false));
                v.push(p(h("mlp.down_proj.weight"), vec![c, f], false));
            }
            v.push(p("model.norm.weight".into(), vec![c], false));
            if !s.tied_head {
                v.push(p("lm_head.weight".into(), vec![cfg.vocab, c], false));
            }
            v
        }
    }
}

/// Allocate every parameter-shaped tensor, zeroed, in `category`.
pub fn alloc_like_params(
    cpu: &Cpu,
    cfg: &ModelConfig,
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
/// 1/√(2·layers), zero biases, unit layer-norm gains. Llama's is transformers': N(0, 0.02)
/// for every matrix and embedding (`initializer_range`), unit norm gains. Deterministic in
/// `seed`.
pub fn init_params(cpu: &Cpu, cfg: &ModelConfig, seed: u64) -> Result<Vec<CpuTensor>> {
    let mut params = Vec::with_capacity(param_infos(cfg).len());
    init_params_each(cpu, cfg, seed, |_, t| {
        params.push(t);
        Ok(())
    })?;
    Ok(params)
}

/// [`init_params`] one tensor at a time, in parameter order: `each(index, tensor)` receives
/// every tensor as soon as it is drawn (the same values), so a consumer that converts them —
/// a frozen base stored in bf16 or 4 bits — never holds the whole f32 model.
pub fn init_params_each(
    cpu: &Cpu,
    cfg: &ModelConfig,
    seed: u64,
    mut each: impl FnMut(usize, CpuTensor) -> Result<()>,
) -> Result<()> {
    let infos = param_infos(cfg);
    let mut rng = Normal::new(seed);
    let residual_std = 0.02 / ((2 * cfg.layers) as f32).sqrt();
    for (index, info) in infos.iter().enumerate() {
        let mut t = {
            let _g = MemoryCategory::Parameters.enter();
            let _l = headroom_profiler::label_absolute(&info.name);
            cpu.zeros(info.shape.clone(), DType::F32)?
        };
        let x = t.as_mut_slice::<f32>()?;
        let n = &info.name;
        if n.ends_with("bias") {
            // Zero, as allocated.
        } else if info.shape.len() == 1 {
            // GPT-2's ln_*.weight, Llama's *layernorm.weight and model.norm.weight.
            x.fill(1.0);
        } else {
            let gpt2_residual = cfg.family == Family::Gpt2 && n.ends_with("c_proj.weight");
            let std = if gpt2_residual { residual_std } else { 0.02 };
            for v in x {
                *v = rng.sample() * std;
            }
        }
        each(index, t)?;
    }
    Ok(())
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
