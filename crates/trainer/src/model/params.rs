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

use headroom_tensor::cpu::kernels::{self, FloatSlice, FloatSliceMut};
use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory};

use crate::model::{Family, ModelConfig, QkNorm};
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

/// Offsets of a Llama block's tensors within its 9: 12 with Qwen2's q/k/v biases, 11 with
/// Qwen3's query and key norms, 13 with Gemma 3's query/key norms and output norms. Each
/// follows the nine, so that every other offset is the same in every layout; no class has
/// both biases and norms, so they share offsets. In Gemma 3, `POST_NORM` (Llama's
/// `post_attention_layernorm`, the MLP's input norm) is `pre_feedforward_layernorm`, and its
/// own `post_attention_layernorm` is `ATTN_OUT_NORM`.
///
/// OLMo 2 has no input norms: its two output norms take their offsets, 0 and 5, and with its
/// query and key norms it has 11 ([`llama_layer::attn_out_norm`],
/// [`llama_layer::mlp_out_norm`]).
#[allow(missing_docs)]
pub mod llama_layer {
    use crate::model::LlamaShape;

    /// The offset of the norm of the attention's output: `ATTN_OUT_NORM`, or OLMo 2's
    /// `INPUT_NORM` slot.
    pub fn attn_out_norm(s: &LlamaShape) -> usize {
        if s.input_norms() {
            ATTN_OUT_NORM
        } else {
            INPUT_NORM
        }
    }

    /// The offset of the norm of the MLP's output: `MLP_OUT_NORM`, or OLMo 2's `POST_NORM`
    /// slot.
    pub fn mlp_out_norm(s: &LlamaShape) -> usize {
        if s.input_norms() {
            MLP_OUT_NORM
        } else {
            POST_NORM
        }
    }

    pub const INPUT_NORM: usize = 0;
    pub const Q: usize = 1;
    pub const K: usize = 2;
    pub const V: usize = 3;
    pub const O: usize = 4;
    pub const POST_NORM: usize = 5;
    pub const GATE: usize = 6;
    pub const UP: usize = 7;
    pub const DOWN: usize = 8;
    pub const Q_BIAS: usize = 9;
    pub const K_BIAS: usize = 10;
    pub const V_BIAS: usize = 11;
    pub const Q_NORM: usize = 9;
    pub const K_NORM: usize = 10;
    pub const ATTN_OUT_NORM: usize = 11;
    pub const MLP_OUT_NORM: usize = 12;
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
        Family::Llama(s) => {
            LLAMA_PER_LAYER
                + 3 * usize::from(s.qkv_bias())
                + 2 * usize::from(s.qk_norm())
                + 2 * usize::from(s.output_norms())
                - 2 * usize::from(!s.input_norms())
        }
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
            // Gemma's and OLMo's post_attention_layernorm normalises the attention's output;
            // Gemma's MLP input norm is its pre_feedforward_layernorm. OLMo has no input
            // norms: its output norms take their slots.
            let (first_norm, mlp_norm) = match (s.input_norms(), s.output_norms()) {
                (false, _) => (
                    "post_attention_layernorm.weight",
                    "post_feedforward_layernorm.weight",
                ),
                (true, true) => ("input_layernorm.weight", "pre_feedforward_layernorm.weight"),
                (true, false) => ("input_layernorm.weight", "post_attention_layernorm.weight"),
            };
            let (q_norm, k_norm) = match s.qk_norm_kind() {
                Some(QkNorm::Projection) => (q, kv),
                _ => (hs, hs),
            };
            for l in 0..cfg.layers {
                let h = |s: &str| format!("model.layers.{l}.{s}");
                v.push(p(h(first_norm), vec![c], false));
                v.push(p(h("self_attn.q_proj.weight"), vec![q, c], false));
                v.push(p(h("self_attn.k_proj.weight"), vec![kv, c], false));
                v.push(p(h("self_attn.v_proj.weight"), vec![kv, c], false));
                v.push(p(h("self_attn.o_proj.weight"), vec![c, q], false));
                v.push(p(h(mlp_norm), vec![c], false));
                v.push(p(h("mlp.gate_proj.weight"), vec![f, c], false));
                v.push(p(h("mlp.up_proj.weight"), vec![f, c], false));
                v.push(p(h("mlp.down_proj.weight"), vec![c, f], false));
                if s.qkv_bias() {
                    v.push(p(h("self_attn.q_proj.bias"), vec![q], false));
                    v.push(p(h("self_attn.k_proj.bias"), vec![kv], false));
                    v.push(p(h("self_attn.v_proj.bias"), vec![kv], false));
                }
                if s.qk_norm() {
                    v.push(p(h("self_attn.q_norm.weight"), vec![q_norm], false));
                    v.push(p(h("self_attn.k_norm.weight"), vec![k_norm], false));
                }
                if s.output_norms() && s.input_norms() {
                    v.push(p(h("post_attention_layernorm.weight"), vec![c], false));
                    v.push(p(h("post_feedforward_layernorm.weight"), vec![c], false));
                }
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
/// for every matrix and embedding (`initializer_range`), unit norm gains (Gemma's stored
/// gains 0: each multiplies as `1 + w`). Deterministic in `seed`.
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
    each: impl FnMut(usize, CpuTensor) -> Result<()>,
) -> Result<()> {
    init_params_into(cpu, cfg, seed, &mut EachF32(each))
}

/// [`init_params_each`] into `sink`, each tensor in the dtype the sink asks for: a bf16 frozen
/// base draws straight into bf16 a chunk at a time. The values are [`init_params`]' cast to
/// that dtype, bit for bit.
pub fn init_params_into(
    cpu: &Cpu,
    cfg: &ModelConfig,
    seed: u64,
    sink: &mut impl TensorSink,
) -> Result<()> {
    let infos = param_infos(cfg);
    let mut rng = Normal::new(seed);
    let residual_std = 0.02 / ((2 * cfg.layers) as f32).sqrt();
    for (index, info) in infos.iter().enumerate() {
        let n = &info.name;
        let t = fill_tensor(cpu, info, index, sink, |_, x| {
            if n.ends_with("bias") {
                x.fill(0.0);
            } else if info.shape.len() == 1 {
                // GPT-2's ln_*.weight, Llama's *layernorm.weight and model.norm.weight: a
                // unit gain, stored as Gemma's offset from 1.
                let offset = match cfg.family {
                    Family::Llama(s) => s.rms_norm().gain_offset,
                    Family::Gpt2 => 0.0,
                };
                x.fill(1.0 - offset);
            } else {
                let gpt2_residual = cfg.family == Family::Gpt2 && n.ends_with("c_proj.weight");
                let std = if gpt2_residual { residual_std } else { 0.02 };
                for v in x {
                    *v = rng.sample() * std;
                }
            }
            Ok(())
        })?;
        sink.push(index, t)?;
    }
    Ok(())
}

/// A consumer of the parameter tensors, in parameter order, as [`init_params_into`] draws them
/// and [`crate::hf::load_into`] reads them.
pub trait TensorSink {
    /// The dtype tensor `index` is wanted in: f32, or bf16/f16 for a consumer that keeps only
    /// rounded copies. Those are filled a chunk at a time through a bounded f32 buffer, so
    /// the tensor never exists in f32.
    fn dtype(&self, index: usize) -> DType;

    /// Tensor `index`'s f32 values in order, a chunk at a time, before it is
    /// [pushed](Self::push). Called only for a tensor wanted in bf16 or f16, whose f32 values
    /// are gone once it is pushed (a fingerprint reads them here), or one the sink
    /// [consumes](Self::consumes).
    fn values(&mut self, index: usize, values: &[f32]) -> Result<()>;

    /// Whether tensor `index`'s values go to [`values`](Self::values) alone — a weight
    /// quantized as its chunks arrive — so that no tensor of its shape is ever allocated: it
    /// is then [pushed](Self::push) as an empty f32 tensor (shape `[0]`).
    fn consumes(&self, _index: usize) -> bool {
        false
    }

    /// Tensor `index`, in the dtype [`dtype`](Self::dtype) named, as soon as it is filled.
    fn push(&mut self, index: usize, tensor: CpuTensor) -> Result<()>;
}

/// A closure taking f32 tensors as a [`TensorSink`].
pub(crate) struct EachF32<F>(pub(crate) F);

impl<F: FnMut(usize, CpuTensor) -> Result<()>> TensorSink for EachF32<F> {
    fn dtype(&self, _: usize) -> DType {
        DType::F32
    }

    fn values(&mut self, _: usize, _: &[f32]) -> Result<()> {
        Ok(())
    }

    fn push(&mut self, index: usize, tensor: CpuTensor) -> Result<()> {
        (self.0)(index, tensor)
    }
}

/// f32 values per chunk of a bf16/f16 [`fill_tensor`] (4 MiB), rounded down to whole rows.
/// Large enough that a transposed read (GPT-2's `Conv1D` weights, one pass over the stored
/// tensor per chunk) makes few passes; small beside any tensor worth streaming.
const FILL_CHUNK: usize = 1 << 20;

/// Tensor `index` (`info`'s shape, counted as `Parameters` under its name) in the dtype `sink`
/// wants, its values written in order by `fill(offset, chunk)`: for f32 once, in place; for
/// bf16/f16 a chunk of whole rows (the last dimension) at a time into a bounded f32 buffer
/// that `sink.values` reads and that is then rounded into the tensor as [`Backend::cast`]
/// rounds.
pub(crate) fn fill_tensor(
    cpu: &Cpu,
    info: &ParamInfo,
    index: usize,
    sink: &mut impl TensorSink,
    fill: impl FnMut(usize, &mut [f32]) -> Result<()>,
) -> Result<CpuTensor> {
    fill_tensor_by(cpu, info, index, sink, FILL_CHUNK, fill)
}

/// [`fill_tensor`] with `chunk` values per chunk (rounded down to whole rows, at least one).
fn fill_tensor_by(
    cpu: &Cpu,
    info: &ParamInfo,
    index: usize,
    sink: &mut impl TensorSink,
    chunk: usize,
    mut fill: impl FnMut(usize, &mut [f32]) -> Result<()>,
) -> Result<CpuTensor> {
    let row = match info.shape.as_slice() {
        [.., last] if info.shape.len() > 1 => (*last).max(1),
        _ => 1,
    };
    let chunk = (chunk / row).max(1) * row;
    if sink.consumes(index) {
        // The sink quantizes the chunks as they come: nothing of the tensor's shape exists.
        let n: usize = info.shape.iter().product();
        in_chunks(n, chunk, fill, |_, values| sink.values(index, values))?;
        let _g = MemoryCategory::Parameters.enter();
        return Ok(cpu.zeros([0], DType::F32)?);
    }
    let dtype = sink.dtype(index);
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(crate::TrainError::Config(format!(
            "{} wanted in {dtype:?}: parameters are f32, bf16 or f16",
            info.name
        )));
    }
    let mut t = {
        let _g = MemoryCategory::Parameters.enter();
        let _l = headroom_profiler::label_absolute(&info.name);
        cpu.zeros(info.shape.clone(), dtype)?
    };
    match t.float_slice_mut("fill_tensor")? {
        // In place: the tensor is its own buffer.
        FloatSliceMut::F32(x) => fill(0, x)?,
        mut narrow => {
            in_chunks(narrow.len(), chunk, fill, |at, values| {
                sink.values(index, values)?;
                cast_into(values, &mut narrow, at);
                Ok(())
            })?;
        }
    }
    Ok(t)
}

/// `n` values, `chunk` at a time through one bounded buffer: `fill(at, chunk)` writes them,
/// then `each(at, chunk)` takes them.
fn in_chunks(
    n: usize,
    chunk: usize,
    mut fill: impl FnMut(usize, &mut [f32]) -> Result<()>,
    mut each: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    let mut buf = vec![0f32; chunk.min(n)];
    let mut at = 0;
    while at < n {
        let values = &mut buf[..chunk.min(n - at)];
        fill(at, values)?;
        each(at, values)?;
        at += values.len();
    }
    Ok(())
}

/// `values` into `dst[at..]`, rounded as [`Backend::cast`] rounds.
fn cast_into(values: &[f32], dst: &mut FloatSliceMut<'_>, at: usize) {
    let end = at + values.len();
    let src = FloatSlice::F32(values);
    match dst {
        FloatSliceMut::F32(d) => d[at..end].copy_from_slice(values),
        FloatSliceMut::BF16(d) => kernels::cast(src, FloatSliceMut::BF16(&mut d[at..end])),
        FloatSliceMut::F16(d) => kernels::cast(src, FloatSliceMut::F16(&mut d[at..end])),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what a sink is given.
    struct Recorder {
        dtype: DType,
        values: Vec<f32>,
        pushed: Vec<CpuTensor>,
    }

    impl TensorSink for Recorder {
        fn dtype(&self, _: usize) -> DType {
            self.dtype
        }
        fn values(&mut self, _: usize, values: &[f32]) -> Result<()> {
            self.values.extend_from_slice(values);
            Ok(())
        }
        fn push(&mut self, _: usize, tensor: CpuTensor) -> Result<()> {
            self.pushed.push(tensor);
            Ok(())
        }
    }

    /// Chunks of whole rows, in order, at every chunk size: the narrowed tensor is the cast of
    /// the values filled, and the sink saw each value once, in order. f32 is filled once.
    #[test]
    fn chunks_are_whole_rows_in_order_and_the_tensor_is_their_cast() {
        let cpu = Cpu::new();
        let info = ParamInfo {
            name: "w".into(),
            shape: vec![5, 7],
            transposed_in_hf: false,
        };
        let value = |i: usize| (i as f32 * 0.731).sin() * 3.0 + 1e-3;
        let all: Vec<f32> = (0..35).map(value).collect();
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for chunk in [1, 6, 7, 8, 14, 20, 35, 100] {
                let mut sink = Recorder {
                    dtype,
                    values: Vec::new(),
                    pushed: Vec::new(),
                };
                let mut calls = Vec::new();
                let t = fill_tensor_by(&cpu, &info, 0, &mut sink, chunk, |at, x| {
                    calls.push((at, x.len()));
                    for (i, v) in x.iter_mut().enumerate() {
                        *v = value(at + i);
                    }
                    Ok(())
                })
                .unwrap();
                let rows = if dtype == DType::F32 {
                    5
                } else {
                    (chunk / 7).max(1)
                };
                let mut at = 0;
                for &(start, len) in &calls {
                    assert_eq!(
                        (start, len),
                        (at, (rows * 7).min(35 - at)),
                        "{dtype:?} {chunk}"
                    );
                    at += len;
                }
                assert_eq!(at, 35);
                let f32s = cpu.upload(&all, [5, 7]).unwrap();
                let mut as_f32 = cpu.zeros([5, 7], DType::F32).unwrap();
                cpu.cast(&t, &mut as_f32).unwrap();
                let mut want32 = cpu.zeros([5, 7], DType::F32).unwrap();
                let mut rounded = cpu.zeros([5, 7], dtype).unwrap();
                cpu.cast(&f32s, &mut rounded).unwrap();
                cpu.cast(&rounded, &mut want32).unwrap();
                assert_eq!(
                    cpu.download::<f32>(&as_f32).unwrap(),
                    cpu.download::<f32>(&want32).unwrap(),
                    "{dtype:?} {chunk}"
                );
                if dtype == DType::F32 {
                    assert!(sink.values.is_empty());
                } else {
                    assert_eq!(sink.values, all, "{dtype:?} {chunk}");
                }
            }
        }
    }
}
