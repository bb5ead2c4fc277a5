//! `--lr-schedule` against llm.c's own schedulers: `fixtures/llmc_lr_schedules.json` holds the
//! learning rates that llm.c's `llmc/schedulers.h` computed (written by
//! `benches/torch/make_lr_schedule_fixture.py`, which compiles that header into a small driver).
//! llm.c computes in f32 and headroom in f64, so the two agree within f32's rounding of the
//! peak rate, not bit for bit; an off-by-one step anywhere (the warmup's `step + 1`, wsd's turn
//! at `(int)(0.8f * steps)`, the decay's span) moves a rate by far more.

use headroom_trainer::train::{LrSchedule, TrainOptions};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    scheduler: String,
    lr: f64,
    warmup: usize,
    steps: usize,
    final_frac: f64,
    /// `[step, llm.c's learning rate]`.
    at: Vec<(usize, f64)>,
}

/// Within this many times the peak rate: f32 carries 2⁻²⁴ ≈ 6e-8 of it per rounding, and a
/// rate goes through a handful (`cosf` included). The committed fixture's worst is 1.3e-7.
const TOLERANCE: f64 = 5e-7;

#[test]
fn every_schedule_gives_llmc_s_learning_rates() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/llmc_lr_schedules.json"
    ))
    .unwrap();
    let fixture: Fixture = serde_json::from_str(&text).unwrap();
    let mut seen = Vec::new();
    let mut compared = 0;
    for case in &fixture.cases {
        let schedule = match case.scheduler.as_str() {
            "cosine" => LrSchedule::Cosine,
            "linear" => LrSchedule::Linear,
            "constant" => LrSchedule::Constant,
            "wsd" => LrSchedule::Wsd,
            other => panic!("a scheduler headroom lacks: {other}"),
        };
        let o = TrainOptions {
            lr: case.lr,
            warmup: case.warmup,
            steps: case.steps,
            min_lr_frac: case.final_frac,
            lr_schedule: schedule,
            ..TrainOptions::tiny_default()
        };
        let mut worst = 0.0f64;
        for &(step, want) in &case.at {
            let got = o.lr_at(step);
            let err = (got - want).abs() / case.lr;
            assert!(
                err <= TOLERANCE,
                "{} lr {} warmup {} steps {} floor {}: step {step}: headroom {got}, llm.c {want}",
                case.scheduler,
                case.lr,
                case.warmup,
                case.steps,
                case.final_frac
            );
            worst = worst.max(err);
            compared += 1;
        }
        eprintln!(
            "{:>8} steps {:>6}: {} rates, worst difference {worst:.2e} of the peak",
            case.scheduler,
            case.steps,
            case.at.len()
        );
        seen.push(schedule);
    }
    for s in LrSchedule::ALL {
        assert!(seen.contains(&s), "the fixture has no {} case", s.name());
    }
    assert!(compared > 1000, "only {compared} rates compared");
}
