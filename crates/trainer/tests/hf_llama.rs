//! The forward of both families against transformers' own on the same weights: committed
//! fixtures written by `benches/torch/make_llama_fixture.py` — `LlamaForCausalLM` with
//! grouped-query attention and an untied head (in f32 and in bf16), with multi-head attention
//! and a tied head, and a `GPT2LMHeadModel` saved in four shards — loaded from their
//! `save_pretrained` directories. Logits within 1e-4 relative (of the largest logit) and the
//! mean cross-entropy within 1e-5, in f32. Rescaled rotary embeddings (Llama 3.1's `llama3`,
//! `linear`), Qwen2 (q/k/v biases), Mistral, Qwen3 (query/key norms, its own head width),
//! SmolLM3 (NoPE blocks), sliding windows (Mistral's, Qwen2's; decoding past them too) and a
//! Mistral with its own head width — the gradients of Qwen3, SmolLM3 and the windowed Mistral
//! against PyTorch's autograd too — against
//! `benches/torch/make_llama_family_fixture.py`'s models, their inverse frequencies bit for
//! bit.

use std::path::PathBuf;

use headroom_tensor::Cpu;
use headroom_trainer::hf;
use headroom_trainer::model::{
    Family, Geometry, LlamaClass, Model, ModelOptions, RopeScaling, SlidingWindow,
};
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn ids(st: &SafeTensors<'_>, name: &str) -> Vec<u32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
        .collect()
}

fn matches_transformers(name: &str, kv_heads: usize, tied: bool) {
    let cfg = matches_reference(name);
    match cfg.family {
        Family::Llama(s) => {
            assert_eq!((s.kv_heads, s.tied_head, s.ffn), (kv_heads, tied, 72));
            assert_eq!(s.rope_theta, 10_000.0);
        }
        Family::Gpt2 => panic!("{name} read as GPT-2"),
    }
}

/// [`matches_reference`] for a Llama-family fixture: its shape and what only a Llama has.
fn llama_matches_reference(
    name: &str,
) -> (
    headroom_trainer::model::ModelConfig,
    headroom_trainer::model::LlamaShape,
) {
    let cfg = matches_reference(name);
    let Family::Llama(s) = cfg.family else {
        panic!("{name} read as GPT-2");
    };
    (cfg, s)
}

/// The model in `dir` on the CPU, with its shape and the bytes of its
/// `reference.safetensors`.
fn loaded(dir: &std::path::Path) -> (headroom_trainer::model::ModelConfig, Model<Cpu>, Vec<u8>) {
    let cpu = Cpu::new();
    let (cfg, masters) = hf::load(dir, &cpu).unwrap();
    let model = Model::from_masters(&cpu, cfg, ModelOptions::default(), masters).unwrap();
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    (cfg, model, bytes)
}

/// The largest |a − b| of `got` against `want`.
fn worst_difference(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

/// `cfg`'s parameters, checked against its own counts: one per tensor, their elements the
/// parameter count.
fn counted_param_infos(
    cfg: &headroom_trainer::model::ModelConfig,
) -> Vec<headroom_trainer::model::params::ParamInfo> {
    let infos = headroom_trainer::model::params::param_infos(cfg);
    assert_eq!(infos.len(), cfg.tensor_count().unwrap());
    let numel: usize = infos
        .iter()
        .map(|i| i.shape.iter().product::<usize>())
        .sum();
    assert_eq!(cfg.parameter_count().unwrap(), numel as u64);
    infos
}

/// Load fixture `name`, compare logits and loss with transformers', return its shape.
fn matches_reference(name: &str) -> headroom_trainer::model::ModelConfig {
    let (cfg, model, bytes) = loaded(&fixture(name));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (tokens, targets) = (ids(&st, "tokens"), ids(&st, "targets"));
    let shape = st.tensor("tokens").unwrap().shape().to_vec();
    let g = Geometry::new(shape[0], shape[1]);
    let want = f32s(&st, "logits");
    let got = model.logits(&tokens, g).unwrap();
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = worst_difference(&got, &want);
    eprintln!("{name}: largest logit {scale}, worst difference {worst:e}");
    assert!(
        worst <= 1e-4 * scale,
        "{name}: logits differ by {worst} (scale {scale})"
    );
    let loss = model.loss(&tokens, &targets, g).unwrap();
    let want_loss = f32s(&st, "loss")[0];
    assert!(
        (loss - want_loss).abs() <= 1e-5 * want_loss.abs().max(1.0),
        "{name}: loss {loss} vs transformers' {want_loss}"
    );
    cfg
}

#[test]
fn llama_gqa_untied_matches_transformers() {
    matches_transformers("hf-llama-gqa-untied", 2, false);
}

#[test]
fn llama_mha_tied_matches_transformers() {
    matches_transformers("hf-llama-mha-tied", 4, true);
}

#[test]
fn llama_saved_in_bf16_matches_transformers() {
    matches_transformers("hf-llama-gqa-untied-bf16", 2, false);
}

#[test]
fn gpt2_in_four_shards_matches_transformers() {
    let cfg = matches_reference("hf-gpt2-sharded");
    assert_eq!(cfg.family, Family::Gpt2);
    assert_eq!(
        (cfg.layers, cfg.heads, cfg.channels, cfg.vocab),
        (2, 4, 32, 97)
    );
}

/// Fixture `name` through a one-step run with an update below f32 resolution: the saved
/// checkpoint's weights and shape read back unchanged. Returns its `config.json`.
fn saved_and_read_back(name: &str, seq: usize) -> serde_json::Value {
    use headroom_trainer::train::{train, TrainOptions};
    let dir = fixture(name);
    let cpu = Cpu::new();
    let (cfg, masters) = hf::load(&dir, &cpu).unwrap();
    let root = tempfile::tempdir().unwrap();
    let mut o = TrainOptions {
        model: cfg,
        init_from: Some(dir.clone()),
        steps: 1,
        lr: 1e-30,
        seq,
        batch: 2,
        save: Some((root.path().to_path_buf(), 0)),
        ..TrainOptions::tiny_default()
    };
    if let headroom_trainer::train::DataSource::Synthetic(d) = &mut o.data {
        d.vocab = cfg.vocab as u32;
    }
    let report = train(&o, |_| {}).unwrap();
    let saved = report.last_checkpoint.unwrap();
    let (cfg2, back) = hf::load(&saved, &cpu).unwrap();
    assert_eq!(cfg2, cfg, "{name}");
    for (a, b) in back.iter().zip(&masters) {
        assert_eq!(
            a.as_slice::<f32>().unwrap(),
            b.as_slice::<f32>().unwrap(),
            "{name}"
        );
    }
    serde_json::from_slice(&std::fs::read(saved.join("config.json")).unwrap()).unwrap()
}

/// What headroom saves is what it loads: a run initialised from the fixture with an update
/// below f32 resolution writes a checkpoint whose weights and shape read back unchanged.
/// (`benches/torch/check_hf_export.py` shows transformers loading such a checkpoint with the
/// reference's logits, 0 difference.)
#[test]
fn a_saved_llama_checkpoint_reads_back_unchanged() {
    for name in ["hf-llama-gqa-untied", "hf-llama-mha-tied"] {
        let written = saved_and_read_back(name, 16);
        assert_eq!(written["architectures"][0], "LlamaForCausalLM", "{written}");
    }
}

/// The fixture's rotary frequencies are transformers' `inv_freq` buffer, bit for bit.
fn assert_inv_freq(name: &str, cfg: &headroom_trainer::model::ModelConfig) {
    let Family::Llama(s) = cfg.family else {
        panic!("{name} read as GPT-2");
    };
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let inv_freq = s.rope().inv_freq(cfg.head_dim());
    let theirs = f32s(&st, "inv_freq");
    assert_eq!(
        inv_freq.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
        theirs.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
        "{name}: {inv_freq:?} vs transformers' {theirs:?}"
    );
    let scaling = f32s(&st, "attention_scaling")[0];
    assert_eq!(
        s.rope().attention_factor().to_bits(),
        scaling.to_bits(),
        "{name}: attention factor vs transformers' {scaling}"
    );
}

/// A rescaled fixture's shape and logits, and its inverse frequencies bit for bit.
fn rescaled_matches_transformers(name: &str, want: RopeScaling) {
    let cfg = matches_reference(name);
    let Family::Llama(s) = cfg.family else {
        panic!("{name} read as GPT-2");
    };
    assert_eq!((s.rope_theta, s.rope_scaling), (10_000.0, want), "{name}");
    assert_inv_freq(name, &cfg);
    // The rescaling moved the frequencies: a loader that ignored it would differ.
    let plain = headroom_trainer::model::Rope::plain(s.rope_theta).inv_freq(cfg.head_dim());
    assert_ne!(plain, s.rope().inv_freq(cfg.head_dim()), "{name}");
}

#[test]
fn llama3_rotary_scaling_matches_transformers() {
    rescaled_matches_transformers(
        "hf-llama3-rope",
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        },
    );
}

/// YaRN with its ramp between two frequencies and cos and sin scaled; and YaRN with
/// transformers' defaults (betas 32 and 1, rounded ends, the factor's attention factor) against
/// the frequencies transformers computed for it.
#[test]
fn yarn_rotary_scaling_matches_transformers() {
    let factor = (0.1 * 4f64.ln() + 1.0) as f32;
    rescaled_matches_transformers(
        "hf-llama-yarn-rope",
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32,
            beta_fast: 8.0,
            beta_slow: 0.5,
            attention_factor: factor,
            truncate: false,
        },
    );
    let cfg = config_edited("hf-llama-yarn-rope", |c| {
        c["rope_parameters"] = serde_json::json!({
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 16,
        });
    })
    .unwrap();
    let Family::Llama(s) = cfg.family else {
        panic!("read as GPT-2");
    };
    let bytes = std::fs::read(fixture("hf-llama-yarn-rope").join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let theirs = f32s(&st, "yarn_defaults_inv_freq");
    let ours = s.rope().inv_freq(cfg.head_dim());
    assert_eq!(
        ours.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
        theirs.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
        "{ours:?} vs transformers' {theirs:?}"
    );
    let scaling = f32s(&st, "yarn_defaults_attention_scaling")[0];
    assert_eq!(s.rope().attention_factor(), scaling);
    assert!(matches!(
        s.rope_scaling,
        RopeScaling::Yarn {
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            ..
        }
    ));
}

#[test]
fn linear_rotary_scaling_matches_transformers() {
    rescaled_matches_transformers("hf-llama-linear-rope", RopeScaling::Linear { factor: 4.0 });
}

/// `config.json` of fixture `name` with `edit` applied, read back.
fn config_edited(
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) -> headroom_trainer::Result<headroom_trainer::model::ModelConfig> {
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut cfg);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    hf::read_config(dir.path())
}

/// The llama3 fixture's `config.json` with `edit` applied, read back.
fn read_edited(edit: impl FnOnce(&mut serde_json::Value)) -> headroom_trainer::Result<Family> {
    config_edited("hf-llama3-rope", edit).map(|c| c.family)
}

#[test]
fn rotary_scaling_reads_as_either_transformers_version_writes_it() {
    let scaling = |f: Family| match f {
        Family::Llama(s) => (s.rope_theta, s.rope_scaling),
        Family::Gpt2 => panic!("read as GPT-2"),
    };
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 32,
    };
    // transformers 4: rope_theta at the top, rope_scaling beside it (Llama 3.1's own file).
    let v4 = read_edited(|c| {
        let mut p = c["rope_parameters"].take();
        p.as_object_mut().unwrap().remove("rope_theta");
        let o = c.as_object_mut().unwrap();
        o.remove("rope_parameters");
        o.insert("rope_theta".into(), 10_000.0.into());
        o.insert("rope_scaling".into(), p);
    });
    assert_eq!(scaling(v4.unwrap()), (10_000.0, llama3));
    // Before transformers 4.43 the key was `type`.
    let legacy = read_edited(|c| {
        let o = c.as_object_mut().unwrap();
        o.remove("rope_parameters");
        o.insert(
            "rope_scaling".into(),
            serde_json::json!({"type": "linear", "factor": 2.0}),
        );
    });
    assert_eq!(
        scaling(legacy.unwrap()),
        (10_000.0, RopeScaling::Linear { factor: 2.0 })
    );
    // llama3 without its original context takes transformers' fallbacks: a top-level key
    // first, then max_position_embeddings.
    let without = |c: &mut serde_json::Value| {
        c["rope_parameters"]
            .as_object_mut()
            .unwrap()
            .remove("original_max_position_embeddings");
    };
    let with_original = |n: usize| RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: n,
    };
    assert_eq!(scaling(read_edited(without).unwrap()).1, with_original(64));
    let top_level = read_edited(|c| {
        c["original_max_position_embeddings"] = 16.into();
    });
    assert_eq!(scaling(top_level.unwrap()).1, with_original(16));
    let default = read_edited(|c| {
        c["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 500000.0});
    });
    assert_eq!(scaling(default.unwrap()), (500_000.0, RopeScaling::None));
}

#[test]
fn rotary_scalings_not_implemented_or_out_of_range_are_refused() {
    let refused = |edit: &dyn Fn(&mut serde_json::Value), what: &str| {
        let err = read_edited(edit).unwrap_err().to_string();
        assert!(err.contains(what), "{what}: {err}");
    };
    refused(
        &|c| c["rope_parameters"]["rope_type"] = "longrope".into(),
        "rope type \"longrope\"",
    );
    refused(
        &|c| c["rope_parameters"]["rope_type"] = "dynamic".into(),
        "rope type \"dynamic\"",
    );
    refused(
        &|c| {
            c["rope_parameters"]
                .as_object_mut()
                .unwrap()
                .remove("factor");
        },
        "needs factor",
    );
    refused(
        &|c| c["rope_parameters"]["low_freq_factor"] = 4.0.into(),
        "below high_freq_factor",
    );
    refused(
        &|c| c["rope_parameters"]["factor"] = 0.5.into(),
        "at least 1",
    );
    refused(
        &|c| c["rope_parameters"]["original_max_position_embeddings"] = 0.into(),
        "original_max_position_embeddings",
    );
    refused(
        &|c| c["rope_parameters"]["partial_rotary_factor"] = 0.5.into(),
        "partial_rotary_factor",
    );
    refused(&|c| c["rope_parameters"]["factor"] = "8".into(), "factor");
}

/// A run from a rescaled Llama or a Qwen2 saves what makes it one: the checkpoint's
/// `config.json` (`rope_scaling` beside `rope_theta`, as transformers 4 writes it and 5.24
/// reads it into the same `rope_parameters`; Qwen2's class and model type) loads back as the
/// same model, weights unchanged.
#[test]
fn a_checkpoint_of_a_rescaled_llama_or_a_qwen2_keeps_its_layout() {
    for name in [
        "hf-llama3-rope",
        "hf-llama-linear-rope",
        "hf-llama-yarn-rope",
        "hf-qwen2",
        "hf-mistral",
        "hf-qwen3",
        "hf-mistral-head-dim",
        "hf-mistral-window",
        "hf-qwen2-window",
    ] {
        let written = saved_and_read_back(name, 48);
        if name.ends_with("-window") {
            assert_eq!(written["sliding_window"], 16, "{written}");
            if name == "hf-qwen2-window" {
                assert_eq!(written["use_sliding_window"], true, "{written}");
                assert_eq!(written["max_window_layers"], 1, "{written}");
            }
        } else if name == "hf-qwen3" {
            assert_eq!(written["architectures"][0], "Qwen3ForCausalLM", "{written}");
            assert_eq!(written["model_type"], "qwen3", "{written}");
            assert_eq!(written["head_dim"], 12, "{written}");
            assert_eq!(written["attention_bias"], false, "{written}");
            assert_eq!(written["use_sliding_window"], false, "{written}");
        } else if name == "hf-mistral-head-dim" {
            assert_eq!(written["model_type"], "mistral", "{written}");
            assert_eq!(written["head_dim"], 16, "{written}");
        } else if name == "hf-qwen2" {
            assert_eq!(written["architectures"][0], "Qwen2ForCausalLM", "{written}");
            assert_eq!(written["model_type"], "qwen2", "{written}");
        } else if name == "hf-mistral" {
            assert_eq!(
                written["architectures"][0], "MistralForCausalLM",
                "{written}"
            );
            assert_eq!(written["model_type"], "mistral", "{written}");
            assert!(written["sliding_window"].is_null(), "{written}");
        } else {
            assert!(
                written["rope_scaling"]["rope_type"].is_string(),
                "{name}: {written}"
            );
        }
    }
}

#[test]
fn qwen2_matches_transformers() {
    let (cfg, s) = llama_matches_reference("hf-qwen2");
    assert!(s.qkv_bias() && s.tied_head);
    assert_inv_freq("hf-qwen2", &cfg);
    assert_eq!(
        (s.kv_heads, s.rope_theta, s.rope_scaling, s.norm_eps),
        (2, 1e6, RopeScaling::None, 1e-6)
    );
    // Three biases per block beside Llama's nine, named as transformers names them.
    let infos = counted_param_infos(&cfg);
    assert_eq!(
        infos
            .iter()
            .filter(|i| i.name.ends_with("_proj.bias"))
            .count(),
        2 * 3
    );
}

#[test]
fn qwen2_settings_that_change_the_model_are_refused() {
    let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
        config_edited("hf-qwen2", edit).map_err(|e| e.to_string())
    };
    // The fixture's window is null (transformers writes it so without use_sliding_window),
    // and a window from block 28 on windows none of this model's two.
    for window in [serde_json::Value::Null, 16.into()] {
        let cfg = edited(&|c| {
            c["use_sliding_window"] = true.into();
            c["sliding_window"] = window.clone();
        })
        .unwrap();
        assert!(matches!(cfg.family, Family::Llama(s) if s.sliding_window.is_none()));
    }
    let err = edited(&|c| c["layer_types"][1] = "sliding_attention".into()).unwrap_err();
    assert!(err.contains("only full_attention"), "{err}");
    // layer_types must be what transformers derives from max_window_layers.
    let err = edited(&|c| {
        c["use_sliding_window"] = true.into();
        c["sliding_window"] = 16.into();
        c["max_window_layers"] = 1.into();
    })
    .unwrap_err();
    assert!(
        err.contains("full_attention before block 1, sliding_attention from it"),
        "{err}"
    );
    let err = edited(&|c| c["model_type"] = "llama".into()).unwrap_err();
    assert!(
        err.contains("not the model_type of Qwen2ForCausalLM"),
        "{err}"
    );
    // Without `architectures`, the model type names the class.
    let cfg = edited(&|c| {
        c.as_object_mut().unwrap().remove("architectures");
    })
    .unwrap();
    assert!(matches!(cfg.family, Family::Llama(s) if s.qkv_bias()));
    // transformers' own Llama with `attention_bias` biases o_proj too: still refused.
    let err = read_edited(|c| c["attention_bias"] = true.into())
        .unwrap_err()
        .to_string();
    assert!(err.contains("attention_bias is not supported"), "{err}");
}

/// QLoRA on fixture `name` as a user runs it: the base frozen in NF4, adapters on every block
/// linear, 60 steps; the loss falls, and the merged model reads back as the base's shape.
/// Returns the base's parameter names and masters, the merged masters and the merged
/// `config.json`.
fn qlora_trained_and_merged(
    name: &str,
) -> (
    Vec<String>,
    Vec<headroom_tensor::CpuTensor>,
    Vec<headroom_tensor::CpuTensor>,
    serde_json::Value,
) {
    use super::common::headroom_command;
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let run = |args: &[&str]| {
        let o = headroom_command().args(args).output().unwrap();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
    };
    run(&["data", "synth", &p("tok.bin"), "--vocab", "97"]);
    let base = fixture(name);
    let out = run(&[
        "train",
        "--init-from",
        base.to_str().unwrap(),
        "--lora-rank",
        "8",
        "--lora-targets",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "--quantize",
        "nf4",
        "--data",
        &p("tok.bin"),
        "--steps",
        "60",
        "--batch",
        "4",
        "--seq",
        "32",
        "--lr",
        "1e-2",
        "--metrics",
        &p("metrics.jsonl"),
        "--checkpoint-dir",
        &p("run"),
        "--merge-into",
        &p("merged"),
        "--no-progress",
    ]);
    let losses: Vec<f64> = std::fs::read_to_string(p("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64())
        .collect();
    assert_eq!(losses.len(), 60, "{name}: {out}");
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    assert!(
        mean(&losses[50..]) < mean(&losses[..10]) - 0.3,
        "{name}: losses {losses:?}"
    );
    let cpu = Cpu::new();
    let (merged_cfg, merged) = hf::load(&dir.path().join("merged"), &cpu).unwrap();
    let (base_cfg, masters) = hf::load(&base, &cpu).unwrap();
    assert_eq!(merged_cfg, base_cfg, "{name}");
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("merged/config.json")).unwrap())
            .unwrap();
    let names = headroom_trainer::model::params::param_infos(&base_cfg)
        .into_iter()
        .map(|i| i.name)
        .collect();
    (names, masters, merged, written)
}

/// The merged tensors whose names end in `suffix` equal the base's bit for bit; how many.
fn kept_from_the_base(
    names: &[String],
    masters: &[headroom_tensor::CpuTensor],
    merged: &[headroom_tensor::CpuTensor],
    suffix: &str,
) -> usize {
    let mut kept = 0;
    for ((name, a), b) in names.iter().zip(merged).zip(masters) {
        if name.ends_with(suffix) {
            kept += 1;
            assert_eq!(
                a.as_slice::<f32>().unwrap(),
                b.as_slice::<f32>().unwrap(),
                "{name}"
            );
        }
    }
    kept
}

/// QLoRA on Qwen2: the base's biases are kept as they are (as bitsandbytes keeps a
/// `Linear4bit`'s bias), and the merged model is a `Qwen2ForCausalLM` whose biases are the
/// base's, bit for bit.
#[test]
fn qlora_on_qwen2_trains_and_merges_into_a_qwen2() {
    let (names, masters, merged, written) = qlora_trained_and_merged("hf-qwen2");
    assert_eq!(written["architectures"][0], "Qwen2ForCausalLM");
    assert_eq!(
        kept_from_the_base(&names, &masters, &merged, "_proj.bias"),
        6
    );
}

/// QLoRA on Qwen3, whose q_proj (48 × 32) and o_proj (32 × 48) are not square: the merged
/// model is a `Qwen3ForCausalLM` whose query and key norms are the base's, bit for bit.
#[test]
fn qlora_on_qwen3_trains_and_merges_into_a_qwen3() {
    let (names, masters, merged, written) = qlora_trained_and_merged("hf-qwen3");
    assert_eq!(written["architectures"][0], "Qwen3ForCausalLM");
    assert_eq!(written["head_dim"], 12);
    assert_eq!(
        kept_from_the_base(&names, &masters, &merged, "_norm.weight"),
        4
    );
}

#[test]
fn mistral_matches_transformers() {
    let (cfg, s) = llama_matches_reference("hf-mistral");
    assert_eq!(s.class, LlamaClass::Mistral);
    assert!(!s.qkv_bias() && !s.tied_head);
    assert_inv_freq("hf-mistral", &cfg);
    assert_eq!((s.kv_heads, s.rope_theta), (1, 1e6));
}

/// Mistral's window as MistralConfig reads it: `null` is none, an absent key is 4096; a window
/// no shorter than the context never hides a key, so it is none too.
#[test]
fn a_mistral_sliding_window_is_read_as_transformers_reads_it() {
    let window = |edit: &dyn Fn(&mut serde_json::Value)| match config_edited("hf-mistral", edit)
        .unwrap()
        .family
    {
        Family::Llama(s) => s.sliding_window,
        Family::Gpt2 => panic!("read as GPT-2"),
    };
    let at = |size| Some(SlidingWindow::from_layer(size, 0));
    assert_eq!(window(&|c| c["sliding_window"] = 16.into()), at(16));
    assert_eq!(window(&|_| {}), None);
    // 4096 by default: longer than this fixture's 64 positions, so nothing is masked.
    assert_eq!(
        window(&|c| {
            c.as_object_mut().unwrap().remove("sliding_window");
        }),
        None
    );
    assert_eq!(
        window(&|c| {
            c.as_object_mut().unwrap().remove("sliding_window");
            c["max_position_embeddings"] = 32768.into();
        }),
        at(4096)
    );
    assert_eq!(window(&|c| c["sliding_window"] = 64.into()), None);
    let err = config_edited("hf-mistral", |c| c["sliding_window"] = 0.into())
        .unwrap_err()
        .to_string();
    assert!(err.contains("a window holds at least one key"), "{err}");
    let err = config_edited("hf-mistral", |c| c["model_type"] = "qwen2".into())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not the model_type of MistralForCausalLM"),
        "{err}"
    );
}

/// Sliding windows against transformers: Mistral's in every block, Qwen2's from block 1 on;
/// 16 keys, crossed by the reference's 48 positions (transformers' logits past position 16
/// move by up to 4.5 without the window).
#[test]
fn sliding_windows_match_transformers() {
    for (name, class, first_layer) in [
        ("hf-mistral-window", LlamaClass::Mistral, 0),
        ("hf-qwen2-window", LlamaClass::Qwen2, 1),
    ] {
        let cfg = matches_reference(name);
        let Family::Llama(s) = cfg.family else {
            panic!("{name} read as GPT-2");
        };
        assert_eq!(s.class, class, "{name}");
        assert_eq!(
            s.sliding_window,
            Some(SlidingWindow::from_layer(16, first_layer)),
            "{name}"
        );
        assert_eq!(
            (0..cfg.layers)
                .map(|l| cfg.window_of(l))
                .collect::<Vec<_>>(),
            (0..cfg.layers)
                .map(|l| (l >= first_layer).then_some(16))
                .collect::<Vec<_>>()
        );
    }
}

/// Decoding with the key/value cache past the window: each step's logits are transformers'
/// at that position (the cache keeps every key; the mask hides the old ones). Both reference
/// rows at once, a 5-token prompt and then one token at a time to position 47. Gemma 3's
/// windowed blocks between its full one, each with its own rotary base, too.
#[test]
fn cached_decoding_past_a_sliding_window_matches_transformers() {
    for name in [
        "hf-mistral-window",
        "hf-qwen2-window",
        "hf-gemma3",
        "hf-olmo3",
    ] {
        let (cfg, model, bytes) = loaded(&fixture(name));
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (tokens, want) = (ids(&st, "tokens"), f32s(&st, "logits"));
        let (seq, v) = (48, cfg.vocab);
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let mut cache = model.kv_cache(2);
        let prompt: Vec<u32> = (0..2)
            .flat_map(|b| tokens[b * seq..b * seq + 5].to_vec())
            .collect();
        let mut logits = model.decode(&mut cache, &prompt).unwrap();
        let mut worst = 0f32;
        for p in 4..seq {
            for b in 0..2 {
                let at = (b * seq + p) * v;
                worst = worst.max(worst_difference(
                    &logits[b * v..(b + 1) * v],
                    &want[at..at + v],
                ));
            }
            if p + 1 < seq {
                let next = [tokens[p + 1], tokens[seq + p + 1]];
                logits = model.decode(&mut cache, &next).unwrap();
            }
        }
        eprintln!("{name}: cached decoding, worst difference {worst:e} (largest logit {scale})");
        assert!(worst <= 1e-4 * scale, "{name}: {worst} (scale {scale})");
    }
}

/// A ragged batch past the window (rows of 30 and 45 tokens, left-padded in the cache): each
/// row's window counts its own tokens, not the padding, so its logits are transformers' for
/// the row alone, at the prompt's end and for the steps after it.
#[test]
fn a_padded_batch_counts_each_rows_window_in_its_own_tokens() {
    for name in ["hf-mistral-window", "hf-gemma3", "hf-olmo3"] {
        padded_decoding_matches_transformers(name);
    }
}

fn padded_decoding_matches_transformers(name: &str) {
    let (cfg, model, bytes) = loaded(&fixture(name));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (tokens, want) = (ids(&st, "tokens"), f32s(&st, "logits"));
    let (seq, v) = (48, cfg.vocab);
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let lens = [30usize, 45];
    let rows: Vec<&[u32]> = (0..2)
        .map(|b| &tokens[b * seq..b * seq + lens[b]])
        .collect();
    let mut cache = model.kv_cache(2);
    let mut logits = model.decode_ragged(&mut cache, &rows).unwrap();
    let mut worst = 0f32;
    for step in 0..3 {
        for b in 0..2 {
            let at = (b * seq + lens[b] - 1 + step) * v;
            worst = worst.max(worst_difference(
                &logits[b * v..(b + 1) * v],
                &want[at..at + v],
            ));
        }
        let next = [tokens[lens[0] + step], tokens[seq + lens[1] + step]];
        logits = model.decode(&mut cache, &next).unwrap();
    }
    eprintln!(
        "{name}: padded decoding past the window: worst difference {worst:e} (largest logit \
         {scale})"
    );
    assert!(worst <= 1e-4 * scale, "{name}: {worst} (scale {scale})");
}

#[test]
fn qwen3_matches_transformers() {
    let (cfg, s) = llama_matches_reference("hf-qwen3");
    assert_eq!(s.class, LlamaClass::Qwen3);
    assert!(s.qk_norm() && !s.qkv_bias() && s.tied_head);
    assert_eq!(
        (s.head_dim, cfg.head_dim(), cfg.attention_width()),
        (Some(12), 12, 48)
    );
    assert_inv_freq("hf-qwen3", &cfg);
    assert_eq!((s.kv_heads, s.rope_theta, s.norm_eps), (2, 1e6, 1e-6));
    // Two head norms per block beside Llama's nine, `[head_dim]` each.
    let infos = counted_param_infos(&cfg);
    let norms: Vec<_> = infos
        .iter()
        .filter(|i| i.name.ends_with("q_norm.weight") || i.name.ends_with("k_norm.weight"))
        .collect();
    assert_eq!(norms.len(), 2 * 2);
    assert!(norms.iter().all(|i| i.shape == [12]));
}

/// Fixture `name`'s gradient of the mean loss for every parameter against PyTorch's autograd
/// on the same model and batch (its reference's `grad.<name>`), within 1e-4 of each tensor's
/// largest gradient.
fn gradients_match_pytorch(name: &str) -> Vec<headroom_tensor::CpuTensor> {
    use headroom_ckpt::Schedule;
    use headroom_tensor::MemoryCategory;
    use headroom_trainer::model::params;
    let (cfg, model, bytes) = loaded(&fixture(name));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (tokens, targets) = (ids(&st, "tokens"), ids(&st, "targets"));
    let g = Geometry::new(2, 48);
    let mut grads =
        params::alloc_like_params(&Cpu::new(), &cfg, MemoryCategory::Gradients).unwrap();
    let all = Schedule::store_all(cfg.layers).unwrap();
    model
        .forward_backward(&tokens, &targets, g, &mut grads, 1.0 / 96.0, &all)
        .unwrap();
    for (info, got) in params::param_infos(&cfg).iter().zip(&grads) {
        let want = f32s(&st, &format!("grad.{}", info.name));
        let got = got.as_slice::<f32>().unwrap();
        assert_eq!(got.len(), want.len(), "{name} {}", info.name);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = worst_difference(got, &want);
        eprintln!(
            "{name} {}: largest {scale:e}, worst difference {worst:e}",
            info.name
        );
        assert!(scale > 0.0, "{name} {}", info.name);
        assert!(
            worst <= 1e-4 * scale,
            "{name} {}: gradients differ by {worst} (largest {scale})",
            info.name
        );
    }
    grads
}

/// Qwen3: the head norms' backward (through the rotation), the 48-wide queries and the tied
/// head.
#[test]
fn qwen3_gradients_match_pytorch() {
    gradients_match_pytorch("hf-qwen3");
}

/// A sliding window in the backward: keys past a query's window get no gradient from it.
#[test]
fn sliding_window_gradients_match_pytorch() {
    gradients_match_pytorch("hf-mistral-window");
}

#[test]
fn qwen3_settings_that_change_the_model_are_refused() {
    let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
        config_edited("hf-qwen3", edit).map_err(|e| e.to_string())
    };
    // Qwen3's window from max_window_layers on, as Qwen2's; layer_types must agree.
    let cfg = edited(&|c| {
        c["use_sliding_window"] = true.into();
        c["sliding_window"] = 8.into();
        c["max_window_layers"] = 1.into();
        c["layer_types"][1] = "sliding_attention".into();
    })
    .unwrap();
    assert_eq!((cfg.window_of(0), cfg.window_of(1)), (None, Some(8)));
    let err = edited(&|c| c["layer_types"][0] = "sliding_attention".into()).unwrap_err();
    assert!(err.contains("only full_attention"), "{err}");
    // Qwen3's attention_bias biases o_proj as well as q, k and v.
    let err = edited(&|c| c["attention_bias"] = true.into()).unwrap_err();
    assert!(err.contains("attention_bias is not supported"), "{err}");
    let err = edited(&|c| c["head_dim"] = 7.into()).unwrap_err();
    assert!(err.contains("even head dimension"), "{err}");
    let err = edited(&|c| c["head_dim"] = 0.into()).unwrap_err();
    assert!(err.contains("head dimension 0"), "{err}");
    let err = edited(&|c| c["head_dim"] = (1u64 << 40).into()).unwrap_err();
    assert!(err.contains("head dimension"), "{err}");
    // Qwen3Config's head_dim is 128 when absent, not hidden_size / heads.
    let cfg = edited(&|c| {
        c.as_object_mut().unwrap().remove("head_dim");
    })
    .unwrap();
    assert_eq!((cfg.head_dim(), cfg.attention_width()), (128, 512));
    // A head_dim equal to hidden_size / heads is the derived one: the shape reads as any
    // Llama's.
    let cfg = edited(&|c| c["head_dim"] = 8.into()).unwrap();
    assert!(matches!(cfg.family, Family::Llama(s) if s.head_dim.is_none() && s.qk_norm()));
    let err = edited(&|c| c["model_type"] = "qwen2".into()).unwrap_err();
    assert!(
        err.contains("not the model_type of Qwen3ForCausalLM"),
        "{err}"
    );
}

/// Mistral Nemo's shape in small: a head width (16) that is not hidden_size / heads (8), read
/// from `head_dim`; Llama's and Mistral's derive it when the key is absent or null.
#[test]
fn a_mistral_with_its_own_head_width_matches_transformers() {
    let (cfg, s) = llama_matches_reference("hf-mistral-head-dim");
    assert_eq!(s.class, LlamaClass::Mistral);
    assert!(!s.qk_norm() && !s.qkv_bias());
    assert_eq!(
        (cfg.head_dim(), cfg.attention_width(), cfg.channels),
        (16, 64, 32)
    );
    assert_inv_freq("hf-mistral-head-dim", &cfg);
    for absent in [None, Some(serde_json::Value::Null)] {
        let cfg = config_edited("hf-mistral-head-dim", |c| match &absent {
            None => {
                c.as_object_mut().unwrap().remove("head_dim");
            }
            Some(v) => c["head_dim"] = v.clone(),
        })
        .unwrap();
        assert_eq!(cfg.head_dim(), 8);
    }
}

/// SmolLM3: every second block of the fixture attends without the rotary embedding (NoPE),
/// read from `no_rope_layer_interval` and `no_rope_layers`; logits and every gradient against
/// transformers and PyTorch.
#[test]
fn smollm3_matches_transformers() {
    let (cfg, s) = llama_matches_reference("hf-smollm3");
    assert_eq!(
        (s.class, s.no_rope_interval),
        (LlamaClass::SmolLM3, Some(2))
    );
    assert_eq!(
        (0..cfg.layers).map(|l| cfg.rotates(l)).collect::<Vec<_>>(),
        [true, false, true]
    );
    assert_inv_freq("hf-smollm3", &cfg);
    gradients_match_pytorch("hf-smollm3");
    let written = saved_and_read_back("hf-smollm3", 48);
    assert_eq!(
        written["architectures"][0], "SmolLM3ForCausalLM",
        "{written}"
    );
    assert_eq!(written["no_rope_layer_interval"], 2, "{written}");
    assert_eq!(
        written["no_rope_layers"],
        serde_json::json!([1, 0, 1]),
        "{written}"
    );
}

#[test]
fn smollm3_settings_that_change_the_model_are_refused() {
    let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
        config_edited("hf-smollm3", edit).map_err(|e| e.to_string())
    };
    let err = edited(&|c| c["no_rope_layers"] = serde_json::json!([1, 1, 0])).unwrap_err();
    assert!(err.contains("only a NoPE block every"), "{err}");
    let err = edited(&|c| c["no_rope_layer_interval"] = 0.into()).unwrap_err();
    assert!(err.contains("no_rope_layer_interval 0"), "{err}");
    // Without the list, the interval alone: SmolLM3Config's 4 when absent too.
    let cfg = edited(&|c| {
        let o = c.as_object_mut().unwrap();
        o.remove("no_rope_layers");
        o.remove("no_rope_layer_interval");
    })
    .unwrap();
    assert_eq!((cfg.rotates(1), cfg.rotates(3)), (true, false));
    // Its window falls on the NoPE blocks alone.
    let err = edited(&|c| {
        c["use_sliding_window"] = true.into();
        c["sliding_window"] = 16.into();
    })
    .unwrap_err();
    assert!(err.contains("windows on its NoPE blocks"), "{err}");
    for flag in ["attention_bias", "mlp_bias"] {
        let err = edited(&|c| c[flag] = true.into()).unwrap_err();
        assert!(err.contains("is not supported"), "{err}");
    }
}

/// Gemma 3 (the class of Gemma 3 270M and 1B): query/key norms, norms on the attention's and
/// the MLP's outputs, a GELU gate, the embedding scaled by √C, gains stored as offsets from 1,
/// and a window over blocks 0 and 2 (block 1 attends to everything) whose rotary base is their
/// own. Logits and every gradient against transformers and PyTorch; the saved checkpoint is a
/// `Gemma3ForCausalLM` that reads back as the same model.
#[test]
fn gemma3_matches_transformers() {
    let (cfg, s) = llama_matches_reference("hf-gemma3");
    assert_eq!(s.class, LlamaClass::Gemma3);
    assert!(s.qk_norm() && s.output_norms() && s.tied_head && !s.qkv_bias());
    assert_eq!(
        (
            cfg.head_dim(),
            cfg.attention_width(),
            s.rope_theta,
            s.norm_eps
        ),
        (12, 48, 1e6, 1e-6)
    );
    assert_eq!(
        (0..cfg.layers)
            .map(|l| cfg.window_of(l))
            .collect::<Vec<_>>(),
        [Some(16), None, Some(16)]
    );
    assert_inv_freq("hf-gemma3", &cfg);
    // The windowed blocks' frequencies are transformers' sliding_attention buffer.
    let bytes = std::fs::read(fixture("hf-gemma3").join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let local = cfg.rope_of(0).unwrap().inv_freq(cfg.head_dim());
    let theirs = f32s(&st, "sliding_inv_freq");
    assert_eq!(
        local.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
        theirs.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(cfg.rope_of(1), Some(s.rope()));
    // Four [C] norms and two [hs] head norms per block.
    let infos = counted_param_infos(&cfg);
    assert_eq!(
        infos
            .iter()
            .filter(|i| i.name.contains("layers.0.") && i.name.ends_with("norm.weight"))
            .count(),
        6
    );
    gradients_match_pytorch("hf-gemma3");
    let written = saved_and_read_back("hf-gemma3", 48);
    assert_eq!(
        written["architectures"][0], "Gemma3ForCausalLM",
        "{written}"
    );
    assert_eq!(written["model_type"], "gemma3_text", "{written}");
    assert_eq!(
        written["layer_types"],
        serde_json::json!(["sliding_attention", "full_attention", "sliding_attention"]),
        "{written}"
    );
    assert_eq!(
        (
            &written["sliding_window"],
            &written["rope_local_base_freq"],
            &written["query_pre_attn_scalar"],
            &written["hidden_activation"]
        ),
        (
            &serde_json::json!(16),
            &serde_json::json!(10000.0),
            &serde_json::json!(12),
            &serde_json::json!("gelu_pytorch_tanh")
        ),
        "{written}"
    );
}

/// Gemma 3's configs as the Hub writes them (transformers 4: `rope_theta`,
/// `rope_local_base_freq`, `sliding_window_pattern`) read as transformers 5 reads them, and
/// the settings that change the computation in ways not implemented here are refused.
#[test]
fn gemma3_configs_read_as_transformers_reads_them() {
    let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
        config_edited("hf-gemma3", edit).map_err(|e| e.to_string())
    };
    let reference = edited(&|_| {}).unwrap();
    // The Hub's gemma-3-1b-it keys, in place of rope_parameters and layer_types.
    let hub = edited(&|c| {
        let o = c.as_object_mut().unwrap();
        o.remove("rope_parameters");
        o.remove("layer_types");
        o.insert("rope_theta".into(), 1_000_000.0.into());
        o.insert("rope_local_base_freq".into(), 10_000.0.into());
        o.insert("sliding_window_pattern".into(), 2.into());
        o.insert("rope_scaling".into(), serde_json::Value::Null);
    })
    .unwrap();
    assert_eq!(hub, reference);
    // Without a pattern, Gemma3TextConfig's: every sixth block full. Without a head width,
    // its 256 (whose query_pre_attn_scalar default matches: no scale of its own).
    let defaults = edited(&|c| {
        let o = c.as_object_mut().unwrap();
        for key in [
            "layer_types",
            "_sliding_window_pattern",
            "head_dim",
            "query_pre_attn_scalar",
        ] {
            o.remove(key);
        }
        o.insert("num_hidden_layers".into(), 12.into());
    })
    .unwrap();
    let full: Vec<usize> = (0..12)
        .filter(|&l| defaults.window_of(l).is_none())
        .collect();
    assert_eq!((full, defaults.head_dim()), (vec![5, 11], 256));
    assert!(matches!(defaults.family, Family::Llama(s) if s.softmax_scale().is_none()));
    // The full blocks' rescaling (Gemma 3 4B's linear 8), the windowed blocks' none.
    let scaled = edited(&|c| {
        c["rope_parameters"]["full_attention"] =
            serde_json::json!({"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6});
    })
    .unwrap();
    assert_eq!(
        scaled.rope_of(1).unwrap().scaling,
        RopeScaling::Linear { factor: 8.0 }
    );
    assert_eq!(scaled.rope_of(0).unwrap().scaling, RopeScaling::None);
    type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
    let refusals: [(Edit<'_>, &str); 8] = [
        (
            &|c| c["layer_types"][0] = "full_attention".into(),
            "only full_attention every k-th block",
        ),
        (
            &|c| c["query_pre_attn_scalar"] = (-4).into(),
            "query_pre_attn_scalar -4 must be finite and positive",
        ),
        (
            &|c| c["attn_logit_softcapping"] = 50.0.into(),
            "attn_logit_softcapping is not supported",
        ),
        (
            &|c| c["final_logit_softcapping"] = 30.0.into(),
            "final_logit_softcapping is not supported",
        ),
        (
            &|c| c["use_bidirectional_attention"] = true.into(),
            "use_bidirectional_attention is not supported",
        ),
        (
            &|c| c["hidden_activation"] = "gelu".into(),
            "only gelu_pytorch_tanh",
        ),
        (
            &|c| {
                c["rope_parameters"]["sliding_attention"] =
                    serde_json::json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
            },
            "windowed blocks' rotary embedding is not rescaled",
        ),
        (
            &|c| c["sliding_window"] = serde_json::Value::Null,
            "sliding_window null",
        ),
    ];
    for (edit, want) in refusals {
        let err = edited(edit).unwrap_err();
        assert!(err.contains(want), "{err} (wanted {want:?})");
    }
}

/// QLoRA on Gemma 3: the merged model is a `Gemma3ForCausalLM` whose six norms per block (the
/// head norms, the input norms and the output norms) are the base's, bit for bit.
#[test]
fn qlora_on_gemma3_trains_and_merges_into_a_gemma3() {
    let (names, masters, merged, written) = qlora_trained_and_merged("hf-gemma3");
    assert_eq!(written["architectures"][0], "Gemma3ForCausalLM");
    assert_eq!(
        kept_from_the_base(&names, &masters, &merged, "norm.weight"),
        6 * 3 + 1
    );
}

/// Gemma 3 4B, 12B and 27B are `Gemma3ForConditionalGeneration`: the text model is read out of
/// it (tensors under `language_model.model.`, as transformers and the Hub store them, the
/// vision tower's dropped), its logits on text are the multimodal model's, and what a run
/// saves is that text model, a `Gemma3ForCausalLM` that reads back as the same model.
#[test]
fn a_multimodal_gemma3s_text_model_matches_transformers() {
    let (cfg, s) = llama_matches_reference("hf-gemma3-multimodal");
    assert_eq!(s.class, LlamaClass::Gemma3);
    let (text_only, _) = llama_matches_reference("hf-gemma3");
    assert_eq!(
        cfg, text_only,
        "the same text settings as the text-only fixture"
    );
    let written = saved_and_read_back("hf-gemma3-multimodal", 48);
    assert_eq!(
        written["architectures"][0], "Gemma3ForCausalLM",
        "{written}"
    );
    assert_eq!(written["model_type"], "gemma3_text", "{written}");
}

/// transformers 5's module names (`model.language_model.`, `model.vision_tower.`) read as the
/// stored ones do; a text tensor under another name is still missing, and refused.
#[test]
fn a_multimodal_gemma3_reads_under_either_naming() {
    let src = fixture("hf-gemma3-multimodal");
    let renamed = |rename: &dyn Fn(&str) -> String| {
        let dir = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(&src).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
        let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let header: serde_json::Map<String, serde_json::Value> = header
            .into_iter()
            .map(|(k, v)| {
                if k == "__metadata__" {
                    (k, v)
                } else {
                    (rename(&k), v)
                }
            })
            .collect();
        let mut text = serde_json::to_vec(&header).unwrap();
        text.resize(text.len().next_multiple_of(8), b' ');
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend(text);
        out.extend(&bytes[8 + n..]);
        std::fs::write(dir.path().join("model.safetensors"), out).unwrap();
        let got = hf::load(dir.path(), &Cpu::new()).map(|(c, m)| (c, m.len()));
        (dir, got)
    };
    let (_, want) = renamed(&|k| k.to_owned());
    let want = want.unwrap();
    let (_, five) = renamed(&|k| {
        if let Some(rest) = k.strip_prefix("language_model.model.") {
            format!("model.language_model.{rest}")
        } else {
            format!("model.{k}")
        }
    });
    assert_eq!(five.unwrap(), want);
    let (_, extra) = renamed(&|k| k.replace("mlp.down_proj", "mlp.down_projection"));
    let err = extra.unwrap_err().to_string();
    assert!(err.contains("missing tensor"), "{err}");
}

/// The Hub's multimodal configs name only what differs from Gemma3TextConfig's defaults (4B's
/// `text_config` holds six keys): filled in as transformers fills them, the text model's
/// parameters are what transformers counts for it (`num_parameters()` of a
/// `Gemma3ForCausalLM` on those settings, transformers 5.24). 27B's attention scale is not
/// `1/√head_dim`: it is kept.
#[test]
fn the_hubs_multimodal_gemma3_configs_read_with_transformers_defaults() {
    let hub = |text: serde_json::Value| {
        config_edited("hf-gemma3-multimodal", |c| {
            c["text_config"] = text.clone();
        })
    };
    let four = hub(serde_json::json!({
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024
    }))
    .unwrap();
    assert_eq!(four.parameter_count().unwrap(), 3_880_263_168);
    assert_eq!(
        (four.vocab, four.heads, four.kv_heads(), four.head_dim()),
        (262_208, 8, 4, 256)
    );
    assert_eq!(
        four.rope_of(5).unwrap().scaling,
        RopeScaling::Linear { factor: 8.0 }
    );
    assert_eq!(four.window_of(4), Some(1024));
    let twelve = hub(serde_json::json!({
        "hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
        "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024
    }))
    .unwrap();
    assert_eq!(twelve.parameter_count().unwrap(), 11_766_034_176);
    let twenty_seven = hub(serde_json::json!({
        "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
        "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62,
        "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024
    }))
    .unwrap();
    let Family::Llama(s) = twenty_seven.family else {
        panic!("27B read as GPT-2");
    };
    assert_eq!(
        (s.query_pre_attn_scalar, s.softmax_scale()),
        (Some(168.0), Some((168f64.powf(-0.5)) as f32))
    );
    let err = hub(serde_json::json!({"model_type": "siglip_vision_model"}))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not gemma3_text"), "{err}");
}

/// Gemma 3 27B's attention scale in small: `query_pre_attn_scalar` 20 on heads of 12, so
/// attention scales `q·kᵀ` by 20^−½. Logits against transformers; the saved config keeps it.
#[test]
fn a_gemma3_attention_scale_of_its_own_matches_transformers() {
    let (_, s) = llama_matches_reference("hf-gemma3-scaled");
    assert_eq!(s.query_pre_attn_scalar, Some(20.0));
    let written = saved_and_read_back("hf-gemma3-scaled", 48);
    // An int, as Gemma3TextConfig types it.
    assert_eq!(written["query_pre_attn_scalar"], 20, "{written}");
    // Scaled as the head width would scale it, the logits are another model's.
    let cpu = Cpu::new();
    let (cfg, masters) = hf::load(&fixture("hf-gemma3-scaled"), &cpu).unwrap();
    let mut unscaled = cfg;
    if let Family::Llama(s) = &mut unscaled.family {
        s.query_pre_attn_scalar = None;
    }
    let bytes = std::fs::read(fixture("hf-gemma3-scaled").join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let model = Model::from_masters(&cpu, unscaled, ModelOptions::default(), masters).unwrap();
    let got = model
        .logits(&ids(&st, "tokens"), Geometry::new(2, 48))
        .unwrap();
    assert!(worst_difference(&got, &f32s(&st, "logits")) > 1e-2);
}

/// OLMo 2 (`Olmo2ForCausalLM`): no norm on either sublayer's input, a norm on each one's output
/// before the residual addition, and the query and key norms over the whole 48- and 24-wide
/// projections, before the split into heads of 12. Logits, loss and every gradient against
/// transformers'; a run's checkpoint is an `Olmo2ForCausalLM` that reads back unchanged.
#[test]
fn olmo2_matches_transformers() {
    use headroom_trainer::model::QkNorm;
    let (cfg, s) = llama_matches_reference("hf-olmo2");
    assert_eq!(s.class, LlamaClass::Olmo2);
    assert!(!s.input_norms() && s.output_norms() && !s.tied_head && !s.qkv_bias());
    assert_eq!(s.qk_norm_kind(), Some(QkNorm::Projection));
    assert_eq!(
        (
            cfg.head_dim(),
            cfg.attention_width(),
            s.rope_theta,
            s.norm_eps
        ),
        (12, 48, 5e5, 1e-6)
    );
    assert!((0..cfg.layers).all(|l| cfg.window_of(l).is_none()));
    assert_inv_freq("hf-olmo2", &cfg);
    let infos = counted_param_infos(&cfg);
    let norms: Vec<(String, Vec<usize>)> = infos
        .iter()
        .filter(|i| i.name.contains("layers.0.") && i.name.ends_with("norm.weight"))
        .map(|i| (i.name.clone(), i.shape.clone()))
        .collect();
    assert_eq!(
        norms,
        [
            ("post_attention_layernorm", 32),
            ("post_feedforward_layernorm", 32),
            ("self_attn.q_norm", 48),
            ("self_attn.k_norm", 24),
        ]
        .map(|(n, w)| (format!("model.layers.0.{n}.weight"), vec![w]))
    );
    // Olmo2Config's padding index (the key is absent): the reference's inputs hold it in
    // every fifth position, and its embedding row gets no gradient, in PyTorch and here.
    assert_eq!(s.padding_idx, Some(1));
    let grads = gradients_match_pytorch("hf-olmo2");
    let wte = grads[0].as_slice::<f32>().unwrap();
    let c = cfg.channels;
    let bytes = std::fs::read(fixture("hf-olmo2").join("reference.safetensors")).unwrap();
    let tokens = ids(&SafeTensors::deserialize(&bytes).unwrap(), "tokens");
    let row = |t: u32| &wte[t as usize * c..(t as usize + 1) * c];
    assert_eq!((tokens[0], tokens[5]), (1, 1));
    assert!(row(1).iter().all(|&g| g == 0.0));
    assert!(tokens[1] != 1 && row(tokens[1]).iter().any(|&g| g != 0.0));
    let written = saved_and_read_back("hf-olmo2", 48);
    assert_eq!(written["pad_token_id"], 1, "{written}");
    assert_eq!(
        (&written["architectures"][0], &written["model_type"]),
        (
            &serde_json::json!("Olmo2ForCausalLM"),
            &serde_json::json!("olmo2")
        ),
        "{written}"
    );
    assert_eq!(written["attention_bias"], false, "{written}");
    assert!(written.get("sliding_window").is_none(), "{written}");
}

/// OLMo 3 (`Olmo3ForCausalLM`): OLMo 2's block with windowed blocks around a full one; the
/// full block rotates with YaRN, the windowed ones with their own unscaled base (the
/// fixture's `sliding_inv_freq`, bit for bit). Logits, gradients, and a checkpoint whose
/// `layer_types` and per-type `rope_parameters` read back as the same model.
#[test]
fn olmo3_matches_transformers() {
    let (cfg, s) = llama_matches_reference("hf-olmo3");
    assert_eq!(s.class, LlamaClass::Olmo3);
    assert!(!s.input_norms() && s.output_norms() && s.qk_norm());
    assert_eq!(
        (0..cfg.layers)
            .map(|l| cfg.window_of(l))
            .collect::<Vec<_>>(),
        [Some(16), None, Some(16)]
    );
    assert!(matches!(s.rope_scaling, RopeScaling::Yarn { factor, .. } if factor == 4.0));
    assert_eq!(s.rope_theta, 5e5);
    assert_inv_freq("hf-olmo3", &cfg);
    let bytes = std::fs::read(fixture("hf-olmo3").join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let local = cfg.rope_of(0).unwrap();
    assert_eq!((local.theta, local.scaling), (1e4, RopeScaling::None));
    let theirs = f32s(&st, "sliding_inv_freq");
    assert_eq!(
        local
            .inv_freq(cfg.head_dim())
            .iter()
            .map(|f| f.to_bits())
            .collect::<Vec<_>>(),
        theirs.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(cfg.rope_of(1), Some(s.rope()));
    gradients_match_pytorch("hf-olmo3");
    let written = saved_and_read_back("hf-olmo3", 48);
    assert_eq!(written["architectures"][0], "Olmo3ForCausalLM", "{written}");
    assert_eq!(
        written["layer_types"],
        serde_json::json!(["sliding_attention", "full_attention", "sliding_attention"]),
        "{written}"
    );
    assert_eq!(
        written["rope_parameters"]["sliding_attention"],
        serde_json::json!({"rope_type": "default", "rope_theta": 10000.0}),
        "{written}"
    );
    assert_eq!(
        (
            &written["rope_parameters"]["full_attention"]["rope_type"],
            &written["sliding_window"]
        ),
        (&serde_json::json!("yarn"), &serde_json::json!(16)),
        "{written}"
    );
}

/// OLMo's configs as transformers 5.24 reads them: Olmo2Config's and Olmo3Config's defaults
/// (ε 1e-5, bases 10⁴ and 5·10⁵, OLMo 3's window of 4096 in three blocks of four), the Hub's
/// transformers 4 keys (`rope_theta`, `rope_scaling` — whose base transformers 5.24 gives the
/// full blocks only), and refusals of what would compute something else.
#[test]
fn olmo_configs_read_as_transformers_reads_them() {
    let edited = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        config_edited(name, edit).map_err(|e| e.to_string())
    };
    let defaults = edited("hf-olmo2", &|c| {
        let o = c.as_object_mut().unwrap();
        for key in ["rms_norm_eps", "rope_parameters", "head_dim"] {
            o.remove(key);
        }
    })
    .unwrap();
    let Family::Llama(s) = defaults.family else {
        panic!("read as GPT-2");
    };
    assert_eq!(
        (s.norm_eps, s.rope_theta, defaults.head_dim()),
        (1e-5, 1e4, 8)
    );
    let olmo3 = edited("hf-olmo3", &|c| {
        let o = c.as_object_mut().unwrap();
        for key in ["layer_types", "sliding_window", "rope_parameters"] {
            o.remove(key);
        }
        o.insert("num_hidden_layers".into(), 8.into());
        o.insert("max_position_embeddings".into(), 65536.into());
        o.insert("rope_theta".into(), 1e6.into());
        o.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "yarn", "factor": 8.0,
                "original_max_position_embeddings": 8192}),
        );
    })
    .unwrap();
    let full: Vec<usize> = (0..8).filter(|&l| olmo3.window_of(l).is_none()).collect();
    assert_eq!((full, olmo3.window_of(0)), (vec![3, 7], Some(4096)));
    let (local, global) = (olmo3.rope_of(0).unwrap(), olmo3.rope_of(3).unwrap());
    assert_eq!((local.theta, local.scaling), (5e5, RopeScaling::None));
    assert!(
        global.theta == 1e6
            && matches!(global.scaling, RopeScaling::Yarn { factor, .. } if factor == 8.0)
    );
    type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
    let refusals: [(&str, Edit<'_>, &str); 5] = [
        (
            "hf-olmo2",
            &|c| c["attention_bias"] = true.into(),
            "attention_bias is not supported",
        ),
        (
            "hf-olmo2",
            &|c| c["hidden_act"] = "gelu".into(),
            "only silu",
        ),
        (
            "hf-olmo3",
            &|c| c["layer_types"][0] = "full_attention".into(),
            "only full_attention every k-th block",
        ),
        (
            "hf-olmo3",
            &|c| {
                c["rope_parameters"]["sliding_attention"] =
                    serde_json::json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
            },
            "windowed blocks' rotary embedding is not rescaled",
        ),
        (
            "hf-olmo3",
            &|c| c["model_type"] = "olmo2".into(),
            "is not the model_type of Olmo3ForCausalLM",
        ),
    ];
    for (name, edit, want) in refusals {
        let err = edited(name, edit).unwrap_err();
        assert!(err.contains(want), "{err} (wanted {want:?})");
    }
}

/// OLMo 2 1B, 7B, 13B and 32B and OLMo 3 7B and 32B, as their configs shape them, count the
/// parameters transformers 5.24 counts (`sum(p.numel())` of `Olmo2ForCausalLM` /
/// `Olmo3ForCausalLM` built on those settings).
#[test]
fn the_olmo_models_count_as_transformers_counts_them() {
    let olmo2 = |c, vocab| parameters_of_shape("hf-olmo2", c, vocab, 4096);
    assert_eq!(olmo2([2048, 8192, 16, 16, 16], 100_352), 1_484_916_736);
    assert_eq!(olmo2([4096, 11008, 32, 32, 32], 100_352), 7_298_617_344);
    assert_eq!(olmo2([5120, 13824, 40, 40, 40], 100_352), 13_716_198_400);
    assert_eq!(olmo2([5120, 27648, 64, 40, 8], 100_352), 32_234_279_936);
    let olmo3 = |c, vocab| parameters_of_shape("hf-olmo3", c, vocab, 65536);
    assert_eq!(olmo3([4096, 11008, 32, 32, 32], 100_278), 7_298_011_136);
    assert_eq!(olmo3([5120, 27648, 64, 40, 8], 100_278), 32_233_522_176);
}

/// The parameters of fixture `name`'s class at a shape of its own: `[hidden_size,
/// intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads]`, the
/// vocabulary and the context (the fixture's head width and layer types dropped: derived,
/// OLMo 3's window left at the fixture's, which changes no count).
fn parameters_of_shape(name: &str, c: [usize; 5], vocab: usize, context: usize) -> u64 {
    config_edited(name, |cfg| {
        let o = cfg.as_object_mut().unwrap();
        for key in ["head_dim", "layer_types"] {
            o.remove(key);
        }
        for (key, v) in [
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        ]
        .into_iter()
        .zip(c)
        {
            o.insert(key.into(), v.into());
        }
        o.insert("vocab_size".into(), vocab.into());
        o.insert("max_position_embeddings".into(), context.into());
    })
    .unwrap()
    .parameter_count()
    .unwrap()
}

/// QLoRA on OLMo 2: the merged model is an `Olmo2ForCausalLM` whose four norms per block (the
/// output norms and the projection-wide query and key norms) are the base's, bit for bit.
#[test]
fn qlora_on_olmo2_trains_and_merges_into_an_olmo2() {
    let (names, masters, merged, written) = qlora_trained_and_merged("hf-olmo2");
    assert_eq!(written["architectures"][0], "Olmo2ForCausalLM");
    assert_eq!(
        kept_from_the_base(&names, &masters, &merged, "norm.weight"),
        4 * 2 + 1
    );
}

/// Granite (`GraniteForCausalLM`): Llama with its four scalars — the embedding ×12, each
/// sublayer's output ×0.22 before the residual addition, `q·kᵀ` ×0.2 in place of `1/√8`, the
/// logits ÷6. Logits, loss and every gradient against transformers'; a run's checkpoint is a
/// `GraniteForCausalLM` with the same scalars that reads back unchanged.
#[test]
fn granite_matches_transformers() {
    let (cfg, s) = llama_matches_reference("hf-granite");
    assert_eq!(s.class, LlamaClass::Granite);
    let want = super::common::granite_multipliers();
    assert_eq!(s.multipliers, Some(want));
    assert_eq!(
        (
            s.embedding_scale(cfg.channels),
            s.softmax_scale(),
            s.residual_scale(),
            s.logits_divisor()
        ),
        (Some(12.0), Some(0.2), Some(0.22), Some(6.0))
    );
    assert!(s.tied_head && s.input_norms() && !s.output_norms() && !s.qk_norm());
    counted_param_infos(&cfg);
    // Granite's padding index is its end of text: with the head tied, that row's gradient is
    // the head's alone (the fixture's inputs hold it in every fifth position).
    assert_eq!(s.padding_idx, Some(0));
    gradients_match_pytorch("hf-granite");
    let written = saved_and_read_back("hf-granite", 48);
    assert_eq!(
        written["architectures"][0], "GraniteForCausalLM",
        "{written}"
    );
    assert_eq!(written["model_type"], "granite", "{written}");
    for key in [
        "embedding_multiplier",
        "residual_multiplier",
        "attention_multiplier",
        "logits_scaling",
    ] {
        assert!(written[key].is_number(), "{key}: {written}");
    }
    assert!(written.get("sliding_window").is_none(), "{written}");
}

/// Granite's configs as transformers reads them: each scalar 1 when absent — attention then
/// scales by 1, not `1/√head_dim` (GraniteAttention's `scaling` is the multiplier itself) —
/// and a scalar that is not a positive number, or a bias, refused; Granite 3.3 2B's and 8B's
/// shapes count the parameters transformers 5.24 counts (`sum(p.numel())` of a
/// `GraniteForCausalLM` built on them).
#[test]
fn granite_configs_read_as_transformers_reads_them() {
    let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
        config_edited("hf-granite", edit).map_err(|e| e.to_string())
    };
    let defaults = edited(&|c| {
        let o = c.as_object_mut().unwrap();
        for key in [
            "embedding_multiplier",
            "residual_multiplier",
            "attention_multiplier",
            "logits_scaling",
        ] {
            o.remove(key);
        }
    })
    .unwrap();
    let Family::Llama(s) = defaults.family else {
        panic!("read as GPT-2");
    };
    assert_eq!(
        (
            s.embedding_scale(defaults.channels),
            s.softmax_scale(),
            s.residual_scale(),
            s.logits_divisor()
        ),
        (None, Some(1.0), None, None)
    );
    type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
    let refusals: [(Edit<'_>, &str); 4] = [
        (
            &|c| c["logits_scaling"] = 0.into(),
            "logits_scaling 0 must be finite and positive",
        ),
        (
            &|c| c["residual_multiplier"] = "x".into(),
            "residual_multiplier",
        ),
        (
            &|c| c["mlp_bias"] = true.into(),
            "mlp_bias is not supported",
        ),
        (
            &|c| c["attention_bias"] = true.into(),
            "attention_bias is not supported",
        ),
    ];
    for (edit, want) in refusals {
        let err = edited(edit).unwrap_err();
        assert!(err.contains(want), "{err} (wanted {want:?})");
    }
    // pad_token_id as transformers reads it into nn.Embedding's padding_idx: null is none,
    // absent is the class's default (GraniteConfig's none, Olmo2Config's 1, Gemma3's 0,
    // SmolLM3's 128004 — past a small vocabulary, which nn.Embedding refuses).
    let padding = |name: &str, value: Option<serde_json::Value>| {
        config_edited(name, |c| {
            let o = c.as_object_mut().unwrap();
            match &value {
                Some(v) => o.insert("pad_token_id".into(), v.clone()),
                None => o.remove("pad_token_id"),
            };
        })
        .map(|cfg| match cfg.family {
            Family::Llama(s) => s.padding_idx,
            Family::Gpt2 => panic!("{name} read as GPT-2"),
        })
        .map_err(|e| e.to_string())
    };
    assert_eq!(padding("hf-granite", None), Ok(None));
    assert_eq!(
        padding("hf-granite", Some(serde_json::Value::Null)),
        Ok(None)
    );
    assert_eq!(padding("hf-granite", Some(5.into())), Ok(Some(5)));
    assert_eq!(padding("hf-olmo2", None), Ok(Some(1)));
    assert_eq!(padding("hf-gemma3", None), Ok(Some(0)));
    for (name, value) in [("hf-smollm3", None), ("hf-granite", Some(97.into()))] {
        let err = padding(name, value).unwrap_err();
        assert!(
            err.contains("is not a row of the 97-token embedding"),
            "{err}"
        );
    }
    let shaped = |c| parameters_of_shape("hf-granite", c, 49_159, 131_072);
    assert_eq!(shaped([2048, 8192, 40, 32, 8]), 2_533_539_840);
    assert_eq!(shaped([4096, 12800, 40, 32, 8]), 8_170_864_640);
}
