//! End-to-end training on the synthetic source: reproducible, and it learns the source down
//! to its entropy floor.

use headroom_trainer::train::{train, TrainOptions};

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
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
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
        dir.path().join("model.safetensors"),
        &bytes[..bytes.len() / 2],
    )
    .unwrap();
    assert!(matches!(
        checkpoint::load(dir.path()),
        Err(headroom_trainer::TrainError::Checkpoint { .. })
    ));
    std::fs::remove_file(dir.path().join("state.json")).unwrap();
    assert!(checkpoint::load(dir.path()).is_err());
}
