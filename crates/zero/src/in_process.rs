//! Ranks as threads of one process, sharing memory: the group for tests and one-machine runs.
//!
//! Every operation is a rendezvous: each rank posts a copy of its input for the operation's
//! sequence number, waits until all ranks have posted, then computes its own output from all
//! posts. Sums are taken in rank order `0, 1, …, N-1` by every rank, so results do not depend
//! on which thread arrived first and are bitwise identical on all ranks and across runs.
//!
//! A rank whose [`InProcessComm`] is dropped (its thread returned or panicked) is marked as
//! gone; a rank waiting for its contribution gets [`CommError::PeerLost`] at once, and a rank
//! that waits longer than the group's time-out for any peer gets [`CommError::Timeout`]. After
//! either, the group is failed and every later operation on any rank returns
//! [`CommError::GroupFailed`] immediately, so no rank can hang on a broken group.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use half::bf16;

use crate::collective::{check_scatter_gather, Buf, BufMut, CommDType, CommKind};
use crate::error::CommError;
use crate::Collective;

/// Builds the communicators of an in-process group.
#[derive(Clone, Copy, Debug)]
pub struct InProcessGroup;

impl InProcessGroup {
    /// One communicator per rank (index = rank) of a new group of `world` ranks. Hand each to
    /// its own thread. An operation waits at most `timeout` for its peers.
    pub fn create(world: usize, timeout: Duration) -> Result<Vec<InProcessComm>, CommError> {
        if world == 0 {
            return Err(CommError::EmptyGroup);
        }
        let shared = Arc::new(Shared {
            world,
            timeout,
            state: Mutex::new(State {
                rounds: BTreeMap::new(),
                gone: vec![false; world],
                failed: None,
            }),
            changed: Condvar::new(),
        });
        Ok((0..world)
            .map(|rank| InProcessComm {
                shared: shared.clone(),
                rank,
                seq: 0,
            })
            .collect())
    }
}

/// One rank's end of an in-process group. Dropping it tells the other ranks this rank is gone.
#[derive(Debug)]
pub struct InProcessComm {
    shared: Arc<Shared>,
    rank: usize,
    seq: u64,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug)]
struct State {
    rounds: BTreeMap<u64, Round>,
    gone: Vec<bool>,
    failed: Option<String>,
}

#[derive(Debug)]
struct Round {
    posts: Vec<Option<Arc<Post>>>,
    posted: usize,
    taken: usize,
}

/// What a rank posts: its operation's signature (to detect disagreement) and its data.
#[derive(Debug)]
struct Post {
    key: OpKey,
    data: Payload,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct OpKey {
    kind: CommKind,
    dtype: Option<CommDType>,
    /// Length of the buffer whose size all ranks must agree on.
    len: usize,
    root: usize,
}

#[derive(Debug)]
enum Payload {
    None,
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

impl Payload {
    fn from_buf(buf: Buf<'_>) -> Payload {
        match buf {
            Buf::F32(s) => Payload::F32(s.to_vec()),
            Buf::Bf16(s) => Payload::Bf16(s.to_vec()),
        }
    }
}

fn lock(shared: &Shared) -> Result<MutexGuard<'_, State>, CommError> {
    shared.state.lock().map_err(|_| CommError::Poisoned)
}

impl InProcessComm {
    /// The group's time-out for one operation.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// Post this rank's part of the next operation and return every rank's post, in rank
    /// order, once all have arrived.
    fn exchange(&mut self, key: OpKey, data: Payload) -> Result<Vec<Arc<Post>>, CommError> {
        let op = key.kind;
        let world = self.shared.world;
        let seq = self.seq;
        self.seq += 1;
        let mut state = lock(&self.shared)?;
        if let Some(reason) = &state.failed {
            return Err(CommError::GroupFailed {
                reason: reason.clone(),
            });
        }
        let round = state.rounds.entry(seq).or_insert_with(|| Round {
            posts: vec![None; world],
            posted: 0,
            taken: 0,
        });
        if let Some(slot) = round.posts.get_mut(self.rank) {
            *slot = Some(Arc::new(Post { key, data }));
            round.posted += 1;
        }
        self.shared.changed.notify_all();

        let start = Instant::now();
        let deadline = start + self.shared.timeout;
        loop {
            if let Some(reason) = &state.failed {
                return Err(CommError::GroupFailed {
                    reason: reason.clone(),
                });
            }
            let Some(round) = state.rounds.get_mut(&seq) else {
                // Only the last taker removes a round, and this rank has not taken it.
                return Err(fail(&mut state, &self.shared, CommError::Poisoned));
            };
            if round.posted == world {
                let posts: Vec<Arc<Post>> = round.posts.iter().flatten().cloned().collect();
                round.taken += 1;
                if round.taken == world {
                    state.rounds.remove(&seq);
                }
                if let Some(other) = posts.iter().find(|p| p.key != key) {
                    let detail = format!("this rank {:?}, another {:?}", key, other.key);
                    return Err(fail(
                        &mut state,
                        &self.shared,
                        CommError::Mismatch { op, detail },
                    ));
                }
                return Ok(posts);
            }
            let missing: Vec<usize> = (0..world)
                .filter(|&r| round.posts.get(r).is_some_and(Option::is_none))
                .collect();
            if let Some(&rank) = missing.iter().find(|&&r| state.gone[r]) {
                return Err(fail(
                    &mut state,
                    &self.shared,
                    CommError::PeerLost { op, rank },
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                let err = CommError::Timeout {
                    op,
                    waited: now - start,
                    missing,
                };
                return Err(fail(&mut state, &self.shared, err));
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, deadline - now)
                .map_err(|_| CommError::Poisoned)?
                .0;
        }
    }
}

/// Mark the group failed (so every rank stops) and return the error for this rank.
fn fail(state: &mut State, shared: &Shared, err: CommError) -> CommError {
    if state.failed.is_none() {
        state.failed = Some(err.to_string());
    }
    shared.changed.notify_all();
    err
}

impl Drop for InProcessComm {
    fn drop(&mut self) {
        // A poisoned lock still holds consistent data (no panics happen under it); the other
        // ranks must learn this rank is gone either way.
        let mut state = match self.shared.state.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some(g) = state.gone.get_mut(self.rank) {
            *g = true;
        }
        self.shared.changed.notify_all();
    }
}

fn f32_of(post: &Post) -> &[f32] {
    match &post.data {
        Payload::F32(v) => v,
        _ => &[],
    }
}

fn bf16_of(post: &Post) -> &[u16] {
    match &post.data {
        Payload::Bf16(v) => v,
        _ => &[],
    }
}

/// Lengths agree once the posts' keys matched; zipping keeps a violated invariant from panicking.
fn copy_into<T: Copy>(dst: &mut [T], src: &[T]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s;
    }
}

/// `out[i] = Σ_r src_r[offset + i]` in rank order, starting from rank 0's value.
fn sum_f32(posts: &[Arc<Post>], offset: usize, out: &mut [f32]) {
    let n = out.len();
    for (r, post) in posts.iter().enumerate() {
        let src = f32_of(post).get(offset..offset + n).unwrap_or(&[]);
        if r == 0 {
            copy_into(out, src);
        } else {
            for (o, &s) in out.iter_mut().zip(src) {
                *o += s;
            }
        }
    }
}

fn sum_bf16(posts: &[Arc<Post>], offset: usize, out: &mut [u16]) {
    let n = out.len();
    let mut acc = vec![0.0f32; n];
    for (r, post) in posts.iter().enumerate() {
        let src = bf16_of(post).get(offset..offset + n).unwrap_or(&[]);
        for (a, &s) in acc.iter_mut().zip(src) {
            let x = bf16::from_bits(s).to_f32();
            *a = if r == 0 { x } else { *a + x };
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = bf16::from_f32(a).to_bits();
    }
}

impl Collective for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce(&mut self, buf: BufMut<'_>) -> Result<(), CommError> {
        let key = OpKey {
            kind: CommKind::AllReduce,
            dtype: Some(buf.dtype()),
            len: buf.len(),
            root: 0,
        };
        let posts = self.exchange(key, Payload::from_buf(buf.as_buf()))?;
        match buf {
            BufMut::F32(out) => sum_f32(&posts, 0, out),
            BufMut::Bf16(out) => sum_bf16(&posts, 0, out),
        }
        Ok(())
    }

    fn reduce_scatter(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        let op = CommKind::ReduceScatter;
        let k = check_scatter_gather(op, self.shared.world, &input, &output)?;
        let key = OpKey {
            kind: op,
            dtype: Some(input.dtype()),
            len: input.len(),
            root: 0,
        };
        let posts = self.exchange(key, Payload::from_buf(input))?;
        let offset = self.rank * k;
        match output {
            BufMut::F32(out) => sum_f32(&posts, offset, out),
            BufMut::Bf16(out) => sum_bf16(&posts, offset, out),
        }
        Ok(())
    }

    fn all_gather(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        let op = CommKind::AllGather;
        let k = check_scatter_gather(op, self.shared.world, &input, &output)?;
        let key = OpKey {
            kind: op,
            dtype: Some(input.dtype()),
            len: input.len(),
            root: 0,
        };
        let posts = self.exchange(key, Payload::from_buf(input))?;
        match output {
            BufMut::F32(out) => {
                for (chunk, post) in out.chunks_exact_mut(k.max(1)).zip(&posts) {
                    copy_into(chunk, f32_of(post));
                }
            }
            BufMut::Bf16(out) => {
                for (chunk, post) in out.chunks_exact_mut(k.max(1)).zip(&posts) {
                    copy_into(chunk, bf16_of(post));
                }
            }
        }
        Ok(())
    }

    fn broadcast(&mut self, buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        let op = CommKind::Broadcast;
        let world = self.shared.world;
        if root >= world {
            return Err(CommError::InvalidRoot { op, root, world });
        }
        let key = OpKey {
            kind: op,
            dtype: Some(buf.dtype()),
            len: buf.len(),
            root,
        };
        let data = if self.rank == root {
            Payload::from_buf(buf.as_buf())
        } else {
            Payload::None
        };
        let posts = self.exchange(key, data)?;
        if self.rank != root {
            if let Some(src) = posts.get(root) {
                match buf {
                    BufMut::F32(out) => copy_into(out, f32_of(src)),
                    BufMut::Bf16(out) => copy_into(out, bf16_of(src)),
                }
            }
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let key = OpKey {
            kind: CommKind::Barrier,
            dtype: None,
            len: 0,
            root: 0,
        };
        self.exchange(key, Payload::None).map(|_| ())
    }
}
