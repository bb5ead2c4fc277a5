//! Checkpoints: the model as safetensors with Hugging Face GPT-2 names, plus everything needed
//! to continue a run bit for bit (optimizer state and moments, data position, step).
//!
//! A checkpoint is a directory:
//! - `model.safetensors` — f32 tensors named as transformers' `GPT2Model` expects
//!   (`wte.weight`, `h.0.attn.c_attn.weight`, …). The four Conv1D weights (`attn.c_attn`,
//!   `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`) are written transposed, `[in, out]`, exactly as
//!   Hugging Face stores them; prefix the names with `transformer.` to load them into
//!   `GPT2LMHeadModel` (the head is tied to `wte`).
//! - `optimizer.bin` — the AdamW moments, raw.
//! - `state.json` — step, model config, optimizer state (groups, per-parameter steps) and the
//!   loader's position. Written last: a directory without it is not a checkpoint.
//!
//! Every file is written to a temporary name, fsynced and renamed, so a crash never leaves a
//! half-written file under a real name.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use headroom_mmap_data::LoaderState;
use headroom_offload::AdamWState;
use headroom_tensor::CpuTensor;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::model::{params, GptConfig};
use crate::{Result, TrainError};

const FORMAT_VERSION: u32 = 1;

/// The small part of a checkpoint, as JSON.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainingState {
    /// Layout version of the checkpoint directory.
    pub format_version: u32,
    /// Optimizer steps completed.
    pub step: usize,
    /// The model's shape.
    pub config: GptConfig,
    /// Optimizer state without the moments.
    pub optimizer: AdamWState,
    /// The data loader's position.
    pub loader: LoaderState,
    /// The fp16 loss scaler's state (absent in fp32/bf16 runs and in older checkpoints).
    #[serde(default)]
    pub scaler: Option<headroom_amp::LossScalerState>,
}

/// A loaded checkpoint, parameters in the trainer's layout.
pub struct Checkpoint {
    /// Step, config, optimizer and loader state.
    pub state: TrainingState,
    /// Parameters in [`params::param_infos`] order and layout.
    pub params: Vec<Vec<f32>>,
    /// The optimizer's moment bytes.
    pub moments: Vec<u8>,
}

fn err(path: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |e| err(path, e.to_string())
}

/// Write `bytes` to `dir/name` atomically: temporary file, fsync, rename.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let dst = dir.join(name);
    let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    fs::rename(&tmp, &dst).map_err(io(&dst))?;
    Ok(())
}

/// `[rows, cols]` row-major → `[cols, rows]`.
fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = x[r * cols + c];
        }
    }
    out
}

/// transformers' `GPT2Config` for this shape: with it beside `model.safetensors`,
/// `GPT2LMHeadModel.from_pretrained(dir)` loads the checkpoint (no dropout, tanh GELU, layer
/// norm ε 1e-5, head tied to `wte`).
fn hf_config(c: &GptConfig, dir: &Path) -> Result<Vec<u8>> {
    let v = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab,
        "n_positions": c.max_seq,
        "n_ctx": c.max_seq,
        "n_embd": c.channels,
        "n_layer": c.layers,
        "n_head": c.heads,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": true,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "torch_dtype": "float32",
        // GPT-2's <|endoftext|> is its last id; for other vocabularies the last id too.
        "bos_token_id": c.vocab.saturating_sub(1),
        "eos_token_id": c.vocab.saturating_sub(1),
    });
    serde_json::to_vec_pretty(&v).map_err(|e| err(dir, e.to_string()))
}

/// Save a checkpoint into `dir` (created if missing): `model.safetensors` and `config.json`
/// (Hugging Face GPT-2), `optimizer.bin` (moments), `state.json` (everything else; written
/// last, so a checkpoint without it is incomplete).
pub fn save(dir: &Path, state: &TrainingState, params: &[CpuTensor], moments: &[u8]) -> Result<()> {
    fs::create_dir_all(dir).map_err(io(dir))?;
    let infos = params::param_infos(&state.config);
    if infos.len() != params.len() {
        return Err(err(
            dir,
            format!("{} parameters for a model of {}", params.len(), infos.len()),
        ));
    }
    // Hugging Face layout: Conv1D weights transposed to [in, out].
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(infos.len());
    for (info, t) in infos.iter().zip(params) {
        let x = t.as_slice::<f32>()?;
        let (shape, data) = if info.transposed_in_hf {
            let (rows, cols) = (info.shape[0], info.shape[1]);
            (vec![cols, rows], transpose(x, rows, cols))
        } else {
            (info.shape.clone(), x.to_vec())
        };
        owned.push((
            info.name.clone(),
            shape,
            bytemuck::cast_slice(&data).to_vec(),
        ));
    }
    let views = owned
        .iter()
        .map(|(n, s, b)| {
            Ok((
                n.as_str(),
                TensorView::new(Dtype::F32, s.clone(), b).map_err(|e| err(dir, e.to_string()))?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, None).map_err(|e| err(dir, e.to_string()))?;
    write_atomic(dir, "model.safetensors", &bytes)?;
    write_atomic(dir, "optimizer.bin", moments)?;
    write_atomic(dir, "config.json", &hf_config(&state.config, dir)?)?;
    let json = serde_json::to_vec_pretty(state).map_err(|e| err(dir, e.to_string()))?;
    // The commit point: written last.
    write_atomic(dir, "state.json", &json)?;
    // Make the renames durable too.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Load a checkpoint written by [`save`], checking every tensor's name, dtype and shape.
pub fn load(dir: &Path) -> Result<Checkpoint> {
    let state_path: PathBuf = dir.join("state.json");
    let json = fs::read(&state_path).map_err(io(&state_path))?;
    let state: TrainingState =
        serde_json::from_slice(&json).map_err(|e| err(&state_path, e.to_string()))?;
    if state.format_version != FORMAT_VERSION {
        return Err(err(
            &state_path,
            format!(
                "format version {} (this build reads {FORMAT_VERSION})",
                state.format_version
            ),
        ));
    }
    state.config.validate()?;
    let model_path = dir.join("model.safetensors");
    let bytes = fs::read(&model_path).map_err(io(&model_path))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| err(&model_path, e.to_string()))?;
    let mut out = Vec::new();
    for info in params::param_infos(&state.config) {
        let t = st
            .tensor(&info.name)
            .map_err(|e| err(&model_path, format!("{}: {e}", info.name)))?;
        if t.dtype() != Dtype::F32 {
            return Err(err(
                &model_path,
                format!("{} is {:?}, expected F32", info.name, t.dtype()),
            ));
        }
        let want: Vec<usize> = if info.transposed_in_hf {
            vec![info.shape[1], info.shape[0]]
        } else {
            info.shape.clone()
        };
        if t.shape() != want.as_slice() {
            return Err(err(
                &model_path,
                format!("{} has shape {:?}, expected {want:?}", info.name, t.shape()),
            ));
        }
        let data: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        out.push(if info.transposed_in_hf {
            transpose(&data, info.shape[1], info.shape[0])
        } else {
            data
        });
    }
    let opt_path = dir.join("optimizer.bin");
    let moments = fs::read(&opt_path).map_err(io(&opt_path))?;
    Ok(Checkpoint {
        state,
        params: out,
        moments,
    })
}

impl TrainingState {
    /// A state for `save`.
    pub fn new(step: usize, config: GptConfig, optimizer: AdamWState, loader: LoaderState) -> Self {
        TrainingState {
            format_version: FORMAT_VERSION,
            step,
            config,
            optimizer,
            loader,
            scaler: None,
        }
    }
}
