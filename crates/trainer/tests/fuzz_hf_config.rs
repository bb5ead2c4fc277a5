//! Structural damage to a Hugging Face model directory's JSON (`config.json`, and a sharded
//! model's `model.safetensors.index.json`) that keeps the JSON valid, so that the loader's own
//! checks face every value: each setting set to odd values (`common::odd_json_values`: zero,
//! negative, 2³², `u64::MAX`, 1e300, strings, arrays, objects) or removed. Every variant is
//! loaded with `hf::load`; a panic, a loaded model whose tensors disagree with its config, or
//! a setting that changes the model loaded from a value of the wrong type (read as a
//! default), is a finding. Sizes from the config must be refused (or checked against the
//! files) before anything is allocated from them, so the test also runs under a small memory
//! budget of its own: nothing it loads needs more than the fixtures' few hundred KiB.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use std::sync::Arc;

use headroom_profiler::MemoryTracker;
use headroom_tensor::{AllocHook, Cpu, Device};
use headroom_trainer::hf;
use headroom_trainer::model::params::param_infos;
use serde_json::Value;

#[allow(dead_code)] // the command helpers are for the tests that run `headroom`
mod common;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Every key of `value` (objects nested in it too), as JSON pointers.
fn keys(value: &Value, at: String, out: &mut Vec<String>) {
    if let Value::Object(map) = value {
        for (k, v) in map {
            let path = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
            out.push(path.clone());
            keys(v, path, out);
        }
    }
}

/// One damaged file: the setting's JSON pointer, what it was set to (`removed` when taken
/// out), and the whole document.
struct Variant {
    path: String,
    value: String,
    json: Value,
}

/// Each key of `json` set to every odd value, and removed.
fn variants(json: &Value) -> Vec<Variant> {
    let mut paths = Vec::new();
    keys(json, String::new(), &mut paths);
    let mut out = Vec::new();
    for path in &paths {
        for odd in common::odd_json_values() {
            let mut v = json.clone();
            *v.pointer_mut(path).unwrap() = odd.clone();
            out.push(Variant {
                path: path.clone(),
                value: format!("{odd:.40}"),
                json: v,
            });
        }
        let (parent, key) = path.rsplit_once('/').unwrap();
        let key = key.replace("~1", "/").replace("~0", "~");
        let mut v = json.clone();
        if let Some(Value::Object(map)) = v.pointer_mut(parent) {
            map.remove(&key);
            out.push(Variant {
                path: path.clone(),
                value: "removed".into(),
                json: v,
            });
        }
    }
    out
}

/// Settings that change what the model computes, and the only damaged values each may load
/// with: absent or `null` (transformers' default too) and the values that mean the fixture's
/// own model. Anything else must be refused: read as a default, a wrongly typed value would
/// compute another model than transformers loads from the same file (`1` ties a head there).
fn strict(file: &str, path: &str) -> Option<&'static [&'static str]> {
    const DEFAULT: &[&str] = &["null", "removed"];
    const OR_TRUE: &[&str] = &["null", "removed", "true"];
    const OR_EMPTY: &[&str] = &["null", "removed", "{}"];
    const BOOLEAN: &[&str] = &["null", "removed", "false", "true"];
    if file != "config.json" {
        return None;
    }
    match path {
        "/model_type"
        | "/hidden_act"
        | "/activation_function"
        | "/attention_bias"
        | "/mlp_bias"
        | "/n_inner"
        | "/rope_parameters/rope_type" => Some(DEFAULT),
        // true: transformers ties and ignores a stored lm_head, as the loader does.
        "/tie_word_embeddings" => Some(OR_TRUE),
        // Qwen2, Qwen3: a boolean (either is read as itself: the fixtures' windows are null
        // or set), never another type read as one.
        "/use_sliding_window" => Some(BOOLEAN),
        "/layer_types" | "/no_rope_layers" => Some(DEFAULT),
        "/rope_parameters" => Some(OR_EMPTY),
        // Gemma 3: what transformers defaults to computes the fixture's model, or is refused.
        "/hidden_activation"
        | "/attn_logit_softcapping"
        | "/final_logit_softcapping"
        | "/rope_parameters/full_attention/rope_type"
        | "/rope_parameters/sliding_attention/rope_type" => Some(DEFAULT),
        "/use_bidirectional_attention" => Some(&["null", "removed", "false"]),
        _ => None,
    }
}

/// Copy `src` into a fresh `dst` with `file` replaced by `json`; load it.
fn load_variant(
    cpu: &Cpu,
    src: &Path,
    dst: &Path,
    file: &str,
    json: &Value,
) -> headroom_trainer::Result<()> {
    let _ = std::fs::remove_dir_all(dst);
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
    std::fs::write(dst.join(file), serde_json::to_vec(json).unwrap()).unwrap();
    let (config, tensors) = hf::load(dst, cpu)?;
    let infos = param_infos(&config);
    assert_eq!(tensors.len(), infos.len(), "{config:?}");
    for (t, info) in tensors.iter().zip(&infos) {
        assert_eq!(
            t.as_slice::<f32>().unwrap().len(),
            info.shape.iter().product::<usize>()
        );
    }
    Ok(())
}

#[test]
fn hugging_face_json_settings() {
    // 64 MiB: any allocation sized by a damaged setting is refused as a typed error, not
    // attempted (the fixtures need well under 1 MiB).
    let tracker = Arc::new(MemoryTracker::new());
    tracker.set_budget(Device::Cpu, Some(64 << 20));
    let cpu = Cpu::new().with_alloc_hook(tracker as Arc<dyn AllocHook>);
    let scratch = tempfile::tempdir().unwrap();
    let cases = [
        ("hf-llama-gqa-untied", "config.json"),
        ("hf-llama-mha-tied", "config.json"),
        ("hf-llama3-rope", "config.json"),
        ("hf-llama-yarn-rope", "config.json"),
        ("hf-qwen2", "config.json"),
        ("hf-mistral", "config.json"),
        ("hf-qwen3", "config.json"),
        ("hf-qwen2-window", "config.json"),
        ("hf-smollm3", "config.json"),
        ("hf-gemma3", "config.json"),
        ("hf-olmo2", "config.json"),
        ("hf-olmo3", "config.json"),
        ("hf-granite", "config.json"),
        ("hf-gpt2-sharded", "config.json"),
        ("hf-gpt2-sharded", "model.safetensors.index.json"),
    ];
    let (mut ok, mut errors, mut panics) = (0, 0, Vec::new());
    let mut wrongly_accepted = Vec::new();
    for (dir, file) in cases {
        let src = fixture(dir);
        let json: Value = serde_json::from_slice(&std::fs::read(src.join(file)).unwrap()).unwrap();
        for v in variants(&json) {
            let what = format!("{dir}/{file}: {} = {}", v.path, v.value);
            let dst = scratch.path().join("model");
            match catch_unwind(AssertUnwindSafe(|| {
                load_variant(&cpu, &src, &dst, file, &v.json)
            })) {
                Ok(Ok(())) => {
                    ok += 1;
                    if strict(file, &v.path).is_some_and(|allowed| !allowed.contains(&&*v.value)) {
                        wrongly_accepted.push(what);
                    }
                }
                Ok(Err(_)) => errors += 1,
                Err(_) => panics.push(what),
            }
        }
    }
    println!(
        "{ok} variants loaded, {errors} refused, {} panicked",
        panics.len()
    );
    assert!(panics.is_empty(), "panicked on:\n{}", panics.join("\n"));
    assert!(
        wrongly_accepted.is_empty(),
        "loaded, but should be refused:\n{}",
        wrongly_accepted.join("\n")
    );
    assert!(ok > 0 && errors > 0);
}

/// A model's `generation_config.json` with each setting `sample` reads set to every odd value
/// or removed: it reads, or is a typed error naming the file; what reads resolves to a checked
/// sampler or a typed error. A value of the wrong JSON type is refused, never read as unset
/// (it would sample where transformers refuses the file).
#[test]
fn generation_config_settings() {
    use headroom_trainer::sample::{GenerationConfig, SamplingRequest};
    let seed = serde_json::json!({
        "bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643],
        "min_p": 0.05, "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20,
        "top_p": 0.8,
    });
    let path = Path::new("model/generation_config.json");
    let (mut read, mut refused) = (0, 0);
    for v in variants(&seed) {
        let text = v.json.to_string();
        let parsed = catch_unwind(AssertUnwindSafe(|| GenerationConfig::parse(&text, path)))
            .unwrap_or_else(|_| panic!("{} = {}: panicked", v.path, v.value));
        let config = match parsed {
            Ok(config) => config,
            Err(e) => {
                assert!(e.to_string().contains("generation_config.json"), "{e}");
                refused += 1;
                continue;
            }
        };
        read += 1;
        let odd = v.json.pointer(&v.path).cloned().unwrap_or(Value::Null);
        let wrong_type = match v.path.as_str() {
            "/do_sample" => !(odd.is_null() || odd.is_boolean()),
            "/eos_token_id" => !(odd.is_null() || odd.is_u64() || odd.is_array()),
            "/top_k" => !(odd.is_null() || odd.is_u64()),
            "/bos_token_id" => false,
            _ => !(odd.is_null() || odd.is_number()),
        };
        assert!(!wrong_type, "{} = {} was read", v.path, v.value);
        for asked in [
            SamplingRequest::default(),
            SamplingRequest {
                temperature: Some(0.0),
                ..SamplingRequest::default()
            },
        ] {
            if let Ok(s) = config.sampling(&asked) {
                s.validate().unwrap();
            }
        }
    }
    println!("generation_config.json variants: {read} read, {refused} refused");
    assert!(read > 0 && refused > 0, "{read} read, {refused} refused");
}
