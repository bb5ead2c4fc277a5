//! Property tests over random chains, schedules and budgets: bitwise-identical gradients,
//! measured peak = predicted peak ≤ budget, the planner never worse than fixed schedules,
//! Revolve's forward count = Griewank's binomial formula, and invalid schedules rejected.

use std::sync::Arc;

use headroom_ckpt::cpu_layers::{seeded_values, Dense, MlpBlock};
use headroom_ckpt::{
    revolve_forward_count, CategoryMeter, Chain, ChainCost, Layer, LayerCost, Op, Plan, PlanError,
    Planner, Schedule, Selective,
};
use headroom_tensor::{Backend, Cpu, CpuTensor};
use proptest::prelude::*;

/// Everything a run produces that must not depend on the schedule, as bit patterns.
#[derive(Debug, PartialEq, Eq)]
struct Gradients {
    params: Vec<Vec<u32>>,
    input: Vec<u32>,
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

struct Setup {
    cpu: Cpu,
    meter: Arc<CategoryMeter>,
    x: CpuTensor,
    r: Vec<f32>,
    out_shape: [usize; 2],
}

impl Setup {
    fn new(rows: usize, in_dim: usize, out_dim: usize, seed: u64) -> Self {
        let meter = Arc::new(CategoryMeter::default());
        let cpu = Cpu::new().with_alloc_hook(meter.clone());
        let x = cpu
            .upload(&seeded_values(rows * in_dim, seed, 1.0), [rows, in_dim])
            .unwrap();
        Setup {
            cpu,
            meter,
            x,
            r: seeded_values(rows * out_dim, seed ^ 0xabc, 1.0),
            out_shape: [rows, out_dim],
        }
    }

    /// Run `schedule` on a fresh copy of `layers`; check the measured peak against the hook
    /// and the prediction; return the gradients.
    fn run<L, F>(
        &self,
        layers: &[L],
        schedule: &Schedule,
        costs: &ChainCost,
        grads: F,
    ) -> (Gradients, u64)
    where
        L: Layer<Cpu> + Clone,
        F: Fn(&L) -> Vec<Vec<u32>>,
    {
        let mut chain = Chain::new(layers.to_vec());
        let before = self.meter.live_bytes();
        self.meter.reset_peak();
        let out = chain
            .step(&self.cpu, schedule, &self.x, |_y| {
                self.cpu.upload(&self.r, self.out_shape)
            })
            .unwrap();
        let hook_peak = self.meter.peak_bytes() - before;
        assert_eq!(
            self.meter.live_bytes(),
            before,
            "every saved activation is freed"
        );
        assert_eq!(
            out.stats.peak_saved_bytes, hook_peak,
            "executor count = allocation hook"
        );
        let predicted = schedule.simulate(costs).unwrap();
        assert_eq!(
            out.stats.peak_saved_bytes, predicted.peak_saved_bytes,
            "measured = predicted"
        );
        assert_eq!(out.stats.forward_count, predicted.forward_count);
        assert_eq!(out.stats.max_checkpoints, predicted.max_checkpoints);
        let params = chain.layers().iter().flat_map(&grads).collect();
        let input = bits(out.input_grad.as_slice::<f32>().unwrap());
        (Gradients { params, input }, out.stats.peak_saved_bytes)
    }

    /// Store-all through `profile`: the reference gradients and the measured costs.
    fn profile<L, F>(&self, layers: &[L], grads: F) -> (Gradients, ChainCost)
    where
        L: Layer<Cpu> + Clone,
        F: Fn(&L) -> Vec<Vec<u32>>,
    {
        let mut chain = Chain::new(layers.to_vec());
        let (costs, out) = chain
            .profile(&self.cpu, &self.x, |_y| {
                self.cpu.upload(&self.r, self.out_shape)
            })
            .unwrap();
        let params = chain.layers().iter().flat_map(&grads).collect();
        let input = bits(out.input_grad.as_slice::<f32>().unwrap());
        (Gradients { params, input }, costs)
    }
}

fn dense_grads(l: &Dense) -> Vec<Vec<u32>> {
    l.grads().iter().map(|g| bits(g)).collect()
}

fn mlp_grads(l: &MlpBlock<Selective>) -> Vec<Vec<u32>> {
    l.grads().iter().map(|g| bits(g)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Random chains of 1–40 dense layers of varied widths: every schedule gives bitwise the
    /// gradients of store-all, and its measured peak (executor and allocation hook) equals the
    /// simulator's prediction; the optimal plan's peak stays within its budget.
    #[test]
    fn every_schedule_gives_identical_gradients(
        widths in prop::collection::vec(1usize..12, 2..42),
        rows in 1usize..4,
        seed in any::<u64>(),
        k_frac in 0.0f64..1.0,
        ckpt_list in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
        revolve_slots in 0usize..5,
        budget_frac in 0.0f64..1.0,
    ) {
        let n = widths.len() - 1;
        let layers: Vec<Dense> = widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| Dense::new(w[0], w[1], seed.wrapping_add(i as u64)))
            .collect();
        let setup = Setup::new(rows, widths[0], widths[n], seed);
        let (reference, costs) = setup.profile(&layers, dense_grads);

        let store_all = Schedule::store_all(n).unwrap();
        let store_all_peak = store_all.simulate(&costs).unwrap().peak_saved_bytes;
        let k = 1 + (k_frac * n as f64) as usize;
        let list: Vec<usize> = ckpt_list.iter().map(|ix| ix.index(n)).collect();
        let (min_bytes, _) = headroom_ckpt::min_memory(&costs).unwrap();
        let budget = min_bytes + ((store_all_peak - min_bytes) as f64 * budget_frac) as u64;
        let plan = Planner::default().optimal(&costs, budget).unwrap();
        prop_assert!(plan.predicted.peak_saved_bytes <= budget);

        let schedules = [
            store_all,
            Schedule::sqrt_n(n).unwrap(),
            Schedule::every_k(n, k).unwrap(),
            Schedule::checkpoint_inputs(n, &list).unwrap(),
            Schedule::revolve(n, revolve_slots).unwrap(),
            plan.schedule.clone(),
        ];
        for schedule in &schedules {
            let (grads, peak) = setup.run(&layers, schedule, &costs, dense_grads);
            prop_assert_eq!(&grads, &reference, "schedule {:?}", schedule.ops());
            prop_assert!(peak <= store_all_peak);
        }
        let (_, peak) = setup.run(&layers, &plan.schedule, &costs, dense_grads);
        prop_assert!(peak <= plan.predicted.peak_saved_bytes && peak <= budget);
    }

    /// Selective recomputation inside MLP blocks: every policy, under store-all and under a
    /// recomputing schedule, gives bitwise the gradients of keeping everything, and keeps no
    /// more bytes.
    #[test]
    fn recompute_policies_give_identical_gradients(
        n in 1usize..7,
        width in 1usize..9,
        hidden in 1usize..17,
        rows in 1usize..4,
        seed in any::<u64>(),
    ) {
        let policies = [
            Selective::save_all(),
            Selective::llmc_level(1),
            Selective::llmc_level(2),
            Selective::recompute_all(),
        ];
        let build = |p: Selective| -> Vec<MlpBlock<Selective>> {
            (0..n).map(|i| MlpBlock::with_policy(width, hidden, seed.wrapping_add(i as u64), p)).collect()
        };
        let setup = Setup::new(rows, width, width, seed);
        let (reference, full_costs) = setup.profile(&build(policies[0]), mlp_grads);
        let full_peak = Schedule::store_all(n).unwrap().simulate(&full_costs).unwrap().peak_saved_bytes;
        for p in policies {
            let layers = build(p);
            let (grads, costs) = setup.profile(&layers, mlp_grads);
            prop_assert_eq!(&grads, &reference, "policy {:?}", p);
            for schedule in [Schedule::store_all(n).unwrap(), Schedule::sqrt_n(n).unwrap(), Schedule::revolve(n, 1).unwrap()] {
                let (grads, peak) = setup.run(&layers, &schedule, &costs, mlp_grads);
                prop_assert_eq!(&grads, &reference);
                prop_assert!(peak <= full_peak);
            }
        }
    }
}

/// Random heterogeneous cost models.
fn costs_strategy(max_layers: usize) -> impl Strategy<Value = ChainCost> {
    (
        prop::collection::vec((0.1f64..10.0, 1u64..1000, 0u64..2000), 1..=max_layers),
        1u64..1000,
    )
        .prop_map(|(layers, out)| {
            let layers = layers
                .into_iter()
                .map(|(f, a, e)| LayerCost {
                    forward_time: f,
                    backward_time: 2.0 * f,
                    input_bytes: a,
                    saved_bytes: e,
                })
                .collect();
            ChainCost::new(layers, out).unwrap()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// At the peak of every-k, √n or store-all (or a larger budget), the optimal plan fits and
    /// recomputes no more; below the minimum, the error names the smallest feasible budget.
    #[test]
    fn optimal_is_never_worse_than_fixed_schedules(
        costs in costs_strategy(40),
        k_frac in 0.0f64..1.0,
        slack in 1.0f64..1.5,
    ) {
        let n = costs.len();
        let k = 1 + (k_frac * n as f64) as usize;
        let planner = Planner::default();
        for fixed in [Schedule::every_k(n, k).unwrap(), Schedule::sqrt_n(n).unwrap(), Schedule::store_all(n).unwrap()] {
            let fixed = Plan::for_schedule(fixed, &costs).unwrap();
            let budget = (fixed.predicted.peak_saved_bytes as f64 * slack) as u64;
            let plan = planner.optimal(&costs, budget).unwrap();
            prop_assert!(plan.predicted.peak_saved_bytes <= budget);
            prop_assert!(plan.predicted.forward_time <= fixed.predicted.forward_time + 1e-9);
            prop_assert_eq!(plan.schedule.simulate(&costs).unwrap(), plan.predicted);
        }
        let (min_bytes, _) = headroom_ckpt::min_memory(&costs).unwrap();
        match planner.optimal(&costs, min_bytes - 1) {
            Err(PlanError::BudgetTooSmall { required, .. }) => prop_assert_eq!(required, min_bytes),
            other => prop_assert!(false, "expected BudgetTooSmall, got {:?}", other),
        }
        prop_assert!(planner.optimal(&costs, min_bytes).is_ok());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// For identical layers, Revolve runs exactly Griewank's minimal number of forwards and
    /// never holds more checkpoints than it was given.
    #[test]
    fn revolve_forward_count_is_binomial(n in 1usize..80, slots in 0usize..8) {
        let schedule = Schedule::revolve(n, slots).unwrap();
        prop_assert_eq!(schedule.forward_count() as u64, revolve_forward_count(n, slots));
        let costs = ChainCost::homogeneous(n, LayerCost { forward_time: 1.0, backward_time: 1.0, input_bytes: 8, saved_bytes: 8 }).unwrap();
        let stats = schedule.simulate(&costs).unwrap();
        prop_assert!(stats.max_checkpoints <= slots);
        prop_assert_eq!(stats.forward_count as u64, revolve_forward_count(n, slots));
    }

    /// Arbitrary op sequences are either valid schedules or typed errors; never a panic.
    #[test]
    fn arbitrary_op_sequences_are_validated(
        n in 1usize..6,
        raw in prop::collection::vec((0u8..4, 0usize..7), 0..30),
    ) {
        let ops: Vec<Op> = raw
            .into_iter()
            .map(|(kind, i)| match kind {
                0 => Op::ForwardSave(i),
                1 => Op::ForwardCheckpoint(i),
                2 => Op::ForwardDiscard(i),
                _ => Op::Backward(i),
            })
            .collect();
        if let Ok(schedule) = Schedule::new(n, ops) {
            prop_assert_eq!(schedule.ops().iter().filter(|op| !op.is_forward()).count(), n);
        }
    }
}

/// Known Revolve counts from Griewank & Walther's tables.
#[test]
fn revolve_known_values() {
    // 10 steps, 3 snapshots (2 slots + the input): r = 2, 2·10 − β(4, 1) = 15 advances.
    assert_eq!(revolve_forward_count(10, 2), 10 + 15);
    // Enough slots: every layer but the last is advanced once.
    assert_eq!(revolve_forward_count(5, 10), 5 + 4);
}

#[test]
fn executor_errors_are_typed() {
    let cpu = Cpu::new();
    let mut chain = Chain::new(vec![Dense::new(3, 2, 1), Dense::new(2, 2, 2)]);
    let x = cpu.upload(&[0.1f32; 6], [2, 3]).unwrap();
    let wrong_len = Schedule::store_all(3).unwrap();
    assert!(matches!(
        chain.step(&cpu, &wrong_len, &x, |_| cpu.upload(&[0f32; 4], [2, 2])),
        Err(headroom_ckpt::CkptError::Schedule(
            headroom_ckpt::ScheduleError::LengthMismatch { .. }
        ))
    ));
    let s = Schedule::store_all(2).unwrap();
    assert!(matches!(
        chain.step(&cpu, &s, &x, |_| cpu.upload(&[0f32; 2], [1, 2])),
        Err(headroom_ckpt::CkptError::LossGradientShape { .. })
    ));
    let bad_x = cpu.upload(&[0.1f32; 8], [2, 4]).unwrap();
    assert!(matches!(
        chain.step(&cpu, &s, &bad_x, |_| cpu.upload(&[0f32; 4], [2, 2])),
        Err(headroom_ckpt::CkptError::Forward { layer: 0, .. })
    ));
    // The failed steps left the chain usable.
    assert!(chain
        .step(&cpu, &s, &x, |_| cpu.upload(&[0f32; 4], [2, 2]))
        .is_ok());
}

/// Dense and MLP layers' gradients agree with central finite differences of a scalar loss.
#[test]
fn layer_gradients_match_finite_differences() {
    fn check<L: Layer<Cpu> + Clone>(
        layer: L,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        grads: impl Fn(&L) -> Vec<f32>,
        perturb: impl Fn(&mut L, &[f32], f32),
    ) {
        let cpu = Cpu::new();
        let x = seeded_values(rows * in_dim, 7, 1.0);
        let r = seeded_values(rows * out_dim, 8, 1.0);
        let loss = |l: &L, x: &[f32]| -> f64 {
            let xt = cpu.upload(x, [rows, in_dim]).unwrap();
            let y = l.forward_discard(&cpu, &xt).unwrap();
            y.as_slice::<f32>()
                .unwrap()
                .iter()
                .zip(&r)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum()
        };
        let mut l = layer.clone();
        let xt = cpu.upload(&x, [rows, in_dim]).unwrap();
        let (_, saved) = l.forward_save(&cpu, &xt).unwrap();
        let rt = cpu.upload(&r, [rows, out_dim]).unwrap();
        let dx = l.backward(&cpu, &xt, saved, &rt).unwrap();
        let dx = dx.as_slice::<f32>().unwrap().to_vec();
        let g = grads(&l);
        let v = seeded_values(x.len(), 9, 1.0);
        let vp = seeded_values(g.len(), 10, 1.0);
        let eps = 1e-2f32;
        let shifted = |sign: f32| {
            let xs: Vec<f32> = x.iter().zip(&v).map(|(a, b)| a + sign * eps * b).collect();
            let mut lp = layer.clone();
            perturb(&mut lp, &vp, sign * eps);
            loss(&lp, &xs)
        };
        let fd = (shifted(1.0) - shifted(-1.0)) / (2.0 * eps as f64);
        let an: f64 = dx
            .iter()
            .zip(&v)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum::<f64>()
            + g.iter()
                .zip(&vp)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>();
        assert!(
            (fd - an).abs() < 2e-2 * (1.0 + an.abs()),
            "finite difference {fd} vs analytic {an}"
        );
    }
    fn shift(params: Vec<&mut Vec<f32>>, v: &[f32], eps: f32) {
        let mut it = v.iter();
        for p in params {
            for x in p.iter_mut() {
                *x += eps * it.next().unwrap();
            }
        }
    }
    check(
        Dense::new(5, 4, 3),
        3,
        5,
        4,
        |l| l.grads().concat(),
        |l, v, e| shift(l.params_mut().into_iter().collect(), v, e),
    );
    check(
        MlpBlock::with_policy(6, 12, 4, Selective::llmc_level(2)),
        3,
        6,
        6,
        |l| l.grads().concat(),
        |l, v, e| shift(l.params_mut().into_iter().collect(), v, e),
    );
}
