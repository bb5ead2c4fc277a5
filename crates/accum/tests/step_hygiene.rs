//! End-of-step hygiene: exact clipping, unscale exactly once per step, skipping non-finite
//! steps with the next step starting from zero, and typed errors that change nothing.

mod support;

use headroom_accum::{
    clip_grad_norm, global_grad_norm, AccumError, GradAccumulator, GradUnscaler, MicroBatchStats,
    NoLossScaling, StaticLossScale, StepOutcome, StepTokens,
};
use headroom_tensor::{reference, Backend, BoxedError, Cpu, CpuTensor, DType, Tensor};
use proptest::prelude::*;
use support::{download_all, random_problem, ModelKind, Problem, Rng};

fn random_tensors(cpu: &Cpu, rng: &mut Rng, count: usize, scale: f32) -> Vec<CpuTensor> {
    (0..count)
        .map(|_| {
            let n = 1 + rng.below(300);
            let data: Vec<f32> = (0..n).map(|_| rng.sym() * scale).collect();
            cpu.upload(&data, [n]).unwrap()
        })
        .collect()
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|t| t.iter().map(|x| x.to_bits()).collect())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Clipping multiplies by exactly `(max_norm / norm) as f32` when `norm > max_norm`, and
    /// touches nothing otherwise; the norm is the f64 reference norm.
    #[test]
    fn clipping_scales_by_exactly_max_over_norm(
        seed in any::<u64>(), count in 1usize..5, scale in 1e-3f32..1e3,
        // The boundary (max_norm == norm must not clip) is drawn often on purpose.
        ratio in prop_oneof![Just(1.0f64), Just(1.0 - 1e-12), Just(1.0 + 1e-12), 0.05f64..3.0],
    ) {
        let cpu = Cpu::new();
        let mut rng = Rng::new(seed);
        let mut grads = random_tensors(&cpu, &mut rng, count, scale);
        let before = download_all(&cpu, &grads);
        let reference_norm: f64 =
            before.iter().map(|g| reference::sum_squares(g)).sum::<f64>().sqrt();
        let norm = global_grad_norm(&cpu, &grads).unwrap();
        prop_assert!((norm - reference_norm).abs() <= 1e-12 * reference_norm);

        let max_norm = norm * ratio;
        let report = clip_grad_norm(&cpu, &mut grads, max_norm).unwrap();
        prop_assert_eq!(report.norm, norm);
        let after = download_all(&cpu, &grads);
        if norm > max_norm {
            let coef = (max_norm / norm) as f32;
            prop_assert_eq!(report.coefficient, Some(coef));
            let expected: Vec<Vec<f32>> =
                before.iter().map(|g| g.iter().map(|x| x * coef).collect()).collect();
            prop_assert_eq!(bits(&after), bits(&expected));
            let clipped = global_grad_norm(&cpu, &grads).unwrap();
            prop_assert!((clipped - max_norm).abs() <= 1e-6 * max_norm, "{clipped} vs {max_norm}");
        } else {
            prop_assert_eq!(report.coefficient, None);
            prop_assert_eq!(bits(&after), bits(&before));
        }
    }

    /// A planted non-finite value in one micro-batch's gradient (f32 or bf16) skips the step,
    /// zeroes the buffers, tells the scaler once; the next step starts from zero and equals a
    /// fresh accumulator's step bit for bit.
    #[test]
    fn planted_non_finite_skips_and_next_step_starts_from_zero(
        seed in any::<u64>(), mlp in any::<bool>(), n_seqs in 1usize..8, which in 0usize..3,
        bf16_grads in any::<bool>(), at in any::<prop::sample::Index>(), in_mb in any::<prop::sample::Index>(),
    ) {
        let cpu = Cpu::new();
        let kind = if mlp { ModelKind::MlpCrossEntropy } else { ModelKind::LinearMse };
        let p = random_problem(&cpu, seed, kind, n_seqs, 6);
        let planted = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN][which];
        let mut scaler = StaticLossScale::new(1024.0).unwrap();
        let mut acc = GradAccumulator::new(cpu.clone(), p.model.param_shapes()).unwrap();

        let bad_mb = in_mb.index(p.split.len());
        let report = run_step(&cpu, &p, &mut acc, &mut scaler, bf16_grads, Some((bad_mb, at, planted)));
        prop_assert_eq!(report.outcome, StepOutcome::Skipped);
        prop_assert_eq!((scaler.steps(), scaler.skipped()), (1, 1));
        for g in download_all(&cpu, acc.gradients()) {
            prop_assert!(g.iter().all(|v| v.to_bits() == 0), "buffers not cleared");
        }

        let next = run_step(&cpu, &p, &mut acc, &mut scaler, bf16_grads, None);
        prop_assert!(next.outcome.is_applied());
        prop_assert_eq!((scaler.steps(), scaler.skipped()), (2, 1));
        let mut fresh = GradAccumulator::new(cpu.clone(), p.model.param_shapes()).unwrap();
        let mut fresh_scaler = StaticLossScale::new(1024.0).unwrap();
        let clean = run_step(&cpu, &p, &mut fresh, &mut fresh_scaler, bf16_grads, None);
        prop_assert_eq!(next, clean);
        prop_assert_eq!(
            bits(&download_all(&cpu, acc.gradients())),
            bits(&download_all(&cpu, fresh.gradients()))
        );
    }
}

/// One step of `p` seeded with the scaler's scale, clipped at 0.5; `plant = (micro-batch,
/// position, value)` overwrites one gradient element of that micro-batch.
fn run_step(
    cpu: &Cpu,
    p: &Problem,
    acc: &mut GradAccumulator<Cpu>,
    scaler: &mut StaticLossScale,
    bf16_grads: bool,
    plant: Option<(usize, prop::sample::Index, f32)>,
) -> headroom_accum::StepReport {
    let total: u64 = p.batch.iter().map(|s| s.counted()).sum();
    acc.begin_step(StepTokens::single_device(total).unwrap())
        .unwrap();
    for (i, r) in p.split.iter().enumerate() {
        let fwd = p.model.forward(cpu, &p.batch[r.clone()]);
        let mut g = p.model.backward(cpu, &fwd.saved, scaler.scale());
        if let Some((mb, at, value)) = &plant {
            if *mb == i {
                let t = at.index(g.len());
                let s = g[t].as_mut_slice::<f32>().unwrap();
                let e = at.index(s.len());
                s[e] = *value;
            }
        }
        if bf16_grads {
            let low: Vec<CpuTensor> = g
                .iter()
                .map(|x| {
                    let mut h = cpu.zeros(x.shape().clone(), DType::BF16).unwrap();
                    cpu.cast(x, &mut h).unwrap();
                    h
                })
                .collect();
            g = low;
        }
        acc.accumulate(&g, fwd.stats).unwrap();
    }
    acc.finish_step(scaler, Some(0.5)).unwrap()
}

/// Records every call, to prove unscaling happens exactly once per step, after the last
/// micro-batch.
#[derive(Default)]
struct CountingUnscaler {
    inner: Option<StaticLossScale>,
    unscale_calls: usize,
    updates: Vec<bool>,
    fail: bool,
    fail_update: bool,
}

impl GradUnscaler<Cpu> for CountingUnscaler {
    fn unscale_and_check(&mut self, b: &Cpu, g: &mut [CpuTensor]) -> Result<bool, BoxedError> {
        self.unscale_calls += 1;
        if self.fail {
            return Err("scaler exploded".into());
        }
        self.inner.as_mut().unwrap().unscale_and_check(b, g)
    }
    fn update(&mut self, found: bool) -> Result<(), BoxedError> {
        self.updates.push(found);
        if self.fail_update {
            return Err("update refused".into());
        }
        Ok(())
    }
}

/// With a power-of-two loss scale, seeding the backward with `S` and unscaling once gives the
/// unscaled step bit for bit (every rounding is scale-invariant), and unscale runs once.
#[test]
fn loss_scale_unscales_once_per_step_and_is_exact() {
    let cpu = Cpu::new();
    let p = random_problem(&cpu, 11, ModelKind::MlpCrossEntropy, 8, 6);
    assert!(p.split.len() > 1 || p.batch.len() == 1);
    let total: u64 = p.batch.iter().map(|s| s.counted()).sum();
    let mut results = Vec::new();
    for scale in [1.0f32, 4096.0] {
        let mut acc = GradAccumulator::new(cpu.clone(), p.model.param_shapes()).unwrap();
        let mut unscaler = CountingUnscaler {
            inner: StaticLossScale::new(scale),
            ..Default::default()
        };
        for step in 0..3 {
            acc.begin_step(StepTokens::single_device(total).unwrap())
                .unwrap();
            for r in &p.split {
                let fwd = p.model.forward(&cpu, &p.batch[r.clone()]);
                let g = p.model.backward(&cpu, &fwd.saved, scale);
                acc.accumulate(&g, fwd.stats).unwrap();
                assert_eq!(
                    unscaler.unscale_calls, step,
                    "unscaled before the last micro-batch"
                );
            }
            let report = acc.finish_step(&mut unscaler, None).unwrap();
            assert!(report.outcome.is_applied());
            assert_eq!(unscaler.unscale_calls, step + 1);
            assert_eq!(unscaler.updates, vec![false; step + 1]);
        }
        results.push(bits(&download_all(&cpu, acc.gradients())));
    }
    assert_eq!(results[0], results[1]);
}

fn tiny(cpu: &Cpu) -> (GradAccumulator<Cpu>, Vec<CpuTensor>) {
    let acc = GradAccumulator::new(cpu.clone(), [vec![2, 3], vec![4]]).unwrap();
    let g = vec![
        cpu.upload(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3])
            .unwrap(),
        cpu.upload(&[1.0f32, -1.0, 1.0, -1.0], [4]).unwrap(),
    ];
    (acc, g)
}

fn stats(counted_tokens: u64) -> MicroBatchStats {
    MicroBatchStats {
        counted_tokens,
        loss_sum: counted_tokens as f64,
    }
}

#[test]
fn bad_input_is_typed_and_changes_nothing() {
    let cpu = Cpu::new();
    let (mut acc, g) = tiny(&cpu);
    assert!(matches!(
        acc.accumulate(&g, stats(1)),
        Err(AccumError::NoStepInProgress)
    ));
    assert!(matches!(
        acc.finish_step(&mut NoLossScaling, None),
        Err(AccumError::NoStepInProgress)
    ));
    acc.begin_step(StepTokens::single_device(4).unwrap())
        .unwrap();
    assert!(matches!(
        acc.begin_step(StepTokens::single_device(4).unwrap()),
        Err(AccumError::StepInProgress)
    ));
    acc.accumulate(&g, stats(1)).unwrap();
    let snapshot = download_all(&cpu, acc.gradients());

    assert!(matches!(
        acc.accumulate(&g[..1], stats(1)),
        Err(AccumError::GradientCount {
            expected: 2,
            got: 1
        })
    ));
    let transposed = cpu.upload(&[0.0f32; 6], [3, 2]).unwrap();
    assert!(matches!(
        acc.accumulate([&transposed, &g[1]], stats(1)),
        Err(AccumError::GradientShape { index: 0, .. })
    ));
    let ints = cpu.zeros([4], DType::U16).unwrap();
    assert!(matches!(
        acc.accumulate([&g[0], &ints], stats(1)),
        Err(AccumError::GradientDType {
            index: 1,
            dtype: DType::U16
        })
    ));
    assert!(matches!(
        acc.accumulate(&g, stats(4)),
        Err(AccumError::TokenCountExceeded {
            declared: 4,
            accumulated: 1,
            adding: 4
        })
    ));
    assert!(matches!(
        acc.accumulate_in_place(stats(1), |_, _, _| Err("backward failed")),
        Err(AccumError::Backward(_))
    ));
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            acc.finish_step(&mut NoLossScaling, Some(bad)),
            Err(AccumError::InvalidMaxNorm(_))
        ));
    }
    assert!(matches!(
        acc.finish_step(&mut NoLossScaling, None),
        Err(AccumError::TokenCountMismatch {
            declared: 4,
            accumulated: 1
        })
    ));
    assert_eq!(
        download_all(&cpu, acc.gradients()),
        snapshot,
        "an error changed the buffers"
    );

    // The step is still in progress and completes correctly once the missing tokens arrive.
    acc.accumulate(&g, stats(3)).unwrap();
    let report = acc.finish_step(&mut NoLossScaling, None).unwrap();
    assert_eq!(report.micro_batches, 2);
    assert_eq!(report.loss, 1.0);
    assert_eq!(
        download_all(&cpu, acc.gradients())[1],
        vec![0.5, -0.5, 0.5, -0.5]
    );
}

#[test]
fn constructor_and_token_errors() {
    let cpu = Cpu::new();
    assert!(matches!(
        GradAccumulator::new(cpu.clone(), Vec::<Vec<usize>>::new()),
        Err(AccumError::NoParameters)
    ));
    assert!(matches!(
        StepTokens::single_device(0),
        Err(AccumError::ZeroGlobalTokens)
    ));
    assert!(matches!(
        StepTokens::data_parallel(5, 4),
        Err(AccumError::LocalExceedsGlobal {
            local: 5,
            global: 4
        })
    ));
    let dp = StepTokens::data_parallel(0, 4).unwrap();
    assert_eq!(
        (dp.local(), dp.global(), dp.loss_grad_weight()),
        (0, 4, 0.25)
    );
    assert!(StaticLossScale::new(0.0).is_none());
    assert!(StaticLossScale::new(f32::INFINITY).is_none());
    assert!(matches!(
        clip_grad_norm(&cpu, &mut [cpu.zeros([2], DType::F32).unwrap()], -1.0),
        Err(AccumError::InvalidMaxNorm(_))
    ));
}

/// A device with no counted tokens in a data-parallel step still contributes (zero) gradients.
#[test]
fn device_with_no_tokens_finishes_with_zeros() {
    let cpu = Cpu::new();
    let (mut acc, g) = tiny(&cpu);
    acc.begin_step(StepTokens::single_device(2).unwrap())
        .unwrap();
    acc.accumulate(&g, stats(2)).unwrap();
    acc.finish_step(&mut NoLossScaling, None).unwrap();
    acc.begin_step(StepTokens::data_parallel(0, 7).unwrap())
        .unwrap();
    let report = acc.finish_step(&mut NoLossScaling, None).unwrap();
    assert_eq!(
        report.outcome,
        StepOutcome::Applied {
            grad_norm: 0.0,
            clip_coefficient: None
        }
    );
    assert!(download_all(&cpu, acc.gradients())
        .iter()
        .flatten()
        .all(|&v| v == 0.0));
}

#[test]
fn unscaler_failure_is_reported_and_step_can_be_abandoned() {
    let cpu = Cpu::new();
    let (mut acc, g) = tiny(&cpu);
    acc.begin_step(StepTokens::single_device(1).unwrap())
        .unwrap();
    acc.accumulate(&g, stats(1)).unwrap();
    let mut failing = CountingUnscaler {
        fail: true,
        ..Default::default()
    };
    assert!(matches!(
        acc.finish_step(&mut failing, None),
        Err(AccumError::Unscale(_))
    ));
    assert!(failing.updates.is_empty());
    assert!(acc.in_step());
    acc.abandon_step().unwrap();
    assert!(!acc.in_step());
    assert!(download_all(&cpu, acc.gradients())
        .iter()
        .flatten()
        .all(|&v| v == 0.0));
}

/// The accumulator's clipping goes through `finish_step` and reports the pre-clip norm.
#[test]
fn finish_step_clips_and_reports_pre_clip_norm() {
    let cpu = Cpu::new();
    let (mut acc, g) = tiny(&cpu);
    acc.begin_step(StepTokens::single_device(1).unwrap())
        .unwrap();
    acc.accumulate(&g, stats(1)).unwrap();
    let norm = (91.0f64 + 4.0).sqrt();
    let report = acc.finish_step(&mut NoLossScaling, Some(1.0)).unwrap();
    let coef = (1.0 / norm) as f32;
    assert_eq!(
        report.outcome,
        StepOutcome::Applied {
            grad_norm: norm,
            clip_coefficient: Some(coef)
        }
    );
    assert_eq!(
        download_all(&cpu, acc.gradients())[0],
        [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].map(|x| x * coef)
    );
    assert!((global_grad_norm(&cpu, acc.gradients()).unwrap() - 1.0).abs() < 1e-6);
}

/// A scaler that refuses `update` gets its error through, after the step completed.
#[test]
fn scaler_update_failure_comes_after_a_completed_step() {
    let cpu = Cpu::new();
    let (mut acc, g) = tiny(&cpu);
    acc.begin_step(StepTokens::single_device(1).unwrap())
        .unwrap();
    acc.accumulate(&g, stats(1)).unwrap();
    let mut refusing = CountingUnscaler {
        inner: StaticLossScale::new(2.0),
        fail_update: true,
        ..Default::default()
    };
    assert!(matches!(
        acc.finish_step(&mut refusing, None),
        Err(AccumError::ScalerUpdate(_))
    ));
    assert_eq!(
        (refusing.unscale_calls, refusing.updates.as_slice()),
        (1, &[false][..])
    );
    assert!(!acc.in_step());
    assert_eq!(
        download_all(&cpu, acc.gradients())[1],
        vec![0.5, -0.5, 0.5, -0.5]
    );
}

/// An applied step's gradients are cleared by the next `begin_step`: the same data gives the
/// same gradients step after step, not a running sum.
#[test]
fn each_step_starts_from_zero_after_an_applied_step() {
    let cpu = Cpu::new();
    let p = random_problem(&cpu, 3, ModelKind::LinearMse, 6, 5);
    let mut acc = GradAccumulator::new(cpu.clone(), p.model.param_shapes()).unwrap();
    let mut scaler = StaticLossScale::new(1.0).unwrap();
    let first = run_step(&cpu, &p, &mut acc, &mut scaler, false, None);
    let first_grads = bits(&download_all(&cpu, acc.gradients()));
    assert!(first_grads.iter().flatten().any(|&b| b != 0));
    for _ in 0..3 {
        assert_eq!(
            run_step(&cpu, &p, &mut acc, &mut scaler, false, None),
            first
        );
        assert_eq!(bits(&download_all(&cpu, acc.gradients())), first_grads);
    }
}
