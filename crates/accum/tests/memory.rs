//! Tracker numbers: with micro-batch `m` and `k` accumulation steps, peak activation bytes are
//! those of a batch of `m`, not of `m·k`; the gradient buffers are allocated once.
//!
//! Run with `--nocapture` to see the table.

mod support;

use std::sync::Arc;

use headroom_accum::{GradAccumulator, MicroBatchPlan, NoLossScaling, SplitBy};
use headroom_tensor::{Backend, Cpu, CpuTensor, MemoryCategory};
use support::{CategoryTracker, Model, ModelKind, Rng, Sequence};

const SEQ_LEN: usize = 32;
const M: usize = 4;
const K: usize = 4;
const STEPS: usize = 3;

struct Run {
    peak_activations: usize,
    peak_data: usize,
    peak_workspace: usize,
    peak_gradients: usize,
    gradient_allocations: usize,
    buffer_bytes: usize,
    losses: Vec<f64>,
}

/// Train the same MLP for `STEPS` optimizer steps on `batch_sequences` sequences per step,
/// cut into micro-batches of `micro_batch` sequences, with every allocation tracked.
fn train(batch_sequences: usize, micro_batch: usize) -> Run {
    let tracker = CategoryTracker::new();
    let cpu = Cpu::new().with_alloc_hook(tracker.clone() as Arc<dyn headroom_tensor::AllocHook>);
    let mut rng = Rng::new(42);
    let mut model = Model::random(&cpu, ModelKind::MlpCrossEntropy, 16, 64, 32, &mut rng);
    let mut acc = GradAccumulator::new(cpu.clone(), model.param_shapes()).unwrap();
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        let batch: Vec<Sequence> = (0..batch_sequences)
            .map(|_| model.random_sequence(SEQ_LEN, 0.7, &mut rng))
            .collect();
        let masks: Vec<&[bool]> = batch.iter().map(|s| s.mask.as_slice()).collect();
        let plan =
            MicroBatchPlan::from_loss_masks(&masks, SplitBy::Sequences(micro_batch)).unwrap();
        acc.begin_step(plan.step_tokens().unwrap()).unwrap();
        for mb in plan.micro_batches() {
            let fwd = model.forward(&cpu, mb.select(&batch).unwrap());
            let m = &model;
            acc.accumulate_in_place(fwd.stats, |_, bufs: &mut [CpuTensor], w| {
                let mut slices: Vec<&mut [f32]> = bufs
                    .iter_mut()
                    .map(|b| b.as_mut_slice::<f32>().unwrap())
                    .collect();
                m.backward_add(&fwd.saved, w, &mut slices, None);
                Ok::<_, std::convert::Infallible>(())
            })
            .unwrap();
            // `fwd.saved` drops here: the micro-batch's activations are freed.
        }
        let report = acc.finish_step(&mut NoLossScaling, Some(1.0)).unwrap();
        assert!(report.outcome.is_applied());
        losses.push(report.loss);
        for (p, g) in model.params.iter_mut().zip(acc.gradients()) {
            cpu.axpy(-0.5, g, p).unwrap();
        }
    }
    Run {
        peak_activations: tracker.peak(MemoryCategory::Activations),
        peak_data: tracker.peak(MemoryCategory::Data),
        peak_workspace: tracker.peak(MemoryCategory::Workspace),
        peak_gradients: tracker.peak(MemoryCategory::Gradients),
        gradient_allocations: tracker.allocations(MemoryCategory::Gradients),
        buffer_bytes: acc.buffer_bytes(),
        losses,
    }
}

#[test]
fn peak_activations_follow_the_micro_batch_not_the_effective_batch() {
    let small = train(M, M); // batch m, no accumulation
    let accumulated = train(M * K, M); // effective batch m·k in k micro-batches of m
    let big = train(M * K, M * K); // batch m·k in one go

    println!("tracker numbers (MLP 16→64→32, {SEQ_LEN}-token sequences, {STEPS} steps):");
    println!(
        "{:<34} {:>12} {:>10} {:>10} {:>14}",
        "run", "activations", "data", "grads", "grad allocs"
    );
    for (name, r) in [
        (format!("batch {M}"), &small),
        (
            format!("batch {} = {K} micro-batches of {M}", M * K),
            &accumulated,
        ),
        (format!("batch {} in one pass", M * K), &big),
    ] {
        println!(
            "{name:<34} {:>12} {:>10} {:>10} {:>14}",
            r.peak_activations, r.peak_data, r.peak_gradients, r.gradient_allocations
        );
    }

    // Activations of one micro-batch: tokens × (hidden + outputs) f32.
    let per_micro_batch = M * SEQ_LEN * (64 + 32) * 4;
    assert_eq!(small.peak_activations, per_micro_batch);
    assert_eq!(accumulated.peak_activations, small.peak_activations);
    assert_eq!(big.peak_activations, K * small.peak_activations);
    assert_eq!(accumulated.peak_data, small.peak_data);
    assert_eq!(big.peak_data, K * small.peak_data);

    // Gradient buffers: allocated once (one per parameter), never more than the parameters'
    // f32 size, and no per-micro-batch gradient copies anywhere (in-place backward).
    let param_bytes = (64 * 16 + 64 + 32 * 64 + 32) * 4;
    for r in [&small, &accumulated, &big] {
        assert_eq!(r.gradient_allocations, 4);
        assert_eq!(r.peak_gradients, param_bytes);
        assert_eq!(r.buffer_bytes, param_bytes);
        assert_eq!(r.peak_workspace, 0);
        assert!(r.losses.iter().all(|l| l.is_finite()));
    }
}
