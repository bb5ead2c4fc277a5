//! Bytes through the collective per step (ring model), by stage: stage 3 moves 1.5× what
//! stage 0 does (the ZeRO paper's 3Ψ against 2Ψ), stages 1 and 2 the same as stage 0.

mod common;

use common::{drive_step, run_ranks, AdamW};
use headroom_tensor::Cpu;
use headroom_zero::{
    CommKind, CommStats, CountingCollective, FlatLayout, Stage, ZeroConfig, ZeroEngine,
};

fn sizes() -> Vec<Vec<usize>> {
    vec![vec![1000, 7], vec![3001, 13], vec![517], vec![2000, 50]]
}

/// Rank 0's counts over its second step (the first allocates optimizer state, which moves
/// nothing, but this keeps the measurement to a steady step).
fn step_volume(stage: Stage, world: usize) -> CommStats {
    run_ranks(world, move |comm| {
        let comm = CountingCollective::new(comm);
        let counters = comm.counters();
        let sizes = sizes();
        let config = ZeroConfig::new(stage).with_bucket_bytes(8 << 10);
        let mut zero = ZeroEngine::new(Cpu::new(), comm, &sizes, config).unwrap();
        let mut opt = AdamW::default();
        drive_step(&mut zero, &sizes, 1, &mut opt);
        let before = counters.snapshot();
        drive_step(&mut zero, &sizes, 1, &mut opt);
        counters.snapshot().since(&before)
    })
    .remove(0)
}

#[test]
fn stage3_moves_one_and_a_half_times_stage0() {
    let numels: Vec<usize> = sizes().iter().map(|l| l.iter().sum()).collect();
    let psi: u64 = numels.iter().sum::<usize>() as u64;
    for world in [2usize, 3, 4] {
        let padded: u64 = numels
            .iter()
            .map(|&n| FlatLayout::new(&[n], world).unwrap().padded_len() as u64)
            .sum();
        let n = world as u64;
        let v: Vec<CommStats> = Stage::ALL.iter().map(|&s| step_volume(s, world)).collect();
        let sent: Vec<u64> = v.iter().map(CommStats::sent_bytes).collect();
        // Stage 0: one all-reduce of 4Ψ bytes, 2(N-1)/N of it each way.
        assert_eq!(sent[0], 2 * (n - 1) * 4 * psi / n);
        assert_eq!(v[0].kind(CommKind::AllReduce).calls, 1);
        // Stages 1-2: reduce-scatter + all-gather of the padded buffer.
        assert_eq!(sent[1], 2 * (n - 1) * 4 * padded / n);
        assert_eq!(sent[2], 2 * (n - 1) * 4 * padded / n);
        // Stage 3: all-gather in forward and in backward, reduce-scatter in backward.
        assert_eq!(sent[3], 3 * (n - 1) * 4 * padded / n);
        assert_eq!(
            v[3].kind(CommKind::AllGather).calls,
            2 * numels.len() as u64
        );
        let ratio = sent[3] as f64 / sent[0] as f64;
        println!(
            "N={world}: bytes sent per rank per step: stage0 {} stage1 {} stage2 {} stage3 {}; \
             stage3/stage0 = {ratio:.4}",
            sent[0], sent[1], sent[2], sent[3]
        );
        assert!((1.5..1.51).contains(&ratio), "N = {world}: ratio {ratio}");
    }
}
