//! [`CountingCollective`]: a wrapper that counts calls and bytes per operation kind.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::collective::{ring_bytes, Buf, BufMut, CommKind};
use crate::error::CommError;
use crate::Collective;

/// Counters shared between a [`CountingCollective`] and whoever reads them (the wrapper
/// usually lives on a communication thread).
#[derive(Debug, Default)]
pub struct CommCounters {
    kinds: [KindCounters; 5],
}

#[derive(Debug, Default)]
struct KindCounters {
    calls: AtomicU64,
    payload: AtomicU64,
    sent: AtomicU64,
    received: AtomicU64,
}

/// Totals of one operation kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KindStats {
    /// Completed calls.
    pub calls: u64,
    /// Bytes of the operation's large buffer (all-reduce buffer, reduce-scatter input,
    /// all-gather output, broadcast buffer), summed over calls.
    pub payload_bytes: u64,
    /// Bytes this rank sent under the ring model of [`ring_bytes`].
    pub sent_bytes: u64,
    /// Bytes this rank received under the ring model.
    pub received_bytes: u64,
}

/// A snapshot of [`CommCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Per kind, indexed by [`CommKind::index`].
    pub kinds: [KindStats; 5],
}

impl CommStats {
    /// The totals of one kind.
    pub fn kind(&self, kind: CommKind) -> KindStats {
        self.kinds[kind.index()]
    }
    /// Bytes sent over all kinds.
    pub fn sent_bytes(&self) -> u64 {
        self.kinds.iter().map(|k| k.sent_bytes).sum()
    }
    /// Bytes received over all kinds.
    pub fn received_bytes(&self) -> u64 {
        self.kinds.iter().map(|k| k.received_bytes).sum()
    }
    /// The counts accumulated since `earlier` (saturating).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut out = *self;
        for (o, e) in out.kinds.iter_mut().zip(&earlier.kinds) {
            o.calls = o.calls.saturating_sub(e.calls);
            o.payload_bytes = o.payload_bytes.saturating_sub(e.payload_bytes);
            o.sent_bytes = o.sent_bytes.saturating_sub(e.sent_bytes);
            o.received_bytes = o.received_bytes.saturating_sub(e.received_bytes);
        }
        out
    }
}

impl CommCounters {
    /// The counts now.
    pub fn snapshot(&self) -> CommStats {
        let mut out = CommStats::default();
        for (o, k) in out.kinds.iter_mut().zip(&self.kinds) {
            *o = KindStats {
                calls: k.calls.load(Ordering::Relaxed),
                payload_bytes: k.payload.load(Ordering::Relaxed),
                sent_bytes: k.sent.load(Ordering::Relaxed),
                received_bytes: k.received.load(Ordering::Relaxed),
            };
        }
        out
    }

    fn record(&self, kind: CommKind, payload: u64, (sent, received): (u64, u64)) {
        let k = &self.kinds[kind.index()];
        k.calls.fetch_add(1, Ordering::Relaxed);
        k.payload.fetch_add(payload, Ordering::Relaxed);
        k.sent.fetch_add(sent, Ordering::Relaxed);
        k.received.fetch_add(received, Ordering::Relaxed);
    }
}

/// Wraps any [`Collective`] and counts what passes through it: calls, payload bytes, and the
/// bytes a ring implementation sends and receives (see [`ring_bytes`]). Only completed calls
/// are counted.
#[derive(Debug)]
pub struct CountingCollective<C> {
    inner: C,
    counters: Arc<CommCounters>,
}

impl<C: Collective> CountingCollective<C> {
    /// Wrap `inner` with fresh counters.
    pub fn new(inner: C) -> Self {
        CountingCollective {
            inner,
            counters: Arc::new(CommCounters::default()),
        }
    }
    /// The counters, to read while the wrapper is elsewhere (on a communication thread).
    pub fn counters(&self) -> Arc<CommCounters> {
        self.counters.clone()
    }
    /// The wrapped collective.
    pub fn into_inner(self) -> C {
        self.inner
    }

    fn count(&self, kind: CommKind, buf_len: usize, dtype: crate::CommDType, is_root: bool) {
        let world = self.inner.world_size();
        let payload = (buf_len as u64).saturating_mul(dtype.size() as u64);
        self.counters.record(
            kind,
            payload,
            ring_bytes(kind, world, buf_len, dtype, is_root),
        );
    }
}

impl<C: Collective> Collective for CountingCollective<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&mut self, buf: BufMut<'_>) -> Result<(), CommError> {
        let (len, dtype) = (buf.len(), buf.dtype());
        self.inner.all_reduce(buf)?;
        self.count(CommKind::AllReduce, len, dtype, false);
        Ok(())
    }
    fn reduce_scatter(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        let (len, dtype) = (input.len(), input.dtype());
        self.inner.reduce_scatter(input, output)?;
        self.count(CommKind::ReduceScatter, len, dtype, false);
        Ok(())
    }
    fn all_gather(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        let (len, dtype) = (output.len(), output.dtype());
        self.inner.all_gather(input, output)?;
        self.count(CommKind::AllGather, len, dtype, false);
        Ok(())
    }
    fn broadcast(&mut self, buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        let (len, dtype) = (buf.len(), buf.dtype());
        self.inner.broadcast(buf, root)?;
        let is_root = self.inner.rank() == root;
        self.count(CommKind::Broadcast, len, dtype, is_root);
        Ok(())
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        self.inner.barrier()?;
        self.count(CommKind::Barrier, 0, crate::CommDType::F32, false);
        Ok(())
    }
}
