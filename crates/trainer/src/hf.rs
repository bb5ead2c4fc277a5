//! Hugging Face model directories in: `config.json` plus `model.safetensors` (or a sharded
//! `model.safetensors.index.json`) for `GPT2LMHeadModel`, `LlamaForCausalLM`,
//! `MistralForCausalLM` (Llama's computation over a sliding window), `Qwen2ForCausalLM`
//! (Llama with q/k/v biases), `Qwen3ForCausalLM` (Llama with an RMSNorm of each query and
//! key head) and `SmolLM3ForCausalLM` (Llama with blocks that skip the rotation), any of them
//! with its own head width, Mistral and the Qwens with their sliding windows, with the tensor
//! names and layouts transformers writes.
//!
//! Memory: each tensor is read from its file in bounded chunks straight into its fp32 master
//! (allocated through the backend, so the tracker counts it as `Parameters`), converting
//! bf16/f16 on the way and reading GPT-2's `Conv1D` weights transposed; nothing holds a second
//! copy of the model, nor of a tensor. A consumer that keeps bf16 or f16 copies only
//! ([`load_into`] with a [`TensorSink`]) gets them converted chunk by chunk, without the
//! tensor's f32 copy. The safetensors header is parsed and checked here (offsets inside the
//! file, no overlap, byte length = elements × dtype size, every product checked) before any
//! size from it reaches an allocation.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use headroom_tensor::{Cpu, CpuTensor};
use serde_json::Value;

use crate::model::params::{self, EachF32, TensorSink};
use crate::model::{
    Family, LlamaClass, LlamaShape, ModelConfig, Multipliers, RopeScaling, SlidingWindow,
};
use crate::{Result, TrainError};

/// The largest safetensors header read (transformers' files hold a few hundred KiB).
const MAX_HEADER_BYTES: u64 = 100 << 20;
/// Bytes read per chunk while converting a tensor.
const CHUNK_BYTES: usize = 1 << 20;

fn bad(path: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::Pretrained {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StoredDtype {
    F32,
    Bf16,
    F16,
}

impl StoredDtype {
    fn size(self) -> u64 {
        match self {
            StoredDtype::F32 => 4,
            StoredDtype::Bf16 | StoredDtype::F16 => 2,
        }
    }
}

/// One tensor of a safetensors file: where its bytes are and what they hold.
#[derive(Clone, Debug)]
pub(crate) struct Stored {
    pub(crate) file: PathBuf,
    pub(crate) dtype: StoredDtype,
    pub(crate) shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub(crate) start: u64,
    pub(crate) end: u64,
}

/// The tensors of one safetensors file, from its header, checked against the file's length.
pub(crate) fn read_header(path: &Path) -> Result<BTreeMap<String, Stored>> {
    let io = |e: std::io::Error| bad(path, e.to_string());
    let mut f = File::open(path).map_err(io)?;
    let file_len = f.metadata().map_err(io)?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| bad(path, "shorter than a safetensors header"))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER_BYTES || n > file_len.saturating_sub(8) {
        return Err(bad(
            path,
            format!("header of {n} bytes in a file of {file_len}"),
        ));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(io)?;
    let json: Value = serde_json::from_slice(&header)
        .map_err(|e| bad(path, format!("header is not JSON: {e}")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| bad(path, "header is not a JSON object"))?;
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let mut out = BTreeMap::new();
    let mut ranges = Vec::new();
    for (name, entry) in obj {
        if name == "__metadata__" {
            continue;
        }
        let field = |k: &str| {
            entry
                .get(k)
                .ok_or_else(|| bad(path, format!("{name}: no {k}")))
        };
        let dtype = match field("dtype")?.as_str() {
            Some("F32") => StoredDtype::F32,
            Some("BF16") => StoredDtype::Bf16,
            Some("F16") => StoredDtype::F16,
            other => {
                return Err(bad(
                    path,
                    format!("{name}: dtype {other:?} (F32, BF16 and F16 load)"),
                ))
            }
        };
        let shape = field("shape")?
            .as_array()
            .ok_or_else(|| bad(path, format!("{name}: shape is not a list")))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .and_then(|d| usize::try_from(d).ok())
                    .ok_or_else(|| bad(path, format!("{name}: bad dimension {d}")))
            })
            .collect::<Result<Vec<usize>>>()?;
        let offsets = field("data_offsets")?
            .as_array()
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
            .ok_or_else(|| bad(path, format!("{name}: data_offsets is not [begin, end]")))?;
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(|| bad(path, format!("{name}: shape {shape:?} overflows")))?;
        let bytes = numel
            .checked_mul(dtype.size())
            .ok_or_else(|| bad(path, format!("{name}: byte size overflows")))?;
        if offsets.0 > offsets.1 || offsets.1 > data_len || offsets.1 - offsets.0 != bytes {
            return Err(bad(
                path,
                format!(
                    "{name}: bytes {}..{} do not hold {numel} {dtype:?} values inside the {data_len} \
                     data bytes",
                    offsets.0, offsets.1
                ),
            ));
        }
        ranges.push((offsets.0, offsets.1, name.clone()));
        out.insert(
            name.clone(),
            Stored {
                file: path.to_path_buf(),
                dtype,
                shape,
                start: data_start + offsets.0,
                end: data_start + offsets.1,
            },
        );
    }
    ranges.sort();
    for w in ranges.windows(2) {
        if w[0].1 > w[1].0 {
            return Err(bad(path, format!("{} and {} overlap", w[0].2, w[1].2)));
        }
    }
    // As the safetensors reader requires: the tensors cover the data bytes exactly, no gap
    // (bytes no tensor owns), nothing after the last.
    let mut covered = 0;
    for (start, end, _) in &ranges {
        if *start != covered {
            break;
        }
        covered = *end;
    }
    if covered != data_len {
        return Err(bad(
            path,
            format!("the tensors cover {covered} of the {data_len} data bytes"),
        ));
    }
    Ok(out)
}

/// Every tensor of a model directory: `model.safetensors`, or the shards a
/// `model.safetensors.index.json` names.
pub(crate) fn read_tensors(dir: &Path) -> Result<BTreeMap<String, Stored>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return read_header(&single);
    }
    let index = dir.join("model.safetensors.index.json");
    if std::fs::symlink_metadata(&index).is_err() {
        return Err(bad(
            dir,
            "neither model.safetensors nor model.safetensors.index.json",
        ));
    }
    let text = read_json(&index)?;
    let json: Value =
        serde_json::from_slice(&text).map_err(|e| bad(&index, format!("not JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad(&index, "no weight_map"))?;
    let mut shards: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(&index, format!("{name}: shard is not a file name")))?;
        // A shard is a file beside the index, never a path elsewhere.
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(bad(
                &index,
                format!("{name}: shard {file:?} is not a plain name"),
            ));
        }
        shards
            .entry(file.to_string())
            .or_default()
            .push(name.clone());
    }
    let mut out = BTreeMap::new();
    for (file, names) in shards {
        let mut tensors = read_header(&dir.join(&file))?;
        for name in names {
            let t = tensors.remove(&name).ok_or_else(|| {
                bad(
                    &dir.join(&file),
                    format!("{name} is in the index but not the shard"),
                )
            })?;
            out.insert(name, t);
        }
    }
    Ok(out)
}

/// A JSON file of a model directory, bounded like a checkpoint's (a symlink to a device would
/// otherwise be read until memory runs out).
fn read_json(path: &Path) -> Result<Vec<u8>> {
    crate::bounded::read_file(path, crate::checkpoint::MAX_JSON_BYTES)
        .map_err(|reason| bad(path, format!("cannot read it: {reason}")))
}

fn get<'a>(cfg: &'a Value, path: &Path, key: &str) -> Result<&'a Value> {
    cfg.get(key)
        .ok_or_else(|| bad(path, format!("config.json has no {key}")))
}

fn get_usize(cfg: &Value, path: &Path, key: &str) -> Result<usize> {
    get(cfg, path, key)?
        .as_u64()
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| bad(path, format!("{key} is not a non-negative integer")))
}

// A setting of the wrong JSON type is refused, never read as its default: transformers would
// act on it (Python truthiness makes `"tie_word_embeddings": 1` tie the head) or fail, so a
// default here could silently compute another model than the file's. Absent and `null` mean
// the default, as they do there.

/// `key`'s string, `None` when absent or null; any other type is an error.
fn get_str<'a>(cfg: &'a Value, path: &Path, key: &str) -> Result<Option<&'a str>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(bad(path, format!("{key} is {v:.40}, not a string"))),
    }
}

/// `key`'s boolean, `None` when absent or null; any other type is an error.
fn get_bool(cfg: &Value, path: &Path, key: &str) -> Result<Option<bool>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(bad(path, format!("{key} is {v:.40}, not true or false"))),
    }
}

/// `key`'s object, `None` when absent or null; any other type is an error.
fn get_object<'a>(cfg: &'a Value, path: &Path, key: &str) -> Result<Option<&'a Value>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => Ok(Some(v)),
        Some(v) => Err(bad(path, format!("{key} is {v:.40}, not an object"))),
    }
}

fn get_f64(cfg: &Value, path: &Path, key: &str) -> Result<Option<f64>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| bad(path, format!("{key} is not a number"))),
    }
}

/// The rescaling a `rope_parameters` (transformers 5) or `rope_scaling` (4) object names by
/// its `rope_type` (`type` in configs older than transformers 4.43; neither is `default`, as
/// there); a kind whose arithmetic is not implemented here is refused, never read as
/// unscaled. `cfg` is the whole config: llama3's and yarn's original context is, as
/// transformers' `standardize_rope_params` takes it, a top-level
/// `original_max_position_embeddings`, else the object's, else `max_position_embeddings`.
fn rope_scaling(obj: &Value, cfg: &Value, path: &Path) -> Result<RopeScaling> {
    let kind = match get_str(obj, path, "rope_type")? {
        Some(k) => Some(k),
        None => get_str(obj, path, "type")?,
    };
    let number = |key: &str| -> Result<f32> {
        get_f64(obj, path, key)?
            .map(|v| v as f32)
            .ok_or_else(|| bad(path, format!("rope type {kind:?} needs {key}")))
    };
    // llama3's and yarn's original context, as transformers' `standardize_rope_params` takes it.
    let original = || -> Result<usize> {
        let key = "original_max_position_embeddings";
        let present = |v: &Value| v.get(key).is_some_and(|x| !x.is_null());
        if present(cfg) {
            get_usize(cfg, path, key)
        } else if present(obj) {
            get_usize(obj, path, key)
        } else {
            get_usize(cfg, path, "max_position_embeddings")
        }
    };
    let scaling = match kind {
        None | Some("default") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear {
            factor: number("factor")?,
        },
        Some("llama3") => RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: original()?,
        },
        Some("yarn") => {
            let original = original()?;
            // Python's numbers, f64 until torch meets them: a missing factor is the context
            // over the original, and the attention factor follows from the factor.
            let factor = match get_f64(obj, path, "factor")? {
                Some(f) => f,
                None => get_usize(cfg, path, "max_position_embeddings")? as f64 / original as f64,
            };
            let mscale = |m: f64| {
                if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * m * factor.ln() + 1.0
                }
            };
            let truthy = |key: &str| -> Result<Option<f64>> {
                Ok(get_f64(obj, path, key)?.filter(|&v| v != 0.0))
            };
            let attention_factor = match get_f64(obj, path, "attention_factor")? {
                Some(a) => a,
                None => match (truthy("mscale")?, truthy("mscale_all_dim")?) {
                    (Some(m), Some(all)) => mscale(m) / mscale(all),
                    _ => mscale(1.0),
                },
            };
            RopeScaling::Yarn {
                factor: factor as f32,
                original_max_position_embeddings: original,
                beta_fast: truthy("beta_fast")?.unwrap_or(32.0),
                beta_slow: truthy("beta_slow")?.unwrap_or(1.0),
                attention_factor: attention_factor as f32,
                truncate: get_bool(obj, path, "truncate")?.unwrap_or(true),
            }
        }
        Some(other) => {
            return Err(bad(
                path,
                format!("rope type {other:?}: default, linear, llama3 and yarn load"),
            ))
        }
    };
    // A partial rotary factor rotates only the first dimensions of a head; Llama rotates all.
    if let Some(f) = get_f64(obj, path, "partial_rotary_factor")? {
        if f != 1.0 {
            return Err(bad(
                path,
                format!("partial_rotary_factor {f}: every dimension rotates here"),
            ));
        }
    }
    scaling.check().map_err(|e| bad(path, e))?;
    Ok(scaling)
}

/// Qwen2's and Qwen3's sliding window, as their configs set it: `use_sliding_window` turns on
/// a window of `sliding_window` keys (4096 when absent) in the blocks from
/// `max_window_layers` (28 when absent) on. `layer_types`, when present, must say the same:
/// full attention up to a block, sliding from there on (transformers derives it so; another
/// pattern is refused), and only full attention without `use_sliding_window`.
fn qwen_sliding_window(cfg: &Value, path: &Path, layers: usize) -> Result<Option<SlidingWindow>> {
    let on = get_bool(cfg, path, "use_sliding_window")? == Some(true);
    let window = if on {
        match cfg.get("sliding_window") {
            None => Some(4096),
            Some(Value::Null) => None,
            Some(_) => Some(get_usize(cfg, path, "sliding_window")?),
        }
    } else {
        None
    };
    let first_layer = match window {
        Some(_) => match cfg.get("max_window_layers") {
            None => 28,
            Some(_) => get_usize(cfg, path, "max_window_layers")?,
        },
        None => layers,
    };
    // transformers requires one type per layer.
    if let Some(types) = cfg.get("layer_types").filter(|v| !v.is_null()) {
        let derived = types.as_array().is_some_and(|a| {
            a.len() == layers
                && a.iter().enumerate().all(|(l, t)| {
                    let want = if l < first_layer {
                        "full_attention"
                    } else {
                        "sliding_attention"
                    };
                    t == want
                })
        });
        if !derived {
            let expected = match window {
                Some(_) => {
                    format!("full_attention before block {first_layer}, sliding_attention from it")
                }
                None => "only full_attention without a sliding window".into(),
            };
            return Err(bad(path, format!("layer_types {types:.80}: {expected}")));
        }
    }
    Ok(window
        .filter(|_| first_layer < layers)
        .map(|size| SlidingWindow::from_layer(size, first_layer)))
}

/// The attention pattern and rotary embeddings of a class with layer types (Gemma 3, OLMo 3),
/// as its configs set them: a window of `sliding_window` keys (4096 when absent) in every
/// block but every `k`-th (`layer_types`; before it, Gemma's `sliding_window_pattern`; 6 for
/// Gemma and 4 for OLMo when absent), whose rotary embedding is not rescaled while the
/// full-attention blocks take `rope_theta` and `rope_scaling` (transformers 5's
/// `rope_parameters.full_attention`; the base 10⁶ for Gemma and 5·10⁵ for OLMo when absent).
/// The windowed blocks' base is transformers 5's `rope_parameters.sliding_attention`, which
/// must not rescale; without it Gemma's `rope_local_base_freq` (10 000 when absent), and for
/// OLMo 3 5·10⁵ whatever `rope_theta` says (transformers 5.24 gives the sliding blocks its
/// default then; 4.x's Olmo3 gave them `rope_theta`, which the Hub's configs set to the same
/// 5·10⁵). Returns the window (`None`: every block attends to the whole context), the full
/// blocks' base and their rescaling. Another pattern of `layer_types` is refused.
fn typed_attention(
    cfg: &Value,
    path: &Path,
    layers: usize,
    class: LlamaClass,
) -> Result<(Option<SlidingWindow>, f64, RopeScaling)> {
    let gemma = class == LlamaClass::Gemma3;
    let (default_theta, default_every) = if gemma { (1e6, 6) } else { (5e5, 4) };
    // transformers 5 writes one set of rotary parameters per layer type.
    let by_type = get_object(cfg, path, "rope_parameters")?;
    let typed = |name: &str| -> Result<Option<&Value>> {
        match by_type {
            Some(r) => get_object(r, path, name),
            None => Ok(None),
        }
    };
    let (full, sliding) = (typed("full_attention")?, typed("sliding_attention")?);
    if by_type.is_some() && (full.is_none() || sliding.is_none()) {
        return Err(bad(
            path,
            "rope_parameters by layer type must hold full_attention and sliding_attention",
        ));
    }
    let (theta, scaling) = match full {
        Some(f) => (get_f64(f, path, "rope_theta")?, rope_scaling(f, cfg, path)?),
        None => {
            let scaling = match get_object(cfg, path, "rope_scaling")? {
                Some(s) => rope_scaling(s, cfg, path)?,
                None => RopeScaling::None,
            };
            (get_f64(cfg, path, "rope_theta")?, scaling)
        }
    };
    let local_theta = match sliding {
        Some(s) => {
            if rope_scaling(s, cfg, path)? != RopeScaling::None {
                return Err(bad(
                    path,
                    "rope_parameters.sliding_attention: the windowed blocks' rotary \
                     embedding is not rescaled here",
                ));
            }
            get_f64(s, path, "rope_theta")?
        }
        None if gemma => get_f64(cfg, path, "rope_local_base_freq")?,
        None => None,
    }
    .unwrap_or(if gemma { 10_000.0 } else { default_theta });
    // Every k-th block attends to everything; all blocks windowed when none does.
    let full_every = match cfg.get("layer_types").filter(|v| !v.is_null()) {
        Some(types) => {
            let list = types.as_array().filter(|a| a.len() == layers);
            let first_full = list.and_then(|a| a.iter().position(|t| t == "full_attention"));
            let k = first_full.map(|i| i + 1);
            let derived = list.is_some_and(|a| {
                a.iter().enumerate().all(|(l, t)| {
                    let full = k.is_some_and(|k| (l + 1).is_multiple_of(k));
                    t == if full {
                        "full_attention"
                    } else {
                        "sliding_attention"
                    }
                })
            });
            if !derived {
                return Err(bad(
                    path,
                    format!(
                        "layer_types {types:.80}: only full_attention every k-th block, \
                         sliding_attention in the others"
                    ),
                ));
            }
            k
        }
        None => {
            let key = ["sliding_window_pattern", "_sliding_window_pattern"]
                .into_iter()
                .filter(|_| gemma)
                .find(|k| cfg.get(*k).is_some_and(|v| !v.is_null()));
            Some(match key {
                Some(k) => get_usize(cfg, path, k)?,
                None => default_every,
            })
        }
    };
    if full_every == Some(0) {
        return Err(bad(
            path,
            "sliding_window_pattern 0: a block count must be positive",
        ));
    }
    let window = match (full_every, cfg.get("sliding_window")) {
        // Every block full: nothing is windowed.
        (Some(1), _) => None,
        (_, None) => Some(4096),
        (_, Some(Value::Null)) => {
            return Err(bad(
                path,
                "sliding_window null with sliding_attention blocks is not supported",
            ))
        }
        (_, Some(_)) => Some(get_usize(cfg, path, "sliding_window")?),
    };
    let window = window.map(|size| SlidingWindow {
        size,
        first_layer: 0,
        // A pattern longer than the model leaves every block windowed, as none does.
        full_every: full_every.filter(|&k| k <= layers),
        rope_theta: Some(local_theta as f32),
    });
    Ok((window, theta.unwrap_or(default_theta), scaling))
}

/// Gemma 3's settings that change the computation in ways not implemented here, refused
/// unless they are off: soft-capped logits (Gemma 2's), bidirectional attention
/// (EmbeddingGemma), biased projections, and an activation other than the tanh GELU.
fn gemma3_refusals(cfg: &Value, path: &Path) -> Result<()> {
    let act = get_str(cfg, path, "hidden_activation")?.or(get_str(cfg, path, "hidden_act")?);
    if !matches!(act, None | Some("gelu_pytorch_tanh")) {
        return Err(bad(
            path,
            format!("Gemma 3 activation {act:?}: only gelu_pytorch_tanh"),
        ));
    }
    for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if !matches!(cfg.get(key), None | Some(Value::Null)) {
            return Err(bad(path, format!("{key} is not supported")));
        }
    }
    for flag in ["use_bidirectional_attention", "attention_bias"] {
        if get_bool(cfg, path, flag)? == Some(true) {
            return Err(bad(path, format!("{flag} is not supported")));
        }
    }
    Ok(())
}

/// SmolLM3's NoPE blocks as its config sets them: one every `no_rope_layer_interval` (4 when
/// absent) blocks. `no_rope_layers`, when present, must be that pattern (1: the block rotates,
/// 0: it does not) — transformers derives it so; another is refused. Its sliding window falls
/// on the NoPE blocks alone, which no window here expresses: refused when it would hide a key.
fn smollm3_no_rope_interval(
    cfg: &Value,
    path: &Path,
    layers: usize,
    context: usize,
) -> Result<usize> {
    let interval = match cfg.get("no_rope_layer_interval") {
        None => 4,
        Some(_) => get_usize(cfg, path, "no_rope_layer_interval")?,
    };
    if interval == 0 {
        return Err(bad(
            path,
            "no_rope_layer_interval 0: a block count must be positive",
        ));
    }
    if let Some(list) = cfg.get("no_rope_layers").filter(|v| !v.is_null()) {
        let derived = list.as_array().is_some_and(|a| {
            a.len() == layers
                && a.iter().enumerate().all(|(l, v)| {
                    let rotates = !(l + 1).is_multiple_of(interval);
                    v.as_u64() == Some(u64::from(rotates))
                })
        });
        if !derived {
            return Err(bad(
                path,
                format!(
                    "no_rope_layers {list:.80}: only a NoPE block every \
                     no_rope_layer_interval ({interval}) blocks"
                ),
            ));
        }
    }
    if get_bool(cfg, path, "use_sliding_window")? == Some(true) {
        let window = match cfg.get("sliding_window") {
            None | Some(Value::Null) => None,
            Some(_) => Some(get_usize(cfg, path, "sliding_window")?),
        };
        if window.is_some_and(|w| w < context) && interval <= layers {
            return Err(bad(
                path,
                "use_sliding_window: SmolLM3's windows on its NoPE blocks are not supported",
            ));
        }
    }
    if let Some(types) = cfg.get("layer_types").filter(|v| !v.is_null()) {
        let full = types
            .as_array()
            .is_some_and(|a| a.len() == layers && a.iter().all(|t| t == "full_attention"));
        if !full {
            return Err(bad(
                path,
                format!("layer_types {types:.80}: only full_attention"),
            ));
        }
    }
    Ok(interval)
}

/// The model shape a Hugging Face `config.json` describes (GPT-2, Llama, Mistral, Qwen2,
/// Qwen3, SmolLM3 or Gemma 3 text), checked.
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    Ok(read_config_and_layout(dir)?.0)
}

/// [`read_config`], and whether the directory is a multimodal model whose text model is read
/// out of it (its tensors named under `language_model`, beside a vision tower's).
fn read_config_and_layout(dir: &Path) -> Result<(ModelConfig, bool)> {
    let path = dir.join("config.json");
    let bytes = read_json(&path)?;
    let cfg: Value =
        serde_json::from_slice(&bytes).map_err(|e| bad(&path, format!("not JSON: {e}")))?;
    let multimodal = architecture(&cfg) == GEMMA3_MULTIMODAL;
    Ok((config_of(&cfg, &path)?, multimodal))
}

/// Gemma 3 4B, 12B and 27B: the Gemma 3 text model under `language_model`, beside a SigLIP
/// vision tower and its projector.
const GEMMA3_MULTIMODAL: &str = "Gemma3ForConditionalGeneration";

/// The class a config names (`architectures`, else its `model_type`'s), or `(none)`.
fn architecture(cfg: &Value) -> &str {
    cfg.get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .or_else(|| match cfg.get("model_type").and_then(Value::as_str) {
            Some("gpt2") => Some("GPT2LMHeadModel"),
            Some("gemma3") => Some(GEMMA3_MULTIMODAL),
            Some(t) => LlamaClass::ALL
                .into_iter()
                .find(|c| c.model_type() == t)
                .map(LlamaClass::architecture),
            None => None,
        })
        .unwrap_or("(none)")
}

/// Gemma3TextConfig's defaults under `text` (the multimodal models' `text_config` names only
/// what differs from them: Gemma 3 4B's gives six keys), as the text model's own config:
/// `Gemma3ForCausalLM`, `gemma3_text`. `tie_word_embeddings` falls back on `outer`'s (the
/// multimodal config's), then on true.
fn gemma3_text_config(text: &Value, outer: Option<&Value>, path: &Path) -> Result<Value> {
    let Value::Object(given) = text else {
        return Err(bad(path, "text_config is not an object"));
    };
    let mut full = serde_json::json!({
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
    });
    if let Some(o) = full.as_object_mut() {
        let tied = given
            .get("tie_word_embeddings")
            .or_else(|| outer.and_then(|c| c.get("tie_word_embeddings")))
            .cloned()
            .unwrap_or(Value::Bool(true));
        o.insert("tie_word_embeddings".into(), tied);
        o.extend(given.iter().map(|(k, v)| (k.clone(), v.clone())));
        o.insert(
            "architectures".into(),
            serde_json::json!([LlamaClass::Gemma3.architecture()]),
        );
        if let Some(t) = get_str(text, path, "model_type")? {
            if t != LlamaClass::Gemma3.model_type() {
                return Err(bad(
                    path,
                    format!("text_config model_type {t:?} is not gemma3_text"),
                ));
            }
        }
        o.insert("model_type".into(), LlamaClass::Gemma3.model_type().into());
    }
    Ok(full)
}

/// The model shape `cfg` (the JSON of `path`) describes.
fn config_of(cfg: &Value, path: &Path) -> Result<ModelConfig> {
    let arch = architecture(cfg);
    // transformers picks the model class by `model_type`; `architectures` only names it. Both
    // present must agree, or the two would load different models.
    let model_type = get_str(cfg, path, "model_type")?;
    let own_type = match arch {
        "GPT2LMHeadModel" => Some("gpt2"),
        GEMMA3_MULTIMODAL => Some("gemma3"),
        other => LlamaClass::of_architecture(other).map(LlamaClass::model_type),
    };
    if let (Some(t), Some(own)) = (model_type, own_type) {
        if t != own {
            return Err(bad(
                path,
                format!("model_type {t:?} is not the model_type of {arch}"),
            ));
        }
    }
    // The text model of a multimodal Gemma 3, and Gemma3TextConfig's defaults where a text
    // config leaves keys out. (Completing is idempotent: a completed config reads the same.)
    if arch == GEMMA3_MULTIMODAL {
        let text = get_object(cfg, path, "text_config")?
            .ok_or_else(|| bad(path, "Gemma3ForConditionalGeneration without text_config"))?;
        return config_of(&gemma3_text_config(text, Some(cfg), path)?, path);
    }
    let completed;
    let cfg = if arch == LlamaClass::Gemma3.architecture() {
        completed = gemma3_text_config(cfg, None, path)?;
        &completed
    } else {
        cfg
    };
    let config = match arch {
        "GPT2LMHeadModel" => {
            let act = get_str(cfg, path, "activation_function")?;
            if !matches!(act, None | Some("gelu_new")) {
                return Err(bad(
                    path,
                    format!("GPT-2 activation {act:?}: only gelu_new"),
                ));
            }
            let eps = get_f64(cfg, path, "layer_norm_epsilon")?.unwrap_or(1e-5);
            if (eps - 1e-5).abs() > 1e-12 {
                return Err(bad(path, format!("layer_norm_epsilon {eps}: only 1e-5")));
            }
            if get_bool(cfg, path, "tie_word_embeddings")? == Some(false) {
                return Err(bad(path, "an untied GPT-2 head is not supported"));
            }
            // transformers' GPT2Attention divides by sqrt(head_dim) only while
            // scale_attn_weights is truthy (default true), and also by layer index + 1 when
            // scale_attn_by_inverse_layer_idx is; ours always does the first, never the second.
            if !matches!(
                cfg.get("scale_attn_weights"),
                None | Some(Value::Bool(true))
            ) {
                return Err(bad(
                    path,
                    format!(
                        "scale_attn_weights {}: attention here always scales by 1/sqrt(head_dim)",
                        cfg["scale_attn_weights"]
                    ),
                ));
            }
            if !matches!(
                cfg.get("scale_attn_by_inverse_layer_idx"),
                None | Some(Value::Null) | Some(Value::Bool(false))
            ) {
                return Err(bad(
                    path,
                    format!(
                        "scale_attn_by_inverse_layer_idx {}: attention here never scales by \
                         layer index",
                        cfg["scale_attn_by_inverse_layer_idx"]
                    ),
                ));
            }
            let channels = get_usize(cfg, path, "n_embd")?;
            // transformers' MLP is n_inner wide when it is set, 4·n_embd when null; ours is
            // always 4·n_embd.
            if !matches!(cfg.get("n_inner"), None | Some(Value::Null)) {
                let inner = get_usize(cfg, path, "n_inner")?;
                if Some(inner) != channels.checked_mul(4) {
                    return Err(bad(
                        path,
                        format!("n_inner {inner}: the MLP here is 4 × n_embd ({channels}) wide"),
                    ));
                }
            }
            ModelConfig {
                vocab: get_usize(cfg, path, "vocab_size")?,
                max_seq: get_usize(cfg, path, "n_positions")?,
                layers: get_usize(cfg, path, "n_layer")?,
                heads: get_usize(cfg, path, "n_head")?,
                channels,
                family: Family::Gpt2,
            }
        }
        // Mistral is Llama over a sliding window (none from 7B v0.2 on). Qwen2 is Llama with
        // biases on q, k and v (fixed, not a setting) and an optional sliding window in its
        // later blocks. Qwen3 drops the biases (a setting, refused when on: it would bias
        // o_proj too) and adds the query/key norms. OLMo 2 moves the norms from the
        // sublayers' inputs to their outputs and normalises the whole q and k projections;
        // OLMo 3 adds Gemma 3's pattern of windowed blocks.
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" | "Qwen3ForCausalLM"
        | "SmolLM3ForCausalLM" | "Gemma3ForCausalLM" | "Olmo2ForCausalLM" | "Olmo3ForCausalLM"
        | "GraniteForCausalLM" => {
            let class = LlamaClass::of_architecture(arch).unwrap_or_default();
            let act = get_str(cfg, path, "hidden_act")?;
            if class != LlamaClass::Gemma3 && !matches!(act, None | Some("silu")) {
                return Err(bad(path, format!("{arch} activation {act:?}: only silu")));
            }
            let layers = get_usize(cfg, path, "num_hidden_layers")?;
            let context = get_usize(cfg, path, "max_position_embeddings")?;
            let sliding_window = match class {
                // MistralConfig's window is 4096 when the key is absent, none when null; it
                // windows every block.
                LlamaClass::Mistral => match cfg.get("sliding_window") {
                    None => Some(4096),
                    Some(Value::Null) => None,
                    Some(_) => Some(get_usize(cfg, path, "sliding_window")?),
                }
                .map(|size| SlidingWindow::from_layer(size, 0)),
                LlamaClass::Qwen2 | LlamaClass::Qwen3 => qwen_sliding_window(cfg, path, layers)?,
                LlamaClass::Llama
                | LlamaClass::SmolLM3
                | LlamaClass::Gemma3
                | LlamaClass::Olmo2
                | LlamaClass::Olmo3
                | LlamaClass::Granite => None,
            };
            let typed = match class {
                LlamaClass::Gemma3 | LlamaClass::Olmo3 => {
                    Some(typed_attention(cfg, path, layers, class)?)
                }
                _ => None,
            };
            let no_rope_interval = match class {
                LlamaClass::SmolLM3 => Some(smollm3_no_rope_interval(cfg, path, layers, context)?),
                _ => None,
            };
            // A window no shorter than the context never hides a key. (Gemma 3's and OLMo
            // 3's windowed blocks keep theirs: they rotate with their own base.)
            let sliding_window = match typed {
                Some((window, ..)) => window,
                None => sliding_window.filter(|w| w.size < context),
            };
            // Mistral's and Qwen2's classes have no bias settings; Gemma 3's are checked with
            // its other settings.
            let bias_settings: &[&str] = match class {
                LlamaClass::Llama | LlamaClass::SmolLM3 | LlamaClass::Granite => {
                    &["attention_bias", "mlp_bias"]
                }
                LlamaClass::Qwen3 | LlamaClass::Olmo2 | LlamaClass::Olmo3 => &["attention_bias"],
                LlamaClass::Mistral | LlamaClass::Qwen2 | LlamaClass::Gemma3 => &[],
            };
            for &flag in bias_settings {
                if get_bool(cfg, path, flag)? == Some(true) {
                    return Err(bad(path, format!("{flag} is not supported")));
                }
            }
            // transformers 4 writes rope_theta (and rope_scaling); 5 writes rope_parameters
            // (Gemma 3's per layer type).
            let (theta, rope_scaling) = match typed {
                Some((_, theta, scaling)) => (theta, scaling),
                None => {
                    let rope = get_object(cfg, path, "rope_parameters")?;
                    let scaling = match rope {
                        Some(r) => Some(r),
                        None => get_object(cfg, path, "rope_scaling")?,
                    };
                    let rope_scaling = match scaling {
                        Some(s) => rope_scaling(s, cfg, path)?,
                        None => RopeScaling::None,
                    };
                    let theta = match rope {
                        Some(r) => get_f64(r, path, "rope_theta")?,
                        None => get_f64(cfg, path, "rope_theta")?,
                    }
                    .unwrap_or(10_000.0);
                    (theta, rope_scaling)
                }
            };
            let heads = get_usize(cfg, path, "num_attention_heads")?;
            let channels = get_usize(cfg, path, "hidden_size")?;
            // Llama's and Mistral's configs derive head_dim (hidden_size / heads) when it is
            // absent or null; Qwen3's is 128 when absent. Kept only when it differs from the
            // derived width, so such a model's shape reads as any Llama's.
            let head_dim = match (cfg.get("head_dim"), class) {
                (None, LlamaClass::Qwen3) => Some(128),
                (None, LlamaClass::Gemma3) => Some(256),
                (None | Some(Value::Null), _) => None,
                (Some(_), _) => Some(get_usize(cfg, path, "head_dim")?),
            };
            if class == LlamaClass::Gemma3 {
                gemma3_refusals(cfg, path)?;
            }
            // Gemma 3 scales q·kᵀ by query_pre_attn_scalar^−½: kept when it is not the
            // head width's own 1/√head_dim (27B's 168 on 128).
            let query_pre_attn_scalar = match class {
                LlamaClass::Gemma3 => {
                    // null is no scale transformers can compute (`None ** -0.5`).
                    if cfg.get("query_pre_attn_scalar") == Some(&Value::Null) {
                        return Err(bad(path, "query_pre_attn_scalar is null"));
                    }
                    let width = head_dim.unwrap_or(channels / heads.max(1));
                    get_f64(cfg, path, "query_pre_attn_scalar")?
                        .filter(|&q| q != width as f64)
                        .map(|q| q as f32)
                }
                _ => None,
            };
            let head_dim =
                head_dim.filter(|&hd| heads == 0 || hd.checked_mul(heads) != Some(channels));
            // Granite's scalars, 1 when absent (GraniteConfig's defaults).
            let multipliers = match class {
                LlamaClass::Granite => {
                    let read = |key: &str| -> Result<f32> {
                        Ok(get_f64(cfg, path, key)?.unwrap_or(1.0) as f32)
                    };
                    Some(Multipliers {
                        embedding: read("embedding_multiplier")?,
                        residual: read("residual_multiplier")?,
                        attention: read("attention_multiplier")?,
                        logits_scaling: read("logits_scaling")?,
                    })
                }
                _ => None,
            };
            // transformers builds every one of these classes' embeddings with
            // `padding_idx=pad_token_id`; absent, the config class's default (SmolLM3's
            // 128004, Gemma 3's 0, OLMo's 1, none elsewhere). nn.Embedding refuses an index
            // past the vocabulary, and so does `validate`.
            let padding_idx = match cfg.get("pad_token_id") {
                None => match class {
                    LlamaClass::SmolLM3 => Some(128_004),
                    LlamaClass::Gemma3 => Some(0),
                    LlamaClass::Olmo2 | LlamaClass::Olmo3 => Some(1),
                    _ => None,
                },
                Some(Value::Null) => None,
                Some(_) => {
                    let p = get_usize(cfg, path, "pad_token_id")?;
                    Some(u32::try_from(p).map_err(|_| {
                        bad(path, format!("pad_token_id {p} does not fit a token id"))
                    })?)
                }
            };
            let kv_heads = match cfg.get("num_key_value_heads") {
                None | Some(Value::Null) => heads,
                Some(_) => get_usize(cfg, path, "num_key_value_heads")?,
            };
            ModelConfig {
                vocab: get_usize(cfg, path, "vocab_size")?,
                max_seq: context,
                layers,
                heads,
                channels,
                family: Family::Llama(LlamaShape {
                    kv_heads,
                    head_dim,
                    sliding_window,
                    no_rope_interval,
                    query_pre_attn_scalar,
                    multipliers,
                    padding_idx,
                    ffn: get_usize(cfg, path, "intermediate_size")?,
                    rope_theta: theta as f32,
                    rope_scaling,
                    // Olmo2Config's and Olmo3Config's epsilon is 1e-5 when absent.
                    norm_eps: get_f64(cfg, path, "rms_norm_eps")?.unwrap_or(
                        if matches!(class, LlamaClass::Olmo2 | LlamaClass::Olmo3) {
                            1e-5
                        } else {
                            1e-6
                        },
                    ) as f32,
                    // Gemma's configs tie the head unless they say otherwise.
                    tied_head: get_bool(cfg, path, "tie_word_embeddings")?
                        .unwrap_or(class == LlamaClass::Gemma3),
                    class,
                }),
            }
        }
        other => {
            return Err(bad(
                path,
                format!(
                    "architecture {other}: GPT2LMHeadModel, LlamaForCausalLM, \
                     MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, \
                     SmolLM3ForCausalLM, Gemma3ForCausalLM, Olmo2ForCausalLM, \
                     Olmo3ForCausalLM and GraniteForCausalLM load"
                ),
            ))
        }
    };
    config
        .validate()
        .map_err(|e| bad(path, format!("unsupported shape: {e}")))?;
    Ok(config)
}

/// A multimodal Gemma 3's text model, named as its own checkpoint names it: `model.X` for
/// `language_model.model.X` (what transformers 4 and 5.24 save, and the Hub holds) or
/// `model.language_model.X` (transformers 5's module names), `lm_head.weight` for
/// `language_model.lm_head.weight`. The vision tower's and projector's tensors are dropped:
/// headroom trains and saves the text model alone.
fn text_tower(stored: BTreeMap<String, Stored>) -> BTreeMap<String, Stored> {
    stored
        .into_iter()
        .filter_map(|(name, t)| {
            let text = if let Some(rest) = name.strip_prefix("language_model.model.") {
                format!("model.{rest}")
            } else if let Some(rest) = name.strip_prefix("model.language_model.") {
                format!("model.{rest}")
            } else if let Some(rest) = name.strip_prefix("language_model.") {
                rest.to_owned()
            } else if name == "lm_head.weight" {
                name
            } else {
                return None;
            };
            Some((text, t))
        })
        .collect()
}

/// Buffers some checkpoints store that are not parameters (GPT-2's causal masks, rotary
/// frequencies): skipped.
fn is_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with("rotary_emb.inv_freq")
}

/// Read a Hugging Face model directory: its shape and fp32 masters (in
/// [`params::param_infos`] order, our layout), allocated on `backend` as `Parameters`.
pub fn load(dir: &Path, backend: &Cpu) -> Result<(ModelConfig, Vec<CpuTensor>)> {
    let mut masters = Vec::new();
    let cfg = load_each(dir, backend, |_, t| {
        masters.push(t);
        Ok(())
    })?;
    Ok((cfg, masters))
}

/// [`load`] one tensor at a time: `each(index, tensor)` receives every fp32 master in
/// parameter order as soon as it is read, so a consumer that converts them (a frozen base in
/// bf16 or 4 bits) never holds the whole f32 model. Every check [`load`] makes is made; the
/// ones about tensors the model does not have come after the last tensor, so a caller must
/// discard what it built when this returns an error.
pub fn load_each(
    dir: &Path,
    backend: &Cpu,
    each: impl FnMut(usize, CpuTensor) -> Result<()>,
) -> Result<ModelConfig> {
    load_into(dir, backend, &mut EachF32(each))
}

/// [`load_each`] into `sink`, each tensor in the dtype the sink asks for: a bf16 frozen base
/// reads a bf16 or f32 file straight into bf16 a chunk at a time, so loading peaks at the bf16
/// model plus a chunk buffer, not plus the largest tensor's f32 copy (GPT-2's 147 MiB
/// embedding). The values are those of [`load_each`]'s f32 tensor cast to the dtype, bit for
/// bit. GPT-2's `Conv1D` weights are read transposed, a band of rows at a time.
pub fn load_into(dir: &Path, backend: &Cpu, sink: &mut impl TensorSink) -> Result<ModelConfig> {
    let (cfg, multimodal) = read_config_and_layout(dir)?;
    let mut stored = read_tensors(dir)?;
    if multimodal {
        stored = text_tower(stored);
    }
    let infos = params::param_infos(&cfg);
    for (index, info) in infos.iter().enumerate() {
        // GPT2LMHeadModel saves its body under `transformer.`; our own export does not.
        let t = stored
            .remove(&info.name)
            .or_else(|| stored.remove(&format!("transformer.{}", info.name)))
            .ok_or_else(|| bad(dir, format!("missing tensor {}", info.name)))?;
        let want: Vec<usize> = if info.transposed_in_hf {
            vec![info.shape[1], info.shape[0]]
        } else {
            info.shape.clone()
        };
        if t.shape != want {
            return Err(bad(
                &t.file,
                format!("{} has shape {:?}, expected {want:?}", info.name, t.shape),
            ));
        }
        let tensor = fill_param(backend, info, index, &t, sink)?;
        sink.push(index, tensor)?;
    }
    // A tied head may still be stored (transformers writes lm_head.weight for GPT-2 in
    // some versions). Its shape is checked but its values are not read: the config ties the
    // head to the embedding, so a copy that differs is ignored, not refused (reading it would
    // cost a second pass over the largest tensor at every load).
    let tied_copy = if params::head_index(&cfg) == params::WTE {
        stored.remove("lm_head.weight")
    } else {
        None
    };
    if let Some(t) = tied_copy {
        if t.shape != infos[params::WTE].shape {
            return Err(bad(
                &t.file,
                "lm_head.weight does not have the embedding's shape",
            ));
        }
    }
    stored.retain(|name, _| !is_buffer(name));
    if let Some(extra) = stored.keys().next() {
        return Err(bad(
            dir,
            format!(
                "{} tensor(s) the model does not have, e.g. {extra}",
                stored.len()
            ),
        ));
    }
    Ok(cfg)
}

/// Parameter `index` (`info`) read from its stored tensor `t` (shape already checked) into
/// the dtype `sink` asks for, as [`load_into`] reads each one.
pub(crate) fn fill_param(
    backend: &Cpu,
    info: &params::ParamInfo,
    index: usize,
    t: &Stored,
    sink: &mut impl TensorSink,
) -> Result<CpuTensor> {
    let mut reader = TensorReader::open(t, info.shape.iter().product())?;
    params::fill_tensor(backend, info, index, sink, |at, out| {
        reader.read_param(info, at, out)
    })
}

/// One stored tensor's values, read from its file and widened to f32.
pub(crate) struct TensorReader<'a> {
    t: &'a Stored,
    file: File,
    bytes: Vec<u8>,
    /// Bytes read at a time ([`CHUNK_BYTES`]; tests make it small).
    chunk_bytes: usize,
}

impl<'a> TensorReader<'a> {
    /// `t`, which must hold `len` values.
    pub(crate) fn open(t: &'a Stored, len: usize) -> Result<Self> {
        if (t.end - t.start) != len as u64 * t.dtype.size() {
            return Err(bad(&t.file, "tensor byte length changed"));
        }
        let file = File::open(&t.file).map_err(|e| bad(&t.file, e.to_string()))?;
        Ok(TensorReader {
            t,
            file,
            bytes: Vec::new(),
            chunk_bytes: CHUNK_BYTES,
        })
    }

    /// Values `at..at + out.len()` of the stored tensor (in bounds: `open` checked the
    /// length, and callers stay within it), a bounded chunk at a time.
    pub(crate) fn read(&mut self, at: usize, out: &mut [f32]) -> Result<()> {
        let t = self.t;
        let size = t.dtype.size() as usize;
        self.file
            .seek(SeekFrom::Start(t.start + (at * size) as u64))
            .map_err(|e| bad(&t.file, e.to_string()))?;
        for out in out.chunks_mut((self.chunk_bytes / size).max(1)) {
            self.bytes.resize(out.len() * size, 0);
            self.file
                .read_exact(&mut self.bytes)
                .map_err(|_| bad(&t.file, "file ends inside a tensor"))?;
            widen(t.dtype, &self.bytes, out);
        }
        Ok(())
    }

    /// Values `at..at + out.len()` of parameter `info` in our layout (`out` whole rows when
    /// the stored tensor is GPT-2's transposed `Conv1D` weight).
    pub(crate) fn read_param(
        &mut self,
        info: &params::ParamInfo,
        at: usize,
        out: &mut [f32],
    ) -> Result<()> {
        if info.transposed_in_hf {
            let (rows, cols) = (info.shape[0], info.shape[1]);
            self.read_transposed(at / cols, out, rows, cols)
        } else {
            self.read(at, out)
        }
    }

    /// Rows `first..first + out.len() / cols` of the `[rows, cols]` transpose of the stored
    /// `[cols, rows]` tensor. Stored rows are read whole, as many as fit a chunk at a time
    /// (at least one), and the band's part of each is scattered into the band's column: one pass over
    /// the stored tensor per band.
    fn read_transposed(
        &mut self,
        first: usize,
        out: &mut [f32],
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let t = self.t;
        let size = t.dtype.size() as usize;
        let band = out.len() / cols;
        debug_assert!(first + band <= rows && band * cols == out.len());
        let per_read = (self.chunk_bytes / (rows * size)).max(1);
        let mut slice = vec![0f32; band];
        self.file
            .seek(SeekFrom::Start(t.start))
            .map_err(|e| bad(&t.file, e.to_string()))?;
        for c0 in (0..cols).step_by(per_read) {
            let stored_rows = per_read.min(cols - c0);
            self.bytes.resize(stored_rows * rows * size, 0);
            self.file
                .read_exact(&mut self.bytes)
                .map_err(|_| bad(&t.file, "file ends inside a tensor"))?;
            for (i, stored_row) in self.bytes.chunks_exact(rows * size).enumerate() {
                let part = &stored_row[first * size..(first + band) * size];
                widen(t.dtype, part, &mut slice);
                let c = c0 + i;
                for (r, v) in slice.iter().enumerate() {
                    out[r * cols + c] = *v;
                }
            }
        }
        Ok(())
    }
}

/// Little-endian `bytes` of `dtype` widened into `out` (as many values as `out` holds).
fn widen(dtype: StoredDtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        StoredDtype::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        StoredDtype::Bf16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        StoredDtype::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A file holding `values` in `dtype` after a few bytes of something else, as one stored
    /// tensor of `shape`.
    fn stored(dir: &Path, dtype: StoredDtype, values: &[f32], shape: Vec<usize>) -> Stored {
        let mut bytes = vec![7u8; 24];
        for v in values {
            match dtype {
                StoredDtype::F32 => bytes.extend(v.to_le_bytes()),
                StoredDtype::Bf16 => bytes.extend(half::bf16::from_f32(*v).to_bits().to_le_bytes()),
                StoredDtype::F16 => bytes.extend(half::f16::from_f32(*v).to_bits().to_le_bytes()),
            }
        }
        let file = dir.join("t.bin");
        std::fs::write(&file, &bytes).unwrap();
        Stored {
            file,
            dtype,
            shape,
            start: 24,
            end: bytes.len() as u64,
        }
    }

    fn widened(dtype: StoredDtype, v: f32) -> f32 {
        match dtype {
            StoredDtype::F32 => v,
            StoredDtype::Bf16 => half::bf16::from_f32(v).to_f32(),
            StoredDtype::F16 => half::f16::from_f32(v).to_f32(),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Reads of any range, any chunk size, and transposed reads of any band height give
        /// the stored values widened, and their plain transpose.
        #[test]
        fn chunked_and_transposed_reads_equal_a_plain_read(
            rows in 1usize..24,
            cols in 1usize..24,
            dtype in prop_oneof![
                Just(StoredDtype::F32),
                Just(StoredDtype::Bf16),
                Just(StoredDtype::F16)
            ],
            chunk_bytes in 1usize..300,
            band in 1usize..24,
            range in (0usize..576, 0usize..576),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let values: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
            // Stored `[cols, rows]`, as GPT-2 stores a `Conv1D` weight.
            let t = stored(dir.path(), dtype, &values, vec![cols, rows]);
            let mut reader = TensorReader::open(&t, rows * cols).unwrap();
            reader.chunk_bytes = chunk_bytes;
            let (a, b) = (range.0 % (rows * cols + 1), range.1 % (rows * cols + 1));
            let (lo, hi) = (a.min(b), a.max(b));
            let mut part = vec![0f32; hi - lo];
            reader.read(lo, &mut part).unwrap();
            for (i, v) in part.iter().enumerate() {
                prop_assert_eq!(v.to_bits(), widened(dtype, values[lo + i]).to_bits());
            }
            let band = band.min(rows);
            let mut out = vec![0f32; rows * cols];
            for first in (0..rows).step_by(band) {
                let n = band.min(rows - first);
                reader
                    .read_transposed(first, &mut out[first * cols..(first + n) * cols], rows, cols)
                    .unwrap();
            }
            for r in 0..rows {
                for c in 0..cols {
                    let want = widened(dtype, values[c * rows + r]);
                    prop_assert_eq!(out[r * cols + c].to_bits(), want.to_bits(), "({}, {})", r, c);
                }
            }
        }
    }

    /// A stored tensor whose byte range does not hold the expected count is refused, and one
    /// whose file is shorter than its range is a typed error, not a panic.
    #[test]
    fn a_length_mismatch_or_a_short_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let t = stored(dir.path(), StoredDtype::F32, &[1.0; 6], vec![2, 3]);
        assert!(TensorReader::open(&t, 5).is_err());
        let short = Stored {
            end: t.end + 8,
            ..t.clone()
        };
        let mut reader = TensorReader::open(&short, 8).unwrap();
        let mut out = vec![0f32; 8];
        let e = reader.read(0, &mut out).unwrap_err().to_string();
        assert!(e.contains("file ends inside a tensor"), "{e}");
        let e = reader
            .read_transposed(0, &mut out, 4, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("file ends inside a tensor"), "{e}");
    }
}
