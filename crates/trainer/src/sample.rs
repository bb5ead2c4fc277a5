//! Text generation from a trained or pretrained model with a KV cache: temperature, top-k,
//! top-p, min-p and the repetition penalty in transformers' order, a seeded generator (the same
//! seed gives the same tokens), end tokens, and a context that slides when the model's window is
//! full. A Hugging Face model's `generation_config.json` ([`GenerationConfig`]) gives the
//! defaults transformers' `generate` would take from it.

use std::path::Path;

use headroom_mmap_data::rng::Xoshiro256;
use headroom_tensor::{Cpu, CpuTensor};

use crate::model::finetune::{FinetuneBuilder, FinetuneSpec, QuantSpec};
use crate::model::{Model, ModelConfig, ModelOps, ModelOptions, Precision};
use crate::{adapters, checkpoint, hf, Result, TrainError};

/// How the next token is chosen from the logits. The steps run in the order transformers'
/// `generate` applies its logits processors (`_get_logits_processor`), so a setting means what
/// it means there: the repetition penalty on the raw logits, then the temperature, top-k, top-p
/// and min-p, then a draw from the softmax of what is left. At temperature 0 only the penalty
/// applies and the choice is the argmax (transformers' greedy search).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 picks the most likely token every time (greedy).
    pub temperature: f32,
    /// Keep the `k` most likely tokens, and any tied with the k-th
    /// (transformers' `TopKLogitsWarper`).
    pub top_k: Option<usize>,
    /// Nucleus sampling: keep the most likely tokens whose probabilities add up to `top_p`,
    /// dropping the least likely while the mass dropped stays within `1 − top_p`
    /// (transformers' `TopPLogitsWarper`); in (0, 1], 1 keeps everything.
    pub top_p: Option<f32>,
    /// Keep the tokens at least `min_p` times as likely as the most likely one
    /// (transformers' `MinPLogitsWarper`); in [0, 1].
    pub min_p: Option<f32>,
    /// CTRL's repetition penalty: a token already in the prompt or the output has its logit
    /// divided by this when positive and multiplied when negative
    /// (transformers' `RepetitionPenaltyLogitsProcessor`); > 0, 1 is none.
    pub repetition_penalty: Option<f32>,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: None,
        }
    }
}

impl Sampling {
    /// Greedy decoding: the argmax every time.
    pub fn greedy() -> Self {
        Sampling {
            temperature: 0.0,
            ..Sampling::default()
        }
    }

    /// A typed error for a setting outside its range.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(TrainError::Input(format!("sample: {what}")));
        let t = self.temperature;
        if !(t >= 0.0 && t.is_finite()) {
            return bad(format!("temperature {t} is not a finite number ≥ 0"));
        }
        if self.top_k == Some(0) {
            return bad("top-k must be at least 1".into());
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return bad(format!("top-p {p} is not in (0, 1]"));
            }
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return bad(format!("min-p {p} is not in [0, 1]"));
            }
        }
        if let Some(r) = self.repetition_penalty {
            if !(r > 0.0 && r.is_finite()) {
                return bad(format!("repetition penalty {r} is not a finite number > 0"));
            }
        }
        Ok(())
    }
}

/// The file beside a Hugging Face model's weights that holds its makers' generation
/// settings.
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// The largest `generation_config.json` read (real ones are under 1 KiB).
const MAX_GENERATION_CONFIG_BYTES: u64 = 1 << 20;

/// The most end-of-text ids a generation config may list.
const MAX_EOS_IDS: usize = 4096;

/// What a Hugging Face model's `generation_config.json` sets of what headroom's sampler does
/// (transformers' `GenerationConfig`); `None` is unset (or `null`), which transformers fills
/// with its defaults: greedy, or when sampling temperature 1, top-k 50, top-p 1. Other keys
/// (beams, lengths, `bos_token_id`, …) are not read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    /// Sample (`true`) or take the argmax (`false`, transformers' default).
    pub do_sample: Option<bool>,
    /// Softmax temperature when sampling.
    pub temperature: Option<f32>,
    /// Top-k when sampling; 0 turns it off.
    pub top_k: Option<usize>,
    /// Top-p when sampling; 1 turns it off.
    pub top_p: Option<f32>,
    /// Min-p when sampling.
    pub min_p: Option<f32>,
    /// The repetition penalty, greedy or not; 1 is none.
    pub repetition_penalty: Option<f32>,
    /// `eos_token_id`: one id, a list, or none; generation stops after any of them.
    pub eos_token_ids: Vec<u32>,
}

/// The settings given for one generation (`headroom sample`'s flags): each replaces the model's
/// [`GenerationConfig`] value. A temperature above 0, a top-k, top-p or min-p asks for sampling
/// (as `generate(do_sample=True, …)`), a temperature of 0 for the argmax.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingRequest {
    /// Softmax temperature; 0 is greedy.
    pub temperature: Option<f32>,
    /// Top-k; 0 turns it off.
    pub top_k: Option<usize>,
    /// Top-p.
    pub top_p: Option<f32>,
    /// Min-p.
    pub min_p: Option<f32>,
    /// Repetition penalty.
    pub repetition_penalty: Option<f32>,
}

impl SamplingRequest {
    /// The sampler these settings ask for with no generation config: temperature 1 unless
    /// given, and only the cuts asked for.
    pub fn plain(&self) -> Sampling {
        Sampling {
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.filter(|&k| k != 0),
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
        }
    }
}

impl GenerationConfig {
    /// Reads a `generation_config.json`'s text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let bad = |why: String| TrainError::Input(format!("{}: {why}", path.display()));
        // A value as the error quotes it: its start, for a long one.
        let shown = |v: &serde_json::Value| {
            let text = v.to_string();
            match text.char_indices().nth(40) {
                Some((at, _)) => format!("{}…", &text[..at]),
                None => text,
            }
        };
        let serde_json::Value::Object(map) =
            serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?
        else {
            return Err(bad("not a JSON object".into()));
        };
        let number = |key: &str| -> Result<Option<f64>> {
            match map.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::Number(n)) => Ok(n.as_f64()),
                Some(v) => Err(bad(format!("{key} is {}, not a number", shown(v)))),
            }
        };
        let real = |key: &str| -> Result<Option<f32>> {
            match number(key)? {
                Some(x) if x.is_finite() && x.abs() <= f64::from(f32::MAX) => Ok(Some(x as f32)),
                Some(x) => Err(bad(format!("{key} {x} is not a finite f32"))),
                None => Ok(None),
            }
        };
        let id = |v: &serde_json::Value| -> Result<u32> {
            v.as_u64()
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(|| bad(format!("eos_token_id holds {}, not a token id", shown(v))))
        };
        let eos_token_ids = match map.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(serde_json::Value::Array(ids)) if ids.len() <= MAX_EOS_IDS => {
                ids.iter().map(id).collect::<Result<_>>()?
            }
            Some(serde_json::Value::Array(ids)) => {
                return Err(bad(format!(
                    "eos_token_id lists {} ids, more than {MAX_EOS_IDS}",
                    ids.len()
                )))
            }
            Some(v) => vec![id(v)?],
        };
        let top_k = match map.get("top_k") {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|k| usize::try_from(k).ok())
                    .ok_or_else(|| bad(format!("top_k is {}, not a count", shown(v))))?,
            ),
        };
        let do_sample = match map.get("do_sample") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Bool(b)) => Some(*b),
            Some(v) => return Err(bad(format!("do_sample is {}, not true or false", shown(v)))),
        };
        Ok(GenerationConfig {
            do_sample,
            temperature: real("temperature")?,
            top_k,
            top_p: real("top_p")?,
            min_p: real("min_p")?,
            repetition_penalty: real("repetition_penalty")?,
            eos_token_ids,
        })
    }

    /// The `generation_config.json` in `dir`, if it has one.
    pub fn beside(dir: &Path) -> Result<Option<Self>> {
        Ok(Self::read_beside(dir)?.map(|(_, config)| config))
    }

    /// The bytes of the `generation_config.json` in `dir`, if it has one, once they read as
    /// one: what an export of a model made from `dir` carries over, as `save_pretrained` does.
    pub fn file_beside(dir: &Path) -> Result<Option<Vec<u8>>> {
        Ok(Self::read_beside(dir)?.map(|(bytes, _)| bytes))
    }

    /// The `generation_config.json` in `dir`, its bytes and what they say.
    fn read_beside(dir: &Path) -> Result<Option<(Vec<u8>, Self)>> {
        let path = dir.join(GENERATION_CONFIG);
        if !path.is_file() {
            return Ok(None);
        }
        let bytes = crate::bounded::read_file(&path, MAX_GENERATION_CONFIG_BYTES)
            .map_err(|e| TrainError::Input(format!("{}: {e}", path.display())))?;
        let text = std::str::from_utf8(&bytes)
            .map_err(|e| TrainError::Input(format!("{}: {e}", path.display())))?;
        let config = Self::parse(text, &path)?;
        Ok(Some((bytes, config)))
    }

    /// The sampler transformers' `generate` builds from this config with `asked`'s settings
    /// passed to it (sampling ones with `do_sample=True`): greedy unless sampling is asked for
    /// or set, else the config's values under the settings given, transformers' defaults
    /// under both (temperature 1, top-k 50, top-p 1), a top-k of 0 and a top-p of 1 meaning
    /// none. The repetition penalty applies either way. Checked ([`Sampling::validate`]).
    pub fn sampling(&self, asked: &SamplingRequest) -> Result<Sampling> {
        // A setting out of range is refused even where greedy search would not read it.
        asked.plain().validate()?;
        let greedy_asked = asked.temperature == Some(0.0);
        let sampling_asked = asked.temperature.is_some_and(|t| t != 0.0)
            || asked.top_k.is_some()
            || asked.top_p.is_some()
            || asked.min_p.is_some();
        let repetition_penalty = asked
            .repetition_penalty
            .or(self.repetition_penalty)
            .filter(|&r| r != 1.0);
        let chosen = if greedy_asked || !(sampling_asked || self.do_sample == Some(true)) {
            Sampling {
                repetition_penalty,
                ..Sampling::greedy()
            }
        } else {
            let temperature = asked.temperature.or(self.temperature).unwrap_or(1.0);
            // transformers refuses to sample at temperature 0 rather than take the argmax.
            if temperature == 0.0 {
                return Err(TrainError::Input(
                    "sample: the generation config samples at temperature 0; set a \
                     temperature above 0, or 0 with --temperature to take the argmax"
                        .into(),
                ));
            }
            let top_p = asked.top_p.or(self.top_p).unwrap_or(1.0);
            // Checked before 1 is read as no cut (transformers then builds no top-p step at
            // all, whatever the value).
            Sampling {
                top_p: Some(top_p),
                ..Sampling::default()
            }
            .validate()?;
            Sampling {
                temperature,
                top_k: Some(asked.top_k.or(self.top_k).unwrap_or(50)).filter(|&k| k != 0),
                top_p: Some(top_p).filter(|&p| p < 1.0),
                min_p: asked.min_p.or(self.min_p),
                repetition_penalty,
            }
        };
        chosen.validate()?;
        Ok(chosen)
    }
}

/// How to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleOptions {
    /// New tokens to generate.
    pub tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Seed of the generator.
    pub seed: u64,
    /// Stop after generating any of these tokens (the end of text; transformers'
    /// `eos_token_id`, which may be a list); empty never stops early.
    pub stop_tokens: Vec<u32>,
    /// Draw only ids below this (a tokenizer with fewer ids than the model's padded
    /// vocabulary); `None` allows the whole vocabulary.
    pub vocab_limit: Option<usize>,
}

impl Default for SampleOptions {
    fn default() -> Self {
        SampleOptions {
            tokens: 100,
            sampling: Sampling::default(),
            seed: 1337,
            stop_tokens: Vec::new(),
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

/// The fp32 masters and config of [`load_model`]'s model. A headroom checkpoint's model files
/// are verified against its manifest and read as the Hugging Face directory its step is; its
/// optimizer state is not read.
pub fn load_masters(dir: &Path, cpu: &Cpu) -> Result<(ModelConfig, Vec<CpuTensor>)> {
    match model_source(dir)? {
        Some(step) => {
            let (model_dir, cfg) = checkpoint::verify_model_files(&step)?;
            let (read, masters) = hf::load(&model_dir, cpu)?;
            same_config(&model_dir, read, cfg)?;
            Ok((cfg, masters))
        }
        None => hf::load(dir, cpu),
    }
}

/// A checkpoint's `config.json` (`read`) says what its state says (`cfg`).
fn same_config(model_dir: &Path, read: ModelConfig, cfg: ModelConfig) -> Result<()> {
    if read != cfg {
        return Err(TrainError::Input(format!(
            "{}: config.json holds {read:?}, the checkpoint's state {cfg:?}",
            model_dir.display()
        )));
    }
    Ok(())
}

/// The directory whose tokenizer and generation config go with the model at `dir`: a
/// headroom checkpoint's step directory (a root's newest), the companion files its manifest
/// lists checked against it ([`checkpoint::verify_companions`]); else `dir`, a Hugging Face
/// directory.
pub fn model_files_dir(dir: &Path) -> Result<std::path::PathBuf> {
    match model_source(dir)? {
        Some(step) => checkpoint::verify_companions(&step),
        None => Ok(dir.to_path_buf()),
    }
}

/// Where `dir`'s model is: a headroom checkpoint step (`Some`) or a Hugging Face directory.
fn model_source(dir: &Path) -> Result<Option<std::path::PathBuf>> {
    match checkpoint::resolve(dir) {
        Ok(step) => Ok(Some(step)),
        // An unfinished headroom save keeps its error: its files are not known to match.
        Err(e) if dir.join("state.json").exists() || !dir.join("config.json").is_file() => Err(e),
        Err(_) => Ok(None),
    }
}

/// How `sample` and `eval` hold a model's weights.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InferenceWeights {
    /// Format of the weights and activations: fp32 keeps the checkpoint's f32 values; bf16 and
    /// fp16 keep only rounded copies (half the bytes), as transformers' `torch_dtype` does.
    pub precision: Precision,
    /// Every block linear in 4 bits (bitsandbytes' `load_in_4bit` with this quantization
    /// type, block size and double quantization); the embeddings, norms and head in
    /// `precision`.
    pub quantize: Option<QuantSpec>,
}

/// [`load_model_with`], holding the weights as `how` says. At fp32 with an adapter and no
/// quantization it is [`load_model_with`] itself (the adapter merged into the f32 weights,
/// the whole f32 model read first).
/// Otherwise the base is
/// streamed one tensor at a time into its stored form (a headroom checkpoint's files are
/// verified first, streamed too; its optimizer state is not read), so the f32 model never
/// exists whole, and an adapter is applied unmerged
/// beside it, as PEFT runs a `PeftModel` over a 4-bit or bf16 base — the numerics a QLoRA run
/// trained with.
pub fn load_for_inference(
    dir: &Path,
    adapter: Option<&Path>,
    cpu: &Cpu,
    how: &InferenceWeights,
) -> Result<Model> {
    if how.precision == Precision::Fp32 && how.quantize.is_none() && adapter.is_some() {
        return load_model_with(dir, adapter, cpu);
    }
    let opts = ModelOptions {
        precision: how.precision,
        ..ModelOptions::default()
    };
    let lora = adapter.map(|a| adapters::load(cpu, a)).transpose()?;
    let builder = |cfg: ModelConfig| -> Result<FinetuneBuilder> {
        match &lora {
            Some(l) => {
                let mut config = l.config().clone();
                config.dropout = 0.0; // inference
                let spec = FinetuneSpec {
                    lora: config,
                    quantize: how.quantize.clone(),
                };
                FinetuneBuilder::new(cpu, cfg, opts, spec)
            }
            None => FinetuneBuilder::frozen(cpu, cfg, opts, how.quantize.clone()),
        }
    };
    // A headroom checkpoint's step directory is a Hugging Face directory too: once its files
    // are verified, both stream.
    let (model_dir, cfg) = match model_source(dir)? {
        Some(step) => checkpoint::verify_model_files(&step)?,
        None => (dir.to_path_buf(), hf::read_config(dir)?),
    };
    let mut b = builder(cfg)?;
    let read = hf::load_into(&model_dir, cpu, &mut b)?;
    same_config(&model_dir, read, cfg)?;
    match (&lora, adapter) {
        (Some(l), Some(a)) => {
            let tensors = adapters::unmerged_tensors(&cfg, l, a)?;
            b.finish(Some(&tensors))
        }
        _ => b.finish(None),
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

/// The logits after the repetition penalty for the ids in `history` (ids outside `logits`
/// are ignored), in f32 as transformers computes them (each id once, however often it
/// occurs).
fn penalized(logits: &[f32], history: &[u32], penalty: Option<f32>) -> Vec<f32> {
    let mut scores = logits.to_vec();
    if let Some(r) = penalty.filter(|&r| r != 1.0) {
        let mut seen = vec![false; scores.len()];
        for &id in history {
            let i = id as usize;
            if i < scores.len() && !std::mem::replace(&mut seen[i], true) {
                let s = scores[i];
                scores[i] = if s < 0.0 { s * r } else { s / r };
            }
        }
    }
    scores
}

/// The distribution the next token is drawn from: the ids `sampling` keeps, in ascending id
/// order, each with its probability (f64, summing to 1). `history` is every token so far,
/// prompt included, for the repetition penalty. At temperature 0, the argmax alone (the lowest
/// id among equals).
///
/// Numerics: the penalty and the temperature are applied in f32, as in transformers, so those
/// scores are its bits; the softmax, top-p's cumulative sums and min-p's ratios are computed in
/// f64 (transformers: f32), so a token whose cumulative probability lies within f32 rounding of
/// top-p's cut can fall on the other side.
///
/// Cost: a decoding step's forward on a small model is a few milliseconds, and sorting a
/// 50 257-token vocabulary would add about as much, so nothing is sorted whole: top-k selects
/// its k (`select_nth`), top-p sorts only the most likely tokens it needs (128 first, eight
/// times more while their mass falls short), and the exponentials are taken over what top-k
/// kept.
pub fn next_token_distribution(
    logits: &[f32],
    history: &[u32],
    sampling: &Sampling,
) -> Result<Vec<(u32, f64)>> {
    sampling.validate()?;
    if logits.is_empty() {
        return Err(TrainError::Input("sample: no logits".into()));
    }
    if logits.iter().any(|l| l.is_nan()) {
        return Err(TrainError::Input(
            "sample: the model produced NaN logits".into(),
        ));
    }
    let mut scores = penalized(logits, history, sampling.repetition_penalty);
    // Descending by score, ties by id: the order every cut and the greedy choice use.
    let by_score =
        |s: &[f32], a: &u32, b: &u32| s[*b as usize].total_cmp(&s[*a as usize]).then(a.cmp(b));
    let mut kept: Vec<u32> = (0..scores.len() as u32).collect();
    if sampling.temperature == 0.0 {
        let best = kept
            .into_iter()
            .min_by(|a, b| by_score(&scores, a, b))
            .unwrap_or(0);
        return Ok(vec![(best, 1.0)]);
    }
    if sampling.temperature != 1.0 {
        for s in &mut scores {
            *s /= sampling.temperature;
        }
    }
    let by_score = |a: &u32, b: &u32| by_score(&scores, a, b);
    if let Some(k) = sampling.top_k.filter(|&k| k < kept.len()) {
        kept.select_nth_unstable_by(k - 1, by_score);
        let kth = scores[kept[k - 1] as usize];
        // The tokens tied with the k-th stay too (scores ≥ the k-th's, transformers' rule).
        let mut end = k;
        for i in k..kept.len() {
            if scores[kept[i] as usize] == kth {
                kept.swap(end, i);
                end += 1;
            }
        }
        kept.truncate(end);
    }
    let top = kept
        .iter()
        .map(|&i| scores[i as usize])
        .fold(f32::NEG_INFINITY, f32::max);
    if !top.is_finite() {
        return Err(TrainError::Input(format!(
            "sample: the largest logit is {top} after the penalty and the temperature \
             (a temperature too close to 0?)"
        )));
    }
    // Each kept id with exp(s − s_max), its unnormalised probability (one exponential each).
    let by_score = |a: &(u32, f64), b: &(u32, f64)| by_score(&a.0, &b.0);
    let mut kept: Vec<(u32, f64)> = kept
        .into_iter()
        .map(|i| (i, (f64::from(scores[i as usize]) - f64::from(top)).exp()))
        .collect();
    if let Some(p) = sampling.top_p.filter(|&p| p < 1.0) {
        let total: f64 = kept.iter().map(|&(_, w)| w).sum();
        // transformers drops, from the least likely up, every token whose cumulative
        // probability is ≤ 1 − p: so it keeps the shortest most-likely prefix whose mass
        // reaches total − (1 − p)·total.
        let need = total - (1.0 - f64::from(p)) * total;
        let mut sorted = kept.len().min(128);
        loop {
            if sorted < kept.len() {
                kept.select_nth_unstable_by(sorted - 1, by_score);
            }
            kept[..sorted].sort_unstable_by(by_score);
            let mut mass = 0.0;
            let reached = kept[..sorted].iter().position(|&(_, w)| {
                mass += w;
                mass >= need
            });
            if let Some(last) = reached {
                kept.truncate(last + 1);
                break;
            }
            if sorted == kept.len() {
                break; // rounding: the whole mass fell a hair short of `need`
            }
            sorted = (sorted * 8).min(kept.len());
        }
    }
    if let Some(p) = sampling.min_p {
        // p_i < min_p · p_max ⇔ exp(s_i − s_max) < min_p: no normaliser needed. The most
        // likely token has weight 1 and always stays.
        kept.retain(|&(_, w)| w >= f64::from(p));
    }
    kept.sort_unstable_by_key(|&(id, _)| id);
    let total: f64 = kept.iter().map(|&(_, w)| w).sum();
    for (_, w) in &mut kept {
        *w /= total;
    }
    Ok(kept)
}

/// The next token from `logits` `[V]`, drawn from [`next_token_distribution`] with `rng`
/// (the argmax at temperature 0, the lowest id among equals).
pub fn pick(
    logits: &[f32],
    history: &[u32],
    sampling: &Sampling,
    rng: &mut Xoshiro256,
) -> Result<u32> {
    let dist = next_token_distribution(logits, history, sampling)?;
    if let [(only, _)] = dist[..] {
        return Ok(only);
    }
    let mut target = rng.next_f64();
    for &(id, p) in &dist {
        if target < p {
            return Ok(id);
        }
        target -= p;
    }
    // Rounding left the draw past the last probability: the last kept token.
    Ok(dist.last().map_or(0, |&(id, _)| id))
}

/// Stop strings (transformers' `stop_strings`): generation stops after the token with which
/// the text comes to hold one of them, where that occurrence reaches into the token (so a
/// token may run past the string's end, and a string already in the text before it does not
/// count again). Fed the bytes each token adds ([`crate::tokenize::Tokenizer::token_bytes`]),
/// the prompt's too, so a string may start in the prompt; it keeps only the bytes a match can
/// still reach.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopStrings {
    strings: Vec<Vec<u8>>,
    /// The end of the text so far: the longest string's length less one byte, before the
    /// last token's bytes.
    tail: Vec<u8>,
}

impl StopStrings {
    /// Matching for these strings; an empty one is refused.
    pub fn new<S: AsRef<str>>(strings: &[S]) -> Result<Self> {
        if strings.iter().any(|s| s.as_ref().is_empty()) {
            return Err(TrainError::Input("sample: a stop string is empty".into()));
        }
        Ok(StopStrings {
            strings: strings
                .iter()
                .map(|s| s.as_ref().as_bytes().to_vec())
                .collect(),
            tail: Vec::new(),
        })
    }

    /// Whether there are no strings to stop at.
    pub fn is_empty(&self) -> bool {
        self.strings.is_empty()
    }

    /// Adds the bytes of the next token; whether a stop string now ends inside or past the
    /// start of those bytes.
    pub fn push(&mut self, token: &[u8]) -> bool {
        let before = self.tail.len();
        self.tail.extend_from_slice(token);
        let text = &self.tail;
        let hit = self.strings.iter().any(|s| {
            // Starts from which `s` reaches past `before` and still fits the text.
            let first = (before + 1).saturating_sub(s.len());
            let last = text.len().checked_sub(s.len());
            last.is_some_and(|last| (first..=last).any(|at| text[at..].starts_with(s)))
        });
        let keep = self.strings.iter().map(Vec::len).max().unwrap_or(1) - 1;
        let cut = self.tail.len().saturating_sub(keep);
        self.tail.drain(..cut);
        hit
    }
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
    generate_until(model, prompt, opts, |id| {
        on_token(id)?;
        Ok(std::ops::ControlFlow::Continue(()))
    })
}

/// [`generate`], where `on_token` may also end generation after the token it is given (a
/// stop string, [`StopStrings`]); that token is kept, as transformers keeps the token that
/// met a stopping criterion.
pub fn generate_until<B: ModelOps>(
    model: &Model<B>,
    prompt: &[u32],
    opts: &SampleOptions,
    on_token: impl FnMut(u32) -> Result<std::ops::ControlFlow<()>>,
) -> Result<Vec<u32>> {
    let mut fresh = PromptCache::new();
    Ok(generate_cached(model, &mut fresh, prompt, opts, on_token)?.0)
}

/// The keys and values of the tokens one call of [`generate_cached`] ran, kept for the next:
/// a conversation's turns share everything up to the latest message, so each turn runs only
/// what is new (llama.cpp's prompt cache; transformers' chat passes `past_key_values` on).
/// Holds `2 · layers · kv_heads · head_dim` elements per token, in the storage precision.
pub struct PromptCache<T> {
    cache: Option<crate::model::KvCache<T>>,
    /// The tokens at the cache's positions `0..`, in order.
    tokens: Vec<u32>,
}

impl<T> Default for PromptCache<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> PromptCache<T> {
    /// An empty one.
    pub fn new() -> Self {
        PromptCache {
            cache: None,
            tokens: Vec::new(),
        }
    }

    /// Positions it holds.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The kept cache, taken out and cut back to the longest prefix it shares with `tokens`
    /// (at most `tokens.len() − 1` positions, so a token is left to run for its logits), and
    /// that prefix's length; a fresh cache when nothing is shared. `self` is empty until
    /// [`PromptCache::keep`] gives it a cache back, so an error in between leaves nothing out
    /// of step with its tokens.
    pub fn take_prefix<B: ModelOps<Tensor = T>>(
        &mut self,
        model: &Model<B>,
        tokens: &[u32],
    ) -> Result<(crate::model::KvCache<T>, usize)> {
        let shared = self
            .tokens
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count()
            .min(tokens.len().saturating_sub(1));
        self.tokens.clear();
        match self.cache.take() {
            Some(mut cache) if shared > 0 => {
                model.truncate_cache(&mut cache, shared)?;
                Ok((cache, shared))
            }
            _ => Ok((model.kv_cache(1), 0)),
        }
    }

    /// Keep `cache`, which holds `tokens` at its positions `0..`, for the next call.
    pub fn keep(&mut self, cache: crate::model::KvCache<T>, tokens: Vec<u32>) {
        self.cache = Some(cache);
        self.tokens = tokens;
    }
}

/// Stopped rows leave a batch's cache once they are this share of its rows (1 in 4).
const DROP_STOPPED_SHARE: usize = 4;

/// One batch's prompts generated together: what [`generate_cached`] generates for each
/// prompt alone, in one batched decode step per token.
///
/// The prompts' longest shared prefix (a few-shot preamble) runs once, after what `kept`
/// holds, and is repeated for every row ([`Model::repeat_cache`]); the rows' own tails run as
/// one padded step ([`Model::decode_ragged`]); then every row takes a token a step until each
/// has stopped (a stop token, `on_token` breaking, or `opts.tokens`). Stopped rows leave the
/// batch ([`Model::keep_rows`]) once they are a quarter of it; until then a stopped row is fed
/// its last token and its results ignored, as transformers' batched `generate` does. `kept` holds
/// the shared prefix afterwards. Row `r` draws from its own generator seeded with `seeds[r]`
/// (one per prompt; `opts.seed` is not read), so it samples what [`generate_cached`] samples
/// for its prompt alone with that seed.
///
/// Returns each row's new tokens and how many of its prompt positions it did not run itself:
/// the first row reuses what `kept` held, every other row the whole shared prefix. The logits
/// equal a row's own run up to the summation order of the batched products (greedy choices
/// can differ where two logits tie to float rounding). The prompts must fit the model's
/// context with `opts.tokens` to spare: a batch has no sliding window. A call that fails
/// before the shared prefix is computed leaves `kept` empty.
pub fn generate_batch_cached<B: ModelOps>(
    model: &Model<B>,
    kept: &mut PromptCache<B::Tensor>,
    prompts: &[&[u32]],
    seeds: &[u64],
    opts: &SampleOptions,
    mut on_token: impl FnMut(usize, u32) -> Result<std::ops::ControlFlow<()>>,
) -> Result<(Vec<Vec<u32>>, Vec<usize>)> {
    let window = model.cfg.max_seq;
    if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
        return Err(TrainError::Input(
            "sample: a batch needs prompts of at least one token each".into(),
        ));
    }
    if seeds.len() != prompts.len() {
        return Err(TrainError::Input(format!(
            "sample: {} seeds for a batch of {} prompts",
            seeds.len(),
            prompts.len()
        )));
    }
    if let Some(p) = prompts.iter().find(|p| p.len() + opts.tokens > window) {
        return Err(TrainError::Input(format!(
            "sample: a batched prompt of {} tokens and {} new ones exceed the context of \
             {window}",
            p.len(),
            opts.tokens
        )));
    }
    opts.sampling.validate()?;
    let first = prompts[0];
    // Every row keeps at least one token of its own: its logits come from its own step.
    let shortest = prompts.iter().map(|p| p.len()).min().unwrap_or(1);
    let shared = prompts[1..]
        .iter()
        .map(|p| {
            first
                .iter()
                .zip(p.iter())
                .take_while(|(a, b)| a == b)
                .count()
        })
        .fold(first.len(), usize::min)
        .min(shortest - 1);
    let (mut prefix, reused) = kept.take_prefix(model, &first[..shared + 1])?;
    if shared > reused {
        model.decode(&mut prefix, &first[reused..shared])?;
    }
    let mut cache = if shared > 0 {
        model.repeat_cache(&prefix, prompts.len())?
    } else {
        model.kv_cache(prompts.len())
    };
    kept.keep(prefix, first[..shared].to_vec());
    let tails: Vec<&[u32]> = prompts.iter().map(|p| &p[shared..]).collect();
    let mut logits = model.decode_ragged(&mut cache, &tails)?;
    let vocab = logits.len() / prompts.len();
    let allowed = opts.vocab_limit.unwrap_or(vocab).min(vocab);
    let mut rngs: Vec<Xoshiro256> = seeds
        .iter()
        .map(|&s| Xoshiro256::seed_from_u64(s))
        .collect();
    let mut histories: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
    let mut outs: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut running = vec![true; prompts.len()];
    // The prompt each cache row holds: stopped rows leave the cache.
    let mut live: Vec<usize> = (0..prompts.len()).collect();
    for step in 0..opts.tokens {
        let mut next = Vec::with_capacity(live.len());
        for (&row, row_logits) in live.iter().zip(logits.chunks_exact(vocab)) {
            let last = histories[row].last().copied().unwrap_or(0);
            if !running[row] {
                next.push(last);
                continue;
            }
            let id = pick(
                &row_logits[..allowed],
                &histories[row],
                &opts.sampling,
                &mut rngs[row],
            )?;
            histories[row].push(id);
            outs[row].push(id);
            if on_token(row, id)?.is_break() || opts.stop_tokens.contains(&id) {
                running[row] = false;
            }
            next.push(id);
        }
        if !running.contains(&true) || step + 1 == opts.tokens {
            break;
        }
        // A stopped row still costs its share of every step (its products, its attention over
        // its cache), and dropping rows copies the cache's kept rows, about one step's
        // attention reads: rows go once a quarter of the batch has stopped.
        let stopped = live.iter().filter(|&&row| !running[row]).count();
        if stopped > 0 && stopped * DROP_STOPPED_SHARE >= live.len() {
            let kept: Vec<usize> = (0..live.len()).filter(|&r| running[live[r]]).collect();
            model.keep_rows(&mut cache, &kept)?;
            next = kept.iter().map(|&r| next[r]).collect();
            live = kept.iter().map(|&r| live[r]).collect();
        }
        logits = model.decode(&mut cache, &next)?;
    }
    let reused_per_row = (0..prompts.len())
        .map(|row| if row == 0 { reused } else { shared })
        .collect();
    Ok((outs, reused_per_row))
}

/// [`generate_until`] after the keys and values `kept` holds from an earlier call: the prompt's
/// positions that repeat `kept`'s tokens are not run again (the cache is cut back to the
/// longest shared prefix, at least one prompt token left to run for its logits), and `kept`
/// holds this call's tokens afterwards. Returns the new tokens and how many prompt positions
/// were reused. The logits after reuse equal a fresh run's to float rounding, not bitwise: a
/// position's keys and values come from the step that first ran it (a turn's answer one token
/// at a time, where a fresh run would run it with the prompt), as in any cached chat. A failed
/// call leaves `kept` empty.
pub fn generate_cached<B: ModelOps>(
    model: &Model<B>,
    kept: &mut PromptCache<B::Tensor>,
    prompt: &[u32],
    opts: &SampleOptions,
    mut on_token: impl FnMut(u32) -> Result<std::ops::ControlFlow<()>>,
) -> Result<(Vec<u32>, usize)> {
    if prompt.is_empty() {
        return Err(TrainError::Input(
            "sample: the prompt needs at least one token".into(),
        ));
    }
    opts.sampling.validate()?;
    let window = model.cfg.max_seq;
    // The prompt's tail that fits the window, at positions 0.. of the cache.
    let visible = &prompt[prompt.len().saturating_sub(window)..];
    let (mut cache, reused) = kept.take_prefix(model, visible)?;
    let mut tokens = visible[..reused].to_vec();
    let mut rng = Xoshiro256::seed_from_u64(opts.seed);
    let mut all: Vec<u32> = prompt.to_vec();
    let mut out = Vec::with_capacity(opts.tokens.min(1 << 20));
    let mut pending: Vec<u32> = visible[reused..].to_vec();
    for _ in 0..opts.tokens {
        if cache.len() + pending.len() > window {
            // A sliding window: the cache restarts from the last half window, recomputed.
            cache = model.kv_cache(1);
            tokens.clear();
            let keep = (window / 2).max(1);
            pending = all[all.len() - keep.min(all.len())..].to_vec();
        }
        let logits = model.decode(&mut cache, &pending)?;
        tokens.extend_from_slice(&pending);
        let allowed = opts.vocab_limit.unwrap_or(logits.len()).min(logits.len());
        let next = pick(&logits[..allowed], &all, &opts.sampling, &mut rng)?;
        all.push(next);
        out.push(next);
        let flow = on_token(next)?;
        if flow.is_break() || opts.stop_tokens.contains(&next) {
            break;
        }
        pending = vec![next];
    }
    kept.keep(cache, tokens);
    Ok((out, reused))
}
