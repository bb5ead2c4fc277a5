//! The forward of both families against transformers' own on the same weights: committed
//! fixtures written by `benches/torch/make_llama_fixture.py` — `LlamaForCausalLM` with
//! grouped-query attention and an untied head (in f32 and in bf16), with multi-head attention
//! and a tied head, and a `GPT2LMHeadModel` saved in four shards — loaded from their
//! `save_pretrained` directories. Logits within 1e-4 relative (of the largest logit) and the
//! mean cross-entropy within 1e-5, in f32.

use std::path::PathBuf;

use headroom_tensor::Cpu;
use headroom_trainer::hf;
use headroom_trainer::model::{Family, Geometry, Model, ModelOptions};
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

/// Load fixture `name`, compare logits and loss with transformers', return its shape.
fn matches_reference(name: &str) -> headroom_trainer::model::ModelConfig {
    let dir = fixture(name);
    let cpu = Cpu::new();
    let (cfg, masters) = hf::load(&dir, &cpu).unwrap();
    let model = Model::from_masters(&cpu, cfg, ModelOptions::default(), masters).unwrap();
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (tokens, targets) = (ids(&st, "tokens"), ids(&st, "targets"));
    let g = Geometry::new(2, 16);
    let want = f32s(&st, "logits");
    let got = model.logits(&tokens, g).unwrap();
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
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

/// What headroom saves is what it loads: a run initialised from the fixture with an update
/// below f32 resolution writes a checkpoint whose weights and shape read back unchanged.
/// (`benches/torch/check_hf_export.py` shows transformers loading such a checkpoint with the
/// reference's logits, 0 difference.)
#[test]
fn a_saved_llama_checkpoint_reads_back_unchanged() {
    use headroom_trainer::train::{train, TrainOptions};
    for name in ["hf-llama-gqa-untied", "hf-llama-mha-tied"] {
        let dir = fixture(name);
        let cpu = Cpu::new();
        let (cfg, masters) = hf::load(&dir, &cpu).unwrap();
        let root = tempfile::tempdir().unwrap();
        let mut o = TrainOptions {
            model: cfg,
            init_from: Some(dir.clone()),
            steps: 1,
            lr: 1e-30,
            seq: 16,
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
    }
}
