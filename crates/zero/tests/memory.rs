//! Per-rank bytes by category, from an allocation tracker on each rank's backend, against the
//! ZeRO paper's formulas (fp32 Adam: 16, 8 + 8/N, 4 + 12/N and 16/N bytes per parameter;
//! mixed bf16 Adam: 16, 4 + 12/N, 2 + 14/N and 16/N).

mod common;

use std::sync::Arc;

use common::{drive_step, run_ranks, AdamW};
use headroom_profiler::MemoryTracker;
use headroom_tensor::{Cpu, Device, MemoryCategory};
use headroom_zero::{
    paper_bytes_per_param, per_rank_bytes, FlatLayout, Precision, Stage, ZeroConfig, ZeroEngine,
};

fn sizes() -> Vec<Vec<usize>> {
    vec![vec![1000, 7], vec![3001, 13], vec![517], vec![2000, 50]]
}

const BUCKET: usize = 16 << 10;

struct Measured {
    live: [u64; 4],
    peak: [u64; 4],
}

fn measure(stage: Stage, world: usize, precision: Precision) -> Vec<Measured> {
    run_ranks(world, move |comm| {
        let tracker = Arc::new(MemoryTracker::new());
        let cpu = Cpu::new().with_alloc_hook(tracker.clone());
        let sizes = sizes();
        let config = ZeroConfig::new(stage)
            .with_bucket_bytes(BUCKET)
            .with_precision(precision);
        let mut zero = ZeroEngine::new(cpu, comm, &sizes, config).unwrap();
        let mut opt = AdamW::default();
        for _ in 0..2 {
            drive_step(&mut zero, &sizes, 2, &mut opt);
        }
        let snap = tracker.snapshot();
        let d = snap.device(Device::Cpu).unwrap();
        let cats = [
            MemoryCategory::Parameters,
            MemoryCategory::Gradients,
            MemoryCategory::OptimizerState,
            MemoryCategory::Workspace,
        ];
        Measured {
            live: cats.map(|c| d.live[c]),
            peak: cats.map(|c| d.peak[c]),
        }
    })
}

#[test]
fn per_rank_bytes_match_the_stage_formulas() {
    let numels: Vec<usize> = sizes().iter().map(|l| l.iter().sum()).collect();
    let psi: usize = numels.iter().sum();
    for (world, precision) in [2, 3, 4]
        .into_iter()
        .flat_map(|n| [(n, Precision::Fp32), (n, Precision::MixedBf16)])
    {
        let padding: usize = numels
            .iter()
            .map(|&n| FlatLayout::new(&[n], world).unwrap().padding())
            .sum();
        assert!(padding > 0, "the sizes must not divide evenly by {world}");
        for stage in Stage::ALL {
            let expected = per_rank_bytes(stage, &numels, world, precision, 8, BUCKET).unwrap();
            // The paper's per-parameter figure times the (padded, from stage 1) parameter count.
            let counted = if stage == Stage::Zero0 {
                psi
            } else {
                psi + padding
            };
            let paper = paper_bytes_per_param(stage, world, precision, 8);
            let formula = paper * counted as f64;
            assert!(
                (expected.persistent() as f64 - formula).abs() < 1e-6,
                "{stage}, N = {world}: {} vs {formula}",
                expected.persistent()
            );
            for (rank, m) in measure(stage, world, precision).iter().enumerate() {
                let ctx = format!("{stage} {precision:?}, N = {world}, rank {rank}");
                assert_eq!(m.live[0], expected.parameters, "{ctx}: parameters");
                assert_eq!(m.live[1], expected.gradients, "{ctx}: gradients");
                assert_eq!(m.live[2], expected.optimizer_state, "{ctx}: optimizer");
                assert_eq!(m.live[3], 0, "{ctx}: workspace left live");
                // Transients: stage 3 holds at most the layer in use and the prefetched one;
                // stages 2-3 at most one bucket filling and two in flight.
                assert!(
                    m.peak[0] <= expected.parameters + 2 * expected.gathered_layer_max,
                    "{ctx}: peak parameters {}",
                    m.peak[0]
                );
                assert!(
                    m.peak[1] <= expected.gradients + 3 * expected.bucket_max,
                    "{ctx}: peak gradients {}",
                    m.peak[1]
                );
                if stage == Stage::Zero3 {
                    assert!(
                        m.peak[0] > expected.parameters,
                        "{ctx}: nothing was gathered"
                    );
                }
                if rank == 0 {
                    let measured = m.live[..3].iter().sum::<u64>() as f64 / psi as f64;
                    println!(
                        "{stage} {precision:?} N={world}: {measured:.3} B/param measured (paper {paper:.3}, \
                         padding {padding} elements); peak params {} B, peak grads {} B",
                        m.peak[0], m.peak[1]
                    );
                }
            }
        }
    }
}

#[test]
fn mixed_precision_formulas_follow_the_paper() {
    // 2Ψ + 2Ψ + KΨ/N with K = 12 (fp32 masters and Adam moments), no padding at N = 1.
    for (stage, want) in [
        (Stage::Zero0, 16.0),
        (Stage::Zero1, 4.0 + 12.0 / 8.0),
        (Stage::Zero2, 2.0 + 14.0 / 8.0),
        (Stage::Zero3, 16.0 / 8.0),
    ] {
        assert_eq!(
            paper_bytes_per_param(stage, 8, Precision::MixedBf16, 8),
            want
        );
    }
    let b = per_rank_bytes(Stage::Zero3, &[800, 8], 8, Precision::MixedBf16, 8, 1 << 20).unwrap();
    assert_eq!(b.parameters, 2 * 101);
    assert_eq!(b.gradients, 2 * 101);
    assert_eq!(b.optimizer_state, 12 * 101);
    assert_eq!(b.gathered_layer_max, 2 * 800);
    assert_eq!(b.bucket_max, 2 * 808);
    assert!(per_rank_bytes(Stage::Zero1, &[1], 0, Precision::Fp32, 8, 0).is_err());
}
