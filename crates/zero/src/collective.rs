//! The [`Collective`] trait: what ZeRO needs from a distributed engine, and nothing more.
//!
//! Buffers are host slices of f32 or of bf16 bit patterns (`u16`). Every rank of a group must
//! call the same operations in the same order with the same sizes (as with MPI and NCCL);
//! implementations detect a disagreement where they can and report it as
//! [`CommError::Mismatch`] rather than exchanging garbage.

use std::fmt;

use crate::error::CommError;

/// The kinds of collective operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CommKind {
    /// Every rank ends with the elementwise sum of all ranks' buffers.
    AllReduce,
    /// Input of `world × k` elements; rank `r` ends with the sum of every rank's chunk `r`.
    ReduceScatter,
    /// Input of `k` elements; every rank ends with all ranks' inputs concatenated in rank order.
    AllGather,
    /// Every rank ends with the root's buffer.
    Broadcast,
    /// No data; returns once every rank has entered.
    Barrier,
}

impl CommKind {
    /// Every kind, in report order.
    pub const ALL: [CommKind; 5] = [
        CommKind::AllReduce,
        CommKind::ReduceScatter,
        CommKind::AllGather,
        CommKind::Broadcast,
        CommKind::Barrier,
    ];

    /// Position in [`CommKind::ALL`].
    pub const fn index(self) -> usize {
        match self {
            CommKind::AllReduce => 0,
            CommKind::ReduceScatter => 1,
            CommKind::AllGather => 2,
            CommKind::Broadcast => 3,
            CommKind::Barrier => 4,
        }
    }

    /// Short snake-case name.
    pub const fn name(self) -> &'static str {
        match self {
            CommKind::AllReduce => "all_reduce",
            CommKind::ReduceScatter => "reduce_scatter",
            CommKind::AllGather => "all_gather",
            CommKind::Broadcast => "broadcast",
            CommKind::Barrier => "barrier",
        }
    }
}

impl fmt::Display for CommKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Element type of a collective buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommDType {
    /// IEEE f32.
    F32,
    /// bfloat16, carried as its `u16` bit pattern.
    Bf16,
}

impl CommDType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            CommDType::F32 => 4,
            CommDType::Bf16 => 2,
        }
    }
}

/// A read-only collective buffer.
#[derive(Clone, Copy, Debug)]
pub enum Buf<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// bf16 elements as bit patterns.
    Bf16(&'a [u16]),
}

impl Buf<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Buf::F32(s) => s.len(),
            Buf::Bf16(s) => s.len(),
        }
    }
    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element type.
    pub fn dtype(&self) -> CommDType {
        match self {
            Buf::F32(_) => CommDType::F32,
            Buf::Bf16(_) => CommDType::Bf16,
        }
    }
}

/// A writable collective buffer.
#[derive(Debug)]
pub enum BufMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// bf16 elements as bit patterns.
    Bf16(&'a mut [u16]),
}

impl<'a> Buf<'a> {
    /// The elements in `range`; `None` if it is out of bounds.
    pub fn get(&self, range: std::ops::Range<usize>) -> Option<Buf<'a>> {
        match *self {
            Buf::F32(s) => s.get(range).map(Buf::F32),
            Buf::Bf16(s) => s.get(range).map(Buf::Bf16),
        }
    }
}

impl BufMut<'_> {
    /// The elements in `range`, mutably; `None` if it is out of bounds.
    pub fn get_mut(&mut self, range: std::ops::Range<usize>) -> Option<BufMut<'_>> {
        match self {
            BufMut::F32(s) => s.get_mut(range).map(BufMut::F32),
            BufMut::Bf16(s) => s.get_mut(range).map(BufMut::Bf16),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            BufMut::F32(s) => s.len(),
            BufMut::Bf16(s) => s.len(),
        }
    }
    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element type.
    pub fn dtype(&self) -> CommDType {
        match self {
            BufMut::F32(_) => CommDType::F32,
            BufMut::Bf16(_) => CommDType::Bf16,
        }
    }
    /// A read-only view of the same elements.
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            BufMut::F32(s) => Buf::F32(s),
            BufMut::Bf16(s) => Buf::Bf16(s),
        }
    }
}

impl<'a> From<&'a [f32]> for Buf<'a> {
    fn from(s: &'a [f32]) -> Self {
        Buf::F32(s)
    }
}
impl<'a> From<&'a [u16]> for Buf<'a> {
    fn from(s: &'a [u16]) -> Self {
        Buf::Bf16(s)
    }
}
impl<'a> From<&'a mut [f32]> for BufMut<'a> {
    fn from(s: &'a mut [f32]) -> Self {
        BufMut::F32(s)
    }
}
impl<'a> From<&'a mut [u16]> for BufMut<'a> {
    fn from(s: &'a mut [u16]) -> Self {
        BufMut::Bf16(s)
    }
}

/// A group of ranks exchanging data: the one trait ZeRO needs from MPI, NCCL or the
/// in-process group.
///
/// All operations block until this rank's part is done. Sums of f32 are taken in rank order
/// `0, 1, …, world-1` by implementations that can guarantee it (the in-process group does;
/// see its docs); sums of bf16 accumulate in f32 and round once to nearest-even. For the
/// overlapped variants, run a collective on a [`CommThread`](crate::CommThread).
///
/// Every error is final for the group (see [`CommError`]); an implementation must return an
/// error, not hang, when a peer is gone.
pub trait Collective: Send {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// Replace `buf` on every rank with the elementwise sum over ranks.
    fn all_reduce(&mut self, buf: BufMut<'_>) -> Result<(), CommError>;
    /// `input` has `world × k` elements and `output` `k`; rank `r`'s output is the sum over
    /// ranks of their input chunk `r` (elements `r·k .. (r+1)·k`).
    fn reduce_scatter(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError>;
    /// `input` has `k` elements and `output` `world × k`; every rank's output is all inputs
    /// concatenated in rank order.
    fn all_gather(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError>;
    /// Every rank's `buf` becomes the root's.
    fn broadcast(&mut self, buf: BufMut<'_>, root: usize) -> Result<(), CommError>;
    /// Return once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<(), CommError>;
}

impl<C: Collective + ?Sized> Collective for Box<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn all_reduce(&mut self, buf: BufMut<'_>) -> Result<(), CommError> {
        (**self).all_reduce(buf)
    }
    fn reduce_scatter(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        (**self).reduce_scatter(input, output)
    }
    fn all_gather(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        (**self).all_gather(input, output)
    }
    fn broadcast(&mut self, buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        (**self).broadcast(buf, root)
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        (**self).barrier()
    }
}

/// Check the buffer lengths and dtypes of a reduce-scatter or all-gather for `world` ranks;
/// implementations call this before exchanging anything. Returns the per-rank chunk length.
pub fn check_scatter_gather(
    op: CommKind,
    world: usize,
    input: &Buf<'_>,
    output: &BufMut<'_>,
) -> Result<usize, CommError> {
    if input.dtype() != output.dtype() {
        return Err(CommError::DTypeMismatch { op });
    }
    let (small, big, big_what) = match op {
        CommKind::AllGather => (input.len(), output.len(), "output"),
        _ => (output.len(), input.len(), "input"),
    };
    let expected = small.checked_mul(world).ok_or(CommError::Length {
        op,
        what: big_what,
        expected: usize::MAX,
        got: big,
    })?;
    if big != expected {
        return Err(CommError::Length {
            op,
            what: big_what,
            expected,
            got: big,
        });
    }
    Ok(small)
}

/// Bytes one rank sends and receives for one operation under the ring algorithms NCCL and
/// MPI use for large messages (the "bus bandwidth" model of nccl-tests): all-reduce moves
/// `2(N-1)/N` of the buffer each way, reduce-scatter and all-gather `(N-1)/N` of the large
/// side, broadcast the buffer once into every non-root rank (the root only sends).
///
/// `elements` is the buffer length (for reduce-scatter the input, for all-gather the output).
/// Returns `(sent, received)`.
pub fn ring_bytes(
    kind: CommKind,
    world: usize,
    elements: usize,
    dtype: CommDType,
    is_root: bool,
) -> (u64, u64) {
    let n = world.max(1) as u128;
    let bytes = elements as u128 * dtype.size() as u128;
    let to_u64 = |x: u128| u64::try_from(x).unwrap_or(u64::MAX);
    match kind {
        CommKind::AllReduce => {
            let b = to_u64(2 * (n - 1) * bytes / n);
            (b, b)
        }
        CommKind::ReduceScatter | CommKind::AllGather => {
            let b = to_u64((n - 1) * bytes / n);
            (b, b)
        }
        CommKind::Broadcast => {
            if n == 1 {
                (0, 0)
            } else if is_root {
                (to_u64(bytes), 0)
            } else {
                (0, to_u64(bytes))
            }
        }
        CommKind::Barrier => (0, 0),
    }
}

/// Plain references of the collectives over every rank's buffer, for tests of
/// implementations. Sums are in rank order. Inputs are one buffer per rank, all of one length
/// (elements missing from a shorter buffer count as zero).
pub mod reference {
    use half::bf16;

    /// Elementwise sum over ranks, in rank order.
    pub fn all_reduce_f32(inputs: &[Vec<f32>]) -> Vec<f32> {
        let len = inputs.first().map_or(0, Vec::len);
        (0..len)
            .map(|i| {
                inputs
                    .iter()
                    .map(|v| v.get(i).copied().unwrap_or(0.0))
                    .reduce(|a, b| a + b)
                    .unwrap_or(0.0)
            })
            .collect()
    }

    /// Elementwise sum over ranks of bf16 bit patterns: f32 accumulation in rank order, one
    /// rounding to nearest-even at the end.
    pub fn all_reduce_bf16(inputs: &[Vec<u16>]) -> Vec<u16> {
        let as_f32: Vec<Vec<f32>> = inputs
            .iter()
            .map(|v| v.iter().map(|&b| bf16::from_bits(b).to_f32()).collect())
            .collect();
        all_reduce_f32(&as_f32)
            .into_iter()
            .map(|x| bf16::from_f32(x).to_bits())
            .collect()
    }

    /// Rank `rank`'s output of a reduce-scatter.
    pub fn reduce_scatter_f32(inputs: &[Vec<f32>], rank: usize) -> Vec<f32> {
        let k = inputs.first().map_or(0, Vec::len) / inputs.len().max(1);
        let chunks: Vec<Vec<f32>> = inputs
            .iter()
            .map(|v| v.get(rank * k..(rank + 1) * k).unwrap_or(&[]).to_vec())
            .collect();
        all_reduce_f32(&chunks)
    }

    /// Rank `rank`'s output of a bf16 reduce-scatter.
    pub fn reduce_scatter_bf16(inputs: &[Vec<u16>], rank: usize) -> Vec<u16> {
        let k = inputs.first().map_or(0, Vec::len) / inputs.len().max(1);
        let chunks: Vec<Vec<u16>> = inputs
            .iter()
            .map(|v| v.get(rank * k..(rank + 1) * k).unwrap_or(&[]).to_vec())
            .collect();
        all_reduce_bf16(&chunks)
    }

    /// The output of an all-gather: inputs concatenated in rank order.
    pub fn all_gather<T: Copy>(inputs: &[Vec<T>]) -> Vec<T> {
        inputs.iter().flatten().copied().collect()
    }
}
