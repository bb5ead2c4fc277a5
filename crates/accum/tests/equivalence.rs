//! Accumulated gradients equal the big-batch gradients, for random linear and MLP problems and
//! random uneven splits and loss masks; and the naive mean-of-means does not.
//!
//! Stated tolerance (see `support::BigBatch::tolerance`): per element,
//! `|accumulated − big| ≤ 4·(tokens + outputs + 8)·ε_f32·Σ|terms|`, where `Σ|terms|` is the same
//! gradient computed with every factor replaced by its absolute value — twice the classical
//! worst-case bound of f32 recursive summation, since both sides carry rounding. Losses are
//! summed in f64 and must agree to `1e-12` relative.

mod support;

use headroom_accum::{GradAccumulator, MicroBatchPlan, NoLossScaling, SplitBy, StepTokens};
use headroom_tensor::{bf16, f16, reference, Backend, Cpu, CpuTensor, DType, Tensor};
use proptest::prelude::*;
use support::{download_all, random_problem, ModelKind, Problem};

fn kind(mlp: bool) -> ModelKind {
    if mlp {
        ModelKind::MlpCrossEntropy
    } else {
        ModelKind::LinearMse
    }
}

#[derive(Clone, Copy, Debug)]
enum Path {
    /// Gradients of the summed loss; the accumulator weights them.
    Summed,
    /// Gradients seeded with `1/total` by the caller.
    Prescaled,
    /// Backward adds straight into the buffers.
    InPlace,
}

/// Accumulate `p` over `ranges`, returning the gradients and the reported loss.
fn accumulate(
    cpu: &Cpu,
    p: &Problem,
    ranges: &[std::ops::Range<usize>],
    path: Path,
) -> (Vec<Vec<f32>>, f64) {
    let mut acc = GradAccumulator::new(cpu.clone(), p.model.param_shapes()).unwrap();
    let total: u64 = p.batch.iter().map(|s| s.counted()).sum();
    acc.begin_step(StepTokens::single_device(total).unwrap())
        .unwrap();
    let weight = acc.step_tokens().unwrap().loss_grad_weight();
    for r in ranges {
        let fwd = p.model.forward(cpu, &p.batch[r.clone()]);
        match path {
            Path::Summed => {
                let g = p.model.backward(cpu, &fwd.saved, 1.0);
                acc.accumulate(&g, fwd.stats).unwrap();
            }
            Path::Prescaled => {
                let g = p.model.backward(cpu, &fwd.saved, weight);
                acc.accumulate_prescaled(&g, fwd.stats).unwrap();
            }
            Path::InPlace => acc
                .accumulate_in_place(fwd.stats, |_, bufs: &mut [CpuTensor], w| {
                    let mut slices: Vec<&mut [f32]> = bufs
                        .iter_mut()
                        .map(|b| b.as_mut_slice::<f32>().unwrap())
                        .collect();
                    p.model.backward_add(&fwd.saved, w, &mut slices, None);
                    Ok::<_, std::convert::Infallible>(())
                })
                .unwrap(),
        }
    }
    let report = acc.finish_step(&mut NoLossScaling, None).unwrap();
    assert!(report.outcome.is_applied());
    assert_eq!(report.micro_batches, ranges.len());
    assert_eq!(report.counted_tokens, total);
    (download_all(cpu, acc.gradients()), report.loss)
}

fn assert_loss_eq(got: f64, big: f64) -> Result<(), TestCaseError> {
    prop_assert!(
        (got - big).abs() <= 1e-12 * big.abs().max(1.0),
        "loss {got} vs big batch {big}"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn accumulated_equals_big_batch(
        seed in any::<u64>(), mlp in any::<bool>(), n_seqs in 1usize..10, max_len in 1usize..9,
        path_index in 0usize..3,
    ) {
        let cpu = Cpu::new();
        let p = random_problem(&cpu, seed, kind(mlp), n_seqs, max_len);
        let big = p.model.big_batch(&cpu, &p.batch);
        let path = [Path::Summed, Path::Prescaled, Path::InPlace][path_index];
        let (grads, loss) = accumulate(&cpu, &p, &p.split, path);
        let worst = big.worst_ratio(&grads);
        prop_assert!(worst <= 1.0, "{path:?}: error is {worst}× the stated tolerance");
        assert_loss_eq(loss, big.loss)?;
    }

    #[test]
    fn token_budget_plans_equal_big_batch(
        seed in any::<u64>(), mlp in any::<bool>(), n_seqs in 1usize..10, extra_budget in 0usize..20,
    ) {
        let cpu = Cpu::new();
        let p = random_problem(&cpu, seed, kind(mlp), n_seqs, 8);
        let masks: Vec<&[bool]> = p.batch.iter().map(|s| s.mask.as_slice()).collect();
        let plan = MicroBatchPlan::from_loss_masks(&masks, SplitBy::TokenBudget(8 + extra_budget)).unwrap();
        let ranges: Vec<_> = plan.micro_batches().iter().map(|m| m.sequences.clone()).collect();
        let big = p.model.big_batch(&cpu, &p.batch);
        prop_assert_eq!(plan.counted_tokens(), big.counted_tokens);
        let (grads, loss) = accumulate(&cpu, &p, &ranges, Path::Summed);
        prop_assert!(big.worst_ratio(&grads) <= 1.0);
        assert_loss_eq(loss, big.loss)?;
    }

    /// Two "devices" each accumulate their half with the global count; summing their buffers
    /// (the all-reduce) and their losses gives the big batch.
    #[test]
    fn data_parallel_sums_counts_then_gradients(
        seed in any::<u64>(), mlp in any::<bool>(), n_seqs in 2usize..10, cut in 1usize..9,
    ) {
        let cpu = Cpu::new();
        let p = random_problem(&cpu, seed, kind(mlp), n_seqs, 6);
        let cut = cut.min(n_seqs - 1);
        let halves = [0..cut, cut..n_seqs];
        let local: Vec<u64> =
            halves.iter().map(|h| p.batch[h.clone()].iter().map(|s| s.counted()).sum()).collect();
        let global = local.iter().sum();
        let mut sum: Vec<Vec<f32>> = Vec::new();
        let mut loss = 0.0;
        for (h, &l) in halves.iter().zip(&local) {
            let mut acc = GradAccumulator::new(cpu.clone(), p.model.param_shapes()).unwrap();
            acc.begin_step(StepTokens::data_parallel(l, global).unwrap()).unwrap();
            for s in h.clone() {
                let fwd = p.model.forward(&cpu, &p.batch[s..s + 1]);
                let g = p.model.backward(&cpu, &fwd.saved, 1.0);
                acc.accumulate(&g, fwd.stats).unwrap();
            }
            let report = acc.finish_step(&mut NoLossScaling, None).unwrap();
            loss += report.loss;
            let g = download_all(&cpu, acc.gradients());
            if sum.is_empty() {
                sum = g;
            } else {
                for (a, b) in sum.iter_mut().zip(g) {
                    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                }
            }
        }
        let big = p.model.big_batch(&cpu, &p.batch);
        prop_assert!(big.worst_ratio(&sum) <= 1.0);
        assert_loss_eq(loss, big.loss)?;
    }

    /// Gradients arriving in bf16/f16 are widened exactly and added with one f32 rounding per
    /// element: the buffers equal the scalar reference `Σ_k ref::axpy(1/total, g_k)` bit for bit.
    #[test]
    fn half_precision_gradients_match_reference_axpy(
        seed in any::<u64>(), mlp in any::<bool>(), n_seqs in 1usize..8, half in any::<bool>(),
    ) {
        let cpu = Cpu::new();
        let p = random_problem(&cpu, seed, kind(mlp), n_seqs, 6);
        let dtype = if half { DType::F16 } else { DType::BF16 };
        let total: u64 = p.batch.iter().map(|s| s.counted()).sum();
        let mut acc = GradAccumulator::new(cpu.clone(), p.model.param_shapes()).unwrap();
        acc.begin_step(StepTokens::single_device(total).unwrap()).unwrap();
        let alpha = (1.0 / total as f64) as f32;
        let mut expected: Vec<Vec<f32>> =
            p.model.param_shapes().iter().map(|s| vec![0f32; s.numel()]).collect();
        for r in &p.split {
            let fwd = p.model.forward(&cpu, &p.batch[r.clone()]);
            let g32 = p.model.backward(&cpu, &fwd.saved, 1.0);
            let mut low = Vec::new();
            for (g, e) in g32.iter().zip(expected.iter_mut()) {
                let mut h = cpu.zeros(g.shape().clone(), dtype).unwrap();
                cpu.cast(g, &mut h).unwrap();
                *e = if half {
                    reference::axpy(alpha, h.as_slice::<f16>().unwrap(), e)
                } else {
                    reference::axpy(alpha, h.as_slice::<bf16>().unwrap(), e)
                };
                low.push(h);
            }
            acc.accumulate(&low, fwd.stats).unwrap();
        }
        acc.finish_step(&mut NoLossScaling, None).unwrap();
        let got = download_all(&cpu, acc.gradients());
        for (g, e) in got.iter().zip(&expected) {
            prop_assert_eq!(
                g.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                e.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}

/// The popular fix-up — average each micro-batch's mean loss over the micro-batches — is wrong
/// as soon as micro-batches count different numbers of tokens. On the same uneven splits that
/// pass above, its gradient is off by far more than the stated tolerance; this keeps the
/// equivalence property from being vacuous.
#[test]
fn mean_of_means_differs_measurably_on_uneven_splits() {
    let cpu = Cpu::new();
    for seed in 0..8u64 {
        for mlp in [false, true] {
            let mut p = random_problem(&cpu, seed, kind(mlp), 6, 6);
            let mut rng = support::Rng::new(seed + 100);
            // Two micro-batches with very different counted tokens: one sparse, one dense.
            p.batch = vec![
                p.model.random_sequence(8, 0.0, &mut rng),
                p.model.random_sequence(8, 1.0, &mut rng),
                p.model.random_sequence(8, 1.0, &mut rng),
            ];
            p.batch[0].mask[3] = true;
            let split = [0..1, 1..3];
            let big = p.model.big_batch(&cpu, &p.batch);

            let k = split.len() as f32;
            let mut mom: Vec<Vec<f32>> = p
                .model
                .param_shapes()
                .iter()
                .map(|s| vec![0f32; s.numel()])
                .collect();
            for r in &split {
                let fwd = p.model.forward(&cpu, &p.batch[r.clone()]);
                let seed_w = 1.0 / (fwd.stats.counted_tokens as f32 * k);
                let g = download_all(&cpu, &p.model.backward(&cpu, &fwd.saved, seed_w));
                for (m, g) in mom.iter_mut().zip(g) {
                    m.iter_mut().zip(g).for_each(|(m, g)| *m += g);
                }
            }
            let (exact, _) = accumulate(&cpu, &p, &split, Path::Summed);
            assert!(big.worst_ratio(&exact) <= 1.0);
            let wrong = big.worst_ratio(&mom);
            assert!(
                wrong > 1e3,
                "seed {seed} mlp {mlp}: mean-of-means only {wrong}× tolerance off"
            );
            // And the relative error is large in plain terms too (1 counted token vs 16).
            let (num, den) = mom
                .iter()
                .flatten()
                .zip(big.grads.iter().flatten())
                .fold((0f64, 0f64), |(n, d), (&m, &b)| {
                    (n + f64::from(m - b).powi(2), d + f64::from(b).powi(2))
                });
            assert!(
                (num / den).sqrt() > 0.05,
                "relative error {}",
                (num / den).sqrt()
            );
        }
    }
}

/// With the whole batch as one micro-batch, the summed path must give bit for bit the summed
/// gradient times `1/total` (one f32 product per element): this pins the weighting exactly.
#[test]
fn single_micro_batch_is_the_summed_gradient_times_weight() {
    let cpu = Cpu::new();
    let p = random_problem(&cpu, 7, ModelKind::MlpCrossEntropy, 5, 6);
    let whole = 0..p.batch.len();
    let (grads, _) = accumulate(&cpu, &p, std::slice::from_ref(&whole), Path::Summed);
    let fwd = p.model.forward(&cpu, &p.batch);
    // Computed here, not taken from the accumulator, so a wrong weight there is caught.
    let w = (1.0 / fwd.stats.counted_tokens as f64) as f32;
    let summed = download_all(&cpu, &p.model.backward(&cpu, &fwd.saved, 1.0));
    for (g, s) in grads.iter().zip(&summed) {
        let expected = reference::axpy(w, s, &vec![0f32; s.len()]);
        assert_eq!(g, &expected);
    }
}
