//! Checkpoints as one unit: a directory whose files disagree is refused, the newest complete
//! checkpoint is the one resumed, a run saves at its end and when stopped, old checkpoints are
//! pruned, and sizes read from a checkpoint are bounded before anything is allocated.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use headroom_offload::StatePrecision;
use headroom_tensor::Backend;
use headroom_trainer::checkpoint::{self, Manifest, FORMAT_VERSION, MANIFEST};
use headroom_trainer::model::ModelConfig;
use headroom_trainer::train::{train, TrainOptions};
use headroom_trainer::TrainError;

fn tiny(steps: usize) -> TrainOptions {
    TrainOptions {
        steps,
        batch: 4,
        ..TrainOptions::tiny_default()
    }
}

/// A tiny run of `steps` steps saving every `every` into a fresh directory: the directory
/// and the options it ran with.
fn trained_with_checkpoints(steps: usize, every: usize) -> (tempfile::TempDir, TrainOptions) {
    let dir = tempfile::tempdir().unwrap();
    let o = TrainOptions {
        save: Some((dir.path().to_path_buf(), every)),
        ..tiny(steps)
    };
    train(&o, |_| {}).unwrap();
    (dir, o)
}

fn step_dirs(root: &Path) -> Vec<usize> {
    checkpoint::list(root)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect()
}

/// Rewrite a file of a step directory and its manifest entry, as a careful attacker (or a
/// buggy tool) would: the checksum then agrees and only the content checks remain.
fn rewrite_consistently(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(name), bytes).unwrap();
    let mut m: Manifest =
        serde_json::from_slice(&std::fs::read(dir.join(MANIFEST)).unwrap()).unwrap();
    let e = m.files.iter_mut().find(|f| f.name == name).unwrap();
    e.bytes = bytes.len() as u64;
    e.xxh3 = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes));
    std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&m).unwrap()).unwrap();
}

#[test]
fn a_run_saves_at_its_end_keeps_the_newest_and_resumes_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let o = TrainOptions {
        save: Some((dir.path().to_path_buf(), 2)),
        keep_checkpoints: 2,
        ..tiny(5)
    };
    let r = train(&o, |_| {}).unwrap();
    // Saved at 2 and 4 (every 2) and 5 (the end); the oldest pruned.
    assert_eq!(step_dirs(dir.path()), vec![4, 5]);
    assert_eq!(
        r.last_checkpoint.as_deref(),
        Some(dir.path().join("step-00000005").as_path())
    );
    let ck = checkpoint::load(dir.path()).unwrap();
    assert_eq!(ck.state.step, 5);
    assert_eq!(ck.state.run, o.run_spec());
    // What `sample` and `eval` read (the verified model files through the Hugging Face
    // loader, no optimizer state) is the checkpoint's model, bit for bit.
    let cpu = headroom_tensor::Cpu::new();
    let (cfg, masters) = headroom_trainer::sample::load_masters(dir.path(), &cpu).unwrap();
    assert_eq!(cfg, ck.state.config);
    assert_eq!(masters.len(), ck.params.len());
    for (m, p) in masters.iter().zip(&ck.params) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(m.as_slice::<f32>().unwrap()), bits(p));
    }
    // No leftovers of the saves (the run's lock file stays: removing it could let two runs
    // lock two different files).
    for e in std::fs::read_dir(dir.path()).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            name.starts_with("step-") || name == checkpoint::ROOT_LOCK,
            "left behind: {name}"
        );
    }
}

#[test]
fn checkpoint_every_zero_still_saves_the_last_step() {
    let (dir, _) = trained_with_checkpoints(3, 0);
    assert_eq!(step_dirs(dir.path()), vec![3]);
}

#[test]
fn a_stop_request_saves_and_returns_early_and_the_resume_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let full: Vec<u32> = train(&tiny(6), |_| {})
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss.to_bits())
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let o = TrainOptions {
        save: Some((dir.path().to_path_buf(), 100)),
        stop: Some(stop),
        ..tiny(6)
    };
    // The "signal" arrives during step 2.
    let r = train(&o, |s| {
        if s.step == 2 {
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    })
    .unwrap();
    assert!(r.stopped);
    assert_eq!(r.steps.len(), 3);
    assert_eq!(step_dirs(dir.path()), vec![3]);
    let rest: Vec<u32> = train(
        &TrainOptions {
            resume_from: Some(dir.path().to_path_buf()),
            ..tiny(6)
        },
        |_| {},
    )
    .unwrap()
    .steps
    .iter()
    .map(|s| s.loss.to_bits())
    .collect();
    assert_eq!(&full[3..], &rest[..]);
}

#[test]
fn files_from_different_steps_are_refused_not_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let o = TrainOptions {
        save: Some((dir.path().to_path_buf(), 1)),
        keep_checkpoints: 5,
        ..tiny(2)
    };
    train(&o, |_| {}).unwrap();
    let (s1, s2) = (
        dir.path().join("step-00000001"),
        dir.path().join("step-00000002"),
    );
    // The failure of the old layout: step 2's model beside step 1's state.
    std::fs::copy(s2.join("model.safetensors"), s1.join("model.safetensors")).unwrap();
    let e = checkpoint::load(&s1)
        .err()
        .expect("a torn checkpoint loaded");
    assert!(
        matches!(&e, TrainError::Checkpoint { reason, .. } if reason.contains("checksum")),
        "{e}"
    );
    // The same through a resume of that step directory.
    let e = train(
        &TrainOptions {
            resume_from: Some(s1.clone()),
            ..tiny(2)
        },
        |_| {},
    )
    .unwrap_err();
    assert!(matches!(e, TrainError::Checkpoint { .. }), "{e}");
    // A state whose step disagrees with the manifest, even with a matching checksum.
    let state = std::fs::read_to_string(s2.join("state.json")).unwrap();
    let forged = state.replacen("\"step\": 2", "\"step\": 1", 1);
    assert_ne!(state, forged);
    rewrite_consistently(&s2, "state.json", forged.as_bytes());
    let e = checkpoint::load(&s2).err().expect("a forged step loaded");
    assert!(e.to_string().contains("manifest"), "{e}");
}

#[test]
fn a_missing_manifest_or_file_is_refused() {
    let (dir, _) = trained_with_checkpoints(1, 1);
    let s1 = dir.path().join("step-00000001");
    std::fs::remove_file(s1.join("optimizer.bin")).unwrap();
    assert!(matches!(
        checkpoint::load(&s1),
        Err(TrainError::Checkpoint { .. })
    ));
    // The layout of earlier versions (no manifest) is refused with a reason.
    std::fs::remove_file(s1.join(MANIFEST)).unwrap();
    let e = checkpoint::load(&s1).err().unwrap();
    assert!(e.to_string().contains("manifest"), "{e}");
    // A manifest of another format version.
    let m = Manifest {
        format_version: FORMAT_VERSION + 1,
        step: 1,
        files: vec![],
    };
    std::fs::write(s1.join(MANIFEST), serde_json::to_vec(&m).unwrap()).unwrap();
    let e = checkpoint::load(&s1).err().unwrap();
    assert!(e.to_string().contains("format version"), "{e}");
    // An empty directory.
    let empty = tempfile::tempdir().unwrap();
    assert!(checkpoint::load(empty.path()).is_err());
}

#[test]
fn a_fresh_run_refuses_a_directory_holding_another_runs_checkpoints() {
    let (dir, o) = trained_with_checkpoints(2, 1);
    let e = train(&o, |_| {}).unwrap_err();
    assert!(e.to_string().contains("resume"), "{e}");
    // Resuming into the same directory continues and saves there.
    let more = TrainOptions {
        steps: 2,
        resume_from: Some(dir.path().to_path_buf()),
        ..o.clone()
    };
    let r = train(&more, |_| {}).unwrap();
    assert!(
        r.steps.is_empty(),
        "the checkpoint already holds every step"
    );
}

#[test]
fn resuming_under_other_settings_names_each_difference() {
    let dir = tempfile::tempdir().unwrap();
    // No warmup and two steps taken: the cosine decay has moved the rate of step 1, so another
    // --steps would have given it another one.
    let o = TrainOptions {
        save: Some((dir.path().to_path_buf(), 1)),
        warmup: 0,
        ..tiny(3)
    };
    train(
        &TrainOptions {
            stop_after: Some(2),
            ..o.clone()
        },
        |_| {},
    )
    .unwrap();
    let mut other = TrainOptions {
        seq: 32,
        lr: 1e-3,
        steps: 5,
        resume_from: Some(dir.path().to_path_buf()),
        save: None,
        ..o.clone()
    };
    other.techniques.optimizer.state = StatePrecision::Float8;
    match train(&other, |_| {}).unwrap_err() {
        TrainError::ResumeMismatch { differences, .. } => {
            assert!(differences.iter().any(|d| d.starts_with("--seq")));
            assert!(differences.iter().any(|d| d.starts_with("--lr")));
            // The floor of the schedule is 0.1 × lr: it moved with --lr.
            assert!(differences.iter().any(|d| d.starts_with("--min-lr")));
            assert!(
                differences
                    .iter()
                    .any(|d| d == "--adam-8bit: checkpoint's optimizer state f32, this run 8-bit"),
                "{differences:?}"
            );
            // A longer run is another schedule; the message says how to train on.
            assert!(
                differences
                    .iter()
                    .any(|d| d.starts_with("--steps: checkpoint 3, this run 5 (")
                        && d.contains("--init-from")),
                "{differences:?}"
            );
            assert_eq!(differences.len(), 5, "{differences:?}");
        }
        e => panic!("expected ResumeMismatch, got {e}"),
    }
}

/// A `wsd` run resumed in its stable phase under another --steps keeps its moments and is,
/// bit for bit, the run of that length trained from the start; so is a `constant` run. Once a
/// decay has moved a rate, another length is refused, naming the steps taken.
#[test]
fn a_stable_phase_resumes_under_another_length() {
    use headroom_trainer::train::{LrSchedule, TrainReport};
    let bits = |r: &TrainReport| -> Vec<u32> { r.steps.iter().map(|s| s.loss.to_bits()).collect() };
    for schedule in [LrSchedule::Wsd, LrSchedule::Constant] {
        let dir = tempfile::tempdir().unwrap();
        let run = |steps: usize| TrainOptions {
            warmup: 2,
            lr_schedule: schedule,
            ..tiny(steps)
        };
        // 10 steps: wsd turns at step 8; 5 are taken, the extension to 16 turns at 12.
        train(
            &TrainOptions {
                save: Some((dir.path().to_path_buf(), 5)),
                stop_after: Some(5),
                ..run(10)
            },
            |_| {},
        )
        .unwrap();
        let longer = train(
            &TrainOptions {
                resume_from: Some(dir.path().to_path_buf()),
                save: Some((dir.path().to_path_buf(), 0)),
                ..run(16)
            },
            |_| {},
        )
        .unwrap();
        let whole = train(&run(16), |_| {}).unwrap();
        assert_eq!(bits(&longer), bits(&whole)[5..], "{}", schedule.name());
        assert_eq!(
            checkpoint::load(dir.path()).unwrap().state.run.steps,
            16,
            "the extended run's checkpoints record its length"
        );
    }
    // wsd turns at step 8 of 10: step 8 is still the peak, step 9's rate depends on the
    // length. So 9 steps taken may be extended, 10 may not.
    let dir = tempfile::tempdir().unwrap();
    let run = |steps: usize| TrainOptions {
        warmup: 2,
        lr_schedule: LrSchedule::Wsd,
        ..tiny(steps)
    };
    train(
        &TrainOptions {
            save: Some((dir.path().to_path_buf(), 9)),
            ..run(10)
        },
        |_| {},
    )
    .unwrap();
    let nine = train(
        &TrainOptions {
            resume_from: Some(dir.path().join("step-00000009")),
            ..run(16)
        },
        |_| {},
    )
    .unwrap();
    assert_eq!(nine.steps.len(), 7);
    match train(
        &TrainOptions {
            resume_from: Some(dir.path().to_path_buf()),
            ..run(16)
        },
        |_| {},
    )
    .unwrap_err()
    {
        TrainError::ResumeMismatch { differences, .. } => {
            assert_eq!(differences.len(), 1, "{differences:?}");
            assert!(
                differences[0].starts_with(
                    "--steps: checkpoint 10, this run 16 (the learning rates of the 10 steps \
                     taken would differ: the wsd decay spans --steps;"
                ),
                "{differences:?}"
            );
        }
        e => panic!("expected ResumeMismatch, got {e}"),
    }
}

/// A run resumed from an older step into its own root, which still holds the later
/// checkpoints of the run it abandons: pruning by step number would delete the resumed run's
/// new checkpoints and keep the abandoned ones, which a later `--resume` of the root would
/// continue. The resume is refused before anything is written or deleted, and goes ahead once
/// the later checkpoints are moved aside as the message says.
#[test]
fn a_resume_refuses_a_root_holding_checkpoints_past_its_start() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let o = TrainOptions {
        save: Some((root.clone(), 2)),
        keep_checkpoints: 2,
        ..tiny(8)
    };
    train(&o, |_| {}).unwrap();
    assert_eq!(step_dirs(&root), vec![6, 8]);
    let manifest8 = std::fs::read(root.join("step-00000008").join(MANIFEST)).unwrap();
    let resumed = TrainOptions {
        save: Some((root.clone(), 1)),
        keep_checkpoints: 1,
        resume_from: Some(root.join("step-00000006")),
        stop_after: Some(7),
        ..tiny(8)
    };
    match train(&resumed, |_| {}).unwrap_err() {
        TrainError::Checkpoint { path, reason } => {
            assert_eq!(path, root);
            assert!(
                reason.contains("steps 8") && reason.contains("--checkpoint-dir"),
                "{reason}"
            );
        }
        e => panic!("expected a checkpoint error, got {e}"),
    }
    // Nothing written, nothing deleted.
    assert_eq!(step_dirs(&root), vec![6, 8]);
    assert_eq!(
        std::fs::read(root.join("step-00000008").join(MANIFEST)).unwrap(),
        manifest8
    );
    let names = |d: &Path| {
        std::fs::read_dir(d)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name() != checkpoint::ROOT_LOCK)
            .count()
    };
    assert_eq!(names(&root), 2, "a save was started");

    std::fs::rename(root.join("step-00000008"), dir.path().join("abandoned")).unwrap();
    let r = train(&resumed, |_| {}).unwrap();
    let last = r.last_checkpoint.unwrap();
    assert_eq!(last, root.join("step-00000007"));
    assert_eq!(step_dirs(&root), vec![7]);
    assert_eq!(checkpoint::resolve(&root).unwrap(), last);
}

/// Defence in depth below the resume's refusal: a save into a root that holds a later step
/// never prunes the checkpoint it just published, whatever the step numbers say.
#[test]
fn a_save_never_prunes_the_checkpoint_it_just_published() {
    let (dir, _) = trained_with_checkpoints(8, 2);
    let root = dir.path();
    assert_eq!(step_dirs(root), vec![4, 6, 8]);
    let mut ck = checkpoint::load(&root.join("step-00000006")).unwrap();
    ck.state.step = 7;
    let cpu = headroom_tensor::Cpu::new();
    let infos = headroom_trainer::model::params::param_infos(&ck.state.config);
    let tensors: Vec<_> = infos
        .iter()
        .zip(&ck.params)
        .map(|(info, p)| cpu.upload(p, info.shape.clone()).unwrap())
        .collect();
    let published = checkpoint::save(root, &ck.state, &tensors, &ck.moments, 1).unwrap();
    assert_eq!(published, root.join("step-00000007"));
    assert_eq!(step_dirs(root), vec![7]);
    assert_eq!(checkpoint::load(root).unwrap().state.step, 7);
}

/// A save that fails part-way (here a tensor of the wrong size, in practice most often a full
/// disk) returns the error, leaves the checkpoints before it as they were, and removes its own
/// unfinished `.partial-…` directory instead of leaving it to hold the space until the next
/// successful save. The same for a Hugging Face export.
#[test]
fn a_failed_save_removes_its_partial_directory_and_keeps_the_older_checkpoints() {
    let (dir, _) = trained_with_checkpoints(6, 2);
    let root = dir.path();
    let before = step_dirs(root);
    let mut ck = checkpoint::load(&root.join("step-00000006")).unwrap();
    ck.state.step = 9;
    let cpu = headroom_tensor::Cpu::new();
    let infos = headroom_trainer::model::params::param_infos(&ck.state.config);
    let mut tensors: Vec<_> = infos
        .iter()
        .zip(&ck.params)
        .map(|(info, p)| cpu.upload(p, info.shape.clone()).unwrap())
        .collect();
    // The save fails while the model file is being written, its header already on disk.
    *tensors.last_mut().unwrap() = cpu.upload(&[0.0f32], vec![1]).unwrap();
    let leftovers = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.') && n != checkpoint::ROOT_LOCK)
            .collect()
    };

    let e = checkpoint::save(root, &ck.state, &tensors, &ck.moments, 2).unwrap_err();
    assert!(e.to_string().contains("values, expected"), "{e}");
    assert_eq!(leftovers(root), Vec::<String>::new());
    assert_eq!(step_dirs(root), before);
    assert_eq!(checkpoint::load(root).unwrap().state.step, 6);

    let out = root.join("exported");
    checkpoint::save_hf(
        &out,
        &ck.state.config,
        &tensors,
        checkpoint::MAX_SHARD_BYTES,
    )
    .unwrap_err();
    assert!(!out.exists());
    assert_eq!(leftovers(root), Vec::<String>::new());
    assert!(!out.exists());
}

/// `--min-loss-scale` decides an fp16 run's numbers (the scale stops backing off at it), so a
/// resume under another floor is refused by name; the same floor resumes. A checkpoint written
/// before the floor was recorded still loads, and its unknown floor is not compared. Without
/// loss scaling the flag changes nothing and is not part of the run.
#[test]
fn the_loss_scale_floor_is_part_of_an_fp16_run() {
    use headroom_trainer::model::Precision;
    let dir = tempfile::tempdir().unwrap();
    let fp16 = |floor: Option<f32>| {
        let mut o = tiny(4);
        o.techniques.model.precision = Precision::Fp16;
        o.min_loss_scale = floor;
        o
    };
    let mut first = fp16(Some(1024.0));
    first.save = Some((dir.path().to_path_buf(), 2));
    first.stop_after = Some(2);
    train(&first, |_| {}).unwrap();
    let step2 = dir.path().join("step-00000002");
    assert_eq!(
        checkpoint::load(&step2).unwrap().state.run.min_loss_scale,
        Some(Some(1024.0))
    );
    let resume = |floor: Option<f32>| {
        let mut o = fp16(floor);
        o.resume_from = Some(step2.clone());
        train(&o, |_| {})
    };
    for (floor, shown) in [(None, "none"), (Some(512.0), "512")] {
        match resume(floor).unwrap_err() {
            TrainError::ResumeMismatch { differences, .. } => assert_eq!(
                differences,
                vec![format!(
                    "--min-loss-scale: checkpoint 1024, this run {shown}"
                )]
            ),
            e => panic!("expected ResumeMismatch, got {e}"),
        }
    }
    assert_eq!(resume(Some(1024.0)).unwrap().steps.len(), 2);

    // A state.json of before: no field at all.
    let path = step2.join("state.json");
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert!(state["run"]
        .as_object_mut()
        .unwrap()
        .remove("min_loss_scale")
        .is_some());
    rewrite_consistently(&step2, "state.json", &serde_json::to_vec(&state).unwrap());
    assert_eq!(
        checkpoint::load(&step2).unwrap().state.run.min_loss_scale,
        None
    );
    assert_eq!(resume(Some(1024.0)).unwrap().steps.len(), 2);

    let fp32 = |floor| TrainOptions {
        min_loss_scale: floor,
        ..tiny(4)
    };
    assert_eq!(fp32(Some(8.0)).run_spec(), fp32(None).run_spec());
}

/// `--beta1`, `--beta2`, `--adam-eps` and `--lr-schedule` are part of a run: the checkpoint
/// records them (and its optimizer state holds the betas the optimizer ran with), a resume under
/// other ones names each, and a resume under the same ones equals the uninterrupted run. A
/// checkpoint written before they were recorded resumes with the values every run used then.
#[test]
fn the_optimizer_settings_and_schedule_are_part_of_a_run() {
    use headroom_trainer::train::LrSchedule;
    let dir = tempfile::tempdir().unwrap();
    let mut o = tiny(4);
    o.beta1 = 0.8;
    o.beta2 = 0.999;
    o.eps = 1e-6;
    o.lr_schedule = LrSchedule::Wsd;
    let whole = train(&o, |_| {}).unwrap();
    let first = TrainOptions {
        save: Some((dir.path().to_path_buf(), 2)),
        stop_after: Some(2),
        ..o.clone()
    };
    train(&first, |_| {}).unwrap();
    let step2 = dir.path().join("step-00000002");
    let ck = checkpoint::load(&step2).unwrap();
    assert_eq!(
        (ck.state.run.beta1, ck.state.run.beta2, ck.state.run.eps),
        (0.8, 0.999, 1e-6)
    );
    assert_eq!(ck.state.run.lr_schedule, LrSchedule::Wsd);
    for g in &ck.state.optimizer.groups {
        assert_eq!((g.beta1, g.beta2, g.eps), (0.8, 0.999, 1e-6));
    }

    let resume = |o: &TrainOptions| {
        train(
            &TrainOptions {
                resume_from: Some(step2.clone()),
                ..o.clone()
            },
            |_| {},
        )
    };
    let other = TrainOptions {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        lr_schedule: LrSchedule::Linear,
        ..o.clone()
    };
    match resume(&other).unwrap_err() {
        TrainError::ResumeMismatch { differences, .. } => assert_eq!(
            differences,
            [
                "--lr-schedule: checkpoint wsd, this run linear",
                "--beta1: checkpoint 0.8, this run 0.9",
                "--beta2: checkpoint 0.999, this run 0.95",
                "--adam-eps: checkpoint 0.000001, this run 0.00000001",
            ]
        ),
        e => panic!("expected ResumeMismatch, got {e}"),
    }
    let resumed = resume(&o).unwrap();
    let bits = |r: &headroom_trainer::train::TrainReport| -> Vec<u32> {
        r.steps.iter().map(|s| s.loss.to_bits()).collect()
    };
    assert_eq!(bits(&resumed), bits(&whole)[2..]);

    // A checkpoint of before: trained with β (0.9, 0.95), ε 1e-8 and the cosine schedule,
    // none of which its state.json names.
    let old_dir = tempfile::tempdir().unwrap();
    let old = TrainOptions {
        save: Some((old_dir.path().to_path_buf(), 2)),
        stop_after: Some(2),
        ..tiny(4)
    };
    train(&old, |_| {}).unwrap();
    let old2 = old_dir.path().join("step-00000002");
    let path = old2.join("state.json");
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let run = state["run"].as_object_mut().unwrap();
    for field in ["beta1", "beta2", "eps", "lr_schedule"] {
        assert!(run.remove(field).is_some(), "state.json lacks {field}");
    }
    rewrite_consistently(&old2, "state.json", &serde_json::to_vec(&state).unwrap());
    let run = checkpoint::load(&old2).unwrap().state.run;
    assert_eq!(run, tiny(4).run_spec());
    let resumed = train(
        &TrainOptions {
            resume_from: Some(old2),
            ..tiny(4)
        },
        |_| {},
    )
    .unwrap();
    assert_eq!(resumed.steps.len(), 2);
}

/// `checkpoint::verify` (`headroom checkpoint verify`): a sound checkpoint is described as the
/// run wrote it; one changed byte in any of its files, or a file gone, is an error naming the
/// file, and nothing is modified.
#[test]
fn verify_describes_a_checkpoint_and_names_any_damaged_file() {
    use headroom_trainer::checkpoint::CheckpointKind;
    let (dir, o) = trained_with_checkpoints(2, 2);
    let step2 = dir.path().join("step-00000002");
    let v = checkpoint::verify(dir.path()).unwrap();
    assert_eq!(v.dir, step2);
    assert_eq!(v.step, 2);
    assert_eq!(v.config, o.model);
    assert_eq!(v.run, o.run_spec());
    assert_eq!(
        v.kind,
        CheckpointKind::Full {
            optimizer: StatePrecision::F32
        }
    );
    assert_eq!(v.loader.as_ref().map(|l| l.next_batch), Some(2));
    let manifest: Manifest =
        serde_json::from_slice(&std::fs::read(step2.join(MANIFEST)).unwrap()).unwrap();
    assert_eq!(v.files, manifest.files);
    assert_eq!(v.files.len(), 4);
    for f in &manifest.files {
        let path = step2.join(&f.name);
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        let at = bad.len() / 2;
        bad[at] ^= 0x40;
        std::fs::write(&path, &bad).unwrap();
        let e = checkpoint::verify(&step2).unwrap_err().to_string();
        assert!(e.contains(&f.name), "{}: {e}", f.name);
        std::fs::remove_file(&path).unwrap();
        let e = checkpoint::verify(&step2).unwrap_err().to_string();
        assert!(e.contains(&f.name), "{} missing: {e}", f.name);
        std::fs::write(&path, &good).unwrap();
    }
    assert_eq!(checkpoint::verify(&step2).unwrap().files, manifest.files);
}

#[test]
fn hostile_sizes_in_a_checkpoint_are_refused_before_allocating() {
    let (dir, _) = trained_with_checkpoints(1, 1);
    let s1 = dir.path().join("step-00000001");
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(s1.join("state.json")).unwrap()).unwrap();
    for (field, value) in [
        ("layers", 1u64 << 40),
        ("channels", 1u64 << 62),
        ("vocab", 1u64 << 33),
        ("max_seq", u64::MAX),
        ("layers", 0),
        ("heads", 3),
    ] {
        let mut bad = state.clone();
        bad["config"][field] = value.into();
        rewrite_consistently(&s1, "state.json", &serde_json::to_vec(&bad).unwrap());
        let e = checkpoint::load(&s1)
            .err()
            .unwrap_or_else(|| panic!("{field} = {value} loaded"));
        assert!(
            matches!(e, TrainError::Config(_) | TrainError::Checkpoint { .. }),
            "{field} = {value}: {e}"
        );
    }
    // A config that is valid but not the one the tensors were saved for.
    let mut bad = state.clone();
    bad["config"]["layers"] = 3.into();
    rewrite_consistently(&s1, "state.json", &serde_json::to_vec(&bad).unwrap());
    let e = checkpoint::load(&s1).err().unwrap();
    assert!(matches!(e, TrainError::Checkpoint { .. }), "{e}");
    // Optimizer parameters that do not match the model's.
    let mut bad = state.clone();
    bad["optimizer"]["params"][0]["numel"] = (1u64 << 40).into();
    rewrite_consistently(&s1, "state.json", &serde_json::to_vec(&bad).unwrap());
    let e = checkpoint::load(&s1).err().unwrap();
    assert!(e.to_string().contains("optimizer state"), "{e}");
}

#[test]
fn the_model_loads_from_a_checkpoint_in_one_call() {
    let (dir, _) = trained_with_checkpoints(2, 2);
    let cpu = headroom_tensor::Cpu::new();
    let gpt = checkpoint::load_model(dir.path(), &cpu, Default::default()).unwrap();
    let g = headroom_trainer::model::Geometry::new(1, 8);
    let tokens: Vec<u32> = (0..8).collect();
    let loss = gpt.loss(&tokens, &tokens, g).unwrap();
    assert!(loss.is_finite());
    // Streamed from the files: the masters `load` reads whole, bit for bit.
    let masters: Vec<Vec<f32>> = gpt
        .masters()
        .iter()
        .map(|t| t.as_slice::<f32>().unwrap().to_vec())
        .collect();
    assert!(masters == checkpoint::load(dir.path()).unwrap().params);
}

#[test]
fn config_sizes_are_bounded_and_checked() {
    let ok = ModelConfig::small(50257);
    assert_eq!(ok.parameter_count().unwrap(), 30_044_544);
    for bad in [
        ModelConfig {
            layers: 10_000_000,
            ..ok
        },
        ModelConfig {
            channels: 1 << 62,
            heads: 1,
            ..ok
        },
        ModelConfig {
            vocab: usize::MAX,
            ..ok
        },
        ModelConfig {
            max_seq: 1 << 40,
            ..ok
        },
    ] {
        assert!(
            matches!(bad.validate(), Err(TrainError::Config(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn absurd_run_options_are_typed_errors_naming_the_option() {
    let cases: Vec<(TrainOptions, &str)> = vec![
        (
            TrainOptions {
                batch: 1_000_000_000,
                ..tiny(1)
            },
            "--batch",
        ),
        (
            TrainOptions {
                batch: 1_000_000,
                ..tiny(1)
            },
            "",
        ),
        (
            TrainOptions {
                budget: Some(0),
                ..tiny(1)
            },
            "--budget-mib",
        ),
        (
            {
                let mut o = tiny(1);
                o.techniques.micro_batch = Some(0);
                o
            },
            "--micro-batch",
        ),
        (
            {
                let mut o = tiny(1);
                o.techniques.micro_batch = Some(3);
                o
            },
            "--micro-batch",
        ),
        (TrainOptions { seq: 65, ..tiny(1) }, "--seq"),
        (
            TrainOptions {
                lr: f64::NAN,
                ..tiny(1)
            },
            "--lr",
        ),
        (
            TrainOptions {
                grad_clip: 0.0,
                ..tiny(1)
            },
            "--grad-clip",
        ),
        (
            TrainOptions {
                beta1: 1.0,
                ..tiny(1)
            },
            "--beta1",
        ),
        (
            TrainOptions {
                beta2: f64::NAN,
                ..tiny(1)
            },
            "--beta2",
        ),
        (
            TrainOptions {
                eps: -1e-8,
                ..tiny(1)
            },
            "--adam-eps",
        ),
        (
            TrainOptions {
                keep_checkpoints: 0,
                ..tiny(1)
            },
            "--keep-checkpoints",
        ),
    ];
    for (o, option) in cases {
        let e = train(&o, |_| {}).unwrap_err();
        let text = e.to_string();
        match &e {
            TrainError::Option { option: named, .. } => assert_eq!(*named, option, "{text}"),
            // A million sequences fit the size bounds but not this machine.
            TrainError::MachineMemory { .. } => assert_eq!(option, ""),
            _ => panic!("{option}: unexpected error {text}"),
        }
    }
}

/// A model split into transformers-style shards (`--max-shard-mib`): the same tensors as the
/// one-file checkpoint, loadable by the Hugging Face reader, and resumed bit for bit.
#[test]
fn sharded_checkpoints_hold_the_same_model_and_resume_exactly() {
    let one = tempfile::tempdir().unwrap();
    let sharded = tempfile::tempdir().unwrap();
    let run = |root: &Path, max_shard_bytes: u64, steps: usize| {
        train(
            &TrainOptions {
                // A stopped run does not save at its end (as a crash would not): a partial
                // run saves every `steps`.
                save: Some((root.to_path_buf(), steps)),
                max_shard_bytes,
                stop_after: (steps < 6).then_some(steps),
                ..tiny(6)
            },
            |_| {},
        )
        .unwrap()
    };
    run(one.path(), checkpoint::MAX_SHARD_BYTES, 6);
    // 64 KiB shards: the tiny model's embedding alone is larger, so it gets a shard of its own.
    run(sharded.path(), 64 << 10, 6);
    let (_, one_dir) = checkpoint::list(one.path()).unwrap().pop().unwrap();
    let (_, dir) = checkpoint::list(sharded.path()).unwrap().pop().unwrap();
    assert!(one_dir.join("model.safetensors").is_file());
    assert!(!dir.join("model.safetensors").exists());
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(checkpoint::SHARD_INDEX)).unwrap()).unwrap();
    let mut shards: Vec<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    shards.sort();
    shards.dedup();
    assert!(shards.len() >= 3, "{shards:?}");
    let n = shards.len();
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(s, &format!("model-{:05}-of-{n:05}.safetensors", i + 1));
        assert!(dir.join(s).is_file());
    }
    let a = checkpoint::load(&one_dir).unwrap();
    let b = checkpoint::load(&dir).unwrap();
    assert_eq!(a.params, b.params);
    assert_eq!(
        index["metadata"]["total_size"].as_u64().unwrap(),
        4 * a.params.iter().map(|p| p.len() as u64).sum::<u64>()
    );
    // transformers' reader (our --init-from) reads the shards through the index.
    let (_, masters) = headroom_trainer::hf::load(&dir, &headroom_tensor::Cpu::new()).unwrap();
    for (m, p) in masters.iter().zip(&a.params) {
        assert_eq!(m.as_slice::<f32>().unwrap(), &p[..]);
    }

    // Stop at step 3 with shards, resume: the losses of the uninterrupted run.
    let full: Vec<u32> = train(&tiny(6), |_| {})
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss.to_bits())
        .collect();
    let part = tempfile::tempdir().unwrap();
    run(part.path(), 64 << 10, 3);
    let rest: Vec<u32> = train(
        &TrainOptions {
            resume_from: Some(part.path().to_path_buf()),
            ..tiny(6)
        },
        |_| {},
    )
    .unwrap()
    .steps
    .iter()
    .map(|s| s.loss.to_bits())
    .collect();
    assert_eq!(&full[3..], &rest[..]);
}

#[test]
fn a_tampered_shard_index_is_refused() {
    let root = tempfile::tempdir().unwrap();
    train(
        &TrainOptions {
            save: Some((root.path().to_path_buf(), 100)),
            max_shard_bytes: 64 << 10,
            ..tiny(1)
        },
        |_| {},
    )
    .unwrap();
    let (_, dir) = checkpoint::list(root.path()).unwrap().pop().unwrap();
    let original = std::fs::read(dir.join(checkpoint::SHARD_INDEX)).unwrap();
    let index: serde_json::Value = serde_json::from_slice(&original).unwrap();
    let first = index["weight_map"]
        .as_object()
        .unwrap()
        .iter()
        .next()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
        .unwrap();
    let other = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_owned())
        .find(|v| *v != first.1)
        .unwrap();
    for (what, file) in [
        ("a tensor in the wrong shard", other),
        (
            "a path outside the directory",
            "../model.safetensors".to_owned(),
        ),
        (
            "a shard the manifest does not list",
            "model-99999-of-99999.safetensors".to_owned(),
        ),
    ] {
        let mut bad = index.clone();
        bad["weight_map"][&first.0] = serde_json::Value::from(file);
        rewrite_consistently(
            &dir,
            checkpoint::SHARD_INDEX,
            &serde_json::to_vec(&bad).unwrap(),
        );
        assert!(
            matches!(checkpoint::load(&dir), Err(TrainError::Checkpoint { .. })),
            "{what}"
        );
    }
    rewrite_consistently(&dir, checkpoint::SHARD_INDEX, &original);
    assert!(checkpoint::load(&dir).is_ok());
    // A shard changed after the save: its checksum no longer matches the manifest.
    let shard = dir.join("model-00001-of-00005.safetensors");
    let shard = if shard.exists() {
        shard
    } else {
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains("-of-"))
            .collect();
        names.sort();
        names.remove(0)
    };
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    assert!(matches!(
        checkpoint::load(&dir),
        Err(TrainError::Checkpoint { .. })
    ));
}

/// A run holds its checkpoint root: a second run saving there (a requeued job whose first
/// instance still runs) is refused before it trains, whether it starts fresh or resumes, and
/// the root is free again once the holder is gone.
#[test]
fn a_root_another_run_holds_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let o = TrainOptions {
        save: Some((dir.path().to_path_buf(), 1)),
        stop_after: Some(2),
        ..tiny(3)
    };
    train(&o, |_| {}).unwrap();
    let held = checkpoint::lock_root(dir.path()).unwrap();
    assert!(held.is_some(), "this file system locks");
    let resume = TrainOptions {
        resume_from: Some(dir.path().to_path_buf()),
        stop_after: None,
        ..o.clone()
    };
    let other = tempfile::tempdir().unwrap();
    let fresh = TrainOptions {
        save: Some((dir.path().to_path_buf(), 1)),
        ..tiny(1)
    };
    for (what, opts) in [("a resume", &resume), ("a fresh run", &fresh)] {
        let e = train(opts, |_| panic!("{what} trained")).unwrap_err();
        assert!(
            matches!(&e, TrainError::Checkpoint { .. }) && e.to_string().contains("another run"),
            "{what}: {e}"
        );
    }
    // Consolidating into it is refused the same way (before its source is even read).
    let e = headroom_trainer::zero_checkpoint::consolidate(other.path(), dir.path()).unwrap_err();
    assert!(e.to_string().contains("another run"), "{e}");
    drop(held);
    assert_eq!(step_dirs(dir.path()), vec![1, 2]);
    train(&resume, |_| {}).unwrap();
    assert_eq!(step_dirs(dir.path()).last(), Some(&3));
}

/// A `model.safetensors` added beside a sharded checkpoint's verified shards (which the
/// Hugging Face reader would prefer, as transformers does) is refused by a resume, not read.
#[test]
fn a_single_model_file_beside_the_shards_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    for (dir, shard) in [(&root, 64 << 10), (&other, checkpoint::MAX_SHARD_BYTES)] {
        train(
            &TrainOptions {
                save: Some((dir.path().to_path_buf(), 100)),
                max_shard_bytes: shard,
                ..tiny(1)
            },
            |_| {},
        )
        .unwrap();
    }
    let (_, dir) = checkpoint::list(root.path()).unwrap().pop().unwrap();
    let (_, single) = checkpoint::list(other.path()).unwrap().pop().unwrap();
    let cpu = headroom_tensor::Cpu::new();
    let read = |dir: &Path| checkpoint::ResumePoint::open(dir)?.read_masters(&cpu);
    assert!(read(&dir).is_ok());
    std::fs::copy(
        single.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let e = read(&dir).unwrap_err();
    assert!(
        matches!(&e, TrainError::Checkpoint { .. })
            && e.to_string().contains("not in the manifest"),
        "{e}"
    );
}

/// Resuming reads the model and the moments straight from their files
/// (`checkpoint::ResumePoint`, never both files' bytes in memory at once): the masters are
/// `checkpoint::load`'s bit for bit, and a flipped byte, a missing byte or an extra byte in
/// either file is refused by the run — as is a consistently rewritten moments file of another
/// length, before anything is allocated for it.
#[test]
fn resuming_refuses_a_corrupt_model_or_optimizer_file() {
    let (dir, o) = trained_with_checkpoints(3, 1);
    let s2 = dir.path().join("step-00000002");
    let point = checkpoint::ResumePoint::open(&s2).unwrap();
    let cpu = headroom_tensor::Cpu::new();
    let masters: Vec<Vec<f32>> = point
        .read_masters(&cpu)
        .unwrap()
        .iter()
        .map(|t| t.as_slice::<f32>().unwrap().to_vec())
        .collect();
    assert_eq!(masters, checkpoint::load(&s2).unwrap().params);

    let resume = |from: &Path| {
        let o = TrainOptions {
            save: None,
            resume_from: Some(from.to_path_buf()),
            ..o.clone()
        };
        train(&o, |_| {})
    };
    assert!(resume(&s2).is_ok());
    type Mutation = fn(&mut Vec<u8>);
    let mutations: [(&str, Mutation); 3] = [
        ("flipped", |b| {
            let mid = b.len() / 2;
            b[mid] ^= 0x10;
        }),
        ("truncated", |b| {
            b.pop();
        }),
        ("extended", |b| b.push(0)),
    ];
    for name in ["model.safetensors", "optimizer.bin"] {
        for (what, mutate) in mutations {
            let copy = tempfile::tempdir().unwrap();
            for f in std::fs::read_dir(&s2).unwrap() {
                let f = f.unwrap().path();
                std::fs::copy(&f, copy.path().join(f.file_name().unwrap())).unwrap();
            }
            let path = copy.path().join(name);
            let mut bytes = std::fs::read(&path).unwrap();
            mutate(&mut bytes);
            std::fs::write(&path, &bytes).unwrap();
            match resume(copy.path()) {
                Err(e) => assert!(e.to_string().contains(name), "{name} {what}: {e}"),
                Ok(_) => panic!("{name} {what}: resumed"),
            }
        }
    }
    // An optimizer state sized for another model, consistently resealed: refused when the
    // checkpoint is opened, before anything is allocated from its sizes.
    let copy = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&s2).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, copy.path().join(f.file_name().unwrap())).unwrap();
    }
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(copy.path().join("state.json")).unwrap()).unwrap();
    state["optimizer"]["params"][0]["numel"] = serde_json::json!(1u64 << 40);
    rewrite_consistently(
        copy.path(),
        "state.json",
        &serde_json::to_vec(&state).unwrap(),
    );
    let e = checkpoint::ResumePoint::open(copy.path()).err().unwrap();
    assert!(e.to_string().contains("optimizer state for"), "{e}");
    assert!(resume(copy.path()).is_err());
    // Moments of another length whose manifest entry agrees: refused by their length.
    let copy = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&s2).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, copy.path().join(f.file_name().unwrap())).unwrap();
    }
    rewrite_consistently(copy.path(), "optimizer.bin", &[0u8; 24]);
    let e = resume(copy.path()).err().unwrap();
    assert!(e.to_string().contains("moment bytes"), "{e}");
}

/// A checkpoint's JSON file that is a symlink to a device reports a length of 0 whatever it
/// yields: it is refused at once, not read until memory runs out (here a ZeRO checkpoint's
/// zero.json, which is read bounded before the manifest's size check).
#[cfg(unix)]
#[test]
fn a_json_file_that_is_a_device_is_refused_without_reading_it() {
    use headroom_trainer::zero_checkpoint::{self, ZERO_STATE};
    let dir = tempfile::tempdir().unwrap();
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        step: 1,
        files: vec![checkpoint::ManifestFile {
            name: ZERO_STATE.into(),
            bytes: 100,
            xxh3: "0".repeat(16),
        }],
    };
    std::fs::write(
        dir.path().join(MANIFEST),
        serde_json::to_vec(&manifest).unwrap(),
    )
    .unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.path().join(ZERO_STATE)).unwrap();
    match zero_checkpoint::load(dir.path()) {
        Err(e @ TrainError::Checkpoint { .. }) => {
            let message = e.to_string();
            assert!(
                message.contains(ZERO_STATE) && message.contains("not a regular file"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
}
