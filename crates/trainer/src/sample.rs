//! Text generation from a trained or pretrained model with a KV cache: temperature, top-k,
//! a seeded generator (the same seed gives the same tokens), and a context that slides when
//! the model's window is full.

use std::path::Path;

use headroom_mmap_data::rng::Xoshiro256;
use headroom_tensor::{Cpu, CpuTensor};

use crate::model::{Model, ModelConfig, ModelOps, ModelOptions};
use crate::{adapters, checkpoint, hf, Result, TrainError};

/// How to sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleOptions {
    /// New tokens to generate.
    pub tokens: usize,
    /// Softmax temperature; 0 picks the most likely token every time (greedy).
    pub temperature: f32,
    /// Sample only among the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Seed of the generator.
    pub seed: u64,
    /// Stop after generating this token (the end of text).
    pub stop_at: Option<u32>,
    /// Draw only ids below this (a tokenizer with fewer ids than the model's padded
    /// vocabulary); `None` allows the whole vocabulary.
    pub vocab_limit: Option<usize>,
}

impl Default for SampleOptions {
    fn default() -> Self {
        SampleOptions {
            tokens: 100,
            temperature: 1.0,
            top_k: None,
            seed: 1337,
            stop_at: None,
            vocab_limit: None,
        }
    }
}

/// Load a model for inference from `dir`: a headroom checkpoint (a run's output directory or
/// one of its `step-*` directories) or a Hugging Face model directory (`config.json` beside
/// safetensors, and no headroom training state).
pub fn load_model(dir: &Path, cpu: &Cpu) -> Result<Model> {
    load_model_with(dir, None, cpu)
}

/// The fp32 masters and config of [`load_model`]'s model.
pub fn load_masters(dir: &Path, cpu: &Cpu) -> Result<(ModelConfig, Vec<CpuTensor>)> {
    match checkpoint::resolve(dir) {
        Ok(step) => checkpoint::load(&step)?.into_masters(cpu),
        // An unfinished headroom save keeps its error: its files are not known to match.
        Err(e) if dir.join("state.json").exists() || !dir.join("config.json").is_file() => Err(e),
        Err(_) => hf::load(dir, cpu),
    }
}

/// [`load_model`], with a PEFT LoRA adapter merged into the weights when `adapter` names its
/// directory (PEFT's `merge_and_unload`).
pub fn load_model_with(dir: &Path, adapter: Option<&Path>, cpu: &Cpu) -> Result<Model> {
    let (cfg, mut masters) = load_masters(dir, cpu)?;
    if let Some(a) = adapter {
        let lora = adapters::load(cpu, a)?;
        adapters::merge(&cfg, &mut masters, &lora, a)?;
    }
    Model::from_masters(cpu, cfg, ModelOptions::default(), masters)
}

/// The next token from `logits` `[V]`: the most likely one at temperature 0 (the lowest id
/// among equals), else a draw from `softmax(logits / temperature)` restricted to the `top_k`
/// most likely tokens.
pub fn pick(
    logits: &[f32],
    temperature: f32,
    top_k: Option<usize>,
    rng: &mut Xoshiro256,
) -> Result<u32> {
    if logits.is_empty() {
        return Err(TrainError::Input("sample: no logits".into()));
    }
    if !(temperature >= 0.0 && temperature.is_finite()) {
        return Err(TrainError::Input(format!(
            "sample: temperature {temperature} is not a finite number ≥ 0"
        )));
    }
    if top_k == Some(0) {
        return Err(TrainError::Input("sample: top-k must be at least 1".into()));
    }
    if logits.iter().any(|l| l.is_nan()) {
        return Err(TrainError::Input(
            "sample: the model produced NaN logits".into(),
        ));
    }
    // Descending by logit, ties by id: the order the cut and the greedy choice use.
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if temperature == 0.0 || top_k == Some(1) {
        return Ok(order.into_iter().min_by(by_logit).unwrap_or(0));
    }
    let keep = top_k.unwrap_or(logits.len()).min(logits.len());
    if keep < logits.len() {
        order.select_nth_unstable_by(keep - 1, by_logit);
        order.truncate(keep);
    }
    order.sort_unstable_by(by_logit);
    // Softmax in f64 over the kept tokens, shifted by the largest for range.
    let top = logits[order[0] as usize] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i as usize] as f64 - top) / temperature as f64).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut target = rng.next_f64() * total;
    for (&id, w) in order.iter().zip(&weights) {
        if target < *w {
            return Ok(id);
        }
        target -= w;
    }
    // Rounding left the draw past the last weight: the last kept token.
    Ok(*order.last().unwrap_or(&0))
}

/// Continue `prompt` by up to `opts.tokens` tokens, calling `on_token` with each as it is
/// chosen; returns the new tokens. When the context window fills, the cache restarts from
/// the last half window of tokens (recomputed), as a sliding window.
pub fn generate<B: ModelOps>(
    model: &Model<B>,
    prompt: &[u32],
    opts: &SampleOptions,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(TrainError::Input(
            "sample: the prompt needs at least one token".into(),
        ));
    }
    let window = model.cfg.max_seq;
    let mut rng = Xoshiro256::seed_from_u64(opts.seed);
    let mut all: Vec<u32> = prompt.to_vec();
    let mut out = Vec::with_capacity(opts.tokens.min(1 << 20));
    let mut cache = model.kv_cache(1);
    // The prompt's tail that fits the window.
    let start = all.len().saturating_sub(window);
    let mut pending: Vec<u32> = all[start..].to_vec();
    for _ in 0..opts.tokens {
        if cache.len() + pending.len() > window {
            cache = model.kv_cache(1);
            let keep = (window / 2).max(1);
            pending = all[all.len() - keep.min(all.len())..].to_vec();
        }
        let logits = model.decode(&mut cache, &pending)?;
        let allowed = opts.vocab_limit.unwrap_or(logits.len()).min(logits.len());
        let next = pick(&logits[..allowed], opts.temperature, opts.top_k, &mut rng)?;
        all.push(next);
        out.push(next);
        on_token(next)?;
        if opts.stop_at == Some(next) {
            break;
        }
        pending = vec![next];
    }
    Ok(out)
}
