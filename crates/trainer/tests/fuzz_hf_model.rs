//! Fuzz tests for the Hugging Face model reader (`hf::load`: `config.json`, the safetensors
//! headers and data, a sharded model's `model.safetensors.index.json`, bf16 weights widened to
//! f32) with headroom-fuzzkit: a model directory from the internet is the most common hostile
//! input a user hands us.
//!
//! Each campaign bundles the files of one fixture directory as one input and damages them at
//! the byte level (`fuzz_hf_config.rs` covers valid JSON with odd values):
//! - `fuzz_hf_model_bf16`: a bf16 Llama with grouped-query attention, one safetensors file;
//! - `fuzz_hf_model_sharded`: GPT-2 in four shards with their index.
//!
//! Whatever loads is used: the tensors are checked against the config the reader validated,
//! and the model is built from them and computes a loss on a few tokens. Every allocation
//! through the backend is under a 64 MiB budget (the fixtures need well under 1 MiB), so a
//! size taken from a damaged file must be refused before it is allocated. 0 panics and 0
//! hangs are asserted; `scripts/fuzz-long.sh` runs them long, each in its own process (an
//! abort would show there).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use headroom_fuzzkit::{fuzz_seeds, iterations, unbundle, Cleanup, FuzzReport, ScratchDir};
use headroom_profiler::MemoryTracker;
use headroom_tensor::{AllocHook, Cpu, Device};
use headroom_trainer::hf;
use headroom_trainer::model::params::param_infos;
use headroom_trainer::model::{Geometry, Model, ModelOptions};

#[allow(dead_code)] // the command helpers are for the tests that run `headroom`
mod common;

const CI_ITERATIONS: u64 = 150;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The files `hf::load` reads from fixture `dir`, sorted by name (the references the other
/// tests compare against, and `generation_config.json`, are not read by the loader).
fn model_files(dir: &str) -> Vec<(String, Vec<u8>)> {
    common::dir_files(
        &fixture(dir),
        None,
        &["reference.safetensors", "generation_config.json"],
    )
}

/// Write the bundle's files into a fresh directory and load it; a loaded model is built and
/// computes a loss.
fn load_input(
    scratch: &ScratchDir,
    names: &[String],
    bytes: &[u8],
) -> Result<(), headroom_trainer::TrainError> {
    let parts = unbundle(bytes, names.len());
    let dir = scratch.fresh();
    let _cleanup = Cleanup(vec![dir.clone()]);
    std::fs::create_dir_all(&dir).unwrap();
    for (name, part) in names.iter().zip(&parts) {
        std::fs::write(dir.join(name), part).unwrap();
    }
    let tracker = Arc::new(MemoryTracker::new());
    tracker.set_budget(Device::Cpu, Some(64 << 20));
    let cpu = Cpu::new().with_alloc_hook(tracker as Arc<dyn AllocHook>);
    let (config, masters) = hf::load(&dir, &cpu)?;
    // The tensors the reader returned agree with the config it validated.
    let infos = param_infos(&config);
    assert_eq!(masters.len(), infos.len(), "{config:?}");
    for (t, info) in masters.iter().zip(&infos) {
        assert_eq!(
            t.as_slice::<f32>().unwrap().len(),
            info.shape.iter().product::<usize>(),
            "{}",
            info.name
        );
    }
    let model = Model::from_masters(&cpu, config, ModelOptions::default(), masters)?;
    let t = config.max_seq.clamp(1, 4);
    let tokens: Vec<u32> = (0..t).map(|i| (i % config.vocab) as u32).collect();
    let targets: Vec<u32> = (0..t).map(|i| ((i + 1) % config.vocab) as u32).collect();
    // A damaged weight may be a NaN or an infinity: the loss's value is not checked.
    model.loss(&tokens, &targets, Geometry::new(1, t))?;
    Ok(())
}

fn campaign(name: &str, dir: &str) -> FuzzReport {
    let files = model_files(dir);
    let seed = common::safetensors_bundle(dir, &files);
    let names: Vec<String> = files.into_iter().map(|(n, _)| n).collect();
    let scratch = ScratchDir::new("headroom-fuzz-hf").unwrap();
    fuzz_seeds(name, &[seed], iterations(CI_ITERATIONS), move |bytes| {
        load_input(&scratch, &names, bytes)
    })
}

fn check(report: FuzzReport) {
    println!("{report}");
    report.assert_clean();
    // The unchanged parts of an input still load: a seed that never loads is broken.
    assert!(
        report.ok > 0,
        "no input loaded: the seed is broken\n{report}"
    );
    assert!(report.errors > 0, "no input was refused\n{report}");
}

#[test]
fn fuzz_hf_model_bf16() {
    check(campaign("hf-model-bf16", "hf-llama-gqa-untied-bf16"));
}

#[test]
fn fuzz_hf_model_sharded() {
    check(campaign("hf-model-sharded", "hf-gpt2-sharded"));
}
