//! PEFT LoRA adapters on the trainer's models, against what PEFT computed: the adapters PEFT
//! saved for transformers' tiny Llama (`benches/torch/make_lora_fixture.py`), merged into the
//! base as `merge_and_unload()` does, give PEFT's merged logits and its unmerged (base +
//! adapter) logits; `headroom merge` writes a Hugging Face directory with those weights;
//! adapters that do not fit the model are typed errors that change nothing.

use crate::common;

use std::path::PathBuf;

use headroom_tensor::Cpu;
use headroom_trainer::model::{Geometry, Model, ModelOptions};
use headroom_trainer::{adapters, hf, sample, TrainError};
use safetensors::SafeTensors;

fn trainer_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn lora_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../lora/tests/fixtures")
        .join(name)
}

fn tensor(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The largest |a − b| relative to the largest |b|.
fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

#[test]
fn merged_adapters_give_pefts_logits() {
    for name in ["peft-llama-tiny", "peft-llama-tiny-rslora"] {
        let cpu = Cpu::new();
        let dir = lora_fixture(name);
        let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let tokens: Vec<u32> = st
            .tensor("tokens")
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
            .collect();
        let model =
            sample::load_model_with(&trainer_fixture("hf-llama-gqa-untied"), Some(&dir), &cpu)
                .unwrap();
        let logits = model.logits(&tokens, Geometry::new(2, 16)).unwrap();
        let merged = rel(&logits, &tensor(&st, "merged_logits"));
        let unmerged = rel(&logits, &tensor(&st, "logits"));
        assert!(
            merged <= 1e-5,
            "{name}: {merged} against PEFT's merged logits"
        );
        assert!(
            unmerged <= 1e-4,
            "{name}: {unmerged} against PEFT's base + adapter logits"
        );
        // The adapter is not invisible: the base alone is far from both.
        let base = sample::load_model(&trainer_fixture("hf-llama-gqa-untied"), &cpu).unwrap();
        let plain = base.logits(&tokens, Geometry::new(2, 16)).unwrap();
        assert!(rel(&plain, &tensor(&st, "merged_logits")) > 1e-3, "{name}");
    }
}

#[test]
fn an_adapter_for_another_model_is_refused_and_changes_nothing() {
    let cpu = Cpu::new();
    let adapter = adapters::load(&cpu, &lora_fixture("peft-llama-tiny")).unwrap();
    // The MHA fixture's v_proj is [32, 32]; the adapter was made for GQA's [16, 32].
    for other in ["hf-llama-mha-tied", "hf-gpt2-sharded"] {
        let (cfg, mut masters) = hf::load(&trainer_fixture(other), &cpu).unwrap();
        let before: Vec<Vec<f32>> = masters
            .iter()
            .map(|m| m.as_slice::<f32>().unwrap().to_vec())
            .collect();
        let e = adapters::merge(
            &cfg,
            &mut masters,
            &adapter,
            &lora_fixture("peft-llama-tiny"),
        );
        assert!(
            matches!(e, Err(TrainError::Adapter { .. })),
            "{other}: {e:?}"
        );
        for (m, b) in masters.iter().zip(&before) {
            assert_eq!(m.as_slice::<f32>().unwrap(), &b[..], "{other}");
        }
    }
    assert!(matches!(
        adapters::load(&cpu, &trainer_fixture("hf-llama-gqa-untied")),
        Err(TrainError::Adapter { .. })
    ));
}

#[test]
fn headroom_merge_writes_a_model_that_loads_with_the_merged_weights() {
    let out = tempfile::tempdir().unwrap();
    let merged = out.path().join("merged");
    let run = |extra: &[&str]| {
        common::headroom_command()
            .args([
                "merge",
                "--base",
                trainer_fixture("hf-llama-gqa-untied").to_str().unwrap(),
                "--adapter",
                lora_fixture("peft-llama-tiny").to_str().unwrap(),
                "--out",
                merged.to_str().unwrap(),
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let o = run(&[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("6 adapted modules"));
    // The base's generation config goes with it, as save_pretrained writes it.
    let generation = "generation_config.json";
    assert_eq!(
        std::fs::read(merged.join(generation)).unwrap(),
        std::fs::read(trainer_fixture("hf-llama-gqa-untied").join(generation)).unwrap()
    );
    // An existing directory is never overwritten.
    let again = run(&[]);
    assert!(!again.status.success());
    let cpu = Cpu::new();
    let from_file = sample::load_model(&merged, &cpu).unwrap();
    let in_memory = sample::load_model_with(
        &trainer_fixture("hf-llama-gqa-untied"),
        Some(&lora_fixture("peft-llama-tiny")),
        &cpu,
    )
    .unwrap();
    for (a, b) in from_file.masters().iter().zip(in_memory.masters()) {
        assert_eq!(a.as_slice::<f32>().unwrap(), b.as_slice::<f32>().unwrap());
    }
    let _ = Model::from_masters(
        &cpu,
        from_file.cfg,
        ModelOptions::default(),
        hf::load(&merged, &cpu).unwrap().1,
    )
    .unwrap();
}
