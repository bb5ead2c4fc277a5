//! Fuzz tests for the trainer's checkpoint reader (`checkpoint::load`: manifest, state and
//! config JSON, safetensors, optimizer moments) with headroom-fuzzkit.
//!
//! Campaigns over the files of a real checkpoint, bundled as one input:
//! - `fuzz_checkpoint_as_is`: the mutated files as they are, so mostly the manifest's size and
//!   checksum checks answer;
//! - `fuzz_checkpoint_resealed`: the manifest is rewritten to match the mutated files, as a
//!   careful forger would, so the content checks behind the checksums (JSON parsing, config
//!   bounds, safetensors headers, tensor names and shapes, optimizer sizes) face every input;
//! - `fuzz_zero_checkpoint_resealed`: the same for a 2-rank ZeRO-2 checkpoint (`zero.json`,
//!   one safetensors file of parameter and moment pieces per rank), read by
//!   `zero_checkpoint::load`, whose tiling checks (every element of every tensor covered
//!   exactly once) face every input;
//! - `fuzz_lora_checkpoint_resealed`: the same for a LoRA fine-tuning checkpoint (PEFT's
//!   adapter files, `state.json` with the fine-tuning spec and the base's fingerprint, the
//!   adapters' moments), read by `checkpoint::load`.
//!
//! Whatever loads is used: the model is built from it (a ZeRO checkpoint is consolidated
//! first, which reads every piece; a LoRA checkpoint's tensors become the run's adapters).
//! `checkpoint::verify` faces every input too, and must accept whatever the resume path (or
//! the ZeRO and LoRA readers) accepts under a manifest that matches. 0 panics and 0 hangs are
//! asserted;
//! `scripts/fuzz-long.sh` runs them long, each in its own process (an abort would show there).

use std::sync::OnceLock;

use headroom_fuzzkit::{fuzz_seeds, iterations, unbundle, Cleanup, FuzzReport, ScratchDir};
use headroom_trainer::checkpoint::{self, Manifest, ManifestFile, FILES, MANIFEST};
use headroom_trainer::model::finetune::adapter_infos;
use headroom_trainer::train::{train, TrainOptions};
use headroom_trainer::zero_checkpoint;
use headroom_trainer::zero_train::{train_zero, ZeroOptions};

#[allow(dead_code)] // the other helpers serve other test binaries
mod common;

const CI_ITERATIONS: u64 = 200;

/// One step of the tiny model (2 layers, width 16) saved under `root`.
fn tiny_run(root: &std::path::Path) -> TrainOptions {
    let mut o = TrainOptions {
        steps: 1,
        batch: 2,
        seq: 8,
        save: Some((root.to_path_buf(), 1)),
        ..TrainOptions::tiny_default()
    };
    o.model.channels = 16;
    o.model.max_seq = 8;
    o
}

/// The files of a small checkpoint ([`tiny_run`]), in [`FILES`] order
/// followed by the manifest.
fn checkpoint_files() -> &'static Vec<(String, Vec<u8>)> {
    static FILES_CELL: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    FILES_CELL.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        train(&tiny_run(dir.path()), |_| {}).unwrap();
        let step = dir.path().join("step-00000001");
        FILES
            .iter()
            .chain([&MANIFEST])
            .map(|n| (n.to_string(), std::fs::read(step.join(n)).unwrap()))
            .collect()
    })
}

/// The files of a 2-rank ZeRO-2 checkpoint of the same tiny model after one step, sorted by
/// name, the manifest last.
fn zero_checkpoint_files() -> &'static Vec<(String, Vec<u8>)> {
    static FILES_CELL: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    FILES_CELL.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        train_zero(
            &tiny_run(dir.path()),
            ZeroOptions::new(headroom_zero::Stage::Zero2, 2),
            |_| {},
        )
        .unwrap();
        let step = dir.path().join("step-00000001");
        assert!(zero_checkpoint::is_zero_checkpoint(&step));
        common::dir_files(&step, Some(MANIFEST), &[])
    })
}

/// The files of a LoRA checkpoint (rank 4, on the tiny Llama fixture) after one step, sorted
/// by name, the manifest last.
fn lora_checkpoint_files() -> &'static Vec<(String, Vec<u8>)> {
    static FILES_CELL: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    FILES_CELL.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let base = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/hf-llama-gqa-untied");
        let root = dir.path().join("run");
        let out = common::headroom_command()
            .args(["train", "--init-from"])
            .arg(&base)
            .args([
                "--lora-rank",
                "4",
                "--steps",
                "1",
                "--batch",
                "2",
                "--seq",
                "8",
            ])
            .arg("--checkpoint-dir")
            .arg(&root)
            .arg("--no-progress")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        common::dir_files(&root.join("step-00000001"), Some(MANIFEST), &[])
    })
}

/// Write the bundle's files into a fresh step directory, the manifest last: as they are, or
/// (`reseal`) a manifest that matches the other files.
fn write_step(
    scratch: &ScratchDir,
    names: &[(String, Vec<u8>)],
    bytes: &[u8],
    reseal: bool,
) -> (std::path::PathBuf, Cleanup) {
    let parts = unbundle(bytes, names.len());
    let dir = scratch.fresh();
    let cleanup = Cleanup(vec![dir.clone()]);
    std::fs::create_dir_all(&dir).unwrap();
    for ((name, _), part) in names.iter().zip(&parts) {
        if name != MANIFEST || !reseal {
            std::fs::write(dir.join(name), part).unwrap();
        }
    }
    if reseal {
        let m = Manifest {
            format_version: checkpoint::FORMAT_VERSION,
            step: 1,
            files: names
                .iter()
                .zip(&parts)
                .filter(|((n, _), _)| n != MANIFEST)
                .map(|((n, _), p)| ManifestFile {
                    name: n.clone(),
                    bytes: p.len() as u64,
                    xxh3: format!("{:016x}", xxhash_rust::xxh3::xxh3_64(p)),
                })
                .collect(),
        };
        std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&m).unwrap()).unwrap();
    }
    (dir, cleanup)
}

/// Write the bundle's files into a fresh step directory (`reseal`: with a manifest that
/// matches them) and load it; a loaded checkpoint builds its model.
fn load_input(
    scratch: &ScratchDir,
    bytes: &[u8],
    reseal: bool,
) -> Result<(), headroom_trainer::TrainError> {
    let (dir, _cleanup) = write_step(scratch, checkpoint_files(), bytes, reseal);
    // The path a resume takes (`ResumePoint`: masters through the HF loader, moments
    // streamed): whatever it accepts, `load` accepts with the same values.
    let cpu = headroom_tensor::Cpu::new();
    let resumed = checkpoint::ResumePoint::open(&dir).and_then(|p| {
        let masters = p.read_masters(&cpu)?;
        let moments = p.read_moments(|_, reader, _| {
            let mut v = Vec::new();
            reader
                .read_to_end(&mut v)
                .map_err(|e| headroom_trainer::TrainError::Input(e.to_string()))?;
            Ok(v)
        })?;
        Ok((masters, moments))
    });
    let loaded = checkpoint::load(&dir);
    // `verify` makes the resume's checks and then every file's checksum: under a manifest
    // that matches the damage, what resumes is verified, as the same step.
    let verified = checkpoint::verify(&dir);
    if reseal && resumed.is_ok() {
        let v = verified.expect("verify refused what the resume path accepted");
        assert_eq!(v.step, loaded.as_ref().map_or(v.step, |ck| ck.state.step));
    }
    if let Ok((masters, moments)) = &resumed {
        let ck = loaded
            .as_ref()
            .expect("the resume path accepted what load refused");
        // Bits, not values: a mutated weight may be a NaN.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(masters.len(), ck.params.len());
        for (t, p) in masters.iter().zip(&ck.params) {
            assert!(bits(t.as_slice::<f32>().unwrap()) == bits(p));
        }
        assert!(*moments == ck.moments);
    }
    let ck = loaded?;
    // The parameters the reader returned agree with the config it validated.
    let infos = headroom_trainer::model::params::param_infos(&ck.state.config);
    assert_eq!(ck.params.len(), infos.len());
    for (p, i) in ck.params.iter().zip(&infos) {
        assert_eq!(p.len(), i.shape.iter().product::<usize>());
    }
    let cpu = headroom_tensor::Cpu::new();
    ck.into_model(&cpu, Default::default())?;
    Ok(())
}

fn check(report: FuzzReport, expect_ok: bool) {
    println!("{report}");
    report.assert_clean();
    if expect_ok {
        assert!(
            report.ok > 0,
            "no input loaded: the seed is broken\n{report}"
        );
    }
    assert!(report.errors > 0, "no input was refused\n{report}");
}

/// Write a damaged ZeRO checkpoint with a matching manifest and load it; whatever loads is
/// consolidated into an ordinary checkpoint, which must load and build its model.
fn load_zero_input(scratch: &ScratchDir, bytes: &[u8]) -> Result<(), headroom_trainer::TrainError> {
    let (dir, _cleanup) = write_step(scratch, zero_checkpoint_files(), bytes, true);
    let verified = checkpoint::verify(&dir);
    zero_checkpoint::load(&dir)?;
    verified.expect("verify refused a ZeRO checkpoint that loads");
    let out = scratch.fresh();
    let _out_cleanup = Cleanup(vec![out.clone()]);
    let consolidated = zero_checkpoint::consolidate(&dir, &out)?;
    let ck = checkpoint::load(&consolidated)
        .expect("a consolidated ZeRO checkpoint that loaded must load as an ordinary one");
    let cpu = headroom_tensor::Cpu::new();
    ck.into_model(&cpu, Default::default())?;
    Ok(())
}

/// Write a damaged LoRA checkpoint with a matching manifest and load it; whatever loads
/// becomes the run's adapters again.
fn load_lora_input(scratch: &ScratchDir, bytes: &[u8]) -> Result<(), headroom_trainer::TrainError> {
    let (dir, _cleanup) = write_step(scratch, lora_checkpoint_files(), bytes, true);
    let verified = checkpoint::verify(&dir);
    let ck = checkpoint::load(&dir)?;
    let v = verified.expect("verify refused a LoRA checkpoint that loads");
    assert!(matches!(v.kind, checkpoint::CheckpointKind::Finetune(_)));
    let spec = &ck
        .state
        .finetune
        .as_ref()
        .expect("a LoRA checkpoint loaded as a full model")
        .spec;
    // The tensors the reader returned agree with the spec and config it validated.
    let infos = adapter_infos(&ck.state.config, &spec.lora)?;
    assert_eq!(ck.params.len(), infos.len());
    for (p, i) in ck.params.iter().zip(&infos) {
        assert_eq!(p.len(), i.shape.iter().product::<usize>(), "{}", i.name);
    }
    let slices: Vec<&[f32]> = ck.params.iter().map(Vec::as_slice).collect();
    checkpoint::adapter_of(&ck.state.config, spec, &slices)?;
    Ok(())
}

/// Campaign `name` over the bundled `files` (`what` names the seed), each input handed to
/// `load` with a scratch directory of its own.
fn campaign(
    name: &str,
    what: &str,
    files: &[(String, Vec<u8>)],
    load: fn(&ScratchDir, &[u8]) -> Result<(), headroom_trainer::TrainError>,
) -> FuzzReport {
    let scratch = ScratchDir::new(&format!("headroom-fuzz-{name}")).unwrap();
    fuzz_seeds(
        name,
        &[common::safetensors_bundle(what, files)],
        iterations(CI_ITERATIONS),
        move |bytes| load(&scratch, bytes),
    )
}

#[test]
fn fuzz_checkpoint_as_is() {
    let report = campaign(
        "checkpoint-as-is",
        "tiny checkpoint",
        checkpoint_files(),
        |scratch, bytes| load_input(scratch, bytes, false),
    );
    // Nearly every mutation breaks a checksum; unmutated parts still load.
    check(report, false);
}

#[test]
fn fuzz_checkpoint_resealed() {
    let report = campaign(
        "checkpoint-resealed",
        "tiny checkpoint",
        checkpoint_files(),
        |scratch, bytes| load_input(scratch, bytes, true),
    );
    check(report, true);
}

#[test]
fn fuzz_zero_checkpoint_resealed() {
    let report = campaign(
        "zero-checkpoint-resealed",
        "tiny ZeRO-2 checkpoint",
        zero_checkpoint_files(),
        load_zero_input,
    );
    check(report, true);
}

#[test]
fn fuzz_lora_checkpoint_resealed() {
    let report = campaign(
        "lora-checkpoint-resealed",
        "tiny LoRA checkpoint",
        lora_checkpoint_files(),
        load_lora_input,
    );
    check(report, true);
}
