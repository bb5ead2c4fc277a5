//! [`CommThread`]: overlapped collectives. One thread owns the communicator and runs
//! submitted operations in submission order, so computation continues while a gradient
//! bucket is reduce-scattered or the next layer's parameters are gathered.
//!
//! Why a single issuing thread: MPI and NCCL match operations across ranks by their order, so
//! a rank must never issue two collectives concurrently from different threads. Blocking
//! operations go through the same queue ([`CommThread::run`]).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::error::CommError;
use crate::Collective;

type Job = Box<dyn FnOnce(&mut dyn Collective) + Send>;

/// A communication thread owning one rank's [`Collective`]. Dropping it finishes the queued
/// operations, then drops the collective (which, for the in-process group, tells the peers
/// this rank has left).
#[derive(Debug)]
pub struct CommThread {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    rank: usize,
    world: usize,
}

/// The pending result of a submitted operation.
#[derive(Debug)]
#[must_use = "an operation's errors only surface through wait"]
pub struct Handle<R> {
    result: mpsc::Receiver<Result<R, CommError>>,
}

impl<R> Handle<R> {
    /// Block until the operation has run and return its result. A panic inside the operation
    /// is [`CommError::Panicked`]; a communication thread that died is
    /// [`CommError::ThreadLost`].
    pub fn wait(self) -> Result<R, CommError> {
        self.result.recv().unwrap_or(Err(CommError::ThreadLost))
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic".to_string()
    }
}

impl CommThread {
    /// Start the thread, moving `comm` onto it.
    pub fn spawn<C: Collective + 'static>(comm: C) -> Result<Self, CommError> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("headroom-zero-comm-{rank}"))
            .spawn(move || {
                let mut comm = comm;
                for job in rx {
                    job(&mut comm);
                }
            })
            .map_err(|_| CommError::ThreadLost)?;
        Ok(CommThread {
            jobs: Some(tx),
            thread: Some(thread),
            rank,
            world,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Queue `op` to run on the communication thread after everything submitted before it.
    /// Buffers travel by value: move them into the closure and return them from it.
    pub fn submit<R, F>(&self, op: F) -> Result<Handle<R>, CommError>
    where
        R: Send + 'static,
        F: FnOnce(&mut dyn Collective) -> R + Send + 'static,
    {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |comm| {
            let result =
                catch_unwind(AssertUnwindSafe(|| op(comm))).map_err(|p| CommError::Panicked {
                    message: panic_message(p.as_ref()),
                });
            // The handle may have been dropped; the operation still had to run for the peers.
            let _ = tx.send(result);
        });
        self.jobs
            .as_ref()
            .ok_or(CommError::ThreadLost)?
            .send(job)
            .map_err(|_| CommError::ThreadLost)?;
        Ok(Handle { result: rx })
    }

    /// Run `op` on the communication thread and wait for it.
    pub fn run<R, F>(&self, op: F) -> Result<R, CommError>
    where
        R: Send + 'static,
        F: FnOnce(&mut dyn Collective) -> R + Send + 'static,
    {
        self.submit(op)?.wait()
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            // A panic on the thread was already reported through the handles.
            let _ = t.join();
        }
    }
}
