//! headroom-ckpt: one training step of a 24-block MLP chain on the CPU under three schedules —
//! store-all (the baseline), √n checkpointing, and the planner's optimal schedule for a budget
//! of 25% of store-all's peak saved bytes — plus the planner's own speed on 100 layers and 500
//! memory slots.
//!
//! Timing: criterion group `ckpt/step_24_layers` (functions `baseline_store_all`,
//! `headroom_sqrt_n`, `headroom_optimal_25pct`, and `headroom_keep_matmuls`: store-all with
//! Megatron-style selective recompute inside each block). Memory: the exact peak of live saved
//! bytes as the executor and the allocation hook count them, one `peak_saved_bytes` record per
//! variant with store-all as the baseline. The planner is fed the costs measured by profiling
//! one warm store-all step, as a user would.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use headroom_benches::{record, Better, Record};
use headroom_ckpt::cpu_layers::{seeded_values, MlpBlock};
use headroom_ckpt::{
    CategoryMeter, Chain, ChainCost, KeepMatmuls, Layer, LayerCost, Plan, Planner, RecomputePolicy,
    Schedule,
};
use headroom_tensor::{Backend, Cpu, CpuTensor};

const LAYERS: usize = 24;
const ROWS: usize = 32;
const WIDTH: usize = 192;
const HIDDEN: usize = 4 * WIDTH;
const PARAM: &str = "24x32x192";
const GROUP: &str = "ckpt/step_24_layers";

fn chain<P: RecomputePolicy>(policy: P) -> Chain<MlpBlock<P>> {
    Chain::new(
        (0..LAYERS)
            .map(|i| MlpBlock::with_policy(WIDTH, HIDDEN, 1000 + i as u64, policy))
            .collect(),
    )
}

struct Step {
    cpu: Cpu,
    meter: Arc<CategoryMeter>,
    x: CpuTensor,
    dy: Vec<f32>,
}

impl Step {
    fn new() -> Self {
        let meter = Arc::new(CategoryMeter::default());
        let cpu = Cpu::new().with_alloc_hook(meter.clone());
        let x = cpu
            .upload(&seeded_values(ROWS * WIDTH, 1, 1.0), [ROWS, WIDTH])
            .expect("upload input");
        Step {
            cpu,
            meter,
            x,
            dy: seeded_values(ROWS * WIDTH, 2, 1e-3),
        }
    }

    /// One step; returns the peak of saved bytes, checked against the allocation hook.
    fn run<L: Layer<Cpu>>(&self, chain: &mut Chain<L>, schedule: &Schedule) -> u64 {
        self.meter.reset_peak();
        let before = self.meter.live_bytes();
        let out = chain
            .step(&self.cpu, schedule, &self.x, |_| {
                self.cpu.upload(&self.dy, [ROWS, WIDTH])
            })
            .expect("step");
        let peak = out.stats.peak_saved_bytes;
        assert_eq!(
            peak,
            self.meter.peak_bytes() - before,
            "executor count = allocation hook"
        );
        black_box(out.input_grad);
        peak
    }

    fn profile<L: Layer<Cpu>>(&self, chain: &mut Chain<L>) -> ChainCost {
        chain
            .profile(&self.cpu, &self.x, |_| {
                self.cpu.upload(&self.dy, [ROWS, WIDTH])
            })
            .expect("profile")
            .0
    }
}

fn peak_record(variant: &str, value: u64, store_all: u64) {
    ratio_record(
        GROUP,
        "peak_saved_bytes",
        "bytes",
        variant,
        value as f64,
        store_all as f64,
    );
}

/// A record of `variant` in `group`, with store-all (measured in the same run) as baseline.
fn ratio_record(group: &str, metric: &str, unit: &str, variant: &str, value: f64, store_all: f64) {
    let baseline = format!("{group}/baseline_store_all/{PARAM}");
    let bench = format!("{group}/{variant}/{PARAM}");
    let is_baseline = bench == baseline;
    let r = Record {
        bench,
        metric: metric.into(),
        value,
        unit: unit.into(),
        baseline: (!is_baseline).then_some(baseline),
        baseline_value: (!is_baseline).then_some(store_all),
        ratio: (!is_baseline).then_some(value / store_all),
        better: Better::Lower,
    };
    if let Err(e) = record(&r) {
        eprintln!("could not record {}: {e}", r.bench);
    }
}

fn step_24_layers(c: &mut Criterion) {
    let step = Step::new();
    let mut plain = chain(headroom_ckpt::SaveAll);
    // Warm up once, then measure the costs the planner sees: per-layer medians of several
    // profiled steps, so one descheduled layer on a shared machine does not skew the plan.
    let _ = step.profile(&mut plain);
    let profiles: Vec<ChainCost> = (0..5).map(|_| step.profile(&mut plain)).collect();
    let costs = median_costs(&profiles);

    let store_all = Schedule::store_all(LAYERS).expect("store-all");
    let sqrt_n = Schedule::sqrt_n(LAYERS).expect("sqrt(n)");
    let store_all_peak = store_all
        .simulate(&costs)
        .expect("simulate")
        .peak_saved_bytes;
    let budget = store_all_peak / 4;
    let plan = Planner::default()
        .optimal(&costs, budget)
        .expect("plan at 25%");
    let sqrt_plan = sqrt_n.simulate(&costs).expect("simulate");
    eprintln!(
        "ckpt: store-all peak {store_all_peak} B; sqrt(n) peak {} B, {} forwards; optimal@25% peak {} B (budget {budget} B), {} forwards, predicted recompute {:.1}% of a forward pass",
        sqrt_plan.peak_saved_bytes,
        sqrt_plan.forward_count,
        plan.predicted.peak_saved_bytes,
        plan.predicted.forward_count,
        100.0 * plan.recompute_time / costs.total_forward_time(),
    );

    // The cost model's view of the step-time price (measured per-layer times, no noise from
    // the other variants' runs): the figure the planner optimised.
    let store_all_plan = Plan::for_schedule(store_all.clone(), &costs).expect("predict");
    let sqrt_n_plan = Plan::for_schedule(sqrt_n.clone(), &costs).expect("predict");
    for (variant, p) in [
        ("baseline_store_all", &store_all_plan),
        ("headroom_sqrt_n", &sqrt_n_plan),
        ("headroom_optimal_25pct", &plan),
    ] {
        eprintln!(
            "ckpt: {variant}: predicted step {:.1} ms ({:.3}x store-all)",
            p.predicted_step_time() * 1e3,
            p.predicted_step_time() / store_all_plan.predicted_step_time()
        );
        ratio_record(
            "ckpt/step_24_layers_predicted",
            "predicted_step_time",
            "s",
            variant,
            p.predicted_step_time(),
            store_all_plan.predicted_step_time(),
        );
    }

    let mut selective = chain(KeepMatmuls);
    let peaks = [
        ("baseline_store_all", step.run(&mut plain, &store_all)),
        ("headroom_sqrt_n", step.run(&mut plain, &sqrt_n)),
        (
            "headroom_optimal_25pct",
            step.run(&mut plain, &plan.schedule),
        ),
        (
            "headroom_keep_matmuls",
            step.run(&mut selective, &store_all),
        ),
    ];
    for (variant, peak) in peaks {
        eprintln!(
            "ckpt: {variant}: peak saved bytes {peak} ({:.3} of store-all)",
            peak as f64 / store_all_peak as f64
        );
        peak_record(variant, peak, store_all_peak);
    }
    assert_eq!(
        peaks[2].1, plan.predicted.peak_saved_bytes,
        "measured = predicted"
    );

    interleaved_step_times(
        &step,
        &mut plain,
        &mut selective,
        [&store_all, &sqrt_n, &plan.schedule],
    );

    let mut group = c.benchmark_group(GROUP);
    group.sample_size(10);
    group.bench_function(BenchmarkId::new("baseline_store_all", PARAM), |b| {
        b.iter(|| step.run(&mut plain, &store_all))
    });
    group.bench_function(BenchmarkId::new("headroom_sqrt_n", PARAM), |b| {
        b.iter(|| step.run(&mut plain, &sqrt_n))
    });
    group.bench_function(BenchmarkId::new("headroom_optimal_25pct", PARAM), |b| {
        b.iter(|| step.run(&mut plain, &plan.schedule))
    });
    group.bench_function(BenchmarkId::new("headroom_keep_matmuls", PARAM), |b| {
        b.iter(|| step.run(&mut selective, &store_all))
    });
    group.finish();
}

/// Per-layer median forward and backward times of several profiles of the same chain.
fn median_costs(profiles: &[ChainCost]) -> ChainCost {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let layers = (0..profiles[0].len())
        .map(|i| {
            let mut l = profiles[0].layers()[i];
            l.forward_time = median(
                profiles
                    .iter()
                    .map(|p| p.layers()[i].forward_time)
                    .collect(),
            );
            l.backward_time = median(
                profiles
                    .iter()
                    .map(|p| p.layers()[i].backward_time)
                    .collect(),
            );
            l
        })
        .collect();
    ChainCost::new(layers, profiles[0].output_bytes()).expect("median costs")
}

/// Median step time of each variant from rounds that run every variant once, in turn: on a
/// shared machine whose load drifts, each round sees the same load for all variants, so the
/// ratios are steadier than those of separate criterion groups.
fn interleaved_step_times(
    step: &Step,
    plain: &mut Chain<MlpBlock<headroom_ckpt::SaveAll>>,
    selective: &mut Chain<MlpBlock<KeepMatmuls>>,
    [store_all, sqrt_n, optimal]: [&Schedule; 3],
) {
    let quick = std::env::args().any(|a| a == "--quick")
        || std::env::var_os("HEADROOM_BENCH_QUICK").is_some();
    let rounds = if quick { 5 } else { 15 };
    let mut times: [Vec<f64>; 4] = Default::default();
    for _ in 0..rounds {
        let timed = |f: &mut dyn FnMut()| {
            let started = std::time::Instant::now();
            f();
            started.elapsed().as_secs_f64() * 1e9
        };
        times[0].push(timed(&mut || {
            step.run(plain, store_all);
        }));
        times[1].push(timed(&mut || {
            step.run(plain, sqrt_n);
        }));
        times[2].push(timed(&mut || {
            step.run(plain, optimal);
        }));
        times[3].push(timed(&mut || {
            step.run(selective, store_all);
        }));
    }
    let medians: Vec<f64> = times
        .iter_mut()
        .map(|t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect();
    let group = "ckpt/step_24_layers_interleaved";
    for (variant, median) in [
        "baseline_store_all",
        "headroom_sqrt_n",
        "headroom_optimal_25pct",
        "headroom_keep_matmuls",
    ]
    .iter()
    .zip(&medians)
    {
        eprintln!(
            "ckpt: {variant}: interleaved median step {:.1} ms ({:.3}x store-all)",
            median / 1e6,
            median / medians[0]
        );
        ratio_record(
            group,
            "median_step_time",
            "ns",
            variant,
            *median,
            medians[0],
        );
    }
}

/// 100 layers of varied costs (three kinds, like embedding / attention / MLP blocks).
fn planner_costs() -> ChainCost {
    let jitter = seeded_values(300, 42, 0.5);
    let layers = (0..100)
        .map(|i| {
            let (f, a, e) = match i % 3 {
                0 => (1.0, 4 << 20, 12 << 20),
                1 => (2.5, 4 << 20, 20 << 20),
                _ => (0.3, 8 << 20, 2 << 20),
            };
            let j = 1.0 + jitter[i];
            LayerCost {
                forward_time: f * j as f64,
                backward_time: 2.0 * f * j as f64,
                input_bytes: (a as f32 * j) as u64,
                saved_bytes: (e as f32 * j) as u64,
            }
        })
        .collect();
    ChainCost::new(layers, 4 << 20).expect("costs")
}

fn planner_100_layers(c: &mut Criterion) {
    let costs = planner_costs();
    let store_all = Schedule::store_all(100)
        .expect("store-all")
        .simulate(&costs)
        .expect("simulate")
        .peak_saved_bytes;
    let budget = store_all / 4;
    let planner = Planner::new(500).expect("planner");
    let mut group = c.benchmark_group("ckpt/planner");
    group.sample_size(10);
    group.bench_function(
        BenchmarkId::new("headroom_optimal", "100_layers_500_slots"),
        |b| b.iter(|| planner.optimal(black_box(&costs), budget).expect("plan")),
    );
    group.finish();
}

criterion_group!(benches, step_24_layers, planner_100_layers);
criterion_main!(benches);
