//! Model shapes: the GPT-2 and Llama families.

use serde::{Deserialize, Serialize};

use crate::ops::rope::{Rope, RopeScaling};
use crate::{Result, TrainError};

/// Which architecture a [`ModelConfig`] describes, with what only that family has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Family {
    /// GPT-2: learned positions, layer norm with bias, GELU MLP 4C wide, biases everywhere,
    /// head tied to the token embedding.
    #[default]
    Gpt2,
    /// Llama: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases.
    Llama(LlamaShape),
}

/// What a Llama model has beyond the shared shape (Hugging Face `LlamaConfig`'s names in
/// brackets).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaShape {
    /// Key/value heads (`num_key_value_heads`): a divisor of the query heads; fewer is
    /// grouped-query attention.
    pub kv_heads: usize,
    /// Width of a head (`head_dim`) when it is not the model width over the heads, as in
    /// Qwen3 and Mistral Nemo: q, k and v are then `heads · head_dim` wide, not `C` (absent in
    /// checkpoints written before it existed: `C / heads`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Width of the SwiGLU MLP (`intermediate_size`).
    pub ffn: usize,
    /// Rotary base (`rope_theta`).
    pub rope_theta: f32,
    /// How the rotary frequencies are rescaled (`rope_scaling`, or transformers 5's
    /// `rope_parameters`; absent in checkpoints written before it existed: none).
    #[serde(default)]
    pub rope_scaling: RopeScaling,
    /// A sliding window of attention (`sliding_window`; absent in checkpoints written before
    /// it existed, and for a window no shorter than the context: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<SlidingWindow>,
    /// SmolLM3's NoPE blocks: every `k`-th block (blocks `k − 1`, `2k − 1`, …) attends without
    /// the rotary embedding (`no_rope_layer_interval`; absent for every other class: every
    /// block rotates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_rope_interval: Option<usize>,
    /// Gemma 3's `query_pre_attn_scalar` when it is not the head width (27B's 168 on heads of
    /// 128): attention scales `q·kᵀ` by its inverse square root instead of `1/√head_dim`
    /// (absent: the head width's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_pre_attn_scalar: Option<f32>,
    /// Granite's four scalar multipliers (`Some` exactly for Granite: its defaults of 1 still
    /// scale attention by 1, not `1/√head_dim`; absent for every other class).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multipliers: Option<Multipliers>,
    /// The token whose embedding row takes no gradient from the tokens that look it up
    /// (transformers' `pad_token_id`, PyTorch's `nn.Embedding(padding_idx=…)`); a tied head's
    /// gradient still reaches it (absent in checkpoints written before it existed: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padding_idx: Option<u32>,
    /// The Hugging Face class: what the checkpoints are saved as, and whether q, k and v have
    /// biases (Qwen2's; absent in checkpoints written before it existed: Llama).
    #[serde(default)]
    pub class: LlamaClass,
    /// RMSNorm epsilon (`rms_norm_eps`).
    pub norm_eps: f32,
    /// Whether the output head is the token embedding (`tie_word_embeddings`).
    pub tied_head: bool,
}

/// Granite's scalars (`GraniteConfig`'s names in brackets), each read as an f32 as PyTorch
/// multiplies an f32 tensor by a Python float.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Multipliers {
    /// The token embedding's rows are multiplied by it (`embedding_multiplier`; 12 in
    /// Granite 3).
    pub embedding: f32,
    /// Each sublayer's output is multiplied by it before the residual addition
    /// (`residual_multiplier`; 0.22).
    pub residual: f32,
    /// The softmax scale of `q·kᵀ`, in place of `1/√head_dim` (`attention_multiplier`).
    pub attention: f32,
    /// The logits are divided by it (`logits_scaling`; 8 or 16).
    pub logits_scaling: f32,
}

/// Attention over a sliding window: in the blocks from `first_layer` on, the query at position
/// `p` sees the keys `p − size < j ≤ p` only (transformers' `sliding_window`; Mistral 7B v0.1
/// windows every block, Qwen2's and Qwen3's `use_sliding_window` the blocks from
/// `max_window_layers` on, Gemma 3 five blocks of every six).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlidingWindow {
    /// Keys a query sees, its own included.
    pub size: usize,
    /// The first windowed block; the blocks before it attend to the whole context.
    pub first_layer: usize,
    /// Gemma 3's pattern: every `k`-th block (blocks `k − 1`, `2k − 1`, …) attends to the
    /// whole context (`sliding_window_pattern`, `layer_types`; absent for every other class:
    /// every block from `first_layer` on is windowed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_every: Option<usize>,
    /// Gemma 3's rotary base of the windowed blocks (`rope_local_base_freq`, transformers 5's
    /// `rope_parameters.sliding_attention`), unscaled; the other blocks keep the model's
    /// (absent: the model's in every block).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f32>,
}

impl SlidingWindow {
    /// A window of `size` keys in every block from `first_layer` on, with the model's rotary
    /// embedding (Mistral's, Qwen2's, Qwen3's).
    pub fn from_layer(size: usize, first_layer: usize) -> Self {
        SlidingWindow {
            size,
            first_layer,
            full_every: None,
            rope_theta: None,
        }
    }

    /// Whether block `l` attends over the window.
    pub fn covers(&self, l: usize) -> bool {
        l >= self.first_layer
            && self
                .full_every
                .is_none_or(|k| !(l + 1).is_multiple_of(k.max(1)))
    }
}

/// Which Hugging Face class a Llama-shaped model is. They compute alike but for Qwen2's
/// biases and Qwen3's query/key norms: a sliding window (Mistral's, Qwen2's, Qwen3's) is
/// refused when it would cut the context.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LlamaClass {
    /// `LlamaForCausalLM` (Llama 1-3, TinyLlama, SmolLM, SmolLM2, …).
    #[default]
    Llama,
    /// `MistralForCausalLM` (Mistral 7B v0.2 and v0.3): Llama's computation.
    Mistral,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): biases on the query, key and value projections
    /// (Llama's own `attention_bias` also biases the output projection; not supported).
    Qwen2,
    /// `Qwen3ForCausalLM` (Qwen3 dense): an RMSNorm over each query and key head (`q_norm`,
    /// `k_norm`, gains `[head_dim]`) before the rotation, no biases, and usually a head width
    /// that is not `C / heads`.
    Qwen3,
    /// `SmolLM3ForCausalLM` (SmolLM3): Llama whose every fourth block (by default) has no
    /// rotary embedding (NoPE; [`LlamaShape::no_rope_interval`]).
    SmolLM3,
    /// `Gemma3ForCausalLM` (Gemma 3 270M and 1B, text only): Qwen3's query/key norms; every
    /// RMSNorm's gain is `1 + w`; a second norm on the attention's and the MLP's outputs
    /// before each residual addition; a tanh-GELU gate (GeGLU) in the MLP; the token
    /// embedding scaled by `√C`; windowed blocks with their own rotary base
    /// ([`SlidingWindow`]).
    Gemma3,
    /// `Olmo2ForCausalLM` (OLMo 2): no norm on a sublayer's input; instead a norm on the
    /// attention's and the MLP's outputs before each residual addition (Gemma 3's output norms
    /// with plain gains), and an RMSNorm over the whole query and key projections
    /// (`[heads · head_dim]` gains) before they are split into heads.
    Olmo2,
    /// `Olmo3ForCausalLM` (OLMo 3): OLMo 2 with a sliding window in three blocks of four,
    /// whose rotary embedding is not rescaled ([`SlidingWindow`]).
    Olmo3,
    /// `GraniteForCausalLM` (IBM Granite 3.x dense): Llama with four scalar multipliers — of
    /// the embedding, of each sublayer's output before the residual addition, of `q·kᵀ` in
    /// place of `1/√head_dim`, and a divisor of the logits ([`Multipliers`]).
    Granite,
}

/// Where a class normalises its queries and keys (before the rotation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    /// Over each head: gains `[head_dim]`, one statistic per head and position (Qwen3's,
    /// Gemma 3's `q_norm` and `k_norm`).
    PerHead,
    /// Over the whole projection before it is split into heads: gains `[heads · head_dim]`,
    /// one statistic per position (OLMo 2's).
    Projection,
}

impl LlamaClass {
    /// Every class.
    pub const ALL: [LlamaClass; 9] = [
        LlamaClass::Llama,
        LlamaClass::Mistral,
        LlamaClass::Qwen2,
        LlamaClass::Qwen3,
        LlamaClass::SmolLM3,
        LlamaClass::Gemma3,
        LlamaClass::Olmo2,
        LlamaClass::Olmo3,
        LlamaClass::Granite,
    ];

    /// transformers' class name (`architectures`).
    pub fn architecture(self) -> &'static str {
        match self {
            LlamaClass::Llama => "LlamaForCausalLM",
            LlamaClass::Mistral => "MistralForCausalLM",
            LlamaClass::Qwen2 => "Qwen2ForCausalLM",
            LlamaClass::Qwen3 => "Qwen3ForCausalLM",
            LlamaClass::SmolLM3 => "SmolLM3ForCausalLM",
            LlamaClass::Gemma3 => "Gemma3ForCausalLM",
            LlamaClass::Olmo2 => "Olmo2ForCausalLM",
            LlamaClass::Olmo3 => "Olmo3ForCausalLM",
            LlamaClass::Granite => "GraniteForCausalLM",
        }
    }

    /// transformers' `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            LlamaClass::Llama => "llama",
            LlamaClass::Mistral => "mistral",
            LlamaClass::Qwen2 => "qwen2",
            LlamaClass::Qwen3 => "qwen3",
            LlamaClass::SmolLM3 => "smollm3",
            LlamaClass::Gemma3 => "gemma3_text",
            LlamaClass::Olmo2 => "olmo2",
            LlamaClass::Olmo3 => "olmo3",
            LlamaClass::Granite => "granite",
        }
    }

    /// The class `architectures` names, if it is one of these.
    pub fn of_architecture(name: &str) -> Option<LlamaClass> {
        Self::ALL.into_iter().find(|c| c.architecture() == name)
    }
}

/// An RMSNorm's settings: `y = x · rstd · (w + gain_offset)`, `rstd = 1/√(mean(x²) + eps)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNorm {
    /// Added to the mean square before the root (`rms_norm_eps`).
    pub eps: f32,
    /// Added to each stored gain before it multiplies: 0, or Gemma's 1 (its gains are stored
    /// as the offset from 1 and initialised to 0). The sum is rounded to f32 once, as
    /// transformers' `1.0 + weight.float()` is.
    pub gain_offset: f32,
}

/// The elementwise gate of a gated MLP, `act(gate) · up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpGate {
    /// `silu(g) = g · σ(g)` (Llama's SwiGLU).
    Silu,
    /// GELU with the tanh approximation (Gemma's GeGLU, `gelu_pytorch_tanh`).
    GeluTanh,
}

impl LlamaShape {
    /// Whether q, k and v add a bias (Qwen2).
    pub fn qkv_bias(&self) -> bool {
        self.class == LlamaClass::Qwen2
    }

    /// Whether the queries and keys are RMS-normalised before the rotation (Qwen3, Gemma 3,
    /// OLMo 2 and 3).
    pub fn qk_norm(&self) -> bool {
        self.qk_norm_kind().is_some()
    }

    /// How the queries and keys are RMS-normalised, if they are: per head (Qwen3, Gemma 3) or
    /// over the whole projection (OLMo 2 and 3).
    pub fn qk_norm_kind(&self) -> Option<QkNorm> {
        match self.class {
            LlamaClass::Qwen3 | LlamaClass::Gemma3 => Some(QkNorm::PerHead),
            LlamaClass::Olmo2 | LlamaClass::Olmo3 => Some(QkNorm::Projection),
            _ => None,
        }
    }

    /// Whether the attention's and the MLP's outputs are RMS-normalised before they are added
    /// to the residual stream (Gemma 3's and OLMo 2's `post_attention_layernorm` and
    /// `post_feedforward_layernorm`).
    pub fn output_norms(&self) -> bool {
        matches!(
            self.class,
            LlamaClass::Gemma3 | LlamaClass::Olmo2 | LlamaClass::Olmo3
        )
    }

    /// Whether each sublayer normalises its input (`input_layernorm` before attention, the
    /// MLP's input norm): every class but OLMo 2 and 3, which normalise the outputs instead.
    pub fn input_norms(&self) -> bool {
        !matches!(self.class, LlamaClass::Olmo2 | LlamaClass::Olmo3)
    }

    /// Whether a sliding window may skip blocks by a pattern (`full_every`) and rotate with a
    /// base of its own: Gemma 3's and OLMo 3's `layer_types`.
    pub fn typed_layers(&self) -> bool {
        matches!(self.class, LlamaClass::Gemma3 | LlamaClass::Olmo3)
    }

    /// Every RMSNorm of the model: its epsilon, and the `1` Gemma 3 adds to each stored gain.
    pub fn rms_norm(&self) -> RmsNorm {
        RmsNorm {
            eps: self.norm_eps,
            gain_offset: if self.class == LlamaClass::Gemma3 {
                1.0
            } else {
                0.0
            },
        }
    }

    /// The MLP's gate: SiLU (SwiGLU), or Gemma 3's tanh GELU (GeGLU).
    pub fn mlp_gate(&self) -> MlpGate {
        match self.class {
            LlamaClass::Gemma3 => MlpGate::GeluTanh,
            _ => MlpGate::Silu,
        }
    }

    /// What the token embedding is multiplied by: Gemma 3's `√C` as transformers rounds it to
    /// f32 (`hidden_size ** 0.5` in Python, then an f32 tensor), Granite's
    /// `embedding_multiplier` unless it is 1, 1 elsewhere (`None`).
    pub fn embedding_scale(&self, channels: usize) -> Option<f32> {
        if self.class == LlamaClass::Gemma3 {
            return Some((channels as f64).sqrt() as f32);
        }
        self.multipliers.map(|m| m.embedding).filter(|&e| e != 1.0)
    }

    /// The multiplier of `q·kᵀ` when it is not `1/√head_dim` (Gemma 3's
    /// `query_pre_attn_scalar^−½`, rounded to f32 as torch rounds a Python float scale;
    /// Granite's `attention_multiplier`).
    pub fn softmax_scale(&self) -> Option<f32> {
        self.query_pre_attn_scalar
            .map(|s| (f64::from(s)).powf(-0.5) as f32)
            .or(self.multipliers.map(|m| m.attention))
    }

    /// What each sublayer's output is multiplied by before the residual addition (Granite's
    /// `residual_multiplier`), unless it is 1.
    pub fn residual_scale(&self) -> Option<f32> {
        self.multipliers.map(|m| m.residual).filter(|&r| r != 1.0)
    }

    /// What the logits are divided by (Granite's `logits_scaling`), unless it is 1.
    pub fn logits_divisor(&self) -> Option<f32> {
        self.multipliers
            .map(|m| m.logits_scaling)
            .filter(|&d| d != 1.0)
    }

    /// The rotary embedding: the base and its rescaling.
    pub fn rope(&self) -> Rope {
        Rope {
            theta: self.rope_theta,
            scaling: self.rope_scaling,
        }
    }
}

/// The shape of a model of either family.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence (rows of the position embedding).
    pub max_seq: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads per block.
    pub heads: usize,
    /// Model width.
    pub channels: usize,
    /// The architecture (GPT-2 when absent, as in checkpoints written before Llama existed).
    #[serde(default)]
    pub family: Family,
}

impl ModelConfig {
    /// The most blocks a config may have (GPT-3 175B has 96).
    pub const MAX_LAYERS: usize = 4096;
    /// The widest model (GPT-3 175B is 12288 wide).
    pub const MAX_CHANNELS: usize = 1 << 17;
    /// The longest context.
    pub const MAX_CONTEXT: usize = 1 << 24;
    /// The most parameters (2⁴⁰, 4 TiB of f32 masters): anything larger is a typo or a hostile
    /// file, and would overflow the byte sizes derived from it.
    pub const MAX_PARAMETERS: u64 = 1 << 40;

    /// For tests and the default run: trains in seconds on 2 cores.
    pub fn tiny(vocab: usize) -> Self {
        ModelConfig {
            vocab,
            max_seq: 64,
            layers: 2,
            heads: 2,
            channels: 64,
            family: Family::Gpt2,
        }
    }

    /// The size used for comparisons: 6 layers, 6 heads, width 384, context 256.
    pub fn small(vocab: usize) -> Self {
        ModelConfig {
            vocab,
            max_seq: 256,
            layers: 6,
            heads: 6,
            channels: 384,
            family: Family::Gpt2,
        }
    }

    /// GPT-2 124M.
    pub fn gpt2() -> Self {
        ModelConfig {
            vocab: 50257,
            max_seq: 1024,
            layers: 12,
            heads: 12,
            channels: 768,
            family: Family::Gpt2,
        }
    }

    /// Llama-shaped and small enough for tests that train in seconds: 2 layers, 4 query
    /// heads sharing 2 key/value heads, width 64, SwiGLU width 176, untied head.
    pub fn llama_tiny(vocab: usize) -> Self {
        ModelConfig {
            vocab,
            max_seq: 64,
            layers: 2,
            heads: 4,
            channels: 64,
            family: Family::Llama(LlamaShape {
                kv_heads: 2,
                head_dim: None,
                sliding_window: None,
                no_rope_interval: None,
                query_pre_attn_scalar: None,
                multipliers: None,
                padding_idx: None,
                ffn: 176,
                rope_theta: 10_000.0,
                rope_scaling: Default::default(),
                class: Default::default(),
                norm_eps: 1e-5,
                tied_head: false,
            }),
        }
    }

    /// The Llama of about `small`'s size, for comparisons: 6 layers, 6 query heads over 2
    /// key/value heads, width 384, SwiGLU width 1024 (Llama's 8/3·C), context 256, untied.
    pub fn llama_small(vocab: usize) -> Self {
        ModelConfig {
            vocab,
            max_seq: 256,
            layers: 6,
            heads: 6,
            channels: 384,
            family: Family::Llama(LlamaShape {
                kv_heads: 2,
                head_dim: None,
                sliding_window: None,
                no_rope_interval: None,
                query_pre_attn_scalar: None,
                multipliers: None,
                padding_idx: None,
                ffn: 1024,
                rope_theta: 10_000.0,
                rope_scaling: Default::default(),
                class: Default::default(),
                norm_eps: 1e-5,
                tied_head: false,
            }),
        }
    }

    /// Whether block `l` rotates its queries and keys (all but SmolLM3's NoPE blocks).
    pub fn rotates(&self, l: usize) -> bool {
        match self.family {
            Family::Llama(LlamaShape {
                no_rope_interval: Some(k),
                ..
            }) => !(l + 1).is_multiple_of(k.max(1)),
            _ => true,
        }
    }

    /// The rotary embedding of block `l`: the model's, Gemma 3's own base in its windowed
    /// blocks, `None` in SmolLM3's NoPE blocks and for GPT-2.
    pub fn rope_of(&self, l: usize) -> Option<Rope> {
        let Family::Llama(s) = self.family else {
            return None;
        };
        if !self.rotates(l) {
            return None;
        }
        match s.sliding_window {
            Some(w) if w.covers(l) => w.rope_theta.map(|theta| Rope {
                theta,
                scaling: RopeScaling::None,
            }),
            _ => None,
        }
        .or(Some(s.rope()))
    }

    /// The sliding window block `l` attends over (`None`: the whole context).
    pub fn window_of(&self, l: usize) -> Option<usize> {
        match self.family {
            Family::Llama(LlamaShape {
                sliding_window: Some(w),
                ..
            }) if w.covers(l) => Some(w.size),
            _ => None,
        }
    }

    /// Head dimension: a Llama's own `head_dim`, else `C / heads`.
    pub fn head_dim(&self) -> usize {
        match self.family {
            Family::Llama(LlamaShape {
                head_dim: Some(hs), ..
            }) => hs,
            _ => self.channels / self.heads.max(1),
        }
    }

    /// Width of the queries and of the attention output, `heads · head_dim`: `C` unless a
    /// Llama sets its own head width. Saturates; [`ModelConfig::validate`] bounds it.
    pub fn attention_width(&self) -> usize {
        self.heads.saturating_mul(self.head_dim())
    }

    /// Key/value heads (the query heads' count outside grouped-query attention).
    pub fn kv_heads(&self) -> usize {
        match self.family {
            Family::Gpt2 => self.heads,
            Family::Llama(s) => s.kv_heads,
        }
    }

    /// Width of the MLP's hidden layer (`4C` for GPT-2).
    pub fn ffn(&self) -> usize {
        match self.family {
            Family::Gpt2 => 4 * self.channels,
            Family::Llama(s) => s.ffn,
        }
    }

    /// The shape in one line: the class (`gpt2`, `llama`, `mistral`, `qwen2`, `qwen3`,
    /// `smollm3`, `gemma3_text`), blocks, heads (with their width when it is not `C / heads`),
    /// width, a sliding window and NoPE blocks: `llama 2L/4H/64C`, `qwen3
    /// 28L/16H×128/1024C`, `mistral 32L/32H/4096C window 4096`, `smollm3 36L/16H/2048C NoPE
    /// every 4`, `gemma3_text 18L/4H×256/640C window 512, full every 6`.
    pub fn shape_name(&self) -> String {
        let (class, own_head_dim, window, nope) = match self.family {
            Family::Gpt2 => ("gpt2", None, None, None),
            Family::Llama(s) => (
                s.class.model_type(),
                s.head_dim,
                s.sliding_window,
                s.no_rope_interval,
            ),
        };
        let heads = match own_head_dim {
            Some(hs) => format!("{}H×{hs}", self.heads),
            None => format!("{}H", self.heads),
        };
        let window = match window {
            Some(w) => {
                let from = match w.first_layer {
                    0 => String::new(),
                    first => format!(" from block {first}"),
                };
                let full = w
                    .full_every
                    .map_or(String::new(), |k| format!(", full every {k}"));
                format!(" window {}{from}{full}", w.size)
            }
            None => String::new(),
        };
        let nope = nope.map_or(String::new(), |k| format!(" NoPE every {k}"));
        format!(
            "{class} {}L/{heads}/{}C{window}{nope}",
            self.layers, self.channels
        )
    }

    /// Short name of the family: `gpt2` or `llama`.
    pub fn family_name(&self) -> &'static str {
        match self.family {
            Family::Gpt2 => "gpt2",
            Family::Llama(_) => "llama",
        }
    }

    /// Parameter tensors: GPT-2's `wte`, `wpe`, 12 per block and `ln_f`'s two; Llama's
    /// embedding, 9 per block, the final norm and an untied head.
    pub fn tensor_count(&self) -> Result<usize> {
        let per_layer = crate::model::params::per_layer(self);
        let outside = match self.family {
            Family::Gpt2 => 4,
            Family::Llama(s) => 2 + usize::from(!s.tied_head),
        };
        self.layers
            .checked_mul(per_layer)
            .and_then(|n| n.checked_add(outside))
            .ok_or_else(|| TrainError::Config(format!("{} layers overflow", self.layers)))
    }

    /// Parameters, every product checked. GPT-2: `V·C + T·C + L·(12C² + 13C) + 2C`. Llama:
    /// `V·C·(1 or 2) + L·(2C·(NH·hs + KV·hs) + 3C·F + 2C (+ NH·hs + 2·KV·hs with q/k/v
    /// biases, + 2·hs with per-head query/key norms or NH·hs + KV·hs with projection-wide
    /// ones, + 2C with output norms, − 2C without input norms)) + C`.
    pub fn parameter_count(&self) -> Result<u64> {
        let (v, t, l, c) = (
            self.vocab as u64,
            self.max_seq as u64,
            self.layers as u64,
            self.channels as u64,
        );
        let overflow =
            || TrainError::Config(format!("the parameter count of {self:?} overflows 64 bits"));
        match self.family {
            Family::Gpt2 => {
                let per_layer = c
                    .checked_mul(c)
                    .and_then(|c2| c2.checked_mul(12))
                    .and_then(|x| x.checked_add(c.checked_mul(13)?));
                v.checked_add(t)
                    .and_then(|vt| vt.checked_mul(c))
                    .and_then(|e| e.checked_add(l.checked_mul(per_layer?)?))
                    .and_then(|x| x.checked_add(c.checked_mul(2)?))
                    .ok_or_else(overflow)
            }
            Family::Llama(s) => {
                let hs = self.head_dim() as u64;
                let q = (self.heads as u64).checked_mul(hs).ok_or_else(overflow)?;
                let kv = (s.kv_heads as u64).checked_mul(hs).ok_or_else(overflow)?;
                let f = s.ffn as u64;
                // q and o are C×q, k and v C×kv, three C×F, two norms; with Qwen2's biases,
                // q + 2·kv more; with query and key norms, 2·hs (per head) or q + kv (over the
                // projections) more; with output norms, 2·C more; without input norms (OLMo
                // 2's), 2·C fewer.
                let biases = if s.qkv_bias() { q + 2 * kv } else { 0 };
                let qk_norms = match s.qk_norm_kind() {
                    Some(QkNorm::PerHead) => 2 * hs,
                    Some(QkNorm::Projection) => q + kv,
                    None => 0,
                } + if s.output_norms() { 2 * c } else { 0 };
                let input_norms = if s.input_norms() { 2 * c } else { 0 };
                let per_layer = q
                    .checked_add(kv)
                    .and_then(|x| x.checked_mul(c)?.checked_mul(2))
                    .and_then(|x| x.checked_add(c.checked_mul(f)?.checked_mul(3)?))
                    .and_then(|x| x.checked_add(input_norms))
                    .and_then(|x| x.checked_add(biases)?.checked_add(qk_norms));
                let heads = if s.tied_head { 1u64 } else { 2 };
                v.checked_mul(c)
                    .and_then(|e| e.checked_mul(heads))
                    .and_then(|e| e.checked_add(l.checked_mul(per_layer?)?))
                    .and_then(|x| x.checked_add(c))
                    .ok_or_else(overflow)
            }
        }
    }

    /// Check that the shapes are consistent and within [`ModelConfig::MAX_PARAMETERS`] and the
    /// per-dimension limits, with every size product checked (so a config read from a file
    /// can be trusted to size allocations).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TrainError::Config(m));
        if self.vocab == 0
            || self.max_seq == 0
            || self.layers == 0
            || self.heads == 0
            || self.channels == 0
        {
            return bad(format!("every dimension must be positive: {self:?}"));
        }
        let own_head_dim = match self.family {
            Family::Llama(s) => s.head_dim,
            Family::Gpt2 => None,
        };
        match own_head_dim {
            None if !self.channels.is_multiple_of(self.heads) => {
                return bad(format!(
                    "channels {} not divisible by heads {}",
                    self.channels, self.heads
                ));
            }
            Some(hs)
                if hs == 0
                    || self
                        .heads
                        .checked_mul(hs)
                        .is_none_or(|w| w > Self::MAX_CHANNELS) =>
            {
                return bad(format!(
                    "head dimension {hs} × {} heads must be in 1..={}",
                    self.heads,
                    Self::MAX_CHANNELS
                ));
            }
            _ => {}
        }
        if let Family::Llama(s) = self.family {
            let hs = self.head_dim();
            if s.kv_heads == 0 || !self.heads.is_multiple_of(s.kv_heads) {
                return bad(format!(
                    "key/value heads {} must divide the {} query heads",
                    s.kv_heads, self.heads
                ));
            }
            if !hs.is_multiple_of(2) {
                return bad(format!(
                    "rotary embeddings need an even head dimension, not {hs}"
                ));
            }
            if s.ffn == 0 || s.ffn > Self::MAX_CHANNELS * 8 {
                return bad(format!(
                    "SwiGLU width {} out of 1..={}",
                    s.ffn,
                    Self::MAX_CHANNELS * 8
                ));
            }
            if !(s.rope_theta.is_finite() && s.rope_theta > 1.0) {
                return bad(format!(
                    "rope theta {} must be finite and above 1",
                    s.rope_theta
                ));
            }
            if let Some(w) = s.sliding_window {
                if w.size == 0 || w.first_layer >= self.layers {
                    return bad(format!(
                        "sliding window of {} keys from block {} (of {}): a window holds at \
                         least one key and starts at an existing block",
                        w.size, w.first_layer, self.layers
                    ));
                }
                // What the class's config can say: Mistral windows every block, Qwen2 and
                // Qwen3 the blocks from one on, Llama and OLMo 2 none; Gemma 3 and OLMo 3 a
                // window in every block but every k-th, with its own rotary base.
                let expressible = match s.class {
                    LlamaClass::Llama
                    | LlamaClass::SmolLM3
                    | LlamaClass::Olmo2
                    | LlamaClass::Granite => false,
                    LlamaClass::Mistral | LlamaClass::Gemma3 | LlamaClass::Olmo3 => {
                        w.first_layer == 0
                    }
                    LlamaClass::Qwen2 | LlamaClass::Qwen3 => true,
                };
                let typed = s.typed_layers();
                if !expressible
                    || (w.full_every.is_some() && !typed)
                    || (w.rope_theta.is_some() && !typed)
                {
                    return bad(format!(
                        "{} cannot hold a sliding window from block {}{}{}",
                        s.class.architecture(),
                        w.first_layer,
                        w.full_every
                            .map_or(String::new(), |k| format!(", full every {k}")),
                        w.rope_theta
                            .map_or(String::new(), |t| format!(", rotary base {t}"))
                    ));
                }
                if w.full_every == Some(0) {
                    return bad(
                        "a sliding window's full-attention interval must be positive".into(),
                    );
                }
                if let Some(theta) = w.rope_theta {
                    if !(theta.is_finite() && theta > 1.0) {
                        return bad(format!(
                            "the windowed blocks' rope theta {theta} must be finite and above 1"
                        ));
                    }
                }
            }
            match (s.no_rope_interval, s.class) {
                (None, LlamaClass::SmolLM3) | (Some(0), _) => {
                    return bad("SmolLM3's NoPE interval must be a positive block count".into())
                }
                (Some(k), class) if class != LlamaClass::SmolLM3 => {
                    return bad(format!(
                        "{} cannot hold NoPE blocks (every {k}th)",
                        class.architecture()
                    ))
                }
                _ => {}
            }
            if let Err(e) = s.rope_scaling.check() {
                return bad(e);
            }
            match s.query_pre_attn_scalar {
                Some(q) if s.class != LlamaClass::Gemma3 => {
                    return bad(format!(
                        "{} has no query_pre_attn_scalar ({q})",
                        s.class.architecture()
                    ))
                }
                Some(q) if !(q.is_finite() && q > 0.0) => {
                    return bad(format!(
                        "query_pre_attn_scalar {q} must be finite and positive"
                    ))
                }
                _ => {}
            }
            match (s.multipliers, s.class) {
                (None, LlamaClass::Granite) => {
                    return bad("a Granite model needs its four multipliers".into())
                }
                (Some(_), class) if class != LlamaClass::Granite => {
                    return bad(format!("{} has no multipliers", class.architecture()))
                }
                (Some(m), _) => {
                    for (name, v) in [
                        ("embedding_multiplier", m.embedding),
                        ("residual_multiplier", m.residual),
                        ("attention_multiplier", m.attention),
                        ("logits_scaling", m.logits_scaling),
                    ] {
                        if !(v.is_finite() && v > 0.0) {
                            return bad(format!("{name} {v} must be finite and positive"));
                        }
                    }
                }
                (None, _) => {}
            }
            if let Some(p) = s.padding_idx.filter(|&p| p as usize >= self.vocab) {
                return bad(format!(
                    "padding index {p} is not a row of the {}-token embedding",
                    self.vocab
                ));
            }
            if !(s.norm_eps.is_finite() && s.norm_eps > 0.0) {
                return bad(format!(
                    "RMSNorm epsilon {} must be finite and positive",
                    s.norm_eps
                ));
            }
        }
        if self.vocab > u32::MAX as usize {
            return bad(format!("vocab {} does not fit token ids (u32)", self.vocab));
        }
        for (name, value, max) in [
            ("layers", self.layers, Self::MAX_LAYERS),
            ("channels", self.channels, Self::MAX_CHANNELS),
            ("max_seq (context)", self.max_seq, Self::MAX_CONTEXT),
        ] {
            if value > max {
                return bad(format!("{name} {value} exceeds the supported {max}"));
            }
        }
        let n = self.parameter_count()?;
        if n > Self::MAX_PARAMETERS {
            return bad(format!(
                "{n} parameters exceed the supported {} ({self:?})",
                Self::MAX_PARAMETERS
            ));
        }
        Ok(())
    }
}
