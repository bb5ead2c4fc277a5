//! Run under `mpirun -n N` (N = 1, 2, 3, …): every process is one rank and runs the same
//! checks in sequence; the exit status is the verdict. Checks:
//!
//! 1. every collective equals headroom-zero's plain references bitwise (f32 and bf16, odd
//!    lengths, every broadcast root);
//! 2. `ZeroEngine` stages 0–3, fp32 and mixed bf16, on MPI equal the same engine on an
//!    in-process group of N threads inside this process, bit for bit (which
//!    `headroom-zero`'s own tests pin to one process over the concatenated batch);
//! 3. a rank that does not show up makes the others return `CommError::Timeout`.
//!
//! `HEADROOM_MPI_CHECK=kill` instead makes the last rank exit abruptly mid-step: the others
//! must not hang (mpirun ends the job, or the survivors report the time-out) and mpirun must
//! exit non-zero; `.ci/run` checks that.
//!
//! Under `cargo test` without mpirun this is a singleton MPI job (N = 1).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use headroom_tensor::{BoxedError, Cpu};
use headroom_zero::{
    reference, Buf, BufMut, Collective, CommError, InProcessGroup, Precision, ShardOptimizer,
    Stage, UpdatePiece, ZeroConfig, ZeroEngine,
};
use headroom_zero_mpi::{initialize, MpiCollective};

type Check = Result<(), String>;

fn ensure(cond: bool, what: impl FnOnce() -> String) -> Check {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

/// Rank `r`'s input: mixed magnitudes, so the summation order shows in the low bits.
fn input(r: usize, len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (r as u64 + 1);
    (0..len)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            u * 10f32.powi((i % 7) as i32 - 3)
        })
        .collect()
}

fn to_bf16(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn check_collectives(comm: &mut MpiCollective) -> Check {
    let (rank, world) = (comm.rank(), comm.world_size());
    let err = |e: CommError| e.to_string();
    for len in [1usize, 3, 7, 101] {
        let all: Vec<Vec<f32>> = (0..world).map(|r| input(r, len, len as u64)).collect();
        let mut buf = all[rank].clone();
        comm.all_reduce(BufMut::F32(&mut buf)).map_err(err)?;
        ensure(bits(&buf) == bits(&reference::all_reduce_f32(&all)), || {
            format!("all_reduce f32, len {len}")
        })?;
        let all16: Vec<Vec<u16>> = all.iter().map(|v| to_bf16(v)).collect();
        let mut buf = all16[rank].clone();
        comm.all_reduce(BufMut::Bf16(&mut buf)).map_err(err)?;
        ensure(buf == reference::all_reduce_bf16(&all16), || {
            format!("all_reduce bf16, len {len}")
        })?;

        let big: Vec<Vec<f32>> = (0..world).map(|r| input(r, len * world, 7)).collect();
        let mut out = vec![0.0f32; len];
        comm.reduce_scatter(Buf::F32(&big[rank]), BufMut::F32(&mut out))
            .map_err(err)?;
        ensure(
            bits(&out) == bits(&reference::reduce_scatter_f32(&big, rank)),
            || format!("reduce_scatter f32, k {len}"),
        )?;
        let big16: Vec<Vec<u16>> = big.iter().map(|v| to_bf16(v)).collect();
        let mut out = vec![0u16; len];
        comm.reduce_scatter(Buf::Bf16(&big16[rank]), BufMut::Bf16(&mut out))
            .map_err(err)?;
        ensure(out == reference::reduce_scatter_bf16(&big16, rank), || {
            format!("reduce_scatter bf16, k {len}")
        })?;

        let mut out = vec![0.0f32; len * world];
        comm.all_gather(Buf::F32(&all[rank]), BufMut::F32(&mut out))
            .map_err(err)?;
        ensure(bits(&out) == bits(&reference::all_gather(&all)), || {
            format!("all_gather, k {len}")
        })?;
        for root in 0..world {
            let mut buf = all16[rank].clone();
            comm.broadcast(BufMut::Bf16(&mut buf), root).map_err(err)?;
            ensure(buf == all16[root], || format!("broadcast from {root}"))?;
        }
        comm.barrier().map_err(err)?;
    }
    Ok(())
}

/// SGD with momentum: an elementwise optimizer with state.
struct Momentum;
impl ShardOptimizer for Momentum {
    fn state_per_param(&self) -> usize {
        1
    }
    fn update(
        &mut self,
        _: &UpdatePiece,
        p: &mut [f32],
        g: &[f32],
        s: &mut [f32],
    ) -> Result<(), BoxedError> {
        for ((p, &g), m) in p.iter_mut().zip(g).zip(s) {
            *m = 0.9 * *m + g;
            *p -= 0.05 * *m;
        }
        Ok(())
    }
}

const SIZES: [[usize; 2]; 3] = [[35, 5], [27, 3], [13, 1]];

/// Four steps of two micro-batches on a chain whose gradients depend on the parameters and
/// on the rank's data; returns the final parameters.
fn train(
    comm: impl Collective + 'static,
    stage: Stage,
    precision: Precision,
) -> Result<Vec<Vec<f32>>, String> {
    let rank = comm.rank();
    let layers: Vec<Vec<usize>> = SIZES.iter().map(|s| s.to_vec()).collect();
    let config = ZeroConfig::new(stage)
        .with_bucket_bytes(200)
        .with_precision(precision);
    let mut zero = ZeroEngine::new(Cpu::new(), comm, &layers, config).map_err(|e| e.to_string())?;
    for (l, s) in SIZES.iter().enumerate() {
        let w = input(99, s[0], l as u64);
        let b = input(98, s[1], l as u64);
        zero.load_layer(l, &[&w, &b]).map_err(|e| e.to_string())?;
    }
    let run = |zero: &mut ZeroEngine| -> headroom_zero::Result<Vec<Vec<f32>>> {
        for step in 0..4u64 {
            for micro in 0..2u64 {
                for l in (0..SIZES.len()).rev() {
                    zero.gather(l)?;
                    if l > 0 {
                        zero.prefetch(l - 1)?;
                    }
                    let seed = step * 100 + micro * 10 + l as u64;
                    let grads: Vec<Vec<f32>> = (0..2)
                        .map(|t| {
                            let p: Vec<f32> = match precision {
                                Precision::Fp32 => zero.tensor(l, t)?.to_vec(),
                                Precision::MixedBf16 => zero
                                    .tensor_bf16(l, t)?
                                    .iter()
                                    .map(|&b| half::bf16::from_bits(b).to_f32())
                                    .collect(),
                            };
                            let target = input(rank, p.len(), seed + t as u64);
                            Ok(p.iter().zip(&target).map(|(p, x)| (p - x) * 0.1).collect())
                        })
                        .collect::<headroom_zero::Result<_>>()?;
                    zero.push_grads(l, &[&grads[0], &grads[1]])?;
                    zero.release(l)?;
                }
            }
            zero.step(&mut Momentum)?;
        }
        zero.full_parameters()
    };
    run(&mut zero).map_err(|e| e.to_string())
}

fn check_engine(universe: &mpi::environment::Universe, rank: usize, world: usize) -> Check {
    for (stage, precision) in Stage::ALL
        .into_iter()
        .flat_map(|s| [(s, Precision::Fp32), (s, Precision::MixedBf16)])
    {
        let comm =
            MpiCollective::world(universe, Duration::from_secs(60)).map_err(|e| e.to_string())?;
        let on_mpi = train(comm, stage, precision)?;
        // The same run on N threads of this process.
        let comms =
            InProcessGroup::create(world, Duration::from_secs(60)).map_err(|e| e.to_string())?;
        let threads: Vec<_> = comms
            .into_iter()
            .map(|c| std::thread::spawn(move || train(c, stage, precision)))
            .collect();
        let mut in_process = Vec::new();
        for t in threads {
            in_process.push(t.join().map_err(|_| "rank thread panicked".to_string())??);
        }
        let want = Arc::new(in_process.swap_remove(rank));
        for (l, (got, want)) in on_mpi.iter().zip(want.iter()).enumerate() {
            ensure(bits(got) == bits(want), || {
                format!("{stage} {precision:?}: layer {l} on MPI differs from the in-process group")
            })?;
        }
    }
    Ok(())
}

fn check_timeout(universe: &mpi::environment::Universe, rank: usize, world: usize) -> Check {
    if world < 2 {
        return Ok(());
    }
    let timeout = Duration::from_millis(500);
    let mut comm = MpiCollective::world(universe, timeout).map_err(|e| e.to_string())?;
    if rank == world - 1 {
        // Late by far more than the time-out; joining then lets the others' barrier finish.
        std::thread::sleep(timeout * 6);
        comm.barrier().map_err(|e| e.to_string())?;
        return Ok(());
    }
    let err = comm.barrier().expect_err("a missing rank must time out");
    ensure(matches!(err, CommError::Timeout { .. }), || {
        format!("unexpected {err}")
    })?;
    let again = comm
        .barrier()
        .expect_err("a failed communicator stays failed");
    ensure(matches!(again, CommError::GroupFailed { .. }), || {
        format!("unexpected {again}")
    })?;
    ensure(comm.wait_idle(Duration::from_secs(120)), || {
        "the late rank never arrived".to_string()
    })
}

fn kill_mid_step(universe: &mpi::environment::Universe, rank: usize, world: usize) -> ExitCode {
    let comm = match MpiCollective::world(universe, Duration::from_secs(20)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rank {rank}: {e}");
            return ExitCode::from(2);
        }
    };
    let layers = vec![vec![1000usize]];
    let mut zero = match ZeroEngine::new(Cpu::new(), comm, &layers, ZeroConfig::new(Stage::Zero3)) {
        Ok(z) => z,
        Err(e) => {
            eprintln!("rank {rank}: {e}");
            return ExitCode::from(2);
        }
    };
    if rank == world - 1 {
        eprintln!("rank {rank}: exiting abruptly mid-step");
        std::process::exit(9);
    }
    match zero
        .gather(0)
        .and_then(|()| zero.push_grads(0, &[&[0.0; 1000]]))
    {
        Ok(()) => {
            eprintln!("rank {rank}: a step completed without the dead rank");
            ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("rank {rank}: stopped with: {e}");
            // The worker is stuck inside MPI: leave without finalising.
            std::process::exit(4);
        }
    }
}

fn main() -> ExitCode {
    let universe = match initialize() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("MPI: {e}");
            return ExitCode::FAILURE;
        }
    };
    let world_comm = universe.world();
    let (rank, world) = {
        use mpi::traits::Communicator;
        (world_comm.rank() as usize, world_comm.size() as usize)
    };
    if std::env::var("HEADROOM_MPI_CHECK").as_deref() == Ok("kill") {
        return kill_mid_step(&universe, rank, world);
    }
    let result = (|| -> Check {
        let mut comm =
            MpiCollective::world(&universe, Duration::from_secs(60)).map_err(|e| e.to_string())?;
        check_collectives(&mut comm)?;
        drop(comm);
        check_engine(&universe, rank, world)?;
        check_timeout(&universe, rank, world)
    })();
    match result {
        Ok(()) => {
            println!(
                "rank {rank}/{world}: collectives, engine stages 0-3 (fp32, bf16) and time-out: ok"
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rank {rank}/{world}: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
