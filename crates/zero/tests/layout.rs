//! Partitioning invariants, for any tensor sizes and world size.

use headroom_zero::{BucketPlan, FlatLayout, ReductionOrder};
use proptest::prelude::*;

fn sizes() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(prop_oneof![Just(0usize), 1usize..40, 40usize..300], 0..8)
}

proptest! {
    #[test]
    fn shards_tile_the_padded_buffer_exactly_once(sizes in sizes(), world in 1usize..9) {
        let layout = FlatLayout::new(&sizes, world).unwrap();
        let numel: usize = sizes.iter().sum();
        prop_assert_eq!(layout.numel(), numel);
        prop_assert_eq!(layout.padded_len() % world, 0);
        prop_assert!(layout.padding() < world);
        prop_assert_eq!(layout.padded_len(), numel + layout.padding());
        let mut covered = vec![0u8; layout.padded_len()];
        for r in 0..world {
            let range = layout.shard_range(r).unwrap();
            prop_assert_eq!(range.len(), layout.shard_len());
            for i in range.clone() {
                covered[i] += 1;
                prop_assert_eq!(layout.owner(i), Some((r, i - range.start)));
            }
        }
        prop_assert!(covered.iter().all(|&c| c == 1));
        prop_assert!(layout.shard_range(world).is_none());
        prop_assert!(layout.owner(layout.padded_len()).is_none());
    }

    #[test]
    fn parameter_and_shard_pieces_round_trip(sizes in sizes(), world in 1usize..9) {
        let layout = FlatLayout::new(&sizes, world).unwrap();
        // Every element of every tensor lies in exactly one piece, and both views agree.
        let mut seen: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0; n]).collect();
        let mut from_shards = Vec::new();
        for r in 0..world {
            let shard = layout.shard_range(r).unwrap();
            for p in layout.shard_pieces(r) {
                prop_assert_eq!(p.rank, r);
                prop_assert_eq!(p.tensor_range.len(), p.shard_range.len());
                prop_assert!(!p.tensor_range.is_empty());
                let t_start = layout.tensor_range(p.tensor).unwrap().start;
                for (ti, si) in p.tensor_range.clone().zip(p.shard_range.clone()) {
                    let flat = shard.start + si;
                    prop_assert_eq!(flat, t_start + ti);
                    prop_assert_eq!(layout.locate(flat), Some((p.tensor, ti)));
                    seen[p.tensor][ti] += 1;
                }
                from_shards.push(p);
            }
        }
        prop_assert!(seen.iter().flatten().all(|&c| c == 1));
        let mut from_tensors: Vec<_> =
            (0..sizes.len()).flat_map(|t| layout.tensor_pieces(t)).collect();
        let key = |p: &headroom_zero::Piece| (p.tensor, p.rank);
        from_shards.sort_by_key(key);
        from_tensors.sort_by_key(key);
        prop_assert_eq!(from_shards, from_tensors);
        // Padding belongs to no tensor.
        for i in layout.numel()..layout.padded_len() {
            prop_assert_eq!(layout.locate(i), None);
        }
    }

    #[test]
    fn buckets_fill_in_backward_order(
        bytes in prop::collection::vec(prop_oneof![Just(0usize), 1usize..500], 0..12),
        bucket in 0usize..1200,
    ) {
        let plan = BucketPlan::new(&bytes, bucket);
        let order: Vec<usize> = plan.buckets().iter().flatten().copied().collect();
        let want: Vec<usize> = (0..bytes.len()).rev().filter(|&l| bytes[l] > 0).collect();
        prop_assert_eq!(order, want);
        let n = plan.buckets().len();
        for (i, b) in plan.buckets().iter().enumerate() {
            prop_assert!(!b.is_empty());
            let total: usize = b.iter().map(|&l| bytes[l]).sum();
            let without_last = total - bytes[*b.last().unwrap()];
            // A bucket closes as soon as it is full, and only then (except the last).
            prop_assert!(without_last < bucket || b.len() == 1);
            if i + 1 < n {
                prop_assert!(total >= bucket);
            }
            for &l in b {
                prop_assert_eq!(plan.bucket_of(l), Some(i));
            }
        }
        for (l, &b) in bytes.iter().enumerate() {
            if b == 0 {
                prop_assert_eq!(plan.bucket_of(l), None);
            }
        }
    }
}

#[test]
fn uneven_example_is_mapped_exactly() {
    // Tensors of 5, 0 and 4 elements over 4 ranks: 9 elements, padded to 12, shards of 3.
    let layout = FlatLayout::new(&[5, 0, 4], 4).unwrap();
    assert_eq!(
        (layout.padded_len(), layout.shard_len(), layout.padding()),
        (12, 3, 3)
    );
    let ranges: Vec<_> = layout
        .tensor_pieces(0)
        .into_iter()
        .map(|p| (p.rank, p.tensor_range, p.shard_range))
        .collect();
    assert_eq!(ranges, [(0, 0..3, 0..3), (1, 3..5, 0..2)]);
    let ranges: Vec<_> = layout
        .shard_pieces(1)
        .into_iter()
        .map(|p| (p.tensor, p.tensor_range, p.shard_range))
        .collect();
    assert_eq!(ranges, [(0, 3..5, 0..2), (2, 0..1, 2..3)]);
    assert!(
        layout.shard_pieces(3).is_empty(),
        "rank 3 holds only padding"
    );
    assert!(layout.tensor_pieces(1).is_empty());
    assert!(FlatLayout::new(&[1], 0).is_err());
    assert!(FlatLayout::new(&[usize::MAX, 1], 2).is_err());
}

#[test]
fn reduction_orders_are_the_documented_sums() {
    // grads[rank][micro], one element each.
    let g = vec![
        vec![vec![1e8f32], vec![1.0]],
        vec![vec![-1e8f32], vec![1.0]],
    ];
    // Ranks of local sums: (0 + 1e8 + 1) + (0 - 1e8 + 1) = 1e8 + -1e8 = 0 (the 1s are lost).
    assert_eq!(
        ReductionOrder::RankSumOfLocalAccumulations.reduce(&g),
        [0.0]
    );
    // Micro-batches of rank sums: 0 + (1e8 - 1e8) + (1 + 1) = 2.
    assert_eq!(ReductionOrder::MicroBatchesOfRankSums.reduce(&g), [2.0]);
}
