//! [`TimedWorker`]: a communicator that lives on a thread of its own, and operations on it that
//! wait at most a time-out — how the MPI and NCCL collectives turn a peer that died (whose
//! blocking collective would never return) into [`CommError::Timeout`] instead of a hang.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::collective::CommKind;
use crate::error::CommError;

type Job<C> = Box<dyn FnOnce(&C) + Send>;

/// A communicator `C` owned by a worker thread. Each [`call`](TimedWorker::call) runs on that
/// thread; the caller waits at most the time-out. After a time-out, a backend error or a lost
/// thread the worker is *failed*: every later call returns [`CommError::GroupFailed`] with the
/// first reason, because a collective that one rank abandoned cannot be resumed. Dropping the
/// worker joins the thread unless it may still be stuck inside a call that never returns.
pub struct TimedWorker<C: 'static> {
    /// The backend's name, for messages ("MPI", "NCCL").
    backend: &'static str,
    timeout: Duration,
    jobs: Option<mpsc::Sender<Job<C>>>,
    thread: Option<JoinHandle<()>>,
    /// Why the communicator is unusable; `None` while healthy.
    failed: Option<String>,
    /// Whether the thread may still be inside a call that never returns.
    stuck: bool,
}

impl<C: 'static> std::fmt::Debug for TimedWorker<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimedWorker")
            .field("backend", &self.backend)
            .field("timeout", &self.timeout)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl<C: 'static> TimedWorker<C> {
    /// Start thread `name`, where `init` makes the communicator (communicators are often
    /// bound to the thread that made them) and returns it with whatever the caller needs to
    /// learn from it (its rank and size, say). Waits at most `timeout` for `init`; its error
    /// becomes [`CommError::Backend`].
    pub fn spawn<T: Send + 'static>(
        name: &str,
        backend: &'static str,
        timeout: Duration,
        init: impl FnOnce() -> Result<(C, T), String> + Send + 'static,
    ) -> Result<(Self, T), CommError> {
        let (jobs, rx) = mpsc::channel::<Job<C>>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let comm = match init() {
                    Ok((comm, info)) => {
                        let _ = ready_tx.send(Ok(info));
                        comm
                    }
                    Err(reason) => {
                        let _ = ready_tx.send(Err(reason));
                        return;
                    }
                };
                for job in rx {
                    job(&comm);
                }
            })
            .map_err(|_| CommError::ThreadLost)?;
        let info = match ready_rx.recv_timeout(timeout) {
            Ok(Ok(info)) => info,
            Ok(Err(reason)) => return Err(backend_error(reason)),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(CommError::SetupTimeout {
                    backend,
                    waited: timeout,
                })
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(CommError::ThreadLost),
        };
        Ok((
            TimedWorker {
                backend,
                timeout,
                jobs: Some(jobs),
                thread: Some(thread),
                failed: None,
                stuck: false,
            },
            info,
        ))
    }

    /// The time-out of one operation.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Run `f` (operation `op`) on the worker and wait at most the time-out for it. An `Err`
    /// from `f` is the backend's reason: [`CommError::Backend`], and the worker is failed.
    pub fn call<R, F>(&mut self, op: CommKind, f: F) -> Result<R, CommError>
    where
        R: Send + 'static,
        F: FnOnce(&C) -> Result<R, String> + Send + 'static,
    {
        if let Some(reason) = &self.failed {
            return Err(CommError::GroupFailed {
                reason: reason.clone(),
            });
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let jobs = self.jobs.as_ref().ok_or(CommError::ThreadLost)?;
        jobs.send(Box::new(move |comm| {
            let _ = tx.send(f(comm));
        }))
        .map_err(|_| CommError::ThreadLost)?;
        let start = Instant::now();
        match rx.recv_timeout(self.timeout) {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(reason)) => {
                self.failed = Some(reason.clone());
                Err(backend_error(reason))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let err = CommError::Timeout {
                    op,
                    waited: start.elapsed(),
                    missing: Vec::new(),
                };
                self.failed = Some(err.to_string());
                self.stuck = true;
                Err(err)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                self.failed = Some(format!("the {} worker thread died", self.backend));
                Err(CommError::ThreadLost)
            }
        }
    }

    /// After a time-out: wait up to `limit` for the operation that timed out to finish after
    /// all (a late peer arriving), so that the communicator can be dropped — and the backend
    /// shut down — without a thread still inside it. Returns whether the worker is idle. It
    /// stays failed either way.
    pub fn wait_idle(&mut self, limit: Duration) -> bool {
        if !self.stuck {
            return true;
        }
        let (tx, rx) = mpsc::channel();
        let Some(jobs) = &self.jobs else {
            return false;
        };
        if jobs
            .send(Box::new(move |_| {
                let _ = tx.send(());
            }))
            .is_err()
        {
            return false;
        }
        let idle = rx.recv_timeout(limit).is_ok();
        self.stuck = !idle;
        idle
    }
}

impl<C: 'static> Drop for TimedWorker<C> {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            // A thread stuck in a call that never completes would block forever.
            if !self.stuck {
                let _ = thread.join();
            }
        }
    }
}

fn backend_error(reason: String) -> CommError {
    CommError::Backend {
        source: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_run_on_the_worker_and_a_slow_one_fails_the_worker() {
        let (mut w, info) =
            TimedWorker::spawn("test-worker", "test", Duration::from_millis(200), || {
                Ok((7u32, "ready"))
            })
            .unwrap();
        assert_eq!(info, "ready");
        assert_eq!(w.call(CommKind::Barrier, |c| Ok(*c + 1)).unwrap(), 8);
        let slow = w.call(CommKind::AllReduce, |_| {
            std::thread::sleep(Duration::from_millis(600));
            Ok(())
        });
        assert!(matches!(
            slow,
            Err(CommError::Timeout {
                op: CommKind::AllReduce,
                ..
            })
        ));
        // Failed for good, with the first reason; the late call still finishes.
        assert!(matches!(
            w.call(CommKind::Barrier, |_| Ok(())),
            Err(CommError::GroupFailed { .. })
        ));
        assert!(w.wait_idle(Duration::from_secs(5)));
    }

    #[test]
    fn a_backend_error_fails_the_worker_and_init_errors_are_typed() {
        let (mut w, ()) = TimedWorker::spawn("test-worker", "test", Duration::from_secs(5), || {
            Ok((0u8, ()))
        })
        .unwrap();
        let e = w.call::<(), _>(CommKind::Broadcast, |_| Err("peer lost".into()));
        assert!(matches!(e, Err(CommError::Backend { .. })));
        match w.call(CommKind::Barrier, |_| Ok(())) {
            Err(CommError::GroupFailed { reason }) => assert_eq!(reason, "peer lost"),
            other => panic!("{other:?}"),
        }
        let e = TimedWorker::<u8>::spawn("test-worker", "test", Duration::from_secs(5), || {
            Err::<(u8, ()), _>("no device".into())
        });
        assert!(matches!(e, Err(CommError::Backend { .. })));
    }

    #[test]
    fn a_set_up_that_outlasts_the_time_out_names_the_group_not_an_operation() {
        let e = TimedWorker::<u8>::spawn("test-worker", "NCCL", Duration::from_millis(100), || {
            std::thread::sleep(Duration::from_millis(400));
            Ok((0u8, ()))
        });
        match e {
            Err(
                err @ CommError::SetupTimeout {
                    backend: "NCCL", ..
                },
            ) => {
                assert!(err.to_string().contains("did not form"), "{err}");
            }
            other => panic!("{other:?}"),
        }
    }
}
