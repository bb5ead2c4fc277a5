//! PEFT's adapter format, both ways: `adapter_config.json` + `adapter_model.safetensors`
//! with PEFT's tensor names (`base_model.model.<module>.lora_A.weight` `[r, in]`,
//! `base_model.model.<module>.lora_B.weight` `[out, r]`).
//!
//! Reading trusts nothing: the JSON's fields are type-checked one by one, settings headroom
//! does not implement are refused by name ([`LoraError::Unsupported`]) instead of being
//! ignored, every tensor's name, dtype, rank and shape is checked, and every size is backed by
//! bytes actually present before anything is allocated.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;

use half::{bf16, f16};
use headroom_tensor::Cpu;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{json, Map, Value};

use crate::adapter::LoraAdapter;
use crate::config::{LoraConfig, MAX_RANK};
use crate::error::{mul, LoraError, Result};
use crate::linear::LoraLinear;

/// The configuration file of a PEFT adapter directory.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The weights file of a PEFT adapter directory.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// What PEFT puts before a module name (`PeftModel.base_model.model`).
pub const TENSOR_PREFIX: &str = "base_model.model.";
/// The largest `adapter_config.json` read (a real one is about 1 KiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// The largest `adapter_model.safetensors` read: rank 256 on every linear of a 70B Llama
/// stored in f32 is about 12 GiB.
pub const MAX_WEIGHTS_BYTES: u64 = 64 << 30;

/// The bytes of the regular file at `path`, at most `limit` of them (`what` names the size in
/// the error). A device, FIFO or `/proc` file reports a length of 0 whatever it yields, so only
/// regular files are read, and through a bound in case one grows.
fn read_bounded(path: &Path, what: &'static str, limit: u64) -> Result<Vec<u8>> {
    let io = |source| LoraError::Io {
        path: path.to_path_buf(),
        source,
    };
    let not_regular = || {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ))
    };
    let too_large = |len: u64| LoraError::TooLarge {
        what,
        value: u128::from(len),
        limit: u128::from(limit),
    };
    // Checked before opening too: opening a FIFO blocks until something writes to it.
    if !std::fs::metadata(path).map_err(io)?.is_file() {
        return Err(not_regular());
    }
    let file = std::fs::File::open(path).map_err(io)?;
    // The handle's own metadata: the path may name something else by now.
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    if meta.len() > limit {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::new();
    let len = usize::try_from(meta.len()).map_err(|_| too_large(meta.len()))?;
    bytes
        .try_reserve_exact(len)
        .map_err(|_| io(std::io::ErrorKind::OutOfMemory.into()))?;
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Which of a module's two LoRA matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoraMatrix {
    /// `lora_A.weight`, `[r, in]`.
    A,
    /// `lora_B.weight`, `[out, r]`.
    B,
}

/// PEFT's tensor name for `module`'s matrix: `base_model.model.<module>.lora_A.weight`.
pub fn peft_tensor_name(module: &str, which: LoraMatrix) -> String {
    let m = match which {
        LoraMatrix::A => "A",
        LoraMatrix::B => "B",
    };
    format!("{TENSOR_PREFIX}{module}.lora_{m}.weight")
}

/// The module and matrix a PEFT tensor name denotes, if it is one.
pub fn parse_peft_tensor_name(name: &str) -> Option<(&str, LoraMatrix)> {
    let rest = name.strip_prefix(TENSOR_PREFIX)?;
    let (module, which) = if let Some(m) = rest.strip_suffix(".lora_A.weight") {
        (m, LoraMatrix::A)
    } else {
        (rest.strip_suffix(".lora_B.weight")?, LoraMatrix::B)
    };
    (!module.is_empty()).then_some((module, which))
}

fn json_err(msg: impl Into<String>) -> LoraError {
    LoraError::Json(msg.into())
}

/// A field that must be absent, `null`, `false` or empty for headroom to load the adapter.
fn refuse_if_set(obj: &Map<String, Value>, field: &str, why: &'static str) -> Result<()> {
    let set = match obj.get(field) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    if set {
        return Err(LoraError::Unsupported {
            field: field.to_owned(),
            value: obj.get(field).map(Value::to_string).unwrap_or_default(),
            why,
        });
    }
    Ok(())
}

fn opt_bool(obj: &Map<String, Value>, field: &str, default: bool) -> Result<bool> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(json_err(format!(
            "{field} must be true or false, found {v}"
        ))),
    }
}

fn opt_string(obj: &Map<String, Value>, field: &str) -> Result<Option<String>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(json_err(format!("{field} must be a string, found {v}"))),
    }
}

/// A list of module names (PEFT also takes a string, which it reads as a regular expression:
/// refused, since headroom matches names only).
fn name_list(obj: &Map<String, Value>, field: &str) -> Result<Option<Vec<String>>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err(json_err(format!(
                    "{field} entries must be strings, found {other}"
                ))),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(Value::String(s)) => Err(LoraError::Unsupported {
            field: field.to_owned(),
            value: format!("{s:?}"),
            why: "a string is a regular expression in PEFT; headroom takes a list of module names",
        }),
        Some(v) => Err(json_err(format!(
            "{field} must be a list of strings, found {v}"
        ))),
    }
}

/// Parse and check an `adapter_config.json`. The seed is not part of PEFT's format: it comes
/// back as 0 (it only matters for initialisation and dropout of a run that trains further).
pub fn parse_peft_config(json: &[u8]) -> Result<LoraConfig> {
    let value: Value = serde_json::from_slice(json).map_err(|e| json_err(e.to_string()))?;
    let obj = value
        .as_object()
        .ok_or_else(|| json_err("the top level must be an object"))?;
    match obj.get("peft_type") {
        Some(Value::String(t)) if t == "LORA" => {}
        Some(v) => {
            return Err(LoraError::Unsupported {
                field: "peft_type".into(),
                value: v.to_string(),
                why: "only LoRA adapters are read",
            })
        }
        None => return Err(json_err("peft_type is missing")),
    }
    let r = obj
        .get("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| json_err("r must be a positive integer"))?;
    if r == 0 || r > MAX_RANK as u64 {
        return Err(LoraError::InvalidConfig(format!(
            "r = {r} (must be 1..={MAX_RANK})"
        )));
    }
    let alpha = obj
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| json_err("lora_alpha must be a number"))?;
    let dropout = match obj.get("lora_dropout") {
        None | Some(Value::Null) => 0.0,
        Some(v) => v
            .as_f64()
            .ok_or_else(|| json_err(format!("lora_dropout must be a number, found {v}")))?,
    };
    match obj.get("bias") {
        None | Some(Value::Null) => {}
        Some(Value::String(b)) if b == "none" => {}
        Some(v) => {
            return Err(LoraError::Unsupported {
                field: "bias".into(),
                value: v.to_string(),
                why: "trained biases are not implemented (only \"none\")",
            })
        }
    }
    match obj.get("init_lora_weights") {
        None | Some(Value::Null) | Some(Value::Bool(_)) => {}
        Some(Value::String(s)) if s == "gaussian" => {}
        Some(v) => {
            return Err(LoraError::Unsupported {
                field: "init_lora_weights".into(),
                value: v.to_string(),
                why: "this initialisation (PiSSA, OLoRA, LoftQ, …) also changes the base weights",
            })
        }
    }
    for (field, why) in [
        ("use_dora", "DoRA is not implemented"),
        ("rank_pattern", "per-module ranks are not implemented"),
        ("alpha_pattern", "per-module alphas are not implemented"),
        ("layers_to_transform", "layer selection is not implemented"),
        (
            "modules_to_save",
            "fully trained extra modules are not part of a LoRA adapter here",
        ),
        ("lora_bias", "trained LoRA biases are not implemented"),
        ("layer_replication", "layer replication is not implemented"),
        (
            "target_parameters",
            "LoRA on raw parameters is not implemented",
        ),
        ("use_qalora", "QA-LoRA is not implemented"),
        (
            "trainable_token_indices",
            "trainable tokens are not implemented",
        ),
        (
            "alora_invocation_tokens",
            "activated LoRA is not implemented",
        ),
    ] {
        refuse_if_set(obj, field, why)?;
    }
    let target_modules =
        name_list(obj, "target_modules")?.ok_or_else(|| LoraError::Unsupported {
            field: "target_modules".into(),
            value: "null".into(),
            why: "PEFT then picks per-architecture defaults; headroom needs the names",
        })?;
    let config = LoraConfig {
        r: r as usize,
        alpha: alpha as f32,
        use_rslora: opt_bool(obj, "use_rslora", false)?,
        dropout: dropout as f32,
        target_modules,
        exclude_modules: name_list(obj, "exclude_modules")?.unwrap_or_default(),
        fan_in_fan_out: opt_bool(obj, "fan_in_fan_out", false)?,
        seed: 0,
        task_type: opt_string(obj, "task_type")?,
        base_model_name_or_path: opt_string(obj, "base_model_name_or_path")?,
    };
    config.validate()?;
    Ok(config)
}

/// The shortest decimal that reads back as `x` (0.05f32 is written `0.05`, as Python would).
fn short_f64(x: f32) -> Value {
    let v: f64 = format!("{x}").parse().unwrap_or(f64::from(x));
    json!(v)
}

/// `adapter_config.json` for `config`, with the fields PEFT 0.21 writes (those headroom does
/// not use at their defaults). `lora_alpha` is an integer when it is one (PEFT's type).
pub fn peft_config_json(config: &LoraConfig) -> Value {
    let alpha = if config.alpha.fract() == 0.0 && config.alpha.abs() < 9.0e15 {
        json!(config.alpha as i64)
    } else {
        short_f64(config.alpha)
    };
    let exclude = if config.exclude_modules.is_empty() {
        Value::Null
    } else {
        json!(config.exclude_modules)
    };
    json!({
        "alpha_pattern": {},
        "auto_mapping": null,
        "base_model_name_or_path": config.base_model_name_or_path,
        "bias": "none",
        "exclude_modules": exclude,
        "fan_in_fan_out": config.fan_in_fan_out,
        "inference_mode": true,
        "init_lora_weights": true,
        "layer_replication": null,
        "layers_pattern": null,
        "layers_to_transform": null,
        "lora_alpha": alpha,
        "lora_bias": false,
        "lora_dropout": short_f64(config.dropout),
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": config.r,
        "rank_pattern": {},
        "revision": null,
        "target_modules": config.target_modules,
        "task_type": config.task_type,
        "use_dora": false,
        "use_rslora": config.use_rslora,
    })
}

/// One matrix as found in the file, checked but not yet decoded.
struct Found<'a> {
    name: String,
    view: TensorView<'a>,
}

/// Decode a checked 2-D view into f32.
fn decode(view: &TensorView<'_>, dst: &mut [f32]) {
    let data = view.data();
    match view.dtype() {
        Dtype::BF16 => {
            for (d, c) in dst.iter_mut().zip(data.chunks_exact(2)) {
                *d = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        Dtype::F16 => {
            for (d, c) in dst.iter_mut().zip(data.chunks_exact(2)) {
                *d = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        _ => {
            for (d, c) in dst.iter_mut().zip(data.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

/// The `[rows, cols]` of a matrix, after checking its dtype and that its bytes are present.
fn check_matrix(found: &Found<'_>) -> Result<(usize, usize)> {
    let size = match found.view.dtype() {
        Dtype::F32 => 4,
        Dtype::BF16 | Dtype::F16 => 2,
        other => {
            return Err(LoraError::UnsupportedDType {
                name: found.name.clone(),
                dtype: format!("{other:?}"),
            })
        }
    };
    let shape = found.view.shape();
    let [rows, cols] = *shape else {
        return Err(LoraError::ShapeMismatch {
            name: found.name.clone(),
            expected: "2-D".into(),
            actual: shape.to_vec(),
        });
    };
    // safetensors checks this too; checked again so no file size reaches an allocation
    // unverified whatever that crate's version does.
    let bytes = mul("tensor bytes", mul("tensor elements", rows, cols)?, size)?;
    if bytes != found.view.data().len() {
        return Err(LoraError::Safetensors(format!(
            "{}: {} data bytes for shape {shape:?}",
            found.name,
            found.view.data().len()
        )));
    }
    Ok((rows, cols))
}

impl LoraAdapter {
    /// Read a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`).
    /// Parameters are allocated through `cpu` as `Parameters` (f32; bf16 and f16 files are
    /// widened exactly).
    pub fn load(cpu: &Cpu, dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = read_bounded(
            &dir.join(CONFIG_FILE),
            "adapter_config.json bytes",
            MAX_CONFIG_BYTES,
        )?;
        let weights = read_bounded(
            &dir.join(WEIGHTS_FILE),
            "adapter_model.safetensors bytes",
            MAX_WEIGHTS_BYTES,
        )?;
        Self::from_peft_bytes(cpu, &config, &weights)
    }

    /// [`load`](Self::load) from the two files' contents.
    pub fn from_peft_bytes(cpu: &Cpu, config_json: &[u8], weights: &[u8]) -> Result<Self> {
        let config = parse_peft_config(config_json)?;
        let st =
            SafeTensors::deserialize(weights).map_err(|e| LoraError::Safetensors(e.to_string()))?;
        let mut pairs: BTreeMap<String, (Option<Found<'_>>, Option<Found<'_>>)> = BTreeMap::new();
        for (name, view) in st.tensors() {
            let Some((module, which)) = parse_peft_tensor_name(&name) else {
                return Err(LoraError::UnexpectedTensor { name });
            };
            let entry = pairs.entry(module.to_owned()).or_default();
            let slot = match which {
                LoraMatrix::A => &mut entry.0,
                LoraMatrix::B => &mut entry.1,
            };
            *slot = Some(Found { name, view });
        }
        if pairs.is_empty() {
            return Err(LoraError::NoTargetMatched {
                targets: config.target_modules.clone(),
            });
        }
        // Check every module before allocating any.
        let mut checked = Vec::with_capacity(pairs.len());
        for (module, (a, b)) in &pairs {
            let missing = |w| LoraError::MissingTensor {
                name: peft_tensor_name(module, w),
            };
            let a = a.as_ref().ok_or_else(|| missing(LoraMatrix::A))?;
            let b = b.as_ref().ok_or_else(|| missing(LoraMatrix::B))?;
            let (ra, in_f) = check_matrix(a)?;
            let (out_f, rb) = check_matrix(b)?;
            for (name, rank) in [(&a.name, ra), (&b.name, rb)] {
                if rank != config.r {
                    return Err(LoraError::RankMismatch {
                        name: name.clone(),
                        expected: config.r,
                        actual: rank,
                    });
                }
            }
            if !config.matches(module) {
                return Err(LoraError::NotTargeted {
                    module: module.clone(),
                    targets: config.target_modules.clone(),
                });
            }
            checked.push((module, a, b, out_f, in_f));
        }
        let mut modules = Vec::with_capacity(checked.len());
        for (module, a, b, out_f, in_f) in checked {
            let mut lora = LoraLinear::new(cpu, module, out_f, in_f, &config)?;
            let (pa, pb) = lora.params_mut();
            decode(&a.view, pa);
            decode(&b.view, pb);
            modules.push(lora);
        }
        LoraAdapter::from_modules(config, modules)
    }

    /// The two files' contents: `adapter_config.json` (pretty-printed, as PEFT writes it) and
    /// `adapter_model.safetensors` (f32, PEFT's names, metadata `{"format": "pt"}`).
    pub fn to_peft_bytes(&self) -> Result<(Vec<u8>, Vec<u8>)> {
        let mut config = serde_json::to_vec_pretty(&peft_config_json(self.config()))
            .map_err(|e| json_err(e.to_string()))?;
        config.push(b'\n');
        let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for (module, lora) in self.iter() {
            let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            data.push((
                peft_tensor_name(module, LoraMatrix::A),
                vec![lora.rank(), lora.in_features()],
                bytes(lora.a()),
            ));
            data.push((
                peft_tensor_name(module, LoraMatrix::B),
                vec![lora.out_features(), lora.rank()],
                bytes(lora.b()),
            ));
        }
        let views = data
            .iter()
            .map(|(name, shape, bytes)| {
                TensorView::new(Dtype::F32, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| LoraError::Safetensors(e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
        let weights = safetensors::serialize(views, Some(metadata))
            .map_err(|e| LoraError::Safetensors(e.to_string()))?;
        Ok((config, weights))
    }

    /// Write `adapter_config.json` and `adapter_model.safetensors` into `dir` (created if
    /// needed), as PEFT's `save_pretrained` lays them out.
    ///
    /// Crash-safe per file: both files are first written and synced under temporary names
    /// unique to this call, then renamed over the old ones one right after the other (the
    /// weights first) and the directory synced. A failure before the renames leaves the
    /// directory as it was, with no temporary behind; a failure or crash between the two
    /// renames (they cannot be one atomic step) leaves the new weights beside the old
    /// configuration, which [`LoraAdapter::load`] refuses unless the old configuration's rank
    /// and target modules fit the new weights (a changed `lora_alpha` alone would go
    /// unnoticed).
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let (config, weights) = self.to_peft_bytes()?;
        std::fs::create_dir_all(dir).map_err(|source| LoraError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let mut staged = Vec::with_capacity(2);
        for (file, bytes) in [(WEIGHTS_FILE, &weights), (CONFIG_FILE, &config)] {
            // On an error, dropping `staged` removes the temporaries already written.
            staged.push(StagedFile::write(dir, file, bytes)?);
        }
        for f in &mut staged {
            f.commit()?;
        }
        // Best effort, as for every rename of ours: some file systems cannot sync a directory,
        // and each file's bytes are synced already.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

/// One file of [`LoraAdapter::save`], written and synced under a temporary name in its
/// directory; removed on drop unless [`StagedFile::commit`] renamed it into place.
struct StagedFile {
    tmp: std::path::PathBuf,
    path: std::path::PathBuf,
    committed: bool,
}

impl StagedFile {
    fn write(dir: &Path, file: &str, bytes: &[u8]) -> Result<StagedFile> {
        use std::io::Write as _;
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        // Unique to this process and call, so two saves into one directory never share a
        // temporary (the leading dot keeps it out of PEFT's and the Hub's way).
        let tmp = dir.join(format!(
            ".{file}.tmp-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let staged = StagedFile {
            tmp,
            path: dir.join(file),
            committed: false,
        };
        let io = |source| LoraError::Io {
            path: staged.path.clone(),
            source,
        };
        let mut f = std::fs::File::create(&staged.tmp).map_err(io)?;
        f.write_all(bytes).and_then(|()| f.sync_all()).map_err(io)?;
        Ok(staged)
    }

    fn commit(&mut self) -> Result<()> {
        std::fs::rename(&self.tmp, &self.path).map_err(|source| LoraError::Io {
            path: self.path.clone(),
            source,
        })?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for StagedFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}
