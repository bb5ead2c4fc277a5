//! `NcclCollective` (feature `cuda`). Without a GPU: the id's exchange formats round-trip, a
//! missing id file times out, and opening a communicator is a typed error, never a panic. With
//! GPUs (ignored until a machine with them runs it): one rank's collectives are identities,
//! and two ranks on two GPUs give the in-process group's bits for every collective.
#![cfg(feature = "cuda")]

use std::time::Duration;

use headroom_zero::{reference, Buf, BufMut, Collective, CommError, NcclCollective, NcclId};

fn sample_id() -> NcclId {
    let mut id = [0u8; 128];
    for (i, b) in id.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(37).wrapping_add(11);
    }
    NcclId(id)
}

#[test]
fn the_id_travels_as_floats_and_as_a_file() {
    let id = sample_id();
    assert_eq!(NcclId::from_f32s(&id.to_f32s()), id);
    let dir = std::env::temp_dir().join(format!("headroom-nccl-id-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("id");
    id.publish(&path).unwrap();
    assert_eq!(NcclId::wait_for(&path, Duration::from_secs(1)).unwrap(), id);
    // A file that never appears is a time-out; one of the wrong size is an error.
    let missing = NcclId::wait_for(&dir.join("never"), Duration::from_millis(120));
    assert!(
        matches!(missing, Err(CommError::Timeout { .. })),
        "{missing:?}"
    );
    std::fs::write(dir.join("short"), [1u8; 7]).unwrap();
    assert!(NcclId::wait_for(&dir.join("short"), Duration::from_secs(1)).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_a_gpu_a_communicator_is_a_typed_error() {
    if headroom_cuda::device_count() > 0 {
        return; // the GPU tests below cover this machine
    }
    // Making an id loads libnccl: an error where it is missing, never a panic.
    let _ = NcclId::new();
    let r = NcclCollective::new(0, 0, 1, sample_id(), Duration::from_secs(5));
    assert!(matches!(r, Err(CommError::Backend { .. })), "{r:?}");
    assert!(matches!(
        NcclCollective::new(0, 2, 2, sample_id(), Duration::from_secs(5)),
        Err(CommError::EmptyGroup)
    ));
}

fn input(r: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + r * 13) % 23) as f32 * 0.37 - 3.1 + (i % 5) as f32 * 1e-3)
        .collect()
}

#[test]
#[ignore = "needs a GPU with libnccl"]
fn one_rank_collectives_are_identities() {
    let id = NcclId::new().unwrap();
    let mut c = NcclCollective::new(0, 0, 1, id, Duration::from_secs(30)).unwrap();
    let x = input(0, 37);
    let mut y = x.clone();
    c.all_reduce(BufMut::F32(&mut y)).unwrap();
    assert_eq!(y, x);
    let mut out = vec![0.0; 37];
    c.all_gather(Buf::F32(&x), BufMut::F32(&mut out)).unwrap();
    assert_eq!(out, x);
    c.reduce_scatter(Buf::F32(&x), BufMut::F32(&mut out))
        .unwrap();
    assert_eq!(out, x);
    c.barrier().unwrap();
}

#[test]
#[ignore = "needs two GPUs with libnccl"]
fn two_ranks_on_two_gpus_give_the_in_process_bits() {
    // Rank 1 alone would fail on a one-GPU machine, and rank 0 then wait out the time-out.
    assert!(headroom_cuda::device_count() >= 2, "needs two GPUs");
    let id = NcclId::new().unwrap();
    let world = 2;
    let len = 2 * 19;
    let results: Vec<_> = (0..world)
        .map(|r| {
            std::thread::spawn(move || {
                let mut c = NcclCollective::new(r, r, world, id, Duration::from_secs(60)).unwrap();
                let x = input(r, len);
                let mut sum = x.clone();
                c.all_reduce(BufMut::F32(&mut sum)).unwrap();
                let mut part = vec![0.0; len / world];
                c.reduce_scatter(Buf::F32(&x), BufMut::F32(&mut part))
                    .unwrap();
                let mut gathered = vec![0.0; len * world];
                c.all_gather(Buf::F32(&x), BufMut::F32(&mut gathered))
                    .unwrap();
                let mut b = if r == 1 { x.clone() } else { vec![0.0; len] };
                c.broadcast(BufMut::F32(&mut b), 1).unwrap();
                (sum, part, gathered, b)
            })
        })
        .map(|h| h.join().unwrap())
        .collect();
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, len)).collect();
    let want_sum = reference::all_reduce_f32(&inputs);
    for (r, (sum, part, gathered, b)) in results.into_iter().enumerate() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&sum), bits(&want_sum));
        assert_eq!(
            bits(&part),
            bits(&want_sum[r * len / world..(r + 1) * len / world])
        );
        assert_eq!(gathered, inputs.concat());
        assert_eq!(b, inputs[1]);
    }
}

/// Two ranks on the same GPU — a launcher that gave every process device 0, say. NCCL refuses
/// that ("duplicate GPU") in the versions we know; either way neither rank may hang past the
/// time-out or panic: both get a typed error in time, or, where NCCL accepts it, the
/// in-process group's bits.
#[test]
#[ignore = "needs a GPU with libnccl"]
fn two_ranks_on_one_gpu_fail_in_time_or_agree() {
    let id = NcclId::new().unwrap();
    let world = 2;
    let len = 2 * 11;
    let timeout = Duration::from_secs(20);
    let started = std::time::Instant::now();
    let results: Vec<_> = (0..world)
        .map(|r| {
            std::thread::spawn(move || {
                let mut c = NcclCollective::new(0, r, world, id, timeout)?;
                let mut sum = input(r, len);
                c.all_reduce(BufMut::F32(&mut sum))?;
                Ok::<_, CommError>(sum)
            })
        })
        .map(|h| h.join().expect("a rank panicked"))
        .collect();
    // Both ranks time out at most once each: creating the communicator and the all-reduce.
    assert!(
        started.elapsed() < 2 * timeout + Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, len)).collect();
    let want = reference::all_reduce_f32(&inputs);
    for (r, result) in results.into_iter().enumerate() {
        match result {
            Ok(sum) => assert_eq!(
                sum.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "rank {r}"
            ),
            Err(e) => {
                println!("rank {r}: {e}");
                assert!(
                    matches!(
                        e,
                        CommError::Backend { .. }
                            | CommError::SetupTimeout { .. }
                            | CommError::Timeout { .. }
                            | CommError::PeerLost { .. }
                    ),
                    "rank {r}: {e:?}"
                );
            }
        }
    }
}
