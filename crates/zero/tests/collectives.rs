//! The in-process group against the plain references, bitwise, and the counting wrapper.

mod common;

use common::{run_ranks, Rng};
use headroom_zero::{
    reference, ring_bytes, Buf, BufMut, Collective, CommDType, CommError, CommKind, CommThread,
    CountingCollective, InProcessGroup,
};

fn f32_inputs(world: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
    (0..world)
        .map(|r| {
            // Mixed magnitudes make the sum order visible in the low bits.
            let mut rng = Rng::new(seed * 31 + r as u64);
            (0..len)
                .map(|i| rng.uniform() * 10f32.powi((i % 7) as i32 - 3))
                .collect()
        })
        .collect()
}

fn bf16_inputs(world: usize, len: usize, seed: u64) -> Vec<Vec<u16>> {
    f32_inputs(world, len, seed)
        .into_iter()
        .map(|v| {
            v.into_iter()
                .map(|x| half::bf16::from_f32(x).to_bits())
                .collect()
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const LENGTHS: [usize; 4] = [1, 3, 7, 101];

#[test]
fn all_reduce_equals_reference_bitwise() {
    for world in 1..=5 {
        for len in LENGTHS {
            let inputs = f32_inputs(world, len, len as u64);
            let want = reference::all_reduce_f32(&inputs);
            let ins = inputs.clone();
            let got = run_ranks(world, move |mut c| {
                let mut buf = ins[c.rank()].clone();
                c.all_reduce(BufMut::F32(&mut buf)).unwrap();
                buf
            });
            for g in &got {
                assert_eq!(bits(g), bits(&want), "N = {world}, len = {len}");
            }

            let inputs = bf16_inputs(world, len, len as u64 + 1);
            let want = reference::all_reduce_bf16(&inputs);
            let got = run_ranks(world, move |mut c| {
                let mut buf = inputs[c.rank()].clone();
                c.all_reduce(BufMut::Bf16(&mut buf)).unwrap();
                buf
            });
            for g in &got {
                assert_eq!(g, &want, "bf16, N = {world}, len = {len}");
            }
        }
    }
}

#[test]
fn reduce_scatter_equals_reference_bitwise() {
    for world in 1..=5 {
        for k in LENGTHS {
            let inputs = f32_inputs(world, world * k, k as u64 + 2);
            let ins = inputs.clone();
            let got = run_ranks(world, move |mut c| {
                let mut out = vec![0.0f32; k];
                c.reduce_scatter(Buf::F32(&ins[c.rank()]), BufMut::F32(&mut out))
                    .unwrap();
                out
            });
            for (rank, g) in got.iter().enumerate() {
                let want = reference::reduce_scatter_f32(&inputs, rank);
                assert_eq!(bits(g), bits(&want), "N = {world}, k = {k}, rank {rank}");
            }

            let inputs = bf16_inputs(world, world * k, k as u64 + 3);
            let ins = inputs.clone();
            let got = run_ranks(world, move |mut c| {
                let mut out = vec![0u16; k];
                c.reduce_scatter(Buf::Bf16(&ins[c.rank()]), BufMut::Bf16(&mut out))
                    .unwrap();
                out
            });
            for (rank, g) in got.iter().enumerate() {
                assert_eq!(g, &reference::reduce_scatter_bf16(&inputs, rank));
            }
        }
    }
}

#[test]
fn all_gather_and_broadcast_equal_reference_bitwise() {
    for world in 1..=5 {
        for k in LENGTHS {
            let inputs = f32_inputs(world, k, k as u64 + 4);
            let want = reference::all_gather(&inputs);
            let ins = inputs.clone();
            let got = run_ranks(world, move |mut c| {
                let mut out = vec![0.0f32; world * k];
                c.all_gather(Buf::F32(&ins[c.rank()]), BufMut::F32(&mut out))
                    .unwrap();
                out
            });
            for g in &got {
                assert_eq!(bits(g), bits(&want), "N = {world}, k = {k}");
            }

            let inputs = bf16_inputs(world, k, k as u64 + 5);
            let want = reference::all_gather(&inputs);
            let ins = inputs.clone();
            let got = run_ranks(world, move |mut c| {
                let mut out = vec![0u16; world * k];
                c.all_gather(Buf::Bf16(&ins[c.rank()]), BufMut::Bf16(&mut out))
                    .unwrap();
                out
            });
            for g in &got {
                assert_eq!(g, &want);
            }

            for root in 0..world {
                let ins = inputs.clone();
                let got = run_ranks(world, move |mut c| {
                    let mut buf = ins[c.rank()].clone();
                    c.broadcast(BufMut::Bf16(&mut buf), root).unwrap();
                    c.barrier().unwrap();
                    buf
                });
                for g in &got {
                    assert_eq!(g, &inputs[root], "N = {world}, root {root}");
                }
            }
        }
    }
}

#[test]
fn wrong_lengths_and_roots_are_typed_errors_before_any_exchange() {
    let mut comms = InProcessGroup::create(2, std::time::Duration::from_secs(5)).unwrap();
    let c = &mut comms[0];
    let err = c
        .reduce_scatter(Buf::F32(&[1.0; 5]), BufMut::F32(&mut [0.0; 2]))
        .unwrap_err();
    assert!(matches!(
        err,
        CommError::Length {
            op: CommKind::ReduceScatter,
            expected: 4,
            got: 5,
            ..
        }
    ));
    let err = c
        .all_gather(Buf::F32(&[1.0; 2]), BufMut::Bf16(&mut [0; 4]))
        .unwrap_err();
    assert!(matches!(err, CommError::DTypeMismatch { .. }));
    let err = c.broadcast(BufMut::F32(&mut [0.0; 2]), 2).unwrap_err();
    assert!(matches!(err, CommError::InvalidRoot { root: 2, .. }));
    assert!(matches!(
        InProcessGroup::create(0, std::time::Duration::from_secs(1)),
        Err(CommError::EmptyGroup)
    ));
}

#[test]
fn ranks_calling_different_operations_get_a_mismatch_error() {
    let got = run_ranks(2, |mut c| {
        let mut buf = vec![1.0f32; 3 + c.rank()];
        c.all_reduce(BufMut::F32(&mut buf)).unwrap_err()
    });
    for e in got {
        assert!(
            matches!(
                e,
                CommError::Mismatch { .. } | CommError::GroupFailed { .. }
            ),
            "{e}"
        );
    }
}

#[test]
fn counting_collective_counts_ring_bytes_per_kind() {
    let got = run_ranks(4, |c| {
        let mut c = CountingCollective::new(c);
        let counters = c.counters();
        let mut buf = vec![1.0f32; 10];
        c.all_reduce(BufMut::F32(&mut buf)).unwrap();
        let mut out = vec![0.0f32; 3];
        c.reduce_scatter(Buf::F32(&[1.0; 12]), BufMut::F32(&mut out))
            .unwrap();
        let mut gathered = vec![0u16; 8];
        c.all_gather(Buf::Bf16(&[1; 2]), BufMut::Bf16(&mut gathered))
            .unwrap();
        c.broadcast(BufMut::F32(&mut buf), 1).unwrap();
        c.barrier().unwrap();
        (c.rank(), counters.snapshot())
    });
    for (rank, stats) in got {
        let ar = stats.kind(CommKind::AllReduce);
        assert_eq!((ar.calls, ar.payload_bytes), (1, 40));
        assert_eq!((ar.sent_bytes, ar.received_bytes), (60, 60)); // 2·3/4·40
        let rs = stats.kind(CommKind::ReduceScatter);
        assert_eq!((rs.payload_bytes, rs.sent_bytes), (48, 36)); // 3/4·48
        let ag = stats.kind(CommKind::AllGather);
        assert_eq!((ag.payload_bytes, ag.sent_bytes), (16, 12)); // bf16: 3/4·16
        let bc = stats.kind(CommKind::Broadcast);
        let expected = if rank == 1 { (40, 0) } else { (0, 40) };
        assert_eq!((bc.sent_bytes, bc.received_bytes), expected);
        assert_eq!(stats.kind(CommKind::Barrier).calls, 1);
        assert_eq!(stats.sent_bytes(), 60 + 36 + 12 + expected.0);
    }
    assert_eq!(
        ring_bytes(CommKind::AllReduce, 1, 100, CommDType::F32, false),
        (0, 0)
    );
}

#[test]
fn comm_thread_runs_in_submission_order_and_reports_panics() {
    let got = run_ranks(3, |c| {
        let thread = CommThread::spawn(c).unwrap();
        let rank = thread.rank();
        // Two overlapped operations, waited in reverse order.
        let first = thread
            .submit(move |c| {
                let mut buf = vec![rank as f32; 4];
                c.all_reduce(BufMut::F32(&mut buf)).map(|()| buf)
            })
            .unwrap();
        let second = thread
            .submit(move |c| {
                let mut out = vec![0.0f32; 3];
                c.all_gather(Buf::F32(&[rank as f32]), BufMut::F32(&mut out))
                    .map(|()| out)
            })
            .unwrap();
        let second = second.wait().unwrap().unwrap();
        let first = first.wait().unwrap().unwrap();
        let panicked = thread.run(|_| -> u32 { panic!("job failed") }).unwrap_err();
        (first, second, panicked)
    });
    for (first, second, panicked) in got {
        assert_eq!(first, vec![3.0; 4]);
        assert_eq!(second, vec![0.0, 1.0, 2.0]);
        assert!(
            matches!(&panicked, CommError::Panicked { message } if message == "job failed"),
            "{panicked}"
        );
    }
}
