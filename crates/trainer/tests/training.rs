//! End-to-end training on the synthetic source: reproducible, and it learns the source down
//! to its entropy floor.

use headroom_trainer::train::{train, DataSource, TrainOptions};

#[test]
fn same_seed_same_losses_bit_for_bit() {
    let o = TrainOptions {
        steps: 12,
        ..TrainOptions::tiny_default()
    };
    let a: Vec<u32> = train(&o, |_| {})
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss.to_bits())
        .collect();
    let b: Vec<u32> = train(&o, |_| {})
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss.to_bits())
        .collect();
    assert_eq!(a, b);
    let other = TrainOptions { seed: 7, ..o };
    let c: Vec<u32> = train(&other, |_| {})
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss.to_bits())
        .collect();
    assert_ne!(a, c, "the seed must matter");
}

#[test]
fn default_run_reaches_within_5_percent_of_the_entropy_floor() {
    let o = TrainOptions::tiny_default();
    let report = train(&o, |_| {}).unwrap();
    let first = report.steps[0].loss as f64;
    let last = report.final_loss(20);
    let floor = report.entropy_floor.unwrap();
    eprintln!("loss {first:.4} -> {last:.4}, floor {floor:.4}");
    assert!(
        last >= floor * 0.97,
        "below the entropy floor: {last} < {floor}: the loss is wrong"
    );
    assert!(
        last <= floor * 1.05,
        "{last} is not within 5% of the floor {floor}"
    );
    // Peaks come from the tracker: parameters, gradients and f32 Adam state are all there.
    let cpu = report.memory.device(headroom_tensor::Device::Cpu).unwrap();
    let params = cpu.peak[headroom_tensor::MemoryCategory::Parameters];
    assert!(params > 0);
    assert_eq!(cpu.peak[headroom_tensor::MemoryCategory::Gradients], params);
    assert_eq!(
        cpu.peak[headroom_tensor::MemoryCategory::OptimizerState],
        2 * params
    );
}

#[test]
fn a_budget_too_small_fails_with_the_trackers_report() {
    let o = TrainOptions {
        steps: 2,
        budget: Some(2 << 20),
        ..TrainOptions::tiny_default()
    };
    let err = train(&o, |_| {}).unwrap_err();
    let mut chain = vec![err.to_string()];
    let mut s = std::error::Error::source(&err);
    while let Some(e) = s {
        chain.push(e.to_string());
        s = e.source();
    }
    assert!(
        chain.iter().any(|m| m.contains("budget")),
        "error chain does not explain the budget: {chain:?}"
    );
}

#[test]
fn interrupted_then_resumed_run_reproduces_the_uninterrupted_losses() {
    let dir = tempfile::tempdir().unwrap();
    let base = TrainOptions {
        steps: 12,
        ..TrainOptions::tiny_default()
    };
    let full: Vec<u32> = train(&base, |_| {})
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss.to_bits())
        .collect();

    // Checkpoint every 5 steps, "killed" after 7: the last checkpoint holds 5 steps.
    let interrupted = TrainOptions {
        save: Some((dir.path().to_path_buf(), 5)),
        stop_after: Some(7),
        ..base.clone()
    };
    let first = train(&interrupted, |_| {}).unwrap();
    assert_eq!(first.steps.len(), 7);
    let resumed = TrainOptions {
        resume_from: Some(dir.path().to_path_buf()),
        ..base.clone()
    };
    let rest: Vec<u32> = train(&resumed, |_| {})
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss.to_bits())
        .collect();
    assert_eq!(rest.len(), 7, "steps 5..12");
    assert_eq!(
        &full[5..],
        &rest[..],
        "resumed losses differ from the uninterrupted run"
    );
}

#[test]
fn checkpoint_uses_hugging_face_names_and_layouts_and_rejects_corruption() {
    use headroom_trainer::checkpoint;
    let dir = tempfile::tempdir().unwrap();
    let o = TrainOptions {
        steps: 2,
        save: Some((dir.path().to_path_buf(), 2)),
        ..TrainOptions::tiny_default()
    };
    train(&o, |_| {}).unwrap();
    let step_dir = dir.path().join("step-00000002");
    let bytes = std::fs::read(step_dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let c = o.model.channels;
    assert_eq!(
        st.tensor("h.0.attn.c_attn.weight").unwrap().shape(),
        &[c, 3 * c]
    );
    assert_eq!(
        st.tensor("h.1.mlp.c_proj.weight").unwrap().shape(),
        &[4 * c, c]
    );
    assert_eq!(
        st.tensor("wte.weight").unwrap().shape(),
        &[o.model.vocab, c]
    );
    assert_eq!(st.tensor("ln_f.bias").unwrap().shape(), &[c]);
    let ck = checkpoint::load(dir.path()).unwrap();
    assert_eq!(ck.state.step, 2);

    // Truncated model file: a typed checkpoint error, not a panic.
    std::fs::write(
        step_dir.join("model.safetensors"),
        &bytes[..bytes.len() / 2],
    )
    .unwrap();
    assert!(matches!(
        checkpoint::load(dir.path()),
        Err(headroom_trainer::TrainError::Checkpoint { .. })
    ));
    std::fs::remove_file(step_dir.join("state.json")).unwrap();
    assert!(checkpoint::load(dir.path()).is_err());
}

/// The exported checkpoint loads in Hugging Face transformers (`GPT2LMHeadModel`) and computes
/// the same loss as headroom's forward. Needs a Python with torch and transformers:
/// `HEADROOM_PYTHON=/path/to/python cargo test -p headroom-trainer -- --ignored hugging_face`.
#[test]
#[ignore = "needs a Python with torch and transformers (HEADROOM_PYTHON)"]
fn hugging_face_transformers_loads_the_checkpoint_with_the_same_loss() {
    use headroom_tensor::Cpu;
    use headroom_trainer::model::{Geometry, Model, ModelOptions};
    let dir = tempfile::tempdir().unwrap();
    let o = TrainOptions {
        steps: 3,
        save: Some((dir.path().to_path_buf(), 3)),
        ..TrainOptions::tiny_default()
    };
    train(&o, |_| {}).unwrap();
    let ck = headroom_trainer::checkpoint::load(dir.path()).unwrap();
    let cpu = Cpu::new();
    let masters = ck
        .params
        .iter()
        .zip(headroom_trainer::model::params::param_infos(&o.model))
        .map(|(p, i)| {
            use headroom_tensor::Backend;
            cpu.upload(p, i.shape.clone()).unwrap()
        })
        .collect();
    let gpt = Model::from_masters(&cpu, o.model, ModelOptions::default(), masters).unwrap();
    let g = Geometry::new(2, 32);
    let tokens: Vec<u32> = (0..64).map(|i| (i * 7 + 3) % 64).collect();
    let targets: Vec<u32> = (0..64).map(|i| (i * 5 + 1) % 64).collect();
    let loss = gpt.loss(&tokens, &targets, g).unwrap();
    let rows = |v: &[u32]| v.chunks(32).map(|c| c.to_vec()).collect::<Vec<_>>();
    let batch =
        serde_json::json!({"tokens": rows(&tokens), "targets": rows(&targets), "loss": loss});
    let batch_path = dir.path().join("batch.json");
    std::fs::write(&batch_path, batch.to_string()).unwrap();
    // transformers reads one step's directory (config.json + model.safetensors), not the
    // save root that holds the `step-*` directories.
    let step_dir = headroom_trainer::checkpoint::resolve(dir.path()).unwrap();
    assert!(step_dir.join("config.json").is_file());
    let python = std::env::var("HEADROOM_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../scripts/check_hf_export.py"
        ))
        .arg(&step_dir)
        .arg(&batch_path)
        .output()
        .unwrap();
    eprintln!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "transformers disagrees or could not run"
    );
}

/// Validation: a fixed set of windows (the same at every evaluation and in every run), a loss
/// that falls as the model trains, and the last one in the report.
#[test]
fn validation_loss_is_on_fixed_windows_and_falls() {
    use headroom_trainer::train::EvalOptions;
    let dir = tempfile::tempdir().unwrap();
    let val = dir.path().join("val.bin");
    let spec = headroom_mmap_data::SynthSpec {
        vocab: 64,
        branching: 4,
        tokens: 20_000,
        chain_seed: 1337,
        stream_seed: 99,
        format: headroom_mmap_data::TokenFileFormat::Llmc(headroom_mmap_data::LlmcFlavor::Gpt2),
    };
    headroom_mmap_data::synthesize(&spec, &val).unwrap();
    let run = |every: usize| {
        let o = TrainOptions {
            steps: 40,
            batch: 8,
            eval: Some(EvalOptions {
                sets: vec![DataSource::File(val.clone())],
                every,
                batches: 4,
            }),
            ..TrainOptions::tiny_default()
        };
        train(&o, |_| {}).unwrap()
    };
    let a = run(5);
    let b = run(10);
    let val_at = |r: &headroom_trainer::train::TrainReport, step: usize| {
        r.steps[step]
            .val_loss
            .unwrap_or_else(|| panic!("no eval at {step}"))
    };
    // Same windows: the shared evaluations agree bit for bit.
    assert_eq!(val_at(&a, 9).to_bits(), val_at(&b, 9).to_bits());
    assert_eq!(val_at(&a, 39).to_bits(), val_at(&b, 39).to_bits());
    assert!(a.steps[5].val_loss.is_none() && a.steps[4].val_loss.is_some());
    assert!(
        val_at(&a, 39) < val_at(&a, 4) - 0.3,
        "{} → {}",
        val_at(&a, 4),
        val_at(&a, 39)
    );
    let (last, tokens) = a.val_loss.unwrap();
    assert_eq!(last.to_bits(), val_at(&a, 39).to_bits());
    assert_eq!(tokens, 4 * 8 * 64);
}

/// The forward-only loss (evaluation) is bit for bit the loss a training step reports, in
/// every precision and with the fused loss, and allocates no gradient.
#[test]
fn forward_only_loss_equals_the_training_loss_and_allocates_no_gradient() {
    use headroom_ckpt::Schedule;
    use headroom_tensor::{Cpu, MemoryCategory};
    use headroom_trainer::model::{params, Geometry, Model, ModelConfig, ModelOptions, Precision};
    let cfg = ModelConfig::tiny(64);
    let g = Geometry::new(2, 32);
    let tokens: Vec<u32> = (0..64).map(|i| (i * 7 + 3) % 64).collect();
    let targets: Vec<u32> = (0..64).map(|i| (i * 5 + 1) % 64).collect();
    for (precision, chunk) in [
        (Precision::Fp32, None),
        (Precision::Bf16, Some(24)),
        (Precision::Fp16, Some(64)),
    ] {
        let tracker = std::sync::Arc::new(headroom_profiler::MemoryTracker::new());
        let cpu = Cpu::new().with_alloc_hook(tracker.clone());
        let opts = ModelOptions {
            precision,
            loss_chunk: chunk,
            ..Default::default()
        };
        let gpt = Model::new(&cpu, cfg, opts, 3).unwrap();
        tracker.reset_peak();
        let eval = gpt.loss(&tokens, &targets, g).unwrap();
        let snap = tracker.snapshot();
        let dev = snap.device(headroom_tensor::Device::Cpu).unwrap();
        assert_eq!(dev.peak[MemoryCategory::Gradients], 0, "{precision:?}");
        let mut grads = params::alloc_like_params(&cpu, &cfg, MemoryCategory::Gradients).unwrap();
        let (train_loss, _) = gpt
            .forward_backward(
                &tokens,
                &targets,
                g,
                &mut grads,
                1.0 / 64.0,
                &Schedule::store_all(cfg.layers).unwrap(),
            )
            .unwrap();
        assert_eq!(
            eval.to_bits(),
            train_loss.to_bits(),
            "{precision:?} {chunk:?}"
        );
    }
}
