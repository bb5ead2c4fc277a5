//! # headroom-zero-mpi
//!
//! [`headroom_zero::Collective`] on MPI (the `mpi` crate, rsmpi, on Open MPI): one process per
//! rank, launched by `mpirun`. Results are bitwise identical to headroom-zero's in-process
//! group: sums are never left to MPI's reduction algorithms (whose order is up to the
//! library); a reduce-scatter is an all-to-all followed by a local sum in rank order, and an
//! all-reduce is that plus an all-gather, which moves the same bytes as a ring all-reduce.
//!
//! Every operation runs on a worker thread that owns copies of the buffers; the caller waits
//! at most the time-out and gets [`CommError::Timeout`] instead of hanging on a rank that is
//! gone or stuck (MPI itself has no time-outs). After a time-out the communicator is failed
//! and refuses further operations with [`CommError::GroupFailed`].
//!
//! ```no_run
//! use std::time::Duration;
//! use headroom_zero::{BufMut, Collective};
//! use headroom_zero_mpi::{initialize, MpiCollective};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let universe = initialize()?; // keep it alive until every MpiCollective is dropped
//! let mut comm = MpiCollective::world(&universe, Duration::from_secs(60))?;
//! let mut x = vec![comm.rank() as f32; 4];
//! comm.all_reduce(BufMut::F32(&mut x))?;
//! let n = comm.world_size() as f32;
//! assert_eq!(x, vec![n * (n - 1.0) / 2.0; 4]);
//! # Ok(())
//! # }
//! ```
//!
//! Run a program using it with `mpirun -n 4 target/release/my-trainer`; see the workspace
//! README for several machines. MPI must be initialised with at least
//! `Threading::Serialized` ([`initialize`] does that), because MPI is called from the worker
//! thread; make no other MPI calls while an `MpiCollective` exists.

use std::time::Duration;

use half::bf16;
use headroom_zero::{
    check_scatter_gather, Buf, BufMut, Collective, CommError, CommKind, TimedWorker,
};
/// rsmpi's handle on the initialised MPI library: MPI is finalised when it is dropped, so
/// keep it alive for as long as any [`MpiCollective`] is in use.
pub use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, CommunicatorCollectives, Root};
use mpi::Threading;

fn backend(message: impl Into<String>) -> CommError {
    CommError::Backend {
        source: message.into().into(),
    }
}

/// Initialise MPI for use from a communication thread (`MPI_THREAD_SERIALIZED` or more).
/// Keep the returned universe alive until every [`MpiCollective`] is dropped: dropping it
/// finalises MPI.
pub fn initialize() -> Result<Universe, CommError> {
    let (universe, provided) = mpi::initialize_with_threading(Threading::Serialized)
        .ok_or_else(|| backend("MPI was already initialised"))?;
    if provided < Threading::Serialized {
        return Err(backend(format!(
            "the MPI library provides only {provided:?} threading; Serialized is needed"
        )));
    }
    Ok(universe)
}

/// One rank's end of `MPI_COMM_WORLD`, as a [`Collective`].
#[derive(Debug)]
pub struct MpiCollective {
    rank: usize,
    world: usize,
    /// The communicator on its own thread: every operation waits at most the time-out.
    worker: TimedWorker<SimpleCommunicator>,
}

/// Owned element data moved to and from the worker.
enum Data {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

impl Data {
    fn of(buf: Buf<'_>) -> Data {
        match buf {
            Buf::F32(s) => Data::F32(s.to_vec()),
            Buf::Bf16(s) => Data::Bf16(s.to_vec()),
        }
    }
    fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::Bf16(v) => v.len(),
        }
    }
    fn zeros_like(&self, len: usize) -> Data {
        match self {
            Data::F32(_) => Data::F32(vec![0.0; len]),
            Data::Bf16(_) => Data::Bf16(vec![0; len]),
        }
    }
    fn padded(mut self, len: usize) -> Data {
        match &mut self {
            Data::F32(v) => v.resize(len, 0.0),
            Data::Bf16(v) => v.resize(len, 0),
        }
        self
    }
    fn write_into(&self, out: BufMut<'_>) {
        match (self, out) {
            (Data::F32(src), BufMut::F32(dst)) => {
                dst.iter_mut().zip(src).for_each(|(d, &s)| *d = s);
            }
            (Data::Bf16(src), BufMut::Bf16(dst)) => {
                dst.iter_mut().zip(src).for_each(|(d, &s)| *d = s);
            }
            // The dtypes were checked before the exchange.
            _ => {}
        }
    }
}

fn all_to_all(comm: &SimpleCommunicator, send: &Data) -> Data {
    let mut recv = send.zeros_like(send.len());
    match (send, &mut recv) {
        (Data::F32(s), Data::F32(r)) => comm.all_to_all_into(&s[..], &mut r[..]),
        (Data::Bf16(s), Data::Bf16(r)) => comm.all_to_all_into(&s[..], &mut r[..]),
        _ => {}
    }
    recv
}

fn all_gather(comm: &SimpleCommunicator, send: &Data, world: usize) -> Data {
    let mut recv = send.zeros_like(send.len() * world);
    match (send, &mut recv) {
        (Data::F32(s), Data::F32(r)) => comm.all_gather_into(&s[..], &mut r[..]),
        (Data::Bf16(s), Data::Bf16(r)) => comm.all_gather_into(&s[..], &mut r[..]),
        _ => {}
    }
    recv
}

/// Sum the `world` blocks of `recv` (block `r` came from rank `r`) in rank order: f32 adds
/// for f32; for bf16, f32 accumulation and one rounding, as the in-process group does.
fn sum_blocks(recv: &Data, world: usize) -> Data {
    let k = recv.len() / world.max(1);
    match recv {
        Data::F32(v) => {
            let mut out = v.get(..k).unwrap_or(&[]).to_vec();
            for block in v.chunks_exact(k.max(1)).skip(1).take(world - 1) {
                out.iter_mut().zip(block).for_each(|(o, &x)| *o += x);
            }
            Data::F32(out)
        }
        Data::Bf16(v) => {
            let mut acc: Vec<f32> = v
                .get(..k)
                .unwrap_or(&[])
                .iter()
                .map(|&b| bf16::from_bits(b).to_f32())
                .collect();
            for block in v.chunks_exact(k.max(1)).skip(1).take(world - 1) {
                acc.iter_mut()
                    .zip(block)
                    .for_each(|(a, &x)| *a += bf16::from_bits(x).to_f32());
            }
            Data::Bf16(
                acc.into_iter()
                    .map(|a| bf16::from_f32(a).to_bits())
                    .collect(),
            )
        }
    }
}

impl MpiCollective {
    /// The world communicator (`MPI_COMM_WORLD`) with a worker thread; an operation waits at
    /// most `timeout` for the other ranks.
    pub fn world(_universe: &Universe, timeout: Duration) -> Result<Self, CommError> {
        let (worker, (rank, size)) =
            TimedWorker::spawn("headroom-zero-mpi", "MPI", timeout, || {
                let comm = SimpleCommunicator::world();
                let info = (comm.rank(), comm.size());
                Ok((comm, info))
            })?;
        let (rank, world) = (
            usize::try_from(rank).map_err(|_| backend("negative MPI rank"))?,
            usize::try_from(size).map_err(|_| backend("negative MPI size"))?,
        );
        Ok(MpiCollective {
            rank,
            world,
            worker,
        })
    }

    /// The time-out of one operation.
    pub fn timeout(&self) -> Duration {
        self.worker.timeout()
    }

    /// After a time-out: wait up to `limit` for the operation that timed out to finish after
    /// all (a late rank arriving), so that the communicator can be dropped, and MPI
    /// finalised, without a thread still inside MPI. Returns whether the worker is idle. The
    /// communicator stays failed either way.
    pub fn wait_idle(&mut self, limit: Duration) -> bool {
        self.worker.wait_idle(limit)
    }

    /// Run `f` on the worker and wait at most the time-out.
    fn call<R, F>(&mut self, op: CommKind, f: F) -> Result<R, CommError>
    where
        R: Send + 'static,
        F: FnOnce(&SimpleCommunicator) -> R + Send + 'static,
    {
        self.worker.call(op, move |comm| Ok(f(comm)))
    }
}

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&mut self, buf: BufMut<'_>) -> Result<(), CommError> {
        let world = self.world;
        let n = buf.len();
        let q = n.div_ceil(world);
        // Padded so every rank owns an equal chunk: the all-to-all sends chunk r to rank r.
        let send = Data::of(buf.as_buf()).padded(q * world);
        let full = self.call(CommKind::AllReduce, move |comm| {
            let mine = sum_blocks(&all_to_all(comm, &send), world);
            all_gather(comm, &mine, world)
        })?;
        full.write_into(buf);
        Ok(())
    }

    fn reduce_scatter(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        let op = CommKind::ReduceScatter;
        let world = self.world;
        check_scatter_gather(op, world, &input, &output)?;
        let send = Data::of(input);
        let mine = self.call(op, move |comm| sum_blocks(&all_to_all(comm, &send), world))?;
        mine.write_into(output);
        Ok(())
    }

    fn all_gather(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        let op = CommKind::AllGather;
        let world = self.world;
        check_scatter_gather(op, world, &input, &output)?;
        let send = Data::of(input);
        let full = self.call(op, move |comm| all_gather(comm, &send, world))?;
        full.write_into(output);
        Ok(())
    }

    fn broadcast(&mut self, buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        let op = CommKind::Broadcast;
        let world = self.world;
        let root_i32 = i32::try_from(root)
            .ok()
            .filter(|_| root < world)
            .ok_or(CommError::InvalidRoot { op, root, world })?;
        let mut data = Data::of(buf.as_buf());
        let data = self.call(op, move |comm| {
            let root = comm.process_at_rank(root_i32);
            match &mut data {
                Data::F32(v) => root.broadcast_into(&mut v[..]),
                Data::Bf16(v) => root.broadcast_into(&mut v[..]),
            }
            data
        })?;
        data.write_into(buf);
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.call(CommKind::Barrier, |comm| comm.barrier())
    }
}
