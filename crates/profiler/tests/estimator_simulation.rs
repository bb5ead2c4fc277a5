//! The estimator's activation peak against a tracked simulation: the saved tensors it lists are
//! really allocated and freed in the order a trainer's forward, recompute and backward would,
//! and the tracker's measured peak must equal the closed-form prediction for every policy.

use std::sync::Arc;

use headroom_profiler::{
    block_saved_tensors, estimate, label, outside_saved_tensors, AttentionKind, CheckpointPolicy,
    GptConfig, MemoryTracker, Precision, SavedTensor, TrainingSetup,
};
use headroom_tensor::{Backend, Cpu, CpuTensor, DType, Device, MemoryCategory};
use proptest::prelude::*;

fn alloc(cpu: &Cpu, tensors: &[SavedTensor]) -> Vec<CpuTensor> {
    tensors
        .iter()
        .map(|t| cpu.zeros([t.elements as usize], t.dtype).unwrap())
        .collect()
}

/// Run forward + backward of `layers` blocks under `policy`, allocating exactly the listed
/// tensors; return the tracker's peak of the activations category.
fn simulate(config: &GptConfig, setup: &TrainingSetup) -> u64 {
    let tracker = Arc::new(MemoryTracker::new());
    let cpu = Cpu::new().with_alloc_hook(tracker.clone());
    let _acts = MemoryCategory::Activations.enter();
    let block = block_saved_tensors(config, setup).unwrap();
    let kept: Vec<SavedTensor> = block
        .iter()
        .filter(|t| !t.recomputed_by_selective)
        .copied()
        .collect();
    let dropped: Vec<SavedTensor> = block
        .iter()
        .filter(|t| t.recomputed_by_selective)
        .copied()
        .collect();
    let outside = outside_saved_tensors(config, setup).unwrap();
    let (encoded, head) = outside.split_at(1);
    let block_input = SavedTensor {
        name: "checkpoint",
        elements: (setup.micro_batch * setup.seq_len * config.width) as u64,
        dtype: setup.precision.compute,
        recomputed_by_selective: false,
    };
    let layers = config.layers;

    let _encoded = alloc(&cpu, encoded);
    match setup.checkpoint {
        CheckpointPolicy::None => {
            let mut saved: Vec<_> = (0..layers).map(|_| alloc(&cpu, &block)).collect();
            let _head = alloc(&cpu, head);
            while saved.pop().is_some() {}
        }
        CheckpointPolicy::Selective => {
            let mut saved: Vec<_> = (0..layers)
                .map(|_| {
                    // Forward computes everything, keeps only the matmul outputs and stats.
                    let kept = alloc(&cpu, &kept);
                    drop(alloc(&cpu, &dropped));
                    kept
                })
                .collect();
            let _head = alloc(&cpu, head);
            while let Some(kept) = saved.pop() {
                let recomputed = alloc(&cpu, &dropped);
                drop((kept, recomputed));
            }
        }
        CheckpointPolicy::EveryK(_) | CheckpointPolicy::SqrtN => {
            let k = match setup.checkpoint {
                CheckpointPolicy::EveryK(k) => k.min(layers),
                _ => (1..=layers).find(|k| k * k >= layers).unwrap(),
            };
            let segments = layers.div_ceil(k);
            let len = |s: usize| if s + 1 == segments { layers - s * k } else { k };
            // Forward: each block's tensors live only while it runs; segment inputs stay.
            let mut inputs = Vec::new();
            for s in 0..segments {
                if s > 0 {
                    inputs.push(alloc(&cpu, &[block_input]));
                }
                for _ in 0..len(s) {
                    drop(alloc(&cpu, &block));
                }
            }
            let _head = alloc(&cpu, head);
            // Backward: recompute a segment in full, then free it block by block.
            for s in (0..segments).rev() {
                let _l = label(&format!("segment {s}"));
                let mut recomputed: Vec<_> = (0..len(s)).map(|_| alloc(&cpu, &block)).collect();
                while recomputed.pop().is_some() {}
                if s > 0 {
                    inputs.pop();
                }
            }
        }
    }
    tracker.snapshot().device(Device::Cpu).unwrap().peak[MemoryCategory::Activations]
}

fn policy() -> impl Strategy<Value = CheckpointPolicy> {
    prop_oneof![
        Just(CheckpointPolicy::None),
        Just(CheckpointPolicy::SqrtN),
        Just(CheckpointPolicy::Selective),
        (1usize..10).prop_map(CheckpointPolicy::EveryK),
    ]
}

fn attention() -> impl Strategy<Value = AttentionKind> {
    prop_oneof![
        Just(AttentionKind::Naive),
        Just(AttentionKind::Flash),
        (1usize..6).prop_map(|chunk| AttentionKind::Chunked { chunk }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn estimated_activation_peak_equals_the_simulated_peak(
        layers in 1usize..9,
        heads in 1usize..4,
        head_dim in 1usize..5,
        seq_len in 1usize..9,
        micro_batch in 1usize..3,
        vocab in 1usize..20,
        bf16 in any::<bool>(),
        checkpoint in policy(),
        attention in attention(),
    ) {
        let config = GptConfig { layers, heads, width: heads * head_dim, context: 8, vocab };
        let setup = TrainingSetup {
            precision: if bf16 { Precision::mixed(DType::BF16) } else { Precision::FP32 },
            checkpoint,
            attention,
            ..TrainingSetup::baseline(micro_batch, seq_len)
        };
        let predicted = estimate(&config, &setup).unwrap().device[MemoryCategory::Activations];
        prop_assert_eq!(simulate(&config, &setup), predicted);
    }
}
