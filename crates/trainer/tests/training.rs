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
    let floor = report.entropy_floor;
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
