//! A rank that leaves or hangs makes the others return a typed error within the time-out,
//! never hang. Bounds on elapsed time are generous: they only prove nobody waited forever.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use headroom_tensor::Cpu;
use headroom_zero::{
    BufMut, Collective, CommError, InProcessGroup, Stage, ZeroConfig, ZeroEngine, ZeroError,
};

const SIZES: [[usize; 2]; 3] = [[60, 6], [30, 5], [20, 2]];

fn layer_sizes() -> Vec<Vec<usize>> {
    SIZES.iter().map(|s| s.to_vec()).collect()
}

fn grads(l: usize) -> Vec<Vec<f32>> {
    SIZES[l].iter().map(|&n| vec![0.5; n]).collect()
}

/// The error a surviving rank sees when `gone` left: the loss itself, or the group's failure
/// caused by it (whichever rank noticed first).
fn is_caused_by_lost_rank(e: &ZeroError, gone: usize) -> bool {
    match e {
        ZeroError::Comm(CommError::PeerLost { rank, .. }) => *rank == gone,
        ZeroError::Comm(CommError::GroupFailed { reason }) => {
            reason.contains(&format!("rank {gone} left"))
        }
        _ => false,
    }
}

#[test]
fn a_rank_dropping_its_engine_mid_backward_fails_the_others_quickly() {
    for stage in Stage::ALL {
        let timeout = Duration::from_secs(60);
        let comms = InProcessGroup::create(3, timeout).unwrap();
        let threads: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                thread::spawn(move || {
                    let start = Instant::now();
                    let r = run_rank(stage, comm);
                    (r, start.elapsed())
                })
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(
            results[2].0.is_ok(),
            "{stage}: the leaving rank itself is fine"
        );
        for (rank, (r, elapsed)) in results.iter().enumerate().take(2) {
            let err = r.as_ref().expect_err("a survivor must see an error");
            assert!(
                is_caused_by_lost_rank(err, 2),
                "{stage}, rank {rank}: {err}"
            );
            assert!(*elapsed < Duration::from_secs(30), "{stage}: {elapsed:?}");
        }
    }
}

fn run_rank(stage: Stage, comm: headroom_zero::InProcessComm) -> Result<(), ZeroError> {
    let rank = comm.rank();
    let config = ZeroConfig::new(stage).with_bucket_bytes(0);
    let mut zero = ZeroEngine::new(Cpu::new(), comm, &layer_sizes(), config)?;
    // One complete step, then rank 2 leaves half-way through the next backward.
    for step in 0..2 {
        for l in (0..SIZES.len()).rev() {
            if step == 1 && l == 1 && rank == 2 {
                drop(zero);
                return Ok(());
            }
            zero.gather(l)?;
            let g = grads(l);
            zero.push_grads(l, &[&g[0], &g[1]])?;
            zero.release(l)?;
        }
        zero.step(&mut Sgd)?;
    }
    Ok(())
}

#[test]
fn a_panicking_rank_is_a_lost_peer_not_a_hang() {
    let comms = InProcessGroup::create(2, Duration::from_secs(60)).unwrap();
    let mut comms = comms.into_iter();
    let (c0, c1) = (comms.next().unwrap(), comms.next().unwrap());
    let t1 = thread::spawn(move || {
        let _comm = c1;
        panic!("rank 1 fails before its all-reduce");
    });
    let t0 = thread::spawn(move || {
        let mut c0 = c0;
        let start = Instant::now();
        let err = c0.all_reduce(BufMut::F32(&mut [1.0; 4])).unwrap_err();
        (err, start.elapsed())
    });
    assert!(t1.join().is_err());
    let (err, elapsed) = t0.join().unwrap();
    assert!(matches!(err, CommError::PeerLost { rank: 1, .. }), "{err}");
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
}

#[test]
fn a_hung_rank_times_out_the_others_and_the_group_stays_failed() {
    let timeout = Duration::from_millis(300);
    let comms = InProcessGroup::create(3, timeout).unwrap();
    let (release, hung) = mpsc::channel::<()>();
    let mut comms = comms.into_iter();
    let c0 = comms.next().unwrap();
    let c1 = comms.next().unwrap();
    let c2 = comms.next().unwrap();
    // Rank 2 keeps its communicator but never calls until the others have failed.
    let t2 = thread::spawn(move || {
        let mut c2 = c2;
        hung.recv().unwrap();
        c2.barrier().unwrap_err()
    });
    let survivors: Vec<_> = [c0, c1]
        .into_iter()
        .map(|mut c| {
            thread::spawn(move || {
                let start = Instant::now();
                let err = c.all_reduce(BufMut::F32(&mut [1.0; 3])).unwrap_err();
                (err, start.elapsed())
            })
        })
        .collect();
    for t in survivors {
        let (err, elapsed) = t.join().unwrap();
        match &err {
            CommError::Timeout {
                missing, waited, ..
            } => {
                assert_eq!(missing, &[2]);
                assert!(*waited >= timeout);
            }
            CommError::GroupFailed { reason } => assert!(reason.contains("timed out")),
            other => panic!("unexpected error {other}"),
        }
        assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
    }
    release.send(()).unwrap();
    let late = t2.join().unwrap();
    assert!(matches!(late, CommError::GroupFailed { .. }), "{late}");
}

struct Sgd;
impl headroom_zero::ShardOptimizer for Sgd {
    fn state_per_param(&self) -> usize {
        0
    }
    fn update(
        &mut self,
        _: &headroom_zero::UpdatePiece,
        params: &mut [f32],
        grads: &[f32],
        _: &mut [f32],
    ) -> Result<(), headroom_tensor::BoxedError> {
        for (p, g) in params.iter_mut().zip(grads) {
            *p -= 0.1 * g;
        }
        Ok(())
    }
}
